#!/bin/sh
# Activation checkpointing of wrapped models (tests/dist/act_ckpt.lua lists the checks): the
# same bits as without it for every strategy, with dropout, nested units, mixed precision, a
# pruning mask and ties; the same all-gather bytes; a lower activation peak; marks and errors;
# at 1, 2 and 4 ranks.
. "${0%/*}/lib.sh"
for n in 1 2 4; do
  on_ranks "$n" tests/dist/act_ckpt.lua
done
finish
