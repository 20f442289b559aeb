#!/bin/sh
# Smoke test of recipes/fashion_mlp.lua in a short mode: 1 epoch over 6000 training images,
# evaluated on 2000 test images. It must train (accuracy well above chance, 0.1) and print it.
set -eu
out=$("$FSDPRUN" recipes/fashion_mlp.lua --epochs=1 --limit=6000 --test_limit=2000 2>&1) || {
  echo "$out"; echo "FAIL: fashion_mlp exited nonzero"; exit 1; }
acc=$(echo "$out" | sed -n 's/^test accuracy \([0-9.]*\).*/\1/p')
[ -n "$acc" ] || { echo "$out"; echo "FAIL: no 'test accuracy' line"; exit 1; }
awk -v a="$acc" 'BEGIN { exit !(a >= 0.6) }' || { echo "$out"; echo "FAIL: accuracy $acc < 0.6"; exit 1; }
echo "ok: fashion_mlp short run, test accuracy $acc"
