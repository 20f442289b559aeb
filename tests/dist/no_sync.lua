-- Gradient accumulation without reduction (tests/recipes/dist_no_sync.sh): fsdp.no_sync.
--
--   fsdprun -n N tests/dist/no_sync.lua [--part=equiv|errors|all] [--ckpt=DIR] [--odd_rank=R]
--
-- equiv: a GPT (one unit per Block, the root tied) trains 4 steps on a global batch of 16 rows
--   with SGD (momentum, weight decay), clip_grad_norm at 0.5 (it clips) and a pruning mask on
--   one weight. The reference is the plain model on all 16 rows at once, computed by every rank
--   on its own. The wrapped model gives each rank its 16/N rows in k micro-batches (k = 2, 4;
--   loss / k each), for every strategy (full, full with reshard_after_forward = false,
--   grad_op, none), two ways: the first k - 1 backwards inside fsdp.no_sync ("no_sync"), or all
--   of them outside ("every": every backward reduces). Checked on every rank:
--   * losses (mean over ranks), clip norms and final parameters equal the reference within
--     1e-5 relative (the parameters as one vector; masked weights exactly 0);
--   * traffic per optimizer step, up to the clip: no_sync reduce-scatters (none: all-reduces)
--     sum P_u bytes in one call per unit, every reduces k times that, so no_sync's bytes are 1/k
--     of every's exactly; the all-gathers are the same both ways;
--   * memory (fsdp.memory().grads): after micro-batch 1 inside no_sync it is up by sum P_u
--     bytes (each unit's full f32 gradient held), and u:grad_unreduced() holds; after the last
--     backward it is back where it was (the held gradients are freed into the shards); with
--     every, micro-batch 1 adds nothing;
--   * a control that drops micro-batch 1's gradient (zero_grad after it) must differ (> 1e-3):
--     the comparison can fail.
-- errors: what no_sync refuses and restores, and what a step after it reduces (see the checks
--   below; with --ckpt, an fsdp.save into DIR inside no_sync too); a layer dropped from the
--   last micro-batch (layer_drop).
-- --odd_rank=R: rank R runs micro-batch 1 outside no_sync, the others inside: every rank must
--   fail at once with the collectives' mismatch named (whether to reduce must agree).
local fsdp = require "fsdp"
local nn = fsdp.nn
local C = dofile("tests/dist/common.lua")
local check = C.check
local a = fsdp.args
local part = a.part or "all"
local W, rank = fsdp.world_size(), fsdp.rank()

local V, T, B, STEPS = 32, 8, 16, 4
local cfg = {vocab = V, ctx = T, d = 16, layers = 2, heads = 2}
local opt_cfg = {lr = 0.05, momentum = 0.9, weight_decay = 0.01}
local MAX_NORM, TOL = 0.5, 1e-5
local MP_TOL, MP_BF16_TOL = 1e-5, 1e-2
local MASKED = "blocks.1.mlp.fc.weight"

-- rows first .. first + n - 1 (global, 1-based) of step s's batch
local function batch(s, first, n)
  local x, y = {}, {}
  for i = 1, n do
    local r = first + i - 1
    x[i], y[i] = {}, {}
    for t = 1, T do
      x[i][t] = (s * 7 + r * 5 + t * 3 + r * t) % V
      y[i][t] = (x[i][t] * 3 + r + 1) % V
    end
  end
  return fsdp.tensor(x, {dtype = "i64"}), fsdp.tensor(y, {dtype = "i64"})
end

local function build()
  fsdp.manual_seed(11)
  local m = nn.GPT(cfg)
  local p = m.blocks[1].mlp.fc.weight
  local sh, rows = p:shape(), {}
  for i = 1, sh[1] do
    rows[i] = {}
    for j = 1, sh[2] do rows[i][j] = (i * 7 + j * 3) % 4 == 0 and 0 or 1 end
  end
  return m, fsdp.tensor(rows)
end

-- {path = flat values}; collective for a wrapped model
local function params_of(m)
  local out = {}
  fsdp.full_params(m, function(mm)
    for path, p in mm:named_parameters() do out[path] = C.flat(p) end
  end, {writeback = false})
  return out
end

local function rel(x, ref) return math.abs(x - ref) / math.max(math.abs(ref), 1e-30) end

local function params_rel(got, ref)
  local num, den = 0, 0
  for path, r in pairs(ref) do
    local g = got[path]
    for i = 1, #r do
      num = num + (g[i] - r[i]) ^ 2
      den = den + r[i] ^ 2
    end
  end
  return math.sqrt(num / den)
end

-- ---- the reference: the plain model on the whole batch ------------------------------------------

local function train_plain()
  local m, mask = build()
  fsdp.set_mask(m.blocks[1].mlp.fc.weight, mask)
  -- the unwrapped reference: every rank trains the same whole model on the whole batch
  local opt = fsdp.optim.SGD(m, {lr = opt_cfg.lr, momentum = opt_cfg.momentum,
                                 weight_decay = opt_cfg.weight_decay, local_only = true})
  local losses, norms = {}, {}
  for s = 1, STEPS do
    local x, y = batch(s, 1, B)
    opt:zero_grad()
    local loss = nn.F.cross_entropy(m(x), y)
    loss:backward()
    norms[s] = fsdp.clip_grad_norm(m, MAX_NORM)
    opt:step()
    losses[s] = loss:item()
  end
  return {losses = losses, norms = norms, params = params_of(m)}
end

-- ---- the wrapped model, k micro-batches per step ------------------------------------------------

local function grads_bytes() return fsdp.memory().grads end

-- o: strategy, raf, k, mode ("no_sync" | "every"), drop_first
local function train_wrapped(o)
  collectgarbage("collect") -- the previous run's buffers: gone before memory is measured
  local m, mask = build()
  fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}, strategy = o.strategy,
    reshard_after_forward = o.raf, mp = o.mp})
  fsdp.set_mask(m.blocks[1].mlp.fc.weight, mask)
  local opt = fsdp.optim.SGD(m, opt_cfg)
  local units = fsdp.units(m)
  -- bytes of a gradient element while held (the gradient dtype: f32 unless mixed precision
  -- computes and reduces in bf16) and as reduced (the reduce dtype)
  local mp = type(o.mp) == "string" and {param = o.mp} or o.mp or {}
  local reduce_size = mp.reduce == "bf16" and 2 or 4
  local held_size = (mp.param == "bf16" and mp.reduce == "bf16") and 2 or 4
  local Pn, n_red = 0, 0 -- padded elements of all units; units that reduce
  for _, u in ipairs(units) do
    Pn = Pn + u:padded_numel()
    if u:padded_numel() > 0 then n_red = n_red + 1 end
  end
  local P, R = Pn * held_size, Pn * reduce_size
  local rows = B / W
  local mb = rows / o.k
  local first = rank * rows + 1
  local label = ("%s k=%d %s"):format(o.label, o.k, o.mode)
  local losses, norms, traffic = {}, {}, {}
  -- a gradient shard is made at its unit's first reducing backward: made here, so that every
  -- step measures the held gradients from the same base
  for _, u in ipairs(units) do u:grad_shard() end
  for s = 1, STEPS do
    opt:zero_grad()
    fsdp.reset_comm_stats()
    local base = grads_bytes()
    local total = 0
    for i = 1, o.k do
      local x, y = batch(s, first + (i - 1) * mb, mb)
      local function micro()
        local loss = nn.F.cross_entropy(m(x), y)
        local scaled = loss * (1 / o.k)
        scaled:backward()
        total = total + loss:item() / o.k
      end
      if o.mode == "no_sync" and i < o.k then fsdp.no_sync(m, micro) else micro() end
      if i == 1 and o.k > 1 then
        local held = o.mode == "no_sync"
        check(grads_bytes() - base == (held and P or 0), ("%s step %d: after micro-batch 1 "
          .. "grads are up by %d bytes, expected %d"):format(label, s, grads_bytes() - base,
            held and P or 0))
        for _, u in ipairs(units) do
          check(u:grad_unreduced() == (held and u:padded_numel() > 0),
            ("%s: unit %s grad_unreduced is %s"):format(label, u.path, tostring(u:grad_unreduced())))
        end
        if o.drop_first then opt:zero_grad() end
      end
    end
    for _, u in ipairs(units) do
      check(not u:grad_unreduced(), ("%s: unit %s still unreduced after the last backward")
        :format(label, u.path))
    end
    -- from step 2 the gradient shards exist: the last backward freed what no_sync held
    if s > 1 then
      check(grads_bytes() == base, ("%s step %d: grads %d bytes after the step's backwards, "
        .. "%d before"):format(label, s, grads_bytes(), base))
    end
    traffic[s] = fsdp.comm_stats()
    norms[s] = fsdp.clip_grad_norm(m, MAX_NORM)
    opt:step()
    losses[s] = fsdp.all_reduce(total, "mean")
  end
  local t = traffic[STEPS]
  local reduced = o.mode == "no_sync" and 1 or o.k
  local rs, rs_calls, ar, ar_calls = 0, 0, 0, 0
  if o.strategy == "none" then ar, ar_calls = reduced * R, reduced * n_red
  else rs, rs_calls = reduced * R, reduced * n_red end
  check(t.reduce_scatter_bytes == rs and t.reduce_scatter_calls == rs_calls,
    ("%s: reduce_scatter %d B in %d calls per step, expected %d B in %d"):format(label,
      t.reduce_scatter_bytes, t.reduce_scatter_calls, rs, rs_calls))
  check(t.all_reduce_bytes == ar and t.all_reduce_calls == ar_calls,
    ("%s: all_reduce %d B in %d calls per step, expected %d B in %d"):format(label,
      t.all_reduce_bytes, t.all_reduce_calls, ar, ar_calls))
  local out = {losses = losses, norms = norms, params = params_of(m), traffic = t, P = P}
  -- masked weights stay exactly zero
  local w = out.params[MASKED]
  local mflat = C.flat(mask)
  for i = 1, #mflat do
    if mflat[i] == 0 and w[i] ~= 0 then
      check(false, ("%s: masked element %d of %s is %g"):format(label, i, MASKED, w[i]))
      break
    end
  end
  fsdp.unwrap(m)
  return out
end

local function compare(label, got, ref)
  local lmax, nmax = 0, 0
  for s = 1, STEPS do
    lmax = math.max(lmax, rel(got.losses[s], ref.losses[s]))
    nmax = math.max(nmax, rel(got.norms[s], ref.norms[s]))
  end
  return lmax, nmax, params_rel(got.params, ref.params)
end

local function equiv()
  local ref = train_plain()
  local clipped = false
  for s = 1, STEPS do clipped = clipped or ref.norms[s] > MAX_NORM end
  check(clipped, "the reference never clips: clip_grad_norm's interplay would go untested")
  local configs = {
    {label = "full", strategy = "full"},
    {label = "full raf=false", strategy = "full", raf = false},
    {label = "grad_op", strategy = "grad_op"},
    {label = "none", strategy = "none"},
  }
  for _, c in ipairs(configs) do
    for _, k in ipairs{2, 4} do
      if (B / W) % k == 0 then
        local runs = {}
        for _, mode in ipairs{"no_sync", "every"} do
          local got = train_wrapped{label = c.label, strategy = c.strategy, raf = c.raf, k = k,
            mode = mode}
          runs[mode] = got
          local l, n, p = compare(label, got, ref)
          local label = ("%s k=%d %s"):format(c.label, k, mode)
          check(l <= TOL and n <= TOL and p <= TOL, ("%s vs the large batch: loss %.2g, clip "
            .. "norm %.2g, parameters %.2g (relative; tolerance %g)"):format(label, l, n, p, TOL))
          if rank == 0 then
            print(("%-26s vs 1 rank, whole batch: loss %.1e  norm %.1e  params %.1e"):format(
              label, l, n, p))
          end
        end
        local ns, ev = runs.no_sync.traffic, runs.every.traffic
        local red = c.strategy == "none" and "all_reduce_bytes" or "reduce_scatter_bytes"
        check(ns[red] * k == ev[red], ("%s k=%d: %s per step %d (no_sync) x k ~= %d (every)")
          :format(c.label, k, red, ns[red], ev[red]))
        check(ns.all_gather_bytes == ev.all_gather_bytes, ("%s k=%d: all_gather bytes %d "
          .. "(no_sync) ~= %d (every)"):format(c.label, k, ns.all_gather_bytes, ev.all_gather_bytes))
        if rank == 0 then
          print(("%-26s %s per optimizer step: no_sync %d B, every micro-batch %d B (ratio "
            .. "1/%g); all_gather %d B both; held full gradients %d B per rank"):format(
            c.label .. " k=" .. k, red:gsub("_bytes", ""), ns[red], ev[red], ev[red] / ns[red],
            ns.all_gather_bytes, runs.no_sync.P))
        end
      end
    end
  end
  -- mixed precision: the held gradient is f32 (bf16 when param and reduce are both bf16); no_sync
  -- against reducing every micro-batch (both compute in bf16, so not against the f32 reference)
  for _, c in ipairs{{label = "mp bf16", mp = "bf16", tol = MP_TOL},
      {label = "mp bf16 reduce bf16", mp = {param = "bf16", reduce = "bf16"}, tol = MP_BF16_TOL}} do
    local runs = {}
    for _, mode in ipairs{"no_sync", "every"} do
      runs[mode] = train_wrapped{label = c.label, strategy = "full", k = 2, mode = mode, mp = c.mp}
    end
    local l, n, p = compare(c.label, runs.no_sync, runs.every)
    check(l <= c.tol and n <= c.tol and p <= c.tol, ("%s k=2: no_sync vs every micro-batch: loss "
      .. "%.2g, clip norm %.2g, parameters %.2g (tolerance %g)"):format(c.label, l, n, p, c.tol))
    if rank == 0 then
      print(("%-26s no_sync vs every: loss %.1e  norm %.1e  params %.1e; reduce_scatter %d B vs "
        .. "%d B per step"):format(c.label .. " k=2", l, n, p,
        runs.no_sync.traffic.reduce_scatter_bytes, runs.every.traffic.reduce_scatter_bytes))
    end
  end

  -- the control: micro-batch 1's gradient dropped must not pass
  local bad = train_wrapped{label = "control", strategy = "full", k = 2, mode = "no_sync",
    drop_first = true}
  local _, _, p = compare("control", bad, ref)
  check(p > 1e-3, ("dropping micro-batch 1's gradient still matches (parameters %.2g): the "
    .. "comparison cannot fail"):format(p))
  if rank == 0 then print(("control (micro-batch 1 dropped): parameters %.1e, fails as it must"):format(p)) end
end

-- ---- errors and state ----------------------------------------------------------------------------

local function line() return debug.getinfo(2, "l").currentline end
local src = debug.getinfo(1, "S").short_src

-- fn must raise an error holding `pattern`; returns its message
local function expect_error(what, pattern, fn, ...)
  local ok, err = pcall(fn, ...)
  if ok then
    check(false, what .. ": no error")
    return ""
  end
  err = tostring(err)
  check(err:find(pattern, 1, true) ~= nil, ("%s: error lacks '%s': %s"):format(what, pattern, err))
  return err
end

-- err starts with this file's name and line `at` (the user's line, not the library's)
local function located(what, err, at)
  local pre = ("%s:%d: "):format(src, at or -1)
  check(err:sub(1, #pre) == pre, ("%s: error not located at %s: %s"):format(what, pre, err))
end

local function errors()
  local m = build()
  fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
  local opt = fsdp.optim.SGD(m, opt_cfg)
  local units = fsdp.units(m)
  local P = 0
  for _, u in ipairs(units) do P = P + u:padded_numel() * 4 end
  local x, y = batch(1, rank * 2 + 1, 2)
  local function backward() nn.F.cross_entropy(m(x), y):backward() end
  local function all_sync(want, what)
    for _, u in ipairs(units) do
      check(u:grad_sync() == want, ("%s: unit %s grad_sync is %s"):format(what, u.path,
        tostring(u:grad_sync())))
    end
  end
  local function unreduced()
    for _, u in ipairs(units) do if u:grad_unreduced() then return true end end
    return false
  end
  local function rs_bytes() return fsdp.comm_stats().reduce_scatter_bytes end
  local function grad_shards()
    local out = {}
    for i, u in ipairs(units) do out[i] = C.flat(u:grad_shard()) end
    return out
  end
  backward()
  opt:zero_grad() -- the gradient shards exist from here on
  local at, err

  -- a step inside no_sync is refused, located at the user's line; sync is back on after fn's
  -- error, the held gradient stays and refuses a step until a backward outside reduces it
  err = expect_error("opt:step inside no_sync", "SGD:step: inside fsdp.no_sync", function()
    fsdp.no_sync(m, function() backward(); at = line(); opt:step() end)
  end)
  located("opt:step inside no_sync", err, at)
  all_sync(true, "after an error inside fn")
  check(unreduced(), "the gradient accumulated before fn's error is not held any more")
  fsdp.reset_comm_stats()
  backward()
  check(rs_bytes() == P, ("the backward after no_sync reduce-scattered %d B, expected %d"):format(
    rs_bytes(), P))
  check(not unreduced(), "still unreduced after a backward outside no_sync")
  opt:step()
  opt:zero_grad()

  -- every micro-batch inside no_sync: the clip (or the step) reduces what is held, once, into
  -- the same gradient as a last backward outside would have
  fsdp.no_sync(m, backward)
  backward()
  local want2 = grad_shards() -- the usual pattern
  opt:zero_grad()
  fsdp.no_sync(m, function() backward(); backward() end)
  fsdp.reset_comm_stats()
  fsdp.clip_grad_norm(m, 1e9) -- measures only
  check(rs_bytes() == P and not unreduced(), ("clip_grad_norm after no_sync reduced %d B, "
    .. "expected %d"):format(rs_bytes(), P))
  local held2, off = grad_shards(), 0
  for i = 1, #want2 do
    for j = 1, #want2[i] do off = math.max(off, math.abs(want2[i][j] - held2[i][j])) end
  end
  check(off < 1e-6, ("two micro-batches inside no_sync, reduced by the clip, differ from the "
    .. "usual pattern by %g"):format(off))
  fsdp.reset_comm_stats()
  opt:step()
  check(rs_bytes() == 0, "opt:step reduced again what clip_grad_norm reduced")
  opt:zero_grad()
  fsdp.no_sync(m, backward)
  fsdp.reset_comm_stats()
  opt:step()
  check(rs_bytes() == P and not unreduced(), "opt:step did not reduce what no_sync held")
  opt:zero_grad()

  -- clip_grad_norm and a loss scaler's unscale_ inside no_sync are refused too
  err = expect_error("clip_grad_norm inside no_sync", "clip_grad_norm: inside fsdp.no_sync",
    function() fsdp.no_sync(m, function() at = line(); fsdp.clip_grad_norm(m, 1.0) end) end)
  located("clip_grad_norm inside no_sync", err, at)
  local scaler = fsdp.optim.GradScaler()
  err = expect_error("unscale_ inside no_sync", "GradScaler:unscale_: inside fsdp.no_sync",
    function() fsdp.no_sync(m, function() at = line(); scaler:unscale_(opt) end) end)
  located("unscale_ inside no_sync", err, at)

  -- fn's own error: raised again unchanged (its location, a table as itself), sync back on
  err = expect_error("an error inside fn", "boom", function()
    fsdp.no_sync(m, function() at = line(); error("boom") end)
  end)
  check(err == ("%s:%d: boom"):format(src, at), "fn's error changed on the way out: " .. err)
  local obj = {}
  local ok, e = pcall(fsdp.no_sync, m, function() error(obj) end)
  check(not ok and rawequal(e, obj), "a table raised inside fn does not come back as itself")
  all_sync(true, "after fn raised")

  -- nested: sync stays off until the outermost returns
  opt:zero_grad()
  fsdp.reset_comm_stats()
  fsdp.no_sync(m, function()
    fsdp.no_sync(m, function() backward(); all_sync(false, "inside the inner no_sync") end)
    all_sync(false, "after the inner no_sync returned")
    backward()
  end)
  check(rs_bytes() == 0, ("nested no_sync reduce-scattered %d B"):format(rs_bytes()))
  all_sync(true, "after the outer no_sync")
  backward()
  check(rs_bytes() == P, ("after nested no_sync: %d B reduce-scattered, expected %d"):format(
    rs_bytes(), P))
  -- three backwards, one reduction: the same gradient as three reduced one by one (the sums
  -- differ only in where the ranks' average is taken)
  local g3 = grad_shards()
  opt:zero_grad()
  backward(); backward(); backward()
  local e3, worst = grad_shards(), 0
  for i = 1, #g3 do
    for j = 1, #g3[i] do worst = math.max(worst, math.abs(g3[i][j] - e3[i][j])) end
  end
  check(worst < 1e-6, ("3 backwards under nested no_sync differ from 3 reduced ones by %g"):format(worst))

  -- fn's results all come back (nils too); fn gets the model
  local r = {fsdp.no_sync(m, function(mm) check(mm == m, "fn did not get the model") return 1, nil, 3 end)}
  check(r[1] == 1 and r[2] == nil and r[3] == 3 and select("#", fsdp.no_sync(m, function()
    return 1, nil, 3 end)) == 3, "fn's results did not come back")

  -- zero_grad drops what no_sync held (memory back, nothing unreduced, a step is fine)
  opt:zero_grad()
  local before = fsdp.memory().grads
  fsdp.no_sync(m, backward)
  check(fsdp.memory().grads - before == P, ("no_sync holds %d B, expected %d"):format(
    fsdp.memory().grads - before, P))
  opt:zero_grad()
  check(fsdp.memory().grads == before and not unreduced(), "zero_grad did not drop the held gradient")
  opt:step()

  -- a graph recorded and dropped without backward leaves the held gradient alone
  opt:zero_grad()
  fsdp.no_sync(m, backward)
  local _ = nn.F.cross_entropy(m(x), y) -- recorded, never backwarded
  fsdp.core.tape_clear()
  check(unreduced() and fsdp.memory().grads - before == P,
    "a graph dropped without backward took the held gradient with it")
  backward()
  local g2 = grad_shards()
  opt:zero_grad()
  backward(); backward()
  e3, worst = grad_shards(), 0
  for i = 1, #g2 do
    for j = 1, #g2[i] do worst = math.max(worst, math.abs(g2[i][j] - e3[i][j])) end
  end
  check(worst < 1e-6, ("after a dropped graph the accumulated gradient is off by %g"):format(worst))
  opt:zero_grad()

  -- full_params and a checkpoint inside no_sync are fine and leave the held gradient alone
  fsdp.no_sync(m, function()
    backward()
    fsdp.full_params(m, function(mm) check(mm.blocks[1].mlp.fc.weight:numel() > 0, "full_params") end)
    if a.ckpt then fsdp.save(m, a.ckpt, {format = "sharded", optimizer = opt}) end
  end)
  check(unreduced() and fsdp.memory().grads - before == P,
    "full_params or save inside no_sync took the held gradient")
  opt:zero_grad()

  -- refusals: a submodule, bad arguments, unwrap inside
  err = expect_error("no_sync on a submodule", "part of a wrapped model; give its root",
    function() at = line(); fsdp.no_sync(m.blocks[1], function() end) end)
  located("no_sync on a submodule", err, at)
  err = expect_error("no_sync without fn", "fsdp.no_sync: expects (model, fn) (got table, nil)",
    function() at = line(); fsdp.no_sync(m) end)
  located("no_sync without fn", err, at)
  expect_error("no_sync on a number", "fsdp.no_sync: expects (model, fn) (got number, function)",
    fsdp.no_sync, 42, function() end)
  expect_error("no_sync with an extra argument",
    "fsdp.no_sync: expects (model, fn), and fn is called as fn(model) (got 1 more argument)",
    fsdp.no_sync, m, function() end, 3)
  err = expect_error("unwrap inside no_sync", "fsdp.unwrap: not inside fsdp.no_sync",
    function() fsdp.no_sync(m, function() at = line(); fsdp.unwrap(m) end) end)
  located("unwrap inside no_sync", err, at)
  check(fsdp.is_wrapped(m), "the model was unwrapped inside no_sync")
  all_sync(true, "after the refused unwrap")

  -- a plain model: fn simply runs (its gradients accumulate in p.grad as always)
  local pm = build()
  local ran = fsdp.no_sync(pm, function(mm)
    nn.F.cross_entropy(mm(x), y):backward()
    return "ran"
  end)
  check(ran == "ran" and pm.blocks[1].mlp.fc.weight.grad ~= nil, "no_sync on a plain model")
  -- the unit methods under it
  expect_error("u:set_grad_sync(1)", "boolean expected", function() units[1]:set_grad_sync(1) end)
  fsdp.unwrap(m)
  expect_error("reduce_held on an unwrapped unit", ("reduce_held: unit '%s' was unsharded")
    :format(units[1].path), function()
    units[1]:reduce_held()
  end)
  if rank == 0 then print("errors and state: checked") end
end

-- Layer drop: unit b runs in micro-batch 1 (inside no_sync) and is skipped, on every rank, in
-- micro-batch 2 (outside): b still holds its gradient after the last backward, and the step
-- (here the clip before it) reduces it, once, into what reducing every micro-batch gives.
local Drop = nn.Module:extend("NoSyncDrop")
function Drop:init()
  self.a = nn.Linear(4, 4)
  self.b = nn.Linear(4, 4)
end
function Drop:forward(x)
  x = self.a(x):relu()
  if not self.skip then x = self.b(x) end
  return x
end

local function layer_drop()
  local function run(use_no_sync)
    fsdp.manual_seed(5)
    local m = Drop()
    fsdp.wrap(m, {policy = fsdp.policy.list{m.a, m.b}})
    local z = fsdp.randn{2 + rank, 4} -- each rank its own rows
    local function micro(skip)
      m.skip = skip
      m(z):sum():backward()
    end
    fsdp.reset_comm_stats()
    if use_no_sync then fsdp.no_sync(m, function() micro(false) end) else micro(false) end
    micro(true)
    for _, u in ipairs(fsdp.units(m)) do
      check(u:grad_unreduced() == (use_no_sync and u.path == "b"), ("layer drop: unit %s "
        .. "grad_unreduced is %s after the last backward"):format(u.path, tostring(u:grad_unreduced())))
    end
    fsdp.clip_grad_norm(m, 1e9)
    local out = {}
    for _, u in ipairs(fsdp.units(m)) do
      out[u.path] = C.flat(u:grad_shard())
      check(not u:grad_unreduced(), u.path .. " still unreduced after the clip")
    end
    local rs = fsdp.comm_stats().reduce_scatter_calls
    fsdp.unwrap(m)
    return out, rs
  end
  local want, rs_every = run(false)
  local got, rs_held = run(true)
  local off = 0
  for path, v in pairs(want) do
    for j = 1, #v do off = math.max(off, math.abs(v[j] - got[path][j])) end
  end
  check(off < 1e-6, ("layer drop under no_sync differs from reducing every micro-batch by %g"):format(off))
  -- every: a and b after micro-batch 1, a after 2 (the root owns nothing); no_sync: a after 2,
  -- b at the clip
  check(rs_every == 3 and rs_held == 2, ("layer drop: %d reduce-scatters (every), %d (no_sync); "
    .. "expected 3 and 2"):format(rs_every, rs_held))
end

-- --odd_rank=R: rank R reduces after micro-batch 1, the others do not
local function odd_rank(r)
  local m = build()
  fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}})
  local x, y = batch(1, rank * 2 + 1, 2)
  local function backward() nn.F.cross_entropy(m(x), y):backward() end
  if rank == r then backward() else fsdp.no_sync(m, backward) end
  backward()
end

if a.odd_rank then odd_rank(a.odd_rank) end
if part == "equiv" or part == "all" then equiv() end
if part == "errors" or part == "all" then
  errors()
  layer_drop()
end
if rank == 0 then print(("world size %d"):format(W)) end
if C.failures() > 0 then error(("%d no_sync checks failed"):format(C.failures())) end
