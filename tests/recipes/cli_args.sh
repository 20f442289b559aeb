#!/bin/sh
# cli_args.sh — recipe arguments declared with fsdp.args{...} (lua/fsdp/args.lua,
# docs/recipes.md): `--help` prints them once and exits 0 without running the recipe; a bad
# value, an unknown argument and a missing value are refused in one line naming the argument,
# status 2, no traceback; `--steps 50` is `--steps=50`. Without -n, at -n 1 and at -n 2; the
# shipped recipes' --help too. Run by ctest with FSDPRUN=<build>/bin/fsdprun.
. "${0%/*}/lib.sh"
R="$SRC/tests/dist/args_recipe.lua"

for n in 0 1 2; do
  if [ "$n" = 0 ]; then set -- "$FSDPRUN"; at="without -n"; else set -- "$FSDPRUN" -n "$n"; at="at -n $n"; fi

  run "$@" "$R" --help
  expect_rc 0 "--help $at"
  expect_has out "usage: fsdprun [-n N] $R [--name=value ...]" "--help $at"
  expect_has out "--steps=INTEGER" "--help $at"
  expect_has out "[default 200, >= 1]" "--help $at"
  expect_has out "--mp=bf16|f16" "--help $at"
  expect_lacks out "ran on rank" "--help $at ran the recipe"
  [ "$(grep -c '^usage:' "$T/out")" = 1 ] || fail "--help $at: printed $(grep -c '^usage:' "$T/out") times"
  [ -s "$T/err" ] && fail "--help $at wrote to stderr: $(cat "$T/err")"
  run "$@" "$R" --steps=abc -h
  expect_rc 0 "-h after a bad value $at"
  expect_has out "usage:" "-h after a bad value $at"

  run "$@" "$R" --steps 50 --lr=0.5 --resume
  expect_rc 0 "--steps 50 $at"
  expect_has out "steps=50 lr=0.5 mp=nil resume=true same=true" "--steps 50 $at"

  # each refusal: status 2, one line on stderr naming the argument, printed once, no traceback
  for case in "--steps=abc|--steps: 'abc' is not an integer" \
              "--step=50|unknown argument --step; did you mean --steps?" \
              "--steps|--steps: missing value (--steps=INTEGER)" \
              "--steps=0|--steps: 0 is below the minimum 1" \
              "--mp=f8|--mp: 'f8' is not one of bf16, f16" \
              "stray|unexpected argument 'stray'; arguments are --name=value"; do
    a=${case%%|*} msg=${case#*|}
    run "$@" "$R" "$a"
    expect_rc 2 "$a $at"
    expect_has err "fsdprun: $R: $msg (try 'fsdprun $R --help')" "$a $at"
    [ "$(lines_of err)" = 1 ] || fail "$a $at: not one line: $(cat "$T/err")"
    expect_lacks err "traceback" "$a $at"
    expect_lacks out "ran on rank" "$a $at ran the recipe"
  done
done

# the shipped recipes declare theirs: --help lists them without training (quickly)
for r in fashion_mlp gpt_fortunes prune_gpt prune_mlp; do
  run "$FSDPRUN" -n 2 "$SRC/recipes/$r.lua" --help
  expect_rc 0 "recipes/$r.lua --help"
  expect_has out "--steps=INTEGER" "recipes/$r.lua --help"
  expect_lacks out "step 1" "recipes/$r.lua --help trained"
  run "$FSDPRUN" "$SRC/recipes/$r.lua" --step=5
  expect_rc 2 "recipes/$r.lua --step=5"
  expect_has err "unknown argument --step; did you mean --steps?" "recipes/$r.lua --step=5"
done

# a recipe that declares nothing keeps the loose fsdp.args (no checks)
echo 'local a = require("fsdp").args; print(a.x, a.flag, a[1])' > "$T/loose.lua"
run "$FSDPRUN" "$T/loose.lua" --x=3 --flag word
expect_rc 0 "undeclared fsdp.args"
expect_out "3	true	word" "undeclared fsdp.args"
finish
