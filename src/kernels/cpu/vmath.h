/*
 * vmath.h — private to src/kernels/cpu: short SIMD vectors (GCC/Clang vector extensions) and
 * a vectorised exp / tanh for the transcendental-heavy kernels (softmax, attention softmax,
 * cross-entropy, GELU).
 *
 * Why not a plain loop calling expf: glibc's expf/tanhf are opaque calls, and with the
 * default -ftrapping-math GCC also refuses to if-convert the range clamps of a hand-written
 * exp, so nothing vectorises. Vector-extension code is SIMD by construction, needs no
 * intrinsics and compiles to SSE2 by default, AVX with -march=native (FSDP_VW lanes).
 *
 * fsdp_vf_exp: Cody-Waite range reduction x = n ln2 + r, |r| <= ln2/2, and a degree-6
 * polynomial for e^r (Cephes expf coefficients); within 2 ulp of exp over the normal range.
 * Inputs below -87.33 give 0 (so exp(-inf) = 0 for masked entries), above 88.72 give +inf,
 * NaN stays NaN. Between 88.38 and 88.72 the result saturates near 2^127 (finite): every
 * caller here passes x - max(x) <= 0 or uses the result where that range is irrelevant.
 * Results are pure functions of the inputs: identical bits on every run (sums reduce lanes in
 * a fixed order).
 */
#ifndef FSDP_KERNELS_CPU_VMATH_H
#define FSDP_KERNELS_CPU_VMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX__)
#define FSDP_VW 8
#else
#define FSDP_VW 4
#endif

typedef float fsdp_vf __attribute__((vector_size(FSDP_VW * 4)));
typedef int32_t fsdp_vi __attribute__((vector_size(FSDP_VW * 4)));

static inline fsdp_vf fsdp_vf_set(float s) { return (fsdp_vf){0} + s; }
static inline fsdp_vf fsdp_vf_load(const float *p) {
  fsdp_vf v;
  memcpy(&v, p, sizeof v); /* unaligned load */
  return v;
}
static inline void fsdp_vf_store(float *p, fsdp_vf v) { memcpy(p, &v, sizeof v); }
/* The first n (< FSDP_VW) lanes from p, the rest `fill`: lets tails run the vector code. */
static inline fsdp_vf fsdp_vf_load_part(const float *p, int n, float fill) {
  fsdp_vf v = fsdp_vf_set(fill);
  memcpy(&v, p, sizeof(float) * (size_t)n);
  return v;
}
static inline void fsdp_vf_store_part(float *p, fsdp_vf v, int n) {
  memcpy(p, &v, sizeof(float) * (size_t)n);
}
/* m ? a : b lane by lane; m lanes are 0 or -1 (a vector comparison). */
static inline fsdp_vf fsdp_vf_select(fsdp_vi m, fsdp_vf a, fsdp_vf b) {
  return (fsdp_vf)((m & (fsdp_vi)a) | (~m & (fsdp_vi)b));
}
static inline fsdp_vf fsdp_vf_max(fsdp_vf a, fsdp_vf b) { return fsdp_vf_select(a > b, a, b); }
static inline float fsdp_vf_hsum(fsdp_vf v) {
  float s = 0.0f;
  for (int i = 0; i < FSDP_VW; i++) s += v[i];
  return s;
}
static inline float fsdp_vf_hmax(fsdp_vf v) {
  float m = v[0];
  for (int i = 1; i < FSDP_VW; i++) m = v[i] > m ? v[i] : m;
  return m;
}

static inline fsdp_vf fsdp_vf_exp(fsdp_vf x) {
  const float lo = -87.3365478515625f, hi = 88.3762626647949f;
  fsdp_vi below = x < lo, above = x > 88.7228393554688f, nan = x != x;
  fsdp_vf xc = fsdp_vf_select(below, fsdp_vf_set(lo), x);
  xc = fsdp_vf_select(xc > hi, fsdp_vf_set(hi), xc);
  xc = fsdp_vf_select(nan, fsdp_vf_set(0.0f), xc); /* keep the int conversion defined */
  /* n = round(x / ln2) with the 1.5 * 2^23 trick: exact under round-to-nearest */
  fsdp_vf fn = xc * 1.44269504088896341f + 12582912.0f;
  fn = fn - 12582912.0f;
  fsdp_vf r = xc - fn * 0.693359375f; /* ln2 split in two: fn * high part is exact */
  r = r - fn * -2.12194440e-4f;
  fsdp_vf r2 = r * r;
  fsdp_vf p = fsdp_vf_set(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  fsdp_vi e = (__builtin_convertvector(fn, fsdp_vi) + 127) << 23;
  fsdp_vf y = p * (fsdp_vf)e;
  y = fsdp_vf_select(below, fsdp_vf_set(0.0f), y);
  y = fsdp_vf_select(above, fsdp_vf_set(INFINITY), y);
  return fsdp_vf_select(nan, x, y);
}

/* tanh(z) = 1 - 2 / (e^{2z} + 1): saturates cleanly at +-1; absolute error ~1e-7 (relative
 * error is larger only near 0, where the GELU callers multiply it by something small). */
static inline fsdp_vf fsdp_vf_tanh(fsdp_vf z) {
  return 1.0f - 2.0f / (fsdp_vf_exp(z * 2.0f) + 1.0f);
}

static inline float fsdp_expf_v(float x) { return fsdp_vf_exp(fsdp_vf_set(x))[0]; }

/* ---- row helpers shared by softmax, attention and cross-entropy ------------------------- */

/* max of x[0..n), n >= 1 */
static inline float fsdp_row_max(const float *x, int64_t n) {
  fsdp_vf m = fsdp_vf_set(-INFINITY);
  int64_t i = 0;
  for (; i + FSDP_VW <= n; i += FSDP_VW) m = fsdp_vf_max(fsdp_vf_load(x + i), m);
  if (i < n) m = fsdp_vf_max(fsdp_vf_load_part(x + i, (int)(n - i), -INFINITY), m);
  return fsdp_vf_hmax(m);
}

/* sum of exp(x[i] - shift); out[i] receives the terms when out is not NULL (out may equal x).
 * Lanes accumulate in float over blocks of 64 elements per lane, blocks in double. */
static inline double fsdp_row_expsum(float *out, const float *x, float shift, int64_t n) {
  double total = 0.0;
  int64_t i = 0;
  while (i < n) {
    int64_t end = i + 64 * FSDP_VW < n ? i + 64 * FSDP_VW : n;
    fsdp_vf acc = fsdp_vf_set(0.0f);
    for (; i + FSDP_VW <= end; i += FSDP_VW) {
      fsdp_vf e = fsdp_vf_exp(fsdp_vf_load(x + i) - shift);
      if (out) fsdp_vf_store(out + i, e);
      acc += e;
    }
    if (i < end) {
      int rem = (int)(end - i);
      fsdp_vf e = fsdp_vf_exp(fsdp_vf_load_part(x + i, rem, -INFINITY) - shift);
      if (out) fsdp_vf_store_part(out + i, e, rem);
      acc += e;
      i = end;
    }
    total += (double)fsdp_vf_hsum(acc);
  }
  return total;
}

/* sum of x[0..n) and dot of x, y: float lanes within blocks of 64 per lane, blocks in double */
static inline double fsdp_row_sum(const float *x, int64_t n) {
  double total = 0.0;
  int64_t i = 0;
  while (i < n) {
    int64_t end = i + 64 * FSDP_VW < n ? i + 64 * FSDP_VW : n;
    fsdp_vf acc = fsdp_vf_set(0.0f);
    for (; i + FSDP_VW <= end; i += FSDP_VW) acc += fsdp_vf_load(x + i);
    float tail = 0.0f;
    for (; i < end; i++) tail += x[i];
    total += (double)(fsdp_vf_hsum(acc) + tail);
  }
  return total;
}

static inline double fsdp_row_dot(const float *x, const float *y, int64_t n) {
  double total = 0.0;
  int64_t i = 0;
  while (i < n) {
    int64_t end = i + 64 * FSDP_VW < n ? i + 64 * FSDP_VW : n;
    fsdp_vf acc = fsdp_vf_set(0.0f);
    for (; i + FSDP_VW <= end; i += FSDP_VW) acc += fsdp_vf_load(x + i) * fsdp_vf_load(y + i);
    float tail = 0.0f;
    for (; i < end; i++) tail += x[i] * y[i];
    total += (double)(fsdp_vf_hsum(acc) + tail);
  }
  return total;
}

#endif
