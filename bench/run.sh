#!/bin/sh
# Run every benchmark (not tests): kernel timings, the GPT train step, then the least time the
# step's kernels allow (docs/PERFORMANCE.md, "The ceiling").
#   sh bench/run.sh [build-dir]
set -eu
BUILD=${1:-build}
"$BUILD/bench/bench_kernels"
"$BUILD/bin/fsdprun" bench/gpt_step.lua
"$BUILD/bench/step_floor" --reps_s=0.3
