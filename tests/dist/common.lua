-- common.lua — helpers shared by the multi-rank tests (tests/dist/*.lua), loaded with
--   local C = dofile("tests/dist/common.lua")
-- from the repository root (ctest runs tests/recipes/dist_*.sh there).
local fsdp = require "fsdp"

local C = {}
local failures = 0

--- Count a failed check and say which rank saw it; C.failures() tells how many.
function C.check(ok, what)
  if not ok then
    failures = failures + 1
    print(("[rank %d] FAIL: %s"):format(fsdp.rank(), what))
  end
end

function C.failures() return failures end

--- A tensor's values, flattened, as a Lua array.
function C.flat(t) return t:contiguous():view{t:numel()}:totable() end

--- Element-wise equality of two arrays (bitwise for floats).
function C.same(a, b)
  if #a ~= #b then return false end
  for k = 1, #a do if a[k] ~= b[k] then return false end end
  return true
end

return C
