#!/bin/sh
# fuzz_io.sh — a bounded libFuzzer run of the io layer's readers: the safetensors reader
# (tests/fuzz/fuzz_safetensors.c), the JSON reader behind checkpoint indexes
# (tests/fuzz/fuzz_json.c) and the sharded checkpoint index check (tests/fuzz/fuzz_index.c),
# each built with clang -fsanitize=fuzzer,address,undefined and run
# for FUZZ_SECONDS (default 10) over the seed corpus in tests/fuzz/corpus/. A crash, a leak, a
# sanitizer report or a broken reader promise (the targets trap) fails the test; the input
# that did it is kept and its path printed. Run by ctest; by
# hand for longer:
#   FSDPRUN=build/bin/fsdprun FUZZ_SECONDS=600 sh tests/recipes/fuzz_io.sh
# Skips (exit 77, "fuzz_io: SKIP (...)") only when clang or its fuzzer runtime
# (Debian: clang, libclang-rt-14-dev) is missing.
. "${0%/*}/lib.sh"
CLANG=${CLANG:-clang}
SECONDS_EACH=${FUZZ_SECONDS:-10}

need "$CLANG" "install-deps needs clang and libclang-rt-14-dev"
printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { return 0; }\n' \
  >"$T/probe.c"
if ! "$CLANG" -fsanitize=fuzzer,address "$T/probe.c" -o "$T/probe" >"$T/probe.log" 2>&1; then
  cat "$T/probe.log"
  skip "no clang fuzzer runtime (install-deps needs libclang-rt-14-dev)"
fi

CFLAGS="-std=c11 -D_GNU_SOURCE -g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
  -fno-sanitize-recover=undefined -I$SRC/src -I$SRC/include"
LIBS="-lcjson -lxxhash -lm -lpthread"
# the file formats only: st_tensor.c (tensors through files) needs the kernels
IO_FILES=$(ls "$SRC"/src/io/*.c | grep -v '/st_tensor\.c$')
for target in safetensors json index; do
  # shellcheck disable=SC2086 # word splitting of the flag lists is intended
  if ! "$CLANG" $CFLAGS "$SRC/tests/fuzz/fuzz_$target.c" $IO_FILES "$SRC"/src/core/*.c \
    $LIBS -o "$T/fuzz_$target" >"$T/build.log" 2>&1; then
    cat "$T/build.log"
    fail "building fuzz_$target"
    continue
  fi
  mkdir -p "$T/work_$target" "$T/crash_$target"
  dict=""
  [ -f "$SRC/tests/fuzz/$target.dict" ] && dict="-dict=$SRC/tests/fuzz/$target.dict"
  # new inputs go to the scratch corpus (first folder); the seeds are only read
  # shellcheck disable=SC2086
  ASAN_OPTIONS=detect_leaks=1 "$T/fuzz_$target" -max_total_time="$SECONDS_EACH" -timeout=10 \
    -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 -artifact_prefix="$T/crash_$target/" \
    $dict "$T/work_$target" "$SRC/tests/fuzz/corpus/$target" >"$T/run.log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then
    keep=$(mktemp -d "${TMPDIR:-/tmp}/fsdp_fuzz_$target.XXXXXX")
    cp "$T/crash_$target"/* "$keep"/ 2>/dev/null
    ls -l "$keep"
    tail -n 60 "$T/run.log"
    fail "fuzz_$target exited with status $rc; inputs kept in $keep (listed above)"
  else
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$T/run.log")
    echo "ok: fuzz_$target ran ${runs:-?} inputs in ${SECONDS_EACH}s without a failure"
  fi
done
finish
