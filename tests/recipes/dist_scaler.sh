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
. "${0%/*}/lib.sh"
scaler() { # scaler N ARGS...
  sc_n=$1
  shift
  must "scaler -n $sc_n $*" "$FSDPRUN" -n "$sc_n" tests/dist/scaler.lua "$@"
}

scaler 1 --case=overflow --mode=plain --mp=f32 --inject=grad --out="$T/ref"
for mode in full none; do
  for bad in 0 1; do
    scaler 2 --case=overflow --mode=$mode --mp=f32 --inject=grad --bad_rank=$bad --out="$T/out"
    compare "$T/ref" "$T/out" "f32, inf in rank $bad's gradient only, $mode at 2 ranks vs 1 rank unwrapped"
  done
done
scaler 1 --case=overflow --mode=plain --mp=f32 --inject=none --out="$T/none"
compare_fails "$T/ref" "$T/none" "a run without the skipped step"

for inject in loss grad; do
  for bad in 0 1; do
    scaler 2 --case=overflow --mode=full --mp=f16 --inject=$inject --bad_rank=$bad
    echo "ok: f16, $inject overflow on rank $bad only: $(grep '^\[rank 0\]' "$T/log")"
  done
done

for n in 1 2; do
  scaler $n --case=train
  echo "ok: $(grep '^train:' "$T/log")"
done

must "gpt_fortunes --mp=f16" "$FSDPRUN" -n 2 recipes/gpt_fortunes.lua --mp=f16 --steps=40 --d=32 \
  --layers=1 --ctx=32 --eval_every=40 --val_batches=2 --sample=10 --metrics="$T/m.jsonl" \
  --ckpt_dir="$T/ckpt" --ckpt_every=0 --export=false
grep -q '^loss scaler: scale' "$T/log" || { cat "$T/log"; die "gpt_fortunes --mp=f16: no scaler line"; }
if grep -Eqi '(loss|val_loss) -?(nan|inf)' "$T/log"; then
  cat "$T/log"
  die "gpt_fortunes --mp=f16: a loss is not finite"
fi
echo "ok: gpt_fortunes --mp=f16: $(grep '^loss scaler' "$T/log")"
finish
