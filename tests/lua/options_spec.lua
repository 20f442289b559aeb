-- options_spec.lua — every options table of the library refuses an unknown key, naming the
-- function, the key and the valid keys (util.check_opts), and the values that cannot be right
-- are refused naming the option. One case per table; the optimizers' and fsdp.wrap's are in
-- optim_spec.lua and wrap_spec.lua.
-- Run: busted --lua=luajit tests/lua/options_spec.lua
local fsdp = require "fsdp"
local nn = fsdp.nn
local data = require "fsdp.data"
local H = require "helpers"
teardown(H.remove_temps)
local errors_with = H.assert_error_has

local function text_file()
  local path = H.mktemp_dir() .. "/t.txt"
  local f = assert(io.open(path, "wb"))
  f:write(("the quick brown fox jumps over the lazy dog\n"):rep(20))
  f:close()
  return path
end

describe("unknown option keys", function()
  local cases = {
    {"fsdp.log.setup", function() fsdp.log.setup{jsnol = "x"} end, "jsnol"},
    {"fsdp.data.text", function() data.text(text_file(), {ctx = 8, batch = 2, splt = "val"}) end,
      "splt", "batch, ctx, rank, seed, split, val_fraction, world_size"},
    {"fsdp.data.fashion_mnist", function() data.fashion_mnist{splt = "test", batch = 2} end,
      "splt", "batch, dir, limit, rank, seed, shuffle, split, world_size"},
    {"read_idx", function() data.read_idx("/nonexistent", {limt = 3}) end, "limt", "dtype, limit, scale"},
    {"fashion_mnist:epoch", function()
      data.FashionMNIST.epoch(setmetatable({batch = 2, n = 0}, data.FashionMNIST), {bacth = 2})
    end, "bacth", "batch"},
    {"text:epoch", function()
      local t = data.text(text_file(), {ctx = 8, batch = 2})
      t:epoch{max_batchs = 2}
    end, "max_batchs", "batch, max_batches"},
    {"nn.Linear", function() nn.Linear(4, 4, {bais = false}) end, "bais", "bias"},
    {"nn.LayerNorm", function() nn.LayerNorm(4, {epps = 1e-6}) end, "epps", "bias, eps"},
    {"nn.CausalSelfAttention", function() nn.CausalSelfAttention(8, 2, {dropuot = 0.1}) end,
      "dropuot", "dropout"},
    {"nn.MLP", function() nn.MLP(8, 16, {dropuot = 0.1}) end, "dropuot", "dropout"},
    {"nn.Block", function() nn.Block(8, 2, {hiden = 16}) end, "hiden", "dropout, eps, hidden"},
    {"nn.GPT", function() nn.GPT{vocab = 16, ctx = 8, d = 8, layers = 1, heads = 2, tei = true} end,
      "tei", "ctx, d, dropout, eps, heads, hidden, layers, tie, vocab"},
    {"GPT:generate", function()
      nn.GPT{vocab = 16, ctx = 8, d = 8, layers = 1, heads = 2}:generate({1}, {max_new_tokens = 2, temprature = 1})
    end, "temprature", "cache, max_new_tokens, seed, temperature, top_k, top_p"},
    {"cross_entropy", function() nn.F.cross_entropy(fsdp.randn{2, 3}, fsdp.tensor{0, 1}, {ignore = 1}) end,
      "ignore", "ignore_index"},
    {"prune.magnitude", function() fsdp.prune.magnitude(nn.Linear(4, 4), {sparsty = 0.5}) end,
      "sparsty", "exclude, params, scope, sparsity"},
    {"prune.nm", function() fsdp.prune.nm(nn.Linear(4, 4), {n = 2, mm = 4}) end, "mm", "exclude, m, n, params"},
    {"prune.hold", function() fsdp.prune.hold(nn.Linear(4, 4), {paramz = "weight"}) end, "paramz", "exclude, params"},
    {"prune.report", function() fsdp.prune.report(nn.Linear(4, 4), {paramz = "weight"}) end, "paramz",
      "exclude, params"},
    {"prune.schedule: modifier 1 (gmp)", function()
      fsdp.prune.schedule{{kind = "gmp", start = 1, stop = 5, final = 0.5, scpoe = "param"}}
    end, "scpoe", "every, exclude, final, init, kind, params, scope, start, stop"},
    {"prune.schedule: modifier 2 (nm)", function()
      fsdp.prune.schedule{{kind = "constant"}, {kind = "nm", at = 3, sparsity = 0.5}}
    end, "sparsity", "at, exclude, kind, m, n, params, start"},
    {"fsdp.sparsity", function() fsdp.sparsity(nn.Linear(4, 4), {paramz = "weight"}) end, "paramz", "exclude, params"},
    {"fsdp.inspect", function() fsdp.inspect(nn.Linear(4, 4).weight, {modle = 1}) end, "modle", "model"},
    {"fsdp.save", function() fsdp.save(nn.Linear(2, 2), "/nonexistent-dir/never.safetensors", {fromat = "x"}) end,
      "fromat", "extra, format, loader, loaders, optimizer, schedule, step"},
    {"fsdp.load", function() require("fsdp.meta").load_tensors(nn.Linear(2, 2), {}, {strct = false}) end,
      "strct", "strict"},
    {"fsdp.materialize", function()
      fsdp.materialize(fsdp.meta(function() return nn.Linear(2, 2) end), {int = 1})
    end, "int", "device, init"},
    {"fsdp.plot.svg", function() fsdp.plot.svg({{step = 1, time = 0, loss = 1}}, {tilte = "x"}) end,
      "tilte", "log, loss_height, metrics, name, panel_height, title, width, x"},
  }
  for _, c in ipairs(cases) do
    local fn, call, key, valid = c[1], c[2], c[3], c[4]
    it(fn .. " refuses '" .. key .. "'", function()
      errors_with(call, ("%s: unknown option '%s'"):format(fn, key), valid and ("(valid: " .. valid .. ")") or "(valid:")
    end)
  end
  it("a refusal names the caller's line, not the library's", function()
    local err = errors_with(function() nn.Linear(4, 4, {bais = false}) end, "nn.Linear: unknown option")
    assert.truthy(err:find("options_spec.lua:%d+: nn.Linear"), err)
  end)
end)

describe("option values", function()
  it("nn: bias and tie must be booleans, eps positive", function()
    errors_with(function() nn.Linear(4, 4, {bias = 0}) end, "nn.Linear: bias must be true or false (got 0)")
    errors_with(function() nn.LayerNorm(4, {bias = "no"}) end, "nn.LayerNorm: bias must be true or false (got no)")
    errors_with(function() nn.LayerNorm(4, {eps = 0}) end, "nn.LayerNorm: eps must be a positive number (got 0)")
    errors_with(function() nn.LayerNorm(4, {eps = -1e-5}) end, "nn.LayerNorm: eps must be a positive number")
    errors_with(function() nn.GPT{vocab = 16, ctx = 8, d = 8, layers = 1, heads = 2, tie = 1} end,
      "nn.GPT: tie must be true or false (got 1)")
    assert.is_nil(nn.Linear(4, 4, {bias = false}).bias)
  end)
  it("generate: max_new_tokens, temperature, top_k and top_p in range", function()
    local g = nn.GPT{vocab = 16, ctx = 8, d = 8, layers = 1, heads = 2}
    errors_with(function() g:generate({1}, {max_new_tokens = -1}) end,
      "GPT:generate: max_new_tokens must be an integer >= 0 (got -1)")
    errors_with(function() g:generate({1}, {max_new_tokens = 1.5}) end,
      "GPT:generate: max_new_tokens must be an integer >= 0 (got 1.5)")
    errors_with(function() g:generate({1}, {}) end, "GPT:generate: max_new_tokens is required")
    errors_with(function() g:generate({1}, {max_new_tokens = 2, top_p = 0}) end,
      "GPT:generate: top_p must be a number in (0, 1] (got 0)")
    errors_with(function() g:generate({1}, {max_new_tokens = 2, temperature = -1}) end,
      "GPT:generate: temperature must be a finite number >= 0 (got -1)")
    errors_with(function() g:generate({1}, {max_new_tokens = 2, top_k = 0}) end, "GPT:generate: top_k must be an integer >= 1 (got 0)")
    assert.equal(3, #g:generate({1}, {max_new_tokens = 2, temperature = 0, top_k = 3}))
  end)
  it("data: a seed must be an integer", function()
    errors_with(function() data.text(text_file(), {ctx = 8, batch = 2, seed = "x"}) end,
      "fsdp.data.text: seed must be an integer, got x")
    errors_with(function() data.text(text_file(), {ctx = 8, batch = 2, seed = 0.5}) end,
      "fsdp.data.text: seed must be an integer, got 0.5")
  end)
  it("plot: panel heights in range", function()
    errors_with(function() fsdp.plot.svg({{step = 1, time = 0, loss = 1}}, {loss_height = -5}) end,
      "fsdp.plot.svg: loss_height must be a number in [50, 10000], got -5")
    errors_with(function() fsdp.plot.svg({{step = 1, time = 0, loss = 1}}, {panel_height = "big"}) end,
      "fsdp.plot.svg: panel_height must be a number in [50, 10000], got big")
  end)
  it("sparsity: exclude needs params", function()
    errors_with(function() fsdp.sparsity(nn.Linear(4, 4), {exclude = "bias"}) end,
      "fsdp.sparsity: exclude needs params")
    assert.equal(16, fsdp.sparsity(nn.Linear(4, 4), {params = "weight"}).total)
  end)
end)
