/*
 * pool.c — the rank's threads for the cpu kernels (pool.h). For now one thread: every task runs
 * inline on the caller.
 */
#include "kernels/cpu/pool.h"

void fsdp_cpu_parallel_for(int64_t n, int64_t grain, fsdp_cpu_task fn, void *ctx) {
  (void)grain;
  if (n > 0) fn(ctx, 0, n);
}

int fsdp_cpu_threads(void) { return 1; }
