-- Masks live with the shards and survive wrap, unwrap, re-wrap, gather and reshard
-- (tests/recipes/dist_mask.sh).
--   fsdprun -n N tests/dist/mask_rewrap.lua
-- Checks, on every rank:
--   * a wrapped parameter's mask holds only this rank's slice: its size is fsdp.shard(p)'s and
--     the slices of all ranks add up to the parameter (strategy none: every rank holds it all);
--   * fsdp.mask(p) gives the same full mask after wrap, training, u:gather()/u:reshard(),
--     unwrap, and re-wraps with other strategies and policies (inner wrap absorbed too), and
--     the masked weights are exactly 0 at every stage;
--   * set_mask with a different mask on some rank is an error on every rank; so are a bad mask
--     (values, shape) or nil on one rank only, bad or differing pruning arguments on one rank
--     (sparsity, m, the selection), and a bad slice for mask.set_local on one rank, each naming
--     that rank and setting nothing.
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
  fsdp.set_mask(p, nil)
end

-- one rank's bad arguments: refused on every rank alike (the local checks ride on the
-- comparison), naming that rank, and nothing is set; the ranks go on in step
local last = W - 1
local function on_last(a, b) if rank == last then return a end return b end
local function refused_alike(fn, err, text)
  err = tostring(err)
  local head = fn .. ": " .. (W > 1 and ("rank %d of %d: "):format(last, W) or "")
  return err:find(head .. text, 1, true) ~= nil
end
local good = {}
for j = 1, p:numel() do good[j] = j % 3 == 0 and 0 or 1 end
local bad = {unpack(good)}
bad[5] = 0.5
local name = "blocks.1.mlp.fc.weight"
ok, err = pcall(fsdp.set_mask, p, fsdp.tensor(on_last(bad, good)):view(p:shape()))
check(not ok and refused_alike("fsdp.set_mask", err, name .. ": the mask must hold only 0 and 1"),
  "a mask with a 0.5 on one rank: " .. tostring(err))
ok, err = pcall(fsdp.set_mask, p, on_last(fsdp.ones{3, 3}, fsdp.tensor(good):view(p:shape())))
check(not ok and refused_alike("fsdp.set_mask", err, name .. ": the mask has shape (3, 3)"),
  "a mask of another shape on one rank: " .. tostring(err))
ok, err = pcall(fsdp.set_mask, p, on_last(nil, fsdp.tensor(good):view(p:shape())))
if W > 1 then
  check(not ok and tostring(err):find(name .. ": the ranks passed different masks: rank 0 a mask "
    .. "with", 1, true) and tostring(err):find(("rank %d nil"):format(last), 1, true),
    "nil on one rank, a mask on the others: " .. tostring(err))
end
check(fsdp.mask(p) == nil, "the refused set_mask calls set nothing")
local sel = "blocks%.1%.mlp%.fc%.weight"
ok, err = pcall(fsdp.prune.magnitude, model, {params = sel, sparsity = on_last(1.5, 0.5)})
check(not ok and refused_alike("prune.magnitude", err,
  "sparsity must be a number in [0, 1] (got 1.5)"),
  "a sparsity out of range on one rank: " .. tostring(err))
ok, err = pcall(fsdp.prune.nm, model, {params = sel, n = 2, m = on_last(5, 4)})
check(not ok and refused_alike("prune.nm", err,
  name .. " has shape (64, 16): its last dimension 16 is not a multiple of m = 5"),
  "an m that does not divide on one rank: " .. tostring(err))
if W > 1 then
  ok, err = pcall(fsdp.prune.magnitude, model, {params = sel, sparsity = 0.5 + rank / 8})
  check(not ok and tostring(err):find('prune.magnitude: what to prune differs across ranks at '
    .. '["sparsity"]: rank 0 has 0.5, rank 1 has 0.625', 1, true),
    "a sparsity that differs across ranks: " .. tostring(err))
  ok, err = pcall(fsdp.prune.hold, model, {params = on_last("blocks%.2%.mlp%.fc%.weight", sel)})
  check(not ok and tostring(err):find('prune.hold: what to prune differs across ranks at '
    .. '["params"][1]', 1, true),
    "a selection that differs across ranks: " .. tostring(err))
end
check(fsdp.mask(p) == nil, "the refused pruning set nothing")
-- mask.set_local (checkpoints): a slice with 2s on the last rank that holds part of p
local held = require("fsdp.collective").all_gather(fsdp.shard(p):numel(), "held")
local culprit = 0
for r = 0, W - 1 do if held[r + 1] > 0 then culprit = r end end
local slice = fsdp.zeros{fsdp.shard(p):numel()}
if rank == culprit then slice:fill(2) end
ok, err = pcall(mask.set_local, model, {[p] = slice})
local head = "mask.set_local: " .. (W > 1 and ("rank %d of %d: "):format(culprit, W) or "")
check(not ok and tostring(err):find(head .. name .. ": the mask must hold only 0 and 1", 1, true),
  "a slice with 2s on one rank: " .. tostring(err))
check(fsdp.mask(p) == nil, "the refused set_local set nothing")
if W > 1 then -- a mask for p on rank 0 only: the ranks must set the same parameters
  local ones = fsdp.ones{fsdp.shard(p):numel()}
  ok, err = pcall(mask.set_local, model, rank == 0 and {[p] = ones} or {})
  check(not ok and tostring(err):find("mask.set_local: which parameters get masks differs "
    .. "across ranks", 1, true), "set_local for p on rank 0 only: " .. tostring(err))
  check(fsdp.mask(p) == nil, "the refused set_local set nothing on any rank")
end
fsdp.unwrap(model)
verify("final unwrap")

if C.failures() > 0 then error(("%d checks failed on rank %d"):format(C.failures(), rank), 0) end
print(("rank %d: masks identical through 4 wraps, gathers, reshards, unwraps and training"):format(rank))
