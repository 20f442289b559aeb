/*
 * test_gemm_bf16.c — the GEMM libraries: the native bf16 GEMM path (src/kernels/cpu/gemm_bf16.c
 * over onednn.c) against the conversion pass, through the cpu table's slots (gemm, bmm, linear);
 * f32 through oneDNN against OpenBLAS; which of them the processor and the environment choose.
 *
 * Every product runs twice, with the native path forced off (the conversion pass: widen to f32,
 * OpenBLAS, round) and forced on, and both are held against a double-precision reference on the
 * same bf16 inputs: within f32 accumulation error (2 K 2^-24 sum |a b|) plus, for a bf16 output,
 * its rounding (2^-8 |ref|). Shapes with odd sizes, all four transposes, strided operands,
 * alpha 1 and 0.5, beta 0 (a NaN in c must not leak) and 1. The native path counts its products
 * (fsdp_cpu_bf16_gemm_count), so each case also checks which path the slot took: none forced
 * off, one per product forced on, none for a product below the size threshold.
 *
 * Where the path cannot run (a build without oneDNN, a processor without AVX512_BF16, valgrind,
 * whose CPUID shows no AVX-512) the native halves are skipped with a message and forcing it on
 * must leave it off; the conversion halves still run.
 *
 * Also: bitwise repeatability, two threads at once over more shapes than a thread's plan cache
 * holds (eviction) against serial results, and the error paths: a shape oneDNN refuses and the
 * scratch over the memory budget.
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
#include <strings.h>

#include <cblas.h>
#include <cmocka.h>

#include "core/core.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/pool.h"
#include "kernels/kernels.h"

static const fsdp_kernels_i *K(void) {
  const fsdp_kernels_i *k = fsdp_kernels_of(&fsdp_device_cpu, "test");
  assert_non_null(k);
  return k;
}
#define CTX NULL /* the cpu's context */
#define BF16 FSDP_DTYPE_BF16
#define F32 FSDP_DTYPE_F32

static bool native_here(void) { return fsdp_cpu_bf16_gemm_supported(); }

static uint64_t rng = 88172645463325252ull;
static float uniform(void) { /* [-1, 1) */
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (float)((double)(rng >> 11) * 0x1p-52 - 1.0);
}

static uint16_t *bf16_rand(int64_t n) {
  uint16_t *p = malloc(sizeof *p * (size_t)(n > 0 ? n : 1));
  assert_non_null(p);
  for (int64_t i = 0; i < n; i++) p[i] = fsdp_f32_to_bf16(i % 17 == 5 ? 0.0f : uniform());
  return p;
}

static float bf(uint16_t x) { return fsdp_bf16_to_f32(x); }

/* ---- checking against double ------------------------------------------------------------------ */

typedef struct {
  int M, N, K, lda, ldb, ldc;
  bool ta, tb;
  float alpha, beta;
} gshape;

/* op(a)(i, k) and op(b)(k, j) of stored bf16 matrices */
static double at(const uint16_t *a, bool t, int ld, int i, int k) {
  return bf(t ? a[(int64_t)k * ld + i] : a[(int64_t)i * ld + k]);
}

/* the largest error either path may make at (i, j), and the exact value */
static void expect(const gshape *s, const uint16_t *a, const uint16_t *b, double c0, int i, int j,
                   bool bf16_out, double *ref, double *tol) {
  double sum = 0, mag = 0;
  for (int k = 0; k < s->K; k++) {
    double p = at(a, s->ta, s->lda, i, k) * at(b, s->tb, s->ldb, k, j);
    sum += p, mag += fabs(p);
  }
  *ref = s->alpha * sum + s->beta * c0;
  *tol = 2.0 * (s->K + 2) * 0x1p-24 * (fabs(s->alpha) * mag + fabs(s->beta * c0)) +
         (bf16_out ? 0x1p-8 * fabs(*ref) : 0.0) + 1e-30;
}

/* c (bf16, M x ldc) against the reference from c0 (c before the call) */
static void check_bf16(const char *what, const gshape *s, const uint16_t *a, const uint16_t *b,
                       const uint16_t *c0, const uint16_t *c) {
  for (int i = 0; i < s->M; i++) {
    for (int j = 0; j < s->N; j++) {
      double ref, tol;
      expect(s, a, b, s->beta != 0.0f ? bf(c0[(int64_t)i * s->ldc + j]) : 0.0, i, j, true, &ref,
             &tol);
      double got = bf(c[(int64_t)i * s->ldc + j]);
      if (!(fabs(got - ref) <= tol)) {
        fail_msg("%s %dx%dx%d ta%d tb%d alpha %g beta %g: c[%d][%d] = %.9g, exact %.9g (tol %.3g)",
                 what, s->M, s->N, s->K, s->ta, s->tb, s->alpha, s->beta, i, j, got, ref, tol);
      }
    }
    /* the padding past N is not the product's */
    for (int j = s->N; j < s->ldc; j++)
      assert_int_equal(c[(int64_t)i * s->ldc + j], c0[(int64_t)i * s->ldc + j]);
  }
}

/* ---- the gemm slot ------------------------------------------------------------------------------- */

/* one slot call with the native path forced (1) or off (0); checks which path ran */
static void slot_gemm(int mode, const gshape *s, const uint16_t *a, const uint16_t *b, uint16_t *c,
                      bool big) {
  bool on = fsdp_cpu_bf16_gemm_force(mode);
  assert_int_equal(on, mode == 1 && native_here());
  int64_t before = fsdp_cpu_bf16_gemm_count();
  assert_int_equal(K()->gemm(CTX, BF16, c, a, b, s->M, s->N, s->K, s->ta, s->tb, s->alpha,
                             s->beta, s->lda, s->ldb, s->ldc),
                   FSDP_OK);
  assert_int_equal(fsdp_cpu_bf16_gemm_count() - before, on && big ? 1 : 0);
  fsdp_cpu_bf16_gemm_force(-1);
}

static void run_gemm_case(const gshape *s, bool big) {
  int64_t na = (int64_t)(s->ta ? s->K : s->M) * s->lda, nb = (int64_t)(s->tb ? s->N : s->K) * s->ldb,
          nc = (int64_t)s->M * s->ldc;
  uint16_t *a = bf16_rand(na), *b = bf16_rand(nb), *c0 = bf16_rand(nc);
  uint16_t *conv = malloc(2 * (size_t)nc), *nat = malloc(2 * (size_t)nc);
  assert_non_null(conv), assert_non_null(nat);
  if (s->beta == 0.0f) /* beta 0 ignores c, NaN included (the padding keeps its values) */
    for (int i = 0; i < s->M; i++)
      for (int j = 0; j < s->N; j++) c0[(int64_t)i * s->ldc + j] = 0x7fc0;
  memcpy(conv, c0, 2 * (size_t)nc), memcpy(nat, c0, 2 * (size_t)nc);
  slot_gemm(0, s, a, b, conv, big);
  check_bf16("conversion", s, a, b, c0, conv);
  slot_gemm(1, s, a, b, nat, big);
  check_bf16(native_here() ? "native" : "native (off here)", s, a, b, c0, nat);
  free(a), free(b), free(c0), free(conv), free(nat);
}

static void test_gemm_slot(void **state) {
  (void)state;
  if (!native_here())
    print_message("native bf16 path not available here (oneDNN or AVX512_BF16 missing, or "
                  "valgrind): conversion halves only\n");
  static const struct {
    int M, N, K, pad;
  } shapes[] = {{37, 29, 53, 0}, {37, 29, 53, 3}, {128, 96, 200, 0}, {65, 130, 7, 5},
                {1, 300, 129, 1}, {200, 3, 71, 2}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    for (int t = 0; t < 4; t++) {
      for (int ab = 0; ab < 4; ab++) {
        int M = shapes[i].M, N = shapes[i].N, Kd = shapes[i].K, p = shapes[i].pad;
        bool ta = t & 1, tb = t & 2;
        gshape s = {M, N, Kd, (ta ? M : Kd) + p, (tb ? Kd : N) + p, N + p, ta, tb,
                    ab & 1 ? 0.5f : 1.0f, ab & 2 ? 1.0f : 0.0f};
        run_gemm_case(&s, (int64_t)M * N * Kd >= 32 * 32 * 32);
      }
    }
  }
}

/* a product below the size threshold keeps the conversion pass even when forced on */
static void test_small_keeps_conversion(void **state) {
  (void)state;
  gshape s = {8, 8, 8, 8, 8, 8, false, false, 1.0f, 0.0f};
  run_gemm_case(&s, false);
}

/* f32 output (a mixed-precision weight gradient), straight through fsdp_cpu_bf16_gemm */
static void test_f32_output(void **state) {
  (void)state;
  if (!native_here()) {
    print_message("skipped: the native bf16 path is not available here\n");
    return;
  }
  gshape s = {45, 70, 333, 45, 70 + 2, 70 + 1, true, false, 1.0f, 1.0f};
  uint16_t *a = bf16_rand((int64_t)s.K * s.lda), *b = bf16_rand((int64_t)s.K * s.ldb);
  float *c = malloc(sizeof *c * (size_t)s.M * s.ldc), *c0 = malloc(sizeof *c0 * (size_t)s.M * s.ldc);
  for (int64_t i = 0; i < (int64_t)s.M * s.ldc; i++) c[i] = c0[i] = uniform();
  assert_true(fsdp_cpu_bf16_gemm_force(1));
  assert_int_equal(fsdp_cpu_bf16_gemm(c, F32, a, b, NULL, BF16, s.M, s.N, s.K, s.ta, s.tb, s.alpha,
                                      s.beta, s.lda, s.ldb, s.ldc),
                   FSDP_OK);
  fsdp_cpu_bf16_gemm_force(-1);
  for (int i = 0; i < s.M; i++) {
    for (int j = 0; j < s.N; j++) {
      double ref, tol;
      expect(&s, a, b, c0[(int64_t)i * s.ldc + j], i, j, false, &ref, &tol);
      assert_true(fabs(c[(int64_t)i * s.ldc + j] - ref) <= tol);
    }
    assert_true(c[(int64_t)i * s.ldc + s.N] == c0[(int64_t)i * s.ldc + s.N]);
  }
  free(a), free(b), free(c), free(c0);
}

/* ---- linear and bmm: native against the conversion pass ---------------------------------------- */

/* |x - y| <= 2^-7 (|x| + |y|) / 2 + floor, element by element: two bf16 results of one exact
 * value (each within about 2^-8 of it) */
static void close_bf16(const char *what, const uint16_t *x, const uint16_t *y, int64_t n,
                       double floor) {
  for (int64_t i = 0; i < n; i++) {
    double u = bf(x[i]), v = bf(y[i]);
    if (!(fabs(u - v) <= 0x1p-8 * (fabs(u) + fabs(v)) + floor))
      fail_msg("%s[%lld]: native %.9g, conversion %.9g", what, (long long)i, u, v);
  }
}

static void close_f32(const char *what, const float *x, const float *y, int64_t n, double floor) {
  for (int64_t i = 0; i < n; i++)
    if (!(fabs(x[i] - y[i]) <= 1e-5 * (fabs(x[i]) + fabs(y[i])) + floor))
      fail_msg("%s[%lld]: native %.9g, conversion %.9g", what, (long long)i, x[i], y[i]);
}

static void test_linear(void **state) {
  (void)state;
  enum { M = 70, IN = 45, OUT = 33 };
  uint16_t *x = bf16_rand(M * IN), *w = bf16_rand(OUT * IN), *bias = bf16_rand(OUT),
           *g = bf16_rand(M * OUT);
  for (int mode = 0; mode <= 1; mode++) {
    if (mode == 1 && !native_here()) break;
    /* results[mode]: forward out; dinp, dweight, dbias in bf16; dweight, dbias in f32 */
    static uint16_t out[2][M * OUT], dx[2][M * IN], dw[2][OUT * IN], db[2][OUT];
    static float dw32[2][OUT * IN], db32[2][OUT];
    for (int i = 0; i < M * IN; i++) dx[mode][i] = fsdp_f32_to_bf16(0.25f);
    for (int i = 0; i < OUT * IN; i++) dw[mode][i] = fsdp_f32_to_bf16(-0.5f), dw32[mode][i] = -0.5f;
    for (int i = 0; i < OUT; i++) db[mode][i] = fsdp_f32_to_bf16(1.0f), db32[mode][i] = 1.0f;
    fsdp_cpu_bf16_gemm_force(mode);
    int64_t before = fsdp_cpu_bf16_gemm_count();
    assert_int_equal(K()->linear_forward(CTX, BF16, out[mode], x, w, bias, M, IN, OUT), FSDP_OK);
    assert_int_equal(K()->linear_backward(CTX, BF16, BF16, dx[mode], dw[mode], db[mode], g, x, w,
                                          M, IN, OUT),
                     FSDP_OK);
    assert_int_equal(K()->linear_backward(CTX, BF16, F32, NULL, dw32[mode], db32[mode], g, x, w,
                                          M, IN, OUT),
                     FSDP_OK);
    /* forward 1, dinp and dweight 2, dweight in f32 1; the bias gradients are column sums */
    assert_int_equal(fsdp_cpu_bf16_gemm_count() - before, mode ? 4 : 0);
    fsdp_cpu_bf16_gemm_force(-1);
    if (mode == 1) {
      close_bf16("linear out", out[1], out[0], M * OUT, 1e-6);
      close_bf16("linear dinp", dx[1], dx[0], M * IN, 1e-6);
      close_bf16("linear dweight", dw[1], dw[0], OUT * IN, 1e-6);
      close_bf16("linear dbias", db[1], db[0], OUT, 1e-6);
      close_f32("linear dweight f32", dw32[1], dw32[0], OUT * IN, 1e-5);
      close_f32("linear dbias f32", db32[1], db32[0], OUT, 1e-5);
    } else {
      /* the conversion pass against double, once, so that native is held to something exact */
      for (int i = 0; i < M; i++)
        for (int o = 0; o < OUT; o++) {
          double ref = bf(bias[o]);
          for (int k = 0; k < IN; k++) ref += (double)bf(x[i * IN + k]) * bf(w[o * IN + k]);
          assert_true(fabs(bf(out[0][i * OUT + o]) - ref) <= 0x1p-8 * fabs(ref) + 1e-5);
        }
    }
  }
  if (!native_here()) print_message("native halves skipped: the path is not available here\n");
  free(x), free(w), free(bias), free(g);
}

static void test_bmm(void **state) {
  (void)state;
  enum { B = 3, M = 40, KK = 30, N = 50 };
  uint16_t *a = bf16_rand(B * M * KK), *b = bf16_rand(B * KK * N), *g = bf16_rand(B * M * N);
  static uint16_t out[2][B * M * N], da[2][B * M * KK], db[2][B * KK * N];
  for (int mode = 0; mode <= 1; mode++) {
    if (mode == 1 && !native_here()) break;
    for (int i = 0; i < B * M * KK; i++) da[mode][i] = fsdp_f32_to_bf16(0.5f);
    for (int i = 0; i < B * KK * N; i++) db[mode][i] = fsdp_f32_to_bf16(-0.25f);
    fsdp_cpu_bf16_gemm_force(mode);
    int64_t before = fsdp_cpu_bf16_gemm_count();
    assert_int_equal(K()->bmm_forward(CTX, BF16, out[mode], a, b, B, M, KK, N), FSDP_OK);
    assert_int_equal(K()->bmm_backward(CTX, BF16, da[mode], db[mode], g, a, b, B, M, KK, N), FSDP_OK);
    assert_int_equal(fsdp_cpu_bf16_gemm_count() - before, mode ? 3 * B : 0);
    fsdp_cpu_bf16_gemm_force(-1);
  }
  if (native_here()) {
    close_bf16("bmm out", out[1], out[0], B * M * N, 1e-6);
    close_bf16("bmm da", da[1], da[0], B * M * KK, 1e-6);
    close_bf16("bmm db", db[1], db[0], B * KK * N, 1e-6);
  } else {
    print_message("native half skipped: the path is not available here\n");
  }
  free(a), free(b), free(g);
}

/* ---- repeatability, threads ------------------------------------------------------------------------ */

#define TSHAPES 70 /* more than a thread's plan cache (64): the oldest plans are evicted */

typedef struct {
  uint16_t *a, *b;
  uint16_t *ref[TSHAPES], *out[TSHAPES];
  int wrong;
} tjob;

static void tshape(int i, int *M, int *N, int *Kd) { *M = 33 + i, *N = 40 + (i * 7) % 23, *Kd = 35; }

static int tgemm(uint16_t *c, const tjob *j, int i) {
  int M, N, Kd;
  tshape(i, &M, &N, &Kd);
  return fsdp_cpu_bf16_gemm(c, BF16, j->a, j->b, NULL, BF16, M, N, Kd, false, true, 1.0f, 0.0f,
                            Kd, Kd, N);
}

static void *tworker(void *p) {
  tjob *j = p;
  for (int rep = 0; rep < 2; rep++)
    for (int i = 0; i < TSHAPES; i++) {
      int M, N, Kd;
      tshape(i, &M, &N, &Kd);
      if (tgemm(j->out[i], j, i) != FSDP_OK || memcmp(j->out[i], j->ref[i], 2 * (size_t)M * N))
        j->wrong++;
    }
  return NULL;
}

static void test_threads_and_repeat(void **state) {
  (void)state;
  if (!native_here()) {
    print_message("skipped: the native bf16 path is not available here\n");
    return;
  }
  assert_true(fsdp_cpu_bf16_gemm_force(1));
  tjob jobs[2];
  for (int t = 0; t < 2; t++) {
    tjob *j = &jobs[t];
    j->a = bf16_rand(200 * 40), j->b = bf16_rand(200 * 40), j->wrong = 0;
    for (int i = 0; i < TSHAPES; i++) {
      int M, N, Kd;
      tshape(i, &M, &N, &Kd);
      j->ref[i] = malloc(2 * (size_t)M * N), j->out[i] = malloc(2 * (size_t)M * N);
      assert_int_equal(tgemm(j->ref[i], j, i), FSDP_OK);
      uint16_t *again = malloc(2 * (size_t)M * N);
      assert_int_equal(tgemm(again, j, i), FSDP_OK);
      assert_memory_equal(again, j->ref[i], 2 * (size_t)M * N); /* bitwise, call to call */
      free(again);
    }
  }
  pthread_t th[2];
  for (int t = 0; t < 2; t++) assert_int_equal(pthread_create(&th[t], NULL, tworker, &jobs[t]), 0);
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  for (int t = 0; t < 2; t++) {
    assert_int_equal(jobs[t].wrong, 0);
    free(jobs[t].a), free(jobs[t].b);
    for (int i = 0; i < TSHAPES; i++) free(jobs[t].ref[i]), free(jobs[t].out[i]);
  }
  fsdp_cpu_bf16_gemm_force(-1);
}

/* ---- f32: oneDNN against OpenBLAS ---------------------------------------------------------------- */

static float *f32_rand(int64_t n) {
  float *p = malloc(sizeof *p * (size_t)(n > 0 ? n : 1));
  assert_non_null(p);
  for (int64_t i = 0; i < n; i++) p[i] = uniform();
  return p;
}

/* one fsdp_cpu_gemm with the f32 library forced: 1 oneDNN, 0 OpenBLAS */
static void f32_gemm(int mode, const gshape *s, float *c, const float *a, const float *b) {
  assert_int_equal(fsdp_cpu_sgemm_force(mode), mode == 1 && fsdp_cpu_sgemm_supported());
  fsdp_cpu_gemm(c, a, b, s->M, s->N, s->K, s->ta, s->tb, s->alpha, s->beta, s->lda, s->ldb,
                s->ldc);
  fsdp_cpu_sgemm_force(-1);
}

/* Each library against double within f32 accumulation error, element by element; then the two
 * against each other over the whole product: ||oneDNN - OpenBLAS|| <= 1e-6 ||OpenBLAS|| (the
 * summation order is the library's, so bits differ; the size of the change is what is held). */
static void f32_case(const gshape *s, double *worst) {
  int64_t na = (int64_t)(s->ta ? s->K : s->M) * s->lda, nb = (int64_t)(s->tb ? s->N : s->K) * s->ldb,
          nc = (int64_t)s->M * s->ldc;
  float *a = f32_rand(na), *b = f32_rand(nb), *c0 = f32_rand(nc);
  float *c[2] = {malloc(sizeof(float) * (size_t)nc), malloc(sizeof(float) * (size_t)nc)};
  assert_non_null(c[0]), assert_non_null(c[1]);
  if (s->beta == 0.0f) /* beta 0 ignores c, NaN included */
    for (int i = 0; i < s->M; i++)
      for (int j = 0; j < s->N; j++) c0[(int64_t)i * s->ldc + j] = NAN;
  for (int m = 0; m < 2; m++) {
    memcpy(c[m], c0, sizeof(float) * (size_t)nc);
    f32_gemm(m, s, c[m], a, b);
  }
  double diff = 0, norm = 0;
  for (int i = 0; i < s->M; i++) {
    for (int j = 0; j < s->N; j++) {
      int64_t at_ij = (int64_t)i * s->ldc + j;
      double sum = 0, mag = 0;
      for (int k = 0; k < s->K; k++) {
        double p = (double)(s->ta ? a[(int64_t)k * s->lda + i] : a[(int64_t)i * s->lda + k]) *
                   (s->tb ? b[(int64_t)j * s->ldb + k] : b[(int64_t)k * s->ldb + j]);
        sum += p, mag += fabs(p);
      }
      double c0v = s->beta != 0.0f ? c0[at_ij] : 0.0;
      double ref = s->alpha * sum + s->beta * c0v;
      double tol = 2.0 * (s->K + 2) * 0x1p-24 * (fabs(s->alpha) * mag + fabs(s->beta * c0v)) + 1e-30;
      for (int m = 0; m < 2; m++)
        if (!(fabs(c[m][at_ij] - ref) <= tol))
          fail_msg("%s %dx%dx%d ta%d tb%d: c[%d][%d] = %.9g, exact %.9g", m ? "onednn" : "openblas",
                   s->M, s->N, s->K, s->ta, s->tb, i, j, c[m][at_ij], ref);
      diff += ((double)c[1][at_ij] - c[0][at_ij]) * ((double)c[1][at_ij] - c[0][at_ij]);
      norm += (double)c[0][at_ij] * c[0][at_ij];
    }
    for (int j = s->N; j < s->ldc; j++) /* the padding is not the product's */
      for (int m = 0; m < 2; m++) assert_true(c[m][(int64_t)i * s->ldc + j] == c0[(int64_t)i * s->ldc + j]);
  }
  double rel = sqrt(diff / (norm > 0 ? norm : 1));
  if (rel > *worst) *worst = rel;
  if (!(rel <= 1e-6))
    fail_msg("%dx%dx%d ta%d tb%d: oneDNN against OpenBLAS %.3g relative", s->M, s->N, s->K, s->ta,
             s->tb, rel);
  free(a), free(b), free(c0), free(c[0]), free(c[1]);
}

static void test_f32_libraries(void **state) {
  (void)state;
  if (!fsdp_cpu_sgemm_supported())
    print_message("oneDNN does not take f32 GEMMs here (not built in, no AVX-512, or valgrind): "
                  "both halves run OpenBLAS\n");
  static const struct {
    int M, N, K, pad;
  } shapes[] = {{37, 29, 53, 0}, {65, 130, 7, 5}, {1, 300, 129, 1}, {200, 3, 71, 2},
                {256, 192, 64, 0}, {128, 384, 256, 0}};
  double worst = 0;
  /* valgrind runs the double reference 50 times slower and shows no AVX-512 (OpenBLAS twice):
   * two shapes there, for the memory checks */
  size_t nshapes = getenv("FSDP_UNDER_VALGRIND") ? 2 : sizeof shapes / sizeof shapes[0];
  for (size_t i = 0; i < nshapes; i++)
    for (int t = 0; t < 4; t++)
      for (int ab = 0; ab < 4; ab++) {
        int M = shapes[i].M, N = shapes[i].N, Kd = shapes[i].K, p = shapes[i].pad;
        bool ta = t & 1, tb = t & 2;
        gshape s = {M, N, Kd, (ta ? M : Kd) + p, (tb ? Kd : N) + p, N + p, ta, tb,
                    ab & 1 ? 0.5f : 1.0f, ab & 2 ? 1.0f : 0.0f};
        f32_case(&s, &worst);
      }
  /* the model's shapes: a linear's forward (NT), dinp (NN), dweight (TN) at d = 384 */
  gshape big[] = {{512, 1536, 384, 384, 384, 1536, false, true, 1.0f, 1.0f},
                  {512, 384, 1536, 1536, 384, 384, false, false, 1.0f, 1.0f},
                  {1536, 384, 512, 1536, 384, 384, true, false, 1.0f, 1.0f}};
  for (size_t i = 0; i < sizeof big / sizeof big[0] && !getenv("FSDP_UNDER_VALGRIND"); i++)
    f32_case(&big[i], &worst);
  print_message("f32: oneDNN against OpenBLAS, worst %.3g relative (norm-wise)\n", worst);
}

/* oneDNN's f32 GEMM is bitwise repeatable call to call and on two threads at once */
typedef struct {
  const float *a, *b, *ref;
  int wrong;
} f32job;

static void *f32worker(void *p) {
  f32job *j = p;
  float *c = malloc(sizeof(float) * 300 * 200);
  for (int rep = 0; rep < 20 && c; rep++) {
    fsdp_cpu_sgemm_serial(c, j->a, j->b, 300, 200, 170, false, true, 1.0f, 0.0f, 170, 170, 200);
    if (memcmp(c, j->ref, sizeof(float) * 300 * 200)) j->wrong++;
  }
  free(c);
  return NULL;
}

static void test_f32_repeat(void **state) {
  (void)state;
  if (!fsdp_cpu_sgemm_supported()) {
    print_message("skipped: oneDNN does not take f32 GEMMs here\n");
    return;
  }
  assert_true(fsdp_cpu_sgemm_force(1));
  float *a = f32_rand(300 * 170), *b = f32_rand(200 * 170), *ref = malloc(sizeof(float) * 300 * 200);
  fsdp_cpu_sgemm_serial(ref, a, b, 300, 200, 170, false, true, 1.0f, 0.0f, 170, 170, 200);
  f32job j[2] = {{a, b, ref, 0}, {a, b, ref, 0}};
  pthread_t th[2];
  for (int t = 0; t < 2; t++) assert_int_equal(pthread_create(&th[t], NULL, f32worker, &j[t]), 0);
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  assert_int_equal(j[0].wrong + j[1].wrong, 0);
  fsdp_cpu_sgemm_force(-1);
  free(a), free(b), free(ref);
}

/* A memory domain of `limit` bytes, current on this thread, for the scratch-budget cases. */
static fsdp_mem_domain *budget_begin(int64_t limit) {
  fsdp_mem_domain *d = fsdp_mem_domain_new();
  assert_non_null(d);
  fsdp_mem_domain_set(d);
  fsdp_mem_set_limit(d, limit);
  return d;
}

/* Nothing of the case is left allocated in d; d is dropped. */
static void budget_end(fsdp_mem_domain *d) {
  fsdp_mem_report r;
  fsdp_mem_report_get(d, &r);
  for (int i = 0; i < r.ndevices; i++) assert_int_equal(r.counts[i].live_total, 0);
  fsdp_mem_domain_set(NULL);
  fsdp_mem_domain_free(d);
}

/* A linear forward with a bias (fsdp_cpu_linear_forward), f32: through oneDNN the bias goes into
 * the matmul's epilogue from 128 rows (fsdp_cpu_sgemm_bias counts it), below that and on OpenBLAS
 * the rows are seeded with it; every way within f32 accumulation error of the exact affine map,
 * bitwise repeatable at a fixed thread count, and over the memory budget (the matmul's scratch
 * refused) the seeding way answers. */
static void linear_check(const char *what, const float *y, const float *x, const float *w,
                         const float *bias, int M, int K, int N) {
  for (int i = 0; i < M; i++)
    for (int j = 0; j < N; j++) {
      double sum = bias[j], mag = fabs(bias[j]);
      for (int k = 0; k < K; k++) {
        double p = (double)x[(int64_t)i * K + k] * w[(int64_t)j * K + k];
        sum += p, mag += fabs(p);
      }
      double tol = 2.0 * (K + 2) * 0x1p-24 * mag + 1e-30;
      if (!(fabs(y[(int64_t)i * N + j] - sum) <= tol))
        fail_msg("%s %dx%dx%d: y[%d][%d] = %.9g, exact %.9g", what, M, K, N, i, j,
                 y[(int64_t)i * N + j], sum);
    }
}

static void test_f32_linear_bias(void **state) {
  (void)state;
  const bool on = fsdp_cpu_sgemm_supported();
  if (!on) print_message("oneDNN does not take f32 GEMMs here: the seeding way only\n");
  static const int shapes[][3] = {{300, 170, 200}, {512, 384, 1152}, {100, 64, 96}, {128, 7, 33}};
  size_t nshapes = getenv("FSDP_UNDER_VALGRIND") ? 1 : sizeof shapes / sizeof shapes[0];
  const int saved = fsdp_cpu_threads();
  for (size_t i = 0; i < nshapes; i++) {
    const int M = shapes[i][0], Kd = shapes[i][1], N = shapes[i][2];
    float *x = f32_rand((int64_t)M * Kd), *w = f32_rand((int64_t)N * Kd), *b = f32_rand(N);
    float *y = malloc(sizeof(float) * (size_t)M * N), *y2 = malloc(sizeof(float) * (size_t)M * N);
    assert_non_null(y), assert_non_null(y2);
    for (int mode = 0; mode <= 1; mode++) {
      fsdp_cpu_sgemm_force(mode);
      for (int threads = 1; threads <= 2; threads++) {
        fsdp_cpu_set_threads(threads);
        int64_t before = fsdp_cpu_sgemm_bias_count();
        fsdp_cpu_linear_forward(y, x, w, b, M, Kd, N);
        const bool fused = mode == 1 && on && M >= 128;
        assert_int_equal(fsdp_cpu_sgemm_bias_count() - before, fused ? 1 : 0);
        linear_check(fused ? "epilogue" : "seeded", y, x, w, b, M, Kd, N);
        fsdp_cpu_linear_forward(y2, x, w, b, M, Kd, N);
        assert_memory_equal(y, y2, sizeof(float) * (size_t)M * N);
      }
    }
    free(x), free(w), free(b), free(y), free(y2);
  }
  fsdp_cpu_set_threads(saved);
  fsdp_cpu_sgemm_force(-1);
  if (!on) return;
  /* the matmul's scratch over the budget: the seeding way answers, nothing is left allocated */
  enum { M = 256, Kd = 96, N = 160 };
  fsdp_cpu_mm_shape s = {F32, F32, F32, M, N, Kd, false, true, Kd, Kd, N, 1.0f, 0.0f, 0, 0, 0, 0};
  fsdp_cpu_mm *mm;
  size_t bytes = 0;
  assert_int_equal(fsdp_cpu_mm_plan(&mm, &bytes, &s), FSDP_OK);
  if (bytes == 0) {
    print_message("the f32 matmul needs no scratch here: its budget refusal is not reachable\n");
    return;
  }
  float *x = f32_rand((int64_t)M * Kd), *w = f32_rand((int64_t)N * Kd), *b = f32_rand(N),
        *y = malloc(sizeof(float) * M * N);
  fsdp_mem_domain *d = budget_begin(16);
  fsdp_cpu_sgemm_force(1);
  int64_t before = fsdp_cpu_sgemm_bias_count();
  assert_int_equal(fsdp_cpu_sgemm_bias(y, x, w, b, M, N, Kd, Kd, Kd, N), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  fsdp_cpu_linear_forward(y, x, w, b, M, Kd, N);
  assert_int_equal(fsdp_cpu_sgemm_bias_count(), before);
  linear_check("over the budget", y, x, w, b, M, Kd, N);
  fsdp_cpu_sgemm_force(-1);
  budget_end(d);
  free(x), free(w), free(b), free(y);
}

/* oneDNN's refusal is an error with its message; the engine's entry then lets OpenBLAS answer */
static void test_f32_refused(void **state) {
  (void)state;
  float a[4] = {1, 2, 3, 4}, b[4] = {1, 0, 0, 1}, c[4] = {0};
  assert_int_equal(fsdp_cpu_onednn_sgemm(c, a, b, 2, 2, 2, false, false, 1.0f, 0.0f, 1, 2, 2),
                   FSDP_ERR);
  char v[32];
  assert_non_null(strstr(fsdp_error_msg(), fsdp_cpu_onednn_version(v, sizeof v)
                                               ? "onednn: sgemm 2 x 2 x 2 (trans 00, ld 1 2 2)"
                                               : "onednn: not built in"));
}

/* What the environment and the processor choose: ctest runs this binary five ways (CMakeLists):
 * plainly; with oneDNN held to AVX2 (a processor like a Zen 3: no AVX-512, so OpenBLAS and the
 * conversion pass, even when forced); the same asking for oneDNN (refused, with the variable's
 * name); with OpenBLAS on its AVX-512 kernels (OPENBLAS_CORETYPE, as it picks them on
 * processors it knows: oneDNN still takes f32 where it runs AVX-512 code); and with
 * FSDP_GEMM=openblas FSDP_BF16_GEMM=convert. */
static void test_choice(void **state) {
  (void)state;
  const char *expect = getenv("FSDP_TEST_GEMM_EXPECT");
  const char *core = openblas_get_corename();
  bool ob512 = !strcasecmp(core, "skylakex") || !strcasecmp(core, "cooperlake") ||
               !strcasecmp(core, "sapphirerapids");
  if (!expect || !strcmp(expect, "openblas512")) {
    /* the default takes whatever the build and the processor make faster */
    if (expect) assert_true(ob512); /* else OPENBLAS_CORETYPE did not take: proves nothing */
    assert_int_equal(fsdp_cpu_gemm_check(), FSDP_OK);
    assert_int_equal(fsdp_cpu_sgemm_onednn(), fsdp_cpu_sgemm_supported());
    assert_int_equal(fsdp_cpu_bf16_gemm_native(), fsdp_cpu_bf16_gemm_supported());
    assert_false(fsdp_cpu_sgemm_force(0));
    assert_false(fsdp_cpu_bf16_gemm_force(0));
    fsdp_cpu_sgemm_force(-1), fsdp_cpu_bf16_gemm_force(-1);
    assert_int_equal(fsdp_cpu_sgemm_onednn(), fsdp_cpu_sgemm_supported());
    assert_int_equal(fsdp_cpu_bf16_gemm_native(), fsdp_cpu_bf16_gemm_supported());
    return;
  }
  if (!strcmp(expect, "avx2") || !strcmp(expect, "avx2_asked")) {
    assert_false(fsdp_cpu_sgemm_supported());
    assert_false(fsdp_cpu_bf16_gemm_supported());
    if (!strcmp(expect, "avx2_asked")) { /* FSDP_GEMM=onednn FSDP_BF16_GEMM=native: refused,
                                          * the first variable named */
      assert_int_equal(fsdp_cpu_gemm_check(), FSDP_ERR);
      assert_non_null(strstr(fsdp_error_msg(), "FSDP_GEMM=onednn: oneDNN cannot run f32 GEMMs"));
    } else {
      assert_int_equal(fsdp_cpu_gemm_check(), FSDP_OK);
    }
    assert_false(fsdp_cpu_sgemm_onednn());
    assert_false(fsdp_cpu_bf16_gemm_native());
    assert_false(fsdp_cpu_sgemm_force(1));
    assert_false(fsdp_cpu_bf16_gemm_force(1));
  } else {
    assert_string_equal(expect, "env");
    assert_int_equal(fsdp_cpu_gemm_check(), FSDP_OK);
    assert_false(fsdp_cpu_sgemm_onednn());
    assert_false(fsdp_cpu_bf16_gemm_native());
    /* forcing still reaches what the processor has (tests and benchmarks) */
    assert_int_equal(fsdp_cpu_sgemm_force(1), fsdp_cpu_sgemm_supported());
    assert_int_equal(fsdp_cpu_bf16_gemm_force(1), fsdp_cpu_bf16_gemm_supported());
  }
  fsdp_cpu_sgemm_force(-1), fsdp_cpu_bf16_gemm_force(-1);
  assert_false(fsdp_cpu_sgemm_onednn());
  assert_false(fsdp_cpu_bf16_gemm_native());
}

/* ---- errors ------------------------------------------------------------------------------------------ */

static void test_refused_shape(void **state) {
  (void)state;
  char v[32];
  fsdp_cpu_mm_shape s = {BF16, BF16, FSDP_DTYPE_COUNT, -1, 4, 4, false, false, 4, 4, 4, 1.0f, 0.0f, 0, 0, 0, 0};
  fsdp_cpu_mm *mm = NULL;
  size_t bytes = 0;
  assert_int_equal(fsdp_cpu_mm_plan(&mm, &bytes, &s), FSDP_ERR);
  if (fsdp_cpu_onednn_version(v, sizeof v))
    assert_non_null(strstr(fsdp_error_msg(), "onednn: no matmul for bf16 x bf16 -> bf16 (-1 x 4 x 4"));
  else
    assert_non_null(strstr(fsdp_error_msg(), "onednn: not built in"));
}

/* the native path's scratch comes from core: over the budget the slot fails with its message */
static void test_scratch_budget(void **state) {
  (void)state;
  if (!native_here()) {
    print_message("skipped: the native bf16 path is not available here\n");
    return;
  }
  enum { M = 64, C = 64 };
  fsdp_cpu_mm_shape s = {BF16, BF16, FSDP_DTYPE_COUNT, M, M, C, false, false, C, M, M, 1.0f, 0.0f, 0, 0, 0, 0};
  fsdp_cpu_mm *mm;
  size_t bytes = 0;
  assert_int_equal(fsdp_cpu_mm_plan(&mm, &bytes, &s), FSDP_OK);
  assert_true(bytes > 16); /* this shape needs scratch (else the test proves nothing) */
  uint16_t *a = bf16_rand(M * C), *b = bf16_rand(C * M), *c = calloc(M * M, 2);
  fsdp_mem_domain *d = budget_begin(16);
  assert_true(fsdp_cpu_bf16_gemm_force(1));
  assert_int_equal(K()->gemm(CTX, BF16, c, a, b, M, M, C, false, false, 1.0f, 0.0f, C, M, M),
                   FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  fsdp_mem_set_limit(d, 0);
  assert_int_equal(K()->gemm(CTX, BF16, c, a, b, M, M, C, false, false, 1.0f, 0.0f, C, M, M),
                   FSDP_OK);
  fsdp_cpu_bf16_gemm_force(-1);
  budget_end(d);
  free(a), free(b), free(c);
}

/* what fsdp.info() shows: the f32 library and the bf16 path as chosen */
static void test_describe(void **state) {
  (void)state;
  char buf[160];
  bool s = fsdp_cpu_sgemm_supported();
  fsdp_cpu_bf16_gemm_force(1), fsdp_cpu_sgemm_force(1);
  fsdp_cpu_gemm_describe(buf, sizeof buf);
  assert_non_null(strstr(buf, s ? "f32 onednn 2." : "f32 openblas 0."));
  assert_non_null(strstr(buf, native_here() ? "bf16 onednn 2." : "bf16 by conversion to f32"));
  fsdp_cpu_bf16_gemm_force(0), fsdp_cpu_sgemm_force(0);
  fsdp_cpu_gemm_describe(buf, sizeof buf);
  assert_non_null(strstr(buf, s ? "f32 openblas 0.3" : "f32 openblas 0."));
  assert_int_equal(strstr(buf, "(onednn off)") != NULL, s);
  assert_non_null(strstr(buf, native_here() ? "bf16 by conversion to f32 (native path off)"
                                            : "bf16 by conversion to f32"));
  fsdp_cpu_bf16_gemm_force(-1), fsdp_cpu_sgemm_force(-1);
  char tiny[8];
  fsdp_cpu_gemm_describe(tiny, sizeof tiny); /* truncated, terminated */
  assert_int_equal(strlen(tiny), 7);
}

int main(void) {
  const char *expect = getenv("FSDP_TEST_GEMM_EXPECT");
  __builtin_cpu_init();
  if (expect && !strcmp(expect, "openblas512") && !__builtin_cpu_supports("avx512f")) {
    printf("skipped: OpenBLAS's AVX-512 kernels need a processor with AVX-512\n");
    return 77;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gemm_slot),          cmocka_unit_test(test_small_keeps_conversion),
      cmocka_unit_test(test_f32_output),         cmocka_unit_test(test_linear),
      cmocka_unit_test(test_bmm),                cmocka_unit_test(test_threads_and_repeat),
      cmocka_unit_test(test_refused_shape),      cmocka_unit_test(test_scratch_budget),
      cmocka_unit_test(test_describe),           cmocka_unit_test(test_f32_libraries),
      cmocka_unit_test(test_f32_repeat),         cmocka_unit_test(test_f32_refused),
      cmocka_unit_test(test_f32_linear_bias),
      cmocka_unit_test(test_choice),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
