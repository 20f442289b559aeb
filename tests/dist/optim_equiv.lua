-- Optimizers on shards equal the same optimizer on one unwrapped rank
-- (tests/recipes/dist_optim.sh): an MLP trained on a fixed global batch, written as
-- tests/dist/train_equiv.lua writes its runs (for tests/dist/compare.lua).
--
--   fsdprun -n N tests/dist/optim_equiv.lua --opt=KIND --strategy=plain|full|grad_op|none|hybrid
--     [--shard_size=S] [--steps=30] [--out=path] [--lr_scale=1] [--save_at=K --dir=D] [--resume=D]
--     [--explicit]
--
-- KIND: sgd_nesterov, adam, lion, adafactor, groups (AdamW, parameter groups chosen by
-- pattern: the middle layer at a tenth of the lr, biases without decay), params (AdamW over
-- the last two layers only, chosen with params =), module (Lion over one module of the
-- model; the rest stays), sgd_local (plain SGD with local_only = true: at N ranks each rank
-- trains its own copy, here on the same rows, so every copy equals the 1-rank run),
-- adamw_clip / adam_clip / sgd_clip (max_grad_norm = 0.05, which clips every step here: AdamW
-- takes the coefficient in its kernel, Adam with its L2 term and SGD scale the gradients; with
-- --explicit the run calls fsdp.clip_grad_norm(model, 0.05) before a step without it instead:
-- the same bits).
-- --save_at=K saves a sharded checkpoint with the optimizer after step K and stops;
-- --resume=D loads it (at any world size) and trains the remaining steps: the run then equals
-- an uninterrupted one. --strategy=hybrid shards in groups of --shard_size ranks (default
-- half the world, at least 1). The policy cuts the weights into several units whose shards split
-- rows and columns (Adafactor's factors).
local fsdp = require "fsdp"
local nn = fsdp.nn
local a = fsdp.args
local C = dofile("tests/dist/common.lua")

local kind = assert(a.opt, "--opt=KIND")
local strategy = a.strategy or "full"
local steps = a.steps or 30
local W, rank = fsdp.world_size(), fsdp.rank()
local B = 8
assert(B % W == 0, "global batch must divide among the ranks")

fsdp.manual_seed(99)
local model = nn.Sequential{nn.Linear(20, 36), nn.ReLU(), nn.Linear(36, 30), nn.ReLU(),
  nn.Linear(30, 10)}
if strategy ~= "plain" then
  local S = strategy == "hybrid" and (a.shard_size or math.max(1, math.floor(fsdp.world_size() / 2))) or nil
  fsdp.wrap(model, {strategy = strategy, shard_size = S, policy = fsdp.policy.size(600)})
end
local s = a.lr_scale or 1
local opt
if kind == "sgd_nesterov" then
  opt = fsdp.optim.SGD(model, {lr = 0.05 * s, momentum = 0.9, nesterov = true, weight_decay = 1e-3})
elseif kind == "adam" then
  opt = fsdp.optim.Adam(model, {lr = 3e-3 * s, weight_decay = 0.01})
elseif kind == "lion" then
  opt = fsdp.optim.Lion(model, {lr = 1e-3 * s, weight_decay = 0.1})
elseif kind == "adafactor" then
  opt = fsdp.optim.Adafactor(model, {lr = 2e-2 * s, weight_decay = 0.01})
elseif kind == "groups" then
  opt = fsdp.optim.AdamW(model, {lr = 3e-3 * s, weight_decay = 0.1,
    groups = {{params = "%.bias$", weight_decay = 0}, {params = "^3%.", lr = 3e-4 * s}}})
elseif kind == "params" then
  opt = fsdp.optim.AdamW(model, {lr = 3e-3 * s, params = {"^3%.", "^5%."}})
elseif kind == "module" then
  opt = fsdp.optim.Lion(model[3], {lr = 1e-3 * s, weight_decay = 0.1})
elseif kind:match("_clip$") then
  local clip = not a.explicit and 0.05 or nil
  if kind == "adamw_clip" then
    opt = fsdp.optim.AdamW(model, {lr = 3e-3 * s, weight_decay = 0.1, max_grad_norm = clip})
  elseif kind == "adam_clip" then
    opt = fsdp.optim.Adam(model, {lr = 3e-3 * s, weight_decay = 0.01, max_grad_norm = clip})
  else
    opt = fsdp.optim.SGD(model, {lr = 0.05 * s, momentum = 0.9, max_grad_norm = clip})
  end
elseif kind == "sgd_local" then
  opt = fsdp.optim.SGD(model, {lr = 0.05 * s, momentum = 0.9, local_only = true})
else
  error("unknown --opt " .. kind)
end

-- the global batch of a step, from a formula; this rank's rows (sgd_local: all rows)
local rows = kind == "sgd_local" and B or B / W
local first = kind == "sgd_local" and 1 or rank * rows + 1
local function batch(step)
  local x, y = {}, {}
  for i = first, first + rows - 1 do
    local xi = {}
    for j = 1, 20 do xi[j] = math.sin(step * 0.37 + i * 1.3 + j * 0.71) end
    x[#x + 1] = xi
    y[#y + 1] = math.floor((xi[1] + xi[2] + 2) * 2.5) % 10
  end
  return fsdp.tensor(x), fsdp.tensor(y)
end

local losses, from = {}, 1
if a.resume then
  local extra = fsdp.load(model, a.resume, {optimizer = opt})
  losses, from = extra.losses, extra.step + 1
end
for step = from, steps do
  local x, y = batch(step)
  opt:zero_grad()
  local loss = nn.F.cross_entropy(model(x), y)
  loss:backward()
  if kind:match("_clip$") then
    local total
    if a.explicit then
      total = fsdp.clip_grad_norm(model, 0.05)
      opt:step()
    else
      opt:step()
      total = opt.grad_norm
    end
    -- the norm before clipping, on every rank: above max_grad_norm (the test clips every step)
    assert(total > 0.05, ("step %d: gradient norm %s does not exceed 0.05"):format(step, total))
    assert(fsdp.all_reduce(total, "max") == total, "ranks disagree on the gradient norm")
  else
    opt:step()
  end
  losses[step] = kind == "sgd_local" and loss:item() or fsdp.all_reduce(loss:item(), "mean")
  if a.save_at == step then
    fsdp.save(model, a.dir, {optimizer = opt, extra = {losses = losses, step = step}})
    return
  end
end
local lines = C.run_lines(losses, model)
C.write_lines(lines, a.out)
