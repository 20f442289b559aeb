#!/bin/sh
# mpi_comm.sh — the mpi backend's own test program, tests/mpi/test_mpi_comm.c (built as
# <build>/tests/test_mpi_comm when Open MPI is found), under mpirun at 1 to 4 ranks: every
# collective bitwise against the serial reference, asynchronous collectives, progress during
# compute, fingerprint mismatches, abort, timeout, a rank that leaves, reviving a poisoned group,
# sub-communicators (hybrid pairs; an abort in one group fails every group). Then the variants
# that take other code paths: 4 KiB reduce-scatter segments with a window of 2 (many segments, slot
# reuse), all_gather by point-to-point, TCP instead of shared memory, MPI_THREAD_MULTIPLE; and a
# rank stopped (SIGSTOP) in an all_gather's data phase, and one stopped in an all_reduce's and a
# reduce_scatter's with only its peers' sends to it pending, which its peers' timeout names.
# Skips (exit 77) only when mpirun is not installed.
. "${0%/*}/lib.sh"
need mpirun "apt-get install openmpi-bin"
BIN=$(dirname "$FSDPRUN")/../tests/test_mpi_comm
if [ ! -x "$BIN" ]; then
  echo "FAIL: $BIN was not built (Open MPI is installed: the build should find it)"
  exit 1
fi
run() { # run LABEL MPIRUN-ARGS...
  label=$1
  shift
  # shellcheck disable=SC2086
  if timeout -k 5 180 $MPIRUN "$@" "$BIN" >"$T/out" 2>&1; then
    echo "ok: $label$(grep -F "overlap:" "$T/out" | sed 's/^ */; /')"
  else
    cat "$T/out"
    echo "FAIL: $label"
    failures=$((failures + 1))
  fi
}
for n in 1 2 3 4; do run "mpirun -np $n" -np $n; done
run "4 KiB segments, window 2, -np 3" -np 3 -x FSDP_MPI_SEGMENT_KIB=4 -x FSDP_MPI_WINDOW=2
run "4 KiB segments, window 1, -np 2" -np 2 -x FSDP_MPI_SEGMENT_KIB=4 -x FSDP_MPI_WINDOW=1
run "all_gather by point-to-point, -np 4" -np 4 -x FSDP_MPI_ALLGATHER=p2p
run "TCP, -np 2" -np 2 --mca btl tcp,self
run "TCP, -np 4" -np 4 --mca btl tcp,self
run "MPI_THREAD_MULTIPLE, -np 2" -np 2 -x FSDP_MPI_THREAD=multiple
# a rank stopped in an all_gather's data phase, named by its peers (MPI_Iallgather, then by
# point-to-point); single-copy transfers off, so that the data moves in fragments that need both
# sides and nothing can complete without the stopped rank
NOCMA="-x OMPI_MCA_btl_vader_single_copy_mechanism=none -x FSDP_TEST_ONLY=stall"
# shellcheck disable=SC2086 # word splitting of the flag list is intended
run "a stopped rank named in MPI_Iallgather's data phase, -np 3" -np 3 $NOCMA
# shellcheck disable=SC2086
run "a stopped rank named in a point-to-point all_gather, -np 3" -np 3 $NOCMA \
  -x FSDP_MPI_ALLGATHER=p2p
# a rank stopped in an all_reduce's and a reduce_scatter's data phase once its peers hold all its
# data, before it takes any of theirs: its peers wait on sends alone, and name it (single-copy
# transfers on and off)
run "a stopped rank named by peers with sends alone pending, -np 2" -np 2 \
  -x FSDP_TEST_ONLY=stall_sends
run "a stopped rank named by peers with sends alone pending, no single copy, -np 3" -np 3 \
  -x OMPI_MCA_btl_vader_single_copy_mechanism=none -x FSDP_TEST_ONLY=stall_sends
finish
