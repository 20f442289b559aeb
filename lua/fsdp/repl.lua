-- fsdp.repl: fsdp.debug(), the REPL opened from inside a recipe, and what fsdprun's REPL asks
-- of Lua: tab completion (M.complete) and the globals of `fsdprun -i` (M.preload). The REPL
-- itself is fsdprun's (src/cli/repl.c, reached through package.loaded.fsdprun); docs/REPL.md is
-- the manual.
--
-- fsdp.debug() is collective: every rank calls it at the same point. While the REPL runs, the
-- local variables (and upvalues) of the function that called it are visible as globals, so
-- `model` or `loss` can be looked at as they are; a value the session assigns to one of those
-- names is written back to the variable when the REPL ends, and the globals the names hid
-- come back. Leaving the REPL (:quit, end of input) returns to the recipe.

local core = require "fsdp.core"

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
--- debug.debug(); in a program embedding libfsdp it raises. Raises when the REPL cannot run,
--- and when a collective failed in it (the ranks' communicator is then poisoned, so the recipe
--- could not go on anyway).
function M.debug()
  local caller = debug.getinfo(2, "Sl")
  local where = caller and (caller.short_src .. ":" .. (caller.currentline or "?")) or "?"
  local host = package.loaded.fsdprun
  if type(host) ~= "table" or type(host.repl) ~= "function" then
    -- in a program embedding libfsdp (fsdp.host is loaded) debug.debug() would read that
    -- program's standard input from a rank thread: refused there at any world size
    if core.world_size() > 1 or package.loaded["fsdp.host"] ~= nil then
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

-- ---- tab completion ---------------------------------------------------------------------------
-- Names are looked up without running the state's code: raw fields, and what a metatable
-- offers as tables (__index, __methods, an nn module's __fields and __class) or as a list
-- (__complete). An __index function is never called; __complete is, protected.

local MAX_DEPTH = 8 -- metatable chains followed at most
local MAX_NAMES = 4096

local KEYWORDS = {
  "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "goto", "if",
  "in", "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while",
}

local function is_module(v, mt)
  return type(v) == "table" and rawget(mt, "__fsdp_module") == true
end

-- Names of v starting with partial (metamethods and private names only when partial starts
-- with '_'), into set; methods: only names whose value is a function (after ':').
local function collect(v, partial, methods, set, depth)
  if depth > MAX_DEPTH then return end
  local function add(k, x)
    if type(k) == "string" and k:match("^[%a_][%w_]*$") and k:sub(1, #partial) == partial
        and (k:sub(1, 2) ~= "__" or partial:sub(1, 1) == "_")
        and (not methods or x == nil or type(x) == "function") then
      set[k] = true
    end
  end
  if type(v) == "table" then
    for k, x in next, v do add(k, x) end
  end
  local mt = debug.getmetatable(v)
  if type(mt) ~= "table" then return end
  local list = rawget(mt, "__complete")
  if type(list) == "function" then
    local ok, got = pcall(list, v)
    list = ok and got or nil
  end
  if type(list) == "table" then
    for _, k in ipairs(list) do add(k) end
  end
  local via = { rawget(mt, "__methods"), rawget(mt, "__index") }
  if is_module(v, mt) then
    via[#via + 1] = rawget(v, "__fields")
    via[#via + 1] = rawget(mt, "__class")
  end
  for i = 1, 4 do
    if type(via[i]) == "table" and not rawequal(via[i], v) then
      collect(via[i], partial, methods, set, depth + 1)
    end
  end
end

-- v[k] without running code (nil where only code could tell).
local function peek(v, k, depth)
  if depth > MAX_DEPTH then return nil end
  if type(v) == "table" then
    local x = rawget(v, k)
    if x ~= nil then return x end
  end
  local mt = debug.getmetatable(v)
  if type(mt) ~= "table" then return nil end
  local via = { is_module(v, mt) and rawget(v, "__fields") or false, rawget(mt, "__methods"),
    rawget(mt, "__class"), rawget(mt, "__index") }
  for i = 1, 4 do
    if type(via[i]) == "table" and not rawequal(via[i], v) then
      local x = peek(via[i], k, depth + 1)
      if x ~= nil then return x end
    end
  end
  return nil
end

-- The word before the cursor: names, '.', ':' and bracketed keys ([1], ["k"]), so that
-- `model.blocks[1].ml` is one word.
local function last_word(line)
  local p = #line + 1
  while true do
    while p > 1 and line:sub(p - 1, p - 1):match("[%w_.:]") do p = p - 1 end
    if line:sub(p - 1, p - 1) ~= "]" then break end
    local open = line:sub(1, p - 2):match(".*()%[")
    if not open then break end
    p = open
  end
  return line:sub(p)
end

--- Tab completion for the text before the cursor (a.b.c, a.b:c, a.b[2].c, a["k"].c),
--- looked up in env (default: the globals): the candidates (sorted, unique) and what they
--- share beyond the name typed so far (the text to insert). A word whose path does not
--- resolve has none.
function M.complete(line, env)
  local word = last_word(line)
  local v, methods = env or _G, false
  local name, pos = word:match("^([%w_]*)()") -- name: the step to take, nil after ']'
  while pos <= #word do
    if name ~= nil then
      if methods or not name:match("^[%a_][%w_]*$") then return {}, "" end -- a:b.c: no path
      v = peek(v, name, 0)
      if v == nil then return {}, "" end
    end
    local sep = word:sub(pos, pos)
    if sep == "." or sep == ":" then
      methods = sep == ":"
      name, pos = word:match("^([%w_]*)()", pos + 1)
    else -- '[': a quoted key or a number, then ']'
      local key, after = word:match('^%["([^"]*)"%]()', pos)
      if not key then key, after = word:match("^%['([^']*)'%]()", pos) end
      if not key then
        key, after = word:match("^%[(%d+)%]()", pos)
        if not key or #key > 15 then return {}, "" end
        key = tonumber(key)
        v = type(v) == "table" and rawget(v, key) or nil
      else
        v = peek(v, key, 0)
      end
      if v == nil then return {}, "" end
      name, pos = nil, after
    end
  end
  if name == nil then return {}, "" end -- the word ends with ']'
  local set = {}
  collect(v, name, methods, set, 0)
  if not word:find("[.:%[]") then
    for _, k in ipairs(KEYWORDS) do
      if k:sub(1, #name) == name then set[k] = true end
    end
  end
  local names = {}
  for k in pairs(set) do
    if #names < MAX_NAMES then names[#names + 1] = k end
  end
  table.sort(names)
  local common = names[1] or name
  for i = 2, #names do
    local n = 0
    while n < #common and common:byte(n + 1) == names[i]:byte(n + 1) do n = n + 1 end
    common = common:sub(1, n)
  end
  return names, common:sub(#name + 1)
end

-- ---- the globals of `fsdprun -i` ----------------------------------------------------------

--- `fsdprun -i`: the globals `fsdp` (require "fsdp") and `nn` (fsdp.nn) in env (default: the
--- globals), where the recipe left those names unset. Returns what the banner says of them
--- ("fsdp and nn are globals"), naming only those that hold the modules; nil when none does.
function M.preload(env)
  env = env or _G
  local fsdp = require "fsdp"
  local have = {}
  for _, name in ipairs { "fsdp", "nn" } do
    local module = name == "fsdp" and fsdp or fsdp.nn
    if rawget(env, name) == nil then rawset(env, name, module) end
    if rawequal(rawget(env, name), module) then have[#have + 1] = name end
  end
  if #have == 0 then return nil end
  return table.concat(have, " and ") .. (#have == 1 and " is a global" or " are globals")
end

return M
