/*
 * reduce.c — the reductions of the local and mpi backends on host memory: the cpu kernels'
 * arithmetic (src/kernels/cpu/ranks.c), which every device's reduce_ranks slot reproduces, so a
 * collective gives the same bits on every backend and device.
 */
#include "comm/comm.h"
#include "kernels/cpu/kernels.h"

bool fsdp_comm_reduce_supported(fsdp_dtype dtype, fsdp_reduce_op red) {
  return fsdp_cpu_reduce_supported(dtype, red);
}

void fsdp_comm_reduce(void *out, const void *const *src, int nsrc, int64_t m, fsdp_dtype dtype,
                      fsdp_reduce_op red) {
  fsdp_cpu_reduce_ranks(out, src, nsrc, m, dtype, red);
}
