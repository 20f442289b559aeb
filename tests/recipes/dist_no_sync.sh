#!/bin/sh
# Gradient accumulation without reduction (tests/dist/no_sync.lua states and asserts it): at 1, 2
# and 4 ranks (and 2 on the mpi backend), k micro-batches with the first k - 1 backwards inside
# fsdp.no_sync equal the plain model on the whole batch within 1e-5 (losses, clip norms,
# parameters; a mask and clipping in play) for every strategy; reduce-scatter (none: all-reduce)
# bytes per optimizer step are exactly 1/k of reducing every micro-batch; fsdp.memory().grads
# shows each unit's full gradient held between micro-batches and freed by the last backward; the
# refusals and the restored state; a layer dropped from the last micro-batch, its gradient reduced
# by the clip. Last, ranks that disagree on no_sync stop at once with the mismatch named.
. "${0%/*}/lib.sh"
for n in 1 2 4; do
  on_ranks "$n" tests/dist/no_sync.lua --ckpt="$T/ckpt$n"
  echo "ok: no_sync at $n ranks"
done

# the same on the mpi backend (ranks as processes), where this build has it
if command -v mpirun >/dev/null 2>&1 &&
  "$FSDPRUN" --backend mpi -e 'assert(require("fsdp").backend() == "mpi")' >/dev/null 2>&1; then
  must_show "no_sync on the mpi backend, 2 ranks" timeout -k 5 120 \
    "$FSDPRUN" -n 2 --backend mpi tests/dist/no_sync.lua --ckpt="$T/ckpt_mpi"
  echo "ok: no_sync at 2 ranks, mpi backend"
else
  echo "note: no mpirun or no mpi backend in this build: the mpi run is left out"
fi

# whether a backward reduces must agree across ranks: rank 1 reduces micro-batch 1, rank 0 not
for n in 2 4; do
  t0=$(date +%s)
  rc=0
  timeout 60 "$FSDPRUN" -n "$n" --timeout=30 tests/dist/no_sync.lua --part=none --odd_rank=1 \
    >"$T/log" 2>&1 || rc=$?
  dt=$(($(date +%s) - t0))
  [ "$rc" -eq 1 ] || die_log "ranks disagreeing on no_sync at $n ranks: exit $rc, expected 1"
  [ "$dt" -le 10 ] || die_log "ranks disagreeing on no_sync at $n ranks took ${dt}s"
  for r in $(seq 0 $((n - 1))); do
    grep "^fsdprun: \[rank $r\]" "$T/log" | grep -q "collective mismatch at #[0-9]*: .*reduce_scatter" ||
      die_log "ranks disagreeing on no_sync at $n ranks: rank $r does not name the mismatch"
  done
  echo "ok: ranks disagreeing on no_sync, $n ranks: exit 1 in ${dt}s"
done
finish
