#!/bin/sh
# repl_tty.sh — the SPMD REPL on a real terminal: fsdprun -n 2 -i runs inside tmux (a pseudo-
# terminal), keys are sent to it and the screen is read back. Checks the prompt, grouped output,
# the preloaded globals fsdp and nn (the banner says so), error display, tab completion (unique,
# listed, table fields, methods, a path with a bracketed key, nn), multi-line input,
# ^C dropping a half-typed input, ^C interrupting an evaluation on every rank, history (up
# arrow, the history file, a second session recalling the first), :quit's exit status; in
# fsdp.debug(), completion of the caller's locals and no preloaded globals.
# Run by ctest with FSDPRUN=<build>/bin/fsdprun; needs tmux (Debian package tmux).
. "${0%/*}/lib.sh"
need tmux "apt-get install tmux"
. "${0%/*}/lib/tmux.sh"
# start ARGS...: fsdprun ARGS in a fresh terminal, history in $T/history
start() { tmux_start "$FSDPRUN" "$@"; }
# the last non-empty line of the screen
last_line() { screen; grep -v '^ *$' "$T/screen" | tail -1; }
# recall TEXT WHAT: the up arrow brings back the line TEXT (at most 5 s)
recall() {
  key Up
  i=0
  while [ $i -lt 50 ] && [ "$(last_line)" != "fsdp> $1" ]; do sleep 0.1; i=$((i + 1)); done
  [ "$(last_line)" = "fsdp> $1" ] || fail "$2: last line is '$(last_line)'"
}

# ---- session 1 --------------------------------------------------------------------------------
start -n 2 -i
wait_for "fsdp>" "prompt"  # capture-pane drops trailing blanks
wait_for "2 ranks (local)" "banner"
wait_for "fsdp and nn are globals" "banner: the preloaded globals"
enter "1 + 1"
wait_for "[0-1] 2" "grouped result"
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
type_text "lin = nn.Lin"
key Tab
type_text "(2, 3)"
key Enter
wait_for "fsdp> lin = nn.Linear(2, 3)" "completed a name of the preloaded nn"
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
recall "6 * 7 + 100" "up arrow"
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
recall ":quit" "history across sessions"
recall "40 + 3" "history across sessions (2)"
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

# ---- session 3: fsdp.debug() completes the caller's locals, and preloads nothing ----------------
cat >"$T/dbg.lua" <<'LUA'
local fsdp = require "fsdp"
local settings = { gamma = 3 }
fsdp.debug()
print("after " .. fsdp.rank())
LUA
start -n 2 "$T/dbg.lua"
wait_for "fsdp.debug() at" "banner (fsdp.debug)"
type_text "settings.ga"
key Tab
type_text " * 2"
key Enter
wait_for "[0-1] 6" "completed a field of the caller's local"
enter "nn == nil"
wait_for "[0-1] true" "fsdp.debug() adds no nn global"
enter ":quit"
wait_for "after 1" "the recipe goes on"
wait_dead
[ "$(pane_status)" = "0" ] || fail "fsdp.debug session: exit status '$(pane_status)', expected 0"

finish
