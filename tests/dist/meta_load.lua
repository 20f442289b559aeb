-- Low-memory loading (tests/recipes/dist_meta.sh): the tensors exist on rank 0 only (a table
-- built in memory, standing in for a checkpoint file), every rank holds a meta model.
--   * wrapped first, then loaded: rank 0 broadcasts one parameter at a time and every rank
--     keeps its slice; values equal the table's everywhere, the meta parameters stop waiting,
--     and no rank holds more than its shards plus one parameter (no gathered memory at all)
--   * loaded on rank 0 into its plain meta model, then wrap{sync_module_states = true}
--   * a tie: a table holding only wte.weight fills head.weight too; one holding both names
--     with different values loads the first path's and rank 0 says so
--   * a table missing a name (strict) is the same error on every rank; tables on some ranks
--     only (not rank 0 alone, not all) are an error
--   fsdprun -n N tests/dist/meta_load.lua
local fsdp = require "fsdp"
require "fsdp.meta"
local meta = require "fsdp.meta"
local nn = fsdp.nn
local core = fsdp.core
local W, rank = fsdp.world_size(), fsdp.rank()

local C = dofile("tests/dist/common.lua")
local check = C.check

local flat = C.flat
local same = C.same

local cfg = {vocab = 40, ctx = 8, d = 16, layers = 3, heads = 2}
local function build() return nn.GPT(cfg) end

-- the reference values: every rank can rebuild them (small), only rank 0 passes a table
fsdp.manual_seed(33)
local ref = build()
local refp = {}
for path, p in ref:named_parameters() do refp[path] = flat(p) end
local function table_of(with_head)
  local t = {}
  for path, p in ref:named_parameters() do t[path] = p:clone() end
  if with_head then t["head.weight"] = ref.wte.weight:clone() end
  return t
end

local function holds_ref(model, what)
  fsdp.full_params(model, function(m)
    for path, p in m:named_parameters() do
      check(same(flat(p), refp[path]), what .. ": " .. path .. " holds the table's values")
    end
  end)
end

local function capture(fn)
  local log = require "fsdp.log"
  local saved = log.print
  local notes = {}
  log.print = function(...) notes[#notes + 1] = table.concat({...}, " ") end
  local ok, err = pcall(fn)
  log.print = saved
  if not ok then error(err, 0) end
  return notes
end

-- 1. wrap the meta model, then load from rank 0's table
fsdp.manual_seed(99)
local m = fsdp.meta(build)
fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
check(not pcall(m, fsdp.tensor{{1, 2}}), "a forward before loading is refused")
collectgarbage()
core.reset_peak()
local before = fsdp.memory().devices.cpu
local res = meta.load_tensors(m, rank == 0 and table_of(false) or nil)
local after = fsdp.memory().devices.cpu
check(res.loaded == #m:parameters(), "every parameter loaded (" .. res.loaded .. ")")
check((after.peak_gathered or 0) == (before.gathered or 0), "loading gathered nothing")
local largest_param = 0
for _, p in ipairs(m:parameters()) do largest_param = math.max(largest_param, p:numel() * 4) end
if rank ~= 0 then
  local extra = (after.peak_activations or 0) - (before.activations or 0)
  -- (+ 1 KiB: the agreement's and the plan's few small tensors)
  check(extra <= largest_param + 1024, ("a receiving rank held at most one parameter (%d B <= %d B + 1 KiB)")
    :format(extra, largest_param))
end
holds_ref(m, "wrapped then loaded")
check(rawequal(m.head.weight, m.wte.weight), "the tie is one object after loading")
local y = m(fsdp.tensor{{1, 2, 3}})
check(same(flat(y), flat(ref(fsdp.tensor{{1, 2, 3}}))), "the loaded model computes the table's function")

-- 2. rank 0 loads into its plain meta model; sync gives everyone its values
local m2 = fsdp.meta(build)
if rank == 0 then meta.load_tensors(m2, table_of(false)) end
check((rank == 0) == (m2.wte.weight.device == "cpu"), "only rank 0 holds values before syncing")
fsdp.wrap(m2, {policy = fsdp.policy.modules{nn.Block}, sync_module_states = true})
holds_ref(m2, "loaded on rank 0, synced")

-- 3. ties in the table: both names with different values are an error on every rank naming
-- them; with equal values they load as one object
local t3
if rank == 0 then
  t3 = table_of(true)
  t3["head.weight"]:fill(0.125)
end
local m3 = fsdp.meta(build)
fsdp.wrap(m3, {policy = fsdp.policy.modules{nn.Block}})
local ok3, err3 = pcall(meta.load_tensors, m3, t3)
err3 = tostring(err3)
check(not ok3 and err3:find("'wte.weight' and 'head.weight' hold one tied parameter", 1, true) ~= nil
  and err3:find("different values", 1, true) ~= nil, "tied copies that differ: an error naming them: " .. err3)
if rank ~= 0 then
  check(err3:find("failed on rank 0", 1, true) ~= nil, "the other ranks name rank 0: " .. err3)
end
check(not pcall(m3, fsdp.tensor{{1}}), "nothing loaded: the model still waits for values")
if rank == 0 then t3["head.weight"]:copy(t3["wte.weight"]) end
local notes = capture(function() meta.load_tensors(m3, t3) end)
check(#notes == 0, "equal tied copies load without a note: " .. tostring(notes[1]))
holds_ref(m3, "both tied names")
check(rawequal(m3.head.weight, m3.wte.weight), "the tie is one object")

-- 4. errors on every rank
local m4 = fsdp.meta(build)
fsdp.wrap(m4, {policy = fsdp.policy.modules{nn.Block}})
local t4
if rank == 0 then
  t4 = table_of(false)
  t4["ln_f.bias"] = nil
end
local ok, err = pcall(meta.load_tensors, m4, t4)
check(not ok and tostring(err):find("no tensor for ln_f.bias", 1, true) ~= nil,
  "a missing tensor on rank 0 is an error naming it on every rank: " .. tostring(err))
if rank ~= 0 then
  check(tostring(err):find("failed on rank 0", 1, true) ~= nil, "the other ranks name rank 0")
end
local partial = meta.load_tensors(m4, t4, {strict = false})
check(partial.loaded == #m4:parameters() - 1, "strict = false loads the rest")
check(not pcall(m4, fsdp.tensor{{1}}), "the parameter still missing keeps the model from running")
if W > 2 then
  ok, err = pcall(meta.load_tensors, m4, rank < 2 and table_of(false) or nil)
  check(not ok and tostring(err):find("on rank 0 only", 1, true) ~= nil,
    "tables on ranks 0 and 1 only: an error: " .. tostring(err))
end

if rank == 0 then print(("meta_load at %d ranks: %d checks failed"):format(W, C.failures())) end
if C.failures() > 0 then error(("%d meta_load checks failed"):format(C.failures())) end
