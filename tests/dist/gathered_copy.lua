-- A gathered unit holds a copy of its shards (tests/recipes/dist_gathered.sh, 1 to 3 ranks):
-- nothing may be computed from a stale copy, and no write into it may vanish.
--   fsdprun -n N tests/dist/gathered_copy.lua
-- Checks, on every rank:
--   * a forward with gradients and no backward (a logged loss) between backward and step, with
--     the root (full) or every unit (grad_op, bf16 mixed precision) still gathered after it:
--     the step reaches the next forward, unwrap and both checkpoint formats; the run is the same
--     bits as one without that forward;
--   * a write through a parameter reference while its unit is gathered (outside full_params /
--     apply) is an error at the reshard that would drop it (backward, a step, save), and
--     u:reshard{discard = true} drops it; by hand, u:gather(), change, u:writeback() keeps it;
--   * a shard written while its unit is gathered is an error at the next gather, not a forward
--     with the old values;
--   * fsdp.set_mask on a unit whose gathered copy was written outside full_params / apply on
--     one rank is refused on every rank, setting no mask and adopting nothing; inside
--     fsdp.apply / full_params (writes expected) and between a forward and its backward it masks;
--   * fsdp.prune.magnitude / nm / hold, mask.reapply and mask.set_local after such a write on
--     one rank are refused on every rank alike, recording and masking nothing; pruning inside
--     fsdp.apply / full_params prunes the shards and masks the live copy, keeping fn's writes
--     (written back, or dropped without writeback); fsdp.load after such a write on one rank
--     is refused on every rank, loading nothing;
--   * fsdp.full_params / fsdp.apply whose fn fails on one rank fail on every rank and write
--     nothing back; fsdp.save inside full_params is refused;
--   * pruning and counting zeros of a model wrapped on meta, before it has values, is refused;
--   * replicas (strategy none) whose ranks reduce different units of one size fail, naming
--     both (collectives compare labels on every call).
local fsdp = require "fsdp"
local nn = fsdp.nn
local rank, W = fsdp.rank(), fsdp.world_size()

local C = dofile("tests/dist/common.lua")
local check = C.check

local x = fsdp.tensor({{1, 2, 3, 4, 5, 6, 7, 8}, {9, 10, 11, 12, 13, 14, 15, 16}}, {dtype = "i64"})
local y = fsdp.tensor({{2, 3, 4, 5, 6, 7, 8, 9}, {10, 11, 12, 13, 14, 15, 16, 17}}, {dtype = "i64"})

local function gpt()
  fsdp.manual_seed(3)
  return nn.GPT{vocab = 32, ctx = 16, d = 32, layers = 2, heads = 2, tie = true}
end

local function wrap(m, strategy, mp)
  return fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Block}, strategy = strategy, mp = mp})
end

local function root_unit(m)
  for _, u in ipairs(fsdp.units(m)) do
    if u.path == "(root)" then return u end
  end
end

local function errs(fn, ...)
  local ok, err = pcall(fn, ...)
  return not ok and tostring(err) or nil
end

local function values(m)
  local out = {}
  fsdp.full_params(m, function(mm)
    for path, p in mm:named_parameters() do out[path] = C.flat(p) end
  end)
  return out
end

local function same_values(a, b)
  for path, v in pairs(a) do
    if not C.same(v, b[path]) then return false, path end
  end
  return true
end

local function tmpdir(name)
  local d = (os.getenv("TMPDIR") or "/tmp") .. ("/fsdp_gathered_%s_%d"):format(name, W)
  return d
end

-- ---- a forward without backward between backward and step ----------------------------------
for _, case in ipairs{{"full"}, {"grad_op"}, {"full", "bf16"}} do
  local strategy, mp = case[1], case[2]
  local what = strategy .. (mp and (" " .. mp) or "")
  local function run(probe)
    local m = wrap(gpt(), strategy, mp)
    local opt = fsdp.optim.AdamW(m, {lr = 1e-2})
    local losses = {}
    for s = 1, 3 do
      opt:zero_grad()
      nn.F.cross_entropy(m(x), y):backward()
      if probe then losses[#losses + 1] = nn.F.cross_entropy(m(x), y):item() end
      opt:step()
      losses[#losses + 1] = s
    end
    losses[#losses + 1] = nn.F.cross_entropy(m(x), y):item()
    return m, losses
  end
  local m0, l0 = run(false)
  local m1, l1 = run(true)
  check(l0[#l0] == l1[#l1], ("%s: a forward after 3 steps: %.9g with logged losses, %.9g without")
    :format(what, l1[#l1], l0[#l0]))
  local v0, v1 = values(m0), values(m1)
  local ok, path = same_values(v0, v1)
  check(ok, what .. ": the logged losses changed the trained parameters (" .. tostring(path) .. ")")
  -- both checkpoint formats save the stepped values
  if strategy == "full" and not mp then
    local a, b = tmpdir("st") .. ".safetensors", tmpdir("sh")
    nn.F.cross_entropy(m1(x), y) -- the root gathered again, no backward
    check(root_unit(m1):state() == "gathered", what .. ": the root stays gathered after a forward")
    fsdp.save(m1, a)
    fsdp.save(m1, b)
    local ra, rb = gpt(), gpt()
    fsdp.load(ra, a)
    fsdp.load(rb, b)
    for p, v in pairs(v1) do
      local pa, pb = ra, rb
      for k in p:gmatch("[^.]+") do pa, pb = pa[tonumber(k) or k], pb[tonumber(k) or k] end
      check(C.same(C.flat(pa), v) and C.same(C.flat(pb), v), what .. ": saved " .. p .. " differs from the model")
    end
    if rank == 0 then os.remove(a) os.execute("rm -rf " .. b) end
  end
  fsdp.unwrap(m1)
  local flat = C.flat(m1.wte.weight)
  check(C.same(flat, v0["wte.weight"]), what .. ": unwrap after logged losses holds the stepped values")
  fsdp.unwrap(m0)
end
print(("ok: rank %d: a forward without backward between backward and step changes nothing"):format(rank))

-- ---- writes into a gathered unit --------------------------------------------------------------
do
  local m = gpt()
  local w = m.wpe.weight -- a reference kept from before wrapping: the root owns it
  wrap(m, "full")
  local root = root_unit(m)
  local before = values(m)
  local opt = fsdp.optim.SGD(m, {lr = 0})
  local _ = nn.F.cross_entropy(m(x), y) -- the root stays gathered
  w:fill(0)
  local e = errs(function()
    opt:zero_grad()
    nn.F.cross_entropy(m(x), y):backward()
  end)
  check(e and e:find("was written while it was gathered", 1, true) and e:find("fsdp.full_params", 1, true),
    "a write through a reference to a gathered unit fails the backward that would drop it: " .. tostring(e))
  -- the refusals below agree across ranks first ("rank R of W: " when several)
  local function refused(err, what)
    return err and err:find(what .. ": ", 1, true)
      and err:find("unit '(root)' was changed while gathered", 1, true)
  end
  e = errs(opt.step, opt)
  check(refused(e, "SGD:step"), "and the step: " .. tostring(e))
  e = errs(fsdp.save, m, tmpdir("dirty") .. ".safetensors")
  check(refused(e, "fsdp.save"), "and a save: " .. tostring(e))
  e = errs(fsdp.unwrap, m)
  check(refused(e, "fsdp.unwrap") and fsdp.is_wrapped(m), "and unwrap, before changing anything: " .. tostring(e))
  e = errs(fsdp.full_params, m, function() end)
  check(refused(e, "fsdp.full_params"), "and full_params: " .. tostring(e))
  root:reshard{discard = true}
  check(root:state() == "sharded", "reshard{discard = true} reshards")
  check(same_values(before, values(m)), "the discarded write left the model as it was")
  e = errs(root.reshard, root, {drop = true})
  check(e and e:find("unknown option 'drop'", 1, true), "reshard refuses unknown options: " .. tostring(e))
  -- by hand: gather, change, write back
  root:gather()
  w:fill(0.5)
  root:writeback()
  root:reshard()
  local v = values(m)["wpe.weight"]
  check(v[1] == 0.5 and v[#v] == 0.5, "gather, fill, writeback, reshard keeps the change")
  root:gather()
  w:view{w:numel()}:narrow(1, 1, 1):fill(2) -- through a view of the parameter
  e = errs(root.reshard, root)
  check(e and e:find("unit '(root)'", 1, true), "a write through a view of a gathered parameter is seen: " .. tostring(e))
  root:reshard{discard = true}
  -- a shard written while its unit is gathered
  local _ = nn.F.cross_entropy(m(x), y)
  root:shard():fill(1) -- every rank holds a slice of the root
  e = errs(function() return m(x) end)
  check(e and e:find("its shard was written while its parameters were gathered", 1, true),
    "a forward over a stale gathered copy is an error: " .. tostring(e))
  root:reshard()
  v = values(m)["wpe.weight"]
  check(v[1] == 1 and v[#v] == 1, "the shard's write is kept")
  fsdp.unwrap(m)
end
print(("ok: rank %d: writes to gathered units are refused or kept, never dropped"):format(rank))

-- ---- set_mask on a gathered unit ----------------------------------------------------------------
do
  local m = gpt()
  local w = m.wpe.weight -- the root's
  wrap(m, "full")
  local root = root_unit(m)
  local before = values(m)
  local mv = {}
  for j = 1, w:numel() do mv[j] = (j % 3 == 0) and 0 or 1 end
  local mk = fsdp.tensor(mv):view(w:shape())
  local loss = nn.F.cross_entropy(m(x), y) -- the root stays gathered for the backward
  if rank == W - 1 then w:fill(5) end -- a stray write, on one rank
  local e = errs(fsdp.set_mask, w, mk)
  check(e and e:find("fsdp.set_mask: ", 1, true)
    and e:find("wpe.weight (no mask set): unit '(root)' was changed while gathered", 1, true)
    and e:find("u:reshard{discard = true}", 1, true),
    "set_mask after a stray write into the gathered copy is refused on every rank: " .. tostring(e))
  if W > 1 then
    check(e and e:find(("rank %d of %d"):format(W - 1, W), 1, true),
      "naming the rank: " .. tostring(e))
  end
  check(fsdp.mask(w) == nil, "the refused set_mask recorded no mask")
  root:reshard{discard = true}
  check(same_values(before, values(m)), "the refused set_mask adopted nothing")
  -- inside fsdp.apply the walk writes the copy back: fn's writes and the mask are both kept
  fsdp.apply(m, function(mod)
    if mod == m then
      mod.wpe.weight:fill(2)
      fsdp.set_mask(mod.wpe.weight, mk)
    end
  end)
  local v = values(m)["wpe.weight"]
  local bad = 0
  for j = 1, #v do if v[j] ~= (mv[j] == 0 and 0 or 2) then bad = bad + 1 end end
  check(bad == 0, ("set_mask inside fsdp.apply: %d weights neither masked nor written"):format(bad))
  -- and inside full_params
  fsdp.full_params(m, function()
    w:fill(3)
    fsdp.set_mask(w, mk)
  end)
  v = values(m)["wpe.weight"]
  bad = 0
  for j = 1, #v do if v[j] ~= (mv[j] == 0 and 0 or 3) then bad = bad + 1 end end
  check(bad == 0,
    ("set_mask inside fsdp.full_params: %d weights neither masked nor written"):format(bad))
  -- between a forward and its backward, with nothing written: masks the live copy
  fsdp.set_mask(w, nil)
  fsdp.full_params(m, function() w:fill(1) end)
  loss = nn.F.cross_entropy(m(x), y)
  check(root:state() == "gathered", "the root is gathered between forward and backward")
  fsdp.set_mask(w, mk)
  local live = C.flat(w)
  bad = 0
  for j = 1, #live do if mv[j] == 0 and live[j] ~= 0 then bad = bad + 1 end end
  check(bad == 0, ("set_mask between forward and backward: %d live weights not masked"):format(bad))
  loss:backward()
  v = values(m)["wpe.weight"]
  bad = 0
  for j = 1, #v do if v[j] ~= (mv[j] == 0 and 0 or 1) then bad = bad + 1 end end
  check(bad == 0, ("set_mask between forward and backward: %d shard weights wrong"):format(bad))
  fsdp.unwrap(m)
end
print(("ok: rank %d: set_mask refuses a stray write into a gathered copy, masks inside walks")
  :format(rank))

-- ---- pruning and re-masking a gathered unit ---------------------------------------------------
do
  local mask = require "fsdp.mask"
  local m = gpt()
  local w = m.wpe.weight -- the root's: (16, 32)
  wrap(m, "full")
  local root = root_unit(m)
  local before = values(m)
  -- refused on every rank alike, naming the call, the rank, the parameter, the unit, the remedy
  local function refused(e, fn, note)
    return e and e:find(fn .. ": ", 1, true)
      and e:find(("wpe.weight (%s): unit '(root)' was changed while gathered"):format(note), 1,
        true)
      and e:find("u:reshard{discard = true}", 1, true)
      and (W == 1 or e:find(("%s: rank %d of %d: "):format(fn, W - 1, W), 1, true)) and true
  end
  local function stray_write() -- the root left gathered by a forward; one rank writes into it
    local _ = nn.F.cross_entropy(m(x), y)
    if rank == W - 1 then w:fill(5) end
  end
  local calls = {
    {"prune.magnitude", function() fsdp.prune.magnitude(m, {params = "wpe", sparsity = 0.5}) end},
    {"prune.nm", function() fsdp.prune.nm(m, {params = "wpe", n = 2, m = 4}) end},
    {"prune.hold", function() fsdp.prune.hold(m, {params = "wpe"}) end},
  }
  for _, c in ipairs(calls) do
    stray_write()
    local e = errs(c[2])
    check(refused(e, c[1], "nothing pruned"), c[1] .. " after a stray write: " .. tostring(e))
    check(fsdp.mask(w) == nil, c[1] .. ": the refused call recorded no mask")
    root:reshard{discard = true}
    check(same_values(before, values(m)), c[1] .. ": the refused call changed nothing")
  end
  -- the checkpoint helpers that mask shards and refresh gathered units
  local mv = {}
  for j = 1, w:numel() do mv[j] = (j % 4 == 0) and 0 or 1 end
  fsdp.set_mask(w, fsdp.tensor(mv):view(w:shape()))
  before = values(m)
  stray_write()
  local e = errs(mask.reapply, m)
  check(refused(e, "mask.reapply", "masks not applied"), "reapply after the write: " .. tostring(e))
  e = errs(mask.set_local, m, {[w] = fsdp.zeros{mask.local_slice(w):numel()}})
  check(refused(e, "mask.set_local", "no mask set"), "set_local after the write: " .. tostring(e))
  check(C.same(C.flat(fsdp.mask(w)), mv), "the refused set_local kept the mask")
  root:reshard{discard = true}
  check(same_values(before, values(m)), "the refused reapply and set_local changed nothing")
  fsdp.set_mask(w, nil)
  -- inside fsdp.apply the walk holds the root: the shards are pruned (by their values, not
  -- yet fn's), the live copy is masked in place keeping fn's writes, and both are kept
  local ramp = {}
  for j = 1, w:numel() do ramp[j] = j end
  fsdp.full_params(m, function() w:copy(fsdp.tensor(ramp):view(w:shape())) end)
  local live
  fsdp.apply(m, function(mod)
    if mod == m then
      w:fill(2)
      fsdp.prune.magnitude(m, {params = "wpe", sparsity = 0.5})
      live = C.flat(w)
    end
  end)
  local v = values(m)["wpe.weight"]
  local bad = 0
  for j = 1, #v do
    local want = j <= #v / 2 and 0 or 2
    if v[j] ~= want or live[j] ~= want then bad = bad + 1 end
  end
  check(bad == 0, ("prune inside fsdp.apply: %d weights wrong (live or written back)"):format(bad))
  -- inside full_params without writeback: fn's write dropped, the pruning kept
  fsdp.set_mask(w, nil)
  fsdp.full_params(m, function() w:copy(fsdp.tensor(ramp):view(w:shape())) end)
  fsdp.full_params(m, function()
    w:fill(3)
    fsdp.prune.magnitude(m, {params = "wpe", sparsity = 0.25})
    live = C.flat(w)
  end, {writeback = false})
  v = values(m)["wpe.weight"]
  bad = 0
  for j = 1, #v do
    local pruned = j <= #v / 4
    if v[j] ~= (pruned and 0 or j) or live[j] ~= (pruned and 0 or 3) then bad = bad + 1 end
  end
  check(bad == 0, ("prune inside fsdp.full_params without writeback: %d weights wrong"):format(bad))
  -- fsdp.load reshards every unit before loading: agreed while staging, nothing loaded
  local file = tmpdir("load") .. ".safetensors"
  fsdp.save(m, file)
  before = values(m)
  stray_write()
  e = errs(fsdp.load, m, file)
  check(e and e:find("fsdp.load: ", 1, true)
    and e:find("unit '(root)' was changed while gathered", 1, true)
    and (W == 1 or e:find(("rank %d of %d: "):format(W - 1, W), 1, true)),
    "fsdp.load after a stray write on one rank is refused on every rank: " .. tostring(e))
  root:reshard{discard = true}
  check(same_values(before, values(m)), "the refused load changed nothing")
  if rank == 0 then os.remove(file) end
  fsdp.unwrap(m)
end
print(("ok: rank %d: pruning refuses a stray write into a gathered copy on every rank, prunes "
  .. "inside walks"):format(rank))

-- ---- full_params / apply failing on one rank ---------------------------------------------------
do
  local m = wrap(gpt(), "full")
  local before = values(m)
  local e = errs(fsdp.full_params, m, function(mm)
    mm.wte.weight:fill(5)
    if rank == W - 1 then error("fn fails on the last rank") end
  end)
  check(e and e:find("fn fails on the last rank", 1, true), "full_params fails on every rank: " .. tostring(e))
  if W > 1 and rank ~= W - 1 then
    check(e and e:find(("rank %d of %d"):format(W - 1, W), 1, true), "naming the failing rank: " .. tostring(e))
  end
  check(same_values(before, values(m)), "full_params wrote nothing back after a failure on one rank")
  local visited = 0
  e = errs(fsdp.apply, m, function(mod, path)
    visited = visited + 1
    if mod.weight then mod.weight:fill(7) end
    if path == "blocks.2" and rank == 0 then error("apply fails on rank 0") end
  end)
  check(e and e:find("apply fails on rank 0", 1, true), "apply fails on every rank: " .. tostring(e))
  -- every rank stopped at blocks.2: blocks.1 was written back when the walk left it, the root
  -- (still gathered at the failure) was not
  local after = values(m)
  local fc = after["blocks.1.mlp.fc.weight"]
  check(fc[1] == 7 and fc[#fc] == 7, "apply wrote back the units it had left before the failure")
  check(C.same(after["wte.weight"], before["wte.weight"]), "apply's failure left the root unwritten")
  e = errs(fsdp.full_params, m, function(mm) fsdp.save(mm, tmpdir("in_fp")) end)
  check(e and e:find("fsdp.save: not inside fsdp.full_params", 1, true), "save inside full_params: " .. tostring(e))
  e = errs(fsdp.full_params, m, function(mm) fsdp.load(mm, tmpdir("in_fp")) end)
  check(e and e:find("fsdp.load: not inside fsdp.full_params", 1, true), "load inside full_params: " .. tostring(e))
  fsdp.unwrap(m)
end
print(("ok: rank %d: full_params and apply fail everywhere or nowhere"):format(rank))

-- ---- a model wrapped on meta, before it has values -------------------------------------------------
do
  local m = fsdp.meta(gpt)
  wrap(m, "full")
  local e = errs(fsdp.prune.magnitude, m, {params = "mlp%.fc%.weight", sparsity = 0.5})
  check(e and e:find("still on the meta device", 1, true), "prune.magnitude waits for values: " .. tostring(e))
  e = errs(fsdp.prune.hold, m, {params = "weight"})
  check(e and e:find("still on the meta device", 1, true), "prune.hold waits for values: " .. tostring(e))
  e = errs(fsdp.sparsity, m)
  check(e and e:find("fsdp.sparsity: ", 1, true), "fsdp.sparsity waits for values: " .. tostring(e))
  fsdp.materialize(m)
  check(fsdp.sparsity(m, {params = "mlp%.fc%.weight"}).sparsity < 0.01, "after materialize: nothing pruned")
end
print(("ok: rank %d: a model without values is neither pruned nor counted"):format(rank))

-- ---- replicas: same-size units reduced in a different order on two ranks ----------------------
-- (last: the mismatch poisons the communicator)
if W > 1 then
  local Net = nn.Module:extend("Net")
  function Net:init() self.a = nn.Linear(8, 8) self.b = nn.Linear(8, 8) self.out = nn.Linear(8, 2) end
  function Net:forward(z, use_b) return self.out(use_b and self.b(z) or self.a(z)) end
  fsdp.manual_seed(1)
  local m = Net()
  fsdp.wrap(m, {policy = fsdp.policy.modules{nn.Linear}, strategy = "none"})
  local opt = fsdp.optim.SGD(m, {lr = 0.1})
  local z = fsdp.ones{2, 8}
  local e = errs(function()
    for s = 1, 2 do
      m(z, s == 2 and rank == 1):sum():backward()
      opt:step()
      opt:zero_grad()
    end
  end)
  check(e and e:find("collective mismatch", 1, true) and e:find("'a'", 1, true) and e:find("'b'", 1, true),
    "replicas reducing different units of one size fail, naming both: " .. tostring(e))
  print(("ok: rank %d: replicas reducing different units fail"):format(rank))
end

if C.failures() > 0 then error(("%d gathered-copy checks failed"):format(C.failures())) end
