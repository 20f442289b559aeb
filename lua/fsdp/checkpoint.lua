-- fsdp.save / fsdp.load — collective, bounded-memory, atomic checkpoints.
-- docs/checkpoints.md is the manual and the format specification; the file formats
-- themselves (safetensors writer/reader with XXH3 checksums, atomic files, the index schema
-- check) are C: src/io, through fsdp.core (src/lua/l_io.c).
--
--   fsdp.save(model, path, {format = "safetensors" | "sharded", optimizer =, extra =,
--             loaders = {name = loader} | loader =, schedule =, step =})        -- collective
--   fsdp.load(model, path, {optimizer =, strict = true, loaders = | loader =, schedule =,
--             rng = true}) -> extra, info                                       -- collective
--
-- Two formats:
--   * "safetensors": one standard file of the full model. Rank 0 writes; every rank takes part
--     in gathering one unit at a time, so memory is the largest unit plus the writer's buffer.
--     A tied parameter is stored once (its other paths in __metadata__ "fsdp.tied.<alias>"),
--     masks as tensors "<path>:mask". Loading reads on every rank only its shard's ranges.
--   * "sharded": a folder with one safetensors file per rank (its slices of parameters,
--     optimizer state and masks) and index.json (checked in C: src/io/index.c), written last.
--     Loading computes, from the index, which ranges of which files hold this rank's slices,
--     so a checkpoint saved at W ranks loads at any world size (resharding).
--
-- Dtypes: every tensor is stored in its own dtype (parameters of a plain model in theirs, a
-- wrapped model's in its shards' (f32 masters), optimizer state in its own, tensors in extra
-- in theirs; masks as F32 0/1). Loading reads into buffers of the dtype the model (or the
-- optimizer) has, converting as it reads (fsdp.core's r:read(name, first, count, out)).
-- Tensors anywhere in extra are stored as tensors "fsdp.extra:<n>" (safetensors: in the file;
-- sharded: in rank 0's file, listed in the index's extra_tensors) and stand in the JSON of
-- extra as {"fsdp.tensor": "<name>"}.
--
-- Collective safety (the rule every function here follows): whatever can fail on one rank
-- alone (file system, damaged files, a check) runs inside pcall, and the ranks then agree
-- (an all-reduce) before anything irreversible: before the index commit when saving, before
-- the model is touched when loading. If any rank failed, every rank raises the same message
-- (the lowest failing rank's, broadcast), so nobody hangs in a collective the others left.
-- Collectives themselves (gathers, the agreement) are issued in an order that depends only on
-- the model and the options, never on a rank's local success.

local fsdp = require "fsdp"
local core = require "fsdp.core"
local collective = require "fsdp.collective"

local C = {}

local INDEX = "index.json"
local FORMAT_TAG = "fsdprun.sharded" -- FSDP_IO_INDEX_FORMAT
local LABEL = "checkpoint"           -- collective label (flight recorder, mismatch messages)

local function base() return require "fsdp.nn.module" end
local function raise(msg) base().raise(msg) end
local function fail(msg) error(msg, 0) end -- inside pcall'd phases: no position prefix

local function is_module(x) return base().is_module(x) end

-- ---- small helpers --------------------------------------------------------------------------

local function shape_str(shape)
  local parts = {}
  for i = 1, #shape do parts[i] = tostring(shape[i]) end
  return "(" .. table.concat(parts, ", ") .. ")"
end

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

local function join(dir, name)
  if dir:sub(-1) == "/" then return dir .. name end
  return dir .. "/" .. name
end

local function strip_slashes(path)
  local p = path:gsub("/+$", "")
  if p == "" then return "/" end
  return p
end

local function parent_dir(path)
  local d = path:match("^(.*)/[^/]*$")
  if d == nil then return "." end
  if d == "" then return "/" end
  return d
end

local function sorted_keys(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  table.sort(ks)
  return ks
end

-- The format's name of a tensor dtype ("bf16" -> "BF16").
local ST_DTYPE = {f32 = "F32", bf16 = "BF16", f16 = "F16", f64 = "F64", i64 = "I64", i32 = "I32",
  u8 = "U8", bool = "BOOL"}
local function st_dtype(t) return ST_DTYPE[t:dtype()] end

-- Devices whose tensors hold no values (a model built on meta, a sharded parameter). Any other
-- device is fine: tensors that are not in host memory are saved and loaded through a bounded
-- host buffer (src/io/st_tensor.c), and loads stage on the target's device.
local NO_DATA = {meta = true, sharded = true}

-- Run fn with gradient recording off (narrow/view/copy on parameters must not be taped).
local function quiet(fn, ...)
  local prev = core.set_grad_enabled(false)
  local res = {pcall(fn, ...)}
  core.set_grad_enabled(prev)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- ---- agreement between ranks ------------------------------------------------------------------

-- An error message without the locations inside the fsdp library that engine errors and
-- error() prepend ("/.../lua/fsdp/checkpoint.lua:123: "): the user gets the message, located
-- at their own call by raise().
local function clean(err)
  local msg = tostring(err)
  while true do
    local rest = msg:match("^[^\n:]-fsdp/[%w_/]+%.lua:%d+: (.*)$")
    if rest == nil then break end
    msg = rest
  end
  return msg
end

-- Every rank gets every rank's value (collective.lua: tables, strings, numbers, booleans).
local function allgather(value) return collective.all_gather(value, LABEL) end

-- Collective. nil when every rank passed ok; otherwise the same message on every rank (the
-- lowest failing rank's, marked with its rank when there are several ranks).
local function disagreement(ok, err)
  local W = fsdp.world_size()
  local msg = nil
  if not ok then
    msg = clean(err)
    if W > 1 and #msg > 8000 then msg = msg:sub(1, 8000) .. "..." end
  end
  local d = collective.compare(nil, msg, LABEL)
  if d == nil then return nil end
  if W == 1 then return d.err end
  return ("rank %d of %d: %s"):format(d.failed, W, d.err)
end

-- ---- the model's parameters ----------------------------------------------------------------------

-- Every path of every parameter: {list = {{path =, param =, aliases = {...}}, ...} in
-- named_parameters order (path is the first path), by_param =, by_path = (every path, aliases
-- included)}. A tied parameter has the other paths that reach it as aliases.
local function param_table(model)
  local list, by_param, by_path = {}, {}, {}
  for path, p in model:named_parameters() do
    local it = {path = path, param = p, aliases = {}}
    list[#list + 1] = it
    by_param[p] = it
    by_path[path] = it
  end
  local onstack = {}
  local function visit(m, prefix)
    if onstack[m] then return end
    onstack[m] = true
    local fields, order = rawget(m, "__fields"), rawget(m, "__order")
    local function one(name, v)
      if v == nil then return end
      local path = prefix == "" and tostring(name) or (prefix .. "." .. tostring(name))
      if is_module(v) then
        visit(v, path)
      else
        local it = by_param[v]
        if it and path ~= it.path and by_path[path] == nil then
          it.aliases[#it.aliases + 1] = path
          by_path[path] = it
        end
      end
    end
    if fields and order then
      for i = 1, #order do one(order[i], fields[order[i]]) end
    end
    for i = 1, #m do one(i, rawget(m, i)) end
    onstack[m] = nil
  end
  visit(model, "")
  return {list = list, by_param = by_param, by_path = by_path}
end

local function check_model(fn, model)
  if not is_module(model) then raise(("%s: expected a module (got %s)"):format(fn, type(model))) end
  local R = rawget(model, "__fsdp_wrap")
  if R ~= nil and not R.dead and R.model ~= model then
    raise(("%s: this %s is part of a wrapped model: pass the wrapped root (a %s)")
      :format(fn, model:type_name(), R.model:type_name()))
  end
  return R ~= nil and not R.dead
end

-- This rank's part of each parameter. {first =, count =, view = 1-D tensor of count elements
-- whose writes land in the parameter (or its shard), replicated = true when every rank holds
-- the whole parameter (a plain model, or a unit with strategy "none")}.
-- for_load: a plain parameter on the meta device (fsdp.meta) is accepted, marked meta = true
-- and given storage only when the load applies (apply_plan).
local function local_parts(P, for_load)
  local slices_of = {} -- unit -> {param -> local slice}
  local parts = {}
  for _, it in ipairs(P.list) do
    local p = it.param
    local u = core.param_unit and core.param_unit(p)
    if u == nil then
      if p.device == "meta" and for_load then
        parts[p] = {first = 0, count = p:numel(), replicated = true, meta = true, dtype = p:dtype()}
      elseif NO_DATA[p.device] then
        fail(("parameter %s is on the %s device: materialize the model first"):format(it.path, p.device))
      else
        parts[p] = {first = 0, count = p:numel(), view = p:detach():view{p:numel()},
          replicated = true, dtype = p:dtype(), device = p.device}
      end
    else
      local map = slices_of[u]
      if map == nil then
        map = {}
        for _, s in ipairs(u:local_slices()) do map[s.param] = s end
        slices_of[u] = map
      end
      local s = map[p]
      local replicated = u:strategy() == "none"
      local shard = u:shard()
      -- a wrapped model's values are its shards (f32 masters), whatever its gathers hold
      if s == nil then
        parts[p] = {first = 0, count = 0, replicated = replicated, unit = u, dtype = shard:dtype(),
          device = shard.device}
      else
        local n = s.shard_last - s.shard_first + 1
        parts[p] = {first = s.param_first - 1, count = n, replicated = replicated, unit = u,
          view = shard:narrow(1, s.shard_first, n), dtype = shard:dtype(), device = shard.device}
      end
    end
  end
  return parts
end

-- The even split of n elements over W ranks (for parameters every rank holds whole):
-- rank r saves [r*chunk, min(n, (r+1)*chunk)).
local function even_slice(n, W, r)
  local chunk = math.ceil(n / W)
  local first = r * chunk
  local count = math.max(0, math.min(chunk, n - first))
  return first, count
end

-- Which elements of each parameter each rank saves in a sharded checkpoint: {[p] = {{rank =,
-- first =, count =}, ...} sorted by first}. Sharded units: the unit layout's slices (every
-- rank's, from rank 0's view of the layout); replicated parameters: the even split.
local function save_slices(P, parts)
  local W = fsdp.world_size()
  local layouts = {}
  local out = {}
  for _, it in ipairs(P.list) do
    local p, part = it.param, parts[it.param]
    local sl = {}
    if part.replicated then
      for r = 0, W - 1 do
        local first, count = even_slice(p:numel(), W, r)
        if count > 0 then sl[#sl + 1] = {rank = r, first = first, count = count} end
      end
    else
      local u = part.unit
      local lay = layouts[u]
      if lay == nil then
        lay = {}
        local paths = u:paths()
        local params = u:params()
        local path_of = {}
        for i = 1, #params do path_of[paths[i]] = params[i] end
        for _, l in ipairs(u:layout()) do lay[path_of[l.path] or l.path] = l end
        layouts[u] = lay
      end
      local l = lay[p]
      for r = 0, W - 1 do
        local s = l and l.slices[r]
        if s then sl[#sl + 1] = {rank = r, first = s[1] - 1, count = s[2] - s[1] + 1} end
      end
      table.sort(sl, function(a, b) return a.first < b.first end)
    end
    out[p] = sl
  end
  return out
end

-- Reshard every unit that shards (collective, idempotent) so no gathered copy or prefetch
-- outlives a change of the shards.
local function reshard_all(model)
  for _, u in ipairs(fsdp.units(model)) do
    if u:strategy() ~= "none" then u:reshard() end
  end
end

-- ---- tensors in extra ---------------------------------------------------------------------
--
-- extra is a JSON-able value that may hold tensors anywhere (as values). Saving replaces each
-- with {["fsdp.tensor"] = name} (names "fsdp.extra:1", ... in a fixed walk: array order, then
-- sorted keys) and stores the tensor under that name; loading puts the tensors back.

local EXTRA_TAG = "fsdp.tensor"
local EXTRA_PREFIX = "fsdp.extra:"

local function is_tensor(v) return base().is_tensor(v) end

-- -> the JSON value (tensors replaced by tags), {{name =, tensor =}, ...}. Errors name the
-- place ("extra.a[2]").
local function split_extra(extra)
  local tensors = {}
  local function walk(v, where, depth)
    if is_tensor(v) then
      if NO_DATA[v.device] then
        error(("%s is a tensor without data (on the %s device)"):format(where, v.device), 0)
      end
      local name = EXTRA_PREFIX .. (#tensors + 1)
      tensors[#tensors + 1] = {name = name, tensor = v}
      return {[EXTRA_TAG] = name}
    end
    if type(v) ~= "table" then return v end
    if depth > 64 then error(("%s is nested deeper than 64 levels (a cycle?)"):format(where), 0) end
    if rawget(v, EXTRA_TAG) ~= nil then
      error(("%s has the key %q, which fsdp.save keeps for tensors"):format(where, EXTRA_TAG), 0)
    end
    local out, n = {}, #v
    for i = 1, n do out[i] = walk(v[i], ("%s[%d]"):format(where, i), depth + 1) end
    local keys = {}
    for k in pairs(v) do
      local in_array = type(k) == "number" and k >= 1 and k <= n and k == math.floor(k)
      if not in_array then keys[#keys + 1] = k end
    end
    table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
    for _, k in ipairs(keys) do
      out[k] = walk(v[k], ("%s.%s"):format(where, tostring(k)), depth + 1)
    end
    return out
  end
  return walk(extra, "extra", 0), tensors
end

-- The value with each tag replaced by get(name) (what load returns as extra).
local function join_extra(v, get)
  if type(v) ~= "table" then return v end
  local name = v[EXTRA_TAG]
  if type(name) == "string" and next(v, next(v)) == nil then return get(name) end
  local out = {}
  for k, x in pairs(v) do out[k] = join_extra(x, get) end
  return out
end

-- Every tag's name in a decoded extra, in a list.
local function extra_names(v, out)
  out = out or {}
  if type(v) == "table" then
    if type(v[EXTRA_TAG]) == "string" and next(v, next(v)) == nil then
      out[#out + 1] = v[EXTRA_TAG]
    else
      for _, x in pairs(v) do extra_names(x, out) end
    end
  end
  return out
end

-- ---- masks (fsdp.mask, lua/fsdp/mask.lua) ------------------------------------------------------
--
-- The extension point for masks (lua/fsdp/mask.lua). The adapter needs: has(p) (local, the same on
-- every rank), local_slice(p) (this rank's slice, the elements of fsdp.shard(p)), full(p)
-- (collective when wrapped: the full-shape mask) and set_local(model, {[p] = slice | false})
-- (collective when wrapped) — lua/fsdp/mask.lua has them. Without them (a build without
-- mask.lua) no masks are saved or loaded: a file holding masks then loads its weights, and
-- strict loading reports the masks as unexpected.

local function mask_api()
  local ok, m = pcall(require, "fsdp.mask")
  if not ok or type(m) ~= "table" then return nil end
  local api = {}
  api.has = m.has
  api.local_slice = m.local_slice
  api.full = m.full or m.mask or rawget(fsdp, "mask")
  api.set_local = m.set_local
  if api.has and api.local_slice and api.full and api.set_local then return api end
  return nil
end
C._mask_api = mask_api -- tests replace it to check the plumbing

local MASK_SUFFIX = ":mask"

-- ---- options ------------------------------------------------------------------------------------

local SAVE_OPTS = {format = true, optimizer = true, extra = true, loaders = true, loader = true,
  schedule = true, step = true}
local LOAD_OPTS = {optimizer = true, strict = true, loaders = true, loader = true, schedule = true,
  rng = true, format = true}

local function check_opts(fn, opts, known)
  opts = opts or {}
  if type(opts) ~= "table" then raise(fn .. ": options must be a table") end
  for k in pairs(opts) do
    if not known[k] then
      local names = sorted_keys(known)
      raise(("%s: unknown option %s (%s)"):format(fn, tostring(k), table.concat(names, ", ")))
    end
  end
  if opts.optimizer ~= nil and (type(opts.optimizer) ~= "table" or opts.optimizer.export_slices == nil) then
    raise(fn .. ": optimizer must be an fsdp.optim optimizer")
  end
  local loaders = {}
  if opts.loader ~= nil then loaders.loader = opts.loader end
  if opts.loaders ~= nil then
    if type(opts.loaders) ~= "table" then raise(fn .. ": loaders must be a table {name = loader}") end
    for k, l in pairs(opts.loaders) do loaders[k] = l end
  end
  for k, l in pairs(loaders) do
    if type(k) ~= "string" or type(l) ~= "table" or type(l.cursor) ~= "number" then
      raise(("%s: loader %s must be a data loader (with a cursor field)"):format(fn, tostring(k)))
    end
  end
  if opts.schedule ~= nil and (type(opts.schedule) ~= "table" or type(opts.schedule.state_dict) ~= "function") then
    raise(fn .. ": schedule must have state_dict/load_state_dict (fsdp.optim.cosine)")
  end
  return opts, loaders
end

-- ---- safetensors: save ------------------------------------------------------------------------------

local function save_safetensors(model, path, opts, wrapped, X)
  local rank = fsdp.rank()
  local P = param_table(model)
  local masks = mask_api()
  if opts.optimizer then
    raise("fsdp.save: a safetensors file holds the model only; save optimizer state with "
      .. "format = \"sharded\"")
  end
  -- tensors in the order they will be written: unit by unit when wrapped
  local groups = {} -- {{unit = u or nil, items = {it...}}}
  if wrapped then
    for _, u in ipairs(fsdp.units(model)) do
      local items = {}
      for _, p in ipairs(u:params()) do items[#items + 1] = P.by_param[p] end
      groups[#groups + 1] = {unit = u, items = items}
    end
  else
    for _, it in ipairs(P.list) do
      if NO_DATA[it.param.device] then
        raise(("fsdp.save: parameter %s is on the %s device: materialize the model first")
          :format(it.path, it.param.device))
      end
    end
    groups[1] = {items = P.list}
  end
  local entries, meta = {}, {}
  local has_mask = {}
  for _, g in ipairs(groups) do
    -- each parameter in its own dtype; a wrapped model's in its shards' (the f32 masters)
    local dtype = g.unit and st_dtype(g.unit:shard())
    for _, it in ipairs(g.items) do
      entries[#entries + 1] = {name = it.path, shape = it.param:shape(),
        dtype = dtype or st_dtype(it.param)}
      if masks and masks.has(it.param) then
        has_mask[it.param] = true
        entries[#entries + 1] = {name = it.path .. MASK_SUFFIX, shape = it.param:shape(),
          dtype = "F32"}
      end
      for _, a in ipairs(it.aliases) do meta["fsdp.tied." .. a] = it.path end
    end
  end
  for _, x in ipairs(X.tensors) do
    entries[#entries + 1] = {name = x.name, shape = x.tensor:shape(), dtype = st_dtype(x.tensor)}
  end
  meta["fsdp.format"] = "fsdprun.safetensors"
  meta["fsdp.version"] = "1"
  if X.text then meta["fsdp.extra"] = X.text end
  if opts.step ~= nil then meta["fsdp.step"] = tostring(opts.step) end

  -- rank 0 opens the writer; every rank learns whether it could
  local w
  local ok, err = true, nil
  if rank == 0 then
    ok, err = pcall(function()
      core.io_mkdirs(parent_dir(path))
      w = core.st_writer(path, entries, meta)
    end)
  end
  local msg = disagreement(ok, err)
  if msg then raise("fsdp.save: " .. msg) end

  -- one unit at a time: gather (collective), rank 0 writes, reshard
  for _, g in ipairs(groups) do
    local u = g.unit
    local was_sharded = u and u:state() == "sharded"
    if u then u:gather() end
    local full_masks = {}
    if masks then
      for _, it in ipairs(g.items) do
        if has_mask[it.param] then full_masks[it.param] = masks.full(it.param) end -- collective
      end
    end
    if rank == 0 and ok then
      ok, err = pcall(function()
        for _, it in ipairs(g.items) do
          w:write(it.path, it.param)
          if full_masks[it.param] then w:write(it.path .. MASK_SUFFIX, full_masks[it.param]) end
        end
      end)
    end
    if was_sharded then u:reshard() end
    full_masks = nil
    msg = disagreement(ok, err)
    if msg then
      if w then w:abort() end
      raise("fsdp.save: " .. msg)
    end
  end
  -- rank 0's extra tensors (in their own dtype and device: the writer stages them), commit
  if rank == 0 then
    ok, err = pcall(function()
      for _, x in ipairs(X.tensors) do w:write(x.name, x.tensor) end
      w:commit()
    end)
    if not ok then w:abort() end
  end
  msg = disagreement(ok, err)
  if msg then raise("fsdp.save: " .. msg) end
end

-- ---- safetensors: load ------------------------------------------------------------------------------

-- Where each model parameter comes from in a file whose tensors are `names` (set) and whose
-- ties are `tied` (alias -> stored name): the stored name, or nil. A parameter is found under
-- its first path, then its aliases, directly or through the file's ties.
local function source_name(it, names, tied)
  local function find(path)
    if names[path] then return path end
    local t = tied[path]
    if t and names[t] then return t end
    return nil
  end
  local s = find(it.path)
  if s then return s end
  for _, a in ipairs(it.aliases) do
    s = find(a)
    if s then return s end
  end
  return nil
end

local function list_names(names, max)
  max = max or 8
  local out = {}
  for i = 1, math.min(#names, max) do out[i] = names[i] end
  local s = table.concat(out, ", ")
  if #names > max then s = s .. (", ... (%d in all)"):format(#names) end
  return s
end

-- Phase A of a safetensors load (local, may fail): read this rank's part of every parameter
-- (and mask) into new tensors. Returns a plan {items = {{it =, data =, mask =}}, extra =,
-- retie = {{alias path, target item}}}.
local function stage_safetensors(model, path, opts, P, parts, masks, wrapped)
  local W, rank = fsdp.world_size(), fsdp.rank()
  local r = core.st_open(path)
  local entries = r:entries()
  local meta = r:metadata()
  local names, entry_of = {}, {}
  for i, e in ipairs(entries) do names[e.name] = true entry_of[e.name] = e e.index = i end
  local tied = {}
  for k, v in pairs(meta) do
    local alias = k:match("^fsdp%.tied%.(.+)$")
    if alias then tied[alias] = v end
  end
  local used, missing, plan = {}, {}, {items = {}, retie = {}}
  -- extra, and the tensors it names (read whole below: every rank returns all of extra)
  local extra_refs = {}
  if meta["fsdp.extra"] then
    plan.extra = core.json_decode(meta["fsdp.extra"], path .. ": fsdp.extra")
    for _, n in ipairs(extra_names(plan.extra)) do
      if not names[n] then
        fail(("%s: fsdp.extra names tensor '%s', which the file does not have"):format(path, n))
      end
      extra_refs[n] = true
      used[n] = true
    end
  end
  for _, it in ipairs(P.list) do
    local src = source_name(it, names, tied)
    if src == nil then
      missing[#missing + 1] = it.path
    else
      local e = entry_of[src]
      local shape = it.param:shape()
      if not same_shape(e.shape, shape) then
        fail(("%s: tensor '%s': shape %s in the file, %s in the model (parameter %s)")
          :format(path, src, shape_str(e.shape), shape_str(shape), it.path))
      end
      used[src] = true
      plan.items[#plan.items + 1] = {it = it, src = src}
      -- a tied parameter's other paths, stored separately (a file from an untied model): the
      -- first one found above is loaded, the others are accounted for (not "unexpected")
      for _, other in ipairs(it.aliases) do
        local oe = entry_of[other]
        if oe and other ~= src then
          if not same_shape(oe.shape, shape) then
            fail(("%s: tensor '%s': shape %s in the file, %s in the model (parameter %s)")
              :format(path, other, shape_str(oe.shape), shape_str(shape), it.path))
          end
          used[other] = true
        end
      end
    end
  end
  -- a model untied where the file is tied: plain models get the tie back
  if not wrapped then
    for alias, target in pairs(tied) do
      local a, t = P.by_path[alias], P.by_path[target]
      if a and t and a ~= t and a.path == alias and not names[alias] then
        plan.retie[#plan.retie + 1] = {alias = alias, target = t}
      end
    end
    table.sort(plan.retie, function(x, y) return x.alias < y.alias end)
  end
  local unexpected = {}
  for _, e in ipairs(entries) do
    local base_name = e.name:sub(-#MASK_SUFFIX) == MASK_SUFFIX and e.name:sub(1, -#MASK_SUFFIX - 1)
    if not used[e.name] and not (base_name and used[base_name] and masks) then
      unexpected[#unexpected + 1] = e.name
    end
  end
  local strict = opts.strict ~= false
  if strict and (#missing > 0 or #unexpected > 0) then
    local what = {}
    if #missing > 0 then
      what[#what + 1] = ("missing tensors (in the model, not in the file): %s"):format(list_names(missing))
    end
    if #unexpected > 0 then
      what[#what + 1] = ("unexpected tensors (in the file, not in the model): %s"):format(list_names(unexpected))
    end
    fail(("%s: %s (strict = false loads what matches)"):format(path, table.concat(what, "; ")))
  end
  -- read: this rank's range of each parameter; ranges that are not whole tensors are not
  -- checksummed by the read, so each such tensor is verified whole by one rank
  -- (tensor i by rank i % W)
  local whole = {}
  for _, x in ipairs(plan.items) do
    local e = entry_of[x.src]
    local part = parts[x.it.param]
    -- into a buffer of the model's dtype: the read converts (and says so when it cannot)
    if part.count == e.numel then
      x.data = r:read(x.src, 0, e.numel,
        fsdp.zeros({e.numel}, {dtype = part.dtype, device = part.device}))
      whole[x.src] = true
    elseif part.count > 0 then
      x.data = r:read(x.src, part.first, part.count,
        fsdp.zeros({part.count}, {dtype = part.dtype, device = part.device}))
    end
    local mname = x.src .. MASK_SUFFIX
    if masks and entry_of[mname] then
      if not same_shape(entry_of[mname].shape, e.shape) then
        fail(("%s: tensor '%s': shape %s, but its parameter's is %s")
          :format(path, mname, shape_str(entry_of[mname].shape), shape_str(e.shape)))
      end
      if part.count == e.numel then
        x.mask = r:read(mname, 0, e.numel, fsdp.zeros{e.numel})
        whole[mname] = true
      elseif part.count > 0 then
        x.mask = r:read(mname, part.first, part.count, fsdp.zeros{part.count})
      else
        x.mask = fsdp.zeros{0}
      end
    end
  end
  if next(extra_refs) then
    local got = {}
    for n in pairs(extra_refs) do -- its stored dtype; whole, so checksummed
      got[n] = r:read(n)
      whole[n] = true
    end
    plan.extra = join_extra(plan.extra, function(n) return got[n] end)
  end
  -- a tensor some rank read only in part is verified whole by one rank: tensor i of the file
  -- by rank (i - 1) % W, unless that rank read it whole (the read checked it). Only sharded
  -- units give partial reads, so plain models skip this.
  if wrapped then
    for _, e in ipairs(entries) do
      local owner = e.name:sub(-#MASK_SUFFIX) == MASK_SUFFIX and e.name:sub(1, -#MASK_SUFFIX - 1)
      local use = used[e.name] or (masks and owner and used[owner])
      if use and (e.index - 1) % W == rank and not whole[e.name] then r:verify(e.name) end
    end
  end
  r:close()
  return plan
end

-- ---- sharded: save ------------------------------------------------------------------------------------

local FILE_PATTERN = "^g(%d+)%-rank(%d+)%-of(%d+)%.safetensors$"
local function file_name(gen, r, W) return ("g%d-rank%d-of%d.safetensors"):format(gen, r, W) end

-- rank 0: the next generation number: above every generation in the folder (files and index)
local function next_generation(dir)
  local gen = 0
  local ok, idx = pcall(core.json_read, join(dir, INDEX))
  if ok and type(idx) == "table" and type(idx.generation) == "number" then gen = idx.generation end
  for _, name in ipairs(core.io_listdir(dir)) do
    local g = name:match(FILE_PATTERN)
    if g and tonumber(g) > gen then gen = tonumber(g) end
  end
  return gen + 1
end

-- This rank's optimizer state, keyed by parameter: {scalars =, tensors =, first =, count =}.
local function optimizer_state(opt, P)
  local out = {}
  for _, s in ipairs(opt:export_slices()) do
    if P.by_param[s.param] == nil then
      fail(("the optimizer updates a parameter (%s) that is not part of this model"):format(s.path))
    end
    out[s.param] = s
  end
  return out
end

local function save_sharded(model, dir, opts, loaders, wrapped, X)
  local W, rank = fsdp.world_size(), fsdp.rank()
  dir = strip_slashes(dir)
  local P = param_table(model)
  local masks = mask_api()
  local opt = opts.optimizer
  local parts, slices, ostate
  -- local preparation (nothing collective, nothing written); then agree
  local ok, err = pcall(quiet, function()
    parts = local_parts(P)
    slices = save_slices(P, parts)
    if opt then ostate = optimizer_state(opt, P) end
  end)
  local msg = disagreement(ok, err)
  if msg then raise("fsdp.save: " .. msg) end

  -- masks: this rank's slices (full masks, collective, when the adapter has no local access)
  local has_mask = {}
  if masks then
    for _, it in ipairs(P.list) do
      if masks.has(it.param) then has_mask[it.param] = true end
    end
  end

  -- the generation (rank 0 looks at the folder), broadcast
  local gen = 0
  ok, err = true, nil
  if rank == 0 then
    ok, err = pcall(function()
      core.io_mkdirs(dir)
      gen = next_generation(dir)
    end)
  end
  msg = disagreement(ok, err)
  if msg then raise("fsdp.save: " .. msg) end
  gen = core.broadcast(gen, 0, LABEL)

  -- every rank writes its file
  local my_name = file_name(gen, rank, W)
  local my_path = join(dir, my_name)
  local info = {}
  ok, err = pcall(quiet, function()
    local entries, writes, scalars, state_names = {}, {}, {}, {}
    for _, it in ipairs(P.list) do
      local p, part = it.param, parts[it.param]
      local mine
      for _, s in ipairs(slices[p]) do if s.rank == rank then mine = s end end
      if mine then
        local off = mine.first - part.first -- within this rank's part (0 unless replicated)
        entries[#entries + 1] = {name = it.path, shape = {mine.count}, dtype = part.dtype}
        writes[#writes + 1] = {it.path, part.view:narrow(1, off + 1, mine.count)}
        local st = ostate and ostate[p]
        if st then
          local soff = mine.first - st.first
          if soff < 0 or soff + mine.count > st.count then
            fail(("optimizer state of %s covers elements [%d, %d), not this rank's [%d, %d)")
              :format(it.path, st.first, st.first + st.count, mine.first, mine.first + mine.count))
          end
          for _, name in ipairs(sorted_keys(st.tensors)) do
            entries[#entries + 1] = {name = it.path .. ":" .. name, shape = {mine.count},
              dtype = st.tensors[name]:dtype()}
            writes[#writes + 1] = {it.path .. ":" .. name, st.tensors[name]:narrow(1, soff + 1, mine.count)}
            state_names[name] = true
          end
          scalars[it.path] = st.scalars
        end
        if has_mask[p] then
          local m = masks.local_slice(p)
          if m == nil or m:numel() ~= part.count then
            fail(("mask of %s: expected this rank's %d elements"):format(it.path, part.count))
          end
          entries[#entries + 1] = {name = it.path .. MASK_SUFFIX, shape = {mine.count},
            dtype = "F32"}
          writes[#writes + 1] = {it.path .. MASK_SUFFIX, m:view{part.count}:narrow(1, off + 1, mine.count)}
        end
      end
    end
    if rank == 0 then -- extra's tensors, whole, in rank 0's file
      for _, x in ipairs(X.tensors) do
        entries[#entries + 1] = {name = x.name, shape = x.tensor:shape(), dtype = x.tensor:dtype()}
        writes[#writes + 1] = {x.name, x.tensor}
      end
    end
    local meta = {
      ["fsdp.checkpoint"] = core.json_encode({rank = rank, world_size = W, generation = gen}),
      ["fsdp.optim"] = core.json_encode({params = scalars}),
    }
    local w = core.st_writer(my_path, entries, meta)
    local wok, werr = pcall(function()
      for _, wr in ipairs(writes) do w:write(wr[1], wr[2]) end
      w:commit()
    end)
    if not wok then
      w:abort()
      error(werr, 0)
    end
    local bytes = assert(core.io_size(my_path))
    local r = core.st_open(my_path)
    local hx = r:metadata()["fsdp.header.xxh3_64"]
    r:close()
    local names = sorted_keys(state_names)
    info = {name = my_name, bytes = bytes, header_xxh3 = hx, states = names}
  end)
  -- agreement before the index commit: every rank's outcome, file and random state
  local all = allgather({ok = ok, err = ok and "" or clean(err), file = info, rng = core.rng_state()})
  local failed
  for i, a in ipairs(all) do
    if not a.ok and failed == nil then failed = ("rank %d of %d: %s"):format(i - 1, W, a.err) end
  end
  if W == 1 and failed then failed = all[1].err end
  local function drop_mine() pcall(core.io_remove, my_path) end
  if failed then
    drop_mine()
    raise("fsdp.save: " .. failed)
  end

  -- rank 0 commits the index
  ok, err = true, nil
  if rank == 0 then
    ok, err = pcall(function()
      local files, rng, states = {}, {}, {}
      for i, a in ipairs(all) do
        files[i] = {rank = i - 1, name = a.file.name, bytes = a.file.bytes, header_xxh3 = a.file.header_xxh3}
        rng[i] = a.rng
        for _, n in ipairs(a.file.states or {}) do states[n] = true end
      end
      local params = {}
      for _, it in ipairs(P.list) do
        local e = {path = it.path, shape = it.param:shape(), numel = it.param:numel(),
          dtype = ST_DTYPE[parts[it.param].dtype], slices = slices[it.param]}
        if #it.aliases > 0 then e.aliases = it.aliases end
        if has_mask[it.param] then e.mask = true end
        params[#params + 1] = e
      end
      local index = {format = FORMAT_TAG, version = 1, generation = gen, world_size = W,
        step = opts.step or (opt and opt.step_count) or 0, files = files, params = params,
        rng = rng}
      if opt then
        index.optimizer = {kind = opt.kind, step = opt.step_count, lr = opt.lr, hyper = opt:hyper(),
          states = sorted_keys(states)}
      end
      if next(loaders) then
        index.loaders = {}
        for k, l in pairs(loaders) do index.loaders[k] = l.cursor end
      end
      if opts.schedule then index.schedule = opts.schedule:state_dict() end
      if X.json ~= nil then index.extra = X.json end
      if #X.tensors > 0 then
        index.extra_tensors = {}
        for i, x in ipairs(X.tensors) do
          index.extra_tensors[i] = {name = x.name, dtype = st_dtype(x.tensor),
            shape = x.tensor:shape()}
        end
      end
      if C._before_index then C._before_index() end -- tests arm a fault here
      core.ckpt_index_write(join(dir, INDEX), index)
    end)
  end
  msg = disagreement(ok, err)
  if msg then
    -- the new files go, unless the index on disk names them after all (the one failure after
    -- the rename: the fsync of the folder); rank 0 looks, everyone follows
    local committed = 0
    if rank == 0 then
      local rok, idx = pcall(core.json_read, join(dir, INDEX))
      if rok and type(idx) == "table" and idx.generation == gen then committed = 1 end
    end
    if core.broadcast(committed, 0, LABEL) == 0 then drop_mine() end
    raise("fsdp.save: " .. msg)
  end
  -- committed: rank 0 removes the files of other generations (best effort)
  if rank == 0 then
    pcall(function()
      local keep = {}
      for _, a in ipairs(all) do keep[a.file.name] = true end
      for _, name in ipairs(core.io_listdir(dir)) do
        if name:match(FILE_PATTERN) and not keep[name] then core.io_remove(join(dir, name)) end
      end
      core.io_fsync_dir(dir)
    end)
  end
end

-- ---- sharded: load -------------------------------------------------------------------------------------

-- Phase A of a sharded load (local, may fail): check the index against the model and the
-- options, read this rank's part of everything into new tensors. Returns the plan.
local function stage_sharded(model, dir, opts, loaders, P, parts, masks, wrapped)
  local W, rank = fsdp.world_size(), fsdp.rank()
  local ipath = join(dir, INDEX)
  if core.io_size(ipath) == nil and core.io_size(dir) == nil then
    local _, why = core.io_size(ipath)
    fail(("%s: neither a safetensors file nor a sharded checkpoint folder (%s)"):format(dir, why))
  end
  local index = core.ckpt_index_read(ipath)
  local strict = opts.strict ~= false
  local opt = opts.optimizer
  local plan = {items = {}, index = index}

  -- names and shapes
  local entry_of, own, used = {}, {}, {}
  for _, e in ipairs(index.params) do
    entry_of[e.path] = e
    own[e.path] = e
  end
  for _, e in ipairs(index.params) do
    for _, a in ipairs(e.aliases or {}) do entry_of[a] = entry_of[a] or e end
  end
  local function check_shape(e, it)
    if not same_shape(e.shape or {}, it.param:shape()) then
      fail(("%s: tensor '%s': shape %s in the checkpoint, %s in the model (parameter %s)")
        :format(ipath, e.path, shape_str(e.shape or {}), shape_str(it.param:shape()), it.path))
    end
  end
  local missing = {}
  for _, it in ipairs(P.list) do
    local e = entry_of[it.path]
    if e == nil then
      for _, a in ipairs(it.aliases) do e = e or entry_of[a] end
    end
    if e == nil then
      missing[#missing + 1] = it.path
    else
      check_shape(e, it)
      used[e.path] = true
      plan.items[#plan.items + 1] = {it = it, e = e}
      -- a tied parameter's other paths saved separately (from an untied model): accounted for
      for _, a in ipairs(it.aliases) do
        if own[a] and own[a] ~= e then
          check_shape(own[a], it)
          used[a] = true
        end
      end
    end
  end
  -- a plain model untied where the checkpoint is tied gets the tie back
  plan.retie = {}
  if not wrapped then
    for _, e in ipairs(index.params) do
      for _, a in ipairs(e.aliases or {}) do
        local ai, ti = P.by_path[a], P.by_path[e.path]
        if ai and ti and ai ~= ti and ai.path == a and own[a] == nil then
          plan.retie[#plan.retie + 1] = {alias = a, target = ti}
        end
      end
    end
  end
  local unexpected = {}
  for _, e in ipairs(index.params) do
    if not used[e.path] then unexpected[#unexpected + 1] = e.path end
  end
  if strict and (#missing > 0 or #unexpected > 0) then
    local what = {}
    if #missing > 0 then
      what[#what + 1] = ("missing tensors (in the model, not in the checkpoint): %s"):format(list_names(missing))
    end
    if #unexpected > 0 then
      what[#what + 1] = ("unexpected tensors (in the checkpoint, not in the model): %s"):format(list_names(unexpected))
    end
    fail(("%s: %s (strict = false loads what matches)"):format(ipath, table.concat(what, "; ")))
  end

  -- optimizer, loaders, random state: can this checkpoint serve them?
  if opt then
    if index.optimizer == nil then
      fail(("%s: the checkpoint holds no optimizer state (saved without optimizer =)"):format(ipath))
    end
    if index.optimizer.kind ~= opt.kind then
      fail(("%s: the checkpoint holds %s state, the optimizer is %s"):format(ipath, index.optimizer.kind, opt.kind))
    end
  end
  for name in pairs(loaders) do
    if index.loaders == nil or index.loaders[name] == nil then
      fail(("%s: no position saved for data loader '%s'"):format(ipath, name))
    end
  end
  if opts.rng ~= false and index.rng then
    if index.world_size == W then
      plan.rng = index.rng[rank + 1]
    else
      local a = core.json_encode(index.rng[1])
      for i = 2, #index.rng do
        if core.json_encode(index.rng[i]) ~= a then
          fail(("%s: saved at %d ranks with a different random state on each; a world size of %d "
            .. "cannot take them over (load at %d ranks, or pass rng = false)")
            :format(ipath, index.world_size, W, index.world_size))
        end
      end
      plan.rng = index.rng[1]
    end
  end

  -- the files this rank needs: open each once, check it is the one the index names
  local readers, scalars_of = {}, {}
  local function reader(r, needed_for)
    if readers[r] then return readers[r] end
    local f = index.files[r + 1]
    local fpath = join(dir, f.name)
    local size, serr = core.io_size(fpath)
    if size == nil then
      fail(("%s names %s (rank %d's file, holding tensor '%s' among others), which cannot be "
        .. "read: %s"):format(ipath, f.name, r, needed_for or "?", serr))
    end
    local okr, rd = pcall(core.st_open, fpath)
    if not okr then fail(("%s (needed for tensor '%s')"):format(clean(rd), needed_for or "?")) end
    local meta = rd:metadata()
    if size ~= f.bytes or meta["fsdp.header.xxh3_64"] ~= f.header_xxh3 then
      fail(("%s: %d bytes, header checksum %s; the index (%s) expects %d bytes, %s: this file is "
        .. "not the one the index was written with"):format(fpath, size, tostring(meta["fsdp.header.xxh3_64"]),
        ipath, f.bytes, f.header_xxh3))
    end
    local ck = meta["fsdp.checkpoint"] and core.json_decode(meta["fsdp.checkpoint"], fpath .. ": fsdp.checkpoint")
    if type(ck) ~= "table" or ck.rank ~= r or ck.world_size ~= index.world_size or ck.generation ~= index.generation then
      fail(("%s: not rank %d's file of generation %d of this checkpoint"):format(fpath, r, index.generation))
    end
    local oj = meta["fsdp.optim"] and core.json_decode(meta["fsdp.optim"], fpath .. ": fsdp.optim")
    scalars_of[r] = (type(oj) == "table" and oj.params) or {}
    local ents = {}
    for _, e in ipairs(rd:entries()) do ents[e.name] = e end
    readers[r] = {r = rd, path = fpath, entries = ents, verified = {}}
    return readers[r]
  end

  -- read `name` of the parts into a tensor of count elements; a part that is not a whole
  -- stored tensor is read as a range and its tensor verified whole (checksums cover tensors)
  -- read `name` of the pieces into a new 1-D tensor of count elements (filed under `role` in
  -- the memory accounting: optimizer state is read straight into the buffers the optimizer
  -- then adopts); a piece that is not a whole stored tensor is read as a range and its tensor
  -- verified whole (checksums cover whole tensors); a whole one is checked by the read itself
  local function gather_parts(pieces, name, count, optional, role, like)
    if optional then
      local found = 0
      for _, pc in ipairs(pieces) do
        if reader(pc.rank, name).entries[name] then found = found + 1 end
      end
      if found == 0 then return nil end
    end
    local out = fsdp.zeros({count}, {role = role or "other", dtype = like and like.dtype or "f32",
      device = like and like.device})
    for _, pc in ipairs(pieces) do
      local R = reader(pc.rank, name)
      local e = R.entries[name]
      if e == nil then
        fail(("%s: tensor '%s' is missing (the index says this file holds elements [%d, %d) of %s)")
          :format(R.path, name, pc.s.first, pc.s.first + pc.s.count, name:match("^[^:]*")))
      end
      if #e.shape ~= 1 or e.shape[1] ~= pc.s.count then
        fail(("%s: tensor '%s': shape %s, the index says (%d)"):format(R.path, name, shape_str(e.shape), pc.s.count))
      end
      R.r:read(name, pc.src_off, pc.n, out:narrow(1, pc.dst_off + 1, pc.n))
      if pc.n ~= pc.s.count and not R.verified[name] then
        R.r:verify(name)
        R.verified[name] = true
      end
    end
    return out
  end

  local states = index.optimizer and index.optimizer.states or {}
  -- optimizer state is read into buffers like the optimizer's own (f32 on the parameter's
  -- device when it has none yet): the buffers read become its state
  local current = {}
  if opt then
    for _, sl in ipairs(opt:export_slices()) do current[sl.param] = sl.tensors end
  end
  local function state_like(p, sname, part)
    local t = current[p] and current[p][sname]
    if t then return {dtype = t:dtype(), device = t.device} end
    return {dtype = "f32", device = part.device}
  end
  for _, x in ipairs(plan.items) do
    local part = parts[x.it.param]
    local a, n = part.first, part.count
    local pieces = {}
    if n > 0 then
      for _, s in ipairs(x.e.slices) do
        local lo, hi = math.max(a, s.first), math.min(a + n, s.first + s.count)
        if lo < hi then
          pieces[#pieces + 1] = {rank = s.rank, s = s, src_off = lo - s.first, dst_off = lo - a, n = hi - lo}
        end
      end
      x.data = gather_parts(pieces, x.e.path, n, false, nil, part)
      if masks and x.e.mask then x.mask = gather_parts(pieces, x.e.path .. MASK_SUFFIX, n) end
      if opt then
        -- state: present in every piece's file, or in none
        local present = 0
        for _, pc in ipairs(pieces) do
          reader(pc.rank, x.e.path)
          if scalars_of[pc.rank][x.e.path] ~= nil then present = present + 1 end
        end
        if present ~= 0 and present ~= #pieces then
          fail(("%s: optimizer state of %s is saved for some of its slices only"):format(ipath, x.e.path))
        end
        if present > 0 then
          local st = {param = x.it.param, first = a, count = n, tensors = {},
            scalars = scalars_of[pieces[1].rank][x.e.path] or {}}
          for _, sname in ipairs(states) do
            st.tensors[sname] = gather_parts(pieces, x.e.path .. ":" .. sname, n, true, "optim",
              state_like(x.it.param, sname, part))
          end
          x.optim = st
        end
      end
    elseif masks and x.e.mask then
      x.mask = fsdp.zeros{0}
    end
  end
  -- extra's tensors: whole, from rank 0's file, in their stored dtype
  if index.extra ~= nil then
    local listed = {}
    for _, xt in ipairs(index.extra_tensors or {}) do listed[xt.name] = xt end
    local got = {}
    for _, n in ipairs(extra_names(index.extra)) do
      local xt = listed[n]
      if xt == nil then
        fail(("%s: extra names tensor '%s', which extra_tensors does not list"):format(ipath, n))
      end
      local R = reader(0, n)
      local e = R.entries[n]
      if e == nil or e.dtype ~= xt.dtype or not same_shape(e.shape, xt.shape or {}) then
        fail(("%s: tensor '%s' is missing or is not the %s %s the index lists"):format(R.path, n,
          xt.dtype, shape_str(xt.shape or {})))
      end
      got[n] = R.r:read(n)
    end
    plan.extra = join_extra(index.extra, function(n) return got[n] end)
  end
  for _, R in pairs(readers) do R.r:close() end
  return plan
end

-- ---- phase B: apply a staged plan (after every rank agreed) -------------------------------------------

local function apply_plan(model, plan, opts, loaders, P, parts, masks, wrapped)
  if wrapped then reshard_all(model) end
  local loaded = {}
  quiet(function()
    for _, x in ipairs(plan.items) do
      local p, part = x.it.param, parts[x.it.param]
      if part.meta and x.data then
        -- a plain parameter built on meta (fsdp.meta): dense storage now, in place
        core.param_materialize(p)
        part.view = p:detach():view{p:numel()}
      end
      if x.data and part.count > 0 then part.view:copy(x.data:view{part.count}) end
      loaded[#loaded + 1] = p
    end
  end)
  if wrapped then
    -- a model wrapped on meta: the loaded parameters stop being pending (lua/fsdp/meta.lua)
    local okm, meta = pcall(require, "fsdp.meta")
    if okm and type(meta) == "table" and meta.mark_loaded then meta.mark_loaded(model, loaded) end
  end
  -- re-tie (plain models whose file says two paths are one parameter)
  for _, t in ipairs(plan.retie or {}) do
    local owner, name = model, nil
    local comps = {}
    for c in t.alias:gmatch("[^.]+") do comps[#comps + 1] = c end
    for i = 1, #comps - 1 do
      local key = tonumber(comps[i]) or comps[i]
      owner = owner[key]
    end
    name = tonumber(comps[#comps]) or comps[#comps]
    owner[name] = t.target.param
  end
  if masks then
    local set = {}
    local any = false
    for _, x in ipairs(plan.items) do
      if x.mask then set[x.it.param] = x.mask any = true end
    end
    if any then masks.set_local(model, set) end
  end
  if opts.optimizer and plan.index then
    local list = {}
    for _, x in ipairs(plan.items) do
      if x.optim then
        local tensors = {}
        for k, t in pairs(x.optim.tensors) do tensors[k] = t end
        list[#list + 1] = {param = x.it.param, first = x.optim.first, count = x.optim.count,
          scalars = x.optim.scalars, tensors = tensors}
      end
    end
    local o = plan.index.optimizer
    -- the staged buffers are new and ours: the optimizer adopts them (no second copy)
    opts.optimizer:import_slices(list, {step = o.step, lr = o.lr, hyper = o.hyper, adopt = true})
  end
  if plan.index then
    for name, l in pairs(loaders) do l.cursor = plan.index.loaders[name] end
    if opts.schedule and plan.index.schedule then opts.schedule:load_state_dict(plan.index.schedule) end
  end
  if plan.rng then core.set_rng_state(plan.rng) end
end

-- ---- the API ------------------------------------------------------------------------------------------

local function resolve_format(fn, path, opts)
  if opts.format ~= nil and opts.format ~= "safetensors" and opts.format ~= "sharded" then
    raise(("%s: format must be \"safetensors\" or \"sharded\" (got %s)"):format(fn, tostring(opts.format)))
  end
  return opts.format
end

--- Collective. Save model (and optionally optimizer state, loader positions, a schedule, extra)
--- to path. format: "safetensors" (one file, rank 0 writes) or "sharded" (a folder); default:
--- "safetensors" when path ends in .safetensors, else "sharded".
function C.save(model, path, opts)
  local wrapped = check_model("fsdp.save", model)
  local R = rawget(model, "__fsdp_wrap")
  if wrapped and R.pending and next(R.pending) then
    raise("fsdp.save: the model was wrapped on the meta device and some parameters have no "
      .. "values yet (fsdp.materialize or fsdp.load it first)")
  end
  if type(path) ~= "string" or path == "" then raise("fsdp.save: path must be a non-empty string") end
  local loaders
  opts, loaders = check_opts("fsdp.save", opts, SAVE_OPTS)
  local format = resolve_format("fsdp.save", path, opts)
    or (path:match("%.safetensors$") and "safetensors" or "sharded")
  if opts.step ~= nil and (type(opts.step) ~= "number" or opts.step < 0 or opts.step ~= math.floor(opts.step)) then
    raise("fsdp.save: step must be an integer >= 0")
  end
  if opts.optimizer and opts.optimizer.wrapped and opts.optimizer.wrapped.model ~= model then
    raise("fsdp.save: the optimizer was made for another model")
  end
  local X = {tensors = {}} -- extra: its JSON (tensors as tags) and its tensors
  if opts.extra ~= nil then
    local ok, err = pcall(function() X.json, X.tensors = split_extra(opts.extra) end)
    if ok then
      ok, err = pcall(core.json_encode, X.json)
      X.text = ok and err or nil
    end
    if not ok then
      local why = tostring(err):gsub("^json_write: ", "")
      raise("fsdp.save: extra must be JSON-able values and tensors (" .. why .. ")")
    end
  end
  if format == "safetensors" then
    if next(loaders) or opts.schedule then
      raise("fsdp.save: a safetensors file holds the model only; save loaders and schedules with format = \"sharded\"")
    end
    return save_safetensors(model, path, opts, wrapped, X)
  end
  return save_sharded(model, path, opts, loaders, wrapped, X)
end

--- Collective. Load path (a safetensors file or a sharded checkpoint folder) into model (and
--- optimizer, loaders, schedule, random state). Nothing changes unless every rank could read
--- and check everything it needs. Returns extra (or {}) and {format =, step =, world_size =}.
function C.load(model, path, opts)
  local wrapped = check_model("fsdp.load", model)
  if type(path) ~= "string" or path == "" then raise("fsdp.load: path must be a non-empty string") end
  local loaders
  opts, loaders = check_opts("fsdp.load", opts, LOAD_OPTS)
  if opts.strict ~= nil and type(opts.strict) ~= "boolean" then raise("fsdp.load: strict must be a boolean") end
  if opts.optimizer and opts.optimizer.wrapped and opts.optimizer.wrapped.model ~= model then
    raise("fsdp.load: the optimizer was made for another model")
  end
  local format = resolve_format("fsdp.load", path, opts)
  if format == nil then
    -- a regular file is a safetensors file; a folder a sharded checkpoint
    format = core.io_size(path) and "safetensors" or "sharded"
  end
  if format == "safetensors" and (opts.optimizer or next(loaders) or opts.schedule) then
    raise("fsdp.load: a safetensors file holds the model only (optimizer, loaders and schedules "
      .. "come from sharded checkpoints)")
  end
  local P = param_table(model)
  local masks = mask_api()
  local parts, plan
  local ok, err = pcall(quiet, function()
    parts = local_parts(P, true)
    if format == "safetensors" then
      plan = stage_safetensors(model, path, opts, P, parts, masks, wrapped)
    else
      plan = stage_sharded(model, strip_slashes(path), opts, loaders, P, parts, masks, wrapped)
    end
  end)
  local msg = disagreement(ok, err)
  if msg then raise("fsdp.load: " .. msg) end
  apply_plan(model, plan, opts, loaders, P, parts, masks, wrapped)
  local info = {format = format}
  if plan.index then
    info.step, info.world_size, info.generation = plan.index.step, plan.index.world_size, plan.index.generation
  end
  return plan.extra or {}, info
end

-- fsdp.save / fsdp.load (init.lua loads this file for them; set here too so that requiring
-- fsdp.checkpoint is enough)
rawset(fsdp, "save", C.save)
rawset(fsdp, "load", C.load)

return C
