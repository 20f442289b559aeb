#!/bin/sh
# Smoke test of recipes/fashion_mlp.lua in a short mode: 1 epoch over 6000 training images,
# evaluated on 2000 test images. It must train (accuracy well above chance, 0.1) and print it;
# at 2 ranks both ranks must print the same accuracy.
. "${0%/*}/lib.sh"
must "fashion_mlp exited nonzero" \
  "$FSDPRUN" recipes/fashion_mlp.lua --epochs=1 --limit=6000 --test_limit=2000
acc=$(sed -n 's/^test accuracy \([0-9.]*\).*/\1/p' "$T/log")
[ -n "$acc" ] || die_log "no 'test accuracy' line"
awk -v a="$acc" 'BEGIN { exit !(a >= 0.6) }' || die_log "accuracy $acc < 0.6"
echo "ok: fashion_mlp short run, test accuracy $acc"
# at 2 ranks the recipe wraps (one model, sharded): every rank reports the same accuracy
must "fashion_mlp at 2 ranks exited nonzero" \
  "$FSDPRUN" -n 2 recipes/fashion_mlp.lua --epochs=1 --limit=6000 --test_limit=2000
sed -n 's/^\(test accuracy .*\)/\1/p' "$T/log" >"$T/acc"
[ "$(wc -l <"$T/acc")" = 2 ] || die_log "not one 'test accuracy' line per rank"
[ "$(sort -u "$T/acc" | wc -l)" = 1 ] || die_log "the ranks report different accuracies: $(cat "$T/acc")"
acc2=$(sed -n '1s/^test accuracy \([0-9.]*\).*/\1/p' "$T/acc")
awk -v a="$acc2" 'BEGIN { exit !(a >= 0.6) }' || die_log "accuracy at 2 ranks $acc2 < 0.6"
echo "ok: fashion_mlp at 2 ranks, both ranks' test accuracy $acc2"
finish
