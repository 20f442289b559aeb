#!/bin/sh
# Smoke test of recipes/fashion_mlp.lua in a short mode: 1 epoch over 6000 training images,
# evaluated on 2000 test images. It must train (accuracy well above chance, 0.1) and print it.
. "${0%/*}/lib.sh"
must "fashion_mlp exited nonzero" \
  "$FSDPRUN" recipes/fashion_mlp.lua --epochs=1 --limit=6000 --test_limit=2000
acc=$(sed -n 's/^test accuracy \([0-9.]*\).*/\1/p' "$T/log")
[ -n "$acc" ] || die_log "no 'test accuracy' line"
awk -v a="$acc" 'BEGIN { exit !(a >= 0.6) }' || die_log "accuracy $acc < 0.6"
echo "ok: fashion_mlp short run, test accuracy $acc"
finish
