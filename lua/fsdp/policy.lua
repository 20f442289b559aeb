-- fsdp.policy — which modules of a model become units (docs/fsdp.md, "Policies").
--
--   fsdp.policy.modules{Class, ...}   fsdp.policy.size(min_params)   fsdp.policy.list{m1, ...}
--   M.select(model, policy, forced) -> set of unit modules (what fsdp.wrap builds on)
--
-- A policy is a table {name =, select = function(module, path, numel) -> bool}: asked for
-- every module below the root, bottom-up (children before parents), with numel = the number
-- of parameter elements of the module's subtree not already claimed by a selected
-- descendant. A plain function(module, path, numel) is accepted as a policy too.

local nn = require "fsdp.nn"
local base = require "fsdp.nn.module"
local util = require "fsdp.util"

local raise, is_module = util.raise, util.is_module

local M = {}

local Policy = {}
Policy.__index = Policy
Policy.__tostring = function(p) return "fsdp.policy." .. p.name end

local function new_policy(name, select) return setmetatable({name = name, select = select}, Policy) end

--- modules{Class, ...}: every module that is an instance of one of the classes (or subclasses).
function M.modules(classes)
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
  return new_policy("modules{" .. table.concat(names, ", ") .. "}", function(m)
    for _, c in ipairs(classes) do
      if nn.isinstance(m, c) then return true end
    end
    return false
  end)
end

--- size(min_params): a module whose unclaimed parameter elements number at least min_params
--- (like PyTorch's size_based_auto_wrap_policy; decided bottom-up). Containers without a
--- forward (ModuleList) are never picked: their elements' unclaimed parameters count toward
--- their parent, as PyTorch's exclude_wrap_modules does.
function M.size(min_params)
  if type(min_params) ~= "number" or min_params < 1 then
    raise(("fsdp.policy.size: min_params must be a number >= 1 (got %s)"):format(tostring(min_params)))
  end
  local p = new_policy(("size(%d)"):format(min_params), function(_, _, numel)
    return numel >= min_params
  end)
  p.skip_containers = true
  return p
end

--- list{m1, m2, ...}: exactly these module objects (each must be part of the wrapped model).
function M.list(mods)
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

--- Whether p is a policy made by this module.
function M.is_policy(p) return getmetatable(p) == Policy end

--- The select function of a policy (nil: none), or an error for something else.
function M.check(policy)
  if policy == nil then return nil end
  if type(policy) == "function" then return policy end
  if getmetatable(policy) == Policy then return policy.select end
  raise("fsdp.wrap: policy must be fsdp.policy.modules{...}, .size(n), .list{...} or a function")
end

-- Bottom-up over the modules below model's root, each module and parameter at its first place:
-- enter(m) before m's children (optional), then claim(m, path, numel) with numel the parameter
-- elements of m's subtree that no descendant claimed; a true answer claims them. The root is
-- never asked. Returns the set of modules and parameters seen.
local function walk_claims(model, claim, enter)
  local seen = {[model] = true}
  local function visit(m, path)
    if enter then enter(m) end
    local unclaimed = {} -- param -> numel
    for _, e in ipairs(base.own_entries(m)) do
      local name, v = e[1], e[2]
      if not seen[v] then
        seen[v] = true
        if is_module(v) then
          for p, n in pairs(visit(v, util.join(path, name))) do unclaimed[p] = n end
        else
          unclaimed[v] = v:numel()
        end
      end
    end
    if m ~= model then
      local numel = 0
      for _, n in pairs(unclaimed) do numel = numel + n end
      if claim(m, path, numel) then return {} end
    end
    return unclaimed
  end
  visit(model, "")
  return seen
end

--- The unit modules of model: the root, the forced ones (inner units of an earlier wrap) and
--- the policy's. Returns set module -> true.
function M.select(model, policy, forced)
  local selected = {[model] = true}
  for m in pairs(forced) do selected[m] = true end
  local select = M.check(policy)
  local skip_containers = getmetatable(policy) == Policy and policy.skip_containers
  local seen = walk_claims(model, function(m, path, numel)
    local container = nn.isinstance(m, nn.ModuleList)
    if not selected[m] and select and not (container and skip_containers)
      and select(m, path, numel) then
      selected[m] = true
    end
    if selected[m] and container then
      raise(("fsdp.wrap: the policy picked %s (ModuleList), which has no forward: its "
        .. "parameters could never be gathered; pick its elements instead"):format(path))
    end
    return selected[m]
  end)
  if getmetatable(policy) == Policy and policy.modules then
    for i, m in ipairs(policy.modules) do
      if not seen[m] and m ~= model then
        raise(("fsdp.policy.list: module %d (%s) is not part of the wrapped model"):format(i, m:type_name()))
      end
    end
  end
  return selected
end

--- The modules a checkpoint policy (fsdp.wrap{checkpoint = policy}) picks: the policy is asked
--- as a wrap policy is, for every module below the root, bottom-up, numel counting the
--- parameter elements of the module's subtree outside picked descendants; containers without a
--- forward (ModuleList) are never asked. Returns an array of {module =, path =}, pre-order.
function M.select_checkpoint(model, policy)
  local select = getmetatable(policy) == Policy and policy.select or policy
  local picked, order, n = {}, {}, 0
  local seen = walk_claims(model, function(m, path, numel)
    if nn.isinstance(m, nn.ModuleList) or not select(m, path, numel) then return false end
    picked[#picked + 1] = {module = m, path = path}
    return true
  end, function(m)
    n = n + 1
    order[m] = n
  end)
  table.sort(picked, function(a, b) return order[a.module] < order[b.module] end) -- pre-order
  if getmetatable(policy) == Policy and policy.modules then
    for i, m in ipairs(policy.modules) do
      if not seen[m] or m == model then
        raise(("fsdp.wrap: checkpoint: module %d of fsdp.policy.list (%s) is not below the "
          .. "wrapped model's root"):format(i, m:type_name()))
      end
    end
  end
  return picked
end

return M
