-- tokens_spec.lua — fsdp.data.tokens, the memory-mapped token loader: windows read from the
-- file as written, deterministic steps from (seed, step, row), each rank's rows equal to its
-- slice of the one-rank global batch at 1, 2 and 4 ranks, exact resume from the cursor and
-- through a sharded checkpoint, uint32 files, validation passes, and the files it refuses.
-- Needs no tokenizer: the files are made here (tests/lua/tokenizer_spec.lua writes real ones).
-- Run: busted --lua=luajit tests/lua/tokens_spec.lua

local fsdp = require "fsdp"
local core = require "fsdp.core"
local data = require "fsdp.data"
require "fsdp.checkpoint"

local H = require "helpers"
local assert_error_has, mktemp_dir, write = H.assert_error_has, H.mktemp_dir, H.write_file
teardown(H.remove_temps)

-- The id at position i (0-based) of the test files: a formula, so any window can be checked.
local function id_at(i, vocab) return (i * 7919 + 13) % vocab end

-- Write name.bin (count ids of the formula, little-endian) and its sidecar name.json.
local function token_file(dir, name, count, vocab, dtype, meta)
  local es = dtype == "uint32" and 4 or 2
  local parts = {}
  for i = 0, count - 1 do
    local v = id_at(i, vocab)
    local b = {}
    for k = 1, es do
      b[k] = v % 256
      v = math.floor(v / 256)
    end
    parts[#parts + 1] = string.char(unpack(b))
  end
  write(dir .. "/" .. name .. ".bin", table.concat(parts))
  local m = { format = "fsdp.tokens", version = 1, dtype = dtype, vocab_size = vocab, count = count,
    tokenizer = "tok.model" }
  for k, v in pairs(meta or {}) do m[k] = v end
  core.json_write(dir .. "/" .. name .. ".json", m)
  return dir .. "/" .. name .. ".bin"
end

-- Every (x, y) row b of a batch holds the formula's ids from starts[b] (0-based) on.
local function check_rows(x, y, ctx, vocab, starts)
  local xs, ys = x:totable(), y:totable()
  assert.are.equal(#starts, #xs)
  for b = 1, #xs do
    for t = 1, ctx do
      assert.are.equal(id_at(starts[b] + t - 1, vocab), xs[b][t])
      assert.are.equal(id_at(starts[b] + t, vocab), ys[b][t])
    end
  end
end

local function collect(loader, n)
  local out = {}
  for step, x, y in loader:batches(n) do out[#out + 1] = { step = step, x = x:totable(), y = y:totable() } end
  return out
end

describe("fsdp.data.tokens", function()
  local dir, path
  local N, V = 5000, 1000
  setup(function()
    dir = mktemp_dir()
    path = token_file(dir, "train", N, V, "uint16")
    token_file(dir, "val", 300, V, "uint16")
  end)
  teardown(function() os.execute("rm -rf '" .. dir .. "'") end)

  it("reads the sidecar and serves windows of the file with their targets", function()
    local L = fsdp.data.tokens(path, { ctx = 16, batch = 4, seed = 1, rank = 0, world_size = 1 })
    assert.are.same({ N, V, "uint16", dir .. "/train.json", dir .. "/tok.model" },
      { L:size(), L.vocab, L.dtype, L.sidecar, L.tokenizer })
    for step, x, y in L:batches(3) do
      assert.are.same({ 4, 16 }, x:shape())
      assert.are.equal("i64", x:dtype())
      assert.are.equal("i64", y:dtype())
      local starts = L:starts(step, 0, 3)
      for _, st in ipairs(starts) do assert.is_true(st >= 0 and st <= N - 17) end
      check_rows(x, y, 16, V, starts)
    end
    assert.are.equal(3, L.cursor)
    local first = L:read(0, 5)
    assert.are.same({ id_at(0, V), id_at(1, V), id_at(2, V), id_at(3, V), id_at(4, V) }, first)
    assert.are.same({ id_at(N - 2, V), id_at(N - 1, V) }, L:read(N - 2, 2))
    assert.are.same({}, L:read(N, 0))
    H.assert_error_has(function() L:read(N - 2, 3) end, "tokens_spec.lua",
      ("tokens:read: ids [%d, %d + 3) are not inside %s's %d ids (first must be an integer in [0, %d])")
        :format(N - 2, N - 2, path, N, N - 3))
    H.assert_error_has(function() L:read(-1, 2) end, "tokens:read: ids [-1, -1 + 2)")
    H.assert_error_has(function() L:read(0) end, "tokens:read: n must be an integer >= 0, got nil")
  end)

  it("opens <split>.bin in a folder", function()
    local L = fsdp.data.tokens(dir, { ctx = 8, batch = 2, split = "val", rank = 0, world_size = 1 })
    assert.are.equal(dir .. "/val.bin", L.path)
    assert.are.equal(300, L:size())
    -- a link to the folder is the folder
    local other = mktemp_dir()
    os.execute("ln -s '" .. dir .. "' '" .. other .. "/data'")
    L = fsdp.data.tokens(other .. "/data", { ctx = 8, batch = 2, split = "val", rank = 0, world_size = 1 })
    assert.are.equal(other .. "/data/val.bin", L.path)
    assert.are.equal(300, L:size())
    L:close()
    os.execute("rm -rf '" .. other .. "'")
  end)

  it("takes a file's split from its sidecar, and refuses a split = that names another", function()
    local sub = mktemp_dir()
    local v = token_file(sub, "val", 300, V, "uint16", { split = "val" })
    local L = fsdp.data.tokens(v, { ctx = 8, batch = 2, rank = 0, world_size = 1 })
    assert.are.equal("val", L.split)
    L = fsdp.data.tokens(v, { ctx = 8, batch = 2, split = "val", rank = 0, world_size = 1 })
    assert.are.equal("val", L.split)
    assert_error_has(function() fsdp.data.tokens(v, { ctx = 8, batch = 2, split = "train" }) end,
      ('fsdp.data.tokens: split = "train", but %s is the val split (its sidecar %s/val.json says '
        .. 'so); split = picks <split>.bin of a folder'):format(v, sub))
    -- a sidecar without the word (nanoGPT's files with a sidecar of their own): as asked
    L = fsdp.data.tokens(path, { ctx = 8, batch = 2, split = "val", rank = 0, world_size = 1 })
    assert.are.equal("val", L.split)
    os.execute("rm -rf '" .. sub .. "'")
  end)

  it("draws the same batches for the same seed, others for another", function()
    local opts = { ctx = 8, batch = 4, seed = 7, rank = 0, world_size = 1 }
    local a = collect(fsdp.data.tokens(path, opts), 5)
    local b = collect(fsdp.data.tokens(path, opts), 5)
    assert.are.same(a, b)
    opts.seed = 8
    local c = collect(fsdp.data.tokens(path, opts), 5)
    assert.are_not.same(a[1].x, c[1].x)
    -- and steps differ from each other
    assert.are_not.same(a[1].x, a[2].x)
  end)

  it("gives each of 1, 2 and 4 ranks its slice of the one-rank global batch", function()
    local B = 8
    local global = collect(fsdp.data.tokens(path, { ctx = 8, batch = B, seed = 3, rank = 0, world_size = 1 }), 4)
    for _, W in ipairs { 2, 4 } do
      local per = {}
      for r = 0, W - 1 do
        per[r] = collect(fsdp.data.tokens(path, { ctx = 8, batch = B, seed = 3, rank = r, world_size = W }), 4)
      end
      for k = 1, 4 do
        local rows = {}
        for r = 0, W - 1 do
          assert.are.equal(B / W, #per[r][k].x)
          for _, row in ipairs(per[r][k].x) do rows[#rows + 1] = row end
        end
        assert.are.same(global[k].x, rows)
      end
    end
    assert_error_has(function()
      for _ in fsdp.data.tokens(path, { ctx = 8, batch = 6, rank = 0, world_size = 4 }):batches(1) do end
    end, "batch 6 is not divisible by the world size 4")
  end)

  it("resumes exactly from the cursor", function()
    local opts = { ctx = 8, batch = 4, seed = 5, rank = 0, world_size = 1 }
    local whole = collect(fsdp.data.tokens(path, opts), 10)
    local L = fsdp.data.tokens(path, opts)
    L.cursor = 6
    local rest = collect(L, 4)
    for i = 1, 4 do assert.are.same(whole[6 + i], rest[i]) end
  end)

  it("resumes exactly through a sharded checkpoint (the loader state is saved)", function()
    local opts = { ctx = 8, batch = 4, seed = 5, rank = 0, world_size = 1 }
    local whole = collect(fsdp.data.tokens(path, opts), 9)
    local L = fsdp.data.tokens(path, opts)
    collect(L, 4)
    fsdp.manual_seed(1)
    local model = fsdp.nn.Linear(2, 2)
    fsdp.save(model, dir .. "/ck", { format = "sharded", loaders = { train = L } })
    local L2 = fsdp.data.tokens(path, opts)
    fsdp.load(model, dir .. "/ck", { loaders = { train = L2 } })
    assert.are.equal(4, L2.cursor)
    local rest = collect(L2, 5)
    for i = 1, 5 do assert.are.same(whole[4 + i], rest[i]) end
  end)

  it("reads uint32 files (vocabularies above 65536)", function()
    local p = token_file(dir, "big", 3000, 70001, "uint32")
    local L = fsdp.data.tokens(p, { ctx = 12, batch = 3, seed = 2, rank = 0, world_size = 1 })
    assert.are.equal("uint32", L.dtype)
    local saw_big = false
    for step, x, y in L:batches(4) do
      check_rows(x, y, 12, 70001, L:starts(step, 0, 2))
      for _, row in ipairs(x:totable()) do
        for _, v in ipairs(row) do if v > 65535 then saw_big = true end end
      end
    end
    assert.is_true(saw_big)
  end)

  it("passes over non-overlapping windows for validation", function()
    local L = fsdp.data.tokens(dir .. "/val.bin", { ctx = 10, batch = 4, rank = 0, world_size = 1 })
    local n, rows = 0, 0
    for i, x, y in L:epoch() do
      n = i
      rows = rows + x:shape()[1]
      local xs, ys = x:totable(), y:totable()
      assert.are.equal(id_at((rows - #xs) * 10, V), xs[1][1])
      assert.are.equal(id_at((rows - #xs) * 10 + 1, V), ys[1][1])
    end
    assert.are.equal(29, rows) -- floor((300 - 1) / 10) windows
    assert.are.equal(8, n)
    local capped = 0
    for _, x in L:epoch(2) do capped = capped + x:shape()[1] end
    assert.are.equal(8, capped)
    -- a misspelt cap is refused, not read as "no cap"
    H.assert_error_has(function() L:epoch{max_batch = 2} end,
      "tokens:epoch: unknown option 'max_batch' (valid: batch, max_batches)")
  end)

  it("draws uniforms in [0, 1) that depend on seed, step and row", function()
    local seen = {}
    for step = 1, 20 do
      for row = 0, 9 do
        local u = data.counter_uniform(42, step, row)
        assert.is_true(u >= 0 and u < 1)
        assert.is_nil(seen[u])
        seen[u] = true
        assert.are.equal(u, data.counter_uniform(42, step, row))
      end
    end
    assert.are_not.equal(data.counter_uniform(42, 1, 0), data.counter_uniform(43, 1, 0))
    assert.are_not.equal(data.counter_uniform(2 ^ 40, 1, 0), data.counter_uniform(2 ^ 40 + 1, 1, 0))
  end)

  it("refuses bad files and options, naming them", function()
    local bad = mktemp_dir()
    -- wrong size: the sidecar promises more ids than the file holds
    token_file(bad, "short", 100, V, "uint16", { count = 101 })
    assert_error_has(function() fsdp.data.tokens(bad .. "/short.bin", { ctx = 4, batch = 1 }) end,
      "fsdp.data.tokens:", "short.bin: wrong size: 200 bytes, but 101 ids of 2 bytes need 202")
    -- a file without its sidecar
    write(bad .. "/lonely.bin", "\0\0\1\0")
    assert_error_has(function() fsdp.data.tokens(bad .. "/lonely.bin", { ctx = 1, batch = 1 }) end,
      "lonely.bin has no sidecar", "lonely.json not found")
    assert_error_has(function() fsdp.data.tokens(bad .. "/none.bin", { ctx = 1, batch = 1 }) end,
      "none.bin not found")
    -- sidecars that do not describe a token file
    token_file(bad, "f16", 10, V, "float16")
    assert_error_has(function() fsdp.data.tokens(bad .. "/f16.bin", { ctx = 1, batch = 1 }) end,
      'dtype must be "uint16" or "uint32", got float16')
    token_file(bad, "novocab", 10, V, "uint16", { vocab_size = "many" })
    assert_error_has(function() fsdp.data.tokens(bad .. "/novocab.bin", { ctx = 1, batch = 1 }) end,
      'vocab_size must be a positive integer, got the string "many"')
    -- a number written as a string is named as one (not "got 300", which reads as a number)
    token_file(bad, "quoted", 10, V, "uint16", { count = "10" })
    assert_error_has(function() fsdp.data.tokens(bad .. "/quoted.bin", { ctx = 1, batch = 1 }) end,
      'quoted.json: count must be a whole number, got the string "10"')
    token_file(bad, "narrow", 10, 70000, "uint16")
    assert_error_has(function() fsdp.data.tokens(bad .. "/narrow.bin", { ctx = 1, batch = 1 }) end,
      "a vocabulary of 70000 does not fit uint16 ids")
    write(bad .. "/junk.bin", "")
    write(bad .. "/junk.json", "{not json")
    assert_error_has(function() fsdp.data.tokens(bad .. "/junk.bin", { ctx = 1, batch = 1 }) end,
      "sidecar", "junk.json")
    -- ids past the vocabulary the sidecar names: a corrupt file, found when read
    token_file(bad, "corrupt", 50, V, "uint16", { vocab_size = 10 })
    local C = fsdp.data.tokens(bad .. "/corrupt.bin", { ctx = 4, batch = 2, rank = 0, world_size = 1 })
    assert_error_has(function() for _ in C:batches(1) do end end, "not below the vocabulary size 10")
    -- a batch that failed is not counted as served: a save made after the error resumes there
    assert.are.equal(0, C.cursor)
    -- named by the call, at the caller's line (not a line of the library)
    for _, f in ipairs {
      { "tokens:batches: ", function() for _ in C:batches(1) do end end },
      { "tokens:epoch: ", function() for _ in C:epoch() do end end },
      { "tokens:read: ", function() C:read(0, 50) end },
    } do
      local err = assert_error_has(f[2], "tokens_spec.lua:", f[1] .. bad .. "/corrupt.bin: token ")
      assert.is_nil(err:find("fsdp/data.lua", 1, true), err)
    end
    -- a file too short for one window
    local S = fsdp.data.tokens(dir .. "/val.bin", { ctx = 300, batch = 1, rank = 0, world_size = 1 })
    assert_error_has(function() S:batches(1) end, "has 300 tokens; a window of ctx = 300 needs 301")
    assert_error_has(function() S:epoch() end, "needs 301")
    -- options
    assert_error_has(function() fsdp.data.tokens(path, { ctx = 4, batch = 1, shuffle = true }) end,
      "fsdp.data.tokens: unknown option 'shuffle'", "valid: batch, ctx, rank, seed, split, world_size")
    assert_error_has(function() fsdp.data.tokens(path, { batch = 1 }) end, "ctx must be a positive integer")
    assert_error_has(function() fsdp.data.tokens(path, { ctx = 2 }) end, "batch must be a positive integer")
    assert_error_has(function() fsdp.data.tokens(dir, { ctx = 2, batch = 1, split = "../x" }) end,
      "split must be a name")
    local L = fsdp.data.tokens(path, { ctx = 4, batch = 1 })
    L:close()
    L:close()
    assert_error_has(function() L:batches(1) end, "the token loader was closed")
    os.execute("rm -rf '" .. bad .. "'")
  end)
end)
