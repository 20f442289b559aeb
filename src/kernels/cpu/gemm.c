/*
 * gemm.c — the library behind every cpu GEMM: one f32 product on the calling thread
 * (fsdp_cpu_sgemm_serial): oneDNN's dnnl_sgemm where the choice (gemm.h) takes it, OpenBLAS's
 * cblas_sgemm otherwise; and what runs the GEMMs here, for fsdp.info() and the benchmarks
 * (fsdp_cpu_gemm_describe). bench/gemm_libs.c measured OpenBLAS, BLIS 0.9 and oneDNN 2.6 at the
 * model's shapes (docs/PERFORMANCE.md, "GEMM libraries").
 */
#include <stdio.h>
#include <string.h>

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

void fsdp_cpu_gemm_describe(char *buf, size_t n) {
  /* openblas_get_config(): "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64" */
  char version[32] = "?", dnnl[32] = "";
  sscanf(openblas_get_config(), "OpenBLAS %31s", version);
  fsdp_cpu_onednn_version(dnnl, sizeof dnnl);
  int len;
  if (fsdp_cpu_sgemm_onednn())
    len = snprintf(buf, n, "f32 onednn %s (avx512_core)", dnnl);
  else
    len = snprintf(buf, n, "f32 openblas %s %s%s", version, openblas_get_corename(),
                   fsdp_cpu_sgemm_preferred() ? " (onednn off)" : "");
  if (len < 0 || (size_t)len >= n) return;
  if (fsdp_cpu_bf16_gemm_native())
    snprintf(buf + len, n - (size_t)len, ", bf16 onednn %s (avx512_bf16)", dnnl);
  else
    snprintf(buf + len, n - (size_t)len, ", bf16 by conversion to f32%s",
             fsdp_cpu_bf16_gemm_supported() ? " (native path off)" : "");
}
