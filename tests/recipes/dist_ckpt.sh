#!/bin/sh
# Checkpoint round trips (tests/dist/ckpt_roundtrip.lua): safetensors (independent parse, tie
# stored once, loads into wrapped / plain / untied models), strict-loading errors, sharded with
# optimizer state, extra, loader and schedule — at 1, 2 and 4 ranks, and with the grad_op and
# none strategies at 2 ranks.
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { # run N STRATEGY
  rm -rf "$tmp/d" && mkdir -p "$tmp/d"
  out=$("$FSDPRUN" -n "$1" tests/dist/ckpt_roundtrip.lua --dir="$tmp/d" --strategy="$2" 2>&1) || {
    echo "$out"; echo "FAIL: ckpt_roundtrip at $1 ranks, strategy $2"; exit 1; }
  echo "$out"
}
run 1 full
run 2 full
run 4 full
run 2 grad_op
run 2 none
