#!/bin/sh
# Traffic proof: fsdp.comm_stats() per training step equals the schedule of each strategy
# (tests/dist/comm_bytes.lua states it and asserts it exactly, on every rank), at 2 and 4 ranks.
set -eu
for n in 2 4; do
  out=$("$FSDPRUN" -n "$n" tests/dist/comm_bytes.lua 2>&1) || {
    echo "$out"; echo "FAIL: comm_bytes at $n ranks"; exit 1; }
  echo "$out"
  echo "ok: comm_stats bytes and calls per step as the schedule says, $n ranks"
done
