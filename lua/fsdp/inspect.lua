-- fsdp.inspect: shard state at a glance, and readable reports for fsdp.memory() and
-- fsdp.comm_stats(). docs/REPL.md ("Inspecting shards") is the manual.
--
--   fsdp.inspect(model)                 -> report: one row per unit (or per parameter, unwrapped),
--                                          the mixed-precision policy and unit dtypes when set
--   fsdp.inspect(param, {model = m})    -> report: state, dtypes (now, the unit's param/reduce),
--                                          unit, flat offset, every rank's slice, tie paths
--                                          (needs the model), mask sparsity
--   fsdp.inspect(unit)                  -> report of one unit (an element of fsdp.units(model))
--   M.memory_report(t), M.comm_report(t) -> t with a __tostring (fields untouched)
--
-- Reports are plain tables with a metatable whose __tostring prints them; every field stays
-- readable by programs (tests, recipes). Nothing here communicates: every rank can inspect on
-- its own (in the REPL, also in ":rank K" mode). What another rank holds is computed from the
-- layout, which is the same on every rank; what only a rank knows (its mask slice, its bytes)
-- is reported for the calling rank.

local core = require "fsdp.core"
local mask = require "fsdp.mask"
local state = require "fsdp.state"
local ties = require "fsdp.ties"
local util = require "fsdp.util"

local M = {}

local concat, floor, format, rep = table.concat, math.floor, string.format, string.rep

local is_module, is_tensor, raise = util.is_module, util.is_tensor, util.raise

-- ---- formatting ----------------------------------------------------------------------------

--- 1234567 -> "1,234,567"
function M.int(n)
  if n ~= n then return "nan" end
  local neg = n < 0
  local s = tostring(floor(math.abs(n)))
  s = s:reverse():gsub("(%d%d%d)", "%1,"):reverse():gsub("^,", "")
  return neg and "-" .. s or s
end

--- 1536 -> "1.5 KiB"; below 1 KiB in bytes ("512 B").
function M.bytes(n)
  if n < 1024 then return format("%d B", n) end
  local units = { "KiB", "MiB", "GiB", "TiB" }
  local v, i = n / 1024, 1
  while v >= 1024 and i < #units do v, i = v / 1024, i + 1 end
  return format(v >= 100 and "%.0f %s" or "%.1f %s", v, units[i])
end

local shape_str = util.shape_str

-- Left-aligned text columns; `right` marks the columns aligned right (numbers).
local function columns(rows, right, indent)
  local w = {}
  for _, r in ipairs(rows) do
    for i, c in ipairs(r) do w[i] = math.max(w[i] or 0, #c) end
  end
  local out = {}
  for _, r in ipairs(rows) do
    local cells = {}
    for i, c in ipairs(r) do
      local pad = rep(" ", w[i] - #c)
      cells[i] = right[i] and pad .. c or (i < #r and c .. pad or c)
    end
    out[#out + 1] = indent .. concat(cells, "  ")
  end
  return concat(out, "\n")
end

local function range_str(first, last)
  if first == nil then return "-" end
  if first == last then return M.int(first) end
  return M.int(first) .. "-" .. M.int(last)
end

-- ---- units ---------------------------------------------------------------------------------


local DTYPE_BYTES = { f32 = 4, bf16 = 2, f16 = 2 }

local function unit_row(u)
  local state = u:state()
  local numel, padded, shard = u:numel(), u:padded_numel(), u:shard_numel()
  local replicated = u:strategy() == "none"
  -- the shard is this rank's place in its shard group (hybrid: every group holds the unit)
  local rank = u:groups().shard_rank
  local first = replicated and 1 or rank * shard + 1
  local last = replicated and padded or (rank + 1) * shard
  -- mixed precision: the dtype parameters are gathered in for compute and gradients reduced
  -- in; while gathered, the dtype of the full buffer (f32 for u:gather(), full_params, apply)
  local dt = u:dtypes()
  -- what this rank holds for the unit now: its f32 shard, plus the full flat buffer while
  -- gathered (a replicated unit's shard is the whole buffer; in a compute dtype other than
  -- f32 it holds a converted copy too)
  local bytes = 4 * shard
  if state == "gathered" and (not replicated or dt.gathered ~= "f32") then
    bytes = bytes + (DTYPE_BYTES[dt.gathered] or 4) * padded
  end
  return {
    path = u.path, state = state, strategy = u:strategy(), nparams = #u:params(),
    numel = numel, padded_numel = padded, padding = padded - numel, shard_numel = shard,
    slice = { first, last }, bytes = bytes,
    param_dtype = dt.param, reduce_dtype = dt.reduce, gathered_dtype = dt.gathered,
  }
end

-- "gathered (bf16)" for a unit gathered in a compute dtype other than f32
local function state_str(u)
  if u.state == "gathered" and u.gathered_dtype and u.gathered_dtype ~= "f32" then
    return "gathered (" .. u.gathered_dtype .. ")"
  end
  return u.state
end

-- "param bf16, reduce f32[, output f32]"
local function mp_str(mp)
  local s = format("param %s, reduce %s", mp.param, mp.reduce)
  if mp.output then s = s .. ", output " .. mp.output end
  return s
end

local Report = {}
Report.__index = Report
M.Report = Report

local function model_text(r)
  local lines = {}
  if not r.wrapped then
    lines[1] = format("%s: not wrapped, %s parameters (%s elements, %s), rank %d of %d", r.type,
      M.int(r.nparams), M.int(r.numel), M.bytes(4 * r.numel), r.rank, r.world_size)
    if r.params and #r.params > 0 then
      local rows = { { "parameter", "shape", "numel", "device" } }
      for _, p in ipairs(r.params) do
        rows[#rows + 1] = { p.path, shape_str(p.shape), M.int(p.numel), p.device }
      end
      lines[2] = columns(rows, { [3] = true }, "  ")
      if r.more_params then lines[3] = format("  ... and %d more", r.more_params) end
    end
    return concat(lines, "\n")
  end
  lines[1] = format("%s: wrapped (%s), %d unit%s, %s parameters (%s elements), rank %d of %d",
    r.type, r.strategy, #r.units, #r.units == 1 and "" or "s", M.int(r.nparams), M.int(r.numel),
    r.rank, r.world_size)
  -- mixed precision: the policy, and a dtype column (units of one model may differ)
  local mixed = r.mp ~= nil
  for _, u in ipairs(r.units) do
    if u.param_dtype ~= "f32" or u.reduce_dtype ~= "f32" then mixed = true end
  end
  if mixed then
    lines[#lines + 1] = format("  mixed precision: %s; shards, gradient shards and optimizer "
      .. "state f32", r.mp and mp_str(r.mp) or "per unit (below)")
  end
  local head = { "unit", "params", "numel", "padding", "state", "this rank's slice", "bytes here" }
  if mixed then head[#head + 1] = "param/reduce" end
  local rows = { head }
  local total = 0
  for _, u in ipairs(r.units) do
    local row = { u.path, M.int(u.nparams), M.int(u.numel), M.int(u.padding), state_str(u),
      range_str(u.slice[1], u.slice[2]) .. " of " .. M.int(u.padded_numel), M.bytes(u.bytes) }
    if mixed then row[#row + 1] = u.param_dtype .. "/" .. u.reduce_dtype end
    rows[#rows + 1] = row
    total = total + u.bytes
  end
  rows[#rows + 1] = { "total", M.int(r.nparams), M.int(r.numel), "", "", "", M.bytes(total) }
  lines[#lines + 1] = columns(rows, { [2] = true, [3] = true, [4] = true, [7] = true }, "  ")
  return concat(lines, "\n")
end

local function param_text(r)
  local lines = {}
  lines[1] = format("parameter %s  %s %s  %s elements", r.path or "(not in a unit: path unknown)",
    shape_str(r.shape), r.dtype or "f32", M.int(r.numel))
  local rows = {}
  if r.unit then
    rows[#rows + 1] = { "state", format("%s (unit %s, strategy %s)", r.state, r.unit, r.strategy) }
    if r.param_dtype == "f32" and r.reduce_dtype == "f32" then
      rows[#rows + 1] = { "dtypes", r.dtype .. " (no mixed precision)" }
    else
      rows[#rows + 1] = { "dtypes", format("%s now; the unit gathers %s for compute and reduces "
        .. "gradients in %s; its shard (the master) is f32", r.dtype, r.param_dtype, r.reduce_dtype) }
    end
    if r.offset then
      rows[#rows + 1] = { "flat", format("elements %s of the unit's flat buffer (offset %s)",
        range_str(r.offset + 1, r.offset + r.numel), M.int(r.offset)) }
    end
    local parts = {}
    for k = 0, (r.shard_size or r.world_size) - 1 do
      local s = r.slices and r.slices[k]
      parts[#parts + 1] = format("%d: %s", k, s and range_str(s[1], s[2]) or "-")
    end
    local whose = (r.replicas or 1) > 1
      and format("elements of the parameter, by rank within each of the %d groups of %d ranks",
        r.replicas, r.shard_size)
      or "elements of the parameter"
    rows[#rows + 1] = { "slices", concat(parts, "   ") .. "  (" .. whose .. ")" }
    rows[#rows + 1] = { "this rank", format("rank %d holds %s element%s", r.rank,
      M.int(r.local_numel), r.local_numel == 1 and "" or "s") }
  else
    rows[#rows + 1] = { "state", format("%s (not sharded: dense storage on %s)", r.state, r.device) }
  end
  if r.ties then
    rows[#rows + 1] = { "ties", #r.ties > 1 and concat(r.ties, ", ") or "none (one path)" }
  else
    rows[#rows + 1] = { "ties", "unknown: fsdp.inspect(param, {model = m}) lists them" }
  end
  if r.mask then
    rows[#rows + 1] = { "mask", format("%.1f%% pruned on %s (%s of %s elements are 0)",
      100 * r.mask.sparsity, r.mask.scope, M.int(r.mask.zeros), M.int(r.mask.n)) }
  else
    rows[#rows + 1] = { "mask", "none" }
  end
  lines[2] = columns(rows, {}, "  ")
  return concat(lines, "\n")
end

Report.__tostring = function(r)
  if r.kind == "param" then return param_text(r) end
  if r.kind == "unit" then
    local u = r.unit_row
    return format("unit %s: %d params, %s elements (+%s padding), %s, rank %d holds %s (%s); %s",
      u.path, u.nparams, M.int(u.numel), M.int(u.padding), state_str(u), r.rank,
      range_str(u.slice[1], u.slice[2]), M.bytes(u.bytes),
      mp_str({ param = u.param_dtype, reduce = u.reduce_dtype }))
  end
  return model_text(r)
end

-- ---- the reports ----------------------------------------------------------------------------

local MAX_PARAM_ROWS = 50

local function model_report(x)
  local R = state.root(x)
  local r = setmetatable({ kind = "model", type = x:type_name(), wrapped = R ~= nil,
    nparams = #x:parameters(), numel = x:num_parameters(), rank = core.rank(),
    world_size = core.world_size() }, Report)
  if R then
    r.strategy = R:option("strategy") or "full"
    -- the policy wrap was given ({param =, reduce =, output =}; nil: f32)
    local mp = R:option("mp")
    if mp then r.mp = { param = mp.param, reduce = mp.reduce, output = mp.output } end
    r.units = {}
    for _, u in ipairs(R:forward_units()) do r.units[#r.units + 1] = unit_row(u) end
  else
    r.params = {}
    local n = 0
    for path, p in x:named_parameters() do
      n = n + 1
      if n <= MAX_PARAM_ROWS then
        r.params[#r.params + 1] = { path = path, shape = p:shape(), numel = p:numel(),
          device = p.device }
      end
    end
    if n > MAX_PARAM_ROWS then r.more_params = n - MAX_PARAM_ROWS end
  end
  return r
end

-- The tie paths of p in model (fsdp.ties; else its path), or nil.
local function tie_paths(p, model)
  if model == nil then return nil end
  local ok, groups = pcall(ties.ties, model)
  if ok and type(groups) == "table" then
    for _, g in ipairs(groups) do
      if rawequal(g.param, p) then return g.paths end
    end
  end
  for path, q in model:named_parameters() do
    if rawequal(q, p) then return { path } end
  end
  return nil
end

local function mask_info(p, sharded)
  if not mask.has(p) then return nil end
  local s = mask.local_slice(p)
  if s == nil then return nil end
  local n = s:numel()
  local zeros = n > 0 and n - s:sum():item() or 0
  return { zeros = zeros, n = n, sparsity = n > 0 and zeros / n or 0,
    scope = sharded and "this rank's slice" or "the whole parameter" }
end

local function param_report(x, opts)
  local r = setmetatable({ kind = "param", shape = x:shape(), numel = x:numel(), dtype = x:dtype(),
    device = x.device, rank = core.rank(), world_size = core.world_size() }, Report)
  local u = core.param_unit and core.param_unit(x)
  if u then
    r.unit, r.strategy, r.state = u.path, u:strategy(), u:state()
    local dt = u:dtypes()
    r.param_dtype, r.reduce_dtype = dt.param, dt.reduce
    local ps, pp = u:params(), u:paths()
    for i = 1, #ps do
      if rawequal(ps[i], x) then r.path = pp[i] end
    end
    for _, l in ipairs(u:layout()) do
      if l.path == r.path then r.offset, r.slices = l.offset, l.slices end
    end
    local g = u:groups() -- hybrid: the slices are by rank within a shard group
    r.shard_size, r.replicas = g.shard_size, g.replicas
    r.local_numel = 0
    for _, s in ipairs(u:local_slices()) do
      if rawequal(s.param, x) then r.local_numel = s.shard_last - s.shard_first + 1 end
    end
    if r.strategy == "none" then r.local_numel = r.numel end
  else
    r.state = x.device == "meta" and "meta" or "full"
  end
  r.ties = tie_paths(x, opts.model)
  if r.path == nil and r.ties then r.path = r.ties[1] end
  r.mask = mask_info(x, u ~= nil and r.strategy ~= "none")
  return r
end

local function is_unit(x)
  if type(x) ~= "userdata" or is_tensor(x) then return false end
  local ok, v = pcall(function() return x.layout ~= nil and x.path ~= nil end)
  return ok and v
end

--- A report on a model, a parameter or a unit; tostring() prints it. opts.model (for a
--- parameter): the model it belongs to, to list its tie paths. Not collective.
function M.inspect(x, opts)
  opts = util.check_opts("fsdp.inspect", opts, {"model"})
  if is_module(x) then return model_report(x) end
  if is_tensor(x) then return param_report(x, opts) end
  if is_unit(x) then
    return setmetatable({ kind = "unit", unit_row = unit_row(x), rank = core.rank(),
      world_size = core.world_size() }, Report)
  end
  raise(("fsdp.inspect: expected a module, a parameter or a unit (got %s)"):format(type(x)))
end

-- ---- fsdp.memory() and fsdp.comm_stats() ------------------------------------------------------

local MemoryReport = {}
M.MemoryReport = MemoryReport

local ROLES = { "params", "grads", "optim", "gathered", "activations", "other" }

MemoryReport.__tostring = function(m)
  local lines = { format("memory (rank %d of %d, cpu): live %s, peak %s", core.rank(),
    core.world_size(), M.bytes(m.live or 0), M.bytes(m.peak or 0)) }
  local parts = {}
  for _, k in ipairs(ROLES) do
    if m[k] ~= nil then parts[#parts + 1] = format("%s %s", k, M.bytes(m[k])) end
  end
  lines[2] = "  " .. concat(parts, "  ")
  if type(m.devices) == "table" then
    local names = {}
    for name in pairs(m.devices) do
      if name ~= "cpu" then names[#names + 1] = name end
    end
    table.sort(names)
    for _, name in ipairs(names) do
      local d = m.devices[name]
      if type(d) == "table" and ((d.live or 0) > 0 or (d.peak or 0) > 0) then
        lines[#lines + 1] = format("  %s: live %s, peak %s", name, M.bytes(d.live or 0),
          M.bytes(d.peak or 0))
      end
    end
  end
  return concat(lines, "\n")
end

--- fsdp.memory()'s table, printable (its fields are unchanged).
function M.memory_report(t) return setmetatable(t, MemoryReport) end

local CommReport = {}
M.CommReport = CommReport

local OPS = { "all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier" }

CommReport.__tostring = function(s)
  local lines = { format("comm (rank %d of %d, %s): %s calls, busy %.3f s, waiting %.3f s",
    core.rank(), core.world_size(), core.backend(), M.int(s.calls or 0), s.busy_s or 0,
    s.wait_s or 0) }
  local rows = { { "op", "calls", "bytes" } }
  for _, op in ipairs(OPS) do
    rows[#rows + 1] = { op, M.int(s[op .. "_calls"] or 0), M.bytes(s[op .. "_bytes"] or 0) }
  end
  lines[2] = columns(rows, { [2] = true, [3] = true }, "  ")
  return concat(lines, "\n")
end

--- fsdp.comm_stats()'s table, printable (its fields are unchanged).
function M.comm_report(t) return setmetatable(t, CommReport) end

return M
