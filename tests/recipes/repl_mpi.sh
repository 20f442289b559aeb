#!/bin/sh
# repl_mpi.sh — the SPMD REPL under mpirun (the mpi backend: ranks are processes, rank 0 reads
# standard input and broadcasts it over the REPL's own communicator): grouped output, an error
# on one rank, ":rank 1" refusing a collective, fsdp.debug() with the caller's locals. Skips
# (exit 0) only when mpirun is not installed or fsdprun was built without Open MPI.
# Run by ctest with FSDPRUN=<build>/bin/fsdprun.
set -u
: "${FSDPRUN:?set FSDPRUN to the fsdprun executable}"
if ! command -v mpirun >/dev/null 2>&1; then
  echo "repl_mpi: SKIP (mpirun not found: install openmpi-bin)"
  exit 77
fi
MPIRUN="mpirun --oversubscribe --allow-run-as-root --mca btl_base_warn_component_unused 0"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
expect_rc() { [ "$rc" -eq "$1" ] || fail "$2: exit status $rc, expected $1; stderr: $(cat "$T/err")"; }
expect_has() { grep -qF -- "$2" "$T/$1" || fail "$3: std$1 lacks '$2'; it was: $(cat "$T/$1")"; }

if ! $MPIRUN -np 1 "$FSDPRUN" -e 'assert(require("fsdp").backend() == "mpi")' >/dev/null 2>"$T/err"
then
  if grep -qF "built without Open MPI" "$T/err"; then
    echo "repl_mpi: SKIP (fsdprun was built without Open MPI)"
    exit 77
  fi
fi

printf 'fsdp = require "fsdp"\nfsdp.backend(), fsdp.world_size()\nfsdp.rank() + 0.5\nfsdp.all_reduce(fsdp.rank() + 1)\nif fsdp.rank() == 1 then error("one") end\n:rank 1\nfsdp.barrier()\n:all\n"done"\n' |
  timeout 120 $MPIRUN -np 2 "$FSDPRUN" -i >"$T/out" 2>"$T/err"
rc=$?
expect_rc 0 "mpirun -np 2 fsdprun -i"
expect_has out "[0-1] mpi	2" "the REPL runs on the mpi backend"
expect_has out "[0] 0.5  [1] 1.5" "results per rank"
expect_has out "[0-1] 3" "a collective in the REPL"
expect_has err "fsdprun: [1] stdin:1: one" "an error on one rank"
expect_has err "[1] stdin:1: barrier '': collectives are refused in ':rank 1' mode" ":rank 1"
expect_has out "[0-1] done" "the REPL goes on"

cat >"$T/debug.lua" <<'EOF'
local fsdp = require "fsdp"
local x = (fsdp.rank() + 1) * 10
fsdp.debug()
print("after", fsdp.rank(), x)
EOF
printf 'x\nx = x + 1\n' | timeout 120 $MPIRUN -np 2 "$FSDPRUN" "$T/debug.lua" >"$T/out" 2>"$T/err"
rc=$?
expect_rc 0 "fsdp.debug under mpirun"
expect_has out "[0] 10  [1] 20" "fsdp.debug sees the caller's locals"
expect_has out "after	1	21" "the recipe goes on with the value the REPL assigned"

if [ "$failures" -ne 0 ]; then
  echo "repl_mpi: $failures failure(s)"
  exit 1
fi
echo "repl_mpi: ok"
