#!/bin/sh
# recipes/gpt_fortunes.lua's checkpoint lines at 2 ranks: a short run interrupted after step 30
# (--stop_after) with a sharded checkpoint every 15 steps, then --resume, must end exactly as
# the same run without interruption: the same final train/val loss line and the same sample;
# --export writes a safetensors file that loads back.
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
A="--steps=45 --d=32 --layers=2 --ctx=32 --batch=8 --eval_every=15 --val_batches=2 --sample=40"
run() { # run OUT ARGS...
  out=$1; shift
  # shellcheck disable=SC2086 # A is a list of arguments
  "$FSDPRUN" -n 2 recipes/gpt_fortunes.lua $A "$@" >"$out" 2>&1 || {
    cat "$out"; echo "FAIL: gpt_fortunes $*"; exit 1; }
}
# (every run names its metrics file: the default lies in the checkpoint folder, in the source tree)
run "$tmp/whole.txt" --export="$tmp/final.safetensors" --metrics="$tmp/whole.jsonl"
run "$tmp/part1.txt" --ckpt_every=15 --ckpt_dir="$tmp/ck" --stop_after=30
grep -q "stopped after step 30" "$tmp/part1.txt" || { cat "$tmp/part1.txt"; echo "FAIL: no stop"; exit 1; }
[ -f "$tmp/ck/index.json" ] || { echo "FAIL: no checkpoint index"; exit 1; }
run "$tmp/part2.txt" --ckpt_every=15 --ckpt_dir="$tmp/ck" --resume
grep -q "resumed from .* at step 30" "$tmp/part2.txt" || { cat "$tmp/part2.txt"; echo "FAIL: no resume"; exit 1; }
final() { sed -n '/^train loss/,$p' "$1"; }
[ -n "$(final "$tmp/whole.txt")" ] || { cat "$tmp/whole.txt"; echo "FAIL: no final line"; exit 1; }
if [ "$(final "$tmp/whole.txt")" != "$(final "$tmp/part2.txt")" ]; then
  echo "--- uninterrupted:"; final "$tmp/whole.txt"; echo "--- resumed:"; final "$tmp/part2.txt"
  echo "FAIL: the resumed run ends differently"; exit 1
fi
echo "ok: interrupted at step 30 and resumed, the run ends exactly as without interruption:"
final "$tmp/whole.txt" | head -1
cat >"$tmp/check.lua" <<LUA
local fsdp = require "fsdp"
local m = fsdp.nn.GPT { vocab = 256, ctx = 32, d = 32, layers = 2, heads = 4, tie = true }
fsdp.load(m, "$tmp/final.safetensors")
print("ok: exported safetensors loads into a plain GPT")
LUA
"$FSDPRUN" "$tmp/check.lua"
