-- lora_spec.lua — low-rank adapters (lua/fsdp/nn/lora.lua) at world size 1: nn.lora.apply
-- (targets, values, freezing, paths), training the adapters only, merge (logits of the merged
-- model equal the adapted model's), meta builds, checkpoints with adapters, wrapped models
-- with the adapters in units of their own, and the refusals. The recipe (recipes/gpt_lora.lua)
-- runs at 2 ranks in tests/recipes/recipe_gpt_lora.sh.
-- Run: busted --lua=luajit tests/lua/lora_spec.lua

local fsdp = require "fsdp"
local nn = fsdp.nn
require "fsdp.meta"
local H = require "helpers"
teardown(H.remove_temps)

local ids = fsdp.tensor({{1, 2, 3, 4}, {5, 6, 7, 8}}, {dtype = "i64"})
local targets = fsdp.tensor({{2, 3, 4, 5}, {6, 7, 8, 9}}, {dtype = "i64"})

local function gpt()
  fsdp.manual_seed(9)
  return nn.GPT{vocab = 11, ctx = 8, d = 8, layers = 2, heads = 2}
end

local function assert_error_has(fn, ...)
  local ok, err = pcall(fn)
  assert.is_false(ok)
  for _, s in ipairs{...} do
    assert.truthy(tostring(err):find(s, 1, true), ("%q not in %q"):format(s, tostring(err)))
  end
end

local function values(m)
  local out = {}
  for path, p in m:named_parameters() do out[path] = p:clone():view{p:numel()}:totable() end
  return out
end

local function train(m, steps)
  local opt = fsdp.optim.AdamW(m, {lr = 2e-2})
  for _ = 1, steps do
    opt:zero_grad()
    nn.F.cross_entropy(m(ids), targets):backward()
    opt:step()
  end
  return opt
end

local function max_diff(a, b) return (a - b):abs():max() end

describe("nn.lora.apply", function()
  it("adapts the attention projections by default, freezing everything else", function()
    local m = gpt()
    local base = fsdp.no_grad(function() return m(ids) end)
    local paths = nn.lora.apply(m, {rank = 2, alpha = 4})
    assert.are.same({"blocks.1.attn.qkv", "blocks.1.attn.proj", "blocks.2.attn.qkv",
      "blocks.2.attn.proj"}, paths)
    local q = m.blocks[1].attn.qkv
    assert.is_true(nn.isinstance(q, nn.LoRALinear) and nn.isinstance(q, nn.Linear))
    assert.are.same({2, 8}, q.lora.A:shape())
    assert.are.same({24, 2}, q.lora.B:shape())
    assert.are.equal(2, q.lora.scale)
    for _, v in ipairs(q.lora.B:view{48}:totable()) do assert.are.equal(0, v) end
    local trainable = {}
    for path, p in m:named_parameters() do
      if p.requires_grad then trainable[#trainable + 1] = path end
    end
    assert.are.same({"blocks.1.attn.qkv.lora.A", "blocks.1.attn.qkv.lora.B",
      "blocks.1.attn.proj.lora.A", "blocks.1.attn.proj.lora.B", "blocks.2.attn.qkv.lora.A",
      "blocks.2.attn.qkv.lora.B", "blocks.2.attn.proj.lora.A", "blocks.2.attn.proj.lora.B"},
      trainable)
    -- B = 0: the adapted model computes what the base did
    local adapted = fsdp.no_grad(function() return m(ids) end)
    assert.are.equal(0, max_diff(base, adapted))
    -- each adapter has values of its own (A differs between adapters)
    assert.are_not.same(q.lora.A:totable(), m.blocks[2].attn.qkv.lora.A:totable())
  end)

  it("takes other targets, and freeze = false", function()
    local m = gpt()
    assert.are.same({"blocks.1.mlp.fc", "blocks.2.mlp.fc"},
      nn.lora.apply(m, {targets = "%.mlp%.fc$", freeze = false}))
    assert.is_true(m.wte.weight.requires_grad)
    assert.are.equal(8, m.blocks[1].mlp.fc.lora.rank)
  end)

  it("a second apply (other targets, another rank) leaves the first one's adapters trainable",
    function()
    local m = gpt()
    nn.lora.apply(m, {targets = "%.attn%.qkv$", rank = 4})
    nn.lora.apply(m, {targets = "%.mlp%.fc$", rank = 2})
    local trainable = {}
    for path, p in m:named_parameters() do
      if p.requires_grad then trainable[#trainable + 1] = path end
    end
    assert.are.same({"blocks.1.attn.qkv.lora.A", "blocks.1.attn.qkv.lora.B",
      "blocks.1.mlp.fc.lora.A", "blocks.1.mlp.fc.lora.B", "blocks.2.attn.qkv.lora.A",
      "blocks.2.attn.qkv.lora.B", "blocks.2.mlp.fc.lora.A", "blocks.2.mlp.fc.lora.B"}, trainable)
  end)

  it("trains the adapters only; the base keeps its bits", function()
    local m = gpt()
    nn.lora.apply(m, {rank = 2})
    local before = values(m)
    train(m, 4)
    local after = values(m)
    for path, v in pairs(before) do
      if path:find("%.lora%.") then
        assert.are_not.same(v, after[path], path)
      else
        assert.are.same(v, after[path], path)
      end
    end
  end)

  it("refuses bad targets and options, naming them", function()
    local m = gpt()
    assert_error_has(function() nn.lora.apply(m, {targets = "nothing"}) end,
      "nn.lora.apply: the pattern \"nothing\" matches no module; the Linear layers are: "
      .. "blocks.1.attn.qkv, blocks.1.attn.proj")
    assert_error_has(function() nn.lora.apply(m, {targets = "%.attn$"}) end,
      "the pattern \"%.attn$\" matches blocks.1.attn, a CausalSelfAttention (adapters go on "
      .. "Linear layers)")
    assert_error_has(function() nn.lora.apply(m, {rnak = 2}) end,
      "nn.lora.apply: unknown option 'rnak' (valid: alpha, freeze, rank, targets)")
    assert_error_has(function() nn.lora.apply(m, {rank = 0}) end, "rank must be an integer >= 1")
    assert_error_has(function() nn.lora.apply(m, {alpha = -1}) end, "alpha must be a finite number > 0")
    assert_error_has(function() nn.lora.apply(m, {freeze = "no"}) end, "nn.lora.apply: freeze must be a boolean (got no)")
    assert_error_has(function() nn.lora.apply(m, {targets = "["}) end, "bad pattern \"[\"")
    assert_error_has(function() nn.lora.apply(42) end, "expected a module (got number)")
    assert.is_true(m.wte.weight.requires_grad) -- nothing changed by the refusals
    nn.lora.apply(m, {targets = "%.attn%.qkv$"})
    assert_error_has(function() nn.lora.apply(m, {targets = "%.attn%.qkv$"}) end,
      "blocks.1.attn.qkv already has an adapter (merge it first)")
    assert_error_has(function() nn.LoRA(8, 0) end, "nn.LoRA: out_features must be an integer >= 1")
  end)

  it("refuses a tied weight and a Linear subclass, and adapts in the weight's dtype", function()
    local m = gpt() -- tied: head.weight is wte.weight
    assert_error_has(function() nn.lora.apply(m, {targets = "^head$"}) end,
      "nn.lora.apply: head.weight is tied to another module's parameter")
    assert.is_true(rawequal(m.head.weight, m.wte.weight) and nn.class_of(m.head) == nn.Linear)
    local Scaled = nn.Linear:extend("Scaled")
    function Scaled:forward(x) return nn.Linear.forward(self, x) * 2 end
    local s = nn.Sequential{Scaled(4, 4)}
    assert_error_has(function() nn.lora.apply(s, {targets = "^1$"}) end,
      "nn.lora.apply: 1 is a Scaled: adapters go on nn.Linear itself")
    local h = gpt():to("bf16")
    nn.lora.apply(h)
    assert.are.equal("bf16", h.blocks[1].attn.qkv.lora.A:dtype())
    assert.are.equal("bf16", h(ids):dtype())
  end)
end)

describe("nn.lora.merge", function()
  it("folds the adapters into the weights: the same logits, the base's parameters", function()
    local m = gpt()
    local names = {}
    for path in m:named_parameters() do names[#names + 1] = path end
    nn.lora.apply(m, {rank = 2, alpha = 8})
    train(m, 4)
    local adapted = fsdp.no_grad(function() return m(ids) end)
    assert.are.equal(m, nn.lora.merge(m))
    local merged = fsdp.no_grad(function() return m(ids) end)
    assert.is_true(max_diff(adapted, merged) < 1e-5)
    local after = {}
    for path in m:named_parameters() do after[#after + 1] = path end
    assert.are.same(names, after)
    assert.are.equal(nn.Linear, nn.class_of(m.blocks[1].attn.qkv))
    assert.is_false(m.blocks[1].attn.qkv.weight.requires_grad) -- still frozen
    nn.lora.merge(m) -- nothing left to merge: no-op
  end)

  it("merges a bf16 model in f32, rounding once", function()
    local m = gpt():to("bf16")
    nn.lora.apply(m, {rank = 4, alpha = 8})
    local q = m.blocks[1].attn.qkv
    fsdp.manual_seed(3)
    fsdp.no_grad(function()
      q.lora.A:copy(fsdp.randn{4, 8})
      q.lora.B:copy(fsdp.randn{24, 4} * 4)
    end)
    local w32, b32, a32 = q.weight:to("f32"), q.lora.B:to("f32"), q.lora.A:to("f32")
    local want = (w32 + b32:matmul(a32) * 2):to("bf16")
    nn.lora.merge(m)
    assert.are.equal("bf16", q.weight:dtype())
    -- B A rounded to bf16 and then added (two roundings) gives other bits here
    assert.are.same(want:to("f32"):view{192}:totable(), q.weight:to("f32"):view{192}:totable())
  end)

  it("refuses a wrapped model and meta values", function()
    local m = gpt()
    nn.lora.apply(m, {rank = 2})
    fsdp.wrap(m)
    assert_error_has(function() nn.lora.merge(m) end,
      "nn.lora.merge: the model is wrapped; fsdp.unwrap it first")
    assert_error_has(function() nn.lora.apply(m) end,
      "nn.lora.apply: the model is wrapped; add the adapters before fsdp.wrap")
    local mm = fsdp.meta(function()
      local g = nn.GPT{vocab = 11, ctx = 8, d = 8, layers = 1, heads = 2}
      nn.lora.apply(g, {rank = 2})
      return g
    end)
    assert_error_has(function() nn.lora.merge(mm) end,
      "nn.lora.merge: blocks.1.attn.qkv has no values (a meta parameter): materialize")
  end)
end)

describe("LoRA with meta, checkpoints and wrapping", function()
  local function build(on_meta)
    fsdp.manual_seed(9)
    local fn = function()
      local g = nn.GPT{vocab = 11, ctx = 8, d = 8, layers = 2, heads = 2}
      nn.lora.apply(g, {rank = 2})
      return g
    end
    return on_meta and fsdp.meta(fn) or fn()
  end

  it("a meta build materializes the adapters as an eager build has them", function()
    local eager = build(false)
    local m = build(true)
    assert.are.equal("meta", m.blocks[1].attn.qkv.lora.A.device)
    fsdp.materialize(m)
    assert.are.same(values(eager), values(m))
    assert.is_false(m.wte.weight.requires_grad)
  end)

  it("a checkpoint holds the adapters; a wrapped meta model loads the base and materializes "
    .. "the adapters", function()
    local dir = H.mktemp_dir()
    local path = dir .. "/m.safetensors"
    local base = gpt()
    train(base, 2)
    fsdp.save(base, path)
    local want = values(base)
    -- wrapped on meta, adapters in units of their own; the base from the file
    local m = build(true)
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block, nn.LoRA}})
    fsdp.load(m, path, {strict = false})
    fsdp.materialize(m)
    local units = {}
    for _, u in ipairs(fsdp.units(m)) do units[#units + 1] = u.path end
    assert.are.same({"blocks.1.attn.qkv.lora", "blocks.1.attn.proj.lora", "blocks.1",
      "blocks.2.attn.qkv.lora", "blocks.2.attn.proj.lora", "blocks.2", "(root)"}, units)
    for _, u in ipairs(fsdp.units(m)) do
      assert.are.equal(u.path:find("lora$") ~= nil, u:trainable(), u.path)
    end
    train(m, 3)
    fsdp.save(m, path) -- adapters saved with the rest
    local r = fsdp.core.st_open(path)
    local names = {}
    for _, e in ipairs(r:entries()) do names[e.name] = true end
    r:close()
    assert.is_true(names["blocks.1.attn.qkv.lora.A"] and names["blocks.2.attn.proj.lora.B"])
    fsdp.unwrap(m)
    for p, v in pairs(want) do assert.are.same(v, values(m)[p], p) end -- base bits kept
    local adapted = fsdp.no_grad(function() return m(ids) end)
    nn.lora.merge(m)
    assert.is_true(max_diff(adapted, fsdp.no_grad(function() return m(ids) end)) < 1e-5)
    H.rmtree(dir)
  end)
end)
