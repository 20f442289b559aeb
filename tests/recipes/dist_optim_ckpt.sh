#!/bin/sh
# Optimizer state through sharded checkpoints at the edges of the layout
# (tests/dist/optim_ckpt.lua; each run checks itself against the plain model): Adafactor saved
# and resumed where some rank holds no slice of any factored parameter (2 -> 2, 1 -> 2, 1 -> 3,
# 2 -> 3): every rank must take part in completing the factors after the load.
. "${0%/*}/lib.sh"
t=tests/dist/optim_ckpt.lua
for pair in "2 2" "1 2" "1 3" "2 3"; do
  set -- $pair
  rm -rf "$T/ada"
  on_ranks "$1" "$t" --case=ada_save --dir="$T/ada"
  on_ranks "$2" "$t" --case=ada_load --dir="$T/ada"
done
finish
