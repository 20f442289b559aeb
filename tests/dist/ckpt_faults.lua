-- ckpt_faults.lua — damaged files and collective safety (run by tests/recipes/dist_ckpt_faults.sh
-- at 2 and 4 ranks). Every case must make EVERY rank raise the same error (T.raises checks a
-- hash of the message across ranks), name the file (and the tensor where there is one), and
-- leave the model and optimizer untouched; failed saves leave the previous checkpoint loadable.
--   fsdprun -n N tests/dist/ckpt_faults.lua --dir=TMPDIR
local fsdp = require "fsdp"
local T = dofile("tests/dist/ckpt_common.lua")
local sharded = require "fsdp.checkpoint.sharded" -- its before_index hook arms a fault
local core = fsdp.core
local dir = assert(fsdp.args.dir, "--dir=TMPDIR")
local rank, W = T.rank, T.W

local model = T.wrap(T.gpt(31))
local opt = fsdp.optim.AdamW(model, {lr = 1e-2})
T.train(model, opt, 1, 2)
local good, good_st = dir .. "/good", dir .. "/good.safetensors"
fsdp.save(model, good, {optimizer = opt, extra = {gen = "first"}})
fsdp.save(model, good_st)
local ref, ref_opt = T.values(model), T.opt_state(opt)

-- the target of failing loads: trained a little, so that any change shows
local target = T.wrap(T.gpt(32))
local topt = fsdp.optim.AdamW(target, {lr = 1e-2})
T.train(target, topt, 1, 1)
local tv, to = T.values(target), T.opt_state(topt)
local function untouched(what)
  T.same_values(T.values(target), tv, what .. ": model untouched")
  T.same_tables(T.opt_state(topt), to, what .. ": optimizer untouched")
end

local function copy_dir(src, dst)
  if rank == 0 then
    core.io_mkdirs(dst)
    for _, name in ipairs(core.io_listdir(src)) do
      T.write_file(dst .. "/" .. name, T.read_file(src .. "/" .. name))
    end
  end
  fsdp.barrier()
end

local function index_of(d) return core.json_read(d .. "/index.json") end
local function file_of(d, r) return d .. "/" .. index_of(d).files[r + 1].name end

-- Byte `at` (0-based) of the data of tensor `name` in safetensors file `path`.
local function data_byte(path, name, at)
  local f = T.parse_safetensors(path)
  return 8 + f.n + f.header[name].data_offsets[1] + at
end

local function patch(path, at, byte)
  local s = T.read_file(path)
  local old = s:byte(at + 1)
  T.write_file(path, s:sub(1, at) .. string.char(byte or (old + 1) % 256) .. s:sub(at + 2))
end

-- a damaged copy of `src` (setup runs on rank 0), then a load that must fail everywhere
local function damaged(label, src, setup, patterns, opts)
  local d = dir .. "/case_" .. label:gsub("[^%w]", "_")
  if src:match("%.safetensors$") then
    d = d .. ".safetensors"
    if rank == 0 then T.write_file(d, T.read_file(src)) end
    fsdp.barrier()
  else
    copy_dir(src, d)
  end
  if rank == 0 then setup(d) end
  fsdp.barrier()
  local err = T.raises(function() fsdp.load(target, d, opts or {optimizer = topt}) end, nil, label)
  for _, pat in ipairs(patterns) do
    if not err:find(pat, 1, true) then error(("CHECK FAILED: %s: %q not in the error: %s"):format(label, pat, err)) end
  end
  untouched(label)
  T.say(("ok: %s -> %s"):format(label, err))
end

-- ---- damaged sharded checkpoints (rank 1's file: only rank 1 reads it) ----------------------------
local victim = W - 1 -- a non-zero rank
local vname = index_of(good).files[victim + 1].name

damaged("truncated rank file", good, function(d)
  local p = file_of(d, victim)
  local s = T.read_file(p)
  T.write_file(p, s:sub(1, #s - 50))
end, {vname, "tensor '", "truncated"})

local vfile = T.parse_safetensors(file_of(good, victim))
local some -- a parameter tensor of the victim's file
for name in pairs(vfile.header) do
  if name ~= "__metadata__" and not name:find(":") and (some == nil or name < some) then some = name end
end
damaged("corrupted data byte", good, function(d)
  local p = file_of(d, victim)
  patch(p, data_byte(p, some, 6))
end, {vname, "tensor '" .. some .. "'", "checksum mismatch"})

damaged("corrupted optimizer byte", good, function(d)
  local p = file_of(d, victim)
  patch(p, data_byte(p, some .. ":exp_avg", 2))
end, {vname, "tensor '" .. some .. ":exp_avg'", "checksum mismatch"})

damaged("corrupted header byte", good, function(d)
  local p = file_of(d, victim)
  patch(p, 200)
end, {vname, "header", "needed for tensor '"})

damaged("wrong magic", good, function(d)
  local p = file_of(d, victim)
  local s = T.read_file(p)
  T.write_file(p, "GARBAGE!" .. s:sub(9))
end, {vname, "needed for tensor '"})

damaged("missing rank file", good, function(d)
  core.io_remove(file_of(d, victim))
end, {"index.json", vname, "holding tensor '", "No such file"})

-- index.json carries a checksum of its bytes: one flipped bit that keeps the JSON and the schema
-- valid (the learning rate's digit) is an error naming the file, on every rank, nothing loaded
damaged("flipped bit in the index's lr", good, function(d)
  local p = d .. "/index.json"
  local s = T.read_file(p)
  local at = assert(s:find('"lr":\t0.01', 1, true), "lr 0.01 in index.json") + #'"lr":\t0.0' - 1
  patch(p, at, bit.bxor(s:byte(at + 1), 1)) -- 0.01 -> 0.00
end, {"index.json", "index checksum mismatch", "the index is corrupted"})

damaged("index rewritten without its checksum", good, function(d)
  core.json_write(d .. "/index.json", index_of(d))
end, {"index.json", "starts with its checksum"})

-- broken schemas, in indexes of version 1 (no checksum: written before there was one, read
-- unchecked, so only the schema stands between them and the loader)
local function old_index(d, edit)
  local idx = index_of(d)
  idx.version, idx.index_xxh3 = 1, nil
  edit(idx)
  core.json_write(d .. "/index.json", idx)
end

damaged("world size the index cannot serve", good, function(d)
  old_index(d, function(idx) idx.world_size = W + 1 end)
end, {"index.json", "cannot serve"})

damaged("slices with a hole", good, function(d)
  old_index(d, function(idx)
    local e = idx.params[1]
    e.slices[#e.slices].count = e.slices[#e.slices].count - 1
  end)
end, {"index.json", "param '" .. index_of(good).params[1].path .. "'", "no rank holds elements"})

damaged("index of another format", good, function(d)
  old_index(d, function(idx) idx.format = "something.else" end)
end, {"index.json", "not a sharded checkpoint index"})

damaged("truncated index", good, function(d)
  local s = T.read_file(d .. "/index.json")
  T.write_file(d .. "/index.json", s:sub(1, 200))
end, {"index.json", "index checksum mismatch"}) -- found before the JSON is parsed

-- a valid file that is not the one the index names (another checkpoint's rank file)
local other = dir .. "/other"
fsdp.save(target, other, {optimizer = topt})
damaged("file of another checkpoint", good, function(d)
  T.write_file(file_of(d, victim), T.read_file(file_of(other, victim)))
end, {vname, "not the one the index was written with"})

-- ---- a damaged safetensors file, loaded by ranges on every rank ----------------------------------
damaged("safetensors: truncated", good_st, function(p)
  local s = T.read_file(p)
  T.write_file(p, s:sub(1, #s - 4))
end, {".safetensors", "tensor '", "truncated"}, {})

-- a byte in the middle of the largest tensor: read in parts by every rank, so no range read
-- sees a checksum; the one rank that verifies it whole must stop everyone
damaged("safetensors: corrupted byte", good_st, function(p)
  patch(p, data_byte(p, "wte.weight", 1001))
end, {".safetensors", "tensor 'wte.weight'", "checksum mismatch"}, {})

damaged("safetensors: wrong magic", good_st, function(p)
  local s = T.read_file(p)
  T.write_file(p, "\255\255\255\255\255\255\255\127" .. s:sub(9))
end, {".safetensors", "header length"}, {})

-- ---- failures while saving, on a non-zero rank: everyone raises, the previous checkpoint stays --
T.train(model, opt, 3, 1) -- the model moves on, so a half-written save would show
local function previous_loads(label)
  local m = T.wrap(T.gpt(33))
  local o = fsdp.optim.AdamW(m, {lr = 1})
  local extra = fsdp.load(m, good, {optimizer = o})
  T.same_values(T.values(m), ref, label .. ": previous checkpoint's parameters")
  T.same_tables(T.opt_state(o), ref_opt, label .. ": previous checkpoint's optimizer state")
  T.check(extra.gen == "first", label .. ": previous checkpoint's extra")
  if rank == 0 then
    local names = core.io_listdir(good)
    T.check(#names == W + 1, label .. ": only the previous checkpoint's files remain: " .. table.concat(names, " "))
  end
end

local function failing_save(label, arm, patterns, path, opts)
  if arm.rank == rank then
    if arm.index then sharded.before_index = function() core.io_fault(arm.point, arm.errno) end
    else core.io_fault(arm.point, arm.errno, arm.after) end
  end
  local err = T.raises(function() fsdp.save(model, path or good, opts or {optimizer = opt}) end, nil, label)
  core.io_fault("none")
  sharded.before_index = nil
  for _, pat in ipairs(patterns) do
    if not err:find(pat, 1, true) then error(("CHECK FAILED: %s: %q not in the error: %s"):format(label, pat, err)) end
  end
  T.say(("ok: %s -> %s"):format(label, err))
end

failing_save("disk full on rank " .. victim, {rank = victim, point = "write", errno = "ENOSPC", after = 64},
  {"rank " .. victim, "No space left on device"})
previous_loads("after disk full")
failing_save("permission denied on rank " .. victim, {rank = victim, point = "open", errno = "EACCES"},
  {"rank " .. victim, "Permission denied"})
previous_loads("after permission denied")
failing_save("fsync failure on rank " .. victim, {rank = victim, point = "fsync", errno = "EIO"},
  {"rank " .. victim, "Input/output error"})
previous_loads("after fsync failure")
failing_save("index commit failure", {rank = 0, index = true, point = "rename", errno = "EIO"},
  {"rank 0", "index.json", "Input/output error"})
previous_loads("after a failed index commit")

-- safetensors: rank 0 writes; its failure stops every rank and leaves the old file
failing_save("safetensors: disk full on rank 0", {rank = 0, point = "write", errno = "ENOSPC", after = 4096},
  {"rank 0", "good.safetensors", "No space left on device"}, good_st, {})
local m = T.wrap(T.gpt(34))
fsdp.load(m, good_st)
T.same_values(T.values(m), ref, "previous safetensors file")

-- and the next save succeeds, replacing the previous checkpoint and its files
fsdp.save(model, good, {optimizer = opt, extra = {gen = "second"}})
local m2 = T.wrap(T.gpt(35))
local o2 = fsdp.optim.AdamW(m2, {lr = 1})
T.check(fsdp.load(m2, good, {optimizer = o2}).gen == "second", "new checkpoint")
T.same_values(T.values(m2), T.values(model), "new checkpoint's parameters")
if rank == 0 then
  T.check(#core.io_listdir(good) == W + 1, "old generation removed")
end
-- options that differ across ranks: an optimizer on rank 0 only would be saved without the
-- other ranks' state; every rank refuses, naming the difference, and writes nothing
T.raises(function()
  fsdp.save(model, dir .. "/half_opt", {optimizer = rank == 0 and opt or nil})
end, 'fsdp%.save: what to save differs across ranks at %["optimizer"%]: rank 0 has "AdamW", rank 1 has false',
  "an optimizer on rank 0 only")
T.check(not core.io_size(dir .. "/half_opt/index.json"), "the refused save wrote no index")
T.say(("ok: ckpt_faults at %d ranks"):format(W))
