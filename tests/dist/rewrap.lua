-- The fairscale/Lightning failure (wrapping a model twice) as a test (tests/recipes/
-- dist_rewrap.sh): wrap, train, keep the plain module, wrap it again (an inner unit that the
-- user wrapped first included), get identical outputs and the same parameter list; unwrap
-- gives a plain model with the same outputs; it can be wrapped afresh. Every check runs on
-- every rank; outputs are compared bitwise (the same kernels on the same values).
--   fsdprun -n N tests/dist/rewrap.lua
local fsdp = require "fsdp"
local nn = fsdp.nn
local rank = fsdp.rank()

local C = dofile("tests/dist/common.lua")
local check = C.check

local function same_list(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if not rawequal(a[i], b[i]) then return false end end
  return true
end

local function equal(a, b)
  local ta, tb = a:view{a:numel()}:totable(), b:view{b:numel()}:totable()
  if #ta ~= #tb then return false end
  for i = 1, #ta do if ta[i] ~= tb[i] then return false end end
  return true
end

fsdp.manual_seed(3)
-- module = nn.Sequential(nn.Linear(5, 5), FullyShardedDataParallel(nn.Linear(5, 5)))
local inner = nn.Linear(5, 5)
local module = nn.Sequential{nn.Linear(5, 5), inner}
fsdp.wrap(inner)
check(fsdp.is_wrapped(inner), "the inner Linear is wrapped")
local saved_weight = module[1].weight -- a reference taken before the outer wrap
local params_before = module:parameters()
local n_before = #params_before

-- training_model = FullyShardedDataParallel(module)
local training_model = fsdp.wrap(module)
check(rawequal(training_model, module), "wrap returns the model itself")
check(fsdp.is_wrapped(module) and not fsdp.is_wrapped(inner), "the outer is the root, the inner a unit")
local units = fsdp.units(module)
check(#units == 2, ("two units (got %d)"):format(#units))
check(#module:parameters() == n_before, "#parameters unchanged by wrapping")
check(same_list(module:parameters(), params_before), "the same parameter objects after wrapping")

local x = fsdp.tensor{{0.1 * (rank + 1), 0.2, -0.3, 0.4, 0.5}, {0.5, -0.1, 0.2, 0.3, -0.4 * (rank + 1)}}
local opt = fsdp.optim.SGD(module, {lr = 0.1, momentum = 0.9})
for _ = 1, 3 do
  opt:zero_grad()
  local out = training_model(x)
  local loss = nn.F.mse(out, x)
  loss:backward()
  opt:step()
end
local output = fsdp.no_grad(function() return training_model(x) end)

-- inference_model = FullyShardedDataParallel(module): wrapping again changes nothing
local inference_model = fsdp.wrap(module)
check(rawequal(inference_model, module), "wrapping again returns the same model")
check(#fsdp.units(module) == 2, "wrapping again adds no unit")
local second_output = fsdp.no_grad(function() return inference_model(x) end)
check(equal(output, second_output), "identical outputs after wrapping again")
-- the assertion that failed in fairscale
check(#inference_model:parameters() == #training_model:parameters() and
  #inference_model:parameters() == n_before, "same number of parameters")

-- a reference saved before wrapping sees the live values
local via_saved, via_fresh
fsdp.full_params(module, function(m)
  via_saved, via_fresh = saved_weight:clone(), m[1].weight:clone()
end)
check(equal(via_saved, via_fresh), "saved reference and fresh reference agree under full_params")

-- unwrap: a plain model, same parameter objects, dense, same outputs
fsdp.unwrap(module)
check(not fsdp.is_wrapped(module) and #fsdp.units(module) == 0, "unwrapped")
check(same_list(module:parameters(), params_before), "the same parameter objects after unwrap")
check(saved_weight.device == "cpu" and equal(saved_weight, via_saved),
  "the saved reference holds the trained values, dense")
local plain_output = fsdp.no_grad(function() return module(x) end)
check(equal(plain_output, output), "identical outputs unwrapped")

-- Lightning's second stage: the user's (plain) module wrapped afresh, the inner unit again
fsdp.wrap(inner)
fsdp.wrap(module, {strategy = "grad_op"})
check(#fsdp.units(module) == 2 and #module:parameters() == n_before, "wrapped afresh")
local fresh_output = fsdp.no_grad(function() return module(x) end)
check(equal(fresh_output, output), "identical outputs wrapped afresh")
-- and it trains again
local opt2 = fsdp.optim.SGD(module, {lr = 0.1})
opt2:zero_grad()
nn.F.mse(module(x), x):backward()
opt2:step()
local after = fsdp.no_grad(function() return module(x) end)
check(not equal(after, output), "training after re-wrapping changes the outputs")
fsdp.unwrap(module)
check(same_list(module:parameters(), params_before), "the same parameter objects at the end")

if rank == 0 then
  print(("rewrap: %d checks failed; %d parameters throughout"):format(C.failures(), n_before))
end
if C.failures() > 0 then error(("%d rewrap checks failed"):format(C.failures())) end
