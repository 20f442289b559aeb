-- scaler_spec.lua — fsdp.optim.GradScaler at world size 1: scaling the loss, unscaling the
-- gradients (p.grad of a plain model, the f32 gradient shards of a wrapped one), skipped steps
-- on overflow, backoff and growth of the scale, unscale_ before clip_grad_norm, state_dict (also
-- through fsdp.save's extra), the disabled scaler and every error message. The cross-rank
-- decision is tests/dist/scaler.lua's (tests/recipes/dist_scaler.sh).
-- Run: busted --lua=luajit tests/lua/scaler_spec.lua

local fsdp = require "fsdp"
local nn = fsdp.nn
local optim = fsdp.optim

local H = require "helpers"
teardown(H.remove_temps)
local flat, assert_close, assert_error_has = H.flat, H.assert_close, H.assert_error_has

local function param(values) return nn.Parameter(fsdp.tensor(values)) end

-- loss = sum(c * p^2) / 2 (grad = c * p), times factor (an injected overflow: 1e38 * scale is
-- inf in f32)
local function quad_loss(p, c, factor)
  local loss = (p * p * fsdp.tensor(c)):sum() * 0.5
  if factor then loss = loss * factor end
  return loss
end

local function snapshot(t) return flat(t:detach()) end

local function small_gpt(seed)
  fsdp.manual_seed(seed)
  return nn.GPT { vocab = 16, ctx = 4, d = 8, layers = 2, heads = 2 }
end

local function ids(k)
  return fsdp.tensor({ { k % 16, (k + 3) % 16, (k * 5) % 16, 1 } }, { dtype = "i64" })
end

describe("optim.GradScaler options", function()
  it("defaults to PyTorch's values", function()
    local s = optim.GradScaler()
    assert.are.equal(2 ^ 16, s:get_scale())
    assert.are.equal(2, s.growth_factor)
    assert.are.equal(0.5, s.backoff_factor)
    assert.are.equal(2000, s.growth_interval)
    assert.is_true(s:is_enabled())
    assert.are.same({ kind = "GradScaler", enabled = true, scale = 65536, growth_factor = 2,
      backoff_factor = 0.5, growth_interval = 2000, growth_tracker = 0 }, s:state_dict())
  end)

  it("refuses unknown options naming the valid ones, and bad values naming the option", function()
    assert_error_has(function() optim.GradScaler { init_scal = 4 } end,
      "GradScaler: unknown option 'init_scal' (valid: backoff_factor, enabled, growth_factor, "
      .. "growth_interval, init_scale)")
    assert_error_has(function() optim.GradScaler(5) end, "GradScaler: expects an options table")
    assert_error_has(function() optim.GradScaler { init_scale = 0 } end,
      "init_scale must be a finite number > 0 (got 0)")
    assert_error_has(function() optim.GradScaler { init_scale = 1 / 0 } end, "init_scale")
    assert_error_has(function() optim.GradScaler { init_scale = "big" } end, "init_scale", "big")
    assert_error_has(function() optim.GradScaler { growth_factor = 1 } end,
      "growth_factor must be a finite number > 1 (got 1)")
    assert_error_has(function() optim.GradScaler { backoff_factor = 1 } end,
      "backoff_factor must be a number in (0, 1) (got 1)")
    assert_error_has(function() optim.GradScaler { backoff_factor = 0 } end, "backoff_factor")
    assert_error_has(function() optim.GradScaler { growth_interval = 1.5 } end,
      "growth_interval must be an integer >= 1 (got 1.5)")
    assert_error_has(function() optim.GradScaler { growth_interval = 0 } end, "growth_interval")
    assert_error_has(function() optim.GradScaler { enabled = "yes" } end,
      "enabled must be a boolean (got yes)")
  end)
end)

describe("optim.GradScaler on a plain model", function()
  it("scales the loss as a recorded op and unscales p.grad before the step", function()
    local p = param { 1, -2, 3 }
    local c = { 0.5, 1, -1 }
    local s = optim.GradScaler { init_scale = 1024 }
    local opt = optim.SGD({ p }, { lr = 0.1 })
    local scaled = s:scale(quad_loss(p, c))
    assert.is_true(scaled.requires_grad)
    assert_close(scaled:item(), 1024 * (0.25 + 2 - 4.5), 1e-6, "scaled loss")
    scaled:backward()
    assert.are.same({ 512, -2048, -3072 }, flat(p.grad)) -- 1024 * c * p
    assert.is_true(s:step(opt))
    assert.are.same({ 0.5, -2, -3 }, flat(p.grad)) -- unscaled in place
    assert_close(p, { 1 - 0.05, -2 + 0.2, 3 + 0.3 }, 1e-6, "one SGD step on the true gradient")
    s:update()
    assert.are.equal(1024, s:get_scale())
    assert.are.equal(1, s.growth_tracker)
  end)

  it("a bf16 or f16 loss is scaled in f32 (f16 holds at most 65504)", function()
    local s = optim.GradScaler()
    local l = fsdp.tensor(3, { dtype = "f16" })
    local out = s:scale(l)
    assert.are.equal("f32", out:dtype())
    assert.are.equal(3 * 65536, out:item())
  end)

  it("skips the step on overflow: parameters, AdamW state and step count untouched; the scale halves", function()
    local p, q = param { 1, 2 }, param { { 1, -1 }, { 2, 0.5 } }
    local opt = optim.AdamW({ p, q }, { lr = 0.1, weight_decay = 0.1 })
    local s = optim.GradScaler { init_scale = 2 ^ 10, growth_interval = 100 }
    local function iteration(factor)
      opt:zero_grad()
      s:scale(quad_loss(p, { 1, 1 }) + quad_loss(q, { { 1, 2 }, { 3, 4 } }, factor)):backward()
      local stepped = s:step(opt)
      s:update()
      return stepped
    end
    assert.is_true(iteration())
    local p1, q1 = snapshot(p), snapshot(q)
    local sd = opt:state_dict()
    local m1, v1 = snapshot(sd.state["1"].exp_avg), snapshot(sd.state["2"].exp_avg_sq)
    assert.are.equal(1, opt.step_count)
    -- overflow: 1e38 * 1024 is inf in f32, q's gradient inf or NaN
    assert.is_false(iteration(1e38))
    assert.are.same(p1, snapshot(p))
    assert.are.same(q1, snapshot(q))
    assert.are.equal(1, opt.step_count)
    sd = opt:state_dict()
    assert.are.equal(1, sd.state["1"].step)
    assert.are.equal(1, sd.state["2"].step)
    assert.are.same(m1, snapshot(sd.state["1"].exp_avg))
    assert.are.same(v1, snapshot(sd.state["2"].exp_avg_sq))
    assert.are.equal(2 ^ 9, s:get_scale())
    assert.are.equal(0, s.growth_tracker)
    -- a NaN counts as an overflow too
    opt:zero_grad()
    s:scale(quad_loss(p, { 1, 1 })):backward()
    p.grad:set(2, 0 / 0)
    assert.is_false(s:step(opt))
    s:update()
    assert.are.equal(2 ^ 8, s:get_scale())
    -- and training goes on
    assert.is_true(iteration())
    assert.are.equal(2, opt.step_count)
    assert.are_not.same(p1, snapshot(p))
  end)

  it("grows the scale after growth_interval clean steps; an overflow restarts the count", function()
    local p = param { 1, 2 }
    local opt = optim.SGD({ p }, { lr = 0.01 })
    local s = optim.GradScaler { init_scale = 8, growth_factor = 4, backoff_factor = 0.25,
      growth_interval = 3 }
    local function iteration(factor)
      opt:zero_grad()
      s:scale(quad_loss(p, { 1, 1 }, factor)):backward()
      s:step(opt)
      s:update()
      return s:get_scale()
    end
    local seen = {}
    for _, f in ipairs { false, false, false, false, false, 1e38, false, false, false } do
      seen[#seen + 1] = iteration(f or nil)
    end
    -- clean x3 -> 32; clean x2; overflow -> 8 (count restarts); clean x3 -> 32
    assert.are.same({ 8, 8, 32, 32, 32, 8, 8, 8, 32 }, seen)
    -- update(new_scale) sets it
    iteration()
    s:update(3)
    assert.are.equal(3, s:get_scale())
  end)

  it("unscale_ before clip_grad_norm clips the true gradients; step then unscales no further", function()
    local p = param { 1, 1 }
    local opt = optim.SGD({ p }, { lr = 1 })
    local s = optim.GradScaler { init_scale = 2 ^ 12 }
    opt:zero_grad()
    s:scale((p * fsdp.tensor { 3, 4 }):sum()):backward() -- true gradient (3, 4), norm 5
    s:unscale_(opt)
    assert.are.same({ 3, 4 }, flat(p.grad))
    assert_close(fsdp.clip_grad_norm({ p }, 1), 5, 1e-6, "norm of the unscaled gradient")
    assert_close(p.grad, { 0.6, 0.8 }, 1e-5, "clipped")
    assert.is_true(s:step(opt))
    assert_close(p, { 0.4, 0.2 }, 1e-5, "stepped with the clipped gradient")
    s:update()
    -- an overflow found by unscale_ still skips the step (clip makes inf * 0 = NaN, no matter)
    opt:zero_grad()
    s:scale((p * fsdp.tensor { 3, 1e38 }):sum()):backward()
    s:unscale_(opt)
    fsdp.clip_grad_norm({ p }, 1)
    assert.is_false(s:step(opt))
    assert_close(p, { 0.4, 0.2 }, 1e-5, "not stepped")
    s:update()
    assert.are.equal(2 ^ 11, s:get_scale())
  end)

  it("with f32 gradients and a power-of-two scale trains exactly as without a scaler", function()
    local function run(with)
      local m = small_gpt(5)
      local opt = optim.AdamW(m, { lr = 1e-2 })
      local s = with and optim.GradScaler { init_scale = 2 ^ 20, growth_interval = 2 } or nil
      local losses = {}
      for k = 1, 6 do
        opt:zero_grad()
        local loss = nn.F.cross_entropy(m(ids(k)), ids(k + 1))
        losses[k] = loss:item()
        if s then
          s:scale(loss):backward()
          s:unscale_(opt)
          fsdp.clip_grad_norm(m, 0.5)
          assert.is_true(s:step(opt))
          s:update()
        else
          loss:backward()
          fsdp.clip_grad_norm(m, 0.5)
          opt:step()
        end
      end
      return losses, flat(m.wte.weight:detach()), s
    end
    local l0, w0 = run(false)
    local l1, w1, s = run(true)
    assert.are.same(l0, l1)
    assert.are.same(w0, w1)
    assert.are.equal(2 ^ 23, s:get_scale()) -- grew at steps 2, 4 and 6
  end)

  it("disabled: scale returns the loss, step steps, update does nothing, the scale is 1", function()
    local p = param { 1, 2 }
    local opt = optim.AdamW({ p }, { lr = 0.1 })
    local s = optim.GradScaler { enabled = false, init_scale = 8 }
    assert.is_false(s:is_enabled())
    assert.are.equal(1, s:get_scale())
    local loss = quad_loss(p, { 1, 1 }, 1e38) -- inf: a disabled scaler checks nothing
    assert.are.equal(loss, s:scale(loss))
    loss:backward()
    s:unscale_(opt)
    assert.is_true(s:step(opt))
    s:update()
    assert.are.equal(1, opt.step_count)
    assert.are.same({ kind = "GradScaler", enabled = false }, s:state_dict())
    assert_error_has(function() s:load_state_dict(optim.GradScaler():state_dict()) end,
      "GradScaler:load_state_dict: this scaler is disabled")
  end)

  it("says what is wrong with each call out of order or argument", function()
    local p = param { 1, 2 }
    local opt = optim.SGD({ p }, { lr = 0.1 })
    local s = optim.GradScaler()
    assert_error_has(function() s:update() end,
      "GradScaler:update: no gradients were unscaled since the last update()")
    assert_error_has(function() s:scale(3) end, "GradScaler:scale: expects the loss tensor (got number)")
    assert_error_has(function() s:step(p) end, "GradScaler:step: expects an fsdp.optim optimizer")
    assert_error_has(function() s:unscale_(nil) end,
      "GradScaler:unscale_: expects an fsdp.optim optimizer (SGD, Adam, AdamW, Lion, Adafactor; got nil)")
    s:scale(quad_loss(p, { 1, 1 })):backward()
    s:unscale_(opt)
    assert_error_has(function() s:unscale_(opt) end,
      "GradScaler:unscale_: already called on this optimizer since the last update()")
    s:step(opt)
    assert_error_has(function() s:step(opt) end,
      "GradScaler:step: already called on this optimizer since the last update()")
    assert_error_has(function() s:unscale_(opt) end,
      "GradScaler:unscale_: called after step() on this optimizer; call update() first")
    assert_error_has(function() s:update(0) end, "GradScaler:update: scale must be a finite number > 0")
    s:update()
    -- f16 gradients of a plain model would lose their small values when unscaled in f16
    local h = nn.Parameter(fsdp.tensor({ 1, 2 }, { dtype = "f16" }))
    local hopt = optim.SGD({ h }, { lr = 0.1 })
    s:scale((h * h):sum()):backward()
    assert_error_has(function() s:step(hopt) end,
      "GradScaler:step: the gradient of 1 is f16", "fsdp.wrap(model, {mp = \"f16\"})")
  end)
end)

describe("optim.GradScaler state", function()
  it("round-trips through state_dict / load_state_dict", function()
    local p = param { 1, 2 }
    local opt = optim.SGD({ p }, { lr = 0.01 })
    local s = optim.GradScaler { init_scale = 2 ^ 14, growth_factor = 3, backoff_factor = 0.3,
      growth_interval = 4 }
    for _, f in ipairs { 1e38, false, false } do
      opt:zero_grad()
      s:scale(quad_loss(p, { 1, 1 }, f or nil)):backward()
      s:step(opt)
      s:update()
    end
    local sd = s:state_dict()
    assert.are.same({ kind = "GradScaler", enabled = true, scale = 2 ^ 14 * 0.3, growth_factor = 3,
      backoff_factor = 0.3, growth_interval = 4, growth_tracker = 2 }, sd)
    local r = optim.GradScaler()
    r:load_state_dict(sd)
    assert.are.same(sd, r:state_dict())
    assert.are.equal(2 ^ 14 * 0.3, r:get_scale())
  end)

  it("checks a state_dict whole before changing anything", function()
    local s = optim.GradScaler { init_scale = 4 }
    assert_error_has(function() s:load_state_dict({ kind = "SGD" }) end,
      "GradScaler:load_state_dict: expected a GradScaler state_dict (got kind SGD)")
    assert_error_has(function() s:load_state_dict(7) end, "expected a GradScaler state_dict (got number)")
    local sd = optim.GradScaler():state_dict()
    sd.growth_tracker = -1
    assert_error_has(function() s:load_state_dict(sd) end, "growth_tracker must be an integer >= 0 (got -1)")
    sd.growth_tracker, sd.scale = 0, nil
    assert_error_has(function() s:load_state_dict(sd) end, "scale must be a finite number > 0 (got nil)")
    sd.scale, sd.extra = 2, 1
    assert_error_has(function() s:load_state_dict(sd) end, "unknown option 'extra'")
    assert_error_has(function() s:load_state_dict({ kind = "GradScaler", enabled = false }) end,
      "saved from a disabled scaler")
    assert.are.equal(4, s:get_scale())
  end)

  it("travels in fsdp.save's extra, exactly", function()
    local dir = H.mktemp_dir()
    local m = small_gpt(2)
    local s = optim.GradScaler { init_scale = 2 ^ 16 * 0.3, growth_interval = 7 }
    s.growth_tracker = 5
    fsdp.save(m, dir .. "/m.safetensors", { extra = { scaler = s:state_dict() } })
    local r = optim.GradScaler()
    local extra = fsdp.load(m, dir .. "/m.safetensors")
    r:load_state_dict(extra.scaler)
    assert.are.same(s:state_dict(), r:state_dict())
    os.execute("rm -rf '" .. dir .. "'")
  end)
end)

describe("optim.GradScaler on a wrapped model", function()
  it("unscales the f32 gradient shards and skips the step on overflow", function()
    local m = small_gpt(7)
    fsdp.wrap(m, { policy = fsdp.policy.modules { nn.Block }, mp = "f16" })
    local opt = optim.AdamW(m, { lr = 1e-2 })
    local s = optim.GradScaler { init_scale = 2 ^ 8, growth_interval = 1000 }
    local units = fsdp.units(m)
    local function shards()
      local out = {}
      for i, u in ipairs(units) do out[i] = snapshot(u:shard()) end
      return out
    end
    local function grads()
      local out = {}
      for i, u in ipairs(units) do out[i] = snapshot(u:grad_shard()) end
      return out
    end
    -- a clean step: the gradient shards are divided by the scale, the optimizer steps
    opt:zero_grad()
    s:scale(nn.F.cross_entropy(m(ids(1)), ids(2))):backward()
    local scaled = grads()
    s:unscale_(opt)
    local unscaled = grads()
    for i = 1, #units do
      assert.are.equal("f32", units[i]:grad_shard():dtype())
      for j = 1, #scaled[i] do assert.are.equal(scaled[i][j] / 2 ^ 8, unscaled[i][j]) end
    end
    assert.is_true(s:step(opt))
    s:update()
    assert.are.equal(1, opt.step_count)
    -- an overflow (1e30 * 256 is inf in f16's backward): nothing changes, the scale halves
    local before = shards()
    local st = opt:state_dict()
    opt:zero_grad()
    s:scale(nn.F.cross_entropy(m(ids(2)), ids(3)) * 1e30):backward()
    assert.is_false(s:step(opt))
    s:update()
    assert.are.same(before, shards())
    assert.are.equal(1, opt.step_count)
    for _, e in pairs(opt:state_dict().state) do assert.are.equal(1, e.step) end
    assert.are.same(st.state["wte.weight"].exp_avg:totable(), opt:state_dict().state["wte.weight"].exp_avg:totable())
    assert.are.equal(2 ^ 7, s:get_scale())
    -- and the next clean step trains
    opt:zero_grad()
    local loss = nn.F.cross_entropy(m(ids(3)), ids(4))
    s:scale(loss):backward()
    assert.is_true(s:step(opt))
    s:update()
    assert.are.equal(2, opt.step_count)
    assert.are_not.same(before, shards())
    fsdp.unwrap(m)
  end)
end)
