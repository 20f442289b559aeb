#!/bin/sh
# Resharding (tests/dist/ckpt_reshard.lua): a sharded checkpoint saved at 4 ranks loads at 2,
# then 1 (and into a plain model), and back from 1 to 2 and 4, and at 3, each time with
# parameters and AdamW state bitwise identical to the 4-rank original; per-rank random states
# are refused at another world size; a corrupted byte that ranks read by ranges is caught;
# bf16, i64 and bool tensors in extra, saved at 2 ranks, load at 1 in their dtypes; two stored
# copies of one tied parameter that differ are refused. A load of the wrong checkpoint must
# fail the comparison.
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
t=tests/dist/ckpt_reshard.lua
run() { # run N ARGS...
  n=$1; shift
  out=$("$FSDPRUN" -n "$n" "$t" "$@" 2>&1) || { echo "$out"; echo "FAIL: -n $n $*"; exit 1; }
  echo "$out"
}
run 4 --phase=save --ckpt="$tmp/c4" --ref="$tmp/ref4.json"
run 2 --phase=load --ckpt="$tmp/c4" --ref="$tmp/ref4.json" --out="$tmp/c2"
run 1 --phase=load --ckpt="$tmp/c2" --ref="$tmp/ref4.json" --out="$tmp/c1"
run 1 --phase=load --ckpt="$tmp/c4" --ref="$tmp/ref4.json" --plain
run 2 --phase=load --ckpt="$tmp/c1" --ref="$tmp/ref4.json" --out="$tmp/c2b"
run 4 --phase=load --ckpt="$tmp/c2b" --ref="$tmp/ref4.json" --out="$tmp/c4b"
run 3 --phase=load --ckpt="$tmp/c4b" --ref="$tmp/ref4.json"
run 2 --phase=load --ckpt="$tmp/c1" --ref="$tmp/ref4.json" --plain
run 2 --phase=rngcheck --ckpt="$tmp/c4" --ref="$tmp/ref4.json"
run 3 --phase=damaged --ckpt="$tmp/c4" --ref="$tmp/ref4.json"
# tensors in extra keep their dtype: saved at 2 ranks, loaded at 1 (wrapped and plain)
run 2 --phase=extra_save --ckpt="$tmp/x2" --ref="$tmp/refx.json"
run 1 --phase=extra_load --ckpt="$tmp/x2" --ref="$tmp/refx.json"
run 1 --phase=extra_load --ckpt="$tmp/x2" --ref="$tmp/refx.json" --plain
# two stored copies of one tied parameter: refused when they differ, at 1 and 3 ranks
run 1 --phase=tied --ckpt="$tmp/t1"
run 3 --phase=tied --ckpt="$tmp/t3"
# the comparison can fail: another training run's checkpoint against this reference
run 2 --phase=save --ckpt="$tmp/other" --ref="$tmp/ref2.json"
if "$FSDPRUN" -n 2 "$t" --phase=load --ckpt="$tmp/other" --ref="$tmp/ref4.json" >"$tmp/log" 2>&1; then
  cat "$tmp/log"; echo "FAIL: a different checkpoint passed the comparison"; exit 1
fi
echo "ok: a different checkpoint fails the comparison: $(grep -m1 'CHECK FAILED' "$tmp/log" | cut -c1-160)"
