/*
 * test_cuda_host.c — the host-side parts of the cuda device, on any machine (no GPU needed):
 * the arithmetic its kernels share with the cpu bit for bit (src/kernels/cuda/exact.h: dtype
 * conversions, Philox uniforms, the normals through their fix-up tables, the cpu's GELU, mask
 * values, the mask hash), its caching allocator driven through a fake backend (reuse in stream
 * order, splitting and merging, retiring a stream, out of memory with a retry, statistics), and
 * that a machine without a GPU registers no cuda device. The kernels themselves run on a GPU
 * only (tests/cuda).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "core/core.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cuda/exact.h"
#include "kernels/cuda/pool.h"

/* Built only with the cuda device (src/kernels/cuda): absent otherwise, and those tests skip. */
#pragma weak fsdp_cuda_pool_alloc
#pragma weak fsdp_cuda_pool_free
#pragma weak fsdp_cuda_pool_retire_stream
#pragma weak fsdp_cuda_empty_cache
#pragma weak fsdp_cuda_memory_stats
#pragma weak fsdp_cuda_memory_reset_peak
#pragma weak fsdp_cuda_pool_set_backend
#pragma weak fsdp_cuda_normal_fixups

static bool cuda_built(void) {
  if (fsdp_cuda_pool_alloc && fsdp_cuda_normal_fixups) return true;
  print_message("skipped: this build has no cuda device (no CUDA toolkit, or FSDP_CUDA=OFF)\n");
  return false;
}

static bool under_valgrind(void) { return getenv("FSDP_UNDER_VALGRIND") != NULL; }

static uint32_t bits(float x) { return fsdp_x_f32_bits(x); }

/* ---- exact arithmetic ------------------------------------------------------------------------- */

static void test_conversions(void **state) {
  (void)state;
  for (uint32_t h = 0; h < 65536; h++) {
    assert_int_equal(bits(fsdp_x_bf16_to_f32((uint16_t)h)), bits(fsdp_bf16_to_f32((uint16_t)h)));
    assert_int_equal(bits(fsdp_x_f16_to_f32((uint16_t)h)), bits(fsdp_f16_to_f32((uint16_t)h)));
  }
  /* every 4099th f32 pattern (all exponents, signs, NaN payloads, ties) */
  const uint64_t step = under_valgrind() ? 400009 : 4099;
  for (uint64_t u = 0; u < ((uint64_t)1 << 32); u += step) {
    float x = fsdp_x_bits_f32((uint32_t)u);
    assert_int_equal(fsdp_x_f32_to_bf16(x), fsdp_f32_to_bf16(x));
    assert_int_equal(fsdp_x_f32_to_f16(x), fsdp_f32_to_f16(x));
  }
  const uint32_t edge[] = {0x477ff000, 0x477fefff, 0x33000000, 0x33000001, 0x38800000,
                           0x387fffff, 0x7f800001, 0xff800000, 0x3f808000, 0x3f818000};
  for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++) {
    float x = fsdp_x_bits_f32(edge[i]);
    assert_int_equal(fsdp_x_f32_to_bf16(x), fsdp_f32_to_bf16(x));
    assert_int_equal(fsdp_x_f32_to_f16(x), fsdp_f32_to_f16(x));
  }
}

static void test_philox_uniform(void **state) {
  (void)state;
  uint32_t a[4], b[4];
  for (uint64_t block = 0; block < 1000; block += 7) {
    fsdp_x_philox(a, block * 0x9E3779B97F4A7C15ull, 0xa4093822u, 0x299f31d0u);
    fsdp_philox4x32(b, 0x299f31d0a4093822ull, block * 0x9E3779B97F4A7C15ull);
    assert_memory_equal(a, b, sizeof a);
  }
  const uint64_t keys[] = {0, 1, fsdp_rng_key(42, "wte.weight"), ~0ull};
  const uint64_t firsts[] = {0, 1, 3, 6, 1ull << 33};
  enum { N = 4099 };
  static float want[N];
  for (size_t k = 0; k < 4; k++)
    for (size_t f = 0; f < 5; f++) {
      fsdp_rng_uniform(want, N, keys[k], firsts[f]);
      for (int64_t i = 0; i < N; i++) {
        uint64_t e = firsts[f] + (uint64_t)i;
        uint32_t r[4];
        fsdp_x_philox(r, e >> 2, (uint32_t)keys[k], (uint32_t)(keys[k] >> 32));
        assert_int_equal(bits(fsdp_x_uniform(r[e & 3])), bits(want[i]));
      }
    }
}

/* Every input of Box-Muller's logf / sincosf: the device's value after its fix-ups is the C
 * library's. */
static void test_normal_fixups(void **state) {
  (void)state;
  if (!cuda_built()) skip();
  const fsdp_x_normal_tables *t;
  assert_int_equal(fsdp_cuda_normal_fixups(&t), FSDP_OK);
  size_t fixed = t->log.start[FSDP_X_FIX_BUCKETS] + t->sin.start[FSDP_X_FIX_BUCKETS] +
                 t->cos.start[FSDP_X_FIX_BUCKETS];
  print_message("%zu of 3 x 2^24 library results differ from the double evaluation\n", fixed);
  const uint32_t step = under_valgrind() ? 997 : 1;
  for (uint32_t k = 0; k < (1u << 24); k += step) {
    float u1 = (float)(k + 1) * (1.0f / 16777216.0f), u2 = (float)k * (1.0f / 16777216.0f);
    float s, c, ds, dc;
    sincosf(6.28318530717958647692f * u2, &s, &c);
    fsdp_x_sincos_u2(k, &ds, &dc);
    assert_int_equal(bits(fsdp_x_fixed(&t->log, k, fsdp_x_log_u1(k))), bits(logf(u1)));
    assert_int_equal(bits(fsdp_x_fixed(&t->sin, k, ds)), bits(s));
    assert_int_equal(bits(fsdp_x_fixed(&t->cos, k, dc)), bits(c));
  }
}

/* The device's random kernel, run on the host: one Philox block at a time. */
static void normal_like_device(float *out, int64_t n, uint64_t key, uint64_t first, float mean,
                               float std, const fsdp_x_normal_tables *t) {
  const uint64_t b0 = first >> 2, b1 = (first + (uint64_t)n - 1) >> 2;
  for (uint64_t block = b0; block <= b1; block++) {
    float z[4];
    fsdp_x_normal4(z, block, (uint32_t)key, (uint32_t)(key >> 32), t);
    for (int l = 0; l < 4; l++) {
      uint64_t e = block * 4 + (uint64_t)l;
      if (e >= first && e - first < (uint64_t)n) out[e - first] = mean + std * z[l];
    }
  }
}

static void test_normal_stream(void **state) {
  (void)state;
  if (!cuda_built()) skip();
  const fsdp_x_normal_tables *t;
  assert_int_equal(fsdp_cuda_normal_fixups(&t), FSDP_OK);
  const int64_t n = under_valgrind() ? 4099 : (1 << 20) + 3;
  float *want = malloc(sizeof(float) * (size_t)n), *got = malloc(sizeof(float) * (size_t)n);
  assert_non_null(want);
  assert_non_null(got);
  const struct {
    uint64_t key, first;
    float mean, std;
  } runs[] = {{fsdp_rng_key(1, "h.0.attn.weight"), 0, 0.0f, 1.0f},
              {fsdp_rng_key(7, "x"), 3, 0.5f, 0.02f},
              {12345, (1ull << 40) + 2, -1.0f, 3.0f}};
  for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
    fsdp_rng_normal(want, n, runs[r].key, runs[r].first, runs[r].mean, runs[r].std);
    normal_like_device(got, n, runs[r].key, runs[r].first, runs[r].mean, runs[r].std, t);
    for (int64_t i = 0; i < n; i++) assert_int_equal(bits(got[i]), bits(want[i]));
  }
  free(want);
  free(got);
}

static void test_gelu(void **state) {
  (void)state;
  enum { N = 20011 };
  static float x[N], y[N], g[N], d[N];
  for (int i = 0; i < N; i++) {
    x[i] = -12.0f + 24.0f * (float)i / (float)(N - 1);
    g[i] = 0.5f + (float)(i % 7) * 0.25f;
    d[i] = (float)(i % 5) - 2.0f;
  }
  const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 100.0f, -100.0f, 1e-30f, 88.0f};
  for (size_t i = 0; i < sizeof special / sizeof special[0]; i++) x[i * 997] = special[i];
  fsdp_cpu_gelu_forward(y, x, N);
  for (int i = 0; i < N; i++) assert_int_equal(bits(fsdp_x_gelu(x[i])), bits(y[i]));
  memcpy(y, d, sizeof d);
  fsdp_cpu_gelu_backward(y, g, x, N);
  for (int i = 0; i < N; i++)
    assert_int_equal(bits(d[i] + fsdp_x_gelu_grad(x[i]) * g[i]), bits(y[i]));
}

static void test_mask_helpers(void **state) {
  (void)state;
  const float x[] = {0.0f, -0.0f, 1.5f, -2.0f, NAN, INFINITY, -INFINITY, 3.0f};
  const float m[] = {1.0f, 0.0f, 1.0f, 0.0f, 1.0f, 1.0f, 1.0f, NAN};
  const int64_t n = 8;
  float want[8];
  fsdp_cpu_mask_values(want, x, m, n);
  for (int64_t i = 0; i < n; i++) assert_int_equal(bits(fsdp_x_mask_value(x[i], m, i)), bits(want[i]));
  fsdp_cpu_mask_values(want, x, NULL, n);
  for (int64_t i = 0; i < n; i++)
    assert_int_equal(bits(fsdp_x_mask_value(x[i], NULL, i)), bits(want[i]));
  assert_int_equal(fsdp_x_mask_key(x[1], m, 1), 0);          /* masked */
  assert_int_equal(fsdp_x_mask_key(x[0], m, 0), 1);          /* +0: bits 0, + 1 */
  assert_int_equal(fsdp_x_mask_key(x[2], NULL, 2), bits(1.5f) + 1);
  assert_int_equal(fsdp_x_mask_key(x[3], NULL, 3), bits(2.0f) + 1); /* magnitude */
  assert_true(fsdp_x_mask_key(x[4], NULL, 4) > fsdp_x_mask_key(x[5], NULL, 5)); /* NaN > inf */
  /* the hash of mask_check: FNV-1a over the zero positions */
  float mk[300];
  for (int i = 0; i < 300; i++) mk[i] = (i * 7919) % 3 == 0 ? 0.0f : 1.0f;
  int64_t bad, zeros;
  uint32_t hash, h = 2166136261u;
  fsdp_cpu_mask_check(&bad, &zeros, &hash, mk, 300);
  for (uint32_t i = 0; i < 300; i++)
    if (mk[i] == 0.0f) h = fsdp_x_fnv_u32(h, i);
  assert_int_equal(h, hash);
}

/* ---- the caching allocator through a fake device ---------------------------------------------- */

static struct {
  size_t capacity, used;
  int mallocs, frees, syncs;
} fake;

static int fake_malloc(int gpu, void **out, size_t bytes, bool *oom) {
  (void)gpu;
  *oom = false;
  if (fake.used + bytes > fake.capacity) {
    *oom = true;
    return fsdp_error("fake: out of memory for %zu bytes", bytes);
  }
  /* a size prefix lets free return the bytes; data 512-aligned like a device's */
  char *p = aligned_alloc(512, bytes + 512);
  if (!p) return fsdp_error("fake: host out of memory");
  memcpy(p, &bytes, sizeof bytes);
  fake.used += bytes;
  fake.mallocs++;
  *out = p + 512;
  return FSDP_OK;
}

static void fake_free(int gpu, void *p) {
  (void)gpu;
  size_t bytes;
  memcpy(&bytes, (char *)p - 512, sizeof bytes);
  fake.used -= bytes;
  fake.frees++;
  free((char *)p - 512);
}

static int fake_sync(int gpu) {
  (void)gpu;
  fake.syncs++;
  return FSDP_OK;
}

static void fake_info(int gpu, size_t *free_bytes, size_t *total_bytes) {
  (void)gpu;
  *free_bytes = fake.capacity - fake.used;
  *total_bytes = fake.capacity;
}

static const fsdp_cuda_pool_backend fake_backend = {fake_malloc, fake_free, fake_sync, fake_info};

#define MiB ((size_t)1 << 20)
#define S1 ((void *)0x1000)
#define S2 ((void *)0x2000)

static int pool_setup(void **state) {
  (void)state;
  if (!fsdp_cuda_pool_set_backend) return 0;
  memset(&fake, 0, sizeof fake);
  fake.capacity = 64 * MiB;
  fsdp_cuda_pool_set_backend(&fake_backend);
  return 0;
}

static int pool_teardown(void **state) {
  (void)state;
  if (fsdp_cuda_pool_set_backend) fsdp_cuda_pool_set_backend(NULL);
  return 0;
}

static fsdp_cuda_mem_stats stats(int gpu) {
  fsdp_cuda_mem_stats s;
  assert_int_equal(fsdp_cuda_memory_stats(gpu, &s), FSDP_OK);
  return s;
}

static void *alloc(int gpu, void *stream, size_t bytes) {
  void *p = NULL;
  assert_int_equal(fsdp_cuda_pool_alloc(gpu, stream, bytes, &p), FSDP_OK);
  assert_non_null(p);
  return p;
}

static void test_pool_reuse(void **state) {
  (void)state;
  if (!cuda_built()) skip();
  void *p = alloc(0, S1, 1000);
  fsdp_cuda_mem_stats s = stats(0);
  assert_int_equal(s.allocated, 1024); /* 512-byte classes */
  assert_int_equal(s.requested, 1000);
  assert_int_equal(s.reserved, 2 * MiB); /* one small segment */
  fsdp_cuda_pool_free(p);
  assert_int_equal(stats(0).allocated, 0);
  assert_ptr_equal(alloc(0, S1, 700), p); /* cached, same stream: reused at once */
  fsdp_cuda_pool_free(p);
  void *q = alloc(0, S2, 1000); /* another stream may not take S1's blocks */
  assert_int_equal(fake.mallocs, 2);
  fsdp_cuda_pool_free(q);
  fsdp_cuda_pool_retire_stream(0, S1); /* S1 is gone: its blocks are anyone's */
  void *r = alloc(0, S2, 2 * MiB);       /* large: 2 MiB, a segment of its own */
  assert_int_equal(fake.mallocs, 3);
  void *t = alloc(0, S2, 2 * MiB - 600); /* over 1 MiB: large, rounded to 2 MiB */
  assert_int_equal(fake.mallocs, 4);
  fsdp_cuda_pool_free(r);
  fsdp_cuda_pool_free(t);
  void *u = alloc(0, S2, 1 * MiB); /* small: S1's former segment, or S2's, no new one */
  assert_int_equal(fake.mallocs, 4);
  fsdp_cuda_pool_free(u);
  /* zero bytes: a real block; NULL and unknown pointers are ignored */
  void *z = alloc(0, S2, 0);
  assert_int_equal(stats(0).allocated, 512);
  fsdp_cuda_pool_free(z);
  fsdp_cuda_pool_free(NULL);
  int local;
  fsdp_cuda_pool_free(&local);
  s = stats(0);
  assert_int_equal(s.allocated, 0);
  assert_int_equal(s.blocks, 0);
  assert_int_equal(s.allocs, 7);
  assert_int_equal(fsdp_cuda_empty_cache(-1), FSDP_OK);
  s = stats(0);
  assert_int_equal(s.reserved, 0);
  assert_int_equal(s.segments, 0);
  assert_int_equal(fake.frees, fake.mallocs);
  assert_int_equal(fake.used, 0);
}

static void test_pool_split_merge(void **state) {
  (void)state;
  if (!cuda_built()) skip();
  void *a = alloc(1, S1, 3 * MiB); /* 4 MiB */
  fsdp_cuda_mem_stats s = stats(1);
  assert_int_equal(s.allocated, 4 * MiB);
  assert_int_equal(s.reserved, 4 * MiB);
  fsdp_cuda_pool_free(a);
  void *b = alloc(1, S1, 2 * MiB), *c = alloc(1, S1, 2 * MiB); /* the two halves */
  assert_int_equal(fake.mallocs, 1);
  assert_ptr_equal(b, a);
  assert_ptr_equal(c, (char *)a + 2 * MiB);
  fsdp_cuda_pool_free(b);
  fsdp_cuda_pool_free(c); /* merged back into one 4 MiB block */
  assert_ptr_equal(alloc(1, S1, 4 * MiB), a);
  assert_int_equal(fake.mallocs, 1);
  fsdp_cuda_pool_free(a);
  /* small blocks split a 2 MiB segment in 512-byte steps and merge back */
  void *p[8];
  for (int i = 0; i < 8; i++) p[i] = alloc(1, S1, 100000);
  assert_int_equal(fake.mallocs, 2);
  for (int i = 1; i < 8; i++) assert_int_equal((char *)p[i] - (char *)p[i - 1], 100352);
  for (int i = 0; i < 8; i += 2) fsdp_cuda_pool_free(p[i]);
  for (int i = 1; i < 8; i += 2) fsdp_cuda_pool_free(p[i]);
  assert_ptr_equal(alloc(1, S1, 1 * MiB), p[0]); /* whole again */
  s = stats(1);
  assert_int_equal(s.allocated, 1 * MiB);
  assert_int_equal(s.allocated_peak, 4 * MiB);
  fsdp_cuda_memory_reset_peak(1);
  assert_int_equal(stats(1).allocated_peak, 1 * MiB);
  fsdp_cuda_pool_free(p[0]);
}

static void test_pool_out_of_memory(void **state) {
  (void)state;
  if (!cuda_built()) skip();
  fake.capacity = 8 * MiB;
  void *a = alloc(0, S1, 6 * MiB);
  fsdp_cuda_pool_free(a); /* cached for S1 */
  /* S2 cannot take it; the device is full: wait, give the cache back, retry */
  void *b = alloc(0, S2, 4 * MiB);
  fsdp_cuda_mem_stats s = stats(0);
  assert_int_equal(s.retries, 1);
  assert_true(fake.syncs >= 1);
  assert_int_equal(s.reserved, 4 * MiB);
  /* more than the device has: an error naming the request and the GPU, nothing counted */
  void *c = NULL;
  assert_int_equal(fsdp_cuda_pool_alloc(0, S2, 16 * MiB, &c), FSDP_ERR);
  assert_null(c);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory allocating 16777216 bytes on GPU 0"));
  s = stats(0);
  assert_int_equal(s.ooms, 1);
  assert_int_equal(s.allocated, 4 * MiB);
  fsdp_cuda_pool_free(b);
  /* no such GPU */
  assert_int_equal(fsdp_cuda_pool_alloc(FSDP_CUDA_MAX_GPUS, S1, 10, &c), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "no GPU 64"));
  fsdp_cuda_mem_stats bad;
  assert_int_equal(fsdp_cuda_memory_stats(-1, &bad), FSDP_ERR);
}

/* Random allocations and frees on two streams: live blocks never overlap (each is filled with
 * its own byte and checked before it is freed) and the statistics add up. */
static void test_pool_random(void **state) {
  (void)state;
  if (!cuda_built()) skip();
  enum { LIVE = 64 };
  struct {
    unsigned char *p;
    size_t n;
    unsigned char tag;
  } live[LIVE] = {{0}};
  uint64_t rng = 0x9E3779B97F4A7C15ull;
  int64_t requested = 0;
  fake.capacity = (size_t)512 << 20;
  const int steps = under_valgrind() ? 400 : 4000;
  for (int step = 0; step < steps; step++) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    int i = (int)((rng >> 33) % LIVE);
    if (live[i].p) {
      for (size_t k = 0; k < live[i].n; k++) assert_int_equal(live[i].p[k], live[i].tag);
      fsdp_cuda_pool_free(live[i].p);
      requested -= (int64_t)live[i].n;
      live[i].p = NULL;
      continue;
    }
    size_t n = (rng >> 40) % 8 == 0 ? (size_t)((rng >> 20) % (3 * MiB)) : (size_t)((rng >> 20) % 70000);
    live[i].p = alloc(0, (rng >> 62) & 1 ? S1 : S2, n);
    live[i].n = n;
    live[i].tag = (unsigned char)step;
    memset(live[i].p, live[i].tag, n);
    requested += (int64_t)n;
    fsdp_cuda_mem_stats s = stats(0);
    assert_int_equal(s.requested, requested);
    assert_true(s.allocated >= s.requested && s.reserved >= s.allocated);
  }
  for (int i = 0; i < LIVE; i++)
    if (live[i].p) {
      for (size_t k = 0; k < live[i].n; k++) assert_int_equal(live[i].p[k], live[i].tag);
      fsdp_cuda_pool_free(live[i].p);
    }
  fsdp_cuda_mem_stats s = stats(0);
  assert_int_equal(s.allocated, 0);
  assert_int_equal(s.requested, 0);
  assert_int_equal(fsdp_cuda_empty_cache(0), FSDP_OK);
  assert_int_equal(stats(0).reserved, 0);
  assert_int_equal(fake.used, 0);
}

/* ---- registration ------------------------------------------------------------------------------- */

static void test_no_gpu_no_device(void **state) {
  (void)state;
  if (access("/dev/nvidiactl", F_OK) == 0 || access("/dev/dxg", F_OK) == 0) {
    print_message("skipped: this machine has an NVIDIA device (tests/cuda checks it)\n");
    skip();
  }
  fsdp_kernels_init();
  assert_int_equal(fsdp_device_count_of("cuda"), 0);
  assert_null(fsdp_device_find("cuda"));
  assert_non_null(strstr(fsdp_error_msg(), "unknown device 'cuda'"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_conversions),
      cmocka_unit_test(test_philox_uniform),
      cmocka_unit_test(test_normal_fixups),
      cmocka_unit_test(test_normal_stream),
      cmocka_unit_test(test_gelu),
      cmocka_unit_test(test_mask_helpers),
      cmocka_unit_test_setup_teardown(test_pool_reuse, pool_setup, pool_teardown),
      cmocka_unit_test_setup_teardown(test_pool_split_merge, pool_setup, pool_teardown),
      cmocka_unit_test_setup_teardown(test_pool_out_of_memory, pool_setup, pool_teardown),
      cmocka_unit_test_setup_teardown(test_pool_random, pool_setup, pool_teardown),
      cmocka_unit_test(test_no_gpu_no_device),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
