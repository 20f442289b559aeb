#!/bin/sh
# Optimizer state through sharded checkpoints at the edges of the layout
# (tests/dist/optim_ckpt.lua; each run checks itself against the plain model): Adafactor saved
# and resumed where some rank holds no slice of any factored parameter (2 -> 2, 1 -> 2, 1 -> 3,
# 2 -> 3): every rank must take part in completing the factors after the load. AdamW and
# Adafactor state saved with every parameter trainable and restored (fsdp.load, and
# load_state_dict) into a model with a fully frozen unit, at 1, 2 and 3 ranks: the frozen unit's
# state is kept, as on a plain model, and training after unfreezing equals the plain model's.
# An optimizer import that must be refused (state for parameters the optimizer does not update)
# is refused on every rank before anything changes, wrapped and plain; so is a load with the
# optimizer passed on rank 0 only (before each Adafactor resume at 2 and 3 ranks).
. "${0%/*}/lib.sh"
t=tests/dist/optim_ckpt.lua
for pair in "2 2" "1 2" "1 3" "2 3"; do
  set -- $pair
  rm -rf "$T/ada"
  on_ranks "$1" "$t" --case=ada_save --dir="$T/ada"
  on_ranks "$2" "$t" --case=ada_load --dir="$T/ada" --one_rank=true
done
for n in 1 2 3; do
  for opt in adamw adafactor; do
    on_ranks "$n" "$t" --case=freeze --opt=$opt --dir="$T/freeze_${n}_$opt"
  done
  on_ranks "$n" "$t" --case=atomic --dir="$T/atomic_$n"
done
on_ranks 1 "$t" --case=atomic --plain=true --dir="$T/atomic_plain"
finish
