/*
 * test_pool.c — the rank's thread pool (src/kernels/cpu/pool.h) and the kernels split over it.
 *
 *   the pool: chunking (counts, bounds, alignment, coverage) at 1-8 threads against
 *   fsdp_cpu_chunk_bounds (fsdp_cpu_chunk_at finding each chunk by its start); small jobs
 *   inline on the caller; chunk 0 on the caller; nested calls
 *   inline, with fsdp_cpu_threads() == 1; every item of thousands of jobs run exactly once;
 *   idle workers asleep on their futex after the spin and the yielding;
 *   rank threads that come and go leave no worker behind (/proc/self/task); shrinking and
 *   releasing join workers; a forked child runs jobs and exits without its parent's workers; the per-thread and process-wide settings;
 *   the thread rule (src/host/setup.c): FSDP_THREADS, FSDP_BLAS_THREADS, cores / ranks, the mpi
 *   form, and malformed variables named in the error;
 *   the kernels: GEMM (odd shapes, every transpose, strided views, row and column cuts), linear,
 *   bmm, attention (by pairs and by tiles), SGD / AdamW, sum / sumsq / column and axis sums,
 *   layernorm backward (rows in blocks, parameter sums in block order), dtype conversions give
 *   results within 1e-6 (of the largest magnitude) at 1, 2 and 3 threads, and the same bits
 *   run to run at a fixed thread count (the optimizers and reductions at any count).
 */
#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "core/core.h"
#include "host/host.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

/* Under valgrind everything runs ~50x slower: fewer rounds, same checks. */
static bool under_valgrind(void) {
  const char *p = getenv("LD_PRELOAD");
  return getenv("FSDP_UNDER_VALGRIND") != NULL || (p && strstr(p, "vgpreload"));
}

/* ---- helpers ------------------------------------------------------------------------------ */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static float urand(float lo, float hi) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  double u = (double)((rng_state * 0x2545f4914f6cdd1dull) >> 11) * (1.0 / 9007199254740992.0);
  return (float)(lo + (hi - lo) * u);
}

static float *frand(int64_t n, float lo, float hi) {
  float *p = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
  for (int64_t i = 0; i < n; i++) p[i] = urand(lo, hi);
  return p;
}

static float *fcopy(const float *src, int64_t n) {
  float *p = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
  memcpy(p, src, sizeof(float) * (size_t)n);
  return p;
}

/* max |got - want| <= tol * max |want| (at least tol): results of one computation cut
 * differently, compared at the scale of the output. */
static void check_close(const char *what, const float *got, const float *want, int64_t n,
                        double tol) {
  double scale = 1.0, worst = 0.0;
  int64_t at = 0;
  for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs((double)want[i]));
  for (int64_t i = 0; i < n; i++) {
    double e = fabs((double)got[i] - (double)want[i]);
    if (!(e <= worst)) worst = e, at = i;
  }
  if (!(worst <= tol * scale))
    fail_msg("%s: [%lld] %.9g vs %.9g: error %.3g > %.1g x %.3g", what, (long long)at,
             (double)got[at], (double)want[at], worst, tol, scale);
}

static void check_bits(const char *what, const float *got, const float *want, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
      fail_msg("%s: [%lld] %.9g vs %.9g differ in bits", what, (long long)i, (double)got[i],
               (double)want[i]);
}

/* Threads of this process: entries of /proc/self/task. */
static int os_threads(void) {
  DIR *d = opendir("/proc/self/task");
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

/* os_threads() once it equals `want`, or after 2 s whatever it is then. A thread that
 * pthread_join has returned for can still be listed in /proc/self/task for a moment (the kernel
 * wakes the joiner before it removes the exited task), so a count taken right after a join may
 * be one high; a thread that was never joined stays and fails the comparison. */
static int os_threads_settled(int want) {
  int n = os_threads();
  for (int i = 0; i < 2000 && n != want; i++) {
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
    n = os_threads();
  }
  return n;
}

/* ---- chunking ---------------------------------------------------------------------------- */

#define MAXREC 64

typedef struct rec_job {
  atomic_int count;
  int64_t lo[MAXREC], hi[MAXREC];
  pthread_t who[MAXREC];
} rec_job;

static void rec_task(void *ctx, int64_t lo, int64_t hi) {
  rec_job *r = ctx;
  int i = atomic_fetch_add(&r->count, 1);
  if (i < MAXREC) r->lo[i] = lo, r->hi[i] = hi, r->who[i] = pthread_self();
}

static void test_chunks(void **state) {
  (void)state;
  const int threads[] = {1, 2, 3, 5, 8};
  const int64_t ns[] = {0, 1, 2, 5, 15, 16, 17, 31, 32, 33, 100, 1000, 4097, 65541};
  const int64_t grains[] = {0, 1, 2, 3, 16, 48, 100};
  for (size_t ti = 0; ti < sizeof threads / sizeof threads[0]; ti++) {
    fsdp_cpu_set_threads(threads[ti]);
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
      for (size_t gi = 0; gi < sizeof grains / sizeof grains[0]; gi++) {
        const int64_t n = ns[ni], grain = grains[gi], g1 = grain < 1 ? 1 : grain;
        rec_job r = {0};
        fsdp_cpu_parallel_for(n, grain, rec_task, &r);
        const int got = atomic_load(&r.count);
        if (n == 0) {
          assert_int_equal(got, 0);
          continue;
        }
        const int want = n / g1 < 2 ? 1 : (int)(n / g1 < threads[ti] ? n / g1 : threads[ti]);
        if (got != want || fsdp_cpu_chunks(n, grain) != want)
          fail_msg("threads %d n %lld grain %lld: %d chunks (chunks() %d), expected %d",
                   threads[ti], (long long)n, (long long)grain, got, fsdp_cpu_chunks(n, grain),
                   want);
        /* every chunk is where chunk_bounds says, the chunks tile [0, n) */
        int64_t covered = 0;
        for (int c = 0; c < want; c++) {
          int64_t lo, hi;
          fsdp_cpu_chunk_bounds(n, grain, want, c, &lo, &hi);
          int k = 0;
          while (k < got && r.lo[k] != lo) k++;
          if (k == got || r.hi[k] != hi)
            fail_msg("threads %d n %lld grain %lld: chunk %d [%lld, %lld) did not run",
                     threads[ti], (long long)n, (long long)grain, c, (long long)lo,
                     (long long)hi);
          assert_int_equal(lo, covered);
          if (hi > lo) assert_int_equal(fsdp_cpu_chunk_at(n, grain, want, lo), c);
          covered = hi;
          if (want > 1) assert_true(hi - lo >= g1);
          if (want > 1 && g1 % 16 == 0 && c < want - 1) assert_int_equal(hi % 16, 0);
          if (lo == 0) assert_true(pthread_equal(r.who[k], pthread_self())); /* chunk 0 */
        }
        assert_int_equal(covered, n);
        if (want == 1) assert_true(pthread_equal(r.who[0], pthread_self()));
      }
    }
  }
  fsdp_cpu_set_threads(0);
  fsdp_cpu_pool_release();
}

/* A job below 2 x grain runs inline and starts no worker. */
static void test_small_inline(void **state) {
  (void)state;
  fsdp_cpu_pool_release();
  fsdp_cpu_set_threads(4);
  rec_job r = {0};
  fsdp_cpu_parallel_for(10, 6, rec_task, &r);
  assert_int_equal(atomic_load(&r.count), 1);
  assert_int_equal(r.lo[0], 0);
  assert_int_equal(r.hi[0], 10);
  assert_true(pthread_equal(r.who[0], pthread_self()));
  assert_int_equal(fsdp_cpu_pool_workers(), 0);
  fsdp_cpu_parallel_for(12, 6, rec_task, &r); /* 2 x grain: two chunks, a worker */
  assert_int_equal(atomic_load(&r.count), 3);
  assert_int_equal(fsdp_cpu_pool_workers(), 1);
  fsdp_cpu_set_threads(0);
  fsdp_cpu_pool_release();
}

/* ---- nesting ------------------------------------------------------------------------------- */

typedef struct nest_job {
  atomic_int bad;
  atomic_int inner_calls;
  float *a, *b, *c; /* each task: its own c block of a 64 x 48 x 80 product */
} nest_job;

static void inner_task(void *ctx, int64_t lo, int64_t hi) {
  nest_job *j = ctx;
  atomic_fetch_add(&j->inner_calls, 1);
  if (lo != 0 || hi != 5000) atomic_fetch_add(&j->bad, 1);
}

static void outer_task(void *ctx, int64_t lo, int64_t hi) {
  nest_job *j = ctx;
  for (int64_t i = lo; i < hi; i++) {
    if (fsdp_cpu_threads() != 1) atomic_fetch_add(&j->bad, 1);
    fsdp_cpu_parallel_for(5000, 1, inner_task, j); /* inline, once */
    fsdp_cpu_pool_release();                       /* a no-op inside a task */
    /* a GEMM from inside a task runs whole on this thread */
    fsdp_cpu_gemm(j->c + i * 64 * 80, j->a, j->b, 64, 80, 48, false, false, 1.0f, 0.0f, 48, 80,
                  80);
  }
}

static void test_nested(void **state) {
  (void)state;
  fsdp_cpu_set_threads(3);
  nest_job j = {.a = frand(64 * 48, -1, 1), .b = frand(48 * 80, -1, 1)};
  j.c = malloc(sizeof(float) * 6 * 64 * 80);
  float *want = malloc(sizeof(float) * 64 * 80);
  fsdp_cpu_sgemm_serial(want, j.a, j.b, 64, 80, 48, false, false, 1.0f, 0.0f, 48, 80, 80);
  fsdp_cpu_parallel_for(6, 1, outer_task, &j);
  assert_int_equal(atomic_load(&j.bad), 0);
  assert_int_equal(atomic_load(&j.inner_calls), 6);
  for (int i = 0; i < 6; i++) check_bits("gemm in a task", j.c + i * 64 * 80, want, 64 * 80);
  assert_int_equal(fsdp_cpu_threads(), 3); /* outside the task again */
  free(j.a), free(j.b), free(j.c), free(want);
  fsdp_cpu_set_threads(0);
  fsdp_cpu_pool_release();
}

/* ---- many jobs: every item exactly once ------------------------------------------------------ */

typedef struct count_job {
  atomic_int *hits;
} count_job;

static void count_task(void *ctx, int64_t lo, int64_t hi) {
  count_job *j = ctx;
  for (int64_t i = lo; i < hi; i++) atomic_fetch_add(&j->hits[i], 1);
}

static void run_many_jobs(int threads, int jobs, uint32_t seed) {
  fsdp_cpu_set_threads(threads);
  atomic_int *hits = calloc(256, sizeof *hits);
  count_job j = {hits};
  int expect[256] = {0};
  for (int k = 0; k < jobs; k++) {
    seed = seed * 1664525u + 1013904223u;
    int n = 1 + (int)(seed >> 8) % 256;
    for (int i = 0; i < n; i++) expect[i]++;
    fsdp_cpu_parallel_for(n, 1 + (int)(seed >> 20) % 4, count_task, &j);
    if (k % 97 == 0) {
      /* a pause longer than the spin and the yielding: the workers go to sleep and must be
       * woken */
      struct timespec pause = {0, 1500000};
      nanosleep(&pause, NULL);
    }
  }
  for (int i = 0; i < 256; i++)
    if (atomic_load(&hits[i]) != expect[i])
      fail_msg("threads %d: item %d ran %d times, expected %d", threads, i,
               atomic_load(&hits[i]), expect[i]);
  free(hits);
}

static void test_many_jobs(void **state) {
  (void)state;
  const int jobs = under_valgrind() ? 300 : 20000;
  run_many_jobs(2, jobs, 1);
  run_many_jobs(3, jobs, 2);
  run_many_jobs(8, jobs / 4, 3);
  fsdp_cpu_set_threads(0);
  fsdp_cpu_pool_release();
}

/* Idle workers end up asleep on their futex (a rank blocked in a collective or in Lua burns no
 * core), and a job wakes them all. The sleep comes after the spin and the yielding (0.55 ms);
 * the test allows 2 s for it on a loaded host. */
static void wait_asleep(int want) {
  for (int k = 0; k < 2000 && fsdp_cpu_pool_sleeping() != want; k++) {
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
  }
  assert_int_equal(fsdp_cpu_pool_sleeping(), want);
}

static void test_workers_sleep(void **state) {
  (void)state;
  const int before = os_threads();
  atomic_int *hits = calloc(1000, sizeof *hits);
  count_job j = {hits};
  fsdp_cpu_set_threads(3);
  for (int r = 1; r <= 3; r++) {
    fsdp_cpu_parallel_for(1000, 1, count_task, &j);
    assert_int_equal(fsdp_cpu_pool_workers(), 2);
    wait_asleep(2);
  }
  for (int i = 0; i < 1000; i++) assert_int_equal(atomic_load(&hits[i]), 3);
  fsdp_cpu_pool_release();
  assert_int_equal(fsdp_cpu_pool_sleeping(), 0);
  assert_int_equal(os_threads_settled(before), before);
  free(hits);
  fsdp_cpu_set_threads(0);
}

/* ---- rank threads that come and go ------------------------------------------------------------ */

typedef struct rank_arg {
  int id;
  int bad;
} rank_arg;

static void *rank_main(void *p) {
  rank_arg *a = p;
  const int threads = 1 + a->id % 4;
  fsdp_cpu_set_threads(threads);
  atomic_int *hits = calloc(1000, sizeof *hits);
  count_job j = {hits};
  for (int k = 0; k < 20; k++) fsdp_cpu_parallel_for(1000, 10, count_task, &j);
  for (int i = 0; i < 1000; i++) a->bad += atomic_load(&hits[i]) != 20;
  if (fsdp_cpu_pool_workers() != threads - 1) a->bad++;
  if (a->id % 3 == 0) fsdp_cpu_pool_release(); /* the others leave it to thread exit */
  free(hits);
  return NULL;
}

static void test_rank_threads(void **state) {
  (void)state;
  const int before = os_threads();
  assert_true(before > 0);
  const int rounds = under_valgrind() ? 2 : 10;
  for (int r = 0; r < rounds; r++) {
    enum { N = 8 };
    pthread_t t[N];
    rank_arg args[N];
    for (int i = 0; i < N; i++) {
      args[i] = (rank_arg){.id = r * N + i};
      assert_int_equal(pthread_create(&t[i], NULL, rank_main, &args[i]), 0);
    }
    for (int i = 0; i < N; i++) {
      pthread_join(t[i], NULL);
      assert_int_equal(args[i].bad, 0);
    }
    /* every rank thread's workers were joined before the rank thread ended */
    assert_int_equal(os_threads_settled(before), before);
  }
}

/* Shrinking joins the workers; growing starts more on the next job; release joins them. */
static void test_release(void **state) {
  (void)state;
  const int before = os_threads();
  atomic_int *hits = calloc(1000, sizeof *hits);
  count_job j = {hits};
  fsdp_cpu_set_threads(3);
  fsdp_cpu_parallel_for(1000, 1, count_task, &j);
  assert_int_equal(fsdp_cpu_pool_workers(), 2);
  assert_int_equal(os_threads_settled(before + 2), before + 2);
  fsdp_cpu_set_threads(2);
  assert_int_equal(fsdp_cpu_pool_workers(), 0);
  assert_int_equal(os_threads_settled(before), before);
  fsdp_cpu_parallel_for(1000, 1, count_task, &j);
  assert_int_equal(fsdp_cpu_pool_workers(), 1);
  fsdp_cpu_set_threads(5);
  assert_int_equal(fsdp_cpu_pool_workers(), 1); /* lazily: on the next job */
  fsdp_cpu_parallel_for(1000, 1, count_task, &j);
  assert_int_equal(fsdp_cpu_pool_workers(), 4);
  fsdp_cpu_pool_release();
  assert_int_equal(fsdp_cpu_pool_workers(), 0);
  assert_int_equal(os_threads_settled(before), before);
  for (int i = 0; i < 1000; i++) assert_int_equal(atomic_load(&hits[i]), 3);
  free(hits);
  fsdp_cpu_set_threads(0);
}

/* A forked child (os.execute, io.popen) has none of its parent's workers: its jobs still run
 * every item once, it starts workers of its own, and exit() joins only those. */
static void test_fork(void **state) {
  (void)state;
  fsdp_cpu_set_threads(3);
  atomic_int *hits = calloc(1000, sizeof *hits);
  count_job j = {hits};
  fsdp_cpu_parallel_for(1000, 1, count_task, &j);
  assert_int_equal(fsdp_cpu_pool_workers(), 2);
  fflush(NULL);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    int bad = fsdp_cpu_pool_workers() != 0;
    fsdp_cpu_parallel_for(1000, 1, count_task, &j);
    for (int i = 0; i < 1000; i++) bad += atomic_load(&hits[i]) != 2;
    bad += fsdp_cpu_pool_workers() != 2;
    exit(bad ? 1 : 0); /* runs the library destructor: joins the child's own workers */
  }
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail_msg("forked child: %s %d", WIFEXITED(status) ? "exit status" : "signal",
             WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
  assert_int_equal(fsdp_cpu_pool_workers(), 2); /* the parent's are untouched */
  fsdp_cpu_parallel_for(1000, 1, count_task, &j);
  for (int i = 0; i < 1000; i++) assert_int_equal(atomic_load(&hits[i]), 2);
  free(hits);
  fsdp_cpu_set_threads(0);
  fsdp_cpu_pool_release();
}

/* ---- settings and the thread rule ------------------------------------------------------------ */

static void *read_threads(void *p) {
  *(int *)p = fsdp_cpu_threads();
  return NULL;
}

static int threads_on_another_thread(void) {
  int n = 0;
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, read_threads, &n), 0);
  pthread_join(t, NULL);
  return n;
}

static void test_settings(void **state) {
  (void)state;
  const int cores = fsdp_cpu_cores();
  assert_true(cores >= 1);
  fsdp_cpu_set_default_threads(0);
  assert_int_equal(fsdp_cpu_default_threads(), cores);
  fsdp_cpu_set_default_threads(3);
  assert_int_equal(fsdp_cpu_default_threads(), 3);
  assert_int_equal(fsdp_cpu_threads(), 3);
  fsdp_cpu_set_threads(2); /* this thread only */
  assert_int_equal(fsdp_cpu_threads(), 2);
  assert_int_equal(threads_on_another_thread(), 3);
  fsdp_cpu_set_threads(0); /* back to the default */
  assert_int_equal(fsdp_cpu_threads(), 3);
  fsdp_cpu_set_threads(1 << 20);
  assert_int_equal(fsdp_cpu_threads(), FSDP_CPU_MAX_THREADS);
  fsdp_cpu_set_default_threads(1 << 20);
  assert_int_equal(fsdp_cpu_default_threads(), FSDP_CPU_MAX_THREADS);
  fsdp_cpu_set_threads(0);
  fsdp_cpu_set_default_threads(0);
}

static void env_clear(void) {
  unsetenv("FSDP_THREADS");
  unsetenv("FSDP_BLAS_THREADS");
}

/* fsdp_host_threads fails, its message naming the variable and value */
static void expect_env_error(const char *name, const char *value) {
  env_clear();
  setenv(name, value, 1);
  fsdp_cpu_set_default_threads(7);
  assert_int_equal(fsdp_host_threads(0, 1), FSDP_ERR);
  char want[96];
  snprintf(want, sizeof want, "%s='%s' must be a positive integer (at most %d)", name, value,
           FSDP_CPU_MAX_THREADS);
  if (strstr(fsdp_error_msg(), want) == NULL)
    fail_msg("%s=%s: error '%s' lacks '%s'", name, value, fsdp_error_msg(), want);
  assert_int_equal(fsdp_cpu_default_threads(), 7); /* unchanged */
  assert_int_equal(fsdp_host_mpi_threads(1), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), want));
  fsdp_error_clear();
}

static void test_thread_rule(void **state) {
  (void)state;
  const int cores = fsdp_cpu_cores();
  env_clear();
  /* max(1, cores / ranks) */
  assert_int_equal(fsdp_host_threads(0, 1), FSDP_OK);
  assert_int_equal(fsdp_cpu_default_threads(), cores);
  assert_int_equal(fsdp_host_threads(0, 2), FSDP_OK);
  assert_int_equal(fsdp_cpu_default_threads(), cores / 2 > 0 ? cores / 2 : 1);
  assert_int_equal(fsdp_host_threads(0, 4 * cores), FSDP_OK);
  assert_int_equal(fsdp_cpu_default_threads(), 1);
  assert_int_equal(threads_on_another_thread(), 1); /* a rank thread follows the default */
  /* a requested count wins, even over a malformed variable */
  setenv("FSDP_THREADS", "many", 1);
  assert_int_equal(fsdp_host_threads(5, 4), FSDP_OK);
  assert_int_equal(fsdp_cpu_default_threads(), 5);
  /* FSDP_THREADS, FSDP_BLAS_THREADS (the old name), FSDP_THREADS over it */
  env_clear();
  setenv("FSDP_THREADS", "3", 1);
  assert_int_equal(fsdp_host_threads(0, 2), FSDP_OK);
  assert_int_equal(fsdp_cpu_default_threads(), 3);
  env_clear();
  setenv("FSDP_BLAS_THREADS", "4", 1);
  assert_int_equal(fsdp_host_threads(0, 2), FSDP_OK);
  assert_int_equal(fsdp_cpu_default_threads(), 4);
  setenv("FSDP_THREADS", "6", 1);
  assert_int_equal(fsdp_host_threads(0, 2), FSDP_OK);
  assert_int_equal(fsdp_cpu_default_threads(), 6);
  setenv("FSDP_THREADS", "", 1); /* empty: unset */
  assert_int_equal(fsdp_host_threads(0, 2), FSDP_OK);
  assert_int_equal(fsdp_cpu_default_threads(), 4);
  /* the mpi form: the variables, else min(the CPUs this process may use, online / local) */
  assert_int_equal(fsdp_host_mpi_threads(3), FSDP_OK);
  assert_int_equal(fsdp_cpu_default_threads(), 4);
  env_clear();
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  assert_int_equal(fsdp_host_mpi_threads(1), FSDP_OK);
  assert_int_equal(fsdp_cpu_default_threads(), cores < online ? cores : (int)online);
  assert_int_equal(fsdp_host_mpi_threads((int)online * 2), FSDP_OK);
  assert_int_equal(fsdp_cpu_default_threads(), 1);
  /* malformed: named */
  expect_env_error("FSDP_THREADS", "many");
  expect_env_error("FSDP_THREADS", "0");
  expect_env_error("FSDP_THREADS", "-2");
  expect_env_error("FSDP_THREADS", "3x");
  expect_env_error("FSDP_THREADS", "1025");
  expect_env_error("FSDP_BLAS_THREADS", "two");
  expect_env_error("FSDP_BLAS_THREADS", "99999999999999999999");
  env_clear();
  fsdp_cpu_set_default_threads(0);
}

/* ---- GEMM ---------------------------------------------------------------------------------- */

typedef struct gemm_case {
  int M, N, K, pad;
  bool ta, tb;
  float alpha, beta;
} gemm_case;

/* c = alpha op(a) op(b) + beta c at `threads` threads; a, b, c0 random with row padding. */
static float *gemm_at(const gemm_case *g, int threads, const float *a, const float *b,
                      const float *c0, int64_t csize) {
  fsdp_cpu_set_threads(threads);
  const int lda = (g->ta ? g->M : g->K) + g->pad, ldb = (g->tb ? g->K : g->N) + g->pad,
            ldc = g->N + g->pad;
  float *c = fcopy(c0, csize);
  fsdp_cpu_gemm(c, a, b, g->M, g->N, g->K, g->ta, g->tb, g->alpha, g->beta, lda, ldb, ldc);
  return c;
}

static void test_gemm(void **state) {
  (void)state;
  const gemm_case shapes[] = {
      {133, 97, 71, 0, 0, 0, 1, 0},    {37, 300, 61, 3, 0, 0, 1, 0}, /* rows or columns */
      {20, 600, 100, 5, 0, 0, 1, 0},   /* too few rows: cut by columns */
      {515, 33, 64, 1, 0, 0, 1, 0},    /* too few columns: rows */
      {1, 4096, 256, 0, 0, 0, 1, 0},   /* a row vector */
      {64, 64, 64, 0, 0, 0, 1, 0},     /* small: stays whole */
      {301, 257, 33, 7, 0, 0, 1, 0},
  };
  const int nshapes = (int)(sizeof shapes / sizeof shapes[0]);
  const bool valgrind = under_valgrind();
  char what[160];
  for (int s = 0; s < nshapes; s++) {
    for (int tr = 0; tr < 4; tr++) {
      for (int bi = 0; bi < 2; bi++) {
        if (valgrind && (tr + bi) % 3 != 0) continue;
        gemm_case g = shapes[s];
        g.ta = tr & 1, g.tb = tr >> 1;
        g.alpha = bi ? 0.7f : 1.0f, g.beta = bi ? 1.0f : 0.0f;
        const int arows = g.ta ? g.K : g.M, brows = g.tb ? g.N : g.K;
        const int64_t asize = (int64_t)arows * ((g.ta ? g.M : g.K) + g.pad),
                      bsize = (int64_t)brows * ((g.tb ? g.K : g.N) + g.pad),
                      csize = (int64_t)g.M * (g.N + g.pad);
        float *a = frand(asize, -1, 1), *b = frand(bsize, -1, 1), *c0 = frand(csize, -1, 1);
        float *one = gemm_at(&g, 1, a, b, c0, csize);
        float *two = gemm_at(&g, 2, a, b, c0, csize);
        float *again = gemm_at(&g, 2, a, b, c0, csize);
        float *three = gemm_at(&g, 3, a, b, c0, csize);
        snprintf(what, sizeof what, "gemm %dx%dx%d pad %d ta %d tb %d beta %g", g.M, g.N, g.K,
                 g.pad, g.ta, g.tb, (double)g.beta);
        check_close(what, two, one, csize, 1e-6);
        check_close(what, three, one, csize, 1e-6);
        check_bits(what, again, two, csize);
        /* padding columns of c are never written */
        for (int m = 0; m < g.M; m++)
          for (int p = 0; p < g.pad; p++)
            assert_memory_equal(&two[(int64_t)m * (g.N + g.pad) + g.N + p],
                                &c0[(int64_t)m * (g.N + g.pad) + g.N + p], sizeof(float));
        free(a), free(b), free(c0), free(one), free(two), free(again), free(three);
      }
    }
  }
  /* the large products used the pool (the last ones ran at 3 threads), OpenBLAS one thread */
  assert_int_equal(fsdp_cpu_pool_workers(), 2);
  assert_int_equal(fsdp_cpu_get_blas_threads(), 1);
  fsdp_cpu_set_threads(0);
  fsdp_cpu_pool_release();
}

static void test_linear_bmm(void **state) {
  (void)state;
  const int M = 203, K = 96, N = 130;
  float *inp = frand(M * K, -1, 1), *w = frand(N * K, -1, 1), *bias = frand(N, -1, 1),
        *dout = frand(M * N, -1, 1), *din0 = frand(M * K, -1, 1), *dw0 = frand(N * K, -1, 1),
        *db0 = frand(N, -1, 1);
  float *out[4], *din[4], *dw[4], *db[4];
  const int tc[4] = {1, 2, 2, 3};
  for (int r = 0; r < 4; r++) {
    fsdp_cpu_set_threads(tc[r]);
    out[r] = malloc(sizeof(float) * M * N);
    fsdp_cpu_linear_forward(out[r], inp, w, bias, M, K, N);
    din[r] = fcopy(din0, M * K), dw[r] = fcopy(dw0, N * K), db[r] = fcopy(db0, N);
    fsdp_cpu_linear_backward(din[r], dw[r], db[r], dout, inp, w, M, K, N);
  }
  check_close("linear out", out[1], out[0], M * N, 1e-6);
  check_close("linear dinp", din[1], din[0], M * K, 1e-6);
  check_close("linear dweight", dw[1], dw[0], N * K, 1e-6);
  check_close("linear dbias", db[1], db[0], N, 1e-6);
  check_close("linear out at 3 threads", out[3], out[0], M * N, 1e-6);
  check_close("linear dinp at 3 threads", din[3], din[0], M * K, 1e-6);
  check_close("linear dweight at 3 threads", dw[3], dw[0], N * K, 1e-6);
  check_close("linear dbias at 3 threads", db[3], db[0], N, 1e-6);
  check_bits("linear out run to run", out[2], out[1], M * N);
  check_bits("linear dinp run to run", din[2], din[1], M * K);
  check_bits("linear dweight run to run", dw[2], dw[1], N * K);
  check_bits("linear dbias run to run", db[2], db[1], N);
  /* the bias was seeded: out - x w^T equals the bias */
  float *nob = malloc(sizeof(float) * M * N);
  fsdp_cpu_linear_forward(nob, inp, w, NULL, M, K, N);
  for (int m = 0; m < M; m += 50)
    for (int n = 0; n < N; n++) assert_float_equal(out[1][m * N + n] - nob[m * N + n], bias[n], 1e-5);
  free(nob);
  for (int r = 0; r < 4; r++) free(out[r]), free(din[r]), free(dw[r]), free(db[r]);
  free(inp), free(w), free(bias), free(dout), free(din0), free(dw0), free(db0);

  /* bmm: 6 batches (split by batch), 1 and 3 (each product split at 2 threads; 3 batches
   * by batch at 3) */
  const int Bs[] = {6, 1, 3};
  for (int bi = 0; bi < 3; bi++) {
    const int B = Bs[bi], bm = 97, bk = 75, bn = 120;
    float *a = frand(B * bm * bk, -1, 1), *b = frand(B * bk * bn, -1, 1),
          *g = frand(B * bm * bn, -1, 1), *da0 = frand(B * bm * bk, -1, 1),
          *dbb0 = frand(B * bk * bn, -1, 1);
    float *o[4], *da[4], *dbb[4];
    for (int r = 0; r < 4; r++) {
      fsdp_cpu_set_threads(tc[r]);
      o[r] = malloc(sizeof(float) * B * bm * bn);
      fsdp_cpu_bmm_forward(o[r], a, b, B, bm, bk, bn);
      da[r] = fcopy(da0, B * bm * bk), dbb[r] = fcopy(dbb0, B * bk * bn);
      fsdp_cpu_bmm_backward(da[r], dbb[r], g, a, b, B, bm, bk, bn);
    }
    char what[64];
    snprintf(what, sizeof what, "bmm B=%d", B);
    check_close(what, o[1], o[0], B * bm * bn, 1e-6);
    check_close(what, da[1], da[0], B * bm * bk, 1e-6);
    check_close(what, dbb[1], dbb[0], B * bk * bn, 1e-6);
    check_close(what, o[3], o[0], B * bm * bn, 1e-6);
    check_close(what, da[3], da[0], B * bm * bk, 1e-6);
    check_close(what, dbb[3], dbb[0], B * bk * bn, 1e-6);
    check_bits(what, o[2], o[1], B * bm * bn);
    check_bits(what, da[2], da[1], B * bm * bk);
    check_bits(what, dbb[2], dbb[1], B * bk * bn);
    for (int r = 0; r < 4; r++) free(o[r]), free(da[r]), free(dbb[r]);
    free(a), free(b), free(g), free(da0), free(dbb0);
  }
  fsdp_cpu_set_threads(0);
  fsdp_cpu_pool_release();
}

/* ---- attention ------------------------------------------------------------------------------- */

static void attention_case(int B, int T, int C, int NH) {
  const int64_t nqkv = (int64_t)B * T * 3 * C, nout = (int64_t)B * T * C;
  float *qkv = frand(nqkv, -1.5f, 1.5f), *dout = frand(nout, -1, 1), *prior = frand(nqkv, -1, 1);
  const int tc[4] = {1, 2, 2, 3};
  const int64_t nst = (int64_t)B * NH * T * 2;
  float *out[4], *dqkv[4], *st[4];
  for (int r = 0; r < 4; r++) {
    fsdp_cpu_set_threads(tc[r]);
    out[r] = frand(nout, 7, 8); /* garbage: overwritten */
    st[r] = frand(nst, 7, 8);
    float *fw = frand(fsdp_cpu_attention_scratch(B, T, C, NH, tc[r], false), -9, 9);
    float *bw = frand(fsdp_cpu_attention_scratch(B, T, C, NH, tc[r], true), -9, 9);
    fsdp_cpu_attention_forward(out[r], st[r], fw, qkv, B, T, C, NH);
    dqkv[r] = fcopy(prior, nqkv);
    /* the probabilities from the stats at even counts, recomputed whole at odd ones */
    fsdp_cpu_attention_backward(dqkv[r], bw, dout, qkv, r % 2 ? NULL : st[r], B, T, C, NH,
                                false);
    free(fw), free(bw);
  }
  char what[96];
  for (int r = 1; r < 4; r++) {
    snprintf(what, sizeof what, "attention B=%d T=%d C=%d NH=%d at %d threads", B, T, C, NH,
             tc[r]);
    /* the same chains of operations for every element whoever runs them, pair by pair or
     * tile by tile */
    check_bits(what, out[r], out[0], nout);
    check_bits(what, st[r], st[0], nst);
    check_bits(what, dqkv[r], dqkv[0], nqkv);
  }
  snprintf(what, sizeof what, "attention B=%d T=%d C=%d NH=%d run to run", B, T, C, NH);
  check_bits(what, dqkv[2], dqkv[1], nqkv);
  for (int r = 0; r < 4; r++) free(out[r]), free(dqkv[r]), free(st[r]);
  free(qkv), free(dout), free(prior);
}

static void test_attention(void **state) {
  (void)state;
  attention_case(4, 130, 48, 4); /* 16 pairs: shared out by pair */
  attention_case(1, 200, 32, 2); /* 2 pairs: by query and key tile */
  attention_case(1, 64, 16, 1);  /* one pair, one tile */
  attention_case(3, 1, 12, 3);   /* one token */
  fsdp_cpu_set_threads(0);
  fsdp_cpu_pool_release();
}

/* ---- optimizers -------------------------------------------------------------------------------- */

static void test_optimizers(void **state) {
  (void)state;
  const int64_t n = 100003;
  float *p0 = frand(n, -1, 1), *g = frand(n, -1, 1), *m0 = frand(n, -0.1f, 0.1f),
        *v0 = frand(n, 0, 0.01f);
  float *ref[4] = {0};
  const int tc[3] = {1, 2, 3};
  for (int r = 0; r < 3; r++) {
    fsdp_cpu_set_threads(tc[r]);
    float *p = fcopy(p0, n), *buf = fcopy(m0, n), *p2 = fcopy(p0, n), *p3 = fcopy(p0, n),
          *m = fcopy(m0, n), *v = fcopy(v0, n);
    fsdp_cpu_sgd_step(p, NULL, g, n, 0.1f, 0.0f, 0.01f, false);
    fsdp_cpu_sgd_step(p2, buf, g, n, 0.1f, 0.9f, 0.01f, true);
    fsdp_cpu_sgd_step(p2, buf, g, n, 0.1f, 0.9f, 0.01f, false);
    for (int64_t step = 1; step <= 3; step++)
      fsdp_cpu_adamw_step(p3, m, v, g, n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1.0f, step);
    float *got[4] = {p, p2, p3, v};
    const char *names[4] = {"sgd", "sgd momentum", "adamw param", "adamw v"};
    for (int k = 0; k < 4; k++) {
      if (r == 0) {
        ref[k] = got[k];
        continue;
      }
      check_close(names[k], got[k], ref[k], n, 1e-6);
      check_bits(names[k], got[k], ref[k], n); /* element-wise: the same bits at any count */
      free(got[k]);
    }
    free(buf), free(m);
  }
  for (int k = 0; k < 4; k++) free(ref[k]);
  free(p0), free(g), free(m0), free(v0);
  fsdp_cpu_set_threads(0);
  fsdp_cpu_pool_release();
}

/* ---- reductions -------------------------------------------------------------------------------- */

static void test_reductions(void **state) {
  (void)state;
  const int64_t n = 3 * 65536 + 4099;
  float *a = frand(n, -1, 2);
  double want_sum = 0, want_sq = 0;
  for (int64_t i = 0; i < n; i++) want_sum += a[i], want_sq += (double)a[i] * a[i];
  const int R = 2048, C = 773;
  float *x = frand((int64_t)R * C, -1, 1), *out0 = frand(C, -1, 1);
  double want_col[773];
  for (int c = 0; c < C; c++) {
    want_col[c] = out0[c];
    for (int r = 0; r < R; r++) want_col[c] += x[(int64_t)r * C + c];
  }
  const int64_t outer = 4, AR = 300, inner = 130, outer1 = 3, R1 = 70001;
  float *y = frand(outer * AR * inner, -1, 1), *z = frand(outer1 * R1, -1, 1);
  double s[4], q[4];
  float *col[4], *ax[4], *ax1[4], *bk[4];
  const int tc[4] = {1, 2, 2, 3};
  for (int r = 0; r < 4; r++) {
    fsdp_cpu_set_threads(tc[r]);
    s[r] = fsdp_cpu_sum(a, n);
    q[r] = fsdp_cpu_sumsq(a, n);
    col[r] = fcopy(out0, C);
    fsdp_cpu_colsum_acc(col[r], x, R, C);
    ax[r] = malloc(sizeof(float) * outer * inner);
    fsdp_cpu_sum_dim_forward(ax[r], y, outer, AR, inner);
    ax1[r] = malloc(sizeof(float) * outer1);
    fsdp_cpu_sum_dim_forward(ax1[r], z, outer1, R1, 1);
    bk[r] = fcopy(y, outer * AR * inner);
    fsdp_cpu_sum_dim_backward(bk[r], ax[0], outer, AR, inner);
  }
  assert_true(fabs(s[0] - want_sum) <= 1e-9 * fabs(want_sum) + 1e-9);
  assert_true(fabs(q[0] - want_sq) <= 1e-9 * want_sq);
  for (int c = 0; c < C; c++) assert_float_equal(col[0][c], want_col[c], 1e-5 * fabs(want_col[c]) + 1e-5);
  for (int r = 1; r < 4; r++) {
    /* blocks fixed by n, columns and outer items whole: the same bits at any thread count */
    assert_memory_equal(&s[r], &s[0], sizeof(double));
    assert_memory_equal(&q[r], &q[0], sizeof(double));
    check_bits("colsum", col[r], col[0], C);
    check_bits("sum_dim", ax[r], ax[0], outer * inner);
    check_bits("sum_dim inner 1", ax1[r], ax1[0], outer1);
    check_bits("sum_dim backward", bk[r], bk[0], outer * AR * inner);
  }
  for (int r = 0; r < 4; r++) free(col[r]), free(ax[r]), free(ax1[r]), free(bk[r]);
  free(a), free(x), free(out0), free(y), free(z);
  fsdp_cpu_set_threads(0);
  fsdp_cpu_pool_release();
}

/* ---- layernorm backward --------------------------------------------------------------------- */

/* dinp, dweight and dbias with the same bits at 1, 2 and 3 threads (blocks of rows fixed by N),
 * at a row count that leaves a short last block; the parameter sums within 1e-5 of a double
 * reference, and dweight / dbias alone (no dinp) equal to the sums beside dinp. */
static void test_layernorm_backward(void **state) {
  (void)state;
  const int64_t N = 64 * 9 + 13;
  const int C = 389;
  float *x = frand(N * C, -3, 5), *g = frand(N * C, -1, 1), *w = frand(C, 0.5f, 1.5f);
  float *mean = malloc(sizeof(float) * N), *rstd = malloc(sizeof(float) * N);
  float *y = malloc(sizeof(float) * N * C);
  fsdp_cpu_layernorm_forward(y, mean, rstd, x, w, NULL, N, C, 1e-5f);
  float *dx0 = frand(N * C, -1, 1), *dw0 = frand(C, -1, 1), *db0 = frand(C, -1, 1);
  float *dx[4], *dw[4], *db[4], *dw_only[4], *db_only[4];
  const int tc[4] = {1, 2, 2, 3};
  for (int r = 0; r < 4; r++) {
    fsdp_cpu_set_threads(tc[r]);
    dx[r] = fcopy(dx0, N * C), dw[r] = fcopy(dw0, C), db[r] = fcopy(db0, C);
    fsdp_cpu_layernorm_backward(dx[r], dw[r], db[r], g, x, w, mean, rstd, N, C);
    dw_only[r] = fcopy(dw0, C), db_only[r] = fcopy(db0, C);
    fsdp_cpu_layernorm_backward(NULL, dw_only[r], db_only[r], g, x, w, mean, rstd, N, C);
  }
  for (int c = 0; c < C; c++) {
    double sw = dw0[c], sb = db0[c];
    for (int64_t n = 0; n < N; n++) {
      const double gi = g[n * C + c];
      sw += ((double)x[n * C + c] - mean[n]) * rstd[n] * gi;
      sb += gi;
    }
    assert_float_equal(dw[0][c], sw, 1e-5 * (fabs(sw) + 1));
    assert_float_equal(db[0][c], sb, 1e-5 * (fabs(sb) + 1));
  }
  for (int r = 0; r < 4; r++) {
    check_bits("layernorm dweight alone", dw_only[r], dw[0], C);
    check_bits("layernorm dbias alone", db_only[r], db[0], C);
    if (r == 0) continue;
    check_bits("layernorm dinp", dx[r], dx[0], N * C);
    check_bits("layernorm dweight", dw[r], dw[0], C);
    check_bits("layernorm dbias", db[r], db[0], C);
  }
  for (int r = 0; r < 4; r++) free(dx[r]), free(dw[r]), free(db[r]), free(dw_only[r]), free(db_only[r]);
  free(x), free(g), free(w), free(mean), free(rstd), free(y), free(dx0), free(dw0), free(db0);
  fsdp_cpu_set_threads(0);
  fsdp_cpu_pool_release();
}

/* ---- conversions ------------------------------------------------------------------------------ */

/* bf16 <-> f32 split over threads: every element as core's scalar conversion gives it, at 1, 2
 * and 3 threads, including NaN and the rounding ties; and narrowing in place (f32 read and bf16
 * written over the same bytes), which the cast keeps on one thread, still correct. */
static void test_convert(void **state) {
  (void)state;
  const int64_t n = 5 * 8192 + 77;
  float *x = frand(n, -4, 4);
  x[1] = NAN, x[2] = INFINITY, x[3] = 1.00390625f; /* a tie: rounds to even */
  uint16_t *want = malloc(sizeof(uint16_t) * n), *h = malloc(sizeof(uint16_t) * n);
  float *back = malloc(sizeof(float) * n);
  for (int64_t i = 0; i < n; i++) want[i] = fsdp_f32_to_bf16(x[i]);
  const int tc[3] = {1, 2, 3};
  for (int r = 0; r < 3; r++) {
    fsdp_cpu_set_threads(tc[r]);
    memset(h, 0xff, sizeof(uint16_t) * n);
    fsdp_cpu_cast(h, FSDP_DTYPE_BF16, x, FSDP_DTYPE_F32, n);
    assert_memory_equal(h, want, sizeof(uint16_t) * n);
    fsdp_cpu_cast(back, FSDP_DTYPE_F32, h, FSDP_DTYPE_BF16, n);
    for (int64_t i = 0; i < n; i++) {
      float f = fsdp_bf16_to_f32(want[i]);
      assert_memory_equal(&back[i], &f, sizeof(float));
    }
    float *inplace = fcopy(x, n);
    fsdp_cpu_cast(inplace, FSDP_DTYPE_BF16, inplace, FSDP_DTYPE_F32, n);
    assert_memory_equal(inplace, want, sizeof(uint16_t) * n);
    free(inplace);
  }
  free(x), free(want), free(h), free(back);
  fsdp_cpu_set_threads(0);
  fsdp_cpu_pool_release();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_chunks),       cmocka_unit_test(test_small_inline),
      cmocka_unit_test(test_nested),       cmocka_unit_test(test_many_jobs),
      cmocka_unit_test(test_workers_sleep),
      cmocka_unit_test(test_rank_threads), cmocka_unit_test(test_release),
      cmocka_unit_test(test_fork),
      cmocka_unit_test(test_settings),     cmocka_unit_test(test_thread_rule),
      cmocka_unit_test(test_gemm),         cmocka_unit_test(test_linear_bmm),
      cmocka_unit_test(test_attention),    cmocka_unit_test(test_optimizers),
      cmocka_unit_test(test_reductions),   cmocka_unit_test(test_layernorm_backward),
      cmocka_unit_test(test_convert),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
