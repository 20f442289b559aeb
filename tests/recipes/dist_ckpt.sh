#!/bin/sh
# Checkpoint round trips (tests/dist/ckpt_roundtrip.lua): safetensors (independent parse, tie
# stored once, loads into wrapped / plain / untied models), strict-loading errors, sharded with
# optimizer state, extra, loader and schedule — at 1, 2 and 4 ranks, and with the grad_op and
# none strategies at 2 ranks.
. "${0%/*}/lib.sh"
for cfg in "1 full" "2 full" "4 full" "2 grad_op" "2 none"; do
  set -- $cfg
  rm -rf "$T/d" && mkdir -p "$T/d"
  on_ranks "$1" tests/dist/ckpt_roundtrip.lua --dir="$T/d" --strategy="$2"
done
finish
