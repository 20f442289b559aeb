-- ckpt_reshard.lua — resharding (run by tests/recipes/dist_ckpt_reshard.sh): a sharded
-- checkpoint saved at one world size loads at another with identical parameters and optimizer
-- state (AdamW moments and step counts), the ranges computed from the index.
--   fsdprun -n N tests/dist/ckpt_reshard.lua --phase=save --ckpt=DIR --ref=FILE
--     trains a wrapped GPT 3 steps, saves it, and writes (rank 0) the full parameters and
--     optimizer state to FILE (JSON, exact numbers)
--   fsdprun -n N tests/dist/ckpt_reshard.lua --phase=load --ckpt=DIR --ref=FILE [--out=DIR2]
--     [--plain]   loads DIR into a new model (wrapped, or plain with --plain) and optimizer,
--     checks both against FILE bitwise, and (with --out) saves again for the next world size
--   fsdprun -n N tests/dist/ckpt_reshard.lua --phase=rngcheck --ckpt=DIR --ref=FILE
--     (N differs from DIR's world size) a copy of DIR whose ranks had different random states
--     is refused with a clear error, the model untouched; rng = false loads it
--   fsdprun -n N tests/dist/ckpt_reshard.lua --phase=damaged --ckpt=DIR --ref=FILE
--     (N differs) a corrupted byte inside a tensor that ranks read by ranges is caught
local fsdp = require "fsdp"
local T = dofile("tests/dist/ckpt_common.lua")
local core = fsdp.core
local a = fsdp.args
local NAMES = {"exp_avg", "exp_avg_sq"}

local function snapshot(model, opt)
  return {values = T.values(model), optim = T.full_opt_state(model, opt, NAMES),
    step = opt.step_count, lr = opt.lr}
end

if a.phase == "save" then
  local model = T.wrap(T.gpt(11, {d = 24, layers = 2}))
  local opt = fsdp.optim.AdamW(model, {lr = 1e-2, weight_decay = 0.1})
  T.train(model, opt, 1, 3)
  fsdp.save(model, a.ckpt, {optimizer = opt, step = 3})
  local snap = snapshot(model, opt)
  if T.rank == 0 then core.json_write(a.ref, snap) end
  T.say(("ok: saved at %d ranks"):format(T.W))
elseif a.phase == "load" then
  local model = T.gpt(12, {d = 24, layers = 2})
  if not a.plain then T.wrap(model) end
  local opt = fsdp.optim.AdamW(model, {lr = 1, weight_decay = 0})
  local _, info = fsdp.load(model, a.ckpt, {optimizer = opt})
  local ref = core.json_read(a.ref)
  local snap = snapshot(model, opt)
  T.same_values(snap.values, ref.values, ("parameters at %d ranks from a %d-rank checkpoint"):format(T.W, info.world_size))
  T.same_tables(snap.optim, ref.optim, ("optimizer state at %d ranks from a %d-rank checkpoint"):format(T.W, info.world_size))
  T.check(snap.step == ref.step and snap.lr == ref.lr, "optimizer step and lr")
  if a.out then fsdp.save(model, a.out, {optimizer = opt, step = 3}) end
  T.say(("ok: %d-rank checkpoint loaded at %d ranks%s: parameters and optimizer state identical")
    :format(info.world_size, T.W, a.plain and " (plain model)" or ""))
elseif a.phase == "rngcheck" then
  -- a checkpoint whose ranks had different random states cannot be resumed at another world
  -- size with them (which rank's would each new rank take?); rng = false loads the rest
  local copy = a.ckpt .. "_rng"
  if T.rank == 0 then
    core.io_mkdirs(copy)
    for _, name in ipairs(core.io_listdir(a.ckpt)) do
      T.write_file(copy .. "/" .. name, T.read_file(a.ckpt .. "/" .. name))
    end
    local idx = core.json_read(copy .. "/index.json")
    T.check(idx.world_size ~= T.W, "rngcheck needs another world size than the checkpoint's")
    idx.rng[#idx.rng].seed = "00000000000004d2"
    core.json_write(copy .. "/index.json", idx)
  end
  fsdp.barrier()
  local model = T.wrap(T.gpt(12, {d = 24, layers = 2}))
  local before = T.values(model)
  T.raises(function() fsdp.load(model, copy) end, "a different random state on each", "per-rank random states")
  T.same_values(T.values(model), before, "model untouched")
  fsdp.load(model, copy, {rng = false})
  T.same_values(T.values(model), core.json_read(a.ref).values, "rng = false loads the rest")
  T.say(("ok: per-rank random states refused at %d ranks; rng = false loads"):format(T.W))
elseif a.phase == "damaged" then
  -- a corrupted byte inside a saved slice that a new rank boundary cuts: the new ranks read
  -- that slice in parts (range reads carry no checksum), so it must be verified whole; every
  -- rank raises the same error and nothing changes
  local copy = a.ckpt .. "_damaged"
  local model = T.wrap(T.gpt(12, {d = 24, layers = 2}))
  local before = T.values(model)
  if T.rank == 0 then
    core.io_mkdirs(copy)
    for _, name in ipairs(core.io_listdir(a.ckpt)) do
      T.write_file(copy .. "/" .. name, T.read_file(a.ckpt .. "/" .. name))
    end
    local starts = {} -- path -> list of first elements (0-based) of the new ranks' slices
    for _, u in ipairs(fsdp.units(model)) do
      for _, l in ipairs(u:layout()) do
        starts[l.path] = starts[l.path] or {}
        for _, sl in pairs(l.slices) do table.insert(starts[l.path], sl[1] - 1) end
      end
    end
    local idx = core.json_read(copy .. "/index.json")
    local target
    for _, e in ipairs(idx.params) do
      for _, sl in ipairs(e.slices) do
        for _, b in ipairs(starts[e.path] or {}) do
          if not target and b > sl.first and b < sl.first + sl.count then
            target = {path = e.path, rank = sl.rank, at = b - sl.first}
          end
        end
      end
    end
    T.check(target ~= nil, "a saved slice that a new rank boundary cuts")
    local file = copy .. "/" .. idx.files[target.rank + 1].name
    local f = T.parse_safetensors(file)
    local at = 8 + f.n + f.header[target.path].data_offsets[1] + 4 * target.at + 1
    local s = T.read_file(file)
    T.write_file(file, s:sub(1, at) .. string.char((s:byte(at + 1) + 1) % 256) .. s:sub(at + 2))
  end
  fsdp.barrier()
  local err = T.raises(function() fsdp.load(model, copy) end, "checksum mismatch", "damaged tensor")
  T.same_values(T.values(model), before, "model untouched")
  T.say(("ok: a corrupted byte read by ranges at %d ranks is caught: %s"):format(T.W, err))
else
  error("--phase=save|load|rngcheck|damaged")
end
