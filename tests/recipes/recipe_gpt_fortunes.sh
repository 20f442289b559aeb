#!/bin/sh
# Smoke test of recipes/gpt_fortunes.lua in a short mode at 2 ranks (as make run starts it):
# a tiny GPT for 150 steps, fully sharded. The byte
# loss starts at ln(256) = 5.55; it must fall below 3.0, print a validation loss and a sample,
# and write JSONL metrics.
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
