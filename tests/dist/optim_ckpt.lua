-- optim_ckpt.lua — optimizer state through sharded checkpoints at the edges of the layout
-- (tests/recipes/dist_optim_ckpt.sh). Every rank feeds the same batch, so a wrapped model at
-- N ranks trains as the plain model at 1 rank; each case checks the wrapped run against the
-- plain one made in the same process (local_only) and fails with an error when they differ.
--
--   fsdprun -n N tests/dist/optim_ckpt.lua --case=ada_save|ada_load|freeze|atomic --dir=D
--     [--opt=adamw|adafactor] [--plain=true] [--one_rank=true]
--
-- ada_save / ada_load: Adafactor over a Linear(4, 4) (16 + 4 elements: at 2 ranks one rank
--   holds the bias only, at 3 one holds padding only), saved after 2 steps at one world size
--   and resumed at another (or the same) for 2 more. A rank holding no slice of any factored
--   parameter imports no factor; the first step after the load completes the factors with an
--   all_reduce every rank must call. Checked: some rank holds no factored slice (the case is
--   what it claims), and the resumed run equals 4 uninterrupted plain steps. --one_rank=true:
--   first a load with the optimizer passed on rank 0 only, refused on every rank with nothing
--   changed (the ranks agree on what to load before anything is read).
-- freeze: a Sequential of two Linear units trained 2 steps with everything trainable, its
--   optimizer state restored into the model with the first unit frozen (fine-tuning the head),
--   then one step, the unit unfrozen, one more step; twice: through fsdp.save / fsdp.load into
--   a new model, and through opt:state_dict() / a new optimizer's load_state_dict. A plain
--   optimizer keeps a frozen parameter's state: the unfrozen unit's steps go on from it, so
--   both runs must equal the plain model's.
-- atomic: a checkpoint saved with an optimizer over every parameter, loaded with one over the
--   second Linear only (params =): refused on every rank with the parameter named, and the
--   model and the optimizer are left as they were (the refusal comes before anything is
--   written). --plain=true: the same on a plain model.
local fsdp = require "fsdp"
local nn = fsdp.nn
local a = fsdp.args
local C = dofile("tests/dist/common.lua")
local check = C.check

local case = assert(a.case, "--case=NAME")
local W, rank = fsdp.world_size(), fsdp.rank()

-- the gathered parameters of model as {path = flat values} (collective when wrapped)
local function values(model)
  local out = {}
  fsdp.full_params(model, function(m)
    for path, p in m:named_parameters() do out[path] = C.flat(p) end
  end, {writeback = false})
  return out
end

-- every parameter of got within tol (relative to the largest magnitude) of want's
local function close(got, want, tol, what)
  for path, w in pairs(want) do
    local g, worst, scale = got[path], 0, 1e-30
    check(g ~= nil and #g == #w, ("%s: %s missing or of another size"):format(what, path))
    if g then
      for k = 1, #w do
        worst = math.max(worst, math.abs(g[k] - w[k]))
        scale = math.max(scale, math.abs(w[k]))
      end
      check(worst <= tol * scale,
        ("%s: %s differs by %g (scale %g)"):format(what, path, worst, scale))
    end
  end
end

local function steps(model, opt, n, x)
  for _ = 1, n do
    opt:zero_grad()
    model(x):sum():backward()
    opt:step()
  end
end

if case == "ada_save" or case == "ada_load" then
  local dir = assert(a.dir, "--dir=D")
  local x = fsdp.tensor{{1, 2, 3, 4}, {-1, 0.5, 2, -3}}
  local function linear()
    fsdp.manual_seed(1)
    return nn.Linear(4, 4)
  end
  local m = linear()
  fsdp.wrap(m)
  local opt = fsdp.optim.Adafactor(m, {lr = 0.01})
  if case == "ada_save" then
    steps(m, opt, 2, x)
    fsdp.save(m, dir, {optimizer = opt})
  else
    local factored = 0
    for _, u in ipairs(fsdp.units(m)) do
      for _, s in ipairs(u:local_slices()) do
        if s.param:dim() >= 2 then factored = factored + 1 end
      end
    end
    if W > 1 then
      check(fsdp.all_reduce(factored, "min") == 0,
        "some rank should hold no slice of a factored parameter (the case this tests)")
    end
    if a.one_rank == true and W > 1 then
      -- the optimizer passed on rank 0 only: rank 0 alone would import the state (and its
      -- first step then complete the factors with an all_reduce the others never call)
      local before = values(m)
      local ok, err = pcall(fsdp.load, m, dir, {optimizer = rank == 0 and opt or nil})
      local want = 'fsdp.load: what to load differs across ranks at ["optimizer"]: rank 0 has '
        .. '"Adafactor", rank 1 has false'
      check(not ok and tostring(err):find(want, 1, true) ~= nil,
        ("an optimizer on rank 0 only: the refusal should say %q; it says %s")
          :format(want, tostring(err)))
      close(values(m), before, 0, "the model after a refused load")
      check(opt.step_count == 0 and next(opt:state_dict().state) == nil,
        "the optimizer after a refused load")
    end
    fsdp.load(m, dir, {optimizer = opt})
    steps(m, opt, 2, x)
    local plain = linear()
    steps(plain, fsdp.optim.Adafactor(plain, {lr = 0.01, local_only = true}), 4, x)
    close(values(m), values(plain), 1e-5, "Adafactor resumed at " .. W .. " ranks vs 4 plain steps")
    if rank == 0 and C.failures() == 0 then
      print(("ok: Adafactor resumed at %d ranks (factored slices here: %d)"):format(W, factored))
    end
  end
elseif case == "freeze" or case == "atomic" then
  local dir = assert(a.dir, "--dir=D")
  local plain_run = a.plain == true
  local x = fsdp.tensor{{1, 2, 3, 4, 5, 6, 7, 8}, {-1, 0.5, 2, -3, 1, 0, -2, 4}}
  local kind = a.opt or "adamw"
  local function make_opt(m, opts)
    opts.local_only = opts.local_only or plain_run
    if kind == "adafactor" then
      opts.lr = 0.01
      return fsdp.optim.Adafactor(m, opts)
    end
    opts.lr, opts.weight_decay = 0.01, 0.1
    return fsdp.optim.AdamW(m, opts)
  end
  local function build(wrapped)
    fsdp.manual_seed(1)
    local m = nn.Sequential{nn.Linear(8, 8), nn.Linear(8, 2)}
    if wrapped then fsdp.wrap(m, {policy = fsdp.policy.list{m[1], m[2]}}) end
    return m
  end
  if case == "freeze" then
    -- the plain reference: 2 steps, m[1] frozen for one, then unfrozen for one
    local ref = build(false)
    local ro = make_opt(ref, {local_only = true})
    steps(ref, ro, 2, x)
    ref[1]:freeze()
    steps(ref, ro, 1, x)
    ref[1]:unfreeze()
    steps(ref, ro, 1, x)
    local want = values(ref)
    -- fsdp.save, then fsdp.load into a new model whose first unit is frozen
    local m = build(true)
    local opt = make_opt(m, {})
    steps(m, opt, 2, x)
    fsdp.save(m, dir, {optimizer = opt})
    local m2 = build(true)
    m2[1]:freeze()
    local opt2 = make_opt(m2, {})
    fsdp.load(m2, dir, {optimizer = opt2})
    local sd = opt2:state_dict()
    for _, path in ipairs{"1.weight", "1.bias", "2.weight", "2.bias"} do
      -- a rank holding a slice of the parameter holds its state (frozen or not), at step 2
      local held = false
      for _, u in ipairs(fsdp.units(m2)) do
        for _, s in ipairs(u:local_slices()) do if s.path == path then held = true end end
      end
      local st = sd.state[path]
      check((st ~= nil) == held and (st == nil or st.step == 2),
        ("fsdp.load, %s frozen: the state of %s is %s (held here: %s)"):format("1", path,
          st and ("at step " .. tostring(st.step)) or "missing", tostring(held)))
    end
    steps(m2, opt2, 1, x)
    m2[1]:unfreeze()
    steps(m2, opt2, 1, x)
    close(values(m2), want, 1e-5, kind .. ": fsdp.load into a model with a frozen unit")
    -- opt:state_dict(), the unit frozen, a new optimizer's load_state_dict
    local m3 = build(true)
    local opt3 = make_opt(m3, {})
    steps(m3, opt3, 2, x)
    local sd3 = opt3:state_dict()
    m3[1]:freeze()
    local opt4 = make_opt(m3, {})
    opt4:load_state_dict(sd3)
    steps(m3, opt4, 1, x)
    m3[1]:unfreeze()
    steps(m3, opt4, 1, x)
    close(values(m3), want, 1e-5, kind .. ": load_state_dict after freezing a unit")
    if rank == 0 and C.failures() == 0 then
      print(("ok: %s state restored into a frozen unit at %d ranks"):format(kind, W))
    end
  else
    local m = build(not plain_run)
    local opt = make_opt(m, {})
    steps(m, opt, 2, x)
    fsdp.save(m, dir, {optimizer = opt})
    local m2 = build(not plain_run)
    local opt2 = make_opt(m2, {params = "^2%."})
    steps(m2, opt2, 1, x)
    local before, sd_before = values(m2), opt2:state_dict()
    local ok, err = pcall(fsdp.load, m2, dir, {optimizer = opt2})
    check(not ok, "loading state for parameters the optimizer does not update must fail")
    local want = "the optimizer's state: 1.weight: state for a parameter this optimizer does not "
      .. "update"
    check(not ok and tostring(err):find(want, 1, true) ~= nil,
      ("the refusal should say %q; it says %s"):format(want, tostring(err)))
    close(values(m2), before, 0, "the model after a refused load")
    local sd = opt2:state_dict()
    check(sd.step == sd_before.step, "the optimizer's step count after a refused load")
    for path, st in pairs(sd_before.state) do
      check(sd.state[path] ~= nil and sd.state[path].step == st.step,
        "the optimizer's state of " .. path .. " after a refused load")
    end
    if rank == 0 and C.failures() == 0 then
      print(("ok: a refused optimizer import changes nothing (%s, %d ranks)")
        :format(plain_run and "plain" or "wrapped", W))
    end
  end
else
  error("--case=ada_save|ada_load|freeze|atomic")
end
if C.failures() > 0 then error(("%d optim_ckpt checks failed"):format(C.failures())) end
