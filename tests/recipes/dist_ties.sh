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
. "${0%/*}/lib.sh"
must "ties_train reference run" "$FSDPRUN" -n 1 tests/dist/ties_train.lua --mode=ref --out="$T/ref"
for n in 2 4; do
  must "ties_train at $n ranks" "$FSDPRUN" -n "$n" tests/dist/ties_train.lua --mode=meta --out="$T/out"
  compare "$T/ref" "$T/out" "tied GPT on meta, rank 0's weights synced, $n ranks vs eager 1 rank" \
    --tol=1e-5
done
for n in 2 4; do
  for case in tie shape skip module extra meta retie; do
    start=$(date +%s)
    must "ties_mismatch $case at $n ranks" \
      timeout 60 "$FSDPRUN" -n "$n" tests/dist/ties_mismatch.lua --case=$case
    secs=$(($(date +%s) - start))
    [ "$secs" -le 10 ] || { cat "$T/log"; die "$case at $n ranks took ${secs}s"; }
    echo "ok (${secs}s): $(tail -1 "$T/log")"
  done
done
finish
