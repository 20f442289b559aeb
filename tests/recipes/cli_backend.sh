#!/bin/sh
# cli_backend.sh — choosing the backend: --backend local|mpi|nccl|auto, the usage error for
# anything else, nccl refused by name where it cannot run (no build, fewer GPUs than ranks: on a
# machine without a GPU always; on one GPU from -n 2), auto falling back to the threads' or
# mpi's own backend, and under mpirun every rank agreeing. Run by ctest with FSDPRUN set.
set -u
. "$(dirname "$0")/lib/check.sh"

gpus=$("$FSDPRUN" -e 'io.write(require("fsdp").device_count("cuda"))' 2>/dev/null || echo 0)
echo "cuda devices here: $gpus"

run "$FSDPRUN" --backend tcp -e 'print(1)'
expect_rc 2 "--backend tcp"
expect_has err "--backend 'tcp': expected 'local', 'mpi', 'nccl' or 'auto'" "--backend tcp"

# nccl where this machine has fewer GPUs than ranks: a usage error naming the counts
n=$((gpus + 1))
run "$FSDPRUN" --backend nccl -n $n -e 'print(1)'
expect_rc 2 "--backend nccl -n $n"
expect_has err "--backend nccl: $n rank" "--backend nccl -n $n"
expect_has err "several ranks on one GPU: --backend local" "--backend nccl -n $n"

# auto: nccl only when every rank has a GPU, else the local backend
run "$FSDPRUN" --backend auto -n $n -e 'local f = require "fsdp"; if f.rank() == 0 then print(f.backend()) end'
expect_rc 0 "--backend auto -n $n"
[ "$(cat "$T/out")" = local ] || fail "--backend auto -n $n: backend '$(cat "$T/out")', expected local"
if [ "$gpus" -gt 0 ]; then
  run "$FSDPRUN" --backend auto -e 'print(require("fsdp").backend())'
  expect_rc 0 "--backend auto on a GPU"
  [ "$(cat "$T/out")" = nccl ] || fail "--backend auto with a GPU: backend '$(cat "$T/out")', expected nccl"
fi

# under mpirun: every rank decides alike
if command -v mpirun >/dev/null 2>&1; then
  M="mpirun --oversubscribe --allow-run-as-root --mca btl_base_warn_component_unused 0"
  run $M -np 2 "$FSDPRUN" --backend auto -e 'local f = require "fsdp"; print(f.rank() .. " " .. f.backend())'
  expect_rc 0 "mpirun --backend auto"
  if [ "$gpus" -lt 2 ]; then
    expect_has out "0 mpi" "mpirun --backend auto"
    expect_has out "1 mpi" "mpirun --backend auto"
    run $M -np 2 "$FSDPRUN" --backend nccl -e 'print(1)'
    [ "$rc" -ne 0 ] || fail "mpirun --backend nccl without GPUs succeeded"
    expect_has err "--backend nccl: 2 ranks on this machine" "mpirun --backend nccl"
  fi
fi

finish cli_backend
