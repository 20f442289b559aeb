-- Pruning is the same at every world size (tests/recipes/dist_prune.sh): masks equal at 1, 2,
-- 3, 4 ranks and the loss curve of a pruned training run within 1e-5 of the unsharded one.
--
--   fsdprun -n N tests/dist/prune_equiv.lua --strategy=plain|full|grad_op|none --out=FILE
--     [--steps=100] [--final=0.7] [--sparsity=0.6]
--
-- Writes on rank 0 (compared by tests/dist/prune_compare.lua):
--   mask <phase> <path> <bits>   a mask gathered with fsdp.mask, one character per element
--   cut <n>                      groups cut by a shard boundary in the N:M phase (not compared)
--   loss <step> <%a>             the GMP run's loss curve
--   violations <n>               masked weights that are not exactly 0 at the end (must be 0)
-- Phases: A — magnitude per parameter (qkv), global (MLP), 2:4 (attention proj) on a fresh GPT;
-- C — 2:6 on an MLP whose input dimension 24 makes groups that shards cut at 3 and 4 ranks;
-- B — a GPT trained `steps` steps (SGD lr 0.03, momentum, weight decay) under a schedule: GMP with global
-- scope on the attention and MLP weights from step 5 to 60 every 5 steps (cubic, to `final`),
-- and 2:4 on blocks.2.mlp.fc.weight at step 3.
-- Wrapped runs check that pruning gathers nothing (all_gather bytes unchanged) and that
-- magnitude pruning and fsdp.sparsity take at most 7 (6 selection passes and the ranks'
-- agreement on the call) and exactly 1 all_reduce calls.
local fsdp = require "fsdp"
require "fsdp.mask"
local prune = require "fsdp.prune"
local nn = fsdp.nn
local a = fsdp.args

local strategy = a.strategy or "full"
local steps = a.steps or 100
local W, rank = fsdp.world_size(), fsdp.rank()
local B = 12 -- global batch rows (divisible by 1, 2, 3, 4)
assert(B % W == 0, "global batch must divide among the ranks")

local lines = {}
local function out(s) lines[#lines + 1] = s end

local function wrap(model, policy)
  if strategy ~= "plain" then fsdp.wrap(model, {strategy = strategy, policy = policy}) end
  return model
end

local function masks(phase, model)
  for path, p in model:named_parameters() do
    local m = fsdp.mask(p)
    if m then
      local bits = {}
      for i, x in ipairs(m:view{m:numel()}:totable()) do bits[i] = x == 0 and "0" or "1" end
      out(("mask %s %s %s"):format(phase, path, table.concat(bits)))
    end
  end
end

-- Run fn and check it gathered nothing and made at most max_ar all_reduce calls.
local function no_gather(what, max_ar, fn)
  local before = fsdp.comm_stats()
  local r = fn()
  local after = fsdp.comm_stats()
  if strategy ~= "plain" and W > 1 then
    assert(after.all_gather_bytes == before.all_gather_bytes,
      what .. ": gathered " .. (after.all_gather_bytes - before.all_gather_bytes) .. " bytes")
    local ar = after.all_reduce_calls - before.all_reduce_calls
    assert(ar <= max_ar, ("%s: %d all_reduce calls (at most %d)"):format(what, ar, max_ar))
  end
  return r
end

-- ---- phase A: one-shot magnitude (both scopes) and N:M -------------------------------------
fsdp.manual_seed(11)
local gpt_cfg = {vocab = 32, ctx = 16, d = 32, layers = 2, heads = 2}
local ma = wrap(nn.GPT(gpt_cfg), fsdp.policy.modules{nn.Block})
no_gather("magnitude param", 7, function()
  return prune.magnitude(ma, {params = "attn%.qkv%.weight", sparsity = 0.5})
end)
no_gather("magnitude global", 7, function()
  return prune.magnitude(ma, {params = "mlp%.%a+%.weight", sparsity = a.sparsity or 0.6, scope = "global"})
end)
-- (2:4 cuts no group: the one all_reduce is the agreement)
no_gather("nm", 1, function() return prune.nm(ma, {params = "attn%.proj%.weight", n = 2, m = 4}) end)
local sp = no_gather("sparsity", 1, function() return fsdp.sparsity(ma) end)
assert(sp.params["blocks.1.attn.qkv.weight"].zeros >= 0.5 * 3072, "qkv pruned")
masks("A", ma)

-- ---- phase C: N:M groups cut by shard boundaries -------------------------------------------
fsdp.manual_seed(12)
local mc = wrap(nn.Sequential{nn.Linear(24, 42), nn.ReLU(), nn.Linear(42, 24, {bias = false}),
  nn.ReLU(), nn.Linear(24, 12)})
local res = prune.nm(mc, {params = "weight", n = 2, m = 6})
out(("cut %d"):format(res.cut_groups))
masks("C", mc)

-- ---- phase B: a GMP schedule during training ----------------------------------------------
fsdp.manual_seed(13)
local mb = wrap(nn.GPT(gpt_cfg), fsdp.policy.modules{nn.Block})
local opt = fsdp.optim.SGD(mb, {lr = a.lr or 0.03, momentum = 0.9, weight_decay = 1e-3})
local sched = prune.schedule{
  {kind = "gmp", params = {"attn%.%a+%.weight", "mlp%.%a+%.weight"}, exclude = "blocks%.2%.mlp%.fc",
    start = 5, stop = 60, every = 5, init = 0.05, final = a.final or 0.7, scope = "global"},
  {kind = "nm", params = "blocks%.2%.mlp%.fc%.weight", at = 3, n = 2, m = 4},
}

-- the batch formula of tests/dist/train_equiv.lua: every world size sees the same global batch
local rows = B / W
local first = rank * rows + 1
local function batch(step)
  local x, y = {}, {}
  for i = first, first + rows - 1 do
    local xi, yi = {}, {}
    for t = 1, 16 do
      local v = (i * 7 + t * 3 + step * 5 + (i * t) % 5) % 32
      xi[t] = v
      yi[t] = (v * 3 + t) % 32
    end
    x[#x + 1], y[#y + 1] = xi, yi
  end
  return fsdp.tensor(x), fsdp.tensor(y)
end

for step = 1, steps do
  sched:step(mb, step)
  local x, y = batch(step)
  opt:zero_grad()
  local loss = nn.F.cross_entropy(mb(x), y)
  loss:backward()
  fsdp.clip_grad_norm(mb, 1.0)
  opt:step()
  out(("loss %d %a"):format(step, fsdp.all_reduce(loss:item(), "mean")))
end
masks("B", mb)
-- masked weights are exactly 0 (read from the gathered model) and the sparsity table agrees
local violations, masked = 0, 0
local mk = {}
for path, p in mb:named_parameters() do mk[path] = fsdp.mask(p) end
fsdp.full_params(mb, function(m)
  for path, p in m:named_parameters() do
    if mk[path] then
      local v, mv = p:view{p:numel()}:totable(), mk[path]:view{p:numel()}:totable()
      for i = 1, #v do
        if mv[i] == 0 then
          masked = masked + 1
          if v[i] ~= 0 then violations = violations + 1 end
        end
      end
    end
  end
end, {writeback = false})
out(("violations %d"):format(violations))
local s = fsdp.sparsity(mb)
local zeros = 0
for path in pairs(mk) do zeros = zeros + s.params[path].zeros end
assert(zeros >= masked, ("sparsity counts %d zeros in masked parameters, the masks %d"):format(zeros, masked))

if rank == 0 then
  local f = a.out and assert(io.open(a.out, "w")) or io.stdout
  f:write(table.concat(lines, "\n"), "\n")
  if f ~= io.stdout then f:close() end
end
