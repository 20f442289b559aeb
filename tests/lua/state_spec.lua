-- state_spec.lua — the wrap state (lua/fsdp/state.lua) at world size 1: which Root a module
-- belongs to, the events other files subscribe to (wrap, writeback, teardown, materialize:
-- when, with what, in which order), walks refusing to nest, and errors at the caller.
-- Run: busted --lua=luajit tests/lua/state_spec.lua
local fsdp = require "fsdp"
local nn = fsdp.nn
local state = require "fsdp.state"

local H = require "helpers"
local errors_with = H.assert_error_has

local function model()
  fsdp.manual_seed(3)
  return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
end

-- Every event announced while fn runs, as {name, ...} (subscribers stay: the log is switched).
local log
for _, ev in ipairs{"wrap", "teardown", "writeback", "materialize"} do
  state.on(ev, function(...) if log then log[#log + 1] = {ev, ...} end end)
end
local function events(fn)
  log = {}
  fn()
  local out = log
  log = nil
  return out
end

describe("fsdp.state", function()
  it("finds the Root of every module of a wrapped tree, and none once unwrapped", function()
    local m = model()
    assert.is_nil(state.of(m))
    fsdp.wrap(m, {policy = fsdp.policy.list{m[1]}})
    local R = state.of(m)
    assert.truthy(R)
    assert.are.equal(R, state.of(m[1]))
    assert.are.equal(R, state.of(m[2]))
    assert.are.equal(R, state.root(m))
    assert.is_nil(state.root(m[1])) -- a unit module, not the root
    assert.are.equal(m, R:model())
    assert.are.equal(2, #R:units())
    assert.are.equal(R:units()[1], R:unit_of(m[1]))
    assert.are.equal(m[1], R:module_of(R:units()[1]))
    assert.are.equal(R:units()[1], R:unit_of_param(m[1].weight))
    assert.are.equal("full", R:option("strategy"))
    fsdp.unwrap(m)
    assert.is_false(R:is_live())
    assert.is_nil(state.of(m))
    assert.is_nil(state.of(m[1]))
  end)

  it("announces wrap, writeback and teardown with the Root and the unit", function()
    local m = model()
    local R
    local seen = events(function() fsdp.wrap(m, {policy = fsdp.policy.list{m[1]}}) end)
    R = state.of(m)
    assert.are.same({{"wrap", R}}, seen)
    -- full_params with writeback: one writeback per gathered unit, newest first; was_sharded
    -- says whether the walk gathered it (the root stays gathered after a forward)
    seen = events(function() fsdp.full_params(m, function() end) end)
    local units = R:units()
    assert.are.same({{"writeback", R, units[2], true}, {"writeback", R, units[1], true}}, seen)
    m(fsdp.zeros{1, 3})
    seen = events(function() fsdp.full_params(m, function() end) end)
    assert.are.same({{"writeback", R, units[2], false}, {"writeback", R, units[1], true}}, seen)
    seen = events(function() fsdp.full_params(m, function() end, {writeback = false}) end)
    assert.are.same({}, seen)
    seen = events(function() fsdp.unwrap(m) end)
    assert.are.same({{"teardown", R}}, seen)
  end)

  it("announces materialize for plain and wrapped models built on meta", function()
    local m = fsdp.meta(model)
    assert.are.same({{"materialize", m}}, events(function() fsdp.materialize(m) end))
    local w = fsdp.meta(model)
    local seen = events(function() fsdp.wrap(w, {init = true}) end)
    assert.are.same({{"wrap", state.of(w)}, {"materialize", w}}, seen)
  end)

  it("an outer wrap tears the inner Root down before building its own", function()
    local m = model()
    fsdp.wrap(m[1])
    local inner = state.of(m[1])
    local seen = events(function() fsdp.wrap(m) end)
    assert.are.equal(2, #seen)
    assert.are.same({"teardown", inner}, seen[1])
    assert.are.same({"wrap", state.of(m)}, seen[2])
    assert.are_not.equal(inner, state.of(m))
    fsdp.unwrap(m)
  end)

  it("refuses a walk inside another, and an unknown event, at the caller's line", function()
    local m = model()
    fsdp.wrap(m)
    local err = errors_with(function()
      fsdp.full_params(m, function() fsdp.apply(m, function() end) end)
    end, "fsdp.apply: not inside fsdp.full_params")
    assert.truthy(err:find("state_spec.lua:%d+: "), err)
    assert.is_nil(state.of(m):busy()) -- the failed walk left
    fsdp.unwrap(m)
    err = errors_with(function() state.on("gathered", function() end) end,
      "fsdp.state: no event gathered (wrap, teardown, writeback, materialize)")
    assert.truthy(err:find("state_spec.lua:%d+: "), err)
  end)
end)
