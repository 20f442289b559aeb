/*
 * mask.c — the f32 kernels of masks and magnitude pruning (the mask slots of kernels/kernels.h;
 * docs/pruning.md is the manual). Pure functions of their inputs, so the masks they make are
 * the same bits at every world size: the Lua layer decides which slices, these only count and
 * write.
 *
 * A key orders elements by magnitude as a 32-bit unsigned integer: 0 for a masked element
 * (m[i] == 0), else (bits of |x| as a float) + 1. Non-negative floats order like their bit
 * patterns, so keys order like magnitudes with masked elements below every live one; a NaN
 * sorts above +inf. The loops are branch-free where a branch on the mask would be mispredicted
 * half the time at 50% sparsity.
 */
#include <math.h>
#include <string.h>

#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

static inline uint32_t key_of(float x, const float *m, int64_t i) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  uint32_t k = (bits & 0x7FFFFFFFu) + 1u;
  if (m) k &= 0u - (uint32_t)(m[i] != 0.0f);
  return k;
}

static inline float value_of(float x, const float *m, int64_t i) {
  if (m && m[i] == 0.0f) return -1.0f;
  if (isnan(x)) return INFINITY;
  return fabsf(x);
}

typedef struct {
  float *x;
  const float *m;
  void (*apply)(float *x, const float *m, int64_t n);
} apply_ctx;

static void mask_apply_task(void *ctx, int64_t lo, int64_t hi) {
  const apply_ctx *c = ctx;
  c->apply(c->x + lo, c->m + lo, hi - lo);
}

void fsdp_cpu_mask_apply(float *x, const float *m, int64_t n) {
  // x (n), m (n): x's bits and all-ones or zero (vec_body.h), exact, +0 for masked; split over
  // the rank's threads
  apply_ctx c = {x, m, fsdp_cpu_vec()->mask_apply};
  fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, mask_apply_task, &c);
}

int64_t fsdp_cpu_count_zeros(const float *x, int64_t n) {
  int64_t z = 0;
  for (int64_t i = 0; i < n; i++) z += x[i] == 0.0f;
  return z;
}

void fsdp_cpu_mask_check(int64_t *bad, int64_t *zeros, uint32_t *hash, const float *m,
                         int64_t n) {
  int64_t b = 0, z = 0;
  uint32_t h = 2166136261u; /* FNV-1a over the zero positions, 4 little-endian bytes each */
  for (int64_t i = 0; i < n; i++) {
    if (m[i] == 0.0f) {
      z++;
      uint32_t v = (uint32_t)i;
      for (int k = 0; k < 4; k++) {
        h ^= (v >> (8 * k)) & 0xFFu;
        h *= 16777619u;
      }
    } else if (m[i] != 1.0f) {
      b++;
    }
  }
  *bad = b, *zeros = z, *hash = h;
}

int64_t fsdp_cpu_mask_from_nonzero(float *mout, const float *x, int64_t n) {
  int64_t z = 0;
  for (int64_t i = 0; i < n; i++) {
    const float v = x[i];
    mout[i] = v != 0.0f ? 1.0f : 0.0f;
    z += v == 0.0f;
  }
  return z;
}

void fsdp_cpu_mask_hist(int64_t *counts, uint32_t *sub, const float *x, const float *m,
                        int64_t n, uint64_t prefix, int shift, int width) {
  // counts (2^width) +=, sub (4 * 2^width) scratch, x (n), m (n) or NULL
  const int64_t nb = (int64_t)1 << width;
  const uint64_t bmask = (uint64_t)(nb - 1);
  const int top = shift + width;
  /* 4 interleaved 32-bit sub-histograms, flushed before they could overflow: weights crowd into
   * few buckets, and consecutive increments of one counter would wait on each other */
  for (int64_t i0 = 0; i0 < n; i0 += (int64_t)1 << 30) {
    int64_t i1 = n - i0 < ((int64_t)1 << 30) ? n : i0 + ((int64_t)1 << 30);
    memset(sub, 0, sizeof *sub * 4 * (size_t)nb);
    if (m) {
      for (int64_t i = i0; i < i1; i++) {
        uint64_t k = key_of(x[i], m, i);
        if ((k >> top) == prefix) sub[(i & 3) * nb + (int64_t)((k >> shift) & bmask)]++;
      }
    } else {
      for (int64_t i = i0; i < i1; i++) {
        uint64_t k = key_of(x[i], NULL, i);
        if ((k >> top) == prefix) sub[(i & 3) * nb + (int64_t)((k >> shift) & bmask)]++;
      }
    }
    for (int64_t b = 0; b < nb; b++)
      counts[b] += (int64_t)sub[b] + sub[nb + b] + sub[2 * nb + b] + sub[3 * nb + b];
  }
}

void fsdp_cpu_mask_hist_pos(int64_t *counts, const float *x, const float *m, int64_t n,
                            uint32_t T, uint64_t gbase, uint64_t prefix, int shift, int width) {
  // counts (2^width) +=, x (n), m (n) or NULL
  const uint64_t bmask = ((uint64_t)1 << width) - 1;
  for (int64_t i = 0; i < n; i++) {
    if (key_of(x[i], m, i) != T) continue;
    uint64_t pos = gbase + (uint64_t)i;
    if ((pos >> (shift + width)) == prefix) counts[(pos >> shift) & bmask]++;
  }
}

int64_t fsdp_cpu_mask_select(float *mout, const float *x, const float *m, int64_t n, uint32_t T,
                             uint64_t gbase, uint64_t P) {
  // mout (n) (may be m: element i is read before it is written), x (n), m (n) or NULL
  int64_t z = 0;
  for (int64_t i = 0; i < n; i++) {
    uint32_t key = key_of(x[i], m, i);
    int pruned = (key < T) | ((key == T) & (gbase + (uint64_t)i < P));
    mout[i] = (float)(1 - pruned);
    z += pruned;
  }
  return z;
}

int64_t fsdp_cpu_mask_nm(float *mout, const float *x, const float *m, int64_t n, int64_t keep,
                         int64_t M, int64_t lead) {
  // mout (n), x (n), m (n) or NULL; mout is written after the whole group is read, so it may
  // be m
  int64_t groups = 0;
  float v[4096], keepv[4096];
  for (int64_t g = lead; g + M <= n; g += M, groups++) {
    for (int64_t i = 0; i < M; i++) v[i] = value_of(x[g + i], m, g + i);
    for (int64_t i = 0; i < M; i++) {
      int64_t above = 0; /* elements of the group ranked before i: larger, or equal and lower */
      for (int64_t j = 0; j < M; j++)
        if (j != i) above += v[j] > v[i] || (v[j] == v[i] && j > i);
      keepv[i] = above < keep ? 1.0f : 0.0f;
    }
    memcpy(mout + g, keepv, sizeof *keepv * (size_t)M);
  }
  return groups;
}

void fsdp_cpu_mask_values(float *out, const float *x, const float *m, int64_t n) {
  // out (n), x (n), m (n) or NULL
  for (int64_t i = 0; i < n; i++) out[i] = value_of(x[i], m, i);
}
