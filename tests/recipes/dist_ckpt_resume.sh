#!/bin/sh
# Exact resume (tests/dist/ckpt_resume.lua) at 2 local ranks: 50 + 50 steps in one process vs
# the step-50 sharded checkpoint loaded in a new process and trained 50 more — the losses of
# steps 51..100 and the final parameters must be bitwise identical (cmp of %a dumps). The model
# uses dropout, so the random state matters: resuming without it (rng = false) must differ,
# which shows the comparison can fail.
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
i=0
while [ $i -lt 300 ]; do
  echo "Line $i: the quick brown fox jumps over the lazy dog $((i * 7919 % 1000))."
  i=$((i + 1))
done >"$tmp/text.txt"
t=tests/dist/ckpt_resume.lua
run() { # run MODE OUT ARGS...
  mode=$1; out=$2; shift 2
  log=$("$FSDPRUN" -n 2 "$t" --mode="$mode" --ckpt="$tmp/ck" --data="$tmp/text.txt" --out="$out" "$@" 2>&1) || {
    echo "$log"; echo "FAIL: ckpt_resume --mode=$mode $*"; exit 1; }
  echo "$log"
}
run full "$tmp/full.txt"
run resume "$tmp/resume.txt"
cmp "$tmp/full.txt" "$tmp/resume.txt" || { echo "FAIL: the resumed run differs"; exit 1; }
echo "ok: resumed run bitwise identical ($(wc -l <"$tmp/full.txt") lines of losses and parameters)"
run resume "$tmp/norng.txt" --rng=false
if cmp -s "$tmp/full.txt" "$tmp/norng.txt"; then
  echo "FAIL: resuming without the random state gave the same bits (the test cannot fail)"; exit 1
fi
echo "ok: resuming without the random state differs, as it must"
