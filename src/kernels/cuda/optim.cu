/*
 * optim.cu — the optimizer updates on the cuda device: SGD (momentum, weight decay) and AdamW,
 * one fused launch over a flat f32 shard, in place. The operations and their order are the
 * cpu's (src/kernels/cpu/optim.c, PyTorch's single-tensor path), uncontracted (exact.h), and
 * the bias corrections are computed on the host in double exactly as the cpu computes them, so
 * a step gives the cpu's bits.
 */
#include <math.h>

#include "kernels/cuda/common.cuh"

using namespace fsdp_cu;

__global__ void sgd_plain_k(float *p, const float *g, int64_t n, float lr, float wd) {
  FSDP_CU_LOOP(i, n) p[i] = XF_SUB(p[i], XF_MUL(lr, XF_ADD(g[i], XF_MUL(wd, p[i]))));
}

__global__ void sgd_momentum_k(float *p, float *m, const float *g, int64_t n, float lr,
                               float momentum, float wd, bool first_step) {
  FSDP_CU_LOOP(i, n) {
    const float d = XF_ADD(g[i], XF_MUL(wd, p[i]));
    const float b = first_step ? d : XF_ADD(XF_MUL(momentum, m[i]), d);
    m[i] = b;
    p[i] = XF_SUB(p[i], XF_MUL(lr, b));
  }
}

int fsdp_cuda_sgd_step(void *ctx, fsdp_dtype dt, void *param, void *buf, const void *grad,
                       int64_t n, float lr, float momentum, float weight_decay, bool first_step) {
  // param (n), buf (n) or NULL when momentum == 0, grad (n)
  if (dt != FSDP_DTYPE_F32) return FSDP_CU_REFUSE("sgd_step", dt);
  if (n <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  if (momentum == 0.0f || !buf)
    sgd_plain_k<<<blocks_for(n), THREADS, 0, s>>>((float *)param, (const float *)grad, n, lr,
                                                  weight_decay);
  else
    sgd_momentum_k<<<blocks_for(n), THREADS, 0, s>>>((float *)param, (float *)buf,
                                                     (const float *)grad, n, lr, momentum,
                                                     weight_decay, first_step);
  return fsdp_cuda_launched("sgd_step");
}

__global__ void adamw_k(float *p, float *m, float *v, const float *g, int64_t n, float beta1,
                        float beta2, float eps, float decay, float step_size, float bc2_sqrt,
                        float gscale) {
  const float c1 = XF_SUB(1.0f, beta1), c2 = XF_SUB(1.0f, beta2);
  FSDP_CU_LOOP(i, n) {
    const float gi = XF_MUL(g[i], gscale); /* clipping's coefficient: g itself is not written */
    const float pi = XF_MUL(p[i], decay);
    const float mi = XF_ADD(XF_MUL(beta1, m[i]), XF_MUL(c1, gi));
    const float vi = XF_ADD(XF_MUL(beta2, v[i]), XF_MUL(XF_MUL(c2, gi), gi));
    const float denom = XF_ADD(XF_DIV(XF_SQRT(vi), bc2_sqrt), eps);
    m[i] = mi;
    v[i] = vi;
    p[i] = XF_SUB(pi, XF_MUL(step_size, XF_DIV(mi, denom)));
  }
}

int fsdp_cuda_adamw_step(void *ctx, fsdp_dtype dt, void *param, void *m, void *v,
                         const void *grad, int64_t n, float lr, float beta1, float beta2,
                         float eps, float weight_decay, float grad_scale, int64_t step) {
  // param (n), m (n), v (n), grad (n); step >= 1
  if (dt != FSDP_DTYPE_F32) return FSDP_CU_REFUSE("adamw_step", dt);
  if (n <= 0) return FSDP_OK;
  const double bc1 = 1.0 - pow((double)beta1, (double)step);
  const double bc2 = 1.0 - pow((double)beta2, (double)step);
  const float step_size = (float)(lr / bc1);
  const float bc2_sqrt = (float)sqrt(bc2);
  volatile float lr_wd = lr * weight_decay; /* never fused into 1 - lr wd: the cpu rounds it */
  const float decay = 1.0f - lr_wd;
  adamw_k<<<blocks_for(n), THREADS, 0, fsdp_cuda_stream()>>>(
      (float *)param, (float *)m, (float *)v, (const float *)grad, n, beta1, beta2, eps, decay,
      step_size, bc2_sqrt, grad_scale);
  return fsdp_cuda_launched("adamw_step");
}
