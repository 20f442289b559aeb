#!/bin/sh
# Smoke test of recipes/prune_gpt.lua at 2 ranks in a short mode (a tiny GPT, 120 steps):
# GMP to 50% on the attention and MLP projections with blocks.1.attn.proj.weight excluded (the
# table must show every pruned projection at exactly 50.00% and the excluded one at 0.00%), the
# validation loss before and after pruning, JSONL metrics with the sparsity report; then --nm
# with --sparsity=0.7: attention at 70.00%, MLP weights at 50.00% with the 2:4 structure on
# every group.
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
short="--steps=120 --d=64 --layers=2 --ctx=64 --val_batches=4"
out=$("$FSDPRUN" -n 2 recipes/prune_gpt.lua $short --metrics="$tmp/m.jsonl" 2>&1) || {
  echo "$out"; echo "FAIL: prune_gpt exited nonzero"; exit 1; }
fail() { echo "$out"; echo "FAIL: $1"; exit 1; }
echo "$out" | grep -Eq '^blocks\.1\.attn\.proj\.weight +4096 +0\.00% +prunable$' || fail "the excluded projection is not at 0.00%"
n=$(echo "$out" | grep -Ec '^blocks\.[12]\.(attn\.(qkv|proj)|mlp\.(fc|proj))\.weight +[0-9]+ +50\.00% +prunable, masked$')
[ "$n" -eq 7 ] || fail "$n of 7 pruned projections at 50.00%"
line=$(echo "$out" | grep '^val loss before pruning') || fail "no validation loss line"
before=$(echo "$line" | sed -n 's/^val loss before pruning \([0-9.]*\) *after \([0-9.]*\) .*/\1/p')
after=$(echo "$line" | sed -n 's/^val loss before pruning \([0-9.]*\) *after \([0-9.]*\) .*/\2/p')
awk -v b="$before" -v a="$after" 'BEGIN { exit !(a > 0 && a < b && b < 5.6) }' || fail "val loss before $before, after $after"
grep -q '"sparsity_report"' "$tmp/m.jsonl" || fail "no sparsity_report in the metrics"
grep -q '"prunable_sparsity_percent"' "$tmp/m.jsonl" || fail "no params_summary in the metrics"
echo "ok: prune_gpt GMP 50%: $line"

out=$("$FSDPRUN" -n 2 recipes/prune_gpt.lua $short --nm --sparsity=0.7 2>&1) || {
  echo "$out"; echo "FAIL: prune_gpt --nm exited nonzero"; exit 1; }
n=$(echo "$out" | grep -Ec '^blocks\.[12]\.attn\.(qkv|proj)\.weight +[0-9]+ +70\.00% +prunable, masked$')
[ "$n" -eq 3 ] || fail "$n of 3 attention weights at 70.00%"
n=$(echo "$out" | grep -Ec '^blocks\.[12]\.mlp\.(fc|proj)\.weight +[0-9]+ +50\.00% +prunable, masked$')
[ "$n" -eq 4 ] || fail "$n of 4 MLP weights at 50.00%"
echo "$out" | grep -Eq '^2:4 check: [1-9][0-9]* groups of 4 in the MLP weights, 0 not keeping exactly 2$' || fail "2:4 structure"
echo "ok: prune_gpt --nm: $(echo "$out" | grep '^2:4 check'); $(echo "$out" | grep '^val loss')"
