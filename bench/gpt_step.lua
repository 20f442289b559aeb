-- GPT train-step benchmark (forward + backward + AdamW), not a test.
--   fsdprun bench/gpt_step.lua [--steps=5] [--warmup=1] [--only=L4] [--mp=bf16] [--threads=N]
--           [--strategy=full] [--sgemm_s=1] [--layers=L --d=D --heads=H] [--batch=8] [--ctx=256]
--           [--checkpoint]
--   fsdprun -n 2 bench/gpt_step.lua      # the same global batch on 2 ranks, sharded
-- Models: L=4 d=256, L=6 d=384, L=12 d=768 (heads d/64), vocab 256, ctx 256, batch 8, tied
-- head; --only= picks those whose name ("L4-d256", ...) contains it; --layers/--d/--heads run
-- that one model instead. At 1 rank the model is plain (not wrapped) unless --mp= asks for mixed
-- precision; at N ranks, and with --mp, it is wrapped (one unit per Block, strategy "full" unless
-- --strategy=) and each rank runs its B/N rows of the same global batch. The step time is the
-- slowest rank's, the median of --steps steps after --warmup untimed ones. --checkpoint
-- checkpoints every Block (nn.checkpoint plain, fsdp.wrap{checkpoint = true} wrapped): its
-- activations are recomputed in backward.
--
-- Memory: the peak live bytes and the peak activation bytes (fsdp.memory()'s counters, the
-- largest rank's) over the timed steps, from a collected heap; the JSON line has them as
-- peak_live_bytes and peak_activations_bytes.
--
-- FLOPs (docs/PERFORMANCE.md): per token 6 x the non-embedding parameters (every parameter but
-- wte and wpe; the tied head's GEMM is not counted) + 6 x L x T x d for causal attention (QK^T
-- and AV over the unmasked half, forward and backward). The same-run sgemm rate is the cpu GEMM
-- at the MLP's shape on each rank, (B/N x T, d) @ (d, 4d), with the rank's threads, all ranks at
-- once, summed; "ratio" is the step's achieved GFLOP/s over it.
--
-- GEMMs ("GEMM:sg", "GEMM %"; JSON gemm_*): the library products of the timed steps (linears
-- and batched matmuls through the cpu kernel table, fsdp.core.cpu_gemm_stats; attention's own
-- products are not among them), timed from call to return on each rank's thread. gemm_gflops is
-- their rate summed over the ranks (as the sgemm's), gemm_ratio that over the same-run sgemm,
-- gemm_share their part of the ranks' step time, gemm_s their seconds a step (mean over ranks),
-- gemm_flops_per_step their FLOPs (2 M N K a product, every rank). ratio is at most about
-- gemm_ratio x gemm_share x (counted FLOPs / GEMM FLOPs): with nothing else in the step, the
-- step would reach what the GEMMs reach inside it.
--
-- cpu_busy: the process's CPU seconds per wall second over a timed step (os.clock: every thread
-- of the process, all ranks at -n N), the median; the cores' share left idle is what waiting
-- (on collectives, on the pool's chunks) costs.
--
-- Output: a table for people, and per model one JSON line (it starts with "{"; the same keys as
-- bench/anchors/torch_cpu_gpt.py) carrying fsdp.info(), whatever fields it has.
local fsdp = require "fsdp"
local nn = fsdp.nn
local core = fsdp.core
local lib = dofile((arg[0]:match("^(.*[/\\])") or "") .. "lib.lua")

local args = fsdp.args {
  description = "GPT train-step benchmark: forward + backward + AdamW (not a test).",
  { "steps", 5, "integer", "timed steps (the median is reported)", min = 1 },
  { "warmup", 1, "integer", "untimed steps first", min = 0 },
  { "batch", 8, "integer", "sequences per step (global)", min = 1 },
  { "ctx", 256, "integer", "tokens per sequence", min = 1 },
  { "vocab", 256, "integer", "vocabulary", min = 2 },
  { "sgemm_s", 1.0, "number", "seconds spent measuring the same-run sgemm rate", min = 0 },
  { "mp", nil, "string", "mixed precision (the model is wrapped)", choices = { "bf16", "f16" } },
  { "threads", nil, "integer", "cpu threads per rank (default: the thread rule)", min = 1 },
  { "checkpoint", false, "boolean", "checkpoint every Block's activations" },
  { "only", nil, "string", "run the models whose name contains this (L4-d256, L6-d384, L12-d768)" },
  { "strategy", "full", "string", "sharding strategy when wrapped",
    choices = { "full", "grad_op", "none", "replicate" } },
  { "layers", nil, "integer", "run this one model instead: blocks", min = 0 },
  { "d", nil, "integer", "... its width", min = 1 },
  { "heads", nil, "integer", "... its attention heads", min = 1 },
}
local steps, warmup = args.steps, args.warmup
local B, T, V = args.batch, args.ctx, args.vocab
local sgemm_s = args.sgemm_s
if not (sgemm_s > 0) then error("--sgemm_s must be a positive number of seconds", 0) end
local mp = args.mp
if args.threads then core.set_threads(args.threads) end
local checkpoint = args.checkpoint

local configs = {
  { name = "L4-d256", layers = 4, d = 256, heads = 4 },
  { name = "L6-d384", layers = 6, d = 384, heads = 6 },
  { name = "L12-d768", layers = 12, d = 768, heads = 12 },
}
if args.layers or args.d or args.heads then
  local c = { layers = args.layers or 4, d = args.d or 256, heads = args.heads or 4 }
  c.name = ("L%d-d%d"):format(c.layers, c.d)
  configs = { c }
end

local median = lib.median

-- A copy of v that json_encode takes: functions, userdata and non-finite numbers dropped, a
-- table with both array and other keys kept by its string keys.
local function plain(v, depth)
  local t = type(v)
  if t == "number" then return (v == v and v ~= math.huge and v ~= -math.huge) and v or nil end
  if t == "string" or t == "boolean" then return v end
  if t ~= "table" or depth > 6 then return nil end
  local n, keys = #v, 0
  for _ in pairs(v) do keys = keys + 1 end
  local out = {}
  if n > 0 and keys == n then
    for i = 1, n do out[#out + 1] = plain(v[i], depth + 1) end
  else
    for k, x in pairs(v) do
      if type(k) == "string" then out[k] = plain(x, depth + 1) end
    end
  end
  return out
end

local function loadavg()
  local f = io.open("/proc/loadavg")
  if not f then return nil end
  local a, b, c = f:read("*l"):match("^(%S+) (%S+) (%S+)")
  f:close()
  return { tonumber(a), tonumber(b), tonumber(c) }
end

local world, rank = fsdp.world_size(), fsdp.rank()
local function say(...) if rank == 0 then print(...) end end
if B % world ~= 0 then error(("batch %d does not split over %d ranks"):format(B, world), 0) end
local strategy = args.strategy
local info = fsdp.info()
local precision = mp or "f32"
local FLOPS_CONVENTION = "6 x non-embedding params (all but wte, wpe) x tokens"
  .. " + 6 x L x T x d per token (causal attention)"
say(tostring(info))
-- every scalar field of fsdp.info() (nested tables one level down, dotted), whatever this build
-- has: GEMM library, ISA and thread fields appear here without this script knowing their names
do
  local fields = {}
  for k, v in pairs(info) do
    if type(k) == "string" and type(v) ~= "table" and type(v) ~= "function" then
      fields[#fields + 1] = ("%s=%s"):format(k, tostring(v))
    elseif type(k) == "string" and type(v) == "table" and #v == 0 then
      for k2, v2 in pairs(v) do
        -- (the cpu's feature flags are booleans, printed above)
        if type(k2) == "string" and type(v2) ~= "table" and type(v2) ~= "function"
            and not (k == "cpu" and type(v2) == "boolean") then
          fields[#fields + 1] = ("%s.%s=%s"):format(k, k2, tostring(v2))
        end
      end
    end
  end
  table.sort(fields)
  say("info: " .. table.concat(fields, " "))
end
say(("GPT train step, batch %d x ctx %d, vocab %d, tied head, %s, %d rank(s)%s, %d threads per "
  .. "rank, median of %d steps after %d warm-up%s"):format(B, T, V, precision, world,
  world > 1 and (" (" .. strategy .. ")") or "", core.get_threads(), steps, warmup,
  checkpoint and ", every Block checkpointed" or ""))
say("FLOPs: " .. FLOPS_CONVENTION)
say(("%-9s %8s %9s %9s %9s %10s %7s %8s %7s %9s%s"):format("model", "params", "step s",
  "tokens/s", "GFLOP/s", "sgemm GF/s", "ratio", "GEMM:sg", "GEMM %", "act. MiB",
  world > 1 and "  comm hidden" or ""))
math.randomseed(1)
for _, c in ipairs(configs) do
  if not args.only or c.name:find(args.only, 1, true) then
    fsdp.manual_seed(0)
    local model = nn.GPT { vocab = V, ctx = T, d = c.d, layers = c.layers, heads = c.heads,
                           tie = true }
    local params = model:num_parameters() -- before wrapping: the whole model, the tie once
    local nonemb = params - V * c.d - T * c.d
    local wrapped = world > 1 or mp ~= nil
    if wrapped then
      fsdp.wrap(model, { policy = fsdp.policy.modules { nn.Block }, strategy = strategy, mp = mp,
                         checkpoint = checkpoint or nil })
    elseif checkpoint then
      for i = 1, #model.blocks do nn.checkpoint(model.blocks[i]) end
    end
    local opt = fsdp.optim.AdamW(model, { lr = 3e-4 })
    local all = lib.random_tokens(B, T, V)
    local Bl = B / world -- this rank's rows of the global batch
    local mine = all:narrow(1, rank * Bl + 1, Bl)
    local x, y = lib.next_token(mine, T)
    local times, losses, cpus = {}, {}, {}
    local gemm0
    local own_s = 0 -- this rank's own time in the timed steps (times holds the slowest rank's)
    local comm_busy, comm_wait = 0, 0 -- collectives inside the timed steps' bodies
    for s = 1, warmup + steps do
      if s == warmup + 1 then
        collectgarbage()
        collectgarbage()
        core.reset_peak()
        gemm0 = core.cpu_gemm_stats()
      end
      fsdp.barrier()
      local cs0 = world > 1 and fsdp.comm_stats()
      local t0, c0 = core.clock(), os.clock()
      local loss = nn.F.cross_entropy(model(x), y)
      opt:zero_grad()
      loss:backward()
      opt:step()
      local t1, c1 = core.clock(), os.clock()
      if cs0 and s > warmup then
        -- the step's own collectives only: not this loop's barrier and all-reduces around it
        local cs1 = fsdp.comm_stats()
        comm_busy = comm_busy + (cs1.busy_s - cs0.busy_s)
        comm_wait = comm_wait + (cs1.wait_s - cs0.wait_s)
      end
      local dt = fsdp.all_reduce(t1 - t0, "max") -- the slowest rank sets the pace
      losses[#losses + 1] = fsdp.all_reduce(loss:item(), "sum") / world
      if s > warmup then
        cpus[#cpus + 1] = (c1 - c0) / (t1 - t0)
        times[#times + 1] = dt
        own_s = own_s + (t1 - t0)
      end
    end
    local gemm1 = core.cpu_gemm_stats()
    local gemm_flops, gemm_s = gemm1.flops - gemm0.flops, gemm1.seconds - gemm0.seconds
    local dt = median(times)
    local mem = core.memory().cpu
    local r = {
      bench = "gpt_step", impl = "fsdprun", version = info.version, model = c.name,
      layers = c.layers, d = c.d, heads = c.heads, vocab = V, ctx = T, batch = B, tied = true,
      ranks = world, mode = wrapped and ("fsdp " .. strategy) or "plain", precision = precision,
      threads = core.get_threads(), params = params, params_nonemb = nonemb, tokens = B * T,
      steps = steps, warmup = warmup, step_s = dt, step_min_s = math.min(unpack(times)),
      step_max_s = math.max(unpack(times)), cpu_busy = median(cpus), loss_first = losses[1], loss_last = losses[#losses],
      flops_convention = FLOPS_CONVENTION, info = plain(info, 0), loadavg = loadavg(),
      checkpoint = checkpoint,
      peak_live_bytes = fsdp.all_reduce(mem.peak or 0, "max"),
      peak_activations_bytes = fsdp.all_reduce(mem.peak_activations or 0, "max"),
    }
    if world > 1 then
      -- busy: time collectives ran (on the communicator's worker, from their start, so a
      -- reduce-scatter left in flight counts while it waits for the peers); wait: time compute
      -- sat blocked on them (queued ones included), what the step pays. What ran but was not
      -- waited for overlapped with compute. Both over the steps' bodies alone (the loop's
      -- barrier and the all-reduces of its timings and losses are not the step's).
      r.comm_busy_s = comm_busy / steps
      r.comm_wait_s = comm_wait / steps
      r.comm_hidden = comm_busy > 0 and math.max(0, 1 - comm_wait / comm_busy) or 0
    end
    -- the library GEMMs inside the timed steps (fsdp.core.cpu_gemm_stats: linears and batched
    -- matmuls, wall time from call to return on the rank's thread; attention's own products are
    -- not among them): FLOPs of the whole step (every rank), seconds per step (mean over the
    -- ranks), their share of the ranks' step time, and their rate summed over the ranks as the
    -- sgemm's is
    local gemm_s_all = fsdp.all_reduce(gemm_s, "sum")
    r.gemm_flops_per_step = fsdp.all_reduce(gemm_flops, "sum") / steps
    r.gemm_s = gemm_s_all / world / steps
    r.gemm_share = gemm_s_all / fsdp.all_reduce(own_s, "sum")
    r.gemm_gflops = fsdp.all_reduce(gemm_s > 0 and gemm_flops / gemm_s / 1e9 or 0, "sum")
    r.tokens_per_s = r.tokens / dt
    r.flops_per_step = (6 * nonemb + 6 * c.layers * T * c.d) * r.tokens
    r.gflops = r.flops_per_step / dt / 1e9
    -- the same-run ceiling: every rank at once on its own share, as in the step
    fsdp.barrier()
    r.sgemm_shape = { Bl * T, c.d, 4 * c.d } -- M, K, N: (M, K) @ (K, N)
    r.sgemm_gflops = fsdp.all_reduce(core.sgemm_gflops(Bl * T, 4 * c.d, c.d, sgemm_s), "sum")
    r.ratio = r.gflops / r.sgemm_gflops
    r.gemm_ratio = r.gemm_gflops / r.sgemm_gflops
    say(("%-9s %7.2fM %9.3f %9.0f %9.1f %10.1f %7.2f %8.2f %6.0f%% %9.1f%s"):format(c.name,
      params / 1e6, dt, r.tokens_per_s, r.gflops, r.sgemm_gflops, r.ratio, r.gemm_ratio,
      100 * r.gemm_share, r.peak_activations_bytes / 2 ^ 20,
      world > 1 and
      ("  %.0f%% of %.0f ms, %.1f ms waited"):format(100 * r.comm_hidden, 1000 * r.comm_busy_s,
        1000 * r.comm_wait_s) or ""))
    say(core.json_encode(plain(r, 0)))
    model, opt, x, y, mine, all = nil, nil, nil, nil, nil, nil
    collectgarbage()
    collectgarbage()
  end
end
