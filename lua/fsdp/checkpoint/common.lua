-- fsdp.checkpoint.common — what both checkpoint formats share (docs/checkpoints.md): the
-- model's parameters with every path, this rank's part of each, tensors in extra, the check
-- that two stored copies of a tied parameter agree, and the agreement between ranks.
--
-- Collective safety (the rule every checkpoint function follows): whatever can fail on one
-- rank alone (file system, damaged files, a check) runs inside pcall, and the ranks then
-- agree (C.agree) before anything irreversible: before the index commit when saving, before
-- the model is touched when loading. If any rank failed, every rank raises the same message
-- (the lowest failing rank's, broadcast), so nobody hangs in a collective the others left.
-- Collectives themselves (gathers, the agreement) are issued in an order that depends only on
-- the model and the options, never on a rank's local success.

local core = require "fsdp.core"
local collective = require "fsdp.collective"
local ties = require "fsdp.ties"
local util = require "fsdp.util"

local C = {}

C.LABEL = "checkpoint"    -- collective label (flight recorder, mismatch messages)
C.MASK_SUFFIX = ":mask"   -- a parameter's mask is stored as "<path>:mask"

-- The format's name of a tensor dtype ("bf16" -> "BF16").
C.ST_DTYPE = {f32 = "F32", bf16 = "BF16", f16 = "F16", f64 = "F64", i64 = "I64", i32 = "I32",
  u8 = "U8", bool = "BOOL"}
function C.st_dtype(t) return C.ST_DTYPE[t:dtype()] end

-- Devices whose tensors hold no values (a model built on meta, a sharded parameter). Any other
-- device is fine: tensors that are not in host memory are saved and loaded through a bounded
-- host buffer (src/io/st_tensor.c), and loads stage on the target's device.
C.NO_DATA = {meta = true, sharded = true}

--- Inside pcall'd phases: a message without a position (util.strip drops the library's).
function C.fail(msg) error(msg, 0) end

function C.same_shape(a, b) return util.shape_str(a) == util.shape_str(b) end

-- ---- files ------------------------------------------------------------------------------------

function C.path_join(dir, name)
  if dir:sub(-1) == "/" then return dir .. name end
  return dir .. "/" .. name
end

function C.strip_slashes(path)
  local p = path:gsub("/+$", "")
  if p == "" then return "/" end
  return p
end

function C.parent_dir(path)
  local d = path:match("^(.*)/[^/]*$")
  if d == nil then return "." end
  if d == "" then return "/" end
  return d
end

-- ---- agreement between ranks -------------------------------------------------------------------

--- Collective. nil when every rank passed ok; otherwise the same message on every rank (the
--- lowest failing rank's, marked with its rank when there are several ranks).
function C.agree(ok, err) return collective.check_outcome(ok, err, C.LABEL) end

--- Every rank's value (collective.lua: tables, strings, numbers, booleans).
function C.allgather(value) return collective.all_gather(value, C.LABEL) end

-- ---- the model's parameters ----------------------------------------------------------------------

--- Every path of every parameter: {list = {{path =, param =, aliases = {...}}, ...} in
--- named_parameters order (path is the first path), by_param =, by_path = (every path,
--- aliases included)}. A tied parameter has the other paths that reach it as aliases.
function C.param_table(model)
  local order, paths = ties.all_paths(model)
  local list, by_param, by_path = {}, {}, {}
  for _, p in ipairs(order) do
    local it = {path = paths[p][1], param = p, aliases = {}}
    for i = 2, #paths[p] do
      if by_path[paths[p][i]] == nil then it.aliases[#it.aliases + 1] = paths[p][i] end
      by_path[paths[p][i]] = it
    end
    list[#list + 1] = it
    by_param[p] = it
    by_path[it.path] = it
  end
  return {list = list, by_param = by_param, by_path = by_path}
end

--- This rank's part of each parameter. {first =, count =, view = 1-D tensor of count elements
--- whose writes land in the parameter (or its shard), replicated = true when every rank holds
--- the whole parameter (a plain model, or a unit with strategy "none")}.
--- for_load: a plain parameter on the meta device (fsdp.meta) is accepted, marked meta = true
--- and given storage only when the load applies.
function C.local_parts(P, for_load)
  local slices_of = {} -- unit -> {param -> local slice}
  local parts = {}
  for _, it in ipairs(P.list) do
    local p = it.param
    local u = core.param_unit(p)
    if u == nil then
      if p.device == "meta" and for_load then
        parts[p] = {first = 0, count = p:numel(), replicated = true, meta = true, dtype = p:dtype()}
      elseif C.NO_DATA[p.device] then
        C.fail(("parameter %s is on the %s device: materialize the model first"):format(it.path, p.device))
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

--- A new buffer for a parameter's part (or count elements of it), in the part's dtype and
--- on its device.
function C.part_buffer(part, count)
  return core.zeros({count or part.count}, {dtype = part.dtype, device = part.device})
end

--- Two stored tensors of one tied parameter must hold the same values: a and b are this
--- rank's parts of stored tensors na and nb (read alike), `it` the parameter. Fails naming
--- them when they differ.
function C.check_tied_copy(where, it, na, a, nb, b)
  local msg = ties.conflict(a, b, na, nb, it.path, where)
  if msg then C.fail(msg) end
end

-- ---- tensors in extra ---------------------------------------------------------------------
--
-- extra is a JSON-able value that may hold tensors anywhere (as values). Saving replaces each
-- with {["fsdp.tensor"] = name} (names "fsdp.extra:1", ... in a fixed walk: array order, then
-- sorted keys) and stores the tensor under that name; loading puts the tensors back.

local EXTRA_TAG = "fsdp.tensor"
local EXTRA_PREFIX = "fsdp.extra:"

--- -> the JSON value (tensors replaced by tags), {{name =, tensor =}, ...}. Errors name the
--- place ("extra.a[2]").
function C.split_extra(extra)
  local tensors = {}
  local function walk(v, where, depth)
    if util.is_tensor(v) then
      if C.NO_DATA[v.device] then
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

--- The value with each tag replaced by get(name) (what load returns as extra).
function C.join_extra(v, get)
  if type(v) ~= "table" then return v end
  local name = v[EXTRA_TAG]
  if type(name) == "string" and next(v, next(v)) == nil then return get(name) end
  local out = {}
  for k, x in pairs(v) do out[k] = C.join_extra(x, get) end
  return out
end

--- Every tag's name in a decoded extra, in a list.
function C.extra_names(v, out)
  out = out or {}
  if type(v) == "table" then
    if type(v[EXTRA_TAG]) == "string" and next(v, next(v)) == nil then
      out[#out + 1] = v[EXTRA_TAG]
    else
      for _, x in pairs(v) do C.extra_names(x, out) end
    end
  end
  return out
end

--- "missing tensors (in the model, not in the <where>): ...; unexpected tensors ..." for a
--- strict load, or nil when nothing is missing or unexpected.
function C.strict_problems(missing, unexpected, where)
  local what = {}
  if #missing > 0 then
    what[#what + 1] = ("missing tensors (in the model, not in the %s): %s"):format(where,
      util.few(missing, 8))
  end
  if #unexpected > 0 then
    what[#what + 1] = ("unexpected tensors (in the %s, not in the model): %s"):format(where,
      util.few(unexpected, 8))
  end
  if #what == 0 then return nil end
  return table.concat(what, "; ") .. " (strict = false loads what matches)"
end

return C
