#!/bin/sh
# Pruning gives the same masks at every world size: magnitude per parameter
# and global, 2:4, 2:6 with groups cut by shard boundaries, and a GMP schedule during 100 steps
# of training (tests/dist/prune_equiv.lua). The reference runs unwrapped at 1 rank; wrapped
# runs at 2, 3 and 4 ranks (full, grad_op, none) must give identical masks, a loss curve within
# 1e-5 relative, and masked weights exactly 0 (tests/dist/prune_compare.lua). At 3 and 4 ranks
# the 2:6 phase must really have cut groups; wrapped runs assert that nothing is gathered.
# A run pruning 0.01% more must FAIL the comparison, so the check can fail.
. "${0%/*}/lib.sh"
prune() { # prune N OUT ARGS...
  pr_n=$1 pr_out=$2
  shift 2
  must "prune_equiv -n $pr_n $*" "$FSDPRUN" -n "$pr_n" tests/dist/prune_equiv.lua --out="$pr_out" "$@"
}
same_masks() { # same_masks REF OUT LABEL
  must "$3" "$FSDPRUN" tests/dist/prune_compare.lua "$1" "$2"
  echo "ok: $3: $(cat "$T/log")"
}
prune 1 "$T/ref" --strategy=plain
prune 1 "$T/out" --strategy=full
same_masks "$T/ref" "$T/out" "full at 1 rank vs unwrapped"
for cfg in "2 full" "3 full" "4 full" "2 grad_op" "4 grad_op" "2 none" "4 none"; do
  set -- $cfg
  prune "$1" "$T/out_$1_$2" --strategy="$2"
  same_masks "$T/ref" "$T/out_$1_$2" "$2 at $1 ranks vs 1 rank unwrapped"
done
for n in 3 4; do
  cut=$(sed -n 's/^cut //p' "$T/out_${n}_full")
  [ "$cut" -gt 0 ] || die "no N:M group was cut at $n ranks (the test lost its point)"
  echo "ok: $cut groups of 6 cut by shard boundaries at $n ranks, masks identical"
done
prune 2 "$T/out" --strategy=full --sparsity=0.6001
must_fail "a perturbed run (global sparsity 0.6001): the comparison" \
  "$FSDPRUN" tests/dist/prune_compare.lua "$T/ref" "$T/out"
echo "ok: a perturbed run (global sparsity 0.6001) fails the comparison: $(cat "$T/log")"
finish
