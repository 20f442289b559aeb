-- ckpt_spec.lua — fsdp.save / fsdp.load at world size 1 (lua/fsdp/checkpoint.lua) and the
-- checkpoint support of fsdp.core (src/lua/l_io.c: json_encode/decode, ckpt_index_read/write,
-- folders, random state). Multi-rank behaviour (sharding, resharding, collective failures) is
-- tested by tests/dist/ckpt_*.lua. Run: busted --lua=luajit tests/lua/ckpt_spec.lua

local fsdp = require "fsdp"
local core = fsdp.core
local nn = fsdp.nn
require "fsdp.checkpoint"

local H = require "helpers"
local tmpdir, rmtree = H.mktemp_dir, H.rmtree
teardown(H.remove_temps)
local errors_with = H.assert_error_has

local function gpt(seed, cfg)
  fsdp.manual_seed(seed)
  local c = {vocab = 16, ctx = 4, d = 8, layers = 1, heads = 2, tie = true}
  for k, v in pairs(cfg or {}) do c[k] = v end
  return nn.GPT(c)
end

local function values(model)
  local out = {}
  for path, p in model:named_parameters() do out[path] = p:detach():view{p:numel()}:totable() end
  return out
end

local function step(model, opt, k)
  local x = fsdp.tensor{{k % 16, (k + 3) % 16, (k * 5) % 16, 1}}
  opt:zero_grad()
  local loss = nn.F.cross_entropy(model(x), x)
  loss:backward()
  opt:step()
  return loss:item()
end

describe("fsdp.save / fsdp.load at world size 1", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rmtree(dir) end)

  it("are the API's names", function()
    assert.are.equal(require("fsdp.checkpoint").save, fsdp.save)
    assert.are.equal(require("fsdp.checkpoint").load, fsdp.load)
  end)

  it("round-trip a model through safetensors, with extra and the step in __metadata__", function()
    local m = gpt(1)
    fsdp.save(m, dir .. "/m.safetensors", {extra = {a = {1, 2}, b = "x"}, step = 7})
    local r = core.st_open(dir .. "/m.safetensors")
    local meta = r:metadata()
    assert.are.equal("wte.weight", meta["fsdp.tied.head.weight"])
    assert.are.equal("7", meta["fsdp.step"])
    assert.are.equal("fsdprun.safetensors", meta["fsdp.format"])
    r:close()
    local m2 = gpt(2)
    assert.are_not.same(values(m), values(m2))
    local extra, info = fsdp.load(m2, dir .. "/m.safetensors")
    assert.are.same({a = {1, 2}, b = "x"}, extra)
    assert.are.equal("safetensors", info.format)
    assert.are.same(values(m), values(m2))
  end)

  it("chooses the format from the path: .safetensors is one file, anything else a folder", function()
    local m = gpt(1)
    fsdp.save(m, dir .. "/a.safetensors")
    fsdp.save(m, dir .. "/folder")
    assert.is_truthy(core.io_size(dir .. "/a.safetensors"))
    assert.is_truthy(core.io_size(dir .. "/folder/index.json"))
    fsdp.save(m, dir .. "/b.bin", {format = "safetensors"})
    assert.is_truthy(core.io_size(dir .. "/b.bin"))
    local m2 = gpt(3)
    fsdp.load(m2, dir .. "/b.bin")
    assert.are.same(values(m), values(m2))
  end)

  it("round-trips a sharded checkpoint with SGD momentum, a loader, a schedule and extra", function()
    local m = gpt(1)
    local opt = fsdp.optim.SGD(m, {lr = 0.1, momentum = 0.9})
    local sched = fsdp.optim.cosine(opt, {warmup = 1, total = 10})
    for k = 1, 3 do sched:step() step(m, opt, k) end
    local loader = {cursor = 3}
    fsdp.save(m, dir .. "/ck", {optimizer = opt, loader = loader, schedule = sched, extra = {note = "n"}})
    local m2 = gpt(2)
    local opt2 = fsdp.optim.SGD(m2, {lr = 0.5, momentum = 0.9})
    local sched2 = fsdp.optim.cosine(opt2, {total = 99})
    local loader2 = {cursor = 0}
    local extra, info = fsdp.load(m2, dir .. "/ck", {optimizer = opt2, loader = loader2, schedule = sched2})
    assert.are.same({note = "n"}, extra)
    assert.are.same({format = "sharded", step = 3, world_size = 1, generation = 1}, info)
    assert.are.equal(3, loader2.cursor)
    assert.are.equal(3, sched2.k)
    assert.are.equal(10, sched2.total)
    assert.are.equal(opt.lr, opt2.lr)
    assert.are.same(values(m), values(m2))
    -- same state: the next steps are identical
    for k = 4, 5 do
      sched:step() sched2:step()
      assert.are.equal(step(m, opt, k), step(m2, opt2, k))
    end
    assert.are.same(values(m), values(m2))
  end)

  it("round-trips a warmup-stable-decay schedule; a schedule of another kind is refused", function()
    local m = gpt(1)
    local opt = fsdp.optim.SGD(m, {lr = 0.1})
    local sched = fsdp.optim.wsd(opt, {warmup = 2, total = 10, decay = 0.5, min_lr = 0.01})
    for k = 1, 7 do sched:step() step(m, opt, k) end
    fsdp.save(m, dir .. "/ck", {optimizer = opt, schedule = sched})
    local m2 = gpt(2)
    local opt2 = fsdp.optim.SGD(m2, {lr = 0.5})
    local sched2 = fsdp.optim.wsd(opt2, {total = 99})
    fsdp.load(m2, dir .. "/ck", {optimizer = opt2, schedule = sched2})
    assert.are.same(sched:state_dict(), sched2:state_dict())
    assert.are.equal(7, sched2.k)
    assert.are.equal(opt.lr, opt2.lr)
    for _ = 8, 11 do assert.are.equal(sched:step(), sched2:step()) end
    local m3 = gpt(2)
    local ok, err = pcall(fsdp.load, m3, dir .. "/ck", {schedule = fsdp.optim.linear(opt2, {total = 9})})
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("the checkpoint holds a wsd schedule, the schedule is linear", 1, true))
    assert.are.same(values(gpt(2)), values(m3)) -- refused before anything changed
  end)

  it("refuses a schedule argument that is not a schedule, naming the schedules", function()
    local m = gpt(1)
    for _, bad in ipairs({42, {}, {state_dict = function() return {} end}}) do
      for _, f in ipairs({fsdp.save, fsdp.load}) do
        local ok, err = pcall(f, m, dir .. "/ck", {schedule = bad})
        assert.is_false(ok)
        assert.is_truthy(tostring(err):find("schedule must be a learning-rate schedule", 1, true))
        assert.is_truthy(tostring(err):find("cosine, linear, constant, step_lr, wsd or lambda", 1, true))
      end
    end
  end)

  it("keeps one generation of files: a new save replaces the previous one's", function()
    local m = gpt(1)
    fsdp.save(m, dir .. "/ck")
    assert.are.same({"g1-rank0-of1.safetensors", "index.json"}, core.io_listdir(dir .. "/ck"))
    -- leftovers of a crashed save (a higher generation nobody committed) are skipped and removed
    local f = assert(io.open(dir .. "/ck/g5-rank0-of1.safetensors", "wb"))
    f:write("junk")
    f:close()
    fsdp.save(m, dir .. "/ck")
    assert.are.same({"g6-rank0-of1.safetensors", "index.json"}, core.io_listdir(dir .. "/ck"))
    assert.are.equal(6, core.ckpt_index_read(dir .. "/ck/index.json").generation)
  end)

  it("check index.json's checksum: a flipped lr fails, version 1 loads unchecked", function()
    local m = gpt(1)
    local opt = fsdp.optim.AdamW(m, {lr = 3e-3})
    step(m, opt, 1)
    fsdp.save(m, dir .. "/ck", {optimizer = opt})
    local ipath = dir .. "/ck/index.json"
    local f = assert(io.open(ipath, "rb"))
    local text = f:read("*a")
    f:close()
    assert.are.equal('{\n\t"index_xxh3":\t"', text:sub(1, 18))
    local function write(s)
      local w = assert(io.open(ipath, "wb"))
      w:write(s)
      w:close()
    end
    -- one bit: 0.003 -> 0.002, valid JSON and schema
    local at = assert(text:find('"lr":\t0.003', 1, true)) + #'"lr":\t0.00'
    write(text:sub(1, at - 1) .. "2" .. text:sub(at + 1))
    local m2, o2 = gpt(2), nil
    o2 = fsdp.optim.AdamW(m2, {lr = 1})
    local before = values(m2)
    errors_with(function() fsdp.load(m2, dir .. "/ck", {optimizer = o2}) end,
      ipath .. ": index checksum mismatch (stored ")
    assert.are.same(before, values(m2))
    assert.are.equal(1, o2.lr)
    errors_with(function() fsdp.load_model(dir .. "/ck") end, ipath .. ": index checksum mismatch")
    -- an index of version 1 (written before the checksum) is read unchecked
    local idx = core.json_decode(text)
    idx.version, idx.index_xxh3 = 1, nil
    core.json_write(ipath, idx)
    fsdp.load(m2, dir .. "/ck", {optimizer = o2})
    assert.are.same(values(m), values(m2))
    assert.are.equal(3e-3, o2.lr)
    -- the index as another program writes it (keys sorted: the checksum not at the start) is
    -- refused
    core.json_write(ipath, core.json_decode(text))
    errors_with(function() fsdp.load(m2, dir .. "/ck", {optimizer = o2}) end,
      ipath .. ": an index of version 2 starts with its checksum")
  end)

  it("loads into a model built on the meta device (plain): parameters get storage and values", function()
    local m = gpt(1)
    fsdp.save(m, dir .. "/m.safetensors")
    fsdp.save(m, dir .. "/ck")
    for _, src in ipairs{dir .. "/m.safetensors", dir .. "/ck"} do
      local mm = fsdp.meta(function() return gpt(9) end)
      assert.are.equal("meta", mm.wte.weight.device)
      fsdp.load(mm, src)
      assert.are.equal("cpu", mm.wte.weight.device)
      assert.is_true(rawequal(mm.wte.weight, mm.head.weight))
      assert.are.same(values(m), values(mm))
    end
  end)

  it("re-ties a plain model the checkpoint says is tied", function()
    local m = gpt(1)
    fsdp.save(m, dir .. "/m.safetensors")
    fsdp.save(m, dir .. "/ck")
    for _, src in ipairs{dir .. "/m.safetensors", dir .. "/ck"} do
      local u = gpt(2, {tie = false})
      fsdp.load(u, src)
      assert.is_true(rawequal(u.wte.weight, u.head.weight))
      assert.are.same(values(m), values(u))
    end
  end)

  it("loads an untied model's checkpoint into a tied model when its two copies agree", function()
    local u = gpt(1, {tie = false})
    u.head.weight:copy(u.wte.weight)
    fsdp.save(u, dir .. "/u.safetensors")
    fsdp.save(u, dir .. "/uck")
    for _, src in ipairs{dir .. "/u.safetensors", dir .. "/uck"} do
      for _, wrapped in ipairs{false, true} do
        local m = gpt(2)
        if wrapped then fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}}) end
        fsdp.load(m, src) -- strict: head.weight is accounted for as wte.weight's other path
        if wrapped then fsdp.unwrap(m) end
        assert.are.same(values(u)["wte.weight"], values(m)["wte.weight"])
        assert.is_true(rawequal(m.wte.weight, m.head.weight))
      end
    end
  end)

  it("refuses two different stored tensors for one tied parameter, naming both", function()
    local u = gpt(1, {tie = false})
    u.head.weight:copy(u.wte.weight)
    u.head.weight:set(3, 2, 0.5) -- one element differs
    fsdp.save(u, dir .. "/u.safetensors")
    fsdp.save(u, dir .. "/uck")
    for _, src in ipairs{dir .. "/u.safetensors", dir .. "/uck"} do
      for _, strict in ipairs{true, false} do
        for _, wrapped in ipairs{false, true} do
          local m = gpt(2)
          local before = values(m)
          if wrapped then fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}}) end
          errors_with(function() fsdp.load(m, src, {strict = strict}) end,
            "'wte.weight' and 'head.weight' hold one tied parameter of the model (wte.weight)",
            "but different values", "largest difference")
          if wrapped then fsdp.unwrap(m) end
          assert.are.same(before, values(m)) -- nothing loaded
        end
      end
    end
  end)

  it("removes the temporaries of a save killed midway, not those of a running one", function()
    local function temps()
      local out = {}
      for _, n in ipairs(core.io_listdir(dir)) do
        if n:find(".tmp.", 1, true) then out[#out + 1] = n end
      end
      return out
    end
    -- a save killed with kill -9 while writing its file (another process)
    local script = dir .. "/killed.lua"
    local f = assert(io.open(script, "w"))
    f:write(([[
local core = require "fsdp.core"
local w = core.st_writer(%q, {{name = "a", shape = {4}}}, {})
w:write("a", core.zeros{2})
os.execute("kill -9 $PPID")
]]):format(dir .. "/m.safetensors"))
    f:close()
    os.execute("luajit " .. script .. " >/dev/null 2>&1")
    os.remove(script)
    assert.are.equal(1, #temps())
    assert.truthy(temps()[1]:find("^%.m%.safetensors%.tmp%."))
    -- this process's save in progress stays
    local live = core.st_writer(dir .. "/live.safetensors", {{name = "a", shape = {4}}}, {})
    local m = gpt(1)
    fsdp.save(m, dir .. "/m.safetensors")
    assert.are.equal(1, #temps())
    assert.truthy(temps()[1]:find("^%.live%.safetensors%.tmp%."))
    fsdp.save(m, dir, {format = "sharded"})
    assert.are.equal(1, #temps())
    live:abort()
    assert.are.same({}, temps())
  end)

  it("reports strict-loading problems by name and shape, and leaves the model untouched", function()
    local m = gpt(1)
    fsdp.save(m, dir .. "/m.safetensors")
    fsdp.save(m, dir .. "/ck")
    for _, src in ipairs{dir .. "/m.safetensors", dir .. "/ck"} do
      local wide = gpt(2, {d = 12})
      local before = values(wide)
      errors_with(function() fsdp.load(wide, src) end, "fsdp.load: ", "wte.weight", "(16, 8)", "(16, 12)")
      assert.are.same(before, values(wide))
      -- non-strict loading still refuses a shape mismatch
      errors_with(function() fsdp.load(wide, src, {strict = false}) end, "(16, 8)", "(16, 12)")
      local deep = gpt(3, {layers = 2})
      before = values(deep)
      errors_with(function() fsdp.load(deep, src) end, "missing tensors", "blocks.2.")
      assert.are.same(before, values(deep))
      fsdp.load(deep, src, {strict = false})
      assert.are.same(values(m)["blocks.1.mlp.fc.weight"], values(deep)["blocks.1.mlp.fc.weight"])
      assert.are.same(before["blocks.2.mlp.fc.weight"], values(deep)["blocks.2.mlp.fc.weight"])
    end
  end)

  it("refuses a stored mask that is not 0/1 before loading anything", function()
    local src = gpt(1)
    local w = src.blocks[1].mlp.fc.weight
    fsdp.set_mask(w, fsdp.ones(w:shape()))
    local good, bad = dir .. "/good.safetensors", dir .. "/bad.safetensors"
    fsdp.save(src, good)
    -- the same file with a 2 in the mask
    local r = core.st_open(good)
    local entries = r:entries()
    local meta = {}
    for k, v in pairs(r:metadata()) do
      if not k:find("xxh3", 1, true) then meta[k] = v end -- (the writer's own checksums)
    end
    local wr = core.st_writer(bad, entries, meta)
    for _, e in ipairs(entries) do
      local t = r:read(e.name)
      if e.name == "blocks.1.mlp.fc.weight:mask" then t:view{t:numel()}:narrow(1, 3, 1):fill(2) end
      wr:write(e.name, t)
    end
    wr:commit()
    r:close()
    for _, wrap in ipairs{false, true} do
      local m = gpt(2)
      if wrap then fsdp.wrap(m) end
      local before = fsdp.sparsity(m)
      errors_with(function() fsdp.load(m, bad) end, "fsdp.load: ",
        "the mask of blocks.1.mlp.fc.weight holds 1 values other than 0 and 1")
      assert.is_nil(fsdp.mask(m.blocks[1].mlp.fc.weight))
      assert.are.same(before.zeros, fsdp.sparsity(m).zeros) -- no weight loaded
      fsdp.load(m, good)
      assert.is_not_nil(fsdp.mask(m.blocks[1].mlp.fc.weight))
      if wrap then fsdp.unwrap(m) end
    end
  end)

  it("refuses a wrapped model whose gathered copy was written outside full_params", function()
    local m = gpt(2)
    fsdp.wrap(m)
    local root = fsdp.units(m)[#fsdp.units(m)]
    local src = dir .. "/m.safetensors"
    fsdp.save(gpt(1), src)
    local x = fsdp.tensor{{1, 2, 3, 4}}
    local _ = nn.F.cross_entropy(m(x), x) -- the root stays gathered for the backward
    m.wpe.weight:fill(5) -- a stray write
    errors_with(function() fsdp.load(m, src) end, "fsdp.load: unit '(root)' was changed while gathered")
    root:reshard{discard = true}
    fsdp.full_params(m, function()
      assert.are_not.equal(5, m.wpe.weight:view{m.wpe.weight:numel()}:totable()[1])
    end)
    fsdp.load(m, src)
    fsdp.unwrap(m)
    assert.are.same(values(gpt(1)), values(m))
  end)

  it("checks its options", function()
    local m = gpt(1)
    local opt = fsdp.optim.AdamW(m, {})
    errors_with(function() fsdp.save(m, dir .. "/x", {fromat = "sharded"}) end, "fsdp.save: unknown option 'fromat' (valid: extra, format, loader, loaders, optimizer, schedule, step)")
    errors_with(function() fsdp.save(m, dir .. "/x", {format = "pickle"}) end, "format must be")
    errors_with(function() fsdp.save(m, dir .. "/x.safetensors", {optimizer = opt}) end,
      "safetensors file holds the model only")
    errors_with(function() fsdp.save(m, dir .. "/x", {extra = {f = print}}) end, "extra must be JSON-able")
    errors_with(function() fsdp.save(m, dir .. "/x", {optimizer = {}}) end, "optimizer must be")
    errors_with(function() fsdp.save(m, dir .. "/x", {loaders = {train = {}}}) end, "cursor")
    errors_with(function() fsdp.save({}, dir .. "/x") end, "expected a module")
    errors_with(function() fsdp.save(m, "") end, "path must be")
    errors_with(function() fsdp.load(m, dir .. "/nothing") end,
      "neither a safetensors file nor a sharded checkpoint folder")
    fsdp.save(m, dir .. "/ck")
    errors_with(function() fsdp.load(m, dir .. "/ck", {optimizer = opt}) end, "holds no optimizer state")
    errors_with(function() fsdp.load(m, dir .. "/ck", {loader = {cursor = 0}}) end,
      "no position saved for data loader 'loader'")
    local sgd = fsdp.optim.SGD(m, {lr = 1})
    fsdp.save(m, dir .. "/ck2", {optimizer = sgd})
    errors_with(function() fsdp.load(m, dir .. "/ck2", {optimizer = opt}) end, "holds SGD state, the optimizer is AdamW")
    assert.is_nil(core.io_size(dir .. "/x"))
  end)
end)

-- A small plain model whose parameters have the dtypes given: w (37), idx (5), b (3).
local Tiny = nn.Module:extend("CkptTiny")
function Tiny:init(dt)
  self.w = nn.Parameter((fsdp.arange(37) * 0.1234 - 2):to(dt.w))
  self.idx = nn.Parameter(fsdp.tensor({3, -7, 2 ^ 40, 0, 9}, {dtype = dt.idx}))
  self.b = nn.Parameter(fsdp.tensor({1 + 2 ^ -9, 0.1, -3.75}, {dtype = dt.b}))
end

local function dtypes(m)
  local out = {}
  for path, p in m:named_parameters() do out[path] = p:dtype() end
  return out
end

-- values as f64 numbers (exact for every dtype)
local function exact(t) return t:to("f64"):view{t:numel()}:totable() end

describe("fsdp.save / fsdp.load keep dtypes", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rmtree(dir) end)

  local LOW = {w = "bf16", idx = "i64", b = "f32"}

  it("store each parameter in its own dtype and load it back bit for bit", function()
    local m = Tiny(LOW)
    fsdp.save(m, dir .. "/m.safetensors")
    fsdp.save(m, dir .. "/ck")
    local want = {w = "BF16", idx = "I64", b = "F32"}
    local r = core.st_open(dir .. "/m.safetensors")
    for _, e in ipairs(r:entries()) do assert.are.equal(want[e.name], e.dtype) end
    r:close()
    local idx = core.ckpt_index_read(dir .. "/ck/index.json")
    for _, e in ipairs(idx.params) do assert.are.equal(want[e.path], e.dtype) end
    for _, src in ipairs{dir .. "/m.safetensors", dir .. "/ck"} do
      local m2 = Tiny(LOW)
      for _, p in ipairs(m2:parameters()) do p:fill(0) end
      fsdp.load(m2, src)
      assert.are.same(dtypes(m), dtypes(m2))
      for path, p in m:named_parameters() do assert.are.same(exact(p), exact(m2[path])) end
    end
  end)

  it("convert when loading into a model of other dtypes", function()
    -- bf16 and i64 into f32: exact widening
    local low = Tiny(LOW)
    fsdp.save(low, dir .. "/low.safetensors")
    fsdp.save(low, dir .. "/low")
    for _, src in ipairs{dir .. "/low.safetensors", dir .. "/low"} do
      local m = Tiny{w = "f32", idx = "f32", b = "f32"}
      fsdp.load(m, src)
      assert.are.same({w = "f32", idx = "f32", b = "f32"}, dtypes(m))
      for path, p in low:named_parameters() do assert.are.same(exact(p), exact(m[path])) end
    end
    -- f32 into bf16 rounds to nearest even; into i32 the integers stay
    local high = Tiny{w = "f32", idx = "f32", b = "f32"}
    high.b:set(3, 0 / 0)
    high.w:set(1, 1 / 0)
    fsdp.save(high, dir .. "/high.safetensors")
    fsdp.save(high, dir .. "/high")
    for _, src in ipairs{dir .. "/high.safetensors", dir .. "/high"} do
      local m = Tiny{w = "bf16", idx = "i32", b = "bf16"}
      fsdp.load(m, src)
      assert.are.same({w = "bf16", idx = "i32", b = "bf16"}, dtypes(m))
      assert.are.same(exact(high.w:to("bf16")), exact(m.w))
      assert.are.equal(1 / 0, m.w:get(1))
      assert.are.same({3, -7, 2 ^ 31 - 1, 0, 9}, exact(m.idx)) -- 2^40 saturates
      local b = exact(m.b)
      assert.are.equal(1, b[1]) -- 1 + 2^-9 is below half a bf16 step
      assert.are.equal(exact(high.b:to("bf16"))[2], b[2])
      assert.is_true(b[3] ~= b[3]) -- NaN stays NaN
    end
  end)

  it("give tensors in extra back in their dtype, shape and values", function()
    local m = gpt(1)
    local ema = (fsdp.arange(6) * 0.3):to("bf16"):view{2, 3}
    local ids = fsdp.tensor({{1, 2}, {3, 2 ^ 50}}, {dtype = "i64"}):transpose(1, 2) -- strided
    local flags = fsdp.tensor({1, 0, 1}, {dtype = "bool"})
    local extra = {ema = ema, ids = ids, list = {flags, "s", 3}, note = "n"}
    for _, src in ipairs{dir .. "/m.safetensors", dir .. "/ck"} do
      fsdp.save(m, src, {extra = extra})
      local got = fsdp.load(gpt(2), src)
      assert.are.equal("n", got.note)
      assert.are.equal("s", got.list[2])
      assert.are.equal(3, got.list[3])
      for _, pair in ipairs{{got.ema, ema}, {got.ids, ids}, {got.list[1], flags}} do
        local a, b = pair[1], pair[2]
        assert.are.equal(b:dtype(), a:dtype())
        assert.are.same(b:shape(), a:shape())
        assert.are.same(exact(b:contiguous()), exact(a))
      end
    end
    -- the safetensors file holds them under fsdp.extra:<n>, in their dtypes
    local r = core.st_open(dir .. "/m.safetensors")
    local by = {}
    for _, e in ipairs(r:entries()) do by[e.name] = e end
    assert.are.same({"BF16", "I64", "BOOL"}, {by["fsdp.extra:1"].dtype, by["fsdp.extra:2"].dtype,
      by["fsdp.extra:3"].dtype})
    r:close()
    -- a tensor alone is extra too
    fsdp.save(m, dir .. "/one.safetensors", {extra = ema})
    assert.are.same(exact(ema), exact(fsdp.load(gpt(2), dir .. "/one.safetensors")))
  end)

  it("refuse what cannot be saved or converted, naming it", function()
    local m = gpt(1)
    errors_with(function() fsdp.save(m, dir .. "/x", {extra = {a = {fsdp.empty({2}, {device = "meta"})}}}) end,
      "extra must be JSON-able values and tensors", "extra.a[1] is a tensor without data (on the meta device)")
    errors_with(function() fsdp.save(m, dir .. "/x", {extra = {a = {["fsdp.tensor"] = "x"}}}) end,
      "extra.a has the key \"fsdp.tensor\"")
    local cyc = {}
    cyc.self = cyc
    errors_with(function() fsdp.save(m, dir .. "/x", {extra = cyc}) end, "nested deeper than 64 levels")
    assert.is_nil(core.io_size(dir .. "/x"))
    -- a stored dtype with no tensor dtype: the message names the tensor and both dtypes
    local One = nn.Module:extend("CkptOne")
    function One:init() self.w = nn.Parameter(fsdp.zeros{2}) end
    local path = dir .. "/i16.safetensors"
    local json = '{"w":{"dtype":"I16","shape":[2],"data_offsets":[0,4]}}'
    local len = ""
    for i = 0, 7 do len = len .. string.char(math.floor(#json / 256 ^ i) % 256) end
    local f = assert(io.open(path, "wb"))
    f:write(len, json, "\1\0\2\0")
    f:close()
    errors_with(function() fsdp.load(One(), path) end,
      "tensor 'w': stored dtype I16 has no tensor dtype, so it cannot be read as f32")
    -- extra naming a tensor the file does not have
    path = dir .. "/noextra.safetensors"
    local w = core.st_writer(path, {{name = "w", shape = {2}}},
      {["fsdp.extra"] = '{"a":{"fsdp.tensor":"fsdp.extra:7"}}'})
    w:write("w", fsdp.zeros{2})
    w:commit()
    errors_with(function() fsdp.load(One(), path) end,
      "fsdp.extra names tensor 'fsdp.extra:7', which the file does not have")
    -- a sharded index whose extra_tensors disagree with extra or with rank 0's file
    local one = One()
    fsdp.save(one, dir .. "/ck", {extra = {t = fsdp.ones{2, 2}}})
    local ipath = dir .. "/ck/index.json"
    local idx = core.ckpt_index_read(ipath)
    idx.extra_tensors[1].dtype = "BF16"
    core.ckpt_index_write(ipath, idx)
    errors_with(function() fsdp.load(One(), dir .. "/ck") end,
      "tensor 'fsdp.extra:1' is missing or is not the BF16 (2, 2) the index lists")
    idx.extra_tensors = nil
    core.ckpt_index_write(ipath, idx)
    errors_with(function() fsdp.load(One(), dir .. "/ck") end,
      "extra names tensor 'fsdp.extra:1', which extra_tensors does not list")
  end)
end)

describe("checkpoint support in fsdp.core", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rmtree(dir) end)

  it("json_encode / json_decode round-trip values, sorted keys, exact numbers", function()
    local v = {b = {1, 2.5, "x", true}, a = {c = 0.1, d = -3}, e = 1e300}
    local s = core.json_encode(v)
    assert.are.equal('{"a":{"c":0.1,"d":-3},"b":[1,2.5,"x",true],"e":1e+300}', s)
    assert.are.same(v, core.json_decode(s))
    errors_with(function() core.json_decode("{", "thing") end, "thing: not valid JSON")
    errors_with(function() core.json_encode({f = print}) end, "$.f")
  end)

  it("save and restore the random state (seed and stream offsets)", function()
    fsdp.manual_seed(3)
    fsdp.randn{5}
    local st = core.rng_state()
    assert.are.equal("0000000000000003", st.seed)
    assert.are.equal("0000000000000008", st.streams.randn)
    local a = fsdp.randn{4}:totable()
    fsdp.manual_seed(99)
    core.set_rng_state(st)
    assert.are.same(a, fsdp.randn{4}:totable())
    errors_with(function() core.set_rng_state({seed = "xyz"}) end, "16 lowercase hex digits")
    errors_with(function() core.set_rng_state({seed = st.seed, streams = {bogus = st.seed}}) end,
      "unknown random stream 'bogus'")
    errors_with(function() core.set_rng_state({seed = st.seed, streams = {randn = "0000000000000003"}}) end,
      "not a multiple of 4")
  end)

  it("ckpt_index_write checks the index before writing it", function()
    local good = {format = "fsdprun.sharded", version = 1, generation = 1, world_size = 1, step = 0,
      files = {{rank = 0, name = "g1-rank0-of1.safetensors", bytes = 64, header_xxh3 = "0123456789abcdef"}},
      params = {{path = "w", shape = {2, 3}, numel = 6, slices = {{rank = 0, first = 0, count = 6}}}}}
    core.ckpt_index_write(dir .. "/index.json", good)
    local back = core.ckpt_index_read(dir .. "/index.json")
    -- written as version 2, with the checksum of its bytes
    assert.are.equal(2, back.version)
    assert.is_truthy(back.index_xxh3:match("^%x+$") and #back.index_xxh3 == 16)
    back.version, back.index_xxh3 = 1, nil
    assert.are.same(good, back)
    good.params[1].slices[1].count = 5
    errors_with(function() core.ckpt_index_write(dir .. "/bad.json", good) end,
      dir .. "/bad.json: param 'w': no rank holds elements [5, 6)")
    assert.is_nil(core.io_size(dir .. "/bad.json"))
    good.params[1].slices[1].count = 6
    good.files[1].name = "../escape"
    errors_with(function() core.ckpt_index_write(dir .. "/bad.json", good) end, "plain file name")
  end)

  it("folders: mkdirs (nested, idempotent), listdir (sorted), remove (missing is fine)", function()
    core.io_mkdirs(dir .. "/a/b/c")
    core.io_mkdirs(dir .. "/a/b/c/")
    for _, n in ipairs{"z", "m", "a"} do
      local f = io.open(dir .. "/a/" .. n, "wb")
      f:write(n)
      f:close()
    end
    assert.are.same({"a", "b", "m", "z"}, core.io_listdir(dir .. "/a"))
    core.io_remove(dir .. "/a/m")
    core.io_remove(dir .. "/a/m")
    assert.are.same({"a", "b", "z"}, core.io_listdir(dir .. "/a"))
    assert.are.equal(1, core.io_size(dir .. "/a/z"))
    errors_with(function() core.io_mkdirs(dir .. "/a/z/q") end, "cannot create folder")
    errors_with(function() core.io_listdir(dir .. "/nope") end, "cannot open folder")
    core.io_fsync_dir(dir .. "/a")
  end)
end)
