-- fsdp.optim — optimizers, gradient clipping, learning-rate schedules and loss scaling.
-- See docs/nn.md ("optim").
--
-- Optimizers (SGD, Adam, AdamW, Lion, Adafactor) keep per-parameter state tensors, created
-- lazily on the first step that sees a gradient. SGD and AdamW update each parameter with one
-- fused C kernel call (core.sgd_step / core.adamw_step); Nesterov, Adam's L2 term, Lion and
-- Adafactor are compositions of tensor operations: no per-element Lua either way. State is
-- keyed by the parameter object, whose identity is stable (invariant 1, docs/ARCHITECTURE.md),
-- and reported by parameter path. Parameter groups (patterns on paths) give parameters their
-- own hyper-parameters (Optimizer:hp); the default group exempts 1-D parameters from decay.
--
-- Sharded models (docs/fsdp.md "Optimizers on shards"). When the model given to an optimizer
-- is a wrapped root (fsdp.wrap) or a module of one, the optimizer never touches parameters:
-- each step walks the units (construction order) and, for each slice of this rank's flat
-- shard (u:local_slices()) of a parameter it updates, runs the same update on the slice of the
-- shard and of the gradient shard, with state tensors of the slice's size (role optim). The
-- elementwise optimizers then equal the dense update restricted to the slice; Adafactor adds up
-- its row and column statistics over the ranks (its section says how).
-- A parameter that received no gradient on any rank (u:has_grad, agreed by one all_reduce per
-- step: the step is collective) is skipped as a plain optimizer skips a nil p.grad.
-- State is keyed by the parameter object; state_dict reports it per path with the slice's
-- position (param_first, numel) so a sharded state is self-describing. clip_grad_norm sums
-- squares over the local grad shards and needs one all_reduce (collective).
--
-- Masks (lua/fsdp/mask.lua, docs/pruning.md): a parameter with
-- a mask has its gradient (shard slice) masked before the update kernel and its weights (shard
-- slice) masked after it, so a pruned weight stays exactly 0 through momentum, Adam moments and
-- weight decay; clip_grad_norm masks gradients before measuring them.

local core = require "fsdp.core"
local mask = require "fsdp.mask"
local state = require "fsdp.state"
local util = require "fsdp.util"

local optim = {}

local raise, is_module = util.raise, util.is_module

-- p.grad and whether this call made its Lua value: the plain paths free such a value when done,
-- so a gradient zero_grad drops is freed then, not when Lua's collector finds the value.
local grad_of = core.grad_of

-- The Root (lua/fsdp/state.lua) of model when it is a wrapped root, else nil. A module inside
-- a wrapped model (not its root), or an array holding sharded parameters, is an error: fn (the
-- caller, named in messages) must see the whole wrapped model to find the shards.
local function wrap_state(fn, x)
  if is_module(x) then
    local R = state.of(x)
    if R ~= nil and R:model() ~= x then
      raise(("%s: this %s is part of a wrapped model: pass the wrapped root (a %s)")
        :format(fn, x:type_name(), R:model():type_name()))
    end
    return R
  end
  if type(x) ~= "table" then -- named_params' message would not say which function
    raise(("%s: expected a module or an array of parameters (got %s)"):format(fn, type(x)))
  end
  for i, p in ipairs(x) do
    if type(p) ~= "userdata" then
      raise(("%s: parameter %d is not a tensor (got %s)"):format(fn, i, type(p)))
    end
    if core.param_unit(p) ~= nil then
      raise(("%s: parameter %d is sharded (its model is wrapped): pass the wrapped model "
        .. "itself"):format(fn, i))
    end
  end
  return nil
end
optim.wrap_state = wrap_state

local slice_mask, mask_dense = mask.shard_slice, mask.apply_plain

-- The wrapped model's units (construction order), checking the wrap is still the one the
-- optimizer was made for.
local function live_units(R, what)
  if not R:is_live() then
    raise(what .. ": the model was unwrapped (or re-wrapped) after this optimizer was created; "
      .. "create a new optimizer")
  end
  return R:units()
end

-- Calls fn(u, shard, grad_shard, slices) per unit of the wrapped model, construction order;
-- a unit whose parameters are all frozen (requires_grad false) has no gradient shard and is
-- left out.
local function each_unit(R, what, fn)
  for _, u in ipairs(live_units(R, what)) do
    if u:trainable() then fn(u, u:shard(), u:grad_shard(), u:local_slices()) end
  end
end

-- This rank's slice of every parameter of the wrapped model, frozen units included (a load
-- restores their state too, as a plain optimizer keeps a frozen parameter's state, for when it
-- is unfrozen): {[param] = {param_first =, numel =}} (param_first 1-based, as slice_of); a
-- parameter this rank holds nothing of is absent. Reads the layout only: no gradient shard is
-- made.
local function rank_slices(R, what)
  local out = {}
  for _, u in ipairs(live_units(R, what)) do
    for _, s in ipairs(u:local_slices()) do
      out[s.param] = {param_first = s.param_first, numel = s.shard_last - s.shard_first + 1}
    end
  end
  return out
end

-- A step writes the shards. A unit still gathered (the root, or a grad_op unit, after a
-- forward whose backward has not run) would go on computing with the values from before the
-- step, and unwrap or a save would take them: every unit is resharded first (a backward still
-- to come gathers again). A unit whose gathered copy was changed (a parameter written in place
-- while gathered) has made agree_grads fail on every rank before this, and nothing is updated.
local function reshard_for_step(R, what)
  for _, u in ipairs(live_units(R, what)) do u:reshard() end
end

-- Collective (wrapped model, world size > 1). Which parameters received a gradient since
-- zero_grad on ANY rank -> {[U] = {[i] = true | nil}} (i as u:has_grad(i) and slice.index).
-- Each unit knows it for this rank only (a parameter used on some ranks' rows only, an expert
-- that got tokens on one rank); the gradient shard averages every rank's gradient, so the
-- parameter has one if any rank gave it one. One all_reduce("max") of one float per parameter
-- of every unit: issued on every step whatever the flags (the decision to communicate may
-- depend only on what every rank shares). World size 1: no communication.
local function agree_grads(R, what)
  local units = live_units(R, what)
  local flags, n = {}, 0
  for _, u in ipairs(units) do
    -- 2: the unit's gathered copy was changed on this rank (a step must not go on: see
    -- reshard_for_step); it rides on the same max, so every rank learns it at no cost
    local dirty = u:dirty()
    for i = 1, #u:paths() do
      n = n + 1
      flags[n] = dirty and 2 or (u:has_grad(i) and 1 or 0)
    end
  end
  if n > 0 and core.world_size() > 1 then
    local t = core.tensor(flags)
    flags = core.all_reduce(t, "max", "optim.has_grad"):totable()
    t:free() -- freed now rather than by Lua's collector: fsdp.memory() stays exact
  end
  local has, k = {}, 0
  for _, u in ipairs(units) do
    local h = {}
    for i = 1, #u:paths() do
      k = k + 1
      if flags[k] == 2 then raise(what .. ": " .. state.changed_error(u.path)) end
      if flags[k] ~= 0 then h[i] = true end
    end
    has[u] = h
  end
  return has
end

-- named_params(model_or_params) -> array of {path =, param =} in traversal order. A module
-- gives its distinct parameters under their first paths; an array of parameters gives paths
-- "1", "2", ... (duplicates dropped).
function optim.named_params(x)
  local out = {}
  if is_module(x) then
    for path, p in x:named_parameters() do out[#out + 1] = {path = path, param = p} end
    return out
  end
  if type(x) ~= "table" then
    raise(("expected a module or an array of parameters (got %s)"):format(type(x)))
  end
  local seen = {}
  for i, p in ipairs(x) do
    if type(p) ~= "userdata" then
      raise(("parameter %d is not a tensor (got %s)"):format(i, type(p)))
    end
    if not seen[p] then
      seen[p] = true
      out[#out + 1] = {path = tostring(i), param = p}
    end
  end
  return out
end

-- Optimizer state buffers: zeros shaped like p (one place, so accounting can tag them), on
-- p's device.
local function state_zeros(p)
  return core.zeros(p:shape(), { role = "optim", device = p.device })
end

-- n zeros for a slice of p's state, where p's unit keeps its shards (p's device when plain).
local function slice_zeros(p, n)
  local u = core.param_unit(p)
  return core.zeros({n}, { role = "optim", device = u and u:shard().device or p.device })
end

-- opts[k] (default when nil): a number, not NaN, >= min and <= max where given; errors name
-- fn (the function given opts).
local function number_opt(fn, opts, k, default, min, max)
  local v = opts[k]
  if v == nil then v = default end
  if type(v) ~= "number" or v ~= v or (min and v < min) or (max and v > max) then
    local range = max and (" in [%s, %s]"):format(min, max) or min and (" >= " .. min) or ""
    raise(("%s: %s must be a number%s (got %s)"):format(fn, k, range, tostring(v)))
  end
  return v
end

-- ---- the common optimizer part -------------------------------------------------------------

local Optimizer = {}
Optimizer.__index = Optimizer

-- A parameter frozen by the user (p.requires_grad = false) is never updated.
local function frozen(p) return p.requires_grad == false end

-- The options every optimizer takes besides its hyper-parameters.
local COMMON_OPTS = {"groups", "local_only", "max_grad_norm", "no_decay", "params"}

-- The L2 norm of gradient pieces taken as one vector: pieces = array of {g, u} (u the unit of a
-- wrapped model's gradient-shard slice g, nil for a plain gradient), squares summed in order.
-- Wrapped (R given; collective): one all_reduce("sum") of this rank's share; units with
-- strategy "none" hold the same averaged gradient on every rank, so theirs is added after it,
-- once; a hybrid unit's shard counts on its first replica group only (util.counts_shard).
local function grad_norm(R, pieces)
  local sq_sharded, sq_replicated = 0, 0
  for _, e in ipairs(pieces) do
    local sq = core.sumsq(e[1])
    local u = e[2]
    if u and u:strategy() == "none" then
      sq_replicated = sq_replicated + sq
    elseif not u or util.counts_shard(u) then
      sq_sharded = sq_sharded + sq
    end
  end
  if R then return math.sqrt(core.all_reduce(sq_sharded, "sum") + sq_replicated) end
  return math.sqrt(sq_sharded)
end

-- Clipping's coefficient for a total norm (PyTorch's clip_grad_norm_): max_norm / (total +
-- 1e-6) where that is below 1, else nil (no scaling). An infinite norm gives 0 (finite
-- elements become 0, infinite ones NaN, as in PyTorch); a NaN norm scales nothing.
local function clip_coef(max_norm, total)
  local coef = max_norm / (total + 1e-6)
  if coef < 1 then return coef end
  return nil
end

-- Does a group's `params` (a Lua pattern, a list of them, a function(path, p) -> boolean, or an
-- array of parameters) take the parameter p at path? sel is the checked form (select_of).
local function selects(sel, path, p)
  if sel.fn then return sel.fn(path, p) and true or false end
  if sel.set then return sel.set[p] == true end
  for _, pat in ipairs(sel.patterns) do
    if path:find(pat) then return true end
  end
  return false
end

-- The checked form of a `params` value (what names it in messages): {fn =} | {set =} |
-- {patterns =}. A pattern that matches no parameter of entries is an error listing them.
local function select_of(v, fn, what, entries)
  if type(v) == "function" then return {fn = v} end
  if type(v) == "table" and #v > 0 and type(v[1]) == "userdata" then
    local set = {}
    for i, p in ipairs(v) do
      if type(p) ~= "userdata" then
        raise(("%s: %s[%d] must be a parameter (got %s)"):format(fn, what, i, type(p)))
      end
      set[p] = true
    end
    local known = {}
    for _, e in ipairs(entries) do known[e.param] = true end
    for i, p in ipairs(v) do
      if not known[p] then
        raise(("%s: %s[%d] is not a parameter of this model"):format(fn, what, i))
      end
    end
    return {set = set}
  end
  local pats = util.patterns(v, what, fn)
  if pats == nil then raise(fn .. ": " .. what .. " is required (a Lua pattern, a list of them, a function "
    .. "(path, p) or an array of parameters)") end
  for _, pat in ipairs(pats) do
    local ok, hit = pcall(function()
      for _, e in ipairs(entries) do
        if e.path:find(pat) then return true end
      end
      return false
    end)
    if not ok then raise(("%s: %s: bad pattern %q: %s"):format(fn, what, pat, tostring(hit))) end
    if not hit then
      local names = {}
      for i, e in ipairs(entries) do names[i] = e.path end
      raise(("%s: %s: the pattern %q matches no parameter; the parameters are: %s")
        :format(fn, what, pat, util.few(names, 12)))
    end
  end
  return {patterns = pats}
end

-- Which parameters an optimizer updates: (Root or nil, array of {path =, param =}).
-- A wrapped root gives all its parameters; a module inside a wrapped model gives its own, under
-- their paths from the root (the optimizer steps their slices of the root's shards); a plain
-- module or an array of plain parameters gives optim.named_params.
local function select_params(kind, x)
  if is_module(x) then
    local R = state.of(x)
    if R == nil then return nil, optim.named_params(x) end
    local all = optim.named_params(R:model())
    if R:model() == x then return R, all end
    local mine, out = {}, {}
    for _, p in ipairs(x:parameters()) do mine[p] = true end
    for _, e in ipairs(all) do
      if mine[e.param] then out[#out + 1] = e end
    end
    return R, out
  end
  if type(x) ~= "table" then -- named_params' message would not say which optimizer
    raise(("%s: expected a module or an array of parameters (got %s)"):format(kind, type(x)))
  end
  if type(x) == "table" then
    for i, p in ipairs(x) do
      if type(p) ~= "userdata" then
        raise(("%s: parameter %d is not a tensor (got %s)"):format(kind, i, type(p)))
      end
      if type(p) == "userdata" and core.param_unit(p) ~= nil then
        raise(("%s: parameter %d is sharded (its model is wrapped): give the optimizer the "
          .. "wrapped model, or a module of it, and choose parameters with params = {...} "
          .. "(patterns or the parameters themselves)"):format(kind, i))
      end
    end
  end
  return nil, optim.named_params(x)
end

-- Parameters with fewer than 2 dimensions (biases, norm scales and shifts) get no weight decay.
function optim.default_no_decay(path, p) return p:dim() < 2 end

-- The hyper-parameters a group may set: hyper[kind] = names, read by read_hyper[kind].
local HYPER = {}

-- kind's optimizer over model with opts (checked: COMMON_OPTS and HYPER[kind]); read(fn, t,
-- base) checks t's hyper-parameters (base: the defaults) and returns them; defaults: the
-- optimizer's defaults. decay_default: whether the no-decay group (optim.default_no_decay,
-- weight_decay = 0) is added when neither groups nor no_decay is given.
-- The optimizers made over each wrapped model (weak both ways): unwrapping drops their state,
-- which belongs to the shards that unwrap drops (docs/fsdp.md: gradient shards and optimizer
-- states are dropped), so that it goes with the next collection even while the optimizer object
-- lives on (a buffer a state_dict handed out stays valid while it is held); such an optimizer
-- refuses to step afterwards (live_units).
local optimizers_of = setmetatable({}, {__mode = "k"})

state.on("teardown", function(R)
  for opt in pairs(optimizers_of[R] or {}) do opt.state, opt.slice_of = {}, {} end
  optimizers_of[R] = nil
end)

local function new_optimizer(cls, kind, model, opts, read, defaults, decay_default)
  if opts ~= nil and type(opts) ~= "table" then
    raise(("%s: expects an options table {lr = ...} (got %s)"):format(kind, type(opts)))
  end
  opts = opts or {}
  local names = {}
  for _, k in ipairs(COMMON_OPTS) do names[#names + 1] = k end
  for _, k in ipairs(HYPER[kind]) do names[#names + 1] = k end
  util.check_opts(kind, opts, names)
  local self = setmetatable({}, cls)
  self.kind = kind
  self.model = model
  local R, entries = select_params(kind, model)
  local n_all = R and #optim.named_params(R:model()) or #entries
  self.wrapped = R                        -- the wrap root state: step the shards
  if R then
    optimizers_of[R] = optimizers_of[R] or setmetatable({}, {__mode = "k"})
    optimizers_of[R][self] = true
  end
  if opts.params ~= nil then
    local sel = select_of(opts.params, kind, "params", entries)
    local out = {}
    for _, e in ipairs(entries) do
      if selects(sel, e.path, e.param) then out[#out + 1] = e end
    end
    entries = out
  end
  self.params = entries                   -- {path, param}, fixed at construction
  self.subset = #entries < n_all          -- wrapped: part of the model's parameters
  self.member = {}
  for _, e in ipairs(entries) do self.member[e.param] = true end
  self.state = {}                         -- param -> {step =, <buffers>}
  self.slice_of = {}
  self.step_count = 0
  if opts.local_only ~= nil and type(opts.local_only) ~= "boolean" then
    raise(("%s: local_only must be a boolean (got %s)"):format(kind, tostring(opts.local_only)))
  end
  self.local_only = opts.local_only == true
  if opts.max_grad_norm ~= nil then
    if cls.clip_unsupported then raise(("%s: %s"):format(kind, cls.clip_unsupported)) end
    local v = opts.max_grad_norm
    if type(v) ~= "number" or not (v > 0) or v == math.huge then
      raise(("%s: max_grad_norm must be a finite number > 0 (got %s)"):format(kind, tostring(v)))
    end
    self.max_grad_norm = v -- each step clips (each_update); the norm lands in self.grad_norm
  end
  for k, v in pairs(read(kind, opts, defaults)) do self[k] = v end
  -- groups: the first group whose params select a parameter gives it its hyper-parameters;
  -- the others follow the optimizer's (self[k], read at every step)
  local groups = opts.groups
  if groups ~= nil and (type(groups) ~= "table" or (next(groups) ~= nil and #groups == 0)) then
    raise(("%s: groups must be an array of {params = PATTERNS, <hyper-parameters>} (got %s)")
      :format(kind, type(groups)))
  end
  local list = {}
  if opts.no_decay ~= nil then
    if type(opts.no_decay) ~= "function" then
      raise(("%s: no_decay must be a function(path, p) -> true to exempt p from weight decay")
        :format(kind))
    end
    list[1] = {params = opts.no_decay, weight_decay = 0}
  elseif groups == nil and decay_default then
    list[1] = {params = optim.default_no_decay, weight_decay = 0}
  end
  for _, g in ipairs(groups or {}) do list[#list + 1] = g end
  self.groups = {}
  self.group_of = {} -- param -> its group's overrides (absent: the optimizer's own)
  local base = {}
  for _, k in ipairs(HYPER[kind]) do base[k] = self[k] end
  for i, g in ipairs(list) do
    local what = ("%s: group %d"):format(kind, i - (#list - #(groups or {})))
    if type(g) ~= "table" then raise(("%s must be a table {params =, ...}"):format(what)) end
    local gnames = {"params"}
    for _, k in ipairs(HYPER[kind]) do gnames[#gnames + 1] = k end
    util.check_opts(what, g, gnames)
    local given = {}
    for k in pairs(g) do if k ~= "params" then given[k] = true end end
    local vals = read(what, g, base)
    local over = {}
    for k in pairs(given) do over[k] = vals[k] end
    if over.lr ~= nil then
      -- schedules set opt.lr: a group's lr scales with it (PyTorch's schedulers scale every
      -- group's lr by one factor)
      if self.lr == 0 then raise(what .. ": a group's lr needs the optimizer's lr > 0 (its scale)") end
      over.lr_scale = over.lr / self.lr
      over.lr = nil
    end
    local sel = select_of(g.params, what, "params", entries)
    local grp = {over = over, paths = {}}
    self.groups[#self.groups + 1] = grp
    for _, e in ipairs(entries) do
      if self.group_of[e.param] == nil and selects(sel, e.path, e.param) then
        self.group_of[e.param] = over
        grp.paths[#grp.paths + 1] = e.path
      end
    end
  end
  -- the paths without weight decay (reports, tests)
  self.no_decay_paths = {}
  for _, e in ipairs(entries) do
    local o = self.group_of[e.param]
    if o and o.weight_decay == 0 then self.no_decay_paths[#self.no_decay_paths + 1] = e.path end
  end
  return self
end

-- Hyper-parameter k for parameter p: its group's, else the optimizer's current one. "lr" is the
-- optimizer's lr times the group's scale.
function Optimizer:hp(p, k)
  local o = self.group_of[p]
  if k == "lr" then return o and o.lr_scale and self.lr * o.lr_scale or self.lr end
  local v = o and o[k]
  if v == nil then v = self[k] end
  return v
end

-- At world size > 1 a model that is neither wrapped nor replicated trains one drifting copy per
-- rank: refused unless local_only says that is the intent.
function Optimizer:check_world()
  if not self.wrapped then
    -- made on the plain model: its parameters now hold no values of their own, so the step
    -- would update nothing
    for _, e in ipairs(self.params) do
      if core.param_unit(e.param) ~= nil then
        raise(("%s:step: the model was wrapped after this optimizer was created (%s is sharded); "
          .. "create the optimizer after fsdp.wrap"):format(self.kind, e.path))
      end
    end
  end
  local W = core.world_size()
  if self.wrapped or self.local_only or W == 1 then return end
  raise(("%s:step: the model is not wrapped, so each of the %d ranks would train its own copy "
    .. "and the copies drift apart; shard it with fsdp.wrap(model), or replicate it (DDP) with "
    .. "fsdp.wrap(model, {strategy = \"replicate\"}), before creating the optimizer (or pass "
    .. "local_only = true to the optimizer if one model per rank is the intent)"):format(self.kind, W))
end

-- Drop every parameter's gradient (p.grad = nil); wrapped: also zero every gradient shard.
function Optimizer:zero_grad()
  for _, e in ipairs(self.params) do e.param.grad = nil end
  if self.wrapped then
    for _, u in ipairs(live_units(self.wrapped, "zero_grad")) do u:zero_grad() end
  end
end

-- x (contiguous) masked in place by the flat mask m, if any (in x's dtype: a plain parameter
-- moved to bf16 keeps its f32 mask).
local function apply_mask(x, m)
  if m then mask.apply_flat(x:dim() == 1 and x or x:view{x:numel()}, m) end
end

-- Wrapped models: fn(st, p_slice, g_slice, param, path) for every parameter slice this rank
-- holds; st is the slice's state table (created with step = 0). With only_grads (a step:
-- collective) the slices of parameters that received no gradient on any rank are left out,
-- as a plain optimizer leaves out a parameter whose p.grad is nil: no update, no weight decay,
-- no state created or changed, no mask applied. fn gets the slice's mask (or nil) as a sixth
-- argument and applies it itself: SGD masks the gradient before its kernel and the weights
-- after it, AdamW passes it to its fused kernel. The seventh is the slice's unit.
function Optimizer:each_slice(fn, only_grads)
  local what = self.kind .. ":step"
  if only_grads then self.wrapped:reduce_held(what) end -- what fsdp.no_sync left unreduced
  local has = only_grads and agree_grads(self.wrapped, what) or nil
  if only_grads then reshard_for_step(self.wrapped, what) end
  each_unit(self.wrapped, what, function(u, shard, gshard, slices)
    for _, s in ipairs(slices) do
      -- frozen parameters are left out of steps (only_grads); loads learn every slice, frozen
      -- units' too, from rank_slices
      if self.member[s.param] and (has == nil or (has[u][s.index] and not frozen(s.param))) then
        local n = s.shard_last - s.shard_first + 1
        local p = s.param
        local st = self.state[p]
        if st == nil then
          st = {step = 0}
          self.state[p] = st
          self.slice_of[p] = {param_first = s.param_first, numel = n}
        end
        local ps, gs = shard:narrow(1, s.shard_first, n), gshard:narrow(1, s.shard_first, n)
        fn(st, ps, gs, p, s.path, slice_mask(p, n, s.path), u)
      end
    end
  end)
end

-- fn(st, p, g, param, path, m) for every parameter this optimizer updates that has a gradient
-- (a step: checks the world, and is collective when wrapped): p and g are the values and the
-- gradient, contiguous and of one shape (wrapped: 1-D views of this rank's slice of the shard
-- and of the gradient shard; plain: the parameter and p.grad), st its state table (created
-- with step = 0; its buffers shaped like p: state_like), m its flat mask (or nil), which fn
-- applies (apply_mask). Plain: run without recording for gradients; a gradient made for the
-- call is freed.
-- With max_grad_norm the gradients are clipped first, as fsdp.clip_grad_norm over exactly these
-- gradients would (masked, measured, scaled by the same coefficient: the same bits), and the
-- norm is kept in self.grad_norm. An optimizer whose kernel takes the coefficient (fused_clip:
-- AdamW) gets it as fn's seventh argument (nil: no scaling) and its gradients are not written
-- (the pass over them that scaling takes is saved); the others get them scaled in place.
function Optimizer:each_update(update)
  self:check_world()
  -- an update's error names the parameter it was updating
  local kind = self.kind
  local function fn(st, p, g, param, path, m, coef)
    local ok, err = pcall(update, st, p, g, param, path, m, coef)
    if not ok then error(("%s: parameter %s: %s"):format(kind, path, util.strip(err)), 0) end
  end
  -- Clipping measures every gradient before any is used: the updates are collected first,
  -- and the lists emptied after use (a compiled trace may keep a closure's upvalue tables as
  -- constants, and with them every gradient view: a frozen unit's gradient shard could then
  -- not be freed). Without clipping each update runs as its gradient comes.
  local clip = self.max_grad_norm ~= nil
  local items, pieces = {}, {}
  local function take(st, p, g, param, path, m, u)
    if not clip then return fn(st, p, g, param, path, m) end
    items[#items + 1] = {st, p, g, param, path, m}
    pieces[#pieces + 1] = {g, u}
  end
  local function run()
    if not clip then return end
    for _, it in ipairs(items) do apply_mask(it[3], it[6]) end -- masked before measuring
    self.grad_norm = grad_norm(self.wrapped, pieces)
    local coef = clip_coef(self.max_grad_norm, self.grad_norm)
    if coef and not self.fused_clip then
      for _, it in ipairs(items) do it[3]:mul_(coef) end
      coef = nil
    end
    for _, it in ipairs(items) do fn(it[1], it[2], it[3], it[4], it[5], it[6], coef) end
  end
  local function clear()
    for i = #items, 1, -1 do items[i] = nil end
    for i = #pieces, 1, -1 do pieces[i] = nil end
  end
  if self.wrapped then
    local ok, err = pcall(function()
      self:each_slice(take, true)
      run()
    end)
    clear()
    if not ok then error(err, 0) end
    return
  end
  -- a parameter the update kernel cannot take is refused before any update (a model with
  -- parameters of several dtypes is not half stepped)
  if self.f32_kernel then
    for _, e in ipairs(self.params) do
      local p = e.param
      local dt = p:dtype()
      local g, new = nil, false
      if dt ~= "f32" and not frozen(p) then g, new = grad_of(p) end
      if new then g:free() end
      if g ~= nil and self:f32_kernel(p) then
        raise(("%s: parameter %s is %s, but %s's update kernel takes f32 parameters only: "
          .. "keep the parameters f32%s (Lion, Adafactor and SGD with nesterov = true update "
          .. "%s parameters as they are)"):format(self.kind, e.path, dt, self.kind,
          dt == "f64" and "" or (" and compute in %s with fsdp.wrap(model, {mp = \"%s\"})")
            :format(dt, dt), dt))
      end
    end
  end
  util.no_grad(function()
    local fresh = {} -- gradients made for the call, freed once their update has run
    local ok, err = pcall(function()
      for _, e in ipairs(self.params) do
        local p = e.param
        local g, new = grad_of(p)
        if g ~= nil and not frozen(p) then
          local st = self.state[p]
          if st == nil then
            st = {step = 0}
            self.state[p] = st
          end
          take(st, p, g, p, e.path, mask.plain_flat(p))
        end
        if new and clip then fresh[#fresh + 1] = g elseif new then g:free() end
      end
      run()
    end)
    clear()
    for _, g in ipairs(fresh) do g:free() end
    if not ok then util.reraise(err) end
  end)
end

-- A state buffer for the p of an each_update call: zeros of its shape, on its device.
local function state_like(p)
  return core.zeros(p:shape(), {role = "optim", device = p.device})
end

-- {kind =, step =, lr =, hyper = {...}, state = {[path] = {step =, <name> = tensor, ...}}}.
-- The state tensors are the live buffers (clone them to keep a snapshot).
-- Wrapped: state holds this rank's slices only; each entry also has param_first (1-based
-- position of the slice in the parameter's flattened elements) and numel, and the table has
-- sharded = true, rank =, world_size =.
function Optimizer:state_dict()
  local state = {}
  for _, e in ipairs(self.params) do
    local st = self.state[e.param]
    if st then
      local copy = {}
      for k, v in pairs(st) do copy[k] = v end
      if self.wrapped then
        local sl = self.slice_of[e.param]
        copy.param_first, copy.numel = sl.param_first, sl.numel
      end
      state[e.path] = copy
    end
  end
  local sd = {kind = self.kind, step = self.step_count, lr = self.lr, hyper = self:hyper(), state = state}
  if self.wrapped then
    sd.sharded, sd.rank, sd.world_size = true, core.rank(), core.world_size()
  end
  return sd
end

-- A new buffer for state `name` of parameter p holding a copy of v (load_state_dict): shaped
-- like p's slice (sl) or p. An optimizer whose state is not shaped like its parameter says so.
function Optimizer:restore_buffer(p, name, v, sl)
  local buf = sl and slice_zeros(p, sl.numel) or state_zeros(p)
  buf:copy(v)
  return buf
end

-- Checkpoint hooks: state `name` (the live buffer v) of parameter p as count elements matching
-- the parameter's elements [first, first + count); import_tensor is the inverse, nil for an
-- elementwise state (the caller copies or adopts it).
function Optimizer:export_tensor(p, name, v, first, count) return v:view{count} end
function Optimizer:import_tensor() return nil end

-- Restore from a state_dict (values are copied into this optimizer's own buffers). Everything
-- is checked, and the new buffers made, before anything changes: a refused state_dict leaves
-- the optimizer as it was.
function Optimizer:load_state_dict(sd)
  if type(sd) ~= "table" or sd.kind ~= self.kind then
    raise(("load_state_dict: expected a %s state_dict (got %s)")
      :format(self.kind, type(sd) == "table" and tostring(sd.kind) or type(sd)))
  end
  local by_path = {}
  for _, e in ipairs(self.params) do by_path[e.path] = e.param end
  for path in pairs(sd.state or {}) do
    if by_path[path] == nil then raise(("load_state_dict: unknown parameter %s"):format(path)) end
  end
  if (sd.sharded == true) ~= (self.wrapped ~= nil) then
    raise(("load_state_dict: the state_dict is %s but this optimizer's model is %s")
      :format(sd.sharded and "sharded" or "dense", self.wrapped and "wrapped" or "not wrapped"))
  end
  if sd.sharded and (sd.world_size ~= core.world_size() or sd.rank ~= core.rank()) then
    raise(("load_state_dict: this sharded state_dict is rank %s of %s; this is rank %d of %d")
      :format(tostring(sd.rank), tostring(sd.world_size), core.rank(), core.world_size()))
  end
  -- this rank's slices, frozen units' too (their state is kept, as a plain optimizer keeps it)
  local mine = self.wrapped and rank_slices(self.wrapped, "load_state_dict") or {}
  local paths = util.sorted_keys(sd.state or {})
  for _, path in ipairs(paths) do
    local saved, sl = sd.state[path], mine[by_path[path]]
    if self.wrapped and (sl == nil or sl.param_first ~= saved.param_first or sl.numel ~= saved.numel) then
      raise(("load_state_dict: %s: the saved slice (first %s, %s elements) is not this rank's")
        :format(path, tostring(saved.param_first), tostring(saved.numel)))
    end
  end
  local state, slice_of = {}, {}
  local ok, err = pcall(function()
    for _, path in ipairs(paths) do
      local p, saved = by_path[path], sd.state[path]
      local sl = mine[p]
      local st = {}
      state[p] = st
      for k, v in pairs(saved) do
        if type(v) == "userdata" then
          local made, buf = pcall(self.restore_buffer, self, p, k, v, sl)
          if not made then
            raise(("load_state_dict: %s: %s: %s"):format(path, k, util.strip(buf)))
          end
          st[k] = buf
        elseif k ~= "param_first" and k ~= "numel" then
          st[k] = v
        end
      end
      if sl then slice_of[p] = {param_first = sl.param_first, numel = sl.numel} end
    end
  end)
  if not ok then
    -- the buffers made so far are freed now rather than by Lua's collector
    for _, st in pairs(state) do
      for _, v in pairs(st) do if type(v) == "userdata" then v:free() end end
    end
    util.reraise(err)
  end
  self.step_count, self.lr = sd.step or 0, sd.lr or self.lr
  for k, v in pairs(sd.hyper or {}) do self[k] = v end
  self.state = state
  if self.wrapped then self.slice_of = slice_of end
end

-- ---- checkpoint support (the caller is lua/fsdp/checkpoint.lua) ----------------------------
--
-- State as per-parameter flat element ranges, so that a checkpoint can store each rank's
-- slice and load it back at another world size (resharding). Positions are 0-based here.

-- -> array, in parameter order, of {path =, param =, first =, count =, scalars = {step =, ...},
-- tensors = {name = 1-D tensor of count elements (a view of the live buffer; a new tensor where
-- the state is not elementwise: Adafactor's factors, expanded)}}: one entry per
-- parameter that has state on this rank. Wrapped: this rank's slice (first = its offset in the
-- parameter's flattened elements); plain: the whole parameter (first 0, count numel).
function Optimizer:export_slices()
  local out = {}
  for _, e in ipairs(self.params) do
    local st = self.state[e.param]
    if st then
      local first, count
      if self.wrapped then
        local sl = self.slice_of[e.param]
        first, count = sl.param_first - 1, sl.numel
      else
        first, count = 0, e.param:numel()
      end
      local scalars, tensors = {}, {}
      for k, v in pairs(st) do
        if type(v) == "userdata" then
          tensors[k] = self:export_tensor(e.param, k, v, first, count)
        else
          scalars[k] = v
        end
      end
      out[#out + 1] = {path = e.path, param = e.param, first = first, count = count,
        scalars = scalars, tensors = tensors}
    end
  end
  return out
end

-- Why import_slices would refuse list (a message starting with what), or nil: every entry must
-- be a parameter this optimizer updates, at this rank's part of it (wrapped: its slice, frozen
-- units included; plain: the whole parameter), with tensors of that many elements. An entry
-- may carry path (the caller's name for the parameter, for messages). Changes nothing:
-- fsdp.load asks while staging, before the ranks agree and anything is written.
function Optimizer:import_problem(list, what)
  local known = {}
  for _, e in ipairs(self.params) do known[e.param] = e.path end
  local mine = self.wrapped and rank_slices(self.wrapped, what) or nil
  for _, it in ipairs(list) do
    local path = known[it.param]
    if path == nil then
      return ("%s: %s: state for a parameter this optimizer does not update")
        :format(what, it.path or "?")
    end
    local want
    if mine then
      local sl = mine[it.param]
      want = sl and {first = sl.param_first - 1, count = sl.numel}
    else
      want = {first = 0, count = it.param:numel()}
    end
    if want == nil or want.first ~= it.first or want.count ~= it.count then
      return ("%s: %s: elements [%d, %d) are not this rank's part of the parameter")
        :format(what, path, it.first, it.first + it.count)
    end
    for k, t in pairs(it.tensors or {}) do
      if t:numel() ~= it.count then
        return ("%s: %s: state %s has %d elements, expected %d")
          :format(what, path, k, t:numel(), it.count)
      end
    end
  end
  return nil
end

-- Replace the whole state: list as export_slices returns it (param, first, count, scalars,
-- tensors: values are copied into new buffers; parameters absent from the list get no state);
-- info = {step =, lr =, hyper = {...}} restores the optimizer's step count, learning rate and
-- hyper-parameters; info.adopt = true makes the given tensors the state buffers themselves
-- (contiguous, 1-D, count elements, not used by the caller afterwards) instead of copies.
-- Wrapped: each slice must be this rank's slice of the parameter (frozen units' too: their
-- state is kept for when they are unfrozen, as on a plain model); plain: the whole parameter.
-- Checks everything (import_problem) before changing anything.
function Optimizer:import_slices(list, info)
  local why = self:import_problem(list, "import_slices")
  if why then raise(why) end
  local state, slice_of = {}, {}
  for _, it in ipairs(list) do
    local st = {}
    for k, v in pairs(it.scalars or {}) do st[k] = v end
    if st.step == nil then st.step = 0 end
    for k, t in pairs(it.tensors or {}) do
      local own = self:import_tensor(it.param, k, t, it.first, it.count)
      if own then
        st[k] = own
      elseif info and info.adopt then
        -- the caller's buffers become the state (1-D contiguous, the caller lets go of them)
        st[k] = self.wrapped and t or t:view(it.param:shape())
      else
        local buf = self.wrapped and slice_zeros(it.param, it.count) or state_zeros(it.param)
        buf:view{it.count}:copy(t:view{it.count})
        st[k] = buf
      end
    end
    state[it.param] = st
    if self.wrapped then slice_of[it.param] = {param_first = it.first + 1, numel = it.count} end
  end
  self.state = state
  if self.wrapped then self.slice_of = slice_of end
  info = info or {}
  if info.step ~= nil then self.step_count = info.step end
  if info.lr ~= nil then self.lr = info.lr end
  for k, v in pairs(info.hyper or {}) do self[k] = v end
end

-- ---- hyper-parameter checks ----------------------------------------------------------------

-- t[k] (base when nil): a number, not NaN, >= lo, and <= hi (< hi when open); fn names the
-- optimizer or group in the message.
local function check_num(fn, t, k, base, lo, hi, open)
  local v = t[k]
  if v == nil then v = base end
  local bad = type(v) ~= "number" or v ~= v or (lo and v < lo) or (hi and (open and v >= hi or v > hi))
  if bad then
    local range = hi and ("in [%s, %s%s"):format(lo, hi, open and ")" or "]")
      or lo and (">= " .. lo) or ""
    raise(("%s: %s must be a number %s (got %s)"):format(fn, k, range, tostring(v)))
  end
  return v
end

-- betas {b1, b2}, each in [0, 1).
local function check_betas(fn, t, base)
  local b = t.betas
  if b == nil then b = base end
  if type(b) ~= "table" or #b ~= 2 or type(b[1]) ~= "number" or type(b[2]) ~= "number"
      or not (b[1] >= 0 and b[1] < 1) or not (b[2] >= 0 and b[2] < 1) then
    local shown = type(b) == "table" and ("{%s, %s}"):format(tostring(b[1]), tostring(b[2]))
      or tostring(b)
    raise(("%s: betas must be {beta1, beta2}, each in [0, 1) (got %s)"):format(fn, shown))
  end
  return {b[1], b[2]}
end

local function check_bool(fn, t, k, base)
  local v = t[k]
  if v == nil then v = base end
  if type(v) ~= "boolean" then raise(("%s: %s must be a boolean (got %s)"):format(fn, k, tostring(v))) end
  return v
end

-- ---- SGD ---------------------------------------------------------------------------------

local SGD = setmetatable({}, {__index = Optimizer})
SGD.__index = SGD
-- whether p's update runs core.sgd_step, whose kernels take f32 only (nesterov: tensor ops)
function SGD:f32_kernel(p) return not self:hp(p, "nesterov") end
optim.SGD_class = SGD

HYPER.SGD = {"lr", "momentum", "nesterov", "weight_decay"}

local function read_sgd(fn, t, base)
  local h = {lr = check_num(fn, t, "lr", base.lr, 0),
    momentum = check_num(fn, t, "momentum", base.momentum, 0),
    weight_decay = check_num(fn, t, "weight_decay", base.weight_decay, 0),
    nesterov = check_bool(fn, t, "nesterov", base.nesterov)}
  if h.nesterov and h.momentum == 0 then
    raise(fn .. ": nesterov needs a momentum > 0")
  end
  return h
end

-- SGD(model_or_params, {lr =, momentum = 0, nesterov = false, weight_decay = 0, groups =,
-- params =, local_only =}) — PyTorch semantics (dampening 0): g = grad + wd * p;
-- buf = momentum * buf + g (buf = g on its first step); p -= lr * buf, or with nesterov
-- p -= lr * (g + momentum * buf). Every parameter decays unless a group says otherwise.
function optim.SGD(model, opts)
  return new_optimizer(SGD, "SGD", model, opts, read_sgd,
    {momentum = 0, nesterov = false, weight_decay = 0}, false)
end

function SGD:hyper()
  return {momentum = self.momentum, weight_decay = self.weight_decay, nesterov = self.nesterov}
end

-- One update of every parameter that has a gradient; parameters without one are skipped
-- (wrapped: those that received none on any rank; the step is then collective).
function SGD:step()
  self:each_update(function(st, p, g, param, _, m)
    local lr, mom, wd = self:hp(param, "lr"), self:hp(param, "momentum"), self:hp(param, "weight_decay")
    local first = false
    if mom ~= 0 and st.momentum_buffer == nil then
      st.momentum_buffer = state_like(p)
      first = true
    end
    st.step = st.step + 1
    apply_mask(g, m)
    if self:hp(param, "nesterov") then
      local buf, d = st.momentum_buffer, g:clone()
      if wd ~= 0 then d:add_(p, wd) end
      if first then buf:copy(d) else buf:mul_(mom):add_(d) end
      d:add_(buf, mom)
      p:add_(d, -lr)
      d:free()
    else
      core.sgd_step(p, g, st.momentum_buffer, lr, mom, wd, first)
    end
    apply_mask(p, m)
  end)
  self.step_count = self.step_count + 1
end

-- ---- Adam and AdamW ------------------------------------------------------------------------

local AdamW = setmetatable({}, {__index = Optimizer})
AdamW.__index = AdamW
AdamW.fused_clip = true -- max_grad_norm's coefficient goes into the kernel (each_update)
function AdamW:f32_kernel() return true end -- core.adamw_step: f32 kernels only
optim.AdamW_class = AdamW

local Adam = setmetatable({}, {__index = AdamW})
Adam.__index = Adam
optim.Adam_class = Adam

HYPER.AdamW = {"lr", "betas", "eps", "weight_decay"}
HYPER.Adam = HYPER.AdamW

local function read_adam(fn, t, base)
  return {lr = check_num(fn, t, "lr", base.lr, 0), betas = check_betas(fn, t, base.betas),
    eps = check_num(fn, t, "eps", base.eps, 0),
    weight_decay = check_num(fn, t, "weight_decay", base.weight_decay, 0)}
end

-- AdamW(model_or_params, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8, weight_decay = 0.01,
--   groups =, params =, no_decay =, local_only =}) — decoupled weight decay as in PyTorch's
-- AdamW (p -= lr * wd * p, then the Adam update with bias correction). By default biases and
-- norm parameters (fewer than 2 dimensions) are a group with weight_decay = 0.
function optim.AdamW(model, opts)
  return new_optimizer(AdamW, "AdamW", model, opts, read_adam,
    {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8, weight_decay = 0.01}, true)
end

-- Adam(model_or_params, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8, weight_decay = 0, ...})
-- — PyTorch's Adam: weight decay is L2, added to the gradient (g + wd * p) before the moments.
-- The same no-decay default group as AdamW.
function optim.Adam(model, opts)
  return new_optimizer(Adam, "Adam", model, opts, read_adam,
    {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8, weight_decay = 0}, true)
end

function AdamW:hyper()
  return {betas = {self.betas[1], self.betas[2]}, eps = self.eps, weight_decay = self.weight_decay}
end

function AdamW:step()
  local l2 = self.kind == "Adam"
  self:each_update(function(st, p, g, param, _, m, coef)
    if st.exp_avg == nil then
      st.exp_avg, st.exp_avg_sq = state_like(p), state_like(p)
    end
    st.step = st.step + 1
    local b = self:hp(param, "betas")
    local lr, eps, wd = self:hp(param, "lr"), self:hp(param, "eps"), self:hp(param, "weight_decay")
    if l2 and wd ~= 0 then
      -- masked elements of p are 0, so g + wd * p stays masked where g is
      local g2 = g:clone()
      if coef then g2:mul_(coef) end -- clipped, then the L2 term (clip_grad_norm's order)
      g2:add_(p, wd)
      core.adamw_step(p, g2, st.exp_avg, st.exp_avg_sq, lr, b[1], b[2], eps, 0, st.step, m)
      g2:free()
    else
      core.adamw_step(p, g, st.exp_avg, st.exp_avg_sq, lr, b[1], b[2], eps, l2 and 0 or wd,
        st.step, m, coef)
    end
  end)
  self.step_count = self.step_count + 1
end

-- ---- Lion ----------------------------------------------------------------------------------

local Lion = setmetatable({}, {__index = Optimizer})
Lion.__index = Lion
optim.Lion_class = Lion

HYPER.Lion = {"lr", "betas", "weight_decay"}

local function read_lion(fn, t, base)
  return {lr = check_num(fn, t, "lr", base.lr, 0), betas = check_betas(fn, t, base.betas),
    weight_decay = check_num(fn, t, "weight_decay", base.weight_decay, 0)}
end

-- Lion(model_or_params, {lr = 1e-4, betas = {0.9, 0.99}, weight_decay = 0, ...}) — Chen et
-- al. 2023 ("Symbolic Discovery of Optimization Algorithms"), as lion-pytorch:
-- p *= 1 - lr * wd; p -= lr * sign(b1 * m + (1 - b1) * g); m = b2 * m + (1 - b2) * g.
-- One state buffer (exp_avg); the no-decay default group as AdamW.
function optim.Lion(model, opts)
  return new_optimizer(Lion, "Lion", model, opts, read_lion,
    {lr = 1e-4, betas = {0.9, 0.99}, weight_decay = 0}, true)
end

function Lion:hyper()
  return {betas = {self.betas[1], self.betas[2]}, weight_decay = self.weight_decay}
end

function Lion:step()
  self:each_update(function(st, p, g, param, _, m)
    if st.exp_avg == nil then st.exp_avg = state_like(p) end
    st.step = st.step + 1
    local b = self:hp(param, "betas")
    local lr, wd = self:hp(param, "lr"), self:hp(param, "weight_decay")
    apply_mask(g, m)
    local ea = st.exp_avg
    local c = ea:clone()
    c:mul_(b[1]):add_(g, 1 - b[1])
    local s = c:sign()
    if wd ~= 0 then p:mul_(1 - lr * wd) end
    p:add_(s, -lr)
    ea:mul_(b[2]):add_(g, 1 - b[2])
    c:free()
    s:free()
    apply_mask(p, m)
  end)
  self.step_count = self.step_count + 1
end

-- ---- Adafactor -----------------------------------------------------------------------------
--
-- PyTorch's torch.optim.Adafactor (Shazeer and Stern 2018, no first moment). A parameter of 2
-- or more dimensions, shape (..., R, C) read as B = numel / (R * C) matrices, keeps factored
-- second moments: row_var (B * R, the row means of g^2) and col_var (B * C, the column means);
-- its variance estimate is row_var[r] * col_var[c] / mean(row_var of its matrix). Smaller
-- parameters keep an elementwise variance. The step size is relative to the parameter's RMS and
-- the update is clipped by its RMS, both over the whole parameter.
--
-- Sharded (docs/fsdp.md "Adafactor on shards"): a rank holds a slice of the flattened
-- parameter, which cuts rows and columns. Every rank holding a slice keeps the whole row_var
-- and col_var (B * (R + C) elements, replicated: small next to R * C / N); the row and column
-- sums of g^2 over its slice, and its sum of p^2, are added up over the ranks in one
-- all_reduce per step, the sums of squares of the update in a second one (both over every
-- factored parameter at once, the same layout on every rank, zeros where a rank holds nothing).
-- Every rank then updates the same factors, so N ranks equal one (to the order of the sums).
-- Units that replicate (strategy "none") hold whole parameters: nothing is reduced for them.
-- Hybrid units: every group holds the same shards, so only the first group's slices enter the
-- sums (the others add zeros), or each would count once per group.
-- Checkpoints store the factors elementwise, expanded over the slice (element (r, c) holds
-- row_var[r] and col_var[c]), so they reshard like Adam's moments; loading gives each rank the
-- factors of the rows and columns its slice touches, and the first step after completes them
-- with one all_reduce("max") (factors are >= 0, unknown entries 0).

local Adafactor = setmetatable({}, {__index = Optimizer})
Adafactor.__index = Adafactor
Adafactor.clip_unsupported = "max_grad_norm is not supported (Adafactor clips its updates by "
  .. "their RMS, d; call fsdp.clip_grad_norm(model, max_norm) before step to clip gradients)"
optim.Adafactor_class = Adafactor

HYPER.Adafactor = {"lr", "beta2_decay", "eps", "d", "weight_decay"}

local F32_EPS = 1.1920928955078125e-07 -- torch.finfo(torch.float32).eps, eps1's default

local function read_adafactor(fn, t, base)
  local eps = t.eps
  if eps == nil then eps = base.eps end
  if type(eps) ~= "table" or #eps ~= 2 or type(eps[1]) ~= "number" or type(eps[2]) ~= "number"
      or not (eps[1] >= 0) or not (eps[2] >= 0) then
    raise(("%s: eps must be {eps1, eps2}, each a number >= 0 (got %s)"):format(fn,
      type(eps) == "table" and ("{%s, %s}"):format(tostring(eps[1]), tostring(eps[2])) or tostring(eps)))
  end
  return {lr = check_num(fn, t, "lr", base.lr, 0),
    beta2_decay = check_num(fn, t, "beta2_decay", base.beta2_decay, -math.huge, 0),
    eps = {eps[1], eps[2]}, d = check_num(fn, t, "d", base.d, 1),
    weight_decay = check_num(fn, t, "weight_decay", base.weight_decay, 0)}
end

-- Adafactor(model_or_params, {lr = 1e-2, beta2_decay = -0.8, eps = {f32 eps, 1e-3}, d = 1,
-- weight_decay = 0, groups =, params =, no_decay =, local_only =}) — torch.optim.Adafactor:
-- per step t: rho = min(lr, 1 / sqrt(t)), alpha = max(eps2, RMS(p)) * rho, beta2_t = 1 -
-- t^beta2_decay; p *= 1 - lr * wd; moments lerp towards g^2 by 1 - beta2_t; u = g /
-- sqrt(max(V, eps1^2)); p -= alpha / max(1, RMS(u) / d) * u.
function optim.Adafactor(model, opts)
  return new_optimizer(Adafactor, "Adafactor", model, opts, read_adafactor,
    {lr = 1e-2, beta2_decay = -0.8, eps = {F32_EPS, 1e-3}, d = 1, weight_decay = 0}, true)
end

function Adafactor:hyper()
  return {beta2_decay = self.beta2_decay, eps = {self.eps[1], self.eps[2]}, d = self.d,
    weight_decay = self.weight_decay}
end

-- B, R, C of a shape with 2 or more dimensions; nil for smaller ones.
local function factor_dims(shape)
  local nd = #shape
  if nd < 2 then return nil end
  local B = 1
  for i = 1, nd - 2 do B = B * shape[i] end
  return B, shape[nd - 1], shape[nd]
end

-- The rows a slice [first, first + n) of a flattened (B * R, C) parameter touches: first row
-- r0 (0-based), k rows, and the slice's offset in that (k, C) block.
local function row_block(first, n, C)
  local r0 = math.floor(first / C)
  local r1 = math.floor((first + n - 1) / C)
  return r0, r1 - r0 + 1, first - r0 * C
end

-- fn(b, lo, kb) for every matrix b (0-based) the rows [r0, r0 + k) touch: its rows from lo
-- (0-based within the block), kb of them.
local function each_matrix(r0, k, R, fn)
  local b0, b1 = math.floor(r0 / R), math.floor((r0 + k - 1) / R)
  for b = b0, b1 do
    local lo, hi = math.max(r0, b * R), math.min(r0 + k - 1, b * R + R - 1)
    fn(b, lo - r0, hi - lo + 1)
  end
end

local function zeros1(n, like, role)
  return core.zeros({n}, {role = role or "other", device = like.device})
end

-- Row and column sums of x^2 (x: a slice [first, first + n) of a (B * R, C) parameter) added
-- into rs (B * R) and cs (B * C).
local function add_sq_sums(x, first, R, C, rs, cs)
  local n = x:numel()
  if n == 0 then return end
  local r0, k, off = row_block(first, n, C)
  local block = zeros1(k * C, x)
  local sq = x * x
  block:narrow(1, off + 1, n):copy(sq)
  sq:free()
  local m2 = block:view{k, C}
  local rsum = m2:sum(2)
  rs:narrow(1, r0 + 1, k):add_(rsum)
  rsum:free()
  each_matrix(r0, k, R, function(b, lo, kb)
    local csum = m2:narrow(1, lo + 1, kb):sum(1)
    cs:narrow(1, b * C + 1, C):add_(csum)
    csum:free()
  end)
  block:free()
end

-- (k * C) block over the rows of a slice: element (r, c) = f(row value, col value) for the
-- matrices' factors, f given as fill(b, rows (kb), cols (C)) -> (kb, C) tensor.
local function factor_block(first, n, R, C, like, fill)
  local r0, k, off = row_block(first, n, C)
  local block = zeros1(k * C, like)
  local m2 = block:view{k, C}
  each_matrix(r0, k, R, function(b, lo, kb)
    local t = fill(b, r0 + lo, kb)
    m2:narrow(1, lo + 1, kb):copy(t)
    t:free()
  end)
  return block, off
end

-- Per step: the parameters to update, as records {param, path, shape, B, R, C (nil: not
-- factored), n (numel), replicated, counted (false: a hybrid replica whose slice another
-- group's sum holds), s = {p, g, first, m} or nil (this rank holds none of it), st}. Wrapped: collective (the gradient flags are agreed); the same records, in the same
-- order, on every rank.
function Adafactor:records()
  local out = {}
  local function add(param, path, replicated, s, counted)
    local B, R, C = factor_dims(param:shape())
    out[#out + 1] = {param = param, path = path, B = B, R = R, C = C, n = param:numel(),
      replicated = replicated, counted = counted ~= false, s = s}
  end
  if self.wrapped then
    local what = self.kind .. ":step"
    local has = agree_grads(self.wrapped, what)
    reshard_for_step(self.wrapped, what)
    each_unit(self.wrapped, what, function(u, shard, gshard, slices)
      local by_index = {}
      for _, s in ipairs(slices) do by_index[s.index] = s end
      local paths = u:paths()
      for i, param in ipairs(u:params()) do
        if self.member[param] and not frozen(param) and has[u][i] then
          local s, sl = by_index[i], nil
          if s then
            local n = s.shard_last - s.shard_first + 1
            sl = {p = shard:narrow(1, s.shard_first, n), g = gshard:narrow(1, s.shard_first, n),
              first = s.param_first - 1, m = slice_mask(param, n, s.path)}
            if self.slice_of[param] == nil then
              self.slice_of[param] = {param_first = s.param_first, numel = n}
            end
          end
          add(param, paths[i], u:strategy() == "none", sl, util.counts_shard(u))
        end
      end
    end)
    return out
  end
  for _, e in ipairs(self.params) do
    local p = e.param
    local g, fresh = nil, false
    if not frozen(p) then g, fresh = grad_of(p) end
    if g ~= nil then
      local n = p:numel()
      add(p, e.path, true, {p = p:detach():view{n}, g = g:view{n}, first = 0,
        m = mask.plain_flat(p), fresh = fresh and g})
    end
  end
  return out
end

-- The device the optimizer's sums live on: the shards' (wrapped), else the parameters'.
function Adafactor:sum_device()
  if self.wrapped then
    local units = live_units(self.wrapped, self.kind .. ":step")
    return units[1] and units[1]:shard().device or "cpu"
  end
  local e = self.params[1]
  return e and e.param.device or "cpu"
end

-- Collective after a load (wrapped, world size > 1): complete every factored parameter's
-- row_var and col_var from the ranks that know each entry (all_reduce "max"). Frozen units'
-- too: their state was loaded, and a later unfreeze steps on it.
function Adafactor:fill_factors()
  self.fill_pending = nil
  if not self.wrapped or core.world_size() == 1 then return end
  local list, total = {}, 0
  for _, u in ipairs(live_units(self.wrapped, self.kind .. ":step")) do
    for _, param in ipairs(u:params()) do
      local B, R, C = factor_dims(param:shape())
      if self.member[param] and B then
        list[#list + 1] = {param = param, off = total, nr = B * R, nc = B * C}
        total = total + B * (R + C)
      end
    end
  end
  if total == 0 then return end
  local pack = core.zeros({total}, {device = self:sum_device()})
  for _, x in ipairs(list) do
    local st = self.state[x.param]
    if st and st.row_var then
      pack:narrow(1, x.off + 1, x.nr):copy(st.row_var)
      pack:narrow(1, x.off + x.nr + 1, x.nc):copy(st.col_var)
    end
  end
  core.all_reduce(pack, "max", "Adafactor.factors")
  for _, x in ipairs(list) do
    local st = self.state[x.param]
    if st and st.row_var then
      st.row_var:copy(pack:narrow(1, x.off + 1, x.nr))
      st.col_var:copy(pack:narrow(1, x.off + x.nr + 1, x.nc))
    end
  end
  pack:free()
end

function Adafactor:step()
  self:check_world()
  local recs = self:records()
  if self.fill_pending then self:fill_factors() end
  local reduce = self.wrapped ~= nil and core.world_size() > 1
  -- round 1: sum of p^2, row and column sums of g^2 (sharded parameters share one buffer)
  local total = 0
  for _, r in ipairs(recs) do
    r.off = total
    total = total + 1 + (r.B and r.B * (r.R + r.C) or 0)
  end
  local dev = self:sum_device()
  local pack = core.zeros({total}, {device = dev})
  util.no_grad(function()
    for _, r in ipairs(recs) do
      local s = r.s
      if s then
        local st = self.state[r.param]
        if st == nil then
          st = {step = 0}
          if r.B then
            st.row_var, st.col_var = zeros1(r.B * r.R, s.p, "optim"), zeros1(r.B * r.C, s.p, "optim")
          else
            st.variance = zeros1(s.p:numel(), s.p, "optim")
          end
          self.state[r.param] = st
        end
        r.st = st
        apply_mask(s.g, s.m)
        pack:narrow(1, r.off + 1, 1):fill(core.sumsq(s.p))
        if r.B then
          add_sq_sums(s.g, s.first, r.R, r.C, pack:narrow(1, r.off + 2, r.B * r.R),
            pack:narrow(1, r.off + 2 + r.B * r.R, r.B * r.C))
        end
      end
    end
  end)
  -- replicated parameters (plain, or strategy "none") hold everything already; the others are
  -- summed over the ranks (a replicated one adds zeros on no rank: every rank holds it whole)
  if reduce then
    local any = false
    for _, r in ipairs(recs) do if not r.replicated then any = true end end
    if any then
      -- a replicated parameter's sums would be counted once per rank: keep them aside; a
      -- hybrid replica's once per group: only the first group's count
      local keep = {}
      for _, r in ipairs(recs) do
        local n = 1 + (r.B and r.B * (r.R + r.C) or 0)
        if r.replicated and r.s then
          keep[r] = pack:narrow(1, r.off + 1, n):clone()
          pack:narrow(1, r.off + 1, n):zero()
        elseif not r.counted and r.s then
          pack:narrow(1, r.off + 1, n):zero()
        end
      end
      core.all_reduce(pack, "sum", "Adafactor.sums")
      for r, t in pairs(keep) do
        pack:narrow(1, r.off + 1, t:numel()):copy(t)
        t:free()
      end
    end
  end
  -- round 2: the moments, the update and its sum of squares
  local usq = core.zeros({math.max(#recs, 1)}, {device = dev})
  local upd = {}
  util.no_grad(function()
    for i, r in ipairs(recs) do
      local s, st = r.s, r.st
      if s then
        st.step = st.step + 1
        local w = st.step ^ self:hp(r.param, "beta2_decay") -- 1 - beta2_t
        local eps1 = self:hp(r.param, "eps")[1]
        local est
        if r.B then
          local B, R, C = r.B, r.R, r.C
          local rv, cv = st.row_var, st.col_var
          local rs = pack:narrow(1, r.off + 2, B * R)
          local cs = pack:narrow(1, r.off + 2 + B * R, B * C)
          rv:mul_(1 - w):add_(rs, w / C)
          cv:mul_(1 - w):add_(cs, w / R)
          local block, off = factor_block(s.first, s.p:numel(), R, C, s.p, function(b, row, kb)
            local rmean = math.max(rv:narrow(1, b * R + 1, R):mean():item(), eps1)
            local t = rv:narrow(1, row + 1, kb):view{kb, 1}:matmul(cv:narrow(1, b * C + 1, C):view{1, C})
            t:mul_(1 / rmean)
            return t
          end)
          est = block:narrow(1, off + 1, s.p:numel()):clone()
          block:free()
        else
          local sq = s.g * s.g
          st.variance:mul_(1 - w):add_(sq, w)
          sq:free()
          est = st.variance:clone()
        end
        local den = est:clamp(eps1 * eps1):sqrt()
        est:free()
        local u = s.g / den
        den:free()
        upd[r] = u
        usq:narrow(1, i, 1):fill(core.sumsq(u))
      end
    end
  end)
  if reduce then
    local keep = {}
    for i, r in ipairs(recs) do
      if r.replicated and r.s then
        keep[i] = usq:narrow(1, i, 1):item()
        usq:narrow(1, i, 1):zero()
      elseif not r.counted and r.s then
        usq:narrow(1, i, 1):zero()
      end
    end
    core.all_reduce(usq, "sum", "Adafactor.update_sumsq")
    for i, v in pairs(keep) do usq:narrow(1, i, 1):fill(v) end
  end
  -- round 3: the steps
  util.no_grad(function()
    for i, r in ipairs(recs) do
      local s, u = r.s, upd[r]
      if s then
        local lr, wd = self:hp(r.param, "lr"), self:hp(r.param, "weight_decay")
        local t = r.st.step
        local rho = math.min(lr, 1 / math.sqrt(t))
        local alpha = math.max(self:hp(r.param, "eps")[2],
          math.sqrt(pack:narrow(1, r.off + 1, 1):item()) / math.sqrt(r.n)) * rho
        local denom = math.max(1, math.sqrt(usq:narrow(1, i, 1):item()) / (math.sqrt(r.n) * self:hp(r.param, "d")))
        if wd ~= 0 then s.p:mul_(1 - lr * wd) end
        s.p:add_(u, -alpha / denom)
        u:free()
        apply_mask(s.p, s.m)
        if s.fresh then s.fresh:free() end
      end
    end
  end)
  pack:free()
  usq:free()
  self.step_count = self.step_count + 1
end

-- Checkpoints: row_var and col_var expanded over the slice [first, first + count).
function Adafactor:export_tensor(p, name, v, first, count)
  if name ~= "row_var" and name ~= "col_var" then return v:view{count} end
  local B, R, C = factor_dims(p:shape())
  if count == 0 then return zeros1(0, v) end
  local block, off = factor_block(first, count, R, C, v, function(b, row, kb)
    if name == "row_var" then
      local ones = core.ones({1, C}, {device = v.device})
      local t = v:narrow(1, row + 1, kb):view{kb, 1}:matmul(ones)
      ones:free()
      return t
    end
    local ones = core.ones({kb, 1}, {device = v.device})
    local t = ones:matmul(v:narrow(1, b * C + 1, C):view{1, C})
    ones:free()
    return t
  end)
  local out = block:narrow(1, off + 1, count):clone()
  block:free()
  return out
end

-- The inverse: the factors of the rows and columns the slice touches (the others 0 until the
-- next step's fill_factors).
function Adafactor:import_tensor(p, name, t, first, count)
  if name ~= "row_var" and name ~= "col_var" then return nil end
  local B, R, C = factor_dims(p:shape())
  local out = zeros1(name == "row_var" and B * R or B * C, t, "optim")
  if count == 0 then return out end
  local r0, k, off = row_block(first, count, C)
  local block = zeros1(k * C, t)
  block:narrow(1, off + 1, count):copy(t:view{count})
  local m2 = block:view{k, C}
  if name == "row_var" then
    local v = m2:max(2)
    out:narrow(1, r0 + 1, k):copy(v)
    v:free()
  else
    each_matrix(r0, k, R, function(b, lo, kb)
      local v = m2:narrow(1, lo + 1, kb):max(1)
      out:narrow(1, b * C + 1, C):copy(v) -- each matrix once per slice
      v:free()
    end)
  end
  block:free()
  return out
end

-- A checkpoint's factors are partial on each rank (import_tensor): the next step completes them
-- with fill_factors' all_reduce. Whether it runs must not depend on what this rank imported (a
-- rank holding no slice of any factored parameter imports no factor, and would skip the
-- collective the others call): every rank of a wrapped model at world size > 1 that imports
-- (fsdp.load imports on every rank) schedules it; with nothing factored it communicates nothing.
function Adafactor:import_slices(list, info)
  Optimizer.import_slices(self, list, info)
  if self.wrapped and core.world_size() > 1 then self.fill_pending = true end
end

-- load_state_dict: the factors are whole on every rank that holds a slice (not shaped like it).
function Adafactor:restore_buffer(p, name, v, sl)
  if name ~= "row_var" and name ~= "col_var" and name ~= "variance" then
    return Optimizer.restore_buffer(self, p, name, v, sl)
  end
  local buf = core.zeros({v:numel()}, {role = "optim", device = v.device})
  buf:copy(v:view{v:numel()})
  return buf
end

-- ---- gradient clipping ---------------------------------------------------------------------

-- clip_grad_norm(model_or_params, max_norm) -> total_norm: the L2 norm over all gradients
-- (as one vector). If it exceeds max_norm every gradient is scaled in place by
-- max_norm / (total_norm + 1e-6) (PyTorch's clip_grad_norm_). Parameters without gradient are
-- skipped.
-- Wrapped model (collective): the squares are summed over this rank's slices of the gradient
-- shards, then one all_reduce("sum") gives the global sum (units with strategy "none" hold the
-- same averaged gradient on every rank: their part is added after the all_reduce, once); the
-- gradient shards are scaled.
function optim.clip_grad_norm(model, max_norm)
  if type(max_norm) ~= "number" or not (max_norm > 0 and max_norm < math.huge) then
    raise(("clip_grad_norm: max_norm must be a finite number > 0 (got %s)"):format(tostring(max_norm)))
  end
  local R = wrap_state("clip_grad_norm", model)
  if R then
    R:reduce_held("clip_grad_norm")
    local gshards, pieces = {}, {}
    each_unit(R, "clip_grad_norm", function(u, _, g, slices)
      gshards[#gshards + 1] = g
      for _, s in ipairs(slices) do
        local n = s.shard_last - s.shard_first + 1
        local gs = g:narrow(1, s.shard_first, n)
        local m = slice_mask(s.param, n, s.path)
        if m then core.mask_apply(gs, m) end
        pieces[#pieces + 1] = {gs, u}
      end
    end)
    local total = grad_norm(R, pieces)
    local coef = clip_coef(max_norm, total)
    if coef then
      for i = 1, #gshards do gshards[i]:mul_(coef) end
    end
    return total
  end
  local grads, fresh = {}, {}
  for _, e in ipairs(optim.named_params(model)) do
    local g, new = grad_of(e.param)
    if g ~= nil then
      mask_dense(e.param, g)
      local n = #grads + 1
      grads[n], fresh[n] = g, new
    end
  end
  local pieces = {}
  for i = 1, #grads do pieces[i] = {grads[i]} end
  local total = grad_norm(nil, pieces)
  local coef = clip_coef(max_norm, total)
  if coef then
    for i = 1, #grads do grads[i]:mul_(coef) end
  end
  for i = 1, #grads do
    if fresh[i] then grads[i]:free() end
  end
  return total
end

-- ---- dynamic loss scaling ------------------------------------------------------------------
--
-- GradScaler, as PyTorch's torch.amp.GradScaler. f16 has 5 exponent bits: small gradients
-- underflow to 0 and large ones overflow to inf. The loss is multiplied by a large scale before
-- backward (scaler:scale) and the gradients divided by it before the step (unscale_); a step
-- whose gradients hold an inf or a NaN (the scale was too large) is skipped (no optimizer call:
-- no update, no step count, no state) and update() backs the scale off; after growth_interval
-- clean steps in a row it grows. Per optimizer, between two update() calls: nil (ready),
-- "unscaled" or "stepped", with the overflow flag found at unscaling.
-- Unscaling is one kernel `scale` (t:mul_) and one `sumsq` per gradient buffer: each unit's
-- f32 gradient shard (wrapped) or each p.grad (plain). A sum of squares accumulated in double
-- is finite iff every element is (an f32 square is below 2^256). Wrapped (collective, as
-- clip_grad_norm): one all_reduce("max") of the flag, so every rank takes the same decision
-- and keeps the same scale.

local GradScaler = {}
GradScaler.__index = GradScaler
optim.GradScaler_class = GradScaler

local SCALER_OPTS = {"backoff_factor", "enabled", "growth_factor", "growth_interval", "init_scale"}

-- The checks of the numbers a scaler holds (options and state_dict share them).
local scaler_checks = {
  init_scale = {function(v) return v > 0 and v < math.huge end, "a finite number > 0"},
  scale = {function(v) return v > 0 and v < math.huge end, "a finite number > 0"},
  growth_factor = {function(v) return v > 1 and v < math.huge end, "a finite number > 1"},
  backoff_factor = {function(v) return v > 0 and v < 1 end, "a number in (0, 1)"},
  growth_interval = {function(v) return v >= 1 and v % 1 == 0 and v < math.huge end,
    "an integer >= 1"},
  growth_tracker = {function(v) return v >= 0 and v % 1 == 0 and v < math.huge end,
    "an integer >= 0"},
}

local function scaler_number(fn, t, k, default)
  local v = t[k]
  if v == nil then v = default end
  local c = scaler_checks[k]
  if type(v) ~= "number" or v ~= v or not c[1](v) then
    raise(("%s: %s must be %s (got %s)"):format(fn, k, c[2], tostring(v)))
  end
  return v
end

local function refuse_unknown(fn, t, names)
  local known = {}
  for _, k in ipairs(names) do known[k] = true end
  for k in pairs(t) do
    if not known[k] then
      raise(("%s: unknown option '%s' (valid: %s)"):format(fn, tostring(k), table.concat(names, ", ")))
    end
  end
end

-- GradScaler{init_scale = 2^16, growth_factor = 2, backoff_factor = 0.5, growth_interval = 2000,
-- enabled = true}
function optim.GradScaler(opts)
  local fn = "GradScaler"
  if opts == nil then opts = {} end
  if type(opts) ~= "table" then
    raise(("%s: expects an options table {init_scale =, growth_factor =, backoff_factor =, "
      .. "growth_interval =, enabled =} (got %s)"):format(fn, type(opts)))
  end
  refuse_unknown(fn, opts, SCALER_OPTS)
  local enabled = opts.enabled
  if enabled == nil then enabled = true end
  if type(enabled) ~= "boolean" then
    raise(("%s: enabled must be a boolean (got %s)"):format(fn, tostring(enabled)))
  end
  local self = setmetatable({}, GradScaler)
  self.enabled = enabled
  self._scale = scaler_number(fn, opts, "init_scale", 2 ^ 16)
  self.growth_factor = scaler_number(fn, opts, "growth_factor", 2)
  self.backoff_factor = scaler_number(fn, opts, "backoff_factor", 0.5)
  self.growth_interval = scaler_number(fn, opts, "growth_interval", 2000)
  self.growth_tracker = 0 -- clean steps since the last change of the scale
  self.per_opt = {}       -- optimizer -> {stage = "unscaled" | "stepped", found_inf = bool}
  return self
end

-- The scale the next scale(loss) multiplies by (1 when disabled).
function GradScaler:get_scale() return self.enabled and self._scale or 1.0 end

function GradScaler:is_enabled() return self.enabled end

-- loss * scale, a recorded op (its backward multiplies every gradient by the scale). A bf16 or
-- f16 loss is scaled in f32 (f16 holds at most 65504). Disabled: loss itself.
function GradScaler:scale(loss)
  if not core.is_tensor(loss) then
    raise(("GradScaler:scale: expects the loss tensor (got %s)"):format(type(loss)))
  end
  if not self.enabled then return loss end
  local dt = loss:dtype()
  if dt == "bf16" or dt == "f16" then loss = loss:to("f32") end
  return loss * self._scale
end

local function check_optimizer(opt, what)
  if type(opt) ~= "table" or type(opt.step) ~= "function" or type(opt.params) ~= "table" then
    raise(("GradScaler:%s: expects an fsdp.optim optimizer (SGD, Adam, AdamW, Lion, Adafactor; got %s)")
      :format(what, type(opt)))
  end
end

local function non_finite(sq) return sq ~= sq or sq == math.huge end

-- Multiply every gradient opt steps by inv in place; true when one of them holds an inf or a
-- NaN afterwards (on any rank, wrapped: collective). Masked gradient elements are zeroed first
-- (they are not part of the step; clip_grad_norm's rule).
local function unscale_grads(opt, inv, what)
  local found = false
  local R = opt.wrapped
  if R then
    R:reduce_held(what)
    each_unit(R, what, function(_, _, g, slices)
      for _, s in ipairs(slices) do
        local n = s.shard_last - s.shard_first + 1
        local m = slice_mask(s.param, n, s.path)
        if m then core.mask_apply(g:narrow(1, s.shard_first, n), m) end
      end
      if not opt.subset then
        g:mul_(inv)
        if non_finite(core.sumsq(g)) then found = true end
        return
      end
      -- an optimizer over part of the model unscales its own slices only (another optimizer
      -- over the rest unscales those)
      for _, s in ipairs(slices) do
        if opt.member[s.param] then
          local gs = g:narrow(1, s.shard_first, s.shard_last - s.shard_first + 1)
          gs:mul_(inv)
          if non_finite(core.sumsq(gs)) then found = true end
        end
      end
    end)
    if core.world_size() > 1 then
      found = core.all_reduce(found and 1 or 0, "max", "GradScaler.found_inf") ~= 0
    end
    return found
  end
  for _, e in ipairs(opt.params) do
    local g, fresh = grad_of(e.param)
    if g ~= nil then
      if g:dtype() == "f16" then
        raise(("%s: the gradient of %s is f16: unscaling it in f16 flushes small values to 0; "
          .. "keep f32 parameters and compute in f16 with fsdp.wrap(model, {mp = \"f16\"})")
          :format(what, e.path))
      end
      mask_dense(e.param, g)
      g:mul_(inv)
      if non_finite(core.sumsq(g)) then found = true end
      if fresh then g:free() end
    end
  end
  return found
end

-- Divide opt's gradients by the scale now (before clip_grad_norm, say) and record whether they
-- overflowed; step() then does not unscale again. Once per optimizer between update() calls.
function GradScaler:unscale_(opt)
  check_optimizer(opt, "unscale_")
  if not self.enabled then return end
  local st = self.per_opt[opt]
  if st ~= nil then
    raise(st.stage == "unscaled"
      and "GradScaler:unscale_: already called on this optimizer since the last update()"
      or "GradScaler:unscale_: called after step() on this optimizer; call update() first")
  end
  self.per_opt[opt] = {stage = "unscaled",
    found_inf = unscale_grads(opt, 1 / self._scale, "GradScaler:unscale_")}
end

-- Unscale (unless unscale_ did) and call opt:step() unless a gradient overflowed. Returns true
-- when the optimizer stepped, false when the step was skipped. Disabled: opt:step(), true.
function GradScaler:step(opt)
  check_optimizer(opt, "step")
  if not self.enabled then
    opt:step()
    return true
  end
  local st = self.per_opt[opt]
  if st ~= nil and st.stage == "stepped" then
    raise("GradScaler:step: already called on this optimizer since the last update()")
  end
  if st == nil then
    st = {found_inf = unscale_grads(opt, 1 / self._scale, "GradScaler:step")}
    self.per_opt[opt] = st
  end
  st.stage = "stepped"
  if st.found_inf then return false end
  opt:step()
  return true
end

-- End of an iteration: scale * backoff_factor if any optimizer's gradients overflowed since the
-- last update (the growth count restarts), else one more clean step, and scale * growth_factor
-- after growth_interval of them. update(new_scale) sets the scale instead.
function GradScaler:update(new_scale)
  if not self.enabled then return end
  if new_scale ~= nil then
    self._scale = scaler_number("GradScaler:update", {scale = new_scale}, "scale")
  else
    local any, found = false, false
    for _, st in pairs(self.per_opt) do
      any = true
      if st.found_inf then found = true end
    end
    if not any then
      raise("GradScaler:update: no gradients were unscaled since the last update() "
        .. "(call step(opt) or unscale_(opt) first)")
    end
    if found then
      self._scale = self._scale * self.backoff_factor
      self.growth_tracker = 0
    else
      self.growth_tracker = self.growth_tracker + 1
      if self.growth_tracker >= self.growth_interval then
        self._scale = self._scale * self.growth_factor
        self.growth_tracker = 0
      end
    end
  end
  self.per_opt = {}
end

local SCALER_STATE = {"backoff_factor", "enabled", "growth_factor", "growth_interval",
  "growth_tracker", "kind", "scale"}

-- {kind = "GradScaler", enabled =, scale =, growth_factor =, backoff_factor =,
-- growth_interval =, growth_tracker =} (plain numbers: JSON-able, so fsdp.save's extra holds
-- it); a disabled scaler gives {kind = "GradScaler", enabled = false}.
function GradScaler:state_dict()
  if not self.enabled then return {kind = "GradScaler", enabled = false} end
  return {kind = "GradScaler", enabled = true, scale = self._scale,
    growth_factor = self.growth_factor, backoff_factor = self.backoff_factor,
    growth_interval = self.growth_interval, growth_tracker = self.growth_tracker}
end

-- Restore a state_dict (checked whole before anything changes).
function GradScaler:load_state_dict(sd)
  local fn = "GradScaler:load_state_dict"
  if type(sd) ~= "table" or sd.kind ~= "GradScaler" then
    raise(("%s: expected a GradScaler state_dict (got %s)")
      :format(fn, type(sd) == "table" and ("kind " .. tostring(sd.kind)) or type(sd)))
  end
  refuse_unknown(fn, sd, SCALER_STATE)
  if not self.enabled then raise(fn .. ": this scaler is disabled (enabled = false)") end
  if sd.enabled == false then
    raise(fn .. ": the state_dict was saved from a disabled scaler; it holds no scale")
  end
  local v = {}
  for _, k in ipairs{"scale", "growth_factor", "backoff_factor", "growth_interval",
      "growth_tracker"} do
    v[k] = scaler_number(fn, sd, k)
  end
  self._scale, self.growth_factor, self.backoff_factor = v.scale, v.growth_factor, v.backoff_factor
  self.growth_interval, self.growth_tracker = v.growth_interval, v.growth_tracker
end

-- ---- schedules ---------------------------------------------------------------------------

-- Every schedule is a Schedule: kind, opt, k (steps taken), base_lr, warmup, the kind's own
-- numbers (NUMBERS[kind], saved by state_dict) and after(s, k), its lr once warmup is over.
-- s:lr(k): lr * k / warmup for k <= warmup (linear from 0; no warmup when warmup = 0), then
-- after(s, k). s:step(): k = k + 1 and opt.lr = s:lr(k). Call it once per iteration before
-- opt:step(), so the first update uses s:lr(1). Creating a scheduler sets opt.lr = s:lr(0).

local Schedule = {}
Schedule.__index = Schedule

-- The kind's own numbers, {name, default (nil: required), min, max}, read from the options and
-- saved by state_dict (with warmup).
local NUMBERS = {
  cosine = {{"total", nil, 0}, {"min_lr", 0, 0}},
  linear = {{"total", nil, 0}, {"min_lr", 0, 0}},
  constant = {},
  step_lr = {{"step_size", nil, 1}, {"gamma", 0.1, 0}},
  wsd = {{"total", nil, 0}, {"decay", 0.2, 0, 1}, {"min_lr", 0, 0}},
  lambda = {},
}

-- Set s's numbers (base_lr, warmup, the kind's own) from t, checked: its options when made
-- (lr defaults to the optimizer's, the others to NUMBERS' defaults), a state_dict when loaded
-- (defaults = false: every number must be there).
local function set_numbers(s, t, defaults)
  local kind = s.kind
  s.base_lr = number_opt(kind, t, "lr", defaults and s.opt.lr or nil, 0)
  s.warmup = number_opt(kind, t, "warmup", defaults and 0 or nil, 0)
  for _, n in ipairs(NUMBERS[kind]) do
    s[n[1]] = number_opt(kind, t, n[1], defaults and n[2] or nil, n[3], n[4])
  end
  if s.total ~= nil and s.warmup > s.total then
    raise(("%s: warmup (%s) must be <= total (%s)"):format(kind, s.warmup, s.total))
  end
  if kind == "wsd" and s.warmup > s.total - s.decay * s.total then
    raise(("wsd: warmup (%s) must end before the decay phase starts (step %s of %s)")
      :format(s.warmup, s.total - s.decay * s.total, s.total))
  end
end

-- The scheduler of kind for opt (opt.lr not set yet: start does it).
local function new_schedule(kind, opt, opts, after)
  if type(opt) ~= "table" or opt.lr == nil then raise(kind .. ": first argument must be an optimizer") end
  if opts ~= nil and type(opts) ~= "table" then
    raise(("%s: second argument must be an options table (got %s)"):format(kind, type(opts)))
  end
  opts = opts or {}
  local names = {"lr", "warmup"}
  for _, n in ipairs(NUMBERS[kind]) do names[#names + 1] = n[1] end
  util.check_opts(kind, opts, names)
  local s = setmetatable({kind = kind, opt = opt, k = 0, after = after}, Schedule)
  set_numbers(s, opts, true)
  return s
end

local function start(s)
  s.opt.lr = s:lr(0)
  return s
end

function Schedule:lr(k)
  local warmup = self.warmup
  if warmup > 0 and k <= warmup then return self.base_lr * k / warmup end
  return self.after(self, k)
end

function Schedule:step()
  self.k = self.k + 1
  self.opt.lr = self:lr(self.k)
  return self.opt.lr
end

-- {kind =, step = k, lr = base lr, warmup =, <the kind's numbers>}. A lambda's function is not
-- saved: load its state into a lambda made with the same function.
function Schedule:state_dict()
  local sd = {kind = self.kind, step = self.k, lr = self.base_lr, warmup = self.warmup}
  for _, n in ipairs(NUMBERS[self.kind]) do sd[n[1]] = self[n[1]] end
  return sd
end

-- Why load_state_dict would refuse sd (a message), or nil: a state_dict of this kind, its step
-- an integer >= 0, its numbers what this kind's options accept, and the learning rate at its
-- step computable (a lambda's function runs on it). Changes nothing: fsdp.load asks while
-- staging, before the ranks agree and anything is written.
function Schedule:load_problem(sd)
  if type(sd) ~= "table" or sd.kind ~= self.kind then
    return ("expected a %s schedule's state_dict (got %s)")
      :format(self.kind, type(sd) == "table" and tostring(sd.kind) or type(sd))
  end
  if not util.is_int(sd.step, 0) then
    return ("step must be %s (got %s)"):format(util.int_range(sd.step, 0), util.got(sd.step))
  end
  local trial = setmetatable({kind = self.kind, after = self.after}, Schedule)
  local ok, err = pcall(set_numbers, trial, sd, false)
  if not ok then return (util.message(err):gsub("^" .. self.kind .. ": ", "", 1)) end
  ok, err = pcall(trial.lr, trial, sd.step)
  if not ok then return ("the learning rate at step %d: %s"):format(sd.step, util.message(err)) end
  return nil
end

-- Checked whole (load_problem) before anything changes.
function Schedule:load_state_dict(sd)
  local why = self:load_problem(sd)
  if why then raise(("%s: load_state_dict: %s"):format(self.kind, why)) end
  self.k = sd.step
  set_numbers(self, sd, false)
  self.opt.lr = self:lr(self.k)
end

-- cosine(opt, {warmup = 0, total =, min_lr = 0, lr = opt.lr}) -> scheduler s. After warmup:
-- min_lr + (lr - min_lr) * (1 + cos(pi * (k - warmup) / (total - warmup))) / 2 until k = total,
-- min_lr after.
function optim.cosine(opt, opts)
  return start(new_schedule("cosine", opt, opts, function(self, k)
    if k >= self.total then return self.min_lr end
    local progress = (k - self.warmup) / (self.total - self.warmup)
    return self.min_lr + (self.base_lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
  end))
end

-- linear(opt, {warmup = 0, total =, min_lr = 0, lr = opt.lr}): after warmup, linear from lr
-- down to min_lr at total, min_lr after.
function optim.linear(opt, opts)
  return start(new_schedule("linear", opt, opts, function(self, k)
    if k >= self.total then return self.min_lr end
    return self.min_lr + (self.base_lr - self.min_lr) * (self.total - k) / (self.total - self.warmup)
  end))
end

-- constant(opt, {warmup = 0, lr = opt.lr}): lr after warmup.
function optim.constant(opt, opts)
  return start(new_schedule("constant", opt, opts, function(self) return self.base_lr end))
end

-- step_lr(opt, {step_size =, gamma = 0.1, warmup = 0, lr = opt.lr}): after warmup,
-- lr * gamma ^ floor((k - warmup) / step_size) (PyTorch's StepLR, shifted by the warmup).
function optim.step_lr(opt, opts)
  return start(new_schedule("step_lr", opt, opts, function(self, k)
    return self.base_lr * self.gamma ^ math.floor((k - self.warmup) / self.step_size)
  end))
end

-- wsd(opt, {warmup = 0, total =, decay = 0.2, min_lr = 0, lr = opt.lr}): warmup-stable-decay.
-- After warmup lr until step total - decay * total, then linear down to min_lr at total,
-- min_lr after. The decay phase may not start before warmup ends.
function optim.wsd(opt, opts)
  return start(new_schedule("wsd", opt, opts, function(self, k)
    local from = self.total - self.decay * self.total
    if k >= self.total then return self.min_lr end
    if k <= from then return self.base_lr end
    return self.min_lr + (self.base_lr - self.min_lr) * (self.total - k) / (self.total - from)
  end))
end

-- lambda(opt, fn): lr = fn(k), a number >= 0, for every k from 0 (no warmup of its own).
function optim.lambda(opt, fn)
  if type(fn) ~= "function" then
    raise(("lambda: second argument must be a function of the step (got %s)"):format(type(fn)))
  end
  return start(new_schedule("lambda", opt, nil, function(_, k)
    local v = fn(k)
    if type(v) ~= "number" or v ~= v or v < 0 then
      raise(("lambda: fn(%d) must return a number >= 0 (got %s)"):format(k, tostring(v)))
    end
    return v
  end))
end

return optim
