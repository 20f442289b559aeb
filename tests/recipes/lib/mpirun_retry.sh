#!/bin/sh
# mpirun_retry.sh MPIRUN [ARGS...]: run mpirun; when it fails with Open MPI 4's launch race, run
# it once more. The race (open-mpi/ompi#7833, not fixed on the 4.x branches Debian 12 ships)
# makes mpirun report a correct run as failed, about once in a thousand launches, with
# "process rank N with PID 0 on node ... exiting improperly". That message is also what mpirun
# prints for any process that exits with status 0 without MPI_Finalize (PID 0 there too), but
# fsdprun never does that: when it cannot finalize MPI (a communicator failed) it exits 1 and
# says "exits with status 1 without MPI_Finalize" (docs/mpi.md, "Limits"), and mpirun then
# reports a nonzero exit instead. So the race's message earns the second run unless a rank said
# so (or the job was signalled); the second run's streams and status are the ones the caller
# sees (standard input a first run read is gone for the second).
# - With mpirun's options alone (the first argument an option) it runs `mpirun` with them, so
#   that it can stand as FSDP_MPIRUN, the launcher `fsdprun -n N --backend mpi` starts (lib.sh
#   sets it so).
# - With a terminal on stderr (a test's interactive session) mpirun runs directly, once.
# - TERM, INT or HUP sent to this script alone (timeout(1) signals the whole process group,
#   other harnesses may not) goes on to mpirun, which ends its ranks; mpirun runs in the
#   background for that, its standard input still this script's.
case ${1-} in -*) set -- mpirun "$@" ;; esac
if [ -t 2 ]; then exec "$@"; fi
mr_err=$(mktemp)
exec 3<&0 # a background command's standard input would be /dev/null: it reads fd 3's
mr_pid=
mr_sig=
trap 'rm -f "$mr_err"' EXIT
trap 'mr_sig=1; [ -n "$mr_pid" ] && kill -TERM "$mr_pid" 2>/dev/null' TERM INT HUP
mr_try=1
while :; do
  "$@" 2>"$mr_err" <&3 3<&- &
  mr_pid=$!
  # wait returns early (status > 128) when a trapped signal arrives: wait again for mpirun
  while :; do
    wait "$mr_pid"
    mr_rc=$?
    kill -0 "$mr_pid" 2>/dev/null || break
  done
  mr_pid=
  if [ "$mr_rc" != 0 ] && [ "$mr_try" = 1 ] && [ -z "$mr_sig" ] &&
    grep -q "with PID 0 on" "$mr_err" && grep -q "exiting improperly" "$mr_err" &&
    ! grep -q "without MPI_Finalize" "$mr_err"; then
    echo "mpirun_retry.sh: Open MPI's launch race (PID 0 exiting improperly): running again" >&2
    mr_try=2
    continue
  fi
  cat "$mr_err" >&2
  exit "$mr_rc"
done
