#!/bin/sh
# cli_stuck.sh — after a rank fails, the other ranks get the grace period (2 s, as SIGINT) to
# finish or fail; then fsdprun ends the run with exit status 1 and the failing rank's message,
# whatever they do: a rank spinning in compiled Lua code (no hook reaches a trace) or in a C
# call is abandoned (fsdprun exits without it), one spinning in interpreted Lua is stopped by
# a hook, one that reaches a collective within the grace period fails there as before. Each
# run has 60 s (timeout) and must end within a few seconds of the grace period. Run by ctest
# with FSDPRUN set.
set -u
. "$(dirname "$0")/lib/check.sh"

now_ms() { date +%s%3N; }

# stuck WHAT SPIN: rank 1 of 2 runs the Lua code SPIN while rank 0 raises "boom"; status in
# rc, tenths of a second in took
stuck() {
  what=$1
  printf 'local fsdp = require "fsdp"\nif fsdp.rank() == 1 then %s end\nerror("boom")\n' "$2" \
    >"$T/r.lua"
  t0=$(now_ms)
  timeout -k 5 60 "$FSDPRUN" -n 2 "$T/r.lua" >"$T/out" 2>"$T/err"
  rc=$?
  took=$((($(now_ms) - t0) / 100))
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || fail "$what: fsdprun hung (killed after 60 s)"
  [ "$rc" -eq 1 ] || fail "$what: exit status $rc, expected 1; stderr: $(cat "$T/err")"
  expect_has err "fsdprun: [rank 0] $T/r.lua:3: boom" "$what: rank 0's message"
  expect_has err "stack traceback:" "$what: rank 0's traceback"
  head -n 1 "$T/err" | grep -qF "[rank 0]" || fail "$what: the first report is not rank 0's: $(cat "$T/err")"
  # the grace period is 2 s (the stop wait 2 s more); a few seconds of slack for a loaded
  # machine
  [ "$took" -le 80 ] || fail "$what: took $took tenths of a second (grace period: 2 s)"
}

# The recipe as a new user wrote it: a compiled loop that never calls a collective.
stuck "compiled loop" "while true do end"
expect_has err "fsdprun: [rank 1] did not stop within 2 s after rank 0 failed" "compiled loop: rank 1 is named"
expect_has err "abandoned" "compiled loop"
[ "$took" -ge 15 ] || fail "compiled loop: ended after $took tenths of a second, before the grace period"

# A rank blocked in a C call is abandoned the same way.
stuck "C call" "os.execute('sleep 10')"
expect_has err "fsdprun: [rank 1] did not stop within 2 s after rank 0 failed" "C call"

# Interpreted Lua (a loop calling a C function makes that call in the interpreter, where hooks
# run): the hook stops it at the end of the grace period, with rank 0's message.
stuck "interpreted loop" "local clock = fsdp.core.clock; while true do clock() end"
expect_has err "fsdprun: [rank 1] $T/r.lua:2: stopped 2 s after rank 0 failed: $T/r.lua:3: boom" "interpreted loop"
expect_lacks err "abandoned" "interpreted loop"
[ "$(grep -c "stack traceback:" "$T/err")" = 1 ] || fail "interpreted loop: rank 1's report is more than one line: $(cat "$T/err")"

# A rank that reaches a collective within the grace period fails there, as without the stop.
stuck "slow peer" "local clock = fsdp.core.clock; local t = clock(); while clock() - t < 0.5 do end; fsdp.barrier('late')"
expect_has err "fsdprun: [rank 1] $T/r.lua:2: rank 0 failed: $T/r.lua:3: boom" "slow peer"
expect_lacks err "stopped" "slow peer"
expect_lacks err "abandoned" "slow peer"
[ "$took" -le 15 ] || fail "slow peer: took $took tenths of a second: it waited for the grace period"

finish cli_stuck
