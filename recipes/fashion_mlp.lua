-- An MLP on Fashion-MNIST (Debian's dataset-fashion-mnist).
--
--   fsdprun recipes/fashion_mlp.lua [--epochs=12] [--name=value ...]
--   (`--help` lists the arguments, declared below with their defaults)
--
-- Prints the final test accuracy. The full run (12 epochs) reaches >= 0.885 on the test set
-- (the dataset's own benchmark table lists an MLP 256-128-100 at 0.8833); --limit and
-- --test_limit shrink the data for smoke tests.
local fsdp = require "fsdp"
local nn = fsdp.nn

local args = fsdp.args {
  description = "An MLP on Fashion-MNIST; prints the final test accuracy.",
  { "epochs", 12, "integer", "passes over the training set", min = 1 },
  { "steps", nil, "integer", "optimizer steps (default: --epochs passes)", min = 1 },
  { "batch", 128, "integer", "images per step", min = 1 },
  { "lr", 1e-3, "number", "peak learning rate (cosine schedule)", min = 0 },
  { "hidden", 512, "integer", "width of the first hidden layer (the second is half)", min = 2 },
  { "limit", nil, "integer", "use only the first N training images", min = 1 },
  { "test_limit", nil, "integer", "use only the first N test images", min = 1 },
  { "seed", 0, "integer", "random seed (parameters, shuffling, dropout)" },
}
local epochs, batch, hidden = args.epochs, args.batch, args.hidden
local function say(...) if fsdp.rank() == 0 then print(...) end end
fsdp.manual_seed(args.seed)

local train = fsdp.data.fashion_mnist { split = "train", batch = batch, seed = args.seed,
  limit = args.limit }
local test = fsdp.data.fashion_mnist { split = "test", batch = 1000, shuffle = false,
  limit = args.test_limit }

local model = nn.Sequential {
  nn.Linear(784, hidden), nn.ReLU(), nn.Dropout(0.2),
  nn.Linear(hidden, hidden / 2), nn.ReLU(), nn.Dropout(0.2),
  nn.Linear(hidden / 2, 10),
}

-- at N ranks one model, sharded (each rank trains on its slice of every batch); unwrapped,
-- each rank would train its own copy and the optimizer refuses that
if fsdp.world_size() > 1 then fsdp.wrap(model) end

if train:size() < batch then
  error(("fashion_mlp: --limit=%d leaves fewer training images than one batch (--batch=%d)")
    :format(train:size(), batch), 0)
end
local steps = args.steps or epochs * math.floor(train:size() / batch)
local opt = fsdp.optim.AdamW(model, { lr = args.lr, weight_decay = 0.05 })
local schedule = fsdp.optim.cosine(opt, { warmup = math.floor(steps / 50), total = steps,
  min_lr = args.lr / 50 })

say(("fashion_mlp: %d parameters, %d steps of batch %d (%d epochs)"):format(
  (function() local n = 0 for _, p in ipairs(model:parameters()) do n = n + p:numel() end return n end)(),
  steps, batch, math.ceil(steps * batch / train:size())))

fsdp.log.setup { total = steps }
for step, x, y in train:batches(steps) do
  schedule:step()
  local loss = nn.F.cross_entropy(model(x), y)
  opt:zero_grad()
  loss:backward()
  opt:step()
  fsdp.log(step, { loss = loss:item(), lr = opt.lr })
end
fsdp.log.finish()

-- Test accuracy: argmax of the logits against the labels, over the whole test split. Every
-- rank evaluates every batch (the forward passes of a wrapped model are collective).
model:eval()
local correct, total = 0, 0
fsdp.no_grad(function()
  for _, x, y in test:epoch() do
    local pred = model(x):argmax():totable()
    local labels = y:totable()
    for i = 1, #labels do
      if pred[i] == labels[i] then correct = correct + 1 end
    end
    total = total + #labels
  end
end)
local acc = correct / total
-- one model: every rank must have counted the same (printed once, by rank 0)
if fsdp.world_size() > 1 and fsdp.all_reduce(acc, "min") ~= fsdp.all_reduce(acc, "max") then
  error(("fashion_mlp: the ranks' test accuracies differ (this rank: %.6f)"):format(acc), 0)
end
say(("test accuracy %.4f (%d/%d)"):format(acc, correct, total))
return acc
