#!/bin/sh
# Hugging Face GPT-2 folders and sampling on a wrapped model (tests/dist/hf_ranks.lua): import
# into shards, logits and tokens at 1, 2 and 4 ranks, and the export of the wrapped model at N
# ranks equals the 1-rank export byte for byte.
. "${0%/*}/lib.sh"
for n in 1 2 4; do
  on_ranks "$n" tests/dist/hf_ranks.lua --out="$T/export$n"
done
for n in 2 4; do
  for f in config.json model.safetensors; do
    cmp -s "$T/export1/$f" "$T/export$n/$f" || fail "export at $n ranks: $f differs from the 1-rank export"
  done
done
echo "ok: the exports at 2 and 4 ranks equal the 1-rank export"
finish
