#!/bin/sh
# cli_progress.sh — fsdp.log's progress output as fsdprun shows it: piped, plain lines (no
# "\r", no escape) that include the steps carrying val_loss, which is not logged every step; on a
# terminal (a pseudo-terminal made by `script`), the bar redrawn in place, the val_loss step kept
# on its own line; --progress=line|bar|off forcing the mode and refusing anything else; the
# JSONL's folder made and a resumed run appending to it. Under mpirun every rank's stdout is a
# pseudo-terminal: `mpirun ... > file` must still get plain lines, mpirun on a terminal the bar.
. "${0%/*}/lib.sh"
need script "apt-get install util-linux"

# A run of 60 steps, val_loss every 25, a line every 20 steps when plain; JSONL in $T/sub/.
cat >"$T/train.lua" <<'LUA'
local fsdp = require "fsdp"
local dir = arg[1]
fsdp.log.setup { total = 60, every = 20, jsonl = dir .. "/sub/m.jsonl", append = arg[2] == "append" }
for s = 1, 60 do
  local m = { loss = 1 / s }
  if s % 25 == 0 then m.val_loss = 2 + s / 100 end
  fsdp.log(s, m)
end
fsdp.log.finish()
LUA
ESC=$(printf '\033')
# on_tty FILE CMD...: CMD's output through a pseudo-terminal, into FILE
on_tty() {
  f=$1
  shift
  script -qec "$*" /dev/null >"$f" 2>&1 </dev/null
}
plain_lines() { # FILE WHAT: plain lines with every val_loss step
  grep -qF "$ESC" "$1" && fail "$2: escape sequences in the output: $(od -c "$1" | head -5)"
  for s in 1 20 25 40 50 60; do
    grep -q "^step $s/60 " "$1" || fail "$2: no line for step $s: $(cat "$1")"
  done
  grep -qF "step 25/60 | loss 0.0400 | val_loss 2.2500" "$1" || fail "$2: val_loss of step 25 not shown: $(cat "$1")"
  grep -qF "step 50/60 | loss 0.0200 | val_loss 2.5000" "$1" || fail "$2: val_loss of step 50 not shown: $(cat "$1")"
}
bar() { # FILE WHAT: the bar, with the val_loss steps kept on lines of their own
  grep -qF "${ESC}[K" "$1" || fail "$2: no bar (no clear-to-end-of-line): $(od -c "$1" | head -5)"
  grep -qF "step 25/60 | loss 0.0400 | val_loss 2.2500" "$1" || fail "$2: val_loss of step 25 not shown"
  # the val_loss line ends with a newline before the next step is drawn
  tr -d '\r' <"$1" | grep -q "val_loss 2.2500 | ETA [0-9ms]*\$" || fail "$2: the val_loss line was drawn over: $(od -c "$1" | head -20)"
}

# ---- one process ------------------------------------------------------------------------------
run "$FSDPRUN" "$T/train.lua" "$T"
expect_rc 0 "piped run"
plain_lines "$T/out" "piped"
on_tty "$T/tty" "$FSDPRUN" "$T/train.lua" "$T" || fail "run on a terminal: exit status $?: $(cat "$T/tty")"
bar "$T/tty" "on a terminal"
on_tty "$T/tty_line" "$FSDPRUN" --progress=line "$T/train.lua" "$T"
tr -d '\r' <"$T/tty_line" >"$T/tty_line.txt"
plain_lines "$T/tty_line.txt" "--progress=line on a terminal"
run "$FSDPRUN" --progress bar "$T/train.lua" "$T"
bar "$T/out" "--progress bar, piped"
run "$FSDPRUN" --progress=off "$T/train.lua" "$T"
expect_rc 0 "--progress=off"
[ -s "$T/out" ] && fail "--progress=off printed: $(cat "$T/out")"
run "$FSDPRUN" --progress=fancy -e 'print(1)'
expect_rc 2 "--progress=fancy"
expect_has err "--progress 'fancy': expected 'auto', 'bar', 'line' or 'off'" "--progress=fancy"

# the JSONL: its folder made; 5 runs above wrote it anew each time, a resumed run appends
[ "$(grep -c '"step"' "$T/sub/m.jsonl")" -eq 60 ] || fail "the JSONL has $(grep -c '"step"' "$T/sub/m.jsonl") lines, expected 60"
run "$FSDPRUN" --progress=off "$T/train.lua" "$T" append
[ "$(grep -c '"step"' "$T/sub/m.jsonl")" -eq 120 ] || fail "append: the JSONL has $(grep -c '"step"' "$T/sub/m.jsonl") lines, expected 120"

# ---- under mpirun: every rank's stdout is mpirun's pseudo-terminal ---------------------------------
if command -v mpirun >/dev/null 2>&1; then
  run timeout -k 5 120 $MPIRUN -np 2 "$FSDPRUN" "$T/train.lua" "$T"
  expect_rc 0 "mpirun, piped"
  plain_lines "$T/out" "mpirun -np 2 ... > file"
  [ "$(grep -c "^step 25/60 " "$T/out")" -eq 1 ] || fail "mpirun: step 25 shown $(grep -c "^step 25/60 " "$T/out") times (rank 0 only)"
  on_tty "$T/mpi_tty" timeout -k 5 120 $MPIRUN -np 2 "$FSDPRUN" "$T/train.lua" "$T"
  bar "$T/mpi_tty" "mpirun on a terminal"
else
  echo "(mpirun is not installed: the mpirun cases are left out)"
fi
finish
