# tests/recipes/lib/tmux.sh — sourced by the tests that drive fsdprun on a real terminal (a tmux
# pane): `tmux_start ARGS...` runs ARGS in a fresh 100x40 pane (a new session each time) under
# a small sh that records the exit status, since tmux may show a dead pane without it; the
# helpers read the screen, type, and wait. Needs $T (a scratch folder) and fail(). Not a test
# itself: ctest runs tests/recipes/*.sh only.
TMUX_SOCK="fsdprun-test-$$"
tm() { tmux -L "$TMUX_SOCK" -f "$T/tmux.conf" "$@"; }
echo "set -g remain-on-exit on" >"$T/tmux.conf"
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
tmux_stop() { tm kill-server >/dev/null 2>&1; }
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
