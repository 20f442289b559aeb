#!/bin/sh
# Smoke test of recipes/fashion_mlp.lua in a short mode: 1 epoch over 6000 training images,
# evaluated on 2000 test images. It must train (accuracy well above chance, 0.1) and print it;
# at 2 ranks the ranks must count the same accuracy, printed once; a --limit below one batch is refused.
. "${0%/*}/lib.sh"
must "fashion_mlp exited nonzero" \
  "$FSDPRUN" recipes/fashion_mlp.lua --epochs=1 --limit=6000 --test_limit=2000
acc=$(sed -n 's/^test accuracy \([0-9.]*\).*/\1/p' "$T/log")
[ -n "$acc" ] || die_log "no 'test accuracy' line"
awk -v a="$acc" 'BEGIN { exit !(a >= 0.6) }' || die_log "accuracy $acc < 0.6"
echo "ok: fashion_mlp short run, test accuracy $acc"
# at 2 ranks the recipe wraps (one model, sharded): the ranks must count the same accuracy (the
# recipe fails otherwise), which rank 0 prints once, as it prints its header
must "fashion_mlp at 2 ranks exited nonzero" \
  "$FSDPRUN" -n 2 recipes/fashion_mlp.lua --epochs=1 --limit=6000 --test_limit=2000
sed -n 's/^\(test accuracy .*\)/\1/p' "$T/log" >"$T/acc"
[ "$(wc -l <"$T/acc")" = 1 ] || die_log "not one 'test accuracy' line"
[ "$(grep -c '^fashion_mlp: ' "$T/log")" = 1 ] || die_log "not one header line"
acc2=$(sed -n '1s/^test accuracy \([0-9.]*\).*/\1/p' "$T/acc")
awk -v a="$acc2" 'BEGIN { exit !(a >= 0.6) }' || die_log "accuracy at 2 ranks $acc2 < 0.6"
echo "ok: fashion_mlp at 2 ranks, test accuracy $acc2"
# a --limit smaller than a batch is refused naming both
for r in fashion_mlp prune_mlp; do
  if "$FSDPRUN" -n 2 "recipes/$r.lua" --limit=100 --test_limit=100 --hidden=16 >"$T/log" 2>&1; then rc=0; else rc=$?; fi
  [ "$rc" -eq 1 ] || die_log "$r --limit=100: exit status $rc, expected 1"
  grep -q "$r: --limit=100 leaves fewer training images than one batch (--batch=128)" "$T/log" ||
    die_log "$r --limit=100: no message naming --limit and --batch"
done
echo "ok: --limit below one batch refused"
finish
