#!/bin/sh
# Parameters without a gradient (tests/dist/skip_grad.lua): a wrapped model at 1, 2 and 4 ranks
# trains like the plain model at 1 rank on the same global batch, whose optimizer skips a parameter
# whose p.grad is nil. Cases: layer drop (a block skipped on steps 3 and 6), an unused parameter
# inside a unit (and one in the root), a root parameter whose gradient only comes from outside the
# forward (on even steps), a mixture of experts whose experts get rows on some ranks, all ranks or
# none, and modules whose gradients are dropped after the backward with module:zero_grad() (a unit,
# part of a unit, part of the root). AdamW with weight decay, 8 steps; strategy "full" at 1, 2 and 4
# ranks, "grad_op" and "none" at 2, SGD with momentum at 2. Losses and final parameters within 1e-5
# relative (tests/dist/compare.lua, as dist_equivalence.sh); the script itself checks u:has_grad
# after every backward and the optimizer step counts. For each case, a plain run that gives every
# missing gradient a zero one (what stepping every shard slice does) must FAIL the comparison, so
# the comparison can fail. Last, a block skipped on ONE rank only stops every rank within seconds in
# that step's backward, the collectives' mismatch named.
. "${0%/*}/lib.sh"
S=tests/dist/skip_grad.lua
skip_grad() { # skip_grad N OUT ARGS...
  sg_n=$1 sg_out=$2
  shift 2
  must "skip_grad -n $sg_n $*" "$FSDPRUN" -n "$sg_n" "$S" --out="$sg_out" "$@"
}
for case in drop unused outside moe zeroed; do
  skip_grad 1 "$T/ref" --case=$case --mode=plain
  for n in 1 2 4; do
    skip_grad "$n" "$T/out" --case=$case --mode=full
    compare "$T/ref" "$T/out" "$case, full at $n ranks vs 1 rank unwrapped"
  done
  for mode in grad_op none; do
    skip_grad 2 "$T/out" --case=$case --mode=$mode
    compare "$T/ref" "$T/out" "$case, $mode at 2 ranks vs 1 rank unwrapped"
  done
  skip_grad 1 "$T/out" --case=$case --mode=plain --zero_fill=true
  compare_fails "$T/ref" "$T/out" "$case: zero gradients instead of none"
  skip_grad 1 "$T/ref" --case=$case --mode=plain --opt=sgd
  skip_grad 2 "$T/out" --case=$case --mode=full --opt=sgd
  compare "$T/ref" "$T/out" "$case, SGD with momentum, full at 2 ranks vs 1 rank unwrapped"
done

# the skip decision differs across ranks: every rank fails at once, in that step's backward
for n in 2 4; do
  t0=$(date +%s)
  rc=0
  timeout 60 "$FSDPRUN" -n "$n" --timeout=30 "$S" --case=drop --odd_rank=1 >"$T/log" 2>&1 || rc=$?
  dt=$(($(date +%s) - t0))
  [ "$rc" -eq 1 ] || { cat "$T/log"; echo "FAIL: one rank skipping at $n ranks: exit $rc, expected 1"; exit 1; }
  [ "$dt" -le 10 ] || { cat "$T/log"; echo "FAIL: one rank skipping at $n ranks took ${dt}s"; exit 1; }
  for r in $(seq 0 $((n - 1))); do
    grep "^fsdprun: \[rank $r\]" "$T/log" | grep -q "collective mismatch at #[0-9]*: .*'body\.[23]'" || {
      cat "$T/log"; echo "FAIL: one rank skipping at $n ranks: rank $r does not name the mismatch"; exit 1; }
  done
  grep -q "in main chunk" "$T/log" && grep -q "'backward'" "$T/log" || {
    cat "$T/log"; echo "FAIL: one rank skipping at $n ranks: not stopped in backward"; exit 1; }
  echo "ok: a block skipped on rank 1 only, $n ranks: exit 1 in ${dt}s; $(grep '^fsdprun: \[rank 0\]' "$T/log" | head -1)"
done
finish
