-- The SparseML failure (masks through stale references) as a test (tests/recipes/dist_mask.sh): a pruning
-- session saves references to the prunable layers and their weights BEFORE the model is wrapped,
-- prunes through them AFTER it is wrapped, and the sharded model must change and stay pruned
-- through 10 optimizer steps; reading the sparsity must not need the full parameters.
--   fsdprun -n N tests/dist/mask_sparseml.lua
-- Checks, on every rank:
--   * writing through a saved reference outside fsdp.apply is an error naming fsdp.full_params
--     (the report's silent no-op cannot happen);
--   * fsdp.apply(model, fn) reaches the live weights both through the saved references and
--     through fresh ones looked up at apply time; fsdp.set_mask inside it keeps them pruned;
--   * fsdp.sparsity reads the shards: no all_gather, one all_reduce, the same table everywhere,
--     and it sees the pruning at once;
--   * after 10 AdamW steps (weight decay 0.1) every masked weight is exactly 0;
--   * control: the same pruning without set_mask changes the shards too but the zeros regrow
--     (so the check above can fail);
--   * a tied weight (head = wte) is pruned once and has one mask.
local fsdp = require "fsdp"
require "fsdp.mask"
local prune = require "fsdp.prune"
local nn = fsdp.nn
local rank = fsdp.rank()

local C = dofile("tests/dist/common.lua")
local check = C.check

local ids = fsdp.tensor{{1, 2, 3, 4, 5, 6, 7, 8}, {9, 10, 11, 12, 13, 14, 15, 16}}
local tgt = fsdp.tensor{{2, 3, 4, 5, 6, 7, 8, 9}, {10, 11, 12, 13, 14, 15, 16, 17}}

local function build()
  fsdp.manual_seed(5)
  local model = nn.GPT{vocab = 32, ctx = 16, d = 32, layers = 2, heads = 2, tie = true}
  -- the pruning session's references, taken at initialisation (before wrapping)
  local saved = {}
  for path, m in model:named_modules() do
    if nn.isinstance(m, nn.Linear) and (path:find("attn") or path:find("mlp")) then
      saved[#saved + 1] = {path = path, module = m, weight = m.weight}
    end
  end
  fsdp.wrap(model, {policy = fsdp.policy.modules{nn.Block}})
  return model, saved
end

-- 0/1 mask removing the half of w with the smallest magnitudes (ties by position)
local function half_mask(w)
  local v = w:view{w:numel()}:totable()
  local idx = {}
  for i = 1, #v do idx[i] = i end
  table.sort(idx, function(a, b)
    if math.abs(v[a]) ~= math.abs(v[b]) then return math.abs(v[a]) < math.abs(v[b]) end
    return a < b
  end)
  local m = {}
  for i = 1, #v do m[i] = 1 end
  for j = 1, math.floor(#v / 2) do m[idx[j]] = 0 end
  return fsdp.tensor(m):view(w:shape())
end

-- The session's update, run by fsdp.apply: odd layers through the saved weight references,
-- even layers through fresh references (m.weight) looked up at apply time.
local function prune_session(model, saved, with_masks)
  local visited = 0
  fsdp.apply(model, function(m)
    for i, s in ipairs(saved) do
      if rawequal(m, s.module) then
        local w = (i % 2 == 1) and s.weight or m.weight
        local mk = half_mask(w)
        w:copy(w * mk)
        if with_masks then fsdp.set_mask(w, mk) end
        visited = visited + 1
      end
    end
  end)
  check(visited == #saved, ("apply visited %d of %d saved layers"):format(visited, #saved))
end

local function train(model, steps)
  local opt = fsdp.optim.AdamW(model, {lr = 1e-2, weight_decay = 0.1})
  for _ = 1, steps do
    opt:zero_grad()
    nn.F.cross_entropy(model(ids), tgt):backward()
    fsdp.clip_grad_norm(model, 1.0)
    opt:step()
  end
end

-- fsdp.sparsity, checking it gathers nothing and makes exactly one all_reduce, and that every
-- rank got the same total
local function sparsity(model)
  local before = fsdp.comm_stats()
  local s = fsdp.sparsity(model)
  local after = fsdp.comm_stats()
  check(after.all_gather_bytes == before.all_gather_bytes, "sparsity gathered nothing")
  check(after.all_reduce_calls - before.all_reduce_calls == 1,
    ("sparsity made %d all_reduce calls"):format(after.all_reduce_calls - before.all_reduce_calls))
  local zmax, zmin = fsdp.all_reduce(s.zeros, "max"), fsdp.all_reduce(s.zeros, "min")
  check(zmax == zmin, "every rank gets the same sparsity table")
  return s
end

-- ---- the report's flow, fixed ----------------------------------------------------------------
local model, saved = build()

-- outside apply, a saved reference is sharded: using it is an error, never a silent no-op
local ok, err = pcall(function() return saved[1].weight * 2 end)
check(not ok and tostring(err):find("full_params", 1, true) ~= nil,
  "a saved reference read outside apply names fsdp.full_params: " .. tostring(err))

local s0 = sparsity(model)
prune_session(model, saved, true)
local s1 = sparsity(model)
for _, s in ipairs(saved) do
  local path = s.path .. ".weight"
  local e = s1.params[path]
  check(e.zeros >= math.floor(e.numel / 2), ("%s: %d zeros after pruning (numel %d)"):format(path, e.zeros, e.numel))
  check(s0.params[path].zeros < e.zeros, path .. ": the sharded model changed")
  -- this rank's shard slice holds exactly its part of the mask's zeros
  local sh, ml = fsdp.shard(s.weight), require("fsdp.mask").local_slice(s.weight)
  check(ml ~= nil and ml:numel() == sh:numel(), path .. ": the mask slice matches the shard slice")
  if sh:numel() > 0 then
    local vs, ms = sh:totable(), ml:totable()
    local bad = 0
    for i = 1, #vs do if ms[i] == 0 and vs[i] ~= 0 then bad = bad + 1 end end
    check(bad == 0, path .. ": masked shard elements are 0")
  end
end

train(model, 10)
local s2 = sparsity(model)
local masks = {}
for _, s in ipairs(saved) do masks[s.path] = fsdp.mask(s.weight) end
fsdp.full_params(model, function()
  for _, s in ipairs(saved) do
    local v, mv = s.weight:view{s.weight:numel()}:totable(), masks[s.path]:view{s.weight:numel()}:totable()
    local bad, live = 0, 0
    for i = 1, #v do
      if mv[i] == 0 then
        if v[i] ~= 0 then bad = bad + 1 end
      elseif v[i] ~= 0 then
        live = live + 1
      end
    end
    check(bad == 0, ("%s: %d masked weights regrew in 10 steps"):format(s.path, bad))
    check(live > 0, s.path .. ": the unmasked weights train")
  end
end, {writeback = false})
for _, s in ipairs(saved) do
  local path = s.path .. ".weight"
  check(s2.params[path].zeros >= math.floor(s2.params[path].numel / 2), path .. ": still pruned after 10 steps")
end

-- a tied weight is pruned once: wte.weight IS head.weight, one path, one mask
local r = prune.magnitude(model, {params = "^wte%.weight$", sparsity = 0.3})
check(r.pruned == math.floor(0.3 * 32 * 32 + 0.5), "the tie is pruned once")
local s3 = sparsity(model)
check(s3.params["head.weight"] == nil, "a tied weight is listed once")
check(s3.params["wte.weight"].zeros >= r.pruned, "wte.weight pruned")
local ma, mb = fsdp.mask(model.head.weight), fsdp.mask(model.wte.weight)
local same = ma ~= nil and mb ~= nil
if same then
  local ta, tb = ma:view{ma:numel()}:totable(), mb:view{mb:numel()}:totable()
  for i = 1, #ta do same = same and ta[i] == tb[i] end
end
check(same, "head and wte share one mask")

-- ---- control: without masks the zeros regrow ---------------------------------------------------
local control, csaved = build()
prune_session(control, csaved, false)
local c1 = sparsity(control)
train(control, 10)
local c2 = sparsity(control)
local path = csaved[1].path .. ".weight"
check(c1.params[path].zeros >= c1.params[path].numel / 2, "control: the shards changed")
check(c2.params[path].zeros < c1.params[path].numel / 10, "control: without masks the zeros regrow")

if C.failures() > 0 then error(("%d checks failed on rank %d"):format(C.failures(), rank), 0) end
print(("rank %d: %d layers pruned through saved and fresh references; %.1f%% of the model zero after 10 steps; masked weights exactly 0"):format(
  rank, #saved, 100 * s2.sparsity))
