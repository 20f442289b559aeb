-- fsdp.util — the helpers the Lua library shares: paths and shapes in messages, the one way to
-- raise an error at the caller's position, running without gradient recording, notes on rank
-- 0, and choosing parameters by path patterns.
--
-- Errors. A library function that refuses its arguments raises with util.raise(msg): the
-- message is located at the innermost stack frame outside lua/fsdp (the user's line), never
-- at the library line that noticed. An error caught from deeper down (the engine's, or one
-- raised inside a pcall'd phase) goes back to the user with util.reraise(err), which first
-- drops the library positions it carries (util.strip). Inside the library, phases that are
-- pcall'd raise plain messages with error(msg, 0).

local core = require "fsdp.core"
local log = require "fsdp.log"

local U = {}

-- ---- text ------------------------------------------------------------------------------------

--- Refuse an options table with a key outside `names` (a list of strings), naming the function,
--- the key and the valid keys: "fn: unknown option 'wieght_decay' (valid: lr, betas, ...)".
--- nil passes (no options); a non-table is refused. Returns opts or {}.
function U.check_opts(fn, opts, names)
  if opts == nil then return {} end
  if type(opts) ~= "table" then
    U.raise(("%s: expects an options table {%s} (got %s)"):format(fn, table.concat(names, ", "), type(opts)))
  end
  local known = {}
  for _, k in ipairs(names) do known[k] = true end
  for k in pairs(opts) do
    if not known[k] then
      local valid = {}
      for i, n in ipairs(names) do valid[i] = n end
      table.sort(valid)
      U.raise(("%s: unknown option '%s' (valid: %s)"):format(fn, tostring(k), table.concat(valid, ", ")))
    end
  end
  return opts
end

--- The largest integer a Lua number holds exactly (2^53), and the largest size a shape holds.
U.INT_MAX = 2 ^ 53

--- Whether v is an integer in [min, max] (max: U.INT_MAX when nil); NaN and the infinities
--- are not.
function U.is_int(v, min, max)
  return type(v) == "number" and v >= min and v <= (max or U.INT_MAX) and v == math.floor(v)
end

--- What an integer check's message says v must be: "an integer >= 1", or "an integer in
--- [1, 2^53]" when v is a finite number beyond that.
function U.int_range(v, min)
  if type(v) == "number" and v > U.INT_MAX and v < math.huge then
    return ("an integer in [%d, 2^53]"):format(min)
  end
  return ("an integer >= %d"):format(min)
end

--- A value as a message shows what it got: a number or a boolean as itself, a string quoted
--- ('the string "2"'), anything else by its type.
function U.got(v)
  local t = type(v)
  if t == "number" or t == "boolean" or t == "nil" then return tostring(v) end
  if t == "string" then return ("the string %q"):format(v) end
  if core.is_tensor(v) then return "a tensor" end
  return "a " .. t
end

--- "a.b" from ("a", "b"); the name alone under the root ("").
function U.join(prefix, name)
  if prefix == "" then return tostring(name) end
  return prefix .. "." .. tostring(name)
end

--- "(2, 3)" for a tensor or a shape (array of sizes).
function U.shape_str(x)
  local shape = type(x) == "table" and x or x:shape()
  local parts = {}
  for i = 1, #shape do parts[i] = tostring(shape[i]) end
  return "(" .. table.concat(parts, ", ") .. ")"
end

--- The keys of t, sorted.
function U.sorted_keys(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  table.sort(ks)
  return ks
end

--- "a, b, c, ... (12 in all)": the first `max` (default 5) of a list of names.
function U.few(names, max)
  max = max or 5
  local s = {}
  for i = 1, math.min(#names, max) do s[i] = tostring(names[i]) end
  return table.concat(s, ", ") .. (#names > max and (", ... (%d in all)"):format(#names) or "")
end

--- A note on rank 0 that does not break a progress line (fsdp.log.print).
function U.note(msg) log.print(msg) end

-- ---- values -----------------------------------------------------------------------------------

U.is_tensor = core.is_tensor

--- A module instance (lua/fsdp/nn/module.lua marks its metatables).
function U.is_module(v)
  if type(v) ~= "table" then return false end
  local mt = getmetatable(v)
  return mt ~= nil and rawget(mt, "__fsdp_module") == true
end

function U.is_param(v) return core.is_tensor(v) and v.is_param == true end

--- Whether this rank's copy of u's shard is the one counted when ranks sum what their shards
--- hold (norms, zeros, masks): every rank of a sharded unit, rank 0 of a replicated one
--- (strategy none), and only the first replica (group 0) of a hybrid one, whose other groups
--- hold the same shards.
function U.counts_shard(u)
  local s = u:strategy()
  if s == "none" then return core.rank() == 0 end
  if s == "hybrid" then return u:groups().replica == 0 end
  return true
end

--- This rank's slice of parameter p in unit u (an entry of u:local_slices()), or nil.
function U.local_slice(u, p)
  for _, s in ipairs(u:local_slices()) do
    if rawequal(s.param, p) then return s end
  end
  return nil
end

-- ---- gradient recording -------------------------------------------------------------------------

--- pcall(fn, ...) with gradient recording off (the previous mode comes back): ok, results...
function U.quiet(fn, ...)
  local prev = core.set_grad_enabled(false)
  local res = {pcall(fn, ...)}
  core.set_grad_enabled(prev)
  return unpack(res, 1, table.maxn(res))
end

--- fn(...) with gradient recording off; its results, or its error raised again unchanged.
function U.no_grad(fn, ...)
  local res = {U.quiet(fn, ...)}
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

--- The largest |a - b| over two tensors of one shape (nil when they cannot be compared).
function U.max_abs_diff(a, b)
  local ok, d = U.quiet(function()
    local d = a:contiguous():view{a:numel()} - b:contiguous():view{b:numel()}
    local hi, lo = d:max(), (-d):max()
    if type(hi) ~= "number" then hi, lo = hi:item(), lo:item() end
    return math.max(hi, lo)
  end)
  if not ok then return nil end
  return d
end

-- ---- errors -------------------------------------------------------------------------------------

local lib_dir = debug.getinfo(1, "S").source:match("^@(.*)/util%.lua$") -- .../lua/fsdp

--- Whether a chunk source ("@/path/file.lua") is a file of the fsdp Lua library.
function U.is_lib_source(src)
  return lib_dir ~= nil and src:sub(1, #lib_dir + 2) == "@" .. lib_dir .. "/"
end

--- The same test for a file name as a message shows it (a short_src, maybe "...tail").
function U.is_lib_file(file)
  if lib_dir == nil then return false end
  local tail = file:match("^%.%.%.(.*)$")
  if tail == nil then return file:sub(1, #lib_dir + 1) == lib_dir .. "/" end
  local rel = tail:match("^.*/fsdp/(.*)$") or tail:match("^fsdp/(.*)$")
  return rel ~= nil and (lib_dir .. "/" .. rel):sub(-#tail) == tail
end

--- "file:line: " of the innermost stack frame outside the library (the user's code), or "".
function U.user_where()
  for level = 2, 60 do
    local info = debug.getinfo(level, "Sl")
    if info == nil then break end
    if info.what ~= "C" and info.currentline and info.currentline > 0
        and not U.is_lib_source(info.source) then
      return ("%s:%d: "):format(info.short_src, info.currentline)
    end
  end
  return ""
end

--- Raise msg located at the user's code.
function U.raise(msg) error(U.user_where() .. msg, 0) end

--- An error message without the library positions in front of it ("/.../fsdp/wrap.lua:12: ").
function U.strip(err)
  local msg = tostring(err)
  while true do
    local file, rest = msg:match("^([^\n]-):%d+: (.*)$")
    if file == nil or not U.is_lib_file(file) then return msg end
    msg = rest
  end
end

--- A caught error's message without any position: the library's (util.strip) and the user's
--- line util.raise put in front of it (the caller's user_where); for a message shown elsewhere
--- (on another rank) or inside another one.
function U.message(err)
  local msg, where = U.strip(err), U.user_where()
  if where ~= "" and msg:sub(1, #where) == where then msg = msg:sub(#where + 1) end
  return msg
end

--- Raise a caught error again, located at the user's code (once: a message util.raise
--- already located there keeps its position).
function U.reraise(err)
  local msg, where = U.strip(err), U.user_where()
  if where ~= "" and msg:sub(1, #where) == where then error(msg, 0) end
  error(where .. msg, 0)
end

-- ---- choosing parameters by path --------------------------------------------------------------

--- A params/exclude option checked: nil, or an array of Lua patterns (a string is one).
function U.patterns(v, what, fn)
  if v == nil then return nil end
  if type(v) == "string" then return {v} end
  if type(v) ~= "table" or #v == 0 then
    U.raise(("%s: %s must be a Lua pattern or a list of them (got %s)"):format(fn, what, type(v)))
  end
  for i, s in ipairs(v) do
    if type(s) ~= "string" then
      U.raise(("%s: %s[%d] must be a string (got %s)"):format(fn, what, i, type(s)))
    end
  end
  return v
end

local function matches(path, pats)
  for _, pat in ipairs(pats) do
    if path:find(pat) then return true end
  end
  return false
end

local function path_list(all)
  local names = {}
  for i, e in ipairs(all) do names[i] = e.path end
  return table.concat(names, ", ")
end

--- The parameters of model selected by opts.params (Lua patterns matched against dotted
--- paths; default: every parameter with 2 or more dimensions) minus opts.exclude, in
--- named_parameters order: array of {path =, param =}. A pattern that matches no parameter is
--- an error (fn names the caller) listing the parameters.
function U.select_params(model, opts, fn)
  if not U.is_module(model) then U.raise(("%s: expected a module (got %s)"):format(fn, type(model))) end
  local inc = U.patterns(opts.params, "params", fn)
  local exc = U.patterns(opts.exclude, "exclude", fn) or {}
  local all = {}
  for path, p in model:named_parameters() do all[#all + 1] = {path = path, param = p} end
  for _, list in ipairs{inc or {}, exc} do
    for _, pat in ipairs(list) do
      local ok, hit = pcall(function()
        for _, e in ipairs(all) do
          if e.path:find(pat) then return true end
        end
        return false
      end)
      if not ok then U.raise(("%s: bad pattern %q: %s"):format(fn, pat, tostring(hit))) end
      if not hit then
        U.raise(("%s: the pattern %q matches no parameter; the parameters are: %s")
          :format(fn, pat, path_list(all)))
      end
    end
  end
  local out = {}
  for _, e in ipairs(all) do
    local take
    if inc then take = matches(e.path, inc) else take = #e.param:shape() >= 2 end
    if take and not matches(e.path, exc) then out[#out + 1] = e end
  end
  if #out == 0 then
    U.raise(("%s: no parameter left to prune (params %s, exclude %s); the parameters are: %s")
      :format(fn, inc and table.concat(inc, " | ") or "(every weight with 2+ dimensions)",
        #exc > 0 and table.concat(exc, " | ") or "-", path_list(all)))
  end
  return out
end

return U
