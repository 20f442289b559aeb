/*
 * ranks.c — reducing the ranks' buffers: the arithmetic of every collective's reduction (the
 * local and mpi backends call it through fsdp_comm_reduce, and it is the cpu's reduce_ranks
 * slot), so every backend and every device with host memory gives the same bits for the same
 * inputs (docs/comm.md "exact arithmetic"). Plain loops over tiles that the compiler
 * vectorises; the dtype is a switch at the entry.
 *
 *   f32   ((x0 + x1) + x2) + ... in float; avg then * (float)(1.0 / n)
 *   bf16  each input widened to f32 (exact), reduced as f32 (avg included), rounded to bf16
 *         once at the end (nearest even): one rounding, not one per rank
 *   f64   the same fold in double; avg then / n (a correctly rounded division)
 *   i64   sums wrap modulo 2^64 (computed in uint64_t: no undefined overflow); max, min; no avg
 * max/min propagate NaN (a NaN anywhere gives NaN).
 */
#include <string.h>

#include "kernels/cpu/kernels.h"

/* the running sums of one tile stay in L1 while every rank's input streams */
#define REDUCE_TILE 2048

bool fsdp_cpu_reduce_supported(fsdp_dtype dtype, fsdp_reduce_op red) {
  if ((unsigned)red > FSDP_RED_MIN) return false;
  switch (dtype) {
  case FSDP_DTYPE_F32:
  case FSDP_DTYPE_BF16:
  case FSDP_DTYPE_F64: return true;
  case FSDP_DTYPE_I64: return red != FSDP_RED_AVG;
  default: return false;
  }
}

/* ---- f32 (and bf16, widened) --------------------------------------------------------------- */

/* One pass per input over a tile. Selects rather than branches for max/min. */
static void f32_acc(float *restrict t, const float *restrict b, int64_t m, fsdp_reduce_op red) {
  switch (red) {
  case FSDP_RED_MAX:
    for (int64_t i = 0; i < m; i++) t[i] = (b[i] > t[i] || b[i] != b[i]) ? b[i] : t[i];
    break;
  case FSDP_RED_MIN:
    for (int64_t i = 0; i < m; i++) t[i] = (b[i] < t[i] || b[i] != b[i]) ? b[i] : t[i];
    break;
  default:
    for (int64_t i = 0; i < m; i++) t[i] += b[i];
    break;
  }
}

static void f32_scale(float *restrict t, int64_t m, float s) {
  for (int64_t i = 0; i < m; i++) t[i] *= s;
}

static void reduce_f32(float *out, const float *const *src, int nsrc, int64_t m,
                       fsdp_reduce_op red) {
  float t[REDUCE_TILE] __attribute__((aligned(64)));
  const float scale = (float)(1.0 / nsrc);
  for (int64_t i0 = 0; i0 < m; i0 += REDUCE_TILE) {
    int64_t k = m - i0 < REDUCE_TILE ? m - i0 : REDUCE_TILE;
    memcpy(t, src[0] + i0, (size_t)k * sizeof(float));
    for (int p = 1; p < nsrc; p++) f32_acc(t, src[p] + i0, k, red);
    if (red == FSDP_RED_AVG) f32_scale(t, k, scale);
    memcpy(out + i0, t, (size_t)k * sizeof(float));
  }
}

/* bf16: every input widened tile by tile into w, then the f32 loops above; one rounding. The
 * conversions are the cpu kernels' bulk ones (vectorised; the bits of core's scalar ones). */
static void reduce_bf16(uint16_t *out, const uint16_t *const *src, int nsrc, int64_t m,
                        fsdp_reduce_op red) {
  float t[REDUCE_TILE] __attribute__((aligned(64)));
  float w[REDUCE_TILE] __attribute__((aligned(64)));
  const float scale = (float)(1.0 / nsrc);
  for (int64_t i0 = 0; i0 < m; i0 += REDUCE_TILE) {
    int64_t k = m - i0 < REDUCE_TILE ? m - i0 : REDUCE_TILE;
    fsdp_cpu_bf16_to_f32(t, src[0] + i0, k);
    for (int p = 1; p < nsrc; p++) {
      fsdp_cpu_bf16_to_f32(w, src[p] + i0, k);
      f32_acc(t, w, k, red);
    }
    if (red == FSDP_RED_AVG) f32_scale(t, k, scale);
    fsdp_cpu_f32_to_bf16(out + i0, t, k);
  }
}

/* ---- f64 ------------------------------------------------------------------------------------ */

static void f64_acc(double *restrict t, const double *restrict b, int64_t m, fsdp_reduce_op red) {
  switch (red) {
  case FSDP_RED_MAX:
    for (int64_t i = 0; i < m; i++) t[i] = (b[i] > t[i] || b[i] != b[i]) ? b[i] : t[i];
    break;
  case FSDP_RED_MIN:
    for (int64_t i = 0; i < m; i++) t[i] = (b[i] < t[i] || b[i] != b[i]) ? b[i] : t[i];
    break;
  default:
    for (int64_t i = 0; i < m; i++) t[i] += b[i];
    break;
  }
}

static void reduce_f64(double *out, const double *const *src, int nsrc, int64_t m,
                       fsdp_reduce_op red) {
  double t[REDUCE_TILE] __attribute__((aligned(64)));
  const double n = (double)nsrc;
  for (int64_t i0 = 0; i0 < m; i0 += REDUCE_TILE) {
    int64_t k = m - i0 < REDUCE_TILE ? m - i0 : REDUCE_TILE;
    memcpy(t, src[0] + i0, (size_t)k * sizeof(double));
    for (int p = 1; p < nsrc; p++) f64_acc(t, src[p] + i0, k, red);
    if (red == FSDP_RED_AVG)
      for (int64_t i = 0; i < k; i++) t[i] /= n;
    memcpy(out + i0, t, (size_t)k * sizeof(double));
  }
}

/* ---- i64 ------------------------------------------------------------------------------------ */

static void i64_acc(int64_t *restrict t, const int64_t *restrict b, int64_t m,
                    fsdp_reduce_op red) {
  switch (red) {
  case FSDP_RED_MAX:
    for (int64_t i = 0; i < m; i++) t[i] = b[i] > t[i] ? b[i] : t[i];
    break;
  case FSDP_RED_MIN:
    for (int64_t i = 0; i < m; i++) t[i] = b[i] < t[i] ? b[i] : t[i];
    break;
  default:
    for (int64_t i = 0; i < m; i++) t[i] = (int64_t)((uint64_t)t[i] + (uint64_t)b[i]);
    break;
  }
}

static void reduce_i64(int64_t *out, const int64_t *const *src, int nsrc, int64_t m,
                       fsdp_reduce_op red) {
  int64_t t[REDUCE_TILE] __attribute__((aligned(64)));
  for (int64_t i0 = 0; i0 < m; i0 += REDUCE_TILE) {
    int64_t k = m - i0 < REDUCE_TILE ? m - i0 : REDUCE_TILE;
    memcpy(t, src[0] + i0, (size_t)k * sizeof(int64_t));
    for (int p = 1; p < nsrc; p++) i64_acc(t, src[p] + i0, k, red);
    memcpy(out + i0, t, (size_t)k * sizeof(int64_t));
  }
}

/* out may be one of the inputs (all_reduce's own chunk): each tile is reduced into a scratch
 * buffer before it is written. */
void fsdp_cpu_reduce_ranks(void *out, const void *const *src, int nsrc, int64_t m,
                           fsdp_dtype dtype, fsdp_reduce_op red) {
  switch (dtype) {
  case FSDP_DTYPE_F32:
    reduce_f32(out, (const float *const *)src, nsrc, m, red);
    break;
  case FSDP_DTYPE_BF16:
    reduce_bf16(out, (const uint16_t *const *)src, nsrc, m, red);
    break;
  case FSDP_DTYPE_F64:
    reduce_f64(out, (const double *const *)src, nsrc, m, red);
    break;
  case FSDP_DTYPE_I64:
    reduce_i64(out, (const int64_t *const *)src, nsrc, m, red);
    break;
  default: break; /* callers check fsdp_cpu_reduce_supported */
  }
}
