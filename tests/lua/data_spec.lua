-- data_spec.lua — fsdp.data and its C helpers: IDX parsing (plain and gzip), Fashion-MNIST
-- shapes and ranges, seeded shuffling, rank slicing of global batches, the text loader's file
-- rules, splits and windows, encode/decode, and every error the loaders give.
-- Run: busted --lua=luajit tests/lua/data_spec.lua

local fsdp = require "fsdp"
local data = require "fsdp.data"
local core = require "fsdp.core"

local FASHION = "/usr/share/datasets/fashion-mnist"
local FORTUNES = "/usr/share/games/fortunes"

local H = require "helpers"
local assert_error_has, flat = H.assert_error_has, H.flat
local mktemp_dir, write = H.mktemp_dir, H.write_file
teardown(H.remove_temps)

local function be32(n)
  return string.char(math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
    math.floor(n / 256) % 256, n % 256)
end

-- An IDX file of unsigned bytes: dims and a function giving byte i (0-based).
local function idx_bytes(dims, byte_at, magic3)
  local parts = { string.char(0, 0, magic3 or 0x08, #dims) }
  local n = 1
  for _, d in ipairs(dims) do parts[#parts + 1] = be32(d); n = n * d end
  local body = {}
  for i = 0, n - 1 do body[#body + 1] = string.char(byte_at(i)) end
  parts[#parts + 1] = table.concat(body)
  return table.concat(parts)
end

-- A fake Fashion-MNIST folder with n examples of 2x2 images: every pixel of image i is i (so
-- a batch row names its example) and label i is i % 10.
local function fake_fashion(n, prefix)
  local dir = mktemp_dir()
  prefix = prefix or "train"
  write(dir .. "/" .. prefix .. "-images-idx3-ubyte.gz",
    idx_bytes({ n, 2, 2 }, function(i) return math.floor(i / 4) end))
  write(dir .. "/" .. prefix .. "-labels-idx1-ubyte.gz",
    idx_bytes({ n }, function(i) return i % 10 end))
  return dir
end

-- The example ids (pixel value * 255 / 1) of the rows of x.
local function ids_of(x)
  local ids = {}
  local rows = x:totable()
  for i, r in ipairs(rows) do ids[i] = math.floor(r[1] * 255 + 0.5) end
  return ids
end

local function collect(iter)
  local out = {}
  for step, x, y in iter do out[#out + 1] = { step = step, x = x, y = y } end
  return out
end

describe("C helpers", function()
  it("gunzip reads gzip and plain files, whole or a prefix, and names the path on errors", function()
    local dir = mktemp_dir()
    write(dir .. "/plain", "hello, world")
    assert.equal("hello, world", core.gunzip(dir .. "/plain"))
    assert.equal("hello", core.gunzip(dir .. "/plain", 5))
    assert.equal(0, os.execute("gzip -c '" .. dir .. "/plain' > '" .. dir .. "/z.gz'"))
    assert.equal("hello, world", core.gunzip(dir .. "/z.gz"))
    assert_error_has(function() core.gunzip(dir .. "/missing.gz") end,
      "gunzip: cannot open", dir .. "/missing.gz", "No such file")
    -- a gzip stream cut short is an error, not a short string
    local z = io.open(dir .. "/z.gz", "rb"):read("*a")
    local big = string.rep("abcdefghij", 10000)
    write(dir .. "/big", big)
    os.execute("gzip -c '" .. dir .. "/big' > '" .. dir .. "/big.gz'")
    local gz = io.open(dir .. "/big.gz", "rb"):read("*a")
    assert.is_true(#z > 0)
    write(dir .. "/cut.gz", gz:sub(1, math.floor(#gz / 2)))
    assert_error_has(function() core.gunzip(dir .. "/cut.gz") end, dir .. "/cut.gz")
    assert_error_has(function() core.gunzip(dir .. "/plain", -1) end, "max_bytes")
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("from_bytes scales bytes into a tensor and checks bounds", function()
    local t = core.from_bytes("\0\1\2\255xyz", 1, { 2, 2 }, 0.5)
    assert.same({ 2, 2 }, t:shape())
    assert.same({ 0.5, 1, 127.5, 60 }, flat(t))
    assert.equal("f32", t:dtype())
    -- another dtype: the same f32 values converted by the one rule (labels are i64)
    local l = core.from_bytes("\0\1\2\255", 0, { 4 }, 1, "i64")
    assert.equal("i64", l:dtype())
    assert.same({ 0, 1, 2, 255 }, flat(l))
    assert.same({ 0, 0.5, 1, 127.5 }, flat(core.from_bytes("\0\1\2\255", 0, { 4 }, 0.5, "bf16")))
    assert_error_has(function() core.from_bytes("abc", 0, { 1 }, 1, "f8") end, "f8")
    assert_error_has(function() core.from_bytes("abc", 1, { 3 }, 1) end,
      "from_bytes", "3 bytes at offset 1", "3 bytes")
    assert_error_has(function() core.from_bytes("abc", -1, { 1 }, 1) end, "from_bytes")
    assert_error_has(function() core.from_bytes("abc", 0.5, { 1 }, 1) end, "integer")
  end)

  it("index_rows gathers rows (1-based) and checks every index", function()
    local t = fsdp.tensor { { 1, 2 }, { 3, 4 }, { 5, 6 } }
    assert.same({ { 5, 6 }, { 1, 2 }, { 5, 6 } }, core.index_rows(t, { 3, 1, 3 }):totable())
    local v = fsdp.tensor { 7, 8, 9 }
    assert.same({ 9, 7 }, core.index_rows(v, { 3, 1 }):totable())
    -- a transposed (non-contiguous) tensor gives its logical rows
    assert.same({ { 2, 4, 6 } }, core.index_rows(t:transpose(1, 2), { 2 }):totable())
    assert_error_has(function() core.index_rows(t, { 4 }) end, "idx[1] = 4", "[1, 3]")
    assert_error_has(function() core.index_rows(t, { 1, 0 }) end, "idx[2] = 0")
    assert_error_has(function() core.index_rows(t, { "a" }) end, "idx[1] must be a number")
    assert_error_has(function() core.index_rows({}, { 1 }) end, "tensor expected")
  end)

  it("byte_windows cuts x and the one-byte-shifted y, 0-based starts, bounds checked", function()
    local x, y = core.byte_windows("abcdefgh", { 0, 4 }, 3)
    assert.same({ 2, 3 }, x:shape())
    assert.same({ { 97, 98, 99 }, { 101, 102, 103 } }, x:totable())
    assert.same({ { 98, 99, 100 }, { 102, 103, 104 } }, y:totable())
    -- ids are integers: a mixed-precision model's input cast leaves them alone
    assert.equal("i64", x:dtype())
    assert.equal("i64", y:dtype())
    assert_error_has(function() core.byte_windows("abcdefgh", { 5 }, 3) end,
      "starts[1] = 5", "[0, 4]")
    assert_error_has(function() core.byte_windows("abc", { 0 }, 3) end, "need 4 bytes")
    assert_error_has(function() core.byte_windows("abc", { 0 }, 0) end, ">= 1")
  end)

  it("file_kind and list_dir see links as links", function()
    local dir = mktemp_dir()
    write(dir .. "/f", "x")
    os.execute("ln -s f '" .. dir .. "/l'; mkdir '" .. dir .. "/d'")
    assert.equal("file", core.file_kind(dir .. "/f"))
    assert.equal("link", core.file_kind(dir .. "/l"))
    assert.equal("dir", core.file_kind(dir .. "/d"))
    local k, err = core.file_kind(dir .. "/none")
    assert.is_nil(k)
    assert.truthy(err:find("No such file", 1, true))
    local kinds = {}
    for _, e in ipairs(core.list_dir(dir)) do kinds[e.name] = e.kind end
    assert.same({ f = "file", l = "link", d = "dir" }, kinds)
    assert_error_has(function() core.list_dir(dir .. "/none") end, "list_dir", "none")
    os.execute("rm -rf '" .. dir .. "'")
  end)
end)

describe("read_idx", function()
  local dir
  before_each(function() dir = mktemp_dir() end)
  after_each(function() os.execute("rm -rf '" .. dir .. "'") end)

  it("parses the magic and big-endian dims of a plain and a gzip IDX file", function()
    local bytes = idx_bytes({ 3, 2, 2 }, function(i) return i * 10 end)
    write(dir .. "/a.idx", bytes)
    local dims, t = data.read_idx(dir .. "/a.idx")
    assert.same({ 3, 2, 2 }, dims)
    assert.same({ 3, 2, 2 }, t:shape())
    assert.same({ 0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110 }, flat(t))
    os.execute("gzip -c '" .. dir .. "/a.idx' > '" .. dir .. "/a.idx.gz'")
    local d2, t2 = data.read_idx(dir .. "/a.idx.gz", { limit = 2, scale = 0.1 })
    assert.same({ 2, 2, 2 }, d2)
    local v = flat(t2)
    assert.equal(8, #v)
    assert.near(7, v[8], 1e-5)
    -- dims above 255 exercise every byte of the big-endian count
    write(dir .. "/b.idx", idx_bytes({ 300 }, function(i) return i % 256 end))
    local d3, t3 = data.read_idx(dir .. "/b.idx")
    assert.same({ 300 }, d3)
    assert.equal(43, flat(t3)[300])
    assert.equal("f32", t3:dtype())
    local _, t4 = data.read_idx(dir .. "/b.idx", { dtype = "i64" })
    assert.equal("i64", t4:dtype())
    assert.same(flat(t3), flat(t4))
  end)

  it("rejects a bad magic, another element type and a truncated body", function()
    write(dir .. "/bad", "\1\2\8\1" .. be32(1) .. "x")
    assert_error_has(function() data.read_idx(dir .. "/bad") end, "not an IDX file")
    write(dir .. "/f32", idx_bytes({ 1 }, function() return 0 end, 0x0D))
    assert_error_has(function() data.read_idx(dir .. "/f32") end, "element type 0x0d")
    write(dir .. "/short", idx_bytes({ 4, 2 }, function() return 1 end):sub(1, -3))
    assert_error_has(function() data.read_idx(dir .. "/short") end, "truncated")
    assert_error_has(function() data.read_idx(dir .. "/none") end, "cannot open",
      dir .. "/none")
  end)
end)

describe("fashion_mnist", function()
  it("loads the real files: shapes, pixel range, labels 0..9", function()
    local tr = data.fashion_mnist { split = "train", batch = 32, limit = 500 }
    assert.equal(500, tr:size())
    assert.same({ 500, 784 }, tr.images:shape())
    assert.same({ 500 }, tr.labels:shape())
    assert.is_true(tr.images:max() <= 1)
    assert.is_true(tr.images:max() > 0.99)
    assert.is_true((-tr.images):max() <= 0)
    local seen = {}
    for _, l in ipairs(flat(tr.labels)) do
      assert.is_true(l >= 0 and l <= 9 and l % 1 == 0)
      seen[l] = true
    end
    for c = 0, 9 do assert.is_true(seen[c], "class " .. c .. " missing from 500 examples") end
    assert.equal("f32", tr.images:dtype())
    assert.equal("i64", tr.labels:dtype())
    local te = data.fashion_mnist { split = "test", batch = 100, limit = 200 }
    assert.equal(200, te:size())
    assert.is_false(te.shuffle)
    assert.is_true(tr.shuffle)
    for step, x, y in tr:batches(2) do
      assert.same({ 32, 784 }, x:shape())
      assert.same({ 32 }, y:shape())
      assert.equal("f32", x:dtype())
      assert.equal("i64", y:dtype())
      assert.equal(tr.cursor, step)
    end
    for _, x, y in te:epoch() do
      assert.equal("f32", x:dtype())
      assert.equal("i64", y:dtype())
      -- accuracy as recipes count it: argmax (i64) against the labels (i64), and against f32
      -- labels (the comparison promotes); logits one-hot at the label, so every answer is right
      local eye = {}
      for i = 1, 10 do
        eye[i] = {}
        for j = 1, 10 do eye[i][j] = i == j and 1 or 0 end
      end
      local pred = fsdp.F.embedding(y, fsdp.tensor(eye)):argmax()
      assert.equal("i64", pred:dtype())
      assert.equal(100, pred:eq(y):to("i64"):sum():item())
      assert.equal(100, pred:eq(y:to("f32")):to("i64"):sum():item())
      assert.equal(0, pred:eq(y + 1):to("i64"):sum():item())
      break
    end
  end)

  it("says how to install the data when the files are missing", function()
    local dir = mktemp_dir()
    assert_error_has(function() data.fashion_mnist { batch = 8, dir = dir } end,
      dir .. "/train-images-idx3-ubyte.gz", "install dataset-fashion-mnist",
      "scripts/install-deps")
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("checks its options", function()
    local dir = fake_fashion(12)
    assert_error_has(function() data.fashion_mnist { dir = dir } end, "batch must be a positive integer")
    assert_error_has(function() data.fashion_mnist { dir = dir, batch = 0 } end, "batch")
    assert_error_has(function() data.fashion_mnist { dir = dir, batch = 2.5 } end, "batch")
    for _, limit in ipairs { 0, 1.5, 0 / 0, math.huge } do
      assert_error_has(function() data.fashion_mnist { dir = dir, batch = 4, limit = limit } end,
        "data_spec.lua:", "fsdp.data.fashion_mnist: limit must be a positive integer, got " .. tostring(limit))
    end
    assert_error_has(function() data.fashion_mnist { dir = dir, batch = 4, split = "val" } end,
      'split must be "train" or "test"')
    assert_error_has(function() data.fashion_mnist { dir = dir, batch = 4, shuffle = "no" } end,
      "data_spec.lua:", "fsdp.data.fashion_mnist: shuffle must be a boolean, got string no")
    assert.is_false(data.fashion_mnist { dir = dir, batch = 4, shuffle = false }.shuffle)
    assert_error_has(function() data.fashion_mnist { dir = dir, batch = 4, rank = 2, world_size = 2 } end,
      "rank 2 is not in [0, 2)")
    local l = data.fashion_mnist { dir = dir, batch = 6, world_size = 4 }
    assert_error_has(function() l:batches(1) end, "batch 6", "world size 4")
    local big = data.fashion_mnist { dir = dir, batch = 16 }
    assert_error_has(function() big:batches(1) end, "batch 16 is larger", "12 examples")
    assert_error_has(function() l:batches(0) end, "n must be a positive integer")
    -- images and labels that disagree
    write(dir .. "/train-labels-idx1-ubyte.gz", idx_bytes({ 11 }, function() return 1 end))
    assert_error_has(function() data.fashion_mnist { dir = dir, batch = 4 } end, "do not match")
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("shuffles with a seeded permutation per epoch, covering each epoch exactly once", function()
    local dir = fake_fashion(12)
    local l = data.fashion_mnist { dir = dir, batch = 4, seed = 7 }
    local b = collect(l:batches(6)) -- two epochs of three batches
    local function epoch_ids(from)
      local ids = {}
      for i = from, from + 2 do for _, id in ipairs(ids_of(b[i].x)) do ids[#ids + 1] = id end end
      return ids
    end
    local e1, e2 = epoch_ids(1), epoch_ids(4)
    local s1, s2 = { unpack(e1) }, { unpack(e2) }
    table.sort(s1); table.sort(s2)
    local all = {}
    for i = 0, 11 do all[#all + 1] = i end
    assert.same(all, s1)
    assert.same(all, s2)
    assert.are_not.same(e1, e2)
    assert.are_not.same(all, e1)
    -- labels follow their images
    for _, r in ipairs(b) do
      local ids, ys = ids_of(r.x), flat(r.y)
      for i = 1, #ids do assert.equal(ids[i] % 10, ys[i]) end
    end
    -- same seed, same order; another seed, another order
    local again = collect(data.fashion_mnist { dir = dir, batch = 4, seed = 7 }:batches(6))
    for i = 1, 6 do assert.same(ids_of(b[i].x), ids_of(again[i].x)) end
    local other = collect(data.fashion_mnist { dir = dir, batch = 4, seed = 8 }:batches(3))
    local eo = {}
    for i = 1, 3 do for _, id in ipairs(ids_of(other[i].x)) do eo[#eo + 1] = id end end
    assert.are_not.same(e1, eo)
    -- shuffle = false is file order, and the remainder of an epoch is dropped
    local plain = collect(data.fashion_mnist { dir = dir, batch = 5, shuffle = false }:batches(3))
    assert.same({ 0, 1, 2, 3, 4 }, ids_of(plain[1].x))
    assert.same({ 5, 6, 7, 8, 9 }, ids_of(plain[2].x))
    assert.same({ 0, 1, 2, 3, 4 }, ids_of(plain[3].x))
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("gives each rank its contiguous slice of the same global batch", function()
    local dir = fake_fashion(24)
    local whole = collect(data.fashion_mnist { dir = dir, batch = 6, seed = 3 }:batches(5))
    for _, world in ipairs { 2, 3, 6 } do
      local per_rank = {}
      for r = 0, world - 1 do
        per_rank[r] = collect(data.fashion_mnist { dir = dir, batch = 6, seed = 3, rank = r,
          world_size = world }:batches(5))
      end
      for s = 1, 5 do
        local joined = {}
        for r = 0, world - 1 do
          assert.same({ 6 / world, 4 }, per_rank[r][s].x:shape())
          assert.equal(s, per_rank[r][s].step)
          for _, id in ipairs(ids_of(per_rank[r][s].x)) do joined[#joined + 1] = id end
        end
        assert.same(ids_of(whole[s].x), joined)
      end
    end
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("continues from its cursor across batches() calls", function()
    local dir = fake_fashion(12)
    local a = collect(data.fashion_mnist { dir = dir, batch = 4, seed = 1 }:batches(5))
    local l = data.fashion_mnist { dir = dir, batch = 4, seed = 1 }
    local b = collect(l:batches(2))
    for _, r in ipairs(collect(l:batches(3))) do b[#b + 1] = r end
    for i = 1, 5 do
      assert.equal(i, b[i].step)
      assert.same(ids_of(a[i].x), ids_of(b[i].x))
    end
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("epoch() walks the split in order with a smaller last batch", function()
    local dir = fake_fashion(10)
    local l = data.fashion_mnist { dir = dir, batch = 4 }
    local e = collect(l:epoch())
    assert.equal(3, #e)
    assert.same({ 0, 1, 2, 3 }, ids_of(e[1].x))
    assert.same({ 8, 9 }, ids_of(e[3].x))
    assert.same({ 8, 9 }, flat(e[3].y))
    assert.equal(1, #collect(l:epoch { batch = 10 }))
    os.execute("rm -rf '" .. dir .. "'")
  end)
end)

describe("the seeded generator", function()
  it("is a fixed, documented stream (changing it changes every run's data order)", function()
    assert.same({ 1, 5, 2, 4, 8, 3, 6, 7, 9, 10 }, data.permutation(10, 42, 0))
    assert.same({ 3, 2, 10, 8, 6, 7, 1, 5, 9, 4 }, data.permutation(10, 0, 0))
    local r = data.Rng.new(1234, 5)
    local v = { r:u32(), r:u32() }
    for _, x in ipairs(v) do assert.is_true(x >= 0 and x < 2 ^ 32 and x % 1 == 0) end
    local r2 = data.Rng.new(1234, 5)
    assert.same(v, { r2:u32(), r2:u32() })
    local r3 = data.Rng.new(1234, 6)
    assert.are_not.same(v, { r3:u32(), r3:u32() })
  end)

  it("draws below n roughly uniformly", function()
    local r = data.Rng.new(0, 0)
    local counts = { 0, 0, 0, 0 }
    for _ = 1, 4000 do local k = r:below(4) + 1; counts[k] = counts[k] + 1 end
    for k = 1, 4 do assert.is_true(counts[k] > 850 and counts[k] < 1150, tostring(counts[k])) end
  end)
end)

describe("text", function()
  local dir
  local A = string.rep("the quick brown fox jumps over the lazy dog. ", 4) -- 180 bytes
  local B = string.rep("0123456789", 10)                                    -- 100 bytes
  before_each(function()
    dir = mktemp_dir()
    write(dir .. "/a", A)
    write(dir .. "/b.txt", B)
    write(dir .. "/a.dat", "an index without NUL bytes: skipped by its name")
    os.execute("ln -s a '" .. dir .. "/a.u8'; ln -s b.txt '" .. dir .. "/link'; mkdir '"
      .. dir .. "/sub'")
    write(dir .. "/sub/c", "not read: folders are not walked")
    write(dir .. "/.hidden", "not read")
    write(dir .. "/zbin", "text\0with a NUL")
  end)
  after_each(function() os.execute("rm -rf '" .. dir .. "'") end)

  it("reads the regular text files of a folder, sorted, skipping .dat, .u8, links, binaries", function()
    local t = data.text(dir, { ctx = 8, batch = 4, val_fraction = 0 })
    assert.same({ dir .. "/a", dir .. "/b.txt" }, t.files)
    assert.equal(A .. B, t.bytes)
    assert.equal(280, t:size())
    assert.equal(256, t.vocab)
  end)

  it("holds out the last val_fraction of every file", function()
    local tr = data.text(dir, { ctx = 8, batch = 4, val_fraction = 0.1 })
    local va = data.text(dir, { ctx = 8, batch = 4, val_fraction = 0.1, split = "val" })
    assert.equal(A:sub(1, 162) .. B:sub(1, 90), tr.bytes)
    assert.equal(A:sub(163) .. B:sub(91), va.bytes)
    assert.equal(tr:size() + va:size(), 280)
  end)

  it("reads a single file, also through a link", function()
    local t = data.text(dir .. "/link", { ctx = 4, batch = 2, val_fraction = 0 })
    assert.equal(B, t.bytes)
  end)

  it("reads a folder through a link to it, and names a link to nothing", function()
    local other = mktemp_dir()
    os.execute("ln -s '" .. dir .. "' '" .. other .. "/data'; ln -s '" .. other
      .. "/none' '" .. other .. "/dangling'")
    local t = data.text(other .. "/data", { ctx = 8, batch = 4, val_fraction = 0 })
    assert.same({ other .. "/data/a", other .. "/data/b.txt" }, t.files)
    assert.equal(A .. B, t.bytes)
    assert_error_has(function() data.text(other .. "/dangling", { ctx = 4, batch = 2 }) end,
      "fsdp.data.text: cannot open " .. other .. "/dangling: No such file or directory")
    os.execute("rm -rf '" .. other .. "'")
  end)

  it("yields windows x and y = x shifted by one, found in the split's bytes", function()
    local t = data.text(dir, { ctx = 16, batch = 6, seed = 5 })
    local n = 0
    for step, x, y in t:batches(4) do
      n = n + 1
      assert.equal(n, step)
      assert.same({ 6, 16 }, x:shape())
      assert.same({ 6, 16 }, y:shape())
      assert.equal("i64", x:dtype())
      assert.equal("i64", y:dtype())
      local xs, ys = x:totable(), y:totable()
      for b = 1, 6 do
        local sx, sy = t:decode(xs[b]), t:decode(ys[b])
        assert.equal(sx:sub(2), sy:sub(1, 15))
        local at = t.bytes:find(sx .. sy:sub(-1), 1, true)
        assert.truthy(at, "window not in the text")
        for _, v in ipairs(xs[b]) do assert.is_true(v >= 0 and v <= 255 and v % 1 == 0) end
      end
    end
    assert.equal(4, n)
  end)

  it("is deterministic per seed and slices global batches by rank", function()
    local function rows(opts, steps)
      local out = {}
      for _, x in data.text(dir, opts):batches(steps) do
        for _, r in ipairs(x:totable()) do out[#out + 1] = table.concat(r, ",") end
      end
      return out
    end
    local whole = rows({ ctx = 8, batch = 4, seed = 9 }, 3)
    assert.same(whole, rows({ ctx = 8, batch = 4, seed = 9 }, 3))
    assert.are_not.same(whole, rows({ ctx = 8, batch = 4, seed = 10 }, 3))
    -- rank r of 2 holds rows 2r+1, 2r+2 of each global batch of 4
    local r0 = rows({ ctx = 8, batch = 4, seed = 9, rank = 0, world_size = 2 }, 3)
    local r1 = rows({ ctx = 8, batch = 4, seed = 9, rank = 1, world_size = 2 }, 3)
    for s = 0, 2 do
      assert.same({ whole[4 * s + 1], whole[4 * s + 2] }, { r0[2 * s + 1], r0[2 * s + 2] })
      assert.same({ whole[4 * s + 3], whole[4 * s + 4] }, { r1[2 * s + 1], r1[2 * s + 2] })
    end
    assert_error_has(function() data.text(dir, { ctx = 8, batch = 3, world_size = 2 }):batches(1) end,
      "batch 3 is not divisible by the world size 2")
  end)

  it("epoch() gives non-overlapping windows in order, capped by max_batches", function()
    local t = data.text(dir, { ctx = 10, batch = 4, split = "val", val_fraction = 0.5 })
    -- val = A:sub(91) .. B:sub(51): 90 + 50 = 140 bytes -> 13 windows of 10 (+1 target byte)
    assert.equal(140, t:size())
    local e = collect(t:epoch())
    assert.equal(4, #e)
    assert.same({ 1, 10 }, e[4].x:shape())
    assert.equal("i64", e[4].x:dtype())
    assert.equal("i64", e[4].y:dtype())
    local all = {}
    for _, r in ipairs(e) do for _, row in ipairs(r.x:totable()) do all[#all + 1] = t:decode(row) end end
    assert.equal(13, #all)
    assert.equal(t.bytes:sub(1, 130), table.concat(all))
    assert.equal(4, #collect(t:epoch(4)))
    -- capped: 2 batches of 4 = 8 of the 13 windows, spread over the whole split, in order
    local capped = collect(t:epoch(2))
    assert.equal(2, #capped)
    assert.equal(2, #collect(t:epoch { max_batches = 2 }))
    local got, want = {}, {}
    for _, r in ipairs(capped) do
      for _, row in ipairs(r.x:totable()) do got[#got + 1] = t:decode(row) end
    end
    for _, w in ipairs { 0, 1, 3, 4, 6, 8, 9, 11 } do -- floor(j * 13 / 8)
      want[#want + 1] = t.bytes:sub(w * 10 + 1, w * 10 + 10)
    end
    assert.same(want, got)
  end)

  it("encodes and decodes bytes, tensors and nested tables", function()
    local t = data.text(dir, { ctx = 4, batch = 2 })
    local s = "h\0\255\n\"é"
    local ids = t:encode(s)
    assert.same({ 104, 0, 255, 10, 34, 195, 169 }, ids)
    assert.equal(s, t:decode(ids))
    assert.equal("hi", t:decode(fsdp.tensor { { 104 }, { 105 } }))
    local long = string.rep("xyz", 5000)
    assert.equal(long, t:decode(t:encode(long)))
    assert_error_has(function() t:decode { 104, 256 } end, "id 256 at position 2")
    assert_error_has(function() t:decode { 1.5 } end, "id 1.5")
    assert_error_has(function() t:decode "abc" end, "expected a tensor or a table")
    assert_error_has(function() t:encode(5) end, "expected a string")
  end)

  it("reports missing paths, empty folders, bad options and splits too small", function()
    assert_error_has(function() data.text(dir .. "/none", { ctx = 4, batch = 2 }) end,
      "cannot open", dir .. "/none", "No such file")
    assert_error_has(function() data.text(FORTUNES .. "-missing", { ctx = 4, batch = 2 }) end,
      "install fortunes")
    local empty = mktemp_dir()
    write(empty .. "/x.dat", "\0")
    assert_error_has(function() data.text(empty, { ctx = 4, batch = 2 }) end, "no text files in")
    -- a file named directly, and a folder of binaries: the refusal says why
    assert_error_has(function() data.text(dir .. "/zbin", { ctx = 4, batch = 2 }) end,
      "fsdp.data.text: no text files in " .. dir .. "/zbin (" .. dir
      .. "/zbin holds a NUL byte: binary)")
    write(empty .. "/y", "\0y")
    write(empty .. "/z", "z\0")
    assert_error_has(function() data.text(empty, { ctx = 4, batch = 2 }) end,
      ("no text files in %s (%s/y, %s/z hold a NUL byte: binary)"):format(empty, empty, empty))
    os.execute("rm -rf '" .. empty .. "'")
    assert_error_has(function() data.text(dir, { batch = 2 }) end, "ctx must be a positive integer")
    assert_error_has(function() data.text(dir, { ctx = 4 }) end, "batch must be a positive integer")
    assert_error_has(function() data.text(dir, { ctx = 4, batch = 2, split = "test" }) end,
      'split must be "train" or "val"')
    assert_error_has(function() data.text(dir, { ctx = 4, batch = 2, val_fraction = 1 }) end,
      "val_fraction")
    assert_error_has(function() data.text(dir, { ctx = 4, batch = 2, val_fraction = 0 / 0 }) end,
      "fsdp.data.text: val_fraction must be in [0, 1), got nan")
    local v = data.text(dir, { ctx = 100, batch = 2, split = "val" })
    assert_error_has(function() v:batches(1) end, "the val split", "needs 101")
    assert_error_has(function() v:epoch() end, "the val split")
  end)

  it("reads Debian's fortunes without the .dat indexes and .u8 links", function()
    local t = data.text(FORTUNES, { ctx = 64, batch = 4 })
    assert.is_true(#t.files >= 10)
    for _, f in ipairs(t.files) do
      assert.is_nil(f:find("%.dat$"), f)
      assert.is_nil(f:find("%.u8$"), f)
    end
    assert.is_nil(t.bytes:find("\0", 1, true))
    assert.is_true(t:size() > 1e6)
  end)
end)
