/*
 * optim.c — in-place optimizer updates over flat buffers (a unit's shard, or one parameter).
 *
 * PyTorch semantics, including the order of operations, so that a recipe tuned there behaves
 * the same here: torch.optim.SGD (dampening 0, no nesterov) and torch.optim.AdamW
 * (non-amsgrad, single-tensor path). Bias corrections are computed once per call in double.
 *
 * Threads: every element's update depends on that element alone, so the buffers are cut into
 * chunks over the pool (whole cache lines each, OPTIM_GRAIN elements at least) and the bits
 * are the same at any thread count. AdamW runs vec_body.h's loop at the instruction set isa.h picked, over the rank's threads.
 */
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

#include <math.h>

/* Elements a chunk must hold: ~10 us of a memory-bound update, well above a dispatch. */
#define OPTIM_GRAIN 16384

typedef struct sgd_job {
  float *param, *buf;
  const float *grad;
  float lr, momentum, weight_decay;
  bool first_step;
} sgd_job;

static void sgd_chunk(void *ctx, int64_t lo, int64_t hi) {
  const sgd_job *j = ctx;
  float *restrict p = j->param;
  const float *restrict g = j->grad;
  const float lr = j->lr, momentum = j->momentum, weight_decay = j->weight_decay;
  if (momentum == 0.0f || !j->buf) {
    for (int64_t i = lo; i < hi; i++) p[i] -= lr * (g[i] + weight_decay * p[i]);
    return;
  }
  float *restrict m = j->buf;
  if (j->first_step) {
    for (int64_t i = lo; i < hi; i++) {
      m[i] = g[i] + weight_decay * p[i];
      p[i] -= lr * m[i];
    }
  } else {
    for (int64_t i = lo; i < hi; i++) {
      m[i] = momentum * m[i] + (g[i] + weight_decay * p[i]);
      p[i] -= lr * m[i];
    }
  }
}

void fsdp_cpu_sgd_step(float *param, float *buf, const float *grad, int64_t n, float lr,
                       float momentum, float weight_decay, bool first_step) {
  // param (n), buf (n) or NULL when momentum == 0, grad (n)
  sgd_job j = {param, buf, grad, lr, momentum, weight_decay, first_step};
  fsdp_cpu_parallel_for(n, OPTIM_GRAIN, sgd_chunk, &j);
}

typedef struct {
  float *p, *m, *v, *g;
  const float *mask;
  float beta1, beta2, eps, decay, step_size, bc2_sqrt, gscale;
  const fsdp_cpu_vec_i *vec;
} adamw_ctx;

static void adamw_task(void *ctx, int64_t lo, int64_t hi) {
  const adamw_ctx *c = ctx;
  if (c->mask)
    c->vec->adamw_masked(c->p + lo, c->m + lo, c->v + lo, c->g + lo, c->mask + lo, hi - lo,
                         c->beta1, c->beta2, c->eps, c->decay, c->step_size, c->bc2_sqrt,
                         c->gscale);
  else
    c->vec->adamw(c->p + lo, c->m + lo, c->v + lo, c->g + lo, hi - lo, c->beta1, c->beta2,
                  c->eps, c->decay, c->step_size, c->bc2_sqrt, c->gscale);
}

static void adamw_run(float *param, float *m, float *v, float *grad, const float *mask,
                      int64_t n, float lr, float beta1, float beta2, float eps,
                      float weight_decay, float gscale, int64_t step) {
  const double bc1 = 1.0 - pow((double)beta1, (double)step);
  const double bc2 = 1.0 - pow((double)beta2, (double)step);
  adamw_ctx c = {.p = param, .m = m, .v = v, .g = grad, .mask = mask, .beta1 = beta1,
                 .beta2 = beta2, .eps = eps, .decay = 1.0f - lr * weight_decay,
                 .step_size = (float)(lr / bc1), .bc2_sqrt = (float)sqrt(bc2),
                 .gscale = gscale, .vec = fsdp_cpu_vec()};
  fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, adamw_task, &c);
}

void fsdp_cpu_adamw_step(float *param, float *m, float *v, const float *grad, int64_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay,
                         float gscale, int64_t step) {
  // param (n), m (n), v (n), grad (n); step >= 1
  adamw_run(param, m, v, (float *)grad, NULL, n, lr, beta1, beta2, eps, weight_decay, gscale,
            step);
}

void fsdp_cpu_adamw_step_masked(float *param, float *m, float *v, float *grad, const float *mask,
                                int64_t n, float lr, float beta1, float beta2, float eps,
                                float weight_decay, float gscale, int64_t step) {
  // param (n), m (n), v (n), grad (n), mask (n); step >= 1
  adamw_run(param, m, v, grad, mask, n, lr, beta1, beta2, eps, weight_decay, gscale, step);
}
