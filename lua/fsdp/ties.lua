-- fsdp.ties — tied parameters: one parameter object referenced from several places.
-- docs/init.md ("Ties") is the manual.
--
--   fsdp.ties(model)              every shared parameter with all its paths
--   fsdp.retie(model, groups)     make each group of paths one parameter
--   M.all_paths(model)            every reference path of every parameter (wrap, loaders)
--   M.conflict(a, b, ...)         the error for two stored copies of one tie that differ
--
-- A tie is not metadata: it is the same object in two fields (invariant 1,
-- docs/ARCHITECTURE.md). Nothing here creates a parameter; retie reassigns fields to an
-- existing object.

local base = require "fsdp.nn.module"
local state = require "fsdp.state"
local util = require "fsdp.util"

local raise, is_module = util.raise, util.is_module

local M = {}

--- Every reference path of every distinct parameter of model: modules are walked without
--- deduplication (a module referenced from two places gives its parameters a path through
--- each), with a guard against cycles. Returns order (parameters by first path, the order of
--- named_parameters) and paths (param -> array of paths, first path first).
function M.all_paths(model)
  local order, paths = {}, {}
  local onstack = {}
  local function visit(m, prefix)
    if onstack[m] then return end
    onstack[m] = true
    for _, e in ipairs(base.own_entries(m)) do
      local path, v = util.join(prefix, e[1]), e[2]
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

--- Every parameter reachable through more than one path, in named_parameters order:
--- { {param =, paths = {first, ...}}, ... }. Works on plain and wrapped models alike (wrapping
--- never replaces a parameter object).
function M.ties(model)
  if not is_module(model) then
    raise(("fsdp.ties: expected a module (got %s)"):format(type(model)))
  end
  local order, paths = M.all_paths(model)
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
      v = base.field(m, part)
    end
    if v == nil then
      raise(("%s: no parameter at %s (%s has no field %s)"):format(what, path, m:type_name(), part))
    end
    parent, key, m = m, k, v
  end
  if parent == nil or is_module(m) or not util.is_param(m) then
    raise(("%s: %s is not a parameter"):format(what, path))
  end
  return parent, key, m
end

--- Set the field that `path` names inside model to param (a checkpoint's tie).
function M.set_path(model, path, param)
  local parent, key = resolve(model, path, "retie")
  parent[key] = param
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
  if state.of(model) ~= nil then
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
  local group_of = {} -- parameter -> {group, path} that named it first
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
      -- groups apply one after another: a parameter in two of them would be replaced by the
      -- first and then tied by the second as the object it no longer is
      local seen = group_of[p]
      if seen ~= nil and seen[1] ~= g then
        raise(("fsdp.retie: groups %d and %d both name %s (%s in group %d): list every path of "
          .. "one tie in one group"):format(seen[1], g, path, seen[2], seen[1]))
      end
      group_of[p] = group_of[p] or {g, path}
      items[#items + 1] = {module = m, key = key, param = p, path = path}
    end
    local keep = items[1]
    for _, it in ipairs(items) do
      if index[it.param] < index[keep.param] then keep = it end
    end
    for _, it in ipairs(items) do
      if it.param ~= keep.param and util.shape_str(it.param) ~= util.shape_str(keep.param) then
        raise(("fsdp.retie: %s %s and %s %s have different shapes"):format(keep.path,
          util.shape_str(keep.param), it.path, util.shape_str(it.param)))
      end
    end
    plans[#plans + 1] = {keep = keep, items = items}
  end
  for _, plan in ipairs(plans) do
    local keep = plan.keep
    for _, it in ipairs(plan.items) do
      if it.param ~= keep.param then
        if it.param.has_data and keep.param.has_data then
          local d = util.max_abs_diff(it.param, keep.param)
          if d ~= nil and d > 0 then
            util.note(("fsdp.retie: warning: %s and %s held different values (largest difference "
              .. "%.6g); keeping %s's"):format(it.path, keep.path, d, keep.path))
          end
        end
        it.module[it.key] = keep.param
      end
    end
  end
  base.drop_unowned_keys(model)
  return model
end

--- The error for two stored tensors of one tied parameter that differ (nil when they agree).
--- a, b: the two tensors (or this rank's parts of them), named na and nb; first: the
--- parameter's first path; where: the file or source, prefixed to the message when given.
function M.conflict(a, b, na, nb, first, where)
  local d = util.max_abs_diff(a, b)
  if d ~= nil and d == 0 then return nil end
  return ("%s'%s' and '%s' hold one tied parameter of the model (%s) but different values "
    .. "(largest difference %s): load into a model where they are two parameters, or store "
    .. "one value under both names"):format(where and (where .. ": ") or "", na, nb, first,
      d and ("%.6g"):format(d) or "unknown")
end

return M
