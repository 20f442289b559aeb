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
--   fsdprun -n N tests/dist/ckpt_reshard.lua --phase=extra_save --ckpt=DIR --ref=FILE
--     saves a wrapped GPT with tensors in extra (bf16, i64, bool) as DIR (sharded) and
--     DIR.safetensors, and the parameters to FILE
--   fsdprun -n N tests/dist/ckpt_reshard.lua --phase=extra_load --ckpt=DIR --ref=FILE [--plain]
--     (another N) loads both: the parameters as saved, extra's tensors in their dtypes, bit for
--     bit
--   fsdprun -n N tests/dist/ckpt_reshard.lua --phase=tied --ckpt=DIR
--     an untied model's two copies of a tied parameter: refused on every rank when they differ
--     (one element), loaded when equal, both formats, strict or not
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
    local idx = core.ckpt_index_read(copy .. "/index.json")
    T.check(idx.world_size ~= T.W, "rngcheck needs another world size than the checkpoint's")
    idx.rng[#idx.rng].seed = "00000000000004d2"
    core.ckpt_index_write(copy .. "/index.json", idx) -- a new checksum for the changed index
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
elseif a.phase == "extra_save" or a.phase == "extra_load" then
  -- tensors in extra keep their dtype; rank 0's are saved, every rank gets them back
  local function extra_tensors()
    return {
      ema = (fsdp.arange(15) * 0.371 - 2):view{3, 5}:to("bf16"),
      counts = fsdp.tensor({-5, 2 ^ 40, 2 ^ 53}, {dtype = "i64"}),
      flags = fsdp.tensor({1, 0, 1, 1}, {dtype = "bool"}),
    }
  end
  local function as_f64(t) return t:to("f64"):view{t:numel()}:totable() end
  if a.phase == "extra_save" then
    local model = T.wrap(T.gpt(13, {d = 24, layers = 2}))
    local X = extra_tensors()
    local extra = {note = "bf16 extra", ema = X.ema, nested = {counts = X.counts, list = {{flags = X.flags}}}}
    fsdp.save(model, a.ckpt, {extra = extra, step = 5})
    fsdp.save(model, a.ckpt .. ".safetensors", {extra = extra})
    local values = T.values(model)
    if T.rank == 0 then
      core.json_write(a.ref, {values = values})
      -- the index records every dtype; rank 0's file holds extra's tensors in theirs
      local idx = core.ckpt_index_read(a.ckpt .. "/index.json")
      for _, e in ipairs(idx.params) do T.check(e.dtype == "F32", e.path .. ": index dtype " .. tostring(e.dtype)) end
      local want = {["fsdp.extra:1"] = {"BF16", 15}, ["fsdp.extra:2"] = {"I64", 3}, ["fsdp.extra:3"] = {"BOOL", 4}}
      T.check(#idx.extra_tensors == 3, "three extra tensors in the index")
      local f = T.parse_safetensors(a.ckpt .. "/" .. idx.files[1].name)
      for _, x in ipairs(idx.extra_tensors) do
        T.check(want[x.name] and want[x.name][1] == x.dtype, x.name .. ": index dtype " .. tostring(x.dtype))
        T.check(f.header[x.name] and f.header[x.name].dtype == x.dtype, x.name .. " in rank 0's file")
      end
      T.check(f.header["fsdp.extra:1"].data_offsets[2] - f.header["fsdp.extra:1"].data_offsets[1] == 30,
        "a bf16 tensor of 15 elements takes 30 bytes")
      f = T.parse_safetensors(a.ckpt .. ".safetensors")
      T.check(f.header["fsdp.extra:1"].dtype == "BF16" and f.header["fsdp.extra:2"].dtype == "I64",
        "extra's tensors in their dtypes in the safetensors file")
    end
    T.say(("ok: a model with bf16, i64 and bool tensors in extra saved at %d ranks"):format(T.W))
  else
    local ref = core.json_read(a.ref)
    local X = extra_tensors()
    for _, file in ipairs({a.ckpt, a.ckpt .. ".safetensors"}) do
      local model = T.gpt(14, {d = 24, layers = 2})
      if not a.plain then T.wrap(model) end
      local extra, info = fsdp.load(model, file)
      T.same_values(T.values(model), ref.values, "parameters from " .. file)
      T.check(extra.note == "bf16 extra", "extra's JSON values")
      local got = {ema = extra.ema, counts = extra.nested.counts, flags = extra.nested.list[1].flags}
      for name, want in pairs(X) do
        local t = got[name]
        T.check(t ~= nil and t:dtype() == want:dtype(), ("extra %s: dtype %s, saved %s")
          :format(name, t and t:dtype() or "nil", want:dtype()))
        T.check(table.concat(t:shape(), ",") == table.concat(want:shape(), ","), "extra " .. name .. ": shape")
        T.same_values({[name] = as_f64(t)}, {[name] = as_f64(want)}, "extra " .. name)
      end
      if info.world_size then T.check(info.world_size ~= T.W, "loaded at another world size") end
    end
    T.say(("ok: extra's bf16, i64 and bool tensors loaded at %d ranks%s, bit for bit, in their dtypes")
      :format(T.W, a.plain and " (plain model)" or ""))
  end
elseif a.phase == "tied" then
  -- an untied GPT whose head.weight copies wte.weight, saved (wrapped) in both formats, loads
  -- into a tied GPT; with one element different in the copy the load fails on every rank
  -- alike, naming both tensors, and the model keeps its values
  for _, differ in ipairs{true, false} do
    local u = T.gpt(21, {tie = false})
    fsdp.no_grad(function()
      u.head.weight:copy(u.wte.weight)
      if differ then u.head.weight:set(32, 16, 0.5) end -- the last element
    end)
    T.wrap(u)
    local dir = ("%s_%s"):format(a.ckpt, differ and "differ" or "equal")
    fsdp.save(u, dir)
    fsdp.save(u, dir .. ".safetensors")
    for _, src in ipairs{dir, dir .. ".safetensors"} do
      for _, strict in ipairs{true, false} do
        local m = T.gpt(22)
        T.wrap(m)
        local before = T.values(m)
        if differ then
          local err = T.raises(function() fsdp.load(m, src, {strict = strict}) end,
            "'wte.weight' and 'head.weight' hold one tied parameter of the model %(wte.weight%) but "
            .. "different values %(largest difference", "tied copies that differ: " .. src)
          T.check(T.W == 1 or err:find("rank %d+ of " .. T.W .. ": "), "the failing rank is named: " .. err)
          T.same_values(T.values(m), before, "nothing loaded from " .. src)
        else
          fsdp.load(m, src, {strict = strict})
          local got, want = T.values(m), T.values(u)
          T.same_values({["wte.weight"] = got["wte.weight"]}, {["wte.weight"] = want["wte.weight"]},
            "the tied parameter from " .. src)
          T.check(rawequal(m.wte.weight, m.head.weight), "the tie holds")
        end
      end
    end
  end
  T.say(("ok: tied copies that differ refused, equal ones loaded, at %d ranks (both formats)"):format(T.W))
else
  error("--phase=save|load|rngcheck|damaged|extra_save|extra_load|tied")
end
