-- rank_env.lua — torchrun's environment variables per rank (src/host/setup.c; under mpirun also
-- src/cli/fsdprun.c): os.getenv("RANK"), WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE give this
-- rank's own values, also when ranks are threads of one process; --child: a program the rank
-- starts sees them too (one rank per process: mpirun, or a single rank). Run by
-- tests/recipes/dist_rank_env.sh; fails with a message naming the variable.
local fsdp = require "fsdp"
local collective = require "fsdp.collective"
local args = fsdp.args {
  {"local_world", nil, "integer", "the LOCAL_WORLD_SIZE expected (default: the world size)"},
  {"child", false, "boolean", "also check a child process's environment"},
}
local rank, world = fsdp.rank(), fsdp.world_size()
local lw = args.local_world or world
local want = {RANK = rank, WORLD_SIZE = world, LOCAL_RANK = rank % lw, LOCAL_WORLD_SIZE = lw}
for _, k in ipairs {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"} do
  local v = os.getenv(k)
  if v ~= tostring(want[k]) then
    error(("rank %d: os.getenv(%q) is %s, expected %d"):format(rank, k, tostring(v), want[k]), 0)
  end
end
assert(os.getenv("PATH") ~= nil, "os.getenv no longer reads the environment")
if args.child then
  local p = io.popen('echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE"')
  local got = p:read("*l")
  p:close()
  local exp = ("%d %d %d %d"):format(want.RANK, want.WORLD_SIZE, want.LOCAL_RANK, want.LOCAL_WORLD_SIZE)
  if got ~= exp then error(("rank %d: a child process sees '%s', expected '%s'"):format(rank, got, exp), 0) end
end
-- every rank a different RANK: gathered, 0..world-1 each once
local all = collective.all_gather(os.getenv("RANK"))
for r = 0, world - 1 do
  if all[r + 1] ~= tostring(r) then error(("rank %d says RANK=%s"):format(r, tostring(all[r + 1])), 0) end
end
if rank == 0 then print(("rank env ok: %d ranks"):format(world)) end
