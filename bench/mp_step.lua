-- Mixed-precision GPT train step against f32, measured in one run (not a test).
--   fsdprun bench/mp_step.lua [--steps=5] [--rounds=3] [--only=L4] [--mp=bf16]
--   fsdprun -n 2 bench/mp_step.lua
--   fsdprun bench/mp_step.lua --only=L4 --mp_only   # the mixed-precision model alone (profiling)
-- Both models are wrapped (one unit per Block) and trained on the same batch; rounds alternate
-- f32 and mp steps (A, B, A, B) so that machine load hits both alike. Per configuration it
-- prints the median step time of each, their ratio, the all-gather bytes per step of each
-- (fsdp.comm_stats) and the peak activation bytes of each (fsdp.memory's accounting: every
-- saved activation, gradient of an activation and conversion scratch buffer counts).
local fsdp = require "fsdp"
local nn = fsdp.nn
local core = fsdp.core

local args = fsdp.args {
  description = "Mixed-precision GPT train step against f32 (not a test).",
  { "steps", 5, "integer", "steps per round and model", min = 1 },
  { "rounds", 3, "integer", "rounds (f32 and mp alternate)", min = 1 },
  { "mp", "bf16", "string", "the mixed precision", choices = { "bf16", "f16", "f32" } },
  { "mp_only", false, "boolean", "the mixed-precision model alone (profiling)" },
  { "only", nil, "string", "run the models whose name contains this (L4-d256, L6-d384)" },
  { "batch", 8, "integer", "sequences per step (global)", min = 1 },
  { "ctx", 256, "integer", "tokens per sequence", min = 1 },
}
local steps, rounds = args.steps, args.rounds
local mp = args.mp
local B, T, V = args.batch, args.ctx, 256
local configs = {
  { name = "L4-d256", layers = 4, d = 256, heads = 4 },
  { name = "L6-d384", layers = 6, d = 384, heads = 6 },
}

local function median(xs)
  table.sort(xs)
  local n = #xs
  return n % 2 == 1 and xs[(n + 1) / 2] or 0.5 * (xs[n / 2] + xs[n / 2 + 1])
end

local world, rank = fsdp.world_size(), fsdp.rank()
local function say(...) if rank == 0 then print(...) end end
say(("GPT train step, f32 against mp = %s, batch %d x ctx %d, %d rank(s), %d rounds of %d steps")
  :format(mp, B, T, world, rounds, steps))
say(("%-8s %10s %10s %6s %12s %12s %6s %12s %12s %6s"):format("model", "f32 s", mp .. " s",
  "ratio", "f32 gather", mp .. " gather", "ratio", "f32 act", mp .. " act", "ratio"))
math.randomseed(1)
for _, c in ipairs(configs) do
  if not args.only or c.name:find(args.only, 1, true) then
    local runs = {}
    for i, prec in ipairs(args.mp_only and { mp } or { "f32", mp }) do
      fsdp.manual_seed(0)
      local model = nn.GPT { vocab = V, ctx = T, d = c.d, layers = c.layers, heads = c.heads, tie = true }
      fsdp.wrap(model, { policy = fsdp.policy.modules { nn.Block }, mp = prec ~= "f32" and prec or nil })
      runs[i] = { model = model, opt = fsdp.optim.AdamW(model, { lr = 3e-4 }), times = {} }
    end
    local ids = {}
    for i = 1, B * (T + 1) do ids[i] = math.random(0, V - 1) end
    local all = fsdp.tensor(ids, { dtype = "i64" }):view { B, T + 1 }
    local Bl = B / world
    local mine = all:narrow(1, rank * Bl + 1, Bl)
    local x, y = mine:narrow(2, 1, T):contiguous(), mine:narrow(2, 2, T):contiguous()
    local function step(r)
      local loss = nn.F.cross_entropy(r.model(x), y)
      r.opt:zero_grad()
      loss:backward()
      r.opt:step()
    end
    for _, r in ipairs(runs) do step(r) end -- warm-up: allocations, BLAS
    for _ = 1, rounds do
      for _, r in ipairs(runs) do
        for _ = 1, steps do
          fsdp.barrier()
          fsdp.reset_comm_stats()
          core.reset_peak()
          local t0 = core.clock()
          step(r)
          r.times[#r.times + 1] = fsdp.all_reduce(core.clock() - t0, "max")
          r.gather = core.comm_stats().all_gather_bytes
          r.act = core.memory().cpu.peak_activations
        end
      end
    end
    local a, b = runs[1], runs[2] or runs[1]
    local ta, tb = median(a.times), median(b.times)
    local mib = function(x) return ("%.1f MiB"):format(x / 1048576) end
    say(("%-8s %10.3f %10.3f %6.2f %12s %12s %6.2f %12s %12s %6.2f"):format(c.name, ta, tb, tb / ta,
      mib(a.gather), mib(b.gather), b.gather / a.gather, mib(a.act), mib(b.act), b.act / a.act))
  end
end
