#!/bin/sh
# repl_tty.sh — the SPMD REPL on a real terminal: fsdprun -n 2 -i runs inside tmux (a pseudo-
# terminal), keys are sent to it and the screen is read back. Checks the prompt, grouped output,
# error display, tab completion (unique, listed, table fields, methods), multi-line input,
# ^C dropping a half-typed input, ^C interrupting an evaluation on every rank, history (up
# arrow, the history file, a second session recalling the first), :quit's exit status.
# Run by ctest with FSDPRUN=<build>/bin/fsdprun; needs tmux (Debian package tmux).
set -u
. "$(dirname "$0")/lib/check.sh"
if ! command -v tmux >/dev/null 2>&1; then
  echo "repl_tty: SKIP (tmux is not installed: apt-get install tmux)"
  exit 77
fi
. "$(dirname "$0")/lib/tmux.sh"
# start ARGS...: fsdprun ARGS in a fresh terminal, history in $T/history
start() { tmux_start "$FSDPRUN" "$@"; }
# the last non-empty line of the screen
last_line() { screen; grep -v '^ *$' "$T/screen" | tail -1; }

# ---- session 1 --------------------------------------------------------------------------------
start -n 2 -i
wait_for "fsdp>" "prompt"  # capture-pane drops trailing blanks
wait_for "2 ranks (local)" "banner"
enter "1 + 1"
wait_for "[0-1] 2" "grouped result"
enter "fsdp = require 'fsdp'"
enter "fsdp.rank() + 0.5"
wait_for "[0] 0.5  [1] 1.5" "results per rank on one line"

# completion: a unique name is completed in place
type_text "fsdp.wor"
key Tab
type_text "() * 21"
key Enter
wait_for "[0-1] 42" "completed fsdp.world_size"
wait_for "fsdp> fsdp.world_size() * 21" "the completed line"
# several candidates: listed under the line, which stays as typed
type_text "fsdp.reset_c"
key Tab
type_text "() or fsdp.re"
key Tab
wait_for "reset_comm_stats" "listed candidates"
wait_for "retie" "listed candidates (lazily loaded names too)"
key C-u
# fields of a user table, methods of a tensor
enter "cfg = {alpha = 1, beta = 2}"
type_text "cfg.al"
key Tab
type_text " * 5"
key Enter
wait_for "[0-1] 5" "completed a table field"
enter "t = fsdp.ones{3}"
type_text "t:nu"
key Tab
type_text "() + 0.25"
key Enter
wait_for "[0-1] 3.25" "completed a tensor method"
# a path with a bracketed key, and the fields of an nn module
enter "deep = {layers = {{alpha = 4}}}"
type_text "deep.layers[1].al"
key Tab
key Enter
wait_for "[0-1] 4" "completed after a bracketed key"
enter "lin = fsdp.nn.Linear(2, 3)"
type_text "lin.wei"
key Tab
type_text ":nu"
key Tab
type_text "()"
key Enter
wait_for "[0-1] 6" "completed a module field and its method"

# errors, per rank
enter 'error("boom")'
wait_for "fsdprun: [0-1] stdin:1: boom" "error on every rank"
enter 'if fsdp.rank() == 1 then error("only one") end'
wait_for "fsdprun: [1] stdin:1: only one" "error on one rank"

# multi-line input
enter "for i = 1, 2 do"
wait_for ">>" "continuation prompt"
enter "print('line' .. i)"
enter "end"
wait_for "[0-1] line1" "multi-line input"
wait_for "      line2" "multi-line output lines up"

# ^C at the prompt drops what was typed; the session goes on
type_text "1 +"
key C-c
wait_for "^C" "^C at the prompt"
enter "6 * 7 + 100"
wait_for "[0-1] 142" "after ^C at the prompt"

# up arrow: the previous line comes back
key Up
i=0
while [ $i -lt 50 ] && [ "$(last_line)" != "fsdp> 6 * 7 + 100" ]; do sleep 0.1; i=$((i + 1)); done
[ "$(last_line)" = "fsdp> 6 * 7 + 100" ] || fail "up arrow: last line is '$(last_line)'"
key C-u

# ^C during an evaluation interrupts every rank and returns to the prompt
enter "while true do fsdp.barrier() end"
sleep 0.5
key C-c
wait_for "interrupted" "^C during an evaluation"
enter "40 + 3"
wait_for "[0-1] 43" "the REPL after an interrupted evaluation"

enter ":quit"
wait_dead
[ "$(pane_status)" = "0" ] || { fail ":quit: exit status '$(pane_status)', expected 0"; show; }
grep -qF 'error("boom")' "$T/history" || fail "history file lacks error(\"boom\"): $(cat "$T/history")"

# ---- session 2: the history of session 1 ---------------------------------------------------------
start -n 2 -i
wait_for "fsdp>" "prompt (session 2)"
key Up
i=0
while [ $i -lt 50 ] && [ "$(last_line)" != "fsdp> :quit" ]; do sleep 0.1; i=$((i + 1)); done
[ "$(last_line)" = "fsdp> :quit" ] || fail "history across sessions: last line is '$(last_line)'"
key Up
i=0
while [ $i -lt 50 ] && [ "$(last_line)" != "fsdp> 40 + 3" ]; do sleep 0.1; i=$((i + 1)); done
[ "$(last_line)" = "fsdp> 40 + 3" ] || fail "history across sessions (2): last line is '$(last_line)'"
key C-u
# a tight loop typed at the prompt is interpreted (jit.off), so ^C stops it too
enter "n = 0; while true do n = n + 1 end"
sleep 0.5
key C-c
wait_for "[0-1] interrupted" "^C stops a tight loop typed at the prompt"
enter "n > 1000"
wait_for "[0-1] true" "the REPL after stopping a tight loop"
key C-d
wait_dead
[ "$(pane_status)" = "0" ] || fail "^D: exit status '$(pane_status)', expected 0"

finish repl_tty
