-- tokens_ranks.lua — fsdp.data.tokens across ranks (run by tests/recipes/dist_tokens.sh at 1, 2
-- and 4 ranks on a dataset that `fsdprun tokenize` wrote):
--   * each rank's rows of every step equal its slice of the one-rank global batch (a loader
--     opened with rank = 0, world_size = 1 on the same rank);
--   * rank 0 writes the whole global batches, gathered from every rank's rows, to --out (the
--     script compares the files of 1, 2 and 4 ranks byte for byte);
--   * a loader restored from a sharded checkpoint saved after step AT serves exactly steps
--     AT+1.. of the uninterrupted run.
--   fsdprun -n N tests/dist/tokens_ranks.lua --data=DIR --ckpt=DIR --out=FILE [--seed=S]
local fsdp = require "fsdp"
local C = require "fsdp.collective"
local T = dofile("tests/dist/ckpt_common.lua")
local a = fsdp.args
local B, CTX, STEPS, AT = 8, 16, 12, 5
local seed = tonumber(a.seed) or 11

local L = fsdp.data.tokens(a.data, {ctx = CTX, batch = B, seed = seed})
local ref = fsdp.data.tokens(a.data, {ctx = CTX, batch = B, seed = seed, rank = 0, world_size = 1})
local per = B / T.W

-- world_size without rank keeps this rank's number: past the world it names, it is refused
-- (its rows would lie outside the global batch)
for _, open in ipairs {
  function() return fsdp.data.tokens(a.data, {ctx = CTX, batch = B, world_size = 1}) end,
  function()
    return fsdp.data.text("tests/dist/tokens_ranks.lua", {ctx = 4, batch = 2, world_size = 1})
  end,
} do
  local ok, err = pcall(open)
  if T.rank == 0 then
    T.check(ok, "world_size = 1 on rank 0: " .. tostring(err))
  else
    T.check(not ok and tostring(err):find(("world_size = 1, but this is rank %d: give rank = too")
      :format(T.rank), 1, true) ~= nil, "world_size = 1 without rank on rank " .. T.rank .. ": "
      .. tostring(err))
  end
end

local mine = {} -- mine[step] = this rank's x rows
for step, x, y in L:batches(STEPS) do
  local _, gx, gy = ref:batches(1)()
  local xs, ys, gxs, gys = x:totable(), y:totable(), gx:totable(), gy:totable()
  T.check(#xs == per, "rank rows")
  for i = 1, per do
    local g = T.rank * per + i
    for t = 1, CTX do
      T.check(xs[i][t] == gxs[g][t] and ys[i][t] == gys[g][t],
        ("step %d: rank %d row %d is row %d of the global batch"):format(step, T.rank, i, g))
    end
  end
  mine[step] = xs
end

local all = C.all_gather(mine)
if T.rank == 0 then
  local lines = {}
  for step = 1, STEPS do
    local row = 0
    for r = 1, T.W do
      for _, ids in ipairs(all[r][step]) do
        row = row + 1
        lines[#lines + 1] = ("%d %d %s"):format(step, row, table.concat(ids, " "))
      end
    end
  end
  T.write_file(a.out, table.concat(lines, "\n") .. "\n")
end

-- exact resume through a checkpoint
local L1 = fsdp.data.tokens(a.data, {ctx = CTX, batch = B, seed = seed})
for _ in L1:batches(AT) do end
fsdp.manual_seed(1)
local model = T.wrap(T.gpt(1, {vocab = 64}))
fsdp.save(model, a.ckpt, {loaders = {train = L1}})
local L2 = fsdp.data.tokens(a.data, {ctx = CTX, batch = B, seed = seed})
fsdp.load(model, a.ckpt, {loaders = {train = L2}})
T.check(L2.cursor == AT, "the restored cursor")
for step, x in L2:batches(STEPS - AT) do
  local xs = x:totable()
  for i = 1, per do
    for t = 1, CTX do
      T.check(xs[i][t] == mine[step][i][t], ("resumed step %d row %d"):format(step, i))
    end
  end
end
T.say(("ok: %d ranks: rows are slices of the global batch; resumed at step %d exactly"):format(T.W, AT))
