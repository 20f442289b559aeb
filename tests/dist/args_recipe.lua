-- args_recipe.lua — a recipe that declares its arguments (lua/fsdp/args.lua), for
-- tests/recipes/cli_args.sh: it prints what it got on rank 0, then a line per rank that it ran
-- on, so a --help or a refusal that let it run shows.
local fsdp = require "fsdp"
local args = fsdp.args {
  description = "A recipe with declared arguments.",
  {"steps", 200, "integer", "optimizer steps", min = 1},
  {"lr", 1e-3, "number", "learning rate"},
  {"mp", nil, "string", "mixed precision", choices = {"bf16", "f16"}},
  {"resume", false, "boolean", "continue from the checkpoint"},
}
fsdp.barrier()
if fsdp.rank() == 0 then
  print(("steps=%d lr=%g mp=%s resume=%s same=%s"):format(args.steps, args.lr, tostring(args.mp),
    tostring(args.resume), tostring(rawequal(args, fsdp.args))))
end
fsdp.barrier()
print(("ran on rank %d"):format(fsdp.rank()))
