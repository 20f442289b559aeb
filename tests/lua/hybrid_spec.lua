-- hybrid_spec.lua — strategy = "hybrid" (HSDP) at world size 1 (lua/fsdp/wrap.lua, the
-- binding's unit_new and u:groups(), fsdp.comm_stats' groups): a world of one splits into
-- groups of one, trains as unwrapped does, and the options are checked. Several ranks:
-- tests/dist/hybrid.lua and tests/recipes/dist_hybrid.sh.
-- Run: busted --lua=luajit tests/lua/hybrid_spec.lua

local fsdp = require "fsdp"
local nn = fsdp.nn

local function mlp()
  fsdp.manual_seed(11)
  return nn.Sequential{nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)}
end

local function step(model)
  local opt = fsdp.optim.SGD(model, {lr = 0.1, momentum = 0.9})
  local x = fsdp.tensor{{1, 2, 3, 4, 5, 6}, {0.5, -1, 2, 0, 1, -2}}
  local y = fsdp.tensor({0, 2}, {dtype = "i64"})
  local losses = {}
  for k = 1, 3 do
    opt:zero_grad()
    local loss = nn.F.cross_entropy(model(x), y)
    loss:backward()
    fsdp.clip_grad_norm(model, 0.5)
    opt:step()
    losses[k] = loss:item()
  end
  return losses
end

local function params_of(model)
  return fsdp.full_params(model, function(m)
    local out = {}
    for path, p in m:named_parameters() do out[path] = p:clone():view{p:numel()}:totable() end
    return out
  end, {writeback = false})
end

describe("hybrid sharding at world size 1", function()
  it("wraps into groups of one and trains as the plain model does", function()
    local plain = mlp()
    local want = step(plain)
    local m = mlp()
    fsdp.wrap(m, {strategy = "hybrid", shard_size = 1, policy = fsdp.policy.size(20)})
    local units = fsdp.units(m)
    assert.is_true(#units > 1)
    for _, u in ipairs(units) do
      assert.are.equal("hybrid", u:strategy())
      assert.are.same({shard_rank = 0, shard_size = 1, replica = 0, replicas = 1}, u:groups())
    end
    fsdp.reset_comm_stats()
    assert.are.same(want, step(m))
    local got = params_of(m)
    for path, p in plain:named_parameters() do
      assert.are.same(p:view{p:numel()}:totable(), got[path])
    end
    local s = fsdp.comm_stats()
    assert.are.equal(1, s.shard_size)
    assert.is_true(s.shard.all_gather_calls > 0 and s.shard.reduce_scatter_calls > 0)
    assert.are.equal(0, s.all_gather_calls) -- the world carries no sharding traffic
    -- a group of one has nothing to average across: no all_reduce issued there
    assert.are.equal(0, s.replicate.all_reduce_calls)
    fsdp.reset_comm_stats()
    assert.are.equal(0, fsdp.comm_stats().shard.all_gather_calls)
    fsdp.unwrap(m)
  end)

  it("says where a rank sits for the other strategies too", function()
    local m = mlp()
    fsdp.wrap(m, {strategy = "grad_op"})
    assert.are.same({shard_rank = 0, shard_size = 1, replica = 0, replicas = 1},
      fsdp.units(m)[1]:groups())
    fsdp.unwrap(m)
  end)

  it("refuses a shard_size that does not fit, and shard_size without hybrid", function()
    local m = mlp()
    local function err_of(opts)
      local ok, err = pcall(fsdp.wrap, m, opts)
      assert.is_false(ok)
      assert.is_false(fsdp.is_wrapped(m))
      return tostring(err)
    end
    assert.truthy(err_of{strategy = "hybrid", shard_size = 2}:find(
      "fsdp.wrap: shard_size 2 does not divide the world of 1 ranks", 1, true))
    assert.truthy(err_of{strategy = "hybrid"}:find('strategy "hybrid" needs shard_size', 1, true))
    assert.truthy(err_of{strategy = "hybrid", shard_size = 1.5}:find("got 1.5", 1, true))
    assert.truthy(err_of{strategy = "hybrid", shard_size = 0}:find("got 0", 1, true))
    assert.truthy(err_of{shard_size = 1}:find('shard_size is for strategy "hybrid" (the strategy is full)', 1, true))
    assert.truthy(err_of{strategy = "zero3"}:find('"none" or "hybrid"', 1, true))
    -- the binding checks too
    local core = fsdp.core
    local ok, err = pcall(core.unit_new, "u", {}, {}, {strategy = "full", shard_size = 1})
    assert.is_false(ok)
    assert.truthy(tostring(err):find('shard_size goes with strategy "hybrid"', 1, true))
    ok, err = pcall(core.unit_new, "u", {}, {}, {strategy = "hybrid", shard_size = 3})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("hybrid sharding: shard_size 3 does not divide the world of 1 ranks", 1, true))
  end)
end)
