#!/bin/sh
# `fsdprun sample CHECKPOINT --prompt=TEXT` (lua/fsdp/sample.lua): the model is rebuilt from the
# configuration stored with the checkpoint (fsdp.save's, or a Hugging Face folder); the text is
# the prompt and the model's own continuation (the same as GPT:generate in a recipe), the same
# at 1 and 2 ranks and with or without the cache; every refusal names its cause.
. "${0%/*}/lib.sh"
must "save a byte-level GPT" "$FSDPRUN" -e '
  local fsdp = require "fsdp"
  fsdp.manual_seed(1)
  local m = fsdp.nn.GPT{vocab = 256, ctx = 32, d = 32, layers = 2, heads = 2}
  fsdp.save(m, "'"$T"'/m.safetensors")
  fsdp.save(m, "'"$T"'/sharded")
  fsdp.save(fsdp.nn.Linear(2, 2), "'"$T"'/lin.safetensors")
  local ids = m:generate({72, 105, 32}, {max_new_tokens = 40, temperature = 0})
  local f = assert(io.open("'"$T"'/want.txt", "wb"))
  for _, id in ipairs(ids) do f:write(string.char(id)) end
  f:write("\n")
  f:close()'

run "$FSDPRUN" sample "$T/m.safetensors" --prompt="Hi " --max-new-tokens=40 --temperature=0
expect_rc 0 "greedy sample"
cmp -s "$T/out" "$T/want.txt" || fail "greedy sample differs from GPT:generate: $(od -c "$T/out" | head -3)"
for args in "-n 2 sample $T/m.safetensors" "sample $T/sharded" "-n 2 sample $T/sharded" \
    "sample $T/m.safetensors --no-cache"; do
  # shellcheck disable=SC2086
  run "$FSDPRUN" $args --prompt "Hi " --max-new-tokens 40 --temperature 0
  expect_rc 0 "$args"
  cmp -s "$T/out" "$T/want.txt" || fail "$args: the text differs from GPT:generate's"
done
run "$FSDPRUN" sample "$T/m.safetensors" --prompt="Hi " --max-new-tokens=30 --top-k=10 --top-p=0.9 --seed=3
expect_rc 0 "seeded sample"
cp "$T/out" "$T/seeded.txt"
run "$FSDPRUN" -n 2 sample "$T/m.safetensors" --prompt="Hi " --max-new-tokens=30 --top-k=10 --top-p=0.9 --seed=3
cmp -s "$T/out" "$T/seeded.txt" || fail "seeded sample at 2 ranks differs from 1 rank"
run "$FSDPRUN" sample "$T/m.safetensors" --prompt="Hi " --max-new-tokens=30 --top-k=10 --top-p=0.9 --seed=4
cmp -s "$T/out" "$T/seeded.txt" && fail "seeds 3 and 4 gave the same text"

# a Hugging Face folder (vocabulary 300 > 256: byte prompts work)
run "$FSDPRUN" sample tests/fixtures/hf_gpt2/model --prompt=ab --max-new-tokens=3
expect_rc 0 "sample from a Hugging Face folder"
expect_has out "ab" "sample from a Hugging Face folder"

run "$FSDPRUN" sample --help
expect_rc 0 "sample --help"
expect_has out "usage: fsdprun [-n N] sample CHECKPOINT" "sample --help"

# refusals
# a refused command line: status 2 and one line (rank 0's at -n 2), no traceback
run "$FSDPRUN" sample "$T/m.safetensors"
expect_rc 2 "no prompt"
expect_has err "fsdprun sample: no --prompt given (try 'fsdprun sample --help')" "no prompt"
[ "$(wc -l < "$T/err")" -eq 1 ] || fail "no prompt: not one line: $(cat "$T/err")"
run "$FSDPRUN" -n 2 sample "$T/m.safetensors" --prompt=x --max-new-tokens
expect_rc 2 "missing value at 2 ranks"
[ "$(cat "$T/err")" = "fsdprun sample: --max-new-tokens needs a value (try 'fsdprun sample --help')" ] ||
  fail "missing value at 2 ranks: not one line: $(cat "$T/err")"
run "$FSDPRUN" sample --prompt=x
expect_rc 2 "no checkpoint"
expect_has err "fsdprun sample: no checkpoint given" "no checkpoint"
run "$FSDPRUN" sample "$T/m.safetensors" --prompt=x --top-p=2
expect_rc 2 "top-p"
expect_has err "--top-p must be a number in [0, 1], not '2'" "top-p"
for t in inf nan -1; do
  run "$FSDPRUN" sample "$T/m.safetensors" --prompt=x --temperature=$t
  expect_rc 2 "temperature $t"
  expect_has err "--temperature must be a number >= 0, finite, not '$t'" "temperature $t"
done
run "$FSDPRUN" sample "$T/m.safetensors" --prompt=x --frobnicate
expect_rc 2 "unknown option"
expect_has err "fsdprun sample: unknown option '--frobnicate'" "unknown option"
run "$FSDPRUN" sample "$T/lin.safetensors" --prompt=x
expect_rc 1 "no stored configuration"
expect_has err "lin.safetensors has no fsdp.config in its metadata" "no stored configuration"
run "$FSDPRUN" sample "$T/none" --prompt=x
expect_rc 1 "no such checkpoint"
expect_has err "fsdprun sample: fsdp.load_model: $T/none is no checkpoint" "no such checkpoint"
expect_lacks err "traceback" "a failed sample: one line, no traceback"
run "$FSDPRUN" -n 2 sample "$T/none" --prompt=x
expect_rc 1 "no such checkpoint at 2 ranks"
[ "$(grep -c 'is no checkpoint' "$T/err")" = 1 ] || fail "no such checkpoint at 2 ranks: not one line: $(cat "$T/err")"
run "$FSDPRUN" sample "$T/m.safetensors" --prompt=x --tokenizer="$T/none.model"
expect_rc 1 "tokenizer"
grep -qF -e "fsdp.tokenizer" -e "none.model" "$T/err" || fail "tokenizer: $(cat "$T/err")"

# --tokenizer: a SentencePiece model on a generated corpus and GPTs of its vocabulary (300), of
# a padded one (310: ids past the tokenizer print as <id>) and of a smaller one (refused). The
# text is the tokenizer's decoding of GPT:generate's ids, at 1 and 2 ranks, from a safetensors
# file and from a Hugging Face export.
"$FSDPRUN" -e 'os.exit(require("fsdp.core").tok_available() and 0 or 1)' ||
  { echo "$TEST: no SentencePiece in this build: --tokenizer not checked"; finish; }
must "tokenizer and models" "$FSDPRUN" -e '
  local fsdp = require "fsdp"
  local f = assert(io.open("'"$T"'/corpus.txt", "wb"))
  local words = {"alpha", "beta", "gamma", "delta", "sampling", "tokens", "the", "of", "énorme"}
  for i = 1, 400 do
    f:write(words[i % 9 + 1], " ", words[(i * 7) % 9 + 1], " ", words[(i * 5) % 9 + 1], ".\n")
  end
  f:close()
  local tok = fsdp.tokenizer.train{input = "'"$T"'/corpus.txt", vocab_size = 300,
    model = "'"$T"'/tok.model"}
  for _, v in ipairs{300, 310, 290} do
    fsdp.manual_seed(2)
    local m = fsdp.nn.GPT{vocab = v, ctx = 32, d = 32, layers = 1, heads = 2}
    fsdp.save(m, ("'"$T"'/v%d.safetensors"):format(v))
    if v == 300 then
      fsdp.export_hf(m, "'"$T"'/hf")
      local ids = m:generate(tok:encode("the beta "), {max_new_tokens = 12, temperature = 0})
      local w = assert(io.open("'"$T"'/want_tok.txt", "wb"))
      w:write(tok:decode(ids), "\n")
      w:close()
    end
  end'
for args in "sample $T/v300.safetensors" "-n 2 sample $T/v300.safetensors" "sample $T/hf" \
    "-n 2 sample $T/hf"; do
  # shellcheck disable=SC2086
  run "$FSDPRUN" $args --tokenizer="$T/tok.model" --prompt "the beta " --max-new-tokens 12 \
    --temperature 0
  expect_rc 0 "$args --tokenizer"
  cmp -s "$T/out" "$T/want_tok.txt" ||
    fail "$args --tokenizer: '$(cat "$T/out")', GPT:generate decoded: '$(cat "$T/want_tok.txt")'"
done
run "$FSDPRUN" sample "$T/v310.safetensors" --tokenizer "$T/tok.model" --prompt "the " \
  --max-new-tokens 200 --temperature 5 --seed 1
expect_rc 0 "a padded vocabulary"
grep -q '<30[0-9]>' "$T/out" || fail "a padded vocabulary: no id past the tokenizer's as <id>: $(cat "$T/out")"
run "$FSDPRUN" sample "$T/v290.safetensors" --tokenizer "$T/tok.model" --prompt "the "
expect_rc 1 "a tokenizer larger than the model"
expect_has err "fsdprun sample: --tokenizer $T/tok.model has 300 pieces, more than the 290 ids of the model" \
  "a tokenizer larger than the model"
run "$FSDPRUN" sample "$T/hf" --prompt "the " --max-new-tokens 2
expect_rc 0 "no --tokenizer for a 300-id model"
expect_has err "note: the model has 300 ids, not the 256 bytes" "no --tokenizer for a 300-id model"
finish
