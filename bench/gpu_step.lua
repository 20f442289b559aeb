-- GPT-2 small train step on one GPU under bf16 mixed precision (not a test). docs/cuda.md,
-- "Benchmark"; scripts/gpu-check runs it beside bench/anchors/torch_gpt2.py.
--   fsdprun bench/gpu_step.lua [--peak_tflops=X] [--steps=10] [--warmup=3] [--batch=8]
--                              [--mp=bf16|f32] [--json=FILE] [--device=cuda] [--time_limit=120]
--   (--layers= --d= --heads= --vocab= --ctx= shrink the model, e.g. for a dry run on the cpu;
--   --peak_n= sizes the fallback matmul)
-- The model: nn.GPT{vocab = 50304, ctx = 1024, d = 768, layers = 12, heads = 12, tie = true}
-- built on the meta device and wrapped at one rank with one unit per Block, {mp = "bf16",
-- device = "cuda"} (FSDP2's policy: f32 master shards, gradients and AdamW state; bf16 gathers
-- and compute; f32 outputs), then materialized there; AdamW (lr 6e-4, weight decay 0.1) on
-- random tokens, batch 8 x 1024.
-- Prints step time (median of the timed steps; each step ends reading the loss, which waits for
-- the device), tokens/s, achieved TFLOP/s and MFU, and the peak of the engine's accounting of
-- device memory during the timed steps. FLOPs per token: 6 N + 12 L d T, N the parameters but
-- the position embedding (nanoGPT's count; the tied head counted once), 12 L d T the attention
-- scores and their use with the full T x T per layer (PaLM's convention, not halved for the
-- causal mask); bench/anchors/torch_gpt2.py counts the same. MFU is over --peak_tflops (what
-- bench/cuda/gemm_peak measured in the same gpu-check run) or, without it, over a bf16
-- 8192^3 matmul through the engine measured here first. --json appends one JSON line.
local fsdp = require "fsdp"
local nn = fsdp.nn
local core = fsdp.core
local lib = dofile((arg[0]:match("^(.*[/\\])") or "") .. "lib.lua")

local args = fsdp.args {
  description = "GPT-2 small train step on one GPU under bf16 mixed precision (not a test).",
  { "device", "cuda", "string", "the device (cpu for a dry run of a shrunk model)" },
  { "steps", 10, "integer", "timed steps", min = 1 },
  { "warmup", 3, "integer", "untimed steps first", min = 0 },
  { "batch", 8, "integer", "sequences per step", min = 1 },
  { "ctx", 1024, "integer", "tokens per sequence", min = 1 },
  { "vocab", 50304, "integer", "vocabulary", min = 2 },
  { "d", 768, "integer", "width", min = 1 },
  { "layers", 12, "integer", "blocks", min = 1 },
  { "heads", 12, "integer", "attention heads", min = 1 },
  { "mp", "bf16", "string", "precision", choices = { "bf16", "f16", "f32" } },
  { "time_limit", 120, "number", "seconds for the timed steps: stop early past it", min = 0 },
  { "peak_tflops", nil, "number", "the MFU denominator (gemm_peak's figure)", min = 0 },
  { "peak_n", 8192, "integer", "size of the fallback matmul that measures the peak", min = 1 },
  { "json", nil, "string", "append one JSON line to this file" },
}
local dev = args.device
local cfg = {vocab = args.vocab, ctx = args.ctx, d = args.d, layers = args.layers,
             heads = args.heads, tie = true}
local B, T = args.batch, args.ctx
local steps, warmup = args.steps, args.warmup
local mp = args.mp
local budget = args.time_limit -- seconds for the timed steps: stop early past it

if dev ~= "cpu" and fsdp.device_count(dev) == 0 then
  print(("gpu_step: no %s device here (fsdp.device_count(%q) is 0)"):format(dev, dev))
  os.exit(77)
end

local median = lib.median

-- the engine's own bf16 matmul rate (the fallback MFU denominator)
local function engine_peak()
  local n = args.peak_n
  fsdp.manual_seed(1)
  local a = fsdp.randn({n, n}, {dtype = "bf16", device = dev})
  local b = fsdp.randn({n, n}, {dtype = "bf16", device = dev})
  local rate
  fsdp.no_grad(function()
    for _ = 1, 3 do a:matmul(b):get(1, 1) end
    local reps = 10
    local t0 = core.clock()
    local c
    for _ = 1, reps do c = a:matmul(b) end
    c:get(1, 1) -- waits for the device
    rate = 2 * n * n * n * reps / (core.clock() - t0) / 1e12
  end)
  return rate
end

local peak, peak_source = args.peak_tflops, "gemm_peak (cuBLASLt)"
if not peak then
  peak, peak_source = engine_peak(), ("the engine's bf16 matmul %d^3"):format(args.peak_n)
end

fsdp.manual_seed(0)
local model = fsdp.meta(function() return nn.GPT(cfg) end)
local params, wpe = 0, cfg.ctx * cfg.d
for _, p in ipairs(model:parameters()) do params = params + p:numel() end
local wrap_opts = {policy = fsdp.policy.modules{nn.Block}, device = dev}
if mp ~= "f32" then wrap_opts.mp = mp end
fsdp.wrap(model, wrap_opts)
fsdp.materialize(model)
local opt = fsdp.optim.AdamW(model, {lr = 6e-4, weight_decay = 0.1})

math.randomseed(1)
local x, y = lib.next_token(lib.random_tokens(B, T, cfg.vocab), T)
x, y = x:to(dev), y:to(dev)

local function step()
  local loss = nn.F.cross_entropy(model(x), y)
  opt:zero_grad()
  loss:backward()
  opt:step()
  return loss:item() -- reads the loss back: waits for every kernel queued before
end

local losses, times = {}, {}
local t_warm = core.clock()
for _ = 1, warmup do losses[#losses + 1] = step() end
t_warm = core.clock() - t_warm
core.reset_peak()
local t_all = core.clock()
for _ = 1, steps do
  local t0 = core.clock()
  losses[#losses + 1] = step()
  times[#times + 1] = core.clock() - t0
  if core.clock() - t_all > budget then break end
end
local mem = core.memory()[dev] or {}
local dt = median(times)
local tokens = B * T
local flops = (6 * (params - wpe) + 12 * cfg.layers * cfg.d * T) * tokens
local tflops = flops / dt / 1e12
local r = {
  what = "gpu_step", impl = "fsdprun", mode = mp ~= "f32" and (mp .. " mixed precision (fsdp.wrap mp)") or "f32",
  device = dev, params = params, batch = B, ctx = T, steps = #times, warmup_s = t_warm,
  step_ms = 1000 * dt, tokens_per_s = tokens / dt, tflops = tflops, peak_tflops = peak,
  peak_source = peak_source, mfu = tflops / peak, peak_mem_gib = (mem.peak or 0) / 2 ^ 30,
  loss_first = losses[1], loss_last = losses[#losses],
}
print(("gpu_step: GPT %dL d%d h%d vocab %d (%.1fM parameters), batch %d x %d, %s, %s"):format(
  cfg.layers, cfg.d, cfg.heads, cfg.vocab, params / 1e6, B, T, r.mode, dev))
print(("  %d warm-up steps in %.1f s; %d timed steps: median %.1f ms, %.0f tokens/s"):format(
  warmup, t_warm, #times, r.step_ms, r.tokens_per_s))
print(("  %.1f TFLOP/s (6N + 12LdT per token), MFU %.1f%% of %.1f TFLOP/s (%s)"):format(
  tflops, 100 * r.mfu, peak, peak_source))
print(("  peak device memory (the engine's accounting) %.2f GiB; loss %.4f -> %.4f"):format(
  r.peak_mem_gib, r.loss_first, r.loss_last))
local line = core.json_encode(r)
print(line)
if args.json then
  local f = assert(io.open(args.json, "a"))
  f:write(line, "\n")
  f:close()
end
