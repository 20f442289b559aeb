-- generate_spec.lua — nn.GPT's key/value cache (GPT:new_cache, forward(ids, cache)) and
-- GPT:generate (lua/fsdp/nn/gpt.lua, lua/fsdp/nn/layers.lua) at world size 1. Several ranks:
-- tests/dist/hf_ranks.lua. Run: busted --lua=luajit tests/lua/generate_spec.lua

local fsdp = require "fsdp"
local nn = fsdp.nn
local H = require "helpers"

local errors_with = H.assert_error_has

-- A small GPT whose weights are large enough that its text is no constant.
local function model(cfg)
  fsdp.manual_seed(11)
  local c = {vocab = 40, ctx = 16, d = 32, layers = 2, heads = 4, tie = false}
  for k, v in pairs(cfg or {}) do c[k] = v end
  local m = nn.GPT(c)
  fsdp.no_grad(function()
    for _, p in ipairs(m:parameters()) do p:copy(fsdp.randn(p:shape()) * 0.3) end
  end)
  return m
end

-- position i of (B, T, V) logits, as (B, V)
local function row(t, i)
  local s = t:shape()
  return t:narrow(2, i, 1):contiguous():view{s[1], s[3]}
end

describe("the key/value cache", function()
  it("gives the logits of the whole sequence, one token at a time", function()
    local m = model():eval()
    local ids = fsdp.tensor({{3, 1, 4, 1, 5, 9, 2, 6, 5, 3}, {2, 7, 1, 8, 2, 8, 1, 8, 2, 8}}, {dtype = "i64"})
    local full = fsdp.no_grad(function() return m(ids) end)
    local cache = m:new_cache()
    fsdp.no_grad(function()
      local first = m(ids:narrow(2, 1, 4), cache) -- the prompt at once
      assert.are.equal(4, cache.pos)
      for t = 1, 4 do H.assert_close(row(first, t), row(full, t), 1e-5, "prompt " .. t) end
      for t = 5, 10 do
        local step = m(ids:narrow(2, t, 1), cache)
        H.assert_close(row(step, 1), row(full, t), 1e-5, "token " .. t)
      end
    end)
    assert.are.equal(10, cache.pos)
    -- past the context, and more than one token after the prompt: named errors
    errors_with(function()
      fsdp.no_grad(function() m(fsdp.tensor({{1, 2, 3, 4, 5, 6, 7}}, {dtype = "i64"}), cache) end)
    end, "sequence length T=7 after 10 cached tokens exceeds the model's context ctx=16")
    errors_with(function() m:new_cache(2) end, "GPT:new_cache: takes no arguments")
    local c2 = m:new_cache()
    fsdp.no_grad(function() m(fsdp.tensor({{1, 2}}, {dtype = "i64"}), c2) end)
    errors_with(function()
      fsdp.no_grad(function() m(fsdp.tensor({{1, 2}}, {dtype = "i64"}), c2) end)
    end, "2 new tokens at position 2 (one at a time after the prompt)")
    -- another batch size than the cache's, and a table that is no cache: named, not a copy's
    -- shape mismatch or an index error inside the library
    errors_with(function()
      fsdp.no_grad(function() m(fsdp.tensor({{1}, {2}}, {dtype = "i64"}), c2) end)
    end, "attention cache: 2 rows, but the cache holds 1 (one cache per batch")
    errors_with(function()
      fsdp.no_grad(function() m(fsdp.tensor({{1}}, {dtype = "i64"}), {}) end)
    end, "GPT: expected a cache made by this model's new_cache() (got a table that is none)")
    -- another model of the same architecture: its cache holds that model's keys and values
    local other = model()
    local c3 = other:new_cache()
    assert.is_true(rawequal(other, c3.model))
    fsdp.no_grad(function() other(fsdp.tensor({{1, 2}}, {dtype = "i64"}), c3) end)
    errors_with(function()
      fsdp.no_grad(function() m(fsdp.tensor({{3}}, {dtype = "i64"}), c3) end)
    end, "GPT: the cache was made by another model's new_cache() (a cache is for the model that made it)")
    -- ids that are no tensor: named, not an index error inside the library
    errors_with(function() m({{1, 2}}) end, "GPT: expected ids, a (B, T) tensor (got a table)")
    -- with gradients recorded the cache would give wrong ones (its copies are not recorded)
    errors_with(function() m(fsdp.tensor({{1, 2}}, {dtype = "i64"}), m:new_cache()) end,
      "GPT: the key/value cache records nothing for backward: call the model with a cache under fsdp.no_grad")
    cache:free()
    assert.are.equal(0, cache.pos)
    assert.is_nil(cache.layers[1].k)
  end)
end)

describe("GPT:generate", function()
  it("samples the same tokens with and without the cache", function()
    local m = model()
    local cases = {
      {max_new_tokens = 10, temperature = 0},
      {max_new_tokens = 25, temperature = 0}, -- past ctx = 16: the window slides
      {max_new_tokens = 12, temperature = 0.8, seed = 7},
      {max_new_tokens = 12, temperature = 1.3, top_k = 5, seed = 8},
      {max_new_tokens = 20, temperature = 1, top_p = 0.7, seed = 9},
    }
    for i, c in ipairs(cases) do
      local with = m:generate({1, 2, 3}, c)
      local o = {cache = false}
      for k, v in pairs(c) do o[k] = v end
      assert.are.same(with, m:generate({1, 2, 3}, o), "case " .. i)
      assert.are.equal(3 + c.max_new_tokens, #with)
    end
    -- the greedy text is no constant (the comparison can fail)
    local g = m:generate({1, 2, 3}, {max_new_tokens = 10, temperature = 0})
    local distinct = {}
    for i = 4, #g do distinct[g[i]] = true end
    local n = 0
    for _ in pairs(distinct) do n = n + 1 end
    assert.is_true(n > 2, table.concat(g, " "))
  end)

  it("is reproducible with a seed, differs without, and restores the training flag", function()
    local m = model():train()
    local o = {max_new_tokens = 15, temperature = 1, seed = 3}
    local a = m:generate(fsdp.tensor{{5, 6}}, o)
    assert.are.same(a, m:generate({5, 6}, o))
    assert.is_true(m.training)
    local b = m:generate({5, 6}, {max_new_tokens = 15, temperature = 1, seed = 4})
    assert.are_not.same(a, b)
    local c1 = m:generate({5, 6}, {max_new_tokens = 15})
    local c2 = m:generate({5, 6}, {max_new_tokens = 15})
    assert.are_not.same(c1, c2)
    -- the older form generate(ids, n, opts)
    assert.are.same(a, m:generate({5, 6}, 15, {temperature = 1, seed = 3}))
    assert.are.same({5, 6}, m:generate({5, 6}, {max_new_tokens = 0}))
  end)

  it("keeps only the top_k most likely ids", function()
    local m = model():eval()
    local last = fsdp.no_grad(function() return m(fsdp.tensor({{7, 8}}, {dtype = "i64"})) end)
    last = row(last, 2):totable()[1]
    local order = {}
    for i = 1, #last do order[i] = i - 1 end
    table.sort(order, function(a, b) return last[a + 1] > last[b + 1] end)
    local top = {[order[1]] = true, [order[2]] = true, [order[3]] = true}
    local seen = {}
    for s = 1, 40 do
      local out = m:generate({7, 8}, {max_new_tokens = 1, temperature = 5, top_k = 3, seed = s})
      assert.is_true(top[out[3]], "id " .. out[3] .. " is not among the top 3")
      seen[out[3]] = true
    end
    local n = 0
    for _ in pairs(seen) do n = n + 1 end
    assert.are.equal(3, n) -- at temperature 5 all three come up
    -- top_k 1 is greedy
    assert.are.same(m:generate({7, 8}, {max_new_tokens = 6, temperature = 0}),
      m:generate({7, 8}, {max_new_tokens = 6, temperature = 2, top_k = 1, seed = 1}))
  end)

  it("draws from the nucleus (top_p) of the distribution", function()
    local draw = nn.GPT.draw
    local logits = {math.log(1), math.log(3), math.log(6)} -- p = 0.1, 0.3, 0.6
    -- top_p 0.5: only id 2 (0.6 >= 0.5); any u
    for _, u in ipairs{0, 0.3, 0.99} do assert.are.equal(2, draw(logits, 1, nil, u, 0.5)) end
    -- top_p 0.8: ids 1 and 2 renormalised to 1/3, 2/3 (cumulative in id order)
    assert.are.equal(1, draw(logits, 1, nil, 0.3, 0.8))
    assert.are.equal(2, draw(logits, 1, nil, 0.4, 0.8))
    -- top_p 1 and none: everything
    assert.are.equal(0, draw(logits, 1, nil, 0.05, 1))
    assert.are.equal(0, draw(logits, 1, nil, 0.05))
    -- with top_k first: top_k 2 leaves 0.3, 0.6 -> 1/3, 2/3; top_p 0.6 keeps id 2 only
    assert.are.equal(2, draw(logits, 1, 2, 0.0, 0.6))
    -- the most likely id always stays, however small top_p
    assert.are.equal(2, draw(logits, 1, nil, 0.0, 1e-9))
    -- equal weights: the lower id is the more likely one
    assert.are.equal(0, draw({0, 0, 0}, 1, nil, 0.9, 0.2))
  end)

  it("gives +inf logits all the probability and refuses a NaN logit", function()
    local draw = nn.GPT.draw
    local inf = math.huge
    for _, u in ipairs{0, 0.5, 0.99} do
      assert.are.equal(0, draw({inf, 1, 5}, 1, nil, u))
      assert.are.equal(0, draw({inf, 1, 5}, 1, 2, u, 0.5))
    end
    assert.are.equal(0, draw({inf, 1, 5}, 0, nil, 0.5))
    -- two +inf logits share it evenly
    assert.are.equal(1, draw({1, inf, 3, inf}, 1, nil, 0.4))
    assert.are.equal(3, draw({1, inf, 3, inf}, 1, nil, 0.6))
    -- -inf logits never come up; all -inf share it evenly
    for _, u in ipairs{0, 0.5, 0.99} do assert.are.equal(1, draw({-inf, 0, -inf}, 1, nil, u)) end
    assert.are.equal(0, draw({-inf, -inf}, 1, nil, 0.4))
    assert.are.equal(1, draw({-inf, -inf}, 1, nil, 0.6))
    errors_with(function() draw({0, 0 / 0, 1}, 1, nil, 0.5) end,
      "GPT:generate: the logit of id 1 is nan (the model's output is not finite)")
    errors_with(function() draw({0, 0 / 0, 1}, 0, nil, 0.5) end, "the logit of id 1 is nan")
  end)

  it("refuses bad options, naming them", function()
    local m = model()
    errors_with(function() m:generate({1}, {}) end, "GPT:generate: max_new_tokens is required")
    errors_with(function() m:generate({1}, {max_new_tokens = 1, topk = 2}) end,
      "GPT:generate: unknown option 'topk' (valid: cache, max_new_tokens, seed, temperature, top_k, top_p)")
    errors_with(function() m:generate({1}, {max_new_tokens = -1}) end, "max_new_tokens must be an integer >= 0")
    errors_with(function() m:generate({1}, {max_new_tokens = 1, top_k = 0}) end, "top_k must be an integer >= 1")
    errors_with(function() m:generate({1}, {max_new_tokens = 1, top_p = 0}) end, "top_p must be a number in (0, 1]")
    errors_with(function() m:generate({1}, {max_new_tokens = 1, top_p = 1.5}) end, "top_p must be a number in (0, 1]")
    errors_with(function() m:generate({1}, {max_new_tokens = 1, temperature = -1}) end,
      "temperature must be a finite number >= 0")
    errors_with(function() m:generate({1}, {max_new_tokens = 1, temperature = 0 / 0}) end,
      "GPT:generate: temperature must be a finite number >= 0 (got nan)")
    errors_with(function() m:generate({1}, {max_new_tokens = 1, temperature = math.huge}) end,
      "GPT:generate: temperature must be a finite number >= 0 (got inf)")
    errors_with(function() m:generate({1}, {max_new_tokens = 1, seed = 2 ^ 62}) end,
      "GPT:generate: seed must be an integer in [0, 2^53] (got 4.6116860184274e+18)")
    errors_with(function() m:generate({1}, {max_new_tokens = math.huge}) end,
      "GPT:generate: max_new_tokens must be an integer >= 0 (got inf)")
    errors_with(function() m:generate({}, {max_new_tokens = 1}) end, "GPT:generate: empty prompt")
    errors_with(function() m:generate({1}, {max_new_tokens = 1, cache = "no"}) end,
      "GPT:generate: cache must be a boolean (got no)")
    -- a batch of prompts, or ids that are not integers, are refused rather than flattened or kept
    errors_with(function() m:generate(fsdp.tensor{{1, 2}, {3, 4}}, {max_new_tokens = 1}) end,
      "GPT:generate: the prompt must be one sequence, a (T) or (1, T) tensor (got (2, 2))")
    errors_with(function() m:generate({{1, 2}, {3, 4}}, {max_new_tokens = 1}) end,
      "GPT:generate: prompt id 1 must be an integer (got table")
    errors_with(function() m:generate({1.5, 2}, {max_new_tokens = 1}) end,
      "GPT:generate: prompt id 1 must be an integer (got 1.5)")
    errors_with(function() m:generate({1, "2"}, {max_new_tokens = 1}) end,
      "GPT:generate: prompt id 2 must be an integer (got 2)")
    assert.are.same(m:generate({5, 6}, {max_new_tokens = 2, temperature = 0}),
      m:generate({{5, 6}}, {max_new_tokens = 2, temperature = 0}))
  end)

  it("samples from a wrapped model the tokens of the plain one", function()
    local m = model()
    local plain = {}
    local cases = {{max_new_tokens = 20, temperature = 0}, {max_new_tokens = 20, temperature = 0.9,
      top_p = 0.9, seed = 2}}
    for i, c in ipairs(cases) do plain[i] = m:generate({4, 5, 6}, c) end
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    for i, c in ipairs(cases) do assert.are.same(plain[i], m:generate({4, 5, 6}, c)) end
  end)
end)
