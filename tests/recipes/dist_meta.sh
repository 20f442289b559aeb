#!/bin/sh
# Deferred initialisation at N ranks (issue 4):
#   meta_equal.lua  1/2/3/4 ranks: a meta model wrapped and materialized equals the eager build
#                   bitwise (each rank's shard slices, and gathered); from the init records
#                   nothing is gathered; custom reset_parameters and wrap{init = fn} work
#   meta_sync.lua   2/3/4 ranks: rank 0 holds real weights, the others meta; sync_module_states
#                   gives everyone rank 0's values, one unit at a time (memory bound checked),
#                   tie kept; a model without ties; rank 0 on meta is a clear error everywhere
#   meta_load.lua   1/2/4 ranks: tensors on rank 0 only, meta models everywhere; load after
#                   wrapping (one parameter in flight), load + sync, tied names, strict errors
set -eu
run() { # run N SCRIPT
  out=$("$FSDPRUN" -n "$1" "tests/dist/$2" 2>&1) || { echo "$out"; echo "FAIL: $2 at $1 ranks"; exit 1; }
  echo "ok: $(echo "$out" | tail -1)"
}
for n in 1 2 3 4; do run "$n" meta_equal.lua; done
for n in 2 3 4; do run "$n" meta_sync.lua; done
for n in 1 2 4; do run "$n" meta_load.lua; done
