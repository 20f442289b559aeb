#!/bin/sh
# Parameters without a gradient (tests/dist/skip_grad.lua): a wrapped model at 1, 2 and 4 ranks
# trains like the plain model at 1 rank on the same global batch, whose optimizer skips a
# parameter whose p.grad is nil. Cases: layer drop (a block skipped on steps 3 and 6), an
# unused parameter inside a unit (and one in the root), a root parameter whose gradient only
# comes from outside the forward (on even steps), and a mixture of experts whose experts get
# rows on some ranks, all ranks or none. AdamW with weight decay, 8 steps; strategy "full" at
# 1, 2 and 4 ranks, "grad_op" and "none" at 2, SGD with momentum at 2. Losses and final
# parameters within 1e-5 relative (tests/dist/compare.lua, as dist_equivalence.sh); the script
# itself checks u:has_grad after every backward and the optimizer step counts. For each case, a
# plain run that gives every missing gradient a zero one (what stepping every shard slice does)
# must FAIL the comparison, so the comparison can fail. Last, a block skipped on ONE rank only
# stops every rank within seconds in that step's backward, the collectives' mismatch named.
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
T=tests/dist/skip_grad.lua
run() { # run N OUT ARGS...
  n=$1; out=$2; shift 2
  "$FSDPRUN" -n "$n" "$T" --out="$out" "$@" >"$tmp/log" 2>&1 || {
    cat "$tmp/log"; echo "FAIL: skip_grad -n $n $* exited nonzero"; exit 1; }
}
compare() { # compare REF OUT LABEL
  res=$("$FSDPRUN" tests/dist/compare.lua "$1" "$2" 2>&1) || {
    echo "$res"; echo "FAIL: $3"; exit 1; }
  echo "ok: $3: $res"
}
for case in drop unused outside moe; do
  run 1 "$tmp/ref" --case=$case --mode=plain
  for n in 1 2 4; do
    run "$n" "$tmp/out" --case=$case --mode=full
    compare "$tmp/ref" "$tmp/out" "$case, full at $n ranks vs 1 rank unwrapped"
  done
  for mode in grad_op none; do
    run 2 "$tmp/out" --case=$case --mode=$mode
    compare "$tmp/ref" "$tmp/out" "$case, $mode at 2 ranks vs 1 rank unwrapped"
  done
  run 1 "$tmp/out" --case=$case --mode=plain --zero_fill=true
  if "$FSDPRUN" tests/dist/compare.lua "$tmp/ref" "$tmp/out" >"$tmp/log" 2>&1; then
    cat "$tmp/log"; echo "FAIL: $case: zero gradients instead of none passed the comparison"; exit 1
  fi
  echo "ok: $case: zero gradients instead of none fail the comparison: $(cat "$tmp/log")"
  run 1 "$tmp/ref" --case=$case --mode=plain --opt=sgd
  run 2 "$tmp/out" --case=$case --mode=full --opt=sgd
  compare "$tmp/ref" "$tmp/out" "$case, SGD with momentum, full at 2 ranks vs 1 rank unwrapped"
done

# the skip decision differs across ranks: every rank fails at once, in that step's backward
for n in 2 4; do
  t0=$(date +%s)
  rc=0
  timeout 60 "$FSDPRUN" -n "$n" --timeout=30 "$T" --case=drop --odd_rank=1 >"$tmp/log" 2>&1 || rc=$?
  dt=$(($(date +%s) - t0))
  [ "$rc" -eq 1 ] || { cat "$tmp/log"; echo "FAIL: one rank skipping at $n ranks: exit $rc, expected 1"; exit 1; }
  [ "$dt" -le 10 ] || { cat "$tmp/log"; echo "FAIL: one rank skipping at $n ranks took ${dt}s"; exit 1; }
  for r in $(seq 0 $((n - 1))); do
    grep "^fsdprun: \[rank $r\]" "$tmp/log" | grep -q "collective mismatch at #[0-9]*: .*'body\.[23]'" || {
      cat "$tmp/log"; echo "FAIL: one rank skipping at $n ranks: rank $r does not name the mismatch"; exit 1; }
  done
  grep -q "in main chunk" "$tmp/log" && grep -q "'backward'" "$tmp/log" || {
    cat "$tmp/log"; echo "FAIL: one rank skipping at $n ranks: not stopped in backward"; exit 1; }
  echo "ok: a block skipped on rank 1 only, $n ranks: exit 1 in ${dt}s; $(grep '^fsdprun: \[rank 0\]' "$tmp/log" | head -1)"
done
