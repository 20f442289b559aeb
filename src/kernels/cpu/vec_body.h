/*
 * vec_body.h — the bodies of the element-wise kernels, written once on FSDP_VW-lane vectors
 * and compiled per instruction set: vec_scalar.c, vec_avx2.c and vec_avx512.c each set the
 * width and a target, then include this file, which defines static functions and the level's
 * table (FSDP_VEC_TABLE, an fsdp_cpu_vec_i of isa.h). Nothing else includes it.
 *
 * The arithmetic is that of the scalar formulas in the public kernels' comments, operation
 * for operation (IEEE per lane; fused multiply-adds only where written, vmath.h's fsdp_vf_fma),
 * so element-wise results are the same bits at every width; sums use vmath.h's fixed 16-lane
 * order. Tails run the same vector code on partial loads (fsdp_vl_load), so a value's result
 * does not depend on where it sits.
 */
#ifndef FSDP_VEC_TABLE
#error "vec_body.h is included by vec_scalar.c, vec_avx2.c and vec_avx512.c only"
#endif

#include <stdbool.h>

#include "kernels/cpu/isa.h"
#include "kernels/cpu/vmath.h"

#define VW FSDP_VW
#define VINLINE static inline __attribute__((always_inline))
#define LD(p, i, n, fill) fsdp_vl_load((p), (i), (n), (fill))
#define ST(p, i, n, v) fsdp_vl_store((p), (i), (n), (v))

VINLINE fsdp_vf vset(float s) { return fsdp_vf_set(s); }

/* ---- activations --------------------------------------------------------------------------- */

static void relu_forward(float *out, const float *inp, int64_t n) {
  for (int64_t i = 0; i < n; i += VW) {
    fsdp_vf x = LD(inp, i, n, 0.0f);
    /* not (x <= 0) rather than x > 0: a NaN passes through, as max(x, 0) would not hide it */
    ST(out, i, n, fsdp_vf_select(~(x <= 0.0f), x, vset(0.0f)));
  }
}

static void relu_backward(float *dinp, const float *dout, const float *inp, int64_t n) {
  for (int64_t i = 0; i < n; i += VW) {
    fsdp_vf x = LD(inp, i, n, 0.0f), g = LD(dout, i, n, 0.0f);
    ST(dinp, i, n, LD(dinp, i, n, 0.0f) + fsdp_vf_select(x > 0.0f, g, vset(0.0f)));
  }
}

#define GELU_S 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_A 0.044715f
/* -2 s, so -2u is one multiply: scaling by 2 is exact, so (-2 s) t == -2 (s t) except where s t
 * is subnormal, and there e^{-2u} is 1 either way */
#define GELU_M2S (-2.0f * GELU_S)

/* 0.5 x (1 + tanh(u)) == x * sigmoid(2u) == x / (1 + e^{-2u}),  u = s (x + a x^3): one exp and
 * one division, and no 1 + tanh cancellation for negative x. x + a x^3 is (a x x) x + x, fused. */
static inline fsdp_vf gelu_v(fsdp_vf x) {
  return x / (1.0f + fsdp_vf_exp(GELU_M2S * fsdp_vf_fma(GELU_A * x * x, x, x)));
}

/* d gelu / dx = 0.5 (1 + t) + 0.5 x (1 - t^2) u',  t = tanh(u), u' = s (1 + 3 a x^2);
 * with q = sigmoid(2u) = (1 + t) / 2 this is q + 2 x q (1 - q) u': the one exp of the forward,
 * recomputed once (the products that end in a sum fused, as in the forward). */
static inline fsdp_vf gelu_grad_v(fsdp_vf x) {
  fsdp_vf x2 = x * x;
  fsdp_vf q = 1.0f / (1.0f + fsdp_vf_exp(GELU_M2S * fsdp_vf_fma(GELU_A * x2, x, x)));
  fsdp_vf du = GELU_S * fsdp_vf_fma(fsdp_vf_set(3.0f * GELU_A), x2, fsdp_vf_set(1.0f));
  return fsdp_vf_fma(2.0f * x * q * (1.0f - q), du, q);
}

/* full vectors, then the tail through partial loads: the same operations per lane */
static void gelu_forward(float *out, const float *inp, int64_t n) {
  int64_t i = 0;
  for (; i + VW <= n; i += VW) fsdp_vf_store(out + i, gelu_v(fsdp_vf_load(inp + i)));
  if (i < n) ST(out, i, n, gelu_v(LD(inp, i, n, 0.0f)));
}

VINLINE void gelu_backward_at(float *dinp, const float *dout, const float *inp, int64_t i,
                              int64_t n, int tail) {
  fsdp_vf grad = gelu_grad_v(fsdp_vt_load(inp, i, n, 0.0f, tail));
  fsdp_vf d = fsdp_vt_load(dinp, i, n, 0.0f, tail) + grad * fsdp_vt_load(dout, i, n, 0.0f, tail);
  fsdp_vt_store(dinp, i, n, d, tail);
}

static void gelu_backward(float *dinp, const float *dout, const float *inp, int64_t n) {
  int64_t i = 0;
  for (; i + VW <= n; i += VW) gelu_backward_at(dinp, dout, inp, i, n, 0);
  if (i < n) gelu_backward_at(dinp, dout, inp, i, n, 1);
}

/* ---- bias + GELU, on f32 or bf16 rows ---------------------------------------------------------
 * One body for both element types: `bf16` is a constant at every call, so each public body
 * below compiles to one kind of load and store (vmath.h: bf16 loads widen exactly, stores round
 * once), and the bf16 results are the f32 body's between a widening and a rounding pass. */

/* the lanes of an f32 or bf16 row at element c (lanes past n read 0 when tail) */
VINLINE fsdp_vf ldx(const void *p, int64_t c, int64_t n, int tail, bool bf16) {
  return bf16 ? fsdp_vh_load(p, c, n, tail) : fsdp_vt_load(p, c, n, 0.0f, tail);
}
VINLINE void stx(void *p, int64_t c, int64_t n, fsdp_vf v, int tail, bool bf16) {
  if (bf16) fsdp_vh_store(p, c, n, v, tail);
  else fsdp_vt_store(p, c, n, v, tail);
}
/* element `off` of an f32 or bf16 buffer (NULL stays NULL) */
VINLINE const void *cat_(const void *p, int64_t off, bool bf16) {
  return p ? (const char *)p + off * (bf16 ? 2 : 4) : NULL;
}
VINLINE void *mat_(void *p, int64_t off, bool bf16) {
  return p ? (char *)p + off * (bf16 ? 2 : 4) : NULL;
}

/* rows [lo, hi) of (N, C): out = gelu(inp + bias), the sum rounded once as an add would */
VINLINE void bias_gelu_rows(void *out, const void *inp, const float *bias, int64_t lo,
                            int64_t hi, int C, bool bf16) {
  for (int64_t r = lo; r < hi; r++) {
    const void *x = cat_(inp, r * C, bf16);
    void *y = mat_(out, r * C, bf16);
    int64_t c = 0;
    /* two vectors a step: their exp-and-divide chains are long and independent, and
     * interleaved they keep more of the floating-point pipes busy (0.62 -> 0.58 ns an f32
     * element, 0.86 -> 0.76 bf16, one AVX-512 thread) */
    for (; c + 2 * VW <= C; c += 2 * VW) {
      fsdp_vf a0 = ldx(x, c, C, 0, bf16) + fsdp_vf_load(bias + c);
      fsdp_vf a1 = ldx(x, c + VW, C, 0, bf16) + fsdp_vf_load(bias + c + VW);
      fsdp_vf g0 = gelu_v(a0), g1 = gelu_v(a1);
      stx(y, c, C, g0, 0, bf16);
      stx(y, c + VW, C, g1, 0, bf16);
    }
    for (; c + VW <= C; c += VW)
      stx(y, c, C, gelu_v(ldx(x, c, C, 0, bf16) + fsdp_vf_load(bias + c)), 0, bf16);
    if (c < C) stx(y, c, C, gelu_v(ldx(x, c, C, 1, bf16) + LD(bias, c, C, 0.0f)), 1, bf16);
  }
}

static void bias_gelu_forward(float *out, const float *inp, const float *bias, int64_t lo,
                              int64_t hi, int C) {
  bias_gelu_rows(out, inp, bias, lo, hi, C, false);
}

static void bias_gelu_forward_bf16(uint16_t *out, const uint16_t *inp, const float *bias,
                                   int64_t lo, int64_t hi, int C) {
  bias_gelu_rows(out, inp, bias, lo, hi, C, true);
}

#define BG_CHUNK 2048
typedef double fsdp_vd __attribute__((vector_size(FSDP_VW * 8)));

/* t = gelu'(x + b) g for the vector at column c of one row strip of len columns */
VINLINE fsdp_vf bias_gelu_t(const void *g, const void *x, const float *b, int c, int len,
                            int tail, bool bf16) {
  fsdp_vf h = ldx(x, c, len, tail, bf16) + fsdp_vt_load(b, c, len, 0.0f, tail);
  return gelu_grad_v(h) * ldx(g, c, len, tail, bf16);
}

/* rows r0 .. r0 + nr - 1 (nr = 1 or 2) at column c: d += t per row (has_d 2: d = t, d unread),
 * acc += t row by row (double: acc + t0 + t1 in that order, one load and store of acc for both).
 * Lanes past len add 0 to acc entries never read (BG_CHUNK % VW == 0). */
VINLINE void bias_gelu_rows_at(void *d, double *acc, const void *g, const void *x,
                               const float *b, int64_t C, int nr, int c, int len, int tail,
                               int has_d, bool has_acc, bool bf16) {
  fsdp_vf t0 = bias_gelu_t(g, x, b, c, len, tail, bf16), t1 = t0;
  if (has_d) stx(d, c, len, has_d == 2 ? t0 : ldx(d, c, len, tail, bf16) + t0, tail, bf16);
  if (nr == 2) {
    void *d1 = mat_(d, C, bf16);
    t1 = bias_gelu_t(cat_(g, C, bf16), cat_(x, C, bf16), b, c, len, tail, bf16);
    if (has_d)
      stx(d1, c, len, has_d == 2 ? t1 : ldx(d1, c, len, tail, bf16) + t1, tail, bf16);
  }
  if (has_acc) {
    fsdp_vd a;
    memcpy(&a, acc + c, sizeof a);
    a += __builtin_convertvector(t0, fsdp_vd);
    if (nr == 2) a += __builtin_convertvector(t1, fsdp_vd);
    memcpy(acc + c, &a, sizeof a);
  }
}

/* has_d: 0 no dinp, 1 dinp += t, 2 dinp = t (its old contents unread) */
VINLINE void bias_gelu_strip(void *dinp, double *acc, const void *dout, const void *inp,
                             const float *b, int64_t N, int64_t C, int len, int has_d,
                             bool has_acc, bool bf16) {
  for (int64_t r = 0; r < N; r += 2) {
    const int nr = r + 2 <= N ? 2 : 1;
    const int64_t o = r * C;
    void *d = has_d ? mat_(dinp, o, bf16) : NULL;
    const void *g = cat_(dout, o, bf16), *x = cat_(inp, o, bf16);
    int c = 0;
    if (nr == 2) {
      for (; c + VW <= len; c += VW)
        bias_gelu_rows_at(d, acc, g, x, b, C, 2, c, len, 0, has_d, has_acc, bf16);
      if (c < len) bias_gelu_rows_at(d, acc, g, x, b, C, 2, c, len, 1, has_d, has_acc, bf16);
    } else {
      for (; c + VW <= len; c += VW)
        bias_gelu_rows_at(d, acc, g, x, b, C, 1, c, len, 0, has_d, has_acc, bf16);
      if (c < len) bias_gelu_rows_at(d, acc, g, x, b, C, 1, c, len, 1, has_d, has_acc, bf16);
    }
  }
}

/* columns [c0, c1) over all N rows: t = gelu'(inp + bias) * dout, dinp += t (set: dinp = t),
 * and dbias += the column sums of t (double, rows in order: fsdp_cpu_colsum_acc's arithmetic),
 * one pass */
VINLINE void bias_gelu_cols(void *dinp, float *dbias, const void *dout, const void *inp,
                            const float *bias, int64_t N, int C, int c0, int c1, bool set,
                            bool bf16) {
  double acc[BG_CHUNK];
  for (int b0 = c0; b0 < c1; b0 += BG_CHUNK) {
    const int len = c1 - b0 < BG_CHUNK ? c1 - b0 : BG_CHUNK;
    memset(acc, 0, sizeof(double) * (size_t)len);
    void *d = mat_(dinp, b0, bf16);
    const void *g = cat_(dout, b0, bf16), *x = cat_(inp, b0, bf16);
#define STRIP(hd, ha) bias_gelu_strip(d, acc, g, x, bias + b0, N, C, len, hd, ha, bf16)
    if (dinp && dbias) set ? STRIP(2, 1) : STRIP(1, 1);
    else if (dinp) set ? STRIP(2, 0) : STRIP(1, 0);
    else STRIP(0, 1);
#undef STRIP
    if (dbias)
      for (int j = 0; j < len; j++) dbias[b0 + j] += (float)acc[j];
  }
}

static void bias_gelu_backward_cols(float *dinp, float *dbias, const float *dout,
                                    const float *inp, const float *bias, int64_t N, int C,
                                    int c0, int c1, bool set) {
  bias_gelu_cols(dinp, dbias, dout, inp, bias, N, C, c0, c1, set, false);
}

static void bias_gelu_backward_cols_bf16(uint16_t *dinp, float *dbias, const uint16_t *dout,
                                         const uint16_t *inp, const float *bias, int64_t N,
                                         int C, int c0, int c1, bool set) {
  bias_gelu_cols(dinp, dbias, dout, inp, bias, N, C, c0, c1, set, true);
}

static void dropout_mask(float *out, float *mask, const float *inp, int64_t n, float p,
                         float scale) {
  for (int64_t i = 0; i < n; i += VW) {
    fsdp_vf k = fsdp_vf_select(LD(mask, i, n, 0.0f) >= p, vset(scale), vset(0.0f));
    ST(mask, i, n, k);
    ST(out, i, n, LD(inp, i, n, 0.0f) * k);
  }
}

/* ---- accumulating streams (backward kernels) ------------------------------------------------ */

static void add_acc(float *d, const float *g, int64_t n) {
  for (int64_t i = 0; i < n; i += VW) ST(d, i, n, LD(d, i, n, 0.0f) + LD(g, i, n, 0.0f));
}

static void mul_acc(float *d, const float *g, const float *b, int64_t n) {
  for (int64_t i = 0; i < n; i += VW)
    ST(d, i, n, LD(d, i, n, 0.0f) + LD(g, i, n, 0.0f) * LD(b, i, n, 0.0f));
}

static void div_acc(float *d, const float *g, const float *b, int64_t n) {
  for (int64_t i = 0; i < n; i += VW)
    ST(d, i, n, LD(d, i, n, 0.0f) + LD(g, i, n, 0.0f) / LD(b, i, n, 1.0f));
}

static void scale_acc(float *d, const float *g, float s, int64_t n) {
  for (int64_t i = 0; i < n; i += VW) ST(d, i, n, LD(d, i, n, 0.0f) + LD(g, i, n, 0.0f) * s);
}

static void rdiv_acc(float *d, const float *g, float s, int64_t n) {
  for (int64_t i = 0; i < n; i += VW) ST(d, i, n, LD(d, i, n, 0.0f) + LD(g, i, n, 0.0f) / s);
}

static void diff_acc(float *d, const float *a, const float *b, float k, int64_t n) {
  for (int64_t i = 0; i < n; i += VW)
    ST(d, i, n, LD(d, i, n, 0.0f) + k * (LD(a, i, n, 0.0f) - LD(b, i, n, 0.0f)));
}

/* ---- binary, affine ------------------------------------------------------------------------ */

/* One loop per op, the op chosen outside it. */
VINLINE void binary_v(float *out, const float *a, const float *b, int64_t n,
                            fsdp_binop op) {
  for (int64_t i = 0; i < n; i += VW) {
    fsdp_vf x = LD(a, i, n, 0.0f), y = LD(b, i, n, 1.0f), z;
    switch (op) {
    case FSDP_BIN_ADD: z = x + y; break;
    case FSDP_BIN_SUB: z = x - y; break;
    case FSDP_BIN_MUL: z = x * y; break;
    default: z = x / y; break;
    }
    ST(out, i, n, z);
  }
}

static void binary(float *out, const float *a, const float *b, int64_t n, fsdp_binop op) {
  switch (op) {
  case FSDP_BIN_ADD: binary_v(out, a, b, n, FSDP_BIN_ADD); break;
  case FSDP_BIN_SUB: binary_v(out, a, b, n, FSDP_BIN_SUB); break;
  case FSDP_BIN_MUL: binary_v(out, a, b, n, FSDP_BIN_MUL); break;
  case FSDP_BIN_DIV: binary_v(out, a, b, n, FSDP_BIN_DIV); break;
  }
}

VINLINE void binary_scalar_v(float *out, const float *a, float s, int64_t n,
                                   fsdp_binop op) {
  for (int64_t i = 0; i < n; i += VW) {
    fsdp_vf x = LD(a, i, n, 0.0f), z;
    switch (op) {
    case FSDP_BIN_ADD: z = x + s; break;
    case FSDP_BIN_SUB: z = x - s; break;
    case FSDP_BIN_MUL: z = x * s; break;
    default: z = x / s; break;
    }
    ST(out, i, n, z);
  }
}

static void binary_scalar(float *out, const float *a, float s, int64_t n, fsdp_binop op) {
  switch (op) {
  case FSDP_BIN_ADD: binary_scalar_v(out, a, s, n, FSDP_BIN_ADD); break;
  case FSDP_BIN_SUB: binary_scalar_v(out, a, s, n, FSDP_BIN_SUB); break;
  case FSDP_BIN_MUL: binary_scalar_v(out, a, s, n, FSDP_BIN_MUL); break;
  case FSDP_BIN_DIV: binary_scalar_v(out, a, s, n, FSDP_BIN_DIV); break;
  }
}

static void affine(float *out, const float *a, float s, float t, int64_t n) {
  for (int64_t i = 0; i < n; i += VW) ST(out, i, n, LD(a, i, n, 0.0f) * s + t);
}

#define DB_CHUNK 256

static void binary_backward_b_cols(float *db, const float *dout, const float *a,
                                   const float *b, int64_t n, int64_t m, fsdp_binop op,
                                   int64_t j0, int64_t j1) {
  // db (m), dout (n), a (n), b (m): each column's repeats added in order, in double
  double acc[DB_CHUNK];
  for (int64_t c0 = j0; c0 < j1; c0 += DB_CHUNK) {
    const int64_t len = j1 - c0 < DB_CHUNK ? j1 - c0 : DB_CHUNK;
    memset(acc, 0, sizeof(double) * (size_t)len);
    const float *bj = b + c0;
    for (int64_t r = 0; r < n; r += m) {
      const float *g = dout + r + c0, *aj = a + r + c0;
      switch (op) {
      case FSDP_BIN_ADD:
      case FSDP_BIN_SUB:
        for (int64_t j = 0; j < len; j++) acc[j] += (double)g[j];
        break;
      case FSDP_BIN_MUL:
        for (int64_t j = 0; j < len; j++) acc[j] += (double)(g[j] * aj[j]);
        break;
      case FSDP_BIN_DIV:
        /* d(a/b)/db = -a / b^2, written (a / b) / b so that b^2 cannot underflow first */
        for (int64_t j = 0; j < len; j++) acc[j] += (double)(g[j] * (aj[j] / bj[j] / bj[j]));
        break;
      }
    }
    if (op == FSDP_BIN_SUB || op == FSDP_BIN_DIV) {
      for (int64_t j = 0; j < len; j++) db[c0 + j] -= (float)acc[j];
    } else {
      for (int64_t j = 0; j < len; j++) db[c0 + j] += (float)acc[j];
    }
  }
}

/* four double accumulators, element i in accumulator i % 4, added (s0 + s1) + (s2 + s3) */
static double binary_backward_b_sum(const float *dout, const float *a, int64_t n,
                                    fsdp_binop op) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int64_t i = 0;
  if (op == FSDP_BIN_ADD || op == FSDP_BIN_SUB) {
    for (; i + 4 <= n; i += 4) {
      s0 += dout[i]; s1 += dout[i + 1]; s2 += dout[i + 2]; s3 += dout[i + 3];
    }
    for (; i < n; i++) s0 += dout[i];
  } else {
    for (; i + 4 <= n; i += 4) {
      s0 += dout[i] * a[i]; s1 += dout[i + 1] * a[i + 1];
      s2 += dout[i + 2] * a[i + 2]; s3 += dout[i + 3] * a[i + 3];
    }
    for (; i < n; i++) s0 += dout[i] * a[i];
  }
  return (s0 + s1) + (s2 + s3);
}

/* sum of (a - b)^2: float lanes over blocks, blocks in double (vmath.h's order) */
static double sqdiff_sum(const float *a, const float *b, int64_t n) {
  double total = 0.0;
  for (int64_t blk = 0; blk < n; blk += FSDP_VBLOCK) {
    int64_t end = n - blk < FSDP_VBLOCK ? n : blk + FSDP_VBLOCK;
    fsdp_vf acc[FSDP_VK];
    for (int k = 0; k < FSDP_VK; k++) acc[k] = vset(0.0f);
    for (int64_t i = blk; i < end; i += FSDP_VL)
      for (int k = 0; k < FSDP_VK; k++) {
        int64_t s = i + k * VW;
        fsdp_vf d = LD(a, s, end, 0.0f) - LD(b, s, end, 0.0f);
        acc[k] += d * d;
      }
    total += (double)fsdp_vl_fold_sum(acc);
  }
  return total;
}

/* bitwise and with all-ones or zero: exact, +0 for masked */
static void mask_apply(float *x, const float *m, int64_t n) {
  for (int64_t i = 0; i < n; i += VW) {
    fsdp_vi keep = LD(m, i, n, 0.0f) != 0.0f;
    ST(x, i, n, (fsdp_vf)((fsdp_vi)LD(x, i, n, 0.0f) & keep));
  }
}

/* ---- optimizer ----------------------------------------------------------------------------- */

/* sqrt per lane: correctly rounded in every form, so each level gives the same bits. The
 * instruction where the target pragma enabled it (GCC defines the feature macros after it). */
#if FSDP_VW == 16 && defined(__AVX512F__)
#include <immintrin.h>
VINLINE fsdp_vf vsqrt(fsdp_vf x) { return (fsdp_vf)_mm512_sqrt_ps((__m512)x); }
#elif FSDP_VW == 8 && defined(__AVX__)
#include <immintrin.h>
VINLINE fsdp_vf vsqrt(fsdp_vf x) { return (fsdp_vf)_mm256_sqrt_ps((__m256)x); }
#elif FSDP_VW == 4 && defined(__SSE2__)
#include <immintrin.h>
VINLINE fsdp_vf vsqrt(fsdp_vf x) { return (fsdp_vf)_mm_sqrt_ps((__m128)x); }
#else
VINLINE fsdp_vf vsqrt(fsdp_vf x) {
  for (int l = 0; l < VW; l++) x[l] = sqrtf(x[l]);
  return x;
}
#endif

/* AdamW over n elements in torch.optim.AdamW's single-tensor order of operations (optim.c).
 * With a mask (has_mask, a constant at each call): the gradient is masked first and written
 * back, the new weights masked after the update, as mask_apply before and after the plain step
 * would: one pass instead of three. The gradient is multiplied by gscale as it is read
 * (clipping's coefficient; 1 is exact), the buffer keeps its unscaled values: the same bits as
 * scaling the buffer first, without that pass. */
VINLINE void adamw_v(float *p, float *m, float *v, float *g, const float *mask, int64_t n,
                     float beta1, float beta2, float eps, float decay, float step_size,
                     float bc2_sqrt, float gscale, bool has_mask) {
  const float a1 = 1.0f - beta1, a2 = 1.0f - beta2;
  for (int64_t i = 0; i < n; i += VW) {
    fsdp_vf gi = LD(g, i, n, 0.0f);
    fsdp_vi keep = {0};
    if (has_mask) {
      keep = LD(mask, i, n, 0.0f) != 0.0f;
      gi = (fsdp_vf)((fsdp_vi)gi & keep);
      ST(g, i, n, gi);
    }
    gi = gi * gscale;
    fsdp_vf mi = beta1 * LD(m, i, n, 0.0f) + a1 * gi;
    fsdp_vf vi = beta2 * LD(v, i, n, 0.0f) + a2 * gi * gi;
    fsdp_vf denom = vsqrt(vi) / bc2_sqrt + eps;
    fsdp_vf pi = LD(p, i, n, 0.0f) * decay - step_size * (mi / denom);
    if (has_mask) pi = (fsdp_vf)((fsdp_vi)pi & keep);
    ST(m, i, n, mi);
    ST(v, i, n, vi);
    ST(p, i, n, pi);
  }
}

static void adamw(float *p, float *m, float *v, const float *g, int64_t n, float beta1,
                  float beta2, float eps, float decay, float step_size, float bc2_sqrt,
                  float gscale) {
  adamw_v(p, m, v, (float *)g, NULL, n, beta1, beta2, eps, decay, step_size, bc2_sqrt, gscale,
          false);
}

static void adamw_masked(float *p, float *m, float *v, float *g, const float *mask, int64_t n,
                         float beta1, float beta2, float eps, float decay, float step_size,
                         float bc2_sqrt, float gscale) {
  adamw_v(p, m, v, g, mask, n, beta1, beta2, eps, decay, step_size, bc2_sqrt, gscale, true);
}

/* ---- layernorm, softmax -------------------------------------------------------------------- */

/* y = (x - m) * s * w + b with w, b optional: has_w / has_b are constants at each call, so
 * each case compiles to its own loop; y f32 or bf16 (rounded once) */
VINLINE void ln_row_out(void *y, const float *x, const float *w, const float *b, float m,
                        float s, int C, bool has_w, bool has_b, bool bf16) {
  for (int64_t c = 0; c < C; c += VW) {
    fsdp_vf v = (LD(x, c, C, 0.0f) - m) * s;
    if (has_w) v = v * LD(w, c, C, 0.0f);
    if (has_b) v = v + LD(b, c, C, 0.0f);
    stx(y, c, C, v, 1, bf16);
  }
}

/* one row x (f32) normalised into y (f32, or bf16 rounded once); its mean and rstd into
 * *m_out, *s_out */
VINLINE void ln_row(void *y, const float *x, const float *weight, const float *bias, int C,
                    float eps, float *m_out, float *s_out, bool bf16) {
  /* two passes over a row in cache: the variance of centred values, which does not cancel
   * catastrophically for large means as E[x^2] - E[x]^2 would */
  float m = (float)(fsdp_row_sum(x, C) / C);
  float var = (float)fsdp_row_sqdev(x, m, C) / (float)C;
  float s = 1.0f / sqrtf(var + eps);
  if (weight && bias) ln_row_out(y, x, weight, bias, m, s, C, true, true, bf16);
  else if (weight) ln_row_out(y, x, weight, NULL, m, s, C, true, false, bf16);
  else if (bias) ln_row_out(y, x, NULL, bias, m, s, C, false, true, bf16);
  else ln_row_out(y, x, NULL, NULL, m, s, C, false, false, bf16);
  *m_out = m;
  *s_out = s;
}

static void layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                              const float *weight, const float *bias, int64_t lo, int64_t hi,
                              int C, float eps) {
  // out (N, C), mean (N), rstd (N), inp (N, C), weight (C) or NULL, bias (C) or NULL
  for (int64_t n = lo; n < hi; n++)
    ln_row(out + n * C, inp + n * C, weight, bias, C, eps, mean + n, rstd + n, false);
}

/* The same on bf16 rows, and the residual add before it when b is given (sum = a + b rounded to
 * bf16 and stored, then normalised as stored, as the add and the layernorm apart do). Each row
 * is widened (or added and rounded, then widened) into an f32 row on the stack and the f32
 * body runs on it, so the results are the f32 kernel's between a widening and a rounding pass,
 * in one walk over the row instead of a conversion pass for every operand. */
static void layernorm_forward_bf16(uint16_t *out, uint16_t *sum, float *mean, float *rstd,
                                   const uint16_t *a, const uint16_t *b, const float *weight,
                                   const float *bias, int64_t lo, int64_t hi, int C, float eps) {
  float row[FSDP_CPU_LN_ROW_MAX] __attribute__((aligned(64)));
  for (int64_t n = lo; n < hi; n++) {
    const uint16_t *x = a + n * C;
    if (b) {
      const uint16_t *x2 = b + n * C;
      uint16_t *sn = sum + n * C;
      for (int64_t c = 0; c < C; c += VW) {
        stx(sn, c, C, ldx(x, c, C, 1, true) + ldx(x2, c, C, 1, true), 1, true);
        ST(row, c, C, ldx(sn, c, C, 1, true));
      }
    } else {
      for (int64_t c = 0; c < C; c += VW) ST(row, c, C, ldx(x, c, C, 1, true));
    }
    ln_row(out + n * C, row, weight, bias, C, eps, mean + n, rstd + n, true);
  }
}

/* Layernorm's backward on f32 or bf16 rows (dout, inp, dinp; weight, mean, rstd and the
 * parameter gradients are f32): `bf16` is a constant at every call, as for bias + GELU, so the
 * bf16 body's bits are the f32 body's between a widening and a rounding pass. Loads and stores
 * go through ldx / stx with the tail checked at every vector, as LD / ST do. */

/* dweight += xhat * dout, dbias += dout over the C columns of one row */
VINLINE void ln_row_params(float *dweight, float *dbias, const void *g, const void *x, float m,
                           float s, int C, bool bf16) {
  if (dbias)
    for (int64_t c = 0; c < C; c += VW)
      ST(dbias, c, C, LD(dbias, c, C, 0.0f) + ldx(g, c, C, 1, bf16));
  if (dweight)
    for (int64_t c = 0; c < C; c += VW)
      ST(dweight, c, C,
         LD(dweight, c, C, 0.0f) + (ldx(x, c, C, 1, bf16) - m) * s * ldx(g, c, C, 1, bf16));
}

/* sum of dxhat and of dxhat * xhat over a row (dxhat = w * dout, xhat = (x - m) * s) */
VINLINE void ln_row_sums(float *sum_dxhat, float *sum_dxhat_xhat, const void *g, const void *x,
                         const float *w, float m, float s, int C, bool bf16) {
  double t0 = 0.0, t1 = 0.0;
  for (int64_t blk = 0; blk < C; blk += FSDP_VBLOCK) {
    int64_t end = C - blk < FSDP_VBLOCK ? C : blk + FSDP_VBLOCK;
    fsdp_vf a[FSDP_VK], b[FSDP_VK];
    for (int k = 0; k < FSDP_VK; k++) a[k] = b[k] = vset(0.0f);
    for (int64_t i = blk; i < end; i += FSDP_VL)
      for (int k = 0; k < FSDP_VK; k++) {
        int64_t c = i + k * VW;
        fsdp_vf dxhat = ldx(g, c, end, 1, bf16);
        if (w) dxhat = LD(w, c, end, 0.0f) * dxhat;
        a[k] += dxhat;
        b[k] += dxhat * ((ldx(x, c, end, 1, bf16) - m) * s);
      }
    t0 += (double)fsdp_vl_fold_sum(a);
    t1 += (double)fsdp_vl_fold_sum(b);
  }
  *sum_dxhat = (float)t0;
  *sum_dxhat_xhat = (float)t1;
}

/* one row's dx, and its dweight / dbias terms in the same pass (has_* are constants at each
 * call, so each case is its own loop) */
VINLINE void ln_row_dx(void *dx, float *dweight, float *dbias, const void *g, const void *x,
                       const float *w, float m, float s, float mean_dxhat,
                       float mean_dxhat_xhat, int C, bool has_w, bool has_dw, bool has_db,
                       bool bf16) {
  for (int64_t c = 0; c < C; c += VW) {
    fsdp_vf xhat = (ldx(x, c, C, 1, bf16) - m) * s, gi = ldx(g, c, C, 1, bf16), dxhat = gi;
    if (has_db) ST(dbias, c, C, LD(dbias, c, C, 0.0f) + gi);
    if (has_dw) ST(dweight, c, C, LD(dweight, c, C, 0.0f) + xhat * gi);
    if (has_w) dxhat = LD(w, c, C, 0.0f) * dxhat;
    stx(dx, c, C, ldx(dx, c, C, 1, bf16) + s * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat), 1,
        bf16);
  }
}

VINLINE void layernorm_backward_rows(void *dinp, float *dweight, float *dbias, const void *dout,
                                     const void *inp, const float *weight, const float *mean,
                                     const float *rstd, int64_t lo, int64_t hi, int C,
                                     bool bf16) {
  for (int64_t n = lo; n < hi; n++) {
    const void *g = cat_(dout, n * C, bf16), *x = cat_(inp, n * C, bf16);
    const float m = mean[n], s = rstd[n];
    if (!dinp) {
      ln_row_params(dweight, dbias, g, x, m, s, C, bf16);
      continue;
    }
    /* dx = s * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = w * dout */
    float sum_dxhat, sum_dxhat_xhat;
    ln_row_sums(&sum_dxhat, &sum_dxhat_xhat, g, x, weight, m, s, C, bf16);
    const float md = sum_dxhat / (float)C, mdx = sum_dxhat_xhat / (float)C;
    void *dx = mat_(dinp, n * C, bf16);
    const bool dw = dweight != NULL, db = dbias != NULL;
#define LN_DX(hw, hdw, hdb) \
  ln_row_dx(dx, dweight, dbias, g, x, weight, m, s, md, mdx, C, hw, hdw, hdb, bf16)
    if (weight) {
      if (dw && db) LN_DX(true, true, true);
      else if (dw) LN_DX(true, true, false);
      else if (db) LN_DX(true, false, true);
      else LN_DX(true, false, false);
    } else {
      if (dw && db) LN_DX(false, true, true);
      else if (dw) LN_DX(false, true, false);
      else if (db) LN_DX(false, false, true);
      else LN_DX(false, false, false);
    }
#undef LN_DX
  }
}

static void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                               const float *inp, const float *weight, const float *mean,
                               const float *rstd, int64_t lo, int64_t hi, int C) {
  layernorm_backward_rows(dinp, dweight, dbias, dout, inp, weight, mean, rstd, lo, hi, C, false);
}

static void layernorm_backward_bf16(uint16_t *dinp, float *dweight, float *dbias,
                                    const uint16_t *dout, const uint16_t *inp,
                                    const float *weight, const float *mean, const float *rstd,
                                    int64_t lo, int64_t hi, int C) {
  layernorm_backward_rows(dinp, dweight, dbias, dout, inp, weight, mean, rstd, lo, hi, C, true);
}

static void softmax_forward(float *out, const float *inp, int64_t lo, int64_t hi, int C) {
  for (int64_t n = lo; n < hi; n++) {
    const float *x = inp + n * C;
    float *y = out + n * C;
    float mx = fsdp_row_max(x, C);
    float inv = (float)(1.0 / fsdp_row_expsum(y, x, mx, C));
    for (int64_t c = 0; c < C; c += VW) ST(y, c, C, LD(y, c, C, 0.0f) * inv);
  }
}

static void softmax_backward(float *dinp, const float *dout, const float *out, int64_t lo,
                             int64_t hi, int C) {
  for (int64_t n = lo; n < hi; n++) {
    const float *g = dout + n * C, *y = out + n * C;
    float *d = dinp + n * C;
    float dot = (float)fsdp_row_dot(g, y, C);
    for (int64_t c = 0; c < C; c += VW)
      ST(d, c, C, LD(d, c, C, 0.0f) + LD(y, c, C, 0.0f) * (LD(g, c, C, 0.0f) - dot));
  }
}

/* attention.c's causal rows (its scalar loops, on vectors: the same operations per lane); the
 * bf16 attention (attention_bf16.c) multiplies bf16 probabilities, and its rows store them
 * rounded (`bf16`, a constant at every call): the f32 rows' bits followed by a rounding pass,
 * without that pass over the block. */

/* rows [r0, r0 + rows) of A softmaxed, the probabilities stored into P: A itself (f32, in
 * place) or a bf16 block (A then keeps the unnormalised exponentials); zeros up to column cols */
VINLINE void att_softmax_row_out(void *P, const float *A, int T, int t, float inv, int cols,
                                 bool bf16) {
  const float *row = A + (int64_t)t * T;
  void *p = mat_(P, (int64_t)t * T, bf16);
  const int len = t + 1;
  for (int c = 0; c < len; c += VW) stx(p, c, len, LD(row, c, len, 0.0f) * inv, 1, bf16);
  memset(mat_(p, len, bf16), 0, (bf16 ? 2 : 4) * (size_t)(cols - len));
}

/* `stats` (NULL: not kept): row t's max and the reciprocal of its sum at stats[2 (t - r0)],
 * stats[2 (t - r0) + 1], what att_softmax_rows_saved needs */
VINLINE void att_softmax_rows_x(void *P, float *A, int T, int r0, int rows, int cols, bool bf16,
                                float *stats) {
  int t = r0;
  /* two rows at a time where a row fits one summation block (the pair helpers' domain) */
  if (T <= FSDP_VBLOCK)
    for (; t + 2 <= r0 + rows; t += 2) {
      float *x0 = A + (int64_t)t * T, *x1 = x0 + T, m0, m1;
      double e0, e1;
      fsdp_row_max2(x0, t + 1, x1, t + 2, &m0, &m1);
      fsdp_row_expsum2(x0, m0, t + 1, x1, m1, t + 2, &e0, &e1);
      const float i0 = (float)(1.0 / e0), i1 = (float)(1.0 / e1);
      att_softmax_row_out(P, A, T, t, i0, cols, bf16);
      att_softmax_row_out(P, A, T, t + 1, i1, cols, bf16);
      if (stats) {
        float *st = stats + 2 * (t - r0);
        st[0] = m0, st[1] = i0, st[2] = m1, st[3] = i1;
      }
    }
  for (; t < r0 + rows; t++) {
    float *row = A + (int64_t)t * T;
    const int len = t + 1;
    float mx = fsdp_row_max(row, len);
    const float inv = (float)(1.0 / fsdp_row_expsum(row, row, mx, len));
    att_softmax_row_out(P, A, T, t, inv, cols, bf16);
    if (stats) stats[2 * (t - r0)] = mx, stats[2 * (t - r0) + 1] = inv;
  }
}

static void att_softmax_rows(float *A, int T, int r0, int rows, int cols, float *stats) {
  att_softmax_rows_x(A, A, T, r0, rows, cols, false, stats);
}

static void att_softmax_rows_bf16(uint16_t *P, float *A, int T, int r0, int rows, int cols,
                                  float *stats) {
  att_softmax_rows_x(P, A, T, r0, rows, cols, true, stats);
}

/* The same probabilities from the rows' saved max and reciprocal sum, in one pass: each
 * element is the exponential the forward computed (the same operations on the same score)
 * times the same reciprocal, so the same bits (rounded the same way into a bf16 P), without
 * the max and sum passes. f32: P is A, in place; bf16: A's scores are left as they were. */
VINLINE void att_softmax_rows_saved_x(void *P, const float *A, int T, int r0, int rows,
                                      int cols, const float *stats, bool bf16) {
  for (int t = r0; t < r0 + rows; t++) {
    const float *row = A + (int64_t)t * T;
    void *p = mat_(P, (int64_t)t * T, bf16);
    const int len = t + 1;
    const fsdp_vf m = vset(stats[2 * (t - r0)]), inv = vset(stats[2 * (t - r0) + 1]);
    for (int c = 0; c < len; c += VW)
      stx(p, c, len, fsdp_vf_exp_nonpos(LD(row, c, len, -INFINITY) - m) * inv, 1, bf16);
    memset(mat_(p, len, bf16), 0, (bf16 ? 2 : 4) * (size_t)(cols - len));
  }
}

static void att_softmax_rows_saved(float *A, int T, int r0, int rows, int cols,
                                   const float *stats) {
  att_softmax_rows_saved_x(A, A, T, r0, rows, cols, stats, false);
}

static void att_softmax_rows_saved_bf16(uint16_t *P, const float *A, int T, int r0, int rows,
                                        int cols, const float *stats) {
  att_softmax_rows_saved_x(P, A, T, r0, rows, cols, stats, true);
}

/* its backward: datt in S, the probabilities P (f32 or bf16), dscores into D (f32: S itself,
 * in place; bf16: a block of their own, S left as it was) */
VINLINE void att_softmax_backward_row_out(void *D, const float *S, const void *P, int T, int t,
                                          float dot, int cols, bool bf16) {
  const void *a = cat_(P, (int64_t)t * T, bf16);
  const float *s = S + (int64_t)t * T;
  void *d = mat_(D, (int64_t)t * T, bf16);
  const int len = t + 1;
  for (int c = 0; c < len; c += VW)
    stx(d, c, len, ldx(a, c, len, 1, bf16) * (LD(s, c, len, 0.0f) - dot), 1, bf16);
  memset(mat_(d, len, bf16), 0, (bf16 ? 2 : 4) * (size_t)(cols - len));
}

VINLINE void att_softmax_backward_rows_x(void *D, const float *S, const void *P, int T, int r0,
                                         int rows, int cols, bool bf16) {
  int t = r0;
  if (T <= FSDP_VBLOCK) /* two rows at a time, as the forward */
    for (; t + 2 <= r0 + rows; t += 2) {
      double d0, d1;
      fsdp_row_dot2_x(cat_(P, (int64_t)t * T, bf16), S + (int64_t)t * T, t + 1,
                      cat_(P, (int64_t)(t + 1) * T, bf16), S + (int64_t)(t + 1) * T, t + 2, bf16,
                      &d0, &d1);
      att_softmax_backward_row_out(D, S, P, T, t, (float)d0, cols, bf16);
      att_softmax_backward_row_out(D, S, P, T, t + 1, (float)d1, cols, bf16);
    }
  for (; t < r0 + rows; t++) {
    const float dot = (float)fsdp_row_dot_x(cat_(P, (int64_t)t * T, bf16), bf16,
                                            S + (int64_t)t * T, t + 1);
    att_softmax_backward_row_out(D, S, P, T, t, dot, cols, bf16);
  }
}

static void att_softmax_backward_rows(float *S, const float *A, int T, int r0, int rows,
                                      int cols) {
  att_softmax_backward_rows_x(S, S, A, T, r0, rows, cols, false);
}

static void att_softmax_backward_rows_bf16(uint16_t *D, const float *S, const uint16_t *P,
                                           int T, int r0, int rows, int cols) {
  att_softmax_backward_rows_x(D, S, P, T, r0, rows, cols, true);
}

/* ---- attention's products ------------------------------------------------------------------ */

/* Register blocks of ATT_MR rows by ATT_NV vectors of accumulators: 6 x 4 = 24 of AVX-512's 32
 * vector registers; 6 x 2 = 12 of AVX2's (and SSE's) 16, leaving room for b's vectors and a
 * broadcast. The broadcast is fsdp_vf_dup (one instruction from memory): with fsdp_vf_set's
 * add before it, 6 x 2 spilled and ran at half the speed, and 4 x 3 was best at 74-83 GFLOP/s;
 * with it 6 x 2 runs at 95-105, 4 x 3 at 83-98, 5 x 2 at 83-100 and 3 x 3 at 70-89
 * (`FSDP_CPU_ISA=avx2 build/bench/bench_kernels 1`). */
#define ATT_MR 6
#if VW == 16
#define ATT_NV 4
#else
#define ATT_NV 2
#endif

/* One block: rows [0, mr) by vectors [0, nz) of c, over kc terms. With `tail` the last vector
 * holds only `last` columns: c is stored (and read) there through partial stores, b read whole
 * unless `tail_b` (ATT_COLS's b may be read past N: see isa.h). mr, nz and the tails are
 * constants at every call (att_block_any), so the accumulators stay in registers; partial
 * loads in the inner loop cost a quarter of the product's speed, hence the padded b. */
VINLINE void att_block(const int mr, const int nz, const bool tail, const bool tail_b, int last,
                       int kc, const float *a, int64_t sam, int64_t sap, const float *b,
                       int64_t ldb, float *c, int64_t ldc, float alpha, bool acc) {
  fsdp_vf s[ATT_MR][ATT_NV];
  for (int m = 0; m < mr; m++)
    for (int z = 0; z < nz; z++) s[m][z] = vset(0.0f);
  for (int p = 0; p < kc; p++) {
    const float *bp = b + p * ldb;
    fsdp_vf bv[ATT_NV];
    for (int z = 0; z < nz; z++)
      bv[z] = tail_b && z == nz - 1 ? fsdp_vf_load_part(bp + z * VW, last, 0.0f)
                                    : fsdp_vf_load(bp + z * VW);
    const float *ap = a + p * sap;
    for (int m = 0; m < mr; m++) {
      const fsdp_vf av = fsdp_vf_dup(ap[m * sam]);
      for (int z = 0; z < nz; z++) s[m][z] = fsdp_vf_fma(av, bv[z], s[m][z]);
    }
  }
  for (int m = 0; m < mr; m++)
    for (int z = 0; z < nz; z++) {
      float *cp = c + m * ldc + z * VW;
      const bool part = tail && z == nz - 1;
      fsdp_vf r = s[m][z] * alpha;
      if (acc) r = (part ? fsdp_vf_load_part(cp, last, 0.0f) : fsdp_vf_load(cp)) + r;
      if (part) fsdp_vf_store_part(cp, r, last);
      else fsdp_vf_store(cp, r);
    }
}

/* t: 0 no tail, 1 a tail in c only, 2 in b too */
static void att_block_any(int mr, int nz, int t, int last, int kc, const float *a, int64_t sam,
                          int64_t sap, const float *b, int64_t ldb, float *c, int64_t ldc,
                          float alpha, bool acc) {
#define ATT_B(m, z, t, tb) \
  att_block(m, z, t, tb, last, kc, a, sam, sap, b, ldb, c, ldc, alpha, acc)
#define ATT_Z(m, z) \
  case ((m) * ATT_NV + (z) - 1) * 3: ATT_B(m, z, false, false); break; \
  case ((m) * ATT_NV + (z) - 1) * 3 + 1: ATT_B(m, z, true, false); break; \
  case ((m) * ATT_NV + (z) - 1) * 3 + 2: ATT_B(m, z, true, true); break;
#if ATT_NV >= 3
#define ATT_Z3(m) ATT_Z(m, 3)
#else
#define ATT_Z3(m)
#endif
#if ATT_NV >= 4
#define ATT_Z4(m) ATT_Z(m, 4)
#else
#define ATT_Z4(m)
#endif
#define ATT_M(m) ATT_Z(m, 1) ATT_Z(m, 2) ATT_Z3(m) ATT_Z4(m)
  switch ((mr * ATT_NV + nz - 1) * 3 + t) {
    ATT_M(1) ATT_M(2) ATT_M(3) ATT_M(4) ATT_M(5) ATT_M(6)
  default: break; /* mr in [1, ATT_MR], nz in [1, ATT_NV] by construction */
  }
#undef ATT_B
#undef ATT_Z
#undef ATT_Z3
#undef ATT_Z4
#undef ATT_M
}

static void att_mm(float *c, int64_t ldc, const float *a, int64_t sam, int64_t sap,
                   const float *b, int64_t ldb, int M, int N, int K, int diag, int kind,
                   float alpha, bool acc) {
  const int NR = ATT_NV * VW;
  for (int m0 = 0; m0 < M; m0 += ATT_MR) {
    const int mr = M - m0 < ATT_MR ? M - m0 : ATT_MR;
    int n1, k0, k1;
    fsdp_cpu_att_bounds(kind, m0, mr, diag, N, K, VW, &n1, &k0, &k1);
    for (int n0 = 0; n0 < n1; n0 += NR) {
      const int w = n1 - n0 < NR ? n1 - n0 : NR, nz = (w + VW - 1) / VW;
      const int last = w - (nz - 1) * VW;
      const int t = last == VW ? 0 : kind == FSDP_ATT_COLS ? 1 : 2;
      att_block_any(mr, nz, t, last, k1 - k0, a + m0 * sam + k0 * sap, sam, sap,
                    b + k0 * ldb + n0, ldb, c + m0 * ldc + n0, ldc, alpha, acc);
    }
  }
}

/* A square block of the level's width transposed in registers (AVX-512: 16 x 16, AVX2: 8 x 8,
 * the standard unpack and lane-shuffle stages); the baseline level copies element by element. */
#if VW == 16 && defined(__AVX512F__)
#define ATT_TB 16
VINLINE void att_transpose_block(float *dst, int64_t ldd, const float *src, int64_t lds) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int k = 0; k < 2; k++) {
      const __m512d x = _mm512_castps_pd(t[i + k]), y = _mm512_castps_pd(t[i + k + 2]);
      r[i + 2 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
      r[i + 2 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
    }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; i++) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0x88);
      t[h + 4 + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0xdd);
    }
  for (int i = 0; i < 8; i++) {
    _mm512_storeu_ps(dst + i * ldd, _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88));
    _mm512_storeu_ps(dst + (8 + i) * ldd, _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd));
  }
}
#elif VW == 8 && defined(__AVX2__)
#define ATT_TB 8
VINLINE void att_transpose_block(float *dst, int64_t ldd, const float *src, int64_t lds) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; i++) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#else
#define ATT_TB 4
VINLINE void att_transpose_block(float *dst, int64_t ldd, const float *src, int64_t lds) {
  for (int r = 0; r < 4; r++)
    for (int k = 0; k < 4; k++) dst[k * ldd + r] = src[r * lds + k];
}
#endif

static void att_pack(float *dst, int64_t ldd, const float *src, int64_t lds, int rows,
                     int cols) {
  const int rb = rows / ATT_TB * ATT_TB, cb = cols / ATT_TB * ATT_TB;
  for (int r0 = 0; r0 < rb; r0 += ATT_TB)
    for (int c0 = 0; c0 < cb; c0 += ATT_TB)
      att_transpose_block(dst + c0 * ldd + r0, ldd, src + r0 * lds + c0, lds);
  /* the edges: rows past the last whole block, then columns past it */
  for (int r = rb; r < rows; r++)
    for (int c = 0; c < cols; c++) dst[c * ldd + r] = src[r * lds + c];
  for (int r = 0; r < rb; r++)
    for (int c = cb; c < cols; c++) dst[c * ldd + r] = src[r * lds + c];
}

/* ---- cross-entropy ------------------------------------------------------------------------- */

static double cross_entropy_forward(float *lse, const float *logits, const int64_t *targets,
                                    int64_t lo, int64_t hi, int V, int64_t ignore_index,
                                    int64_t *count) {
  double total = 0.0;
  int64_t counted = 0;
  for (int64_t i = lo; i < hi; i++) {
    const int64_t tgt = targets[i];
    if (tgt == ignore_index) {
      lse[i] = 0.0f;
      continue;
    }
    const float *row = logits + i * V;
    const float mx = fsdp_row_max(row, V);
    const double l = (double)mx + log(fsdp_row_expsum(NULL, row, mx, V));
    lse[i] = (float)l;
    total += l - (double)row[tgt];
    counted++;
  }
  *count += counted;
  return total;
}

/* softmax recomputed from the saved log-sum-exp and the gradient written in the same pass */
static void cross_entropy_backward(float *dlogits, float sc, const float *logits,
                                   const float *lse, const int64_t *targets, int64_t lo,
                                   int64_t hi, int V, int64_t ignore_index) {
  for (int64_t i = lo; i < hi; i++) {
    const int64_t tgt = targets[i];
    if (tgt == ignore_index) continue;
    const float *x = logits + i * V;
    float *d = dlogits + i * V;
    const float l = lse[i];
    for (int64_t v = 0; v < V; v += VW) {
      fsdp_vf p = fsdp_vf_exp_nonpos(LD(x, v, V, -INFINITY) - l); /* x <= max <= lse */
      ST(d, v, V, LD(d, v, V, 0.0f) + sc * p);
    }
    d[tgt] -= sc;
  }
}

const fsdp_cpu_vec_i FSDP_VEC_TABLE = {
    .bias_gelu_forward_bf16 = bias_gelu_forward_bf16,
    .bias_gelu_backward_cols_bf16 = bias_gelu_backward_cols_bf16,
    .relu_forward = relu_forward,
    .relu_backward = relu_backward,
    .gelu_forward = gelu_forward,
    .gelu_backward = gelu_backward,
    .dropout_mask = dropout_mask,
    .bias_gelu_forward = bias_gelu_forward,
    .bias_gelu_backward_cols = bias_gelu_backward_cols,
    .add_acc = add_acc,
    .mul_acc = mul_acc,
    .div_acc = div_acc,
    .scale_acc = scale_acc,
    .rdiv_acc = rdiv_acc,
    .diff_acc = diff_acc,
    .binary = binary,
    .binary_scalar = binary_scalar,
    .affine = affine,
    .binary_backward_b_cols = binary_backward_b_cols,
    .binary_backward_b_sum = binary_backward_b_sum,
    .sqdiff_sum = sqdiff_sum,
    .mask_apply = mask_apply,
    .adamw = adamw,
    .adamw_masked = adamw_masked,
    .layernorm_forward = layernorm_forward,
    .layernorm_forward_bf16 = layernorm_forward_bf16,
    .layernorm_backward = layernorm_backward,
    .layernorm_backward_bf16 = layernorm_backward_bf16,
    .att_softmax_rows_bf16 = att_softmax_rows_bf16,
    .att_softmax_rows_saved_bf16 = att_softmax_rows_saved_bf16,
    .att_softmax_backward_rows_bf16 = att_softmax_backward_rows_bf16,
    .softmax_forward = softmax_forward,
    .softmax_backward = softmax_backward,
    .att_softmax_rows = att_softmax_rows,
    .att_softmax_rows_saved = att_softmax_rows_saved,
    .att_softmax_backward_rows = att_softmax_backward_rows,
    .att_mm = att_mm,
    .att_pack = att_pack,
    .cross_entropy_forward = cross_entropy_forward,
    .cross_entropy_backward = cross_entropy_backward,
};
