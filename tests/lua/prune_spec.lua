-- prune_spec.lua — pruning at world size 1 (lua/fsdp/prune.lua): magnitude (per parameter and
-- global) against a brute-force sort with exact counts and the tie-break, masked elements
-- first, N:M against a brute force, parameter selection and its errors, schedules (the cubic
-- GMP sparsities, every/stop, oneshot, nm, constant), the report. Plain and wrapped models
-- give the same masks. Multi-rank: tests/dist/prune_*.lua.
-- Run: busted --lua=luajit tests/lua/prune_spec.lua

local fsdp = require "fsdp"
require "fsdp.mask"
local prune = require "fsdp.prune"
local nn = fsdp.nn

local H = require "helpers"
local flat = H.flat_view

local function gpt()
  fsdp.manual_seed(3)
  return nn.GPT{vocab = 16, ctx = 8, d = 16, layers = 2, heads = 2}
end

local ids = fsdp.tensor{{1, 2, 3, 4, 5, 6}, {7, 8, 9, 10, 11, 12}}
local tgt = fsdp.tensor{{2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13}}

local function values(model, p)
  local out
  fsdp.full_params(model, function() out = flat(p) end, {writeback = false})
  return out
end

local function mask_of(p) return flat(fsdp.mask(p)) end

-- Brute force: the k smallest of the concatenated lists by (masked first, |v|, position).
local function brute(lists, masks, k)
  local all = {}
  for li, v in ipairs(lists) do
    for i, x in ipairs(v) do
      local masked = masks and masks[li] and masks[li][i] == 0
      all[#all + 1] = {li = li, i = i, key = masked and -1 or math.abs(x), pos = #all}
    end
  end
  table.sort(all, function(a, b)
    if a.key ~= b.key then return a.key < b.key end
    return a.pos < b.pos
  end)
  local out = {}
  for li, v in ipairs(lists) do
    out[li] = {}
    for i = 1, #v do out[li][i] = 1 end
  end
  for j = 1, k do out[all[j].li][all[j].i] = 0 end
  return out
end

-- Put values with many exact ties into the selected weights.
local function tie_values(model, paths)
  fsdp.full_params(model, function(m)
    for path, p in m:named_parameters() do
      for _, want in ipairs(paths) do
        if path == want then
          local v = {}
          for i = 1, p:numel() do v[i] = (((i * 13) % 7) - 3) * 0.125 end
          p:view{p:numel()}:copy(fsdp.tensor(v))
        end
      end
    end
  end)
end

local function by_path(model, path)
  for pth, p in model:named_parameters() do if pth == path then return p end end
end

describe("prune.magnitude", function()
  for _, wrapped in ipairs{false, true} do
    local how = wrapped and "wrapped" or "plain"
    it("per parameter: exactly round(s * numel), the smallest, ties by position (" .. how .. ")", function()
      local m = gpt()
      if wrapped then fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}}) end
      local paths = {"blocks.1.mlp.fc.weight", "blocks.2.attn.qkv.weight"}
      tie_values(m, {paths[1]})
      local before = {}
      for i, path in ipairs(paths) do before[i] = values(m, by_path(m, path)) end
      local res = prune.magnitude(m, {params = {"^blocks%.1%.mlp%.fc%.weight$", "^blocks%.2%.attn%.qkv%.weight$"},
        sparsity = 0.37})
      for i, path in ipairs(paths) do
        local p = by_path(m, path)
        local k = math.floor(0.37 * p:numel() + 0.5)
        assert.are.equal(k, res.params[path].pruned)
        assert.are.same(brute({before[i]}, nil, k)[1], mask_of(p))
        local v, mk = values(m, p), mask_of(p)
        for j = 1, #v do if mk[j] == 0 then assert.are.equal(0, v[j]) end end
      end
      if wrapped then fsdp.unwrap(m) end
    end)

    it("global: one threshold over the selection, exact count, ties by parameter order (" .. how .. ")", function()
      local m = gpt()
      if wrapped then fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}}) end
      local paths = {"blocks.1.attn.proj.weight", "blocks.1.mlp.proj.weight", "blocks.2.mlp.proj.weight"}
      tie_values(m, {paths[1], paths[3]})
      local before = {}
      for i, path in ipairs(paths) do before[i] = values(m, by_path(m, path)) end
      local res = prune.magnitude(m, {params = "proj%.weight", exclude = "blocks%.2%.attn", sparsity = 0.6,
        scope = "global"})
      local total = 0
      for i = 1, #paths do total = total + #before[i] end
      local k = math.floor(0.6 * total + 0.5)
      assert.are.equal(k, res.pruned)
      local want = brute(before, nil, k)
      local zeros = 0
      for i, path in ipairs(paths) do
        local mk = mask_of(by_path(m, path))
        assert.are.same(want[i], mk)
        for _, x in ipairs(mk) do if x == 0 then zeros = zeros + 1 end end
      end
      assert.are.equal(k, zeros)
      assert.is_nil(fsdp.mask(m.blocks[2].attn.proj.weight)) -- excluded
      if wrapped then fsdp.unwrap(m) end
    end)
  end

  it("prunes masked elements first: gradual pruning only adds zeros", function()
    local m = gpt()
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    local opt = fsdp.optim.SGD(m, {lr = 0.2, momentum = 0.9})
    local w = m.blocks[1].mlp.fc.weight
    local prev
    for _, s in ipairs{0.2, 0.4, 0.6, 0.8} do
      prune.magnitude(m, {params = "mlp%.fc%.weight", sparsity = s})
      local mk = mask_of(w)
      local zeros = 0
      for i, x in ipairs(mk) do
        if x == 0 then zeros = zeros + 1 end
        if prev and prev[i] == 0 then assert.are.equal(0, x) end
      end
      assert.are.equal(math.floor(s * w:numel() + 0.5), zeros)
      prev = mk
      for _ = 1, 2 do
        opt:zero_grad()
        nn.F.cross_entropy(m(ids), tgt):backward()
        opt:step()
      end
    end
    fsdp.unwrap(m)
  end)

  it("handles sparsity 0 and 1", function()
    local m = gpt()
    local w = m.blocks[1].mlp.fc.weight
    prune.magnitude(m, {params = "blocks%.1%.mlp%.fc%.weight", sparsity = 1})
    for _, x in ipairs(flat(w)) do assert.are.equal(0, x) end
    prune.magnitude(m, {params = "blocks%.1%.mlp%.fc%.weight", sparsity = 0})
    for _, x in ipairs(mask_of(w)) do assert.are.equal(1, x) end
  end)

  it("validates its options and names the parameters when a pattern matches none", function()
    local m = gpt()
    assert.has_error(function() prune.magnitude(m, {sparsity = 1.5}) end)
    assert.has_error(function() prune.magnitude(m, {sparsity = 0.5, scope = "layer"}) end)
    local ok, err = pcall(prune.magnitude, m, {params = {"mlp%.fc%.weight", "mlp%.fcc"}, sparsity = 0.5})
    assert.is_false(ok)
    assert.truthy(tostring(err):find('"mlp%.fcc" matches no parameter', 1, true))
    assert.truthy(tostring(err):find("blocks.2.mlp.proj.weight", 1, true)) -- lists them
    assert.has_error(function() prune.magnitude(m, {params = "mlp", exclude = "mlp", sparsity = 0.5}) end)
  end)

  it("selects every parameter with 2+ dimensions by default", function()
    local m = gpt()
    prune.magnitude(m, {sparsity = 0.5})
    for path, p in m:named_parameters() do
      if #p:shape() >= 2 then assert.is_not_nil(fsdp.mask(p), path) else assert.is_nil(fsdp.mask(p), path) end
    end
  end)
end)

describe("pruning a gathered unit", function()
  local function wrapped() return H.wrap_blocks(gpt()) end

  it("refuses a copy written outside full_params / apply, recording and pruning nothing", function()
    local m, root = wrapped()
    local w = m.wpe.weight -- the root unit's (8, 16)
    local before = values(m, w)
    local calls = {
      {"prune.magnitude", function() prune.magnitude(m, {params = "wpe", sparsity = 0.5}) end},
      {"prune.nm", function() prune.nm(m, {params = "wpe", n = 2, m = 4}) end},
      {"prune.hold", function() prune.hold(m, {params = "wpe"}) end},
    }
    for _, c in ipairs(calls) do
      local _ = nn.F.cross_entropy(m(ids), tgt) -- the root stays gathered for the backward
      w:fill(5) -- a stray write: no walk will write it back
      local ok, err = pcall(c[2])
      assert.is_false(ok, c[1])
      err = tostring(err)
      assert.truthy(err:find(c[1] .. ": wpe.weight (nothing pruned): unit '(root)' was changed "
        .. "while gathered", 1, true), err)
      assert.truthy(err:find("u:reshard{discard = true}", 1, true), err)
      assert.is_nil(fsdp.mask(w), c[1])
      assert.is_true(root:dirty(), c[1] .. ": the write was adopted")
      root:reshard{discard = true}
      assert.are.same(before, values(m, w))
    end
    -- with nothing changed, pruning a gathered unit refreshes its copy
    local _ = nn.F.cross_entropy(m(ids), tgt)
    prune.magnitude(m, {params = "wpe", sparsity = 0.5})
    local live, mk = flat(w), mask_of(w)
    for i = 1, #mk do if mk[i] == 0 then assert.are.equal(0, live[i]) end end
    assert.is_false(root:dirty())
    fsdp.unwrap(m)
  end)

  it("inside fsdp.apply / full_params prunes the shards and masks the live copy, keeping fn's "
    .. "writes", function()
    local m = wrapped()
    local w = m.wpe.weight
    local n = w:numel()
    local ramp = {}
    for j = 1, n do ramp[j] = j end
    local function set_ramp()
      fsdp.full_params(m, function() w:copy(fsdp.tensor(ramp):view(w:shape())) end)
    end
    set_ramp()
    local live
    fsdp.apply(m, function(mod)
      if mod == m then
        w:fill(2) -- fn's write: pruned by the shards' values, masked, written back
        prune.magnitude(m, {params = "wpe", sparsity = 0.5})
        live = flat(w)
      end
    end)
    local v = values(m, w)
    for j = 1, n do
      local want = j <= n / 2 and 0 or 2
      assert.are.equal(want, live[j])
      assert.are.equal(want, v[j])
    end
    -- without writeback fn's write is dropped, the pruning kept
    fsdp.set_mask(w, nil)
    set_ramp()
    fsdp.full_params(m, function()
      w:fill(3)
      prune.hold(m, {params = "wpe"}) -- nothing is zero: no element masked
      prune.nm(m, {params = "wpe", n = 3, m = 4})
      live = flat(w)
    end, {writeback = false})
    v = values(m, w)
    for j = 1, n do
      local keep = (j - 1) % 4 ~= 0 -- the smallest of every 4 goes (by the shards' ramp)
      assert.are.equal(keep and 3 or 0, live[j])
      assert.are.equal(keep and j or 0, v[j])
    end
    fsdp.unwrap(m)
  end)
end)

describe("prune.nm", function()
  for _, wrapped in ipairs{false, true} do
    it("keeps the n largest of every m along the last dimension (" .. (wrapped and "wrapped" or "plain") .. ")", function()
      local m = gpt()
      if wrapped then fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}}) end
      local w = m.blocks[2].mlp.fc.weight -- (64, 16)
      tie_values(m, {"blocks.2.mlp.fc.weight"})
      local v = values(m, w)
      local res = prune.nm(m, {params = "blocks%.2%.mlp%.fc%.weight", n = 2, m = 4})
      assert.are.equal(w:numel() / 4, res.groups)
      assert.are.equal(0, res.cut_groups) -- world size 1
      local mk = mask_of(w)
      for g = 0, w:numel() / 4 - 1 do
        local grp = {}
        for j = 1, 4 do grp[j] = v[g * 4 + j] end
        local want = brute({grp}, nil, 2)[1]
        for j = 1, 4 do assert.are.equal(want[j], mk[g * 4 + j]) end
      end
      if wrapped then fsdp.unwrap(m) end
    end)
  end

  it("refuses a last dimension that m does not divide, and bad n/m", function()
    local m = gpt()
    local ok, err = pcall(prune.nm, m, {params = "blocks%.1%.mlp%.fc%.weight", n = 2, m = 5})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("not a multiple of m = 5", 1, true))
    assert.has_error(function() prune.nm(m, {params = "mlp", n = 5, m = 4}) end)
  end)
end)

describe("prune.schedule", function()
  it("follows the cubic GMP schedule on its grid, then holds", function()
    local m = gpt()
    local s = prune.schedule{{kind = "gmp", params = "mlp%.fc%.weight", start = 10, stop = 40, every = 7,
      init = 0.1, final = 0.7}}
    local w = m.blocks[1].mlp.fc.weight
    local ran_at = {}
    for t = 0, 60 do
      local ran = s:step(m, t)
      if ran then
        ran_at[#ran_at + 1] = t
        local p = math.min(1, (t - 10) / 30)
        local want = 0.7 + (0.1 - 0.7) * (1 - p) ^ 3
        assert.is_true(math.abs(ran[1].sparsity - want) < 1e-12)
        local zeros = 0
        for _, x in ipairs(mask_of(w)) do if x == 0 then zeros = zeros + 1 end end
        assert.are.equal(math.floor(want * w:numel() + 0.5), zeros)
      end
    end
    assert.are.same({10, 17, 24, 31, 38, 40}, ran_at)
    assert.are.equal(0.7, prune.gmp_sparsity({start = 10, stop = 40, init = 0.1, final = 0.7}, 99))
  end)

  it("runs oneshot, nm and constant once at their step", function()
    local m = gpt()
    local hold = m.blocks[2].attn.qkv.weight
    fsdp.full_params(m, function() hold:narrow(1, 1, 3):fill(0) end)
    local s = prune.schedule{
      {kind = "oneshot", params = "attn%.proj%.weight", at = 2, sparsity = 0.5, scope = "global"},
      {kind = "nm", params = "mlp%.proj%.weight", at = 3, n = 1, m = 4},
      {kind = "constant", params = "blocks%.2%.attn%.qkv%.weight", start = 1},
    }
    local kinds = {}
    for t = 0, 5 do
      for _, ev in ipairs(s:step(m, t) or {}) do kinds[#kinds + 1] = ev.kind .. "@" .. ev.step end
    end
    assert.are.same({"constant@1", "oneshot@2", "nm@3"}, kinds)
    local zeros = 0
    for _, x in ipairs(mask_of(hold)) do if x == 0 then zeros = zeros + 1 end end
    assert.are.equal(3 * 16, zeros) -- the three zero rows are held
    local sp = fsdp.sparsity(m)
    assert.are.equal(0.75, sp.params["blocks.1.mlp.proj.weight"].sparsity)
  end)

  it("checks modifiers; patterns matching nothing list the parameters", function()
    assert.has_error(function() prune.schedule{{kind = "magic"}} end)
    assert.has_error(function() prune.schedule{{kind = "gmp", start = 5, stop = 5}} end)
    assert.has_error(function() prune.schedule{{kind = "gmp", stop = 5, final = 2}} end)
    local s = prune.schedule{{kind = "gmp", params = "nothing%.here", stop = 5}}
    local ok, err = pcall(s.step, s, gpt(), 0)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("modifier 1 (gmp)", 1, true))
    assert.truthy(tostring(err):find("wte.weight", 1, true))
  end)
end)

describe("prune.report", function()
  it("totals, prunable figures and a readable table; an excluded parameter shows 0%", function()
    local m = gpt()
    prune.magnitude(m, {params = {"attn%.proj%.weight", "mlp%.fc%.weight"}, exclude = "blocks%.2%.mlp",
      sparsity = 0.5})
    local r = prune.report(m, {params = {"attn%.proj%.weight", "mlp%.fc%.weight"}})
    local direct = 0
    for _, p in ipairs(m:parameters()) do
      for _, x in ipairs(flat(p)) do if x == 0 then direct = direct + 1 end end
    end
    assert.are.equal(direct, r.sparse)
    assert.are.equal(m:num_parameters(), r.total)
    assert.are.equal(0, r.params["blocks.2.mlp.fc.weight"].sparsity)
    assert.are.equal(0.5, r.params["blocks.1.mlp.fc.weight"].sparsity)
    local pr = 0
    for _, path in ipairs{"blocks.1.attn.proj.weight", "blocks.2.attn.proj.weight", "blocks.1.mlp.fc.weight",
      "blocks.2.mlp.fc.weight"} do pr = pr + r.params[path].numel end
    assert.are.equal(pr, r.prunable)
    local text = tostring(r)
    assert.truthy(text:find("blocks%.2%.mlp%.fc%.weight%s+1024%s+0%.00%%"))
    local j = r:json()
    assert.are.equal(r.prunable, j.params_summary.prunable)
    assert.is_true(j.params_info["blocks.1.mlp.fc.weight"].prunable)
    assert.truthy(fsdp.log.json(j):find('"params_summary"', 1, true))
  end)
end)
