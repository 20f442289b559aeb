-- fsdp.load_tensors — tensors by name into a model, plain or wrapped, from every rank or from
-- rank 0 only. docs/init.md ("Loading tensors by name") is the manual; require("fsdp.meta")
-- gives the same two functions.
--
--   M.load_tensors(model, source, {strict = true}) -> {loaded =, missing =, unexpected =}
--   M.mark_loaded(model, params)    for loaders that write shards themselves (fsdp.load)
--
-- A source is a plain table {name = tensor} or a safetensors reader (fsdp.core.st_open: has
-- entries() and read(name[, first, count])).
--
-- A tied parameter (one object under several paths, lua/fsdp/ties.lua) is filled once, from
-- the first of its paths the source holds. A source holding two of its names must hold the
-- same values under both: two different tensors for one parameter are an error naming them
-- (one of them would be dropped without a word otherwise).

local core = require "fsdp.core"
local collective = require "fsdp.collective"
local state = require "fsdp.state"
local ties = require "fsdp.ties"
local util = require "fsdp.util"

local raise, is_module = util.raise, util.is_module

local M = {}

-- The source adapted to {names, shape(name), get(name), get_slice(name, first, count) or nil}.
-- A table with an entries method is a reader (fsdp.hf's view of a Hugging Face file).
local function as_source(x)
  if type(x) == "table" and type(rawget(x, "entries")) ~= "function" then
    local names = {}
    for k, v in pairs(x) do
      if type(k) ~= "string" or not util.is_tensor(v) then
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

-- The plan: for each distinct parameter (order), the source name to read, or nil; plus the
-- names the source has that match no path. Errors (strict) for missing and unexpected names,
-- any shape mismatch, and tied copies that differ.
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
      local want = util.shape_str(p)
      for _, n in ipairs{chosen, unpack(copies)} do
        local got = util.shape_str(src.shape(n))
        if got ~= want then
          problems[#problems + 1] = ("%s has shape %s in the source, the model's is %s")
            :format(n, got, want)
        end
      end
      plan[p] = {name = chosen, copies = copies, first = paths[p][1]}
    end
  end
  if #problems > 0 then return nil, "fsdp.load: " .. table.concat(problems, "; ") end
  for _, p in ipairs(order) do
    local e = plan[p]
    if e and #e.copies > 0 then
      local a = src.get(e.name)
      for _, c in ipairs(e.copies) do
        local msg = ties.conflict(a, src.get(c), e.name, c, e.first)
        if msg then return nil, "fsdp.load: " .. msg end
      end
    end
  end
  local unexpected, masks = {}, {}
  for _, n in ipairs(src.names) do
    if not used[n] then
      -- fsdp.save stores a pruned parameter's mask as "<path>:mask": not a parameter, and not
      -- restored here (fsdp.load restores masks)
      if n:sub(-5) == ":mask" then masks[#masks + 1] = n else unexpected[#unexpected + 1] = n end
    end
  end
  if #masks > 0 and strict then
    return nil, ("fsdp.load_tensors: the source holds pruning masks (%s), which loading tensors "
      .. "by name does not restore: load the file with fsdp.load, which does, or pass strict = "
      .. "false to load the weights without them"):format(util.few(masks))
  end
  if #masks > 0 then
    util.note(("fsdp.load_tensors: the masks in the source were not loaded (%s): the weights are "
      .. "as pruned, but the zeros are not held from now on (fsdp.load restores masks)")
      :format(util.few(masks)))
  end
  if strict and #missing > 0 then
    return nil, ("fsdp.load: the source has no tensor for %s (strict; pass strict = false to "
      .. "load the rest)"):format(util.few(missing))
  end
  if strict and #unexpected > 0 then
    return nil, ("fsdp.load: the source holds tensors the model has no parameter for: %s "
      .. "(strict; pass strict = false to ignore them)"):format(util.few(unexpected))
  end
  return {plan = plan, missing = missing, unexpected = unexpected}
end

-- Plain model (local): meta parameters get storage; values copied in.
local function load_plain(order, paths, source, strict)
  local src = as_source(source)
  local pl, err = plan_load(order, paths, src, strict)
  if not pl then error(err, 0) end
  local n = 0
  for _, p in ipairs(order) do
    local e = pl.plan[p]
    if e then
      if p.device == "meta" then core.param_materialize(p) end
      local t = src.get(e.name)
      util.no_grad(function() p:copy(t:contiguous():view(p:shape())) end)
      n = n + 1
    end
  end
  return {loaded = n, missing = pl.missing, unexpected = pl.unexpected}
end

-- Copy the source's values of every parameter `send` marks into this rank's shard slices.
-- mode "root": rank 0 broadcasts each parameter in turn; "every": each rank reads its own.
local function load_wrapped(R, order, pl, send, mode)
  local W, rank = core.world_size(), core.rank()
  local loaded = {}
  for _, u in ipairs(R:units()) do
    u:reshard()
    local params, upaths = u:params(), u:paths()
    local slices = {}
    for _, s in ipairs(u:local_slices()) do slices[s.index] = s end
    local shard
    for i, p in ipairs(params) do
      if send[p] then
        loaded[#loaded + 1] = p
        local s = slices[i]
        if mode == "root" then
          -- in the shard's dtype on every rank (a source may hold another: a bf16 file)
          local buf, dt = nil, u:shard():dtype()
          if rank == 0 then
            buf = pl.src.get(pl.plan[p].name):contiguous():view{p:numel()}:to(dt)
          else
            buf = core.zeros({p:numel()}, {dtype = dt})
          end
          if W > 1 then core.broadcast(buf, 0, upaths[i]) end
          if s then
            shard = shard or u:shard()
            local len = s.shard_last - s.shard_first + 1
            local part = buf:narrow(1, s.param_first, len)
            shard:narrow(1, s.shard_first, len):copy(part)
            if rank ~= 0 then part:free() end
          end
          -- at most one parameter in flight: do not wait for the collector (rank 0's buf
          -- views the caller's tensor and goes with it)
          if rank ~= 0 then buf:free() end
        elseif s then
          shard = shard or u:shard()
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
      end
    end
  end
  return loaded
end

--- load_tensors(model, source, {strict = true}) -> {loaded =, missing = {...}, unexpected =
--- {...}}. A tied parameter is filled once, from the first of its paths the source holds (all
--- its paths then see it: one object); a source holding several of its names with different
--- values is an error naming them.
---   plain model (local): meta parameters get storage; values copied in.
---   wrapped root (collective): source on every rank — each rank copies its own slices (a
---   reader reads only them); source on rank 0 only (nil elsewhere) — rank 0 broadcasts each
---   parameter in turn and every rank keeps its slice: no rank ever holds more than one full
---   parameter beyond its shards. Loaded parameters stop being pending (see fsdp.materialize).
function M.load_tensors(model, source, opts)
  opts = util.check_opts("fsdp.load", opts, {"strict"})
  local strict = opts.strict ~= false
  if not is_module(model) then
    raise(("fsdp.load: expected a module (got %s)"):format(type(model)))
  end
  local order, paths = ties.all_paths(model)
  local R = state.of(model)
  if R ~= nil and R:model() ~= model then
    raise(("fsdp.load: this %s is part of a wrapped model; load into its root"):format(model:type_name()))
  end
  if R == nil then
    if source == nil then raise("fsdp.load: no source (a table of tensors by name or a reader)") end
    local ok, res = pcall(load_plain, order, paths, source, strict)
    if not ok then util.reraise(res) end
    return res
  end
  -- wrapped: collective
  R:check_idle("fsdp.load")
  local W, rank = core.world_size(), core.rank()
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
  local msg = collective.check_lists("fsdp.load", {}, local_err)
  if msg then util.reraise(msg) end
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
  local ok, res = pcall(load_wrapped, R, order, pl, send, mode)
  if not ok then util.reraise(res) end
  R:given_values(res)
  local out = {loaded = #res}
  if pl then out.missing, out.unexpected = pl.missing, pl.unexpected end
  return out
end

--- mark_loaded(model, params): for loaders that write shards themselves (fsdp.load): the
--- given parameters of a wrapped model (meta at wrap time) now hold values, so they stop
--- being pending (a forward is refused while any is). Plain models need nothing (a meta
--- parameter gets storage with fsdp.core.param_materialize(p) before it is written).
function M.mark_loaded(model, params)
  local R = state.root(model)
  if R ~= nil then R:given_values(params) end
end

return M
