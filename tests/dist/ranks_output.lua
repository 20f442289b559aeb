-- ranks_output.lua — run by tests/recipes/dist_ranks.sh: every rank prints many long lines at
-- once (print with several arguments, so each line is built from pieces); the script checks
-- that no line of one rank is cut by another's.
local fsdp = require "fsdp"
local rank = fsdp.rank()
local lines = tonumber(fsdp.args.lines) or 300
local piece = string.rep(tostring(rank), 97)
fsdp.barrier()
for i = 1, lines do
  print("line", rank, piece, piece, piece, i)
end
