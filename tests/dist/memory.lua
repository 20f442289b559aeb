-- Memory proof (tests/recipes/dist_memory.sh): fsdp.memory() on every rank, for a GPT wrapped
-- with one unit per Block, strategy "full", AdamW, compared with what sharding promises
-- (docs/ARCHITECTURE.md, "The three invariants": the numbers held), each figure within 5%:
--   between steps  params = grads = total/N, optim = 2 total/N      (x 4 bytes, + padding)
--                  so params + grads + optim = 16 total/N bytes, against 16 total unsharded
--   during a step  gathered peaks at the root plus the largest unit (prefetch = false), or the
--                  root plus the two largest (prefetch: the next unit's all-gather is in flight
--                  while the current one computes); the root stays gathered from its forward
--                  to the end of its backward, being the first and last unit used
--                  grads peaks at the shards + the root's and one unit's full gradient
--                  (prefetch = false, or one rank), or two units' (prefetch, N > 1: a unit's
--                  reduce-scatter is in flight while the next unit's gradient accumulates)
-- The peak of params + grads + optim + gathered is thus total/N plus the largest gathered
-- units, not total. Before wrapping, params = 4 total (dense); after, the dense storage is gone
-- and no gradient shard exists yet, exactly (no collection needed: tests/dist/memory_live.lua
-- checks the live figures after each step).
--   fsdprun -n N tests/dist/memory.lua [--prefetch=false] [--device=cuda]
-- --device: the model and batches on that device (every rank thread sharing the machine's GPUs;
-- tests/cuda/dist_memory.sh), the peaks read from that device's column of fsdp.memory().
local fsdp = require "fsdp"
local nn = fsdp.nn
local W, rank = fsdp.world_size(), fsdp.rank()
local prefetch = fsdp.args.prefetch ~= false
local device = fsdp.args.device or "cpu"

fsdp.manual_seed(5)
local model = nn.GPT{vocab = 64, ctx = 16, d = 64, layers = 4, heads = 2}
if device ~= "cpu" then model:to(device) end
local total = model:num_parameters()
local before = fsdp.memory()

local x, y = {}, {}
for i = 1, 2 do
  x[i], y[i] = {}, {}
  for t = 1, 16 do
    x[i][t] = (rank * 11 + i * 5 + t * 3) % 64
    y[i][t] = (x[i][t] + 1) % 64
  end
end
x, y = fsdp.tensor(x, {device = device}), fsdp.tensor(y, {device = device})

fsdp.wrap(model, {policy = fsdp.policy.modules{nn.Block}, prefetch = prefetch})
local wrapped = fsdp.memory()
local opt = fsdp.optim.AdamW(model, {lr = 1e-3})
local function step()
  opt:zero_grad()
  local loss = nn.F.cross_entropy(model(x), y)
  loss:backward()
  opt:step()
end
step() -- optimizer state appears; the forward order is recorded
fsdp.core.reset_peak()
step()
local m = fsdp.memory()
local cpu = m.devices[device]

-- the theory, from the units
local S, Pmax, Pmax2, Proot = 0, 0, 0, 0
for _, u in ipairs(fsdp.units(model)) do
  S = S + u:shard_numel() * 4
  local P = u:padded_numel() * 4
  if u.is_root then
    Proot = P
  elseif P > Pmax then
    Pmax2, Pmax = Pmax, P
  elseif P > Pmax2 then
    Pmax2 = P
  end
end
local per_rank = total * 4 / W
local want_gathered = Proot + Pmax + (prefetch and Pmax2 or 0)
-- grad shards + the root's full gradient + the largest inner unit's full gradient (the
-- reduce-scatter runs in place in the full gradient buffer: no temporary), + the next largest
-- while a reduce-scatter overlaps the next unit's backward
local overlap = prefetch and W > 1
local want_grads_peak = S + Proot + Pmax + (overlap and Pmax2 or 0)

local failures = 0
local function near(label, got, want)
  local ok = math.abs(got - want) <= 0.05 * want
  if not ok then
    failures = failures + 1
    print(("[rank %d] FAIL: %s: %d bytes, expected %d (within 5%%)"):format(rank, label, got, want))
  end
  return got
end
local function exact(label, got, want)
  if got ~= want then
    failures = failures + 1
    print(("[rank %d] FAIL: %s: %d bytes, expected %d exactly"):format(rank, label, got, want))
  end
end
local b, w = before.devices[device], wrapped.devices[device]
exact("dense params before wrapping", b.params, total * 4)
exact("params after wrapping (dense storage freed)", w.params, S)
exact("grads after wrapping (none before a backward)", w.grads, 0)
near("params after wrapping", wrapped.params, per_rank)
near("params between steps", m.params, per_rank)
near("grads between steps", m.grads, per_rank)
near("optim between steps", m.optim, 2 * per_rank)
near("params + grads + optim between steps", m.params + m.grads + m.optim, 4 * per_rank)
if m.gathered ~= 0 then
  failures = failures + 1
  print(("[rank %d] FAIL: %d bytes still gathered between steps"):format(rank, m.gathered))
end
near("peak gathered", cpu.peak_gathered, want_gathered)
near("peak grads", cpu.peak_grads, want_grads_peak)
near("peak params", cpu.peak_params, per_rank)
local peak_sum = cpu.peak_params + cpu.peak_grads + cpu.peak_optim + cpu.peak_gathered

if rank == 0 then
  print(("world %d, prefetch %s: %d parameters (%d bytes dense); per rank: shards params %d, "
    .. "grads %d, optim %d = %d B (16 total/N = %d B); peak gathered %d B (root %d + unit %d%s); "
    .. "peak grads %d B%s; peak params+grads+optim+gathered <= %d B = %.3f of unsharded %d B")
    :format(W, tostring(prefetch), total, total * 4, m.params, m.grads, m.optim,
      m.params + m.grads + m.optim, 4 * per_rank, cpu.peak_gathered, Proot, Pmax,
      prefetch and (" + next " .. Pmax2) or "", cpu.peak_grads,
      overlap and (" (one unit's more in flight: " .. Pmax2 .. ")") or "", peak_sum,
      peak_sum / (16 * total), 16 * total))
end
if failures > 0 then error(("%d memory checks failed"):format(failures)) end
