/*
 * test_comm.c — the communicator (src/comm): every collective of the local backend against a
 * serial reference at world sizes 1-4 (odd counts, count 0, in place, NaN), bitwise equality
 * across ranks and runs, asynchronous handles (overlap, in-order and out-of-order waits, mixed
 * with blocking calls), fingerprint mismatches, abort, timeout, a rank that leaves, the flight
 * recorder, stats, the world of one, the current communicator, the environment, validation, and
 * the generic layer over a native-async backend.
 *
 * Ranks are pthreads. cmocka's asserts must run on the main thread, so rank bodies record what
 * they saw (status, message, first wrong element) in their rank_ctx and the main thread checks.
 */
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
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "comm/comm.h"
#include "comm/nccl.h"
#include "typed_ref.h"

#define MAXW 4
#define MSG 2048
#define NOTES 32

/* ---- rank threads ----------------------------------------------------------------------------- */

typedef struct rank_ctx rank_ctx;
typedef void (*rank_body)(rank_ctx *);

struct rank_ctx {
  int rank, world;
  fsdp_comm *c;
  void *arg;
  rank_body body;
  fsdp_local_group *g;
  double timeout;
  bool keep;           /* body frees the communicator itself (or leaves it to the runner) */
  /* what the body saw */
  int nnotes;
  int rc[NOTES];
  char msg[NOTES][MSG];
  double secs[NOTES];
  char wrong[256];     /* first value mismatch, "" when none */
  char big[8192];      /* a flight recorder */
  int checks;          /* values compared (a test that checks nothing is a defect) */
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_s(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&ts, NULL);
}

/* Record a collective's status and message (and how long it took since t0). */
static void note(rank_ctx *x, int rc, double t0) {
  if (x->nnotes >= NOTES) return;
  int i = x->nnotes++;
  x->rc[i] = rc;
  x->secs[i] = now_s() - t0;
  snprintf(x->msg[i], MSG, "%s", rc == FSDP_OK ? "" : fsdp_error_msg());
}

static void *rank_main(void *arg) {
  rank_ctx *x = arg;
  if (fsdp_comm_local_new(&x->c, x->g, x->rank) != FSDP_OK) {
    snprintf(x->wrong, sizeof x->wrong, "local_new: %s", fsdp_error_msg());
    return NULL;
  }
  if (x->timeout > 0) fsdp_comm_set_timeout(x->c, x->timeout);
  fsdp_comm_set_current(x->c);
  x->body(x);
  if (!x->keep) fsdp_comm_free(x->c);
  return NULL;
}

/* Run body on W rank threads of a fresh group; ctx[W] receives what each saw. */
static void run_world(int W, double timeout, rank_body body, void *arg, rank_ctx *ctx) {
  fsdp_local_group *g;
  assert_int_equal(fsdp_local_group_new(&g, W), FSDP_OK);
  pthread_t th[MAXW];
  for (int r = 0; r < W; r++) {
    memset(&ctx[r], 0, sizeof ctx[r]);
    ctx[r].rank = r;
    ctx[r].world = W;
    ctx[r].arg = arg;
    ctx[r].body = body;
    ctx[r].g = g;
    ctx[r].timeout = timeout;
  }
  for (int r = 0; r < W; r++) assert_int_equal(pthread_create(&th[r], NULL, rank_main, &ctx[r]), 0);
  for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < W; r++) {
    if (ctx[r].keep && ctx[r].c) fsdp_comm_free(ctx[r].c);
  }
  fsdp_local_group_release(g); /* the last reference: frees the group */
}

/* ---- deterministic inputs and the serial reference -------------------------------------------- */

/* Values spread over many exponents, so that float addition order shows in the low bits. */
static float input(int rank, int64_t i, int salt) {
  uint64_t h = (uint64_t)rank * 0x9E3779B97F4A7C15ull ^ (uint64_t)i * 0xC2B2AE3D27D4EB4Full ^
               (uint64_t)salt * 0x165667B19E3779F9ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  float m = (float)(h % 100003) / 100003.0f - 0.5f;
  return ldexpf(m, (int)(h >> 40) % 24 - 12);
}

static float ref_combine(float s, float x, fsdp_reduce_op red) {
  switch (red) {
  case FSDP_RED_MAX: return (x > s || x != x) ? x : s;
  case FSDP_RED_MIN: return (x < s || x != x) ? x : s;
  default: return s + x;
  }
}

/* element i of the reduction over ranks 0..W-1 of input(p, i, salt), left to right */
static float ref_reduce(int W, int64_t i, int salt, fsdp_reduce_op red) {
  float s = input(0, i, salt);
  for (int p = 1; p < W; p++) s = ref_combine(s, input(p, i, salt), red);
  if (red == FSDP_RED_AVG) s = s * (float)(1.0 / W);
  return s;
}

static bool same_bits(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

static void check_value(rank_ctx *x, const char *what, int64_t i, float got, float want) {
  x->checks++;
  if (x->wrong[0] || same_bits(got, want)) return;
  snprintf(x->wrong, sizeof x->wrong, "rank %d %s: element %lld is %.9g, want %.9g", x->rank,
           what, (long long)i, got, want);
}

static void expect_ok(rank_ctx *x, int rc, const char *what) {
  if (rc != FSDP_OK && !x->wrong[0]) {
    snprintf(x->wrong, sizeof x->wrong, "rank %d %s failed: %.200s", x->rank, what,
             fsdp_error_msg());
  }
}

/* Main thread: no rank saw a wrong value, and they compared something. */
static void assert_ranks_right(rank_ctx *ctx, int W) {
  for (int r = 0; r < W; r++) {
    if (ctx[r].wrong[0]) fail_msg("%s", ctx[r].wrong);
    assert_true(ctx[r].checks > 0);
  }
}

static void assert_contains(const char *hay, const char *needle) {
  if (!strstr(hay, needle)) fail_msg("\"%s\"\ndoes not contain \"%s\"", hay, needle);
}

/* ---- values ----------------------------------------------------------------------------------- */

static const int64_t counts[] = {0, 1, 5, 17, 100, 2049, 4099, 10007};
#define NCOUNTS ((int)(sizeof counts / sizeof counts[0]))

static void body_values(rank_ctx *x) {
  const int W = x->world, r = x->rank;
  fsdp_comm *c = fsdp_comm_current();
  for (int ci = 0; ci < NCOUNTS; ci++) {
    int64_t n = counts[ci];
    int salt = ci * 16;
    float *send = malloc(sizeof(float) * (size_t)(n * W + 1));
    float *recv = malloc(sizeof(float) * (size_t)(n * W + 1));
    /* all_gather */
    for (int64_t i = 0; i < n; i++) send[i] = input(r, i, salt);
    expect_ok(x, fsdp_comm_all_gather(c, recv, send, n, FSDP_DTYPE_F32, "ag"), "all_gather");
    for (int p = 0; p < W; p++)
      for (int64_t i = 0; i < n; i++) check_value(x, "all_gather", p * n + i, recv[p * n + i], input(p, i, salt));
    /* all_gather in place: this rank's shard already sits at recv + r * n */
    for (int64_t i = 0; i < n * W; i++) recv[i] = -1.0f;
    for (int64_t i = 0; i < n; i++) recv[r * n + i] = input(r, i, salt + 1);
    expect_ok(x, fsdp_comm_all_gather(c, recv, recv + r * n, n, FSDP_DTYPE_F32, "ag_inplace"), "all_gather in place");
    for (int p = 0; p < W; p++)
      for (int64_t i = 0; i < n; i++) check_value(x, "all_gather in place", p * n + i, recv[p * n + i], input(p, i, salt + 1));
    /* reduce_scatter and all_reduce, every reduction */
    for (int red = FSDP_RED_SUM; red <= FSDP_RED_MIN; red++) {
      int s2 = salt + 2 + red;
      for (int64_t i = 0; i < n * W; i++) send[i] = input(r, i, s2);
      expect_ok(x, fsdp_comm_reduce_scatter(c, recv, send, n, FSDP_DTYPE_F32, red, "rs"), "reduce_scatter");
      for (int64_t i = 0; i < n; i++) check_value(x, "reduce_scatter", i, recv[i], ref_reduce(W, r * n + i, s2, red));
      for (int64_t i = 0; i < n; i++) recv[i] = input(r, i, s2 + 8);
      expect_ok(x, fsdp_comm_all_reduce(c, recv, n, FSDP_DTYPE_F32, red, "ar"), "all_reduce");
      for (int64_t i = 0; i < n; i++) check_value(x, "all_reduce", i, recv[i], ref_reduce(W, i, s2 + 8, red));
    }
    /* reduce_scatter in place: the result lands in this rank's own chunk of send */
    for (int64_t i = 0; i < n * W; i++) send[i] = input(r, i, salt + 7);
    expect_ok(x, fsdp_comm_reduce_scatter(c, send + r * n, send, n, FSDP_DTYPE_F32, FSDP_RED_AVG, "rs_inplace"), "reduce_scatter in place");
    for (int64_t i = 0; i < n; i++) check_value(x, "reduce_scatter in place", i, send[r * n + i], ref_reduce(W, r * n + i, salt + 7, FSDP_RED_AVG));
    /* broadcast from every root */
    for (int root = 0; root < W; root++) {
      for (int64_t i = 0; i < n; i++) recv[i] = input(r, i, salt + 13);
      expect_ok(x, fsdp_comm_broadcast(c, recv, n, FSDP_DTYPE_F32, root, "bc"), "broadcast");
      for (int64_t i = 0; i < n; i++) check_value(x, "broadcast", i, recv[i], input(root, i, salt + 13));
    }
    expect_ok(x, fsdp_comm_barrier(c, "barrier"), "barrier");
    free(send);
    free(recv);
  }
}

static void test_values(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  for (int W = 1; W <= MAXW; W++) {
    run_world(W, 0, body_values, NULL, ctx);
    assert_ranks_right(ctx, W);
  }
}

/* NaN anywhere makes max/min NaN on every rank; sum and avg propagate it by arithmetic. */
static void body_nan(rank_ctx *x) {
  float buf[40];
  for (int i = 0; i < 40; i++) buf[i] = (float)(x->rank * 40 + i);
  if (x->rank == x->world - 1) buf[3] = NAN;
  if (x->rank == 0) buf[21] = NAN;
  expect_ok(x, fsdp_comm_all_reduce(x->c, buf, 40, FSDP_DTYPE_F32, FSDP_RED_MAX, "nan"), "all_reduce max");
  x->checks++;
  if (!isnan(buf[3]) || !isnan(buf[21]) || buf[0] != (float)((x->world - 1) * 40))
    snprintf(x->wrong, sizeof x->wrong, "rank %d: max gave %g %g %g", x->rank, buf[3], buf[21], buf[0]);
  for (int i = 0; i < 40; i++) buf[i] = (float)(x->rank * 40 + i);
  if (x->rank == 0) buf[7] = NAN;
  expect_ok(x, fsdp_comm_all_reduce(x->c, buf, 40, FSDP_DTYPE_F32, FSDP_RED_MIN, "nan"), "all_reduce min");
  x->checks++;
  if (!isnan(buf[7]) || buf[8] != 8.0f)
    snprintf(x->wrong, sizeof x->wrong, "rank %d: min gave %g %g", x->rank, buf[7], buf[8]);
}

static void test_nan(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(3, 0, body_nan, NULL, ctx);
  assert_ranks_right(ctx, 3);
}

/* ---- dtypes ------------------------------------------------------------------------------------ */

/* Every collective in every dtype (typed_ref.h's exercise, which the mpi test runs too). */
static void body_typed(rank_ctx *x) {
  typed_report t = {{0}, 0};
  typed_exercise(x->c, x->world, x->rank, &t);
  x->checks += (int)t.checks;
  if (t.wrong[0]) snprintf(x->wrong, sizeof x->wrong, "rank %d: %.200s", x->rank, t.wrong);
}

static void test_typed_values(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  for (int W = 1; W <= MAXW; W++) {
    run_world(W, 0, body_typed, NULL, ctx);
    assert_ranks_right(ctx, W);
  }
  /* the world of one runs the same program (its collectives are local copies) */
  rank_ctx one = {.world = 1};
  assert_int_equal(fsdp_comm_single_new(&one.c), FSDP_OK);
  body_typed(&one);
  fsdp_comm_free(one.c);
  if (one.wrong[0]) fail_msg("%s", one.wrong);
  assert_true(one.checks > 0);
}

/* bf16 reductions round once: three inputs whose f32 sum is exact but whose pairwise bf16
 * sums would round differently. 1 + 2^-8 + 2^-8: a bf16 fold would give 1 (each add ties to
 * even), the f32 fold 1 + 2^-7, which bf16 holds. */
static void body_bf16_once(rank_ctx *x) {
  uint16_t v = fsdp_f32_to_bf16(x->rank == 0 ? 1.0f : 0x1p-8f);
  expect_ok(x, fsdp_comm_all_reduce(x->c, &v, 1, FSDP_DTYPE_BF16, FSDP_RED_SUM, "once"), "ar");
  x->checks++;
  if (fsdp_bf16_to_f32(v) != 1.0f + 0x1p-7f)
    snprintf(x->wrong, sizeof x->wrong, "rank %d: bf16 sum %.9g, want %.9g", x->rank,
             fsdp_bf16_to_f32(v), 1.0f + 0x1p-7f);
}

static void test_bf16_rounds_once(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(3, 0, body_bf16_once, NULL, ctx);
  assert_ranks_right(ctx, 3);
}

/* Reductions a dtype has not are an error naming the dtype and the reduction. */
static void test_typed_invalid(void **state) {
  (void)state;
  fsdp_comm *c;
  uint8_t b[8] = {0};
  struct { fsdp_dtype dt; fsdp_reduce_op red; bool scatter; const char *msg; } cases[] = {
      {FSDP_DTYPE_U8, FSDP_RED_SUM, false,
       "all_reduce(u8 x4 sum, 'bytes'): sum is not defined for u8 (reductions take f32, bf16, f64, i64)"},
      {FSDP_DTYPE_BOOL, FSDP_RED_MAX, false, "max is not defined for bool"},
      {FSDP_DTYPE_U8, FSDP_RED_MIN, true, "reduce_scatter(u8 x4 min, 'bytes'): min is not defined for u8"},
      {FSDP_DTYPE_F16, FSDP_RED_SUM, false, "sum is not defined for f16"},
      {FSDP_DTYPE_I32, FSDP_RED_AVG, true, "avg is not defined for i32"},
      {FSDP_DTYPE_I64, FSDP_RED_AVG, false,
       "all_reduce(i64 x4 avg, 'bytes'): avg is not defined for i64 (reduce with sum and divide)"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
    uint64_t big[8] = {0};
    void *buf = fsdp_dtype_size(cases[k].dt) > 1 ? (void *)big : (void *)b;
    int rc = cases[k].scatter
                 ? fsdp_comm_reduce_scatter(c, buf, buf, 4, cases[k].dt, cases[k].red, "bytes")
                 : fsdp_comm_all_reduce(c, buf, 4, cases[k].dt, cases[k].red, "bytes");
    assert_int_equal(rc, FSDP_ERR);
    assert_contains(fsdp_error_msg(), cases[k].msg);
    fsdp_comm_free(c);
  }
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
  assert_int_equal(fsdp_comm_broadcast(c, b, 4, (fsdp_dtype)99, 0, "x"), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "unknown dtype 99");
  fsdp_comm_free(c);
}

/* A bytes reduction on one rank fails it, and its peer at once (the group is poisoned). */
static void body_bytes_sum(rank_ctx *x) {
  uint8_t b[4] = {1, 2, 3, 4};
  float f[4] = {0};
  if (x->rank == 0) note(x, fsdp_comm_all_reduce(x->c, b, 4, FSDP_DTYPE_U8, FSDP_RED_SUM, "b"), now_s());
  else note(x, fsdp_comm_all_reduce(x->c, f, 4, FSDP_DTYPE_F32, FSDP_RED_SUM, "b"), now_s());
}

/* Main thread, a world of two: rank 0's first call failed with msg (an invalid argument), and
 * rank 1's failed at once with "rank 0 failed: <msg>" (the group was poisoned). */
static void assert_invalid_poisons(rank_ctx *ctx, const char *msg) {
  char peer[256];
  snprintf(peer, sizeof peer, "rank 0 failed: %s", msg);
  assert_int_equal(ctx[0].rc[0], FSDP_ERR);
  assert_contains(ctx[0].msg[0], msg);
  assert_int_equal(ctx[1].rc[0], FSDP_ERR);
  assert_true(ctx[1].secs[0] < 5);
  assert_contains(ctx[1].msg[0], peer);
}

static void test_bytes_reduction_poisons(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(2, 30, body_bytes_sum, NULL, ctx);
  assert_invalid_poisons(ctx, "all_reduce(u8 x4 sum, 'b'): sum is not defined for u8");
}

/* Ranks that disagree on the dtype: the mismatch names both. */
static void body_dtype_mismatch(rank_ctx *x) {
  char send[64] = {0}, recv[64 * MAXW];
  fsdp_dtype dt = x->rank == 1 ? FSDP_DTYPE_BF16 : FSDP_DTYPE_F32;
  note(x, fsdp_comm_all_gather(x->c, recv, send, 8, dt, "blocks.1"), now_s());
}

/* Main thread: the first collective failed on every one of W ranks with msg. */
static void assert_all_failed(rank_ctx *ctx, int W, const char *msg) {
  for (int r = 0; r < W; r++) {
    assert_int_equal(ctx[r].rc[0], FSDP_ERR);
    assert_contains(ctx[r].msg[0], msg);
  }
}


/* The recorder and the byte counters use the dtype: bytes are elements x its size. */
static void body_typed_accounting(rank_ctx *x) {
  static uint16_t send[MAXW][1024], recv[MAXW][1024 * 2];
  double d[3] = {1, 2, 3};
  uint8_t u[5] = {0};
  fsdp_comm_reset_stats(x->c);
  expect_ok(x, fsdp_comm_all_gather(x->c, recv[x->rank], send[x->rank], 1024, FSDP_DTYPE_BF16,
                                    "blocks.1"), "ag");
  expect_ok(x, fsdp_comm_all_reduce(x->c, d, 3, FSDP_DTYPE_F64, FSDP_RED_SUM, "loss"), "ar");
  expect_ok(x, fsdp_comm_broadcast(x->c, u, 5, FSDP_DTYPE_U8, 0, "text"), "bc");
  expect_ok(x, fsdp_comm_reduce_scatter(x->c, recv[x->rank], send[x->rank], 512,
                                        FSDP_DTYPE_BF16, FSDP_RED_SUM, "grads"), "rs");
  fsdp_comm_stats st;
  fsdp_comm_get_stats(x->c, &st);
  x->checks++;
  if (st.bytes[FSDP_COLL_ALL_GATHER] != 1024 * 2 * 2 || st.bytes[FSDP_COLL_ALL_REDUCE] != 24 ||
      st.bytes[FSDP_COLL_BROADCAST] != 5 || st.bytes[FSDP_COLL_REDUCE_SCATTER] != 512 * 2 * 2)
    snprintf(x->wrong, sizeof x->wrong, "rank %d: bytes ag %lld ar %lld bc %lld rs %lld", x->rank,
             (long long)st.bytes[FSDP_COLL_ALL_GATHER], (long long)st.bytes[FSDP_COLL_ALL_REDUCE],
             (long long)st.bytes[FSDP_COLL_BROADCAST],
             (long long)st.bytes[FSDP_COLL_REDUCE_SCATTER]);
  fsdp_comm_flight_recorder(x->c, x->big, sizeof x->big);
}

static void test_typed_accounting(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(2, 0, body_typed_accounting, NULL, ctx);
  assert_ranks_right(ctx, 2);
  assert_contains(ctx[0].big, "all_gather bf16 x1024 'blocks.1' done");
  assert_contains(ctx[0].big, "all_reduce f64 x3 'loss' done");
  assert_contains(ctx[0].big, "broadcast u8 x5 'text' done");
  assert_contains(ctx[0].big, "reduce_scatter bf16 x512 'grads' done");
}

/* ---- reproducibility ------------------------------------------------------------------------- */

#define REPRO_N 5003
typedef struct repro_out {
  float ar[MAXW][REPRO_N];
  float rs[MAXW][REPRO_N];
} repro_out;

static void body_repro(rank_ctx *x) {
  repro_out *o = x->arg;
  const int W = x->world, r = x->rank;
  float *send = malloc(sizeof(float) * REPRO_N * W);
  for (int64_t i = 0; i < REPRO_N; i++) o->ar[r][i] = input(r, i, 99);
  expect_ok(x, fsdp_comm_all_reduce(x->c, o->ar[r], REPRO_N, FSDP_DTYPE_F32, FSDP_RED_AVG, "avg"), "all_reduce");
  for (int64_t i = 0; i < (int64_t)REPRO_N * W; i++) send[i] = input(r, i, 98);
  /* every rank receives chunk r; put them side by side in o->rs[r] (REPRO_N / W each) */
  int64_t n = REPRO_N / W;
  expect_ok(x, fsdp_comm_reduce_scatter(x->c, o->rs[r], send, n, FSDP_DTYPE_F32, FSDP_RED_AVG, "avg_rs"),
            "reduce_scatter");
  x->checks++;
  free(send);
}

static void test_bitwise_reproducible(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  repro_out *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
  for (int W = 2; W <= MAXW; W++) {
    run_world(W, 0, body_repro, a, ctx);
    assert_ranks_right(ctx, W);
    run_world(W, 0, body_repro, b, ctx);
    assert_ranks_right(ctx, W);
    /* all ranks hold the same bits, equal to the serial reference, and a second run repeats them */
    for (int r = 0; r < W; r++) {
      assert_memory_equal(a->ar[r], a->ar[0], sizeof a->ar[0]);
      assert_memory_equal(b->ar[r], a->ar[r], sizeof a->ar[0]);
      assert_memory_equal(b->rs[r], a->rs[r], sizeof(float) * (REPRO_N / W));
    }
    for (int64_t i = 0; i < REPRO_N; i++) {
      float want = ref_reduce(W, i, 99, FSDP_RED_AVG);
      if (!same_bits(a->ar[0][i], want)) fail_msg("W=%d element %lld: %.9g vs %.9g", W, (long long)i, a->ar[0][i], want);
    }
  }
  /* the avg really is rounded twice (sum, then * 1/3): at W = 3 it differs from sum / 3
   * somewhere, so the test above would notice another formula */
  int differ = 0;
  for (int64_t i = 0; i < REPRO_N; i++) {
    float s = ref_reduce(3, i, 99, FSDP_RED_SUM);
    differ += !same_bits(s * (float)(1.0 / 3), s / 3.0f);
  }
  assert_true(differ > 0);
  free(a);
  free(b);
}

/* ---- asynchronous ------------------------------------------------------------------------------ */

#define ASYNC_N 3000
#define ASYNC_K 5

static fsdp_coll gather_coll(float *recv, const float *send, int64_t n, const char *label) {
  fsdp_coll k = {.op = FSDP_COLL_ALL_GATHER, .dtype = FSDP_DTYPE_F32, .count = n,
                 .send = send, .recv = recv};
  snprintf(k.label, sizeof k.label, "%s", label);
  return k;
}

static void body_async(rank_ctx *x) {
  const int W = x->world, r = x->rank;
  float *send[ASYNC_K], *recv[ASYNC_K];
  for (int round = 0; round < 2; round++) {
    fsdp_comm_req *req[ASYNC_K];
    for (int k = 0; k < ASYNC_K; k++) {
      send[k] = malloc(sizeof(float) * ASYNC_N);
      recv[k] = malloc(sizeof(float) * ASYNC_N * W);
      for (int64_t i = 0; i < ASYNC_N; i++) send[k][i] = input(r, i, 200 + k + 10 * round);
      char label[16];
      snprintf(label, sizeof label, "u%d", k);
      fsdp_coll kc = gather_coll(recv[k], send[k], ASYNC_N, label);
      expect_ok(x, fsdp_comm_start(x->c, &kc, &req[k]), "start");
    }
    /* compute while they run */
    volatile double acc = 0;
    for (int i = 0; i < 200000; i++) acc += i * 1e-9;
    if (round == 0) {
      for (int k = 0; k < ASYNC_K; k++) expect_ok(x, fsdp_comm_wait(req[k]), "wait in order");
    } else {
      for (int k = ASYNC_K - 1; k >= 0; k--) expect_ok(x, fsdp_comm_wait(req[k]), "wait reversed");
    }
    for (int k = 0; k < ASYNC_K; k++) {
      for (int p = 0; p < W; p++)
        for (int64_t i = 0; i < ASYNC_N; i++)
          check_value(x, "async all_gather", p * ASYNC_N + i, recv[k][p * ASYNC_N + i], input(p, i, 200 + k + 10 * round));
      free(send[k]);
      free(recv[k]);
    }
  }
  /* mixed: async A, blocking B (queues behind A), async C, wait C then A */
  float a_send[64], a_recv[64 * MAXW], b[64], c_send[64 * MAXW], c_recv[64];
  for (int i = 0; i < 64; i++) a_send[i] = input(r, i, 300);
  for (int i = 0; i < 64; i++) b[i] = input(r, i, 301);
  for (int i = 0; i < 64 * W; i++) c_send[i] = input(r, i, 302);
  fsdp_coll ka = gather_coll(a_recv, a_send, 64, "A");
  fsdp_coll kc = {.op = FSDP_COLL_REDUCE_SCATTER, .dtype = FSDP_DTYPE_F32, .red = FSDP_RED_SUM,
                  .count = 64, .send = c_send, .recv = c_recv, .label = "C"};
  fsdp_comm_req *ra, *rc;
  expect_ok(x, fsdp_comm_start(x->c, &ka, &ra), "start A");
  expect_ok(x, fsdp_comm_all_reduce(x->c, b, 64, FSDP_DTYPE_F32, FSDP_RED_SUM, "B"), "B");
  expect_ok(x, fsdp_comm_start(x->c, &kc, &rc), "start C");
  expect_ok(x, fsdp_comm_wait(rc), "wait C");
  expect_ok(x, fsdp_comm_wait(ra), "wait A");
  for (int p = 0; p < W; p++)
    for (int i = 0; i < 64; i++) check_value(x, "A", p * 64 + i, a_recv[p * 64 + i], input(p, i, 300));
  for (int i = 0; i < 64; i++) check_value(x, "B", i, b[i], ref_reduce(W, i, 301, FSDP_RED_SUM));
  for (int i = 0; i < 64; i++) check_value(x, "C", i, c_recv[i], ref_reduce(W, r * 64 + i, 302, FSDP_RED_SUM));
  /* the recorder shows them in issue order: A, B, C are the last three */
  char rec[8192];
  fsdp_comm_flight_recorder(x->c, rec, sizeof rec);
  const char *pa = strstr(rec, "'A' done"), *pb = strstr(rec, "'B' done"), *pc = strstr(rec, "'C' done");
  x->checks++;
  if (!pa || !pb || !pc || !(pa < pb && pb < pc))
    snprintf(x->wrong, sizeof x->wrong, "rank %d: recorder order wrong:\n%.200s", r, rec);
}

static void test_async(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  for (int W = 1; W <= MAXW; W++) {
    run_world(W, 0, body_async, NULL, ctx);
    assert_ranks_right(ctx, W);
  }
}

/* Overlap: rank 1 arrives 300 ms late; rank 0's start returns at once and its compute (250 ms)
 * runs meanwhile, so it spends well under 300 ms in wait although the collective takes longer. */
static void body_overlap(rank_ctx *x) {
  float send[256], recv[512];
  for (int i = 0; i < 256; i++) send[i] = (float)(x->rank * 1000 + i);
  if (x->rank == 1) {
    sleep_s(0.3);
    note(x, fsdp_comm_all_gather(x->c, recv, send, 256, FSDP_DTYPE_F32, "late"), now_s());
    return;
  }
  fsdp_coll k = gather_coll(recv, send, 256, "late");
  fsdp_comm_req *req;
  double t0 = now_s();
  expect_ok(x, fsdp_comm_start(x->c, &k, &req), "start");
  double t_start = now_s() - t0;
  sleep_s(0.25); /* "compute" */
  double t1 = now_s();
  int rc = fsdp_comm_wait(req);
  double t_wait = now_s() - t1, t_total = now_s() - t0;
  note(x, rc, t0);
  x->secs[1] = t_start;
  x->secs[2] = t_wait;
  x->secs[3] = t_total;
  fsdp_comm_stats st;
  fsdp_comm_get_stats(x->c, &st);
  x->secs[4] = st.wait_s;
  x->secs[5] = st.busy_s;
  for (int p = 0; p < 2; p++)
    for (int i = 0; i < 256; i++) check_value(x, "late gather", p * 256 + i, recv[p * 256 + i], (float)(p * 1000 + i));
}

static void test_async_overlap(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(2, 0, body_overlap, NULL, ctx);
  assert_int_equal(ctx[0].rc[0], FSDP_OK);
  assert_int_equal(ctx[1].rc[0], FSDP_OK);
  if (ctx[0].wrong[0]) fail_msg("%s", ctx[0].wrong);
  assert_true(ctx[0].secs[1] < 0.1);              /* start did not block */
  assert_true(ctx[0].secs[3] >= 0.29);             /* the collective waited for rank 1 */
  assert_true(ctx[0].secs[2] < ctx[0].secs[3] - 0.2); /* most of it overlapped the compute */
  assert_true(ctx[0].secs[4] <= ctx[0].secs[2] + 0.01);  /* wait_s counts the wait only */
  assert_true(ctx[0].secs[5] >= 0.25);            /* busy_s counts the collective's time */
}

/* ---- fingerprints ----------------------------------------------------------------------------- */

static void body_mismatch_op(rank_ctx *x) {
  float send[1024 * 2], recv[1024 * 2];
  memset(send, 0, sizeof send);
  double t0 = now_s();
  if (x->rank == 0) note(x, fsdp_comm_all_gather(x->c, recv, send, 1024, FSDP_DTYPE_F32, "blocks.1"), t0);
  else note(x, fsdp_comm_reduce_scatter(x->c, recv, send, 512, FSDP_DTYPE_F32, FSDP_RED_SUM, "blocks.2"), t0);
  /* the group is poisoned: the next collective fails too, with the same story */
  note(x, fsdp_comm_barrier(x->c, "after"), now_s());
}

static void test_mismatch_op(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(2, 30, body_mismatch_op, NULL, ctx);
  for (int r = 0; r < 2; r++) {
    assert_int_equal(ctx[r].rc[0], FSDP_ERR);
    assert_contains(ctx[r].msg[0], "collective mismatch at #1: rank 0 called all_gather(f32 x1024, "
                                   "'blocks.1') but rank 1 called reduce_scatter(f32 x512 sum, 'blocks.2')");
    assert_true(strncmp(ctx[r].msg[0], "collective mismatch", 19) == 0);
    char hdr[64];
    snprintf(hdr, sizeof hdr, "\nflight recorder (rank %d, newest last):\n", r);
    assert_contains(ctx[r].msg[0], hdr);
    assert_true(ctx[r].secs[0] < 5);
    assert_int_equal(ctx[r].rc[1], FSDP_ERR);
    assert_contains(ctx[r].msg[1], "collective mismatch at #1");
  }
}

static void body_mismatch_count(rank_ctx *x) {
  float buf[300] = {0};
  note(x, fsdp_comm_all_reduce(x->c, buf, 100 + 100 * x->rank, FSDP_DTYPE_F32, FSDP_RED_AVG, "loss"), now_s());
}

static void test_mismatch_count(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(3, 30, body_mismatch_count, NULL, ctx);
  assert_all_failed(ctx, 3, "collective mismatch at #1: rank 0 called all_reduce(f32 x100 avg, "
                            "'loss') but rank 1 called all_reduce(f32 x200 avg, 'loss')");
  /* the dtype, likewise (typed collectives: f32 against bf16 of the same count) */
  run_world(3, 30, body_dtype_mismatch, NULL, ctx);
  assert_all_failed(ctx, 3, "collective mismatch at #1: rank 0 called all_gather(f32 x8, "
                            "'blocks.1') but rank 1 called all_gather(bf16 x8, 'blocks.1')");
}

/* Labels are compared on every collective, a label used before too: two same-size units
 * reduced in a different order on two ranks must not pass. */
static void body_labels(rank_ctx *x) {
  fsdp_comm *c = x->c;
  const int r = x->rank;
  note(x, fsdp_comm_barrier(c, "a"), now_s());                 /* same: ok */
  note(x, fsdp_comm_barrier(c, "b"), now_s());                 /* same: ok */
  note(x, fsdp_comm_barrier(c, r == 0 ? "a" : "b"), now_s());  /* both seen before: mismatch */
}

static void test_mismatch_label(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(2, 30, body_labels, NULL, ctx);
  for (int r = 0; r < 2; r++) {
    assert_int_equal(ctx[r].nnotes, 3);
    assert_int_equal(ctx[r].rc[0], FSDP_OK);
    assert_int_equal(ctx[r].rc[1], FSDP_OK);
    assert_int_equal(ctx[r].rc[2], FSDP_ERR);
    assert_contains(ctx[r].msg[2], "collective mismatch at #3: rank 0 called barrier('a') but "
                                   "rank 1 called barrier('b')");
  }
}

/* A label new on one rank, used before on the others, is compared. */
static void body_label_first_use(rank_ctx *x) {
  note(x, fsdp_comm_barrier(x->c, "blocks.0"), now_s());
  note(x, fsdp_comm_barrier(x->c, x->rank == 2 ? "blocks.9" : "blocks.0"), now_s());
}

static void test_label_first_use(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(3, 30, body_label_first_use, NULL, ctx);
  for (int r = 0; r < 3; r++) {
    assert_int_equal(ctx[r].rc[0], FSDP_OK);
    assert_int_equal(ctx[r].rc[1], FSDP_ERR);
    assert_contains(ctx[r].msg[1], "rank 0 called barrier('blocks.0') but rank 2 called barrier('blocks.9')");
  }
}

/* ---- the scalable fingerprint check ------------------------------------------------------------ */

static fsdp_coll coll_of(fsdp_coll_op op, fsdp_dtype dt, int64_t n, fsdp_reduce_op red, int root,
                         const char *label) {
  fsdp_coll k;
  memset(&k, 0, sizeof k);
  k.op = op;
  k.dtype = dt;
  k.count = n;
  k.red = red;
  k.root = root;
  snprintf(k.label, sizeof k.label, "%s", label);
  return k;
}

/* The hash covers exactly what fsdp_coll_matches compares, and the sequence number. */
static void test_check_hash(void **state) {
  (void)state;
  fsdp_coll a = coll_of(FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_F32, 100, FSDP_RED_SUM, 0, "loss");
  fsdp_coll b = a;
  b.send = (void *)&b; /* buffers are not part of a fingerprint */
  assert_true(fsdp_coll_hash(&a, 7) == fsdp_coll_hash(&b, 7));
  assert_true(fsdp_coll_hash(&a, 7) != fsdp_coll_hash(&a, 8));
  fsdp_coll diff[] = {
      coll_of(FSDP_COLL_REDUCE_SCATTER, FSDP_DTYPE_F32, 100, FSDP_RED_SUM, 0, "loss"),
      coll_of(FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_BF16, 100, FSDP_RED_SUM, 0, "loss"),
      coll_of(FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_F32, 101, FSDP_RED_SUM, 0, "loss"),
      coll_of(FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_F32, 100, FSDP_RED_AVG, 0, "loss"),
  };
  for (size_t i = 0; i < sizeof diff / sizeof diff[0]; i++) {
    assert_false(fsdp_coll_matches(&a, &diff[i]));
    assert_true(fsdp_coll_hash(&a, 7) != fsdp_coll_hash(&diff[i], 7));
  }
  /* the label counts */
  fsdp_coll l = coll_of(FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_F32, 100, FSDP_RED_SUM, 0, "lossy");
  assert_false(fsdp_coll_matches(&a, &l));
  assert_true(fsdp_coll_hash(&a, 7) != fsdp_coll_hash(&l, 7));
  /* root only for a broadcast, the reduction only where one applies */
  fsdp_coll g1 = coll_of(FSDP_COLL_ALL_GATHER, FSDP_DTYPE_F32, 8, FSDP_RED_SUM, 0, "g");
  fsdp_coll g2 = coll_of(FSDP_COLL_ALL_GATHER, FSDP_DTYPE_F32, 8, FSDP_RED_MAX, 3, "g");
  assert_true(fsdp_coll_matches(&g1, &g2));
  assert_true(fsdp_coll_hash(&g1, 1) == fsdp_coll_hash(&g2, 1));
  fsdp_coll b1 = coll_of(FSDP_COLL_BROADCAST, FSDP_DTYPE_F32, 8, FSDP_RED_SUM, 0, "b");
  fsdp_coll b2 = coll_of(FSDP_COLL_BROADCAST, FSDP_DTYPE_F32, 8, FSDP_RED_SUM, 1, "b");
  assert_true(fsdp_coll_hash(&b1, 1) != fsdp_coll_hash(&b2, 1));
  /* folding: any one rank that differs, anywhere in the order, is seen */
  for (int odd = 0; odd < 5; odd++) {
    uint64_t acc[FSDP_CHECK_WORDS], v[FSDP_CHECK_WORDS];
    for (int r = 0; r < 5; r++) {
      const fsdp_coll *k = r == odd ? &diff[r % 4] : &a;
      fsdp_coll_check_init(v, k, 3, false);
      if (r == 0) memcpy(acc, v, sizeof v);
      else fsdp_coll_check_fold(acc, v);
    }
    assert_false(fsdp_coll_check_agrees(acc));
  }
  uint64_t acc[FSDP_CHECK_WORDS], v[FSDP_CHECK_WORDS];
  fsdp_coll_check_init(acc, &a, 3, false);
  fsdp_coll_check_init(v, &a, 3, false); /* the same fingerprint: agrees */
  fsdp_coll_check_fold(acc, v);
  assert_true(fsdp_coll_check_agrees(acc));
  assert_int_equal(acc[FSDP_CHECK_FULL], 0);
  fsdp_coll_check_init(v, &l, 3, true); /* another label: disagrees; and a rank asks for full */
  fsdp_coll_check_fold(acc, v);
  assert_false(fsdp_coll_check_agrees(acc));
  assert_int_equal(acc[FSDP_CHECK_FULL], 1);
}

/* The full check asked by one rank only: every collective still runs right on every rank, and
 * a mismatch on the last rank is named. */
static void body_full_check(rank_ctx *x) {
  if (x->rank == x->world - 1) fsdp_comm_set_full_check(x->c, true);
  float buf[64];
  for (int i = 0; i < 16; i++) buf[i] = (float)(x->rank + i);
  note(x, fsdp_comm_all_reduce(x->c, buf, 16, FSDP_DTYPE_F32, FSDP_RED_SUM, "sum"), now_s());
  for (int i = 0; i < 16; i++) {
    float want = 0;
    for (int p = 0; p < x->world; p++) want += (float)(p + i);
    check_value(x, "all_reduce under the full check", i, buf[i], want);
  }
  note(x, fsdp_comm_barrier(x->c, "b"), now_s());
  int n = x->rank == x->world - 1 ? 8 : 16;
  note(x, fsdp_comm_all_reduce(x->c, buf, n, FSDP_DTYPE_F32, FSDP_RED_SUM, "sum"), now_s());
}

static void test_full_check(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  for (int W = 2; W <= 4; W++) {
    run_world(W, 30, body_full_check, NULL, ctx);
    assert_ranks_right(ctx, W);
    char want[160];
    snprintf(want, sizeof want,
             "collective mismatch at #3: rank 0 called all_reduce(f32 x16 sum, 'sum') but rank "
             "%d called all_reduce(f32 x8 sum, 'sum')", W - 1);
    for (int r = 0; r < W; r++) {
      assert_int_equal(ctx[r].rc[0], FSDP_OK);
      assert_int_equal(ctx[r].rc[1], FSDP_OK);
      assert_int_equal(ctx[r].rc[2], FSDP_ERR);
      assert_contains(ctx[r].msg[2], want);
    }
  }
}

/* Under the default (hash) check a mismatch on the last of 4 ranks is named as well. */
static void body_last_differs(rank_ctx *x) {
  float buf[16] = {0};
  note(x, fsdp_comm_barrier(x->c, "b"), now_s());
  note(x, fsdp_comm_broadcast(x->c, buf, 16, FSDP_DTYPE_F32, x->rank == 3 ? 1 : 0, "bc"),
       now_s());
}

static void test_last_differs(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(4, 30, body_last_differs, NULL, ctx);
  for (int r = 0; r < 4; r++) {
    assert_int_equal(ctx[r].rc[0], FSDP_OK);
    assert_int_equal(ctx[r].rc[1], FSDP_ERR);
    assert_contains(ctx[r].msg[1], "collective mismatch at #2: rank 0 called broadcast(f32 x16 "
                                   "root 0, 'bc') but rank 3 called broadcast(f32 x16 root 1, 'bc')");
  }
}

/* ---- the NCCL unique id, shared over the local backend with a stand-in for ncclGetUniqueId -- */

static int fake_id(uint8_t id[FSDP_NCCL_ID_BYTES], void *arg) {
  int seed = *(int *)arg;
  for (int i = 0; i < FSDP_NCCL_ID_BYTES; i++) id[i] = (uint8_t)(seed * 31 + i * 7);
  return FSDP_OK;
}

static int failing_id(uint8_t id[FSDP_NCCL_ID_BYTES], void *arg) {
  (void)id, (void)arg;
  return fsdp_error("ncclGetUniqueId: unhandled system error (no network interface)");
}

static void body_share_id(rank_ctx *x) {
  int seed = 100 + x->rank; /* only rank 0's may be used */
  uint8_t id[FSDP_NCCL_ID_BYTES];
  note(x, fsdp_nccl_share_id(x->c, id, fake_id, &seed), now_s());
  int zero_seed = 100;
  uint8_t want[FSDP_NCCL_ID_BYTES];
  fake_id(want, &zero_seed);
  for (int i = 0; i < FSDP_NCCL_ID_BYTES; i++) check_value(x, "unique id", i, id[i], want[i]);
  /* the bootstrap is an ordinary collective of the communicator: the next one follows it */
  note(x, fsdp_comm_barrier(x->c, "after"), now_s());
}

static void body_share_id_fails(rank_ctx *x) {
  uint8_t id[FSDP_NCCL_ID_BYTES];
  note(x, fsdp_nccl_share_id(x->c, id, failing_id, NULL), now_s());
}

static void test_nccl_share_id(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  for (int W = 1; W <= 4; W++) {
    run_world(W, 30, body_share_id, NULL, ctx);
    assert_ranks_right(ctx, W);
    for (int r = 0; r < W; r++) {
      assert_int_equal(ctx[r].rc[0], FSDP_OK);
      assert_int_equal(ctx[r].rc[1], FSDP_OK);
    }
  }
  /* rank 0 cannot make one: every rank fails with its message, at once */
  run_world(3, 30, body_share_id_fails, NULL, ctx);
  assert_contains(ctx[0].msg[0], "nccl bootstrap: ncclGetUniqueId: unhandled system error");
  for (int r = 1; r < 3; r++) {
    assert_int_equal(ctx[r].rc[0], FSDP_ERR);
    assert_contains(ctx[r].msg[0], "rank 0 failed: nccl bootstrap: ncclGetUniqueId: unhandled");
    assert_true(ctx[r].secs[0] < 5);
  }
  /* arguments */
  uint8_t id[FSDP_NCCL_ID_BYTES];
  assert_int_equal(fsdp_nccl_share_id(NULL, id, fake_id, NULL), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "no communicator");
  /* this build's backend: the stub says how to get the real one; the real one, on a machine
   * without a GPU (or without libnccl), fails with a message and poisons the bootstrap
   * communicator, so peers waiting in the bootstrap would fail too */
  fsdp_comm *c = NULL, *boot;
  if (!fsdp_nccl_available()) {
    assert_int_equal(fsdp_comm_nccl_new(&c, NULL), FSDP_ERR);
    assert_contains(fsdp_error_msg(), "built without NCCL");
  } else if (fsdp_device_count_of("cuda") == 0) {
    assert_int_equal(fsdp_comm_nccl_new(&c, NULL), FSDP_ERR);
    assert_contains(fsdp_error_msg(), "nccl backend: no bootstrap communicator");
    assert_int_equal(fsdp_comm_single_new(&boot), FSDP_OK);
    assert_int_equal(fsdp_comm_nccl_new(&c, boot), FSDP_ERR);
    assert_contains(fsdp_error_msg(), "nccl backend: ");
    assert_null(c);
    assert_true(fsdp_comm_poisoned(boot));
    fsdp_comm_free(boot);
  }
}

/* ---- abort -------------------------------------------------------------------------------------- */

static atomic_int aborted;

/* rank 0 aborts while ranks 1..W-2 are blocked in a collective; rank W-1 enters one later */
static void body_abort(rank_ctx *x) {
  float buf[16] = {0};
  const int W = x->world;
  if (x->rank == 0) {
    note(x, fsdp_comm_barrier(x->c, "start"), now_s());
    sleep_s(0.1);
    fsdp_comm_abort(x->c, "boom in forward");
    atomic_store(&aborted, 1);
    note(x, fsdp_comm_all_reduce(x->c, buf, 16, FSDP_DTYPE_F32, FSDP_RED_SUM, "grads"), now_s());
    x->secs[NOTES - 1] = fsdp_comm_poisoned(x->c);
  } else if (x->rank < W - 1) {
    note(x, fsdp_comm_barrier(x->c, "start"), now_s());
    note(x, fsdp_comm_all_reduce(x->c, buf, 16, FSDP_DTYPE_F32, FSDP_RED_SUM, "grads"), now_s());
  } else {
    note(x, fsdp_comm_barrier(x->c, "start"), now_s());
    while (!atomic_load(&aborted)) sleep_s(0.005);
    note(x, fsdp_comm_all_reduce(x->c, buf, 16, FSDP_DTYPE_F32, FSDP_RED_SUM, "grads"), now_s());
    /* a second abort does not replace the first message */
    fsdp_comm_abort(x->c, "second");
    note(x, fsdp_comm_barrier(x->c, "again"), now_s());
  }
}

static void test_abort(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  for (int W = 2; W <= MAXW; W++) {
    atomic_store(&aborted, 0);
    run_world(W, 30, body_abort, NULL, ctx);
    for (int r = 0; r < W; r++) {
      assert_int_equal(ctx[r].rc[0], FSDP_OK);
      assert_int_equal(ctx[r].rc[1], FSDP_ERR);
      assert_true(strncmp(ctx[r].msg[1], "rank 0 failed: boom in forward\nflight recorder (rank", 52) == 0);
      assert_contains(ctx[r].msg[1], "all_reduce f32 x16 'grads' failed");
      if (r > 0 && r < W - 1) assert_true(ctx[r].secs[1] < 5); /* blocked ones fail fast */
    }
    assert_true(ctx[0].secs[NOTES - 1] == 1.0);
    assert_int_equal(ctx[W - 1].rc[2], FSDP_ERR);
    assert_true(strncmp(ctx[W - 1].msg[2], "rank 0 failed: boom in forward", 30) == 0);
  }
}

/* ---- timeout and a rank that leaves ----------------------------------------------------------- */

static atomic_int reported;

static void body_timeout(rank_ctx *x) {
  float send[8] = {0}, recv[8 * MAXW];
  /* every rank has joined before the timed barrier: on a loaded machine a rank thread may
   * otherwise start after the timeout, and the report would say "never joined" */
  expect_ok(x, fsdp_comm_barrier(x->c, "start"), "start barrier");
  if (x->rank == x->world - 1) {
    /* alive but never arriving (as if stuck in compute); it enters once the others failed */
    while (atomic_load(&reported) < x->world - 1) sleep_s(0.01);
    note(x, fsdp_comm_all_gather(x->c, recv, send, 8, FSDP_DTYPE_F32, "blocks.1"), now_s());
    return;
  }
  note(x, fsdp_comm_barrier(x->c, "warmup"), now_s()); /* everyone but the last: hangs */
  note(x, fsdp_comm_all_gather(x->c, recv, send, 8, FSDP_DTYPE_F32, "blocks.1"), now_s());
  atomic_fetch_add(&reported, 1);
}

static void test_timeout(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  atomic_store(&reported, 0);
  double t0 = now_s();
  run_world(3, 0.3, body_timeout, NULL, ctx);
  assert_true(now_s() - t0 < 5);
  /* ranks 0, 1 time out in the barrier (#2); whichever timed out first names rank 2, the
   * other fails on the poison with that message */
  int timed_out = 0;
  for (int r = 0; r < 3; r++) assert_string_equal(ctx[r].wrong, "");
  for (int r = 0; r < 2; r++) {
    assert_int_equal(ctx[r].rc[0], FSDP_ERR);
    assert_true(ctx[r].secs[0] < 3);
    assert_contains(ctx[r].msg[0], "timeout after 0.3 s in barrier #2 'warmup': rank 2 has not "
                                   "arrived (sequence number it reached: rank 2 #1)");
    if (strncmp(ctx[r].msg[0], "timeout after", 13) == 0) timed_out++;
    else assert_true(strncmp(ctx[r].msg[0], "rank ", 5) == 0 && strstr(ctx[r].msg[0], " failed: timeout after"));
    assert_contains(ctx[r].msg[0], "\nflight recorder (rank");
    assert_contains(ctx[r].msg[0], "#2 barrier 'warmup' failed");
    assert_int_equal(ctx[r].rc[1], FSDP_ERR); /* later collectives fail at once */
    assert_true(ctx[r].secs[1] < 1);
  }
  assert_true(timed_out >= 1);
  /* the late rank enters afterwards and fails at once with the poison */
  assert_int_equal(ctx[2].rc[0], FSDP_ERR);
  assert_true(ctx[2].secs[0] < 1);
  assert_contains(ctx[2].msg[0], " failed: timeout after 0.3 s in barrier #2 'warmup'");
}

static void body_timeout_two_b(rank_ctx *x) {
  /* ranks 0: #1, #2; rank 1: #1 only; ranks 2, 3: #1 then stall */
  note(x, fsdp_comm_barrier(x->c, "one"), now_s());
  if (x->rank == 0) {
    note(x, fsdp_comm_barrier(x->c, "two"), now_s());
    atomic_store(&reported, 1);
  } else {
    while (!atomic_load(&reported)) sleep_s(0.01);
  }
}

static void test_timeout_lists_missing(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  atomic_store(&reported, 0);
  run_world(4, 0.3, body_timeout_two_b, NULL, ctx);
  for (int r = 0; r < 4; r++) assert_int_equal(ctx[r].rc[0], FSDP_OK);
  assert_int_equal(ctx[0].rc[1], FSDP_ERR);
  assert_contains(ctx[0].msg[1], "timeout after 0.3 s in barrier #2 'two': ranks 1, 2, 3 have not "
                                 "arrived (sequence numbers they reached: rank 1 #1, rank 2 #1, rank 3 #1)");
}

/* A rank whose communicator is freed has left: peers waiting for it fail at once. */
static void body_leave(rank_ctx *x) {
  if (x->rank == 1) {
    note(x, fsdp_comm_barrier(x->c, "one"), now_s());
    return; /* rank_main frees the communicator: rank 1 is gone */
  }
  note(x, fsdp_comm_barrier(x->c, "one"), now_s());
  note(x, fsdp_comm_barrier(x->c, "two"), now_s());
}

static void test_rank_leaves(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(3, 30, body_leave, NULL, ctx);
  for (int r = 0; r < 3; r++) assert_int_equal(ctx[r].rc[0], FSDP_OK);
  for (int r = 0; r < 3; r += 2) {
    assert_int_equal(ctx[r].rc[1], FSDP_ERR);
    assert_true(ctx[r].secs[1] < 5);
    assert_contains(ctx[r].msg[1], "rank 1 left the group (its communicator was freed) after #1");
  }
}

/* Freeing a communicator with queued collectives on a poisoned group does not hang. */
static void body_free_poisoned(rank_ctx *x) {
  x->keep = true;
  static float send[MAXW][64], recv[MAXW][64 * MAXW];
  if (x->rank == 1) {
    sleep_s(0.05);
    fsdp_comm_abort(x->c, "rank 1 gave up");
    return;
  }
  for (int k = 0; k < 3; k++) {
    fsdp_coll kc = gather_coll(recv[x->rank], send[x->rank], 64, "pending");
    fsdp_comm_req *req;
    expect_ok(x, fsdp_comm_start(x->c, &kc, &req), "start");
  }
  x->checks++;
  /* never waited: fsdp_comm_free drains them (they fail on the poison) and frees the handles */
}

static void test_free_poisoned(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  double t0 = now_s();
  run_world(2, 30, body_free_poisoned, NULL, ctx);
  assert_true(now_s() - t0 < 5);
  if (ctx[0].wrong[0]) fail_msg("%s", ctx[0].wrong);
}

/* ---- flight recorder --------------------------------------------------------------------------- */

static void body_recorder(rank_ctx *x) {
  float buf[8] = {0}, big[8 * MAXW];
  for (int i = 0; i < 70; i++) {
    char label[16];
    snprintf(label, sizeof label, "step%d", i + 1);
    if (i % 2) expect_ok(x, fsdp_comm_all_reduce(x->c, buf, 8, FSDP_DTYPE_F32, FSDP_RED_SUM, label), "ar");
    else expect_ok(x, fsdp_comm_all_gather(x->c, big, buf, 8, FSDP_DTYPE_F32, label), "ag");
  }
  x->checks++;
  char *rec = malloc(16384);
  fsdp_comm_flight_recorder(x->c, rec, 16384);
  snprintf(x->big, sizeof x->big, "%s", rec);
  /* a small buffer keeps the newest lines */
  fsdp_comm_flight_recorder(x->c, rec, 100);
  snprintf(x->msg[1], MSG, "%s", rec);
  free(rec);
}

static void test_flight_recorder(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(2, 0, body_recorder, NULL, ctx);
  assert_ranks_right(ctx, 2);
  const char *rec = ctx[1].big;
  int lines = 0;
  for (const char *p = rec; *p; p++) lines += *p == '\n';
  assert_int_equal(lines, 64);
  assert_true(strncmp(rec, "#7 all_gather f32 x8 'step7' done ", 34) == 0);
  assert_contains(rec, "\n#70 all_reduce f32 x8 'step70' done ");
  assert_contains(rec, " ms\n");
  assert_null(strstr(rec, "#6 "));
  /* truncated to 100 bytes: the newest line survives whole, the oldest ones go */
  const char *small = ctx[1].msg[1];
  assert_true(strlen(small) < 100);
  assert_contains(small, "#70 all_reduce f32 x8 'step70' done");
  assert_null(strstr(small, "#7 "));

  fsdp_comm *one;
  assert_int_equal(fsdp_comm_single_new(&one), FSDP_OK);
  char buf[128];
  assert_string_equal(fsdp_comm_flight_recorder(one, buf, sizeof buf), "(no collectives)\n");
  fsdp_comm_free(one);
}

/* States queued/running appear while a collective waits: rank 1 arrives late. */
/* Rank 1 arrives only once rank 0 has seen its recorder in that state (or after 10 s): a
 * fixed sleep was too short for the worker thread to be scheduled on a loaded machine. */
static void body_recorder_states(rank_ctx *x) {
  atomic_int *seen = x->arg;
  float send[4] = {0}, recv[8];
  if (x->rank == 1) {
    for (double t0 = now_s(); !atomic_load(seen) && now_s() - t0 < 10;) sleep_s(1e-3);
    expect_ok(x, fsdp_comm_all_gather(x->c, recv, send, 4, FSDP_DTYPE_F32, "x"), "late");
    expect_ok(x, fsdp_comm_all_gather(x->c, recv, send, 4, FSDP_DTYPE_F32, "y"), "late");
    x->checks++;
    return;
  }
  fsdp_coll k1 = gather_coll(recv, send, 4, "x");
  float recv2[8];
  fsdp_coll k2 = gather_coll(recv2, send, 4, "y");
  fsdp_comm_req *a, *b;
  expect_ok(x, fsdp_comm_start(x->c, &k1, &a), "start");
  expect_ok(x, fsdp_comm_start(x->c, &k2, &b), "start");
  for (double t0 = now_s(); now_s() - t0 < 10; sleep_s(1e-3)) {
    fsdp_comm_flight_recorder(x->c, x->msg[0], MSG);
    if (strstr(x->msg[0], "'x' running ")) break;
  }
  atomic_store(seen, 1);
  expect_ok(x, fsdp_comm_wait(a), "wait");
  expect_ok(x, fsdp_comm_wait(b), "wait");
  x->checks++;
}

static void test_recorder_states(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  atomic_int seen = 0;
  run_world(2, 0, body_recorder_states, &seen, ctx);
  assert_ranks_right(ctx, 2);
  assert_contains(ctx[0].msg[0], "#1 all_gather f32 x4 'x' running ");
  assert_contains(ctx[0].msg[0], "#2 all_gather f32 x4 'y' queued ");
}

/* ---- stats ------------------------------------------------------------------------------------- */

static void body_stats(rank_ctx *x) {
  const int W = x->world;
  float a[10 * MAXW] = {0}, b[10 * MAXW] = {0};
  fsdp_comm_reset_stats(x->c);
  expect_ok(x, fsdp_comm_all_gather(x->c, b, a, 10, FSDP_DTYPE_F32, "ag"), "ag");
  expect_ok(x, fsdp_comm_all_gather(x->c, b, a, 10, FSDP_DTYPE_F32, "ag"), "ag");
  expect_ok(x, fsdp_comm_reduce_scatter(x->c, a, b, 10, FSDP_DTYPE_F32, FSDP_RED_AVG, "rs"), "rs");
  expect_ok(x, fsdp_comm_all_reduce(x->c, a, 7, FSDP_DTYPE_F32, FSDP_RED_SUM, "ar"), "ar");
  expect_ok(x, fsdp_comm_broadcast(x->c, a, 3, FSDP_DTYPE_F32, 0, "bc"), "bc");
  expect_ok(x, fsdp_comm_barrier(x->c, "b"), "b");
  fsdp_comm_stats s;
  fsdp_comm_get_stats(x->c, &s);
  x->checks++;
  int64_t want_calls[FSDP_COLL_COUNT] = {2, 1, 1, 1, 1};
  int64_t want_bytes[FSDP_COLL_COUNT] = {2 * 40 * W, 40 * W, 28, 12, 0};
  for (int op = 0; op < FSDP_COLL_COUNT; op++) {
    if (s.calls[op] != want_calls[op] || s.bytes[op] != want_bytes[op])
      snprintf(x->wrong, sizeof x->wrong, "rank %d %s: %lld calls %lld bytes", x->rank,
               fsdp_coll_name(op), (long long)s.calls[op], (long long)s.bytes[op]);
  }
  if (!(s.busy_s > 0) || !(s.wait_s >= s.busy_s * 0.5))
    snprintf(x->wrong, sizeof x->wrong, "rank %d: busy %g wait %g", x->rank, s.busy_s, s.wait_s);
  fsdp_comm_reset_stats(x->c);
  fsdp_comm_get_stats(x->c, &s);
  if (s.calls[0] || s.bytes[0] || s.busy_s || s.wait_s)
    snprintf(x->wrong, sizeof x->wrong, "rank %d: reset left counts", x->rank);
}

static void test_stats(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  for (int W = 1; W <= 3; W += 2) {
    run_world(W, 0, body_stats, NULL, ctx);
    assert_ranks_right(ctx, W);
  }
}

/* ---- world of one, current communicator, environment ----------------------------------------------- */

static void test_world_of_one(void **state) {
  (void)state;
  fsdp_comm *c;
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
  assert_int_equal(fsdp_comm_rank(c), 0);
  assert_int_equal(fsdp_comm_world(c), 1);
  assert_string_equal(fsdp_comm_backend(c), "local");
  float send[5] = {1, 2, 3, 4, 5}, recv[5] = {0}, buf[5] = {1.5f, -2, 3, 4, 5};
  assert_int_equal(fsdp_comm_all_gather(c, recv, send, 5, FSDP_DTYPE_F32, "ag"), FSDP_OK);
  assert_memory_equal(recv, send, sizeof send);
  memset(recv, 0, sizeof recv);
  assert_int_equal(fsdp_comm_reduce_scatter(c, recv, send, 5, FSDP_DTYPE_F32, FSDP_RED_AVG, "rs"), FSDP_OK);
  assert_memory_equal(recv, send, sizeof send);
  assert_int_equal(fsdp_comm_all_reduce(c, buf, 5, FSDP_DTYPE_F32, FSDP_RED_AVG, "ar"), FSDP_OK);
  assert_true(buf[0] == 1.5f && buf[1] == -2.0f);
  assert_int_equal(fsdp_comm_broadcast(c, buf, 5, FSDP_DTYPE_F32, 0, "bc"), FSDP_OK);
  assert_int_equal(fsdp_comm_barrier(c, NULL), FSDP_OK);
  assert_int_equal(fsdp_comm_all_gather(c, NULL, NULL, 0, FSDP_DTYPE_F32, "empty"), FSDP_OK);
  /* async completes at start; still a handle to wait on */
  fsdp_coll k = gather_coll(recv, send, 5, "async");
  fsdp_comm_req *req = NULL;
  assert_int_equal(fsdp_comm_start(c, &k, &req), FSDP_OK);
  assert_non_null(req);
  assert_int_equal(fsdp_comm_wait(req), FSDP_OK);
  fsdp_comm_stats s;
  fsdp_comm_get_stats(c, &s);
  assert_int_equal(s.calls[FSDP_COLL_ALL_GATHER], 3);
  assert_int_equal(s.bytes[FSDP_COLL_ALL_GATHER], 40);
  assert_int_equal(s.bytes[FSDP_COLL_REDUCE_SCATTER], 20);
  assert_int_equal(s.calls[FSDP_COLL_BARRIER], 1);
  char rec[4096];
  fsdp_comm_flight_recorder(c, rec, sizeof rec);
  assert_contains(rec, "#1 all_gather f32 x5 'ag' done");
  assert_contains(rec, "#5 barrier '' done");
  assert_contains(rec, "#7 all_gather f32 x5 'async' done");
  /* abort poisons a world of one too */
  assert_false(fsdp_comm_poisoned(c));
  fsdp_comm_abort(c, "oops");
  assert_true(fsdp_comm_poisoned(c));
  assert_int_equal(fsdp_comm_barrier(c, "x"), FSDP_ERR);
  assert_true(strncmp(fsdp_error_msg(), "rank 0 failed: oops\nflight recorder (rank 0, newest last):\n", 58) == 0);
  assert_contains(fsdp_error_msg(), "#8 barrier 'x' failed");
  fsdp_comm_free(c);
  fsdp_comm_free(NULL);
}

static void *thread_current(void *arg) {
  fsdp_comm **out = arg;
  out[0] = fsdp_comm_current();
  out[1] = fsdp_comm_current();
  float x = 2;
  if (fsdp_comm_all_reduce(out[0], &x, 1, FSDP_DTYPE_F32, FSDP_RED_SUM, "x") != FSDP_OK || x != 2) out[1] = NULL;
  return NULL; /* the lazily made world of one is freed at thread exit (valgrind checks) */
}

static void test_current(void **state) {
  (void)state;
  fsdp_comm *mine = fsdp_comm_current();
  assert_non_null(mine);
  assert_ptr_equal(fsdp_comm_current(), mine);
  assert_int_equal(fsdp_comm_world(mine), 1);
  fsdp_comm *seen[2];
  pthread_t th;
  pthread_create(&th, NULL, thread_current, seen);
  pthread_join(th, NULL);
  assert_non_null(seen[0]);
  assert_ptr_equal(seen[0], seen[1]);
  assert_ptr_not_equal(seen[0], mine);
  /* set/unset; freeing the current one unsets it */
  fsdp_comm *c;
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
  fsdp_comm_set_current(c);
  assert_ptr_equal(fsdp_comm_current(), c);
  fsdp_comm_free(c);
  assert_ptr_equal(fsdp_comm_current(), mine);
  fsdp_comm_set_current(NULL);
  assert_ptr_equal(fsdp_comm_current(), mine);
}

static void test_env(void **state) {
  (void)state;
  fsdp_comm *c;
  setenv("FSDP_TIMEOUT", "2.5", 1);
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
  assert_true(fsdp_comm_timeout(c) == 2.5);
  fsdp_comm_set_timeout(c, 7);
  assert_true(fsdp_comm_timeout(c) == 7);
  fsdp_comm_set_timeout(c, 0); /* back to the default, which is FSDP_TIMEOUT's */
  assert_true(fsdp_comm_timeout(c) == 2.5);
  fsdp_comm_free(c);
  setenv("FSDP_TIMEOUT", "soon", 1);
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "FSDP_TIMEOUT");
  assert_contains(fsdp_error_msg(), "'soon'");
  fsdp_local_group *g;
  assert_int_equal(fsdp_local_group_new(&g, 2), FSDP_OK);
  assert_int_equal(fsdp_comm_local_new(&c, g, 0), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "FSDP_TIMEOUT");
  unsetenv("FSDP_TIMEOUT");
  setenv("FSDP_COMM_CHECK", "always", 1);
  assert_int_equal(fsdp_comm_local_new(&c, g, 0), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "FSDP_COMM_CHECK: expected 'hash' or 'full', got 'always'");
  setenv("FSDP_COMM_CHECK", "full", 1);
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
  fsdp_comm_free(c);
  unsetenv("FSDP_COMM_CHECK");
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
  assert_true(fsdp_comm_timeout(c) == 60);
  fsdp_comm_free(c);
  /* group errors: rank range, a rank twice, world range */
  assert_int_equal(fsdp_comm_local_new(&c, g, 2), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "rank 2 out of range for world 2");
  fsdp_comm *c0;
  assert_int_equal(fsdp_comm_local_new(&c0, g, 0), FSDP_OK); /* the failed attempt did not take it */
  assert_int_equal(fsdp_comm_local_new(&c, g, 0), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "rank 0 already has a communicator");
  fsdp_comm_free(c0);
  fsdp_local_group_release(g);
  fsdp_local_group *bad;
  assert_int_equal(fsdp_local_group_new(&bad, 0), FSDP_ERR);
  fsdp_local_group_release(NULL);
}

/* Invalid arguments fail on the caller and poison the group so the peers do not wait. */
static void body_invalid(rank_ctx *x) {
  float buf[64] = {0};
  if (x->rank == 0) {
    note(x, fsdp_comm_all_gather(x->c, buf, buf + 3, 8, FSDP_DTYPE_F32, "overlap"), now_s());
  } else {
    note(x, fsdp_comm_all_gather(x->c, buf, buf + 32, 8, FSDP_DTYPE_F32, "overlap"), now_s());
  }
}

static void test_invalid(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(2, 30, body_invalid, NULL, ctx);
  assert_invalid_poisons(ctx, "all_gather(f32 x8, 'overlap'): send overlaps recv");

  fsdp_comm *c;
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
  float b[4];
  assert_int_equal(fsdp_comm_broadcast(c, b, 4, FSDP_DTYPE_F32, 1, "r"), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "root 1 out of range for world 1");
  fsdp_comm_free(c);
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
  assert_int_equal(fsdp_comm_all_reduce(c, NULL, 4, FSDP_DTYPE_F32, FSDP_RED_SUM, "n"), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "NULL buffer");
  fsdp_comm_free(c);
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
  assert_int_equal(fsdp_comm_all_reduce(c, b, -1, FSDP_DTYPE_F32, FSDP_RED_SUM, "n"), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "negative count");
  fsdp_comm_free(c);
  assert_int_equal(fsdp_comm_wait(NULL), FSDP_ERR);
}

/* ---- the generic layer over a backend with native async slots ----------------------------- */

typedef struct native_log {
  int started[16], waited[16], nstart, nwait;
} native_log;

static int native_run(fsdp_comm *c, const fsdp_coll *k, uint64_t seq) {
  (void)c; (void)k; (void)seq;
  return fsdp_error("native backend: run must not be called");
}

static int native_start(fsdp_comm *c, const fsdp_coll *k, uint64_t seq, void **h) {
  native_log *log = fsdp_comm_impl(c);
  log->started[log->nstart++] = (int)seq;
  *h = (void *)(uintptr_t)seq;
  if (k->count > 0 && k->op == FSDP_COLL_ALL_GATHER) memcpy(k->recv, k->send, sizeof(float) * (size_t)k->count);
  return FSDP_OK;
}

static int native_wait(fsdp_comm *c, void *h) {
  native_log *log = fsdp_comm_impl(c);
  log->waited[log->nwait++] = (int)(uintptr_t)h;
  if ((uintptr_t)h == 3) return fsdp_error("native collective 3 broke");
  return FSDP_OK;
}

static void native_free(fsdp_comm *c) { (void)c; /* the test owns the log */ }

static const fsdp_comm_i native_vt = {.name = "native", .run = native_run, .host_buffers = true, .start = native_start,
                                       .wait = native_wait, .free = native_free};

static void test_native_backend(void **state) {
  (void)state;
  native_log *log = calloc(1, sizeof *log);
  fsdp_comm *c;
  assert_int_equal(fsdp_comm_new_backend(&c, &native_vt, log, 0, 1), FSDP_OK);
  assert_string_equal(fsdp_comm_backend(c), "native");
  float s[3] = {1, 2, 3}, r[3];
  fsdp_coll k = gather_coll(r, s, 3, "n");
  fsdp_comm_req *q[4];
  for (int i = 0; i < 4; i++) assert_int_equal(fsdp_comm_start(c, &k, &q[i]), FSDP_OK);
  assert_int_equal(log->nstart, 4); /* started at issue, in order */
  assert_int_equal(log->started[3], 4);
  assert_int_equal(fsdp_comm_wait(q[1]), FSDP_OK);
  assert_int_equal(fsdp_comm_wait(q[2]), FSDP_ERR);
  assert_true(strncmp(fsdp_error_msg(), "native collective 3 broke\nflight recorder (rank 0", 49) == 0);
  assert_contains(fsdp_error_msg(), "#3 all_gather f32 x3 'n' failed");
  assert_contains(fsdp_error_msg(), "#1 all_gather f32 x3 'n' running");
  assert_int_equal(fsdp_comm_wait(q[0]), FSDP_OK);
  assert_memory_equal(r, s, sizeof s);
  /* q[3] never waited: free finishes it */
  fsdp_comm_free(c);
  assert_int_equal(log->nwait, 4);
  assert_int_equal(log->waited[3], 4);
  /* a backend that moves host memory only refuses buffers of a device without host memory,
   * naming the device and the backend, before anything is issued */
  static fsdp_device_i gpu = {.name = "gpu", .has_data = true};
  memset(log, 0, sizeof *log);
  assert_int_equal(fsdp_comm_new_backend(&c, &native_vt, log, 0, 1), FSDP_OK);
  k.device = &gpu;
  assert_int_equal(fsdp_comm_start(c, &k, &q[0]), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "all_gather(f32 x3, 'n') on gpu: the buffers are on the gpu "
                                    "device, but the native backend moves host memory only (move "
                                    "them to the cpu)");
  assert_int_equal(log->nstart, 0);
  fsdp_comm_free(c);
  free(log);
}

/* A device collective the device cannot serve is refused before anything is issued, naming
 * the device (and poisons the group, as any invalid collective): one without data (shapes
 * only), one without a reduce_ranks kernel. */
static int dev_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  (void)ctx;
  memmove(dst, src, bytes);
  return FSDP_OK;
}

static void test_device_refusals(void **state) {
  (void)state;
  fsdp_local_group *g;
  fsdp_comm *c;
  fsdp_comm_req *q = NULL;
  assert_int_equal(fsdp_local_group_new(&g, 1), FSDP_OK);
  assert_int_equal(fsdp_comm_local_new(&c, g, 0), FSDP_OK);
  fsdp_local_group_release(g);
  float buf[2] = {1, 2};
  static fsdp_device_i shapes = {.name = "shapes"};
  static fsdp_device_i nored = {.name = "nored", .has_data = true, .copy = dev_copy};
  fsdp_coll k = {.op = FSDP_COLL_ALL_REDUCE, .dtype = FSDP_DTYPE_F32, .red = FSDP_RED_SUM,
                 .count = 2, .recv = buf, .label = "d", .device = &shapes};
  assert_int_equal(fsdp_comm_start(c, &k, &q), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "the shapes device has no data to move");
  k.device = &nored;
  assert_int_equal(fsdp_comm_start(c, &k, &q), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "the nored device has no reduce_ranks kernel");
  /* the peers would wait for this rank: a refusal poisons the group */
  assert_true(fsdp_comm_poisoned(c));
  fsdp_comm_free(c);
}

/* set_refuse: collectives fail at once on this rank, take no sequence number, count nothing,
 * poison nothing; lifting it restores them. */
static void test_refuse(void **state) {
  (void)state;
  fsdp_comm *c;
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
  fsdp_comm_set_refuse(c, "collectives are off in :rank mode");
  assert_int_equal(fsdp_comm_barrier(c, "probe"), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "barrier 'probe': collectives are off in :rank mode"));
  fsdp_comm_stats st;
  fsdp_comm_get_stats(c, &st);
  assert_int_equal(st.calls[FSDP_COLL_BARRIER], 0);
  assert_false(fsdp_comm_poisoned(c));
  fsdp_comm_set_refuse(c, NULL);
  assert_int_equal(fsdp_comm_barrier(c, "probe"), FSDP_OK);
  fsdp_comm_get_stats(c, &st);
  assert_int_equal(st.calls[FSDP_COLL_BARRIER], 1);
  fsdp_comm_free(c);
}

/* ---- reviving a poisoned group (fsdprun's post-mortem) ------------------------------------------ */

typedef struct revive_arg {
  pthread_barrier_t meet; /* what the post-mortem's own channel does between the steps */
  uint64_t seq[2];
} revive_arg;

/* Rank 0 aborts at #2, rank 1 fails there; both drain, agree on the larger number, revive, and
 * a collective runs again with the right sum; reviving below a rank's number is refused. */
static void body_revive(rank_ctx *x) {
  revive_arg *a = x->arg;
  double one = 1;
  note(x, fsdp_comm_all_reduce(x->c, &one, 1, FSDP_DTYPE_F64, FSDP_RED_SUM, "a"), now_s());
  if (x->rank == 0) fsdp_comm_abort(x->c, "broke");
  else note(x, fsdp_comm_barrier(x->c, "b"), now_s());
  pthread_barrier_wait(&a->meet);
  a->seq[x->rank] = fsdp_comm_drain(x->c);
  pthread_barrier_wait(&a->meet);
  uint64_t seq = a->seq[0] > a->seq[1] ? a->seq[0] : a->seq[1];
  if (x->rank == 1) note(x, fsdp_comm_revive(x->c, seq - 1), now_s());
  note(x, fsdp_comm_revive(x->c, seq), now_s());
  pthread_barrier_wait(&a->meet);
  x->secs[NOTES - 1] = fsdp_comm_poisoned(x->c);
  double v = x->rank + 1;
  note(x, fsdp_comm_all_reduce(x->c, &v, 1, FSDP_DTYPE_F64, FSDP_RED_SUM, "after"), now_s());
  x->secs[NOTES - 2] = v;
  fsdp_comm_flight_recorder(x->c, x->big, sizeof x->big);
}

/* body on 2 ranks that meet through a->meet besides their communicators */
static void run_revive(rank_body body, revive_arg *a, rank_ctx *ctx) {
  pthread_barrier_init(&a->meet, NULL, 2);
  run_world(2, 30, body, a, ctx);
  pthread_barrier_destroy(&a->meet);
}

static void test_revive(void **state) {
  (void)state;
  revive_arg a = {0};
  rank_ctx ctx[MAXW];
  run_revive(body_revive, &a, ctx);
  assert_int_equal(a.seq[0], 1); /* rank 0 never issued #2 */
  assert_int_equal(a.seq[1], 2);
  assert_int_equal(ctx[1].rc[1], FSDP_ERR); /* its #2 failed on the poison */
  assert_contains(ctx[1].msg[1], "rank 0 failed: broke");
  assert_int_equal(ctx[1].rc[2], FSDP_ERR);
  assert_contains(ctx[1].msg[2], "cannot revive the communicator at #1: rank 1 issued #2 already");
  for (int r = 0; r < 2; r++) {
    int k = r == 0 ? 1 : 3; /* the revive's note */
    assert_int_equal(ctx[r].rc[k], FSDP_OK);
    assert_true(ctx[r].secs[NOTES - 1] == 0); /* not poisoned */
    assert_int_equal(ctx[r].rc[k + 1], FSDP_OK);
    assert_true(ctx[r].secs[NOTES - 2] == 3); /* 1 + 2: the collective after the revive ran */
  }
  /* rank 0 skipped #2: its recorder says so rather than showing an older entry */
  assert_contains(ctx[0].big, "#2 barrier '(skipped: revived)' failed");
  assert_contains(ctx[0].big, "#3 all_reduce f64 x1 'after' done");
}

/* A group that a rank has left cannot be revived; a backend without a revive slot refuses. */
static void body_revive_left(rank_ctx *x) {
  revive_arg *a = x->arg;
  if (x->rank == 1) {
    fsdp_comm_free(x->c);
    x->c = NULL;
    x->keep = true; /* freed here */
    pthread_barrier_wait(&a->meet);
    return;
  }
  fsdp_comm_abort(x->c, "broke");
  pthread_barrier_wait(&a->meet);
  note(x, fsdp_comm_revive(x->c, fsdp_comm_drain(x->c)), now_s());
  x->secs[NOTES - 1] = fsdp_comm_poisoned(x->c);
}

static void nop_abort(fsdp_comm *c, const char *msg) { (void)c, (void)msg; }
static bool never_poisoned(const fsdp_comm *c) { (void)c; return false; }

static void test_revive_refused(void **state) {
  (void)state;
  revive_arg a = {0};
  rank_ctx ctx[MAXW];
  run_revive(body_revive_left, &a, ctx);
  assert_int_equal(ctx[0].rc[0], FSDP_ERR);
  assert_contains(ctx[0].msg[0], "cannot revive the group: a rank has left it");
  assert_true(ctx[0].secs[NOTES - 1] != 0); /* still poisoned */
  static const fsdp_comm_i stubborn_vt = {.name = "stubborn", .run = native_run,
                                          .host_buffers = true, .abort = nop_abort,
                                          .poisoned = never_poisoned};
  native_log *log = calloc(1, sizeof *log);
  fsdp_comm *c;
  assert_int_equal(fsdp_comm_new_backend(&c, &stubborn_vt, log, 0, 1), FSDP_OK);
  assert_int_equal(fsdp_comm_revive(c, 0), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "the stubborn backend cannot lift the poison of its group");
  fsdp_comm_free(c);
  free(log);
}

/* ---- sub-communicators ------------------------------------------------------------------------ */

/* hybrid(S) on W = 4: values within each group, ranks, per-communicator stats, a custom split */
static void body_split(rank_ctx *x) {
  const int W = x->world, r = x->rank;
  for (int S = 1; S <= W; S *= 2) {
    fsdp_comm *sh, *rep, *sh2, *rep2;
    expect_ok(x, fsdp_comm_hybrid(x->c, S, &sh, &rep), "hybrid");
    if (x->wrong[0]) return;
    /* the pair is kept: asking again issues nothing and gives the same pair */
    fsdp_comm_stats before, after;
    fsdp_comm_get_stats(x->c, &before);
    expect_ok(x, fsdp_comm_hybrid(x->c, S, &sh2, &rep2), "hybrid again");
    fsdp_comm_get_stats(x->c, &after);
    check_value(x, "same pair", 0, (float)(sh2 == sh && rep2 == rep), 1.0f);
    check_value(x, "nothing issued", 0, (float)(after.calls[FSDP_COLL_ALL_GATHER] -
                                                before.calls[FSDP_COLL_ALL_GATHER]), 0.0f);
    check_value(x, "shard world", S, (float)fsdp_comm_world(sh), (float)S);
    check_value(x, "shard rank", S, (float)fsdp_comm_rank(sh), (float)(r % S));
    check_value(x, "replicate world", S, (float)fsdp_comm_world(rep), (float)(W / S));
    check_value(x, "replicate rank", S, (float)fsdp_comm_rank(rep), (float)(r / S));
    check_value(x, "parent", S, (float)(fsdp_comm_parent(sh) == x->c), 1.0f);
    /* a sum within each group: the group's ranks' inputs, in group-rank order */
    float a[7], b[7];
    for (int i = 0; i < 7; i++) a[i] = b[i] = input(r, i, 500 + S);
    expect_ok(x, fsdp_comm_all_reduce(sh, a, 7, FSDP_DTYPE_F32, FSDP_RED_SUM, "in group"), "shard all_reduce");
    expect_ok(x, fsdp_comm_all_reduce(rep, b, 7, FSDP_DTYPE_F32, FSDP_RED_SUM, "across"), "replicate all_reduce");
    for (int i = 0; i < 7; i++) {
      float ws = input(r - r % S, i, 500 + S), wr = input(r % S, i, 500 + S);
      for (int k = 1; k < S; k++) ws += input(r - r % S + k, i, 500 + S);
      for (int k = 1; k < W / S; k++) wr += input(r % S + k * S, i, 500 + S);
      check_value(x, "shard sum", i, a[i], ws);
      check_value(x, "replicate sum", i, b[i], wr);
    }
    /* an all_gather in the group: the group's ranks, in order; counted in the group's stats */
    float mine[3], all[3 * MAXW];
    for (int i = 0; i < 3; i++) mine[i] = (float)(100 * r + i);
    fsdp_comm_reset_stats(sh);
    expect_ok(x, fsdp_comm_all_gather(sh, all, mine, 3, FSDP_DTYPE_F32, "gather"), "shard all_gather");
    for (int p = 0; p < S; p++)
      for (int i = 0; i < 3; i++)
        check_value(x, "shard all_gather", 3 * p + i, all[3 * p + i], (float)(100 * (r - r % S + p) + i));
    fsdp_comm_stats st;
    fsdp_comm_get_stats(sh, &st);
    check_value(x, "group bytes", 0, (float)st.bytes[FSDP_COLL_ALL_GATHER], (float)(3 * 4 * S));
    check_value(x, "group calls", 0, (float)st.calls[FSDP_COLL_ALL_GATHER], 1.0f);
  }
  /* fsdp_comm_split: odd and even ranks, reversed by key */
  fsdp_comm *sub;
  expect_ok(x, fsdp_comm_split(x->c, r % 2, -r, &sub), "split");
  if (x->wrong[0]) return;
  int n = (W - r % 2 + 1) / 2; /* ranks of my parity */
  check_value(x, "split world", 0, (float)fsdp_comm_world(sub), (float)n);
  check_value(x, "split rank", 0, (float)fsdp_comm_rank(sub), (float)(n - 1 - r / 2));
  double v = r;
  expect_ok(x, fsdp_comm_broadcast(sub, &v, 1, FSDP_DTYPE_F64, 0, "top"), "split broadcast");
  int top = r % 2 + 2 * (n - 1); /* the largest rank of my parity is rank 0 of sub */
  check_value(x, "split broadcast", 0, (float)v, (float)top);
  fsdp_comm_free(sub); /* before the parent: it leaves the parent's list */
}

static void test_split(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(4, 30, body_split, NULL, ctx);
  assert_ranks_right(ctx, 4);
}

/* A shard_size that does not divide the world, or a negative color: the same error on every
 * rank; the first before anything is issued. */
static void body_split_refused(rank_ctx *x) {
  fsdp_comm *sh, *rep, *sub;
  note(x, fsdp_comm_hybrid(x->c, 3, &sh, &rep), now_s());
  fsdp_comm_stats st;
  fsdp_comm_get_stats(x->c, &st);
  x->secs[NOTES - 1] = (double)st.calls[FSDP_COLL_ALL_GATHER];
  note(x, fsdp_comm_split(x->c, x->rank == 2 ? -1 : 0, 0, &sub), now_s());
  x->checks++;
}

static void test_split_refused(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(4, 30, body_split_refused, NULL, ctx);
  for (int r = 0; r < 4; r++) {
    assert_int_equal(ctx[r].rc[0], FSDP_ERR);
    assert_contains(ctx[r].msg[0], "hybrid sharding: shard_size 3 does not divide the world of 4 ranks");
    assert_true(ctx[r].secs[NOTES - 1] == 0);
    assert_int_equal(ctx[r].rc[1], FSDP_ERR);
    assert_contains(ctx[r].msg[1], "comm split: rank 2 passed color -1 (colors are >= 0)");
  }
  /* a world of one splits into a world of one; a backend without split refuses */
  fsdp_comm *c, *sh, *rep;
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
  assert_int_equal(fsdp_comm_hybrid(c, 1, &sh, &rep), FSDP_OK);
  assert_int_equal(fsdp_comm_world(sh), 1);
  assert_int_equal(fsdp_comm_world(rep), 1);
  assert_int_equal(fsdp_comm_hybrid_last(c, &sh, &rep), 1);
  fsdp_comm_free(c); /* frees the pair too (memcheck) */
  static const fsdp_comm_i nosplit_vt = {.name = "nosplit", .run = native_run,
                                         .host_buffers = true};
  native_log *log = calloc(1, sizeof *log);
  assert_int_equal(fsdp_comm_new_backend(&c, &nosplit_vt, log, 0, 1), FSDP_OK);
  assert_int_equal(fsdp_comm_hybrid(c, 1, &sh, &rep), FSDP_ERR);
  assert_contains(fsdp_error_msg(), "comm split: the nosplit backend has no sub-communicators yet");
  assert_int_equal(fsdp_comm_hybrid_last(c, &sh, &rep), 0);
  fsdp_comm_free(c);
  free(log);
}

/* An error on one rank of one group fails the collectives of every group: rank 0 aborts its
 * shard group; rank 3 waits in the other shard group for rank 2, which is alive but never comes
 * (as if waiting for rank 0 elsewhere): rank 3 fails at once, not at the timeout. */
static void body_split_failure(rank_ctx *x) {
  fsdp_comm *sh, *rep;
  expect_ok(x, fsdp_comm_hybrid(x->c, 2, &sh, &rep), "hybrid");
  x->checks++;
  if (x->wrong[0]) return;
  expect_ok(x, fsdp_comm_barrier(x->c, "start"), "start");
  double t0 = now_s();
  if (x->rank == 0) {
    fsdp_comm_abort(sh, "boom in group 0");
    note(x, fsdp_comm_barrier(sh, "after"), t0);
  } else if (x->rank == 2) {
    while (!fsdp_comm_poisoned(rep) && now_s() - t0 < 20) sleep_s(0.005);
    note(x, fsdp_comm_barrier(sh, "after"), t0);
  } else {
    note(x, fsdp_comm_barrier(sh, "after"), t0);
  }
  note(x, fsdp_comm_barrier(x->c, "world"), t0);
  x->secs[NOTES - 1] = fsdp_comm_revive(x->c, fsdp_comm_drain(x->c));
  snprintf(x->big, sizeof x->big, "%s", fsdp_error_msg());
}

static void test_split_failure(void **state) {
  (void)state;
  rank_ctx ctx[MAXW];
  run_world(4, 30, body_split_failure, NULL, ctx);
  for (int r = 0; r < 4; r++) {
    if (ctx[r].wrong[0]) fail_msg("%s", ctx[r].wrong);
    for (int k = 0; k < 2; k++) {
      assert_int_equal(ctx[r].rc[k], FSDP_ERR);
      assert_true(strncmp(ctx[r].msg[k], "rank 0 failed: boom in group 0", 30) == 0);
    }
    assert_true(ctx[r].secs[0] < 10);
    assert_true(ctx[r].secs[NOTES - 1] == FSDP_ERR);
    assert_contains(ctx[r].big, "cannot revive the communicator: it belongs to a family with sub-communicators");
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_revive),
      cmocka_unit_test(test_split),
      cmocka_unit_test(test_split_refused),
      cmocka_unit_test(test_split_failure),
      cmocka_unit_test(test_revive_refused),
      cmocka_unit_test(test_world_of_one),
      cmocka_unit_test(test_values),
      cmocka_unit_test(test_nan),
      cmocka_unit_test(test_typed_values),
      cmocka_unit_test(test_bf16_rounds_once),
      cmocka_unit_test(test_typed_invalid),
      cmocka_unit_test(test_bytes_reduction_poisons),
      cmocka_unit_test(test_typed_accounting),
      cmocka_unit_test(test_bitwise_reproducible),
      cmocka_unit_test(test_async),
      cmocka_unit_test(test_async_overlap),
      cmocka_unit_test(test_mismatch_op),
      cmocka_unit_test(test_mismatch_count),
      cmocka_unit_test(test_mismatch_label),
      cmocka_unit_test(test_label_first_use),
      cmocka_unit_test(test_check_hash),
      cmocka_unit_test(test_full_check),
      cmocka_unit_test(test_last_differs),
      cmocka_unit_test(test_nccl_share_id),
      cmocka_unit_test(test_abort),
      cmocka_unit_test(test_timeout),
      cmocka_unit_test(test_timeout_lists_missing),
      cmocka_unit_test(test_rank_leaves),
      cmocka_unit_test(test_free_poisoned),
      cmocka_unit_test(test_flight_recorder),
      cmocka_unit_test(test_recorder_states),
      cmocka_unit_test(test_stats),
      cmocka_unit_test(test_current),
      cmocka_unit_test(test_env),
      cmocka_unit_test(test_invalid),
      cmocka_unit_test(test_native_backend),
      cmocka_unit_test(test_device_refusals),
      cmocka_unit_test(test_refuse),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
