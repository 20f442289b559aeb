#!/bin/sh
# dist_faults.sh — collective failure (invariant 3) through fsdprun -n N, with
# tests/dist/fault_inject.lua: an error injected on rank 1 of 4, and on rank 0, before the
# first collective, between collectives, and while the peers wait in an all_reduce (a Lua
# error and an engine error) ends the run within seconds (the abort wakes the peers, no
# timeout) with exit status 1, the full traceback of the failing rank, and one line per peer
# naming "rank R failed: <the injected message>". A rank that returns early while the others
# wait, and one that is too slow (--timeout=1), end the run with a message naming it. The same
# error on every rank is reported in full once. SIGINT stops every rank (exit 130), also with a
# rank blocked in a collective and one in a compiled loop. Run by ctest with
# FSDPRUN set.
# (Mid-forward / mid-backward injection inside FSDP units: with the wrap tests, once they land.)
. "${0%/*}/lib.sh"
R="$SRC/tests/dist/fault_inject.lua"

count() { grep -cF -- "$2" "$T/$1"; }
# fault WHAT ARGS...: run fsdprun ARGS (killed after 30 s), status in rc, seconds in took
fault() {
  what=$1
  shift
  t0=$(now_ms)
  timeout -k 5 30 "$FSDPRUN" "$@" >"$T/out" 2>"$T/err"
  rc=$?
  took=$((($(now_ms) - t0) / 100)) # tenths of a second
  [ "$rc" -eq 1 ] || fail "$what: exit status $rc, expected 1; stderr: $(cat "$T/err")"
  expect_lacks out "finished" "$what: no rank may finish"
}
# within WHAT TENTHS: the run took at most TENTHS tenths of a second
within() { [ "$took" -le "$2" ] || fail "$1: took $took tenths of a second (limit $2)"; }

# injected BAD AT MESSAGE: rank BAD of 4 raises MESSAGE at AT; the others are told
injected() {
  bad=$1 at=$2 msg=$3
  what="rank $bad fails $at"
  fault "$what" -n 4 "$R" --rank="$bad" --at="$at"
  within "$what" 50 # the default timeout is 60 s: only the abort can end it this soon
  # the failing rank: the full report, with the traceback down to the main chunk
  expect_has err "fsdprun: [rank $bad] $R:" "$what"
  expect_has err "$msg" "$what"
  expect_has err "stack traceback:" "$what"
  expect_has err "$R:" "$what"
  [ "$(count err "stack traceback:")" = 1 ] || fail "$what: more than one traceback: $(cat "$T/err")"
  # every peer: one line naming the failed rank and its message
  [ "$(count err "rank $bad failed: ")" = 3 ] || fail "$what: not every peer reports rank $bad: $(cat "$T/err")"
  for r in 0 1 2 3; do
    [ "$r" = "$bad" ] && continue
    grep -qF "fsdprun: [rank $r] $R:" "$T/err" || fail "$what: rank $r says nothing"
    grep "fsdprun: \[rank $r\]" "$T/err" | grep -qF "rank $bad failed: $R:" ||
      fail "$what: rank $r does not name rank $bad's failure: $(cat "$T/err")"
    grep "fsdprun: \[rank $r\]" "$T/err" | grep -qF "$msg" ||
      fail "$what: rank $r does not carry the message '$msg'"
  done
  # the root cause comes first
  head -n 1 "$T/err" | grep -qF "[rank $bad]" || fail "$what: the first report is not rank $bad's: $(head -n 1 "$T/err")"
}

injected 1 before "injected fault before the first collective on rank 1"
injected 1 between "injected fault between collectives on rank 1"
injected 1 blocked "injected fault while peers wait on rank 1"
injected 1 engine "matmul: shapes (2, 3) and (4, 5) do not match"
injected 0 before "injected fault before the first collective on rank 0"
injected 0 blocked "injected fault while peers wait on rank 0"
expect_has err "in function 'inject'" "the traceback names the function that raised"

# ---- a rank that leaves early, a rank that is too slow ---------------------------------------------
fault "rank 1 returns early" -n 4 --timeout=5 "$R" --rank=1 --at=return
within "rank 1 returns early" 40
expect_has err "rank 1 left the group" "rank 1 returns early"
expect_has err "all_reduce #4 'step.4'" "rank 1 returns early: the collective and its label"
expect_has err "flight recorder" "rank 1 returns early: the flight recorder"
expect_lacks err "[rank 1]" "rank 1 returns early: rank 1 itself succeeded"
[ "$(grep -c "^fsdprun: \[rank [023]\]" "$T/err")" = 3 ] || fail "rank 1 returns early: not every peer failed: $(cat "$T/err")"

fault "rank 1 too slow" -n 4 --timeout=1 "$R" --rank=1 --at=slow --busy=2.5
within "rank 1 too slow" 80
expect_has err "timeout after 1 s in all_reduce #4 'step.4': rank 1 has not arrived" "rank 1 too slow"
[ "$(grep -c "^fsdprun: \[rank [0-3]\]" "$T/err")" = 4 ] || fail "rank 1 too slow: not every rank failed: $(cat "$T/err")"
[ "$(count err "stack traceback:")" = 1 ] || fail "rank 1 too slow: more than one full report: $(cat "$T/err")"

# ---- the same error everywhere: one full report, one line per other rank -------------------------
fault "every rank fails" -n 4 "$R" --at=all
within "every rank fails" 50
[ "$(count err "the same fault on every rank")" = 4 ] || fail "every rank fails: $(cat "$T/err")"
[ "$(count err "(the same error as rank ")" = 3 ] || fail "every rank fails: not deduplicated: $(cat "$T/err")"
[ "$(count err "stack traceback:")" = 1 ] || fail "every rank fails: $(cat "$T/err")"

# ---- a collective mismatch: both sides see it; one full report ------------------------------------
fault "label mismatch" -n 2 -e 'local f = require "fsdp"; f.barrier("b"); f.all_reduce(1, "sum", "lbl" .. f.rank())'
within "label mismatch" 50
expect_has err "collective mismatch at #2: rank 0 called all_reduce(f64 x1 sum, 'lbl0') but rank 1 called all_reduce(f64 x1 sum, 'lbl1')" "label mismatch"
[ "$(count err "stack traceback:")" = 1 ] || fail "label mismatch: $(cat "$T/err")"
expect_has err "(the same error as rank " "label mismatch"

# ---- core.abort by hand: the aborting rank's own collective fails too ------------------------------
fault "core.abort" -n 2 -e 'local c = require("fsdp").core; if c.rank() == 1 then c.abort("by hand") end; c.barrier()'
within "core.abort" 50
expect_has err "fsdprun: [rank 0] (command line):1: rank 1 failed: by hand" "core.abort: the peer"
expect_has err "fsdprun: [rank 1] (command line):1: rank 1 failed: by hand" "core.abort: the rank itself"

# ---- an -e chunk fails on both ranks ------------------------------------------------------------
fault "-e fails" -n 2 -e 'error("from -e")' "$R"
expect_has err "fsdprun: [rank 0] (command line):1: from -e" "-e fails"
expect_has err "fsdprun: [rank 1] (command line):1: from -e" "-e fails"

# ---- SIGINT: every rank stops, exit 130 -----------------------------------------------------------------
interrupt() { # WHAT ARGS...: SIGINT after 1 s
  what=$1
  shift
  t0=$(now_ms)
  timeout -k 15 --preserve-status -s INT 1 "$FSDPRUN" "$@" >"$T/out" 2>"$T/err"
  rc=$?
  took=$((($(now_ms) - t0) / 100))
  [ "$rc" -eq 130 ] || fail "$what: exit status $rc, expected 130; stderr: $(cat "$T/err")"
  expect_has out "spinning" "$what"
  expect_has err "interrupted" "$what"
  expect_lacks err "error in error handling" "$what"
}
interrupt "SIGINT, 4 ranks" -n 4 "$R" --at=spin
within "SIGINT, 4 ranks" 60
expect_lacks err "did not stop in time" "SIGINT, 4 ranks: the hook stops every rank (no grace timer)"
for r in 0 1 3; do
  grep "fsdprun: \[rank $r\]" "$T/err" | grep -qF "interrupted" || fail "SIGINT: rank $r was not interrupted: $(cat "$T/err")"
done
grep "fsdprun: \[rank 2\]" "$T/err" | grep -qF "failed: " || fail "SIGINT: rank 2 (in a barrier) was not released: $(cat "$T/err")"
interrupt "SIGINT, a compiled loop" -n 4 "$R" --at=spin --rank=1 --compiled
within "SIGINT, a compiled loop" 80
expect_has err "the running code did not stop in time" "SIGINT, a compiled loop: the grace timer"

finish
