#!/bin/sh
# nccl_world1.sh — the nccl backend where a machine has one GPU: world size 1 (NCCL refuses two
# ranks on one GPU; several ranks on one GPU are the local backend's, dist_local.sh). The GPT
# wrapped (full sharding) and trained 50 steps over NCCL equals the unwrapped run on the GPU
# within 1e-5; the backend is "nccl"; -n 2 on one GPU is refused by name. Skips (77) without a
# cuda device or without the nccl backend.
set -eu
: "${FSDPRUN:?set FSDPRUN to the fsdprun executable}"
n=$("$FSDPRUN" -e 'io.write(require("fsdp").device_count("cuda"))' 2>/dev/null || echo 0)
if [ "$n" = 0 ]; then
  echo "no CUDA device: fsdp.device_count(\"cuda\") is 0"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
b=$("$FSDPRUN" --backend nccl -e 'io.write(require("fsdp").backend())' 2>"$tmp/err") || {
  if grep -q "built without NCCL" "$tmp/err"; then echo "skipped: $(cat "$tmp/err")"; exit 77; fi
  cat "$tmp/err"; echo "FAIL: fsdprun --backend nccl could not start"; exit 1; }
[ "$b" = nccl ] || { echo "FAIL: --backend nccl runs the '$b' backend"; exit 1; }
"$FSDPRUN" tests/dist/train_equiv.lua --out="$tmp/ref" --model=gpt --device=cuda \
  --strategy=plain >"$tmp/log" 2>&1 || { cat "$tmp/log"; echo "FAIL: the reference run"; exit 1; }
"$FSDPRUN" --backend nccl tests/dist/train_equiv.lua --out="$tmp/out" --model=gpt --device=cuda \
  --strategy=full >"$tmp/log" 2>&1 || { cat "$tmp/log"; echo "FAIL: the nccl run"; exit 1; }
res=$("$FSDPRUN" tests/dist/compare.lua "$tmp/ref" "$tmp/out" 2>&1) || {
  echo "$res"; echo "FAIL: gpt over nccl at world 1 vs unwrapped"; exit 1; }
echo "ok: gpt full over nccl, world 1, vs unwrapped: $res"
if [ "$n" -lt 2 ]; then
  if "$FSDPRUN" --backend nccl -n 2 -e 'print(1)' >"$tmp/out" 2>"$tmp/err"; then
    echo "FAIL: --backend nccl -n 2 on one GPU ran"; exit 1
  fi
  grep -q "several ranks on one GPU: --backend local" "$tmp/err" || {
    cat "$tmp/err"; echo "FAIL: -n 2 on one GPU: no reason given"; exit 1; }
  echo "ok: --backend nccl -n 2 on one GPU is refused"
fi
