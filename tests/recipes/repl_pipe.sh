#!/bin/sh
# repl_pipe.sh — the SPMD REPL with standard input from a pipe (no terminal): grouped output,
# print capture, errors per rank, multi-line input, a collective that only some ranks enter
# (fails after the REPL timeout, the REPL goes on), :rank/:all/:timeout/:help and unknown
# commands, fsdp.debug() from a recipe (caller's locals, write-back, the recipe goes on), entry
# after a failed rank, fsdp.debug() called by one rank only. tests/recipes/repl_tty.sh does the
# terminal (libedit) side. Run by ctest with FSDPRUN=<build>/bin/fsdprun.
. "${0%/*}/lib.sh"

# repl INPUT [fsdprun args...]: feed INPUT to fsdprun (with a 30 s guard against hangs)
repl() {
  input=$1
  shift
  printf '%s' "$input" | timeout 30 "$FSDPRUN" "$@" >"$T/out" 2>"$T/err"
  rc=$?
}

# ---- grouped output, capture, errors, multi-line --------------------------------------------
repl 'fsdp = require "fsdp"
1 + 1
fsdp.rank()
fsdp.rank() * 1.5
print("hello")
if fsdp.rank() == 0 then print("only zero") end
fsdp.all_reduce(fsdp.rank() + 1)
for i = 1, 2 do
  print("loop", i)
end
if fsdp.rank() == 2 then error("two is sad") end
error("everyone")
nosuch.field
x = fsdp.rank() == 1 and error("one") or 7
fsdp.ones{2, 3}
"after the errors"
' -n 4 -i
expect_rc 0 "grouped"
expect_out '[0-3] 2
[0] 0  [1] 1  [2] 2  [3] 3
[0] 0  [1] 1.5  [2] 3  [3] 4.5
[0-3] hello
[0] only zero
[0-3] 10
[0-3] loop	1
      loop	2
[0-3] tensor((2, 3), f32, cpu)
      [[1, 1, 1],
       [1, 1, 1]]
[0-3] after the errors' "grouped"
expect_has err "fsdprun: [2] stdin:1: two is sad" "an error on one rank"
expect_lacks err "[0] stdin:1: two is sad" "an error on one rank only"
expect_has err "fsdprun: [0-3] stdin:1: everyone" "the same error on every rank, merged"
expect_has err "fsdprun: [0-3] stdin:1: attempt to index global 'nosuch' (a nil value)" "runtime error"
expect_has err "fsdprun: [1] stdin:1: one" "an error on rank 1"
expect_lacks err "stack traceback" "no traceback for errors in the input itself"
expect_lacks out "fsdp> " "no prompt without a terminal"

# A function the input calls keeps its frame in the traceback; the REPL's own frames do not.
repl 'function f() error("deep") end
f()
' -n 2 -i
expect_rc 0 "traceback"
expect_has err "fsdprun: [0-1] stdin:1: deep" "traceback"
expect_has err "in function 'f'" "traceback keeps the user's function"
expect_lacks err "in main chunk" "traceback drops the REPL's frames"

# ---- a collective only some ranks enter: fails after the REPL timeout, the REPL goes on ---------
start=$(date +%s)
repl 'fsdp = require "fsdp"
:timeout 0.5
for i = 1, 10 do fsdp.barrier() end
if fsdp.rank() == 0 then fsdp.barrier() end
"still here", fsdp.rank()
fsdp.barrier()
' -n 2 -i
end=$(date +%s)
expect_rc 0 "partial collective"
expect_has out "(a collective now waits 0.5 s for the other ranks)" ":timeout"
expect_has err "[0] stdin:1: timeout after 0.5 s in barrier" "partial collective: rank 0 times out"
expect_has err "rank 1 has not arrived" "partial collective names the missing rank"
expect_has err "... (8 older)" "the flight recorder is cut to its newest lines"
grep -A5 "flight recorder (rank 0" "$T/err" | grep -qF "#12 barrier '' failed" ||
  fail "the flight recorder shows the failed collective: $(cat "$T/err")"
expect_has err "communicator is now poisoned" "the REPL says the communicator is poisoned"
expect_has out "[0] still here	0  [1] still here	1" "the REPL goes on after the timeout"
expect_has err "[0-1] stdin:1: rank 0 failed: timeout" "later collectives fail at once"
[ $((end - start)) -le 10 ] || fail "partial collective took $((end - start)) s"

# ---- commands ------------------------------------------------------------------------------
repl 'fsdp = require "fsdp"
:rank 1
fsdp.rank()
fsdp.barrier()
:all
fsdp.rank()
fsdp.barrier()
"ok"
:rank 9
:rank
:timeout
:timeout -1
:nope
:help
' -n 2 -i
expect_rc 0 "commands"
expect_has out "(inputs run on rank 1 only" ":rank 1"
sed -n '2p' "$T/out" >"$T/line2"
[ "$(cat "$T/line2")" = "[1] 1" ] || fail ":rank 1 runs on rank 1 only: line 2 of stdout is '$(cat "$T/line2")'"
expect_has err "[1] stdin:1: barrier '': collectives are refused in ':rank 1' mode" \
  ":rank refuses collectives"
expect_has out "[0-1] ok" "the communicator is fine after a refused collective"
expect_lacks err "poisoned" "a refused collective poisons nothing"
expect_has out "(inputs run on every rank: 0-1)" ":all"
expect_has out "[0] 0  [1] 1" ":all runs on every rank again"
expect_has err "fsdprun: :rank needs a rank from 0 to 1 (got '9')" ":rank out of range"
expect_has err "fsdprun: :rank needs a rank from 0 to 1 (got '')" ":rank without a rank"
expect_has out "(a collective waits 10 s for the other ranks)" ":timeout shows the timeout"
expect_has err ":timeout needs a positive number of seconds (got '-1')" ":timeout -1"
expect_has err "fsdprun: unknown command ':nope' (:help lists them)" "unknown command"
expect_has out ":rank K" ":help"

# ---- fsdp.inspect on two ranks: each rank's slices ---------------------------------------------
cat >"$T/model.lua" <<'EOF'
fsdp = require "fsdp"
fsdp.manual_seed(1)
model = fsdp.nn.GPT{vocab = 32, ctx = 8, d = 16, layers = 2, heads = 2, tie = true}
fsdp.wrap(model, {policy = fsdp.policy.modules{fsdp.nn.Block}})
w = model.blocks[1].mlp.fc.weight
EOF
repl 'print(fsdp.inspect(model))
u = fsdp.inspect(model).units[1]; print(u.slice[1] == fsdp.rank() * u.shard_numel + 1, u.slice[2] == (fsdp.rank() + 1) * u.shard_numel)
fsdp.all_reduce(fsdp.inspect(w).local_numel) == w:numel()
p = fsdp.inspect(model.head.weight, {model = model}); print(p.slices[0][1], p.slices[1][2], p.ties[2])
:rank 1
fsdp.inspect(w).local_numel + fsdp.inspect(w).slices[0][2] == w:numel()
fsdp.memory().params > 0
' -n 2 -i "$T/model.lua"
expect_rc 0 "inspect on two ranks"
expect_has out "[0] GPT: wrapped (full), 3 units" "inspect: rank 0's report"
expect_has out "[1] GPT: wrapped (full), 3 units" "inspect: rank 1's report"
expect_has out "rank 1 of 2" "inspect: rank 1's report"
expect_has out "[0-1] true	true" "inspect: each rank's slice of a unit"
expect_has out "[0-1] true" "inspect: the ranks' slices of a parameter add up"
expect_has out "[0-1] 1	512	head.weight" "inspect: slices and ties of a tied parameter"
expect_has out "[1] true" "inspect in :rank mode (no collective)"
expect_lacks err "fsdprun:" "inspect on two ranks: no errors"

# :quit ends the REPL at once
repl '1
:quit
2
' -n 2 -i
expect_rc 0 ":quit"
expect_out "[0-1] 1" ":quit"

# ---- fsdp.debug() in a recipe ------------------------------------------------------------------
cat >"$T/debug.lua" <<'EOF'
local fsdp = require "fsdp"
local x = (fsdp.rank() + 1) * 10
local secret = "hidden"
hidden_global = "global"
local function get() return x end
fsdp.barrier()
fsdp.debug()
print("after", fsdp.rank(), x, get(), secret, hidden_global)
EOF
repl 'x
x = x + 1
secret
' -n 2 "$T/debug.lua"
expect_rc 0 "fsdp.debug"
expect_has out "[0] 10  [1] 20" "fsdp.debug sees the caller's locals"
expect_has out "[0-1] hidden" "fsdp.debug: every local"
expect_has out "after	0	11	11	hidden	global" "fsdp.debug writes back to the local (rank 0)"
expect_has out "after	1	21	21	hidden	global" "fsdp.debug writes back to the local (rank 1)"

# fsdp.debug() with nothing to read: the recipe goes on
repl '' -n 2 "$T/debug.lua"
expect_rc 0 "fsdp.debug at end of input"
expect_has out "after	0	10	10" "fsdp.debug at end of input"

# a collective that failed in the REPL: the recipe cannot go on
repl ':timeout 0.3
if fsdp.rank() == 1 then fsdp.barrier() end
' -n 2 "$T/debug.lua"
expect_rc 1 "fsdp.debug after a failed collective"
expect_has err "fsdp.debug: the ranks' communicator was poisoned in the REPL" \
  "fsdp.debug after a failed collective"
expect_lacks out "after" "the recipe does not go on after a poisoned REPL"

# fsdp.debug() on one rank only: an error on every rank, no hang
cat >"$T/one.lua" <<'EOF'
local fsdp = require "fsdp"
if fsdp.rank() == 0 then fsdp.debug() end
fsdp.barrier("end")
EOF
repl '1
' -n 2 --timeout=2 "$T/one.lua"
expect_rc 1 "fsdp.debug on one rank"
expect_has err "collective mismatch" "fsdp.debug on one rank is a collective mismatch"

# fsdp.debug() inside the REPL
repl 'fsdp.debug()
"fine"
' -n 2 -e 'fsdp = require "fsdp"' -i
expect_rc 0 "nested fsdp.debug"
expect_has err "fsdp.debug: the REPL is already running" "nested fsdp.debug"
expect_has out "[0-1] fine" "nested fsdp.debug leaves the REPL usable"

# ---- -i after a recipe that failed on one rank: no REPL, no hang -------------------------------------
printf 'local fsdp = require "fsdp"\nif fsdp.rank() == 1 then error("recipe broke") end\n' >"$T/bad.lua"
repl '"in the repl"
' -n 2 -i "$T/bad.lua"
expect_rc 1 "-i after a failed rank"
expect_has err "[rank 1] $T/bad.lua:2: recipe broke" "-i after a failed rank"
expect_lacks out "in the repl" "-i after a failed rank"

# one rank: plain output, as before (tests/recipes/cli_repl.sh has the rest)
repl '1 + 1
' -n 1 -i
expect_rc 0 "-n 1"
expect_out "2" "-n 1 prints plainly"

# ---- the timeout: any finite number, FSDP_REPL_TIMEOUT, the one in force ---------------------
# any finite number of seconds, as --timeout and FSDP_TIMEOUT take (1e300: no limit in practice)
repl ':timeout 1e300
:timeout
fsdp.core.timeout() == 1e300
:timeout 1e400
:timeout inf
' -n 2 -i
expect_rc 0 ":timeout 1e300"
expect_out "(a collective now waits 1e+300 s for the other ranks)
(a collective waits 1e+300 s for the other ranks)
[0-1] true" ":timeout 1e300"
expect_has err "fsdprun: :timeout needs a positive number of seconds (got '1e400')" ":timeout 1e400"
expect_has err "fsdprun: :timeout needs a positive number of seconds (got 'inf')" ":timeout inf"
printf ':timeout\n' | FSDP_REPL_TIMEOUT=1e300 timeout 30 "$FSDPRUN" -n 2 -i >"$T/out" 2>"$T/err"
rc=$?
expect_rc 0 "FSDP_REPL_TIMEOUT=1e300"
expect_out "(a collective waits 1e+300 s for the other ranks)" "FSDP_REPL_TIMEOUT=1e300"

# a malformed FSDP_REPL_TIMEOUT stops fsdprun before it runs anything, as FSDP_THREADS does
for bad in abc -1 0 1e400 inf; do
  printf '"ran"\n' | FSDP_REPL_TIMEOUT=$bad timeout 30 "$FSDPRUN" -n 2 -i >"$T/out" 2>"$T/err"
  rc=$?
  expect_rc 2 "FSDP_REPL_TIMEOUT=$bad"
  expect_out "" "FSDP_REPL_TIMEOUT=$bad ran the input"
  expect_has err "fsdprun: FSDP_REPL_TIMEOUT='$bad' must be a positive number of seconds" \
    "FSDP_REPL_TIMEOUT=$bad"
done

# :timeout shows the communicator's timeout, also after an input changed it
repl 'fsdp.core.set_timeout(1)
:timeout
' -n 2 -i
expect_rc 0 ":timeout after fsdp.core.set_timeout"
expect_out "(a collective waits 1 s for the other ranks)" ":timeout after fsdp.core.set_timeout"

finish
