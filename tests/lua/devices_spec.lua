-- devices_spec.lua — the binding on a device the host must not read: cpu2 (tests/c/cpu2_device.h,
-- loaded by the test module fsdp_cpu2) has host memory behind host_memory = false and the cpu's
-- kernels. Printing, item, get/set, totable and max read through its to_host/from_host; the
-- mask, optimizer, init and sumsq bindings compute in its kernel table with no host transfer and
-- give the cpu's bits; mixing devices or dtypes in one call is an error naming both; data and
-- safetensors helpers move through the host only where they must. The C side (ops, units at 1
-- and 2 ranks): tests/c/test_devices.c.
-- Run: busted --lua=luajit tests/lua/devices_spec.lua (needs build/lib on LUA_CPATH)

local cpu2 = require "fsdp_cpu2" -- first: its fsdp.core is the engine cpu2 is registered in
local fsdp = require "fsdp"
local core = fsdp.core
local H = require "helpers"
teardown(H.remove_temps)

-- the same stream on both devices
local function pair(shape, seed)
  fsdp.manual_seed(seed or 1)
  local a = fsdp.randn(shape)
  return a, a:to("cpu2")
end

local function bits_equal(a, b)
  assert.are.equal("cpu", a.device)
  assert.are.equal("cpu2", b.device)
  assert.are.equal(a:dtype(), b:dtype())
  assert.is_true(H.same_values_view(a, b:to("cpu")))
end

-- runs fn and returns the host transfers (to_host, from_host) it made on cpu2
local function transfers(fn)
  cpu2.reset()
  fn()
  return cpu2.transfers()
end

describe("tensors on a device without host memory", function()
  it("print, item, get/set, totable and max/min read through to_host/from_host", function()
    local c = fsdp.tensor{{1, 2, 3}, {4, 5, 6}}
    local x = fsdp.tensor({{1, 2, 3}, {4, 5, 6}}, {device = "cpu2"})
    assert.are.equal("cpu2", x.device)
    local th = transfers(function()
      assert.are.equal((tostring(c):gsub("cpu", "cpu2", 1)), tostring(x))
    end)
    assert.is_true(th > 0)
    local g
    th = transfers(function() g = x:get(2, 3) end)
    assert.are.equal(6, g)
    assert.are.equal(1, th)
    local _, fh = transfers(function() x:set(1, 2, -7.5) end)
    assert.are.equal(1, fh)
    assert.are.equal(-7.5, x:get(1, 2))
    assert.are.same({{1, -7.5, 3}, {4, 5, 6}}, x:totable())
    assert.are.equal(6, x:max())
    assert.are.equal(-7.5, x:min())
    assert.are.equal(-7.5, x:transpose(1, 2):min()) -- strided: made dense on cpu2 first
    assert.are.equal(-2.5, x:narrow(2, 2, 1):sum():item())
  end)

  it("t:to moves across devices and dtypes; factories and fill make values there", function()
    local a, b = pair({3, 4}, 2)
    bits_equal(a, b)
    bits_equal(a:to("bf16"), b:to("bf16"))
    bits_equal(a:to("bf16"):to("f64"), b:to("bf16"):to("f64"))
    assert.are.equal("cpu2", b:to("bf16").device)
    assert.are.equal("cpu", b:to("cpu", "f16").device)
    fsdp.manual_seed(3)
    local r1 = fsdp.rand({5}, {dtype = "bf16"})
    fsdp.manual_seed(3)
    local r2 = fsdp.rand({5}, {dtype = "bf16", device = "cpu2"})
    bits_equal(r1, r2)
    bits_equal(fsdp.full({2, 2}, 3.25), fsdp.full({2, 2}, 3.25, {device = "cpu2"}))
    bits_equal(fsdp.arange(0, 3, 0.5), fsdp.arange(0, 3, 0.5, {device = "cpu2"}))
  end)
end)

describe("mask bindings on cpu2", function()
  local n = 1000
  local function inputs()
    local x, xd = pair({n}, 4)
    local mc = fsdp.tensor((function()
      local v = {}
      for i = 1, n do v[i] = (i * 37) % 5 == 0 and 0 or 1 end
      return v
    end)())
    return x, xd, mc, mc:to("cpu2")
  end

  it("compute in the device's kernels, with the cpu's results and no host transfer", function()
    local x, xd, m, md = inputs()
    local out = {cpu = {}, cpu2 = {}}
    local function run(dev, x, m)
      local o, opts = out[dev], {device = dev}
      o.zeros = core.count_zeros(m)
      o.check = {core.mask_check(m)}
      o.nz = fsdp.zeros({n}, opts)
      o.nz_zeros = core.mask_from_nonzero(o.nz, m)
      -- k = 150 of the 200 masked elements (key 0): the keys' passes, then the positions'
      o.group = {k = 150, pieces = {{x = x, m = m, gbase = 100, counts = true}}}
      core.prune_select({o.group}, false, "devices_spec")
      o.sel = fsdp.zeros({n}, opts)
      o.pruned = core.mask_select(o.sel, x, m, 1065353216, 0, 500)
      o.nm = fsdp.ones({n}, opts)
      o.groups = core.mask_nm(o.nm, x, m, 2, 4, 3)
      o.vals = fsdp.zeros({n}, opts)
      core.mask_values(o.vals, x, m)
      o.applied = x:clone()
      core.mask_apply(o.applied, m)
    end
    run("cpu", x, m)
    local th, fh = transfers(function() run("cpu2", xd, md) end)
    assert.are.equal(0, th)
    assert.are.equal(0, fh)
    local a, b = out.cpu, out.cpu2
    for _, k in ipairs {"zeros", "nz_zeros", "pruned", "groups"} do assert.are.equal(a[k], b[k]) end
    assert.are.same(a.check, b.check)
    assert.are.same({a.group.T, a.group.P}, {b.group.T, b.group.P})
    assert.is_true(a.zeros > 0 and a.pruned > 0 and a.groups > 0)
    -- the 150th masked element (index 749, 0-based) sits at position 100 + 749: P is one past it
    assert.are.same({0, 850}, {a.group.T, a.group.P})
    for _, k in ipairs {"nz", "sel", "nm", "vals", "applied"} do bits_equal(a[k], b[k]) end
  end)

  it("refuse mixed devices and dtypes, naming both, and dtypes the kernels lack", function()
    local _, xd, m, md = inputs()
    H.assert_error_has(function() core.mask_apply(xd, m) end,
      "mask_apply: argument #2 is on the cpu device, argument #1 on cpu2")
    H.assert_error_has(function() core.mask_select(fsdp.zeros{n}, xd, md, 1, 0, 0) end,
      "mask_select: argument #2 is on the cpu2 device, argument #1 on cpu")
    H.assert_error_has(function()
      core.prune_select({{k = 1, pieces = {{x = xd, m = m, gbase = 0, counts = true}}}}, false, "p")
    end, "mask_hist: argument #2 is on the cpu device, argument #1 on cpu2")
    H.assert_error_has(function() core.mask_apply(xd, md:to("f64")) end,
      "mask_apply: argument #2 is f64, argument #1 f32")
    H.assert_error_has(function() core.count_zeros(xd:to("bf16")) end,
      "op count_zeros has no kernel for bf16")
    H.assert_error_has(function() core.mask_values(fsdp.zeros({n}, {device = "cpu2"}), xd, md:narrow(1, 1, 10)) end,
      "mask_values: the mask has 10 elements, the values 1000")
    -- empty views compute nothing and need no kernel
    assert.are.equal(0, core.count_zeros(xd:narrow(1, 1, 0)))
  end)
end)

describe("optimizer, init and sumsq bindings on cpu2", function()
  it("sgd_step and adamw_step give the cpu's bits with no host transfer", function()
    local p, pd = pair({64}, 5)
    local g, gd = pair({64}, 6)
    local b, bd = fsdp.zeros{64}, fsdp.zeros({64}, {device = "cpu2"})
    local m, md = fsdp.zeros{64}, fsdp.zeros({64}, {device = "cpu2"})
    local v, vd = fsdp.zeros{64}, fsdp.zeros({64}, {device = "cpu2"})
    local th, fh = transfers(function()
      for s = 1, 3 do
        core.sgd_step(p, g, b, 0.1, 0.9, 0.01, s == 1)
        core.sgd_step(pd, gd, bd, 0.1, 0.9, 0.01, s == 1)
        core.adamw_step(p, g, m, v, 1e-2, 0.9, 0.999, 1e-8, 0.1, s)
        core.adamw_step(pd, gd, md, vd, 1e-2, 0.9, 0.999, 1e-8, 0.1, s)
      end
    end)
    assert.are.equal(0, th + fh)
    for _, q in ipairs {{p, pd}, {b, bd}, {m, md}, {v, vd}} do bits_equal(q[1], q[2]) end
    assert.are.equal(core.sumsq(p), core.sumsq(pd))
    assert.are.equal(core.sumsq(p:view{8, 8}:transpose(1, 2)), core.sumsq(pd:view{8, 8}:transpose(1, 2)))
  end)

  it("adamw_step with a mask: the cpu's fused kernel, cpu2's three calls and the sequence agree",
    function()
    -- cpu2's table lacks the optional adamw_step_masked, so the binding masks, steps and masks
    local function run(device, fused)
      fsdp.manual_seed(7)
      local p, g = fsdp.randn{1003}, fsdp.randn{1003}
      local mask = fsdp.rand{1003}:gt(0.4):to("f32")
      g:narrow(1, 5, 1):fill(0 / 0) -- a NaN under a zero of the mask (index 5 of 1003)
      mask:narrow(1, 5, 1):fill(0)
      p, g, mask = p:to(device), g:to(device), mask:to(device)
      local m, v = fsdp.zeros({1003}, {device = device}), fsdp.zeros({1003}, {device = device})
      for s = 1, 3 do
        if fused then
          core.adamw_step(p, g, m, v, 1e-2, 0.9, 0.999, 1e-8, 0.1, s, mask)
        else
          core.mask_apply(g, mask)
          core.adamw_step(p, g, m, v, 1e-2, 0.9, 0.999, 1e-8, 0.1, s)
          core.mask_apply(p, mask)
        end
      end
      return {p, g, m, v}
    end
    local fused, fallback, seq = run("cpu", true), run("cpu2", true), run("cpu", false)
    for i = 1, 4 do
      bits_equal(fused[i], fallback[i])
      assert.is_true(H.same_values_view(fused[i], seq[i]))
    end
    assert.are.equal(0, fused[1]:narrow(1, 5, 1):item())
    assert.are.equal(0, fused[2]:narrow(1, 5, 1):item()) -- the gradient is left masked
    local p, g = fsdp.zeros{4}, fsdp.zeros{4}
    H.assert_error_has(function()
      core.adamw_step(p, g, fsdp.zeros{4}, fsdp.zeros{4}, 0.1, 0.9, 0.99, 1e-8, 0, 1, fsdp.ones{3})
    end, "adamw_step: mask has 3 elements, the parameter has 4")
  end)

  it("F.bias_gelu: the cpu's fused slots, cpu2's add and gelu (no such slots) and bf16 agree",
    function()
    local function run(device, dtype)
      fsdp.manual_seed(9)
      local x = fsdp.randn{13, 67}:to(device):to(dtype)
      local b = fsdp.randn{67}:to(device):to(dtype)
      x.requires_grad, b.requires_grad = true, true
      local y = fsdp.F.bias_gelu(x, b)
      local w = fsdp.randn{13, 67}:to(device):to(dtype)
      ;(y * w):sum():backward()
      return {y, x.grad, b.grad}
    end
    local fused, composed = run("cpu", "f32"), run("cpu2", "f32")
    for i = 1, 3 do bits_equal(fused[i], composed[i]) end
    local half = run("cpu", "bf16") -- no bf16 slot: composed on the cpu too
    for i = 1, 3 do
      assert.are.equal("bf16", half[i]:dtype())
      H.assert_close(half[i]:to("f32"), fused[i], 0.05)
    end
    H.assert_error_has(function() fsdp.F.bias_gelu(fsdp.zeros{2, 3}, fsdp.zeros{2}) end,
      "bias_gelu: bias (2) does not match input (2, 3): need (3)")
    H.assert_error_has(function() fsdp.F.bias_gelu(fsdp.zeros{2, 3}, fsdp.zeros({3}, {dtype = "f64"})) end,
      "bias_gelu: dtypes f32 and f64 differ")
  end)

  it("F.add_layernorm: the cpu's fused slot, cpu2's add and layernorm (no such slot) and the "
    .. "two ops agree bit for bit, values and gradients, f32 and bf16", function()
    local function run(device, dtype, fused)
      fsdp.manual_seed(10)
      local x = fsdp.randn{2, 9, 70}:to(device):to(dtype)
      local a = fsdp.randn{2, 9, 70}:to(device):to(dtype)
      local w = (fsdp.randn{70} * 0.1 + 1):to(device):to(dtype)
      local b = fsdp.randn{70}:to(device):to(dtype)
      for _, t in ipairs {x, a, w, b} do t.requires_grad = true end
      local s, y
      if fused then
        s, y = fsdp.F.add_layernorm(x, a, w, b, 1e-5)
      else
        s = x + a
        y = fsdp.F.layernorm(s, w, b, 1e-5)
      end
      local g1 = fsdp.randn{2, 9, 70}:to(device):to(dtype)
      local g2 = fsdp.randn{2, 9, 70}:to(device):to(dtype)
      ;((y * g1):sum() + (s * g2):sum()):backward()
      return {s, y, x.grad, a.grad, w.grad, b.grad}
    end
    for _, dt in ipairs {"f32", "bf16"} do
      local want = run("cpu", dt, false)
      for _, got in ipairs {run("cpu", dt, true), run("cpu2", dt, true)} do
        for i = 1, 6 do
          assert.are.equal(dt, got[i]:dtype())
          assert.is_true(H.same_values_view(got[i]:to("cpu"), want[i]))
        end
      end
    end
    -- shapes that only broadcast: the add and the layernorm, as x + a would
    local s, y = fsdp.F.add_layernorm(fsdp.ones{2, 3}, fsdp.ones{3}, fsdp.ones{3})
    assert.are.same({2, 3}, s:shape())
    assert.are.same({{2, 2, 2}, {2, 2, 2}}, s:totable())
    assert.are.same({2, 3}, y:shape())
    H.assert_error_has(function() fsdp.F.add_layernorm(fsdp.zeros{2, 3}, fsdp.zeros{2, 3},
      fsdp.zeros{2}) end, "layernorm: input (2, 3) needs weight and bias of shape (3), got (2)")
    H.assert_error_has(function() fsdp.F.add_layernorm(fsdp.zeros{2, 3}, fsdp.zeros{2, 3},
      fsdp.zeros({3}, {dtype = "f64"})) end, "layernorm: dtypes f32 and f64 differ")
    H.assert_error_has(function() fsdp.F.add_layernorm(fsdp.zeros{2, 3}, fsdp.zeros{2, 3}) end,
      "bad argument #3 to 'add_layernorm' (tensor expected, got no value)")
    H.assert_error_has(function() fsdp.F.add_layernorm(fsdp.zeros{2, 3}, fsdp.zeros{2, 3},
      fsdp.ones{3}, nil, "x") end, "bad argument #5 to 'add_layernorm' (eps: number expected")
  end)

  it("refuse state on another device or dtype, and dtypes the kernels lack", function()
    local _, pd = pair({8}, 5)
    local g = fsdp.zeros{8}
    H.assert_error_has(function() core.sgd_step(pd, g, nil, 0.1) end,
      "sgd_step: gradient is on the cpu device, the parameter on cpu2")
    local gd = g:to("cpu2")
    H.assert_error_has(function()
      core.adamw_step(pd, gd, gd:to("f64"), gd, 0.1, 0.9, 0.99, 1e-8, 0, 1)
    end, "adamw_step: first moment is f64, the parameter f32")
    local pb, gb = pd:to("bf16"), gd:to("bf16")
    H.assert_error_has(function() core.sgd_step(pb, gb, nil, 0.1) end,
      "op sgd_step has no kernel for bf16")
  end)

  it("init_normal / init_uniform fill any slice [first, first + n) like the cpu", function()
    for _, dt in ipairs {"f32", "bf16"} do
      local a, b = fsdp.zeros({10}, {dtype = dt}), fsdp.zeros({10}, {dtype = dt, device = "cpu2"})
      local th, fh = transfers(function()
        core.init_normal(a, 11, "w", 0.5, 2, 7)
        core.init_normal(b, 11, "w", 0.5, 2, 7)
      end)
      assert.are.equal(0, th + fh)
      bits_equal(a, b)
      core.init_uniform(a, 11, "u", -0.25, 0.75, 3)
      core.init_uniform(b, 11, "u", -0.25, 0.75, 3)
      bits_equal(a, b)
    end
    -- a slice equals the same elements of a whole fill
    local whole, part = fsdp.zeros{10}, fsdp.zeros({4}, {device = "cpu2"})
    core.init_uniform(whole, 11, "u", -0.25, 0.75)
    core.init_uniform(part, 11, "u", -0.25, 0.75, 3)
    bits_equal(whole:narrow(1, 4, 4):contiguous(), part)
  end)
end)

describe("data and safetensors helpers on cpu2", function()
  it("index_rows keeps the device and dtype", function()
    local t, td = pair({5, 3}, 8)
    local r = core.index_rows(td, {5, 1, 5})
    assert.are.equal("cpu2", r.device)
    bits_equal(core.index_rows(t, {5, 1, 5}), r)
    local ti = core.index_rows(fsdp.tensor({{1, 2}, {3, 4}}, {dtype = "i64", device = "cpu2"}), {2})
    assert.are.equal("i64", ti:dtype())
    assert.are.same({{3, 4}}, ti:totable())
  end)

  it("w:write takes any device and dtype; r:read fills an out tensor on any device", function()
    local dir = H.mktemp_dir()
    local path = dir .. "/d.safetensors"
    local a, ad = pair({6}, 9)
    local w = core.st_writer(path, {{name = "a", shape = {6}}, {name = "b", shape = {2, 3}}}, {})
    w:write("a", ad)
    w:write("b", ad:to("bf16"):view{2, 3})
    w:commit()
    local r = core.st_open(path)
    bits_equal(r:read("a"), ad)
    bits_equal(r:read("b"):view{6}, ad:to("bf16"):to("f32"))
    local out = fsdp.zeros({4}, {device = "cpu2"})
    assert.are.equal(out, r:read("a", 1, 4, out))
    bits_equal(a:narrow(1, 2, 4):contiguous(), out)
    r:close()
    os.remove(path)
    os.remove(dir)
  end)
end)

describe("models on another device", function()
  local nn = fsdp.nn

  it("model:to moves the parameters in place and the model trains there like on the cpu", function()
    local function make()
      fsdp.manual_seed(3)
      return nn.GPT{vocab = 16, ctx = 8, d = 16, layers = 1, heads = 2}
    end
    local a, b = make(), make()
    local w = b.wte.weight
    assert.are.equal(b, b:to("cpu2"))
    assert.are.equal(w, b.wte.weight) -- the same parameter object
    assert.are.equal("cpu2", w.device)
    assert.are.equal(b.head.weight, b.wte.weight) -- the tie holds
    local ids = fsdp.tensor({{1, 2, 3, 4}, {5, 6, 7, 8}}, {dtype = "i64"})
    local la = nn.F.cross_entropy(a(ids), ids)
    la:backward() -- (backward consumes the thread's whole tape: one graph at a time)
    local lb = nn.F.cross_entropy(b(ids:to("cpu2")), ids:to("cpu2"))
    lb:backward()
    assert.are.equal(la:item(), lb:item())
    assert.is_true(H.same_values(a.wte.weight.grad, b.wte.weight.grad:to("cpu")))
    b:to("bf16")
    assert.are.equal("bf16", b.wte.weight:dtype())
    assert.are.equal("bf16", b.wte.weight.grad:dtype()) -- gradients move with the parameters
    H.assert_error_has(function() b:to("nowhere") end, "unknown device 'nowhere'")
    H.assert_error_has(function() b:to("i64") end,
      "to: parameters take a float dtype (f32, bf16, f16, f64), not i64")
  end)

  it("wrap{device =} puts a meta model's shards there and materialize fills them", function()
    fsdp.manual_seed(5)
    local eager = nn.Sequential{nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)}
    fsdp.manual_seed(5)
    local m = fsdp.meta(function() return nn.Sequential{nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)} end)
    fsdp.wrap(m, {device = "cpu2"})
    fsdp.materialize(m)
    for _, u in ipairs(fsdp.units(m)) do assert.are.equal("cpu2", u:shard().device) end
    local x = fsdp.randn{3, 8}
    local want = eager(x)
    local got = m(x:to("cpu2"))
    assert.is_true(H.same_values(want, got:to("cpu")))
    H.assert_error_has(function() fsdp.materialize(m, {device = "cpu"}) end,
      "a wrapped model's shards are where wrap put them (cpu2)")
    fsdp.unwrap(m)
    assert.are.equal("cpu2", m[1].weight.device)
    H.assert_error_has(function() fsdp.wrap(nn.Linear(2, 2), {device = "cpu2"}) end,
      "is on the cpu device, the unit's buffers go on cpu2")
    H.assert_error_has(function() fsdp.wrap(nn.Linear(2, 2), {device = 3}) end,
      "device must be a device name")
  end)

  it("materialize{device =} gives a plain meta model's parameters storage there", function()
    fsdp.manual_seed(6)
    local eager = nn.Linear(4, 3)
    fsdp.manual_seed(6)
    local m = fsdp.meta(function() return nn.Linear(4, 3) end)
    fsdp.materialize(m, {device = "cpu2"})
    assert.are.equal("cpu2", m.weight.device)
    assert.is_true(H.same_values(eager.weight, m.weight:to("cpu")))
    H.assert_error_has(function() fsdp.materialize(m, {colour = 1}) end,
      "fsdp.materialize: unknown option 'colour' (valid: device, init)")
    local meta = fsdp.meta(function() return nn.Linear(4, 3) end)
    H.assert_error_has(function() meta:to("cpu2") end, "has no values to move: materialize it first")
  end)

  it("no_sync holds the full gradient on the unit's device (offload too), trains like reducing each time", function()
    -- k = 2 micro-batches per step, the first inside fsdp.no_sync or not; the held gradient is
    -- the unit's full gradient, on the device the parameters compute on
    local function run(offload, no_sync)
      fsdp.manual_seed(11)
      local m = nn.GPT{vocab = 16, ctx = 8, d = 16, layers = 2, heads = 2}
      m:to("cpu2")
      fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}, offload = offload})
      local P = 0
      for _, u in ipairs(fsdp.units(m)) do P = P + u:padded_numel() * 4 end
      -- SGD: Adam would blow the ~1e-9 noise of attention's key-bias gradient (exactly zero in
      -- exact arithmetic) up to lr-sized steps, which differ between the two summation orders
      local opt = fsdp.optim.SGD(m, {lr = 0.1, momentum = 0.9, weight_decay = 0.1})
      local ids = fsdp.tensor({{1, 2, 3, 4, 5}, {5, 6, 7, 8, 9}}, {dtype = "i64", device = "cpu2"})
      local function grads(dev) return fsdp.memory().devices[dev].grads or 0 end
      for _ = 1, 3 do
        opt:zero_grad()
        for i = 1, 2 do
          local function micro()
            local x = ids:narrow(1, i, 1)
            local loss = nn.F.cross_entropy(m(x), x) * 0.5
            loss:backward()
          end
          if no_sync and i == 1 then
            -- the collector held still: a previous run's buffers freed in between would show
            -- as a drop of the counters
            collectgarbage("collect")
            collectgarbage("stop")
            local on_dev, on_cpu = grads("cpu2"), grads("cpu")
            fsdp.no_sync(m, micro)
            local d_dev, d_cpu = grads("cpu2") - on_dev, grads("cpu") - on_cpu
            collectgarbage("restart")
            assert.are.equal(P, d_dev)
            assert.are.equal(0, d_cpu)
          else
            micro()
          end
        end
        fsdp.clip_grad_norm(m, 1.0)
        opt:step()
      end
      local flat = {}
      fsdp.full_params(m, function(full)
        for path, p in full:named_parameters() do flat[path] = H.flat(p:to("cpu")) end
      end, {writeback = false})
      return flat
    end
    for _, offload in ipairs{false, "cpu"} do
      local every, held = run(offload, false), run(offload, true)
      for path, v in pairs(every) do
        for k = 1, #v do assert.is_true(math.abs(v[k] - held[path][k]) <= 1e-6, path) end
      end
    end
  end)

  it("wrap{offload = \"cpu\"} keeps shards and optimizer state on the host, trains like without", function()
    local function run(offload, mask)
      fsdp.manual_seed(11)
      local m = nn.GPT{vocab = 16, ctx = 8, d = 16, layers = 2, heads = 2}
      m:to("cpu2")
      fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}, offload = offload})
      for _, u in ipairs(fsdp.units(m)) do
        assert.are.equal(offload and "cpu" or "cpu2", u:shard().device)
        assert.are.equal(offload and "cpu" or "cpu2", u:grad_shard().device)
      end
      if mask then fsdp.prune.magnitude(m, {sparsity = 0.5, params = {"blocks.1.mlp.fc.weight"}}) end
      local opt = fsdp.optim.AdamW(m, {lr = 1e-2, weight_decay = 0.1})
      local ids = fsdp.tensor({{1, 2, 3, 4, 5}, {5, 6, 7, 8, 9}}, {dtype = "i64", device = "cpu2"})
      local losses = {}
      for step = 1, 3 do
        opt:zero_grad()
        local loss = nn.F.cross_entropy(m(ids), ids)
        loss:backward()
        fsdp.clip_grad_norm(m, 1.0)
        opt:step()
        losses[step] = loss:item()
      end
      local flat = {}
      fsdp.full_params(m, function(full)
        for path, p in full:named_parameters() do
          assert.are.equal("cpu2", p.device) -- the parameters compute on their device
          flat[path] = p:to("cpu")
        end
      end, {writeback = false})
      return losses, flat
    end
    for _, mask in ipairs{false, true} do
      local l0, p0 = run(false, mask)
      local l1, p1 = run("cpu", mask)
      for i = 1, #l0 do assert.are.equal(l0[i], l1[i]) end
      for path, t in pairs(p0) do assert.is_true(H.same_values(t, p1[path]), path) end
    end
    H.assert_error_has(function() fsdp.wrap(nn.Linear(2, 2), {offload = "cpu"}) end,
      "offload = \"cpu\" keeps the shards in host memory while the parameters compute on a "
      .. "device, but these are on the cpu")
    H.assert_error_has(function()
      fsdp.wrap(nn.Linear(2, 2):to("cpu2"), {offload = "cpu", strategy = "none"})
    end, "offload = \"cpu\" needs a sharding strategy (full, grad_op or hybrid)")
    H.assert_error_has(function() fsdp.wrap(nn.Linear(2, 2):to("cpu2"), {offload = "disk"}) end,
      "fsdp.wrap: offload must be \"cpu\" (or false) (got disk)")
  end)

  it("fsdp.memory() carries a device allocator's own figures where it has them", function()
    collectgarbage()
    core.reset_peak()
    local before = fsdp.memory().devices.cpu2
    assert.is_number(before.allocated)
    local t = fsdp.zeros({1024, 256}, {device = "cpu2"}) -- 1 MiB
    local m = fsdp.memory().devices.cpu2
    assert.is_true(m.allocated >= before.allocated + 2 ^ 20)
    assert.is_true(m.peak_allocated >= m.allocated)
    assert.is_true(m.reserved >= m.allocated and m.peak_reserved >= m.reserved)
    t = nil
    collectgarbage()
    local after = fsdp.memory().devices.cpu2
    assert.is_true(after.allocated < m.allocated)
    assert.is_true(after.peak_allocated >= m.allocated) -- the peak stays until reset_peak
    core.reset_peak()
    assert.is_true(fsdp.memory().devices.cpu2.peak_allocated < m.allocated)
    assert.is_nil(fsdp.memory().devices.cpu.allocated) -- the cpu has no allocator figures
  end)

  it("device_count, devices, info and deterministic mode", function()
    assert.are.equal(1, fsdp.device_count("cpu"))
    assert.are.equal(0, fsdp.device_count("meta"))
    assert.are.equal(0, fsdp.device_count("no such device"))
    assert.are.equal(1, fsdp.device_count("cpu2"))
    local names = {}
    for _, d in ipairs(core.devices()) do names[#names + 1] = d.name end
    assert.are.same({"cpu", "meta", "cpu2"}, names)
    local text = tostring(fsdp.info())
    assert.truthy(text:find("device cpu2", 1, true), text)
    assert.is_boolean(fsdp.info().cpu.avx2)
    -- the cpu's line names the GEMM libraries the processor got (f32, then bf16)
    local cpu_desc = fsdp.info().devices[1].description
    assert.truthy(cpu_desc and cpu_desc:match("^gemm f32 %a+ [%d.]+"), cpu_desc)
    assert.truthy(cpu_desc:find(", bf16 ", 1, true), cpu_desc)
    assert.truthy(text:find("device cpu    count 1, kernels: gemm f32 ", 1, true), text)
    local isa = fsdp.info().cpu.isa
    assert.truthy(isa == "avx512" or isa == "avx2" or isa == "scalar", tostring(isa))
    assert.truthy(text:find(", kernels " .. isa, 1, true), text)
    local prev = fsdp.deterministic(true)
    assert.is_true(fsdp.deterministic())
    fsdp.deterministic(prev)
    assert.are.equal(prev, fsdp.deterministic())
    H.assert_error_has(function() fsdp.deterministic("yes") end, "boolean expected")
  end)
end)
