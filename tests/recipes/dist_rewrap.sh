#!/bin/sh
# The fairscale/Lightning re-wrap scenario (tests/dist/rewrap.lua) at 1, 2 and 4 ranks.
set -eu
for n in 1 2 4; do
  out=$("$FSDPRUN" -n "$n" tests/dist/rewrap.lua 2>&1) || {
    echo "$out"; echo "FAIL: rewrap at $n ranks"; exit 1; }
  echo "ok: $n ranks: $out"
done
