-- A rank that fails in the middle of sharded training makes every rank fail fast (invariant 3,
-- docs/ARCHITECTURE.md), run by tests/recipes/dist_wrap_faults.sh:
--   fsdprun -n N tests/dist/wrap_faults.lua --at=forward|backward [--rank=1] [--step=3]
-- at=forward: rank R raises inside the forward of the second of three units, after the first
--   unit's all-gather and while the third's prefetch is in flight on the other ranks; its
--   peers block in the next unit's all-gather.
-- at=backward: rank R raises after its forward, just before loss:backward(), while its peers
--   are inside backward (the autograd hooks' all-gathers and reduce-scatters); there is no Lua
--   code inside backward to fail, so this is the failure a peer sees mid-backward.
-- Expected: fsdprun exits 1 within seconds, the peers' errors say "rank R failed: injected".
local fsdp = require "fsdp"
local nn = fsdp.nn
local a = fsdp.args
local bad_rank, bad_step, at = a.rank or 1, a.step or 3, a.at or "forward"
local rank = fsdp.rank()

local Faulty = nn.Module:extend("Faulty")
function Faulty:init(d) self.fc = nn.Linear(d, d) end
function Faulty:forward(x)
  if self.armed and at == "forward" and rank == bad_rank then
    error(("injected fault in forward on rank %d at step %d"):format(rank, self.step), 0)
  end
  return self.fc(x):relu()
end

fsdp.manual_seed(9)
local faulty = Faulty(16)
local model = nn.Sequential{nn.Linear(16, 16), faulty, nn.Linear(16, 16)}
fsdp.wrap(model, {policy = fsdp.policy.list{model[1], model[2], model[3]}})
local opt = fsdp.optim.SGD(model, {lr = 0.01})
local x = fsdp.randn{4, 16}
for step = 1, 5 do
  faulty.step, faulty.armed = step, step == bad_step
  opt:zero_grad()
  local loss = nn.F.mse(model(x), x)
  if at == "backward" and step == bad_step and rank == bad_rank then
    error(("injected fault before backward on rank %d at step %d"):format(rank, step), 0)
  end
  loss:backward()
  opt:step()
end
print(("rank %d finished: the fault was not injected"):format(rank))
