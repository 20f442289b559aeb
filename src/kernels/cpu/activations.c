/*
 * activations.c — ReLU, GELU (tanh approximation) and dropout, forward and backward.
 *
 * The loops are vec_body.h's at the instruction set isa.h picked, over chunks of the rank's
 * threads (pool.h); every element is computed by one chunk, so results do not depend on the
 * thread count. GELU uses the vectorised exp of vmath.h, with tanh(u) written through
 * sigmoid(2u); its backward is the exact derivative of the same formula, recomputing the one
 * exp. Dropout draws its uniforms from the counter-based core RNG into the mask buffer itself,
 * so no scratch is needed and element i's decision is a pure function of (key, first + i): any
 * chunk (and any rank) can reproduce any slice.
 */
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"
#include "core/core.h"

/* one element range: out (n) = f(inp) or dinp (n) += f(dout, inp) */
typedef struct {
  float *out;
  const float *a, *b;
  void (*map)(float *out, const float *inp, int64_t n);
  void (*map_acc)(float *d, const float *g, const float *x, int64_t n);
} act_ctx;

static void map_task(void *ctx, int64_t lo, int64_t hi) {
  const act_ctx *c = ctx;
  c->map(c->out + lo, c->a + lo, hi - lo);
}

static void map_acc_task(void *ctx, int64_t lo, int64_t hi) {
  const act_ctx *c = ctx;
  c->map_acc(c->out + lo, c->a + lo, c->b + lo, hi - lo);
}

void fsdp_cpu_relu_forward(float *out, const float *inp, int64_t n) {
  act_ctx c = {.out = out, .a = inp, .map = fsdp_cpu_vec()->relu_forward};
  fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, map_task, &c);
}

void fsdp_cpu_relu_backward(float *dinp, const float *dout, const float *inp, int64_t n) {
  act_ctx c = {.out = dinp, .a = dout, .b = inp, .map_acc = fsdp_cpu_vec()->relu_backward};
  fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, map_acc_task, &c);
}

void fsdp_cpu_gelu_forward(float *out, const float *inp, int64_t n) {
  act_ctx c = {.out = out, .a = inp, .map = fsdp_cpu_vec()->gelu_forward};
  fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN_HEAVY, map_task, &c);
}

void fsdp_cpu_gelu_backward(float *dinp, const float *dout, const float *inp, int64_t n) {
  act_ctx c = {.out = dinp, .a = dout, .b = inp, .map_acc = fsdp_cpu_vec()->gelu_backward};
  fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN_HEAVY, map_acc_task, &c);
}

typedef struct {
  float *out, *db;
  const float *inp, *bias, *dout;
  int64_t N;
  int C;
  bool set;
  const fsdp_cpu_vec_i *vec;
} bias_gelu_ctx;

static void bias_gelu_forward_task(void *ctx, int64_t lo, int64_t hi) {
  const bias_gelu_ctx *c = ctx;
  c->vec->bias_gelu_forward(c->out, c->inp, c->bias, lo, hi, c->C);
}

void fsdp_cpu_bias_gelu_forward(float *out, const float *inp, const float *bias, int64_t N,
                                int C) {
  // out (N, C), inp (N, C), bias (C)
  bias_gelu_ctx c = {.out = out, .inp = inp, .bias = bias, .N = N, .C = C,
                     .vec = fsdp_cpu_vec()};
  fsdp_cpu_parallel_for(N, fsdp_cpu_grain_rows(C, FSDP_CPU_GRAIN_HEAVY), bias_gelu_forward_task,
                        &c);
}

/* split by columns: each column's rows are added in order, so dbias does not depend on the
 * thread count */
static void bias_gelu_backward_task(void *ctx, int64_t lo, int64_t hi) {
  const bias_gelu_ctx *c = ctx;
  c->vec->bias_gelu_backward_cols(c->out, c->db, c->dout, c->inp, c->bias, c->N, c->C, (int)lo,
                                  (int)hi, c->set);
}

void fsdp_cpu_bias_gelu_backward(float *dinp, float *dbias, const float *dout, const float *inp,
                                 const float *bias, int64_t N, int C, bool set) {
  // dinp (N, C) or NULL, dbias (C) or NULL, dout (N, C), inp (N, C), bias (C)
  if (N <= 0 || (!dinp && !dbias)) return;
  bias_gelu_ctx c = {.out = dinp, .db = dbias, .inp = inp, .bias = bias, .dout = dout, .N = N,
                     .C = C, .set = set, .vec = fsdp_cpu_vec()};
  int64_t grain = fsdp_cpu_grain_rows(N, FSDP_CPU_GRAIN_HEAVY);
  fsdp_cpu_parallel_for(C, grain < 64 ? 64 : grain, bias_gelu_backward_task, &c);
}

typedef struct {
  float *out, *mask;
  const float *inp;
  float p, scale;
  uint64_t key, first;
  const fsdp_cpu_vec_i *vec;
} dropout_ctx;

static void dropout_task(void *ctx, int64_t lo, int64_t hi) {
  const dropout_ctx *c = ctx;
  /* the uniforms of elements first + lo .. first + hi, turned into the mask in place */
  fsdp_rng_uniform(c->mask + lo, hi - lo, c->key, c->first + (uint64_t)lo);
  c->vec->dropout_mask(c->out + lo, c->mask + lo, c->inp + lo, hi - lo, c->p, c->scale);
}

static void dropout_ones_task(void *ctx, int64_t lo, int64_t hi) {
  const dropout_ctx *c = ctx;
  for (int64_t i = lo; i < hi; i++) {
    c->mask[i] = 1.0f;
    c->out[i] = c->inp[i];
  }
}

void fsdp_cpu_dropout_forward(float *out, float *mask, const float *inp, int64_t n, float p,
                              uint64_t key, uint64_t first) {
  // out (n), mask (n), inp (n)
  dropout_ctx c = {.out = out, .mask = mask, .inp = inp, .p = p, .key = key, .first = first,
                   .vec = fsdp_cpu_vec()};
  if (p <= 0.0f) { /* u >= 0 always holds: skip the RNG, the mask is all ones */
    fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, dropout_ones_task, &c);
    return;
  }
  c.scale = p >= 1.0f ? 0.0f : 1.0f / (1.0f - p);
  fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN_HEAVY, dropout_task, &c);
}

void fsdp_cpu_dropout_backward(float *dinp, const float *dout, const float *mask, int64_t n) {
  act_ctx c = {.out = dinp, .a = dout, .b = mask, .map_acc = fsdp_cpu_vec()->mul_acc};
  fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, map_acc_task, &c);
}
