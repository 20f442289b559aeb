#!/bin/sh
# fsdp.load is all or nothing across ranks (tests/dist/ckpt_agree.lua) at 1, 2 and 3 ranks:
# options that decide what is loaded (optimizer, loaders, schedule, strict, rng, format) given
# on some ranks only or unlike are refused on every rank before anything is read, naming the
# option and the ranks; what the schedule and the random state take is checked before the
# parameters are written (a lambda failing at the saved step, a saved schedule missing a
# number, a schedule for a checkpoint without one, a random state set_rng_state refuses, a
# schedule of the user's own refusing on one rank). Each refusal raises the same error on
# every rank and leaves the model, the optimizer, the schedules, the loader and the random
# state as they were.
. "${0%/*}/lib.sh"
for n in 1 2 3; do
  rm -rf "$T/d" && mkdir -p "$T/d"
  on_ranks "$n" tests/dist/ckpt_agree.lua --dir="$T/d"
done
finish
