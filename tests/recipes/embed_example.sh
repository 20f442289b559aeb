#!/bin/sh
# embed_example.sh — examples/host_trainer.c, the embedding API's example host program: 2 local
# ranks train an MLP defined in a Lua string on batches pulled from the host's memory, the
# weights read back reproduce the engine's validation loss in C, the loss falls (the program
# checks all that and exits 0); its log callback receives fsdp.log's lines; and the same run is
# clean under valgrind's memcheck (invalid accesses, definite and indirect leaks fail it;
# LuaJIT's and OpenBLAS's still-reachable memory does not).
# Run by ctest with FSDPRUN=<build>/bin/fsdprun (the build folder is its dirname/..).
. "${0%/*}/lib.sh"
B=$(cd "$(dirname "$FSDPRUN")/.." && pwd)
EX="$B/examples/host_trainer"
[ -x "$EX" ] || die "$EX is not built (cmake --build: target examples)"

# ---- the example, as a user runs it (no LUA_PATH: libfsdp finds its Lua library) -------------
run env -u LUA_PATH -u LUA_CPATH "$EX"
expect_rc 0 "host_trainer"
expect_has out "host_trainer: ok" "host_trainer's own checks"
grep -Eq '^fsdp [0-9]+\.[0-9]+\.[0-9]+: 2 ranks$' "$T/out" || fail "version and world: $(head -1 "$T/out")"
expect_has out "[lua 0] step 1 | loss" "fsdp.log lines reach the log callback (rank 0)"
expect_has out "validation loss from the weights read back, computed here" "weights read back"
grep -q "^\[lua 1\]" "$T/out" && fail "fsdp.log wrote on rank 1: $(grep '^\[lua 1\]' "$T/out")"
before=$(sed -n 's/^validation loss before training: //p' "$T/out")
after=$(sed -n 's/^validation loss after [0-9]* steps: \([0-9.]*\).*/\1/p' "$T/out")
awk -v b="$before" -v a="$after" 'BEGIN { exit !(b > 0 && a > 0 && a < 0.2 * b) }' ||
  fail "the validation loss should fall below a fifth: $before -> $after"

# deterministic: a second run prints the same losses
cp "$T/out" "$T/first"
run env -u LUA_PATH -u LUA_CPATH "$EX"
cmp -s "$T/first" "$T/out" || fail "two runs differ: $(diff "$T/first" "$T/out" | head -5)"

# ---- under valgrind -----------------------------------------------------------------------------
if memcheck host_trainer "$EX" --steps=10 --quiet; then
  expect_has out "host_trainer: ok" "host_trainer under valgrind"
fi

finish
