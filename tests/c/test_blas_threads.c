/*
 * test_blas_threads.c — concurrent sgemm from rank threads, as `fsdprun -n N` runs them: N
 * threads (2 and 4) each call fsdp_cpu_gemm (OpenBLAS cblas_sgemm) on their own data, many
 * times, all four transpose combinations, strided operands, beta 0 and 1, while the others do
 * the same; every result must equal, bit for bit, the one computed serially beforehand.
 *
 * Configuration under test: the launcher's for several ranks, one OpenBLAS thread
 * (fsdp_cpu_set_blas_threads(1), set once before the threads start). FSDP_TEST_BLAS_THREADS=n
 * runs the same check with n OpenBLAS threads per call (an experiment, see docs/comm.md:
 * with Debian's OpenBLAS 0.3.21 that configuration is not safe by design and is very slow).
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/cpu/kernels.h"

#define MAXT 4
#define ITERS 100
/* Under valgrind (its preload library is in LD_PRELOAD) OpenBLAS runs ~100x slower: a few
 * rounds still check concurrency and memory there; the full count runs natively. */
static int iters(void) {
  const char *p = getenv("LD_PRELOAD");
  return p && strstr(p, "vgpreload") ? 2 : ITERS;
}

/* OpenBLAS 0.3.21 splits a gemm over its threads only when M*N*K > 262144 (65536 x
 * GEMM_MULTITHREAD_THRESHOLD 4): 80x64x72 is above, so FSDP_TEST_BLAS_THREADS=2 exercises the
 * threaded driver; the others stay on the calling thread in every configuration. */
typedef struct shape {
  int M, N, K;
  int pad; /* extra columns in each stored row: lda/ldb/ldc > the logical width */
} shape;

static const shape shapes[] = {{48, 40, 64, 0}, {80, 64, 72, 3}, {33, 129, 17, 5}, {1, 96, 100, 0}};
#define NSHAPES ((int)(sizeof shapes / sizeof shapes[0]))
#define NCASES (NSHAPES * 4 * 2) /* shapes x transposes x beta */

typedef struct gcase {
  int M, N, K, lda, ldb, ldc;
  bool ta, tb;
  float beta;
  float *a, *b, *c0; /* inputs; c0: c before the call (used with beta = 1) */
  float *ref;        /* the serial result */
  float *out;        /* this thread's result */
  size_t csize;
} gcase;

typedef struct worker {
  int id;
  gcase cases[NCASES];
  int wrong;         /* results that differ from the serial ones */
  char first[200];
} worker;

static float val(int t, int k, int64_t i) {
  uint32_t h = (uint32_t)(t * 7919 + k * 104729) ^ (uint32_t)i * 2654435761u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return (float)(h % 20001) / 10000.0f - 1.0f;
}

static float *filled(size_t n, int t, int k) {
  float *p = malloc(n * sizeof *p);
  for (size_t i = 0; i < n; i++) p[i] = val(t, k, (int64_t)i);
  return p;
}

static void make_cases(worker *w) {
  int k = 0;
  for (int s = 0; s < NSHAPES; s++) {
    for (int tr = 0; tr < 4; tr++) {
      for (int bt = 0; bt < 2; bt++, k++) {
        gcase *g = &w->cases[k];
        const shape *sh = &shapes[s];
        g->M = sh->M + w->id; /* every thread a different problem */
        g->N = sh->N;
        g->K = sh->K + 2 * w->id;
        g->ta = tr & 1;
        g->tb = tr & 2;
        g->beta = bt ? 1.0f : 0.0f;
        /* stored shapes: a is (M, K) or (K, M) when transposed; rows padded */
        int arows = g->ta ? g->K : g->M, acols = g->ta ? g->M : g->K;
        int brows = g->tb ? g->N : g->K, bcols = g->tb ? g->K : g->N;
        g->lda = acols + sh->pad;
        g->ldb = bcols + sh->pad;
        g->ldc = g->N + sh->pad;
        g->a = filled((size_t)arows * g->lda, w->id, 3 * k);
        g->b = filled((size_t)brows * g->ldb, w->id, 3 * k + 1);
        g->csize = (size_t)g->M * g->ldc;
        g->c0 = filled(g->csize, w->id, 3 * k + 2);
        g->ref = malloc(g->csize * sizeof(float));
        g->out = malloc(g->csize * sizeof(float));
      }
    }
  }
}

static void run_case(gcase *g, float *c) {
  memcpy(c, g->c0, g->csize * sizeof(float));
  fsdp_cpu_gemm(c, g->a, g->b, g->M, g->N, g->K, g->ta, g->tb, 1.0f, g->beta, g->lda, g->ldb,
                g->ldc);
}

static void free_cases(worker *w) {
  for (int k = 0; k < NCASES; k++) {
    gcase *g = &w->cases[k];
    free(g->a);
    free(g->b);
    free(g->c0);
    free(g->ref);
    free(g->out);
  }
}

static pthread_barrier_t start_line;

static void *worker_main(void *arg) {
  worker *w = arg;
  pthread_barrier_wait(&start_line); /* all threads begin together: maximal overlap */
  const int n_iters = iters();
  for (int it = 0; it < n_iters; it++) {
    for (int k = 0; k < NCASES; k++) {
      /* rotate the order so different threads run different transposes at the same time */
      gcase *g = &w->cases[(k + it + w->id * 3) % NCASES];
      run_case(g, g->out);
      if (memcmp(g->out, g->ref, g->csize * sizeof(float)) != 0) {
        if (!w->wrong) {
          snprintf(w->first, sizeof w->first,
                   "thread %d iteration %d: gemm %dx%dx%d ta=%d tb=%d beta=%g differs from serial",
                   w->id, it, g->M, g->N, g->K, g->ta, g->tb, g->beta);
        }
        w->wrong++;
      }
    }
  }
  return NULL;
}

static void check_concurrent(int nthreads) {
  worker *w = calloc(MAXT, sizeof *w);
  for (int t = 0; t < nthreads; t++) {
    w[t].id = t;
    make_cases(&w[t]);
    for (int k = 0; k < NCASES; k++) run_case(&w[t].cases[k], w[t].cases[k].ref); /* serial */
  }
  pthread_t th[MAXT];
  pthread_barrier_init(&start_line, NULL, (unsigned)nthreads);
  for (int t = 0; t < nthreads; t++) assert_int_equal(pthread_create(&th[t], NULL, worker_main, &w[t]), 0);
  for (int t = 0; t < nthreads; t++) pthread_join(th[t], NULL);
  pthread_barrier_destroy(&start_line);
  int wrong = 0;
  for (int t = 0; t < nthreads; t++) {
    if (w[t].wrong) fprintf(stderr, "%s (%d wrong results)\n", w[t].first, w[t].wrong);
    wrong += w[t].wrong;
  }
  /* the serial results are real products: spot-check one element against a plain dot */
  gcase *g = &w[nthreads - 1].cases[NCASES - 1];
  double dot = g->beta * g->c0[(size_t)(g->M - 1) * g->ldc + 2];
  for (int k = 0; k < g->K; k++) {
    float a = g->ta ? g->a[(size_t)k * g->lda + g->M - 1] : g->a[(size_t)(g->M - 1) * g->lda + k];
    float b = g->tb ? g->b[(size_t)2 * g->ldb + k] : g->b[(size_t)k * g->ldb + 2];
    dot += (double)a * b;
  }
  float got = g->ref[(size_t)(g->M - 1) * g->ldc + 2];
  for (int t = 0; t < nthreads; t++) free_cases(&w[t]);
  free(w);
  assert_int_equal(wrong, 0);
  assert_true(got > dot - 1e-3 && got < dot + 1e-3);
}

static int blas_threads_under_test(void) {
  const char *s = getenv("FSDP_TEST_BLAS_THREADS");
  int n = s ? atoi(s) : 1;
  return n < 1 ? 1 : n;
}

static int setup(void **state) {
  (void)state;
  fsdp_cpu_set_blas_threads(blas_threads_under_test()); /* once, before any rank thread */
  return 0;
}

static void test_setting(void **state) {
  (void)state;
  assert_int_equal(fsdp_cpu_get_blas_threads(), blas_threads_under_test());
}

static void test_two_threads(void **state) {
  (void)state;
  check_concurrent(2);
}

static void test_four_threads(void **state) {
  (void)state;
  check_concurrent(4);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_setting),
      cmocka_unit_test(test_two_threads),
      cmocka_unit_test(test_four_threads),
  };
  return cmocka_run_group_tests(tests, setup, NULL);
}
