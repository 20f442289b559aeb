/*
 * bench_kernels.c — throughput of the CPU kernels (not a test; prints numbers, exits 0).
 *
 *   sgemm GFLOP/s at 1024^3 and at the GPT layer shapes (M = B*T = 2048; K = 256 -> N = 768
 *   (qkv), 1024 (mlp up); K = 1024 -> N = 256 (mlp down)), through fsdp_cpu_linear_forward.
 *   Time per call (forward + backward) of layernorm, gelu, softmax and attention at
 *   B = 8, T = 256, C = 256, NH = 4, plus attention's GFLOP/s as a fraction of plain sgemm.
 * Everything runs with 1 and then 2 threads of the rank's pool (kernels/cpu/pool.h; OpenBLAS
 * stays at 1 thread, called per block). Each measurement repeats until it has
 * run for ~0.25 s (best of those reps is reported), so the whole program takes ~10-20 s.
 *
 * Usage: bench_kernels [max_threads]   (default 2)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

static float *buf(int64_t n, float scale) { return bench_buf("bench_kernels", n, scale); }

/* Seconds per call: one warm-up call, then repeat until 0.25 s have passed; best call. */
static double time_call(bench_fn fn, void *ctx) { return bench_time_call(fn, ctx, 0.25); }

/* ---- gemm ------------------------------------------------------------------------------------ */

typedef struct {
  float *out, *inp, *weight;
  int M, K, N;
} gemm_ctx;

static void run_square(void *p) {
  gemm_ctx *g = p;
  fsdp_cpu_gemm(g->out, g->inp, g->weight, g->M, g->N, g->K, false, false, 1.0f, 0.0f, g->K,
                g->N, g->N);
}

static void run_linear(void *p) {
  gemm_ctx *g = p;
  fsdp_cpu_linear_forward(g->out, g->inp, g->weight, NULL, g->M, g->K, g->N);
}

static double bench_gemm(const char *label, bench_fn fn, int M, int K, int N) {
  gemm_ctx g = {buf((int64_t)M * N, 1), buf((int64_t)M * K, 1), buf((int64_t)N * K, 1), M, K, N};
  double t = time_call(fn, &g);
  double gflops = 2.0 * M * N * K / t * 1e-9;
  printf("  %-34s M=%-5d K=%-5d N=%-5d %8.2f ms  %7.1f GFLOP/s\n", label, M, K, N, t * 1e3,
         gflops);
  free(g.out), free(g.inp), free(g.weight);
  return gflops;
}

/* ---- layer kernels at B=8, T=256, C=256, NH=4 ----------------------------------------------- */

enum { B = 8, T = 256, C = 256, NH = 4 };

typedef struct {
  float *x, *y, *dx, *dy, *w, *b, *dw, *db, *mean, *rstd;
} ln_ctx;

static void run_layernorm(void *p) {
  ln_ctx *c = p;
  fsdp_cpu_layernorm_forward(c->y, c->mean, c->rstd, c->x, c->w, c->b, B * T, C, 1e-5f);
  fsdp_cpu_layernorm_backward(c->dx, c->dw, c->db, c->dy, c->x, c->w, c->mean, c->rstd, B * T,
                              C);
}

typedef struct {
  float *x, *y, *dx, *dy;
  int64_t n;
  int rows, cols;
} ew_ctx;

static void run_gelu(void *p) {
  ew_ctx *c = p;
  fsdp_cpu_gelu_forward(c->y, c->x, c->n);
  fsdp_cpu_gelu_backward(c->dx, c->dy, c->x, c->n);
}

static void run_softmax(void *p) {
  ew_ctx *c = p;
  fsdp_cpu_softmax_forward(c->y, c->x, c->rows, c->cols);
  fsdp_cpu_softmax_backward(c->dx, c->dy, c->y, c->rows, c->cols);
}

typedef struct {
  float *qkv, *out, *att, *dqkv, *dout, *scratch;
} att_ctx;

static void run_attention(void *p) {
  att_ctx *c = p;
  fsdp_cpu_attention_forward(c->out, c->att, c->qkv, B, T, C, NH);
  fsdp_cpu_attention_backward(c->dqkv, c->scratch, c->dout, c->qkv, c->att, B, T, C, NH, false);
}

static void run_attention_fwd(void *p) {
  att_ctx *c = p;
  fsdp_cpu_attention_forward(c->out, c->att, c->qkv, B, T, C, NH);
}

int main(int argc, char **argv) {
  int max_threads = argc > 1 ? atoi(argv[1]) : 2;
  if (max_threads < 1) max_threads = 1;
  const int64_t NT = (int64_t)B * T;

  ln_ctx ln = {buf(NT * C, 4), buf(NT * C, 1), buf(NT * C, 1), buf(NT * C, 1), buf(C, 1),
               buf(C, 1),      buf(C, 1),      buf(C, 1),      buf(NT, 1),     buf(NT, 1)};
  ew_ctx ge = {buf(NT * 4 * C, 6), buf(NT * 4 * C, 1), buf(NT * 4 * C, 1), buf(NT * 4 * C, 1),
               NT * 4 * C, 0, 0};
  ew_ctx sm = {buf((int64_t)B * NH * T * T, 8), buf((int64_t)B * NH * T * T, 1),
               buf((int64_t)B * NH * T * T, 1), buf((int64_t)B * NH * T * T, 1),
               (int64_t)B * NH * T * T, B * NH * T, T};
  att_ctx at = {buf(NT * 3 * C, 2), buf(NT * C, 1), buf((int64_t)B * NH * T * T, 1),
                buf(NT * 3 * C, 1), buf(NT * C, 1), buf((int64_t)B * NH * T * T, 1)};

  printf("bench_kernels: CPU kernels, f32 (best of repeated calls)\n");
  for (int threads = 1; threads <= max_threads; threads++) {
    fsdp_cpu_set_threads(threads);
    printf("\nthreads: %d\n", fsdp_cpu_threads());
    double peak = bench_gemm("sgemm a @ b", run_square, 1024, 1024, 1024);
    bench_gemm("linear (qkv)  inp @ w^T", run_linear, 2048, 256, 768);
    bench_gemm("linear (mlp up)  inp @ w^T", run_linear, 2048, 256, 1024);
    bench_gemm("linear (mlp down)  inp @ w^T", run_linear, 2048, 1024, 256);

    printf("  at B=%d T=%d C=%d NH=%d, forward + backward per call:\n", B, T, C, NH);
    double t = time_call(run_layernorm, &ln);
    printf("    %-30s %8.3f ms\n", "layernorm (B*T, C)", t * 1e3);
    t = time_call(run_gelu, &ge);
    printf("    %-30s %8.3f ms  (%.2f ns/element)\n", "gelu (B*T, 4C)", t * 1e3,
           t * 1e9 / (double)ge.n);
    t = time_call(run_softmax, &sm);
    printf("    %-30s %8.3f ms  (%.2f ns/element)\n", "softmax (B*NH*T, T)", t * 1e3,
           t * 1e9 / (double)sm.n);
    double tf = time_call(run_attention_fwd, &at);
    t = time_call(run_attention, &at);
    /* useful (causal, lower-triangle) flops: forward q@k^T and att@v, backward four products
     * of the same size; the kernel skips most of the upper triangle */
    const double hs = (double)C / NH;
    const double fwd_flops = (double)B * NH * 2.0 * (2.0 * T * (T + 1) / 2.0 * hs);
    printf("    %-30s %8.3f ms  (forward %.3f ms; %.1f GFLOP/s causal = %.0f%% of sgemm)\n",
           "attention", t * 1e3, tf * 1e3, 3.0 * fwd_flops / t * 1e-9,
           100.0 * 3.0 * fwd_flops / t * 1e-9 / peak);
  }
  return 0;
}
