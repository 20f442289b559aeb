/*
 * optim.cu — not yet implemented: every kernel refuses (replaced as the CUDA device lands).
 */
#include "kernels/cuda/cuda.h"

int fsdp_cuda_sgd_step(void *ctx, fsdp_dtype dt, void *param, void *buf, const void *grad,
                       int64_t n, float lr, float momentum, float weight_decay, bool first_step) {
  (void)ctx;
  return fsdp_kernels_refuse("sgd_step", dt, "cuda");
}

int fsdp_cuda_adamw_step(void *ctx, fsdp_dtype dt, void *param, void *m, void *v,
                         const void *grad, int64_t n, float lr, float beta1, float beta2,
                         float eps, float weight_decay, int64_t step) {
  (void)ctx;
  return fsdp_kernels_refuse("adamw_step", dt, "cuda");
}
