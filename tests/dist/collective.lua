-- collective.lua — fsdp.collective across ranks (tests/recipes/dist_collective.sh runs it at
-- -n 1..4 and under mpirun): all_gather of nested tables, strings with NUL bytes and long
-- strings; broadcast of a string and of a table from every root; compare and agree when the
-- ranks agree (one all_reduce, nothing else), when one rank differs (every rank raises the same
-- message naming it, its value and where the values differ) and when a rank failed. Prints
-- "ok <rank> <world>" at the end.
local fsdp = require "fsdp"
local collective = require "fsdp.collective"
local C = dofile("tests/dist/common.lua")
local check = C.check

local rank, W = fsdp.rank(), fsdp.world_size()

-- a value only rank r builds: nested tables, NUL bytes, a long string for odd ranks
local function value_of(r)
  local v = {rank = r, name = "rank\0" .. r, nested = {list = {r, r * 0.1, -r, {deep = r % 2 == 0}},
    [r] = "key " .. r}, flag = r == 0}
  if r % 2 == 1 then v.long = ("x\0y"):rep(50000 + r) end
  return v
end
local function same(a, b) return collective.encode(a) == collective.encode(b) end

local all = collective.all_gather(value_of(rank))
check(#all == W, ("all_gather: %d values for %d ranks"):format(#all, W))
for r = 0, W - 1 do
  check(same(all[r + 1], value_of(r)), ("all_gather: rank %d's value arrived changed"):format(r))
end
local got = collective.all_gather(rank == 1 and "a\0\0b" or "")
check(got[1] == "" and (W == 1 or got[2] == "a\0\0b"), "all_gather of strings with NUL bytes")
check(#collective.all_gather(nil) == 0, "all_gather of nil: an array of nils")

for root = 0, W - 1 do
  local s = collective.broadcast(rank == root and ("root " .. root .. "\0!") or nil, root)
  check(s == "root " .. root .. "\0!", ("broadcast of a string from %d gave %q"):format(root, tostring(s)))
  local t = collective.broadcast(value_of(rank), root)
  check(same(t, value_of(root)), ("broadcast of a table from %d"):format(root))
end
check(collective.broadcast(rank == 0 and 2 ^ 60 + 2 ^ 8 or 0) == 2 ^ 60 + 2 ^ 8, "a number past 2^53")

-- agreement: one all_reduce and nothing more when the values are equal
fsdp.reset_comm_stats()
local cfg = {lr = 0.1, layers = {"a", "b"}}
check(collective.agree(cfg, "the config") == cfg, "agree returns the value")
local st = fsdp.comm_stats()
check(st.calls == (W > 1 and 1 or 0) and st.all_reduce_calls == st.calls,
  ("agree of equal values: one all_reduce, got %d calls"):format(st.calls))

if W > 1 then
  -- the last rank differs in one leaf: every rank raises the same message
  local mine = {lr = 0.1, layers = {"a", rank == W - 1 and "c" or "b"}}
  local ok, err = pcall(collective.agree, mine, "the config")
  err = tostring(err)
  check(not ok, "agree with a differing rank must fail")
  local want = ('the config differs across ranks at ["layers"][2]: rank 0 has "b", rank %d has "c" '
    .. "(ranks that differ from rank 0: %d)"):format(W - 1, W - 1)
  check(err:find(want, 1, true), "agree message: " .. err)
  check(err:find("fsdp/collective.lua", 1, true) == nil, "the error points at the caller: " .. err)
  -- several ranks differ: the first is named, all are listed
  local ok2, err2 = pcall(collective.agree, rank, "the rank")
  check(not ok2 and tostring(err2):find(("the rank differs across ranks: rank 0 has 0, rank 1 has 1 "
    .. "(ranks that differ from rank 0: %s)"):format(table.concat((function()
      local t = {}
      for r = 1, W - 1 do t[r] = tostring(r) end
      return t
    end)(), ", ")), 1, true), "agree names every differing rank: " .. tostring(err2))
  -- a rank that failed: everyone learns the lowest failing rank and its message
  local d = collective.compare("v", rank >= 1 and ("broke on " .. rank .. "\0") or nil)
  check(d and d.failed == 1 and d.err == "broke on 1\0", "compare names the lowest failing rank")
end

-- the ranks are still in step
check(fsdp.all_reduce(1) == W, "in step after the failures")
if C.failures() > 0 then error(("%d check(s) failed"):format(C.failures())) end
print(("ok %d %d"):format(rank, W))
