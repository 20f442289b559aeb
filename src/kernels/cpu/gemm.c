/*
 * gemm.c — the library behind every cpu GEMM: one f32 product on the calling thread
 * (fsdp_cpu_sgemm_serial): oneDNN's dnnl_sgemm where the choice (gemm.h) takes it, OpenBLAS's
 * cblas_sgemm otherwise (docs/PERFORMANCE.md, "GEMM libraries").
 */
#include <cblas.h>

#include "kernels/cpu/gemm.h"

void fsdp_cpu_sgemm_serial(float *c, const float *a, const float *b, int M, int N, int K,
                           bool trans_a, bool trans_b, float alpha, float beta, int lda, int ldb,
                           int ldc) {
  /* oneDNN refuses only what cblas_sgemm would too: let OpenBLAS report it */
  if (fsdp_cpu_sgemm_onednn() &&
      fsdp_cpu_onednn_sgemm(c, a, b, M, N, K, trans_a, trans_b, alpha, beta, lda, ldb, ldc) ==
          FSDP_OK)
    return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
}
