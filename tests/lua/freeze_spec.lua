-- freeze_spec.lua — frozen parameters at world size 1: p.requires_grad on plain and wrapped
-- parameters, module:freeze / unfreeze and their patterns, what a frozen unit allocates and
-- records, and the refusals. Multi-rank equivalence and the traffic counters are in
-- tests/dist/freeze.lua.
-- Run: busted --lua=luajit tests/lua/freeze_spec.lua

local fsdp = require "fsdp"
local nn = fsdp.nn
local H = require "helpers"
teardown(H.remove_temps)

local ids = fsdp.tensor({{1, 2, 3, 4}, {5, 6, 7, 8}}, {dtype = "i64"})
local targets = fsdp.tensor({{2, 3, 4, 5}, {6, 7, 8, 9}}, {dtype = "i64"})

local function gpt()
  fsdp.manual_seed(3)
  return nn.GPT{vocab = 11, ctx = 8, d = 8, layers = 2, heads = 2}
end

local function frozen_paths(m)
  local out = {}
  for path, p in m:named_parameters() do
    if not p.requires_grad then out[#out + 1] = path end
  end
  return table.concat(out, " ")
end

local function assert_error_has(fn, ...)
  local ok, err = pcall(fn)
  assert.is_false(ok)
  for _, s in ipairs{...} do
    assert.truthy(tostring(err):find(s, 1, true), ("%q not in %q"):format(s, tostring(err)))
  end
end

local function step(model, opt)
  opt:zero_grad()
  local loss = nn.F.cross_entropy(model(ids), targets)
  loss:backward()
  opt:step()
  return loss
end

describe("freeze", function()
  it("sets requires_grad by path pattern and returns the module", function()
    local m = gpt()
    assert.are.equal(m, m:freeze("^blocks%.1%."))
    assert.are.equal("blocks.1.ln1.weight blocks.1.ln1.bias blocks.1.attn.qkv.weight "
      .. "blocks.1.attn.qkv.bias blocks.1.attn.proj.weight blocks.1.attn.proj.bias "
      .. "blocks.1.ln2.weight blocks.1.ln2.bias blocks.1.mlp.fc.weight blocks.1.mlp.fc.bias "
      .. "blocks.1.mlp.proj.weight blocks.1.mlp.proj.bias", frozen_paths(m))
    m:unfreeze()
    assert.are.equal("", frozen_paths(m))
    m:freeze():unfreeze{"^ln_f%.", "%.mlp%.fc%."}
    for path, p in m:named_parameters() do
      local trains = path:find("^ln_f%.") or path:find("%.mlp%.fc%.")
      assert.are.equal(trains ~= nil, p.requires_grad, path)
    end
  end)

  it("refuses a requires_grad that is not a boolean, leaving the parameter as it was", function()
    local m = gpt()
    for _, v in ipairs{"no", 0, false} do
      local ok, err = pcall(function() m.wte.weight.requires_grad = v or nil end)
      assert.is_false(ok)
      assert.truthy(tostring(err):find("requires_grad: must be true or false (got "
        .. (v and type(v) or "nil") .. ")", 1, true), tostring(err))
      assert.is_true(m.wte.weight.requires_grad)
    end
  end)

  it("freezes a tie once: the tied head is the embedding's parameter", function()
    local m = gpt()
    m:freeze("^wte%.")
    assert.is_false(m.head.weight.requires_grad)
  end)

  it("works on a submodule, with paths relative to it", function()
    local m = gpt()
    m.blocks[2]:freeze("^attn%.")
    assert.are.equal("blocks.2.attn.qkv.weight blocks.2.attn.qkv.bias "
      .. "blocks.2.attn.proj.weight blocks.2.attn.proj.bias", frozen_paths(m))
  end)

  it("refuses a pattern that matches nothing, naming the parameters", function()
    local m = gpt()
    assert_error_has(function() m:freeze("^blocks%.9") end,
      "freeze: the pattern \"^blocks%.9\" matches no parameter; the parameters are: wte.weight")
    assert_error_has(function() m:unfreeze{"attn", 3} end, "unfreeze: patterns[2] must be a string")
    assert_error_has(function() m:freeze("[") end, "freeze: bad pattern \"[\"")
    assert.are.equal("", frozen_paths(m)) -- nothing changed
  end)

  it("plain: a frozen parameter gets no gradient and the optimizer leaves it alone", function()
    local m = gpt():freeze("^blocks%.2%.")
    local w = m.blocks[2].mlp.fc.weight:clone()
    local t = m.blocks[1].mlp.fc.weight:clone()
    local opt = fsdp.optim.AdamW(m, {lr = 1e-2, weight_decay = 0.1})
    step(m, opt)
    assert.is_nil(m.blocks[2].mlp.fc.weight.grad)
    assert.are.same(w:totable(), m.blocks[2].mlp.fc.weight:totable())
    assert.are_not.same(t:totable(), m.blocks[1].mlp.fc.weight:totable())
    assert.is_nil(opt.state[m.blocks[2].mlp.fc.weight])
  end)
end)

describe("freeze, wrapped", function()
  local function wrapped()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    return m
  end

  local function unit_of(m, path)
    for _, u in ipairs(fsdp.units(m)) do if u.path == path then return u end end
  end

  it("sets requires_grad on sharded parameters after wrapping", function()
    local m = wrapped()
    m:freeze("^blocks%.1%.")
    assert.is_false(m.blocks[1].attn.qkv.weight.requires_grad)
    assert.is_false(unit_of(m, "blocks.1"):trainable())
    assert.is_true(unit_of(m, "blocks.2"):trainable())
    assert.is_true(unit_of(m, "(root)"):trainable())
  end)

  -- (also with an optimizer that clips: its step collects the gradient views before using
  -- them, and must not keep them)
  for _, opts in ipairs{{lr = 1e-2}, {lr = 1e-2, max_grad_norm = 1e-3}} do
    it("a frozen unit keeps no gradient shard; freezing after training frees it"
      .. (opts.max_grad_norm and " (max_grad_norm)" or ""), function()
      local m = wrapped()
      local opt = fsdp.optim.AdamW(m, opts)
      step(m, opt)
      local u2 = unit_of(m, "blocks.2")
      collectgarbage() -- the optimizer's Lua values of the gradient shards
      local all = fsdp.memory().grads
      m:freeze("^blocks%.2%.")
      collectgarbage()
      assert.are.equal(all - u2:shard_numel() * 4, fsdp.memory().grads)
      local before = fsdp.memory().optim
      step(m, opt)
      collectgarbage()
      assert.are.equal(all - u2:shard_numel() * 4, fsdp.memory().grads)
      assert.are.equal(before, fsdp.memory().optim) -- no new state; the old stays (as PyTorch)
      m:unfreeze()
      step(m, opt)
      collectgarbage()
      assert.are.equal(all, fsdp.memory().grads) -- made again at its next backward
    end)
  end

  it("a frozen unit no gradient passes leaves nothing on the tape", function()
    local m = wrapped()
    m:freeze()
    fsdp.core.tape_clear()
    local out = m(ids)
    assert.is_false(out.requires_grad)
    assert.are.equal(0, fsdp.core.tape_size())
    for _, u in ipairs(fsdp.units(m)) do assert.are.equal("sharded", u:state()) end
    m:unfreeze("^ln_f%.") -- only the root trains: the blocks are still not recorded
    out = m(ids)
    assert.is_true(out.requires_grad)
    assert.are.equal("sharded", unit_of(m, "blocks.1"):state())
    nn.F.cross_entropy(out, targets):backward()
    assert.are.equal(0, fsdp.core.tape_size())
  end)

  it("a frozen unit that gradients pass through gathers in backward and reduces nothing", function()
    local m = wrapped()
    m:freeze("^blocks%.2%.")
    local opt = fsdp.optim.SGD(m, {lr = 0.1})
    local w = fsdp.full_params(m, function() return m.blocks[2].mlp.fc.weight:clone() end)
    fsdp.reset_comm_stats()
    step(m, opt)
    assert.is_true(unit_of(m, "blocks.1"):has_grad(1))
    for i = 1, #unit_of(m, "blocks.2"):paths() do
      assert.is_false(unit_of(m, "blocks.2"):has_grad(i))
    end
    local w2 = fsdp.full_params(m, function() return m.blocks[2].mlp.fc.weight:clone() end)
    assert.are.same(w:totable(), w2:totable())
  end)

  it("a change between a forward and its backward applies to that backward", function()
    local m = wrapped()
    local opt = fsdp.optim.SGD(m, {lr = 0.1})
    local u1 = unit_of(m, "blocks.1")
    opt:zero_grad()
    local loss = nn.F.cross_entropy(m(ids), targets)
    m:freeze("^blocks%.1%.") -- recorded as trainable; frozen before its backward
    fsdp.reset_comm_stats()
    loss:backward()
    local s = fsdp.comm_stats() -- counted at one rank too: blocks.2 and the root reduce
    assert.are.equal(2, s.reduce_scatter_calls)
    assert.are.equal(unit_of(m, "blocks.2"):padded_numel() * 4 + unit_of(m, "(root)"):padded_numel() * 4,
      s.reduce_scatter_bytes)
    for i = 1, #u1:paths() do assert.is_false(u1:has_grad(i)) end
    assert.is_true(unit_of(m, "blocks.2"):has_grad(1))
    -- and the other way: frozen at the forward, unfrozen before backward: nothing recorded
    m:freeze()
    opt:zero_grad()
    local out = m(ids)
    m:unfreeze()
    assert.is_false(out.requires_grad)
    for _, u in ipairs(fsdp.units(m)) do
      for i = 1, #u:paths() do assert.is_false(u:has_grad(i)) end
    end
  end)
end)

describe("freeze and checkpoints", function()
  local function run(frozen_at_save, frozen_at_load)
    local dir = H.tmpname()
    local m = gpt()
    if frozen_at_save then m:freeze("^blocks%.1%.") end
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local opt = fsdp.optim.AdamW(m, {lr = 1e-2})
    step(m, opt)
    fsdp.save(m, dir, {format = "sharded", optimizer = opt})
    -- a second model resumes from the checkpoint; both take one more step
    local m2 = gpt()
    if frozen_at_load then m2:freeze("^blocks%.1%.") end
    fsdp.wrap(m2, {policy = fsdp.policy.modules{nn.Block}})
    local opt2 = fsdp.optim.AdamW(m2, {lr = 1e-2})
    fsdp.load(m2, dir, {optimizer = opt2})
    if frozen_at_load then m:freeze("^blocks%.1%.") end
    local l1, l2 = step(m, opt):item(), step(m2, opt2):item()
    assert.are.equal(l1, l2)
    local a = fsdp.full_params(m, function() return m.blocks[1].mlp.fc.weight:clone() end)
    local b = fsdp.full_params(m2, function() return m2.blocks[1].mlp.fc.weight:clone() end)
    assert.are.same(a:totable(), b:totable())
    os.execute("rm -rf '" .. dir .. "'")
  end

  it("a frozen model saves its parameters and optimizer state and resumes to the bit", function()
    run(true, true)
  end)

  it("an optimizer state saved before freezing loads into the frozen model", function()
    run(false, true)
  end)

  it("a state_dict taken before freezing a unit loads, keeping the frozen unit's state", function()
    -- the same run twice: one optimizer throughout, or its state_dict loaded into a new one
    -- after freezing block 1 (a unit); block 1 is unfrozen later and must go on from its state
    local function train(roundtrip)
      local m = gpt()
      fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
      local opt = fsdp.optim.AdamW(m, {lr = 1e-2})
      step(m, opt)
      step(m, opt)
      m:freeze("^blocks%.1%.")
      if roundtrip then
        local sd = opt:state_dict()
        opt = fsdp.optim.AdamW(m, {lr = 1e-2})
        opt:load_state_dict(sd)
        local st = opt:state_dict().state["blocks.1.mlp.fc.weight"]
        assert.truthy(st, "the frozen unit's state was loaded")
        assert.are.equal(2, st.step)
      end
      step(m, opt)
      m:unfreeze()
      step(m, opt)
      return fsdp.full_params(m, function() return m.blocks[1].mlp.fc.weight:clone() end)
    end
    assert.are.same(train(false):totable(), train(true):totable())
  end)
end)
