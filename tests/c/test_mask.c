/*
 * test_mask.c — masks and magnitude pruning below the binding (src/fsdp/mask.h): the radix
 * selection (fsdp_prune_select) against a sort by (key, position) for many k, ties, masks and
 * several groups; the same T and P when the group is spread over 1-4 ranks (slices of a flat
 * shard, a replicated piece counted once); mask_select/mask_nm/mask_values/mask_apply on
 * known values; every argument error.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "autograd/autograd.h"
#include "comm/comm.h"
#include "fsdp/mask.h"
#include "ranks.h"

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})

static fsdp_tensor *vec(int64_t n, const float *v) {
  fsdp_tensor *t;
  if (fsdp_tensor_new_f32(&t, 1, SHAPE(n))) return NULL;
  if (v && n) memcpy(fsdp_tensor_data(t, "test"), v, (size_t)n * sizeof *v);
  return t;
}
static float *F(fsdp_tensor *t) { return fsdp_tensor_data(t, "test"); }

static void assert_msg_has(const char *want) {
  if (!strstr(fsdp_error_msg(), want))
    fail_msg("error message \"%s\" lacks \"%s\"", fsdp_error_msg(), want);
}

/* N values with many exact ties (and both signs of each magnitude) */
#define N 300
static void tied_values(float *v, int n, int salt) {
  for (int i = 0; i < n; i++) v[i] = (float)(((i * 37 + salt * 11) % 13) - 6) * 0.25f;
}
static void some_mask(float *m, int n) {
  for (int i = 0; i < n; i++) m[i] = (i * 7) % 9 == 0 ? 0.0f : 1.0f;
}

/* the key of the pruning order (mask.h) */
static uint32_t key_of(float x, const float *m, int i) {
  if (m && m[i] == 0) return 0;
  float a = fabsf(x);
  uint32_t b;
  memcpy(&b, &a, sizeof b);
  return b + 1;
}

static const float *sort_x, *sort_m;
static int by_key_then_pos(const void *a, const void *b) {
  int i = *(const int *)a, j = *(const int *)b;
  uint32_t ki = key_of(sort_x[i], sort_m, i), kj = key_of(sort_x[j], sort_m, j);
  if (ki != kj) return ki < kj ? -1 : 1;
  return i - j;
}

/* want[i] = 0 for the k smallest of x (with mask m or NULL) by key then position, else 1 */
static void brute_force(float *want, const float *x, const float *m, int n, int64_t k) {
  int order[N];
  for (int i = 0; i < n; i++) order[i] = i, want[i] = 1;
  sort_x = x, sort_m = m;
  qsort(order, (size_t)n, sizeof *order, by_key_then_pos);
  for (int64_t j = 0; j < k; j++) want[order[j]] = 0;
}

/* ---- one rank ------------------------------------------------------------------------------- */

/* For many k, with and without a mask, the group held as three pieces: T and P select exactly
 * the k smallest (mask_select's count and values against the sort). */
static void test_select_matches_sort(void **state) {
  (void)state;
  float xv[N], mv[N], want[N];
  tied_values(xv, N, 0);
  some_mask(mv, N);
  fsdp_tensor *x = vec(N, xv), *m = vec(N, mv), *mout = vec(N, NULL), *xs[3], *ms[3];
  const int64_t cut[4] = {0, 100, 101, N}; /* a piece of one element, too */
  for (int p = 0; p < 3; p++) {
    assert_int_equal(fsdp_tensor_narrow(&xs[p], x, 0, cut[p], cut[p + 1] - cut[p]), FSDP_OK);
    assert_int_equal(fsdp_tensor_narrow(&ms[p], m, 0, cut[p], cut[p + 1] - cut[p]), FSDP_OK);
  }
  const int64_t ks[] = {0, 1, 2, 17, 33, 34, 150, 299, 300};
  for (int masked = 0; masked < 2; masked++) {
    for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
      fsdp_prune_piece pcs[3];
      for (int p = 0; p < 3; p++)
        pcs[p] = (fsdp_prune_piece){xs[p], masked ? ms[p] : NULL, (uint64_t)cut[p], true};
      fsdp_prune_group g = {.pieces = pcs, .npieces = 3, .k = ks[ki]};
      assert_int_equal(fsdp_prune_select(&g, 1, NULL, "test"), FSDP_OK);
      int64_t pruned = -1;
      assert_int_equal(fsdp_mask_select(mout, x, masked ? m : NULL, g.T, 0, g.P, &pruned),
                       FSDP_OK);
      assert_int_equal(pruned, ks[ki]);
      brute_force(want, xv, masked ? mv : NULL, N, ks[ki]);
      for (int i = 0; i < N; i++)
        if (F(mout)[i] != want[i])
          fail_msg("masked %d, k %lld: element %d is %g, want %g", masked, (long long)ks[ki], i,
                   (double)F(mout)[i], (double)want[i]);
    }
  }
  for (int p = 0; p < 3; p++) fsdp_tensor_release(xs[p]), fsdp_tensor_release(ms[p]);
  fsdp_tensor_release(x), fsdp_tensor_release(m), fsdp_tensor_release(mout);
}

/* Groups are independent: each gets its own T and P in one lockstep call; k = 0 selects
 * nothing; every element of key T going gives P = 2^53. */
static void test_select_groups(void **state) {
  (void)state;
  float a[4] = {3, 1, 2, 1}, b[3] = {-5, 5, 0.5f};
  fsdp_tensor *xa = vec(4, a), *xb = vec(3, b), *xc = vec(2, a);
  fsdp_prune_piece pa = {xa, NULL, 0, true}, pb = {xb, NULL, 0, true}, pc = {xc, NULL, 0, true};
  fsdp_prune_group g[3] = {{.pieces = &pa, .npieces = 1, .k = 2},  /* both 1s: P = 2^53 */
                           {.pieces = &pb, .npieces = 1, .k = 2},  /* 0.5, then -5 of |5| ties */
                           {.pieces = &pc, .npieces = 1, .k = 0}}; /* nothing */
  assert_int_equal(fsdp_prune_select(g, 3, NULL, "test"), FSDP_OK);
  assert_int_equal(g[0].T, key_of(1.0f, NULL, 0));
  assert_true(g[0].P == (uint64_t)1 << 53);
  assert_int_equal(g[1].T, key_of(5.0f, NULL, 0));
  assert_int_equal(g[1].P, 1); /* position 0 (-5) goes, position 1 (5) stays */
  assert_int_equal(g[2].T, 0);
  assert_int_equal(g[2].P, 0);
  /* no groups at all is nothing to do */
  assert_int_equal(fsdp_prune_select(NULL, 0, NULL, "test"), FSDP_OK);
  fsdp_tensor_release(xa), fsdp_tensor_release(xb), fsdp_tensor_release(xc);
}

static void test_select_errors(void **state) {
  (void)state;
  float v[3] = {1, 2, 3};
  fsdp_tensor *x = vec(3, v), *m2 = vec(2, v), *t;
  fsdp_prune_piece pc = {x, NULL, 0, true};
  fsdp_prune_group g = {.pieces = &pc, .npieces = 1, .k = 5};
  assert_int_equal(fsdp_prune_select(&g, 1, NULL, "prune.magnitude"), FSDP_ERR);
  assert_msg_has("prune.magnitude: group 1 has 2 elements fewer than the 5 to select");
  pc.counts = false; /* another rank counts it: nothing here */
  g.k = 1;
  assert_int_equal(fsdp_prune_select(&g, 1, NULL, "p"), FSDP_ERR);
  assert_msg_has("p: group 1 has 1 elements fewer than the 1 to select");
  pc = (fsdp_prune_piece){x, m2, 0, true};
  assert_int_equal(fsdp_prune_select(&g, 1, NULL, "p"), FSDP_ERR);
  assert_msg_has("mask_hist: the mask has 2 elements, the values 3");
  assert_msg_has("piece 1");
  assert_msg_has("p: group 1");
  g.k = -1;
  assert_int_equal(fsdp_prune_select(&g, 1, NULL, "p"), FSDP_ERR);
  assert_msg_has("p: group 1: k -1 with 1 pieces");
  assert_int_equal(fsdp_prune_select(NULL, 2, NULL, NULL), FSDP_ERR);
  assert_msg_has("prune: 2 groups at");
  /* a strided piece */
  fsdp_tensor *x4 = vec(4, (float[]){1, 2, 3, 4});
  assert_int_equal(fsdp_tensor_view(&t, x4, 2, SHAPE(2, 2)), FSDP_OK);
  fsdp_tensor *tt;
  assert_int_equal(fsdp_tensor_transpose(&tt, t, 0, 1), FSDP_OK);
  pc = (fsdp_prune_piece){tt, NULL, 0, true};
  g.k = 1;
  assert_int_equal(fsdp_prune_select(&g, 1, NULL, "p"), FSDP_ERR);
  assert_msg_has("mask_hist: argument #1 must be contiguous");
  fsdp_tensor_release(tt), fsdp_tensor_release(t), fsdp_tensor_release(x4);
  fsdp_tensor_release(x), fsdp_tensor_release(m2);
}

/* ---- ranks: the selection of a group spread over ranks is the one-rank selection ---------- */

typedef struct {
  int64_t k;
  uint32_t T[2];
  uint64_t P[2];
} spread_arg;

/* Group 0: N tied values, rank r holding the slice [r N / W, (r+1) N / W) (possibly empty),
 * with the mask. Group 1: 7 values every rank holds (a replicated unit), rank 0 counting. */
static bool spread_body(rank_ctx *ctx) {
  spread_arg *a = ctx->arg;
  float xv[N], mv[N];
  tied_values(xv, N, 3);
  some_mask(mv, N);
  int64_t lo = ctx->rank * N / ctx->world, hi = (ctx->rank + 1) * N / ctx->world;
  fsdp_tensor *x = vec(hi - lo, xv + lo), *m = vec(hi - lo, mv + lo), *r = vec(7, xv + 20);
  CHECK(x && m && r);
  fsdp_prune_piece p0 = {x, m, (uint64_t)lo, true}, p1 = {r, NULL, 0, ctx->rank == 0};
  fsdp_prune_group g[2] = {{.pieces = &p0, .npieces = 1, .k = a->k},
                           {.pieces = &p1, .npieces = 1, .k = 3}};
  int rc = fsdp_prune_select(g, 2, ctx->comm, "spread");
  fsdp_tensor_release(x), fsdp_tensor_release(m), fsdp_tensor_release(r);
  CHECK_OK(rc);
  for (int i = 0; i < 2; i++) CHECK(g[i].T == a->T[i] && g[i].P == a->P[i]);
  return true;
}

static void test_select_ranks(void **state) {
  (void)state;
  float xv[N], mv[N];
  tied_values(xv, N, 3);
  some_mask(mv, N);
  fsdp_tensor *x = vec(N, xv), *m = vec(N, mv), *r = vec(7, xv + 20);
  for (int64_t k = 1; k < N; k += 37) {
    /* the one-rank answer */
    fsdp_prune_piece p0 = {x, m, 0, true}, p1 = {r, NULL, 0, true};
    fsdp_prune_group g[2] = {{.pieces = &p0, .npieces = 1, .k = k},
                             {.pieces = &p1, .npieces = 1, .k = 3}};
    assert_int_equal(fsdp_prune_select(g, 2, NULL, "one"), FSDP_OK);
    spread_arg a = {k, {g[0].T, g[1].T}, {g[0].P, g[1].P}};
    for (int W = 1; W <= 4; W++) run_ranks(W, spread_body, &a);
  }
  fsdp_tensor_release(x), fsdp_tensor_release(m), fsdp_tensor_release(r);
}

/* ---- the per-element operations ------------------------------------------------------------ */

static void test_mask_ops(void **state) {
  (void)state;
  fsdp_tensor *x = vec(4, (float[]){-1.5f, 2, -3, 4}), *m = vec(4, (float[]){0, 1, 0, 1});
  uint64_t v0 = x->version;
  assert_int_equal(fsdp_mask_apply(x, m), FSDP_OK);
  assert_true(x->version > v0);
  assert_true(F(x)[0] == 0 && !signbit(F(x)[0]) && F(x)[1] == 2 && F(x)[2] == 0 && F(x)[3] == 4);
  int64_t z, bad, groups;
  uint32_t h1, h2;
  assert_int_equal(fsdp_mask_count_zeros(x, &z), FSDP_OK);
  assert_int_equal(z, 2);
  fsdp_tensor *mm = vec(5, (float[]){0, 1, 0.5f, 1, 2});
  assert_int_equal(fsdp_mask_check(mm, &bad, &z, &h1), FSDP_OK);
  assert_int_equal(bad, 2);
  assert_int_equal(z, 1);
  assert_int_equal(fsdp_mask_check(m, &bad, &z, &h2), FSDP_OK);
  assert_true(bad == 0 && z == 2 && h1 != h2);
  fsdp_tensor *out = vec(4, NULL);
  assert_int_equal(fsdp_mask_from_nonzero(out, x, &z), FSDP_OK);
  assert_true(z == 2 && F(out)[0] == 0 && F(out)[1] == 1 && F(out)[2] == 0 && F(out)[3] == 1);
  /* N:M from lead 1 over 9 elements: groups [1..4], [5..8]; element 0 untouched */
  fsdp_tensor *y = vec(9, (float[]){9, 1, 2, 3, 1, 1, 1, 1, -4}), *o9 = vec(9, NULL);
  for (int i = 0; i < 9; i++) F(o9)[i] = 7;
  assert_int_equal(fsdp_mask_nm(o9, y, NULL, 2, 4, 1, &groups), FSDP_OK);
  assert_int_equal(groups, 2);
  const float want[9] = {7, 0, 1, 1, 0, 0, 0, 1, 1}; /* equal values: the lower index goes */
  for (int i = 0; i < 9; i++) assert_true(F(o9)[i] == want[i]);
  fsdp_tensor *vals = vec(4, NULL), *w = vec(4, (float[]){-2, NAN, 3, 5});
  assert_int_equal(fsdp_mask_values(vals, w, m), FSDP_OK);
  assert_true(F(vals)[0] == -1 && isinf(F(vals)[1]) && F(vals)[2] == -1 && F(vals)[3] == 5);
  fsdp_tensor_release(vals), fsdp_tensor_release(w);
  fsdp_tensor_release(x), fsdp_tensor_release(m), fsdp_tensor_release(mm);
  fsdp_tensor_release(out), fsdp_tensor_release(y), fsdp_tensor_release(o9);
}

static void test_mask_errors(void **state) {
  (void)state;
  fsdp_tensor *x = vec(4, (float[]){1, 2, 3, 4}), *m3 = vec(3, NULL), *e = vec(0, NULL), *v, *tr,
              *d;
  int64_t z;
  assert_int_equal(fsdp_mask_apply(x, m3), FSDP_ERR);
  assert_msg_has("mask_apply: the tensors have 4 and 3 elements");
  assert_int_equal(fsdp_mask_select(x, x, m3, 0, 0, 0, &z), FSDP_ERR);
  assert_msg_has("mask_select: the mask has 3 elements, the values 4");
  assert_int_equal(fsdp_mask_nm(x, x, NULL, 3, 2, 0, &z), FSDP_ERR);
  assert_msg_has("mask_nm: need 0 <= n <= m <= 4096 (got n = 3, m = 2)");
  assert_int_equal(fsdp_mask_nm(x, x, NULL, 1, 2, -1, &z), FSDP_ERR);
  assert_msg_has("mask_nm: lead must be >= 0");
  assert_int_equal(fsdp_tensor_view(&v, x, 2, SHAPE(2, 2)), FSDP_OK);
  assert_int_equal(fsdp_tensor_transpose(&tr, v, 0, 1), FSDP_OK);
  assert_int_equal(fsdp_mask_count_zeros(tr, &z), FSDP_ERR);
  assert_msg_has("count_zeros: argument #1 must be contiguous (got shape (2, 2)");
  assert_int_equal(fsdp_tensor_new(&d, &fsdp_device_cpu, FSDP_DTYPE_F64, 1, SHAPE(4),
                                   FSDP_ROLE_ACTIVATIONS),
                   FSDP_OK);
  assert_int_equal(fsdp_mask_values(x, d, NULL), FSDP_ERR);
  assert_msg_has("mask_values: argument #2 is f64, argument #1 f32");
  /* the kernels refuse a dtype they lack */
  assert_int_equal(fsdp_mask_count_zeros(d, &z), FSDP_ERR);
  assert_msg_has("count_zeros");
  /* no elements: nothing to compute, no kernel asked */
  assert_int_equal(fsdp_mask_count_zeros(e, &z), FSDP_OK);
  assert_int_equal(z, 0);
  fsdp_tensor_release(x), fsdp_tensor_release(m3), fsdp_tensor_release(e);
  fsdp_tensor_release(v), fsdp_tensor_release(tr), fsdp_tensor_release(d);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_select_matches_sort), cmocka_unit_test(test_select_groups),
      cmocka_unit_test(test_select_errors),       cmocka_unit_test(test_select_ranks),
      cmocka_unit_test(test_mask_ops),            cmocka_unit_test(test_mask_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
