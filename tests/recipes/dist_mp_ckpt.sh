#!/bin/sh
# Checkpoints of a mixed-precision model (tests/dist/mp_ckpt.lua): a bf16-wrapped GPT saved at 2
# ranks stores its f32 masters (F32 in the index and the files); it loads bitwise at 1 rank,
# whose save loads at 4 (resharding 2 -> 1 -> 4), into f16- and f32-wrapped models; resumed at
# 2 ranks the run equals the uninterrupted one bit for bit (at 1 and 4: within 1e-2, other
# per-rank rounding of the bf16 gradients). Another training run's checkpoint must fail the
# comparison (the check can fail).
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
t=tests/dist/mp_ckpt.lua
run() { # run N ARGS...
  n=$1; shift
  out=$("$FSDPRUN" -n "$n" "$t" "$@" 2>&1) || { echo "$out"; echo "FAIL: -n $n $*"; exit 1; }
  echo "$out"
}
run 2 --phase=save --ckpt="$tmp/c2" --ref="$tmp/ref.json"
run 2 --phase=load --ckpt="$tmp/c2" --ref="$tmp/ref.json"
run 1 --phase=load --ckpt="$tmp/c2" --ref="$tmp/ref.json" --out="$tmp/c1"
run 4 --phase=load --ckpt="$tmp/c1" --ref="$tmp/ref.json"
run 2 --phase=load --ckpt="$tmp/c2" --ref="$tmp/ref.json" --mp=f16
run 4 --phase=load --ckpt="$tmp/c2" --ref="$tmp/ref.json" --mp=f32
# the comparison can fail: another run's checkpoint (saved at 1 rank: other per-rank batches)
run 1 --phase=save --ckpt="$tmp/other" --ref="$tmp/ref_other.json"
if "$FSDPRUN" -n 2 "$t" --phase=load --ckpt="$tmp/other" --ref="$tmp/ref.json" >"$tmp/log" 2>&1; then
  cat "$tmp/log"; echo "FAIL: a different checkpoint passed the comparison"; exit 1
fi
echo "ok: a different checkpoint fails the comparison: $(grep -m1 'CHECK FAILED' "$tmp/log" | cut -c1-160)"
