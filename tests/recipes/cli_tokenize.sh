#!/bin/sh
# `fsdprun tokenize`: trains a tokenizer (--vocab-size) or uses one (--model), writes
# train.bin/val.bin with their sidecars and the model; the same model gives the same files;
# training twice gives the same model; --val-fraction moves the split; every usage error
# exits 2 and every input error exits 1, naming what is wrong.
. "${0%/*}/lib.sh"
F=/usr/share/games/fortunes
[ -f $F/debian ] || skip "$F/debian not found: install fortunes (scripts/install-deps)"
"$FSDPRUN" -e 'os.exit(require("fsdp.core").tok_available() and 0 or 1)' ||
  skip "fsdprun was built without SentencePiece (libsentencepiece-dev)"

# expect STATUS NEEDLE ARGS...: fsdprun tokenize ARGS exits STATUS and says NEEDLE
expect() {
  ex_status=$1 ex_needle=$2
  shift 2
  run "$FSDPRUN" tokenize "$@"
  if [ "$rc" != "$ex_status" ]; then
    cat "$T/out" "$T/err"
    fail "tokenize $*: exit $rc, expected $ex_status"
  elif ! grep -qF -- "$ex_needle" "$T/out" "$T/err"; then
    cat "$T/out" "$T/err"
    fail "tokenize $*: no '$ex_needle' in the output"
  fi
}

expect 0 "usage: fsdprun tokenize" --help
expect 0 "trained $T/a/tok.model (600 pieces, bpe)" --out "$T/a" --vocab-size 600 $F/debian $F/linux
grep -qF "wrote $T/a/train.bin" "$T/out" || fail "no summary line"
for f in train.bin val.bin train.json val.json tok.model; do
  [ -f "$T/a/$f" ] || fail "$f was not written"
done
# the sidecars: dtype, vocabulary, count matching the file's size, the model's name
must "sidecar check" "$FSDPRUN" -e "
  local core = require 'fsdp.core'
  for _, s in ipairs { 'train', 'val' } do
    local m = core.json_read('$T/a/' .. s .. '.json')
    assert(m.dtype == 'uint16' and m.vocab_size == 600 and m.tokenizer == 'tok.model', s)
    assert(m.count > 0 and core.io_size('$T/a/' .. s .. '.bin') == 2 * m.count, s .. ' size')
    assert(#m.files == 2, s .. ' files')
  end"
# the same model gives the same files; training again gives the same model
expect 0 "wrote $T/b/train.bin" --out "$T/b" --model "$T/a/tok.model" $F/debian $F/linux
cmp "$T/a/train.bin" "$T/b/train.bin" || fail "the same model wrote another train.bin"
cmp "$T/a/val.bin" "$T/b/val.bin" || fail "the same model wrote another val.bin"
expect 0 "trained" --out "$T/c" --vocab-size 600 $F/debian $F/linux
cmp "$T/a/tok.model" "$T/c/tok.model" || fail "training twice gave two models"
expect 0 "and $T/d/val.bin (0 tokens)" --out "$T/d" --model "$T/a/tok.model" --val-fraction=0 $F/debian
expect 0 "trained $T/u/tok.model (700 pieces, unigram)" --out "$T/u" --vocab-size=700 \
  --model-type unigram --threads 2 $F/debian

# usage errors: 2
expect 2 "--out DIR is required" --vocab-size 600 $F/debian
expect 2 "not both" --out "$T/x" --model "$T/a/tok.model" --vocab-size 600 $F/debian
expect 2 "not neither" --out "$T/x" $F/debian
expect 2 "no corpus given" --out "$T/x" --vocab-size 600
expect 2 "unknown option '--vocab'" --out "$T/x" --vocab 600 $F/debian
expect 2 "--val-fraction '1': expected a number in [0, 1)" --out "$T/x" --vocab-size 600 --val-fraction 1 $F/debian
expect 2 "--model-type 'wp': expected bpe or unigram" --out "$T/x" --vocab-size 600 --model-type wp $F/debian
expect 2 "--vocab-size 'lots': expected a positive integer" --out "$T/x" --vocab-size lots $F/debian
expect 2 "--model-type and --threads are for training" --out "$T/x" --model "$T/a/tok.model" --threads 2 $F/debian
expect 2 "--out needs a value" --vocab-size 600 $F/debian --out
# input errors: 1
expect 1 "cannot open $T/none.txt" --out "$T/x" --vocab-size 600 "$T/none.txt"
expect 1 "cannot open $T/none.model" --out "$T/x" --model "$T/none.model" $F/debian
expect 1 "is not a SentencePiece model" --out "$T/x" --model $F/debian $F/debian
expect 1 "Vocabulary size too high (100000)" --out "$T/x" --vocab-size 100000 $F/debian
# a vocabulary that the corpus's characters do not fit in: said in tokenize's flags (it has no
# --character_coverage, which SentencePiece's own message names)
expect 1 "--vocab-size 260 is too small for this corpus: it needs at least" --out "$T/x" --vocab-size 260 $F/debian
grep -qF -e "--character_coverage" -e "required_chars" "$T/err" &&
  fail "SentencePiece's flag named: $(cat "$T/err")"
grep -qE "give --vocab-size [0-9]+ or more$" "$T/err" || fail "no --vocab-size advice: $(cat "$T/err")"
printf '\n\n' > "$T/blank.txt"
expect 1 "the input has no text to train on (1 file, every line empty)" --out "$T/x" --vocab-size 300 "$T/blank.txt"
finish
