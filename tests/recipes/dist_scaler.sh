#!/bin/sh
# The dynamic loss scaler, fsdp.optim.GradScaler, across ranks (tests/dist/scaler.lua).
# Overflow on one rank only, at step 3 of 6: an inf written into that rank's own gradient (f32;
# f16) or its loss times 1e30 (f16). Every rank must skip that step (the other ranks' own
# gradients are finite: the decision is the collective's), keep its shards and optimizer state,
# and back the scale off to the same value. f32 runs at 2 ranks ("full" and "none") equal the
# plain model at 1 rank with the same overflow (tests/dist/compare.lua, 1e-5 relative), and a
# run without the overflow FAILS that comparison, so it can fail. Then an f16 GPT with a scaler
# that starts too high trains at 1 and 2 ranks (the loss falls, nothing is NaN, the scale
# backs off), and recipes/gpt_fortunes.lua runs with --mp=f16.
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
T=tests/dist/scaler.lua
run() { # run N ARGS...
  n=$1; shift
  "$FSDPRUN" -n "$n" "$T" "$@" >"$tmp/log" 2>&1 || {
    cat "$tmp/log"; echo "FAIL: scaler -n $n $*"; exit 1; }
}
compare() { # compare REF OUT LABEL
  res=$("$FSDPRUN" tests/dist/compare.lua "$1" "$2" 2>&1) || {
    echo "$res"; echo "FAIL: $3"; exit 1; }
  echo "ok: $3: $res"
}

run 1 --case=overflow --mode=plain --mp=f32 --inject=grad --out="$tmp/ref"
for mode in full none; do
  for bad in 0 1; do
    run 2 --case=overflow --mode=$mode --mp=f32 --inject=grad --bad_rank=$bad --out="$tmp/out"
    compare "$tmp/ref" "$tmp/out" "f32, inf in rank $bad's gradient only, $mode at 2 ranks vs 1 rank unwrapped"
  done
done
run 1 --case=overflow --mode=plain --mp=f32 --inject=none --out="$tmp/none"
if "$FSDPRUN" tests/dist/compare.lua "$tmp/ref" "$tmp/none" >"$tmp/log" 2>&1; then
  cat "$tmp/log"; echo "FAIL: a run without the skipped step passed the comparison"; exit 1
fi
echo "ok: without the overflow the comparison fails: $(cat "$tmp/log")"

for inject in loss grad; do
  for bad in 0 1; do
    run 2 --case=overflow --mode=full --mp=f16 --inject=$inject --bad_rank=$bad
    echo "ok: f16, $inject overflow on rank $bad only: $(grep '^\[rank 0\]' "$tmp/log")"
  done
done

for n in 1 2; do
  run $n --case=train
  echo "ok: $(grep '^train:' "$tmp/log")"
done

out=$("$FSDPRUN" -n 2 recipes/gpt_fortunes.lua --mp=f16 --steps=40 --d=32 --layers=1 --ctx=32 \
  --eval_every=40 --val_batches=2 --sample=10 --metrics="$tmp/m.jsonl" --ckpt_dir="$tmp/ckpt" \
  --ckpt_every=0 --export=false 2>&1) || { echo "$out"; echo "FAIL: gpt_fortunes --mp=f16"; exit 1; }
echo "$out" | grep -q '^loss scaler: scale' || { echo "$out"; echo "FAIL: gpt_fortunes --mp=f16: no scaler line"; exit 1; }
if echo "$out" | grep -Eqi '(loss|val_loss) -?(nan|inf)'; then
  echo "$out"; echo "FAIL: gpt_fortunes --mp=f16: a loss is not finite"; exit 1
fi
echo "ok: gpt_fortunes --mp=f16: $(echo "$out" | grep '^loss scaler')"
