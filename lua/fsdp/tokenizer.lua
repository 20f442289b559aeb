-- fsdp.tokenizer: subword tokenizers (SentencePiece BPE or unigram, with byte fallback) and
-- the token files that `fsdprun tokenize` writes. SentencePiece is C++ behind src/tok/tok.h;
-- its binding is fsdp.core's tok_* (src/lua/l_tok.c). docs/data.md is the manual.
--
--   fsdp.tokenizer.train{input =, vocab_size =, model =, model_type =, threads =,
--                        character_coverage =, max_sentences =} -> tokenizer
--   fsdp.tokenizer.load(path) -> tokenizer
--   tok:encode(s) -> {ids}     tok:decode(ids) -> s    tok:piece(id)   tok:free()
--   fsdp.tokenizer.write_dataset{tokenizer =, input =, out =, val_fraction =} -> summary
--   fsdp.tokenizer.command(args)      `fsdprun tokenize ...`: returns the exit status
--
-- Ids are values from 0, as every token id in fsdp (docs/nn.md). A model trained here falls
-- back to bytes and keeps text as it is (no normalization), so decode(encode(s)) == s for valid
-- UTF-8; a malformed byte comes back as U+FFFD (src/tok/tok.h).

local core = require "fsdp.core"
local U = require "fsdp.util"
local data = require "fsdp.data"

local tokenizer = {}

local floor = math.floor

-- The files of an input: a path (file or folder, as fsdp.data.text reads them) or a list of
-- paths. Errors name fn and the path.
-- A file whose first 64 KiB hold a NUL byte is binary, and left out of training and of the
-- token files alike (fsdp.data.text leaves out files with a NUL byte too).
local function is_binary(path)
  local f = io.open(path, "rb")
  if not f then return false end -- reading it later names the error
  local head = f:read(65536) or ""
  f:close()
  return head:find("\0", 1, true) ~= nil
end

local function input_files(fn, input)
  if type(input) == "string" then input = { input } end
  if type(input) ~= "table" or #input == 0 then
    U.raise(fn .. ": input must be a path (a file or a folder) or a list of paths")
  end
  local files = {}
  for _, p in ipairs(input) do
    if type(p) ~= "string" then U.raise(fn .. ": input paths must be strings, got " .. type(p)) end
    local kind, err = core.file_kind(p, true)
    if kind == nil then U.raise(("%s: cannot open %s"):format(fn, err)) end
    local ok, found = pcall(data.text_files, p)
    if not ok then U.raise(fn .. ": " .. tostring(found):gsub("^fsdp%.data%.text: ", "")) end
    for _, f in ipairs(found) do
      if not is_binary(f) then files[#files + 1] = f end
    end
  end
  if #files == 0 then U.raise(fn .. ": no text files in the input (a file holding a NUL byte is binary)") end
  return files
end

-- ---- the tokenizer object -------------------------------------------------------------------

local Tokenizer = {}
Tokenizer.__index = Tokenizer
tokenizer.Tokenizer = Tokenizer

local function wrap(h, path)
  return setmetatable({
    _h = h, path = path, vocab_size = h:vocab_size(),
    unk = h:special_id("unk"), bos = h:special_id("bos"), eos = h:special_id("eos"),
  }, Tokenizer)
end

--- Load a SentencePiece .model file (any SentencePiece model, not only those trained here).
function tokenizer.load(path)
  if type(path) ~= "string" then U.raise("fsdp.tokenizer.load: path must be a string") end
  if not core.tok_available() then
    U.raise("fsdp.tokenizer.load: this build has no SentencePiece (install libsentencepiece-dev)")
  end
  local ok, h = pcall(core.tok_load, path)
  if not ok then U.raise("fsdp.tokenizer.load: " .. U.strip(h)) end
  return wrap(h, path)
end

local TRAIN_OPTS = { "input", "vocab_size", "model", "model_type", "threads",
  "character_coverage", "max_sentences" }

-- SentencePiece's refusal of a vocabulary smaller than the pieces it must hold says what to do
-- in its own command line's terms (--character_coverage), which neither train nor fsdprun
-- tokenize has: say it in the caller's, with the numbers. `cli`: fsdprun tokenize's flags.
local function explain_required_chars(msg, v, cov, cli)
  local asked, need = msg:match("Vocabulary size is smaller than required_chars%. (%d+) vs (%d+)%.")
  if not need then return msg end
  local chars = tonumber(need) - 259
  local text = ("%s %s is too small for this corpus: it needs at least %s (259 byte and special "
    .. "pieces, and %d characters of the corpus that get pieces of their own"):format(
    cli and "--vocab-size" or "vocab_size", asked, need, chars)
  if cli then return text .. ("); give --vocab-size %s or more"):format(need) end
  return text .. (" at character_coverage %g); give vocab_size = %s or more, or a lower "
    .. "character_coverage (characters left out become byte pieces)"):format(cov or 0.9995, need)
end

-- train, with its errors worded for fsdprun tokenize's flags when `cli`
local function train(opts, cli)
  local fn = "fsdp.tokenizer.train"
  U.check_opts(fn, opts, TRAIN_OPTS)
  if opts == nil then U.raise(fn .. ": expects {input =, vocab_size =, model =}") end
  if type(opts.model) ~= "string" then U.raise(fn .. ": model must be the path of the .model to write") end
  local v = opts.vocab_size
  if type(v) ~= "number" or v % 1 ~= 0 or v < 1 then
    U.raise(fn .. ": vocab_size must be a positive integer, got " .. tostring(v))
  end
  local mt = opts.model_type or "bpe"
  if mt ~= "bpe" and mt ~= "unigram" then
    U.raise(("%s: model_type must be \"bpe\" or \"unigram\", got %s"):format(fn, tostring(mt)))
  end
  if not core.tok_available() then
    U.raise(fn .. ": this build has no SentencePiece (install libsentencepiece-dev)")
  end
  local files = input_files(fn, opts.input)
  -- the model's folder is made, as fsdp.save and fsdprun tokenize --out make theirs
  local dir = opts.model:match("^(.*)/[^/]*$")
  if dir and dir ~= "" then
    local okm, merr = pcall(core.io_mkdirs, dir)
    if not okm then U.raise(("%s: cannot make the model's folder: %s"):format(fn, U.strip(merr))) end
  end
  local ok, err = pcall(core.tok_train, {
    inputs = files, vocab_size = v, model = opts.model, model_type = mt, threads = opts.threads,
    character_coverage = opts.character_coverage, max_sentences = opts.max_sentences,
  })
  if not ok then
    local msg = U.strip(err):gsub("^tok_train: ", ""):gsub("^tokenizer train: ", "")
    msg = explain_required_chars(msg, v, opts.character_coverage, cli)
    if cli then msg = msg:gsub("^vocab_size ", "--vocab-size ") end
    U.raise(fn .. ": " .. msg)
  end
  return tokenizer.load(opts.model)
end

--- Train a model on the lines of the input files and write it to opts.model (returns it
--- loaded). Local: on several ranks, train on one and load everywhere (or use fsdprun tokenize).
function tokenizer.train(opts)
  return train(opts)
end

function Tokenizer:_handle(fn)
  if type(self) ~= "table" or getmetatable(self) ~= Tokenizer then
    U.raise(fn .. ": call it as tok:" .. fn:match("[^:]*$") .. "(...)")
  end
  if self._h == nil then U.raise(fn .. ": the tokenizer was freed") end
  return self._h
end

--- String -> Lua array of ids (values from 0). fsdp.tensor(ids, {dtype = "i64"}) makes a tensor.
function Tokenizer:encode(s)
  local h = self:_handle("tokenizer:encode")
  if type(s) ~= "string" then U.raise("tokenizer:encode: expected a string, got " .. type(s)) end
  return h:encode(s)
end

--- Ids (a Lua array, nested arrays, or a tensor of any shape, read in order) -> string.
function Tokenizer:decode(ids)
  local h = self:_handle("tokenizer:decode")
  if type(ids) == "userdata" and ids.totable then ids = ids:totable() end
  if type(ids) == "number" then ids = { ids } end -- one id; a 0-dim tensor's totable() too
  if type(ids) ~= "table" then
    U.raise("tokenizer:decode: expected a table of ids or a tensor, got " .. type(ids))
  end
  if type(ids[1]) == "table" then
    local flat = {}
    local function walk(t)
      for i = 1, #t do
        if type(t[i]) == "table" then walk(t[i]) else flat[#flat + 1] = t[i] end
      end
    end
    walk(ids)
    ids = flat
  end
  local ok, s = pcall(h.decode, h, ids)
  if not ok then U.raise(U.strip(s)) end
  return s
end

--- The piece (a string: "▁the", "<0x0A>", "<unk>") of an id.
function Tokenizer:piece(id)
  local h = self:_handle("tokenizer:piece")
  local ok, s = pcall(h.piece, h, id)
  if not ok then U.raise(U.strip(s)) end
  return s
end

--- Release the model now (idempotent); later use is an error.
function Tokenizer:free()
  if self._h ~= nil then self._h:free() end
  self._h = nil
end

function Tokenizer:__tostring()
  if self._h == nil then return "tokenizer (freed)" end
  return ("tokenizer %s (%d pieces)"):format(self.path, self.vocab_size)
end

-- ---- token datasets -------------------------------------------------------------------------

--- The dtype of a vocabulary's ids in a token file: "uint16" up to 65536 pieces, else "uint32".
function tokenizer.dtype_for(vocab_size)
  return vocab_size <= 65536 and "uint16" or "uint32"
end

-- Bytes read (and encoded) at a time; a field so that tests can make it small.
tokenizer.chunk_bytes = 1048576

-- Feed the bytes [from, to) of file f to emit(text) in pieces that end at a newline (or at
-- `to`). A newline is a byte piece of its own (no trained piece contains one: training reads
-- lines), so encoding such pieces one by one gives the ids of encoding the whole.
local function stream(f, from, to, emit)
  f:seek("set", from)
  local left, carry = to - from, ""
  while left > 0 do
    local s = f:read(math.min(tokenizer.chunk_bytes, left))
    if s == nil or #s == 0 then break end
    left = left - #s
    local text = carry .. s
    carry = ""
    if left == 0 then
      emit(text)
    else
      local nl = text:match(".*()\n")
      if nl then
        emit(text:sub(1, nl))
        carry = text:sub(nl + 1)
      else
        carry = text
      end
    end
  end
  if #carry > 0 then emit(carry) end
end

-- The start of the validation part of a file of `size` bytes: just after the first newline
-- at or after floor(size * (1 - vf)) (whole lines in both parts), or the end.
local function val_start(f, size, vf)
  if vf <= 0 then return size end
  local at = floor(size * (1 - vf))
  if at <= 0 then return 0 end
  f:seek("set", at - 1)
  local pos = at - 1
  while pos < size do
    local s = f:read(65536)
    if s == nil then break end
    local nl = s:find("\n", 1, true)
    if nl then return pos + nl end
    pos = pos + #s
  end
  return size
end

-- src's bytes written to dst (a temporary the caller renames); true, or nil and the reason.
local function copy_file(src, dst)
  local i, err = io.open(src, "rb")
  if not i then return nil, err end
  local s = i:read("*a")
  i:close()
  local o, err2 = io.open(dst, "wb")
  if not o then return nil, err2 end
  local okw, werr = o:write(s)
  local okc, cerr = o:close()
  if not okw then return nil, werr end
  if not okc then return nil, cerr end
  return true
end

local DATASET_OPTS = { "tokenizer", "input", "out", "val_fraction" }

--- Encode the input files into out/train.bin and out/val.bin (nanoGPT's raw ids) with their
--- sidecars out/train.json and out/val.json, and copy the model to out/tok.model (the
--- sidecars name it). Each file is a document: its last val_fraction (from the first line
--- break there) goes to val, the rest to train, each part followed by the end-of-text id when
--- the model has one. Returns {train =, val =, files =, vocab_size =, dtype =}.
function tokenizer.write_dataset(opts)
  local fn = "fsdp.tokenizer.write_dataset"
  U.check_opts(fn, opts, DATASET_OPTS)
  if opts == nil then U.raise(fn .. ": expects {tokenizer =, input =, out =}") end
  local tok = opts.tokenizer
  if type(tok) == "string" then tok = tokenizer.load(tok) end
  if getmetatable(tok) ~= Tokenizer then U.raise(fn .. ": tokenizer must be a tokenizer or a .model path") end
  local h = tok:_handle(fn)
  if type(opts.out) ~= "string" then U.raise(fn .. ": out must be a folder path") end
  local out = opts.out:gsub("(.)/+$", "%1") -- "data/" names its files data/train.bin
  local vf = opts.val_fraction or 0.1
  if type(vf) ~= "number" or not (vf >= 0 and vf < 1) then
    U.raise(("%s: val_fraction must be in [0, 1), got %s"):format(fn, tostring(vf)))
  end
  local files = input_files(fn, opts.input)
  local ok, err = pcall(core.io_mkdirs, out)
  if not ok then U.raise(fn .. ": " .. U.strip(err)) end
  local dtype = tokenizer.dtype_for(tok.vocab_size)
  local es = dtype == "uint16" and 2 or 4
  local eos -- the end-of-text id, packed
  if tok.eos then
    eos = es == 2 and string.char(tok.eos % 256, floor(tok.eos / 256))
      or string.char(tok.eos % 256, floor(tok.eos / 256) % 256, floor(tok.eos / 65536) % 256,
        floor(tok.eos / 16777216))
  end
  local model_name = "tok.model"
  local model_dst = out .. "/" .. model_name
  -- Every file is written as <name>.tmp first and renamed only once all of them are written:
  -- an error before that removes the temporaries and leaves the folder as it was.
  local finals = {}
  for _, split in ipairs { "train", "val" } do
    finals[#finals + 1] = ("%s/%s.bin"):format(out, split)
    finals[#finals + 1] = ("%s/%s.json"):format(out, split)
  end
  if tok.path ~= model_dst then finals[#finals + 1] = model_dst end
  local outs, counts = {}, { train = 0, val = 0 }
  local function discard()
    for _, split in ipairs { "train", "val" } do
      if outs[split] then pcall(io.close, outs[split]) end
    end
    for _, final in ipairs(finals) do os.remove(final .. ".tmp") end
  end
  local function put(split, text)
    local packed, n = h:encode_packed(text, es)
    local okw, werr = outs[split]:write(packed)
    if not okw then U.raise(("%s: writing %s/%s.bin: %s"):format(fn, out, split, tostring(werr))) end
    counts[split] = counts[split] + n
  end
  local used = {}
  local okl, lerr = pcall(function()
    if tok.path ~= model_dst then
      local okc, cerr = copy_file(tok.path, model_dst .. ".tmp")
      if not okc then
        U.raise(("%s: cannot copy %s to %s: %s"):format(fn, tok.path, model_dst, tostring(cerr)))
      end
    end
    for _, split in ipairs { "train", "val" } do
      local f, ferr = io.open(("%s/%s.bin.tmp"):format(out, split), "wb")
      if not f then U.raise(fn .. ": cannot write " .. tostring(ferr)) end
      outs[split] = f
    end
    for _, path in ipairs(files) do
      local f, oerr = io.open(path, "rb")
      if not f then U.raise(("%s: cannot open %s"):format(fn, tostring(oerr))) end
      local size = f:seek("end")
      local cut = val_start(f, size, vf)
      for _, part in ipairs { { "train", 0, cut }, { "val", cut, size } } do
        local split, a, b = part[1], part[2], part[3]
        if b > a then
          stream(f, a, b, function(text) put(split, text) end)
          if eos then
            outs[split]:write(eos)
            counts[split] = counts[split] + 1
          end
        end
      end
      used[#used + 1] = path
      f:close()
    end
    for _, split in ipairs { "train", "val" } do
      local okc, cerr = outs[split]:close()
      outs[split] = nil
      if not okc then U.raise(("%s: writing %s/%s.bin: %s"):format(fn, out, split, tostring(cerr))) end
      local okj, jerr = pcall(core.json_write, ("%s/%s.json.tmp"):format(out, split), {
        format = "fsdp.tokens", version = 1, dtype = dtype, vocab_size = tok.vocab_size,
        count = counts[split], tokenizer = model_name, eos = tok.eos, split = split,
        val_fraction = vf, files = used,
      }, { first = { "format", "version", "dtype", "vocab_size", "count", "tokenizer" } })
      if not okj then U.raise(("%s: writing %s/%s.json: %s"):format(fn, out, split, U.strip(jerr))) end
    end
  end)
  if not okl then
    discard()
    U.reraise(lerr)
  end
  for _, final in ipairs(finals) do
    local okr, rerr = os.rename(final .. ".tmp", final)
    if not okr then U.raise(("%s: cannot rename to %s: %s"):format(fn, final, tostring(rerr))) end
  end
  return { train = counts.train, val = counts.val, files = used, vocab_size = tok.vocab_size,
    dtype = dtype, out = out }
end

-- ---- fsdprun tokenize -----------------------------------------------------------------------

local USAGE = [[
usage: fsdprun tokenize --out DIR (--model TOK.model | --vocab-size N) [options] CORPUS...
Encode text files into nanoGPT-style token files: DIR/train.bin and DIR/val.bin (raw
little-endian uint16 ids, uint32 above 65536 pieces) with sidecars DIR/train.json and
DIR/val.json (dtype, vocab_size, count, tokenizer), and the model as DIR/tok.model.
CORPUS: files or folders (a folder's regular text files, as fsdp.data.text reads them).

options:
  --out DIR             the folder to write (created when missing)
  --model PATH          a SentencePiece .model to encode with
  --vocab-size N        train a model of N pieces on the corpus first (instead of --model)
  --model-type TYPE     bpe (default) or unigram, for --vocab-size
  --threads N           training threads (default 1)
  --val-fraction F      the last F of every file goes to val.bin (default 0.1; 0: none)
  -h, --help            this text
]]

local CliError = {}

local function usage_error(fmt, ...)
  error(setmetatable({ status = 2, message = fmt:format(...) .. " (see 'fsdprun tokenize --help')" },
    CliError), 0)
end

local function parse_args(args)
  local o, inputs = {}, {}
  local valued = { ["--out"] = "out", ["--model"] = "model", ["--vocab-size"] = "vocab_size",
    ["--model-type"] = "model_type", ["--threads"] = "threads", ["--val-fraction"] = "val_fraction" }
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == "-h" or a == "--help" then
      o.help = true
    elseif a == "--" then
      for j = i + 1, #args do inputs[#inputs + 1] = args[j] end
      break
    elseif a:find("^%-") then
      local name, val = a:match("^(%-%-[%w%-]+)=(.*)$")
      name = name or a
      local key = valued[name]
      if key == nil then usage_error("unknown option '%s'", name) end
      if val == nil then
        i = i + 1
        val = args[i]
        if val == nil then usage_error("%s needs a value", name) end
      end
      o[key] = val
    else
      inputs[#inputs + 1] = a
    end
    i = i + 1
  end
  if o.help then return o, inputs end
  for _, k in ipairs { "vocab_size", "threads" } do
    if o[k] ~= nil then
      local v = tonumber(o[k])
      if v == nil or v < 1 or v % 1 ~= 0 then
        usage_error("--%s '%s': expected a positive integer", k:gsub("_", "-"), o[k])
      end
      o[k] = v
    end
  end
  if o.val_fraction ~= nil then
    local v = tonumber(o.val_fraction)
    if v == nil or not (v >= 0 and v < 1) then
      usage_error("--val-fraction '%s': expected a number in [0, 1)", o.val_fraction)
    end
    o.val_fraction = v
  end
  if o.model_type ~= nil and o.model_type ~= "bpe" and o.model_type ~= "unigram" then
    usage_error("--model-type '%s': expected bpe or unigram", o.model_type)
  end
  if o.out == nil then usage_error("--out DIR is required") end
  o.out = o.out:gsub("(.)/+$", "%1")
  if (o.model == nil) == (o.vocab_size == nil) then
    usage_error("give --model PATH (a trained model) or --vocab-size N (train one), not %s",
      o.model and "both" or "neither")
  end
  if o.model and (o.model_type or o.threads) then
    usage_error("--model-type and --threads are for training (--vocab-size)")
  end
  if #inputs == 0 then usage_error("no corpus given") end
  return o, inputs
end

--- `fsdprun tokenize ARGS...`: writes the dataset, prints what it wrote on env.stdout and
--- returns 0; prints "fsdprun tokenize: <message>" on env.stderr and returns 1 (a file that
--- cannot be read, a training failure) or 2 (usage).
function tokenizer.command(args, env)
  env = env or {}
  local stdout, stderr = env.stdout or io.stdout, env.stderr or io.stderr
  local ok, res = pcall(function()
    local o, inputs = parse_args(args)
    if o.help then
      stdout:write(USAGE)
      return 0
    end
    local tok, trained
    local okt, err = pcall(function()
      if o.vocab_size then
        local okm, merr = pcall(core.io_mkdirs, o.out)
        if not okm then error(U.strip(merr), 0) end
        -- trained beside tok.model, which write_dataset replaces with the token files: the
        -- ids already there must never be left beside a model that did not make them
        trained = o.out .. "/tok.model.train.tmp"
        tok = train({ input = inputs, vocab_size = o.vocab_size, model = trained,
          model_type = o.model_type, threads = o.threads }, true)
        stdout:write(("fsdprun tokenize: trained %s/tok.model (%d pieces, %s)\n"):format(o.out,
          tok.vocab_size, o.model_type or "bpe"))
      else
        tok = tokenizer.load(o.model)
      end
      return tokenizer.write_dataset { tokenizer = tok, input = inputs, out = o.out,
        val_fraction = o.val_fraction }
    end)
    if trained then os.remove(trained) end
    if not okt then error(setmetatable({ status = 1, message = U.strip(err) }, CliError), 0) end
    local r = err
    stdout:write(("fsdprun tokenize: wrote %s/train.bin (%d tokens) and %s/val.bin (%d tokens), %s ids, "
      .. "vocabulary %d, from %d file%s\n"):format(r.out, r.train, r.out, r.val, r.dtype, r.vocab_size,
      #r.files, #r.files == 1 and "" or "s"))
    return 0
  end)
  if ok then return res end
  if getmetatable(res) == CliError then
    stderr:write("fsdprun tokenize: ", (res.message:gsub("^fsdp%.tokenizer%.[%w_]+: ", "")), "\n")
    stderr:flush()
    return res.status
  end
  error(res, 0)
end

return tokenizer
