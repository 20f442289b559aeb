-- fsdp.repl: fsdp.debug(), the REPL opened from inside a recipe. The REPL itself
-- is fsdprun's (src/cli/repl.c, reached through package.loaded.fsdprun); docs/REPL.md is the
-- manual.
--
-- fsdp.debug() is collective: every rank calls it at the same point. While the REPL runs, the
-- local variables (and upvalues) of the function that called it are visible as globals, so
-- `model` or `loss` can be looked at as they are; a value the session assigns to one of those
-- names is written back to the variable when the REPL ends, and the globals the names hid
-- come back. Leaving the REPL (:quit, end of input) returns to the recipe.

local M = {}

-- The variables of the function `level` levels above the caller of this helper: name ->
-- {local = index} or {upvalue = index, func = f}, with their values. Locals shadow upvalues,
-- and a later local of the same name (an inner block) shadows an earlier one.
local function visible_vars(level)
  level = level + 1
  local vars = {}
  local info = debug.getinfo(level, "f")
  if info and info.func then
    for i = 1, 255 do
      local name, value = debug.getupvalue(info.func, i)
      if name == nil then break end
      if name:match("^[%a_][%w_]*$") then
        vars[name] = { upvalue = i, func = info.func, value = value }
      end
    end
  end
  for i = 1, 255 do
    local name, value = debug.getlocal(level, i)
    if name == nil then break end
    if name:match("^[%a_][%w_]*$") then vars[name] = { ["local"] = i, value = value } end
  end
  return vars
end

--- Collective: open the REPL here on every rank (fsdprun -n N); the recipe goes on when the
--- user leaves it. Outside fsdprun (plain luajit, a world of one) it falls back to Lua's
--- debug.debug(). Raises when the REPL cannot run, and when a collective failed in it (the
--- ranks' communicator is then poisoned, so the recipe could not go on anyway).
function M.debug()
  local caller = debug.getinfo(2, "Sl")
  local where = caller and (caller.short_src .. ":" .. (caller.currentline or "?")) or "?"
  local host = package.loaded.fsdprun
  if type(host) ~= "table" or type(host.repl) ~= "function" then
    local fsdp = require "fsdp"
    if fsdp.world_size() > 1 then
      error("fsdp.debug: the REPL needs fsdprun (this program embeds the engine without it)", 2)
    end
    io.stderr:write("fsdp.debug() at ", where, ": Lua's debug.debug(); 'cont' goes on\n")
    debug.debug()
    return
  end
  local vars = visible_vars(2)
  local G = _G
  local hidden = {}
  for name, v in pairs(vars) do
    hidden[name] = rawget(G, name)
    rawset(G, name, v.value)
  end
  local ok, err = pcall(host.repl, where)
  -- what the session assigned goes back to the variable; the hidden globals come back
  for name, v in pairs(vars) do
    local now = rawget(G, name)
    if not rawequal(now, v.value) then
      if v["local"] then debug.setlocal(2, v["local"], now)
      else debug.setupvalue(v.func, v.upvalue, now) end
    end
    rawset(G, name, hidden[name])
  end
  if not ok then error(err, 0) end
end

return M
