#!/bin/sh
# dist_collective.sh — fsdp.collective (tests/dist/collective.lua) at 1 to 4 ranks, without -n,
# and under mpirun -np 3 when mpirun is installed: every rank prints "ok <rank> <world>".
. "${0%/*}/lib.sh"
expect() { # N COMMAND...: the command prints "ok r N" for every rank r
  n=$1
  shift
  if ! "$@" >"$T/out" 2>&1; then
    cat "$T/out"
    echo "FAIL: $*"
    failures=$((failures + 1))
    return
  fi
  r=0
  while [ "$r" -lt "$n" ]; do
    grep -qx "ok $r $n" "$T/out" || { cat "$T/out"; echo "FAIL: $*: rank $r did not finish"; failures=$((failures + 1)); }
    r=$((r + 1))
  done
  echo "ok: $*"
}
for n in 1 2 3 4; do expect "$n" "$FSDPRUN" -n "$n" tests/dist/collective.lua; done
expect 1 "$FSDPRUN" tests/dist/collective.lua
if command -v mpirun >/dev/null 2>&1; then
  expect 3 timeout -k 5 120 mpirun --oversubscribe --allow-run-as-root \
    --mca btl_base_warn_component_unused 0 -np 3 "$FSDPRUN" tests/dist/collective.lua
else
  echo "(mpirun not installed: the mpi backend's run is skipped)"
fi
finish
