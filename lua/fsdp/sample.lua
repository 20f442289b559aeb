-- fsdp.sample — `fsdprun [options] sample CHECKPOINT --prompt=TEXT [...]` (docs/cli.md): rebuild
-- the nn.GPT a checkpoint holds from the configuration stored with it (fsdp.load_model), let
-- it continue the prompt (GPT:generate, with the key/value cache) and print the text on rank 0.
-- With -n N the model is wrapped (one unit per Block) and loaded shard by shard; every rank
-- samples the same tokens.
--
-- Text: without --tokenizer, ids are bytes (the byte vocabulary of fsdp.data.text, 256 ids);
-- --tokenizer=FILE loads a SentencePiece model through fsdp.tokenizer.load.

local core = require "fsdp.core"
local checkpoint = require "fsdp.checkpoint"
local nn = require "fsdp.nn"
local policy = require "fsdp.policy"
local util = require "fsdp.util"

local M = {}

M.usage = [[
usage: fsdprun [-n N] sample CHECKPOINT --prompt=TEXT [options]
Continue TEXT with the GPT in CHECKPOINT (a file or folder fsdp.save wrote for an nn.GPT, or a
Hugging Face GPT-2 folder such as fsdp.export_hf writes) and print prompt and continuation.

options:
  --prompt TEXT          the text to continue (required)
  --max-new-tokens N     how many tokens to add (default 200)
  --temperature T        0 is greedy (default 0.8)
  --top-k K              sample among the K most likely tokens only
  --top-p P              sample from the smallest set of tokens whose probability reaches P
  --seed S               the same seed gives the same text (default 0)
  --tokenizer FILE       a SentencePiece model (fsdp.tokenizer); default: bytes are ids
  --no-cache             recompute the whole window for every token (no key/value cache)
  -h, --help             show this help
]]

local function fail(fmt, ...)
  error(("fsdprun sample: " .. fmt):format(...), 0)
end

-- A refused command line is reported as fsdprun's own usage errors and a recipe's refused
-- arguments are: one line (rank 0's; every rank parses the same words before anything runs)
-- and status 2 on every rank, no traceback. Outside fsdprun it is raised.
local function usage_error(fmt, ...)
  local msg = ("fsdprun sample: " .. fmt .. " (try 'fsdprun sample --help')"):format(...)
  if type(package.loaded.fsdprun) ~= "table" then error(msg, 0) end
  if core.rank() == 0 then
    io.stderr:write(msg, "\n")
    io.stderr:flush()
  end
  os.exit(2)
end

local function number(flag, v, int, min, max)
  local n = tonumber(v)
  -- finite (NaN fails every comparison, so test the range the way round that refuses it)
  if n == nil or not (n >= min and n < math.huge) or (int and n % 1 ~= 0) or (max and n > max) then
    usage_error("%s must be %s %s, not '%s'", flag, int and "an integer" or "a number",
      max and ("in [%s, %s]"):format(tostring(min), tostring(max)) or (">= %s, finite"):format(min),
      tostring(v))
  end
  return n
end

--- Parse the arguments after "sample" -> {checkpoint =, prompt =, opts = generate's options,
--- tokenizer =} or nil after --help (printed to out).
function M.parse(args, out)
  local o = {opts = {max_new_tokens = 200, temperature = 0.8, seed = 0}}
  local i = 1
  local function value(flag, inline)
    if inline then return inline end
    i = i + 1
    if args[i] == nil then usage_error("%s needs a value", flag) end
    return args[i]
  end
  while args[i] ~= nil do
    local a = tostring(args[i])
    local flag, inline = a:match("^(%-%-[%w-]+)=(.*)$")
    flag = flag or a
    if a == "-h" or a == "--help" then
      out:write(M.usage)
      return nil
    elseif a:sub(1, 1) ~= "-" then
      if o.checkpoint then usage_error("more than one checkpoint ('%s' and '%s')", o.checkpoint, a) end
      o.checkpoint = a
    elseif flag == "--prompt" then
      o.prompt = value(flag, inline)
    elseif flag == "--max-new-tokens" then
      o.opts.max_new_tokens = number(flag, value(flag, inline), true, 0)
    elseif flag == "--temperature" then
      o.opts.temperature = number(flag, value(flag, inline), false, 0)
    elseif flag == "--top-k" then
      o.opts.top_k = number(flag, value(flag, inline), true, 1)
    elseif flag == "--top-p" then
      o.opts.top_p = number(flag, value(flag, inline), false, 0, 1)
      if o.opts.top_p == 0 then usage_error("--top-p must be above 0") end
    elseif flag == "--seed" then
      o.opts.seed = number(flag, value(flag, inline), true, 0, 2 ^ 53)
    elseif flag == "--tokenizer" then
      o.tokenizer = value(flag, inline)
    elseif a == "--no-cache" then
      o.opts.cache = false
    else
      usage_error("unknown option '%s'", a)
    end
    i = i + 1
  end
  if not o.checkpoint then usage_error("no checkpoint given") end
  if not o.prompt then usage_error("no --prompt given") end
  return o
end

-- Byte ids, for a model whose vocabulary holds the 256 bytes.
local bytes = {}
function bytes.encode(_, s)
  local ids = {}
  for k = 1, #s do ids[k] = s:byte(k) end
  return ids
end
function bytes.decode(_, ids)
  local parts = {}
  for k, id in ipairs(ids) do
    parts[k] = id < 256 and string.char(id) or ("<%d>"):format(id)
  end
  return table.concat(parts)
end

-- A tokenizer whose decode shows an id past its pieces as <id> (as bytes does ids past 255)
-- and decodes the runs between such ids.
local function padded(t)
  local n = t.vocab_size
  return {
    vocab_size = n,
    encode = function(_, s) return t:encode(s) end,
    decode = function(_, ids)
      local parts, run = {}, {}
      local function flush()
        if #run > 0 then parts[#parts + 1] = t:decode(run) run = {} end
      end
      for _, id in ipairs(ids) do
        if id < n then
          run[#run + 1] = id
        else
          flush()
          parts[#parts + 1] = ("<%d>"):format(id)
        end
      end
      flush()
      return table.concat(parts)
    end,
  }
end

--- Run `fsdprun sample` with the arguments after "sample"; prints on rank 0 (out: io.stdout).
--- Returns the text (on every rank); errors name what is wrong.
local run -- below: the sampling itself, once the command line is parsed

function M.command(...)
  local args = {...}
  local out = io.stdout
  local o = M.parse(args, out)
  if o == nil then return nil end
  if type(package.loaded.fsdprun) ~= "table" then return run(o, out) end
  -- Under fsdprun, a failure (a missing or foreign checkpoint, a tokenizer that does not fit)
  -- is the command's, not a recipe's: one line on rank 0 and status 1 on every rank, no
  -- traceback through this file. (Collectives fail on every rank alike, so every rank exits.)
  local ok, res = pcall(run, o, out)
  if ok then return res end
  if core.rank() == 0 then
    local msg = util.strip(res)
    if not msg:find("^fsdprun sample: ") then msg = "fsdprun sample: " .. msg end
    io.stderr:write(msg, "\n")
    io.stderr:flush()
  end
  os.exit(1)
end

function run(o, out)
  local tok = bytes
  if o.tokenizer then
    -- only when asked: fsdp.tokenizer needs the SentencePiece library, bytes need nothing
    local found, tokenizer = pcall(require, "fsdp.tokenizer")
    if not found then
      if not tostring(tokenizer):find("module 'fsdp.tokenizer' not found", 1, true) then
        error(tokenizer, 0)
      end
      fail("--tokenizer: this fsdprun has no fsdp.tokenizer (byte prompts need no --tokenizer)")
    end
    tok = tokenizer.load(o.tokenizer)
  end
  local wrap
  if core.world_size() > 1 then wrap = {policy = policy.modules{nn.Block}} end
  local model = checkpoint.load_model(o.checkpoint, {wrap = wrap})
  if tok == bytes and model.vocab < 256 then
    fail("%s: the model's vocabulary has %d ids, fewer than the 256 bytes: give its --tokenizer",
      o.checkpoint, model.vocab)
  end
  if tok == bytes and model.vocab ~= 256 and core.rank() == 0 then
    io.stderr:write(("fsdprun sample: note: the model has %d ids, not the 256 bytes; without "
      .. "--tokenizer its ids are read as bytes\n"):format(model.vocab))
  end
  if tok ~= bytes then
    -- a model may pad its vocabulary beyond the tokenizer's (ids past it print as <id>); a
    -- tokenizer larger than the model is another model's
    if tok.vocab_size > model.vocab then
      fail("--tokenizer %s has %d pieces, more than the %d ids of the model in %s: it is not the "
        .. "tokenizer the model was trained with", o.tokenizer, tok.vocab_size, model.vocab,
        o.checkpoint)
    end
    tok = padded(tok)
  end
  local ids = tok:encode(o.prompt)
  if #ids == 0 then fail("the prompt is empty") end
  for _, id in ipairs(ids) do
    if id >= model.vocab then
      fail("the prompt's id %d is outside the model's vocabulary of %d", id, model.vocab)
    end
  end
  local text = tok:decode(model:generate(ids, o.opts))
  if core.rank() == 0 then
    out:write(text, "\n")
    out:flush()
  end
  return text
end

return M
