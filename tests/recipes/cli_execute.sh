#!/bin/sh
# cli_execute.sh — os.execute in a rank (src/cli/fsdprun.c): LuaJIT's results for the same
# commands (a shell exists, exit codes 0 and 3, a missing command, a command killed by a
# signal), without -n and at -n 2; and SIGINT while a rank waits in os.execute still interrupts
# the run (system(3) would ignore SIGINT in the whole process while it waits): sent to fsdprun
# alone, the rank in the command is cut short after the grace period; sent to the process group
# (as a ^C at the terminal is), the command ends too and its rank raises `interrupted`. Exit 130
# either way, within a few seconds. Run by ctest with FSDPRUN set.
. "${0%/*}/lib.sh"

# ---- the results --------------------------------------------------------------------------------
# LuaJIT with Lua 5.2 compatibility (goto is a keyword there) returns true|nil, "exit"|"signal",
# code; without it (Debian's), system(3)'s wait status
cat >"$T/results.lua" <<'LUA'
local lua52 = loadstring("local goto = 1") == nil
local function show(...)
  local t = {...}
  for i = 1, select("#", ...) do t[i] = tostring(t[i]) end
  return table.concat(t, " ")
end
local got = {
  show(os.execute()), show(os.execute("exit 0")), show(os.execute("exit 3")),
  show(os.execute("no_such_command_fsdprun_test 2>/dev/null")), show(os.execute("kill -INT $$")),
  show(os.execute(nil)),
}
local want = lua52 and {"true", "true exit 0", "nil exit 3", "nil exit 127", "nil signal 2", "true"}
  or {"1", "0", "768", "32512", "2", "1"}
for i = 1, #want do
  if got[i] ~= want[i] then
    error(("result %d: os.execute gave '%s', expected '%s'"):format(i, got[i], want[i]), 0)
  end
end
local ok, err = pcall(os.execute, {})
assert(not ok and err:find("string expected"), "os.execute({}) did not raise: " .. tostring(err))
io.write(("ok %s\n"):format(lua52 and "5.2" or "5.1"))
LUA
run "$FSDPRUN" "$T/results.lua"
expect_rc 0 "os.execute's results without -n"
expect_has out "ok 5." "os.execute's results without -n"
run "$FSDPRUN" -n 2 "$T/results.lua"
expect_rc 0 "os.execute's results at -n 2"
[ "$(grep -c '^ok 5\.' "$T/out")" = 2 ] || fail "os.execute's results at -n 2: $(cat "$T/out")"

# ---- SIGINT while a rank waits in os.execute -----------------------------------------------------
# rank 1 runs a 30 s command (it writes its pid, so that the test can end it), rank 0 spins in
# interpreted Lua (at most 20 s: without the interrupt the run would end on its own, status 0)
cat >"$T/exec_spin.lua" <<LUA
local fsdp = require "fsdp"
if fsdp.rank() == 1 then
  os.execute("echo \$\$ > '$T/cmd.pid'; exec sleep 30")
else
  jit.off()
  local t0 = os.time()
  while os.time() - t0 < 20 do end
end
print("rank " .. fsdp.rank() .. " finished")
LUA

# wait_cmd: until the command has started (its pid file), at most 10 s
wait_cmd() {
  for _ in $(seq 100); do
    [ -s "$T/cmd.pid" ] && return 0
    sleep 0.1
  done
  return 1
}

# stop_cmd: end the command if it is still running
stop_cmd() {
  if [ -s "$T/cmd.pid" ]; then kill "$(cat "$T/cmd.pid")" 2>/dev/null; fi
  rm -f "$T/cmd.pid"
}
AT_EXIT='stop_cmd'

# stopped_in_time LABEL MS: the run started at $start ended with $rc = 130 within MS ms, said
# "interrupted" and never printed "finished" (no rank went on); the sleeps it left are stopped
stopped_in_time() {
  sit_took=$(($(now_ms) - start))
  expect_rc 130 "$1"
  expect_has err "interrupted" "$1"
  expect_lacks out "finished" "$1"
  [ "$sit_took" -le "$2" ] || fail "$1: took ${sit_took} ms"
  stop_cmd
}

# kill -INT to fsdprun's pid alone: the command does not get it
"$FSDPRUN" -n 2 "$T/exec_spin.lua" >"$T/out" 2>"$T/err" &
pid=$!
wait_cmd || fail "kill -INT: the command did not start"
start=$(now_ms)
kill -INT "$pid"
# give it 10 s (the grace period is 2), then end it
for _ in $(seq 100); do
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$pid" 2>/dev/null; then
  kill -KILL "$pid"
  fail "kill -INT while a rank is in os.execute: fsdprun still ran 10 s later"
fi
wait "$pid"
rc=$?
stopped_in_time "kill -INT while a rank is in os.execute" 6000

# SIGINT to the process group (coreutils timeout sends it to fsdprun and then to its group, as the
# terminal sends a ^C): the command ends too, and its rank raises `interrupted` at once (every
# rank raises it, and which rank's line the report shows first depends on the threads' order:
# "finished" never printed is what says the rank in os.execute went no further)
start=$(now_ms)
timeout -k 15 --preserve-status -s INT 2 "$FSDPRUN" -n 2 "$T/exec_spin.lua" >"$T/out" 2>"$T/err"
rc=$?
stopped_in_time "SIGINT to the group while a rank is in os.execute" 7000

finish
