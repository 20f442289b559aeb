/*
 * elementwise.c — binary ops with suffix broadcasting, scalar affine, and embedding lookup.
 *
 * Broadcasting: a (n), b (m), n % m == 0, b repeats n / m times (its shape is a suffix of a's).
 * Forward kernels may run in place with out == a exactly (no restrict on them).
 * Backward kernels accumulate; da and db may be the same buffer (x * x hands both gradients to
 * one tensor), so each is updated in its own pass. Gradients of a broadcast b are summed over
 * the repeats in double, column by column, so that long batch dimensions lose no precision.
 *
 * Work is split over the rank's threads (pool.h) so that each output element is computed by
 * one chunk: element ranges for the maps, columns for the sums over repeats (each column's
 * repeats added in order) and for the embedding's scatter-add, fixed blocks added in block
 * order for a scalar's gradient. No result depends on the thread count. The loops are
 * vec_body.h's at the instruction set isa.h picked.
 */
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

#include <string.h>

typedef struct {
  float *out;            /* out, da or db */
  const float *a, *b, *dout;
  int64_t n, m;
  float s, t;
  fsdp_binop op;
  const fsdp_cpu_vec_i *vec;
  int64_t nb;            /* fixed blocks of a scalar's gradient, and their sums */
  double part[FSDP_CPU_MAX_BLOCKS];
} ew_ctx;

/* the span of b's period that starts at element i, cut at hi */
static inline int64_t period_span(int64_t i, int64_t hi, int64_t m, int64_t *j) {
  *j = i % m;
  return m - *j < hi - i ? m - *j : hi - i;
}

static void binary_task(void *ctx, int64_t lo, int64_t hi) {
  const ew_ctx *c = ctx;
  if (c->m == 1) {
    c->vec->binary_scalar(c->out + lo, c->a + lo, c->b[0], hi - lo, c->op);
    return;
  }
  for (int64_t i = lo, j, len; i < hi; i += len) {
    len = period_span(i, hi, c->m, &j);
    c->vec->binary(c->out + i, c->a + i, c->b + j, len, c->op);
  }
}

void fsdp_cpu_binary_forward(float *out, const float *a, const float *b, int64_t n, int64_t m,
                             fsdp_binop op) {
  // out (n), a (n), b (m)
  if (n <= 0 || m <= 0) return;
  ew_ctx c = {.out = out, .a = a, .b = b, .m = m, .op = op, .vec = fsdp_cpu_vec()};
  fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, binary_task, &c);
}

/* da (n) += dout * d(a op b)/da over elements [lo, hi), with b repeating */
static void backward_a_task(void *ctx, int64_t lo, int64_t hi) {
  const ew_ctx *c = ctx;
  float *da = c->out;
  if (c->op == FSDP_BIN_ADD || c->op == FSDP_BIN_SUB) {
    c->vec->add_acc(da + lo, c->dout + lo, hi - lo);
  } else if (c->m == 1) {
    if (c->op == FSDP_BIN_MUL) c->vec->scale_acc(da + lo, c->dout + lo, c->b[0], hi - lo);
    else c->vec->rdiv_acc(da + lo, c->dout + lo, c->b[0], hi - lo);
  } else {
    for (int64_t i = lo, j, len; i < hi; i += len) {
      len = period_span(i, hi, c->m, &j);
      if (c->op == FSDP_BIN_MUL) c->vec->mul_acc(da + i, c->dout + i, c->b + j, len);
      else c->vec->div_acc(da + i, c->dout + i, c->b + j, len);
    }
  }
}

/* db (m) columns [lo, hi) += sum over repeats */
static void backward_b_task(void *ctx, int64_t lo, int64_t hi) {
  const ew_ctx *c = ctx;
  c->vec->binary_backward_b_cols(c->out, c->dout, c->a, c->b, c->n, c->m, c->op, lo, hi);
}

/* blocks [lo, hi) of a scalar b's gradient: each block's sum in its own slot */
static void backward_b_sum_task(void *ctx, int64_t lo, int64_t hi) {
  ew_ctx *c = ctx;
  for (int64_t k = lo; k < hi; k++) {
    int64_t i0 = c->n * k / c->nb, i1 = c->n * (k + 1) / c->nb;
    c->part[k] = c->vec->binary_backward_b_sum(c->dout + i0, c->a + i0, i1 - i0, c->op);
  }
}

void fsdp_cpu_binary_backward(float *da, float *db, const float *dout, const float *a,
                              const float *b, int64_t n, int64_t m, fsdp_binop op) {
  // da (n), db (m), dout (n), a (n), b (m)
  if (n <= 0 || m <= 0) return;
  ew_ctx c = {.a = a, .b = b, .dout = dout, .n = n, .m = m, .op = op, .vec = fsdp_cpu_vec()};
  if (da) {
    c.out = da;
    fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, backward_a_task, &c);
  }
  if (!db) return;
  c.out = db;
  if (m > 1) {
    int64_t grain = fsdp_cpu_grain_rows(n / m, FSDP_CPU_GRAIN);
    fsdp_cpu_parallel_for(m, grain < 64 ? 64 : grain, backward_b_task, &c);
    return;
  }
  c.nb = fsdp_cpu_blocks(n, 1, FSDP_CPU_GRAIN);
  fsdp_cpu_parallel_for(c.nb, 1, backward_b_sum_task, &c);
  double s = 0.0;
  for (int64_t k = 0; k < c.nb; k++) s += c.part[k];
  switch (op) {
  case FSDP_BIN_ADD: db[0] += (float)s; break;
  case FSDP_BIN_SUB: db[0] -= (float)s; break;
  case FSDP_BIN_MUL: db[0] += (float)s; break;
  case FSDP_BIN_DIV: db[0] -= (float)(s / b[0] / b[0]); break;
  }
}

static void affine_task(void *ctx, int64_t lo, int64_t hi) {
  const ew_ctx *c = ctx;
  c->vec->affine(c->out + lo, c->a + lo, c->s, c->t, hi - lo);
}

void fsdp_cpu_affine_forward(float *out, const float *a, float s, float t, int64_t n) {
  ew_ctx c = {.out = out, .a = a, .s = s, .t = t, .vec = fsdp_cpu_vec()};
  fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, affine_task, &c);
}

static void affine_backward_task(void *ctx, int64_t lo, int64_t hi) {
  const ew_ctx *c = ctx;
  c->vec->scale_acc(c->out + lo, c->dout + lo, c->s, hi - lo);
}

void fsdp_cpu_affine_backward(float *da, const float *dout, float s, int64_t n) {
  ew_ctx c = {.out = da, .dout = dout, .s = s, .vec = fsdp_cpu_vec()};
  fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, affine_backward_task, &c);
}

/* ---- embedding ----------------------------------------------------------------------------- */

typedef struct {
  float *out;
  const float *in;
  const int64_t *ids;
  int64_t N;
  int C;
  const fsdp_cpu_vec_i *vec;
} emb_ctx;

static void embedding_forward_task(void *ctx, int64_t lo, int64_t hi) {
  const emb_ctx *c = ctx;
  for (int64_t i = lo; i < hi; i++)
    memcpy(c->out + i * c->C, c->in + c->ids[i] * c->C, sizeof(float) * (size_t)c->C);
}

void fsdp_cpu_embedding_forward(float *out, const int64_t *ids, const float *weight, int64_t N,
                                int C) {
  // out (N, C), ids (N), weight (V, C)
  emb_ctx c = {.out = out, .in = weight, .ids = ids, .N = N, .C = C};
  fsdp_cpu_parallel_for(N, fsdp_cpu_grain_rows(C, FSDP_CPU_GRAIN), embedding_forward_task, &c);
}

/* columns [lo, hi) of every row, rows in order: a repeated id adds in position order */
static void embedding_backward_task(void *ctx, int64_t lo, int64_t hi) {
  const emb_ctx *c = ctx;
  for (int64_t i = 0; i < c->N; i++)
    c->vec->add_acc(c->out + c->ids[i] * c->C + lo, c->in + i * c->C + lo, hi - lo);
}

void fsdp_cpu_embedding_backward(float *dweight, const float *dout, const int64_t *ids, int64_t N,
                                 int C) {
  // dweight (V, C), dout (N, C), ids (N)
  if (N <= 0) return;
  emb_ctx c = {.out = dweight, .in = dout, .ids = ids, .N = N, .C = C, .vec = fsdp_cpu_vec()};
  int64_t grain = fsdp_cpu_grain_rows(N, FSDP_CPU_GRAIN);
  fsdp_cpu_parallel_for(C, grain < 16 ? 16 : grain, embedding_backward_task, &c);
}
