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
 * Layernorm's backward reads dout and the input once: each row's input gradient and its
 * dweight / dbias terms come from one pass over the row while it is in cache. The parameter
 * terms go into a partial sum per block of LN_BLOCK_ROWS rows (rows in order inside a block),
 * and the blocks' partials are then added in block order into dweight and dbias. Blocks are
 * fixed by N alone, never by the thread count, so the bits are the same at any thread count;
 * threads split the blocks, then the columns of the final sum. (Splitting rows for dinp and
 * columns for the parameters instead reads dout and the input twice from memory.)
 */
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

#include <stdlib.h>

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

/* Elements of the fused residual add + layernorm per step: the sum of that many rows is still
 * in L2 when the layernorm reads it back, and the add still runs long loops (a few rows at a
 * time measured slower than the two kernels apart). */
#define ADD_LN_ELEMS 16384

typedef struct {
  float *sum, *out, *mean, *rstd;
  const float *a, *b, *weight, *bias;
  int C;
  float eps;
  const fsdp_cpu_vec_i *vec;
} add_ln_ctx;

static void add_layernorm_task(void *ctx, int64_t lo, int64_t hi) {
  const add_ln_ctx *c = ctx;
  const int64_t C = c->C, rows = C < ADD_LN_ELEMS ? ADD_LN_ELEMS / C : 1;
  for (int64_t r = lo; r < hi; r += rows) {
    const int64_t r1 = r + rows < hi ? r + rows : hi, len = (r1 - r) * C;
    /* inside a task the add runs inline, on this thread */
    fsdp_cpu_binary_forward(c->sum + r * C, c->a + r * C, c->b + r * C, len, len, FSDP_BIN_ADD);
    c->vec->layernorm_forward(c->out, c->mean, c->rstd, c->sum, c->weight, c->bias, r, r1,
                              c->C, c->eps);
  }
}

void fsdp_cpu_add_layernorm_forward(float *sum, float *out, float *mean, float *rstd,
                                    const float *a, const float *b, const float *weight,
                                    const float *bias, int64_t N, int C, float eps) {
  add_ln_ctx c = {.sum = sum, .out = out, .mean = mean, .rstd = rstd, .a = a, .b = b,
                  .weight = weight, .bias = bias, .C = C, .eps = eps, .vec = fsdp_cpu_vec()};
  fsdp_cpu_parallel_for(N, fsdp_cpu_grain_rows(C, FSDP_CPU_GRAIN), add_layernorm_task, &c);
}

static void layernorm_backward_task(void *ctx, int64_t lo, int64_t hi) {
  const norm_ctx *c = ctx;
  c->vec->layernorm_backward(c->out, c->dweight, c->dbias, c->dout, c->inp, c->weight,
                             c->cmean, c->crstd, lo, hi, c->C);
}

/* Rows per block of layernorm's parameter-gradient partial sums: enough rows that the partials
 * (2 x C floats a block) stay small beside the rows' bytes, few enough that 2048-row batches
 * split into blocks for every thread. */
#define LN_BLOCK_ROWS 64

typedef struct {
  norm_ctx base;
  float *pw, *pb; /* (blocks, C) partial dweight / dbias, zeroed; either may be NULL */
} ln_blocks_ctx;

static void layernorm_backward_blocks_task(void *ctx, int64_t lo, int64_t hi) {
  const ln_blocks_ctx *c = ctx;
  const int64_t N = c->base.N, C = c->base.C;
  for (int64_t b = lo; b < hi; b++) {
    const int64_t r0 = b * LN_BLOCK_ROWS, r1 = r0 + LN_BLOCK_ROWS < N ? r0 + LN_BLOCK_ROWS : N;
    c->base.vec->layernorm_backward(c->base.out, c->pw ? c->pw + b * C : NULL,
                                    c->pb ? c->pb + b * C : NULL, c->base.dout, c->base.inp,
                                    c->base.weight, c->base.cmean, c->base.crstd, r0, r1,
                                    (int)C);
  }
}

/* dst[c] += (p[0][c] + p[1][c] + ...) over columns [lo, hi), blocks in order */
static void ln_sum_blocks(float *dst, float *p, int64_t blocks, int64_t C, int64_t lo,
                          int64_t hi) {
  for (int64_t b = 1; b < blocks; b++)
    for (int64_t c = lo; c < hi; c++) p[c] += p[b * C + c];
  for (int64_t c = lo; c < hi; c++) dst[c] += p[c];
}

static void layernorm_backward_sum_task(void *ctx, int64_t lo, int64_t hi) {
  const ln_blocks_ctx *c = ctx;
  const int64_t blocks = (c->base.N + LN_BLOCK_ROWS - 1) / LN_BLOCK_ROWS;
  if (c->pw) ln_sum_blocks(c->base.dweight, c->pw, blocks, c->base.C, lo, hi);
  if (c->pb) ln_sum_blocks(c->base.dbias, c->pb, blocks, c->base.C, lo, hi);
}

void fsdp_cpu_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                 const float *inp, const float *weight, const float *mean,
                                 const float *rstd, int64_t N, int C) {
  // dinp (N, C), dweight (C), dbias (C), dout (N, C), inp (N, C), weight (C) or NULL,
  // mean (N), rstd (N); dinp, dweight, dbias may each be NULL
  norm_ctx c = {.out = dinp, .dweight = dweight, .dbias = dbias, .inp = inp, .weight = weight,
                .dout = dout, .cmean = mean, .crstd = rstd, .N = N, .C = C,
                .vec = fsdp_cpu_vec()};
  const int64_t blocks = (N + LN_BLOCK_ROWS - 1) / LN_BLOCK_ROWS;
  if ((!dweight && !dbias) || blocks <= 1) {
    /* no parameter sums to order, or one block: the row pass adds straight into them */
    if (dweight || dbias) {
      layernorm_backward_task(&c, 0, N);
      return;
    }
    fsdp_cpu_parallel_for(N, fsdp_cpu_grain_rows(C, FSDP_CPU_GRAIN), layernorm_backward_task,
                          &c);
    return;
  }
  ln_blocks_ctx b = {.base = c};
  float *partials = calloc((size_t)blocks * (size_t)C * 2, sizeof(float));
  if (!partials) {
    /* no memory for the partials (a few hundred KiB at most): one thread, rows in order, into
     * dweight / dbias directly. Slower and rounded differently, never wrong. */
    layernorm_backward_task(&c, 0, N);
    return;
  }
  b.pw = dweight ? partials : NULL;
  b.pb = dbias ? partials + blocks * C : NULL;
  fsdp_cpu_parallel_for(blocks, 1, layernorm_backward_blocks_task, &b);
  int64_t cgrain = C / (2 * fsdp_cpu_threads());
  fsdp_cpu_parallel_for(C, cgrain < 64 ? 64 : cgrain, layernorm_backward_sum_task, &b);
  free(partials);
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
