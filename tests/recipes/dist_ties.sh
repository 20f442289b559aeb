#!/bin/sh
# Ties and cross-rank agreement:
#   ties_train.lua     the accelerate report's scenario: a tied GPT on meta at 2 and 4 ranks,
#                      rank 0 holding the real weights, sync_module_states, 20 steps: the same
#                      tensors and the tie on every rank, one storage, and the loss curve and
#                      final parameters equal the eager unsharded 1-rank run (1e-5 relative)
#   ties_mismatch.lua  the last rank builds something else (no tie, another width, a block
#                      fewer, a module dropped, an extra parameter, meta, a broken tie): wrap
#                      fails on every rank with an error naming the difference and the ranks,
#                      within seconds (no hang), and the ranks can go on
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$FSDPRUN" -n 1 tests/dist/ties_train.lua --mode=ref --out="$tmp/ref" >"$tmp/log" 2>&1 || {
  cat "$tmp/log"; echo "FAIL: ties_train reference run"; exit 1; }
for n in 2 4; do
  "$FSDPRUN" -n "$n" tests/dist/ties_train.lua --mode=meta --out="$tmp/out" >"$tmp/log" 2>&1 || {
    cat "$tmp/log"; echo "FAIL: ties_train at $n ranks"; exit 1; }
  res=$("$FSDPRUN" tests/dist/compare.lua "$tmp/ref" "$tmp/out" --tol=1e-5 2>&1) || {
    echo "$res"; echo "FAIL: meta + sync at $n ranks differs from the eager 1-rank run"; exit 1; }
  echo "ok: tied GPT on meta, rank 0's weights synced, $n ranks vs eager 1 rank: $res"
done
for n in 2 4; do
  for case in tie shape skip module extra meta retie; do
    start=$(date +%s)
    out=$(timeout 60 "$FSDPRUN" -n "$n" tests/dist/ties_mismatch.lua --case=$case 2>&1) || {
      echo "$out"; echo "FAIL: ties_mismatch $case at $n ranks"; exit 1; }
    secs=$(( $(date +%s) - start ))
    if [ "$secs" -gt 10 ]; then echo "$out"; echo "FAIL: $case at $n ranks took ${secs}s"; exit 1; fi
    echo "ok (${secs}s): $(echo "$out" | tail -1)"
  done
done
