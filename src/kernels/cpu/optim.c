/*
 * optim.c — in-place optimizer updates over flat buffers (a unit's shard, or one parameter).
 *
 * PyTorch semantics, including the order of operations, so that a recipe tuned there behaves
 * the same here: torch.optim.SGD (dampening 0, no nesterov) and torch.optim.AdamW
 * (non-amsgrad, single-tensor path). Bias corrections are computed once per call in double.
 */
#include "kernels/cpu/kernels.h"

#include <math.h>

void fsdp_cpu_sgd_step(float *param, float *buf, const float *grad, int64_t n, float lr,
                       float momentum, float weight_decay, bool first_step) {
  // param (n), buf (n) or NULL when momentum == 0, grad (n)
  float *restrict p = param;
  const float *restrict g = grad;
  if (momentum == 0.0f || !buf) {
    for (int64_t i = 0; i < n; i++) p[i] -= lr * (g[i] + weight_decay * p[i]);
    return;
  }
  float *restrict m = buf;
  if (first_step) {
    for (int64_t i = 0; i < n; i++) {
      m[i] = g[i] + weight_decay * p[i];
      p[i] -= lr * m[i];
    }
  } else {
    for (int64_t i = 0; i < n; i++) {
      m[i] = momentum * m[i] + (g[i] + weight_decay * p[i]);
      p[i] -= lr * m[i];
    }
  }
}

void fsdp_cpu_adamw_step(float *param, float *m, float *v, const float *grad, int64_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay,
                         int64_t step) {
  // param (n), m (n), v (n), grad (n); step >= 1
  float *restrict p = param, *restrict mm = m, *restrict vv = v;
  const float *restrict g = grad;
  const double bc1 = 1.0 - pow((double)beta1, (double)step);
  const double bc2 = 1.0 - pow((double)beta2, (double)step);
  const float step_size = (float)(lr / bc1);
  const float bc2_sqrt = (float)sqrt(bc2);
  const float decay = 1.0f - lr * weight_decay;
  for (int64_t i = 0; i < n; i++) {
    p[i] *= decay;
    mm[i] = beta1 * mm[i] + (1.0f - beta1) * g[i];
    vv[i] = beta2 * vv[i] + (1.0f - beta2) * g[i] * g[i];
    const float denom = sqrtf(vv[i]) / bc2_sqrt + eps;
    p[i] -= step_size * (mm[i] / denom);
  }
}
