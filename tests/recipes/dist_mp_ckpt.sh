#!/bin/sh
# Checkpoints of a mixed-precision model (tests/dist/mp_ckpt.lua): a bf16-wrapped GPT saved at 2
# ranks stores its f32 masters (F32 in the index and the files); it loads bitwise at 1 rank,
# whose save loads at 4 (resharding 2 -> 1 -> 4), into f16- and f32-wrapped models; resumed at
# 2 ranks the run equals the uninterrupted one bit for bit (at 1 and 4: within 1e-2, other
# per-rank rounding of the bf16 gradients). Another training run's checkpoint must fail the
# comparison (the check can fail).
. "${0%/*}/lib.sh"
t=tests/dist/mp_ckpt.lua
on_ranks 2 "$t" --phase=save --ckpt="$T/c2" --ref="$T/ref.json"
on_ranks 2 "$t" --phase=load --ckpt="$T/c2" --ref="$T/ref.json"
on_ranks 1 "$t" --phase=load --ckpt="$T/c2" --ref="$T/ref.json" --out="$T/c1"
on_ranks 4 "$t" --phase=load --ckpt="$T/c1" --ref="$T/ref.json"
on_ranks 2 "$t" --phase=load --ckpt="$T/c2" --ref="$T/ref.json" --mp=f16
on_ranks 4 "$t" --phase=load --ckpt="$T/c2" --ref="$T/ref.json" --mp=f32
on_ranks 1 "$t" --phase=save --ckpt="$T/other" --ref="$T/ref_other.json"
must_fail "a different checkpoint" "$FSDPRUN" -n 2 "$t" --phase=load --ckpt="$T/other" --ref="$T/ref.json"
echo "ok: a different checkpoint fails the comparison: $(grep -m1 'CHECK FAILED' "$T/log" | cut -c1-160)"
finish
