-- Traffic proof (tests/recipes/dist_comm.sh): fsdp.comm_stats() counts exactly what the
-- schedule of each strategy costs, per training step, from the units' padded sizes.
--
-- Per step (forward + backward + optimizer step), P_u = u:padded_numel() * 4 bytes:
--   full     all_gather: 2 P_u for every unit but the root (gathered for forward, resharded,
--            gathered again for backward), 1 P_root (the root stays gathered from its forward
--            to the end of backward); reduce_scatter: P_u for every unit
--   full, reshard_after_forward = false, and grad_op: all_gather P_u, reduce_scatter P_u
--   none     all_reduce P_u for every unit (gradients averaged); no all_gather/reduce_scatter
--   a forward under no_grad (eval): all_gather P_u (not none), nothing else
--   clip_grad_norm: one all_reduce of one number
--   the optimizer step: one all_reduce of one float per parameter of every unit (which
--            parameters received a gradient on some rank: docs/fsdp.md "Optimizers on shards")
-- Compared to the design's "two all-gathers and one reduce-scatter of the padded parameters",
-- the root's second all-gather is saved. Asserted exactly (bytes and call counts), on every
-- rank; one model is wrapped, measured, unwrapped and wrapped again for each configuration.
local fsdp = require "fsdp"
local nn = fsdp.nn
local W, rank = fsdp.world_size(), fsdp.rank()
local steps = 3

fsdp.manual_seed(5)
local model = nn.GPT{vocab = 32, ctx = 16, d = 32, layers = 4, heads = 2}
local opt_cfg = {lr = 1e-3}

local x, y = {}, {}
for i = 1, 2 do
  x[i], y[i] = {}, {}
  for t = 1, 16 do
    x[i][t] = (rank * 11 + i * 5 + t * 3) % 32
    y[i][t] = (x[i][t] + 1) % 32
  end
end
x, y = fsdp.tensor(x), fsdp.tensor(y)

local failures = 0
local function check(label, got, want)
  if got ~= want then
    failures = failures + 1
    print(("[rank %d] FAIL: %s: got %d, expected %d"):format(rank, label, got, want))
  end
end

local function train_step(opt)
  opt:zero_grad()
  local loss = nn.F.cross_entropy(model(x), y)
  loss:backward()
  opt:step()
end

local function measure(cfg)
  fsdp.wrap(model, {strategy = cfg.strategy, policy = fsdp.policy.modules{nn.Block},
    reshard_after_forward = cfg.raf, prefetch = cfg.prefetch})
  local opt = fsdp.optim.SGD(model, opt_cfg)
  train_step(opt) -- records the forward order (prefetch starts from the second step)
  fsdp.reset_comm_stats()
  for _ = 1, steps do train_step(opt) end
  local s = fsdp.comm_stats()
  -- all_reduce starts with the optimizer's has_grad flags: one call, 4 bytes per parameter
  local want = {ag = 0, ag_calls = 0, rs = 0, rs_calls = 0, ar = 0, ar_calls = 1}
  local total_padded = 0
  for _, u in ipairs(fsdp.units(model)) do
    want.ar = want.ar + #u:paths() * 4
    local P = u:padded_numel() * 4
    total_padded = total_padded + P
    if cfg.strategy == "none" then
      want.ar, want.ar_calls = want.ar + P, want.ar_calls + 1
    else
      local k = (cfg.strategy == "full" and cfg.raf ~= false and not u.is_root) and 2 or 1
      want.ag, want.ag_calls = want.ag + k * P, want.ag_calls + k
      want.rs, want.rs_calls = want.rs + P, want.rs_calls + 1
    end
  end
  local name = cfg.label
  check(name .. " all_gather bytes/step", s.all_gather_bytes / steps, want.ag)
  check(name .. " all_gather calls/step", s.all_gather_calls / steps, want.ag_calls)
  check(name .. " reduce_scatter bytes/step", s.reduce_scatter_bytes / steps, want.rs)
  check(name .. " reduce_scatter calls/step", s.reduce_scatter_calls / steps, want.rs_calls)
  check(name .. " all_reduce bytes/step", s.all_reduce_bytes / steps, want.ar)
  check(name .. " all_reduce calls/step", s.all_reduce_calls / steps, want.ar_calls)
  check(name .. " broadcast calls", s.broadcast_calls, 0)

  -- an evaluation forward: one all_gather per unit (none: nothing), no reduction
  fsdp.reset_comm_stats()
  fsdp.no_grad(function() return model(x) end)
  local e = fsdp.comm_stats()
  check(name .. " eval all_gather bytes", e.all_gather_bytes, cfg.strategy == "none" and 0 or total_padded)
  check(name .. " eval reduce_scatter calls", e.reduce_scatter_calls, 0)
  check(name .. " eval all_reduce calls", e.all_reduce_calls, 0)
  for _, u in ipairs(fsdp.units(model)) do
    if cfg.strategy ~= "none" and u:state() ~= "sharded" then
      failures = failures + 1
      print(("[rank %d] FAIL: %s: unit %s still gathered after an eval forward"):format(rank, name, u.path))
    end
  end

  -- clip_grad_norm: exactly one all_reduce
  fsdp.reset_comm_stats()
  fsdp.clip_grad_norm(model, 1.0)
  local c = fsdp.comm_stats()
  check(name .. " clip_grad_norm all_reduce calls", c.all_reduce_calls, 1)
  check(name .. " clip_grad_norm other calls", c.calls, 1)

  if rank == 0 then
    print(("%-28s per step: all_gather %8d B (%2d calls)  reduce_scatter %7d B (%2d)  "
      .. "all_reduce %7d B (%2d); padded parameters %d B; 2 x padded = %d B")
      :format(name, s.all_gather_bytes / steps, s.all_gather_calls / steps,
        s.reduce_scatter_bytes / steps, s.reduce_scatter_calls / steps,
        s.all_reduce_bytes / steps, s.all_reduce_calls / steps, total_padded, 2 * total_padded))
  end
  fsdp.unwrap(model)
end

for _, cfg in ipairs{
  {label = "full", strategy = "full"},
  {label = "full, no prefetch", strategy = "full", prefetch = false},
  {label = "full, reshard_after_forward=false", strategy = "full", raf = false},
  {label = "grad_op", strategy = "grad_op"},
  {label = "none", strategy = "none"},
} do
  measure(cfg)
end
if rank == 0 then print(("world size %d"):format(W)) end
if failures > 0 then error(("%d comm_stats checks failed"):format(failures)) end
