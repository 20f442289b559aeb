/*
 * norm.c — layer normalisation and row softmax, forward and backward.
 *
 * Rows are independent and split over the rank's threads (pool.h); the loops are vec_body.h's
 * at the instruction set isa.h picked: row reductions in vmath.h's fixed 16-lane order (float
 * lanes, blocks in double), element-wise parts on the same vectors. Layernorm computes the
 * variance from centred values (two passes over a row that is in cache) rather than
 * E[x^2] - E[x]^2, which cancels catastrophically for large means: one read of the row from
 * memory either way.
 *
 * Layernorm's backward adds each row into dweight and dbias (float, rows in order). On one
 * thread that happens in the row pass itself; on several, the rows' input gradients are split
 * by rows and the parameter gradients by columns (each column still adds its rows in order),
 * so the bits are the same at any thread count.
 */
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

typedef struct {
  float *out, *mean, *rstd, *dweight, *dbias;
  const float *inp, *weight, *bias, *dout, *cmean, *crstd;
  int64_t N;
  int C;
  float eps;
  const fsdp_cpu_vec_i *vec;
} norm_ctx;

static void layernorm_forward_task(void *ctx, int64_t lo, int64_t hi) {
  const norm_ctx *c = ctx;
  c->vec->layernorm_forward(c->out, c->mean, c->rstd, c->inp, c->weight, c->bias, lo, hi, c->C,
                            c->eps);
}

void fsdp_cpu_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                const float *weight, const float *bias, int64_t N, int C,
                                float eps) {
  // out (N, C), mean (N), rstd (N), inp (N, C), weight (C) or NULL (= 1), bias (C) or NULL
  norm_ctx c = {.out = out, .mean = mean, .rstd = rstd, .inp = inp, .weight = weight,
                .bias = bias, .N = N, .C = C, .eps = eps, .vec = fsdp_cpu_vec()};
  fsdp_cpu_parallel_for(N, fsdp_cpu_grain_rows(C, FSDP_CPU_GRAIN), layernorm_forward_task, &c);
}

static void layernorm_backward_task(void *ctx, int64_t lo, int64_t hi) {
  const norm_ctx *c = ctx;
  c->vec->layernorm_backward(c->out, c->dweight, c->dbias, c->dout, c->inp, c->weight,
                             c->cmean, c->crstd, lo, hi, c->C);
}

static void layernorm_backward_cols_task(void *ctx, int64_t lo, int64_t hi) {
  const norm_ctx *c = ctx;
  c->vec->layernorm_backward_cols(c->dweight, c->dbias, c->dout, c->inp, c->cmean, c->crstd,
                                  c->N, c->C, (int)lo, (int)hi);
}

void fsdp_cpu_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                 const float *inp, const float *weight, const float *mean,
                                 const float *rstd, int64_t N, int C) {
  // dinp (N, C), dweight (C), dbias (C), dout (N, C), inp (N, C), weight (C) or NULL,
  // mean (N), rstd (N); dinp, dweight, dbias may each be NULL
  norm_ctx c = {.out = dinp, .dweight = dweight, .dbias = dbias, .inp = inp, .weight = weight,
                .dout = dout, .cmean = mean, .crstd = rstd, .N = N, .C = C,
                .vec = fsdp_cpu_vec()};
  const int64_t grain = fsdp_cpu_grain_rows(C, FSDP_CPU_GRAIN);
  if (fsdp_cpu_threads() == 1 || N < 2 * grain || (!dweight && !dbias)) {
    /* one pass: what several threads split below, in the same order per element */
    fsdp_cpu_parallel_for(N, grain, layernorm_backward_task, &c);
    return;
  }
  if (dinp) {
    c.dweight = c.dbias = NULL;
    fsdp_cpu_parallel_for(N, grain, layernorm_backward_task, &c);
    c.dweight = dweight, c.dbias = dbias;
  }
  int64_t cgrain = fsdp_cpu_grain_rows(N, FSDP_CPU_GRAIN);
  fsdp_cpu_parallel_for(C, cgrain < 16 ? 16 : cgrain, layernorm_backward_cols_task, &c);
}

static void softmax_forward_task(void *ctx, int64_t lo, int64_t hi) {
  const norm_ctx *c = ctx;
  c->vec->softmax_forward(c->out, c->inp, lo, hi, c->C);
}

void fsdp_cpu_softmax_forward(float *out, const float *inp, int64_t N, int C) {
  // out (N, C), inp (N, C)
  norm_ctx c = {.out = out, .inp = inp, .N = N, .C = C, .vec = fsdp_cpu_vec()};
  fsdp_cpu_parallel_for(N, fsdp_cpu_grain_rows(C, FSDP_CPU_GRAIN_HEAVY), softmax_forward_task,
                        &c);
}

static void softmax_backward_task(void *ctx, int64_t lo, int64_t hi) {
  const norm_ctx *c = ctx;
  c->vec->softmax_backward(c->out, c->dout, c->inp, lo, hi, c->C);
}

void fsdp_cpu_softmax_backward(float *dinp, const float *dout, const float *out, int64_t N,
                               int C) {
  // dinp (N, C), dout (N, C), out (N, C)
  norm_ctx c = {.out = dinp, .dout = dout, .inp = out, .N = N, .C = C, .vec = fsdp_cpu_vec()};
  fsdp_cpu_parallel_for(N, fsdp_cpu_grain_rows(C, FSDP_CPU_GRAIN), softmax_backward_task, &c);
}
