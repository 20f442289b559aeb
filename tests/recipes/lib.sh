# lib.sh — what every test script of tests/recipes shares (sourced, not a test itself; the
# CMake glob leaves it out), and tests/cuda's scripts too. A script starts with
#
#   . "${0%/*}/lib.sh"                 (tests/cuda: . "${0%/*}/../recipes/lib.sh")
#
# and has: `set -u`; FSDPRUN checked (ctest sets it to the built launcher); $TEST, the script's
# name; $SRC, the source tree (FSDP_SOURCE_DIR, or the current folder, where ctest runs the
# scripts); $T, a temporary folder removed at exit (with $AT_EXIT run first: a script's own
# clean-up); $MPIRUN, mpirun with the options every test uses (through lib/mpirun_retry.sh, which
# runs it again when Open MPI's launch race fails a correct run; FSDP_MPIRUN, what
# `fsdprun -n N --backend mpi` starts, is that wrapper too); and the functions below.
# Checks that find a problem call `fail` and the script goes on; `finish` ends it with the
# verdict. `die` (and `must`) end it at once, where later checks would only repeat the cause.
# Exit status 77 is a skip, which ctest reports as such (SKIP_RETURN_CODE). sh has no local
# variables: a helper here names its own with a prefix (on_n, te_out), leaving the script's alone.

set -u
: "${FSDPRUN:?set FSDPRUN to the fsdprun executable}"
TEST=$(basename "$0" .sh)
SRC=${FSDP_SOURCE_DIR:-$(pwd)}
T=$(mktemp -d)
AT_EXIT=
trap 'eval "$AT_EXIT"; rm -rf "$T"' EXIT
failures=0
MPIRUN="sh $SRC/tests/recipes/lib/mpirun_retry.sh mpirun --oversubscribe --allow-run-as-root"
MPIRUN="$MPIRUN --mca btl_base_warn_component_unused 0"
FSDP_MPIRUN="$SRC/tests/recipes/lib/mpirun_retry.sh"
export FSDP_MPIRUN

# fail MESSAGE: count a failure and go on
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# die MESSAGE: a failure that ends the script now
die() {
  echo "FAIL: $*"
  exit 1
}

# die_log MESSAGE: show the output of the last must ($T/log), then die
die_log() {
  cat "$T/log"
  die "$*"
}

# skip WHY: this machine cannot run the test
skip() {
  echo "$TEST: SKIP ($*)"
  exit 77
}

# need COMMAND HOW: skip unless COMMAND is installed (HOW says how to install it)
need() { command -v "$1" >/dev/null 2>&1 || skip "$1 is not installed: $2"; }

# need_cuda: skip unless fsdprun sees a cuda device; $cuda_n is how many it sees
need_cuda() {
  cuda_n=$("$FSDPRUN" -e 'io.write(require("fsdp").device_count("cuda"))' 2>/dev/null || echo 0)
  [ "$cuda_n" != 0 ] || skip 'no CUDA device: fsdp.device_count("cuda") is 0'
}

# need_mpi: skip unless mpirun is installed and fsdprun was built with Open MPI
need_mpi() {
  need mpirun "apt-get install openmpi-bin"
  if ! $MPIRUN -np 1 "$FSDPRUN" -e 'assert(require("fsdp").backend() == "mpi")' \
    >/dev/null 2>"$T/need_mpi"; then
    if grep -qF "built without Open MPI" "$T/need_mpi"; then
      skip "fsdprun was built without Open MPI"
    fi
  fi
}

# run CMD...: run it; stdout in $T/out, stderr in $T/err, the exit status in $rc
run() {
  if "$@" >"$T/out" 2>"$T/err"; then rc=0; else rc=$?; fi
}

# must LABEL CMD...: run CMD with both streams in $T/log; if it fails, show them and die
must() {
  must_label=$1
  shift
  if ! "$@" >"$T/log" 2>&1; then
    cat "$T/log"
    die "$must_label"
  fi
}

# must_show LABEL CMD...: as must, and the output is shown when CMD passes too
must_show() {
  must "$@"
  cat "$T/log"
}

# on_ranks N SCRIPT ARGS...: `fsdprun -n N SCRIPT ARGS` must pass (must_show)
on_ranks() {
  on_n=$1 on_script=$2
  shift 2
  must_show "$on_script at $on_n ranks $*" "$FSDPRUN" -n "$on_n" "$on_script" "$@"
}

# train_equiv N OUT ARGS...: tests/dist/train_equiv.lua at N ranks writes its run to OUT (for
# compare); dies when it fails
train_equiv() {
  te_n=$1 te_out=$2
  shift 2
  must "train_equiv -n $te_n $*" \
    "$FSDPRUN" -n "$te_n" "$SRC/tests/dist/train_equiv.lua" --out="$te_out" "$@"
}

# compare REF OUT LABEL [ARGS...]: tests/dist/compare.lua finds the runs REF and OUT equal (within
# its tolerance, or ARGS: --tol=X, --exact); else show why and die
compare() {
  cmp_ref=$1 cmp_out=$2 cmp_label=$3
  shift 3
  must "$cmp_label" "$FSDPRUN" "$SRC/tests/dist/compare.lua" "$cmp_ref" "$cmp_out" "$@"
  echo "ok: $cmp_label: $(cat "$T/log")"
}

# compare_fails REF OUT LABEL [ARGS...]: the comparison must fail (a perturbed run: the check
# can fail)
compare_fails() {
  cmp_ref=$1 cmp_out=$2 cmp_label=$3
  shift 3
  must_fail "$cmp_label: the comparison" \
    "$FSDPRUN" "$SRC/tests/dist/compare.lua" "$cmp_ref" "$cmp_out" "$@"
  echo "ok: $cmp_label fails the comparison: $(cat "$T/log")"
}

# must_fail LABEL CMD...: CMD must fail (how a test shows that its check can fail); both
# streams in $T/log
must_fail() {
  must_label=$1
  shift
  if "$@" >"$T/log" 2>&1; then
    cat "$T/log"
    die "$must_label: it succeeded"
  fi
}

# expect_rc N WHAT: the last run exited with status N
expect_rc() {
  [ "$rc" -eq "$1" ] ||
    fail "$2: exit status $rc, expected $1; stdout: $(cat "$T/out" 2>/dev/null);" \
      "stderr: $(cat "$T/err" 2>/dev/null)"
}

# expect_out TEXT WHAT: the last run's stdout is TEXT exactly (trailing newlines aside)
expect_out() {
  [ "$(cat "$T/out")" = "$1" ] || fail "$2: stdout was:
$(cat "$T/out")
expected:
$1"
}

# lines_of out|err: how many lines that output of the last run has
lines_of() { wc -l <"$T/$1" | tr -d ' '; }

# expect_has out|err|log TEXT WHAT, expect_lacks ...: that output of the last run holds TEXT
# (a fixed string), or does not
expect_has() { grep -qF -- "$2" "$T/$1" || fail "$3: std$1 lacks '$2'; it was: $(cat "$T/$1")"; }
expect_lacks() { ! grep -qF -- "$2" "$T/$1" || fail "$3: std$1 has '$2'; it was: $(cat "$T/$1")"; }

# file_has FILE TEXT WHAT: FILE holds TEXT
file_has() { grep -qF -- "$2" "$1" 2>/dev/null || fail "$3: $1 lacks '$2'"; }

# memcheck LABEL CMD...: run CMD (no LUA_PATH or LUA_CPATH, one BLAS thread) under valgrind's
# memcheck, as run does; invalid accesses and definite or indirect leaks fail. Returns 1, with a
# note, where it cannot run: valgrind missing, or a sanitized build (ASan and valgrind do not mix)
memcheck() {
  mc_label=$1
  shift
  if ! command -v valgrind >/dev/null 2>&1; then
    echo "note: valgrind is not installed: the memcheck run is skipped"
    return 1
  fi
  if ldd "$(dirname "$FSDPRUN")/../libfsdp.so" 2>/dev/null | grep -q libasan; then
    echo "note: sanitized build (FSDP_SANITIZE): the memcheck run is skipped (ASan checks instead)"
    return 1
  fi
  run env -u LUA_PATH -u LUA_CPATH OPENBLAS_NUM_THREADS=1 valgrind -q --leak-check=full \
    --errors-for-leak-kinds=definite,indirect --error-exitcode=99 "$@"
  [ "$rc" -eq 99 ] &&
    fail "valgrind memcheck found errors or leaks in $mc_label: $(head -c 4000 "$T/err")"
  [ "$rc" -eq 0 ] ||
    fail "$mc_label under valgrind: exit status $rc: $(cat "$T/out"; head -c 2000 "$T/err")"
  return 0
}

# now_ms: milliseconds, for timing a run
now_ms() { date +%s%3N; }

# finish: the verdict; exit 1 after any failure
finish() {
  if [ "$failures" -ne 0 ]; then
    echo "$TEST: $failures failure(s)"
    exit 1
  fi
  echo "$TEST: ok"
  exit 0
}
