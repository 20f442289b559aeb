-- lib.lua — what the Lua benchmarks share (not a benchmark itself). A script loads it from its
-- own folder, wherever it is run from:
--   local lib = dofile((arg[0]:match("^(.*[/\\])") or "") .. "lib.lua")
local fsdp = require "fsdp"

local M = {}

-- median(xs): the median of the numbers xs (xs is left as it is)
function M.median(xs)
  local s = {}
  for i, x in ipairs(xs) do s[i] = x end
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) / 2] or 0.5 * (s[n / 2] + s[n / 2 + 1])
end

-- random_tokens(B, T, V): a B x (T + 1) i64 tensor of tokens in [0, V) from math.random (the
-- caller seeds it)
function M.random_tokens(B, T, V)
  local ids = {}
  for i = 1, B * (T + 1) do ids[i] = math.random(0, V - 1) end
  return fsdp.tensor(ids, {dtype = "i64"}):view{B, T + 1}
end

-- next_token(rows, T): the inputs (the first T columns of rows) and the targets (the same
-- shifted by one), contiguous
function M.next_token(rows, T)
  return rows:narrow(2, 1, T):contiguous(), rows:narrow(2, 2, T):contiguous()
end

return M
