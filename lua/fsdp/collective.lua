-- fsdp.collective — Lua values between ranks: every rank's value (all_gather), one rank's value
-- (broadcast), and agreement (agree, compare). Every function here is collective: every rank
-- calls it, in the same order.
--
-- A value is nil, a boolean, a number, a string, or a table of those (nested; keys booleans,
-- numbers or strings). It travels as bytes (fsdp.core.all_gather_bytes / broadcast_bytes) in a
-- canonical encoding: numbers exactly (%.17g, and nan/inf/-0 by name), strings as their bytes
-- (NUL bytes included), table keys sorted, so equal values encode to equal bytes on every rank
-- whatever the order their tables were filled in. A cycle, a function, a userdata (tensors
-- too) or a table key of another kind is an error naming where it is in the value.
--
-- Agreement costs one all_reduce of five numbers when the ranks agree (a 64-bit digest of the
-- encoding, and whether a rank failed); only on a difference do the values themselves travel.
--
-- On it, the two checks the library makes before anything irreversible (invariants 2 and 3,
-- docs/ARCHITECTURE.md): check_outcome (did every rank's local phase succeed? the lowest
-- failing rank's message otherwise: what fsdp.save and fsdp.load raise) and check_lists (is
-- every rank about to act on the same things? the first differing item and the ranks
-- otherwise: what fsdp.wrap, fsdp.materialize and load_tensors raise). check_agreement joins
-- one call's arguments and its refusals in one comparison; refusal and difference are the two
-- messages every rank raises from a comparison's result, the same on every rank.
local core = require "fsdp.core"
local util = require "fsdp.util"

local M = {}

-- ---- encoding ----------------------------------------------------------------------------------

local KEY_RANK = { boolean = 1, number = 2, string = 3 }

local function key_less(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then return KEY_RANK[ta] < KEY_RANK[tb] end
  if ta == "boolean" then return (not a) and b end
  return a < b
end

local function number_text(x)
  if x ~= x then return "nan" end
  if x == math.huge then return "inf" end
  if x == -math.huge then return "-inf" end
  if x == 0 and 1 / x < 0 then return "-0" end
  for _, f in ipairs { "%.15g", "%.16g" } do -- the shortest text that reads back as x
    local t = f:format(x)
    if tonumber(t) == x then return t end
  end
  return ("%.17g"):format(x)
end

local function where(path) return path == "" and "the value" or path end

local function encode(v, out, path, open)
  local t = type(v)
  if t == "nil" then
    out[#out + 1] = "z"
  elseif t == "boolean" then
    out[#out + 1] = v and "T" or "F"
  elseif t == "number" then
    out[#out + 1] = "n" .. number_text(v) .. ";"
  elseif t == "string" then
    out[#out + 1] = "s" .. #v .. ":"
    out[#out + 1] = v
  elseif t == "table" then
    if open[v] then error(("collective: %s is a cycle (a table that contains itself)"):format(where(path)), 0) end
    open[v] = true
    local keys = {}
    for k in pairs(v) do
      if not KEY_RANK[type(k)] or k ~= k then
        error(("collective: %s has a key of type %s (keys must be booleans, numbers or strings)")
          :format(where(path), k ~= k and "nan" or type(k)), 0)
      end
      keys[#keys + 1] = k
    end
    table.sort(keys, key_less)
    out[#out + 1] = "t" .. #keys .. ":"
    for _, k in ipairs(keys) do
      encode(k, out, path, open)
      encode(v[k], out, ("%s[%s]"):format(path, type(k) == "string" and ("%q"):format(k) or tostring(k)), open)
    end
    open[v] = nil
  else
    error(("collective: cannot send %s: it is a %s (values are nil, booleans, numbers, strings "
      .. "and tables of them)"):format(where(path), t), 0)
  end
end

--- The canonical bytes of a value (see the file comment).
function M.encode(v)
  local out = {}
  encode(v, out, "", {})
  return table.concat(out)
end

local NAMED = { nan = 0 / 0, inf = math.huge, ["-inf"] = -math.huge, ["-0"] = -0.0 }

local function decode(s, i)
  local tag = s:sub(i, i)
  if tag == "z" then return nil, i + 1 end
  if tag == "T" then return true, i + 1 end
  if tag == "F" then return false, i + 1 end
  if tag == "n" then
    local j = s:find(";", i + 1, true)
    local text = j and s:sub(i + 1, j - 1)
    local x = text and (NAMED[text] or tonumber(text)) -- (NaN is truthy)
    if x == nil then error(("collective: malformed number at byte %d"):format(i), 0) end
    return x, j + 1
  end
  if tag == "s" or tag == "t" then
    local j = s:find(":", i + 1, true)
    local n = j and tonumber(s:sub(i + 1, j - 1))
    if not n then error(("collective: malformed length at byte %d"):format(i), 0) end
    if tag == "s" then return s:sub(j + 1, j + n), j + n + 1 end
    local t, k, v = {}, nil, nil
    i = j + 1
    for _ = 1, n do
      k, i = decode(s, i)
      v, i = decode(s, i)
      t[k] = v
    end
    return t, i
  end
  error(("collective: malformed encoding at byte %d"):format(i), 0)
end

--- The value of bytes made by encode.
function M.decode(s)
  local v, i = decode(s, 1)
  if i ~= #s + 1 then error(("collective: %d bytes left after the value"):format(#s + 1 - i), 0) end
  return v
end

-- ---- collectives -------------------------------------------------------------------------------

--- Collective. Every rank's value, as an array indexed by rank + 1 (rank 0's first).
function M.all_gather(value, label)
  local texts = core.all_gather_bytes(M.encode(value), label or "collective.all_gather")
  local out = {}
  for i, s in ipairs(texts) do out[i] = M.decode(s) end
  return out
end

--- Collective. Rank root's value on every rank (root defaults to 0; the other ranks' value is
--- not looked at). A string travels as its bytes.
function M.broadcast(value, root, label)
  root = root or 0
  local mine = core.rank() == root and M.encode(value) or nil
  return M.decode(core.broadcast_bytes(mine, root, label or "collective.broadcast"))
end

--- Collective. Compares value across ranks, together with whether this rank failed on its own
--- (err: nil, or its message). Returns nil when no rank failed and every rank holds the same
--- value; otherwise, the same on every rank:
---   {failed = R, err = <R's message>}                    R: the lowest rank that failed
---   {values = {by rank + 1}, differ = {ranks whose value differs from rank 0's}}
function M.compare(value, err, label)
  label = label or "collective.compare"
  local W = core.world_size()
  if W == 1 then return err ~= nil and { failed = 0, err = err } or nil end
  local h1, h2 = 0, 0
  local text
  if err == nil then
    text = M.encode(value)
    h1, h2 = core.bytes_digest(text)
  end
  local v = core.all_reduce({ err ~= nil and 1 or 0, h1, h2, -h1, -h2 }, "max", label)
  if v[1] > 0 then
    local r = core.all_reduce(err ~= nil and core.rank() or W, "min", label)
    return { failed = r, err = M.broadcast(err, r, label) }
  end
  if v[2] == -v[4] and v[3] == -v[5] then return nil end
  local texts = core.all_gather_bytes(text, label)
  local values, differ = {}, {}
  for i, s in ipairs(texts) do
    values[i] = M.decode(s)
    if s ~= texts[1] then differ[#differ + 1] = i - 1 end
  end
  return { values = values, differ = differ }
end

-- A readable rendering of a value for messages, cut at `max` bytes.
local function show(v, max)
  max = max or 200
  local s
  if type(v) == "string" then
    s = ("%q"):format(v):gsub("\\\n", "\\n")
  elseif type(v) == "table" then
    local keys, parts = {}, {}
    for k in pairs(v) do keys[#keys + 1] = k end
    table.sort(keys, key_less)
    local n = #v
    for _, k in ipairs(keys) do
      local is_index = type(k) == "number" and k >= 1 and k <= n and k == math.floor(k)
      parts[#parts + 1] = (is_index and "" or ("[%s] = "):format(show(k, max))) .. show(v[k], max)
      if #parts > 20 then parts[#parts + 1] = "..." break end
    end
    s = "{" .. table.concat(parts, ", ") .. "}"
  elseif type(v) == "number" then
    s = number_text(v)
  else
    s = tostring(v)
  end
  if #s > max then s = s:sub(1, max) .. "..." end
  return s
end
M.show = show

-- The first place where a and b differ: a path ("[3]", "[\"lr\"]") and the two values there.
local function first_difference(a, b, path)
  if type(a) ~= "table" or type(b) ~= "table" then return path, a, b end
  local keys, seen = {}, {}
  for k in pairs(a) do keys[#keys + 1] = k; seen[k] = true end
  for k in pairs(b) do if not seen[k] then keys[#keys + 1] = k end end
  table.sort(keys, key_less)
  for _, k in ipairs(keys) do
    if M.encode(a[k]) ~= M.encode(b[k]) then
      return first_difference(a[k], b[k], ("%s[%s]"):format(path, show(k)))
    end
  end
  return path, a, b
end

--- Collective. Every rank must hold the same value: returns it, or raises (on every rank)
--- "<what> differs across ranks[ at <where>]: rank 0 has <v>, rank R has <v> (ranks that differ
--- from rank 0: R, ...)", naming the first differing rank R and the first place in the value
--- where the two differ. err: this rank's error instead of a value (it could not make one):
--- then every rank raises "rank R of W: <R's message>", R the lowest rank with an error (at
--- world size 1: the error itself), so that no rank goes on alone.
function M.agree(value, what, label, err)
  if type(what) ~= "string" then util.raise("collective.agree: `what` must be a string naming the value") end
  -- sent without its positions (this rank's user line means nothing elsewhere)
  local d = M.compare(value, err ~= nil and util.message(err) or nil, label or what)
  if d == nil then return value end
  if d.failed then
    if core.world_size() == 1 then util.reraise(err) end
    util.raise(M.refusal(d))
  end
  util.raise(M.difference(d, what))
end

--- The message every rank raises for a result of compare in which a rank refused (d.failed):
--- "rank R of W: <R's message>", R the lowest refusing rank; its message alone at world size 1.
--- Local: every rank has the same d.
function M.refusal(d)
  local W = core.world_size()
  return (W > 1 and ("rank %d of %d: "):format(d.failed, W) or "") .. d.err
end

--- The message agree raises for a result of compare whose values differ (d.differ): "<what>
--- differs across ranks[ at <where>]: rank 0 has <v>, rank R has <v> (ranks that differ from
--- rank 0: R, ...)". Local: every rank has the same d, so every rank gets the same message.
function M.difference(d, what)
  local other = d.differ[1]
  local path, a, b = first_difference(d.values[1], d.values[other + 1], "")
  local ranks = {}
  for i, r in ipairs(d.differ) do ranks[i] = tostring(r) end
  return ("%s differs across ranks%s: rank 0 has %s, rank %d has %s (ranks that differ from "
    .. "rank 0: %s)"):format(what, path ~= "" and (" at " .. path) or "", show(a), other, show(b),
      table.concat(ranks, ", "))
end

-- ---- the library's checks --------------------------------------------------------------------

--- Collective. One agreement for a call `fn` about to act on every rank: compare(value, err)
--- (value: what every rank must hold alike, e.g. its arguments; err: this rank's own reason to
--- refuse, or nil). nil when every rank may go on; otherwise the same message on every rank:
---   "<fn>: rank R of W: <R's err>"      (the lowest refusing rank; "<fn>: <err>" at one rank)
---   "<fn>: <what> differs across ranks[ at <where>]: rank 0 has ..., rank R has ... (...)"
function M.check_agreement(fn, value, err, what, label)
  local d = M.compare(value, err, label or fn)
  if d == nil then return nil end
  if d.failed ~= nil then return fn .. ": " .. M.refusal(d) end
  return fn .. ": " .. M.difference(d, what)
end

--- Collective. Whether every rank's local phase succeeded (ok, err as pcall returned them):
--- nil when every rank passed ok, otherwise the same message on every rank, the lowest failing
--- rank's (its library positions dropped), marked "rank R of W: " when there are several ranks.
function M.check_outcome(ok, err, label)
  local W = core.world_size()
  local msg = nil
  if not ok then
    msg = util.strip(err)
    if W > 1 and #msg > 8000 then msg = msg:sub(1, 8000) .. "..." end
  end
  local d = M.compare(nil, msg, label or "collective.check_outcome")
  if d == nil then return nil end
  return M.refusal(d)
end

--- Collective. Compare `entries` (an array of strings each rank builds from its own state, in
--- an order that depends only on it) across ranks, together with this rank's local error `err`
--- (nil when its own checks passed). Returns nil when every rank succeeded with the same
--- entries; otherwise a message, the same on every rank except that a rank that failed gets
--- its own error back:
---   "<what> failed on rank R: <R's error>"
---   "<what>: <subject> differs across ranks (item k): rank 0 has <entry>, rank R has <entry>
---    (ranks that differ from rank 0 there: R, ...)"
--- opts.subject names what is compared ("the model"); opts.hint(a, b) may add a sentence for
--- a given pair of texts.
function M.check_lists(what, entries, err, opts)
  if core.world_size() == 1 then return err end
  local d = M.compare(entries, err, what)
  if d == nil then return nil end
  if d.failed then
    if err then return err end
    return ("%s failed on rank %d: %s"):format(what, d.failed, d.err)
  end
  -- the first item where some rank differs from rank 0, and the ranks that differ there
  local ref = d.values[1]
  local at, first = math.huge, {}
  for i = 2, #d.values do
    local mine = d.values[i]
    for k = 1, math.max(#mine, #ref) + 1 do
      if mine[k] ~= ref[k] then first[i - 1] = k break end
    end
    if first[i - 1] and first[i - 1] < at then at = first[i - 1] end
  end
  local differ = {}
  for r = 1, #d.values - 1 do
    if first[r] == at then differ[#differ + 1] = tostring(r) end
  end
  local other = tonumber(differ[1])
  local a, b = ref[at] or "nothing more", d.values[other + 1][at] or "nothing more"
  local subject = opts and opts.subject or "the state"
  local msg = ("%s: %s differs across ranks (item %d): rank 0 has %s, rank %d has %s (ranks "
    .. "that differ from rank 0 there: %s)"):format(what, subject, at, a, other, b,
      table.concat(differ, ", "))
  local extra = opts and opts.hint and opts.hint(a, b)
  if extra then msg = msg .. "; " .. extra end
  return msg
end

return M
