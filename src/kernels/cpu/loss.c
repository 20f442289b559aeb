/*
 * loss.c — cross-entropy (fused log-softmax, integral targets, ignore_index) and mean squared
 * error, forward and backward.
 *
 * Cross-entropy is stable for any logit range: each row's max is subtracted before exp, and
 * the row's log-sum-exp is computed in double and saved, so the backward recomputes
 * softmax = exp(logit - lse) and writes the gradient in the same pass, with no second
 * reduction. Rows are split over the rank's threads (pool.h); the per-row losses are summed in
 * double within fixed blocks of rows and the blocks in order, as are MSE's squares, so the
 * loss does not depend on the thread count. The loops are vec_body.h's (isa.h).
 */
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

typedef struct {
  float *out;
  const float *x, *y, *lse;
  const int64_t *targets;
  int64_t N, ignore_index;
  int V;
  float k;
  const fsdp_cpu_vec_i *vec;
  int64_t nb; /* fixed blocks and their sums */
  double part[FSDP_CPU_MAX_BLOCKS];
  int64_t count[FSDP_CPU_MAX_BLOCKS];
} loss_ctx;

static void ce_forward_task(void *ctx, int64_t lo, int64_t hi) {
  loss_ctx *c = ctx;
  for (int64_t k = lo; k < hi; k++) {
    int64_t r0 = c->N * k / c->nb, r1 = c->N * (k + 1) / c->nb;
    c->count[k] = 0;
    c->part[k] = c->vec->cross_entropy_forward(c->out, c->x, c->targets, r0, r1, c->V,
                                               c->ignore_index, &c->count[k]);
  }
}

float fsdp_cpu_cross_entropy_forward(float *lse, const float *logits, const int64_t *targets,
                                     int64_t N, int V, int64_t ignore_index, int64_t *count) {
  // lse (N), logits (N, V), targets (N)
  loss_ctx c = {.out = lse, .x = logits, .targets = targets, .N = N, .V = V,
                .ignore_index = ignore_index, .vec = fsdp_cpu_vec()};
  c.nb = fsdp_cpu_blocks(N, V, FSDP_CPU_GRAIN_HEAVY);
  fsdp_cpu_parallel_for(c.nb, 1, ce_forward_task, &c);
  double total = 0.0;
  int64_t counted = 0;
  for (int64_t k = 0; k < c.nb; k++) total += c.part[k], counted += c.count[k];
  *count = counted;
  return counted ? (float)(total / (double)counted) : 0.0f;
}

static void ce_backward_task(void *ctx, int64_t lo, int64_t hi) {
  const loss_ctx *c = ctx;
  c->vec->cross_entropy_backward(c->out, c->k, c->x, c->lse, c->targets, lo, hi, c->V,
                                 c->ignore_index);
}

void fsdp_cpu_cross_entropy_backward(float *dlogits, float dloss, const float *logits,
                                     const float *lse, const int64_t *targets, int64_t N, int V,
                                     int64_t ignore_index, int64_t count) {
  // dlogits (N, V), logits (N, V), lse (N), targets (N)
  if (count <= 0) return;
  loss_ctx c = {.out = dlogits, .x = logits, .lse = lse, .targets = targets, .N = N, .V = V,
                .ignore_index = ignore_index, .k = dloss / (float)count, .vec = fsdp_cpu_vec()};
  fsdp_cpu_parallel_for(N, fsdp_cpu_grain_rows(V, FSDP_CPU_GRAIN_HEAVY), ce_backward_task, &c);
}

static void mse_forward_task(void *ctx, int64_t lo, int64_t hi) {
  loss_ctx *c = ctx;
  for (int64_t k = lo; k < hi; k++) {
    int64_t i0 = c->N * k / c->nb, i1 = c->N * (k + 1) / c->nb;
    c->part[k] = c->vec->sqdiff_sum(c->x + i0, c->y + i0, i1 - i0);
  }
}

float fsdp_cpu_mse_forward(const float *a, const float *b, int64_t n) {
  // a (n), b (n)
  if (n <= 0) return 0.0f;
  loss_ctx c = {.x = a, .y = b, .N = n, .vec = fsdp_cpu_vec()};
  c.nb = fsdp_cpu_blocks(n, 1, FSDP_CPU_GRAIN);
  fsdp_cpu_parallel_for(c.nb, 1, mse_forward_task, &c);
  double total = 0.0;
  for (int64_t k = 0; k < c.nb; k++) total += c.part[k];
  return (float)(total / (double)n);
}

static void mse_backward_task(void *ctx, int64_t lo, int64_t hi) {
  const loss_ctx *c = ctx;
  c->vec->diff_acc(c->out + lo, c->x + lo, c->y + lo, c->k, hi - lo);
}

void fsdp_cpu_mse_backward(float *da, float *db, float dloss, const float *a, const float *b,
                           int64_t n) {
  // da (n), db (n), a (n), b (n); da and db may be the same buffer: one pass each
  if (n <= 0) return;
  const float k = 2.0f * dloss / (float)n;
  loss_ctx c = {.x = a, .y = b, .vec = fsdp_cpu_vec()};
  if (da) {
    c.out = da, c.k = k;
    fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, mse_backward_task, &c);
  }
  if (db) { /* db -= k (a - b), as db += (-k) (a - b): the same bits */
    c.out = db, c.k = -k;
    fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, mse_backward_task, &c);
  }
}
