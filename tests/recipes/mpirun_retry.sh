#!/bin/sh
# The tests' mpirun wrapper (lib/mpirun_retry.sh) against a stand-in for mpirun: Open MPI's
# launch race ("rank 0 with PID 0 ... exiting improperly") gets one more run, whose streams and
# status are the result; a real failure (a real pid, the race twice, or the same message after
# a rank said it exits without MPI_Finalize) keeps its status and its message; a success runs
# once; mpirun's options alone run mpirun; standard input reaches
# the command; a signal to the wrapper alone reaches the command too, leaving nothing behind.
# Needs no MPI.
. "${0%/*}/lib.sh"
W="$SRC/tests/recipes/lib/mpirun_retry.sh"
cat >"$T/fake" <<'FAKE'
#!/bin/sh
# $1: how many runs fail with the race; $2: the exit status after them; counts runs in $T/n;
# $3 (optional): a rank's line on stderr before the race's message
n=$(($(cat "$FAKE_DIR/n" 2>/dev/null || echo 0) + 1))
echo "$n" >"$FAKE_DIR/n"
echo "run $n"
if [ "$n" -le "$1" ]; then
  [ -n "${3-}" ] && echo "$3" >&2
  printf '%s\n' "mpirun has exited due to process rank 0 with PID 0 on" \
    "node box exiting improperly. There are three reasons this could occur:" >&2
  exit 1
fi
if [ "$2" != 0 ]; then
  printf '%s\n' "mpirun has exited due to process rank 1 with PID 4242 on" \
    "node box exiting improperly." >&2
fi
echo "done $n" >&2
exit "$2"
FAKE
chmod +x "$T/fake"
export FAKE_DIR="$T"

rm -f "$T/n"
run sh "$W" "$T/fake" 1 0
expect_rc 0 "the race once, then a correct run"
expect_has out "run 2" "the second run's output"
expect_has err "running again" "the second run is announced"
expect_has err "done 2" "the second run's stderr"
expect_lacks err "with PID 0 on" "the first run's race message"

rm -f "$T/n"
run sh "$W" "$T/fake" 2 0
expect_rc 1 "the race twice"
expect_has err "with PID 0 on" "the race message, the second time"
[ "$(cat "$T/n")" = 2 ] || fail "the race twice: $(cat "$T/n") runs, expected 2"

rm -f "$T/n"
run sh "$W" "$T/fake" 0 3
expect_rc 3 "a real failure"
expect_has err "with PID 4242 on" "a real failure's message"
[ "$(cat "$T/n")" = 1 ] || fail "a real failure: $(cat "$T/n") runs, expected 1"

# the same message after fsdprun said it skips MPI_Finalize: a process that did, not the race
rm -f "$T/n"
run sh "$W" "$T/fake" 1 0 "fsdprun: [rank 0] exits with status 1 without MPI_Finalize: ..."
expect_rc 1 "without MPI_Finalize"
expect_has err "with PID 0 on" "without MPI_Finalize: mpirun's message"
expect_lacks err "running again" "without MPI_Finalize: no second run"
[ "$(cat "$T/n")" = 1 ] || fail "without MPI_Finalize: $(cat "$T/n") runs, expected 1"

rm -f "$T/n"
run sh "$W" "$T/fake" 0 0
expect_rc 0 "a correct run"
[ "$(cat "$T/n")" = 1 ] || fail "a correct run: $(cat "$T/n") runs, expected 1"

# mpirun's options alone (FSDP_MPIRUN's call): the wrapper runs `mpirun` with them
mkdir -p "$T/bin"
printf '#!/bin/sh\necho "mpirun $*"\n' >"$T/bin/mpirun"
chmod +x "$T/bin/mpirun"
run env PATH="$T/bin:$PATH" sh "$W" -np 2 prog arg
expect_rc 0 "options alone"
expect_out "mpirun -np 2 prog arg" "options alone: mpirun runs with them"

printf 'line one\nline two\n' | sh "$W" cat >"$T/out" 2>"$T/err"
expect_out "line one
line two" "standard input through the wrapper"

cat >"$T/hang" <<'HANG'
#!/bin/sh
echo $$ >"$FAKE_DIR/hang.pid"
exec sleep 600
HANG
chmod +x "$T/hang"
# TERM to the wrapper alone (not its process group, as timeout(1) would): it must reach the command
sh "$W" "$T/hang" >/dev/null 2>&1 &
w_pid=$!
for i in $(seq 50); do [ -s "$T/hang.pid" ] && break; sleep 0.1; done
kill -TERM "$w_pid"
wait "$w_pid"
rc=$?
[ "$rc" -ne 0 ] || fail "TERM to the wrapper: exit status 0"
hang_pid=$(cat "$T/hang.pid" 2>/dev/null)
for i in 1 2 3 4 5 6 7 8 9 10; do
  kill -0 "$hang_pid" 2>/dev/null || break
  sleep 0.2
done
if kill -0 "$hang_pid" 2>/dev/null; then
  kill -9 "$hang_pid"
  fail "TERM to the wrapper: the command outlived it (pid $hang_pid)"
fi
finish
