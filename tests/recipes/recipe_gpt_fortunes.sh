#!/bin/sh
# Smoke test of recipes/gpt_fortunes.lua in a short mode at 2 ranks (as make run starts it):
# a tiny GPT for 150 steps, fully sharded. The byte
# loss starts at ln(256) = 5.55; it must fall below 3.0, print a validation loss and a sample,
# and write JSONL metrics. Then --mp=bf16 (f16 runs in dist_scaler.sh): a short run that saves
# its checkpoint and export, with finite losses; and --mp with another dtype is refused.
. "${0%/*}/lib.sh"
must "gpt_fortunes exited nonzero" "$FSDPRUN" -n 2 recipes/gpt_fortunes.lua --steps=150 --d=64 \
  --layers=2 --ctx=64 --eval_every=75 --val_batches=4 --sample=40 --metrics="$T/m.jsonl" \
  --ckpt_dir="$T/ckpt" --ckpt_every=75
val=$(sed -n 's/.*val loss \([0-9.]*\) nats\/byte.*/\1/p' "$T/log")
[ -n "$val" ] || die_log "no final val loss line"
awk -v v="$val" 'BEGIN { exit !(v < 3.0) }' || die_log "val loss $val >= 3.0"
grep -q '^sample:' "$T/log" || die_log "no sample"
lines=$(grep -c '"step"' "$T/m.jsonl")
[ "$lines" -ge 2 ] || die "metrics file has $lines step lines"
grep -q '"val_loss"' "$T/m.jsonl" || die "no val_loss in metrics"
grep -q '"grad_norm"' "$T/m.jsonl" || die "no grad_norm (fsdp.clip_grad_norm's result) in metrics"
# the run leaves a sharded checkpoint, a safetensors export and a plot of its metrics
[ -f "$T/ckpt/index.json" ] || die_log "no sharded checkpoint index"
[ -f "$T/ckpt/model.safetensors" ] || die_log "no safetensors export"
[ -f "$T/m.svg" ] || die_log "no metrics plot"
grep -q "plot of loss and learning rate: $T/m.svg" "$T/log" || die_log "plot location not printed"
echo "ok: gpt_fortunes short run, val loss $val"

must "gpt_fortunes --mp=bf16 exited nonzero" "$FSDPRUN" -n 2 recipes/gpt_fortunes.lua --mp=bf16 \
  --steps=40 --d=32 --layers=1 --ctx=32 --eval_every=40 --val_batches=2 --sample=10 \
  --metrics="$T/mp.jsonl" --ckpt_dir="$T/mp" --ckpt_every=40
val=$(sed -n 's/.*val loss \([0-9.]*\) nats\/byte.*/\1/p' "$T/log")
[ -n "$val" ] || die_log "--mp=bf16: no finite final val loss"
grep -q 'mixed precision bf16' "$T/log" || die_log "--mp=bf16 not reported"
[ -f "$T/mp/index.json" ] && [ -f "$T/mp/model.safetensors" ] || die_log "--mp=bf16: no checkpoint or export"
must_fail "--mp=f8 was accepted" "$FSDPRUN" recipes/gpt_fortunes.lua --mp=f8
grep -q "recipes/gpt_fortunes.lua: --mp: 'f8' is not one of bf16, f16" "$T/log" || die_log "--mp=f8: wrong message"
echo "ok: gpt_fortunes --mp=bf16, val loss $val; --mp=f8 refused"
finish
