/*
 * bench_pool.c — the rank's thread pool (src/kernels/cpu/pool.h) and the kernels split over it
 * (not a test; prints numbers, exits 0).
 *
 *   dispatch: one fsdp_cpu_parallel_for of 2 empty chunks, back to back (the worker is
 *   spinning) and after a 1 ms pause (the worker sleeps on its futex);
 *   kernels at 1 and at 2..max threads, interleaved (1, 2, 1, 2, ...): sgemm 1024^3 and the
 *   GPT layer shapes (split over the pool, and for comparison the pool at 1 thread with
 *   OpenBLAS's own threads instead: the ceiling the split should reach), attention forward + backward at B=8 T=256 C=256 NH=4, AdamW and sumsq
 *   over 4 M floats, column sums of (2048, 768).
 * Prints the load average with each table: the machine is shared, compare ratios of one run.
 *
 * Usage: bench_pool [max_threads] [rounds]   (defaults: 2, 3)
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

static void loadavg(void) {
  char line[128] = "?";
  FILE *f = fopen("/proc/loadavg", "r");
  if (f) {
    if (!fgets(line, sizeof line, f)) strcpy(line, "?\n");
    fclose(f);
  }
  printf("load average: %s", line);
}

static float *buf(int64_t n, float scale) { return bench_buf("bench_pool", n, scale); }

/* Seconds per call: one warm-up call, then the best of repeated calls over ~0.2 s. */
static double time_call(bench_fn fn, void *ctx) { return bench_time_call(fn, ctx, 0.2); }

/* ---- dispatch -------------------------------------------------------------------------------- */

static void empty_task(void *ctx, int64_t lo, int64_t hi) { (void)ctx, (void)lo, (void)hi; }

static void bench_dispatch(int threads) {
  fsdp_cpu_set_threads(threads);
  fsdp_cpu_parallel_for(threads, 1, empty_task, NULL); /* start the workers */
  const int hot = 200000;
  double t0 = bench_now();
  for (int i = 0; i < hot; i++) fsdp_cpu_parallel_for(threads, 1, empty_task, NULL);
  double per_hot = (bench_now() - t0) / hot;
  enum { COLD = 200 };
  double cold[COLD];
  for (int i = 0; i < COLD; i++) {
    struct timespec pause = {0, 1000000};
    nanosleep(&pause, NULL);
    double t = bench_now();
    fsdp_cpu_parallel_for(threads, 1, empty_task, NULL);
    cold[i] = bench_now() - t;
  }
  qsort(cold, COLD, sizeof cold[0], bench_cmp_double);
  printf("  %d threads: back to back %.2f us a call; after 1 ms idle: median %.1f us, "
         "90th percentile %.1f us\n",
         threads, per_hot * 1e6, cold[COLD / 2] * 1e6, cold[COLD * 9 / 10] * 1e6);
}

/* ---- kernels --------------------------------------------------------------------------------- */

typedef struct {
  float *out, *inp, *weight, *bias;
  int M, K, N;
} gemm_ctx;

static void run_linear(void *p) {
  gemm_ctx *g = p;
  fsdp_cpu_linear_forward(g->out, g->inp, g->weight, g->bias, g->M, g->K, g->N);
}

enum { B = 8, T = 256, C = 256, NH = 4 };

typedef struct {
  float *qkv, *out, *dqkv, *dout, *scratch; /* scratch: enough for any thread count here */
} att_ctx;

/* the rows' softmax stats, kept by the forward for the backward as the engine does */
static float att_stats[B * NH * T * 2];

static void run_attention(void *p) {
  att_ctx *c = p;
  fsdp_cpu_attention_forward(c->out, att_stats, c->scratch, c->qkv, B, T, C, NH);
  fsdp_cpu_attention_backward(c->dqkv, c->scratch, c->dout, c->qkv, att_stats, B, T, C, NH,
                              false);
}

typedef struct {
  float *p, *m, *v, *g;
  int64_t n;
  int rows, cols;
  double sink;
} vec_ctx;

static void run_adamw(void *p) {
  vec_ctx *c = p;
  fsdp_cpu_adamw_step(c->p, c->m, c->v, c->g, c->n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1.0f, 3);
}

static void run_sumsq(void *p) {
  vec_ctx *c = p;
  c->sink += fsdp_cpu_sumsq(c->g, c->n);
}

static void run_colsum(void *p) {
  vec_ctx *c = p;
  fsdp_cpu_colsum_acc(c->m, c->g, c->rows, c->cols);
}

typedef struct {
  const char *label;
  bench_fn fn;
  void *ctx;
  double flops; /* per call, 0: report time only */
  bool native;  /* t threads are OpenBLAS's own, the pool at 1 */
} item;

int main(int argc, char **argv) {
  int max_threads = argc > 1 ? atoi(argv[1]) : 2;
  int rounds = argc > 2 ? atoi(argv[2]) : 3;
  if (max_threads < 2) max_threads = 2;
  if (rounds < 1) rounds = 1;
  printf("bench_pool: cores %d\n", fsdp_cpu_cores());
  loadavg();
  printf("dispatch (2 empty chunks a call):\n");
  for (int t = 2; t <= max_threads; t++) bench_dispatch(t);

  gemm_ctx sq = {buf(1024 * 1024, 1), buf(1024 * 1024, 1), buf(1024 * 1024, 1), NULL, 1024,
                 1024, 1024};
  gemm_ctx qkv = {buf(2048 * 768, 1), buf(2048 * 256, 1), buf(768 * 256, 1), buf(768, 1), 2048,
                  256, 768};
  gemm_ctx down = {buf(2048 * 256, 1), buf(2048 * 1024, 1), buf(256 * 1024, 1), buf(256, 1),
                   2048, 1024, 256};
  gemm_ctx small = {buf(64 * 64, 1), buf(64 * 64, 1), buf(64 * 64, 1), NULL, 64, 64, 64};
  const int64_t NT = (int64_t)B * T;
  att_ctx at = {buf(NT * 3 * C, 2), buf(NT * C, 1), buf(NT * 3 * C, 1), buf(NT * C, 1),
                buf(fsdp_cpu_attention_scratch(B, T, C, NH, FSDP_CPU_MAX_THREADS, true), 1)};
  const int64_t n = 4 << 20;
  vec_ctx vec = {buf(n, 1), buf(n, 1), buf(n, 0), buf(n, 1), n, 2048, 768, 0.0};
  for (int64_t i = 0; i < n; i++) vec.v[i] = vec.v[i] * vec.v[i];
  const double hs = (double)C / NH;
  item items[] = {
      {"sgemm 1024^3 (no bias)", run_linear, &sq, 2.0 * 1024 * 1024 * 1024, false},
      {"  the same, OpenBLAS threads", run_linear, &sq, 2.0 * 1024 * 1024 * 1024, true},
      {"linear qkv 2048x256 -> 768", run_linear, &qkv, 2.0 * 2048 * 256 * 768, false},
      {"  the same, OpenBLAS threads", run_linear, &qkv, 2.0 * 2048 * 256 * 768, true},
      {"linear down 2048x1024 -> 256", run_linear, &down, 2.0 * 2048 * 1024 * 256, false},
      {"linear 64x64 -> 64", run_linear, &small, 2.0 * 64 * 64 * 64, false},
      {"attention fwd+bwd B8 T256 C256 NH4", run_attention, &at,
       3.0 * B * NH * 2.0 * (2.0 * T * (T + 1) / 2.0 * hs), false},
      {"adamw 4M", run_adamw, &vec, 0, false},
      {"sumsq 4M", run_sumsq, &vec, 0, false},
      {"colsum (2048, 768)", run_colsum, &vec, 0, false},
  };
  const int nitems = (int)(sizeof items / sizeof items[0]);
  double best[16][64];
  for (int i = 0; i < nitems; i++)
    for (int t = 0; t <= max_threads; t++) best[i][t] = 1e30;
  for (int r = 0; r < rounds; r++) {
    for (int i = 0; i < nitems; i++) {
      for (int t = 1; t <= max_threads; t++) {
        fsdp_cpu_set_threads(items[i].native ? 1 : t);
        fsdp_cpu_set_blas_threads(items[i].native ? t : 1);
        double s = time_call(items[i].fn, items[i].ctx);
        if (s < best[i][t]) best[i][t] = s;
      }
    }
  }
  loadavg();
  printf("kernels, best of %d interleaved rounds (ms; GFLOP/s where counted):\n", rounds);
  for (int i = 0; i < nitems; i++) {
    printf("  %-36s", items[i].label);
    for (int t = 1; t <= max_threads; t++) {
      printf("  %dT %8.3f", t, best[i][t] * 1e3);
      if (items[i].flops > 0) printf(" (%5.1f)", items[i].flops / best[i][t] * 1e-9);
    }
    printf("  x%.2f\n", best[i][1] / best[i][max_threads]);
  }
  fsdp_cpu_pool_release();
  return 0;
}
