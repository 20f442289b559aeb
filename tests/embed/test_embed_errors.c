/*
 * test_embed_errors.c — error paths of the embedding API (include/fsdp.h; linked against
 * libfsdp.so only, like a host program): the status each returns and the message it leaves.
 *
 * Shape queries (out[k].data NULL) with ndim out of range are FSDP_MISUSE naming out[k] before
 * anything runs, and nothing reads past their shape (under memcheck: no invalid read). A result
 * of fsdp_call_ranks that does not fit names the host's out[r * n_out + k]. A parameter lookup
 * whose model raises a value that is not a string says so (not "(null)"). The callback setters
 * clear the last error when they succeed and return FSDP_BROKEN once the runtime is broken. A
 * call from inside a callback is FSDP_MISUSE with its message for fsdp_last_error(rt) on that
 * thread, and leaves the host's message of the call in progress alone.
 *
 * Exit status 0 when every check passed; a hang ends the program after 60 s (SIGALRM).
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>

#include "check.h"

static fsdp_runtime *make(int world) {
  fsdp_runtime *rt = NULL;
  int st = fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = world, .timeout_s = 30});
  CHECK(st == FSDP_OK && rt != NULL, "fsdp_runtime_new(world %d): %s", world,
        fsdp_last_error(NULL));
  return rt;
}

/* ---- shape queries --------------------------------------------------------------------------- */

static void test_shape_queries(void) {
  fsdp_runtime *rt = make(2);
  if (rt == NULL) return;
  OK(rt, fsdp_run_string(rt, "local fsdp = require 'fsdp'\n"
                             "calls = 0\n"
                             "function num() calls = calls + 1; return 1 end\n"
                             "function vec()\n"
                             "  calls = calls + 1\n"
                             "  return fsdp.zeros{fsdp.rank() + 2}\n"
                             "end"));
  /* on the heap, sized for one tensor: a read past its shape is an invalid read under memcheck */
  fsdp_host_tensor *q = calloc(1, sizeof *q);
  const int bad[] = {1 << 28, FSDP_HOST_MAX_DIMS + 1, 12, -1};
  const char *fns[] = {"num", "vec"};
  for (size_t f = 0; f < 2; f++) {
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
      *q = (fsdp_host_tensor){.data = NULL, .ndim = bad[i]};
      char want[96];
      snprintf(want, sizeof want, "fsdp_call: out[0]: ndim %d is out of range (0 .. %d)", bad[i],
               FSDP_HOST_MAX_DIMS);
      EXPECT(rt, fsdp_call(rt, fns[f], NULL, 0, q, 1), FSDP_MISUSE, want);
      CHECK(q->ndim == bad[i], "%s: a refused query's ndim was written: %d", fns[f], q->ndim);
    }
  }
  /* fsdp_call_ranks: rank 1's query, out[1] */
  fsdp_host_tensor qs[2] = {{.ndim = 0}, {.ndim = 1 << 28}};
  EXPECT(rt, fsdp_call_ranks(rt, "vec", NULL, 0, qs, 1), FSDP_MISUSE,
         "fsdp_call_ranks: out[1]: ndim 268435456 is out of range (0 .. 8)");
  /* nothing ran: the checks come first */
  float calls = -1;
  fsdp_host_tensor n = {.data = &calls};
  OK(rt, fsdp_call(rt, "num", NULL, 0, &n, 1));
  CHECK(calls == 1, "a refused query ran the function: %g calls", calls);

  /* a query in range works whatever its shape holds (the shape is only written) */
  *q = (fsdp_host_tensor){.data = NULL, .ndim = FSDP_HOST_MAX_DIMS,
                          .shape = {-5, 1 << 30, -1, 0, 7, 7, 7, 7}};
  OK(rt, fsdp_call(rt, "vec", NULL, 0, q, 1));
  CHECK(q->ndim == 1 && q->shape[0] == 2, "query of vec: ndim %d shape[0] %lld", q->ndim,
        (long long)q->shape[0]);
  *q = (fsdp_host_tensor){.data = NULL, .ndim = 3, .shape = {-1, -1, -1}};
  OK(rt, fsdp_call(rt, "num", NULL, 0, q, 1));
  CHECK(q->ndim == 0, "query of num: ndim %d", q->ndim);
  qs[0] = (fsdp_host_tensor){.ndim = 0};
  qs[1] = (fsdp_host_tensor){.ndim = 2, .shape = {-3, -3}};
  OK(rt, fsdp_call_ranks(rt, "vec", NULL, 0, qs, 1));
  CHECK(qs[0].ndim == 1 && qs[0].shape[0] == 2 && qs[1].ndim == 1 && qs[1].shape[0] == 3,
        "queries per rank: (%d: %lld) (%d: %lld)", qs[0].ndim, (long long)qs[0].shape[0],
        qs[1].ndim, (long long)qs[1].shape[0]);
  free(q);
  fsdp_runtime_free(rt);
}

/* ---- results per rank ------------------------------------------------------------------------ */

static void test_ranks_results(void) {
  fsdp_runtime *rt = make(3);
  if (rt == NULL) return;
  /* rank r returns a number and a tensor of r + 2 elements; `odd` makes one rank's first result
   * a tensor instead */
  OK(rt, fsdp_run_string(rt, "local fsdp = require 'fsdp'\n"
                             "function g(odd)\n"
                             "  local r = fsdp.rank()\n"
                             "  local first = r == odd and fsdp.zeros{2} or r\n"
                             "  return first, fsdp.zeros{r + 2}\n"
                             "end\n"
                             "function g2() return g(-1) end\n"
                             "function g1() return g(1) end"));
  float num[3], vec[3][4];
  fsdp_host_tensor out[6];
  for (int r = 0; r < 3; r++) {
    out[2 * r] = (fsdp_host_tensor){.data = &num[r]};
    out[2 * r + 1] = (fsdp_host_tensor){.data = vec[r], .ndim = 1, .shape = {r + 2}};
  }
  OK(rt, fsdp_call_ranks(rt, "g2", NULL, 0, out, 2));
  /* rank 2's second result does not fit: out[2 * 2 + 1], not the per-rank index 1 */
  out[5] = (fsdp_host_tensor){.data = vec[2], .ndim = 1, .shape = {3}};
  EXPECT(rt, fsdp_call_ranks(rt, "g2", NULL, 0, out, 2), FSDP_ERROR,
         "[rank 2] result 2 of 'g2' has shape (4) (4 elements), but out[5] holds 3");
  /* rank 1's first result is a tensor of 2 for a one-element buffer: out[2] */
  out[5] = (fsdp_host_tensor){.data = vec[2], .ndim = 1, .shape = {4}};
  EXPECT(rt, fsdp_call_ranks(rt, "g1", NULL, 0, out, 2), FSDP_ERROR,
         "[rank 1] result 1 of 'g1' has shape (2) (2 elements), but out[2] holds 1");
  /* and a number into a buffer of more: out[4] */
  out[4] = (fsdp_host_tensor){.data = vec[2], .ndim = 1, .shape = {4}};
  EXPECT(rt, fsdp_call_ranks(rt, "g2", NULL, 0, out, 2), FSDP_ERROR,
         "[rank 2] result 1 of 'g2' is a number, but out[4] holds 4 elements");
  /* fsdp_call: rank 0's results, out[k] */
  out[1] = (fsdp_host_tensor){.data = vec[0], .ndim = 1, .shape = {3}};
  EXPECT(rt, fsdp_call(rt, "g2", NULL, 0, out, 2), FSDP_ERROR,
         "result 2 of 'g2' has shape (2) (2 elements), but out[1] holds 3");
  fsdp_runtime_free(rt);
}

/* ---- parameter lookup ------------------------------------------------------------------------ */

static void test_param_lookup(void) {
  fsdp_runtime *rt = make(2);
  if (rt == NULL) return;
  int ndim = -1;
  int64_t shape[FSDP_HOST_MAX_DIMS];
  float w;
  /* the model's own code raises while the parameter is looked up: a table, nil, a number */
  const char *raised[][2] = {{"{reason = 'x'}", "(error object is not a string)"},
                             {"nil", "(error object is not a string)"},
                             {"42", "host:1: 42"}};
  for (size_t i = 0; i < sizeof raised / sizeof raised[0]; i++) {
    char code[160], want[96];
    snprintf(code, sizeof code, "model = {named_modules = function() error(%s) end}",
             raised[i][0]);
    OK(rt, fsdp_run_string(rt, code));
    snprintf(want, sizeof want, "fsdp_param_shape: [rank 0] %s", raised[i][1]);
    EXPECT(rt, fsdp_param_shape(rt, "weight", &ndim, shape), FSDP_ERROR, want);
    snprintf(want, sizeof want, "fsdp_read_param: [rank 0] %s", raised[i][1]);
    EXPECT(rt, fsdp_read_param(rt, "weight", &w, 1), FSDP_ERROR, want);
    CHECK(strstr(fsdp_last_error(rt), "(null)") == NULL, "error(%s): '%s'", raised[i][0],
          fsdp_last_error(rt));
  }
  /* a lookup failure breaks nothing */
  OK(rt, fsdp_run_string(rt, "model = require('fsdp').nn.Linear(2, 1)"));
  OK(rt, fsdp_param_shape(rt, "weight", &ndim, shape));
  CHECK(ndim == 2 && shape[0] == 1 && shape[1] == 2, "shape of weight: ndim %d", ndim);
  fsdp_runtime_free(rt);
}

/* ---- callback setters ------------------------------------------------------------------------ */

static void on_log_quiet(void *ud, int rank, const char *line) {
  (void)ud;
  (void)rank;
  (void)line;
}

static int no_data(void *ud, fsdp_batch *b) {
  (void)ud;
  (void)b;
  return FSDP_DONE;
}

static void test_setters(void) {
  fsdp_runtime *rt = make(2);
  if (rt == NULL) return;
  /* a successful setter clears the last failure, as every successful call does */
  EXPECT(rt, fsdp_call(rt, "missing", NULL, 0, NULL, 0), FSDP_ERROR, "'missing' is not");
  OK(rt, fsdp_set_log_callback(rt, on_log_quiet, NULL));
  CHECK(strcmp(fsdp_last_error(rt), "") == 0, "after fsdp_set_log_callback: '%s'",
        fsdp_last_error(rt));
  EXPECT(rt, fsdp_call(rt, "missing", NULL, 0, NULL, 0), FSDP_ERROR, "'missing' is not");
  OK(rt, fsdp_set_data_source(rt, no_data, NULL));
  CHECK(strcmp(fsdp_last_error(rt), "") == 0, "after fsdp_set_data_source: '%s'",
        fsdp_last_error(rt));
  OK(rt, fsdp_run_string(rt, "assert(require('fsdp').host.next_batch() == nil)"));

  /* once broken, every call returns FSDP_BROKEN with the first failure, setters included */
  EXPECT(rt, fsdp_run_string(rt, "error('boom')"), FSDP_BROKEN, "host:1: boom");
  EXPECT(rt, fsdp_set_log_callback(rt, NULL, NULL), FSDP_BROKEN,
         "fsdp_set_log_callback: the runtime is broken by an earlier failure");
  CHECK(strstr(fsdp_last_error(rt), "boom") != NULL, "the first failure: '%s'",
        fsdp_last_error(rt));
  EXPECT(rt, fsdp_set_log_callback(rt, on_log_quiet, NULL), FSDP_BROKEN, "boom");
  EXPECT(rt, fsdp_set_data_source(rt, no_data, NULL), FSDP_BROKEN,
         "fsdp_set_data_source: the runtime is broken by an earlier failure");
  EXPECT(rt, fsdp_set_data_source(rt, NULL, NULL), FSDP_BROKEN, "boom");
  fsdp_runtime_free(rt);

  EXPECT(NULL, fsdp_set_log_callback(NULL, on_log_quiet, NULL), FSDP_MISUSE,
         "fsdp_set_log_callback: the runtime is NULL");
  EXPECT(NULL, fsdp_set_data_source(NULL, NULL, NULL), FSDP_MISUSE,
         "fsdp_set_data_source: the runtime is NULL");
}

/* fsdp.debug() has no REPL in a host program: refused at one rank as at two, without reading
 * the host's standard input (Lua's debug.debug() would) */
static void test_debug_refused(void) {
  for (int world = 1; world <= 2; world++) {
    fsdp_runtime *rt = make(world);
    if (rt == NULL) return;
    EXPECT(rt, fsdp_run_string(rt, "require('fsdp').debug()"), FSDP_BROKEN,
           "fsdp.debug: the REPL needs fsdprun");
    fsdp_runtime_free(rt);
  }
}

/* n_in and n_out: 200 each at most (fsdp.h), more is FSDP_MISUSE naming them, and runs nothing */
static void test_counts(void) {
  fsdp_runtime *rt = make(2);
  if (rt == NULL) return;
  static float v[201], o[201];
  static fsdp_host_tensor in[201], out[201];
  for (int i = 0; i < 201; i++) {
    v[i] = (float)i;
    in[i] = (fsdp_host_tensor){.data = &v[i]};
    out[i] = (fsdp_host_tensor){.data = &o[i]};
  }
  OK(rt, fsdp_run_string(rt, "calls = 0\n"
                             "function echo(...) calls = calls + 1; return ... end"));
  OK(rt, fsdp_call(rt, "echo", in, 200, out, 200));
  CHECK(o[0] == 0 && o[199] == 199, "200 values through: %g %g", o[0], o[199]);
  EXPECT(rt, fsdp_call(rt, "echo", in, 201, out, 0), FSDP_MISUSE,
         "fsdp_call: n_in 201 / n_out 0 out of range (0 .. 200)");
  EXPECT(rt, fsdp_call_ranks(rt, "echo", NULL, 0, out, 201), FSDP_MISUSE,
         "fsdp_call_ranks: n_in 0 / n_out 201 out of range (0 .. 200)");
  OK(rt, fsdp_run_string(rt, "assert(calls == 1, calls)"));
  fsdp_runtime_free(rt);
}

/* A data source that answers with a status that is none of its three (FSDP_OK, FSDP_DONE,
 * FSDP_ERROR): next_batch raises naming the status, not "failed (no message)". */
static int odd_status(void *ud, fsdp_batch *b) {
  (void)b;
  return *(int *)ud;
}

static void test_source_status(void) {
  static const int odd[] = {42, FSDP_MISUSE};
  static const char *const want[] = {"the data source returned status 42 (unknown status)",
                                     "the data source returned status -2 (misuse)"};
  for (int i = 0; i < 2; i++) {
    fsdp_runtime *rt = make(1);
    if (rt == NULL) return;
    int st = odd[i];
    OK(rt, fsdp_set_data_source(rt, odd_status, &st));
    EXPECT(rt, fsdp_run_string(rt, "require('fsdp').host.next_batch()"), FSDP_BROKEN, want[i]);
    fsdp_runtime_free(rt);
  }
}

/* ---- calls from inside callbacks ------------------------------------------------------------- */

typedef struct reentry {
  fsdp_runtime *rt;
  int st[2][3];         /* per rank: the statuses of the calls it made from its callback */
  char msg[2][3][160];  /* and fsdp_last_error(rt) after each */
  char tl[2][160];      /* fsdp_last_error(NULL) after the first */
} reentry;

static void keep(char *dst, const char *src) { snprintf(dst, 160, "%s", src); }

static void on_log_calls_in(void *ud, int rank, const char *line) {
  reentry *e = ud;
  (void)line;
  if (rank < 0 || rank > 1) return;
  e->st[rank][0] = fsdp_run_string(e->rt, "x = 1");
  keep(e->msg[rank][0], fsdp_last_error(e->rt));
  keep(e->tl[rank], fsdp_last_error(NULL));
  e->st[rank][1] = fsdp_set_log_callback(e->rt, NULL, NULL);
  keep(e->msg[rank][1], fsdp_last_error(e->rt));
  fsdp_runtime *other = NULL;
  e->st[rank][2] = fsdp_runtime_new(&other, NULL);
  keep(e->msg[rank][2], fsdp_last_error(e->rt));
  fsdp_runtime_free(other);
}

static int source_calls_in(void *ud, fsdp_batch *b) {
  reentry *e = ud;
  static float one = 1;
  if (b->rank < 0 || b->rank > 1) return FSDP_ERROR;
  float v;
  fsdp_host_tensor out = {.data = &v};
  e->st[b->rank][0] = fsdp_call(e->rt, "f", NULL, 0, &out, 1);
  keep(e->msg[b->rank][0], fsdp_last_error(e->rt));
  e->st[b->rank][1] = fsdp_param_shape(e->rt, "weight", NULL, NULL);
  keep(e->msg[b->rank][1], fsdp_last_error(e->rt));
  b->n = 1;
  b->tensors[0] = (fsdp_host_tensor){.data = &one};
  return FSDP_OK;
}

static void test_callback_errors(void) {
  reentry e = {.rt = make(2)};
  if (e.rt == NULL) return;
  /* the log callback: each rank's refusals read back through fsdp_last_error(rt) */
  OK(e.rt, fsdp_set_log_callback(e.rt, on_log_calls_in, &e));
  OK(e.rt, fsdp_run_string(e.rt, "print('hello')"));
  CHECK(strcmp(fsdp_last_error(e.rt), "") == 0,
        "the host's last error after a call whose callback was refused: '%s'",
        fsdp_last_error(e.rt));
  const char *want[3] = {"fsdp_run_string: called from inside a runtime callback",
                         "fsdp_set_log_callback: called from inside a runtime callback",
                         "fsdp_runtime_new: called from inside a runtime callback"};
  for (int r = 0; r < 2; r++) {
    for (int c = 0; c < 3; c++)
      CHECK(e.st[r][c] == FSDP_MISUSE && strstr(e.msg[r][c], want[c]) != NULL,
            "rank %d, call %d from the log callback: %s, fsdp_last_error(rt) '%s'", r, c,
            fsdp_status_name(e.st[r][c]), e.msg[r][c]);
    CHECK(strstr(e.tl[r], want[0]) != NULL, "rank %d: fsdp_last_error(NULL) '%s'", r, e.tl[r]);
  }
  /* the refused setter changed nothing: the callback is still set */
  memset(e.st, 0, sizeof e.st);
  OK(e.rt, fsdp_run_string(e.rt, "if require('fsdp').rank() == 1 then print('again') end"));
  CHECK(e.st[1][0] == FSDP_MISUSE && e.st[0][0] == 0, "the log callback is still set: %d %d",
        e.st[0][0], e.st[1][0]);
  OK(e.rt, fsdp_set_log_callback(e.rt, NULL, NULL));

  /* the data source */
  memset(&e.st, 0, sizeof e.st);
  OK(e.rt, fsdp_set_data_source(e.rt, source_calls_in, &e));
  OK(e.rt, fsdp_run_string(e.rt, "function f() return 1 end\n"
                                 "assert(require('fsdp').host.next_batch():item() == 1)"));
  CHECK(strcmp(fsdp_last_error(e.rt), "") == 0, "the host's last error: '%s'",
        fsdp_last_error(e.rt));
  for (int r = 0; r < 2; r++) {
    CHECK(e.st[r][0] == FSDP_MISUSE &&
              strstr(e.msg[r][0], "fsdp_call: called from inside a runtime callback") != NULL,
          "rank %d: fsdp_call from the data source: %s, '%s'", r, fsdp_status_name(e.st[r][0]),
          e.msg[r][0]);
    CHECK(e.st[r][1] == FSDP_MISUSE &&
              strstr(e.msg[r][1], "fsdp_param_shape: called from inside a runtime callback") !=
                  NULL,
          "rank %d: fsdp_param_shape from the data source: %s, '%s'", r,
          fsdp_status_name(e.st[r][1]), e.msg[r][1]);
  }
  fsdp_runtime_free(e.rt);
}

int main(void) {
  alarm(getenv("FSDP_UNDER_VALGRIND") ? 300 : 60); /* a hang fails the test */
  test_shape_queries();
  test_ranks_results();
  test_param_lookup();
  test_setters();
  test_source_status();
  test_counts();
  test_debug_refused();
  test_callback_errors();
  printf("test_embed_errors: %d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
