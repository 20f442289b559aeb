-- mask_spec.lua — masks at world size 1 (lua/fsdp/mask.lua, the mask part of optim.lua and the
-- helpers of src/fsdp/mask.c through src/lua/l_mask.c): set_mask/mask on plain and wrapped models, masked weights
-- exactly 0 through SGD momentum, AdamW and weight decay (mask set mid-training too),
-- clip_grad_norm on masked gradients, wrap/unwrap/re-wrap, full_params/apply writeback, ties,
-- set_mask on gathered units (inside walks, between forward and backward, refused after a stray
-- write into the copy), fsdp.sparsity against a direct count. Multi-rank behaviour: tests/dist/mask_*.lua.
-- Run: busted --lua=luajit tests/lua/mask_spec.lua

local fsdp = require "fsdp"
require "fsdp.mask" -- installs fsdp.set_mask/mask/sparsity if init.lua does not know them yet
local core = fsdp.core
local nn = fsdp.nn

local H = require "helpers"
local flat = H.flat_view

local function gpt(tie)
  fsdp.manual_seed(7)
  return nn.GPT{vocab = 16, ctx = 8, d = 16, layers = 2, heads = 2, tie = tie}
end

local ids = fsdp.tensor{{1, 2, 3, 4, 5, 6}, {7, 8, 9, 10, 11, 12}}
local tgt = fsdp.tensor{{2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13}}

-- A deterministic 0/1 mask of shape with about `frac` zeros.
local function some_mask(shape, frac, salt)
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  local v = {}
  for i = 1, n do v[i] = ((i * 7919 + (salt or 0) * 104729) % 1000) / 1000 < frac and 0 or 1 end
  return fsdp.tensor(v):view(shape)
end

-- Full values of a parameter (gathered when the model is wrapped).
local function values(model, p)
  local out
  fsdp.full_params(model, function() out = flat(p) end, {writeback = false})
  return out
end

local function train(model, opt, steps)
  for _ = 1, steps do
    opt:zero_grad()
    nn.F.cross_entropy(model(ids), tgt):backward()
    fsdp.clip_grad_norm(model, 1.0)
    opt:step()
  end
end

-- Every masked element of p is exactly 0 and at least `live` unmasked ones are not.
local function assert_masked(model, p, m, live)
  local v, mv = values(model, p), flat(m)
  local nonzero = 0
  for i = 1, #v do
    if mv[i] == 0 then
      assert.are.equal(0, v[i])
    elseif v[i] ~= 0 then
      nonzero = nonzero + 1
    end
  end
  assert.is_true(nonzero >= (live or 1), "unmasked weights should train")
end

describe("l_mask.c helpers", function()
  it("mask_apply writes +0 where the mask is 0, leaves the rest", function()
    local x = fsdp.tensor{-1.5, 2, -3, 4}
    core.mask_apply(x, fsdp.tensor{0, 1, 0, 1})
    local v = x:totable()
    assert.are.same({0, 2, 0, 4}, v)
    assert.are.equal(math.huge, 1 / v[1]) -- +0, not -0
    assert.has_error(function() core.mask_apply(x, fsdp.tensor{1, 1}) end)
  end)

  it("count_zeros and mask_check", function()
    assert.are.equal(3, core.count_zeros(fsdp.tensor{0, 1, -0.0, 2, 0}))
    local bad, zeros = core.mask_check(fsdp.tensor{0, 1, 0.5, 1, 0, 2})
    assert.are.equal(2, bad)
    assert.are.equal(2, zeros)
    local _, _, h1 = core.mask_check(fsdp.tensor{0, 1, 1, 1})
    local _, _, h2 = core.mask_check(fsdp.tensor{1, 0, 1, 1})
    assert.are_not.equal(h1, h2)
  end)

  it("mask_select with a key found by the histograms prunes exactly the k smallest", function()
    -- values with many exact ties; brute force: sort by (|x|, index)
    local v = {}
    for i = 1, 200 do v[i] = ((i * 37) % 11 - 5) * 0.25 end
    local x = fsdp.tensor(v)
    for _, k in ipairs{0, 1, 17, 100, 199, 200} do
      local order = {}
      for i = 1, #v do order[i] = i end
      table.sort(order, function(a, b)
        if math.abs(v[a]) ~= math.abs(v[b]) then return math.abs(v[a]) < math.abs(v[b]) end
        return a < b
      end)
      local want = {}
      for i = 1, #v do want[i] = 1 end
      for j = 1, k do want[order[j]] = 0 end
      -- one group, held as two pieces (positions 0..119 and 120..199), one rank
      local g = {k = k, pieces = {{x = x:narrow(1, 1, 120), gbase = 0, counts = true},
                                  {x = x:narrow(1, 121, 80), gbase = 120, counts = true}}}
      core.prune_select({g}, false, "mask_spec")
      local T, P = g.T, g.P
      local mout = fsdp.ones{#v}
      assert.are.equal(k, core.mask_select(mout, x, nil, T, 0, P))
      assert.are.same(want, mout:totable())
    end
  end)

  it("prune_select refuses a group with fewer elements than k, naming the label", function()
    local g = {k = 5, pieces = {{x = fsdp.tensor{1, 2, 3}, gbase = 0, counts = true}}}
    local ok, err = pcall(core.prune_select, {g}, false, "mask_spec")
    assert.is_false(ok)
    assert.truthy(tostring(err):find("mask_spec: group 1 has 2 elements fewer than the 5", 1, true))
    -- a piece another rank counts adds nothing
    g = {k = 3, pieces = {{x = fsdp.tensor{1, 2, 3}, gbase = 0, counts = false}}}
    assert.has_error(function() core.prune_select({g}, false, "mask_spec") end)
    -- the binding's own checks, naming the group or piece
    local function refused(groups, want)
      local ok2, err2 = pcall(core.prune_select, groups, false, "x")
      assert.is_false(ok2)
      assert.truthy(tostring(err2):find(want, 1, true), tostring(err2))
    end
    refused({{k = -1, pieces = {}}}, "prune_select: group 1: k must be an integer in [0, 2^53]")
    refused({5}, "prune_select: group 1 is a number, not a table")
    refused({{k = 1}}, "prune_select: group 1: pieces is a nil, not a table")
    refused({{k = 1, pieces = {{x = fsdp.tensor{1}, counts = true}}}},
      "prune_select: piece 1: gbase must be an integer in [0, 2^53]")
    refused({{k = 1, pieces = {{x = 3, gbase = 0}}}}, "prune_select: group 1, piece 1: x must be a tensor (got number)")
    refused({{k = 1, pieces = {{x = fsdp.tensor{1}, m = {}, gbase = 0}}}}, "piece 1: m must be a tensor (got table)")
  end)

  it("keys put masked elements below every live one", function()
    local x = fsdp.tensor{5, 0.1, 3, 0.2}
    local m = fsdp.tensor{0, 1, 1, 1} -- element 1 is masked: smallest key although |5| is large
    local mout = fsdp.ones{4}
    -- key of a masked element is 0: T = 1 (the smallest live key is above it) prunes only it
    assert.are.equal(1, core.mask_select(mout, x, m, 1, 0, 0))
    assert.are.same({0, 1, 1, 1}, mout:totable())
  end)

  it("mask_nm keeps the n largest of each full group (equal values: the lower index goes)", function()
    local x = fsdp.tensor{9, 1, 2, 3, 1, 1, 1, 1, -4, 5, -6, 0.5, 7}
    local mout = fsdp.full({13}, 7)
    -- lead 1: groups [2..5], [6..9], [10..13]; element 1 untouched
    assert.are.equal(3, core.mask_nm(mout, x, nil, 2, 4, 1))
    assert.are.same({7, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1, 0, 1}, mout:totable())
    -- a mask: masked elements rank below every live one
    local mout2 = fsdp.ones{4}
    core.mask_nm(mout2, fsdp.tensor{9, 1, 2, 3}, fsdp.tensor{0, 1, 1, 1}, 2, 4, 0)
    assert.are.same({0, 0, 1, 1}, mout2:totable())
  end)
end)

describe("fsdp.set_mask / fsdp.mask", function()
  it("masks a plain parameter at once and returns a copy of the mask", function()
    local m = gpt()
    local w = m.blocks[1].mlp.fc.weight
    local mk = some_mask(w:shape(), 0.4)
    assert.is_nil(fsdp.mask(w))
    fsdp.set_mask(w, mk)
    local got = fsdp.mask(w)
    assert.are.same(flat(mk), flat(got))
    got:fill(1) -- a copy: the stored mask does not change
    assert.are.same(flat(mk), flat(fsdp.mask(w)))
    local v, mv = flat(w), flat(mk)
    for i = 1, #v do if mv[i] == 0 then assert.are.equal(0, v[i]) end end
    fsdp.set_mask(w, nil)
    assert.is_nil(fsdp.mask(w))
  end)

  it("checks shape and values", function()
    local m = gpt()
    local w = m.blocks[1].mlp.fc.weight
    assert.has_error(function() fsdp.set_mask(w, fsdp.ones{3, 3}) end)
    local bad = fsdp.ones(w:shape())
    bad:set(1, 1, 0.5)
    local ok, err = pcall(fsdp.set_mask, w, bad)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("only 0 and 1", 1, true))
    assert.has_error(function() fsdp.set_mask(w, 1) end)
    assert.has_error(function() fsdp.set_mask({}, fsdp.ones{1}) end)
  end)

  it("works on a wrapped parameter and on a reference saved before wrapping", function()
    local m = gpt()
    local w = m.blocks[2].attn.qkv.weight -- saved before wrap
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local mk = some_mask(w:shape(), 0.5, 3)
    fsdp.set_mask(w, mk)
    assert.are.same(flat(mk), flat(fsdp.mask(w)))
    assert_masked(m, w, mk)
    fsdp.unwrap(m)
  end)

  it("ties share one mask (GPT tie = true)", function()
    local m = gpt(true)
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local mk = some_mask(m.head.weight:shape(), 0.3, 5)
    fsdp.set_mask(m.head.weight, mk)
    assert.are.same(flat(mk), flat(fsdp.mask(m.wte.weight)))
    local opt = fsdp.optim.SGD(m, {lr = 0.5, momentum = 0.9})
    train(m, opt, 3)
    assert_masked(m, m.wte.weight, mk)
    fsdp.unwrap(m)
  end)
end)

describe("masked weights stay exactly 0", function()
  local cases = {
    {"SGD momentum + weight decay", function(m) return fsdp.optim.SGD(m, {lr = 0.3, momentum = 0.9, weight_decay = 0.01}) end},
    {"AdamW + weight decay", function(m) return fsdp.optim.AdamW(m, {lr = 0.05, weight_decay = 0.1}) end},
  }
  for _, wrapped in ipairs{false, true} do
    for _, c in ipairs(cases) do
      it(c[1] .. (wrapped and ", wrapped" or ", plain") .. ", mask set after momentum built up", function()
        local m = gpt()
        if wrapped then fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}}) end
        local opt = c[2](m)
        train(m, opt, 3) -- momentum / moments are nonzero everywhere now
        local targets = {m.blocks[1].mlp.fc.weight, m.blocks[2].attn.proj.weight, m.wpe.weight,
          m.blocks[1].mlp.fc.bias}
        local masks = {}
        for i, p in ipairs(targets) do
          masks[i] = some_mask(p:shape(), 0.6, i)
          fsdp.set_mask(p, masks[i])
        end
        train(m, opt, 5)
        for i, p in ipairs(targets) do assert_masked(m, p, masks[i]) end
        if wrapped then fsdp.unwrap(m) end
      end)
    end
  end

  it("the test can fail: without the optimizer's masking, weights regrow", function()
    local m = gpt()
    local opt = fsdp.optim.SGD(m, {lr = 0.3, momentum = 0.9})
    train(m, opt, 2)
    local w = m.blocks[1].mlp.fc.weight
    local mk = some_mask(w:shape(), 0.5)
    core.mask_apply(w:detach():view{w:numel()}, mk:view{w:numel()}) -- zeros, but no mask
    train(m, opt, 2)
    local v, mv, regrown = flat(w), flat(mk), 0
    for i = 1, #v do if mv[i] == 0 and v[i] ~= 0 then regrown = regrown + 1 end end
    assert.is_true(regrown > 0)
  end)
end)

describe("clip_grad_norm", function()
  it("measures masked gradients (plain and wrapped agree)", function()
    local norms = {}
    for k, wrapped in ipairs{false, true} do
      local m = gpt()
      local w = m.blocks[1].mlp.fc.weight
      if wrapped then fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}}) end
      fsdp.set_mask(w, some_mask(w:shape(), 0.9))
      nn.F.cross_entropy(m(ids), tgt):backward()
      norms[k] = fsdp.clip_grad_norm(m, 1e9)
      if wrapped then fsdp.unwrap(m) end
    end
    -- the unmasked norm of the same model is larger
    local m = gpt()
    nn.F.cross_entropy(m(ids), tgt):backward()
    local full = fsdp.clip_grad_norm(m, 1e9)
    assert.is_true(math.abs(norms[1] - norms[2]) <= 1e-5 * norms[1])
    assert.is_true(full > norms[1] * (1 + 1e-4))
  end)
end)

describe("masks across wrap, unwrap, re-wrap and writeback", function()
  it("survive wrap -> unwrap -> re-wrap with another strategy", function()
    local m = gpt()
    local w = m.blocks[1].attn.qkv.weight
    local mk = some_mask(w:shape(), 0.5, 9)
    fsdp.set_mask(w, mk)
    for _, strategy in ipairs{"full", "grad_op", "none"} do
      fsdp.wrap(m, {strategy = strategy, policy = fsdp.policy.modules{nn.Block}})
      assert.are.same(flat(mk), flat(fsdp.mask(w)))
      local opt = fsdp.optim.AdamW(m, {lr = 0.05})
      train(m, opt, 2)
      assert_masked(m, w, mk)
      fsdp.unwrap(m)
      assert.are.same(flat(mk), flat(fsdp.mask(w)))
      assert_masked(m, w, mk)
    end
    -- an outer wrap absorbing an inner one keeps the mask
    fsdp.wrap(m.blocks[1], {})
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    assert.are.same(flat(mk), flat(fsdp.mask(w)))
    fsdp.unwrap(m)
    assert.are.same(flat(mk), flat(fsdp.mask(w)))
  end)

  it("full_params and apply writeback re-apply the masks to the shards", function()
    local m = gpt()
    local w = m.blocks[2].mlp.proj.weight
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local mk = some_mask(w:shape(), 0.5, 11)
    fsdp.set_mask(w, mk)
    fsdp.full_params(m, function() w:fill(3) end)
    local v, mv = values(m, w), flat(mk)
    for i = 1, #v do assert.are.equal(mv[i] == 0 and 0 or 3, v[i]) end
    fsdp.apply(m, function(mod) if mod == m.blocks[2].mlp.proj then mod.weight:fill(2) end end)
    v = values(m, w)
    for i = 1, #v do assert.are.equal(mv[i] == 0 and 0 or 2, v[i]) end
    -- sparsity reads the shards: exactly the masked count
    local s = fsdp.sparsity(m)
    assert.are.equal(#v - fsdp.tensor(mv):sum():item(), s.params["blocks.2.mlp.proj.weight"].zeros)
    fsdp.unwrap(m)
  end)

  it("a mask set while the unit is gathered reaches the live parameters", function()
    local m = gpt()
    local w = m.blocks[1].mlp.fc.weight
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local mk = some_mask(w:shape(), 0.5, 13)
    fsdp.full_params(m, function()
      fsdp.set_mask(w, mk)
      local v, mv = flat(w), flat(mk)
      for i = 1, #v do if mv[i] == 0 then assert.are.equal(0, v[i]) end end
    end)
    assert_masked(m, w, mk)
    fsdp.unwrap(m)
  end)
end)

describe("set_mask on a gathered unit", function()
  local function root_unit(m)
    for _, u in ipairs(fsdp.units(m)) do
      if u.path == "(root)" then return u end
    end
  end

  local function wrapped()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    return m, root_unit(m)
  end

  local function refusal(fn, ...)
    local ok, err = pcall(fn, ...)
    assert.is_false(ok, "set_mask should have been refused")
    return tostring(err)
  end

  it("refuses a copy written outside full_params / apply, setting and changing nothing", function()
    local m, root = wrapped()
    local w = m.wpe.weight -- the root unit's
    local before = values(m, w)
    local _ = nn.F.cross_entropy(m(ids), tgt) -- the root stays gathered for the backward
    assert.are.equal("gathered", root:state())
    w:fill(5) -- a stray write: no walk will write it back
    local mk = some_mask(w:shape(), 0.5, 19)
    local err = refusal(fsdp.set_mask, w, mk)
    assert.truthy(err:find("fsdp.set_mask: wpe.weight (no mask set): unit '(root)' was changed "
      .. "while gathered", 1, true), err)
    assert.truthy(err:find("fsdp.full_params or fsdp.apply", 1, true), err)
    assert.truthy(err:find("u:reshard{discard = true}", 1, true), err)
    assert.is_nil(fsdp.mask(w))
    assert.is_true(root:dirty(), "the write was adopted by set_mask")
    root:reshard{discard = true}
    assert.are.same(before, values(m, w))
    -- a shard written under the gathered copy: refused too (the copy is stale)
    local _ = nn.F.cross_entropy(m(ids), tgt)
    root:shard():narrow(1, 1, 1):fill(7)
    err = refusal(fsdp.set_mask, w, mk)
    assert.truthy(err:find("unit '(root)' was changed while gathered", 1, true), err)
    assert.is_nil(fsdp.mask(w))
    root:reshard()
    -- with nothing changed, the same call goes through
    fsdp.set_mask(w, mk)
    assert_masked(m, w, mk)
    fsdp.unwrap(m)
  end)

  it("inside a walk, refuses a gathered unit the walk does not hold", function()
    local m, root = wrapped()
    local w = m.wpe.weight
    local before = values(m, w)
    local _ = nn.F.cross_entropy(m(ids), tgt) -- the root stays gathered
    local mk = some_mask(w:shape(), 0.5, 19)
    -- full_params of blocks.1 holds its unit, not the root: nothing writes the root back
    local err = refusal(fsdp.full_params, m.blocks[1], function()
      w:fill(5)
      fsdp.set_mask(w, mk)
    end)
    assert.truthy(err:find("fsdp.set_mask: wpe.weight (no mask set): unit '(root)'", 1, true), err)
    assert.is_nil(fsdp.mask(w))
    root:reshard{discard = true}
    assert.are.same(before, values(m, w))
    fsdp.unwrap(m)
  end)

  it("inside fsdp.apply and fsdp.full_params masks what fn wrote", function()
    local m = wrapped()
    local w = m.blocks[1].mlp.fc.weight
    local function expect(v, want)
      for i = 1, #v do assert.are.equal(want(i), v[i]) end
    end
    local mv = flat(some_mask(w:shape(), 0.5, 23))
    fsdp.apply(m, function(mod)
      if mod == m.blocks[1].mlp.fc then
        mod.weight:fill(2)
        fsdp.set_mask(mod.weight, fsdp.tensor(mv):view(w:shape()))
        expect(flat(mod.weight), function(i) return mv[i] == 0 and 0 or 2 end)
      end
    end)
    expect(values(m, w), function(i) return mv[i] == 0 and 0 or 2 end)
    assert.are.same(mv, flat(fsdp.mask(w)))
    local mv2 = flat(some_mask(w:shape(), 0.3, 29))
    fsdp.full_params(m, function()
      w:fill(3)
      fsdp.set_mask(w, fsdp.tensor(mv2):view(w:shape()))
    end)
    expect(values(m, w), function(i) return mv2[i] == 0 and 0 or 3 end)
    -- without writeback fn's write is dropped and the mask kept
    local mv3 = flat(some_mask(w:shape(), 0.3, 31))
    fsdp.full_params(m, function()
      w:fill(4)
      fsdp.set_mask(w, fsdp.tensor(mv3):view(w:shape()))
    end, {writeback = false})
    expect(values(m, w), function(i) return (mv3[i] == 0 or mv2[i] == 0) and 0 or 3 end)
    assert.are.same(mv3, flat(fsdp.mask(w)))
    fsdp.unwrap(m)
  end)

  it("between a forward and its backward masks the live copy", function()
    local m, root = wrapped()
    local w = m.wpe.weight
    local loss = nn.F.cross_entropy(m(ids), tgt)
    assert.are.equal("gathered", root:state())
    local mk = some_mask(w:shape(), 0.5, 37)
    fsdp.set_mask(w, mk)
    local v, mv = flat(w), flat(mk)
    for i = 1, #v do if mv[i] == 0 then assert.are.equal(0, v[i]) end end
    loss:backward()
    assert_masked(m, w, mk)
    fsdp.unwrap(m)
  end)
end)

describe("the checkpoint helpers on a gathered unit, and bad slices", function()
  local mask = require "fsdp.mask"

  local function wrapped() return H.wrap_blocks(gpt()) end

  it("set_mask on a wrapped parameter names it in a refusal, setting nothing", function()
    local m = wrapped()
    local w = m.blocks[1].mlp.fc.weight
    local bad = fsdp.ones(w:shape())
    bad:set(1, 1, 0.5)
    local ok, err = pcall(fsdp.set_mask, w, bad)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("fsdp.set_mask: blocks.1.mlp.fc.weight: the mask must hold "
      .. "only 0 and 1 (1 other values)", 1, true), err)
    ok, err = pcall(fsdp.set_mask, w, fsdp.ones{3, 3})
    assert.truthy(tostring(err):find("fsdp.set_mask: blocks.1.mlp.fc.weight: the mask has shape "
      .. "(3, 3), the parameter (64, 16)", 1, true), err)
    ok, err = pcall(fsdp.set_mask, w, 1)
    assert.truthy(tostring(err):find("the mask must be a tensor", 1, true), err)
    assert.is_nil(fsdp.mask(w))
    fsdp.unwrap(m)
  end)

  it("mask.set_local checks every slice before setting any", function()
    for _, wrap in ipairs{false, true} do
      local m = wrap and wrapped() or gpt()
      local a, b = m.blocks[1].mlp.fc.weight, m.blocks[2].mlp.fc.weight
      local sa, sb = fsdp.ones{fsdp.shard(a):numel()}, fsdp.ones{fsdp.shard(b):numel()}
      sb:view{sb:numel()}:narrow(1, 1, 1):fill(2)
      local ok, err = pcall(mask.set_local, m, {[a] = sa, [b] = sb})
      assert.is_false(ok)
      assert.truthy(tostring(err):find("mask.set_local: blocks.2.mlp.fc.weight: the mask must hold "
        .. "only 0 and 1", 1, true), err)
      assert.is_nil(fsdp.mask(a), "a mask was set before the bad slice was found")
      ok, err = pcall(mask.set_local, m, {[a] = fsdp.ones{3}})
      assert.truthy(tostring(err):find("mask.set_local: blocks.1.mlp.fc.weight: ", 1, true), err)
      mask.set_local(m, {[a] = sa})
      assert.are.same(flat(fsdp.ones(a:shape())), flat(fsdp.mask(a)))
      if wrap then fsdp.unwrap(m) end
    end
  end)

  it("reapply and set_local refuse a copy changed outside full_params / apply, changing nothing",
    function()
    local m, root = wrapped()
    local w = m.wpe.weight
    local mk = some_mask(w:shape(), 0.5, 41)
    fsdp.set_mask(w, mk)
    local before = values(m, w)
    local _ = nn.F.cross_entropy(m(ids), tgt) -- the root stays gathered
    w:fill(5)
    local ok, err = pcall(mask.reapply, m)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("mask.reapply: wpe.weight (masks not applied): unit '(root)' "
      .. "was changed while gathered", 1, true), err)
    ok, err = pcall(mask.set_local, m, {[w] = fsdp.ones{fsdp.shard(w):numel()}})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("mask.set_local: wpe.weight (no mask set): unit '(root)'", 1,
      true), err)
    assert.are.same(flat(mk), flat(fsdp.mask(w)))
    assert.is_true(root:dirty())
    -- not collective, so it cannot refresh the copy: refused while the unit holds one
    ok, err = pcall(mask.set_local_mask, w, 1, fsdp.ones{w:numel()})
    assert.truthy(tostring(err):find("mask.set_local_mask: wpe.weight: unit '(root)' holds a "
      .. "gathered copy", 1, true), err)
    root:reshard{discard = true}
    assert.are.same(before, values(m, w))
    -- with nothing changed both refresh the copy
    local _ = nn.F.cross_entropy(m(ids), tgt)
    mask.set_local(m, {[w] = fsdp.ones{fsdp.shard(w):numel()}})
    mask.reapply(m)
    assert.is_false(root:dirty())
    fsdp.unwrap(m)
  end)
end)

describe("fsdp.sparsity", function()
  it("counts zeros of every parameter (plain and wrapped give the same table)", function()
    local m = gpt()
    local w = m.blocks[1].mlp.fc.weight
    fsdp.set_mask(w, some_mask(w:shape(), 0.25, 17))
    local direct, total, zeros = {}, 0, 0
    for path, p in m:named_parameters() do
      local z = 0
      for _, x in ipairs(flat(p)) do if x == 0 then z = z + 1 end end
      direct[path] = z
      total, zeros = total + p:numel(), zeros + z
    end
    local s1 = fsdp.sparsity(m)
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local s2 = fsdp.sparsity(m)
    fsdp.unwrap(m)
    for _, s in ipairs{s1, s2} do
      assert.are.equal(total, s.total)
      assert.are.equal(zeros, s.zeros)
      assert.are.equal(zeros / total, s.sparsity)
      for path, z in pairs(direct) do assert.are.equal(z, s.params[path].zeros) end
      assert.is_true(s.params["blocks.1.mlp.fc.weight"].masked)
      assert.is_false(s.params["blocks.1.mlp.proj.weight"].masked)
    end
    assert.truthy(tostring(s2):find("blocks.1.mlp.fc.weight", 1, true))
  end)
end)

describe("masks on a meta model", function()
  it("apply as soon as materialize gives the parameter values", function()
    local fsdp = require "fsdp"
    local nn = fsdp.nn
    fsdp.manual_seed(1)
    local m = fsdp.meta(function() return nn.Linear(8, 8) end)
    local mask = fsdp.ones { 8, 8 }
    mask:set(1, 1, 0)
    mask:set(2, 3, 0)
    fsdp.set_mask(m.weight, mask)
    fsdp.materialize(m)
    assert.are.equal(0, m.weight:get(1, 1))
    assert.are.equal(0, m.weight:get(2, 3))
    assert.are_not.equal(0, m.weight:get(1, 2))
  end)
end)

describe("masks on a plain model moved to bf16 or f16 (model:to)", function()
  -- the mask stays f32 (0/1) while the weights and gradients have the parameter's dtype
  local function bits(t) return flat(t:to("f32")) end

  it("set_mask, reapply and the optimizer's masking keep masked weights exactly 0", function()
    for _, dt in ipairs{"bf16", "f16"} do
      fsdp.manual_seed(3)
      local m = nn.Linear(8, 8):to(dt)
      local before = bits(m.weight)
      local mask = some_mask({8, 8}, 0.4, 1)
      fsdp.set_mask(m.weight, mask)
      assert.are.equal(dt, m.weight:dtype())
      local w, mk = bits(m.weight), flat(mask)
      for i = 1, #mk do assert.are.equal(mk[i] == 0 and 0 or before[i], w[i]) end
      local opt = fsdp.optim.Lion(m, {lr = 0.05, weight_decay = 0.1})
      for _ = 1, 3 do
        opt:zero_grad()
        m(fsdp.randn{4, 8}:to(dt)):pow(2):sum():backward()
        fsdp.clip_grad_norm(m, 0.1)
        local g = bits(m.weight.grad)
        for i = 1, #mk do if mk[i] == 0 then assert.are.equal(0, g[i]) end end
        opt:step()
      end
      w = bits(m.weight)
      for i = 1, #mk do if mk[i] == 0 then assert.are.equal(0, w[i]) end end
      m.weight:detach():fill(1)
      require("fsdp.mask").reapply(m)
      w = bits(m.weight)
      for i = 1, #mk do assert.are.equal(mk[i], w[i]) end
      local kept = 0
      for _, v in ipairs(mk) do kept = kept + v end
      assert.are.equal(#mk - kept, fsdp.sparsity(m).params.weight.zeros)
    end
  end)

  it("a masked checkpoint loads into a bf16 model", function()
    local path = os.tmpname()
    os.remove(path)
    path = path .. ".safetensors"
    local a = gpt(true)
    fsdp.set_mask(a.blocks[1].mlp.fc.weight, some_mask({64, 16}, 0.5, 2))
    fsdp.save(a, path)
    local b = nn.GPT{vocab = 16, ctx = 8, d = 16, layers = 2, heads = 2}:to("bf16")
    fsdp.load(b, path)
    os.remove(path)
    local mk = flat(fsdp.mask(b.blocks[1].mlp.fc.weight))
    local w = bits(b.blocks[1].mlp.fc.weight)
    local wa = flat(a.blocks[1].mlp.fc.weight:to("bf16"):to("f32"))
    for i = 1, #mk do assert.are.equal(mk[i] == 0 and 0 or wa[i], w[i]) end
  end)

  it("pruning selects as on the f32 weights of the same values; f64 is refused by name", function()
    fsdp.manual_seed(5)
    local a = nn.GPT{vocab = 16, ctx = 8, d = 16, layers = 2, heads = 2}:to("bf16")
    fsdp.manual_seed(5)
    local b = nn.GPT{vocab = 16, ctx = 8, d = 16, layers = 2, heads = 2}:to("bf16"):to("f32")
    for _, m in ipairs{a, b} do
      fsdp.prune.magnitude(m, {params = "attn", sparsity = 0.6, scope = "global"})
      fsdp.prune.nm(m, {params = "mlp", n = 2, m = 4})
    end
    local pa, pb = a:parameters(), b:parameters()
    local masked = 0
    for i = 1, #pa do
      assert.are.equal("bf16", pa[i]:dtype())
      local ma, mb = fsdp.mask(pa[i]), fsdp.mask(pb[i])
      assert.are.equal(ma == nil, mb == nil)
      if ma then
        masked = masked + 1
        assert.are.same(flat(mb), flat(ma))
      end
      assert.are.same(flat(pb[i]), bits(pa[i]))
    end
    assert.are.equal(16, masked) -- per Block: qkv, proj (weights and biases), fc, proj (weights)
    local c = nn.Linear(4, 4):to("f64")
    local ok, err = pcall(fsdp.prune.magnitude, c, {sparsity = 0.5})
    assert.is_false(ok)
    local want = "prune.magnitude: weight is f64: pruning selects in f32, bf16 or f16"
    assert.truthy(tostring(err):find(want, 1, true), tostring(err))
    assert.is_nil(fsdp.mask(c.weight))
  end)
end)
