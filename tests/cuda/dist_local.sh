#!/bin/sh
# dist_local.sh — sharded training with every rank thread on the one GPU a machine has (the
# local backend moving cuda buffers: the device's copies and reduce_ranks, tests/dist/
# train_equiv.lua --device=cuda). The GPT at 2 and 4 ranks (full and grad_op sharding) equals
# the 1-rank unwrapped run on the GPU within 1e-5 over 50 steps; the 4-rank run repeats bit for
# bit in deterministic mode; and the 1-rank GPU run equals the cpu's within 1e-4. Skips (77)
# without a cuda device. Run from the source root with FSDPRUN set (ctest does both).
. "${0%/*}/../recipes/lib.sh"
set -e
need_cuda
train_equiv 1 "$T/ref" --model=gpt --strategy=plain --device=cuda
train_equiv 1 "$T/cpu" --model=gpt --strategy=plain
compare "$T/cpu" "$T/ref" "gpt on cuda vs the cpu, 1 rank" --tol=1e-4
for strategy in full grad_op; do
  for k in 2 4; do
    train_equiv "$k" "$T/out" --model=gpt --strategy=$strategy --device=cuda
    compare "$T/ref" "$T/out" "gpt $strategy at $k ranks on one GPU vs 1 rank"
  done
done
train_equiv 4 "$T/a" --model=gpt --strategy=full --device=cuda --deterministic
train_equiv 4 "$T/b" --model=gpt --strategy=full --device=cuda --deterministic
compare "$T/a" "$T/b" "gpt full at 4 ranks on one GPU, two runs" --exact
