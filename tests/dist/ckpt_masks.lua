-- ckpt_masks.lua — masks (fsdp.set_mask, lua/fsdp/mask.lua) through checkpoints (run by
-- tests/recipes/dist_ckpt_masks.sh):
--   --phase=save: a wrapped GPT with masks on three parameters (one of them the tied
--     wte.weight), trained 3 steps (masked weights stay 0); saves a sharded checkpoint and a
--     safetensors file, and writes (rank 0) the full masks and values to --ref. Checks the
--     safetensors file independently: "<path>:mask" tensors equal to the masks.
--   --phase=load (any world size): loads both into new wrapped and plain models: the same
--     masks (fsdp.mask), the same values, unmasked parameters have no mask, and training on
--     keeps the masked weights at 0.
--   fsdprun -n N tests/dist/ckpt_masks.lua --phase=save|load --dir=DIR --ref=FILE
local fsdp = require "fsdp"
local T = dofile("tests/dist/ckpt_common.lua")
local core = fsdp.core
local a = fsdp.args
local MASKED = {"wte.weight", "blocks.1.mlp.fc.weight", "blocks.2.attn.qkv.weight"}

local function params_by_path(model)
  local out = {}
  for path, p in model:named_parameters() do out[path] = p end
  return out
end

-- {path = flat mask values} of the masked parameters (collective when wrapped)
local function masks_of(model)
  local out = {}
  local ps = params_by_path(model)
  local paths = {}
  for path in pairs(ps) do paths[#paths + 1] = path end
  table.sort(paths)
  for _, path in ipairs(paths) do
    local m = fsdp.mask(ps[path])
    if m then out[path] = m:view{m:numel()}:totable() end
  end
  return out
end

if a.phase == "save" then
  local model = T.wrap(T.gpt(41, {d = 24}))
  local ps = params_by_path(model)
  for i, path in ipairs(MASKED) do
    local p = ps[path]
    local shape = p:shape()
    local n = p:numel()
    local vals = {}
    for k = 1, n do vals[k] = ((k * (i + 2)) % 5 == 0) and 0 or 1 end
    fsdp.set_mask(p, fsdp.tensor(vals):view(shape))
  end
  local opt = fsdp.optim.AdamW(model, {lr = 1e-2})
  T.train(model, opt, 1, 3)
  fsdp.save(model, a.dir .. "/ck", {optimizer = opt})
  fsdp.save(model, a.dir .. "/m.safetensors")
  local ref = {masks = masks_of(model), values = T.values(model)}
  local nm = 0
  for _ in pairs(ref.masks) do nm = nm + 1 end
  T.check(nm == #MASKED, "three masked parameters")
  if T.rank == 0 then
    core.json_write(a.ref, ref)
    local f = T.parse_safetensors(a.dir .. "/m.safetensors")
    for _, path in ipairs(MASKED) do
      T.same_values({[path] = T.tensor_values(f, path .. ":mask")}, {[path] = ref.masks[path]}, "mask in the file")
      local v = T.tensor_values(f, path)
      for k, mk in ipairs(ref.masks[path]) do
        T.check(mk == 1 or v[k] == 0, path .. ": a masked weight is 0 in the file")
      end
    end
    T.check(f.header["wpe.weight:mask"] == nil, "no mask for an unmasked parameter")
  end
  T.say(("ok: masks saved at %d ranks"):format(T.W))
elseif a.phase == "load" then
  local ref = core.json_read(a.ref)
  for _, src in ipairs{a.dir .. "/ck", a.dir .. "/m.safetensors"} do
    for _, kind in ipairs{"wrapped", "plain"} do
      local model = T.gpt(42, {d = 24})
      if kind == "wrapped" then T.wrap(model) end
      fsdp.load(model, src)
      local what = ("%s into a %s model at %d ranks"):format(src:match("[^/]*$"), kind, T.W)
      T.same_tables(masks_of(model), ref.masks, what .. ": masks")
      T.same_values(T.values(model), ref.values, what .. ": values")
      -- plain: every rank trains its own copy on purpose
      local opt = fsdp.optim.AdamW(model, {lr = 1e-2, local_only = kind == "plain"})
      T.train(model, opt, 4, 2)
      local after = T.values(model)
      for path, mk in pairs(ref.masks) do
        for k = 1, #mk do
          if mk[k] == 0 then T.check(after[path][k] == 0, what .. ": " .. path .. " masked weight stays 0") end
        end
      end
    end
  end
  T.say(("ok: masks loaded at %d ranks (sharded and safetensors, wrapped and plain)"):format(T.W))
end
