#!/bin/sh
# Smoke test of bench/gpt_step.lua on a tiny GPT (L=1 d=32, batch 2 x ctx 16, 2 steps): its one
# JSON line per model has the documented shape and the values that follow from the model
# (tests/dist/bench_json.lua), at 1 rank, at 2 ranks, at 2 ranks with mp = bf16, and with
# --checkpoint at 1 and 2 ranks; bad arguments are refused with a message naming them. Timings
# are not judged.
set -eu
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
tiny="--layers=1 --d=32 --heads=2 --batch=2 --ctx=16 --steps=2 --sgemm_s=0.01"
check() { # ranks precision [extra arguments for gpt_step.lua]
  n=$1 prec=$2
  shift 2
  # shellcheck disable=SC2086 # $tiny holds separate arguments
  "$FSDPRUN" -n "$n" bench/gpt_step.lua $tiny "$@" > "$tmp" 2>&1 || {
    cat "$tmp"; echo "FAIL: gpt_step.lua at $n ranks, $prec"; exit 1; }
  grep -q "^L1-d32 " "$tmp" || { cat "$tmp"; echo "FAIL: no table row for L1-d32"; exit 1; }
  # shellcheck disable=SC2086
  "$FSDPRUN" tests/dist/bench_json.lua --file="$tmp" --ranks="$n" --precision="$prec" $tiny "$@" || {
    cat "$tmp"; echo "FAIL: gpt_step.lua's JSON at $n ranks, $prec"; exit 1; }
}
check 1 f32
check 2 f32
check 2 bf16 --mp=bf16
check 1 f32 --checkpoint
check 2 f32 --checkpoint

refused() { # expected message, then arguments for gpt_step.lua
  want=$1
  shift
  if "$FSDPRUN" "$@" > "$tmp" 2>&1; then
    cat "$tmp"; echo "FAIL: gpt_step.lua accepted $*"; exit 1
  fi
  grep -qF -- "$want" "$tmp" || { cat "$tmp"; echo "FAIL: $* did not say: $want"; exit 1; }
  echo "ok: refused $* ($want)"
}
refused "--steps: 0 is below the minimum 1" bench/gpt_step.lua --steps=0
refused "--layers: '1.5' is not an integer" bench/gpt_step.lua --layers=1.5
refused "--mp: 'f8' is not one of bf16, f16" bench/gpt_step.lua --mp=f8
refused "--sgemm_s must be a positive number of seconds" bench/gpt_step.lua --sgemm_s=0
refused "batch 2 does not split over 3 ranks" -n 3 bench/gpt_step.lua --batch=2
refused "--checkpoint: '3' is not true or false" bench/gpt_step.lua --checkpoint=3
echo "ok: bench/gpt_step.lua's JSON shape at 1 and 2 ranks, f32 and bf16, with --checkpoint"
