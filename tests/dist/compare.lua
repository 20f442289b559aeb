-- Compare two files written by tests/dist/train_equiv.lua (the reference first):
--   fsdprun tests/dist/compare.lua REF OUT [--tol=1e-5] [--exact]
-- Prints the largest relative error of the loss curve (|a - b| / |b| per step) and the relative
-- error of the final parameters as one vector (||a - b|| / ||b|| over all of them), and exits 1
-- when either exceeds tol. The worst single parameter's relative error is printed too (a small
-- parameter, e.g. a LayerNorm bias grown from 0, has a larger relative error for the same
-- absolute one). With --exact the files must be identical (bitwise reproducibility).
local fsdp = require "fsdp"
local a = fsdp.args
local ref_path, out_path = a[1], a[2]
assert(ref_path and out_path, "usage: compare.lua REF OUT [--tol=1e-5] [--exact]")
local tol = a.tol or 1e-5

local function read(path)
  local f = assert(io.open(path))
  local text = f:read("*a")
  f:close()
  local losses, params, order = {}, {}, {}
  for line in text:gmatch("[^\n]+") do
    local step, v = line:match("^loss (%d+) (%S+)$")
    if step then
      losses[tonumber(step)] = tonumber(v)
    else
      local path, rest = line:match("^param (%S+) (.*)$")
      assert(path, path or ("bad line in " .. path .. ": " .. line:sub(1, 60)))
      local vals = {}
      for w in rest:gmatch("%S+") do vals[#vals + 1] = tonumber(w) end
      params[path] = vals
      order[#order + 1] = path
    end
  end
  return {text = text, losses = losses, params = params, order = order}
end

local ref, out = read(ref_path), read(out_path)
if a.exact then
  if ref.text ~= out.text then
    print(("FAIL: %s and %s differ (not bitwise identical)"):format(ref_path, out_path))
    os.exit(1)
  end
  print(("bitwise identical: %d losses, %d parameters"):format(#ref.losses, #ref.order))
  os.exit(0)
end

local fail = false
if #ref.losses == 0 or #ref.losses ~= #out.losses then
  print(("FAIL: %d reference losses, %d losses"):format(#ref.losses, #out.losses))
  os.exit(1)
end
local worst_loss, worst_step = 0, 0
for i, b in ipairs(ref.losses) do
  local e = math.abs(out.losses[i] - b) / math.abs(b)
  if e ~= e then e = math.huge end
  if e > worst_loss then worst_loss, worst_step = e, i end
end
local worst_param, worst_path = 0, "-"
local all_num, all_den = 0, 0
for _, path in ipairs(ref.order) do
  local r, o = ref.params[path], out.params[path]
  if o == nil or #o ~= #r then
    print(("FAIL: parameter %s missing or of another size"):format(path))
    os.exit(1)
  end
  local num, den = 0, 0
  for k = 1, #r do
    num = num + (o[k] - r[k]) ^ 2
    den = den + r[k] ^ 2
  end
  all_num, all_den = all_num + num, all_den + den
  local e = math.sqrt(num) / math.max(math.sqrt(den), 1e-30)
  if e ~= e then e = math.huge end
  if e > worst_param then worst_param, worst_path = e, path end
end
if #out.order ~= #ref.order then
  print(("FAIL: %d reference parameters, %d parameters"):format(#ref.order, #out.order))
  fail = true
end
local params_err = math.sqrt(all_num) / math.max(math.sqrt(all_den), 1e-30)
if params_err ~= params_err then params_err = math.huge end
if worst_loss > tol then fail = true end
if params_err > tol then fail = true end
print(("%s: loss max rel err %.3g (step %d; loss %.4f -> %.4f), params rel err %.3g "
  .. "(worst parameter %.3g, %s)"):format(fail and "FAIL" or "ok", worst_loss, worst_step,
  ref.losses[1], ref.losses[#ref.losses], params_err, worst_param, worst_path))
os.exit(fail and 1 or 0)
