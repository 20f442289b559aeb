-- fsdp.no_sync — gradient accumulation without reduction (PyTorch FSDP's no_sync, DeepSpeed's
-- gradient_accumulation_steps). docs/fsdp.md ("Gradient accumulation: no_sync") is the manual.
--
--   fsdp.no_sync(model, fn) -> fn's results
--
-- fn(model) runs with every unit of the wrapped model set to keep its full gradient instead of
-- reducing it when a backward finishes with it (src/fsdp/unit.h, fsdp_unit_set_grad_sync); the
-- first backward outside reduces the accumulated sum once. This file only turns the units'
-- flag off and back on (Root:no_sync_enter / no_sync_leave, lua/fsdp/state.lua), restoring it
-- when fn raises. A step, clip_grad_norm or unscale_ is refused inside no_sync and, after it,
-- first reduces what a unit still holds (Root:reduce_held: a unit the last backward left out).
-- Nothing here communicates: whether a backward reduces must be decided alike on every rank,
-- so every rank calls no_sync around the same backwards.

local state = require "fsdp.state"
local util = require "fsdp.util"

local M = {}

--- fn(model) with gradient reduction off for the wrapped model; returns fn's results. A plain
--- model communicates nothing anyway: fn simply runs. Nests (sync comes back when the
--- outermost returns); fn's error is raised again unchanged, after sync is back on.
function M.no_sync(model, fn, ...)
  if not util.is_module(model) or type(fn) ~= "function" then
    util.raise(("fsdp.no_sync: expects (model, fn) (got %s, %s)"):format(type(model), type(fn)))
  end
  if select("#", ...) > 0 then
    -- fn is called as fn(model): what else it needs comes through its closure
    util.raise(("fsdp.no_sync: expects (model, fn), and fn is called as fn(model) (got %d more "
      .. "argument%s)"):format(select("#", ...), select("#", ...) == 1 and "" or "s"))
  end
  local R = state.of(model)
  if R == nil then return fn(model) end
  if R:model() ~= model then
    util.raise(("fsdp.no_sync: this %s is part of a wrapped model; give its root (a %s): "
      .. "gradient reduction is turned off for the whole model"):format(model:type_name(),
        R:model():type_name()))
  end
  R:no_sync_enter()
  local res = {pcall(fn, model)}
  R:no_sync_leave()
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

return M
