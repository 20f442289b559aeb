-- tensor_spec.lua — tensors from Lua (src/lua/l_tensor.c): constructors, shapes, element
-- access, views, operators, printing, identity, and the errors bad input must give (never a
-- crash). Run: busted --lua=luajit tests/lua/tensor_spec.lua

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
    assert_error_has(function() fsdp.tensor "abc" end, "bad argument #1 to 'tensor' (values: a number or a nested table")
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

  it("takes options inside the shape table (fsdp.zeros{2, 3, dtype = \"bf16\"}) or after it", function()
    local z = fsdp.zeros { 2, 3, dtype = "bf16" }
    assert.are.same({ 2, 3 }, z:shape())
    assert.are.equal("bf16", z:dtype())
    assert.are.equal("i64", fsdp.ones { 4, dtype = "i64" }:dtype())
    assert.are.equal("f64", fsdp.randn { 2, 2, dtype = "f64" }:dtype())
    local f = fsdp.full({ 2, dtype = "i32" }, 7)
    assert.are.equal("i32", f:dtype())
    assert.are.same({ 7, 7 }, f:totable())
    local t = fsdp.tensor { { 1, 2 }, { 3, 4 }, dtype = "i64" }
    assert.are.equal("i64", t:dtype())
    assert.are.same({ { 1, 2 }, { 3, 4 } }, t:totable())
    assert.are.equal("meta", fsdp.empty { 3, device = "meta", dtype = "bf16" }.device)
    assert.are.equal("bf16", fsdp.zeros({ 2 }, { dtype = "bf16" }):dtype())
    assert_error_has(function() fsdp.zeros({ 2, dtype = "bf16" }, { dtype = "f32" }) end,
      "zeros: options given both in the shape table and after it")
    assert_error_has(function() fsdp.full({ 2, dtype = "i32" }, 1, { dtype = "f32" }) end,
      "full: options given both")
    assert_error_has(function() fsdp.tensor({ 1, dtype = "i64" }, { dtype = "f32" }) end,
      "tensor: options given both")
    assert_error_has(function() fsdp.zeros { 2, dtyp = "bf16" } end,
      "zeros: unknown option 'dtyp' (valid: device, dtype, role)")
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
    -- a strided destination is refused by the method's name; a strided source is fine
    local m = fsdp.tensor { { 1, 2 }, { 3, 4 } }
    local mt = m:transpose(1, 2)
    assert_error_has(function() mt:add_(fsdp.ones(2, 2)) end,
      "add_: needs a contiguous tensor, got a strided view (2, 2)")
    assert_error_has(function() mt:mul_(2) end,
      "mul_: needs a contiguous tensor, got a strided view (2, 2)")
    m:add_(mt)
    assert_values(m, { 2, 5, 5, 8 })
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

  it("divides by a number (not times its reciprocal) and keeps the sign of zero", function()
    local function bits(t)
      local out = {}
      for i, v in ipairs(t:totable()) do out[i] = (v == 0 and 1 / v < 0) and "-0" or ("%a"):format(v) end
      return table.concat(out, " ")
    end
    local x = fsdp.tensor { 0, 1e-30, 3e38 }
    -- 1 / 1e-39 overflows f32: the reciprocal would give NaN for 0 and inf for 1e-30
    assert.are.equal(bits(x / fsdp.full({ 3 }, 1e-39)), bits(x / 1e-39))
    assert.are.equal(bits(x / fsdp.full({ 3 }, 3e38)), bits(x / 3e38))
    assert.are.equal(1, (fsdp.tensor { 3e38 } / 3e38):item())
    local r = fsdp.randn { 257 }
    assert.are.equal(bits(r / fsdp.full({ 257 }, 3)), bits(r / 3))
    assert.are.equal(bits(fsdp.full({ 3 }, 1e-30) / x), bits(1e-30 / x))
    local h = fsdp.tensor({ 0, 1 }, { dtype = "bf16" })
    assert.are.equal(bits(h / fsdp.tensor({ 1e-39, 1e-39 }, { dtype = "bf16" })), bits(h / 1e-39))
    -- a number keeps the tensor's shape, one element or not
    assert.are.same({ 1, 1 }, (1 / fsdp.ones { 1, 1 }):shape())
    assert.are.same({ 1 }, (3 / fsdp.tensor { 2 }):shape())
    assert.are.same({ 1, 1 }, (fsdp.full({}, 1) + fsdp.ones { 1, 1 }):shape())
    assert.are.same({ 2, 3 }, (fsdp.ones { 2, 3 } + fsdp.ones { 1, 1, 1 }):shape())
    -- -x is -1 * x, and a product -0 stays -0
    assert.are.equal("-0 -0x1p+0", bits(-fsdp.tensor { 0, 1 }))
    assert.are.equal("-0 0x0p+0", bits(fsdp.tensor { 0, -0.0 } * -1 * 1))
    assert.are.equal("-0", bits(-2 * fsdp.tensor { 0 }))
    assert.are.equal("0x0p+0", bits(fsdp.tensor { -0.0 } + 0))
  end)

  it("relu lets NaN through in every float dtype, at every position", function()
    for _, dt in ipairs { "f32", "bf16", "f16", "f64" } do
      for n = 1, 40, 13 do
        local v = {}
        for i = 1, n do v[i] = (i % 3) - 1 end
        v[n] = 0 / 0
        local r = fsdp.tensor(v, { dtype = dt }):relu():totable()
        assert.is_true(r[n] ~= r[n], dt .. " n " .. n)
        for i = 1, n - 1 do assert.are.equal(math.max(v[i], 0), r[i]) end
      end
    end
  end)

  it("where broadcasts onto an empty tensor from either side", function()
    local e = fsdp.zeros { 0, 4 }
    for _, r in ipairs { fsdp.where(e:gt(0), 1, e), fsdp.where(e:gt(0), e, 1),
      fsdp.where(e:gt(0), e, fsdp.ones { 4 }), fsdp.where(fsdp.ones({ 4 }):gt(0), e, 2) } do
      assert.are.same({ 0, 4 }, r:shape())
    end
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

describe("argument errors name the function", function()
  it("however the function is called (through pcall, or in a tail call)", function()
    local t = fsdp.ones{2}
    local function fails(f, ...)
      local ok, err = pcall(f, ...)
      assert.is_false(ok)
      return err
    end
    assert.are.equal("bad argument #1 to 'tensor' (values: a number or a nested table of numbers "
      .. "expected, got string)", fails(fsdp.tensor, "abc"))
    assert.are.equal("bad argument #2 to 'tensor' (options: table expected, got string)",
      fails(fsdp.tensor, {1}, "f32"))
    assert.are.equal("bad argument #2 to 'full' (value: number expected, got no value)",
      fails(fsdp.full, {2}))
    assert.are.equal("bad argument #3 to 'full' (value: number expected, got string)",
      fails(fsdp.full, 2, 3, "x"))
    assert.are.equal("bad argument #3 to 'set' (value: number expected, got string)",
      fails(t.set, t, 1, "x"))
    assert.are.equal("bad argument #2 to 'fill' (value: number expected, got string)",
      fails(t.fill, t, "1"))
    assert_error_has(function() return fsdp.zeros{0}:argmax() end,
      "argmax: dimension 1 of the tensor (0) is empty")
    local freed = fsdp.ones{3}
    freed:free()
    assert_error_has(function() return fsdp.cat{fsdp.ones{3}, freed} end,
      "cat: entry 2 is a freed tensor (t:free() was called on it)")
    assert_error_has(function() return fsdp.stack{freed} end, "stack: entry 1 is a freed tensor")
    assert_error_has(function() return fsdp.cat{fsdp.ones{3}, 5} end,
      "cat: entry 2 is a number, expected a tensor")
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

-- ---- dtypes ------------------------------------------------------------------------------------

local function is_nan(x) return x ~= x end

describe("dtypes", function()
  local all = { "f32", "bf16", "f16", "f64", "i64", "i32", "u8", "bool" }

  it("every factory takes a dtype, and t:dtype() names it", function()
    for _, dt in ipairs(all) do
      local o = { dtype = dt }
      assert.are.equal(dt, fsdp.zeros({ 2, 3 }, o):dtype())
      assert.are.equal(dt, fsdp.zeros(2, 3, o):dtype())
      assert.are.equal(dt, fsdp.ones({ 2 }, o):dtype())
      assert.are.equal(dt, fsdp.full({ 2 }, 1, o):dtype())
      assert.are.equal(dt, fsdp.empty({ 2 }, o):dtype())
      assert.are.equal(dt, fsdp.tensor({ 1, 0 }, o):dtype())
      assert.are.equal(dt, fsdp.tensor(1, o):dtype())
      assert.are.equal(dt, fsdp.arange(3, o):dtype())
      assert.are.equal(dt, fsdp.empty({ 2 }, { dtype = dt, device = "meta" }):dtype())
      assert.are.same({ 1, 1 }, fsdp.ones({ 2 }, o):totable())
    end
    for _, dt in ipairs { "f32", "bf16", "f16", "f64" } do
      assert.are.equal(dt, fsdp.randn({ 4 }, { dtype = dt }):dtype())
      assert.are.equal(dt, fsdp.rand({ 4 }, { dtype = dt }):dtype())
    end
    -- PyTorch's names are accepted and normalised
    assert.are.equal("bf16", fsdp.zeros({ 1 }, { dtype = "bfloat16" }):dtype())
    assert.are.equal("i64", fsdp.zeros({ 1 }, { dtype = "long" }):dtype())
    assert.are.equal("f16", fsdp.zeros({ 1 }, { dtype = "half" }):dtype())
    assert.are.equal("f64", fsdp.zeros({ 1 }, { dtype = "double" }):dtype())
  end)

  it("random values are the f32 stream rounded to the dtype", function()
    fsdp.manual_seed(11)
    local a = fsdp.randn { 64 }
    fsdp.manual_seed(11)
    local b = fsdp.randn({ 64 }, { dtype = "bf16" })
    fsdp.manual_seed(11)
    local c = fsdp.randn({ 64 }, { dtype = "f64" })
    assert.are.same(a:to("bf16"):totable(), b:totable())
    assert.are.same(a:totable(), c:totable()) -- widening is exact
    assert_error_has(function() fsdp.randn({ 2 }, { dtype = "i64" }) end,
      "op randn has no kernel for i64 on cpu")
    assert_error_has(function() fsdp.rand({ 2 }, { dtype = "bool" }) end,
      "op rand has no kernel for bool on cpu")
  end)

  it("printing shows the dtype", function()
    assert.truthy(tostring(fsdp.tensor({ 1.5 }, { dtype = "bf16" })):find("tensor((1), bf16, cpu)", 1, true))
    assert.truthy(tostring(fsdp.tensor({ 1, 0 }, { dtype = "bool" })):find("bool", 1, true))
    local s = tostring(fsdp.tensor({ 2 ^ 40 + 1, -7 }, { dtype = "i64" }))
    assert.truthy(s:find("i64", 1, true))
    assert.truthy(s:find("[1099511627777, -7]", 1, true))
    assert.truthy(tostring(fsdp.zeros({ 2 }, { dtype = "f16", device = "meta" })):find("(2), f16, meta", 1, true))
    -- NaN prints as nan whatever its sign bit (0/0 is a negative NaN on x86)
    local n = tostring(fsdp.tensor { 0 / 0, 1 / 0, -1 / 0 })
    assert.truthy(n:find("[nan, inf, -inf]", 1, true), n)
  end)

  it("to converts with round to nearest even, keeping NaN and infinities", function()
    local x = fsdp.tensor { 1 + 2 ^ -8, 1 + 3 * 2 ^ -8, 1 + 2 ^ -8 + 2 ^ -20, -(1 + 3 * 2 ^ -8),
      0 / 0, 1 / 0, -1 / 0, 3.4e38 }
    local b = x:to("bf16")
    assert.are.equal("bf16", b:dtype())
    local v = H.flat(b)
    assert.are.equal(1, v[1])                -- a tie: to the even mantissa
    assert.are.equal(1 + 2 ^ -6, v[2])       -- a tie the other way
    assert.are.equal(1 + 2 ^ -7, v[3])       -- above the tie: up
    assert.are.equal(-(1 + 2 ^ -6), v[4])
    assert.is_true(is_nan(v[5]))
    assert.are.equal(1 / 0, v[6])
    assert.are.equal(-1 / 0, v[7])
    assert.are.equal(1 / 0, v[8])            -- past bf16's largest finite value
    local h = H.flat(fsdp.tensor { 1 + 2 ^ -11, 1 + 3 * 2 ^ -11, 65519, 65520, 2 ^ -25, 0 / 0 }:to("f16"))
    assert.are.same({ 1, 1 + 2 ^ -9, 65504, 1 / 0, 0 }, { h[1], h[2], h[3], h[4], h[5] })
    assert.is_true(is_nan(h[6]))
    -- to integers truncates toward zero and saturates; NaN becomes 0; bool is v ~= 0
    assert.are.same({ 1, 0, 0, 255, 0 }, fsdp.tensor { 1.7, -1.7, 0 / 0, 300, -5 }:to("u8"):totable())
    assert.are.same({ 1, -1, 0 }, fsdp.tensor { 1.7, -1.7, 0 / 0 }:to("i32"):totable())
    assert.are.same({ 1, 0, 1 }, fsdp.tensor { 0.5, 0, 0 / 0 }:to("bool"):totable())
  end)

  it("to takes dtypes and devices, by name or in a table; the same tensor when nothing changes", function()
    local x = fsdp.tensor { 1.5, 2.5 }
    assert.is_true(rawequal(x, x:to("f32")))
    assert.is_true(rawequal(x, x:to("cpu")))
    assert.is_true(rawequal(x, x:to { device = "cpu", dtype = "f32" }))
    assert.are.equal("f64", x:to { dtype = "f64" }:dtype())
    assert.are.equal("f16", x:to("cpu", "f16"):dtype())
    assert.are.equal("f16", x:to("half"):dtype())
    local m = x:to("meta")
    assert.are.equal("meta", m.device)
    assert.are.equal("f32", m:dtype())
    assert.are.equal("bf16", x:to { device = "meta", dtype = "bf16" }:dtype())
    assert.are.same({ 1.5, 2.5 }, x:to("f64"):to("f32"):totable())
    assert_error_has(function() x:to("f8") end, "to: 'f8' is neither a dtype", "nor a device")
    assert_error_has(function() x:to() end, "to: expected a dtype or a device name")
    assert_error_has(function() x:to { dtyp = "f32" } end, "to: unknown option 'dtyp' (valid: device, dtype)")
    assert_error_has(function() x:to { device = 3 } end, "to: device must be a name")
    assert_error_has(function() x:to { dtype = "f8" } end, "unknown dtype 'f8'")
  end)

  it("to is recorded: the gradient flows back converted", function()
    local x = fsdp.tensor { 1, 2, 3 }
    x.requires_grad = true
    local y = x:to("f64")
    assert.is_true(y.requires_grad)
    local loss = (y * y):sum()
    assert.are.equal("f64", loss:dtype())
    loss:backward()
    assert.are.equal("f32", x.grad:dtype())
    assert.are.same({ 2, 4, 6 }, x.grad:totable())
    -- to an integer dtype cannot carry a gradient
    assert_error_has(function() x:to("i64") end,
      "to: a tensor that requires a gradient cannot become i64 (gradients need a float dtype; detach() it first)")
    assert.are.same({ 1, 2, 3 }, x:detach():to("i64"):totable())
  end)

  it("item, totable, get and set on bf16, i64 and bool tensors", function()
    local b = fsdp.zeros({ 2, 2 }, { dtype = "bf16" })
    b:set(1, 2, 1 + 2 ^ -8)   -- rounds on the way in
    b:set(2, 1, 3.140625)
    assert.are.equal(1, b:get(1, 2))
    assert.are.equal(3.140625, b:get(2, 1))
    assert.are.same({ { 0, 1 }, { 3.140625, 0 } }, b:totable())
    assert.are.equal(3.140625, b:narrow(1, 2, 1):narrow(2, 1, 1):item())

    local big = 2 ^ 40 + 3 -- beyond 2^31: i64 keeps it exactly
    local i = fsdp.tensor({ big, -big, 2 ^ 53 }, { dtype = "i64" })
    assert.are.equal(big, i:get(1))
    assert.are.equal(-big, i:get(2))
    assert.are.equal(2 ^ 53, i:get(3))
    i:set(2, 2 ^ 31 + 5)
    assert.are.same({ big, 2 ^ 31 + 5, 2 ^ 53 }, i:totable())
    assert.are.equal(big, i:narrow(1, 1, 1):item())
    i:set(1, 7.9) -- integers truncate toward zero
    assert.are.equal(7, i:get(1))
    local i32 = fsdp.tensor({ 2 ^ 40 }, { dtype = "i32" }) -- saturates
    assert.are.equal(2 ^ 31 - 1, i32:item())

    local z = fsdp.zeros({ 3 }, { dtype = "bool" })
    z:set(1, 5)
    z:set(3, -0.5)
    assert.are.same({ 1, 0, 1 }, z:totable())
    assert.are.equal(1, z:get(3))
    assert.are.equal(0, z:narrow(1, 2, 1):item())
    z:fill(0)
    assert.are.same({ 0, 0, 0 }, z:totable())
  end)

  it("arange takes a dtype", function()
    assert.are.same({ 0, 1, 2, 3, 4 }, fsdp.arange(5, { dtype = "i64" }):totable())
    assert.are.same({ 2 ^ 40, 2 ^ 40 + 1 }, fsdp.arange(2 ^ 40, 2 ^ 40 + 2, { dtype = "i64" }):totable())
    assert.are.same({ 0, 0.25, 0.5, 0.75 }, fsdp.arange(0, 1, 0.25, { dtype = "bf16" }):totable())
    assert.are.same({ 0, 1, 1 }, fsdp.arange(3, { dtype = "bool" }):totable())
    assert.are.same({ 3, 2, 1 }, fsdp.arange(3, 0, -1, { dtype = "u8" }):totable())
    assert.are.equal("meta", fsdp.arange(4, { dtype = "i32", device = "meta" }).device)
    assert_error_has(function() fsdp.arange(3, { dtype = "q4" }) end, "unknown dtype 'q4'")
    assert_error_has(function() fsdp.arange(3, { step = 2 }) end, "arange: unknown option 'step'")
  end)

  it("unknown dtypes and unknown option keys are errors naming the valid ones", function()
    assert_error_has(function() fsdp.zeros({ 2 }, { dtype = "f8" }) end,
      "unknown dtype 'f8' (valid: f32, bf16, f16, f64, i64, i32, u8, bool)")
    assert_error_has(function() fsdp.zeros({ 2 }, { dtype = 5 }) end, "dtype must be a name", "number")
    assert_error_has(function() fsdp.zeros({ 2 }, { dtyp = "f32" }) end,
      "zeros: unknown option 'dtyp' (valid: device, dtype, role)")
    assert_error_has(function() fsdp.tensor({ 1 }, { requires_grad = true }) end,
      "tensor: unknown option 'requires_grad' (valid: device, dtype, role)")
    assert_error_has(function() fsdp.full({ 2 }, 1, { colour = 1 }) end, "full: unknown option 'colour'")
    assert_error_has(function() fsdp.randn({ 2 }, { [1] = 2 }) end, "randn: unknown option 'number'")
  end)

  it("only float tensors can require a gradient", function()
    for _, dt in ipairs { "i64", "i32", "u8", "bool" } do
      local t = fsdp.zeros({ 2 }, { dtype = dt })
      assert_error_has(function() t.requires_grad = true end,
        "requires_grad: only float tensors can require a gradient (this one is " .. dt .. ")")
      t.requires_grad = false -- turning it off is always fine
    end
    for _, dt in ipairs { "f32", "bf16", "f16", "f64" } do
      local t = fsdp.zeros({ 2 }, { dtype = dt })
      t.requires_grad = true
      assert.is_true(t.requires_grad)
    end
  end)

  it("binary ops promote: f64 > f32 > bf16, f16; bf16 with f16 gives f32; integers take the float's dtype", function()
    local function T(dt, v) return fsdp.tensor(v or { 1, 2 }, { dtype = dt }) end
    local cases = {
      { "f32", "f64", "f64" }, { "bf16", "f32", "f32" }, { "f16", "f32", "f32" },
      { "bf16", "f16", "f32" }, { "bf16", "f64", "f64" }, { "i64", "f32", "f32" },
      { "i64", "bf16", "bf16" }, { "u8", "f16", "f16" }, { "i32", "i64", "i64" },
      { "u8", "i32", "i32" }, { "bool", "u8", "u8" }, { "bool", "f32", "f32" },
      { "i64", "i64", "i64" }, { "bf16", "bf16", "bf16" },
    }
    for _, c in ipairs(cases) do
      assert.are.equal(c[3], (T(c[1]) + T(c[2])):dtype(), c[1] .. " + " .. c[2])
      assert.are.equal(c[3], (T(c[2]) * T(c[1])):dtype(), c[2] .. " * " .. c[1])
    end
    assert.are.same({ 3.5, 4.5 }, (T("i64", { 3, 4 }) + T("f32", { 0.5, 0.5 })):totable())
    -- i64 arithmetic is exact beyond 2^53
    local a = T("i64", { 2 ^ 53 }) + T("i64", { 1 })
    assert.are.equal(1, (a - T("i64", { 2 ^ 53 })):item())
    -- and so are i64 sums
    local big = fsdp.cat { a, T("i64", { 1 }) } -- { 2^53 + 1, 1 }
    assert.are.equal(2, (big:sum() - T("i64", { 2 ^ 53 })):item())
    assert.are.equal(2, (big:view(1, 2):sum(2) - T("i64", { 2 ^ 53 })):item())
    assert_error_has(function() return T("bool") + T("bool") end, "op add has no kernel for bool on cpu")
    assert_error_has(function() return T("i64") / T("i64") end, "op div has no kernel for i64 on cpu")
  end)

  it("a number with an integer or f64 tensor keeps its value", function()
    local i = fsdp.tensor({ 3, 4 }, { dtype = "i64" })
    assert.are.equal("i64", (i + 1):dtype())
    assert.are.same({ 4, 5 }, (i + 1):totable())
    assert.are.same({ -1, -2 }, (2 - i):totable())
    assert.are.equal("i64", (2 * i):dtype())
    -- a fraction makes the result f32 instead of being truncated away
    assert.are.equal("f32", (i * 2.5):dtype())
    assert.are.same({ 7.5, 10 }, (i * 2.5):totable())
    assert.are.same({ 3.5, 4.5 }, (0.5 + i):totable())
    -- dividing integers needs a float tensor, as with two tensors
    assert_error_has(function() return i / 2 end, "op div has no kernel for i64 on cpu")
    assert_error_has(function() return 2 / i end, "i64 on cpu")
    -- f64 arithmetic with numbers happens in f64
    local d = fsdp.tensor({ 1 }, { dtype = "f64" })
    assert.are.equal(1.1, (d + 0.1):item())
    assert.are.equal(1 - 0.1, (d - 0.1):item())
    assert.are.equal(0.1, (d * 0.1):item())
    assert.are.equal(1 / 3, (d / 3):item())
    assert.are.equal(1 / 3, (1 / (d * 3)):item())
    assert.are.equal(0.9, (1 - d * 0.1):item())
    local b = fsdp.tensor({ 1, 0 }, { dtype = "bool" })
    assert_error_has(function() return b + 1 end, "op add has no kernel for bool on cpu")
    -- a number the integer dtype cannot hold is not saturated into it: the op promotes
    local u = fsdp.tensor({ 0, 200 }, { dtype = "u8" })
    assert.are.same({ 1, 1 }, u:gt(-1):totable())
    assert.are.same({ 0, 0 }, u:eq(255 + 1):totable())
    assert.are.same({ -1, 199 }, (u + -1):totable())
    assert.are.equal("i64", (u + -1):dtype())
    assert.are.same({ 1, 201 }, (u + 1):totable())
    assert.are.same({ 100, 255 }, (u + 100):totable()) -- u8 results saturate
    assert.are.equal("u8", (u + 1):dtype())
    assert.are.same({ -1, 200 }, fsdp.where(u:gt(0), u, -1):totable())
    assert.are.same({ 0 }, fsdp.tensor({ 2 ^ 31 - 1 }, { dtype = "i32" }):eq(2 ^ 40):totable())
    assert.are.same({ 0, 0 }, b:eq(2):totable())
  end)

  it("ops refuse dtypes their kernels lack, naming op, dtype and device", function()
    local d = fsdp.ones({ 2, 2 }, { dtype = "f64" })
    assert_error_has(function() return d:matmul(d) end, "op matmul has no kernel for f64 on cpu")
    assert_error_has(function() return d:softmax() end, "op softmax has no kernel for f64 on cpu")
    local i = fsdp.ones({ 2 }, { dtype = "i64" })
    assert_error_has(function() return i:gelu() end, "op gelu has no kernel for i64 on cpu")
    assert_error_has(function() return i:mean() end, "op mean has no kernel for i64 on cpu")
    assert_error_has(function() return fsdp.ones({ 2 }, { dtype = "bool" }):sum() end,
      "op sum has no kernel for bool on cpu")
    assert.are.equal("i64", fsdp.ones({ 3 }, { dtype = "u8" }):sum():dtype()) -- integers sum to i64
    assert.are.equal(3, fsdp.ones({ 3 }, { dtype = "u8" }):sum():item())
    local u = fsdp.tensor({ { 200, 100 }, { 1, 2 } }, { dtype = "u8" }) -- along a dim too
    assert.are.equal("i64", u:sum(2):dtype())
    assert.are.same({ 300, 3 }, u:sum(2):totable())
    assert.are.same({ 201, 102 }, u:sum(1):totable())
    assert.are.equal("i64", fsdp.ones({ 2, 2 }, { dtype = "i32" }):sum(-1):dtype())
    assert.are.equal("i64", fsdp.ones({ 2, 2 }, { dtype = "i64" }):sum(1):dtype())
    assert_error_has(function() return u:mean(1) end, "mean: needs a float tensor, got u8")
    assert_error_has(function() return d:matmul(fsdp.ones(2, 2)) end,
      "matmul: dtypes f64 and f32 differ (convert one with t:to(\"f64\"))")
  end)

  it("bf16 and f16 compute through f32 and round once", function()
    local x = fsdp.tensor({ 1, 2, 3 }, { dtype = "bf16" })
    local s = x:softmax()
    assert.are.equal("bf16", s:dtype())
    local want = fsdp.tensor { 1, 2, 3 }:softmax():to("bf16")
    assert.are.same(want:totable(), s:totable())
    assert.are.same({ 1.5, 2.25, 3 }, (x + fsdp.tensor({ 0.5, 0.25, 0 }, { dtype = "bf16" })):totable())
    assert.are.same({ 1, 2, 3 }, (x + fsdp.tensor({ 2 ^ -9, 0, 0 }, { dtype = "bf16" })):totable()) -- rounded
    assert.are.same({ 1 + 2 ^ -9, 2, 3 }, (x:to("f32") + fsdp.tensor { 2 ^ -9, 0, 0 }):totable())
    local m = x:view(1, 3):matmul(x:view(3, 1))
    assert.are.equal(14, m:item())
    assert.are.equal("bf16", m:dtype())
  end)
end)

-- ---- the selection and shaping ops ------------------------------------------------------------

describe("new ops", function()
  it("are methods and fsdp.<name> functions alike", function()
    for _, name in ipairs { "abs", "sign", "where", "cat", "stack", "topk", "sort", "clamp",
      "argmax", "gt", "ge", "lt", "le", "eq", "ne", "max", "min" } do
      assert.are.equal("function", type(fsdp[name]), "fsdp." .. name)
      assert.are.equal("function", type(fsdp.Tensor[name]), "Tensor." .. name)
    end
    local t = fsdp.tensor { -1, 2 }
    assert.are.same(t:abs():totable(), fsdp.abs(t):totable())
    assert.are.same({ 2, -1 }, H.flat(fsdp.topk(t, 2)))
    assert.are.equal(2, fsdp.max(t))
  end)

  it("abs and sign", function()
    assert.are.same({ 2, 0, 3 }, fsdp.tensor({ -2, 0, 3 }):abs():totable())
    assert.are.same({ -1, 0, 1 }, fsdp.tensor({ -2, 0, 3 }):sign():totable())
    local n = fsdp.tensor({ 0 / 0 })
    assert.is_true(is_nan(n:abs():item()))
    assert.is_true(is_nan(n:sign():item()))
    local i = fsdp.tensor({ -2 ^ 40, 5 }, { dtype = "i64" })
    assert.are.same({ 2 ^ 40, 5 }, i:abs():totable())
    assert.are.same({ -1, 1 }, i:sign():totable())
    assert.are.equal("i64", i:sign():dtype())
    -- gradients: sign(x) for abs (0 at 0), zero for sign
    local x = fsdp.tensor { -2, 0, 3 }
    x.requires_grad = true
    local loss = (x:abs() + x:sign()):sum()
    loss:backward()
    assert.are.same({ -1, 0, 1 }, x.grad:totable())
  end)

  it("comparisons give bool, with a tensor or a number on either side", function()
    local a = fsdp.tensor { 1, 2, 3 }
    local r = a:gt(2)
    assert.are.equal("bool", r:dtype())
    assert.are.same({ 0, 0, 1 }, r:totable())
    assert.are.same({ 0, 1, 1 }, a:ge(2):totable())
    assert.are.same({ 1, 0, 0 }, a:lt(2):totable())
    assert.are.same({ 1, 1, 0 }, a:le(2):totable())
    assert.are.same({ 0, 1, 0 }, a:eq(2):totable())
    assert.are.same({ 1, 0, 1 }, a:ne(2):totable())
    assert.are.same({ 1, 0, 0 }, fsdp.gt(2, a):totable()) -- 2 > a
    assert.are.same({ 0, 0, 1 }, fsdp.lt(2, a):totable()) -- 2 < a
    assert.are.same({ 0, 1, 1 }, a:ge(fsdp.tensor { 3, 2, 1 }):totable())
    -- broadcasting by suffix, either way round
    local m = fsdp.tensor { { 1, 5 }, { 4, 2 } }
    assert.are.same({ { 0, 1 }, { 1, 0 } }, m:gt(fsdp.tensor { 3, 3 }):totable())
    assert.are.same({ { 1, 0 }, { 0, 1 } }, fsdp.tensor({ 3, 3 }):gt(m):totable())
    assert_error_has(function() return a:gt(fsdp.tensor { 1, 2 }) end,
      "gt: shapes (3) and (2) do not broadcast (one shape must end with the other)")
    -- NaN compares false except with ne
    local n = fsdp.tensor { 0 / 0 }
    assert.are.same({ 0 }, n:eq(n):totable())
    assert.are.same({ 1 }, n:ne(n):totable())
    assert.are.same({ 0 }, n:lt(1):totable())
    assert.are.same({ 0 }, n:ge(1):totable())
    -- operands promote: bf16 1 + 2^-8 is 1, compared with an f32 1 + 2^-8 in f32
    local h = fsdp.tensor({ 1 + 2 ^ -8 }, { dtype = "bf16" })
    assert.are.same({ 0 }, h:eq(fsdp.tensor { 1 + 2 ^ -8 }):totable())
    assert.are.same({ 1 }, h:eq(1):totable())
    -- i64 against an integer number stays exact beyond 2^31
    assert.are.same({ 1 }, fsdp.tensor({ 2 ^ 40 }, { dtype = "i64" }):eq(2 ^ 40):totable())
    assert.are.same({ 1 }, fsdp.tensor({ 3 }, { dtype = "i64" }):gt(2.5):totable())
    assert_error_has(function() return fsdp.gt(1, 2) end, "bad argument #2 to 'gt' (tensor expected, got number)")
  end)

  it("where takes tensors or numbers and broadcasts them by suffix", function()
    local c = fsdp.tensor({ 1, 0, 1 }, { dtype = "bool" })
    assert.are.same({ 5, -5, 5 }, fsdp.where(c, 5, -5):totable())
    assert.are.equal("f32", fsdp.where(c, 5, -5):dtype())
    local a = fsdp.tensor { 1, 2, 3 }
    assert.are.same({ 1, 0, 3 }, fsdp.where(c, a, 0):totable())
    assert.are.same({ 0, 2, 0 }, fsdp.where(c, 0, a):totable())
    assert.are.same({ 0, 2, 0 }, c:where(0, a):totable())
    -- any condition dtype: nonzero (NaN included) is true
    assert.are.same({ 1, 9, 1 }, fsdp.where(fsdp.tensor { 0.5, 0, 0 / 0 }, 1, 9):totable())
    -- a condition row over a matrix, a scalar tensor, a row operand
    local cm = fsdp.tensor({ { 1, 0 }, { 0, 1 } }, { dtype = "bool" })
    assert.are.same({ { 1, 0 }, { 0, 2 } }, fsdp.where(cm, fsdp.tensor { 1, 2 }, 0):totable())
    assert.are.same({ { 1, 6 }, { 3, 6 } },
      fsdp.where(fsdp.tensor { 1, 0 }, fsdp.tensor { { 1, 2 }, { 3, 4 } }, fsdp.tensor { 5, 6 }):totable())
    -- operands promote; an integer tensor with a fraction gives f32
    assert.are.same({ 1, 0.5, 3 },
      fsdp.where(c, fsdp.tensor({ 1, 2, 3 }, { dtype = "i64" }), 0.5):totable())
    assert.are.equal("i64", fsdp.where(c, fsdp.tensor({ 1, 2, 3 }, { dtype = "i64" }), 0):dtype())
    assert.are.equal("f64", fsdp.where(c, a, fsdp.zeros({ 3 }, { dtype = "f64" })):dtype())
    assert_error_has(function() return fsdp.where(c, fsdp.tensor { 1, 2 }, 0) end,
      "where: shape (2) does not broadcast to (3) (it must end the other)")
    assert_error_has(function() return fsdp.where(c, a) end, "bad argument #3 to 'where' (tensor expected, got no value)")
    -- gradients flow into both branches, summed over a broadcast operand
    local x, y = fsdp.tensor { { 1, 2 }, { 3, 4 } }, fsdp.tensor { 10, 20 }
    x.requires_grad, y.requires_grad = true, true
    fsdp.where(cm, x, y):sum():backward()
    assert.are.same({ { 1, 0 }, { 0, 1 } }, x.grad:totable())
    assert.are.same({ 1, 1 }, y.grad:totable())
  end)

  it("clamp takes a min, a max or both; NaN stays NaN", function()
    local t = fsdp.tensor { -2, 0.5, 3, 0 / 0 }
    local v = H.flat(fsdp.clamp(t, -1, 1))
    assert.are.same({ -1, 0.5, 1 }, { v[1], v[2], v[3] })
    assert.is_true(is_nan(v[4]))
    local lo = H.flat(t:clamp(0))
    assert.are.same({ 0, 0.5, 3 }, { lo[1], lo[2], lo[3] })
    local hi = H.flat(t:clamp(nil, 1))
    assert.are.same({ -2, 0.5, 1 }, { hi[1], hi[2], hi[3] })
    assert.are.same({ 0, 3, 4 }, fsdp.tensor({ -5, 3, 9 }, { dtype = "i64" }):clamp(0, 4):totable())
    assert.are.same({ 2, 2 }, fsdp.tensor({ 1, 3 }):clamp(2, 2):totable())
    assert_error_has(function() return t:clamp(1, -1) end, "clamp: min 1 is above max -1")
    assert_error_has(function() return t:clamp() end, "clamp: give a min, a max or both")
    assert_error_has(function() return fsdp.tensor({ 1 }, { dtype = "bool" }):clamp(0, 1) end,
      "op clamp has no kernel for bool on cpu")
    -- the gradient passes where min <= x <= max
    local x = fsdp.tensor { -2, -1, 0.5, 1, 3 }
    x.requires_grad = true
    x:clamp(-1, 1):sum():backward()
    assert.are.same({ 0, 1, 1, 1, 0 }, x.grad:totable())
  end)

  it("cat joins along a 1-based dim (default 1, negative from the end)", function()
    local a, b = fsdp.tensor { { 1, 2 } }, fsdp.tensor { { 3, 4 }, { 5, 6 } }
    assert.are.same({ { 1, 2 }, { 3, 4 }, { 5, 6 } }, fsdp.cat({ a, b }):totable())
    assert.are.same({ { 1, 2 }, { 3, 4 }, { 5, 6 } }, fsdp.cat({ a, b }, 1):totable())
    assert.are.same({ { 1, 2, 3 } }, fsdp.cat({ a, fsdp.tensor { { 3 } } }, 2):totable())
    assert.are.same({ { 1, 2, 3 } }, fsdp.cat({ a, fsdp.tensor { { 3 } } }, -1):totable())
    assert.are.same({ 1, 2, 3 }, fsdp.cat({ fsdp.tensor { 1, 2 }, fsdp.tensor { 3 } }):totable())
    assert.are.same({ 7 }, fsdp.cat({ fsdp.tensor { 7 } }):totable())
    -- a strided input, any dtype
    assert.are.same({ { 1, 2, 3, 5 }, { 9, 9, 4, 6 } },
      fsdp.cat({ fsdp.tensor { { 1, 2 }, { 9, 9 } }, b:transpose(1, 2) }, 2):totable())
    local i = fsdp.cat({ fsdp.tensor({ 2 ^ 40 }, { dtype = "i64" }), fsdp.tensor({ 1 }, { dtype = "i64" }) })
    assert.are.equal("i64", i:dtype())
    assert.are.same({ 2 ^ 40, 1 }, i:totable())
    assert_error_has(function() return fsdp.cat({ a, fsdp.tensor { { 1, 2, 3 } } }) end,
      "cat: tensor 2 has shape (1, 3), tensor 1 (1, 2): they must agree except in dimension 1")
    assert_error_has(function() return fsdp.cat({ a, a:to("bf16") }) end,
      "cat: tensor 2 is bf16, tensor 1 f32 (convert with t:to())")
    assert_error_has(function() return fsdp.cat({ a, a }, 3) end, "cat: dimension 3 out of range")
    assert_error_has(function() return fsdp.cat({ fsdp.tensor(1) }) end, "cat: cannot concatenate scalars (use stack)")
    assert_error_has(function() return fsdp.cat({}) end, "cat: expected a non-empty array of tensors")
    assert_error_has(function() return fsdp.cat({ a, 3 }) end, "cat: entry 2 is a number, expected a tensor")
    -- gradients: each input gets its slice; an input used twice gets both
    local x = fsdp.tensor { { 1, 5 } }
    x.requires_grad = true
    local y = fsdp.cat({ x, fsdp.tensor { { 0 } }, x }, 2)
    assert.are.same({ 1, 5 }, y:shape())
    local loss = (y * fsdp.tensor { 1, 2, 3, 4, 5 }):sum()
    loss:backward()
    assert.are.same({ { 5, 7 } }, x.grad:totable())
  end)

  it("stack adds a 1-based dim (1..ndim+1, default 1, negative from the end)", function()
    local a, b = fsdp.tensor { 1, 2 }, fsdp.tensor { 3, 4 }
    assert.are.same({ { 1, 2 }, { 3, 4 } }, fsdp.stack({ a, b }):totable())
    assert.are.same({ { 1, 2 }, { 3, 4 } }, fsdp.stack({ a, b }, 1):totable())
    assert.are.same({ { 1, 3 }, { 2, 4 } }, fsdp.stack({ a, b }, 2):totable())
    assert.are.same({ { 1, 3 }, { 2, 4 } }, fsdp.stack({ a, b }, -1):totable())
    assert.are.same({ { 1, 2 }, { 3, 4 } }, fsdp.stack({ a, b }, -2):totable())
    assert.are.same({ 2 }, fsdp.stack({ fsdp.tensor(1), fsdp.tensor(2) }):shape())
    assert_error_has(function() return fsdp.stack({ a, fsdp.tensor { 1, 2, 3 } }) end,
      "stack: tensor 2 has shape (3), tensor 1 (2): stacked tensors share one shape")
    local ok, err = pcall(fsdp.stack, { a, fsdp.tensor { 1, 2, 3 } })
    assert.is_nil(err:find("stack: stack", 1, true))
    assert_error_has(function() return fsdp.stack({ a, b }, 3) end, "stack: dimension 3 out of range for tensors (2) (1..2)")
    assert_error_has(function() return fsdp.stack({ a, b:to("f64") }) end, "stack", "f64")
    local x = fsdp.tensor { 1, 2 }
    x.requires_grad = true
    local loss = (fsdp.stack({ x, x * 2 }, 2) * fsdp.tensor { 1, 10 }):sum()
    loss:backward()
    assert.are.same({ 21, 21 }, x.grad:totable())
  end)

  it("i64 beyond 2^53 compares, orders and sorts exactly", function()
    -- 2^53 + 1 is no double: read as one it would equal 2^53
    local lo = fsdp.tensor({ 2 ^ 53 }, { dtype = "i64" })
    local hi = lo + 1
    assert.are.equal(1, (hi - lo):item())
    assert.are.same({ 0 }, hi:eq(lo):totable())
    assert.are.same({ 1 }, hi:ne(lo):totable())
    assert.are.same({ 1 }, hi:gt(lo):totable())
    assert.are.same({ 0 }, hi:le(lo):totable())
    local t = fsdp.cat { lo, hi, lo }
    local _, i = t:max(1)
    assert.are.equal(1, i:item())
    _, i = t:min(1)
    assert.are.equal(0, i:item())
    assert.are.equal(1, t:argmax():item())
    local _, order = t:sort { descending = true }
    assert.are.same({ 1, 0, 2 }, order:totable())
    local _, top = t:topk(1)
    assert.are.same({ 1 }, top:totable())
  end)

  it("max and min along a dim give values and 0-based indices", function()
    local t = fsdp.tensor { { 3, 7, 7 }, { 9, 0, 2 } }
    local v, i = t:max(2)
    assert.are.same({ 7, 9 }, v:totable())
    assert.are.same({ 1, 0 }, i:totable()) -- ties: the first index
    assert.are.equal("i64", i:dtype())
    v, i = t:max(1)
    assert.are.same({ 9, 7, 7 }, v:totable())
    assert.are.same({ 1, 0, 0 }, i:totable())
    v, i = t:min(-1)
    assert.are.same({ 3, 0 }, v:totable())
    assert.are.same({ 0, 1 }, i:totable())
    v, i = t:min(1, true) -- keepdim
    assert.are.same({ { 3, 0, 2 } }, v:totable())
    assert.are.same({ { 0, 1, 1 } }, i:totable())
    v, i = fsdp.max(t, -2)
    assert.are.same({ 9, 7, 7 }, v:totable())
    assert.are.equal(9, t:max())
    assert.are.equal(0, t:min())
    assert.are.equal(0, fsdp.min(t))
    -- NaN wins, as a maximum and as a minimum
    local n = fsdp.tensor { { 1, 0 / 0, 5 } }
    v, i = n:max(2)
    assert.is_true(is_nan(v:item()))
    assert.are.same({ 1 }, i:totable())
    v, i = n:min(2)
    assert.is_true(is_nan(v:item()))
    assert.are.same({ 1 }, i:totable())
    assert.is_true(is_nan(n:max()))
    assert.is_true(is_nan(n:min()))
    -- integer values keep their dtype and exact value
    local big = fsdp.tensor({ 2 ^ 40, -3, 2 ^ 40 + 1 }, { dtype = "i64" })
    assert.are.equal(2 ^ 40 + 1, big:max())
    v, i = big:max(1)
    assert.are.equal("i64", v:dtype())
    assert.are.same({ 2 ^ 40 + 1 }, { v:item() })
    assert.are.same({ 2 }, { i:item() })
    assert_error_has(function() return t:max(3) end, "max: dimension 3 out of range for a tensor (2, 3) (dimensions start at 1)")
    assert_error_has(function() return t:min(0) end, "min: dimension 0 out of range")
    assert_error_has(function() return fsdp.zeros(2, 0):max(2) end, "max: dimension 2 of the tensor (2, 0) is empty")
    assert_error_has(function() return fsdp.zeros(0):min() end, "min: tensor is empty")
    -- the gradient goes to the chosen element
    local x = fsdp.tensor { { 1, 5, 3 }, { 7, 0, 2 } }
    x.requires_grad = true
    x:max(2):sum():backward()
    assert.are.same({ { 0, 1, 0 }, { 1, 0, 0 } }, x.grad:totable())
  end)

  it("argmax gives 0-based indices along the last dim or a given one", function()
    local t = fsdp.tensor { { 3, 7, 7 }, { 9, 0, 2 } }
    assert.are.same({ 1, 0 }, t:argmax():totable())
    assert.are.same({ 1, 0, 0 }, t:argmax(1):totable())
    assert.are.same({ 1, 0 }, fsdp.argmax(t, -1):totable())
    assert.are.equal("i64", t:argmax():dtype())
    assert.are.equal(1, fsdp.tensor({ 1, 0 / 0, 0 / 0, 2 }):argmax():item()) -- the first NaN
    assert_error_has(function() return fsdp.tensor(1):argmax() end, "argmax: needs at least one dimension")
    assert_error_has(function() return t:argmax(3) end, "argmax: dimension 3 out of range")
  end)

  it("topk: the k largest (or smallest), sorted, ties in index order, NaN largest", function()
    local t = fsdp.tensor { 1, 2, 2, 1, 2 }
    local v, i = t:topk(2)
    assert.are.same({ 2, 2 }, v:totable())
    assert.are.same({ 1, 2 }, i:totable()) -- 0-based, lower index first among ties
    v, i = fsdp.topk(t, 3, { largest = false })
    assert.are.same({ 1, 1, 2 }, v:totable())
    assert.are.same({ 0, 3, 1 }, i:totable())
    local m = fsdp.tensor { { 3, 1 }, { 2, 4 }, { 5, 0 } }
    v, i = m:topk(2, { dim = 1 })
    assert.are.same({ { 5, 4 }, { 3, 1 } }, v:totable())
    assert.are.same({ { 2, 1 }, { 0, 0 } }, i:totable())
    v, i = m:topk(1, { dim = -1 })
    assert.are.same({ { 3 }, { 4 }, { 5 } }, v:totable())
    assert.are.same({ { 0 }, { 1 }, { 0 } }, i:totable())
    v, i = fsdp.tensor({ 1, 0 / 0, 3 }):topk(2)
    assert.is_true(is_nan(v:get(1)))
    assert.are.same({ 1, 2 }, i:totable())
    v, i = fsdp.tensor({ 1, 0 / 0, 3 }):topk(2, { largest = false })
    assert.are.same({ 1, 3 }, v:totable())
    assert.are.same({ 0, 2 }, i:totable())
    v, i = t:topk(0)
    assert.are.same({ 0 }, v:shape())
    assert.are.same({ 0 }, i:shape())
    assert_error_has(function() return t:topk(6) end, "topk: k = 6 is not in [0, 5] (dimension 1 of a tensor (5))")
    assert_error_has(function() return t:topk(-1) end, "topk: k = -1 is not in [0, 5]")
    assert_error_has(function() return t:topk(1.5) end, "topk: k must be an integer, got 1.5")
    assert_error_has(function() return t:topk(math.huge) end, "topk: k must be an integer, got inf")
    assert_error_has(function() return t:topk(1, { dims = 1 }) end, "topk: unknown option 'dims' (valid: dim, largest)")
    assert_error_has(function() return t:topk(1, { dim = 2 }) end, "topk: dimension 2 out of range")
    assert_error_has(function() return t:topk(1, 1) end, "topk: expected an options table, got a number")
    assert_error_has(function() return fsdp.tensor(3):topk(1) end, "topk: needs at least one dimension")
    -- the gradient goes to the chosen elements
    local x = fsdp.tensor { 1, 5, 3, 4 }
    x.requires_grad = true
    local top = x:topk(2)
    local loss = (top * fsdp.tensor { 10, 1 }):sum()
    loss:backward()
    assert.are.same({ 0, 10, 0, 1 }, x.grad:totable())
  end)

  it("sort is stable, ascending unless descending, NaN last (first when descending)", function()
    local v, i = fsdp.tensor({ 1, 2, 2, 1, 2 }):sort()
    assert.are.same({ 1, 1, 2, 2, 2 }, v:totable())
    assert.are.same({ 0, 3, 1, 2, 4 }, i:totable())
    v, i = fsdp.sort(fsdp.tensor { 1, 2, 2, 1, 2 }, { descending = true })
    assert.are.same({ 2, 2, 2, 1, 1 }, v:totable())
    assert.are.same({ 1, 2, 4, 0, 3 }, i:totable())
    v, i = fsdp.tensor({ 3, 0 / 0, 1, 2 }):sort()
    local vv = H.flat(v)
    assert.are.same({ 1, 2, 3 }, { vv[1], vv[2], vv[3] })
    assert.is_true(is_nan(vv[4]))
    assert.are.same({ 2, 3, 0, 1 }, i:totable())
    v, i = fsdp.tensor({ 3, 0 / 0, 1, 2 }):sort { descending = true }
    assert.is_true(is_nan(v:get(1)))
    assert.are.same({ 1, 0, 3, 2 }, i:totable())
    v, i = fsdp.tensor({ { 3, 1 }, { 2, 4 } }):sort { dim = 1 }
    assert.are.same({ { 2, 1 }, { 3, 4 } }, v:totable())
    assert.are.same({ { 1, 0 }, { 0, 1 } }, i:totable())
    v, i = fsdp.tensor({ { 3, 1 }, { 2, 4 } }):sort { dim = -2, descending = true }
    assert.are.same({ { 3, 4 }, { 2, 1 } }, v:totable())
    v, i = fsdp.tensor({ 5, 2 ^ 40, -1, 2 ^ 31 }, { dtype = "i64" }):sort { descending = true }
    assert.are.same({ 2 ^ 40, 2 ^ 31, 5, -1 }, v:totable())
    assert.are.same({ 1, 3, 0, 2 }, i:totable())
    v = fsdp.tensor({ 0.5, -1, 2 }, { dtype = "bf16" }):sort()
    assert.are.equal("bf16", v:dtype())
    assert.are.same({ -1, 0.5, 2 }, v:totable())
    assert_error_has(function() return fsdp.tensor(1):sort() end, "sort: needs at least one dimension")
    assert_error_has(function() return fsdp.tensor({ 1 }):sort { reverse = true } end,
      "sort: unknown option 'reverse' (valid: dim, descending)")
  end)

  it("softmax along a 1-based dim (default the last; negative from the end), also as F.softmax", function()
    local x = fsdp.tensor { { 0, 0 }, { 0, math.log(3) } }
    local assert_close = H.make_assert_close(1e-6, "%.7g")
    assert_close(x:softmax(1), { { 0.5, 0.25 }, { 0.5, 0.75 } })
    assert_close(x:softmax(-2), { { 0.5, 0.25 }, { 0.5, 0.75 } })
    assert_close(fsdp.F.softmax(x, 1), { { 0.5, 0.25 }, { 0.5, 0.75 } })
    assert_close(x:softmax(), { { 0.5, 0.5 }, { 0.25, 0.75 } })
    assert_close(x:softmax(2), { { 0.5, 0.5 }, { 0.25, 0.75 } })
    assert_close(fsdp.F.softmax(x), { { 0.5, 0.5 }, { 0.25, 0.75 } })
    local t3 = fsdp.randn { 2, 3, 4 }
    local s = t3:softmax(2)
    assert.are.same({ 2, 3, 4 }, s:shape())
    assert_close(s:sum(2), fsdp.ones(2, 4))
    assert_error_has(function() return x:softmax(3) end, "softmax: dimension 3 out of range for a tensor (2, 2) (dimensions start at 1)")
    assert_error_has(function() return x:softmax(0) end, "softmax: dimension 0 out of range")
    assert_error_has(function() return fsdp.tensor(1):softmax() end, "softmax: needs at least one dimension, got a scalar")
  end)
end)
