# tests/recipes/lib/check.sh — sourced at the top of a test script (after `set -u`): checks
# FSDPRUN, makes the scratch folder $T (removed on exit), and gives the helpers below. Not a
# test itself: ctest runs tests/recipes/*.sh only.
: "${FSDPRUN:?set FSDPRUN to the fsdprun executable}"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
# run CMD...: stdout in $T/out, stderr in $T/err, the exit status in rc
run() { "$@" >"$T/out" 2>"$T/err"; rc=$?; }
expect_rc() { [ "$rc" -eq "$1" ] || fail "$2: exit status $rc, expected $1; stderr: $(cat "$T/err")"; }
# expect_has out|err TEXT WHAT (a fixed string); expect_lacks likewise
expect_has() { grep -qF -- "$2" "$T/$1" || fail "$3: std$1 lacks '$2'; it was: $(cat "$T/$1")"; }
expect_lacks() { ! grep -qF -- "$2" "$T/$1" || fail "$3: std$1 has '$2'; it was: $(cat "$T/$1")"; }
lines_of() { wc -l <"$T/$1" | tr -d ' '; }
# finish NAME: the verdict line and the exit status (0, or 1 after any failure)
finish() {
  if [ "$failures" -ne 0 ]; then
    echo "$1: $failures failure(s)"
    exit 1
  fi
  echo "$1: ok"
  exit 0
}
