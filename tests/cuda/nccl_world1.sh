#!/bin/sh
# nccl_world1.sh — the nccl backend where a machine has one GPU: world size 1 (NCCL refuses two
# ranks on one GPU; several ranks on one GPU are the local backend's, dist_local.sh). The GPT
# wrapped (full sharding) and trained 50 steps over NCCL equals the unwrapped run on the GPU
# within 1e-5; the backend is "nccl"; -n 2 on one GPU is refused by name. Skips (77) without a
# cuda device or without the nccl backend.
. "${0%/*}/../recipes/lib.sh"
set -e
need_cuda
b=$("$FSDPRUN" --backend nccl -e 'io.write(require("fsdp").backend())' 2>"$T/err") || {
  if grep -q "built without NCCL" "$T/err"; then skip "$(cat "$T/err")"; fi
  cat "$T/err"; echo "FAIL: fsdprun --backend nccl could not start"; exit 1; }
[ "$b" = nccl ] || { echo "FAIL: --backend nccl runs the '$b' backend"; exit 1; }
"$FSDPRUN" tests/dist/train_equiv.lua --out="$T/ref" --model=gpt --device=cuda \
  --strategy=plain >"$T/log" 2>&1 || { cat "$T/log"; echo "FAIL: the reference run"; exit 1; }
"$FSDPRUN" --backend nccl tests/dist/train_equiv.lua --out="$T/out" --model=gpt --device=cuda \
  --strategy=full >"$T/log" 2>&1 || { cat "$T/log"; echo "FAIL: the nccl run"; exit 1; }
res=$("$FSDPRUN" tests/dist/compare.lua "$T/ref" "$T/out" 2>&1) || {
  echo "$res"; echo "FAIL: gpt over nccl at world 1 vs unwrapped"; exit 1; }
echo "ok: gpt full over nccl, world 1, vs unwrapped: $res"
if [ "$cuda_n" -lt 2 ]; then
  if "$FSDPRUN" --backend nccl -n 2 -e 'print(1)' >"$T/out" 2>"$T/err"; then
    echo "FAIL: --backend nccl -n 2 on one GPU ran"; exit 1
  fi
  grep -q "several ranks on one GPU: --backend local" "$T/err" || {
    cat "$T/err"; echo "FAIL: -n 2 on one GPU: no reason given"; exit 1; }
  echo "ok: --backend nccl -n 2 on one GPU is refused"
fi
