#!/bin/sh
# dist_rank_env.sh — torchrun's RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE through
# os.getenv (tests/dist/rank_env.lua): each rank its own at -n 1, 2 and 4 (threads of one
# process), without -n (0 of 1, also for a child process), and under mpirun at 1 and 3 ranks
# (also for a child process; that part is left out, with a note, where fsdprun has no Open MPI).
# A single run keeps a launcher's LOCAL_RANK and LOCAL_WORLD_SIZE; malformed ones are refused.
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

# a single run keeps a launcher's LOCAL_RANK (the GPU is chosen by it) and LOCAL_WORLD_SIZE; a
# LOCAL_WORLD_SIZE that is missing or not above LOCAL_RANK is LOCAL_RANK + 1
E='io.write(os.getenv("LOCAL_RANK"), " ", os.getenv("LOCAL_WORLD_SIZE"), "\n")
os.execute("echo child $LOCAL_RANK $LOCAL_WORLD_SIZE")'
for case in "3||3 4" "1|2|1 2" "2|2|2 3" "1048575||1048575 1048576" "||0 1"; do
  lr=${case%%|*} rest=${case#*|}
  lw=${rest%%|*} want=${rest#*|}
  run env LOCAL_RANK="$lr" LOCAL_WORLD_SIZE="$lw" "$FSDPRUN" -e "$E"
  expect_rc 0 "LOCAL_RANK='$lr' LOCAL_WORLD_SIZE='$lw'"
  expect_out "child $want
$want" "LOCAL_RANK='$lr' LOCAL_WORLD_SIZE='$lw'"
done
# a malformed one stops fsdprun before it runs anything: status 2, one line naming it
for bad in -1 abc 3x " 1" +1 1048576 2147483647 99999999999; do
  for n in "" "-n 1"; do
    # shellcheck disable=SC2086
    run env LOCAL_RANK="$bad" "$FSDPRUN" $n -e 'print("ran")'
    expect_rc 2 "LOCAL_RANK='$bad' $n"
    expect_out "" "LOCAL_RANK='$bad' $n ran the chunk"
    expect_has err "fsdprun: LOCAL_RANK='$bad' must be a non-negative integer (below 1048576)" \
      "LOCAL_RANK='$bad' $n"
    [ "$(lines_of err)" = 1 ] || fail "LOCAL_RANK='$bad' $n: not one line: $(cat "$T/err")"
  done
done
for bad in 0 -2 x 1048577; do
  run env LOCAL_WORLD_SIZE="$bad" "$FSDPRUN" -e 'print("ran")'
  expect_rc 2 "LOCAL_WORLD_SIZE='$bad'"
  expect_has err "fsdprun: LOCAL_WORLD_SIZE='$bad' must be a positive integer (at most 1048576)" \
    "LOCAL_WORLD_SIZE='$bad'"
done
# rank threads have their own local ranks: the variables are not read, so not refused
run env LOCAL_RANK=abc LOCAL_WORLD_SIZE=0 "$FSDPRUN" -n 2 -e 'print("ran")'
expect_rc 0 "-n 2 under LOCAL_RANK=abc"

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
