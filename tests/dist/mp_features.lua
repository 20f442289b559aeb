-- Mixed precision with the rest of fsdp (tests/recipes/dist_mp.sh), at any world size; every
-- check on every rank. A GPT (tie = true) wrapped with mp = "bf16" unless said otherwise.
--   * dtypes: u:dtypes() sharded / gathered for compute / in full_params; a parameter is bf16
--     inside its unit's forward, f32 (its master) otherwise; the model's output is f32
--   * training (AdamW, four batches in turn): the loss decreases over 40 steps and stays within
--     0.1 of the f32 run's at every step (bf16, f16, bf16 with reduce bf16; figures printed)
--   * masks: set_mask before wrapping and prune.magnitude on the wrapped model: masked weights
--     exactly 0 in the f32 masters and in the bf16 parameters the forward sees; set_mask between
--     a forward and its backward masks the live bf16 parameters (full and none)
--   * ties: head.weight IS wte.weight (one object, one storage in forward and in full_params,
--     one layout entry), and its one gradient holds both uses (against an f32 plain model)
--   * full_params / apply: f32 values equal to the masters, writeback of values bf16 cannot
--     hold, called between a forward and its backward the gradients are unchanged (bits);
--     u:writeback() of a unit gathered in bf16 is refused
--   * unwrap: f32 dense parameters holding the masters (not rounded); re-wrap with another mp
--     ({param = "f16", reduce = "bf16"}), and without (the f32 model's outputs, bitwise)
--   * an inner wrap with its own mp absorbed by an outer one (bf16 block in an f32 model and the
--     reverse): the units keep their dtypes, casts at their boundaries, training works
--   * sync_module_states and meta init with mp: the eager model's values (bits)
--   * reduce = "bf16": gradient shards hold bf16 values; reduce = "f32" at several ranks does not
--   * errors: bad mp options name the option and leave the model plain; ranks with different
--     policies fail the wrap agreement, naming them; the unit's own checks
--   * f32 token ids: cast to bf16 like any floating input; exact below 257 (the same logits as
--     i64 ids), rounded above (257 reads row 256): what happens now, pending a decision
--   fsdprun -n N tests/dist/mp_features.lua
local fsdp = require "fsdp"
require "fsdp.meta"
local nn = fsdp.nn
local core = fsdp.core
local W, rank = fsdp.world_size(), fsdp.rank()

local C = dofile("tests/dist/common.lua")
local check, flat, same = C.check, C.flat, C.same

local function say(...) if rank == 0 then print(...) end end
local BLOCK = fsdp.policy.modules{nn.Block}
local CFG = {vocab = 32, ctx = 8, d = 16, layers = 2, heads = 2}

local function gpt(seed, over)
  fsdp.manual_seed(seed or 3)
  local c = {}
  for k, v in pairs(CFG) do c[k] = v end
  for k, v in pairs(over or {}) do c[k] = v end
  return nn.GPT(c)
end

local function wrap(m, mp, strategy)
  return fsdp.wrap(m, {policy = BLOCK, mp = mp, strategy = strategy or "full"})
end

-- this rank's rows of a 4-row global batch (a formula), i64 ids
local ROWS = 4
assert(ROWS % W == 0, "4 rows must divide among the ranks")
local function batch(step)
  local x, y = {}, {}
  for i = rank * ROWS / W + 1, (rank + 1) * ROWS / W do
    local xi, yi = {}, {}
    for t = 1, CFG.ctx do
      local v = (i * 7 + t * 3 + step * 5 + (i * t) % 5) % 32
      xi[t], yi[t] = v, (v * 3 + t) % 32
    end
    x[#x + 1], y[#y + 1] = xi, yi
  end
  return fsdp.tensor(x, {dtype = "i64"}), fsdp.tensor(y, {dtype = "i64"})
end

local function step(model, opt, s)
  local x, y = batch(s)
  opt:zero_grad()
  local loss = nn.F.cross_entropy(model(x), y)
  loss:backward()
  opt:step()
  return fsdp.all_reduce(loss:item(), "mean")
end

-- {path = flat f32 values} of the whole model (collective when wrapped)
local function values(model)
  return fsdp.full_params(model, function(m)
    local out = {}
    for path, p in m:named_parameters() do
      check(p:dtype() == "f32", "full_params shows " .. path .. " in f32 (got " .. p:dtype() .. ")")
      out[path] = flat(p:detach())
    end
    return out
  end, {writeback = false})
end

local function same_values(a, b, what)
  local n = 0
  for path, va in pairs(a) do
    n = n + 1
    check(b[path] ~= nil and same(va, b[path]), what .. ": " .. path)
  end
  for path in pairs(b) do check(a[path] ~= nil, what .. ": unexpected " .. path) end
  check(n > 0, what .. ": no parameters")
end

-- how many values bf16 cannot hold exactly (masters are f32, not rounded)
local function not_bf16(vals)
  local n = 0
  for _, v in pairs(vals) do
    local r = flat(fsdp.tensor(v):to("bf16"):to("f32"))
    for i = 1, #v do if r[i] ~= v[i] then n = n + 1 end end
  end
  return n
end

local function errs(fn)
  local ok, err = pcall(fn)
  return not ok, tostring(err)
end

-- ---- dtypes ----------------------------------------------------------------------------------
do
  local m = wrap(gpt(), "bf16")
  for _, u in ipairs(fsdp.units(m)) do
    local d = u:dtypes()
    check(d.param == "bf16" and d.reduce == "f32" and d.gathered == nil,
      ("unit %s sharded: dtypes %s/%s/%s"):format(u.path, d.param, d.reduce, tostring(d.gathered)))
  end
  local seen = {}
  m.blocks[1].mlp:register_forward_pre_hook(function(mod) seen.fc = mod.fc.weight:dtype() end)
  m.ln_f:register_forward_pre_hook(function(mod, x) seen.ln_f, seen.ln_in = mod.weight:dtype(), x:dtype() end)
  local x, y = batch(1)
  local out = m(x)
  check(seen.fc == "bf16" and seen.ln_f == "bf16" and seen.ln_in == "bf16",
    ("compute in bf16: fc %s, ln_f %s, its input %s"):format(tostring(seen.fc), tostring(seen.ln_f), tostring(seen.ln_in)))
  check(out:dtype() == "f32", "the output is cast to f32, got " .. out:dtype())
  check(m.blocks[1].mlp.fc.weight:dtype() == "f32", "a sharded parameter reads as its f32 master")
  local root = fsdp.units(m)[1]
  check(root.path == "(root)" and root:dtypes().gathered == "bf16", "the root stays gathered in bf16 after forward")
  fsdp.full_params(m, function()
    for _, u in ipairs(fsdp.units(m)) do
      check(u:dtypes().gathered == "f32", "in full_params unit " .. u.path .. " is gathered in f32")
    end
  end, {writeback = false})
  -- the root stays gathered (in f32 now) after full_params: writeback of f32 values is fine
  check(not errs(function() root:writeback() end), "writeback of a unit gathered in f32 works")
  local loss = nn.F.cross_entropy(m(x), y)
  local bad, msg = errs(function() root:writeback() end)
  check(bad and msg:find("gathered in bf16 for compute", 1, true) ~= nil,
    "writeback of a unit gathered in bf16 is refused: " .. msg)
  loss:backward()
  say("ok: dtypes: bf16 inside forward, f32 masters outside, f32 in full_params and output")
end

-- ---- training ----------------------------------------------------------------------------------
local function train_curve(m, steps)
  local opt = fsdp.optim.AdamW(m, {lr = 1e-2, weight_decay = 0.01})
  local out = {}
  for s = 1, steps do out[s] = step(m, opt, (s - 1) % 4 + 1) end -- four batches in turn
  return out
end
local function curve(mp, steps) return train_curve(wrap(gpt(11), mp), steps) end
-- the largest relative difference of two loss curves
local function curve_diff(a, b)
  local worst = 0
  for s = 1, #b do worst = math.max(worst, math.abs(a[s] - b[s]) / b[s]) end
  return worst
end
local ref_curve = curve(nil, 40) -- f32
do
  local steps = 40
  local ref = ref_curve
  for _, mp in ipairs{"bf16", "f16", {param = "bf16", reduce = "bf16"}} do
    local l = curve(mp, steps)
    local worst = curve_diff(l, ref)
    local first, last = (l[1] + l[2] + l[3]) / 3, (l[steps - 2] + l[steps - 1] + l[steps]) / 3
    local name = type(mp) == "table" and "bf16 reduce bf16" or mp
    check(last < 0.8 * first, ("%s trains: loss %.4f -> %.4f"):format(name, first, last))
    check(worst < 0.1, ("%s stays close to f32: max rel diff %.3g"):format(name, worst))
    say(("ok: %s trains: loss %.4f -> %.4f over %d steps, max rel diff to f32 %.2g (f32 %.4f -> %.4f)")
      :format(name, first, last, steps, worst, ref[1], ref[steps]))
  end
end

-- ---- masks -------------------------------------------------------------------------------------
for _, strategy in ipairs{"full", "none"} do
  local m = gpt(5)
  local w1, w2 = m.blocks[1].mlp.fc.weight, m.wpe.weight
  local want = {}
  for i, p in ipairs{w1, w2} do
    local v = {}
    for j = 1, p:numel() do v[j] = ((j * 13 + i * 7) % 5 < 2) and 0 or 1 end
    want[p] = v
    fsdp.set_mask(p, fsdp.tensor(v):view(p:shape()))
  end
  wrap(m, "bf16", strategy)
  local bad_live = 0
  local function count_live(p)
    local v = flat(p:detach():to("f32"))
    for j = 1, #v do if want[p][j] == 0 and v[j] ~= 0 then bad_live = bad_live + 1 end end
  end
  m.blocks[1].mlp:register_forward_pre_hook(function(mod)
    check(mod.fc.weight:dtype() == "bf16", "the masked weight is bf16 in forward")
    count_live(mod.fc.weight)
  end)
  m:register_forward_hook(function() count_live(w2) end)
  local opt = fsdp.optim.AdamW(m, {lr = 5e-2})
  for s = 1, 4 do step(m, opt, s) end
  -- magnitude pruning on the wrapped bf16 model
  fsdp.prune.magnitude(m, {params = "attn%.qkv%.weight", sparsity = 0.5})
  local w3 = m.blocks[2].attn.qkv.weight
  want[w3] = flat(fsdp.mask(w3))
  m.blocks[2].attn:register_forward_pre_hook(function(mod) count_live(mod.qkv.weight) end)
  for s = 5, 8 do step(m, opt, s) end
  check(bad_live == 0, ("%s: %d masked weights nonzero in the bf16 parameters of a forward"):format(strategy, bad_live))
  local vals = values(m)
  local paths = {[w1] = "blocks.1.mlp.fc.weight", [w2] = "wpe.weight", [w3] = "blocks.2.attn.qkv.weight"}
  local zeros = 0
  for p, path in pairs(paths) do
    local v = vals[path]
    for j = 1, #v do
      if want[p][j] == 0 then
        zeros = zeros + 1
        check(v[j] == 0, ("%s: masked %s[%d] is %g in the f32 master"):format(strategy, path, j, v[j]))
      end
    end
  end
  check(zeros > 0 and not_bf16(vals) > 0, strategy .. ": masked zeros counted, masters are f32")
  -- set_mask between a forward and its backward: the root's live bf16 parameter is masked too
  local x, y = batch(9)
  local loss = nn.F.cross_entropy(m(x), y)
  local wte = m.wte.weight
  local v = {}
  for j = 1, wte:numel() do v[j] = (j % 3 == 0) and 0 or 1 end
  want[wte] = v
  fsdp.set_mask(wte, fsdp.tensor(v):view(wte:shape()))
  check(wte:dtype() == "bf16", strategy .. ": the root is still gathered in bf16")
  bad_live = 0
  count_live(wte)
  check(bad_live == 0, ("%s: set_mask between forward and backward: %d live bf16 weights not masked")
    :format(strategy, bad_live))
  loss:backward()
  say(("ok: masks (%s): %d masked weights 0 in the f32 masters and in every bf16 forward; set_mask "
    .. "between forward and backward masks the live bf16 parameter"):format(strategy, zeros))
  fsdp.unwrap(m)
end

-- ---- ties --------------------------------------------------------------------------------------
do
  local m = gpt(7)
  local ref = gpt(7)
  check(rawequal(m.head.weight, m.wte.weight), "tied before wrapping")
  wrap(m, "bf16")
  check(rawequal(m.head.weight, m.wte.weight), "tied after wrapping")
  local ties = fsdp.ties(m)
  check(#ties == 1 and ties[1].paths[1] == "wte.weight" and ties[1].paths[2] == "head.weight", "fsdp.ties")
  local root = fsdp.units(m)[#fsdp.units(m)]
  local entries = 0
  for _, l in ipairs(root:layout()) do
    if l.path == "wte.weight" then entries = entries + 1 end
    check(l.path ~= "head.weight", "head.weight has no layout entry of its own")
  end
  check(entries == 1, "one layout entry for the tied parameter")
  local shared = nil
  m.head:register_forward_pre_hook(function(mod)
    shared = mod.weight:dtype() == "bf16" and core.same_storage(mod.weight, m.wte.weight)
  end)
  -- one gradient with both uses: the gradient shard against an f32 plain model's gradient
  local x, y = batch(1)
  nn.F.cross_entropy(m(x), y):backward()
  check(shared == true, "in forward head.weight is the bf16 wte.weight (one storage)")
  local xs, ys = {}, {}
  for s = 0, W - 1 do -- the whole global batch on the plain model
    local rows = ROWS / W
    for i = s * rows + 1, (s + 1) * rows do
      local xi, yi = {}, {}
      for t = 1, CFG.ctx do
        local v = (i * 7 + t * 3 + 5 + (i * t) % 5) % 32
        xi[t], yi[t] = v, (v * 3 + t) % 32
      end
      xs[#xs + 1], ys[#ys + 1] = xi, yi
    end
  end
  nn.F.cross_entropy(ref(fsdp.tensor(xs, {dtype = "i64"})), fsdp.tensor(ys, {dtype = "i64"})):backward()
  local g = flat(ref.wte.weight.grad)
  local num, den = 0, 0
  local gs = root:grad_shard()
  for _, s in ipairs(root:local_slices()) do
    if rawequal(s.param, m.wte.weight) then
      local mine = flat(gs:narrow(1, s.shard_first, s.shard_last - s.shard_first + 1))
      for k = 1, #mine do
        local r = g[s.param_first + k - 1]
        num, den = num + (mine[k] - r) ^ 2, den + r ^ 2
      end
    end
  end
  num, den = fsdp.all_reduce(num, "sum"), fsdp.all_reduce(den, "sum")
  local rel = math.sqrt(num / den)
  check(rel < 2e-2, ("the tied gradient holds both uses: rel diff to f32 %.3g"):format(rel))
  local opt = fsdp.optim.SGD(m, {lr = 0.1})
  for s = 2, 4 do step(m, opt, s) end
  fsdp.full_params(m, function(mm)
    check(core.same_storage(mm.head.weight, mm.wte.weight), "one storage in full_params")
  end, {writeback = false})
  fsdp.unwrap(m)
  check(rawequal(m.head.weight, m.wte.weight) and m.wte.weight:dtype() == "f32", "tied and f32 after unwrap")
  say(("ok: ties: one parameter, one storage, one layout entry; its gradient vs f32 %.2g"):format(rel))
end

-- ---- full_params, apply, unwrap, re-wrap -------------------------------------------------------
for _, strategy in ipairs{"full", "grad_op", "none"} do
  local function trained()
    local m = wrap(gpt(13), "bf16", strategy)
    local opt = fsdp.optim.SGD(m, {lr = 0.1, momentum = 0.9})
    for s = 1, 3 do step(m, opt, s) end
    return m
  end
  local m = trained()
  local before = values(m)
  check(not_bf16(before) > 0, strategy .. ": the masters hold values bf16 cannot")
  -- every rank's shard slices are the values full_params shows
  for _, u in ipairs(fsdp.units(m)) do
    local shard = flat(u:shard())
    for _, s in ipairs(u:local_slices()) do
      local v = before[s.path]
      for k = 0, s.shard_last - s.shard_first do
        if shard[s.shard_first + k] ~= v[s.param_first + k] then
          check(false, ("%s: full_params value of %s differs from the shard"):format(strategy, s.path))
          break
        end
      end
    end
  end
  -- writeback of values bf16 cannot hold
  fsdp.full_params(m, function(mm) mm.blocks[1].mlp.fc.bias:fill(0.1) end)
  fsdp.apply(m, function(mod, path)
    if path == "blocks.2.ln1" then
      check(mod.weight:dtype() == "f32", "apply shows f32")
      mod.weight:fill(1 / 3)
    end
  end)
  local after = values(m)
  for _, v in ipairs(after["blocks.1.mlp.fc.bias"]) do check(v == fsdp.tensor{0.1}:item(), strategy .. ": writeback f32 0.1") end
  for _, v in ipairs(after["blocks.2.ln1.weight"]) do check(v == fsdp.tensor{1 / 3}:item(), strategy .. ": apply writeback f32 1/3") end
  -- between a forward and its backward: the same gradients
  local function grads(between)
    local mm = wrap(gpt(17), "bf16", strategy)
    local x, y = batch(1)
    local loss = nn.F.cross_entropy(mm(x), y)
    if between then
      fsdp.full_params(mm, function() end)
      fsdp.apply(mm, function() end)
      fsdp.full_params(mm, function() end, {writeback = false})
    end
    loss:backward()
    local out = {}
    for i, u in ipairs(fsdp.units(mm)) do
      out[i] = flat(u:grad_shard())
      check(u:state() == (strategy == "none" and "gathered" or "sharded") and u:dtypes().gathered ~= "bf16",
        strategy .. ": after backward unit " .. u.path .. " holds no bf16 copy")
    end
    return out
  end
  local g0, g1 = grads(false), grads(true)
  local same_g = #g0 == #g1
  for i = 1, #g0 do same_g = same_g and same(g0[i], g1[i]) end
  check(same_g, strategy .. ": full_params/apply between forward and backward leave the gradients unchanged")
  -- unwrap: dense f32 parameters holding the masters
  fsdp.unwrap(m)
  for path, p in m:named_parameters() do
    check(p:dtype() == "f32" and p.device == "cpu", strategy .. ": unwrapped " .. path .. " is dense f32")
    check(same(flat(p:detach()), after[path]), strategy .. ": unwrapped " .. path .. " holds the master")
  end
  -- re-wrap with another policy
  wrap(m, {param = "f16", reduce = "bf16"}, strategy)
  for _, u in ipairs(fsdp.units(m)) do
    local d = u:dtypes()
    check(d.param == "f16" and d.reduce == "bf16", strategy .. ": re-wrapped with f16/bf16")
  end
  same_values(values(m), after, strategy .. ": re-wrap keeps the values")
  local opt = fsdp.optim.SGD(m, {lr = 0.1})
  step(m, opt, 4)
  local f16vals = values(m)
  -- and without mp: the f32 model's outputs, bit for bit
  fsdp.unwrap(m)
  local x = batch(5)
  local plain = flat(fsdp.no_grad(function() return m(x) end))
  wrap(m, nil, strategy)
  check(fsdp.units(m)[1]:dtypes().param == "f32", "re-wrapped without mp")
  check(same(flat(fsdp.no_grad(function() return m(x) end)), plain), strategy .. ": f32 re-wrap gives the plain outputs")
  same_values(values(m), f16vals, strategy .. ": f32 re-wrap keeps the values")
  fsdp.unwrap(m)
  say(("ok: full_params/apply/unwrap/re-wrap (%s): f32 masters, writeback exact, gradients unchanged "
    .. "when called between forward and backward"):format(strategy))
end

-- ---- an inner wrap with its own policy, absorbed -----------------------------------------------
for _, case in ipairs{{inner = "bf16", outer = nil}, {inner = nil, outer = "bf16"}} do
  local m = gpt(11)
  fsdp.wrap(m.blocks[1], {mp = case.inner})
  wrap(m, case.outer)
  local want = {["blocks.1"] = case.inner or "f32", ["blocks.2"] = case.outer or "f32", ["(root)"] = case.outer or "f32"}
  for _, u in ipairs(fsdp.units(m)) do
    check(u:dtypes().param == want[u.path], ("absorbed: unit %s has param %s, expected %s")
      :format(u.path, u:dtypes().param, want[u.path]))
  end
  local seen = {}
  m.blocks[1].mlp:register_forward_pre_hook(function(mod, x) seen.b1 = mod.fc.weight:dtype() .. "/" .. x:dtype() end)
  m.blocks[2].mlp:register_forward_pre_hook(function(mod, x) seen.b2 = mod.fc.weight:dtype() .. "/" .. x:dtype() end)
  m.ln_f:register_forward_pre_hook(function(mod, x) seen.ln_f = mod.weight:dtype() .. "/" .. x:dtype() end)
  local l = train_curve(m, 20)
  for k, dt in pairs{b1 = want["blocks.1"], b2 = want["blocks.2"], ln_f = want["(root)"]} do
    check(seen[k] == dt .. "/" .. dt, ("absorbed: %s computes in %s (got %s)"):format(k, dt, tostring(seen[k])))
  end
  local ref = {unpack(ref_curve, 1, 20)}
  local worst = curve_diff(l, ref)
  local name = ("inner %s, outer %s"):format(case.inner or "f32", case.outer or "f32")
  local first, last = (l[1] + l[2] + l[3] + l[4]) / 4, (l[17] + l[18] + l[19] + l[20]) / 4
  check(last < 0.9 * first and worst < 0.1, ("absorbed (%s) trains like f32: %.4f -> %.4f, max rel diff %.3g")
    :format(name, first, last, worst))
  say(("ok: an inner wrap absorbed (%s): casts at the unit boundaries, loss %.4f -> %.4f, max rel diff to f32 %.2g")
    :format(name, first, last, worst))
  fsdp.unwrap(m)
end

-- ---- sync_module_states and meta init ----------------------------------------------------------
do
  local eager = values(gpt(23))
  local m = rank == 0 and gpt(23) or fsdp.meta(function() return gpt(29) end)
  fsdp.wrap(m, {policy = BLOCK, mp = "bf16", sync_module_states = true})
  same_values(values(m), eager, "sync_module_states with mp gives rank 0's values")
  local opt = fsdp.optim.SGD(m, {lr = 0.1})
  step(m, opt, 1)
  fsdp.unwrap(m)
  local mm = fsdp.meta(function() return gpt(23) end)
  fsdp.wrap(mm, {policy = BLOCK, mp = "bf16", init = true})
  same_values(values(mm), eager, "meta + wrap{init = true, mp} gives the eager values")
  step(mm, fsdp.optim.SGD(mm, {lr = 0.1}), 1)
  local m3 = fsdp.meta(function() return gpt(23) end)
  wrap(m3, "bf16")
  fsdp.materialize(m3)
  same_values(values(m3), eager, "meta + wrap{mp} + materialize gives the eager values")
  say("ok: sync_module_states and meta init with mp: the eager model's values")
end

-- ---- reduce = "bf16" ---------------------------------------------------------------------------
do
  for _, reduce in ipairs{"bf16", "f32"} do
    local m = wrap(gpt(31), {param = "bf16", reduce = reduce})
    local x, y = batch(1)
    nn.F.cross_entropy(m(x), y):backward()
    local n, off = 0, 0
    for _, u in ipairs(fsdp.units(m)) do
      local g = flat(u:grad_shard())
      local r = flat(u:grad_shard():to("bf16"):to("f32"))
      for k = 1, #g do
        n = n + 1
        if g[k] ~= r[k] then off = off + 1 end
      end
    end
    off = fsdp.all_reduce(off, "sum")
    if reduce == "bf16" then
      check(off == 0, ("reduce bf16: %d gradient values bf16 cannot hold"):format(off))
    elseif W > 1 then
      check(off > 0, "reduce f32 at several ranks: averages of bf16 gradients are f32 values")
    end
    say(("ok: reduce %s: %d of the gradient shard values are not bf16 values"):format(reduce, off))
  end
end

-- ---- errors ------------------------------------------------------------------------------------
do
  for _, case in ipairs{
    {mp = "f64", has = "mp.param must be \"f32\", \"bf16\" or \"f16\" (got f64)"},
    {mp = {param = "i64"}, has = "mp.param must be \"f32\", \"bf16\" or \"f16\" (got i64)"},
    {mp = {bogus = 1}, has = "unknown mp option bogus (param, reduce, output)"},
    {mp = {reduce = "f16"}, has = "mp.reduce must be \"f32\" or \"bf16\" (got f16)"},
    {mp = {output = "i64"}, has = "mp.output must be \"f32\", \"bf16\" or \"f16\" (got i64)"},
    {mp = 3, has = "mp must be \"bf16\", \"f16\" or a table {param =, reduce =, output =} (got number)"},
  } do
    local m = gpt(1)
    local bad, err = errs(function() wrap(m, case.mp) end)
    check(bad and err:find("fsdp.wrap: " .. case.has, 1, true) ~= nil, "error: " .. err)
    check(not fsdp.is_wrapped(m) and m.wte.weight.device == "cpu", "the model stays plain after: " .. case.has)
  end
  -- the unit's own checks (the binding's primitives), collective like its layout check
  for _, case in ipairs{
    {opts = {param_dtype = "f64"}, has = "parameters cannot be gathered as f64"},
    {opts = {param_dtype = "i64"}, has = "parameters cannot be gathered as i64"},
    {opts = {reduce_dtype = "f16"}, has = "gradients cannot be reduced in f16"},
  } do
    local lin = nn.Linear(4, 4)
    local bad, err = errs(function() core.unit_new("u", {lin.weight, lin.bias}, {"weight", "bias"}, case.opts) end)
    check(bad and err:find(case.has, 1, true) ~= nil, "unit_new error: " .. err)
    check(lin.weight.device == "cpu" and core.param_unit(lin.weight) == nil, "unit_new left the parameters alone")
  end
  -- ranks with different policies: the wrap agreement names it, on every rank, before any
  -- collective of the units (not a collective mismatch at the first forward)
  if W > 1 then
    local m = gpt(1)
    local bad, err = errs(function() wrap(m, rank == W - 1 and "bf16" or nil) end)
    local want = ("rank %d has unit 'blocks.1' with mp param bf16, reduce f32, output f32"):format(W - 1)
    check(bad and err:find("the model differs across ranks", 1, true) ~= nil and err:find(want, 1, true) ~= nil,
      "different policies across ranks: " .. err)
    check(not fsdp.is_wrapped(m) and m.wte.weight.device == "cpu", "the model stays plain after a disagreement")
  end
  say("ok: bad mp options, policies that differ across ranks and unit dtypes are errors naming "
    .. "them; the model stays plain")
end

-- ---- f32 token ids -----------------------------------------------------------------------------
-- The unit's input cast turns floating ids into bf16, which holds integers exactly only to 256:
-- the embedding refuses bf16 ids (naming the cause and the fix) rather than read rounded rows.
do
  local m = wrap(gpt(37, {vocab = 300}), "bf16")
  local function logits(ids, dtype)
    return flat(fsdp.no_grad(function() return m(fsdp.tensor(ids, {dtype = dtype})) end))
  end
  local ids = {{0, 1, 100, 255, 256, 257, 299, 31}}
  check(#logits(ids, "i64") == 8 * 300, "i64 ids are looked up as they are")
  local bad, err = errs(function() logits(ids, "f32") end)
  check(bad and err:find("embedding: ids are bf16", 1, true) ~= nil and
    err:find("give it i64 ids", 1, true) ~= nil, "f32 ids are refused once cast: " .. tostring(err))
  say("ok: token ids: i64 ids work; f32 ids, cast to bf16 by the input cast, are refused with a "
    .. "message naming the fix")
  fsdp.unwrap(m)
end

if C.failures() > 0 then error(("%d mixed-precision checks failed"):format(C.failures())) end
say(("all mixed-precision feature checks passed at %d rank(s)"):format(W))
