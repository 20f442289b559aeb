/*
 * gemm.c — the library behind every cpu GEMM: one f32 product on the calling thread
 * (fsdp_cpu_sgemm_serial), OpenBLAS's cblas_sgemm; and what runs the GEMMs here, for fsdp.info()
 * and the benchmarks (fsdp_cpu_gemm_describe). bench/gemm_libs.c measured BLIS 0.9 and oneDNN
 * 2.6 against it (docs/PERFORMANCE.md, "Choosing the GEMM library").
 */
#include <stdio.h>
#include <string.h>

#include <cblas.h>

#include "kernels/cpu/gemm.h"

void fsdp_cpu_sgemm_serial(float *c, const float *a, const float *b, int M, int N, int K,
                           bool trans_a, bool trans_b, float alpha, float beta, int lda, int ldb,
                           int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
}

void fsdp_cpu_gemm_describe(char *buf, size_t n) {
  /* openblas_get_config(): "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Cooperlake MAX_THREADS=64" */
  char version[32] = "?", dnnl[32];
  sscanf(openblas_get_config(), "OpenBLAS %31s", version);
  int len = snprintf(buf, n, "openblas %s %s (f32)", version, openblas_get_corename());
  if (len < 0 || (size_t)len >= n) return;
  if (fsdp_cpu_bf16_gemm_native()) {
    fsdp_cpu_onednn_version(dnnl, sizeof dnnl);
    snprintf(buf + len, n - (size_t)len, ", onednn %s (bf16, avx512_bf16)", dnnl);
  } else {
    snprintf(buf + len, n - (size_t)len, ", bf16 by conversion to f32%s",
             fsdp_cpu_bf16_gemm_supported() ? " (native path off)" : "");
  }
}
