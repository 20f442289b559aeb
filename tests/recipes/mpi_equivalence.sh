#!/bin/sh
# mpi_equivalence.sh — the equivalence tests of tests/recipes/dist_equivalence.sh on the mpi
# backend: tests/dist/train_equiv.lua (a small GPT with SGD, an MLP with AdamW; every strategy)
# under `mpirun -np 2` and `-np 4` must give the very same bits (losses and final parameters) as
# the local backend at the same world size: the mpi backend reduces in rank order with the local
# backend's arithmetic (docs/mpi.md), so nothing is left to tolerance (mixed precision too: bf16
# gathers with f32 and bf16 reductions, at 2 ranks). They are also compared
# with the 1-rank unwrapped reference within 1e-5 relative, as dist_equivalence.sh does. The
# same over TCP (--mca btl tcp,self: ranks talk as they would across machines), through
# `fsdprun -n 2 --backend mpi` (fsdprun starts mpirun itself), and a perturbed run must differ
# (so the comparison can fail). Skips (exit 77) only when mpirun is not installed.
. "${0%/*}/lib.sh"
need mpirun "apt-get install openmpi-bin"
if ! "$FSDPRUN" --backend mpi -e 'assert(require("fsdp").backend() == "mpi")' >/dev/null 2>&1; then
  "$FSDPRUN" --backend mpi -e '' 2>&1 | head -3
  echo "FAIL: this fsdprun has no working mpi backend (Open MPI is installed)"
  exit 1
fi
# run OUT LAUNCH...: LAUNCH fsdprun train_equiv.lua --out=OUT (the rest of the arguments follow)
train() {
  out=$1; shift
  timeout -k 5 120 "$@" >"$T/log" 2>&1 || { cat "$T/log"; fail "exited nonzero: $*"; return 1; }
}
same() { # same A B LABEL: bitwise
  if "$FSDPRUN" tests/dist/compare.lua "$1" "$2" --exact >"$T/cmp" 2>&1; then
    echo "ok: $3: $(cat "$T/cmp")"
  else
    fail "$3: $(cat "$T/cmp")"
  fi
}
close() { # close REF OUT LABEL: within 1e-5 relative
  if "$FSDPRUN" tests/dist/compare.lua "$1" "$2" >"$T/cmp" 2>&1; then
    echo "ok: $3: $(cat "$T/cmp")"
  else
    fail "$3: $(cat "$T/cmp")"
  fi
}
for model in gpt mlp; do
  train "$T/ref" "$FSDPRUN" tests/dist/train_equiv.lua --model=$model --strategy=plain --out="$T/ref_$model"
  for strategy in full grad_op none; do
    for n in 2 4; do
      train x "$FSDPRUN" -n $n tests/dist/train_equiv.lua --model=$model --strategy=$strategy --out="$T/local" || continue
      train x $MPIRUN -np $n "$FSDPRUN" tests/dist/train_equiv.lua --model=$model --strategy=$strategy --out="$T/mpi" || continue
      same "$T/local" "$T/mpi" "$model $strategy: mpirun -np $n = local -n $n, bitwise"
      close "$T/ref_$model" "$T/mpi" "$model $strategy: mpirun -np $n vs 1 rank unwrapped"
    done
  done
done
# mixed precision: bf16 gathers, f32 or bf16 reductions (bf16 sums in rank order too)
for cfg in "gpt full f32" "mlp none bf16" "gpt grad_op bf16"; do
  set -- $cfg
  "$FSDPRUN" -n 2 tests/dist/train_equiv.lua --model=$1 --strategy=$2 --mp=bf16 --reduce=$3 --out="$T/local" >/dev/null 2>&1
  train x $MPIRUN -np 2 "$FSDPRUN" tests/dist/train_equiv.lua --model=$1 --strategy=$2 --mp=bf16 --reduce=$3 --out="$T/mpi" &&
    same "$T/local" "$T/mpi" "$1 $2 mp bf16 reduce $3: mpirun -np 2 = local -n 2, bitwise"
done
# over TCP
for n in 2 4; do
  "$FSDPRUN" -n $n tests/dist/train_equiv.lua --model=gpt --strategy=full --out="$T/local" >/dev/null 2>&1
  train x $MPIRUN --mca btl tcp,self -np $n "$FSDPRUN" tests/dist/train_equiv.lua --model=gpt --strategy=full --out="$T/mpi" &&
    same "$T/local" "$T/mpi" "gpt full over TCP: mpirun --mca btl tcp,self -np $n = local -n $n, bitwise"
done
"$FSDPRUN" -n 4 tests/dist/train_equiv.lua --model=mlp --strategy=grad_op --out="$T/local" >/dev/null 2>&1
train x $MPIRUN --mca btl tcp,self -np 4 "$FSDPRUN" tests/dist/train_equiv.lua --model=mlp --strategy=grad_op --out="$T/mpi" &&
  same "$T/local" "$T/mpi" "mlp grad_op over TCP: mpirun --mca btl tcp,self -np 4 = local -n 4, bitwise"
# prefetch off, and the reduce-scatter cut into many small segments with a small window
"$FSDPRUN" -n 2 tests/dist/train_equiv.lua --model=gpt --strategy=full --prefetch=false --out="$T/local" >/dev/null 2>&1
train x $MPIRUN -np 2 -x FSDP_MPI_SEGMENT_KIB=4 -x FSDP_MPI_WINDOW=1 "$FSDPRUN" tests/dist/train_equiv.lua --model=gpt --strategy=full --prefetch=false --out="$T/mpi" &&
  same "$T/local" "$T/mpi" "gpt full, no prefetch, 4 KiB segments, window 1: mpirun -np 2 = local -n 2"
# fsdprun -n 2 --backend mpi starts mpirun itself
"$FSDPRUN" -n 2 tests/dist/train_equiv.lua --model=mlp --strategy=full --out="$T/local" >/dev/null 2>&1
train x "$FSDPRUN" -n 2 --backend mpi tests/dist/train_equiv.lua --model=mlp --strategy=full --out="$T/mpi" &&
  same "$T/local" "$T/mpi" "mlp full: fsdprun -n 2 --backend mpi = local -n 2"
# the comparison can fail: a learning rate off by 0.1%
train x $MPIRUN -np 2 "$FSDPRUN" tests/dist/train_equiv.lua --model=mlp --strategy=full --lr_scale=1.001 --out="$T/mpi"
if "$FSDPRUN" tests/dist/compare.lua "$T/local" "$T/mpi" --exact >"$T/cmp" 2>&1; then
  fail "a perturbed mpi run compared equal: $(cat "$T/cmp")"
else
  echo "ok: a perturbed run (lr x 1.001) differs: $(cat "$T/cmp")"
fi
finish
