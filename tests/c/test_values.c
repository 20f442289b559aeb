/*
 * test_values.c — collectives over values (src/comm/values.c) at 1-4 ranks: byte strings of
 * different lengths (empty ones, all empty, embedded NULs) gathered from every rank and
 * broadcast from each root, tensors reduced and broadcast in place (versions bumped, a strided
 * view refused before anything is issued), the digest against FNV-1a's published values.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "autograd/autograd.h"
#include "comm/comm.h"
#include "ranks.h"

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})

/* fsdp_comm_alloc_fn over a few malloc'd blocks the rank frees at its end */
typedef struct {
  void *block[4];
  int n;
} blocks;
static void *take(void *ud, size_t n) {
  blocks *b = ud;
  return b->n < 4 ? (b->block[b->n++] = malloc(n)) : NULL;
}
static void give_back(blocks *b) {
  for (int i = 0; i < b->n; i++) free(b->block[i]);
}

/* rank r's string: r * 3 bytes (rank 0's is empty), with a NUL inside from 2 bytes on; all
 * empty when every is true */
static size_t string_of(int r, bool empty, char *s) {
  size_t n = empty ? 0 : (size_t)r * 3;
  for (size_t i = 0; i < n; i++) s[i] = i == 1 ? '\0' : (char)('a' + r + (int)i);
  return n;
}

static bool gather_body(rank_ctx *ctx) {
  for (int empty = 0; empty < 2; empty++) {
    char s[16], want[16];
    size_t len = string_of(ctx->rank, empty, s), stride;
    int64_t lens[RANKS_MAX];
    char *all;
    blocks b = {0};
    int rc = fsdp_comm_all_gather_bytes(ctx->comm, s, len, lens, &all, &stride, take, &b, "g");
    bool same = rc == FSDP_OK;
    for (int p = 0; same && p < ctx->world; p++) {
      size_t n = string_of(p, empty, want);
      same = lens[p] == (int64_t)n && (n == 0 || memcmp(all + (size_t)p * stride, want, n) == 0);
    }
    bool none = all == NULL && stride == 0 && b.n == 0;
    give_back(&b);
    CHECK_OK(rc);
    CHECK(same);
    /* one collective (the lengths) when every string is empty, or with a single rank of "" */
    CHECK(none == (empty || ctx->world == 1));
  }
  return true;
}

static bool broadcast_body(rank_ctx *ctx) {
  for (int root = 0; root < ctx->world; root++) {
    char s[16], want[16];
    size_t len = string_of(ctx->rank, false, s), n, wn = string_of(root, false, want);
    const char *out;
    blocks b = {0};
    /* a rank other than the root passes nothing */
    bool me = ctx->rank == root;
    int rc = fsdp_comm_broadcast_bytes(ctx->comm, me ? s : NULL, me ? len : 0, root, &out, &n,
                                       take, &b, "b");
    bool ok = rc == FSDP_OK && n == wn && (n == 0 || memcmp(out, want, n) == 0) &&
              (me ? out == s || n == 0 : out[n] == '\0');
    give_back(&b);
    CHECK_OK(rc);
    CHECK(ok);
  }
  const char *out;
  size_t n;
  CHECK(fsdp_comm_broadcast_bytes(ctx->comm, "x", 1, ctx->world, &out, &n, take, NULL, "b") ==
        FSDP_ERR);
  char want[80];
  snprintf(want, sizeof want, "broadcast_bytes: root %d is not a rank in [0, %d)", ctx->world,
           ctx->world);
  CHECK_MSG(want);
  return true;
}

static bool tensor_body(rank_ctx *ctx) {
  fsdp_tensor *t, *v, *tr;
  CHECK_OK(fsdp_tensor_new_f32(&t, 1, SHAPE(6)));
  float *d = fsdp_tensor_data(t, "test");
  for (int i = 0; i < 6; i++) d[i] = (float)(ctx->rank * 10 + i);
  uint64_t v0 = t->version;
  int rc = fsdp_comm_all_reduce_tensor(ctx->comm, t, FSDP_RED_SUM, "sum");
  bool ok = rc == FSDP_OK && t->version > v0;
  int W = ctx->world;
  for (int i = 0; ok && i < 6; i++) ok = d[i] == (float)(10 * W * (W - 1) / 2 + W * i);
  for (int i = 0; i < 6; i++) d[i] = (float)(ctx->rank * 10 + i);
  int rc2 = fsdp_comm_broadcast_tensor(ctx->comm, t, W - 1, "bc");
  for (int i = 0; ok && i < 6; i++) ok = d[i] == (float)((W - 1) * 10 + i);
  /* a strided view: refused before anything is issued (every rank refuses alike here) */
  int rc3 = fsdp_tensor_view(&v, t, 2, SHAPE(2, 3)) || fsdp_tensor_transpose(&tr, v, 0, 1);
  int rc4 = rc3 ? FSDP_OK : fsdp_comm_all_reduce_tensor(ctx->comm, tr, FSDP_RED_SUM, "x");
  char msg[256];
  snprintf(msg, sizeof msg, "%s", fsdp_error_msg());
  if (!rc3) fsdp_tensor_release(v), fsdp_tensor_release(tr);
  fsdp_tensor_release(t);
  CHECK_OK(rc);
  CHECK_OK(rc2);
  CHECK(ok);
  CHECK_OK(rc3);
  CHECK(rc4 == FSDP_ERR);
  CHECK(strstr(msg, "all_reduce: needs a contiguous tensor, got a strided view (3, 2)"));
  /* the communicator still works: nothing was issued */
  CHECK_OK(fsdp_comm_barrier(ctx->comm, "after"));
  return true;
}

static void test_all_gather_bytes(void **state) {
  (void)state;
  for (int W = 1; W <= 4; W++) run_ranks(W, gather_body, NULL);
}

static void test_broadcast_bytes(void **state) {
  (void)state;
  for (int W = 1; W <= 4; W++) run_ranks(W, broadcast_body, NULL);
}

static void test_tensors(void **state) {
  (void)state;
  for (int W = 1; W <= 4; W++) run_ranks(W, tensor_body, NULL);
}

static void *no_memory(void *ud, size_t n) {
  (void)ud, (void)n;
  return NULL;
}

/* The errors a rank raises alone, at world size 1 (at larger ones a peer would wait on it): a
 * NULL string of some length, an allocator out of memory. */
static bool errors_body(rank_ctx *ctx) {
  int64_t lens[1];
  char *all;
  size_t stride, n;
  const char *out;
  CHECK(fsdp_comm_all_gather_bytes(ctx->comm, NULL, 3, lens, &all, &stride, take, NULL, "e") ==
        FSDP_ERR);
  CHECK_MSG("all_gather_bytes: NULL string of 3 bytes");
  CHECK(fsdp_comm_all_gather_bytes(ctx->comm, "abc", 3, lens, &all, &stride, no_memory, NULL,
                                   "e") == FSDP_ERR);
  CHECK_MSG("all_gather_bytes: out of memory for 1 x 3 bytes");
  CHECK(all == NULL && stride == 0);
  CHECK(fsdp_comm_broadcast_bytes(ctx->comm, NULL, 2, 0, &out, &n, take, NULL, "e") == FSDP_ERR);
  CHECK_MSG("broadcast_bytes: NULL string of 2 bytes");
  /* a root's NULL string of no bytes is the empty string */
  CHECK_OK(fsdp_comm_broadcast_bytes(ctx->comm, NULL, 0, 0, &out, &n, no_memory, NULL, "e"));
  CHECK(n == 0 && out != NULL && out[0] == '\0');
  return true;
}

static void test_errors(void **state) {
  (void)state;
  run_ranks(1, errors_body, NULL);
}

/* FNV-1a 64 of "" and "a" (the published test vectors) */
static void test_digest(void **state) {
  (void)state;
  assert_true(fsdp_comm_digest("", 0) == 0xcbf29ce484222325ull);
  assert_true(fsdp_comm_digest("a", 1) == 0xaf63dc4c8601ec8cull);
  assert_true(fsdp_comm_digest("a\0b", 3) != fsdp_comm_digest("a\0c", 3));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_all_gather_bytes),
      cmocka_unit_test(test_broadcast_bytes),
      cmocka_unit_test(test_tensors),
      cmocka_unit_test(test_digest),
      cmocka_unit_test(test_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
