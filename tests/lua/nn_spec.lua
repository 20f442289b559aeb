-- nn_spec.lua — fsdp.nn: module protocol, registration and paths, ties, path-based
-- initialisation, train/eval, error paths, layer forwards against hand computation, GPT and a
-- small regression that trains. Run: busted --lua=luajit tests/lua/nn_spec.lua

local fsdp = require "fsdp"
local nn = fsdp.nn
local F = nn.F

local H = require "helpers"
local flat, assert_close, same_values = H.flat, H.assert_close, H.same_values

local function paths_of(m)
  local out = {}
  for path in m:named_parameters() do out[#out + 1] = path end
  return out
end

local function small_gpt(extra)
  local cfg = {vocab = 11, ctx = 8, d = 8, layers = 2, heads = 2}
  for k, v in pairs(extra or {}) do cfg[k] = v end
  return nn.GPT(cfg)
end

-- a custom class used by several tests
local Pair = nn.Module:extend("Pair")
function Pair:init(d)
  self.first = nn.Linear(d, d)
  self.scale = nn.Parameter(fsdp.ones{d})
  self.note = "plain values are not registered"
  self.second = nn.Linear(d, d, {bias = false})
end
function Pair:forward(x) return self.second(self.first(x) * self.scale) end

describe("nn.Module registration", function()
  it("refuses what it could not register: plain tables, odd keys, writes over elements, holes", function()
    local Net = nn.Module:extend("TableNet")
    for _, fn in pairs {
      list = function(self) self.layers = {nn.Linear(2, 2)} end,
      dict = function(self) self.layers = {a = nn.Linear(2, 2)} end,
      params = function(self) self.ws = {nn.Parameter(fsdp.ones{2})} end,
    } do
      Net.init = fn
      H.assert_error_has(function() return Net() end, "a plain table of modules or parameters is not registered")
    end
    Net.init = function(self) self[0] = nn.Linear(2, 2) end
    H.assert_error_has(function() return Net() end, "TableNet[0]: integer fields are positions 1, 2, ...")
    Net.init = function(self) self.config = {d = 2, name = "x"} end -- plain values are fine
    assert.are.equal(2, Net().config.d)
    Net.init = function(self) self.modules = nn.Linear(2, 2) end
    H.assert_error_has(function() return Net() end, "TableNet.modules: a field of that name would hide the method TableNet:modules")
    Net.init = function(self) self.training = nn.Linear(2, 2) end
    H.assert_error_has(function() return Net() end, "TableNet.training: the train/eval flag is a boolean")
    local s = nn.Sequential{nn.Linear(2, 2)}
    s[1] = fsdp.zeros{3} -- over an existing element: Lua does not tell the module
    H.assert_error_has(function() return s:parameters() end,
      "Sequential[1]: integer fields hold modules or parameters (got tensor)")
    local t = nn.Sequential{nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 3)}
    t[2] = nil
    H.assert_error_has(function() return t:parameters() end, "without a hole")
  end)

  it("registers modules and parameters in assignment order with dotted paths", function()
    local m = Pair(3)
    assert.are.same({"first.weight", "first.bias", "scale", "second.weight"}, paths_of(m))
    assert.are.equal(4, #m:parameters())
    assert.are.equal("plain values are not registered", m.note)
    local names = {}
    for path, sub in m:named_modules() do names[#names + 1] = path .. "=" .. sub:type_name() end
    assert.are.same({"=Pair", "first=Linear", "second=Linear"}, names)
    assert.are.equal(2, #m:children())
    assert.is_true(rawequal(m:children()[1], m.first))
  end)

  it("keeps a reassigned field in place and drops a field set to nil", function()
    local m = Pair(3)
    local old = m.first
    m.first = nn.Linear(3, 3, {bias = false})
    assert.is_false(rawequal(old, m.first))
    assert.are.same({"first.weight", "scale", "second.weight"}, paths_of(m))
    m.scale = nil
    assert.are.same({"first.weight", "second.weight"}, paths_of(m))
    m.scale = nn.Parameter(fsdp.ones{3}) -- re-added: goes to the end
    assert.are.same({"first.weight", "second.weight", "scale"}, paths_of(m))
    m.second = 42 -- a plain value replaces a module: unregistered
    assert.are.same({"first.weight", "scale"}, paths_of(m))
    assert.are.equal(42, m.second)
  end)

  it("refuses a plain table of modules (use ModuleList)", function()
    local Bad = nn.Module:extend("Bad")
    function Bad:init() self.layers = {nn.Linear(2, 2)} end
    assert.has_error(function() Bad() end)
    local ok, err = pcall(Bad)
    assert.is_false(ok)
    assert.truthy(err:find("ModuleList", 1, true))
  end)

  it("supports subclasses calling the parent constructor", function()
    local Base = nn.Module:extend("Base")
    function Base:init(d) self.fc = nn.Linear(d, d) end
    local Child = Base:extend("Child")
    function Child:init(d)
      Base.init(self, d)
      self.extra = nn.Linear(d, 1)
    end
    function Child:forward(x) return self.extra(self.fc(x)) end
    local c = Child(4)
    assert.are.same({"fc.weight", "fc.bias", "extra.weight", "extra.bias"}, paths_of(c))
    assert.is_true(nn.isinstance(c, Base))
    assert.is_true(nn.isinstance(c, nn.Module))
    assert.is_false(nn.isinstance(c, nn.Linear))
    assert.are.same({2, 1}, c(fsdp.zeros{2, 4}):shape())
  end)

  it("names ModuleList and Sequential children 1, 2, ... and supports #, [i], ipairs, append", function()
    local l = nn.ModuleList{nn.Linear(2, 2), nn.ReLU()}
    assert.are.equal(2, #l)
    l:append(nn.Linear(2, 3, {bias = false}))
    assert.are.equal(3, #l)
    assert.are.equal("ReLU", l[2]:type_name())
    local n = 0
    for i, sub in ipairs(l) do
      n = n + 1
      assert.is_true(rawequal(sub, l[i]))
    end
    assert.are.equal(3, n)
    assert.are.same({"1.weight", "1.bias", "3.weight"}, paths_of(l))
    local s = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    assert.are.same({"1.weight", "1.bias", "2.weight", "2.bias"}, paths_of(s))
    assert.has_error(function() nn.Sequential{nn.Linear(2, 2), 3} end)
    assert.has_error(function() l:append(3) end)
  end)

  it("gives GPT the documented children and paths", function()
    local m = small_gpt()
    local kids = {}
    for name in m:named_children() do kids[#kids + 1] = name end
    assert.are.same({"wte", "wpe", "blocks", "ln_f", "head"}, kids)
    local paths = paths_of(m)
    assert.are.equal("wte.weight", paths[1])
    assert.are.equal("wpe.weight", paths[2])
    assert.are.equal("blocks.1.ln1.weight", paths[3])
    local set = {}
    for _, p in ipairs(paths) do set[p] = true end
    assert.is_true(set["blocks.1.mlp.fc.weight"])
    assert.is_true(set["blocks.2.attn.qkv.bias"])
    assert.is_true(set["blocks.2.attn.proj.weight"])
    assert.is_true(set["ln_f.bias"])
    assert.is_nil(set["head.weight"]) -- tied: listed once, as wte.weight
    assert.is_nil(set["head.bias"])
    -- 2 embeddings + 2 blocks x 12 + ln_f 2
    assert.are.equal(2 + 2 * 12 + 2, #paths)
    assert.is_true(rawequal(m.blocks[1].mlp.fc, m.blocks[1].mlp.fc))
  end)

  it("prints a readable tree", function()
    local s = tostring(small_gpt())
    assert.truthy(s:find("GPT(vocab=11, ctx=8, d=8, layers=2, heads=2, tie=true)", 1, true))
    assert.truthy(s:find("\n  blocks: ModuleList(2)\n    1: Block", 1, true))
    assert.truthy(s:find("qkv: Linear(8 -> 24)", 1, true))
    assert.truthy(s:find("head: Linear(8 -> 11, bias=false) [weight tied to wte.weight]", 1, true))
    local p = tostring(Pair(2))
    assert.truthy(p:find("scale: Parameter(2)", 1, true))
  end)

  it("counts parameters once", function()
    local m = small_gpt()
    local n = 0
    for _, p in ipairs(m:parameters()) do n = n + p:numel() end
    assert.are.equal(n, m:num_parameters())
    local untied = small_gpt{tie = false}
    assert.are.equal(n + 11 * 8, untied:num_parameters())
  end)
end)

describe("nn ties", function()
  it("GPT's head weight is the embedding parameter itself", function()
    local m = small_gpt()
    assert.is_true(rawequal(m.head.weight, m.wte.weight))
    local count = 0
    for _, p in ipairs(m:parameters()) do
      if rawequal(p, m.wte.weight) then count = count + 1 end
    end
    assert.are.equal(1, count)
    local u = small_gpt{tie = false}
    assert.is_false(rawequal(u.head.weight, u.wte.weight))
  end)

  it("accumulates the gradients of both uses into the one tied parameter", function()
    fsdp.manual_seed(11)
    local tied = small_gpt()
    local untied = small_gpt{tie = false}
    -- same values everywhere; the untied head starts as a copy of the embedding
    local src = {}
    for path, p in tied:named_parameters() do src[path] = p end
    for path, p in untied:named_parameters() do
      p:copy(path == "head.weight" and tied.wte.weight or src[path])
    end
    local ids = fsdp.tensor{{1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}}
    local targets = fsdp.tensor{{2, 3, 4, 5, 6}, {7, 8, 9, 10, 0}}
    local lt = F.cross_entropy(tied(ids), targets)
    lt:backward() -- one graph at a time: backward frees the tape
    local lu = F.cross_entropy(untied(ids), targets)
    lu:backward()
    assert_close(lt:item(), lu:item(), 1e-6, "losses")
    local summed = untied.wte.weight.grad + untied.head.weight.grad
    assert_close(tied.wte.weight.grad, summed, 1e-4, "tied gradient")
    -- and the sum is not just one of the two parts
    assert.is_false(same_values(tied.wte.weight.grad, untied.wte.weight.grad))
    assert.is_false(same_values(tied.wte.weight.grad, untied.head.weight.grad))
    assert_close(tied.blocks[2].mlp.fc.weight.grad, untied.blocks[2].mlp.fc.weight.grad, 1e-4,
      "other gradients")
  end)
end)

describe("nn path-based initialisation", function()
  it("keeps the values of a parameter the user put in a built-in layer's field", function()
    local Net = nn.Module:extend("KeepNet")
    function Net:init()
      self.fc = nn.Linear(2, 2, {bias = false})
      self.fc.weight = nn.Parameter(fsdp.ones{2, 2})
    end
    assert.are.equal(4, Net().fc.weight:sum():item())
    local l = nn.Linear(2, 2)
    l.weight = nn.Parameter(fsdp.full({2, 2}, 3))
    local s = nn.Sequential{l}
    assert.are.equal(12, s[1].weight:sum():item())
    assert.is_true(l.bias:abs():sum():item() > 0) -- the layer's own bias is initialised
    -- a custom module's own nn.Parameter, made in its init, is its reset_parameters' to fill,
    -- and so is one it ties to another module's
    local C = nn.Module:extend("OwnInit")
    function C:init() self.w = nn.Parameter(fsdp.zeros{4}) end
    function C:reset_parameters() self:init_param("w", "normal", 0, 1) end
    assert.is_true(C().w:abs():sum():item() > 0)
    local Two = nn.Module:extend("TwoOwn")
    function Two:init() self.a = C() self.b = C() self.b.w = self.a.w end
    local two = Two()
    assert.is_true(rawequal(two.a.w, two.b.w) and two.a.w:abs():sum():item() > 0)
  end)

  it("gives the same values for the same seed and different values for another seed", function()
    fsdp.manual_seed(5)
    local a = small_gpt()
    fsdp.manual_seed(5)
    local b = small_gpt()
    fsdp.manual_seed(6)
    local c = small_gpt()
    local pb, pc = b:parameters(), c:parameters()
    for i, p in ipairs(a:parameters()) do
      assert.is_true(same_values(p, pb[i]))
    end
    assert.is_false(same_values(a.blocks[1].attn.qkv.weight, pc[5]))
    assert.is_false(same_values(a.wte.weight, c.wte.weight))
  end)

  it("gives two standalone layers of the same shape different values", function()
    fsdp.manual_seed(1)
    local l1, l2 = nn.Linear(4, 4), nn.Linear(4, 4)
    assert.is_false(same_values(l1.weight, l2.weight))
    assert.is_false(same_values(l1.bias, l2.bias))
  end)

  it("is a pure function of (seed, top-level construction number, final path)", function()
    fsdp.manual_seed(7)
    local s = nn.Sequential{nn.Linear(3, 4), nn.Linear(4, 2)} -- outermost constructions 1, 2, 3
    local k = 1 / math.sqrt(3)
    local expect = fsdp.zeros{4, 3}
    fsdp.core.init_uniform(expect, 7, "3/1.weight", -k, k)
    assert.is_true(same_values(s[1].weight, expect))
    k = 1 / math.sqrt(4)
    expect = fsdp.zeros{2}
    fsdp.core.init_uniform(expect, 7, "3/2.bias", -k, k)
    assert.is_true(same_values(s[2].bias, expect))
    local rec = nn.init_record(s[2].weight)
    assert.are.equal("3/2.weight", rec.key)
    assert.are.equal(7, rec.seed)
    assert.are.equal("uniform", rec.kind)
  end)

  it("does not depend on creation order: children are re-initialised by final path", function()
    fsdp.manual_seed(3)
    local a1, a2 = nn.Linear(3, 4), nn.Linear(4, 2)
    local before = a1.weight:clone()
    local sa = nn.Sequential{a1, a2}
    assert.is_false(same_values(before, sa[1].weight)) -- re-initialised when adopted
    fsdp.manual_seed(3)
    local b2 = nn.Linear(4, 2) -- built in the other order
    local b1 = nn.Linear(3, 4)
    local sb = nn.Sequential{b1, b2}
    for i, p in ipairs(sa:parameters()) do
      assert.is_true(same_values(p, sb:parameters()[i]))
    end
  end)

  it("gives a subtree the same values whether built inside the container or outside", function()
    local Two = nn.Module:extend("Two")
    function Two:init()
      self[1] = nn.Linear(3, 4) -- built inside: paths "1.*", "2.*" as in Sequential
      self[2] = nn.Linear(4, 2)
    end
    fsdp.manual_seed(9)
    local inside = Two() -- outermost construction 1
    fsdp.manual_seed(9)
    nn.ReLU()
    nn.ReLU() -- two outermost constructions, so that the Sequential below is number 3
    local outside = nn.Sequential{nn.Linear(3, 4), nn.Linear(4, 2)} -- numbers 3, 4, 5
    -- the Sequential is construction 5, Two was 1: same paths, different top numbers
    assert.is_false(same_values(inside[1].weight, outside[1].weight))
    fsdp.manual_seed(9)
    for _ = 1, 4 do nn.ReLU() end
    local inside5 = Two() -- now also construction number 5
    for i, p in ipairs(inside5:parameters()) do
      assert.is_true(same_values(p, outside:parameters()[i]))
    end
  end)

  it("restarts construction numbers at manual_seed", function()
    fsdp.manual_seed(4)
    local a = nn.Linear(2, 2)
    nn.Linear(2, 2)
    fsdp.manual_seed(4)
    local b = nn.Linear(2, 2)
    assert.is_true(same_values(a.weight, b.weight))
  end)

  it("counts fsdp.manual_seed calls in seed_epoch; the engine's manual_seed restarts nothing", function()
    local e = fsdp.seed_epoch()
    fsdp.manual_seed(4)
    assert.are.equal(e + 1, fsdp.seed_epoch())
    assert.are.equal(4, fsdp.seed())
    local a = nn.Linear(2, 2)
    fsdp.core.manual_seed(4)
    local b = nn.Linear(2, 2)
    assert.are.equal(e + 1, fsdp.seed_epoch())
    assert.are.equal("1/weight", nn.init_record(a.weight).key)
    assert.are.equal("2/weight", nn.init_record(b.weight).key)
  end)

  it("does not depend on the stream consumed by randn", function()
    fsdp.manual_seed(2)
    local a = small_gpt()
    fsdp.manual_seed(2)
    fsdp.randn{100}
    local b = small_gpt()
    assert.is_true(same_values(a.blocks[2].mlp.fc.weight, b.blocks[2].mlp.fc.weight))
  end)

  it("follows GPT-2 initialisation in GPT and PyTorch defaults standalone", function()
    fsdp.manual_seed(12)
    local m = nn.GPT{vocab = 64, ctx = 32, d = 32, layers = 3, heads = 4}
    local function expect_normal(path, p, std)
      local e = fsdp.zeros(p:shape())
      fsdp.core.init_normal(e, 12, "1/" .. path, 0, std)
      assert.is_true(same_values(p, e), path)
    end
    expect_normal("wte.weight", m.wte.weight, 0.02)
    expect_normal("wpe.weight", m.wpe.weight, 0.02)
    expect_normal("blocks.1.attn.qkv.weight", m.blocks[1].attn.qkv.weight, 0.02)
    expect_normal("blocks.3.mlp.fc.weight", m.blocks[3].mlp.fc.weight, 0.02)
    local resid = 0.02 / math.sqrt(2 * 3)
    expect_normal("blocks.2.attn.proj.weight", m.blocks[2].attn.proj.weight, resid)
    expect_normal("blocks.3.mlp.proj.weight", m.blocks[3].mlp.proj.weight, resid)
    for _, v in ipairs(flat(m.blocks[1].attn.qkv.bias)) do assert.are.equal(0, v) end
    for _, v in ipairs(flat(m.blocks[2].ln2.weight)) do assert.are.equal(1, v) end
    for _, v in ipairs(flat(m.ln_f.bias)) do assert.are.equal(0, v) end
    -- standalone layers: Linear uniform(+-1/sqrt(in)), Embedding N(0, 1), LayerNorm 1/0
    local l = nn.Linear(16, 200)
    local k = 1 / math.sqrt(16)
    local w = flat(l.weight)
    local lo, hi = math.huge, -math.huge
    for _, v in ipairs(w) do lo, hi = math.min(lo, v), math.max(hi, v) end
    assert.is_true(lo >= -k and hi <= k and lo < -0.9 * k and hi > 0.9 * k)
    local e = flat(nn.Embedding(100, 50).weight)
    local s2 = 0
    for _, v in ipairs(e) do s2 = s2 + v * v end
    assert.is_true(math.abs(math.sqrt(s2 / #e) - 1) < 0.05)
    local ln = nn.LayerNorm(5)
    assert.are.same({1, 1, 1, 1, 1}, ln.weight:totable())
    assert.are.same({0, 0, 0, 0, 0}, ln.bias:totable())
  end)

  it("re-creates the construction values with init_tree and reset_parameters", function()
    fsdp.manual_seed(8)
    local m = small_gpt()
    local saved = {}
    for _, p in ipairs(m:parameters()) do saved[#saved + 1] = p:clone() end
    for _, p in ipairs(m:parameters()) do p:fill(0.5) end
    nn.init_tree(m)
    for i, p in ipairs(m:parameters()) do assert.is_true(same_values(p, saved[i])) end
    m.blocks[1].mlp.proj.weight:fill(3)
    m.blocks[1].mlp.proj:reset_parameters() -- own parameters only, with GPT's spec
    assert.is_true(same_values(m.blocks[1].mlp.proj.weight, saved[13]))
    -- the head does not own the tied weight: resetting it leaves the embedding alone
    m.head:reset_parameters()
    assert.is_true(same_values(m.wte.weight, saved[1]))
  end)

  it("records on a meta model the specs that give the eager model's values", function()
    fsdp.manual_seed(21)
    local eager = small_gpt()
    fsdp.manual_seed(21)
    local prev = nn.set_param_device("meta")
    local ok, meta = pcall(small_gpt)
    nn.set_param_device(prev)
    assert.is_true(ok, meta)
    local eager_params = eager:parameters()
    local n = 0
    for i, p in ipairs(meta:parameters()) do
      assert.are.equal("meta", p.device)
      local r = nn.init_record(p)
      local t = fsdp.zeros(p:shape())
      if r.kind == "normal" then
        fsdp.core.init_normal(t, r.seed, r.key, r.a, r.b)
      elseif r.kind == "uniform" then
        fsdp.core.init_uniform(t, r.seed, r.key, r.a, r.b)
      else
        assert.are.equal("constant", r.kind)
        t:fill(r.a)
      end
      assert.is_true(same_values(t, eager_params[i]), r.key)
      n = n + 1
    end
    assert.are.equal(#eager_params, n)
    assert.is_true(rawequal(meta.head.weight, meta.wte.weight))
    assert.are.equal("cpu", nn.Linear(2, 2).weight.device)
  end)

  it("keeps user-given parameter values in custom modules", function()
    local m = Pair(2)
    assert.are.same({1, 1}, m.scale:totable())
  end)
end)

describe("nn train/eval and dropout", function()
  it("propagates the training flag through the tree", function()
    local m = small_gpt()
    assert.is_true(m.training and m.blocks[2].mlp.training)
    assert.are.equal(m, m:eval())
    assert.is_false(m.training)
    assert.is_false(m.blocks[2].mlp.fc.training)
    m:train()
    assert.is_true(m.blocks[2].attn.training)
  end)

  it("drops in training mode and is the identity in eval mode or with p = 0", function()
    fsdp.manual_seed(1)
    local x = fsdp.ones{1000}
    local d = nn.Dropout(0.5)
    local y = flat(d(x))
    local zeros, twos = 0, 0
    for _, v in ipairs(y) do
      if v == 0 then zeros = zeros + 1 elseif math.abs(v - 2) < 1e-6 then twos = twos + 1 end
    end
    assert.are.equal(1000, zeros + twos)
    assert.is_true(zeros > 400 and zeros < 600)
    d:eval()
    assert.is_true(rawequal(d(x), x))
    assert.is_true(rawequal(nn.Dropout(0)(x), x))
    assert.has_error(function() nn.Dropout(1) end)
  end)

  it("makes GPT with dropout deterministic in eval mode only", function()
    fsdp.manual_seed(3)
    local m = small_gpt{dropout = 0.3}
    local ids = fsdp.tensor{{1, 2, 3}}
    local a, b = m(ids), m(ids)
    assert.is_false(same_values(a, b))
    m:eval()
    assert.is_true(same_values(m(ids), m(ids)))
  end)
end)

describe("nn forward hooks", function()
  it("runs the hooks a call started with when one removes itself; a pre-hook's nil keeps the input", function()
    for _, kind in ipairs {"register_forward_pre_hook", "register_forward_hook"} do
      local l = nn.Linear(2, 2)
      local ran, ha = {}, nil
      ha = l[kind](l, function() ran[#ran + 1] = "A" ha:remove() end)
      l[kind](l, function() ran[#ran + 1] = "B" end)
      l(fsdp.ones{1, 2})
      assert.are.equal("A,B", table.concat(ran, ","), kind)
      l(fsdp.ones{1, 2})
      assert.are.equal("A,B,B", table.concat(ran, ","), kind)
    end
    local l = nn.Linear(2, 2)
    local want = l(fsdp.ones{1, 2}):totable()
    l:register_forward_pre_hook(function() return nil end)
    assert.are.same(want, l(fsdp.ones{1, 2}):totable())
  end)

  it("runs pre and post hooks around forward until removed", function()
    local l = nn.Linear(2, 3)
    local log = {}
    local h1 = l:register_forward_pre_hook(function(m, x)
      log[#log + 1] = {"pre", rawequal(m, l), x:shape()[2]}
    end)
    local h2 = l:register_forward_hook(function(m, out)
      log[#log + 1] = {"post", rawequal(m, l), out:shape()[2]}
    end)
    l(fsdp.zeros{1, 2})
    assert.are.same({{"pre", true, 2}, {"post", true, 3}}, log)
    h1.remove()
    h2.remove()
    l(fsdp.zeros{1, 2})
    assert.are.equal(2, #log)
  end)
end)

describe("nn releases its intermediates", function()
  local function act() return fsdp.memory().activations end
  local ids = fsdp.tensor{{1, 2, 3, 4}, {5, 6, 7, 8}}

  it("leaves nothing of a forward and backward but the values the caller holds", function()
    local m = small_gpt()
    fsdp.no_grad(function() m(ids) end) -- the positions cache
    collectgarbage()
    fsdp.core.tape_clear() -- graphs earlier tests left (a backward would consume them)
    local before = act()
    local logits = m(ids)
    local loss = F.cross_entropy(logits, ids)
    loss:backward()
    assert.are.equal(before + logits:numel() * 4 + 4, act())
    logits:free()
    loss:free()
    assert.are.equal(before, act())
    -- no_grad: the intermediates go as the forward passes them
    local out = fsdp.no_grad(function() return m(ids) end)
    assert.are.equal(before + out:numel() * 4, act())
  end)

  it("gives the same values as the layers applied by hand", function()
    local m = small_gpt()
    local got = m(ids)
    local x = m.wte(ids) + m.wpe(fsdp.arange(4, {dtype = "i64"}))
    for i = 1, #m.blocks do
      local b = m.blocks[i]
      x = x + b.attn.proj(F.attention(b.attn.qkv(b.ln1(x)), b.attn.heads))
      x = x + b.mlp.proj(F.gelu(b.mlp.fc(b.ln2(x))))
    end
    assert.is_true(same_values(m.head(m.ln_f(x)), got))
  end)

  it("never frees a tensor a user hook or a user module was handed", function()
    local m = small_gpt()
    local kept = {}
    m.blocks[1].mlp.fc:register_forward_hook(function(_, out) kept.fc_out = out end)
    m.blocks[1].ln2:register_forward_pre_hook(function(_, x) kept.ln2_in = x end)
    m.blocks[2].attn:register_forward_hook(function(_, out) kept.attn_out = out end)
    local Keep = nn.Module:extend("Keep")
    function Keep:init(d) self.fc = nn.Linear(d, d) end
    function Keep:forward(x)
      kept.keep_in = x
      kept.keep_out = self.fc(x)
      return kept.keep_out
    end
    m.blocks[2].mlp = Keep(8)
    local loss = F.cross_entropy(m(ids), ids)
    loss:backward()
    for name, t in pairs(kept) do
      assert.is_true(fsdp.core.is_tensor(t), name .. " was freed")
      assert.are.same({2, 4, name == "fc_out" and 32 or 8}, t:shape())
      assert.is_true(t:sum():item() == t:sum():item(), name) -- readable
    end
  end)

  it("keeps what a user hook saw only while the hook is registered", function()
    local mlp = nn.MLP(8, 32)
    local x = fsdp.randn{4, 8}
    local function held() -- bytes a no_grad forward leaves besides its input and output
      collectgarbage()
      local before = act()
      local out = fsdp.no_grad(function() return mlp(x) end)
      local extra = act() - before - out:numel() * 4
      out:free()
      return extra
    end
    assert.are.equal(0, held())
    local h = mlp.fc:register_forward_hook(function() end)
    assert.are.equal(4 * 32 * 4, held()) -- fc's output, which the hook saw
    h.remove()
    h.remove() -- idempotent: the count of user hooks drops once
    assert.are.equal(0, held())
  end)
end)

describe("nn errors", function()
  it("prefixes the path of the failing submodule, once", function()
    local m = small_gpt()
    m.blocks[2].mlp.fc = nn.Linear(9, 32) -- wrong input width
    local ok, err = pcall(m, fsdp.tensor{{1, 2, 3}})
    assert.is_false(ok)
    assert.truthy(err:find("^blocks%.2%.mlp%.fc %(Linear%): linear: [^\n]*%(32, 9%)"), err)
    local _, n = err:gsub("%(Linear%)", "")
    assert.are.equal(1, n)
    assert.is_nil(err:find("blocks.2.mlp.fc (Linear): blocks", 1, true))
    -- the call stack is reset: a later error reports its own path
    local ok2, err2 = pcall(m.blocks[1], fsdp.zeros{1, 3, 7})
    assert.is_false(ok2)
    assert.truthy(err2:find("^ln1 %(LayerNorm%): "), err2)
    -- and a good call still works
    assert.are.same({1, 3, 8}, m.blocks[1](fsdp.zeros{1, 3, 8}):shape())
  end)

  it("keeps the location of an error raised in a custom forward", function()
    local Boom = nn.Module:extend("Boom")
    function Boom:forward() error("boom") end
    local Outer = nn.Module:extend("Outer")
    function Outer:init() self.inner = nn.Sequential{nn.ReLU(), Boom()} end
    function Outer:forward(x) return self.inner(x) end
    local ok, err = pcall(Outer(), fsdp.zeros{2})
    assert.is_false(ok)
    assert.truthy(err:find("^inner%.2 %(Boom%): .*nn_spec%.lua:%d+: boom$"), err)
  end)

  it("adds the user's location to an engine error raised in a custom forward", function()
    local Bad = nn.Module:extend("Bad")
    function Bad:forward(x)
      local y = x:matmul(fsdp.zeros{5, 2}) -- (2, 3) x (5, 2)
      return y
    end
    local Holder = nn.Module:extend("Holder")
    function Holder:init() self.bad = Bad() end
    function Holder:forward(x) return self.bad(x) end
    local ok, err = pcall(Holder(), fsdp.zeros{2, 3})
    assert.is_false(ok)
    assert.truthy(err:find("^bad %(Bad%): [^\n]*nn_spec%.lua:%d+: matmul"), err)
    -- a tail call leaves no user frame: no library location either
    function Bad:forward(x) return x:matmul(fsdp.zeros{5, 2}) end
    ok, err = pcall(Holder(), fsdp.zeros{2, 3})
    assert.is_false(ok)
    assert.truthy(err:find("^bad %(Bad%): matmul"), err)
  end)

  -- A module whose forward runs `try` (a function of the module and x that may raise, and that
  -- the forward catches), then its Linear child fc (4 -> 3): with a 5-wide x, fc fails.
  local Try = nn.Module:extend("Try")
  function Try:init(try) self.try, self.fc = try, nn.Linear(4, 3) end
  function Try:forward(x)
    local ok, e = pcall(self.try, self, x)
    self.caught = not ok and e or nil
    return self.fc(x)
  end
  local Boom = nn.Module:extend("Boom")
  function Boom:forward() error("boom", 0) end
  local Wrap = nn.Module:extend("Wrap") -- inner = the module given
  function Wrap:init(inner) self.inner = inner end
  function Wrap:forward(x) return self.inner(x) end

  -- m = Wrap(Wrap(t)), t a Try running `try` with t.bad = Wrap(Boom()): the forward caught
  -- `caught` (the message it got), and the later error of t.fc has its own path
  local function check_later_error(try, caught)
    local t = Try(try)
    t.bad = Wrap(Boom())
    local m = Wrap(Wrap(t))
    for _ = 1, 2 do -- and again in a new call
      local ok, err = pcall(m, fsdp.zeros{2, 5})
      assert.is_false(ok)
      assert.are.equal(caught, t.caught)
      assert.truthy(err:find("^inner%.inner%.fc %(Linear%): linear: input %(2, 5%)"), err)
    end
    assert.are.same({2, 3}, m(fsdp.zeros{2, 4}):shape()) -- and a good call works
  end

  it("keeps the path of a later error after an error a forward caught", function()
    local BOOM = "inner.inner.bad.inner (Boom): boom" -- the path within the outermost call
    check_later_error(function(self, x) return self.bad(x) end, BOOM)
    -- caught two levels down, under a pcall inside a pcall, and raised again as it was
    check_later_error(function(self, x)
      local ok, e = pcall(self.bad, x)
      error(e, 0)
    end, BOOM)
    -- raised again after other module calls: it keeps the path of its error point
    check_later_error(function(self, x)
      local ok, e = pcall(self.bad, x)
      self.fc(fsdp.zeros{2, 4})
      error(e, 0)
    end, BOOM)
    -- caught inside a module that raises it out of its own forward after catching another
    -- error: the first keeps its one prefix
    local Msg = nn.Module:extend("Msg")
    function Msg:init(msg) self.msg = msg end
    function Msg:forward() error(self.msg, 0) end
    local Either = nn.Module:extend("Either") -- tries a, then b; raises a's error
    function Either:init() self.a, self.b = Msg("a failed"), Msg("b failed") end
    function Either:forward(x)
      local _, ea = pcall(self.a, x)
      local _, eb = pcall(self.b, x)
      assert.are.equal("e.b (Msg): b failed", eb)
      error(ea, 0)
    end
    local Top = nn.Module:extend("Top")
    function Top:init() self.e = Either() end
    function Top:forward(x) return self.e(x) end
    local ok, err = pcall(Top(), fsdp.zeros{2})
    assert.is_false(ok)
    assert.are.equal("e.a (Msg): a failed", err)
  end)

  it("keeps the path of a later error after a hook's error a forward caught", function()
    check_later_error(function(self, x)
      local h = self.bad:register_forward_pre_hook(function() error("boom in pre-hook", 0) end)
      local ok, e = pcall(self.bad, x)
      h.remove()
      error(e, 0)
    end, "inner.inner.bad (Wrap): boom in pre-hook")
    check_later_error(function(self, x)
      local boom = self.bad
      self.bad = Wrap(nn.ReLU())
      local h = self.bad.inner:register_forward_hook(function() error("boom in hook", 0) end)
      local ok, e = pcall(self.bad, x)
      h.remove()
      self.bad = boom
      error(e, 0)
    end, "inner.inner.bad.inner (ReLU): boom in hook")
  end)

  it("keeps the path of a later error after a module call in a coroutine failed", function()
    -- the coroutine's calls are nested ones: their path starts at its first module call
    check_later_error(function(self, x)
      local co = coroutine.create(function() return self.bad(x) end)
      local ok, e = coroutine.resume(co)
      assert(not ok)
      error(e, 0)
    end, "inner (Boom): boom")
    check_later_error(function(self, x)
      return coroutine.wrap(function() return self.bad(x) end)()
    end, "inner (Boom): boom")
  end)

  it("names the module whose hook raised", function()
    local m = Wrap(Wrap(nn.ReLU()))
    local h = m.inner.inner:register_forward_pre_hook(function() error("no", 0) end)
    local ok, err = pcall(m, fsdp.zeros{2})
    assert.is_false(ok)
    assert.are.equal("inner.inner (ReLU): no", err)
    h.remove()
    h = m.inner:register_forward_hook(function() error("late", 0) end)
    ok, err = pcall(m, fsdp.zeros{2})
    assert.are.equal("inner (Wrap): late", err)
    h.remove()
    h = m:register_forward_pre_hook(function() error("first", 0) end)
    ok, err = pcall(m, fsdp.zeros{2})
    assert.are.equal("Wrap: first", err)
    h.remove()
    assert.are.same({2}, m(fsdp.zeros{2}):shape())
  end)

  it("keeps the paths right around a coroutine that yields inside a forward", function()
    local Yield = nn.Module:extend("Yield")
    function Yield:forward(x) coroutine.yield() return x end
    local y = Wrap(Wrap(Yield()))
    local lin = Wrap(nn.Linear(4, 3))
    local function lin_error()
      local ok, err = pcall(lin, fsdp.zeros{2, 5})
      assert.is_false(ok)
      assert.truthy(err:find("^inner %(Linear%): linear: "), err)
    end
    local co = coroutine.wrap(function(x) return y(x) end)
    co(fsdp.zeros{2}) -- suspended inside y.inner.inner
    assert.are.same({2, 3}, lin(fsdp.zeros{2, 4}):shape()) -- calls meanwhile run
    lin_error() -- and their errors have their path
    assert.are.same({2}, co():shape()) -- the coroutine's call returns
    lin_error()
    -- a call made in a coroutine is an outermost call there
    coroutine.wrap(lin_error)()
    -- a coroutine left suspended inside a call changes nothing either
    coroutine.wrap(function(x) return y(x) end)(fsdp.zeros{2})
    lin_error()
    local ok, err = pcall(y, fsdp.zeros{2}) -- yields outside a coroutine
    assert.is_false(ok)
    assert.truthy(err:find("^inner%.inner %(Yield%): .*yield"), err)
  end)

  it("prefixes a message once, also when a forward raises a caught error again", function()
    local t = Try(function(self, x) return self.bad(x) end)
    t.bad = Boom()
    function t.forward(self, x) -- raises what it caught
      local ok, e = pcall(self.bad, x)
      error(e, 0)
    end
    local ok, err = pcall(Wrap(t), fsdp.zeros{2})
    assert.is_false(ok)
    assert.are.equal("inner.bad (Boom): boom", err)
    -- an error made by an earlier call, raised again inside another call, is kept as it was
    local Again = nn.Module:extend("Again")
    function Again:forward() error(err, 0) end
    local ok2, err2 = pcall(Wrap(Again()), fsdp.zeros{2})
    assert.is_false(ok2)
    assert.are.equal(err, err2)
  end)

  it("passes error values that are not strings through unchanged", function()
    local obj, ten = {what = "boom"}, fsdp.zeros{3}
    local Raise = nn.Module:extend("Raise")
    function Raise:forward(x) error(self.value, 0) end -- level 0: Lua makes no string of 42
    local r = Raise()
    local m = Wrap(Wrap(r))
    for _, v in ipairs{obj, ten, 42, true} do
      r.value = v
      local ok, err = pcall(m, fsdp.zeros{2})
      assert.is_false(ok)
      assert.is_true(rawequal(v, err), tostring(err))
    end
    -- and a string error afterwards still gets its path
    r.value = "plain"
    local ok, err = pcall(m, fsdp.zeros{2})
    assert.is_false(ok)
    assert.are.equal("inner.inner (Raise): plain", err)
  end)

  it("names both lengths when a sequence is longer than the context", function()
    local m = small_gpt()
    local ok, err = pcall(m, fsdp.zeros{1, 9})
    assert.is_false(ok)
    assert.truthy(err:find("T=9", 1, true), err)
    assert.truthy(err:find("ctx=8", 1, true), err)
  end)

  it("rejects bad constructor arguments with the caller's location", function()
    local ok, err = pcall(nn.Linear, 0, 3)
    assert.is_false(ok)
    assert.truthy(err:find("in_features"), err)
    ok, err = pcall(nn.CausalSelfAttention, 10, 3)
    assert.is_false(ok)
    assert.truthy(err:find("multiple of heads"), err)
    assert.has_error(function() nn.GPT{vocab = 10} end)
  end)

  it("refuses sizes that are infinite, too large or not numbers, and NaN options", function()
    local err = H.assert_error_has
    local cfg = {vocab = 10, ctx = 4, d = 8, layers = 1, heads = 2}
    local function gpt(k, v)
      local c = {}
      for key, x in pairs(cfg) do c[key] = x end
      c[k] = v
      return function() return nn.GPT(c) end
    end
    err(gpt("layers", math.huge), "nn.GPT: layers must be an integer >= 0 (got inf)")
    err(gpt("layers", 0 / 0), "nn.GPT: layers must be an integer >= 0 (got nan)")
    err(gpt("vocab", 2 ^ 60), "nn.GPT: vocab must be an integer in [1, 2^53] (got 1.1529215046068e+18)")
    err(gpt("d", "8"), 'nn.GPT: d must be an integer >= 1 (got the string "8")')
    err(gpt("dropout", 0 / 0), "nn.GPT: dropout must be a number in [0, 1) (got nan)")
    err(function() nn.Linear(math.huge, 3) end, "nn.Linear: in_features must be an integer >= 1 (got inf)")
    err(function() nn.Linear("2", 3) end, 'nn.Linear: in_features must be an integer >= 1 (got the string "2")')
    err(function() nn.Linear(2, {}) end, "nn.Linear: out_features must be an integer >= 1 (got a table)")
    err(function() nn.Embedding(4, -math.huge) end, "nn.Embedding: embedding_dim must be an integer >= 1 (got -inf)")
    err(function() nn.LoRA(8, 8, {rank = math.huge}) end, "nn.LoRA: rank must be an integer >= 1 (got inf)")
    err(function() nn.Dropout(0 / 0) end, "nn.Dropout: dropout p must be a number in [0, 1) (got nan)")
    err(function() nn.MLP(8, nil, {dropout = 0 / 0}) end, "nn.MLP: dropout p must be a number in [0, 1) (got nan)")
  end)

  it("keeps integer and bool parameters without a gradient: saved, skipped by optimizers", function()
    for _, dt in ipairs{"i64", "bool"} do
      local p = nn.Parameter(fsdp.ones({2}, {dtype = dt}))
      assert.is_true(p.is_param)
      assert.is_false(p.requires_grad, dt)
      H.assert_error_has(function() p.requires_grad = true end,
        "requires_grad: only float tensors can require a gradient (this one is " .. dt .. ")")
    end
    for _, dt in ipairs{"f32", "bf16", "f16", "f64"} do
      assert.is_true(nn.Parameter(fsdp.ones({2}, {dtype = dt})).requires_grad, dt)
    end
    local N = nn.Module:extend("WithIds")
    function N:init()
      self.fc = nn.Linear(2, 2)
      self.ids = nn.Parameter(fsdp.tensor({3, 2 ^ 40}, {dtype = "i64"}))
    end
    function N:forward(x) return self.fc(x) end
    local m = N()
    m:freeze():unfreeze() -- unfreeze leaves the integer parameter alone
    assert.is_true(m.fc.weight.requires_grad)
    assert.is_false(m.ids.requires_grad)
    m:to("bf16") -- converts the float parameters only
    assert.are.equal("bf16", m.fc.weight:dtype())
    assert.are.equal("i64", m.ids:dtype())
    m:to("f32")
    local opt = fsdp.optim.AdamW(m, {lr = 0.1, max_grad_norm = 1})
    m(fsdp.ones{1, 2}):sum():backward()
    opt:step()
    assert.are.same({3, 2 ^ 40}, m.ids:totable())
    H.assert_error_has(function() m:to("i64") end,
      "to: parameters take a float dtype (f32, bf16, f16, f64), not i64")
    H.assert_error_has(function() fsdp.core.param_to(m.fc.weight, "cpu", "i64") end,
      "to: the f32 parameter (2, 2): parameters take a float dtype, not i64")
  end)

  it("F.layernorm and F.add_layernorm refuse an eps that is not > 0, as nn.LayerNorm does", function()
    local x, w = fsdp.tensor{{1, 2, 3, 4}}, fsdp.ones{4}
    for _, eps in ipairs{0, -2, 0 / 0} do
      H.assert_error_has(function() F.layernorm(x, w, nil, eps) end,
        "layernorm: eps must be a number > 0, got " .. tostring(eps))
      H.assert_error_has(function() F.add_layernorm(x, x, w, nil, eps) end,
        "add_layernorm: eps must be a number > 0, got " .. tostring(eps))
    end
    assert_close(F.layernorm(x, w, nil, 1e-5), F.layernorm(x, w), 0, "eps 1e-5 is the default")
  end)
end)

describe("nn layer forwards", function()
  it("Linear computes x W^T + b", function()
    local l = nn.Linear(3, 2)
    l.weight:copy(fsdp.tensor{{1, 2, 3}, {-1, 0.5, 2}})
    l.bias:copy(fsdp.tensor{0.5, -1})
    local x = fsdp.tensor{{1, 0, -1}, {2, 1, 0.5}}
    local expect = {{1 - 3 + 0.5, -1 - 2 - 1}, {2 + 2 + 1.5 + 0.5, -2 + 0.5 + 1 - 1}}
    assert_close(l(x), expect, 1e-6, "linear")
    local nb = nn.Linear(3, 2, {bias = false})
    assert.is_nil(nb.bias)
    nb.weight:copy(l.weight)
    assert_close(nb(x), {{-2, -3}, {5.5, -0.5}}, 1e-6, "linear without bias")
    -- leading dimensions are kept
    assert.are.same({2, 5, 2}, l(fsdp.zeros{2, 5, 3}):shape())
  end)

  it("Embedding looks rows up by 0-based id", function()
    local e = nn.Embedding(4, 2)
    e.weight:copy(fsdp.tensor{{0, 1}, {10, 11}, {20, 21}, {30, 31}})
    assert_close(e(fsdp.tensor{{3, 0}, {1, 1}}), {{{30, 31}, {0, 1}}, {{10, 11}, {10, 11}}}, 0, "emb")
  end)

  it("LayerNorm normalises over the last dimension", function()
    local ln = nn.LayerNorm(4)
    ln.weight:copy(fsdp.tensor{1, 2, 0.5, 1})
    ln.bias:copy(fsdp.tensor{0, 1, 0, -1})
    local rows = {{1, 2, 3, 4}, {-2, 0, 2, 10}}
    local expect = {}
    for r, row in ipairs(rows) do
      local mean, var = 0, 0
      for _, v in ipairs(row) do mean = mean + v / 4 end
      for _, v in ipairs(row) do var = var + (v - mean) ^ 2 / 4 end
      local w, b = {1, 2, 0.5, 1}, {0, 1, 0, -1}
      expect[r] = {}
      for i, v in ipairs(row) do
        expect[r][i] = (v - mean) / math.sqrt(var + 1e-5) * w[i] + b[i]
      end
    end
    assert_close(ln(fsdp.tensor(rows)), expect, 1e-5, "layernorm")
  end)

  it("ReLU and GELU match their formulas", function()
    local x = {-2, -0.5, 0, 0.7, 3}
    local r, g = {}, {}
    for i, v in ipairs(x) do
      r[i] = math.max(v, 0)
      local c = math.sqrt(2 / math.pi)
      local u = c * (v + 0.044715 * v ^ 3)
      local th = (math.exp(u) - math.exp(-u)) / (math.exp(u) + math.exp(-u))
      g[i] = 0.5 * v * (1 + th)
    end
    assert_close(nn.ReLU()(fsdp.tensor(x)), r, 1e-6, "relu")
    assert_close(nn.GELU()(fsdp.tensor(x)), g, 1e-5, "gelu")
  end)

  it("Sequential feeds each output to the next module", function()
    local s = nn.Sequential{nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)}
    s[1].weight:copy(fsdp.tensor{{1, 0}, {0, -1}})
    s[1].bias:copy(fsdp.tensor{0, 0})
    s[3].weight:copy(fsdp.tensor{{2, 3}})
    s[3].bias:copy(fsdp.tensor{1})
    -- x = (1, 2): h = relu(1, -2) = (1, 0); y = 2 + 1 = 3
    assert_close(s(fsdp.tensor{{1, 2}}), {{3}}, 1e-6, "sequential")
  end)

  it("Block is x + attn(ln1(x)), then + mlp(ln2(.))", function()
    fsdp.manual_seed(2)
    local b = nn.Block(8, 2)
    b.ln1.weight:fill(0.5)
    b.ln2.weight:fill(2) -- distinct norms, so that swapping them shows
    b.ln2.bias:fill(0.1)
    local x = fsdp.randn{2, 3, 8}
    local h = x + b.attn.proj(F.attention(b.attn.qkv(b.ln1(x)), 2))
    local expect = h + b.mlp.proj(F.gelu(b.mlp.fc(b.ln2(h))))
    assert_close(b(x), expect, 1e-5, "block")
  end)

  it("Block and CausalSelfAttention keep the shape and are causal", function()
    fsdp.manual_seed(2)
    local b = nn.Block(8, 2)
    local x = fsdp.randn{1, 5, 8}
    local y = b(x)
    assert.are.same({1, 5, 8}, y:shape())
    -- changing the last position leaves the earlier outputs unchanged
    local x2 = x:clone()
    x2:set(1, 5, 1, 7)
    local y2 = b(x2)
    assert_close(y:narrow(2, 1, 4), y2:narrow(2, 1, 4), 1e-6, "causal prefix")
    assert.is_false(same_values(y:narrow(2, 5, 1), y2:narrow(2, 5, 1)))
  end)

  it("nn.F losses match hand computation and re-export fsdp.F", function()
    local logits = {{1, 2, 0.5}, {0, -1, 3}}
    local targets = {1, 2}
    local loss = 0
    for r, row in ipairs(logits) do
      local z = 0
      for _, v in ipairs(row) do z = z + math.exp(v) end
      loss = loss + (math.log(z) - row[targets[r] + 1]) / 2
    end
    assert_close(F.cross_entropy(fsdp.tensor(logits), fsdp.tensor(targets)):item(), loss, 1e-6, "ce")
    assert_close(F.mse(fsdp.tensor{1, 2, 3}, fsdp.tensor{1, 0, 0}):item(), (4 + 9) / 3, 1e-6, "mse")
    assert.are.equal(fsdp.F.linear, F.linear)
    assert.are.equal(fsdp.F.attention, F.attention)
  end)
end)

describe("nn GPT", function()
  it("maps ids (B, T) to logits (B, T, vocab)", function()
    local m = small_gpt()
    assert.are.same({3, 4, 11}, m(fsdp.zeros{3, 4}):shape())
    assert.are.same({1, 8, 11}, m(fsdp.zeros{1, 8}):shape())
  end)

  it("composes token and position embeddings, blocks, ln_f and the head", function()
    fsdp.manual_seed(6)
    local m = small_gpt()
    local ids = fsdp.tensor{{3, 1, 4, 1, 5}, {9, 2, 6, 5, 3}}
    local x = m.wte(ids) + m.wpe(fsdp.tensor{0, 1, 2, 3, 4})
    for i = 1, #m.blocks do x = m.blocks[i](x) end
    local expect = F.linear(m.ln_f(x), m.wte.weight, nil)
    assert_close(m(ids), expect, 1e-5, "logits")
  end)

  it("generates reproducibly, in eval mode, without recording", function()
    fsdp.manual_seed(4)
    local m = small_gpt{dropout = 0.1}
    local out = m:generate({1, 2, 3}, {max_new_tokens = 12, seed = 99, top_k = 5})
    assert.are.equal(15, #out)
    assert.are.same({1, 2, 3}, {out[1], out[2], out[3]})
    for _, id in ipairs(out) do assert.is_true(id >= 0 and id < 11 and id % 1 == 0) end
    assert.are.same(out, m:generate(fsdp.tensor{{1, 2, 3}}, {max_new_tokens = 12, seed = 99, top_k = 5}))
    assert.is_true(m.training) -- restored
    -- greedy = top_k 1 = the argmax of the last logits
    local greedy = m:generate({4}, {max_new_tokens = 1, temperature = 0})
    m:eval()
    local last = m(fsdp.tensor{{4}}):totable()[1][1]
    local best = 1
    for i = 2, #last do if last[i] > last[best] then best = i end end
    assert.are.equal(best - 1, greedy[2])
    assert.are.same(greedy, m:generate({4}, {max_new_tokens = 1, top_k = 1, seed = 1}))
  end)

  it("samples from the softmax distribution", function()
    local draw = nn.GPT.draw
    local logits = {math.log(1), math.log(3)} -- p = 0.25, 0.75
    assert.are.equal(0, draw(logits, 1, nil, 0.2))
    assert.are.equal(1, draw(logits, 1, nil, 0.3))
    assert.are.equal(1, draw(logits, 1, 1, 0.0)) -- top_k 1 keeps only the best
    assert.are.equal(1, draw(logits, 0, nil, 0.0)) -- greedy
  end)
end)

describe("nn training", function()
  it("trains a small MLP regression (loss falls by 10x)", function()
    fsdp.manual_seed(1)
    local n = 64
    local xs, ys = {}, {}
    for i = 1, n do
      local a, b = (i % 8) / 4 - 1, math.floor((i - 1) / 8) / 4 - 1
      xs[i] = {a, b}
      ys[i] = {a * b + 0.5 * a}
    end
    local x, y = fsdp.tensor(xs), fsdp.tensor(ys)
    local model = nn.Sequential{nn.Linear(2, 32), nn.GELU(), nn.Linear(32, 1)}
    local opt = fsdp.optim.AdamW(model, {lr = 0.01, weight_decay = 0})
    local first, last
    for step = 1, 300 do
      opt:zero_grad()
      local loss = F.mse(model(x), y)
      loss:backward()
      opt:step()
      if step == 1 then first = loss:item() end
      last = loss:item()
    end
    assert.is_true(last < first / 10, ("loss %g -> %g"):format(first, last))
  end)

  it("overfits a tiny tied GPT with AdamW, clipping and a cosine schedule", function()
    fsdp.manual_seed(3)
    local m = nn.GPT{vocab = 11, ctx = 8, d = 16, layers = 1, heads = 2}
    local x = fsdp.tensor{{1, 2, 3, 4, 5, 6, 7, 8}, {8, 7, 6, 5, 4, 3, 2, 1}}
    local y = fsdp.tensor{{2, 3, 4, 5, 6, 7, 8, 9}, {7, 6, 5, 4, 3, 2, 1, 0}}
    local opt = fsdp.optim.AdamW(m, {lr = 0.02})
    local sched = fsdp.optim.cosine(opt, {warmup = 5, total = 80})
    local first, last
    for step = 1, 80 do
      sched:step()
      opt:zero_grad()
      local loss = F.cross_entropy(m(x), y)
      loss:backward()
      fsdp.clip_grad_norm(m, 1.0)
      opt:step()
      if step == 1 then first = loss:item() end
      last = loss:item()
    end
    assert.is_true(last < first / 5, ("loss %g -> %g"):format(first, last))
    assert.are.same({1, 2, 3, 4, 5, 6, 7, 8, 9}, m:generate({1}, {max_new_tokens = 8, temperature = 0}))
  end)
end)

describe("adoption by a container", function()
  it("re-initialises a fresh module by its final path but keeps a trained one", function()
    fsdp.manual_seed(3)
    local fresh = nn.Linear(4, 4)
    local trained = nn.Linear(4, 4)
    local opt = fsdp.optim.SGD(trained, { lr = 0.5 })
    trained(fsdp.ones { 2, 4 }):sum():backward()
    opt:step()
    local trained_values = trained.weight:totable()
    local fresh_values = fresh.weight:totable()
    local seq = nn.Sequential { fresh, trained }
    -- the fresh child now holds the values of its final path, so they changed ...
    assert.are_not.same(fresh_values, seq[1].weight:totable())
    -- ... and the trained child kept what training gave it
    assert.are.same(trained_values, seq[2].weight:totable())
    -- an explicit reset_parameters still resets the trained one
    seq[2]:reset_parameters()
    assert.are_not.same(trained_values, seq[2].weight:totable())
  end)

  it("keeps values written through a view or detach() of a parameter", function()
    local writes = {
      direct = function(w) w:fill(7) end,
      detach = function(w) w:detach():fill(7) end,
      view = function(w) w:view { 16 }:fill(7) end,
      narrow = function(w) w:detach():narrow(1, 1, 1):fill(7) end,
    }
    for name, write in pairs(writes) do
      fsdp.manual_seed(3)
      local lin = nn.Linear(4, 4)
      write(lin.weight)
      local written = lin.weight:totable()
      local seq = nn.Sequential { lin, nn.Linear(4, 4) }
      assert.are.same(written, seq[1].weight:totable(), name)
      assert.are.equal(7, seq[1].weight:totable()[1][1], name)
    end
    -- the memory's stamp: a write through any tensor over it moves its version
    local w = fsdp.zeros { 2, 2 }
    local id, v = fsdp.core.memory_stamp(w)
    w:detach():fill(1)
    local id2, v2 = fsdp.core.memory_stamp(w)
    assert.are.equal(id, id2)
    assert.is_true(v2 > v)
    assert.are.equal(0, w.version)
    assert.are_not.equal(id, (fsdp.core.memory_stamp(w:clone())))
  end)
end)

describe("nn.MLP's fused bias and GELU", function()
  it("gives the unfused call's values and gradients; a hook on fc takes the usual call", function()
    local function run(hooked)
      fsdp.manual_seed(3)
      local mlp = nn.MLP(8, 24)
      local calls = 0
      if hooked then mlp.fc:register_forward_hook(function() calls = calls + 1 end) end
      local x = fsdp.randn{2, 5, 8}
      local y = mlp(x)
      local w = fsdp.randn{2, 5, 8}
      F.mse(y * w, fsdp.zeros{2, 5, 8}):backward()
      return y, mlp, calls
    end
    local y1, m1, c1 = run(false)
    local y2, m2, c2 = run(true)
    assert.are.equal(0, c1)
    assert.are.equal(1, c2)
    assert_close(y1, y2, 1e-6, "output")
    for _, k in ipairs{"weight", "bias"} do
      assert_close(m1.fc[k].grad, m2.fc[k].grad, 1e-6, "fc." .. k .. " grad")
      assert_close(m1.proj[k].grad, m2.proj[k].grad, 1e-6, "proj." .. k .. " grad")
    end
  end)
end)
