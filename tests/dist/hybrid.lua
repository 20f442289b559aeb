-- Hybrid sharding (HSDP) at 4 ranks as 2 groups of 2 (tests/recipes/dist_hybrid.sh):
--   bytes   fsdp.comm_stats() per training step, per group, equals the schedule:
--           shard group: all_gather 2 P_u per unit (1 for the root), reduce_scatter P_u;
--           replicate group: all_reduce P_u / shard_size per unit (this rank's shard);
--           the world: only the optimizer's has_grad flags (4 bytes per parameter) and
--           clip_grad_norm's one number, no all_gather or reduce_scatter
--   refuse  shard_size that does not divide the world, hybrid without shard_size, shard_size
--           with another strategy: the same clear error on every rank, nothing wrapped
--   ckpt    checkpoints cross strategies: a hybrid run saved (sharded with its optimizer, and
--           one safetensors file) loads into a full-shard model, which takes the next step as
--           the hybrid run does; saved again from full shard it loads back into hybrid; the
--           values are exactly those saved
-- Every check runs on every rank; any failure raises at the end.
--   fsdprun -n 4 tests/dist/hybrid.lua --dir=TMPDIR [--shard_size=2]
local fsdp = require "fsdp"
local nn = fsdp.nn
local a = fsdp.args
local W, rank = fsdp.world_size(), fsdp.rank()
local S = a.shard_size or 2
local dir = assert(a.dir, "--dir=a temporary folder")

local failures = 0
local function check(ok, what)
  if not ok then
    failures = failures + 1
    print(("[rank %d] FAIL: %s"):format(rank, what))
  end
end
local function check_eq(got, want, what)
  check(got == want, ("%s: got %s, expected %s"):format(what, tostring(got), tostring(want)))
end

local function new_model()
  fsdp.manual_seed(7)
  return nn.GPT{vocab = 32, ctx = 16, d = 32, layers = 3, heads = 2}
end
local policy = fsdp.policy.modules{nn.Block}

-- this rank's rows of a fixed global batch of 8 (every world size sees the same data)
local function batch(step)
  local rows, x, y = 8 / W, {}, {}
  for i = rank * rows + 1, rank * rows + rows do
    local xi, yi = {}, {}
    for t = 1, 16 do
      xi[t] = (i * 7 + t * 3 + step * 5 + (i * t) % 5) % 32
      yi[t] = (xi[t] * 3 + t) % 32
    end
    x[#x + 1], y[#y + 1] = xi, yi
  end
  return fsdp.tensor(x, {dtype = "i64"}), fsdp.tensor(y, {dtype = "i64"})
end

local function train_step(model, opt, step)
  local x, y = batch(step)
  opt:zero_grad()
  local loss = nn.F.cross_entropy(model(x), y)
  loss:backward()
  fsdp.clip_grad_norm(model, 1.0)
  opt:step()
  return fsdp.all_reduce(loss:item(), "mean")
end

-- every parameter's full values, by path (collective)
local function values(model)
  return fsdp.full_params(model, function(m)
    local out = {}
    for path, p in m:named_parameters() do out[path] = p:clone():view{p:numel()}:totable() end
    return out
  end, {writeback = false})
end

local function max_diff(A, B)
  local d = 0
  for path, va in pairs(A) do
    local vb = B[path]
    if vb == nil then return math.huge end
    for i = 1, #va do d = math.max(d, math.abs(va[i] - vb[i])) end
  end
  return d
end

-- ---- bytes per group ------------------------------------------------------------------------
do
  local model = new_model()
  fsdp.wrap(model, {strategy = "hybrid", shard_size = S, policy = policy})
  local opt = fsdp.optim.SGD(model, {lr = 0.05, momentum = 0.9})
  train_step(model, opt, 1) -- records the forward order
  fsdp.reset_comm_stats()
  local steps = 2
  for k = 1, steps do train_step(model, opt, k + 1) end
  local s = fsdp.comm_stats()
  check(s.shard ~= nil and s.replicate ~= nil, "comm_stats has shard and replicate groups")
  check_eq(s.shard_size, S, "comm_stats shard_size")
  local want = {ag = 0, ag_calls = 0, rs = 0, rs_calls = 0, rar = 0, rar_calls = 0, war = 0}
  local total = 0
  for _, u in ipairs(fsdp.units(model)) do
    local g = u:groups()
    check(u:strategy() == "hybrid" and g.shard_size == S and g.replicas == W / S
      and g.shard_rank == rank % S and g.replica == math.floor(rank / S),
      ("unit %s: hybrid, shard rank %d of %d, replica %d of %d"):format(u.path, g.shard_rank,
        g.shard_size, g.replica, g.replicas))
    local P = u:padded_numel() * 4
    total = total + P
    local k = u.is_root and 1 or 2
    want.ag, want.ag_calls = want.ag + k * P, want.ag_calls + k
    want.rs, want.rs_calls = want.rs + P, want.rs_calls + 1
    want.rar, want.rar_calls = want.rar + P / S, want.rar_calls + 1
    want.war = want.war + #u:paths() * 4 -- the optimizer's has_grad flags
    check_eq(u:shard_numel() * 4, P / S, "unit " .. u.path .. " shard bytes")
  end
  -- fsdp.inspect places this rank's shard by its rank within the group, and lists the
  -- parameter's slices per group rank
  local report = fsdp.inspect(model)
  for _, row in ipairs(report.units) do
    local first = (rank % S) * row.shard_numel + 1
    check(row.slice[1] == first and row.slice[2] == first + row.shard_numel - 1,
      ("inspect: unit %s slice %d-%d, expected from %d"):format(row.path, row.slice[1], row.slice[2], first))
  end
  local text = tostring(fsdp.inspect(model.wte.weight))
  check(text:find(("by rank within each of the %d groups of %d ranks"):format(W / S, S), 1, true)
    and not text:find(("%d: -"):format(S), 1, true), "inspect(param) lists group ranks:\n" .. text)
  local sh, rep = s.shard or {}, s.replicate or {}
  check_eq(sh.all_gather_bytes / steps, want.ag, "shard group all_gather bytes/step")
  check_eq(sh.all_gather_calls / steps, want.ag_calls, "shard group all_gather calls/step")
  check_eq(sh.reduce_scatter_bytes / steps, want.rs, "shard group reduce_scatter bytes/step")
  check_eq(sh.reduce_scatter_calls / steps, want.rs_calls, "shard group reduce_scatter calls/step")
  check_eq(sh.all_reduce_calls, 0, "shard group all_reduce calls")
  check_eq(rep.all_reduce_bytes / steps, want.rar, "replicate group all_reduce bytes/step")
  check_eq(rep.all_reduce_calls / steps, want.rar_calls, "replicate group all_reduce calls/step")
  check_eq(rep.all_gather_calls + rep.reduce_scatter_calls, 0, "replicate group gathers")
  -- the world: clip_grad_norm's number (8 bytes) and the flags, the loss's mean (8 bytes)
  check_eq(s.all_reduce_bytes / steps, want.war + 8 + 8, "world all_reduce bytes/step")
  check_eq(s.all_reduce_calls / steps, 3, "world all_reduce calls/step")
  check_eq(s.all_gather_calls + s.reduce_scatter_calls, 0, "world all_gather/reduce_scatter calls")
  if rank == 0 then
    print(("hybrid %dx%d per step: shard group all_gather %d B reduce_scatter %d B; replicate "
      .. "group all_reduce %d B; padded parameters %d B"):format(W / S, S, want.ag, want.rs,
        want.rar, total))
  end
  fsdp.unwrap(model)
end

-- ---- refusals ---------------------------------------------------------------------------------
do
  local model = new_model()
  local function refused(opts, want, what)
    local ok, err = pcall(fsdp.wrap, model, opts)
    check(not ok and tostring(err):find(want, 1, true) ~= nil,
      ("%s: refused with '%s' (got %s)"):format(what, want, tostring(err)))
    check(not fsdp.is_wrapped(model), what .. ": nothing wrapped")
  end
  if W % 3 ~= 0 then
    refused({strategy = "hybrid", shard_size = 3, policy = policy},
      ("fsdp.wrap: shard_size 3 does not divide the world of %d ranks"):format(W),
      "shard_size 3")
  end
  refused({strategy = "hybrid", policy = policy}, 'fsdp.wrap: strategy "hybrid" needs shard_size',
    "hybrid without shard_size")
  refused({strategy = "full", shard_size = S}, 'fsdp.wrap: shard_size is for strategy "hybrid"',
    "shard_size with full")
  -- the C layer refuses too (what the Lua check stands in front of)
  local ok, err = pcall(fsdp.core.unit_new, "x", {}, {}, {strategy = "hybrid", shard_size = W + 1})
  check(not ok and tostring(err):find(("hybrid sharding: shard_size %d does not divide the world of %d ranks")
    :format(W + 1, W), 1, true) ~= nil, "unit_new shard_size > world: " .. tostring(err))
  -- a good wrap still works after the refusals (nothing was left half made)
  fsdp.wrap(model, {strategy = "hybrid", shard_size = S, policy = policy})
  check(fsdp.is_wrapped(model), "hybrid wrap after refusals")
  fsdp.unwrap(model)
end

-- ---- checkpoints across strategies --------------------------------------------------------------
do
  local hyb = new_model()
  fsdp.wrap(hyb, {strategy = "hybrid", shard_size = S, policy = policy})
  local hopt = fsdp.optim.AdamW(hyb, {lr = 1e-3, weight_decay = 0.1})
  for step = 1, 3 do train_step(hyb, hopt, step) end
  fsdp.save(hyb, dir .. "/hyb", {format = "sharded", optimizer = hopt})
  fsdp.save(hyb, dir .. "/hyb.safetensors")
  local saved = values(hyb)
  local loss4 = train_step(hyb, hopt, 4)
  local after4 = values(hyb)

  -- into full shard: exactly the saved values; the next step as the hybrid run's
  local full = new_model()
  fsdp.wrap(full, {strategy = "full", policy = policy})
  local fopt = fsdp.optim.AdamW(full, {lr = 1e-3, weight_decay = 0.1})
  fsdp.load(full, dir .. "/hyb", {optimizer = fopt})
  check_eq(max_diff(values(full), saved), 0, "hybrid sharded checkpoint loaded by full shard: max diff")
  local floss4 = train_step(full, fopt, 4)
  check(math.abs(floss4 - loss4) <= 1e-6 * math.abs(loss4),
    ("full shard's step after loading the hybrid checkpoint: loss %.9g, hybrid's %.9g"):format(floss4, loss4))
  local d4 = max_diff(values(full), after4)
  check(d4 <= 1e-5, ("parameters after that step: max diff %g (<= 1e-5)"):format(d4))
  -- the safetensors file too
  local full2 = new_model()
  fsdp.wrap(full2, {strategy = "full", policy = policy})
  fsdp.load(full2, dir .. "/hyb.safetensors")
  check_eq(max_diff(values(full2), saved), 0, "hybrid safetensors loaded by full shard: max diff")

  -- and back: full shard saved, hybrid loads
  local fvals = values(full)
  fsdp.save(full, dir .. "/full", {format = "sharded", optimizer = fopt})
  fsdp.save(full, dir .. "/full.safetensors")
  local back = new_model()
  fsdp.wrap(back, {strategy = "hybrid", shard_size = S, policy = policy})
  local bopt = fsdp.optim.AdamW(back, {lr = 1e-3, weight_decay = 0.1})
  fsdp.load(back, dir .. "/full", {optimizer = bopt})
  check_eq(max_diff(values(back), fvals), 0, "full-shard sharded checkpoint loaded by hybrid: max diff")
  local l5, lf5 = train_step(back, bopt, 5), train_step(full, fopt, 5)
  check(math.abs(l5 - lf5) <= 1e-6 * math.abs(lf5),
    ("hybrid's step after loading the full-shard checkpoint: loss %.9g, full's %.9g"):format(l5, lf5))
  local back2 = new_model()
  fsdp.wrap(back2, {strategy = "hybrid", shard_size = S, policy = policy})
  fsdp.load(back2, dir .. "/full.safetensors")
  check_eq(max_diff(values(back2), fvals), 0, "full-shard safetensors loaded by hybrid: max diff")
  -- the check can fail: a different model's values are caught
  check(max_diff(values(back2), saved) > 0, "the comparison sees a difference (after a step)")
  if rank == 0 then print("checkpoints: hybrid -> full shard -> hybrid, sharded and safetensors") end
end

if failures > 0 then error(("%d hybrid checks failed on rank %d"):format(failures, rank)) end
if rank == 0 then print(("hybrid: ok at %d ranks, shard_size %d"):format(W, S)) end
