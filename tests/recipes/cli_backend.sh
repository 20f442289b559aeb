#!/bin/sh
# cli_backend.sh — choosing the backend: --backend local|mpi|nccl|auto, the usage error for
# anything else, nccl refused by name where it cannot run (no build, fewer GPUs than ranks: on a
# machine without a GPU always; on one GPU from -n 2), auto falling back to the threads' or
# mpi's own backend, under mpirun every rank agreeing, and the launcher `-n N --backend mpi`
# starts (FSDP_MPIRUN: its arguments; one that cannot be run). Run by ctest with FSDPRUN set.
. "${0%/*}/lib.sh"

gpus=$("$FSDPRUN" -e 'io.write(require("fsdp").device_count("cuda"))' 2>/dev/null || echo 0)
echo "cuda devices here: $gpus"

run "$FSDPRUN" --backend tcp -e 'print(1)'
expect_rc 2 "--backend tcp"
expect_has err "--backend 'tcp': expected 'local', 'mpi', 'nccl' or 'auto'" "--backend tcp"

# nccl where this machine has fewer GPUs than ranks: a usage error naming the counts; in a
# build without the nccl backend (FSDP_BUILT_NCCL=0, set by ctest) one saying so
: "${FSDP_BUILT_NCCL:?set FSDP_BUILT_NCCL to 1 or 0 (whether fsdprun has the nccl backend)}"
n=$((gpus + 1))
run "$FSDPRUN" --backend nccl -n $n -e 'print(1)'
expect_rc 2 "--backend nccl -n $n"
if [ "$FSDP_BUILT_NCCL" = 1 ]; then
  expect_has err "--backend nccl: $n rank" "--backend nccl -n $n"
  expect_has err "several ranks on one GPU: --backend local" "--backend nccl -n $n"
else
  expect_has err "--backend nccl: fsdprun was built without NCCL" "--backend nccl -n $n"
fi

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
  run $MPIRUN -np 2 "$FSDPRUN" --backend auto -e 'local f = require "fsdp"; print(f.rank() .. " " .. f.backend())'
  expect_rc 0 "mpirun --backend auto"
  if [ "$gpus" -lt 2 ]; then
    expect_has out "0 mpi" "mpirun --backend auto"
    expect_has out "1 mpi" "mpirun --backend auto"
    run $MPIRUN -np 2 "$FSDPRUN" --backend nccl -e 'print(1)'
    [ "$rc" -ne 0 ] || fail "mpirun --backend nccl without GPUs succeeded"
    if [ "$FSDP_BUILT_NCCL" = 1 ]; then
      expect_has err "--backend nccl: 2 ranks on this machine" "mpirun --backend nccl"
    else
      expect_has err "--backend nccl: fsdprun was built without NCCL" "mpirun --backend nccl"
    fi
  fi
fi

# FSDP_MPIRUN: the launcher fsdprun -n N --backend mpi execs, with mpirun's arguments (in a
# build with Open MPI; without it --backend mpi is refused before any launch)
if "$FSDPRUN" --backend mpi -e '' >/dev/null 2>&1; then
  cat >"$T/launcher" <<'EOF2'
#!/bin/sh
printf '%s\n' "$@" >"$LAUNCHER_ARGS"
exit 7
EOF2
  chmod +x "$T/launcher"
  cores=$(nproc)
  run env FSDP_MPIRUN="$T/launcher" LAUNCHER_ARGS="$T/args" "$FSDPRUN" -n $((cores + 1)) \
    --backend mpi -e 'print(1)'
  expect_rc 7 "FSDP_MPIRUN: the launcher's exit status"
  [ "$(sed -n 1,2p "$T/args" | tr '\n' ' ')" = "-np $((cores + 1)) " ] ||
    fail "FSDP_MPIRUN: the launcher's first arguments: $(tr '\n' ' ' <"$T/args")"
  file_has "$T/args" "--oversubscribe" "FSDP_MPIRUN with more ranks than cores"
  file_has "$T/args" "$(readlink -f "$FSDPRUN")" "FSDP_MPIRUN: fsdprun itself"
  [ "$(tail -n 2 "$T/args" | tr '\n' ' ')" = "-e print(1) " ] ||
    fail "FSDP_MPIRUN: fsdprun's own arguments last: $(tr '\n' ' ' <"$T/args")"
  run env FSDP_MPIRUN="$T/no_such_launcher" "$FSDPRUN" -n 2 --backend mpi -e 'print(1)'
  expect_rc 1 "FSDP_MPIRUN naming nothing"
  expect_has err "--backend mpi: cannot run $T/no_such_launcher" "FSDP_MPIRUN naming nothing"
fi

finish
