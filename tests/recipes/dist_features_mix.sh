#!/bin/sh
# The training features together (tests/dist/features_mix.lua lists the runs): activation
# checkpointing, no_sync, frozen parameters and LoRA, Adafactor / Lion / parameter groups, under
# hybrid sharding and with each other, each against the plain model at 1 rank (1e-5) and bitwise
# where a single feature promises bits; reduce bytes per group under no_sync; a checkpoint of
# hybrid + no_sync + frozen resumed under full; "replicate" as "none". At 1, 2 (hybrid 2 x 1)
# and 4 ranks (2 x 2).
. "${0%/*}/lib.sh"
for n in 1 2 4; do
  mkdir -p "$T/ck$n"
  on_ranks "$n" tests/dist/features_mix.lua --dir="$T/ck$n"
done
finish
