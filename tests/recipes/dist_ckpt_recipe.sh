#!/bin/sh
# recipes/gpt_fortunes.lua's checkpoint lines at 2 ranks: a short run interrupted after step 30
# (--stop_after) with a sharded checkpoint every 15 steps, then --resume, must end exactly as
# the same run without interruption: the same final train/val loss line and the same sample,
# and the metrics file of the two parts together holds every step; --export writes a
# safetensors file that loads back. A run shorter than --ckpt_every still leaves a checkpoint
# at its end, which --resume finds.
. "${0%/*}/lib.sh"
A="--steps=45 --d=32 --layers=2 --ctx=32 --batch=8 --eval_every=15 --val_batches=2 --sample=40"
gpt() { # gpt OUT ARGS...: the recipe at 2 ranks, its output in OUT
  out=$1
  shift
  # shellcheck disable=SC2086 # A is a list of arguments
  must "gpt_fortunes $*" "$FSDPRUN" -n 2 recipes/gpt_fortunes.lua $A "$@"
  cp "$T/log" "$out"
}
# (every run names its metrics file or its checkpoint folder: the default lies in the source tree)
gpt "$T/whole.txt" --export="$T/final.safetensors" --metrics="$T/whole.jsonl" --ckpt_every=0
gpt "$T/part1.txt" --ckpt_every=15 --ckpt_dir="$T/ck" --stop_after=30
grep -q "stopped after step 30" "$T/part1.txt" || { cat "$T/part1.txt"; die "no stop"; }
[ -f "$T/ck/index.json" ] || die "no checkpoint index"
gpt "$T/part2.txt" --ckpt_every=15 --ckpt_dir="$T/ck" --resume
grep -q "resumed from .* at step 30" "$T/part2.txt" || { cat "$T/part2.txt"; die "no resume"; }
final() { sed -n '/^train loss/,$p' "$1"; }
[ -n "$(final "$T/whole.txt")" ] || { cat "$T/whole.txt"; die "no final line"; }
if [ "$(final "$T/whole.txt")" != "$(final "$T/part2.txt")" ]; then
  echo "--- uninterrupted:"; final "$T/whole.txt"; echo "--- resumed:"; final "$T/part2.txt"
  die "the resumed run ends differently"
fi
echo "ok: interrupted at step 30 and resumed, the run ends exactly as without interruption:"
final "$T/whole.txt" | head -1
# the resumed run appended: steps 1..30 from the first part, 31..45 from the second
steps=$(sed -n 's/.*"step":\([0-9]*\).*/\1/p' "$T/ck/metrics.jsonl" | sort -n | uniq | wc -l)
[ "$steps" -eq 45 ] || fail "the metrics file of the two parts holds $steps distinct steps, expected 45"
cat >"$T/check.lua" <<LUA
local fsdp = require "fsdp"
local m = fsdp.nn.GPT { vocab = 256, ctx = 32, d = 32, layers = 2, heads = 4, tie = true }
fsdp.load(m, "$T/final.safetensors")
print("ok: exported safetensors loads into a plain GPT")
LUA
must "the export loads" "$FSDPRUN" "$T/check.lua"
cat "$T/log"

# fewer steps than --ckpt_every (500 by default): the checkpoint at the end is there to resume
gpt "$T/short.txt" --steps=20 --ckpt_dir="$T/short" --export=false
grep -qF "sharded checkpoint (resume with --resume): $T/short" "$T/short.txt" || fail "no checkpoint announced: $(cat "$T/short.txt")"
[ -f "$T/short/index.json" ] || fail "a 20-step run left no checkpoint in $T/short"
gpt "$T/short2.txt" --steps=20 --ckpt_dir="$T/short" --export=false --resume
grep -q "resumed from .* at step 20" "$T/short2.txt" || fail "--resume after a 20-step run: $(cat "$T/short2.txt")"
[ "$(final "$T/short.txt" | head -1)" = "$(final "$T/short2.txt" | head -1)" ] ||
  fail "a resumed finished run reports other losses: $(final "$T/short.txt" | head -1) vs $(final "$T/short2.txt" | head -1)"
finish
