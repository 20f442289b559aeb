-- Shards at N ranks (tests/recipes/dist_shards.sh): what world-size-1 specs cannot show.
--   * fsdp.shard(p) on every rank: the slices tile the parameter exactly (sizes add up, and
--     their values, gathered by all_reduce, rebuild it); u:layout() agrees with the shards
--   * fsdp.apply writes rank-dependent-free changes back into every rank's shard
--   * sync_module_states = true: ranks that built different values all hold rank 0's
--   * the sharded optimizer state covers each parameter exactly once across the ranks
--   * models that differ across ranks: an error naming the parameter, the model left plain
--   fsdprun -n N tests/dist/shards.lua
local fsdp = require "fsdp"
local nn = fsdp.nn
local W, rank = fsdp.world_size(), fsdp.rank()

local C = dofile("tests/dist/common.lua")
local check = C.check

fsdp.manual_seed(11)
local model = nn.GPT{vocab = 24, ctx = 8, d = 16, layers = 2, heads = 2}
local dense = {}
for path, p in model:named_parameters() do dense[path] = p:clone() end
fsdp.wrap(model, {policy = fsdp.policy.modules{nn.Block}})

-- slices tile each parameter; values rebuild it
for path, p in model:named_parameters() do
  local s = fsdp.shard(p)
  local n = fsdp.all_reduce(s:numel(), "sum")
  check(n == p:numel(), ("%s: shard sizes add up to %d, not %d"):format(path, n, p:numel()))
  local u = fsdp.core.param_unit(p)
  local rebuilt = fsdp.zeros{p:numel()}
  for _, l in ipairs(u:layout()) do
    if l.path == path then
      local mine = l.slices[rank]
      check((mine and (mine[2] - mine[1] + 1) or 0) == s:numel(), path .. ": layout slice size")
      if mine then rebuilt:narrow(1, mine[1], mine[2] - mine[1] + 1):copy(s) end
    end
  end
  fsdp.all_reduce(rebuilt, "sum")
  local a, b = rebuilt:totable(), dense[path]:view{p:numel()}:totable()
  local same = true
  for k = 1, #b do if a[k] ~= b[k] then same = false break end end
  check(same, path .. ": the shards rebuild the parameter")
end

-- apply: change every Linear's bias to 0.25 on every rank; full_params sees it
fsdp.apply(model, function(m)
  if nn.isinstance(m, nn.Linear) and m.bias then m.bias:fill(0.25) end
end)
fsdp.full_params(model, function(m)
  for path, p in m:named_parameters() do
    if path:match("%.bias$") and not path:match("ln") then
      local lo, hi = p:min(), p:max()
      if type(lo) ~= "number" then lo, hi = lo:item(), hi:item() end
      check(lo == 0.25 and hi == 0.25, path .. ": written back by apply")
    end
  end
end)

-- the optimizer state of each parameter is split across ranks, exactly
local opt = fsdp.optim.AdamW(model, {lr = 1e-3})
local x = fsdp.tensor{{1, 2, 3, 4}}
opt:zero_grad()
nn.F.cross_entropy(model(x), x):backward()
opt:step()
local sd = opt:state_dict()
for path, p in model:named_parameters() do
  local st = sd.state[path]
  local n = fsdp.all_reduce(st and st.exp_avg:numel() or 0, "sum")
  check(n == p:numel(), ("%s: optimizer state covers %d of %d elements"):format(path, n, p:numel()))
end
fsdp.unwrap(model)

-- sync_module_states: each rank builds its own values; after wrapping all hold rank 0's
fsdp.manual_seed(100 + rank)
local m2 = nn.Sequential{nn.Linear(8, 8), nn.Linear(8, 3)}
local mine = m2[2].weight:sum():item()
fsdp.wrap(m2, {sync_module_states = true, policy = fsdp.policy.list{m2[1]}})
local s
fsdp.full_params(m2, function(m) s = m[2].weight:sum():item() end)
local s0 = fsdp.broadcast(s, 0)
check(s == s0, "sync_module_states: every rank holds rank 0's values")
if rank == 0 then check(s == mine, "sync_module_states: rank 0 keeps its own values") end
if W > 1 and rank == 1 then check(s ~= mine, "rank 1 had other values before syncing") end
fsdp.unwrap(m2)

-- invariant 2: ranks that build different models get an error naming the difference, on
-- every rank, and keep a plain, usable model
if W > 1 then
  fsdp.manual_seed(7)
  local d = rank == W - 1 and 6 or 4
  local m3 = nn.Sequential{nn.Linear(4, 4), nn.Sequential{nn.Linear(4, d), nn.Linear(d, 4)}}
  local ok, err = pcall(fsdp.wrap, m3, {policy = fsdp.policy.list{m3[1], m3[2]}})
  check(not ok, "wrapping different models on different ranks fails")
  check(tostring(err):find("differs across ranks", 1, true) ~= nil and
    tostring(err):find("2.1.weight", 1, true) ~= nil, "the error names the parameter: " .. tostring(err))
  check(not fsdp.is_wrapped(m3) and m3[1].weight.device == "cpu", "the model is left plain")
  local y = m3(fsdp.ones{1, 4}) -- usable
  check(y:numel() == 4, "the plain model still runs")
end

if rank == 0 then print(("shards at %d ranks: %d checks failed"):format(W, C.failures())) end
if C.failures() > 0 then error(("%d shard checks failed"):format(C.failures())) end
