-- fsdp.wrap — the user-facing sharding layer. docs/fsdp.md is the manual.
--
--   fsdp.wrap(model, opts)   fsdp.unwrap(model)   fsdp.is_wrapped(model)   fsdp.units(model)
--   fsdp.full_params(model, fn, {writeback = true})   fsdp.apply(model, fn)   fsdp.shard(param)
--
-- Everything here is Lua over the C units of fsdp.core (src/fsdp/unit.h, src/lua/l_fsdp.c):
-- this file decides WHICH modules become units (lua/fsdp/policy.lua picks them) and WHICH unit
-- owns each parameter, builds the Root that holds them (lua/fsdp/state.lua), installs the
-- forward hooks that drive a unit's gather/reshard, and walks units for full_params/apply.
-- The state machine itself (gather, reshard, prefetch, tape hooks, reduce-scatter) is C's.
--
-- Invariants:
--   * Wrapping never replaces a module or a parameter object (invariant 1,
--     docs/ARCHITECTURE.md). The tree the user built is the tree that runs; a unit only
--     changes what storage backs the parameters it owns.
--   * Every collective here is issued in an order that depends only on the module tree (the
--     same on every rank): units are created innermost first in post-order, and walked in
--     construction order or in the tree's pre-order, never in the order of a Lua `pairs`.
--   * Before any collective, wrap compares across ranks what it is about to build (units,
--     parameter paths and shapes, ties, meta or not: collective.check_lists): a difference is
--     the same error on every rank, naming the first differing item and the ranks on each side.
--   * Meta parameters (fsdp.meta) are wrapped without storage: their shard slices stay zero
--     and they are pending (Root:has_pending) until fsdp.materialize / wrap{init =} /
--     fsdp.load give them values; a forward, full_params or apply meanwhile is an error, and
--     unwrap puts them back on meta. sync_module_states broadcasts rank 0's values unit by
--     unit, just before each unit takes its slices (meta parameters on other ranks get storage
--     only then).

local core = require "fsdp.core"
local base = require "fsdp.nn.module"
local ckpt = require "fsdp.nn.checkpoint"
local collective = require "fsdp.collective"
local meta = require "fsdp.meta"
local policy = require "fsdp.policy"
local state = require "fsdp.state"
local ties = require "fsdp.ties"
local util = require "fsdp.util"

local raise, is_module, join = util.raise, util.is_module, util.join

local W = {}

W.policy = {modules = policy.modules, size = policy.size, list = policy.list}

-- ---- options ------------------------------------------------------------------------------

-- "replicate" is DDP's name for "none" (parameters whole on every rank, gradients all-reduced)
local strategies = {full = "full", grad_op = "grad_op", none = "none", replicate = "none",
  hybrid = "hybrid"}
local OPTS = {"policy", "strategy", "reshard_after_forward", "prefetch", "sync_module_states",
  "init", "mp", "device", "offload", "checkpoint", "shard_size"}

-- Mixed precision (FSDP2's MixedPrecisionPolicy): mp = "bf16" | "f16" | {param =, reduce =,
-- output =}. param: the dtype units gather parameters in for forward and backward (the
-- all-gather moves it, modules compute in it); reduce: the dtype gradients are reduce-scattered
-- in; output: the dtype the wrapped model's floating outputs are cast to. Shards, gradient
-- shards and optimizer state stay f32. Returns nil (off) or {param =, reduce =, output =}.
local mp_dtypes = {f32 = true, bf16 = true, f16 = true}
local function check_mp(mp)
  if mp == nil or mp == false then return nil end
  if type(mp) == "string" then mp = {param = mp} end
  if type(mp) ~= "table" then
    raise(("fsdp.wrap: mp must be \"bf16\", \"f16\" or a table {param =, reduce =, output =} "
      .. "(got %s)"):format(type(mp)))
  end
  for k in pairs(mp) do
    if k ~= "param" and k ~= "reduce" and k ~= "output" then
      raise(("fsdp.wrap: unknown mp option %s (param, reduce, output)"):format(tostring(k)))
    end
  end
  local out = {param = mp.param or "f32", reduce = mp.reduce or "f32", output = mp.output or "f32"}
  for _, k in ipairs{"param", "output"} do
    if not mp_dtypes[out[k]] then
      raise(("fsdp.wrap: mp.%s must be \"f32\", \"bf16\" or \"f16\" (got %s)"):format(k,
        tostring(out[k])))
    end
  end
  if out.reduce ~= "f32" and out.reduce ~= "bf16" then
    raise(("fsdp.wrap: mp.reduce must be \"f32\" or \"bf16\" (got %s)"):format(tostring(out.reduce)))
  end
  if out.param == "f32" and out.reduce == "f32" and out.output == "f32" then return nil end
  return out
end

local function check_opts(opts)
  opts = util.check_opts("fsdp.wrap", opts, OPTS)
  local o = {
    policy = opts.policy,
    strategy = strategies[opts.strategy or "full"],
    reshard_after_forward = opts.reshard_after_forward ~= false,
    prefetch = opts.prefetch ~= false,
    sync_module_states = opts.sync_module_states == true,
  }
  if not o.strategy then
    raise(("fsdp.wrap: strategy must be \"full\", \"grad_op\", \"none\" or \"hybrid\" "
      .. "(\"replicate\" is another name for \"none\") (got %s)"):format(tostring(opts.strategy)))
  end
  -- hybrid (HSDP): shard inside groups of shard_size consecutive ranks, replicate across them
  if o.strategy == "hybrid" then
    local S, world = opts.shard_size, core.world_size()
    if type(S) ~= "number" or S ~= math.floor(S) or S < 1 then
      raise(("fsdp.wrap: strategy \"hybrid\" needs shard_size, the ranks of a sharding group "
        .. "(a whole number >= 1; got %s)"):format(tostring(S)))
    end
    if world % S ~= 0 then
      raise(("fsdp.wrap: shard_size %d does not divide the world of %d ranks (hybrid shards "
        .. "inside groups of shard_size ranks and replicates across %s groups)")
        :format(S, world, "world / shard_size"))
    end
    o.shard_size = S
  elseif opts.shard_size ~= nil then
    raise(("fsdp.wrap: shard_size is for strategy \"hybrid\" (the strategy is %s)"):format(opts.strategy or o.strategy))
  end
  for _, k in ipairs{"reshard_after_forward", "prefetch", "sync_module_states"} do
    if opts[k] ~= nil and type(opts[k]) ~= "boolean" then
      raise(("fsdp.wrap: %s must be a boolean (got %s)"):format(k, type(opts[k])))
    end
  end
  if opts.init ~= nil and opts.init ~= true and type(opts.init) ~= "function" then
    raise(("fsdp.wrap: init must be a function(module, path) or true (got %s)"):format(type(opts.init)))
  end
  if opts.init ~= nil and o.sync_module_states then
    raise("fsdp.wrap: init and sync_module_states = true both given: with sync_module_states "
      .. "every rank receives rank 0's values (meta parameters on the other ranks included), so "
      .. "init would have nothing to do; drop one")
  end
  o.init = opts.init
  o.mp = check_mp(opts.mp)
  -- device: where the units' buffers go (a model built on meta, materialized there); absent:
  -- the parameters' device, the cpu for meta ones
  if opts.device ~= nil and type(opts.device) ~= "string" then
    raise(("fsdp.wrap: device must be a device name (got %s)"):format(type(opts.device)))
  end
  o.device = opts.device
  -- offload = "cpu": shards, gradient shards and optimizer state in host memory, the optimizer
  -- step on the cpu, each gather copying the shard up to the parameters' device first
  if opts.offload ~= nil and opts.offload ~= false and opts.offload ~= "cpu" then
    raise(("fsdp.wrap: offload must be \"cpu\" (or false) (got %s)"):format(tostring(opts.offload)))
  end
  o.offload = opts.offload == "cpu"
  policy.check(o.policy) -- validates
  -- checkpoint: activation checkpointing of the modules a policy picks (true: of every unit
  -- but the root), marked as nn.checkpoint marks them
  local c = opts.checkpoint
  if c ~= nil and c ~= false and c ~= true and type(c) ~= "function"
      and not policy.is_policy(c) then
    raise(("fsdp.wrap: checkpoint must be fsdp.policy.modules{...}, .size(n), .list{...}, a "
      .. "function(module, path, numel) or true (got %s)"):format(type(c)))
  end
  o.checkpoint = c ~= false and c or nil
  return o
end

-- module -> the Root whose fsdp.wrap{checkpoint =} marked it (weak: a dropped model goes)
local marked_by = setmetatable({}, {__mode = "kv"})

-- ---- choosing owners ----------------------------------------------------------------------

-- The owner of every distinct parameter: the deepest selected module that lies on EVERY
-- reference path of the parameter (its closest common wrapped ancestor). Reference paths are
-- enumerated without deduplicating modules, so a module shared by two parents counts both
-- ways. Returns owner: param -> unit module.
local function compute_owners(model, selected)
  local common = {}  -- param -> array of unit modules common to all its paths (root first)
  local chain, depth_of = {}, {}
  local onstack = {}
  local function visit(m)
    if onstack[m] then return end -- a cycle: the first visit covers it
    onstack[m] = true
    local pushed = false
    if selected[m] then
      chain[#chain + 1] = m
      depth_of[m] = (depth_of[m] or 0) + 1
      pushed = true
    end
    for _, e in ipairs(base.own_entries(m)) do
      local v = e[2]
      if is_module(v) then
        visit(v)
      else
        local c = common[v]
        if c == nil then
          common[v] = {unpack(chain)}
        else
          local kept = {}
          for i = 1, #c do
            if (depth_of[c[i]] or 0) > 0 then kept[#kept + 1] = c[i] end
          end
          common[v] = kept
        end
      end
    end
    if pushed then
      chain[#chain] = nil
      depth_of[m] = depth_of[m] - 1
    end
    onstack[m] = nil
  end
  visit(model)
  local owner = {}
  for p, c in pairs(common) do owner[p] = c[#c] end
  return owner
end

-- Unit modules in post-order (innermost first), with their paths and unit-tree parents.
local function unit_order(model, selected)
  local out, seen = {}, {[model] = true}
  local function visit(m, path, parent)
    local me = parent
    local rec
    if selected[m] then
      rec = {module = m, path = (m == model) and state.ROOT_PATH or path, parent_module = parent}
      me = m
    end
    for _, e in ipairs(base.own_entries(m)) do
      local v = e[2]
      if is_module(v) and not seen[v] then
        seen[v] = true
        visit(v, join(path, e[1]), me)
      end
    end
    if rec then out[#out + 1] = rec end
  end
  visit(model, "", nil)
  return out
end

-- ---- hooks --------------------------------------------------------------------------------

-- Mixed precision at a unit's boundary: floating-point tensor inputs take the param dtype
-- (integer inputs, like token ids, are left alone); the root's floating outputs take the output
-- dtype. The casts are recorded ops, so gradients flow back in each tensor's own dtype. Units
-- of one model may have different policies (an inner wrap keeps its own when an outer wrap
-- absorbs it): then every unit casts its inputs (an f32 unit to f32), and a unit whose param
-- dtype differs from its parent unit's casts its outputs to the parent's, so that the modules
-- computing around it get their own dtype.
local function cast_floats(dtype, ...)
  local n = select("#", ...)
  local args = {...}
  local changed = false
  for i = 1, n do
    local a = args[i]
    if core.is_tensor(a) then
      local dt = a:dtype()
      if dt ~= dtype and (dt == "f32" or dt == "bf16" or dt == "f16" or dt == "f64") then
        args[i] = a:to(dtype)
        changed = true
      end
    end
  end
  if changed then return unpack(args, 1, n) end
end

local function cast_output(dtype, out)
  if not core.is_tensor(out) then return nil end
  local dt = out:dtype()
  if dt == dtype or not (dt == "f32" or dt == "bf16" or dt == "f16") then return nil end
  return out:to(dtype)
end

local function param_dtype(pol) return pol.mp and pol.mp.param or "f32" end

-- Whether a module's output (its first result) carries a gradient back into the unit: a tensor
-- that requires one, a table with such a tensor among its values; anything else (nil, a number)
-- counts as yes, so a unit whose output is not a tensor is never left out of backward.
local function out_needs_grad(out)
  if core.is_tensor(out) then return out.requires_grad end
  if type(out) ~= "table" or util.is_module(out) then return true end
  local any = false
  for _, v in pairs(out) do
    if core.is_tensor(v) then
      if v.requires_grad then return true end
      any = true
    end
  end
  return not any
end

-- The forward hooks of unit u (wrapping `module`, whose parent unit is `parent` or nil);
-- cast_in: the dtype of its inputs (nil: no cast); the root casts its outputs to mp.output,
-- another unit to cast_out (nil: no cast).
-- Internal hooks (nn/module.lua's _add_hook): they keep no tensor, so a unit's intermediates
-- stay releasable.
local function install_hooks(R, u, module, cast_in, cast_out)
  local is_root = module == R:model()
  local mp = R:policy_of(u).mp
  R:add_hook(base._add_hook(module, "pre", function(_, ...)
    if R:busy() then return end -- inside full_params / apply: everything needed is gathered
    if R:has_pending() then error(R:pending_error("forward"), 0) end
    -- a checkpointed region run again in backward: no forward order, no forward prefetch
    if ckpt.recomputing() then u:pre_forward(nil) else u:pre_forward(R:forward_begin(u)) end
    if cast_in then return cast_floats(cast_in, ...) end
  end, true))
  R:add_hook(base._add_hook(module, "post", function(_, out)
    if R:busy() then return end
    u:post_forward(out_needs_grad(out))
    R:forward_end(u)
    if is_root and mp then return cast_output(mp.output, out) end
    if cast_out then return cast_output(cast_out, out) end
  end, true))
end

-- ---- wrap / unwrap ------------------------------------------------------------------------

-- Everything wrap decides from this rank's model alone, before any collective: the units and
-- their parameters and policies, and `entries`, the description ranks compare
-- (collective.check_lists): every unit (construction order) with its mixed-precision policy,
-- and each of its parameters with path, shape, the other paths of a tie, and whether it is on
-- meta (unless sync_module_states gives every rank rank 0's values).
local function plan_wrap(model, o)
  -- Earlier wraps inside this tree: their units become forced boundaries (with their own
  -- policies), and the outer model becomes the root. A wrapped tree that merely overlaps
  -- (its root is outside this model) is an error.
  local members = model:modules()
  local is_member = {}
  for _, m in ipairs(members) do is_member[m] = true end
  local inner, forced = {}, {}
  for _, m in ipairs(members) do
    local R = state.of(m)
    if R ~= nil then
      if R:model() == m then
        inner[#inner + 1] = R
      elseif not is_member[R:model()] then
        raise(("fsdp.wrap: a %s inside this model is part of another wrapped model (a %s); "
          .. "fsdp.unwrap that model first"):format(m:type_name(), R:model():type_name()))
      end
    end
  end
  local inner_unit, inner_pending = {}, {}
  for _, R in ipairs(inner) do
    for _, u in ipairs(R:units()) do
      forced[R:module_of(u)] = R:policy_of(u)
      inner_unit[u] = true
    end
    for _, e in ipairs(R:pending_list()) do inner_pending[e.param] = true end
  end
  local selected = policy.select(model, o.policy, forced)
  -- the modules to checkpoint: the ranks compare them too (a recomputation gathers the units
  -- inside it again, so ranks that differ would issue different collectives)
  local checkpoint = {}
  if o.checkpoint == true then
    for path, m in model:named_modules() do
      if selected[m] and m ~= model then checkpoint[#checkpoint + 1] = {module = m, path = path} end
    end
  elseif o.checkpoint ~= nil then
    checkpoint = policy.select_checkpoint(model, o.checkpoint)
  end
  -- an absorbed inner wrap's checkpoints stay (as its units keep their policies)
  local listed = {}
  for _, c in ipairs(checkpoint) do listed[c.module] = true end
  if #inner > 0 then
    local is_inner = {}
    for _, R in ipairs(inner) do is_inner[R] = true end
    for path, m in model:named_modules() do
      if is_inner[marked_by[m]] and not listed[m] then
        checkpoint[#checkpoint + 1] = {module = m, path = path}
      end
    end
  end
  local paths, params = {}, {}
  for path, p in model:named_parameters() do
    local u = core.param_unit(p)
    if u ~= nil and not inner_unit[u] then
      -- the one case where a parameter has no closest common wrapped ancestor: it is shared
      -- with a model wrapped separately
      raise(("fsdp.wrap: parameter %s is shared with another wrapped model (it belongs to its "
        .. "unit '%s'): a parameter has exactly one owner, the closest wrapped module that "
        .. "contains all its uses, and none contains both models; wrap one module that contains "
        .. "both, or fsdp.unwrap the other model first"):format(path, u.path))
    end
    paths[#paths + 1] = path
    params[#params + 1] = p
  end
  local function is_meta(p) return p.device == "meta" or inner_pending[p] == true end
  if o.sync_module_states and core.rank() == 0 then
    for i, p in ipairs(params) do
      if is_meta(p) then
        raise(("fsdp.wrap: sync_module_states: rank 0's parameter %s is on the meta device; "
          .. "rank 0 must hold the values it broadcasts (build or load the model there, or "
          .. "fsdp.materialize it)"):format(paths[i]))
      end
    end
  end
  local owner = compute_owners(model, selected)
  local recs = unit_order(model, selected)
  local _, all = ties.all_paths(model)
  local entries = {}
  for _, rec in ipairs(recs) do
    local ps, pp = {}, {}
    for i, p in ipairs(params) do
      if owner[p] == rec.module then
        ps[#ps + 1] = p
        pp[#pp + 1] = paths[i]
      end
    end
    rec.ps, rec.pp = ps, pp
    rec.policy = forced[rec.module] or {strategy = o.strategy,
      reshard_after_forward = o.reshard_after_forward, mp = o.mp, offload = o.offload,
      shard_size = o.shard_size}
    if #ps > 0 or rec.module == model then
      -- its mixed-precision policy too: ranks gathering in different dtypes would first meet
      -- in a collective mismatch
      local mp = rec.policy.mp
      entries[#entries + 1] = ("unit '%s'"):format(rec.path) .. (mp and (" with mp param %s, "
        .. "reduce %s, output %s"):format(mp.param, mp.reduce, mp.output) or "")
      for i, p in ipairs(ps) do
        local e = ("parameter %s %s in unit '%s'"):format(pp[i], util.shape_str(p), rec.path)
        local ap = all[p]
        if ap and #ap > 1 then e = e .. " tied to " .. table.concat(ap, ", ", 2) end
        if not o.sync_module_states and is_meta(p) then e = e .. " on meta" end
        entries[#entries + 1] = e
      end
    end
  end
  for _, c in ipairs(checkpoint) do entries[#entries + 1] = "checkpoint " .. c.path end
  return {members = members, inner = inner, recs = recs, entries = entries, checkpoint = checkpoint}
end

-- A sentence for the cross-rank message when two ranks' entries differ only in "on meta".
local function wrap_hint(a, b)
  local x, y = a:gsub(" on meta$", ""), b:gsub(" on meta$", "")
  if x == y and a ~= b then
    return "a parameter is on the meta device on some ranks only: materialize the model on "
      .. "every rank, or pass sync_module_states = true to give every rank rank 0's values"
  end
  return nil
end

-- Collective. Build the units of plan into a new Root (not attached yet). A unit that cannot
-- be built fails on every rank alike (unit_new checks the layout collectively first), so
-- every rank undoes the units made so far, in the same order, and the model is left plain.
local function build(model, o, plan)
  local R = state.new(model, o, plan.members)
  local pending, filled = {}, {}
  local built = {}
  local ok, err = pcall(function()
    for _, rec in ipairs(plan.recs) do
      local m, ps, pp, pol = rec.module, rec.ps, rec.pp, rec.policy
      -- a picked module whose parameters all belong to an ancestor holds nothing: no unit
      if #ps > 0 or m == model then
        if o.sync_module_states then
          -- rank 0's values, one unit at a time: a meta parameter on another rank gets storage
          -- just before its unit takes its slice and frees it (peak: this unit + the shards)
          for i, p in ipairs(ps) do
            if core.rank() ~= 0 and p.device == "meta" then
              core.param_materialize(p, o.device)
              filled[p] = true
            end
            core.broadcast(p, 0, pp[i])
          end
        else
          for _, p in ipairs(ps) do
            if p.device == "meta" then pending[p] = true end
          end
        end
        local u = core.unit_new(rec.path, ps, pp, {strategy = pol.strategy, root = (m == model),
          reshard_after_forward = pol.reshard_after_forward, param_dtype = pol.mp and pol.mp.param,
          reduce_dtype = pol.mp and pol.mp.reduce, device = o.device, offload = pol.offload,
          shard_size = pol.shard_size, overlap_reduce = o.prefetch})
        built[#built + 1] = u
        R:add_unit(u, m, ps, pol)
      end
    end
  end)
  if not ok then
    for _, u in ipairs(built) do pcall(u.unshard, u) end
    for _, set in ipairs{pending, filled} do
      for p in pairs(set) do
        if core.param_unit(p) == nil then pcall(core.param_to_meta, p) end
      end
    end
    util.reraise(err)
  end
  R:set_pending(pending)
  return R
end

-- The hooks of every unit of R, with the casts its mixed-precision policy needs.
local function hook_units(R, plan)
  local units = R:units()
  local mixed = false -- units with different param dtypes (an absorbed inner wrap's)
  for _, u in ipairs(units) do
    if param_dtype(R:policy_of(u)) ~= param_dtype(R:policy_of(units[1])) then mixed = true end
  end
  local parent_of = {}
  for _, rec in ipairs(plan.recs) do parent_of[rec.module] = rec.parent_module end
  for _, u in ipairs(units) do
    local m = R:module_of(u)
    -- parent: the closest selected ancestor that became a unit (the root always is one)
    local pm = parent_of[m]
    while pm ~= nil and R:unit_of(pm) == nil do pm = parent_of[pm] end
    local dt = param_dtype(R:policy_of(u))
    local cast_in, cast_out = nil, nil
    if mixed or dt ~= "f32" then cast_in = dt end
    if m ~= R:model() and pm ~= nil and param_dtype(R:policy_of(R:unit_of(pm))) ~= dt then
      cast_out = param_dtype(R:policy_of(R:unit_of(pm)))
    end
    install_hooks(R, u, m, cast_in, cast_out)
  end
end

--- Collective. Shard `model` in place (see the file header and docs/fsdp.md). Returns model.
function W.wrap(model, opts)
  if not is_module(model) then
    raise(("fsdp.wrap: expected a module (got %s)"):format(type(model)))
  end
  local R0 = state.of(model)
  if R0 ~= nil then
    if R0:model() == model then
      util.note(("fsdp.wrap: the model is already wrapped (%d units, strategy %s); returning it "
        .. "unchanged (fsdp.unwrap it first to wrap it differently)"):format(#R0:units(),
          R0:option("strategy")))
      return model
    end
    raise(("fsdp.wrap: this %s is part of a wrapped model (whose root is a %s); wrap or unwrap "
      .. "that root instead"):format(model:type_name(), R0:model():type_name()))
  end
  local o = check_opts(opts)

  -- Local phase: everything this rank decides from its own model. An error here is not
  -- raised yet: it travels with the cross-rank comparison below, so that every rank fails
  -- with it instead of some waiting in a collective for a rank that gave up.
  local ok0, plan = pcall(plan_wrap, model, o)
  local local_err = (not ok0) and tostring(plan) or nil
  -- Invariant 2: every rank is about to build the same units over the same parameters
  -- (paths, shapes, ties, meta or not): one all_reduce when they agree, an error naming the
  -- first difference and the ranks on each side when not.
  local msg = collective.check_lists("fsdp.wrap", ok0 and plan.entries or {}, local_err,
    {subject = "the model", hint = wrap_hint})
  if msg then util.reraise(msg) end

  -- collective from here on
  for _, inner in ipairs(plan.inner) do inner:teardown() end
  local R = build(model, o, plan)
  hook_units(R, plan)
  -- checkpoint marks this wrap sets (not those nn.checkpoint set before) go at unwrap
  for _, c in ipairs(plan.checkpoint) do
    local m = c.module
    if not ckpt.is_marked(m) then
      ckpt.mark(m, true)
      marked_by[m] = R
      R:add_hook({remove = function()
        ckpt.mark(m, false)
        marked_by[m] = nil
      end})
    end
  end
  R:attach()
  if o.init ~= nil and R:has_pending() then
    local fine, e = pcall(meta.materialize_wrapped, R, o.init ~= true and o.init or nil, "fsdp.wrap")
    if not fine then
      -- every rank failed alike (the init runs agreed, module by module): leave the model plain,
      -- as every other failed wrap does (parameters still waiting for values go back to meta)
      pcall(W.unwrap, model)
      util.reraise(e)
    end
    state.emit("materialize", model)
  end
  return model
end

--- Collective. Gather every unit, give each parameter its own dense storage back, remove the
--- hooks and marks: a plain model again (same module and parameter objects). Returns model.
function W.unwrap(model)
  if not is_module(model) then
    raise(("fsdp.unwrap: expected a module (got %s)"):format(type(model)))
  end
  local R = state.of(model)
  if R == nil then return model end
  if R:model() ~= model then
    raise(("fsdp.unwrap: this %s is part of a wrapped model; unwrap its root (a %s)")
      :format(model:type_name(), R:model():type_name()))
  end
  R:check_idle("fsdp.unwrap")
  if R:in_no_sync() then raise("fsdp.unwrap: not inside fsdp.no_sync") end
  R:check_clean("fsdp.unwrap") -- before teardown changes anything
  R:teardown()
  return model
end

--- true when model is the root of a wrapped model.
function W.is_wrapped(model) return state.root(model) ~= nil end

--- The units of a wrapped model: forward order once a forward ran, else construction order
--- (innermost first, root last). {} for a plain model.
function W.units(model)
  local R = state.of(model)
  if R == nil then return {} end
  return R:forward_units()
end

--- This rank's slice of param as a flat tensor view (writes land in the shard); possibly
--- empty. A parameter of a plain model: the whole parameter, flattened (a view).
function W.shard(param)
  if not util.is_tensor(param) then
    raise(("fsdp.shard: expected a parameter (got %s)"):format(type(param)))
  end
  local u = core.param_unit(param)
  if u == nil then return param:detach():view{param:numel()} end
  local s = util.local_slice(u, param)
  if s == nil then return core.zeros{0} end
  return u:shard():narrow(1, s.shard_first, s.shard_last - s.shard_first + 1)
end

-- ---- full_params and apply ------------------------------------------------------------------

-- The Root of model for a walk `what`, or nil for a plain model; errors while another walk
-- runs or parameters wait for values.
local function walk_root(model, what)
  local R = state.of(model)
  if R == nil then return nil end
  R:check_idle(what)
  if R:has_pending() then raise(R:pending_error(what)) end
  return R
end

--- Collective. fn(model) with full parameters; changes are written back to the shards
--- (writeback = true). model may be the wrapped root (every unit is gathered: the whole model
--- in memory) or a submodule of it (only the units owning parameters of its subtree). Returns
--- fn's first result.
function W.full_params(model, fn, opts)
  if type(fn) ~= "function" then raise("fsdp.full_params: expects (model, fn[, opts])") end
  opts = util.check_opts("fsdp.full_params", opts, {"writeback"})
  local writeback = opts.writeback ~= false
  local R = walk_root(model, "fsdp.full_params")
  if R == nil then return (util.no_grad(fn, model)) end
  local need = {}
  if model == R:model() then
    for _, u in ipairs(R:units()) do need[u] = true end
  else
    for _, p in ipairs(model:parameters()) do
      local u = R:unit_of_param(p)
      if u then need[u] = true end
    end
  end
  return (R:walk("fsdp.full_params", writeback, function(gathered)
    for _, u in ipairs(R:units()) do -- construction order: the same on every rank
      if need[u] then R:gather(u, gathered) end
    end
    return util.no_grad(fn, model)
  end))
end

-- The units above `model` inside R's tree (root first), along its first path from the root.
local function units_above(R, model)
  local chain
  local seen = {[R:model()] = true}
  local function find(m, acc)
    if m == model then chain = acc return true end
    for _, e in ipairs(base.own_entries(m)) do
      local v = e[2]
      if is_module(v) and not seen[v] then
        seen[v] = true
        local a = acc
        if R:unit_of(v) and v ~= model then
          a = {unpack(acc)}
          a[#a + 1] = R:unit_of(v)
        end
        if find(v, a) then return true end
      end
    end
    return false
  end
  find(R:model(), {R:unit_of(R:model())})
  return chain
end

--- Collective. fn(module, path) for every module of model (pre-order, as named_modules), each
--- called while the units on its path from the root are gathered (memory: the largest chain of
--- nested units, not the model); changes are written back to the shards.
function W.apply(model, fn)
  if type(fn) ~= "function" then raise("fsdp.apply: expects (model, fn)") end
  local R = walk_root(model, "fsdp.apply")
  if R == nil then
    util.no_grad(function()
      for path, m in model:named_modules() do fn(m, path) end
    end)
    return model
  end
  R:walk("fsdp.apply", true, function(gathered)
    -- when model is a submodule: first gather the units above it (root first)
    if model ~= R:model() then
      for _, u in ipairs(units_above(R, model)) do R:gather(u, gathered) end
    end
    -- pre-order walk; `gathered` is the stack of units gathered on the current path, so an
    -- error anywhere leaves exactly those for the restore below
    local seen = {[model] = true}
    local function visit(m, path)
      local u = R:unit_of(m)
      if u then R:gather(u, gathered) end
      -- agreed at every module: a rank whose fn failed must not leave the others gathering
      R:call_agreed("fsdp.apply", util.no_grad, fn, m, path)
      for _, entry in ipairs(base.own_entries(m)) do
        local v = entry[2]
        if is_module(v) and not seen[v] then
          seen[v] = true
          visit(v, join(path, entry[1]))
        end
      end
      if u then
        R:restore({gathered[#gathered]}, true, true)
        gathered[#gathered] = nil
      end
    end
    visit(model, "")
  end)
  return model
end

return W
