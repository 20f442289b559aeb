-- fsdp.data: dataset loaders (Fashion-MNIST from Debian's IDX files, byte-level text).
-- The byte crunching is C (fsdp.core: gunzip, from_bytes, index_rows,
-- byte_windows; src/lua/l_data.c); this file holds the policy: file discovery, IDX parsing,
-- splits, seeded order and the rank slicing of global batches. docs/data.md is the manual.
--
-- Invariants every loader keeps:
--  * The global batch of step k is a pure function of (seed, k): the same on every rank and at
--    every world size. Each rank takes its own contiguous slice of it: rank r of W gets
--    positions [r*B/W, (r+1)*B/W) (B must be divisible by W).
--  * `loader:batches(n)` continues from `loader.cursor` (the number of batches served so far)
--    and yields the global step number cursor+1, cursor+2, ...; set loader.cursor to resume.
--  * Token ids, targets and labels are i64 tensors (values from 0); images are f32. Integers,
--    because a mixed-precision model casts its floating inputs to bf16 or f16, which hold
--    integers exactly only up to 256 (2048).

local core = require "fsdp.core"
local U = require "fsdp.util"
local bit = require "bit"

local data = {}

local floor = math.floor

-- ---- a small seeded PRNG (identical on every platform: only 32-bit integer bit ops) --------

-- a * b modulo 2^32 without losing bits in a double: split b into 16-bit halves.
local function mul32(a, b)
  local lo, hi = b % 65536, floor(b / 65536) % 65536
  return bit.tobit(a * lo + bit.tobit(a * hi) * 65536)
end

-- murmur3's finalizer: a good 32-bit mixer.
local function fmix32(h)
  h = bit.bxor(h, bit.rshift(h, 16))
  h = mul32(h, 0x85ebca6b)
  h = bit.bxor(h, bit.rshift(h, 13))
  h = mul32(h, 0xc2b2ae35)
  return bit.bxor(h, bit.rshift(h, 16))
end

local Rng = {}
Rng.__index = Rng

--- A xorshift128 generator keyed by (seed, stream): seed any number, stream an integer
--- (epoch or step). Streams are independent, so any epoch or step can be produced directly.
function Rng.new(seed, stream)
  seed = floor(tonumber(seed) or 0)
  local lo, hi = seed % 4294967296, floor(seed / 4294967296) % 4294967296
  stream = floor(stream or 0) % 4294967296
  local s = {}
  local h = fmix32(bit.tobit(lo + 0x9e3779b9))
  for i = 1, 4 do
    h = fmix32(bit.bxor(h, bit.tobit(hi * 0x10001 + i)))
    h = fmix32(bit.bxor(h, bit.tobit(stream + 0x7f4a7c15 * i)))
    s[i] = h
  end
  if s[1] == 0 and s[2] == 0 and s[3] == 0 and s[4] == 0 then s[1] = 1 end
  local r = setmetatable({ s[1], s[2], s[3], s[4] }, Rng)
  for _ = 1, 8 do r:u32() end
  return r
end

--- Next value, an integer in [0, 2^32).
function Rng:u32()
  local t = bit.bxor(self[1], bit.lshift(self[1], 11))
  self[1], self[2], self[3] = self[2], self[3], self[4]
  local w = self[4]
  w = bit.bxor(bit.bxor(w, bit.rshift(w, 19)), bit.bxor(t, bit.rshift(t, 8)))
  self[4] = w
  return w % 4294967296
end

--- An integer in [0, n).
function Rng:below(n)
  return floor(self:u32() / 4294967296 * n)
end

data.Rng = Rng

--- Array 1..n in the order of the seeded permutation for (seed, stream) (Fisher-Yates).
function data.permutation(n, seed, stream)
  local rng = Rng.new(seed, stream)
  local p = {}
  for i = 1, n do p[i] = i end
  for i = n, 2, -1 do
    local j = rng:below(i) + 1
    p[i], p[j] = p[j], p[i]
  end
  return p
end

-- ---- shared helpers -------------------------------------------------------------------------

local function is_count(v) return type(v) == "number" and v >= 1 and v % 1 == 0 end

local function check_count(fn, what, v)
  if not is_count(v) then
    error(("%s: %s must be a positive integer, got %s"):format(fn, what, tostring(v)), 3)
  end
  return v
end

local function file_exists(path)
  local f = io.open(path, "rb")
  if f then f:close() return true end
  return false
end

-- This rank and the world size: options rank= / world_size= (for tests and host programs that
-- shard data themselves) override fsdp.rank() / fsdp.world_size().
local function rank_world(self)
  local rank = self.opts.rank or core.rank()
  local world = self.opts.world_size or core.world_size()
  return rank, world
end

local function check_rank_world(fn, opts)
  if opts.seed ~= nil and (type(opts.seed) ~= "number" or opts.seed % 1 ~= 0) then
    error(("%s: seed must be an integer, got %s"):format(fn, tostring(opts.seed)), 3)
  end
  if opts.world_size ~= nil then check_count(fn, "world_size", opts.world_size) end
  if opts.rank ~= nil then
    local w = opts.world_size or core.world_size()
    if type(opts.rank) ~= "number" or opts.rank % 1 ~= 0 or opts.rank < 0 or opts.rank >= w then
      error(("%s: rank %s is not in [0, %d)"):format(fn, tostring(opts.rank), w), 3)
    end
  elseif opts.world_size ~= nil and core.rank() >= opts.world_size then
    -- this rank's slice would lie past the global batch: rows of other steps, or none
    error(("%s: world_size = %d, but this is rank %d: give rank = too (rank = 0, world_size = "
      .. "1 reads the whole global batch)"):format(fn, opts.world_size, core.rank()), 3)
  end
end

-- The size of this rank's slice of a global batch B.
local function local_batch(fn, B, world)
  if B % world ~= 0 then
    error(("%s: batch %d is not divisible by the world size %d"):format(fn, B, world), 3)
  end
  return B / world
end

-- ---- IDX files --------------------------------------------------------------------------

local function be32(s, i)
  local a, b, c, d = s:byte(i, i + 3)
  return ((a * 256 + b) * 256 + c) * 256 + d
end

--- Read an IDX file of unsigned bytes (gzip-compressed or plain): returns its dims (array) and
--- a tensor of shape dims whose values are the bytes times opts.scale (default 1), of dtype
--- opts.dtype (default "f32"). opts.limit keeps only the first `limit` items along the first
--- dimension (and reads only those bytes).
function data.read_idx(path, opts)
  opts = U.check_opts("read_idx", opts, {"limit", "scale", "dtype"})
  if not file_exists(path) then
    error(("read_idx: cannot open %s: No such file or directory"):format(path), 2)
  end
  local head = core.gunzip(path, 4)
  if #head < 4 or head:byte(1) ~= 0 or head:byte(2) ~= 0 then
    error(("read_idx: %s is not an IDX file (bad magic)"):format(path), 2)
  end
  if head:byte(3) ~= 0x08 then
    error(("read_idx: %s: element type 0x%02x is not supported (only unsigned bytes, 0x08)")
      :format(path, head:byte(3)), 2)
  end
  local ndim = head:byte(4)
  if ndim < 1 then error(("read_idx: %s: IDX file with 0 dimensions"):format(path), 2) end
  local hsize = 4 + 4 * ndim
  local hdr = core.gunzip(path, hsize)
  if #hdr < hsize then
    error(("read_idx: %s: truncated header (%d of %d bytes)"):format(path, #hdr, hsize), 2)
  end
  local dims, item = {}, 1
  for d = 1, ndim do
    dims[d] = be32(hdr, 5 + 4 * (d - 1))
    if d > 1 then item = item * dims[d] end
  end
  local n = dims[1]
  if opts.limit ~= nil then
    check_count("read_idx", "limit", opts.limit)
    if opts.limit < n then n = opts.limit end
  end
  local want = hsize + n * item
  local bytes = core.gunzip(path, opts.limit ~= nil and want or nil)
  if #bytes < want then
    error(("read_idx: %s: truncated: the header promises %d bytes of data, the file has %d")
      :format(path, want - hsize, #bytes - hsize), 2)
  end
  dims[1] = n
  return dims, core.from_bytes(bytes, hsize, dims, opts.scale or 1, opts.dtype)
end

-- ---- Fashion-MNIST ----------------------------------------------------------------------

local FASHION_FILES = {
  train = { "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz" },
  test = { "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz" },
}

local FashionMNIST = {}
FashionMNIST.__index = FashionMNIST
data.FashionMNIST = FashionMNIST

--- fsdp.data.fashion_mnist{split = "train"|"test", batch =, shuffle =, seed =, dir =, limit =,
--- rank =, world_size =}: images (N, 784) f32 in [0, 1] and labels (N) i64 in 0..9.
function data.fashion_mnist(opts)
  local fn = "fsdp.data.fashion_mnist"
  opts = U.check_opts(fn, opts,
    {"split", "batch", "shuffle", "seed", "dir", "limit", "rank", "world_size"})
  local split = opts.split or "train"
  local files = FASHION_FILES[split]
  if not files then
    error(("%s: split must be \"train\" or \"test\", got %s"):format(fn, tostring(split)), 2)
  end
  check_count(fn, "batch", opts.batch)
  if opts.limit ~= nil then check_count(fn, "limit", opts.limit) end
  if opts.shuffle ~= nil and type(opts.shuffle) ~= "boolean" then
    -- a string such as "no" would count as true
    error(("%s: shuffle must be a boolean, got %s %s"):format(fn, type(opts.shuffle),
      tostring(opts.shuffle)), 2)
  end
  check_rank_world(fn, opts)
  local dir = opts.dir or "/usr/share/datasets/fashion-mnist"
  local ipath, lpath = dir .. "/" .. files[1], dir .. "/" .. files[2]
  for _, p in ipairs { ipath, lpath } do
    if not file_exists(p) then
      error(("%s: %s not found: install dataset-fashion-mnist (scripts/install-deps)")
        :format(fn, p), 2)
    end
  end
  local idims, images = data.read_idx(ipath, { limit = opts.limit, scale = 1 / 255 })
  local ldims, labels = data.read_idx(lpath, { limit = opts.limit, dtype = "i64" })
  if #idims ~= 3 or #ldims ~= 1 or idims[1] ~= ldims[1] then
    error(("%s: %s and %s do not match (images %s, labels %s)"):format(fn, ipath, lpath,
      table.concat(idims, "x"), table.concat(ldims, "x")), 2)
  end
  local n = idims[1]
  local features = idims[2] * idims[3]
  local self = setmetatable({
    split = split, batch = opts.batch, n = n, features = features, classes = 10,
    shuffle = opts.shuffle == nil and split == "train" or not not opts.shuffle,
    seed = opts.seed or core.seed(), cursor = 0, opts = opts,
    images = images:view { n, features }, labels = labels,
  }, FashionMNIST)
  return self
end

--- Number of examples in the split.
function FashionMNIST:size() return self.n end

-- Order of the examples in an epoch (array of 1-based rows), cached for the current epoch.
function FashionMNIST:_order(epoch)
  if not self.shuffle then epoch = 0 end
  if self._order_epoch ~= epoch then
    if self.shuffle then
      self._order_cache = data.permutation(self.n, self.seed, epoch)
    else
      local p = {}
      for i = 1, self.n do p[i] = i end
      self._order_cache = p
    end
    self._order_epoch = epoch
  end
  return self._order_cache
end

--- Iterator of (step, x, y) for n steps: x (B/W, 784), y (B/W). Epochs hold floor(N/B)
--- global batches (the remainder is dropped); each epoch is reshuffled with its own seeded
--- permutation.
function FashionMNIST:batches(n)
  local fn = "fashion_mnist:batches"
  check_count(fn, "n", n)
  local B = self.batch
  local rank, world = rank_world(self)
  local Bl = local_batch(fn, B, world)
  if B > self.n then
    error(("%s: batch %d is larger than the %s split (%d examples)"):format(fn, B, self.split,
      self.n), 2)
  end
  local per_epoch = floor(self.n / B)
  local done = 0
  return function()
    if done >= n then return nil end
    done = done + 1
    local k = self.cursor
    local order = self:_order(floor(k / per_epoch))
    local base = (k % per_epoch) * B + rank * Bl
    local idx = {}
    for j = 1, Bl do idx[j] = order[base + j] end
    local x, y = core.index_rows(self.images, idx), core.index_rows(self.labels, idx)
    self.cursor = k + 1 -- served: a batch that failed is not counted (a save resumes there)
    return k + 1, x, y
  end
end

--- Iterator of (i, x, y) over the whole split in file order, in batches of opts.batch (or the
--- loader's batch); the last batch may be smaller. Every rank sees every example.
function FashionMNIST:epoch(opts)
  opts = U.check_opts("fashion_mnist:epoch", opts, {"batch"})
  local B = check_count("fashion_mnist:epoch", "batch", opts.batch or self.batch)
  local pos, i = 1, 0
  return function()
    if pos > self.n then return nil end
    local cnt = math.min(B, self.n - pos + 1)
    local idx = {}
    for j = 1, cnt do idx[j] = pos + j - 1 end
    pos, i = pos + cnt, i + 1
    return i, core.index_rows(self.images, idx), core.index_rows(self.labels, idx)
  end
end

-- ---- byte-level text ----------------------------------------------------------------------

local function read_file(path)
  local f, err = io.open(path, "rb")
  if not f then error(err, 0) end
  local s = f:read("*a")
  f:close()
  return s
end

-- The files a text loader reads from `path`: the file itself, or for a folder its regular
-- text files sorted by name. Skipped: names starting with ".", *.dat (fortune's binary
-- indexes), *.u8 (fortune's UTF-8 aliases), symbolic links, folders and other non-regular
-- entries, and any file containing a NUL byte (binary).
function data.text_files(path)
  -- the path itself may be a link: to a file or to a folder, read as that file or folder
  local kind, err = core.file_kind(path, true)
  if kind == nil then
    local hint = path:find("^/usr/share/games/fortunes") and " (install fortunes: scripts/install-deps)"
      or ""
    error(("fsdp.data.text: cannot open %s%s"):format(err, hint), 0)
  end
  if kind == "file" then return { path } end
  if kind ~= "dir" then error(("fsdp.data.text: %s is not a file or a folder"):format(path), 0) end
  local entries = core.list_dir(path)
  table.sort(entries, function(a, b) return a.name < b.name end)
  local files = {}
  for _, e in ipairs(entries) do
    local name = e.name
    if e.kind == "file" and not name:find("^%.") and not name:find("%.dat$")
      and not name:find("%.u8$") then
      files[#files + 1] = path .. "/" .. name
    end
  end
  return files
end

local Text = {}
Text.__index = Text
data.Text = Text

--- fsdp.data.text(path, {ctx =, batch =, split = "train"|"val", val_fraction = 0.1, seed =,
--- rank =, world_size =}): the split's bytes as token ids 0..255.
function data.text(path, opts)
  local fn = "fsdp.data.text"
  if type(path) ~= "string" then error(fn .. ": path must be a string", 2) end
  opts = U.check_opts(fn, opts, {"ctx", "batch", "split", "val_fraction", "seed", "rank", "world_size"})
  check_count(fn, "ctx", opts.ctx)
  check_count(fn, "batch", opts.batch)
  check_rank_world(fn, opts)
  local split = opts.split or "train"
  if split ~= "train" and split ~= "val" then
    error(("%s: split must be \"train\" or \"val\", got %s"):format(fn, tostring(split)), 2)
  end
  local vf = opts.val_fraction or 0.1
  if type(vf) ~= "number" or not (vf >= 0 and vf < 1) then
    error(("%s: val_fraction must be in [0, 1), got %s"):format(fn, tostring(vf)), 2)
  end
  local ok, files = pcall(data.text_files, path)
  if not ok then error(files, 2) end
  local parts, used, binary = {}, {}, {}
  for _, f in ipairs(files) do
    local s = read_file(f)
    if s:find("\0", 1, true) then
      binary[#binary + 1] = f
    else
      -- The validation split is the last val_fraction of every file: each file (each fortune
      -- category) is represented in both splits.
      local cut = floor(#s * (1 - vf))
      parts[#parts + 1] = split == "train" and s:sub(1, cut) or s:sub(cut + 1)
      used[#used + 1] = f
    end
  end
  if #used == 0 then
    -- say why the files that are there were left out
    local why = ""
    if #binary > 0 then
      why = (" (%s %s a NUL byte: binary)"):format(table.concat(binary, ", "),
        #binary == 1 and "holds" or "hold")
    end
    error(("%s: no text files in %s%s"):format(fn, path, why), 2)
  end
  local bytes = table.concat(parts)
  return setmetatable({
    path = path, files = used, split = split, ctx = opts.ctx, batch = opts.batch, vocab = 256,
    bytes = bytes, seed = opts.seed or core.seed(), cursor = 0, opts = opts,
  }, Text)
end

--- Bytes in the split.
function Text:size() return #self.bytes end

function Text:_check_room(fn)
  if #self.bytes < self.ctx + 1 then
    error(("%s: the %s split of %s has %d bytes; a window of ctx = %d needs %d"):format(fn,
      self.split, self.path, #self.bytes, self.ctx, self.ctx + 1), 3)
  end
end

--- Iterator of (step, x, y) for n steps: x, y (B/W, ctx), y is x shifted by one byte. The
--- global batch of step k holds B windows at seeded random starts (stream k).
function Text:batches(n)
  local fn = "text:batches"
  check_count(fn, "n", n)
  local B = self.batch
  local rank, world = rank_world(self)
  local Bl = local_batch(fn, B, world)
  self:_check_room(fn)
  local span = #self.bytes - self.ctx -- number of valid starts: [0, span)
  local done = 0
  return function()
    if done >= n then return nil end
    done = done + 1
    local k = self.cursor
    local rng = Rng.new(self.seed, k)
    local starts = {}
    for j = 1, B do
      local s = rng:below(span)
      local l = j - rank * Bl
      if l >= 1 and l <= Bl then starts[l] = s end
    end
    local x, y = core.byte_windows(self.bytes, starts, self.ctx)
    self.cursor = k + 1 -- served: a batch that failed is not counted (a save resumes there)
    return k + 1, x, y
  end
end

-- The options of an evaluation pass (text:epoch, tokens:epoch): a number (max_batches) or
-- {max_batches =, batch =}; returns the batch and max_batches (nil: every window).
local function epoch_opts(fn, opts, default_batch)
  if type(opts) == "number" then opts = { max_batches = opts } end
  opts = U.check_opts(fn, opts, {"max_batches", "batch"})
  local B = check_count(fn, "batch", opts.batch or default_batch)
  if opts.max_batches ~= nil then check_count(fn, "max_batches", opts.max_batches) end
  return B, opts.max_batches
end

-- (i, x, y) over nwin non-overlapping windows of ctx (window w starts at w * ctx) in batches
-- of B, read by windows(starts); capped at max_batches * B windows spread evenly over all
-- (window floor(j * nwin / used) for j = 0, 1, ...), so a capped pass still samples everywhere.
local function epoch_windows(nwin, ctx, B, max_batches, windows)
  local used = nwin
  if max_batches and max_batches * B < nwin then used = max_batches * B end
  local nb = math.ceil(used / B)
  local i = 0
  return function()
    if i >= nb then return nil end
    local first = i * B
    local starts = {}
    for j = 1, math.min(B, used - first) do starts[j] = floor((first + j - 1) * nwin / used) * ctx end
    i = i + 1
    local x, y = windows(starts)
    return i, x, y
  end
end

--- Iterator of (i, x, y) over non-overlapping windows of ctx bytes (window w starts at
--- w*ctx), in batches of the loader's batch (the last may be smaller), for validation loss.
--- With max_batches below the full count, the max_batches*batch windows used are spread
--- evenly over the whole split (window floor(j * total / used) for j = 0, 1, ...), so a capped
--- evaluation still samples every file. Every rank sees every window.
--- opts: a number (max_batches) or {max_batches =, batch =}.
function Text:epoch(opts)
  local fn = "text:epoch"
  local B, max_batches = epoch_opts(fn, opts, self.batch)
  self:_check_room(fn)
  return epoch_windows(floor((#self.bytes - 1) / self.ctx), self.ctx, B, max_batches,
    function(starts) return core.byte_windows(self.bytes, starts, self.ctx) end)
end

--- Token ids (a table of numbers, nested tables, or a tensor) -> string.
function Text:decode(ids)
  if type(ids) ~= "table" and type(ids) ~= "number" then
    if type(ids) == "userdata" and ids.totable then
      ids = ids:totable()
    else
      error("text:decode: expected a tensor or a table of ids, got " .. type(ids), 2)
    end
  end
  local flat = {}
  local function walk(v)
    if type(v) == "table" then
      for i = 1, #v do walk(v[i]) end
    else
      if type(v) ~= "number" or v % 1 ~= 0 or v < 0 or v > 255 then
        error(("text:decode: id %s at position %d is not a byte (0..255)")
          :format(tostring(v), #flat + 1), 0)
      end
      flat[#flat + 1] = v
    end
  end
  local ok, err = pcall(walk, ids)
  if not ok then error(err, 2) end
  local out = {}
  for i = 1, #flat, 4096 do
    out[#out + 1] = string.char(unpack(flat, i, math.min(i + 4095, #flat)))
  end
  return table.concat(out)
end

--- String -> table of token ids (its bytes).
function Text:encode(str)
  if type(str) ~= "string" then error("text:encode: expected a string, got " .. type(str), 2) end
  local ids = {}
  for i = 1, #str, 4096 do
    local chunk = { str:byte(i, math.min(i + 4095, #str)) }
    for j = 1, #chunk do ids[#ids + 1] = chunk[j] end
  end
  return ids
end

-- ---- token files (nanoGPT's layout, memory-mapped) --------------------------------------------

--- A counter-based draw: a number in [0, 1) with 53 random bits, a pure function of (seed,
--- step, row). Any row of any step comes without drawing the others, so each rank draws only
--- its own rows and a resumed run draws what the uninterrupted one would have.
function data.counter_uniform(seed, step, row)
  seed = floor(tonumber(seed) or 0)
  local lo, hi = seed % 4294967296, floor(seed / 4294967296) % 4294967296
  local h = fmix32(bit.tobit(lo + 0x9e3779b9))
  h = fmix32(bit.bxor(h, bit.tobit(hi + 0x632be5ab)))
  h = fmix32(bit.bxor(h, bit.tobit(step % 4294967296)))
  h = fmix32(bit.bxor(h, bit.tobit(floor(step / 4294967296) + 0x7f4a7c15)))
  h = fmix32(bit.bxor(h, bit.tobit(row % 4294967296 + 0x2545f491)))
  local a = fmix32(bit.bxor(h, 0x68e31da4)) % 4294967296
  local b = fmix32(bit.bxor(h, 0x1b56c4e9)) % 4294967296
  return (a * 2097152 + floor(b / 2048)) / 9007199254740992
end

local Tokens = {}
Tokens.__index = Tokens
data.Tokens = Tokens

-- map:windows(...) under fn's name, raised at the user's line (a corrupt id is found here,
-- inside an iterator: the message would otherwise carry this file's position)
local function windows(fn, map, ...)
  local ok, x, y = pcall(map.windows, map, ...)
  if not ok then U.raise(fn .. ": " .. U.strip(x)) end
  return x, y
end

local TOKEN_DTYPES = { uint16 = 2, uint32 = 4 }
local TOKENS_OPTS = { "ctx", "batch", "seed", "split", "rank", "world_size" }

-- The sidecar of a token file: x.bin -> x.json (another name: name .. ".json").
local function sidecar_of(path)
  if path:find("%.bin$") then return (path:gsub("%.bin$", ".json")) end
  return path .. ".json"
end

--- fsdp.data.tokens(path, {ctx =, batch =, seed =, split = "train", rank =, world_size =}): a
--- token file written by `fsdprun tokenize` (or nanoGPT's prepare.py with a sidecar), read
--- memory-mapped. path: the .bin file, or the folder holding <split>.bin.
function data.tokens(path, opts)
  local fn = "fsdp.data.tokens"
  if type(path) ~= "string" then U.raise(fn .. ": path must be a string") end
  U.check_opts(fn, opts, TOKENS_OPTS)
  opts = opts or {}
  check_count(fn, "ctx", opts.ctx)
  check_count(fn, "batch", opts.batch)
  check_rank_world(fn, opts)
  local split = opts.split or "train"
  if type(split) ~= "string" or not split:find("^[%w_%-]+$") then
    U.raise(("%s: split must be a name such as \"train\" or \"val\", got %s"):format(fn, tostring(split)))
  end
  local folder = core.file_kind(path, true) == "dir" -- a link to a folder is that folder
  if folder then path = path:gsub("/+$", "") .. "/" .. split .. ".bin" end
  local side = sidecar_of(path)
  if core.file_kind(path, true) == nil then U.raise(("%s: %s not found"):format(fn, path)) end
  if core.file_kind(side, true) == nil then
    U.raise(("%s: %s has no sidecar: %s not found (fsdprun tokenize writes one: docs/data.md)")
      :format(fn, path, side))
  end
  local ok, meta = pcall(core.json_read, side)
  if not ok then U.raise(("%s: sidecar %s: %s"):format(fn, side, U.strip(meta))) end
  if type(meta) ~= "table" then U.raise(("%s: sidecar %s is not a JSON object"):format(fn, side)) end
  local es = TOKEN_DTYPES[meta.dtype]
  if es == nil then
    U.raise(("%s: sidecar %s: dtype must be \"uint16\" or \"uint32\", got %s"):format(fn, side,
      tostring(meta.dtype)))
  end
  local V, n = meta.vocab_size, meta.count
  if not is_count(V) then
    U.raise(("%s: sidecar %s: vocab_size must be a positive integer, got %s"):format(fn, side, U.got(V)))
  end
  if type(n) ~= "number" or n < 0 or n % 1 ~= 0 then
    U.raise(("%s: sidecar %s: count must be a whole number, got %s"):format(fn, side, U.got(n)))
  end
  if es == 2 and V > 65536 then
    U.raise(("%s: sidecar %s: a vocabulary of %d does not fit uint16 ids"):format(fn, side, V))
  end
  if not folder and type(meta.split) == "string" then
    -- a file is the split its sidecar names: a split = that names another would be silently
    -- ignored (it picks <split>.bin of a folder), and loader.split would say what it is not
    if opts.split ~= nil and opts.split ~= meta.split then
      U.raise(("%s: split = \"%s\", but %s is the %s split (its sidecar %s says so); split = picks "
        .. "<split>.bin of a folder"):format(fn, opts.split, path, meta.split, side))
    end
    split = meta.split
  end
  local okm, map = pcall(core.tokens_open, path, es, n, V)
  if not okm then U.raise(fn .. ": " .. U.strip(map)) end
  local tok = meta.tokenizer
  if type(tok) == "string" and not tok:find("^/") then
    tok = (side:match("^(.*)/[^/]*$") or ".") .. "/" .. tok
  end
  return setmetatable({
    path = path, sidecar = side, meta = meta, dtype = meta.dtype, vocab = V, count = n,
    tokenizer = type(tok) == "string" and tok or nil, eos = meta.eos, split = split,
    ctx = opts.ctx, batch = opts.batch, seed = opts.seed or core.seed(), cursor = 0,
    opts = opts, _map = map,
  }, Tokens)
end

--- Tokens in the file.
function Tokens:size() return self.count end

function Tokens:_file(fn)
  if self._map == nil then error(fn .. ": the token loader was closed", 3) end
  if self.count < self.ctx + 1 then
    error(("%s: %s has %d tokens; a window of ctx = %d needs %d"):format(fn, self.path,
      self.count, self.ctx, self.ctx + 1), 3)
  end
  return self._map
end

--- The window starts (0-based token positions) of global step k (1-based), rows [first, last]
--- (0-based): start = floor(u * (count - ctx)), u = counter_uniform(seed, k, row).
function Tokens:starts(k, first, last)
  local span = self.count - self.ctx
  local starts = {}
  for j = first, last do
    starts[#starts + 1] = floor(data.counter_uniform(self.seed, k, j) * span)
  end
  return starts
end

--- Iterator of (step, x, y) for n steps: x, y (B/W, ctx) i64, y is x shifted by one token.
--- Global step k holds B windows; row j starts at a position drawn from (seed, k, j); rank r
--- reads rows [r*B/W, (r+1)*B/W) and nothing else.
function Tokens:batches(n)
  local fn = "tokens:batches"
  check_count(fn, "n", n)
  local rank, world = rank_world(self)
  local Bl = local_batch(fn, self.batch, world)
  local map = self:_file(fn)
  local done = 0
  return function()
    if done >= n then return nil end
    done = done + 1
    local k = self.cursor + 1
    local x, y = windows(fn, map, self:starts(k, rank * Bl, rank * Bl + Bl - 1), self.ctx)
    self.cursor = k -- served: a batch that failed is not counted (a save resumes there)
    return k, x, y
  end
end

--- Iterator of (i, x, y) over non-overlapping windows (window w starts at w*ctx), in batches
--- of the loader's batch (the last may be smaller), as text:epoch: opts a number (max_batches)
--- or {max_batches =, batch =}; a capped pass spreads its windows over the whole file. Every
--- rank sees every window.
function Tokens:epoch(opts)
  local fn = "tokens:epoch"
  local B, max_batches = epoch_opts(fn, opts, self.batch)
  local map = self:_file(fn)
  return epoch_windows(floor((self.count - 1) / self.ctx), self.ctx, B, max_batches,
    function(starts) return windows(fn, map, starts, self.ctx) end)
end

--- Ids [first, first + n) of the file (0-based first) as a Lua array, for inspection.
function Tokens:read(first, n)
  local map = self._map
  if map == nil then error("tokens:read: the token loader was closed", 2) end
  -- checked here: the windows call would name a window start and its own frame
  if type(n) ~= "number" or n < 0 or n % 1 ~= 0 then
    error(("tokens:read: n must be an integer >= 0, got %s"):format(tostring(n)), 2)
  end
  if type(first) ~= "number" or first < 0 or first % 1 ~= 0 or first + n > self.count then
    error(("tokens:read: ids [%s, %s + %d) are not inside %s's %d ids (first must be an integer in [0, %d])")
      :format(tostring(first), tostring(first), n, self.path, self.count, self.count - n), 2)
  end
  if n == 0 then return {} end
  local x = windows("tokens:read", map, { first }, n, false)
  return x:totable()[1]
end

--- Unmap the file now (idempotent); the loader cannot serve batches afterwards.
function Tokens:close()
  if self._map ~= nil then self._map:close() end
  self._map = nil
end

return data
