#!/bin/sh
# gpu_offload.sh — the largest GPT that trains on this machine's GPU with and without CPU offload
# (bench/gpu_offload.lua, one process per size, ascending; a mode stops at its first failure).
#   sh bench/gpu_offload.sh [build-dir] [json-out]
set -u
BUILD=${1:-build}
OUT=${2:-/dev/stdout}
# GPT-2 medium, large, XL, then wider and deeper (d, layers): ~0.35, 0.77, 1.6, 2.7, 6.7, 13 B
SIZES="1024:24 1280:36 1600:48 2560:32 4096:32 5120:40"
for mode in none cpu; do
  for s in $SIZES; do
    d=${s%:*}; L=${s#*:}
    off=""; [ $mode = cpu ] && off="--offload=cpu"
    line=$("$BUILD/bin/fsdprun" bench/gpu_offload.lua --d=$d --layers=$L $off 2>&1 | tail -1)
    echo "$line" >>"$OUT"
    case "$line" in *'"result":"ok"'*) ;; *) break ;; esac
  done
done
