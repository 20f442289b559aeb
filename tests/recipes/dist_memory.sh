#!/bin/sh
# Memory proof: tests/dist/memory.lua asserts, on every rank, that fsdp.memory() shows the
# sharded footprint (params + grads + optim = 16 total/N bytes between steps) and peaks at the
# gathered units the schedule predicts, within 5%; at 1, 2 and 4 ranks, with and without
# prefetch. tests/dist/memory_live.lua asserts the live figures exactly after wrapping and
# after each step (nothing dead left counted), at 1, 2 and 4 ranks and on a plain model.
. "${0%/*}/lib.sh"
for n in 1 2 4; do
  for prefetch in true false; do
    must "memory at $n ranks, prefetch $prefetch" \
      "$FSDPRUN" -n "$n" tests/dist/memory.lua --prefetch=$prefetch
    echo "ok: $(cat "$T/log")"
  done
  must "live memory at $n ranks" "$FSDPRUN" -n "$n" tests/dist/memory_live.lua
  echo "ok: $(cat "$T/log")"
done
must "live memory of a plain model" "$FSDPRUN" tests/dist/memory_live.lua --plain
echo "ok: $(cat "$T/log")"
finish
