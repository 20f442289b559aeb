#!/bin/sh
# Optimizers on shards equal the same optimizer on one unwrapped rank: SGD with Nesterov
# momentum, Adam, Lion, Adafactor, AdamW with parameter groups chosen by pattern, AdamW over
# some parameters (params =), Lion over one module of a wrapped model, and AdamW, Adam and SGD
# clipping their gradients (max_grad_norm; bitwise clip_grad_norm then the step, too), each
# trained 30 steps (tests/dist/optim_equiv.lua) at 1 rank unwrapped (the reference) and at 1, 2 and 4 ranks
# wrapped, compared by tests/dist/compare.lua (1e-5 relative). Adafactor's factored state is
# also checked with the strategies that replicate (none), keep parameters whole (grad_op) or
# shard in groups (hybrid: 2 x 2, 2 x 1; saved as 2 x 2 and resumed at 2 full), saved at 2 ranks and resumed at 1, 2 and 4 and unwrapped; bitwise reproducible at 4 ranks;
# a perturbed run must fail the comparison. An unwrapped model at 2 ranks is refused with the
# fix named, unless local_only = true (then each rank trains its own copy).
. "${0%/*}/lib.sh"
oe() {
  oe_n=$1 oe_out=$2
  shift 2
  must "optim_equiv -n $oe_n $*" "$FSDPRUN" -n "$oe_n" "$SRC/tests/dist/optim_equiv.lua" --out="$oe_out" "$@"
}
for opt in sgd_nesterov adam lion adafactor groups params module adamw_clip adam_clip sgd_clip; do
  oe 1 "$T/ref_$opt" --opt=$opt --strategy=plain
  for n in 1 2 4; do
    oe "$n" "$T/out" --opt=$opt --strategy=full
    compare "$T/ref_$opt" "$T/out" "$opt full at $n ranks vs 1 rank unwrapped"
  done
done
for strategy in none grad_op; do
  oe 2 "$T/out" --opt=adafactor --strategy=$strategy
  compare "$T/ref_adafactor" "$T/out" "adafactor $strategy at 2 ranks vs 1 rank unwrapped"
done
# hybrid: every group holds the same shards, so only one group's enter Adafactor's sums
oe 4 "$T/out" --opt=adafactor --strategy=hybrid --shard_size=2
compare "$T/ref_adafactor" "$T/out" "adafactor hybrid 2 x 2 at 4 ranks vs 1 rank unwrapped"
oe 2 "$T/out" --opt=adafactor --strategy=hybrid --shard_size=1
compare "$T/ref_adafactor" "$T/out" "adafactor hybrid 2 x 1 at 2 ranks vs 1 rank unwrapped"
# Adafactor's factors through a sharded checkpoint, at other world sizes (and from hybrid)
must "adafactor save at 4 ranks, hybrid 2 x 2" "$FSDPRUN" -n 4 "$SRC/tests/dist/optim_equiv.lua" \
  --opt=adafactor --strategy=hybrid --shard_size=2 --save_at=15 --dir="$T/ck_hybrid"
oe 2 "$T/out" --opt=adafactor --strategy=full --resume="$T/ck_hybrid"
compare "$T/ref_adafactor" "$T/out" "adafactor saved at 4 ranks hybrid, resumed at 2 full"
must "adafactor save at 2 ranks" "$FSDPRUN" -n 2 "$SRC/tests/dist/optim_equiv.lua" --opt=adafactor \
  --strategy=full --save_at=15 --dir="$T/ck"
for n in 1 2 4; do
  oe "$n" "$T/out" --opt=adafactor --strategy=full --resume="$T/ck"
  compare "$T/ref_adafactor" "$T/out" "adafactor saved at 2 ranks, resumed at $n"
done
oe 1 "$T/out" --opt=adafactor --strategy=plain --resume="$T/ck"
compare "$T/ref_adafactor" "$T/out" "adafactor saved at 2 ranks, resumed unwrapped"
# bitwise reproducible
oe 4 "$T/a" --opt=adafactor --strategy=full
oe 4 "$T/b" --opt=adafactor --strategy=full
compare "$T/a" "$T/b" "adafactor full at 4 ranks, two runs" --exact
# the comparison can fail
oe 2 "$T/out" --opt=adafactor --strategy=full --lr_scale=1.001
compare_fails "$T/ref_adafactor" "$T/out" "a perturbed adafactor run (lr x 1.001)"
oe 2 "$T/out" --opt=groups --strategy=full --lr_scale=1.001
compare_fails "$T/ref_groups" "$T/out" "a perturbed groups run (lr x 1.001)"
# max_grad_norm clips as clip_grad_norm before the step does, bit for bit (AdamW: the
# coefficient goes into its kernel, the gradients are not scaled in place)
for opt in adamw_clip adam_clip sgd_clip; do
  for n in 1 2; do
    oe "$n" "$T/a" --opt=$opt --strategy=full
    oe "$n" "$T/b" --opt=$opt --strategy=full --explicit
    compare "$T/a" "$T/b" "$opt at $n ranks: max_grad_norm vs clip_grad_norm then step" --exact
  done
done
# the norm over replicated units (none) and over groups that hold the same shards (hybrid 2 x 2)
oe 2 "$T/a" --opt=adamw_clip --strategy=none
oe 2 "$T/b" --opt=adamw_clip --strategy=none --explicit
compare "$T/a" "$T/b" "adamw_clip none at 2 ranks: max_grad_norm vs clip_grad_norm then step" --exact
compare "$T/ref_adamw_clip" "$T/a" "adamw_clip none at 2 ranks vs 1 rank unwrapped"
oe 4 "$T/a" --opt=adamw_clip --strategy=hybrid --shard_size=2
oe 4 "$T/b" --opt=adamw_clip --strategy=hybrid --shard_size=2 --explicit
compare "$T/a" "$T/b" "adamw_clip hybrid 2 x 2: max_grad_norm vs clip_grad_norm then step" --exact
compare "$T/ref_adamw_clip" "$T/a" "adamw_clip hybrid 2 x 2 at 4 ranks vs 1 rank unwrapped"
oe 1 "$T/a" --opt=adamw_clip --strategy=plain
oe 1 "$T/b" --opt=adamw_clip --strategy=plain --explicit
compare "$T/a" "$T/b" "adamw_clip unwrapped: max_grad_norm vs clip_grad_norm then step" --exact
oe 2 "$T/out" --opt=adamw_clip --strategy=full --lr_scale=1.001
compare_fails "$T/ref_adamw_clip" "$T/out" "a perturbed adamw_clip run (lr x 1.001)"
# one model per rank: refused, naming the fix; local_only = true says it is meant
must_fail "an unwrapped model at 2 ranks" "$FSDPRUN" -n 2 "$SRC/tests/dist/optim_equiv.lua" \
  --opt=adam --strategy=plain --out="$T/out"
for want in "Adam:step: the model is not wrapped, so each of the 2 ranks would train its own copy" \
  'fsdp.wrap(model)' 'fsdp.wrap(model, {strategy = "replicate"})' 'local_only = true'; do
  grep -qF "$want" "$T/log" || fail "the refusal lacks '$want': $(cat "$T/log")"
done
oe 1 "$T/ref_local" --opt=sgd_local --strategy=plain
oe 2 "$T/out" --opt=sgd_local --strategy=plain
compare "$T/ref_local" "$T/out" "local_only SGD at 2 ranks (each rank its own copy) vs 1 rank" --exact
finish
