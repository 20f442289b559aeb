/*
 * embed.cu — not yet implemented: every kernel refuses (replaced as the CUDA device lands).
 */
#include "kernels/cuda/cuda.h"

int fsdp_cuda_embedding_forward(void *ctx, fsdp_dtype dt, void *out, const void *ids,
                                fsdp_dtype idt, const void *weight, int64_t N, int C) {
  (void)ctx;
  return fsdp_kernels_refuse("embedding_forward", dt, "cuda");
}

int fsdp_cuda_embedding_backward(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dweight,
                                 const void *dout, const void *ids, fsdp_dtype idt, int64_t N,
                                 int C) {
  (void)ctx;
  return fsdp_kernels_refuse("embedding_backward", dt, "cuda");
}
