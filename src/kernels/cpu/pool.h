/*
 * pool.h — private to src/kernels/cpu: the calling rank's CPU threads, shared by every cpu
 * kernel (element-wise math, attention, optimizer steps, and the GEMMs, which split their work
 * over the same threads), so no two threading runtimes compete for a rank's cores.
 *
 * fsdp_cpu_parallel_for(n, grain, fn, ctx) runs fn(ctx, lo, hi) over contiguous chunks covering
 * [0, n), each at least `grain` items (the last may be shorter), and returns when all are done.
 * The chunks depend only on n, grain and the thread count, never on timing, so a kernel that
 * writes each output from one chunk gives the same bits run to run; one that combines partial
 * results must combine them in chunk order. With one thread, or n < 2 * grain, fn runs inline
 * once over [0, n).
 */
#ifndef FSDP_KERNELS_CPU_POOL_H
#define FSDP_KERNELS_CPU_POOL_H

#include <stdint.h>

typedef void (*fsdp_cpu_task)(void *ctx, int64_t lo, int64_t hi);

void fsdp_cpu_parallel_for(int64_t n, int64_t grain, fsdp_cpu_task fn, void *ctx);
/* The threads the calling rank's kernels use (>= 1). */
int fsdp_cpu_threads(void);

#endif
