-- Deferred initialisation at N ranks (tests/recipes/dist_meta.sh): a model built on meta,
-- wrapped and materialized holds exactly (bitwise) the values of the same model built eagerly
-- with the same seed, whatever the world size.
--   * without init_fn: each rank's shard slices, read directly (no gather), equal the eager
--     parameters' elements there; materializing communicates nothing but the one agreement
--     all_reduce and gathers nothing (no all_gather, gathered memory unchanged)
--   * a module with its own reset_parameters runs it on its gathered unit, in an eager build's
--     order (a parent's write into its child's weight is overwritten by the child's reset)
--   * wrap{init = fn}: equals fsdp.materialize(plain meta model, fn); gathered memory stays at
--     the largest unit one module needs
--   * strategies full, grad_op and none: wrap{init = true} and an init_fn calling
--     reset_parameters give the eager model's outputs
--   fsdprun -n N tests/dist/meta_equal.lua
local fsdp = require "fsdp"
require "fsdp.meta" -- fsdp.meta, materialize, ties (until fsdp's lazy loader lists them)
local meta = require "fsdp.meta"
local nn = fsdp.nn
local core = fsdp.core
local W, rank = fsdp.world_size(), fsdp.rank()

local C = dofile("tests/dist/common.lua")
local check = C.check

local flat = C.flat

-- a module whose reset_parameters is its own (b is filled directly, not from a record)
local Scaled = nn.Module:extend("Scaled")
function Scaled:init(n)
  self.w = nn.new_param{n, n}
  self.b = nn.new_param{n}
end
function Scaled:reset_parameters()
  self:init_param("w", "uniform", -2, 2)
  if self.b.has_data then self.b:fill(0.5) end
end
function Scaled:forward(x) return fsdp.F.linear(x, self.w, self.b) end

local ParentInit = nn.Module:extend("ParentInit")
function ParentInit:init() self.lin = nn.Linear(4, 4); self.scale = nn.new_param{4} end
function ParentInit:reset_parameters()
  self:init_param("scale", "constant", 2)
  if self.lin.weight.has_data then self.lin.weight:fill(0.5) end
end
function ParentInit:forward(x) return self.lin(x) * self.scale end

local cases = {
  {name = "gpt tied", build = function()
    return nn.GPT{vocab = 29, ctx = 8, d = 16, layers = 3, heads = 2}
  end, policy = function() return fsdp.policy.modules{nn.Block} end},
  {name = "gpt untied", build = function()
    return nn.GPT{vocab = 29, ctx = 8, d = 16, layers = 2, heads = 2, tie = false}
  end, policy = function()
    return function(mod, _, numel) return numel >= 500 and not nn.isinstance(mod, nn.ModuleList) end
  end},
  {name = "custom reset", build = function()
    return nn.Sequential{nn.Linear(7, 9), Scaled(9), nn.LayerNorm(9), Scaled(9)}
  end, policy = function(m) return fsdp.policy.list{m[2], m[4]} end, gathers = 2},
  -- a reset_parameters that also writes its child's weight: an eager build resets in
  -- pre-order, so the child's own reset wins (in the parent's unit, or in its own unit filled
  -- without a gather)
  {name = "parent init", build = function()
    return nn.Sequential{nn.Linear(4, 4), ParentInit(), nn.LayerNorm(4)}
  end, policy = function(m) return fsdp.policy.list{m[2]} end, gathers = 1},
  {name = "parent init, child unit", build = function()
    return nn.Sequential{nn.Linear(4, 4), ParentInit(), nn.LayerNorm(4)}
  end, policy = function(m) return fsdp.policy.list{m[2].lin} end, gathers = 1},
}

for ci, case in ipairs(cases) do
  local seed = 100 + ci
  fsdp.manual_seed(seed)
  local eager = case.build()
  local ref = {}
  for path, p in eager:named_parameters() do ref[path] = flat(p) end

  fsdp.manual_seed(seed)
  local m = fsdp.meta(case.build)
  fsdp.wrap(m, {policy = case.policy(m)})
  fsdp.reset_comm_stats()
  core.reset_peak()
  local g0 = fsdp.memory().devices.cpu.gathered or 0
  fsdp.materialize(m)
  local st = fsdp.comm_stats()
  if not case.gathers then
    check(st.all_gather_calls == 0, case.name .. ": materialize gathered nothing (all_gather calls "
      .. st.all_gather_calls .. ")")
    check((fsdp.memory().devices.cpu.peak_gathered or 0) == g0, case.name .. ": no gathered memory")
    check(st.all_reduce_calls == (W > 1 and 1 or 0), case.name .. ": one agreement all_reduce, got "
      .. st.all_reduce_calls)
  else
    check(st.all_gather_calls == case.gathers, case.name .. ": each custom module's unit "
      .. "gathered once (" .. case.gathers .. ", got " .. st.all_gather_calls .. ")")
  end
  -- this rank's slices, straight from the shards
  local checked = 0
  for _, u in ipairs(fsdp.units(m)) do
    local shard = flat(u:shard())
    for _, s in ipairs(u:local_slices()) do
      local want = ref[s.path]
      local same = true
      for k = 0, s.shard_last - s.shard_first do
        if shard[s.shard_first + k] ~= want[s.param_first + k] then same = false break end
      end
      check(same, ("%s: rank %d's slice of %s equals the eager values"):format(case.name, rank, s.path))
      checked = checked + 1
    end
  end
  check(fsdp.all_reduce(checked, "sum") >= #eager:parameters(), case.name .. ": every parameter checked")
  -- and gathered, bitwise
  fsdp.full_params(m, function(mm)
    for path, p in mm:named_parameters() do
      local a, b = flat(p), ref[path]
      local same = #a == #b
      for k = 1, #a do if a[k] ~= b[k] then same = false break end end
      check(same, ("%s: %s equals the eager values"):format(case.name, path))
    end
  end)
  if case.name == "gpt tied" then
    check(rawequal(m.head.weight, m.wte.weight), "the tie is one object")
    local x = fsdp.tensor{{1, 2, 3, 4}}
    local a, b = flat(m(x)), flat(eager(x))
    local same = true
    for k = 1, #a do if a[k] ~= b[k] then same = false break end end
    check(same, "the materialized model computes what the eager one does")
  end
end

-- wrap{init = fn} vs fsdp.materialize(plain, fn); gathered memory: one module's units at a time
local function init(mod, path)
  for _, e in ipairs(require("fsdp.nn.module").own_entries(mod)) do
    if nn.is_param(e[2]) then
      core.init_normal(e[2], 77, path .. "." .. tostring(e[1]), 0.1, 0.05)
    end
  end
end
local function build() return nn.GPT{vocab = 29, ctx = 8, d = 16, layers = 3, heads = 2} end
fsdp.manual_seed(9)
local plain = fsdp.meta(build)
fsdp.materialize(plain, init)
fsdp.manual_seed(9)
local m = fsdp.meta(build)
collectgarbage()
core.reset_peak()
local base = fsdp.memory().devices.cpu.gathered or 0 -- earlier models may hold a gathered root
fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}, init = init})
local peak = (fsdp.memory().devices.cpu.peak_gathered or 0) - base
local largest = 0
for _, u in ipairs(fsdp.units(m)) do largest = math.max(largest, u:padded_numel() * 4) end
check(peak > 0 and peak <= largest, ("init_fn: gathered peak %d B <= the largest unit %d B"):format(peak, largest))
fsdp.full_params(m, function(mm)
  local ref = {}
  for path, p in plain:named_parameters() do ref[path] = flat(p) end
  for path, p in mm:named_parameters() do
    local a, b = flat(p), ref[path]
    local same = true
    for k = 1, #a do if a[k] ~= b[k] then same = false break end end
    check(same, "init_fn: " .. path .. " equals the plain materialize")
  end
end)

-- every strategy: wrap{init = true} (records) and wrap{init = fn} calling reset_parameters
fsdp.manual_seed(4)
local eager = build()
local x = fsdp.tensor{{1, 2, 3}}
local ye = flat(eager(x))
for _, strategy in ipairs{"full", "grad_op", "none"} do
  for _, how in ipairs{"records", "reset"} do
    fsdp.manual_seed(4)
    local ms = fsdp.meta(build)
    fsdp.wrap(ms, {policy = fsdp.policy.modules{nn.Block}, strategy = strategy,
      init = how == "records" or function(mod) mod:reset_parameters() end})
    local y = flat(ms(x))
    local same = #y == #ye
    for k = 1, #y do if y[k] ~= ye[k] then same = false break end end
    check(same, ("strategy %s, init by %s: the eager outputs"):format(strategy, how))
  end
end

if rank == 0 then
  print(("meta_equal at %d ranks: %d checks failed"):format(W, C.failures()))
end
if C.failures() > 0 then error(("%d meta_equal checks failed"):format(C.failures())) end
