#!/bin/sh
# run_spec.sh SPEC — runs one tests/cuda busted spec on the device under test: cuda, or the cpu2
# test device when FSDP_CUDA_TEST_DEVICE=cpu2 (the harness, runnable without a GPU). busted has
# no skip code, so this script is the skip: with no cuda device it prints "no CUDA device:
# <reason>" and exits 77 (ctest's SKIP_RETURN_CODE). nvidia-smi listing a GPU while the engine
# counts none is a failure, not a skip. Run from the source root with ctest's LUA_PATH/LUA_CPATH.
set -u
spec=$1
dev=${FSDP_CUDA_TEST_DEVICE:-cuda}
case $dev in
  cuda | cpu2) ;;
  *) echo "FSDP_CUDA_TEST_DEVICE=$dev: only cuda and cpu2 are known" >&2; exit 1 ;;
esac
if [ "$dev" = cuda ]; then
  n=$(luajit -e 'io.write(require("fsdp").device_count("cuda"))') || {
    echo "run_spec: luajit could not load fsdp (LUA_PATH / LUA_CPATH?)" >&2
    exit 1
  }
  if [ "$n" = 0 ]; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    if [ "${gpus:-0}" -gt 0 ]; then
      echo "nvidia-smi lists $gpus GPU(s) but fsdp.device_count(\"cuda\") is 0" >&2
      exit 1
    fi
    if command -v nvidia-smi >/dev/null 2>&1; then
      echo "no CUDA device: fsdp.device_count(\"cuda\") is 0 and nvidia-smi lists no GPU"
    else
      echo "no CUDA device: fsdp.device_count(\"cuda\") is 0 and there is no nvidia-smi"
    fi
    exit 77
  fi
fi
exec busted --lua=luajit -o utfTerminal "$spec"
