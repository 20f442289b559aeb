-- Ranks whose user code built different models (tests/recipes/dist_ties.sh): fsdp.wrap must
-- stop on every rank with an error that names the difference and the ranks on each side
-- (invariant 2), before any collective that could hang, and leave the model plain.
-- The last rank is the odd one out:
--   --case=tie     it does not tie head.weight to wte.weight
--   --case=shape   it builds one layer with another width
--   --case=skip    it builds one block fewer
--   --case=module  it drops a module (ln_f) after building
--   --case=extra   it adds one more parameter
--   --case=meta    it builds on meta while the others build real weights (no sync)
--   --case=retie   it breaks the tie after building (head.weight a new parameter)
--   fsdprun -n N tests/dist/ties_mismatch.lua --case=<case>
local fsdp = require "fsdp"
require "fsdp.meta"
local nn = fsdp.nn
local W, rank = fsdp.world_size(), fsdp.rank()
local case = fsdp.args.case or "tie"
local odd = rank == W - 1
assert(W >= 2, "run at 2 ranks or more")

local C = dofile("tests/dist/common.lua")
local check = C.check

local cfg = {vocab = 20, ctx = 8, d = 16, layers = 3, heads = 2}
local expect -- substrings every rank's error must contain
fsdp.manual_seed(2)
local model
if case == "tie" then
  model = nn.GPT{vocab = 20, ctx = 8, d = 16, layers = 3, heads = 2, tie = not odd}
  expect = {"wte.weight (20, 16)", "tied to head.weight", "rank " .. (W - 1)}
elseif case == "shape" then
  model = nn.GPT(cfg)
  if odd then model.blocks[2].mlp.fc = nn.Linear(16, 48) end
  expect = {"blocks.2.mlp.fc.weight (64, 16)", "blocks.2.mlp.fc.weight (48, 16)", "unit 'blocks.2'"}
elseif case == "skip" then
  model = nn.GPT{vocab = 20, ctx = 8, d = 16, layers = odd and 2 or 3, heads = 2}
  expect = {"unit 'blocks.3'", "rank " .. (W - 1)}
elseif case == "module" then
  model = nn.GPT(cfg)
  if odd then model.ln_f = nil end
  expect = {"ln_f.weight (16)", "rank " .. (W - 1)}
elseif case == "extra" then
  model = nn.GPT(cfg)
  if odd then model.extra = nn.Parameter(fsdp.zeros{4}) end
  expect = {"extra (4)", "nothing more"}
elseif case == "meta" then
  model = odd and fsdp.meta(function() return nn.GPT(cfg) end) or nn.GPT(cfg)
  expect = {"on meta", "sync_module_states = true"}
elseif case == "retie" then
  model = nn.GPT(cfg)
  if odd then model.head.weight = nn.Parameter(fsdp.zeros{20, 16}) end
  expect = {"tied to head.weight", "rank " .. (W - 1)}
else
  error("unknown case " .. tostring(case))
end

local ok, err = pcall(fsdp.wrap, model, {policy = fsdp.policy.modules{nn.Block}})
err = tostring(err)
check(not ok, case .. ": wrap fails on every rank")
check(err:find("differs across ranks", 1, true) ~= nil, case .. ": the error says the ranks differ: " .. err)
for _, s in ipairs(expect) do
  check(err:find(s, 1, true) ~= nil, ("%s: the error names %q: %s"):format(case, s, err))
end
check(err:find("rank 0 has", 1, true) ~= nil, case .. ": the error names rank 0's side")
check(not fsdp.is_wrapped(model), case .. ": the model is left plain")
check(#fsdp.units(model) == 0, case .. ": no units")
-- and the ranks can go on (no collective is left half done): a barrier and a good wrap
fsdp.barrier()
fsdp.manual_seed(2)
local good = nn.GPT(cfg)
fsdp.wrap(good, {policy = fsdp.policy.modules{nn.Block}})
check(fsdp.is_wrapped(good), case .. ": a model that agrees wraps afterwards")

if rank == 0 then
  print(("ties_mismatch %s at %d ranks: %d checks failed; rank 0's error: %s"):format(case, W,
    C.failures(), err))
end
if C.failures() > 0 then error(("%d ties_mismatch checks failed"):format(C.failures())) end
