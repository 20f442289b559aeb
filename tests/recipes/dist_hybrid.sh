#!/bin/sh
# Hybrid sharding (HSDP) on the local backend: a small GPT (SGD) and an MLP (AdamW) trained
# 50 steps with strategy = "hybrid" at 4 ranks as 2 groups of 2 (and as 1 x 4 and 4 x 1) equal
# the 1-rank unwrapped run (losses and final parameters within 1e-5 relative, tests/dist/
# compare.lua), bitwise the same run to run; a perturbed run fails the comparison (the check can
# fail). tests/dist/hybrid.lua then proves the bytes per group, the refusals and checkpoints
# across strategies. A shard_size that does not divide the world is refused, naming both.
. "${0%/*}/lib.sh"
for model in gpt mlp; do
  train_equiv 1 "$T/ref_$model" --model=$model --strategy=plain
  train_equiv 4 "$T/out" --model=$model --strategy=hybrid --shard_size=2
  compare "$T/ref_$model" "$T/out" "$model hybrid 2 x 2 at 4 ranks vs 1 rank unwrapped"
done
for S in 1 4; do
  train_equiv 4 "$T/out" --model=gpt --strategy=hybrid --shard_size=$S
  compare "$T/ref_gpt" "$T/out" "gpt hybrid shard_size $S at 4 ranks vs 1 rank unwrapped"
done
train_equiv 2 "$T/out" --model=mlp --strategy=hybrid --shard_size=1
compare "$T/ref_mlp" "$T/out" "mlp hybrid shard_size 1 at 2 ranks vs 1 rank unwrapped"
# bitwise reproducible
train_equiv 4 "$T/a" --model=gpt --strategy=hybrid --shard_size=2
train_equiv 4 "$T/b" --model=gpt --strategy=hybrid --shard_size=2
compare "$T/a" "$T/b" "gpt hybrid 2 x 2, two runs" --exact
# the comparison can fail
train_equiv 4 "$T/out" --model=mlp --strategy=hybrid --shard_size=2 --lr_scale=1.001
compare_fails "$T/ref_mlp" "$T/out" "a perturbed hybrid run (lr x 1.001)"
# bytes per group, refusals, checkpoints across strategies
mkdir -p "$T/ck"
on_ranks 4 tests/dist/hybrid.lua --dir="$T/ck"
# a world that shard_size does not divide: refused on every rank, with the numbers
run "$FSDPRUN" -n 3 -e 'local fsdp = require "fsdp"
fsdp.wrap(fsdp.nn.Linear(4, 4), {strategy = "hybrid", shard_size = 2})' 
expect_rc 1 "hybrid shard_size 2 at 3 ranks"
expect_has err "fsdp.wrap: shard_size 2 does not divide the world of 3 ranks" "the refusal"
expect_has err "(the same error as rank" "the refusal on every rank"
finish
