/*
 * blas.c — GEMM and the ops built directly on it (linear, batched matmul), plus the OpenBLAS
 * thread-count knob.
 *
 * Every matrix product goes through cblas_sgemm with explicit strides: callers (and the
 * attention kernel) pass views into bigger buffers without copying. Backward passes use
 * beta = 1 so that gradients accumulate (+=) as kernels.h requires.
 */
#include "kernels/cpu/kernels.h"

#include <cblas.h>
#include <string.h>

void fsdp_cpu_gemm(float *c, const float *a, const float *b, int M, int N, int K, bool trans_a,
                   bool trans_b, float alpha, float beta, int lda, int ldb, int ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    /* sgemm with K == 0 is legal BLAS but some builds reject lda < 1: do the beta part here. */
    for (int i = 0; i < M; i++) {
      float *row = c + (int64_t)i * ldc;
      for (int j = 0; j < N; j++) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
    }
    return;
  }
  fsdp_cpu_sgemm_serial(c, a, b, M, N, K, trans_a, trans_b, alpha, beta, lda, ldb, ldc);
}

/* OpenBLAS keeps one process-wide thread count: with ranks as threads of one process the
 * launcher sets it once (max(1, cores / ranks)) rather than each rank fighting over it. */
void fsdp_cpu_set_blas_threads(int n) { openblas_set_num_threads(n < 1 ? 1 : n); }

int fsdp_cpu_get_blas_threads(void) { return openblas_get_num_threads(); }

/* ---- linear ------------------------------------------------------------------------------- */

void fsdp_cpu_linear_forward(float *out, const float *inp, const float *weight,
                             const float *bias, int M, int K, int N) {
  // out (M, N), inp (M, K), weight (N, K), bias (N) or NULL
  if (bias) {
    /* Seed every row with the bias and let sgemm add into it (beta = 1): one pass over out. */
    for (int m = 0; m < M; m++) memcpy(out + (int64_t)m * N, bias, sizeof(float) * (size_t)N);
  }
  fsdp_cpu_gemm(out, inp, weight, M, N, K, false, true, 1.0f, bias ? 1.0f : 0.0f, K, K, N);
}

void fsdp_cpu_linear_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                              const float *inp, const float *weight, int M, int K, int N) {
  // dinp (M, K), dweight (N, K), dbias (N), dout (M, N), inp (M, K), weight (N, K)
  if (dinp) fsdp_cpu_gemm(dinp, dout, weight, M, K, N, false, false, 1.0f, 1.0f, N, K, K);
  if (dweight) fsdp_cpu_gemm(dweight, dout, inp, N, K, M, true, false, 1.0f, 1.0f, N, K, K);
  if (dbias) fsdp_cpu_colsum_acc(dbias, dout, M, N);
}

/* ---- batched matmul ----------------------------------------------------------------------- */

void fsdp_cpu_bmm_forward(float *out, const float *a, const float *b, int B, int M, int K,
                          int N) {
  // out (B, M, N), a (B, M, K), b (B, K, N)
  for (int i = 0; i < B; i++) {
    fsdp_cpu_gemm(out + (int64_t)i * M * N, a + (int64_t)i * M * K, b + (int64_t)i * K * N, M,
                  N, K, false, false, 1.0f, 0.0f, K, N, N);
  }
}

void fsdp_cpu_bmm_backward(float *da, float *db, const float *dout, const float *a,
                           const float *b, int B, int M, int K, int N) {
  // da (B, M, K), db (B, K, N), dout (B, M, N), a (B, M, K), b (B, K, N)
  for (int i = 0; i < B; i++) {
    const float *dout_i = dout + (int64_t)i * M * N;
    if (da) {
      fsdp_cpu_gemm(da + (int64_t)i * M * K, dout_i, b + (int64_t)i * K * N, M, K, N, false,
                    true, 1.0f, 1.0f, N, N, K);
    }
    if (db) {
      fsdp_cpu_gemm(db + (int64_t)i * K * N, a + (int64_t)i * M * K, dout_i, K, N, M, true,
                    false, 1.0f, 1.0f, K, N, N);
    }
  }
}
