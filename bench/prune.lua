-- Pruning benchmark (not a test): fsdp.sparsity and prune.magnitude(scope = "global") on the
-- shards versus gathering the full model (fsdp.full_params), the way the SparseML report had to
-- read sparsity (summon_full_params).
--
--   fsdprun -n 2 bench/prune.lua [--d=256] [--layers=6] [--reps=5]
--
-- Prints, per operation, the median wall time over reps, the bytes this rank sent through
-- all_gather / all_reduce, and the most memory it allocated on top of what was live (peak +). "gather + count" is full_params(model, count zeros of every full
-- parameter, writeback = false): the cheapest way to count that gathers. "gather + writeback"
-- is full_params with a no-op fn and writeback: the floor under any pruning done on gathered
-- weights (choosing the mask would come on top).
local fsdp = require "fsdp"
require "fsdp.mask"
local prune = require "fsdp.prune"
local core = fsdp.core
local nn = fsdp.nn
local a = fsdp.args {
  description = "fsdp.sparsity and global magnitude pruning on shards against full_params (not a test).",
  { "reps", 5, "integer", "repetitions (the median is reported)", min = 1 },
  { "d", 256, "integer", "GPT width", min = 4 },
  { "layers", 6, "integer", "GPT blocks", min = 1 },
}
local reps = a.reps

fsdp.manual_seed(0)
local model = nn.GPT{vocab = 256, ctx = 128, d = a.d, layers = a.layers, heads = 4, tie = true}
fsdp.wrap(model, {policy = fsdp.policy.modules{nn.Block}})
local weights = "%.weight$"

local function measure(name, fn)
  local times = {}
  local s0 = fsdp.comm_stats()
  local extra = 0
  for r = 1, reps do
    fsdp.barrier()
    collectgarbage()
    core.reset_peak()
    local live = fsdp.memory().live
    local t0 = core.clock()
    fn(r)
    times[r] = core.clock() - t0
    extra = math.max(extra, fsdp.memory().peak - live)
  end
  local s1 = fsdp.comm_stats()
  table.sort(times)
  local med = times[math.floor((reps + 1) / 2)]
  if fsdp.rank() == 0 then
    print(("%-34s %8.2f ms  all_gather %9.0f B  all_reduce %7.0f B  peak +%9.0f B  (per call, rank 0)")
      :format(name, med * 1e3, (s1.all_gather_bytes - s0.all_gather_bytes) / reps,
        (s1.all_reduce_bytes - s0.all_reduce_bytes) / reps, extra))
  end
  return med
end

if fsdp.rank() == 0 then
  print(("GPT d=%d layers=%d: %.2fM parameters, %d ranks"):format(a.d, a.layers,
    model:num_parameters() / 1e6, fsdp.world_size()))
end
local t1 = measure("fsdp.sparsity (shards)", function() fsdp.sparsity(model) end)
local t2 = measure("gather + count (full_params)", function()
  fsdp.full_params(model, function(m)
    local z = 0
    for _, p in ipairs(m:parameters()) do z = z + core.count_zeros(p:detach():view{p:numel()}) end
    return z
  end, {writeback = false})
end)
local t3 = measure("prune.magnitude global (shards)", function(r)
  prune.magnitude(model, {params = weights, sparsity = 0.1 * r, scope = "global"})
end)
local t4 = measure("gather + writeback (full_params)", function()
  fsdp.full_params(model, function() end)
end)
if fsdp.rank() == 0 then
  print(("sparsity: %.1fx faster than gathering; global magnitude pruning: %.1fx the cost of a bare gather + writeback")
    :format(t2 / t1, t3 / t4))
end
