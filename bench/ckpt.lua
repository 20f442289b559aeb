-- Checkpoint benchmark (not a test): save and load time and peak memory per rank for the L=6
-- GPT (d=384, 6 heads, ctx 256, vocab 256, tied head: 10.8 M parameters), wrapped with one unit
-- per Block, with AdamW state, in both formats.
--   fsdprun -n 2 bench/ckpt.lua [--dir=/tmp/fsdp_bench_ckpt] [--repeat=3] [--layers=6 --d=384]
-- Times are the slowest rank's (all_reduce max), medians of --repeat runs, files written to
-- --dir (use a real disk, not tmpfs, to include fsync). Memory is the rank's accounted tensor
-- memory (fsdp.memory(): every tensor the engine allocates) above what it held before the call:
-- the peak added by the call; the writer's 1 MiB buffer is plain malloc and comes on top.
local fsdp = require "fsdp"
require "fsdp.checkpoint"
local nn = fsdp.nn
local core = fsdp.core

local a = fsdp.args {
  description = "Checkpoint save / load time and peak memory per rank (not a test).",
  { "dir", "/tmp/fsdp_bench_ckpt", "string", "where the checkpoints are written" },
  { "repeat", 3, "integer", "runs per figure (the median is reported)", min = 1 },
  { "layers", 6, "integer", "GPT blocks", min = 1 },
  { "d", 384, "integer", "GPT width", min = 1 },
  { "heads", 6, "integer", "attention heads", min = 1 },
}
local dir = a.dir
local reps = a["repeat"]
local rank, W = fsdp.rank(), fsdp.world_size()
local function say(...) if rank == 0 then print(...) end end
local MB = 1024 * 1024

fsdp.manual_seed(0)
local cfg = {vocab = 256, ctx = 256, d = a.d, layers = a.layers, heads = a.heads, tie = true}
local model = nn.GPT(cfg)
local nparams = model:num_parameters()
fsdp.wrap(model, {policy = fsdp.policy.modules{nn.Block}})
local opt = fsdp.optim.AdamW(model, {lr = 1e-4})
-- one step so that the optimizer has its state (two moments per parameter)
do
  local x = fsdp.zeros{2, 16}
  local loss = nn.F.cross_entropy(model(x), x)
  loss:backward()
  opt:step()
  opt:zero_grad()
end

local largest_unit = 0
for _, u in ipairs(fsdp.units(model)) do
  largest_unit = math.max(largest_unit, u:padded_numel() * 4)
end

local function median(xs)
  table.sort(xs)
  return xs[math.floor((#xs + 1) / 2)]
end

local function measure(label, fn)
  local times, peaks = {}, {}
  for _ = 1, reps do
    collectgarbage()
    collectgarbage()
    fsdp.barrier()
    local live = fsdp.memory().live
    core.reset_peak()
    local t0 = core.clock()
    fn()
    local dt = core.clock() - t0
    local peak = fsdp.memory().peak - live
    times[#times + 1] = fsdp.all_reduce(dt, "max")
    peaks[#peaks + 1] = fsdp.all_reduce(peak, "max")
  end
  return {label = label, time = median(times), peak = median(peaks)}
end

local function du(path)
  local total = 0
  local size = core.io_size(path)
  if size then return size end
  for _, name in ipairs(core.io_listdir(path)) do total = total + (core.io_size(path .. "/" .. name) or 0) end
  return total
end

if rank == 0 then core.io_mkdirs(dir) end
fsdp.barrier()
local st, sh = dir .. "/model.safetensors", dir .. "/sharded"
local results = {
  measure("save safetensors (model)", function() fsdp.save(model, st) end),
  measure("load safetensors (model)", function() fsdp.load(model, st) end),
  measure("save sharded (model + AdamW)", function() fsdp.save(model, sh, {optimizer = opt}) end),
  measure("load sharded (model + AdamW)", function() fsdp.load(model, sh, {optimizer = opt}) end),
  measure("save sharded (model)", function() fsdp.save(model, sh .. "_m") end),
  measure("load sharded (model)", function() fsdp.load(model, sh .. "_m") end),
}
local sizes = {st = du(st), sh = du(sh), shm = du(sh .. "_m")}
say(("checkpoint bench: GPT L=%d d=%d (%.2f M parameters, %.1f MB f32), %d rank(s), largest unit %.2f MB, %d runs each, files in %s")
  :format(cfg.layers, cfg.d, nparams / 1e6, nparams * 4 / MB, W, largest_unit / MB, reps, dir))
say(("files: safetensors %.1f MB; sharded with AdamW %.1f MB; sharded model only %.1f MB")
  :format(sizes.st / MB, sizes.sh / MB, sizes.shm / MB))
say(("%-32s %10s %12s %22s"):format("", "time", "MB/s", "peak added per rank"))
for _, r in ipairs(results) do
  local bytes = r.label:find("safetensors") and sizes.st or (r.label:find("AdamW") and sizes.sh or sizes.shm)
  say(("%-32s %8.3f s %10.0f %17.2f MB"):format(r.label, r.time, bytes / MB / r.time, r.peak / MB))
end
