/*
 * gemm.c — the library behind every cpu GEMM: one product on the calling thread
 * (fsdp_cpu_sgemm_serial). OpenBLAS's cblas_sgemm today.
 */
#include "kernels/cpu/kernels.h"

#include <cblas.h>

void fsdp_cpu_sgemm_serial(float *c, const float *a, const float *b, int M, int N, int K,
                           bool trans_a, bool trans_b, float alpha, float beta, int lda, int ldb,
                           int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
}
