#!/bin/sh
# Pruning gives the same masks at every world size: magnitude per parameter
# and global, 2:4, 2:6 with groups cut by shard boundaries, and a GMP schedule during 100 steps
# of training (tests/dist/prune_equiv.lua). The reference runs unwrapped at 1 rank; wrapped
# runs at 2, 3 and 4 ranks (full, grad_op, none) must give identical masks, a loss curve within
# 1e-5 relative, and masked weights exactly 0 (tests/dist/prune_compare.lua). At 3 and 4 ranks
# the 2:6 phase must really have cut groups; wrapped runs assert that nothing is gathered.
# A run pruning 0.01% more must FAIL the comparison, so the check can fail.
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { # run N OUT ARGS...
  n=$1; out=$2; shift 2
  "$FSDPRUN" -n "$n" tests/dist/prune_equiv.lua --out="$out" "$@" >"$tmp/log" 2>&1 || {
    cat "$tmp/log"; echo "FAIL: prune_equiv -n $n $* exited nonzero"; exit 1; }
}
compare() { # compare REF OUT LABEL
  res=$("$FSDPRUN" tests/dist/prune_compare.lua "$1" "$2" 2>&1) || {
    echo "$res"; echo "FAIL: $3"; exit 1; }
  echo "ok: $3: $res"
}
run 1 "$tmp/ref" --strategy=plain
run 1 "$tmp/out" --strategy=full
compare "$tmp/ref" "$tmp/out" "full at 1 rank vs unwrapped"
for cfg in "2 full" "3 full" "4 full" "2 grad_op" "4 grad_op" "2 none" "4 none"; do
  set -- $cfg
  run "$1" "$tmp/out_$1_$2" --strategy="$2"
  compare "$tmp/ref" "$tmp/out_$1_$2" "$2 at $1 ranks vs 1 rank unwrapped"
done
for n in 3 4; do
  cut=$(sed -n 's/^cut //p' "$tmp/out_${n}_full")
  [ "$cut" -gt 0 ] || { echo "FAIL: no N:M group was cut at $n ranks (the test lost its point)"; exit 1; }
  echo "ok: $cut groups of 6 cut by shard boundaries at $n ranks, masks identical"
done
run 2 "$tmp/out" --strategy=full --sparsity=0.6001
if "$FSDPRUN" tests/dist/prune_compare.lua "$tmp/ref" "$tmp/out" >"$tmp/log" 2>&1; then
  cat "$tmp/log"; echo "FAIL: a perturbed run passed the comparison"; exit 1
fi
echo "ok: a perturbed run (global sparsity 0.6001) fails the comparison: $(cat "$tmp/log")"
