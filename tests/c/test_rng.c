/*
 * test_rng.c — the counter-based RNG (src/core/rng.c): Philox4x32-10 against Random123's
 * published known-answer vectors, the element-index contract that lets a rank generate only
 * its shard (one call == the same elements generated in pieces), and the distributions.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/core.h"

/* Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter[4] key[2] -> out[4]. */
static void test_philox_kat(void **state) {
  (void)state;
  static const struct {
    uint32_t ctr[4], key[2], want[4];
  } kat[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (size_t i = 0; i < sizeof kat / sizeof kat[0]; i++) {
    uint32_t out[4];
    fsdp_philox4x32_10(out, kat[i].ctr, kat[i].key);
    for (int j = 0; j < 4; j++) assert_int_equal(out[j], kat[i].want[j]);
  }
}

/* The 64-bit API packs key -> (k0 low, k1 high), counter -> (low, high, 0, 0). */
static void test_philox_packing(void **state) {
  (void)state;
  uint64_t key = 0x299f31d0a4093822ull, ctr = 0x85a308d3243f6a88ull;
  uint32_t a[4], b[4];
  fsdp_philox4x32(a, key, ctr);
  fsdp_philox4x32_10(b, (const uint32_t[4]){0x243f6a88, 0x85a308d3, 0, 0},
                     (const uint32_t[2]){0xa4093822, 0x299f31d0});
  assert_memory_equal(a, b, sizeof a);
  fsdp_philox4x32(a, 0, 0);
  assert_int_equal(a[0], 0x6627e8d5); /* KAT vector 1 through the packed API */
  assert_int_equal(a[3], 0x9b00dbd8);
}

static void test_key(void **state) {
  (void)state;
  uint64_t a = fsdp_rng_key(42, "wte.weight");
  assert_true(a == fsdp_rng_key(42, "wte.weight"));
  assert_true(a != fsdp_rng_key(42, "wpe.weight"));
  assert_true(a != fsdp_rng_key(43, "wte.weight"));
  assert_true(fsdp_rng_key(42, "") == fsdp_rng_key(42, NULL));
  assert_true(fsdp_rng_key(0, "a") != fsdp_rng_key(0, "b"));
  assert_true(fsdp_rng_key_mix(a, 0) != fsdp_rng_key_mix(a, 1));
  assert_true(fsdp_rng_key_mix(a, 0) != a);
  /* Pinned: every initialisation in every checkpoint depends on this hash. Changing it is a
   * deliberate, announced break, not a refactor. */
  assert_int_equal(fsdp_rng_key(0, ""), UINT64_C(0xaebe53f85cdc3c4c));
  assert_int_equal(fsdp_rng_key(1234, "blocks.1.mlp.fc.weight"), UINT64_C(0xa29035724f55a038));
}

/* element e is (lane e % 4 of block e / 4) >> 8, times 2^-24 */
static void test_uniform_definition(void **state) {
  (void)state;
  uint64_t key = fsdp_rng_key(7, "u");
  float out[37];
  fsdp_rng_uniform(out, 37, key, 1001);
  for (int i = 0; i < 37; i++) {
    uint64_t e = 1001 + (uint64_t)i;
    uint32_t r[4];
    fsdp_philox4x32(r, key, e / 4);
    assert_true(out[i] == (float)(r[e % 4] >> 8) / 16777216.0f);
  }
}

/* One call over [first, first + n) equals the same range cut into pieces at odd offsets. */
static void check_pieces(void (*gen)(float *, int64_t, uint64_t, uint64_t, void *), void *arg,
                         uint64_t first) {
  enum { N = 103 };
  float whole[N], parts[N];
  uint64_t key = fsdp_rng_key(99, "pieces");
  gen(whole, N, key, first, arg);
  static const int cuts[] = {0, 1, 2, 3, 7, 8, 13, 50, 51, 97, N};
  for (size_t c = 0; c + 1 < sizeof cuts / sizeof cuts[0]; c++)
    gen(parts + cuts[c], cuts[c + 1] - cuts[c], key, first + (uint64_t)cuts[c], arg);
  assert_memory_equal(whole, parts, sizeof whole);
  /* and a rank-style split: 3 "ranks" of 35 elements, the last one short */
  for (int r = 0; r < 3; r++) {
    int64_t lo = r * 35, n = r == 2 ? N - 70 : 35;
    gen(parts + lo, n, key, first + (uint64_t)lo, arg);
  }
  assert_memory_equal(whole, parts, sizeof whole);
}

static void gen_uniform(float *o, int64_t n, uint64_t k, uint64_t f, void *arg) {
  (void)arg;
  fsdp_rng_uniform(o, n, k, f);
}
static void gen_normal(float *o, int64_t n, uint64_t k, uint64_t f, void *arg) {
  (void)arg;
  fsdp_rng_normal(o, n, k, f, 0.5f, 2.0f);
}

static void test_slices(void **state) {
  (void)state;
  static const uint64_t firsts[] = {0, 1, 2, 3, 5, 1ull << 40, (1ull << 40) + 3};
  for (size_t i = 0; i < sizeof firsts / sizeof firsts[0]; i++) {
    check_pieces(gen_uniform, NULL, firsts[i]);
    check_pieces(gen_normal, NULL, firsts[i]);
  }
  /* zero-length requests write nothing */
  float sentinel = 123.0f;
  fsdp_rng_normal(&sentinel, 0, 1, 0, 0, 1);
  fsdp_rng_uniform(&sentinel, 0, 1, 0);
  assert_true(sentinel == 123.0f);
}

/* lanes (0,1) and (2,3) are Box-Muller pairs: z0^2 + z1^2 = -2 ln u1 from lane 0 */
static void test_normal_pairs(void **state) {
  (void)state;
  uint64_t key = fsdp_rng_key(5, "pairs");
  float z[8];
  fsdp_rng_normal(z, 8, key, 8, 0.0f, 1.0f); /* blocks 2 and 3 */
  for (int b = 0; b < 2; b++) {
    uint32_t r[4];
    fsdp_philox4x32(r, key, 2 + (uint64_t)b);
    for (int p = 0; p < 4; p += 2) {
      double u1 = ((r[p] >> 8) + 1) / 16777216.0;
      double u2 = (r[p + 1] >> 8) / 16777216.0;
      double rad = sqrt(-2 * log(u1));
      assert_true(fabs(z[4 * b + p] - rad * cos(6.283185307179586 * u2)) < 1e-5 * (1 + rad));
      assert_true(fabs(z[4 * b + p + 1] - rad * sin(6.283185307179586 * u2)) < 1e-5 * (1 + rad));
    }
  }
}

static void test_distributions(void **state) {
  (void)state;
  enum { N = 1000000 };
  float *x = malloc(N * sizeof *x);
  assert_non_null(x);

  fsdp_rng_uniform(x, N, fsdp_rng_key(1, "uniform"), 0);
  double s = 0, s2 = 0;
  for (int i = 0; i < N; i++) {
    assert_true(x[i] >= 0.0f && x[i] < 1.0f);
    s += x[i], s2 += (double)x[i] * x[i];
  }
  double mean = s / N, var = s2 / N - mean * mean;
  assert_true(fabs(mean - 0.5) < 0.002);         /* sd of the mean: 0.00029 */
  assert_true(fabs(var - 1.0 / 12) < 0.001);

  fsdp_rng_normal(x, N, fsdp_rng_key(1, "normal"), 0, 2.0f, 3.0f);
  s = s2 = 0;
  int within1 = 0, finite = 1;
  for (int i = 0; i < N; i++) {
    finite &= isfinite(x[i]);
    s += x[i], s2 += (double)x[i] * x[i];
    within1 += fabsf(x[i] - 2.0f) < 3.0f;
  }
  mean = s / N;
  double sd = sqrt(s2 / N - mean * mean);
  assert_true(finite);
  assert_true(fabs(mean - 2.0) < 0.015); /* sd of the mean: 0.003 */
  assert_true(fabs(sd - 3.0) < 0.015);
  assert_true(fabs(within1 / (double)N - 0.682689) < 0.003);
  free(x);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_philox_kat),    cmocka_unit_test(test_philox_packing),
      cmocka_unit_test(test_key),           cmocka_unit_test(test_uniform_definition),
      cmocka_unit_test(test_slices),        cmocka_unit_test(test_normal_pairs),
      cmocka_unit_test(test_distributions),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
