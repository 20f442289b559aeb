#!/bin/sh
# Hybrid sharding on the mpi backend (sub-communicators from MPI_Comm_split): under
# `mpirun -np 4` a GPT and an MLP trained with strategy = "hybrid", shard_size 2, give the very
# same bits as the local backend at 4 ranks (the reductions are the same in both), and
# tests/dist/hybrid.lua (bytes per group, refusals, checkpoints across strategies) passes.
# Skips (exit 77) when mpirun is missing or fsdprun was built without Open MPI.
. "${0%/*}/lib.sh"
need_mpi
for model in gpt mlp; do
  train_equiv 4 "$T/local" --model=$model --strategy=hybrid --shard_size=2
  must "mpirun -np 4 $model hybrid" timeout -k 5 120 $MPIRUN -np 4 "$FSDPRUN" \
    "$SRC/tests/dist/train_equiv.lua" --model=$model --strategy=hybrid --shard_size=2 --out="$T/mpi"
  compare "$T/local" "$T/mpi" "$model hybrid 2 x 2: mpirun -np 4 = local -n 4" --exact
done
mkdir -p "$T/ck"
must_show "mpirun -np 4 tests/dist/hybrid.lua" timeout -k 5 120 $MPIRUN -np 4 "$FSDPRUN" \
  "$SRC/tests/dist/hybrid.lua" --dir="$T/ck"
finish
