#!/bin/sh
# cli_signal.sh — SIGINT stops a running recipe with the Lua error "interrupted" (with a
# traceback) and exit status 130, also when the loop is a compiled LuaJIT trace that never
# runs a hook (the grace timer ends it). Run by ctest with FSDPRUN set.
set -u
. "$(dirname "$0")/lib/check.sh"

# interrupt RECIPE: send SIGINT after 1 s (SIGKILL 15 s later if it is still running)
interrupt() {
  timeout -k 15 --preserve-status -s INT 1 "$FSDPRUN" "$1" >"$T/out" 2>"$T/err"
  rc=$?
}

# Interpreted code: the hook fires at once.
cat >"$T/calls.lua" <<'LUA'
print("started")
io.stdout:flush()
local function tick() return os.time() end
while true do tick() end
LUA
interrupt "$T/calls.lua"
[ "$rc" -eq 130 ] || fail "interpreted loop: exit status $rc, expected 130; stderr: $(cat "$T/err")"
expect_has out "started" "interpreted loop"
expect_has err "fsdprun: $T/calls.lua:" "interpreted loop: the error has file:line"
expect_has err "interrupted" "interpreted loop"
expect_has err "stack traceback:" "interpreted loop"

# A compiled trace never sees the hook: the grace timer must still end the run.
printf 'while true do end\n' >"$T/spin.lua"
start=$(date +%s)
interrupt "$T/spin.lua"
took=$(($(date +%s) - start))
[ "$rc" -eq 130 ] || fail "compiled loop: exit status $rc, expected 130; stderr: $(cat "$T/err")"
expect_has err "interrupted" "compiled loop"
[ "$took" -le 10 ] || fail "compiled loop: took ${took}s to stop"

# pcall in the recipe may see the interrupt, as in lua.c; the run still ends with 130.
cat >"$T/caught.lua" <<'LUA'
local ok, err = pcall(function() while true do local _ = os.time() end end)
print("caught", err)
io.stdout:flush()
error(err, 0)
LUA
interrupt "$T/caught.lua"
[ "$rc" -eq 130 ] || fail "caught interrupt: exit status $rc, expected 130"
expect_has out "interrupted" "caught interrupt"

finish cli_signal
