#!/bin/sh
# Deferred initialisation at N ranks:
#   meta_equal.lua      1/2/3/4 ranks: a meta model wrapped and materialized equals the eager
#                       build bitwise (each rank's shard slices, and gathered); from the init
#                       records nothing is gathered; custom reset_parameters and wrap{init = fn}
#   meta_sync.lua       2/3/4 ranks: rank 0 holds real weights, the others meta;
#                       sync_module_states gives everyone rank 0's values, one unit at a time
#                       (memory bound checked), tie kept; a model without ties; rank 0 on meta
#                       is a clear error everywhere
#   meta_load.lua       1/2/4 ranks: a tensor table on rank 0 only, meta models everywhere; load
#                       after wrapping (one parameter in flight), load + sync, tied names, errors
#   meta_load_file.lua  1/2/4 ranks: a checkpoint written by fsdp.save loaded into meta models:
#                       fsdp.load on every rank, the file read on rank 0 only, rank 0 + sync,
#                       a plain meta model; a bf16 copy of the file, both ways
. "${0%/*}/lib.sh"
meta() { # meta N SCRIPT [ARGS]
  n=$1 s=$2
  shift 2
  must "$s at $n ranks" "$FSDPRUN" -n "$n" "tests/dist/$s" "$@"
  echo "ok: $(tail -1 "$T/log")"
}
for n in 1 2 3 4; do meta "$n" meta_equal.lua; done
for n in 2 3 4; do meta "$n" meta_sync.lua; done
for n in 1 2 4; do meta "$n" meta_load.lua; done
for n in 1 2 4; do
  rm -rf "$T/f" && mkdir -p "$T/f"
  meta "$n" meta_load_file.lua --dir="$T/f"
done
finish
