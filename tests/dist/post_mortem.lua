-- post_mortem.lua — run by tests/recipes/post_mortem*.sh under fsdprun --debug-on-error: a
-- wrapped model trains; at step 2, rank `--bad` (default 1) fails in `step` (--how=lua: error(),
-- --how=c: an engine error from a tensor op) while the others wait in the barrier after the
-- step, or (--peer=spin) run an interpreted loop, or (--peer=compiled) a compiled one, or
-- (--peer=ccall) a long C call, or (--peer=done) have finished. `secret` is a local of the failing frame only; `model` and
-- `loss` are visible on every rank. --enable: fsdp.debug_on_error(true) instead of the flag.
local fsdp = require "fsdp"
local nn = fsdp.nn
local bad = tonumber(fsdp.args.bad) or 1
local how = fsdp.args.how or "lua"
local peer = fsdp.args.peer or "barrier"
if fsdp.args.enable then fsdp.debug_on_error(true) end
fsdp.manual_seed(0)
local model = nn.Linear(4, 2)
fsdp.wrap(model)
local loss

local function step(k)
  loss = model(fsdp.ones{3, 4}):sum()
  if k == 2 and fsdp.rank() == bad then
    local secret = 40 + k
    -- by then the others wait in the barrier or run their loop (compiled: as a trace); after
    -- --peer=done this barrier fails once rank 0 has left, and that error is the failure
    if peer == "done" then fsdp.barrier("after step " .. k) else os.execute("sleep 1") end
    if how == "c" then return fsdp.ones{2} + fsdp.ones{secret} end
    error("boom at step " .. k)
  end
  if k == 2 and peer == "spin" then
    jit.off()
    local spins = 0
    while true do spins = spins + 1 end
  end
  if k == 2 and peer == "ccall" then
    local slow = true -- (stopped at the statement after the call, where `slow` is in scope)
    os.execute("sleep 4"); fsdp.barrier("slow") -- a C call, returning 3 s after the failure
  end
  if k == 2 and peer == "compiled" then
    local s = 0
    for i = 1, math.huge do s = s + i % 7 end
  end
  fsdp.barrier("after step " .. k)
end

for k = 1, 3 do
  if k == 2 and peer == "done" and fsdp.rank() ~= bad then break end
  step(k)
end
print("finished", fsdp.rank())
