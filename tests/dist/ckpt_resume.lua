-- ckpt_resume.lua — exact resume (run by tests/recipes/dist_ckpt_resume.sh): a wrapped GPT
-- with dropout (random state), AdamW, a cosine schedule, gradient clipping and a text loader.
--   --mode=full:   train 100 steps, saving a sharded checkpoint after step 50 to --ckpt
--   --mode=resume: a new process loads --ckpt (model, optimizer, schedule, loader position,
--                  random state) and trains the remaining 50 steps
-- Both write (rank 0) the losses of steps 51..100 and the final parameters, every number in
-- %a (exact bits), to --out; the shell script compares the files byte for byte.
--   fsdprun -n N tests/dist/ckpt_resume.lua --mode=full|resume --ckpt=DIR --data=FILE --out=FILE
--     [--rng=false] (resume without the random state: the test shows that this differs)
local fsdp = require "fsdp"
local T = dofile("tests/dist/ckpt_common.lua")
local nn = fsdp.nn
local a = fsdp.args
local STEPS, AT = 100, 50

local seed = a.mode == "full" and 21 or 99 -- the resumed run starts from other values
local model = T.wrap(T.gpt(seed, {vocab = 128, dropout = 0.1}))
local opt = fsdp.optim.AdamW(model, {lr = 3e-3, weight_decay = 0.1})
local sched = fsdp.optim.cosine(opt, {warmup = 10, total = STEPS, min_lr = 3e-4})
local loader = fsdp.data.text(a.data, {ctx = 8, batch = 4, seed = 5})
fsdp.manual_seed(7) -- the random state training starts from (dropout)

local done = 0
if a.mode == "resume" then
  local _, info = fsdp.load(model, a.ckpt, {optimizer = opt, schedule = sched, loaders = {train = loader},
    rng = a.rng ~= false})
  done = info.step
  T.check(done == AT and loader.cursor == AT, "resumed at step 50")
end

local losses = {}
for step, x, y in loader:batches(STEPS - done) do
  sched:step()
  opt:zero_grad()
  local loss = nn.F.cross_entropy(model(x), y)
  loss:backward()
  fsdp.clip_grad_norm(model, 1.0)
  opt:step()
  if step > AT then losses[#losses + 1] = fsdp.all_reduce(loss:item(), "mean") end
  if a.mode == "full" and step == AT then
    fsdp.save(model, a.ckpt, {optimizer = opt, schedule = sched, loaders = {train = loader}, step = step})
  end
end
T.check(#losses == STEPS - AT, "50 losses")

local values = T.values(model)
if T.rank == 0 then
  local lines = {}
  for i, l in ipairs(losses) do lines[#lines + 1] = ("loss %d %a"):format(AT + i, l) end
  local paths = {}
  for p in pairs(values) do paths[#paths + 1] = p end
  table.sort(paths)
  for _, p in ipairs(paths) do
    local v = values[p]
    local parts = {}
    for i = 1, #v do parts[i] = ("%a"):format(v[i]) end
    lines[#lines + 1] = p .. " " .. table.concat(parts, " ")
  end
  T.write_file(a.out, table.concat(lines, "\n") .. "\n")
end
T.say(("ok: %s run at %d ranks, final loss %.6f"):format(a.mode, T.W, losses[#losses]))
