#!/bin/sh
# Mixed-precision traffic: all-gather bytes per step with param = bf16 or f16 are exactly half
# the f32 model's, reduce-scatter bytes (all-reduce for strategy none) half with reduce = "bf16"
# and equal with reduce = "f32", full_params moves f32 masters, call counts unchanged
# (tests/dist/mp_comm.lua states and asserts it on every rank), at 2 and 4 ranks.
. "${0%/*}/lib.sh"
for n in 2 4; do
  on_ranks "$n" tests/dist/mp_comm.lua
  echo "ok: mixed-precision comm_stats bytes and calls per step, $n ranks"
done
finish
