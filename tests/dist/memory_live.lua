-- Live memory after wrapping and after each training step (tests/recipes/dist_memory.sh): exact
-- figures, with no collectgarbage anywhere, so what fsdp.memory() counts is what the program
-- still holds, not what waits for Lua's collector.
--   fsdprun -n N tests/dist/memory_live.lua [--plain]     (--plain: 1 rank, the model not wrapped)
-- Expected on every rank, in bytes (f32: 4 per element; S = this rank's shards, 4 total / N plus
-- padding; batch = the x and y tensors; pos = the GPT's cached positions, 8 ctx):
--   built            params = 4 total (a tied head never allocates a weight of its own)
--   wrapped          params = S, with the parameters' Lua references held across wrapping
--                    (the dense pre-wrap weights are not counted); grads = optim = gathered =
--                    0 (gradient shards come with the first backward); activations = batch
--   after each step  params = S, grads = S, optim = 2 S (AdamW), gathered = 0;
--                    activations = batch + pos + the logits (B/N x T x V) and loss (4) that the
--                    loop still holds; once it frees those, batch + pos: the forward's
--                    intermediates and the optimizer's gradient values are freed when dead
--   plain            the same with S = 4 total (dense parameters and gradients)
local fsdp = require "fsdp"
local nn = fsdp.nn
local W, rank = fsdp.world_size(), fsdp.rank()
local plain = fsdp.args.plain == true
if plain and W ~= 1 then error("--plain runs on 1 rank") end

local V, T, B = 64, 32, 4
fsdp.manual_seed(7)
local model = nn.GPT{vocab = V, ctx = T, d = 64, layers = 3, heads = 2}
local total = model:num_parameters()

local failures = 0
local function expect(label, got, want)
  if got ~= want then
    failures = failures + 1
    print(("[rank %d] FAIL: %s: %d bytes, expected %d (%+d)"):format(rank, label, got, want,
      got - want))
  end
end
local function expect_mem(when, want)
  local m = fsdp.memory()
  for _, role in ipairs{"params", "grads", "optim", "gathered", "activations", "other"} do
    expect(when .. ": " .. role, m[role], want[role] or 0)
  end
  return m
end

expect_mem("built", {params = 4 * total})

local Bl = B / W -- this rank's rows of the global batch
local x, y = {}, {}
for i = 1, Bl do
  x[i], y[i] = {}, {}
  for t = 1, T do
    x[i][t] = ((rank * Bl + i) * 7 + t * 3) % V
    y[i][t] = (x[i][t] + 1) % V
  end
end
x, y = fsdp.tensor(x), fsdp.tensor(y)
local batch = (x:numel() + y:numel()) * 4 -- f32

local S = 4 * total
-- references to the parameters held across wrapping: wrapping swaps what backs them, so the
-- dense pre-wrap weights must leave the count all the same
local held = model:parameters()
if not plain then
  fsdp.wrap(model, {policy = fsdp.policy.modules{nn.Block}})
  S = 0
  local units = fsdp.units(model)
  for _, u in ipairs(units) do S = S + u:shard_numel() * 4 end
  -- S is this rank's 1/W of the dense bytes plus padding (each parameter starts on a 16-element
  -- boundary, each unit is padded to 16 W elements), so a unit that kept its full weights
  -- fails here and not only in the comparisons below
  local pad = 4 * 16 * (#held + W * #units)
  if S * W < 4 * total or S * W > 4 * total + pad then
    failures = failures + 1
    print(("[rank %d] FAIL: shards %d B at %d ranks, expected %d B / %d plus padding")
      :format(rank, S, W, 4 * total, W))
  end
end
expect_mem(plain and "plain" or "wrapped", {params = S, activations = batch})

local opt = fsdp.optim.AdamW(model, {lr = 1e-3})
local pos = T * 8 -- GPT:positions, made by the first forward and kept
local logits_bytes = Bl * T * V * 4
for s = 1, 3 do
  opt:zero_grad()
  local logits = model(x)
  local loss = nn.F.cross_entropy(logits, y)
  loss:backward()
  opt:step()
  local when = ("after step %d"):format(s)
  expect_mem(when, {params = S, grads = S, optim = 2 * S,
                    activations = batch + pos + logits_bytes + 4})
  logits:free()
  loss:free()
  expect_mem(when .. ", logits and loss freed", {params = S, grads = S, optim = 2 * S,
                                                   activations = batch + pos})
end

if rank == 0 then
  print(("world %d%s: %d parameters (%d tensors held across wrapping); shards %d B, "
    .. "after a step params %d + grads %d + optim %d B, activations held: batch %d + "
    .. "positions %d B (+ logits %d + loss 4 B until freed)")
    :format(W, plain and " (plain)" or "", total, #held, S, S, S, 2 * S, batch, pos, logits_bytes))
end
if failures > 0 then error(("%d live-memory checks failed"):format(failures)) end
