/*
 * test_half.c — the cpu table's bf16 / f16 kernels (src/kernels/cpu/half.c) against the f32
 * kernels, bit for bit.
 *
 * The half kernels widen their operands, run the f32 arithmetic and round the results once;
 * they do it slice by slice inside tasks of the rank's threads (or per batch row, per block of
 * rows, per column tile). Whatever the slicing, every output element must be exactly what the
 * f32 slot computes on the widened inputs, rounded once to the half dtype. Each case runs the
 * slot twice, on bf16 (or f16) buffers and on their f32 widening, and compares the rounded f32
 * result with the half one bit for bit, at 1 and at 2 threads, with sizes that take several
 * slices, odd tails, rows longer than a slice (the chunked fallback), one block and several.
 * Sums over rows that the f16 pass orders differently from f32 (the fused bias + GELU's bias
 * gradient, summed per column tile) are held to 1e-6 relative instead, and to the same bits at
 * 1 and 2 threads. bf16's bias + GELU runs on the level's own bf16 bodies: ctest runs this file
 * at every instruction-set level (FSDP_CPU_ISA), as test_kernels. bf16 attention with the
 * processor's bf16 products (attention_bf16.c) is not the f32 kernel's bits: it is held to
 * bf16's precision of it, and to the same bits row by row and at either thread count; the
 * widening way is checked bit for bit with those products forced off.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/core.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/half.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"
#include "kernels/kernels.h"

#define CTX NULL

static const fsdp_kernels_i *K(void) {
  const fsdp_kernels_i *k = fsdp_kernels_of(&fsdp_device_cpu, "test");
  assert_non_null(k);
  return k;
}

static uint64_t rng = 88172645463325252ull;
static float frand(float lo, float hi) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return lo + (hi - lo) * (float)((rng >> 11) * (1.0 / 9007199254740992.0));
}

/* A half buffer and its f32 widening, filled with values in [lo, hi) rounded to dt. */
typedef struct {
  int64_t n;
  uint16_t *h;
  float *f;
} buf;

static fsdp_dtype DT = FSDP_DTYPE_BF16;

static float widen1(uint16_t v) {
  return DT == FSDP_DTYPE_BF16 ? fsdp_bf16_to_f32(v) : fsdp_f16_to_f32(v);
}
static uint16_t narrow1(float v) {
  return DT == FSDP_DTYPE_BF16 ? fsdp_f32_to_bf16(v) : fsdp_f32_to_f16(v);
}

static buf mk(int64_t n, float lo, float hi) {
  buf b = {n, malloc((size_t)n * 2 + 2), malloc((size_t)n * 4 + 4)};
  assert_non_null(b.h);
  assert_non_null(b.f);
  for (int64_t i = 0; i < n; i++) {
    b.h[i] = narrow1(frand(lo, hi));
    b.f[i] = widen1(b.h[i]);
  }
  return b;
}

static void rm(buf *b) {
  free(b->h);
  free(b->f);
}

/* the half result equals the f32 result rounded once, element for element; then the f32 side
 * takes the half values, so that accumulating buffers start the next case equal */
static void same(const buf *b, const char *what) {
  for (int64_t i = 0; i < b->n; i++) {
    uint16_t want = narrow1(b->f[i]);
    if (b->h[i] != want && !(isnan(b->f[i]) && isnan(widen1(b->h[i]))))
      fail_msg("%s (%s): element %lld is %#06x, f32 then rounded %#06x (%g)", what,
               fsdp_dtype_name(DT), (long long)i, b->h[i], want, (double)b->f[i]);
  }
  /* the next case starts from the half values on both sides */
  for (int64_t i = 0; i < b->n; i++) b->f[i] = widen1(b->h[i]);
}

static void same_f32(const float *a, const float *b, int64_t n, const char *what) {
  for (int64_t i = 0; i < n; i++)
    if (memcmp(&a[i], &b[i], 4) != 0)
      fail_msg("%s (%s): f32 element %lld is %.9g, want %.9g", what, fsdp_dtype_name(DT),
               (long long)i, (double)a[i], (double)b[i]);
}

static void close_f32(const float *a, const float *b, int64_t n, double rel, const char *what) {
  double scale = 0;
  for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(b[i]));
  for (int64_t i = 0; i < n; i++)
    if (fabs((double)a[i] - b[i]) > rel * (scale > 0 ? scale : 1))
      fail_msg("%s (%s): f32 element %lld is %.9g, want %.9g", what, fsdp_dtype_name(DT),
               (long long)i, (double)a[i], (double)b[i]);
}

/* elements of several slices of 2048 and an odd tail */
#define NE (3 * 2048 + 77)

static void elementwise_cases(void) {
  const fsdp_kernels_i *k = K();
  buf x = mk(NE, -3, 3), y = mk(NE, 0.5f, 2), o = mk(NE, 0, 1), d = mk(NE, -1, 1),
      g = mk(NE, -1, 1);
  /* GELU forward and backward (the backward adds into d) */
  assert_int_equal(k->unary_forward(CTX, DT, FSDP_UNARY_GELU, o.h, x.h, NE), FSDP_OK);
  assert_int_equal(k->unary_forward(CTX, FSDP_DTYPE_F32, FSDP_UNARY_GELU, o.f, x.f, NE), FSDP_OK);
  same(&o, "gelu forward");
  assert_int_equal(k->unary_backward(CTX, DT, FSDP_UNARY_GELU, d.h, g.h, x.h, NULL, NE), FSDP_OK);
  assert_int_equal(
      k->unary_backward(CTX, FSDP_DTYPE_F32, FSDP_UNARY_GELU, d.f, g.f, x.f, NULL, NE), FSDP_OK);
  same(&d, "gelu backward");
  /* exp backward reads the output */
  assert_int_equal(k->unary_forward(CTX, DT, FSDP_UNARY_EXP, o.h, x.h, NE), FSDP_OK);
  assert_int_equal(k->unary_forward(CTX, FSDP_DTYPE_F32, FSDP_UNARY_EXP, o.f, x.f, NE), FSDP_OK);
  same(&o, "exp forward");
  assert_int_equal(k->unary_backward(CTX, DT, FSDP_UNARY_EXP, d.h, g.h, NULL, o.h, NE), FSDP_OK);
  assert_int_equal(
      k->unary_backward(CTX, FSDP_DTYPE_F32, FSDP_UNARY_EXP, d.f, g.f, NULL, o.f, NE), FSDP_OK);
  same(&d, "exp backward");
  /* binary, same shapes and broadcast rows (a row within a slice, and one longer) */
  for (fsdp_binop op = FSDP_BIN_ADD; op <= FSDP_BIN_DIV; op++) {
    assert_int_equal(k->binary_forward(CTX, DT, o.h, x.h, y.h, NE, NE, op), FSDP_OK);
    assert_int_equal(k->binary_forward(CTX, FSDP_DTYPE_F32, o.f, x.f, y.f, NE, NE, op), FSDP_OK);
    same(&o, "binary forward");
  }
  const int64_t rows[] = {384, 2500};
  for (int r = 0; r < 2; r++) {
    const int64_t m = rows[r], n = m * 2; /* within NE */
    assert_int_equal(k->binary_forward(CTX, DT, o.h, x.h, y.h, n, m, FSDP_BIN_MUL), FSDP_OK);
    assert_int_equal(k->binary_forward(CTX, FSDP_DTYPE_F32, o.f, x.f, y.f, n, m, FSDP_BIN_MUL),
                     FSDP_OK);
    same(&o, "binary forward, broadcast");
  }
  /* binary backward, both gradients, and one buffer for both (x * x) */
  assert_int_equal(k->binary_backward(CTX, DT, d.h, o.h, g.h, x.h, y.h, NE, NE, FSDP_BIN_MUL),
                   FSDP_OK);
  assert_int_equal(
      k->binary_backward(CTX, FSDP_DTYPE_F32, d.f, o.f, g.f, x.f, y.f, NE, NE, FSDP_BIN_MUL),
      FSDP_OK);
  same(&d, "binary backward da");
  same(&o, "binary backward db");
  assert_int_equal(k->binary_backward(CTX, DT, d.h, d.h, g.h, x.h, x.h, NE, NE, FSDP_BIN_MUL),
                   FSDP_OK);
  assert_int_equal(
      k->binary_backward(CTX, FSDP_DTYPE_F32, d.f, d.f, g.f, x.f, x.f, NE, NE, FSDP_BIN_MUL),
      FSDP_OK);
  same(&d, "binary backward, da == db");
  /* axpy, affine */
  assert_int_equal(k->axpy(CTX, DT, d.h, x.h, -0.75, NE), FSDP_OK);
  assert_int_equal(k->axpy(CTX, FSDP_DTYPE_F32, d.f, x.f, -0.75, NE), FSDP_OK);
  same(&d, "axpy");
  assert_int_equal(k->affine_forward(CTX, DT, o.h, x.h, 1.5, -0.25, NE), FSDP_OK);
  assert_int_equal(k->affine_forward(CTX, FSDP_DTYPE_F32, o.f, x.f, 1.5, -0.25, NE), FSDP_OK);
  same(&o, "affine");
  /* dropout: the same mask from the same stream position, and its backward */
  buf mask = mk(NE, 0, 1);
  assert_int_equal(k->dropout_forward(CTX, DT, o.h, mask.h, x.h, NE, 0.3f, 7, 1000), FSDP_OK);
  assert_int_equal(k->dropout_forward(CTX, FSDP_DTYPE_F32, o.f, mask.f, x.f, NE, 0.3f, 7, 1000),
                   FSDP_OK);
  same(&o, "dropout forward");
  same(&mask, "dropout mask");
  assert_int_equal(k->dropout_backward(CTX, DT, d.h, g.h, mask.h, NE), FSDP_OK);
  assert_int_equal(k->dropout_backward(CTX, FSDP_DTYPE_F32, d.f, g.f, mask.f, NE), FSDP_OK);
  same(&d, "dropout backward");
  rm(&mask), rm(&x), rm(&y), rm(&o), rm(&d), rm(&g);
}

/* rows: layernorm, softmax, cross-entropy's backward, bias + GELU */
static void row_cases(int64_t N, int C) {
  const fsdp_kernels_i *k = K();
  const int64_t n = N * C;
  buf x = mk(n, -2, 2), o = mk(n, 0, 1), d = mk(n, -1, 1), g = mk(n, -1, 1);
  buf w = mk(C, 0.5f, 1.5f), b = mk(C, -0.5f, 0.5f), dw = mk(C, -1, 1), db = mk(C, -1, 1);
  float *mean = malloc(sizeof(float) * (size_t)N * 4), *rstd = mean + N, *mean32 = rstd + N,
        *rstd32 = mean32 + N;
  assert_non_null(mean);
  assert_int_equal(k->layernorm_forward(CTX, DT, o.h, mean, rstd, x.h, w.h, b.h, N, C, 1e-5f),
                   FSDP_OK);
  assert_int_equal(k->layernorm_forward(CTX, FSDP_DTYPE_F32, o.f, mean32, rstd32, x.f, w.f, b.f,
                                        N, C, 1e-5f),
                   FSDP_OK);
  same(&o, "layernorm forward");
  same_f32(mean, mean32, N, "layernorm mean");
  same_f32(rstd, rstd32, N, "layernorm rstd");
  /* backward: half parameter gradients, then f32 ones (mixed precision), then no dinp */
  assert_int_equal(k->layernorm_backward(CTX, DT, DT, d.h, dw.h, db.h, g.h, x.h, w.h, mean, rstd,
                                         N, C),
                   FSDP_OK);
  assert_int_equal(k->layernorm_backward(CTX, FSDP_DTYPE_F32, FSDP_DTYPE_F32, d.f, dw.f, db.f,
                                         g.f, x.f, w.f, mean, rstd, N, C),
                   FSDP_OK);
  same(&d, "layernorm backward dinp");
  same(&dw, "layernorm backward dweight");
  same(&db, "layernorm backward dbias");
  /* dinp alone (frozen parameters): rows split over the threads, no sums to order */
  assert_int_equal(k->layernorm_backward(CTX, DT, DT, d.h, NULL, NULL, g.h, x.h, w.h, mean, rstd,
                                         N, C),
                   FSDP_OK);
  assert_int_equal(k->layernorm_backward(CTX, FSDP_DTYPE_F32, FSDP_DTYPE_F32, d.f, NULL, NULL,
                                         g.f, x.f, w.f, mean, rstd, N, C),
                   FSDP_OK);
  same(&d, "layernorm backward dinp alone");
  float *fw = calloc((size_t)C * 4, sizeof(float)), *fb = fw + C, *fw32 = fb + C, *fb32 = fw32 + C;
  assert_non_null(fw);
  for (int pass = 0; pass < 2; pass++) {
    void *dinp = pass ? NULL : d.h;
    assert_int_equal(k->layernorm_backward(CTX, DT, FSDP_DTYPE_F32, dinp, fw, fb, g.h, x.h, w.h,
                                           mean, rstd, N, C),
                     FSDP_OK);
    assert_int_equal(k->layernorm_backward(CTX, FSDP_DTYPE_F32, FSDP_DTYPE_F32,
                                           pass ? NULL : d.f, fw32, fb32, g.f, x.f, w.f, mean,
                                           rstd, N, C),
                     FSDP_OK);
    same_f32(fw, fw32, C, "layernorm backward f32 dweight");
    same_f32(fb, fb32, C, "layernorm backward f32 dbias");
  }
  same(&d, "layernorm backward dinp (f32 parameter gradients)");
  /* residual add + layernorm: the add and then the layernorm, bit for bit, in the dtype (the sum
   * rounded before it is normalised) and in f32 */
  {
    uint16_t *hs = malloc((size_t)n * 8), *ho = hs + n, *hs2 = ho + n, *ho2 = hs2 + n;
    float *fs = malloc((size_t)n * 16 + (size_t)N * 16), *fo = fs + n, *fs2 = fo + n,
          *fo2 = fs2 + n, *m1 = fo2 + n, *r1 = m1 + N, *m2 = r1 + N, *r2 = m2 + N;
    assert_non_null(hs);
    assert_non_null(fs);
    assert_int_equal(k->add_layernorm_forward(CTX, DT, hs, ho, m1, r1, x.h, g.h, w.h, b.h, N, C,
                                              1e-5f),
                     FSDP_OK);
    assert_int_equal(k->binary_forward(CTX, DT, hs2, x.h, g.h, n, n, FSDP_BIN_ADD), FSDP_OK);
    assert_int_equal(k->layernorm_forward(CTX, DT, ho2, m2, r2, hs2, w.h, b.h, N, C, 1e-5f),
                     FSDP_OK);
    if (memcmp(hs, hs2, (size_t)n * 2) || memcmp(ho, ho2, (size_t)n * 2))
      fail_msg("add_layernorm (%s, N %lld, C %d): not the add and the layernorm's bits",
               fsdp_dtype_name(DT), (long long)N, C);
    same_f32(m1, m2, N, "add_layernorm mean");
    same_f32(r1, r2, N, "add_layernorm rstd");
    assert_int_equal(k->add_layernorm_forward(CTX, FSDP_DTYPE_F32, fs, fo, m1, r1, x.f, g.f, w.f,
                                              b.f, N, C, 1e-5f),
                     FSDP_OK);
    assert_int_equal(k->binary_forward(CTX, FSDP_DTYPE_F32, fs2, x.f, g.f, n, n, FSDP_BIN_ADD),
                     FSDP_OK);
    assert_int_equal(k->layernorm_forward(CTX, FSDP_DTYPE_F32, fo2, m2, r2, fs2, w.f, b.f, N, C,
                                          1e-5f),
                     FSDP_OK);
    same_f32(fs, fs2, n, "add_layernorm f32 sum");
    same_f32(fo, fo2, n, "add_layernorm f32 out");
    same_f32(m1, m2, N, "add_layernorm f32 mean");
    same_f32(r1, r2, N, "add_layernorm f32 rstd");
    free(hs), free(fs);
  }
  /* softmax */
  assert_int_equal(k->softmax_forward(CTX, DT, o.h, x.h, N, C), FSDP_OK);
  assert_int_equal(k->softmax_forward(CTX, FSDP_DTYPE_F32, o.f, x.f, N, C), FSDP_OK);
  same(&o, "softmax forward");
  assert_int_equal(k->softmax_backward(CTX, DT, d.h, g.h, o.h, N, C), FSDP_OK);
  assert_int_equal(k->softmax_backward(CTX, FSDP_DTYPE_F32, d.f, g.f, o.f, N, C), FSDP_OK);
  same(&d, "softmax backward");
  /* cross-entropy's backward (its forward sums the rows' losses: covered by test_dtypes) */
  int64_t *tg = malloc(sizeof(int64_t) * (size_t)N);
  float *lse = malloc(sizeof(float) * (size_t)N), loss, dloss = 0.5f;
  assert_non_null(tg);
  assert_non_null(lse);
  for (int64_t r = 0; r < N; r++) tg[r] = r % 5 == 3 ? -100 : (r * 7) % C;
  int64_t count = 0;
  assert_int_equal(k->cross_entropy_forward(CTX, FSDP_DTYPE_F32, &loss, lse, x.f, tg,
                                            FSDP_DTYPE_I64, N, C, -100, &count),
                   FSDP_OK);
  assert_int_equal(k->cross_entropy_backward(CTX, DT, d.h, &dloss, x.h, lse, tg, FSDP_DTYPE_I64,
                                             N, C, -100, count),
                   FSDP_OK);
  assert_int_equal(k->cross_entropy_backward(CTX, FSDP_DTYPE_F32, d.f, &dloss, x.f, lse, tg,
                                             FSDP_DTYPE_I64, N, C, -100, count),
                   FSDP_OK);
  same(&d, "cross-entropy backward");
  /* bias + GELU: the forward and dinp exactly, the bias gradient's sum within 1e-6 */
  assert_int_equal(k->bias_gelu_forward(CTX, DT, o.h, x.h, b.h, N, C), FSDP_OK);
  assert_int_equal(k->bias_gelu_forward(CTX, FSDP_DTYPE_F32, o.f, x.f, b.f, N, C), FSDP_OK);
  same(&o, "bias_gelu forward");
  memset(fb, 0, sizeof(float) * (size_t)C);
  memset(fb32, 0, sizeof(float) * (size_t)C);
  assert_int_equal(
      k->bias_gelu_backward(CTX, DT, FSDP_DTYPE_F32, d.h, fb, g.h, x.h, b.h, N, C, false), FSDP_OK);
  assert_int_equal(k->bias_gelu_backward(CTX, FSDP_DTYPE_F32, FSDP_DTYPE_F32, d.f, fb32, g.f, x.f,
                                         b.f, N, C, false),
                   FSDP_OK);
  same(&d, "bias_gelu backward dinp");
  if (DT == FSDP_DTYPE_BF16) /* the level's bf16 body: the f32 kernel's sums */
    same_f32(fb, fb32, C, "bias_gelu backward dbias");
  else /* f16's column tiles round each tile's sums once */
    close_f32(fb, fb32, C, 1e-6, "bias_gelu backward dbias");
  /* dinp written, not added: whatever it held before (NaN here) is never read */
  for (int64_t i = 0; i < n; i++) d.h[i] = narrow1(NAN), d.f[i] = 0.0f;
  assert_int_equal(
      k->bias_gelu_backward(CTX, DT, FSDP_DTYPE_F32, d.h, NULL, g.h, x.h, b.h, N, C, true),
      FSDP_OK);
  assert_int_equal(k->bias_gelu_backward(CTX, FSDP_DTYPE_F32, FSDP_DTYPE_F32, d.f, NULL, g.f,
                                         x.f, b.f, N, C, true),
                   FSDP_OK);
  same(&d, "bias_gelu backward, dinp set");
  /* dinp over dout (autograd writes it there when dout has no other reader): the same bits */
  {
    uint16_t *h2 = malloc(sizeof(uint16_t) * (size_t)n);
    float *f2 = malloc(sizeof(float) * (size_t)n);
    assert_non_null(h2);
    assert_non_null(f2);
    memcpy(h2, g.h, sizeof(uint16_t) * (size_t)n);
    memcpy(f2, g.f, sizeof(float) * (size_t)n);
    assert_int_equal(
        k->bias_gelu_backward(CTX, DT, FSDP_DTYPE_F32, h2, NULL, h2, x.h, b.h, N, C, true),
        FSDP_OK);
    assert_int_equal(k->bias_gelu_backward(CTX, FSDP_DTYPE_F32, FSDP_DTYPE_F32, f2, NULL, f2,
                                           x.f, b.f, N, C, true),
                     FSDP_OK);
    assert_memory_equal(h2, d.h, sizeof(uint16_t) * (size_t)n);
    /* d.f holds the half values now (same): the f32 kernel out of place again */
    assert_int_equal(k->bias_gelu_backward(CTX, FSDP_DTYPE_F32, FSDP_DTYPE_F32, d.f, NULL, g.f,
                                           x.f, b.f, N, C, true),
                     FSDP_OK);
    assert_memory_equal(f2, d.f, sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) d.f[i] = widen1(d.h[i]);
    free(h2), free(f2);
  }
  /* the bias gradient alone, and in the half dtype */
  for (int64_t i = 0; i < C; i++) db.f[i] = widen1(db.h[i]);
  assert_int_equal(k->bias_gelu_backward(CTX, DT, DT, NULL, db.h, g.h, x.h, b.h, N, C, false),
                   FSDP_OK);
  assert_int_equal(k->bias_gelu_backward(CTX, FSDP_DTYPE_F32, FSDP_DTYPE_F32, NULL, db.f, g.f,
                                         x.f, b.f, N, C, false),
                   FSDP_OK);
  for (int64_t i = 0; i < C; i++)
    assert_true(fabsf(widen1(db.h[i]) - db.f[i]) <= 1e-2f * (fabsf(db.f[i]) + 1e-3f));
  free(tg), free(lse), free(fw), free(mean);
  rm(&x), rm(&o), rm(&d), rm(&g), rm(&w), rm(&b), rm(&dw), rm(&db);
}

/* the half result near the f32 one: norm-wise within rel, and each element within 4 rel of the
 * largest magnitude; then the f32 side takes the half values (as same) */
static void near(const buf *b, double rel, const char *what) {
  double diff = 0, norm = 0, big = 0, worst = 0;
  for (int64_t i = 0; i < b->n; i++) {
    double d = (double)widen1(b->h[i]) - b->f[i];
    diff += d * d, norm += (double)b->f[i] * b->f[i];
    big = fmax(big, fabs(b->f[i])), worst = fmax(worst, fabs(d));
  }
  if (!(sqrt(diff) <= rel * sqrt(norm)) || !(worst <= 4 * rel * big))
    fail_msg("%s (%s): %.3g relative norm-wise, worst element off by %.3g of %.3g", what,
             fsdp_dtype_name(DT), sqrt(diff) / sqrt(norm), worst, big);
  for (int64_t i = 0; i < b->n; i++) b->f[i] = widen1(b->h[i]);
}

/* The bf16 / f16 attention against the f32 kernel on the widened inputs, first without saved
 * stats (each backward recomputes the probabilities whole). The widening way (native false: the
 * bf16 products forced off) gives the f32 kernel's bits. bf16 attention with the processor's
 * bf16 products (attention_bf16.c, native true; skipped where it cannot run) is held to bf16's
 * precision: the outputs and gradients within 1-2% norm-wise of the f32 kernel's (its products
 * read the rounded probabilities and score gradients), written and accumulated; and a batch
 * row's results are the same bits whichever call and thread count computes it. Then with the
 * rows' stats kept by the forward (attention_saved's (B, NH, T, 2) f32): the same outputs, and
 * a backward that rebuilds the probabilities from them gives the same bits, written and added. */
static void attention_case(int B, int T, int C, int NH, bool native) {
  const fsdp_kernels_i *k = K();
  if (native && (DT != FSDP_DTYPE_BF16 || !fsdp_cpu_bf16_gemm_force(1))) return;
  if (native && !fsdp_cpu_att_bf16_supported()) { /* AVX512_BF16 at the AVX-512 level only */
    fsdp_cpu_bf16_gemm_force(-1);
    return;
  }
  if (!native) fsdp_cpu_bf16_gemm_force(0);
  assert_int_equal(fsdp_cpu_bf16_attention_native(B, T, C, NH), native);
  const int64_t nq = (int64_t)B * T * 3 * C, no = (int64_t)B * T * C;
  fsdp_dtype sdt = FSDP_DTYPE_BOOL;
  const int64_t ns = (int64_t)B * NH * T * 2;
  assert_int_equal(k->attention_saved(CTX, DT, B, T, C, NH, &sdt), ns);
  assert_int_equal(sdt, FSDP_DTYPE_F32);
  buf qkv = mk(nq, -1, 1), o = mk(no, 0, 1), g = mk(no, -1, 1), dq = mk(nq, -1, 1);
  assert_int_equal(k->attention_forward(CTX, DT, o.h, NULL, qkv.h, B, T, C, NH), FSDP_OK);
  assert_int_equal(k->attention_forward(CTX, FSDP_DTYPE_F32, o.f, NULL, qkv.f, B, T, C, NH),
                   FSDP_OK);
  if (native) near(&o, 1e-2, "attention forward");
  else same(&o, "attention forward");
  assert_int_equal(k->attention_backward(CTX, DT, dq.h, g.h, qkv.h, NULL, B, T, C, NH, false),
                   FSDP_OK);
  assert_int_equal(
      k->attention_backward(CTX, FSDP_DTYPE_F32, dq.f, g.f, qkv.f, NULL, B, T, C, NH, false),
      FSDP_OK);
  if (native) near(&dq, 2e-2, "attention backward, added");
  else same(&dq, "attention backward");
  /* dqkv written, not added: its old contents (NaN here) never read */
  for (int64_t i = 0; i < nq; i++) dq.h[i] = narrow1(NAN), dq.f[i] = NAN;
  assert_int_equal(k->attention_backward(CTX, DT, dq.h, g.h, qkv.h, NULL, B, T, C, NH, true),
                   FSDP_OK);
  assert_int_equal(
      k->attention_backward(CTX, FSDP_DTYPE_F32, dq.f, g.f, qkv.f, NULL, B, T, C, NH, true),
      FSDP_OK);
  if (native) near(&dq, 2e-2, "attention backward, dqkv set");
  else same(&dq, "attention backward, dqkv set");
  /* with the stats: the forward's outputs unchanged, every row's stats written (NaN before) */
  float *st = malloc(sizeof(float) * (size_t)ns);
  assert_non_null(st);
  for (int64_t i = 0; i < ns; i++) st[i] = NAN;
  buf o2 = mk(no, 0, 1), dq2 = mk(nq, -1, 1), dq3 = mk(nq, 0, 0);
  assert_int_equal(k->attention_forward(CTX, DT, o2.h, st, qkv.h, B, T, C, NH), FSDP_OK);
  assert_memory_equal(o2.h, o.h, (size_t)no * 2);
  for (int64_t i = 0; i < ns; i++)
    if (!isfinite(st[i])) fail_msg("attention forward: stat %lld not written", (long long)i);
  /* the backward from them: written, and added (onto the same values both ways) */
  assert_int_equal(k->attention_backward(CTX, DT, dq3.h, g.h, qkv.h, st, B, T, C, NH, true),
                   FSDP_OK);
  assert_memory_equal(dq3.h, dq.h, (size_t)nq * 2);
  memcpy(dq3.h, dq2.h, (size_t)nq * 2);
  assert_int_equal(k->attention_backward(CTX, DT, dq2.h, g.h, qkv.h, NULL, B, T, C, NH, false),
                   FSDP_OK);
  assert_int_equal(k->attention_backward(CTX, DT, dq3.h, g.h, qkv.h, st, B, T, C, NH, false),
                   FSDP_OK);
  assert_memory_equal(dq3.h, dq2.h, (size_t)nq * 2);
  if (native) { /* row by row, at the other thread count: the same bits, stats included */
    buf o1 = mk(no, 0, 1), dq1 = mk(nq, 0, 0);
    float *st1 = calloc((size_t)ns, sizeof(float));
    assert_non_null(st1);
    const int saved = fsdp_cpu_threads();
    fsdp_cpu_set_threads(saved == 1 ? 2 : 1);
    for (int b = 0; b < B; b++) {
      const int64_t q0 = (int64_t)b * T * 3 * C, o0 = (int64_t)b * T * C;
      float *sb = st1 + (int64_t)b * NH * T * 2;
      assert_int_equal(k->attention_forward(CTX, DT, o1.h + o0, sb, qkv.h + q0, 1, T, C, NH),
                       FSDP_OK);
      assert_int_equal(k->attention_backward(CTX, DT, dq1.h + q0, g.h + o0, qkv.h + q0, sb, 1,
                                             T, C, NH, true),
                       FSDP_OK);
    }
    fsdp_cpu_set_threads(saved);
    assert_memory_equal(o1.h, o.h, (size_t)no * 2);
    assert_memory_equal(dq1.h, dq.h, (size_t)nq * 2);
    assert_memory_equal(st1, st, sizeof(float) * (size_t)ns);
    rm(&o1), rm(&dq1), free(st1);
  }
  fsdp_cpu_bf16_gemm_force(-1);
  rm(&qkv), rm(&o), rm(&g), rm(&dq), rm(&o2), rm(&dq2), rm(&dq3), free(st);
}

/* Where the bf16 products cannot serve a call, the widening way computes it, with the f32
 * kernel's bits: an odd head size or T (a pair of bf16 would straddle a head or a row), T past
 * the scratch's bound, qkv or dout at an odd 16-bit address (the packs move 32-bit words). The
 * rows' stats go from the forward to the backward as in a step. With dout misaligned the
 * forward is native, and its stats (of the bf16 products' scores, summed in another order) must
 * not reach the widened backward: their differences would mostly vanish in the bf16 rounding,
 * so the test spoils them (a backward that read them would be far off the f32 kernel's bits). */
static void widened_case(int B, int T, int C, int NH, int q_off, int g_off) {
  const fsdp_kernels_i *k = K();
  const int64_t nq = (int64_t)B * T * 3 * C, no = (int64_t)B * T * C;
  const int64_t ns = (int64_t)B * NH * T * 2;
  buf qs = mk(nq + 1, -1, 1), gs = mk(no + 1, -1, 1), o = mk(no, 0, 1), dq = mk(nq, -1, 1);
  buf qkv = {nq, qs.h + q_off, qs.f + q_off}, g = {no, gs.h + g_off, gs.f + g_off};
  float *st = calloc((size_t)ns, sizeof(float));
  assert_non_null(st);
  assert_int_equal(k->attention_forward(CTX, DT, o.h, st, qkv.h, B, T, C, NH), FSDP_OK);
  assert_int_equal(k->attention_forward(CTX, FSDP_DTYPE_F32, o.f, NULL, qkv.f, B, T, C, NH),
                   FSDP_OK);
  if (g_off == 0) same(&o, "attention forward, widened"); /* else the forward is native */
  if (g_off && fsdp_cpu_bf16_attention_native(B, T, C, NH))
    for (int64_t i = 0; i < ns; i++) st[i] = i % 2 ? 1e3f : -1.0f; /* max -1, sum 1e-3 */
  assert_int_equal(k->attention_backward(CTX, DT, dq.h, g.h, qkv.h, st, B, T, C, NH, false),
                   FSDP_OK);
  assert_int_equal(
      k->attention_backward(CTX, FSDP_DTYPE_F32, dq.f, g.f, qkv.f, NULL, B, T, C, NH, false),
      FSDP_OK);
  same(&dq, "attention backward, widened");
  rm(&qs), rm(&gs), rm(&o), rm(&dq), free(st);
}

static void native_bounds_cases(void) {
  if (DT != FSDP_DTYPE_BF16 || !fsdp_cpu_bf16_gemm_force(1)) return;
  const bool can = fsdp_cpu_att_bf16_supported();
  assert_int_equal(fsdp_cpu_bf16_attention_native(2, 64, 64, 2), can);
  assert_int_equal(fsdp_cpu_bf16_attention_native(1, 1024, 64, 2), can);
  assert_false(fsdp_cpu_bf16_attention_native(2, 64, 30, 2));   /* head size 15 */
  assert_false(fsdp_cpu_bf16_attention_native(2, 63, 64, 2));   /* T odd */
  assert_false(fsdp_cpu_bf16_attention_native(1, 1026, 64, 2)); /* past the bound */
  widened_case(2, 24, 30, 2, 0, 0);
  widened_case(2, 23, 32, 2, 0, 0);
  widened_case(2, 40, 64, 2, 1, 0); /* qkv misaligned */
  widened_case(2, 40, 64, 2, 0, 1); /* dout misaligned (the forward is native here) */
  fsdp_cpu_bf16_gemm_force(-1);
}

static void colsum_case(void) {
  const int64_t R = 300, C = 700;
  buf x = mk(R * C, -1, 1);
  float *a = calloc((size_t)C * 2, sizeof(float)), *b = a + C;
  assert_non_null(a);
  fsdp_cpu_colsum_acc_half(a, x.h, DT, R, C);
  fsdp_cpu_colsum_acc(b, x.f, R, C);
  same_f32(a, b, C, "column sums");
  free(a);
  rm(&x);
}

static void all_cases(void) {
  elementwise_cases();
  row_cases(37, 384);  /* one layernorm block, rows within a slice */
  row_cases(200, 256); /* several blocks */
  row_cases(70, 101);  /* rows that end inside a vector at every width (bf16: the row body's
                        * partial loads and stores), two blocks */
  row_cases(9, 2500);  /* rows longer than a slice: the chunked loops */
  row_cases(2, 4100);  /* past the bf16 layernorm forward's row bound (FSDP_CPU_LN_ROW_MAX) */
  attention_case(5, 40, 64, 4, false);
  attention_case(1, 70, 32, 2, false); /* too few rows to share: one at a time */
  attention_case(3, 200, 96, 3, true); /* a partial last tile */
  attention_case(2, 64, 128, 2, true);
  attention_case(2, 64, 40, 2, true);   /* head size 20: partial vectors */
  attention_case(1, 130, 144, 2, true); /* head size 72, a last tile of 2 rows */
  attention_case(2, 6, 4, 2, true);     /* head size 2: one pair */
  attention_case(1, 1024, 32, 2, true); /* the longest sequence it takes */
  native_bounds_cases();
  colsum_case();
}

static void test_bf16(void **state) {
  (void)state;
  DT = FSDP_DTYPE_BF16;
  for (int t = 1; t <= 2; t++) {
    fsdp_cpu_set_threads(t);
    all_cases();
  }
  fsdp_cpu_set_threads(0);
}

static void test_f16(void **state) {
  (void)state;
  DT = FSDP_DTYPE_F16;
  fsdp_cpu_set_threads(2);
  all_cases();
  fsdp_cpu_set_threads(0);
}

/* The level's bf16 bodies end every row of C elements with a partial vector when C is not a
 * multiple of the width: their stores must stop at the row's end. One row, C = 1..40, the
 * output followed by guard words that must keep their value (inside a longer row, a store past
 * the end would land in the next row, which is written afterwards and hides it). */
static void test_bf16_row_ends(void **state) {
  (void)state;
  DT = FSDP_DTYPE_BF16;
  enum { GUARD = 48, CMAX = 40 };
  const uint16_t canary = 0x7fc1; /* a NaN no kernel writes */
  for (int C = 1; C <= CMAX; C++) {
    buf x = mk(C, -2, 2), g = mk(C, -1, 1), b = mk(C, -1, 1), w = mk(C, 0.5f, 1.5f);
    uint16_t *o = malloc(sizeof(uint16_t) * (C + GUARD));
    float mean, rstd, db[CMAX];
    assert_non_null(o);
    for (int step = 0; step < 3; step++) {
      for (int i = 0; i < C + GUARD; i++) o[i] = canary;
      memset(db, 0, sizeof db);
      const char *what = "";
      if (step == 0) {
        what = "bias_gelu forward";
        assert_int_equal(K()->bias_gelu_forward(CTX, DT, o, x.h, b.h, 1, C), FSDP_OK);
      } else if (step == 1) {
        what = "bias_gelu backward";
        assert_int_equal(K()->bias_gelu_backward(CTX, DT, FSDP_DTYPE_F32, o, db, g.h, x.h, b.h,
                                                 1, C, true),
                         FSDP_OK);
      } else {
        what = "layernorm backward";
        assert_int_equal(K()->layernorm_forward(CTX, DT, o, &mean, &rstd, x.h, w.h, b.h, 1, C,
                                                1e-5f),
                         FSDP_OK);
        for (int i = C; i < C + GUARD; i++)
          if (o[i] != canary) fail_msg("layernorm forward, C %d: wrote past the row's end", C);
        for (int i = 0; i < C + GUARD; i++) o[i] = i < C ? 0 : canary; /* it adds into dinp */
        assert_int_equal(K()->layernorm_backward(CTX, DT, DT, o, NULL, NULL, g.h, x.h, w.h,
                                                 &mean, &rstd, 1, C),
                         FSDP_OK);
      }
      for (int i = 0; i < C; i++)
        if (o[i] == canary) /* (layernorm's values are row_cases' to check) */
          fail_msg("%s, C %d: element %d not written", what, C, i);
      for (int i = C; i < C + GUARD; i++)
        if (o[i] != canary) fail_msg("%s, C %d: wrote past the row's end at %d", what, C, i);
    }
    free(o);
    rm(&x), rm(&g), rm(&b), rm(&w);
  }
}

/* The half kernels' results do not depend on the thread count, sums included. */
static void test_threads_same_bits(void **state) {
  (void)state;
  DT = FSDP_DTYPE_BF16;
  const int64_t N = 300, C = 512;
  float *out[2];
  for (int t = 1; t <= 2; t++) {
    fsdp_cpu_set_threads(t);
    rng = 5;
    buf x = mk(N * C, -2, 2), g = mk(N * C, -1, 1), b = mk(C, -1, 1), d = mk(N * C, 0, 0);
    float *fb = calloc((size_t)C * 3, sizeof(float));
    assert_non_null(fb);
    float *mean = malloc(sizeof(float) * (size_t)N * 2), *rstd = mean + N;
    assert_non_null(mean);
    assert_int_equal(K()->bias_gelu_backward(CTX, DT, FSDP_DTYPE_F32, d.h, fb, g.h, x.h, b.h, N,
                                             (int)C, false),
                     FSDP_OK);
    assert_int_equal(K()->layernorm_forward(CTX, DT, d.h, mean, rstd, x.h, b.h, b.h, N, (int)C,
                                            1e-5f),
                     FSDP_OK);
    assert_int_equal(K()->layernorm_backward(CTX, DT, FSDP_DTYPE_F32, d.h, fb + C, fb + 2 * C,
                                             g.h, x.h, b.h, mean, rstd, N, (int)C),
                     FSDP_OK);
    out[t - 1] = malloc(sizeof(float) * (size_t)(3 * C + N * C));
    assert_non_null(out[t - 1]);
    memcpy(out[t - 1], fb, sizeof(float) * (size_t)C * 3);
    for (int64_t i = 0; i < N * C; i++) out[t - 1][3 * C + i] = widen1(d.h[i]);
    free(fb), free(mean);
    rm(&x), rm(&g), rm(&b), rm(&d);
  }
  same_f32(out[1], out[0], 3 * C + N * C, "2 threads against 1");
  free(out[0]), free(out[1]);
  fsdp_cpu_set_threads(0);
}

/* Scratch over the memory budget: the slot fails with the budget's message, writes nothing and
 * gives back what it had taken (layernorm's block partials, attention's per-task rows, the f32
 * attention's probabilities scratch). */
static void test_scratch_refused(void **state) {
  (void)state;
  DT = FSDP_DTYPE_BF16;
  fsdp_cpu_set_threads(2);
  const fsdp_kernels_i *k = K();
  enum { N = 200, C = 256, B = 4, T = 32, AC = 64, NH = 2 };
  buf x = mk(N * C, -1, 1), g = mk(N * C, -1, 1), d = mk(N * C, -1, 1), w = mk(C, 0.5f, 1.5f);
  buf qkv = mk(B * T * 3 * AC, -1, 1), o = mk(B * T * AC, -1, 1);
  float mean[N], rstd[N], dw[C];
  for (int i = 0; i < N; i++) mean[i] = 0.1f, rstd[i] = 1.5f;
  memset(dw, 0, sizeof dw);
  uint16_t *d0 = malloc(sizeof(uint16_t) * N * C), *o0 = malloc(sizeof(uint16_t) * B * T * AC);
  assert_non_null(d0);
  assert_non_null(o0);
  memcpy(d0, d.h, sizeof(uint16_t) * N * C);
  memcpy(o0, o.h, sizeof(uint16_t) * B * T * AC);
  fsdp_mem_domain *dom = fsdp_mem_domain_new();
  assert_non_null(dom);
  fsdp_mem_domain_set(dom);
  fsdp_mem_set_limit(dom, 1024);
  assert_int_equal(k->layernorm_backward(CTX, DT, FSDP_DTYPE_F32, d.h, dw, NULL, g.h, x.h, w.h,
                                         mean, rstd, N, C),
                   FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  assert_memory_equal(d.h, d0, sizeof(uint16_t) * N * C);
  for (int i = 0; i < C; i++) assert_true(dw[i] == 0.0f);
  /* the forward, alone and after the add: the f32 copies of weight and bias refused, the
   * output and the sum untouched */
  assert_int_equal(k->layernorm_forward(CTX, DT, d.h, mean, rstd, x.h, w.h, w.h, N, C, 1e-5f),
                   FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  assert_memory_equal(d.h, d0, sizeof(uint16_t) * N * C);
  assert_int_equal(k->add_layernorm_forward(CTX, DT, d.h, d.h, mean, rstd, x.h, g.h, w.h, w.h, N,
                                            C, 1e-5f),
                   FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  assert_memory_equal(d.h, d0, sizeof(uint16_t) * N * C);
  for (int i = 0; i < N; i++) assert_true(mean[i] == 0.1f && rstd[i] == 1.5f);
  assert_int_equal(k->attention_forward(CTX, DT, o.h, NULL, qkv.h, B, T, AC, NH), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  assert_memory_equal(o.h, o0, sizeof(uint16_t) * B * T * AC);
  /* the backward (its recomputed probabilities' scratch), added into and written: untouched */
  uint16_t *q0 = malloc(sizeof(uint16_t) * B * T * 3 * AC);
  assert_non_null(q0);
  memcpy(q0, qkv.h, sizeof(uint16_t) * B * T * 3 * AC);
  buf dq = mk(B * T * 3 * AC, -1, 1);
  uint16_t *dq0 = malloc(sizeof(uint16_t) * B * T * 3 * AC);
  assert_non_null(dq0);
  memcpy(dq0, dq.h, sizeof(uint16_t) * B * T * 3 * AC);
  for (int set = 0; set < 2; set++) {
    assert_int_equal(
        k->attention_backward(CTX, DT, dq.h, o.h, qkv.h, NULL, B, T, AC, NH, set == 1), FSDP_ERR);
    assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
    assert_memory_equal(dq.h, dq0, sizeof(uint16_t) * B * T * 3 * AC);
  }
  assert_memory_equal(qkv.h, q0, sizeof(uint16_t) * B * T * 3 * AC);
  free(q0), free(dq0);
  rm(&dq);
  /* the f32 kernel's scratch too, forward and backward: nothing written */
  float *of = malloc(sizeof(float) * B * T * AC), *df = malloc(sizeof(float) * B * T * 3 * AC);
  assert_non_null(of);
  assert_non_null(df);
  for (int i = 0; i < B * T * AC; i++) of[i] = 7.0f;
  for (int i = 0; i < B * T * 3 * AC; i++) df[i] = 7.0f;
  assert_int_equal(
      k->attention_forward(CTX, FSDP_DTYPE_F32, of, NULL, qkv.f, B, T, AC, NH), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  assert_int_equal(k->attention_backward(CTX, FSDP_DTYPE_F32, df, of, qkv.f, NULL, B, T, AC, NH,
                                         false),
                   FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  for (int i = 0; i < B * T * AC; i++) assert_true(of[i] == 7.0f);
  for (int i = 0; i < B * T * 3 * AC; i++) assert_true(df[i] == 7.0f);
  free(of), free(df);
  fsdp_mem_report r;
  fsdp_mem_report_get(dom, &r);
  for (int i = 0; i < r.ndevices; i++) assert_int_equal(r.counts[i].live_total, 0);
  fsdp_mem_domain_set(NULL);
  fsdp_mem_domain_free(dom);
  free(d0), free(o0);
  rm(&x), rm(&g), rm(&d), rm(&w), rm(&qkv), rm(&o);
  fsdp_cpu_set_threads(0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_scratch_refused),
      cmocka_unit_test(test_bf16),
      cmocka_unit_test(test_f16),
      cmocka_unit_test(test_bf16_row_ends),
      cmocka_unit_test(test_threads_same_bits),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
