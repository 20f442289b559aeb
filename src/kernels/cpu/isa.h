/*
 * isa.h — private to src/kernels/cpu: the vector instruction set of the element-wise kernels,
 * and the table of their bodies compiled for it.
 *
 * Three levels: AVX-512 (F, BW, DQ and VL; 16-lane vectors), AVX2 with FMA (8 lanes) and the
 * build's baseline (4 lanes of portable vector-extension C: SSE2 on x86-64, whatever the
 * compiler targets elsewhere). The process takes the best its processor has, once, on first
 * use; FSDP_CPU_ISA=avx512|avx2|scalar forces one (tests compare the levels with it). Every
 * level computes the same bits (vmath.h: per-lane IEEE operations, reductions in a fixed
 * 16-lane order), so the choice changes speed only.
 *
 * The bodies (vec_body.h) are compiled once per level by vec_scalar.c, vec_avx2.c and
 * vec_avx512.c, each under its own target pragma: the rest of the build keeps the baseline
 * flags. The public kernels (activations.c, elementwise.c, norm.c, loss.c, mask.c; attention.c
 * for its softmax rows) split their work over the rank's threads (pool.h) and call the bodies
 * through fsdp_cpu_vec().
 */
#ifndef FSDP_KERNELS_CPU_ISA_H
#define FSDP_KERNELS_CPU_ISA_H

#include <stdint.h>

#include "kernels/kernels.h"

typedef enum {
  FSDP_CPU_ISA_SCALAR = 0,
  FSDP_CPU_ISA_AVX2 = 1,
  FSDP_CPU_ISA_AVX512 = 2,
  FSDP_CPU_ISA_COUNT
} fsdp_cpu_isa_level;

/* The level the kernels use now (the best the processor has, or FSDP_CPU_ISA's). */
fsdp_cpu_isa_level fsdp_cpu_isa(void);
/* The best level this processor (and its operating system) supports. */
fsdp_cpu_isa_level fsdp_cpu_isa_best(void);
/* "scalar", "avx2", "avx512" */
const char *fsdp_cpu_isa_name(fsdp_cpu_isa_level level);
/* Use `level` from now on (tests; not while kernels run). FSDP_ERR naming the level when this
 * processor lacks it, the current level unchanged. */
int fsdp_cpu_isa_set(fsdp_cpu_isa_level level);
/* FSDP_CPU_ISA's rules: value (NULL or "" = best) parsed against the processor's `best`.
 * FSDP_ERR naming the variable for an unknown value or a level above `best`. */
int fsdp_cpu_isa_parse(const char *value, fsdp_cpu_isa_level best, fsdp_cpu_isa_level *out);
/* fsdp_cpu_isa_check (kernels.h) repeats FSDP_CPU_ISA's error; the Lua module refuses to load
 * on it, so a bad setting never runs silently. */

/* the longest row layernorm_forward_bf16 takes (its f32 copy of a row lives on the stack:
 * 16 KiB) */
#define FSDP_CPU_LN_ROW_MAX 4096

/* ---- the bodies at one level ---------------------------------------------------------------
 * Ranges of the public kernels of kernels/cpu/kernels.h, same arithmetic; `lo, hi` are rows
 * (or columns for *_cols) of the full problem. Accumulating slots add (+=) as the public
 * kernels do. */
typedef struct fsdp_cpu_vec_i {
  /* element ranges; out may equal the input */
  void (*relu_forward)(float *out, const float *inp, int64_t n);
  void (*relu_backward)(float *dinp, const float *dout, const float *inp, int64_t n);
  void (*gelu_forward)(float *out, const float *inp, int64_t n);
  void (*gelu_backward)(float *dinp, const float *dout, const float *inp, int64_t n);
  /* rows [lo, hi) of (N, C): out = gelu(inp + bias (C)) */
  void (*bias_gelu_forward)(float *out, const float *inp, const float *bias, int64_t lo,
                            int64_t hi, int C);
  /* columns [c0, c1): dinp += t (set: dinp = t, its old contents unread), dbias += column
   * sums of t, t = gelu'(inp + bias) dout; either output may be NULL */
  void (*bias_gelu_backward_cols)(float *dinp, float *dbias, const float *dout,
                                  const float *inp, const float *bias, int64_t N, int C, int c0,
                                  int c1, bool set);
  /* the same two on bf16 operands (bias and dbias f32): bf16 loads widen, stores round once,
   * so the bits are those of the f32 bodies between a widening and a rounding pass */
  void (*bias_gelu_forward_bf16)(uint16_t *out, const uint16_t *inp, const float *bias,
                                 int64_t lo, int64_t hi, int C);
  void (*bias_gelu_backward_cols_bf16)(uint16_t *dinp, float *dbias, const uint16_t *dout,
                                       const uint16_t *inp, const float *bias, int64_t N, int C,
                                       int c0, int c1, bool set);
  /* mask holds uniforms on entry: mask = u >= p ? scale : 0, out = inp * mask */
  void (*dropout_mask)(float *out, float *mask, const float *inp, int64_t n, float p,
                       float scale);
  void (*add_acc)(float *d, const float *g, int64_t n);                 /* d += g */
  void (*mul_acc)(float *d, const float *g, const float *b, int64_t n); /* d += g * b */
  void (*div_acc)(float *d, const float *g, const float *b, int64_t n); /* d += g / b */
  void (*scale_acc)(float *d, const float *g, float s, int64_t n);      /* d += g * s */
  void (*rdiv_acc)(float *d, const float *g, float s, int64_t n);       /* d += g / s */
  /* d += k (a - b) */
  void (*diff_acc)(float *d, const float *a, const float *b, float k, int64_t n);
  void (*binary)(float *out, const float *a, const float *b, int64_t n, fsdp_binop op);
  void (*binary_scalar)(float *out, const float *a, float s, int64_t n, fsdp_binop op);
  void (*affine)(float *out, const float *a, float s, float t, int64_t n); /* a * s + t */
  /* db (m) columns [j0, j1) += sum over the n / m repeats of dout * d(a op b)/db, in double */
  void (*binary_backward_b_cols)(float *db, const float *dout, const float *a, const float *b,
                                 int64_t n, int64_t m, fsdp_binop op, int64_t j0, int64_t j1);
  /* sum of dout (add, sub) or dout * a (mul, div) over [0, n), in double */
  double (*binary_backward_b_sum)(const float *dout, const float *a, int64_t n, fsdp_binop op);
  double (*sqdiff_sum)(const float *a, const float *b, int64_t n); /* sum (a - b)^2 */
  void (*mask_apply)(float *x, const float *m, int64_t n);
  /* AdamW (optim.c) with the step's constants: decay = 1 - lr wd, step_size = lr / bc1; the
   * gradient read times gscale (g itself unchanged) */
  void (*adamw)(float *p, float *m, float *v, const float *g, int64_t n, float beta1,
                float beta2, float eps, float decay, float step_size, float bc2_sqrt,
                float gscale);
  /* the same with g and the new p masked (mask_apply's rule), g written back masked (not
   * scaled) */
  void (*adamw_masked)(float *p, float *m, float *v, float *g, const float *mask, int64_t n,
                       float beta1, float beta2, float eps, float decay, float step_size,
                       float bc2_sqrt, float gscale);
  /* rows [lo, hi) of (N, C) */
  void (*layernorm_forward)(float *out, float *mean, float *rstd, const float *inp,
                            const float *weight, const float *bias, int64_t lo, int64_t hi,
                            int C, float eps);
  /* the same on bf16 rows a (out rounded once; weight, bias, mean, rstd f32), C <=
   * FSDP_CPU_LN_ROW_MAX; with b, the residual add first: sum = a + b rounded to bf16 and
   * stored, and that normalised. The f32 body's bits between a widening and a rounding pass. */
  void (*layernorm_forward_bf16)(uint16_t *out, uint16_t *sum, float *mean, float *rstd,
                                 const uint16_t *a, const uint16_t *b, const float *weight,
                                 const float *bias, int64_t lo, int64_t hi, int C, float eps);
  void (*layernorm_backward)(float *dinp, float *dweight, float *dbias, const float *dout,
                             const float *inp, const float *weight, const float *mean,
                             const float *rstd, int64_t lo, int64_t hi, int C);
  /* the same on bf16 dinp, dout and inp (the rest f32), with the f32 body's bits between a
   * widening and a rounding pass */
  void (*layernorm_backward_bf16)(uint16_t *dinp, float *dweight, float *dbias,
                                  const uint16_t *dout, const uint16_t *inp,
                                  const float *weight, const float *mean, const float *rstd,
                                  int64_t lo, int64_t hi, int C);
  void (*softmax_forward)(float *out, const float *inp, int64_t lo, int64_t hi, int C);
  void (*softmax_backward)(float *dinp, const float *dout, const float *out, int64_t lo,
                           int64_t hi, int C);
  /* causal attention's softmax on rows [r0, r0 + rows) of a (T, T) block A, in place: row t
   * over its first t + 1 entries, zeros after them up to column `cols` (>= r0 + rows; the
   * products read no further: the rest of the row is left as it was); with `stats`, row t's
   * max and reciprocal sum go to stats[2 (t - r0)] and stats[2 (t - r0) + 1] */
  void (*att_softmax_rows)(float *A, int T, int r0, int rows, int cols, float *stats);
  /* the same probabilities, the same bits, from the scores in A and the stats the forward
   * kept: one pass, no max or sum */
  void (*att_softmax_rows_saved)(float *A, int T, int r0, int rows, int cols,
                                 const float *stats);
  /* its backward on the same rows: S holds datt and receives dscores, a (A) the forward's
   * probabilities; zeros from t + 1 up to column `cols` */
  void (*att_softmax_backward_rows)(float *S, const float *A, int T, int r0, int rows, int cols);
  /* the same three writing bf16 (attention_bf16.c): the forward's probabilities rounded into
   * P (A holds the scores and is left with their exponentials; stats as above), the same from
   * the stats (A's scores read, left as they were), the backward's dscores rounded into D from
   * datt in S and the bf16 probabilities P; zeros as above, in P and D */
  void (*att_softmax_rows_bf16)(uint16_t *P, float *A, int T, int r0, int rows, int cols,
                                float *stats);
  void (*att_softmax_rows_saved_bf16)(uint16_t *P, const float *A, int T, int r0, int rows,
                                      int cols, const float *stats);
  void (*att_softmax_backward_rows_bf16)(uint16_t *D, const float *S, const uint16_t *P, int T,
                                         int r0, int rows, int cols);
  /* attention's products (attention.c): c (M, N, row stride ldc) = alpha * a @ b (acc: c +=),
   * a's (m, p) element at a[m * sam + p * sap], b (K, N) row-major with row stride ldb. Each
   * element is one fused multiply-add chain over p in order, started from zero, then scaled
   * (and added to c): the same bits at every level and every blocking. `kind` (FSDP_ATT_*)
   * says which part the causal mask needs, with diag the offset of the diagonal: ATT_COLS
   * computes (m, n) for n <= m + diag, ATT_KHEAD sums p <= m + diag, ATT_KTAIL p >= m + diag;
   * whole vectors past the bound may be computed too (ATT_COLS: written, never past N; the
   * ATT_K* kinds read a there, which must hold zeros). ATT_COLS reads b's rows in whole
   * vectors: up to N rounded up to 16 floats must be readable (their values do not matter). */
  void (*att_mm)(float *c, int64_t ldc, const float *a, int64_t sam, int64_t sap,
                 const float *b, int64_t ldb, int M, int N, int K, int diag, int kind,
                 float alpha, bool acc);
  /* dst (cols, rows), row stride ldd = src (rows, cols), row stride lds, transposed */
  void (*att_pack)(float *dst, int64_t ldd, const float *src, int64_t lds, int rows, int cols);
  /* the rows' losses summed in double; *count += rows counted */
  double (*cross_entropy_forward)(float *lse, const float *logits, const int64_t *targets,
                                  int64_t lo, int64_t hi, int V, int64_t ignore_index,
                                  int64_t *count);
  void (*cross_entropy_backward)(float *dlogits, float sc, const float *logits,
                                 const float *lse, const int64_t *targets, int64_t lo,
                                 int64_t hi, int V, int64_t ignore_index);
} fsdp_cpu_vec_i;

enum { FSDP_ATT_FULL = 0, FSDP_ATT_COLS = 1, FSDP_ATT_KHEAD = 2, FSDP_ATT_KTAIL = 3 };

/* The causal bounds of one register block of attention's products (rows [m0, m0 + mr)), for
 * att_mm and the bf16 kernel (att_bf16.c) alike: ATT_COLS computes columns [0, *n1), the last
 * row's bound rounded up to whole vectors of vw lanes (a partial one costs more than the
 * columns it saves) and capped at N; ATT_KHEAD sums terms [0, *k1) to the last row's bound,
 * ATT_KTAIL terms [*k0, K) from the first row's (rows inside the block read the zeros the
 * contract puts in a outside their own bound). */
static inline void fsdp_cpu_att_bounds(int kind, int m0, int mr, int diag, int N, int K, int vw,
                                       int *n1, int *k0, int *k1) {
  *n1 = N, *k0 = 0, *k1 = K;
  if (kind == FSDP_ATT_COLS) {
    const int lim = (m0 + mr + diag + vw - 1) / vw * vw;
    if (lim < N) *n1 = lim;
  }
  if (kind == FSDP_ATT_KHEAD && m0 + mr + diag < K) *k1 = m0 + mr + diag;
  if (kind == FSDP_ATT_KTAIL && m0 + diag > 0) *k0 = m0 + diag < K ? m0 + diag : K;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* The lanes of x (16 f32 bit patterns) that hold a subnormal. AVX512_BF16's VCVTNEPS2BF16
 * rounds to nearest even as the integer rounding does, NaN included, but reads subnormal
 * inputs as zero: a vector with such a lane is rounded the integer way (convert.c's narrowing
 * loop, vmath.h's fsdp_vh_round at vec_avx512bf16.c), so the bits are the same. */
__attribute__((target("avx512f"), always_inline)) static inline __mmask16
fsdp_cpu_subnormal16(__m512i x) {
  const __mmask16 zero_exp = _mm512_cmpeq_epi32_mask(
      _mm512_and_si512(x, _mm512_set1_epi32(0x7f800000)), _mm512_setzero_si512());
  return _mm512_mask_test_epi32_mask(zero_exp, x, _mm512_set1_epi32(0x007fffff));
}
#endif

extern const fsdp_cpu_vec_i fsdp_cpu_vec_scalar, fsdp_cpu_vec_avx2, fsdp_cpu_vec_avx512;
/* The AVX-512 bodies with bf16 stores through AVX512_BF16 (vec_avx512bf16.c): the same bits;
 * the AVX-512 level's table on a processor with the instruction. */
extern const fsdp_cpu_vec_i fsdp_cpu_vec_avx512bf16;

/* The bodies of the level in force. */
const fsdp_cpu_vec_i *fsdp_cpu_vec(void);

/* ---- splitting work over the rank's threads (pool.h) ---------------------------------------
 * Minimum items a chunk gets: light streaming loops, transcendental ones, and rows of C. */
#define FSDP_CPU_GRAIN 32768
#define FSDP_CPU_GRAIN_HEAVY 8192
static inline int64_t fsdp_cpu_grain_rows(int64_t C, int64_t grain) {
  return C >= grain ? 1 : grain / (C > 0 ? C : 1);
}
/* Fixed blocks for sums over many rows or elements: their count depends on the size alone
 * (never on the thread count), partials are added in block order. */
#define FSDP_CPU_MAX_BLOCKS 64
static inline int64_t fsdp_cpu_blocks(int64_t items, int64_t per_item, int64_t grain) {
  int64_t work = items * (per_item > 0 ? per_item : 1), nb = work / grain;
  nb = nb < 1 ? 1 : nb > FSDP_CPU_MAX_BLOCKS ? FSDP_CPU_MAX_BLOCKS : nb;
  return nb < items ? nb : (items > 0 ? items : 1);
}

#endif
