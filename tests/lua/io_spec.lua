-- io_spec.lua — the io binding of fsdp.core (src/lua/l_io.c): safetensors writers and readers,
-- JSON documents, the fault injector. Run: busted --lua=luajit tests/lua/io_spec.lua
-- (the C layer itself is tested by tests/c/test_io.c).

local core = require "fsdp.core"

local H = require "helpers"
teardown(H.remove_temps)
local assert_error_has, mktemp_dir, flat = H.assert_error_has, H.mktemp_dir, H.flat

local function read_file(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read "*a"
  f:close()
  return s
end

local function temps(dir)
  local p = io.popen("ls -A '" .. dir .. "'")
  local n = 0
  for name in p:lines() do if name:find(".tmp.", 1, true) then n = n + 1 end end
  p:close()
  return n
end

describe("safetensors", function()
  local dir
  before_each(function() dir = mktemp_dir() end)
  after_each(function() os.execute("rm -rf '" .. dir .. "'") end)

  local ENTRIES = {
    { name = "a", shape = { 2, 3 } },
    { name = "b", shape = {} },
    { name = "e", shape = { 10 }, dtype = "F32" },
  }

  local function write_model(path)
    local w = core.st_writer(path, ENTRIES, { format = "pt", z = "last", a = "first" })
    w:write("a", core.arange(6):view(3, 2):transpose(1, 2)) -- non-contiguous, any shape
    w:write("b", core.tensor { 7 })
    local e = core.arange(10)
    w:write("e", e:narrow(1, 1, 4)) -- a shard at a time
    w:write("e", e:narrow(1, 5, 6))
    w:commit()
  end

  it("writes a file that reads back whole and by 0-based element ranges", function()
    local path = dir .. "/m.safetensors"
    write_model(path)
    assert.equal(0, temps(dir))
    local r = core.st_open(path)
    assert.equal(path, r:path())
    local es = r:entries()
    assert.equal(3, #es)
    assert.same({ "a", "b", "e" }, { es[1].name, es[2].name, es[3].name })
    assert.same({ 2, 3 }, es[1].shape)
    assert.same({}, es[2].shape)
    assert.equal("F32", es[3].dtype)
    assert.same({ 0, 24, 28 }, { es[1].offset, es[2].offset, es[3].offset })
    assert.same({ 6, 1, 10 }, { es[1].numel, es[2].numel, es[3].numel })
    assert.matches("^%x+$", es[1].checksum)
    assert.equal(16, #es[1].checksum)
    local a = r:read("a")
    assert.same({ 2, 3 }, a:shape())
    assert.same({ 0, 2, 4, 1, 3, 5 }, flat(a))
    assert.same({ 7 }, flat(r:read("b")))
    assert.same({ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 }, flat(r:read("e")))
    local part = r:read("e", 3, 4)
    assert.same({ 4 }, part:shape())
    assert.same({ 3, 4, 5, 6 }, flat(part))
    assert.same({ 8, 9 }, flat(r:read("e", 8)))
    assert.same({ 0 }, r:read("e", 10):shape())
    local m = r:metadata()
    assert.equal("pt", m.format)
    assert.equal(es[3].checksum, m["fsdp.xxh3_64.e"])
    -- metadata is written sorted by key, after the header checksum
    local text = read_file(path)
    assert.truthy(text:find('"fsdp.header.xxh3_64":"%x+","a":"first","format":"pt","z":"last"'))
    r:verify("e")
    r:verify()
    assert_error_has(function() r:read("e", 8, 3) end, path, "tensor 'e'", "out of range")
    assert_error_has(function() r:read("e", -1) end, "first must be an integer >= 0")
    assert_error_has(function() r:read("nope") end, path, "tensor 'nope': no such tensor")
    assert.matches("3 tensors", tostring(r))
    r:close()
    r:close()
    assert_error_has(function() r:read("a") end, "the reader is closed")
    assert.matches("closed", tostring(r))
  end)

  it("reports a corrupted byte naming the file and the tensor", function()
    local path = dir .. "/m.safetensors"
    write_model(path)
    local s = read_file(path)
    local f = assert(io.open(path, "wb"))
    f:write(s:sub(1, #s - 1), string.char((s:byte(#s) + 1) % 256))
    f:close()
    local r = core.st_open(path)
    assert_error_has(function() r:read("e") end, path, "tensor 'e'", "checksum mismatch")
    assert_error_has(function() r:verify() end, "tensor 'e'", "checksum mismatch")
    r:read("e", 0, 9) -- a range is not checked
    r:close()
    f = assert(io.open(path, "wb"))
    f:write(s:sub(1, #s - 1))
    f:close()
    assert_error_has(function() core.st_open(path) end, path, "tensor 'e'", "truncated")
    assert_error_has(function() core.st_open(dir .. "/none") end, "none: cannot open")
  end)

  it("checks the writer's order and completeness, and leaves the old file on failure", function()
    local path = dir .. "/m.safetensors"
    write_model(path)
    local before = read_file(path)
    local w = core.st_writer(path, ENTRIES)
    assert_error_has(function() w:write("e", core.zeros(10)) end,
      "tensor 'e' written before 'a' is complete")
    assert_error_has(function() w:write("a", core.zeros(7)) end, "runs past its end")
    assert_error_has(function() w:write("a", 5) end, "tensor expected")
    w:write("a", core.zeros(6))
    assert_error_has(function() w:commit() end, "tensor 'b' is incomplete")
    assert_error_has(function() w:commit() end, "the writer is closed")
    assert_error_has(function() w:write("b", core.zeros(1)) end, "the writer is closed")
    assert.equal(before, read_file(path))
    assert.equal(0, temps(dir))
    -- abort, and a writer dropped without commit
    w = core.st_writer(path, ENTRIES)
    w:write("a", core.ones(6))
    w:abort()
    w:abort()
    core.st_writer(dir .. "/dropped.safetensors", ENTRIES):write("a", core.ones(6))
    collectgarbage()
    collectgarbage()
    assert.equal(0, temps(dir))
    assert.is_nil(io.open(dir .. "/dropped.safetensors"))
    assert.equal(before, read_file(path))
    -- an injected disk-full error names the file; the previous file stays
    core.io_fault("write", "ENOSPC", 30)
    assert_error_has(function() write_model(path) end, path, "No space left on device")
    collectgarbage()
    assert.equal(before, read_file(path))
    assert.equal(0, temps(dir))
    core.io_fault("rename", "EIO")
    assert_error_has(function() write_model(path) end, "cannot rename")
    assert.equal(before, read_file(path))
    core.io_fault("open", 13)
    assert_error_has(function() core.st_writer(path, ENTRIES) end, "Permission denied")
    core.io_fault("open", "EACCES")
    core.io_fault("none")
    write_model(path)
    assert_error_has(function() core.io_fault("bogus", "EIO") end, "unknown point")
    assert_error_has(function() core.io_fault("write", "EBOGUS") end, "unknown errno name")
  end)

  it("rejects bad entries and metadata with clear messages", function()
    local p = dir .. "/x.safetensors"
    assert_error_has(function() core.st_writer(p, { { shape = { 1 } } }) end,
      "entries[1].name must be a string")
    assert_error_has(function() core.st_writer(p, { { name = "x" } }) end,
      "entries[1] ('x'): shape must be a table")
    assert_error_has(function() core.st_writer(p, { { name = "x", shape = { -1 } } }) end,
      "size 1 is negative")
    assert_error_has(function() core.st_writer(p, { { name = "x", shape = { 1 }, dtype = "I16" } })
    end, "entries[1] ('x'): dtype must be one of F32, BF16", "got I16")
    assert_error_has(function() core.st_writer(p, { { name = "x", shape = { 1 }, dtype = 3 } })
    end, "dtype must be one of", "got number")
    assert_error_has(function()
      core.st_writer(p, { { name = "x", shape = { 1 } }, { name = "x", shape = { 1 } } })
    end, "tensor 'x' appears twice")
    assert_error_has(function() core.st_writer(p, {}, { k = 1 }) end,
      "metadata value of 'k' must be a string")
    assert_error_has(function() core.st_writer(p, {}, { [1] = "v" }) end,
      "metadata keys must be strings")
    assert_error_has(function() core.st_writer(p, {}, { ["fsdp.header.xxh3_64"] = "v" }) end,
      "reserved")
    assert.equal(0, temps(dir))
  end)
end)

describe("safetensors dtypes", function()
  local dir
  before_each(function() dir = mktemp_dir() end)
  after_each(function() os.execute("rm -rf '" .. dir .. "'") end)

  -- bit patterns that only an exact round trip keeps
  local function bits(t) return core.tensor(t:view { t:numel() }:to("f64"):totable(), { dtype = "f64" }) end

  it("stores each tensor in its own dtype and reads it back as that dtype, bit for bit", function()
    local path = dir .. "/d.safetensors"
    local src = {
      f32 = core.tensor({ 1.5, -0.0, 1e-40, 3.4e38 }),
      bf16 = core.tensor({ 1, -2.5, 3.140625, 65280 }, { dtype = "bf16" }),
      f16 = core.tensor({ 0.5, -65504, 6e-8, 1 }, { dtype = "f16" }),
      f64 = core.tensor({ 0.1, -1e300, 5e-324, 2 ^ 60 }, { dtype = "f64" }),
      i64 = core.tensor({ -3, 2 ^ 40, 2 ^ 53, 0 }, { dtype = "i64" }),
      i32 = core.tensor({ -2147483648, 2147483647, 7, 0 }, { dtype = "i32" }),
      u8 = core.tensor({ 0, 255, 128, 1 }, { dtype = "u8" }),
      bool = core.tensor({ 1, 0, 0, 1 }, { dtype = "bool" }),
    }
    local order = { "f32", "bf16", "f16", "f64", "i64", "i32", "u8", "bool" }
    local entries = {}
    for i, dt in ipairs(order) do
      -- the format's names and the tensor names are both accepted
      entries[i] = { name = dt, shape = { 2, 2 }, dtype = i % 2 == 0 and dt or dt:upper() }
    end
    local w = core.st_writer(path, entries)
    for _, dt in ipairs(order) do w:write(dt, src[dt]:view(2, 2)) end
    w:commit()
    local r = core.st_open(path)
    local names = { f32 = "F32", bf16 = "BF16", f16 = "F16", f64 = "F64", i64 = "I64", i32 = "I32",
      u8 = "U8", bool = "BOOL" }
    for i, e in ipairs(r:entries()) do
      assert.equal(order[i], e.name)
      assert.equal(names[order[i]], e.dtype)
      assert.equal(order[i], e.tensor_dtype)
      assert.equal(4, e.numel)
    end
    for _, dt in ipairs(order) do
      local t = r:read(dt)
      assert.equal(dt, t:dtype())
      assert.same({ 2, 2 }, t:shape())
      assert.same(flat(bits(src[dt])), flat(bits(t)))
      local part = r:read(dt, 1, 2)
      assert.equal(dt, part:dtype())
      assert.same({ flat(bits(src[dt]))[2], flat(bits(src[dt]))[3] }, flat(bits(part)))
    end
    -- the bytes in the file are the tensor's: a bf16 element takes 2 bytes
    local es = r:entries()
    assert.equal(es[2].offset + 8, es[3].offset)
    r:close()
  end)

  it("converts into a tensor of another dtype, and from a tensor of another dtype", function()
    local path = dir .. "/c.safetensors"
    local w = core.st_writer(path, {
      { name = "bf", shape = { 3 }, dtype = "BF16" },
      { name = "f", shape = { 4 } },
      { name = "f_as_bf", shape = { 4 }, dtype = "bf16" },
      { name = "i", shape = { 2 }, dtype = "I64" },
    })
    local f = core.tensor({ 1 + 2 ^ -8, 1 + 3 * 2 ^ -8, 1 / 0, 0 / 0 })
    w:write("bf", core.tensor({ 1, -3, 0.5 }, { dtype = "bf16" }))
    w:write("f", f)
    w:write("f_as_bf", f) -- converted on write, rounding to nearest even
    w:write("i", core.tensor({ 7, -7 }, { dtype = "i64" }))
    w:commit()
    local r = core.st_open(path)
    assert.same({ 1, -3, 0.5 }, flat(r:read("bf", 0, 3, core.zeros(3)))) -- bf16 -> f32
    local b = r:read("f", 0, 4, core.zeros({ 4 }, { dtype = "bf16" }))
    local want = { 1, 1 + 2 ^ -6, 1 / 0 } -- ties to even: 1 and 1 + 4 * 2^-8
    for k = 1, 3 do assert.equal(want[k], flat(b)[k]) end
    assert.is_true(flat(b)[4] ~= flat(b)[4]) -- NaN stays NaN
    local b2 = r:read("f_as_bf")
    assert.equal("bf16", b2:dtype())
    for k = 1, 3 do assert.equal(flat(b)[k], flat(b2)[k]) end
    assert.is_true(flat(b2)[4] ~= flat(b2)[4])
    assert.same({ 7, -7 }, flat(r:read("i", 0, 2, core.zeros(2)))) -- i64 -> f32
    -- inf saturates, NaN gives 0
    assert.same({ 2147483647, 0 }, flat(r:read("f", 2, 2, core.zeros({ 2 }, { dtype = "i32" }))))
    assert_error_has(function() r:read("f", 0, 4, core.zeros(4):view(2, 2):transpose(1, 2)) end,
      "out must be a contiguous tensor of 4 elements")
    assert_error_has(function() r:read("f", 0, 3, core.zeros(4)) end, "out must be a contiguous")
    r:close()
  end)

  it("refuses the format's dtypes that are no tensor dtype, naming the tensor and both dtypes", function()
    local path = dir .. "/s.safetensors"
    local f = assert(io.open(path, "wb"))
    local json = '{"s":{"dtype":"I16","shape":[2],"data_offsets":[0,4]}}'
    local n = #json
    local len = ""
    for i = 0, 7 do len = len .. string.char(math.floor(n / 256 ^ i) % 256) end
    f:write(len, json, "\1\0\2\0")
    f:close()
    local r = core.st_open(path)
    assert.equal("I16", r:entries()[1].dtype)
    assert.is_nil(r:entries()[1].tensor_dtype)
    assert_error_has(function() r:read("s") end, path, "tensor 's': stored dtype I16 has no tensor dtype")
    assert_error_has(function() r:read("s", 0, 2, core.zeros(2)) end,
      "tensor 's': stored dtype I16 has no tensor dtype, so it cannot be read as f32")
    r:close()
  end)
end)

describe("json", function()
  local dir
  before_each(function() dir = mktemp_dir() end)
  after_each(function() os.execute("rm -rf '" .. dir .. "'") end)

  it("round-trips tables, exact numbers and UTF-8 strings", function()
    local path = dir .. "/index.json"
    local doc = {
      world_size = 4,
      step = 50,
      big = 2 ^ 53 - 1,
      odd = 2 ^ 52 + 1,
      neg = -123456789012,
      third = 1 / 3,
      tenth = 0.1,
      tiny = 5e-324,
      name = "ckpt \"α\"\n",
      ok = true,
      no = false,
      files = { "rank0.st", "rank1.st" },
      nested = { { a = 1 }, { b = { 1, 2, { 3 } } } },
      empty = {},
    }
    core.json_write(path, doc)
    assert.equal(0, temps(dir))
    local back = core.json_read(path)
    assert.same(doc, back)
    assert.equal(2 ^ 52 + 1, back.odd)
    assert.equal(1 / 3, back.third)
    local text = read_file(path)
    assert.truthy(text:find('"big":%s*9007199254740991'))
    assert.truthy(text:find('"tenth":%s*0.1[,\n]'))
    -- keys sorted: the same table gives the same bytes
    core.json_write(path, doc)
    assert.equal(text, read_file(path))
    -- non-table roots
    core.json_write(path, "just a string")
    assert.equal("just a string", core.json_read(path))
    core.json_write(path, 42)
    assert.equal(42, core.json_read(path))
  end)

  it("names the value that JSON cannot hold", function()
    local path = dir .. "/bad.json"
    local cyc = {}
    cyc.self = cyc
    assert_error_has(function() core.json_write(path, cyc) end, "nested deeper than 64")
    assert_error_has(function() core.json_write(path, { a = { f = print } }) end,
      "$.a.f is a function")
    assert_error_has(function() core.json_write(path, { 1, 2, x = 3 }) end, "$ mixes string keys")
    assert_error_has(function() core.json_write(path, { [1] = 1, [3] = 3 }) end, "holes")
    assert_error_has(function() core.json_write(path, { x = 0 / 0 }) end, "$.x is", "JSON cannot hold")
    assert_error_has(function() core.json_write(path, { x = 1 / 0 }) end, "$.x is")
    assert_error_has(function() core.json_write(path, { x = "a\0b" }) end, "zero byte")
    assert_error_has(function() core.json_write(path, { x = "\255" }) end, "not valid UTF-8")
    assert_error_has(function() core.json_write(path, { [true] = 1 }) end, "boolean key")
    assert.is_nil(io.open(path))
    assert.equal(0, temps(dir))
    local f = assert(io.open(path, "w"))
    f:write '{"a": [1, 2,]}'
    f:close()
    assert_error_has(function() core.json_read(path) end, path, "not valid JSON", "line 1")
    assert_error_has(function() core.json_read(dir .. "/none.json") end, "none.json: cannot open")
    f = assert(io.open(path, "w"))
    f:write '{"a": null, "b": [1, null, 3]}'
    f:close()
    local v = core.json_read(path)
    assert.is_nil(v.a)
    assert.equal(3, v.b[3])
    core.io_fault("rename", "EIO")
    assert_error_has(function() core.json_write(path, { x = 1 }) end, path, "cannot rename")
    assert.equal(3, core.json_read(path).b[3])
  end)

  it("writes NaN and infinities as asked, and puts chosen keys first", function()
    local v = { b = 1, a = 0 / 0, z = { 1 / 0, -1 / 0 }, step = 3 }
    assert_error_has(function() core.json_encode(v) end, "json_encode: $.a is", "JSON cannot hold")
    assert.equal('{"a":null,"b":1,"step":3,"z":[null,null]}', core.json_encode(v, { nonfinite = "null" }))
    assert.equal('{"step":3,"z":["Infinity","-Infinity"],"a":"NaN","b":1}',
      core.json_encode(v, { nonfinite = "string", first = { "step", "missing", "z" } }))
    local path = dir .. "/nf.json"
    core.json_write(path, v, { nonfinite = "string" })
    assert.equal("NaN", core.json_read(path).a)
    assert_error_has(function() core.json_encode(v, { nonfinite = "zero" }) end,
      'nonfinite must be "error", "null" or "string", got zero')
    assert_error_has(function() core.json_encode(v, { sorted = true }) end,
      "json_encode: unknown option 'sorted' (valid: nonfinite, first)")
    assert_error_has(function() core.json_encode(v, { first = "step" }) end, "first must be a list of keys")
  end)

  it("reads NaN and infinities back on request, null as a chosen value, errors as values", function()
    local text = '{"a":"NaN","b":Infinity,"c":[-Infinity,"-Infinity"],"d":null,"s":"Infinity!","t":"NaN"}'
    assert_error_has(function() core.json_decode(text, "m") end, "m: not valid JSON: error at line 1, column 16")
    local null = {}
    local v = core.json_decode(text, "m", { nonfinite = true, null = null })
    assert.is_true(v.a ~= v.a)
    assert.equal(math.huge, v.b)
    assert.same({ -math.huge, -math.huge }, v.c)
    assert.equal(null, v.d)
    assert.equal("Infinity!", v.s)
    assert.equal("NaN", core.json_decode('{"t":"NaN"}').t) -- without the option a string stays one
    local r, msg, line, col = core.json_decode('{"a":1,\n "b":NaN,\n "c":}', "m", { nonfinite = true, raise = false })
    assert.is_nil(r)
    assert.truthy(msg:find("m: not valid JSON: error at line 3, column 6 (unexpected '}')", 1, true), msg)
    assert.equal(3, line)
    assert.equal(6, col)
    r, msg, line, col = core.json_decode('{"a":[1,2', "m", { raise = false })
    assert.truthy(msg:find("(unexpected end of text)", 1, true), msg)
    assert.same({ 1, 10 }, { line, col })
    assert_error_has(function() core.json_decode("{}", "m", { strict = true }) end,
      "json_decode: unknown option 'strict' (valid: nonfinite, null, raise)")
  end)
end)
