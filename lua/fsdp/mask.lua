-- fsdp.mask — masks that live with the shards. docs/pruning.md is the manual.
--
--   fsdp.set_mask(param, mask)   fsdp.mask(param)   fsdp.sparsity(model)
--   for checkpoints (lua/fsdp/checkpoint.lua): has, local_slice, set_local, masked, local_mask,
--   set_local_mask; reapply(model)
--   for optimizers and pruning (optim.lua, prune.lua): shard_slice, apply_plain, plain_flat,
--   piece, adopt, changed_copy, refresh, wrapped
--
-- A mask is a 0/1 value per element of a parameter (0 = pruned). It is stored in the form the
-- parameter has (docs/pruning.md):
--   * a parameter of a plain model: the full mask, a tensor of the parameter's shape;
--   * a parameter owned by a unit (fsdp.wrap): only THIS rank's slice of it, a 1-D tensor laid
--     out exactly like the parameter's slice in the unit's flat shard (u:local_slices()), or
--     nothing when this rank holds no element of the parameter. No rank ever holds a full mask
--     of a wrapped parameter (except fsdp.mask(param), which assembles one on request).
-- Masks are kept per parameter OBJECT (a weak-keyed table): tied parameters are one object, so
-- ties share one mask, and a reference saved before wrapping names the same mask after it.
--
-- Where masks are applied:
--   * set_mask / prune.*: at once, to the weights (the shard, and the live full parameter when its
--     unit is gathered);
--   * the optimizers (optim.lua): to the gradient (shard) before every step and to the weights
--     (shard) after it (AdamW's fused kernel does both), so a masked weight stays exactly 0
--     through momentum, Adam moments and weight decay; clip_grad_norm masks the gradients
--     before measuring them;
--   * fsdp.apply / fsdp.full_params with writeback: to the shards right after the writeback.
-- Conversions, on the events of lua/fsdp/state.lua: "wrap" (full -> this rank's slice, no
-- communication), "teardown" (unwrap and re-wrap: slices -> full, one all_reduce per masked
-- parameter of a sharded unit, collective), "writeback" (the shard is masked again) and
-- "materialize" (masks set on meta parameters apply to their new values).
--
-- Record of a parameter p (records[p]):
--   plain:   {full = tensor (p's shape), flat = 1-D view of it}
--   sharded: {sharded = true, numel =, shape =, path =, slice = 1-D tensor or nil, first =
--            (1-based position of the slice in p's flattened elements), n = #slice,
--            shard_first = (1-based position of the slice in the unit's flat shard)}
-- Every rank has a record for the same parameters (set_mask and prune are collective), which
-- keeps the collectives of fsdp.mask and of teardown in step.

local core = require "fsdp.core"
local collective = require "fsdp.collective"
local state = require "fsdp.state"
local util = require "fsdp.util"

local M = {}

local records = setmetatable({}, {__mode = "k"})

local raise, is_module, is_tensor = util.raise, util.is_module, util.is_tensor

-- Where p's mask lives: on the device of its weights (its unit's shards when wrapped), so the
-- kernels that apply it take both from one device; the cpu for a parameter without values yet.
local function mask_opts(u, p)
  local dev = u and u:shard().device or p.device
  if dev == "meta" then dev = "cpu" end
  return {role = "other", device = dev}
end

local function numel_of(shape)
  local n = 1
  for i = 1, #shape do n = n * shape[i] end
  return n
end

local shape_str = util.shape_str

local local_slice = util.local_slice

-- The dotted path a unit gives p (its first use), for labels and messages.
local function unit_path(u, p)
  local ps, pp = u:params(), u:paths()
  for i = 1, #ps do
    if rawequal(ps[i], p) then return pp[i] end
  end
  return "?"
end

-- 1-D view of a dense parameter's values (no autograd).
local function flat_param(p)
  return p:detach():view{p:numel()}
end

local function is_replicated(u) return u:strategy() == "none" end
-- whether this rank's slices go into a sum of every rank's (hybrid: the first group's only)
local function contributes(u) return u == nil or is_replicated(u) or util.counts_shard(u) end

-- Whether u's live parameters are a copy of its shards: gathered, and not "none" (whose
-- parameters view the shard itself) unless gathered in a mixed-precision compute dtype.
local function holds_copy(u)
  return u:state() == "gathered" and (not is_replicated(u) or u:dtypes().gathered ~= "f32")
end

-- Mask p's live (gathered) values with flat, p's full 1-D mask on the same device: a copy
-- gathered in bf16/f16 for compute is masked through f32 (exact both ways).
-- x (1-D, in place) = +0 where the f32 0/1 mask flat is 0, in x's own dtype. The kernels
-- compute masks in f32 only; a plain parameter moved to bf16, f16 or f64 (model:to) keeps its
-- f32 mask, so other dtypes take the mask through where (a copy of x's size, exact: x's other
-- elements keep their bits).
local function apply_flat(x, flat)
  if x:dtype() == "f32" then
    core.mask_apply(x, flat)
  else
    x:copy(flat:where(x, 0))
  end
end
M.apply_flat = apply_flat

local function mask_live(p, flat) apply_flat(flat_param(p), flat) end

-- p's full 1-D mask from every rank's slice (sharded record rec of p in unit u), where p's
-- mask lives. Collective unless u is replicated: one all_reduce("sum") of p's size (every
-- element is held by exactly one rank, or counted by one: the sum is exact).
local function full_mask(u, p, rec)
  local flat = core.zeros{rec.numel}
  if rec.slice ~= nil and contributes(u) then flat:narrow(1, rec.first, rec.n):copy(rec.slice) end
  if not is_replicated(u) then core.all_reduce(flat, "sum", "mask " .. rec.path) end
  return flat:to(mask_opts(u, p).device)
end

-- This rank's reason to refuse changing the shards of unit u (nil: none); `what` names the
-- parameter and what is then not done ("wpe.weight (no mask set)"). A gathered copy that no
-- longer matches its shard outside a walk holding it (a parameter written in place outside
-- fsdp.full_params / fsdp.apply, or the shard written under the copy) is what gather and
-- reshard refuse; masking the copy and accepting it, or refreshing it, would adopt that change
-- silently (into the shards at the next writeback, on the ranks that made it) or fail on the
-- ranks that made it only. Inside fsdp.apply / full_params the walk writes the copy back (or
-- drops it) itself: writes there are expected. Local: callers fold it into an agreement.
local function changed_copy(u, what)
  if not u:dirty() then return nil end
  local R = state.of_unit(u)
  if R ~= nil and R:walk_holds(u) then return nil end
  return ("%s: %s"):format(what, state.changed_error(u.path))
end
M.changed_copy = changed_copy

-- Collective when one of units ({unit, path} pairs) holds a gathered copy (the same on every
-- rank; nothing communicates otherwise): raise on every rank alike, naming fn, the lowest rank
-- and the unit, when some rank's copy changed outside a walk holding it (changed_copy, with
-- `note` saying what is not done). For callers about to change shards and refresh the units.
local function check_copies(units, fn, note)
  local any, err = false, nil
  for _, e in ipairs(units) do
    if holds_copy(e[1]) then
      any = true
      err = err or changed_copy(e[1], ("%s (%s)"):format(e[2], note))
    end
  end
  if not any then return end
  local msg = collective.check_agreement(fn, nil, err, nil, fn .. " copies")
  if msg then raise(msg) end
end

-- A unit holding a full copy that a change of the shards does not reach: make the copy match
-- the masked shards again. Collective; every rank has the same unit states, and a walk holds
-- the same units on every rank. A unit a walk holds (fsdp.apply / full_params) keeps its copy,
-- which may hold fn's writes for the walk to write back or drop: the copy is masked in place
-- with each masked parameter's full mask (one all_reduce each). Any other copy is gathered
-- again from the shards; the caller made sure no rank's copy changed outside a walk
-- (changed_copy), which that reshard would refuse on that rank only.
local function refresh(u)
  if not holds_copy(u) then return end
  local R = state.of_unit(u)
  if R ~= nil and R:walk_holds(u) then
    for _, p in ipairs(u:params()) do
      local rec = records[p]
      if rec ~= nil and rec.sharded then mask_live(p, full_mask(u, p, rec)) end
    end
    -- shard and live copy masked alike: kept as matching (the walk's own writes in the copy
    -- are its to write back or drop, as before)
    u:accept_changes()
  else
    u:reshard()
    u:gather()
  end
end
M.refresh = refresh

-- A sharded record for p from this rank's part of a full flat mask (or all ones), or adopting
-- `slice` (this rank's values, not copied) when given.
local function sharded_record(u, p, full_flat, path, slice)
  local rec = {sharded = true, numel = p:numel(), shape = p:shape(), path = path, n = 0}
  local s = local_slice(u, p)
  if s ~= nil then
    local n = s.shard_last - s.shard_first + 1
    rec.first, rec.n, rec.shard_first = s.param_first, n, s.shard_first
    if slice ~= nil then
      if slice:numel() ~= n then
        error(("mask: %s: a slice of %d elements was expected (got %d)"):format(path, n, slice:numel()), 0)
      end
      rec.slice = slice
    else
      rec.slice = core.ones({n}, mask_opts(u, p))
      if full_flat ~= nil then rec.slice:copy(full_flat:narrow(1, s.param_first, n)) end
    end
  end
  return rec
end

-- Apply a sharded record to the unit's shard.
local function apply_sharded(u, rec, shard)
  if rec.slice ~= nil then
    shard = shard or u:shard()
    core.mask_apply(shard:narrow(1, rec.shard_first, rec.n), rec.slice)
  end
end

-- ---- the user API ---------------------------------------------------------------------------

local function check_param(p, fn)
  if not is_tensor(p) then
    raise(("%s: expected a parameter (got %s)"):format(fn, type(p)))
  end
end

-- The mask as {full = a new 0/1 tensor of p's shape where p's mask lives, flat = its 1-D view,
-- zeros =, hash = (of the zero positions)}, or nil and why not (its type, shape or values).
local function checked_mask(p, u, mask)
  if not is_tensor(mask) then
    return nil, ("the mask must be a tensor of the parameter's shape (got %s)"):format(type(mask))
  end
  local shape, ms = p:shape(), mask:shape()
  local same = #ms == #shape and mask:numel() == p:numel()
  for i = 1, #shape do same = same and ms[i] == shape[i] end
  if not same then
    return nil, ("the mask has shape %s, the parameter %s"):format(shape_str(ms), shape_str(shape))
  end
  local full = core.zeros(shape, mask_opts(u, p))
  full:copy(mask)
  local flat = full:view{p:numel()}
  local bad, zeros, hash = core.mask_check(flat)
  if bad > 0 then return nil, ("the mask must hold only 0 and 1 (%d other values)"):format(bad) end
  return {full = full, flat = flat, zeros = zeros, hash = hash}
end

-- What a rank passed to set_mask, in the message for ranks that passed different masks.
local function passed(v)
  if v == "none" then return "nil (no mask)" end
  return ("a mask with %d zeros"):format(v[1])
end

--- set_mask(param, mask): mask is a 0/1 tensor of param's shape (nil removes param's mask).
--- Collective when param is sharded (every rank passes the same mask, or nil: checked). The
--- masked weights become 0 at once and stay 0 through every optimizer step. Refused on every
--- rank, setting nothing, when some rank's mask is not a 0/1 tensor of param's shape, or when
--- param's unit is gathered and its copy was changed outside fsdp.full_params / fsdp.apply on
--- some rank (docs/pruning.md).
function M.set_mask(p, mask)
  check_param(p, "fsdp.set_mask")
  local u = core.param_unit(p)
  if u == nil then
    if mask == nil then
      records[p] = nil
      return
    end
    local m, why = checked_mask(p, nil, mask)
    if m == nil then raise("fsdp.set_mask: " .. why) end
    records[p] = {full = m.full, flat = m.flat}
    if p.device ~= "meta" then apply_flat(flat_param(p), m.flat) end
    return
  end
  -- sharded: every rank must pass the same mask (a different one would leave the slices of
  -- different masks side by side; one removed on some ranks only, records that differ):
  -- compare the zero count and a hash of the zero positions ("none" for nil), with this rank's
  -- reason to refuse (its mask's type, shape or values; a changed gathered copy), so that
  -- every rank refuses alike before anything is recorded or masked
  local path = unit_path(u, p)
  local m, why, value = nil, nil, "none"
  if mask ~= nil then
    local ok
    ok, m, why = pcall(checked_mask, p, u, mask)
    if not ok then m, why = nil, util.strip(m) end
    if m == nil then
      why = ("%s: %s"):format(path, why)
    else
      value = {m.zeros, m.hash}
      why = changed_copy(u, path .. " (no mask set)")
    end
  end
  local d = collective.compare(value, why, "set_mask " .. path)
  if d ~= nil and d.failed ~= nil then raise("fsdp.set_mask: " .. collective.refusal(d)) end
  if d ~= nil then
    local other = d.differ[1]
    local ranks = {}
    for i, r in ipairs(d.differ) do ranks[i] = tostring(r) end
    raise(("fsdp.set_mask: %s: the ranks passed different masks: rank 0 %s, rank %d %s (ranks "
      .. "that differ from rank 0: %s); every rank must pass the same full mask, or nil")
      :format(path, passed(d.values[1]), other, passed(d.values[other + 1]),
        table.concat(ranks, ", ")))
  end
  if mask == nil then
    records[p] = nil
    return
  end
  local rec = sharded_record(u, p, m.flat, path)
  records[p] = rec
  apply_sharded(u, rec)
  -- a gathered unit: its live full parameter gets the full mask too (every rank has it)
  if holds_copy(u) then
    mask_live(p, m.flat)
    -- shard and live copy changed alike: kept, neither stale nor dropped (a change of the copy
    -- made outside a walk holding it was refused above)
    u:accept_changes()
  end
end

--- mask(param) -> a new full-shape 0/1 tensor, or nil when param has no mask. Collective when
--- param is sharded (the slices are summed with one all_reduce).
function M.mask(p)
  check_param(p, "fsdp.mask")
  local rec = records[p]
  if rec == nil then return nil end
  if not rec.sharded then return rec.full:clone() end
  local u = core.param_unit(p)
  local full = core.zeros{rec.numel}
  if rec.slice ~= nil and contributes(u) then full:narrow(1, rec.first, rec.n):copy(rec.slice) end
  if u ~= nil and not is_replicated(u) then core.all_reduce(full, "sum", "mask " .. rec.path) end
  return full:view(rec.shape)
end

-- Is anything sharded in this model (then counting is collective)?
local function any_sharded(params)
  for _, e in ipairs(params) do
    if core.param_unit(e.param) ~= nil then return true end
  end
  return false
end

local SparsityReport = {}
SparsityReport.__index = SparsityReport

--- sparsity(model [, {params = PATTERNS}]) -> {total =, zeros =, sparsity =, params = {[path] =
--- {numel =, zeros =, sparsity =, masked =}}, order = {paths...}}. Counts exact zeros of the
--- weights on this rank's shards; one all_reduce sums them (collective when the model is
--- wrapped): nothing is gathered, and every rank gets the same table.
function M.sparsity(model, opts)
  if not is_module(model) then
    raise(("fsdp.sparsity: expected a module (got %s)"):format(type(model)))
  end
  opts = util.check_opts("fsdp.sparsity", opts, {"params", "exclude"})
  state.check_values(model, "fsdp.sparsity")
  if opts.exclude ~= nil and opts.params == nil then
    raise("fsdp.sparsity: exclude needs params (the parameters to count, minus exclude)")
  end
  local params
  if opts.params then
    params = util.select_params(model, opts, "fsdp.sparsity")
  else
    params = {}
    for path, p in model:named_parameters() do params[#params + 1] = {path = path, param = p} end
  end
  local collective = any_sharded(params)
  local counts = {}
  for i, e in ipairs(params) do
    local p = e.param
    local z = 0
    local u = core.param_unit(p)
    if u == nil then
      if p.device ~= "meta" then
        local x = flat_param(p)
        -- the kernel counts in f32; another dtype (model:to) counts through its 0/1 of nonzeros
        z = core.count_zeros(x:dtype() == "f32" and x or x:ne(0):to("f32"))
      end
    elseif util.counts_shard(u) then -- a replicated (or hybrid) shard is counted once
      local s = local_slice(u, p)
      if s ~= nil then
        z = core.count_zeros(u:shard():narrow(1, s.shard_first, s.shard_last - s.shard_first + 1))
      end
    end
    counts[i] = z
  end
  if collective and #params > 0 then
    counts = core.all_reduce(counts, "sum", "sparsity") -- f64: exact counts
  end
  local out = setmetatable({total = 0, zeros = 0, params = {}, order = {}}, SparsityReport)
  for i, e in ipairs(params) do
    local numel = e.param:numel()
    out.params[e.path] = {numel = numel, zeros = counts[i], sparsity = numel > 0 and counts[i] / numel or 0,
      masked = records[e.param] ~= nil}
    out.order[i] = e.path
    out.total = out.total + numel
    out.zeros = out.zeros + counts[i]
  end
  out.sparsity = out.total > 0 and out.zeros / out.total or 0
  return out
end

SparsityReport.__tostring = function(r)
  local lines = {("%-40s %12s %12s %9s"):format("parameter", "numel", "zeros", "sparsity")}
  for _, path in ipairs(r.order) do
    local e = r.params[path]
    lines[#lines + 1] = ("%-40s %12d %12d %8.2f%%%s"):format(path, e.numel, e.zeros,
      100 * e.sparsity, e.masked and "  (masked)" or "")
  end
  lines[#lines + 1] = ("%-40s %12d %12d %8.2f%%"):format("total", r.total, r.zeros, 100 * r.sparsity)
  return table.concat(lines, "\n")
end

-- ---- for optim.lua and prune.lua (not part of the fsdp table) ------------------------------------

--- This rank's mask values for the shard slice of p that holds n elements (nil when p has
--- no mask there); an error when the mask holds another number of elements.
function M.shard_slice(p, n, path)
  local rec = records[p]
  if rec == nil or not rec.sharded or rec.slice == nil then return nil end
  if rec.n ~= n then
    raise(("%s: the mask holds %d elements of this rank's slice, the shard %d (the model was "
      .. "re-wrapped without its masks?)"):format(path, rec.n, n))
  end
  return rec.slice
end

--- Mask x, a dense parameter p's gradient or values, when p has a mask (plain models).
function M.apply_plain(p, x)
  local rec = records[p]
  if rec == nil or rec.sharded then return end
  if x:is_contiguous() then
    apply_flat(x:detach():view{x:numel()}, rec.flat)
  else
    local c = x:detach():contiguous()
    apply_flat(c:view{c:numel()}, rec.flat)
    x:detach():copy(c)
  end
end

--- The whole flat mask of a plain parameter p, for a fused step; nil without a mask or when p
--- is sharded.
function M.plain_flat(p)
  local rec = records[p]
  if rec == nil or rec.sharded then return nil end
  return rec.flat
end

--- This rank's mask values of p as a 1-D live buffer: the whole mask of a plain parameter,
--- this rank's slice of a sharded one; nil without a mask (or a slice).
function M.piece(p)
  local rec = records[p]
  if rec == nil then return nil end
  if rec.sharded then return rec.slice end
  return rec.flat
end

--- Make `values` (a 1-D buffer: p's whole mask when u is nil, else this rank's slice of it in
--- unit u, or nil when the rank holds none) p's mask, adopted, not copied. The weights are
--- not touched (the caller masks them).
function M.adopt(p, u, path, values)
  if u == nil then
    records[p] = {full = values:view(p:shape()), flat = values}
    return
  end
  local rec = sharded_record(u, p, nil, path, values)
  if rec.slice ~= nil and values == nil then
    error(("mask: %s: a slice of %d elements was expected"):format(path, rec.n), 0)
  end
  records[p] = rec
end

--- This rank's mask values for p as {first =, n =, numel =, shape =, mask = 1-D tensor (the
--- live buffer: writes change the mask)} — first is the 1-based position of `mask`'s first
--- element in p's flattened elements; a plain parameter gives the whole mask (first = 1). nil
--- when p has no mask; {n = 0} when this rank holds no element of p. Not collective. For
--- checkpoints: a sharded checkpoint saves these slices as they are.
function M.local_mask(p)
  local rec = records[p]
  if rec == nil then return nil end
  if not rec.sharded then
    return {first = 1, n = p:numel(), numel = p:numel(), shape = p:shape(), mask = rec.flat}
  end
  return {first = rec.first, n = rec.n, numel = rec.numel, shape = rec.shape, mask = rec.slice}
end

--- Set this rank's mask values of p from a checkpoint's slice: `values` holds the elements
--- first .. first + numel - 1 of p's flattened mask (it may cover more than this rank's slice:
--- the part this rank holds is taken). Not collective, but every rank must call it for the
--- same parameters (as with set_mask). The weights are masked at once. A plain parameter needs
--- the whole mask (first = 1, numel = p:numel()). Refused (on every rank: unit states are the
--- same) while p's unit holds a gathered copy, which a change of the shard alone would leave
--- stale: mask.set_local refreshes such units.
function M.set_local_mask(p, first, values)
  check_param(p, "mask.set_local_mask")
  local u = core.param_unit(p)
  local flat = values:contiguous():view{values:numel()}
  local last = first + flat:numel() - 1
  if u == nil then
    if first ~= 1 or flat:numel() ~= p:numel() then
      raise(("mask.set_local_mask: a plain parameter needs its whole mask (%d elements)"):format(p:numel()))
    end
    local full = core.zeros(p:shape(), mask_opts(nil, p))
    full:view{p:numel()}:copy(flat)
    records[p] = {full = full, flat = full:view{p:numel()}}
    if p.device ~= "meta" then apply_flat(flat_param(p), records[p].flat) end
    return
  end
  local rec = sharded_record(u, p, nil, unit_path(u, p))
  if holds_copy(u) then
    raise(("mask.set_local_mask: %s: unit '%s' holds a gathered copy, which a change of its "
      .. "shard would leave stale: reshard it first (u:reshard()), or use mask.set_local")
      :format(rec.path, u.path))
  end
  if rec.slice ~= nil then
    if rec.first < first or rec.first + rec.n - 1 > last then
      raise(("mask.set_local_mask: %s: values cover elements %d..%d, this rank holds %d..%d")
        :format(rec.path, first, last, rec.first, rec.first + rec.n - 1))
    end
    rec.slice:copy(flat:narrow(1, rec.first - first + 1, rec.n))
  end
  records[p] = rec
  apply_sharded(u, rec)
end

-- The checkpoint interface (lua/fsdp/checkpoint.lua saves and loads masks through it). Elements are those of
-- fsdp.shard(param): the flattened parameter's slice this rank holds (the whole parameter when
-- it is not sharded, or its unit's strategy is "none").

--- Whether param has a mask (local; the same answer on every rank).
function M.has(p) return records[p] ~= nil end

--- This rank's slice of param's mask as a 1-D tensor (the live buffer: read it, do not write
--- it), an empty tensor when this rank holds no element of param, nil without a mask. Local.
function M.local_slice(p)
  local rec = records[p]
  if rec == nil then return nil end
  if not rec.sharded then return rec.flat end
  return rec.slice or core.zeros{0}
end

-- Whether some parameter of model belongs to a unit (then its mask calls are collective).
--- Whether any parameter of model belongs to a unit (then set_local and pruning are
--- collective): false for anything that is not a module.
function M.wrapped(model)
  if not is_module(model) then return false end
  for _, p in ipairs(model:parameters()) do
    if core.param_unit(p) ~= nil then return true end
  end
  return false
end
local has_units = M.wrapped

--- Collective when model is wrapped (every rank passes the same set of parameters): set each
--- listed parameter's mask from this rank's slice (a 1-D tensor with fsdp.shard(param)'s
--- elements: the whole mask of a plain parameter), or remove it (false). The weights are
--- masked at once, and units holding a gathered copy refreshed. Each rank checks its slices
--- (sizes, 0/1 values) and its gathered copies first, and the ranks agree on it (one small
--- all_reduce when wrapped): a slice refused on one rank fails every rank alike, and nothing is
--- set.
function M.set_local(model, slices)
  if not is_module(model) or type(slices) ~= "table" then
    raise("mask.set_local: expects (model, {[param] = slice or false, ...})")
  end
  local plan, units, seen = {}, {}, {}
  -- this rank's checks: the new records are built, nothing is set yet
  local ok, err = pcall(function()
    for path, p in model:named_parameters() do
      local v = slices[p]
      if v == false then
        plan[#plan + 1] = {p = p, path = path}
      elseif v ~= nil then
        if not is_tensor(v) then
          error(("%s: the slice must be a tensor (got %s)"):format(path, type(v)), 0)
        end
        local u = core.param_unit(p)
        local rec
        if u == nil then
          if v:numel() ~= p:numel() then
            error(("%s: a plain parameter needs its whole mask (%d elements, the slice has %d)")
              :format(path, p:numel(), v:numel()), 0)
          end
          local full = core.zeros(p:shape(), mask_opts(nil, p))
          full:view{p:numel()}:copy(v:contiguous():view{p:numel()})
          rec = {full = full, flat = full:view{p:numel()}}
        else
          local s = local_slice(u, p)
          local n = s and (s.shard_last - s.shard_first + 1) or 0
          if v:numel() ~= n then
            error(("%s: this rank holds %d elements, the slice has %d")
              :format(path, n, v:numel()), 0)
          end
          rec = sharded_record(u, p, nil, path)
          if rec.slice ~= nil then rec.slice:copy(v:contiguous():view{n}) end
          if not seen[u] then
            seen[u] = true
            units[#units + 1] = {u, path}
          end
        end
        local t = rec.flat or rec.slice
        local bad = t and core.mask_check(t) or 0
        if bad > 0 then
          error(("%s: the mask must hold only 0 and 1 (%d other values)"):format(path, bad), 0)
        end
        plan[#plan + 1] = {p = p, u = u, rec = rec, path = path}
      end
    end
  end)
  err = not ok and util.strip(err) or nil
  if err == nil then
    for _, e in ipairs(units) do
      if holds_copy(e[1]) then err = err or changed_copy(e[1], e[2] .. " (no mask set)") end
    end
  end
  if has_units(model) then
    -- the same parameters on every rank (what refresh communicates for depends on them)
    local which = {}
    for i, x in ipairs(plan) do which[i] = (x.rec and "set " or "remove ") .. x.path end
    local msg = collective.check_agreement("mask.set_local", which, err,
      "which parameters get masks")
    if msg then raise(msg) end
  elseif err then
    raise("mask.set_local: " .. err)
  end
  for _, x in ipairs(plan) do
    records[x.p] = x.rec
    if x.rec ~= nil then
      if x.u ~= nil then
        apply_sharded(x.u, x.rec)
      elseif x.p.device ~= "meta" then
        apply_flat(flat_param(x.p), x.rec.flat)
      end
    end
  end
  for _, e in ipairs(units) do refresh(e[1]) end
end

--- The parameters of model that have a mask: array of {path =, param =} (named_parameters order).
function M.masked(model)
  local out = {}
  for path, p in model:named_parameters() do
    if records[p] ~= nil then out[#out + 1] = {path = path, param = p} end
  end
  return out
end

--- Re-apply every mask of model to its weights (plain or wrapped; collective when wrapped only
--- if a unit is gathered and must be refreshed). Refused on every rank, changing nothing, when
--- such a unit's copy was changed outside fsdp.full_params / fsdp.apply on some rank.
function M.reapply(model)
  local list, units, seen = M.masked(model), {}, {}
  for _, e in ipairs(list) do
    local u = core.param_unit(e.param)
    if records[e.param].sharded and u ~= nil and not seen[u] then
      seen[u] = true
      units[#units + 1] = {u, e.path}
    end
  end
  check_copies(units, "mask.reapply", "masks not applied")
  for _, e in ipairs(list) do
    local p, rec = e.param, records[e.param]
    local u = core.param_unit(p)
    if rec.sharded then
      if u ~= nil then apply_sharded(u, rec) end
    elseif p.device ~= "meta" then
      apply_flat(flat_param(p), rec.flat)
    end
  end
  for _, e in ipairs(units) do refresh(e[1]) end
end

-- ---- on the events of wrapped models (lua/fsdp/state.lua) ---------------------------------------

-- After fsdp.wrap built the units of R: full masks become this rank's slices, and the shards
-- are masked (no communication).
state.on("wrap", function(R)
  for _, u in ipairs(R:units()) do
    local pp = u:paths()
    for i, p in ipairs(u:params()) do
      local rec = records[p]
      if rec ~= nil and not rec.sharded then
        records[p] = sharded_record(u, p, rec.flat, pp[i])
        apply_sharded(u, records[p])
      end
    end
  end
end)

-- Before the units of R are unsharded (fsdp.unwrap, or an outer wrap absorbing R): slices
-- become full masks again. Collective: one all_reduce("sum") per masked parameter of a
-- sharded unit, in construction order (each element is held by exactly one rank, so the sum
-- is exact).
state.on("teardown", function(R)
  for _, u in ipairs(R:units()) do
    for _, p in ipairs(u:params()) do
      local rec = records[p]
      if rec ~= nil and rec.sharded then
        -- assembled on the cpu (the collective), kept where the weights are
        local full = core.zeros(rec.shape, {role = "other"})
        local flat = full:view{rec.numel}
        if rec.slice ~= nil and contributes(u) then flat:narrow(1, rec.first, rec.n):copy(rec.slice) end
        if not is_replicated(u) then core.all_reduce(flat, "sum", "unwrap mask " .. rec.path) end
        full = full:to(mask_opts(u, p).device)
        records[p] = {full = full, flat = full:view{rec.numel}}
      end
    end
  end
end)

-- After a unit's writeback (fsdp.apply / full_params): mask its shard again; a unit that
-- stays gathered is gathered anew so its live parameters are masked too (collective).
state.on("writeback", function(_, u, was_sharded)
  local any = false
  for _, p in ipairs(u:params()) do
    local rec = records[p]
    if rec ~= nil and rec.sharded then
      any = true
      apply_sharded(u, rec)
    end
  end
  -- (the copy was just written back: it matches the shard but for the masked elements)
  if any and not was_sharded then
    u:reshard()
    u:gather()
  end
end)

-- Masks set while a model was on meta apply as soon as its values arrive.
state.on("materialize", function(model) M.reapply(model) end)

return M
