-- log_spec.lua — fsdp.log: the progress text, plain lines when not on a terminal, the
-- redrawn bar on one, no progress at all, metrics logged every so often, rank 0 only,
-- throughput and ETA from a fake clock, and JSONL (its folder made, appended on request) with
-- NaN and infinities that read back.
-- Run: busted --lua=luajit tests/lua/log_spec.lua

local fsdp = require "fsdp"
local log = require "fsdp.log"
local core = require "fsdp.core"

local H = require "helpers"
teardown(H.remove_temps)
local sink = H.sink -- an output handle that keeps what is written

local function lines(text)
  local out = {}
  for l in text:gmatch("([^\n]*)\n") do out[#out + 1] = l end
  return out
end

-- A JSONL line read back (by the same codec: what matters here is what the line holds) and the
-- order of its keys in the text.
local function json_decode(line)
  local keys = {}
  for k in line:gmatch('[{,]"([^"]+)":') do keys[#keys + 1] = k end
  return core.json_decode(line, "jsonl", { nonfinite = true }), keys
end

-- A clock the test moves by hand.
local function fake_clock()
  local c = { t = 100 }
  c.fn = function() return c.t end
  return c
end

after_each(function() log.finish() end)

describe("fsdp.log", function()
  it("is the callable table the fsdp module exposes", function()
    assert.equal(log, fsdp.log)
    assert.equal("function", type(getmetatable(log).__call))
  end)

  it("formats step, metrics (loss first, then by name), throughput and ETA", function()
    assert.equal("step 12/500 | loss 2.3457 | 1234 tok/s | ETA 1m05s",
      log.format(12, { loss = 2.34567 }, 500, 1234.4, 65))
    assert.equal("step 3 | loss 0.5000 | acc 0.9100 | lr 3.000e-04 | n 7",
      log.format(3, { n = 7, lr = 3e-4, acc = 0.91, loss = 0.5, name = "skip", tokens = 99 }))
    assert.equal("step 1/10 | ETA 2h01m", log.format(1, {}, 10, nil, 7265))
    assert.equal("step 10/10 | elapsed 9s", log.format(10, {}, 10, nil, nil, 9.2))
  end)

  it("prints plain lines at step 1, every `every` steps and the last step off a terminal", function()
    local out, clock = sink(), fake_clock()
    log.setup { total = 100, out = out, progress = "line", clock = clock.fn, tokens_per_step = 1000 }
    for step = 1, 100 do
      clock.t = clock.t + 0.5
      log(step, { loss = 1 / step })
    end
    local ls = lines(out.text)
    -- default period: about 20 lines per run
    assert.equal(21, #ls)
    assert.equal("step 1/100 | loss 1", ls[1])
    assert.equal("step 5/100 | loss 0.2000 | 2000 tok/s | ETA 48s", ls[2])
    assert.equal("step 100/100 | loss 0.0100 | 2000 tok/s | elapsed 50s", ls[21])
    assert.is_nil(out.text:find("\r", 1, true))
  end)

  it("uses every= when given and every 10 steps without a total", function()
    local out = sink()
    log.setup { out = out, progress = "line", every = 3 }
    for step = 1, 9 do log(step, { loss = 1 }) end
    assert.equal(4, #lines(out.text)) -- 1, 3, 6, 9
    local out2 = sink()
    log.setup { out = out2, progress = "line" }
    for step = 1, 25 do log(step, { loss = 1 }) end
    local ls = lines(out2.text)
    assert.same({ "step 1 | loss 1", "step 10 | loss 1", "step 20 | loss 1" }, ls)
  end)

  it("takes throughput from metrics.tokens over tokens_per_step", function()
    local out, clock = sink(), fake_clock()
    log.setup { out = out, progress = "line", every = 1, clock = clock.fn, tokens_per_step = 10 }
    log(1, { tokens = 300 })
    clock.t = clock.t + 0.25
    log(2, { tokens = 300 })
    assert.equal("step 2 | 1200 tok/s", lines(out.text)[2])
  end)

  it("redraws one line on a terminal and ends it with finish()", function()
    local out, clock = sink(), fake_clock()
    log.setup { total = 4, out = out, progress = "bar", clock = clock.fn }
    log(1, { loss = 4 })
    clock.t = clock.t + 0.01
    log(2, { loss = 3 }) -- within 0.1 s of the last draw: skipped
    clock.t = clock.t + 1
    log(3, { loss = 2 })
    log(4, { loss = 1 }) -- the last step is always drawn
    log.print("evaluating")
    log.finish()
    local expected = "\r\27[Kstep 1/4 | loss 4"
      .. "\r\27[Kstep 3/4 | loss 2 | ETA 0s" -- 1 s to go at 0.8 * 0.01 + 0.2 * 1 s per step
      .. "\r\27[Kstep 4/4 | loss 1 | elapsed 1s"
      .. "\r\27[Kevaluating\n\r\27[Kstep 4/4 | loss 1 | elapsed 1s"
      .. "\n"
    assert.equal(expected, out.text)
  end)

  it("writes nothing on other ranks", function()
    local out = sink()
    local path = H.tmpname()
    log.setup { out = out, progress = "line", rank = 1, jsonl = path }
    log(1, { loss = 1 })
    log.print("x")
    log.finish()
    assert.equal("", out.text)
    local f = io.open(path, "rb")
    assert.equal("", f and f:read("*a") or "")
    if f then f:close() end
    os.remove(path)
  end)

  it("writes one JSON object per call with step, time and every metric", function()
    local path = H.tmpname()
    local clock = fake_clock()
    log.setup { jsonl = path, out = sink(), progress = "line", clock = clock.fn }
    clock.t = clock.t + 1.5
    log(1, { loss = 2.5, lr = 1e-3, note = 'a "q"\n\ttab\1', ok = true, acc = fsdp.tensor { 0.25 }:sum() })
    clock.t = clock.t + 1
    log(2, { loss = 0 / 0, sizes = { 1, 2 }, by = { a = 1 } })
    log.finish()
    local f = assert(io.open(path, "rb"))
    local text = f:read("*a")
    f:close()
    os.remove(path)
    local ls = lines(text)
    assert.equal(2, #ls)
    local r1, keys = json_decode(ls[1])
    assert.same({ "step", "time", "loss", "acc", "lr", "note", "ok" }, keys)
    assert.equal(1, r1.step)
    assert.equal(1.5, r1.time)
    assert.equal(2.5, r1.loss)
    assert.equal(1e-3, r1.lr)
    assert.equal(0.25, r1.acc)
    assert.equal('a "q"\n\ttab\1', r1.note)
    assert.is_true(r1.ok)
    local r2 = json_decode(ls[2])
    assert.equal(2, r2.step)
    assert.equal(2.5, r2.time)
    assert.is_true(r2.loss ~= r2.loss) -- NaN, written as the string "NaN"
    assert.truthy(ls[2]:find('"loss":"NaN"', 1, true))
    assert.same({ 1, 2 }, r2.sizes)
    assert.same({ a = 1 }, r2.by)
  end)

  it("encodes numbers so that they read back exactly, NaN and infinities as strings", function()
    for _, v in ipairs { 0.1, 1 / 3, -2.5e-300, 123456789012, 2 ^ 60, 1e21, math.huge, -math.huge } do
      assert.equal(v, core.json_decode(log.json(v), "v", { nonfinite = true }))
    end
    assert.equal('"Infinity"', log.json(math.huge))
    assert.equal('["NaN","-Infinity"]', log.json { 0 / 0, -1 / 0 })
    assert.equal('[1,"x",false,{"k":[2]}]', log.json { 1, "x", false, { k = { 2 } } })
  end)

  it("checks its arguments", function()
    local ok, err = pcall(log, "one", {})
    assert.is_false(ok)
    assert.truthy(err:find("step must be a number", 1, true))
    ok, err = pcall(log, 1, 5)
    assert.is_false(ok)
    assert.truthy(err:find("metrics must be a table", 1, true))
    ok, err = pcall(log.setup, { total = -1 })
    assert.is_false(ok)
    assert.truthy(err:find("total must be a positive number", 1, true))
    ok, err = pcall(log.setup, { jsonl = "/proc/version/x.jsonl" })
    assert.is_false(ok)
    assert.truthy(err:find("cannot make the JSONL file's folder", 1, true), err)
    ok, err = pcall(log.setup, { jsonl = "/proc/no-such-file" })
    assert.is_false(ok)
    assert.truthy(err:find("cannot open the JSONL file", 1, true), err)
    ok, err = pcall(log.setup, { tty = true })
    assert.is_false(ok)
    assert.truthy(err:find("unknown option 'tty' (valid: total, every, jsonl, append, progress,", 1, true), err)
    ok, err = pcall(log.setup, { progress = "fancy" })
    assert.is_false(ok)
    assert.truthy(err:find('progress must be "auto", "bar", "line" or "off", got fancy', 1, true), err)
  end)

  it("makes the JSONL file's folder", function()
    local dir = H.tmpname()
    local path = dir .. "/a/b/metrics.jsonl"
    log.setup { jsonl = path, out = sink(), progress = "line", rank = 0 }
    log(1, { loss = 1 })
    log.finish()
    local f = assert(io.open(path, "rb"))
    assert.equal(1, json_decode(f:read("*l")).step)
    f:close()
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("shows a step that carries a metric the previous one lacked, whatever the cadence", function()
    -- piped: the validation steps print although they are off the 25-step cadence
    local out = sink()
    log.setup { total = 100, every = 25, out = out, progress = "line" }
    for step = 1, 100 do
      local m = { loss = 1 }
      if step % 30 == 0 then m.val_loss = 2 end
      log(step, m)
    end
    local ls = lines(out.text:gsub(" | ETA [^\n]*", ""):gsub(" | elapsed [^\n]*", ""))
    assert.same({ "step 1/100 | loss 1", "step 25/100 | loss 1", "step 30/100 | loss 1 | val_loss 2",
      "step 50/100 | loss 1", "step 60/100 | loss 1 | val_loss 2", "step 75/100 | loss 1",
      "step 90/100 | loss 1 | val_loss 2", "step 100/100 | loss 1" }, ls)
    -- on a terminal: the validation step is drawn at once and its line stays; the bar goes on
    -- below it. A first line with a metric the next one lacks stays too.
    local clock = fake_clock()
    out = sink()
    log.setup { total = 6, out = out, progress = "bar", clock = clock.fn }
    log(1, { loss = 4, val_loss = 9 })
    clock.t = clock.t + 1
    log(2, { loss = 3 })
    clock.t = clock.t + 0.01
    log(3, { loss = 2, val_loss = 5 }) -- within 0.1 s of the last draw, drawn all the same
    clock.t = clock.t + 1
    log(4, { loss = 1 })
    log.print("saved")
    clock.t = clock.t + 1
    log(5, { loss = 0.5 })
    log.finish()
    local expected = "\r\27[Kstep 1/6 | loss 4 | val_loss 9"
      .. "\n\r\27[Kstep 2/6 | loss 3 | ETA 4s"
      .. "\r\27[Kstep 3/6 | loss 2 | val_loss 5 | ETA 2s"
      .. "\n\r\27[Kstep 4/6 | loss 1 | ETA 2s"
      .. "\r\27[Ksaved\n\r\27[Kstep 4/6 | loss 1 | ETA 2s"
      .. "\r\27[Kstep 5/6 | loss 0.5000 | ETA 1s"
      .. "\n"
    assert.equal(expected, out.text)
  end)

  it("prints no progress with progress = \"off\", and takes FSDP_PROGRESS as the default", function()
    local out = sink()
    log.setup { total = 3, out = out, progress = "off" }
    for step = 1, 3 do log(step, { loss = 1, val_loss = step == 2 and 1 or nil }) end
    log.print("kept")
    log.finish()
    assert.equal("kept\n", out.text)
    -- the environment (fsdprun --progress sets it) when setup names no mode; a mode of setup wins
    local ffi = require "ffi"
    pcall(ffi.cdef, "int setenv(const char *, const char *, int); int unsetenv(const char *);")
    ffi.C.setenv("FSDP_PROGRESS", "off", 1)
    out = sink()
    log.setup { out = out }
    log(1, { loss = 1 })
    log.setup { out = out, progress = "line" }
    log(1, { loss = 2 })
    ffi.C.setenv("FSDP_PROGRESS", "sideways", 1)
    local ok, err = pcall(log.setup, { out = out })
    ffi.C.unsetenv("FSDP_PROGRESS")
    assert.equal("step 1 | loss 2\n", out.text)
    assert.is_false(ok)
    assert.truthy(err:find("FSDP_PROGRESS must be auto, bar, line or off, got 'sideways'", 1, true), err)
  end)

  it("refuses a bad FSDP_PROGRESS without setup too, naming the function called", function()
    local ffi = require "ffi"
    pcall(ffi.cdef, "int setenv(const char *, const char *, int); int unsetenv(const char *);")
    -- a fresh module: its state is made on its first call, as in a recipe that skips setup
    local function fresh()
      package.loaded["fsdp.log"] = nil
      local l = require "fsdp.log"
      package.loaded["fsdp.log"] = log
      return l
    end
    ffi.C.setenv("FSDP_PROGRESS", "sideways", 1)
    local l1, l2 = fresh(), fresh()
    local ok1, err1 = pcall(l1, 1, { loss = 1 })
    local ok2, err2 = pcall(l2.print, "text")
    ffi.C.unsetenv("FSDP_PROGRESS")
    assert.is_false(ok1)
    assert.truthy(err1:find("fsdp.log: FSDP_PROGRESS must be auto, bar, line or off, got 'sideways'",
      1, true), err1)
    assert.is_false(ok2)
    assert.truthy(err2:find("fsdp.log.print: FSDP_PROGRESS must be auto, bar, line or off, got "
      .. "'sideways'", 1, true), err2)
  end)
end)

describe("fsdp.log JSONL append", function()
  it("continues an existing metrics file when append = true", function()
    local fsdp = require "fsdp"
    local path = H.tmpname()
    local sink = { write = function() end, flush = function() end }
    fsdp.log.setup { jsonl = path, out = sink, progress = "line", rank = 0 }
    fsdp.log(1, { loss = 2 })
    fsdp.log.finish()
    fsdp.log.setup { jsonl = path, out = sink, progress = "line", rank = 0, append = true }
    fsdp.log(2, { loss = 1 })
    fsdp.log.finish()
    local n = 0
    for line in io.lines(path) do if line:find('"step"') then n = n + 1 end end
    os.remove(path)
    assert.are.equal(2, n)
  end)

  it("starts on a line of its own after a record a killed run cut short", function()
    local fsdp = require "fsdp"
    local core = require "fsdp.core"
    local path = H.tmpname()
    local f = assert(io.open(path, "w"))
    f:write('{"step":5,"loss":1}\n{"step":6,"ti')
    f:close()
    local sink = { write = function() end, flush = function() end }
    fsdp.log.setup { jsonl = path, out = sink, progress = "line", rank = 0, append = true }
    fsdp.log(6, { loss = 0.5 })
    fsdp.log.finish()
    local lines = {}
    for line in io.lines(path) do lines[#lines + 1] = line end
    os.remove(path)
    assert.are.equal(3, #lines)
    assert.are.equal('{"step":6,"ti', lines[2])
    local ok, rec = pcall(core.json_decode, lines[3])
    assert.is_true(ok, rec)
    assert.are.equal(6, rec.step)
  end)
end)
