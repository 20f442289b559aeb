-- GPT train-step benchmark (forward + backward + AdamW), not a test.
--   fsdprun bench/gpt_step.lua [--steps=6] [--threads=N] [--only=L4] [--strategy=full]
--   fsdprun -n 2 bench/gpt_step.lua      # the same global batch on 2 ranks, sharded
-- At N ranks the model is wrapped (one unit per Block, strategy "full" unless --strategy=) and
-- each rank runs its B/N rows of the same global batch; the step time is the slowest rank's.
-- Prints tokens/s, achieved GFLOP/s (6 x params x tokens + 12 L d T per token for attention,
-- llm.c's convention) and, measured in the same run, OpenBLAS
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

local world, rank = fsdp.world_size(), fsdp.rank()
local function say(...) if rank == 0 then print(...) end end
if B % world ~= 0 then error(("batch %d does not split over %d ranks"):format(B, world)) end
local strategy = args.strategy or "full"
say(("GPT train step, batch %d x ctx %d, vocab %d, %d rank(s)%s, BLAS threads %d per rank, %d timed steps")
  :format(B, T, V, world, world > 1 and (" (" .. strategy .. ")") or "", core.get_threads(), steps))
say(("%-8s %9s %9s %10s %10s %12s %7s%s"):format("model", "params", "step s", "tokens/s",
  "GFLOP/s", "sgemm GF/s", "ratio", world > 1 and "  comm hidden" or ""))
math.randomseed(1)
for _, c in ipairs(configs) do
  if not args.only or c.name:find(args.only, 1, true) then
    fsdp.manual_seed(0)
    local model = nn.GPT { vocab = V, ctx = T, d = c.d, layers = c.layers, heads = c.heads, tie = true }
    local params = 0 -- counted before wrapping (the whole model, not this rank's shards)
    for _, p in ipairs(model:parameters()) do params = params + p:numel() end
    if world > 1 then
      fsdp.wrap(model, { policy = fsdp.policy.modules { nn.Block }, strategy = strategy })
    end
    local opt = fsdp.optim.AdamW(model, { lr = 3e-4 })
    local ids = fsdp.tensor(random_ids(B * (T + 1))):view { B, T + 1 }
    local Bl = B / world -- this rank's rows of the global batch
    local mine = ids:narrow(1, rank * Bl + 1, Bl)
    local x = mine:narrow(2, 1, T):contiguous()
    local y = mine:narrow(2, 2, T):contiguous()
    local times = {}
    local stats0
    for s = 1, steps + 1 do
      if s == 2 and world > 1 then stats0 = fsdp.comm_stats() end
      fsdp.barrier()
      local t0 = core.clock()
      local loss = nn.F.cross_entropy(model(x), y)
      opt:zero_grad()
      loss:backward()
      opt:step()
      local dt = fsdp.all_reduce(core.clock() - t0, "max") -- the slowest rank sets the pace
      if s > 1 then times[#times + 1] = dt end -- step 1 warms up allocations and BLAS
    end
    local dt = median(times)
    local hidden = ""
    if world > 1 then
      -- busy: time collectives ran (on the communicator's worker); wait: time compute sat
      -- blocked on them. What ran but was not waited for overlapped with compute.
      local st = fsdp.comm_stats()
      local busy, wait = st.busy_s - stats0.busy_s, st.wait_s - stats0.wait_s
      hidden = ("  %.0f%% of %.0f ms"):format(busy > 0 and 100 * math.max(0, 1 - wait / busy) or 0,
        1000 * busy / steps)
    end
    local tokens = B * T
    local flops = 6 * params * tokens + 12 * c.layers * c.d * T * tokens
    local gflops = flops / dt / 1e9
    local sgemm = core.sgemm_gflops(B * T, 4 * c.d, c.d, 1.0)
    say(("%-8s %8.2fM %9.3f %10.0f %10.1f %12.1f %7.2f%s"):format(c.name, params / 1e6, dt,
      tokens / dt, gflops, sgemm * world, gflops / (sgemm * world), hidden))
  end
end
