-- fsdp.prune — magnitude, N:M and scheduled pruning on shards.
-- docs/pruning.md is the manual.
--
--   prune.magnitude(model, {params =, exclude =, sparsity =, scope = "param" | "global"})
--   prune.nm(model, {params =, exclude =, n = 2, m = 4})
--   prune.schedule{ modifier, ... } -> s;  s:step(model, step)
--   prune.report(model, {params =, exclude =}) -> report (tostring: a table; report:json())
--
-- All of them are collective when the model is wrapped, and none gathers a unit: each rank
-- works on its own slices of the weights (u:local_slices()) and the ranks agree through a few
-- all_reduce calls of histograms. Before any of that, the ranks agree on the call itself (one
-- all_reduce of five numbers, `agreed` below): every rank's checks of its arguments and of the
-- gathered copies it would refresh, and the arguments that decide the masks; a refusal on one
-- rank fails every rank alike, before anything is pruned.
--
-- Magnitude: a group (one parameter for scope "param", every selected parameter for "global")
-- loses exactly k = floor(sparsity * numel + 0.5) elements: those with the smallest keys, where
-- a masked element's key is below every live one and a live element's key is its magnitude;
-- equal keys go by global position (the parameter's rank in the selection, then the flat
-- index), so the chosen elements are the same at any world size. The k-th key is found by
-- radix selection: three passes of 11/11/10 bits, each one histogram per group and one
-- all_reduce of all groups' histograms together; when only part of the elements equal to that
-- key are to go, three more passes select the cut-off position the same way (fsdp_prune_select,
-- src/fsdp/mask.c, through the kernel table). Cost: at most 6 all_reduce calls of G * 16 KiB
-- (G groups), plus two passes over the local shard per call, whatever the model size.
--
-- N:M: along the last dimension (a Linear weight's input dimension) each group of m consecutive
-- weights keeps its n largest (the m - n smallest go, in the order of magnitude pruning: masked
-- first, then by magnitude, equal magnitudes lower index first). A shard boundary can
-- fall inside a group when m does not divide the flat layout's alignment (16 elements): such
-- cut groups are listed from the unit layout (the same list on every rank), each rank puts the
-- values it holds of them into one buffer, one all_reduce("sum") assembles them, and every rank
-- decides those groups from the whole group. No alignment of the layout is needed.

local core = require "fsdp.core"
local collective_m = require "fsdp.collective"
local mask = require "fsdp.mask"
local state = require "fsdp.state"
local util = require "fsdp.util"

local prune = {}

local raise = util.raise

local ROLE = {role = "other"}

-- ---- this rank's pieces of the selected parameters --------------------------------------------

-- For each selected entry: e.unit (nil for a plain parameter), e.numel, e.shape and e.piece =
-- {x = 1-D view of the weights this rank holds (shard slice or whole parameter; an f32 copy of a
-- bf16/f16 plain parameter, which is then target), m = current
-- mask values (nil: none), first = 1-based position of x[1] in the parameter, n =, counts =
-- false when another rank counts the same elements (replicated units: rank 0 counts; hybrid:
-- the first group)} or nil
-- when the rank holds no element. Returns entries.
local function pieces(model, entries, fn)
  state.check_values(model, fn)
  local shards = {} -- unit -> its shard tensor (one per unit)
  for _, e in ipairs(entries) do
    local p = e.param
    e.numel, e.shape = p:numel(), p:shape()
    local u = core.param_unit(p)
    e.unit = u
    if u == nil then
      if p.device ~= "cpu" then
        raise(("%s: %s is on the %s device: materialize the model first"):format(fn, e.path, p.device))
      end
      local x = p:detach():view{e.numel}
      local dt = x:dtype()
      -- the selection's kernels compute in f32; a plain parameter moved to bf16 or f16
      -- (model:to) is selected on an f32 copy, exact and in the same order, and masked itself
      -- (target); f64 would round its magnitudes, so it is refused
      if dt ~= "f32" and dt ~= "bf16" and dt ~= "f16" then
        raise(("%s: %s is %s: pruning selects in f32, bf16 or f16 (model:to(\"f32\") first)")
          :format(fn, e.path, dt))
      end
      e.piece = {x = dt == "f32" and x or x:to("f32"), target = dt ~= "f32" and x or nil,
        m = mask.piece(p), first = 1, n = e.numel, counts = true}
    else
      local s = util.local_slice(u, p)
      if s ~= nil then
        local n = s.shard_last - s.shard_first + 1
        shards[u] = shards[u] or u:shard()
        e.piece = {x = shards[u]:narrow(1, s.shard_first, n), m = mask.piece(p), first = s.param_first,
          n = n, shard_first = s.shard_first, counts = util.counts_shard(u)}
      end
    end
  end
  return entries
end

-- A buffer for the new mask values of a piece: the current mask's own buffer when the values
-- can be computed in place (element i read before it is written: mask_select,
-- mask_from_nonzero), else a new one.
local function out_buffer(pc, in_place)
  if in_place and pc.m ~= nil then return pc.m end
  return core.ones({pc.n}, {role = ROLE.role, device = pc.x.device}) -- where the weights are
end

-- Store the new mask of entry e (values `mout` for its piece, or nil when it has none) and mask
-- the weights.
local function store(e, mout)
  local p = e.param
  if not (mask.has(p) and rawequal(mask.piece(p), mout)) then mask.adopt(p, e.unit, e.path, mout) end
  if mout ~= nil then
    core.mask_apply(e.piece.x, mout)
    if e.piece.target ~= nil then mask.apply_flat(e.piece.target, mout) end
  end
end

-- ---- agreeing before anything changes ---------------------------------------------------------

-- Whether some parameter of model belongs to a unit: the pruning functions are then collective
-- (the same answer on every rank: wrapping is collective).
local wrapped = mask.wrapped

-- A caught error of fn's checks as a bare message: without positions, and without "fn: " in
-- front (put back once, with the rank, when raised).
local function bare(err, fn)
  local msg, where = util.strip(err), util.user_where()
  if where ~= "" and msg:sub(1, #where) == where then msg = msg:sub(#where + 1) end
  if msg:sub(1, #fn + 2) == fn .. ": " then msg = msg:sub(#fn + 3) end
  return msg
end

-- Run check(), this rank's checks of a call of fn (it raises on bad arguments, and returns the
-- selected entries, with their pieces, and the value every rank must hold alike: the
-- arguments that decide the masks and the selected paths), and add this rank's refusal of a
-- gathered copy changed outside a walk holding it (mask.changed_copy: refreshing that unit
-- after pruning would fail on this rank only, or adopt the change). On a wrapped model the
-- ranks then agree (one all_reduce of five numbers): any rank's refusal, or a difference in
-- the values (a sparsity computed per rank, a selection that differs), raises on every rank
-- alike ("fn: rank R of W: <R's reason>"), before anything is pruned or recorded. Returns the
-- entries.
local function agreed(fn, model, check)
  local together = wrapped(model)
  local ok, entries, value = pcall(check)
  local err
  if not ok then
    err, entries = bare(entries, fn), nil
  else
    local seen = {}
    for _, e in ipairs(entries) do
      if e.unit ~= nil and not seen[e.unit] then
        seen[e.unit] = true
        err = err or mask.changed_copy(e.unit, e.path .. " (nothing pruned)")
      end
    end
  end
  if together then
    local msg = collective_m.check_agreement(fn, value, err, "what to prune", fn)
    if msg then raise(msg) end
  elseif err then
    raise(fn .. ": " .. err)
  end
  return entries
end

-- The selected paths, in selection order (part of what every rank must hold alike).
local function paths_of(entries)
  local out = {}
  for i, e in ipairs(entries) do out[i] = e.path end
  return out
end

-- Whether an entry is sharded (then the selection communicates).
local function any_sharded(entries)
  for _, e in ipairs(entries) do
    if e.unit ~= nil then return true end
  end
  return false
end

-- Gathered units of the entries get their full copies refreshed (collective, in entry order).
local function refresh_units(entries)
  local seen = {}
  for _, e in ipairs(entries) do
    if e.unit ~= nil and not seen[e.unit] then
      seen[e.unit] = true
      mask.refresh(e.unit)
    end
  end
end

local function check_sparsity(s, fn)
  if type(s) ~= "number" or s ~= s or s < 0 or s > 1 then
    raise(("%s: sparsity must be a number in [0, 1] (got %s)"):format(fn, tostring(s)))
  end
end

--- Collective when wrapped. Prune the selected parameters to `sparsity` by magnitude.
--- Returns {pruned =, numel =, params = {[path] = {numel =, pruned =}}} (pruned: this call's
--- mask zeros, the same on every rank).
function prune.magnitude(model, opts)
  local fn = "prune.magnitude"
  local scope, total
  local entries = agreed(fn, model, function()
    if type(opts) ~= "table" then
      raise(fn .. ": expects (model, {params =, sparsity =, scope =})")
    end
    util.check_opts(fn, opts, {"params", "exclude", "sparsity", "scope"})
    check_sparsity(opts.sparsity, fn)
    scope = opts.scope or "param"
    if scope ~= "param" and scope ~= "global" then
      raise(("%s: scope must be \"param\" or \"global\" (got %s)"):format(fn, tostring(scope)))
    end
    local list = pieces(model, util.select_params(model, opts, fn), fn)
    total = 0
    for _, e in ipairs(list) do total = total + e.numel end
    if total >= 2 ^ 33 then raise(fn .. ": more than 2^33 elements selected") end
    return list, {sparsity = opts.sparsity, scope = scope, params = paths_of(list)}
  end)
  local collective = any_sharded(entries)
  local groups = {}
  if scope == "global" then
    local g = {pieces = {}, numel = total}
    local gbase = 0
    for _, e in ipairs(entries) do
      if e.piece then
        e.piece.gbase = gbase + e.piece.first - 1
        g.pieces[#g.pieces + 1] = e.piece
      end
      gbase = gbase + e.numel
    end
    g.k = math.floor(opts.sparsity * total + 0.5)
    groups[1] = g
    for _, e in ipairs(entries) do e.group = g end
  else
    for i, e in ipairs(entries) do
      local g = {pieces = {}, numel = e.numel}
      if e.piece then
        e.piece.gbase = e.piece.first - 1
        g.pieces[1] = e.piece
      end
      g.k = math.floor(opts.sparsity * e.numel + 0.5)
      groups[i] = g
      e.group = g
    end
  end
  -- every group's k smallest (keys, then positions) as g.T and g.P (fsdp_prune_select)
  core.prune_select(groups, collective, fn)
  local res = {pruned = 0, numel = total, params = {}}
  for _, e in ipairs(entries) do
    local mout
    local z = 0
    if e.piece then
      mout = out_buffer(e.piece, true)
      z = core.mask_select(mout, e.piece.x, e.piece.m, e.group.T, e.piece.gbase, e.group.P)
    end
    store(e, mout)
    res.params[e.path] = {numel = e.numel, pruned = z}
  end
  -- the per-parameter counts are local until summed; the totals are known exactly
  for _, g in ipairs(groups) do res.pruned = res.pruned + g.k end
  if scope == "param" then
    for _, e in ipairs(entries) do res.params[e.path].pruned = e.group.k end
  else
    res.params = nil -- per-parameter figures: fsdp.sparsity(model)
  end
  refresh_units(entries)
  return res
end

-- ---- N:M ---------------------------------------------------------------------------------------

-- The groups of parameter e (0-based group numbers) that a rank boundary of its unit's layout
-- cuts, sorted: the same list on every rank.
local function cut_groups(e, m)
  local u = e.unit
  if u == nil or u:strategy() == "none" then return {} end
  local entry
  local ps = u:params()
  local layout = u:layout()
  for i = 1, #ps do
    if rawequal(ps[i], e.param) then entry = layout[i] break end
  end
  local set, list = {}, {}
  for r = 0, core.world_size() - 1 do
    local s = entry.slices[r]
    if s ~= nil then
      for _, b in ipairs{s[1] - 1, s[2]} do -- 0-based boundaries before element b
        if b > 0 and b < e.numel and b % m ~= 0 then
          local g = math.floor(b / m)
          if not set[g] then set[g] = true list[#list + 1] = g end
        end
      end
    end
  end
  table.sort(list)
  return list
end

--- Collective when wrapped. N:M sparsity: along the last dimension, every m consecutive weights
--- keep their n largest. Returns {groups =, cut_groups =} (cut_groups: groups split between
--- ranks, decided from the assembled group).
function prune.nm(model, opts)
  local fn = "prune.nm"
  local n, m
  local entries = agreed(fn, model, function()
    if type(opts) ~= "table" then raise(fn .. ": expects (model, {params =, n = 2, m = 4})") end
    util.check_opts(fn, opts, {"params", "exclude", "n", "m"})
    n, m = opts.n or 2, opts.m or 4
    if type(n) ~= "number" or type(m) ~= "number" or n % 1 ~= 0 or m % 1 ~= 0 or m < 1 or n < 0
        or n > m or m > 4096 then
      raise(("%s: need integers 0 <= n <= m <= 4096 (got n = %s, m = %s)")
        :format(fn, tostring(n), tostring(m)))
    end
    local list = pieces(model, util.select_params(model, opts, fn), fn)
    for _, e in ipairs(list) do
      local last = e.shape[#e.shape] or 1
      if last % m ~= 0 then
        raise(("%s: %s has shape (%s): its last dimension %d is not a multiple of m = %d")
          :format(fn, e.path, table.concat(e.shape, ", "), last, m))
      end
    end
    return list, {n = n, m = m, params = paths_of(list)}
  end)
  local collective = any_sharded(entries)
  -- full groups inside each piece
  local res = {groups = 0, cut_groups = 0}
  for _, e in ipairs(entries) do
    res.groups = res.groups + e.numel / m
    local pc = e.piece
    if pc then
      local a = pc.first - 1 -- 0-based start
      pc.lead = (m - a % m) % m
      pc.mout = core.ones({pc.n}, ROLE)
      core.mask_nm(pc.mout, pc.x, pc.m, n, m, pc.lead)
    end
  end
  -- cut groups: one buffer for all of them, one all_reduce
  local cuts = {}
  for _, e in ipairs(entries) do
    for _, g in ipairs(cut_groups(e, m)) do cuts[#cuts + 1] = {e = e, g = g} end
  end
  res.cut_groups = #cuts
  if #cuts > 0 then
    local buf = core.zeros{#cuts * m}
    for ci, c in ipairs(cuts) do
      local pc = c.e.piece
      if pc and pc.counts then -- (hybrid: the first group's copy)
        local a, lo = pc.first - 1, c.g * m
        local from, to = math.max(lo, a), math.min(lo + m, a + pc.n) -- [from, to) held here
        if to > from then
          core.mask_values(buf:narrow(1, (ci - 1) * m + (from - lo) + 1, to - from),
            pc.x:narrow(1, from - a + 1, to - from), pc.m and pc.m:narrow(1, from - a + 1, to - from))
        end
      end
    end
    if collective then core.all_reduce(buf, "sum", fn .. " cut groups") end
    local vals = buf:totable()
    for ci, c in ipairs(cuts) do
      local pc = c.e.piece
      if pc then
        local a, lo = pc.first - 1, c.g * m
        local from, to = math.max(lo, a), math.min(lo + m, a + pc.n)
        for i = from, to - 1 do
          local vi, above = vals[(ci - 1) * m + (i - lo) + 1], 0
          for j = lo, lo + m - 1 do
            local vj = vals[(ci - 1) * m + (j - lo) + 1]
            if j ~= i and (vj > vi or (vj == vi and j > i)) then above = above + 1 end
          end
          pc.mout:set(i - a + 1, above < n and 1 or 0)
        end
      end
    end
  end
  for _, e in ipairs(entries) do store(e, e.piece and e.piece.mout) end
  refresh_units(entries)
  return res
end

-- ---- constant: hold the zeros there are ------------------------------------------------------

--- Collective when wrapped (one all_reduce of five numbers: the ranks agree; then gathered
--- units are refreshed). The mask of each selected parameter becomes (weight ~= 0): its
--- current zeros are held from now on.
function prune.hold(model, opts)
  local fn = "prune.hold"
  local entries = agreed(fn, model, function()
    opts = util.check_opts(fn, opts, {"params", "exclude"})
    local list = pieces(model, util.select_params(model, opts, fn), fn)
    return list, {params = paths_of(list)}
  end)
  for _, e in ipairs(entries) do
    local mout
    if e.piece then
      mout = out_buffer(e.piece, true)
      core.mask_from_nonzero(mout, e.piece.x)
    end
    store(e, mout)
  end
  refresh_units(entries)
end

-- ---- schedules ----------------------------------------------------------------------------------

local Schedule = {}
Schedule.__index = Schedule

local kinds = {gmp = true, constant = true, oneshot = true, nm = true}
-- the keys each kind of modifier takes
local MOD_KEYS = {
  gmp = {"kind", "params", "exclude", "start", "stop", "every", "init", "final", "scope"},
  oneshot = {"kind", "params", "exclude", "at", "start", "sparsity", "scope"},
  nm = {"kind", "params", "exclude", "at", "start", "n", "m"},
  constant = {"kind", "params", "exclude", "start"},
}

local function num(mod, i, k, default, min)
  local v = mod[k]
  if v == nil then v = default end
  if type(v) ~= "number" or v ~= v or (min and v < min) then
    raise(("prune.schedule: modifier %d (%s): %s must be a number%s (got %s)")
      :format(i, tostring(mod.kind), k, min and (" >= " .. min) or "", tostring(mod[k])))
  end
  return v
end

--- The GMP sparsity at step t (Zhu & Gupta 2017): s_f + (s_i - s_f) (1 - p)^3 with
--- p = (t - start) / (stop - start) clamped to [0, 1].
function prune.gmp_sparsity(mod, t)
  local p = (t - mod.start) / (mod.stop - mod.start)
  p = math.max(0, math.min(1, p))
  return mod.final + (mod.init - mod.final) * (1 - p) ^ 3
end

--- schedule{ modifier, ... } -> s. Modifiers (params/exclude: patterns, see fsdp.util.select_params):
---   {kind = "gmp", params =, start =, stop =, every = 1, init = 0.05, final = 0.8, scope = "param"}
---   {kind = "oneshot", params =, at = (or start), sparsity =, scope = "param"}
---   {kind = "nm", params =, at = (or start), n = 2, m = 4}
---   {kind = "constant", params =, start = 0}      (hold the current zeros as masks)
--- s:step(model, step) once per optimizer step (collective when wrapped): runs what is due
--- at `step` and returns an array of what ran ({kind =, step =, sparsity =, ...}), or nil.
function prune.schedule(mods)
  if type(mods) ~= "table" or #mods == 0 then
    raise("prune.schedule: expects a list of modifiers, e.g. {{kind = \"gmp\", params = ..., "
      .. "start = 0, stop = 100, final = 0.8}}")
  end
  local s = setmetatable({mods = {}}, Schedule)
  for i, src in ipairs(mods) do
    if type(src) ~= "table" or not kinds[src.kind] then
      raise(("prune.schedule: modifier %d: kind must be \"gmp\", \"oneshot\", \"nm\" or "
        .. "\"constant\" (got %s)"):format(i, type(src) == "table" and tostring(src.kind) or type(src)))
    end
    util.check_opts(("prune.schedule: modifier %d (%s)"):format(i, src.kind), src, MOD_KEYS[src.kind])
    local mod = {kind = src.kind, params = src.params, exclude = src.exclude, index = i}
    util.patterns(src.params, "params", "prune.schedule") -- validates
    util.patterns(src.exclude, "exclude", "prune.schedule")
    if src.kind == "gmp" then
      mod.start = num(src, i, "start", 0, 0)
      mod.stop = num(src, i, "stop", nil, 0)
      if mod.stop <= mod.start then
        raise(("prune.schedule: modifier %d (gmp): stop (%s) must be after start (%s)")
          :format(i, tostring(mod.stop), tostring(mod.start)))
      end
      mod.every = num(src, i, "every", 1, 1)
      mod.init = num(src, i, "init", 0.05, 0)
      mod.final = num(src, i, "final", 0.8, 0)
      check_sparsity(mod.init, "prune.schedule: modifier " .. i .. " (gmp): init")
      check_sparsity(mod.final, "prune.schedule: modifier " .. i .. " (gmp): final")
      mod.scope = src.scope or "param"
      mod.next = mod.start
    elseif src.kind == "oneshot" then
      mod.at = num(src, i, "at", src.start or 0, 0)
      mod.sparsity = src.sparsity
      check_sparsity(mod.sparsity, "prune.schedule: modifier " .. i .. " (oneshot): sparsity")
      mod.scope = src.scope or "param"
    elseif src.kind == "nm" then
      mod.at = num(src, i, "at", src.start or 0, 0)
      mod.n = num(src, i, "n", 2, 0)
      mod.m = num(src, i, "m", 4, 1)
    else
      mod.at = num(src, i, "start", 0, 0)
    end
    if mod.scope ~= nil and mod.scope ~= "param" and mod.scope ~= "global" then
      raise(("prune.schedule: modifier %d: scope must be \"param\" or \"global\" (got %s)")
        :format(i, tostring(mod.scope)))
    end
    s.mods[i] = mod
  end
  return s
end

-- Check every modifier's patterns against the model (once): an error lists the parameters.
function Schedule:check(model)
  if self.checked == model then return end
  for _, mod in ipairs(self.mods) do
    local ok, err = pcall(util.select_params, model, mod, ("prune.schedule: modifier %d (%s)"):format(mod.index, mod.kind))
    if not ok then error(err, 0) end
  end
  self.checked = model
end

function Schedule:step(model, t)
  if type(t) ~= "number" then raise("schedule:step: expects (model, step)") end
  self:check(model)
  local ran
  local function did(ev)
    ran = ran or {}
    ev.step = t
    ran[#ran + 1] = ev
  end
  for _, mod in ipairs(self.mods) do
    if mod.kind == "gmp" then
      if not mod.done and t >= mod.next then
        local sp = prune.gmp_sparsity(mod, t)
        prune.magnitude(model, {params = mod.params, exclude = mod.exclude, sparsity = sp, scope = mod.scope})
        did{kind = "gmp", sparsity = sp, modifier = mod.index}
        if t >= mod.stop then
          mod.done = true
        else
          -- the next due step on the grid start + j * every, and the stop step itself
          local j = math.floor((t - mod.start) / mod.every) + 1
          mod.next = math.min(mod.start + j * mod.every, mod.stop)
        end
      end
    elseif not mod.done and t >= mod.at then
      mod.done = true
      if mod.kind == "oneshot" then
        prune.magnitude(model, {params = mod.params, exclude = mod.exclude, sparsity = mod.sparsity,
          scope = mod.scope})
        did{kind = "oneshot", sparsity = mod.sparsity, modifier = mod.index}
      elseif mod.kind == "nm" then
        prune.nm(model, {params = mod.params, exclude = mod.exclude, n = mod.n, m = mod.m})
        did{kind = "nm", n = mod.n, m = mod.m, modifier = mod.index}
      else
        prune.hold(model, {params = mod.params, exclude = mod.exclude})
        did{kind = "constant", modifier = mod.index}
      end
    end
  end
  return ran
end

--- The sparsity a GMP/oneshot modifier aims at after step t (for logs); nil for others.
function Schedule:target(t)
  local out = {}
  for _, mod in ipairs(self.mods) do
    if mod.kind == "gmp" then
      out[mod.index] = t < mod.start and 0 or prune.gmp_sparsity(mod, t)
    elseif mod.kind == "oneshot" then
      out[mod.index] = t < mod.at and 0 or mod.sparsity
    end
  end
  return out
end

-- ---- report -------------------------------------------------------------------------------------

local Report = {}
Report.__index = Report

--- Collective when wrapped (one all_reduce: fsdp.sparsity). A summary in the spirit of
--- SparseML's: total and prunable parameter counts (prunable: opts.params/exclude, default
--- every parameter with 2+ dimensions), their zeros, and per parameter numel and sparsity.
function prune.report(model, opts)
  opts = util.check_opts("prune.report", opts, {"params", "exclude"})
  local sp = mask.sparsity(model)
  local prunable = {}
  for _, e in ipairs(util.select_params(model, opts, "prune.report")) do prunable[e.path] = true end
  local r = setmetatable({total = sp.total, sparse = sp.zeros, prunable = 0, prunable_sparse = 0,
    params = {}, order = sp.order}, Report)
  for _, path in ipairs(sp.order) do
    local e = sp.params[path]
    r.params[path] = {numel = e.numel, zeros = e.zeros, sparsity = e.sparsity,
      prunable = prunable[path] == true, masked = e.masked}
    if prunable[path] then
      r.prunable = r.prunable + e.numel
      r.prunable_sparse = r.prunable_sparse + e.zeros
    end
  end
  r.sparsity = r.total > 0 and r.sparse / r.total or 0
  r.prunable_sparsity = r.prunable > 0 and r.prunable_sparse / r.prunable or 0
  return r
end

--- A plain table for JSON (fsdp.log metrics): {params_summary = {...}, params_info = {...}}.
function Report:json()
  local info = {}
  for path, e in pairs(self.params) do
    info[path] = {numel = e.numel, sparsity = e.sparsity, prunable = e.prunable}
  end
  return {
    params_summary = {total = self.total, sparse = self.sparse, sparsity_percent = 100 * self.sparsity,
      prunable = self.prunable, prunable_sparse = self.prunable_sparse,
      prunable_sparsity_percent = 100 * self.prunable_sparsity},
    params_info = info,
  }
end

Report.__tostring = function(r)
  local w = 12
  for _, path in ipairs(r.order) do w = math.max(w, #path) end
  local fmt = "%-" .. w .. "s %10s %9s  %s"
  local lines = {fmt:format("parameter", "numel", "sparsity", "")}
  for _, path in ipairs(r.order) do
    local e = r.params[path]
    lines[#lines + 1] = fmt:format(path, tostring(e.numel), ("%.2f%%"):format(100 * e.sparsity),
      (e.prunable and "prunable" or "") .. (e.masked and ", masked" or ""))
  end
  lines[#lines + 1] = ("total %d parameters, %d zero (%.2f%%); prunable %d, %d zero (%.2f%%)")
    :format(r.total, r.sparse, 100 * r.sparsity, r.prunable, r.prunable_sparse, 100 * r.prunable_sparsity)
  return table.concat(lines, "\n")
end

return prune
