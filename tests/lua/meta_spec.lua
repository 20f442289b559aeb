-- meta_spec.lua — deferred initialisation and ties at world size 1 (lua/fsdp/meta.lua and the
-- parts of lua/fsdp/wrap.lua they touch): fsdp.meta, fsdp.materialize (plain and wrapped,
-- records / custom reset_parameters / init_fn), wrap{init =}, pending meta parameters, the
-- element offset of the init kernels, fsdp.ties, fsdp.retie, ties kept through every step,
-- gradients and optimizer steps of a tied parameter, load_tensors from a table.
-- Multi-rank behaviour (shards, sync_module_states, rank-0 loading, memory cap, cross-rank
-- errors) is in tests/dist/meta_*.lua and ties_*.lua.
-- Run: busted --lua=luajit tests/lua/meta_spec.lua

local fsdp = require "fsdp"
require "fsdp.meta" -- fsdp.meta, materialize, ties, retie (until fsdp's lazy loader lists them)
local meta = require "fsdp.meta"
local nn = fsdp.nn
local core = fsdp.core

local H = require "helpers"
local flat, same_values = H.flat_view, H.same_values_view

-- path -> clone of every parameter (first paths)
local function snapshot(model)
  local out = {}
  for path, p in model:named_parameters() do out[path] = p:clone() end
  return out
end

-- paths of parameters whose values differ from ref's (bitwise)
local function differing(model, ref)
  local bad = {}
  for path, p in model:named_parameters() do
    if ref[path] == nil or not same_values(p, ref[path]) then bad[#bad + 1] = path end
  end
  return bad
end

local cfg = {vocab = 13, ctx = 8, d = 8, layers = 2, heads = 2}

local function eager_gpt(tie, seed)
  fsdp.manual_seed(seed or 3)
  local c = {}
  for k, v in pairs(cfg) do c[k] = v end
  c.tie = tie
  return nn.GPT(c)
end

local function meta_gpt(tie, seed)
  fsdp.manual_seed(seed or 3)
  local c = {}
  for k, v in pairs(cfg) do c[k] = v end
  c.tie = tie
  return fsdp.meta(function() return nn.GPT(c) end)
end

-- a module with its own reset_parameters (not a replay of init records: b is filled directly)
local Scaled = nn.Module:extend("Scaled")
function Scaled:init(n)
  self.w = nn.new_param{n}
  self.b = nn.new_param{n}
end
function Scaled:reset_parameters()
  self:init_param("w", "normal", 0, 3)
  if self.b.has_data then self.b:fill(0.5) end
end
function Scaled:forward(x) return x * self.w + self.b end

local function quiet_notes(fn)
  local log = require "fsdp.log"
  local saved = log.print
  local notes = {}
  log.print = function(...) notes[#notes + 1] = table.concat({...}, " ") end
  local ok, err = pcall(fn)
  log.print = saved
  if not ok then error(err, 0) end
  return notes
end

describe("the init kernels' element offset", function()
  it("fills a slice with exactly the whole fill's values there", function()
    local whole = fsdp.zeros{37}
    core.init_normal(whole, 9, "k", 0.5, 2)
    for _, first in ipairs{0, 1, 2, 3, 5, 16, 30} do
      local part = fsdp.zeros{37 - first}
      core.init_normal(part, 9, "k", 0.5, 2, first)
      assert.is_true(same_values(part, whole:narrow(1, first + 1, 37 - first)), "normal at " .. first)
    end
    local u = fsdp.zeros{21}
    core.init_uniform(u, 9, "k", -1, 3)
    local part = fsdp.zeros{6}
    core.init_uniform(part, 9, "k", -1, 3, 7)
    assert.is_true(same_values(part, u:narrow(1, 8, 6)))
    assert.is_false(pcall(core.init_normal, part, 9, "k", 0, 1, -1))
    assert.is_false(pcall(core.init_normal, part, 9, "k", 0, 1, 1.5))
  end)
end)

describe("fsdp.meta", function()
  it("builds every parameter on the meta device, without parameter memory", function()
    local before = fsdp.memory().params
    local m = meta_gpt(true)
    assert.are.equal(before, fsdp.memory().params)
    for path, p in m:named_parameters() do assert.are.equal("meta", p.device, path) end
    assert.is_true(rawequal(m.head.weight, m.wte.weight))
    -- later constructions are back on the cpu
    assert.are.equal("cpu", nn.Linear(2, 2).weight.device)
  end)

  it("restores the parameter device when the builder fails", function()
    local ok, err = pcall(fsdp.meta, function() error("boom", 0) end)
    assert.is_false(ok)
    assert.are.equal("boom", err)
    assert.are.equal("cpu", nn.Linear(2, 2).weight.device)
    assert.is_false(pcall(fsdp.meta, 3))
  end)

  it("keeps the device of tensors the user passes in", function()
    local m = fsdp.meta(function()
      local s = nn.Sequential{nn.Linear(3, 3)}
      s.extra = nn.Parameter(fsdp.ones{3})
      return s
    end)
    assert.are.equal("meta", m[1].weight.device)
    assert.are.equal("cpu", m.extra.device)
  end)
end)

describe("fsdp.materialize (plain model)", function()
  it("gives exactly the eager values, tied or not", function()
    for _, tie in ipairs{true, false} do
      local ref = snapshot(eager_gpt(tie))
      local m = meta_gpt(tie)
      fsdp.manual_seed(999) -- values depend on the construction's seed, not the current one
      assert.are.equal(m, fsdp.materialize(m))
      assert.are.same({}, differing(m, ref))
      if tie then assert.is_true(rawequal(m.head.weight, m.wte.weight)) end
    end
  end)

  it("runs a module's own reset_parameters", function()
    fsdp.manual_seed(4)
    local eager = nn.Sequential{nn.Linear(4, 4), Scaled(4)}
    fsdp.manual_seed(4)
    local m = fsdp.meta(function() return nn.Sequential{nn.Linear(4, 4), Scaled(4)} end)
    fsdp.materialize(m)
    assert.are.same({}, differing(m, snapshot(eager)))
    assert.are.equal(0.5, m[2].b:get(1))
  end)

  it("with init_fn: called once per module holding a meta parameter, ties kept", function()
    local m = meta_gpt(true)
    local seen = {}
    fsdp.materialize(m, function(mod, path)
      seen[#seen + 1] = path
      for _, e in ipairs(require("fsdp.nn.module").own_entries(mod)) do
        if nn.is_param(e[2]) then e[2]:fill(#path) end
      end
    end)
    assert.are.equal("wte", seen[1])
    local count = {}
    for _, p in ipairs(seen) do count[p] = (count[p] or 0) + 1 end
    for p, n in pairs(count) do assert.are.equal(1, n, p) end
    assert.truthy(count.head) -- head holds the tied parameter too
    assert.is_true(rawequal(m.head.weight, m.wte.weight))
    assert.are.equal(#"head", m.wte.weight:get(1, 1)) -- head came last
    assert.are.equal(#"blocks.1.mlp.fc", m.blocks[1].mlp.fc.weight:get(1, 1))
  end)

  it("refuses an init_fn that replaces a parameter object", function()
    local m = meta_gpt(true)
    local ok, err = pcall(fsdp.materialize, m, function(mod)
      if mod == m.head then mod.weight = nn.Parameter(fsdp.zeros{cfg.vocab, cfg.d}) end
    end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("replaced parameter head.weight", 1, true), err)
    -- the error put the original back: the tie is whole, no parameter was added
    assert.is_true(rawequal(m.head.weight, m.wte.weight))
    assert.are.equal(#meta_gpt(true):parameters(), #m:parameters())
    -- the same through wrap{init = ...}: the failed wrap leaves the model plain
    local w = meta_gpt(true)
    ok, err = pcall(fsdp.wrap, w, {policy = fsdp.policy.modules{nn.Block}, init = function(mod)
      if mod == w.head then mod.weight = nn.Parameter(fsdp.zeros{cfg.vocab, cfg.d}) end
    end})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("replaced parameter head.weight", 1, true), err)
    assert.is_false(fsdp.is_wrapped(w))
    assert.is_true(rawequal(w.head.weight, w.wte.weight))
    assert.are.equal("meta", w.head.weight.device)
  end)

  it("leaves materialized parameters alone and is idempotent", function()
    local m = meta_gpt(false)
    fsdp.materialize(m)
    m.wte.weight:fill(7)
    fsdp.materialize(m)
    assert.are.equal(7, m.wte.weight:get(1, 1))
  end)
end)

describe("fsdp.materialize (wrapped, world size 1)", function()
  local policy = function() return fsdp.policy.modules{nn.Block} end

  it("fills shards from the init records: the eager values, without gathering", function()
    for _, tie in ipairs{true, false} do
      local ref = snapshot(eager_gpt(tie))
      local m = meta_gpt(tie)
      fsdp.wrap(m, {policy = policy()})
      fsdp.reset_comm_stats()
      core.reset_peak()
      local g0 = fsdp.memory().devices.cpu.peak_gathered or 0
      fsdp.materialize(m)
      assert.are.equal(0, fsdp.comm_stats().all_gather_calls)
      assert.are.equal(g0, fsdp.memory().devices.cpu.peak_gathered or 0)
      fsdp.full_params(m, function(mm) assert.are.same({}, differing(mm, ref)) end)
      fsdp.unwrap(m)
      assert.are.same({}, differing(m, ref))
    end
  end)

  it("refuses to run a forward before the values exist; unwrap puts them back on meta", function()
    local m = meta_gpt(true)
    fsdp.wrap(m, {policy = policy()})
    local ok, err = pcall(m, fsdp.tensor{{1, 2}})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("still on the meta device", 1, true), err)
    assert.is_false(pcall(fsdp.full_params, m, function() end))
    assert.is_false(pcall(fsdp.apply, m, function() end))
    fsdp.unwrap(m)
    for path, p in m:named_parameters() do assert.are.equal("meta", p.device, path) end
    assert.is_true(rawequal(m.head.weight, m.wte.weight))
    fsdp.materialize(m)
    assert.are.same({}, differing(m, snapshot(eager_gpt(true))))
  end)

  it("wrap{init = true} and wrap{init = fn} materialize while wrapping", function()
    local ref = snapshot(eager_gpt(true))
    local m = meta_gpt(true)
    fsdp.wrap(m, {policy = policy(), init = true})
    fsdp.full_params(m, function(mm) assert.are.same({}, differing(mm, ref)) end)
    fsdp.unwrap(m)

    local function init(mod, path)
      for _, e in ipairs(require("fsdp.nn.module").own_entries(mod)) do
        if nn.is_param(e[2]) then core.init_normal(e[2], 1, path .. "." .. e[1], 0, 0.1) end
      end
    end
    local plain = meta_gpt(true)
    fsdp.materialize(plain, init)
    local m2 = meta_gpt(true)
    fsdp.wrap(m2, {policy = policy(), init = init})
    local y1 = plain(fsdp.tensor{{1, 2, 3}})
    local y2 = m2(fsdp.tensor{{1, 2, 3}})
    assert.is_true(same_values(y1, y2))
    fsdp.full_params(m2, function(mm) assert.are.same({}, differing(mm, snapshot(plain))) end)
  end)

  it("runs custom reset_parameters on the gathered unit", function()
    fsdp.manual_seed(4)
    local eager = nn.Sequential{nn.Linear(4, 4), Scaled(4), nn.Linear(4, 2)}
    fsdp.manual_seed(4)
    local m = fsdp.meta(function() return nn.Sequential{nn.Linear(4, 4), Scaled(4), nn.Linear(4, 2)} end)
    fsdp.wrap(m, {policy = fsdp.policy.list{m[2], m[3]}})
    fsdp.materialize(m)
    fsdp.full_params(m, function(mm) assert.are.same({}, differing(mm, snapshot(eager))) end)
  end)

  it("trains like the eager model", function()
    local e = eager_gpt(true)
    local m = meta_gpt(true)
    fsdp.wrap(m, {policy = policy(), init = true})
    local oe = fsdp.optim.SGD(e, {lr = 0.1})
    local om = fsdp.optim.SGD(m, {lr = 0.1})
    local x, y = fsdp.tensor{{1, 2, 3, 4}}, fsdp.tensor{{2, 3, 4, 5}}
    for _ = 1, 3 do
      for _, pair in ipairs{{e, oe}, {m, om}} do
        pair[2]:zero_grad()
        nn.F.cross_entropy(pair[1](x), y):backward()
        pair[2]:step()
      end
    end
    fsdp.full_params(m, function(mm) assert.are.same({}, differing(mm, snapshot(e))) end)
  end)

  it("checks its options", function()
    local m = meta_gpt(true)
    assert.is_false(pcall(fsdp.materialize, m, 3))
    assert.is_false(pcall(fsdp.materialize, 3))
    fsdp.wrap(m, {policy = policy()})
    local ok, err = pcall(fsdp.materialize, m.blocks[1])
    assert.is_false(ok)
    assert.truthy(tostring(err):find("materialize its root", 1, true), err)
    ok, err = pcall(fsdp.wrap, meta_gpt(true), {sync_module_states = true})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("rank 0's parameter wte.weight is on the meta device", 1, true), err)
  end)
  it("refuses an init_fn that adds or removes a parameter or module of a wrapped model", function()
    -- the new object would belong to no unit: a plain parameter inside a wrapped model
    local w = meta_gpt(true)
    local ok, err = pcall(fsdp.wrap, w, {policy = fsdp.policy.modules{nn.Block}, init = function(mod)
      if mod.reset_parameters then mod:reset_parameters() end
      if mod == w.head then mod.extra = nn.Parameter(fsdp.zeros{3}) end
    end})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("Linear.extra: the module belongs to a wrapped model, and "
      .. "adding a parameter there", 1, true), err)
    assert.is_false(fsdp.is_wrapped(w))
    assert.is_nil(w.head.extra)
    assert.are.equal(#meta_gpt(true):parameters(), #w:parameters())
    -- fsdp.materialize of a model wrapped on meta, removing a parameter and adding a module
    fsdp.wrap(w, {policy = fsdp.policy.modules{nn.Block}})
    ok, err = pcall(fsdp.materialize, w, function(mod)
      if mod == w.blocks[1].ln1 then mod.bias = nil end
    end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("LayerNorm.bias: the module belongs to a wrapped model, and "
      .. "removing a parameter there", 1, true), err)
    assert.is_not_nil(w.blocks[1].ln1.bias)
    ok, err = pcall(fsdp.materialize, w, function(mod)
      if mod == w.blocks[1].ln1 then mod.sub = nn.Linear(2, 2) end
    end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("adding a Linear there", 1, true), err)
    fsdp.materialize(w)
    assert.are.equal(#meta_gpt(true):parameters(), #w:parameters())
    fsdp.unwrap(w)
  end)
  it("runs resets in an eager build's order: a parent's write into a child is overwritten", function()
    -- the parent's reset_parameters also fills its child's weight; an
    -- eager build runs every module's reset in pre-order, so the child's own reset (the Linear's
    -- record) wins, while the parent's own parameter keeps the parent's value
    local Parent = nn.Module:extend("ParentInit")
    function Parent:init() self.lin = nn.Linear(4, 4); self.scale = nn.new_param{4} end
    function Parent:reset_parameters()
      self:init_param("scale", "constant", 2)
      if self.lin.weight.has_data then self.lin.weight:fill(0.5) end
    end
    function Parent:forward(x) return self.lin(x) * self.scale end
    local function build() return nn.Sequential{nn.Linear(4, 4), Parent(), nn.LayerNorm(4)} end
    fsdp.manual_seed(21)
    local ref = snapshot(build())
    assert.are_not.equal(0.5, ref["2.lin.weight"]:get(1, 1))
    fsdp.manual_seed(21)
    local plain = fsdp.meta(build)
    fsdp.materialize(plain)
    assert.are.same({}, differing(plain, ref))
    -- wrapped: the child in the parent's unit, in a unit of its own, and with an init_fn
    for _, pick in ipairs{function() return {} end, function(m) return {m[2].lin} end,
      function(m) return {m[2], m[3]} end} do
      fsdp.manual_seed(21)
      local w = fsdp.meta(build)
      fsdp.wrap(w, {policy = fsdp.policy.list(pick(w)), init = true})
      fsdp.full_params(w, function() assert.are.same({}, differing(w, ref)) end)
      fsdp.unwrap(w)
    end
  end)
end)

describe("fsdp.ties", function()
  it("lists each shared parameter with all its paths", function()
    local m = eager_gpt(true)
    local t = fsdp.ties(m)
    assert.are.equal(1, #t)
    assert.is_true(rawequal(t[1].param, m.wte.weight))
    assert.are.same({"wte.weight", "head.weight"}, t[1].paths)
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    assert.are.same({"wte.weight", "head.weight"}, fsdp.ties(m)[1].paths)
  end)

  it("works on models without any tie (no metadata needed)", function()
    assert.are.same({}, fsdp.ties(eager_gpt(false)))
    assert.are.same({}, fsdp.ties(nn.Sequential{nn.Linear(2, 2)}))
    assert.are.same({}, fsdp.ties(nn.ReLU()))
    assert.is_false(pcall(fsdp.ties, 3))
  end)

  it("counts a module referenced twice", function()
    fsdp.manual_seed(1)
    local shared = nn.Linear(2, 2)
    local m = nn.Sequential{shared, nn.ReLU(), shared}
    local t = fsdp.ties(m)
    assert.are.equal(2, #t)
    assert.are.same({"1.weight", "3.weight"}, t[1].paths)
    assert.are.same({"1.bias", "3.bias"}, t[2].paths)
  end)
end)

describe("fsdp.retie", function()
  it("makes a builder's two parameters one, with the tied model's values and init", function()
    local tied = snapshot(eager_gpt(true))
    -- an eager untied model, retied (either order in the group): the first path is kept
    for _, group in ipairs{{"head.weight", "wte.weight"}, {"wte.weight", "head.weight"}} do
      local m = eager_gpt(false)
      local wte = m.wte.weight
      local notes = quiet_notes(function() fsdp.retie(m, {group}) end)
      assert.is_true(rawequal(m.head.weight, wte))
      assert.truthy(notes[1] and notes[1]:find("held different values", 1, true))
      assert.are.same({}, differing(m, tied))
      assert.are.equal(1, #fsdp.ties(m))
    end
    -- on meta: retie, then materialize: exactly the tied model (head no longer re-initialises)
    local m = meta_gpt(false)
    fsdp.retie(m, {{"head.weight", "wte.weight"}})
    fsdp.materialize(m)
    assert.are.same({}, differing(m, tied))
    assert.is_true(rawequal(m.head.weight, m.wte.weight))
  end)

  it("errors on shapes, bad paths and wrapped models; says nothing for equal values", function()
    local m = eager_gpt(false)
    local ok, err = pcall(fsdp.retie, m, {{"head.weight", "wpe.weight"}})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("different shapes", 1, true), err)
    ok, err = pcall(fsdp.retie, m, {{"head.weight", "wte.nope"}})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("no parameter at wte.nope", 1, true), err)
    ok, err = pcall(fsdp.retie, m, {{"head.weight"}})
    assert.is_false(ok)
    m.head.weight:copy(m.wte.weight)
    local notes = quiet_notes(function() fsdp.retie(m, {{"head.weight", "wte.weight"}}) end)
    assert.are.same({}, notes)
    fsdp.wrap(m)
    ok, err = pcall(fsdp.retie, m, {{"head.weight", "wte.weight"}})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("unwrap it", 1, true), err)
  end)

  it("refuses a parameter named by two groups, changing nothing", function()
    local m = fsdp.nn.Sequential{fsdp.nn.Linear(4, 4), fsdp.nn.Linear(4, 4), fsdp.nn.Linear(4, 4)}
    local w1, w2, w3 = m[1].weight, m[2].weight, m[3].weight
    local ok, err = pcall(fsdp.retie, m, {{"1.weight", "2.weight"}, {"2.weight", "3.weight"}})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("groups 1 and 2 both name 2.weight", 1, true), err)
    assert.is_true(rawequal(m[1].weight, w1) and rawequal(m[2].weight, w2) and rawequal(m[3].weight, w3))
    -- one group with the three paths ties them all
    quiet_notes(function() fsdp.retie(m, {{"1.weight", "2.weight", "3.weight"}}) end)
    assert.is_true(rawequal(m[2].weight, w1) and rawequal(m[3].weight, w1))
  end)
end)

describe("a tie", function()
  it("is one object with one storage through meta, materialize, wrap, gather, reshard, apply, "
    .. "full_params, unwrap, re-wrap and load", function()
    local m = meta_gpt(true)
    local w = m.wte.weight
    local function one(where)
      assert.is_true(rawequal(m.head.weight, w), where)
      assert.is_true(rawequal(m.wte.weight, w), where)
      assert.is_true(core.same_storage(m.head.weight, m.wte.weight), where)
      local n = 0
      for _ in m:named_parameters() do n = n + 1 end
      assert.are.equal(#m:parameters(), n, where)
    end
    one("meta")
    fsdp.materialize(m)
    one("materialize")
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    one("wrap")
    local u = core.param_unit(w)
    assert.are.equal("(root)", u.path)
    local count = 0
    for _, p in ipairs(u:params()) do if rawequal(p, w) then count = count + 1 end end
    assert.are.equal(1, count) -- once in its unit
    u:gather()
    one("gather")
    m.head.weight:fill(0.25)
    assert.are.equal(0.25, m.wte.weight:get(2, 2))
    u:writeback()
    u:reshard()
    one("reshard")
    fsdp.apply(m, function(mod) if mod == m.head then mod.weight:fill(0.5) end end)
    fsdp.full_params(m, function(mm)
      assert.are.equal(0.5, mm.wte.weight:get(3, 3))
      one("full_params")
    end)
    fsdp.unwrap(m)
    one("unwrap")
    assert.are.equal(0.5, m.wte.weight:get(1, 1))
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    one("re-wrap")
    fsdp.unwrap(m)
    local t = {}
    for path, p in m:named_parameters() do t[path] = p:clone():fill(0.75) end
    meta.load_tensors(m, t)
    one("load")
    assert.are.equal(0.75, m.head.weight:get(1, 1))
  end)

  it("accumulates the gradients of both uses; the optimizer updates it once", function()
    -- reference: the same values untied; the tied gradient is the sum of the two
    local tied = eager_gpt(true)
    local untied = eager_gpt(false)
    untied.head.weight:copy(untied.wte.weight)
    local x, y = fsdp.tensor{{1, 2, 3, 4}}, fsdp.tensor{{2, 3, 4, 5}}
    nn.F.cross_entropy(tied(x), y):backward()
    nn.F.cross_entropy(untied(x), y):backward()
    local want = untied.wte.weight.grad + untied.head.weight.grad
    local got = tied.wte.weight.grad
    local d = (got - want):max()
    if type(d) ~= "number" then d = d:item() end
    assert.is_true(math.abs(d) < 1e-6)
    local before = tied.wte.weight:clone()
    local opt = fsdp.optim.SGD(tied, {lr = 0.1})
    opt:step()
    local expect = before - got * 0.1
    assert.is_true(same_values(tied.wte.weight, expect)) -- one step, not two

    -- wrapped: the same gradient, the same single update
    local m = eager_gpt(true)
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local om = fsdp.optim.SGD(m, {lr = 0.1})
    om:zero_grad()
    nn.F.cross_entropy(m(x), y):backward()
    om:step()
    fsdp.full_params(m, function(mm)
      local diff = (mm.wte.weight - expect):max()
      if type(diff) ~= "number" then diff = diff:item() end
      assert.is_true(math.abs(diff) < 1e-6)
    end)
  end)
end)

describe("load_tensors (tensor table, world size 1)", function()
  it("names the masks of a pruned model's file rather than taking them for parameters", function()
    local ref = eager_gpt(true)
    local t = {}
    for path, p in ref:named_parameters() do t[path] = p:clone() end
    t["blocks.1.mlp.fc.weight:mask"] = fsdp.ones(ref.blocks[1].mlp.fc.weight:shape())
    local ok, err = pcall(meta.load_tensors, meta_gpt(true), t)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("the source holds pruning masks (blocks.1.mlp.fc.weight:mask)", 1, true), err)
    local m = meta_gpt(true)
    local notes = quiet_notes(function() meta.load_tensors(m, t, {strict = false}) end)
    assert.truthy(table.concat(notes, "\n"):find("the masks in the source were not loaded", 1, true))
    assert.are.same({}, differing(m, snapshot(ref)))
  end)

  it("loads into meta parameters; one name fills both paths of a tie", function()
    local ref = eager_gpt(true)
    local t = {}
    for path, p in ref:named_parameters() do t[path] = p:clone() end -- wte.weight only
    local m = meta_gpt(true)
    local res = meta.load_tensors(m, t)
    assert.are.equal(#ref:parameters(), res.loaded)
    assert.are.same({}, differing(m, snapshot(ref)))
    assert.is_true(rawequal(m.head.weight, m.wte.weight))
  end)

  it("both names of a tie: one object when the copies agree, an error naming both when not", function()
    local ref = eager_gpt(true)
    local t = {}
    for path, p in ref:named_parameters() do t[path] = p:clone() end
    t["head.weight"] = t["wte.weight"]:clone()
    local m = meta_gpt(true)
    local notes = quiet_notes(function() meta.load_tensors(m, t) end)
    assert.are.same({}, notes)
    assert.are.same({}, differing(m, snapshot(ref)))
    assert.is_true(rawequal(m.head.weight, m.wte.weight))
    t["head.weight"]:fill(1)
    for _, strict in ipairs{true, false} do
      m = meta_gpt(true)
      local ok, err = pcall(meta.load_tensors, m, t, {strict = strict})
      assert.is_false(ok)
      err = tostring(err)
      assert.truthy(err:find("'wte.weight' and 'head.weight' hold one tied parameter", 1, true), err)
      assert.truthy(err:find("different values", 1, true), err)
      assert.truthy(err:find("meta_spec.lua:%d+: "), err) -- located at the caller
      assert.are.equal("meta", m.wte.weight.device) -- nothing loaded
    end
  end)

  it("strict: missing, unexpected and mis-shaped tensors are errors naming them", function()
    local ref = eager_gpt(false)
    local t = {}
    for path, p in ref:named_parameters() do t[path] = p:clone() end
    local saved = t["ln_f.bias"]
    t["ln_f.bias"] = nil
    local ok, err = pcall(meta.load_tensors, meta_gpt(false), t)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("no tensor for ln_f.bias", 1, true), err)
    local res = meta.load_tensors(meta_gpt(false), t, {strict = false})
    assert.are.same({"ln_f.bias"}, res.missing)
    t["ln_f.bias"] = saved
    t["extra.weight"] = fsdp.zeros{2}
    ok, err = pcall(meta.load_tensors, meta_gpt(false), t)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("extra.weight", 1, true), err)
    t["extra.weight"] = nil
    t["wpe.weight"] = fsdp.zeros{3, 3}
    ok, err = pcall(meta.load_tensors, meta_gpt(false), t)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("wpe.weight has shape (3, 3)", 1, true), err)
  end)

  it("loads a wrapped meta model's shards (its parameters stop waiting)", function()
    local ref = eager_gpt(true)
    local t = {}
    for path, p in ref:named_parameters() do t[path] = p:clone() end
    local m = meta_gpt(true)
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    meta.load_tensors(m, t)
    local y = m(fsdp.tensor{{1, 2, 3}}) -- no longer pending
    assert.is_true(same_values(y, ref(fsdp.tensor{{1, 2, 3}})))
    fsdp.full_params(m, function(mm) assert.are.same({}, differing(mm, snapshot(ref))) end)
  end)
end)

describe("ownership of a tie across units", function()
  it("a parameter tied between two blocks belongs to their closest common unit (the root)", function()
    local function build()
      fsdp.manual_seed(8)
      local m = nn.GPT{vocab = 13, ctx = 8, d = 8, layers = 3, heads = 2}
      quiet_notes(function() fsdp.retie(m, {{"blocks.3.mlp.fc.weight", "blocks.1.mlp.fc.weight"}}) end)
      return m
    end
    local plain, m = build(), build()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local w = m.blocks[1].mlp.fc.weight
    assert.is_true(rawequal(w, m.blocks[3].mlp.fc.weight))
    assert.are.equal("(root)", core.param_unit(w).path)
    assert.are.equal("blocks.1", core.param_unit(m.blocks[1].mlp.fc.bias).path)
    -- both uses' gradients accumulate into the one parameter, sharded as unsharded
    local x, y = fsdp.tensor{{1, 2, 3, 4}}, fsdp.tensor{{2, 3, 4, 5}}
    local op, om = fsdp.optim.SGD(plain, {lr = 0.1}), fsdp.optim.SGD(m, {lr = 0.1})
    for _, pair in ipairs{{plain, op}, {m, om}} do
      pair[2]:zero_grad()
      nn.F.cross_entropy(pair[1](x), y):backward()
      pair[2]:step()
    end
    fsdp.full_params(m, function(mm)
      local d = (mm.blocks[3].mlp.fc.weight - plain.blocks[1].mlp.fc.weight):max()
      if type(d) ~= "number" then d = d:item() end
      assert.is_true(math.abs(d) < 1e-6)
    end)
  end)

  it("a parameter shared with a separately wrapped model has no common ancestor: a clear error", function()
    fsdp.manual_seed(1)
    local a = nn.Sequential{nn.Linear(4, 4)}
    local b = nn.Sequential{nn.Linear(4, 4)}
    b[1].weight = a[1].weight
    fsdp.wrap(a)
    local ok, err = pcall(fsdp.wrap, b)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("1.weight is shared with another wrapped model", 1, true), err)
    assert.truthy(tostring(err):find("wrap one module that contains both", 1, true), err)
    assert.is_false(fsdp.is_wrapped(b))
    -- wrapping a module that contains both works: the common ancestor owns it
    fsdp.unwrap(a)
    local both = nn.Sequential{a, b}
    fsdp.wrap(both, {policy = fsdp.policy.list{a, b}})
    assert.are.equal("(root)", core.param_unit(a[1].weight).path)
    assert.are.equal("1", core.param_unit(a[1].bias).path)
  end)
end)
