/*
 * test_kernels.c — every CPU kernel of src/kernels/cpu/kernels.h, checked three ways:
 *   1. forward against a plain reference written here (naive loops, double accumulation),
 *      on odd shapes (T = 7, C = 12, NH = 3, vocab 11, ...) so no size is a lucky multiple;
 *   2. every backward against central finite differences of the kernel's own forward, using
 *      the scalar loss L = sum(out * w) with random w (so dout = w), accumulated in double;
 *   3. accumulation: gradient buffers start with random contents, and the test checks that
 *      the kernel added to them (got - prior == expected), never overwrote them.
 * Plus broadcasting (m divides n, m == 1, m == n), NULL gradient slots, ignore_index, reduction
 * accuracy, and hand-computed two-step SGD / AdamW trajectories.
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/core.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"
#include "kernels/kernels.h"
#include "kernels/cpu/vmath.h" /* the private SIMD exp, tested directly for its accuracy */

/* ---- helpers ---------------------------------------------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static double urand(void) { /* xorshift64*, uniform [0, 1) */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (double)((rng_state * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0);
}

static float *frand(int64_t n, float lo, float hi) {
  float *p = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
  for (int64_t i = 0; i < n; i++) p[i] = (float)(lo + (hi - lo) * urand());
  return p;
}

static float *fcopy(const float *src, int64_t n) {
  float *p = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
  memcpy(p, src, sizeof(float) * (size_t)n);
  return p;
}

static float *fzeros(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }
static double *dzeros(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(double)); }

/* |got - want| <= atol + rtol * |want| elementwise; fails naming the first bad index. */
static void check_close_d(const char *what, const float *got, const double *want, int64_t n,
                          double rtol, double atol) {
  for (int64_t i = 0; i < n; i++) {
    double err = fabs((double)got[i] - want[i]);
    if (!(err <= atol + rtol * fabs(want[i]))) {
      fail_msg("%s[%lld]: got %.9g want %.9g (err %.3g)", what, (long long)i, (double)got[i],
               want[i], err);
    }
  }
}

static void check_close_f(const char *what, const float *got, const float *want, int64_t n,
                          double rtol, double atol) {
  double *w = dzeros(n);
  for (int64_t i = 0; i < n; i++) w[i] = want[i];
  check_close_d(what, got, w, n, rtol, atol);
  free(w);
}

/* got - prior (what the kernel added) against want */
static void check_added(const char *what, const float *got, const float *prior,
                        const double *want, int64_t n, double rtol, double atol) {
  float *d = fzeros(n);
  for (int64_t i = 0; i < n; i++) d[i] = got[i] - prior[i];
  check_close_d(what, d, want, n, rtol, atol);
  free(d);
}

static double dot_fd(const float *out, const float *w, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; i++) s += (double)out[i] * w[i];
  return s;
}

/* Central finite differences of a scalar loss(ctx) w.r.t. x[i] for i = 0, step, 2 step, ...,
 * against the analytic gradient `an` (what a backward added). Tolerance per element
 * atol + rtol * |fd|, and the whole checked set must agree to 1e-2 in relative 2-norm. */
typedef double (*loss_fn)(void *ctx);

static void fd_check(const char *what, loss_fn loss, void *ctx, float *x, const float *an,
                     int64_t n, int64_t step, float eps, double rtol, double atol) {
  /* Under valgrind (the memcheck.* runs) every 8th of the elements a plain run checks: memcheck
   * needs the code paths, which the plain run's checks of every element do not add to, and
   * valgrind emulates each fused multiply-add of the exp lane by lane, so a loss is dearer
   * there (test_attention alone took over two minutes). */
  if (getenv("FSDP_UNDER_VALGRIND")) step *= 8;
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n; i += step) {
    float x0 = x[i];
    x[i] = x0 + eps;
    double lp = loss(ctx);
    x[i] = x0 - eps;
    double lm = loss(ctx);
    x[i] = x0;
    double fd = (lp - lm) / ((double)(x0 + eps) - (double)(x0 - eps));
    double err = fabs(fd - an[i]);
    num += err * err;
    den += fd * fd;
    if (!(err <= atol + rtol * fabs(fd))) {
      fail_msg("%s: d/dx[%lld] finite difference %.7g, backward %.7g", what, (long long)i, fd,
               (double)an[i]);
    }
  }
  if (den > 0.0 && !(sqrt(num / den) < 1e-2)) {
    fail_msg("%s: relative gradient error %.3g", what, sqrt(num / den));
  }
}

static float *diff(const float *got, const float *prior, int64_t n) {
  float *d = fzeros(n);
  for (int64_t i = 0; i < n; i++) d[i] = got[i] - prior[i];
  return d;
}

/* ---- private SIMD math --------------------------------------------------------------------- */

/* fsdp_vf_exp within 2 ulp of exp on the normal range; the limits and NaN as documented */
static void test_vexp(void **state) {
  (void)state;
  double worst = 0.0;
  for (float x = -87.0f; x < 88.3f; x += 0.000731f) {
    double e = exp((double)x), rel = fabs((double)fsdp_expf_v(x) - e) / e;
    worst = rel > worst ? rel : worst;
  }
  if (!(worst < 2.4e-7)) fail_msg("exp max relative error %.3g", worst);
  assert_true(fsdp_expf_v(0.0f) == 1.0f);
  assert_true(fsdp_expf_v(-INFINITY) == 0.0f && fsdp_expf_v(-100.0f) == 0.0f);
  assert_true(isinf(fsdp_expf_v(INFINITY)) && isinf(fsdp_expf_v(100.0f)));
  assert_true(isnan(fsdp_expf_v(NAN)));
  worst = 0.0;
  for (float z = -12.0f; z < 12.0f; z += 0.00137f) {
    double err = fabs((double)fsdp_vf_tanh(fsdp_vf_set(z))[0] - tanh((double)z));
    worst = err > worst ? err : worst;
  }
  if (!(worst < 3e-7)) fail_msg("tanh max absolute error %.3g", worst);
  /* the row helpers on a length with a tail, against plain double loops */
  float x[37];
  double mx = -INFINITY, s = 0, d = 0, dot = 0;
  for (int i = 0; i < 37; i++) x[i] = (float)sin(i * 1.7) * 3.0f, mx = fmax(mx, x[i]);
  for (int i = 0; i < 37; i++) s += exp(x[i] - mx), d += x[i], dot += (double)x[i] * x[i];
  assert_true(fsdp_row_max(x, 37) == (float)mx);
  assert_true(fabs(fsdp_row_expsum(NULL, x, (float)mx, 37) - s) < 1e-5 * s);
  assert_true(fabs(fsdp_row_sum(x, 37) - d) < 1e-5);
  assert_true(fabs(fsdp_row_dot(x, x, 37) - dot) < 1e-5 * dot);
}

/* ---- reference GEMM ------------------------------------------------------------------------ */

static void ref_gemm(double *c, const float *a, const float *b, int M, int N, int K, bool ta,
                     bool tb, double alpha, double beta, int lda, int ldb, int ldc) {
  for (int i = 0; i < M; i++) {
    for (int j = 0; j < N; j++) {
      double s = 0.0;
      for (int k = 0; k < K; k++) {
        double av = ta ? a[(int64_t)k * lda + i] : a[(int64_t)i * lda + k];
        double bv = tb ? b[(int64_t)j * ldb + k] : b[(int64_t)k * ldb + j];
        s += av * bv;
      }
      c[(int64_t)i * ldc + j] = alpha * s + beta * c[(int64_t)i * ldc + j];
    }
  }
}

static void test_gemm(void **state) {
  (void)state;
  const int M = 7, N = 5, K = 9;
  for (int t = 0; t < 4; t++) {
    bool ta = t & 1, tb = t & 2;
    /* padded strides: the stored matrices are wider than the used part */
    int lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 2, ldc = N + 4;
    float *a = frand((int64_t)(ta ? K : M) * lda, -1, 1);
    float *b = frand((int64_t)(tb ? N : K) * ldb, -1, 1);
    float *c = frand((int64_t)M * ldc, -1, 1);
    double *want = dzeros((int64_t)M * ldc);
    for (int64_t i = 0; i < (int64_t)M * ldc; i++) want[i] = c[i];
    ref_gemm(want, a, b, M, N, K, ta, tb, 0.75, 0.5, lda, ldb, ldc);
    for (int i = 0; i < M; i++) { /* the padding columns must stay untouched: keep them in want */
      for (int j = N; j < ldc; j++) want[(int64_t)i * ldc + j] = c[(int64_t)i * ldc + j];
    }
    fsdp_cpu_gemm(c, a, b, M, N, K, ta, tb, 0.75f, 0.5f, lda, ldb, ldc);
    check_close_d("gemm", c, want, (int64_t)M * ldc, 1e-5, 1e-5);
    free(a), free(b), free(c), free(want);
  }
  /* beta = 0 ignores whatever c held, even NaN */
  float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1}, c[4] = {NAN, NAN, NAN, NAN};
  fsdp_cpu_gemm(c, a, b, 2, 2, 3, false, false, 1.0f, 0.0f, 3, 2, 2);
  double want[4] = {1 + 3, 2 + 3, 4 + 6, 5 + 6};
  check_close_d("gemm beta0", c, want, 4, 0, 1e-6);
}

static void test_blas_threads(void **state) {
  (void)state;
  int before = fsdp_cpu_get_blas_threads();
  assert_true(before >= 1);
  fsdp_cpu_set_blas_threads(1);
  assert_int_equal(fsdp_cpu_get_blas_threads(), 1);
  fsdp_cpu_set_blas_threads(2);
  assert_int_equal(fsdp_cpu_get_blas_threads(), 2);
  fsdp_cpu_set_blas_threads(0); /* clamped to 1, never 0 threads */
  assert_int_equal(fsdp_cpu_get_blas_threads(), 1);
  fsdp_cpu_set_blas_threads(before);
}

/* ---- linear ------------------------------------------------------------------------------- */

typedef struct {
  float *out, *inp, *weight, *bias, *w;
  int M, K, N;
} linear_ctx;

static double linear_loss(void *p) {
  linear_ctx *c = p;
  fsdp_cpu_linear_forward(c->out, c->inp, c->weight, c->bias, c->M, c->K, c->N);
  return dot_fd(c->out, c->w, (int64_t)c->M * c->N);
}

static void test_linear(void **state) {
  (void)state;
  const int M = 6, K = 5, N = 7;
  linear_ctx c = {fzeros(M * N), frand(M * K, -1, 1), frand(N * K, -1, 1), frand(N, -1, 1),
                  frand(M * N, -1, 1), M, K, N};
  for (int with_bias = 0; with_bias < 2; with_bias++) {
    float *bias = with_bias ? c.bias : NULL;
    fsdp_cpu_linear_forward(c.out, c.inp, c.weight, bias, M, K, N);
    double *want = dzeros(M * N);
    for (int m = 0; m < M; m++) {
      for (int n = 0; n < N; n++) {
        double s = bias ? bias[n] : 0.0;
        for (int k = 0; k < K; k++) s += (double)c.inp[m * K + k] * c.weight[n * K + k];
        want[m * N + n] = s;
      }
    }
    check_close_d("linear out", c.out, want, M * N, 1e-5, 1e-6);
    free(want);
  }
  /* backward: finite differences for all three gradients, on top of random prior contents */
  float *p_dinp = frand(M * K, -1, 1), *p_dw = frand(N * K, -1, 1), *p_db = frand(N, -1, 1);
  float *dinp = fcopy(p_dinp, M * K), *dw = fcopy(p_dw, N * K), *db = fcopy(p_db, N);
  fsdp_cpu_linear_backward(dinp, dw, db, c.w, c.inp, c.weight, M, K, N);
  float *g_inp = diff(dinp, p_dinp, M * K), *g_w = diff(dw, p_dw, N * K), *g_b = diff(db, p_db, N);
  fd_check("linear dinp", linear_loss, &c, c.inp, g_inp, M * K, 1, 1e-2f, 1e-3, 1e-4);
  fd_check("linear dweight", linear_loss, &c, c.weight, g_w, N * K, 1, 1e-2f, 1e-3, 1e-4);
  fd_check("linear dbias", linear_loss, &c, c.bias, g_b, N, 1, 1e-2f, 1e-3, 1e-4);
  /* NULL slots: each gradient alone equals what the all-at-once call added */
  float *d1 = fzeros(M * K), *d2 = fzeros(N * K), *d3 = fzeros(N);
  fsdp_cpu_linear_backward(d1, NULL, NULL, c.w, c.inp, c.weight, M, K, N);
  fsdp_cpu_linear_backward(NULL, d2, NULL, c.w, c.inp, c.weight, M, K, N);
  fsdp_cpu_linear_backward(NULL, NULL, d3, c.w, c.inp, c.weight, M, K, N);
  fsdp_cpu_linear_backward(NULL, NULL, NULL, c.w, c.inp, c.weight, M, K, N);
  check_close_f("linear dinp alone", d1, g_inp, M * K, 1e-5, 1e-6);
  check_close_f("linear dweight alone", d2, g_w, N * K, 1e-5, 1e-6);
  check_close_f("linear dbias alone", d3, g_b, N, 1e-5, 1e-6);
  free(d1), free(d2), free(d3), free(g_inp), free(g_w), free(g_b);
  free(p_dinp), free(p_dw), free(p_db), free(dinp), free(dw), free(db);
  free(c.out), free(c.inp), free(c.weight), free(c.bias), free(c.w);
}

/* ---- bmm ------------------------------------------------------------------------------------- */

typedef struct {
  float *out, *a, *b, *w;
  int B, M, K, N;
} bmm_ctx;

static double bmm_loss(void *p) {
  bmm_ctx *c = p;
  fsdp_cpu_bmm_forward(c->out, c->a, c->b, c->B, c->M, c->K, c->N);
  return dot_fd(c->out, c->w, (int64_t)c->B * c->M * c->N);
}

static void test_bmm(void **state) {
  (void)state;
  const int B = 3, M = 4, K = 5, N = 3;
  bmm_ctx c = {fzeros(B * M * N), frand(B * M * K, -1, 1), frand(B * K * N, -1, 1),
               frand(B * M * N, -1, 1), B, M, K, N};
  fsdp_cpu_bmm_forward(c.out, c.a, c.b, B, M, K, N);
  double *want = dzeros(B * M * N);
  for (int i = 0; i < B; i++) {
    ref_gemm(want + i * M * N, c.a + i * M * K, c.b + i * K * N, M, N, K, false, false, 1, 0, K,
             N, N);
  }
  check_close_d("bmm out", c.out, want, B * M * N, 1e-5, 1e-6);
  float *pa = frand(B * M * K, -1, 1), *pb = frand(B * K * N, -1, 1);
  float *da = fcopy(pa, B * M * K), *db = fcopy(pb, B * K * N);
  fsdp_cpu_bmm_backward(da, db, c.w, c.a, c.b, B, M, K, N);
  float *ga = diff(da, pa, B * M * K), *gb = diff(db, pb, B * K * N);
  fd_check("bmm da", bmm_loss, &c, c.a, ga, B * M * K, 1, 1e-2f, 1e-3, 1e-4);
  fd_check("bmm db", bmm_loss, &c, c.b, gb, B * K * N, 1, 1e-2f, 1e-3, 1e-4);
  float *da1 = fzeros(B * M * K), *db1 = fzeros(B * K * N);
  fsdp_cpu_bmm_backward(da1, NULL, c.w, c.a, c.b, B, M, K, N);
  fsdp_cpu_bmm_backward(NULL, db1, c.w, c.a, c.b, B, M, K, N);
  fsdp_cpu_bmm_backward(NULL, NULL, c.w, c.a, c.b, B, M, K, N);
  check_close_f("bmm da alone", da1, ga, B * M * K, 1e-5, 1e-6);
  check_close_f("bmm db alone", db1, gb, B * K * N, 1e-5, 1e-6);
  free(da1), free(db1), free(ga), free(gb), free(pa), free(pb), free(da), free(db), free(want);
  free(c.out), free(c.a), free(c.b), free(c.w);
}

/* ---- the products' tally (fsdp_cpu_gemm_stats) ------------------------------------------------ */

typedef struct {
  int64_t calls;
  double flops, seconds;
} tally;

static tally tally_now(void) {
  tally t;
  fsdp_cpu_gemm_stats(&t.calls, &t.flops, &t.seconds);
  return t;
}

/* calls and FLOPs added since `from`; its seconds moved forward */
static void tally_expect(tally from, int64_t calls, double flops) {
  tally t = tally_now();
  assert_int_equal(t.calls - from.calls, calls);
  assert_true(t.flops - from.flops == flops);
  assert_true(t.seconds >= from.seconds);
  if (calls) assert_true(t.seconds > from.seconds);
}

/* A product on a thread of its own: its tally before and after, for the test's thread to check
 * (cmocka's assertions belong to the test's thread). */
typedef struct {
  float *buf;
  tally before, after;
  int rc;
} other_thread;

static void *tally_other_thread(void *arg) {
  other_thread *o = arg;
  const fsdp_kernels_i *k = fsdp_kernels_of(&fsdp_device_cpu, "test");
  o->before = tally_now();
  o->rc = k->gemm(NULL, FSDP_DTYPE_F32, o->buf, o->buf + 64, o->buf + 128, 8, 8, 8, false, false,
                  1, 0, 8, 8, 8);
  o->after = tally_now();
  return NULL;
}

/* The kernel table's gemm, bmm and linear slots add to the calling thread's tally: a call each,
 * 2 M N K FLOPs a product (a linear's backward counts each gradient it makes, a bmm each of its B
 * products, any dtype); the kernels under them, called directly, do not; another thread's
 * products are its own; a call the slot refuses is not counted. */
static void test_gemm_stats(void **state) {
  (void)state;
  const fsdp_kernels_i *k = fsdp_kernels_of(&fsdp_device_cpu, "test");
  const int M = 40, K = 24, N = 16, B = 3;
  float *x = frand(B * M * K, -1, 1), *w = frand(B * K * N, -1, 1), *bias = frand(N, -1, 1),
        *o = fzeros(B * M * N), *g = frand(B * M * N, -1, 1), *dx = fzeros(B * M * K),
        *dw = fzeros(B * K * N), *db = fzeros(N);
  const double mnk = 2.0 * M * N * K;
  tally t = tally_now();
  assert_int_equal(k->linear_forward(NULL, FSDP_DTYPE_F32, o, x, w, bias, M, K, N), FSDP_OK);
  tally_expect(t, 1, mnk);
  t = tally_now();
  assert_int_equal(k->linear_backward(NULL, FSDP_DTYPE_F32, FSDP_DTYPE_F32, dx, dw, db, g, x, w,
                                      M, K, N),
                   FSDP_OK);
  tally_expect(t, 1, 2 * mnk);
  t = tally_now();
  assert_int_equal(k->linear_backward(NULL, FSDP_DTYPE_F32, FSDP_DTYPE_F32, NULL, dw, NULL, g, x,
                                      w, M, K, N),
                   FSDP_OK);
  assert_int_equal(k->linear_backward(NULL, FSDP_DTYPE_F32, FSDP_DTYPE_F32, NULL, NULL, db, g, x,
                                      w, M, K, N),
                   FSDP_OK);
  tally_expect(t, 2, mnk); /* the column sum alone is no product */
  t = tally_now();
  assert_int_equal(k->gemm(NULL, FSDP_DTYPE_F32, o, x, w, M, N, K, false, false, 1, 0, K, N, N),
                   FSDP_OK);
  tally_expect(t, 1, mnk);
  t = tally_now();
  assert_int_equal(k->bmm_forward(NULL, FSDP_DTYPE_F32, o, x, w, B, M, K, N), FSDP_OK);
  assert_int_equal(k->bmm_backward(NULL, FSDP_DTYPE_F32, dx, NULL, g, x, w, B, M, K, N), FSDP_OK);
  tally_expect(t, 2, 2 * B * mnk);
  /* bf16 (native or through the conversion pass): the same count */
  uint16_t *hx = calloc((size_t)M * K, 2), *hw = calloc((size_t)N * K, 2),
           *ho = calloc((size_t)M * N, 2);
  t = tally_now();
  assert_int_equal(k->linear_forward(NULL, FSDP_DTYPE_BF16, ho, hx, hw, NULL, M, K, N), FSDP_OK);
  tally_expect(t, 1, mnk);
  /* a refused call runs no product: not counted */
  t = tally_now();
  assert_int_not_equal(
      k->gemm(NULL, FSDP_DTYPE_I64, o, x, w, M, N, K, false, false, 1, 0, K, N, N), FSDP_OK);
  assert_int_not_equal(k->linear_forward(NULL, FSDP_DTYPE_I64, o, x, w, NULL, M, K, N), FSDP_OK);
  tally_expect(t, 0, 0);
  /* below the table: not counted */
  t = tally_now();
  fsdp_cpu_gemm(o, x, w, M, N, K, false, false, 1, 0, K, N, N);
  fsdp_cpu_linear_forward(o, x, w, bias, M, K, N);
  tally_expect(t, 0, 0);
  /* another thread's products are its own */
  t = tally_now();
  other_thread ot = {.buf = o};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, tally_other_thread, &ot), 0);
  assert_int_equal(pthread_join(th, NULL), 0);
  assert_int_equal(ot.rc, FSDP_OK);
  assert_int_equal(ot.before.calls, 0); /* a new thread starts at zero */
  assert_true(ot.before.flops == 0.0 && ot.before.seconds == 0.0);
  assert_int_equal(ot.after.calls, 1);
  assert_true(ot.after.flops == 2.0 * 8 * 8 * 8 && ot.after.seconds > 0.0);
  tally_expect(t, 0, 0);
  free(hx), free(hw), free(ho);
  free(x), free(w), free(bias), free(o), free(g), free(dx), free(dw), free(db);
}

/* ---- binary with broadcasting, affine -------------------------------------------------------- */

typedef struct {
  float *out, *a, *b, *w;
  int64_t n, m;
  fsdp_binop op;
} bin_ctx;

static double bin_loss(void *p) {
  bin_ctx *c = p;
  fsdp_cpu_binary_forward(c->out, c->a, c->b, c->n, c->m, c->op);
  return dot_fd(c->out, c->w, c->n);
}

static void test_binary(void **state) {
  (void)state;
  const char *names[] = {"add", "sub", "mul", "div"};
  const int64_t n = 60, ms[] = {12, 1, 60, 5};
  for (int op = FSDP_BIN_ADD; op <= FSDP_BIN_DIV; op++) {
    for (size_t mi = 0; mi < sizeof ms / sizeof ms[0]; mi++) {
      const int64_t m = ms[mi];
      char what[64];
      snprintf(what, sizeof what, "binary %s n=%lld m=%lld", names[op], (long long)n,
               (long long)m);
      bin_ctx c = {fzeros(n), frand(n, -2, 2), frand(m, 0.5, 2), frand(n, -1, 1), n, m, op};
      fsdp_cpu_binary_forward(c.out, c.a, c.b, n, m, (fsdp_binop)op);
      double *want = dzeros(n);
      for (int64_t i = 0; i < n; i++) {
        double x = c.a[i], y = c.b[i % m];
        want[i] = op == FSDP_BIN_ADD ? x + y : op == FSDP_BIN_SUB ? x - y
                : op == FSDP_BIN_MUL ? x * y : x / y;
      }
      check_close_d(what, c.out, want, n, 1e-6, 1e-7);
      /* in place, out == a */
      float *inplace = fcopy(c.a, n);
      fsdp_cpu_binary_forward(inplace, inplace, c.b, n, m, (fsdp_binop)op);
      check_close_f(what, inplace, c.out, n, 0, 0);
      /* backward: accumulate onto prior contents, then finite differences */
      float *pa = frand(n, -1, 1), *pb = frand(m, -1, 1);
      float *da = fcopy(pa, n), *db = fcopy(pb, m);
      fsdp_cpu_binary_backward(da, db, c.w, c.a, c.b, n, m, (fsdp_binop)op);
      float *ga = diff(da, pa, n), *gb = diff(db, pb, m);
      fd_check(what, bin_loss, &c, c.a, ga, n, 1, 1e-2f, 1e-3, 1e-4);
      fd_check(what, bin_loss, &c, c.b, gb, m, 1, 1e-2f, 2e-3, 1e-4);
      /* one slot at a time, and both NULL */
      float *da1 = fzeros(n), *db1 = fzeros(m);
      fsdp_cpu_binary_backward(da1, NULL, c.w, c.a, c.b, n, m, (fsdp_binop)op);
      fsdp_cpu_binary_backward(NULL, db1, c.w, c.a, c.b, n, m, (fsdp_binop)op);
      fsdp_cpu_binary_backward(NULL, NULL, c.w, c.a, c.b, n, m, (fsdp_binop)op);
      check_close_f(what, da1, ga, n, 1e-6, 1e-7);
      check_close_f(what, db1, gb, m, 1e-6, 1e-7);
      free(da1), free(db1), free(ga), free(gb), free(pa), free(pb), free(da), free(db);
      free(inplace), free(want), free(c.out), free(c.a), free(c.b), free(c.w);
    }
  }
}

/* x * x: both gradients land in one buffer (da == db) and must both be added */
static void test_binary_aliased_grads(void **state) {
  (void)state;
  const int64_t n = 13;
  float *x = frand(n, -2, 2), *w = frand(n, -1, 1), *prior = frand(n, -1, 1);
  float *g = fcopy(prior, n);
  fsdp_cpu_binary_backward(g, g, w, x, x, n, n, FSDP_BIN_MUL);
  double *want = dzeros(n);
  for (int64_t i = 0; i < n; i++) want[i] = 2.0 * w[i] * x[i];
  check_added("mul x*x", g, prior, want, n, 1e-5, 1e-6);
  free(x), free(w), free(prior), free(g), free(want);
}

static void test_affine(void **state) {
  (void)state;
  const int64_t n = 23;
  float *a = frand(n, -3, 3), *out = fzeros(n);
  fsdp_cpu_affine_forward(out, a, -1.5f, 0.25f, n);
  double *want = dzeros(n);
  for (int64_t i = 0; i < n; i++) want[i] = a[i] * -1.5 + 0.25;
  check_close_d("affine", out, want, n, 1e-6, 1e-7);
  float *prior = frand(n, -1, 1), *da = fcopy(prior, n), *g = frand(n, -1, 1);
  fsdp_cpu_affine_backward(da, g, -1.5f, n);
  for (int64_t i = 0; i < n; i++) want[i] = g[i] * -1.5;
  check_added("affine backward", da, prior, want, n, 1e-6, 1e-6);
  free(a), free(out), free(want), free(prior), free(da), free(g);
}

/* ---- activations ----------------------------------------------------------------------------- */

typedef struct {
  float *out, *inp, *w, *mask;
  int64_t n;
  int kind; /* 0 relu, 1 gelu, 2 dropout */
  float p;
  uint64_t key, first;
} act_ctx;

static double act_loss(void *p) {
  act_ctx *c = p;
  if (c->kind == 0) fsdp_cpu_relu_forward(c->out, c->inp, c->n);
  else if (c->kind == 1) fsdp_cpu_gelu_forward(c->out, c->inp, c->n);
  else fsdp_cpu_dropout_forward(c->out, c->mask, c->inp, c->n, c->p, c->key, c->first);
  return dot_fd(c->out, c->w, c->n);
}

static double ref_gelu(double x) {
  return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

static void test_relu(void **state) {
  (void)state;
  const int64_t n = 37;
  act_ctx c = {fzeros(n), frand(n, -2, 2), frand(n, -1, 1), NULL, n, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; i++) { /* keep away from the kink for finite differences */
    if (fabsf(c.inp[i]) < 0.1f) c.inp[i] = c.inp[i] < 0 ? -0.3f : 0.3f;
  }
  fsdp_cpu_relu_forward(c.out, c.inp, n);
  double *want = dzeros(n);
  for (int64_t i = 0; i < n; i++) want[i] = c.inp[i] > 0 ? c.inp[i] : 0;
  check_close_d("relu", c.out, want, n, 0, 0);
  float *prior = frand(n, -1, 1), *d = fcopy(prior, n);
  fsdp_cpu_relu_backward(d, c.w, c.inp, n);
  float *g = diff(d, prior, n);
  fd_check("relu backward", act_loss, &c, c.inp, g, n, 1, 1e-2f, 1e-3, 1e-4);
  free(prior), free(d), free(g), free(want), free(c.out), free(c.inp), free(c.w);
}

static void test_gelu(void **state) {
  (void)state;
  /* 1001: odd, so the SIMD tail path runs; range covers saturation on both sides */
  const int64_t n = 1001;
  act_ctx c = {fzeros(n), frand(n, -6, 6), frand(n, -1, 1), NULL, n, 1, 0, 0, 0};
  c.inp[0] = 0.0f, c.inp[1] = -20.0f, c.inp[2] = 20.0f, c.inp[3] = 1e-6f;
  fsdp_cpu_gelu_forward(c.out, c.inp, n);
  double *want = dzeros(n);
  for (int64_t i = 0; i < n; i++) want[i] = ref_gelu(c.inp[i]);
  check_close_d("gelu", c.out, want, n, 1e-6, 3e-7);
  float *prior = frand(n, -1, 1), *d = fcopy(prior, n);
  fsdp_cpu_gelu_backward(d, c.w, c.inp, n);
  float *g = diff(d, prior, n);
  /* analytic derivative of the double formula too: tighter than finite differences */
  for (int64_t i = 0; i < n; i++) {
    double x = c.inp[i], h = 1e-5;
    want[i] = c.w[i] * (ref_gelu(x + h) - ref_gelu(x - h)) / (2 * h);
  }
  check_close_d("gelu backward (double fd)", g, want, n, 1e-4, 1e-5);
  fd_check("gelu backward", act_loss, &c, c.inp, g, n, 1, 1e-2f, 1e-2, 1e-3);
  free(prior), free(d), free(g), free(want), free(c.out), free(c.inp), free(c.w);
}

static void test_dropout(void **state) {
  (void)state;
  const int64_t n = 4099;
  const float p = 0.3f;
  const uint64_t key = fsdp_rng_key(1234, "dropout"), first = 77;
  act_ctx c = {fzeros(n), frand(n, -2, 2), frand(n, -1, 1), fzeros(n), n, 2, p, key, first};
  fsdp_cpu_dropout_forward(c.out, c.mask, c.inp, n, p, key, first);
  float *u = fzeros(n);
  fsdp_rng_uniform(u, n, key, first);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; i++) {
    float want_mask = u[i] >= p ? 1.0f / (1.0f - p) : 0.0f;
    if (c.mask[i] != want_mask) {
      fail_msg("dropout mask[%lld] %g want %g", (long long)i, c.mask[i], want_mask);
    }
    if (fabsf(c.out[i] - c.inp[i] * want_mask) > 1e-6f) fail_msg("dropout out[%lld]", (long long)i);
    kept += c.mask[i] != 0.0f;
  }
  /* keep fraction near 1 - p (4099 draws: sd ~ 0.007) */
  assert_true(fabs((double)kept / n - (1.0 - p)) < 0.04);
  /* a slice generated on its own equals the same slice of the whole (what a rank does) */
  float *o2 = fzeros(100), *m2 = fzeros(100);
  fsdp_cpu_dropout_forward(o2, m2, c.inp + 500, 100, p, key, first + 500);
  check_close_f("dropout slice", m2, c.mask + 500, 100, 0, 0);
  /* in place, out == inp */
  float *ip = fcopy(c.inp, n), *m3 = fzeros(n);
  fsdp_cpu_dropout_forward(ip, m3, ip, n, p, key, first);
  check_close_f("dropout in place", ip, c.out, n, 0, 0);
  /* p = 0 is the identity with an all-ones mask */
  fsdp_cpu_dropout_forward(o2, m2, c.inp, 100, 0.0f, key, first);
  for (int i = 0; i < 100; i++) assert_true(m2[i] == 1.0f && o2[i] == c.inp[i]);
  float *prior = frand(n, -1, 1), *d = fcopy(prior, n);
  fsdp_cpu_dropout_backward(d, c.w, c.mask, n);
  float *g = diff(d, prior, n);
  fd_check("dropout backward", act_loss, &c, c.inp, g, n, 7, 1e-2f, 1e-3, 1e-4);
  free(prior), free(d), free(g), free(u), free(o2), free(m2), free(ip), free(m3);
  free(c.out), free(c.inp), free(c.w), free(c.mask);
}

/* ---- embedding ------------------------------------------------------------------------------- */

typedef struct {
  float *out;
  const int64_t *ids;
  float *weight, *w;
  int64_t N;
  int C;
} emb_ctx;

static double emb_loss(void *p) {
  emb_ctx *c = p;
  fsdp_cpu_embedding_forward(c->out, c->ids, c->weight, c->N, c->C);
  return dot_fd(c->out, c->w, c->N * c->C);
}

static void test_embedding(void **state) {
  (void)state;
  const int V = 5, C = 6;
  const int64_t N = 9;
  int64_t ids[9] = {0, 3, 3, 4, 1, 3, 0, 2, 4}; /* repeated ids: scatter-add must sum them */
  emb_ctx c = {fzeros(N * C), ids, frand(V * C, -1, 1), frand(N * C, -1, 1), N, C};
  fsdp_cpu_embedding_forward(c.out, ids, c.weight, N, C);
  for (int64_t i = 0; i < N; i++) {
    check_close_f("embedding", c.out + i * C, c.weight + (int)ids[i] * C, C, 0, 0);
  }
  float *prior = frand(V * C, -1, 1), *d = fcopy(prior, V * C);
  fsdp_cpu_embedding_backward(d, c.w, ids, N, C);
  double *want = dzeros(V * C);
  for (int64_t i = 0; i < N; i++) {
    for (int j = 0; j < C; j++) want[(int)ids[i] * C + j] += c.w[i * C + j];
  }
  check_added("embedding backward", d, prior, want, V * C, 1e-6, 1e-6);
  float *g = diff(d, prior, V * C);
  fd_check("embedding backward", emb_loss, &c, c.weight, g, V * C, 1, 1e-2f, 1e-3, 1e-4);
  free(prior), free(d), free(want), free(g), free(c.out), free(c.weight), free(c.w);
}

/* ---- layernorm ------------------------------------------------------------------------------- */

typedef struct {
  float *out, *mean, *rstd, *inp, *weight, *bias, *w;
  int64_t N;
  int C;
} ln_ctx;

static double ln_loss(void *p) {
  ln_ctx *c = p;
  fsdp_cpu_layernorm_forward(c->out, c->mean, c->rstd, c->inp, c->weight, c->bias, c->N, c->C,
                             1e-5f);
  return dot_fd(c->out, c->w, c->N * c->C);
}

static void ref_layernorm(double *out, double *mean, double *rstd, const float *inp,
                          const float *weight, const float *bias, int64_t N, int C, double eps) {
  for (int64_t n = 0; n < N; n++) {
    double m = 0, v = 0;
    for (int c = 0; c < C; c++) m += inp[n * C + c];
    m /= C;
    for (int c = 0; c < C; c++) v += (inp[n * C + c] - m) * (inp[n * C + c] - m);
    v /= C;
    double s = 1.0 / sqrt(v + eps);
    for (int c = 0; c < C; c++) {
      double w = weight ? weight[c] : 1.0, b = bias ? bias[c] : 0.0;
      out[n * C + c] = (inp[n * C + c] - m) * s * w + b;
    }
    mean[n] = m, rstd[n] = s;
  }
}

static void test_layernorm(void **state) {
  (void)state;
  const int64_t N = 7;
  const int Cs[] = {12, 37};
  for (int ci = 0; ci < 2; ci++) {
    const int C = Cs[ci];
    ln_ctx c = {fzeros(N * C), fzeros(N), fzeros(N), frand(N * C, -2, 2), frand(C, 0.5, 1.5),
                frand(C, -1, 1), frand(N * C, -1, 1), N, C};
    for (int c2 = 0; c2 < C; c2++) c.inp[c2] += 100.0f; /* row 0: large mean, small spread */
    for (int variant = 0; variant < 4; variant++) { /* weight / bias present or NULL */
      float *wt = variant & 1 ? NULL : c.weight, *bs = variant & 2 ? NULL : c.bias;
      fsdp_cpu_layernorm_forward(c.out, c.mean, c.rstd, c.inp, wt, bs, N, C, 1e-5f);
      double *want = dzeros(N * C), *wm = dzeros(N), *wr = dzeros(N);
      ref_layernorm(want, wm, wr, c.inp, wt, bs, N, C, 1e-5);
      check_close_d("layernorm out", c.out, want, N * C, 1e-4, 1e-4);
      check_close_d("layernorm mean", c.mean, wm, N, 1e-6, 1e-6);
      check_close_d("layernorm rstd", c.rstd, wr, N, 1e-4, 0);
      free(want), free(wm), free(wr);
    }
    /* backward with weight and bias */
    ln_loss(&c);
    float *pi = frand(N * C, -1, 1), *pw = frand(C, -1, 1), *pb = frand(C, -1, 1);
    float *di = fcopy(pi, N * C), *dw = fcopy(pw, C), *db = fcopy(pb, C);
    fsdp_cpu_layernorm_backward(di, dw, db, c.w, c.inp, c.weight, c.mean, c.rstd, N, C);
    float *gi = diff(di, pi, N * C), *gw = diff(dw, pw, C), *gb = diff(db, pb, C);
    /* row 0 sits at 100 with spread ~1: finite differences in f32 there are noisy, so check
     * rows 1.. by finite differences and row 0 through the NULL-slot consistency below */
    fd_check("layernorm dinp", ln_loss, &c, c.inp + C, gi + C, (N - 1) * C, 1, 1e-2f, 1e-2, 2e-3);
    fd_check("layernorm dweight", ln_loss, &c, c.weight, gw, C, 1, 1e-2f, 1e-2, 2e-3);
    fd_check("layernorm dbias", ln_loss, &c, c.bias, gb, C, 1, 1e-2f, 1e-2, 2e-3);
    /* NULL dweight / dbias: dinp unchanged; dinp NULL: parameter grads unchanged */
    float *di2 = fzeros(N * C), *dw2 = fzeros(C), *db2 = fzeros(C);
    fsdp_cpu_layernorm_backward(di2, NULL, NULL, c.w, c.inp, c.weight, c.mean, c.rstd, N, C);
    fsdp_cpu_layernorm_backward(NULL, dw2, db2, c.w, c.inp, c.weight, c.mean, c.rstd, N, C);
    check_close_f("layernorm dinp alone", di2, gi, N * C, 1e-5, 1e-5);
    check_close_f("layernorm dweight alone", dw2, gw, C, 1e-5, 1e-5);
    check_close_f("layernorm dbias alone", db2, gb, C, 1e-5, 1e-5);
    /* without weight (= 1) */
    float *saved_w = c.weight;
    c.weight = NULL;
    ln_loss(&c);
    float *di3 = fzeros(N * C);
    fsdp_cpu_layernorm_backward(di3, NULL, NULL, c.w, c.inp, NULL, c.mean, c.rstd, N, C);
    fd_check("layernorm dinp (no weight)", ln_loss, &c, c.inp + C, di3 + C, (N - 1) * C, 1, 1e-2f,
             1e-2, 2e-3);
    c.weight = saved_w;
    free(di3), free(di2), free(dw2), free(db2), free(gi), free(gw), free(gb);
    free(pi), free(pw), free(pb), free(di), free(dw), free(db);
    free(c.out), free(c.mean), free(c.rstd), free(c.inp), free(c.weight), free(c.bias), free(c.w);
  }
}

/* ---- softmax --------------------------------------------------------------------------------- */

typedef struct {
  float *out, *inp, *w;
  int64_t N;
  int C;
} sm_ctx;

static double sm_loss(void *p) {
  sm_ctx *c = p;
  fsdp_cpu_softmax_forward(c->out, c->inp, c->N, c->C);
  return dot_fd(c->out, c->w, c->N * c->C);
}

static void test_softmax(void **state) {
  (void)state;
  const int64_t N = 5;
  const int C = 13;
  sm_ctx c = {fzeros(N * C), frand(N * C, -3, 3), frand(N * C, -1, 1), N, C};
  for (int j = 0; j < C; j++) c.inp[C + j] += 500.0f; /* row 1: would overflow without the max */
  c.inp[2 * C + 3] = -INFINITY;                        /* a masked entry: probability 0 */
  fsdp_cpu_softmax_forward(c.out, c.inp, N, C);
  double *want = dzeros(N * C);
  for (int64_t n = 0; n < N; n++) {
    double mx = -INFINITY, s = 0;
    for (int j = 0; j < C; j++) mx = fmax(mx, c.inp[n * C + j]);
    for (int j = 0; j < C; j++) s += exp(c.inp[n * C + j] - mx);
    for (int j = 0; j < C; j++) want[n * C + j] = exp(c.inp[n * C + j] - mx) / s;
  }
  check_close_d("softmax", c.out, want, N * C, 1e-5, 1e-7);
  assert_true(c.out[2 * C + 3] == 0.0f);
  c.inp[2 * C + 3] = 0.5f; /* finite differences need finite inputs */
  sm_loss(&c);
  float *prior = frand(N * C, -1, 1), *d = fcopy(prior, N * C);
  fsdp_cpu_softmax_backward(d, c.w, c.out, N, C);
  float *g = diff(d, prior, N * C);
  fd_check("softmax backward", sm_loss, &c, c.inp, g, N * C, 1, 1e-2f, 1e-2, 1e-3);
  free(prior), free(d), free(g), free(want), free(c.out), free(c.inp), free(c.w);
}

/* ---- attention ------------------------------------------------------------------------------- */

typedef struct {
  float *out, *scratch, *qkv, *w;
  int B, T, C, NH;
} att_ctx;

static double att_loss(void *p) {
  att_ctx *c = p;
  fsdp_cpu_attention_forward(c->out, NULL, c->scratch, c->qkv, c->B, c->T, c->C, c->NH);
  return dot_fd(c->out, c->w, (int64_t)c->B * c->T * c->C);
}

static void ref_attention(double *out, const float *qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  const double scale = 1.0 / sqrt(hs);
  double *a = dzeros(T);
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      for (int t = 0; t < T; t++) {
        const float *q = qkv + ((int64_t)b * T + t) * 3 * C + h * hs;
        double mx = -INFINITY;
        for (int s = 0; s <= t; s++) {
          const float *k = qkv + ((int64_t)b * T + s) * 3 * C + C + h * hs;
          double d = 0;
          for (int i = 0; i < hs; i++) d += (double)q[i] * k[i];
          a[s] = d * scale;
          mx = fmax(mx, a[s]);
        }
        double sum = 0;
        for (int s = 0; s <= t; s++) sum += (a[s] = exp(a[s] - mx));
        for (int s = 0; s <= t; s++) a[s] /= sum;
        double *o = out + ((int64_t)b * T + t) * C + h * hs;
        for (int i = 0; i < hs; i++) {
          double acc = 0;
          for (int s = 0; s <= t; s++) {
            acc += a[s] * qkv[((int64_t)b * T + s) * 3 * C + 2 * C + h * hs + i];
          }
          o[i] = acc;
        }
      }
    }
  }
  free(a);
}

/* scratch for both directions at the calling thread's count, 64-byte aligned as the engine's
 * storages are, filled with garbage (no contents may be read) */
static float *att_scratch(int B, int T, int C, int NH) {
  const int th = fsdp_cpu_threads();
  int64_t n = fsdp_cpu_attention_scratch(B, T, C, NH, th, false),
          bw = fsdp_cpu_attention_scratch(B, T, C, NH, th, true);
  if (bw > n) n = bw;
  float *p = aligned_alloc(64, (size_t)(n + 15) / 16 * 64);
  assert_non_null(p);
  for (int64_t i = 0; i < n; i++) p[i] = (float)(-9 + 18 * urand());
  return p;
}

static void run_attention_case(int B, int T, int C, int NH, int64_t fd_step) {
  const int64_t nqkv = (int64_t)B * T * 3 * C, nout = (int64_t)B * T * C;
  att_ctx c = {frand(nout, 5, 6) /* garbage: must be overwritten */, att_scratch(B, T, C, NH),
               frand(nqkv, -1.5, 1.5), frand(nout, -1, 1), B, T, C, NH};
  const int64_t nst = (int64_t)B * NH * T * 2;
  float *st = frand(nst, 5, 6); /* garbage: every row's pair is written */
  fsdp_cpu_attention_forward(c.out, st, c.scratch, c.qkv, B, T, C, NH);
  double *want = dzeros(nout);
  ref_attention(want, c.qkv, B, T, C, NH);
  check_close_d("attention out", c.out, want, nout, 1e-4, 1e-5);
  /* the stats: row t of pair (b, h) holds its scores' max and 1 / sum exp(score - max) */
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++)
      for (int t = 0; t < T; t++) {
        const int hs = C / NH;
        const float *q = c.qkv + ((int64_t)b * T + t) * 3 * C + h * hs;
        double sc[512], mx = -INFINITY, sum = 0;
        assert_true(T <= 512);
        for (int u = 0; u <= t; u++) {
          const float *k = c.qkv + ((int64_t)b * T + u) * 3 * C + C + h * hs;
          double dd = 0;
          for (int i = 0; i < hs; i++) dd += (double)q[i] * k[i];
          mx = fmax(mx, sc[u] = dd / sqrt(hs));
        }
        for (int u = 0; u <= t; u++) sum += exp(sc[u] - mx);
        const float *r = st + 2 * (((int64_t)b * NH + h) * T + t);
        assert_true(fabs(r[0] - mx) <= 1e-4 * (1 + fabs(mx)));
        assert_true(fabs(r[1] - 1 / sum) <= 1e-4 / sum);
      }
  float *prior = frand(nqkv, -1, 1), *d = fcopy(prior, nqkv);
  fsdp_cpu_attention_backward(d, c.scratch, c.w, c.qkv, st, B, T, C, NH, false);
  float *g = diff(d, prior, nqkv);
  char what[64];
  snprintf(what, sizeof what, "attention dqkv B=%d T=%d C=%d NH=%d", B, T, C, NH);
  fd_check(what, att_loss, &c, c.qkv, g, nqkv, fd_step, 1e-2f, 1e-2, 1e-3);
  /* set: dqkv written whole whatever it held (NaN here): the bits of adding into zeros, in the
   * split by pairs and in the split by tiles (one pair: fewer than four a thread); and the
   * probabilities rebuilt from the stats are the recomputed ones, bit for bit */
  float *z = fzeros(nqkv), *s = fzeros(nqkv);
  fsdp_cpu_attention_backward(z, c.scratch, c.w, c.qkv, NULL, B, T, C, NH, false);
  for (int64_t i = 0; i < nqkv; i++) s[i] = NAN;
  fsdp_cpu_attention_backward(s, c.scratch, c.w, c.qkv, st, B, T, C, NH, true);
  assert_memory_equal(s, z, sizeof(float) * (size_t)nqkv);
  /* one thread (every pair on it, the scratch of one task) gives the forward's bits and stats,
   * written to the same buffers (tests/c/test_pool.c compares thread counts both ways) */
  fsdp_cpu_attention_forward(c.out, st, c.scratch, c.qkv, B, T, C, NH); /* fd_check left others */
  float *o1 = fcopy(c.out, nout), *st1 = fcopy(st, nst);
  const int before = fsdp_cpu_threads();
  fsdp_cpu_set_threads(1);
  float *sc1 = att_scratch(B, T, C, NH);
  fsdp_cpu_attention_forward(c.out, st, sc1, c.qkv, B, T, C, NH);
  fsdp_cpu_set_threads(before);
  assert_memory_equal(o1, c.out, sizeof(float) * (size_t)nout);
  assert_memory_equal(st1, st, sizeof(float) * (size_t)nst);
  free(o1), free(sc1), free(st1), free(st);
  free(z), free(s);
  free(prior), free(d), free(g), free(want);
  free(c.out), free(c.scratch), free(c.qkv), free(c.w);
}

static void test_attention(void **state) {
  (void)state;
  run_attention_case(2, 7, 12, 3, 1);  /* odd T, hs = 4 */
  run_attention_case(1, 1, 6, 2, 1);   /* a single token attends to itself */
  run_attention_case(1, 70, 16, 2, 7); /* more than one 64-row causal block */
  run_attention_case(8, 40, 16, 2, 11); /* enough pairs to split by pairs at two threads */
  /* head sizes past one vector with a partial one after (20 = 16 + 4; 72 = 64 + 8: two column
   * blocks at AVX-512), T past two tiles and not a multiple of the vector width */
  run_attention_case(1, 130, 40, 2, 41);
  run_attention_case(1, 67, 144, 2, 53);
}

/* ---- cross-entropy --------------------------------------------------------------------------- */

typedef struct {
  float *lse, *logits;
  const int64_t *targets;
  float dloss;
  int64_t N, count;
  int V, ignore;
} ce_ctx;

static double ce_loss(void *p) {
  ce_ctx *c = p;
  return c->dloss * (double)fsdp_cpu_cross_entropy_forward(c->lse, c->logits, c->targets, c->N,
                                                           c->V, c->ignore, &c->count);
}

static void test_cross_entropy(void **state) {
  (void)state;
  const int64_t N = 6;
  const int V = 11, ignore = -100;
  int64_t targets[6] = {3, -100, 0, 10, 7, -100};
  ce_ctx c = {fzeros(N), frand(N * V, -4, 4), targets, 0.7f, N, 0, V, ignore};
  for (int j = 0; j < V; j++) c.logits[2 * V + j] += 1000.0f; /* overflow without the max */
  float loss = fsdp_cpu_cross_entropy_forward(c.lse, c.logits, targets, N, V, ignore, &c.count);
  assert_int_equal(c.count, 4);
  double total = 0;
  for (int64_t i = 0; i < N; i++) {
    if ((int)targets[i] == ignore) continue;
    double mx = -INFINITY, s = 0;
    for (int j = 0; j < V; j++) mx = fmax(mx, c.logits[i * V + j]);
    for (int j = 0; j < V; j++) s += exp(c.logits[i * V + j] - mx);
    double lse = mx + log(s);
    check_close_d("ce lse", c.lse + i, &lse, 1, 1e-6, 1e-6);
    total += lse - c.logits[i * V + (int)targets[i]];
  }
  double want = total / 4;
  check_close_d("ce loss", &loss, &want, 1, 1e-5, 1e-6);
  float *prior = frand(N * V, -1, 1), *d = fcopy(prior, N * V);
  fsdp_cpu_cross_entropy_backward(d, c.dloss, c.logits, c.lse, targets, N, V, ignore, c.count);
  float *g = diff(d, prior, N * V);
  for (int j = 0; j < V; j++) { /* ignored rows receive nothing */
    assert_true(d[1 * V + j] == prior[1 * V + j] && d[5 * V + j] == prior[5 * V + j]);
  }
  /* rows other than the +1000 one by finite differences (f32 logits near 1000 have 6e-5
   * spacing, too coarse for them); that row against the closed form softmax - onehot */
  fd_check("ce dlogits", ce_loss, &c, c.logits, g, 2 * V, 1, 1e-2f, 1e-2, 1e-3);
  fd_check("ce dlogits", ce_loss, &c, c.logits + 3 * V, g + 3 * V, 3 * V, 1, 1e-2f, 1e-2, 1e-3);
  {
    double mx = -INFINITY, s = 0, want_row[11];
    const float *x = c.logits + 2 * V;
    for (int j = 0; j < V; j++) mx = fmax(mx, x[j]);
    for (int j = 0; j < V; j++) s += exp(x[j] - mx);
    for (int j = 0; j < V; j++) want_row[j] = c.dloss / 4.0 * (exp(x[j] - mx) / s - (j == 0));
    check_close_d("ce dlogits row 2", g + 2 * V, want_row, V, 1e-4, 1e-6);
  }
  /* every row ignored: loss 0, count 0, backward adds nothing */
  int64_t all_ignored[6] = {-100, -100, -100, -100, -100, -100};
  int64_t cnt = 99;
  float l0 = fsdp_cpu_cross_entropy_forward(c.lse, c.logits, all_ignored, N, V, ignore, &cnt);
  assert_true(l0 == 0.0f);
  assert_int_equal(cnt, 0);
  float *d0 = fcopy(prior, N * V);
  fsdp_cpu_cross_entropy_backward(d0, 1.0f, c.logits, c.lse, all_ignored, N, V, ignore, 0);
  check_close_f("ce all ignored", d0, prior, N * V, 0, 0);
  free(d0), free(prior), free(d), free(g), free(c.lse), free(c.logits);
}

/* a vocabulary past one SIMD block and with a tail, against the reference */
static void test_cross_entropy_wide(void **state) {
  (void)state;
  const int64_t N = 3;
  const int V = 1031;
  float *logits = frand(N * V, -8, 8), *lse = fzeros(N);
  int64_t targets[3] = {0, 1030, 517};
  int64_t count;
  float loss = fsdp_cpu_cross_entropy_forward(lse, logits, targets, N, V, -1, &count);
  double total = 0;
  double *want_g = dzeros(N * V);
  for (int64_t i = 0; i < N; i++) {
    double mx = -INFINITY, s = 0;
    for (int j = 0; j < V; j++) mx = fmax(mx, logits[i * V + j]);
    for (int j = 0; j < V; j++) s += exp(logits[i * V + j] - mx);
    total += mx + log(s) - logits[i * V + (int)targets[i]];
    for (int j = 0; j < V; j++) {
      want_g[i * V + j] = (exp(logits[i * V + j] - mx) / s - (j == (int)targets[i])) / 3.0;
    }
  }
  double want = total / 3;
  check_close_d("ce wide loss", &loss, &want, 1, 1e-5, 1e-6);
  float *d = fzeros(N * V);
  fsdp_cpu_cross_entropy_backward(d, 1.0f, logits, lse, targets, N, V, -1, count);
  check_close_d("ce wide dlogits", d, want_g, N * V, 1e-4, 1e-8);
  free(logits), free(lse), free(want_g), free(d);
}

/* ---- mse ------------------------------------------------------------------------------------- */

typedef struct {
  float *a, *b, dloss;
  int64_t n;
} mse_ctx;

static double mse_loss(void *p) {
  mse_ctx *c = p;
  return c->dloss * (double)fsdp_cpu_mse_forward(c->a, c->b, c->n);
}

static void test_mse(void **state) {
  (void)state;
  const int64_t n = 301;
  mse_ctx c = {frand(n, -2, 2), frand(n, -2, 2), 1.3f, n};
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += ((double)c.a[i] - c.b[i]) * ((double)c.a[i] - c.b[i]);
  double want = s / n;
  float got = fsdp_cpu_mse_forward(c.a, c.b, n);
  check_close_d("mse", &got, &want, 1, 1e-6, 0);
  float *pa = frand(n, -1, 1), *pb = frand(n, -1, 1), *da = fcopy(pa, n), *db = fcopy(pb, n);
  fsdp_cpu_mse_backward(da, db, c.dloss, c.a, c.b, n);
  float *ga = diff(da, pa, n), *gb = diff(db, pb, n);
  fd_check("mse da", mse_loss, &c, c.a, ga, n, 1, 1e-2f, 1e-2, 1e-4);
  fd_check("mse db", mse_loss, &c, c.b, gb, n, 1, 1e-2f, 1e-2, 1e-4);
  float *da1 = fzeros(n), *db1 = fzeros(n);
  fsdp_cpu_mse_backward(da1, NULL, c.dloss, c.a, c.b, n);
  fsdp_cpu_mse_backward(NULL, db1, c.dloss, c.a, c.b, n);
  fsdp_cpu_mse_backward(NULL, NULL, c.dloss, c.a, c.b, n);
  check_close_f("mse da alone", da1, ga, n, 1e-6, 1e-7);
  check_close_f("mse db alone", db1, gb, n, 1e-6, 1e-7);
  /* mse(x, x) with one gradient buffer: the two contributions cancel exactly */
  float *g2 = fcopy(pa, n);
  fsdp_cpu_mse_backward(g2, g2, 1.0f, c.a, c.a, n);
  check_close_f("mse aliased", g2, pa, n, 0, 0);
  free(g2), free(da1), free(db1), free(pa), free(pb), free(da), free(db), free(ga), free(gb);
  free(c.a), free(c.b);
}

/* ---- reductions ------------------------------------------------------------------------------ */

static void test_sum(void **state) {
  (void)state;
  const int64_t n = 1003;
  float *a = frand(n, -1, 1);
  double want = 0, want_sq = 0;
  for (int64_t i = 0; i < n; i++) want += a[i], want_sq += (double)a[i] * a[i];
  assert_true(fabs(fsdp_cpu_sum(a, n) - want) < 1e-9);
  assert_true(fabs(fsdp_cpu_sumsq(a, n) - want_sq) < 1e-9);
  assert_true(fsdp_cpu_sum(a, 0) == 0.0 && fsdp_cpu_sumsq(a, 0) == 0.0);
  free(a);
  /* accuracy: a float accumulator would be off by ~1e-3 relative here; double summation of 4M
   * equal terms may still drift by ~n * 1e-16 */
  const int64_t big = 1 << 22;
  float *ones = malloc(sizeof(float) * big);
  for (int64_t i = 0; i < big; i++) ones[i] = 0.1f;
  double exact = (double)big * (double)0.1f;
  assert_true(fabs(fsdp_cpu_sum(ones, big) - exact) / exact < 1e-9);
  assert_true(fabs(fsdp_cpu_sumsq(ones, big) - exact * 0.1f) / (exact * 0.1f) < 1e-9);
  free(ones);
}

typedef struct {
  float *out, *inp, *w;
  int64_t outer, R, inner;
} sd_ctx;

static double sd_loss(void *p) {
  sd_ctx *c = p;
  fsdp_cpu_sum_dim_forward(c->out, c->inp, c->outer, c->R, c->inner);
  return dot_fd(c->out, c->w, c->outer * c->inner);
}

static void test_sum_dim(void **state) {
  (void)state;
  const int64_t shapes[][3] = {{3, 5, 7}, {4, 9, 1}, {1, 6, 300}, {2, 1, 5}};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
    const int64_t outer = shapes[si][0], R = shapes[si][1], inner = shapes[si][2];
    const int64_t n = outer * R * inner, no = outer * inner;
    sd_ctx c = {frand(no, 7, 8), frand(n, -1, 1), frand(no, -1, 1), outer, R, inner};
    fsdp_cpu_sum_dim_forward(c.out, c.inp, outer, R, inner);
    double *want = dzeros(no);
    for (int64_t o = 0; o < outer; o++) {
      for (int64_t r = 0; r < R; r++) {
        for (int64_t i = 0; i < inner; i++) want[o * inner + i] += c.inp[(o * R + r) * inner + i];
      }
    }
    check_close_d("sum_dim", c.out, want, no, 1e-6, 1e-6);
    float *prior = frand(n, -1, 1), *d = fcopy(prior, n);
    fsdp_cpu_sum_dim_backward(d, c.w, outer, R, inner);
    float *g = diff(d, prior, n);
    fd_check("sum_dim backward", sd_loss, &c, c.inp, g, n, 1, 1e-2f, 1e-3, 1e-4);
    free(prior), free(d), free(g), free(want), free(c.out), free(c.inp), free(c.w);
  }
  /* accuracy over a long reduced axis, both the inner == 1 and the column paths */
  const int64_t R = 1 << 20;
  float *x = malloc(sizeof(float) * R * 2), out[2];
  for (int64_t i = 0; i < R * 2; i++) x[i] = 0.1f;
  double exact = (double)R * (double)0.1f;
  fsdp_cpu_sum_dim_forward(out, x, 1, R, 2);
  assert_true(fabs(out[0] - exact) / exact < 1e-7 && fabs(out[1] - exact) / exact < 1e-7);
  fsdp_cpu_sum_dim_forward(out, x, 2, R, 1);
  assert_true(fabs(out[0] - exact) / exact < 1e-7 && fabs(out[1] - exact) / exact < 1e-7);
  free(x);
}

static void test_colsum(void **state) {
  (void)state;
  const int64_t R = 9, C = 300; /* C past one 256-column chunk */
  float *inp = frand(R * C, -1, 1), *prior = frand(C, -1, 1), *out = fcopy(prior, C);
  fsdp_cpu_colsum_acc(out, inp, R, C);
  double *want = dzeros(C);
  for (int64_t r = 0; r < R; r++) {
    for (int64_t j = 0; j < C; j++) want[j] += inp[r * C + j];
  }
  check_added("colsum", out, prior, want, C, 1e-5, 1e-6);
  free(inp), free(prior), free(out), free(want);
}

/* The table's f32 axpy and scale split over the rank's threads: every element, once, the same
 * bits as the plain loop, at 1 and 2 threads and lengths around the split. */
static void test_axpy_scale(void **state) {
  (void)state;
  const fsdp_kernels_i *k = fsdp_kernels_of(&fsdp_device_cpu, "test");
  assert_non_null(k);
  const int64_t lens[] = {1, 1000, 2 * FSDP_CPU_GRAIN - 1, 2 * FSDP_CPU_GRAIN + 1,
                          5 * FSDP_CPU_GRAIN + 17};
  int before = fsdp_cpu_threads();
  for (int threads = 1; threads <= 2; threads++) {
    fsdp_cpu_set_threads(threads);
    for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++) {
      const int64_t n = lens[l];
      float *x = frand(n, -1, 1), *y = frand(n, -1, 1), *want = fcopy(y, n);
      for (int64_t i = 0; i < n; i++) want[i] += 0.75f * x[i];
      assert_int_equal(k->axpy(NULL, FSDP_DTYPE_F32, y, x, 0.75, n), FSDP_OK);
      assert_memory_equal(y, want, (size_t)n * sizeof(float));
      for (int64_t i = 0; i < n; i++) want[i] += x[i];
      assert_int_equal(k->axpy(NULL, FSDP_DTYPE_F32, y, x, 1.0, n), FSDP_OK);
      assert_memory_equal(y, want, (size_t)n * sizeof(float));
      for (int64_t i = 0; i < n; i++) want[i] *= -1.5f;
      assert_int_equal(k->scale(NULL, FSDP_DTYPE_F32, y, -1.5, n), FSDP_OK);
      assert_memory_equal(y, want, (size_t)n * sizeof(float));
      free(x), free(y), free(want);
    }
  }
  fsdp_cpu_set_threads(before);
}

/* ---- optimizers ------------------------------------------------------------------------------ */

/* One parameter, two steps, numbers worked out by hand (lr 0.1, momentum 0.9, wd 0.01):
 *   step 1: g = 0.5 + 0.01 * 1 = 0.51;          buf = 0.51 (first step: buf = g)
 *           p = 1 - 0.1 * 0.51 = 0.949
 *   step 2: g = -0.25 + 0.01 * 0.949 = -0.24051; buf = 0.9 * 0.51 - 0.24051 = 0.21849
 *           p = 0.949 - 0.1 * 0.21849 = 0.927151 */
static void test_sgd(void **state) {
  (void)state;
  float p = 1.0f, buf = 12345.0f /* garbage: the first step must overwrite it */, g;
  g = 0.5f;
  fsdp_cpu_sgd_step(&p, &buf, &g, 1, 0.1f, 0.9f, 0.01f, true);
  assert_true(fabsf(buf - 0.51f) < 1e-6f && fabsf(p - 0.949f) < 1e-6f);
  g = -0.25f;
  fsdp_cpu_sgd_step(&p, &buf, &g, 1, 0.1f, 0.9f, 0.01f, false);
  assert_true(fabsf(buf - 0.21849f) < 1e-6f);
  assert_true(fabsf(p - 0.927151f) < 1e-6f);
  /* no momentum, NULL buffer: p -= lr * (g + wd p) = 1 - 0.1 * (0.5 + 0.01) */
  p = 1.0f, g = 0.5f;
  fsdp_cpu_sgd_step(&p, NULL, &g, 1, 0.1f, 0.0f, 0.01f, true);
  assert_true(fabsf(p - 0.949f) < 1e-6f);
  /* a vector (tail lanes included) against the same recurrence in double */
  const int64_t n = 11;
  float *pv = frand(n, -1, 1), *bv = fzeros(n), *g1 = frand(n, -1, 1), *g2 = frand(n, -1, 1);
  double *wp = dzeros(n), *wb = dzeros(n);
  for (int64_t i = 0; i < n; i++) {
    wp[i] = pv[i];
    double gg = g1[i] + 0.01 * wp[i];
    wb[i] = gg, wp[i] -= 0.1 * wb[i];
    gg = g2[i] + 0.01 * wp[i];
    wb[i] = 0.9 * wb[i] + gg, wp[i] -= 0.1 * wb[i];
  }
  fsdp_cpu_sgd_step(pv, bv, g1, n, 0.1f, 0.9f, 0.01f, true);
  fsdp_cpu_sgd_step(pv, bv, g2, n, 0.1f, 0.9f, 0.01f, false);
  check_close_d("sgd p", pv, wp, n, 1e-5, 1e-6);
  check_close_d("sgd buf", bv, wb, n, 1e-5, 1e-6);
  free(pv), free(bv), free(g1), free(g2), free(wp), free(wb);
}

/* lr 0.1, betas (0.9, 0.999), eps 1e-8, wd 0.01, p0 = 1, g1 = 0.5, g2 = -0.25:
 *   step 1: p = 1 * (1 - 0.001) = 0.999;  m = 0.05;  v = 0.00025
 *           m^ = 0.05 / 0.1 = 0.5;  v^ = 0.00025 / 0.001 = 0.25;  sqrt = 0.5
 *           p = 0.999 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.89900000200
 *   step 2: p = 0.899000002 * 0.999 = 0.898101001998;  m = 0.045 - 0.025 = 0.02
 *           v = 0.999 * 0.00025 + 0.001 * 0.0625 = 0.00031225
 *           m^ = 0.02 / 0.19 = 0.105263157895;  v^ = 0.00031225 / 0.001999 = 0.156203101551
 *           sqrt(v^) = 0.395225380702;  step = 0.1 * 0.105263157895 / (0.395225380702 + 1e-8)
 *                                            = 0.026633703292
 *           p = 0.898101001998 - 0.026633703292 = 0.871467298706 */
static void test_adamw(void **state) {
  (void)state;
  float p = 1.0f, m = 0.0f, v = 0.0f, g = 0.5f;
  fsdp_cpu_adamw_step(&p, &m, &v, &g, 1, 0.1f, 0.9f, 0.999f, 1e-8f, 0.01f, 1.0f, 1);
  /* betas arrive as floats: 1 - 0.999f is 0.000999987, so v is off 1.3e-5 relative */
  assert_true(fabsf(m - 0.05f) < 1e-7f && fabsf(v - 0.00025f) < 1e-8f);
  assert_true(fabsf(p - 0.899000002f) < 2e-7f);
  g = -0.25f;
  fsdp_cpu_adamw_step(&p, &m, &v, &g, 1, 0.1f, 0.9f, 0.999f, 1e-8f, 0.01f, 1.0f, 2);
  assert_true(fabsf(m - 0.02f) < 1e-7f && fabsf(v - 0.00031225f) < 1e-8f);
  assert_true(fabsf(p - 0.871467298706f) < 5e-7f);
  /* a vector over three steps against the same formulas in double */
  const int64_t n = 9;
  float *pv = frand(n, -1, 1), *mv = fzeros(n), *vv = fzeros(n);
  double *wp = dzeros(n), *wm = dzeros(n), *wv = dzeros(n);
  for (int64_t i = 0; i < n; i++) wp[i] = pv[i];
  for (int step = 1; step <= 3; step++) {
    float *gv = frand(n, -1, 1);
    for (int64_t i = 0; i < n; i++) {
      wp[i] *= 1.0 - 1e-3 * 0.1;
      wm[i] = 0.8 * wm[i] + 0.2 * gv[i];
      wv[i] = 0.99 * wv[i] + 0.01 * (double)gv[i] * gv[i];
      double mh = wm[i] / (1 - pow(0.8, step)), vh = wv[i] / (1 - pow(0.99, step));
      wp[i] -= 1e-3 * mh / (sqrt(vh) + 1e-6);
    }
    fsdp_cpu_adamw_step(pv, mv, vv, gv, n, 1e-3f, 0.8f, 0.99f, 1e-6f, 0.1f, 1.0f, step);
    free(gv);
  }
  check_close_d("adamw p", pv, wp, n, 1e-5, 1e-6);
  check_close_d("adamw m", mv, wm, n, 1e-5, 1e-7);
  check_close_d("adamw v", vv, wv, n, 1e-5, 1e-8);
  free(pv), free(mv), free(vv), free(wp), free(wm), free(wv);
}

/* bias + GELU fused: bitwise the add, the GELU, its backward and the bias's column sum */
static void test_bias_gelu(void **state) {
  (void)state;
  const int64_t N = 29;
  const int C = 301;
  const int64_t n = N * C;
  float *x = frand(n, -5, 5), *b = frand(C, -1, 1), *g = frand(n, -1, 1);
  float *y = fzeros(n), *h = fzeros(n), *y2 = fzeros(n);
  fsdp_cpu_bias_gelu_forward(y, x, b, N, C);
  fsdp_cpu_binary_forward(h, x, b, n, C, FSDP_BIN_ADD);
  fsdp_cpu_gelu_forward(y2, h, n);
  assert_memory_equal(y, y2, sizeof(float) * (size_t)n);
  float *dx = frand(n, -1, 1), *dh = fzeros(n), *db = frand(C, -1, 1);
  float *dx2 = fcopy(dx, n), *db2 = fcopy(db, C);
  fsdp_cpu_bias_gelu_backward(dx, db, g, x, b, N, C, false);
  fsdp_cpu_gelu_backward(dh, g, h, n);
  for (int64_t i = 0; i < n; i++) dx2[i] += dh[i];
  fsdp_cpu_colsum_acc(db2, dh, N, C);
  assert_memory_equal(dx, dx2, sizeof(float) * (size_t)n);
  assert_memory_equal(db, db2, sizeof(float) * (size_t)C);
  /* either output alone */
  float *db3 = fcopy(db2, C), *dx3 = fcopy(dx2, n);
  fsdp_cpu_bias_gelu_backward(NULL, db3, g, x, b, N, C, false);
  fsdp_cpu_colsum_acc(db2, dh, N, C);
  assert_memory_equal(db3, db2, sizeof(float) * (size_t)C);
  fsdp_cpu_bias_gelu_backward(dx3, NULL, g, x, b, N, C, false);
  for (int64_t i = 0; i < n; i++) dx2[i] += dh[i];
  assert_memory_equal(dx3, dx2, sizeof(float) * (size_t)n);
  /* set: dinp = t whatever it held (NaN here), with and without the bias gradient */
  float *dx4 = frand(n, -1, 1), *db4 = fcopy(db3, C);
  for (int64_t i = 0; i < n; i++) dx4[i] = NAN;
  fsdp_cpu_bias_gelu_backward(dx4, db4, g, x, b, N, C, true);
  assert_memory_equal(dx4, dh, sizeof(float) * (size_t)n);
  fsdp_cpu_colsum_acc(db3, dh, N, C);
  assert_memory_equal(db4, db3, sizeof(float) * (size_t)C);
  for (int64_t i = 0; i < n; i++) dx4[i] = NAN;
  fsdp_cpu_bias_gelu_backward(dx4, NULL, g, x, b, N, C, true);
  assert_memory_equal(dx4, dh, sizeof(float) * (size_t)n);
  free(x), free(b), free(g), free(y), free(h), free(y2), free(dx), free(dh), free(db);
  free(dx2), free(db2), free(db3), free(dx3), free(dx4), free(db4);
}

/* A step with a gradient scale (clipping's coefficient) is bitwise scaling a copy of the
 * gradient by it and stepping with that, masked or not, over a length with a partial vector,
 * infinite gradient elements included (a scale of 0, an infinite norm's, makes them NaN as the
 * scaling would); the gradient buffer is left unscaled (masked, with a mask). */
static void test_adamw_grad_scale(void **state) {
  (void)state;
  const int64_t n = 1037;
  float *g = frand(n, -1, 1), *mask = frand(n, 0, 1);
  for (int64_t i = 0; i < n; i++) mask[i] = mask[i] < 0.4f ? 0.0f : 1.0f;
  g[5] = INFINITY, g[700] = -INFINITY, mask[5] = mask[700] = 1.0f;
  for (int run = 0; run < 4; run++) {
    const int masked = run % 2;
    const float s = run < 2 ? 0.3173f : 0.0f;
    float *p = frand(n, -1, 1), *p2 = fcopy(p, n), *g1 = fcopy(g, n), *m = fzeros(n),
          *v = fzeros(n), *m2 = fzeros(n), *v2 = fzeros(n);
    for (int step = 1; step <= 3; step++) {
      float *gs = fcopy(g, n);
      if (masked) fsdp_cpu_mask_apply(gs, mask, n);
      for (int64_t i = 0; i < n; i++) gs[i] *= s; /* the cpu table's scale (clip_grad_norm) */
      if (masked) {
        fsdp_cpu_adamw_step_masked(p, m, v, g1, mask, n, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, s,
                                   step);
        fsdp_cpu_adamw_step_masked(p2, m2, v2, gs, mask, n, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f,
                                   1.0f, step);
      } else {
        fsdp_cpu_adamw_step(p, m, v, g1, n, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, s, step);
        fsdp_cpu_adamw_step(p2, m2, v2, gs, n, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1.0f, step);
      }
      free(gs);
    }
    assert_memory_equal(p, p2, sizeof(float) * (size_t)n);
    assert_memory_equal(m, m2, sizeof(float) * (size_t)n);
    assert_memory_equal(v, v2, sizeof(float) * (size_t)n);
    if (s == 0.0f) assert_true(isnan(p[5]) && isnan(p[700]) && !isnan(p[6]));
    for (int64_t i = 0; i < n; i++) /* read, not scaled */
      assert_true(g1[i] == (masked && mask[i] == 0.0f ? 0.0f : g[i]));
    free(p), free(p2), free(g1), free(m), free(v), free(m2), free(v2);
  }
  free(g), free(mask);
}

/* The fused masked step is bitwise mask_apply(g), the step, mask_apply(p), NaN gradients under
 * the mask included, and leaves g masked. */
static void test_adamw_masked(void **state) {
  (void)state;
  const int64_t n = 1037;
  float *p = frand(n, -1, 1), *g = frand(n, -1, 1), *mask = frand(n, 0, 1);
  for (int64_t i = 0; i < n; i++) mask[i] = mask[i] < 0.4f ? 0.0f : 1.0f;
  g[3] = NAN, mask[3] = 0.0f;
  g[n - 1] = -INFINITY, mask[n - 1] = 0.0f;
  float *p2 = fcopy(p, n), *g2 = fcopy(g, n), *m = fzeros(n), *v = fzeros(n), *m2 = fzeros(n),
        *v2 = fzeros(n);
  for (int step = 1; step <= 3; step++) {
    fsdp_cpu_adamw_step_masked(p, m, v, g, mask, n, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1.0f,
                               step);
    fsdp_cpu_mask_apply(g2, mask, n);
    fsdp_cpu_adamw_step(p2, m2, v2, g2, n, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1.0f, step);
    fsdp_cpu_mask_apply(p2, mask, n);
  }
  assert_memory_equal(p, p2, sizeof(float) * (size_t)n);
  assert_memory_equal(g, g2, sizeof(float) * (size_t)n);
  assert_memory_equal(m, m2, sizeof(float) * (size_t)n);
  assert_memory_equal(v, v2, sizeof(float) * (size_t)n);
  assert_true(p[3] == 0.0f && !signbit(p[3]) && g[3] == 0.0f && g[n - 1] == 0.0f);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; i++) kept += mask[i] != 0.0f && p[i] != 0.0f;
  assert_true(kept > n / 2); /* the unmasked weights moved on */
  free(p), free(g), free(mask), free(p2), free(g2), free(m), free(v), free(m2), free(v2);
}

/* FSDP_CPU_ISA forces the level these tests run at (ctest runs them at each); a level this
 * processor lacks is a skip, any other bad value a failure. */
static int isa_setup(void) {
  const char *want = getenv("FSDP_CPU_ISA");
  if (fsdp_cpu_isa_check() != FSDP_OK) {
    fsdp_cpu_isa_level l;
    if (fsdp_cpu_isa_parse(want, FSDP_CPU_ISA_AVX512, &l) == FSDP_OK) {
      printf("test_kernels: skipped: %s\n", fsdp_error_msg());
      return 77;
    }
    fprintf(stderr, "test_kernels: %s\n", fsdp_error_msg());
    return 1;
  }
  printf("test_kernels: kernels at %s%s\n", fsdp_cpu_isa_current(),
         want && *want ? " (FSDP_CPU_ISA)" : "");
  return 0;
}

int main(void) {
  int rc = isa_setup();
  if (rc != 0) return rc;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_vexp),
      cmocka_unit_test(test_gemm),
      cmocka_unit_test(test_blas_threads),
      cmocka_unit_test(test_linear),
      cmocka_unit_test(test_bmm),
      cmocka_unit_test(test_gemm_stats),
      cmocka_unit_test(test_binary),
      cmocka_unit_test(test_binary_aliased_grads),
      cmocka_unit_test(test_affine),
      cmocka_unit_test(test_relu),
      cmocka_unit_test(test_gelu),
      cmocka_unit_test(test_dropout),
      cmocka_unit_test(test_embedding),
      cmocka_unit_test(test_layernorm),
      cmocka_unit_test(test_softmax),
      cmocka_unit_test(test_attention),
      cmocka_unit_test(test_cross_entropy),
      cmocka_unit_test(test_cross_entropy_wide),
      cmocka_unit_test(test_mse),
      cmocka_unit_test(test_sum),
      cmocka_unit_test(test_sum_dim),
      cmocka_unit_test(test_colsum),
      cmocka_unit_test(test_axpy_scale),
      cmocka_unit_test(test_sgd),
      cmocka_unit_test(test_adamw),
      cmocka_unit_test(test_adamw_grad_scale),
      cmocka_unit_test(test_adamw_masked),
      cmocka_unit_test(test_bias_gelu),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
