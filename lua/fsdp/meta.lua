-- fsdp.meta — deferred initialisation, ties and cross-rank agreement.
-- docs/init.md is the manual.
--
--   fsdp.meta(fn) -> model              build with every new parameter on the meta device
--   fsdp.materialize(model, init_fn)    give meta parameters storage and their values
--   fsdp.ties(model)                    every shared parameter with all its paths
--   fsdp.retie(model, groups)           make each group of paths one parameter
--   M.load_tensors(model, source, opts) tensors by name into a model (plain or wrapped; on
--                                       rank 0 only or on every rank) — what fsdp.load uses
--   M._agree(what, entries, err)        the cross-rank comparison wrap/materialize/load use
--
-- Invariants 1 and 2 (docs/ARCHITECTURE.md):
--   * Nothing here creates a parameter object in place of another. Materializing, loading and
--     sharding change what storage backs a parameter (core.param_materialize swaps a meta
--     storage for a dense one in place); retie reassigns module fields to an existing object.
--     So a tie is one object with one storage through every step, and cannot break.
--   * Values are a pure function of (seed, init key, element index) — the init records of
--     lua/fsdp/nn/module.lua and the counter-based RNG — so a rank fills its slice of a
--     parameter's shard with exactly the values an eagerly built model holds there, without
--     gathering anything (core.init_normal/init_uniform take the element offset).
--   * Collectives are issued in an order that depends only on state every rank agrees on:
--     before anything moves, _agree compares a description of that state across ranks and
--     turns any difference into the same error on every rank (never a hang).

local fsdp = require "fsdp"
local core = require "fsdp.core"
local collective = require "fsdp.collective"

local M = {}

local function base() return require "fsdp.nn.module" end
local function nnmod() return require "fsdp.nn" end
local function wrapmod() return require "fsdp.wrap" end
local function raise(msg) base().raise(msg) end
local function is_module(x) return base().is_module(x) end

local function join(prefix, name)
  if prefix == "" then return tostring(name) end
  return prefix .. "." .. tostring(name)
end

local function own_entries(m) return require("fsdp.nn.module").own_entries(m) end
M._own_entries = own_entries

local function shape_str(t) return "(" .. table.concat(t:shape(), ", ") .. ")" end
M._shape_str = shape_str

-- a note on rank 0 that does not break a progress line
local function note(msg) fsdp.log.print(msg) end

-- Run fn(...) with gradient recording off; returns ok, err.
local function quiet(fn, ...)
  local prev = core.set_grad_enabled(false)
  local ok, err = pcall(fn, ...)
  core.set_grad_enabled(prev)
  return ok, err
end

-- ---- cross-rank agreement -------------------------------------------------------------------
--
-- Each rank describes what it is about to act on as an array of strings (entries), in an
-- order that depends only on its model. collective.compare answers "did some rank fail
-- locally?" and "is every rank's list the same?" with one all_reduce; only on a difference do
-- the lists travel, and every rank then finds the first index where some rank differs from
-- rank 0 and which ranks differ there.

local function rank_list(ranks)
  local s = {}
  for i, r in ipairs(ranks) do s[i] = tostring(r) end
  return table.concat(s, ", ")
end

--- Collective. Compare `entries` (array of strings) across ranks, together with this rank's
--- local error `err` (nil when its own checks passed). Returns nil when every rank succeeded
--- with the same entries; otherwise a message, the same on every rank except that a rank that
--- failed gets its own error back:
---   "<what> failed on rank R: <R's error>"
---   "<what>: <subject> differs across ranks (item k): rank 0 has <entry>, rank R has <entry>
---    (ranks that differ from rank 0 there: R, ...)"
--- opts.subject names what is compared ("the model"); opts.hint(a, b) may add a sentence for
--- a given pair of texts.
function M._agree(what, entries, err, opts)
  if fsdp.world_size() == 1 then return err end
  local d = collective.compare(entries, err, what)
  if d == nil then return nil end
  if d.failed then
    if err then return err end
    return ("%s failed on rank %d: %s"):format(what, d.failed, d.err)
  end
  -- the first item where some rank differs from rank 0, and the ranks that differ there
  local ref = d.values[1]
  local at, first = math.huge, {}
  for i = 2, #d.values do
    local mine = d.values[i]
    for k = 1, math.max(#mine, #ref) + 1 do
      if mine[k] ~= ref[k] then first[i - 1] = k break end
    end
    if first[i - 1] and first[i - 1] < at then at = first[i - 1] end
  end
  local differ = {}
  for r = 1, #d.values - 1 do
    if first[r] == at then differ[#differ + 1] = r end
  end
  local other = differ[1]
  local a, b = ref[at] or "nothing more", d.values[other + 1][at] or "nothing more"
  local subject = opts and opts.subject or "the state"
  local msg = ("%s: %s differs across ranks (item %d): rank 0 has %s, rank %d has %s (ranks "
    .. "that differ from rank 0 there: %s)"):format(what, subject, at, a, other, b, rank_list(differ))
  local extra = opts and opts.hint and opts.hint(a, b)
  if extra then msg = msg .. "; " .. extra end
  return msg
end

-- ---- ties -----------------------------------------------------------------------------------

-- Every reference path of every distinct parameter of model: modules are walked without
-- deduplication (a module referenced from two places gives its parameters a path through
-- each), with a guard against cycles. Returns order (parameters by first path, the order of
-- named_parameters) and paths (param -> array of paths, first path first).
local function all_paths(model)
  local order, paths = {}, {}
  local onstack = {}
  local function visit(m, prefix)
    if onstack[m] then return end
    onstack[m] = true
    for _, e in ipairs(own_entries(m)) do
      local path, v = join(prefix, e[1]), e[2]
      if is_module(v) then
        visit(v, path)
      else
        local list = paths[v]
        if list == nil then
          list = {}
          paths[v] = list
          order[#order + 1] = v
        end
        list[#list + 1] = path
      end
    end
    onstack[m] = nil
  end
  visit(model, "")
  return order, paths
end
M._all_paths = all_paths

--- Every parameter reachable through more than one path, in named_parameters order:
--- { {param =, paths = {first, ...}}, ... }. Works on plain and wrapped models alike (wrapping
--- never replaces a parameter object).
function M.ties(model)
  if not is_module(model) then
    raise(("fsdp.ties: expected a module (got %s)"):format(type(model)))
  end
  local order, paths = all_paths(model)
  local out = {}
  for _, p in ipairs(order) do
    if #paths[p] > 1 then out[#out + 1] = {param = p, paths = paths[p]} end
  end
  return out
end

-- The (module, field) that path names inside model, and the value there.
local function resolve(model, path, what)
  local m, parent, key = model, nil, nil
  for part in path:gmatch("[^%.]+") do
    if not is_module(m) then
      raise(("%s: no parameter at %s (%s is a parameter, not a module)"):format(what, path,
        tostring(key)))
    end
    local k = tonumber(part)
    local v
    if k ~= nil and k == math.floor(k) and rawget(m, k) ~= nil then
      v = rawget(m, k)
    else
      k = part
      v = rawget(m, "__fields")[part]
    end
    if v == nil then
      raise(("%s: no parameter at %s (%s has no field %s)"):format(what, path, m:type_name(), part))
    end
    parent, key, m = m, k, v
  end
  if parent == nil or is_module(m) or not base().is_param(m) then
    raise(("%s: %s is not a parameter"):format(what, path))
  end
  return parent, key, m
end

local function max_abs_diff(a, b)
  local d1, d2
  local ok = quiet(function()
    local d = a:contiguous() - b:contiguous()
    d1, d2 = d:max(), (-d):max()
  end)
  if not ok then return nil end
  if type(d1) ~= "number" then d1, d2 = d1:item(), d2:item() end
  return math.max(d1, d2)
end

--- retie(model, { {"head.weight", "wte.weight"}, ... }): make each group of paths one
--- parameter. The parameter kept is the one that comes first in traversal order (the path
--- named_parameters reports), whatever the order inside the group, so a retied model has the
--- layout, init keys and values of a model built tied. The other paths' fields are set to it.
--- Shapes must match (error); values that differ give a warning with the largest difference.
--- Not on a wrapped model (unwrap first). Returns model.
function M.retie(model, groups)
  if not is_module(model) then
    raise(("fsdp.retie: expected a module (got %s)"):format(type(model)))
  end
  if rawget(model, "__fsdp_wrap") ~= nil and not rawget(model, "__fsdp_wrap").dead then
    raise("fsdp.retie: the model is wrapped; fsdp.unwrap it, retie, and wrap it again")
  end
  if type(groups) ~= "table" then
    raise("fsdp.retie: expects a list of groups of paths, e.g. {{\"head.weight\", \"wte.weight\"}}")
  end
  local index = {}
  local i = 0
  for _, p in model:named_parameters() do
    i = i + 1
    index[p] = i
  end
  local plans = {}
  for g, group in ipairs(groups) do
    if type(group) ~= "table" or #group < 2 then
      raise(("fsdp.retie: group %d must list at least two paths"):format(g))
    end
    local items = {}
    for k, path in ipairs(group) do
      if type(path) ~= "string" then
        raise(("fsdp.retie: group %d, element %d is a %s, not a path"):format(g, k, type(path)))
      end
      local m, key, p = resolve(model, path, "fsdp.retie")
      items[#items + 1] = {module = m, key = key, param = p, path = path}
    end
    local keep = items[1]
    for _, it in ipairs(items) do
      if index[it.param] < index[keep.param] then keep = it end
    end
    for _, it in ipairs(items) do
      if it.param ~= keep.param then
        if shape_str(it.param) ~= shape_str(keep.param) then
          raise(("fsdp.retie: %s %s and %s %s have different shapes"):format(keep.path,
            shape_str(keep.param), it.path, shape_str(it.param)))
        end
      end
    end
    plans[#plans + 1] = {keep = keep, items = items}
  end
  for _, plan in ipairs(plans) do
    local keep = plan.keep
    for _, it in ipairs(plan.items) do
      if it.param ~= keep.param then
        if it.param.has_data and keep.param.has_data then
          local d = max_abs_diff(it.param, keep.param)
          if d ~= nil and d > 0 then
            note(("fsdp.retie: warning: %s and %s held different values (largest difference "
              .. "%.6g); keeping %s's"):format(it.path, keep.path, d, keep.path))
          end
        end
        it.module[it.key] = keep.param
      end
    end
  end
  base().drop_unowned_keys(model)
  return model
end

-- ---- fsdp.meta ------------------------------------------------------------------------------

--- meta(fn, ...) -> fn's results: runs fn with new parameters created on the meta device
--- (shape only, no storage): every built-in layer and nn.new_param. Init keys and specs are
--- recorded as usual, so fsdp.materialize later gives the values an eager build would have.
--- Tensors the user makes and passes to nn.Parameter keep their device.
function M.meta(fn, ...)
  if type(fn) ~= "function" then
    raise(("fsdp.meta: expects a function that builds the model (got %s)"):format(type(fn)))
  end
  local nn = nnmod()
  local prev = nn.set_param_device("meta")
  local res = {pcall(fn, ...)}
  nn.set_param_device(prev)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- ---- filling from init records ----------------------------------------------------------------

local builtin_resets -- reset_parameters functions that only replay init records

-- true when m's reset_parameters is one of the built-in ones, whose effect is exactly each
-- owned parameter's init record: such parameters can be filled slice by slice from the record.
local function replays_records(m)
  if builtin_resets == nil then
    local nn = nnmod()
    builtin_resets = {}
    for _, C in ipairs{nn.Module, nn.Linear, nn.Embedding, nn.LayerNorm} do
      builtin_resets[rawget(C, "reset_parameters")] = true
    end
  end
  return builtin_resets[m.reset_parameters] == true
end

-- Fill dst (a contiguous tensor: all of p, or a slice of p's shard) with elements
-- [first, first + numel) of p's initial values, from p's init record. Records of kind nil
-- (values the user gave, or none) leave dst as it is (zero, freshly allocated).
local function fill_from_record(dst, p, first)
  local r = base().init_record(p)
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
M._fill_from_record = fill_from_record

-- Modules (pre-order, as named_modules) that hold one of `set`'s parameters in a field of
-- their own: array of {module =, path =}.
local function holders(model, set)
  local out = {}
  for path, m in model:named_modules() do
    for _, e in ipairs(own_entries(m)) do
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
  for _, e in ipairs(own_entries(m)) do
    if not is_module(e[2]) then out[#out + 1] = e end
  end
  return out
end

-- Run call(m, path) with gradients off and check that it left m's parameter fields holding
-- the same objects (replacing one would split a tie and leave a unit's shard behind).
local function call_checked(what, call, m, path)
  local before = own_params(m)
  local ok, err = quiet(call, m, path)
  if not ok then return false, err end
  for _, e in ipairs(before) do
    local now = e[1]
    local v = type(now) == "number" and rawget(m, now) or rawget(m, "__fields")[now]
    if not rawequal(v, e[2]) then
      return false, ("%s: %s replaced parameter %s with a new object; write into the "
        .. "parameter instead (p:copy(t), p:fill(v), fsdp.core.init_normal(p, ...)): a new "
        .. "object would break ties and references"):format(what,
          what == "fsdp.materialize" and "init_fn" or "the init function", join(path, now))
    end
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
  local owners = base().init_owners(model)
  local custom = {}
  for _, p in ipairs(list) do
    local o = owners[p]
    if o ~= nil and not replays_records(o.module) then
      custom[o.module] = true
    else
      local ok, err = quiet(fill_from_record, p, p, 0)
      if not ok then error(err, 0) end
      local r = base().init_record(p)
      if r ~= nil and r.kind ~= nil then r.version = p.version end -- fresh, as after an eager init
    end
  end
  for path, m in model:named_modules() do
    if custom[m] then
      local ok, err = call_checked("fsdp.materialize", function(x) x:reset_parameters() end, m, path)
      if not ok then error(err, 0) end
    end
  end
  return model
end

-- Collective. Run call(m, path) for each entry of mods (pre-order) with the units that own
-- m's own parameters gathered, writing back and resharding a unit as soon as the next module
-- does not need it: memory is the units one module needs (usually one) plus the shards.
local function gathered_pass(R, mods, call, what)
  local current = {}
  local function release(keep)
    for _, U in ipairs(R.units) do
      if current[U] and not (keep and keep[U]) then
        U.unit:writeback()
        U.unit:reshard()
        current[U] = nil
      end
    end
  end
  R.busy = what
  local ok, err = pcall(function()
    for _, h in ipairs(mods) do
      local need = {}
      for _, e in ipairs(own_params(h.module)) do
        local U = R.unit_of_param[e[2]]
        if U then need[U] = true end
      end
      release(need)
      for _, U in ipairs(R.units) do -- construction order: the same on every rank
        if need[U] and not current[U] then
          U.unit:gather()
          current[U] = true
        end
      end
      local fine, e = call_checked(what, call, h.module, h.path)
      if not fine then error(e, 0) end
    end
    release(nil)
  end)
  R.busy = nil
  if not ok then
    for _, U in ipairs(R.units) do
      if current[U] then pcall(U.unit.reshard, U.unit) end
    end
    error(err, 0)
  end
end

--- Collective (wrapped). The pending (meta at wrap time) parameters of a wrapped model get
--- their values in this rank's shards. Without init_fn: parameters whose init owner is a
--- built-in module are generated straight into the shard slice from their init record (no
--- communication, no gathering); modules with their own reset_parameters run it on their
--- gathered unit. With init_fn: init_fn(module, path) for every module holding a pending
--- parameter, on its gathered unit, one unit at a time.
function M._materialize_wrapped(R, init_fn, what)
  what = what or "fsdp.materialize"
  local model = R.model
  local pending = R.pending or {}
  local entries, count = {}, 0
  for _, U in ipairs(R.units) do
    for i, p in ipairs(U.params) do
      if pending[p] then
        count = count + 1
        entries[#entries + 1] = U.unit:paths()[i]
      end
    end
  end
  local msg = M._agree(what, entries, nil, {subject = "the set of parameters waiting for values"})
  if msg then error(msg, 0) end
  if count == 0 then
    R.pending = nil
    return model
  end
  if R.busy then error(("%s: not inside fsdp.%s"):format(what, R.busy), 0) end
  if init_fn ~= nil then
    gathered_pass(R, holders(model, pending), init_fn, what)
  else
    local owners = base().init_owners(model)
    local custom = {}
    for p in pairs(pending) do
      local o = owners[p]
      if o ~= nil and not replays_records(o.module) then custom[o.module] = true end
    end
    for _, U in ipairs(R.units) do
      U.unit:reshard() -- no full buffer (or prefetch) may be left holding stale values
      local shard
      for _, s in ipairs(U.unit:local_slices()) do
        local p = s.param
        local o = owners[p]
        if pending[p] and not (o ~= nil and custom[o.module]) then
          shard = shard or U.unit:shard()
          local dst = shard:narrow(1, s.shard_first, s.shard_last - s.shard_first + 1)
          local ok, err = quiet(fill_from_record, dst, p, s.param_first - 1)
          if not ok then error(err, 0) end
        end
      end
    end
    local mods = {}
    for path, m in model:named_modules() do
      if custom[m] then mods[#mods + 1] = {module = m, path = path} end
    end
    if #mods > 0 then
      gathered_pass(R, mods, function(m) m:reset_parameters() end, what)
    end
  end
  R.pending = nil
  return model
end

--- materialize(model, init_fn) -> model. Plain model (local): every meta parameter gets
--- dense storage in place and its values: init_fn(module, path) for each module holding one
--- (pre-order), or without init_fn its init record (the eager values) / its module's own
--- reset_parameters. Wrapped root (collective): see _materialize_wrapped; only this rank's
--- shards are ever allocated, plus at most the units one module needs with init_fn.
function M.materialize(model, init_fn)
  if not is_module(model) then
    raise(("fsdp.materialize: expected a module (got %s)"):format(type(model)))
  end
  -- materialize(model, {init = fn, device = "cuda"}): the options form
  local device
  if type(init_fn) == "table" then
    local opts = init_fn
    for k in pairs(opts) do
      if k ~= "init" and k ~= "device" then
        raise(("fsdp.materialize: unknown option %s (init, device)"):format(tostring(k)))
      end
    end
    init_fn, device = opts.init, opts.device
    if device ~= nil and type(device) ~= "string" then
      raise(("fsdp.materialize: device must be a device name (got %s)"):format(type(device)))
    end
  end
  if init_fn ~= nil and type(init_fn) ~= "function" then
    raise(("fsdp.materialize: init_fn must be a function(module, path) (got %s)"):format(type(init_fn)))
  end
  -- masks set while the model was meta apply as soon as values arrive, not at the next step
  local function reapply_masks()
    if package.loaded["fsdp.mask"] then package.loaded["fsdp.mask"].reapply(model) end
  end
  local R = wrapmod()._root_state(model)
  if R ~= nil then
    if device ~= nil and device ~= (R.opts.device or "cpu") then
      raise(("fsdp.materialize: a wrapped model's shards are where wrap put them (%s); wrap it "
        .. "with {device = \"%s\"} to materialize it there"):format(R.opts.device or "cpu", device))
    end
    local ok, err = pcall(M._materialize_wrapped, R, init_fn, "fsdp.materialize")
    if not ok then raise((tostring(err):gsub("^[^\n]-meta%.lua:%d+: ", ""))) end
    reapply_masks()
    return model
  end
  local S = rawget(model, "__fsdp_wrap")
  if S ~= nil and not S.dead then
    raise(("fsdp.materialize: this %s is part of a wrapped model; materialize its root (a %s)")
      :format(model:type_name(), S.model:type_name()))
  end
  local ok, err = pcall(materialize_plain, model, init_fn, device)
  if not ok then raise((tostring(err):gsub("^[^\n]-meta%.lua:%d+: ", ""))) end
  reapply_masks()
  return model
end

-- ---- loading tensors by name ------------------------------------------------------------------
--
-- A source is a plain table {name = tensor} or a safetensors reader (fsdp.core.st_open: has
-- entries() and read(name[, first, count])). Adapted to {names, shape(name), get(name),
-- get_slice(name, first, count) or nil}.

local function as_source(x)
  if type(x) == "table" then
    local names = {}
    for k, v in pairs(x) do
      if type(k) ~= "string" or not base().is_tensor(v) then
        error(("fsdp.load: the tensor table maps names to tensors (got %s = %s)")
          :format(tostring(k), type(v)), 0)
      end
      names[#names + 1] = k
    end
    table.sort(names)
    return {names = names, shape = function(n) return x[n]:shape() end,
      get = function(n) return x[n] end}
  end
  local ok, entries = pcall(function() return x:entries() end)
  if not ok or type(entries) ~= "table" then
    error("fsdp.load: the source must be a table of tensors by name or a safetensors reader", 0)
  end
  local names, shapes = {}, {}
  for _, e in ipairs(entries) do
    names[#names + 1] = e.name
    shapes[e.name] = e.shape
  end
  return {names = names, shape = function(n) return shapes[n] end,
    get = function(n) return x:read(n) end,
    get_slice = function(n, first, count) return x:read(n, first, count) end}
end

local function shape_of(list) return "(" .. table.concat(list, ", ") .. ")" end

-- The plan: for each distinct parameter (order), the source name to read, or nil; plus the
-- other names of it the source holds (tied copies) and the names the source has that match no
-- path. Errors (strict) for missing and unexpected names and any shape mismatch.
local function plan_load(order, paths, src, strict)
  local have = {}
  for _, n in ipairs(src.names) do have[n] = true end
  local used = {}
  local plan, missing, problems = {}, {}, {}
  for _, p in ipairs(order) do
    local chosen, copies = nil, {}
    for _, path in ipairs(paths[p]) do
      if have[path] then
        used[path] = true
        if chosen == nil then chosen = path else copies[#copies + 1] = path end
      end
    end
    if chosen == nil then
      missing[#missing + 1] = paths[p][1]
    else
      local want = shape_str(p)
      for _, n in ipairs{chosen, unpack(copies)} do
        local got = shape_of(src.shape(n))
        if got ~= want then
          problems[#problems + 1] = ("%s has shape %s in the source, the model's is %s")
            :format(n, got, want)
        end
      end
      plan[p] = {name = chosen, copies = copies}
    end
  end
  local unexpected = {}
  for _, n in ipairs(src.names) do
    if not used[n] then unexpected[#unexpected + 1] = n end
  end
  local function few(list)
    local s = {}
    for i = 1, math.min(#list, 5) do s[i] = list[i] end
    return table.concat(s, ", ") .. (#list > 5 and (", ... (%d in all)"):format(#list) or "")
  end
  if #problems > 0 then return nil, "fsdp.load: " .. table.concat(problems, "; ") end
  if strict and #missing > 0 then
    return nil, ("fsdp.load: the source has no tensor for %s (strict; pass strict = false to "
      .. "load the rest)"):format(few(missing))
  end
  if strict and #unexpected > 0 then
    return nil, ("fsdp.load: the source holds tensors the model has no parameter for: %s "
      .. "(strict; pass strict = false to ignore them)"):format(few(unexpected))
  end
  return {plan = plan, missing = missing, unexpected = unexpected}
end

-- Compare the tied copies a source holds for one parameter; a note when they differ.
local function check_copies(src, p, e, notes)
  if #e.copies == 0 then return end
  local a = src.get(e.name)
  for _, c in ipairs(e.copies) do
    local d = max_abs_diff(a, src.get(c))
    if d ~= nil and d > 0 then
      notes[#notes + 1] = ("%s and %s are one tied parameter; the source's two copies differ "
        .. "(largest difference %.6g): loaded %s's"):format(e.name, c, d, e.name)
    end
  end
end

--- load_tensors(model, source, {strict = true}) -> {loaded =, missing = {...}, unexpected =
--- {...}, notes = {...}}. A tied parameter is filled once, from the first of its paths the
--- source holds (all its paths then see it: one object); when the source holds several of its
--- names and their values differ, a note says so (printed on rank 0).
---   plain model (local): meta parameters get storage; values copied in.
---   wrapped root (collective): source on every rank — each rank copies its own slices (a
---   reader reads only them); source on rank 0 only (nil elsewhere) — rank 0 broadcasts each
---   parameter in turn and every rank keeps its slice: no rank ever holds more than one full
---   parameter beyond its shards. Loaded parameters stop being pending (see materialize).
function M.load_tensors(model, source, opts)
  opts = opts or {}
  local strict = opts.strict ~= false
  if not is_module(model) then
    raise(("fsdp.load: expected a module (got %s)"):format(type(model)))
  end
  local order, paths = all_paths(model)
  local R = wrapmod()._root_state(model)
  local notes = {}
  if R == nil then
    local S = rawget(model, "__fsdp_wrap")
    if S ~= nil and not S.dead then
      raise(("fsdp.load: this %s is part of a wrapped model; load into its root"):format(model:type_name()))
    end
    if source == nil then raise("fsdp.load: no source (a table of tensors by name or a reader)") end
    local ok, res = pcall(function()
      local src = as_source(source)
      local pl, err = plan_load(order, paths, src, strict)
      if not pl then error(err, 0) end
      local n = 0
      for _, p in ipairs(order) do
        local e = pl.plan[p]
        if e then
          check_copies(src, p, e, notes)
          if p.device == "meta" then core.param_materialize(p) end
          local t = src.get(e.name)
          local fine, err2 = quiet(function() p:copy(t:contiguous():view(p:shape())) end)
          if not fine then error(err2, 0) end
          n = n + 1
        end
      end
      return {loaded = n, missing = pl.missing, unexpected = pl.unexpected, notes = notes}
    end)
    if not ok then raise((tostring(res):gsub("^[^\n]-meta%.lua:%d+: ", ""))) end
    for _, s in ipairs(notes) do note(s) end
    return res
  end
  -- wrapped: collective
  if R.busy then raise("fsdp.load: not inside fsdp." .. R.busy) end
  local W, rank = fsdp.world_size(), fsdp.rank()
  local has = source ~= nil
  local given = W == 1 and (has and 1 or 0) or core.all_reduce(has and 1 or 0, "sum", "fsdp.load")
  local mode
  if given == W then
    mode = "every"
  elseif given == 1 and (W == 1 or core.all_reduce(has and rank or W, "min", "fsdp.load") == 0) then
    mode = "root"
  else
    raise(("fsdp.load: pass the tensors on rank 0 only (the others nil) or on every rank; %d of "
      .. "%d ranks passed them"):format(given, W))
  end
  local pl, local_err
  if has then
    local ok, res = pcall(function()
      local src = as_source(source)
      local p2, err = plan_load(order, paths, src, strict)
      if not p2 then error(err, 0) end
      p2.src = src
      return p2
    end)
    if ok then pl = res else local_err = tostring(res) end
  end
  -- every rank learns whether the planning ranks succeeded; in "root" mode also which
  -- parameters rank 0 will send (the others follow its plan)
  local msg = M._agree("fsdp.load", {}, local_err)
  if msg then raise(msg) end
  local send = {} -- param -> true when loaded
  if mode == "root" then
    local flags = {}
    if rank == 0 then
      for i, p in ipairs(order) do flags[i] = pl.plan[p] ~= nil end
    end
    if W > 1 then flags = collective.broadcast(flags, 0, "fsdp.load") end
    for i, p in ipairs(order) do send[p] = flags[i] end
  else
    for _, p in ipairs(order) do send[p] = pl.plan[p] ~= nil end
  end
  local loaded = 0
  local ok, err = pcall(function()
    if pl then
      for _, p in ipairs(order) do
        if pl.plan[p] and (mode == "every" or rank == 0) then check_copies(pl.src, p, pl.plan[p], notes) end
      end
    end
    for _, U in ipairs(R.units) do
      U.unit:reshard()
      local params, upaths = U.unit:params(), U.unit:paths()
      local slices = {}
      for _, s in ipairs(U.unit:local_slices()) do slices[s.index] = s end
      local shard
      for i, p in ipairs(params) do
        if send[p] then
          loaded = loaded + 1
          local s = slices[i]
          if mode == "root" then
            -- in the shard's dtype on every rank (a source may hold another: a bf16 file)
            local buf, dt = nil, U.unit:shard():dtype()
            if rank == 0 then
              buf = pl.src.get(pl.plan[p].name):contiguous():view{p:numel()}:to(dt)
            else
              buf = fsdp.zeros({p:numel()}, {dtype = dt})
            end
            if W > 1 then core.broadcast(buf, 0, upaths[i]) end
            if s then
              shard = shard or U.unit:shard()
              local len = s.shard_last - s.shard_first + 1
              local part = buf:narrow(1, s.param_first, len)
              shard:narrow(1, s.shard_first, len):copy(part)
              if rank ~= 0 then part:free() end
            end
            -- at most one parameter in flight: do not wait for the collector (rank 0's buf
            -- views the caller's tensor and goes with it)
            if rank ~= 0 then buf:free() end
          elseif s then
            shard = shard or U.unit:shard()
            local len = s.shard_last - s.shard_first + 1
            local part
            if pl.src.get_slice then
              part = pl.src.get_slice(pl.plan[p].name, s.param_first - 1, len)
            else
              part = pl.src.get(pl.plan[p].name):contiguous():view{p:numel()}:narrow(1, s.param_first, len)
            end
            shard:narrow(1, s.shard_first, len):copy(part)
            if pl.src.get_slice then part:free() end
          end
          if R.pending then R.pending[p] = nil end
        end
      end
    end
  end)
  if not ok then raise((tostring(err):gsub("^[^\n]-meta%.lua:%d+: ", ""))) end
  if R.pending and next(R.pending) == nil then R.pending = nil end
  for _, s in ipairs(notes) do note(s) end
  local res = {loaded = loaded, notes = notes}
  if pl then res.missing, res.unexpected = pl.missing, pl.unexpected end
  return res
end

--- mark_loaded(model, params): for loaders that write shards themselves (fsdp.load): the
--- given parameters of a wrapped model (meta at wrap time) now hold values, so they stop
--- being pending (a forward is refused while any is). Plain models need nothing (a meta
--- parameter gets storage with fsdp.core.param_materialize(p) before it is written).
function M.mark_loaded(model, params)
  local R = wrapmod()._root_state(model)
  if R == nil or R.pending == nil then return end
  for _, p in ipairs(params) do R.pending[p] = nil end
  if next(R.pending) == nil then R.pending = nil end
end

-- The names of the API (fsdp.meta, fsdp.materialize, fsdp.ties, fsdp.retie) until fsdp's lazy
-- loader lists them (lua/fsdp/init.lua).
for _, k in ipairs{"meta", "materialize", "ties", "retie"} do
  if rawget(fsdp, k) == nil then rawset(fsdp, k, M[k]) end
end

return M
