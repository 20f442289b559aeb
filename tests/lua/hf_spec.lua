-- hf_spec.lua — fsdp.import_hf / fsdp.export_hf (lua/fsdp/hf.lua) at world size 1, against a
-- GPT-2 made and run by transformers (tests/fixtures/hf_gpt2: make_fixture.py wrote it).
-- Several ranks: tests/dist/hf_ranks.lua. Run: busted --lua=luajit tests/lua/hf_spec.lua

local fsdp = require "fsdp"
local core = fsdp.core
local nn = fsdp.nn
local H = require "helpers"
teardown(H.remove_temps)

local errors_with = H.assert_error_has
local FIXTURE = "tests/fixtures/hf_gpt2/model"
local EXPECTED = "tests/fixtures/hf_gpt2/expected.safetensors"

local function expected()
  local r = core.st_open(EXPECTED)
  local e = {ids = r:read("input_ids"), logits = r:read("logits"), greedy = r:read("greedy"):totable()[1]}
  r:close()
  return e
end

local function max_diff(a, b) return (a - b):abs():max() end

local function logits(m, ids) return fsdp.no_grad(function() return m(ids) end) end

local function values(m)
  local out = {}
  for path, p in m:named_parameters() do out[path] = H.flat_view(p:detach()) end
  return out
end

-- the fixture's two files into dst (an existing folder), in Lua: no child process (which, in
-- the sanitizer build, starts with the ASan runtime preloaded)
local function copy_dir(src, dst)
  for _, name in ipairs{"config.json", "model.safetensors"} do
    local f = assert(io.open(src .. "/" .. name, "rb"))
    local bytes = f:read("*a")
    f:close()
    H.write_file(dst .. "/" .. name, bytes)
  end
end

-- A copy of the fixture whose config.json has `change` applied (keys set; false values kept).
local function with_config(change)
  local dir = H.mktemp_dir()
  copy_dir(FIXTURE, dir)
  local cfg = core.json_read(dir .. "/config.json")
  for k, v in pairs(change) do cfg[k] = v end
  core.json_write(dir .. "/config.json", cfg)
  return dir
end

-- A copy of the fixture whose weights file holds the fixture's tensors renamed by rename(name)
-- (nil drops one) plus `add` ({name = tensor}), stored as `dtypes` says ({name = dtype}).
local function with_tensors(rename, add, dtypes)
  local dir = H.mktemp_dir()
  copy_dir(FIXTURE, dir)
  local r = core.st_open(FIXTURE .. "/model.safetensors")
  local entries, data = {}, {}
  for _, e in ipairs(r:entries()) do
    local n = rename(e.name)
    if n then
      entries[#entries + 1] = {name = n, shape = e.shape, dtype = (dtypes or {})[n] or e.dtype}
      data[#data + 1] = r:read(e.name)
    end
  end
  r:close()
  for n, t in pairs(add or {}) do
    entries[#entries + 1] = {name = n, shape = t:shape(), dtype = "F32"}
    data[#data + 1] = t
  end
  local w = core.st_writer(dir .. "/model.safetensors", entries, {format = "pt"})
  for i, e in ipairs(entries) do w:write(e.name, data[i]) end
  w:commit()
  return dir
end

describe("fsdp.import_hf", function()
  it("gives the logits transformers computed on the fixture (within 1e-4)", function()
    local e = expected()
    local m = fsdp.import_hf(FIXTURE)
    assert.is_true(nn.isinstance(m, nn.GPT))
    assert.are.same({vocab = 300, ctx = 64, d = 64, layers = 2, heads = 4, tie = true,
      dropout = 0, hidden = 256, eps = 1e-5}, m:config())
    assert.is_true(rawequal(m.head.weight, m.wte.weight))
    local d = max_diff(logits(m, e.ids), e.logits)
    assert.is_true(d < 1e-4, "max |logits - transformers'| = " .. d)
    -- and a perturbed model is farther than that: the check can fail
    fsdp.no_grad(function() m.blocks[2].attn.qkv.bias:add_(fsdp.full({192}, 1e-3)) end)
    assert.is_true(max_diff(logits(m, e.ids), e.logits) > 1e-4)
  end)

  it("continues a prompt greedily as transformers' generate does", function()
    local e = expected()
    local m = fsdp.import_hf(FIXTURE)
    local prompt = {}
    for i = 1, 8 do prompt[i] = e.greedy[i] end
    for _, cache in ipairs{true, false} do
      assert.are.same(e.greedy, m:generate(prompt, {max_new_tokens = #e.greedy - 8,
        temperature = 0, cache = cache}))
    end
  end)

  it("reads GPT2Model's names (no transformer. prefix) and ignores attention buffers", function()
    local e = expected()
    local dir = with_tensors(function(n) return (n:gsub("^transformer%.", "")) end,
      {["h.0.attn.bias"] = fsdp.ones{1, 1, 64, 64}})
    local m = fsdp.import_hf(dir)
    assert.is_true(max_diff(logits(m, e.ids), e.logits) < 1e-4)
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("builds on meta, and fills a model wrapped on meta from the file", function()
    local e = expected()
    local plain = fsdp.import_hf(FIXTURE)
    local m = fsdp.import_hf(FIXTURE, {meta = true})
    for _, p in ipairs(m:parameters()) do assert.are.equal("meta", p.device) end
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
    assert.are.equal(m, fsdp.import_hf(FIXTURE, {model = m}))
    assert.are.equal(0, max_diff(logits(m, e.ids), logits(plain, e.ids)))
    local w = fsdp.import_hf(FIXTURE, {wrap = {policy = fsdp.policy.modules{nn.Block}}})
    assert.is_true(fsdp.is_wrapped(w))
    assert.are.equal(0, max_diff(logits(w, e.ids), logits(plain, e.ids)))
    -- meta and wrap: wrapped on meta (wrap was ignored), then filled
    local mw = fsdp.import_hf(FIXTURE,
      {meta = true, wrap = {policy = fsdp.policy.modules{nn.Block}}})
    assert.is_true(fsdp.is_wrapped(mw))
    errors_with(function() fsdp.export_hf(mw, H.mktemp_dir()) end,
      "was wrapped on the meta device and some parameters have no values yet")
    fsdp.import_hf(FIXTURE, {model = mw})
    assert.are.equal(0, max_diff(logits(mw, e.ids), logits(plain, e.ids)))
    -- and an eager model of the same shape
    fsdp.manual_seed(1)
    local eager = nn.GPT(plain:config())
    fsdp.import_hf(FIXTURE, {model = eager})
    assert.are.same(values(plain), values(eager))
  end)

  it("refuses a folder without config.json or model.safetensors, naming the file", function()
    local dir = H.mktemp_dir()
    errors_with(function() fsdp.import_hf(dir) end, dir .. "/config.json: no such file")
    copy_dir(FIXTURE, dir)
    errors_with(function() fsdp.import_hf(dir .. "/model.safetensors") end,
      "fsdp.import_hf: " .. dir .. "/model.safetensors is a file; give the folder that holds config.json")
    os.remove(dir .. "/model.safetensors")
    errors_with(function() fsdp.import_hf(dir) end, dir .. "/model.safetensors: no such file")
    H.write_file(dir .. "/pytorch_model.bin", "x")
    errors_with(function() fsdp.import_hf(dir) end, "only safetensors weights are read")
    os.remove(dir .. "/pytorch_model.bin")
    H.write_file(dir .. "/model.safetensors.index.json", "{}")
    errors_with(function() fsdp.import_hf(dir) end, "split over several files")
    H.write_file(dir .. "/config.json", "[1, 2]")
    errors_with(function() fsdp.import_hf(dir) end, dir .. "/config.json: not a JSON object")
    H.write_file(dir .. "/config.json", "{not json")
    errors_with(function() fsdp.import_hf(dir) end, "fsdp.import_hf: ", "config.json")
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("refuses configurations nn.GPT cannot compute exactly, naming the key", function()
    local cases = {
      {{activation_function = "relu"}, "activation_function = relu is not supported"},
      {{activation_function = "gelu"}, "activation_function = gelu is not supported"},
      {{scale_attn_by_inverse_layer_idx = true}, "scale_attn_by_inverse_layer_idx = true is not supported"},
      {{scale_attn_weights = false}, "scale_attn_weights = false is not supported"},
      {{add_cross_attention = true}, "add_cross_attention = true is not supported"},
      {{model_type = "llama"}, "model_type = llama is not supported"},
      {{n_head = 5}, "n_head = 5 does not divide n_embd = 64"},
      {{n_layer = 1.5}, "n_layer = 1.5 is not an integer >= 0"},
      {{n_layer = 2 ^ 60}, "n_layer = " .. tostring(2 ^ 60) .. " is not an integer in [0, 2^53]"},
      {{n_embd = "64"}, 'n_embd = "64" is not an integer >= 1'},
      {{layer_norm_epsilon = "1e-5"}, 'layer_norm_epsilon = "1e-5" is not a positive number'},
      {{tie_word_embeddings = "true"}, 'tie_word_embeddings = "true" is not a boolean'},
    }
    for _, c in ipairs(cases) do
      local dir = with_config(c[1])
      errors_with(function() fsdp.import_hf(dir) end, "fsdp.import_hf: " .. dir .. "/config.json: " .. c[2])
      os.execute("rm -rf '" .. dir .. "'")
    end
  end)

  it("refuses weights that do not fit config.json, naming the tensor", function()
    local dir = with_config{vocab_size = 301}
    errors_with(function() fsdp.import_hf(dir) end,
      "tensor 'transformer.wte.weight' has shape (300, 64), config.json makes it (301, 64)")
    os.execute("rm -rf '" .. dir .. "'")
    dir = with_config{n_inner = 128}
    errors_with(function() fsdp.import_hf(dir) end,
      "tensor 'transformer.h.0.mlp.c_fc.weight' has shape (64, 256), config.json makes it (64, 128)")
    os.execute("rm -rf '" .. dir .. "'")
    dir = with_config{n_layer = 3}
    errors_with(function() fsdp.import_hf(dir) end, "has no tensor transformer.h.2.ln_1.weight")
    os.execute("rm -rf '" .. dir .. "'")
    -- far more blocks than the file holds: refused at once (the blocks are not listed first)
    dir = with_config{n_layer = 1e12}
    errors_with(function() fsdp.import_hf(dir) end,
      "/model.safetensors has no tensor transformer.h.2.ln_1.weight (" .. dir
      .. "/config.json: n_layer = " .. tostring(1e12) .. ")")
    os.execute("rm -rf '" .. dir .. "'")
    -- n_layer absent: GPT2Config's 12, said as such
    dir = with_config{}
    local cfg = core.json_read(dir .. "/config.json")
    cfg.n_layer = nil
    core.json_write(dir .. "/config.json", cfg)
    errors_with(function() fsdp.import_hf(dir) end, "has no tensor transformer.h.2.ln_1.weight ("
      .. dir .. "/config.json: n_layer = 12, GPT2Config's default: the key is absent)")
    os.execute("rm -rf '" .. dir .. "'")
    dir = with_config{tie_word_embeddings = false}
    errors_with(function() fsdp.import_hf(dir) end, "has no tensor lm_head.weight")
    os.execute("rm -rf '" .. dir .. "'")
    dir = with_tensors(function(n) return n end, nil, {["transformer.wpe.weight"] = "I32"})
    errors_with(function() fsdp.import_hf(dir) end,
      "tensor 'transformer.wpe.weight' is I32; only F32, BF16, F16 and F64 are read")
    os.execute("rm -rf '" .. dir .. "'")
    dir = with_tensors(function(n) return n end, {["transformer.extra"] = fsdp.ones{2}})
    errors_with(function() fsdp.import_hf(dir) end, "has no place for: transformer.extra",
      "strict = false")
    local m = fsdp.import_hf(dir, {strict = false})
    assert.are.equal(300, m.vocab)
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("fills the base of a model with LoRA adapters with strict = false, leaving them", function()
    local e = expected()
    local plain = fsdp.import_hf(FIXTURE)
    local m = fsdp.import_hf(FIXTURE, {meta = true})
    nn.lora.apply(m, {rank = 2})
    fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block, nn.LoRA}})
    errors_with(function() fsdp.import_hf(FIXTURE, {model = m}) end,
      "fsdp.import_hf: the model has parameters GPT-2 has no place for: "
        .. "blocks.1.attn.qkv.lora.A, blocks.1.attn.qkv.lora.B",
      "(pass strict = false to fill the rest and leave them as they are)")
    assert.are.equal(m, fsdp.import_hf(FIXTURE, {model = m, strict = false}))
    fsdp.materialize(m) -- the adapters: B is zeros, so the base's logits
    assert.are.equal(0, max_diff(logits(m, e.ids), logits(plain, e.ids)))
  end)

  it("refuses bad options and a model of another shape", function()
    errors_with(function() fsdp.import_hf(FIXTURE, {wrapp = {}}) end,
      "fsdp.import_hf: unknown option 'wrapp' (valid: meta, model, strict, wrap)")
    errors_with(function() fsdp.import_hf(FIXTURE, {wrap = 1}) end, "wrap must be fsdp.wrap's options")
    local m = nn.GPT{vocab = 300, ctx = 64, d = 64, layers = 1, heads = 4}
    errors_with(function() fsdp.import_hf(FIXTURE, {model = m}) end,
      "the model's layers is 1, the folder's 2")
    errors_with(function() fsdp.import_hf(FIXTURE, {model = m, meta = true}) end, "takes no meta or wrap")
    errors_with(function() fsdp.import_hf(FIXTURE, {model = nn.Linear(2, 2)}) end,
      "fsdp.import_hf: expected an nn.GPT (got Linear)")
  end)
end)

describe("fsdp.export_hf", function()
  it("writes what import_hf reads back bitwise, in GPT-2's layout and names", function()
    local m = fsdp.import_hf(FIXTURE)
    local dir = H.mktemp_dir() .. "/out"
    fsdp.export_hf(m, dir)
    local back = fsdp.import_hf(dir)
    assert.are.same(values(m), values(back))
    local r = core.st_open(dir .. "/model.safetensors")
    local meta = r:metadata()
    assert.are.equal("pt", meta.format)
    assert.are.same(m:config(), core.json_decode(meta["fsdp.config"]))
    -- Conv1D (in, out): c_attn.weight is qkv.weight transposed; no lm_head (tied)
    local c_attn = r:read("transformer.h.0.attn.c_attn.weight")
    assert.are.same({64, 192}, c_attn:shape())
    assert.are.same(H.flat_view(m.blocks[1].attn.qkv.weight:detach():transpose(1, 2):contiguous()),
      H.flat_view(c_attn))
    -- the file's tensors are the fixture's, byte for byte
    local f = core.st_open(FIXTURE .. "/model.safetensors")
    local n = 0
    for _, e in ipairs(f:entries()) do
      assert.are.same(H.flat_view(f:read(e.name)), H.flat_view(r:read(e.name)))
      n = n + 1
    end
    assert.are.equal(n, #r:entries())
    r:close()
    f:close()
    local cfg = core.json_read(dir .. "/config.json")
    assert.are.same({"GPT2LMHeadModel"}, cfg.architectures)
    assert.are.equal("gpt2", cfg.model_type)
    assert.are.equal("gelu_new", cfg.activation_function)
    assert.are.equal(1e-5, cfg.layer_norm_epsilon)
    assert.is_true(cfg.tie_word_embeddings)
    for k, v in pairs{vocab_size = 300, n_positions = 64, n_embd = 64, n_layer = 2, n_head = 4} do
      assert.are.equal(v, cfg[k], k)
    end
    assert.is_nil(cfg.n_inner) -- null: 4 * n_embd
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("exports an untied model with its own width, eps and dropout, and reads it back", function()
    fsdp.manual_seed(5)
    local m = nn.GPT{vocab = 37, ctx = 12, d = 16, layers = 2, heads = 2, tie = false,
      hidden = 40, eps = 1e-6, dropout = 0.1}
    local dir = H.mktemp_dir()
    fsdp.export_hf(m, dir)
    local cfg = core.json_read(dir .. "/config.json")
    assert.are.equal(40, cfg.n_inner)
    assert.are.equal(1e-6, cfg.layer_norm_epsilon)
    assert.is_false(cfg.tie_word_embeddings)
    assert.are.equal(0.1, cfg.resid_pdrop)
    local back = fsdp.import_hf(dir)
    assert.are.same(m:config(), back:config()) -- dropout from fsdp.config
    assert.are.same(values(m), values(back))
    local r = core.st_open(dir .. "/model.safetensors")
    assert.are.same(H.flat_view(m.head.weight:detach()), H.flat_view(r:read("lm_head.weight")))
    r:close()
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("refuses a config.json that contradicts the configuration exported with the weights",
    function()
    local g = nn.GPT{vocab = 7, ctx = 4, d = 8, layers = 1, heads = 2, eps = 1e-6, hidden = 12}
    local dir = H.mktemp_dir()
    fsdp.export_hf(g, dir)
    assert.are.same(g:config(), fsdp.import_hf(dir):config())
    -- n_head and layer_norm_epsilon change no tensor's shape: config.json was taken as it was
    for _, c in ipairs{{"n_head", 4, "heads = 2"}, {"layer_norm_epsilon", 1e-5, "eps = 1e-06"}} do
      local cfg = core.json_read(dir .. "/config.json")
      local was = cfg[c[1]]
      cfg[c[1]] = c[2]
      core.json_write(dir .. "/config.json", cfg)
      errors_with(function() fsdp.import_hf(dir) end, "fsdp.import_hf: " .. dir .. "/config.json: "
        .. c[1] .. " = " .. tostring(c[2]) .. ", but " .. dir .. "/model.safetensors's fsdp.config "
        .. "(written with the weights by fsdp.export_hf) has " .. c[3])
      cfg[c[1]] = was
      core.json_write(dir .. "/config.json", cfg)
    end
    -- fewer layers than exported: strict = false still takes the first ones
    g = nn.GPT{vocab = 7, ctx = 4, d = 8, layers = 2, heads = 2}
    fsdp.export_hf(g, dir)
    local cfg = core.json_read(dir .. "/config.json")
    cfg.n_layer = 1
    core.json_write(dir .. "/config.json", cfg)
    assert.are.equal(1, fsdp.import_hf(dir, {strict = false}):config().layers)
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("refuses what is no GPT, a module inside a wrapped one, and a model on meta", function()
    local dir = "/nonexistent-dir/x" -- never written: each call is refused first
    errors_with(function() fsdp.export_hf(nn.Linear(2, 2), dir) end,
      "fsdp.export_hf: expected an nn.GPT (got Linear)")
    local m = fsdp.meta(function() return nn.GPT{vocab = 5, ctx = 4, d = 4, layers = 1, heads = 1} end)
    errors_with(function() fsdp.export_hf(m, dir) end,
      "fsdp.export_hf: parameter wte.weight is on the meta device")
    errors_with(function() fsdp.export_hf(nn.GPT{vocab = 5, ctx = 4, d = 4, layers = 1, heads = 1}, "") end,
      "dir must be a non-empty string")
    local Sub = nn.GPT:extend("Sub")
    function Sub:init(cfg)
      nn.GPT.init(self, cfg)
      self.extra = nn.Linear(2, 2)
    end
    errors_with(function() fsdp.export_hf(Sub{vocab = 5, ctx = 4, d = 4, layers = 1, heads = 1}, dir) end,
      "parameter extra.weight has no GPT-2 counterpart")
    errors_with(function() fsdp.export_hf(nn.GPT{vocab = 5, ctx = 4, d = 4, layers = 1, heads = 1}, dir,
      {dtype = "bf16"}) end, "fsdp.export_hf: takes (model, dir) and no options (got a third argument, a table)")
    local lora = nn.GPT{vocab = 5, ctx = 4, d = 4, layers = 1, heads = 1}
    nn.lora.apply(lora, {rank = 2})
    errors_with(function() fsdp.export_hf(lora, dir) end,
      "parameter blocks.1.attn.qkv.lora.A has no GPT-2 counterpart (merge the adapters first: nn.lora.merge(model)")
    -- tie = false with the head tied by hand: lm_head.weight was left out of a folder whose
    -- config.json says tie_word_embeddings = false
    local tied = nn.GPT{vocab = 5, ctx = 4, d = 4, layers = 1, heads = 1, tie = false}
    tied.head.weight = tied.wte.weight
    errors_with(function() fsdp.export_hf(tied, H.mktemp_dir()) end, "fsdp.export_hf: head.weight "
      .. "has no parameter of its own for GPT-2's lm_head.weight (it is wte.weight); the GPT's tie "
      .. "is false")
  end)
end)

describe("fsdp.load_model", function()
  it("rebuilds an nn.GPT from the configuration stored with it", function()
    fsdp.manual_seed(2)
    local m = nn.GPT{vocab = 30, ctx = 8, d = 16, layers = 2, heads = 2, eps = 1e-6, dropout = 0.1,
      hidden = 24, tie = false}
    local dir = H.mktemp_dir()
    fsdp.save(m, dir .. "/a.safetensors")
    fsdp.save(m, dir .. "/sharded")
    fsdp.export_hf(m, dir .. "/hf")
    for _, c in ipairs{{"a.safetensors", "safetensors"}, {"sharded", "sharded"}, {"hf", "hf"}} do
      local b, _, info = fsdp.load_model(dir .. "/" .. c[1])
      assert.are.equal(c[2], info.format)
      assert.are.same(m:config(), b:config())
      assert.are.same(values(m), values(b))
      local w = fsdp.load_model(dir .. "/" .. c[1], {wrap = {policy = fsdp.policy.modules{nn.Block}}})
      assert.is_true(fsdp.is_wrapped(w))
      fsdp.full_params(w, function(full) assert.are.same(values(m), values(full)) end)
    end
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("says what is missing when a checkpoint has no configuration", function()
    local dir = H.mktemp_dir()
    fsdp.save(nn.Linear(2, 3), dir .. "/lin.safetensors")
    fsdp.save(nn.Linear(2, 3), dir .. "/lin")
    errors_with(function() fsdp.load_model(dir .. "/lin.safetensors") end,
      "fsdp.load_model: " .. dir .. "/lin.safetensors has no fsdp.config in its metadata",
      "build the model as the recipe does and fsdp.load it")
    errors_with(function() fsdp.load_model(dir .. "/lin") end, dir .. "/lin/index.json has no config")
    errors_with(function() fsdp.load_model(dir .. "/nothing") end, "is no checkpoint")
    errors_with(function() fsdp.load_model(dir, {wrapp = 1}) end,
      "fsdp.load_model: unknown option 'wrapp' (valid: strict, wrap)")
    -- a GPT saved with its LoRA adapters unmerged: strict = false would drop them silently
    local adapted = nn.GPT{vocab = 5, ctx = 4, d = 4, layers = 1, heads = 1}
    nn.lora.apply(adapted, {rank = 2})
    fsdp.save(adapted, dir .. "/lora.safetensors")
    errors_with(function() fsdp.load_model(dir .. "/lora.safetensors") end,
      "fsdp.load_model: " .. dir .. "/lora.safetensors holds LoRA adapters", "nn.lora.merge(model)")
    -- other unexpected tensors keep fsdp.load's own message
    local other = nn.GPT{vocab = 5, ctx = 4, d = 4, layers = 1, heads = 1}
    other.extra = nn.Linear(2, 2)
    fsdp.save(other, dir .. "/extra.safetensors")
    errors_with(function() fsdp.load_model(dir .. "/extra.safetensors") end,
      "unexpected tensors (in the file, not in the model): extra.weight")
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("refuses an export's weights file, and a model strict = false would leave on meta", function()
    local g = nn.GPT{vocab = 5, ctx = 4, d = 4, layers = 1, heads = 1}
    local dir = H.mktemp_dir()
    fsdp.export_hf(g, dir .. "/hf")
    -- it carries fsdp.config, under GPT-2's names: strict = false loaded nothing, without a word
    for _, strict in ipairs{true, false} do
      errors_with(function() fsdp.load_model(dir .. "/hf/model.safetensors", {strict = strict}) end,
        "fsdp.load_model: " .. dir .. "/hf/model.safetensors holds a Hugging Face GPT-2's tensors",
        "give its folder, " .. dir .. "/hf, which holds config.json")
    end
    -- a checkpoint of the configuration without ln_f.bias (its metadata kept)
    fsdp.save(g, dir .. "/full.safetensors")
    local r = core.st_open(dir .. "/full.safetensors")
    local entries, data = {}, {}
    for _, e in ipairs(r:entries()) do
      if e.name ~= "ln_f.bias" then
        entries[#entries + 1] = {name = e.name, shape = e.shape, dtype = e.dtype}
        data[#data + 1] = r:read(e.name)
      end
    end
    local w = core.st_writer(dir .. "/part.safetensors", entries,
      {["fsdp.config"] = r:metadata()["fsdp.config"]})
    r:close()
    for i, e in ipairs(entries) do w:write(e.name, data[i]) end
    w:commit()
    for _, wrap in ipairs{false, {}} do
      errors_with(function()
        fsdp.load_model(dir .. "/part.safetensors", {strict = false, wrap = wrap or nil})
      end, "fsdp.load_model: " .. dir .. "/part.safetensors has no tensor for ln_f.bias: the model "
        .. "would have no values there")
    end
    os.execute("rm -rf '" .. dir .. "'")
  end)
end)
