-- The training features combined (tests/recipes/dist_features_mix.sh), at any world size of
-- 1, 2 or 4. Each feature has its own test against the strategies full, grad_op and none; this
-- one runs them together and under hybrid sharding, in groups of S = max(1, W / 2) ranks
-- (4 ranks: 2 groups of 2; 2 ranks: 2 groups of 1).
--
-- Every run is checked against the plain model trained on the whole global batch of 8 rows
-- (computed on every rank: an unwrapped model with a local_only optimizer, which is what one
-- rank computes): losses within 1e-5 relative at every step and the final parameters, as one
-- vector, within 1e-5 relative. Where a single feature promises bits, the combination is held
-- to them: activation checkpointing gives the bits of the same run without it, frozen
-- parameters keep their bits, "replicate" is "none".
--
--   GPT (vocab 32, ctx 8, d 16, 2 Blocks, tied; one unit per Block), AdamW (eps 1e-6, weight
--   decay 0.1), clip_grad_norm 0.5, 3 steps:
--     hybrid                          the baseline
--     hybrid + checkpoint             the bits of hybrid, the same all-gather bytes
--     hybrid + no_sync (k = 2)        reduce bytes per step: in the group and across groups,
--                                     those of one backward per step (1/k of reducing each
--                                     micro-batch); all-gather bytes k times
--     hybrid + no_sync + checkpoint   the bits of hybrid + no_sync
--     hybrid + no_sync, MLP units inside checkpointed Blocks: the bits of the unchecked run,
--                                     one more all-gather per unit and micro-batch
--     hybrid, reshard_after_forward = false, + no_sync: one gather fewer per unit and
--                                     micro-batch
--     full + no_sync (+ checkpoint)   the same pair under full sharding
--     controls: the bitwise check sees no_sync's rounding, the 1e-5 check a frozen block
--   the same GPT with block 2 frozen (gradients pass through it to block 1 and the
--   embeddings):
--     hybrid + frozen                 the frozen unit reduces nothing (bytes asserted)
--     hybrid + frozen + no_sync       the frozen unit holds no gradient between micro-batches
--     hybrid + frozen + checkpoint    the frozen block checkpointed: the bits of hybrid + frozen
--     hybrid + frozen + no_sync + checkpoint: the bits of hybrid + frozen + no_sync
--   the GPT with LoRA adapters on the attention projections (nn.lora.apply; units per Block and
--   per adapter, the Blocks fully frozen):
--     hybrid + LoRA (+ checkpointed Blocks, + no_sync)   the checkpointed runs: the bits of the
--                                     unchecked ones; the base weights keep their bits; also
--                                     checkpoint = true (adapters checkpointed inside Blocks)
--   the GPT with the embeddings (so the tied head) and block 1 frozen: no gradient reaches
--   block 1, so its checkpointed forward runs plain and its unit stays out of backward:
--     hybrid + bottom frozen + no_sync (+ checkpoint)    the bits of the unchecked run
--   an MLP (20-36-30-10, units by size) under hybrid, with and without no_sync (k = 2):
--   Adafactor, Lion, AdamW with parameter groups, 6 steps
--   checkpoint: hybrid + no_sync + frozen, a sharded checkpoint (with AdamW's state) saved
--   between micro-batches (inside no_sync) and after step 2; the run goes on to the bits of
--   the same run without saving; a full-shard model loads the step-2 checkpoint and takes step 3
--   with the same loss (1e-6) and parameters (1e-5); the mid-accumulation checkpoint holds the
--   parameters after step 1 exactly
--   replicate: strategy "replicate" gives the bits of "none"
-- Every check runs on every rank; any failure raises at the end. Rank 0 prints the figures.
--   fsdprun -n N tests/dist/features_mix.lua --dir=TMPDIR [--case=PATTERN]
local fsdp = require "fsdp"
local nn = fsdp.nn
local a = fsdp.args
local C = dofile("tests/dist/common.lua")
local check = C.check
local W, rank = fsdp.world_size(), fsdp.rank()
local S = math.max(1, math.floor(W / 2))
local dir = assert(a.dir, "--dir=a temporary folder")
local only = a.case
local TOL = 1e-5

local B, T, V = 8, 8, 32
assert(B % (2 * W) == 0, "8 rows must split into 2 micro-batches per rank")
local BLOCK = fsdp.policy.modules{nn.Block}
local function say(...) if rank == 0 then print(...) end end

-- ---- models and data ------------------------------------------------------------------------

local function gpt(prep)
  fsdp.manual_seed(11)
  local m = nn.GPT{vocab = V, ctx = T, d = 16, layers = 2, heads = 2}
  if prep == "top" then
    m:freeze("^blocks%.2%.")
  elseif prep == "bottom" then
    m:freeze{"^wte%.", "^wpe%.", "^blocks%.1%."}
  elseif prep == "lora" then
    nn.lora.apply(m, {rank = 2, alpha = 4})
    -- B starts at zeros; a small start lets A's gradient be nonzero from step 1
    fsdp.manual_seed(12)
    for path, p in m:named_parameters() do
      if path:find("%.lora%.B$") then p:copy(fsdp.randn(p:shape()) * 0.1) end
    end
  end
  return m
end

local function mlp()
  fsdp.manual_seed(99)
  return nn.Sequential{nn.Linear(20, 36), nn.ReLU(), nn.Linear(36, 30), nn.ReLU(), nn.Linear(30, 10)}
end

-- rows [first, first + n) of step's global batch (1-based row numbers)
local function gpt_rows(step, first, n)
  local x, y = {}, {}
  for i = first, first + n - 1 do
    local xi, yi = {}, {}
    for t = 1, T do
      xi[t] = (i * 7 + t * 3 + step * 5 + (i * t) % 5) % V
      yi[t] = (xi[t] * 3 + t) % V
    end
    x[#x + 1], y[#y + 1] = xi, yi
  end
  return fsdp.tensor(x, {dtype = "i64"}), fsdp.tensor(y, {dtype = "i64"})
end

local function mlp_rows(step, first, n)
  local x, y = {}, {}
  for i = first, first + n - 1 do
    local xi = {}
    for j = 1, 20 do xi[j] = math.sin(step * 0.37 + i * 1.3 + j * 0.71) end
    x[#x + 1] = xi
    y[#y + 1] = math.floor((xi[1] + xi[2] + 2) * 2.5) % 10
  end
  return fsdp.tensor(x), fsdp.tensor(y)
end

local OPTS = {
  adamw = function(m, lo) return fsdp.optim.AdamW(m, {lr = 1e-2, eps = 1e-6, weight_decay = 0.1, local_only = lo}) end,
  adafactor = function(m, lo) return fsdp.optim.Adafactor(m, {lr = 2e-2, weight_decay = 0.01, local_only = lo}) end,
  lion = function(m, lo) return fsdp.optim.Lion(m, {lr = 1e-3, weight_decay = 0.1, local_only = lo}) end,
  groups = function(m, lo)
    return fsdp.optim.AdamW(m, {lr = 3e-3, weight_decay = 0.1, local_only = lo,
      groups = {{params = "%.bias$", weight_decay = 0}, {params = "^3%.", lr = 3e-4}}})
  end,
}

-- ---- training -------------------------------------------------------------------------------

-- Every parameter's values, {path, flat array} in named_parameters order (collective when
-- wrapped).
local function values(model)
  local function read(m)
    local out = {}
    for path, p in m:named_parameters() do out[#out + 1] = {path, C.flat(p)} end
    return out
  end
  if fsdp.is_wrapped(model) then return fsdp.full_params(model, read, {writeback = false}) end
  return read(model)
end

local function group_bytes(s, key)
  return (s[key] or 0) + (s.shard and s.shard[key] or 0)
end

-- Train spec.model with spec.opt from step spec.from (1) to spec.steps. A wrapped model: this
-- rank's rows, in spec.k micro-batches (the first k - 1 inside fsdp.no_sync, each loss / k);
-- a plain one: the whole global batch at once. spec.micro(step, i, model) runs after
-- micro-batch i, spec.after(step, model) after each step. Returns {losses, values, stats (the
-- comm counters of steps 2 .. steps, per step), clip = the clip norms}.
local function train(spec)
  local model, opt, k = spec.model, spec.opt, spec.k or 1
  local rows = spec.rows or gpt_rows
  local wrapped = fsdp.is_wrapped(model)
  local first, n = 1, B
  if wrapped then n, first = B / W, rank * (B / W) + 1 else k = 1 end
  local losses, clips = {}, {}
  local from = spec.from or 1
  for step = from, spec.steps do
    if step == from + 1 then fsdp.reset_comm_stats() end
    opt:zero_grad()
    local sum, m = 0, n / k
    for i = 1, k do
      local function micro()
        local x, y = rows(step, first + (i - 1) * m, m)
        local loss = nn.F.cross_entropy(model(x), y)
        if k > 1 then (loss / k):backward() else loss:backward() end
        sum = sum + loss:item()
      end
      if i < k then fsdp.no_sync(model, micro) else micro() end
      if spec.micro then spec.micro(step, i, model) end
    end
    if spec.clip ~= false then clips[step] = fsdp.clip_grad_norm(model, 0.5) end
    opt:step()
    losses[step] = wrapped and fsdp.all_reduce(sum / k, "mean") or sum
    if spec.after then spec.after(step, model) end
  end
  local s = fsdp.comm_stats()
  local per = math.max(1, spec.steps - from)
  local stats = {ag = group_bytes(s, "all_gather_bytes") / per,
    rs = group_bytes(s, "reduce_scatter_bytes") / per,
    rep = (s.replicate and s.replicate.all_reduce_bytes or 0) / per,
    world_ag = s.all_gather_bytes / per, world_rs = s.reduce_scatter_bytes / per}
  return {losses = losses, values = values(model), stats = stats, clips = clips}
end

-- ---- comparisons ----------------------------------------------------------------------------

local figures = {}

-- run vs a reference: the largest relative loss error and the relative error of the parameters
-- as one vector (tests/dist/compare.lua's measures)
local function rel_errors(run, ref, what)
  local dl = 0
  for step, l in pairs(ref.losses) do
    dl = math.max(dl, math.abs(run.losses[step] - l) / math.abs(l))
  end
  local num, den = 0, 0
  check(#run.values == #ref.values, what .. ": the same parameters")
  for i, e in ipairs(ref.values) do
    local r = run.values[i]
    check(r and r[1] == e[1], ("%s: parameter %d is %s, expected %s"):format(what, i, r and r[1], e[1]))
    for j, v in ipairs(e[2]) do
      local d = (r and r[2][j] or 0) - v
      num, den = num + d * d, den + v * v
    end
  end
  return dl, math.sqrt(num) / math.sqrt(den)
end

-- run vs the plain model, within TOL; the figures are kept for the report
local function close(run, ref, what)
  local dl, dp = rel_errors(run, ref, what)
  check(dl <= TOL and dp <= TOL, ("%s vs the plain model: loss %.2g, parameters %.2g (tolerance %g)")
    :format(what, dl, dp, TOL))
  figures[#figures + 1] = {what, dl, dp}
  return dl, dp
end

-- nil when run has the bits of ref (every loss, clip norm and parameter), else the first
-- difference
local function bits_differ(run, ref)
  local bad
  for step, l in pairs(ref.losses) do
    if run.losses[step] ~= l then bad = bad or ("loss %d: %a vs %a"):format(step, run.losses[step], l) end
  end
  for step, c in pairs(ref.clips) do
    if run.clips[step] ~= c then bad = bad or ("clip norm %d: %a vs %a"):format(step, run.clips[step], c) end
  end
  for i, e in ipairs(ref.values) do
    if not C.same(run.values[i][2], e[2]) then bad = bad or ("parameter " .. e[1]) end
  end
  return bad
end

local function same_bits(run, ref, what)
  local bad = bits_differ(run, ref)
  check(bad == nil, what .. ": not the same bits (" .. tostring(bad) .. ")")
end

local function eq(got, want, what)
  check(got == want, ("%s: %s, expected %s"):format(what, tostring(got), tostring(want)))
end

-- the parameters matching pattern kept their bits from `before` (a frozen part); with `all`,
-- every other parameter changed
local function kept(run, before, pattern, what, all)
  local n = 0
  for i, e in ipairs(before) do
    if e[1]:find(pattern) then
      n = n + 1
      check(C.same(run.values[i][2], e[2]), what .. ": frozen " .. e[1] .. " changed")
    elseif all then
      check(not C.same(run.values[i][2], e[2]), what .. ": " .. e[1] .. " trains but did not change")
    end
  end
  check(n > 0, what .. ": some parameter is frozen")
end

local function want_case(name) return only == nil or name:find(only, 1, true) ~= nil end

-- A wrapped run: model from build(), wrapped with opts, trained with optimizer kind.
local function wrapped_run(build, opts, kind, spec)
  local m = build()
  fsdp.wrap(m, opts)
  spec = spec or {}
  spec.model, spec.opt = m, OPTS[kind](m)
  spec.steps = spec.steps or 3
  local r = train(spec)
  r.model = m
  return r
end

local function plain_run(build, kind, spec)
  local m = build()
  spec = spec or {}
  spec.model, spec.opt = m, OPTS[kind](m, true)
  spec.steps = spec.steps or 3
  return train(spec)
end

local function hybrid(extra)
  local o = {strategy = "hybrid", shard_size = S, policy = BLOCK}
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

local function units_of(model)
  local out = {}
  for _, u in ipairs(fsdp.units(model)) do out[u.path] = u end
  return out
end

-- ---- GPT: checkpointing and no_sync under hybrid, and each other ------------------------------
if want_case("gpt") then
  local build = function() return gpt() end
  local ref = plain_run(build, "adamw")
  local h = wrapped_run(build, hybrid(), "adamw")
  close(h, ref, "hybrid")
  -- the bytes of one step follow the schedule (docs/fsdp.md, "Hybrid sharding")
  local want_rs, want_rep = 0, 0
  for _, u in ipairs(fsdp.units(h.model)) do
    want_rs = want_rs + u:padded_numel() * 4
    want_rep = want_rep + u:padded_numel() * 4 / S
  end
  eq(h.stats.rs, want_rs, "hybrid: reduce_scatter bytes per step")
  eq(h.stats.rep, W / S > 1 and want_rep or 0, "hybrid: all_reduce bytes across the groups per step")
  eq(h.stats.world_ag + h.stats.world_rs, 0, "hybrid: the world gathers and scatters nothing")

  local hc = wrapped_run(build, hybrid{checkpoint = BLOCK}, "adamw")
  same_bits(hc, h, "hybrid + checkpoint vs hybrid")
  eq(hc.stats.ag, h.stats.ag, "hybrid + checkpoint: all-gather bytes per step")
  close(hc, ref, "hybrid + checkpoint")

  local held = {}
  local function watch(step, i, model)
    if i == 1 then
      for _, u in ipairs(fsdp.units(model)) do held[#held + 1] = u:grad_unreduced() end
    end
  end
  local hn = wrapped_run(build, hybrid(), "adamw", {k = 2, micro = watch})
  close(hn, ref, "hybrid + no_sync")
  local all_held = #held > 0
  for _, v in ipairs(held) do all_held = all_held and v end
  check(all_held, "hybrid + no_sync: every unit holds its gradient after micro-batch 1")
  for _, u in ipairs(fsdp.units(hn.model)) do
    check(not u:grad_unreduced(), "hybrid + no_sync: " .. u.path .. " holds nothing after the step")
  end
  -- one reduce per step: 1/k of reducing each of the k micro-batches (each moves h's bytes)
  eq(hn.stats.rs, h.stats.rs, "hybrid + no_sync: reduce_scatter bytes per step (in the group)")
  eq(hn.stats.rep, h.stats.rep, "hybrid + no_sync: all_reduce bytes per step (across the groups)")
  eq(hn.stats.ag, 2 * h.stats.ag, "hybrid + no_sync: all-gather bytes per step (k micro-batches)")
  local hnc = wrapped_run(build, hybrid{checkpoint = BLOCK}, "adamw", {k = 2})
  same_bits(hnc, hn, "hybrid + no_sync + checkpoint vs hybrid + no_sync")
  close(hnc, ref, "hybrid + no_sync + checkpoint")
  eq(hnc.stats.rs, hn.stats.rs, "hybrid + no_sync + checkpoint: reduce_scatter bytes per step")

  -- MLP units inside checkpointed Blocks: the recomputation gathers them once more, in the group
  local MLP = fsdp.policy.modules{nn.MLP}
  local hm = wrapped_run(build, hybrid{policy = MLP}, "adamw", {k = 2})
  local hmc = wrapped_run(build, hybrid{policy = MLP, checkpoint = BLOCK}, "adamw", {k = 2})
  same_bits(hmc, hm, "hybrid + no_sync, MLP units inside checkpointed Blocks vs unchecked")
  close(hmc, ref, "hybrid + no_sync, MLP units in checkpointed Blocks")
  local extra = 0
  for _, u in ipairs(fsdp.units(hmc.model)) do
    if not u.is_root then extra = extra + u:padded_numel() * 4 end
  end
  eq(hmc.stats.ag - hm.stats.ag, 2 * extra, "MLP units in checkpointed Blocks: all-gather bytes "
    .. "per step beyond the unchecked run's (one gather per unit and micro-batch)")

  -- the checks can fail: no_sync's other order of sums is not the bits of reducing each
  -- micro-batch; the frozen model is not within TOL of this one
  check(bits_differ(hn, h) ~= nil, "control: the bitwise comparison sees no_sync's rounding")
  local frozen_ref = plain_run(function() return gpt("top") end, "adamw")
  local dl, dp = rel_errors(frozen_ref, ref, "control")
  check(dl > TOL and dp > TOL, ("control: a frozen block is seen (loss %.2g, parameters %.2g)"):format(dl, dp))

  -- hybrid keeping the parameters gathered from forward to backward (ZeRO-2 in the group)
  local hk = wrapped_run(build, hybrid{reshard_after_forward = false}, "adamw", {k = 2})
  close(hk, ref, "hybrid, reshard_after_forward = false, + no_sync")
  local once = 0
  for _, u in ipairs(fsdp.units(hk.model)) do
    if not u.is_root then once = once + u:padded_numel() * 4 end
  end
  eq(hn.stats.ag - hk.stats.ag, 2 * once, "hybrid, reshard_after_forward = false: all-gather "
    .. "bytes per step (one gather fewer per unit and micro-batch)")
  eq(hk.stats.rs, hn.stats.rs, "hybrid, reshard_after_forward = false: reduce_scatter bytes")

  local fn = wrapped_run(build, {policy = BLOCK}, "adamw", {k = 2})
  close(fn, ref, "full + no_sync")
  local fnc = wrapped_run(build, {policy = BLOCK, checkpoint = BLOCK}, "adamw", {k = 2})
  same_bits(fnc, fn, "full + no_sync + checkpoint vs full + no_sync")
  close(fnc, ref, "full + no_sync + checkpoint")
  if rank == 0 then
    print(("gpt: hybrid %dx%d per step: reduce_scatter %d B in the group, all_reduce %d B across; "
      .. "no_sync k = 2: %d B and %d B (reducing each micro-batch: %d B and %d B)")
      :format(W / S, S, h.stats.rs, h.stats.rep, hn.stats.rs, hn.stats.rep, 2 * h.stats.rs,
        2 * h.stats.rep))
  end
end

-- ---- frozen block 2: gradients pass through it ------------------------------------------------
if want_case("frozen") then
  local build = function() return gpt("top") end
  local before = values(build())
  local ref = plain_run(build, "adamw")
  kept(ref, before, "^blocks%.2%.", "plain + frozen", true)
  local h = wrapped_run(build, hybrid(), "adamw")
  close(h, ref, "hybrid + frozen")
  kept(h, before, "^blocks%.2%.", "hybrid + frozen", true)
  -- the frozen unit reduces nothing, in the group or across
  local rs, rep = 0, 0
  for _, u in ipairs(fsdp.units(h.model)) do
    check(u:trainable() == (u.path ~= "blocks.2"), "hybrid + frozen: trainable " .. u.path)
    if u:trainable() then rs, rep = rs + u:padded_numel() * 4, rep + u:padded_numel() * 4 / S end
  end
  eq(h.stats.rs, rs, "hybrid + frozen: reduce_scatter bytes per step")
  eq(h.stats.rep, W / S > 1 and rep or 0, "hybrid + frozen: all_reduce bytes across the groups per step")

  local held = {}
  local hn = wrapped_run(build, hybrid(), "adamw", {k = 2, micro = function(_, i, model)
    if i == 1 then for path, u in pairs(units_of(model)) do held[path] = u:grad_unreduced() end end
  end})
  close(hn, ref, "hybrid + frozen + no_sync")
  kept(hn, before, "^blocks%.2%.", "hybrid + frozen + no_sync", true)
  eq(held["blocks.2"], false, "hybrid + frozen + no_sync: the frozen unit holds a gradient")
  eq(held["blocks.1"], true, "hybrid + frozen + no_sync: blocks.1 holds its gradient")
  eq(hn.stats.rs, h.stats.rs, "hybrid + frozen + no_sync: reduce_scatter bytes per step")
  eq(hn.stats.rep, h.stats.rep, "hybrid + frozen + no_sync: all_reduce bytes per step")

  local marked = false
  local hc = wrapped_run(build, hybrid{checkpoint = BLOCK}, "adamw", {after = function(_, model)
    marked = nn.is_checkpointed(model.blocks[2])
  end})
  check(marked, "hybrid + frozen + checkpoint: the frozen block is checkpointed")
  same_bits(hc, h, "hybrid + frozen + checkpoint vs hybrid + frozen")
  close(hc, ref, "hybrid + frozen + checkpoint")
  eq(hc.stats.ag, h.stats.ag, "hybrid + frozen + checkpoint: all-gather bytes per step")
  local hnc = wrapped_run(build, hybrid{checkpoint = BLOCK}, "adamw", {k = 2})
  same_bits(hnc, hn, "hybrid + frozen + no_sync + checkpoint vs hybrid + frozen + no_sync")
  close(hnc, ref, "hybrid + frozen + no_sync + checkpoint")

  -- the bottom frozen (embeddings, so the tied head, and block 1): no gradient reaches block 1,
  -- whose checkpointed forward then runs as a plain one and whose unit is not in backward
  local bbuild = function() return gpt("bottom") end
  local bbefore = values(bbuild())
  local bref = plain_run(bbuild, "adamw")
  local bh = wrapped_run(bbuild, hybrid(), "adamw", {k = 2})
  close(bh, bref, "hybrid + bottom frozen + no_sync")
  kept(bh, bbefore, "^w[tp]e%.", "hybrid + bottom frozen + no_sync")
  kept(bh, bbefore, "^blocks%.1%.", "hybrid + bottom frozen + no_sync")
  local bhc = wrapped_run(bbuild, hybrid{checkpoint = BLOCK}, "adamw", {k = 2})
  same_bits(bhc, bh, "hybrid + bottom frozen + no_sync + checkpoint vs unchecked")
  close(bhc, bref, "hybrid + bottom frozen + no_sync + checkpoint")
  eq(bhc.stats.ag, bh.stats.ag, "hybrid + bottom frozen + checkpoint: all-gather bytes per step")
end

-- ---- LoRA: frozen Blocks around trainable adapter units, checkpointed -------------------------
if want_case("lora") then
  local build = function() return gpt("lora") end
  local before = values(build())
  local ref = plain_run(build, "adamw")
  local pol = fsdp.policy.modules{nn.Block, nn.LoRA}
  local function check_base(run, what)
    for i, e in ipairs(before) do
      local is_lora = e[1]:find("%.lora%.") ~= nil
      check(C.same(run.values[i][2], e[2]) == not is_lora,
        ("%s: %s %s"):format(what, e[1], is_lora and "did not train" or "(frozen) changed"))
    end
  end
  check_base(ref, "plain LoRA")
  local h = wrapped_run(build, hybrid{policy = pol}, "adamw")
  close(h, ref, "hybrid + LoRA")
  check_base(h, "hybrid + LoRA")
  for _, u in ipairs(fsdp.units(h.model)) do
    check(u:trainable() == (u.path:find("lora") ~= nil), "hybrid + LoRA: trainable " .. u.path)
  end
  local hc = wrapped_run(build, hybrid{policy = pol, checkpoint = BLOCK}, "adamw")
  same_bits(hc, h, "hybrid + LoRA + checkpointed Blocks vs hybrid + LoRA")
  close(hc, ref, "hybrid + LoRA + checkpointed Blocks")
  check_base(hc, "hybrid + LoRA + checkpointed Blocks")
  -- checkpoint = true: every unit but the root, the adapters' inside the Blocks' (nested)
  local ht = wrapped_run(build, hybrid{policy = pol, checkpoint = true}, "adamw")
  same_bits(ht, h, "hybrid + LoRA + checkpoint = true (nested) vs hybrid + LoRA")
  local hn = wrapped_run(build, hybrid{policy = pol}, "adamw", {k = 2})
  close(hn, ref, "hybrid + LoRA + no_sync")
  local hnc = wrapped_run(build, hybrid{policy = pol, checkpoint = BLOCK}, "adamw", {k = 2})
  same_bits(hnc, hn, "hybrid + LoRA + no_sync + checkpointed Blocks vs hybrid + LoRA + no_sync")
  close(hnc, ref, "hybrid + LoRA + no_sync + checkpointed Blocks")
  check_base(hnc, "hybrid + LoRA + no_sync + checkpointed Blocks")
end

-- ---- optimizers under hybrid (an MLP whose shards cut rows and columns) -----------------------
if want_case("optim") then
  local opts = {strategy = "hybrid", shard_size = S, policy = fsdp.policy.size(600)}
  for _, kind in ipairs{"adafactor", "lion", "groups"} do
    local spec = function(k) return {rows = mlp_rows, steps = 6, clip = false, k = k} end
    local ref = plain_run(mlp, kind, spec())
    close(wrapped_run(mlp, opts, kind, spec()), ref, "hybrid + " .. kind)
    close(wrapped_run(mlp, opts, kind, spec(2)), ref, "hybrid + no_sync + " .. kind)
  end
end

-- ---- a checkpoint of hybrid + no_sync + frozen, resumed under full ---------------------------
if want_case("ckpt") then
  local build = function() return gpt("top") end
  local ref = plain_run(build, "adamw")
  local plain_hn = wrapped_run(build, hybrid(), "adamw", {k = 2})
  local after1
  local m = build()
  fsdp.wrap(m, hybrid())
  local opt = OPTS.adamw(m)
  local run = train{model = m, opt = opt, steps = 3, k = 2,
    micro = function(step, i, model)
      -- inside the accumulation (micro-batch 1's gradient held): parameters of step 1
      if step == 2 and i == 1 then fsdp.save(model, dir .. "/mid", {format = "sharded"}) end
    end,
    after = function(step, model)
      if step == 1 then after1 = values(model) end
      if step == 2 then fsdp.save(model, dir .. "/ck", {format = "sharded", optimizer = opt}) end
    end}
  same_bits(run, plain_hn, "hybrid + no_sync + frozen, saving twice, vs the same run without saving")
  close(run, ref, "hybrid + no_sync + frozen (saved)")

  local mid = build()
  fsdp.wrap(mid, {policy = BLOCK})
  fsdp.load(mid, dir .. "/mid")
  local got = values(mid)
  for i, e in ipairs(after1) do
    check(C.same(got[i][2], e[2]), "the checkpoint saved inside no_sync: " .. e[1])
  end

  local full = build()
  fsdp.wrap(full, {policy = BLOCK})
  local fopt = OPTS.adamw(full)
  fsdp.load(full, dir .. "/ck", {optimizer = fopt})
  local resumed = train{model = full, opt = fopt, from = 3, steps = 3}
  local l, r = resumed.losses[3], run.losses[3]
  check(math.abs(l - r) <= 1e-6 * math.abs(r),
    ("full shard resumed from hybrid + no_sync + frozen: step 3 loss %.9g, the run's %.9g"):format(l, r))
  local num, den = 0, 0
  for i, e in ipairs(run.values) do
    for j, v in ipairs(e[2]) do
      local d = resumed.values[i][2][j] - v
      num, den = num + d * d, den + v * v
    end
  end
  local dp = math.sqrt(num / den)
  check(dp <= TOL, ("full shard resumed: parameters after step 3 differ by %.2g"):format(dp))
  figures[#figures + 1] = {"resumed under full: step 3", math.abs(l - r) / math.abs(r), dp}
end

-- ---- "replicate" is "none" -------------------------------------------------------------------
if want_case("replicate") then
  local build = function() return gpt() end
  local r = wrapped_run(build, {strategy = "replicate", policy = BLOCK}, "adamw", {steps = 2})
  local n = wrapped_run(build, {strategy = "none", policy = BLOCK}, "adamw", {steps = 2})
  same_bits(r, n, "strategy replicate vs none")
  for _, u in ipairs(fsdp.units(r.model)) do eq(u:strategy(), "none", "replicate: " .. u.path) end
end

if rank == 0 then
  for _, f in ipairs(figures) do
    print(("%-52s loss %.2g  parameters %.2g"):format(f[1], f[2], f[3]))
  end
end
if C.failures() > 0 then error(("%d features_mix checks failed on rank %d"):format(C.failures(), rank)) end
say(("features_mix: ok at %d ranks (hybrid %d x %d)"):format(W, W / S, S))
