#!/bin/sh
# Smoke test of recipes/gpt_fortunes.lua in a short mode at 2 ranks (as make run starts it):
# a tiny GPT for 150 steps, fully sharded. The byte
# loss starts at ln(256) = 5.55; it must fall below 3.0, print a validation loss and a sample,
# and write JSONL metrics. Then --mp=bf16 (f16 runs in dist_scaler.sh): a short run that saves
# its checkpoint and export, with finite losses; and --mp with another dtype is refused.
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
out=$("$FSDPRUN" -n 2 recipes/gpt_fortunes.lua --steps=150 --d=64 --layers=2 --ctx=64 --eval_every=75 \
  --val_batches=4 --sample=40 --metrics="$tmp/m.jsonl" --ckpt_dir="$tmp/ckpt" --ckpt_every=75 2>&1) || {
  echo "$out"; echo "FAIL: gpt_fortunes exited nonzero"; exit 1; }
val=$(echo "$out" | sed -n 's/.*val loss \([0-9.]*\) nats\/byte.*/\1/p')
[ -n "$val" ] || { echo "$out"; echo "FAIL: no final val loss line"; exit 1; }
awk -v v="$val" 'BEGIN { exit !(v < 3.0) }' || { echo "$out"; echo "FAIL: val loss $val >= 3.0"; exit 1; }
echo "$out" | grep -q '^sample:' || { echo "$out"; echo "FAIL: no sample"; exit 1; }
lines=$(grep -c '"step"' "$tmp/m.jsonl")
[ "$lines" -ge 2 ] || { echo "FAIL: metrics file has $lines step lines"; exit 1; }
grep -q '"val_loss"' "$tmp/m.jsonl" || { echo "FAIL: no val_loss in metrics"; exit 1; }
# the run leaves a sharded checkpoint, a safetensors export and a plot of its metrics
[ -f "$tmp/ckpt/index.json" ] || { echo "$out"; echo "FAIL: no sharded checkpoint index"; exit 1; }
[ -f "$tmp/ckpt/model.safetensors" ] || { echo "$out"; echo "FAIL: no safetensors export"; exit 1; }
[ -f "$tmp/m.svg" ] || { echo "$out"; echo "FAIL: no metrics plot"; exit 1; }
echo "$out" | grep -q "plot of loss and learning rate: $tmp/m.svg" || { echo "$out"; echo "FAIL: plot location not printed"; exit 1; }
echo "ok: gpt_fortunes short run, val loss $val"

out=$("$FSDPRUN" -n 2 recipes/gpt_fortunes.lua --mp=bf16 --steps=40 --d=32 --layers=1 --ctx=32 \
  --eval_every=40 --val_batches=2 --sample=10 --metrics="$tmp/mp.jsonl" --ckpt_dir="$tmp/mp" \
  --ckpt_every=40 2>&1) || { echo "$out"; echo "FAIL: gpt_fortunes --mp=bf16 exited nonzero"; exit 1; }
val=$(echo "$out" | sed -n 's/.*val loss \([0-9.]*\) nats\/byte.*/\1/p')
[ -n "$val" ] || { echo "$out"; echo "FAIL: --mp=bf16: no finite final val loss"; exit 1; }
echo "$out" | grep -q 'mixed precision bf16' || { echo "$out"; echo "FAIL: --mp=bf16 not reported"; exit 1; }
[ -f "$tmp/mp/index.json" ] && [ -f "$tmp/mp/model.safetensors" ] || {
  echo "$out"; echo "FAIL: --mp=bf16: no checkpoint or export"; exit 1; }
if out=$("$FSDPRUN" recipes/gpt_fortunes.lua --mp=f8 2>&1); then
  echo "$out"; echo "FAIL: --mp=f8 was accepted"; exit 1
fi
echo "$out" | grep -q 'gpt_fortunes: --mp must be bf16 or f16 (got f8)' || {
  echo "$out"; echo "FAIL: --mp=f8: wrong message"; exit 1; }
echo "ok: gpt_fortunes --mp=bf16, val loss $val; --mp=f8 refused"
