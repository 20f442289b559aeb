-- From text to a Hugging Face model: a subword tokenizer trained on a corpus, the corpus
-- tokenized into memory-mapped token files, a GPT trained on them fully sharded in bf16, and
-- the result exported as a GPT-2 folder that transformers (and `fsdprun sample`) load.
--
--   fsdprun -n 2 recipes/gpt_tokens.lua [--data=/usr/share/games/fortunes] [--out=DIR]
--        [--vocab=2048] [--steps=3000] [--mp=bf16|none] [--resume] [--name=value ...]
--   (`--help` lists the arguments, declared below with their defaults)
--
-- Everything goes into --out (default checkpoints/gpt_tokens):
--   tok.model                 the SentencePiece tokenizer (BPE with byte fallback), trained on
--                             --data by rank 0 unless it is already there
--   train.bin, val.bin        the corpus as token ids (nanoGPT's layout) with their sidecars
--   train.json, val.json      (fsdp.tokenizer.write_dataset), written once, by rank 0
--   ckpt/                     a sharded checkpoint every --ckpt_every steps and at the end
--                             (model, AdamW, schedule, loader position): --resume continues
--   hf/                       config.json + model.safetensors (fsdp.export_hf), at the end
--   metrics.jsonl, metrics.svg
-- A second run with the same --out reuses the tokenizer and the token files (a tokenizer of
-- another size than --vocab is refused). Then:
--   fsdprun sample DIR/hf --tokenizer=DIR/tok.model --prompt="Q: "
-- Losses are nats per token; the summary also gives them per byte of text (through the
-- corpus' bytes per token), comparable with gpt_fortunes' byte-level losses.
local fsdp = require "fsdp"
local nn = fsdp.nn
local collective = require "fsdp.collective"
local clock = fsdp.core.clock -- wall seconds

local args = fsdp.args {
  description = "A tokenizer, token files, a GPT trained on them fully sharded, a Hugging Face export.",
  { "data", "/usr/share/games/fortunes", "string", "a text file or a folder of them" },
  { "out", "checkpoints/gpt_tokens", "string", "where the tokenizer, token files, checkpoint and export go" },
  { "vocab", 2048, "integer", "tokenizer pieces: 259 bytes and specials, one per character of "
    .. "--data (the default needs 346 or more), then merges", min = 260 },
  { "model_type", "bpe", "string", "tokenizer model", choices = { "bpe", "unigram" } },
  { "val_fraction", 0.1, "number", "the last fraction of every file held out", min = 0.01, max = 0.5 },
  { "steps", 3000, "integer", "optimizer steps", min = 1 },
  { "batch", 16, "integer", "sequences per step (global)", min = 1 },
  { "ctx", 128, "integer", "context length in tokens", min = 1 },
  { "d", 128, "integer", "model width", min = 1 },
  { "layers", 4, "integer", "transformer blocks", min = 1 },
  { "heads", 4, "integer", "attention heads (divides --d)", min = 1 },
  { "lr", 2e-3, "number", "peak learning rate (cosine schedule)", min = 0 },
  { "mp", "bf16", "string", "mixed precision (none: f32 throughout)", choices = { "bf16", "none" } },
  { "eval_every", 500, "integer", "validate every N steps", min = 1 },
  { "val_batches", 20, "integer", "validation batches per evaluation", min = 1 },
  { "ckpt_every", 500, "integer", "a sharded checkpoint every N steps (0: only at the end)", min = 0 },
  { "resume", false, "boolean", "continue from the checkpoint in <out>/ckpt" },
  { "stop_after", nil, "integer", "stop after step N as if interrupted", min = 1 },
  { "prompt", "Q: ", "string", "the start of the text sampled at the end" },
  { "sample", 100, "integer", "tokens sampled at the end", min = 0 },
  { "seed", 0, "integer", "random seed (parameters, batches, sample)" },
}
local out, steps, batch, ctx, lr = args.out, args.steps, args.batch, args.ctx, args.lr
local mp = args.mp ~= "none" and args.mp or nil
local rank, world = fsdp.rank(), fsdp.world_size()
local function say(...) if rank == 0 then print(...) end end
local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

-- Rank 0 runs fn (writing files); then every rank learns whether it worked (the same error
-- on every rank otherwise) and returns what rank 0's fn returned. The other ranks wait in the
-- collective meanwhile, so the files exist on every rank's return: nothing polls for them.
local function on_rank0(what, fn)
  local ok, res = true, nil
  if rank == 0 then ok, res = pcall(fn) end
  local msg = collective.check_outcome(ok, res, what)
  if msg then error(("gpt_tokens: %s: %s"):format(what, msg), 0) end
  return collective.broadcast(ok and res or nil, 0, what)
end

fsdp.manual_seed(args.seed)

-- ---- 1. the tokenizer, trained once ----------------------------------------------------------

local tok_path = out .. "/tok.model"
local tok_s = on_rank0("tokenizer", function()
  if exists(tok_path) then return -1 end
  fsdp.core.io_mkdirs(out)
  local t0 = clock()
  fsdp.tokenizer.train { input = args.data, vocab_size = args.vocab, model = tok_path,
    model_type = args.model_type }:free()
  return clock() - t0
end)
local tok = fsdp.tokenizer.load(tok_path) -- every rank its own copy of the same file
if tok.vocab_size ~= args.vocab then
  error(("gpt_tokens: %s has %d pieces, not --vocab=%d: give another --out, or remove it to "
    .. "train a new one"):format(tok_path, tok.vocab_size, args.vocab), 0)
end
say(tok_s >= 0 and ("tokenizer: trained %s (%d pieces, %s) on %s in %.1f s"):format(tok_path,
  tok.vocab_size, args.model_type, args.data, tok_s)
  or ("tokenizer: %s (%d pieces), already there"):format(tok_path, tok.vocab_size))

-- ---- 2. the token files, written once ----------------------------------------------------------

-- val.json is written last (write_dataset: each .bin renamed into place, then its sidecar)
local data_s = on_rank0("token files", function()
  if exists(out .. "/val.json") then return -1 end
  local t0 = clock()
  fsdp.tokenizer.write_dataset { tokenizer = tok, input = args.data, out = out,
    val_fraction = args.val_fraction }
  return clock() - t0
end)
local train = fsdp.data.tokens(out, { ctx = ctx, batch = batch, split = "train", seed = args.seed })
local val = fsdp.data.tokens(out, { ctx = ctx, batch = batch, split = "val", seed = args.seed })
if train.vocab ~= tok.vocab_size then
  error(("gpt_tokens: %s holds ids of a %d-piece vocabulary, the tokenizer has %d: remove the "
    .. "token files to write them again"):format(train.sidecar, train.vocab, tok.vocab_size), 0)
end
-- checked now rather than at the first validation, eval_every steps into the run
for _, l in ipairs { train, val } do
  if l:size() < ctx + 1 then
    error(("gpt_tokens: %s has %d tokens, fewer than --ctx + 1 = %d: %s"):format(l.path, l:size(),
      ctx + 1, l == val and "validation needs one window (more text in the last --val_fraction "
        .. "of the files, or a smaller --ctx)" or "give more text, or a smaller --ctx"), 0)
  end
end
-- bytes per token: the corpus' bytes over its ids (the end-of-text id after each part left
-- out); unknown (nil) when the files the sidecar names are no longer where it says
local bytes = 0
for _, f in ipairs(train.meta.files or {}) do
  local h = io.open(f, "rb")
  bytes = bytes and h and bytes + h:seek("end") or nil
  if h then h:close() end
end
local eos_ids = 0
for _, l in ipairs { train, val } do
  if l.eos then eos_ids = eos_ids + #(l.meta.files or {}) end
end
local bytes_per_token = bytes and bytes > 0 and bytes / (train:size() + val:size() - eos_ids) or nil
say(("token files: %d train / %d val tokens in %s (%s), %s bytes of text per token%s")
  :format(train:size(), val:size(), out, train.dtype,
    bytes_per_token and ("%.2f"):format(bytes_per_token) or "? (corpus not found)",
    data_s >= 0 and (", written in %.1f s"):format(data_s) or ", already there"))

-- ---- 3. the model, sharded, and its training -------------------------------------------------

local model = fsdp.meta(function()
  return nn.GPT { vocab = tok.vocab_size, ctx = ctx, d = args.d, layers = args.layers,
    heads = args.heads, tie = true }
end)
local nparams = 0
for _, p in ipairs(model:parameters()) do nparams = nparams + p:numel() end
fsdp.wrap(model, { policy = fsdp.policy.modules { nn.Block }, init = true, mp = mp })
say(("gpt_tokens: %.2fM parameters (head tied to wte), vocabulary %d, %d steps of %dx%d tokens, "
  .. "%d rank%s, %s"):format(nparams / 1e6, tok.vocab_size, steps, batch, ctx, world,
  world == 1 and "" or "s", mp and ("mixed precision " .. mp) or "f32"))

-- max_grad_norm: each step clips the gradients to norm 1 (as fsdp.clip_grad_norm would, the
-- coefficient going into AdamW's kernel) and keeps the norm before clipping in opt.grad_norm
local opt = fsdp.optim.AdamW(model, { lr = lr, betas = { 0.9, 0.99 }, weight_decay = 0.1,
  max_grad_norm = 1.0 })
local schedule = fsdp.optim.cosine(opt, { warmup = math.min(100, math.floor(steps / 10)),
  total = steps, min_lr = lr / 10 })

-- Mean validation loss over val_batches batches of windows spread over the held-out tokens:
-- every rank sees every window, evaluates its rows of the batch, and the ranks average.
local function validate()
  model:eval()
  local sum, n = 0, 0
  fsdp.no_grad(function()
    for _, x, y in val:epoch(args.val_batches) do
      local rows = x:shape()[1]
      local per = math.ceil(rows / world)
      local first = math.min(rank * per, rows - 1) -- a rank past the end repeats the last row
      local cnt = math.max(1, math.min(per, rows - first))
      local l = nn.F.cross_entropy(model(x:narrow(1, first + 1, cnt)), y:narrow(1, first + 1, cnt)):item()
      local real = math.max(0, math.min(per, rows - rank * per)) -- rows this rank really owns
      sum = sum + fsdp.all_reduce(l * real, "sum") / rows
      n = n + 1
    end
  end)
  model:train()
  return sum / n
end

local ckpt_dir = out .. "/ckpt"
local metrics_path = out .. "/metrics.jsonl"
fsdp.log.setup { total = steps, jsonl = metrics_path, append = args.resume or nil }
local train_loss, val_loss, first_loss
local ckpt_opts = { optimizer = opt, schedule = schedule, loaders = { train = train } }
local saved_at
local function save_checkpoint(step)
  ckpt_opts.step = step
  ckpt_opts.extra = { train_loss = train_loss, val_loss = val_loss, first_loss = first_loss }
  fsdp.save(model, ckpt_dir, ckpt_opts)
  saved_at = step
end
if args.resume then
  local extra = fsdp.load(model, ckpt_dir, ckpt_opts)
  train_loss, val_loss, first_loss = extra.train_loss, extra.val_loss, extra.first_loss
  say(("resumed from %s at step %d"):format(ckpt_dir, train.cursor))
  saved_at = train.cursor
end
local ckpt_every = args.ckpt_every > 0 and args.ckpt_every or nil
local todo = steps - train.cursor
local t0, done, aside = clock(), 0, 0 -- aside: seconds spent validating and checkpointing
for step, x, y in todo > 0 and train:batches(todo) or function() end do
  schedule:step()
  local loss = nn.F.cross_entropy(model(x), y)
  opt:zero_grad()
  loss:backward()
  opt:step()
  local grad_norm = opt.grad_norm
  train_loss = fsdp.all_reduce(loss:item(), "mean") -- every rank's slice of the global batch
  first_loss = first_loss or train_loss
  done = done + 1
  local metrics = { loss = train_loss, lr = opt.lr, tokens = batch * ctx, grad_norm = grad_norm }
  local t1 = clock()
  if step % args.eval_every == 0 or step == steps then
    val_loss = validate()
    metrics.val_loss = val_loss
  end
  fsdp.log(step, metrics)
  if ckpt_every and step % ckpt_every == 0 then save_checkpoint(step) end
  aside = aside + clock() - t1
  if args.stop_after and step >= args.stop_after then
    fsdp.log.finish()
    say(("stopped after step %d"):format(step))
    do return end
  end
end
local train_s = clock() - t0
fsdp.log.finish()
if saved_at ~= train.cursor then save_checkpoint(train.cursor) end
if rank == 0 then
  local svg = metrics_path:gsub("%.jsonl$", "") .. ".svg"
  local ok, err = pcall(fsdp.plot.write, metrics_path, svg, { title = "gpt_tokens" })
  say(ok and ("plot of loss and learning rate: " .. svg) or ("no plot: " .. tostring(err)))
end
if done > 0 then
  local step_s = train_s - aside
  say(("trained %d steps in %.1f s (%.1f s of it validating and checkpointing): %.3f s per "
    .. "step, %.0f tokens/s"):format(done, train_s, aside, step_s / done, done * batch * ctx / step_s))
end
if val_loss == nil then val_loss = validate() end
say(("train loss %.4f (step 1: %.4f)  val loss %.4f nats/token%s"):format(train_loss or 0 / 0,
  first_loss or 0 / 0, val_loss,
  bytes_per_token and (" = %.4f nats/byte"):format(val_loss / bytes_per_token) or ""))

-- ---- 4. the Hugging Face export and a sample ---------------------------------------------------

fsdp.export_hf(model, out .. "/hf")
say(("exported %s/hf (config.json, model.safetensors); sharded checkpoint: %s"):format(out, ckpt_dir))
-- every rank runs the sampler (its forwards are collective); rank 0 prints
if args.sample > 0 then
  local ids = model:generate(tok:encode(args.prompt), { max_new_tokens = args.sample,
    temperature = 0.8, top_k = 50, seed = args.seed })
  say("sample:\n" .. tok:decode(ids))
end
say(("more samples: fsdprun sample %s/hf --tokenizer=%s --prompt=%q"):format(out, tok_path, args.prompt))
return val_loss
