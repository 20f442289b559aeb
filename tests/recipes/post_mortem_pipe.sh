#!/bin/sh
# post_mortem_pipe.sh — fsdprun --debug-on-error with standard input from a pipe (no terminal):
# the post-mortem REPL reads its inputs from stdin like the piped REPL, and end of input ends
# the run as :quit does (exit status 1, the failure reported as without the flag). Checks the
# failing rank's locals, every rank's `err`, fsdp.inspect, a collective in the session (the
# local group revived), a Lua error and an engine error, a peer stopped in an interpreted loop
# and one that joins after a C call longer than the stop wait, one rank
# (FSDPRUN_DEBUG_ON_ERROR, fsdp.debug_on_error), stdin at its end (no hang), no flag (stdin
# untouched), a peer that finished or cannot stop (no post-mortem, said so), a peer that
# finished and waits at the entry of the REPL of -i (it joins), --help,
# fsdp.debug_on_error in plain luajit, and -i inputs that fail (no post-mortem).
# tests/dist/post_mortem.lua is the recipe.
# Run by ctest with FSDPRUN=<build>/bin/fsdprun.
set -u
. "${0%/*}/lib.sh"
cd "${FSDP_SOURCE_DIR:-.}" || exit 1
R=tests/dist/post_mortem.lua
# pm INPUT ARGS...: feed INPUT to fsdprun ARGS (killed after 60 s: a hang is a failure)
pm() {
  input=$1
  shift
  printf '%s' "$input" | timeout -k 5 60 "$FSDPRUN" "$@" >"$T/out" 2>"$T/err"
  rc=$?
}

# ---- 2 ranks: rank 1 raises, rank 0 waits in a barrier ----------------------------------------
pm 'secret
loss:item() == loss:item()
fsdp.all_reduce(fsdp.rank() + 1)
fsdp.inspect(model)
err
error("in the session")
"still here", fsdp.rank()
:quit
print("not reached")
' --debug-on-error -n 2 "$R"
expect_rc 1 "lua error"
expect_has out "[0] nil  [1] 42" "the failing frame's local, on the failing rank only"
expect_has out "[0-1] true" "loss, a local of the recipe, on every rank"
expect_has out "[0-1] 3" "a collective in the session (the group was revived)"
expect_has out "[0] Linear: wrapped (full), 1 unit" "fsdp.inspect(model) on rank 0"
expect_has out "[1] Linear: wrapped (full), 1 unit" "fsdp.inspect(model) on rank 1"
expect_has out "[0] tests/dist/post_mortem.lua:41: rank 1 failed: tests/dist/post_mortem.lua:26: boom at step 2" "err on the peer"
expect_has out "[1] tests/dist/post_mortem.lua:26: boom at step 2" "err on the failing rank"
expect_has err "fsdprun: [0-1] stdin:1: in the session" "an error in the session is the session's"
expect_has out "[0] still here	0  [1] still here	1" "the session goes on after its own error"
expect_lacks out "not reached" ":quit ends the session"
expect_lacks out "finished" "the recipe does not go on"
# the failure is reported as without the flag: in full once, the peer in one line
[ "$(grep -c "boom at step 2" "$T/err")" -eq 2 ] ||
  fail "the failure should be reported once and the peer's once; stderr: $(cat "$T/err")"
expect_has err "fsdprun: [rank 1] tests/dist/post_mortem.lua:26: boom at step 2
stack traceback:" "the failing rank's report"
expect_has err "fsdprun: [rank 0] tests/dist/post_mortem.lua:41: rank 1 failed:" "the peer's report"
cp "$T/err" "$T/err.flag"

# without the flag: the same report, and stdin is not read
pm 'print("REPL ran")
' -n 2 "$R"
expect_rc 1 "no flag"
expect_lacks out "REPL ran" "no flag: no REPL"
# the reports are the same lines (the tracebacks' C addresses aside), the session's aside
sed 's/0x[0-9a-f]*/ADDR/' "$T/err" >"$T/a"
grep -vF "in the session" "$T/err.flag" | sed 's/0x[0-9a-f]*/ADDR/' >"$T/b"
cmp -s "$T/a" "$T/b" || fail "the report differs from the run without the flag:
$(cat "$T/b")
without:
$(cat "$T/a")"

# ---- an engine error (C), the peer stopped in an interpreted loop -------------------------------
pm 'secret
spins > 0
err
' --debug-on-error -n 2 "$R" --how=c --peer=spin
expect_rc 1 "engine error"
expect_has out "[0] nil  [1] 42" "engine error: the failing frame's local"
expect_has out "[0] true" "the peer's loop variable, where it stopped"
expect_has out "[0] tests/dist/post_mortem.lua" "the peer's err"
expect_has out "stopped: rank 1 failed: tests/dist/post_mortem.lua:25: add: shapes (2) and (42) do not broadcast" "the peer's err names the failure"
expect_has out "[1] tests/dist/post_mortem.lua:25: add: shapes (2) and (42)" "the failing rank's err"

# ---- a peer in a C call longer than the stop wait joins when the call returns ------------------
pm 'slow
fsdp.all_reduce(fsdp.rank() + 1)
' --debug-on-error -n 2 "$R" --peer=ccall
expect_rc 1 "a peer in a C call"
expect_has out "[0] true" "the peer's local, after its C call"
expect_has out "[0-1] 3" "a peer in a C call: a collective in the session"
expect_lacks err "abandoned" "a peer in a C call is not abandoned"

# ---- one rank: the environment variable, fsdp.debug_on_error; end of input is :quit ------------
pm 'secret
fsdp.all_reduce(5)
' "$R" --bad=0
expect_rc 1 "one rank, no flag"
[ ! -s "$T/out" ] || fail "one rank, no flag: stdout should be empty: $(cat "$T/out")"
printf 'secret\nfsdp.all_reduce(5)\n' | FSDPRUN_DEBUG_ON_ERROR=1 timeout -k 5 60 "$FSDPRUN" "$R" \
  --bad=0 >"$T/out" 2>"$T/err"
rc=$?
expect_rc 1 "FSDPRUN_DEBUG_ON_ERROR=1"
[ "$(cat "$T/out")" = "42
5" ] || fail "FSDPRUN_DEBUG_ON_ERROR=1: stdout was: $(cat "$T/out")"
expect_has err "fsdprun: tests/dist/post_mortem.lua:26: boom at step 2" "one rank: the report"
pm 'secret
' "$R" --bad=0 --enable
expect_rc 1 "fsdp.debug_on_error(true)"
expect_has out "42" "fsdp.debug_on_error(true) opens the post-mortem"
pm 'secret
' -e 'require("fsdp").debug_on_error(false)' --debug-on-error "$R" --bad=0
expect_rc 1 "fsdp.debug_on_error(false)"
[ ! -s "$T/out" ] || fail "fsdp.debug_on_error(false) after the flag: stdout was: $(cat "$T/out")"

# ---- stdin at its end: no hang, the run ends as without the flag --------------------------------
timeout -k 5 60 "$FSDPRUN" --debug-on-error -n 2 "$R" </dev/null >"$T/out" 2>"$T/err"
rc=$?
expect_rc 1 "stdin at its end"
expect_has err "fsdprun: [rank 1] tests/dist/post_mortem.lua:26: boom at step 2" "stdin at its end: the report"

# ---- no post-mortem: a peer that finished, a peer that cannot stop ------------------------------
pm '"unreachable"
' --debug-on-error -n 2 "$R" --peer=done
expect_rc 1 "a peer finished"
expect_has out "finished	0" "the peer finished"
expect_has err "[rank 1] no post-mortem: the post-mortem REPL needs every rank: rank 0 left the group" "a peer that finished"
expect_lacks out "unreachable" "no session without every rank"
printf '"unreachable"\n' | FSDP_REPL_TIMEOUT=1 timeout -k 5 60 "$FSDPRUN" --debug-on-error -n 2 \
  "$R" --peer=compiled >"$T/out" 2>"$T/err"
rc=$?
expect_rc 1 "a peer in a compiled loop"
expect_has err "[rank 0] did not stop" "the compiled loop is abandoned"
expect_has err "[rank 1] no post-mortem: the post-mortem REPL needs every rank: timeout after 1 s in barrier #1 'fsdp.post_mortem': rank 0 has not arrived" "a peer that cannot stop"
expect_lacks out "unreachable" "no session without every rank"

# ---- -i: a peer that finished its recipe waits at the REPL's entry and joins the post-mortem ---
pm 'fsdp.rank()
err ~= nil
fsdp.all_reduce(1)
:quit
' --debug-on-error -n 2 -i "$R" --peer=done
expect_rc 1 "-i, a peer at the REPL's entry"
expect_has out "finished	0" "-i: the peer finished its recipe"
expect_has out "[0] 0  [1] 1" "-i: every rank in the post-mortem"
expect_has out "[0-1] true" "-i: err on every rank"
expect_has out "[0-1] 2" "-i: a collective in the post-mortem"
expect_lacks err "no post-mortem" "-i: a peer at the REPL's entry"

# ---- the option in --help; fsdp.debug_on_error outside fsdprun (plain luajit) does nothing ----
run "$FSDPRUN" --help
expect_has out "--debug-on-error" "--help"
# (the sanitized build's core.so needs the ASan runtime preloaded into plain luajit, with the
# specs' ASAN_OPTIONS: CMakeLists.txt says why)
run env LD_PRELOAD="${FSDP_ASAN_PRELOAD:-}" ${FSDP_ASAN_PRELOAD:+ASAN_OPTIONS=intercept_tls_get_addr=0} luajit -e 'local fsdp = require "fsdp"; print(fsdp.debug_on_error(true), fsdp.debug_on_error())'
expect_rc 0 "fsdp.debug_on_error in luajit"
expect_has out "false	false" "fsdp.debug_on_error outside fsdprun"

# ---- -i: an input that fails is the REPL's, not a post-mortem ------------------------------------
pm 'error("typed")
1 + 1
' --debug-on-error -n 2 -i
expect_rc 0 "-i with the flag"
expect_has err "fsdprun: [0-1] stdin:1: typed" "-i: the input's error"
expect_has out "[0-1] 2" "-i goes on"

finish post_mortem_pipe
