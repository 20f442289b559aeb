-- fsdp.args — recipe arguments declared once: name, default, type, help (docs/recipes.md,
-- "Arguments"). `fsdp.args{...}` (lua/fsdp/init.lua) calls M.declare: it parses the global `arg`
-- against the declaration, prints the help on `--help` and refuses an unknown argument, a bad
-- value or a missing one with one line naming the argument.
--
-- The grammar: `--name=value` or `--name value` (the next word is the value unless it starts
-- with "--"; so `--lr -0.5` works); a boolean is `--name` (true) or `--name=true|false`, never
-- followed by a separate word; `-` and `_` are the same inside a name (`--eval-every`); the last
-- of repeated arguments wins; `--` ends the arguments (what follows is refused as unexpected,
-- as is any word that is not an argument). `-h` or `--help` anywhere before `--` asks for help.
--
-- The parser is ours, not lua-argparse's: argparse 0.7 reads `--lr -0.5` as an unknown option
-- "-0", names no argument in "too many arguments" or "malformed argument 'abc'", refuses
-- `--flag=false`, and prints its usage and exits by itself; working around each costs more than
-- these lines, and fsdprun would depend on a second Lua package at run time.

local U = require "fsdp.util"

local M = {}

local TYPES = {number = true, integer = true, string = true, boolean = true}
local ENTRY_KEYS = {"choices", "min", "max"}

local function check_value(d, v)
  if d.type == "boolean" then return type(v) == "boolean" end
  if d.type == "string" then return type(v) == "string" end
  if type(v) ~= "number" then return false end
  return d.type == "number" or (v == math.floor(v) and v > -math.huge and v < math.huge)
end

--- The declaration checked and normalised: {description =, list = {d...}, by = {[name] = d}}
--- with d = {name =, default =, type =, help =, choices =, min =, max =}. A mistake in it is
--- the recipe's, raised at its line.
function M.spec(decl)
  if type(decl) ~= "table" then
    U.raise(("fsdp.args: expects a table of argument declarations (got %s)"):format(type(decl)))
  end
  for k in pairs(decl) do
    if type(k) ~= "number" and k ~= "description" then
      U.raise(("fsdp.args: unknown key '%s' (valid: description, and one {name, default, type, "
        .. "help} per argument)"):format(tostring(k)))
    end
  end
  local spec = {description = decl.description, list = {}, by = {}}
  for i, e in ipairs(decl) do
    if type(e) ~= "table" then
      U.raise(("fsdp.args: declaration %d must be {name, default, type, help} (got %s)"):format(i, type(e)))
    end
    local name = e[1]
    if type(name) ~= "string" or not name:match("^[%a_][%w_]*$") then
      U.raise(("fsdp.args: declaration %d: the name must be an identifier (got %s)"):format(i, tostring(name)))
    end
    local where = "fsdp.args: --" .. name
    if name == "help" or name == "h" then U.raise(where .. ": reserved (it prints the help)") end
    for k in pairs(e) do
      if not (k == 1 or k == 2 or k == 3 or k == 4 or k == "choices" or k == "min" or k == "max") then
        U.raise(("%s: unknown key '%s' (valid: [1] name, [2] default, [3] type, [4] help, %s)")
          :format(where, tostring(k), table.concat(ENTRY_KEYS, ", ")))
      end
    end
    local d = {name = name, default = e[2], type = e[3], help = e[4], choices = e.choices,
      min = e.min, max = e.max}
    if not TYPES[d.type] then
      U.raise(("%s: the type must be \"number\", \"integer\", \"string\" or \"boolean\" (got %s)")
        :format(where, tostring(d.type)))
    end
    if type(d.help) ~= "string" then U.raise(where .. ": the help must be a string") end
    if spec.by[name] then U.raise(where .. ": declared twice") end
    if d.choices ~= nil then
      if d.type ~= "string" or type(d.choices) ~= "table" or #d.choices == 0 then
        U.raise(where .. ": choices must be a list of strings, for a string argument")
      end
      for _, c in ipairs(d.choices) do
        if type(c) ~= "string" then U.raise(where .. ": choices must be a list of strings") end
      end
    end
    for _, k in ipairs {"min", "max"} do
      if d[k] ~= nil and (type(d[k]) ~= "number" or (d.type ~= "number" and d.type ~= "integer")) then
        U.raise(("%s: %s must be a number, for a number or integer argument"):format(where, k))
      end
    end
    if d.default ~= nil then
      if not check_value(d, d.default) then
        U.raise(("%s: the default %s is not a%s %s"):format(where, tostring(d.default),
          d.type == "integer" and "n" or "", d.type))
      end
      local bad = M.check(d, d.default)
      if bad then U.raise(("%s: the default %s"):format(where, (bad:gsub("^[^:]*: ", "")))) end
    end
    spec.list[#spec.list + 1], spec.by[name] = d, d
  end
  return spec
end

--- nil when v (already of d's type) is allowed, else the message naming the argument.
function M.check(d, v)
  if d.choices then
    for _, c in ipairs(d.choices) do if v == c then return nil end end
    return ("--%s: '%s' is not one of %s"):format(d.name, v, table.concat(d.choices, ", "))
  end
  if d.min ~= nil and v < d.min then
    return ("--%s: %s is below the minimum %s"):format(d.name, tostring(v), tostring(d.min))
  end
  if d.max ~= nil and v > d.max then
    return ("--%s: %s is above the maximum %s"):format(d.name, tostring(v), tostring(d.max))
  end
  return nil
end

-- The text s as d's type, or nil and the message.
local function convert(d, s)
  local v
  if d.type == "string" then
    v = s
  elseif d.type == "boolean" then
    if s == "true" then v = true elseif s == "false" then v = false
    else return nil, ("--%s: '%s' is not true or false"):format(d.name, s) end
  else
    v = tonumber(s)
    if v == nil or v ~= v then return nil, ("--%s: '%s' is not a%s"):format(d.name, s,
      d.type == "integer" and "n integer" or " number") end
    if d.type == "integer" and not check_value(d, v) then
      return nil, ("--%s: '%s' is not an integer"):format(d.name, s)
    end
    -- from 2^53 on a double skips integers: the text would quietly become another value
    -- ('9007199254740993' reads as 9007199254740992)
    if d.type == "integer" and math.abs(v) >= 2 ^ 53 then
      return nil, ("--%s: '%s' is too large for an exact integer (its size must be below 2^53)")
        :format(d.name, s)
    end
  end
  local bad = M.check(d, v)
  if bad then return nil, bad end
  return v
end

-- The closest declared name to `name` (a typo: at most two edits apart), or nil.
local function nearest(spec, name)
  local function dist(a, b)
    local prev = {}
    for j = 0, #b do prev[j] = j end
    for i = 1, #a do
      local cur = {[0] = i}
      for j = 1, #b do
        cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a:byte(i) == b:byte(j) and 0 or 1))
      end
      prev = cur
    end
    return prev[#b]
  end
  local best, bd = nil, 3
  for _, d in ipairs(spec.list) do
    local n = dist(name, d.name)
    if n < bd then best, bd = d.name, n end
  end
  return best
end

--- Whether argv (an array of strings) asks for help: -h or --help before any `--`.
function M.wants_help(argv)
  for _, a in ipairs(argv or {}) do
    if a == "--" then return false end
    if a == "-h" or a == "--help" then return true end
  end
  return false
end

--- Parse argv (an array of strings) against spec (M.spec's): the values (defaults filled
--- in), or nil and one line naming the argument at fault.
function M.parse(spec, argv)
  local vals = {}
  for _, d in ipairs(spec.list) do vals[d.name] = d.default end
  argv = argv or {}
  local i = 1
  while i <= #argv do
    local a = tostring(argv[i])
    if a == "--" then
      if argv[i + 1] ~= nil then
        return nil, ("unexpected argument '%s' after --"):format(tostring(argv[i + 1]))
      end
      break
    end
    local raw, eq, s = a:match("^%-%-([^=]+)(=?)(.*)$")
    if raw == nil then
      return nil, ("unexpected argument '%s'; arguments are --name=value"):format(a)
    end
    local name = raw:gsub("%-", "_")
    local d = spec.by[name]
    if d == nil then
      local near = nearest(spec, name)
      return nil, ("unknown argument --%s%s"):format(raw, near and ("; did you mean --" .. near .. "?") or "")
    end
    if eq == "" then
      if d.type == "boolean" then
        s = "true"
      else
        local nxt = argv[i + 1]
        if nxt == nil or tostring(nxt):match("^%-%-") then
          return nil, ("--%s: missing value (--%s=%s)"):format(d.name, d.name, d.type:upper())
        end
        s, i = tostring(nxt), i + 1
      end
    end
    local v, err = convert(d, s)
    if err then return nil, err end
    vals[d.name] = v
    i = i + 1
  end
  return vals
end

local function show(v)
  if type(v) == "string" then return v == "" and '""' or v end
  return tostring(v)
end

--- The help text: usage, the description, one line per argument (type or choices, help,
--- default, range).
function M.help(spec, prog, script)
  local lines = {("usage: %s [-n N] %s [--name=value ...]"):format(prog or "fsdprun", script or "recipe.lua")}
  if spec.description then lines[#lines + 1] = ""; lines[#lines + 1] = spec.description end
  lines[#lines + 1] = ""
  lines[#lines + 1] = "arguments (also --name value; a boolean alone is true):"
  local rows, width = {}, 0
  for _, d in ipairs(spec.list) do
    local left = d.type == "boolean" and ("--" .. d.name)
      or ("--%s=%s"):format(d.name, d.choices and table.concat(d.choices, "|") or d.type:upper())
    local right = d.help
    local extra = {}
    if d.default ~= nil then extra[#extra + 1] = "default " .. show(d.default) end
    if d.min ~= nil and d.max ~= nil then extra[#extra + 1] = ("%s..%s"):format(d.min, d.max)
    elseif d.min ~= nil then extra[#extra + 1] = ">= " .. tostring(d.min)
    elseif d.max ~= nil then extra[#extra + 1] = "<= " .. tostring(d.max) end
    if #extra > 0 then right = right .. " [" .. table.concat(extra, ", ") .. "]" end
    rows[#rows + 1] = {left, right}
    width = math.max(width, #left)
  end
  rows[#rows + 1] = {"-h, --help", "print this and exit"}
  width = math.min(math.max(width, 10), 28)
  for _, r in ipairs(rows) do
    if #r[1] > width then
      lines[#lines + 1] = "  " .. r[1]
      lines[#lines + 1] = "  " .. (" "):rep(width) .. "  " .. r[2]
    else
      lines[#lines + 1] = ("  %-" .. width .. "s  %s"):format(r[1], r[2])
    end
  end
  return table.concat(lines, "\n") .. "\n"
end

-- The program name as `arg` holds it (its lowest index: fsdprun or luajit), its base name.
local function program(argt)
  local lo = 0
  while argt[lo - 1] ~= nil do lo = lo - 1 end
  local p = lo < 0 and tostring(argt[lo]) or "fsdprun"
  return p:match("([^/]+)$") or p
end

--- Declare the recipe's arguments and parse the global `arg` against them: the values. With
--- -h/--help, rank 0 prints the help and every rank ends (os.exit(0)); an argument refused
--- ends every rank with status 2 after rank 0 printed "PROG: SCRIPT: <message> (...)" on
--- stderr; outside fsdprun (no os.exit of its own) the refusal is raised as an error instead.
--- rank: the calling rank (0 prints).
function M.declare(decl, rank)
  local spec = M.spec(decl)
  local argt = rawget(_G, "arg") or {}
  local argv = {}
  for i = 1, #argt do argv[i] = argt[i] end
  local prog, script = program(argt), tostring(argt[0] or "recipe.lua")
  if M.wants_help(argv) then
    if rank == 0 then
      io.stdout:write(M.help(spec, prog, script))
      io.stdout:flush()
    end
    os.exit(0)
  end
  local vals, err = M.parse(spec, argv)
  if vals then return vals end
  if type(package.loaded.fsdprun) ~= "table" then error(("%s: %s"):format(script, err), 0) end
  local msg = ("%s: %s (try '%s %s --help')"):format(script, err, prog, script)
  if rank == 0 then
    io.stderr:write(prog, ": ", msg, "\n")
    io.stderr:flush()
  end
  os.exit(2)
end

return M
