/*
 * ranks.h — ranks as threads for the C tests that run a function on every rank of a local
 * group (test_fsdp.c, test_devices.c). Each rank has its own communicator, memory domain and
 * tape. cmocka's asserts are not thread-safe, so rank code checks with CHECK(), which records
 * the rank's first failure, aborts the communicator (so peers fail at once instead of waiting
 * in a collective) and returns false; run_ranks then fails the test with each rank's message.
 * Every rank's memory domain must be empty when the rank ends (leak check).
 *
 * Include it after <cmocka.h> (and its prerequisites), autograd/autograd.h and comm/comm.h.
 */
#ifndef FSDP_TEST_RANKS_H
#define FSDP_TEST_RANKS_H

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define RANKS_MAX 4

typedef struct rank_ctx rank_ctx;
typedef bool (*rank_fn)(rank_ctx *ctx);

struct rank_ctx {
  int rank, world;
  fsdp_comm *comm;
  fsdp_mem_domain *domain;
  rank_fn fn;
  void *arg; /* shared by all ranks of a run */
  bool ok;
  char fail[1024];
};

static _Thread_local rank_ctx *cur;

static bool note_fail(int line, const char *what) {
  if (cur && !cur->fail[0]) {
    snprintf(cur->fail, sizeof cur->fail, "rank %d, line %d: %s [engine: %s]", cur->rank, line,
             what, fsdp_error_msg());
    fsdp_comm_abort(cur->comm, cur->fail);
  }
  return false;
}
#define CHECK(c)                                                                                   \
  do {                                                                                             \
    if (!(c)) return note_fail(__LINE__, #c);                                                      \
  } while (0)
#define CHECK_OK(call) CHECK((call) == FSDP_OK)
/* the engine's error message is exactly `want` */
#define CHECK_MSG(want)                                                                            \
  do {                                                                                             \
    if (strcmp(fsdp_error_msg(), (want)) != 0) {                                                   \
      char m_[900];                                                                                \
      snprintf(m_, sizeof m_, "message \"%s\" != \"%s\"", fsdp_error_msg(), (want));              \
      return note_fail(__LINE__, m_);                                                              \
    }                                                                                              \
  } while (0)

static void *rank_main(void *arg) {
  rank_ctx *ctx = arg;
  cur = ctx;
  fsdp_mem_domain_set(ctx->domain);
  fsdp_comm_set_current(ctx->comm);
  fsdp_comm_set_timeout(ctx->comm, 30);
  ctx->ok = ctx->fn(ctx);
  fsdp_tape_clear();
  if (ctx->ok && !ctx->fail[0]) { /* every device's memory came back */
    fsdp_mem_report r;
    fsdp_mem_report_get(ctx->domain, &r);
    for (int i = 0; i < r.ndevices; i++)
      if (r.counts[i].live_total)
        snprintf(ctx->fail, sizeof ctx->fail, "rank %d: %lld bytes still live on %s", ctx->rank,
                 (long long)r.counts[i].live_total, r.device[i]);
  }
  fsdp_comm_set_current(NULL);
  fsdp_mem_domain_set(NULL);
  return NULL;
}

/* Run fn on W (<= RANKS_MAX) rank threads sharing arg; fail the test with every rank's
 * failure. */
static void run_ranks(int W, rank_fn fn, void *arg) {
  assert_true(W >= 1 && W <= RANKS_MAX);
  fsdp_local_group *g;
  assert_int_equal(fsdp_local_group_new(&g, W), FSDP_OK);
  rank_ctx ctx[RANKS_MAX];
  pthread_t th[RANKS_MAX];
  for (int r = 0; r < W; r++) {
    ctx[r] = (rank_ctx){.rank = r, .world = W, .fn = fn, .arg = arg};
    assert_int_equal(fsdp_comm_local_new(&ctx[r].comm, g, r), FSDP_OK);
    ctx[r].domain = fsdp_mem_domain_new();
    assert_non_null(ctx[r].domain);
    fsdp_mem_set_limit(ctx[r].domain, 0);
  }
  fsdp_local_group_release(g);
  for (int r = 0; r < W; r++) assert_int_equal(pthread_create(&th[r], NULL, rank_main, &ctx[r]), 0);
  for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
  char all[4096] = "";
  size_t len = 0;
  for (int r = 0; r < W; r++) {
    fsdp_comm_free(ctx[r].comm);
    fsdp_mem_domain_free(ctx[r].domain);
    if (ctx[r].fail[0] || !ctx[r].ok)
      len += (size_t)snprintf(all + len, sizeof all - len < 2 ? 0 : sizeof all - len, "\n  %s",
                              ctx[r].fail[0] ? ctx[r].fail : "(failed without a message)");
    if (len >= sizeof all) len = sizeof all - 1;
  }
  if (all[0]) fail_msg("W=%d:%s", W, all);
}

#endif
