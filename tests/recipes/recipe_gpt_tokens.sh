#!/bin/sh
# Smoke test of recipes/gpt_tokens.lua at 2 ranks with a tiny model: it trains a tokenizer on
# the fortunes, writes the token files, trains the GPT in bf16 (the loss falls), samples,
# exports a Hugging Face folder that `fsdprun sample --tokenizer` reads; a run stopped after
# step 20 and resumed from its checkpoint ends exactly as the uninterrupted one (and reuses
# the tokenizer and token files); with --mp=none the recipe's sample is the CLI's on its
# export; a tokenizer or token files of another vocabulary are refused.
. "${0%/*}/lib.sh"
F=/usr/share/games/fortunes
[ -f $F/fortunes ] || skip "$F not found: install fortunes (scripts/install-deps)"
"$FSDPRUN" -e 'os.exit(require("fsdp.core").tok_available() and 0 or 1)' ||
  skip "fsdprun was built without SentencePiece (libsentencepiece-dev)"

# sample_of LOG: the text the recipe sampled (between "sample:" and its closing hint line)
sample_of() { awk '/^more samples: fsdprun sample /{ on = 0 } on { print } /^sample:$/{ on = 1 }' "$1"; }

SMALL="--vocab=512 --steps=40 --batch=8 --ctx=32 --d=32 --layers=1 --heads=2 --eval_every=20
  --val_batches=2 --ckpt_every=20 --sample=30"
# shellcheck disable=SC2086
must "gpt_tokens exited nonzero" "$FSDPRUN" -n 2 recipes/gpt_tokens.lua --out="$T/a" $SMALL
cp "$T/log" "$T/a.log"
grep -qF "tokenizer: trained $T/a/tok.model (512 pieces, bpe) on $F" "$T/log" || die_log "no tokenizer trained"
grep -q "token files: [0-9]* train / [0-9]* val tokens in $T/a (uint16), [0-9.]* bytes of text per token, written" \
  "$T/log" || die_log "no token files written"
grep -qF "2 ranks, mixed precision bf16" "$T/log" || die_log "not bf16 at 2 ranks"
for f in tok.model train.bin val.bin train.json val.json ckpt/index.json hf/config.json \
    hf/model.safetensors metrics.jsonl; do
  [ -s "$T/a/$f" ] || fail "$T/a/$f was not written"
done
grep -Eq '"vocab_size":[[:space:]]*512,' "$T/a/train.json" || fail "train.json: no vocab_size 512"
grep -Eq '"split":[[:space:]]*"val"' "$T/a/val.json" || fail "val.json: not split val"
grep -Eq '"vocab_size":[[:space:]]*512' "$T/a/hf/config.json" || fail "hf/config.json: no vocab_size 512"
# the loss: finite, and lower after 40 steps than at step 1 (ln 512 = 6.24)
line=$(grep '^train loss' "$T/log")
first=$(echo "$line" | sed -n 's/.*(step 1: \([0-9.]*\)).*/\1/p')
last=$(echo "$line" | sed -n 's/^train loss \([0-9.]*\) .*/\1/p')
val=$(echo "$line" | sed -n 's/.*val loss \([0-9.]*\) nats\/token.*/\1/p')
[ -n "$first" ] && [ -n "$last" ] && [ -n "$val" ] || die_log "no finite losses in '$line'"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.3) }' ||
  fail "train loss did not fall: step 1 $first, step 40 $last"
# the sample: the prompt and decoded text (no <id> of a byte reading)
sample=$(sample_of "$T/log")
case "$sample" in
  "Q: "?*) ;;
  *) fail "the sample is not the prompt and decoded text: '$sample'" ;;
esac
echo "ok: gpt_tokens, loss $first -> $last, val $val nats/token, sample '$sample'"

# `fsdprun sample` on the export, with the recipe's tokenizer
run "$FSDPRUN" sample "$T/a/hf" --tokenizer "$T/a/tok.model" --prompt "Q: What" --max-new-tokens 20
expect_rc 0 "fsdprun sample on the export"
expect_has out "Q: What" "fsdprun sample on the export"
[ "$(wc -c <"$T/out")" -gt 12 ] || fail "fsdprun sample printed no continuation: $(cat "$T/out")"
[ -s "$T/err" ] && fail "fsdprun sample --tokenizer wrote on stderr: $(cat "$T/err")"

# stopped after step 20 (the checkpoint there), then resumed: the same end as the whole run; the
# tokenizer and token files copied from the first run are used as they are
mkdir -p "$T/b"
cp "$T/a/tok.model" "$T/a/train.bin" "$T/a/train.json" "$T/a/val.bin" "$T/a/val.json" "$T/b/"
# shellcheck disable=SC2086
must "gpt_tokens --stop_after=20" "$FSDPRUN" -n 2 recipes/gpt_tokens.lua --out="$T/b" $SMALL --stop_after=20
grep -qF "tokenizer: $T/b/tok.model (512 pieces), already there" "$T/log" || die_log "the tokenizer was not reused"
grep -q "bytes of text per token, already there" "$T/log" || die_log "the token files were not reused"
grep -q "stopped after step 20" "$T/log" || die_log "did not stop after step 20"
[ -f "$T/b/hf/config.json" ] && fail "a run stopped early exported"
# shellcheck disable=SC2086
must "gpt_tokens --resume" "$FSDPRUN" -n 2 recipes/gpt_tokens.lua --out="$T/b" $SMALL --resume
grep -qF "resumed from $T/b/ckpt at step 20" "$T/log" || die_log "not resumed at step 20"
grep -q "trained 20 steps in" "$T/log" || die_log "the resumed run did not train the 20 steps left"
want=$(grep '^train loss' "$T/a.log")
got=$(grep '^train loss' "$T/log")
[ "$got" = "$want" ] || fail "resumed run ended with '$got', the whole run with '$want'"
[ -f "$T/b/hf/model.safetensors" ] || fail "the resumed run did not export"
echo "ok: stopped at 20 and resumed: $got"

# f32: the recipe's sample is `fsdprun sample`'s on the export (same seed and sampling)
mkdir -p "$T/c"
cp "$T/a/tok.model" "$T/a/train.bin" "$T/a/train.json" "$T/a/val.bin" "$T/a/val.json" "$T/c/"
# shellcheck disable=SC2086
must "gpt_tokens --mp=none" "$FSDPRUN" -n 2 recipes/gpt_tokens.lua --out="$T/c" $SMALL --steps=20 --mp=none
grep -qF "2 ranks, f32" "$T/log" || die_log "--mp=none is not f32"
sample_of "$T/log" >"$T/want_sample.txt"
run "$FSDPRUN" sample "$T/c/hf" --tokenizer="$T/c/tok.model" --prompt="Q: " --max-new-tokens=30 \
  --temperature=0.8 --top-k=50 --seed=0
expect_rc 0 "fsdprun sample on the f32 export"
cmp -s "$T/out" "$T/want_sample.txt" ||
  fail "fsdprun sample: '$(cat "$T/out")', the recipe sampled '$(cat "$T/want_sample.txt")'"

# refusals: a tokenizer of another size than --vocab; token files of another vocabulary
# shellcheck disable=SC2086
must_fail "--vocab=600 over a 512-piece tokenizer" "$FSDPRUN" -n 2 recipes/gpt_tokens.lua --out="$T/a" $SMALL --vocab=600
grep -qF "gpt_tokens: $T/a/tok.model has 512 pieces, not --vocab=600" "$T/log" || die_log "--vocab=600: wrong message"
sed 's/"vocab_size":\([[:space:]]*\)512/"vocab_size":\1600/' "$T/a/train.json" >"$T/c/train.json"
cmp -s "$T/a/train.json" "$T/c/train.json" && die "train.json: vocab_size not replaced"
# shellcheck disable=SC2086
must_fail "token files of another vocabulary" "$FSDPRUN" -n 2 recipes/gpt_tokens.lua --out="$T/c" $SMALL
grep -qF "gpt_tokens: $T/c/train.json holds ids of a 600-piece vocabulary, the tokenizer has 512" "$T/log" ||
  die_log "token files of another vocabulary: wrong message"
# token files without a validation split (tokenized with --val-fraction 0): refused before training
must "tokenize with --val-fraction 0" "$FSDPRUN" tokenize --out "$T/d" --model "$T/a/tok.model" --val-fraction 0 $F/computers
# shellcheck disable=SC2086
must_fail "an empty val.bin" "$FSDPRUN" -n 2 recipes/gpt_tokens.lua --out="$T/d" $SMALL
grep -qF "gpt_tokens: $T/d/val.bin has 0 tokens, fewer than --ctx + 1 = 33: validation needs one window" "$T/log" ||
  die_log "an empty val.bin: wrong message"
grep -q "^step 1/" "$T/log" && die_log "an empty val.bin: training started"
echo "ok: sample matches the CLI's in f32; other vocabularies and an empty val.bin refused"
finish
