-- ckpt_common.lua — helpers shared by the checkpoint tests (tests/dist/ckpt_*.lua), loaded
-- with dofile from the repository root (ctest runs tests/recipes/dist_ckpt*.sh there).
local fsdp = require "fsdp"
require "fsdp.checkpoint" -- fsdp.save / fsdp.load, also before init.lua knows them
local nn = fsdp.nn
local ffi = require "ffi"

local T = {}

T.W, T.rank = fsdp.world_size(), fsdp.rank()

function T.say(...) if T.rank == 0 then print(...) end end

-- Fail on every rank with the same message (a check whose inputs are the same everywhere).
function T.check(cond, msg)
  if not cond then error("CHECK FAILED: " .. msg, 2) end
end

-- A tiny GPT; cfg overrides the defaults.
function T.gpt(seed, cfg)
  fsdp.manual_seed(seed)
  local c = {vocab = 32, ctx = 8, d = 16, layers = 2, heads = 2, tie = true}
  for k, v in pairs(cfg or {}) do c[k] = v end
  return nn.GPT(c)
end

function T.wrap(model, strategy)
  return fsdp.wrap(model, {policy = fsdp.policy.modules{nn.Block}, strategy = strategy or "full"})
end

-- The global batch of a step (a formula, no RNG); this rank's rows of it. 4 rows divide among
-- 1, 2 and 4 ranks.
function T.batch(step, rows_total)
  rows_total = rows_total or 4
  local rows = rows_total / T.W
  local first = T.rank * rows + 1
  local x, y = {}, {}
  for i = first, first + rows - 1 do
    local xi, yi = {}, {}
    for t = 1, 8 do
      local v = (i * 7 + t * 3 + step * 5 + (i * t) % 5) % 32
      xi[t] = v
      yi[t] = (v * 3 + t) % 32
    end
    x[#x + 1], y[#y + 1] = xi, yi
  end
  -- token ids as integers (a model wrapped with mixed precision casts floating inputs)
  return fsdp.tensor(x, {dtype = "i64"}), fsdp.tensor(y, {dtype = "i64"})
end

-- steps of training from step `from`; returns the losses (mean over ranks: the global mean).
function T.train(model, opt, from, steps)
  local losses = {}
  for step = from, from + steps - 1 do
    local x, y = T.batch(step)
    opt:zero_grad()
    local loss = nn.F.cross_entropy(model(x), y)
    loss:backward()
    opt:step()
    losses[#losses + 1] = fsdp.all_reduce(loss:item(), "mean")
  end
  return losses
end

-- {path = flat table of values} of the full model (collective when wrapped).
function T.values(model)
  return fsdp.full_params(model, function(m)
    local out = {}
    for path, p in m:named_parameters() do
      local t = p:detach():view{p:numel()}:totable()
      out[path] = t
    end
    return out
  end, {writeback = false})
end

-- Bitwise equality of two values() tables (f32 values are exact in Lua numbers).
function T.same_values(a, b, what)
  for path, va in pairs(a) do
    local vb = b[path]
    T.check(vb ~= nil, ("%s: %s is missing"):format(what, path))
    T.check(#va == #vb, ("%s: %s has %d vs %d elements"):format(what, path, #va, #vb))
    for i = 1, #va do
      if va[i] ~= vb[i] and not (va[i] ~= va[i] and vb[i] ~= vb[i]) then
        error(("CHECK FAILED: %s: %s element %d differs: %.9g vs %.9g"):format(what, path, i, va[i], vb[i]), 2)
      end
    end
  end
  for path in pairs(b) do T.check(a[path] ~= nil, ("%s: unexpected %s"):format(what, path)) end
end

-- The optimizer's state on this rank as {path = {name = flat values, step =}}.
function T.opt_state(opt)
  local out = {}
  for _, s in ipairs(opt:export_slices()) do
    local e = {first = s.first, count = s.count}
    for k, v in pairs(s.scalars) do e[k] = v end
    for k, t in pairs(s.tensors) do e[k] = t:totable() end
    out[s.path] = e
  end
  return out
end

-- The whole optimizer state (collective): {path = {step =, name = flat values of the whole
-- parameter}} for the state tensors `names`, assembled from every rank's slices with one
-- all_reduce per tensor. The slices of a wrapped model (strategy full or grad_op) are
-- disjoint; a plain optimizer's whole state is counted once (rank 0's).
function T.full_opt_state(model, opt, names)
  local mine = {}
  for _, s in ipairs(opt:export_slices()) do mine[s.param] = s end
  local counted = opt.wrapped ~= nil or T.rank == 0
  local out = {}
  for path, p in model:named_parameters() do
    local s = mine[p]
    local e = {}
    e.step = fsdp.all_reduce((s and counted) and s.scalars.step or 0, "max")
    for _, name in ipairs(names) do
      local full = fsdp.zeros{p:numel()}
      if s and counted and s.tensors[name] then
        full:narrow(1, s.first + 1, s.count):copy(s.tensors[name])
      end
      fsdp.all_reduce(full, "sum")
      e[name] = full:totable()
    end
    out[path] = e
  end
  return out
end

function T.same_tables(a, b, what)
  local function cmp(x, y, where)
    if type(x) == "table" and type(y) == "table" then
      for k, v in pairs(x) do cmp(v, y[k], where .. "." .. tostring(k)) end
      for k in pairs(y) do T.check(x[k] ~= nil, what .. ": unexpected " .. where .. "." .. tostring(k)) end
    else
      T.check(x == y, ("%s: %s differs: %s vs %s"):format(what, where, tostring(x), tostring(y)))
    end
  end
  cmp(a, b, "")
end

-- Expect fn to raise; returns the message. Every rank must raise (collective errors).
function T.raises(fn, pattern, what)
  local ok, err = pcall(fn)
  T.check(not ok, what .. ": expected an error, got none")
  err = tostring(err)
  if pattern and not err:find(pattern) then
    error(("CHECK FAILED: %s: error %q does not match %q"):format(what, err, pattern), 2)
  end
  -- the same message on every rank (a hash of it agrees)
  local h = #err
  for i = 1, #err do h = (h * 31 + err:byte(i)) % 1000000007 end
  T.check(fsdp.all_reduce(h, "min") == fsdp.all_reduce(h, "max"),
    what .. ": ranks raised different errors; this one: " .. err)
  return err
end

-- ---- an independent safetensors parser (no fsdp io code: bytes, cJSON text via json_decode) ----

function T.read_file(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

function T.write_file(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

-- {header = table, data = string, n = header length}: checks the layout rules of the format
-- (every tensor dtype's size).
function T.parse_safetensors(path)
  local s = T.read_file(path)
  T.check(#s >= 8, path .. ": shorter than 8 bytes")
  local n = 0
  for i = 8, 1, -1 do n = n * 256 + s:byte(i) end
  T.check(8 + n <= #s, path .. ": header length past the end")
  T.check((8 + n) % 8 == 0, path .. ": header not padded to 8 bytes")
  local header = fsdp.core.json_decode(s:sub(9, 8 + n), path)
  local data = s:sub(9 + n)
  local spans = {}
  local SIZE = {F32 = 4, BF16 = 2, F16 = 2, F64 = 8, I64 = 8, I32 = 4, U8 = 1, BOOL = 1}
  for name, e in pairs(header) do
    if name ~= "__metadata__" then
      T.check(SIZE[e.dtype] ~= nil, name .. ": dtype " .. tostring(e.dtype))
      local numel = 1
      for _, d in ipairs(e.shape) do numel = numel * d end
      T.check(e.data_offsets[2] - e.data_offsets[1] == SIZE[e.dtype] * numel, name .. ": size")
      spans[#spans + 1] = {e.data_offsets[1], e.data_offsets[2], name}
    end
  end
  table.sort(spans, function(a, b) return a[1] < b[1] end)
  local at = 0
  for _, sp in ipairs(spans) do
    T.check(sp[1] == at, sp[3] .. ": hole or overlap at byte " .. at)
    at = sp[2]
  end
  T.check(at == #data, path .. ": data section has trailing bytes")
  return {header = header, data = data, n = n}
end

-- The f32 values of tensor `name` of a parsed file, as a flat table.
function T.tensor_values(parsed, name)
  local e = parsed.header[name]
  T.check(e.dtype == "F32", name .. ": dtype " .. tostring(e.dtype) .. ", not F32")
  local a, b = e.data_offsets[1], e.data_offsets[2]
  local count = (b - a) / 4
  local buf = ffi.new("float[?]", math.max(count, 1))
  ffi.copy(buf, parsed.data:sub(a + 1, b), b - a)
  local out = {}
  for i = 1, count do out[i] = buf[i - 1] end
  return out
end

return T
