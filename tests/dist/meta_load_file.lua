-- Loading a checkpoint file into meta models (tests/recipes/dist_meta.sh). A tied GPT is saved
-- with fsdp.save (safetensors: wte.weight stored once, head.weight recorded as its alias), then
-- loaded into models built with fsdp.meta:
--   A. wrapped on meta, fsdp.load on every rank (each reads its own ranges)
--   B. wrapped on meta, the file opened on rank 0 only: meta.load_tensors(model, reader | nil)
--      broadcasts one parameter at a time (low-memory loading: only rank 0 touches the file)
--   C. a plain meta model loaded on rank 0 only, then wrap{sync_module_states = true}
--   D. a plain meta model, fsdp.load (every parameter materialized in place)
--   E. a bf16 copy of the file, loaded into models wrapped on meta as in B (rank 0 converts
--      to the shards' dtype before it broadcasts) and A: the values rounded to bf16
-- Each ends with every rank holding its correct shard (bitwise the saved values), the tie one
-- object, and the model running.
--   fsdprun -n N tests/dist/meta_load_file.lua --dir=TMPDIR
local fsdp = require "fsdp"
require "fsdp.meta"
local meta = require "fsdp.meta"
local nn = fsdp.nn
local core = fsdp.core
local W, rank = fsdp.world_size(), fsdp.rank()
local dir = assert(fsdp.args.dir, "--dir=TMPDIR")

local C = dofile("tests/dist/common.lua")
local check = C.check

local flat = C.flat
local same = C.same

local cfg = {vocab = 40, ctx = 8, d = 16, layers = 3, heads = 2}
local function build() return nn.GPT(cfg) end
local policy = function() return fsdp.policy.modules{nn.Block} end

-- the saved model: trained a little, so its values are not what any init would give
fsdp.manual_seed(61)
local src = build()
fsdp.wrap(src, {policy = policy()})
local opt = fsdp.optim.SGD(src, {lr = 0.1})
nn.F.cross_entropy(src(fsdp.tensor{{1, 2, 3, 4}}), fsdp.tensor{{2, 3, 4, 5}}):backward()
opt:step()
local path = dir .. "/gpt.safetensors"
fsdp.save(src, path, {format = "safetensors"})
local ref = {}
fsdp.full_params(src, function(m)
  for p, t in m:named_parameters() do ref[p] = flat(t) end
end)
local x = fsdp.tensor{{3, 1, 4, 1, 5}}
local yref = flat(src(x))

local function verify(m, what)
  check(rawequal(m.head.weight, m.wte.weight), what .. ": the tie is one object")
  fsdp.full_params(m, function(mm)
    for p, t in mm:named_parameters() do
      check(same(flat(t), ref[p]), ("%s: %s holds the saved values"):format(what, p))
    end
  end)
  check(same(flat(m(x)), yref), what .. ": the loaded model computes the saved one's function")
end

-- A. wrapped on meta, fsdp.load (every rank reads its ranges)
fsdp.manual_seed(1000 + rank)
local a = fsdp.meta(build)
fsdp.wrap(a, {policy = policy()})
check(not pcall(a, x), "A: a forward before loading is refused")
fsdp.load(a, path)
verify(a, "A (fsdp.load)")

-- B. wrapped on meta, the file read on rank 0 only
local b = fsdp.meta(build)
fsdp.wrap(b, {policy = policy()})
local reader = rank == 0 and core.st_open(path) or nil
local res = meta.load_tensors(b, reader)
if reader then reader:close() end
check(res.loaded == #b:parameters(), "B: every parameter loaded")
verify(b, "B (rank 0 reads)")

-- C. plain meta model loaded on rank 0, then synced
local c = fsdp.meta(build)
if rank == 0 then
  local r = core.st_open(path)
  meta.load_tensors(c, r)
  r:close()
end
fsdp.wrap(c, {policy = policy(), sync_module_states = true})
verify(c, "C (rank 0 loads, sync)")

-- D. plain meta model, fsdp.load
local d = fsdp.meta(build)
fsdp.load(d, path)
for p, t in d:named_parameters() do
  check(t.device == "cpu" and same(flat(t), ref[p]), "D (plain fsdp.load): " .. p)
end
check(rawequal(d.head.weight, d.wte.weight), "D: the tie is one object")

-- E. the same values stored as BF16 (written by rank 0 from the F32 file, converted)
local path16 = dir .. "/gpt_bf16.safetensors"
if rank == 0 then
  local r = core.st_open(path)
  local es, md = {}, {}
  for i, e in ipairs(r:entries()) do es[i] = {name = e.name, shape = e.shape, dtype = "BF16"} end
  for k, v in pairs(r:metadata()) do if k:match("^fsdp%.tied%.") then md[k] = v end end
  local w = core.st_writer(path16, es, md)
  for _, e in ipairs(es) do w:write(e.name, r:read(e.name)) end
  w:commit()
  r:close()
end
fsdp.barrier()
local ref16 = {}
for p, v in pairs(ref) do ref16[p] = flat(fsdp.tensor(v):to("bf16"):to("f32")) end
local function verify16(m, what)
  check(rawequal(m.head.weight, m.wte.weight), what .. ": the tie is one object")
  fsdp.full_params(m, function(mm)
    for p, t in mm:named_parameters() do
      check(t:dtype() == "f32" and same(flat(t), ref16[p]), ("%s: %s holds the bf16 values"):format(what, p))
    end
  end)
end
local e = fsdp.meta(build)
fsdp.wrap(e, {policy = policy()})
local reader16 = rank == 0 and core.st_open(path16) or nil
res = meta.load_tensors(e, reader16)
if reader16 then reader16:close() end
check(res.loaded == #e:parameters(), "E: every parameter loaded")
verify16(e, "E (rank 0 reads a bf16 file)")
local e2 = fsdp.meta(build)
fsdp.wrap(e2, {policy = policy()})
fsdp.load(e2, path16)
verify16(e2, "E (fsdp.load of a bf16 file)")

if rank == 0 then print(("meta_load_file at %d ranks: %d checks failed"):format(W, C.failures())) end
if C.failures() > 0 then error(("%d meta_load_file checks failed"):format(C.failures())) end
