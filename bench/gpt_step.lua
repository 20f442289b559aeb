-- GPT train-step benchmark (forward + backward + AdamW), not a test.
--   fsdprun bench/gpt_step.lua [--steps=6] [--threads=N] [--only=L4]
-- Prints tokens/s, achieved GFLOP/s (6 x params x tokens + 12 L d T per token for attention,
-- the convention of llm.c and ../shared/MEASUREMENTS.md) and, measured in the same run, OpenBLAS
-- sgemm GFLOP/s at the model's MLP shape (B*T, d) @ (d, 4d), with the ratio of the two.
local fsdp = require "fsdp"
local nn = fsdp.nn
local core = fsdp.core

local args = fsdp.args
local steps = args.steps or 6
if args.threads then core.set_threads(args.threads) end
local B, T, V = args.batch or 8, args.ctx or 256, 256

local configs = {
  { name = "L4-d256", layers = 4, d = 256, heads = 4 },
  { name = "L6-d384", layers = 6, d = 384, heads = 6 },
}

local function median(xs)
  table.sort(xs)
  local n = #xs
  return n % 2 == 1 and xs[(n + 1) / 2] or 0.5 * (xs[n / 2] + xs[n / 2 + 1])
end

local function random_ids(n)
  local t = {}
  for i = 1, n do t[i] = math.random(0, V - 1) end
  return t
end

print(("GPT train step, batch %d x ctx %d, vocab %d, BLAS threads %d, %d timed steps")
  :format(B, T, V, core.get_threads(), steps))
print(("%-8s %9s %9s %10s %10s %12s %7s"):format("model", "params", "step s", "tokens/s",
  "GFLOP/s", "sgemm GF/s", "ratio"))
math.randomseed(1)
for _, c in ipairs(configs) do
  if not args.only or c.name:find(args.only, 1, true) then
    fsdp.manual_seed(0)
    local model = nn.GPT { vocab = V, ctx = T, d = c.d, layers = c.layers, heads = c.heads, tie = true }
    local params = 0
    for _, p in ipairs(model:parameters()) do params = params + p:numel() end
    local opt = fsdp.optim.AdamW(model, { lr = 3e-4 })
    local ids = fsdp.tensor(random_ids(B * (T + 1))):view { B, T + 1 }
    local x = ids:narrow(2, 1, T):contiguous()
    local y = ids:narrow(2, 2, T):contiguous()
    local times = {}
    for s = 1, steps + 1 do
      local t0 = core.clock()
      local loss = nn.F.cross_entropy(model(x), y)
      opt:zero_grad()
      loss:backward()
      opt:step()
      local dt = core.clock() - t0
      if s > 1 then times[#times + 1] = dt end -- step 1 warms up allocations and BLAS
    end
    local dt = median(times)
    local tokens = B * T
    local flops = 6 * params * tokens + 12 * c.layers * c.d * T * tokens
    local gflops = flops / dt / 1e9
    local sgemm = core.sgemm_gflops(B * T, 4 * c.d, c.d, 1.0)
    print(("%-8s %8.2fM %9.3f %10.0f %10.1f %12.1f %7.2f"):format(c.name, params / 1e6, dt,
      tokens / dt, gflops, sgemm, gflops / sgemm))
  end
end
