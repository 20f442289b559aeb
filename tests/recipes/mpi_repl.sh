#!/bin/sh
# mpi_repl.sh — the SPMD REPL (src/cli/repl.c, `fsdprun -i`) under mpirun: the same session fed
# to `mpirun -np 2 fsdprun -i` and to `fsdprun -n 2 -i` prints the same standard output (grouped
# per rank, collectives across the processes), an error on one rank is reported and the session
# goes on, and :quit ends every process with status 0. Skips (exit 0) only when mpirun is not
# installed.
set -u
: "${FSDPRUN:?set FSDPRUN to the fsdprun executable}"
if ! command -v mpirun >/dev/null 2>&1; then
  echo "SKIP: mpirun not found (install openmpi-bin to test the mpi backend)"
  exit 77
fi
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
MPIRUN="mpirun --oversubscribe --allow-run-as-root --mca btl_base_warn_component_unused 0"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

session='fsdp = require "fsdp"
fsdp.backend()
fsdp.rank()
print("hello from", fsdp.rank(), "of", fsdp.world_size())
fsdp.all_reduce(fsdp.rank() + 1)
if fsdp.rank() == 1 then error("only on rank one") end
x = fsdp.ones{4}
fsdp.all_reduce(x, "sum"):sum()
:quit
'
printf '%s' "$session" | timeout -k 5 60 "$FSDPRUN" -n 2 -i >"$T/local" 2>"$T/local_err"
rc_local=$?
printf '%s' "$session" | timeout -k 5 60 $MPIRUN -np 2 "$FSDPRUN" -i >"$T/mpi" 2>"$T/mpi_err"
rc_mpi=$?
[ "$rc_mpi" -eq 0 ] || fail "mpirun -np 2 fsdprun -i: exit status $rc_mpi; stderr: $(cat "$T/mpi_err")"
[ "$rc_local" -eq 0 ] || fail "fsdprun -n 2 -i: exit status $rc_local; stderr: $(cat "$T/local_err")"
# the backend's name differs; everything else must not
sed 's/"local"/BACKEND/; s/\blocal\b/BACKEND/' "$T/local" >"$T/local.n"
sed 's/"mpi"/BACKEND/; s/\bmpi\b/BACKEND/' "$T/mpi" >"$T/mpi.n"
grep -q "mpi" "$T/mpi" || fail "the session did not run on the mpi backend: $(cat "$T/mpi")"
if cmp -s "$T/local.n" "$T/mpi.n"; then
  echo "ok: the same REPL session prints the same under mpirun -np 2 as with -n 2:"
  sed 's/^/    /' "$T/mpi"
else
  fail "stdout differs; local:
$(cat "$T/local")
mpi:
$(cat "$T/mpi")"
fi
grep -q "only on rank one" "$T/mpi_err" || fail "rank 1's error is not reported: $(cat "$T/mpi_err")"
grep -q "8" "$T/mpi" || fail "the all_reduce after the error did not run: $(cat "$T/mpi")"

if [ "$failures" -ne 0 ]; then
  echo "mpi_repl: $failures failure(s)"
  exit 1
fi
echo "mpi_repl: ok"
