-- wrap_spec.lua — the sharding layer at world size 1 (lua/fsdp/wrap.lua, sharded optim):
-- wrap/unwrap/re-wrap, idempotence, units and ownership (ties, shared modules), policies,
-- the sharded-read error, full_params/apply with writeback, saved references, fsdp.shard,
-- inspect, mixed-precision policies (mp: dtypes, casts, errors, absorbed inner policies), and
-- sharded optimizers equal to dense ones. Multi-rank behaviour is in tests/dist/.
-- Run: busted --lua=luajit tests/lua/wrap_spec.lua

local fsdp = require "fsdp"
local nn = fsdp.nn

local H = require "helpers"
local flat, same_values = H.flat_view, H.same_values_view

-- Every parameter of module a within 1e-6 (relative) of module b's, in order.
local function assert_params_close(a, b)
  local pa, pb = a:parameters(), b:parameters()
  for i = 1, #pa do
    local x, y = flat(pa[i]), flat(pb[i])
    for k = 1, #x do
      assert.is_true(math.abs(x[k] - y[k]) <= 1e-6 * (1 + math.abs(x[k])),
        ("param %d element %d: %g vs %g"):format(i, k, x[k], y[k]))
    end
  end
end

local function unit_paths(model)
  local out = {}
  for _, u in ipairs(fsdp.units(model)) do out[#out + 1] = u.path end
  return out
end

-- path -> unit path, from every unit's parameter list
local function owners(model)
  local out = {}
  for _, u in ipairs(fsdp.units(model)) do
    for _, p in ipairs(u:paths()) do out[p] = u.path end
  end
  return out
end

local function gpt(tie)
  fsdp.manual_seed(42)
  return nn.GPT{vocab = 11, ctx = 8, d = 8, layers = 2, heads = 2, tie = tie}
end

local ids = fsdp.tensor({{1, 2, 3, 4}, {5, 6, 7, 8}}, {dtype = "i64"})

local function quiet(fn)
  -- wrap prints a note for an already wrapped model: keep the test output clean
  local log = fsdp.log
  local saved = log.print
  local notes = {}
  log.print = function(...) notes[#notes + 1] = table.concat({...}, " ") end
  local ok, err = pcall(fn)
  log.print = saved
  if not ok then error(err, 0) end
  return notes
end

describe("fsdp.wrap", function()
  it("marks units in place: same modules, same parameter objects, same outputs", function()
    local m = gpt()
    local params = m:parameters()
    local blocks1 = m.blocks[1]
    local y0 = fsdp.no_grad(function() return m(ids) end)
    assert.are.equal(m, fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}}))
    assert.is_true(fsdp.is_wrapped(m))
    assert.are.equal(blocks1, m.blocks[1])
    local during = m:parameters()
    assert.are.equal(#params, #during)
    for i = 1, #params do assert.is_true(rawequal(params[i], during[i])) end
    local y1 = fsdp.no_grad(function() return m(ids) end)
    assert.is_true(same_values(y0, y1))
    fsdp.unwrap(m)
    assert.is_false(fsdp.is_wrapped(m))
    local after = m:parameters()
    assert.are.equal(#params, #after)
    for i = 1, #params do
      assert.is_true(rawequal(params[i], after[i]))
      assert.are.equal("cpu", after[i].device)
    end
    assert.is_true(same_values(y0, fsdp.no_grad(function() return m(ids) end)))
  end)

  it("is idempotent: wrapping a wrapped model changes nothing and says so", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local before = fsdp.units(m)
    local notes = quiet(function()
      assert.are.equal(m, fsdp.wrap(m, {strategy = "none"}))
    end)
    assert.are.equal(1, #notes)
    assert.truthy(notes[1]:find("already wrapped", 1, true))
    local after = fsdp.units(m)
    assert.are.equal(#before, #after)
    for i = 1, #before do assert.is_true(rawequal(before[i], after[i])) end
    assert.are.equal("full", after[1]:strategy())
    fsdp.unwrap(m)
    assert.are.equal(0, #fsdp.units(m))
    -- unwrap of a plain model is a no-op
    assert.are.equal(m, fsdp.unwrap(m))
  end)

  it("re-wraps an unwrapped model with other options", function()
    local m = gpt()
    local y0 = fsdp.no_grad(function() return m(ids) end)
    for _, strategy in ipairs{"full", "grad_op", "none"} do
      fsdp.wrap(m, {strategy = strategy, policy = fsdp.policy.modules{nn.Block}})
      assert.are.equal(strategy, fsdp.units(m)[1]:strategy())
      assert.is_true(same_values(y0, fsdp.no_grad(function() return m(ids) end)))
      fsdp.unwrap(m)
    end
  end)

  it("makes the root a unit and the picked modules units, innermost first", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    assert.are.same({"blocks.1", "blocks.2", "(root)"}, unit_paths(m))
    assert.is_true(fsdp.units(m)[3].is_root)
    -- after a forward: forward order
    fsdp.no_grad(function() return m(ids) end)
    assert.are.same({"(root)", "blocks.1", "blocks.2"}, unit_paths(m))
    fsdp.unwrap(m)
  end)

  it("gives a tied parameter to the root: GPT tie=true with one unit per Block", function()
    local m = gpt(true)
    assert.is_true(rawequal(m.head.weight, m.wte.weight))
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local own = owners(m)
    assert.are.equal("(root)", own["wte.weight"])
    assert.is_nil(own["head.weight"]) -- one parameter, listed once, under its first path
    assert.are.equal("blocks.2", own["blocks.2.mlp.fc.weight"])
    assert.is_true(rawequal(m.head.weight, m.wte.weight))
    local root = fsdp.units(m)[3]
    assert.are.same({"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"}, root:paths())
    -- a step trains through both uses: forward + backward + step run and the tie holds
    local opt = fsdp.optim.SGD(m, {lr = 0.1})
    nn.F.cross_entropy(m(ids), ids):backward()
    opt:step()
    fsdp.unwrap(m)
    assert.is_true(rawequal(m.head.weight, m.wte.weight))
  end)

  it("gives a parameter used from two units to their closest common wrapped ancestor", function()
    local Pair = nn.Module:extend("Pair")
    function Pair:init(shared)
      self.a = nn.Linear(4, 4)
      self.a.weight = shared -- a tie into another unit
    end
    function Pair:forward(x) return self.a(x) end
    local Outer = nn.Module:extend("Outer")
    function Outer:init()
      self.first = nn.Linear(4, 4)
      self.mid = nn.Sequential{Pair(self.first.weight), Pair(self.first.weight)}
      self.shared = nn.Linear(4, 4)        -- a module referenced from two places
      self.mid2 = nn.Sequential{self.shared, nn.ReLU()}
    end
    function Outer:forward(x)
      return self.mid2(self.shared(self.mid(self.first(x))))
    end
    fsdp.manual_seed(1)
    local m = Outer()
    local x = fsdp.randn{3, 4}
    local y0 = fsdp.no_grad(function() return m(x) end)
    -- units: both Pairs and mid; first.weight is used by first (root) and both Pairs: root
    fsdp.wrap(m, {policy = fsdp.policy.modules{Pair}})
    local own = owners(m)
    assert.are.equal("(root)", own["first.weight"])
    assert.are.equal("mid.1", own["mid.1.a.bias"])
    assert.are.equal("mid.2", own["mid.2.a.bias"])
    -- shared (at "shared" and "mid2.1"): root's
    assert.are.equal("(root)", own["shared.weight"])
    assert.is_true(same_values(y0, fsdp.no_grad(function() return m(x) end)))
    fsdp.unwrap(m)
    -- the tie inside mid only: pick mid as a unit too; first.weight still root (used by first)
    fsdp.wrap(m, {policy = fsdp.policy.list{m.mid, m.mid[1], m.mid[2], m.mid2}})
    own = owners(m)
    assert.are.equal("(root)", own["first.weight"])
    -- shared is referenced by the root directly and from mid2: root
    assert.are.equal("(root)", own["shared.weight"])
    assert.is_nil(own["mid2.1.weight"])
    fsdp.unwrap(m)
    -- a parameter tied between two units under a common unit goes to that unit
    local p = nn.Parameter(fsdp.ones{4, 4})
    local a, b = Pair(p), Pair(p)
    local inner = nn.Sequential{a, b}
    local top = nn.Sequential{nn.Linear(4, 4), inner}
    fsdp.wrap(top, {policy = fsdp.policy.list{a, b, inner}})
    own = owners(top)
    assert.are.equal("2", own["2.1.a.weight"])
    assert.are.equal("2.1", own["2.1.a.bias"])
    fsdp.unwrap(top)
  end)

  it("handles a unit called twice in one forward (gradients equal the plain model's)", function()
    local function build()
      fsdp.manual_seed(8)
      local b = nn.Linear(6, 6)
      return nn.Sequential{nn.Linear(6, 6), b, nn.ReLU(), b}
    end
    local x = fsdp.randn{3, 6}
    local plain = build()
    nn.F.mse(plain(x), x):backward()
    local m = build()
    fsdp.wrap(m, {policy = fsdp.policy.list{m[2]}})
    assert.are.same({"2", "(root)"}, unit_paths(m))
    for _ = 1, 2 do -- the second pass runs with the recorded order and prefetch
      m:zero_grad()
      nn.F.mse(m(x), x):backward()
    end
    assert.are.same({"(root)", "2"}, unit_paths(m))
    local grads = {}
    for _, u in ipairs(fsdp.units(m)) do
      local g = u:grad_shard()
      for _, s in ipairs(u:local_slices()) do
        grads[s.path] = g:narrow(1, s.shard_first, s.shard_last - s.shard_first + 1):clone()
      end
    end
    for path, p in plain:named_parameters() do
      local a, b = flat(p.grad), flat(grads[path])
      for k = 1, #a do
        assert.is_true(math.abs(a[k] - b[k]) <= 1e-6 * (1 + math.abs(a[k])), path)
      end
    end
    fsdp.unwrap(m)
  end)

  it("keeps the inner units of a model part of which is already wrapped", function()
    fsdp.manual_seed(3)
    local inner = nn.Linear(5, 5)
    local m = nn.Sequential{nn.Linear(5, 5), inner}
    local x = fsdp.randn{2, 5}
    local y0 = fsdp.no_grad(function() return m(x) end)
    fsdp.wrap(inner, {strategy = "grad_op"})
    assert.is_true(fsdp.is_wrapped(inner))
    fsdp.wrap(m)
    assert.is_true(fsdp.is_wrapped(m))
    assert.is_false(fsdp.is_wrapped(inner))
    assert.are.same({"2", "(root)"}, unit_paths(m))
    assert.are.equal("grad_op", fsdp.units(m)[1]:strategy()) -- the inner unit keeps its own
    assert.are.equal(2, #m:parameters() / 2)
    assert.is_true(same_values(y0, fsdp.no_grad(function() return m(x) end)))
    fsdp.unwrap(m)
    assert.is_false(fsdp.is_wrapped(inner))
    assert.are.equal("cpu", inner.weight.device)
  end)

  it("an optimizer needs the wrapped root, and a wrap that is still live", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local function refuses(fn, text)
      local ok, err = pcall(fn)
      assert.is_false(ok)
      assert.truthy(tostring(err):find(text, 1, true), tostring(err))
    end
    refuses(function() fsdp.optim.AdamW({m.blocks[1].mlp.fc.weight}, {lr = 0.1}) end,
      "parameter 1 is sharded (its model is wrapped): give the optimizer the wrapped model, "
      .. "or a module of it, and choose parameters with params = {...}")
    local opt = fsdp.optim.SGD(m, {lr = 0.1})
    fsdp.unwrap(m)
    refuses(function() opt:zero_grad() end,
      "zero_grad: the model was unwrapped (or re-wrapped) after this optimizer was created")
    refuses(function() opt:step() end,
      "SGD:step: the model was unwrapped (or re-wrapped) after this optimizer was created")
  end)

  it("refuses to wrap or unwrap a part of a wrapped model", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    assert.has_error(function() fsdp.wrap(m.blocks[1]) end)
    local ok, err = pcall(fsdp.wrap, m.blocks[1])
    assert.is_false(ok)
    assert.truthy(err:find("part of a wrapped model", 1, true))
    ok, err = pcall(fsdp.unwrap, m.ln_f)
    assert.is_false(ok)
    assert.truthy(err:find("unwrap its root", 1, true))
    -- a container holding a module of another wrapped model
    ok, err = pcall(fsdp.wrap, nn.Sequential{m.blocks[2]})
    assert.is_false(ok)
    assert.truthy(err:find("another wrapped model", 1, true))
    fsdp.unwrap(m)
  end)

  it("refuses to add, replace or remove a parameter or module of a wrapped model", function()
    fsdp.manual_seed(3)
    local m = nn.Sequential{nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)}
    m[3].weight = m[1].weight -- a tie across two units: the root owns it
    fsdp.wrap(m, {policy = fsdp.policy.list{m[1], m[3]}})
    local tied = m[1].weight
    -- untying by assignment would leave the new parameter in no unit: trained unsharded,
    -- unreduced and never stepped
    local ok, err = pcall(function() m[3].weight = nn.Parameter(fsdp.zeros{6, 6}) end)
    assert.is_false(ok)
    assert.truthy(err:find("Linear.weight: the module belongs to a wrapped model, and replacing "
      .. "a parameter", 1, true), err)
    assert.truthy(err:find("fsdp.unwrap the model, change it, and wrap it again", 1, true), err)
    assert.is_true(rawequal(m[3].weight, tied))
    ok, err = pcall(function() m[2].bias = nil end)
    assert.is_false(ok)
    assert.truthy(err:find("Linear.bias: the module belongs to a wrapped model, and removing",
      1, true), err)
    ok, err = pcall(function() m[2].extra = nn.Linear(6, 6) end)
    assert.is_false(ok)
    assert.truthy(err:find("and adding a Linear there", 1, true), err)
    ok, err = pcall(function() m[4] = nn.Linear(6, 6) end)
    assert.is_false(ok)
    assert.truthy(err:find("Sequential.4: the module belongs to a wrapped model", 1, true), err)
    assert.are.equal(3, #m)
    -- the same object again, and fields that hold neither, are fine
    m[3].weight = tied
    m[2].note = "kept"
    assert.are.same({"1.weight", "3.weight"}, fsdp.ties(m)[1].paths)
    -- unwrapped, the model is the user's to change
    fsdp.unwrap(m)
    m[3].weight = nn.Parameter(fsdp.zeros{6, 6})
    assert.are.same({}, fsdp.ties(m))
  end)

  it("validates its options", function()
    local m = gpt()
    local function err_of(opts)
      local ok, err = pcall(fsdp.wrap, m, opts)
      assert.is_false(ok)
      return err
    end
    assert.truthy(err_of{strategy = "zero3"}:find("strategy must be", 1, true))
    assert.truthy(err_of{strategy = "zero3"}:find('"replicate"', 1, true))
    assert.truthy(err_of{polcy = 1}:find("fsdp.wrap: unknown option 'polcy' (valid: checkpoint, "
      .. "device, init, mp, offload, policy, prefetch, reshard_after_forward, shard_size, "
      .. "strategy, sync_module_states)", 1, true))
    assert.truthy(err_of(3):find("fsdp.wrap: expects an options table", 1, true))
    local ok, err = pcall(fsdp.full_params, m, function() end, {write_back = false})
    assert.is_false(ok)
    assert.truthy(err:find("fsdp.full_params: unknown option 'write_back' (valid: writeback)", 1, true))
    assert.truthy(err_of{prefetch = "yes"}:find("prefetch must be a boolean", 1, true))
    assert.truthy(err_of{init = 3}:find("init must be a function", 1, true))
    assert.truthy(err_of{init = true, sync_module_states = true}:find("both given", 1, true))
    assert.truthy(err_of{policy = 3}:find("policy must be", 1, true))
    assert.is_false(fsdp.is_wrapped(m))
  end)

  it("takes \"replicate\" as the other name of \"none\"", function()
    local m, ref = gpt(), gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}, strategy = "replicate"})
    fsdp.wrap(ref, {policy = fsdp.policy.modules{nn.Block}, strategy = "none"})
    for i, u in ipairs(fsdp.units(m)) do
      assert.equal("none", u:strategy())
      assert.equal(fsdp.units(ref)[i]:numel(), u:numel())
    end
    assert.equal("none", fsdp.inspect(m).strategy)
    fsdp.unwrap(m); fsdp.unwrap(ref)
    local ok, err = pcall(fsdp.wrap, m, {strategy = "replicate", shard_size = 1})
    assert.is_false(ok)
    assert.truthy(err:find('shard_size is for strategy "hybrid" (the strategy is replicate)', 1, true))
  end)
end)

describe("fsdp.wrap{mp = ...}", function()
  local function dtypes(m)
    local out = {}
    for _, u in ipairs(fsdp.units(m)) do
      local d = u:dtypes()
      out[u.path] = d.param .. "/" .. d.reduce
    end
    return out
  end

  it("takes a policy: \"bf16\" = {param = bf16, reduce = f32, output = f32}; all f32 is off", function()
    for _, case in ipairs {
      {mp = "bf16", units = "bf16/f32", out = "f32"},
      {mp = "f16", units = "f16/f32", out = "f32"},
      {mp = {param = "bf16", reduce = "bf16", output = "bf16"}, units = "bf16/bf16", out = "bf16"},
      {mp = {reduce = "bf16"}, units = "f32/bf16", out = "f32"},
      {mp = "f32", units = "f32/f32", out = "f32", off = true},
      {mp = false, units = "f32/f32", out = "f32", off = true},
    } do
      local m = gpt()
      fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}, mp = case.mp})
      for path, d in pairs(dtypes(m)) do assert.are.equal(case.units, d, path) end
      local out = m(ids)
      assert.are.equal(case.out, out:dtype())
      if case.off then assert.is_nil(fsdp.inspect(m).mp) end
      out:to("f32"):sum():backward()
      fsdp.unwrap(m)
    end
  end)

  it("casts floating inputs to the param dtype and leaves integer ones alone", function()
    local seen = {}
    local lin = nn.Linear(4, 3)
    local seq = nn.Sequential{lin}
    lin:register_forward_pre_hook(function(_, x) seen[#seen + 1] = x:dtype() end)
    fsdp.wrap(seq, {mp = "bf16"})
    for _, dt in ipairs {"f32", "f64", "f16", "bf16"} do
      local out = seq(fsdp.ones({2, 4}, {dtype = dt}))
      assert.are.equal("f32", out:dtype())
    end
    assert.are.same({"bf16", "bf16", "bf16", "bf16"}, seen)
    local m = gpt()
    fsdp.wrap(m, {mp = "bf16"})
    local got
    m.wte:register_forward_pre_hook(function(_, x) got = x:dtype() end)
    m(fsdp.tensor({{1, 2, 3}}, {dtype = "i64"}))
    assert.are.equal("i64", got)
  end)

  it("refuses bad policies naming the option, leaving the model plain", function()
    local m = gpt()
    for _, case in ipairs {
      {"f64", 'fsdp.wrap: mp.param must be "f32", "bf16" or "f16" (got f64)'},
      {{param = "i64"}, 'fsdp.wrap: mp.param must be "f32", "bf16" or "f16" (got i64)'},
      {{bogus = 1}, "fsdp.wrap: unknown mp option bogus (param, reduce, output)"},
      {{reduce = "f16"}, 'fsdp.wrap: mp.reduce must be "f32" or "bf16" (got f16)'},
      {{output = "u8"}, 'fsdp.wrap: mp.output must be "f32", "bf16" or "f16" (got u8)'},
      {42, 'fsdp.wrap: mp must be "bf16", "f16" or a table {param =, reduce =, output =} (got number)'},
    } do
      H.assert_error_has(function() fsdp.wrap(m, {mp = case[1]}) end, case[2])
      assert.is_false(fsdp.is_wrapped(m))
    end
  end)

  it("keeps an absorbed inner wrap's policy, casting at the unit boundaries", function()
    local m = gpt()
    fsdp.wrap(m.blocks[2], {mp = "bf16"})
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    assert.are.same({["blocks.1"] = "f32/f32", ["blocks.2"] = "bf16/f32", ["(root)"] = "f32/f32"},
      dtypes(m))
    local seen = {}
    m.blocks[2].mlp:register_forward_pre_hook(function(mod, x) seen.b2 = mod.fc.weight:dtype() .. "/" .. x:dtype() end)
    m.ln_f:register_forward_pre_hook(function(_, x) seen.ln_f = x:dtype() end)
    local out = m(ids)
    assert.are.same({b2 = "bf16/bf16", ln_f = "f32"}, seen)
    assert.are.equal("f32", out:dtype())
    out:sum():backward()
    fsdp.unwrap(m)
  end)

  it("gives f32 gradients through a cat of more parameters than an op has inputs", function()
    -- each bf16 parameter's gradient goes through a bf16 buffer into its f32 one
    local Cat = nn.Module:extend("WrapSpecCatMany")
    function Cat:init(n)
      self.n = n
      for i = 1, n do self["p" .. i] = nn.Parameter(fsdp.zeros{2}) end
    end
    function Cat:forward(x)
      local ps = {}
      for i = 1, self.n do ps[i] = self["p" .. i] end
      return fsdp.cat(ps) * x
    end
    local n = 13
    local m = Cat(n)
    fsdp.wrap(m, {mp = "bf16"})
    local opt = fsdp.optim.SGD(m, {lr = 1})
    m(fsdp.arange(1, 2 * n + 1)):sum():backward() -- d/d p_i = x's slice: 2i - 1, 2i
    opt:step()
    fsdp.full_params(m, function(mm)
      for i = 1, n do assert.are.same({1 - 2 * i, -2 * i}, mm["p" .. i]:totable(), "p" .. i) end
    end, {writeback = false})
    fsdp.unwrap(m)
  end)
end)

describe("fsdp.policy", function()
  it("modules{Class} picks instances (subclasses included)", function()
    local MyLinear = nn.Linear:extend("MyLinear")
    fsdp.manual_seed(1)
    local m = nn.Sequential{nn.Linear(4, 4), MyLinear(4, 4), nn.ReLU()}
    fsdp.wrap(m, {policy = fsdp.policy.modules{MyLinear}})
    assert.are.same({"2", "(root)"}, unit_paths(m))
    fsdp.unwrap(m)
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Linear}})
    assert.are.same({"1", "2", "(root)"}, unit_paths(m)) -- the root holds no parameter
    assert.are.equal(0, fsdp.units(m)[3]:numel())
    fsdp.unwrap(m)
    assert.has_error(function() fsdp.policy.modules{} end)
    assert.has_error(function() fsdp.policy.modules{"Linear"} end)
  end)

  it("size(n) picks, bottom-up, modules with at least n unclaimed elements", function()
    local m = gpt() -- d = 8: a Block has 8*4 + 8*24+24 + 8*8+8 + 8*32+32 + 32*8+8 = 872
    fsdp.wrap(m, {policy = fsdp.policy.size(300)})
    -- mlp (fc 288 + proj 264 = 552) and attn (216 + 72 = 288 < 300) ... decided bottom-up
    local paths = unit_paths(m)
    assert.are.same({"blocks.1.mlp", "blocks.1", "blocks.2.mlp", "blocks.2", "(root)"}, paths)
    fsdp.unwrap(m)
    fsdp.wrap(m, {policy = fsdp.policy.size(1e9)})
    assert.are.same({"(root)"}, unit_paths(m))
    fsdp.unwrap(m)
    assert.has_error(function() fsdp.policy.size(0) end)
  end)

  it("size(n) skips containers: a ModuleList's unclaimed elements count toward its parent", function()
    local m = gpt() -- blocks (a ModuleList) holds 2 x 872 elements, each mlp 552
    -- each mlp is picked; the blocks then leave 2 x 320 = 640 >= 500 unclaimed in the list,
    -- which PyTorch's size policy never wraps (and which could never be gathered): the root
    -- takes them
    fsdp.wrap(m, {policy = fsdp.policy.size(500)})
    assert.are.same({"blocks.1.mlp", "blocks.2.mlp", "(root)"}, unit_paths(m))
    assert.are.same({2, 4, 11}, m(ids):shape()) -- a forward runs
    fsdp.unwrap(m)
    fsdp.wrap(m, {policy = fsdp.policy.size(1500)}) -- the list alone (1744) would pass
    assert.are.same({"(root)"}, unit_paths(m))
    fsdp.unwrap(m)
  end)

  it("list{...} picks exactly these modules and names a stranger", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.list{m.blocks[2].mlp, m.ln_f}})
    assert.are.same({"blocks.2.mlp", "ln_f", "(root)"}, unit_paths(m))
    fsdp.unwrap(m)
    local ok, err = pcall(fsdp.wrap, m, {policy = fsdp.policy.list{nn.Linear(2, 2)}})
    assert.is_false(ok)
    assert.truthy(err:find("not part of the wrapped model", 1, true))
    assert.is_false(fsdp.is_wrapped(m))
  end)

  it("accepts a function and refuses a ModuleList unit", function()
    local m = gpt()
    fsdp.wrap(m, {policy = function(mod, path) return path == "blocks.1.attn" end})
    assert.are.same({"blocks.1.attn", "(root)"}, unit_paths(m))
    fsdp.unwrap(m)
    local ok, err = pcall(fsdp.wrap, m, {policy = fsdp.policy.modules{nn.ModuleList}})
    assert.is_false(ok)
    assert.truthy(err:find("ModuleList", 1, true))
    assert.is_false(fsdp.is_wrapped(m))
  end)
end)

describe("sharded parameters", function()
  it("raise an error naming fsdp.full_params when read", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local w = m.blocks[1].mlp.fc.weight
    local ok, err = pcall(function() return w:sum() end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("fsdp.full_params", 1, true), tostring(err))
    ok, err = pcall(function() return w:totable() end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("fsdp.full_params", 1, true), tostring(err))
    -- the shape is still known
    assert.are.same({32, 8}, w:shape())
    fsdp.unwrap(m)
  end)

  it("refuse writes instead of dropping them (fill, copy, clone)", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local w = m.blocks[1].mlp.fc.weight
    for what, fn in pairs {
      fill = function() w:fill(0) end,
      copy = function() w:copy(fsdp.zeros{32, 8}) end,
      clone = function() return w:clone() end,
    } do
      local ok, err = pcall(fn)
      assert.is_false(ok, what)
      assert.truthy(tostring(err):find("blocks.1.mlp.fc.weight is sharded", 1, true), tostring(err))
      assert.truthy(tostring(err):find("fsdp.full_params", 1, true), tostring(err))
    end
    -- the shard still holds the values: unwrap gives them back
    fsdp.unwrap(m)
    assert.is_true(m.blocks[1].mlp.fc.weight:sum():item() ~= 0)
  end)

  it("name the call that gathers when a forward method is called directly", function()
    local m = nn.Sequential { nn.Linear(4, 3), nn.Linear(3, 2) }
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Linear}})
    local x = fsdp.randn{2, 4}
    local ok, err = pcall(function() return m[1]:forward(x) end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("1.weight is sharded: gather its unit (u:gather()) or use "
      .. "fsdp.full_params; a wrapped model gathers its units when it is called (m(x)), not "
      .. "through m:forward(x)", 1, true), tostring(err))
    assert.are.same({2, 3}, m[1](x):shape())
    fsdp.unwrap(m)
  end)

  it("fsdp.shard gives this rank's slice as a view (all of it at world size 1)", function()
    local m = gpt()
    local w = m.blocks[1].mlp.fc.weight
    local dense = w:clone()
    assert.are.equal(w:numel(), fsdp.shard(w):numel()) -- plain: the whole parameter
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local s = fsdp.shard(w)
    assert.are.equal(w:numel(), s:numel())
    assert.is_true(same_values(s, dense))
    s:fill(0.5) -- writes land in the shard
    fsdp.full_params(m, function() assert.are.equal(0.5, w:get(3, 4)) end)
    fsdp.unwrap(m)
    assert.are.equal(0.5, w:get(1, 1))
  end)
end)

describe("model:to on a wrapped model", function()
  it("is refused naming the wrap, a dtype alone too; odd arguments are refused", function()
    local m = gpt()
    H.assert_error_has(function() m:to() end, "to: expected a device or dtype name (got nothing)")
    H.assert_error_has(function() m:to("bf16", "f32") end, "to: two dtypes (bf16 and f32)")
    fsdp.wrap(m)
    for _, arg in ipairs {"bf16", "cpu"} do
      H.assert_error_has(function() m:to(arg) end, "to: the model is wrapped")
      H.assert_error_has(function() m.blocks[1]:to(arg) end, "to: the model is wrapped")
    end
  end)
end)

describe("a dropped model", function()
  -- compiled traces may hold the first objects a closure saw (docs/init.md): flushed first
  local function collected(unwrap)
    local alive = setmetatable({}, {__mode = "k"})
    for _ = 1, 2 do
      local m = gpt()
      alive[m] = true
      fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
      local ids = fsdp.tensor({{1, 2, 3, 4}}, {dtype = "i64"})
      nn.F.cross_entropy(m(ids), ids):backward()
      if unwrap then fsdp.unwrap(m) end
    end
    jit.flush()
    for _ = 1, 4 do collectgarbage() end
    return next(alive) == nil
  end

  it("is collected with its units and shards, wrapped or unwrapped", function()
    assert.is_true(collected(false))
    assert.is_true(collected(true))
    assert.are.equal(0, fsdp.memory().params)
  end)
end)

describe("after fsdp.unwrap", function()
  it("the optimizers' state over the shards is dropped with them", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local opt = fsdp.optim.AdamW(m, {lr = 1e-3})
    local ids = fsdp.tensor({{1, 2, 3, 4}}, {dtype = "i64"})
    nn.F.cross_entropy(m(ids), ids):backward()
    opt:step()
    local sd = opt:state_dict() -- a state_dict taken before stays readable
    assert.is_true(fsdp.memory().optim > 0)
    fsdp.unwrap(m)
    local _, st = next(sd.state)
    assert.is_true(st.exp_avg:sum():item() == st.exp_avg:sum():item())
    sd, st = nil, nil
    collectgarbage()
    collectgarbage()
    assert.are.equal(0, fsdp.memory().optim)
    H.assert_error_has(function() opt:step() end, "AdamW:step: the model was unwrapped")
  end)

  it("an old fsdp.shard view refuses reads and writes instead of dropping them", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local w = m.blocks[1].mlp.fc.weight
    local s, root = fsdp.shard(w), fsdp.shard(m.wte.weight)
    fsdp.unwrap(m)
    local before = w:clone()
    for what, fn in pairs {
      fill = function() s:fill(3) end,
      copy = function() s:copy(fsdp.ones{s:numel()}) end,
      set = function() s:set(1, 3) end,
      read = function() return s:sum() end,
      root = function() root:fill(3) end,
    } do
      H.assert_error_has(fn, "unit that was unsharded (fsdp.unwrap)", "take fsdp.shard(param) again")
    end
    assert.is_true(same_values(before, w))
    -- the parameter itself is the place to write now; its shard is the whole of it
    fsdp.shard(w):fill(0.25)
    assert.are.equal(0.25, w:get(2, 3))
  end)

  it("a backward over a graph recorded before the unwrap raises, naming the unit", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local loss = nn.F.cross_entropy(m(ids), ids)
    fsdp.unwrap(m)
    H.assert_error_has(function() loss:backward() end,
      "was unsharded (fsdp.unwrap) after the forward that recorded this graph", "run the forward again")
    for _, p in ipairs(m:parameters()) do assert.is_nil(p.grad) end
    -- the plain model trains: a new forward and backward work
    nn.F.cross_entropy(m(ids), ids):backward()
    assert.is_not_nil(m.blocks[1].mlp.fc.weight.grad)
  end)

  it("a graph dropped before the unwrap does not stand in the way of the plain model", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    do local _ = m(ids) end -- an evaluation forward recorded (no no_grad) and dropped
    fsdp.unwrap(m)
    nn.F.cross_entropy(m(ids), ids):backward()
    assert.is_not_nil(m.blocks[1].mlp.fc.weight.grad)
  end)
end)

describe("fsdp.full_params and fsdp.apply", function()
  it("full_params shows full weights and writes changes back (or not)", function()
    local m = gpt()
    local saved = m.wpe.weight -- a reference taken before wrapping
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local n = #m:parameters()
    fsdp.full_params(m, function(model)
      assert.are.equal(n, #model:parameters())
      for _, u in ipairs(fsdp.units(m)) do assert.are.equal("gathered", u:state()) end
      assert.is_true(rawequal(saved, model.wpe.weight))
      saved:fill(2) -- through the old reference
      model.blocks[2].ln1.bias:fill(3)
    end)
    for _, u in ipairs(fsdp.units(m)) do assert.are.equal("sharded", u:state()) end
    fsdp.full_params(m, function(model)
      assert.are.equal(2, model.wpe.weight:get(1, 1))
      assert.are.equal(3, model.blocks[2].ln1.bias:get(5))
      model.wpe.weight:fill(7)
    end, {writeback = false})
    fsdp.full_params(m, function(model) assert.are.equal(2, saved:get(2, 2)) end)
    fsdp.unwrap(m)
    assert.are.equal(2, saved:get(1, 1))
  end)

  it("full_params on a submodule gathers only the units it needs; a forward inside works", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local states
    fsdp.full_params(m.blocks[2], function(b)
      states = {}
      for _, u in ipairs(fsdp.units(m)) do states[u.path] = u:state() end
      local x = fsdp.randn{1, 3, 8}
      local y = b(x) -- the block's hooks pass through: it stays gathered
      assert.are.same({1, 3, 8}, y:shape())
      assert.are.equal("gathered", fsdp.units(m)[2]:state())
    end)
    assert.are.same({["(root)"] = "sharded", ["blocks.1"] = "sharded", ["blocks.2"] = "gathered"},
      states)
    assert.are.equal("sharded", fsdp.units(m)[2]:state())
    -- the whole model inside full_params: a forward runs on the full weights
    local y0 = fsdp.no_grad(function() return m(ids) end)
    fsdp.full_params(m, function(model) assert.is_true(same_values(y0, model(ids))) end)
    fsdp.unwrap(m)
  end)

  it("apply visits every module with its path, units gathered along the path only", function()
    local m = gpt()
    local plain = {}
    for path, mod in m:named_modules() do plain[#plain + 1] = path end
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local visited, gathered_at = {}, {}
    fsdp.apply(m, function(mod, path)
      visited[#visited + 1] = path
      local g = {}
      for _, u in ipairs(fsdp.units(m)) do
        if u:state() == "gathered" then g[#g + 1] = u.path end
      end
      table.sort(g)
      gathered_at[path] = table.concat(g, ",")
      if mod.weight then mod.weight:mul_(0) end -- every module's own weight sees full data
    end)
    assert.are.same(plain, visited)
    assert.are.equal("(root)", gathered_at["wte"])
    assert.are.equal("(root),blocks.1", gathered_at["blocks.1.mlp.fc"])
    assert.are.equal("(root),blocks.2", gathered_at["blocks.2"])
    assert.are.equal("(root)", gathered_at["head"])
    for _, u in ipairs(fsdp.units(m)) do assert.are.equal("sharded", u:state()) end
    -- written back
    fsdp.full_params(m, function(model)
      assert.are.equal(0, model.blocks[1].mlp.fc.weight:sum():item())
      assert.are.equal(0, model.wte.weight:sum():item())
      assert.are.equal(1, model.ln_f.bias:numel() > 0 and 1 or 0)
    end)
    -- apply on a submodule: paths relative to it, its ancestors' units gathered
    local sub = {}
    fsdp.apply(m.blocks[1], function(mod, path)
      sub[#sub + 1] = path
      assert.are.equal("gathered", fsdp.units(m)[#fsdp.units(m)]:state()) -- the root
    end)
    assert.are.equal("", sub[1])
    assert.are.equal("ln1", sub[2])
    fsdp.unwrap(m)
  end)

  it("apply and full_params leave the model usable after fn raises", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local ok, err = pcall(fsdp.apply, m, function(mod, path)
      if path == "blocks.1.mlp" then error("boom in apply") end
    end)
    assert.is_false(ok)
    assert.truthy(err:find("boom in apply", 1, true))
    ok = pcall(fsdp.full_params, m, function() error("boom") end)
    assert.is_false(ok)
    for _, u in ipairs(fsdp.units(m)) do assert.are.equal("sharded", u:state()) end
    fsdp.no_grad(function() return m(ids) end) -- hooks work again
    fsdp.unwrap(m)
  end)

  it("work on a plain model too", function()
    local m = gpt()
    local n = 0
    fsdp.apply(m, function() n = n + 1 end)
    assert.are.equal(#m:modules(), n)
    assert.are.equal(42, fsdp.full_params(m, function() return 42 end))
  end)
end)

describe("fsdp.inspect", function()
  it("describes a model and a parameter", function()
    local m = gpt()
    assert.truthy(tostring(fsdp.inspect(m)):find("not wrapped", 1, true))
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local r = fsdp.inspect(m)
    assert.is_true(r.wrapped)
    assert.are.equal(3, #r.units)
    local text = tostring(r)
    assert.truthy(text:find("blocks.2", 1, true))
    assert.truthy(text:find("(root)", 1, true))
    local p = fsdp.inspect(m.head.weight)
    assert.are.equal("(root)", p.unit)
    assert.are.equal("wte.weight", p.path)
    assert.truthy(tostring(p):find("wte.weight", 1, true))
    fsdp.unwrap(m)
  end)
end)

describe("optimizers on a wrapped model", function()
  local function train(wrap, make_opt, steps)
    local m = gpt()
    if wrap then fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}}) end
    local opt = make_opt(m)
    local norms = {}
    for i = 1, steps do
      opt:zero_grad()
      nn.F.cross_entropy(m(ids), ids):backward()
      norms[i] = fsdp.clip_grad_norm(m, 0.5)
      opt:step()
    end
    return m, opt, norms
  end

  for _, case in ipairs{
    {"AdamW", function(m) return fsdp.optim.AdamW(m, {lr = 1e-2, weight_decay = 0.1}) end},
    {"SGD", function(m) return fsdp.optim.SGD(m, {lr = 0.1, momentum = 0.9, weight_decay = 0.01}) end},
  } do
    it(case[1] .. " on shards equals " .. case[1] .. " on the plain model", function()
      local plain, _, n0 = train(false, case[2], 4)
      local wrapped, opt, n1 = train(true, case[2], 4)
      for i = 1, #n0 do assert.is_true(math.abs(n0[i] - n1[i]) <= 1e-6 * n0[i]) end
      fsdp.unwrap(wrapped)
      assert_params_close(plain, wrapped)
      -- the optimizer refuses to step a model unwrapped under it
      local ok, err = pcall(opt.step, opt)
      assert.is_false(ok)
      assert.truthy(err:find("unwrapped", 1, true))
    end)
  end

  it("keeps per-slice state with weight-decay exclusions per parameter", function()
    local m, opt = train(true, function(mm) return fsdp.optim.AdamW(mm, {lr = 1e-2}) end, 1)
    local sd = opt:state_dict()
    assert.is_true(sd.sharded)
    assert.are.equal(0, sd.rank)
    local st = sd.state["blocks.1.mlp.fc.weight"]
    assert.are.equal(1, st.param_first)
    assert.are.equal(256, st.numel)
    assert.are.equal(256, st.exp_avg:numel())
    assert.are.equal(1, st.step)
    -- biases and norms are excluded from decay, by path, as for a plain model
    local excluded = {}
    for _, p in ipairs(opt.no_decay_paths) do excluded[p] = true end
    assert.is_true(excluded["blocks.1.ln1.weight"])
    assert.is_nil(excluded["blocks.1.mlp.fc.weight"])
    -- optimizer state is accounted as optim
    assert.is_true(fsdp.memory().optim >= 2 * 4 * m:num_parameters())
    -- round trip
    local before = flat(st.exp_avg)
    opt:load_state_dict(sd)
    assert.are.same(before, flat(opt:state_dict().state["blocks.1.mlp.fc.weight"].exp_avg))
    fsdp.unwrap(m)
  end)

  it("zero_grad zeroes the gradient shards (optimizer and module)", function()
    local m, opt = train(true, function(mm) return fsdp.optim.SGD(mm, {lr = 0.1}) end, 1)
    nn.F.cross_entropy(m(ids), ids):backward()
    local u = fsdp.units(m)[1]
    assert.is_true(fsdp.core.sumsq(u:grad_shard()) > 0)
    opt:zero_grad()
    assert.are.equal(0, fsdp.core.sumsq(u:grad_shard()))
    nn.F.cross_entropy(m(ids), ids):backward()
    assert.is_true(fsdp.core.sumsq(u:grad_shard()) > 0)
    m:zero_grad()
    assert.are.equal(0, fsdp.core.sumsq(u:grad_shard()))
    fsdp.unwrap(m)
  end)

  it("a submodule's zero_grad drops its parameters' gradients only, as on a plain model", function()
    -- m.b a unit, m.a and m.c in the root: b:zero_grad() zeroes a whole unit, a:zero_grad()
    -- part of the root's shard; under fsdp.no_sync the held gradient is dropped too
    local Pair = nn.Module:extend("WrapSpecZeroPair")
    function Pair:init()
      self.a = nn.Linear(4, 4)
      self.b = nn.Linear(4, 4)
      self.c = nn.Linear(4, 4)
    end
    function Pair:forward(x) return self.c(self.b(self.a(x)):relu()) end
    local function run(wrap)
      fsdp.manual_seed(5)
      local m = Pair()
      if wrap then fsdp.wrap(m, {policy = fsdp.policy.list{m.b}}) end
      local opt = fsdp.optim.SGD(m, {lr = 0.1, momentum = 0.9, weight_decay = 0.1,
        local_only = not wrap})
      local x = fsdp.tensor{{1, -2, 3, 0.5}, {0, 1, -1, 2}}
      local function loss() return m(x):sum() end
      -- step 1: b dropped after the backward; step 2: a dropped; step 3: a micro-batch under
      -- no_sync, a and b dropped, then one more outside it (theirs is the second one only)
      opt:zero_grad(); loss():backward(); m.b:zero_grad(); opt:step()
      opt:zero_grad(); loss():backward(); m.a:zero_grad(); opt:step()
      opt:zero_grad()
      fsdp.no_sync(m, function() loss():backward() end)
      m.a:zero_grad()
      m.b:zero_grad()
      loss():backward()
      opt:step()
      local steps = {}
      for _, name in ipairs{"a", "b", "c"} do
        local st = opt.state[m[name].weight]
        steps[name] = st and st.step
      end
      if wrap then
        -- the flags say so: no gradient after zero_grad, until the next backward
        for _, u in ipairs(fsdp.units(m)) do
          for i, path in ipairs(u:paths()) do assert.is_true(u:has_grad(i), path) end
        end
        m.a:zero_grad()
        for _, u in ipairs(fsdp.units(m)) do
          for i, path in ipairs(u:paths()) do
            assert.are.equal(path:sub(1, 2) ~= "a.", u:has_grad(i), path)
          end
        end
        fsdp.unwrap(m)
      end
      return m, steps
    end
    local plain, ps = run(false)
    local m, ws = run(true)
    assert.are.same({a = 2, b = 2, c = 3}, ps)
    assert.are.same(ps, ws)
    assert_params_close(plain, m)
  end)

  -- A block whose "spare" Linear is never called, and a block left out on step 2.
  local Skip = nn.Module:extend("WrapSpecSkip")
  function Skip:init()
    self.a = nn.Linear(4, 4)
    self.b = nn.Linear(4, 4)
    self.spare = nn.Linear(4, 4)
  end
  function Skip:forward(x, step)
    if step ~= 2 then x = self.b(x) end
    return self.a(x)
  end

  for _, case in ipairs{
    {"AdamW", function(m) return fsdp.optim.AdamW(m, {lr = 1e-2, weight_decay = 0.1}) end},
    {"SGD", function(m) return fsdp.optim.SGD(m, {lr = 0.1, momentum = 0.9, weight_decay = 0.1}) end},
  } do
    it(case[1] .. " skips the shard slices of parameters without a gradient, as on a plain model", function()
      local function run(wrap)
        fsdp.manual_seed(3)
        local m = Skip()
        local spare = flat(m.spare.weight)
        if wrap then fsdp.wrap(m, {policy = fsdp.policy.list{m.b}}) end
        local opt = case[2](m)
        for step = 1, 3 do
          opt:zero_grad()
          m(fsdp.ones{2, 4}, step):sum():backward()
          opt:step()
        end
        return m, opt, spare
      end
      local plain, popt = run(false)
      local m, opt, spare = run(true)
      assert.is_nil(opt.state[m.spare.weight]) -- never stepped: no state, as plain
      assert.is_nil(popt.state[plain.spare.weight])
      assert.are.equal(3, opt.state[m.a.weight].step)
      assert.are.equal(2, opt.state[m.b.weight].step) -- not on step 2
      assert.are.equal(2, popt.state[plain.b.weight].step)
      fsdp.unwrap(m)
      assert.are.same(spare, flat(m.spare.weight)) -- no weight decay either
      assert_params_close(plain, m)
    end)
  end

  it("takes a submodule of a wrapped model (its parameters, under paths from the root), "
    .. "refuses an array of sharded parameters", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local sub = fsdp.optim.SGD(m.blocks[1], {lr = 1})
    assert.are.equal(#m.blocks[1]:parameters(), #sub.params)
    assert.are.equal("blocks.1.ln1.weight", sub.params[1].path)
    local ok, err = pcall(fsdp.optim.SGD, m:parameters(), {lr = 1})
    assert.is_false(ok)
    assert.truthy(err:find("sharded", 1, true))
    fsdp.unwrap(m)
  end)
end)
