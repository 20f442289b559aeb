#!/bin/sh
# The memory proof of deferred initialisation: with FSDP_MEM_LIMIT (per rank) below
# the model's f32 parameters, building the GPT eagerly fails, while building it on meta,
# wrapping and materializing it at 4 ranks (from the init records, and with a user init_fn)
# and training a step all stay under the cap. tests/dist/meta_memcap.lua checks and prints
# the cap, the model size and every rank's peaks.
. "${0%/*}/lib.sh"
cap=8000000
must "meta_memcap at 4 ranks under FSDP_MEM_LIMIT=$cap" \
  env FSDP_MEM_LIMIT=$cap "$FSDPRUN" -n 4 tests/dist/meta_memcap.lua --cap=$cap
echo "ok: $(tail -1 "$T/log")"
finish
