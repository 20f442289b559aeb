/*
 * reduce.c — the reduction arithmetic of every backend: the same loops in the same order, so the
 * local and mpi backends give the same bits for the same inputs (docs/comm.md "exact
 * arithmetic"). Plain loops over tiles that the compiler vectorises.
 */
#include <string.h>

#include "comm/comm.h"

/* the running sums of one tile stay in L1 while every rank's input streams */
#define REDUCE_TILE 2048


/* One pass per input over a tile: plain loops the compiler vectorises. max/min propagate NaN
 * (a NaN anywhere gives NaN), with selects rather than branches. */
static void tile_first2(float *restrict t, const float *restrict a, const float *restrict b,
                        int64_t m, fsdp_reduce_op red) {
  switch (red) {
  case FSDP_RED_MAX:
    for (int64_t i = 0; i < m; i++) t[i] = (b[i] > a[i] || b[i] != b[i]) ? b[i] : a[i];
    break;
  case FSDP_RED_MIN:
    for (int64_t i = 0; i < m; i++) t[i] = (b[i] < a[i] || b[i] != b[i]) ? b[i] : a[i];
    break;
  default:
    for (int64_t i = 0; i < m; i++) t[i] = a[i] + b[i];
    break;
  }
}

static void tile_acc(float *restrict t, const float *restrict b, int64_t m, fsdp_reduce_op red) {
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

static void tile_scale_out(float *restrict out, const float *restrict t, int64_t m, float s) {
  for (int64_t i = 0; i < m; i++) out[i] = t[i] * s;
}

/* out[i] = src[0][i] (+) src[1][i] (+) ... (+) src[n-1][i] for i < m, left to right; for AVG
 * the sum is then multiplied by (float)(1.0 / n). out may be one of the inputs (all_reduce's
 * own chunk): each tile is reduced into a scratch buffer before it is written. */
void fsdp_comm_reduce_f32(float *out, const float *const *src, int nsrc, int64_t m,
                       fsdp_reduce_op red) {
  float t[REDUCE_TILE] __attribute__((aligned(64)));
  const float scale = (float)(1.0 / nsrc);
  for (int64_t i0 = 0; i0 < m; i0 += REDUCE_TILE) {
    int64_t k = m - i0 < REDUCE_TILE ? m - i0 : REDUCE_TILE;
    if (nsrc == 1) {
      memcpy(t, src[0] + i0, (size_t)k * sizeof(float));
    } else {
      tile_first2(t, src[0] + i0, src[1] + i0, k, red);
      for (int p = 2; p < nsrc; p++) tile_acc(t, src[p] + i0, k, red);
    }
    if (red == FSDP_RED_AVG) tile_scale_out(out + i0, t, k, scale);
    else memcpy(out + i0, t, (size_t)k * sizeof(float));
  }
}
