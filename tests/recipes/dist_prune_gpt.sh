#!/bin/sh
# Smoke test of recipes/prune_gpt.lua at 2 ranks in a short mode (a tiny GPT, 120 steps):
# GMP to 50% on the attention and MLP projections with blocks.1.attn.proj.weight excluded (the
# table must show every pruned projection at exactly 50.00% and the excluded one at 0.00%), the
# validation loss before and after pruning, JSONL metrics with the sparsity report; then --nm
# with --sparsity=0.7: attention at 70.00%, MLP weights at 50.00% with the 2:4 structure on
# every group.
. "${0%/*}/lib.sh"
short="--steps=120 --d=64 --layers=2 --ctx=64 --val_batches=4"
# shellcheck disable=SC2086 # $short is a list of options
must "prune_gpt exited nonzero" "$FSDPRUN" -n 2 recipes/prune_gpt.lua $short --metrics="$T/m.jsonl"
grep -Eq '^blocks\.1\.attn\.proj\.weight +4096 +0\.00% +prunable$' "$T/log" || die_log "the excluded projection is not at 0.00%"
n=$(grep -Ec '^blocks\.[12]\.(attn\.(qkv|proj)|mlp\.(fc|proj))\.weight +[0-9]+ +50\.00% +prunable, masked$' "$T/log")
[ "$n" -eq 7 ] || die_log "$n of 7 pruned projections at 50.00%"
line=$(grep '^val loss before pruning' "$T/log") || die_log "no validation loss line"
before=$(echo "$line" | sed -n 's/^val loss before pruning \([0-9.]*\) *after \([0-9.]*\) .*/\1/p')
after=$(echo "$line" | sed -n 's/^val loss before pruning \([0-9.]*\) *after \([0-9.]*\) .*/\2/p')
awk -v b="$before" -v a="$after" 'BEGIN { exit !(a > 0 && a < b && b < 5.6) }' || die_log "val loss before $before, after $after"
grep -q '"sparsity_report"' "$T/m.jsonl" || die_log "no sparsity_report in the metrics"
grep -q '"prunable_sparsity_percent"' "$T/m.jsonl" || die_log "no params_summary in the metrics"
echo "ok: prune_gpt GMP 50%: $line"

# shellcheck disable=SC2086
must "prune_gpt --nm exited nonzero" "$FSDPRUN" -n 2 recipes/prune_gpt.lua $short --nm --sparsity=0.7
n=$(grep -Ec '^blocks\.[12]\.attn\.(qkv|proj)\.weight +[0-9]+ +70\.00% +prunable, masked$' "$T/log")
[ "$n" -eq 3 ] || die_log "$n of 3 attention weights at 70.00%"
n=$(grep -Ec '^blocks\.[12]\.mlp\.(fc|proj)\.weight +[0-9]+ +50\.00% +prunable, masked$' "$T/log")
[ "$n" -eq 4 ] || die_log "$n of 4 MLP weights at 50.00%"
grep -Eq '^2:4 check: [1-9][0-9]* groups of 4 in the MLP weights, 0 not keeping exactly 2$' "$T/log" || die_log "2:4 structure"
echo "ok: prune_gpt --nm: $(grep '^2:4 check' "$T/log"); $(grep '^val loss' "$T/log")"
finish
