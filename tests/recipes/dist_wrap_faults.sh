#!/bin/sh
# A fault injected mid-forward and mid-backward of sharded training on one rank
# (tests/dist/wrap_faults.lua): fsdprun exits 1 within 10 s (the collective timeout is 30 s:
# peers must fail at once from the poisoned group, not time out), and rank 0 reports
# "rank 1 failed: injected ...". Without a fault the same run finishes (exit 0).
. "${0%/*}/lib.sh"
for at in forward backward; do
  for n in 2 4; do
    t0=$(date +%s)
    run "$FSDPRUN" -n "$n" --timeout=30 tests/dist/wrap_faults.lua --at=$at
    dt=$(($(date +%s) - t0))
    what="$at fault at $n ranks"
    [ "$rc" -eq 1 ] || die "$what: exit $rc, expected 1; $(cat "$T/out" "$T/err")"
    [ "$dt" -le 10 ] || die "$what took ${dt}s; $(cat "$T/out" "$T/err")"
    grep -q "^fsdprun: \[rank 0\] .*rank 1 failed: .*injected fault" "$T/err" ||
      die "$what: rank 0 does not report rank 1's failure; $(cat "$T/out" "$T/err")"
    echo "ok: $at fault on rank 1 of $n: exit 1 in ${dt}s; $(grep '^fsdprun: \[rank 0\]' "$T/err" | head -1)"
  done
done
must "the run without a fault" "$FSDPRUN" -n 2 tests/dist/wrap_faults.lua --step=99
echo "ok: without a fault the run finishes"
finish
