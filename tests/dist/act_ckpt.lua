-- Activation checkpointing of a wrapped model (tests/recipes/dist_act_ckpt.sh), at any world
-- size; every check on every rank. A GPT (tie = true) with Block units, trained 3 steps with
-- AdamW; "the same" means every loss and every final parameter bit for bit (C.run_lines).
--   * fsdp.wrap{checkpoint = modules{Block}} and {checkpoint = true} against no checkpointing,
--     for each strategy (full, grad_op, none), with and without dropout: the same, and the same
--     all-gather bytes (the recomputation uses the gather of backward, never one of its own)
--   * an MLP checkpointed inside each Block unit; a Block checkpointed around MLP units (the
--     recomputation gathers those units once more, exactly, and prefetches nothing: the same
--     results)
--   * mixed precision (mp = "bf16") and a pruning mask (prune.magnitude on the wrapped model,
--     masked weights still 0): the same
--   * activation memory: the peak of a step drops (deterministic counters)
--   * unwrap removes the marks wrap set and keeps those nn.checkpoint set; an inner wrap's marks
--     stay when an outer wrap absorbs it
--   * errors: a bad checkpoint option; a listed module outside the model; ranks that disagree
--     on what to checkpoint (more than one rank); a backward after fsdp.unwrap (f32 and bf16)
--   fsdprun -n N tests/dist/act_ckpt.lua
local fsdp = require "fsdp"
local nn = fsdp.nn
local core = fsdp.core
local W, rank = fsdp.world_size(), fsdp.rank()

local C = dofile("tests/dist/common.lua")
local check, flat = C.check, C.flat

local function say(...) if rank == 0 then print(...) end end
local BLOCK = fsdp.policy.modules{nn.Block}
local MLP = fsdp.policy.modules{nn.MLP}
local CFG = {vocab = 32, ctx = 8, d = 16, layers = 2, heads = 2}

local function gpt(over)
  fsdp.manual_seed(3)
  local c = {}
  for k, v in pairs(CFG) do c[k] = v end
  for k, v in pairs(over or {}) do c[k] = v end
  return nn.GPT(c)
end

-- this rank's rows of a 4-row global batch (a formula), i64 ids
local ROWS = 4
assert(ROWS % W == 0, "4 rows must divide among the ranks")
local function batch(step)
  local x, y = {}, {}
  for i = rank * ROWS / W + 1, (rank + 1) * ROWS / W do
    local xi, yi = {}, {}
    for t = 1, CFG.ctx do
      local v = (i * 7 + t * 3 + step * 5 + (i * t) % 5) % 32
      xi[t], yi[t] = v, (v * 3 + t) % 32
    end
    x[#x + 1], y[#y + 1] = xi, yi
  end
  return fsdp.tensor(x, {dtype = "i64"}), fsdp.tensor(y, {dtype = "i64"})
end

-- Train `model` (wrapped by the caller) 3 steps: its run as lines, the all-gather bytes of the
-- steps, and the peak of activation bytes over them.
local function train(model, prepare)
  if prepare then prepare(model) end
  local opt = fsdp.optim.AdamW(model, {lr = 1e-2})
  local losses = {}
  fsdp.reset_comm_stats()
  local peak = 0
  for s = 1, 3 do
    -- what the previous step left for the collector goes first: the peak is this step's
    collectgarbage()
    collectgarbage()
    core.reset_peak()
    local base = core.memory().cpu.activations or 0
    fsdp.manual_seed(100 + s) -- the dropout masks of step s, whatever ran before
    local x, y = batch(s)
    opt:zero_grad()
    local loss = nn.F.cross_entropy(model(x), y)
    loss:backward()
    opt:step()
    losses[s] = fsdp.all_reduce(loss:item(), "mean")
    peak = math.max(peak, (core.memory().cpu.peak_activations or 0) - base)
  end
  local gathered = fsdp.comm_stats().all_gather_bytes
  check(core.tape_size() == 0, "the tape is empty after the steps")
  return C.run_lines(losses, model), gathered, peak
end

local function first_diff(a, b)
  for i = 1, math.max(#a, #b) do
    if a[i] ~= b[i] then return ("line %d: %s | %s"):format(i, tostring(a[i]):sub(1, 80), tostring(b[i]):sub(1, 80)) end
  end
end

local function same_run(a, b, what)
  local d = first_diff(a, b)
  check(d == nil, what .. ": differs at " .. tostring(d))
end

-- ---- every strategy, with and without dropout ----------------------------------------------
for _, strategy in ipairs{"full", "grad_op", "none"} do
  for _, dropout in ipairs{0, 0.1} do
    local what = ("%s, dropout %g"):format(strategy, dropout)
    local ref, ref_bytes, ref_peak = train(fsdp.wrap(gpt{dropout = dropout}, {policy = BLOCK, strategy = strategy}))
    for _, ck in ipairs{{BLOCK, "checkpoint = modules{Block}"}, {true, "checkpoint = true"},
        {MLP, "checkpoint = modules{MLP}"}} do
      local m = fsdp.wrap(gpt{dropout = dropout}, {policy = BLOCK, strategy = strategy, checkpoint = ck[1]})
      for i = 1, CFG.layers do
        local marked = ck[1] == MLP and m.blocks[i].mlp or m.blocks[i]
        check(nn.is_checkpointed(marked), what .. ", " .. ck[2] .. ": block " .. i .. " marked")
      end
      local run, bytes, peak = train(m)
      same_run(ref, run, what .. ", " .. ck[2])
      check(bytes == ref_bytes, ("%s, %s: all-gather bytes %d, %d without"):format(what, ck[2], bytes, ref_bytes))
      check(peak < ref_peak, ("%s, %s: peak activations %d, %d without"):format(what, ck[2], peak, ref_peak))
      fsdp.unwrap(m)
      check(not nn.is_checkpointed(m.blocks[1]) and not nn.is_checkpointed(m.blocks[1].mlp),
        what .. ", " .. ck[2] .. ": unwrap removes the marks")
    end
  end
end
say("ok: every strategy, with and without dropout: checkpointed runs are bitwise the plain ones, "
  .. "with the same all-gather bytes and a lower activation peak")

-- ---- units inside a checkpointed region -------------------------------------------------------
do
  local ref, ref_bytes = train(fsdp.wrap(gpt{dropout = 0.1}, {policy = MLP}))
  local m = fsdp.wrap(gpt{dropout = 0.1}, {policy = MLP, checkpoint = BLOCK})
  local run, bytes = train(m)
  same_run(ref, run, "MLP units in checkpointed Blocks")
  -- one more gather of every MLP unit per step, and nothing else (no forward prefetch while
  -- recomputing)
  local once = 0
  for _, u in ipairs(fsdp.units(m)) do
    if u.path ~= "(root)" then
      fsdp.reset_comm_stats()
      u:gather()
      once = once + fsdp.comm_stats().all_gather_bytes
      u:reshard()
    end
  end
  check(once > 0 and bytes == ref_bytes + 3 * once, ("MLP units in checkpointed Blocks: the "
    .. "recomputation gathers them once more (%d all-gather bytes, %d without, %d a gather of the "
    .. "MLP units)"):format(bytes, ref_bytes, once))
  say("ok: units inside a checkpointed region are gathered again for the recomputation")
end

-- ---- mixed precision and masks ------------------------------------------------------------------
do
  local ref = train(fsdp.wrap(gpt{dropout = 0.1}, {policy = BLOCK, mp = "bf16"}))
  local run = train(fsdp.wrap(gpt{dropout = 0.1}, {policy = BLOCK, mp = "bf16", checkpoint = BLOCK}))
  same_run(ref, run, "mp = bf16")
  local function prune(m)
    fsdp.prune.magnitude(m, {params = "attn%.qkv%.weight", sparsity = 0.5})
  end
  ref = train(fsdp.wrap(gpt(), {policy = BLOCK}), prune)
  local m = fsdp.wrap(gpt(), {policy = BLOCK, checkpoint = BLOCK})
  run = train(m, prune)
  same_run(ref, run, "pruning mask")
  local mask = flat(fsdp.mask(m.blocks[1].attn.qkv.weight))
  local zeros, bad = 0, 0
  fsdp.full_params(m, function(mm)
    local w = flat(mm.blocks[1].attn.qkv.weight)
    for j = 1, #mask do
      if mask[j] == 0 then
        zeros = zeros + 1
        if w[j] ~= 0 then bad = bad + 1 end
      end
    end
  end, {writeback = false})
  check(zeros > 0 and bad == 0, ("pruning mask: %d masked weights, %d of them nonzero"):format(zeros, bad))
  say("ok: mp = bf16 and a pruning mask: checkpointed runs are bitwise the plain ones")
end

-- ---- marks: unwrap, absorbed inner wraps ----------------------------------------------------------
do
  local m = gpt()
  nn.checkpoint(m.blocks[2]) -- the user's own mark
  fsdp.wrap(m, {policy = BLOCK, checkpoint = BLOCK})
  check(nn.is_checkpointed(m.blocks[1]) and nn.is_checkpointed(m.blocks[2]), "both blocks marked")
  fsdp.unwrap(m)
  check(not nn.is_checkpointed(m.blocks[1]), "unwrap removes the mark wrap set")
  check(nn.is_checkpointed(m.blocks[2]), "unwrap keeps the mark nn.checkpoint set")
  nn.checkpoint(m.blocks[2], {enabled = false})
  -- an inner wrap's checkpoints stay when an outer wrap absorbs it
  fsdp.wrap(m.blocks[1], {checkpoint = MLP})
  check(nn.is_checkpointed(m.blocks[1].mlp), "the inner wrap marks its MLP")
  fsdp.wrap(m, {policy = BLOCK})
  check(nn.is_checkpointed(m.blocks[1].mlp), "the outer wrap keeps the inner wrap's mark")
  check(not nn.is_checkpointed(m.blocks[2].mlp), "and marks nothing else")
  fsdp.unwrap(m)
  check(not nn.is_checkpointed(m.blocks[1].mlp), "unwrapping the outer wrap removes it")
  say("ok: unwrap removes the marks wrap set, keeps the user's; absorbed wraps keep theirs")
end

-- ---- errors ------------------------------------------------------------------------------------
local function errs(fn)
  local ok, err = pcall(fn)
  return not ok, tostring(err)
end

do
  local m = gpt()
  local bad, err = errs(function() fsdp.wrap(m, {policy = BLOCK, checkpoint = 5}) end)
  check(bad and err:find("fsdp.wrap: checkpoint must be fsdp.policy.modules{...}, .size(n), "
    .. ".list{...}, a function(module, path, numel) or true (got number)", 1, true) ~= nil,
    "checkpoint = 5 is refused: " .. err)
  check(not fsdp.is_wrapped(m), "a refused wrap leaves the model plain")
  bad, err = errs(function()
    fsdp.wrap(m, {policy = BLOCK, checkpoint = fsdp.policy.list{nn.Linear(2, 2)}})
  end)
  check(bad and err:find("fsdp.wrap: checkpoint: module 1 of fsdp.policy.list (Linear) is not "
    .. "below the wrapped model's root", 1, true) ~= nil, "a listed module outside the model: " .. err)
  check(not fsdp.is_wrapped(m), "a refused wrap leaves the model plain")
  if W > 1 then
    bad, err = errs(function()
      fsdp.wrap(m, {policy = BLOCK, checkpoint = rank == 0 and BLOCK or nil})
    end)
    check(bad and err:find("checkpoint blocks.1", 1, true) ~= nil,
      "ranks that checkpoint different modules fail the wrap, naming the first: " .. err)
    check(not fsdp.is_wrapped(m) and not nn.is_checkpointed(m.blocks[1]),
      "a refused wrap marks nothing")
  end
  -- the size policy and a plain function pick modules like wrap policies do
  fsdp.wrap(m, {policy = BLOCK, checkpoint = function(mod) return nn.isinstance(mod, nn.CausalSelfAttention) end})
  check(nn.is_checkpointed(m.blocks[2].attn) and not nn.is_checkpointed(m.blocks[2]), "a function picks")
  fsdp.unwrap(m)
  fsdp.wrap(m, {policy = BLOCK, checkpoint = fsdp.policy.size(3000)})
  check(nn.is_checkpointed(m.blocks[1]) and not nn.is_checkpointed(m.blocks[1].mlp)
    and not nn.is_checkpointed(m.blocks), "size(3000) picks the blocks, not the ModuleList")
  fsdp.unwrap(m)
  say("ok: errors name the option; ranks must agree on what they checkpoint")
end

-- ---- a model unwrapped between a forward and its backward ------------------------------------
-- The recomputation would run on the dense f32 parameters (under mp, on the forward's bf16
-- activations: a dtype error inside a layer); it is refused first, naming what happened, as the
-- unit's hooks refuse it without checkpointing. Every rank alike; the model trains afterwards.
for _, mp in ipairs{"f32", "bf16"} do
  local m = fsdp.wrap(gpt(), {policy = BLOCK, mp = mp, checkpoint = BLOCK})
  local x, y = batch(1)
  local loss = nn.F.cross_entropy(m(x), y)
  fsdp.unwrap(m)
  local bad, err = errs(function() loss:backward() end)
  check(bad and err:find("backward of checkpoint: blocks.2 (Block): the model was unwrapped "
    .. "(fsdp.unwrap) after the forward that recorded this graph, so unit 'blocks.2' holds none "
    .. "of its parameters any more: run the forward again", 1, true) ~= nil,
    mp .. ": backward after unwrap is refused by name: " .. err)
  check(core.tape_size() == 0, mp .. ": the failed backward leaves no graph")
  fsdp.wrap(m, {policy = BLOCK, mp = mp, checkpoint = BLOCK})
  loss = nn.F.cross_entropy(m(x), y)
  loss:backward()
  local opt = fsdp.optim.AdamW(m, {lr = 1e-2})
  opt:step()
  check(core.tape_size() == 0, mp .. ": the re-wrapped model trains")
  fsdp.unwrap(m)
end
say("ok: a backward after unwrap is refused with the unwrap named, mixed precision too")

if C.failures() > 0 then error(("%d activation checkpointing checks failed"):format(C.failures())) end
say(("all activation checkpointing checks passed at %d rank(s)"):format(W))
