#!/bin/sh
# Damaged checkpoints and collective safety (tests/dist/ckpt_faults.lua) at 2 and 4 ranks:
# truncated / corrupted / wrong-magic / missing / foreign files, broken indexes, a world size
# the index cannot serve, damaged safetensors files read by ranges; disk full, permission
# denied and fsync failures injected on a non-zero rank while saving, a failed index commit:
# every rank raises the same error, the model is untouched, the previous checkpoint loads.
. "${0%/*}/lib.sh"
for n in 2 4; do
  rm -rf "$T/d" && mkdir -p "$T/d"
  on_ranks "$n" tests/dist/ckpt_faults.lua --dir="$T/d"
done
finish
