/*
 * reduce.c — sums: full (double), sum of squares (double), over one axis, and column sums
 * for bias-style gradients.
 *
 * Precision: every reduction whose length is not bounded by a feature size (a batch, a whole
 * parameter) accumulates in double. Column sums keep a double accumulator on the stack for a
 * chunk of columns and stream rows through it, so memory is read once, contiguously.
 */
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/vmath.h"

#include <string.h>

typedef double fsdp_vd __attribute__((vector_size(FSDP_VW * 8)));

double fsdp_cpu_sum(const float *a, int64_t n) {
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

double fsdp_cpu_sumsq(const float *a, int64_t n) {
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

#define COL_CHUNK 256

void fsdp_cpu_colsum_acc(float *out, const float *inp, int64_t R, int64_t C) {
  // out (C), inp (R, C)
  double acc[COL_CHUNK];
  for (int64_t c0 = 0; c0 < C; c0 += COL_CHUNK) {
    int64_t len = C - c0 < COL_CHUNK ? C - c0 : COL_CHUNK;
    memset(acc, 0, sizeof(double) * (size_t)len);
    for (int64_t r = 0; r < R; r++) {
      const float *row = inp + r * C + c0;
      for (int64_t j = 0; j < len; j++) acc[j] += (double)row[j];
    }
    for (int64_t j = 0; j < len; j++) out[c0 + j] += (float)acc[j];
  }
}

void fsdp_cpu_sum_dim_forward(float *out, const float *inp, int64_t outer, int64_t R,
                              int64_t inner) {
  // out (outer, inner), inp (outer, R, inner)
  for (int64_t o = 0; o < outer; o++) {
    const float *src = inp + o * R * inner;
    float *dst = out + o * inner;
    if (inner == 1) {
      dst[0] = (float)fsdp_cpu_sum(src, R);
    } else {
      memset(dst, 0, sizeof(float) * (size_t)inner);
      fsdp_cpu_colsum_acc(dst, src, R, inner);
    }
  }
}

void fsdp_cpu_sum_dim_backward(float *dinp, const float *dout, int64_t outer, int64_t R,
                               int64_t inner) {
  // dinp (outer, R, inner), dout (outer, inner)
  for (int64_t o = 0; o < outer; o++) {
    const float *restrict g = dout + o * inner;
    for (int64_t r = 0; r < R; r++) {
      float *restrict d = dinp + (o * R + r) * inner;
      for (int64_t j = 0; j < inner; j++) d[j] += g[j];
    }
  }
}
