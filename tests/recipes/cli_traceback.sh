#!/bin/sh
# cli_traceback.sh — an error inside a module's forward prints the traceback of the error
# point: the user's frames inside forward (a helper, the forward itself), then the call of the
# model and the main chunk, at 1 rank, at 2 ranks (each rank's report) and in a wrapped model;
# a traceback left by an error the recipe caught is not printed for a later, other error.
# Run by ctest with FSDPRUN=<build>/bin/fsdprun.
set -u
: "${FSDPRUN:?set FSDPRUN to the fsdprun executable}"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
failures=0

fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
run() { "$@" >"$T/out" 2>"$T/err"; rc=$?; }
expect_rc() { [ "$rc" -eq "$1" ] || fail "$2: exit status $rc, expected $1; stderr: $(cat "$T/err")"; }
expect_has() { grep -qF -- "$2" "$T/$1" || fail "$3: std$1 lacks '$2'; it was: $(cat "$T/$1")"; }
expect_lacks() { ! grep -qF -- "$2" "$T/$1" || fail "$3: std$1 has '$2'; it was: $(cat "$T/$1")"; }
count_of() { grep -cF -- "$2" "$T/$1"; }

# A custom module whose forward calls a helper that makes a shape error (no tail calls: a tail
# call leaves no frame to show). WRAP=1 wraps it first.
cat >"$T/fwd.lua" <<'LUA'
local fsdp = require "fsdp"
local nn = fsdp.nn
local Net = nn.Module:extend("Net")
function Net:init() self.fc = nn.Linear(4, 3) end
local function helper(y)
  local z = y:matmul(fsdp.zeros{5, 2})
  return z
end
function Net:forward(x)
  local y = self.fc(x)
  local z = helper(y)
  return z
end
local model = Net()
if os.getenv("WRAP") == "1" then fsdp.wrap(model) end
local function step()
  local out = model(fsdp.zeros{2, 4})
  return out
end
step()
LUA

check_frames() { # $1: what
  expect_has err "Net: $T/fwd.lua:6: matmul: shapes (2, 3) and (5, 2) do not match" "$1: message"
  expect_has err "stack traceback:" "$1: traceback"
  expect_has err "$T/fwd.lua:6: in function 'helper'" "$1: the helper's frame"
  expect_has err "$T/fwd.lua:11: in function " "$1: forward's frame"
  expect_has err "$T/fwd.lua:17: in function 'step'" "$1: the frame that called the model"
  expect_has err "$T/fwd.lua:20: in main chunk" "$1: the main chunk"
}

run "$FSDPRUN" "$T/fwd.lua"
expect_rc 1 "1 rank"
check_frames "1 rank"

run "$FSDPRUN" -n 2 "$T/fwd.lua"
expect_rc 1 "2 ranks"
check_frames "2 ranks"
expect_has err "] Net: $T/fwd.lua:6: matmul" "2 ranks: a rank's report"

WRAP=1 run "$FSDPRUN" -n 2 "$T/fwd.lua"
expect_rc 1 "wrapped, 2 ranks"
check_frames "wrapped, 2 ranks"

# an error caught by the recipe leaves its traceback behind; a later error of another message
# gets its own
cat >"$T/caught.lua" <<'LUA'
local fsdp = require "fsdp"
local nn = fsdp.nn
local lin = nn.Linear(4, 3)
local ok = pcall(lin, fsdp.zeros{2, 5})
assert(not ok)
local function later() error("later error") end
later()
LUA
run "$FSDPRUN" "$T/caught.lua"
expect_rc 1 "caught, then another error"
expect_has err "$T/caught.lua:6: later error" "caught: the later message"
expect_has err "$T/caught.lua:7: in main chunk" "caught: the later error's own traceback"
expect_lacks err "linear" "caught: nothing of the caught error"
[ "$(count_of err "stack traceback:")" -eq 1 ] || fail "caught: one traceback: $(cat "$T/err")"

if [ "$failures" -gt 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "cli_traceback: all checks passed"
