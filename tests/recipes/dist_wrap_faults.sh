#!/bin/sh
# A fault injected mid-forward and mid-backward of sharded training on one rank
# (tests/dist/wrap_faults.lua): fsdprun exits 1 within 10 s (the collective timeout is 30 s:
# peers must fail at once from the poisoned group, not time out), and rank 0 reports
# "rank 1 failed: injected ...". Without a fault the same run finishes (exit 0).
set -eu
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for at in forward backward; do
  for n in 2 4; do
    t0=$(date +%s)
    rc=0
    "$FSDPRUN" -n "$n" --timeout=30 tests/dist/wrap_faults.lua --at=$at >"$tmp" 2>&1 || rc=$?
    dt=$(( $(date +%s) - t0 ))
    [ "$rc" -eq 1 ] || { cat "$tmp"; echo "FAIL: $at fault at $n ranks: exit $rc, expected 1"; exit 1; }
    [ "$dt" -le 10 ] || { cat "$tmp"; echo "FAIL: $at fault at $n ranks took ${dt}s"; exit 1; }
    grep -q "^fsdprun: \[rank 0\] .*rank 1 failed: .*injected fault" "$tmp" || {
      cat "$tmp"; echo "FAIL: $at fault at $n ranks: rank 0 does not report rank 1's failure"; exit 1; }
    echo "ok: $at fault on rank 1 of $n: exit 1 in ${dt}s; $(grep '^fsdprun: \[rank 0\]' "$tmp" | head -1)"
  done
done
"$FSDPRUN" -n 2 tests/dist/wrap_faults.lua --step=99 >"$tmp" 2>&1 || {
  cat "$tmp"; echo "FAIL: the run without a fault failed"; exit 1; }
echo "ok: without a fault the run finishes"
