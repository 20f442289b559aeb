#!/bin/sh
# Shards at 2, 3 and 4 ranks (tests/dist/shards.lua): slices tile parameters, apply writes back
# on every rank, sync_module_states, optimizer state split exactly once across ranks.
set -eu
for n in 2 3 4; do
  out=$("$FSDPRUN" -n "$n" tests/dist/shards.lua 2>&1) || {
    echo "$out"; echo "FAIL: shards at $n ranks"; exit 1; }
  echo "ok: $out"
done
