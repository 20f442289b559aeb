#!/bin/sh
# mpi_faults.sh — collective failure (invariant 3) on the mpi backend, under mpirun:
# an error raised on rank 1 while its peers are inside backward (and inside forward), at 2 and
# 4 ranks, over shared memory and over TCP, ends every rank within seconds (the collective
# timeout is 30 s: the peers must be woken by rank 1's poison, not time out), with rank 1's
# report and its peers' "rank 1 failed: <rank 1's message>". Also: an error while the peers wait
# in an all_reduce (every peer names rank 1), a hung rank 1 reported by the timeout naming it
# and the collective it missed, a rank that leaves early, a collective mismatch across
# processes, a mismatch the recipe catches (the same messages as on the local backend, exit
# status 1 without MPI_Finalize, one run), and a run without a fault that finishes with exit
# status 0. Skips (exit 77) only when mpirun is not installed.
. "${0%/*}/lib.sh"
need mpirun "apt-get install openmpi-bin"
# fault WHAT MAXTENTHS LAUNCH...: must exit nonzero within MAXTENTHS tenths of a second
fault() {
  what=$1 max=$2
  shift 2
  t0=$(now_ms)
  timeout -k 5 60 "$@" >"$T/out" 2>&1
  rc=$?
  took=$((($(now_ms) - t0) / 100))
  [ "$rc" -ne 0 ] || fail "$what: exit status 0; output: $(cat "$T/out")"
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || fail "$what: hung (killed after 60 s)"
  [ "$took" -le "$max" ] || fail "$what: took $took tenths of a second (limit $max)"
  grep -q "finished" "$T/out" && fail "$what: a rank finished: $(cat "$T/out")"
  echo "ran: $what: exit $rc in $took tenths of a second"
}
has() { grep -qF -- "$1" "$T/out" || fail "$2: the output lacks '$1': $(cat "$T/out")"; }
# a line of rank R's report that contains TEXT
rank_says() { grep "^fsdprun: \[rank $1\]" "$T/out" | grep -qF -- "$2" || fail "$3: rank $1 does not say '$2': $(cat "$T/out")"; }

W=tests/dist/wrap_faults.lua
F=tests/dist/fault_inject.lua
for transport in shm tcp; do
  mca=""
  [ $transport = tcp ] && mca="--mca btl tcp,self"
  for n in 2 4; do
    for at in backward forward; do
      what="rank 1 fails ${at}, $n ranks, $transport"
      # shellcheck disable=SC2086
      fault "$what" 100 $MPIRUN $mca -np $n "$FSDPRUN" --timeout=30 $W --at=$at
      if [ $at = backward ]; then msg="injected fault before backward on rank 1 at step 3"
      else msg="injected fault in forward on rank 1 at step 3"; fi
      rank_says 1 "$msg" "$what"
      rank_says 0 "rank 1 failed: " "$what"
      rank_says 0 "$msg" "$what"
      has "stack traceback:" "$what"
    done
    [ $transport = tcp ] && break # one TCP world size is enough
  done
done

# every peer of a 4-rank job names rank 1 while they wait in an all_reduce
fault "rank 1 fails while 3 peers wait" 100 $MPIRUN -np 4 "$FSDPRUN" $F --rank=1 --at=blocked
rank_says 1 "injected fault while peers wait on rank 1" "blocked"
for r in 0 2 3; do rank_says $r "rank 1 failed: " "blocked"; done

# a hung peer: rank 1 computes for 30 s; the others time out after 2 s, naming it
fault "rank 1 hangs" 100 $MPIRUN -np 2 "$FSDPRUN" --timeout=2 $F --rank=1 --at=slow --busy=30
rank_says 0 "timeout after 2 s in all_reduce #4 'step.4': rank 1 has not arrived (sequence number it reached: rank 1 #3)" "hang"
has "flight recorder (rank 0, newest last)" "hang"

# a rank that returns early: its peer fails at once, not at the timeout
fault "rank 1 leaves early" 100 $MPIRUN -np 2 "$FSDPRUN" --timeout=30 $F --rank=1 --at=return
rank_says 0 "rank 1 left the group (its communicator was freed) after #3: all_reduce #4 'step.4' cannot complete" "leave"

# a collective mismatch across processes: the same verdict on both ranks
fault "label mismatch" 100 $MPIRUN -np 2 "$FSDPRUN" -e 'local f = require "fsdp"; f.barrier("b"); f.all_reduce(1, "sum", "lbl" .. f.rank())'
has "collective mismatch at #2: rank 0 called all_reduce(f64 x1 sum, 'lbl0') but rank 1 called all_reduce(f64 x1 sum, 'lbl1')" "mismatch"
rank_says 0 "collective mismatch at #2" "mismatch"
rank_says 1 "collective mismatch at #2" "mismatch"

# a mismatch the recipe catches (pcall) before it ends normally: every later collective fails
# with the verdict itself on every rank, as on the local backend; and since a failed
# communicator keeps MPI from being finalized, each rank exits 1 saying so, never 0 without
# MPI_Finalize (mpirun's "exiting improperly", which the tests' mpirun wrapper would take for
# Open MPI's launch race and run the job again)
cat >"$T/caught.lua" <<'LUA'
local fsdp = require "fsdp"
if fsdp.rank() == 0 then print("started") end -- on stdout, which a second run would add to
local _, e1 = pcall(fsdp.all_reduce, 1, "sum", "l" .. fsdp.rank())
local _, e2 = pcall(fsdp.all_reduce, 1)
local _, e3 = pcall(fsdp.barrier)
local function first(e) return (tostring(e):gsub("^[^:]*:%d+: ", ""):match("^[^\n]*")) end
io.stderr:write(("ran %d: %s | %s | %s\n"):format(fsdp.rank(), first(e1), first(e2), first(e3)))
LUA
verdict="collective mismatch at #1: rank 0 called all_reduce(f64 x1 sum, 'l0')"
verdict="$verdict but rank 1 called all_reduce(f64 x1 sum, 'l1')"
timeout -k 5 60 "$FSDPRUN" -n 2 "$T/caught.lua" >"$T/out" 2>&1
[ $? -eq 0 ] || fail "caught mismatch, -n 2: exit status not 0: $(cat "$T/out")"
for r in 0 1; do has "ran $r: $verdict | $verdict | $verdict" "caught mismatch, -n 2"; done
timeout -k 5 60 $MPIRUN -np 2 "$FSDPRUN" "$T/caught.lua" >"$T/out" 2>&1
rc=$?
[ "$rc" -eq 1 ] || fail "caught mismatch, mpirun: exit status $rc, expected 1: $(cat "$T/out")"
for r in 0 1; do
  has "ran $r: $verdict | $verdict | $verdict" "caught mismatch, mpirun"
  rank_says $r "exits with status 1 without MPI_Finalize: a communicator of this process failed" \
    "caught mismatch, mpirun"
done
[ "$(grep -c "^started" "$T/out")" = 1 ] ||
  fail "caught mismatch, mpirun: the job ran more than once: $(cat "$T/out")"
grep -qi "improperly\|running again" "$T/out" && fail "caught mismatch, mpirun: $(cat "$T/out")"
echo "ok: a caught mismatch: the verdict on every rank, exit status 1, one run"

# without a fault: exit 0, no complaint from mpirun
if timeout -k 5 60 $MPIRUN -np 2 "$FSDPRUN" $W --step=99 >"$T/out" 2>&1; then
  grep -q "rank 0 finished" "$T/out" || fail "no fault: rank 0 did not finish: $(cat "$T/out")"
  grep -qi "improperly\|non-zero" "$T/out" && fail "no fault: mpirun complains: $(cat "$T/out")"
  echo "ok: without a fault the run finishes"
else
  fail "the run without a fault failed: $(cat "$T/out")"
fi

finish
