-- tensor_spec.lua — tensors from Lua (src/lua/l_tensor.c): constructors, shapes, element
-- access, views, operators, printing, identity, and the errors bad input must give (never a
-- crash). Owner: grad. Run: busted --lua=luajit tests/lua/tensor_spec.lua

local fsdp = require "fsdp"

local H = require "helpers"
local flat, assert_error_has = H.flat, H.assert_error_has
local assert_values = H.make_assert_close(1e-6, "%.7g") -- (t, want, tol)

describe("constructors", function()
  it("builds from nested tables", function()
    local t = fsdp.tensor { { 1, 2, 3 }, { 4, 5, 6 } }
    assert.are.same({ 2, 3 }, t:shape())
    assert.are.equal(2, t:dim())
    assert.are.equal(6, t:numel())
    assert.are.same({ { 1, 2, 3 }, { 4, 5, 6 } }, t:totable())
    assert.are.equal("f32", t:dtype())
    assert.are.equal("cpu", t.device)
    local c = fsdp.tensor { { { 1 }, { 2 } }, { { 3 }, { 4 } } }
    assert.are.same({ 2, 2, 1 }, c:shape())
    assert.are.equal(3, c:get(2, 1, 1))
  end)

  it("makes a 0-dim tensor from a number and an empty tensor from {}", function()
    local s = fsdp.tensor(2.5)
    assert.are.same({}, s:shape())
    assert.are.equal(2.5, s:item())
    assert.are.equal(0, fsdp.tensor({}):numel())
  end)

  it("rejects ragged and non-numeric tables", function()
    assert_error_has(function() fsdp.tensor { { 1, 2 }, { 3 } } end, "ragged")
    assert_error_has(function() fsdp.tensor { { 1, 2 }, 3 } end, "ragged")
    assert_error_has(function() fsdp.tensor { 1, { 2 } } end, "ragged")
    assert_error_has(function() fsdp.tensor { { 1, 2 }, { 3, { 4 } } } end, "ragged")
    assert_error_has(function() fsdp.tensor { {}, { 1 } } end, "ragged")
    assert_error_has(function() fsdp.tensor { 1, "x" } end, "string", "expected a number")
    assert_error_has(function() fsdp.tensor { 1, true } end, "boolean")
    assert_error_has(function() fsdp.tensor "abc" end, "table expected")
  end)

  it("zeros, ones and full take a table or varargs", function()
    local a, b = fsdp.zeros { 2, 3 }, fsdp.zeros(2, 3)
    assert.are.same(a:shape(), b:shape())
    assert_values(a, { 0, 0, 0, 0, 0, 0 })
    assert_values(fsdp.ones(3), { 1, 1, 1 })
    assert_values(fsdp.ones { 1, 2 }, { { 1, 1 } })
    assert_values(fsdp.full({ 2, 2 }, 7), { 7, 7, 7, 7 })
    assert_values(fsdp.full(3, -1), { -1, -1, -1 })
    assert.are.same({}, fsdp.zeros():shape())
    assert_values(fsdp.arange(4), { 0, 1, 2, 3 })
    assert_values(fsdp.arange(2, 5), { 2, 3, 4 })
    assert.are.equal(0, fsdp.arange(0):numel())
  end)

  it("rejects bad shapes", function()
    assert_error_has(function() fsdp.zeros { 2, -3 } end, "shape entry 2", "-3")
    assert_error_has(function() fsdp.zeros { 2, -1 } end, "shape entry 2")
    assert_error_has(function() fsdp.zeros { 2.5 } end, "shape entry 1", "2.5")
    assert_error_has(function() fsdp.ones { 2, "a" } end, "shape entry 2", "string")
    assert_error_has(function() fsdp.zeros("a") end, "shape expected")
    assert_error_has(function() fsdp.zeros { 1, 1, 1, 1, 1, 1, 1, 1, 1 } end, "at most 8")
  end)

  it("rejects non-finite sizes and ranges", function()
    assert_error_has(function() fsdp.zeros(math.huge) end, "shape entry 1")
    assert_error_has(function() fsdp.zeros { 0 / 0 } end, "shape entry 1")
    assert_error_has(function() fsdp.arange(math.huge) end, "arange", "finite")
    assert_error_has(function() fsdp.arange(0 / 0) end, "arange")
    assert_error_has(function() fsdp.arange(0, 1, 0) end, "arange", "step")
    assert_error_has(function() fsdp.zeros(2 ^ 40, 2 ^ 40) end, "too many elements")
    assert.are.equal(0, fsdp.arange(-3):numel())
  end)

  it("randn follows the seed", function()
    fsdp.manual_seed(5)
    local a = fsdp.randn { 3, 4 }
    local b = fsdp.randn { 3, 4 }
    fsdp.manual_seed(5)
    local c = fsdp.randn(3, 4)
    assert.are.same(a:totable(), c:totable())
    assert.are_not.same(a:totable(), b:totable())
    assert.are.equal(5, fsdp.seed())
  end)

  it("makes meta tensors whose data cannot be read", function()
    local m = fsdp.empty({ 2, 3 }, { device = "meta" })
    assert.are.equal("meta", m.device)
    assert.are.same({ 2, 3 }, m:shape())
    assert.are.equal(6, m:numel())
    local m2 = fsdp.zeros(4, 5, { device = "meta" })
    assert.are.equal("meta", m2.device)
    assert.are.same({ 4, 5 }, m2:shape())
    assert_error_has(function() return m:get(1, 1) end, "get", "(2, 3)", "meta", "has no data")
    assert_error_has(function() return m:totable() end, "totable", "meta", "has no data")
    assert_error_has(function() return m:item() end, "item")
    assert_error_has(function() return fsdp.empty({}, { device = "meta" }):item() end, "item",
      "has no data")
    assert_error_has(function() return m + 1 end, "add", "(2, 3)", "has no data")
    assert_error_has(function() return m * m end, "mul", "(2, 3)", "has no data")
    assert_error_has(function() return m:sum() end, "sum", "(2, 3)", "has no data")
    assert_error_has(function() return fsdp.F.relu(m) end, "relu", "(2, 3)", "has no data")
    assert_error_has(function() return m:max() end, "max", "has no data")
    -- shape-only operations stay meta
    assert.are.equal("meta", m:view(-1).device)
    assert.are.same({ 3, 2 }, m:transpose(1, 2):shape())
    assert.truthy(tostring(m):find("meta", 1, true))
    assert_error_has(function() fsdp.empty({ 2 }, { device = "tpu" }) end, "tpu")
    assert_error_has(function() fsdp.empty({ 2 }, { device = 5 }) end, "device", "number")
    assert_error_has(function() fsdp.empty({ 2 }, "meta") end, "empty", "options table", "string")
    assert_error_has(function() fsdp.zeros(2, 3, "meta") end, "zeros", "options table")
  end)
end)

describe("element access", function()
  it("get and set are 1-based", function()
    local t = fsdp.tensor { { 1, 2, 3 }, { 4, 5, 6 } }
    assert.are.equal(1, t:get(1, 1))
    assert.are.equal(6, t:get(2, 3))
    assert.are.equal(t, t:set(2, 1, 40))
    assert.are.equal(40, t:get(2, 1))
    assert_values(t, { 1, 2, 3, 40, 5, 6 })
  end)

  it("out-of-range and malformed positions are errors", function()
    local t = fsdp.tensor { { 1, 2, 3 }, { 4, 5, 6 } }
    assert_error_has(function() t:get(0, 1) end, "position 0", "dimension 1", "start at 1")
    assert_error_has(function() t:get(3, 1) end, "position 3", "size 2", "(2, 3)")
    assert_error_has(function() t:get(1, 4) end, "position 4", "dimension 2")
    assert_error_has(function() t:get(1.5, 1) end, "position 1.5")
    assert_error_has(function() t:get(1) end, "needs 2 positions")
    assert_error_has(function() t:set(1, 1) end, "needs 2 positions")
    assert_error_has(function() t:set(3, 1, 0) end, "position 3")
    assert_error_has(function() t:set(1, 1, "x") end, "number expected")
    assert_error_has(function() return t[1] end, "t:get")
  end)

  it("item needs exactly one element", function()
    assert.are.equal(3, fsdp.tensor({ 3 }):item())
    assert_error_has(function() fsdp.tensor({ 1, 2 }):item() end, "item", "(2)", "2 elements")
    assert_error_has(function() fsdp.zeros(0):item() end, "item", "0 elements")
  end)

  it("fill, zero, copy and clone", function()
    local t = fsdp.zeros(2, 2)
    t:fill(3)
    assert_values(t, { 3, 3, 3, 3 })
    t:zero()
    assert_values(t, { 0, 0, 0, 0 })
    t:copy(fsdp.tensor { { 1, 2 }, { 3, 4 } })
    assert_values(t, { 1, 2, 3, 4 })
    local c = t:clone()
    c:set(1, 1, 9)
    assert.are.equal(1, t:get(1, 1))
    assert_error_has(function() t:copy(fsdp.zeros(3)) end, "copy", "(2, 2)", "(3)")
    -- copying through a transposed view
    local u = fsdp.zeros(2, 2)
    u:copy(t:transpose(1, 2))
    assert_values(u, { 1, 3, 2, 4 })
  end)
end)

describe("views", function()
  it("view and reshape infer one -1", function()
    local t = fsdp.arange(6)
    assert.are.same({ 2, 3 }, t:view { 2, 3 }:shape())
    assert.are.same({ 3, 2 }, t:view(3, -1):shape())
    assert.are.same({ 6 }, t:view { 2, 3 }:view(-1):shape())
    assert.are.same({ 1, 6 }, t:reshape { 1, -1 }:shape())
    assert_error_has(function() t:view { 4, -1 } end, "view", "(4, -1)", "(6)")
    assert_error_has(function() t:view { -1, -1 } end, "view", "more than one -1")
    assert_error_has(function() t:view { 4, 2 } end, "view", "(4, 2)", "(6)")
    -- a view shares storage
    local v = t:view { 2, 3 }
    v:set(2, 1, 30)
    assert.are.equal(30, t:get(4))
  end)

  it("transpose and narrow take 1-based dimensions and positions", function()
    local t = fsdp.tensor { { 1, 2, 3 }, { 4, 5, 6 } }
    local tt = t:transpose(1, 2)
    assert.are.same({ 3, 2 }, tt:shape())
    assert.are.equal(4, tt:get(1, 2))
    assert.is_false(tt:is_contiguous())
    assert.are.same({ { 1, 4 }, { 2, 5 }, { 3, 6 } }, tt:totable())
    assert.are.same({ 3, 2 }, t:transpose():shape())
    assert.are.same({ 3, 2 }, t:transpose(-1, -2):shape())
    assert_values(t:narrow(2, 2, 2), { { 2, 3 }, { 5, 6 } })
    assert_values(t:narrow(1, 2, 1), { { 4, 5, 6 } })
    assert_values(tt:narrow(1, 3, 1), { { 3, 6 } })
    assert_error_has(function() t:transpose(0, 1) end, "transpose", "dimension 0", "start at 1")
    assert_error_has(function() t:transpose(1, 3) end, "transpose", "dimension 3", "(2, 3)")
    assert_error_has(function() t:narrow(3, 1, 1) end, "narrow", "dimension 3")
    assert_error_has(function() t:narrow(2, 0, 1) end, "narrow", "start 0", "start at 1")
    assert_error_has(function() t:narrow(2, 3, 2) end, "narrow", "start 3", "length 2", "size 3")
    assert_error_has(function() fsdp.tensor({ 1 }):transpose() end, "transpose")
    -- a non-contiguous tensor can be viewed after contiguous() (view copies when needed)
    assert.is_true(tt:contiguous():is_contiguous())
    assert_values(tt:view(-1), { 1, 4, 2, 5, 3, 6 })
  end)
end)

describe("operators", function()
  local a = fsdp.tensor { { 1, 2 }, { 3, 4 } }
  local b = fsdp.tensor { { 10, 20 }, { 30, 40 } }

  it("tensor op tensor", function()
    assert_values(a + b, { 11, 22, 33, 44 })
    assert_values(b - a, { 9, 18, 27, 36 })
    assert_values(a * b, { 10, 40, 90, 160 })
    assert_values(b / a, { 10, 10, 10, 10 })
    assert_values(-a, { -1, -2, -3, -4 })
    assert_values(a:matmul(b), { 70, 100, 150, 220 })
  end)

  it("numbers on either side", function()
    assert_values(a + 1, { 2, 3, 4, 5 })
    assert_values(1 + a, { 2, 3, 4, 5 })
    assert_values(a - 1, { 0, 1, 2, 3 })
    assert_values(2 - a, { 1, 0, -1, -2 })
    assert_values(a * 2, { 2, 4, 6, 8 })
    assert_values(2 * a, { 2, 4, 6, 8 })
    assert_values(a / 2, { 0.5, 1, 1.5, 2 })
    assert_values(2 / a, { 2, 1, 2 / 3, 0.5 })
  end)

  it("broadcasts over leading dimensions, either way round", function()
    local row = fsdp.tensor { 100, 200 }
    assert_values(a + row, { 101, 202, 103, 204 })
    assert_values(row + a, { 101, 202, 103, 204 })
    assert_values(row - a, { 99, 198, 97, 196 })
    assert_values(a / row, { 0.01, 0.01, 0.03, 0.02 })
    assert_values(a * fsdp.tensor(3), { 3, 6, 9, 12 })
    local t3 = fsdp.ones(2, 2, 2)
    assert.are.same({ 2, 2, 2 }, (t3 * a):shape())
    assert_values(a * t3, { 1, 2, 3, 4, 1, 2, 3, 4 })
    assert_error_has(function() return a + fsdp.ones(3) end, "add", "(2, 2)", "(3)")
    assert_error_has(function() return fsdp.ones(3, 2) * fsdp.ones(2, 3) end, "mul", "(3, 2)",
      "(2, 3)")
  end)

  it("other methods", function()
    assert.are.equal(10, a:sum():item())
    assert.are.equal(2.5, a:mean():item())
    assert_values(a:sum(1), { 4, 6 })
    assert_values(a:sum(2), { 3, 7 })
    assert_values(a:mean(-1), { 1.5, 3.5 })
    assert_values(fsdp.tensor({ -1, 2 }):relu(), { 0, 2 })
    assert_values(fsdp.tensor({ 0 }):exp(), { 1 })
    assert_values(fsdp.tensor({ 4 }):sqrt(), { 2 })
    assert_values(fsdp.tensor({ 1 }):log(), { 0 })
    assert_values(fsdp.tensor({ 3 }):pow(2), { 9 })
    assert_values(fsdp.tensor({ 0, 0 }):softmax(), { 0.5, 0.5 })
    assert_values(fsdp.tensor({ { 1, 5, 2 }, { 7, 0, 1 } }):argmax(), { 1, 0 })
    assert.are.equal(4, a:max())
    assert.are.equal(1, a:min())
    assert_values(fsdp.tensor({ 0 }):gelu(), { 0 })
    assert_error_has(function() a:sum(3) end, "sum", "dimension 3")
    assert_error_has(function() a:matmul(fsdp.ones(3, 2)) end, "matmul", "(2, 2)", "(3, 2)")
  end)

  it("in-place add_ and mul_ (no autograd)", function()
    local t = fsdp.tensor { 1, 2 }
    t:add_(fsdp.tensor { 10, 10 }, 0.5)
    assert_values(t, { 6, 7 })
    t:mul_(2)
    assert_values(t, { 12, 14 })
    assert_error_has(function() t:add_(fsdp.ones(3)) end, "add_", "(2)", "(3)")
  end)

  it("wrong Lua types are errors that name the problem", function()
    assert_error_has(function() return a + "x" end, "add", "tensor and string")
    assert_error_has(function() return "x" .. "" + a end, "add", "string")
    assert_error_has(function() return a * {} end, "mul", "table")
    assert_error_has(function() return a / true end, "div", "boolean")
    assert_error_has(function() return a - nil end, "sub", "nil")
    assert_error_has(function() return a:matmul(3) end, "tensor expected", "number")
    assert_error_has(function() return fsdp.F.linear("a", a) end, "linear", "tensor expected",
      "string")
    assert_error_has(function() return fsdp.F.linear(a, a, 5) end, "linear", "#3")
    assert_error_has(function() return fsdp.F.layernorm(a, {}) end, "layernorm", "#2", "table")
    assert_error_has(function() return fsdp.F.dropout(a, "p") end, "dropout", "number expected")
    assert_error_has(function() return fsdp.F.attention(a, "x") end, "attention", "n_head")
    assert_error_has(function() return fsdp.F.cross_entropy(a, a, { ignore_index = "x" }) end,
      "cross_entropy", "ignore_index")
    assert_error_has(function() return fsdp.Tensor.sum(42) end, "tensor expected", "number")
    assert_error_has(function() a.shape = 3 end, "no settable field 'shape'")
  end)
end)

describe("lifetime and identity", function()
  it("a freed tensor errors on use, never crashes", function()
    local t = fsdp.ones(2)
    local u = t
    t:free()
    t:free() -- idempotent
    assert.are.equal("tensor(freed)", tostring(u))
    assert_error_has(function() return u:sum() end, "freed")
    assert_error_has(function() return u + 1 end, "freed")
    assert_error_has(function() return 1 + u end, "freed")
    assert_error_has(function() return u * fsdp.ones(2) end, "freed")
    assert_error_has(function() return u.grad end, "freed")
    assert_error_has(function() return u:shape() end, "freed")
    assert_error_has(function() return fsdp.F.relu(u) end, "relu", "freed")
    assert_error_has(function() return fsdp.F.mse(fsdp.ones(2), u) end, "mse", "#2", "freed")
    assert_error_has(function() u.requires_grad = true end, "freed")
    collectgarbage() -- __gc after free is a no-op
  end)

  it("the same C tensor is the same userdata", function()
    local p = fsdp.core.parameter(fsdp.randn { 3 })
    assert.is_true(rawequal(p, fsdp.core.parameter(p)))
    p.grad = fsdp.ones(3)
    assert.is_true(rawequal(p.grad, p.grad))
    local g = p.grad
    collectgarbage()
    assert.is_true(rawequal(g, p.grad))
    p.grad = nil
    assert.is_nil(p.grad)
  end)

  it("grad assignment is checked", function()
    local t = fsdp.zeros(2, 3)
    assert_error_has(function() t.grad = fsdp.zeros(3, 2) end, "grad", "(3, 2)", "(2, 3)")
    assert_error_has(function() t.grad = fsdp.zeros(3, 2):transpose() end, "contiguous")
    assert_error_has(function() t.grad = 5 end, "tensor expected")
  end)

  it("dead tensors do not pile up between collections (the binding counts their bytes)", function()
    collectgarbage()
    local before = fsdp.memory().activations
    local peak = 0
    for _ = 1, 400 do -- 400 MiB allocated in all, 1 MiB at a time, never collected by hand
      local t = fsdp.zeros(256, 1024)
      peak = math.max(peak, fsdp.memory().activations - before)
      t = nil
    end
    print(("\n  1 MiB tensors x 400: at most %.0f MiB of them alive at once"):format(peak / 2 ^ 20))
    assert.is_true(peak < 160 * 2 ^ 20)
  end)

  it("many short-lived tensors are collected", function()
    local before = fsdp.memory().activations
    for _ = 1, 200 do local _ = fsdp.zeros(64, 64) + 1 end
    collectgarbage()
    collectgarbage()
    assert.is_true(fsdp.memory().activations <= before + 64 * 64 * 4 * 2)
  end)
end)

describe("bad arguments never crash", function()
  it("every method, F op and constructor raises a plain error on any argument mix", function()
    local freed = fsdp.ones(2)
    freed:free()
    local vals = {
      function() return nil end, function() return 0 end, function() return -1 end,
      function() return 2.5 end, function() return 0 / 0 end, function() return math.huge end,
      function() return "x" end, function() return {} end, function() return { 2, 3 } end,
      function() return { { 1, 2 }, { 3, 4 } } end, function() return true end,
      function() return fsdp.ones(2, 3) end, function() return fsdp.ones(3) end,
      function() return fsdp.tensor(2) end, function() return fsdp.zeros(0) end,
      function() return freed end, function() return fsdp.empty({ 2, 3 }, { device = "meta" }) end,
      function() return fsdp.ones(2, 3):transpose(1, 2) end, function() return print end,
    }
    local fns = {}
    for k, f in pairs(fsdp.Tensor) do if k ~= "free" then fns[#fns + 1] = { "Tensor." .. k, f } end end
    for k, f in pairs(fsdp.F) do fns[#fns + 1] = { "F." .. k, f } end
    for _, k in ipairs { "tensor", "zeros", "ones", "full", "empty", "randn", "rand", "arange" } do
      fns[#fns + 1] = { k, fsdp[k] }
    end
    for _, k in ipairs { "parameter", "init_normal", "init_uniform", "sumsq", "sgd_step",
      "adamw_step" } do
      fns[#fns + 1] = { "core." .. k, fsdp.core[k] }
    end
    local calls, errors = 0, 0
    for _, nf in ipairs(fns) do
      for i = 1, #vals do
        for j = 1, #vals do
          local ok, err = pcall(nf[2], vals[i](), vals[j](), vals[(i + j) % #vals + 1]())
          calls = calls + 1
          if not ok then
            errors = errors + 1
            if type(err) ~= "string" or #err == 0 then
              error(nf[1] .. " raised a non-message error: " .. tostring(err))
            end
          end
        end
      end
      fsdp.core.tape_clear()
    end
    assert.is_true(fsdp.is_grad_enabled())
    assert.is_true(calls > 10000 and errors > calls / 2)
  end)
end)

describe("printing", function()
  it("shows shape, dtype, device and values", function()
    local s = tostring(fsdp.tensor { { 1, 2, 3 }, { 4, 5, 6 } })
    assert.truthy(s:find("(2, 3)", 1, true))
    assert.truthy(s:find("f32", 1, true))
    assert.truthy(s:find("cpu", 1, true))
    assert.truthy(s:find("[[1, 2, 3],", 1, true))
    assert.truthy(s:find("[4, 5, 6]]", 1, true))
    assert.truthy(tostring(fsdp.tensor(0.25)):find("0.25", 1, true))
  end)

  it("abbreviates long dimensions", function()
    local s = tostring(fsdp.arange(100))
    assert.truthy(s:find("(100)", 1, true))
    assert.truthy(s:find("[0, 1, 2, ..., 97, 98, 99]", 1, true))
    assert.is_true(#s < 200)
    local big = tostring(fsdp.zeros(50, 50))
    assert.is_true(#big < 400)
  end)

  it("marks parameters and tensors that require a gradient", function()
    local p = fsdp.core.parameter(fsdp.zeros(2))
    assert.truthy(tostring(p):find("parameter", 1, true))
    local t = fsdp.zeros(2)
    t.requires_grad = true
    assert.truthy(tostring(t):find("requires_grad", 1, true))
  end)
end)

describe("memory roles", function()
  it("accounts a tensor under the role its options name", function()
    local before = fsdp.memory()
    local g = fsdp.zeros({ 8, 8 }, { role = "grads" })
    assert.are.equal(before.grads + 8 * 8 * 4, fsdp.memory().grads)
    g:free()
    assert.are.equal(before.grads, fsdp.memory().grads)
  end)
  it("rejects an unknown role by name", function()
    local ok, err = pcall(fsdp.zeros, { 2 }, { role = "bogus" })
    assert.is_false(ok)
    assert.truthy(err:find("bogus", 1, true))
  end)
end)
