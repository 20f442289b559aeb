/*
 * pool.h — the calling rank's CPU threads, shared by every cpu kernel (element-wise math,
 * attention, optimizer steps, and the GEMMs, which split their work over the same threads), so
 * no two threading runtimes compete for a rank's cores. Private to src/kernels/cpu, except the
 * thread-count settings, which the host (its thread rule) and the binding call.
 *
 * fsdp_cpu_parallel_for(n, grain, fn, ctx) runs fn(ctx, lo, hi) over contiguous chunks covering
 * [0, n), each at least `grain` items (the last may be shorter), and returns when all are done.
 * The chunks depend only on n, grain and the thread count, never on timing, so a kernel that
 * writes each output from one chunk gives the same bits run to run; one that combines partial
 * results must combine them in chunk order. With one thread, or n < 2 * grain, fn runs inline
 * once over [0, n).
 *
 * Chunking: min(threads, n / grain) chunks of nearly equal size. When grain is a multiple of 16
 * every chunk boundary but n is a multiple of 16 (whole cache lines of floats), so chunks never
 * share a line of a float output, and the remainder goes to the last chunk.
 *
 * Threads: the rank's thread runs the first chunk itself and takes any chunk no worker has
 * claimed yet; workers are started on first need and joined when the rank's thread exits.
 * Inside a task (on any of the threads) fsdp_cpu_threads() is 1 and fsdp_cpu_parallel_for runs
 * fn inline once over [0, n): nested parallelism is never attempted, and a kernel called from a
 * task computes exactly what it computes on one thread. fn must not block on another thread.
 */
#ifndef FSDP_KERNELS_CPU_POOL_H
#define FSDP_KERNELS_CPU_POOL_H

#include <stdint.h>

/* Most threads a rank may have (its own included). */
#define FSDP_CPU_MAX_THREADS 1024

typedef void (*fsdp_cpu_task)(void *ctx, int64_t lo, int64_t hi);

void fsdp_cpu_parallel_for(int64_t n, int64_t grain, fsdp_cpu_task fn, void *ctx);
/* The threads the calling rank's kernels use (>= 1): its own setting, else the process
 * default; 1 inside a task. */
int fsdp_cpu_threads(void);
/* How fsdp_cpu_parallel_for(n, grain, ...) cuts [0, n) on this thread now: the number of chunks
 * (1: fn runs inline over [0, n)), and chunk i's bounds [*lo, *hi) for that count. A kernel
 * that keeps one partial result per chunk sizes and indexes them with these. */
int fsdp_cpu_chunks(int64_t n, int64_t grain);
void fsdp_cpu_chunk_bounds(int64_t n, int64_t grain, int nchunks, int i, int64_t *lo,
                           int64_t *hi);
/* The index of the chunk that starts at lo (a task's lo), for per-chunk scratch slots; 0 when
 * none does. */
int fsdp_cpu_chunk_at(int64_t n, int64_t grain, int nchunks, int64_t lo);

/* ---- settings (the host's thread rule, fsdp.core.set_threads) ------------------------------ */

/* The calling thread's thread count from now on, clamped to 1 .. FSDP_CPU_MAX_THREADS;
 * n < 1: follow the process default again. Shrinking joins the thread's workers. */
void fsdp_cpu_set_threads(int n);
/* The count for threads that set none (clamped likewise); n < 1: fsdp_cpu_cores(). */
void fsdp_cpu_set_default_threads(int n);
int fsdp_cpu_default_threads(void);
/* CPUs this process may run on (sched_getaffinity), >= 1. */
int fsdp_cpu_cores(void);
/* Join the calling thread's workers now (later calls start them again). Thread exit and
 * process exit do this for the exiting thread. */
void fsdp_cpu_pool_release(void);
/* Workers the calling thread has running, and how many of them sleep on their futex (tests). */
int fsdp_cpu_pool_workers(void);
int fsdp_cpu_pool_sleeping(void);

#endif
