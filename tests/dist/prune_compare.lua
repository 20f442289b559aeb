-- Compare two files written by tests/dist/prune_equiv.lua (the reference first):
--   fsdprun tests/dist/prune_compare.lua REF OUT [--tol=1e-5]
-- Every mask line must be identical (same parameters, same bits) and the loss curves agree
-- within tol relative at every step; OUT must report 0 violations. Prints the number of masks
-- and pruned elements compared and the largest loss difference; exits 1 on any difference.
local fsdp = require "fsdp"
local a = fsdp.args
local ref_path, out_path = a[1], a[2]
assert(ref_path and out_path, "usage: prune_compare.lua REF OUT [--tol=1e-5]")
local tol = a.tol or 1e-5

local function read(path)
  local r = {masks = {}, order = {}, losses = {}}
  for line in io.lines(path) do
    local phase, p, bits = line:match("^mask (%S+) (%S+) (%S+)$")
    if phase then
      r.masks[phase .. " " .. p] = bits
      r.order[#r.order + 1] = phase .. " " .. p
    end
    local step, v = line:match("^loss (%d+) (%S+)$")
    if step then r.losses[tonumber(step)] = tonumber(v) end
    local viol = line:match("^violations (%d+)$")
    if viol then r.violations = tonumber(viol) end
  end
  return r
end

local ref, out = read(ref_path), read(out_path)
local function fail(msg)
  print("FAIL: " .. msg)
  os.exit(1)
end
if #ref.order == 0 then fail("no masks in " .. ref_path) end
if #ref.order ~= #out.order then fail(("%d masks in the reference, %d here"):format(#ref.order, #out.order)) end
local pruned = 0
for _, k in ipairs(ref.order) do
  local r, o = ref.masks[k], out.masks[k]
  if o == nil then fail("no mask " .. k) end
  if r ~= o then
    local first
    for i = 1, #r do
      if r:sub(i, i) ~= o:sub(i, i) then first = i break end
    end
    local diff = 0
    for i = 1, math.min(#r, #o) do if r:sub(i, i) ~= o:sub(i, i) then diff = diff + 1 end end
    fail(("mask %s differs at %d elements (first: element %s)"):format(k, diff, tostring(first)))
  end
  local _, z = r:gsub("0", "")
  pruned = pruned + z
end
if out.violations ~= 0 then fail(("%s masked weights are not 0"):format(tostring(out.violations))) end
if #ref.losses == 0 or #ref.losses ~= #out.losses then
  fail(("%d reference losses, %d here"):format(#ref.losses, #out.losses))
end
local worst, at = 0, 0
for i, b in ipairs(ref.losses) do
  local e = math.abs(out.losses[i] - b) / math.abs(b)
  if e ~= e then e = math.huge end
  if e > worst then worst, at = e, i end
end
if worst > tol then fail(("loss differs by %.3g relative at step %d (tol %g)"):format(worst, at, tol)) end
print(("%d masks identical (%d pruned elements), %d losses within %.3g (worst at step %d)")
  :format(#ref.order, pruned, #ref.losses, worst, at))
