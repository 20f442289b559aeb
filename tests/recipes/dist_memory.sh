#!/bin/sh
# Memory proof: tests/dist/memory.lua asserts, on every rank, that fsdp.memory() shows the
# sharded footprint (params + grads + optim = 16 total/N bytes between steps) and peaks at the
# gathered units the schedule predicts, within 5%; at 1, 2 and 4 ranks, with and without
# prefetch. tests/dist/memory_live.lua asserts the live figures exactly after wrapping and
# after each step (nothing dead left counted), at 1, 2 and 4 ranks and on a plain model.
set -eu
for n in 1 2 4; do
  for prefetch in true false; do
    out=$("$FSDPRUN" -n "$n" tests/dist/memory.lua --prefetch=$prefetch 2>&1) || {
      echo "$out"; echo "FAIL: memory at $n ranks, prefetch $prefetch"; exit 1; }
    echo "ok: $out"
  done
  out=$("$FSDPRUN" -n "$n" tests/dist/memory_live.lua 2>&1) || {
    echo "$out"; echo "FAIL: live memory at $n ranks"; exit 1; }
  echo "ok: $out"
done
out=$("$FSDPRUN" tests/dist/memory_live.lua --plain 2>&1) || {
  echo "$out"; echo "FAIL: live memory of a plain model"; exit 1; }
echo "ok: $out"
