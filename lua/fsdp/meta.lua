-- fsdp.meta — deferred initialisation: build a model without storage, give it values later.
-- docs/init.md is the manual.
--
--   fsdp.meta(fn) -> model              build with every new parameter on the meta device
--   fsdp.materialize(model, init_fn)    give meta parameters storage and their values
--   M.materialize_wrapped(R, init_fn, what)   the wrapped case (also fsdp.wrap{init =})
--   M.load_tensors, M.mark_loaded       loading tensors by name (lua/fsdp/load_tensors.lua)
--
-- Invariants 1 and 2 (docs/ARCHITECTURE.md):
--   * Nothing here creates a parameter object in place of another: core.param_materialize
--     swaps a meta storage for a dense one in place, so a tie is one object with one storage
--     through every step, and cannot break.
--   * Values are a pure function of (seed, init key, element index) — the init records of
--     lua/fsdp/nn/module.lua and the counter-based RNG — so a rank fills its slice of a
--     parameter's shard with exactly the values an eagerly built model holds there, without
--     gathering anything (core.init_normal/init_uniform take the element offset).
--   * Before anything moves, the ranks compare the list of parameters waiting for values
--     (collective.check_lists): a difference is the same error on every rank, never a hang.
-- When values arrive, the "materialize" event (lua/fsdp/state.lua) tells the masks.

local core = require "fsdp.core"
local nn = require "fsdp.nn"
local base = require "fsdp.nn.module"
local collective = require "fsdp.collective"
local load_tensors = require "fsdp.load_tensors"
local state = require "fsdp.state"
local util = require "fsdp.util"

local raise, is_module = util.raise, util.is_module

local M = {}

M.load_tensors = load_tensors.load_tensors
M.mark_loaded = load_tensors.mark_loaded

--- meta(fn, ...) -> fn's results: runs fn with new parameters created on the meta device
--- (shape only, no storage): every built-in layer and nn.new_param. Init keys and specs are
--- recorded as usual, so fsdp.materialize later gives the values an eager build would have.
--- Tensors the user makes and passes to nn.Parameter keep their device.
function M.meta(fn, ...)
  if type(fn) ~= "function" then
    raise(("fsdp.meta: expects a function that builds the model (got %s)"):format(type(fn)))
  end
  local prev = nn.set_param_device("meta")
  local res = {pcall(fn, ...)}
  nn.set_param_device(prev)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- ---- filling from init records ----------------------------------------------------------------

-- reset_parameters functions that only replay init records
local builtin_resets = {}
for _, C in ipairs{nn.Module, nn.Linear, nn.Embedding, nn.LayerNorm} do
  builtin_resets[rawget(C, "reset_parameters")] = true
end

-- true when m's reset_parameters is one of the built-in ones, whose effect is exactly each
-- owned parameter's init record: such parameters can be filled slice by slice from the record.
local function replays_records(m) return builtin_resets[m.reset_parameters] == true end

--- Fill dst (a contiguous tensor: all of p, or a slice of p's shard) with elements
--- [first, first + numel) of p's initial values, from p's init record. Records of kind nil
--- (values the user gave, or none) leave dst as it is (zero, freshly allocated).
function M.fill_from_record(dst, p, first)
  local r = base.init_record(p)
  if r == nil or r.kind == nil or dst:numel() == 0 then return false end
  if r.kind == "normal" then
    core.init_normal(dst, r.seed, r.key, r.a, r.b, first)
  elseif r.kind == "uniform" then
    core.init_uniform(dst, r.seed, r.key, r.a, r.b, first)
  elseif r.kind == "constant" then
    dst:fill(r.a)
  else
    error(("materialize: unknown init kind %s"):format(tostring(r.kind)), 0)
  end
  return true
end

-- Modules (pre-order, as named_modules) that hold one of `set`'s parameters in a field of
-- their own: array of {module =, path =}.
local function holders(model, set)
  local out = {}
  for path, m in model:named_modules() do
    for _, e in ipairs(base.own_entries(m)) do
      if set[e[2]] then
        out[#out + 1] = {module = m, path = path}
        break
      end
    end
  end
  return out
end

-- The parameters in m's own fields, {name, param} in order (to check fn kept them).
local function own_params(m)
  local out = {}
  for _, e in ipairs(base.own_entries(m)) do
    if not is_module(e[2]) then out[#out + 1] = e end
  end
  return out
end

-- Run call(m, path) with gradients off and check that it left m's parameter fields holding
-- the same objects (replacing one would split a tie and leave a unit's shard behind). A
-- replaced parameter is an error, and the original object goes back into its field first, so
-- that the error leaves the tie whole.
local call_checked_here
local function call_checked(what, call, m, path)
  -- a wrapped model refuses field writes (nn.module): this check names the parameter instead
  return base.with_checked_fields(call_checked_here, what, call, m, path)
end
call_checked_here = function(what, call, m, path)
  local before = own_params(m)
  local ok, err = util.quiet(call, m, path)
  if not ok then return false, err end
  local replaced
  for _, e in ipairs(before) do
    local name = e[1]
    local v = type(name) == "number" and rawget(m, name) or base.field(m, name)
    if not rawequal(v, e[2]) then
      m[name] = e[2]
      replaced = replaced or name
    end
  end
  if replaced ~= nil then
    return false, ("%s: %s replaced parameter %s with a new object; write into the "
      .. "parameter instead (p:copy(t), p:fill(v), fsdp.core.init_normal(p, ...)): a new "
      .. "object would break ties and references"):format(what,
        what == "fsdp.materialize" and "init_fn" or "the init function", util.join(path, replaced))
  end
  return true
end

-- ---- fsdp.materialize ----------------------------------------------------------------------

-- Plain model: every meta parameter gets dense storage, then its values.
local function materialize_plain(model, init_fn, device)
  local pending, list = {}, {}
  for _, p in ipairs(model:parameters()) do
    if p.device == "meta" then
      pending[p] = true
      list[#list + 1] = p
    end
  end
  if #list == 0 then return model end
  for _, p in ipairs(list) do core.param_materialize(p, device) end
  if init_fn ~= nil then
    for _, h in ipairs(holders(model, pending)) do
      local ok, err = call_checked("fsdp.materialize", init_fn, h.module, h.path)
      if not ok then error(err, 0) end
    end
    return model
  end
  local owners = base.init_owners(model)
  local custom, recorded = {}, {}
  for _, p in ipairs(list) do
    local o = owners[p]
    if o ~= nil and not replays_records(o.module) then
      custom[o.module] = true
    elseif o ~= nil then
      local ps = recorded[o.module] or {}
      recorded[o.module] = ps
      ps[#ps + 1] = p
    else
      util.no_grad(M.fill_from_record, p, p, 0)
      base.note_init(p)
    end
  end
  -- in the order of an eager build (every module's reset in pre-order): a custom
  -- reset_parameters that also writes into a later module's parameters is overwritten by that
  -- module's reset, as it is eagerly
  for path, m in model:named_modules() do
    if custom[m] then
      local ok, err = call_checked("fsdp.materialize", function(x) x:reset_parameters() end, m, path)
      if not ok then error(err, 0) end
    elseif recorded[m] then
      for _, p in ipairs(recorded[m]) do
        util.no_grad(M.fill_from_record, p, p, 0)
        base.note_init(p) -- fresh, as after an eager init
      end
    end
  end
  return model
end

-- Collective. Run call(m, path) for each entry of mods (pre-order) with the units that own
-- m's own parameters gathered, writing back and resharding a unit as soon as the next module
-- does not need it: memory is the units one module needs (usually one) plus the shards.
local function gathered_pass(R, mods, call, what)
  R:walk(what, true, function(gathered)
    -- put back (newest first) the units gathered for earlier modules that `keep` lacks
    local function release(keep)
      for i = #gathered, 1, -1 do
        if not (keep and keep[gathered[i][1]]) then
          R:restore({gathered[i]}, true, true)
          table.remove(gathered, i)
        end
      end
    end
    for _, h in ipairs(mods) do
      if h.fill ~= nil then
        -- no gather for this one: its parameters go into the gathered copy when their unit is
        -- held, else straight into this rank's shard
        local held = {}
        for _, g in ipairs(gathered) do held[g[1]] = true end
        h.fill(held)
        goto continue
      end
      local need = {}
      for _, e in ipairs(own_params(h.module)) do
        local u = R:unit_of_param(e[2])
        if u then need[u] = true end
      end
      release(need)
      local held = {}
      for _, g in ipairs(gathered) do held[g[1]] = true end
      for _, u in ipairs(R:units()) do -- construction order: the same on every rank
        if need[u] and not held[u] then R:gather(u, gathered) end
      end
      -- agreed at every module: a rank whose init failed must not leave the others gathering
      R:call_agreed(what, function()
        local fine, e = call_checked(what, call, h.module, h.path)
        if not fine then error(e, 0) end
      end)
      ::continue::
    end
  end)
end

--- Collective (wrapped). The pending (meta at wrap time) parameters of wrapped model R get
--- their values in this rank's shards. Without init_fn: parameters whose init owner is a
--- built-in module are generated straight into the shard slice from their init record (no
--- communication, no gathering); modules with their own reset_parameters run it on their
--- gathered unit. With init_fn: init_fn(module, path) for every module holding a pending
--- parameter, on its gathered unit, one unit at a time. Errors are raised unlocated (the
--- caller locates them).
function M.materialize_wrapped(R, init_fn, what)
  local model = R:model()
  local pending = {}
  local entries = {}
  for _, e in ipairs(R:pending_list()) do
    pending[e.param] = true
    entries[#entries + 1] = e.path
  end
  local msg = collective.check_lists(what, entries, nil,
    {subject = "the set of parameters waiting for values"})
  if msg then error(msg, 0) end
  if #entries == 0 then return model end
  if R:busy() then error(("%s: not inside %s"):format(what, R:busy()), 0) end
  if init_fn ~= nil then
    gathered_pass(R, holders(model, pending), init_fn, what)
  else
    local owners = base.init_owners(model)
    local custom, owning = {}, {}
    for p in pairs(pending) do
      local o = owners[p]
      if o ~= nil and not replays_records(o.module) then custom[o.module] = true end
      if o ~= nil then owning[o.module] = true end
    end
    -- an eager build resets every module in pre-order, so a custom reset_parameters that writes
    -- into a later module's parameters is overwritten by that module's reset: the modules from
    -- the first custom one on run in that order on their gathered units, record owners
    -- included; the parameters of record owners before it are filled straight into the shards
    -- this rank's slice of p, in u's shard, from p's record
    local function fill_slice(u, p)
      for _, s in ipairs(u:local_slices()) do
        if s.param == p then
          local dst = u:shard():narrow(1, s.shard_first, s.shard_last - s.shard_first + 1)
          util.no_grad(M.fill_from_record, dst, p, s.param_first - 1)
        end
      end
    end
    local mods, late = {}, {}
    for path, m in model:named_modules() do
      if custom[m] then
        mods[#mods + 1] = {module = m, path = path}
      elseif #mods > 0 and owning[m] then
        late[m] = true
        mods[#mods + 1] = {module = m, path = path, fill = function(held)
          for _, e in ipairs(own_params(m)) do
            local p, o = e[2], owners[e[2]]
            if pending[p] and o ~= nil and o.module == m then
              local u = R:unit_of_param(p)
              if held[u] then util.no_grad(M.fill_from_record, p, p, 0) else fill_slice(u, p) end
            end
          end
        end}
      end
    end
    for _, u in ipairs(R:units()) do
      u:reshard() -- no full buffer (or prefetch) may be left holding stale values
      for _, s in ipairs(u:local_slices()) do
        local p = s.param
        local o = owners[p]
        if pending[p] and not (o ~= nil and (custom[o.module] or late[o.module])) then
          fill_slice(u, p)
        end
      end
    end
    if #mods > 0 then
      gathered_pass(R, mods, function(m) m:reset_parameters() end, what)
    end
  end
  R:given_values(nil)
  return model
end

--- materialize(model, init_fn) -> model. Plain model (local): every meta parameter gets
--- dense storage in place and its values: init_fn(module, path) for each module holding one
--- (pre-order), or without init_fn its init record (the eager values) / its module's own
--- reset_parameters. Wrapped root (collective): see materialize_wrapped; only this rank's
--- shards are ever allocated, plus at most the units one module needs with init_fn.
function M.materialize(model, init_fn)
  if not is_module(model) then
    raise(("fsdp.materialize: expected a module (got %s)"):format(type(model)))
  end
  -- materialize(model, {init = fn, device = "cuda"}): the options form
  local device
  if type(init_fn) == "table" then
    local opts = util.check_opts("fsdp.materialize", init_fn, {"init", "device"})
    init_fn, device = opts.init, opts.device
    if device ~= nil and type(device) ~= "string" then
      raise(("fsdp.materialize: device must be a device name (got %s)"):format(type(device)))
    end
  end
  if init_fn ~= nil and type(init_fn) ~= "function" then
    raise(("fsdp.materialize: init_fn must be a function(module, path) (got %s)"):format(type(init_fn)))
  end
  local R = state.of(model)
  if R ~= nil and R:model() ~= model then
    raise(("fsdp.materialize: this %s is part of a wrapped model; materialize its root (a %s)")
      :format(model:type_name(), R:model():type_name()))
  end
  local ok, err
  if R ~= nil then
    local wdev = R:option("device") or "cpu"
    if device ~= nil and device ~= wdev then
      raise(("fsdp.materialize: a wrapped model's shards are where wrap put them (%s); wrap it "
        .. "with {device = \"%s\"} to materialize it there"):format(wdev, device))
    end
    ok, err = pcall(M.materialize_wrapped, R, init_fn, "fsdp.materialize")
  else
    ok, err = pcall(materialize_plain, model, init_fn, device)
  end
  if not ok then util.reraise(err) end
  -- masks set while the model was meta apply as soon as values arrive, not at the next step
  state.emit("materialize", model)
  return model
end

return M
