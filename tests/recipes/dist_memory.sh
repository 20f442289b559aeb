#!/bin/sh
# Memory proof: tests/dist/memory.lua asserts, on every rank, that fsdp.memory() shows the
# sharded footprint (params + grads + optim = 16 total/N bytes between steps) and peaks at the
# gathered units the schedule predicts, within 5%; at 2 and 4 ranks, with and without prefetch.
. "${0%/*}/lib.sh"
for n in 2 4; do
  for prefetch in true false; do
    must "memory at $n ranks, prefetch $prefetch" \
      "$FSDPRUN" -n "$n" tests/dist/memory.lua --prefetch=$prefetch
    echo "ok: $(cat "$T/log")"
  done
done
finish
