#!/bin/sh
# Masks through checkpoints (tests/dist/ckpt_masks.lua): saved at 2 ranks (sharded slices and
# "<path>:mask" tensors in safetensors), loaded at 1, 2 and 4 ranks into wrapped and plain
# models with the same masks and values; masked weights stay 0 when training on.
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { # run N ARGS...
  n=$1; shift
  out=$("$FSDPRUN" -n "$n" tests/dist/ckpt_masks.lua --dir="$tmp" --ref="$tmp/ref.json" "$@" 2>&1) || {
    echo "$out"; echo "FAIL: ckpt_masks -n $n $*"; exit 1; }
  echo "$out"
}
run 2 --phase=save
run 1 --phase=load
run 2 --phase=load
run 4 --phase=load
