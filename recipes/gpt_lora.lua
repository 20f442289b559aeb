-- LoRA fine-tuning of a trained byte-level GPT, fully sharded: low-rank adapters on the
-- attention projections are trained on one fortune file while every base weight stays frozen,
-- then folded into the weights and exported.
--
--   fsdprun -n 2 recipes/gpt_lora.lua [--base=FILE.safetensors] [--short]
--        [--data=/usr/share/games/fortunes/computers] [--base_data=/usr/share/games/fortunes]
--        [--steps=300] [--base_steps=300] [--batch=16] [--ctx=64] [--d=64] [--layers=2]
--        [--heads=4] [--rank=8] [--alpha=16] [--lr=0.003] [--val_batches=8] [--seed=0]
--        [--out=checkpoints/gpt_lora]
--   --base: a safetensors file of a GPT of the given shape (gpt_fortunes' export with the same
--   --ctx/--d/--layers/--heads); without it the recipe first trains one for --base_steps on
--   --base_data and saves it as <out>/base.safetensors. --short: a tiny model and a few dozen
--   steps (the ctest smoke run).
-- What it does, step by step:
--   1. builds the GPT on the meta device, adds the adapters there (nn.lora.apply: A random, B
--      zeros, the base frozen), wraps it with one unit per Block and one per adapter, loads the
--      base weights into the shards (fsdp.load, strict = false: the file has no adapters) and
--      materializes the adapters: no rank ever holds more than its shards;
--   2. trains the adapters only (AdamW over the model: frozen parameters get no gradient, no
--      optimizer state; the Block units are fully frozen, so they reduce nothing: only the
--      adapter units' gradients are reduce-scattered) and reports the traffic and memory that
--      freezing saved;
--   3. unwraps (every rank then holds the full weights), merges (W += (alpha/rank) B A, the
--      adapters removed), checks that the merged model's logits equal the adapted model's
--      (within 1e-5) and exports it (<out>/model.safetensors, the base GPT's tensor names);
--   4. loads the export into a plain GPT and checks it computes the same logits.
-- Prints the validation loss on --data before and after fine-tuning.
local fsdp = require "fsdp"
local nn = fsdp.nn

-- Arguments with two defaults (the full run's, --short's) are declared without one and
-- resolved by arg() below.
local args = fsdp.args {
  description = "LoRA adapters on a trained byte-level GPT's attention, fully sharded; merged and exported.",
  { "base", nil, "string", "a safetensors GPT of this shape (default: train one first)" },
  { "short", false, "boolean", "a tiny model and a few dozen steps (the ctest smoke run)" },
  { "data", "/usr/share/games/fortunes/computers", "string", "the text to adapt to" },
  { "base_data", "/usr/share/games/fortunes", "string", "the base model's text, without --base" },
  { "steps", nil, "integer", "LoRA steps (default 300; --short: 40)", min = 1 },
  { "base_steps", nil, "integer", "base training steps without --base (default 300; --short: 60)", min = 1 },
  { "batch", nil, "integer", "sequences per step (default 16; --short: 8)", min = 1 },
  { "ctx", nil, "integer", "context in bytes (default 64; --short: 32)", min = 1 },
  { "d", nil, "integer", "model width (default 64; --short: 32)", min = 1 },
  { "layers", 2, "integer", "transformer blocks", min = 1 },
  { "heads", nil, "integer", "attention heads (default 4; --short: 2)", min = 1 },
  { "rank", nil, "integer", "adapter rank (default 8; --short: 4)", min = 1 },
  { "alpha", nil, "number", "adapter scale numerator (default 16; --short: 8)", min = 0 },
  { "lr", 3e-3, "number", "adapter learning rate", min = 0 },
  { "val_batches", nil, "integer", "validation batches (default 8; --short: 2)", min = 1 },
  { "seed", 0, "integer", "random seed" },
  { "out", "checkpoints/gpt_lora", "string", "where base.safetensors and model.safetensors go" },
}
local short = args.short
local function arg(k, default, short_default)
  if args[k] ~= nil then return args[k] end
  if short and short_default ~= nil then return short_default end
  return default
end
local steps = arg("steps", 300, 40)
local base_steps = arg("base_steps", 300, 60)
local batch = arg("batch", 16, 8)
local ctx = arg("ctx", 64, 32)
local cfg = {vocab = 256, ctx = ctx, d = arg("d", 64, 32), layers = arg("layers", 2, 2),
  heads = arg("heads", 4, 2), tie = true}
local lora_opts = {rank = arg("rank", 8, 4), alpha = arg("alpha", 16, 8)}
local lr = arg("lr", 3e-3)
local val_batches = arg("val_batches", 8, 2)
local seed = arg("seed", 0)
local data = arg("data", "/usr/share/games/fortunes/computers")
local base_data = arg("base_data", "/usr/share/games/fortunes")
local out = arg("out", "checkpoints/gpt_lora")
local rank, world = fsdp.rank(), fsdp.world_size()
local function say(...) if rank == 0 then print(...) end end
-- rank 0 makes the output folder (as mkdir -p, the path taken as it is); if it cannot, every
-- rank stops, with rank 0's reason
local made, why = true, nil
if rank == 0 then made, why = pcall(fsdp.core.io_mkdirs, out) end
if fsdp.all_reduce(made and 1 or 0, "min") == 0 then
  error(("gpt_lora: --out=%s: %s"):format(out, rank == 0
    and (tostring(why):gsub("^[^\n]-:%d+: ", "", 1)) or "rank 0 could not make the folder"), 0)
end

-- Mean loss over val_batches batches of the loader's held-out split: each rank evaluates its
-- rows of every batch, the ranks average.
local function validate(model, loader)
  local sum, n = 0, 0
  fsdp.no_grad(function()
    for _, x, y in loader:epoch(val_batches) do
      local rows = x:shape()[1]
      local per = math.ceil(rows / world)
      local first = math.min(rank * per, rows - 1)
      local cnt = math.max(1, math.min(per, rows - first))
      local l = nn.F.cross_entropy(model(x:narrow(1, first + 1, cnt)), y:narrow(1, first + 1, cnt))
      local real = math.max(0, math.min(per, rows - rank * per))
      sum = sum + fsdp.all_reduce(l:item() * real, "sum") / rows
      n = n + 1
    end
  end)
  return sum / n
end

local function train_loop(model, loader, n, opt, label)
  local loss_avg
  for step, x, y in loader:batches(n) do
    opt:zero_grad()
    local loss = nn.F.cross_entropy(model(x), y)
    loss:backward()
    opt:step()
    loss_avg = fsdp.all_reduce(loss:item(), "mean")
    if step % math.max(1, math.floor(n / 4)) == 0 or step == n then
      say(("%s step %d/%d: loss %.4f"):format(label, step, n, loss_avg))
    end
  end
  return loss_avg
end

-- ---- 0. a base model, unless one is given ----------------------------------------------------

local base_path = args.base
if base_path == nil then
  base_path = out .. "/base.safetensors"
  fsdp.manual_seed(seed)
  local base = fsdp.meta(function() return nn.GPT(cfg) end)
  fsdp.wrap(base, {policy = fsdp.policy.modules{nn.Block}, init = true})
  local loader = fsdp.data.text(base_data, {ctx = ctx, batch = batch, split = "train", seed = seed})
  say(("gpt_lora: no --base given: training a base GPT for %d steps on %s"):format(base_steps,
    base_data))
  train_loop(base, loader, base_steps,
    fsdp.optim.AdamW(base, {lr = 2e-3, betas = {0.9, 0.99}, weight_decay = 0.1}), "base")
  fsdp.save(base, base_path, {format = "safetensors"})
  fsdp.unwrap(base)
  base = nil
  -- the base model and its optimizer's state go now, so the figures below are LoRA's: compiled
  -- traces keep the objects they saw alive until flushed
  if jit then jit.flush() end
  for _ = 1, 4 do collectgarbage() end -- finalizers free the buffers over a few cycles
  say("saved the base model: " .. base_path)
end

-- ---- 1. the adapted model, sharded, with the base weights -----------------------------------

fsdp.manual_seed(seed + 1)
local model = fsdp.meta(function()
  local m = nn.GPT(cfg)
  nn.lora.apply(m, lora_opts)
  return m
end)
fsdp.wrap(model, {policy = fsdp.policy.modules{nn.Block, nn.LoRA}})
fsdp.load(model, base_path, {strict = false})
fsdp.materialize(model) -- the adapters: A random, B zeros
local n_base, n_lora = 0, 0
for _, p in ipairs(model:parameters()) do
  if p.requires_grad then n_lora = n_lora + p:numel() else n_base = n_base + p:numel() end
end
say(("gpt_lora: %.3fM frozen base parameters, %d adapter parameters (rank %d, alpha %g) on "
  .. "the attention projections; %d ranks"):format(n_base / 1e6, n_lora, lora_opts.rank,
  lora_opts.alpha, world))

local train = fsdp.data.text(data, {ctx = ctx, batch = batch, split = "train", seed = seed})
local val = fsdp.data.text(data, {ctx = ctx, batch = batch, split = "val", seed = seed})
local val_before = validate(model, val)
say(("val loss on %s before fine-tuning: %.4f nats/byte"):format(data, val_before))

-- ---- 2. train the adapters only ---------------------------------------------------------------

local opt = fsdp.optim.AdamW(model, {lr = lr, weight_decay = 0})
fsdp.reset_comm_stats()
train_loop(model, train, steps, opt, "lora")
local comm, mem = fsdp.comm_stats(), fsdp.memory()
local rs_all, grads_all = 0, 0
for _, u in ipairs(fsdp.units(model)) do
  rs_all = rs_all + u:padded_numel() * 4
  grads_all = grads_all + u:shard_numel() * 4
end
say(("per step: reduce_scatter %d B (every parameter trainable: %d B); gradient shards %d B "
  .. "(all trainable: %d B), optimizer state %d B on rank 0"):format(
  math.floor(comm.reduce_scatter_bytes / steps), rs_all, mem.grads, grads_all, mem.optim))
local val_after = validate(model, val)
say(("val loss on %s after fine-tuning: %.4f nats/byte (was %.4f)"):format(data, val_after,
  val_before))

-- ---- 3. merge and export ----------------------------------------------------------------------

local probe = train:encode(("Q: What is a computer?\nA: "):rep(3):sub(1, ctx))
local probe_ids = fsdp.tensor({probe}, {dtype = "i64"})
local adapted = fsdp.no_grad(function() return model(probe_ids) end)
fsdp.unwrap(model)
nn.lora.merge(model)
local merged = fsdp.no_grad(function() return model(probe_ids) end)
local diff = (adapted - merged):abs():max()
say(("merged: largest logit difference to the adapted model %.3g"):format(diff))
if not (diff <= 1e-5) then
  error(("gpt_lora: the merged model's logits differ from the adapted model's by %g"):format(diff), 0)
end
local export = out .. "/model.safetensors"
fsdp.save(model, export, {format = "safetensors"})
say("exported the merged model: " .. export)

-- ---- 4. the export is a plain GPT ------------------------------------------------------------

local plain = fsdp.meta(function() return nn.GPT(cfg) end)
fsdp.load(plain, export) -- strict: exactly the base GPT's tensors
local again = fsdp.no_grad(function() return plain(probe_ids) end)
local d2 = (again - merged):abs():max()
if d2 ~= 0 then error(("gpt_lora: the exported model computes other logits (%g)"):format(d2), 0) end
say("the export loads into a plain GPT and computes the same logits")
return val_after
