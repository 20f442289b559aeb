/*
 * test_isa.c — the instruction-set levels of the element-wise cpu kernels (src/kernels/cpu/
 * isa.h): FSDP_CPU_ISA's rules and errors, and every vectorised kernel run at each level this
 * processor has against the scalar level (within 1e-6 relative; the design gives the same
 * bits, which the test counts and prints). Sizes are odd so every vector tail runs, and large
 * enough that the kernels split over several chunks once the pool has threads.
 * test_kernels checks the kernels' math at one level; ctest runs it once per forced level.
 * Attention's products (att_mm) and packing are checked at every level against what they
 * promise exactly: each element's chain of fused multiply-adds, bit for bit.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/core.h"
#include "kernels/cpu/half.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

static uint64_t rng_state;

static float urand(float lo, float hi) { /* xorshift64* */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  double u = (double)((rng_state * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0);
  return (float)(lo + (hi - lo) * u);
}

static float *frand(int64_t n, float lo, float hi) {
  float *p = malloc(sizeof(float) * (size_t)n);
  for (int64_t i = 0; i < n; i++) p[i] = urand(lo, hi);
  return p;
}

static float *fcopy(const float *x, int64_t n) {
  float *p = malloc(sizeof(float) * (size_t)n);
  memcpy(p, x, sizeof(float) * (size_t)n);
  return p;
}

/* ---- FSDP_CPU_ISA's rules ------------------------------------------------------------------ */

static void test_parse(void **state) {
  (void)state;
  fsdp_cpu_isa_level l;
  assert_int_equal(fsdp_cpu_isa_parse(NULL, FSDP_CPU_ISA_AVX2, &l), FSDP_OK);
  assert_int_equal(l, FSDP_CPU_ISA_AVX2); /* unset: the best */
  assert_int_equal(fsdp_cpu_isa_parse("", FSDP_CPU_ISA_AVX512, &l), FSDP_OK);
  assert_int_equal(l, FSDP_CPU_ISA_AVX512);
  assert_int_equal(fsdp_cpu_isa_parse("scalar", FSDP_CPU_ISA_AVX512, &l), FSDP_OK);
  assert_int_equal(l, FSDP_CPU_ISA_SCALAR);
  assert_int_equal(fsdp_cpu_isa_parse("AVX2", FSDP_CPU_ISA_AVX512, &l), FSDP_OK);
  assert_int_equal(l, FSDP_CPU_ISA_AVX2);
  assert_int_equal(fsdp_cpu_isa_parse("avx512", FSDP_CPU_ISA_AVX512, &l), FSDP_OK);
  assert_int_equal(l, FSDP_CPU_ISA_AVX512);

  /* a level the processor lacks: a Zen 3 asked for AVX-512 */
  assert_int_equal(fsdp_cpu_isa_parse("avx512", FSDP_CPU_ISA_AVX2, &l), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "FSDP_CPU_ISA=avx512"));
  assert_non_null(strstr(fsdp_error_msg(), "lacks AVX-512"));
  assert_non_null(strstr(fsdp_error_msg(), "its best is avx2"));
  assert_int_equal(fsdp_cpu_isa_parse("avx2", FSDP_CPU_ISA_SCALAR, &l), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "FSDP_CPU_ISA=avx2: this processor lacks AVX2"));

  /* unknown values name the variable and the choices */
  assert_int_equal(fsdp_cpu_isa_parse("sse9", FSDP_CPU_ISA_AVX512, &l), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "FSDP_CPU_ISA='sse9': unknown instruction set"));
  assert_non_null(strstr(fsdp_error_msg(), "avx512, avx2 or scalar"));
  assert_int_equal(fsdp_cpu_isa_parse("avx", FSDP_CPU_ISA_AVX512, &l), FSDP_ERR);
}

static void test_set(void **state) {
  (void)state;
  const fsdp_cpu_isa_level best = fsdp_cpu_isa_best(), was = fsdp_cpu_isa();
  for (int l = 0; l <= (int)best; l++) {
    assert_int_equal(fsdp_cpu_isa_set((fsdp_cpu_isa_level)l), FSDP_OK);
    assert_int_equal(fsdp_cpu_isa(), l);
    assert_string_equal(fsdp_cpu_isa_current(), fsdp_cpu_isa_name((fsdp_cpu_isa_level)l));
  }
  if (best < FSDP_CPU_ISA_AVX512) { /* the processor's own refusal */
    assert_int_equal(fsdp_cpu_isa_set(FSDP_CPU_ISA_AVX512), FSDP_ERR);
    assert_non_null(strstr(fsdp_error_msg(), "this processor lacks"));
    assert_int_equal(fsdp_cpu_isa(), best);
  }
  assert_int_equal(fsdp_cpu_isa_set(FSDP_CPU_ISA_COUNT), FSDP_ERR);
  assert_int_equal(fsdp_cpu_isa_set(was), FSDP_OK);
}

/* ---- every kernel at every level ----------------------------------------------------------- */

enum { N_EW = 100003, ROWS = 67, C = 389, V = 263, NOUT = 64 };

typedef struct {
  const char *name;
  float *v;
  int64_t n;
} out_t;

typedef struct {
  out_t o[NOUT];
  int count;
} outs_t;

static float *out_new(outs_t *r, const char *name, const float *init, int64_t n) {
  assert_true(r->count < NOUT);
  float *p = init ? fcopy(init, n) : calloc((size_t)n, sizeof(float));
  r->o[r->count++] = (out_t){name, p, n};
  return p;
}

static float *out_scalar(outs_t *r, const char *name, float x) {
  return out_new(r, name, &x, 1);
}

/* inputs: the same for every level */
typedef struct {
  float *x, *y, *g, *acc, *b, *w, *bias, *lx, *lg, *lacc, *logits, *lacc2, *mask;
  int64_t tgt[ROWS], ids[ROWS];
} inputs_t;

static void inputs_make(inputs_t *in) {
  rng_state = 0x9e3779b97f4a7c15ull;
  in->x = frand(N_EW, -6.0f, 6.0f);
  in->y = frand(N_EW, -2.0f, 2.0f);
  in->g = frand(N_EW, -1.0f, 1.0f);
  in->acc = frand(N_EW, -1.0f, 1.0f);
  in->b = frand(C, 0.5f, 2.0f);
  in->w = frand(C, 0.5f, 1.5f);
  in->bias = frand(C, -0.5f, 0.5f);
  in->lx = frand(ROWS * C, -3.0f, 5.0f);
  in->lg = frand(ROWS * C, -1.0f, 1.0f);
  in->lacc = frand(ROWS * C, -1.0f, 1.0f);
  in->logits = frand(ROWS * V, -8.0f, 8.0f);
  in->lacc2 = frand(ROWS * V, -1.0f, 1.0f);
  in->mask = frand(N_EW, 0.0f, 1.0f);
  for (int64_t i = 0; i < N_EW; i++) in->mask[i] = in->mask[i] < 0.3f ? 0.0f : 1.0f;
  for (int i = 0; i < ROWS; i++) {
    in->tgt[i] = i % 5 == 3 ? -100 : (int64_t)(urand(0.0f, 1.0f) * (V - 1));
    in->ids[i] = i % 7;
  }
  in->lx[C + 2] = 1e4f;  /* a row with a large mean */
  for (int c = 0; c < C; c++) in->lx[2 * C + c] += 1000.0f;
}

static void inputs_free(inputs_t *in) {
  float *all[] = {in->x, in->y, in->g, in->acc, in->b, in->w, in->bias, in->lx, in->lg,
                  in->lacc, in->logits, in->lacc2, in->mask};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

static void run_all(outs_t *r, const inputs_t *in) {
  r->count = 0;
  const int64_t n = N_EW, nc = (int64_t)ROWS * C;
  fsdp_cpu_gelu_forward(out_new(r, "gelu", NULL, n), in->x, n);
  fsdp_cpu_gelu_backward(out_new(r, "gelu backward", in->acc, n), in->g, in->x, n);
  fsdp_cpu_bias_gelu_forward(out_new(r, "bias gelu", NULL, nc), in->lx, in->b, ROWS, C);
  fsdp_cpu_bias_gelu_backward(out_new(r, "bias gelu dinp", in->lacc, nc),
                              out_new(r, "bias gelu dbias", in->w, C), in->lg, in->lx, in->b,
                              ROWS, C, false);
  fsdp_cpu_relu_forward(out_new(r, "relu", NULL, n), in->x, n);
  fsdp_cpu_relu_backward(out_new(r, "relu backward", in->acc, n), in->g, in->x, n);
  float *dm = out_new(r, "dropout mask", NULL, n);
  fsdp_cpu_dropout_forward(out_new(r, "dropout", NULL, n), dm, in->x, n, 0.3f, 42, 7);
  fsdp_cpu_dropout_backward(out_new(r, "dropout backward", in->acc, n), in->g, dm, n);
  for (int op = FSDP_BIN_ADD; op <= FSDP_BIN_DIV; op++) {
    /* b broadcast over rows (m = C), and a scalar b */
    const int64_t nb = n - n % C;
    fsdp_cpu_binary_forward(out_new(r, "binary", NULL, nb), in->x, in->b, nb, C, op);
    fsdp_cpu_binary_forward(out_new(r, "binary scalar", NULL, n), in->x, in->b, n, 1, op);
    fsdp_cpu_binary_backward(out_new(r, "binary backward a", in->acc, nb),
                             out_new(r, "binary backward b", in->w, C), in->g, in->x, in->b, nb,
                             C, op);
  }
  fsdp_cpu_affine_forward(out_new(r, "affine", NULL, n), in->x, 0.7f, -0.2f, n);
  fsdp_cpu_affine_backward(out_new(r, "affine backward", in->acc, n), in->g, 0.7f, n);

  float *mean = out_new(r, "layernorm mean", NULL, ROWS);
  float *rstd = out_new(r, "layernorm rstd", NULL, ROWS);
  float *ln = out_new(r, "layernorm", NULL, nc);
  fsdp_cpu_layernorm_forward(ln, mean, rstd, in->lx, in->w, in->bias, ROWS, C, 1e-5f);
  fsdp_cpu_layernorm_forward(out_new(r, "layernorm no affine", NULL, nc),
                             out_new(r, "mean 2", NULL, ROWS), out_new(r, "rstd 2", NULL, ROWS),
                             in->lx, NULL, NULL, ROWS, C, 1e-5f);
  fsdp_cpu_layernorm_backward(out_new(r, "layernorm dinp", in->lacc, nc),
                              out_new(r, "layernorm dweight", in->w, C),
                              out_new(r, "layernorm dbias", in->bias, C), in->lg, in->lx, in->w,
                              mean, rstd, ROWS, C);

  float *sm = out_new(r, "softmax", NULL, nc);
  fsdp_cpu_softmax_forward(sm, in->lx, ROWS, C);
  fsdp_cpu_softmax_backward(out_new(r, "softmax backward", in->lacc, nc), in->lg, sm, ROWS, C);

  float *lse = out_new(r, "cross-entropy lse", NULL, ROWS);
  int64_t count = 0;
  float loss = fsdp_cpu_cross_entropy_forward(lse, in->logits, in->tgt, ROWS, V, -100, &count);
  out_scalar(r, "cross-entropy loss", loss);
  fsdp_cpu_cross_entropy_backward(out_new(r, "cross-entropy backward", in->lacc2, ROWS * V),
                                  0.5f, in->logits, lse, in->tgt, ROWS, V, -100, count);
  out_scalar(r, "mse", fsdp_cpu_mse_forward(in->x, in->y, n));
  fsdp_cpu_mse_backward(out_new(r, "mse da", in->acc, n), out_new(r, "mse db", in->g, n), 0.9f,
                        in->x, in->y, n);
  fsdp_cpu_embedding_backward(out_new(r, "embedding backward", in->lacc, 7 * C), in->lg,
                              in->ids, ROWS, C);

  float *p = out_new(r, "adamw p", in->x, n), *m = out_new(r, "adamw m", NULL, n);
  float *v = out_new(r, "adamw v", NULL, n);
  for (int step = 1; step <= 3; step++)
    fsdp_cpu_adamw_step(p, m, v, step == 2 ? in->y : in->g, n, 1e-3f, 0.9f, 0.999f, 1e-8f,
                        0.1f, step == 3 ? 0.6f : 1.0f, step);
  p = out_new(r, "masked adamw p", in->x, n);
  float *gm = out_new(r, "masked adamw g", in->g, n);
  m = out_new(r, "masked adamw m", NULL, n), v = out_new(r, "masked adamw v", NULL, n);
  for (int step = 1; step <= 2; step++)
    fsdp_cpu_adamw_step_masked(p, m, v, gm, in->mask, n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f,
                               step == 2 ? 0.6f : 1.0f, step);
  float *mx = out_new(r, "mask apply", in->x, n);
  fsdp_cpu_mask_apply(mx, in->mask, n);

  /* attention: its softmax rows are the level's bodies; T = 70 leaves partial vectors and a
   * partial tile; lx serves as qkv (B 2, T 70, 3C with C 24) and lg as dout */
  enum { AB = 2, AT = 70, AC = 24, ANH = 3 };
  assert_true((int64_t)AB * AT * 3 * AC <= nc && (int64_t)AB * AT * AC <= nc);
  const int64_t ns = fsdp_cpu_attention_scratch(AB, AT, AC, ANH, fsdp_cpu_threads(), true);
  assert_true(ns >= fsdp_cpu_attention_scratch(AB, AT, AC, ANH, fsdp_cpu_threads(), false));
  float *scratch = calloc((size_t)ns, sizeof(float));
  assert_non_null(scratch);
  float *ast = out_new(r, "attention's softmax stats", NULL, (int64_t)AB * ANH * AT * 2);
  fsdp_cpu_attention_forward(out_new(r, "attention out", NULL, (int64_t)AB * AT * AC), ast,
                             scratch, in->lx, AB, AT, AC, ANH);
  fsdp_cpu_attention_backward(out_new(r, "attention dqkv", NULL, (int64_t)AB * AT * 3 * AC),
                              scratch, in->lg, in->lx, ast, AB, AT, AC, ANH, false);
  fsdp_cpu_attention_backward(out_new(r, "attention dqkv, recomputed", NULL,
                                      (int64_t)AB * AT * 3 * AC),
                              scratch, in->lg, in->lx, NULL, AB, AT, AC, ANH, false);
  free(scratch);
}

static void outs_free(outs_t *r) {
  for (int i = 0; i < r->count; i++) free(r->o[i].v);
  r->count = 0;
}

static void test_levels_agree(void **state) {
  (void)state;
  const fsdp_cpu_isa_level best = fsdp_cpu_isa_best(), was = fsdp_cpu_isa();
  if (best == FSDP_CPU_ISA_SCALAR) {
    printf("test_isa: this processor has no AVX2: only the scalar level, nothing to compare\n");
    skip();
  }
  inputs_t in;
  inputs_make(&in);
  outs_t ref, got;
  assert_int_equal(fsdp_cpu_isa_set(FSDP_CPU_ISA_SCALAR), FSDP_OK);
  run_all(&ref, &in);
  for (int l = FSDP_CPU_ISA_AVX2; l < FSDP_CPU_ISA_COUNT; l++) {
    if (l > (int)best) {
      printf("test_isa: %s not compared: this processor lacks it\n",
             fsdp_cpu_isa_name((fsdp_cpu_isa_level)l));
      continue;
    }
    assert_int_equal(fsdp_cpu_isa_set((fsdp_cpu_isa_level)l), FSDP_OK);
    run_all(&got, &in);
    assert_int_equal(got.count, ref.count);
    int64_t total = 0, same = 0;
    for (int k = 0; k < ref.count; k++) {
      const out_t *a = &ref.o[k], *b = &got.o[k];
      for (int64_t i = 0; i < a->n; i++) {
        float x = a->v[i], y = b->v[i];
        total++;
        if (memcmp(&x, &y, sizeof x) == 0) {
          same++;
          continue;
        }
        double err = fabs((double)x - (double)y), tol = 1e-6 * fmax(fabs(x), fabs(y));
        if (!(err <= tol))
          fail_msg("%s at %s, element %lld: %.9g, scalar level %.9g",
                   a->name, fsdp_cpu_isa_name((fsdp_cpu_isa_level)l), (long long)i, y, x);
      }
    }
    printf("test_isa: %s against scalar: %lld of %lld values bitwise equal, all within 1e-6\n",
           fsdp_cpu_isa_name((fsdp_cpu_isa_level)l), (long long)same, (long long)total);
    outs_free(&got);
  }
  outs_free(&ref);
  inputs_free(&in);
  assert_int_equal(fsdp_cpu_isa_set(was), FSDP_OK);
}

/* ---- attention's products: every level against the chain they promise ---------------------- */

/* What att_mm promises for element (m, n) of kind `kind` (isa.h): a fused multiply-add chain
 * from zero over p in its range, times alpha, plus c0 when acc; false where the element is not
 * defined (ATT_COLS above the diagonal). */
static bool att_ref(float *out, const float *a, int64_t sam, int64_t sap, const float *b,
                    int64_t ldb, int m, int n, int K, int diag, int kind, float alpha, bool acc,
                    float c0) {
  int p0 = 0, p1 = K;
  if (kind == FSDP_ATT_COLS && n > m + diag) return false;
  if (kind == FSDP_ATT_KHEAD && m + diag + 1 < K) p1 = m + diag + 1 < 0 ? 0 : m + diag + 1;
  if (kind == FSDP_ATT_KTAIL && m + diag > 0) p0 = m + diag < K ? m + diag : K;
  float s = 0.0f;
  for (int p = p0; p < p1; p++) s = fmaf(a[m * sam + p * sap], b[p * ldb + n], s);
  float r = s * alpha;
  *out = acc ? c0 + r : r;
  return true;
}

static void att_mm_case(const fsdp_cpu_vec_i *vec, const char *level, int M, int N, int K,
                        int diag, int kind, bool trans_a, bool acc) {
  /* a is (M, K) read through strides (trans_a: stored (K, M)); b's rows padded past N (what
   * ATT_COLS may read) with NaN, which must never reach a stored element; c has a guard column
   * band and guard rows that must stay as they were */
  const int lda = (trans_a ? M : K) + 3, ldb = (N + 15) / 16 * 16 + 16, ldc = N + 21;
  const int64_t na = (int64_t)(trans_a ? K : M) * lda, nc = (int64_t)(M + 2) * ldc;
  float *a = frand(na > 0 ? na : 1, -1, 1), *b = frand((int64_t)(K > 0 ? K : 1) * ldb, -1, 1);
  for (int p = 0; p < K; p++)
    for (int n = N; n < ldb; n++) b[p * ldb + n] = NAN;
  const int64_t sam = trans_a ? 1 : lda, sap = trans_a ? lda : 1;
  /* the K kinds read a past each row's range: the contract wants zeros there */
  for (int m = 0; m < M; m++)
    for (int p = 0; p < K; p++) {
      bool out = (kind == FSDP_ATT_KHEAD && p > m + diag) || (kind == FSDP_ATT_KTAIL && p < m + diag);
      if (out) a[m * sam + p * sap] = 0.0f;
    }
  float *c = frand(nc, -1, 1), *c0 = fcopy(c, nc);
  const float alpha = 0.375f;
  vec->att_mm(c + ldc, ldc, a, sam, sap, b, ldb, M, N, K, diag, kind, alpha, acc);
  for (int64_t i = 0; i < nc; i++) {
    const int row = (int)(i / ldc) - 1, col = (int)(i % ldc);
    float want;
    if (row >= 0 && row < M && col < N &&
        att_ref(&want, a, sam, sap, b, ldb, row, col, K, diag, kind, alpha, acc, c0[i])) {
      if (memcmp(&want, &c[i], sizeof want) != 0)
        fail_msg("att_mm at %s, kind %d, M %d N %d K %d diag %d trans_a %d acc %d: (%d, %d) "
                 "%.9g, the chain gives %.9g", level, kind, M, N, K, diag, trans_a, acc, row,
                 col, c[i], want);
    } else if (row < 0 || row >= M || col >= N) {
      if (memcmp(&c0[i], &c[i], sizeof c[i]) != 0)
        fail_msg("att_mm at %s, kind %d, M %d N %d K %d: wrote (%d, %d) outside the output",
                 level, kind, M, N, K, row, col);
    }
  }
  free(a), free(b), free(c), free(c0);
}

static void test_att_mm(void **state) {
  (void)state;
  const fsdp_cpu_vec_i *levels[FSDP_CPU_ISA_COUNT] = {&fsdp_cpu_vec_scalar, &fsdp_cpu_vec_avx2,
                                                      &fsdp_cpu_vec_avx512};
  /* sizes around the block (6 rows, 1-4 vectors) and vector widths, diagonals on both sides */
  const int sizes[][4] = {{1, 1, 1, 0},   {7, 13, 5, 0},  {6, 64, 64, 0},  {13, 70, 33, 6},
                          {20, 100, 17, -4}, {64, 48, 64, 64}, {37, 8, 120, -30}, {5, 129, 3, 2}};
  for (int l = 0; l <= (int)fsdp_cpu_isa_best(); l++) {
    const char *name = fsdp_cpu_isa_name((fsdp_cpu_isa_level)l);
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
      for (int kind = FSDP_ATT_FULL; kind <= FSDP_ATT_KTAIL; kind++)
        for (int t = 0; t < 2; t++)
          for (int acc = 0; acc < 2; acc++)
            att_mm_case(levels[l], name, sizes[i][0], sizes[i][1], sizes[i][2], sizes[i][3],
                        kind, t, acc);
    /* the packing: blocks of the level's width and the edges past them */
    const int shapes[][2] = {{16, 16}, {37, 21}, {256, 64}, {3, 70}, {70, 3}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
      const int rows = shapes[i][0], cols = shapes[i][1], lds = cols + 5, ldd = rows + 7;
      float *src = frand((int64_t)rows * lds, -1, 1), *dst = frand((int64_t)cols * ldd, 5, 6);
      float *was = fcopy(dst, (int64_t)cols * ldd);
      levels[l]->att_pack(dst, ldd, src, lds, rows, cols);
      for (int c = 0; c < cols; c++)
        for (int r = 0; r < ldd; r++) {
          const float want = r < rows ? src[r * lds + c] : was[c * ldd + r];
          if (memcmp(&want, &dst[c * ldd + r], sizeof want) != 0)
            fail_msg("att_pack at %s, %d x %d: (%d, %d) %.9g, want %.9g", name, rows, cols, c,
                     r, dst[c * ldd + r], want);
        }
      free(src), free(dst), free(was);
    }
  }
}

/* ---- the bf16 attention's products (att_bf16.c) against the chain they compute -------------- */

static uint16_t bf_of(float x) { /* truncated: any bf16 will do */
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (uint16_t)(u >> 16);
}
static float f_of(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}
static uint16_t bf_round(float x) { /* to nearest even (no NaN or subnormal here) */
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* VDPBF16PS's arithmetic: per lane the odd element's product added, then the even one's, each
 * sum rounded to f32 (the products of bf16 are exact in f32); over the pairs in order from zero.
 * Pairs outside an element's causal bound hold zeros in a, which leave the sum as it is. */
static float bf_chain(const uint16_t *a, int64_t sam, int64_t sap, const uint32_t *b,
                      int64_t ldb, int m, int n, int kp) {
  float s = 0.0f;
  for (int p = 0; p < kp; p++) {
    const uint16_t *ap = a + m * sam + p * sap;
    const uint32_t w = b[p * ldb + n];
    s = fmaf(f_of(ap[1]), f_of((uint16_t)(w >> 16)), s);
    s = fmaf(f_of(ap[0]), f_of((uint16_t)w), s);
  }
  return s;
}

static void bf_mm_case(int M, int N, int K, int diag, int kind, bool trans_a, bool acc,
                       bool cbf16) {
  const int kp = (K + 1) / 2;
  /* a: (M, K) row-major with pairs along k, or the interleave of a stored (K, M) */
  const int64_t lda = trans_a ? (M + 5) : 2 * kp + 6, sam = trans_a ? 2 : lda,
                sap = trans_a ? 2 * lda : 2;
  const int64_t na = trans_a ? (int64_t)kp * lda * 2 : (int64_t)M * lda;
  uint16_t *a = malloc(2 * (size_t)(na > 0 ? na : 1));
  for (int64_t i = 0; i < na; i++) a[i] = bf_of(urand(-1, 1));
  for (int m = 0; m < M; m++)
    for (int k = 0; k < 2 * kp; k++) {
      bool out = k >= K || (kind == FSDP_ATT_KHEAD && k > m + diag) ||
                 (kind == FSDP_ATT_KTAIL && k < m + diag);
      if (out) a[m * sam + (k / 2) * sap + k % 2] = 0;
    }
  /* b's words past N (read in whole vectors) hold NaNs that must never reach an output */
  const int64_t ldb = (N + 15) / 16 * 16 + 16;
  uint32_t *b = malloc(4 * (size_t)(kp > 0 ? kp : 1) * (size_t)ldb);
  for (int p = 0; p < kp; p++)
    for (int64_t n = 0; n < ldb; n++)
      b[p * ldb + n] = n < N ? (uint32_t)bf_of(urand(-1, 1)) | (uint32_t)bf_of(urand(-1, 1)) << 16
                             : 0x7fc07fc0u;
  /* c with guard columns and a guard row on each side */
  const int64_t ldc = N + 19, nc = (int64_t)(M + 2) * ldc;
  const size_t es = cbf16 ? 2 : 4;
  char *c = malloc(es * (size_t)nc), *c0 = malloc(es * (size_t)nc);
  for (int64_t i = 0; i < nc; i++) {
    float x = urand(-1, 1);
    if (cbf16) ((uint16_t *)c)[i] = bf_of(x);
    else ((float *)c)[i] = x;
  }
  memcpy(c0, c, es * (size_t)nc);
  const float alpha = 0.375f;
  fsdp_cpu_att_bf16_mm(c + es * (size_t)ldc, ldc, cbf16, a, sam, sap, b, ldb, M, N, K, diag,
                       kind, alpha, acc);
  for (int64_t i = 0; i < nc; i++) {
    const int row = (int)(i / ldc) - 1, col = (int)(i % ldc);
    const bool inside = row >= 0 && row < M && col < N;
    if (inside && kind == FSDP_ATT_COLS && col > row + diag) continue; /* undefined there */
    if (!inside) {
      if (memcmp(c0 + es * (size_t)i, c + es * (size_t)i, es) != 0)
        fail_msg("att_bf16_mm, kind %d, M %d N %d K %d: wrote (%d, %d) outside the output",
                 kind, M, N, K, row, col);
      continue;
    }
    const float r = bf_chain(a, sam, sap, b, ldb, row, col, kp) * alpha;
    if (cbf16) {
      const uint16_t want = bf_round(acc ? f_of(((uint16_t *)c0)[i]) + r : r),
                     got = ((uint16_t *)c)[i];
      if (want != got)
        fail_msg("att_bf16_mm (bf16 out), kind %d, M %d N %d K %d diag %d trans_a %d acc %d: "
                 "(%d, %d) %#x, the chain gives %#x", kind, M, N, K, diag, trans_a, acc, row,
                 col, got, want);
    } else {
      const float want = acc ? ((float *)c0)[i] + r : r, got = ((float *)c)[i];
      if (memcmp(&want, &got, sizeof want) != 0)
        fail_msg("att_bf16_mm, kind %d, M %d N %d K %d diag %d trans_a %d acc %d: (%d, %d) "
                 "%.9g, the chain gives %.9g", kind, M, N, K, diag, trans_a, acc, row, col, got,
                 want);
    }
  }
  free(a), free(b), free(c), free(c0);
}

static void test_att_bf16_mm(void **state) {
  (void)state;
  if (!fsdp_cpu_att_bf16_supported()) {
    printf("test_isa: the bf16 attention products not checked: %s\n",
           fsdp_cpu_isa() != FSDP_CPU_ISA_AVX512 ? "the AVX-512 level is not in force"
                                                : "this processor has no AVX512_BF16");
    skip();
  }
  const int sizes[][4] = {{1, 1, 1, 0},     {7, 13, 5, 0},   {6, 64, 64, 0},  {13, 70, 33, 6},
                          {20, 100, 18, -4}, {64, 48, 64, 64}, {37, 8, 120, -30}, {5, 129, 3, 2},
                          {64, 64, 256, 0}};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
    for (int kind = FSDP_ATT_FULL; kind <= FSDP_ATT_KTAIL; kind++)
      for (int t = 0; t < 2; t++)
        for (int acc = 0; acc < 2; acc++)
          for (int cb = 0; cb < 2; cb++)
            bf_mm_case(sizes[i][0], sizes[i][1], sizes[i][2], sizes[i][3], kind, t, acc, cb);
  /* the interleave: pairs of rows into words, zeros past the last row and column */
  const int shapes[][2] = {{2, 1}, {37, 21}, {256, 64}, {4, 70}, {70, 3}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    const int rows = shapes[i][0], cols = shapes[i][1], lds = cols + 5;
    const int64_t ldd = (cols + 15) / 16 * 16 + 16, nd = (int64_t)(rows / 2 + 2) * ldd;
    uint16_t *src = malloc(2 * (size_t)rows * (size_t)lds);
    uint32_t *dst = malloc(4 * (size_t)nd);
    for (int64_t k = 0; k < (int64_t)rows * lds; k++) src[k] = (uint16_t)(k * 2654435761u >> 7);
    for (int64_t k = 0; k < nd; k++) dst[k] = 0xdeadbeefu;
    fsdp_cpu_att_bf16_interleave(dst, ldd, src, lds, rows, cols);
    const int wide = (cols + 15) / 16 * 16;
    for (int64_t k = 0; k < nd; k++) {
      const int r = (int)(k / ldd) * 2, col = (int)(k % ldd);
      uint32_t want = 0xdeadbeefu;
      if (r < rows && col < wide) {
        const uint32_t lo = col < cols ? src[r * lds + col] : 0,
                       hi = col < cols && r + 1 < rows ? src[(r + 1) * lds + col] : 0;
        want = lo | hi << 16;
      }
      if (dst[k] != want)
        fail_msg("att_bf16_interleave %d x %d: word (%d, %d) %#x, want %#x", rows, cols, r / 2,
                 col, dst[k], want);
    }
    free(src), free(dst);
  }
}

/* ---- attention's softmax rows: any grouping of rows, the same bits ------------------------- */

/* The row bodies take rows two at a time (vmath.h's pair helpers) and one at a time at the end:
 * a tile's rows must come out as each row alone would, whatever the tile's start and length,
 * at every level, f32 and bf16, forward and backward. */
static void test_att_rows_grouping(void **state) {
  (void)state;
  const fsdp_cpu_isa_level best = fsdp_cpu_isa_best(), was = fsdp_cpu_isa();
  /* 1100: rows longer than one summation block (1024), which go one at a time */
  const int Ts[] = {1, 2, 3, 17, 64, 70, 131, 1100};
  for (int l = 0; l <= (int)best; l++) {
    assert_int_equal(fsdp_cpu_isa_set((fsdp_cpu_isa_level)l), FSDP_OK);
    const fsdp_cpu_vec_i *v = fsdp_cpu_vec();
    for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++)
      for (int s0 = 0; s0 < 2 && s0 < Ts[i]; s0++) {
        /* a tile from row 0 or 1, the long rows' from near the end */
        const int T = Ts[i], r0 = T > 1024 ? T - 12 + s0 : s0, rows = T - r0;
        const int64_t tt = (int64_t)T * T;
        float *A = frand(tt, -6, 6), *A1 = fcopy(A, tt), *A2 = fcopy(A, tt);
        float *S = frand(tt, -1, 1), *S1 = fcopy(S, tt), *S2 = fcopy(S, tt);
        uint16_t *P1 = calloc((size_t)tt, 2), *P2 = calloc((size_t)tt, 2),
                 *D1 = calloc((size_t)tt, 2), *D2 = calloc((size_t)tt, 2);
        float *st1 = frand(2 * (int64_t)rows, 5, 6), *st2 = frand(2 * (int64_t)rows, 5, 6);
        v->att_softmax_rows(A1, T, r0, rows, T, st1);
        for (int t = r0; t < T; t++) v->att_softmax_rows(A2, T, t, 1, T, st2 + 2 * (t - r0));
        if (memcmp(A1, A2, sizeof(float) * (size_t)tt) != 0 ||
            memcmp(st1, st2, sizeof(float) * 2 * (size_t)rows) != 0)
          fail_msg("att_softmax_rows at %s, T %d from row %d: a tile's rows differ from the rows "
                   "alone", fsdp_cpu_isa_name((fsdp_cpu_isa_level)l), T, r0);
        /* from the stats: the same bits in one pass, the columns after each row zeroed */
        memcpy(A2, A, sizeof(float) * (size_t)tt);
        v->att_softmax_rows_saved(A2, T, r0, rows, T, st1);
        if (memcmp(A1, A2, sizeof(float) * (size_t)tt) != 0)
          fail_msg("att_softmax_rows_saved at %s, T %d from row %d: not the forward's bits",
                   fsdp_cpu_isa_name((fsdp_cpu_isa_level)l), T, r0);
        v->att_softmax_backward_rows(S1, A1, T, r0, rows, T);
        for (int t = r0; t < T; t++) v->att_softmax_backward_rows(S2, A1, T, t, 1, T);
        if (memcmp(S1, S2, sizeof(float) * (size_t)tt) != 0)
          fail_msg("att_softmax_backward_rows at %s, T %d from row %d: a tile's rows differ",
                   fsdp_cpu_isa_name((fsdp_cpu_isa_level)l), T, r0);
        memcpy(A1, A, sizeof(float) * (size_t)tt), memcpy(A2, A, sizeof(float) * (size_t)tt);
        v->att_softmax_rows_bf16(P1, A1, T, r0, rows, T, st1);
        for (int t = r0; t < T; t++)
          v->att_softmax_rows_bf16(P2, A2, T, t, 1, T, t % 2 ? st2 + 2 * (t - r0) : NULL);
        v->att_softmax_backward_rows_bf16(D1, S, P1, T, r0, rows, T);
        for (int t = r0; t < T; t++) v->att_softmax_backward_rows_bf16(D2, S, P1, T, t, 1, T);
        if (memcmp(P1, P2, 2 * (size_t)tt) != 0 || memcmp(D1, D2, 2 * (size_t)tt) != 0 ||
            memcmp(A1, A2, sizeof(float) * (size_t)tt) != 0)
          fail_msg("the bf16 softmax rows at %s, T %d from row %d: a tile's rows differ",
                   fsdp_cpu_isa_name((fsdp_cpu_isa_level)l), T, r0);
        for (int t = r0 + 1; t < T; t += 2) /* the rows that kept theirs: the tile's stats */
          if (memcmp(st1 + 2 * (t - r0), st2 + 2 * (t - r0), 2 * sizeof(float)) != 0)
            fail_msg("att_softmax_rows_bf16 at %s, T %d: row %d's stats differ",
                     fsdp_cpu_isa_name((fsdp_cpu_isa_level)l), T, t);
        /* the bf16 probabilities from the stats, on the scores (left as they were): the same
         * bits in one pass, the columns after each row zeroed */
        memcpy(A2, A, sizeof(float) * (size_t)tt);
        memset(P2, 0xff, 2 * (size_t)tt);
        v->att_softmax_rows_saved_bf16(P2, A2, T, r0, rows, T, st1);
        for (int t = r0; t < T; t++)
          if (memcmp(P1 + (int64_t)t * T, P2 + (int64_t)t * T, 2 * (size_t)T) != 0)
            fail_msg("att_softmax_rows_saved_bf16 at %s, T %d, row %d: not the forward's bits",
                     fsdp_cpu_isa_name((fsdp_cpu_isa_level)l), T, t);
        if (memcmp(A2, A, sizeof(float) * (size_t)tt) != 0)
          fail_msg("att_softmax_rows_saved_bf16 at %s: the scores changed",
                   fsdp_cpu_isa_name((fsdp_cpu_isa_level)l));
        free(st1), free(st2);
        free(A), free(A1), free(A2), free(S), free(S1), free(S2);
        free(P1), free(P2), free(D1), free(D2);
      }
  }
  assert_int_equal(fsdp_cpu_isa_set(was), FSDP_OK);
}

/* ---- bf16 stores through AVX512_BF16: the same bits as the integer rounding -------------- */

static uint16_t *hbits(int64_t n) {
  uint16_t *p = malloc(sizeof(uint16_t) * (size_t)(n > 0 ? n : 1));
  for (int64_t i = 0; i < n; i++) p[i] = 0;
  return p;
}

static void same_u16(const char *what, const uint16_t *a, const uint16_t *b, int64_t n,
                     const uint16_t *inp) {
  for (int64_t i = 0; i < n; i++)
    if (a[i] != b[i])
      fail_msg("%s, element %lld (input bits %#06x): %#06x with VCVTNEPS2BF16, %#06x with the "
               "integer rounding", what, (long long)i, inp ? inp[i] : 0, b[i], a[i]);
}

static void same_f32(const char *what, const float *a, const float *b, int64_t n) {
  if (memcmp(a, b, sizeof(float) * (size_t)n) != 0) fail_msg("%s: f32 outputs differ", what);
}

/* Every bf16 slot of the two AVX-512 tables on the same inputs, bit for bit: every bf16 bit
 * pattern through bias + GELU (subnormal, infinite and NaN inputs, and outputs that are
 * subnormal: the integer path's share) and random rows through the rest. */
static void test_bf16_round(void **state) {
  (void)state;
  if (fsdp_cpu_isa_best() != FSDP_CPU_ISA_AVX512 || !__builtin_cpu_supports("avx512bf16")) {
    printf("test_isa: the bf16 rounding table not checked: this processor has no %s\n",
           fsdp_cpu_isa_best() != FSDP_CPU_ISA_AVX512 ? "AVX-512" : "AVX512_BF16");
    skip();
  }
  const fsdp_cpu_isa_level was = fsdp_cpu_isa();
  assert_int_equal(fsdp_cpu_isa_set(FSDP_CPU_ISA_AVX512), FSDP_OK);
  assert_ptr_equal(fsdp_cpu_vec(), &fsdp_cpu_vec_avx512bf16); /* the level's table here */
  assert_int_equal(fsdp_cpu_isa_set(was), FSDP_OK);
  const fsdp_cpu_vec_i *ref = &fsdp_cpu_vec_avx512, *hw = &fsdp_cpu_vec_avx512bf16;

  /* bias + GELU, forward and backward: rows of 37 (a tail in every row) */
  const int C = 37;
  const int64_t N = (65536 + C - 1) / C, n = N * C;
  uint16_t *x = hbits(n), *g = hbits(n), *y0 = hbits(n), *y1 = hbits(n);
  for (int64_t i = 0; i < n; i++) {
    x[i] = (uint16_t)(i & 0xffff);
    g[i] = (uint16_t)((i * 40503u) & 0xffff);
  }
  float *bias = calloc((size_t)C, sizeof(float)), *db0 = calloc((size_t)C, sizeof(float)),
        *db1 = calloc((size_t)C, sizeof(float));
  ref->bias_gelu_forward_bf16(y0, x, bias, 0, N, C);
  hw->bias_gelu_forward_bf16(y1, x, bias, 0, N, C);
  same_u16("bias_gelu_forward_bf16", y0, y1, n, x);
  /* a bias that moves some inputs into the subnormal range and out of it */
  for (int c = 0; c < C; c++) bias[c] = (c % 3 - 1) * 1.0e-38f;
  ref->bias_gelu_forward_bf16(y0, x, bias, 0, N, C);
  hw->bias_gelu_forward_bf16(y1, x, bias, 0, N, C);
  same_u16("bias_gelu_forward_bf16 with a bias", y0, y1, n, x);
  for (int set = 0; set < 2; set++) {
    for (int64_t i = 0; i < n; i++) y0[i] = y1[i] = (uint16_t)(0x3f80 + (i & 0x7f));
    ref->bias_gelu_backward_cols_bf16(y0, db0, g, x, bias, N, C, 0, C, set);
    hw->bias_gelu_backward_cols_bf16(y1, db1, g, x, bias, N, C, 0, C, set);
    same_u16(set ? "bias_gelu_backward_cols_bf16 (set)" : "bias_gelu_backward_cols_bf16", y0, y1,
             n, g);
    same_f32("bias_gelu_backward_cols_bf16's dbias", db0, db1, C);
  }

  /* layernorm's backward on random rows */
  const int LC = 75, LN = 9;
  float *w = frand(LC, 0.5f, 1.5f), *mean = frand(LN, -0.2f, 0.2f), *rstd = frand(LN, 0.5f, 2.f);
  uint16_t *li = hbits((int64_t)LN * LC), *lg = hbits((int64_t)LN * LC),
           *ld0 = hbits((int64_t)LN * LC), *ld1 = hbits((int64_t)LN * LC);
  for (int64_t i = 0; i < (int64_t)LN * LC; i++) {
    float v = urand(-2, 2), u = urand(-1, 1);
    uint32_t b, c;
    memcpy(&b, &v, 4), memcpy(&c, &u, 4);
    li[i] = (uint16_t)(b >> 16), lg[i] = (uint16_t)(c >> 16);
  }
  float *dw0 = calloc(LC, sizeof(float)), *dw1 = calloc(LC, sizeof(float)),
        *dbb0 = calloc(LC, sizeof(float)), *dbb1 = calloc(LC, sizeof(float));
  ref->layernorm_backward_bf16(ld0, dw0, dbb0, lg, li, w, mean, rstd, 0, LN, LC);
  hw->layernorm_backward_bf16(ld1, dw1, dbb1, lg, li, w, mean, rstd, 0, LN, LC);
  same_u16("layernorm_backward_bf16", ld0, ld1, (int64_t)LN * LC, NULL);
  same_f32("layernorm_backward_bf16's dweight", dw0, dw1, LC);
  same_f32("layernorm_backward_bf16's dbias", dbb0, dbb1, LC);
  /* and its forward, alone and after the residual add (lg as the second addend) */
  float *lb = frand(LC, -0.5f, 0.5f), *m0 = calloc(2 * LN, sizeof(float)), *m1 = m0 + LN;
  float *r0 = calloc(2 * LN, sizeof(float)), *r1 = r0 + LN;
  uint16_t *s0 = hbits((int64_t)LN * LC), *s1 = hbits((int64_t)LN * LC);
  ref->layernorm_forward_bf16(ld0, NULL, m0, r0, li, NULL, w, lb, 0, LN, LC, 1e-5f);
  hw->layernorm_forward_bf16(ld1, NULL, m1, r1, li, NULL, w, lb, 0, LN, LC, 1e-5f);
  same_u16("layernorm_forward_bf16", ld0, ld1, (int64_t)LN * LC, NULL);
  same_f32("layernorm_forward_bf16's rstd", r0, r1, LN);
  ref->layernorm_forward_bf16(ld0, s0, m0, r0, li, lg, w, lb, 0, LN, LC, 1e-5f);
  hw->layernorm_forward_bf16(ld1, s1, m1, r1, li, lg, w, lb, 0, LN, LC, 1e-5f);
  same_u16("layernorm_forward_bf16 (add)", ld0, ld1, (int64_t)LN * LC, NULL);
  same_u16("layernorm_forward_bf16's sum", s0, s1, (int64_t)LN * LC, NULL);
  same_f32("layernorm_forward_bf16's mean (add)", m0, m1, LN);
  free(lb), free(m0), free(r0), free(s0), free(s1);

  /* attention's softmax rows, forward and backward, on a causal (T, T) block */
  const int T = 70;
  const int64_t tt = (int64_t)T * T;
  float *A0 = frand(tt, -4, 4), *A1 = fcopy(A0, tt), *S = frand(tt, -1, 1);
  uint16_t *P0 = hbits(tt), *P1 = hbits(tt), *D0 = hbits(tt), *D1 = hbits(tt);
  float *As = fcopy(A0, tt), *st0 = frand(2 * T, 0, 1), *st1 = frand(2 * T, 0, 1);
  ref->att_softmax_rows_bf16(P0, A0, T, 0, T, T, st0);
  hw->att_softmax_rows_bf16(P1, A1, T, 0, T, T, st1);
  same_u16("att_softmax_rows_bf16", P0, P1, tt, NULL);
  same_f32("att_softmax_rows_bf16's exponentials", A0, A1, tt);
  same_f32("att_softmax_rows_bf16's stats", st0, st1, 2 * T);
  hw->att_softmax_rows_saved_bf16(P1, As, T, 0, T, T, st0);
  same_u16("att_softmax_rows_saved_bf16", P0, P1, tt, NULL);
  free(As), free(st0), free(st1);
  ref->att_softmax_backward_rows_bf16(D0, S, P0, T, 0, T, T);
  hw->att_softmax_backward_rows_bf16(D1, S, P0, T, 0, T, T);
  same_u16("att_softmax_backward_rows_bf16", D0, D1, tt, NULL);

  free(x), free(g), free(y0), free(y1), free(bias), free(db0), free(db1);
  free(w), free(mean), free(rstd), free(li), free(lg), free(ld0), free(ld1);
  free(dw0), free(dw1), free(dbb0), free(dbb1);
  free(A0), free(A1), free(S), free(P0), free(P1), free(D0), free(D1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse),
      cmocka_unit_test(test_set),
      cmocka_unit_test(test_levels_agree),
      cmocka_unit_test(test_att_mm),
      cmocka_unit_test(test_att_bf16_mm),
      cmocka_unit_test(test_att_rows_grouping),
      cmocka_unit_test(test_bf16_round),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
