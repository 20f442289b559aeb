-- autograd_spec.lua — autograd from Lua: backward through fsdp.F and tensor methods against
-- finite differences, gradient accumulation and dropping, no_grad, the errors backward gives,
-- in-place writes refused on a live graph's memory, memory accounting, and fsdp.args parsing.
-- Run: busted --lua=luajit tests/lua/autograd_spec.lua

local fsdp = require "fsdp"
local F = fsdp.F
local core = fsdp.core

local H = require "helpers"
local flat, assert_error_has = H.flat, H.assert_error_has

-- element i (1-based, row-major) of a contiguous tensor, through a flat view
local function getf(t, i) return t:view(-1):get(i) end
local function setf(t, i, v) t:view(-1):set(i, v) end

-- Central differences of loss_fn() (a function returning a 1-element tensor) w.r.t. every
-- element of x, computed under no_grad; compared with x.grad from one backward.
-- Returns the worst |autograd - fd| / max |fd|.
local function check_grad(loss_fn, xs, eps)
  eps = eps or 1e-2
  for _, x in ipairs(xs) do x.grad = nil end
  local loss = loss_fn()
  loss:backward()
  assert.are.equal(0, core.tape_size())
  local worst = 0
  for _, x in ipairs(xs) do
    assert.is_not_nil(x.grad, "no gradient")
    local ag = flat(x.grad)
    local maxd, maxfd = 0, 0
    fsdp.no_grad(function()
      for i = 1, x:numel() do
        local v = getf(x, i)
        setf(x, i, v + eps)
        local lp = loss_fn():item()
        setf(x, i, v - eps)
        local lm = loss_fn():item()
        setf(x, i, v)
        local fd = (lp - lm) / (2 * eps)
        maxd = math.max(maxd, math.abs(fd - ag[i]))
        maxfd = math.max(maxfd, math.abs(fd))
      end
    end)
    worst = math.max(worst, maxd / math.max(maxfd, 1e-6))
  end
  return worst
end

describe("backward", function()
  before_each(function() core.tape_clear() end)

  it("matches finite differences through a small model", function()
    fsdp.manual_seed(3)
    local x = fsdp.randn { 2, 3, 4 }
    local w1 = core.parameter(fsdp.randn { 6, 4 } * 0.5)
    local b1 = core.parameter(fsdp.randn { 6 } * 0.1)
    local g = core.parameter(fsdp.ones { 6 } + fsdp.randn { 6 } * 0.1)
    local w2 = core.parameter(fsdp.randn { 5, 6 } * 0.5)
    local targets = fsdp.tensor { { 0, 4, -1 }, { 2, 1, 3 } }
    local function loss_fn()
      local h = F.layernorm(F.linear(x, w1, b1), g, nil)
      h = F.gelu(h)
      local logits = F.linear(h, w2)
      local ce = F.cross_entropy(logits, targets, { ignore_index = -1 })
      -- a second use of w2 (through a transposed view) and arithmetic with numbers
      local reg = (w2:transpose(1, 2):matmul(w2) * w2:sum()):mean()
      return ce + 0.01 * reg + (2 - h:narrow(2, 2, 2)):pow(2):mean() / 4
    end
    local err = check_grad(loss_fn, { w1, b1, g, w2 })
    print(("\n  composite model: max scaled gradient error %.2e"):format(err))
    assert.is_true(err < 2e-3)
  end)

  it("matches finite differences through attention and an embedding", function()
    fsdp.manual_seed(4)
    local wte = core.parameter(fsdp.randn { 7, 6 })
    local wqkv = core.parameter(fsdp.randn { 18, 6 } * 0.3)
    local ids = fsdp.tensor { { 1, 5, 5, 0, 6 }, { 2, 2, 3, 4, 1 } }
    local targets = fsdp.tensor { { 5, 5, 0, 6, 1 }, { 2, 3, 4, 1, 0 } }
    local function loss_fn()
      local h = F.embedding(ids, wte)                  -- (2, 5, 6)
      local a = F.attention(F.linear(h, wqkv), 3)      -- (2, 5, 6)
      local logits = (h + a):matmul(wte:transpose(1, 2)) -- tied head: (2, 5, 7)
      return F.cross_entropy(logits:view { -1, 7 }, targets:view(-1))
    end
    local err = check_grad(loss_fn, { wte, wqkv })
    print(("  attention + tied embedding: max scaled gradient error %.2e"):format(err))
    assert.is_true(err < 2e-3)
  end)

  it("gives exact gradients for simple cases", function()
    local x = fsdp.tensor { 1, 2, 3 }
    x.requires_grad = true
    local l = (x * x):sum()
    l:backward()
    assert.are.same({ 2, 4, 6 }, x.grad:totable())
    -- a tensor used twice gets the sum; leaves accumulate across backward calls
    l = (x + x):sum() + x:sum()
    l:backward()
    assert.are.same({ 5, 7, 9 }, x.grad:totable())
    x.grad = nil
    l = (2 / x):sum()
    l:backward()
    local g = x.grad:totable()
    assert.is_true(math.abs(g[1] + 2) < 1e-6 and math.abs(g[2] + 0.5) < 1e-6)
    x.grad = nil
    l = -(x:mean())
    l:backward()
    assert.is_true(math.abs(x.grad:get(1) + 1 / 3) < 1e-6)
  end)

  it("keeps the gradients of a view's input and of the addend beside it apart", function()
    -- the add hands view(y) and b one gradient buffer, which the view passes on to y; the
    -- older consumers p and q then add into y's and b's gradients
    local x, z = fsdp.tensor { { 1, -2, 3 } }, fsdp.tensor { { 0.5, 2, -1 } }
    x.requires_grad, z.requires_grad = true, true
    local y, b = x * 1, z * 1
    local p, q = y * y, b * b
    local s = y:view { 1, 3 } + b
    ;(s * s + p + q):sum():backward()
    -- d/dx = 2 (x + z) + 2 x, d/dz = 2 (x + z) + 2 z
    assert.are.same({ { 5, -4, 10 } }, x.grad:totable())
    assert.are.same({ { 4, 4, 2 } }, z.grad:totable())
  end)

  it("frees non-leaf gradients and the tape", function()
    local w = core.parameter(fsdp.randn { 3, 3 })
    local h = F.relu(w:matmul(w))
    local l = h:sum()
    assert.is_true(core.tape_size() >= 3)
    assert.is_true(h.requires_grad)
    assert.is_false(h.is_leaf)
    l:backward()
    assert.are.equal(0, core.tape_size())
    assert.is_nil(h.grad)
    assert.is_nil(l.grad)
    assert.is_not_nil(w.grad)
  end)

  it("errors clearly on misuse", function()
    local w = core.parameter(fsdp.randn { 2, 3 })
    local y = w * 2
    assert_error_has(function() y:backward() end, "backward", "(2, 3)", "6 elements")
    assert_error_has(function() y:backward(fsdp.ones(3)) end, "backward", "(3)", "(2, 3)")
    y:backward(fsdp.ones(2, 3)) -- an explicit gradient of the right shape works
    assert.are.same({ { 2, 2, 2 }, { 2, 2, 2 } }, w.grad:totable())
    local l = (w * 3):sum()
    l:backward()
    assert_error_has(function() l:backward() end, "backward", "already")
    assert_error_has(function() fsdp.ones(1):backward() end, "backward",
      "does not require a gradient")
    assert_error_has(function() y.requires_grad = false end, "requires_grad", "leaf")
    assert_error_has(function() core.parameter(w * 1) end, "Parameter", "leaf")
  end)

  it("refuses a saved tensor modified in place before backward", function()
    local w = core.parameter(fsdp.randn { 2, 3 })
    local x = fsdp.randn { 4, 3 }
    local l = F.linear(x, w):sum()
    x:set(1, 1, 5)
    assert_error_has(function() l:backward() end, "backward of linear", "(4, 3)",
      "modified in place")
    assert.are.equal(0, core.tape_size())
    -- exp's backward reads its output, but a write into that output (a non-leaf) is refused
    -- when made ("in-place writes into a graph" below), so the backward stays right
    local e = w:exp()
    l = e:sum()
    assert_error_has(function() e:mul_(2) end, "mul_", "made by exp")
    l:backward()
    assert.are.same(flat(w:exp()), flat(w.grad))
  end)

  it("refuses a saved leaf written through another tensor over its memory", function()
    -- detach(), a view, a narrow: each is a tensor of its own (its own version) over w's memory
    local writes = {
      detach = function(w) w:detach():mul_(10) end,
      view = function(w) w:view { 6 }:mul_(10) end,
      narrow = function(w) w:narrow(1, 2, 1):fill(0) end,
      detach_view = function(w) w:detach():view { 6 }:add_(fsdp.ones(6)) end,
    }
    for name, write in pairs(writes) do
      core.tape_clear()
      local w = core.parameter(fsdp.randn { 2, 3 })
      local x = fsdp.randn { 4, 3 }
      x.requires_grad = true
      local l = F.linear(x, w):sum()
      write(w)
      local err = assert_error_has(function() l:backward() end, "backward of linear",
        "a tensor (2, 3) that linear saved for its gradient was modified in place through "
        .. "another tensor over its memory (a view or detach()) after the forward",
        "(its memory's version ", "clone()")
      assert.is_nil(x.grad, name)
      assert.are.equal(0, core.tape_size(), name .. ": " .. err)
    end
    -- a write after backward, or into a clone, is fine; so is a graph over a clone of w
    local w = core.parameter(fsdp.ones { 2, 3 })
    local x = fsdp.ones { 4, 3 }
    x.requires_grad = true
    local l = F.linear(x, w):sum()
    w:clone():mul_(10)
    l:backward()
    assert.are.same({ 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2 }, flat(x.grad))
    w:detach():mul_(10)
    assert.are.same({ 10, 10, 10, 10, 10, 10 }, flat(w))
  end)

  it("consumes every recorded graph: a second loss's backward is refused, a sum works", function()
    local w = core.parameter(fsdp.ones(3))
    local la, lb = (w * 2):sum(), (w * 3):sum()
    la:backward()
    assert_error_has(function() lb:backward() end, "backward: the graph of tensor () is no "
      .. "longer recorded (a backward already ran over it: each consumes every graph recorded "
      .. "before it ran, so sum the losses and run one backward")
    assert.are.same({ 2, 2, 2 }, w.grad:totable())
    w.grad = nil
    la, lb = (w * 2):sum(), (w * 3):sum()
    ;(la + lb):backward()
    assert.are.same({ 5, 5, 5 }, w.grad:totable())
    assert.are.equal(0, core.tape_size())
  end)

  it("detach cuts the graph", function()
    local w = core.parameter(fsdp.ones(2))
    local d = (w * 3):detach()
    assert.is_false(d.requires_grad)
    assert.are.same({ 3, 3 }, d:totable())
    local l = (w * d):sum()
    l:backward()
    assert.are.same({ 3, 3 }, w.grad:totable())
  end)
end)

describe("no_grad", function()
  before_each(function() core.tape_clear() end)

  it("records nothing and returns fn's results", function()
    local w = core.parameter(fsdp.ones(2))
    local a, b = fsdp.no_grad(function(k) return w * k, "second" end, 5)
    assert.are.equal("second", b)
    assert.is_false(a.requires_grad)
    assert.are.equal(0, core.tape_size())
    assert.is_true(fsdp.is_grad_enabled())
  end)

  it("restores the mode when fn errors", function()
    local ok, err = pcall(fsdp.no_grad, function() error("boom") end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("boom", 1, true))
    assert.is_true(fsdp.is_grad_enabled())
    -- nested: the inner call restores the outer (disabled) mode
    fsdp.no_grad(function()
      pcall(fsdp.no_grad, function() error("inner") end)
      assert.is_false(fsdp.is_grad_enabled())
    end)
    assert.is_true(fsdp.is_grad_enabled())
  end)
end)

describe("in-place writes into a graph", function()
  before_each(function() core.tape_clear() end)
  teardown(H.remove_temps)

  -- x, a leaf that requires a gradient, and y = x * 2, a non-leaf of a live graph
  local function graph(dtype)
    local x = fsdp.tensor({ 1, 2, 3 }, { dtype = dtype })
    x.requires_grad = true
    return x, x * 2
  end

  -- write(t) must be refused naming what, leaving t and y (values and versions) as they were and
  -- the graph whole: backward gives x the gradient of y = x * 2. Returns the message.
  local function refused(x, y, t, what, write, ...)
    local tv, yv, tver, yver = flat(t), flat(y), t.version, y.version
    local err = assert_error_has(function() write(t) end, what .. ": this tensor",
      "and is part of the autograd graph", "an in-place write is not recorded",
      "would make the gradient wrong", "clone()", "docs/tensor.md", ...)
    assert.are.same(tv, flat(t))
    assert.are.same(yv, flat(y))
    assert.are.equal(tver, t.version)
    assert.are.equal(yver, y.version)
    y:sum():backward()
    assert.are.same({ 2, 2, 2 }, flat(x.grad))
    return err
  end

  -- (t:set takes one position per dim, then the value)
  local function set_first(t, v)
    local a = {}
    for i = 1, t:dim() do a[i] = 1 end
    a[#a + 1] = v
    return t:set(unpack(a))
  end

  -- the tensor methods that write in place, and what each says to do instead
  local methods = {
    { "add_", function(t) t:add_(fsdp.ones(t:shape())) end, "t = t + alpha * u" },
    { "mul_", function(t) t:mul_(3) end, "t = t * s" },
    { "fill", function(t) t:fill(1) end, "fsdp.full(t:shape(), v)" },
    { "zero", function(t) t:zero() end, "fsdp.zeros(t:shape())" },
    { "copy", function(t) t:copy(fsdp.ones(t:shape())) end, "src:to(t:dtype())" },
    { "set", function(t) set_first(t, 5) end, "fsdp.where" },
  }

  it("refuses every in-place method on a non-leaf of a live graph", function()
    for _, m in ipairs(methods) do
      local x, y = graph()
      refused(x, y, y, m[1], m[2], "(3) was made by affine", m[3])
    end
    -- a non-leaf of a longer chain, named by the op that made it
    local x = fsdp.tensor { 1, 2, 3 }
    x.requires_grad = true
    local y = (x * 2):exp():log()
    assert_error_has(function() y:mul_(2) end, "mul_: this tensor (3) was made by log")
  end)

  it("refuses the functions that write into a tensor of a live graph", function()
    local dir = H.mktemp_dir()
    local w = core.st_writer(dir .. "/t.safetensors", { { name = "a", shape = { 3 } } })
    w:write("a", fsdp.ones(3))
    w:commit()
    local r = core.st_open(dir .. "/t.safetensors")
    local ones = function() return fsdp.ones(3) end
    local function adamw(p, g, m, v, mask)
      core.adamw_step(p, g, m, v, 0.1, 0.9, 0.99, 1e-8, 0, 1, mask)
    end
    local writers = {
      { "mask_apply", function(t) core.mask_apply(t, fsdp.zeros(3)) end },
      { "mask_from_nonzero", function(t) core.mask_from_nonzero(t, ones()) end },
      { "mask_select", function(t) core.mask_select(t, ones(), nil, 0, 0, 0) end },
      { "mask_nm", function(t) core.mask_nm(t, ones(), nil, 1, 3, 0) end },
      { "mask_values", function(t) core.mask_values(t, ones(), nil) end },
      { "init_normal", function(t) core.init_normal(t, 1, "k") end },
      { "init_uniform", function(t) core.init_uniform(t, 1, "k") end },
      { "sgd_step", function(t) core.sgd_step(t, ones(), nil, 0.1) end },
      { "sgd_step", function(t) core.sgd_step(ones(), ones(), t, 0.1, 0.9) end },
      { "adamw_step", function(t) adamw(t, ones(), ones(), ones()) end },
      { "adamw_step", function(t) adamw(ones(), ones(), t, ones()) end },
      { "adamw_step", function(t) adamw(ones(), ones(), ones(), t) end },
      -- with a mask the gradient is written too
      { "adamw_step", function(t) adamw(ones(), t, ones(), ones(), ones()) end },
      { "all_reduce", function(t) fsdp.all_reduce(t) end, ":item()" },
      { "broadcast", function(t) fsdp.broadcast(t) end },
      { "r:read", function(t) r:read("a", 0, 3, t) end },
    }
    for _, f in ipairs(writers) do
      local x, y = graph()
      refused(x, y, y, f[1], f[2], f[3])
    end
    r:close()
    -- the gradient is read, not written, by adamw_step without a mask
    local x, y = graph()
    adamw(ones(), y, ones(), ones())
    y:sum():backward()
    assert.are.same({ 2, 2, 2 }, flat(x.grad))
  end)

  it("refuses writes through any view of such a tensor", function()
    local views = {
      { "narrow", function(y) return y:narrow(1, 2, 2) end,
        "(2) shares the memory of a tensor (3) that was made by affine" },
      { "view", function(y) return y:view { 3, 1 } end, "(3, 1) shares the memory" },
      { "a view chain", function(y) return y:view { 1, 3 }:transpose(1, 2) end,
        "(3, 1) shares the memory of a tensor (3) that was made by affine" },
      -- view copies a strided tensor first: the copy is the graph's memory
      { "a view of a copy", function(y)
        return fsdp.cat { y, y }:view { 2, 3 }:transpose(1, 2):view { 6 }
      end, "(6) shares the memory of a tensor (3, 2) that was made by contiguous" },
      { "detach", function(y) return y:detach() end,
        "(3) shares the memory of a tensor (3) that was made by affine" },
      { "a view made under no_grad", function(y)
        return fsdp.no_grad(function() return y:narrow(1, 1, 2) end)
      end, "(2) shares the memory of a tensor (3) that was made by affine" },
      { "a view of a detach", function(y) return y:detach():view { 1, 3 } end,
        "(1, 3) shares the memory" },
    }
    for _, v in ipairs(views) do
      for _, m in ipairs(methods) do
        local x, y = graph()
        local t = v[2](y)
        refused(x, y, t, m[1], m[2], v[3])
      end
    end
  end)

  it("takes a write through a view of a leaf as a write into the leaf", function()
    -- a recorded view of a leaf that requires a gradient is a non-leaf, but its memory is the
    -- leaf's: the view stays the leaf's view, and the graph holds as for the leaf itself
    for _, m in ipairs(methods) do
      local x = fsdp.tensor { 1, 2, 3 }
      x.requires_grad = true
      local v = x:view { 3, 1 }
      local l = (v * 2):sum()
      m[2](v)
      m[2](x:narrow(1, 1, 2))
      assert.are.same(flat(x), flat(v))
      l:backward()
      assert.are.same({ 2, 2, 2 }, flat(x.grad))
    end
  end)

  it("refuses inside no_grad too", function()
    for _, m in ipairs(methods) do
      local x, y = graph()
      refused(x, y, y, m[1], function(t) fsdp.no_grad(m[2], t) end)
    end
  end)

  it("refuses bf16 and f16 graph tensors alike", function()
    for _, dt in ipairs { "bf16", "f16" } do
      for _, m in ipairs(methods) do
        local x, y = graph(dt)
        refused(x, y, y, m[1], m[2])
        local _, b = graph("f32")
        local c = b:to(dt) -- made by the conversion
        assert_error_has(function() m[2](c) end, m[1] .. ": this tensor (3) was made by")
      end
      -- a bf16 / f16 leaf takes writes
      local x = graph(dt)
      x:mul_(2)
      assert.are.same({ 2, 4, 6 }, flat(x))
    end
  end)

  it("leaves, tensors outside a graph and consumed graphs take every write", function()
    for _, m in ipairs(methods) do
      -- a leaf that requires a gradient, while a graph made from it lives
      local x, y = graph()
      m[2](x)
      m[2](x:detach())
      m[2](x:detach():narrow(1, 1, 2))
      y:sum():backward()
      assert.are.same({ 2, 2, 2 }, flat(x.grad))
      -- a parameter, its graph live
      local p = core.parameter(fsdp.ones(3))
      local l = (p * 2):sum()
      m[2](p)
      l:backward()
      assert.are.same({ 2, 2, 2 }, flat(p.grad))
      -- computed from tensors that require no gradient, or under no_grad
      m[2](fsdp.ones(3) * 2)
      m[2](fsdp.no_grad(function() return x * 2 end))
      -- after backward consumed the graph, and after the tape was cleared
      x, y = graph()
      y:sum():backward()
      m[2](y)
      x, y = graph()
      core.tape_clear()
      m[2](y)
      m[2](y:narrow(1, 1, 2)) -- recorded (y requires a gradient), but nothing is behind y now
      m[2](y:detach():narrow(1, 1, 2))
      m[2](fsdp.no_grad(function() return y:narrow(1, 1, 2) end))
    end
    -- optimizer steps on a parameter while its graph lives
    local p = core.parameter(fsdp.ones(3))
    local l = (p * 2):sum()
    core.sgd_step(p, fsdp.ones(3), nil, 0.5)
    assert.are.same({ 0.5, 0.5, 0.5 }, flat(p))
    l:backward()
    assert.are.same({ 2, 2, 2 }, flat(p.grad))
  end)
end)

describe("functional ops", function()
  before_each(function() core.tape_clear() end)

  it("cross_entropy honours ignore_index and validates targets", function()
    local logits = fsdp.tensor { { 0, 0 }, { 10, 0 } }
    local all = F.cross_entropy(logits, fsdp.tensor { 0, 1 }):item()
    local one = F.cross_entropy(logits, fsdp.tensor { 0, -1 }):item()
    assert.is_true(math.abs(one - math.log(2)) < 1e-6)
    assert.is_true(all > one)
    local other = F.cross_entropy(logits, fsdp.tensor { 0, 5 }, { ignore_index = 5 }):item()
    assert.is_true(math.abs(other - one) < 1e-6)
    assert_error_has(function() F.cross_entropy(logits, fsdp.tensor { 0, 2 }) end,
      "cross_entropy", "target 2", "[0, 2)")
    assert_error_has(function() F.cross_entropy(logits, fsdp.tensor { 0.5, 1 }) end,
      "cross_entropy", "0.5")
    assert_error_has(function() F.cross_entropy(logits, fsdp.tensor { 0, 1, 1 }) end,
      "cross_entropy", "(3)", "(2, 2)")
    -- integer targets give the same loss as f32 ones; bf16 and f16 targets are refused by dtype
    local i64 = F.cross_entropy(logits, fsdp.tensor({ 0, 1 }, { dtype = "i64" })):item()
    assert.are.equal(all, i64)
    assert_error_has(function() F.cross_entropy(logits, fsdp.tensor({ 0, 1 }, { dtype = "bf16" })) end,
      "cross_entropy: targets are bf16; targets must be integers (i64) or f32 — a bf16 target above 256 is not exact")
    assert_error_has(function() F.cross_entropy(logits, fsdp.tensor({ 0, 1 }, { dtype = "f16" })) end,
      "cross_entropy: targets are f16", "an f16 target above 2048 is not exact")
  end)

  it("embedding validates ids", function()
    local w = fsdp.randn { 4, 3 }
    assert.are.same({ 2, 2, 3 }, F.embedding(fsdp.tensor { { 0, 3 }, { 1, 1 } }, w):shape())
    assert_error_has(function() F.embedding(fsdp.tensor { 4 }, w) end, "embedding", "4",
      "[0, 4)", "(4, 3)")
    assert_error_has(function() F.embedding(fsdp.tensor { 1.5 }, w) end, "embedding", "1.5")
    -- integer ids pick the same rows; bf16 and f16 ids are refused by dtype, whatever their
    -- values (a bf16 id above 256 is not exact: 257 rounds to 256)
    local ids = { { 0, 3 }, { 1, 1 } }
    for _, dt in ipairs { "i64", "i32", "u8", "f64" } do
      assert.are.same(F.embedding(fsdp.tensor(ids), w):totable(),
        F.embedding(fsdp.tensor(ids, { dtype = dt }), w):totable(), dt)
    end
    assert_error_has(function() F.embedding(fsdp.tensor({ 1 }, { dtype = "bf16" }), w) end,
      "embedding: ids are bf16; ids must be integers (i64) or f32 — a bf16 id above 256 is not exact")
    assert_error_has(function() F.embedding(fsdp.tensor({ 1 }, { dtype = "f16" }), w) end,
      "embedding: ids are f16", "an f16 id above 2048 is not exact")
  end)

  it("ids and targets above 2^24 pick their own row and class (i64 and f64)", function()
    -- 2^24 + 1 is no f32 number: an index carried as f32 would pick row (class) 2^24
    local V = 2 ^ 24 + 2
    local id = 2 ^ 24 + 1
    local w = fsdp.zeros({ V, 1 }, { role = "params" })
    w:set(id + 1, 1, 7)
    w:set(id, 1, 3)
    w.requires_grad = true
    for _, dt in ipairs { "i64", "f64" } do
      w.grad = nil
      local out = F.embedding(fsdp.tensor({ id }, { dtype = dt }), w)
      assert.are.same({ { 7 } }, out:totable(), dt)
      out:sum():backward()
      assert.are.equal(1, w.grad:get(id + 1, 1), dt)
      assert.are.equal(0, w.grad:get(id, 1), dt)
    end
    w = nil
    collectgarbage()
    local logits = fsdp.zeros({ 1, V })
    logits:set(1, id + 1, 30)
    logits.requires_grad = true
    for _, dt in ipairs { "i64", "f64" } do
      logits.grad = nil
      local loss = F.cross_entropy(logits, fsdp.tensor({ id }, { dtype = dt }))
      assert.is_true(loss:item() < 1e-3, dt) -- the target's logit dominates: loss ~ 0
      loss:backward()
      -- softmax - onehot: below 0 at the target only (class 2^24 would get about -1)
      assert.is_true(logits.grad:get(1, id + 1) < 0, dt)
      assert.is_true(logits.grad:get(1, id) > 0, dt)
    end
  end)

  it("a mixed-precision model takes i64 ids; f32 ids, cast to bf16 by its input cast, are refused", function()
    fsdp.manual_seed(3)
    local m = fsdp.nn.GPT { vocab = 300, ctx = 4, d = 8, layers = 1, heads = 1 }
    fsdp.wrap(m, { mp = "bf16" })
    local ids = { { 1, 299, 257, 0 } } -- 299 and 257 are not bf16 numbers
    local logits = m(fsdp.tensor(ids, { dtype = "i64" }))
    assert.are.same({ 1, 4, 300 }, logits:shape())
    assert_error_has(function() m(fsdp.tensor(ids)) end, "wte", "embedding: ids are bf16",
      "a bf16 id above 256 is not exact")
    fsdp.unwrap(m)
  end)

  it("linear, layernorm and attention name the shapes on mismatch", function()
    local x = fsdp.ones(2, 3)
    assert_error_has(function() F.linear(x, fsdp.ones(4, 5)) end, "linear", "(2, 3)", "(4, 5)")
    assert_error_has(function() F.linear(x, fsdp.ones(4, 3), fsdp.ones(5)) end, "linear", "bias")
    assert_error_has(function() F.layernorm(x, fsdp.ones(4)) end, "layernorm", "(2, 3)", "(4)")
    assert_error_has(function() F.attention(fsdp.ones(1, 2, 18), 4) end, "attention",
      "(1, 2, 18)", "4 heads")
    assert_error_has(function() F.attention(fsdp.ones(1, 2, 18), 0) end, "attention", "n_head")
    assert_error_has(function() F.mse(x, fsdp.ones(3, 2)) end, "mse", "(2, 3)", "(3, 2)")
  end)

  it("dropout is seeded, scaled and checked", function()
    local x = fsdp.ones(1000)
    fsdp.manual_seed(1)
    local a = F.dropout(x, 0.25)
    fsdp.manual_seed(1)
    local b = F.dropout(x, 0.25)
    assert.are.same(a:totable(), b:totable())
    local zeros = 0
    for _, v in ipairs(a:totable()) do
      if v == 0 then zeros = zeros + 1 else assert.is_true(math.abs(v - 4 / 3) < 1e-6) end
    end
    assert.is_true(zeros > 180 and zeros < 320)
    assert.is_true(rawequal(F.dropout(x, 0), x))
    assert_error_has(function() F.dropout(x, 1) end, "dropout", "probability 1", "(1000)")
    assert_error_has(function() F.dropout(x, -0.5) end, "dropout", "-0.5")
  end)
end)

describe("memory", function()
  it("an evaluation loop run with gradients on does not keep its graphs", function()
    core.tape_clear()
    collectgarbage()
    local w = core.parameter(fsdp.randn { 256, 256 } * 0.01)
    local x = fsdp.randn { 1024, 256 }
    local before = fsdp.memory().activations
    local peak, most = 0, 0
    for _ = 1, 300 do -- each output is 1 MiB; none is kept, no backward
      local y = F.relu(F.linear(x, w))
      y = nil
      peak = math.max(peak, fsdp.memory().activations - before)
      most = math.max(most, core.tape_size())
    end
    print(("  eval loop with grad on: at most %.0f MiB of activations, %d nodes")
      :format(peak / 2 ^ 20, most))
    assert.is_true(peak < 200 * 2 ^ 20)
    core.tape_clear()
  end)


  it("reports parameter and gradient bytes", function()
    core.tape_clear()
    collectgarbage()
    local m0 = fsdp.memory()
    local p = core.parameter(fsdp.randn { 16, 8 })
    local m1 = fsdp.memory()
    assert.are.equal(m0.params + 16 * 8 * 4, m1.params)
    assert.are.equal(m0.grads, m1.grads)
    local x = fsdp.randn { 4, 8 }
    F.linear(x, p):sum():backward()
    local m2 = fsdp.memory()
    assert.are.equal(m0.grads + 16 * 8 * 4, m2.grads)
    assert.are.equal(m1.params, m2.params)
    assert.is_true(m2.peak >= m2.live)
    assert.is_true(m2.live >= m2.params + m2.grads)
    -- a clone of a parameter is not a parameter
    local c = p:clone()
    assert.are.equal(m2.params, fsdp.memory().params)
    c:free()
    p.grad = nil
    assert.are.equal(m0.grads, fsdp.memory().grads)
    p:free()
    assert.are.equal(m0.params, fsdp.memory().params)
  end)
end)

describe("fsdp.args", function()
  it("parses --key=value, --flag and positionals", function()
    local a = fsdp.parse_args { "--lr=0.5", "--name=gpt", "--fast", "--on=true", "--off=false",
      "data.txt", "--n-layers=4" }
    assert.are.equal(0.5, a.lr)
    assert.are.equal("gpt", a.name)
    assert.is_true(a.fast)
    assert.is_true(a.on)
    assert.is_false(a.off)
    assert.are.equal(4, a["n-layers"])
    assert.are.equal("data.txt", a[1])
    assert.are.same({}, fsdp.parse_args {})
    assert.are.same({}, fsdp.parse_args(nil))
    assert.are.equal("table", type(fsdp.args))
    assert.are.equal("", fsdp.parse_args { "--empty=" }.empty)
  end)
end)
