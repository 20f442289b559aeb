-- ranks_collectives.lua — run by tests/recipes/dist_ranks.sh at -n 1, 2 and 4 (and without
-- -n): rank()/world_size()/backend(), all_reduce of numbers and tensors for every op, broadcast
-- from every root, barrier, and comm_stats counting. Every rank checks its results against the
-- serial answer computed here from what each rank contributes, so "equal on every rank" is
-- checked by each rank for itself. Prints "ok <rank> <world>" at the end; any failure raises.
local fsdp = require "fsdp"
local core = fsdp.core

local rank, world = fsdp.rank(), fsdp.world_size()
local expected_world = tonumber(fsdp.args.world) or 1

local function check(cond, fmt, ...)
  if not cond then error(("rank %d: " .. fmt):format(rank, ...), 2) end
end
local function same_bits(a, b) return a == b or (a ~= a and b ~= b) end

check(world == expected_world, "world_size() = %s, expected %s", tostring(world), expected_world)
check(rank >= 0 and rank < world and rank % 1 == 0, "rank() = %s", tostring(rank))
check(fsdp.backend() == "local", "backend() = %s", tostring(fsdp.backend()))

-- every rank holds a distinct rank: their sum is 0 + 1 + ... + (W-1), their max W-1
check(fsdp.all_reduce(rank, "sum") == world * (world - 1) / 2, "ranks do not sum up")
check(fsdp.all_reduce(rank, "max") == world - 1, "max of ranks")
check(fsdp.all_reduce(rank, "min") == 0, "min of ranks")

-- numbers: exact in double, reduced in rank order (the same order is used here)
local function contrib(r) return 0.1 * (r + 1) + 2 ^ 40 * r end
local sum, mx, mn = 0, -math.huge, math.huge
for r = 0, world - 1 do
  local v = contrib(r)
  sum = sum + v
  mx, mn = math.max(mx, v), math.min(mn, v)
end
local got = fsdp.all_reduce(contrib(rank), "sum")
check(same_bits(got, sum), "number sum %.17g, serial %.17g", got, sum)
check(same_bits(fsdp.all_reduce(contrib(rank)), sum), "the default op is sum")
got = fsdp.all_reduce(contrib(rank), "mean")
check(same_bits(got, sum / world), "number mean %.17g, serial %.17g", got, sum / world)
check(same_bits(fsdp.all_reduce(contrib(rank), "max"), mx), "number max")
check(same_bits(fsdp.all_reduce(contrib(rank), "min"), mn), "number min")
-- past f32's 24 bits: a count of elements must not come back rounded
check(fsdp.all_reduce(16777217, "sum") == 16777217 * world, "big counts are exact")
check(fsdp.all_reduce(-0.0, "sum") == 0, "negative zero")
local nan = fsdp.all_reduce(rank == world - 1 and 0 / 0 or rank, "max")
check(nan ~= nan, "max propagates NaN")

-- tensors: rank r contributes t_r[i] = (r + 1) * (i - 3) + r / 2 (exact in f32), in place
local n = 7
local function tval(r, i) return (r + 1) * (i - 3) + r / 2 end
local function make() local t = fsdp.zeros{n}; for i = 1, n do t:set(i, tval(rank, i)) end; return t end
for _, op in ipairs { "sum", "mean", "max", "min" } do
  local t = make()
  local ret = fsdp.all_reduce(t, op, "t." .. op)
  check(rawequal(ret, t), "%s: all_reduce returns the tensor it reduced in place", op)
  for i = 1, n do
    local acc = tval(0, i)
    for r = 1, world - 1 do
      local v = tval(r, i)
      if op == "sum" or op == "mean" then acc = acc + v
      elseif op == "max" then acc = math.max(acc, v) else acc = math.min(acc, v) end
    end
    if op == "mean" then acc = acc / world end
    check(t:get(i) == acc, "tensor %s [%d] = %.9g, serial %.9g", op, i, t:get(i), acc)
  end
end
-- a 2-D contiguous tensor is fine; a strided view is refused with a clear error
local m = fsdp.ones{2, 3}
fsdp.all_reduce(m, "sum")
check(m:get(2, 3) == world, "2-D tensor sum")
local ok, err = pcall(fsdp.all_reduce, fsdp.ones{2, 3}:transpose(1, 2), "sum")
check(not ok and tostring(err):find("contiguous", 1, true), "strided view: %s", tostring(err))
-- a tensor of a live autograd graph (or a view of one) is refused before anything is sent, on
-- every rank that passes one, as a strided view is; the collectives below run on
local xg = fsdp.ones{3}
xg.requires_grad = true
local yg = xg * 2
ok, err = pcall(fsdp.all_reduce, yg, "sum")
check(not ok and tostring(err):find("all_reduce: this tensor (3) was made by affine", 1, true),
  "graph tensor: %s", tostring(err))
ok, err = pcall(fsdp.broadcast, yg:detach(), 0)
check(not ok and tostring(err):find("broadcast: this tensor (3) shares the memory", 1, true),
  "view of a graph tensor: %s", tostring(err))
check(yg:get(1) == 2 and yg:get(3) == 2, "the refused tensor is unchanged")
check(fsdp.all_reduce(yg:sum():item(), "sum") == 6 * world, "its :item() reduces")

-- bitwise: a sum of non-exact floats is the same bits on every rank (fixed order)
fsdp.manual_seed(100 + rank)
local x = fsdp.randn{257}
fsdp.all_reduce(x, "sum")
local from0 = x:clone()
fsdp.broadcast(from0, 0)
for i = 1, 257 do check(same_bits(x:get(i), from0:get(i)), "sum differs from rank 0's at %d", i) end

-- numbers travel as f64: a double past 2^53 and the bits of 0.1 arrive exactly; integers sum
-- exactly as far as a double holds them; an array of numbers reduces element by element
local big = 2 ^ 60 + 2 ^ 8 * (rank + 1) -- exact doubles, not exact in f32
check(fsdp.broadcast(big, 0) == 2 ^ 60 + 2 ^ 8, "broadcast of 2^60 + 256: %.17g", fsdp.broadcast(big, 0))
check(fsdp.all_reduce(2 ^ 53 - 1 - rank, "max") == 2 ^ 53 - 1, "max of integers below 2^53")
local isum = 0
for r = 0, world - 1 do isum = isum + (2 ^ 50 + r) end
check(fsdp.all_reduce(2 ^ 50 + rank, "sum") == isum, "a sum of integers near 2^50")
local arr = fsdp.all_reduce({rank, 0.1 * rank, -rank}, "max")
check(#arr == 3 and arr[1] == world - 1 and arr[2] == 0.1 * (world - 1) and arr[3] == 0,
  "array max: %s %s %s", tostring(arr[1]), tostring(arr[2]), tostring(arr[3]))
check(#fsdp.all_reduce({}, "sum") == 0, "an empty array")

-- broadcast: numbers and tensors from every root
for root = 0, world - 1 do
  local v = fsdp.broadcast(1000 * rank + 0.1, root)
  check(v == 1000 * root + 0.1, "broadcast of a number from %d gave %s", root, tostring(v))
  local t = fsdp.full({3}, rank + 0.25)
  local ret = fsdp.broadcast(t, root, "bcast")
  check(rawequal(ret, t), "broadcast returns its tensor")
  check(t:get(1) == root + 0.25 and t:get(3) == root + 0.25, "broadcast tensor from %d", root)
end
check(fsdp.broadcast(7 + rank) == 7, "the default root is 0")

-- barrier: rank 0 arrives 0.2 s late; nobody leaves before it arrived (core.clock is the
-- process-wide monotonic clock, so the ranks' readings compare)
fsdp.barrier("align")
local arrived = 0
if rank == 0 then
  local t0 = core.clock()
  while core.clock() - t0 < 0.2 do end
  arrived = core.clock()
end
fsdp.barrier("late")
local left = core.clock()
arrived = fsdp.broadcast(arrived, 0)
check(left >= arrived, "left the barrier %.4f s before rank 0 arrived", arrived - left)

-- argument errors are raised on the calling rank, before any collective
local function fails_with(text, f, ...)
  local ok2, e = pcall(f, ...)
  check(not ok2 and tostring(e):find(text, 1, true), "expected an error with %q, got %s", text,
    tostring(e))
end
fails_with("unknown op 'avg' (sum, mean, max, min)", fsdp.all_reduce, 1, "avg")
fails_with("op must be a string", fsdp.all_reduce, 1, 3)
fails_with("expected a number, an array of numbers or a tensor, got string", fsdp.all_reduce, "s")
fails_with("element 2 of the array is string, not a number", fsdp.all_reduce, {1, "x"}, "sum")
fails_with("expected a number or a tensor, got string", fsdp.broadcast, "s", 0)
fails_with(("root %d is not a rank in [0, %d)"):format(world, world), fsdp.broadcast, 1, world)
fails_with("root -1 is not a rank", fsdp.broadcast, 1, -1)
fails_with("root 0.5 is not a rank", fsdp.broadcast, 1, 0.5)
fails_with("root must be a rank number, got string", fsdp.broadcast, 1, "0")
fails_with("label must be a string", fsdp.barrier, 12)
local freed = fsdp.ones{2}
freed:free()
fails_with("tensor was freed", fsdp.all_reduce, freed, "sum")

-- comm_stats: counted per rank, per op, with bytes of the logical buffer
fsdp.reset_comm_stats()
local s0 = fsdp.comm_stats()
check(s0.calls == 0 and s0.all_reduce_bytes == 0, "reset_comm_stats")
fsdp.all_reduce(fsdp.zeros{10}, "sum")    -- 40 bytes
fsdp.all_reduce(fsdp.zeros{6}, "max")     -- 24 bytes
fsdp.all_reduce(1.5, "sum")               -- a number: one f64, 8 bytes
fsdp.broadcast(fsdp.zeros{5}, 0)          -- 20 bytes
fsdp.broadcast(2.5, 0)                    -- 8 bytes
fsdp.barrier()
fsdp.barrier()
local s = fsdp.comm_stats()
check(s.all_reduce_calls == 3, "all_reduce_calls %s", tostring(s.all_reduce_calls))
check(s.all_reduce_bytes == 40 + 24 + 8, "all_reduce_bytes %s", tostring(s.all_reduce_bytes))
check(s.broadcast_calls == 2 and s.broadcast_bytes == 28, "broadcast %s calls %s bytes",
  tostring(s.broadcast_calls), tostring(s.broadcast_bytes))
check(s.barrier_calls == 2 and s.barrier_bytes == 0, "barrier_calls %s", tostring(s.barrier_calls))
check(s.all_gather_calls == 0 and s.reduce_scatter_calls == 0 and s.all_gather_bytes == 0
  and s.reduce_scatter_bytes == 0, "no all_gather / reduce_scatter issued")
check(s.calls == 7, "calls %s", tostring(s.calls))
check(type(s.busy_s) == "number" and s.busy_s >= 0 and type(s.wait_s) == "number" and s.wait_s >= 0,
  "busy_s / wait_s")
local rec = core.flight_recorder()
check(rec:find("barrier", 1, true) and rec:find("broadcast f32 x5", 1, true)
  and rec:find("broadcast f64 x1", 1, true) and rec:find("all_reduce f64 x1", 1, true),
  "flight recorder lacks the last collectives:\n%s", rec)

print(("ok %d %d"):format(rank, world))
