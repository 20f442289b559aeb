#!/bin/sh
# The fairscale/Lightning re-wrap scenario (tests/dist/rewrap.lua) at 1, 2 and 4 ranks.
. "${0%/*}/lib.sh"
for n in 1 2 4; do
  must "rewrap at $n ranks" "$FSDPRUN" -n "$n" tests/dist/rewrap.lua
  echo "ok: $n ranks: $(cat "$T/log")"
done
finish
