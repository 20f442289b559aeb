-- Checkpoints of a model wrapped with mixed precision (tests/recipes/dist_mp_ckpt.sh): the f32
-- masters are saved (dtype F32 in the index and in the files, values bf16 cannot hold), loaded
-- bit for bit at any world size and into other policies, and a resumed run equals the
-- uninterrupted one bit for bit.
--   fsdprun -n N tests/dist/mp_ckpt.lua --phase=save --ckpt=DIR --ref=FILE
--     trains a bf16-wrapped tied GPT 3 steps (AdamW), saves DIR (sharded, with the optimizer)
--     and DIR.safetensors, checks the dtypes there, writes the masters and optimizer state to
--     FILE (JSON, exact); then trains 3 more steps and adds their losses and the final masters
--   fsdprun -n N tests/dist/mp_ckpt.lua --phase=load --ckpt=DIR --ref=FILE [--mp=bf16|f16|f32]
--     [--out=DIR2]  loads DIR into a new model wrapped with --mp (f32: no mp) and a new AdamW:
--     masters and optimizer state equal FILE's bitwise; with --mp=bf16 it trains the 3 more
--     steps: at the saving world size FILE's losses and final masters bitwise (resume), at
--     another within 1e-2 (each rank's bf16 gradient rounding covers other rows); the
--     safetensors file loads the same masters; with --out saves both again (the next world
--     size reads them)
local fsdp = require "fsdp"
local T = dofile("tests/dist/ckpt_common.lua")
local core = fsdp.core
local nn = fsdp.nn
local a = fsdp.args
local NAMES = {"exp_avg", "exp_avg_sq"}

local function model(seed, mp)
  local m = T.gpt(seed, {d = 24, layers = 2})
  return fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}, mp = mp})
end
local function adamw(m) return fsdp.optim.AdamW(m, {lr = 1e-2, weight_decay = 0.1}) end

-- how many values bf16 cannot hold (the masters are f32)
local function not_bf16(values)
  local n = 0
  for _, v in pairs(values) do
    local r = fsdp.tensor(v):to("bf16"):to("f32"):totable()
    for i = 1, #v do if r[i] ~= v[i] then n = n + 1 end end
  end
  return n
end

if a.phase == "save" then
  local m = model(11, "bf16")
  local opt = adamw(m)
  T.train(m, opt, 1, 3)
  fsdp.save(m, a.ckpt, {optimizer = opt, step = 3})
  fsdp.save(m, a.ckpt .. ".safetensors")
  local ref = {values = T.values(m), optim = T.full_opt_state(m, opt, NAMES), step = opt.step_count}
  T.check(not_bf16(ref.values) > 1000, "the masters hold values bf16 cannot")
  if T.rank == 0 then
    local idx = core.ckpt_index_read(a.ckpt .. "/index.json")
    for _, e in ipairs(idx.params) do T.check(e.dtype == "F32", e.path .. ": index dtype " .. tostring(e.dtype)) end
    for _, file in ipairs(idx.files) do
      local f = T.parse_safetensors(a.ckpt .. "/" .. file.name)
      for name, e in pairs(f.header) do
        if name ~= "__metadata__" and not name:find("^fsdp%.") then
          T.check(e.dtype == "F32", ("%s: %s stored as %s"):format(file.name, name, e.dtype))
        end
      end
    end
    local f = T.parse_safetensors(a.ckpt .. ".safetensors")
    for path, v in pairs(ref.values) do
      T.check(f.header[path] and f.header[path].dtype == "F32", path .. " in the safetensors file as F32")
      local stored = T.tensor_values(f, path)
      for i = 1, #v do
        if stored[i] ~= v[i] then T.check(false, ("%s[%d] stored %.9g, master %.9g"):format(path, i, stored[i], v[i])) end
      end
    end
  end
  ref.losses = T.train(m, opt, 4, 3)
  ref.final = T.values(m)
  if T.rank == 0 then core.json_write(a.ref, ref) end
  T.say(("ok: a bf16-wrapped model saved at %d ranks: F32 masters in the index and the files"):format(T.W))
elseif a.phase == "load" then
  local mp = a.mp or "bf16"
  local m = model(12, mp ~= "f32" and mp or nil)
  local opt = adamw(m)
  local _, info = fsdp.load(m, a.ckpt, {optimizer = opt})
  local ref = core.json_read(a.ref)
  T.same_values(T.values(m), ref.values, ("masters at %d ranks (mp %s) from a %d-rank checkpoint"):format(T.W, mp, info.world_size))
  T.same_tables(T.full_opt_state(m, opt, NAMES), ref.optim, "optimizer state")
  T.check(opt.step_count == ref.step, "optimizer step count")
  for _, u in ipairs(fsdp.units(m)) do
    T.check(u:dtypes().param == mp, ("unit %s keeps its policy (%s)"):format(u.path, u:dtypes().param))
  end
  if a.out then
    fsdp.save(m, a.out, {optimizer = opt, step = 3})
    fsdp.save(m, a.out .. ".safetensors")
  end
  local other = model(13, mp ~= "f32" and mp or nil)
  fsdp.load(other, a.ckpt .. ".safetensors")
  T.same_values(T.values(other), ref.values, "masters from the safetensors file")
  local resumed = ""
  if mp == "bf16" and info.world_size == T.W then
    local losses = T.train(m, opt, 4, 3)
    for i = 1, 3 do
      T.check(losses[i] == ref.losses[i], ("resumed loss %d: %.9g, uninterrupted %.9g"):format(i, losses[i], ref.losses[i]))
    end
    T.same_values(T.values(m), ref.final, "masters after resuming")
    resumed = "; 3 resumed steps equal the uninterrupted run bitwise"
  elseif mp == "bf16" then
    -- at another world size each rank's gradient is rounded to bf16 over other rows
    -- (dist_mp_equivalence.sh): close, not the same bits
    local losses = T.train(m, opt, 4, 3)
    local worst = 0
    for i = 1, 3 do worst = math.max(worst, math.abs(losses[i] - ref.losses[i]) / ref.losses[i]) end
    T.check(worst < 1e-2, ("resumed at another world size: loss within 1e-2 (%.3g)"):format(worst))
    resumed = ("; 3 resumed steps within %.2g of the uninterrupted run's losses"):format(worst)
  end
  T.say(("ok: %d-rank checkpoint of a bf16 model loaded at %d ranks with mp %s: masters and AdamW "
    .. "state bitwise%s"):format(info.world_size, T.W, mp, resumed))
else
  error("--phase=save|load")
end
