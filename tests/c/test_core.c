/*
 * test_core.c — the core layer (src/core): errors, devices, storage and tensor refcounts, view
 * geometry and aliasing, strided copy/fill, meta tensors, memory accounting per role, device and
 * domain (including domains on several threads and frees on another thread), the memory cap.
 *
 * Every test that allocates runs in a fresh memory domain; its teardown fails the test if any
 * byte is still live there, so a missing release anywhere shows up as a failure here (and
 * valgrind catches the rest).
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

#include "core/core.h"

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})

/* ---- helpers ------------------------------------------------------------------------------- */

static int setup_domain(void **state) {
  fsdp_mem_domain *d = fsdp_mem_domain_new();
  if (!d) return -1;
  fsdp_mem_set_limit(d, 0);
  fsdp_mem_domain_set(d);
  *state = d;
  return 0;
}

static int teardown_domain(void **state) {
  fsdp_mem_report r;
  fsdp_mem_report_get(*state, &r);
  int leaked = 0;
  for (int i = 0; i < r.ndevices; i++)
    if (r.counts[i].live_total) {
      fprintf(stderr, "leak: %lld bytes live on %s\n", (long long)r.counts[i].live_total,
              r.device[i]);
      leaked = 1;
    }
  fsdp_mem_domain_set(NULL);
  fsdp_mem_domain_free(*state);
  return leaked ? -1 : 0;
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, setup_domain, teardown_domain)

static void expect_error(int rc, const char *needle) {
  assert_int_equal(rc, FSDP_ERR);
  if (!strstr(fsdp_error_msg(), needle))
    fail_msg("error message \"%s\" does not contain \"%s\"", fsdp_error_msg(), needle);
}

static fsdp_tensor *mk(int ndim, const int64_t *shape) {
  fsdp_tensor *t = NULL;
  assert_int_equal(fsdp_tensor_new_f32(&t, ndim, shape), FSDP_OK);
  return t;
}

/* a contiguous tensor holding 0, 1, 2, ... */
static fsdp_tensor *arange(int ndim, const int64_t *shape) {
  fsdp_tensor *t = mk(ndim, shape);
  float *p = fsdp_tensor_data(t, "test");
  for (int64_t i = 0; i < fsdp_tensor_numel(t); i++) p[i] = (float)i;
  return t;
}

static float *at(const fsdp_tensor *t, const int64_t *idx) {
  int64_t off = 0;
  for (int i = 0; i < t->ndim; i++) off += idx[i] * t->strides[i];
  return (float *)fsdp_tensor_data(t, "test") + off;
}

/* advance a multi-index in row-major order; false when done */
static bool next_index(int64_t *idx, int ndim, const int64_t *shape) {
  for (int i = ndim - 1; i >= 0; i--) {
    if (++idx[i] < shape[i]) return true;
    idx[i] = 0;
  }
  return false;
}

static fsdp_mem_counts cpu_counts(const fsdp_mem_domain *d) {
  fsdp_mem_report r;
  fsdp_mem_report_get(d, &r);
  assert_string_equal(r.device[0], "cpu");
  return r.counts[0];
}

/* ---- errors --------------------------------------------------------------------------------- */

static void *other_thread_error(void *arg) {
  char *seen = arg;
  strcpy(seen, fsdp_error_msg()); /* a new thread starts with no message */
  fsdp_error("from the other thread");
  return NULL;
}

static void test_errors(void **state) {
  (void)state;
  fsdp_error_clear();
  assert_string_equal(fsdp_error_msg(), "");
  assert_int_equal(fsdp_error("bad %d", 3), FSDP_ERR);
  assert_string_equal(fsdp_error_msg(), "bad 3");
  assert_int_equal(fsdp_error_context("layer %s", "fc"), FSDP_ERR);
  assert_string_equal(fsdp_error_msg(), "layer fc: bad 3");
  fsdp_error("%s!", fsdp_error_msg()); /* formatting from the slot into the slot */
  assert_string_equal(fsdp_error_msg(), "layer fc: bad 3!");

  char big[FSDP_ERROR_CAP + 2000];
  memset(big, 'x', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  fsdp_error("%s", big);
  assert_int_equal(strlen(fsdp_error_msg()), FSDP_ERROR_CAP - 1);
  fsdp_error_context("ctx");
  assert_int_equal(strlen(fsdp_error_msg()), FSDP_ERROR_CAP - 1);
  assert_memory_equal(fsdp_error_msg(), "ctx: xxx", 8);

  fsdp_error("mine");
  char seen[64] = "unset";
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, other_thread_error, seen), 0);
  pthread_join(th, NULL);
  assert_string_equal(seen, "");
  assert_string_equal(fsdp_error_msg(), "mine");
  fsdp_error_clear();
}

static void test_names(void **state) {
  (void)state;
  assert_int_equal(fsdp_dtype_size(FSDP_DTYPE_F32), 4);
  assert_string_equal(fsdp_dtype_name(FSDP_DTYPE_F32), "f32");
  static const char *roles[] = {"other", "params", "grads", "optim", "activations", "gathered"};
  for (int r = 0; r < FSDP_ROLE_COUNT; r++) assert_string_equal(fsdp_role_name(r), roles[r]);
  assert_string_equal(fsdp_role_name(FSDP_ROLE_COUNT), "?");
  char buf[32];
  assert_string_equal(fsdp_shape_str(buf, sizeof buf, 2, SHAPE(2, 3)), "(2, 3)");
  assert_string_equal(fsdp_shape_str(buf, sizeof buf, 0, NULL), "()");
  assert_string_equal(fsdp_shape_str(buf, 5, 3, SHAPE(100, 200, 300)), "(100");
}

/* ---- dtypes --------------------------------------------------------------------------------- */

static float F(uint32_t bits) {
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static uint32_t B(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static void test_dtype_names(void **state) {
  (void)state;
  static const char *names[] = {"f32", "bf16", "f16", "f64", "i64", "i32", "u8", "bool"};
  static const size_t sizes[] = {4, 2, 2, 8, 8, 4, 1, 1};
  for (int i = 0; i < FSDP_DTYPE_COUNT; i++) {
    assert_string_equal(fsdp_dtype_name((fsdp_dtype)i), names[i]);
    assert_int_equal(fsdp_dtype_size((fsdp_dtype)i), sizes[i]);
    fsdp_dtype dt;
    assert_int_equal(fsdp_dtype_parse(names[i], &dt), FSDP_OK);
    assert_int_equal(dt, i);
  }
  assert_string_equal(fsdp_dtype_name(FSDP_DTYPE_COUNT), "?");
  assert_int_equal(fsdp_dtype_size(FSDP_DTYPE_COUNT), 0);
  fsdp_dtype dt = FSDP_DTYPE_F32;
  assert_int_equal(fsdp_dtype_parse("bfloat16", &dt), FSDP_OK);
  assert_int_equal(dt, FSDP_DTYPE_BF16);
  assert_int_equal(fsdp_dtype_parse("half", &dt), FSDP_OK);
  assert_int_equal(dt, FSDP_DTYPE_F16);
  expect_error(fsdp_dtype_parse("f8", &dt), "unknown dtype 'f8' (valid: f32, bf16");
  expect_error(fsdp_dtype_parse(NULL, &dt), "unknown dtype '(null)'");
  assert_true(fsdp_dtype_is_float(FSDP_DTYPE_BF16) && !fsdp_dtype_is_float(FSDP_DTYPE_I64));
}

/* Known bit patterns: ties go to the even neighbour, NaN stays NaN (quiet), infinities and
 * overflow give infinity, f16 subnormals are exact. */
static void test_bf16_bits(void **state) {
  (void)state;
  static const uint32_t in[][2] = {
      {0x3f800000, 0x3f80}, /* 1 */
      {0x3f808000, 0x3f80}, /* tie, even below */
      {0x3f818000, 0x3f82}, /* tie, even above */
      {0x3f808001, 0x3f81}, /* just above the tie */
      {0x3f807fff, 0x3f80}, /* just below it */
      {0x80000000, 0x8000}, /* -0 */
      {0x7f800000, 0x7f80}, /* inf */
      {0xff800000, 0xff80}, /* -inf */
      {0x7f7fffff, 0x7f80}, /* FLT_MAX rounds to inf */
      {0x7f7f7fff, 0x7f7f},
      {0x7fc00000, 0x7fc0}, /* quiet NaN */
      {0xffc00001, 0xffc0}, /* negative NaN keeps its sign */
      {0x7f800001, 0x7fc0}, /* signalling NaN with a low payload stays NaN */
      {0x00008000, 0x0000}, /* subnormal tie to even (0) */
      {0x00018000, 0x0002}, /* subnormal tie to even (2) */
      {0x3dcccccd, 0x3dcd}, /* 0.1 */
  };
  for (size_t i = 0; i < sizeof in / sizeof in[0]; i++) {
    uint16_t h = fsdp_f32_to_bf16(F(in[i][0]));
    if (h != in[i][1]) fail_msg("bf16(%08x) = %04x, want %04x", in[i][0], h, (unsigned)in[i][1]);
  }
  /* every bf16 value widens exactly and narrows back to itself (NaNs: to a quiet NaN) */
  for (uint32_t h = 0; h < 65536; h++) {
    float f = fsdp_bf16_to_f32((uint16_t)h);
    assert_int_equal(B(f), h << 16);
    uint16_t back = fsdp_f32_to_bf16(f);
    if (f != f) assert_int_equal(back, h | 0x40);
    else assert_int_equal(back, h);
  }
}

static void test_f16_bits(void **state) {
  (void)state;
  static const uint32_t in[][2] = {
      {0x3f800000, 0x3c00}, /* 1 */
      {0x3f801000, 0x3c00}, /* 1 + 2^-11: tie, even below */
      {0x3f803000, 0x3c02}, /* 1 + 3 * 2^-11: tie, even above */
      {0x3f801001, 0x3c01},
      {0x477fe000, 0x7bff}, /* 65504, the largest */
      {0x477fefff, 0x7bff}, /* just below the tie with 65536 */
      {0x477ff000, 0x7c00}, /* 65520: the tie rounds to inf */
      {0x7f7fffff, 0x7c00}, /* FLT_MAX */
      {0xff800000, 0xfc00}, /* -inf */
      {0x7fc00000, 0x7e00}, /* NaN */
      {0xffc00000, 0xfe00},
      {0x7f800001, 0x7e00}, /* signalling NaN with a low payload stays NaN */
      {0x38800000, 0x0400}, /* 2^-14, the smallest normal */
      {0x387fc000, 0x03ff}, /* 1023 * 2^-24, the largest subnormal */
      {0x387fe000, 0x0400}, /* 1023.5 * 2^-24: tie, rounds up into the normals */
      {0x33800000, 0x0001}, /* 2^-24, the smallest subnormal */
      {0x33000000, 0x0000}, /* 2^-25: tie with 0, even */
      {0x33000001, 0x0001},
      {0x33c00000, 0x0002}, /* 1.5 * 2^-24: tie, even above */
      {0x34200000, 0x0002}, /* 2.5 * 2^-24: tie, even below */
      {0xb3800000, 0x8001}, /* -2^-24 */
      {0x80000000, 0x8000}, /* -0 */
      {0x3dcccccd, 0x2e66}, /* 0.1 */
      {0x00000001, 0x0000}, /* f32 subnormal */
  };
  for (size_t i = 0; i < sizeof in / sizeof in[0]; i++) {
    uint16_t h = fsdp_f32_to_f16(F(in[i][0]));
    if (h != in[i][1]) fail_msg("f16(%08x) = %04x, want %04x", in[i][0], h, (unsigned)in[i][1]);
  }
  assert_int_equal(B(fsdp_f16_to_f32(0x0001)), 0x33800000);
  assert_int_equal(B(fsdp_f16_to_f32(0x7bff)), 0x477fe000);
  assert_int_equal(B(fsdp_f16_to_f32(0xfc00)), 0xff800000);
  assert_int_equal(B(fsdp_f16_to_f32(0x8000)), 0x80000000);
  for (uint32_t h = 0; h < 65536; h++) {
    float f = fsdp_f16_to_f32((uint16_t)h);
    uint16_t back = fsdp_f32_to_f16(f);
    if (f != f) assert_int_equal(back, h | 0x200);
    else assert_int_equal(back, h);
  }
}

static void test_dtype_load_store(void **state) {
  (void)state;
  unsigned char buf[64];
  for (int i = 0; i < FSDP_DTYPE_COUNT; i++) {
    fsdp_dtype dt = (fsdp_dtype)i;
    fsdp_dtype_store(buf, dt, 3, 2.0);
    assert_true(fsdp_dtype_load(buf, dt, 3) == (dt == FSDP_DTYPE_BOOL ? 1.0 : 2.0));
  }
  fsdp_dtype_store(buf, FSDP_DTYPE_I32, 0, -7.9);
  assert_true(fsdp_dtype_load(buf, FSDP_DTYPE_I32, 0) == -7.0);
  fsdp_dtype_store(buf, FSDP_DTYPE_U8, 0, 300);
  assert_true(fsdp_dtype_load(buf, FSDP_DTYPE_U8, 0) == 255.0);
  fsdp_dtype_store(buf, FSDP_DTYPE_I64, 0, 1e30);
  assert_true(fsdp_dtype_load(buf, FSDP_DTYPE_I64, 0) > 9.2e18);
  fsdp_dtype_store(buf, FSDP_DTYPE_I64, 0, 0.0 / 0.0);
  assert_true(fsdp_dtype_load(buf, FSDP_DTYPE_I64, 0) == 0.0);
  fsdp_dtype_store(buf, FSDP_DTYPE_BF16, 0, 1.00390625);
  assert_true(fsdp_dtype_load(buf, FSDP_DTYPE_BF16, 0) == 1.0);
  fsdp_dtype_store(buf, FSDP_DTYPE_F64, 0, 0.1);
  assert_true(fsdp_dtype_load(buf, FSDP_DTYPE_F64, 0) == 0.1);
}

/* ---- devices -------------------------------------------------------------------------------- */

static void test_devices(void **state) {
  (void)state;
  assert_ptr_equal(fsdp_device_find("cpu"), &fsdp_device_cpu);
  assert_ptr_equal(fsdp_device_find("meta"), &fsdp_device_meta);
  assert_null(fsdp_device_find("cuda"));
  assert_string_equal(fsdp_error_msg(), "unknown device 'cuda' (known devices: cpu, meta)");
  assert_null(fsdp_device_find(NULL));
  assert_int_equal(fsdp_device_count(), 2);
  assert_ptr_equal(fsdp_device_at(0), &fsdp_device_cpu);
  assert_ptr_equal(fsdp_device_at(1), &fsdp_device_meta);
  assert_null(fsdp_device_at(2));
  assert_int_equal(fsdp_device_index(&fsdp_device_meta), 1);
  assert_int_equal(fsdp_device_index(NULL), -1);

  const fsdp_device_i *cpu = &fsdp_device_cpu;
  assert_true(cpu->has_data);
  for (int round = 0; round < 3; round++) { /* reused memory must come back zeroed too */
    void *p = NULL;
    assert_int_equal(cpu->alloc(NULL, &p, 1000), FSDP_OK);
    assert_non_null(p);
    assert_int_equal((uintptr_t)p % 64, 0);
    for (int i = 0; i < 1000; i++) assert_int_equal(((unsigned char *)p)[i], 0);
    memset(p, 0xff, 1000);
    cpu->free(NULL, p, 1000);
  }
  void *p = NULL;
  assert_int_equal(cpu->alloc(NULL, &p, 0), FSDP_OK);
  assert_non_null(p); /* a real pointer even for 0 bytes: empty cpu tensors have data */
  cpu->free(NULL, p, 0);

  const fsdp_device_i *meta = &fsdp_device_meta;
  assert_false(meta->has_data);
  p = (void *)1;
  assert_int_equal(meta->alloc(NULL, &p, 1 << 30), FSDP_OK);
  assert_null(p);
  meta->free(NULL, NULL, 1 << 30);
  assert_null(meta->copy);
}

/* ---- tensors -------------------------------------------------------------------------------- */

static void test_tensor_new(void **state) {
  (void)state;
  fsdp_tensor *t = mk(2, SHAPE(2, 3));
  assert_int_equal(t->ndim, 2);
  assert_int_equal(t->strides[0], 3);
  assert_int_equal(t->strides[1], 1);
  assert_int_equal(fsdp_tensor_numel(t), 6);
  assert_true(fsdp_tensor_is_contiguous(t));
  assert_true(t->is_leaf);
  assert_false(t->requires_grad);
  assert_false(t->is_param);
  assert_int_equal(t->version, 0);
  assert_null(t->grad);
  assert_int_equal(t->refcount, 1);
  assert_int_equal(t->storage->refcount, 1);
  assert_int_equal(t->storage->bytes, 24);
  assert_int_equal(t->storage->role, FSDP_ROLE_ACTIVATIONS);
  assert_ptr_equal(t->storage->domain, fsdp_mem_domain_current());
  float *p = fsdp_tensor_data(t, "test");
  for (int i = 0; i < 6; i++) assert_true(p[i] == 0.0f);
  assert_string_equal(FSDP_SHAPE_STR(t), "(2, 3)");
  fsdp_tensor_release(t);

  fsdp_tensor *s = mk(0, NULL); /* scalar */
  assert_int_equal(fsdp_tensor_numel(s), 1);
  assert_true(*(float *)fsdp_tensor_data(s, "test") == 0.0f);
  assert_int_equal(s->storage->bytes, 4);
  fsdp_tensor_release(s);

  fsdp_tensor *e = mk(2, SHAPE(0, 3)); /* empty */
  assert_int_equal(fsdp_tensor_numel(e), 0);
  assert_non_null(fsdp_tensor_data(e, "test"));
  assert_true(fsdp_tensor_is_contiguous(e));
  fsdp_tensor_release(e);

  fsdp_tensor *bad = (fsdp_tensor *)1;
  int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  expect_error(fsdp_tensor_new_f32(&bad, 9, nine), "at most 8");
  assert_null(bad);
  expect_error(fsdp_tensor_new_f32(&bad, -1, nine), "-1 dimensions");
  expect_error(fsdp_tensor_new_f32(&bad, 2, SHAPE(2, -3)), "size -3 at dim 1 of shape (2, -3)");
  expect_error(fsdp_tensor_new(&bad, NULL, FSDP_DTYPE_F32, 1, SHAPE(2), FSDP_ROLE_OTHER),
               "no device");
  expect_error(fsdp_tensor_new_f32(&bad, 2, SHAPE(INT64_MAX / 2, 4)), "too many elements");
  fsdp_tensor_release(NULL); /* no-op */
  fsdp_storage_release(NULL);
}

static void test_view_keeps_storage(void **state) {
  fsdp_tensor *base = arange(2, SHAPE(2, 3));
  fsdp_tensor *v;
  assert_int_equal(fsdp_tensor_view(&v, base, 2, SHAPE(3, 2)), FSDP_OK);
  assert_ptr_equal(v->storage, base->storage);
  assert_int_equal(base->storage->refcount, 2);
  fsdp_tensor_release(base);
  assert_int_equal(v->storage->refcount, 1);
  assert_int_equal(cpu_counts(*state).live[FSDP_ROLE_ACTIVATIONS], 24);
  float *p = fsdp_tensor_data(v, "test");
  for (int i = 0; i < 6; i++) assert_true(p[i] == (float)i);
  fsdp_tensor_release(v);
  assert_int_equal(cpu_counts(*state).live_total, 0);
}

static void test_view(void **state) {
  (void)state;
  fsdp_tensor *base = arange(1, SHAPE(6));
  fsdp_tensor *v;
  assert_int_equal(fsdp_tensor_view(&v, base, 2, SHAPE(-1, 2)), FSDP_OK);
  assert_int_equal(v->shape[0], 3);
  assert_int_equal(v->shape[1], 2);
  assert_int_equal(v->strides[0], 2);
  assert_true(v->is_leaf);
  *at(v, SHAPE(2, 1)) = 42.0f; /* writes through the view land in the base */
  assert_true(((float *)fsdp_tensor_data(base, "test"))[5] == 42.0f);

  fsdp_tensor *bad = NULL;
  fsdp_tensor *b23;
  assert_int_equal(fsdp_tensor_view(&b23, base, 2, SHAPE(2, 3)), FSDP_OK);
  expect_error(fsdp_tensor_view(&bad, b23, 2, SHAPE(4, 2)),
               "view: shape (4, 2) is invalid for a tensor of shape (2, 3) (6 elements)");
  expect_error(fsdp_tensor_view(&bad, b23, 2, SHAPE(-1, 4)),
               "shape (-1, 4) is invalid for a tensor of shape (2, 3) (6 elements)");
  expect_error(fsdp_tensor_view(&bad, b23, 2, SHAPE(-1, -1)), "more than one -1");
  expect_error(fsdp_tensor_view(&bad, b23, 2, SHAPE(-2, 3)), "negative size at dim 0");
  int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 6};
  expect_error(fsdp_tensor_view(&bad, b23, 9, nine), "at most 8");
  assert_null(bad);

  fsdp_tensor *tt;
  assert_int_equal(fsdp_tensor_transpose(&tt, b23, 0, 1), FSDP_OK);
  expect_error(fsdp_tensor_view(&bad, tt, 1, SHAPE(6)), "view: tensor of shape (3, 2)");
  expect_error(fsdp_tensor_view(&bad, tt, 1, SHAPE(6)), "not contiguous");

  /* a row narrow of a contiguous tensor stays contiguous: view keeps its offset */
  fsdp_tensor *row, *rv;
  assert_int_equal(fsdp_tensor_narrow(&row, b23, 0, 1, 1), FSDP_OK);
  assert_int_equal(fsdp_tensor_view(&rv, row, 1, SHAPE(-1)), FSDP_OK);
  assert_int_equal(rv->offset, 3);
  assert_int_equal(rv->shape[0], 3);
  assert_true(*at(rv, SHAPE(2)) == 42.0f);

  /* scalars and empties */
  fsdp_tensor *s = arange(0, NULL), *s1, *s0;
  assert_int_equal(fsdp_tensor_view(&s1, s, 2, SHAPE(1, -1)), FSDP_OK);
  assert_int_equal(s1->shape[1], 1);
  assert_int_equal(fsdp_tensor_view(&s0, s1, 0, NULL), FSDP_OK);
  assert_int_equal(fsdp_tensor_numel(s0), 1);
  fsdp_tensor *e = mk(2, SHAPE(0, 3));
  expect_error(fsdp_tensor_view(&bad, e, 2, SHAPE(0, -1)), "invalid for a tensor of shape (0, 3)");

  fsdp_tensor *all[] = {base, v, b23, tt, row, rv, s, s1, s0, e};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) fsdp_tensor_release(all[i]);
}

static void test_transpose(void **state) {
  (void)state;
  fsdp_tensor *base = arange(3, SHAPE(2, 3, 4)), *tt, *bad = NULL;
  assert_int_equal(fsdp_tensor_transpose(&tt, base, 0, 2), FSDP_OK);
  assert_int_equal(tt->shape[0], 4);
  assert_int_equal(tt->shape[1], 3);
  assert_int_equal(tt->shape[2], 2);
  assert_int_equal(tt->strides[0], 1);
  assert_int_equal(tt->strides[1], 4);
  assert_int_equal(tt->strides[2], 12);
  assert_false(fsdp_tensor_is_contiguous(tt));
  int64_t i[3] = {0};
  do {
    assert_true(*at(tt, SHAPE(i[2], i[1], i[0])) == *at(base, i));
  } while (next_index(i, 3, base->shape));
  *at(tt, SHAPE(3, 2, 1)) = -5.0f;
  assert_true(*at(base, SHAPE(1, 2, 3)) == -5.0f);

  fsdp_tensor *same;
  assert_int_equal(fsdp_tensor_transpose(&same, base, 1, 1), FSDP_OK);
  assert_true(fsdp_tensor_is_contiguous(same));

  expect_error(fsdp_tensor_transpose(&bad, base, 0, 3),
               "transpose: dims 0 and 3: out of range for a tensor of shape (2, 3, 4)");
  expect_error(fsdp_tensor_transpose(&bad, base, -1, 0), "out of range");
  fsdp_tensor *s = mk(0, NULL);
  expect_error(fsdp_tensor_transpose(&bad, s, 0, 0), "shape ()");
  assert_null(bad);
  fsdp_tensor_release(s);
  fsdp_tensor_release(same);
  fsdp_tensor_release(tt);
  fsdp_tensor_release(base);
}

static void test_narrow(void **state) {
  (void)state;
  fsdp_tensor *base = arange(2, SHAPE(4, 5)), *n, *bad = NULL;
  assert_int_equal(fsdp_tensor_narrow(&n, base, 1, 1, 3), FSDP_OK);
  assert_int_equal(n->shape[0], 4);
  assert_int_equal(n->shape[1], 3);
  assert_int_equal(n->offset, 1);
  assert_int_equal(n->strides[0], 5);
  assert_false(fsdp_tensor_is_contiguous(n));
  int64_t i[2] = {0};
  do {
    assert_true(*at(n, i) == (float)(i[0] * 5 + i[1] + 1));
  } while (next_index(i, 2, n->shape));
  *at(n, SHAPE(2, 2)) = 99.0f;
  assert_true(((float *)fsdp_tensor_data(base, "t"))[2 * 5 + 3] == 99.0f);

  /* narrow of a transposed view, and an empty narrow at the end */
  fsdp_tensor *tt, *nt, *empty;
  assert_int_equal(fsdp_tensor_transpose(&tt, base, 0, 1), FSDP_OK); /* (5, 4) */
  assert_int_equal(fsdp_tensor_narrow(&nt, tt, 1, 2, 2), FSDP_OK);    /* (5, 2) */
  assert_true(*at(nt, SHAPE(3, 1)) == *at(base, SHAPE(3, 3)));
  assert_int_equal(fsdp_tensor_narrow(&empty, base, 1, 5, 0), FSDP_OK);
  assert_int_equal(fsdp_tensor_numel(empty), 0);

  expect_error(fsdp_tensor_narrow(&bad, base, 1, 3, 3),
               "narrow: dim 1, start 3, length 3 is out of range for size 5 "
               "(tensor of shape (4, 5))");
  expect_error(fsdp_tensor_narrow(&bad, base, 0, -1, 2), "start -1");
  expect_error(fsdp_tensor_narrow(&bad, base, 0, 0, -2), "length -2");
  expect_error(fsdp_tensor_narrow(&bad, base, 2, 0, 1), "narrow: dim 2 out of range");
  expect_error(fsdp_tensor_narrow(&bad, base, 0, 2, INT64_MAX), "out of range for size 4");
  assert_null(bad);
  fsdp_tensor *all[] = {base, n, tt, nt, empty};
  for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) fsdp_tensor_release(all[k]);
}

static void test_new_view_bounds(void **state) {
  (void)state;
  fsdp_tensor *base = arange(2, SHAPE(2, 3)), *v, *bad = NULL;
  assert_int_equal(fsdp_tensor_new_view(&v, base, 4, 1, SHAPE(2), SHAPE(1)), FSDP_OK);
  assert_true(*at(v, SHAPE(1)) == 5.0f);
  fsdp_tensor_release(v);
  /* a reversed view: negative stride */
  assert_int_equal(fsdp_tensor_new_view(&v, base, 5, 1, SHAPE(6), SHAPE(-1)), FSDP_OK);
  for (int k = 0; k < 6; k++) assert_true(*at(v, SHAPE(k)) == (float)(5 - k));
  fsdp_tensor *c;
  assert_int_equal(fsdp_tensor_contiguous(&c, v), FSDP_OK);
  for (int k = 0; k < 6; k++) assert_true(((float *)fsdp_tensor_data(c, "t"))[k] == (float)(5 - k));
  fsdp_tensor_release(c);
  fsdp_tensor_release(v);
  expect_error(fsdp_tensor_new_view(&bad, base, 5, 1, SHAPE(2), SHAPE(1)),
               "reach elements [5, 6] outside the storage's 6 elements");
  expect_error(fsdp_tensor_new_view(&bad, base, 0, 2, SHAPE(2, 3), SHAPE(4, 1)), "outside");
  expect_error(fsdp_tensor_new_view(&bad, base, 4, 1, SHAPE(6), SHAPE(-1)), "[-1, 4]");
  expect_error(fsdp_tensor_new_view(&bad, base, -1, 1, SHAPE(1), SHAPE(1)), "negative offset");
  expect_error(fsdp_tensor_new_view(&bad, base, 0, 1, SHAPE(-1), SHAPE(1)), "negative");
  assert_null(bad);
  fsdp_tensor_release(base);
}

static void test_contiguous_and_clone(void **state) {
  (void)state;
  fsdp_tensor *base = arange(2, SHAPE(3, 4)), *tt, *c, *same;
  assert_int_equal(fsdp_tensor_transpose(&tt, base, 0, 1), FSDP_OK);
  assert_int_equal(fsdp_tensor_contiguous(&c, tt), FSDP_OK);
  assert_ptr_not_equal(c->storage, base->storage);
  assert_true(fsdp_tensor_is_contiguous(c));
  assert_true(fsdp_tensor_same_shape(c, tt));
  int64_t i[2] = {0};
  do {
    assert_true(*at(c, i) == *at(tt, i));
  } while (next_index(i, 2, c->shape));
  const float *cd = fsdp_tensor_data(c, "t"); /* row-major order of the transposed values */
  assert_true(cd[0] == 0.0f && cd[1] == 4.0f && cd[2] == 8.0f && cd[3] == 1.0f);

  assert_int_equal(fsdp_tensor_contiguous(&same, base), FSDP_OK);
  assert_ptr_equal(same, base);
  assert_int_equal(base->refcount, 2);
  fsdp_tensor_release(same);

  /* clone: deep, same device and role, fresh version */
  fsdp_tensor *p, *pc;
  assert_int_equal(fsdp_tensor_new(&p, &fsdp_device_cpu, FSDP_DTYPE_F32, 1, SHAPE(4),
                                   FSDP_ROLE_PARAMS),
                   FSDP_OK);
  fsdp_tensor_fill(p, 3.0f);
  assert_int_equal(fsdp_tensor_clone(&pc, p), FSDP_OK);
  assert_int_equal(pc->storage->role, FSDP_ROLE_PARAMS);
  assert_int_equal(pc->version, 0);
  assert_ptr_not_equal(pc->storage, p->storage);
  ((float *)fsdp_tensor_data(pc, "t"))[0] = 7.0f;
  assert_true(((float *)fsdp_tensor_data(p, "t"))[0] == 3.0f);
  assert_true(((float *)fsdp_tensor_data(pc, "t"))[1] == 3.0f);
  fsdp_tensor *all[] = {base, tt, c, p, pc};
  for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) fsdp_tensor_release(all[k]);
}

/* A tensor of `shape` whose strides are a random permutation of a padded base's, at a non-zero
 * offset: the hardest layout copy has to walk. *base_out keeps the backing tensor. */
static fsdp_tensor *scrambled(int ndim, const int64_t *shape, unsigned *seed,
                              fsdp_tensor **base_out, float fillv) {
  int perm[FSDP_MAX_DIMS];
  for (int k = 0; k < ndim; k++) perm[k] = k;
  for (int k = ndim - 1; k > 0; k--) {
    int j = rand_r(seed) % (k + 1), tmp = perm[k];
    perm[k] = perm[j], perm[j] = tmp;
  }
  int64_t bshape[FSDP_MAX_DIMS], pad[FSDP_MAX_DIMS];
  for (int k = 0; k < ndim; k++) {
    pad[k] = rand_r(seed) % 2;
    bshape[k] = shape[perm[k]] + pad[k];
  }
  fsdp_tensor *base = mk(ndim, bshape);
  if (fillv == fillv) fsdp_tensor_fill(base, fillv);
  else { /* NaN: arange */
    float *p = fsdp_tensor_data(base, "t");
    for (int64_t k = 0; k < fsdp_tensor_numel(base); k++) p[k] = (float)k;
  }
  fsdp_tensor *x = base;
  fsdp_tensor_retain(x);
  for (int k = 0; k < ndim; k++) {
    fsdp_tensor *y;
    assert_int_equal(fsdp_tensor_narrow(&y, x, k, pad[k], shape[perm[k]]), FSDP_OK);
    fsdp_tensor_release(x);
    x = y;
  }
  int cur[FSDP_MAX_DIMS];
  memcpy(cur, perm, sizeof cur);
  for (int j = 0; j < ndim; j++) {
    int k = j;
    while (cur[k] != j) k++;
    if (k != j) {
      fsdp_tensor *y;
      assert_int_equal(fsdp_tensor_transpose(&y, x, j, k), FSDP_OK);
      fsdp_tensor_release(x);
      x = y;
      int tmp = cur[j];
      cur[j] = cur[k], cur[k] = tmp;
    }
  }
  for (int k = 0; k < ndim; k++) assert_int_equal(x->shape[k], shape[k]);
  *base_out = base;
  return x;
}

static void test_copy_strided(void **state) {
  (void)state;
  unsigned seed = 12345;
  for (int trial = 0; trial < 200; trial++) {
    int ndim = 1 + rand_r(&seed) % 5;
    int64_t shape[FSDP_MAX_DIMS];
    for (int k = 0; k < ndim; k++) shape[k] = 1 + rand_r(&seed) % 5;
    fsdp_tensor *sbase, *dbase;
    fsdp_tensor *src = scrambled(ndim, shape, &seed, &sbase, 0.0f / 0.0f);
    fsdp_tensor *dst = scrambled(ndim, shape, &seed, &dbase, -1.0f);
    uint64_t v = dst->version;
    assert_int_equal(fsdp_tensor_copy(dst, src), FSDP_OK);
    assert_int_equal(dst->version, v + 1);
    int64_t i[FSDP_MAX_DIMS] = {0};
    do {
      assert_true(*at(dst, i) == *at(src, i));
    } while (next_index(i, ndim, shape));
    /* nothing outside the destination view was written */
    int64_t untouched = 0;
    const float *d = fsdp_tensor_data(dbase, "t");
    for (int64_t k = 0; k < fsdp_tensor_numel(dbase); k++) untouched += d[k] == -1.0f;
    assert_int_equal(untouched, fsdp_tensor_numel(dbase) - fsdp_tensor_numel(dst));
    fsdp_tensor *all[] = {src, sbase, dst, dbase};
    for (size_t k = 0; k < 4; k++) fsdp_tensor_release(all[k]);
  }
}

/* Shapes past the 32 x 32 tile of the transposed-copy path, both directions, with a batch dim. */
static void test_copy_transposed_tiles(void **state) {
  (void)state;
  fsdp_tensor *base = arange(3, SHAPE(3, 70, 45)), *tt, *c;
  assert_int_equal(fsdp_tensor_transpose(&tt, base, 1, 2), FSDP_OK); /* (3, 45, 70) */
  assert_int_equal(fsdp_tensor_contiguous(&c, tt), FSDP_OK);
  int64_t i[3] = {0};
  do {
    assert_true(*at(c, i) == *at(base, SHAPE(i[0], i[2], i[1])));
  } while (next_index(i, 3, c->shape));
  /* strided destination: write c back through the transposed view of a zeroed tensor */
  fsdp_tensor *z = mk(3, SHAPE(3, 70, 45)), *zt;
  assert_int_equal(fsdp_tensor_transpose(&zt, z, 1, 2), FSDP_OK);
  assert_int_equal(fsdp_tensor_copy(zt, c), FSDP_OK);
  assert_memory_equal(fsdp_tensor_data(z, "t"), fsdp_tensor_data(base, "t"),
                      3 * 70 * 45 * sizeof(float));
  fsdp_tensor *all[] = {base, tt, c, z, zt};
  for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) fsdp_tensor_release(all[k]);
}

static void test_copy_errors_and_overlap(void **state) {
  (void)state;
  fsdp_tensor *a = mk(2, SHAPE(2, 3)), *b = mk(2, SHAPE(3, 2));
  expect_error(fsdp_tensor_copy(a, b), "copy: shape mismatch: destination (2, 3), source (3, 2)");
  assert_int_equal(a->version, 0); /* a failed copy wrote nothing */
  fsdp_tensor_release(a);
  fsdp_tensor_release(b);

  /* overlapping views of one buffer behave as if the source were read first */
  fsdp_tensor *base = arange(1, SHAPE(10)), *lo, *hi;
  assert_int_equal(fsdp_tensor_narrow(&lo, base, 0, 0, 8), FSDP_OK);
  assert_int_equal(fsdp_tensor_narrow(&hi, base, 0, 2, 8), FSDP_OK);
  assert_int_equal(fsdp_tensor_copy(hi, lo), FSDP_OK);
  static const float want1[] = {0, 1, 0, 1, 2, 3, 4, 5, 6, 7};
  assert_memory_equal(fsdp_tensor_data(base, "t"), want1, sizeof want1);
  assert_int_equal(hi->version, 1);
  assert_int_equal(fsdp_tensor_copy(lo, hi), FSDP_OK);
  static const float want2[] = {0, 1, 2, 3, 4, 5, 6, 7, 6, 7};
  assert_memory_equal(fsdp_tensor_data(base, "t"), want2, sizeof want2);
  assert_int_equal(fsdp_tensor_copy(lo, lo), FSDP_OK); /* self copy: no-op */
  assert_memory_equal(fsdp_tensor_data(base, "t"), want2, sizeof want2);

  /* a matrix copied onto its own transpose ends up transposed */
  fsdp_tensor *m = arange(2, SHAPE(3, 3)), *mt;
  assert_int_equal(fsdp_tensor_transpose(&mt, m, 0, 1), FSDP_OK);
  assert_int_equal(fsdp_tensor_copy(m, mt), FSDP_OK);
  static const float want3[] = {0, 3, 6, 1, 4, 7, 2, 5, 8};
  assert_memory_equal(fsdp_tensor_data(m, "t"), want3, sizeof want3);
  fsdp_tensor *all[] = {base, lo, hi, m, mt};
  for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) fsdp_tensor_release(all[k]);
}

static void test_fill(void **state) {
  (void)state;
  fsdp_tensor *base = mk(2, SHAPE(3, 4)), *col, *tt;
  assert_int_equal(fsdp_tensor_narrow(&col, base, 1, 2, 1), FSDP_OK);
  assert_int_equal(fsdp_tensor_fill(col, 7.0f), FSDP_OK);
  assert_int_equal(col->version, 1);
  const float *p = fsdp_tensor_data(base, "t");
  for (int k = 0; k < 12; k++) assert_true(p[k] == (k % 4 == 2 ? 7.0f : 0.0f));
  assert_int_equal(fsdp_tensor_transpose(&tt, base, 0, 1), FSDP_OK);
  fsdp_tensor *sub;
  assert_int_equal(fsdp_tensor_narrow(&sub, tt, 0, 0, 2), FSDP_OK); /* columns 0-1 */
  assert_int_equal(fsdp_tensor_fill(sub, -1.0f), FSDP_OK);
  for (int k = 0; k < 12; k++)
    assert_true(p[k] == (k % 4 < 2 ? -1.0f : k % 4 == 2 ? 7.0f : 0.0f));
  fsdp_tensor *s = mk(0, NULL);
  assert_int_equal(fsdp_tensor_fill(s, 2.5f), FSDP_OK);
  assert_true(*(float *)fsdp_tensor_data(s, "t") == 2.5f);
  fsdp_tensor *all[] = {base, col, tt, sub, s};
  for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) fsdp_tensor_release(all[k]);
}

static void test_meta(void **state) {
  fsdp_mem_set_limit(*state, 1000); /* meta never counts against the cap */
  fsdp_tensor *m, *bad = NULL;
  assert_int_equal(fsdp_tensor_new(&m, fsdp_device_find("meta"), FSDP_DTYPE_F32, 2,
                                   SHAPE(1000, 1000), FSDP_ROLE_PARAMS),
                   FSDP_OK);
  fsdp_error_clear();
  assert_null(fsdp_tensor_data(m, "init"));
  assert_string_equal(fsdp_error_msg(), "init: tensor (1000, 1000) on meta device has no data");
  fsdp_mem_report r;
  fsdp_mem_report_get(NULL, &r);
  assert_string_equal(r.device[1], "meta");
  assert_int_equal(r.counts[1].live[FSDP_ROLE_PARAMS], 4000000);
  assert_int_equal(r.counts[0].live_total, 0);

  fsdp_tensor *tt, *n, *c, *v;
  assert_int_equal(fsdp_tensor_transpose(&tt, m, 0, 1), FSDP_OK);
  assert_int_equal(fsdp_tensor_narrow(&n, tt, 0, 10, 20), FSDP_OK);
  assert_int_equal(fsdp_tensor_contiguous(&c, n), FSDP_OK);
  assert_ptr_equal(c->storage->device, &fsdp_device_meta);
  assert_int_equal(c->storage->role, FSDP_ROLE_PARAMS);
  assert_int_equal(fsdp_tensor_view(&v, c, 1, SHAPE(-1)), FSDP_OK);
  assert_int_equal(v->shape[0], 20000);
  assert_int_equal(fsdp_tensor_fill(v, 1.0f), FSDP_OK);

  fsdp_tensor *cpu = mk(1, SHAPE(20000 / 100)); /* 800 bytes: fits the 1000-byte cap */
  fsdp_tensor *cv;
  assert_int_equal(fsdp_tensor_view(&cv, v, 2, SHAPE(100, 200)), FSDP_OK);
  fsdp_tensor *row;
  assert_int_equal(fsdp_tensor_narrow(&row, cv, 0, 0, 1), FSDP_OK);
  fsdp_tensor *row1;
  assert_int_equal(fsdp_tensor_view(&row1, row, 1, SHAPE(200)), FSDP_OK);
  assert_int_equal(fsdp_tensor_copy(row1, cpu), FSDP_OK); /* into meta: shape only */
  expect_error(fsdp_tensor_copy(cpu, row1), "copy: source: tensor (200) on meta device has no data");
  expect_error(fsdp_tensor_new_f32(&bad, 1, SHAPE(100)), "out of memory budget");
  fsdp_tensor *all[] = {m, tt, n, c, v, cpu, cv, row, row1};
  for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) fsdp_tensor_release(all[k]);
}

static void test_set_storage_and_grad(void **state) {
  fsdp_tensor *t = arange(1, SHAPE(4)), *g = mk(1, SHAPE(4));
  fsdp_storage *s;
  assert_int_equal(fsdp_storage_new(&s, &fsdp_device_cpu, 16, FSDP_ROLE_PARAMS), FSDP_OK);
  assert_int_equal(s->refcount, 1);
  fsdp_tensor_set_storage(t, s, 0);
  assert_int_equal(s->refcount, 2);
  assert_int_equal(cpu_counts(*state).live[FSDP_ROLE_ACTIVATIONS], 16); /* only g now */
  fsdp_tensor_set_storage(t, s, 1); /* the same storage again */
  assert_int_equal(s->refcount, 2);
  assert_int_equal(t->offset, 1);
  fsdp_storage_release(s);
  assert_int_equal(t->storage->refcount, 1);
  assert_true(fsdp_tensor_data(t, "t") == (float *)t->storage->data + 1);

  fsdp_tensor_set_grad(t, g);
  assert_int_equal(g->refcount, 2);
  fsdp_tensor_set_grad(t, g);
  assert_int_equal(g->refcount, 2);
  fsdp_tensor_set_grad(t, NULL);
  assert_int_equal(g->refcount, 1);
  fsdp_tensor_set_grad(t, g);
  fsdp_tensor_release(g); /* t holds the only reference now */
  assert_int_equal(cpu_counts(*state).live[FSDP_ROLE_ACTIVATIONS], 16);
  fsdp_tensor_release(t); /* releases the grad and the storage */
  assert_int_equal(cpu_counts(*state).live_total, 0);
}

static void test_storage_wrap(void **state) {
  float buf[4] = {1, 2, 3, 4};
  fsdp_mem_counts before = cpu_counts(*state);
  fsdp_storage *s, *bad = (fsdp_storage *)1;
  assert_int_equal(fsdp_storage_wrap(&s, buf, sizeof buf), FSDP_OK);
  assert_ptr_equal(s->data, buf);
  assert_null(s->domain);
  fsdp_tensor *t = mk(1, SHAPE(4));
  fsdp_tensor_set_storage(t, s, 0);
  fsdp_storage_release(s);
  fsdp_tensor_fill(t, 9.0f);
  assert_true(buf[3] == 9.0f);
  fsdp_tensor_release(t); /* frees the header only: buf is on the stack */
  fsdp_mem_counts after = cpu_counts(*state);
  assert_memory_equal(&before.live, &after.live, sizeof before.live);
  expect_error(fsdp_storage_wrap(&bad, NULL, 8), "cannot wrap NULL");
  assert_null(bad);
  /* fsdp_tensor_wrap: the same as a contiguous cpu tensor of any dtype */
  uint16_t h[6] = {0};
  fsdp_tensor *w, *wbad = (fsdp_tensor *)1;
  assert_int_equal(fsdp_tensor_wrap(&w, h, FSDP_DTYPE_BF16, 2, SHAPE(2, 3)), FSDP_OK);
  assert_ptr_equal(fsdp_tensor_data(w, "test"), h);
  assert_ptr_equal(w->storage->device, &fsdp_device_cpu);
  assert_int_equal(w->dtype, FSDP_DTYPE_BF16);
  assert_true(fsdp_tensor_is_contiguous(w) && w->shape[0] == 2 && w->shape[1] == 3);
  assert_int_equal(w->storage->bytes, sizeof h);
  fsdp_tensor_fill(w, 1.0);
  assert_int_equal(h[5], fsdp_f32_to_bf16(1.0f));
  fsdp_tensor_release(w); /* frees the headers only */
  after = cpu_counts(*state);
  assert_memory_equal(&before.live, &after.live, sizeof before.live);
  expect_error(fsdp_tensor_wrap(&wbad, NULL, FSDP_DTYPE_F32, 1, SHAPE(2)), "cannot wrap NULL");
  assert_null(wbad);
}

/* ---- accounting --------------------------------------------------------------------------- */

static fsdp_tensor *mk_role(int64_t n, fsdp_role role) {
  fsdp_tensor *t;
  assert_int_equal(fsdp_tensor_new(&t, &fsdp_device_cpu, FSDP_DTYPE_F32, 1, SHAPE(n), role),
                   FSDP_OK);
  return t;
}

static void test_accounting(void **state) {
  fsdp_mem_domain *d = *state;
  fsdp_mem_report proc_before, proc_after;
  fsdp_mem_domain_set(NULL);
  fsdp_mem_report_get(NULL, &proc_before);
  fsdp_mem_domain_set(d);
  assert_ptr_equal(fsdp_mem_domain_current(), d);

  fsdp_tensor *p = mk_role(1000, FSDP_ROLE_PARAMS), *g = mk_role(500, FSDP_ROLE_GRADS);
  fsdp_tensor *o = mk_role(250, FSDP_ROLE_OPTIM);
  fsdp_mem_report r;
  fsdp_mem_report_get(d, &r);
  assert_int_equal(r.ndevices, 2);
  assert_string_equal(r.device[0], "cpu");
  assert_string_equal(r.device[1], "meta");
  fsdp_mem_counts c = r.counts[0];
  assert_int_equal(c.live[FSDP_ROLE_PARAMS], 4000);
  assert_int_equal(c.live[FSDP_ROLE_GRADS], 2000);
  assert_int_equal(c.live[FSDP_ROLE_OPTIM], 1000);
  assert_int_equal(c.live[FSDP_ROLE_ACTIVATIONS], 0);
  assert_int_equal(c.live_total, 7000);
  assert_int_equal(c.peak_total, 7000);
  assert_int_equal(r.counts[1].live_total, 0);

  fsdp_tensor_release(p);
  c = cpu_counts(d);
  assert_int_equal(c.live[FSDP_ROLE_PARAMS], 0);
  assert_int_equal(c.peak[FSDP_ROLE_PARAMS], 4000);
  assert_int_equal(c.live_total, 3000);
  assert_int_equal(c.peak_total, 7000);
  fsdp_mem_reset_peak(d);
  c = cpu_counts(d);
  assert_int_equal(c.peak[FSDP_ROLE_PARAMS], 0);
  assert_int_equal(c.peak[FSDP_ROLE_GRADS], 2000);
  assert_int_equal(c.peak_total, 3000);
  fsdp_tensor *a = mk_role(100, FSDP_ROLE_ACTIVATIONS);
  fsdp_tensor_release(a);
  c = cpu_counts(d);
  assert_int_equal(c.peak_total, 3400);
  assert_int_equal(c.peak[FSDP_ROLE_ACTIVATIONS], 400);
  fsdp_tensor_release(g);
  fsdp_tensor_release(o);

  fsdp_mem_domain_set(NULL);
  fsdp_mem_report_get(NULL, &proc_after);
  fsdp_mem_domain_set(d);
  assert_memory_equal(&proc_before, &proc_after, sizeof proc_before);
}

static void test_limit(void **state) {
  fsdp_mem_domain *d = *state;
  fsdp_mem_set_limit(d, 2 << 20);
  assert_int_equal(fsdp_mem_get_limit(d), 2 << 20);
  assert_int_equal(fsdp_mem_get_limit(NULL), 2 << 20);
  fsdp_tensor *a = mk_role((1 << 20) / 4, FSDP_ROLE_GRADS), *bad = (fsdp_tensor *)1;
  fsdp_mem_report before, after;
  fsdp_mem_report_get(d, &before);
  expect_error(fsdp_tensor_new(&bad, &fsdp_device_cpu, FSDP_DTYPE_F32, 1,
                               SHAPE((3 << 20) / 8), FSDP_ROLE_PARAMS),
               "");
  assert_string_equal(fsdp_error_msg(),
                      "out of memory budget: allocating 1.5 MiB of params on cpu would bring "
                      "live bytes to 2.5 MiB, limit is 2.0 MiB (FSDP_MEM_LIMIT)");
  assert_null(bad);
  fsdp_mem_report_get(d, &after);
  assert_memory_equal(&before, &after, sizeof before); /* nothing was counted */

  /* exactly at the cap is allowed; one element more is not (and says so in bytes) */
  fsdp_tensor *b = mk_role((1 << 20) / 4, FSDP_ROLE_PARAMS);
  fsdp_tensor_release(b);
  expect_error(fsdp_storage_new((fsdp_storage **)&bad, &fsdp_device_cpu, (1 << 20) + 1,
                                FSDP_ROLE_OTHER),
               "would bring live bytes to 2097153 bytes, limit is 2097152 bytes");
  fsdp_tensor_release(a); /* freeing makes room */
  b = mk_role((3 << 20) / 8, FSDP_ROLE_PARAMS);
  fsdp_tensor_release(b);
  fsdp_mem_set_limit(d, 0); /* no cap */
  b = mk_role(4 << 20, FSDP_ROLE_PARAMS);
  fsdp_tensor_release(b);
  expect_error(fsdp_storage_new((fsdp_storage **)&bad, &fsdp_device_cpu, 8, FSDP_ROLE_COUNT),
               "invalid memory role");
  fsdp_device_i fake = fsdp_device_cpu;
  fake.name = "fake";
  expect_error(fsdp_storage_new((fsdp_storage **)&bad, &fake, 8, FSDP_ROLE_OTHER),
               "'fake': not a registered device");
  assert_int_equal(cpu_counts(d).live_total, 0);
}

/* main() sets FSDP_MEM_LIMIT=64M before anything runs */
static void test_env_limit(void **state) {
  (void)state;
  fsdp_mem_domain *pd = fsdp_mem_domain_current();
  fsdp_mem_domain_set(NULL);
  assert_ptr_not_equal(fsdp_mem_domain_current(), pd);
  assert_int_equal(fsdp_mem_get_limit(NULL), 64 << 20);
  fsdp_tensor *bad = NULL;
  expect_error(fsdp_tensor_new_f32(&bad, 1, SHAPE(17 << 20)),
               "allocating 68.0 MiB of activations on cpu would bring live bytes to 68.0 MiB, "
               "limit is 64.0 MiB (FSDP_MEM_LIMIT)");
  fsdp_mem_domain *d = fsdp_mem_domain_new();
  assert_int_equal(fsdp_mem_get_limit(d), 64 << 20); /* inherited */
  fsdp_mem_domain_free(d);
  fsdp_mem_set_limit(NULL, 1 << 20); /* later domains inherit the process domain's cap */
  d = fsdp_mem_domain_new();
  assert_int_equal(fsdp_mem_get_limit(d), 1 << 20);
  fsdp_mem_domain_free(d);
  fsdp_mem_set_limit(NULL, 64 << 20);
  fsdp_mem_domain_set(pd);
}

static void test_parse_size(void **state) {
  (void)state;
  static const struct {
    const char *text;
    int64_t want;
  } ok[] = {{"1048576", 1048576},       {"512K", 512 << 10},  {"1.5M", 3 << 19},
            {"2G", 2LL << 30},           {"2GiB", 2LL << 30}, {"64mb", 64 << 20},
            {" 3 k", 3 << 10},           {"0", 0},            {"1T", 1LL << 40},
            {"100B", 100}};
  for (size_t k = 0; k < sizeof ok / sizeof ok[0]; k++) {
    int64_t v = -7;
    assert_int_equal(fsdp_mem_parse_size(ok[k].text, &v), FSDP_OK);
    assert_int_equal(v, ok[k].want);
  }
  static const char *bad[] = {"", "abc", "-1", "12X", "1.5.2", "nan", "inf", "1e30", "5 K B x"};
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    int64_t v;
    expect_error(fsdp_mem_parse_size(bad[k], &v), "cannot parse size");
  }
  int64_t v;
  expect_error(fsdp_mem_parse_size("abc", &v), "cannot parse size 'abc'");
  expect_error(fsdp_mem_parse_size(NULL, &v), "cannot parse size");
}

/* ---- threads --------------------------------------------------------------------------------- */

typedef struct {
  int64_t params, grads;      /* what this "rank" allocates */
  pthread_barrier_t *barrier; /* both ranks hold their memory at once */
  fsdp_mem_counts during, after;
  bool current_ok, alloc_ok;
} rank_arg;

static void *rank_main(void *p) {
  rank_arg *a = p;
  fsdp_mem_domain *d = fsdp_mem_domain_new();
  a->current_ok = fsdp_mem_domain_current() != d; /* a new thread starts on the process domain */
  fsdp_mem_domain_set(d);
  a->current_ok &= fsdp_mem_domain_current() == d;
  fsdp_tensor *x = NULL, *y = NULL;
  a->alloc_ok = fsdp_tensor_new(&x, &fsdp_device_cpu, FSDP_DTYPE_F32, 1, SHAPE(a->params / 4),
                                FSDP_ROLE_PARAMS) == FSDP_OK &&
                fsdp_tensor_new(&y, &fsdp_device_cpu, FSDP_DTYPE_F32, 1, SHAPE(a->grads / 4),
                                FSDP_ROLE_GRADS) == FSDP_OK;
  pthread_barrier_wait(a->barrier);
  fsdp_mem_report r;
  fsdp_mem_report_get(NULL, &r);
  a->during = r.counts[0];
  pthread_barrier_wait(a->barrier);
  fsdp_tensor_release(x);
  fsdp_tensor_release(y);
  fsdp_mem_report_get(d, &r);
  a->after = r.counts[0];
  fsdp_mem_domain_free(d);
  a->current_ok &= fsdp_mem_domain_current() != d;
  return NULL;
}

static void test_domains_on_threads(void **state) {
  fsdp_mem_counts mine_before = cpu_counts(*state);
  pthread_barrier_t barrier;
  pthread_barrier_init(&barrier, NULL, 2);
  rank_arg args[2] = {{.params = 4000, .grads = 400, .barrier = &barrier},
                      {.params = 8000, .grads = 1200, .barrier = &barrier}};
  pthread_t th[2];
  for (int k = 0; k < 2; k++) assert_int_equal(pthread_create(&th[k], NULL, rank_main, &args[k]), 0);
  for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
  pthread_barrier_destroy(&barrier);
  for (int k = 0; k < 2; k++) {
    assert_true(args[k].current_ok);
    assert_true(args[k].alloc_ok);
    assert_int_equal(args[k].during.live[FSDP_ROLE_PARAMS], args[k].params);
    assert_int_equal(args[k].during.live[FSDP_ROLE_GRADS], args[k].grads);
    assert_int_equal(args[k].during.live_total, args[k].params + args[k].grads);
    assert_int_equal(args[k].after.live_total, 0);
    assert_int_equal(args[k].after.peak_total, args[k].params + args[k].grads);
  }
  fsdp_mem_counts mine_after = cpu_counts(*state);
  assert_memory_equal(&mine_before, &mine_after, sizeof mine_before);
}

typedef struct {
  fsdp_mem_domain *domain;
  fsdp_tensor *t;
  bool drop_domain; /* creator drops its reference before the storage is freed */
} alloc_arg;

static void *alloc_main(void *p) {
  alloc_arg *a = p;
  a->domain = fsdp_mem_domain_new();
  fsdp_mem_domain_set(a->domain);
  if (fsdp_tensor_new(&a->t, &fsdp_device_cpu, FSDP_DTYPE_F32, 1, SHAPE(1024),
                      FSDP_ROLE_PARAMS) != FSDP_OK)
    a->t = NULL;
  if (a->drop_domain) fsdp_mem_domain_free(a->domain);
  return NULL;
}

static void test_free_on_other_thread(void **state) {
  fsdp_mem_counts mine_before = cpu_counts(*state);
  alloc_arg a = {0};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, alloc_main, &a), 0);
  pthread_join(th, NULL);
  assert_non_null(a.t);
  assert_int_equal(cpu_counts(a.domain).live[FSDP_ROLE_PARAMS], 4096);
  fsdp_tensor_release(a.t); /* on this thread: uncharges the allocating thread's domain */
  fsdp_mem_counts c = cpu_counts(a.domain);
  assert_int_equal(c.live[FSDP_ROLE_PARAMS], 0);
  assert_int_equal(c.peak[FSDP_ROLE_PARAMS], 4096);
  fsdp_mem_counts mine_after = cpu_counts(*state);
  assert_memory_equal(&mine_before, &mine_after, sizeof mine_before);
  fsdp_mem_domain_free(a.domain);

  /* deferred free: the domain outlives its creator's reference while a storage is live
   * (valgrind checks the release below touches no freed memory and leaks nothing) */
  alloc_arg b = {.drop_domain = true};
  assert_int_equal(pthread_create(&th, NULL, alloc_main, &b), 0);
  pthread_join(th, NULL);
  assert_non_null(b.t);
  assert_ptr_equal(b.t->storage->domain, b.domain);
  fsdp_tensor_release(b.t);
}

typedef struct {
  fsdp_tensor *shared;
  fsdp_mem_domain *domain;
  int64_t cap, failures;
} stress_arg;

static void *stress_main(void *p) {
  stress_arg *a = p;
  fsdp_mem_domain_set(a->domain);
  for (int k = 0; k < 20000; k++) {
    fsdp_tensor_retain(a->shared);
    fsdp_storage *s;
    if (fsdp_storage_new(&s, &fsdp_device_cpu, 1024, FSDP_ROLE_OTHER) == FSDP_OK)
      fsdp_storage_release(s);
    else
      a->failures++;
    fsdp_tensor_release(a->shared);
  }
  return NULL;
}

/* Two threads racing in one capped domain never exceed the cap; refcounts survive the race. */
static void test_concurrent_cap_and_refcounts(void **state) {
  fsdp_mem_domain *d = *state;
  fsdp_mem_set_limit(d, 1536); /* room for one 1 KiB storage at a time */
  fsdp_tensor *shared = mk(1, SHAPE(4));
  fsdp_mem_reset_peak(d);
  stress_arg args[2] = {{shared, d, 1536, 0}, {shared, d, 1536, 0}};
  pthread_t th[2];
  for (int k = 0; k < 2; k++)
    assert_int_equal(pthread_create(&th[k], NULL, stress_main, &args[k]), 0);
  for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
  assert_int_equal(shared->refcount, 1);
  fsdp_mem_counts c = cpu_counts(d);
  assert_true(c.peak_total <= 1536 && c.peak_total >= 16 + 1024);
  assert_int_equal(c.live_total, 16);
  assert_int_equal(c.live[FSDP_ROLE_OTHER], 0);
  fsdp_tensor_release(shared);
}


/* The cpu block cache: a freed large block is reused for the next request of its size, a
 * zeroed request gets zeros even when the block was dirty, and trim returns everything. */
static void test_cpu_cache(void **state) {
  (void)state;
  fsdp_device_cpu_trim();
  assert_int_equal(fsdp_device_cpu_cached_bytes(), 0);
  int64_t n = 1 << 16; /* 256 KiB: above the cache's 64 KiB floor */
  fsdp_tensor *a;
  assert_int_equal(fsdp_tensor_new_f32_uninit(&a, 1, &n), FSDP_OK);
  float *pa = fsdp_tensor_data(a, "test");
  for (int64_t i = 0; i < n; i++) pa[i] = 7.0f;
  fsdp_tensor_release(a);
  assert_int_equal(fsdp_device_cpu_cached_bytes(), (size_t)n * 4);
  fsdp_tensor *b;
  assert_int_equal(fsdp_tensor_new_f32(&b, 1, &n), FSDP_OK);
  float *pb = fsdp_tensor_data(b, "test");
  assert_ptr_equal(pb, pa); /* the same block came back ... */
  for (int64_t i = 0; i < n; i++) assert_true(pb[i] == 0.0f); /* ... cleared */
  assert_int_equal(fsdp_device_cpu_cached_bytes(), 0);
  fsdp_tensor_release(b);
  /* a small block is never cached */
  int64_t small = 16;
  fsdp_tensor *c;
  assert_int_equal(fsdp_tensor_new_f32(&c, 1, &small), FSDP_OK);
  fsdp_tensor_release(c);
  assert_int_equal(fsdp_device_cpu_cached_bytes(), (size_t)n * 4);
  fsdp_device_cpu_trim();
  assert_int_equal(fsdp_device_cpu_cached_bytes(), 0);
}

int main(void) {
  setenv("FSDP_MEM_LIMIT", "64M", 1); /* read once, on the first allocation */
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_errors),
      cmocka_unit_test(test_names),
      cmocka_unit_test(test_dtype_names),
      cmocka_unit_test(test_bf16_bits),
      cmocka_unit_test(test_f16_bits),
      cmocka_unit_test(test_dtype_load_store),
      T(test_devices),
      T(test_tensor_new),
      T(test_view_keeps_storage),
      T(test_view),
      T(test_transpose),
      T(test_narrow),
      T(test_new_view_bounds),
      T(test_contiguous_and_clone),
      T(test_copy_strided),
      T(test_copy_transposed_tiles),
      T(test_copy_errors_and_overlap),
      T(test_fill),
      T(test_meta),
      T(test_set_storage_and_grad),
      T(test_storage_wrap),
      T(test_accounting),
      T(test_limit),
      T(test_env_limit),
      cmocka_unit_test(test_parse_size),
      T(test_domains_on_threads),
      T(test_free_on_other_thread),
      T(test_concurrent_cap_and_refcounts),
      T(test_cpu_cache),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
