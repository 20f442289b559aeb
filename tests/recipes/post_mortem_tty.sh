#!/bin/sh
# post_mortem_tty.sh — fsdprun --debug-on-error -n 2 on a real terminal (tmux): rank 1 of
# tests/dist/post_mortem.lua raises while rank 0 waits in a barrier; the post-mortem REPL opens
# (banner), the failing frame's local is readable on rank 1, `loss:item()` and
# `fsdp.inspect(model)` work on both ranks, a collective runs (the group was revived), `err` is
# each rank's error, and :quit ends the run with exit status 1 after the failure was reported.
# With PM_MPIRUN set (tests/recipes/post_mortem_mpi.sh) the same session runs under that mpirun
# command instead.
# Run by ctest with FSDPRUN=<build>/bin/fsdprun; needs tmux (Debian package tmux).
set -u
. "${0%/*}/lib.sh"
if ! command -v tmux >/dev/null 2>&1; then
  echo "post_mortem_tty: SKIP (tmux is not installed: apt-get install tmux)"
  exit 77
fi
. "${0%/*}/lib/tmux.sh"
cd "${FSDP_SOURCE_DIR:-.}" || exit 1
R=tests/dist/post_mortem.lua

if [ -n "${PM_MPIRUN:-}" ]; then
  # shellcheck disable=SC2086 # the command's words
  tmux_start $PM_MPIRUN -np 2 "$FSDPRUN" --debug-on-error "$R"
  name="post_mortem_tty under mpirun"
else
  tmux_start "$FSDPRUN" --debug-on-error -n 2 "$R"
  name="post_mortem_tty"
  wait_for "post-mortem: 2 ranks (local), each stopped where it failed" "the banner"
fi
wait_for "fsdprun: [rank 1] tests/dist/post_mortem.lua:26: boom at step 2" "the failure, reported first"
wait_for "fsdprun: [rank 0] tests/dist/post_mortem.lua:41: rank 1 failed" "the peer's line"
enter "secret"
wait_for "[0] nil  [1] 42" "the failing frame's local"
enter "loss:item() == loss:item()"
wait_for "[0-1] true" "loss:item() on every rank"
enter "fsdp.inspect(model)"
wait_for "[1] Linear: wrapped (full), 1 unit" "fsdp.inspect(model)"
enter "fsdp.all_reduce(fsdp.rank() + 1)"
wait_for "[0-1] 3" "a collective in the session (the group was revived)"
enter "err"
wait_for "[1] tests/dist/post_mortem.lua:26: boom at step 2" "err on the failing rank"
enter ":quit"
wait_dead
[ "$(pane_status)" = "1" ] || { fail ":quit: exit status '$(pane_status)', expected 1"; show; }
screen
grep -qF "finished" "$T/screen" && fail "the recipe went on after :quit"

finish "$name"
