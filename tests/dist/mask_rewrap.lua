-- Masks live with the shards and survive wrap, unwrap, re-wrap, gather and reshard
-- (tests/recipes/dist_mask.sh).
--   fsdprun -n N tests/dist/mask_rewrap.lua
-- Checks, on every rank:
--   * a wrapped parameter's mask holds only this rank's slice: its size is fsdp.shard(p)'s and
--     the slices of all ranks add up to the parameter (strategy none: every rank holds it all);
--   * fsdp.mask(p) gives the same full mask after wrap, training, u:gather()/u:reshard(),
--     unwrap, and re-wraps with other strategies and policies (inner wrap absorbed too), and
--     the masked weights are exactly 0 at every stage;
--   * set_mask with a different mask on some rank is an error on every rank.
local fsdp = require "fsdp"
local mask = require "fsdp.mask"
local nn = fsdp.nn
local rank, W = fsdp.rank(), fsdp.world_size()

local C = dofile("tests/dist/common.lua")
local check = C.check

local ids = fsdp.tensor{{1, 2, 3, 4, 5, 6}, {7, 8, 9, 10, 11, 12}}
local tgt = fsdp.tensor{{2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13}}

fsdp.manual_seed(9)
local model = nn.GPT{vocab = 16, ctx = 8, d = 16, layers = 3, heads = 2}
local targets = {model.blocks[1].attn.qkv.weight, model.blocks[2].mlp.fc.weight,
  model.blocks[3].mlp.proj.bias, model.wpe.weight}
local names = {"blocks.1.attn.qkv.weight", "blocks.2.mlp.fc.weight", "blocks.3.mlp.proj.bias", "wpe.weight"}
local want = {}
for i, p in ipairs(targets) do
  local v = {}
  for j = 1, p:numel() do v[j] = ((j * 31 + i * 17) % 10) < 4 and 0 or 1 end
  want[i] = v
  fsdp.set_mask(p, fsdp.tensor(v):view(p:shape())) -- plain: full masks
end

local function flat(t) return t:view{t:numel()}:totable() end

local function same(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

local function verify(stage)
  local vals = {}
  fsdp.full_params(model, function()
    for i, p in ipairs(targets) do vals[i] = flat(p) end
  end, {writeback = false})
  for i, p in ipairs(targets) do
    local m = fsdp.mask(p)
    check(m ~= nil and same(flat(m), want[i]), stage .. ": mask of " .. names[i])
    local bad = 0
    for j, x in ipairs(vals[i]) do if want[i][j] == 0 and x ~= 0 then bad = bad + 1 end end
    check(bad == 0, ("%s: %d masked weights of %s are not 0"):format(stage, bad, names[i]))
  end
end

local function verify_local(stage, strategy)
  for i, p in ipairs(targets) do
    local sl = mask.local_slice(p)
    local n = sl and sl:numel() or -1
    check(n == fsdp.shard(p):numel(), ("%s: %s: the mask slice has %d elements, the shard slice %d")
      :format(stage, names[i], n, fsdp.shard(p):numel()))
    local total = fsdp.all_reduce(n, "sum")
    local expect = strategy == "none" and W * p:numel() or p:numel()
    check(total == expect, ("%s: %s: slices add up to %d (expected %d)"):format(stage, names[i], total, expect))
  end
end

local function train(steps)
  local opt = fsdp.optim.SGD(model, {lr = 0.2, momentum = 0.9, weight_decay = 0.01})
  for _ = 1, steps do
    opt:zero_grad()
    nn.F.cross_entropy(model(ids), tgt):backward()
    opt:step()
  end
end

verify("plain")
for _, cfg in ipairs{
  {strategy = "full", policy = fsdp.policy.modules{nn.Block}},
  {strategy = "grad_op", policy = fsdp.policy.size(1000)},
  {strategy = "none", policy = fsdp.policy.modules{nn.Block}},
  {strategy = "full"},
} do
  local stage = cfg.strategy .. (cfg.policy and (" " .. tostring(cfg.policy)) or " root only")
  fsdp.wrap(model, cfg)
  verify_local(stage, cfg.strategy)
  verify(stage .. ", wrapped")
  train(3)
  verify(stage .. ", trained")
  for _, u in ipairs(fsdp.units(model)) do u:gather() end
  verify(stage .. ", gathered")
  for _, u in ipairs(fsdp.units(model)) do u:reshard() end
  train(1)
  verify(stage .. ", resharded")
  fsdp.unwrap(model)
  verify(stage .. ", unwrapped")
end

-- an inner wrap absorbed by an outer one
fsdp.wrap(model.blocks[2], {})
for i, p in ipairs(targets) do
  check(same(flat(fsdp.mask(p)), want[i]), "inner wrap: mask of " .. names[i])
end
fsdp.wrap(model, {policy = fsdp.policy.modules{nn.Block}})
verify_local("outer wrap", "full")
verify("outer wrap")
train(2)
verify("outer wrap, trained")

-- ranks passing different masks: an error everywhere
local p = model.blocks[1].mlp.fc.weight
local v = {}
for j = 1, p:numel() do v[j] = (j + rank) % 3 == 0 and 0 or 1 end
local ok, err = pcall(fsdp.set_mask, p, fsdp.tensor(v):view(p:shape()))
if W > 1 then
  check(not ok and tostring(err):find("different masks", 1, true) ~= nil,
    "different masks on the ranks are refused: " .. tostring(err))
else
  check(ok, "one rank: any mask is fine")
end
fsdp.unwrap(model)
verify("final unwrap")

if C.failures() > 0 then error(("%d checks failed on rank %d"):format(C.failures(), rank), 0) end
print(("rank %d: masks identical through 4 wraps, gathers, reshards, unwraps and training"):format(rank))
