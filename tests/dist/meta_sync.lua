-- sync_module_states with meta models on the other ranks (tests/recipes/dist_meta.sh): the
-- accelerate failure's scenario (tied weights split by deferred init): a tied GPT whose real weights exist on
-- rank 0 only (built eagerly there), every other rank holding a meta model, then
-- fsdp.wrap{sync_module_states = true}:
--   * every rank holds rank 0's values (its shards, and gathered: equal to an eager build with
--     rank 0's seed, bitwise), and every rank manages the same tensors: the same number of
--     parameters, of unit parameters, and fsdp.ties reports the one tie on every rank
--   * memory on the meta ranks: parameters peak at the shards plus one unit's dense values
--     (each unit is materialized just before it takes its slices), never the model
--   * a model without any tie (a plain MLP) works the same
--   * rank 0 holding a meta parameter is the same clear error on every rank
--   fsdprun -n N tests/dist/meta_sync.lua
local fsdp = require "fsdp"
require "fsdp.meta"
local nn = fsdp.nn
local core = fsdp.core
local W, rank = fsdp.world_size(), fsdp.rank()

local C = dofile("tests/dist/common.lua")
local check = C.check

local flat = C.flat
local same = C.same
-- the same number on every rank
local function agreed(n) return fsdp.all_reduce(n, "min") == n and fsdp.all_reduce(n, "max") == n end

local cfg = {vocab = 40, ctx = 8, d = 16, layers = 4, heads = 2}
local function build() return nn.GPT(cfg) end

-- rank 0 has the real weights (seed 21); the others build on meta with another seed, so
-- their values can only come from rank 0
local model
if rank == 0 then
  fsdp.manual_seed(21)
  model = build()
else
  fsdp.manual_seed(1000 + rank)
  model = fsdp.meta(build)
end
check(rawequal(model.head.weight, model.wte.weight), "the builder ties head to wte")
collectgarbage()
core.reset_peak()
local p0 = fsdp.memory().devices.cpu.params or 0
fsdp.wrap(model, {policy = fsdp.policy.modules{nn.Block}, sync_module_states = true})
local mem = fsdp.memory().devices.cpu

-- the same tensors everywhere
local nparams = #model:parameters()
check(agreed(nparams), "every rank manages the same number of parameters (" .. nparams .. ")")
local nunit = 0
for _, u in ipairs(fsdp.units(model)) do nunit = nunit + #u:params() end
check(nunit == nparams and agreed(nunit), "every parameter is in exactly one unit, on every rank")
local ties = fsdp.ties(model)
check(#ties == 1 and ties[1].paths[1] == "wte.weight" and ties[1].paths[2] == "head.weight",
  "fsdp.ties reports the tie on every rank")
check(rawequal(ties[1].param, model.wte.weight) and rawequal(model.head.weight, model.wte.weight),
  "the tied parameter is one object")
check(core.param_unit(model.wte.weight).path == "(root)", "the tie belongs to the root unit")

-- the values: rank 0's everywhere
fsdp.manual_seed(21)
local ref = build()
local refp = {}
for path, p in ref:named_parameters() do refp[path] = flat(p) end
fsdp.full_params(model, function(m)
  check(core.same_storage(m.head.weight, m.wte.weight), "one storage for the tie while gathered")
  for path, p in m:named_parameters() do
    check(same(flat(p), refp[path]), path .. " holds rank 0's values")
  end
end)
for _, u in ipairs(fsdp.units(model)) do
  local shard = flat(u:shard())
  for _, s in ipairs(u:local_slices()) do
    local ok = true
    for k = 0, s.shard_last - s.shard_first do
      if shard[s.shard_first + k] ~= refp[s.path][s.param_first + k] then ok = false break end
    end
    check(ok, "rank " .. rank .. "'s slice of " .. s.path .. " is rank 0's")
  end
end

-- memory: a meta rank never held more than the shards and one unit
local shards, largest = 0, 0
for _, u in ipairs(fsdp.units(model)) do
  shards = shards + u:shard_numel() * 4
  largest = math.max(largest, u:numel() * 4)
end
local full = 0
for _, p in ipairs(model:parameters()) do full = full + p:numel() * 4 end
local peak = (mem.peak_params or 0) - p0
if rank ~= 0 then
  check(peak <= shards + largest, ("meta rank: parameter peak %d B <= shards %d B + largest unit %d B")
    :format(peak, shards, largest))
  check(peak < full, ("meta rank: parameter peak %d B below the model's %d B"):format(peak, full))
end
local peaks = fsdp.zeros{W}
peaks:set(rank + 1, peak)
fsdp.all_reduce(peaks, "sum")

-- it trains: one step, and the tie stays one object
local opt = fsdp.optim.SGD(model, {lr = 0.1})
local x = fsdp.tensor{{(rank * 3) % 40, 5, 7, 9}}
nn.F.cross_entropy(model(x), x):backward()
opt:step()
check(rawequal(model.head.weight, model.wte.weight), "still one object after a step")

-- a model without any tie metadata or tie at all
local mlp
if rank == 0 then
  fsdp.manual_seed(5)
  mlp = nn.Sequential{nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3)}
else
  mlp = fsdp.meta(function() return nn.Sequential{nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3)} end)
end
check(#fsdp.ties(mlp) == 0, "no ties in the MLP")
fsdp.wrap(mlp, {sync_module_states = true, policy = fsdp.policy.list{mlp[1]}})
fsdp.manual_seed(5)
local mref = nn.Sequential{nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3)}
local xin = fsdp.ones{2, 6}
check(same(flat(mlp(xin)), flat(mref(xin))), "the synced MLP computes rank 0's function")

-- rank 0 on meta: the same clear error on every rank, nobody hangs
local bad = fsdp.meta(function() return nn.Sequential{nn.Linear(3, 3)} end)
local ok, err = pcall(fsdp.wrap, bad, {sync_module_states = true})
check(not ok and tostring(err):find("rank 0's parameter 1.weight is on the meta device", 1, true) ~= nil,
  "rank 0 on meta is an error naming the parameter: " .. tostring(err))
check(not fsdp.is_wrapped(bad) and bad[1].weight.device == "meta", "the model is left as it was")

if rank == 0 then
  local t = peaks:totable()
  local s = {}
  for r = 1, W do s[r] = ("%d"):format(t[r]) end
  print(("meta_sync at %d ranks: %d checks failed; model %d B, shards %d B/rank, largest unit %d B, "
    .. "parameter peak per rank during wrap: %s B"):format(W, C.failures(), full, shards, largest,
      table.concat(s, ", ")))
end
if C.failures() > 0 then error(("%d meta_sync checks failed"):format(C.failures())) end
