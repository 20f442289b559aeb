-- Checks the output of bench/gpt_step.lua (tests/recipes/bench_gpt_step.sh): exactly one JSON
-- line for the one tiny model it ran, with every key of the shape docs/PERFORMANCE.md gives and
-- the values that follow from the model and the arguments; timings only for being positive and
-- consistent, never for their size.
--   fsdprun tests/dist/bench_json.lua --file=OUT --ranks=N --precision=f32|bf16
--           --layers=L --d=D --heads=H --batch=B --ctx=T --steps=K [--checkpoint]
local fsdp = require "fsdp"
local core = fsdp.core
local a = fsdp.args

local f = assert(io.open(a.file), "no output file " .. tostring(a.file))
local text = f:read("*a")
f:close()
local lines = {}
for line in text:gmatch("[^\n]+") do
  if line:sub(1, 1) == "{" then lines[#lines + 1] = line end
end
if #lines ~= 1 then
  error(("expected 1 JSON line (one model, rank 0 only), got %d in:\n%s"):format(#lines, text), 0)
end
local r = core.json_decode(lines[1], "gpt_step's JSON line")

local failures = 0
local function fail(msg, ...)
  failures = failures + 1
  print("FAIL: " .. msg:format(...))
end
local function eq(key, want)
  if r[key] ~= want then fail("%s = %s, expected %s", key, tostring(r[key]), tostring(want)) end
end
local function positive(key)
  if type(r[key]) ~= "number" or not (r[key] > 0) or r[key] == math.huge then
    fail("%s = %s, expected a positive finite number", key, tostring(r[key]))
  end
end
local function near(key, want)
  if type(r[key]) ~= "number" or math.abs(r[key] - want) > 1e-9 * math.abs(want) then
    fail("%s = %s, expected %.17g", key, tostring(r[key]), want)
  end
end

local L, d, H, B, T, V, N = a.layers, a.d, a.heads, a.batch, a.ctx, 256, a.ranks
-- the GPT's parameters, counted by hand: wte, wpe, per block two LayerNorms, qkv, proj, fc,
-- proj (weights and biases), ln_f; the tied head none of its own
local params = V * d + T * d + L * (2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d)
  + (4 * d * d + 4 * d) + (4 * d * d + d)) + 2 * d
local nonemb = params - V * d - T * d
local tokens = B * T

eq("bench", "gpt_step")
eq("impl", "fsdprun")
eq("version", core.version)
eq("model", ("L%d-d%d"):format(L, d))
eq("layers", L) eq("d", d) eq("heads", H) eq("vocab", V) eq("ctx", T) eq("batch", B)
eq("tied", true)
eq("ranks", N)
eq("precision", a.precision)
eq("mode", (N > 1 or a.precision ~= "f32") and "fsdp full" or "plain")
eq("checkpoint", a.checkpoint == true)
positive("peak_live_bytes")
positive("peak_activations_bytes")
eq("params", params)
eq("params_nonemb", nonemb)
eq("tokens", tokens)
eq("steps", a.steps)
eq("warmup", 1)
eq("flops_convention", "6 x non-embedding params (all but wte, wpe) x tokens"
  .. " + 6 x L x T x d per token (causal attention)")
eq("flops_per_step", (6 * nonemb + 6 * L * T * d) * tokens)
-- the library GEMMs of a step, counted by hand: per token and block qkv, proj, fc and proj
-- (12 d^2 multiply-adds), the tied head V d; each once forward and twice backward (the input's and
-- the weight's gradients), and a checkpointed block's forward once more
local gemm_flops = 2 * tokens * (3 * (12 * d * d * L + V * d)
  + (a.checkpoint and 12 * d * d * L or 0))
eq("gemm_flops_per_step", gemm_flops)
for _, k in ipairs{"step_s", "step_min_s", "step_max_s", "tokens_per_s", "gflops",
                   "sgemm_gflops", "ratio", "threads", "loss_first", "loss_last", "cpu_busy",
                   "gemm_s", "gemm_gflops", "gemm_ratio", "gemm_share"} do
  positive(k)
end
if failures == 0 then
  if not (r.step_min_s <= r.step_s and r.step_s <= r.step_max_s) then
    fail("step_s %g outside [step_min_s %g, step_max_s %g]", r.step_s, r.step_min_s, r.step_max_s)
  end
  near("tokens_per_s", tokens / r.step_s)
  near("gflops", r.flops_per_step / r.step_s / 1e9)
  near("ratio", r.gflops / r.sgemm_gflops)
  near("gemm_ratio", r.gemm_gflops / r.sgemm_gflops)
  -- the products run inside the ranks' steps
  if r.gemm_share > 1 then fail("gemm_share = %g, more than the whole step", r.gemm_share) end
  -- random tokens over 256 values: the first loss is near ln 256 = 5.545
  if math.abs(r.loss_first - math.log(V)) > 0.5 then fail("loss_first = %g", r.loss_first) end
end
local shape = r.sgemm_shape
if type(shape) ~= "table" or shape[1] ~= B / N * T or shape[2] ~= d or shape[3] ~= 4 * d then
  fail("sgemm_shape is not {%d, %d, %d}", B / N * T, d, 4 * d)
end
if type(r.info) ~= "table" or r.info.version ~= core.version then
  fail("info does not carry fsdp.info() (its version)")
end
if type(r.loadavg) ~= "table" or #r.loadavg ~= 3 then fail("loadavg is not 3 numbers") end
if N > 1 then
  positive("comm_busy_s")
  -- not bounded by busy: a wait also covers a collective's time in the worker's queue
  if type(r.comm_wait_s) ~= "number" or r.comm_wait_s < 0 then
    fail("comm_wait_s = %s, expected seconds", tostring(r.comm_wait_s))
  end
  if type(r.comm_hidden) ~= "number" or r.comm_hidden < 0 or r.comm_hidden > 1 then
    fail("comm_hidden = %s, expected a fraction", tostring(r.comm_hidden))
  end
elseif r.comm_busy_s ~= nil or r.comm_hidden ~= nil or r.comm_wait_s ~= nil then
  fail("comm_busy_s / comm_wait_s / comm_hidden at 1 rank")
end
if failures > 0 then error(("%d checks of gpt_step's JSON line failed"):format(failures), 0) end
print(("ok: %s, %d rank(s), %s: %d keys"):format(r.model, N, r.precision,
  (function() local n = 0 for _ in pairs(r) do n = n + 1 end return n end)()))
