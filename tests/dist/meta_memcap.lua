-- The memory proof of deferred initialisation (tests/recipes/dist_meta_memcap.sh): under an
-- allocator cap (FSDP_MEM_LIMIT, per rank) below the size of the model's f32 parameters,
--   * building the model eagerly fails (the cap is real and the model does not fit),
--   * building it on meta, wrapping and materializing it at 4 ranks works — from the init
--     records (each rank generates its shard slices: nothing gathered) and with a user init_fn
--     (one unit gathered at a time) — and it trains a step; rank 0 prints every rank's peaks.
--   FSDP_MEM_LIMIT=<cap> fsdprun -n 4 tests/dist/meta_memcap.lua --cap=<cap bytes>
local fsdp = require "fsdp"
require "fsdp.meta"
local meta = require "fsdp.meta"
local nn = fsdp.nn
local core = fsdp.core
local W, rank = fsdp.world_size(), fsdp.rank()
local cap = assert(tonumber(fsdp.args.cap), "--cap=<bytes> (the FSDP_MEM_LIMIT in force)")

local C = dofile("tests/dist/common.lua")
local check = C.check

-- 24 blocks: a unit is 1/24 of the model, so shards + a unit + activations fit where the model
-- does not
local cfg = {vocab = 64, ctx = 8, d = 96, layers = 24, heads = 4}
local function build() return nn.GPT(cfg) end
local policy = function() return fsdp.policy.modules{nn.Block} end

-- Each phase runs in a function of its own, so a dropped model is unreachable from Lua (a
-- main-chunk temporary could keep it alive). LuaJIT's compiled traces hold the tables they
-- were specialised on as constants, which keeps a dropped model alive as long as the trace:
-- jit.flush() drops them; the buffers then go after a few collections (finalizers).
local function collect()
  if jit then jit.flush() end
  for _ = 1, 8 do collectgarbage() end
end

local function model_bytes()
  local probe = fsdp.meta(build) -- shapes only: no storage
  local n = 0
  for _, p in ipairs(probe:parameters()) do n = n + p:numel() * 4 end
  return n
end

local function train_step(model)
  local opt = fsdp.optim.SGD(model, {lr = 0.05})
  local x, y = {}, {}
  for t = 1, cfg.ctx do
    x[t] = (rank * 5 + t * 3) % cfg.vocab
    y[t] = (x[t] + 1) % cfg.vocab
  end
  local loss = nn.F.cross_entropy(model(fsdp.tensor{x}), fsdp.tensor{y})
  loss:backward()
  opt:step()
  return loss:item()
end

local function units_figures(model)
  local largest, shards = 0, 0
  for _, u in ipairs(fsdp.units(model)) do
    largest = math.max(largest, u:padded_numel() * 4)
    shards = shards + u:shard_numel() * 4
  end
  return largest, shards
end

-- 1. eagerly: the model does not fit
local function eager()
  fsdp.manual_seed(3)
  local ok, err = pcall(build)
  check(not ok, "building the model eagerly under the cap fails")
  check(tostring(err):find("FSDP_MEM_LIMIT", 1, true) ~= nil,
    "... with the allocator's message: " .. tostring(err))
end

-- 2. meta + wrap + materialize from the init records, then a training step
local function from_records()
  core.reset_peak()
  fsdp.manual_seed(3)
  local m = fsdp.meta(build)
  fsdp.wrap(m, {policy = policy(), prefetch = false})
  fsdp.reset_comm_stats()
  fsdp.materialize(m)
  local mem = fsdp.memory().devices.cpu
  check((mem.peak_gathered or 0) == 0, "materializing from the records gathers nothing")
  check(fsdp.comm_stats().all_gather_calls == 0, "... and all-gathers nothing")
  local after_init = mem.peak
  local loss = train_step(m)
  check(loss == loss and loss > 0, "the step gives a finite loss: " .. tostring(loss))
  local largest, shards = units_figures(m)
  return after_init, fsdp.memory().devices.cpu.peak, largest, shards
end

-- 3. the same with a user init_fn: each module on its gathered unit, one unit at a time
local function with_init_fn()
  core.reset_peak()
  fsdp.manual_seed(3)
  local m = fsdp.meta(build)
  local calls = 0
  fsdp.wrap(m, {policy = policy(), prefetch = false, init = function(mod, path)
    calls = calls + 1
    for _, e in ipairs(require("fsdp.nn.module").own_entries(mod)) do
      if nn.is_param(e[2]) then core.init_normal(e[2], 5, path .. "." .. tostring(e[1]), 0, 0.02) end
    end
  end})
  local mem = fsdp.memory().devices.cpu
  local largest = units_figures(m)
  check(calls > 0, "init_fn ran")
  check((mem.peak_gathered or 0) > 0 and (mem.peak_gathered or 0) <= largest,
    ("init_fn: gathered peak %d B <= the largest unit %d B"):format(mem.peak_gathered or 0, largest))
  local after_init = mem.peak
  local loss = train_step(m)
  check(loss == loss and loss > 0, "the step gives a finite loss: " .. tostring(loss))
  return after_init, fsdp.memory().devices.cpu.peak
end

local full = model_bytes()
check(cap < full, ("the cap %d B is below the model's f32 parameters, %d B"):format(cap, full))
eager()
collect()
local init1, step1, largest, shards = from_records()
collect()
local init2, step2 = with_init_fn()
check(math.max(init1, step1, init2, step2) <= cap, "every peak is under the cap")

local peaks = fsdp.zeros{4, W}
for i, v in ipairs{init1, step1, init2, step2} do peaks:set(i, rank + 1, v) end
fsdp.all_reduce(peaks, "sum")
if rank == 0 then
  local t = peaks:totable()
  local function row(i)
    local s = {}
    for r = 1, W do s[r] = ("%d"):format(t[i][r]) end
    return table.concat(s, ", ")
  end
  print(("meta_memcap at %d ranks: %d checks failed; cap %d B per rank < model f32 parameters %d B "
    .. "(cap/model %.2f); shards %d B per rank, largest unit %d B; peak live bytes per rank: "
    .. "from records [%s] after materialize, [%s] after a step; with init_fn [%s] after wrap, [%s] "
    .. "after a step"):format(W, C.failures(), cap, full, cap / full, shards, largest, row(1), row(2),
      row(3), row(4)))
end
if C.failures() > 0 then error(("%d meta_memcap checks failed"):format(C.failures())) end
