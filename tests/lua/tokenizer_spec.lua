-- tokenizer_spec.lua — fsdp.tokenizer: training a small BPE (and unigram) model on a fortunes
-- file, loading it, exact round trips (tables, nested tables, tensors), what invalid UTF-8
-- becomes, token datasets written by write_dataset (they decode back to the corpus; encoding in
-- pieces gives the ids of encoding whole files), and every named error.
-- Run: busted --lua=luajit tests/lua/tokenizer_spec.lua

local fsdp = require "fsdp"
local core = require "fsdp.core"
local tokenizer = require "fsdp.tokenizer"

local H = require "helpers"
local assert_error_has, mktemp_dir, write = H.assert_error_has, H.mktemp_dir, H.write_file
teardown(H.remove_temps)

local FORTUNES = "/usr/share/games/fortunes"
local CORPUS = FORTUNES .. "/debian"

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

if not core.tok_available() or not io.open(CORPUS, "rb") then
  describe("fsdp.tokenizer", function()
    it("needs SentencePiece and Debian's fortunes", function()
      pending("skipped: no SentencePiece in this build, or fortunes not installed")
    end)
  end)
  return
end

describe("fsdp.tokenizer", function()
  local dir, tok
  setup(function()
    dir = mktemp_dir()
    tok = fsdp.tokenizer.train { input = CORPUS, vocab_size = 500, model = dir .. "/tok.model" }
  end)
  teardown(function() os.execute("rm -rf '" .. dir .. "'") end)

  it("trains a model of the size asked for and loads it", function()
    assert.are.equal(500, tok.vocab_size)
    assert.are.equal(dir .. "/tok.model", tok.path)
    assert.are.same({ 0, 1, 2 }, { tok.unk, tok.bos, tok.eos })
    assert.are.equal("<0x0A>", tok:piece(3 + 10)) -- byte pieces follow the three specials
    local again = fsdp.tokenizer.load(dir .. "/tok.model")
    assert.are.equal(500, again.vocab_size)
    local s = "Debian developers debug Debian."
    assert.are.same(tok:encode(s), again:encode(s))
    assert.matches("tokenizer .*tok.model %(500 pieces%)", tostring(again))
  end)

  it("encodes to a Lua array of ids from 0 and decodes them back exactly", function()
    for _, s in ipairs {
      "Debian GNU/Linux",
      "two lines\nand a\ttab, trailing spaces  \n\n",
      "\u{e9}t\u{e9} \u{65e5}\u{672c} \u{1F600}", -- unseen characters: byte pieces
      "\1\127 control",
      "",
    } do
      local ids = tok:encode(s)
      assert.are.equal("table", type(ids))
      for _, id in ipairs(ids) do
        assert.is_true(id >= 0 and id < 500 and id % 1 == 0)
      end
      assert.are.equal(s, tok:decode(ids))
    end
    assert.are.same({}, tok:encode(""))
    assert.is_true(#tok:encode("Debian Debian Debian") < #"Debian Debian Debian")
  end)

  it("decodes tensors and nested tables", function()
    local s = "packages and\nmore packages"
    local ids = tok:encode(s)
    assert.are.equal(s, tok:decode(fsdp.tensor(ids, { dtype = "i64" })))
    local half = math.floor(#ids / 2)
    local a, b = {}, {}
    for i = 1, #ids do if i <= half then a[#a + 1] = ids[i] else b[#b + 1] = ids[i] end end
    assert.are.equal(s, tok:decode { a, b })
    -- any shape: a 0-dim tensor is one id, as is a number
    local one = tok:encode("x")[1]
    assert.are.equal(tok:decode { one }, tok:decode(fsdp.tensor(one, { dtype = "i64" })))
    assert.are.equal(tok:decode { one }, tok:decode(one))
  end)

  it("turns malformed UTF-8 bytes into U+FFFD (documented: byte fallback covers valid text)", function()
    assert.are.equal("a\u{FFFD}b", tok:decode(tok:encode("a\255b")))
  end)

  it("trains a unigram model too", function()
    local u = fsdp.tokenizer.train { input = { CORPUS }, vocab_size = 600, model = dir .. "/uni.model",
      model_type = "unigram", threads = 2 }
    assert.are.equal(600, u.vocab_size)
    local s = "unigram\nDebian \u{e9}"
    assert.are.equal(s, u:decode(u:encode(s)))
  end)

  it("trains the same model twice from the same text (a deterministic trainer)", function()
    fsdp.tokenizer.train { input = CORPUS, vocab_size = 500, model = dir .. "/again.model" }
    assert.are.equal(read(dir .. "/tok.model"), read(dir .. "/again.model"))
  end)

  it("trains on the files write_dataset encodes: a binary file (a NUL byte) is left out", function()
    local folder = dir .. "/mixed"
    os.execute("mkdir -p '" .. folder .. "'")
    write(folder .. "/a", read(CORPUS))
    write(folder .. "/blob", ("\0\1\2\255binary "):rep(2000))
    fsdp.tokenizer.train { input = folder, vocab_size = 500, model = dir .. "/mixed.model" }
    assert.are.equal(read(dir .. "/tok.model"), read(dir .. "/mixed.model"))
    write(folder .. "/a", "\0 binary too")
    assert_error_has(function()
      fsdp.tokenizer.train { input = folder, vocab_size = 500, model = dir .. "/x.model" }
    end, "fsdp.tokenizer.train: no text files in the input (a file holding a NUL byte is binary)")
  end)

  it("trains on the first max_sentences lines of the input, empty ones counted", function()
    local folder = dir .. "/firstlines"
    os.execute("mkdir -p '" .. folder .. "'")
    write(folder .. "/a", "aaa\n\nbbb\n")
    write(folder .. "/b", "zzz\n")
    -- the first three lines hold two characters: 259 + 2 pieces; all four lines need 262
    local t = fsdp.tokenizer.train { input = folder, vocab_size = 261, max_sentences = 3,
      model = dir .. "/first.model" }
    assert.are.equal(261, t.vocab_size)
    t:free()
    assert_error_has(function()
      fsdp.tokenizer.train { input = folder, vocab_size = 261, max_sentences = 4,
        model = dir .. "/first.model" }
    end, "it needs at least 262")
  end)

  it("makes the model's folder, as fsdp.save makes its own", function()
    local t = fsdp.tokenizer.train { input = CORPUS, vocab_size = 500,
      model = dir .. "/new/sub/tok.model" }
    assert.are.equal(read(dir .. "/tok.model"), read(dir .. "/new/sub/tok.model"))
    t:free()
    write(dir .. "/plain", "a file, not a folder")
    assert_error_has(function()
      fsdp.tokenizer.train { input = CORPUS, vocab_size = 500, model = dir .. "/plain/tok.model" }
    end, "fsdp.tokenizer.train: cannot make the model's folder: ", "plain")
  end)

  it("names what is wrong", function()
    assert_error_has(function()
      fsdp.tokenizer.train { input = dir .. "/none.txt", vocab_size = 500, model = dir .. "/x.model" }
    end, "fsdp.tokenizer.train: cannot open", "none.txt")
    assert_error_has(function()
      fsdp.tokenizer.train { input = CORPUS, vocab_size = 100000, model = dir .. "/x.model" }
    end, "fsdp.tokenizer.train: Vocabulary size too high (100000)")
    assert.is_nil(io.open(dir .. "/x.model", "rb")) -- nothing written
    assert_error_has(function()
      fsdp.tokenizer.train { input = CORPUS, vocab_size = 200, model = dir .. "/x.model" }
    end, "vocab_size 200 is too small")
    -- above 259 but below the pieces the corpus's characters need: said in train's options
    -- (SentencePiece's own hint names a --character_coverage flag that nothing here has)
    local ok, err = pcall(fsdp.tokenizer.train, { input = CORPUS, vocab_size = 260,
      model = dir .. "/x.model" })
    assert.is_false(ok)
    err = tostring(err)
    local need = tonumber(err:match("it needs at least (%d+) %(259 byte and special pieces, and "))
    assert.truthy(need and need > 260, err)
    assert.truthy(err:find("fsdp.tokenizer.train: vocab_size 260 is too small for this corpus", 1,
      true), err)
    assert.truthy(err:find(("%d characters of the corpus that get pieces of their own at "
      .. "character_coverage 0.9995); give vocab_size = %d or more, or a lower character_coverage")
      :format(need - 259, need), 1, true), err)
    assert.is_nil(err:find("--character_coverage", 1, true), err)
    assert.is_nil(io.open(dir .. "/x.model", "rb"))
    -- the number it gives is enough; a lower coverage needs fewer
    local ok2, err2 = pcall(fsdp.tokenizer.train, { input = CORPUS, vocab_size = 260,
      model = dir .. "/x.model", character_coverage = 0.99 })
    assert.is_false(ok2)
    assert.truthy(tonumber(tostring(err2):match("it needs at least (%d+)")) < need, err2)
    local enough = fsdp.tokenizer.train { input = CORPUS, vocab_size = need,
      model = dir .. "/x.model" }
    assert.are.equal(need, enough.vocab_size)
    enough:free()
    os.remove(dir .. "/x.model")
    -- an empty corpus: SentencePiece's own message has no words, only its failed check
    write(dir .. "/blank.txt", "\n\n")
    assert_error_has(function()
      fsdp.tokenizer.train { input = dir .. "/blank.txt", vocab_size = 300, model = dir .. "/x.model" }
    end, "fsdp.tokenizer.train: the input has no text to train on (1 file, every line empty)")
    assert_error_has(function()
      fsdp.tokenizer.train { input = CORPUS, vocab_size = 500, model = dir .. "/x.model", model_type = "wp" }
    end, 'model_type must be "bpe" or "unigram", got wp')
    assert_error_has(function()
      fsdp.tokenizer.train { input = CORPUS, vocab = 500, model = dir .. "/x.model" }
    end, "unknown option 'vocab'", "valid: character_coverage, input, max_sentences")
    assert_error_has(function() fsdp.tokenizer.train { input = CORPUS, model = dir .. "/x.model" } end,
      "vocab_size must be a positive integer")
    assert_error_has(function() fsdp.tokenizer.train { input = CORPUS, vocab_size = 500 } end,
      "model must be the path")
    assert_error_has(function() fsdp.tokenizer.load(dir .. "/missing.model") end,
      "fsdp.tokenizer.load: tokenizer: cannot open", "missing.model")
    assert_error_has(function() fsdp.tokenizer.load(CORPUS) end,
      "fsdp.tokenizer.load: tokenizer: " .. CORPUS .. " is not a SentencePiece model")
    write(dir .. "/cut.model", read(dir .. "/tok.model"):sub(1, 1000))
    assert_error_has(function() fsdp.tokenizer.load(dir .. "/cut.model") end,
      "cut.model is not a SentencePiece model")
    assert_error_has(function() tok:decode { 1, 500 } end,
      "tokenizer:decode: id 500 at position 2 is out of range [0, 500)")
    assert_error_has(function() tok:decode { 1, 2.5 } end, "id 2.5 at position 2 is not an integer id")
    assert_error_has(function() tok:decode { 2 ^ 40 } end,
      "tokenizer:decode: id 1099511627776 at position 1 is out of range [0, 500)")
    assert_error_has(function() tok:decode { -1 } end, "id -1 at position 1 is out of range [0, 500)")
    assert_error_has(function() tok:decode { 0 / 0 } end, "id nan at position 1 is not an integer id")
    assert_error_has(function() tok:decode { math.huge } end, "id inf at position 1 is out of range")
    assert_error_has(function() tok:decode("ids") end, "expected a table of ids or a tensor")
    assert_error_has(function() tok:encode(42) end, "tokenizer:encode: expected a string, got number")
    local t = fsdp.tokenizer.load(dir .. "/tok.model")
    t:free()
    t:free()
    assert_error_has(function() t:encode("x") end, "the tokenizer was freed")
    assert.are.equal("tokenizer (freed)", tostring(t))
  end)
end)

describe("fsdp.tokenizer.write_dataset", function()
  local dir, tok, corpus, files
  setup(function()
    dir = mktemp_dir()
    tok = fsdp.tokenizer.train { input = CORPUS, vocab_size = 500, model = dir .. "/trained.model" }
    corpus = dir .. "/corpus"
    os.execute("mkdir -p '" .. corpus .. "'")
    files = {
      a = read(CORPUS),
      b = "short file without a final newline",
      c = ("line %d: \u{e9}t\u{e9}\n"):rep(40):gsub("%%d", "x"),
    }
    for name, text in pairs(files) do write(corpus .. "/" .. name, text) end
    write(corpus .. "/d.dat", "skipped by its name")
    write(corpus .. "/bin", "a\0binary") -- skipped: holds a NUL byte
  end)
  teardown(function() os.execute("rm -rf '" .. dir .. "'") end)

  -- The ids of a token file and its sidecar.
  local function ids_of(path)
    local meta = core.json_read(path:gsub("%.bin$", ".json"))
    local L = fsdp.data.tokens(path, { ctx = 1, batch = 1 })
    local ids = meta.count > 0 and L:read(0, meta.count) or {}
    L:close()
    return ids, meta
  end

  -- Split a stream of ids at the end-of-text id.
  local function documents(ids, eos)
    local docs, cur = {}, {}
    for _, id in ipairs(ids) do
      if id == eos then
        docs[#docs + 1] = cur
        cur = {}
      else
        cur[#cur + 1] = id
      end
    end
    assert.are.same({}, cur) -- every document ends with eos
    return docs
  end

  it("writes train and val files that decode back to the corpus, file by file", function()
    local out = dir .. "/data"
    local r = fsdp.tokenizer.write_dataset { tokenizer = tok, input = corpus, out = out, val_fraction = 0.25 }
    assert.are.same({ corpus .. "/a", corpus .. "/b", corpus .. "/c" }, r.files)
    assert.are.equal("uint16", r.dtype)
    local train, tmeta = ids_of(out .. "/train.bin")
    local val, vmeta = ids_of(out .. "/val.bin")
    assert.are.equal(r.train, #train)
    assert.are.equal(r.val, #val)
    for _, m in ipairs { tmeta, vmeta } do
      assert.are.equal("uint16", m.dtype)
      assert.are.equal(500, m.vocab_size)
      assert.are.equal("tok.model", m.tokenizer)
      assert.are.equal(2, m.eos)
    end
    assert.are.equal(read(dir .. "/trained.model"), read(out .. "/tok.model"))
    assert.are.equal(2 * #train, #read(out .. "/train.bin"))
    local tdocs, vdocs = documents(train, tok.eos), documents(val, tok.eos)
    -- "b" is one line: all of it is train (the cut moves to the end of the line)
    assert.are.equal(3, #tdocs)
    assert.are.equal(2, #vdocs)
    local ta, tb, tc = tok:decode(tdocs[1]), tok:decode(tdocs[2]), tok:decode(tdocs[3])
    local va, vc = tok:decode(vdocs[1]), tok:decode(vdocs[2])
    assert.are.equal(files.a, ta .. va)
    assert.are.equal(files.b, tb)
    assert.are.equal(files.c, tc .. vc)
    -- whole lines on both sides, the split near 75 %
    assert.are.equal("\n", ta:sub(-1))
    assert.is_true(math.abs(#ta / #files.a - 0.75) < 0.05)
  end)

  it("gives the ids of whole files when it encodes them in pieces", function()
    local whole = dir .. "/whole"
    fsdp.tokenizer.write_dataset { tokenizer = tok, input = CORPUS, out = whole, val_fraction = 0 }
    local saved = tokenizer.chunk_bytes
    tokenizer.chunk_bytes = 4096 -- the corpus is 15 kB: four pieces
    local pieces = dir .. "/pieces"
    local ok, err = pcall(fsdp.tokenizer.write_dataset,
      { tokenizer = dir .. "/trained.model", input = { CORPUS }, out = pieces, val_fraction = 0 })
    tokenizer.chunk_bytes = saved
    assert(ok, err)
    assert.are.equal(read(whole .. "/train.bin"), read(pieces .. "/train.bin"))
    local ids = ids_of(whole .. "/train.bin")
    table.remove(ids) -- the end-of-text id
    assert.are.same(tok:encode(read(CORPUS)), ids)
    local _, vmeta = ids_of(whole .. "/val.bin")
    assert.are.equal(0, vmeta.count)
  end)

  it("reads a folder through a link to it (not as an empty file)", function()
    local other = mktemp_dir()
    os.execute("ln -s '" .. corpus .. "' '" .. other .. "/corpus'")
    local r = fsdp.tokenizer.write_dataset { tokenizer = tok, input = other .. "/corpus",
      out = other .. "/out" }
    local direct = fsdp.tokenizer.write_dataset { tokenizer = tok, input = corpus,
      out = other .. "/direct" }
    assert.are.equal(3, #r.files)
    assert.are.same({ direct.train, direct.val }, { r.train, r.val })
    assert.are.equal(read(other .. "/direct/train.bin"), read(other .. "/out/train.bin"))
    os.execute("rm -rf '" .. other .. "'")
  end)

  it("picks uint32 ids above 65536 pieces", function()
    assert.are.equal("uint16", tokenizer.dtype_for(65536))
    assert.are.equal("uint32", tokenizer.dtype_for(65537))
  end)

  it("names what is wrong", function()
    assert_error_has(function()
      fsdp.tokenizer.write_dataset { tokenizer = tok, input = dir .. "/none", out = dir .. "/x" }
    end, "fsdp.tokenizer.write_dataset: cannot open", "/none")
    assert_error_has(function()
      fsdp.tokenizer.write_dataset { tokenizer = tok, input = CORPUS, out = dir .. "/x", val_fraction = 1 }
    end, "val_fraction must be in [0, 1), got 1")
    assert_error_has(function()
      fsdp.tokenizer.write_dataset { tokenizer = tok, input = CORPUS, out = dir .. "/x", split = 1 }
    end, "unknown option 'split'")
    assert_error_has(function()
      fsdp.tokenizer.write_dataset { tokenizer = 5, input = CORPUS, out = dir .. "/x" }
    end, "tokenizer must be a tokenizer or a .model path")
    -- a file that cannot be read midway (as root, permissions cannot refuse it: io.open is
    -- made to): named, and nothing half-written is left beside the previous files
    local out = dir .. "/keep"
    fsdp.tokenizer.write_dataset { tokenizer = tok, input = corpus, out = out }
    local before = read(out .. "/train.bin")
    local real_open = io.open
    io.open = function(p, m)
      if p == corpus .. "/b" then return nil, p .. ": Permission denied" end
      return real_open(p, m)
    end
    local ok, err = pcall(fsdp.tokenizer.write_dataset, { tokenizer = tok, input = corpus, out = out })
    io.open = real_open
    assert.is_false(ok)
    assert.matches("write_dataset: cannot open .*/corpus/b: Permission denied", err)
    assert.are.equal(before, read(out .. "/train.bin"))
    assert.is_nil(io.open(out .. "/train.bin.tmp", "rb"))
    assert.is_nil(io.open(out .. "/val.bin.tmp", "rb"))
  end)

  it("replaces no file of the dataset when any part fails, and leaves no temporary", function()
    local out = dir .. "/whole"
    fsdp.tokenizer.write_dataset { tokenizer = tok, input = corpus, out = out }
    local names = { "train.bin", "val.bin", "train.json", "val.json", "tok.model" }
    local before = {}
    for _, n in ipairs(names) do before[n] = read(out .. "/" .. n) end
    local function unchanged()
      for _, n in ipairs(names) do
        assert.are.equal(before[n], read(out .. "/" .. n), n)
        assert.is_nil(io.open(out .. "/" .. n .. ".tmp", "rb"), n .. ".tmp")
      end
    end
    assert_error_has(function()
      fsdp.tokenizer.write_dataset { tokenizer = tok, input = corpus, out = out, val_fraction = 0 / 0 }
    end, "fsdp.tokenizer.write_dataset: val_fraction must be in [0, 1), got nan")
    unchanged()
    -- no text file: found after the .bin files are written, before anything is renamed
    assert_error_has(function()
      fsdp.tokenizer.write_dataset { tokenizer = tok, input = { corpus .. "/bin" }, out = out }
    end, "fsdp.tokenizer.write_dataset: no text files in the input")
    unchanged()
    -- a sidecar that cannot be written (a folder in the temporary's place)
    os.execute("mkdir '" .. out .. "/val.json.tmp'")
    assert_error_has(function()
      fsdp.tokenizer.write_dataset { tokenizer = tok, input = { corpus .. "/b" }, out = out }
    end, "fsdp.tokenizer.write_dataset: writing " .. out .. "/val.json: ")
    unchanged()
    os.execute("rmdir '" .. out .. "/val.json.tmp'")
    -- fsdprun tokenize --vocab-size: the model it trains replaces tok.model only with the ids
    -- it encodes (else the old ids would be read with the new model)
    os.execute("mkdir '" .. out .. "/val.bin.tmp'")
    local sink = { write = function() end, flush = function() end }
    assert.are.equal(1, tokenizer.command({ "--out", out, "--vocab-size", "600", CORPUS },
      { stdout = sink, stderr = sink }))
    os.execute("rmdir '" .. out .. "/val.bin.tmp'")
    unchanged()
    for _, name in ipairs(core.list_dir(out)) do
      assert.is_nil(name.name:find("%.tmp$"), name.name)
    end
  end)
end)
