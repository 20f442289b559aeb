/*
 * exact.h — private to src/kernels/cuda: the arithmetic the cuda kernels do bit for bit as the
 * cpu does, written once in plain C for the host and the device (FSDP_HD functions compile for
 * both under nvcc, and as static inline C elsewhere, so tests/c checks them on a machine
 * without a GPU against the cpu's own functions).
 *
 * What is exact here: the dtype conversions (core's dtype.c), Philox4x32-10 and its uniforms
 * (core's rng.c), the cpu's polynomial exp and the GELU built on it (cpu/vmath.h,
 * cpu/activations.c), and the normals of fsdp_rng_normal. nvcc contracts a * b + c into a
 * fused multiply-add unless told not to; the cpu (ISO C) fuses only where its code says so
 * (vmath.h's fsdp_vf_fma). So every float operation whose rounding matters is written with the
 * XF_ / XD_ macros, which are the _rn intrinsics on the device (never contracted) and plain
 * operators on the host, and XF_FMA where the cpu fuses (__fmaf_rn; fmaf on the host).
 *
 * Normals: the cpu computes logf and sincosf with the C library, which is not correctly rounded
 * (glibc's logf differs from the correctly rounded value for ~0.7% of the 2^24 possible
 * inputs, sinf/cosf for ~1.3%). The device computes the same quantities in double with basic
 * operations only (fsdp_x_log_u1, fsdp_x_sincos_u2: the same bits on host and device, correctly
 * rounded to f32 almost always) and then looks its input up in a table of fix-ups: the inputs
 * where the host's C library gives another f32 (fsdp_x_fixups, built on the host by
 * rngtab.c from the library the cpu itself calls). The result is the cpu's value, whatever C
 * library the process runs with.
 */
#ifndef FSDP_KERNELS_CUDA_EXACT_H
#define FSDP_KERNELS_CUDA_EXACT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define FSDP_HD static __host__ __device__ __forceinline__
#else
#define FSDP_HD static inline
#endif

#if defined(__CUDA_ARCH__)
#define XF_ADD(a, b) __fadd_rn((a), (b))
#define XF_SUB(a, b) __fsub_rn((a), (b))
#define XF_MUL(a, b) __fmul_rn((a), (b))
#define XF_DIV(a, b) __fdiv_rn((a), (b))
#define XF_SQRT(a) __fsqrt_rn(a)
#define XF_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#define XD_ADD(a, b) __dadd_rn((a), (b))
#define XD_SUB(a, b) __dsub_rn((a), (b))
#define XD_MUL(a, b) __dmul_rn((a), (b))
#define XD_DIV(a, b) __ddiv_rn((a), (b))
#else
#define XF_ADD(a, b) ((a) + (b))
#define XF_SUB(a, b) ((a) - (b))
#define XF_MUL(a, b) ((a) * (b))
#define XF_DIV(a, b) ((a) / (b))
#define XF_SQRT(a) sqrtf(a)
#define XF_FMA(a, b, c) fmaf((a), (b), (c))
#define XD_ADD(a, b) ((a) + (b))
#define XD_SUB(a, b) ((a) - (b))
#define XD_MUL(a, b) ((a) * (b))
#define XD_DIV(a, b) ((a) / (b))
#endif

FSDP_HD uint32_t fsdp_x_f32_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

FSDP_HD float fsdp_x_bits_f32(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

FSDP_HD uint64_t fsdp_x_f64_bits(double x) {
  uint64_t u;
  memcpy(&u, &x, 8);
  return u;
}

FSDP_HD double fsdp_x_bits_f64(uint64_t u) {
  double x;
  memcpy(&x, &u, 8);
  return x;
}

/* ---- bf16 / f16 (core's fsdp_f32_to_bf16 & co.: nearest even, NaN kept quiet with its sign) */

FSDP_HD uint16_t fsdp_x_f32_to_bf16(float x) {
  uint32_t u = fsdp_x_f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

FSDP_HD float fsdp_x_bf16_to_f32(uint16_t h) { return fsdp_x_bits_f32((uint32_t)h << 16); }

FSDP_HD uint16_t fsdp_x_f32_to_f16(float x) {
  uint32_t u = fsdp_x_f32_bits(x);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                     /* inf */
  if (a < 0x38800000u) { /* subnormal f16 */
    if (a < 0x33000000u) return sign;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    int shift = 126 - (int)(a >> 23);
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
  }
  uint32_t r = a - 0x38000000u;
  r += 0xfffu + ((r >> 13) & 1u);
  return (uint16_t)(sign | (r >> 13));
}

FSDP_HD float fsdp_x_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return fsdp_x_bits_f32(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    float v = XF_MUL((float)m, 0x1p-24f);
    return sign ? -v : v;
  }
  return fsdp_x_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* ---- Philox4x32-10 (core's rng.c) ------------------------------------------------------- */

FSDP_HD void fsdp_x_philox(uint32_t out[4], uint64_t block, uint32_t k0, uint32_t k1) {
  uint32_t c0 = (uint32_t)block, c1 = (uint32_t)(block >> 32), c2 = 0, c3 = 0;
  for (int r = 0; r < 10; r++) {
    if (r) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    uint64_t p0 = (uint64_t)0xD2511F53u * c0;
    uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
    uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
    uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
    c1 = (uint32_t)p1;
    c3 = (uint32_t)p0;
    c0 = n0, c2 = n2;
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

/* the uniform of one lane: top 24 bits, in [0, 1), exact in f32 */
FSDP_HD float fsdp_x_uniform(uint32_t lane) { return XF_MUL((float)(lane >> 8), 0x1p-24f); }

/* ---- the cpu's polynomial exp and GELU (cpu/vmath.h, cpu/activations.c) --------------------- */

FSDP_HD float fsdp_x_expf(float x) {
  const float lo = -87.3365478515625f, hi = 88.3762626647949f;
  int below = x < lo, above = x > 88.7228393554688f, nan = x != x;
  float xc = below ? lo : x;
  xc = xc > hi ? hi : xc;
  xc = nan ? 0.0f : xc;
  float fn = XF_FMA(xc, 1.44269504088896341f, 12582912.0f);
  fn = XF_SUB(fn, 12582912.0f);
  float r = XF_FMA(fn, -0.693359375f, xc);
  r = XF_FMA(fn, 2.12194440e-4f, r);
  float r2 = XF_MUL(r, r);
  float p = 1.9875691500e-4f;
  p = XF_FMA(p, r, 1.3981999507e-3f);
  p = XF_FMA(p, r, 8.3334519073e-3f);
  p = XF_FMA(p, r, 4.1665795894e-2f);
  p = XF_FMA(p, r, 1.6666665459e-1f);
  p = XF_FMA(p, r, 5.0000001201e-1f);
  p = XF_ADD(XF_FMA(p, r2, r), 1.0f);
  int32_t e = ((int32_t)fn + 127) * (1 << 23); /* fn in [-126, 128]: no overflow */
  float y = XF_MUL(p, fsdp_x_bits_f32((uint32_t)e));
  y = below ? 0.0f : y;
  y = above ? (float)INFINITY : y;
  return nan ? x : y;
}

#define FSDP_X_GELU_S 0.7978845608028654f /* sqrt(2 / pi) */
#define FSDP_X_GELU_A 0.044715f

/* x / (1 + e^{-2u}), u = s (x + a x^3) */
FSDP_HD float fsdp_x_gelu(float x) {
  float ax2 = XF_MUL(XF_MUL(FSDP_X_GELU_A, x), x);
  float u = XF_MUL(FSDP_X_GELU_S, XF_FMA(ax2, x, x));
  return XF_DIV(x, XF_ADD(1.0f, fsdp_x_expf(XF_MUL(-2.0f, u))));
}

/* q + 2 x q (1 - q) s (1 + 3 a x^2), q = sigmoid(2u) */
FSDP_HD float fsdp_x_gelu_grad(float x) {
  float x2 = XF_MUL(x, x);
  float u = XF_MUL(FSDP_X_GELU_S, XF_FMA(XF_MUL(FSDP_X_GELU_A, x2), x, x));
  float q = XF_DIV(1.0f, XF_ADD(1.0f, fsdp_x_expf(XF_MUL(-2.0f, u))));
  float du = XF_MUL(FSDP_X_GELU_S, XF_FMA(XF_MUL(3.0f, FSDP_X_GELU_A), x2, 1.0f));
  float t = XF_MUL(XF_MUL(XF_MUL(2.0f, x), q), XF_SUB(1.0f, q));
  return XF_FMA(t, du, q);
}

/* ---- normals (core's fsdp_rng_normal): log and sincos in double, then the host's fix-ups --- */

/* f32 log of u1 = (k + 1) 2^-24, k < 2^24: log(m) + e ln 2 with x = k + 1 = m 2^e,
 * m in [sqrt(1/2), sqrt(2)), log(m) = 2 atanh(s), s = (m - 1) / (m + 1) (|s| < 0.172: eleven
 * terms of the series reach 1e-18), rounded once to f32. */
FSDP_HD float fsdp_x_log_u1(uint32_t k) {
  double x = (double)(k + 1u);
  uint64_t b = fsdp_x_f64_bits(x);
  int e = (int)((b >> 52) & 0x7ff) - 1023;
  double m = fsdp_x_bits_f64((b & 0x000fffffffffffffull) | 0x3ff0000000000000ull); /* [1, 2) */
  if (m > 1.4142135623730951) m = XD_MUL(m, 0.5), e++;
  double s = XD_DIV(XD_SUB(m, 1.0), XD_ADD(m, 1.0));
  double z = XD_MUL(s, s);
  double p = 0.047619047619047616; /* 1/21 */
  p = XD_ADD(XD_MUL(p, z), 0.05263157894736842);
  p = XD_ADD(XD_MUL(p, z), 0.058823529411764705);
  p = XD_ADD(XD_MUL(p, z), 0.06666666666666667);
  p = XD_ADD(XD_MUL(p, z), 0.07692307692307693);
  p = XD_ADD(XD_MUL(p, z), 0.09090909090909091);
  p = XD_ADD(XD_MUL(p, z), 0.1111111111111111);
  p = XD_ADD(XD_MUL(p, z), 0.14285714285714285);
  p = XD_ADD(XD_MUL(p, z), 0.2);
  p = XD_ADD(XD_MUL(p, z), 0.3333333333333333);
  double logm = XD_MUL(XD_MUL(2.0, s), XD_ADD(XD_MUL(p, z), 1.0));
  double k2 = (double)(e - 24); /* log(u1) = log(x) - 24 ln 2 */
  const double ln2_hi = 0x1.62e42fee00000p-1, ln2_lo = 0x1.a39ef35793c76p-33;
  double r = XD_ADD(XD_MUL(k2, ln2_hi), XD_ADD(XD_MUL(k2, ln2_lo), logm));
  return (float)r;
}

/* f32 sin and cos of t = 2 pi (as an f32) * u2, u2 = k 2^-24: t in double, reduced by
 * multiples of pi/2 (three-part Cody-Waite: exact for the quadrants 0..4), Taylor polynomials
 * on |r| <= pi/4 to r^19 / r^20, each rounded once to f32. */
FSDP_HD void fsdp_x_sincos_u2(uint32_t k, float *sin_out, float *cos_out) {
  float u2 = XF_MUL((float)k, 0x1p-24f);
  double x = (double)XF_MUL(6.28318530717958647692f, u2);
  int q = (int)XD_ADD(XD_MUL(x, 0.6366197723675814), 0.5); /* x >= 0 */
  double dq = (double)q;
  double r = XD_SUB(x, XD_MUL(dq, 0x1.921fb54000000p+0));
  r = XD_SUB(r, XD_MUL(dq, 0x1.10b4611800000p-30));
  r = XD_SUB(r, XD_MUL(dq, 0x1.313198a2e0370p-61));
  double z = XD_MUL(r, r);
  double s = -8.22063524662433e-18; /* -1/19! */
  s = XD_ADD(XD_MUL(s, z), 2.8114572543455206e-15);
  s = XD_ADD(XD_MUL(s, z), -7.647163731819816e-13);
  s = XD_ADD(XD_MUL(s, z), 1.6059043836821613e-10);
  s = XD_ADD(XD_MUL(s, z), -2.505210838544172e-08);
  s = XD_ADD(XD_MUL(s, z), 2.7557319223985893e-06);
  s = XD_ADD(XD_MUL(s, z), -0.0001984126984126984);
  s = XD_ADD(XD_MUL(s, z), 0.008333333333333333);
  s = XD_ADD(XD_MUL(s, z), -0.16666666666666666);
  s = XD_ADD(r, XD_MUL(XD_MUL(s, z), r));
  double c = 4.110317623312165e-19; /* 1/20! */
  c = XD_ADD(XD_MUL(c, z), -1.5619206968586225e-16);
  c = XD_ADD(XD_MUL(c, z), 4.779477332387385e-14);
  c = XD_ADD(XD_MUL(c, z), -1.1470745597729725e-11);
  c = XD_ADD(XD_MUL(c, z), 2.08767569878681e-09);
  c = XD_ADD(XD_MUL(c, z), -2.755731922398589e-07);
  c = XD_ADD(XD_MUL(c, z), 2.48015873015873e-05);
  c = XD_ADD(XD_MUL(c, z), -0.001388888888888889);
  c = XD_ADD(XD_MUL(c, z), 0.041666666666666664);
  c = XD_ADD(XD_MUL(c, z), -0.5);
  c = XD_ADD(XD_MUL(c, z), 1.0);
  double sn, cs;
  switch (q & 3) {
  case 0: sn = s, cs = c; break;
  case 1: sn = c, cs = -s; break;
  case 2: sn = -s, cs = -c; break;
  default: sn = -c, cs = s; break;
  }
  *sin_out = (float)sn;
  *cos_out = (float)cs;
}

/* Inputs k (< 2^24) where the host's C library rounds to another f32 than fsdp_x_log_u1 /
 * fsdp_x_sincos_u2, and its values. Entries sorted by k; start[b] .. start[b + 1] are those
 * with k >> FSDP_X_FIX_SHIFT == b. */
#define FSDP_X_FIX_SHIFT 10
#define FSDP_X_FIX_BUCKETS (1u << (24 - FSDP_X_FIX_SHIFT))
typedef struct fsdp_x_fixups {
  const uint32_t *start; /* (FSDP_X_FIX_BUCKETS + 1) */
  const uint32_t *key;
  const float *value;
} fsdp_x_fixups;

FSDP_HD float fsdp_x_fixed(const fsdp_x_fixups *t, uint32_t k, float v) {
  uint32_t lo = t->start[k >> FSDP_X_FIX_SHIFT], hi = t->start[(k >> FSDP_X_FIX_SHIFT) + 1];
  while (lo < hi) { /* first entry >= k */
    uint32_t mid = lo + (hi - lo) / 2;
    if (t->key[mid] < k) lo = mid + 1;
    else hi = mid;
  }
  return lo < t->start[(k >> FSDP_X_FIX_SHIFT) + 1] && t->key[lo] == k ? t->value[lo] : v;
}

/* The three tables of one process: logf, sinf, cosf. */
typedef struct fsdp_x_normal_tables {
  fsdp_x_fixups log, sin, cos;
} fsdp_x_normal_tables;

#ifdef __cplusplus
extern "C" {
#endif
/* The fix-up tables of this process (host memory, built on the first call from the C library
 * the cpu calls: rngtab.c; a fraction of a second, ~4.5 MB, kept for the life of the process).
 * FSDP_ERR when out of host memory. Thread-safe. */
int fsdp_cuda_normal_fixups(const fsdp_x_normal_tables **out);
#ifdef __cplusplus
}
#endif

/* The 4 standard normals of Philox block `block` (core's normal4): Box-Muller on lanes (0, 1)
 * and (2, 3), lane 0/2 r cos, lane 1/3 r sin. */
FSDP_HD void fsdp_x_normal4(float z[4], uint64_t block, uint32_t k0, uint32_t k1,
                            const fsdp_x_normal_tables *t) {
  uint32_t r[4];
  fsdp_x_philox(r, block, k0, k1);
  for (int p = 0; p < 4; p += 2) {
    uint32_t a = r[p] >> 8, b = r[p + 1] >> 8;
    float lg = fsdp_x_fixed(&t->log, a, fsdp_x_log_u1(a));
    float rad = XF_SQRT(XF_MUL(-2.0f, lg));
    float s, c;
    fsdp_x_sincos_u2(b, &s, &c);
    s = fsdp_x_fixed(&t->sin, b, s);
    c = fsdp_x_fixed(&t->cos, b, c);
    z[p] = XF_MUL(rad, c);
    z[p + 1] = XF_MUL(rad, s);
  }
}

/* ---- masks (cpu/mask.c) ----------------------------------------------------------------------- */

/* the key ordering an element by magnitude: 0 when masked, else bits of |x| + 1 */
FSDP_HD uint32_t fsdp_x_mask_key(float x, const float *m, int64_t i) {
  uint32_t k = (fsdp_x_f32_bits(x) & 0x7FFFFFFFu) + 1u;
  if (m && m[i] == 0.0f) k = 0;
  return k;
}

/* the value N:M ranks: -1 when masked, +inf for NaN, else |x| */
FSDP_HD float fsdp_x_mask_value(float x, const float *m, int64_t i) {
  if (m && m[i] == 0.0f) return -1.0f;
  if (x != x) return (float)INFINITY;
  return fsdp_x_bits_f32(fsdp_x_f32_bits(x) & 0x7FFFFFFFu);
}

/* FNV-1a over the 4 little-endian bytes of v */
FSDP_HD uint32_t fsdp_x_fnv_u32(uint32_t h, uint32_t v) {
  for (int k = 0; k < 4; k++) {
    h ^= (v >> (8 * k)) & 0xFFu;
    h *= 16777619u;
  }
  return h;
}

#endif
