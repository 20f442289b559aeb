#!/bin/sh
# Sharded training equals one-rank unsharded training (the numbers held, docs/ARCHITECTURE.md):
# a small GPT (SGD with momentum) and an MLP (AdamW), each trained 50 steps on the same
# global batch, at 1 rank unwrapped (the reference) and at 2 and 4 ranks with every strategy.
# The loss curves must agree within 1e-5 relative at every step and the final parameters
# (gathered with fsdp.full_params) within 1e-5 relative as one vector; the 4-rank run must be
# bitwise identical run to run. tests/dist/train_equiv.lua trains, tests/dist/compare.lua
# compares; a perturbed run (learning rate x 1.001) must FAIL the comparison, so the check can
# fail.
. "${0%/*}/lib.sh"
for model in gpt mlp; do
  train_equiv 1 "$T/ref_$model" --model=$model --strategy=plain
  for strategy in full grad_op none; do
    for n in 2 4; do
      train_equiv "$n" "$T/out" --model=$model --strategy=$strategy
      compare "$T/ref_$model" "$T/out" "$model $strategy at $n ranks vs 1 rank unwrapped"
    done
  done
done
# prefetch off gives the same numbers
train_equiv 2 "$T/out" --model=gpt --strategy=full --prefetch=false
compare "$T/ref_gpt" "$T/out" "gpt full at 2 ranks without prefetch"
# bitwise reproducible at 4 ranks
train_equiv 4 "$T/a" --model=gpt --strategy=full
train_equiv 4 "$T/b" --model=gpt --strategy=full
compare "$T/a" "$T/b" "gpt full at 4 ranks, two runs" --exact
train_equiv 4 "$T/a" --model=mlp --strategy=grad_op
train_equiv 4 "$T/b" --model=mlp --strategy=grad_op
compare "$T/a" "$T/b" "mlp grad_op at 4 ranks, two runs" --exact
# the comparison can fail: a learning rate off by 0.1% is caught
train_equiv 2 "$T/out" --model=mlp --strategy=full --lr_scale=1.001
compare_fails "$T/ref_mlp" "$T/out" "a perturbed run (lr x 1.001)"
finish
