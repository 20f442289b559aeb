#!/bin/sh
# The gradient accumulation snippet of docs/recipes.md ("Gradient accumulation"), taken from the
# page as it is and run at 2 ranks for 100 steps of 4 micro-batches: the byte loss starts at
# ln(256) = 5.55 and must fall below 3.2. Then --accumulate=1 (no no_sync at all) trains too.
# Also runs the page's first recipe, "The shape of a recipe", at 2 ranks.
. "${0%/*}/lib.sh"
[ -r /usr/share/games/fortunes ] || skip "no /usr/share/games/fortunes (apt-get install fortunes)"
awk '/^## Gradient accumulation/ { on = 1 } on && /^```lua$/ { code = 1; next }
     code && /^```$/ { exit } code { print }' "$SRC/docs/recipes.md" >"$T/snippet.lua"
[ -s "$T/snippet.lua" ] || die "docs/recipes.md has no lua block under '## Gradient accumulation'"
grep -q "fsdp.no_sync" "$T/snippet.lua" || die "the snippet does not use fsdp.no_sync"
for k in 4 1; do
  must "the snippet with --accumulate=$k" "$FSDPRUN" -n 2 "$T/snippet.lua" --steps=100 --accumulate=$k
  loss=$(sed -n 's/^step 100 loss \([0-9.]*\)$/\1/p' "$T/log")
  [ -n "$loss" ] || die_log "--accumulate=$k: no 'step 100 loss' line"
  awk -v v="$loss" 'BEGIN { exit !(v < 3.2) }' || die_log "--accumulate=$k: loss $loss >= 3.2"
  echo "ok: the snippet, 2 ranks, --accumulate=$k: loss $loss at step 100"
done
# its arguments are declared: a misspelt one is refused (status 2), and a k that does not divide
# a rank's rows is named before anything runs
if "$FSDPRUN" -n 2 "$T/snippet.lua" --acumulate=2 >"$T/log" 2>&1; then rc=0; else rc=$?; fi
[ "$rc" -eq 2 ] && grep -q "unknown argument --acumulate; did you mean --accumulate?" "$T/log" ||
  die_log "--acumulate=2: exit status $rc"
must_fail "--accumulate=3" "$FSDPRUN" -n 2 "$T/snippet.lua" --accumulate=3
grep -q "accumulate=3 does not divide the 16 rows of a rank" "$T/log" || die_log "--accumulate=3: wrong message"
echo "ok: the snippet refuses --acumulate and --accumulate=3"

# the page's first recipe ("The shape of a recipe") runs at 2 ranks too (it wraps its model)
awk '/^## The shape of a recipe/ { on = 1 } on && /^```lua$/ { code = 1; next }
     code && /^```$/ { exit } code { print }' "$SRC/docs/recipes.md" >"$T/shape.lua"
[ -s "$T/shape.lua" ] || die "docs/recipes.md has no lua block under '## The shape of a recipe'"
must "the shape of a recipe at 2 ranks" "$FSDPRUN" -n 2 "$T/shape.lua" --steps=101
grep -q "^step 101/101 | loss" "$T/log" || die_log "the shape of a recipe: no step 101"
echo "ok: the shape of a recipe, 2 ranks, 101 steps"
finish
