# tests/recipes/lib/tmux.sh — sourced by the tests that drive fsdprun on a real terminal (a tmux
# pane): `tmux_start ARGS...` runs ARGS in a fresh 100x40 pane (sessions s1, s2, ...: a new one
# each time, since killing the last would stop the server under the next new-session) under a
# small sh that records the exit status (tmux 3.3a sometimes shows a dead pane without it: the
# pty closed before tmux collected the child); the helpers read the screen, type, and wait.
# Source it after lib.sh ($T, fail, AT_EXIT); the tmux server goes with $T on exit. Not a test
# itself: ctest runs tests/recipes/*.sh only.
TMUX_SOCK="fsdprun-test-$$"
tm() { tmux -L "$TMUX_SOCK" -f "$T/tmux.conf" "$@"; }
echo "set -g remain-on-exit on" >"$T/tmux.conf"
AT_EXIT="${AT_EXIT:+$AT_EXIT; }tm kill-server >/dev/null 2>&1"
tmux_sessions=0
S=
tmux_start() {
  tmux_sessions=$((tmux_sessions + 1))
  S="s$tmux_sessions"
  rm -f "$T/exit.$S"
  # the sh ignores SIGINT (^C goes to the whole foreground group); fsdprun handles its own
  tm new-session -d -s "$S" -x 100 -y 40 -c "$PWD" env -u FSDPRUN_NO_EDIT HOME="$T" \
    TERM=xterm FSDPRUN_HISTORY="$T/history" EXITF="$T/exit.$S" \
    sh -c 'trap "" INT; "$@"; echo "$?" >"$EXITF"' sh "$@"
}
screen() { tm capture-pane -t "$S" -p -S -1000 >"$T/screen"; }
show() { screen; sed 's/^/    | /' "$T/screen"; }
# wait_for TEXT [WHAT]: until the screen shows TEXT (a fixed string), at most 20 s
wait_for() {
  i=0
  while [ $i -lt 200 ]; do
    screen
    if grep -qF -- "$1" "$T/screen"; then return 0; fi
    sleep 0.1
    i=$((i + 1))
  done
  fail "${2:-$1}: the screen never showed '$1'; it shows:"
  show
  return 1
}
type_text() { tm send-keys -t "$S" -l -- "$1"; }
key() { tm send-keys -t "$S" "$@"; }
enter() { type_text "$1"; key Enter; }
# the exit status once the command has ended ("" while it runs)
pane_status() { cat "$T/exit.$S" 2>/dev/null; }
# until the command has ended and its status is recorded, at most 20 s
wait_dead() {
  i=0
  while [ $i -lt 200 ]; do
    [ -s "$T/exit.$S" ] && return 0
    sleep 0.1
    i=$((i + 1))
  done
}
