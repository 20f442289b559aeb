-- ckpt_roundtrip.lua — fsdp.save / fsdp.load round trips at any world size (run by
-- tests/recipes/dist_ckpt.sh at 1, 2 and 4 ranks):
--   * safetensors from a wrapped model: an independent parse (bytes and JSON only) finds a
--     standard file holding exactly the model's values, the tie stored once; loading it into
--     a wrapped model (other seed), into a plain model, and into an untied plain model (which
--     gets the tie back) gives the same values bitwise; a plain model's file loads wrapped;
--   * strict loading: a shape mismatch names the tensor and both shapes; missing and
--     unexpected names are listed; strict = false loads what matches; every rank raises the
--     same error and the model is untouched;
--   * sharded with AdamW state, extra, a loader position and a schedule: loading into a new
--     wrapped model and optimizer restores values and optimizer state bitwise, and training
--     on gives the same losses bitwise;
--   * both formats load into a model built and wrapped on the meta device.
--   fsdprun -n N tests/dist/ckpt_roundtrip.lua --dir=TMPDIR [--strategy=full]
local fsdp = require "fsdp"
local T = dofile("tests/dist/ckpt_common.lua")
local nn = fsdp.nn
local dir = assert(fsdp.args.dir, "--dir=TMPDIR")
local strategy = fsdp.args.strategy or "full"
local W = T.W

-- a trained wrapped model
local model = T.wrap(T.gpt(1), strategy)
local opt = fsdp.optim.AdamW(model, {lr = 1e-2, weight_decay = 0.1})
T.train(model, opt, 1, 3)
local ref = T.values(model)

-- ---- safetensors ------------------------------------------------------------------------------
local st = dir .. "/model.safetensors"
fsdp.save(model, st, {format = "safetensors", extra = {note = "roundtrip", world = W}})
if T.rank == 0 then
  local f = T.parse_safetensors(st)
  local meta = f.header.__metadata__
  T.check(meta["fsdp.tied.head.weight"] == "wte.weight", "tie recorded in __metadata__")
  T.check(f.header["head.weight"] == nil, "a tied parameter is stored once")
  local n = 0
  for name in pairs(f.header) do
    if name ~= "__metadata__" then
      n = n + 1
      T.check(ref[name] ~= nil, "unexpected tensor " .. name)
      T.same_values({[name] = T.tensor_values(f, name)}, {[name] = ref[name]}, "file vs model")
    end
  end
  local m = 0
  for _ in pairs(ref) do m = m + 1 end
  T.check(n == m, ("%d tensors in the file, %d parameters"):format(n, m))
end
fsdp.barrier()

local wrapped2 = T.wrap(T.gpt(2), strategy)
local extra = fsdp.load(wrapped2, st)
T.check(extra.note == "roundtrip" and extra.world == W, "extra comes back")
T.same_values(T.values(wrapped2), ref, "safetensors -> wrapped")

local plain = T.gpt(3)
fsdp.load(plain, st)
T.same_values(T.values(plain), ref, "safetensors -> plain")

local untied = T.gpt(4, {tie = false})
T.check(untied.head.weight ~= untied.wte.weight, "untied model")
fsdp.load(untied, st)
T.check(rawequal(untied.head.weight, untied.wte.weight), "load re-ties head.weight to wte.weight")
T.same_values(T.values(untied), ref, "safetensors -> untied plain")

-- a plain model's file (every rank holds it; rank 0 writes) loads into a wrapped model
local st2 = dir .. "/plain.safetensors"
fsdp.save(plain, st2)
local wrapped3 = T.wrap(T.gpt(5), strategy)
fsdp.load(wrapped3, st2)
T.same_values(T.values(wrapped3), ref, "plain safetensors -> wrapped")

-- ---- strict -----------------------------------------------------------------------------------
local before = T.values(wrapped3)
local wider = T.wrap(T.gpt(6, {d = 32}), strategy)
local wider_before = T.values(wider)
local err = T.raises(function() fsdp.load(wider, st) end,
  "tensor 'wte.weight': shape %(32, 16%) in the file, %(32, 32%) in the model", "shape mismatch")
T.same_values(T.values(wider), wider_before, "model untouched after a shape error")

local deeper = T.wrap(T.gpt(7, {layers = 3}), strategy)
local deeper_before = T.values(deeper)
err = T.raises(function() fsdp.load(deeper, st) end, "missing tensors", "missing names")
T.check(err:find("blocks%.3%.ln1%.weight"), "missing names listed: " .. err)
T.same_values(T.values(deeper), deeper_before, "model untouched after a missing-names error")
fsdp.load(deeper, st, {strict = false})
local dv = T.values(deeper)
T.same_values({["blocks.1.mlp.fc.weight"] = dv["blocks.1.mlp.fc.weight"]},
  {["blocks.1.mlp.fc.weight"] = ref["blocks.1.mlp.fc.weight"]}, "strict = false loads what matches")
T.same_values({["blocks.3.mlp.fc.weight"] = dv["blocks.3.mlp.fc.weight"]},
  {["blocks.3.mlp.fc.weight"] = deeper_before["blocks.3.mlp.fc.weight"]}, "strict = false leaves the rest")

local shallower = T.wrap(T.gpt(8, {layers = 1}), strategy)
err = T.raises(function() fsdp.load(shallower, st) end, "unexpected tensors", "unexpected names")
T.check(err:find("blocks%.2%.attn%.qkv%.weight"), "unexpected names listed: " .. err)
T.same_values(T.values(wrapped3), before, "other models untouched")

-- ---- sharded with optimizer state, extra, loader and schedule ------------------------------------
local loader = {cursor = 17}
local sched = fsdp.optim.cosine(opt, {warmup = 2, total = 100})
sched:step()
local sh = dir .. "/sharded"
fsdp.save(model, sh, {format = "sharded", optimizer = opt, extra = {tag = "x", list = {1, 2, 3}},
  loaders = {train = loader}, schedule = sched})
local ref_opt = T.opt_state(opt)

local model2 = T.wrap(T.gpt(9), strategy)
local opt2 = fsdp.optim.AdamW(model2, {lr = 1, weight_decay = 0})
local loader2 = {cursor = 0}
local sched2 = fsdp.optim.cosine(opt2, {warmup = 10, total = 10})
local extra2, info = fsdp.load(model2, sh, {optimizer = opt2, loaders = {train = loader2}, schedule = sched2})
T.check(extra2.tag == "x" and #extra2.list == 3 and extra2.list[3] == 3, "extra of a sharded checkpoint")
T.check(info.format == "sharded" and info.step == 3 and info.world_size == W, "info")
T.check(loader2.cursor == 17, "loader position restored")
T.check(sched2.k == 1 and sched2.total == 100, "schedule restored")
T.check(opt2.lr == opt.lr and opt2.weight_decay == 0.1 and opt2.step_count == 3, "optimizer hyper-parameters")
T.same_values(T.values(model2), ref, "sharded -> wrapped: parameters")
T.same_tables(T.opt_state(opt2), ref_opt, "sharded -> wrapped: optimizer state")
local l1 = T.train(model, opt, 4, 2)
local l2 = T.train(model2, opt2, 4, 2)
T.same_tables(l2, l1, "losses after loading")
T.same_values(T.values(model2), T.values(model), "parameters after training on")

-- a plain model at the same world size loads the sharded checkpoint too
local plain2 = T.gpt(10)
fsdp.load(plain2, sh)
T.same_values(T.values(plain2), ref, "sharded -> plain")

-- a model built and wrapped on the meta device (fsdp.meta): loading gives it its values
for _, src in ipairs{st, sh} do
  local mm = fsdp.meta(function() return T.gpt(11) end)
  T.wrap(mm, strategy)
  fsdp.load(mm, src)
  T.same_values(T.values(mm), ref, "into a model wrapped on meta from " .. src:match("[^/]*$"))
end

T.say(("ok: ckpt_roundtrip at %d ranks (strategy %s)"):format(W, strategy))
