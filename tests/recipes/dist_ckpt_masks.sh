#!/bin/sh
# Masks through checkpoints (tests/dist/ckpt_masks.lua): saved at 2 ranks (sharded slices and
# "<path>:mask" tensors in safetensors), loaded at 1, 2 and 4 ranks into wrapped and plain
# models with the same masks and values; masked weights stay 0 when training on.
. "${0%/*}/lib.sh"
mkdir -p "$T/ck"
for cfg in "2 save" "1 load" "2 load" "4 load"; do
  set -- $cfg
  on_ranks "$1" tests/dist/ckpt_masks.lua --dir="$T/ck" --ref="$T/ref.json" --phase="$2"
done
finish
