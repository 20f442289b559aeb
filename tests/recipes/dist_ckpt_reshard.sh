#!/bin/sh
# Resharding (tests/dist/ckpt_reshard.lua): a sharded checkpoint saved at 4 ranks loads at 2,
# then 1 (and into a plain model), and back from 1 to 2 and 4, and at 3, each time with
# parameters and AdamW state bitwise identical to the 4-rank original; per-rank random states
# are refused at another world size; a corrupted byte that ranks read by ranges is caught;
# bf16, i64 and bool tensors in extra, saved at 2 ranks, load at 1 in their dtypes; two stored
# copies of one tied parameter that differ are refused. A load of the wrong checkpoint must
# fail the comparison.
. "${0%/*}/lib.sh"
t=tests/dist/ckpt_reshard.lua
on_ranks 4 "$t" --phase=save --ckpt="$T/c4" --ref="$T/ref4.json"
on_ranks 2 "$t" --phase=load --ckpt="$T/c4" --ref="$T/ref4.json" --out="$T/c2"
on_ranks 1 "$t" --phase=load --ckpt="$T/c2" --ref="$T/ref4.json" --out="$T/c1"
on_ranks 1 "$t" --phase=load --ckpt="$T/c4" --ref="$T/ref4.json" --plain
on_ranks 2 "$t" --phase=load --ckpt="$T/c1" --ref="$T/ref4.json" --out="$T/c2b"
on_ranks 4 "$t" --phase=load --ckpt="$T/c2b" --ref="$T/ref4.json" --out="$T/c4b"
on_ranks 3 "$t" --phase=load --ckpt="$T/c4b" --ref="$T/ref4.json"
on_ranks 2 "$t" --phase=load --ckpt="$T/c1" --ref="$T/ref4.json" --plain
on_ranks 2 "$t" --phase=rngcheck --ckpt="$T/c4" --ref="$T/ref4.json"
on_ranks 3 "$t" --phase=damaged --ckpt="$T/c4" --ref="$T/ref4.json"
on_ranks 2 "$t" --phase=extra_save --ckpt="$T/x2" --ref="$T/refx.json"
on_ranks 1 "$t" --phase=extra_load --ckpt="$T/x2" --ref="$T/refx.json"
on_ranks 1 "$t" --phase=extra_load --ckpt="$T/x2" --ref="$T/refx.json" --plain
# two stored copies of one tied parameter: refused when they differ, at 1 and 3 ranks
on_ranks 1 "$t" --phase=tied --ckpt="$T/t1"
on_ranks 3 "$t" --phase=tied --ckpt="$T/t3"
on_ranks 2 "$t" --phase=save --ckpt="$T/other" --ref="$T/ref2.json"
must_fail "a different checkpoint" "$FSDPRUN" -n 2 "$t" --phase=load --ckpt="$T/other" --ref="$T/ref4.json"
echo "ok: a different checkpoint fails the comparison: $(grep -m1 'CHECK FAILED' "$T/log" | cut -c1-160)"
finish
