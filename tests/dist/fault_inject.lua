-- fault_inject.lua — run by tests/recipes/dist_faults.sh under fsdprun -n N: one rank (--rank,
-- default 1) fails at one point (--at) while the others go on into collectives; the launcher
-- must end the run within seconds (the abort wakes the peers) with every peer reporting
-- "rank R failed: <message>". Points:
--   before   error before the first collective
--   between  error after three collectives, before the fourth
--   blocked  error while the peers already wait in an all_reduce (0.3 s after they entered)
--   engine   an engine error (matmul shapes) while the peers wait in an all_reduce
--   return   the rank returns early while the peers wait in an all_reduce (it has left)
--   slow     the rank computes for --busy seconds while the peers wait (they time out)
--   all      every rank raises the same error before any collective (reported in full once)
--   spin     SIGINT target: every rank loops in Lua (rank --rank in a compiled loop when
--            --compiled is given), rank 2 waits in a barrier
local fsdp = require "fsdp"
local core = fsdp.core
local rank = fsdp.rank()
local bad = tonumber(fsdp.args.rank) or 1
local at = fsdp.args.at or "before"

local function spin(seconds)
  local t0 = core.clock()
  while core.clock() - t0 < seconds do end
end

local function inject(where)
  error(("injected fault %s on rank %d"):format(where, rank))
end

if at == "all" then error("the same fault on every rank") end
if rank == bad and at == "before" then inject("before the first collective") end

if at == "spin" then
  if rank == 0 then print("spinning") io.stdout:flush() end
  local function tick() return core.clock() end
  if rank == 2 then fsdp.barrier("never complete") end
  if rank == bad and fsdp.args.compiled then while true do end end
  while true do tick() end
end

local x = fsdp.ones{16}
for step = 1, 3 do fsdp.all_reduce(x, "sum", "step." .. step) end
if rank == bad then
  if at == "between" then inject("between collectives") end
  if at == "blocked" then spin(0.3); inject("while peers wait") end
  if at == "engine" then spin(0.3); local _ = fsdp.zeros{2, 3}:matmul(fsdp.zeros{4, 5}) end
  if at == "return" then spin(0.3); return end
  if at == "slow" then spin(tonumber(fsdp.args.busy) or 3) end
end
fsdp.all_reduce(x, "sum", "step.4")
fsdp.barrier("end")
print("finished " .. rank) -- only when nothing was injected
