-- fsdp.plot: training curves from a JSONL metrics file (the one fsdp.log.setup{jsonl =}
-- writes) drawn as a standalone SVG, in Lua with the engine's JSON codec: no Python, no
-- gnuplot; it runs inside fsdprun and under plain `luajit` (with fsdp/core.so on LUA_CPATH).
-- docs/plots.md is the manual.
--
--   fsdp.plot.svg(path_or_records, opts) -> svg text, problems
--   fsdp.plot.write(jsonl_path, svg_path, opts) -> svg_path, problems
--   fsdp.plot.read(path) -> records, problems          (parse(text, name) for a string)
--   fsdp.plot.decode(line) -> record | nil, message, column
--   fsdp.plot.metrics(records) -> the names of the metrics that hold numbers, in file order
--   fsdp.plot.main(args, env)     -- `fsdprun plot metrics.jsonl -o loss.svg [--title=...]`
--   fsdp.plot.command(args, env)  -- main, errors printed: returns the exit status
--
-- Every numeric metric is drawn (step and time are the axes; tokens, a constant, only when
-- asked for), top to bottom, only when it has at least one finite value: one "loss" panel
-- for `loss` and every metric named *loss (val_loss), then one panel per other metric, lr
-- first, the rest in the order the file first shows them. They share the horizontal axis
-- (step, or time). A record is one flat JSON object; NaN and infinities (strings "NaN",
-- "Infinity", "-Infinity" as fsdp.log writes them, or the bare words) decode to numbers and
-- JSON null to plot.null, so such a value is counted as skipped, not missing. Malformed lines
-- are skipped and reported as "name:line:column: message" in `problems`.
--
-- Long series are reduced to the lowest and highest point of each pixel column (in their
-- original order), which draws the same picture and bounds a series at two points per column.

local core = require "fsdp.core"
local util = require "fsdp.util"

local plot = {}

-- ---- JSON lines ---------------------------------------------------------------------------

--- The value JSON null decodes to (a metric that was NaN/inf, or absent on purpose).
plot.null = setmetatable({}, { __tostring = function() return "null" end })

-- Lines are decoded by the engine's codec (cJSON); NaN and infinities come back as numbers,
-- whether written as the strings fsdp.log writes or as the bare words of other writers.
local DECODE = { nonfinite = true, null = plot.null, raise = false }

--- Decode one line holding one JSON object. Returns the table, or nil, a message and the
--- 1-based column where it went wrong. Values: numbers (NaN and infinities included),
--- strings, booleans, plot.null, and (decoded but not plotted) arrays and objects.
function plot.decode(line)
  if type(line) ~= "string" then error("fsdp.plot.decode: expected a string", 2) end
  local p = line:find("[^ \t\r\n]") or #line + 1
  if line:sub(p, p) ~= "{" then return nil, "expected a JSON object ('{')", p end
  local rec, msg, _, col = core.json_decode(line, "line", DECODE)
  if rec ~= nil then return rec end
  return nil, msg:match("%((unexpected[^()]*)%)$") or msg:match("unexpected text after the document")
    or "not valid JSON", col
end

-- Feed lines from an iterator; blank lines are skipped, malformed ones reported.
local function read_lines(iter, name)
  local records, problems = {}, {}
  local n = 0
  for line in iter do
    n = n + 1
    if line:find("[^ \t\r\n]") then
      local rec, msg, col = plot.decode(line)
      if rec then
        records[#records + 1] = rec
      else
        problems[#problems + 1] = ("%s:%d:%d: %s"):format(name, n, col, msg)
      end
    end
  end
  return records, problems
end

--- Decode JSONL text. Returns the records (in file order) and the list of problems, one
--- string "name:line:column: message" per skipped line.
function plot.parse(text, name)
  if type(text) ~= "string" then error("fsdp.plot.parse: expected a string", 2) end
  if text ~= "" and text:sub(-1) ~= "\n" then text = text .. "\n" end
  return read_lines(text:gmatch("([^\n]*)\n"), name or "(string)")
end

--- Read a JSONL file ("-" is standard input). Raises an error when it cannot be opened.
function plot.read(path)
  if type(path) ~= "string" then error("fsdp.plot.read: expected a path", 2) end
  if path == "-" then return read_lines(io.stdin:lines(), "(stdin)") end
  local f, err = io.open(path, "rb")
  if not f then error("cannot open " .. err, 0) end
  local text = f:read("*a")
  f:close()
  if not text then error("cannot read " .. path, 0) end
  return plot.parse(text, path)
end

-- ---- numbers and text ---------------------------------------------------------------------

-- Finite and small enough that differences of two values cannot overflow (|v| < 1e300);
-- anything else is skipped like NaN.
local function finite(v) return type(v) == "number" and v > -1e300 and v < 1e300 end

local function log10(v) return math.log10(v) end

--- Escape text for XML character data and attribute values; drops the control characters
--- XML 1.0 does not allow (tab and newline are kept).
function plot.escape(s)
  s = tostring(s):gsub("[%z\1-\8\11\12\14-\31\127]", "")
  return (s:gsub("[&<>\"']", { ["&"] = "&amp;", ["<"] = "&lt;", [">"] = "&gt;",
    ['"'] = "&quot;", ["'"] = "&apos;" }))
end
local esc = plot.escape

-- "1.5e-04" -> "1.5e-4", "1e+05" -> "1e5"
local function tidy_exp(s)
  return (s:gsub("e([-+])0*(%d)", function(sign, d) return "e" .. (sign == "-" and "-" or "") .. d end))
end

-- A value in scientific form with as many mantissa digits as `prec` (a step) asks for.
local function fmt_sci(v, prec)
  local d = math.floor(log10(math.abs(v))) - math.floor(log10(prec) + 1e-9)
  d = math.max(0, math.min(6, d))
  return tidy_exp(("%." .. d .. "e"):format(v))
end

--- Labels for evenly spaced ticks `values` (step apart): one style for the whole axis,
--- fixed-point when it stays short, scientific otherwise.
function plot.format_ticks(values, step)
  local maxabs = 0
  for _, v in ipairs(values) do maxabs = math.max(maxabs, math.abs(v)) end
  local decimals = math.max(0, -math.floor(log10(step) + 1e-9)) + 0 -- (+ 0: no "-0")
  local fixed = maxabs < 1e6 and (decimals <= 4 or (decimals <= 6 and maxabs >= 1e-3))
  local out = {}
  for i, v in ipairs(values) do
    if math.abs(v) < step * 1e-6 then out[i] = "0"
    elseif fixed then out[i] = ("%." .. decimals .. "f"):format(v)
    else out[i] = fmt_sci(v, step) end
  end
  return out
end

-- A label for one value on a log axis (1, 2 or 5 times a power of ten, or any).
local function fmt_log_tick(v)
  if v >= 1e-3 and v < 1e5 then
    local d = math.max(0, -math.floor(log10(v) + 1e-9)) + 0 -- (+ 0: no "-0")
    local s = ("%." .. d .. "f"):format(v)
    return s
  end
  return fmt_sci(v, v)
end

-- A short readable value for legends.
local function fmt_value(v)
  local a = math.abs(v)
  if v == 0 then return "0" end
  if v % 1 == 0 and a < 1e9 then return ("%d"):format(v) end
  if a >= 1e-3 and a < 1e5 then
    local s = ("%.4g"):format(v)
    if s:find("e") then s = ("%.1f"):format(v) end
    return s
  end
  return tidy_exp(("%.3g"):format(v))
end

-- 1, 2, 5 or 10 times a power of ten, near x (rounded) or at least x (not rounded).
local function nice_num(x, round)
  local e = math.floor(log10(x))
  local f = x / 10 ^ e
  local nf
  if round then
    nf = f < 1.5 and 1 or f < 3 and 2 or f < 7 and 5 or 10
  else
    nf = f <= 1 and 1 or f <= 2 and 2 or f <= 5 and 5 or 10
  end
  return nf * 10 ^ e
end

--- Nice linear ticks (1, 2 or 5 times a power of ten apart, about n of them) for the range
--- [lo, hi], at least min_step apart if given. With `snap` the range widens to whole steps;
--- otherwise it stays and only the ticks inside it are returned. Returns the axis range, the step and the tick values.
function plot.linear_ticks(lo, hi, n, snap, min_step)
  n = n or 5
  if not (hi > lo) then error("fsdp.plot.linear_ticks: empty range", 2) end
  local step = nice_num((hi - lo) / math.max(1, n - 1), true)
  if min_step and step < min_step then step = min_step end
  local k0, k1
  if snap then
    k0, k1 = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    lo, hi = k0 * step, k1 * step
  else
    k0, k1 = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
  end
  local ticks = {}
  if k1 - k0 <= 1000 then -- else rounding ate the range (values near the double limits)
    for k = k0, k1 do ticks[#ticks + 1] = k * step end
  end
  return lo, hi, step, ticks
end

--- Ticks for a log axis over [lo, hi] (both > 0): powers of ten, or 1-2-5 multiples, or
--- every multiple, whichever first gives at least three inside; decades are thinned when
--- there are more than `n`. Returns the tick values.
function plot.log_ticks(lo, hi, n)
  n = n or 8
  if not (lo > 0 and hi >= lo and hi < math.huge) then
    error("fsdp.plot.log_ticks: needs 0 < lo <= hi < inf", 2)
  end
  local e0, e1 = math.floor(log10(lo)), math.ceil(log10(hi))
  local best = {}
  for _, set in ipairs { { 1 }, { 1, 2, 5 }, { 1, 2, 3, 4, 5, 6, 7, 8, 9 } } do
    local ticks = {}
    local every = math.max(1, math.ceil((e1 - e0 + 1) / n))
    for e = e0, e1 do
      if #set > 1 or (e - e0) % every == 0 then
        for _, m in ipairs(set) do
          local v = tonumber(("%.12g"):format(m * 10 ^ e))
          if v >= lo * (1 - 1e-12) and v <= hi * (1 + 1e-12) then ticks[#ticks + 1] = v end
        end
      end
    end
    best = ticks
    if #ticks >= 3 then break end
  end
  return best
end

-- ---- series -------------------------------------------------------------------------------

-- Colours: the tab10 palette; the usual metrics keep theirs, the others take the rest in turn.
local COLORS = { loss = "#1f77b4", val_loss = "#d62728", lr = "#2ca02c", sparsity = "#9467bd" }
local PALETTE = { "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f",
  "#1f77b4", "#d62728", "#2ca02c", "#9467bd" }
local LABELS = { lr = "learning rate" }
-- Not metrics: the axes; and tokens (per step, a constant), drawn only when asked for.
local AXES = { step = true, time = true }

--- The names of the metrics in `records` that hold a number (finite or not) on some line, in
--- the order the lines first show them (names within a line sorted): step and time excepted.
function plot.metrics(records)
  local names, seen = {}, {}
  for _, r in ipairs(records) do
    local fresh = {}
    for k, v in pairs(r) do
      if type(k) == "string" and not seen[k] and not AXES[k] and type(v) == "number" then
        fresh[#fresh + 1] = k
        seen[k] = true
      end
    end
    table.sort(fresh)
    for _, k in ipairs(fresh) do names[#names + 1] = k end
  end
  return names
end

local function is_loss(name) return name == "loss" or name:sub(-4) == "loss" end

-- Panels in drawing order for the metrics `names`: {id, label, keys, log}.
local function panel_specs(names)
  local loss, lr, rest = {}, nil, {}
  for _, k in ipairs(names) do
    if is_loss(k) then loss[#loss + 1] = k
    elseif k == "lr" then lr = k
    else rest[#rest + 1] = k end
  end
  table.sort(loss, function(a, b) -- loss first, then the others by name
    if a == "loss" or b == "loss" then return a == "loss" and b ~= "loss" end
    return a < b
  end)
  local specs = {}
  if #loss > 0 then specs[1] = { id = "loss", label = "loss", keys = loss, log = true } end
  if lr then table.insert(rest, 1, lr) end
  for _, k in ipairs(rest) do specs[#specs + 1] = { id = k, label = LABELS[k] or k, keys = { k } } end
  return specs
end

-- The points of metric `key` against `xkey`: sorted by x (file order within equal x), with
-- the count of values that were present but not finite (NaN, inf, null, non-numbers).
local function extract(records, key, xkey)
  local pts, skipped = {}, 0
  for i, r in ipairs(records) do
    local y = r[key]
    if y ~= nil then
      local x = r[xkey]
      if x == nil and xkey == "step" then x = i end
      if finite(y) and finite(x) then
        pts[#pts + 1] = { x, y, i }
      else
        skipped = skipped + 1
      end
    end
  end
  table.sort(pts, function(a, b)
    if a[1] ~= b[1] then return a[1] < b[1] end
    return a[3] < b[3]
  end)
  return pts, skipped
end

--- Keep, per pixel column, the lowest and the highest point (in their order), plus the first
--- and last point of the series. `col(x)` gives the column. Returns a new list.
function plot.downsample(pts, col)
  if #pts <= 2 then return pts end
  local out = { pts[1] }
  local i, n = 2, #pts - 1
  while i <= n do
    local c = col(pts[i][1])
    local lo, hi = i, i
    local j = i + 1
    while j <= n and col(pts[j][1]) == c do
      if pts[j][2] < pts[lo][2] then lo = j end
      if pts[j][2] > pts[hi][2] then hi = j end
      j = j + 1
    end
    if lo == hi then
      out[#out + 1] = pts[lo]
    else
      out[#out + 1] = pts[math.min(lo, hi)]
      out[#out + 1] = pts[math.max(lo, hi)]
    end
    i = j
  end
  out[#out + 1] = pts[#pts]
  return out
end

-- ---- drawing ------------------------------------------------------------------------------

local function num(v) -- a coordinate: one decimal, no "-0.0"
  local s = ("%.1f"):format(v)
  if s == "-0.0" then s = "0.0" end
  return s
end

-- Axis mapping for values in [lo, hi] onto pixels [p0, p1] (p1 < p0 for y), linear or log10.
local function scale(lo, hi, p0, p1, log)
  if log then lo, hi = log10(lo), log10(hi) end
  local k = (p1 - p0) / (hi - lo)
  local pmin, pmax = math.min(p0, p1), math.max(p0, p1)
  return function(v)
    if log then v = log10(v) end
    local p = p0 + (v - lo) * k
    return math.max(pmin, math.min(pmax, p))
  end
end

-- Range of values over several series; nil when there are none.
local function range_of(list, index)
  local lo, hi = math.huge, -math.huge
  for _, pts in ipairs(list) do
    for _, p in ipairs(pts) do
      local v = p[index]
      if v < lo then lo = v end
      if v > hi then hi = v end
    end
  end
  if lo > hi then return nil end
  return lo, hi
end

-- Widen an empty or tiny range so that it has some height.
local function widen(lo, hi, minpad)
  if hi - lo <= math.max(math.abs(lo), math.abs(hi)) * 1e-9 then
    local pad = math.abs(lo) * 0.1
    if pad == 0 or (minpad and pad < minpad) then pad = minpad or 1 end
    return lo - pad, hi + pad
  end
  return lo, hi
end

-- Text cut to at most n characters (UTF-8 aware), ending in an ellipsis when cut: the SVG
-- cannot measure text, so lengths are estimated from the font size.
local function fit(text, n)
  n = math.max(2, math.floor(n + 1e-6))
  local chars = 0
  for i = 1, #text do
    local b = text:byte(i)
    if b < 0x80 or b >= 0xC0 then
      chars = chars + 1
      if chars == n then -- the n-th character starts here: cut before it if more follow
        local rest = text:sub(i):gsub("^[%z\1-\127\192-\255][\128-\191]*", "", 1)
        if rest == "" then return text end
        return text:sub(1, i - 1) .. "\226\128\166"
      end
    end
  end
  return text
end

local function basename(path) return (tostring(path):match("([^/]*)$")) end

-- How much of the polylines `drawn` (lists of pixel points) fall inside a rectangle:
-- each segment is sampled every few pixels.
local function ink_inside(drawn, x0, y0, x1, y1)
  local count = 0
  local function inside(x, y) return x >= x0 and x <= x1 and y >= y0 and y <= y1 end
  for _, pix in ipairs(drawn) do
    for i = 1, #pix do
      local a = pix[i]
      if inside(a[1], a[2]) then count = count + 1 end
      local b = pix[i + 1]
      if b then
        local len = math.max(math.abs(b[1] - a[1]), math.abs(b[2] - a[2]))
        local k = math.min(200, math.floor(len / 4))
        for j = 1, k - 1 do
          local t = j / k
          if inside(a[1] + t * (b[1] - a[1]), a[2] + t * (b[2] - a[2])) then count = count + 1 end
        end
      end
    end
  end
  return count
end

-- The top-left corner of a w x h legend inside the panel at (L, top) of size pw x ph.
local function place_legend(drawn, w, h, L, top, pw, ph)
  local m = 6
  local corners = {
    { L + pw - w - m, top + m }, { L + m, top + m },
    { L + pw - w - m, top + ph - h - m }, { L + m, top + ph - h - m },
  }
  local best, best_ink
  for _, c in ipairs(corners) do
    local ink = ink_inside(drawn, c[1] - 2, c[2] - 2, c[1] + w + 2, c[2] + h + 2)
    if not best_ink or ink < best_ink then best, best_ink = c, ink end
  end
  return best[1], best[2]
end

local defaults = {
  width = 800, loss_height = 300, panel_height = 150,
  left = 80, right = 24, title_h = 56, gap = 34, bottom = 44,
}

--- Draw the SVG. `source` is a JSONL path or a list of records (tables of metrics with
--- step and time). Options: title, x ("step" | "time"), metrics (a list of the metric names
--- to draw, in place of every one but tokens; a name the records lack is an error), log
--- (true | false | nil for auto: log when the loss spans more than 10x), width, loss_height,
--- panel_height, name (shown under the title). Returns the SVG text and the list of problems
--- met while reading. Raises an error when there is nothing to draw.
function plot.svg(source, opts)
  opts = util.check_opts("fsdp.plot.svg", opts,
    {"title", "x", "metrics", "log", "width", "loss_height", "panel_height", "name"})
  for _, k in ipairs {"loss_height", "panel_height"} do
    local v = opts[k]
    if v ~= nil and (type(v) ~= "number" or v < 50 or v > 10000) then
      error(("fsdp.plot.svg: %s must be a number in [50, 10000], got %s"):format(k, tostring(v)), 2)
    end
  end
  local records, problems, name
  if type(source) == "string" then
    records, problems = plot.read(source)
    name = source == "-" and "(stdin)" or source
  elseif type(source) == "table" then
    records, problems = source, {}
  else
    error("fsdp.plot.svg: expected a JSONL path or a list of records, got " .. type(source), 2)
  end
  name = opts.name or name
  local xkey = opts.x or "step"
  if xkey ~= "step" and xkey ~= "time" then
    error("fsdp.plot.svg: x must be \"step\" or \"time\", got " .. tostring(xkey), 2)
  end
  local W = opts.width or defaults.width
  if type(W) ~= "number" or W < 200 or W > 10000 then
    error("fsdp.plot.svg: width must be a number in [200, 10000]", 2)
  end
  local L, R = defaults.left, defaults.right
  local plot_w = W - L - R

  -- the metrics and their colours
  local names = plot.metrics(records)
  if opts.metrics ~= nil then
    if type(opts.metrics) ~= "table" then error("fsdp.plot.svg: metrics must be a list of names", 2) end
    local have = {}
    for _, k in ipairs(names) do have[k] = true end
    for _, k in ipairs(opts.metrics) do
      if not have[k] then
        error(("no metric '%s' in the records (those with numbers: %s)"):format(tostring(k),
          #names > 0 and table.concat(names, ", ") or "none"), 0)
      end
    end
    names = opts.metrics
  else
    local kept = {}
    for _, k in ipairs(names) do if k ~= "tokens" then kept[#kept + 1] = k end end
    names = kept
  end
  local colors, next_color = {}, 0
  for _, k in ipairs(names) do
    colors[k] = COLORS[k]
    if not colors[k] then
      next_color = next_color + 1
      colors[k] = PALETTE[(next_color - 1) % #PALETTE + 1]
    end
  end

  -- the series of each panel; panels without any point are left out
  local panels = {}
  for _, spec in ipairs(panel_specs(names)) do
    local series = {}
    for _, key in ipairs(spec.keys) do
      local pts, skipped = extract(records, key, xkey)
      if #pts > 0 then
        series[#series + 1] = { key = key, pts = pts, skipped = skipped, n = #pts }
      end
    end
    if #series > 0 then panels[#panels + 1] = { spec = spec, series = series } end
  end
  if #panels == 0 and xkey == "time" then
    local any = false
    for _, r in ipairs(records) do if finite(r.time) then any = true break end end
    if not any then error("no time values for the horizontal axis (try x = \"step\")", 0) end
  end
  if #panels == 0 then
    error(("no metrics to plot (%d records%s): no line holds a finite number besides step%s")
      :format(#records, #problems > 0 and (", %d malformed lines"):format(#problems) or "",
        opts.metrics and "" or ", time and tokens"), 0)
  end

  -- shared x axis
  local all = {}
  for _, p in ipairs(panels) do for _, s in ipairs(p.series) do all[#all + 1] = s.pts end end
  local xlo, xhi = range_of(all, 1)
  xlo, xhi = widen(xlo, xhi, 1)
  local xmin, xmax, xstep, xticks = plot.linear_ticks(xlo, xhi, math.max(3, math.floor(plot_w / 110)), true,
    xkey == "step" and 1 or nil)
  local xs = scale(xmin, xmax, L, L + plot_w)
  local xlabels = plot.format_ticks(xticks, xstep)

  -- vertical layout
  local y = defaults.title_h
  for i, p in ipairs(panels) do
    p.h = p.spec.id == "loss" and (opts.loss_height or defaults.loss_height)
      or (opts.panel_height or defaults.panel_height)
    p.top = y
    y = y + p.h + (i < #panels and defaults.gap or 0)
  end
  local H = y + defaults.bottom

  local out = {}
  local function w(...) for i = 1, select("#", ...) do out[#out + 1] = select(i, ...) end end

  local title = opts.title or (name and ("training metrics: " .. basename(name))) or "training metrics"
  w('<?xml version="1.0" encoding="UTF-8"?>\n')
  w('<svg xmlns="http://www.w3.org/2000/svg" width="', W, '" height="', H, '" viewBox="0 0 ',
    W, " ", H, '" font-family="DejaVu Sans, Arial, Helvetica, sans-serif" font-size="12">\n')
  w("<title>", esc(title), "</title>\n")
  w('<rect x="0" y="0" width="', W, '" height="', H, '" fill="#ffffff"/>\n')
  w('<text class="title" x="', L, '" y="24" font-size="16" font-weight="bold" fill="#222222">',
    esc(fit(title, (W - L - 8) / 9.8)), "</text>\n")
  do -- a line of facts under the title
    local facts = {}
    if name then facts[#facts + 1] = basename(name) end
    facts[#facts + 1] = ("%d record%s"):format(#records, #records == 1 and "" or "s")
    local first, last = range_of(all, 1)
    facts[#facts + 1] = ("%s %s to %s"):format(xkey, fmt_value(first), fmt_value(last))
    if #problems > 0 then
      facts[#facts + 1] = ("%d malformed line%s skipped"):format(#problems, #problems == 1 and "" or "s")
    end
    w('<text class="subtitle" x="', L, '" y="42" font-size="11" fill="#666666">',
      esc(fit(table.concat(facts, " \xC2\xB7 "), (W - L - 8) / 6.2)), "</text>\n")
  end

  for pi, p in ipairs(panels) do
    local top, bot = p.top, p.top + p.h
    local list = {}
    for _, s in ipairs(p.series) do list[#list + 1] = s.pts end
    local ylo, yhi = range_of(list, 2)

    -- log scale: asked for, or (auto) the loss panel when its positive values span > 10x
    local use_log = false
    if p.spec.log then
      local positive = ylo > 0
      if opts.log == true then
        use_log = true
      elseif opts.log == nil then
        use_log = positive and yhi / ylo > 10
      end
      if use_log and not positive then -- drop the points a log axis cannot show
        for _, s in ipairs(p.series) do
          local kept = {}
          for _, q in ipairs(s.pts) do if q[2] > 0 then kept[#kept + 1] = q end end
          s.skipped = s.skipped + (#s.pts - #kept)
          s.pts = kept
        end
        local nonempty = {}
        for _, s in ipairs(p.series) do if #s.pts > 0 then nonempty[#nonempty + 1] = s end end
        p.series = nonempty
        list = {}
        for _, s in ipairs(p.series) do list[#list + 1] = s.pts end
        if #list == 0 then
          use_log = false -- nothing positive: fall back to a linear axis of the raw values
          p.series = {}
          for _, key in ipairs(p.spec.keys) do
            local pts, skipped = extract(records, key, xkey)
            if #pts > 0 then p.series[#p.series + 1] = { key = key, pts = pts, skipped = skipped } end
          end
          list = {}
          for _, s in ipairs(p.series) do list[#list + 1] = s.pts end
        end
        ylo, yhi = range_of(list, 2)
      end
    end

    local ys, yticks, ylabels
    if use_log then
      if yhi / ylo < 1 + 1e-9 then ylo, yhi = ylo / 1.5, yhi * 1.5 end
      local pad = (yhi / ylo) ^ 0.04
      local lo, hi = ylo / pad, yhi * pad
      yticks = plot.log_ticks(lo, hi)
      if #yticks < 2 then -- widen to the decades around the data
        lo, hi = 10 ^ math.floor(log10(lo)), 10 ^ math.ceil(log10(hi))
        yticks = plot.log_ticks(lo, hi)
      end
      ys = scale(lo, hi, bot, top, true)
      ylabels = {}
      for i, v in ipairs(yticks) do ylabels[i] = fmt_log_tick(v) end
    else
      ylo, yhi = widen(ylo, yhi)
      local lo, hi, step
      local pad = (yhi - ylo) * 0.05 -- keep the extremes off the frame
      lo, hi, step, yticks = plot.linear_ticks(ylo - pad, yhi + pad, math.max(4, math.floor(p.h / 28)))
      ys = scale(lo, hi, bot, top, false)
      ylabels = plot.format_ticks(yticks, step)
    end

    w('<g class="panel" id="panel-', esc(p.spec.id), '">\n')
    -- grid, frame and ticks
    w('<g stroke="#e5e5e5" stroke-width="1">\n')
    for _, v in ipairs(yticks) do
      local py = num(ys(v))
      w('<line x1="', L, '" y1="', py, '" x2="', L + plot_w, '" y2="', py, '"/>\n')
    end
    for _, v in ipairs(xticks) do
      local px = num(xs(v))
      w('<line x1="', px, '" y1="', top, '" x2="', px, '" y2="', bot, '"/>\n')
    end
    w("</g>\n")
    w('<rect x="', L, '" y="', top, '" width="', plot_w, '" height="', p.h,
      '" fill="none" stroke="#555555" stroke-width="1"/>\n')
    w('<g class="yticks" font-size="11" fill="#333333" text-anchor="end">\n')
    for i, v in ipairs(yticks) do
      local py = ys(v)
      w('<line x1="', L - 4, '" y1="', num(py), '" x2="', L, '" y2="', num(py), '" stroke="#555555"/>')
      w('<text x="', L - 7, '" y="', num(py + 4), '">', esc(ylabels[i]), "</text>\n")
    end
    w("</g>\n")
    w('<g class="xticks" font-size="11" fill="#333333" text-anchor="middle">\n')
    for i, v in ipairs(xticks) do
      local px = num(xs(v))
      w('<line x1="', px, '" y1="', bot, '" x2="', px, '" y2="', bot + 4, '" stroke="#555555"/>')
      w('<text x="', px, '" y="', bot + 17, '">', esc(xlabels[i]), "</text>\n")
    end
    w("</g>\n")
    local ylabel = p.spec.label .. (use_log and " (log scale)" or "")
    local cy = num(top + p.h / 2)
    w('<text class="ylabel" x="16" y="', cy, '" transform="rotate(-90 16 ', cy,
      ')" text-anchor="middle" fill="#222222">', esc(ylabel), "</text>\n")
    if pi == #panels then
      w('<text class="xlabel" x="', num(L + plot_w / 2), '" y="', bot + 36,
        '" text-anchor="middle" fill="#222222">', xkey == "time" and "time (s)" or "step", "</text>\n")
    end

    -- the curves
    local function col(x) return math.floor(xs(x)) end
    local drawn = {}
    for _, s in ipairs(p.series) do
      local color = colors[s.key] or "#444444"
      local n = #s.pts
      local pts = plot.downsample(s.pts, col)
      w('<g class="series" id="series-', esc(s.key), '" stroke="', color, '" fill="', color, '">\n')
      local pix = {} -- pixel positions, kept to place the legend where the curves are not
      for i, q in ipairs(pts) do pix[i] = { xs(q[1]), ys(q[2]) } end
      drawn[#drawn + 1] = pix
      if #pts > 1 then
        local coords = {}
        for i, q in ipairs(pix) do coords[i] = num(q[1]) .. "," .. num(q[2]) end
        w('<polyline fill="none" stroke-width="1.5" stroke-linejoin="round" points="',
          table.concat(coords, " "), '"/>\n')
      end
      if n <= 60 then -- few points (a validation loss, a short run): mark each
        for _, q in ipairs(pix) do
          w('<circle cx="', num(q[1]), '" cy="', num(q[2]), '" r="2.5" stroke="none"/>\n')
        end
      end
      w("</g>\n")
      s.last = s.pts[#s.pts] and s.pts[#s.pts][2]
    end

    -- legend: in the corner of the panel the curves cross least (top right when tied)
    local entries = {}
    for _, s in ipairs(p.series) do
      local text = s.key
      if s.last then text = text .. "  (last " .. fmt_value(s.last) .. ")" end
      if s.skipped > 0 then text = text .. (", %d not finite"):format(s.skipped) end
      entries[#entries + 1] = { key = s.key, text = text }
    end
    local lw = 0
    for _, e in ipairs(entries) do lw = math.max(lw, #e.text * 6.6 + 36) end
    lw = math.min(lw, plot_w - 8)
    for _, e in ipairs(entries) do e.text = fit(e.text, (lw - 36) / 6.6) end
    local lh = #entries * 16 + 8
    local lx, ly = place_legend(drawn, lw, lh, L, top, plot_w, p.h)
    w('<g class="legend" font-size="11">\n')
    w('<rect x="', num(lx), '" y="', num(ly), '" width="', num(lw), '" height="', lh,
      '" fill="#ffffff" fill-opacity="0.85" stroke="#cccccc"/>\n')
    for i, e in ipairs(entries) do
      local ey = ly + 4 + (i - 1) * 16 + 8
      w('<line x1="', num(lx + 8), '" y1="', num(ey), '" x2="', num(lx + 26), '" y2="', num(ey),
        '" stroke="', colors[e.key] or "#444444", '" stroke-width="2"/>')
      w('<text x="', num(lx + 32), '" y="', num(ey + 4), '" fill="#222222">', esc(e.text), "</text>\n")
    end
    w("</g>\n")
    w("</g>\n")
  end
  w("</svg>\n")
  return table.concat(out), problems
end

--- Read `jsonl_path` and write the SVG to `svg_path` ("-" for standard output). Returns
--- svg_path and the problems met while reading.
function plot.write(jsonl_path, svg_path, opts)
  if type(jsonl_path) ~= "string" then error("fsdp.plot.write: expected a JSONL path", 2) end
  if type(svg_path) ~= "string" then error("fsdp.plot.write: expected an SVG path", 2) end
  local text, problems = plot.svg(jsonl_path, opts)
  if svg_path == "-" then
    io.stdout:write(text)
    io.stdout:flush()
    return svg_path, problems
  end
  -- write beside and rename, so that a reader never sees half a file
  local tmp = svg_path .. ".tmp"
  local f, err = io.open(tmp, "wb")
  if not f then error("cannot write " .. err, 0) end
  local ok, werr = f:write(text)
  f:close()
  if not ok then os.remove(tmp); error("cannot write " .. svg_path .. ": " .. tostring(werr), 0) end
  local rok, rerr = os.rename(tmp, svg_path)
  if not rok then os.remove(tmp); error("cannot write " .. svg_path .. ": " .. tostring(rerr), 0) end
  return svg_path, problems
end

-- ---- command line -------------------------------------------------------------------------

plot.usage = [[
usage: fsdprun plot [options] metrics.jsonl
Draw every metric of a JSONL metrics file (fsdp.log's) as an SVG: the losses in one panel,
then one panel per other metric.

options:
  -o, --output FILE  the SVG to write; '-' writes to standard output
                     (default: the input with .jsonl replaced by .svg)
  --title TEXT       the title (default: "training metrics: <input file name>")
  --x step|time      the horizontal axis (default: step)
  --metrics A,B,...  draw only these metrics (default: every one but tokens)
  --log, --linear    loss axis scale (default: log when the loss spans more than 10x)
  --width N          width in pixels (default 800)
  -q, --quiet        do not list the malformed lines that were skipped
  -h, --help         show this help

Exit status: 0 written, 1 unreadable input or nothing to plot, 2 usage error.
]]

-- Errors main raises: a status and a message; tostring gives the message.
local PlotError = { __tostring = function(e) return e.message end }
plot.Error = PlotError

local function raise(status, fmt, ...)
  error(setmetatable({ status = status, message = fmt:format(...) }, PlotError), 0)
end

local function usage_error(fmt, ...)
  raise(2, fmt .. " (try 'fsdprun plot --help')", ...)
end

--- `fsdprun plot` (arguments after "plot", a list of strings). Writes the SVG and a line
--- saying where to env.stdout (default io.stdout), skipped lines to env.stderr. Returns 0;
--- failures raise a plot.Error: {status = 1 | 2, message =} whose tostring is the message.
function plot.main(args, env)
  env = env or {}
  local stdout, stderr = env.stdout or io.stdout, env.stderr or io.stderr
  if type(args) ~= "table" then usage_error("expected a list of arguments") end
  local opts, input, output, quiet = {}, nil, nil, false
  local i = 1
  local function value(flag, inline)
    if inline then return inline end
    i = i + 1
    local v = args[i]
    if v == nil then usage_error("%s needs a value", flag) end
    return v
  end
  local only_files = false
  while args[i] ~= nil do
    local a = tostring(args[i])
    local flag, inline = a:match("^(%-%-[%w-]+)=(.*)$")
    flag = flag or a
    if only_files or a == "-" or a:sub(1, 1) ~= "-" then
      if input then usage_error("more than one input file ('%s' and '%s')", input, a) end
      input = a
    elseif a == "--" then
      only_files = true
    elseif a == "-h" or a == "--help" then
      stdout:write(plot.usage)
      return 0
    elseif flag == "-o" or flag == "--output" then
      output = value(flag, inline)
    elseif a:match("^%-o.") then
      output = a:sub(3)
    elseif flag == "--title" then
      opts.title = value(flag, inline)
    elseif flag == "--x" then
      opts.x = value(flag, inline)
      if opts.x ~= "step" and opts.x ~= "time" then
        usage_error("--x must be 'step' or 'time', not '%s'", opts.x)
      end
    elseif flag == "--metrics" then
      local list = {}
      for name in value(flag, inline):gmatch("[^,]+") do list[#list + 1] = name end
      if #list == 0 then usage_error("--metrics needs a comma-separated list of names") end
      opts.metrics = list
    elseif a == "--log" then
      opts.log = true
    elseif a == "--linear" then
      opts.log = false
    elseif flag == "--width" then
      local v = value(flag, inline)
      local n = tonumber(v)
      if not n or n % 1 ~= 0 or n < 200 or n > 10000 then
        usage_error("--width must be a whole number of pixels in [200, 10000], not '%s'", v)
      end
      opts.width = n
    elseif a == "-q" or a == "--quiet" then
      quiet = true
    else
      usage_error("unknown option '%s'", a)
    end
    i = i + 1
  end
  if not input then usage_error("no metrics file given") end
  if output == "" then usage_error("-o needs a file name") end
  if not output then
    if input == "-" then usage_error("reading standard input needs -o") end
    output = input:gsub("%.jsonl$", ""):gsub("%.json$", "") .. ".svg"
  end
  if output == input then usage_error("the output would overwrite the input '%s'", input) end

  local ok, err = pcall(function()
    local _, problems = plot.write(input, output, opts)
    if #problems > 0 and not quiet then
      for k = 1, math.min(5, #problems) do
        stderr:write("fsdprun plot: ", problems[k], " (line skipped)\n")
      end
      if #problems > 5 then
        stderr:write(("fsdprun plot: ... and %d more malformed lines skipped\n"):format(#problems - 5))
      end
    end
    if output ~= "-" then stdout:write("fsdprun plot: wrote ", output, "\n") end
  end)
  if not ok then
    if getmetatable(err) == PlotError then error(err, 0) end
    raise(1, "%s", tostring(err))
  end
  return 0
end

--- Run main; print a plot.Error as "fsdprun plot: message" on env.stderr and return its
--- status (0 on success). Any other error (a bug) is raised again with its traceback.
function plot.command(args, env)
  env = env or {}
  local stderr = env.stderr or io.stderr
  local ok, res = xpcall(function() return plot.main(args, env) end, function(e)
    if getmetatable(e) == PlotError then return e end
    return debug.traceback(tostring(e), 2)
  end)
  if ok then return res end
  if getmetatable(res) == PlotError then
    stderr:write("fsdprun plot: ", res.message, "\n")
    stderr:flush()
    return res.status
  end
  error(res, 0)
end

return plot
