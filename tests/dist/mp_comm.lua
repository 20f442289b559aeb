-- Mixed-precision traffic (tests/recipes/dist_mp_comm.sh): fsdp.comm_stats() per training step
-- of a GPT wrapped with mp against the same model wrapped in f32, every count asserted exactly
-- on every rank.
--   all-gather bytes: param bf16 (or f16) moves 2 bytes per element, so exactly 0.5 x f32, in
--     the same calls (also an eval forward under no_grad)
--   reduce-scatter bytes (strategy none: the all-reduce of the gradients): reduce = "f32" the
--     same as f32 (1 x), reduce = "bf16" exactly 0.5 x
--   everything else (the optimizer's has-gradient flags, clip_grad_norm) unchanged
--   full_params and u:gather() move the f32 masters: as many bytes as in an f32 model
-- The f32 figures are the schedule of tests/dist/comm_bytes.lua (they are checked there).
local fsdp = require "fsdp"
local nn = fsdp.nn
local rank = fsdp.rank()
local steps = 3

local C = dofile("tests/dist/common.lua")
local check = C.check

fsdp.manual_seed(5)
local model = nn.GPT{vocab = 32, ctx = 16, d = 32, layers = 4, heads = 2}

local x, y = {}, {}
for i = 1, 2 do
  x[i], y[i] = {}, {}
  for t = 1, 16 do
    x[i][t] = (rank * 11 + i * 5 + t * 3) % 32
    y[i][t] = (x[i][t] + 1) % 32
  end
end
x, y = fsdp.tensor(x, {dtype = "i64"}), fsdp.tensor(y, {dtype = "i64"})

local function train_step(opt)
  opt:zero_grad()
  local loss = nn.F.cross_entropy(model(x), y)
  loss:backward()
  fsdp.clip_grad_norm(model, 1.0)
  opt:step()
end

local KEYS = {"all_gather", "reduce_scatter", "all_reduce", "broadcast"}

-- bytes and calls per step of training, of an eval forward, of a full_params
local function measure(strategy, mp)
  fsdp.wrap(model, {strategy = strategy, policy = fsdp.policy.modules{nn.Block}, mp = mp})
  local opt = fsdp.optim.SGD(model, {lr = 1e-3})
  train_step(opt) -- records the forward order (prefetch starts from the second step)
  fsdp.reset_comm_stats()
  for _ = 1, steps do train_step(opt) end
  local s = fsdp.comm_stats()
  local r = {step = {}, eval = {}, full = {}}
  for _, k in ipairs(KEYS) do
    r.step[k .. "_bytes"] = s[k .. "_bytes"] / steps
    r.step[k .. "_calls"] = s[k .. "_calls"] / steps
  end
  fsdp.reset_comm_stats()
  fsdp.no_grad(function() return model(x) end)
  s = fsdp.comm_stats()
  for _, k in ipairs(KEYS) do r.eval[k .. "_bytes"], r.eval[k .. "_calls"] = s[k .. "_bytes"], s[k .. "_calls"] end
  fsdp.reset_comm_stats()
  fsdp.full_params(model, function() end, {writeback = false})
  s = fsdp.comm_stats()
  for _, k in ipairs(KEYS) do r.full[k .. "_bytes"], r.full[k .. "_calls"] = s[k .. "_bytes"], s[k .. "_calls"] end
  -- the gradient part of the all-reduces (strategy none): the flags are 4 bytes per parameter,
  -- clip_grad_norm 8 (one double)
  r.flags = 0
  for _, u in ipairs(fsdp.units(model)) do r.flags = r.flags + 4 * #u:paths() end
  fsdp.unwrap(model)
  return r
end

local function expect(label, got, want)
  check(got == want, ("%s: got %s, expected %s"):format(label, tostring(got), tostring(want)))
end

for _, strategy in ipairs{"full", "grad_op", "none"} do
  local f32 = measure(strategy, nil)
  for _, mp in ipairs{
    {name = "bf16", mp = "bf16", gather = 0.5, reduce = 1},
    {name = "f16", mp = {param = "f16"}, gather = 0.5, reduce = 1},
    {name = "bf16, reduce bf16", mp = {param = "bf16", reduce = "bf16"}, gather = 0.5, reduce = 0.5},
    {name = "f32, reduce bf16", mp = {reduce = "bf16"}, gather = 1, reduce = 0.5},
  } do
    local m = measure(strategy, mp.mp)
    local label = ("%s, mp %s"):format(strategy, mp.name)
    expect(label .. ": all_gather bytes/step", m.step.all_gather_bytes, mp.gather * f32.step.all_gather_bytes)
    expect(label .. ": reduce_scatter bytes/step", m.step.reduce_scatter_bytes,
      mp.reduce * f32.step.reduce_scatter_bytes)
    local grad_ar = f32.step.all_reduce_bytes - f32.flags - 8 -- strategy none: the gradients
    expect(label .. ": all_reduce bytes/step", m.step.all_reduce_bytes,
      mp.reduce * grad_ar + f32.flags + 8)
    for _, k in ipairs(KEYS) do
      expect(label .. ": " .. k .. " calls/step", m.step[k .. "_calls"], f32.step[k .. "_calls"])
    end
    expect(label .. ": eval all_gather bytes", m.eval.all_gather_bytes, mp.gather * f32.eval.all_gather_bytes)
    expect(label .. ": eval all_gather calls", m.eval.all_gather_calls, f32.eval.all_gather_calls)
    expect(label .. ": full_params all_gather bytes (f32 masters)", m.full.all_gather_bytes,
      f32.full.all_gather_bytes)
    if strategy ~= "none" then
      check(f32.step.all_gather_bytes > 0 and f32.step.reduce_scatter_bytes > 0,
        label .. ": the f32 run moved parameters and gradients")
    end
    if rank == 0 then
      print(("%-29s per step: all_gather %7d B (f32 %7d)  reduce_scatter %7d B (f32 %7d)  "
        .. "all_reduce %7d B (f32 %7d)"):format(label, m.step.all_gather_bytes,
        f32.step.all_gather_bytes, m.step.reduce_scatter_bytes, f32.step.reduce_scatter_bytes,
        m.step.all_reduce_bytes, f32.step.all_reduce_bytes))
    end
  end
end
if rank == 0 then print(("world size %d"):format(fsdp.world_size())) end
if C.failures() > 0 then error(("%d mixed-precision comm_stats checks failed"):format(C.failures())) end
