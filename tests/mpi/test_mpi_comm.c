/*
 * test_mpi_comm.c — the mpi backend (src/comm/mpi.c) under mpirun, against the same serial
 * reference as test_comm.c uses for the local backend. Run by tests/recipes/mpi_comm.sh:
 *   mpirun -np W test_mpi_comm        (W = 1..4; FSDP_MPI_* variables select variants)
 *
 * Not cmocka: the ranks are processes, and a failed check on one of them must end all of them
 * at once rather than leave the others blocked in the next collective. CHECK prints
 * "[rank R] FAIL file:line: ..." and calls MPI_Abort; the program prints "ok: <test>" per test
 * on rank 0 and exits 0.
 *
 * What it checks: every collective at counts 0..10007 with every reduction, bit for bit against
 * the left-to-right fold in rank order (the local backend's arithmetic), in place and not, every
 * broadcast root; every collective in every dtype against tests/c/typed_ref.h (the reference
 * test_comm.c holds the local backend to, so both give the same bits), NaN through max/min, several asynchronous collectives waited out of order,
 * that an asynchronous all_gather advances while the caller computes without calling MPI,
 * fingerprint mismatches (op, count, label on its first use and on a later one) failing on every
 * rank with the same message, abort, a timeout naming the missing rank, a rank that left,
 * the stats and the flight recorder. Each failure case uses a communicator of its own (a failed
 * one is never used again); a separate healthy one keeps the ranks in step between cases.
 * FSDP_TEST_ONLY=stall runs one case alone (mpi_comm.sh runs it with Open MPI's single-copy
 * transfers off): a rank stopped (SIGSTOP) in the middle of an all_gather's data phase, which
 * its peers' timeout names. FSDP_TEST_ONLY=stall_sends: a rank stopped in an all_reduce's and a
 * reduce_scatter's data phase once its peers hold all its data, so that they wait on sends
 * alone, and name it (this program wraps MPI_Isend and MPI_Irecv to stop it there).
 */
#include <math.h>
#include <mpi.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm.h"
#include "comm/mpi.h"
#include "comm/nccl.h"
#include "../c/typed_ref.h"

static int g_rank = -1, g_world = 0;
static fsdp_comm *g_sync; /* stays healthy: keeps the ranks in step between cases */

#define CHECK(cond, ...)                                                                         \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      fprintf(stderr, "[rank %d] FAIL %s:%d: %s: ", g_rank, __FILE__, __LINE__, #cond);          \
      fprintf(stderr, __VA_ARGS__);                                                              \
      fprintf(stderr, "\n");                                                                     \
      fflush(stderr);                                                                            \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                              \
    }                                                                                            \
  } while (0)

#define OK(call) CHECK((call) == FSDP_OK, "%s", fsdp_error_msg())

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sync_all(const char *what) { OK(fsdp_comm_barrier(g_sync, what)); }

static void passed(const char *what) {
  sync_all(what);
  if (g_rank == 0) {
    printf("ok: %s (world %d)\n", what, g_world);
    fflush(stdout);
  }
}

/* Rank p's input element i of a collective `tag`: varied signs and magnitudes (so that the order
 * of float additions shows in the last bits), the same on every rank. */
static float input(int tag, int p, int64_t i) {
  uint32_t h = (uint32_t)(tag * 2654435761u) ^ (uint32_t)(p * 40503u) ^ (uint32_t)(i * 2246822519u);
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  float m = (float)(h % 100000u) / 997.0f - 50.0f;
  return (h & 0x100000u) ? m * 1e-3f : m;
}

/* The serial reference: ((x0 + x1) + x2) ... in float, * (float)(1.0 / W) for avg; max/min
 * with NaN propagating. */
static float fold(int tag, int64_t i, int W, fsdp_reduce_op red, int64_t offset_of_rank_elem) {
  (void)offset_of_rank_elem;
  float s = input(tag, 0, i);
  for (int p = 1; p < W; p++) {
    float x = input(tag, p, i);
    switch (red) {
    case FSDP_RED_MAX: s = (x > s || x != x) ? x : s; break;
    case FSDP_RED_MIN: s = (x < s || x != x) ? x : s; break;
    default: s = s + x; break;
    }
  }
  if (red == FSDP_RED_AVG) s = s * (float)(1.0 / W);
  return s;
}

static bool same_bits(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

static const int64_t counts[] = {0, 1, 5, 17, 100, 2049, 4099, 10007};
#define NCOUNTS (sizeof counts / sizeof counts[0])

static void test_collectives(fsdp_comm *c) {
  const int W = g_world, r = g_rank;
  int tag = 1;
  for (size_t ci = 0; ci < NCOUNTS; ci++) {
    const int64_t n = counts[ci];
    float *send = malloc((size_t)(n * W + 1) * sizeof(float));
    float *recv = malloc((size_t)(n * W + 1) * sizeof(float));
    CHECK(send && recv, "out of memory");
    /* all_gather, separate buffers and in place */
    for (int in_place = 0; in_place < 2; in_place++, tag++) {
      for (int64_t i = 0; i < n * W; i++) recv[i] = -1.0f;
      float *src = in_place ? recv + (int64_t)r * n : send;
      for (int64_t i = 0; i < n; i++) src[i] = input(tag, r, i);
      OK(fsdp_comm_all_gather(c, recv, src, n, FSDP_DTYPE_F32, "ag"));
      for (int p = 0; p < W; p++)
        for (int64_t i = 0; i < n; i++)
          CHECK(same_bits(recv[p * n + i], input(tag, p, i)), "all_gather n=%lld in_place=%d p=%d i=%lld",
                (long long)n, in_place, p, (long long)i);
    }
    /* reduce_scatter and all_reduce, every reduction; reduce_scatter in place too */
    for (int red = FSDP_RED_SUM; red <= FSDP_RED_MIN; red++) {
      for (int in_place = 0; in_place < 2; in_place++, tag++) {
        for (int p = 0; p < W; p++)
          for (int64_t i = 0; i < n; i++) send[p * n + i] = input(tag, r, p * n + i);
        float *dst = in_place ? send + (int64_t)r * n : recv;
        OK(fsdp_comm_reduce_scatter(c, dst, send, n, FSDP_DTYPE_F32, (fsdp_reduce_op)red, "rs"));
        for (int64_t i = 0; i < n; i++) {
          float want = fold(tag, (int64_t)r * n + i, W, (fsdp_reduce_op)red, 0);
          CHECK(same_bits(dst[i], want), "reduce_scatter %s n=%lld in_place=%d i=%lld: %a vs %a",
                fsdp_reduce_name((fsdp_reduce_op)red), (long long)n, in_place, (long long)i,
                dst[i], want);
        }
      }
      tag++;
      for (int64_t i = 0; i < n; i++) recv[i] = input(tag, r, i);
      OK(fsdp_comm_all_reduce(c, recv, n, FSDP_DTYPE_F32, (fsdp_reduce_op)red, "ar"));
      for (int64_t i = 0; i < n; i++) {
        float want = fold(tag, i, W, (fsdp_reduce_op)red, 0);
        CHECK(same_bits(recv[i], want), "all_reduce %s n=%lld i=%lld: %a vs %a",
              fsdp_reduce_name((fsdp_reduce_op)red), (long long)n, (long long)i, recv[i], want);
      }
    }
    /* broadcast from every root */
    for (int root = 0; root < W; root++, tag++) {
      for (int64_t i = 0; i < n; i++) recv[i] = input(tag, r, i);
      OK(fsdp_comm_broadcast(c, recv, n, FSDP_DTYPE_F32, root, "bc"));
      for (int64_t i = 0; i < n; i++)
        CHECK(same_bits(recv[i], input(tag, root, i)), "broadcast root %d n=%lld i=%lld", root,
              (long long)n, (long long)i);
    }
    free(send);
    free(recv);
  }
  OK(fsdp_comm_barrier(c, "end"));
  passed("every collective, counts 0..10007, bitwise against the serial fold");
}

/* Every collective in every dtype: typed_ref.h's exercise, the one test_comm.c runs on the
 * local backend, so both backends are held to the same bits. */
static void test_typed(fsdp_comm *c) {
  typed_report t = {{0}, 0};
  typed_exercise(c, g_world, g_rank, &t);
  CHECK(t.wrong[0] == '\0' && t.checks > 0, "%s", t.wrong);
  passed("every collective in every dtype, bitwise against typed_ref.h (the local backend's reference)");
}

static void test_nan(fsdp_comm *c) {
  const int W = g_world, r = g_rank;
  float buf[40];
  for (int i = 0; i < 40; i++) buf[i] = (float)(i + r);
  if (r == W - 1) buf[3] = NAN; /* the last rank: a left fold that dropped it would show */
  if (r == 0) buf[7] = NAN;
  float mx[40], mn[40];
  memcpy(mx, buf, sizeof buf);
  memcpy(mn, buf, sizeof buf);
  OK(fsdp_comm_all_reduce(c, mx, 40, FSDP_DTYPE_F32, FSDP_RED_MAX, "nan max"));
  OK(fsdp_comm_all_reduce(c, mn, 40, FSDP_DTYPE_F32, FSDP_RED_MIN, "nan min"));
  for (int i = 0; i < 40; i++) {
    bool nan = i == 3 || i == 7;
    CHECK(nan ? isnan(mx[i]) : mx[i] == (float)(i + W - 1), "max i=%d: %g", i, mx[i]);
    CHECK(nan ? isnan(mn[i]) : mn[i] == (float)i, "min i=%d: %g", i, mn[i]);
  }
  passed("max and min propagate NaN");
}

/* Several asynchronous collectives in flight, waited in reverse order. */
static void test_async(fsdp_comm *c) {
  const int W = g_world, r = g_rank;
  enum { N = 3000, K = 6 };
  float *bufs[K];
  float *sends[K];
  fsdp_comm_req *reqs[K];
  for (int j = 0; j < K; j++) {
    bufs[j] = malloc((size_t)N * W * sizeof(float));
    sends[j] = malloc((size_t)N * W * sizeof(float));
    CHECK(bufs[j] && sends[j], "oom");
    fsdp_coll k = {.dtype = FSDP_DTYPE_F32, .count = N};
    snprintf(k.label, sizeof k.label, "async.%d", j);
    switch (j % 3) {
    case 0:
      for (int i = 0; i < N; i++) sends[j][i] = input(100 + j, r, i);
      k.op = FSDP_COLL_ALL_GATHER, k.send = sends[j], k.recv = bufs[j];
      break;
    case 1:
      for (int i = 0; i < N * W; i++) sends[j][i] = input(100 + j, r, i);
      k.op = FSDP_COLL_REDUCE_SCATTER, k.red = FSDP_RED_AVG, k.send = sends[j], k.recv = bufs[j];
      break;
    default:
      for (int i = 0; i < N; i++) bufs[j][i] = input(100 + j, r, i);
      k.op = FSDP_COLL_ALL_REDUCE, k.red = FSDP_RED_SUM, k.recv = bufs[j];
      break;
    }
    OK(fsdp_comm_start(c, &k, &reqs[j]));
  }
  for (int j = K - 1; j >= 0; j--) OK(fsdp_comm_wait(reqs[j]));
  for (int j = 0; j < K; j++) {
    for (int i = 0; i < N; i++) {
      switch (j % 3) {
      case 0:
        for (int p = 0; p < W; p++)
          CHECK(same_bits(bufs[j][p * N + i], input(100 + j, p, i)), "async ag j=%d", j);
        break;
      case 1:
        CHECK(same_bits(bufs[j][i], fold(100 + j, (int64_t)r * N + i, W, FSDP_RED_AVG, 0)),
              "async rs j=%d i=%d", j, i);
        break;
      default:
        CHECK(same_bits(bufs[j][i], fold(100 + j, i, W, FSDP_RED_SUM, 0)), "async ar j=%d", j);
        break;
      }
    }
    free(bufs[j]);
    free(sends[j]);
  }
  char rec[4096];
  fsdp_comm_flight_recorder(c, rec, sizeof rec);
  const char *a0 = strstr(rec, "'async.0' done"), *a5 = strstr(rec, "'async.5' done");
  CHECK(a0 && a5 && a0 < a5, "recorder:\n%s", rec);
  passed("asynchronous collectives waited in reverse order");
}

/* The progress thread: an all_gather started before a stretch of compute that makes no MPI call
 * is finished (or nearly) when the compute ends. Timing on a shared machine: best of 3. */
static void test_overlap(fsdp_comm *c) {
  if (g_world == 1) return;
  const int W = g_world, r = g_rank;
  const int64_t n = (int64_t)2 << 20; /* 8 MiB shards */
  float *send = malloc((size_t)n * sizeof(float)), *recv = malloc((size_t)(n * W) * sizeof(float));
  CHECK(send && recv, "oom");
  for (int64_t i = 0; i < n; i++) send[i] = (float)(i + r);
  double t_block = 1e9;
  for (int k = 0; k < 3; k++) {
    sync_all("overlap.block");
    double t0 = now_s();
    OK(fsdp_comm_all_gather(c, recv, send, n, FSDP_DTYPE_F32, "overlap.block"));
    double t = now_s() - t0;
    if (t < t_block) t_block = t;
  }
  double best_ratio = 1e9;
  for (int k = 0; k < 3; k++) { /* the same number of rounds on every rank */
    sync_all("overlap.async");
    fsdp_coll kk = {.op = FSDP_COLL_ALL_GATHER, .dtype = FSDP_DTYPE_F32, .count = n, .send = send,
                    .recv = recv};
    snprintf(kk.label, sizeof kk.label, "overlap.async");
    fsdp_comm_req *req;
    OK(fsdp_comm_start(c, &kk, &req));
    double t0 = now_s();
    volatile double x = 0; /* compute without MPI calls, 4x the blocking time */
    while (now_s() - t0 < 4 * t_block + 0.01) x = x + 1.0;
    double tw = now_s();
    OK(fsdp_comm_wait(req));
    double wait = now_s() - tw, ratio = wait / t_block;
    if (ratio < best_ratio) best_ratio = ratio;
  }
  for (int p = 0; p < W; p++) CHECK(recv[(int64_t)p * n + 7] == (float)(7 + p), "overlap data");
  /* every rank's verdict, so that all fail or none */
  float worst = (float)best_ratio;
  OK(fsdp_comm_all_reduce(g_sync, &worst, 1, FSDP_DTYPE_F32, FSDP_RED_MAX, "overlap.verdict"));
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (r == 0) printf("  overlap: blocking all_gather %.2f ms; wait after compute %.0f%% of it%s\n",
                     t_block * 1e3, worst * 100.0,
                     W > cores ? " (more ranks than cores: not checked)" : "");
  /* with more ranks than cores the ranks' compute loops starve the progress threads */
  CHECK(W > cores || worst < 0.5f, "the wait after compute took %.0f%% of a blocking all_gather (%.2f ms): "
        "the collective did not advance during compute", worst * 100.0, t_block * 1e3);
  free(send);
  free(recv);
  passed("an asynchronous all_gather advances while the caller computes");
}

static void test_stats(fsdp_comm *c) {
  fsdp_comm_reset_stats(c);
  float buf[64 * 4] = {0};
  OK(fsdp_comm_all_gather(c, buf, buf + g_rank * 16, 16, FSDP_DTYPE_F32, "s"));
  OK(fsdp_comm_all_reduce(c, buf, 10, FSDP_DTYPE_F32, FSDP_RED_SUM, "s"));
  fsdp_comm_stats s;
  fsdp_comm_get_stats(c, &s);
  CHECK(s.calls[FSDP_COLL_ALL_GATHER] == 1 && s.bytes[FSDP_COLL_ALL_GATHER] == 16 * 4 * g_world,
        "all_gather stats %lld %lld", (long long)s.calls[0], (long long)s.bytes[0]);
  CHECK(s.calls[FSDP_COLL_ALL_REDUCE] == 1 && s.bytes[FSDP_COLL_ALL_REDUCE] == 40, "all_reduce");
  CHECK(strcmp(fsdp_comm_backend(c), "mpi") == 0, "backend %s", fsdp_comm_backend(c));
  passed("stats and backend name");
}

/* ---- failures: each on a communicator of its own ------------------------------------------- */

static fsdp_comm *fresh(double timeout) {
  fsdp_comm *c;
  OK(fsdp_comm_mpi_new(&c));
  if (timeout > 0) fsdp_comm_set_timeout(c, timeout);
  return c;
}

static void expect_fail(int rc, const char *want, const char *what) {
  CHECK(rc == FSDP_ERR, "%s: succeeded", what);
  CHECK(strstr(fsdp_error_msg(), want) != NULL, "%s: the message lacks '%s':\n%s", what, want,
        fsdp_error_msg());
  CHECK(strstr(fsdp_error_msg(), "flight recorder (rank") != NULL, "%s: no recorder:\n%s", what,
        fsdp_error_msg());
}

/* the first line of an error message (the flight recorder follows it) */
static void first_line(char *buf, size_t n, const char *msg) {
  size_t len = strcspn(msg, "\n");
  if (len >= n) len = n - 1;
  memcpy(buf, msg, len);
  buf[len] = '\0';
}

static void test_mismatch(void) {
  if (g_world == 1) return;
  const int r = g_rank;
  float buf[4096];
  memset(buf, 0, sizeof buf);
  /* op: rank 0 all_gather, the others reduce_scatter */
  fsdp_comm *c = fresh(20);
  OK(fsdp_comm_barrier(c, "first"));
  int rc = r == 0 ? fsdp_comm_all_gather(c, buf, buf, 8, FSDP_DTYPE_F32, "x")
                  : fsdp_comm_reduce_scatter(c, buf, buf + 1024, 8, FSDP_DTYPE_F32, FSDP_RED_SUM, "x");
  expect_fail(rc, "collective mismatch at #2: rank 0 called all_gather(f32 x8, 'x') but rank 1 "
                  "called reduce_scatter(f32 x8 sum, 'x')", "op mismatch");
  /* and the group stays poisoned with the verdict itself: every later collective fails with
   * the same message on every rank, blaming no rank (docs/comm.md, as the local backend) */
  char verdict[256];
  first_line(verdict, sizeof verdict, fsdp_error_msg());
  for (int i = 0; i < 2; i++) {
    expect_fail(fsdp_comm_barrier(c, "after"), "collective mismatch at #2", "after a mismatch");
    char later[256];
    first_line(later, sizeof later, fsdp_error_msg());
    CHECK(strcmp(later, verdict) == 0,
          "after a mismatch: the message is\n%s\nnot the verdict\n%s", later, verdict);
  }
  fsdp_comm_free(c);
  sync_all("mismatch.op");
  /* count */
  c = fresh(20);
  rc = fsdp_comm_all_reduce(c, buf, r == 1 ? 5 : 6, FSDP_DTYPE_F32, FSDP_RED_SUM, "n");
  expect_fail(rc, "collective mismatch at #1: rank 0 called all_reduce(f32 x6 sum, 'n') but rank 1 "
                  "called all_reduce(f32 x5 sum, 'n')", "count mismatch");
  fsdp_comm_free(c);
  sync_all("mismatch.count");
  /* dtype */
  c = fresh(20);
  rc = fsdp_comm_all_gather(c, buf + 64, buf, 8, r == 1 ? FSDP_DTYPE_BF16 : FSDP_DTYPE_F32, "d");
  expect_fail(rc, "collective mismatch at #1: rank 0 called all_gather(f32 x8, 'd') but rank 1 "
                  "called all_gather(bf16 x8, 'd')", "dtype mismatch");
  fsdp_comm_free(c);
  sync_all("mismatch.dtype");
  /* label: compared on its first use (and on every later one, below) */
  c = fresh(20);
  char label[32];
  snprintf(label, sizeof label, "lbl%d", r);
  rc = fsdp_comm_all_reduce(c, buf, 8, FSDP_DTYPE_F32, FSDP_RED_SUM, label);
  expect_fail(rc, "collective mismatch at #1: rank 0 called all_reduce(f32 x8 sum, 'lbl0') but "
                  "rank 1 called all_reduce(f32 x8 sum, 'lbl1')", "label mismatch");
  fsdp_comm_free(c);
  sync_all("mismatch.label");
  /* a label used before: compared too */
  c = fresh(20);
  OK(fsdp_comm_all_reduce(c, buf, 8, FSDP_DTYPE_F32, FSDP_RED_SUM, "a"));
  OK(fsdp_comm_all_reduce(c, buf, 8, FSDP_DTYPE_F32, FSDP_RED_SUM, "b"));
  rc = fsdp_comm_all_reduce(c, buf, 8, FSDP_DTYPE_F32, FSDP_RED_SUM, r == 1 ? "b" : "a");
  expect_fail(rc, "collective mismatch at #3: rank 0 called all_reduce(f32 x8 sum, 'a') but rank 1 "
                  "called all_reduce(f32 x8 sum, 'b')", "label mismatch on a later use");
  fsdp_comm_free(c);
  sync_all("mismatch.later");
  /* the full check asked by the last rank only: the others follow it (the request travels in
   * the folded check), collectives still run, and a mismatch of the last rank is named */
  c = fresh(20);
  if (r == g_world - 1) fsdp_comm_set_full_check(c, true);
  float v[16];
  for (int i = 0; i < 16; i++) v[i] = (float)(r + i);
  OK(fsdp_comm_all_reduce(c, v, 16, FSDP_DTYPE_F32, FSDP_RED_SUM, "full"));
  for (int i = 0; i < 16; i++) {
    float want = 0;
    for (int p = 0; p < g_world; p++) want += (float)(p + i);
    CHECK(v[i] == want, "full check: element %d is %g, want %g", i, v[i], want);
  }
  rc = fsdp_comm_broadcast(c, v, 16, FSDP_DTYPE_F32, r == g_world - 1 ? 1 : 0, "bc");
  char want[200];
  snprintf(want, sizeof want,
           "collective mismatch at #2: rank 0 called broadcast(f32 x16 root 0, 'bc') but rank %d "
           "called broadcast(f32 x16 root 1, 'bc')", g_world - 1);
  expect_fail(rc, want, "mismatch under the full check");
  fsdp_comm_free(c);
  sync_all("mismatch.full");
  /* the same mismatch under the hash check alone */
  c = fresh(20);
  rc = fsdp_comm_broadcast(c, v, 16, FSDP_DTYPE_F32, r == g_world - 1 ? 1 : 0, "bc");
  snprintf(want, sizeof want,
           "collective mismatch at #1: rank 0 called broadcast(f32 x16 root 0, 'bc') but rank %d "
           "called broadcast(f32 x16 root 1, 'bc')", g_world - 1);
  expect_fail(rc, want, "mismatch of the last rank");
  fsdp_comm_free(c);
  passed("fingerprint mismatches fail every rank with both sides named");
}

/* The NCCL unique id over MPI (what `mpirun ... fsdprun --backend nccl` does before
 * ncclCommInitRank), with a stand-in for ncclGetUniqueId: every process ends with rank 0's. */
static int fake_id(uint8_t id[FSDP_NCCL_ID_BYTES], void *arg) {
  int seed = *(int *)arg;
  for (int i = 0; i < FSDP_NCCL_ID_BYTES; i++) id[i] = (uint8_t)(seed * 31 + i * 7);
  return FSDP_OK;
}

static int failing_id(uint8_t id[FSDP_NCCL_ID_BYTES], void *arg) {
  (void)id, (void)arg;
  return fsdp_error("ncclGetUniqueId: unhandled system error");
}

static void test_nccl_id(void) {
  fsdp_comm *c = fresh(20);
  int seed = 1000 + g_rank, zero = 1000;
  uint8_t id[FSDP_NCCL_ID_BYTES], want[FSDP_NCCL_ID_BYTES];
  OK(fsdp_nccl_share_id(c, id, fake_id, &seed));
  fake_id(want, &zero);
  CHECK(memcmp(id, want, sizeof id) == 0, "rank %d holds another id than rank 0 made", g_rank);
  OK(fsdp_comm_barrier(c, "after the id"));
  fsdp_comm_free(c);
  sync_all("nccl id");
  if (g_world > 1) {
    c = fresh(20);
    int rc = fsdp_nccl_share_id(c, id, failing_id, NULL);
    if (g_rank == 0) {
      CHECK(rc == FSDP_ERR && strstr(fsdp_error_msg(), "nccl bootstrap: ncclGetUniqueId: "
                                                      "unhandled system error"),
            "rank 0: %s", fsdp_error_msg());
    } else {
      expect_fail(rc, "rank 0 failed: nccl bootstrap: ncclGetUniqueId", "a failing ncclGetUniqueId");
    }
    fsdp_comm_free(c);
  }
  passed("the NCCL unique id reaches every process from rank 0");
}

static void test_abort(void) {
  if (g_world == 1) return;
  fsdp_comm *c = fresh(30);
  OK(fsdp_comm_barrier(c, "before"));
  double t0 = now_s();
  if (g_rank == 1) {
    struct timespec ts = {0, 200000000}; /* the others are waiting by then */
    nanosleep(&ts, NULL);
    fsdp_comm_abort(c, "boom on rank 1");
    CHECK(fsdp_comm_poisoned(c), "poisoned after abort");
  }
  float x[3] = {1, 2, 3};
  int rc = fsdp_comm_all_reduce(c, x, 3, FSDP_DTYPE_F32, FSDP_RED_SUM, "victim");
  expect_fail(rc, "rank 1 failed: boom on rank 1", "abort");
  CHECK(now_s() - t0 < 10, "abort took %.1f s (the timeout is 30)", now_s() - t0);
  CHECK(fsdp_comm_poisoned(c), "poisoned");
  fsdp_comm_free(c);
  sync_all("abort");
  passed("abort fails every rank's collective with the aborting rank's message");
}

static void test_timeout(void) {
  if (g_world == 1) return;
  fsdp_comm *c = fresh(0.5);
  OK(fsdp_comm_barrier(c, "first"));
  if (g_rank == 1) {
    struct timespec ts = {1, 500000000};
    nanosleep(&ts, NULL);
  }
  double t0 = now_s();
  int rc = fsdp_comm_barrier(c, "late");
  double t = now_s() - t0;
  if (g_rank == 0) {
    expect_fail(rc, "timeout after 0.5 s in barrier #2 'late': rank 1 has not arrived (sequence "
                    "number it reached: rank 1 #1)", "timeout");
    CHECK(t > 0.45 && t < 5, "timed out after %.2f s", t);
  } else {
    expect_fail(rc, "timeout after 0.5 s in barrier #2 'late'", "timeout (peer)");
  }
  fsdp_comm_free(c);
  sync_all("timeout");
  passed("a timeout names the rank that has not arrived");
}

static void test_left(void) {
  if (g_world == 1) return;
  fsdp_comm *c = fresh(30);
  OK(fsdp_comm_barrier(c, "one"));
  if (g_rank == 1) {
    fsdp_comm_free(c);
  } else {
    struct timespec ts = {0, 100000000};
    nanosleep(&ts, NULL);
    double t0 = now_s();
    int rc = fsdp_comm_barrier(c, "two");
    expect_fail(rc, "rank 1 left the group (its communicator was freed) after #1: barrier #2 "
                    "'two' cannot complete", "left");
    CHECK(now_s() - t0 < 10, "took %.1f s", now_s() - t0);
    fsdp_comm_free(c);
  }
  passed("a rank that left fails its peers at once");
}

/* fsdp_comm_revive as the post-mortem uses it: after an abort every rank drains, they agree on
 * the largest sequence number (over g_sync), revive, and collectives run again with the right
 * values (the aborting rank issued one collective fewer: it skips a number). Reviving a healthy
 * communicator with a collective still queued is refused and changes nothing. */
static void test_revive(void) {
  if (g_world == 1) return;
  fsdp_comm *c = fresh(30);
  OK(fsdp_comm_barrier(c, "before"));
  sync_all("revive: before"); /* every rank is out of #1: the poison fails #2 only */
  if (g_rank == 1) fsdp_comm_abort(c, "broke");
  else expect_fail(fsdp_comm_barrier(c, "victim"), "rank 1 failed: broke", "before the revive");
  sync_all("revive: stopped");
  double seq = (double)fsdp_comm_drain(c);
  OK(fsdp_comm_all_reduce(g_sync, &seq, 1, FSDP_DTYPE_F64, FSDP_RED_MAX, "revive.seq"));
  CHECK(seq == 2, "the largest sequence number is %g, expected 2", seq);
  OK(fsdp_comm_revive(c, (uint64_t)seq));
  sync_all("revive: revived");
  CHECK(!fsdp_comm_poisoned(c), "poisoned after the revive");
  double v = g_rank + 1;
  OK(fsdp_comm_all_reduce(c, &v, 1, FSDP_DTYPE_F64, FSDP_RED_SUM, "after"));
  CHECK(v == g_world * (g_world + 1) / 2.0, "the sum after the revive is %g", v);
  float mine[4] = {(float)g_rank, 1, 2, 3}, all[4 * 8];
  CHECK(g_world <= 8, "world %d", g_world);
  OK(fsdp_comm_all_gather(c, all, mine, 4, FSDP_DTYPE_F32, "after.gather"));
  for (int p = 0; p < g_world; p++) CHECK(all[4 * p] == (float)p, "gathered %g from rank %d", all[4 * p], p);
  fsdp_comm_free(c);
  sync_all("revive");

  fsdp_comm *q = fresh(30);
  if (g_rank == 0) {
    fsdp_coll k = {.op = FSDP_COLL_BARRIER, .dtype = FSDP_DTYPE_F32};
    snprintf(k.label, sizeof k.label, "alone");
    fsdp_comm_req *req;
    OK(fsdp_comm_start(q, &k, &req));
    CHECK(fsdp_comm_revive(q, 1) == FSDP_ERR, "revived with a collective queued");
    CHECK(strstr(fsdp_error_msg(), "cannot revive the communicator while collectives are queued"),
          "%s", fsdp_error_msg());
    fsdp_comm_abort(q, "done");
    CHECK(fsdp_comm_wait(req) == FSDP_ERR, "the lone barrier succeeded");
  }
  sync_all("revive: refused");
  fsdp_comm_free(q);
  passed("a poisoned group revives over new MPI communicators; a queued collective refuses it");
}

/* Sub-communicators over MPI_Comm_split: hybrid pairs for every shard_size dividing the world,
 * every collective inside the groups bitwise against the serial fold over the group's ranks, and
 * a split by color and key. */
static void test_split(void) {
  const int W = g_world, r = g_rank;
  fsdp_comm *c = fresh(30);
  for (int S = 1; S <= W; S++) {
    if (W % S) continue;
    fsdp_comm *sh, *rep;
    OK(fsdp_comm_hybrid(c, S, &sh, &rep));
    CHECK(fsdp_comm_world(sh) == S && fsdp_comm_rank(sh) == r % S, "shard group of %d", S);
    CHECK(fsdp_comm_world(rep) == W / S && fsdp_comm_rank(rep) == r / S, "replicate group");
    CHECK(strcmp(fsdp_comm_backend(sh), "mpi") == 0, "backend %s", fsdp_comm_backend(sh));
    enum { N = 4099 };
    static float a[N * 8], b[N];
    CHECK(W <= 8, "world %d", W);
    /* reduce_scatter in the group: chunk (r % S) of the sum of the group's ranks' inputs */
    for (int64_t i = 0; i < (int64_t)N * S; i++) a[i] = input(900 + S, r, i);
    OK(fsdp_comm_reduce_scatter(sh, b, a, N, FSDP_DTYPE_F32, FSDP_RED_SUM, "group rs"));
    for (int64_t i = 0; i < N; i++) {
      int64_t e = (int64_t)(r % S) * N + i;
      float want = input(900 + S, r - r % S, e);
      for (int k = 1; k < S; k++) want += input(900 + S, r - r % S + k, e);
      CHECK(same_bits(b[i], want), "group reduce_scatter S=%d i=%lld: %a vs %a", S, (long long)i, b[i], want);
    }
    /* all_reduce across the groups: the ranks with the same index */
    for (int64_t i = 0; i < N; i++) b[i] = input(950 + S, r, i);
    OK(fsdp_comm_all_reduce(rep, b, N, FSDP_DTYPE_F32, FSDP_RED_SUM, "across"));
    for (int64_t i = 0; i < N; i++) {
      float want = input(950 + S, r % S, i);
      for (int k = 1; k < W / S; k++) want += input(950 + S, r % S + k * S, i);
      CHECK(same_bits(b[i], want), "replicate all_reduce S=%d i=%lld: %a vs %a", S, (long long)i, b[i], want);
    }
    /* all_gather in the group */
    for (int64_t i = 0; i < 5; i++) b[i] = (float)(10 * r + i);
    OK(fsdp_comm_all_gather(sh, a, b, 5, FSDP_DTYPE_F32, "group ag"));
    for (int p = 0; p < S; p++)
      for (int i = 0; i < 5; i++)
        CHECK(a[5 * p + i] == (float)(10 * (r - r % S + p) + i), "group all_gather S=%d", S);
  }
  fsdp_comm *sub;
  OK(fsdp_comm_split(c, r % 2, -r, &sub));
  int n = (W - r % 2 + 1) / 2;
  CHECK(fsdp_comm_world(sub) == n && fsdp_comm_rank(sub) == n - 1 - r / 2, "split by key");
  fsdp_comm_free(sub);
  fsdp_comm_free(c); /* the hybrid pairs with it */
  passed("sub-communicators: hybrid pairs and a split by color and key, bitwise");
}

/* At 4 ranks as 2 x 2: rank 0 aborts its shard group; rank 3 waits in the other shard group for
 * rank 2, which waits until its replicate group (shared with rank 0) is poisoned: every
 * collective fails with rank 0's message, in less than the timeout. */
static void test_split_failure(void) {
  if (g_world != 4) return;
  fsdp_comm *c = fresh(30), *sh, *rep;
  OK(fsdp_comm_hybrid(c, 2, &sh, &rep));
  OK(fsdp_comm_barrier(c, "start"));
  double t0 = now_s();
  if (g_rank == 0) {
    struct timespec ts = {0, 200000000}; /* the others are waiting by then */
    nanosleep(&ts, NULL);
    fsdp_comm_abort(sh, "boom in group 0");
  } else if (g_rank == 2) {
    while (!fsdp_comm_poisoned(rep) && now_s() - t0 < 20) {
      struct timespec ts = {0, 5000000};
      nanosleep(&ts, NULL);
    }
  }
  expect_fail(fsdp_comm_barrier(sh, "after"), "rank 0 failed: boom in group 0", "shard group");
  expect_fail(fsdp_comm_barrier(c, "world"), "rank 0 failed: boom in group 0", "world");
  CHECK(now_s() - t0 < 10, "the failure took %.1f s (the timeout is 30)", now_s() - t0);
  CHECK(fsdp_comm_revive(c, fsdp_comm_drain(c)) == FSDP_ERR, "revived a family");
  CHECK(strstr(fsdp_error_msg(), "belongs to a family with sub-communicators"), "%s", fsdp_error_msg());
  fsdp_comm_free(c);
  sync_all("split failure");
  passed("an abort in one group fails every group's collectives");
}

/* A rank stopped in the middle of an all_gather's data phase (every rank arrived, the data is
 * moving): its peers time out without progress and name it, whether the data moves by the
 * library's MPI_Iallgather (the default: a probe finds the peer that does not answer) or by
 * point-to-point (FSDP_MPI_ALLGATHER=p2p: the pending receive names it, or when only sends are
 * pending, the pending sends). Rank 1 stops itself (raise(SIGSTOP)) as soon as the first peer data
 * lands in its output, so that everyone has arrived and nothing can finish without it: with
 * single-copy transfers off, the blocks move in 32 KiB fragments that need both sides. Rank 0
 * resumes it (SIGCONT) after its own failure. */
static void test_stall(void) {
  if (g_world == 1) return;
  const int W = g_world, r = g_rank;
  int64_t pid = (int64_t)getpid(), *pids = calloc((size_t)W, sizeof *pids);
  CHECK(pids, "oom");
  OK(fsdp_comm_all_gather(g_sync, pids, &pid, 1, FSDP_DTYPE_I64, "pids"));
  CHECK(pids[1] > 0, "rank 1 pid %lld", (long long)pids[1]);
  const int64_t n = (int64_t)32 << 20; /* bytes per rank */
  unsigned char *in = malloc((size_t)n), *out = calloc((size_t)W, (size_t)n);
  CHECK(in && out, "oom");
  memset(in, 0x5a, (size_t)n);
  fsdp_comm *c = fresh(1.0);
  OK(fsdp_comm_barrier(c, "before"));
  fsdp_coll k = {.op = FSDP_COLL_ALL_GATHER, .dtype = FSDP_DTYPE_U8, .count = n, .send = in,
                 .recv = out};
  snprintf(k.label, sizeof k.label, "stalled");
  fsdp_comm_req *req;
  OK(fsdp_comm_start(c, &k, &req));
  if (r == 1) {
    /* the progress thread moves the data; stop at the first peer byte (it arrived, so every
     * rank did) */
    double t0 = now_s();
    bool seen = false;
    while (!seen) {
      for (int p = 0; p < W && !seen; p++)
        seen = p != r && ((volatile unsigned char *)out)[(size_t)p * (size_t)n] != 0;
      CHECK(seen || now_s() - t0 < 30, "no peer data arrived in 30 s");
    }
    raise(SIGSTOP);
  }
  double t0 = now_s();
  int rc = fsdp_comm_wait(req);
  double t = now_s() - t0;
  if (r == 0) {
    const char *ag = getenv("FSDP_MPI_ALLGATHER");
    bool p2p = ag && strcmp(ag, "p2p") == 0;
    CHECK(rc == FSDP_ERR, "the stalled all_gather succeeded");
    const char *m = fsdp_error_msg();
    CHECK(strstr(m, "timeout after 1 s in all_gather #2 'stalled': every rank arrived, but no "
                    "data has moved for 1 s (waiting for "),
          "the message:\n%s", m);
    if (p2p)
      CHECK(strstr(m, "(waiting for rank 1)") || strstr(m, "(waiting for rank 1 to receive)"),
            "point-to-point: the message does not name rank 1:\n%s", m);
    else
      CHECK(strstr(m, "(waiting for the MPI collective: rank 1 does not answer)"),
            "the library collective: the message does not name rank 1:\n%s", m);
    CHECK(t < 8, "failed after %.1f s (timeout 1 s)", t);
    struct timespec ts = {0, 300000000}; /* the others learn of it first */
    nanosleep(&ts, NULL);
    CHECK(kill((pid_t)pids[1], SIGCONT) == 0, "SIGCONT to rank 1");
  }
  /* rank 1 (resumed) and ranks 2.. may fail with rank 0's poison or, the data having moved
   * after all, succeed: either is right for them */
  fsdp_comm_free(c);
  /* in and out stay: the abandoned MPI_Iallgather (MPI cannot cancel it) may still move data
   * into them once rank 1 runs again */
  free(pids);
  sync_all("stall");
  passed("a rank stopped in an all_gather's data phase is named by its peers' timeout");
}

/* ---- a rank whose peers hold only sends to it (test_stall_sends) -------------------------------
 * The backend's MPI_Isend and MPI_Irecv calls come here first (MPI's profiling interface: the
 * library's own entry points are PMPI_*). While armed, rank 1 records its reduce-scatter sends
 * and, at its first reduce-scatter receive, waits until every one of them has completed (its
 * peers have received all of its data), then stops itself (SIGSTOP) before posting that receive.
 * Its peers then have no receive pending, only their sends to rank 1, which nobody takes: the
 * state that single-copy transfers produce by chance when a rank stops in the data phase (the
 * receivers pull the stopped rank's posted sends), here reached on every transport. The
 * backend holds its MPI lock around these calls, so no other thread of rank 1 moves data
 * meanwhile. */
#define STALL_TAG 10 /* mpi.c's TAG_RS: reduce_scatter's data, and all_reduce's first half */
#define STALL_MAX 256
static atomic_bool g_stall_armed;
static MPI_Request g_stall_sends[STALL_MAX];
static int g_stall_nsends;

int MPI_Isend(const void *buf, int count, MPI_Datatype dt, int dest, int tag, MPI_Comm comm,
              MPI_Request *req) {
  int err = PMPI_Isend(buf, count, dt, dest, tag, comm, req);
  if (atomic_load(&g_stall_armed) && tag == STALL_TAG && err == MPI_SUCCESS) {
    CHECK(g_stall_nsends < STALL_MAX, "more than %d sends", STALL_MAX);
    g_stall_sends[g_stall_nsends++] = *req;
  }
  return err;
}

int MPI_Irecv(void *buf, int count, MPI_Datatype dt, int src, int tag, MPI_Comm comm,
              MPI_Request *req) {
  if (atomic_load(&g_stall_armed) && tag == STALL_TAG) {
    atomic_store(&g_stall_armed, false);
    CHECK(g_stall_nsends > 0, "no send recorded before the first receive");
    double t0 = now_s();
    for (int i = 0; i < g_stall_nsends; i++) {
      int done = 0;
      while (!done) { /* (get_status leaves the request to its owner) */
        PMPI_Request_get_status(g_stall_sends[i], &done, MPI_STATUS_IGNORE);
        CHECK(done || now_s() - t0 < 30, "send %d of %d did not complete in 30 s", i,
              g_stall_nsends);
      }
    }
    raise(SIGSTOP);
  }
  return PMPI_Irecv(buf, count, dt, src, tag, comm, req);
}

/* Rank 1 stops in an all_reduce's (then a reduce_scatter's) data phase once its peers hold all
 * of its data and before it takes any of theirs (above): every peer's pending requests are
 * sends to rank 1, and rank 0's timeout names it as the rank that does not receive. Rank 0
 * resumes it (SIGCONT) after its own failure. */
static void test_stall_sends(void) {
  if (g_world == 1) return;
  const int W = g_world, r = g_rank;
  int64_t pid = (int64_t)getpid(), *pids = calloc((size_t)W, sizeof *pids);
  CHECK(pids, "oom");
  OK(fsdp_comm_all_gather(g_sync, pids, &pid, 1, FSDP_DTYPE_I64, "pids"));
  const int64_t n = (int64_t)1 << 20; /* f32 elements per chunk: 4 MiB, four 1 MiB segments */
  for (int round = 0; round < 2; round++) {
    const bool ar = round == 0;
    const char *what = ar ? "all_reduce" : "reduce_scatter";
    /* never freed: rank 1, resumed, may still move data in or out of them */
    float *in = malloc((size_t)(n * W) * sizeof(float)), *out = malloc((size_t)n * sizeof(float));
    CHECK(in && out, "oom");
    for (int64_t i = 0; i < n * W; i++) in[i] = (float)r;
    /* rank 0 times out first, well before the others (whose poison would otherwise race it) */
    fsdp_comm *c = fresh(r == 0 ? 1.0 : 4.0);
    OK(fsdp_comm_barrier(c, "before"));
    g_stall_nsends = 0;
    if (r == 1) atomic_store(&g_stall_armed, true);
    double t0 = now_s();
    int rc = ar ? fsdp_comm_all_reduce(c, in, n * W, FSDP_DTYPE_F32, FSDP_RED_SUM, "stalled")
                : fsdp_comm_reduce_scatter(c, out, in, n, FSDP_DTYPE_F32, FSDP_RED_SUM,
                                           "stalled");
    double t = now_s() - t0;
    CHECK(!atomic_load(&g_stall_armed), "%s: rank %d never reached its first receive", what, r);
    if (r == 0) {
      CHECK(rc == FSDP_ERR, "%s: the stalled collective succeeded", what);
      char want[256];
      snprintf(want, sizeof want,
               "timeout after 1 s in %s #2 'stalled': every rank arrived, but no data has moved "
               "for 1 s (waiting for rank 1 to receive)\n", what);
      CHECK(strncmp(fsdp_error_msg(), want, strlen(want)) == 0, "%s: the message is\n%s\nnot\n%s",
            what, fsdp_error_msg(), want);
      CHECK(t < 8, "%s: failed after %.1f s (timeout 1 s)", what, t);
      struct timespec ts = {0, 300000000}; /* the others learn of it first */
      nanosleep(&ts, NULL);
      CHECK(kill((pid_t)pids[1], SIGCONT) == 0, "SIGCONT to rank 1");
    }
    /* the others may fail with rank 0's poison, with their own timeout, or (rank 1, resumed)
     * succeed: each is right for them */
    fsdp_comm_free(c);
    sync_all("stall sends");
  }
  free(pids);
  passed("a rank that takes none of its peers' data is named by their timeout");
}

int main(void) {
  fsdp_comm *c;
  OK(fsdp_comm_mpi_new(&c));
  g_rank = fsdp_comm_rank(c);
  g_world = fsdp_comm_world(c);
  OK(fsdp_comm_mpi_new(&g_sync));
  if (g_rank == 0) {
    printf("test_mpi_comm: world %d, thread level %s\n", g_world, fsdp_mpi_thread_level());
    fflush(stdout);
  }
  const char *only = getenv("FSDP_TEST_ONLY");
  if (only && (strcmp(only, "stall") == 0 || strcmp(only, "stall_sends") == 0)) {
    if (strcmp(only, "stall") == 0) test_stall();
    else test_stall_sends();
    fsdp_comm_free(c);
    fsdp_comm_free(g_sync);
    MPI_Finalize();
    if (g_rank == 0) printf("test_mpi_comm: ok\n");
    return 0;
  }
  test_collectives(c);
  test_typed(c);
  test_nan(c);
  test_async(c);
  test_stats(c);
  const char *quick = getenv("FSDP_TEST_QUICK");
  if (!quick || strcmp(quick, "1") != 0) {
    test_overlap(c);
    test_mismatch();
    test_nccl_id();
    test_abort();
    test_timeout();
    test_left();
    test_revive();
    test_split();
    test_split_failure();
  }
  fsdp_comm_free(c);
  fsdp_comm_free(g_sync);
  /* the failure cases poisoned communicators on purpose, so fsdp_mpi_finalize would decline;
   * they left nothing in flight, so finalize here */
  MPI_Finalize();
  if (g_rank == 0) printf("test_mpi_comm: ok\n");
  return 0;
}
