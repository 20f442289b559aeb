-- The accelerate report's scenario, end to end (tests/recipes/dist_ties.sh; the report is
-- the accelerate failure): a tied GPT built on meta at N ranks, the real weights on rank 0
-- only (built eagerly there), wrap{sync_module_states = true}, then 20 training steps. The
-- loss curve and the final parameters must equal the eagerly built, unsharded 1-rank run
-- (tests/dist/compare.lua, 1e-5 relative). Along the way, on every rank: the same number of
-- tensors, fsdp.ties reports the tie, the tied parameter is one object with one storage, and
-- after training still is.
--
--   fsdprun -n 1 tests/dist/ties_train.lua --mode=ref --out=REF      (eager, unwrapped)
--   fsdprun -n N tests/dist/ties_train.lua --mode=meta --out=OUT     (meta + rank 0 + sync)
-- Each writes, on rank 0, "loss <step> <%a>" lines and "param <path> <%a ...>" lines.
local fsdp = require "fsdp"
require "fsdp.meta"
local nn = fsdp.nn
local core = fsdp.core
local a = fsdp.args
local mode = a.mode or "meta"
local steps = a.steps or 20
local W, rank = fsdp.world_size(), fsdp.rank()
local B = 8
assert(B % W == 0, "the global batch must divide among the ranks")

local C = dofile("tests/dist/common.lua")
local check = C.check
local function agreed(n) return fsdp.all_reduce(n, "min") == n and fsdp.all_reduce(n, "max") == n end

local cfg = {vocab = 32, ctx = 16, d = 32, layers = 3, heads = 2} -- tie = true (the default)
local function build() return nn.GPT(cfg) end

local model
if mode == "ref" then
  fsdp.manual_seed(1234)
  model = build()
else
  if rank == 0 then
    fsdp.manual_seed(1234)
    model = build()
  else
    fsdp.manual_seed(4321) -- whatever the other ranks would have had: rank 0's values win
    model = fsdp.meta(build)
  end
  fsdp.wrap(model, {policy = fsdp.policy.modules{nn.Block}, sync_module_states = true})
  -- every rank manages the same tensors
  local n = #model:parameters()
  local nu, units = 0, fsdp.units(model)
  for _, u in ipairs(units) do nu = nu + #u:params() end
  check(agreed(n) and agreed(nu) and n == nu, ("every rank manages the same %d tensors"):format(n))
  check(agreed(#units), "every rank has the same units")
  local ties = fsdp.ties(model)
  check(#ties == 1 and ties[1].paths[1] == "wte.weight" and ties[1].paths[2] == "head.weight",
    "fsdp.ties reports the tie on every rank")
  check(agreed(#ties), "the same ties on every rank")
end

local function tie_is_one(where)
  check(rawequal(model.head.weight, model.wte.weight), where .. ": one object")
  fsdp.full_params(model, function(m)
    check(core.same_storage(m.head.weight, m.wte.weight), where .. ": one storage")
  end, {writeback = false})
end
tie_is_one("after sync")

local opt = fsdp.optim.SGD(model, {lr = 0.05, momentum = 0.9, weight_decay = 1e-3})
local rows = B / W
local first = rank * rows + 1
local function batch(step)
  local x, y = {}, {}
  for i = first, first + rows - 1 do
    local xi, yi = {}, {}
    for t = 1, cfg.ctx do
      local v = (i * 7 + t * 3 + step * 5 + (i * t) % 5) % cfg.vocab
      xi[t] = v
      yi[t] = (v * 3 + t) % cfg.vocab
    end
    x[#x + 1], y[#y + 1] = xi, yi
  end
  return fsdp.tensor(x), fsdp.tensor(y)
end

local losses = {}
for step = 1, steps do
  local x, y = batch(step)
  opt:zero_grad()
  local loss = nn.F.cross_entropy(model(x), y)
  loss:backward()
  fsdp.clip_grad_norm(model, 1.0)
  opt:step()
  losses[step] = fsdp.all_reduce(loss:item(), "mean")
end
tie_is_one("after training")

local lines = C.run_lines(losses, model)

if C.failures() > 0 then error(("%d ties_train checks failed"):format(C.failures())) end
C.write_lines(lines, a.out)
if rank == 0 then
  print(("ties_train %s at %d ranks: %d steps, loss %.4f -> %.4f"):format(mode, W, steps,
    losses[1], losses[#losses]))
end
