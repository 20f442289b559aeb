-- inspect_spec.lua — lua/fsdp/inspect.lua at world size 1: fsdp.inspect of plain and wrapped
-- models, parameters (state, dtypes, flat offset, slices, ties, mask) and units, mixed
-- precision (the policy, unit dtypes, bytes of a bf16 full buffer); the readable
-- tostring of fsdp.memory() and fsdp.comm_stats() with their fields unchanged; the number
-- formatting. Several ranks: tests/recipes/repl_pipe.sh inspects through the REPL at -n 2.
-- Run: busted --lua=luajit tests/lua/inspect_spec.lua

local fsdp = require "fsdp"
local nn = fsdp.nn
local inspect = require "fsdp.inspect"

local function gpt(tie)
  fsdp.manual_seed(7)
  return nn.GPT{vocab = 11, ctx = 8, d = 8, layers = 2, heads = 2, tie = tie}
end

local function has(text, s) return text:find(s, 1, true) ~= nil end

describe("formatting", function()
  it("groups thousands and scales bytes", function()
    assert.are.equal("0", inspect.int(0))
    assert.are.equal("999", inspect.int(999))
    assert.are.equal("1,000", inspect.int(1000))
    assert.are.equal("1,234,567", inspect.int(1234567))
    assert.are.equal("-12,345", inspect.int(-12345))
    assert.are.equal("512 B", inspect.bytes(512))
    assert.are.equal("1.5 KiB", inspect.bytes(1536))
    assert.are.equal("2.0 MiB", inspect.bytes(2 * 1024 * 1024))
    assert.are.equal("300 GiB", inspect.bytes(300 * 1024 ^ 3))
  end)
end)

describe("fsdp.inspect(model)", function()
  it("lists the parameters of a plain model", function()
    local m = gpt(true)
    local r = fsdp.inspect(m)
    assert.are.equal("model", r.kind)
    assert.is_false(r.wrapped)
    assert.are.equal(#m:parameters(), r.nparams)
    assert.are.equal(m:num_parameters(), r.numel)
    assert.are.equal("wte.weight", r.params[1].path)
    local text = tostring(r)
    assert.is_true(has(text, "GPT: not wrapped"))
    assert.is_true(has(text, "blocks.2.mlp.fc.weight"))
    assert.is_true(has(text, "(32, 8)"))
  end)

  it("gives one row per unit of a wrapped model, with padding, state, slice and bytes", function()
    local m = gpt(true)
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local r = fsdp.inspect(m)
    assert.is_true(r.wrapped)
    assert.are.equal("full", r.strategy)
    assert.are.equal(3, #r.units)
    local units = fsdp.units(m)
    for i, u in ipairs(r.units) do
      assert.are.equal(units[i].path, u.path)
      assert.are.equal("sharded", u.state)
      assert.are.equal(u.padded_numel - u.numel, u.padding)
      assert.are.same({1, u.padded_numel}, u.slice) -- world 1: the whole buffer
      assert.are.equal(4 * u.shard_numel, u.bytes)
      assert.are.equal(#units[i]:params(), u.nparams)
    end
    local text = tostring(r)
    for _, col in ipairs {"unit", "params", "numel", "padding", "state", "this rank's slice",
                          "bytes here", "blocks.1", "blocks.2", "(root)", "total"} do
      assert.is_true(has(text, col), col)
    end
    assert.is_true(has(text, "rank 0 of 1"))
    -- a gathered unit holds its full buffer too
    units[1]:gather()
    local g = fsdp.inspect(m).units[1]
    assert.are.equal("gathered", g.state)
    assert.are.equal(4 * (g.shard_numel + g.padded_numel), g.bytes)
    units[1]:reshard()
    fsdp.unwrap(m)
    assert.is_false(fsdp.inspect(m).wrapped)
  end)
end)

describe("fsdp.inspect(param)", function()
  it("gives the state, flat offset, slices and ties of a sharded parameter", function()
    local m = gpt(true)
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local p = fsdp.inspect(m.head.weight, {model = m})
    assert.are.equal("param", p.kind)
    assert.are.equal("(root)", p.unit)
    assert.are.equal("wte.weight", p.path) -- a tied parameter: its first path
    assert.are.equal("sharded", p.state)
    assert.are.equal(0, p.offset)
    assert.are.same({1, m.wte.weight:numel()}, p.slices[0])
    assert.are.equal(m.wte.weight:numel(), p.local_numel)
    assert.are.same({"wte.weight", "head.weight"}, p.ties)
    assert.is_nil(p.mask)
    local text = tostring(p)
    for _, s in ipairs {"parameter wte.weight", "(11, 8)", "sharded (unit (root)",
                        "wte.weight, head.weight", "0: 1-88"} do
      assert.is_true(has(text, s), s)
    end
    assert.is_true(text:match("\n  mask%s+none") ~= nil, text)
    -- an untied parameter in a block: its offset inside the unit
    local q = fsdp.inspect(m.blocks[2].mlp.fc.weight)
    assert.are.equal("blocks.2", q.unit)
    assert.are.equal("blocks.2.mlp.fc.weight", q.path)
    local layout
    for _, l in ipairs(fsdp.units(m)[2]:layout()) do
      if l.path == q.path then layout = l end
    end
    assert.are.equal(layout.offset, q.offset)
    assert.is_nil(q.ties) -- unknown without the model
    assert.is_true(has(tostring(q), "fsdp.inspect(param, {model = m})"))
    fsdp.unwrap(m)
  end)

  it("says a plain parameter is not sharded", function()
    local m = gpt(false)
    local p = fsdp.inspect(m.head.weight, {model = m})
    assert.are.equal("full", p.state)
    assert.is_nil(p.unit)
    assert.are.same({"head.weight"}, p.ties)
    assert.is_true(has(tostring(p), "not sharded"))
  end)

  it("reports the mask sparsity", function()
    if not pcall(require, "fsdp.mask") then pending("lua/fsdp/mask.lua is not here") return end
    local m = gpt(false)
    local w = m.blocks[1].mlp.fc.weight
    local mask = fsdp.ones(w:shape())
    local half = w:numel() / 2
    local flat = mask:view{w:numel()}
    for i = 1, half do flat:set(i, 0) end
    fsdp.set_mask(w, mask)
    local p = fsdp.inspect(w)
    assert.are.equal(half, p.mask.zeros)
    assert.are.equal(w:numel(), p.mask.n)
    assert.are.equal(0.5, p.mask.sparsity)
    assert.is_true(has(tostring(p), "50.0% pruned on the whole parameter"))
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local s = fsdp.inspect(w)
    assert.are.equal(0.5, s.mask.sparsity) -- world 1: this rank's slice is the parameter
    assert.is_true(has(tostring(s), "this rank's slice"))
    fsdp.unwrap(m)
  end)
end)

describe("fsdp.inspect and mixed precision", function()
  it("shows the policy, each unit's dtypes, and counts a bf16 full buffer at 2 bytes", function()
    local m = gpt(true)
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}, mp = "bf16"})
    local r = fsdp.inspect(m)
    assert.are.same({param = "bf16", reduce = "f32", output = "f32"}, r.mp)
    for _, u in ipairs(r.units) do
      assert.are.equal("bf16", u.param_dtype)
      assert.are.equal("f32", u.reduce_dtype)
      assert.is_nil(u.gathered_dtype)
      assert.are.equal(4 * u.shard_numel, u.bytes) -- the f32 shard
    end
    local text = tostring(r)
    assert.is_true(has(text, "GPT: wrapped (full), 3 units"), text)
    assert.is_true(has(text, "mixed precision: param bf16, reduce f32, output f32; shards, "
      .. "gradient shards and optimizer state f32"), text)
    assert.is_true(has(text, "param/reduce"), text)
    assert.is_true(text:match("blocks%.1 .* bf16/f32") ~= nil, text)
    -- after a forward the root stays gathered for compute, in bf16
    local out = m(fsdp.tensor({{1, 2, 3, 4}}, {dtype = "i64"}))
    local root
    for _, u in ipairs(fsdp.inspect(m).units) do if u.path == "(root)" then root = u end end
    assert.are.equal("bf16", root.gathered_dtype)
    assert.are.equal(4 * root.shard_numel + 2 * root.padded_numel, root.bytes)
    assert.is_true(has(tostring(fsdp.inspect(m)), "gathered (bf16)"))
    local p = fsdp.inspect(m.head.weight, {model = m})
    assert.are.equal("bf16", p.dtype) -- its current dtype
    assert.are.equal("bf16", p.param_dtype)
    assert.are.equal("f32", p.reduce_dtype)
    local pt = tostring(p)
    assert.is_true(has(pt, "parameter wte.weight  (11, 8) bf16"), pt)
    assert.is_true(has(pt, "bf16 now; the unit gathers bf16 for compute and reduces gradients "
      .. "in f32; its shard (the master) is f32"), pt)
    local ut = tostring(fsdp.inspect(fsdp.units(m)[1]))
    assert.is_true(has(ut, "gathered (bf16)") and has(ut, "param bf16, reduce f32"), ut)
    out:sum():backward()
    local q = fsdp.inspect(m.blocks[1].mlp.fc.weight)
    assert.are.equal("f32", q.dtype) -- sharded: its f32 master
    assert.is_true(has(tostring(q), "f32 now; the unit gathers bf16"))
    fsdp.unwrap(m)
  end)

  it("shows per-unit dtypes of a model whose units differ, and none for f32", function()
    local m = gpt(true)
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local text = tostring(fsdp.inspect(m))
    assert.is_false(has(text, "mixed precision"))
    assert.is_false(has(text, "param/reduce"))
    assert.is_nil(fsdp.inspect(m).mp)
    assert.is_true(has(tostring(fsdp.inspect(m.wte.weight)), "f32 (no mixed precision)"))
    fsdp.unwrap(m)
    fsdp.wrap(m.blocks[1], {mp = {param = "f16", reduce = "bf16"}})
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    text = tostring(fsdp.inspect(m))
    assert.is_true(has(text, "mixed precision: per unit (below)"), text)
    assert.is_true(text:match("blocks%.1 .* f16/bf16") ~= nil, text)
    assert.is_true(text:match("blocks%.2 .* f32/f32") ~= nil, text)
    fsdp.unwrap(m)
  end)
end)

describe("fsdp.inspect(unit) and bad arguments", function()
  it("describes one unit", function()
    local m = gpt(true)
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local u = fsdp.units(m)[1]
    local r = fsdp.inspect(u)
    assert.are.equal("unit", r.kind)
    assert.are.equal(u.path, r.unit_row.path)
    assert.is_true(has(tostring(r), "unit " .. u.path))
    fsdp.unwrap(m)
  end)

  it("refuses other values", function()
    assert.has_error(function() fsdp.inspect(42) end,
      "fsdp.inspect: expected a module, a parameter or a unit (got number)")
    assert.has_error(function() fsdp.inspect(gpt(), 5) end, "fsdp.inspect: expects an options table {model} (got number)")
  end)
end)

describe("fsdp.memory() and fsdp.comm_stats()", function()
  it("print readably and keep their fields", function()
    local keep = fsdp.ones{256}
    local m = fsdp.memory()
    for _, k in ipairs {"live", "peak", "params", "grads", "optim", "gathered", "activations",
                        "other"} do
      assert.are.equal("number", type(m[k]), k)
    end
    assert.is_true(m.live >= 1024)
    assert.are.equal("table", type(m.devices))
    local text = tostring(m)
    assert.is_true(has(text, "memory (rank 0 of 1, cpu): live "))
    assert.is_true(has(text, "params "))
    assert.is_true(has(text, inspect.bytes(m.live)))
    keep:free()

    fsdp.reset_comm_stats()
    fsdp.barrier()
    fsdp.all_reduce(fsdp.ones{4})
    local s = fsdp.comm_stats()
    assert.are.equal(2, s.calls)
    assert.are.equal(1, s.barrier_calls)
    assert.are.equal(16, s.all_reduce_bytes)
    local st = tostring(s)
    assert.is_true(has(st, "comm (rank 0 of 1, local): 2 calls"))
    assert.is_true(st:match("all_reduce%s+1%s+16 B") ~= nil, st)
    assert.is_true(st:match("barrier%s+1%s+0 B") ~= nil, st)
  end)
end)
