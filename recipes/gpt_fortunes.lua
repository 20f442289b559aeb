-- A small byte-level GPT with tied embeddings, trained on Debian's fortunes.
--
--   fsdprun recipes/gpt_fortunes.lua [--steps=1500] [--batch=16] [--ctx=128] [--d=128]
--        [--layers=4] [--heads=4] [--lr=0.002] [--eval_every=250] [--val_batches=20]
--        [--sample=300] [--data=/usr/share/games/fortunes] [--seed=0] [--metrics=FILE]
--
-- Prints train and validation loss (nats per byte) as it goes, and a sampled text at the end.
-- The default run reaches a validation loss below 2.0 in a few minutes on a 2-core machine.
local fsdp = require "fsdp"
local nn = fsdp.nn

local args = fsdp.args
local steps = args.steps or 1500
local batch = args.batch or 16
local ctx = args.ctx or 128
local lr = args.lr or 2e-3
local eval_every = args.eval_every or 250
local val_batches = args.val_batches or 20
local seed = args.seed or 0
local path = args.data or "/usr/share/games/fortunes"
fsdp.manual_seed(seed)

local train = fsdp.data.text(path, { ctx = ctx, batch = batch, split = "train", seed = seed })
local val = fsdp.data.text(path, { ctx = ctx, batch = batch, split = "val", seed = seed })

local model = nn.GPT { vocab = 256, ctx = ctx, d = args.d or 128, layers = args.layers or 4,
  heads = args.heads or 4, tie = true }
local nparams = 0
for _, p in ipairs(model:parameters()) do nparams = nparams + p:numel() end
print(("gpt_fortunes: %.2fM parameters (head tied to wte), %d train / %d val bytes, %d steps of %dx%d")
  :format(nparams / 1e6, train:size(), val:size(), steps, batch, ctx))

local opt = fsdp.optim.AdamW(model, { lr = lr, betas = { 0.9, 0.99 }, weight_decay = 0.1 })
local schedule = fsdp.optim.cosine(opt, { warmup = math.min(100, math.floor(steps / 10)),
  total = steps, min_lr = lr / 10 })

-- Mean validation loss over the first val_batches windows of the held-out split.
local function validate()
  model:eval()
  local sum, n = 0, 0
  fsdp.no_grad(function()
    for _, x, y in val:epoch(val_batches) do
      sum = sum + nn.F.cross_entropy(model(x), y):item()
      n = n + 1
    end
  end)
  model:train()
  return sum / n
end

fsdp.log.setup { total = steps, jsonl = args.metrics }
local train_loss, val_loss
local ema
for step, x, y in train:batches(steps) do
  schedule:step()
  local loss = nn.F.cross_entropy(model(x), y)
  opt:zero_grad()
  loss:backward()
  fsdp.clip_grad_norm(model, 1.0)
  opt:step()
  train_loss = loss:item()
  ema = ema and 0.95 * ema + 0.05 * train_loss or train_loss
  local metrics = { loss = train_loss, lr = opt.lr, tokens = batch * ctx }
  if step % eval_every == 0 or step == steps then
    val_loss = validate()
    metrics.val_loss = val_loss
  end
  fsdp.log(step, metrics)
end
fsdp.log.finish()

print(("train loss %.4f (smoothed %.4f)  val loss %.4f nats/byte"):format(train_loss, ema, val_loss))
local text = model:generate(train:encode("Q: "), args.sample or 300, { temperature = 0.8 })
print("sample:\n" .. train:decode(text))
return val_loss
