#!/bin/sh
# fsdp.data.tokens at 1, 2 and 4 local ranks (tests/dist/tokens_ranks.lua) on a dataset written
# by `fsdprun tokenize` from two fortunes files: each rank's rows are its slice of the one-rank
# global batch, the global batches are byte-identical at every world size, and a loader
# restored from a checkpoint resumes exactly. Another seed must give other batches (the
# comparison can fail).
. "${0%/*}/lib.sh"
F=/usr/share/games/fortunes
[ -f $F/debian ] || skip "$F/debian not found: install fortunes (scripts/install-deps)"
"$FSDPRUN" -e 'os.exit(require("fsdp.core").tok_available() and 0 or 1)' ||
  skip "fsdprun was built without SentencePiece (libsentencepiece-dev)"
must "fsdprun tokenize" "$FSDPRUN" tokenize --out "$T/data" --vocab-size 800 $F/debian $F/linux
for n in 1 2 4; do
  on_ranks $n tests/dist/tokens_ranks.lua --data="$T/data" --ckpt="$T/ck$n" --out="$T/rows$n.txt"
done
[ -s "$T/rows1.txt" ] || die "no rows written"
for n in 2 4; do
  cmp "$T/rows1.txt" "$T/rows$n.txt" || fail "the global batches at $n ranks differ from 1 rank"
done
echo "ok: global batches identical at 1, 2 and 4 ranks ($(wc -l <"$T/rows1.txt") rows)"
on_ranks 2 tests/dist/tokens_ranks.lua --data="$T/data" --ckpt="$T/ck9" --out="$T/other.txt" --seed=12
if cmp -s "$T/rows1.txt" "$T/other.txt"; then
  fail "another seed gave the same batches (the comparison cannot fail)"
fi
finish
