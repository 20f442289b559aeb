/*
 * blas.c — GEMM and the ops built directly on it (linear, batched matmul), split over the
 * rank's threads (pool.h), plus the OpenBLAS thread-count knob and the benchmarks' reference
 * rate (fsdp_cpu_sgemm_gflops).
 *
 * Every matrix product goes through fsdp_cpu_gemm with explicit strides: callers (and the
 * attention kernel) pass views into bigger buffers without copying. Backward passes use
 * beta = 1 so that gradients accumulate (+=) as kernels.h requires.
 *
 * Threads: OpenBLAS runs single-threaded on whichever thread calls it (pinned to 1 thread on
 * the first GEMM); fsdp_cpu_gemm cuts the output into blocks of whole rows or whole columns,
 * whichever balances better over the pool's threads, and each block is one
 * fsdp_cpu_sgemm_serial call, so every output element is computed by exactly one call. The cut
 * depends only on the shape and the thread count: a fixed thread count gives fixed bits. A
 * product too small to pay for waking a thread (GEMM_MIN_CHUNK multiply-adds a block) runs on
 * the calling thread, as does every GEMM called from inside a pool task.
 */
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

#include <cblas.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Multiply-adds a block must carry before a product is split: ~5 us of sgemm at ~100 GFLOP/s
 * per core, several times a pool dispatch (docs/PERFORMANCE.md, "The rank's thread pool"). */
#define GEMM_MIN_CHUNK ((int64_t)1 << 18)
/* Blocks are whole multiples of this many rows or columns (OpenBLAS's f32 micro-tiles are
 * 16 x 4 on AVX-512 and 8 x 4 or 16 x 2 elsewhere), except the last: a grain that is a
 * multiple of 16 makes pool.h cut so. */
#define GEMM_ALIGN 16
/* Rows from which a linear forward's bias goes into a oneDNN matmul's epilogue */
#define SGEMM_BIAS_ROWS 128

/* ---- OpenBLAS threads ------------------------------------------------------------------------ */

static atomic_bool blas_set_explicitly;
static pthread_once_t blas_pin_once = PTHREAD_ONCE_INIT;

static void blas_pin(void) {
  if (!atomic_load(&blas_set_explicitly)) openblas_set_num_threads(1);
}

/* OpenBLAS keeps one process-wide thread count; the pool is the parallelism, so it stays at 1
 * unless a caller (a benchmark, an experiment) sets it. */
void fsdp_cpu_set_blas_threads(int n) {
  atomic_store(&blas_set_explicitly, true);
  openblas_set_num_threads(n < 1 ? 1 : n);
}

/* What the next GEMM's OpenBLAS calls use: pinned first if nothing set it, so a caller that
 * saves and restores the count restores the pinned 1, not OpenBLAS's load-time default. */
int fsdp_cpu_get_blas_threads(void) {
  pthread_once(&blas_pin_once, blas_pin);
  return openblas_get_num_threads();
}

/* ---- gemm ------------------------------------------------------------------------------------ */

typedef struct gemm_job {
  float *c;
  const float *a, *b;
  const float *bias; /* (N) or NULL: seed each block's rows with it first (linear forward) */
  int M, N, K, lda, ldb, ldc;
  bool ta, tb, by_cols;
  float alpha, beta;
} gemm_job;

static void gemm_block(void *ctx, int64_t lo, int64_t hi) {
  const gemm_job *j = ctx;
  const int n = (int)(hi - lo);
  float *c = j->by_cols ? j->c + lo : j->c + lo * j->ldc;
  const int M = j->by_cols ? j->M : n, N = j->by_cols ? n : j->N;
  if (j->bias) {
    const float *bias = j->by_cols ? j->bias + lo : j->bias;
    for (int m = 0; m < M; m++) memcpy(c + (int64_t)m * j->ldc, bias, sizeof(float) * (size_t)N);
  }
  const float *a = j->a, *b = j->b;
  if (j->by_cols)
    b = j->tb ? b + lo * j->ldb : b + lo; /* columns lo.. of op(b) */
  else
    a = j->ta ? a + lo : a + lo * j->lda; /* rows lo.. of op(a) */
  fsdp_cpu_sgemm_serial(c, a, b, M, N, j->K, j->ta, j->tb, j->alpha, j->beta, j->lda, j->ldb,
                        j->ldc);
}

/* Rows or columns to cut a (M, N, K) product along, and the least a block may hold; 0 when the
 * product stays whole. The dimension whose blocks keep the threads busiest wins (rows on a
 * tie: a row block is contiguous in c). */
static int64_t gemm_plan(int M, int N, int K, bool *by_cols) {
  const int threads = fsdp_cpu_threads();
  *by_cols = false;
  if (threads < 2 || (int64_t)M * N * K < 2 * GEMM_MIN_CHUNK) return 0;
  double best = 0.0;
  int64_t best_grain = 0;
  for (int d = 0; d < 2; d++) {
    const int64_t len = d == 0 ? M : N, other = (int64_t)(d == 0 ? N : M) * K;
    /* at least GEMM_MIN_CHUNK multiply-adds, in whole GEMM_ALIGN units */
    int64_t grain = (GEMM_MIN_CHUNK + other - 1) / other;
    grain = (grain + GEMM_ALIGN - 1) / GEMM_ALIGN * GEMM_ALIGN;
    const int nch = fsdp_cpu_chunks(len, grain);
    if (nch < 2) continue;
    int64_t biggest = 0;
    for (int i = 0; i < nch; i++) {
      int64_t lo, hi;
      fsdp_cpu_chunk_bounds(len, grain, nch, i, &lo, &hi);
      if (hi - lo > biggest) biggest = hi - lo;
    }
    const double use = (double)len / ((double)threads * (double)biggest);
    if (use > best + 1e-9) {
      best = use;
      best_grain = grain;
      *by_cols = d == 1;
    }
  }
  return best_grain;
}

static void gemm_run(float *c, const float *a, const float *b, const float *bias, int M, int N,
                     int K, bool ta, bool tb, float alpha, float beta, int lda, int ldb,
                     int ldc) {
  if (M <= 0 || N <= 0) return;
  pthread_once(&blas_pin_once, blas_pin);
  if (K <= 0) {
    /* sgemm with K == 0 is legal BLAS but some builds reject lda < 1: do the beta part here. */
    for (int i = 0; i < M; i++) {
      float *row = c + (int64_t)i * ldc;
      if (bias) memcpy(row, bias, sizeof(float) * (size_t)N);
      for (int j = 0; j < N; j++) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
    }
    return;
  }
  gemm_job j = {c, a, b, bias, M, N, K, lda, ldb, ldc, ta, tb, false, alpha, beta};
  const int64_t grain = gemm_plan(M, N, K, &j.by_cols);
  if (grain == 0)
    gemm_block(&j, 0, M);
  else
    fsdp_cpu_parallel_for(j.by_cols ? N : M, grain, gemm_block, &j);
}

void fsdp_cpu_gemm(float *c, const float *a, const float *b, int M, int N, int K, bool trans_a,
                   bool trans_b, float alpha, float beta, int lda, int ldb, int ldc) {
  gemm_run(c, a, b, NULL, M, N, K, trans_a, trans_b, alpha, beta, lda, ldb, ldc);
}

/* ---- the reference rate ------------------------------------------------------------------- */

static double seconds_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int fsdp_cpu_sgemm_gflops(int M, int N, int K, double seconds, double *gflops) {
  *gflops = 0.0;
  if (M < 1 || N < 1 || K < 1)
    return fsdp_error("sgemm_gflops: sizes must be positive (got %d x %d x %d)", M, N, K);
  if (!(seconds > 0.0))
    return fsdp_error("sgemm_gflops: seconds must be positive (got %g)", seconds);
  float *a = calloc((size_t)M * K, sizeof(float)), *b = calloc((size_t)K * N, sizeof(float)),
        *c = calloc((size_t)M * N, sizeof(float));
  if (!a || !b || !c) {
    free(a), free(b), free(c);
    return fsdp_error("sgemm_gflops: out of memory for %d x %d x %d", M, N, K);
  }
  for (size_t i = 0; i < (size_t)M * K; i++) a[i] = (float)(i % 7) * 0.1f;
  for (size_t i = 0; i < (size_t)K * N; i++) b[i] = (float)(i % 5) * 0.1f;
  fsdp_cpu_gemm(c, a, b, M, N, K, false, true, 1.0f, 0.0f, K, K, N);
  for (int w = 0; w < FSDP_CPU_SGEMM_WINDOWS; w++) {
    int64_t calls = 0;
    const double t0 = seconds_now();
    double t;
    do {
      fsdp_cpu_gemm(c, a, b, M, N, K, false, true, 1.0f, 0.0f, K, K, N);
      calls++;
      t = seconds_now() - t0;
    } while (t < seconds / FSDP_CPU_SGEMM_WINDOWS);
    const double rate = 2.0 * M * N * K * (double)calls / t / 1e9;
    if (rate > *gflops) *gflops = rate;
  }
  free(a), free(b), free(c);
  return FSDP_OK;
}

/* ---- linear ------------------------------------------------------------------------------- */

void fsdp_cpu_linear_forward(float *out, const float *inp, const float *weight,
                             const float *bias, int M, int K, int N) {
  // out (M, N), inp (M, K), weight (N, K), bias (N) or NULL
  /* With oneDNN, a bias goes into the matmul's epilogue (gemm.h, fsdp_cpu_sgemm_bias; from
   * SGEMM_BIAS_ROWS rows: fewer rows are sampling's shapes, which change call to call and would
   * each plan a primitive). Otherwise each block seeds its rows with the bias and lets sgemm add
   * into them (beta = 1): one more pass over out. A failed matmul leaves the second way. */
  if (bias && M >= SGEMM_BIAS_ROWS && fsdp_cpu_sgemm_onednn() &&
      fsdp_cpu_sgemm_bias(out, inp, weight, bias, M, N, K, K, K, N) == FSDP_OK)
    return;
  gemm_run(out, inp, weight, bias, M, N, K, false, true, 1.0f, bias ? 1.0f : 0.0f, K, K, N);
}

void fsdp_cpu_linear_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                              const float *inp, const float *weight, int M, int K, int N) {
  // dinp (M, K), dweight (N, K), dbias (N), dout (M, N), inp (M, K), weight (N, K)
  if (dinp) fsdp_cpu_gemm(dinp, dout, weight, M, K, N, false, false, 1.0f, 1.0f, N, K, K);
  if (dweight) fsdp_cpu_gemm(dweight, dout, inp, N, K, M, true, false, 1.0f, 1.0f, N, K, K);
  if (dbias) fsdp_cpu_colsum_acc(dbias, dout, M, N);
}

/* ---- batched matmul ----------------------------------------------------------------------- */

/* Batches go to threads whole (each product on one thread) when there are enough of them to
 * share evenly or the products are too small to split; otherwise each product is split. */
static bool bmm_by_batch(int B, int M, int N, int K) {
  const int threads = fsdp_cpu_threads();
  if (threads < 2 || B < 2) return false;
  if (B % threads == 0 || B >= 4 * threads) return true;
  return (int64_t)M * N * K < 2 * GEMM_MIN_CHUNK * threads;
}

typedef struct bmm_job {
  float *out, *da, *db;
  const float *a, *b, *dout;
  int M, K, N;
} bmm_job;

static void bmm_forward_task(void *ctx, int64_t lo, int64_t hi) {
  const bmm_job *j = ctx;
  const int M = j->M, K = j->K, N = j->N;
  for (int64_t i = lo; i < hi; i++)
    fsdp_cpu_gemm(j->out + i * M * N, j->a + i * M * K, j->b + i * K * N, M, N, K, false, false,
                  1.0f, 0.0f, K, N, N);
}

static void bmm_backward_task(void *ctx, int64_t lo, int64_t hi) {
  const bmm_job *j = ctx;
  const int M = j->M, K = j->K, N = j->N;
  for (int64_t i = lo; i < hi; i++) {
    const float *dout_i = j->dout + i * M * N;
    if (j->da)
      fsdp_cpu_gemm(j->da + i * M * K, dout_i, j->b + i * K * N, M, K, N, false, true, 1.0f,
                    1.0f, N, N, K);
    if (j->db)
      fsdp_cpu_gemm(j->db + i * K * N, j->a + i * M * K, dout_i, K, N, M, true, false, 1.0f,
                    1.0f, K, N, N);
  }
}

void fsdp_cpu_bmm_forward(float *out, const float *a, const float *b, int B, int M, int K,
                          int N) {
  // out (B, M, N), a (B, M, K), b (B, K, N)
  bmm_job j = {.out = out, .a = a, .b = b, .M = M, .K = K, .N = N};
  if (bmm_by_batch(B, M, N, K))
    fsdp_cpu_parallel_for(B, 1, bmm_forward_task, &j);
  else
    bmm_forward_task(&j, 0, B);
}

void fsdp_cpu_bmm_backward(float *da, float *db, const float *dout, const float *a,
                           const float *b, int B, int M, int K, int N) {
  // da (B, M, K), db (B, K, N), dout (B, M, N), a (B, M, K), b (B, K, N)
  bmm_job j = {.da = da, .db = db, .dout = dout, .a = a, .b = b, .M = M, .K = K, .N = N};
  if (bmm_by_batch(B, M, N, K))
    fsdp_cpu_parallel_for(B, 1, bmm_backward_task, &j);
  else
    bmm_backward_task(&j, 0, B);
}
