#!/bin/sh
# Traffic proof: fsdp.comm_stats() per training step equals the schedule of each strategy
# (tests/dist/comm_bytes.lua states it and asserts it exactly, on every rank), at 2 and 4 ranks.
. "${0%/*}/lib.sh"
for n in 2 4; do
  on_ranks "$n" tests/dist/comm_bytes.lua
  echo "ok: comm_stats bytes and calls per step as the schedule says, $n ranks"
done
finish
