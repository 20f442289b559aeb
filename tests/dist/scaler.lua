-- The dynamic loss scaler across ranks (tests/recipes/dist_scaler.sh): fsdp.optim.GradScaler
-- must take the same decision on every rank, so a wrapped model's shards stay one model.
--
--   fsdprun -n N tests/dist/scaler.lua --case=overflow --inject=grad|loss|none [--bad_rank=R]
--     [--mode=plain|full|none] [--mp=f16|f32] [--steps=6] [--at=3] [--out=path]
--   fsdprun -n N tests/dist/scaler.lua --case=train [--steps=80]
--
-- overflow: a small GPT, AdamW, a scaler (init_scale 2^10, growth_interval 2) and a global batch
--   of 4 rows per step, each rank its rows. On step `at` only rank bad_rank (default the last)
--   overflows: --inject=loss multiplies its loss by 1e30 (inf in f16's backward); --inject=grad
--   writes an inf into its own gradient (the first element of its first gradient shard, or
--   wte.weight's gradient when plain), which no other rank's shard holds. Checked on every
--   rank: the step is skipped there and only there (scaler:step returns false), on every rank;
--   with --inject=grad the ranks other than bad_rank saw finite gradients of their own, so their
--   decision came from the collective; the skipped step leaves the shards (bitwise) and the
--   optimizer's step count as they were; the scale follows init, growth and backoff and is the
--   same on every rank; with --mode=none (every rank holds the whole model) the shards are
--   bitwise equal across ranks at the end. Rank 0 writes the losses and the final parameters
--   (%a) to --out, as tests/dist/train_equiv.lua does, for tests/dist/compare.lua: the same
--   overflow at 1 rank and at N ranks must train the same model. --inject=none overflows
--   nowhere (no step skipped): it must FAIL that comparison, so the comparison can fail.
-- train: mp = "f16" with a scaler that starts too high (2^24: the first steps overflow and back
--   it off), on the repository's docs as byte-level text (the loader's i64 ids through the
--   mixed-precision input cast): the loss falls, every loss and every parameter stays finite,
--   some steps were skipped and the scale came down.
local fsdp = require "fsdp"
local nn = fsdp.nn
local a = fsdp.args
local C = dofile("tests/dist/common.lua")
local check = C.check

local W, rank = fsdp.world_size(), fsdp.rank()
local case = a.case or "overflow"

local function finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

-- Clones of every unit's shard (wrapped) or of every parameter (plain), as Lua arrays.
local function state_of(model)
  local out = {}
  if fsdp.is_wrapped(model) then
    for i, u in ipairs(fsdp.units(model)) do out[i] = C.flat(u:shard()) end
  else
    for i, p in ipairs(model:parameters()) do out[i] = C.flat(p:detach()) end
  end
  return out
end

local function same_state(x, y)
  if #x ~= #y then return false end
  for i = 1, #x do if not C.same(x[i], y[i]) then return false end end
  return true
end

-- Does this rank's own gradient (its shards, or the p.grad of a plain model) hold an inf/NaN?
local function local_overflow(model)
  if fsdp.is_wrapped(model) then
    for _, u in ipairs(fsdp.units(model)) do
      if not finite(fsdp.core.sumsq(u:grad_shard())) then return true end
    end
    return false
  end
  for _, p in ipairs(model:parameters()) do
    if p.grad ~= nil and not finite(fsdp.core.sumsq(p.grad)) then return true end
  end
  return false
end

if case == "overflow" then
  local mode = a.mode or "full"
  local mp = a.mp or "f16"
  local inject = a.inject or "grad"
  local bad = a.bad_rank or (W - 1)
  local steps, at = a.steps or 6, a.at or 3
  if inject == "none" then at = nil end
  assert(inject == "grad" or inject == "loss" or inject == "none", "--inject: grad, loss or none")
  local B, T, V = 4, 8, 64
  assert(B % W == 0, "the global batch must divide among the ranks")
  local rows = B / W
  assert(mode == "plain" or mode == "full" or mode == "none", "--mode: plain, full or none")
  assert(mode ~= "plain" or W == 1, "--mode=plain runs at 1 rank")

  fsdp.manual_seed(11)
  local model = nn.GPT { vocab = V, ctx = T, d = 16, layers = 2, heads = 2 }
  if mode ~= "plain" then
    fsdp.wrap(model, { policy = fsdp.policy.modules { nn.Block }, strategy = mode,
      mp = mp ~= "f32" and mp or nil })
  end
  local opt = fsdp.optim.AdamW(model, { lr = 1e-2 })
  local scaler = fsdp.optim.GradScaler { init_scale = 2 ^ 10, growth_interval = 2 }

  -- this rank's rows of the global batch of a step: ids and next ids, i64
  local function batch(step)
    local x, y = {}, {}
    for i = rank * rows + 1, (rank + 1) * rows do
      local xi, yi = {}, {}
      for t = 1, T do
        xi[t] = (step * 7 + i * 13 + t * 5) % V
        yi[t] = (xi[t] * 3 + 1) % V
      end
      x[#x + 1], y[#y + 1] = xi, yi
    end
    return fsdp.tensor(x, { dtype = "i64" }), fsdp.tensor(y, { dtype = "i64" })
  end

  local losses, want_scale, tracker, stepped_count = {}, 2 ^ 10, 0, 0
  for step = 1, steps do
    local x, y = batch(step)
    opt:zero_grad()
    local loss = nn.F.cross_entropy(model(x), y)
    local l = loss
    if step == at and inject == "loss" and rank == bad then l = loss * 1e30 end
    scaler:scale(l):backward()
    if step == at and inject == "grad" and rank == bad then
      if mode == "plain" then
        model.wte.weight.grad:set(1, 1, math.huge)
      else
        local done = false
        for _, u in ipairs(fsdp.units(model)) do
          local g = u:grad_shard()
          if not done and g:numel() > 0 then g:narrow(1, 1, 1):fill(math.huge); done = true end
        end
        assert(done, "this rank holds no gradient shard element")
      end
    end
    local mine = local_overflow(model)
    if step == at then
      check(mine == (rank == bad) or (inject == "loss" and rank ~= bad),
        ("step %d: rank %d's own gradients: overflow %s"):format(step, rank, tostring(mine)))
    else
      check(not mine, ("step %d: an overflow nobody injected"):format(step))
    end
    local before, count_before = state_of(model), opt.step_count
    local stepped = scaler:step(opt)
    scaler:update()
    check(stepped == (step ~= at), ("step %d: scaler:step returned %s on rank %d")
      :format(step, tostring(stepped), rank))
    -- one decision on every rank
    local n_stepped = fsdp.all_reduce(stepped and 1 or 0, "sum")
    check(n_stepped == 0 or n_stepped == W, ("step %d: %d of %d ranks stepped"):format(step, n_stepped, W))
    if stepped then
      stepped_count = stepped_count + 1
      tracker = tracker + 1
      if tracker == 2 then want_scale, tracker = want_scale * 2, 0 end
    else
      check(same_state(before, state_of(model)), ("step %d: a skipped step changed the parameters"):format(step))
      check(opt.step_count == count_before, ("step %d: a skipped step advanced the optimizer"):format(step))
      want_scale, tracker = want_scale / 2, 0
    end
    check(scaler:get_scale() == want_scale, ("step %d: scale %g, expected %g")
      :format(step, scaler:get_scale(), want_scale))
    check(fsdp.all_reduce(scaler:get_scale(), "max") == fsdp.all_reduce(scaler:get_scale(), "min"),
      ("step %d: the ranks' scales differ"):format(step))
    check(finite(loss:item()), ("step %d: loss %s"):format(step, tostring(loss:item())))
    losses[step] = fsdp.all_reduce(loss:item(), "mean")
  end
  local want_steps = at and steps - 1 or steps
  check(opt.step_count == stepped_count and stepped_count == want_steps,
    ("the optimizer stepped %d times, expected %d"):format(opt.step_count, want_steps))
  for _, s in ipairs(state_of(model)) do
    for _, v in ipairs(s) do
      if not finite(v) then check(false, "a parameter is not finite") break end
    end
  end
  if mode == "none" and W > 1 then -- every rank holds the whole model: the same bits everywhere
    for i, u in ipairs(fsdp.units(model)) do
      local mx = fsdp.all_reduce(u:shard():clone(), "max")
      local mn = fsdp.all_reduce(u:shard():clone(), "min")
      check(C.same(C.flat(mx), C.flat(mn)), ("unit %d: the ranks' replicas differ"):format(i))
    end
  end

  local lines = C.run_lines(losses, model)
  if a.out then C.write_lines(lines, a.out) end
  print(("[rank %d] overflow (%s, mode %s, mp %s, bad rank %d): step %s skipped, final scale %g")
    :format(rank, inject, mode, mp, bad, tostring(at), scaler:get_scale()))
elseif case == "train" then
  local steps = a.steps or 80
  local init = 2 ^ 24
  fsdp.manual_seed(3)
  local data = fsdp.data.text("docs", { ctx = 32, batch = 8, seed = 3 })
  local model = nn.GPT { vocab = 256, ctx = 32, d = 32, layers = 2, heads = 2 }
  fsdp.wrap(model, { policy = fsdp.policy.modules { nn.Block }, mp = "f16" })
  local opt = fsdp.optim.AdamW(model, { lr = 3e-3 })
  local scaler = fsdp.optim.GradScaler { init_scale = init, growth_interval = 20 }
  local losses, skipped = {}, 0
  for step, x, y in data:batches(steps) do
    check(x:dtype() == "i64" and y:dtype() == "i64", "the loader's ids are not i64")
    opt:zero_grad()
    local loss = nn.F.cross_entropy(model(x), y)
    scaler:scale(loss):backward()
    scaler:unscale_(opt)
    fsdp.clip_grad_norm(model, 1.0)
    if not scaler:step(opt) then skipped = skipped + 1 end
    scaler:update()
    losses[step] = fsdp.all_reduce(loss:item(), "mean")
    check(finite(losses[step]), ("step %d: loss %s"):format(step, tostring(losses[step])))
  end
  for i, s in ipairs(state_of(model)) do
    for _, v in ipairs(s) do
      if not finite(v) then check(false, ("unit %d holds a non-finite parameter"):format(i)) break end
    end
  end
  local first, last = losses[1], 0
  for i = steps - 9, steps do last = last + losses[i] / 10 end
  check(first > 5.0, ("the first loss %.4f is not near ln(256)"):format(first))
  check(last < first - 1.5, ("the loss did not fall: first %.4f, mean of the last 10 %.4f"):format(first, last))
  check(skipped >= 1 and scaler:get_scale() < init,
    ("the scale never backed off: %d skipped, scale %g"):format(skipped, scaler:get_scale()))
  check(fsdp.all_reduce(skipped, "max") == fsdp.all_reduce(skipped, "min"), "the ranks skipped different steps")
  if rank == 0 then
    print(("train: f16, %d steps at %d rank(s): loss %.4f -> %.4f (mean of the last 10), %d skipped, scale %g")
      :format(steps, W, first, last, skipped, scaler:get_scale()))
  end
else
  error("--case: overflow or train", 0)
end

if C.failures() > 0 then
  error(("%d check(s) failed on rank %d"):format(C.failures(), rank), 0)
end
