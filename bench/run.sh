#!/bin/sh
# Run every benchmark (not tests): kernel timings, then the GPT train step.
#   sh bench/run.sh [build-dir]
set -eu
BUILD=${1:-build}
"$BUILD/bench/bench_kernels"
"$BUILD/bin/fsdprun" bench/gpt_step.lua
