#!/bin/sh
# cli_repl.sh — fsdprun -i fed through a pipe: expressions print their values (tab-separated),
# statements run, an error is reported and the loop goes on, unfinished statements continue
# on the next line, `:quit` and end of input leave with status 0, and -i after a recipe sees
# the recipe's globals. Run by ctest with FSDPRUN=<build>/bin/fsdprun.
set -u
. "$(dirname "$0")/lib/check.sh"

# repl INPUT [fsdprun args...]: feed INPUT to fsdprun -i
repl() {
  input=$1
  shift
  printf '%s' "$input" | "$FSDPRUN" -i "$@" >"$T/out" 2>"$T/err"
  rc=$?
}

repl '1 + 1
x = 5
x * 2, "s" -- a comment
error("bad")
y = = 1
print("after the errors")
for i = 1, 2 do
  print("loop", i)
end
local t = {
  1,
  2}
=x

nil
local fsdp = require "fsdp"; print(fsdp.ones{3}:sum():item())
:quit
print("not reached")
'
expect_rc 0 "repl"
expected='2
10	s
after the errors
loop	1
loop	2
5
nil
3'
[ "$(cat "$T/out")" = "$expected" ] || fail "repl output was:
$(cat "$T/out")
expected:
$expected"
expect_has err "fsdprun: stdin:1: bad" "runtime error in the loop"
expect_has err "stack traceback:" "runtime error in the loop"
expect_has err "fsdprun: stdin:1: unexpected symbol near '='" "syntax error in the loop"
expect_lacks out "fsdp> " "no prompt when stdin is not a terminal"
expect_lacks out "not reached" ":quit"

# End of input ends the loop; an unfinished statement at the end is reported.
repl 'print("one")
if true then
'
expect_rc 0 "end of input"
expect_has out "one" "end of input"
expect_has err "'<eof>'" "unfinished statement at end of input"

# After a recipe, the loop sees its globals; -e runs first.
printf 'COUNT = 41\n' >"$T/r.lua"
repl 'COUNT + BONUS
' -e 'BONUS = 1' "$T/r.lua"
expect_rc 0 "-i after a recipe"
[ "$(cat "$T/out")" = "42" ] || fail "-i after a recipe printed '$(cat "$T/out")'"

# A failing recipe exits 1 without entering the loop.
printf 'error("recipe failed")\n' >"$T/bad.lua"
repl 'print("in the loop")
' "$T/bad.lua"
expect_rc 1 "-i with a failing recipe"
expect_lacks out "in the loop" "-i with a failing recipe"

# Values whose __tostring fails are reported, and the loop goes on.
repl 'setmetatable({}, {__tostring = function() error("no string") end})
print("still here")
'
expect_rc 0 "__tostring error"
expect_has err "no string" "__tostring error"
expect_has out "still here" "__tostring error"

finish cli_repl
