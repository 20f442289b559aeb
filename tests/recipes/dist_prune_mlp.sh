#!/bin/sh
# Smoke test of recipes/prune_mlp.lua at 2 ranks in a short mode (3 epochs over 20000 images,
# 2000 test images): GMP with global scope must reach exactly 80.00% sparsity of the Linear
# weights and the pruned MLP must still classify (accuracy >= 0.8; it reaches 0.848; the full
# run reaches 0.8926, docs/pruning.md).
. "${0%/*}/lib.sh"
must "prune_mlp exited nonzero" \
  "$FSDPRUN" -n 2 recipes/prune_mlp.lua --epochs=3 --limit=20000 --test_limit=2000
grep -q '^weight sparsity 0\.8000 ' "$T/log" || die_log "sparsity is not 0.8000"
acc=$(sed -n 's/^test accuracy \([0-9.]*\).*/\1/p' "$T/log")
[ -n "$acc" ] || die_log "no 'test accuracy' line"
awk -v a="$acc" 'BEGIN { exit !(a >= 0.8) }' || die_log "accuracy $acc < 0.8"
echo "ok: prune_mlp short run at 2 ranks: 80% sparse, test accuracy $acc"
finish
