#!/bin/sh
# Frozen parameters (tests/dist/freeze.lua): a wrapped GPT with some parameters frozen
# (model:freeze) trains at 1, 2 and 4 ranks ("full"; "grad_op" and "none" at 2) like the plain
# model at 1 rank on the same global batch: losses and final parameters within 1e-5 relative
# (tests/dist/compare.lua). Cases: a fully frozen block that gradients pass through, frozen
# embeddings and first block (no gradient reaches it), every attention frozen (partly frozen
# units), only ln_f trainable. The script itself checks that frozen parameters get no gradient
# and keep their bits, and (wrapped) that gradient and optimizer memory and, for "full", the
# bytes and calls of every collective are what the frozen units save. A run that freezes
# nothing must FAIL the comparison; unfreezing after two steps trains as the plain model does;
# freezing on one rank only stops every rank with the collectives' mismatch named.
. "${0%/*}/lib.sh"
S=tests/dist/freeze.lua
freeze() { # freeze N OUT ARGS...
  fz_n=$1 fz_out=$2
  shift 2
  must "freeze -n $fz_n $*" "$FSDPRUN" -n "$fz_n" "$S" --out="$fz_out" "$@"
  grep "^freeze " "$T/log" || true
}
for case in top bottom attn ln_f; do
  freeze 1 "$T/ref" --case=$case --mode=plain
  for n in 1 2 4; do
    freeze "$n" "$T/out" --case=$case --mode=full
    compare "$T/ref" "$T/out" "$case, full at $n ranks vs 1 rank unwrapped"
  done
  for mode in grad_op none; do
    freeze 2 "$T/out" --case=$case --mode=$mode
    compare "$T/ref" "$T/out" "$case, $mode at 2 ranks vs 1 rank unwrapped"
  done
done
freeze 1 "$T/out" --case=top --mode=plain --no_freeze=true
compare_fails "$T/ref" "$T/out" "nothing frozen instead of ln_f alone"

freeze 1 "$T/ref" --case=top --mode=plain --unfreeze=true
freeze 2 "$T/out" --case=top --mode=full --unfreeze=true
compare "$T/ref" "$T/out" "block 3 unfrozen after step 2, full at 2 ranks vs 1 rank unwrapped"

# frozen on one rank only: the collectives differ; every rank fails, naming the mismatch
rc=0
timeout 60 "$FSDPRUN" -n 2 --timeout=30 "$S" --case=top --odd_rank=1 >"$T/log" 2>&1 || rc=$?
[ "$rc" -eq 1 ] || { cat "$T/log"; die "block 3 frozen on rank 1 only: exit $rc, expected 1"; }
for r in 0 1; do
  grep "^fsdprun: \[rank $r\]" "$T/log" | grep -q "collective mismatch" || {
    cat "$T/log"; die "frozen on rank 1 only: rank $r does not name the mismatch"; }
done
echo "ok: block 3 frozen on rank 1 only: exit 1; $(grep '^fsdprun: \[rank 0\]' "$T/log" | head -1)"
finish
