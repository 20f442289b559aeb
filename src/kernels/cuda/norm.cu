/*
 * norm.cu — not yet implemented: every kernel refuses (replaced as the CUDA device lands).
 */
#include "kernels/cuda/cuda.h"

int fsdp_cuda_layernorm_forward(void *ctx, fsdp_dtype dt, void *out, float *mean, float *rstd,
                                const void *inp, const void *weight, const void *bias, int64_t N,
                                int C, float eps) {
  (void)ctx;
  return fsdp_kernels_refuse("layernorm_forward", dt, "cuda");
}

int fsdp_cuda_layernorm_backward(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dinp,
                                 void *dweight, void *dbias, const void *dout, const void *inp,
                                 const void *weight, const float *mean, const float *rstd,
                                 int64_t N, int C) {
  (void)ctx;
  return fsdp_kernels_refuse("layernorm_backward", dt, "cuda");
}

int fsdp_cuda_softmax_forward(void *ctx, fsdp_dtype dt, void *out, const void *inp, int64_t N,
                              int C) {
  (void)ctx;
  return fsdp_kernels_refuse("softmax_forward", dt, "cuda");
}

int fsdp_cuda_softmax_backward(void *ctx, fsdp_dtype dt, void *dinp, const void *dout,
                               const void *out, int64_t N, int C) {
  (void)ctx;
  return fsdp_kernels_refuse("softmax_backward", dt, "cuda");
}
