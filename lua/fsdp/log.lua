-- fsdp.log: training progress for humans (a progress line or plain lines) and for programs
-- (a JSONL file). docs/cli.md ("Logging") is the manual.
--
--   fsdp.log.setup{total =, every =, jsonl = "path", tokens_per_step =}   -- optional
--   fsdp.log(step, {loss = l, lr = lr, tokens = n})                      -- each step (or less)
--   fsdp.log.print(...)                                                  -- text, line kept
--   fsdp.log.finish()                                                    -- ends the line
--
-- Only rank 0 writes anything; the other ranks return at once, so calling fsdp.log on every
-- rank is right (it is not collective). On a terminal the line is redrawn in place ("\r" and
-- clear-to-end-of-line) at most 10 times a second; otherwise plain lines are printed at step 1,
-- every `every` steps and at the last step. Metric values may be numbers, booleans, strings or
-- 1-element tensors; the line shows the numeric ones (loss first, the rest by name), JSONL
-- holds them all.

local fsdp = require "fsdp"
local core = require "fsdp.core"

local log = {}

local S -- the state of the current run (reset by setup)

local function new_state(opts)
  return {
    total = opts.total, every = opts.every, tokens_per_step = opts.tokens_per_step,
    out = opts.out or io.stdout, tty = opts.tty, clock = opts.clock or core.clock,
    rank = opts.rank, jsonl = nil, jsonl_path = opts.jsonl,
    t0 = nil, last_step = nil, last_t = nil, sec_per_step = nil,
    line = nil, line_open = false, last_draw = -math.huge,
  }
end

local function my_rank() return S.rank or fsdp.rank() end

-- ---- JSON (numbers, strings, booleans, tables of those) -----------------------------------

local escapes = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f",
  ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t" }

local function json_string(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    return escapes[c] or ("\\u%04x"):format(c:byte())
  end) .. '"'
end

local function json_number(v)
  if v ~= v or v == math.huge or v == -math.huge then return "null" end
  if v % 1 == 0 and math.abs(v) < 2 ^ 53 then return ("%d"):format(v) end
  local s = ("%.15g"):format(v)
  if tonumber(s) ~= v then s = ("%.17g"):format(v) end
  return s
end

local json_value

local function json_table(t, depth)
  if depth > 16 then error("fsdp.log: table nested too deeply for JSON", 0) end
  local n = #t
  local keys, count = {}, 0
  for k in pairs(t) do
    count = count + 1
    if type(k) ~= "number" or k < 1 or k > n or k % 1 ~= 0 then keys[#keys + 1] = k end
  end
  local parts = {}
  if n > 0 and count == n then
    for i = 1, n do parts[i] = json_value(t[i], depth + 1) end
    return "[" .. table.concat(parts, ",") .. "]"
  end
  for k in pairs(t) do
    if type(k) == "number" and k >= 1 and k <= n and k % 1 == 0 then keys[#keys + 1] = k end
  end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  for i, k in ipairs(keys) do
    parts[i] = json_string(tostring(k)) .. ":" .. json_value(t[k], depth + 1)
  end
  return "{" .. table.concat(parts, ",") .. "}"
end

json_value = function(v, depth)
  local tv = type(v)
  if tv == "number" then return json_number(v)
  elseif tv == "string" then return json_string(v)
  elseif tv == "boolean" then return tostring(v)
  elseif tv == "nil" then return "null"
  elseif tv == "table" then return json_table(v, depth or 0)
  end
  return json_string(tostring(v))
end

--- Encode a Lua value as JSON text (exposed for tests and recipes).
function log.json(v) return json_value(v, 0) end

-- ---- formatting ---------------------------------------------------------------------------

local function fmt_num(v)
  if v % 1 == 0 and math.abs(v) < 1e9 then return ("%d"):format(v) end
  local a = math.abs(v)
  if a ~= 0 and (a < 1e-3 or a >= 1e5) then return ("%.3e"):format(v) end
  return ("%.4f"):format(v)
end

local function fmt_duration(s)
  s = math.max(0, math.floor(s + 0.5))
  if s < 60 then return ("%ds"):format(s) end
  if s < 3600 then return ("%dm%02ds"):format(math.floor(s / 60), s % 60) end
  return ("%dh%02dm"):format(math.floor(s / 3600), math.floor(s / 60) % 60)
end

-- Metric names in display order: loss first, then by name.
local function ordered_keys(m)
  local keys = {}
  for k in pairs(m) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b)
    if a == "loss" then return b ~= "loss" end
    if b == "loss" then return false end
    return tostring(a) < tostring(b)
  end)
  return keys
end

-- Copy of metrics with 1-element tensors turned into numbers.
local function plain_metrics(metrics)
  local m = {}
  for k, v in pairs(metrics) do
    if type(v) == "userdata" and v.item then v = v:item() end
    m[k] = v
  end
  return m
end

--- The progress text for one step (no "\r", no newline).
function log.format(step, m, total, tokens_per_sec, eta, elapsed)
  local parts = { total and ("step %d/%d"):format(step, total) or ("step %d"):format(step) }
  for _, k in ipairs(ordered_keys(m)) do
    local v = m[k]
    if type(v) == "number" and k ~= "tokens" then parts[#parts + 1] = k .. " " .. fmt_num(v) end
  end
  if tokens_per_sec then parts[#parts + 1] = ("%d tok/s"):format(math.floor(tokens_per_sec + 0.5)) end
  if eta then parts[#parts + 1] = "ETA " .. fmt_duration(eta) end
  if elapsed then parts[#parts + 1] = "elapsed " .. fmt_duration(elapsed) end
  return table.concat(parts, " | ")
end

-- ---- output -------------------------------------------------------------------------------

local function is_tty()
  if S.tty == nil then S.tty = S.out == io.stdout and core.isatty(1) end
  return S.tty
end

local function draw(text)
  S.out:write("\r\27[K", text)
  S.out:flush()
  S.line, S.line_open = text, true
end

--- Start a run: forget the previous one (closing its JSONL file) and set its options:
--- total (steps, for "step i/total" and ETA), every (plain-line period), jsonl (path of a
--- metrics file, truncated unless append = true: a resumed run continues its file),
--- tokens_per_step (throughput when metrics.tokens is absent).
--- For tests and hosts: out (a file handle, default io.stdout), tty (force the mode), clock
--- (a function returning seconds), rank (instead of fsdp.rank()).
function log.setup(opts)
  opts = opts or {}
  if type(opts) ~= "table" then error("fsdp.log.setup: expected an options table", 2) end
  for _, k in ipairs { "total", "every", "tokens_per_step" } do
    local v = opts[k]
    if v ~= nil and (type(v) ~= "number" or v <= 0) then
      error(("fsdp.log.setup: %s must be a positive number, got %s"):format(k, tostring(v)), 2)
    end
  end
  if S then log.finish() end
  S = new_state(opts)
  if opts.jsonl and my_rank() == 0 then
    local f, err = io.open(opts.jsonl, opts.append and "a" or "w")
    if not f then error("fsdp.log.setup: cannot open the JSONL file: " .. err, 2) end
    S.jsonl = f
  end
  S.t0 = S.clock()
  return log
end

local function every()
  if S.every then return S.every end
  if S.total then return math.max(1, math.ceil(S.total / 20)) end
  return 10
end

--- Log step `step` with a table of metrics. Rank 0 only; not collective.
local function call(_, step, metrics)
  if type(step) ~= "number" then
    error("fsdp.log: step must be a number, got " .. type(step), 2)
  end
  if metrics ~= nil and type(metrics) ~= "table" then
    error("fsdp.log: metrics must be a table, got " .. type(metrics), 2)
  end
  if not S then S = new_state {}; S.t0 = S.clock() end
  if my_rank() ~= 0 then return end
  local m = plain_metrics(metrics or {})
  local now = S.clock()
  if S.last_step and step > S.last_step then
    local dt = (now - S.last_t) / (step - S.last_step)
    S.sec_per_step = S.sec_per_step and (0.8 * S.sec_per_step + 0.2 * dt) or dt
  end
  S.last_step, S.last_t = step, now

  if S.jsonl then
    local parts = { '"step":' .. json_number(step), '"time":' .. json_number(now - S.t0) }
    for _, k in ipairs(ordered_keys(m)) do
      if k ~= "step" and k ~= "time" then
        parts[#parts + 1] = json_string(tostring(k)) .. ":" .. json_value(m[k], 1)
      end
    end
    S.jsonl:write("{", table.concat(parts, ","), "}\n")
    S.jsonl:flush()
  end

  local sps = S.sec_per_step
  local tokens = type(m.tokens) == "number" and m.tokens or S.tokens_per_step
  local tps = (tokens and sps and sps > 0) and tokens / sps or nil
  local last = S.total and step >= S.total
  local eta = (S.total and sps and not last) and (S.total - step) * sps or nil
  local elapsed = last and now - S.t0 or nil
  if is_tty() then
    if last or now - S.last_draw >= 0.1 then
      draw(log.format(step, m, S.total, tps, eta, elapsed))
      S.last_draw = now
    end
  elseif step == 1 or step % every() == 0 or last then
    S.out:write(log.format(step, m, S.total, tps, eta, elapsed), "\n")
    S.out:flush()
  end
end

--- Print text (like print) on rank 0 without breaking the progress line: the line is cleared,
--- the text printed, and the line drawn again below it.
function log.print(...)
  if not S then S = new_state {}; S.t0 = S.clock() end
  if my_rank() ~= 0 then return end
  local n = select("#", ...)
  local parts = {}
  for i = 1, n do parts[i] = tostring((select(i, ...))) end
  local text = table.concat(parts, "\t")
  if S.line_open then
    S.out:write("\r\27[K", text, "\n")
    draw(S.line)
  else
    S.out:write(text, "\n")
    S.out:flush()
  end
end

--- End the run's output: finish the progress line with a newline and close the JSONL file.
function log.finish()
  if not S then return end
  if S.line_open then
    S.out:write("\n")
    S.out:flush()
    S.line_open = false
  end
  if S.jsonl then
    S.jsonl:close()
    S.jsonl = nil
  end
end

return setmetatable(log, { __call = call })
