#!/bin/sh
# embed_api.sh — examples/embed_check.c, the test program of the embedding API (include/fsdp.h):
# options and creation failures, run_string / run_file (arguments, fsdp.args, syntax errors,
# missing files, os.exit), fsdp_call and fsdp_call_ranks (zero-copy inputs written in place,
# results and shape queries, results that do not fit, inputs kept by Lua detached from host
# memory), read_param / param_shape (unwrapped and wrapped, ties, wrong sizes and paths), a Lua
# error on one rank failing every rank at once and breaking the runtime, collective timeouts,
# the log and data-source callbacks (and calls from inside them), two runtimes on two threads,
# freeing with live tensors. Natively, then under valgrind's memcheck.
# Run by ctest with FSDPRUN=<build>/bin/fsdprun (the build folder is its dirname/..).
. "${0%/*}/lib.sh"
B=$(cd "$(dirname "$FSDPRUN")/.." && pwd)
EX="$B/examples/embed_check"
[ -x "$EX" ] || die "$EX is not built (cmake --build: target examples)"

run env -u LUA_PATH -u LUA_CPATH "$EX"
[ "$rc" -eq 0 ] || fail "embed_check: exit status $rc: $(cat "$T/out" "$T/err")"
grep -q "^embed_check: [0-9]* checks passed" "$T/out" || fail "embed_check did not pass: $(cat "$T/out")"

memcheck embed_check "$EX"

finish
