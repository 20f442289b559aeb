-- ckpt_agree.lua — fsdp.load is all or nothing across ranks (run by
-- tests/recipes/dist_ckpt_agree.sh at 1, 2 and 3 ranks). Every refused load must make EVERY
-- rank raise the same error (T.raises) and leave everything it would load as it was, on every
-- rank: the model, the optimizer (state, step count, learning rate), the schedule, the loader
-- positions and the random state.
--   * options that decide what is loaded differ across ranks (an optimizer, loaders, a
--     schedule, strict, rng, format given on some ranks only or unlike; a schedule with
--     load_problem on some ranks only): refused before anything is read, naming the option
--     and the ranks that differ (2 and 3 ranks);
--   * options refused on one rank only: every rank raises that rank's message;
--   * fsdp.save: a refusal on one rank, and loaders that served different batches on different
--     ranks, fail every rank and commit nothing;
--   * what the schedule and the random state take is checked while staging, before the
--     parameters are written: a lambda schedule whose function fails at the saved step (on
--     one rank, or all), a saved schedule with a number missing, a schedule given for a
--     checkpoint without one, a random state set_rng_state refuses; a schedule of the user's
--     own (no load_problem) that refuses the state on one rank: the ranks that took it go back.
--   fsdprun -n N tests/dist/ckpt_agree.lua --dir=TMPDIR
local fsdp = require "fsdp"
local T = dofile("tests/dist/ckpt_common.lua")
local core = fsdp.core
local nn = fsdp.nn
local dir = assert(fsdp.args.dir, "--dir=TMPDIR")
local rank, W = T.rank, T.W
local victim = W - 1 -- the rank that differs (the last; rank 0 itself at 1 rank)

-- steps of training on 6 rows (divisible by 1, 2 and 3 ranks), a schedule and a loader along
local function train(model, opt, sched, loader, steps)
  for step = 1, steps do
    local x, y = T.batch(step, 6)
    if sched then sched:step() end
    opt:zero_grad()
    nn.F.cross_entropy(model(x), y):backward()
    opt:step()
    if loader then loader.cursor = loader.cursor + 1 end
  end
end

-- the checkpoints: everything (good), a lambda schedule's (lam), no schedule (nosched)
local model = T.wrap(T.gpt(31))
local opt = fsdp.optim.AdamW(model, {lr = 1e-2})
local sched = fsdp.optim.cosine(opt, {warmup = 1, total = 20})
local loader = {cursor = 0}
train(model, opt, sched, loader, 2)
local good, lam, nosched = dir .. "/good", dir .. "/lam", dir .. "/nosched"
fsdp.save(model, good, {optimizer = opt, schedule = sched, loaders = {train = loader}})
fsdp.save(model, nosched, {optimizer = opt, loaders = {train = loader}})
local lsched = fsdp.optim.lambda(opt, function(k) return 0.01 / (k + 1) end)
lsched:step()
lsched:step()
fsdp.save(model, lam, {optimizer = opt, schedule = lsched})
local ref = T.values(model)

-- the target of the loads, trained a little so that any change shows; a lambda made for one
-- step on `victim` (its function fails after), and a schedule of the user's own (no kind, no
-- load_problem) that refuses the saved state on `victim`
local target = T.wrap(T.gpt(32))
local topt = fsdp.optim.AdamW(target, {lr = 1e-2})
local tlam = fsdp.optim.lambda(topt, function(k)
  if rank == victim and k > 1 then error("this lambda serves one step", 0) end
  return 0.02
end)
local tlam_all = fsdp.optim.lambda(topt, function(k)
  if k > 1 then error("this lambda serves one step", 0) end
  return 0.02
end)
local own = {k = 5}
function own:state_dict() return {step = self.k} end
function own:load_state_dict(sd)
  self.k = sd.step -- changed before refusing: the load must put it back
  if rank == victim then error("own schedule: refused", 0) end
end
local tsched = fsdp.optim.cosine(topt, {warmup = 1, total = 20})
local tloader = {cursor = 0}
train(target, topt, tsched, tloader, 1)

-- everything a load may change on this rank: the model's values (collective), the rest
local function snapshot()
  local rest = {rng = core.rng_state(), opt = T.opt_state(topt), step = topt.step_count,
    lr = topt.lr, sched = tsched:state_dict(), lam = tlam:state_dict(), own = own.k,
    cursor = tloader.cursor}
  return T.values(target), rest
end
local values_before, rest_before = snapshot()

local function untouched(what)
  local values, rest = snapshot()
  T.same_values(values, values_before, what .. ": model untouched")
  T.same_tables(rest, rest_before, what .. ": optimizer, schedules, loader, random state untouched")
end

local function base()
  return {optimizer = topt, schedule = tsched, loaders = {train = tloader}}
end

-- a load that must fail on every rank with the same message holding every pattern
local function refused(label, path, opts, patterns)
  local err = T.raises(function() fsdp.load(target, path, opts) end, nil, label)
  for _, pat in ipairs(patterns) do
    if not err:find(pat, 1, true) then
      error(("CHECK FAILED: %s: %q not in the error: %s"):format(label, pat, err))
    end
  end
  untouched(label)
  T.say(("ok: %s -> %s"):format(label, err))
end

local function differs(option, r0, rv)
  return {("fsdp.load: what to load differs across ranks at [\"%s\"]"):format(option),
    ("rank 0 has %s, rank %d has %s"):format(r0, victim, rv),
    ("(ranks that differ from rank 0: %d)"):format(victim)}
end

-- ---- options that differ across ranks -----------------------------------------------------------
if W > 1 then
  local mine = rank == victim
  local o = base()
  if rank ~= 0 then o.optimizer = nil end
  local others = {}
  for r = 1, W - 1 do others[#others + 1] = tostring(r) end
  refused("an optimizer on rank 0 only", good, o,
    {'what to load differs across ranks at ["optimizer"]: rank 0 has "AdamW", rank 1 has false',
      "(ranks that differ from rank 0: " .. table.concat(others, ", ") .. ")"})
  o = base()
  if mine then o.optimizer = fsdp.optim.SGD(target, {lr = 1}) end
  refused("an optimizer of another kind on one rank", good, o,
    differs("optimizer", '"AdamW"', '"SGD"'))
  o = base()
  if mine then o.loaders = nil end
  refused("loaders on some ranks only", good, o,
    {'what to load differs across ranks at ["loaders"][1]: rank 0 has "train", rank '
      .. victim .. ' has nil'})
  o = base()
  if mine then o.loaders = {other = tloader} end
  refused("loaders of other names on one rank", good, o,
    {'what to load differs across ranks at ["loaders"][1]: rank 0 has "train", rank '
      .. victim .. ' has "other"'})
  o = base()
  if mine then o.schedule = nil end
  refused("a schedule on some ranks only", good, o, differs("schedule", '"cosine"', "false"))
  o = base()
  if mine then o.schedule = tlam end
  refused("a schedule of another kind on one rank", good, o,
    differs("schedule", '"cosine"', '"lambda"'))
  o = base()
  if mine then o.schedule = own end -- no kind: it stands as true; no load_problem either
  refused("a schedule of the user's own on one rank", good, o,
    differs("schedule", '"cosine"', "true"))
  local own2 = {state_dict = own.state_dict, load_state_dict = own.load_state_dict}
  if rank ~= victim then own2.load_problem = function() return nil end end
  refused("a schedule with load_problem on some ranks only", good, {schedule = own2},
    differs("schedule_load_problem", "true", "false"))
  o = base()
  if mine then o.strict = false end
  refused("strict = false on one rank", good, o, differs("strict", "true", "false"))
  o = base()
  if mine then o.rng = false end
  refused("rng = false on one rank", good, o, differs("rng", "true", "false"))
  o = base()
  if mine then o.format = "sharded" end
  refused("format given on one rank", good, o, differs("format", "false", '"sharded"'))
  -- refused on one rank only: every rank raises that rank's message
  o = base()
  if mine then o.strict = "yes" end
  refused("options refused on one rank", good, o,
    {("rank %d of %d: fsdp.load: strict must be a boolean"):format(victim, W)})
  -- fsdp.save agrees the same way: a refusal on one rank fails every rank, nothing written
  T.raises(function()
    fsdp.save(model, dir .. "/half_step", {step = mine and -1 or 3})
  end, ("rank %d of %d: fsdp%%.save: step must be an integer >= 0"):format(victim, W),
    "a step refused on one rank")
  T.check(not core.io_size(dir .. "/half_step/index.json"), "the refused save wrote no index")
  T.say("ok: fsdp.save options refused on one rank fail every rank")
  -- loaders that served different batches on different ranks: one position cannot serve both
  local ahead = {cursor = mine and 3 or 2}
  T.raises(function()
    fsdp.save(model, dir .. "/apart", {loaders = {a = {cursor = 1}, train = ahead}})
  end, (("data loader 'train' has served 2 batches on rank 0 but 3 on rank %d: the checkpoint "
    .. "holds one position, which every rank resumes from"):format(victim)
    :gsub("[%(%)%.%-]", "%%%0")), "loaders apart")
  T.check(not core.io_size(dir .. "/apart/index.json"), "the refused save wrote no index")
  T.check(#core.io_listdir(dir .. "/apart") == 0, "the refused save left no rank's file")
  T.say("ok: fsdp.save refuses loaders at different positions on the ranks")
end

-- ---- what the schedule and the random state take: checked before anything is written ------------
local function where(path) return W > 1 and ("rank %d of %d: %s/index.json"):format(victim, W, path)
  or path .. "/index.json" end
refused("a lambda whose function fails at the saved step on one rank", lam,
  {optimizer = topt, schedule = tlam},
  {"fsdp.load: " .. where(lam), ": the schedule: the learning rate at step 2: "
    .. "this lambda serves one step"})
refused("a lambda whose function fails at the saved step on every rank", lam,
  {optimizer = topt, schedule = tlam_all},
  {"the schedule: the learning rate at step 2: this lambda serves one step"})
refused("a schedule for a checkpoint saved without one", nosched,
  {optimizer = topt, schedule = tsched, loaders = {train = tloader}},
  {nosched .. "/index.json: the checkpoint holds no schedule (saved without schedule =)"})

local function edited(label, edit)
  local d = dir .. "/case_" .. label:gsub("[^%w]", "_")
  if rank == 0 then
    core.io_mkdirs(d)
    for _, name in ipairs(core.io_listdir(good)) do
      T.write_file(d .. "/" .. name, T.read_file(good .. "/" .. name))
    end
    local idx = core.json_read(d .. "/index.json")
    edit(idx)
    core.ckpt_index_write(d .. "/index.json", idx)
  end
  fsdp.barrier()
  return d
end
local d = edited("no total", function(idx) idx.schedule.total = nil end)
refused("a saved schedule without its total", d, base(),
  {d .. "/index.json: the schedule: total must be a number >= 0 (got nil)"})
d = edited("bad rng", function(idx)
  for _, st in ipairs(idx.rng) do st.streams.randn = "0000000000000003" end
end)
refused("a random state set_rng_state refuses", d, base(),
  {d .. "/index.json: the random state: stream 'randn' offset 3 is not a multiple of 4"})
refused("a schedule of the user's own refusing the state on one rank", good,
  {optimizer = topt, schedule = own, loaders = {train = tloader}},
  {"fsdp.load: " .. (W > 1 and ("rank %d of %d: "):format(victim, W) or ""), good
    .. ": the schedule: own schedule: refused"})

-- ---- and a load that is not refused changes all of it -------------------------------------------
fsdp.load(target, good, base())
T.same_values(T.values(target), ref, "the loaded model")
T.check(topt.step_count == 2 and tsched.k == 2 and tloader.cursor == 2,
  ("the loaded optimizer, schedule and loader: steps %s, %s, cursor %s")
    :format(topt.step_count, tsched.k, tloader.cursor))
T.check(topt.lr == sched:lr(2), "the learning rate the loaded schedule sets")
if W > 1 then
  -- a schedule of the user's own that takes the state on every rank
  function own:load_state_dict(sd) self.k = sd.step end
  fsdp.load(target, good, {schedule = own})
  T.check(own.k == 2, "a schedule of the user's own takes the saved state")
end
T.say(("ok: ckpt_agree at %d ranks"):format(W))
