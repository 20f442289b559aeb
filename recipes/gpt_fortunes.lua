-- A small byte-level GPT with tied embeddings, trained on Debian's fortunes, fully sharded.
--
--   fsdprun -n 2 recipes/gpt_fortunes.lua [--steps=1500] [--name=value ...]
--   (`--help` lists the arguments, declared below with their defaults)
--   --metrics: JSONL metrics, default <ckpt_dir>/metrics.jsonl; at the end rank 0 draws them
--   beside it as <FILE without .jsonl>.svg (fsdp.plot) and prints where.
--   checkpoints: every N steps and after the last one a sharded checkpoint (model, AdamW state,
--   schedule, loader position, random state) replaces the previous one in ckpt_dir; --resume
--   continues from it (bitwise the same run; the metrics file is appended to); --export writes
--   the trained model as one safetensors file at the end; --stop_after=N stops after step N as
--   if interrupted, without a checkpoint of its own (to try --resume).
--   --mp: mixed precision (fsdp.wrap's mp option: parameters gathered and computed in bf16, f32
--   master shards, gradients reduced in f32, logits and losses in f32; f16 also uses a dynamic
--   loss scaler, fsdp.optim.GradScaler, saved in the checkpoints' extra). Checkpoints hold the
--   f32 masters either way.
-- Prints train and validation loss (nats per byte) as it goes, and a sampled text at the end.
-- The model is wrapped with one unit per Block (embeddings, final norm and the tied head in the
-- root unit); each of N ranks trains on its slice of every global batch, so the run computes
-- the same thing at any N. The default run reaches a validation loss below 2.0 in a few
-- minutes on a 2-core machine (`make run` starts it on 2 ranks).
local fsdp = require "fsdp"
local nn = fsdp.nn

local args = fsdp.args {
  description = "A byte-level GPT trained on Debian's fortunes, fully sharded, checkpointed.",
  { "steps", 1500, "integer", "optimizer steps", min = 1 },
  { "batch", 16, "integer", "sequences per step (global)", min = 1 },
  { "ctx", 128, "integer", "context length in bytes", min = 1 },
  { "d", 128, "integer", "model width", min = 1 },
  { "layers", 4, "integer", "transformer blocks", min = 1 },
  { "heads", 4, "integer", "attention heads (divides --d)", min = 1 },
  { "lr", 2e-3, "number", "peak learning rate (cosine schedule)", min = 0 },
  { "eval_every", 250, "integer", "validate every N steps", min = 1 },
  { "val_batches", 20, "integer", "validation batches per evaluation", min = 1 },
  { "sample", 300, "integer", "bytes sampled at the end", min = 0 },
  { "data", "/usr/share/games/fortunes", "string", "a text file or a folder of them" },
  { "seed", 0, "integer", "random seed (parameters, batches)" },
  { "metrics", nil, "string", "JSONL metrics file (default <ckpt_dir>/metrics.jsonl)" },
  { "strategy", "full", "string", "sharding strategy", choices = { "full", "grad_op", "none" } },
  { "mp", nil, "string", "mixed precision", choices = { "bf16", "f16" } },
  { "ckpt_dir", "checkpoints/gpt_fortunes", "string", "where checkpoints go" },
  { "ckpt_every", 500, "integer", "a sharded checkpoint every N steps (0: none)", min = 0 },
  { "resume", false, "boolean", "continue from the checkpoint in --ckpt_dir" },
  { "export", nil, "string", "safetensors file written at the end (default "
    .. "<ckpt_dir>/model.safetensors; false: none)" },
  { "stop_after", nil, "integer", "stop after step N as if interrupted", min = 1 },
}
local steps, batch, ctx, lr = args.steps, args.batch, args.ctx, args.lr
local eval_every, val_batches, seed, path = args.eval_every, args.val_batches, args.seed, args.data
local rank, world = fsdp.rank(), fsdp.world_size()
local function say(...) if rank == 0 then print(...) end end
-- a sharded checkpoint every 500 steps and at the end (--ckpt_every=0: none) and a safetensors
-- export at the end (--export=false: none), both in ckpt_dir by default
local ckpt_dir = args.ckpt_dir
local ckpt_every = args.ckpt_every
if ckpt_every == 0 then ckpt_every = nil end
local export = args.export
if export == nil then export = ckpt_dir .. "/model.safetensors" end
if export == "false" then export = nil end
fsdp.manual_seed(seed)

local train = fsdp.data.text(path, { ctx = ctx, batch = batch, split = "train", seed = seed })
local val = fsdp.data.text(path, { ctx = ctx, batch = batch, split = "val", seed = seed })

-- built on the meta device (shapes only); wrap{init = true} below gives each rank only its
-- shards, with exactly the values an eager build would have (docs/init.md)
local model = fsdp.meta(function()
  return nn.GPT { vocab = 256, ctx = ctx, d = args.d, layers = args.layers,
    heads = args.heads, tie = true }
end)
local nparams = 0
for _, p in ipairs(model:parameters()) do nparams = nparams + p:numel() end
local mp = args.mp
fsdp.wrap(model, { policy = fsdp.policy.modules { nn.Block }, strategy = args.strategy,
  init = true, mp = mp })
say(("gpt_fortunes: %.2fM parameters (head tied to wte), %d train / %d val bytes, %d steps of %dx%d")
  :format(nparams / 1e6, train:size(), val:size(), steps, batch, ctx)
  .. (world > 1 and (", %d ranks"):format(world) or "") .. (mp and (", mixed precision " .. mp) or ""))

local opt = fsdp.optim.AdamW(model, { lr = lr, betas = { 0.9, 0.99 }, weight_decay = 0.1 })
local schedule = fsdp.optim.cosine(opt, { warmup = math.min(100, math.floor(steps / 10)),
  total = steps, min_lr = lr / 10 })
-- f16's range is narrow: a dynamic loss scaler keeps small gradients from flushing to 0 and
-- skips the steps whose gradients overflow. bf16 has f32's range: disabled, the scaler is a
-- pass-through (the loop below is then the plain one, bit for bit).
local scaler = fsdp.optim.GradScaler { enabled = mp == "f16" }
local skipped = 0

-- Mean validation loss over val_batches batches of windows spread over the held-out split.
-- Every rank sees every window; each evaluates its rows of the batch and the ranks average.
local function validate()
  model:eval()
  local sum, n = 0, 0
  fsdp.no_grad(function()
    for _, x, y in val:epoch(val_batches) do
      local rows = x:shape()[1]
      local per = math.ceil(rows / world)
      local first = math.min(rank * per, rows - 1) -- a rank past the end repeats the last row
      local cnt = math.max(1, math.min(per, rows - first))
      local xl, yl = x:narrow(1, first + 1, cnt), y:narrow(1, first + 1, cnt)
      local l = nn.F.cross_entropy(model(xl), yl):item()
      local real = math.max(0, math.min(per, rows - rank * per)) -- rows this rank really owns
      sum = sum + fsdp.all_reduce(l * real, "sum") / rows
      n = n + 1
    end
  end)
  model:train()
  return sum / n
end

-- JSONL metrics (default beside the checkpoints; setup makes the folder, and a resumed run
-- appends); rank 0 draws them as an SVG at the end
local metrics_path = args.metrics or (ckpt_dir .. "/metrics.jsonl")
fsdp.log.setup { total = steps, jsonl = metrics_path, append = args.resume or nil }
local train_loss, val_loss
local ema
local ckpt_opts = { optimizer = opt, schedule = schedule, loaders = { train = train } }
local saved_at -- the step of the checkpoint in ckpt_dir, when this run wrote or loaded it
local function save_checkpoint(step)
  ckpt_opts.step, ckpt_opts.extra = step, { train_loss = train_loss, val_loss = val_loss, ema = ema,
    scaler = scaler:state_dict() }
  fsdp.save(model, ckpt_dir, ckpt_opts)
  saved_at = step
end
if args.resume then
  local extra = fsdp.load(model, ckpt_dir, ckpt_opts)
  train_loss, val_loss, ema = extra.train_loss, extra.val_loss, extra.ema
  if scaler:is_enabled() and extra.scaler and extra.scaler.enabled then
    scaler:load_state_dict(extra.scaler)
  end
  say(("resumed from %s at step %d"):format(ckpt_dir, train.cursor))
  saved_at = train.cursor
end
-- (a run resumed from its own end has no step left to train)
local todo = steps - train.cursor
for step, x, y in todo > 0 and train:batches(todo) or function() end do
  schedule:step()
  local loss = nn.F.cross_entropy(model(x), y)
  opt:zero_grad()
  scaler:scale(loss):backward()
  scaler:unscale_(opt) -- clip the true gradients
  local grad_norm = fsdp.clip_grad_norm(model, 1.0) -- before clipping; inf/NaN: the step is skipped
  if not scaler:step(opt) then skipped = skipped + 1 end -- every rank takes the same decision
  scaler:update()
  train_loss = fsdp.all_reduce(loss:item(), "mean") -- every rank's slice of the global batch
  ema = ema and 0.95 * ema + 0.05 * train_loss or train_loss
  local metrics = { loss = train_loss, lr = opt.lr, tokens = batch * ctx }
  if grad_norm == grad_norm and grad_norm < math.huge then metrics.grad_norm = grad_norm end
  if scaler:is_enabled() then metrics.scale = scaler:get_scale() end
  if step % eval_every == 0 or step == steps then
    val_loss = validate()
    metrics.val_loss = val_loss
  end
  fsdp.log(step, metrics)
  if ckpt_every and step % ckpt_every == 0 then save_checkpoint(step) end
  if args.stop_after and step >= args.stop_after then
    fsdp.log.finish()
    say(("stopped after step %d"):format(step))
    do return end
  end
end
fsdp.log.finish()
-- the last steps since a multiple of ckpt_every: saved too, so that --resume always finds the
-- end of this run
if ckpt_every and saved_at ~= train.cursor then save_checkpoint(train.cursor) end
if rank == 0 then -- fsdp.plot is plain Lua, no collective: rank 0 alone draws it
  local svg = metrics_path:gsub("%.jsonl$", "") .. ".svg"
  local ok, err = pcall(fsdp.plot.write, metrics_path, svg, { title = "gpt_fortunes" })
  say(ok and ("plot of loss and learning rate: " .. svg) or ("no plot: " .. tostring(err)))
end
if export then
  fsdp.save(model, export, { format = "safetensors" })
  say("exported the trained model: " .. export)
end
if ckpt_every then say("sharded checkpoint (resume with --resume): " .. ckpt_dir) end

say(("train loss %.4f (smoothed %.4f)  val loss %.4f nats/byte"):format(train_loss, ema, val_loss))
if scaler:is_enabled() then
  say(("loss scaler: scale %g, %d of the steps run here skipped (inf/NaN gradients)")
    :format(scaler:get_scale(), skipped))
end
-- every rank runs the sampler (the forward passes are collective); rank 0 prints
local text = model:generate(train:encode("Q: "), { max_new_tokens = args.sample, temperature = 0.8 })
say("sample:\n" .. train:decode(text))
return val_loss
