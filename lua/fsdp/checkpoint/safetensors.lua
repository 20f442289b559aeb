-- fsdp.checkpoint.safetensors — one standard safetensors file of the full model
-- (docs/checkpoints.md, "How saving works", "How loading works").
--
--   S.save(model, path, opts, R, X)     collective: rank 0 writes, one unit gathered at a time
--   S.stage(path, opts, P, parts, R)    local: this rank's part of everything, read and checked
--
-- Saving: memory is the largest unit plus the writer's buffer. A tied parameter is stored
-- once (its other paths in __metadata__ "fsdp.tied.<alias>"), masks as tensors "<path>:mask".
-- Loading reads on every rank only its shard's ranges; a tensor some rank read in part is
-- verified whole by one rank.

local core = require "fsdp.core"
local mask = require "fsdp.mask"
local C = require "fsdp.checkpoint.common"
local util = require "fsdp.util"

local S = {}

local MASK_SUFFIX, fail, shape_str = C.MASK_SUFFIX, C.fail, util.shape_str

--- Collective. Save model (R: its Root, false when plain) to the file at path; X: extra's
--- JSON text and tensors.
function S.save(model, path, opts, R, X)
  local rank = core.rank()
  local P = C.param_table(model)
  if opts.optimizer then
    util.raise("fsdp.save: a safetensors file holds the model only; save optimizer state with "
      .. "format = \"sharded\"")
  end
  -- tensors in the order they will be written: unit by unit when wrapped
  local groups = {} -- {{unit = u or nil, items = {it...}}}
  if R then
    for _, u in ipairs(R:forward_units()) do
      local items = {}
      for _, p in ipairs(u:params()) do items[#items + 1] = P.by_param[p] end
      groups[#groups + 1] = {unit = u, items = items}
    end
  else
    for _, it in ipairs(P.list) do
      if C.NO_DATA[it.param.device] then
        util.raise(("fsdp.save: parameter %s is on the %s device: materialize the model first")
          :format(it.path, it.param.device))
      end
    end
    groups[1] = {items = P.list}
  end
  local entries, meta = {}, {}
  local has_mask = {}
  for _, g in ipairs(groups) do
    -- each parameter in its own dtype; a wrapped model's in its shards' (the f32 masters)
    local dtype = g.unit and C.st_dtype(g.unit:shard())
    for _, it in ipairs(g.items) do
      entries[#entries + 1] = {name = it.path, shape = it.param:shape(),
        dtype = dtype or C.st_dtype(it.param)}
      if mask.has(it.param) then
        has_mask[it.param] = true
        entries[#entries + 1] = {name = it.path .. MASK_SUFFIX, shape = it.param:shape(),
          dtype = "F32"}
      end
      for _, a in ipairs(it.aliases) do meta["fsdp.tied." .. a] = it.path end
    end
  end
  for _, x in ipairs(X.tensors) do
    entries[#entries + 1] = {name = x.name, shape = x.tensor:shape(), dtype = C.st_dtype(x.tensor)}
  end
  meta["fsdp.format"] = "fsdprun.safetensors"
  meta["fsdp.version"] = "1"
  if X.text then meta["fsdp.extra"] = X.text end
  if X.config then meta["fsdp.config"] = core.json_encode(X.config) end
  if opts.step ~= nil then meta["fsdp.step"] = tostring(opts.step) end

  -- rank 0 opens the writer; every rank learns whether it could
  local w
  local ok, err = true, nil
  if rank == 0 then
    ok, err = pcall(function()
      core.io_mkdirs(C.parent_dir(path))
      w = core.st_writer(path, entries, meta)
    end)
  end
  local msg = C.agree(ok, err)
  if msg then util.raise("fsdp.save: " .. msg) end

  -- one unit at a time: gather (collective), rank 0 writes, reshard
  for _, g in ipairs(groups) do
    local u = g.unit
    local was_sharded = u and u:state() == "sharded"
    if u then u:gather() end
    local full_masks = {}
    for _, it in ipairs(g.items) do
      if has_mask[it.param] then full_masks[it.param] = mask.mask(it.param) end -- collective
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
    msg = C.agree(ok, err)
    if msg then
      if w then w:abort() end
      util.raise("fsdp.save: " .. msg)
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
  msg = C.agree(ok, err)
  if msg then util.raise("fsdp.save: " .. msg) end
end

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

--- Phase A of a safetensors load (local, may fail): read this rank's part of every parameter
--- (and mask) into new tensors. Returns a plan {items = {{it =, data =, mask =}}, extra =,
--- retie = {{alias =, target = item}}}.
function S.stage(path, opts, P, parts, R)
  local W, rank = core.world_size(), core.rank()
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
    for _, n in ipairs(C.extra_names(plan.extra)) do
      if not names[n] then
        fail(("%s: fsdp.extra names tensor '%s', which the file does not have"):format(path, n))
      end
      extra_refs[n] = true
      used[n] = true
    end
  end
  local function check_shape(name, e, it)
    if not C.same_shape(e.shape, it.param:shape()) then
      fail(("%s: tensor '%s': shape %s in the file, %s in the model (parameter %s)")
        :format(path, name, shape_str(e.shape), shape_str(it.param:shape()), it.path))
    end
  end
  for _, it in ipairs(P.list) do
    local src = source_name(it, names, tied)
    if src == nil then
      missing[#missing + 1] = it.path
    else
      check_shape(src, entry_of[src], it)
      used[src] = true
      local x = {it = it, src = src, copies = {}}
      plan.items[#plan.items + 1] = x
      -- a tied parameter's other paths, stored separately (a file from an untied model): the
      -- first one found above is loaded, the others must hold the same values
      for _, other in ipairs(it.aliases) do
        local oe = entry_of[other]
        if oe and other ~= src then
          check_shape(other, oe, it)
          used[other] = true
          x.copies[#x.copies + 1] = other
        end
      end
    end
  end
  -- a model untied where the file is tied: plain models get the tie back
  if not R then
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
    if not used[e.name] and not (base_name and used[base_name]) then
      unexpected[#unexpected + 1] = e.name
    end
  end
  if opts.strict ~= false then
    local problems = C.strict_problems(missing, unexpected, "file")
    if problems then fail(("%s: %s"):format(path, problems)) end
  end
  -- read: this rank's range of each parameter; ranges that are not whole tensors are not
  -- checksummed by the read, so each such tensor is verified whole by one rank
  -- (tensor i by rank i % W)
  local whole = {}
  local function read_part(name, part, numel)
    -- into a buffer of the model's dtype: the read converts (and says so when it cannot)
    if part.count == numel then
      whole[name] = true
      return r:read(name, 0, numel, C.part_buffer(part, numel))
    elseif part.count > 0 then
      return r:read(name, part.first, part.count, C.part_buffer(part))
    end
  end
  for _, x in ipairs(plan.items) do
    local e = entry_of[x.src]
    local part = parts[x.it.param]
    x.data = read_part(x.src, part, e.numel)
    for _, other in ipairs(x.copies) do
      local copy = read_part(other, part, e.numel)
      if copy then
        C.check_tied_copy(path, x.it, x.src, x.data, other, copy)
        copy:free()
      end
    end
    local mname = x.src .. MASK_SUFFIX
    if entry_of[mname] then
      if not C.same_shape(entry_of[mname].shape, e.shape) then
        fail(("%s: tensor '%s': shape %s, but its parameter's is %s")
          :format(path, mname, shape_str(entry_of[mname].shape), shape_str(e.shape)))
      end
      if part.count == e.numel then
        x.mask = r:read(mname, 0, e.numel, core.zeros{e.numel})
        whole[mname] = true
      elseif part.count > 0 then
        x.mask = r:read(mname, part.first, part.count, core.zeros{part.count})
      else
        x.mask = core.zeros{0}
      end
    end
  end
  if next(extra_refs) then
    local got = {}
    for n in pairs(extra_refs) do -- its stored dtype; whole, so checksummed
      got[n] = r:read(n)
      whole[n] = true
    end
    plan.extra = C.join_extra(plan.extra, function(n) return got[n] end)
  end
  -- a tensor some rank read only in part is verified whole by one rank: tensor i of the file
  -- by rank (i - 1) % W, unless that rank read it whole (the read checked it). Only sharded
  -- units give partial reads, so plain models skip this.
  if R then
    for _, e in ipairs(entries) do
      local owner = e.name:sub(-#MASK_SUFFIX) == MASK_SUFFIX and e.name:sub(1, -#MASK_SUFFIX - 1)
      local use = used[e.name] or (owner and used[owner])
      if use and (e.index - 1) % W == rank and not whole[e.name] then r:verify(e.name) end
    end
  end
  r:close()
  return plan
end

return S
