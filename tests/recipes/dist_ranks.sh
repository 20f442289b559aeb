#!/bin/sh
# dist_ranks.sh — fsdprun -n N: rank()/world_size(), all_reduce (every op, numbers and
# tensors) and broadcast equal the serial answer on every rank, barrier, comm_stats
# (tests/dist/ranks_collectives.lua at -n 1, 2, 4 and without -n); recipe arguments, -e,
# separate memory domains, --timeout and the thread rule per rank (ranks_env.lua: max(1,
# cores / N), FSDP_THREADS, FSDP_BLAS_THREADS); whole output lines (ranks_output.lua); the
# recipe read once (stdin, missing file, syntax error); -n, --timeout, -i, FSDP_THREADS and
# FSDP_BLAS_THREADS validation. Run by ctest with FSDPRUN set.
. "${0%/*}/lib.sh"
D="$SRC/tests/dist"

# expect_ranks N PREFIX: stdout has exactly the lines "PREFIX r N" for r = 0..N-1, in any order
expect_ranks() {
  want=$(r=0; while [ "$r" -lt "$1" ]; do echo "$2 $r $1"; r=$((r + 1)); done)
  got=$(sort -n -k2 "$T/out")
  [ "$got" = "$want" ] || fail "$2 at -n $1: stdout was '$(cat "$T/out")', expected '$want'"
}

# ---- collectives at 1, 2 and 4 ranks ------------------------------------------------------------
for n in 1 2 4; do
  run "$FSDPRUN" -n "$n" "$D/ranks_collectives.lua" --world="$n"
  expect_rc 0 "collectives -n $n"
  expect_ranks "$n" ok
done
run "$FSDPRUN" "$D/ranks_collectives.lua"
expect_rc 0 "collectives without -n (a world of one)"
expect_ranks 1 ok

# ---- what each rank's state gets --------------------------------------------------------------------
cores=$(nproc) # the CPUs this process may run on (sched_getaffinity), as the rule counts them
per_rank=$((cores / 4))
[ "$per_rank" -ge 1 ] || per_rank=1
run "$FSDPRUN" -n 4 --timeout=7.5 -e 'FROM_E = "e" .. require("fsdp").rank()' \
  "$D/ranks_env.lua" pos --lr=0.5 "--tag=x y"
expect_rc 0 "env -n 4"
[ "$(lines_of out)" = 4 ] || fail "env -n 4: $(cat "$T/out")"
for r in 0 1 2 3; do
  expect_has out "env $r threads=$per_rank timeout=7.5" "env -n 4: rank $r: threads max(1, $cores/4), --timeout"
done
run env FSDP_BLAS_THREADS=3 "$FSDPRUN" -n 2 --timeout 2 -e 'FROM_E = "e" .. require("fsdp").rank()' \
  "$D/ranks_env.lua" pos --lr=0.5 "--tag=x y"
expect_rc 0 "env FSDP_BLAS_THREADS=3 -n 2"
expect_has out "env 0 threads=3 timeout=2" "FSDP_BLAS_THREADS overrides"
expect_has out "env 1 threads=3 timeout=2" "FSDP_BLAS_THREADS overrides"
run env FSDP_THREADS=5 FSDP_BLAS_THREADS=3 "$FSDPRUN" -n 2 -e 'FROM_E = "e" .. require("fsdp").rank()' \
  "$D/ranks_env.lua" pos --lr=0.5 "--tag=x y"
expect_rc 0 "env FSDP_THREADS=5 -n 2"
expect_has out "env 0 threads=5 timeout=" "FSDP_THREADS overrides, over FSDP_BLAS_THREADS"
expect_has out "env 1 threads=5 timeout=" "FSDP_THREADS overrides, over FSDP_BLAS_THREADS"
# without -n: one rank, every core
run env FSDP_THREADS= "$FSDPRUN" -e 'FROM_E = "e0"' "$D/ranks_env.lua" pos --lr=0.5 "--tag=x y"
expect_rc 0 "env without -n"
expect_has out "env 0 threads=$cores timeout=" "without -n: every core"

# ---- output: 4 ranks x 300 lines, none cut by another rank -------------------------------------------
run "$FSDPRUN" -n 4 "$D/ranks_output.lua" --lines=300
expect_rc 0 "output"
# a whole line: "line", the rank, three pieces of 97 copies of the rank's digit, a number
bad=$(awk -F'\t' '
  NF != 6 || $1 != "line" || $2 !~ /^[0-3]$/ || $6 !~ /^[0-9]+$/ { bad++; next }
  { for (f = 3; f <= 5; f++) { s = $f; if (length(s) != 97 || gsub($2, "", s) != 97) { bad++; next } } }
  END { print bad + 0 }' "$T/out")
[ "$(lines_of out)" = 1200 ] || fail "output: $(lines_of out) lines, expected 1200"
[ "$bad" = 0 ] || fail "output: $bad lines mixed from several ranks"
for r in 0 1 2 3; do
  [ "$(grep -c "^line	$r	" "$T/out")" = 300 ] || fail "output: rank $r did not print 300 whole lines"
done

# ---- the recipe is read once ------------------------------------------------------------------------------
printf 'local f = require "fsdp"\nprint("stdin " .. f.rank() .. " " .. f.world_size())\n' >"$T/stdin.lua"
"$FSDPRUN" -n 2 - <"$T/stdin.lua" >"$T/out" 2>"$T/err"
rc=$?
expect_rc 0 "recipe from stdin at -n 2"
expect_ranks 2 stdin
run "$FSDPRUN" -n 3 "$T/none.lua"
expect_rc 1 "missing recipe at -n 3"
[ "$(cat "$T/err")" = "fsdprun: cannot open $T/none.lua: No such file or directory" ] ||
  fail "missing recipe at -n 3: stderr was '$(cat "$T/err")'"
printf 'local x = 1\nlocal y = = 2\n' >"$T/syn.lua"
run "$FSDPRUN" -n 3 "$T/syn.lua"
expect_rc 1 "syntax error at -n 3"
[ "$(lines_of err)" = 1 ] || fail "syntax error at -n 3: not reported once: $(cat "$T/err")"
expect_has err "fsdprun: $T/syn.lua:2:" "syntax error at -n 3"
# -n 1: the rank runs on a thread but reports like a single run (no [rank 0] prefix)
printf 'error("solo")\n' >"$T/solo.lua"
run "$FSDPRUN" -n 1 "$T/solo.lua"
expect_rc 1 "-n 1 error"
expect_has err "fsdprun: $T/solo.lua:1: solo" "-n 1 error"
expect_lacks err "[rank" "-n 1 error has no rank prefix"
# -n 1 -i: the interactive loop on the rank's thread, collectives included
printf 'x = fsdp.all_reduce(21, "sum") * 2\nprint(x, fsdp.world_size(), fsdp.backend())\n' |
  "$FSDPRUN" -n 1 -e 'fsdp = require "fsdp"' -i >"$T/out" 2>"$T/err"
rc=$?
expect_rc 0 "-n 1 -i"
[ "$(cat "$T/out")" = "42	1	local" ] || fail "-n 1 -i: stdout was '$(cat "$T/out")'"
# -n 2 -i: the recipe runs on both ranks, then the SPMD REPL (tests/recipes/repl_*.sh go further)
echo 'print("ran")' >"$T/ran.lua"
printf 'fsdp.all_reduce(fsdp.rank() + 1)\n' |
  "$FSDPRUN" -n 2 -e 'fsdp = require "fsdp"' -i "$T/ran.lua" >"$T/out" 2>"$T/err"
rc=$?
expect_rc 0 "-n 2 -i"
[ "$(cat "$T/out")" = "ran
ran
[0-1] 3" ] || fail "-n 2 -i: stdout was '$(cat "$T/out")'"

# ---- usage errors: exit 2, nothing runs ----------------------------------------------------------------
echo 'print("ran")' >"$T/ok.lua"
check_usage() { # WHAT TEXT ARGS...
  what=$1 text=$2
  shift 2
  run "$FSDPRUN" "$@"
  expect_rc 2 "$what"
  expect_has err "$text" "$what"
  expect_lacks out "ran" "$what must not run the recipe"
  [ "$(lines_of err)" = 1 ] || fail "$what: more than one line: $(cat "$T/err")"
}
check_usage "-n 0" "-n '0': the number of ranks must be a positive integer" -n 0 "$T/ok.lua"
check_usage "-n x" "-n 'x': the number of ranks must be a positive integer" -n x "$T/ok.lua"
check_usage "-n 2.5" "-n '2.5'" -n 2.5 "$T/ok.lua"
check_usage "-n 5000" "-n '5000': at most 1024 ranks" -n 5000 "$T/ok.lua"
check_usage "--timeout=0" "--timeout '0': the timeout must be a positive number of seconds" --timeout=0 -n 2 "$T/ok.lua"
check_usage "--timeout=abc" "--timeout 'abc'" --timeout=abc "$T/ok.lua"
check_usage "--timeout=1e400" "--timeout '1e400': the timeout must be a positive number of seconds" --timeout=1e400 "$T/ok.lua"
check_usage "--timeout=inf" "--timeout 'inf'" --timeout=inf "$T/ok.lua"
# an option whose value is missing says so, rather than naming an empty value
check_usage "--timeout" "fsdprun: --timeout needs a value: a positive number of seconds (try" --timeout
check_usage "--backend" "fsdprun: --backend needs a value: 'local', 'mpi', 'nccl' or 'auto' (try" --backend
check_usage "--progress" "fsdprun: --progress needs a value: 'auto', 'bar', 'line' or 'off' (try" --progress
check_usage "--backend=" "fsdprun: --backend '': expected 'local'" --backend= "$T/ok.lua"
# any finite timeout is taken, as FSDP_TIMEOUT takes it (a huge one: no limit in practice)
for t in 1e12 1e300; do
  run "$FSDPRUN" --timeout=$t -n 2 -e "local c = require 'fsdp.core'
if require('fsdp').rank() == 0 then print(c.timeout() == $t, tonumber(os.getenv('FSDP_TIMEOUT')) == $t) end
require('fsdp').barrier()"
  expect_rc 0 "--timeout=$t"
  expect_out "true	true" "--timeout=$t"
  run env FSDP_TIMEOUT=$t "$FSDPRUN" -e "print(require('fsdp.core').timeout() == $t)"
  expect_rc 0 "FSDP_TIMEOUT=$t"
  expect_out "true" "FSDP_TIMEOUT=$t"
done
# a malformed FSDP_TIMEOUT or FSDP_COMM_CHECK fails the communicator's creation, before the
# recipe runs: with -n 1 and also without -n, where the world of one is made on first use
for ranks in "-n 1" ""; do
  for var in FSDP_TIMEOUT=abc FSDP_COMM_CHECK=xx; do
    what="$var fsdprun ${ranks:-(no -n)}"
    # shellcheck disable=SC2086 # ranks is empty or two words
    run env $var "$FSDPRUN" $ranks "$T/ok.lua"
    expect_rc 1 "$what"
    expect_has err "fsdprun: cannot create the communicator of rank 0: ${var%%=*}: expected" "$what"
    expect_has err "got '${var#*=}'" "$what"
    expect_lacks out "ran" "$what"
  done
done
# --timeout replaces the variable, so a malformed one is not read
run env FSDP_TIMEOUT=abc "$FSDPRUN" --timeout=5 -e "print(require('fsdp.core').timeout())"
expect_rc 0 "FSDP_TIMEOUT=abc --timeout=5"
expect_out "5" "FSDP_TIMEOUT=abc --timeout=5"
run env FSDP_BLAS_THREADS=many "$FSDPRUN" -n 2 "$T/ok.lua"
expect_rc 2 "FSDP_BLAS_THREADS=many"
expect_has err "FSDP_BLAS_THREADS='many' must be a positive integer" "FSDP_BLAS_THREADS=many"
expect_lacks out "ran" "FSDP_BLAS_THREADS=many"
for bad in 0 x 2000; do
  run env FSDP_THREADS=$bad "$FSDPRUN" "$T/ok.lua"
  expect_rc 2 "FSDP_THREADS=$bad"
  expect_has err "fsdprun: FSDP_THREADS='$bad' must be a positive integer (at most 1024)" "FSDP_THREADS=$bad"
  expect_lacks out "ran" "FSDP_THREADS=$bad"
done

finish
