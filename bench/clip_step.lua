-- Gradient clipping + AdamW step benchmark (not a test): fsdp.clip_grad_norm then opt:step()
-- against one AdamW made with max_grad_norm, which takes the clipping coefficient into its
-- kernel instead of scaling the gradient shards in place first.
--
--   fsdprun [-n N] bench/clip_step.lua [--layers=6 --d=384 --heads=6] [--rounds=9]
--
-- A GPT wrapped one unit per Block gets fresh gradients (forward and backward of a small batch,
-- not timed) before every timed update; the two ways alternate, each with its own model and
-- optimizer from the same start, and clip at a limit below the gradient norm, so every update
-- scales. Prints the median update time of each over the rounds, their ratio, and checks that
-- both trained to the same bits.
local fsdp = require "fsdp"
local nn = fsdp.nn
local core = fsdp.core
local lib = dofile((arg[0]:match("^(.*[/\\])") or "") .. "lib.lua")

local args = fsdp.args {
  description = "clip_grad_norm then AdamW against AdamW with max_grad_norm (not a test).",
  { "layers", 6, "integer", "transformer blocks", min = 1 },
  { "d", 384, "integer", "model width", min = 1 },
  { "heads", 6, "integer", "attention heads", min = 1 },
  { "rounds", 9, "integer", "updates of each way (the median is reported)", min = 1 },
}
local V, T, B = 256, 32, 2 * fsdp.world_size()

local runs = {}
for i, mode in ipairs {"explicit", "fused"} do
  fsdp.manual_seed(0)
  local model = nn.GPT { vocab = V, ctx = T, d = args.d, layers = args.layers, heads = args.heads,
    tie = true }
  fsdp.wrap(model, { policy = fsdp.policy.modules { nn.Block } })
  local opt = fsdp.optim.AdamW(model, { lr = 3e-4, max_grad_norm = mode == "fused" and 0.01 or nil })
  runs[i] = { mode = mode, model = model, opt = opt, wall = {}, params = 0 }
  for _, e in ipairs(fsdp.optim.named_params(model)) do runs[i].params = runs[i].params + e.param:numel() end
end
math.randomseed(1)
local Bl = B / fsdp.world_size()
local x, y = lib.next_token(lib.random_tokens(B, T, V):narrow(1, fsdp.rank() * Bl + 1, Bl), T)

for _ = 1, args.rounds + 1 do -- the first round warms up (state allocation), not counted
  for _, r in ipairs(runs) do
    r.opt:zero_grad()
    nn.F.cross_entropy(r.model(x), y):backward()
    local t0 = core.clock()
    local total
    if r.mode == "explicit" then
      total = fsdp.clip_grad_norm(r.model, 0.01)
      r.opt:step()
    else
      r.opt:step()
      total = r.opt.grad_norm
    end
    r.wall[#r.wall + 1] = (core.clock() - t0) * 1e3
    if not (total > 0.01) then error(("gradient norm %s does not exceed the limit"):format(total), 0) end
  end
end
for _, r in ipairs(runs) do table.remove(r.wall, 1) end

-- the largest difference between the two models' parameters (gathered, both at once)
local worst = 0
fsdp.full_params(runs[1].model, function()
  fsdp.full_params(runs[2].model, function()
    local pa, pb = fsdp.optim.named_params(runs[1].model), fsdp.optim.named_params(runs[2].model)
    for i = 1, #pa do
      local m = (pa[i].param - pb[i].param):abs():max()
      worst = math.max(worst, type(m) == "number" and m or m:item())
    end
  end, { writeback = false })
end, { writeback = false })
local same = worst == 0
if fsdp.rank() == 0 then
  print(("clip + AdamW update, GPT L=%d d=%d (%d parameters), %d rank(s), %d threads, %d rounds")
    :format(args.layers, args.d, runs[1].params, fsdp.world_size(), core.get_threads(), args.rounds))
  local we, wf = lib.median(runs[1].wall), lib.median(runs[2].wall)
  print(("%-28s %10.3f ms"):format("clip_grad_norm + step", we))
  print(("%-28s %10.3f ms"):format("step with max_grad_norm", wf))
  print(("%-28s %10.2f"):format("ratio", wf / we))
  print(("same parameters after both: %s"):format(same and "yes" or "NO"))
end
if not same then error("the two ways trained different parameters", 0) end
