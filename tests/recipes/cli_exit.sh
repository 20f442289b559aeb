#!/bin/sh
# cli_exit.sh — os.exit in a recipe ends the rank's run, not the process under it: the exit
# status is the code (true 0, false 1, none 0), output written so far is kept, nothing after
# it runs (not even behind pcall), several ranks exiting end with the code and no report, a rank
# that exits early leaves its peers' collectives failing at once; under mpirun MPI is finalized
# (no "exiting improperly" from mpirun); in the REPL (-i, fsdp.debug()) os.exit ends the session
# and the run with its code; with --debug-on-error os.exit starts no post-mortem, and in the
# post-mortem it ends the run with status 1 (a rank failed).
. "${0%/*}/lib.sh"

# code CODE EXPECTED WHAT: fsdprun -e CODE exits with EXPECTED
code() {
  run timeout -k 5 60 "$FSDPRUN" -e "$1"
  expect_rc "$2" "$3"
}
code 'os.exit(3)' 3 "os.exit(3)"
code 'os.exit()' 0 "os.exit()"
code 'os.exit(true)' 0 "os.exit(true)"
code 'os.exit(false)' 1 "os.exit(false)"
code 'io.write("kept"); os.exit(0); print("not reached")' 0 "output before os.exit"
expect_has out "kept" "output before os.exit"
expect_lacks out "not reached" "nothing after os.exit"
[ -s "$T/err" ] && fail "os.exit(0) printed on stderr: $(cat "$T/err")"
code 'pcall(os.exit, 5); print("after pcall")' 5 "os.exit behind pcall"
expect_lacks out "after pcall" "pcall cannot keep the rank running"
# finalizers run: the state is closed, as at the end of a recipe
code 'P = newproxy(true); getmetatable(P).__gc = function() io.open("'"$T"'/gc.txt", "w"):write("finalized") end; os.exit(0)' 0 "finalizers"
[ "$(cat "$T/gc.txt" 2>/dev/null)" = finalized ] || fail "a finalizer did not run after os.exit"

# several ranks
run timeout -k 5 60 "$FSDPRUN" -n 3 -e 'local f = require "fsdp"; f.barrier(); os.exit(f.rank() == 2 and 4 or 0)'
expect_rc 4 "-n 3, rank 2 exits with 4"
expect_lacks err "fsdprun:" "-n 3, os.exit is no failure"
run timeout -k 5 60 "$FSDPRUN" -n 2 -e 'local f = require "fsdp"; if f.rank() == 1 then os.exit(0) end; f.barrier("after")'
expect_rc 1 "-n 2, rank 1 leaves early"
expect_has err "rank 1 left the group" "-n 2, rank 1 leaves early"

# the REPL: os.exit ends the session and the run
printf 'x = 1\nos.exit(7)\nprint("not reached")\n' | timeout -k 5 60 "$FSDPRUN" -n 2 -i >"$T/out" 2>"$T/err"
rc=$?
expect_rc 7 "os.exit(7) in the REPL on 2 ranks"
expect_lacks out "not reached" "os.exit in the REPL"
printf 'os.exit(6)\nprint("not reached")\n' | timeout -k 5 60 "$FSDPRUN" -i >"$T/out" 2>"$T/err"
rc=$?
expect_rc 6 "os.exit(6) in the REPL on 1 rank"
expect_lacks out "not reached" "os.exit in the REPL, 1 rank"
printf 'local fsdp = require "fsdp"\nfsdp.debug()\nprint("the recipe went on")\n' >"$T/debug.lua"
printf 'os.exit(0)\n' | timeout -k 5 60 "$FSDPRUN" -n 2 "$T/debug.lua" >"$T/out" 2>"$T/err"
rc=$?
expect_rc 0 "os.exit(0) in fsdp.debug()"
expect_lacks out "the recipe went on" "os.exit in fsdp.debug() ends the recipe"

# --debug-on-error: os.exit is no failure, so no post-mortem (stdin is not read), no report
printf 'print("REPL ran")\n' | timeout -k 5 60 "$FSDPRUN" --debug-on-error -e 'os.exit(4)' >"$T/out" 2>"$T/err"
rc=$?
expect_rc 4 "os.exit(4) with --debug-on-error"
expect_lacks out "REPL ran" "os.exit with --debug-on-error: no post-mortem"
[ -s "$T/err" ] && fail "os.exit(4) with --debug-on-error printed on stderr: $(cat "$T/err")"
printf 'print("REPL ran")\n' | timeout -k 5 60 "$FSDPRUN" --debug-on-error -n 2 -e 'local f = require "fsdp"; f.barrier(); pcall(os.exit, f.rank() == 1 and 5 or 0)' >"$T/out" 2>"$T/err"
rc=$?
expect_rc 5 "-n 2, os.exit behind pcall with --debug-on-error"
expect_lacks out "REPL ran" "-n 2, os.exit with --debug-on-error: no post-mortem"
[ -s "$T/err" ] && fail "-n 2, os.exit with --debug-on-error printed on stderr: $(cat "$T/err")"
# os.exit in the post-mortem ends the run, but the failure stays one (exit status 1)
printf 'os.exit(0)\nprint("not reached")\n' | timeout -k 5 60 "$FSDPRUN" --debug-on-error -n 2 -e 'local f = require "fsdp"; if f.rank() == 1 then error("boom") end; f.barrier()' >"$T/out" 2>"$T/err"
rc=$?
expect_rc 1 "os.exit(0) in the post-mortem"
expect_lacks out "not reached" "os.exit in the post-mortem ends the session"
expect_has err "boom" "os.exit in the post-mortem: the failure is reported"

# mpirun: MPI finalized, so mpirun has nothing to complain about
if command -v mpirun >/dev/null 2>&1; then
  run timeout -k 5 120 $MPIRUN -np 2 "$FSDPRUN" -e 'print("rank" .. require("fsdp").rank()); os.exit(0)'
  expect_rc 0 "mpirun, os.exit(0)"
  expect_lacks err "improperly" "mpirun, os.exit(0)"
  expect_lacks out "improperly" "mpirun, os.exit(0)"
  expect_has out "rank1" "mpirun, os.exit(0): rank 1's output"
  run timeout -k 5 120 $MPIRUN -np 2 "$FSDPRUN" -e 'os.exit(3)'
  expect_rc 3 "mpirun, os.exit(3)"
  expect_lacks err "improperly" "mpirun, os.exit(3)"
else
  echo "(mpirun is not installed: the mpirun cases are left out)"
fi
finish
