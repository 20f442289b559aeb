-- fsdp.log: training progress for humans (a progress bar or plain lines) and for programs
-- (a JSONL file). docs/cli.md ("Logging") is the manual.
--
--   fsdp.log.setup{total =, every =, jsonl = "path", append =, progress =, tokens_per_step =}
--   fsdp.log(step, {loss = l, lr = lr, tokens = n})                      -- each step (or less)
--   fsdp.log.print(...)                                                  -- text, bar kept
--   fsdp.log.finish()                                                    -- ends the bar
--
-- Only rank 0 writes anything; the other ranks return at once, so calling fsdp.log on every
-- rank is right (it is not collective). progress = "bar" redraws one line in place ("\r" and
-- clear-to-end-of-line) at most 10 times a second; "line" prints plain lines at step 1, every
-- `every` steps and at the last step; "off" prints none; "auto" (the default, or
-- FSDP_PROGRESS, which `fsdprun --progress` sets) is "bar" when standard output is a
-- terminal, else "line". A step that carries a metric the previous call did not (val_loss
-- every 250 steps) is always shown and its line stays. Metric values may be numbers,
-- booleans, strings, tables or 1-element tensors; the line shows the numeric ones (loss
-- first, the rest by name), JSONL holds them all.

local core = require "fsdp.core"

local log = {}

local PROGRESS = { auto = true, off = true, line = true, bar = true }
local SETUP_KEYS = { "total", "every", "jsonl", "append", "progress", "tokens_per_step", "out",
  "clock", "rank" }

local S -- the state of the current run (reset by setup)

local function new_state(opts)
  return {
    total = opts.total, every = opts.every, tokens_per_step = opts.tokens_per_step,
    out = opts.out or io.stdout, progress = opts.progress, clock = opts.clock or core.clock,
    rank = opts.rank, jsonl = nil,
    t0 = nil, last_step = nil, last_t = nil, sec_per_step = nil, shown = nil,
    line = nil, line_open = false, line_keys = nil, keep = false, last_draw = -math.huge,
  }
end

local function my_rank() return S.rank or core.rank() end

-- ---- JSON ---------------------------------------------------------------------------------

-- Metrics are written with the engine's codec (fsdp.core.json_encode, cJSON): numbers exactly,
-- NaN and infinities as the strings "NaN", "Infinity", "-Infinity" (JSON has no such
-- numbers; fsdp.plot and json_decode{nonfinite = true} read them back as numbers).
local JSONL = { nonfinite = "string", first = { "step", "time", "loss" } }

--- Encode a Lua value as JSON text, as the JSONL lines are.
function log.json(v) return core.json_encode(v, JSONL) end

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

-- The metrics the line shows: numeric ones but `tokens`, as a set.
local function shown_keys(m)
  local set = {}
  for k, v in pairs(m) do
    if type(v) == "number" and k ~= "tokens" then set[k] = true end
  end
  return set
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

-- "bar", "line" or "off": the mode asked for, "auto" resolved by the output's kind.
local function mode()
  if S.progress == "auto" then
    S.progress = S.out == io.stdout and core.isatty(1) and "bar" or "line"
  end
  return S.progress
end

-- Draw the bar. The line it replaces is cleared, unless it is kept (it showed a metric this
-- one lacks): then the new line starts below it.
local function draw(text, keys, keep)
  if S.line_open and S.keep then S.out:write("\n") end
  S.out:write("\r\27[K", text)
  S.out:flush()
  S.line, S.line_open, S.line_keys, S.keep = text, true, keys, keep
end

-- Whether the open bar shows a metric that `keys` lacks.
local function loses(keys)
  for k in pairs(S.line_keys or {}) do if not keys[k] then return true end end
  return false
end

-- FSDP_PROGRESS (fsdprun --progress sets it): nil when unset or empty, else one of PROGRESS;
-- another value is an error naming `fn`, raised at `level` as error() counts from the caller.
local function env_progress(fn, level)
  local progress = os.getenv("FSDP_PROGRESS")
  if progress == "" then return nil end
  if progress ~= nil and not PROGRESS[progress] then
    error(("%s: FSDP_PROGRESS must be auto, bar, line or off, got '%s'"):format(fn, progress),
      level)
  end
  return progress
end

--- Start a run: forget the previous one (closing its JSONL file) and set its options:
--- total (steps, for "step i/total" and ETA), every (plain-line period), jsonl (path of a
--- metrics file: its folder is made, and the file truncated unless append = true, which
--- continues it, as a resumed run must), tokens_per_step (throughput when metrics.tokens is
--- absent), progress ("auto" | "bar" | "line" | "off"; default FSDP_PROGRESS, else "auto").
--- For tests and hosts: out (a file handle, default io.stdout), clock (a function returning
--- seconds), rank (instead of fsdp.rank()).
function log.setup(opts)
  opts = opts or {}
  if type(opts) ~= "table" then error("fsdp.log.setup: expected an options table", 2) end
  for k in pairs(opts) do
    local known = false
    for _, v in ipairs(SETUP_KEYS) do known = known or k == v end
    if not known then
      error(("fsdp.log.setup: unknown option '%s' (valid: %s)"):format(tostring(k),
        table.concat(SETUP_KEYS, ", ")), 2)
    end
  end
  for _, k in ipairs { "total", "every", "tokens_per_step" } do
    local v = opts[k]
    if v ~= nil and (type(v) ~= "number" or v <= 0) then
      error(("fsdp.log.setup: %s must be a positive number, got %s"):format(k, tostring(v)), 2)
    end
  end
  local progress = opts.progress
  if progress == nil then
    progress = env_progress("fsdp.log.setup", 3)
  elseif not PROGRESS[progress] then
    error(("fsdp.log.setup: progress must be \"auto\", \"bar\", \"line\" or \"off\", got %s")
      :format(tostring(progress)), 2)
  end
  if S then log.finish() end
  S = new_state(opts)
  S.progress = progress or "auto"
  if opts.jsonl and my_rank() == 0 then
    local dir = opts.jsonl:match("^(.*)/[^/]*$")
    if dir and dir ~= "" then
      local ok, err = pcall(core.io_mkdirs, dir)
      if not ok then error("fsdp.log.setup: cannot make the JSONL file's folder: " .. err, 2) end
    end
    local f, err = io.open(opts.jsonl, opts.append and "a+" or "w")
    if not f then error("fsdp.log.setup: cannot open the JSONL file: " .. err, 2) end
    if opts.append then
      -- a run killed while writing leaves its last record cut short: the resumed run's first
      -- record starts a line of its own instead of finishing that one
      local size = f:seek("end")
      if size and size > 0 then
        f:seek("set", size - 1)
        local last = f:read(1)
        f:seek("end")
        if last ~= "\n" then f:write("\n") end
      end
    end
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

-- A run without setup takes its mode from the environment as setup would, and refuses a bad
-- one the same way (a typo in FSDP_PROGRESS must not quietly become "auto"). `fn` is the
-- function the user called; the error points at the user's call.
local function default_state(fn)
  if not S then
    local progress = env_progress(fn, 4)
    S = new_state {}
    S.progress = progress or "auto"
    S.t0 = S.clock()
  end
end

--- Log step `step` with a table of metrics. Rank 0 only; not collective.
local function call(_, step, metrics)
  if type(step) ~= "number" then
    error("fsdp.log: step must be a number, got " .. type(step), 2)
  end
  if metrics ~= nil and type(metrics) ~= "table" then
    error("fsdp.log: metrics must be a table, got " .. type(metrics), 2)
  end
  default_state("fsdp.log")
  if my_rank() ~= 0 then return end
  local m = plain_metrics(metrics or {})
  local now = S.clock()
  if S.last_step and step > S.last_step then
    local dt = (now - S.last_t) / (step - S.last_step)
    S.sec_per_step = S.sec_per_step and (0.8 * S.sec_per_step + 0.2 * dt) or dt
  end
  S.last_step, S.last_t = step, now

  if S.jsonl then
    local rec = {}
    for k, v in pairs(m) do rec[k] = v end
    rec.step, rec.time = step, now - S.t0
    S.jsonl:write(log.json(rec), "\n")
    S.jsonl:flush()
  end

  -- a metric the previous call lacked (a validation loss every N steps): shown whatever the
  -- cadence, on a line that stays
  local keys = shown_keys(m)
  local new = false
  if S.shown then
    for k in pairs(keys) do if not S.shown[k] then new = true end end
  end
  S.shown = keys

  local sps = S.sec_per_step
  local tokens = type(m.tokens) == "number" and m.tokens or S.tokens_per_step
  local tps = (tokens and sps and sps > 0) and tokens / sps or nil
  local last = S.total and step >= S.total
  local eta = (S.total and sps and not last) and (S.total - step) * sps or nil
  local elapsed = last and now - S.t0 or nil
  local how = mode()
  if how == "bar" then
    if new or last or now - S.last_draw >= 0.1 or (S.line_open and loses(keys)) then
      if S.line_open and not S.keep and loses(keys) then S.keep = true end
      draw(log.format(step, m, S.total, tps, eta, elapsed), keys, new)
      S.last_draw = now
    end
  elseif how == "line" and (new or step == 1 or step % every() == 0 or last) then
    S.out:write(log.format(step, m, S.total, tps, eta, elapsed), "\n")
    S.out:flush()
  end
end

--- Print text (like print) on rank 0 without breaking the bar: the bar is cleared, the text
--- printed, and the bar drawn again below it (a kept line stays, and the next step draws).
function log.print(...)
  default_state("fsdp.log.print")
  if my_rank() ~= 0 then return end
  local n = select("#", ...)
  local parts = {}
  for i = 1, n do parts[i] = tostring((select(i, ...))) end
  local text = table.concat(parts, "\t")
  if S.line_open and S.keep then
    S.out:write("\n", text, "\n")
    S.out:flush()
    S.line_open, S.line_keys, S.keep = false, nil, false
  elseif S.line_open then
    S.out:write("\r\27[K", text, "\n")
    draw(S.line, S.line_keys, false)
  else
    S.out:write(text, "\n")
    S.out:flush()
  end
end

--- End the run's output: finish the bar with a newline and close the JSONL file.
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
