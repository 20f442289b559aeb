#!/bin/sh
# dist_memory.sh — the memory proof of tests/dist/memory.lua with every rank thread on the one
# GPU: per rank, shards = total/N and the gathered peak = the root plus the largest unit (plus
# the next one with prefetch), within 5%, at 2 and 4 ranks, read from the cuda column of
# fsdp.memory(). Skips (77) without a cuda device.
. "${0%/*}/../recipes/lib.sh"
set -e
need_cuda
for k in 2 4; do
  for prefetch in true false; do
    out=$("$FSDPRUN" -n "$k" tests/dist/memory.lua --prefetch=$prefetch --device=cuda 2>&1) || {
      echo "$out"; echo "FAIL: memory on one GPU at $k ranks, prefetch $prefetch"; exit 1; }
    echo "ok: $out"
  done
done
