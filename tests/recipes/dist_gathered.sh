#!/bin/sh
# A gathered unit is a copy of its shards (tests/dist/gathered_copy.lua) at 1, 2 and 3 ranks:
# never computed from when stale, never written into and dropped.
. "${0%/*}/lib.sh"
for n in 1 2 3; do
  must "gathered copies at $n ranks" "$FSDPRUN" -n "$n" tests/dist/gathered_copy.lua
  echo "ok: $n ranks"
done
finish
