#!/bin/sh
# cli_basic.sh — fsdprun's command line: --help/--version, usage errors (exit 2), -n
# validation, Lua errors with a traceback (exit 1), syntax errors and missing recipes, -e,
# `arg` and fsdp.args, exit statuses, and finding the Lua library without LUA_PATH (build tree
# and installed tree). Run by ctest with FSDPRUN=<build>/bin/fsdprun.
. "${0%/*}/lib.sh"

# ---- --help, --version ------------------------------------------------------------------
run "$FSDPRUN" --help
expect_rc 0 "--help"
expect_has out "usage: fsdprun" "--help"
expect_has out "-n N" "--help"
expect_has out "FSDP_THREADS=K" "--help names the thread variable"
run "$FSDPRUN" -h
expect_rc 0 "-h"
expect_has out "usage: fsdprun" "-h"

version=$(sed -n 's/^project(fsdprun VERSION \([0-9.]*\).*/\1/p' "$SRC/CMakeLists.txt")
run "$FSDPRUN" --version
expect_rc 0 "--version"
expect_has out "fsdprun $version" "--version"
[ -n "$version" ] || fail "could not read the version from $SRC/CMakeLists.txt"

# ---- usage errors: exit 2, one line, a hint to --help -----------------------------------------
for bad in "-x" "--bogus"; do
  run "$FSDPRUN" "$bad" r.lua
  expect_rc 2 "unknown option $bad"
  expect_has err "unknown option '$bad'" "unknown option $bad"
  expect_has err "fsdprun --help" "unknown option $bad"
  [ "$(lines_of err)" = 1 ] || fail "unknown option $bad: more than one line: $(cat "$T/err")"
done
run "$FSDPRUN"
expect_rc 2 "no arguments"
expect_has err "no recipe given" "no arguments"
expect_has err "--help" "no arguments"
run "$FSDPRUN" -e
expect_rc 2 "-e without code"
expect_has err "-e needs" "-e without code"
# plot and tokenize have no ranks: after fsdprun's options they are refused, naming the word
# (not taken for a recipe file of that name that cannot be opened)
for sub in plot tokenize; do
  run "$FSDPRUN" -n 2 "$sub" --help
  expect_rc 2 "-n 2 $sub"
  expect_has err "'$sub' runs without ranks" "-n 2 $sub"
  expect_has err "'fsdprun $sub ...'" "-n 2 $sub"
  [ "$(lines_of err)" = 1 ] || fail "-n 2 $sub: more than one line: $(cat "$T/err")"
done

# ---- -n ---------------------------------------------------------------------------------------
echo 'print("ran")' >"$T/ok.lua"
for bad in 0 -3 abc 2x 1.5 99999999999; do
  run "$FSDPRUN" -n "$bad" "$T/ok.lua"
  expect_rc 2 "-n $bad"
  expect_has err "-n '$bad'" "-n $bad names the bad value"
  expect_has err "positive integer" "-n $bad"
  expect_lacks out "ran" "-n $bad must not run the recipe"
done
run "$FSDPRUN" -n
expect_rc 2 "-n without a value"
expect_has err "-n needs" "-n without a value"
run "$FSDPRUN" -n 4 "$T/ok.lua"
expect_rc 0 "-n 4"
[ "$(cat "$T/out")" = "ran
ran
ran
ran" ] || fail "-n 4: stdout was '$(cat "$T/out")'"
run "$FSDPRUN" -n4 "$T/ok.lua"
expect_rc 0 "-n4"
run "$FSDPRUN" -n 1 "$T/ok.lua"
expect_rc 0 "-n 1"
expect_out "ran" "-n 1"

# ---- runtime errors: exit 1, message with file:line, traceback ---------------------------------
cat >"$T/rt.lua" <<'LUA'
local function inner()
  error("boom")
end
local function outer() inner() end
outer()
LUA
run "$FSDPRUN" "$T/rt.lua"
expect_rc 1 "runtime error"
expect_has err "fsdprun: $T/rt.lua:2: boom" "runtime error message"
expect_has err "stack traceback:" "runtime error traceback"
expect_has err "$T/rt.lua:4: in function 'outer'" "traceback names the caller"
expect_has err "$T/rt.lua:5: in main chunk" "traceback reaches the main chunk"

cat >"$T/eng.lua" <<'LUA'
local fsdp = require "fsdp"
local a = fsdp.zeros{2, 3}
local b = a:matmul(fsdp.zeros{4, 5})
LUA
run "$FSDPRUN" "$T/eng.lua"
expect_rc 1 "engine error"
expect_has err "$T/eng.lua:3:" "engine error carries file:line"
expect_has err "stack traceback:" "engine error traceback"

printf 'error(setmetatable({}, {__tostring = function() return "custom object" end}))\n' >"$T/obj.lua"
run "$FSDPRUN" "$T/obj.lua"
expect_rc 1 "error object with __tostring"
expect_has err "fsdprun: custom object" "error object with __tostring"
printf 'error({})\n' >"$T/tbl.lua"
run "$FSDPRUN" "$T/tbl.lua"
expect_rc 1 "table error object"
expect_has err "(error object is a table value)" "table error object"

printf 'local x = 1\nlocal y = = 2\n' >"$T/syn.lua"
run "$FSDPRUN" "$T/syn.lua"
expect_rc 1 "syntax error"
expect_has err "fsdprun: $T/syn.lua:2:" "syntax error shows file:line"

run "$FSDPRUN" "$T/none.lua"
expect_rc 1 "missing recipe"
[ "$(cat "$T/err")" = "fsdprun: cannot open $T/none.lua: No such file or directory" ] ||
  fail "missing recipe: stderr was '$(cat "$T/err")'"

printf 'print("partial")\nos.exit(3)\n' >"$T/exit3.lua"
run "$FSDPRUN" "$T/exit3.lua"
expect_rc 3 "os.exit(3)"
expect_out "partial" "os.exit(3) flushes output"

# ---- -e -----------------------------------------------------------------------------------
run "$FSDPRUN" -e 'x = 41' -e 'print(x + 1)'
expect_rc 0 "-e twice"
expect_out "42" "-e twice"
printf 'print(GREETING .. ", " .. arg[1])\n' >"$T/greet.lua"
run "$FSDPRUN" -e 'GREETING = "hello"' "$T/greet.lua" world
expect_rc 0 "-e before the recipe"
expect_out "hello, world" "-e before the recipe"
run "$FSDPRUN" -e 'error("from -e")' "$T/ok.lua"
expect_rc 1 "-e error"
expect_has err "fsdprun: (command line):1: from -e" "-e error"
expect_lacks out "ran" "-e error stops before the recipe"
run "$FSDPRUN" -e'print("glued")'
expect_out "glued" "-eCODE"

# ---- arguments: arg, ..., fsdp.args --------------------------------------------------------
cat >"$T/args.lua" <<'LUA'
local fsdp = require "fsdp"
print("arg0", arg[0])
print("n", #arg, select("#", ...))
for i = -3, #arg do print(i, arg[i]) end
print("dots", ...)
local a = fsdp.args
print("lr", a.lr, type(a.lr))
print("name", a.name, type(a.name))
print("flag", a.flag, type(a.flag))
print("pos", a[1])
LUA
run "$FSDPRUN" -n 1 -- "$T/args.lua" pos --lr=0.5 --name=gpt --flag
expect_rc 0 "arguments"
expect_has out "arg0	$T/args.lua" "arg[0] is the recipe"
expect_has out "n	4	4" "#arg and ... count the recipe arguments"
expect_has out "-3	-n" "interpreter options at negative indices"
expect_has out "-2	1" "interpreter options at negative indices"
expect_has out "-1	--" "interpreter options at negative indices"
expect_has out "1	pos" "arg[1]"
expect_has out "4	--flag" "arg[4]"
expect_has out "dots	pos	--lr=0.5	--name=gpt	--flag" "... holds the arguments"
expect_has out "lr	0.5	number" "fsdp.args converts numbers"
expect_has out "name	gpt	string" "fsdp.args keeps strings"
expect_has out "flag	true	boolean" "fsdp.args: --flag is true"
expect_has out "pos	pos" "fsdp.args keeps positional arguments"
# Without a recipe, as in Lua 5.3: arg[0] is the program and the options follow it.
run "$FSDPRUN" -e 'print(arg[1], arg[0])'
expect_out "-e	$FSDPRUN" "arg without a recipe"

# ---- finding the Lua library ------------------------------------------------------------------
# Build tree: no LUA_PATH / LUA_CPATH needed; fsdp.core is the linked engine, not a core.so.
mkdir -p "$T/cpath/fsdp"
echo "not a shared object" >"$T/cpath/fsdp/core.so"
run env -u LUA_PATH LUA_CPATH="$T/cpath/?.so" "$FSDPRUN" -e \
  'local fsdp = require "fsdp"; print(fsdp.zeros{2, 2}:sum():item(), package.path:sub(1, 200))'
expect_rc 0 "require fsdp without LUA_PATH"
expect_has out "0	$SRC/lua/?.lua;$SRC/lua/?/init.lua;" "package.path starts with the source lua/"
# A user's LUA_PATH still works, after the library.
mkdir -p "$T/user"
echo 'return "mine"' >"$T/user/mymod.lua"
run env LUA_PATH="$T/user/?.lua;;" "$FSDPRUN" -e 'print(require "mymod")'
expect_rc 0 "user LUA_PATH"
expect_out "mine" "user LUA_PATH"
# Installed tree: <prefix>/bin/fsdprun finds <prefix>/share/fsdprun/lua first.
mkdir -p "$T/prefix/bin" "$T/prefix/share/fsdprun/lua/fsdp"
cp "$FSDPRUN" "$T/prefix/bin/fsdprun"
echo 'return "installed copy"' >"$T/prefix/share/fsdprun/lua/probe.lua"
run env -u LUA_PATH "$T/prefix/bin/fsdprun" -e 'print(require "probe", package.path:match("^[^;]*"))'
expect_rc 0 "installed tree"
expect_has out "installed copy	$T/prefix/share/fsdprun/lua/?.lua" "installed tree comes first"

finish
