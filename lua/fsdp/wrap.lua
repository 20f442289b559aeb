-- fsdp.wrap — the user-facing sharding layer. docs/fsdp.md is the manual.
--
--   fsdp.wrap(model, opts)   fsdp.unwrap(model)   fsdp.is_wrapped(model)   fsdp.units(model)
--   fsdp.full_params(model, fn, {writeback = true})   fsdp.apply(model, fn)
--   fsdp.policy.modules{...} / .size(n) / .list{...}   fsdp.shard(param)   fsdp.inspect(x)
--
-- Everything here is Lua over the C units of fsdp.core (src/fsdp/unit.h, src/lua/l_fsdp.c):
-- this file decides WHICH modules become units and WHICH unit owns each parameter, installs
-- the forward hooks that drive a unit's gather/reshard, and walks units for full_params/apply.
-- The state machine itself (gather, reshard, prefetch, tape hooks, reduce-scatter) is C's.
--
-- Invariants:
--   * Wrapping never replaces a module or a parameter object (invariant 1, docs/ARCHITECTURE.md). The tree
--     the user built is the tree that runs; a unit only changes what storage backs the
--     parameters it owns. So #model:parameters() and saved references are unaffected.
--   * Every collective here is issued in an order that depends only on the module tree (the
--     same on every rank): units are created innermost first in post-order, and walked in
--     construction order or in the tree's pre-order, never in the order of a Lua `pairs`.
--   * Marks: every module of a wrapped tree carries the raw field `__fsdp_wrap` = the root's
--     state R (a raw field rather than a weak table, so a dropped model is collectable);
--     unwrap removes it. R.unit_of[module] is the unit record of a module that is a unit.
--
--   * Before any collective, wrap compares across ranks what it is about to build (units,
--     parameter paths and shapes, ties, meta or not: meta.lua's _agree): a difference is the
--     same error on every rank, naming the first differing item and the ranks on each side.
--   * Meta parameters (fsdp.meta) are wrapped without storage: their shard slices stay zero
--     and they are "pending" (R.pending) until fsdp.materialize / wrap{init =} / fsdp.load give
--     them values; a forward, full_params or apply meanwhile is an error, and unwrap puts them
--     back on meta. sync_module_states broadcasts rank 0's values unit by unit, just before
--     each unit takes its slices (meta parameters on other ranks get storage only then).
--
-- Unit records (U): {unit = <core unit>, module =, path =, parent = U or nil, hooks = {...},
-- strategy =, params =}. R: {model =, opts =, units = {U...} (construction order), unit_of =
-- {}, unit_of_param = {}, order = {U...} or nil (forward order, recorded on the first
-- forward), busy = nil | what, pending = nil | {param = true}, mixed = nil | true (units with
-- different mixed-precision param dtypes)}.

local fsdp = require "fsdp"
local core = require "fsdp.core"

local W = {}

local MARK = "__fsdp_wrap"
local ROOT_PATH = "(root)" -- the root unit's path (a label in collectives and reports)

local function nnmod() return require "fsdp.nn" end
local function base() return require "fsdp.nn.module" end

local function raise(msg) base().raise(msg) end

local function is_module(x) return base().is_module(x) end

local function join(prefix, name)
  if prefix == "" then return tostring(name) end
  return prefix .. "." .. tostring(name)
end

-- a note on rank 0 that does not break a progress line
local function note(msg) fsdp.log.print(msg) end

local function own_entries(m) return require("fsdp.nn.module").own_entries(m) end

-- The root state of a module's wrapped tree, or nil.
local function state_of(m)
  if type(m) ~= "table" then return nil end
  local R = rawget(m, MARK)
  if R ~= nil and R.dead then return nil end
  return R
end

-- ---- policies -----------------------------------------------------------------------------
--
-- A policy is a table {name =, select = function(module, path, numel) -> bool}: asked for
-- every module below the root, bottom-up (children before parents), with numel = the number
-- of parameter elements of the module's subtree not already claimed by a selected
-- descendant. A plain function(module, path, numel) is accepted as a policy too.

local Policy = {}
Policy.__index = Policy
Policy.__tostring = function(p) return "fsdp.policy." .. p.name end

local function new_policy(name, select) return setmetatable({name = name, select = select}, Policy) end

W.policy = {}

-- modules{Class, ...}: every module that is an instance of one of the classes (or subclasses).
function W.policy.modules(classes)
  if type(classes) ~= "table" or #classes == 0 then
    raise("fsdp.policy.modules: expects a list of module classes, e.g. {nn.Block}")
  end
  local names = {}
  for i, c in ipairs(classes) do
    if type(c) ~= "table" or rawget(c, "__name") == nil then
      raise(("fsdp.policy.modules: element %d is not a module class (got %s)"):format(i, type(c)))
    end
    names[#names + 1] = "nn." .. rawget(c, "__name")
  end
  local nn = nnmod()
  return new_policy("modules{" .. table.concat(names, ", ") .. "}", function(m)
    for _, c in ipairs(classes) do
      if nn.isinstance(m, c) then return true end
    end
    return false
  end)
end

-- size(min_params): a module whose unclaimed parameter elements number at least min_params
-- (like PyTorch's size_based_auto_wrap_policy; decided bottom-up).
function W.policy.size(min_params)
  if type(min_params) ~= "number" or min_params < 1 then
    raise(("fsdp.policy.size: min_params must be a number >= 1 (got %s)"):format(tostring(min_params)))
  end
  return new_policy(("size(%d)"):format(min_params), function(_, _, numel)
    return numel >= min_params
  end)
end

-- list{m1, m2, ...}: exactly these module objects (each must be part of the wrapped model).
function W.policy.list(mods)
  if type(mods) ~= "table" then raise("fsdp.policy.list: expects a list of modules") end
  local set = {}
  for i, m in ipairs(mods) do
    if not is_module(m) then
      raise(("fsdp.policy.list: element %d is not a module (got %s)"):format(i, type(m)))
    end
    set[m] = i
  end
  local p = new_policy(("list{%d modules}"):format(#mods), function(m) return set[m] ~= nil end)
  p.modules = mods
  return p
end

local function policy_fn(policy)
  if policy == nil then return nil end
  if type(policy) == "function" then return policy end
  if getmetatable(policy) == Policy then return policy.select end
  raise("fsdp.wrap: policy must be fsdp.policy.modules{...}, .size(n), .list{...} or a function")
end

-- ---- options ------------------------------------------------------------------------------

local strategies = {full = true, grad_op = true, none = true}
local known_opts = {policy = true, strategy = true, reshard_after_forward = true, prefetch = true,
  sync_module_states = true, init = true, mp = true, device = true, offload = true}

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
  opts = opts or {}
  if type(opts) ~= "table" then raise("fsdp.wrap: options must be a table") end
  for k in pairs(opts) do
    if not known_opts[k] then
      raise(("fsdp.wrap: unknown option %s (policy, strategy, reshard_after_forward, prefetch, "
        .. "sync_module_states, init, mp, device, offload)"):format(tostring(k)))
    end
  end
  local o = {
    policy = opts.policy,
    strategy = opts.strategy or "full",
    reshard_after_forward = opts.reshard_after_forward ~= false,
    prefetch = opts.prefetch ~= false,
    sync_module_states = opts.sync_module_states == true,
  }
  if not strategies[o.strategy] then
    raise(("fsdp.wrap: strategy must be \"full\", \"grad_op\" or \"none\" (got %s)")
      :format(tostring(opts.strategy)))
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
  policy_fn(o.policy) -- validates
  return o
end

-- ---- choosing units and owners ------------------------------------------------------------

-- Selected unit modules: root, forced ones (inner units of an earlier wrap) and the policy's.
-- Returns set module -> true.
local function select_units(model, policy, forced)
  local selected = {[model] = true}
  for m in pairs(forced) do selected[m] = true end
  local select = policy_fn(policy)
  local nn = nnmod()
  local seen = {[model] = true}
  -- post-order: returns the set of unclaimed parameters of m's subtree (param -> numel)
  local function visit(m, path)
    local unclaimed = {}
    for _, e in ipairs(own_entries(m)) do
      local name, v = e[1], e[2]
      if not seen[v] then
        seen[v] = true
        if is_module(v) then
          local sub = visit(v, join(path, name))
          for p, n in pairs(sub) do unclaimed[p] = n end
        else
          unclaimed[v] = v:numel()
        end
      end
    end
    if m ~= model then
      if not selected[m] and select then
        local numel = 0
        for _, n in pairs(unclaimed) do numel = numel + n end
        if select(m, path, numel) then selected[m] = true end
      end
      if selected[m] then
        if nn.isinstance(m, nn.ModuleList) then
          raise(("fsdp.wrap: the policy picked %s (ModuleList), which has no forward: its "
            .. "parameters could never be gathered; pick its elements instead"):format(path))
        end
        return {}
      end
    end
    return unclaimed
  end
  visit(model, "")
  if getmetatable(policy) == Policy and policy.modules then
    for i, m in ipairs(policy.modules) do
      if not seen[m] and m ~= model then
        raise(("fsdp.policy.list: module %d (%s) is not part of the wrapped model"):format(i, m:type_name()))
      end
    end
  end
  return selected
end

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
    for _, e in ipairs(own_entries(m)) do
      local v = e[2]
      if is_module(v) then
        visit(v)
      else
        local c = common[v]
        if c == nil then
          local copy = {}
          for i = 1, #chain do copy[i] = chain[i] end
          common[v] = copy
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
      rec = {module = m, path = (m == model) and ROOT_PATH or path, parent_module = parent}
      me = m
    end
    for _, e in ipairs(own_entries(m)) do
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

-- ---- hooks: forward order and prefetch ----------------------------------------------------

-- The first forward of the root records two orders: `order`, the order in which units START
-- their forward (pre hooks: the forward prefetch chain, and fsdp.units), and the order in
-- which they FINISH it (post hooks). Backward meets the units' "end" hooks in the reverse of
-- the finish order, so that reversed list is the backward prefetch chain: each unit
-- prefetches the one whose backward comes next. Units never called come last, in
-- construction order, and take part in no chain.
local function finish_recording(R)
  local order, done = R.recording, R.recording_post
  R.recording, R.recording_post, R.recorded, R.finished = nil, nil, nil, nil
  local called = {}
  for _, U in ipairs(order) do called[U] = true end
  local all = {}
  for _, U in ipairs(order) do all[#all + 1] = U end
  for _, U in ipairs(R.units) do
    if not called[U] then all[#all + 1] = U end
  end
  R.order = all
  R.next = {}
  for i, U in ipairs(order) do R.next[U] = order[i + 1] end
  if R.opts.prefetch then
    for i = #done, 1, -1 do
      local nxt = done[i - 1]
      done[i].unit:set_backward_prefetch(nxt and nxt.unit or nil)
    end
  end
end

-- The message for using a model whose meta parameters never got values (their shards hold
-- zeros, which must never pass for a model).
local function pending_error(R, what)
  local n, first = 0, nil
  for _, U in ipairs(R.units) do
    local paths = U.unit:paths()
    for i, p in ipairs(U.params) do
      if R.pending[p] then
        n = n + 1
        first = first or paths[i]
      end
    end
  end
  return ("%s: %d parameter%s of this model %s still on the meta device (first: %s): give "
    .. "them values with fsdp.materialize(model[, init_fn]) or fsdp.load, or wrap with init = "
    .. "... or sync_module_states = true"):format(what, n, n == 1 and "" or "s",
      n == 1 and "is" or "are", tostring(first))
end

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

local function param_dtype(U) return U.mp and U.mp.param or "f32" end

local function install_hooks(R, U)
  local is_root = U.module == R.model
  -- the dtype of its inputs (nil: no cast) and of a non-root unit's outputs (nil: no cast)
  local cast_in, cast_out = nil, nil
  if R.mixed or param_dtype(U) ~= "f32" then cast_in = param_dtype(U) end
  if not is_root and U.parent and param_dtype(U.parent) ~= param_dtype(U) then
    cast_out = param_dtype(U.parent)
  end
  -- internal hooks (module.lua): they keep no tensor, so a unit's intermediates stay releasable
  local pre = base()._add_hook(U.module, "pre", function(_, ...)
    if R.busy then return end -- inside full_params / apply: everything needed is gathered
    if R.pending then error(pending_error(R, "forward"), 0) end
    if is_root and R.order == nil then
      R.recording, R.recording_post, R.recorded, R.finished = {}, {}, {}, {}
    end
    if R.recording and not R.recorded[U] then
      R.recorded[U] = true
      R.recording[#R.recording + 1] = U
    end
    local nxt = R.opts.prefetch and R.next and R.next[U]
    U.unit:pre_forward(nxt and nxt.unit or nil)
    if cast_in then return cast_floats(cast_in, ...) end
  end, true)
  local post = base()._add_hook(U.module, "post", function(_, out)
    if R.busy then return end
    U.unit:post_forward()
    if R.recording and not R.finished[U] then
      R.finished[U] = true
      R.recording_post[#R.recording_post + 1] = U
    end
    if is_root and R.recording then finish_recording(R) end
    if is_root and U.mp then return cast_output(U.mp.output, out) end
    if cast_out then return cast_output(cast_out, out) end
  end, true)
  U.hooks = {pre, post}
end

-- ---- wrap / unwrap ------------------------------------------------------------------------

local function shape_str(t) return "(" .. table.concat(t:shape(), ", ") .. ")" end

-- Everything wrap decides from this rank's model alone, before any collective: the units and
-- their parameters, and `entries`, the description ranks compare (meta.lua, _agree): every
-- unit (construction order) with its mixed-precision policy, and each of its parameters with
-- path, shape, the other paths of a tie, and whether it is on meta (unless sync_module_states
-- gives every rank rank 0's values).
local function plan_wrap(model, o)
  local meta = require "fsdp.meta"
  -- Earlier wraps inside this tree: their units become forced boundaries (with their own
  -- strategy), and the outer model becomes the root. A wrapped tree that merely overlaps
  -- (its root is outside this model) is an error.
  local members = model:modules()
  local is_member = {}
  for _, m in ipairs(members) do is_member[m] = true end
  local inner, forced = {}, {}
  for _, m in ipairs(members) do
    local R = state_of(m)
    if R ~= nil then
      if R.model == m then
        inner[#inner + 1] = R
      elseif not is_member[R.model] then
        raise(("fsdp.wrap: a %s inside this model is part of another wrapped model (a %s); "
          .. "fsdp.unwrap that model first"):format(m:type_name(), R.model:type_name()))
      end
    end
  end
  local inner_unit, inner_pending = {}, {}
  for _, R in ipairs(inner) do
    for _, U in ipairs(R.units) do
      forced[U.module] = {strategy = U.strategy, reshard_after_forward = R.opts.reshard_after_forward,
        mp = R.opts.mp, offload = R.opts.offload}
      inner_unit[U.unit] = true
    end
    for p in pairs(R.pending or {}) do inner_pending[p] = true end
  end
  local selected = select_units(model, o.policy, forced)
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
  if o.sync_module_states and fsdp.rank() == 0 then
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
  local _, all = meta._all_paths(model)
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
    if #ps > 0 or rec.module == model then
      -- its mixed-precision policy too: ranks gathering in different dtypes would first meet
      -- in a collective mismatch
      local f = forced[rec.module]
      local mp
      if f then mp = f.mp else mp = o.mp end
      entries[#entries + 1] = ("unit '%s'"):format(rec.path) .. (mp and (" with mp param %s, "
        .. "reduce %s, output %s"):format(mp.param, mp.reduce, mp.output) or "")
      for i, p in ipairs(ps) do
        local e = ("parameter %s %s in unit '%s'"):format(pp[i], shape_str(p), rec.path)
        local ap = all[p]
        if ap and #ap > 1 then e = e .. " tied to " .. table.concat(ap, ", ", 2) end
        if not o.sync_module_states and is_meta(p) then e = e .. " on meta" end
        entries[#entries + 1] = e
      end
    end
  end
  return {members = members, inner = inner, forced = forced, recs = recs, entries = entries}
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

local function teardown(R)
  -- collective: every rank unshards the same units in the same (construction) order
  -- masks (lua/fsdp/mask.lua, owner masks): this rank's mask slices become full masks
  if package.loaded["fsdp.mask"] then package.loaded["fsdp.mask"]._on_teardown(R) end
  for _, U in ipairs(R.units) do U.unit:unshard() end
  -- parameters that never got values (wrapped on meta, not materialized) are meta again,
  -- not zeros
  if R.pending then
    for p in pairs(R.pending) do core.param_to_meta(p) end
  end
  for _, U in ipairs(R.units) do
    for _, h in ipairs(U.hooks or {}) do h.remove() end
    U.hooks = nil
  end
  for _, m in ipairs(R.members) do
    if rawget(m, MARK) == R then rawset(m, MARK, nil) end
  end
  R.dead = true
end

--- Collective. Shard `model` in place (see the file header and docs/fsdp.md). Returns model.
function W.wrap(model, opts)
  if not is_module(model) then
    raise(("fsdp.wrap: expected a module (got %s)"):format(type(model)))
  end
  local R0 = state_of(model)
  if R0 ~= nil then
    if R0.model == model then
      note(("fsdp.wrap: the model is already wrapped (%d units, strategy %s); returning it "
        .. "unchanged (fsdp.unwrap it first to wrap it differently)"):format(#R0.units, R0.opts.strategy))
      return model
    end
    raise(("fsdp.wrap: this %s is part of a wrapped model (whose root is a %s); wrap or unwrap "
      .. "that root instead"):format(model:type_name(), R0.model:type_name()))
  end
  local o = check_opts(opts)

  local meta = require "fsdp.meta"
  local rank = fsdp.rank()
  -- Local phase: everything this rank decides from its own model. An error here is not
  -- raised yet: it travels with the cross-rank comparison below, so that every rank fails
  -- with it instead of some waiting in a collective for a rank that gave up.
  local plan
  local ok0, err0 = pcall(function() plan = plan_wrap(model, o) end)
  local local_err = (not ok0) and tostring(err0) or nil
  -- Invariant 2: every rank is about to build the same units over the same parameters
  -- (paths, shapes, ties, meta or not): one all_reduce when they agree, an error naming the
  -- first difference and the ranks on each side when not.
  local msg = meta._agree("fsdp.wrap", plan and plan.entries or {}, local_err, {subject = "the model",
    hint = wrap_hint})
  if msg then
    if msg == local_err then error(msg, 0) end -- this rank's own error, already located
    raise(msg)
  end
  local members, inner, forced, recs = plan.members, plan.inner, plan.forced, plan.recs

  -- collective from here on
  for _, R in ipairs(inner) do teardown(R) end
  local R = {model = model, opts = o, units = {}, unit_of = {}, unit_of_param = {},
    members = members}
  local rec_of = {}
  for _, rec in ipairs(recs) do rec_of[rec.module] = rec end
  local pending, filled = {}, {}
  local ok, err = pcall(function()
    for _, rec in ipairs(recs) do
      local m, ps, pp = rec.module, rec.ps, rec.pp
      -- a picked module whose parameters all belong to an ancestor holds nothing: no unit
      if #ps > 0 or m == model then
        if o.sync_module_states then
          -- rank 0's values, one unit at a time: a meta parameter on another rank gets storage
          -- just before its unit takes its slice and frees it (peak: this unit + the shards)
          for i, p in ipairs(ps) do
            if rank ~= 0 and p.device == "meta" then
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
        local f = forced[m]
        local strategy = f and f.strategy or o.strategy
        local raf = o.reshard_after_forward
        if f then raf = f.reshard_after_forward end
        local mp = o.mp
        if f then mp = f.mp end
        local offload = o.offload
        if f then offload = f.offload end
        local u = core.unit_new(rec.path, ps, pp, {strategy = strategy, root = (m == model),
          reshard_after_forward = raf, param_dtype = mp and mp.param,
          reduce_dtype = mp and mp.reduce, device = o.device, offload = offload})
        local U = {unit = u, module = m, path = rec.path, strategy = strategy, params = ps, mp = mp}
        R.units[#R.units + 1] = U
        R.unit_of[m] = U
        for _, p in ipairs(ps) do R.unit_of_param[p] = U end
      end
    end
  end)
  if not ok then
    -- A unit that cannot be built fails on every rank alike (unit_new checks the layout
    -- collectively first), so every rank undoes the units made so far, in the same order,
    -- and the model is left plain.
    for _, U in ipairs(R.units) do pcall(U.unit.unshard, U.unit) end
    for p in pairs(pending) do
      if core.param_unit(p) == nil then pcall(core.param_to_meta, p) end
    end
    for p in pairs(filled) do
      if core.param_unit(p) == nil then pcall(core.param_to_meta, p) end
    end
    -- locate the engine's message at the user's call, not at this file
    raise((tostring(err):gsub("^[^\n]-wrap%.lua:%d+: ", "")))
  end
  if next(pending) ~= nil then R.pending = pending end
  for _, U in ipairs(R.units) do -- units with different policies (see install_hooks)
    if param_dtype(U) ~= param_dtype(R.units[1]) then R.mixed = true end
  end
  for _, U in ipairs(R.units) do
    -- parent: the closest selected ancestor that became a unit (the root always is one)
    local pm = rec_of[U.module].parent_module
    while pm ~= nil and R.unit_of[pm] == nil do pm = rec_of[pm].parent_module end
    U.parent = pm and R.unit_of[pm]
    install_hooks(R, U)
  end
  for _, m in ipairs(members) do rawset(m, MARK, R) end
  if o.init ~= nil and R.pending then
    local fine, e = pcall(meta._materialize_wrapped, R, o.init ~= true and o.init or nil, "fsdp.wrap")
    if not fine then raise((tostring(e):gsub("^[^\n]-meta%.lua:%d+: ", ""))) end
  end
  -- masks (lua/fsdp/mask.lua, owner masks): full masks become this rank's slices
  if package.loaded["fsdp.mask"] then package.loaded["fsdp.mask"]._on_wrap(R) end
  return model
end

--- Collective. Gather every unit, give each parameter its own dense storage back, remove the
--- hooks and marks: a plain model again (same module and parameter objects). Returns model.
function W.unwrap(model)
  if not is_module(model) then
    raise(("fsdp.unwrap: expected a module (got %s)"):format(type(model)))
  end
  local R = state_of(model)
  if R == nil then return model end
  if R.model ~= model then
    raise(("fsdp.unwrap: this %s is part of a wrapped model; unwrap its root (a %s)")
      :format(model:type_name(), R.model:type_name()))
  end
  if R.busy then raise("fsdp.unwrap: not inside fsdp." .. R.busy) end
  teardown(R)
  return model
end

--- true when model is the root of a wrapped model.
function W.is_wrapped(model)
  local R = state_of(model)
  return R ~= nil and R.model == model
end

local function unit_list(R)
  local list = R.order or R.units
  local out = {}
  for i, U in ipairs(list) do out[i] = U.unit end
  return out
end

--- The units of a wrapped model: forward order once a forward ran, else construction order
--- (innermost first, root last). {} for a plain model.
function W.units(model)
  local R = state_of(model)
  if R == nil then return {} end
  return unit_list(R)
end

-- ---- shards -------------------------------------------------------------------------------

local function local_slice_of(u, p)
  for _, s in ipairs(u:local_slices()) do
    if rawequal(s.param, p) then return s end
  end
  return nil
end

--- This rank's slice of param as a flat tensor view (writes land in the shard); possibly
--- empty. A parameter of a plain model: the whole parameter, flattened (a view).
function W.shard(param)
  if not base().is_tensor(param) then
    raise(("fsdp.shard: expected a parameter (got %s)"):format(type(param)))
  end
  local u = core.param_unit and core.param_unit(param)
  if u == nil then return param:detach():view{param:numel()} end
  local s = local_slice_of(u, param)
  if s == nil then return fsdp.zeros{0} end
  return u:shard():narrow(1, s.shard_first, s.shard_last - s.shard_first + 1)
end

-- ---- full_params and apply ------------------------------------------------------------------

-- Run fn with gradients off; returns ok, err.
local function run_quiet(fn, ...)
  local prev = core.set_grad_enabled(false)
  local ok, err = pcall(fn, ...)
  core.set_grad_enabled(prev)
  return ok, err
end

-- Put back what `gathered` (array of {U, was_sharded}) changed: write back if asked, then
-- reshard the units this call gathered. After an error: no writeback, best-effort reshard.
local function restore(gathered, writeback, ok)
  for i = #gathered, 1, -1 do
    local U, was_sharded = gathered[i][1], gathered[i][2]
    if ok then
      if writeback then
        U.unit:writeback()
        -- masks (lua/fsdp/mask.lua, owner masks): the shard is masked again
        if package.loaded["fsdp.mask"] then package.loaded["fsdp.mask"]._on_writeback(U, was_sharded) end
      end
      if was_sharded then U.unit:reshard() end
    elseif was_sharded then
      pcall(U.unit.reshard, U.unit)
    end
  end
end

local function gather(U, list)
  local was_sharded = U.unit:state() == "sharded"
  U.unit:gather()
  list[#list + 1] = {U, was_sharded}
end

--- Collective. fn(model) with full parameters; changes are written back to the shards
--- (writeback = true). model may be the wrapped root (every unit is gathered: the whole model
--- in memory) or a submodule of it (only the units owning parameters of its subtree). Returns
--- fn's first result.
function W.full_params(model, fn, opts)
  if type(fn) ~= "function" then raise("fsdp.full_params: expects (model, fn[, opts])") end
  opts = opts or {}
  local writeback = opts.writeback ~= false
  local R = state_of(model)
  if R == nil then
    local ok, res = run_quiet(fn, model)
    if not ok then error(res, 0) end
    return res
  end
  if R.busy then raise("fsdp.full_params: already inside fsdp." .. R.busy) end
  if R.pending then raise(pending_error(R, "fsdp.full_params")) end
  local need = {}
  if model == R.model then
    for _, U in ipairs(R.units) do need[U] = true end
  else
    for _, p in ipairs(model:parameters()) do
      local U = R.unit_of_param[p]
      if U then need[U] = true end
    end
  end
  local gathered = {}
  R.busy = "full_params"
  local ok, res = pcall(function()
    for _, U in ipairs(R.units) do -- construction order: the same on every rank
      if need[U] then gather(U, gathered) end
    end
    local fine, r = run_quiet(fn, model)
    if not fine then error(r, 0) end
    return r
  end)
  restore(gathered, writeback, ok)
  R.busy = nil
  if not ok then error(res, 0) end
  return res
end

--- Collective. fn(module, path) for every module of model (pre-order, as named_modules), each
--- called while the units on its path from the root are gathered (memory: the largest chain of
--- nested units, not the model); changes are written back to the shards.
function W.apply(model, fn)
  if type(fn) ~= "function" then raise("fsdp.apply: expects (model, fn)") end
  local R = state_of(model)
  if R == nil then
    local ok, err = run_quiet(function()
      for path, m in model:named_modules() do fn(m, path) end
    end)
    if not ok then error(err, 0) end
    return model
  end
  if R.busy then raise("fsdp.apply: already inside fsdp." .. R.busy) end
  if R.pending then raise(pending_error(R, "fsdp.apply")) end
  local gathered = {}
  R.busy = "apply"
  local ok, err = pcall(function()
    -- when model is a submodule: first gather the units above it (root first), found along
    -- its first path from the root
    if model ~= R.model then
      local chain
      local seen = {[R.model] = true}
      local function find(m, acc)
        if m == model then chain = acc return true end
        for _, e in ipairs(own_entries(m)) do
          local v = e[2]
          if is_module(v) and not seen[v] then
            seen[v] = true
            local a = acc
            if R.unit_of[v] and v ~= model then
              a = {unpack(acc)}
              a[#a + 1] = R.unit_of[v]
            end
            if find(v, a) then return true end
          end
        end
        return false
      end
      find(R.model, {R.unit_of[R.model]})
      for _, U in ipairs(chain) do gather(U, gathered) end
    end
    -- pre-order walk; `gathered` is the stack of units gathered on the current path, so an
    -- error anywhere leaves exactly those for the restore below
    local seen = {[model] = true}
    local function visit(m, path)
      local U = R.unit_of[m]
      if U then gather(U, gathered) end
      local fine, e = run_quiet(fn, m, path)
      if not fine then error(e, 0) end
      for _, entry in ipairs(own_entries(m)) do
        local v = entry[2]
        if is_module(v) and not seen[v] then
          seen[v] = true
          visit(v, join(path, entry[1]))
        end
      end
      if U then
        restore({gathered[#gathered]}, true, true)
        gathered[#gathered] = nil
      end
    end
    visit(model, "")
  end)
  restore(gathered, true, ok)
  R.busy = nil
  if not ok then error(err, 0) end
  return model
end

-- ---- inspection: lua/fsdp/inspect.lua ----------------------------------------

--- A report on a model (one row per unit), a parameter or a unit; tostring() prints it.
function W.inspect(x, opts) return require("fsdp.inspect").inspect(x, opts) end

-- ---- for optim.lua (not part of the fsdp table) ----------------------------------------------

--- The root state when model is a wrapped root (nil otherwise).
function W._root_state(model)
  local R = state_of(model)
  if R ~= nil and R.model == model then return R end
  return nil
end

--- This rank's parameter slices of every unit, in construction order:
--- array of {unit =, strategy =, path =, param =, shard_first =, shard_last =, param_first =}.
function W._slices(model)
  local R = W._root_state(model)
  local out = {}
  for _, U in ipairs(R.units) do
    for _, s in ipairs(U.unit:local_slices()) do
      out[#out + 1] = {unit = U.unit, strategy = U.strategy, path = s.path, param = s.param,
        shard_first = s.shard_first, shard_last = s.shard_last, param_first = s.param_first}
    end
  end
  return out
end

--- Zero every unit's gradient shard (Module:zero_grad and optimizers call it).
function W._zero_grad(model)
  local R = state_of(model)
  if R == nil then return end
  for _, U in ipairs(R.units) do U.unit:zero_grad() end
end

W.ROOT_PATH = ROOT_PATH

return W
