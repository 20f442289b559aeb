-- The fortunes GPT (recipes/gpt_fortunes.lua's model) pruned during training, fully sharded:
-- gradual magnitude pruning (GMP) of the attention and MLP projections to 50%, with one
-- projection excluded; or, with --nm, 2:4 sparsity on the MLP and GMP on the attention.
--
--   fsdprun -n 2 recipes/prune_gpt.lua [--steps=1500] [--sparsity=0.5] [--nm] [--name=value ...]
--   (`--help` lists the arguments, declared below with their defaults)
--
-- Training runs dense for the first 20% of the steps; the validation loss is measured there
-- ("before pruning"). GMP then raises the sparsity of the selected weights along the cubic
-- schedule s_t = s_f + (s_i - s_f)(1 - p)^3 (Zhu & Gupta 2017) from 5% to --sparsity, every 2% of
-- the run, until 70% of the run (scope "param": each weight gets that sparsity); the last 30%
-- fine-tune with the masks held. With --nm the MLP weights get 2:4 (two of every four
-- consecutive input weights kept) when pruning starts and the attention alone follows GMP.
-- The excluded projection (default: the first block's attention output projection) is
-- reported at 0%. Prints the sparsity table (rank 0; also in the JSONL metrics as
-- sparsity_report) and the validation loss before and after pruning. Nothing is gathered to
-- prune or to count zeros: every rank works on its shards (docs/pruning.md).
local fsdp = require "fsdp"
local nn = fsdp.nn
local prune = fsdp.prune

local args = fsdp.args {
  description = "The fortunes GPT pruned during training (GMP, or 2:4 on the MLP with --nm).",
  { "steps", 1500, "integer", "optimizer steps", min = 1 },
  { "sparsity", 0.5, "number", "final sparsity of the pruned projections", min = 0, max = 1 },
  { "nm", false, "boolean", "2:4 sparsity on the MLP, GMP on the attention only" },
  { "exclude", "^blocks%.1%.attn%.proj%.weight$", "string", "Lua pattern of parameters kept dense" },
  { "batch", 16, "integer", "sequences per step (global)", min = 1 },
  { "ctx", 128, "integer", "context length in bytes", min = 1 },
  { "d", 128, "integer", "model width", min = 1 },
  { "layers", 4, "integer", "transformer blocks", min = 1 },
  { "heads", 4, "integer", "attention heads (divides --d)", min = 1 },
  { "lr", 2e-3, "number", "peak learning rate (cosine schedule)", min = 0 },
  { "val_batches", 20, "integer", "validation batches per evaluation", min = 1 },
  { "data", "/usr/share/games/fortunes", "string", "a text file or a folder of them" },
  { "seed", 0, "integer", "random seed (parameters, batches)" },
  { "metrics", nil, "string", "write JSONL metrics to this file" },
  { "strategy", "full", "string", "sharding strategy", choices = { "full", "grad_op", "none" } },
}
local steps, batch, ctx, lr = args.steps, args.batch, args.ctx, args.lr
local val_batches, seed, target = args.val_batches, args.seed, args.sparsity
local path, exclude = args.data, args.exclude
local rank, world = fsdp.rank(), fsdp.world_size()
local function say(...) if rank == 0 then print(...) end end
fsdp.manual_seed(seed)

local train = fsdp.data.text(path, { ctx = ctx, batch = batch, split = "train", seed = seed })
local val = fsdp.data.text(path, { ctx = ctx, batch = batch, split = "val", seed = seed })

local model = nn.GPT { vocab = 256, ctx = ctx, d = args.d, layers = args.layers,
  heads = args.heads, tie = true }
fsdp.wrap(model, { policy = fsdp.policy.modules { nn.Block }, strategy = args.strategy })

local opt = fsdp.optim.AdamW(model, { lr = lr, betas = { 0.9, 0.99 }, weight_decay = 0.1 })
local lr_schedule = fsdp.optim.cosine(opt, { warmup = math.min(100, math.floor(steps / 10)),
  total = steps, min_lr = lr / 10 })

local start = math.max(1, math.floor(steps * 0.2))
local stop = math.max(start + 1, math.floor(steps * 0.7))
local every = math.max(1, math.floor(steps / 50))
local attn = { "attn%.qkv%.weight", "attn%.proj%.weight" }
local mlp = { "mlp%.fc%.weight", "mlp%.proj%.weight" }
local prunable = { attn[1], attn[2], mlp[1], mlp[2] }
local modifiers
if args.nm then
  modifiers = {
    { kind = "gmp", params = attn, exclude = exclude, start = start, stop = stop, every = every,
      init = 0.05, final = target },
    { kind = "nm", params = mlp, exclude = exclude, at = start, n = 2, m = 4 },
  }
else
  modifiers = {
    { kind = "gmp", params = prunable, exclude = exclude, start = start, stop = stop, every = every,
      init = 0.05, final = target },
  }
end
local pruning = prune.schedule(modifiers)

say(("prune_gpt: %.2fM parameters, %d steps of %dx%d, %s from step %d to %d, excluded %s%s")
  :format(model:num_parameters() / 1e6, steps, batch, ctx,
    args.nm and ("GMP to %.0f%% on attention, 2:4 on the MLP"):format(100 * target)
      or ("GMP to %.0f%% on attention and MLP projections"):format(100 * target),
    start, stop, exclude, world > 1 and (", %d ranks"):format(world) or ""))

-- Mean validation loss over val_batches batches (as recipes/gpt_fortunes.lua): every rank sees
-- every window, evaluates its rows, and the ranks average.
local function validate()
  model:eval()
  local sum = 0
  local n = 0
  fsdp.no_grad(function()
    for _, x, y in val:epoch(val_batches) do
      local rows = x:shape()[1]
      local per = math.ceil(rows / world)
      local first = math.min(rank * per, rows - 1)
      local cnt = math.max(1, math.min(per, rows - first))
      local l = nn.F.cross_entropy(model(x:narrow(1, first + 1, cnt)), y:narrow(1, first + 1, cnt)):item()
      local real = math.max(0, math.min(per, rows - rank * per))
      sum = sum + fsdp.all_reduce(l * real, "sum") / rows
      n = n + 1
    end
  end)
  model:train()
  return sum / n
end

fsdp.log.setup { total = steps, jsonl = args.metrics }
local val_before, train_loss
for step, x, y in train:batches(steps) do
  lr_schedule:step()
  if step == start then val_before = validate() end
  local ran = pruning:step(model, step)
  local loss = nn.F.cross_entropy(model(x), y)
  opt:zero_grad()
  loss:backward()
  fsdp.clip_grad_norm(model, 1.0)
  opt:step()
  train_loss = fsdp.all_reduce(loss:item(), "mean")
  local metrics = { loss = train_loss, lr = opt.lr, tokens = batch * ctx }
  if step == start then metrics.val_loss = val_before end
  if ran then metrics.sparsity = prune.report(model, { params = prunable }).prunable_sparsity end
  if step == steps then
    metrics.val_loss = validate()
    metrics.sparsity_report = prune.report(model, { params = prunable }):json()
  end
  fsdp.log(step, metrics)
end
fsdp.log.finish()
local val_after = validate()

local report = prune.report(model, { params = prunable })
say(tostring(report))
if args.nm then
  -- Check the 2:4 structure on the shards: every group of 4 consecutive input weights of an
  -- MLP weight keeps exactly 2 (groups of 4 never straddle ranks: shards start at multiples of
  -- 16 elements). Each rank counts its own groups; one all_reduce sums them.
  local mask = require "fsdp.mask"
  local groups, bad = 0, 0
  for p_path, p in model:named_parameters() do
    if (p_path:find(mlp[1]) or p_path:find(mlp[2])) and not p_path:find(exclude) then
      local lm = mask.local_mask(p)
      if lm and lm.n > 0 then
        local v = lm.mask:totable()
        local lead = (4 - (lm.first - 1) % 4) % 4
        for g = lead, #v - 4, 4 do
          local kept = v[g + 1] + v[g + 2] + v[g + 3] + v[g + 4]
          groups = groups + 1
          if kept ~= 2 then bad = bad + 1 end
        end
      end
    end
  end
  say(("2:4 check: %d groups of 4 in the MLP weights, %d not keeping exactly 2")
    :format(fsdp.all_reduce(groups, "sum"), fsdp.all_reduce(bad, "sum")))
end
say(("val loss before pruning %.4f  after %.4f nats/byte (train %.4f); prunable sparsity %.4f")
  :format(val_before, val_after, train_loss, report.prunable_sparsity))
return val_after
