-- fsdp.optim — optimizers, gradient clipping and learning-rate schedules (owner: masks, since
-- wave 2; written by nn and wrap).
-- See docs/nn.md ("optim").
--
-- Optimizers keep per-parameter state tensors, created lazily on the first step that sees a
-- gradient, and update each parameter with one fused C kernel call (fsdp.core.sgd_step /
-- fsdp.core.adamw_step): no per-element Lua. State is keyed by the parameter object, whose
-- identity is stable (DESIGN.md, invariant 1), and reported by parameter path.
--
-- Every parameter iteration of this file goes through optim.named_params, the one place
-- sharding changes to make optimizers and clip_grad_norm act on shards.
--
-- Sharded models (owner of this part: wrap; docs/fsdp.md "Optimizers on shards"). When the
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
-- Masks (owner of this file now: masks; lua/fsdp/mask.lua, docs/pruning.md): a parameter with
-- a mask has its gradient (shard slice) masked before the update kernel and its weights (shard
-- slice) masked after it, so a pruned weight stays exactly 0 through momentum, Adam moments and
-- weight decay; clip_grad_norm masks gradients before measuring them. Without fsdp.mask loaded
-- no parameter has a mask and nothing extra runs.

local fsdp = require "fsdp"

local optim = {}

local function is_module(x)
  local nn = package.loaded["fsdp.nn"]
  return nn ~= nil and nn.is_module(x)
end

local function where()
  local nn_module = package.loaded["fsdp.nn.module"]
  return nn_module and nn_module.user_where() or ""
end

local function raise(msg) error(where() .. msg, 0) end

-- The wrap root state of model when it is a wrapped root, else nil. A module inside a wrapped
-- model (not its root), or an array holding sharded parameters, is an error: the optimizer
-- must see the whole wrapped model to find the shards.
local function wrap_state(x)
  local w = package.loaded["fsdp.wrap"]
  if w == nil then return nil end
  if is_module(x) then
    local R = w._root_state(x)
    if R == nil and rawget(x, "__fsdp_wrap") ~= nil and not rawget(x, "__fsdp_wrap").dead then
      raise("this module is part of a wrapped model: give the optimizer the wrapped root")
    end
    return R
  end
  local core = fsdp.core
  if type(x) == "table" and core.param_unit then
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

-- The mask record of parameter p (lua/fsdp/mask.lua), or nil. fsdp.mask is only consulted once
-- something loaded it (no mask can exist before).
local function mask_record(p)
  local mk = package.loaded["fsdp.mask"]
  return mk and mk._record(p)
end

-- This rank's mask slice for a shard slice of n elements of p, or nil.
local function slice_mask(p, n, path)
  local rec = mask_record(p)
  if rec == nil or not rec.sharded or rec.slice == nil then return nil end
  if rec.n ~= n then
    raise(("%s: the mask holds %d elements of this rank's slice, the shard %d (the model was "
      .. "re-wrapped without its masks?)"):format(path, rec.n, n))
  end
  return rec.slice
end

-- Mask a dense parameter's gradient (before a step) or values (after it).
local function mask_dense(p, x)
  local rec = mask_record(p)
  if rec ~= nil and not rec.sharded then package.loaded["fsdp.mask"]._apply_plain(rec, x) end
end

-- The wrapped model's units (construction order), checking the wrap is still the one the
-- optimizer was made for.
local function live_units(R, what)
  if R.dead then
    raise(what .. ": the model was unwrapped (or re-wrapped) after this optimizer was created; "
      .. "create a new optimizer")
  end
  return R.units
end

-- Calls fn(U, shard, grad_shard, slices) per unit of the wrapped model, construction order.
local function each_unit(R, what, fn)
  for _, U in ipairs(live_units(R, what)) do
    local u = U.unit
    fn(U, u:shard(), u:grad_shard(), u:local_slices())
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
  for _, U in ipairs(units) do
    for i = 1, #U.unit:paths() do
      n = n + 1
      flags[n] = U.unit:has_grad(i) and 1 or 0
    end
  end
  if n > 0 and fsdp.world_size() > 1 then
    flags = fsdp.all_reduce(fsdp.tensor(flags), "max", "optim.has_grad"):totable()
  end
  local has, k = {}, 0
  for _, U in ipairs(units) do
    local h = {}
    for i = 1, #U.unit:paths() do
      k = k + 1
      if flags[k] ~= 0 then h[i] = true end
    end
    has[U] = h
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

-- Optimizer state buffers: zeros shaped like p (one place, so accounting can tag them).
local function state_zeros(p)
  return fsdp.zeros(p:shape(), { role = "optim" })
end

local function number_opt(opts, k, default, min)
  local v = opts[k]
  if v == nil then v = default end
  if type(v) ~= "number" or v ~= v or (min and v < min) then
    raise(("%s must be a number%s (got %s)"):format(k, min and (" >= " .. min) or "", tostring(v)))
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
    each_unit(self.wrapped, "zero_grad", function(U) U.unit:zero_grad() end)
  end
end

-- Wrapped models: fn(st, p_slice, g_slice, param, path) for every parameter slice this rank
-- holds; st is the slice's state table (created with step = 0). With only_grads (a step:
-- collective) the slices of parameters that received no gradient on any rank are left out,
-- as a plain optimizer leaves out a parameter whose p.grad is nil: no update, no weight decay,
-- no state created or changed, no mask applied.
function Optimizer:each_slice(fn, only_grads)
  local what = self.kind .. ":step"
  local has = only_grads and agree_grads(self.wrapped, what) or nil
  each_unit(self.wrapped, what, function(U, shard, gshard, slices)
    for _, s in ipairs(slices) do
      if has == nil or has[U][s.index] then
        local n = s.shard_last - s.shard_first + 1
        local p = s.param
        local st = self.state[p]
        if st == nil then
          st = {step = 0}
          self.state[p] = st
          self.slice_of[p] = {param_first = s.param_first, numel = n}
        end
        local ps, gs = shard:narrow(1, s.shard_first, n), gshard:narrow(1, s.shard_first, n)
        local m = slice_mask(p, n, s.path)
        if m then fsdp.core.mask_apply(gs, m) end
        fn(st, ps, gs, p, s.path)
        if m then fsdp.core.mask_apply(ps, m) end
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
    sd.sharded, sd.rank, sd.world_size = true, fsdp.rank(), fsdp.world_size()
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
  if sd.sharded and (sd.world_size ~= fsdp.world_size() or sd.rank ~= fsdp.rank()) then
    raise(("load_state_dict: this sharded state_dict is rank %s of %s; this is rank %d of %d")
      :format(tostring(sd.rank), tostring(sd.world_size), fsdp.rank(), fsdp.world_size()))
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
        st[k] = sl and fsdp.zeros({sl.numel}, { role = "optim" }) or state_zeros(p)
        st[k]:copy(v)
      elseif k ~= "param_first" and k ~= "numel" then
        st[k] = v
      end
    end
    self.state[p] = st
  end
end

-- ---- checkpoint support (added by ckpt; the caller is lua/fsdp/checkpoint.lua) -------------
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
        local buf = self.wrapped and fsdp.zeros({it.count}, { role = "optim" }) or state_zeros(it.param)
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
    self:each_slice(function(st, p, g)
      local first = false
      if momentum ~= 0 and st.momentum_buffer == nil then
        st.momentum_buffer = fsdp.zeros({p:numel()}, { role = "optim" })
        first = true
      end
      st.step = st.step + 1
      fsdp.core.sgd_step(p, g, st.momentum_buffer, lr, momentum, wd, first)
    end, true)
    return
  end
  for _, e in ipairs(self.params) do
    local p = e.param
    local g = p.grad
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
      fsdp.core.sgd_step(p, g, st.momentum_buffer, lr, momentum, wd, first)
      mask_dense(p, p)
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
    self:each_slice(function(st, p, g, param)
      if st.exp_avg == nil then
        st.exp_avg = fsdp.zeros({p:numel()}, { role = "optim" })
        st.exp_avg_sq = fsdp.zeros({p:numel()}, { role = "optim" })
      end
      st.step = st.step + 1
      fsdp.core.adamw_step(p, g, st.exp_avg, st.exp_avg_sq, lr, b1, b2, eps,
        self.decay[param] and wd or 0, st.step)
    end, true)
    return
  end
  for _, e in ipairs(self.params) do
    local p = e.param
    local g = p.grad
    if g ~= nil then
      local st = self.state[p]
      if st == nil then
        st = {step = 0, exp_avg = state_zeros(p), exp_avg_sq = state_zeros(p)}
        self.state[p] = st
      end
      st.step = st.step + 1
      mask_dense(p, g)
      fsdp.core.adamw_step(p, g, st.exp_avg, st.exp_avg_sq, lr, b1, b2, eps,
        self.decay[p] and wd or 0, st.step)
      mask_dense(p, p)
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
    each_unit(R, "clip_grad_norm", function(U, _, g, slices)
      gshards[#gshards + 1] = g
      for _, s in ipairs(slices) do
        local n = s.shard_last - s.shard_first + 1
        local gs = g:narrow(1, s.shard_first, n)
        local m = slice_mask(s.param, n, s.path)
        if m then fsdp.core.mask_apply(gs, m) end
        local sq = fsdp.core.sumsq(gs)
        if U.strategy == "none" then
          sq_replicated = sq_replicated + sq
        else
          sq_sharded = sq_sharded + sq
        end
      end
    end)
    local total = math.sqrt(fsdp.all_reduce(sq_sharded, "sum") + sq_replicated)
    local coef = max_norm / (total + 1e-6)
    if coef < 1 then
      for i = 1, #gshards do gshards[i]:mul_(coef) end
    end
    return total
  end
  local grads = {}
  for _, e in ipairs(optim.named_params(model)) do
    local g = e.param.grad
    if g ~= nil then
      mask_dense(e.param, g)
      grads[#grads + 1] = g
    end
  end
  local sq = 0
  for i = 1, #grads do sq = sq + fsdp.core.sumsq(grads[i]) end
  local total = math.sqrt(sq)
  local coef = max_norm / (total + 1e-6)
  if coef < 1 then
    for i = 1, #grads do grads[i]:mul_(coef) end
  end
  return total
end

-- ---- schedules ---------------------------------------------------------------------------

local Cosine = {}
Cosine.__index = Cosine

-- cosine(opt, {warmup = 0, total =, min_lr = 0, lr = opt.lr}) -> scheduler s.
--   s:lr(k): lr * k / warmup for k <= warmup (linear from 0), then
--            min_lr + (lr - min_lr) * (1 + cos(pi * (k - warmup) / (total - warmup))) / 2
--            until k = total, min_lr after.
--   s:step(): k = k + 1 and opt.lr = s:lr(k). Call it once per iteration before opt:step(), so
--   the first update uses s:lr(1). Creating the scheduler sets opt.lr = s:lr(0).
function optim.cosine(opt, opts)
  if type(opt) ~= "table" or opt.lr == nil then raise("cosine: first argument must be an optimizer") end
  opts = opts or {}
  local s = setmetatable({opt = opt, k = 0}, Cosine)
  s.base_lr = number_opt(opts, "lr", opt.lr, 0)
  s.warmup = number_opt(opts, "warmup", 0, 0)
  s.total = number_opt(opts, "total", nil, 0)
  s.min_lr = number_opt(opts, "min_lr", 0, 0)
  opt.lr = s:lr(0)
  return s
end

function Cosine:lr(k)
  local lr, warmup, total = self.base_lr, self.warmup, self.total
  if warmup > 0 and k <= warmup then return lr * k / warmup end
  if k >= total then return self.min_lr end
  local progress = (k - warmup) / (total - warmup)
  return self.min_lr + (lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
end

function Cosine:step()
  self.k = self.k + 1
  self.opt.lr = self:lr(self.k)
  return self.opt.lr
end

function Cosine:state_dict()
  return {kind = "cosine", step = self.k, warmup = self.warmup, total = self.total,
    min_lr = self.min_lr, lr = self.base_lr}
end

function Cosine:load_state_dict(sd)
  self.k, self.warmup, self.total = sd.step, sd.warmup, sd.total
  self.min_lr, self.base_lr = sd.min_lr, sd.lr
  self.opt.lr = self:lr(self.k)
end

return optim
