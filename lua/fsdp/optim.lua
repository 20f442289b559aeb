-- fsdp.optim — optimizers, gradient clipping, learning-rate schedules and loss scaling.
-- See docs/nn.md ("optim").
--
-- Optimizers keep per-parameter state tensors, created lazily on the first step that sees a
-- gradient, and update each parameter with one fused C kernel call (core.sgd_step /
-- core.adamw_step): no per-element Lua. State is keyed by the parameter object, whose
-- identity is stable (invariant 1, docs/ARCHITECTURE.md), and reported by parameter path.
--
-- Every parameter iteration of this file goes through optim.named_params, the one place
-- sharding changes to make optimizers and clip_grad_norm act on shards.
--
-- Sharded models (docs/fsdp.md "Optimizers on shards"). When the
-- model given to an optimizer is a wrapped root (fsdp.wrap), the optimizer never touches
-- parameters: each step walks the units (construction order) and, for each parameter slice of
-- this rank's flat shard (u:local_slices()), runs the same fused kernel on the slice of the
-- shard and of the gradient shard, with state tensors of the slice's size (role optim). The
-- math is elementwise, so this equals the dense update restricted to the slice. Weight-decay
-- exclusions are decided per parameter (path, parameter object) exactly as for a plain model.
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
-- a wrapped model (not its root), or an array holding sharded parameters, is an error: the
-- optimizer must see the whole wrapped model to find the shards.
local function wrap_state(x)
  if is_module(x) then
    local R = state.of(x)
    if R ~= nil and R:model() ~= x then
      raise("this module is part of a wrapped model: give the optimizer the wrapped root")
    end
    return R
  end
  if type(x) == "table" then
    for i, p in ipairs(x) do
      if type(p) == "userdata" and core.param_unit(p) ~= nil then
        raise(("parameter %d is sharded (its model is wrapped): give the optimizer the wrapped "
          .. "model itself"):format(i))
      end
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

-- Calls fn(u, shard, grad_shard, slices) per unit of the wrapped model, construction order.
local function each_unit(R, what, fn)
  for _, u in ipairs(live_units(R, what)) do
    fn(u, u:shard(), u:grad_shard(), u:local_slices())
  end
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
    for i = 1, #u:paths() do
      n = n + 1
      flags[n] = u:has_grad(i) and 1 or 0
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

-- opts[k] (default when nil): a number, not NaN, >= min and <= max where given.
local function number_opt(opts, k, default, min, max)
  local v = opts[k]
  if v == nil then v = default end
  if type(v) ~= "number" or v ~= v or (min and v < min) or (max and v > max) then
    local range = max and (" in [%s, %s]"):format(min, max) or min and (" >= " .. min) or ""
    raise(("%s must be a number%s (got %s)"):format(k, range, tostring(v)))
  end
  return v
end

-- ---- the common optimizer part -------------------------------------------------------------

local Optimizer = {}
Optimizer.__index = Optimizer

local function new_optimizer(cls, kind, model, opts)
  if type(opts) ~= "table" then raise(kind .. ": expects an options table {lr = ...}") end
  local self = setmetatable({}, cls)
  self.kind = kind
  self.model = model
  self.params = optim.named_params(model) -- {path, param}, fixed at construction
  self.state = {}                         -- param -> {step =, <buffers>}
  self.wrapped = wrap_state(model)        -- the wrap root state: step the shards
  self.step_count = 0
  return self
end

-- Drop every parameter's gradient (p.grad = nil); wrapped: also zero every gradient shard.
function Optimizer:zero_grad()
  for _, e in ipairs(self.params) do e.param.grad = nil end
  if self.wrapped then
    each_unit(self.wrapped, "zero_grad", function(u) u:zero_grad() end)
  end
end

-- Wrapped models: fn(st, p_slice, g_slice, param, path) for every parameter slice this rank
-- holds; st is the slice's state table (created with step = 0). With only_grads (a step:
-- collective) the slices of parameters that received no gradient on any rank are left out,
-- as a plain optimizer leaves out a parameter whose p.grad is nil: no update, no weight decay,
-- no state created or changed, no mask applied. fn gets the slice's mask (or nil) as a sixth
-- argument and applies it itself: SGD masks the gradient before its kernel and the weights
-- after it, AdamW passes it to its fused kernel.
function Optimizer:each_slice(fn, only_grads)
  local what = self.kind .. ":step"
  local has = only_grads and agree_grads(self.wrapped, what) or nil
  each_unit(self.wrapped, what, function(u, shard, gshard, slices)
    for _, s in ipairs(slices) do
      if has == nil or has[u][s.index] then
        local n = s.shard_last - s.shard_first + 1
        local p = s.param
        local st = self.state[p]
        if st == nil then
          st = {step = 0}
          self.state[p] = st
          self.slice_of[p] = {param_first = s.param_first, numel = n}
        end
        local ps, gs = shard:narrow(1, s.shard_first, n), gshard:narrow(1, s.shard_first, n)
        fn(st, ps, gs, p, s.path, slice_mask(p, n, s.path))
      end
    end
  end)
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

-- Restore from a state_dict (values are copied into this optimizer's own buffers).
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
  self.step_count, self.lr = sd.step or 0, sd.lr or self.lr
  for k, v in pairs(sd.hyper or {}) do self[k] = v end
  if (sd.sharded == true) ~= (self.wrapped ~= nil) then
    raise(("load_state_dict: the state_dict is %s but this optimizer's model is %s")
      :format(sd.sharded and "sharded" or "dense", self.wrapped and "wrapped" or "not wrapped"))
  end
  if sd.sharded and (sd.world_size ~= core.world_size() or sd.rank ~= core.rank()) then
    raise(("load_state_dict: this sharded state_dict is rank %s of %s; this is rank %d of %d")
      :format(tostring(sd.rank), tostring(sd.world_size), core.rank(), core.world_size()))
  end
  local mine = {}
  if self.wrapped then
    self:each_slice(function() end) -- learn this rank's slices (creates empty states)
    for p, sl in pairs(self.slice_of) do mine[p] = sl end
  end
  self.state = {}
  for path, saved in pairs(sd.state or {}) do
    local p = by_path[path]
    local sl = mine[p]
    if self.wrapped and (sl == nil or sl.param_first ~= saved.param_first or sl.numel ~= saved.numel) then
      raise(("load_state_dict: %s: the saved slice (first %s, %s elements) is not this rank's")
        :format(path, tostring(saved.param_first), tostring(saved.numel)))
    end
    local st = {}
    for k, v in pairs(saved) do
      if type(v) == "userdata" then
        st[k] = sl and slice_zeros(p, sl.numel) or state_zeros(p)
        st[k]:copy(v)
      elseif k ~= "param_first" and k ~= "numel" then
        st[k] = v
      end
    end
    self.state[p] = st
  end
end

-- ---- checkpoint support (the caller is lua/fsdp/checkpoint.lua) ----------------------------
--
-- State as per-parameter flat element ranges, so that a checkpoint can store each rank's
-- slice and load it back at another world size (resharding). Positions are 0-based here.

-- -> array, in parameter order, of {path =, param =, first =, count =, scalars = {step =, ...},
-- tensors = {name = 1-D tensor of count elements (a view of the live buffer)}}: one entry per
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
          tensors[k] = v:view{count}
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

-- Replace the whole state: list as export_slices returns it (param, first, count, scalars,
-- tensors: values are copied into new buffers; parameters absent from the list get no state);
-- info = {step =, lr =, hyper = {...}} restores the optimizer's step count, learning rate and
-- hyper-parameters; info.adopt = true makes the given tensors the state buffers themselves
-- (contiguous, 1-D, count elements, not used by the caller afterwards) instead of copies.
-- Wrapped: each slice must be this rank's slice of the parameter; plain: the whole parameter.
-- Checks everything before changing anything.
function Optimizer:import_slices(list, info)
  local known = {}
  for _, e in ipairs(self.params) do known[e.param] = e.path end
  local mine = {}
  if self.wrapped then
    each_unit(self.wrapped, "import_slices", function(_, _, _, slices)
      for _, s in ipairs(slices) do
        mine[s.param] = {first = s.param_first - 1, count = s.shard_last - s.shard_first + 1}
      end
    end)
  end
  for _, it in ipairs(list) do
    local path = known[it.param]
    if path == nil then raise("import_slices: a parameter this optimizer does not update") end
    local want = self.wrapped and mine[it.param] or {first = 0, count = it.param:numel()}
    if want == nil or want.first ~= it.first or want.count ~= it.count then
      raise(("import_slices: %s: elements [%d, %d) are not this rank's part of the parameter")
        :format(path, it.first, it.first + it.count))
    end
    for k, t in pairs(it.tensors or {}) do
      if t:numel() ~= it.count then
        raise(("import_slices: %s: state %s has %d elements, expected %d")
          :format(path, k, t:numel(), it.count))
      end
    end
  end
  local state, slice_of = {}, {}
  for _, it in ipairs(list) do
    local st = {}
    for k, v in pairs(it.scalars or {}) do st[k] = v end
    if st.step == nil then st.step = 0 end
    for k, t in pairs(it.tensors or {}) do
      if info and info.adopt then
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

-- ---- SGD ---------------------------------------------------------------------------------

local SGD = setmetatable({}, {__index = Optimizer})
SGD.__index = SGD
optim.SGD_class = SGD

-- SGD(model_or_params, {lr =, momentum = 0, weight_decay = 0}) — PyTorch semantics:
-- g = grad + wd * p; buf = momentum * buf + g (buf = g on its first step); p -= lr * buf.
function optim.SGD(model, opts)
  local self = new_optimizer(SGD, "SGD", model, opts)
  self.slice_of = {}
  self.lr = number_opt(opts, "lr", nil, 0)
  self.momentum = number_opt(opts, "momentum", 0, 0)
  self.weight_decay = number_opt(opts, "weight_decay", 0, 0)
  return self
end

function SGD:hyper() return {momentum = self.momentum, weight_decay = self.weight_decay} end

-- One update of every parameter that has a gradient; parameters without one are skipped
-- (wrapped: those that received none on any rank; the step is then collective).
function SGD:step()
  self.step_count = self.step_count + 1
  local lr, momentum, wd = self.lr, self.momentum, self.weight_decay
  if self.wrapped then
    self:each_slice(function(st, p, g, _, _, m)
      local first = false
      if momentum ~= 0 and st.momentum_buffer == nil then
        st.momentum_buffer = core.zeros({p:numel()}, { role = "optim", device = p.device })
        first = true
      end
      st.step = st.step + 1
      if m then core.mask_apply(g, m) end
      core.sgd_step(p, g, st.momentum_buffer, lr, momentum, wd, first)
      if m then core.mask_apply(p, m) end
    end, true)
    return
  end
  for _, e in ipairs(self.params) do
    local p = e.param
    local g, fresh = grad_of(p)
    if g ~= nil then
      local st = self.state[p]
      if st == nil then
        st = {step = 0}
        self.state[p] = st
      end
      local first = false
      if momentum ~= 0 and st.momentum_buffer == nil then
        st.momentum_buffer = state_zeros(p)
        first = true
      end
      st.step = st.step + 1
      mask_dense(p, g)
      core.sgd_step(p, g, st.momentum_buffer, lr, momentum, wd, first)
      mask_dense(p, p)
      if fresh then g:free() end
    end
  end
end

-- ---- AdamW -------------------------------------------------------------------------------

local AdamW = setmetatable({}, {__index = Optimizer})
AdamW.__index = AdamW
optim.AdamW_class = AdamW

-- Parameters with fewer than 2 dimensions (biases, norm scales and shifts) get no weight decay.
function optim.default_no_decay(path, p) return p:dim() < 2 end

-- AdamW(model_or_params, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8, weight_decay = 0.01,
--   no_decay = function(path, p) -> true to exempt p from weight decay}) — decoupled weight
-- decay as in PyTorch's AdamW (p -= lr * wd * p, then the Adam update with bias correction).
function optim.AdamW(model, opts)
  opts = opts or {}
  local self = new_optimizer(AdamW, "AdamW", model, opts)
  self.slice_of = {}
  self.lr = number_opt(opts, "lr", 1e-3, 0)
  local betas = opts.betas or {0.9, 0.999}
  if type(betas) ~= "table" or type(betas[1]) ~= "number" or type(betas[2]) ~= "number"
      or betas[1] < 0 or betas[1] >= 1 or betas[2] < 0 or betas[2] >= 1 then
    raise("AdamW: betas must be {beta1, beta2} with each in [0, 1)")
  end
  self.betas = {betas[1], betas[2]}
  self.eps = number_opt(opts, "eps", 1e-8, 0)
  self.weight_decay = number_opt(opts, "weight_decay", 0.01, 0)
  local no_decay = opts.no_decay or optim.default_no_decay
  if type(no_decay) ~= "function" then raise("AdamW: no_decay must be a function(path, p)") end
  self.decay = {} -- param -> true when weight decay applies
  self.no_decay_paths = {}
  for _, e in ipairs(self.params) do
    if no_decay(e.path, e.param) then
      self.no_decay_paths[#self.no_decay_paths + 1] = e.path
    else
      self.decay[e.param] = true
    end
  end
  return self
end

function AdamW:hyper()
  return {betas = {self.betas[1], self.betas[2]}, eps = self.eps, weight_decay = self.weight_decay}
end

function AdamW:step()
  self.step_count = self.step_count + 1
  local lr, b1, b2, eps, wd = self.lr, self.betas[1], self.betas[2], self.eps, self.weight_decay
  if self.wrapped then
    self:each_slice(function(st, p, g, param, _, m)
      if st.exp_avg == nil then
        st.exp_avg = core.zeros({p:numel()}, { role = "optim", device = p.device })
        st.exp_avg_sq = core.zeros({p:numel()}, { role = "optim", device = p.device })
      end
      st.step = st.step + 1
      core.adamw_step(p, g, st.exp_avg, st.exp_avg_sq, lr, b1, b2, eps,
        self.decay[param] and wd or 0, st.step, m)
    end, true)
    return
  end
  for _, e in ipairs(self.params) do
    local p = e.param
    local g, fresh = grad_of(p)
    if g ~= nil then
      local st = self.state[p]
      if st == nil then
        st = {step = 0, exp_avg = state_zeros(p), exp_avg_sq = state_zeros(p)}
        self.state[p] = st
      end
      st.step = st.step + 1
      -- adamw_step wants p and g contiguous (gradients always are): the whole flat mask fits
      core.adamw_step(p, g, st.exp_avg, st.exp_avg_sq, lr, b1, b2, eps,
        self.decay[p] and wd or 0, st.step, mask.plain_flat(p))
      if fresh then g:free() end
    end
  end
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
  if type(max_norm) ~= "number" or max_norm <= 0 then
    raise(("clip_grad_norm: max_norm must be a positive number (got %s)"):format(tostring(max_norm)))
  end
  local R = wrap_state(model)
  if R then
    local sq_sharded, sq_replicated = 0, 0
    local gshards = {}
    each_unit(R, "clip_grad_norm", function(u, _, g, slices)
      gshards[#gshards + 1] = g
      for _, s in ipairs(slices) do
        local n = s.shard_last - s.shard_first + 1
        local gs = g:narrow(1, s.shard_first, n)
        local m = slice_mask(s.param, n, s.path)
        if m then core.mask_apply(gs, m) end
        local sq = core.sumsq(gs)
        if u:strategy() == "none" then
          sq_replicated = sq_replicated + sq
        elseif util.counts_shard(u) then -- (hybrid: the first group's copy of the shard)
          sq_sharded = sq_sharded + sq
        end
      end
    end)
    local total = math.sqrt(core.all_reduce(sq_sharded, "sum") + sq_replicated)
    local coef = max_norm / (total + 1e-6)
    if coef < 1 then
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
  local sq = 0
  for i = 1, #grads do sq = sq + core.sumsq(grads[i]) end
  local total = math.sqrt(sq)
  local coef = max_norm / (total + 1e-6)
  if coef < 1 then
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
    raise(("GradScaler:%s: expects an fsdp.optim optimizer (SGD, AdamW; got %s)")
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
    each_unit(R, what, function(_, _, g, slices)
      for _, s in ipairs(slices) do
        local n = s.shard_last - s.shard_first + 1
        local m = slice_mask(s.param, n, s.path)
        if m then core.mask_apply(g:narrow(1, s.shard_first, n), m) end
      end
      g:mul_(inv)
      if non_finite(core.sumsq(g)) then found = true end
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

-- The scheduler of kind for opt (opt.lr not set yet: start does it).
local function new_schedule(kind, opt, opts, after)
  if type(opt) ~= "table" or opt.lr == nil then raise(kind .. ": first argument must be an optimizer") end
  if opts ~= nil and type(opts) ~= "table" then
    raise(("%s: second argument must be an options table (got %s)"):format(kind, type(opts)))
  end
  opts = opts or {}
  local s = setmetatable({kind = kind, opt = opt, k = 0, after = after}, Schedule)
  s.base_lr = number_opt(opts, "lr", opt.lr, 0)
  s.warmup = number_opt(opts, "warmup", 0, 0)
  for _, n in ipairs(NUMBERS[kind]) do s[n[1]] = number_opt(opts, n[1], n[2], n[3], n[4]) end
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

function Schedule:load_state_dict(sd)
  if type(sd) ~= "table" or sd.kind ~= self.kind then
    raise(("%s: load_state_dict: expected a %s schedule's state_dict (got %s)")
      :format(self.kind, self.kind, type(sd) == "table" and tostring(sd.kind) or type(sd)))
  end
  self.k, self.base_lr, self.warmup = sd.step, sd.lr, sd.warmup
  for _, n in ipairs(NUMBERS[self.kind]) do self[n[1]] = sd[n[1]] end
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
  local s = new_schedule("wsd", opt, opts, function(self, k)
    local from = self.total - self.decay * self.total
    if k >= self.total then return self.min_lr end
    if k <= from then return self.base_lr end
    return self.min_lr + (self.base_lr - self.min_lr) * (self.total - k) / (self.total - from)
  end)
  if s.warmup > s.total - s.decay * s.total then
    raise(("wsd: warmup (%s) must end before the decay phase starts (step %s of %s)")
      :format(s.warmup, s.total - s.decay * s.total, s.total))
  end
  return start(s)
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
