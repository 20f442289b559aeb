#!/bin/sh
# Mixed precision with the rest of fsdp (tests/dist/mp_features.lua lists the checks): dtypes in
# and out of forward, training close to f32, masks and pruning, ties, full_params/apply (also
# between a forward and its backward), unwrap and re-wrap with another policy, inner wraps with
# their own policy, sync_module_states and meta init, reduce = "bf16", option errors, f32 token
# ids; at 1, 2 and 4 ranks.
. "${0%/*}/lib.sh"
for n in 1 2 4; do
  on_ranks "$n" tests/dist/mp_features.lua
done
finish
