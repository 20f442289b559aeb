/*
 * reduce.c — sums: full (double), sum of squares (double), over one axis, and column sums
 * for bias-style gradients.
 *
 * Precision: every reduction whose length is not bounded by a feature size (a batch, a whole
 * parameter) accumulates in double. Column sums keep a double accumulator on the stack for a
 * chunk of columns and stream rows through it, so memory is read once, contiguously.
 *
 * Threads (pool.h) without changing bits: a long sum is cut into blocks whose size depends on
 * n alone (SUM_BLOCK elements, more when there would be over SUM_MAX_BLOCKS), each block is
 * summed as a short sum is, and the block sums are added in block order, so the result is the
 * same at any thread count and run to run. Column sums are cut by columns (each column's rows
 * are still added in order: the serial bits); sums over an axis by their outer index.
 */
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"
#include "kernels/cpu/vmath.h"

#include <string.h>

typedef double fsdp_vd __attribute__((vector_size(FSDP_VW * 8)));

#define SUM_BLOCK 65536
#define SUM_MAX_BLOCKS 1024
/* Elements (rows x columns) a chunk of column or axis sums must hold. */
#define REDUCE_GRAIN 32768

static double sum_run(const float *a, int64_t n) {
  fsdp_vd acc = {0};
  int64_t i = 0;
  for (; i + FSDP_VW <= n; i += FSDP_VW) {
    acc += __builtin_convertvector(fsdp_vf_load(a + i), fsdp_vd);
  }
  double s = 0.0;
  for (int l = 0; l < FSDP_VW; l++) s += acc[l];
  for (; i < n; i++) s += a[i];
  return s;
}

static double sumsq_run(const float *a, int64_t n) {
  fsdp_vd acc = {0};
  int64_t i = 0;
  for (; i + FSDP_VW <= n; i += FSDP_VW) {
    fsdp_vd x = __builtin_convertvector(fsdp_vf_load(a + i), fsdp_vd);
    acc += x * x;
  }
  double s = 0.0;
  for (int l = 0; l < FSDP_VW; l++) s += acc[l];
  for (; i < n; i++) s += (double)a[i] * a[i];
  return s;
}

typedef struct blocks_job {
  const float *a;
  int64_t n, block;
  double (*run)(const float *, int64_t);
  double *part; /* (blocks) */
} blocks_job;

static void blocks_task(void *ctx, int64_t lo, int64_t hi) {
  const blocks_job *j = ctx;
  for (int64_t k = lo; k < hi; k++) {
    const int64_t at = k * j->block, len = j->n - at < j->block ? j->n - at : j->block;
    j->part[k] = j->run(j->a + at, len);
  }
}

/* run over [0, n) in blocks that depend on n alone, block sums added in order */
static double blocked(const float *a, int64_t n, double (*run)(const float *, int64_t)) {
  if (n <= SUM_BLOCK) return run(a, n);
  int64_t block = SUM_BLOCK;
  if (n > block * SUM_MAX_BLOCKS) block = ((n + SUM_MAX_BLOCKS - 1) / SUM_MAX_BLOCKS + 15) / 16 * 16;
  double part[SUM_MAX_BLOCKS];
  blocks_job j = {a, n, block, run, part};
  const int64_t nblocks = (n + block - 1) / block;
  fsdp_cpu_parallel_for(nblocks, 1, blocks_task, &j);
  double s = 0.0;
  for (int64_t k = 0; k < nblocks; k++) s += part[k];
  return s;
}

double fsdp_cpu_sum(const float *a, int64_t n) { return blocked(a, n, sum_run); }

double fsdp_cpu_sumsq(const float *a, int64_t n) { return blocked(a, n, sumsq_run); }

#define COL_CHUNK 256

/* element j of an f32 or bf16 row, as a double (bf16 -> f32 is exact) */
static inline __attribute__((always_inline)) double col_elem(const void *row, int64_t j,
                                                             bool bf16) {
  if (!bf16) return (double)((const float *)row)[j];
  uint32_t u = (uint32_t)((const uint16_t *)row)[j] << 16;
  float x;
  memcpy(&x, &u, sizeof x);
  return (double)x;
}

/* out[c0:c1] += column sums of inp[:, c0:c1] (row stride C), inp f32 or bf16 (`bf16` a constant
 * at each caller, so each compiles to one loop; bf16 sums are those of the f32 loop on the
 * widened matrix). Compiled per instruction set (target_clones, as convert.c): the vectors run
 * across columns, each column still summed row by row in double, so every width gives the same
 * bits. */
static inline __attribute__((always_inline)) void colsum_body(float *out, const void *inp,
                                                              bool bf16, int64_t R, int64_t C,
                                                              int64_t c0, int64_t c1) {
  const size_t es = bf16 ? 2 : 4;
  double acc[COL_CHUNK];
  for (; c0 < c1; c0 += COL_CHUNK) {
    int64_t len = c1 - c0 < COL_CHUNK ? c1 - c0 : COL_CHUNK;
    memset(acc, 0, sizeof(double) * (size_t)len);
    for (int64_t r = 0; r < R; r++) {
      const void *row = (const char *)inp + (size_t)(r * C + c0) * es;
      for (int64_t j = 0; j < len; j++) acc[j] += col_elem(row, j, bf16);
    }
    for (int64_t j = 0; j < len; j++) out[c0 + j] += (float)acc[j];
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
static void colsum_run(float *out, const float *inp, int64_t R, int64_t C, int64_t c0,
                       int64_t c1) {
  colsum_body(out, inp, false, R, C, c0, c1);
}

__attribute__((target_clones("avx512f", "avx2", "default")))
static void colsum_bf16_run(float *out, const uint16_t *inp, int64_t R, int64_t C, int64_t c0,
                            int64_t c1) {
  colsum_body(out, inp, true, R, C, c0, c1);
}

/* f16 input: element by element through core's conversion (no hot path uses f16 on the cpu) */
static void colsum_f16_run(float *out, const uint16_t *inp, int64_t R, int64_t C, int64_t c0,
                           int64_t c1) {
  for (int64_t c = c0; c < c1; c++) {
    double acc = 0;
    for (int64_t r = 0; r < R; r++) acc += (double)fsdp_f16_to_f32(inp[r * C + c]);
    out[c] += (float)acc;
  }
}

typedef struct colsum_job {
  float *out;
  const void *inp;
  fsdp_dtype dt;
  int64_t R, C;
} colsum_job;

static void colsum_task(void *ctx, int64_t lo, int64_t hi) {
  const colsum_job *j = ctx;
  if (j->dt == FSDP_DTYPE_F32) colsum_run(j->out, j->inp, j->R, j->C, lo, hi);
  else if (j->dt == FSDP_DTYPE_BF16) colsum_bf16_run(j->out, j->inp, j->R, j->C, lo, hi);
  else colsum_f16_run(j->out, j->inp, j->R, j->C, lo, hi);
}

static void colsum(float *out, const void *inp, fsdp_dtype dt, int64_t R, int64_t C) {
  // out (C), inp (R, C)
  if (R <= 0 || C <= 0) return;
  /* columns in whole cache lines (grain a multiple of 16), each chunk REDUCE_GRAIN elements */
  int64_t grain = (REDUCE_GRAIN / R + 15) / 16 * 16;
  if (grain < 16) grain = 16;
  colsum_job j = {out, inp, dt, R, C};
  fsdp_cpu_parallel_for(C, grain, colsum_task, &j);
}

void fsdp_cpu_colsum_acc(float *out, const float *inp, int64_t R, int64_t C) {
  colsum(out, inp, FSDP_DTYPE_F32, R, C);
}

void fsdp_cpu_colsum_acc_half(float *out, const void *inp, fsdp_dtype dt, int64_t R, int64_t C) {
  colsum(out, inp, dt, R, C);
}

typedef struct sum_dim_job {
  float *out;
  const float *inp;
  int64_t R, inner;
} sum_dim_job;

static void sum_dim_task(void *ctx, int64_t lo, int64_t hi) {
  const sum_dim_job *j = ctx;
  const int64_t R = j->R, inner = j->inner;
  for (int64_t o = lo; o < hi; o++) {
    const float *src = j->inp + o * R * inner;
    float *dst = j->out + o * inner;
    if (inner == 1) {
      dst[0] = (float)fsdp_cpu_sum(src, R);
    } else {
      memset(dst, 0, sizeof(float) * (size_t)inner);
      fsdp_cpu_colsum_acc(dst, src, R, inner);
    }
  }
}

/* Items of per_item elements a chunk takes so that it holds REDUCE_GRAIN elements (at least
 * 1; empty items: every item in one chunk). */
static int64_t outer_grain(int64_t per_item) {
  if (per_item < 1) return INT64_MAX;
  return per_item >= REDUCE_GRAIN ? 1 : (REDUCE_GRAIN + per_item - 1) / per_item;
}

void fsdp_cpu_sum_dim_forward(float *out, const float *inp, int64_t outer, int64_t R,
                              int64_t inner) {
  // out (outer, inner), inp (outer, R, inner)
  sum_dim_job j = {out, inp, R, inner};
  /* one outer item: its own sum or column sums split the work; several: split by item (the
   * sums inside give the same bits on one thread as on many) */
  if (outer == 1)
    sum_dim_task(&j, 0, 1);
  else
    fsdp_cpu_parallel_for(outer, outer_grain(R * inner), sum_dim_task, &j);
}

typedef struct sum_dim_bwd_job {
  float *dinp;
  const float *dout;
  int64_t R, inner;
} sum_dim_bwd_job;

static void sum_dim_bwd_task(void *ctx, int64_t lo, int64_t hi) {
  const sum_dim_bwd_job *j = ctx;
  const int64_t R = j->R, inner = j->inner;
  for (int64_t row = lo; row < hi; row++) { /* row = o * R + r */
    const float *restrict g = j->dout + row / R * inner;
    float *restrict d = j->dinp + row * inner;
    for (int64_t c = 0; c < inner; c++) d[c] += g[c];
  }
}

void fsdp_cpu_sum_dim_backward(float *dinp, const float *dout, int64_t outer, int64_t R,
                               int64_t inner) {
  // dinp (outer, R, inner), dout (outer, inner)
  sum_dim_bwd_job j = {dinp, dout, R, inner};
  fsdp_cpu_parallel_for(outer * R, outer_grain(inner), sum_dim_bwd_task, &j);
}
