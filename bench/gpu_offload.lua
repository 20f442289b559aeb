-- The largest GPT that trains on one GPU, with and without CPU offload (not a test; figures in
-- docs/nccl.md "CPU offload"). One configuration per process, so an out-of-memory leaves nothing
-- behind for the next; bench/gpu_offload.sh walks the sizes.
--   fsdprun bench/gpu_offload.lua --layers=L --d=D [--heads=H] [--offload=cpu] [--batch=1]
--                                 [--ctx=1024] [--device=cuda]
-- The model: nn.GPT{vocab = 50304, ctx, d, layers, heads} built on the meta device, wrapped
-- with one unit per Block, bf16 mixed precision, on the device (and offload = "cpu" when asked),
-- materialized, then two AdamW steps on random tokens. Prints one JSON line: the parameters,
-- whether it trained ("ok") or the first line of the error ("oom: ..."), the step time and the
-- peak device memory of the engine's accounting. Exits 0 either way (77 without the device).
local fsdp = require "fsdp"
local nn = fsdp.nn
local core = fsdp.core
local lib = dofile((arg[0]:match("^(.*[/\\])") or "") .. "lib.lua")
local args = fsdp.args {
  description = "The largest GPT that trains on one GPU, with and without CPU offload (not a test).",
  { "device", "cuda", "string", "the device" },
  { "d", 768, "integer", "width", min = 1 },
  { "layers", 12, "integer", "blocks", min = 1 },
  { "heads", nil, "integer", "attention heads (default d / 64)", min = 1 },
  { "vocab", 50304, "integer", "vocabulary", min = 2 },
  { "ctx", 1024, "integer", "tokens per sequence", min = 1 },
  { "batch", 1, "integer", "sequences per step", min = 1 },
  { "offload", nil, "string", "offload the shards to this device's host memory", choices = { "cpu" } },
}
local dev = args.device
if dev ~= "cpu" and fsdp.device_count(dev) == 0 then
  print(("gpu_offload: no %s device here"):format(dev))
  os.exit(77)
end
local d, L = args.d, args.layers
local cfg = {vocab = args.vocab, ctx = args.ctx, d = d, layers = L,
             heads = args.heads or math.max(1, math.floor(d / 64)), tie = true}
local B, T = args.batch, cfg.ctx
local r = {what = "gpu_offload", layers = L, d = d, offload = args.offload or false, batch = B,
           ctx = T}
local ok, err = pcall(function()
  fsdp.manual_seed(0)
  local model = fsdp.meta(function() return nn.GPT(cfg) end)
  local n = 0
  for _, p in ipairs(model:parameters()) do n = n + p:numel() end
  r.params = n
  fsdp.wrap(model, {policy = fsdp.policy.modules{nn.Block}, device = dev, mp = "bf16",
                    offload = args.offload})
  fsdp.materialize(model)
  local opt = fsdp.optim.AdamW(model, {lr = 1e-4, weight_decay = 0.1})
  math.randomseed(1)
  local x, y = lib.next_token(lib.random_tokens(B, T, cfg.vocab), T)
  x, y = x:to(dev), y:to(dev)
  core.reset_peak()
  local t
  for _ = 1, 2 do
    local t0 = core.clock()
    local loss = nn.F.cross_entropy(model(x), y)
    opt:zero_grad()
    loss:backward()
    opt:step()
    r.loss = loss:item()
    t = core.clock() - t0
  end
  r.step_s = t
  local mem = core.memory()[dev] or {}
  r.peak_device_gib = (mem.peak or 0) / 2 ^ 30
end)
r.result = ok and "ok" or ("error: " .. tostring(err):match("[^\n]*"))
print(core.json_encode(r))
