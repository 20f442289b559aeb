-- ranks_env.lua — run by tests/recipes/dist_ranks.sh: what each rank's Lua state gets from the
-- launcher. Recipe arguments (arg, ..., fsdp.args) reach every rank; globals set by -e are per
-- state; each rank has its own memory domain (fsdp.memory() counts only its own tensors);
-- --timeout reaches every communicator; the thread rule sets every rank's cpu threads, and
-- set_threads changes only the calling rank's. Prints "env <rank> threads=<n> timeout=<s>"
-- (n as the launcher set it); any failure raises.
local fsdp = require "fsdp"
local core = fsdp.core
local rank, world = fsdp.rank(), fsdp.world_size()

local function check(cond, fmt, ...)
  if not cond then error(("rank %d: " .. fmt):format(rank, ...), 2) end
end

-- arguments: the same on every rank
local args = { ... }
check(#args == 3 and args[1] == "pos" and args[2] == "--lr=0.5" and args[3] == "--tag=x y",
  "recipe varargs: %s", table.concat(args, "|"))
check(arg[1] == "pos" and arg[3] == "--tag=x y", "arg[] %s %s", tostring(arg[1]), tostring(arg[3]))
check(fsdp.args.lr == 0.5 and fsdp.args.tag == "x y" and fsdp.args[1] == "pos", "fsdp.args")

-- -e ran in this rank's own state before the recipe (set with the rank baked in)
check(FROM_E == "e" .. rank, "global from -e: %s", tostring(FROM_E))

-- memory domains: rank r allocates (r + 1) MiB; after everybody has, each rank's live bytes
-- grew by its own allocation only
collectgarbage()
fsdp.barrier()
local before = fsdp.memory()
local mine = (rank + 1) * 262144 -- floats
local t = fsdp.zeros{mine}
fsdp.barrier()
local after = fsdp.memory()
check(after.live - before.live == 4 * mine, "live grew by %d bytes, own allocation %d",
  after.live - before.live, 4 * mine)
local total = fsdp.all_reduce(after.live - before.live, "sum")
check(total == 4 * 262144 * world * (world + 1) / 2, "sum of the ranks' growth %d", total)
t:free()

-- threads: each rank its own count
local threads = core.get_threads()
fsdp.barrier()
core.set_threads(rank + 1)
fsdp.barrier()
check(core.get_threads() == rank + 1, "set_threads(%d) then get_threads() %d", rank + 1,
  core.get_threads())
fsdp.barrier()
core.set_threads(threads)

print(("env %d threads=%d timeout=%g"):format(rank, threads, core.timeout()))
