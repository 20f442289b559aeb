-- plot_spec.lua — fsdp.plot: the JSON-lines reader (values, escapes, strict numbers, malformed
-- lines with their line and column), tick values and labels, XML escaping, the SVG (well-formed
-- by a small tag-balance checker below, panels only for series that exist, coordinates inside
-- the viewBox and curves inside their frames, log scale, NaN/inf, one point, constant series,
-- missing keys, min/max downsampling bounding the size), files written, a JSONL file from
-- fsdp.log read back, and the `fsdprun plot` command line (plot.main / plot.command).
-- Run: busted --lua=luajit tests/lua/plot_spec.lua

local plot = require "fsdp.plot"

-- ---- helpers --------------------------------------------------------------------------------

local H = require "helpers"
teardown(H.remove_temps)
local sink, write_file = H.sink, H.write_file

local function read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local t = f:read("*a")
  f:close()
  return t
end

local function exists(path) return read_file(path) ~= nil end

-- A small XML well-formedness checker: one root element, tags balanced and properly nested,
-- attributes name="value" (each name once), values and text free of '<' and of '&' that does
-- not start one of the five entities or a character reference. Returns true, or nil and why.
local function check_xml(s)
  local pos, stack, roots = 1, {}, 0
  local function check_text(t, where)
    if t:find("<", 1, true) then return "'<' in " .. where end
    for amp in t:gmatch("&[^;]*;?") do
      if not (amp:match("^&[a-z]+;$") and ({ ["&amp;"] = 1, ["&lt;"] = 1, ["&gt;"] = 1,
        ["&quot;"] = 1, ["&apos;"] = 1 })[amp] or amp:match("^&#%d+;$") or amp:match("^&#x%x+;$")) then
        return "bad entity '" .. amp .. "' in " .. where
      end
    end
  end
  if s:sub(1, 5) == "<?xml" then
    local e = s:find("?>", 1, true)
    if not e then return nil, "unterminated XML declaration" end
    pos = e + 2
  end
  while pos <= #s do
    local lt = s:find("<", pos, true)
    local text = s:sub(pos, (lt or #s + 1) - 1)
    local why = check_text(text, "text")
    if why then return nil, why end
    if #stack == 0 and text:find("%S") then return nil, "text outside the root element" end
    if not lt then break end
    if s:sub(lt, lt + 3) == "<!--" then
      local e = s:find("-->", lt + 4, true)
      if not e then return nil, "unterminated comment" end
      pos = e + 3
    else
      local gt = s:find(">", lt, true)
      if not gt then return nil, "unterminated tag at " .. lt end
      local tag = s:sub(lt + 1, gt - 1)
      if tag:sub(1, 1) == "/" then
        local name = tag:match("^/([%a_][%w_:.-]*)%s*$")
        if not name then return nil, "bad end tag <" .. tag .. ">" end
        local open = table.remove(stack)
        if open ~= name then
          return nil, ("</%s> closes <%s>"):format(name, tostring(open))
        end
      else
        local self_closing = tag:sub(-1) == "/"
        if self_closing then tag = tag:sub(1, -2) end
        local name, rest = tag:match("^([%a_][%w_:.-]*)(.*)$")
        if not name then return nil, "bad tag <" .. tag .. ">" end
        local seen = {}
        rest = rest:gsub('%s+([%a_][%w_:.-]*)%s*=%s*"([^"]*)"', function(attr, val)
          if seen[attr] then seen.dup = attr end
          seen[attr] = true
          local w = check_text(val, "attribute " .. attr)
          if w then seen.bad = w end
          return ""
        end)
        if seen.dup then return nil, "attribute " .. seen.dup .. " twice in <" .. name .. ">" end
        if seen.bad then return nil, seen.bad end
        if rest:find("%S") then return nil, "bad attributes in <" .. name .. ">: " .. rest end
        if #stack == 0 then
          roots = roots + 1
          if roots > 1 then return nil, "more than one root element" end
        end
        if not self_closing then stack[#stack + 1] = name end
      end
      pos = gt + 1
    end
  end
  if #stack > 0 then return nil, "unclosed <" .. stack[#stack] .. ">" end
  if roots ~= 1 then return nil, "no root element" end
  return true
end

local function assert_xml(svg)
  local ok, why = check_xml(svg)
  assert(ok, "SVG is not well-formed: " .. tostring(why))
end

local function viewbox(svg)
  local w, h = svg:match('viewBox="0 0 ([%d.]+) ([%d.]+)"')
  return tonumber(w), tonumber(h)
end

-- Every coordinate the SVG places something at (x and y attributes, polyline points); each
-- must be a plain decimal number (no nan, inf or exponent).
local function coordinates(svg)
  local xs, ys = {}, {}
  local function number(v)
    assert(v:match("^%-?%d+%.?%d*$"), "not a plain number: '" .. v .. "'")
    return tonumber(v)
  end
  for tag in svg:gmatch("<[%a][^>]*>") do
    for attr, v in tag:gmatch('%s([%w-]+)="([^"]*)"') do
      if attr == "x" or attr == "x1" or attr == "x2" or attr == "cx" then xs[#xs + 1] = number(v) end
      if attr == "y" or attr == "y1" or attr == "y2" or attr == "cy" then ys[#ys + 1] = number(v) end
      if attr == "points" then
        for pair in v:gmatch("%S+") do
          local px, py = pair:match("^([^,]+),([^,]+)$")
          assert(px, "bad point '" .. pair .. "'")
          xs[#xs + 1], ys[#ys + 1] = number(px), number(py)
        end
      end
    end
  end
  return xs, ys
end

-- The panels: id -> {x, y, w, h (the frame), svg (the panel's text)}.
local function panels(svg)
  local out = {}
  for id, body in svg:gmatch('<g class="panel" id="panel%-([%w_]+)">(.-)\n</g>\n</g>\n') do
    local x, y, w, h = body:match('<rect x="([%d.]+)" y="([%d.]+)" width="([%d.]+)" height="([%d.]+)" fill="none"')
    out[id] = { x = tonumber(x), y = tonumber(y), w = tonumber(w), h = tonumber(h), svg = body }
  end
  return out
end

-- The polyline points and circles of series `key`.
local function series(svg, key)
  local body = svg:match('<g class="series" id="series%-' .. key .. '"[^>]*>(.-)</g>')
  if not body then return nil end
  local pts, dots = {}, {}
  local line = body:match('points="([^"]*)"')
  if line then
    for px, py in line:gmatch("([-%d.]+),([-%d.]+)") do pts[#pts + 1] = { tonumber(px), tonumber(py) } end
  end
  for cx, cy in body:gmatch('<circle cx="([-%d.]+)" cy="([-%d.]+)"') do
    dots[#dots + 1] = { tonumber(cx), tonumber(cy) }
  end
  return { pts = pts, dots = dots, body = body }
end

local function count(s, pattern)
  local n = 0
  for _ in s:gmatch(pattern) do n = n + 1 end
  return n
end

-- Records like a training run: n steps, warm-up then decay of lr, loss from 10 to ~1,
-- val_loss every `val_every` steps, sparsity after the first third.
local function run_records(n, val_every)
  local r = {}
  for s = 1, n do
    local rec = { step = s, time = s * 0.25, loss = 9 * math.exp(-s / (n / 6)) + 1 + 0.05 * math.sin(s),
      lr = s < n / 10 and 1e-3 * s / (n / 10) or 1e-3 * (1 - s / (n + 1)) }
    if val_every and s % val_every == 0 then rec.val_loss = rec.loss + 0.2 end
    if s > n / 3 then rec.sparsity = math.min(0.8, (s - n / 3) / n) end
    r[s] = rec
  end
  return r
end

-- ---- the checker itself ---------------------------------------------------------------------

describe("the XML checker used by these tests", function()
  it("accepts well-formed documents", function()
    assert.is_true(check_xml('<?xml version="1.0"?>\n<a x="1"><b/><c>t &amp; &#233; &lt;</c></a>\n'))
  end)
  it("rejects what is not", function()
    for _, bad in ipairs {
      "<a><b></a></b>", "<a>", "<a></a><b/>", '<a x=1/>', "<a>&foo;</a>", "<a>x & y</a>",
      '<a x="1" x="2"/>', '<a x="<"/>', "text<a/>", "</a>", "<a><b></b>",
    } do
      assert.is_nil((check_xml(bad)), bad)
    end
  end)
end)

-- ---- reading --------------------------------------------------------------------------------

describe("fsdp.plot.decode", function()
  it("reads the flat objects fsdp.log writes", function()
    local r = plot.decode('{"step":3,"time":0.5,"loss":2.25,"lr":1e-3,"ok":true,"bad":false,"x":null,"note":"hi"}')
    assert.same({ step = 3, time = 0.5, loss = 2.25, lr = 1e-3, ok = true, bad = false, note = "hi",
      x = plot.null }, r)
    assert.equal("null", tostring(r.x))
  end)

  it("decodes escapes and \\u with surrogate pairs; a lone surrogate makes the line malformed", function()
    local r = plot.decode([[{"s":"a\"b\\c\/d\n\t\u00e9\ud83d\ude00"}]])
    assert.equal('a"b\\c/d\n\t\195\169\240\159\152\128', r.s)
    assert.is_nil(plot.decode([[{"lone":"\ud800x"}]]))
  end)

  it("reads NaN and infinities as fsdp.log writes them (strings) and as other writers do (bare)", function()
    local r = plot.decode('{"a":-0,"b":1.5E+3,"c":2e-5,"d":-12.75,"e":0.5,"n":NaN,"i":Infinity,"m":-Infinity,'
      .. '"sn":"NaN","si":"Infinity","sm":"-Infinity","s":"NaN and more","q":"a NaN"}')
    assert.equal(0, r.a)
    assert.equal(1500, r.b)
    assert.equal(2e-5, r.c)
    assert.equal(-12.75, r.d)
    assert.equal(0.5, r.e)
    assert.is_true(r.n ~= r.n)
    assert.equal(math.huge, r.i)
    assert.equal(-math.huge, r.m)
    assert.is_true(r.sn ~= r.sn)
    assert.equal(math.huge, r.si)
    assert.equal(-math.huge, r.sm)
    assert.equal("NaN and more", r.s)
    assert.equal("a NaN", r.q) -- a word inside a string is text
    for _, bad in ipairs { ".5", "+1", "1e", "1e+", "-", "0x10", "1.2.3", "nan", "Inf" } do
      assert.is_nil(plot.decode('{"a":' .. bad .. "}"), bad)
    end
  end)

  it("keeps nested values, and the last of duplicate keys", function()
    local r = plot.decode(' { "a" : [1, [2], {"b": null}] , "o": {}, "a2": [], "k": 1, "k": 2 } \r')
    assert.same({ 1, { 2 }, { b = plot.null } }, r.a)
    assert.same({}, r.o)
    assert.same({}, r.a2)
    assert.equal(2, r.k)
  end)

  it("says what is wrong and in which column", function()
    local cases = {
      { '{"a" 1}', 6, "unexpected '1'" },
      { '{"a":1} x', 9, "after the document" },
      { '{"a":"\\x"}', 7, "unexpected" },
      { "[1,2]", 1, "JSON object" },
      { '  7', 3, "JSON object" },
      { '{"a":1', 7, "unexpected end of text" },
      { '{"a":tru}', 6, "unexpected 't'" },
      { '{"a":', 6, "unexpected end of text" },
      { '{"a":[1 2]}', 9, "unexpected '2'" },
      { '{"a":1,"b":NaN x}', 16, "unexpected 'x'" }, -- a column of the line, not of its rewrite
    }
    for _, c in ipairs(cases) do
      local r, msg, col = plot.decode(c[1])
      assert.is_nil(r, c[1])
      assert.equal(c[2], col, c[1] .. ": " .. tostring(msg))
      assert.truthy(msg:find(c[3], 1, true), c[1] .. ": " .. msg)
    end
  end)

  it("refuses absurd nesting instead of overflowing the stack", function()
    local deep = '{"a":' .. ("["):rep(2000) .. ("]"):rep(2000) .. "}"
    assert.is_nil(plot.decode(deep))
  end)
end)

describe("fsdp.plot.parse and fsdp.plot.read", function()
  it("skips blank lines and reports malformed ones as name:line:column", function()
    local text = '{"step":1,"loss":2}\n\n   \n{"step":2,"loss":\n{"step":3,"loss":1.5}\r\nnot json\n{"step":4,"loss":1}'
    local recs, problems = plot.parse(text, "m.jsonl")
    assert.equal(3, #recs)
    assert.same({ 1, 3, 4 }, { recs[1].step, recs[2].step, recs[3].step })
    assert.same({ "m.jsonl:4:18: unexpected end of text",
      "m.jsonl:6:1: expected a JSON object ('{')" }, problems)
  end)

  it("reads a file, and reports a truncated last line", function()
    local path = H.tmpname()
    write_file(path, '{"step":1,"loss":2}\n{"step":2,"lo')
    local recs, problems = plot.read(path)
    os.remove(path)
    assert.equal(1, #recs)
    assert.equal(1, #problems)
    assert.truthy(problems[1]:find(path .. ":2:", 1, true))
  end)

  it("raises a plain message for a file it cannot open", function()
    local ok, err = pcall(plot.read, "/nonexistent-dir/m.jsonl")
    assert.is_false(ok)
    assert.equal("cannot open /nonexistent-dir/m.jsonl: No such file or directory", err)
  end)

  it("reads back what fsdp.log wrote (NaN and inf as numbers, strings, tensors as numbers)", function()
    local fsdp = require "fsdp"
    local log = require "fsdp.log"
    local path = H.tmpname()
    local t = 0
    log.setup { jsonl = path, out = sink(), progress = "off", rank = 0, clock = function() return t end }
    for s = 1, 5 do
      t = t + 0.5
      log(s, { loss = s == 3 and 0 / 0 or 5 - s, lr = fsdp.tensor { 0.5 }:sum(), note = 'x"<&>', ok = true,
        grad_norm = s == 4 and -math.huge or s })
    end
    log.finish()
    local recs, problems = plot.read(path)
    os.remove(path)
    assert.same({}, problems)
    assert.equal(5, #recs)
    assert.is_true(recs[3].loss ~= recs[3].loss)
    assert.equal(-math.huge, recs[4].grad_norm)
    assert.equal(4, recs[1].loss)
    assert.equal(0.5, recs[2].lr)
    assert.equal(1.0, recs[2].time)
    assert.equal('x"<&>', recs[5].note)
    local svg = plot.svg(recs)
    assert_xml(svg)
    assert.truthy(svg:find("loss  (last 0), 1 not finite", 1, true))
    assert.truthy(svg:find("grad_norm  (last 5), 1 not finite", 1, true))
  end)
end)

-- ---- numbers and text -----------------------------------------------------------------------

describe("ticks and labels", function()
  it("chooses 1-2-5 steps and keeps the range unless asked to snap", function()
    local lo, hi, step, ticks = plot.linear_ticks(0.13, 9.7, 5)
    assert.equal(2, step)
    assert.same({ 2, 4, 6, 8 }, ticks)
    assert.same({ 0.13, 9.7 }, { lo, hi })
    lo, hi, step, ticks = plot.linear_ticks(1, 3000, 7, true)
    assert.same({ 0, 3000, 500 }, { lo, hi, step })
    assert.equal(7, #ticks)
    lo, hi, step = plot.linear_ticks(6, 8, 7, true, 1)
    assert.equal(1, step)
    local ok = pcall(plot.linear_ticks, 1, 1)
    assert.is_false(ok)
  end)

  it("never produces 0.30000000000000004 or -0 labels", function()
    local _, _, step, ticks = plot.linear_ticks(-0.05, 0.95, 11)
    assert.equal(0.1, step)
    assert.same({ "0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9" },
      plot.format_ticks(ticks, step))
  end)

  it("labels one axis in one style: fixed when short, scientific otherwise", function()
    assert.same({ "0", "0.5", "1.0", "1.5" }, plot.format_ticks({ 0, 0.5, 1, 1.5 }, 0.5))
    assert.same({ "0", "1000", "2000" }, plot.format_ticks({ 0, 1000, 2000 }, 1000))
    assert.same({ "0", "0.0001", "0.0002" }, plot.format_ticks({ 0, 1e-4, 2e-4 }, 1e-4))
    assert.same({ "0", "5e-5", "1.0e-4", "1.5e-4" }, plot.format_ticks({ 0, 5e-5, 1e-4, 1.5e-4 }, 5e-5))
    assert.same({ "0.00095", "0.00100", "0.00105" }, plot.format_ticks({ 9.5e-4, 1e-3, 1.05e-3 }, 5e-5))
    assert.same({ "0", "5e6", "1.0e7" }, plot.format_ticks({ 0, 5e6, 1e7 }, 5e6))
    assert.same({ "-2", "0", "2" }, plot.format_ticks({ -2, 0, 2 }, 2))
  end)

  it("puts log ticks at powers of ten, or 1-2-5 multiples over a short span", function()
    assert.same({ 1e-4, 1e-3, 1e-2, 1e-1, 1, 10 }, plot.log_ticks(5e-5, 20))
    assert.same({ 0.5, 1, 2, 5, 10 }, plot.log_ticks(0.3, 11))
    local t = plot.log_ticks(2.1, 3.9)
    assert.same({ 3 }, t) -- the caller widens to whole decades when fewer than two
    local many = plot.log_ticks(1e-30, 1e30)
    assert.truthy(#many <= 9 and #many >= 3)
  end)

  it("escapes text for XML and drops control characters XML cannot hold", function()
    assert.equal("&lt;a href=&quot;x&quot;&gt; &amp; &apos;y&apos;", plot.escape("<a href=\"x\"> & 'y'"))
    assert.equal("ab\tc\n", plot.escape("a\1b\27\tc\n\127"))
    assert.equal("12", plot.escape(12))
  end)
end)

describe("fsdp.plot.downsample", function()
  it("keeps at most the low and high point of each column, in order, and both ends", function()
    local pts = {}
    for i = 1, 1000 do pts[i] = { i, math.sin(i) * i } end
    local function col(x) return math.floor(x / 10) end
    local out = plot.downsample(pts, col)
    assert.truthy(#out <= 2 * 101 + 2)
    assert.equal(pts[1], out[1])
    assert.equal(pts[1000], out[#out])
    local per = {}
    for i = 2, #out - 1 do
      local c = col(out[i][1])
      per[c] = (per[c] or 0) + 1
      assert.truthy(per[c] <= 2)
      assert.truthy(out[i][1] > out[i - 1][1], "order kept")
    end
    local lo, hi = math.huge, -math.huge
    for _, p in ipairs(pts) do lo, hi = math.min(lo, p[2]), math.max(hi, p[2]) end
    local olo, ohi = math.huge, -math.huge
    for _, p in ipairs(out) do olo, ohi = math.min(olo, p[2]), math.max(ohi, p[2]) end
    assert.same({ lo, hi }, { olo, ohi })
  end)

  it("leaves short series alone", function()
    local pts = { { 1, 1 }, { 2, 2 } }
    assert.equal(pts, plot.downsample(pts, math.floor))
  end)
end)

-- ---- the SVG --------------------------------------------------------------------------------

describe("fsdp.plot.svg", function()
  it("draws a panel per metric present, well-formed, everything inside the viewBox", function()
    local svg = plot.svg(run_records(500, 50), { title = "run <1> & \"2\"" })
    assert_xml(svg)
    local W, H = viewbox(svg)
    assert.equal(800, W)
    local ps = panels(svg)
    assert.truthy(ps.loss and ps.lr and ps.sparsity)
    assert.truthy(ps.loss.y < ps.lr.y and ps.lr.y < ps.sparsity.y)
    for _, key in ipairs { "loss", "val_loss", "lr", "sparsity" } do
      assert.truthy(series(svg, key), key)
    end
    assert.truthy(svg:find("<title>run &lt;1&gt; &amp; &quot;2&quot;</title>", 1, true))
    local xs, ys = coordinates(svg)
    assert.truthy(#xs > 100 and #ys > 100)
    for _, x in ipairs(xs) do assert.truthy(x >= 0 and x <= W, "x " .. x) end
    for _, y in ipairs(ys) do assert.truthy(y >= 0 and y <= H, "y " .. y) end
    -- every curve inside its own frame
    for id, keys in pairs { loss = { "loss", "val_loss" }, lr = { "lr" }, sparsity = { "sparsity" } } do
      local p = ps[id]
      for _, key in ipairs(keys) do
        local s = series(p.svg, key)
        assert.truthy(s, key .. " in panel " .. id)
        for _, q in ipairs(s.pts) do
          assert.truthy(q[1] >= p.x and q[1] <= p.x + p.w and q[2] >= p.y and q[2] <= p.y + p.h,
            key .. " point outside its frame")
        end
      end
    end
    -- legend entries and axis labels
    assert.truthy(ps.loss.svg:find(">loss  (last ", 1, true))
    assert.truthy(ps.loss.svg:find(">val_loss  (last ", 1, true))
    assert.truthy(ps.lr.svg:find(">learning rate</text>", 1, true))
    assert.truthy(ps.sparsity.svg:find('class="xlabel"[^>]*>step</text>'))
    assert.falsy(ps.loss.svg:find('class="xlabel"'))
  end)

  it("draws every numeric metric: losses together, then lr, then the others in file order", function()
    local recs = {}
    for s = 1, 40 do
      recs[s] = { step = s, time = s / 4, loss = 3 - s / 20, lr = 1e-3, tokens = 512, grad_norm = 1 + s % 3,
        note = "text", flag = true, nested = { 1, 2 } }
      if s % 10 == 0 then recs[s].val_loss, recs[s].acc = 3.1 - s / 20, s / 40 end
      if s > 20 then recs[s].test_loss = 2 end
    end
    assert.same({ "grad_norm", "loss", "lr", "tokens", "acc", "val_loss", "test_loss" }, plot.metrics(recs))
    local svg = plot.svg(recs)
    assert_xml(svg)
    local ps = panels(svg)
    local order = {}
    for id in svg:gmatch('<g class="panel" id="panel%-([%w_]+)">') do order[#order + 1] = id end
    assert.same({ "loss", "lr", "grad_norm", "acc" }, order)
    for _, key in ipairs { "loss", "val_loss", "test_loss" } do assert.truthy(series(ps.loss.svg, key), key) end
    assert.truthy(series(ps.grad_norm.svg, "grad_norm"))
    assert.truthy(ps.grad_norm.svg:find(">grad_norm</text>", 1, true), "the metric names its axis")
    assert.is_nil(ps.tokens, "tokens only when asked for")
    assert.is_nil(svg:find("note", 1, true))
    -- colours: the usual ones kept, the others distinct
    local colour = {}
    for key, c in svg:gmatch('<g class="series" id="series%-([%w_]+)" stroke="(#%x+)"') do colour[key] = c end
    assert.equal("#1f77b4", colour.loss)
    assert.equal("#d62728", colour.val_loss)
    assert.equal("#2ca02c", colour.lr)
    local seen = {}
    for key, c in pairs(colour) do
      assert.is_nil(seen[c], key .. " shares its colour with " .. tostring(seen[c]))
      seen[c] = key
    end
  end)

  it("draws only the metrics asked for, and names a metric the records lack", function()
    local recs = {}
    for s = 1, 20 do recs[s] = { step = s, loss = 1 / s, lr = 0.1, tokens = 100 + s, grad_norm = s } end
    local svg = plot.svg(recs, { metrics = { "tokens", "grad_norm" } })
    assert_xml(svg)
    local ps = panels(svg)
    assert.truthy(ps.tokens and ps.grad_norm)
    assert.is_nil(ps.loss)
    assert.is_nil(ps.lr)
    local ok, err = pcall(plot.svg, recs, { metrics = { "grad_nrom" } })
    assert.is_false(ok)
    assert.truthy(err:find("no metric 'grad_nrom' in the records (those with numbers: grad_norm, loss, lr, tokens)",
      1, true), err)
  end)

  it("cuts a title too long for the width, on a character boundary, and keeps it whole in <title>", function()
    local long = ("\195\169t\195\169 "):rep(40) -- "été " x 40: two-byte characters
    local svg = plot.svg(run_records(20), { title = long, width = 400 })
    assert_xml(svg)
    local shown = svg:match('<text class="title"[^>]*>([^<]*)</text>')
    assert.truthy(#shown < #long)
    assert.equal("\226\128\166", shown:sub(-3))
    local body = shown:sub(1, -4)
    assert.truthy(body:find("^[%z\1-\127\194-\244][\128-\191]*"), "starts on a character")
    assert.falsy(body:sub(-1):find("[\194-\244]"), "no half character before the ellipsis")
    assert.equal(long, svg:match("<title>([^<]*)</title>"))
    local W = viewbox(svg)
    local x = tonumber(svg:match('<text class="title" x="([%d.]+)"'))
    local chars = select(2, shown:gsub("[^\128-\191]", ""))
    assert.truthy(x + chars * 9.8 <= W, "estimated width inside the viewBox")
    -- a title that fits is left alone
    svg = plot.svg(run_records(20), { title = "short" })
    assert.truthy(svg:find('font-weight="bold" fill="#222222">short</text>', 1, true))
  end)

  it("leaves out panels for series that are absent", function()
    local recs = {}
    for s = 1, 20 do recs[s] = { step = s, lr = 0.1 * s, tokens = 100 } end
    local svg = plot.svg(recs)
    assert_xml(svg)
    local ps = panels(svg)
    assert.truthy(ps.lr)
    assert.is_nil(ps.loss)
    assert.is_nil(ps.sparsity)
    assert.is_nil(series(svg, "loss"))
    assert.is_nil(svg:find("val_loss", 1, true))
  end)

  it("uses a log axis for a loss spanning more than 10x, unless told otherwise", function()
    local recs = {}
    for s = 1, 100 do recs[s] = { step = s, loss = 20 * math.exp(-s / 20) + 0.5 } end
    local auto = plot.svg(recs)
    assert.truthy(auto:find(">loss (log scale)</text>", 1, true))
    assert.falsy(plot.svg(recs, { log = false }):find("log scale", 1, true))
    local narrow = {}
    for s = 1, 100 do narrow[s] = { step = s, loss = 5 - s / 50 } end
    assert.falsy(plot.svg(narrow):find("log scale", 1, true))
    assert.truthy(plot.svg(narrow, { log = true }):find("log scale", 1, true))
    -- on a log axis the y pixel of 10x is a fixed distance above that of x
    local svg = plot.svg({ { step = 1, loss = 100 }, { step = 2, loss = 10 }, { step = 3, loss = 1 } })
    local p = series(svg, "loss").pts
    assert.near(p[2][2] - p[1][2], p[3][2] - p[2][2], 0.11)
  end)

  it("drops points a forced log axis cannot show, and says so", function()
    local recs = { { step = 1, loss = 4 }, { step = 2, loss = 0 }, { step = 3, loss = -1 }, { step = 4, loss = 2 } }
    local svg = plot.svg(recs, { log = true })
    assert_xml(svg)
    assert.equal(2, #series(svg, "loss").pts)
    assert.truthy(svg:find("2 not finite", 1, true))
    -- nothing positive at all: a linear axis after all
    svg = plot.svg({ { step = 1, loss = 0 }, { step = 2, loss = -1 } }, { log = true })
    assert.falsy(svg:find("log scale", 1, true))
    assert.equal(2, #series(svg, "loss").pts)
  end)

  it("skips NaN, inf, null and non-numbers, and counts them", function()
    local recs = {}
    for s = 1, 10 do recs[s] = { step = s, loss = 1 + s } end
    recs[3].loss = 0 / 0
    recs[4].loss = math.huge
    recs[5].loss = plot.null
    recs[6].loss = "oops"
    recs[7].step = 0 / 0 -- no usable x: skipped too
    local svg = plot.svg(recs)
    assert_xml(svg)
    assert.equal(5, #series(svg, "loss").pts)
    assert.truthy(svg:find("loss  (last 11), 5 not finite", 1, true))
    assert.falsy(svg:find("nan", 1, true))
    assert.falsy(svg:find("inf", 1, true))
  end)

  it("draws a single point as a dot, with a sensible axis", function()
    local svg = plot.svg({ { step = 7, loss = 3.5 } })
    assert_xml(svg)
    local s = series(svg, "loss")
    assert.equal(0, #s.pts)
    assert.equal(1, #s.dots)
    local p = panels(svg).loss
    local d = s.dots[1]
    assert.truthy(d[1] > p.x and d[1] < p.x + p.w and d[2] > p.y and d[2] < p.y + p.h)
    assert.truthy(svg:find(">7</text>", 1, true), "an integer step tick")
    assert.falsy(svg:find(">6.5</text>", 1, true), "no fractional steps")
  end)

  it("draws a constant series as a flat line in the middle, with distinct tick labels", function()
    local recs = {}
    for s = 1, 50 do recs[s] = { step = s, lr = 3e-4 } end
    local svg = plot.svg(recs)
    assert_xml(svg)
    local p = panels(svg).lr
    local s = series(svg, "lr")
    for _, q in ipairs(s.pts) do assert.equal(s.pts[1][2], q[2]) end
    assert.near(p.y + p.h / 2, s.pts[1][2], 1)
    local labels, seen = {}, {}
    for l in p.svg:match('<g class="yticks".-</g>'):gmatch(">([^<]+)</text>") do
      assert.is_nil(seen[l], "label " .. l .. " twice")
      seen[l] = true
      labels[#labels + 1] = l
    end
    assert.truthy(#labels >= 3)
  end)

  it("draws metrics present on some lines only (validation every so often)", function()
    local svg = plot.svg(run_records(1000, 100))
    local v = series(svg, "val_loss")
    assert.equal(10, #v.pts)
    assert.equal(10, #v.dots)
    -- sorted by step even when the file is not
    local recs = { { step = 3, loss = 3 }, { step = 1, loss = 1 }, { step = 2, loss = 2 } }
    local p = series(plot.svg(recs), "loss").pts
    assert.truthy(p[1][1] < p[2][1] and p[2][1] < p[3][1])
    assert.truthy(p[1][2] > p[2][2] and p[2][2] > p[3][2], "higher loss drawn higher")
  end)

  it("downsamples thousands of points to a bounded size and keeps the extremes", function()
    local n = 100000
    local recs = run_records(n, 1000)
    recs[n / 2].loss = 50 -- one spike: it must survive
    local svg = plot.svg(recs)
    assert_xml(svg)
    assert.truthy(#svg < 150000, "SVG of " .. #svg .. " bytes")
    local p = panels(svg).loss
    local s = series(svg, "loss")
    assert.truthy(#s.pts <= 2 * p.w + 4, #s.pts .. " points")
    assert.equal(0, #s.dots, "no dots on a long series")
    local top = math.huge
    for _, q in ipairs(s.pts) do top = math.min(top, q[2]) end
    assert.truthy(top < p.y + 0.1 * p.h, "the spike reaches the top of the panel")
  end)

  it("survives extreme magnitudes", function()
    for _, vals in ipairs { { 9e299, -9e299 }, { 1e-300, 2e-300 }, { 1e15, 1e15 + 0.5 },
      { 1, 1 + 1e-14 }, { -5, -5 }, { 0, 0 } } do
      local recs = { { step = 1, loss = vals[1], lr = vals[1] }, { step = 1e12, loss = vals[2], lr = vals[2] } }
      local svg = plot.svg(recs)
      assert_xml(svg)
      local W, H = viewbox(svg)
      local xs, ys = coordinates(svg)
      for _, x in ipairs(xs) do assert.truthy(x >= 0 and x <= W, "x " .. x) end
      for _, y in ipairs(ys) do assert.truthy(y >= 0 and y <= H, "y " .. y) end
      assert.equal(2, #series(svg, "loss").pts)
    end
    -- beyond 1e300 values count as not finite (their differences would overflow)
    local svg = plot.svg { { step = 1, loss = 1.7e308 }, { step = 2, loss = -1.7e308 }, { step = 3, loss = 1 } }
    assert.truthy(svg:find("2 not finite", 1, true))
    coordinates(svg)
  end)

  it("puts time on the x axis when asked", function()
    local svg = plot.svg(run_records(100), { x = "time" })
    assert.truthy(svg:find(">time (s)</text>", 1, true))
    assert.truthy(svg:find("time 0.25 to 25", 1, true))
  end)

  it("places the legend where the curves are not", function()
    -- a rising curve fills the top right; the legend goes elsewhere
    local recs = {}
    for s = 1, 100 do recs[s] = { step = s, sparsity = s / 100 } end
    local p = panels(plot.svg(recs)).sparsity
    local lx = tonumber(p.svg:match('<g class="legend"[^>]*>\n<rect x="([%d.]+)"'))
    assert.truthy(lx < p.x + p.w / 2, "legend on the left")
  end)

  it("honours the width and raises on bad input", function()
    local svg = plot.svg(run_records(50), { width = 1200 })
    assert.equal(1200, (viewbox(svg)))
    local ok, err = pcall(plot.svg, { { step = 1, tokens = 5 } })
    assert.is_false(ok)
    assert.truthy(err:find("no metrics to plot (1 records)", 1, true))
    ok, err = pcall(plot.svg, 42)
    assert.is_false(ok)
    assert.truthy(err:find("expected a JSONL path or a list of records", 1, true))
    ok, err = pcall(plot.svg, {}, { x = "epoch" })
    assert.is_false(ok)
    assert.truthy(err:find('x must be "step" or "time"', 1, true))
    ok = pcall(plot.svg, {}, { width = 10 })
    assert.is_false(ok)
    ok, err = pcall(plot.svg, { { step = 1, loss = 1 } }, { x = "time" })
    assert.is_false(ok)
    assert.truthy(err:find("no time values for the horizontal axis", 1, true))
  end)
end)

describe("fsdp.plot.write", function()
  it("writes the SVG and no temporary file; reports malformed lines", function()
    local dir = H.mktemp_dir()
    local jsonl, svg = dir .. "/m.jsonl", dir .. "/m.svg"
    write_file(jsonl, '{"step":1,"loss":2}\n{"step":2,"loss":1}\nbroken\n')
    local out, problems = plot.write(jsonl, svg, { title = "t" })
    assert.equal(svg, out)
    assert.equal(1, #problems)
    local text = read_file(svg)
    assert_xml(text)
    assert.truthy(text:find("1 malformed line skipped", 1, true))
    assert.is_false(exists(svg .. ".tmp"))
    H.rmtree(dir)
  end)

  it("raises a plain message when it cannot write", function()
    local jsonl = H.tmpname()
    write_file(jsonl, '{"step":1,"loss":2}\n')
    local ok, err = pcall(plot.write, jsonl, "/nonexistent-dir/x.svg")
    os.remove(jsonl)
    assert.is_false(ok)
    assert.truthy(err:find("^cannot write /nonexistent%-dir/x%.svg"))
  end)
end)

-- ---- the command line -----------------------------------------------------------------------

describe("fsdprun plot (plot.main and plot.command)", function()
  local dir, jsonl
  before_each(function()
    dir = H.mktemp_dir()
    jsonl = dir .. "/metrics.jsonl"
    local lines = {}
    for s = 1, 30 do lines[s] = ('{"step":%d,"time":%g,"loss":%g,"lr":0.01}'):format(s, s / 4, 3 - s / 20) end
    write_file(jsonl, table.concat(lines, "\n") .. "\n")
  end)
  after_each(function() H.rmtree(dir) end)

  local function run(args)
    local env = { stdout = sink(), stderr = sink() }
    local status = plot.command(args, env)
    return status, env.stdout.text, env.stderr.text
  end

  it("writes the SVG named by -o and says where", function()
    local out = dir .. "/loss.svg"
    local status, stdout, stderr = run { jsonl, "-o", out, "--title=My run" }
    assert.equal(0, status)
    assert.equal("fsdprun plot: wrote " .. out .. "\n", stdout)
    assert.equal("", stderr)
    local text = read_file(out)
    assert_xml(text)
    assert.truthy(text:find("<title>My run</title>", 1, true))
  end)

  it("accepts the option spellings and defaults the output beside the input", function()
    assert.equal(0, (run { "--title", "T", jsonl, "--output=" .. dir .. "/a.svg", "--x=time", "--log" }))
    assert.truthy(read_file(dir .. "/a.svg"):find("log scale", 1, true))
    assert.equal(0, (run { "-o" .. dir .. "/b.svg", "--width", "1000", "--linear", jsonl }))
    assert.equal(1000, (viewbox(read_file(dir .. "/b.svg"))))
    assert.equal(0, (run { jsonl }))
    assert.truthy(exists(dir .. "/metrics.svg"))
    assert.equal(0, (run { "-o", dir .. "/c.svg", "--", jsonl }))
    assert.truthy(exists(dir .. "/c.svg"))
  end)

  it("prints help on stdout with status 0", function()
    local status, stdout = run { "--help" }
    assert.equal(0, status)
    assert.truthy(stdout:find("usage: fsdprun plot", 1, true))
    assert.equal(plot.usage, stdout)
  end)

  it("exits 2 on usage errors, with one line naming the problem", function()
    local cases = {
      { {}, "no metrics file given" },
      { { "--bogus", jsonl }, "unknown option '--bogus'" },
      { { jsonl, "-o" }, "-o needs a value" },
      { { jsonl, "--width=abc" }, "--width must be a whole number" },
      { { jsonl, "--width=50" }, "--width must be a whole number" },
      { { jsonl, "--x=epoch" }, "--x must be 'step' or 'time'" },
      { { jsonl, jsonl .. "2" }, "more than one input file" },
      { { "-" }, "reading standard input needs -o" },
      { { jsonl, "-o", jsonl }, "the output would overwrite the input" },
    }
    for _, c in ipairs(cases) do
      local status, stdout, stderr = run(c[1])
      assert.equal(2, status, c[2])
      assert.equal("", stdout)
      assert.truthy(stderr:find("fsdprun plot: " .. c[2], 1, true), stderr)
      assert.truthy(stderr:find("(try 'fsdprun plot --help')\n", 1, true))
      assert.equal(1, count(stderr, "\n"))
    end
  end)

  it("exits 1 when the input cannot be read or holds nothing to plot", function()
    local status, _, stderr = run { dir .. "/missing.jsonl", "-o", dir .. "/x.svg" }
    assert.equal(1, status)
    assert.equal("fsdprun plot: cannot open " .. dir .. "/missing.jsonl: No such file or directory\n", stderr)
    write_file(dir .. "/empty.jsonl", "garbage\n{\"step\":1}\n")
    status, _, stderr = run { dir .. "/empty.jsonl", "-o", dir .. "/x.svg" }
    assert.equal(1, status)
    assert.truthy(stderr:find("no metrics to plot (1 records, 1 malformed lines)", 1, true))
    assert.is_false(exists(dir .. "/x.svg"))
  end)

  it("lists skipped lines on stderr (the first five), unless -q", function()
    local f = assert(io.open(jsonl, "ab"))
    for i = 1, 7 do f:write("bad ", i, "\n") end
    f:close()
    local status, _, stderr = run { jsonl, "-o", dir .. "/x.svg" }
    assert.equal(0, status)
    assert.equal(6, count(stderr, "\n"))
    assert.truthy(stderr:find("fsdprun plot: " .. jsonl .. ":31:1: expected a JSON object ('{') (line skipped)", 1, true))
    assert.truthy(stderr:find("... and 2 more malformed lines skipped", 1, true))
    status, _, stderr = run { jsonl, "-q", "-o", dir .. "/y.svg" }
    assert.equal(0, status)
    assert.equal("", stderr)
  end)

  it("main raises plot.Error objects carrying the status", function()
    local ok, err = pcall(plot.main, { "--nope" }, { stdout = sink(), stderr = sink() })
    assert.is_false(ok)
    assert.equal(plot.Error, getmetatable(err))
    assert.equal(2, err.status)
    assert.truthy(tostring(err):find("unknown option '--nope'", 1, true))
  end)

  it("command raises again, with a traceback, errors that are not plot.Error", function()
    local evil = setmetatable({}, { __tostring = function() error("boom") end })
    local ok, err = pcall(plot.command, { evil }, { stdout = sink(), stderr = sink() })
    assert.is_false(ok)
    assert.truthy(err:find("boom", 1, true))
    assert.truthy(err:find("stack traceback", 1, true))
  end)
end)
