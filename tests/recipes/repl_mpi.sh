#!/bin/sh
# repl_mpi.sh — the SPMD REPL under mpirun (the mpi backend: ranks are processes, rank 0 reads
# standard input and broadcasts it over the REPL's own communicator). The same session fed to
# `mpirun -np 2 fsdprun -i` and to `fsdprun -n 2 -i` prints the same standard output (the
# backend's name aside): the preloaded fsdp, grouped output, print capture, collectives across
# the processes, an error on one rank that the session survives, ":rank 1" refusing a
# collective, and :quit ending every process with status 0. A collective mismatch in the
# session: the same verdict on every rank for it and the next collective, as with -n 2, and
# exit status 1 (MPI cannot be finalized). Then fsdp.debug() with the caller's locals. Skips
# (77) when mpirun is not installed or fsdprun was built without Open MPI. Run by ctest with
# FSDPRUN=<build>/bin/fsdprun.
. "${0%/*}/lib.sh"
need_mpi

session='fsdp.backend(), fsdp.world_size()
fsdp.rank() + 0.5
print("hello from", fsdp.rank(), "of", fsdp.world_size())
fsdp.all_reduce(fsdp.rank() + 1)
if fsdp.rank() == 1 then error("only on rank one") end
x = fsdp.ones{4}
fsdp.all_reduce(x, "sum"):sum():item()
:rank 1
fsdp.barrier()
:all
"done"
:quit
'
printf '%s' "$session" | timeout -k 5 120 $MPIRUN -np 2 "$FSDPRUN" -i >"$T/out" 2>"$T/err"
rc=$?
expect_rc 0 "mpirun -np 2 fsdprun -i"
expect_has out "[0-1] mpi	2" "the REPL runs on the mpi backend, fsdp preloaded"
expect_has out "[0] 0.5  [1] 1.5" "results per rank"
expect_has out "[0-1] 3" "a collective in the REPL"
expect_has err "fsdprun: [1] stdin:1: only on rank one" "an error on one rank"
expect_has err "[1] stdin:1: barrier '': collectives are refused in ':rank 1' mode" ":rank 1"
expect_has out "[0-1] 8" "a collective after the error"
expect_has out "[0-1] done" "the REPL goes on"
cp "$T/out" "$T/mpi"

printf '%s' "$session" | timeout -k 5 60 "$FSDPRUN" -n 2 -i >"$T/out" 2>"$T/err"
rc=$?
expect_rc 0 "fsdprun -n 2 -i"
sed 's/\blocal\b/BACKEND/' "$T/out" >"$T/local.n"
sed 's/\bmpi\b/BACKEND/' "$T/mpi" >"$T/mpi.n"
cmp -s "$T/local.n" "$T/mpi.n" || fail "stdout differs; -n 2:
$(cat "$T/out")
mpirun -np 2:
$(cat "$T/mpi")"

# a collective mismatch in the session: it and every later collective fail with the same verdict
# on both ranks (grouped as [0-1]), as with -n 2; the poisoned communicator keeps MPI from being
# finalized, so each process then exits 1 saying so
mismatch='fsdp.all_reduce(1, "sum", "l" .. fsdp.rank())
fsdp.barrier()
:quit
'
printf '%s' "$mismatch" | timeout -k 5 60 "$FSDPRUN" -n 2 -i >"$T/out" 2>"$T/err"
rc=$?
expect_rc 0 "a mismatch in the session, -n 2"
[ "$(grep -c "^fsdprun: \[0-1\] stdin:1: collective mismatch at #2" "$T/err")" = 2 ] ||
  fail "a mismatch in the session, -n 2: not the same verdict twice on both ranks: $(cat "$T/err")"
printf '%s' "$mismatch" | timeout -k 5 120 $MPIRUN -np 2 "$FSDPRUN" -i >"$T/out" 2>"$T/err"
rc=$?
expect_rc 1 "a mismatch in the session, mpirun"
[ "$(grep -c "^fsdprun: \[0-1\] stdin:1: collective mismatch at #2" "$T/err")" = 2 ] ||
  fail "a mismatch in the session, mpirun: not the same verdict twice on both ranks:
$(cat "$T/err")"
expect_has err "fsdprun: [rank 1] exits with status 1 without MPI_Finalize" "a mismatch, mpirun"

cat >"$T/debug.lua" <<'LUA'
local fsdp = require "fsdp"
local x = (fsdp.rank() + 1) * 10
fsdp.debug()
-- one line, from rank 0: under mpirun each rank's stdout is a pseudo-terminal whose lines
-- reach mpirun in pieces (split at tabs), so lines printed by both ranks at once can interleave
local sum = fsdp.all_reduce(x)
if fsdp.rank() == 0 then print("after " .. sum) end
LUA
printf 'x\nx = x + 1\n' | timeout 120 $MPIRUN -np 2 "$FSDPRUN" "$T/debug.lua" >"$T/out" 2>"$T/err"
rc=$?
expect_rc 0 "fsdp.debug under mpirun"
expect_has out "[0] 10  [1] 20" "fsdp.debug sees the caller's locals"
expect_has out "after 32" "the recipe goes on with the values the REPL assigned (11 + 21)"
finish
