#!/bin/sh
# Mixed precision with the rest of fsdp (tests/dist/mp_features.lua lists the checks): dtypes in
# and out of forward, training close to f32, masks and pruning, ties, full_params/apply (also
# between a forward and its backward), unwrap and re-wrap with another policy, inner wraps with
# their own policy, sync_module_states and meta init, reduce = "bf16", option errors, f32 token
# ids; at 1, 2 and 4 ranks.
set -eu
for n in 1 2 4; do
  out=$("$FSDPRUN" -n "$n" tests/dist/mp_features.lua 2>&1) || {
    echo "$out"; echo "FAIL: mp_features at $n ranks"; exit 1; }
  echo "$out"
done
