#!/bin/sh
# Mixed-precision traffic: all-gather bytes per step with param = bf16 or f16 are exactly half
# the f32 model's, reduce-scatter bytes (all-reduce for strategy none) half with reduce = "bf16"
# and equal with reduce = "f32", full_params moves f32 masters, call counts unchanged
# (tests/dist/mp_comm.lua states and asserts it on every rank), at 2 and 4 ranks.
set -eu
for n in 2 4; do
  out=$("$FSDPRUN" -n "$n" tests/dist/mp_comm.lua 2>&1) || {
    echo "$out"; echo "FAIL: mp_comm at $n ranks"; exit 1; }
  echo "$out"
  echo "ok: mixed-precision comm_stats bytes and calls per step, $n ranks"
done
