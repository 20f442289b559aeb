#!/bin/sh
# Shards at 2, 3 and 4 ranks (tests/dist/shards.lua): slices tile parameters, apply writes back
# on every rank, sync_module_states, optimizer state split exactly once across ranks.
. "${0%/*}/lib.sh"
for n in 2 3 4; do
  must "shards at $n ranks" "$FSDPRUN" -n "$n" tests/dist/shards.lua
  echo "ok: $(cat "$T/log")"
done
finish
