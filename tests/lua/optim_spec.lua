-- optim_spec.lua — fsdp.optim: SGD and AdamW against hand-computed steps, weight-decay
-- exclusions, state, clip_grad_norm and max_grad_norm, the learning-rate schedules.
-- Run: busted --lua=luajit tests/lua/optim_spec.lua

local fsdp = require "fsdp"
local nn = fsdp.nn
local optim = fsdp.optim

local H = require "helpers"
teardown(H.remove_temps)
local flat, assert_close = H.flat, H.assert_close

local function param(values) return nn.Parameter(fsdp.tensor(values)) end

-- loss = 0.5 * sum(c * p^2) so that grad = c * p (depends on the current p)
local function quad_backward(ps, cs)
  local loss
  for i, p in ipairs(ps) do
    local term = (p * p * fsdp.tensor(cs[i])):sum() * 0.5
    loss = loss and (loss + term) or term
  end
  loss:backward()
end

local function map2(a, b, f)
  local out = {}
  for i = 1, #a do out[i] = f(a[i], b[i]) end
  return out
end

describe("optim.SGD", function()
  it("matches two hand-computed steps with momentum and weight decay", function()
    local p0, c = {1, -2, 3}, {0.5, 1, -1}
    local p = param(p0)
    local opt = optim.SGD({p}, {lr = 0.1, momentum = 0.9, weight_decay = 0.01})
    local lr, mu, wd = 0.1, 0.9, 0.01
    -- hand: g = c*p + wd*p; buf = g (first), then mu*buf + g; p = p - lr*buf
    local g1 = map2(c, p0, function(ci, pi) return ci * pi + wd * pi end)
    local buf = g1
    local p1 = map2(p0, buf, function(pi, bi) return pi - lr * bi end)
    local g2 = map2(c, p1, function(ci, pi) return ci * pi + wd * pi end)
    buf = map2(buf, g2, function(bi, gi) return mu * bi + gi end)
    local p2 = map2(p1, buf, function(pi, bi) return pi - lr * bi end)
    quad_backward({p}, {c})
    opt:step()
    assert_close(p, p1, 1e-6, "after step 1")
    opt:zero_grad()
    assert.is_nil(p.grad)
    quad_backward({p}, {c})
    opt:step()
    assert_close(p, p2, 1e-6, "after step 2")
    local sd = opt:state_dict()
    assert.are.equal(2, sd.step)
    assert.are.equal(0.1, sd.lr)
    assert.are.equal(0.9, sd.hyper.momentum)
    assert_close(sd.state["1"].momentum_buffer, buf, 1e-6, "momentum buffer")
  end)

  it("without momentum is plain gradient descent and keeps no buffer", function()
    local p = param{2, 4}
    local opt = optim.SGD({p}, {lr = 0.5})
    quad_backward({p}, {{1, 1}})
    opt:step()
    assert_close(p, {1, 2}, 1e-7, "p")
    assert.is_nil(opt:state_dict().state["1"].momentum_buffer)
  end)

  it("skips parameters without a gradient and follows opt.lr", function()
    local m = nn.Sequential{nn.Linear(2, 2), nn.Linear(2, 2)}
    local opt = optim.SGD(m, {lr = 0.1})
    local w1, w2 = m[1].weight:clone(), m[2].weight:clone()
    m[1](fsdp.ones{1, 2}):sum():backward() -- only the first layer gets gradients
    assert.is_nil(m[2].weight.grad)
    opt.lr = 0
    opt:step()
    assert_close(m[1].weight, w1, 0, "lr 0 leaves weights")
    opt.lr = 0.1
    opt:step()
    assert.is_false(pcall(assert_close, m[1].weight, w1, 0))
    assert_close(m[2].weight, w2, 0, "no gradient, no update")
    local st = opt:state_dict().state
    assert.is_not_nil(st["1.weight"])
    assert.is_nil(st["2.weight"])
  end)

  it("updates a parameter listed twice once", function()
    local p = param{2, 4}
    local opt = optim.SGD({p, p}, {lr = 0.5})
    quad_backward({p}, {{1, 1}})
    opt:step()
    assert_close(p, {1, 2}, 1e-7, "p")
  end)

  it("rejects bad options", function()
    local err = H.assert_error_has
    err(function() optim.SGD({param{1}}, {}) end, "SGD: lr must be a number >= 0 (got nil)")
    err(function() optim.SGD({param{1}}, {lr = -1}) end, "SGD: lr must be a number >= 0 (got -1)")
    err(function() optim.SGD(3, {lr = 1}) end, "expected a module or an array of parameters")
    err(function() optim.SGD({param{1}}, {lr = 1, momentum = -0.5}) end,
      "SGD: momentum must be a number >= 0 (got -0.5)")
    err(function() optim.SGD({param{1}}, {lr = 1, nesterov = true}) end,
      "SGD: nesterov needs a momentum > 0")
    err(function() optim.SGD({param{1}}, {lr = 1, momentum = 0.9, nesterov = 1}) end,
      "SGD: nesterov must be a boolean (got 1)")
    err(function() optim.SGD({param{1}}, {lr = 1, wieght_decay = 0.1}) end,
      "SGD: unknown option 'wieght_decay' (valid: groups, local_only, lr, max_grad_norm, "
      .. "momentum, nesterov, no_decay, params, weight_decay)")
  end)
end)

describe("optim.AdamW", function()
  -- hand-computed AdamW (PyTorch): p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  -- p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
  local function adamw_ref(p, m, v, g, t, lr, b1, b2, eps, wd)
    local np, nm, nv = {}, {}, {}
    for i = 1, #p do
      local pi = p[i] * (1 - lr * wd)
      nm[i] = b1 * m[i] + (1 - b1) * g[i]
      nv[i] = b2 * v[i] + (1 - b2) * g[i] * g[i]
      local denom = math.sqrt(nv[i]) / math.sqrt(1 - b2 ^ t) + eps
      np[i] = pi - lr / (1 - b1 ^ t) * nm[i] / denom
    end
    return np, nm, nv
  end

  it("matches two hand-computed steps, with decay on matrices only", function()
    local lr, b1, b2, eps, wd = 0.1, 0.9, 0.99, 1e-8, 0.1
    local W0, b0 = {{1, -2}, {3, 0.5}}, {1, -1}
    local cW, cb = {{0.5, 1}, {-1, 2}}, {3, -0.25}
    local W, b = param(W0), param(b0)
    local opt = optim.AdamW({W, b}, {lr = lr, betas = {b1, b2}, eps = eps, weight_decay = wd})
    assert.are.same({"2"}, opt.no_decay_paths) -- the 1-D parameter
    local pw, pb = flat(W0), flat(b0)
    local mw, vw, mb, vb = {0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0}, {0, 0}
    for t = 1, 2 do
      local gw = map2(flat(cW), pw, function(c, x) return c * x end)
      local gb = map2(cb, pb, function(c, x) return c * x end)
      pw, mw, vw = adamw_ref(pw, mw, vw, gw, t, lr, b1, b2, eps, wd)
      pb, mb, vb = adamw_ref(pb, mb, vb, gb, t, lr, b1, b2, eps, 0)
      opt:zero_grad()
      quad_backward({W, b}, {cW, cb})
      opt:step()
      assert_close(W, pw, 1e-5, "W after step " .. t)
      assert_close(b, pb, 1e-5, "b after step " .. t)
    end
    local sd = opt:state_dict()
    assert.are.equal("AdamW", sd.kind)
    assert.are.equal(2, sd.step)
    assert.are.same({b1, b2}, sd.hyper.betas)
    assert.are.equal(2, sd.state["1"].step)
    assert_close(sd.state["1"].exp_avg, mw, 1e-5, "exp_avg")
    assert_close(sd.state["2"].exp_avg_sq, vb, 1e-5, "exp_avg_sq")
  end)

  it("exempts biases and norms from weight decay by default, or as no_decay says", function()
    local function run(opts)
      fsdp.manual_seed(1)
      local m = nn.Sequential{nn.Linear(3, 3), nn.LayerNorm(3)}
      local before = {}
      for path, p in m:named_parameters() do
        p:fill(0.7) -- nonzero everywhere, so that decay always shows
        before[path] = p:clone()
      end
      opts.lr, opts.weight_decay = 0.1, 0.5
      local opt = optim.AdamW(m, opts)
      ;(m(fsdp.ones{2, 3}):sum() * 0):backward() -- zero gradients: only decay moves weights
      opt:step()
      local scaled = {}
      for path, p in m:named_parameters() do
        local expect = before[path] * 0.95 -- 1 - lr * wd
        if pcall(assert_close, p, expect, 1e-6) then
          scaled[#scaled + 1] = path
        else
          assert_close(p, before[path], 0, path .. " unchanged")
        end
      end
      return scaled, opt.no_decay_paths
    end
    local scaled, exempt = run{}
    assert.are.same({"1.weight"}, scaled)
    assert.are.same({"1.bias", "2.weight", "2.bias"}, exempt)
    scaled = run{no_decay = function(path) return path:match("^2%.") ~= nil end}
    assert.are.same({"1.weight", "1.bias"}, scaled)
  end)

  it("restores its state from a state_dict", function()
    local function fresh() return param{{1, 2}, {-3, 4}} end
    local c = {{1, 2}, {0.5, -1}}
    local pa = fresh()
    local a = optim.AdamW({pa}, {lr = 0.05})
    for _ = 1, 2 do
      a:zero_grad()
      quad_backward({pa}, {c})
      a:step()
    end
    local pb = fresh()
    local b = optim.AdamW({pb}, {lr = 0.05})
    quad_backward({pb}, {c})
    b:step()
    local sd = b:state_dict()
    local b2 = optim.AdamW({pb}, {lr = 1})
    b2:load_state_dict(sd)
    assert.are.equal(0.05, b2.lr)
    b2:zero_grad()
    quad_backward({pb}, {c})
    b2:step()
    assert_close(pb, pa, 1e-6, "resumed")
    assert.has_error(function() b2:load_state_dict(optim.SGD({pb}, {lr = 1}):state_dict()) end)
  end)
end)

describe("optim.clip_grad_norm", function()
  it("returns the total norm and scales gradients above max_norm", function()
    local p, q, unused = param{1, 1}, param{1, 1, 1}, param{5}
    local function grads()
      p.grad, q.grad = nil, nil
      ;((p * fsdp.tensor{3, 4}):sum() + (q * fsdp.tensor{0, 0, 12}):sum()):backward()
    end
    grads()
    local total = optim.clip_grad_norm({p, q, unused}, 100)
    assert_close(total, 13, 1e-6, "total")
    assert_close(p.grad, {3, 4}, 0, "below max_norm: unchanged")
    total = fsdp.clip_grad_norm({p, q, unused}, 1)
    assert_close(total, 13, 1e-6, "total before clipping")
    assert_close(p.grad, {3 / 13, 4 / 13}, 1e-5, "clipped p")
    assert_close(q.grad, {0, 0, 12 / 13}, 1e-5, "clipped q")
    assert_close(optim.clip_grad_norm({p, q}, 1), 1, 1e-5, "norm after clipping")
    assert.is_nil(unused.grad)
  end)

  it("works on a module", function()
    local m = nn.Linear(2, 1)
    m.weight:copy(fsdp.tensor{{1, 1}})
    m(fsdp.tensor{{3, 4}}):sum():backward() -- grads: weight (3, 4), bias 1
    assert_close(optim.clip_grad_norm(m, 1e9), math.sqrt(26), 1e-6, "norm")
  end)

  it("names the parameter when its update or its saved state fails", function()
    local m = nn.Linear(2, 2)
    m:to("bf16")
    local o = optim.AdamW(m)
    m(fsdp.ones({1, 2}, {dtype = "bf16"})):sum():backward()
    H.assert_error_has(function() o:step() end, "optim_spec.lua:",
      "AdamW: parameter weight is bf16, but AdamW's update kernel takes f32 parameters only")
    -- an update that fails while it runs is named too
    local f = nn.Linear(2, 2)
    local of = optim.AdamW(f)
    f(fsdp.ones{1, 2}):sum():backward()
    local kernel = fsdp.core.adamw_step
    fsdp.core.adamw_step = function() error("adamw_step: a failing kernel", 0) end
    local ok, err = pcall(of.step, of)
    fsdp.core.adamw_step = kernel
    assert.is_false(ok)
    assert.truthy(tostring(err):find("AdamW: parameter weight: adamw_step: a failing kernel", 1,
      true), tostring(err))
    local a = nn.Linear(2, 2)
    local oa = optim.AdamW(a)
    a(fsdp.ones{1, 2}):sum():backward()
    oa:step()
    local b = nn.Linear(3, 3)
    local ob = optim.AdamW(b)
    H.assert_error_has(function() ob:load_state_dict(oa:state_dict()) end, "optim_spec.lua:",
      "load_state_dict: ", ": copy: shape mismatch")
    local ok, err = pcall(ob.load_state_dict, ob, oa:state_dict())
    assert.is_false(ok)
    assert.truthy(err:find("load_state_dict: weight: exp_avg", 1, true)
      or err:find("load_state_dict: bias: exp_avg", 1, true), err)
  end)

  it("load_state_dict that fails half way leaves the optimizer as it was", function()
    -- a's weight has b's shape, a's bias does not: whichever comes first, nothing changes
    local a = nn.Sequential{nn.Linear(2, 2), nn.Linear(2, 3)}
    local oa = optim.AdamW(a, {lr = 0.5})
    a(fsdp.ones{1, 2}):sum():backward()
    oa:step()
    oa:step()
    local b = nn.Sequential{nn.Linear(2, 2), nn.Linear(2, 2)}
    local ob = optim.AdamW(b, {lr = 0.1})
    b(fsdp.ones{1, 2}):sum():backward()
    ob:step()
    local before = ob:state_dict()
    local kept = {}
    for path, st in pairs(before.state) do kept[path] = flat(st.exp_avg) end
    H.assert_error_has(function() ob:load_state_dict(oa:state_dict()) end, "load_state_dict: 2.")
    local after = ob:state_dict()
    assert.are.equal(1, after.step)
    assert.are.equal(0.1, ob.lr)
    local n = 0
    for path, st in pairs(after.state) do
      n = n + 1
      assert.are.equal(1, st.step, path)
      assert.are.same(kept[path], flat(st.exp_avg), path)
    end
    assert.are.equal(4, n)
  end)

  it("refuses a limit that is not a finite number > 0, as max_grad_norm does", function()
    local m = nn.Linear(2, 1)
    m(fsdp.tensor{{3, 4}}):sum():backward()
    for _, v in ipairs{0, -1, 0 / 0, math.huge, "1"} do
      H.assert_error_has(function() optim.clip_grad_norm(m, v) end,
        "clip_grad_norm: max_norm must be a finite number > 0 (got " .. tostring(v) .. ")")
    end
  end)

  it("names itself when refusing what it was given, a part of a wrapped model too", function()
    H.assert_error_has(function() optim.clip_grad_norm(5, 1.0) end,
      "clip_grad_norm: expected a module or an array of parameters (got number)")
    H.assert_error_has(function() fsdp.clip_grad_norm({5}, 1.0) end,
      "clip_grad_norm: parameter 1 is not a tensor (got number)")
    local m = nn.Sequential{nn.Linear(4, 4), nn.Linear(4, 2)}
    fsdp.wrap(m, {policy = fsdp.policy.list{m[1], m[2]}})
    m(fsdp.ones{2, 4}):sum():backward()
    H.assert_error_has(function() fsdp.clip_grad_norm(m[1], 1.0) end,
      "clip_grad_norm: this Linear is part of a wrapped model: pass the wrapped root "
      .. "(a Sequential)")
    H.assert_error_has(function() fsdp.clip_grad_norm({m[1].weight}, 1.0) end,
      "clip_grad_norm: parameter 1 is sharded (its model is wrapped): pass the wrapped model")
    assert.truthy(fsdp.clip_grad_norm(m, 1e9) > 0)
  end)
end)

describe("max_grad_norm", function()
  -- a small MLP, its loss on a fixed batch; every optimizer kind gets the same start
  local function mlp()
    fsdp.manual_seed(7)
    return nn.Sequential{nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)}
  end
  local x, y = fsdp.randn{6, 5}, fsdp.tensor({0, 2, 1, 1, 0, 2}, {dtype = "i64"})
  local function backward(m) nn.F.cross_entropy(m(x), y):backward() end
  local function params(m)
    local out = {}
    for _, e in ipairs(optim.named_params(m)) do out[#out + 1] = flat(e.param) end
    return out
  end
  local kinds = {
    {"AdamW", {lr = 1e-2, weight_decay = 0.1}}, {"Adam", {lr = 1e-2, weight_decay = 0.05}},
    {"Adam", {lr = 1e-2}}, {"SGD", {lr = 0.1, momentum = 0.9}}, {"Lion", {lr = 1e-3}},
  }
  -- One step of each way from fresh gradients (edit(model) may change them first): oa (made
  -- with max_grad_norm) steps on a, clip_grad_norm(b, max) then ob steps on b; the norm
  -- clip_grad_norm returned.
  local function step_both(a, oa, b, ob, max, edit)
    oa:zero_grad()
    ob:zero_grad()
    backward(a)
    backward(b)
    if edit then edit(a) edit(b) end
    oa:step()
    local total = optim.clip_grad_norm(b, max)
    ob:step()
    return total
  end

  it("equals clip_grad_norm then the step, bit for bit, and keeps the norm", function()
    for _, k in ipairs(kinds) do
      for _, max in ipairs{0.05, 1e9} do -- clipping, and a norm below the limit
        local a, b = mlp(), mlp()
        local oa = optim[k[1]](a, setmetatable({max_grad_norm = max}, {__index = k[2]}))
        local ob = optim[k[1]](b, k[2])
        for step = 1, 3 do
          local total = step_both(a, oa, b, ob, max)
          assert.are.equal(total, oa.grad_norm)
          if max < 1 then assert.is_true(total > max, "the test clips") end
          assert.are.same(params(b), params(a), ("%s max %g step %d"):format(k[1], max, step))
        end
      end
    end
  end)

  it("an infinite gradient norm: the same bits as clip_grad_norm then the step (NaN weights)", function()
    -- every number as text, so that NaNs compare (their sign included)
    local function text(ts)
      local out = {}
      for i, t in ipairs(ts) do
        out[i] = {}
        for j, v in ipairs(t) do out[i][j] = tostring(v) end
      end
      return out
    end
    for _, k in ipairs(kinds) do
      local a, b = mlp(), mlp()
      local oa = optim[k[1]](a, setmetatable({max_grad_norm = 0.05}, {__index = k[2]}))
      local ob = optim[k[1]](b, k[2])
      for step = 1, 2 do
        local total = step_both(a, oa, b, ob, 0.05, step == 2 and function(m)
          m[1].weight.grad:set(2, 3, math.huge)
        end)
        assert.are.equal(total, oa.grad_norm)
        assert.are.same(text(params(b)), text(params(a)), ("%s step %d"):format(k[1], step))
      end
      assert.are.equal(math.huge, oa.grad_norm)
      assert.is_true(flat(a[1].weight)[(2 - 1) * 5 + 3] ~= flat(a[1].weight)[(2 - 1) * 5 + 3],
        k[1] .. ": the infinite element's weight is NaN")
    end
  end)

  it("leaves AdamW's gradients unscaled (the kernel takes the coefficient); SGD's are scaled", function()
    local a, b = mlp(), mlp()
    local oa = optim.AdamW(a, {lr = 1e-2, max_grad_norm = 0.05})
    local ob = optim.SGD(b, {lr = 0.1, max_grad_norm = 0.05})
    backward(a)
    backward(b)
    local ga, gb = flat(a[1].weight.grad), flat(b[1].weight.grad)
    oa:step()
    ob:step()
    assert.are.same(ga, flat(a[1].weight.grad))
    local coef = 0.05 / (ob.grad_norm + 1e-6)
    assert_close(flat(b[1].weight.grad), map2(gb, gb, function(g) return g * coef end), 1e-6,
      "SGD's gradient scaled in place")
  end)

  it("masks before measuring, as clip_grad_norm does", function()
    local a, b = mlp(), mlp()
    local mk = fsdp.tensor{{1, 0, 1, 0, 1}, {0, 1, 1, 1, 0}, {1, 1, 0, 0, 1}, {1, 0, 0, 1, 1},
      {0, 0, 1, 1, 1}, {1, 1, 1, 0, 0}, {0, 1, 0, 1, 0}, {1, 0, 1, 1, 1}}
    fsdp.set_mask(a[1].weight, mk)
    fsdp.set_mask(b[1].weight, mk)
    local oa = optim.AdamW(a, {lr = 1e-2, max_grad_norm = 0.05})
    local ob = optim.AdamW(b, {lr = 1e-2})
    for _ = 1, 2 do
      assert.are.equal(step_both(a, oa, b, ob, 0.05), oa.grad_norm)
      assert.are.same(params(b), params(a))
    end
  end)

  it("refuses a bad limit and Adafactor, naming them", function()
    local err = H.assert_error_has
    for _, v in ipairs{0, -1, 0 / 0, math.huge, "1"} do
      err(function() optim.AdamW(mlp(), {max_grad_norm = v}) end,
        "AdamW: max_grad_norm must be a finite number > 0 (got " .. tostring(v) .. ")")
    end
    err(function() optim.Adafactor(mlp(), {max_grad_norm = 1}) end,
      "Adafactor: max_grad_norm is not supported")
  end)
end)

describe("optim.cosine", function()
  it("warms up linearly, then follows a cosine down to min_lr", function()
    local opt = optim.SGD({param{1}}, {lr = 1})
    local s = optim.cosine(opt, {warmup = 10, total = 110, min_lr = 0.1})
    assert.are.equal(0, opt.lr) -- s:lr(0)
    assert_close(s:lr(5), 0.5, 1e-12, "warmup middle")
    assert_close(s:lr(10), 1, 1e-12, "warmup end")
    assert_close(s:lr(35), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 1e-12, "quarter")
    assert_close(s:lr(60), 0.55, 1e-12, "half way")
    assert_close(s:lr(110), 0.1, 1e-12, "end")
    assert_close(s:lr(500), 0.1, 1e-12, "after the end")
    for _ = 1, 5 do s:step() end
    assert_close(opt.lr, 0.5, 1e-12, "opt.lr after 5 steps")
    local sd = s:state_dict()
    assert.are.equal(5, sd.step)
    assert.are.equal(10, sd.warmup)
    assert.are.equal(110, sd.total)
  end)

  it("without warmup starts at lr", function()
    local opt = optim.AdamW({param{1}}, {lr = 0.3})
    local s = optim.cosine(opt, {total = 4})
    assert.are.equal(0.3, opt.lr)
    s:step()
    assert_close(opt.lr, 0.15 * (1 + math.cos(math.pi / 4)), 1e-12, "step 1")
    s:step()
    assert_close(opt.lr, 0.15, 1e-12, "step 2")
  end)
end)

-- fn raises an error whose message holds text (plain).
local function raises(text, fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok, "expected an error holding: " .. text)
  assert.is_truthy(tostring(err):find(text, 1, true), ("%q does not hold %q"):format(tostring(err), text))
end

-- s:lr(k) for each k of want ({[k] = value}).
local function check_lrs(s, want)
  for k, v in pairs(want) do assert_close(s:lr(k), v, 1e-12, s.kind .. " at k = " .. k) end
end

describe("optim.linear", function()
  it("warms up linearly, then decays linearly to min_lr at total", function()
    local opt = optim.SGD({param{1}}, {lr = 1})
    local s = optim.linear(opt, {warmup = 10, total = 110, min_lr = 0.1})
    assert.are.equal(0, opt.lr)
    check_lrs(s, {[0] = 0, [5] = 0.5, [10] = 1, [11] = 0.1 + 0.9 * 99 / 100, [60] = 0.55,
      [109] = 0.1 + 0.9 / 100, [110] = 0.1, [500] = 0.1})
    for _ = 1, 11 do s:step() end
    assert_close(opt.lr, 0.991, 1e-12, "opt.lr after 11 steps")
  end)

  it("without warmup starts at lr and reaches 0 by default", function()
    local opt = optim.AdamW({param{1}}, {lr = 0.3})
    local s = optim.linear(opt, {total = 4})
    assert.are.equal(0.3, opt.lr)
    check_lrs(s, {[1] = 0.225, [2] = 0.15, [4] = 0, [5] = 0})
  end)
end)

describe("optim.constant", function()
  it("warms up linearly to lr, then holds it", function()
    local opt = optim.SGD({param{1}}, {lr = 1})
    local s = optim.constant(opt, {warmup = 4, lr = 2})
    assert.are.equal(0, opt.lr)
    check_lrs(s, {[0] = 0, [1] = 0.5, [4] = 2, [5] = 2, [10 ^ 6] = 2})
    s:step()
    assert.are.equal(0.5, opt.lr)
  end)

  it("without warmup is opt.lr throughout", function()
    local opt = optim.SGD({param{1}}, {lr = 0.7})
    local s = optim.constant(opt)
    assert.are.equal(0.7, opt.lr)
    check_lrs(s, {[0] = 0.7, [1] = 0.7, [1000] = 0.7})
  end)
end)

describe("optim.step_lr", function()
  it("multiplies lr by gamma every step_size steps after warmup", function()
    local opt = optim.SGD({param{1}}, {lr = 1})
    local s = optim.step_lr(opt, {step_size = 3, gamma = 0.5, warmup = 2})
    assert.are.equal(0, opt.lr)
    check_lrs(s, {[0] = 0, [1] = 0.5, [2] = 1, [3] = 1, [4] = 1, [5] = 0.5, [7] = 0.5,
      [8] = 0.25, [11] = 0.125})
  end)

  it("defaults to gamma 0.1 and no warmup (PyTorch's StepLR)", function()
    local opt = optim.SGD({param{1}}, {lr = 2})
    local s = optim.step_lr(opt, {step_size = 2})
    assert.are.equal(2, opt.lr)
    check_lrs(s, {[1] = 2, [2] = 0.2, [3] = 0.2, [4] = 0.02, [9] = 2e-4})
  end)
end)

describe("optim.wsd", function()
  it("warms up, holds lr, then decays linearly over the last decay fraction", function()
    local opt = optim.SGD({param{1}}, {lr = 1})
    local s = optim.wsd(opt, {warmup = 10, total = 100, min_lr = 0.1}) -- decay 0.2: from step 80
    assert.are.equal(0, opt.lr)
    check_lrs(s, {[0] = 0, [5] = 0.5, [10] = 1, [11] = 1, [80] = 1, [81] = 0.1 + 0.9 * 19 / 20,
      [90] = 0.55, [99] = 0.1 + 0.9 / 20, [100] = 0.1, [150] = 0.1})
  end)

  it("takes the decay fraction; decay = 0 holds lr up to total", function()
    local opt = optim.SGD({param{1}}, {lr = 1})
    local s = optim.wsd(opt, {total = 100, decay = 0.5})
    assert.are.equal(1, opt.lr)
    check_lrs(s, {[50] = 1, [75] = 0.5, [100] = 0})
    s = optim.wsd(opt, {total = 100, decay = 0})
    check_lrs(s, {[99] = 1, [100] = 0, [101] = 0})
  end)
end)

describe("optim.lambda", function()
  it("sets opt.lr = fn(k)", function()
    local opt = optim.SGD({param{1}}, {lr = 1})
    local s = optim.lambda(opt, function(k) return 0.5 ^ k * 3 end)
    assert.are.equal(3, opt.lr)
    check_lrs(s, {[1] = 1.5, [3] = 0.375})
    s:step()
    assert.are.equal(1.5, opt.lr)
  end)

  it("raises naming the step when fn returns a non-number, NaN or a negative number", function()
    local opt = optim.SGD({param{1}}, {lr = 1})
    local s = optim.lambda(opt, function(k) if k == 2 then return "x" end return 1 end)
    s:step()
    raises("lambda: fn(2) must return a number >= 0 (got x)", s.step, s)
    raises("fn(0) must return a number >= 0 (got nan)", optim.lambda, opt, function() return 0 / 0 end)
    raises("fn(0) must return a number >= 0 (got -1)", optim.lambda, opt, function() return -1 end)
    raises("fn(0) must return a number >= 0 (got nil)", optim.lambda, opt, function() end)
    raises("lambda: second argument must be a function of the step (got table)", optim.lambda, opt, {})
  end)
end)

describe("learning-rate schedules", function()
  local make = {
    cosine = function(opt) return optim.cosine(opt, {warmup = 2, total = 10, min_lr = 0.01}) end,
    linear = function(opt) return optim.linear(opt, {warmup = 2, total = 10, min_lr = 0.01}) end,
    constant = function(opt) return optim.constant(opt, {warmup = 2}) end,
    step_lr = function(opt) return optim.step_lr(opt, {warmup = 2, step_size = 2, gamma = 0.5}) end,
    wsd = function(opt) return optim.wsd(opt, {warmup = 2, total = 10, decay = 0.5, min_lr = 0.01}) end,
    lambda = function(opt) return optim.lambda(opt, function(k) return 1 / (k + 1) end) end,
  }

  it("round-trip through state_dict / load_state_dict", function()
    for kind, mk in pairs(make) do
      local opt = optim.SGD({param{1}}, {lr = 1})
      local s = mk(opt)
      for _ = 1, 3 do s:step() end
      local opt2 = optim.SGD({param{1}}, {lr = 5})
      local s2 = make[kind](opt2)
      s2.base_lr = 7 -- load_state_dict restores it
      s2:load_state_dict(s:state_dict())
      assert.are.equal(kind, s2:state_dict().kind)
      assert.are.equal(3, s2.k, kind)
      assert.are.equal(opt.lr, opt2.lr, kind)
      for _ = 1, 4 do assert.are.equal(s:step(), s2:step(), kind) end
    end
  end)

  it("refuses another kind's state_dict", function()
    local opt = optim.SGD({param{1}}, {lr = 1})
    local s = optim.linear(opt, {total = 10})
    raises("linear: load_state_dict: expected a linear schedule's state_dict (got cosine)",
      s.load_state_dict, s, optim.cosine(opt, {total = 10}):state_dict())
    raises("(got number)", s.load_state_dict, s, 3)
  end)

  it("refuse a state_dict they cannot take whole, changing nothing (load_problem: why)", function()
    for kind, mk in pairs(make) do
      local opt = optim.SGD({param{1}}, {lr = 1})
      local s = mk(opt)
      s:step()
      local good = s:state_dict()
      good.step = 3
      assert.is_nil(s:load_problem(good), kind)
      local function bad(change, want)
        local sd = {}
        for k, v in pairs(good) do sd[k] = v end
        change(sd)
        local before, lr = s:state_dict(), opt.lr
        assert.are.equal(want, s:load_problem(sd), kind)
        raises(kind .. ": load_state_dict: " .. want, s.load_state_dict, s, sd)
        assert.are.same(before, s:state_dict(), kind)
        assert.are.equal(lr, opt.lr, kind)
      end
      bad(function(sd) sd.step = -1 end, "step must be an integer >= 0 (got -1)")
      bad(function(sd) sd.step = 1.5 end, "step must be an integer >= 0 (got 1.5)")
      bad(function(sd) sd.lr = nil end, "lr must be a number >= 0 (got nil)")
      bad(function(sd) sd.warmup = "2" end, "warmup must be a number >= 0 (got 2)")
      if good.total then
        bad(function(sd) sd.total = nil end, "total must be a number >= 0 (got nil)")
        bad(function(sd) sd.total = 1 end, "warmup (2) must be <= total (1)")
      end
      -- the kinds' own rules, as when made
      if kind == "step_lr" then
        bad(function(sd) sd.step_size = 0 end, "step_size must be a number >= 1 (got 0)")
      end
      if kind == "wsd" then
        bad(function(sd) sd.decay = 0.9 end,
          "warmup (2) must end before the decay phase starts (step 1 of 10)")
      end
    end
    -- a lambda's function runs on the saved step: one made for fewer steps refuses it
    local opt = optim.SGD({param{1}}, {lr = 1})
    local s = optim.lambda(opt, function(k)
      if k > 2 then error("made for 2 steps", 0) end
      return 1 / (k + 1)
    end)
    local sd = {kind = "lambda", step = 3, lr = 1, warmup = 0}
    assert.are.equal("the learning rate at step 3: made for 2 steps", s:load_problem(sd))
    raises("lambda: load_state_dict: the learning rate at step 3: made for 2 steps",
      s.load_state_dict, s, sd)
    assert.are.equal(0, s.k)
    assert.are.equal(1, opt.lr)
  end)

  it("check their arguments", function()
    local opt = optim.SGD({param{1}}, {lr = 1})
    for kind, mk in pairs(make) do
      raises(kind .. ": first argument must be an optimizer", mk, {})
    end
    local base = {cosine = {total = 1}, linear = {total = 1}, constant = {},
      step_lr = {step_size = 1}, wsd = {total = 1}}
    local function with(kind, t)
      local o = {}
      for k, v in pairs(base[kind]) do o[k] = v end
      for k, v in pairs(t) do o[k] = v end
      return o
    end
    for _, kind in ipairs{"cosine", "linear", "constant", "step_lr", "wsd"} do
      raises(kind .. ": second argument must be an options table (got number)", optim[kind], opt, 3)
      raises(kind .. ": warmup must be a number >= 0 (got -1)", optim[kind], opt, with(kind, {warmup = -1}))
      raises(kind .. ": lr must be a number >= 0 (got nan)", optim[kind], opt, with(kind, {lr = 0 / 0}))
      raises(kind .. ": unknown option 'wamrup' (valid: ", optim[kind], opt, with(kind, {wamrup = 3}))
    end
    raises("step_lr: unknown option 'total' (valid: gamma, lr, step_size, warmup)", optim.step_lr, opt,
      {step_size = 1, total = 5})
    for _, kind in ipairs{"cosine", "linear", "wsd"} do
      raises(kind .. ": total must be a number >= 0 (got nil)", optim[kind], opt, {})
      raises(kind .. ": min_lr must be a number >= 0 (got -0.5)", optim[kind], opt, {total = 5, min_lr = -0.5})
    end
    for _, kind in ipairs{"cosine", "linear"} do
      raises(kind .. ": warmup (11) must be <= total (10)", optim[kind], opt, {total = 10, warmup = 11})
    end
    raises("step_lr: step_size must be a number >= 1 (got nil)", optim.step_lr, opt, {})
    raises("step_lr: step_size must be a number >= 1 (got 0)", optim.step_lr, opt, {step_size = 0})
    raises("step_lr: gamma must be a number >= 0 (got -1)", optim.step_lr, opt, {step_size = 1, gamma = -1})
    raises("wsd: decay must be a number in [0, 1] (got 1.5)", optim.wsd, opt, {total = 10, decay = 1.5})
    raises("wsd: decay must be a number in [0, 1] (got -0.1)", optim.wsd, opt, {total = 10, decay = -0.1})
    raises("wsd: warmup (9) must end before the decay phase starts (step 8 of 10)",
      optim.wsd, opt, {total = 10, warmup = 9})
    assert.are.equal(1, opt.lr) -- a failed constructor leaves opt.lr alone
  end)
end)

describe("optimizer state accounting", function()
  it("files AdamW moments under the optim role of fsdp.memory()", function()
    collectgarbage()
    local before = fsdp.memory().optim
    local m = nn.Linear(10, 20)
    local opt = fsdp.optim.AdamW(m, { lr = 1e-3 })
    m(fsdp.randn { 3, 10 }):sum():backward()
    opt:step()
    -- two moments per parameter: (20*10 + 20) floats each
    assert.are.equal(before + 2 * 4 * (20 * 10 + 20), fsdp.memory().optim)
  end)
end)

describe("gradients the optimizer reads", function()
  local function grads() return fsdp.memory().grads end

  it("are freed by zero_grad, not left for Lua's collector", function()
    collectgarbage()
    local before = grads()
    local m = nn.Linear(16, 32)
    local opt = fsdp.optim.AdamW(m, {lr = 1e-3})
    local x = fsdp.randn{4, 16}
    for _ = 1, 3 do
      opt:zero_grad()
      m(x):sum():backward()
      optim.clip_grad_norm(m, 1.0)
      opt:step()
      assert.are.equal(before + (16 * 32 + 32) * 4, grads())
    end
    opt:zero_grad()
    assert.are.equal(before, grads())
  end)

  it("stay readable where the program holds them", function()
    local m = nn.Linear(3, 2)
    local opt = fsdp.optim.SGD(m, {lr = 0.1})
    m(fsdp.ones{1, 3}):sum():backward()
    local g = m.weight.grad
    local want = flat(g)
    optim.clip_grad_norm(m, 100)
    opt:step()
    opt:zero_grad()
    assert.is_nil(m.weight.grad)
    assert.are.same(want, flat(g)) -- the program's value outlives zero_grad, unchanged
  end)

  it("come from fsdp.core.grad_of, which says whether it made the value", function()
    local p = nn.Parameter(fsdp.ones{2})
    local none, made = fsdp.core.grad_of(p)
    assert.is_nil(none)
    assert.is_false(made)
    local loss = (p * p):sum()
    loss:backward()
    local g, fresh = fsdp.core.grad_of(p)
    assert.is_true(fresh)
    local g2, fresh2 = fsdp.core.grad_of(p)
    assert.is_true(rawequal(g, g2))
    assert.is_false(fresh2)
    assert.are.same({2, 2}, flat(g))
  end)
end)

-- ---- against torch.optim (tests/lua/fixtures/gen_optim_torch.py) ---------------------------

local REF = require "fixtures.optim_torch"

local Three = nn.Module:extend("Three")
function Three:init()
  for _, k in ipairs{"w", "t", "b"} do
    self[k] = nn.Parameter(fsdp.tensor(REF.params[k]):view(REF.shapes[k]))
  end
end
-- sum(p * G) over the three: the gradients are step i's of the fixture
function Three:forward(i)
  local loss
  for _, k in ipairs{"w", "t", "b"} do
    local term = (self[k] * fsdp.tensor(REF.grads[i][k]):view(REF.shapes[k])):sum()
    loss = loss and loss + term or term
  end
  return loss
end

local function fixture_backward(m, i) m(i):backward() end

local TORCH_CASES = {
  sgd = function(m) return optim.SGD(m, {lr = 0.1, momentum = 0.9, weight_decay = 0.01}) end,
  sgd_nesterov = function(m)
    return optim.SGD(m, {lr = 0.1, momentum = 0.9, nesterov = true, weight_decay = 0.01})
  end,
  adam = function(m) return optim.Adam(m, {lr = 1e-2, betas = {0.9, 0.99}, weight_decay = 0.1}) end,
  adamw = function(m) return optim.AdamW(m, {lr = 1e-2, weight_decay = 0.1}) end,
  adamw_groups = function(m)
    return optim.AdamW(m, {lr = 1e-2, weight_decay = 0.1,
      groups = {{params = "^b$", weight_decay = 0}, {params = {"^t$"}, lr = 1e-3}}})
  end,
  lion = function(m) return optim.Lion(m, {lr = 1e-3, betas = {0.9, 0.99}, weight_decay = 0.1}) end,
  adafactor = function(m) return optim.Adafactor(m, {lr = 1e-2, weight_decay = 0.1}) end,
}

local function check_case(name, wrap)
  local m = Three()
  if wrap then fsdp.wrap(m) end
  local opt = TORCH_CASES[name](m)
  for i = 1, #REF.grads do
    opt:zero_grad()
    fixture_backward(m, i)
    opt:step()
    local got = {}
    fsdp.full_params(m, function()
      for _, k in ipairs{"w", "t", "b"} do got[k] = H.flat_view(m[k]) end
    end)
    for _, k in ipairs{"w", "t", "b"} do
      assert_close(got[k], REF.cases[name][i][k], 2e-6, ("%s step %d %s"):format(name, i, k))
    end
  end
  if wrap then fsdp.unwrap(m) end
  return opt
end

describe("optimizers against torch.optim", function()
  for _, name in ipairs{"sgd", "sgd_nesterov", "adam", "adamw", "adamw_groups", "lion", "adafactor"} do
    it(name .. ": three steps, plain model", function() check_case(name, false) end)
    it(name .. ": three steps, wrapped model (its shards)", function() check_case(name, true) end)
  end
end)

describe("optimizer options", function()
  local err = H.assert_error_has
  local function p2() return {param{{1, 2}, {3, 4}}, param{1, 2}} end

  it("refuse unknown keys and out-of-range numbers, naming them", function()
    for _, kind in ipairs{"Adam", "AdamW", "Lion", "Adafactor"} do
      err(function() optim[kind](p2(), {wieght_decay = 0.1}) end,
        kind .. ": unknown option 'wieght_decay' (valid: ")
      err(function() optim[kind](p2(), {lr = -1e-3}) end, kind .. ": lr must be a number >= 0 (got -0.001)")
      err(function() optim[kind](p2(), {weight_decay = -1}) end,
        kind .. ": weight_decay must be a number >= 0 (got -1)")
      err(function() optim[kind](p2(), 5) end, kind .. ": expects an options table")
      err(function() optim[kind](p2(), {local_only = "yes"}) end, kind .. ": local_only must be a boolean")
      err(function() optim[kind](nil, {}) end,
        kind .. ": expected a module or an array of parameters (got nil)")
      err(function() optim[kind]({p2()[1], 3}, {}) end, kind .. ": parameter 2 is not a tensor (got number)")
    end
    for _, kind in ipairs{"Adam", "AdamW", "Lion"} do
      err(function() optim[kind](p2(), {betas = {0.9, 1}}) end,
        kind .. ": betas must be {beta1, beta2}, each in [0, 1) (got {0.9, 1})")
      err(function() optim[kind](p2(), {betas = {-0.1, 0.9}}) end, kind .. ": betas must be")
      err(function() optim[kind](p2(), {betas = 0.9}) end, kind .. ": betas must be")
    end
    err(function() optim.AdamW(p2(), {eps = -1}) end, "AdamW: eps must be a number >= 0 (got -1)")
    err(function() optim.Adafactor(p2(), {beta2_decay = 0.5}) end,
      "Adafactor: beta2_decay must be a number in [-inf, 0] (got 0.5)")
    err(function() optim.Adafactor(p2(), {d = 0.5}) end, "Adafactor: d must be a number >= 1 (got 0.5)")
    err(function() optim.Adafactor(p2(), {eps = {1e-30, -1}}) end,
      "Adafactor: eps must be {eps1, eps2}, each a number >= 0 (got {1e-30, -1})")
    err(function() optim.AdamW(p2(), {no_decay = "%.bias$"}) end, "AdamW: no_decay must be a function")
  end)

  it("check groups: keys, hyper-parameters, patterns", function()
    local m = nn.Sequential{nn.Linear(2, 3), nn.LayerNorm(3)}
    err(function() optim.AdamW(m, {groups = {{params = "bias", wd = 0}}}) end,
      "AdamW: group 1: unknown option 'wd' (valid: betas, eps, lr, params, weight_decay)")
    err(function() optim.AdamW(m, {groups = {{params = "bias", lr = -1}}}) end,
      "AdamW: group 1: lr must be a number >= 0 (got -1)")
    err(function() optim.AdamW(m, {groups = {{weight_decay = 0}}}) end,
      "AdamW: group 1: params is required")
    err(function() optim.AdamW(m, {groups = {{params = "^nope"}}}) end,
      "AdamW: group 1: params: the pattern \"^nope\" matches no parameter; the parameters are: "
      .. "1.weight, 1.bias, 2.weight, 2.bias")
    err(function() optim.AdamW(m, {groups = {{params = "[" }}}) end, "bad pattern \"[\"")
    err(function() optim.AdamW(m, {groups = "bias"}) end, "AdamW: groups must be an array")
    err(function() optim.AdamW(m, {groups = {{params = {param{1}}}}}) end,
      "AdamW: group 1: params[1] is not a parameter of this model")
    err(function() optim.SGD(m, {lr = 1, groups = {{params = "bias", nesterov = true}}}) end,
      "SGD: group 1: nesterov needs a momentum > 0")
    err(function() optim.SGD(m, {lr = 0, groups = {{params = "bias", lr = 1}}}) end,
      "SGD: group 1: a group's lr needs the optimizer's lr > 0")
    err(function() optim.AdamW(m, {params = "^3"}) end,
      "AdamW: params: the pattern \"^3\" matches no parameter")
  end)

  it("default to no decay for biases and norms; groups = {} decays everything", function()
    local m = nn.Sequential{nn.Linear(2, 3), nn.LayerNorm(3)}
    assert.are.same({"1.bias", "2.weight", "2.bias"}, optim.AdamW(m, {}).no_decay_paths)
    assert.are.same({"1.bias", "2.weight", "2.bias"}, optim.Lion(m, {}).no_decay_paths)
    assert.are.same({}, optim.AdamW(m, {groups = {}}).no_decay_paths)
    assert.are.same({}, optim.SGD(m, {lr = 1, weight_decay = 0.1}).no_decay_paths)
    local o = optim.AdamW(m, {groups = {{params = "%.bias$", weight_decay = 0}}})
    assert.are.same({"1.bias", "2.bias"}, o.no_decay_paths)
    -- the first group that selects a parameter wins
    o = optim.AdamW(m, {lr = 0.1, groups = {{params = "^1%.", lr = 0.01}, {params = "weight", lr = 1}}})
    assert.are.equal(0.01, o:hp(m[1].weight, "lr"))
    assert.are.equal(1, o:hp(m[2].weight, "lr"))
    assert.are.equal(0.1, o:hp(m[2].bias, "lr"))
    -- a group's lr follows a schedule's changes of opt.lr by the same factor
    o.lr = 0.05
    assert.is_true(math.abs(o:hp(m[1].weight, "lr") - 0.005) < 1e-12)
    -- a function or the parameters themselves select too
    o = optim.AdamW(m, {groups = {{params = function(path) return path == "2.bias" end, weight_decay = 0},
      {params = {m[1].weight}, weight_decay = 0}}})
    assert.are.same({"1.weight", "2.bias"}, o.no_decay_paths)
  end)

  it("params = chooses the parameters the optimizer updates; the others stay", function()
    local m = nn.Sequential{nn.Linear(2, 2), nn.Linear(2, 2)}
    local opt = optim.SGD(m, {lr = 0.5, params = "^2%."})
    assert.are.equal(2, #opt.params)
    local w1, w2 = m[1].weight:clone(), m[2].weight:clone()
    m(fsdp.ones{1, 2}):sum():backward()
    opt:step()
    assert_close(m[1].weight, H.flat_view(w1), 0, "not chosen: unchanged")
    assert.is_false(pcall(assert_close, m[2].weight, H.flat_view(w2), 0))
  end)

  it("skip a parameter whose requires_grad is false (plain and wrapped)", function()
    for _, wrap in ipairs{false, true} do
      for _, kind in ipairs{"SGD", "AdamW", "Adam", "Lion", "Adafactor"} do
        local m = nn.Sequential{nn.Linear(2, 2)}
        if wrap then fsdp.wrap(m) end
        local opt = optim[kind](m, {lr = 0.5})
        m(fsdp.ones{1, 2}):sum():backward()
        local before = {}
        fsdp.full_params(m, function()
          before.w, before.b = H.flat_view(m[1].weight), H.flat_view(m[1].bias)
        end)
        m[1].weight.requires_grad = false
        opt:step()
        fsdp.full_params(m, function()
          assert_close(m[1].weight, before.w, 0, kind .. ": frozen weight unchanged")
          assert.is_false(pcall(assert_close, m[1].bias, before.b, 0), kind .. ": bias steps")
        end)
        assert.is_nil(opt.state[m[1].weight], kind .. ": no state for a frozen parameter")
        if wrap then fsdp.unwrap(m) end
      end
    end
  end)

  it("refuse at world size 1 nothing, and say local_only is accepted", function()
    local o = optim.AdamW(p2(), {local_only = true})
    assert.is_true(o.local_only)
    o:step() -- no gradients: nothing to do, no refusal at 1 rank
  end)
end)

describe("optimizer state (Adam, Lion, Adafactor, Nesterov SGD)", function()
  local MAKE = {
    Adam = function(m) return optim.Adam(m, {lr = 1e-2, betas = {0.9, 0.99}, weight_decay = 0.1}) end,
    Lion = function(m) return optim.Lion(m, {lr = 1e-3, weight_decay = 0.1}) end,
    Adafactor = function(m) return optim.Adafactor(m, {lr = 1e-2, weight_decay = 0.1}) end,
    SGD = function(m) return optim.SGD(m, {lr = 0.1, momentum = 0.9, nesterov = true}) end,
  }
  local function values(m)
    local out = {}
    for _, k in ipairs{"w", "t", "b"} do out[k] = H.flat_view(m[k]) end
    return out
  end
  local function steps(m, opt, from, to)
    for i = from, to do
      opt:zero_grad()
      fixture_backward(m, i)
      opt:step()
    end
  end
  for kind, make in pairs(MAKE) do
    it(kind .. ": state_dict into a new optimizer, and a checkpoint, continue as the original", function()
      local m1 = Three()
      local o1 = make(m1)
      steps(m1, o1, 1, 2)
      local sd = o1:state_dict()
      if kind == "Adafactor" then
        assert.are.equal(3, sd.state.w.row_var:numel()) -- (3, 5): 3 rows, 5 columns
        assert.are.equal(5, sd.state.w.col_var:numel())
        assert.are.equal(2 * 3 + 2 * 4, sd.state.t.row_var:numel() + sd.state.t.col_var:numel())
        assert.are.equal(5, sd.state.b.variance:numel())
      end
      local m2, m3 = Three(), Three()
      fsdp.no_grad(function()
        for _, k in ipairs{"w", "t", "b"} do m2[k]:copy(m1[k]) end
      end)
      local o2 = make(m2)
      o2:load_state_dict(sd)
      local dir = H.tmpname()
      fsdp.save(m1, dir, {format = "sharded", optimizer = o1})
      local o3 = make(m3)
      fsdp.load(m3, dir, {optimizer = o3})
      steps(m1, o1, 3, 3)
      steps(m2, o2, 3, 3)
      steps(m3, o3, 3, 3)
      local want = values(m1)
      assert.is_true(H.same_values(want.w, values(m2).w) and H.same_values(want.t, values(m2).t)
        and H.same_values(want.b, values(m2).b), kind .. ": load_state_dict")
      assert.is_true(H.same_values(want.w, values(m3).w) and H.same_values(want.t, values(m3).t)
        and H.same_values(want.b, values(m3).b), kind .. ": checkpoint")
      -- and the continued runs still follow torch
      if kind ~= "SGD" then
        local ref = REF.cases[kind:lower()][3]
        for _, k in ipairs{"w", "t", "b"} do assert_close(values(m3)[k], ref[k], 2e-6, k) end
      end
      os.execute("rm -rf '" .. dir .. "'")
    end)
  end
end)

describe("optimizers over parts of a wrapped model", function()
  it("two optimizers, one per module, with a GradScaler equal one over the whole model", function()
    local function run(split)
      fsdp.manual_seed(5)
      local m = nn.Sequential{nn.Linear(3, 4), nn.Linear(4, 2)}
      fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Linear}})
      local opts = split and {optim.SGD(m[1], {lr = 0.1}), optim.SGD(m[2], {lr = 0.1})}
        or {optim.SGD(m, {lr = 0.1})}
      if split then
        assert.is_true(opts[1].subset)
        assert.are.same({"1.weight", "1.bias"}, {opts[1].params[1].path, opts[1].params[2].path})
      end
      local scaler = optim.GradScaler{init_scale = 1024}
      for step = 1, 3 do
        for _, o in ipairs(opts) do o:zero_grad() end
        local x = fsdp.tensor{{1, 2, 3}, {step, -1, 0.5}}
        scaler:scale(m(x):sum()):backward()
        for _, o in ipairs(opts) do assert.is_true(scaler:step(o)) end
        scaler:update()
      end
      local out
      fsdp.full_params(m, function()
        out = {}
        for _, p in ipairs(m:parameters()) do out[#out + 1] = H.flat_view(p) end
      end)
      fsdp.unwrap(m)
      return out
    end
    local whole, parts = run(false), run(true)
    for i = 1, #whole do assert.is_true(H.same_values(whole[i], parts[i]), "parameter " .. i) end
  end)
end)

describe("an optimizer made before fsdp.wrap", function()
  it("refuses to step instead of updating nothing", function()
    for _, kind in ipairs{"SGD", "AdamW", "Adafactor"} do
      local m = nn.Sequential{nn.Linear(3, 4), nn.Linear(4, 2)}
      local o = optim[kind](m, {lr = 0.1})
      fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Linear}})
      o:zero_grad()
      m(fsdp.tensor{{1, 2, 3}}):sum():backward()
      H.assert_error_has(function() o:step() end, kind .. ":step: the model was wrapped after this "
        .. "optimizer was created (1.weight is sharded); create the optimizer after fsdp.wrap")
      fsdp.unwrap(m)
    end
  end)
end)

describe("plain parameters of another dtype than f32 (model:to)", function()
  -- SGD's and Adam(W)'s update kernels take f32 parameters only
  local function model_of(dt)
    local a = param{1, 2, 3}                 -- f32, first: left alone when the step is refused
    local b = nn.Parameter(fsdp.tensor{4, 5, 6}:to(dt))
    a.grad, b.grad = fsdp.tensor{1, 1, 1}, fsdp.tensor({1, 1, 1}):to(dt)
    return {a, b}
  end

  it("SGD, Adam and AdamW refuse them by name before updating anything", function()
    for _, dt in ipairs{"bf16", "f16", "f64"} do
      for _, mk in ipairs{
          function(ps) return optim.SGD(ps, {lr = 0.1}) end,
          function(ps) return optim.SGD(ps, {lr = 0.1, momentum = 0.9}) end,
          function(ps) return optim.Adam(ps, {lr = 0.1}) end,
          function(ps) return optim.AdamW(ps, {lr = 0.1}) end} do
        local ps = model_of(dt)
        local opt = mk(ps)
        local ok, err = pcall(opt.step, opt)
        assert.is_false(ok)
        local want = ("%s: parameter 2 is %s, but %s's update kernel takes f32 parameters only: "
          .. "keep the parameters f32"):format(opt.kind, dt, opt.kind)
        assert.truthy(tostring(err):find(want, 1, true), tostring(err))
        local hint = ("fsdp.wrap(model, {mp = \"%s\"})"):format(dt)
        assert.are.equal(dt ~= "f64", tostring(err):find(hint, 1, true) ~= nil)
        assert.are.same({1, 2, 3}, flat(ps[1]))
        assert.are.same({4, 5, 6}, flat(ps[2]:to("f32")))
        assert.is_nil(opt.state[ps[1]] and opt.state[ps[1]].exp_avg)
      end
    end
  end)

  it("Lion, Adafactor and SGD with nesterov step them", function()
    for _, mk in ipairs{
        function(ps) return optim.Lion(ps, {lr = 0.5}) end,
        function(ps) return optim.Adafactor(ps, {lr = 0.5}) end,
        function(ps) return optim.SGD(ps, {lr = 0.5, momentum = 0.9, nesterov = true}) end} do
      local ps = model_of("bf16")
      mk(ps):step()
      assert.are.equal("bf16", ps[2]:dtype())
      local v = flat(ps[2]:to("f32"))
      for i, w in ipairs{4, 5, 6} do assert.is_true(v[i] < w) end
    end
  end)
end)
