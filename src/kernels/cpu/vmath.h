/*
 * vmath.h — private to src/kernels/cpu: short SIMD vectors (GCC/Clang vector extensions), a
 * vectorised exp / tanh, and the row reductions of the transcendental-heavy kernels (softmax,
 * attention softmax, cross-entropy, GELU, layernorm).
 *
 * Width: FSDP_VW lanes, the includer's choice (the vec_*.c files set 4, 8 or 16 for their
 * instruction set, isa.h), else what the compile targets (8 with AVX, 4 otherwise).
 *
 * Why not a plain loop calling expf: glibc's expf/tanhf are opaque calls, and with the
 * default -ftrapping-math GCC also refuses to if-convert the range clamps of a hand-written
 * exp, so nothing vectorises. Vector-extension code is SIMD by construction and needs no
 * intrinsics. Every function here is a sequence of IEEE operations per lane (ISO C contracts
 * nothing into fused multiply-adds; the fused ones are written out, fsdp_vf_fma, one rounding
 * at every width and level), so a lane's result does not depend on the width.
 *
 * fsdp_vf_exp: Cody-Waite range reduction x = n ln2 + r, |r| <= ln2/2, and a degree-6
 * polynomial for e^r (Cephes expf coefficients), evaluated in fused multiply-adds (half the
 * operations of separate ones, and one rounding a step); within 8.5e-8 relative of exp over the
 * normal range (measured over every float; tests/c/test_kernels.c holds it to 2.4e-7).
 * Inputs below -87.33 give 0 (so exp(-inf) = 0 for masked entries), above 88.72 give +inf,
 * NaN stays NaN. Between 88.38 and 88.72 the result saturates near 2^127 (finite): every
 * caller here passes x - max(x) <= 0 or uses the result where that range is irrelevant.
 *
 * Row reductions accumulate in FSDP_VL = 16 lanes whatever the width (element i of a row
 * goes to lane i % 16; a lane set is FSDP_VL / FSDP_VW vectors), four 16-element groups
 * added as a tree before they reach the accumulator, in float over blocks of FSDP_VBLOCK
 * elements; then the lanes fold in a fixed tree (lane l += lane l + h for h = 8, 4, 2, 1) and
 * blocks add in double. So sums are the same bits at every width and on every run: results
 * do not depend on the instruction set the process picked.
 */
#ifndef FSDP_KERNELS_CPU_VMATH_H
#define FSDP_KERNELS_CPU_VMATH_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#if defined(__clang__)
#pragma clang fp contract(off) /* GCC in ISO C mode never contracts; clang would */
#endif

#ifndef FSDP_VW
#if defined(__AVX__)
#define FSDP_VW 8
#else
#define FSDP_VW 4
#endif
#endif

#define FSDP_VL 16                /* lanes of every row reduction */
#define FSDP_VK (FSDP_VL / FSDP_VW) /* vectors in a lane set */
#define FSDP_VBLOCK (64 * FSDP_VL) /* elements summed in float before the double total */

typedef float fsdp_vf __attribute__((vector_size(FSDP_VW * 4)));
typedef int32_t fsdp_vi __attribute__((vector_size(FSDP_VW * 4)));

static inline fsdp_vf fsdp_vf_set(float s) { return (fsdp_vf){0} + s; }
/* s in every lane, -0 kept: one broadcast (from memory where s was just loaded). fsdp_vf_set's
 * 0 + s is an add the compiler must keep (it turns -0 into +0) before the broadcast: two more
 * floating-point operations, which slowed attention's products at AVX2 by up to a fifth. */
#if defined(__clang__)
static inline fsdp_vf fsdp_vf_dup(float s) {
  fsdp_vf v;
  for (int l = 0; l < FSDP_VW; l++) v[l] = s;
  return v;
}
#else
static inline fsdp_vf fsdp_vf_dup(float s) {
  fsdp_vf v = {s};
  return __builtin_shuffle(v, (fsdp_vi){0});
}
#endif
static inline fsdp_vf fsdp_vf_load(const float *p) {
  fsdp_vf v;
  memcpy(&v, p, sizeof v); /* unaligned load */
  return v;
}
static inline void fsdp_vf_store(float *p, fsdp_vf v) { memcpy(p, &v, sizeof v); }
/* The first n (0 <= n <= FSDP_VW) lanes from p, the rest `fill`: lets tails run the vector
 * code. */
#if FSDP_VW == 16 && defined(__AVX512F__)
/* Masked loads and stores where the includer compiles for AVX-512 or AVX2: the memcpy form
 * goes through the stack (a variable-length copy, then a vector reload that store forwarding
 * cannot serve), which made short rows (attention's causal rows, 1..T long) cost several times
 * their length. Masked-off lanes are never touched, so reading up to a page end is safe. */
#include <immintrin.h>
static inline fsdp_vf fsdp_vf_load_part(const float *p, int n, float fill) {
  return (fsdp_vf)_mm512_mask_loadu_ps(_mm512_set1_ps(fill), (__mmask16)((1u << n) - 1u), p);
}
static inline void fsdp_vf_store_part(float *p, fsdp_vf v, int n) {
  _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1u), (__m512)v);
}
#elif FSDP_VW == 8 && defined(__AVX2__)
#include <immintrin.h>
static inline __m256i fsdp_vf_part_mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline fsdp_vf fsdp_vf_load_part(const float *p, int n, float fill) {
  __m256i m = fsdp_vf_part_mask(n);
  return (fsdp_vf)_mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m),
                                   _mm256_castsi256_ps(m));
}
static inline void fsdp_vf_store_part(float *p, fsdp_vf v, int n) {
  _mm256_maskstore_ps(p, fsdp_vf_part_mask(n), (__m256)v);
}
#else
static inline fsdp_vf fsdp_vf_load_part(const float *p, int n, float fill) {
  fsdp_vf v = fsdp_vf_set(fill);
  memcpy(&v, p, sizeof(float) * (size_t)n);
  return v;
}
static inline void fsdp_vf_store_part(float *p, fsdp_vf v, int n) {
  memcpy(p, &v, sizeof(float) * (size_t)n);
}
#endif
/* m ? a : b lane by lane; m lanes are 0 or -1 (a vector comparison). */
static inline fsdp_vf fsdp_vf_select(fsdp_vi m, fsdp_vf a, fsdp_vf b) {
  return (fsdp_vf)((m & (fsdp_vi)a) | (~m & (fsdp_vi)b));
}
static inline fsdp_vf fsdp_vf_max(fsdp_vf a, fsdp_vf b) { return fsdp_vf_select(a > b, a, b); }
/* Lanes of one vector summed left to right (attention's and reduce.c's own loops). */
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

#define FSDP_EXP_LO -87.3365478515625f

/* a * b + c rounded once, lane by lane, so every width and level gives the same bits: the
 * fused multiply-add instruction where the includer compiles for one (the AVX-512 and AVX2
 * levels), else the correctly rounded fmaf. */
#if FSDP_VW == 16 && defined(__AVX512F__)
#include <immintrin.h>
static inline fsdp_vf fsdp_vf_fma(fsdp_vf a, fsdp_vf b, fsdp_vf c) {
  return (fsdp_vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#elif FSDP_VW == 8 && defined(__FMA__)
#include <immintrin.h>
static inline fsdp_vf fsdp_vf_fma(fsdp_vf a, fsdp_vf b, fsdp_vf c) {
  return (fsdp_vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#elif defined(__x86_64__) && defined(__GNUC__)
/* Baseline x86-64 (the scalar level): one call, whose FMA clone the loader picks where the
 * processor has the instruction (GCC's target_clones, an ifunc), else the C library's fmaf
 * lane by lane (software, slow, exact). Inlined fmaf calls would cost four library calls a
 * vector: the transcendental kernels ran 10x slower at this level that way, 1.7-2.2x with the
 * clone. */
__attribute__((target_clones("fma", "default"), noinline, unused)) static fsdp_vf
fsdp_vf_fma(fsdp_vf a, fsdp_vf b, fsdp_vf c) {
  fsdp_vf r;
  for (int i = 0; i < FSDP_VW; i++) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
}
#else
static inline fsdp_vf fsdp_vf_fma(fsdp_vf a, fsdp_vf b, fsdp_vf c) {
  fsdp_vf r;
  for (int i = 0; i < FSDP_VW; i++) r[i] = fmaf(a[i], b[i], c[i]);
  return r;
}
#endif

/* e^xc for xc already clamped to [lo, hi] (no NaN) */
static inline fsdp_vf fsdp_vf_exp_core(fsdp_vf xc) {
  /* n = round(x / ln2) with the 1.5 * 2^23 trick: exact under round-to-nearest */
  fsdp_vf fn = fsdp_vf_fma(xc, fsdp_vf_set(1.44269504088896341f), fsdp_vf_set(12582912.0f));
  fn = fn - 12582912.0f;
  /* r = x - n ln2 with ln2 in two parts: the first product is exact, the second fused */
  fsdp_vf r = fsdp_vf_fma(fn, fsdp_vf_set(-0.693359375f), xc);
  r = fsdp_vf_fma(fn, fsdp_vf_set(2.12194440e-4f), r);
  fsdp_vf r2 = r * r;
  fsdp_vf p = fsdp_vf_set(1.9875691500e-4f);
  p = fsdp_vf_fma(p, r, fsdp_vf_set(1.3981999507e-3f));
  p = fsdp_vf_fma(p, r, fsdp_vf_set(8.3334519073e-3f));
  p = fsdp_vf_fma(p, r, fsdp_vf_set(4.1665795894e-2f));
  p = fsdp_vf_fma(p, r, fsdp_vf_set(1.6666665459e-1f));
  p = fsdp_vf_fma(p, r, fsdp_vf_set(5.0000001201e-1f));
  p = fsdp_vf_fma(p, r2, r) + 1.0f;
  fsdp_vi e = (__builtin_convertvector(fn, fsdp_vi) + 127) << 23;
  return p * (fsdp_vf)e;
}

static inline fsdp_vf fsdp_vf_exp(fsdp_vf x) {
  const float lo = FSDP_EXP_LO, hi = 88.3762626647949f;
  fsdp_vi below = x < lo, above = x > 88.7228393554688f, nan = x != x;
  /* clamp to [lo, hi]; a NaN lane becomes lo (x > lo is false), which keeps the int conversion
   * defined, and takes x back at the end */
  fsdp_vf xc = fsdp_vf_select(x > lo, x, fsdp_vf_set(lo));
  xc = fsdp_vf_select(xc < hi, xc, fsdp_vf_set(hi));
  fsdp_vf y = fsdp_vf_exp_core(xc);
  y = fsdp_vf_select(below, fsdp_vf_set(0.0f), y);
  y = fsdp_vf_select(above, fsdp_vf_set(INFINITY), y);
  return fsdp_vf_select(nan, x, y);
}

/* fsdp_vf_exp for x <= 0 or NaN only (x - max, x - logsumexp): the same results there without
 * the upper clamp */
static inline fsdp_vf fsdp_vf_exp_nonpos(fsdp_vf x) {
  const float lo = FSDP_EXP_LO;
  fsdp_vi below = x < lo, nan = x != x;
  fsdp_vf y = fsdp_vf_exp_core(fsdp_vf_select(x > lo, x, fsdp_vf_set(lo)));
  y = fsdp_vf_select(below, fsdp_vf_set(0.0f), y);
  return fsdp_vf_select(nan, x, y);
}

/* tanh(z) = 1 - 2 / (e^{2z} + 1): saturates cleanly at +-1; absolute error ~1e-7 (relative
 * error is larger only near 0, where the GELU callers multiply it by something small). */
static inline fsdp_vf fsdp_vf_tanh(fsdp_vf z) {
  return 1.0f - 2.0f / (fsdp_vf_exp(z * 2.0f) + 1.0f);
}

static inline float fsdp_expf_v(float x) { return fsdp_vf_exp(fsdp_vf_set(x))[0]; }

/* ---- 16-lane sets: the reductions' fixed order ---------------------------------------------- */

/* The FSDP_VW lanes starting at element s of a row of n, lanes past the end `fill` (any s). */
static inline fsdp_vf fsdp_vl_load(const float *x, int64_t s, int64_t n, float fill) {
  if (s + FSDP_VW <= n) return fsdp_vf_load(x + s);
  return fsdp_vf_load_part(x + s, s < n ? (int)(n - s) : 0, fill);
}
static inline void fsdp_vl_store(float *x, int64_t s, int64_t n, fsdp_vf v) {
  if (s + FSDP_VW <= n) fsdp_vf_store(x + s, v);
  else if (s < n) fsdp_vf_store_part(x + s, v, (int)(n - s));
}
/* a full vector at s, or (tail) fsdp_vl_load's: tail is a constant at every call, so main
 * loops compile without the branch */
static inline fsdp_vf fsdp_vt_load(const float *x, int64_t s, int64_t n, float fill, int tail) {
  return tail ? fsdp_vl_load(x, s, n, fill) : fsdp_vf_load(x + s);
}
static inline void fsdp_vt_store(float *x, int64_t s, int64_t n, fsdp_vf v, int tail) {
  if (tail) fsdp_vl_store(x, s, n, v);
  else fsdp_vf_store(x + s, v);
}

/* bf16 lanes, for the kernels that read and write bf16 themselves (half.c's native slots).
 * A load widens exactly (lanes past n read 0); a store rounds to nearest even and keeps NaN
 * quiet: convert.c's fsdp_cpu_f32_to_bf16 lane by lane, so these kernels give the bits of the
 * f32 kernel between a widening and a rounding pass. */
typedef uint16_t fsdp_vh __attribute__((vector_size(FSDP_VW * 2)));
typedef uint32_t fsdp_vu __attribute__((vector_size(FSDP_VW * 4)));

static inline fsdp_vf fsdp_vh_widen(fsdp_vh h) {
  return (fsdp_vf)(__builtin_convertvector(h, fsdp_vu) << 16);
}
static inline fsdp_vh fsdp_vh_round_int(fsdp_vf v) {
  fsdp_vu x = (fsdp_vu)v;
  fsdp_vu r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  fsdp_vu q = (x >> 16) | 0x40u;
  fsdp_vi nan = (x & 0x7fffffffu) > 0x7f800000u;
  return __builtin_convertvector((fsdp_vu)((nan & (fsdp_vi)q) | (~nan & (fsdp_vi)r)), fsdp_vh);
}
#if defined(FSDP_VH_HW) && FSDP_VW == 16
/* AVX512_BF16's VCVTNEPS2BF16 (the including file, vec_avx512bf16.c, targets it) rounds 16
 * lanes in one instruction where the integer sequence above takes about ten; a vector holding
 * a subnormal (rare: below 1.2e-38), which the instruction reads as zero, takes the integer
 * sequence (isa.h, fsdp_cpu_subnormal16), so the bits are the same. */
#include "kernels/cpu/isa.h"
static inline fsdp_vh fsdp_vh_round(fsdp_vf v) {
  if (__builtin_expect(fsdp_cpu_subnormal16((__m512i)v) != 0, 0)) return fsdp_vh_round_int(v);
  return (fsdp_vh)_mm512_cvtneps_pbh((__m512)v);
}
#else
static inline fsdp_vh fsdp_vh_round(fsdp_vf v) { return fsdp_vh_round_int(v); }
#endif
/* The first n (0 <= n <= FSDP_VW) bf16 lanes from p, the rest 0; and their store. Masked
 * where the level has them, as fsdp_vf_load_part: the memcpy form is a call per row end (GCC
 * does not inline the variable-length copy) and a reload through the stack, and attention's
 * causal rows all end in one. AVX2 has no 16-bit masks: whole 32-bit pairs masked, then the
 * odd last lane on its own (nothing past p[n - 1] is touched either way). These and the loads
 * and stores below are always inlined: left to itself GCC kept the tail forms out of line in
 * the large bf16 bodies. */
#define FSDP_VM_INLINE static inline __attribute__((always_inline))
#if FSDP_VW == 16 && defined(__AVX512BW__) && defined(__AVX512VL__)
FSDP_VM_INLINE fsdp_vh fsdp_vh_load_part(const uint16_t *p, int n) {
  return (fsdp_vh)_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), p);
}
FSDP_VM_INLINE void fsdp_vh_store_part(uint16_t *p, fsdp_vh h, int n) {
  _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1u), (__m256i)h);
}
#elif FSDP_VW == 8 && defined(__AVX2__)
FSDP_VM_INLINE __m128i fsdp_vh_pair_mask(int n) {
  return _mm_cmpgt_epi32(_mm_set1_epi32(n >> 1), _mm_setr_epi32(0, 1, 2, 3));
}
FSDP_VM_INLINE fsdp_vh fsdp_vh_load_part(const uint16_t *p, int n) {
  __m128i v = _mm_maskload_epi32((const int *)(const void *)p, fsdp_vh_pair_mask(n));
  if (n & 1) {
    __m128i at = _mm_cmpeq_epi16(_mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7),
                                 _mm_set1_epi16((short)(n - 1)));
    v = _mm_blendv_epi8(v, _mm_set1_epi16((short)p[n - 1]), at);
  }
  return (fsdp_vh)v;
}
FSDP_VM_INLINE void fsdp_vh_store_part(uint16_t *p, fsdp_vh h, int n) {
  _mm_maskstore_epi32((int *)(void *)p, fsdp_vh_pair_mask(n), (__m128i)h);
  if (n & 1) p[n - 1] = h[n - 1];
}
#else
FSDP_VM_INLINE fsdp_vh fsdp_vh_load_part(const uint16_t *p, int n) {
  fsdp_vh h = {0};
  memcpy(&h, p, sizeof(uint16_t) * (size_t)n);
  return h;
}
FSDP_VM_INLINE void fsdp_vh_store_part(uint16_t *p, fsdp_vh h, int n) {
  memcpy(p, &h, sizeof(uint16_t) * (size_t)n);
}
#endif
/* a full vector at s, or (tail: a constant at every call) the lanes of [s, n) */
FSDP_VM_INLINE fsdp_vf fsdp_vh_load(const uint16_t *x, int64_t s, int64_t n, int tail) {
  fsdp_vh h;
  if (!tail || s + FSDP_VW <= n) memcpy(&h, x + s, sizeof h);
  else h = fsdp_vh_load_part(x + s, s < n ? (int)(n - s) : 0);
  return fsdp_vh_widen(h);
}
FSDP_VM_INLINE void fsdp_vh_store(uint16_t *x, int64_t s, int64_t n, fsdp_vf v, int tail) {
  fsdp_vh h = fsdp_vh_round(v);
  if (!tail || s + FSDP_VW <= n) memcpy(x + s, &h, sizeof h);
  else if (s < n) fsdp_vh_store_part(x + s, h, (int)(n - s));
}

/* lane l += lane l + h for h = 8, 4, 2, 1: the same tree at every width. Across the lane set's
 * vectors that is whole-vector adds, within one vector a rotate and add (only lanes l < h
 * matter at each step), so no lane goes through memory. */
#if defined(__clang__)
static inline fsdp_vf fsdp_vf_down(fsdp_vf v, int h) { /* lane l <- lane l + h */
  fsdp_vf r = v;
  for (int l = 0; l + h < FSDP_VW; l++) r[l] = v[l + h];
  return r;
}
#else
static inline fsdp_vf fsdp_vf_down(fsdp_vf v, int h) { /* lane l <- lane (l + h) % VW */
  fsdp_vi idx;
  for (int l = 0; l < FSDP_VW; l++) idx[l] = (l + h) % FSDP_VW;
  return __builtin_shuffle(v, idx);
}
#endif
static inline float fsdp_vl_fold_sum(const fsdp_vf *acc) {
  fsdp_vf v[FSDP_VK];
  for (int k = 0; k < FSDP_VK; k++) v[k] = acc[k];
  for (int h = FSDP_VK / 2; h >= 1; h /= 2)
    for (int k = 0; k < h; k++) v[k] += v[k + h];
  for (int h = FSDP_VW / 2; h >= 1; h /= 2) v[0] += fsdp_vf_down(v[0], h);
  return v[0][0];
}
static inline float fsdp_vl_fold_max(const fsdp_vf *acc) {
  fsdp_vf v[FSDP_VK];
  for (int k = 0; k < FSDP_VK; k++) v[k] = acc[k];
  for (int h = FSDP_VK / 2; h >= 1; h /= 2)
    for (int k = 0; k < h; k++) v[k] = fsdp_vf_select(v[k + h] > v[k], v[k + h], v[k]);
  for (int h = FSDP_VW / 2; h >= 1; h /= 2) {
    fsdp_vf d = fsdp_vf_down(v[0], h);
    v[0] = fsdp_vf_select(d > v[0], d, v[0]);
  }
  return v[0][0];
}

/* ---- row helpers shared by softmax, attention, cross-entropy and layernorm ---------------
 * Each walks a block in quads of four 16-element groups: lane set k gets
 * acc += (t0 + t1) + (t2 + t3), one dependent add per 64 elements; the last, partial quad
 * reads past-the-end lanes as a neutral fill. */

#define FSDP_VQ (4 * FSDP_VL)

/* max of x[0..n), n >= 1 (NaN entries are passed over) */
static inline void fsdp_row_max_quad(fsdp_vf *m, const float *x, int64_t i, int64_t n,
                                     int tail) {
  for (int k = 0; k < FSDP_VK; k++) {
    int64_t s = i + k * FSDP_VW;
    fsdp_vf t0 = fsdp_vt_load(x, s, n, -INFINITY, tail);
    fsdp_vf t1 = fsdp_vt_load(x, s + FSDP_VL, n, -INFINITY, tail);
    fsdp_vf t2 = fsdp_vt_load(x, s + 2 * FSDP_VL, n, -INFINITY, tail);
    fsdp_vf t3 = fsdp_vt_load(x, s + 3 * FSDP_VL, n, -INFINITY, tail);
    m[k] = fsdp_vf_max(fsdp_vf_max(fsdp_vf_max(t0, t1), fsdp_vf_max(t2, t3)), m[k]);
  }
}
static inline float fsdp_row_max(const float *x, int64_t n) {
  fsdp_vf m[FSDP_VK];
  for (int k = 0; k < FSDP_VK; k++) m[k] = fsdp_vf_set(-INFINITY);
  int64_t i = 0;
  for (; i + FSDP_VQ <= n; i += FSDP_VQ) fsdp_row_max_quad(m, x, i, n, 0);
  if (i < n) fsdp_row_max_quad(m, x, i, n, 1);
  return fsdp_vl_fold_max(m);
}

/* sum of exp(x[i] - shift), shift >= max(x) (the exponents are <= 0: fsdp_vf_exp_nonpos); out[i]
 * receives the terms when out is not NULL (out may equal x) */
static inline fsdp_vf fsdp_row_exp_term(float *out, const float *x, float shift, int64_t s,
                                        int64_t n, int tail) {
  /* a vector wholly past the end: exp(-inf) is +0 exactly, so the sum's bits are the same
   * without computing it (a short row's last quad is mostly such vectors) */
  if (tail && s >= n) return fsdp_vf_set(0.0f);
  fsdp_vf e = fsdp_vf_exp_nonpos(fsdp_vt_load(x, s, n, -INFINITY, tail) - shift);
  if (out) fsdp_vt_store(out, s, n, e, tail);
  return e;
}
static inline void fsdp_row_expsum_quad(fsdp_vf *acc, float *out, const float *x, float shift,
                                        int64_t i, int64_t n, int tail) {
  for (int k = 0; k < FSDP_VK; k++) {
    int64_t s = i + k * FSDP_VW;
    fsdp_vf t0 = fsdp_row_exp_term(out, x, shift, s, n, tail);
    fsdp_vf t1 = fsdp_row_exp_term(out, x, shift, s + FSDP_VL, n, tail);
    fsdp_vf t2 = fsdp_row_exp_term(out, x, shift, s + 2 * FSDP_VL, n, tail);
    fsdp_vf t3 = fsdp_row_exp_term(out, x, shift, s + 3 * FSDP_VL, n, tail);
    acc[k] += (t0 + t1) + (t2 + t3);
  }
}
static inline double fsdp_row_expsum(float *out, const float *x, float shift, int64_t n) {
  double total = 0.0;
  for (int64_t b = 0; b < n; b += FSDP_VBLOCK) {
    int64_t end = n - b < FSDP_VBLOCK ? n : b + FSDP_VBLOCK, i = b;
    fsdp_vf acc[FSDP_VK];
    for (int k = 0; k < FSDP_VK; k++) acc[k] = fsdp_vf_set(0.0f);
    for (; i + FSDP_VQ <= end; i += FSDP_VQ) fsdp_row_expsum_quad(acc, out, x, shift, i, end, 0);
    if (i < end) fsdp_row_expsum_quad(acc, out, x, shift, i, end, 1);
    total += (double)fsdp_vl_fold_sum(acc);
  }
  return total;
}

/* sum of x[i] * y[i] (y NULL: of x[i]); x f32, or bf16 (xh) widened exactly, which gives the
 * terms and the tree of the widened f32 row, so the same bits. xh is a constant at every call,
 * and these are always inlined so that no loop tests it. */
FSDP_VM_INLINE fsdp_vf fsdp_row_dot_term(const void *x, bool xh, const float *y, int64_t s,
                                         int64_t n, int tail) {
  fsdp_vf v = xh ? fsdp_vh_load(x, s, n, tail) : fsdp_vt_load(x, s, n, 0.0f, tail);
  return y ? v * fsdp_vt_load(y, s, n, 0.0f, tail) : v;
}
FSDP_VM_INLINE void fsdp_row_dot_quad(fsdp_vf *acc, const void *x, bool xh, const float *y,
                                      int64_t i, int64_t n, int tail) {
  for (int k = 0; k < FSDP_VK; k++) {
    int64_t s = i + k * FSDP_VW;
    fsdp_vf t0 = fsdp_row_dot_term(x, xh, y, s, n, tail);
    fsdp_vf t1 = fsdp_row_dot_term(x, xh, y, s + FSDP_VL, n, tail);
    fsdp_vf t2 = fsdp_row_dot_term(x, xh, y, s + 2 * FSDP_VL, n, tail);
    fsdp_vf t3 = fsdp_row_dot_term(x, xh, y, s + 3 * FSDP_VL, n, tail);
    acc[k] += (t0 + t1) + (t2 + t3);
  }
}
FSDP_VM_INLINE double fsdp_row_dot_x(const void *x, bool xh, const float *y, int64_t n) {
  double total = 0.0;
  for (int64_t b = 0; b < n; b += FSDP_VBLOCK) {
    int64_t end = n - b < FSDP_VBLOCK ? n : b + FSDP_VBLOCK, i = b;
    fsdp_vf acc[FSDP_VK];
    for (int k = 0; k < FSDP_VK; k++) acc[k] = fsdp_vf_set(0.0f);
    for (; i + FSDP_VQ <= end; i += FSDP_VQ) fsdp_row_dot_quad(acc, x, xh, y, i, end, 0);
    if (i < end) fsdp_row_dot_quad(acc, x, xh, y, i, end, 1);
    total += (double)fsdp_vl_fold_sum(acc);
  }
  return total;
}
static inline double fsdp_row_dot(const float *x, const float *y, int64_t n) {
  return fsdp_row_dot_x(x, false, y, n);
}
/* Two rows at once: fsdp_row_max, fsdp_row_expsum (out = x) and fsdp_row_dot_x of rows of at
 * most FSDP_VBLOCK elements. A short row's max, exponentials, fold and division form one chain
 * of dependent steps; two independent chains keep the pipes busier (attention's causal rows, 1
 * to T long). Both rows' quads are walked in one loop while both have full ones, then each
 * row's rest; every row gets the quads and the fold it has alone, so its bits are its own
 * (tests/c/test_isa.c, test_att_rows_grouping, holds a tile's rows to the rows one at a time).
 * The one-row helpers above keep loops of their own: walking them through fsdp_row_rest too
 * changed what GCC inlined and cost short softmax rows 15% (64 elements: 1.14 -> 1.33 ns). */
typedef struct {
  const void *x; /* f32, or bf16 for FSDP_ROW_DOT_H */
  float *out;    /* FSDP_ROW_EXPSUM: the terms (x itself) */
  const float *y;
  float shift;
  int64_t n;
} fsdp_row_arg;
enum { FSDP_ROW_MAX, FSDP_ROW_EXPSUM, FSDP_ROW_DOT, FSDP_ROW_DOT_H };

FSDP_VM_INLINE void fsdp_row_quad_of(int kind, fsdp_vf *acc, const fsdp_row_arg *r, int64_t i,
                                     int tail) {
  if (kind == FSDP_ROW_MAX) fsdp_row_max_quad(acc, (const float *)r->x, i, r->n, tail);
  else if (kind == FSDP_ROW_EXPSUM)
    fsdp_row_expsum_quad(acc, r->out, (const float *)r->x, r->shift, i, r->n, tail);
  else fsdp_row_dot_quad(acc, r->x, kind == FSDP_ROW_DOT_H, r->y, i, r->n, tail);
}
/* row r's quads from element i on */
FSDP_VM_INLINE void fsdp_row_rest(int kind, fsdp_vf *acc, const fsdp_row_arg *r, int64_t i) {
  for (; i < r->n; i += FSDP_VQ)
    if (i + FSDP_VQ <= r->n) fsdp_row_quad_of(kind, acc, r, i, 0);
    else fsdp_row_quad_of(kind, acc, r, i, 1);
}
/* a (r) and b (s): the two rows' lane sets, initialised by the caller (each set addressed
 * directly, never through a pointer chosen at run time, so both stay in registers) */
FSDP_VM_INLINE void fsdp_row_pair(int kind, fsdp_vf *a, const fsdp_row_arg *r, fsdp_vf *b,
                                  const fsdp_row_arg *s) {
  const int64_t n = r->n < s->n ? r->n : s->n;
  int64_t i = 0;
  for (; i + FSDP_VQ <= n; i += FSDP_VQ) {
    fsdp_row_quad_of(kind, a, r, i, 0);
    fsdp_row_quad_of(kind, b, s, i, 0);
  }
  fsdp_row_rest(kind, a, r, i);
  fsdp_row_rest(kind, b, s, i);
}
static inline void fsdp_row_max2(const float *x0, int64_t n0, const float *x1, int64_t n1,
                                 float *m0, float *m1) {
  fsdp_vf a[FSDP_VK], b[FSDP_VK];
  for (int k = 0; k < FSDP_VK; k++) a[k] = b[k] = fsdp_vf_set(-INFINITY);
  const fsdp_row_arg r = {.x = x0, .n = n0}, s = {.x = x1, .n = n1};
  fsdp_row_pair(FSDP_ROW_MAX, a, &r, b, &s);
  *m0 = fsdp_vl_fold_max(a);
  *m1 = fsdp_vl_fold_max(b);
}
/* the sums' totals as the one-row helpers make them, one block: 0.0 + the folded lanes */
FSDP_VM_INLINE void fsdp_row_pair_sums(int kind, const fsdp_row_arg *r, const fsdp_row_arg *s,
                                       double *t0, double *t1) {
  fsdp_vf a[FSDP_VK], b[FSDP_VK];
  for (int k = 0; k < FSDP_VK; k++) a[k] = b[k] = fsdp_vf_set(0.0f);
  fsdp_row_pair(kind, a, r, b, s);
  double u0 = 0.0, u1 = 0.0;
  u0 += (double)fsdp_vl_fold_sum(a);
  u1 += (double)fsdp_vl_fold_sum(b);
  *t0 = u0;
  *t1 = u1;
}
static inline void fsdp_row_expsum2(float *x0, float s0, int64_t n0, float *x1, float s1,
                                    int64_t n1, double *e0, double *e1) {
  const fsdp_row_arg r = {.x = x0, .out = x0, .shift = s0, .n = n0},
                     s = {.x = x1, .out = x1, .shift = s1, .n = n1};
  fsdp_row_pair_sums(FSDP_ROW_EXPSUM, &r, &s, e0, e1);
}
FSDP_VM_INLINE void fsdp_row_dot2_x(const void *x0, const float *y0, int64_t n0, const void *x1,
                                    const float *y1, int64_t n1, bool xh, double *d0,
                                    double *d1) {
  const fsdp_row_arg r = {.x = x0, .y = y0, .n = n0}, s = {.x = x1, .y = y1, .n = n1};
  fsdp_row_pair_sums(xh ? FSDP_ROW_DOT_H : FSDP_ROW_DOT, &r, &s, d0, d1);
}

/* sum of x[0..n) */
static inline double fsdp_row_sum(const float *x, int64_t n) { return fsdp_row_dot(x, NULL, n); }

/* sum of (x[i] - m)^2: layernorm's centred variance */
static inline fsdp_vf fsdp_row_sqdev_term(const float *x, float m, int64_t s, int64_t n,
                                          int tail) {
  fsdp_vf d = fsdp_vt_load(x, s, n, m, tail) - m; /* fill m: past the end d = 0 */
  return d * d;
}
static inline void fsdp_row_sqdev_quad(fsdp_vf *acc, const float *x, float m, int64_t i,
                                       int64_t n, int tail) {
  for (int k = 0; k < FSDP_VK; k++) {
    int64_t s = i + k * FSDP_VW;
    fsdp_vf t0 = fsdp_row_sqdev_term(x, m, s, n, tail);
    fsdp_vf t1 = fsdp_row_sqdev_term(x, m, s + FSDP_VL, n, tail);
    fsdp_vf t2 = fsdp_row_sqdev_term(x, m, s + 2 * FSDP_VL, n, tail);
    fsdp_vf t3 = fsdp_row_sqdev_term(x, m, s + 3 * FSDP_VL, n, tail);
    acc[k] += (t0 + t1) + (t2 + t3);
  }
}
static inline double fsdp_row_sqdev(const float *x, float m, int64_t n) {
  double total = 0.0;
  for (int64_t b = 0; b < n; b += FSDP_VBLOCK) {
    int64_t end = n - b < FSDP_VBLOCK ? n : b + FSDP_VBLOCK, i = b;
    fsdp_vf acc[FSDP_VK];
    for (int k = 0; k < FSDP_VK; k++) acc[k] = fsdp_vf_set(0.0f);
    for (; i + FSDP_VQ <= end; i += FSDP_VQ) fsdp_row_sqdev_quad(acc, x, m, i, end, 0);
    if (i < end) fsdp_row_sqdev_quad(acc, x, m, i, end, 1);
    total += (double)fsdp_vl_fold_sum(acc);
  }
  return total;
}

#endif
