/*
 * nccl_stub.c — the `nccl` backend when the build did not find NCCL (CMakeLists.txt compiles
 * this file instead of nccl.c): every entry point of nccl.h exists and says how to get the real
 * one. The bootstrap (nccl_boot.c) is in every build.
 */
#include "comm/nccl.h"

bool fsdp_nccl_available(void) { return false; }

int fsdp_comm_nccl_new(fsdp_comm **out, fsdp_comm *boot) {
  (void)boot;
  *out = NULL;
  return fsdp_error("fsdprun was built without NCCL (install the CUDA toolkit with NCCL under "
                    "/usr/local/cuda, or set CUDAToolkit_ROOT, and rebuild)");
}
