-- fsdp.hf — Hugging Face GPT-2 folders: fsdp.export_hf(model, dir) and fsdp.import_hf(dir [, opts]).
-- docs/checkpoints.md ("Hugging Face GPT-2") is the manual.
--
-- A folder is config.json (GPT2Config's keys) and model.safetensors (GPT2LMHeadModel's names).
-- nn.GPT is GPT-2's architecture: pre-norm blocks, the fused qkv projection split [q | k | v]
-- with heads contiguous inside each third, attention scaled by 1/sqrt(head size), GELU in its
-- tanh form (gelu_new), learned positions, the head tied to wte. Two differences are layouts:
-- GPT-2's Conv1D stores a projection's weight as (in, out), nn.Linear as (out, in), so c_attn,
-- c_proj and c_fc weights are transposed on the way in and out; and GPT-2's paths
-- (transformer.h.0.ln_1) are renamed (blocks.1.ln1). Nothing else is converted.
--
-- Export is collective (every rank, the same dir): on a wrapped model one unit gathered at a
-- time, rank 0 writes, so the file equals a one-rank export. Import builds the model on meta
-- and fills it through fsdp.load_tensors: a plain model gets each parameter's storage as it is
-- read, a wrapped model each rank's shard slices only (a transposed weight is read whole, one
-- at a time, on the ranks whose slices it touches), so a model larger than one rank's memory
-- loads.
-- The export's metadata holds the model's own configuration as "fsdp.config" (JSON of
-- GPT:config(), as fsdp.save stores it too); import_hf takes its dropout from there.

local core = require "fsdp.core"
local collective = require "fsdp.collective"
local load_tensors = require "fsdp.load_tensors"
local meta = require "fsdp.meta"
local nn = require "fsdp.nn"
local state = require "fsdp.state"
local ties = require "fsdp.ties"
local util = require "fsdp.util"
local wrap = require "fsdp.wrap"

local raise = util.raise

local M = {}

local LABEL = "hf"
local CONFIG, WEIGHTS = "config.json", "model.safetensors"
-- activations that are GELU's tanh form, which nn.GPT computes
local GELU_TANH = {gelu_new = true, gelu_pytorch_tanh = true}

local function join(dir, name)
  dir = dir:gsub("/+$", "")
  if dir == "" then return "/" .. name end
  return dir .. "/" .. name
end

-- ---- the name map -----------------------------------------------------------------------

-- GPT-2's tensors for an nn.GPT configuration, in GPT2LMHeadModel's order:
-- {hf = name, path = nn.GPT path, shape = GPT-2's shape, transpose = Conv1D weight}.
local function tensor_map(cfg)
  local d, hid = cfg.d, cfg.hidden
  local list = {}
  local function add(hf, path, shape, transpose)
    list[#list + 1] = {hf = hf, path = path, shape = shape, transpose = transpose or false}
  end
  add("transformer.wte.weight", "wte.weight", {cfg.vocab, d})
  add("transformer.wpe.weight", "wpe.weight", {cfg.ctx, d})
  for i = 1, cfg.layers do
    local h, b = ("transformer.h.%d."):format(i - 1), ("blocks.%d."):format(i)
    add(h .. "ln_1.weight", b .. "ln1.weight", {d})
    add(h .. "ln_1.bias", b .. "ln1.bias", {d})
    add(h .. "attn.c_attn.weight", b .. "attn.qkv.weight", {d, 3 * d}, true)
    add(h .. "attn.c_attn.bias", b .. "attn.qkv.bias", {3 * d})
    add(h .. "attn.c_proj.weight", b .. "attn.proj.weight", {d, d}, true)
    add(h .. "attn.c_proj.bias", b .. "attn.proj.bias", {d})
    add(h .. "ln_2.weight", b .. "ln2.weight", {d})
    add(h .. "ln_2.bias", b .. "ln2.bias", {d})
    add(h .. "mlp.c_fc.weight", b .. "mlp.fc.weight", {d, hid}, true)
    add(h .. "mlp.c_fc.bias", b .. "mlp.fc.bias", {hid})
    add(h .. "mlp.c_proj.weight", b .. "mlp.proj.weight", {hid, d}, true)
    add(h .. "mlp.c_proj.bias", b .. "mlp.proj.bias", {d})
  end
  add("transformer.ln_f.weight", "ln_f.weight", {d})
  add("transformer.ln_f.bias", "ln_f.bias", {d})
  if not cfg.tie then add("lm_head.weight", "head.weight", {cfg.vocab, d}) end
  return list
end
M.tensor_map = tensor_map

-- ---- configurations -----------------------------------------------------------------------

-- config.json's values, as GPT2Config reads them: absent keys take GPT2Config's defaults.
local HF_DEFAULTS = {vocab_size = 50257, n_positions = 1024, n_embd = 768, n_layer = 12,
  n_head = 12, layer_norm_epsilon = 1e-5, activation_function = "gelu_new",
  tie_word_embeddings = true, scale_attn_weights = true, scale_attn_by_inverse_layer_idx = false,
  add_cross_attention = false}

--- The nn.GPT configuration of a GPT-2 config.json table (where: its path, for messages).
--- Refuses what nn.GPT cannot compute exactly, naming the key.
function M.gpt_config(hf, where)
  local function get(k)
    local v = hf[k]
    if v == nil then v = HF_DEFAULTS[k] end
    return v
  end
  local function bad(k, why, quote)
    local v = hf[k] -- quote: a string where a number is due (n_embd = "64" is not 64)
    raise(("fsdp.import_hf: %s: %s = %s %s"):format(where, k,
      quote and type(v) == "string" and ("%q"):format(v) or tostring(v), why))
  end
  if hf.model_type ~= nil and hf.model_type ~= "gpt2" then
    bad("model_type", "is not supported (only \"gpt2\": GPT2LMHeadModel)")
  end
  local function int(k, min)
    local v = get(k)
    if not util.is_int(v, min) then
      bad(k, ("is not %s"):format(util.int_range(v, min)), true)
    end
    return v
  end
  local cfg = {vocab = int("vocab_size", 1), ctx = int("n_positions", 1), d = int("n_embd", 1),
    layers = int("n_layer", 0), heads = int("n_head", 1)}
  if cfg.d % cfg.heads ~= 0 then bad("n_head", ("does not divide n_embd = %d"):format(cfg.d)) end
  if hf.n_inner ~= nil then cfg.hidden = int("n_inner", 1) else cfg.hidden = 4 * cfg.d end
  local act = get("activation_function")
  if not GELU_TANH[act] then
    bad("activation_function", "is not supported (nn.GPT computes GELU's tanh form: gelu_new, "
      .. "gelu_pytorch_tanh)")
  end
  local eps = get("layer_norm_epsilon")
  if type(eps) ~= "number" or not (eps > 0) then
    bad("layer_norm_epsilon", "is not a positive number", true)
  end
  cfg.eps = eps
  local tie = get("tie_word_embeddings")
  if type(tie) ~= "boolean" then bad("tie_word_embeddings", "is not a boolean", true) end
  cfg.tie = tie
  if get("scale_attn_weights") ~= true then
    bad("scale_attn_weights", "is not supported (nn.GPT always scales scores by 1/sqrt(head size))")
  end
  if get("scale_attn_by_inverse_layer_idx") ~= false then
    bad("scale_attn_by_inverse_layer_idx", "is not supported (nn.GPT scales every layer alike)")
  end
  if get("add_cross_attention") ~= false then
    bad("add_cross_attention", "is not supported (nn.GPT is decoder-only)")
  end
  cfg.dropout = 0
  return cfg
end

local NULL = "fsdp:null" -- json_encode has no null: a placeholder replaced in the text

-- config.json for an nn.GPT configuration: what GPT2Config needs, GPT-2's defaults elsewhere.
local function hf_config(cfg)
  local t = {
    architectures = {"GPT2LMHeadModel"}, model_type = "gpt2",
    vocab_size = cfg.vocab, n_positions = cfg.ctx, n_embd = cfg.d, n_layer = cfg.layers,
    n_head = cfg.heads, n_inner = cfg.hidden ~= 4 * cfg.d and cfg.hidden or NULL,
    activation_function = "gelu_new", layer_norm_epsilon = cfg.eps,
    tie_word_embeddings = cfg.tie, scale_attn_weights = true,
    resid_pdrop = cfg.dropout, embd_pdrop = cfg.dropout, attn_pdrop = 0,
    initializer_range = 0.02, dtype = "float32",
    -- GPT-2's 50256 is no id of a smaller vocabulary
    bos_token_id = cfg.vocab > 50256 and 50256 or NULL,
    eos_token_id = cfg.vocab > 50256 and 50256 or NULL,
  }
  local text = core.json_encode(t, {first = {"architectures", "model_type"}})
  return (text:gsub('"fsdp:null"', "null"))
end

-- ---- export -------------------------------------------------------------------------------

local function check_gpt(fn, model)
  if not util.is_module(model) or not nn.isinstance(model, nn.GPT) then
    raise(("%s: expected an nn.GPT (got %s)"):format(fn,
      util.is_module(model) and model:type_name() or type(model)))
  end
  local R = state.of(model)
  if R ~= nil and R:model() ~= model then
    raise(("%s: this GPT is part of a wrapped model (a %s): export the wrapped root")
      :format(fn, R:model():type_name()))
  end
  return R
end

--- Collective (every rank, the same dir; rank 0 writes). Write dir/config.json and
--- dir/model.safetensors, a folder transformers.GPT2LMHeadModel.from_pretrained(dir) loads.
--- Every tensor is F32.
function M.export_hf(model, dir, extra)
  local R = check_gpt("fsdp.export_hf", model)
  if type(dir) ~= "string" or dir == "" then raise("fsdp.export_hf: dir must be a non-empty string") end
  if extra ~= nil then -- an options table would otherwise be ignored without a word
    raise(("fsdp.export_hf: takes (model, dir) and no options (got a third argument, a %s); "
      .. "every tensor is written as F32"):format(type(extra)))
  end
  if R and R:has_pending() then
    raise("fsdp.export_hf: the model was wrapped on the meta device and some parameters have "
      .. "no values yet (fsdp.materialize or fsdp.load it first)")
  end
  local cfg = model:config()
  local list = tensor_map(cfg)
  local by_path = {}
  for _, e in ipairs(list) do by_path[e.path] = e end
  -- the model's parameters must be exactly GPT-2's (a subclass may add its own)
  local order, paths = ties.all_paths(model)
  local item = {}
  for _, p in ipairs(order) do
    local e = by_path[paths[p][1]]
    if e == nil then
      local path = paths[p][1]
      raise(("fsdp.export_hf: parameter %s has no GPT-2 counterpart%s"):format(path,
        path:find("%.lora%.[AB]$") and " (merge the adapters first: nn.lora.merge(model), after "
          .. "fsdp.unwrap on a wrapped model)" or ""))
    end
    item[p] = e
  end
  -- and each of GPT-2's tensors a parameter of its own: a head tied by hand on a GPT built with
  -- tie = false would leave lm_head.weight unwritten, a folder config.json contradicts
  local written = {}
  for _, e in pairs(item) do written[e] = true end
  for _, e in ipairs(list) do
    if not written[e] then
      local shared = ""
      for _, p in ipairs(order) do
        for _, q in ipairs(paths[p]) do
          if q == e.path then shared = (" (it is %s)"):format(paths[p][1]) end
        end
      end
      raise(("fsdp.export_hf: %s has no parameter of its own for GPT-2's %s%s; the GPT's tie is "
        .. "%s"):format(e.path, e.hf, shared, tostring(cfg.tie)))
    end
  end
  -- tensors in the order they are written: unit by unit when wrapped
  local groups = {}
  if R then
    for _, u in ipairs(R:forward_units()) do groups[#groups + 1] = {unit = u, params = u:params()} end
  else
    for _, p in ipairs(order) do
      if p.device == "meta" then
        raise(("fsdp.export_hf: parameter %s is on the meta device: materialize the model first")
          :format(paths[p][1]))
      end
    end
    groups[1] = {params = order}
  end
  local entries = {}
  for _, g in ipairs(groups) do
    for _, p in ipairs(g.params) do
      local e = item[p]
      entries[#entries + 1] = {name = e.hf, shape = e.shape, dtype = "F32"}
    end
  end
  local metadata = {format = "pt", ["fsdp.config"] = core.json_encode(cfg)}
  local rank = core.rank()
  -- rank 0 writes, a plain model too: a folder given per rank would be written on rank 0 only
  local differ = collective.check_lists("fsdp.export_hf", {dir}, nil,
    {subject = "the folder", hint = function() return "every rank gives the same dir" end})
  if differ then raise(differ) end
  local w
  local ok, err = true, nil
  if rank == 0 then
    ok, err = pcall(function()
      core.io_mkdirs(dir)
      w = core.st_writer(join(dir, WEIGHTS), entries, metadata)
    end)
  end
  local msg = collective.check_outcome(ok, err, LABEL)
  if msg then raise("fsdp.export_hf: " .. msg) end
  for _, g in ipairs(groups) do
    local u = g.unit
    local was_sharded = u and u:state() == "sharded"
    if u then u:gather() end
    if rank == 0 and ok then
      ok, err = pcall(util.no_grad, function()
        for _, p in ipairs(g.params) do
          local e = item[p]
          if e.transpose then
            local t = p:detach():transpose(1, 2):contiguous() -- (in, out): Conv1D's layout
            w:write(e.hf, t)
            t:free()
          else
            w:write(e.hf, p)
          end
        end
      end)
    end
    if was_sharded then u:reshard() end
    msg = collective.check_outcome(ok, err, LABEL)
    if msg then
      if w then w:abort() end
      raise("fsdp.export_hf: " .. msg)
    end
  end
  if rank == 0 then
    ok, err = pcall(function()
      w:commit()
      local path = join(dir, CONFIG)
      local f = assert(io.open(path .. ".tmp", "w"))
      f:write(hf_config(cfg), "\n")
      f:close()
      assert(os.rename(path .. ".tmp", path))
    end)
    if not ok then w:abort() end
  end
  msg = collective.check_outcome(ok, err, LABEL)
  if msg then raise("fsdp.export_hf: " .. msg) end
end

-- ---- import -------------------------------------------------------------------------------

-- GPT:config()'s keys that config.json sets, with their config.json names (not n_layer: a
-- config.json with fewer layers, read with strict = false, takes the first ones)
local SAME_AS_EXPORT = {{"vocab", "vocab_size"}, {"ctx", "n_positions"}, {"d", "n_embd"},
  {"heads", "n_head"}, {"hidden", "n_inner"}, {"tie", "tie_word_embeddings"},
  {"eps", "layer_norm_epsilon"}}

-- Buffers GPT-2 checkpoints may hold that are no parameters (older transformers saved them).
local function is_buffer(name)
  return name:match("%.attn%.bias$") ~= nil or name:match("%.attn%.masked_bias$") ~= nil
end

-- What the folder holds: {cfg =, reader =, list = tensor map with each entry's name in the
-- file (e.file), fsdp_config = the export's own configuration or nil}. Errors name the file.
local function open_folder(dir, strict)
  if type(dir) ~= "string" or dir == "" then raise("fsdp.import_hf: dir must be a non-empty string") end
  local cpath, wpath = join(dir, CONFIG), join(dir, WEIGHTS)
  if core.io_size(dir) then -- a file: most likely the model.safetensors inside the folder
    raise(("fsdp.import_hf: %s is a file; give the folder that holds config.json and "
      .. "model.safetensors (a checkpoint of fsdprun's own: fsdp.load_model)"):format(dir))
  end
  if not core.io_size(cpath) then
    raise(("fsdp.import_hf: %s: no such file (a Hugging Face model folder holds config.json "
      .. "and model.safetensors)"):format(cpath))
  end
  local ok, hf = pcall(core.json_read, cpath)
  if not ok then raise("fsdp.import_hf: " .. util.strip(hf)) end
  -- a JSON array is a Lua table too: its first element tells it from an object
  if type(hf) ~= "table" or hf[1] ~= nil then
    raise(("fsdp.import_hf: %s: not a JSON object"):format(cpath))
  end
  local cfg = M.gpt_config(hf, cpath)
  if not core.io_size(wpath) then
    local why = core.io_size(join(dir, "model.safetensors.index.json"))
      and " (weights split over several files are not supported: save with a larger max_shard_size)"
      or core.io_size(join(dir, "pytorch_model.bin"))
      and " (only safetensors weights are read: save with safe_serialization=True)" or ""
    raise(("fsdp.import_hf: %s: no such file%s"):format(wpath, why))
  end
  local r
  ok, r = pcall(core.st_open, wpath)
  if not ok then raise("fsdp.import_hf: " .. util.strip(r)) end
  local entry = {}
  for _, e in ipairs(r:entries()) do entry[e.name] = e end
  -- the blocks the file holds, before listing n_layer blocks' tensors: a config.json that
  -- claims more (n_layer = 1e12) fails at once, naming its field
  for i = 0, cfg.layers - 1 do
    local h = ("h.%d.ln_1.weight"):format(i)
    if entry["transformer." .. h] == nil and entry[h] == nil then
      r:close()
      raise(("fsdp.import_hf: %s has no tensor transformer.%s (%s: n_layer = %s%s)")
        :format(wpath, h, cpath, tostring(cfg.layers),
          hf.n_layer == nil and ", GPT2Config's default: the key is absent" or ""))
    end
  end
  local list = tensor_map(cfg)
  local used, missing, problems = {}, {}, {}
  for _, e in ipairs(list) do
    -- GPT2LMHeadModel's names, or GPT2Model's (no "transformer." prefix)
    local name = e.hf
    if entry[name] == nil and name:match("^transformer%.") then name = name:sub(#"transformer." + 1) end
    local fe = entry[name]
    if fe == nil then
      missing[#missing + 1] = e.hf
    else
      used[name] = true
      e.file = name
      if util.shape_str(fe.shape) ~= util.shape_str(e.shape) then
        problems[#problems + 1] = ("tensor '%s' has shape %s, config.json makes it %s")
          :format(name, util.shape_str(fe.shape), util.shape_str(e.shape))
      end
      if fe.tensor_dtype == nil or not (fe.dtype == "F32" or fe.dtype == "BF16" or fe.dtype == "F16"
          or fe.dtype == "F64") then
        -- F8_E4M3 and the like are floating-point too, but no dtype nn.GPT computes in
        problems[#problems + 1] = ("tensor '%s' is %s; only F32, BF16, F16 and F64 are read")
          :format(name, fe.dtype)
      end
    end
  end
  if #problems > 0 then
    r:close()
    raise(("fsdp.import_hf: %s: %s"):format(wpath, table.concat(problems, "; ")))
  end
  if #missing > 0 then
    r:close()
    raise(("fsdp.import_hf: %s has no tensor %s"):format(wpath, util.few(missing)))
  end
  local unexpected = {}
  for _, e in ipairs(r:entries()) do
    local n = e.name
    -- a tied head may be stored too (it is wte's values): GPT2LMHeadModel ignores it as well
    if not used[n] and not is_buffer(n) and not (cfg.tie and n == "lm_head.weight") then
      unexpected[#unexpected + 1] = n
    end
  end
  if strict and #unexpected > 0 then
    r:close()
    raise(("fsdp.import_hf: %s holds tensors GPT-2 (config.json) has no place for: %s (pass "
      .. "strict = false to ignore them)"):format(wpath, util.few(unexpected)))
  end
  local own = r:metadata()["fsdp.config"]
  if own then
    local ok2, t = pcall(core.json_decode, own, wpath .. ": fsdp.config")
    if ok2 and type(t) == "table" then
      -- the configuration export_hf wrote with these weights: a config.json that says otherwise
      -- (n_head and layer_norm_epsilon change no shape) came from elsewhere, and which of the
      -- two is right cannot be told
      for _, k in ipairs(SAME_AS_EXPORT) do
        local v = t[k[1]]
        if v ~= nil and v ~= cfg[k[1]] then
          r:close()
          raise(("fsdp.import_hf: %s: %s = %s, but %s's fsdp.config (written with the weights "
            .. "by fsdp.export_hf) has %s = %s: the two files come from different models")
            :format(cpath, k[2], tostring(cfg[k[1]]), wpath, k[1], tostring(v)))
        end
      end
      if type(t.dropout) == "number" then cfg.dropout = t.dropout end
    end
  end
  return {cfg = cfg, reader = r, list = list, path = wpath}
end

-- The folder's tensors as a load_tensors source, under nn.GPT's paths and in its layout.
local function source(F)
  local by_path = {}
  for _, e in ipairs(F.list) do by_path[e.path] = e end
  local r = F.reader
  local src = {}
  function src.entries()
    local out = {}
    for _, e in ipairs(F.list) do
      local shape = e.transpose and {e.shape[2], e.shape[1]} or e.shape
      out[#out + 1] = {name = e.path, shape = shape}
    end
    return out
  end
  function src.read(_, name, first, count)
    local e = by_path[name]
    if not e.transpose then return r:read(e.file, first, count) end
    local t = r:read(e.file)
    local tt = t:transpose(1, 2):contiguous() -- (out, in): nn.Linear's layout
    t:free()
    if first == nil then return tt end
    local part = tt:view{tt:numel()}:narrow(1, first + 1, count):clone()
    tt:free()
    return part
  end
  return src
end

local IMPORT_OPTS = {"meta", "wrap", "model", "strict"}

local function same_arch(a, b)
  for _, k in ipairs{"vocab", "ctx", "d", "layers", "heads", "hidden", "tie", "eps"} do
    if a[k] ~= b[k] then return k end
  end
  return nil
end

--- import_hf(dir [, {meta =, wrap =, model =, strict = true}]) -> model. An nn.GPT with the
--- folder's weights. wrap = fsdp.wrap's options: build on meta, wrap (collective), and fill
--- each rank's shards from the file. meta = true: the model on meta, without weights (wrap it,
--- then import_hf(dir, {model = m})); with wrap as well, wrapped on meta. model = an nn.GPT of
--- the folder's configuration, plain or wrapped (collective): fill it. strict = false ignores
--- tensors GPT-2 has no place for, and parameters of the model's own (LoRA adapters).
function M.import_hf(dir, opts)
  opts = util.check_opts("fsdp.import_hf", opts, IMPORT_OPTS)
  if opts.wrap ~= nil and type(opts.wrap) ~= "table" then
    raise("fsdp.import_hf: wrap must be fsdp.wrap's options table")
  end
  if opts.model ~= nil and (opts.wrap ~= nil or opts.meta) then
    raise("fsdp.import_hf: model fills a model you built: it takes no meta or wrap")
  end
  local strict = opts.strict ~= false
  local F = open_folder(dir, strict)
  local model = opts.model
  local ok, err = pcall(function()
    if model ~= nil then
      check_gpt("fsdp.import_hf", model)
      local k = same_arch(model:config(), F.cfg)
      if k then
        error(("fsdp.import_hf: the model's %s is %s, the folder's %s (%s)"):format(k,
          tostring(model:config()[k]), tostring(F.cfg[k]), join(dir, CONFIG)), 0)
      end
      -- parameters of its own (LoRA adapters) get no values from the folder
      local known = {}
      for _, e in ipairs(F.list) do known[e.path] = true end
      local order, paths = ties.all_paths(model)
      local extra = {}
      for _, p in ipairs(order) do
        if not known[paths[p][1]] then extra[#extra + 1] = paths[p][1] end
      end
      if strict and #extra > 0 then
        error(("fsdp.import_hf: the model has parameters GPT-2 has no place for: %s (pass "
          .. "strict = false to fill the rest and leave them as they are)")
          :format(util.few(extra)), 0)
      end
    else
      model = meta.meta(function() return nn.GPT(F.cfg) end)
      if opts.wrap then wrap.wrap(model, opts.wrap) end
      if opts.meta then return end -- with wrap: wrapped on meta, to be filled or materialized
    end
    -- strict: the folder has every tensor the map lists; without it, the model's own extras
    -- (checked above) are left alone
    load_tensors.load_tensors(model, source(F), {strict = strict})
  end)
  F.reader:close()
  if not ok then util.reraise(err) end
  return model
end

return M
