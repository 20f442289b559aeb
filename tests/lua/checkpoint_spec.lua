-- checkpoint_spec.lua — activation checkpointing of a plain model (nn.checkpoint): the loss,
-- every gradient and the random numbers drawn afterwards are bitwise those of the run without
-- it (with and without dropout, nested, with non-tensor arguments, with an identity forward);
-- activation memory drops; no node under no_grad; the errors (not a module, a ModuleList, bad
-- options, a forward that does not return one tensor, an input modified before backward, a
-- recomputation that differs or fails, core.checkpoint's own refusals).
-- Run: busted --lua=luajit tests/lua/checkpoint_spec.lua

local fsdp = require "fsdp"
local nn = fsdp.nn
local core = fsdp.core

local H = require "helpers"
local assert_error_has = H.assert_error_has

local CFG = {vocab = 32, ctx = 8, d = 16, layers = 3, heads = 2}

local function gpt(over)
  fsdp.manual_seed(7)
  local c = {}
  for k, v in pairs(CFG) do c[k] = v end
  for k, v in pairs(over or {}) do c[k] = v end
  return nn.GPT(c)
end

local function batch()
  local x, y = {}, {}
  for i = 1, 4 do
    x[i], y[i] = {}, {}
    for t = 1, CFG.ctx do
      x[i][t] = (i * 5 + t * 3) % 32
      y[i][t] = (x[i][t] * 7 + 1) % 32
    end
  end
  return fsdp.tensor(x, {dtype = "i64"}), fsdp.tensor(y, {dtype = "i64"})
end

-- Everything a step computes, as exact text: the loss, every gradient, the next random draws.
local function step_bits(model)
  local x, y = batch()
  fsdp.manual_seed(11) -- the same dropout masks for every model
  model:zero_grad()
  local loss = nn.F.cross_entropy(model(x), y)
  loss:backward()
  assert.are.equal(0, core.tape_size())
  local out = {("loss %a"):format(loss:item())}
  for path, p in model:named_parameters() do
    assert.is_not_nil(p.grad, path .. " has no gradient")
    local vals = {}
    for k, v in ipairs(p.grad:contiguous():view{p:numel()}:totable()) do vals[k] = ("%a"):format(v) end
    out[#out + 1] = path .. " " .. table.concat(vals, " ")
  end
  for k, v in ipairs(fsdp.randn{5}:totable()) do out[#out + 1] = ("rand%d %a"):format(k, v) end
  return table.concat(out, "\n")
end

local function same_bits(a, b)
  if a == b then return end
  local la, lb = {}, {}
  for l in a:gmatch("[^\n]+") do la[#la + 1] = l end
  for l in b:gmatch("[^\n]+") do lb[#lb + 1] = l end
  for i = 1, math.max(#la, #lb) do
    if la[i] ~= lb[i] then
      error(("first difference at line %d:\n  %s\n  %s"):format(i, tostring(la[i]):sub(1, 120),
        tostring(lb[i]):sub(1, 120)), 2)
    end
  end
end

local function checkpoint_blocks(m)
  for i = 1, #m.blocks do nn.checkpoint(m.blocks[i]) end
  return m
end

describe("nn.checkpoint", function()
  before_each(function() core.tape_clear() end)

  it("gives the bits of the run without it, with dropout, and draws the same numbers after", function()
    for _, dropout in ipairs{0, 0.2} do
      local plain = step_bits(gpt{dropout = dropout})
      local ck = step_bits(checkpoint_blocks(gpt{dropout = dropout}))
      same_bits(plain, ck)
    end
  end)

  it("checkpoints inner modules, nested ones and the whole model alike", function()
    local plain = step_bits(gpt{dropout = 0.1})
    local m = gpt{dropout = 0.1}
    for i = 1, #m.blocks do
      nn.checkpoint(m.blocks[i].mlp)
      nn.checkpoint(m.blocks[i].attn)
    end
    same_bits(plain, step_bits(m))
    checkpoint_blocks(m) -- blocks around checkpointed attn and mlp: nested
    same_bits(plain, step_bits(m))
    nn.checkpoint(m) -- the root too: everything recomputed at once
    same_bits(plain, step_bits(m))
  end)

  it("records one node per checkpointed module and saves fewer activations", function()
    local x = batch()
    local m = gpt()
    local logits = m(x)
    local plain_nodes = core.tape_size()
    logits = nil
    core.tape_clear()
    checkpoint_blocks(m)
    logits = m(x)
    local ck_nodes = core.tape_size()
    assert.is_true(ck_nodes < plain_nodes - 2 * CFG.layers,
      ("%d nodes with checkpointing, %d without"):format(ck_nodes, plain_nodes))
    logits = nil
    core.tape_clear()
    -- activation memory of a whole step, deterministic counters
    local function peak(model)
      collectgarbage()
      core.reset_peak()
      local before = core.memory().cpu.activations or 0
      step_bits(model)
      return (core.memory().cpu.peak_activations or 0) - before
    end
    local d = {d = 64, ctx = 32, vocab = 64, layers = 4, heads = 4}
    local without = peak(gpt(d))
    local with = peak(checkpoint_blocks(gpt(d)))
    assert.is_true(with < 0.75 * without,
      ("peak activations %d bytes with checkpointing, %d without"):format(with, without))
  end)

  it("records nothing under no_grad and in eval forwards without gradients", function()
    local m = checkpoint_blocks(gpt())
    local x = batch()
    fsdp.no_grad(function() m(x) end)
    assert.are.equal(0, core.tape_size())
    -- frozen parameters and inputs that need no gradient: a plain forward, no node
    for _, p in ipairs(m.blocks[1]:parameters()) do p.requires_grad = false end
    local b = m.blocks[1]
    local h = fsdp.randn{2, 8, 16}
    local out = b(h)
    assert.is_false(out.requires_grad)
    assert.are.equal(0, core.tape_size())
  end)

  it("passes non-tensor arguments again, and gradients through an identity forward", function()
    local Scale = nn.Module:extend("Scale")
    function Scale:init() self.w = nn.Parameter(fsdp.tensor{1.5, -2}) end
    function Scale:forward(x, k, opts) return x * self.w * k + opts.shift end
    local Ident = nn.Module:extend("Ident")
    function Ident:forward(x) return x end
    local function run(ck)
      local s, id = Scale(), Ident()
      if ck then nn.checkpoint(s) nn.checkpoint(id) end
      local x = nn.Parameter(fsdp.tensor{{1, 2}, {3, 4}})
      local y = id(s(x, 3, {shift = 0.5}))
      local z = id(x) -- the input itself comes back
      local loss = (y * y):sum() + (z * 2):sum()
      loss:backward()
      return {loss:item(), x.grad:totable(), s.w.grad:totable()}
    end
    assert.are.same(run(false), run(true))
  end)

  it("can be switched off, and says which modules are checkpointed", function()
    local m = gpt()
    assert.is_false(nn.is_checkpointed(m.blocks[1]))
    assert.are.equal(m.blocks[1], nn.checkpoint(m.blocks[1]))
    assert.is_true(nn.is_checkpointed(m.blocks[1]))
    nn.checkpoint(m.blocks[1], {enabled = false})
    assert.is_false(nn.is_checkpointed(m.blocks[1]))
    assert.is_false(nn.is_checkpointed(5))
    -- the mark is no parameter or child: paths and parameters are unchanged
    local paths = {}
    for path in m:named_parameters() do paths[#paths + 1] = path end
    checkpoint_blocks(m)
    local after = {}
    for path in m:named_parameters() do after[#after + 1] = path end
    assert.are.same(paths, after)
  end)

  it("refuses what it cannot checkpoint", function()
    assert_error_has(function() nn.checkpoint(5) end, "nn.checkpoint: expected a module (got number)")
    assert_error_has(function() nn.checkpoint(nn.ModuleList{nn.ReLU()}) end,
      "nn.checkpoint: a ModuleList has no forward to checkpoint")
    assert_error_has(function() nn.checkpoint(nn.ReLU(), {enable = true}) end,
      "nn.checkpoint: unknown option 'enable' (valid: enabled)")
    assert_error_has(function() nn.checkpoint(nn.ReLU(), {enabled = 1}) end,
      "nn.checkpoint: enabled must be a boolean (got number)")
    assert_error_has(function() nn.checkpoint(nn.ReLU(), 3) end, "nn.checkpoint: expects an options table")
  end)

  it("refuses a forward that does not return one tensor", function()
    local Two = nn.Module:extend("Two")
    function Two:init() self.l = nn.Linear(2, 2) end
    function Two:forward(x) local y = self.l(x) return y, y end
    local Tab = nn.Module:extend("Tab")
    function Tab:init() self.l = nn.Linear(2, 2) end
    function Tab:forward(x) return {self.l(x)} end
    local x = fsdp.randn{3, 2}
    assert_error_has(function() nn.checkpoint(Two())(x) end,
      "Two: nn.checkpoint: a checkpointed forward must return one tensor (Two's returned 2 values)")
    assert_error_has(function() nn.checkpoint(Tab())(x) end, "(Tab's returned table)")
    assert.is_true(core.is_grad_enabled()) -- an error in the forward leaves recording on
    -- an integral output carries no gradient: returned as it is, nothing recorded
    local Arg = nn.Module:extend("Arg")
    function Arg:init() self.l = nn.Linear(2, 2) end
    function Arg:forward(z) return self.l(z):argmax(2) end
    local ids = nn.checkpoint(Arg())(x)
    assert.are.equal("i64", ids:dtype())
    assert.are.equal(0, core.tape_size())
    -- an error inside the forward keeps its module path
    local m = gpt()
    nn.checkpoint(m.blocks[2])
    assert_error_has(function() m.blocks[2](fsdp.randn{1, 2, 5}) end, "ln1 (LayerNorm): layernorm")
  end)

  it("leaves a parameter writable when its forward returns a view of it", function()
    -- the node's output is the parameter's memory, not an activation the graph made
    local P = nn.Module:extend("P")
    function P:init() self.w = nn.Parameter(fsdp.ones{3}) end
    function P:forward() return self.w:view{3} end
    local m = nn.checkpoint(P())
    local y = m(fsdp.ones{3})
    assert.are.equal(1, core.tape_size())
    m.w:detach():fill(2)
    y:mul_(3)
    assert.are.same({6, 6, 6}, m.w:totable())
    y:sum():backward()
    assert.are.same({1, 1, 1}, m.w.grad:totable())
  end)

  it("refuses to recompute from an input modified in place since the forward", function()
    local l = nn.checkpoint(nn.Linear(3, 3))
    local x = fsdp.randn{2, 3}
    x.requires_grad = true
    local y = l(x)
    x:fill(0) -- a leaf takes the write; the node's version check catches it
    assert_error_has(function() y:sum():backward() end, "backward of checkpoint",
      "input 1 (2, 3) of the checkpointed region was modified in place after the forward")
    assert.are.equal(0, core.tape_size())
    -- the same through another tensor over x's memory
    y = l(x)
    x:detach():fill(1)
    assert_error_has(function() y:sum():backward() end, "backward of checkpoint",
      "input 1 (2, 3) of the checkpointed region was modified in place through another tensor "
      .. "over its memory (a view or detach()) after the forward")
    assert.are.equal(0, core.tape_size())
    -- an input that is a graph's own tensor cannot be written at all while the graph lives
    local h = x * 1
    y = l(h)
    assert_error_has(function() h:fill(0) end, "fill: this tensor (2, 3) was made by affine")
    y:sum():backward()
    assert.are.equal(0, core.tape_size())
  end)

  it("refuses a recomputation that differs from the forward, and passes its errors on", function()
    local Fickle = nn.Module:extend("Fickle")
    function Fickle:init() self.l = nn.Linear(4, 4) self.calls = 0 end
    function Fickle:forward(x)
      self.calls = self.calls + 1
      if self.calls == 2 and self.fail then error("boom in the recomputation", 0) end
      local y = self.l(x)
      if self.calls == 2 then return y:narrow(1, 1, 1) end
      return y
    end
    local m = nn.checkpoint(Fickle())
    local out = m(fsdp.randn{2, 4})
    assert_error_has(function() out:sum():backward() end, "backward of checkpoint",
      "the recomputation gave f32 (1, 4) where the forward gave f32 (2, 4)")
    m.calls, m.fail = 0, true
    out = m(fsdp.randn{2, 4})
    assert_error_has(function() out:sum():backward() end, "boom in the recomputation")
    assert.are.equal(0, core.tape_size())
    -- the model still trains afterwards
    m.calls, m.fail = 5, false
    m(fsdp.randn{2, 4}):sum():backward()
    assert.is_not_nil(m.l.weight.grad)
  end)

  it("checkpoints modules that a fused op stands in for (an MLP's fc, a Block's ln2)", function()
    -- nn.MLP runs fc and the GELU as one op, nn.Block the residual add and ln2, without calling
    -- fc or ln2: checkpointed, they are still checkpointed, with the bits of the unchecked run
    local calls = 0
    local checkpoint = core.checkpoint
    core.checkpoint = function(...)
      calls = calls + 1
      return checkpoint(...)
    end
    local ok, err = pcall(function()
      for _, dt in ipairs{"f32", "bf16"} do
        local ref = step_bits(gpt{dropout = 0.1}:to(dt))
        local m = gpt{dropout = 0.1}:to(dt)
        for i = 1, #m.blocks do
          nn.checkpoint(m.blocks[i].mlp.fc)
          nn.checkpoint(m.blocks[i].ln2)
        end
        calls = 0
        local x = batch()
        m(x)
        core.tape_clear()
        assert.are.equal(2 * CFG.layers, calls, dt .. ": checkpointed regions in a forward")
        same_bits(ref, step_bits(m))
      end
    end)
    core.checkpoint = checkpoint
    assert(ok, err)
  end)

  it("names the recomputed module's path in its errors, as the forward's errors do", function()
    -- fail = a module: it raises when it runs in backward (a recomputation)
    local fail
    local Boom = nn.Module:extend("Boom")
    function Boom:init() self.l = nn.Linear(4, 4) end
    function Boom:forward(x)
      if fail == self and self.armed then
        self.armed = self.armed - 1
        if self.armed == 0 then error("boom", 0) end
      end
      return self.l(x)
    end
    local Inner = nn.Module:extend("Inner")
    function Inner:init() self.a = nn.Linear(4, 4) self.boom = Boom() end
    function Inner:forward(x) return self.boom(self.a(x)):relu() end
    local Net = nn.Module:extend("Net")
    function Net:init()
      self.first = nn.Linear(4, 4)
      self.blocks = nn.ModuleList{Inner(), Inner()}
    end
    function Net:forward(x) return self.blocks[2](self.blocks[1](self.first(x))) end
    -- target fails on its `at`-th run in backward (default: the first)
    local function run(m, target, at)
      fail = target
      target.armed = false
      local out = m(fsdp.randn{2, 4})
      target.armed = at or 1 -- the forward ran: what runs now is a recomputation
      local ok, err = pcall(function() out:sum():backward() end)
      target.armed = false
      assert.is_false(ok)
      assert.are.equal(0, core.tape_size())
      return tostring(err)
    end
    local m = Net()
    nn.checkpoint(m.blocks[1])
    nn.checkpoint(m.blocks[2])
    -- raised by a module the recomputation calls, and by the checkpointed module itself
    local err = run(m, m.blocks[2].boom)
    assert.truthy(err:find("backward of checkpoint: blocks.2.boom (Boom): boom", 1, true), err)
    local Self = nn.Module:extend("Self")
    function Self:init() self.l = nn.Linear(4, 4) end
    function Self:forward(x)
      if self.armed then error("boom itself", 0) end -- any number: on the first run
      return self.l(x)
    end
    local s = nn.Sequential(nn.Linear(4, 4), Self())
    nn.checkpoint(s[2])
    err = run(s, s[2])
    assert.truthy(err:find("backward of checkpoint: 2 (Self): boom itself", 1, true), err)
    -- nested: the inner checkpoint runs in the outer one's recomputation (run 1 in backward),
    -- then its own (run 2): both named from the model
    nn.checkpoint(m.blocks[1].boom)
    for at = 1, 2 do
      err = run(m, m.blocks[1].boom, at)
      assert.truthy(err:find("backward of checkpoint: blocks.1.boom (Boom): boom", 1, true), err)
    end
    -- a checkpointed model called by itself: its own name
    local whole = nn.checkpoint(Self())
    err = run(whole, whole)
    assert.truthy(err:find("backward of checkpoint: Self: boom itself", 1, true), err)
    -- the model still trains afterwards, and forward errors keep their paths
    m(fsdp.randn{2, 4}):sum():backward()
    assert.is_not_nil(m.first.weight.grad)
    assert_error_has(function() m(fsdp.randn{2, 5}) end, "first (Linear): ")
  end)

  it("core.checkpoint refuses a bad state and an integral output", function()
    local rng = core.checkpoint_rng()
    local fn = function() end
    assert_error_has(function() core.checkpoint(fsdp.zeros{2}, "abc", fn) end,
      "checkpoint: argument #2 is not a state from checkpoint_rng()")
    assert_error_has(function() core.checkpoint(fsdp.zeros({2}, {dtype = "i64"}), rng, fn) end,
      "checkpoint: the region's output is i64 (2); only a floating output")
    assert_error_has(function() core.checkpoint(fsdp.zeros{2}, rng, fn, 3) end,
      "bad argument #4 to 'checkpoint' (tensor expected, got number)")
    -- a recomputation that returns no tensor
    local y = core.checkpoint(fsdp.zeros{2}, rng, function() return 1 end)
    assert_error_has(function() y:sum():backward() end,
      "checkpoint: the recomputation returned number, not a tensor")
  end)

  it("drops the graphs of forwards that never ran backward", function()
    local m = checkpoint_blocks(gpt())
    local x = batch()
    for _ = 1, 3 do m(x) end -- results dropped
    collectgarbage()
    collectgarbage()
    core.tape_prune()
    assert.are.equal(0, core.tape_size())
    same_bits(step_bits(gpt()), step_bits(m))
  end)
end)
