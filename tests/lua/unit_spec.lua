-- unit_spec.lua — the units API of fsdp.core (docs/fsdp.md) at world size 1:
-- building a unit over a model's parameters, identity, layout and slices, the sharded error,
-- gather/reshard/writeback, shard views, the forward hooks driving backward (gradient shard
-- equals the unwrapped gradient, for every strategy), mixed precision (dtypes, bf16 gathers
-- and gradients into f32 shards, the writeback refusal, dtype errors), unshard, errors,
-- collection.
-- Run: busted --lua=luajit tests/lua/unit_spec.lua
local fsdp = require "fsdp"
local core = fsdp.core
local nn = fsdp.nn
local F = nn.F

local H = require "helpers"
teardown(H.remove_temps)
local flat = H.flat
local assert_close = H.make_assert_close(1e-6, "%.9g")
local errors_with = H.assert_error_has -- (fn, needle)

-- A two-layer model and its parameters / paths in traversal order.
local function model(seed)
  fsdp.manual_seed(seed or 1)
  local m = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
  local paths, params = {}, {}
  for path, p in m:named_parameters() do
    paths[#paths + 1], params[#params + 1] = path, p
  end
  return m, params, paths
end

local function values_of(params)
  local out = {}
  for i, p in ipairs(params) do out[i] = flat(p) end
  return out
end

describe("core.unit_new", function()
  it("keeps the parameter objects and lays them out aligned and padded", function()
    local m, params, paths = model()
    local before = values_of(params)
    local u = core.unit_new("net", params, paths, {strategy = "full", root = true})
    assert.are.equal("net", u.path)
    assert.is_true(u.is_root)
    assert.are.equal("full", u:strategy())
    assert.are.equal("sharded", u:state())
    local ps = u:params()
    assert.are.equal(#params, #ps)
    for i = 1, #params do assert.is_true(rawequal(params[i], ps[i])) end
    local mp = m:parameters()
    for i = 1, #mp do assert.is_true(rawequal(mp[i], params[i])) end
    assert.are.same(paths, u:paths())
    -- 15, 5, 10, 2 elements at offsets 0, 16, 32, 48; end 50, padded to 64 (world 1 x 16)
    assert.are.equal(32, u:numel())
    assert.are.equal(64, u:padded_numel())
    assert.are.equal(64, u:shard_numel())
    local lay = u:layout()
    assert.are.equal(4, #lay)
    local offsets = {0, 16, 32, 48}
    for i, e in ipairs(lay) do
      assert.are.equal(paths[i], e.path)
      assert.are.equal(offsets[i], e.offset)
      assert.are.equal(params[i]:numel(), e.numel)
      assert.are.same(params[i]:shape(), e.shape)
      assert.are.same({[0] = {1, e.numel}}, e.slices)
    end
    local sl = u:local_slices()
    assert.are.equal(4, #sl)
    for i, s in ipairs(sl) do
      assert.are.equal(i, s.index)
      assert.are.equal(paths[i], s.path)
      assert.is_true(rawequal(params[i], s.param))
      assert.are.equal(offsets[i] + 1, s.shard_first)
      assert.are.equal(offsets[i] + params[i]:numel(), s.shard_last)
      assert.are.equal(1, s.param_first)
    end
    -- the shard holds the values; identity of the shard view is stable
    local sh = u:shard()
    assert.is_true(rawequal(sh, u:shard()))
    assert.are.same({64}, sh:shape())
    local sv = flat(sh)
    for i, s in ipairs(sl) do
      assert.are.same(before[i], {unpack(sv, s.shard_first, s.shard_last)})
    end
    assert.are.same({64}, u:grad_shard():shape())
    assert.is_truthy(tostring(u):find("unit('net', full, 4 parameters, 32 elements, sharded)", 1, true))
  end)

  it("makes sharded parameters unreadable, with a message naming them", function()
    local _, params, paths = model()
    local u = core.unit_new("net", params, paths)
    assert.are.equal("sharded", params[1].device)
    errors_with(function() return params[1]:totable() end, "sharded")
    errors_with(function() return params[3] + 1 end, "sharded")
    assert.is_truthy(u)
  end)

  it("maps parameters to their unit (the same userdata) and others to nil", function()
    local _, params, paths = model()
    assert.is_nil(core.param_unit(params[1]))
    local u = core.unit_new("net", params, paths)
    for _, p in ipairs(params) do assert.is_true(rawequal(u, core.param_unit(p))) end
    assert.is_nil(core.param_unit(fsdp.zeros{2}))
  end)

  it("rejects bad arguments and parameters already in a unit", function()
    local _, params, paths = model()
    errors_with(function() core.unit_new("x", params, {"a"}) end, "4 parameters but 1 paths")
    errors_with(function() core.unit_new("x", {1}, {"a"}) end, "params[1] is a number")
    errors_with(function() core.unit_new("x", params, paths, {strategy = "zero3"}) end,
      "unknown strategy 'zero3'")
    errors_with(function() core.unit_new("x", {params[1], params[1]}, {"a", "b"}) end,
      "parameter b is listed twice (also as a)")
    local u = core.unit_new("first", {params[1]}, {paths[1]})
    errors_with(function() core.unit_new("second", {params[2], params[1]}, {paths[2], paths[1]}) end,
      "wrap: parameter 1.weight already belongs to unit 'first'")
    assert.are.equal("cpu", params[2].device) -- nothing moved
    assert.is_truthy(u)
  end)
end)

describe("gather, reshard, writeback", function()
  it("gathers the exact values and reshards idempotently", function()
    local _, params, paths = model()
    local before = values_of(params)
    local u = core.unit_new("net", params, paths)
    u:gather(); u:gather()
    assert.are.equal("gathered", u:state())
    assert.are.same(before, values_of(params))
    u:reshard(); u:reshard()
    assert.are.equal("sharded", u:state())
    errors_with(function() return params[2]:totable() end, "sharded")
    u:prefetch()
    u:gather()
    assert.are.same(before, values_of(params))
    assert.is_true(fsdp.memory().gathered >= 64 * 4) -- the full buffer is counted as gathered
    u:reshard()
  end)

  it("lands writes to the shard view in the parameters, and writes back changed parameters", function()
    local _, params, paths = model()
    local u = core.unit_new("net", params, paths)
    u:shard():set(1, 42)
    u:gather()
    assert.are.equal(42, params[1]:get(1, 1))
    errors_with(function() u:reshard(); u:writeback() end, "not gathered")
    u:gather()
    params[3]:fill(2)
    u:writeback()
    u:reshard()
    u:gather()
    for _, v in ipairs(flat(params[3])) do assert.are.equal(2, v) end
    assert.are.equal(42, params[1]:get(1, 1))
  end)
end)

describe("forward hooks and backward", function()
  -- One step of the model on x with the unit's hooks around the forward; returns the loss.
  local function step(m, u, x, y)
    u:pre_forward(nil)
    local out = m(x)
    u:post_forward()
    local loss = F.mse(out, y)
    loss:backward()
    return loss:item()
  end

  for _, strategy in ipairs {"full", "grad_op", "none"} do
    it("gives the unwrapped gradient in the gradient shard (" .. strategy .. ")", function()
      local x, y = fsdp.randn{4, 3}, fsdp.randn{4, 2}
      local ref, rparams = model(7)
      F.mse(ref(x), y):backward()
      local m, params, paths = model(7)
      local u = core.unit_new("", params, paths, {strategy = strategy, root = true})
      for s = 1, 2 do
        step(m, u, x, y)
        assert.are.equal(strategy == "none" and "gathered" or "sharded", u:state())
        local g = flat(u:grad_shard())
        for i, sl in ipairs(u:local_slices()) do
          assert.is_nil(params[i].grad)
          local want = flat(rparams[i].grad)
          for k = 1, #want do want[k] = want[k] * s end -- accumulates until zero_grad
          assert_close({unpack(g, sl.shard_first, sl.shard_last)}, want, 1e-6, sl.path)
        end
      end
      u:zero_grad()
      for _, v in ipairs(flat(u:grad_shard())) do assert.are.equal(0, v) end
    end)
  end

  it("says which parameters received a gradient since zero_grad (u:has_grad)", function()
    local m, params, paths = model()
    local u = core.unit_new("", params, paths, {root = true})
    for i = 1, #params do assert.is_false(u:has_grad(i)) end
    -- only the first layer runs: the second one's parameters get no gradient
    u:pre_forward(nil)
    local out = m[1](fsdp.zeros{2, 3}) -- a zero input: the weight's gradient is exactly zero
    u:post_forward()
    out:sum():backward()
    assert.are.same({true, true, false, false},
      {u:has_grad(1), u:has_grad(2), u:has_grad(3), u:has_grad(4)})
    local sl = u:local_slices()[1]
    for _, v in ipairs({unpack(flat(u:grad_shard()), sl.shard_first, sl.shard_last)}) do
      assert.are.equal(0, v) -- a zero gradient, which still counts
    end
    u:zero_grad()
    for i = 1, #params do assert.is_false(u:has_grad(i)) end
    errors_with(function() u:has_grad(0) end, "has_grad: 0 is not a parameter index of unit '' (1 to 4)")
    errors_with(function() u:has_grad(5) end, "(1 to 4)")
    errors_with(function() u:has_grad(1.5) end, "1.5 is not a parameter index")
    errors_with(function() u:has_grad("x") end, "number expected")
  end)

  it("records nothing under no_grad and reshards after forward", function()
    local m, params, paths = model()
    local u = core.unit_new("", params, paths, {root = true})
    fsdp.no_grad(function()
      u:pre_forward(nil)
      m(fsdp.randn{2, 3})
      u:post_forward()
    end)
    assert.are.equal("sharded", u:state())
  end)

  it("accepts a next unit to prefetch and a backward prefetch unit", function()
    local m1, p1, n1 = model(1)
    local m2, p2, n2 = model(2)
    local a = core.unit_new("a", p1, n1)
    local b = core.unit_new("b", p2, n2)
    a:set_backward_prefetch(b)
    a:set_backward_prefetch(nil)
    b:set_backward_prefetch(a)
    a:pre_forward(b)
    local h = m1(fsdp.randn{2, 3})
    a:post_forward()
    b:pre_forward(nil)
    assert.are.equal("gathered", b:state())
    local out = m2(h:matmul(fsdp.ones{2, 3}))
    b:post_forward()
    out:sum():backward()
    assert.are.equal("sharded", a:state())
    assert.are.equal("sharded", b:state())
    errors_with(function() a:pre_forward(42) end, "unit expected")
  end)
end)

describe("mixed precision (param_dtype, reduce_dtype)", function()
  -- values rounded to bf16 (what a bf16 gather holds)
  local function bf16(vals)
    local out = {}
    for i, v in ipairs(vals) do out[i] = flat(fsdp.tensor(v):to("bf16"):to("f32")) end
    return out
  end

  it("reports its dtypes: f32 by default, the compute dtype while gathered for compute", function()
    local _, params, paths = model()
    local u = core.unit_new("net", params, paths)
    assert.are.same({param = "f32", reduce = "f32"}, u:dtypes())
    u:gather()
    assert.are.same({param = "f32", reduce = "f32", gathered = "f32"}, u:dtypes())
    u:reshard()
    local _, p2, paths2 = model()
    local v = core.unit_new("mp", p2, paths2, {param_dtype = "bf16", reduce_dtype = "bf16"})
    assert.are.same({param = "bf16", reduce = "bf16"}, v:dtypes())
  end)

  it("gathers bf16 for forward and the f32 masters for u:gather() (a prefetch in bf16 is dropped)", function()
    local _, params, paths = model(3)
    local masters = values_of(params)
    local u = core.unit_new("net", params, paths, {param_dtype = "bf16"})
    u:pre_forward(nil)
    assert.are.equal("bf16", u:dtypes().gathered)
    for _, p in ipairs(params) do assert.are.equal("bf16", p:dtype()) end
    local got = {}
    for i, p in ipairs(params) do got[i] = flat(p:to("f32")) end
    assert.are.same(bf16(masters), got)
    assert.are_not.same(masters, got) -- the masters hold more than bf16 can
    u:post_forward() -- not root, full: resharded
    assert.are.equal("sharded", u:state())
    for _, p in ipairs(params) do assert.are.equal("f32", p:dtype()) end
    u:prefetch()
    u:gather()
    assert.are.equal("f32", u:dtypes().gathered)
    assert.are.same(masters, values_of(params))
    u:reshard()
    u:gather()
    assert.are.same(masters, values_of(params))
    u:reshard()
  end)

  it("refuses to write back parameters gathered in the compute dtype", function()
    local _, params, paths = model()
    local u = core.unit_new("net", params, paths, {param_dtype = "bf16", root = true})
    u:pre_forward(nil)
    errors_with(function() u:writeback() end,
      "writeback: unit 'net' is gathered in bf16 for compute (mixed precision)")
    u:post_forward()
    u:gather() -- f32 masters: changes can be written back
    params[2]:fill(0.1)
    u:writeback()
    u:reshard()
    u:gather()
    for _, x in ipairs(flat(params[2])) do assert.are.equal(fsdp.tensor{0.1}:item(), x) end
  end)

  for _, strategy in ipairs {"full", "grad_op", "none"} do
    it("reduces bf16 gradients into the f32 gradient shard (" .. strategy .. ")", function()
      local x, y = fsdp.randn{4, 3}, fsdp.randn{4, 2}
      local ref, rparams = model(7)
      F.mse(ref(x), y):backward()
      for _, reduce in ipairs {"f32", "bf16"} do
        local m, params, paths = model(7)
        local u = core.unit_new("", params, paths, {strategy = strategy, root = true,
          param_dtype = "bf16", reduce_dtype = reduce})
        u:pre_forward(nil)
        local out = m(x:to("bf16"))
        assert.are.equal("bf16", out:dtype())
        u:post_forward()
        F.mse(out:to("f32"), y):backward()
        -- after backward: no bf16 copy left (none: the parameters view the f32 shard again)
        assert.are.equal(strategy == "none" and "gathered" or "sharded", u:state())
        if strategy == "none" then assert.are.equal("f32", u:dtypes().gathered) end
        local g = flat(u:grad_shard())
        for i, sl in ipairs(u:local_slices()) do
          assert.is_true(u:has_grad(i))
          assert_close({unpack(g, sl.shard_first, sl.shard_last)}, flat(rparams[i].grad), 2e-2, sl.path)
        end
        -- one rank: reduced in bf16, each value is a bf16 number; in f32 the gradients stayed f32
        -- from the kernels on (parameter gradients accumulate in f32 under mixed precision)
        local rounded = flat(u:grad_shard():to("bf16"):to("f32"))
        if reduce == "bf16" then
          assert.are.same(rounded, g)
        else
          local exact = 0
          for i = 1, #g do if rounded[i] == g[i] then exact = exact + 1 end end
          assert.is_true(exact < #g, "f32 gradients are not all bf16 numbers")
        end
      end
    end)
  end

  it("rejects dtypes it cannot gather or reduce in", function()
    local _, params, paths = model()
    errors_with(function() core.unit_new("x", params, paths, {param_dtype = "f64"}) end,
      "wrap: unit 'x': parameters cannot be gathered as f64 (mixed precision takes f32, bf16 or f16)")
    errors_with(function() core.unit_new("x", params, paths, {param_dtype = "i32"}) end,
      "parameters cannot be gathered as i32")
    errors_with(function() core.unit_new("x", params, paths, {reduce_dtype = "f16"}) end,
      "wrap: unit 'x': gradients cannot be reduced in f16 (f32 or bf16)")
    errors_with(function() core.unit_new("x", params, paths, {param_dtype = "bfloat"}) end, "bfloat")
    assert.are.equal("cpu", params[1].device) -- nothing moved
    assert.is_nil(core.param_unit(params[1]))
  end)
end)

describe("unshard", function()
  it("gives every parameter dense storage with its current values and empties the unit", function()
    local m, params, paths = model()
    local u = core.unit_new("net", params, paths)
    local sh = u:shard()
    local sv = flat(sh)
    for i = 1, #sv do sv[i] = sv[i] + 1 end
    for i = 1, #sv do sh:set(i, sv[i]) end
    u:gather()
    local want = values_of(params)
    u:reshard()
    u:unshard()
    u:unshard()
    assert.are.same(want, values_of(params))
    for _, p in ipairs(params) do
      assert.are.equal("cpu", p.device)
      assert.is_true(p.is_param)
      assert.is_nil(core.param_unit(p))
    end
    assert.are.same({}, u:params())
    errors_with(function() u:gather() end, "was unsharded")
    -- the plain model works and can be put in a new unit
    m(fsdp.randn{1, 3}):sum():backward()
    local u2 = core.unit_new("again", params, paths)
    u2:gather()
    assert.are.same(want, values_of(params))
  end)

  it("frees the shards at once: views of them left behind refuse reads and writes", function()
    local m, params, paths = model()
    local u = core.unit_new("net", params, paths)
    local sh, gs = u:shard():narrow(1, 1, 4), u:grad_shard()
    local function params_bytes()
      collectgarbage(); collectgarbage()
      return core.memory().cpu.params
    end
    local before = params_bytes()
    u:unshard()
    -- the shard (64 floats) goes, the parameters' own storage (15 + 5 + 10 + 2 floats) comes
    assert.are.equal((32 - 64) * 4, params_bytes() - before)
    assert.is_not_nil(m)
    for what, fn in pairs {
      fill = function() sh:fill(1) end, read = function() return sh:sum() end,
      copy = function() gs:copy(fsdp.zeros{gs:numel()}) end,
    } do
      local ok, err = pcall(fn)
      assert.is_false(ok, what)
      assert.truthy(tostring(err):find("unit that was unsharded (fsdp.unwrap)", 1, true), tostring(err))
    end
  end)

  it("lets collected units release their parameters", function()
    local _, params, paths = model()
    do core.unit_new("tmp", params, paths) end
    collectgarbage(); collectgarbage()
    assert.is_nil(core.param_unit(params[1]))
  end)
end)

describe("at two ranks (through fsdprun -n 2)", function()
  -- Linear(3, 20) + Linear(20, 2): offsets 0, 64, 96, 144, end 146, padded 160, 80 per rank:
  -- 1.bias is split between the ranks.
  local script = [==[
local fsdp = require "fsdp"
local core, nn, F = fsdp.core, fsdp.nn, fsdp.nn.F
local function model()
  fsdp.manual_seed(5)
  local m = nn.Sequential(nn.Linear(3, 20), nn.Linear(20, 2))
  local ps, paths = {}, {}
  for path, p in m:named_parameters() do ps[#ps + 1], paths[#paths + 1] = p, path end
  return m, ps, paths
end
local function check(c, msg) if not c then error(("rank %d: %s"):format(core.rank(), msg), 2) end end
local x, y = fsdp.randn{8, 3}, fsdp.randn{8, 2}           -- the same on both ranks (same seed)
local ref, rps = model()
F.mse(ref(x), y):backward()
local m, ps, paths = model()
local u = core.unit_new("net", ps, paths, {root = true})
check(u:padded_numel() == 160 and u:shard_numel() == 80, "sizes")
local lay = u:layout()
local want = {{[0] = {1, 60}}, {[0] = {1, 16}, [1] = {17, 20}}, {[1] = {1, 40}}, {[1] = {1, 2}}}
local offsets = {0, 64, 96, 144}
for i, e in ipairs(lay) do
  check(e.offset == offsets[i], "offset " .. i)
  for r = 0, 1 do
    local a, b = e.slices[r], want[i][r]
    check((a == nil) == (b == nil) and (a == nil or (a[1] == b[1] and a[2] == b[2])),
      ("slice of %s on rank %d"):format(e.path, r))
  end
end
local sl = u:local_slices()
local mine = core.rank() == 0 and {{1, 1, 60, 1}, {2, 65, 80, 1}}
                               or {{2, 1, 4, 17}, {3, 17, 56, 1}, {4, 65, 66, 1}}
check(#sl == #mine, "local slice count")
for k, s in ipairs(sl) do
  local w = mine[k]
  check(s.index == w[1] and s.shard_first == w[2] and s.shard_last == w[3] and
        s.param_first == w[4] and rawequal(s.param, ps[w[1]]) and s.path == paths[w[1]],
        "local slice " .. k)
end
-- each rank's half of the batch; the averaged gradient shard equals the 1-rank gradient
local lo = core.rank() * 4 + 1
u:pre_forward(nil)
local out = m(x:narrow(1, lo, 4):contiguous())
u:post_forward()
F.mse(out, y:narrow(1, lo, 4):contiguous()):backward()
local g = u:grad_shard():totable()
for _, s in ipairs(sl) do
  local rg = rps[s.index].grad:reshape{-1}:totable()
  for k = 0, s.shard_last - s.shard_first do
    local a, b = g[s.shard_first + k], rg[s.param_first + k]
    check(math.abs(a - b) <= 1e-6 * (1 + math.abs(b)), ("%s grad %g vs %g"):format(s.path, a, b))
  end
end
print("units-ok " .. core.rank())
]==]

  it("lays out, slices and averages gradients across ranks", function()
    local fsdprun = os.getenv("FSDPRUN")
    if not fsdprun then pending("FSDPRUN is not set (run through ctest)") return end
    local path = H.tmpname()
    local f = assert(io.open(path, "w"))
    f:write(script)
    f:close()
    local p = assert(io.popen(("%q -n 2 --timeout=30 %q 2>&1"):format(fsdprun, path)))
    local out = p:read("*a")
    p:close()
    os.remove(path)
    assert.is_truthy(out:find("units-ok 0", 1, true), out)
    assert.is_truthy(out:find("units-ok 1", 1, true), out)
  end)
end)
