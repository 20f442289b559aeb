#!/bin/sh
# dist_rank_env.sh — torchrun's RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE through
# os.getenv (tests/dist/rank_env.lua): each rank its own at -n 1, 2 and 4 (threads of one
# process), without -n (0 of 1, also for a child process), and under mpirun at 1 and 3 ranks
# (also for a child process; that part is left out, with a note, where fsdprun has no Open MPI).
# A perturbed check (--local_world wrong) must fail, so the check can.
. "${0%/*}/lib.sh"
S="$SRC/tests/dist/rank_env.lua"

must_show "no -n" "$FSDPRUN" "$S" --child
for n in 1 2 4; do on_ranks "$n" "$S"; done
# stale values in the user's environment do not leak into the ranks
must_show "-n 2 under RANK=5 WORLD_SIZE=9" env RANK=5 WORLD_SIZE=9 LOCAL_RANK=3 "$FSDPRUN" -n 2 "$S"
must_fail "a wrong LOCAL_WORLD_SIZE was accepted" "$FSDPRUN" -n 2 "$S" --local_world=3
grep -qF 'os.getenv("LOCAL_WORLD_SIZE") is 2, expected 3' "$T/log" ||
  die_log "the perturbed run failed for another reason"

if command -v mpirun >/dev/null 2>&1 &&
   $MPIRUN -np 1 "$FSDPRUN" -e 'assert(require("fsdp").backend() == "mpi")' >/dev/null 2>&1; then
  for n in 1 3; do
    # shellcheck disable=SC2086
    must_show "mpirun -np $n" timeout -k 5 120 $MPIRUN -np $n "$FSDPRUN" "$S" --child
  done
else
  echo "note: no mpirun, or fsdprun built without Open MPI: the mpirun part is left out"
fi
finish
