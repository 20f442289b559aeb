#!/bin/sh
# post_mortem_mpi.sh — fsdprun --debug-on-error under mpirun (the mpi backend: ranks are
# processes): with stdin from a pipe, rank 1 of tests/dist/post_mortem.lua raises, rank 0 is
# told in its barrier, and the post-mortem REPL reads the inputs: the failing frame's local,
# fsdp.inspect(model), `err`, collectives on the revived group (new MPI communicators): an
# all_reduce of a number and of a tensor, fsdp.full_params, a forward and backward pass; the
# end of input ends the job with exit status 1 and the failure reported. Then the terminal
# session of tests/recipes/post_mortem_tty.sh under mpirun (when tmux is there).
# Skips when mpirun is missing or fsdprun was built without Open MPI.
# Run by ctest with FSDPRUN=<build>/bin/fsdprun.
set -u
. "${0%/*}/lib.sh"
need_mpi
cd "${FSDP_SOURCE_DIR:-.}" || exit 1
R=tests/dist/post_mortem.lua

printf '%s\n' 'secret' 'fsdp.inspect(model)' 'err' 'fsdp.all_reduce(fsdp.rank() + 1)' \
  'fsdp.all_reduce(fsdp.ones{100000}):sum()' \
  'fsdp.full_params(model, function() return model.weight:sum():item() end) ~= nil' \
  'l = model(fsdp.ones{3, 4}):sum(); l:backward(); return l:item() == l:item()' '"after"' |
  timeout -k 5 120 $MPIRUN -np 2 "$FSDPRUN" --debug-on-error "$R" >"$T/out" 2>"$T/err"
rc=$?
[ "$rc" -eq 1 ] || fail "exit status $rc, expected 1; stderr: $(cat "$T/err")"
expect_has out "[0] nil  [1] 42" "the failing frame's local"
expect_has out "[1] Linear: wrapped (full), 1 unit, 2 parameters (10 elements), rank 1 of 2" "fsdp.inspect(model)"
expect_has out "[0] tests/dist/post_mortem.lua:41: rank 1 failed: tests/dist/post_mortem.lua:26: boom at step 2" "the peer's err"
expect_has out "[1] tests/dist/post_mortem.lua:26: boom at step 2" "the failing rank's err"
expect_has out "[0-1] 3" "an all_reduce on the revived group"
expect_has out "[0-1] tensor((), f32, cpu)
      200000" "a tensor all_reduce on the revived group"
[ "$(grep -c '^\[0-1\] true$' "$T/out")" -eq 2 ] ||
  fail "full_params and a forward/backward on the revived group: $(cat "$T/out")"
expect_has out "[0-1] after" "the session goes on"
expect_has err "fsdprun: [rank 1] tests/dist/post_mortem.lua:26: boom at step 2
stack traceback:" "the failure, reported as without the flag"

if command -v tmux >/dev/null 2>&1; then
  PM_MPIRUN="$MPIRUN" sh tests/recipes/post_mortem_tty.sh || fail "the terminal session under mpirun"
else
  echo "post_mortem_mpi: the terminal session skipped (tmux is not installed)"
fi

finish post_mortem_mpi
