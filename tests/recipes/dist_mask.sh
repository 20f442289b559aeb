#!/bin/sh
# Masks that live with the shards: the SparseML report as a test (references saved
# before wrapping, pruning through them after, the sharded model changed and still pruned after
# 10 optimizer steps, sparsity read without gathering; tests/dist/mask_sparseml.lua), and masks
# through wrap/unwrap/re-wrap/gather/reshard with only this rank's slice in memory
# (tests/dist/mask_rewrap.lua), at 1, 2, 3 and 4 ranks.
. "${0%/*}/lib.sh"
for t in mask_sparseml mask_rewrap; do
  for n in 1 2 3 4; do
    must "$t at $n ranks" "$FSDPRUN" -n "$n" tests/dist/$t.lua
    echo "ok: $t at $n ranks: $(grep '^rank 0:' "$T/log")"
  done
done
finish
