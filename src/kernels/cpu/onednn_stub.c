/*
 * onednn_stub.c — gemm.h's oneDNN functions in a build without oneDNN (libdnnl-dev): bf16 GEMMs
 * take the conversion pass.
 */
#include "kernels/cpu/gemm.h"

bool fsdp_cpu_onednn_version(char *buf, size_t n) {
  if (n) buf[0] = '\0';
  return false;
}

bool fsdp_cpu_onednn_bf16(void) { return false; }

bool fsdp_cpu_onednn_avx512(void) { return false; }

int fsdp_cpu_onednn_sgemm(float *c, const float *a, const float *b, int M, int N, int K,
                          bool trans_a, bool trans_b, float alpha, float beta, int lda, int ldb,
                          int ldc) {
  return fsdp_error("onednn: not built in (install libdnnl-dev and rebuild)");
}

int fsdp_cpu_mm_plan(fsdp_cpu_mm **out, size_t *scratch, const fsdp_cpu_mm_shape *s) {
  return fsdp_error("onednn: not built in (install libdnnl-dev and rebuild)");
}

int fsdp_cpu_mm_run(const fsdp_cpu_mm *p, void *c, const void *a, const void *b,
                    const void *bias, void *scratch) {
  return fsdp_error("onednn: not built in (install libdnnl-dev and rebuild)");
}

const char *fsdp_cpu_mm_impl(const fsdp_cpu_mm *p) { return "none"; }
