#!/bin/sh
# Exact resume (tests/dist/ckpt_resume.lua) at 2 local ranks: 50 + 50 steps in one process vs
# the step-50 sharded checkpoint loaded in a new process and trained 50 more — the losses of
# steps 51..100 and the final parameters must be bitwise identical (cmp of %a dumps). The model
# uses dropout, so the random state matters: resuming without it (rng = false) must differ,
# which shows the comparison can fail.
. "${0%/*}/lib.sh"
i=0
while [ $i -lt 300 ]; do
  echo "Line $i: the quick brown fox jumps over the lazy dog $((i * 7919 % 1000))."
  i=$((i + 1))
done >"$T/text.txt"
t=tests/dist/ckpt_resume.lua
resume() { # resume MODE OUT ARGS...
  rs_mode=$1 rs_out=$2
  shift 2
  must_show "ckpt_resume --mode=$rs_mode $*" "$FSDPRUN" -n 2 "$t" --mode="$rs_mode" \
    --ckpt="$T/ck" --data="$T/text.txt" --out="$rs_out" "$@"
}
resume full "$T/full.txt"
resume resume "$T/resume.txt"
cmp "$T/full.txt" "$T/resume.txt" || die "the resumed run differs"
echo "ok: resumed run bitwise identical ($(wc -l <"$T/full.txt") lines of losses and parameters)"
resume resume "$T/norng.txt" --rng=false
if cmp -s "$T/full.txt" "$T/norng.txt"; then
  die "resuming without the random state gave the same bits (the test cannot fail)"
fi
echo "ok: resuming without the random state differs, as it must"
finish
