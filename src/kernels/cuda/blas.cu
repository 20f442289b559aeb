/*
 * blas.cu — not yet implemented: every kernel refuses (replaced as the CUDA device lands).
 */
#include "kernels/cuda/cuda.h"

int fsdp_cuda_gemm(void *ctx, fsdp_dtype dt, void *c, const void *a, const void *b, int M, int N,
                   int K, bool trans_a, bool trans_b, float alpha, float beta, int lda, int ldb,
                   int ldc) {
  (void)ctx;
  return fsdp_kernels_refuse("gemm", dt, "cuda");
}

int fsdp_cuda_bmm_forward(void *ctx, fsdp_dtype dt, void *out, const void *a, const void *b,
                          int B, int M, int K, int N) {
  (void)ctx;
  return fsdp_kernels_refuse("bmm_forward", dt, "cuda");
}

int fsdp_cuda_bmm_backward(void *ctx, fsdp_dtype dt, void *da, void *db, const void *dout,
                           const void *a, const void *b, int B, int M, int K, int N) {
  (void)ctx;
  return fsdp_kernels_refuse("bmm_backward", dt, "cuda");
}

int fsdp_cuda_linear_forward(void *ctx, fsdp_dtype dt, void *out, const void *inp,
                             const void *weight, const void *bias, int M, int K, int N) {
  (void)ctx;
  return fsdp_kernels_refuse("linear", dt, "cuda");
}

int fsdp_cuda_linear_backward(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dweight,
                              void *dbias, const void *dout, const void *inp, const void *weight,
                              int M, int K, int N) {
  (void)ctx;
  return fsdp_kernels_refuse("linear", dt, "cuda");
}
