#!/bin/sh
# dist_local.sh — sharded training with every rank thread on the one GPU a machine has (the
# local backend moving cuda buffers: the device's copies and reduce_ranks, tests/dist/
# train_equiv.lua --device=cuda). The GPT at 2 and 4 ranks (full and grad_op sharding) equals
# the 1-rank unwrapped run on the GPU within 1e-5 over 50 steps; the 4-rank run repeats bit for
# bit in deterministic mode; and the 1-rank GPU run equals the cpu's within 1e-4. Skips (77)
# without a cuda device. Run from the source root with FSDPRUN set (ctest does both).
set -eu
: "${FSDPRUN:?set FSDPRUN to the fsdprun executable}"
n=$("$FSDPRUN" -e 'io.write(require("fsdp").device_count("cuda"))' 2>/dev/null || echo 0)
if [ "$n" = 0 ]; then
  echo "no CUDA device: fsdp.device_count(\"cuda\") is 0"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { # run N OUT ARGS...
  k=$1; out=$2; shift 2
  "$FSDPRUN" -n "$k" tests/dist/train_equiv.lua --out="$out" "$@" >"$tmp/log" 2>&1 || {
    cat "$tmp/log"; echo "FAIL: train_equiv -n $k $* exited nonzero"; exit 1; }
}
compare() { # compare REF OUT LABEL [ARGS]
  ref=$1; out=$2; label=$3; shift 3
  res=$("$FSDPRUN" tests/dist/compare.lua "$ref" "$out" "$@" 2>&1) || {
    echo "$res"; echo "FAIL: $label"; exit 1; }
  echo "ok: $label: $res"
}
run 1 "$tmp/ref" --model=gpt --strategy=plain --device=cuda
run 1 "$tmp/cpu" --model=gpt --strategy=plain
compare "$tmp/cpu" "$tmp/ref" "gpt on cuda vs the cpu, 1 rank" --tol=1e-4
for strategy in full grad_op; do
  for k in 2 4; do
    run "$k" "$tmp/out" --model=gpt --strategy=$strategy --device=cuda
    compare "$tmp/ref" "$tmp/out" "gpt $strategy at $k ranks on one GPU vs 1 rank"
  done
done
run 4 "$tmp/a" --model=gpt --strategy=full --device=cuda --deterministic
run 4 "$tmp/b" --model=gpt --strategy=full --device=cuda --deterministic
compare "$tmp/a" "$tmp/b" "gpt full at 4 ranks on one GPU, two runs" --exact
