/*
 * attention.cu — not yet implemented: every kernel refuses (replaced as the CUDA device lands).
 */
#include "kernels/cuda/cuda.h"

int64_t fsdp_cuda_attention_saved(void *ctx, fsdp_dtype dt, int B, int T, int C, int NH,
                                  fsdp_dtype *saved_dt) {
  (void)ctx, (void)B, (void)T, (void)C, (void)NH;
  *saved_dt = dt;
  return 0;
}

int fsdp_cuda_attention_forward(void *ctx, fsdp_dtype dt, void *out, void *att, const void *qkv,
                                int B, int T, int C, int NH) {
  (void)ctx;
  return fsdp_kernels_refuse("attention_forward", dt, "cuda");
}

int fsdp_cuda_attention_backward(void *ctx, fsdp_dtype dt, void *dqkv, const void *dout,
                                 const void *qkv, const void *att, int B, int T, int C, int NH) {
  (void)ctx;
  return fsdp_kernels_refuse("attention_backward", dt, "cuda");
}
