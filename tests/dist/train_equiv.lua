-- Equivalence run (tests/recipes/dist_equivalence.sh): train a small model for a fixed number
-- of steps on a fixed global batch and write, on rank 0, the loss of every step and the final
-- parameters (gathered with fsdp.full_params) to --out, every number in %a (exact bits).
--
--   fsdprun -n N tests/dist/train_equiv.lua --model=gpt|mlp --strategy=plain|full|grad_op|none
--     [--steps=50] [--opt=adamw|sgd] [--prefetch=true] [--lr_scale=1] [--out=path]
--     [--mp=bf16|f16] [--reduce=f32|bf16] [--micro=1] [--device=cpu|cuda] [--deterministic]
--     [--shard_size=S] (with --strategy=hybrid)
--
-- strategy=plain trains the model unwrapped (the reference, at -n 1). Every rank takes its
-- rows of the same global batch, so every world size sees the same data; the logged loss is
-- the mean over ranks of the local mean loss (= the global mean, the slices being equal).
-- --mp wraps with mixed precision ({param = mp, reduce = reduce}); --micro=K splits this rank's
-- rows into K micro-batches, each backward on its loss / K (gradient accumulation): at one rank,
-- --micro=N reproduces the per-rank batches of an N-rank run (tests/recipes/dist_mp_equiv.sh).
-- --device moves the model and the batches there (every rank thread of -n N shares the machine's
-- GPUs: rank % count; tests/cuda/dist_local.sh).
local fsdp = require "fsdp"
local nn = fsdp.nn
local a = fsdp.args
local C = dofile("tests/dist/common.lua")

local model_kind = a.model or "gpt"
local strategy = a.strategy or "full"
local steps = a.steps or 50
-- GPT trains with SGD, the MLP with AdamW by default: AdamW normalizes each gradient element
-- by its own history, and the key bias of attention has an exactly-zero gradient (softmax is
-- invariant to it), so AdamW turns its rounding noise (~1e-11) into steps of size lr, and any
-- change in the order of float sums (sharding averages gradients across ranks) then makes the
-- curves part. That is a property of the math, not of sharding (docs/fsdp.md).
local opt_kind = a.opt or (model_kind == "gpt" and "sgd" or "adamw")
local W, rank = fsdp.world_size(), fsdp.rank()
local B = 8 -- global batch rows (divisible by 1, 2, 4)
assert(B % W == 0, "global batch must divide among the ranks")

fsdp.manual_seed(1234)
local model, policy
if model_kind == "gpt" then
  model = nn.GPT{vocab = 32, ctx = 16, d = 32, layers = 3, heads = 2}
  policy = fsdp.policy.modules{nn.Block}
else
  model = nn.Sequential{nn.Linear(20, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 10)}
  policy = fsdp.policy.size(1000)
end
local device = a.device or "cpu"
if a.deterministic then fsdp.deterministic(true) end
if device ~= "cpu" then model:to(device) end
if strategy ~= "plain" then
  local mp = a.mp and {param = a.mp, reduce = a.reduce or "f32"} or nil -- mixed precision
  fsdp.wrap(model, {strategy = strategy, policy = policy, prefetch = a.prefetch ~= false, mp = mp,
    shard_size = a.shard_size}) -- shard_size: strategy=hybrid's groups
end
local opt
local lr_scale = a.lr_scale or 1 -- the shell test perturbs it to show the comparison can fail
if opt_kind == "adamw" then
  opt = fsdp.optim.AdamW(model, {lr = 3e-3 * lr_scale, weight_decay = 0.1})
else
  opt = fsdp.optim.SGD(model, {lr = 0.05 * lr_scale, momentum = 0.9, weight_decay = 1e-3})
end

-- The global batch of a step, from a formula (no RNG), and this rank's rows of it.
local rows = B / W
local first = rank * rows + 1
local function batch(step)
  if model_kind == "gpt" then
    local T = 16
    local x, y = {}, {}
    for i = first, first + rows - 1 do
      local xi, yi = {}, {}
      for t = 1, T do
        local v = (i * 7 + t * 3 + step * 5 + (i * t) % 5) % 32
        xi[t] = v
        yi[t] = (v * 3 + t) % 32
      end
      x[#x + 1], y[#y + 1] = xi, yi
    end
    -- token ids as integers (a model wrapped with mixed precision casts floating inputs)
    return fsdp.tensor(x, {dtype = "i64", device = device}),
      fsdp.tensor(y, {dtype = "i64", device = device})
  end
  local x, y = {}, {}
  for i = first, first + rows - 1 do
    local xi = {}
    for j = 1, 20 do xi[j] = math.sin(step * 0.37 + i * 1.3 + j * 0.71) end
    x[#x + 1] = xi
    y[#y + 1] = math.floor((xi[1] + xi[2] + 2) * 2.5) % 10 -- learnable from x
  end
  return fsdp.tensor(x, {device = device}), fsdp.tensor(y, {device = device})
end

local micro = a.micro or 1
assert(rows % micro == 0, "the micro-batches must divide this rank's rows")
local losses = {}
for step = 1, steps do
  local x, y = batch(step)
  opt:zero_grad()
  local sum = 0
  for k = 0, micro - 1 do
    local m = rows / micro
    local xk, yk = x, y
    if micro > 1 then xk, yk = x:narrow(1, k * m + 1, m), y:narrow(1, k * m + 1, m) end
    local loss = nn.F.cross_entropy(model(xk), yk)
    if micro > 1 then loss = loss * (1 / micro) end
    loss:backward()
    sum = sum + loss:item()
  end
  fsdp.clip_grad_norm(model, 1.0)
  opt:step()
  losses[step] = fsdp.all_reduce(sum, "mean")
end

-- final parameters, gathered (the whole model: it is small)
local lines = C.run_lines(losses, model)

C.write_lines(lines, a.out)
