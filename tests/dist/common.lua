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

--- Collective (fsdp.full_params). A run as text, the same on every rank: "loss <i> <%a>" per
--- loss, then "param <path> <%a> ..." per parameter of the gathered model (exact bits), for
--- comparing runs with tests/dist/compare.lua.
function C.run_lines(losses, model)
  local lines = {}
  for i, l in ipairs(losses) do lines[#lines + 1] = ("loss %d %a"):format(i, l) end
  fsdp.full_params(model, function(m)
    for path, p in m:named_parameters() do
      local vals = {}
      for k, v in ipairs(C.flat(p)) do vals[k] = ("%a"):format(v) end
      lines[#lines + 1] = ("param %s %s"):format(path, table.concat(vals, " "))
    end
  end, {writeback = false})
  return lines
end

--- Rank 0 writes the lines to path (stdout when nil).
function C.write_lines(lines, path)
  if fsdp.rank() ~= 0 then return end
  local out = path and assert(io.open(path, "w")) or io.stdout
  out:write(table.concat(lines, "\n"), "\n")
  if out ~= io.stdout then out:close() end
end

return C
