/*
 * test_devices.c — a second device (cpu2_device.h: host memory behind host_memory = false,
 * the cpu's kernel table, registered through fsdp_device_register only) checked against the
 * cpu: registration, ops forward and backward bit for bit, mixing devices, moves across devices
 * and dtypes, fill and copy on a device the host must not read, and an FSDP unit at 1 and 2
 * ranks training bit for bit like the cpu one. Counting cpu2's to_host / from_host shows that
 * the hot paths (ops, gather, reduce-scatter, gradient accumulation, optimizer steps) move no
 * data through the host, and that the paths that must read on the host do go through them.
 *
 * Rank code runs on threads (a local group, as in test_fsdp.c) and checks with CHECK, which
 * records the first failure and aborts the communicator; the main thread fails the test.
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "autograd/autograd.h"
#include "comm/comm.h"
#include "cpu2_device.h"
#include "fsdp/unit.h"
#include "kernels/kernels.h"
#include "ranks.h"

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define NDIM(...) ((int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))

static int setup(void **state) {
  (void)state;
  return cpu2_register() == FSDP_OK ? 0 : -1;
}

/* ---- tensors ------------------------------------------------------------------------------- */

/* Uniform in [-1, 1) from the stream `name`, made on the cpu in f32, then moved to dev as dt. */
static fsdp_tensor *rnd(const fsdp_device_i *dev, fsdp_dtype dt, int ndim, const int64_t *shape,
                        const char *name) {
  fsdp_tensor *c, *t;
  assert_int_equal(fsdp_tensor_new(&c, &fsdp_device_cpu, FSDP_DTYPE_F32, ndim, shape,
                                   FSDP_ROLE_ACTIVATIONS), FSDP_OK);
  assert_int_equal(fsdp_cpu_kernels.random(NULL, FSDP_DTYPE_F32, fsdp_tensor_data(c, "test"),
                                           fsdp_tensor_numel(c), fsdp_rng_key(3, name), 0,
                                           false, -1.0, 1.0),
                   FSDP_OK);
  assert_int_equal(fsdp_to(&t, c, dev, dt, FSDP_ROLE_ACTIVATIONS), FSDP_OK);
  fsdp_tensor_release(c);
  return t;
}

/* i64 ids (i * mul + add) % mod, on dev */
static fsdp_tensor *ids(const fsdp_device_i *dev, int64_t n, int64_t mul, int64_t add,
                        int64_t mod) {
  fsdp_tensor *c, *t;
  assert_int_equal(fsdp_tensor_new(&c, &fsdp_device_cpu, FSDP_DTYPE_I64, 1, &n,
                                   FSDP_ROLE_ACTIVATIONS), FSDP_OK);
  int64_t *d = fsdp_tensor_data(c, "test");
  for (int64_t i = 0; i < n; i++) d[i] = (i * mul + add) % mod;
  assert_int_equal(fsdp_to(&t, c, dev, FSDP_DTYPE_I64, -1), FSDP_OK);
  fsdp_tensor_release(c);
  return t;
}

/* a and b hold the same shape, dtype and bytes (each read through fsdp_to_host) */
static bool same_bits(fsdp_tensor *a, fsdp_tensor *b) {
  if (!fsdp_tensor_same_shape(a, b) || a->dtype != b->dtype) return false;
  fsdp_tensor *ha, *hb;
  if (fsdp_to_host(&ha, a) || fsdp_to_host(&hb, b)) return false;
  bool same = memcmp(fsdp_tensor_data(ha, "test"), fsdp_tensor_data(hb, "test"),
                     (size_t)fsdp_tensor_numel(a) * fsdp_dtype_size(a->dtype)) == 0;
  fsdp_tensor_release(ha);
  fsdp_tensor_release(hb);
  return same;
}

static void assert_msg_has(const char *want) {
  if (!strstr(fsdp_error_msg(), want))
    fail_msg("error message \"%s\" lacks \"%s\"", fsdp_error_msg(), want);
}

/* ---- registration ---------------------------------------------------------------------------- */

static int no_alloc(void *ctx, void **out, size_t bytes) {
  (void)ctx, (void)bytes;
  *out = NULL;
  return FSDP_OK;
}
static void no_free(void *ctx, void *p, size_t b) { (void)ctx, (void)p, (void)b; }

static void test_registration(void **state) {
  (void)state;
  assert_ptr_equal(fsdp_device_find("cpu2"), &cpu2_device);
  assert_int_equal(cpu2_register(), FSDP_OK); /* the same table again: only its kernels */
  assert_ptr_equal(fsdp_kernels_of(&cpu2_device, "test"), &cpu2_kernels);
  int n = fsdp_device_count();
  assert_int_equal(fsdp_device_index(&cpu2_device), n - 1);
  /* another table with a taken name, and a data device without host copies, are refused */
  static fsdp_device_i twin = {.name = "cpu2", .alloc = no_alloc, .free = no_free};
  assert_int_equal(fsdp_device_register(&twin, NULL), FSDP_ERR);
  assert_msg_has("register device 'cpu2': a different device has that name");
  static fsdp_device_i half = {.name = "half", .has_data = true, .alloc = no_alloc,
                               .free = no_free, .copy = cpu2_copy};
  assert_int_equal(fsdp_device_register(&half, NULL), FSDP_ERR);
  assert_msg_has("needs copy, to_host and from_host");
  assert_int_equal(fsdp_device_count(), n);
}

/* ---- ops: the same bits as on the cpu, no host transfers ---------------------------------- */

enum { B = 2, T = 4, C = 8, NH = 2, V = 11, N = B * T, NPARAM = 6, MAXR = 48 };

typedef struct {
  fsdp_tensor *p[NPARAM]; /* wte, ln_w, ln_b, w_qkv, b_qkv, w_head */
  fsdp_tensor *ids, *tgt, *y;
  fsdp_tensor *r[MAXR]; /* every op's result, in order (released by graph_free) */
  int nr;
  fsdp_tensor *loss;
} graph;

static void graph_init(graph *g, const fsdp_device_i *dev) {
  memset(g, 0, sizeof *g);
  g->p[0] = rnd(dev, FSDP_DTYPE_F32, 2, SHAPE(V, C), "wte");
  g->p[1] = rnd(dev, FSDP_DTYPE_F32, 1, SHAPE(C), "ln_w");
  g->p[2] = rnd(dev, FSDP_DTYPE_F32, 1, SHAPE(C), "ln_b");
  g->p[3] = rnd(dev, FSDP_DTYPE_F32, 2, SHAPE(3 * C, C), "w_qkv");
  g->p[4] = rnd(dev, FSDP_DTYPE_F32, 1, SHAPE(3 * C), "b_qkv");
  g->p[5] = rnd(dev, FSDP_DTYPE_F32, 2, SHAPE(V, C), "w_head");
  for (int i = 0; i < NPARAM; i++) g->p[i]->requires_grad = true;
  g->ids = ids(dev, N, 3, 0, V);
  g->tgt = ids(dev, N, 5, 1, V);
  g->y = rnd(dev, FSDP_DTYPE_F32, 2, SHAPE(N, C), "y");
}

static void graph_free(graph *g) {
  for (int i = 0; i < NPARAM; i++) fsdp_tensor_release(g->p[i]);
  for (int i = 0; i < g->nr; i++) fsdp_tensor_release(g->r[i]);
  fsdp_tensor_release(g->ids);
  fsdp_tensor_release(g->tgt);
  fsdp_tensor_release(g->y);
  fsdp_tensor_release(g->loss);
}

/* keep an op's result: the call must succeed */
static fsdp_tensor *kept(graph *g, int rc, fsdp_tensor *t) {
  if (rc) fail_msg("op failed: %s", fsdp_error_msg());
  assert_true(g->nr < MAXR);
  return g->r[g->nr++] = t;
}
/* the comma sequences the call before o_ is read */
#define OP(call) (rc_ = (call), kept(g, rc_, o_))
#define OUT (&o_)

/* A forward touching every kind of op (linear algebra, norm, attention, activations, views and
 * strided copies, reductions, selection, comparisons, conversions, losses) and its backward. */
static void graph_run(graph *g) {
  fsdp_tensor *o_ = NULL, **p = g->p;
  int rc_;
  fsdp_rng_manual_seed(5); /* dropout's stream */
  fsdp_tensor *e = OP(fsdp_op_embedding(OUT, g->ids, p[0]));
  fsdp_tensor *h = OP(fsdp_op_layernorm(OUT, e, p[1], p[2], 1e-5f));
  fsdp_tensor *qkv = OP(fsdp_op_linear(OUT, h, p[3], p[4]));
  fsdp_tensor *q3 = OP(fsdp_op_view(OUT, qkv, 3, SHAPE(B, T, 3 * C)));
  fsdp_tensor *a = OP(fsdp_op_attention(OUT, q3, NH));
  fsdp_tensor *a2 = OP(fsdp_op_view(OUT, a, 2, SHAPE(N, C)));
  fsdp_tensor *r = OP(fsdp_op_binary(OUT, e, a2, FSDP_OP_ADD));
  fsdp_tensor *gl = OP(fsdp_op_unary(OUT, r, FSDP_UNARY_GELU));
  fsdp_tensor *tr = OP(fsdp_op_transpose(OUT, gl, 0, 1));
  fsdp_tensor *tc = OP(fsdp_op_contiguous(OUT, tr)); /* a strided copy on the device */
  fsdp_tensor *mm = OP(fsdp_op_matmul(OUT, gl, tc));
  fsdp_tensor *sm = OP(fsdp_op_softmax(OUT, mm, 1));
  fsdp_tensor *nr = OP(fsdp_op_narrow(OUT, sm, 1, 1, C / 2)); /* strided */
  fsdp_tensor *cl = OP(fsdp_op_clamp(OUT, nr, 0.01, 0.5));
  fsdp_tensor *pw = OP(fsdp_op_pow(OUT, cl, 2.0f));
  fsdp_tensor *ct = OP(fsdp_op_cat(OUT, (fsdp_tensor *[]){gl, pw}, 2, 1));
  fsdp_tensor *c2 = OP(fsdp_op_narrow(OUT, ct, 1, C / 2, C));
  fsdp_tensor *dr = OP(fsdp_op_dropout(OUT, c2, 0.25f));
  fsdp_tensor *logits = OP(fsdp_op_linear(OUT, gl, p[5], NULL));
  fsdp_tensor *ce = OP(fsdp_op_cross_entropy(OUT, logits, g->tgt, -1));
  fsdp_tensor *ms = OP(fsdp_op_mse(OUT, dr, g->y));
  fsdp_tensor *sd = OP(fsdp_op_sum_dim(OUT, pw, 1, true));
  fsdp_tensor *s1 = OP(fsdp_op_sum(OUT, sd));
  fsdp_tensor *mx = NULL, *ix = NULL, *tk = NULL, *ti = NULL;
  if (fsdp_op_extreme(&mx, &ix, gl, 1, true, false)) fail_msg("%s", fsdp_error_msg());
  kept(g, 0, mx), kept(g, 0, ix);
  if (fsdp_op_topk(&tk, &ti, gl, 3, 1, true)) fail_msg("%s", fsdp_error_msg());
  kept(g, 0, tk), kept(g, 0, ti);
  fsdp_tensor *s2 = OP(fsdp_op_mean(OUT, tk));
  fsdp_tensor *s3 = OP(fsdp_op_sum(OUT, mx));
  fsdp_tensor *cmp = OP(fsdp_op_compare(OUT, gl, r, FSDP_CMP_GT));
  fsdp_tensor *wh = OP(fsdp_op_where(OUT, cmp, gl, r));
  fsdp_tensor *s4 = OP(fsdp_op_sum(OUT, wh));
  /* the bf16 conversion pass of the kernels, on the device */
  fsdp_tensor *hb = OP(fsdp_op_to(OUT, h, NULL, FSDP_DTYPE_BF16));
  fsdp_tensor *tb = OP(fsdp_op_unary(OUT, hb, FSDP_UNARY_TANH));
  fsdp_tensor *tf = OP(fsdp_op_to(OUT, tb, NULL, FSDP_DTYPE_F32));
  fsdp_tensor *s5 = OP(fsdp_op_sum(OUT, tf));
  fsdp_tensor *s6 = OP(fsdp_op_affine(OUT, s4, 0.125f, 0.0f));
  fsdp_tensor *l = ce;
  fsdp_tensor *terms[] = {ms, s1, s2, s3, s5, s6};
  for (size_t i = 0; i < sizeof terms / sizeof terms[0]; i++)
    l = OP(fsdp_op_binary(OUT, l, terms[i], FSDP_OP_ADD));
  fsdp_tensor_retain(l);
  g->loss = l;
  if (fsdp_backward(l, NULL)) fail_msg("backward: %s", fsdp_error_msg());
}

static void test_ops_match_cpu(void **state) {
  (void)state;
  graph a, b;
  graph_init(&a, &fsdp_device_cpu);
  graph_init(&b, &cpu2_device);
  graph_run(&a);
  cpu2_reset();
  graph_run(&b);
  /* forward and backward on cpu2 moved nothing through the host */
  assert_int_equal(cpu2_transfers(), 0);
  assert_true(cpu2_counts.copy > 0); /* its own copies did run */
  assert_int_equal(a.nr, b.nr);
  assert_ptr_equal(b.loss->storage->device, &cpu2_device);
  assert_true(same_bits(a.loss, b.loss));
  for (int i = 0; i < a.nr; i++)
    if (!same_bits(a.r[i], b.r[i])) fail_msg("result %d differs between cpu and cpu2", i);
  for (int i = 0; i < NPARAM; i++) {
    assert_non_null(a.p[i]->grad);
    assert_ptr_equal(b.p[i]->grad->storage->device, &cpu2_device);
    if (!same_bits(a.p[i]->grad, b.p[i]->grad))
      fail_msg("gradient of parameter %d differs between cpu and cpu2", i);
  }
  /* the test can fail: a different input gives different bits */
  fsdp_tensor *other = rnd(&cpu2_device, FSDP_DTYPE_F32, 2, SHAPE(V, C), "not wte");
  assert_false(same_bits(a.p[0], other));
  fsdp_tensor_release(other);
  graph_free(&a);
  graph_free(&b);
  fsdp_tape_clear();
}

/* A first gradient that a kernel writes whole (a sum's addends: a copy of dout, into a buffer
 * never zero-filled) is zero-filled when that kernel fails: never left as the allocator made it.
 * cpu2's cast is made to fail for the backward. */
static int cast_refused(void *ctx, void *out, fsdp_dtype odt, const void *in, fsdp_dtype idt,
                        int64_t n) {
  (void)ctx, (void)out, (void)odt, (void)in, (void)idt, (void)n;
  return fsdp_error("cpu2: cast refused (test)");
}

static void test_first_gradient_failure(void **state) {
  (void)state;
  fsdp_tensor *a = rnd(&cpu2_device, FSDP_DTYPE_F32, 1, SHAPE(300), "a");
  fsdp_tensor *b = rnd(&cpu2_device, FSDP_DTYPE_F32, 1, SHAPE(300), "b"), *z = NULL, *s = NULL;
  a->requires_grad = b->requires_grad = true;
  assert_int_equal(fsdp_op_binary(&z, a, b, FSDP_OP_ADD), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&s, z), FSDP_OK);
  int (*cast)(void *, void *, fsdp_dtype, const void *, fsdp_dtype, int64_t) = cpu2_kernels.cast;
  cpu2_kernels.cast = cast_refused;
  int rc = fsdp_backward(s, NULL);
  cpu2_kernels.cast = cast;
  assert_int_equal(rc, FSDP_ERR);
  assert_msg_has("cast refused");
  assert_non_null(a->grad);
  const float *g = fsdp_tensor_data(a->grad, "test"); /* cpu2's memory is the host's */
  for (int i = 0; i < 300; i++) assert_true(g[i] == 0.0f);
  fsdp_tape_clear();
  fsdp_tensor *all[] = {a, b, z, s};
  for (int i = 0; i < 4; i++) fsdp_tensor_release(all[i]);
}

static void test_mixing_devices(void **state) {
  (void)state;
  fsdp_tensor *a = rnd(&fsdp_device_cpu, FSDP_DTYPE_F32, 1, SHAPE(4), "a");
  fsdp_tensor *b = rnd(&cpu2_device, FSDP_DTYPE_F32, 1, SHAPE(4), "b"), *o = NULL;
  assert_int_equal(fsdp_op_binary(&o, a, b, FSDP_OP_MUL), FSDP_ERR);
  assert_msg_has("tensors on different devices (cpu and cpu2)");
  assert_int_equal(fsdp_op_binary(&o, b, a, FSDP_OP_SUB), FSDP_ERR);
  assert_msg_has("(cpu2 and cpu)");
  /* fsdp_add_into moves the source to the destination's device on purpose */
  assert_int_equal(fsdp_add_into(b, a, 1.0), FSDP_OK);
  fsdp_tensor_release(a);
  fsdp_tensor_release(b);
}

/* ---- moves, copies and fills ------------------------------------------------------------- */

static void test_to_and_copy(void **state) {
  (void)state;
  fsdp_tensor *a = rnd(&fsdp_device_cpu, FSDP_DTYPE_F32, 2, SHAPE(3, 5), "a");
  /* cpu f32 -> cpu2 bf16 -> cpu f32 equals the conversion on the cpu */
  fsdp_tensor *b, *c, *ref_b, *ref;
  cpu2_reset();
  assert_int_equal(fsdp_to(&b, a, &cpu2_device, FSDP_DTYPE_BF16, -1), FSDP_OK);
  assert_true(cpu2_counts.from_host > 0);
  assert_ptr_equal(b->storage->device, &cpu2_device);
  assert_int_equal(b->dtype, FSDP_DTYPE_BF16);
  assert_int_equal(fsdp_to(&c, b, &fsdp_device_cpu, FSDP_DTYPE_F32, -1), FSDP_OK);
  assert_true(cpu2_counts.to_host > 0);
  assert_int_equal(fsdp_to(&ref_b, a, &fsdp_device_cpu, FSDP_DTYPE_BF16, -1), FSDP_OK);
  assert_int_equal(fsdp_to(&ref, ref_b, &fsdp_device_cpu, FSDP_DTYPE_F32, -1), FSDP_OK);
  assert_true(same_bits(c, ref));
  /* within cpu2 across dtypes (f64, i64), and back */
  fsdp_tensor *d64, *i64, *back;
  cpu2_reset();
  assert_int_equal(fsdp_to(&d64, b, &cpu2_device, FSDP_DTYPE_F64, -1), FSDP_OK);
  assert_int_equal(fsdp_to(&i64, d64, &cpu2_device, FSDP_DTYPE_I64, -1), FSDP_OK);
  assert_int_equal(fsdp_to(&back, d64, &cpu2_device, FSDP_DTYPE_BF16, -1), FSDP_OK);
  assert_int_equal(cpu2_transfers(), 0);
  /* a cast into a dense destination on the same device writes it directly: no scratch
   * buffer copied after the cast */
  assert_int_equal(cpu2_counts.copy, 0);
  assert_true(same_bits(back, b));
  /* ... and into a dense view of a larger tensor, leaving the rest alone */
  fsdp_tensor *big, *row, *row_ref;
  assert_int_equal(fsdp_tensor_new(&big, &cpu2_device, FSDP_DTYPE_F32, 2, SHAPE(5, 5),
                                   FSDP_ROLE_ACTIVATIONS), FSDP_OK);
  assert_int_equal(fsdp_tensor_narrow(&row, big, 0, 1, 3), FSDP_OK); /* rows 1..3: dense */
  assert_int_equal(fsdp_to(&row_ref, b, &cpu2_device, FSDP_DTYPE_F32, -1), FSDP_OK);
  int64_t v0 = row->version;
  cpu2_reset();
  assert_int_equal(fsdp_copy(row, b), FSDP_OK);
  assert_int_equal(cpu2_counts.copy, 0);
  assert_int_equal(row->version, v0 + 1);
  assert_true(same_bits(row, row_ref));
  const float *bd = fsdp_tensor_data(big, "test");
  for (int k = 0; k < 5; k++) assert_true(bd[k] == 0.0f && bd[20 + k] == 0.0f);
  /* the device's cast failing: the error reaches the caller, named as a copy's, and the
   * destination's version stays */
  int (*cast)(void *, void *, fsdp_dtype, const void *, fsdp_dtype, int64_t) = cpu2_kernels.cast;
  cpu2_kernels.cast = cast_refused;
  const int64_t v1 = row->version;
  int rc = fsdp_copy(row, b);
  cpu2_kernels.cast = cast;
  assert_int_equal(rc, FSDP_ERR);
  assert_msg_has("copy");
  assert_msg_has("cast refused");
  assert_int_equal(row->version, v1);
  fsdp_tensor_release(row_ref);
  fsdp_tensor_release(row);
  fsdp_tensor_release(big);
  /* a strided view on cpu2 to the cpu: its kernels make it dense first */
  fsdp_tensor *bt, *bt_host, *at, *at_dense;
  assert_int_equal(fsdp_tensor_transpose(&bt, c, 0, 1), FSDP_OK); /* cpu */
  fsdp_tensor *c2;
  assert_int_equal(fsdp_to(&c2, c, &cpu2_device, FSDP_DTYPE_F32, -1), FSDP_OK);
  assert_int_equal(fsdp_tensor_transpose(&at, c2, 0, 1), FSDP_OK); /* cpu2, strided */
  assert_int_equal(fsdp_to(&bt_host, at, &fsdp_device_cpu, FSDP_DTYPE_F32, -1), FSDP_OK);
  assert_int_equal(fsdp_tensor_contiguous(&at_dense, bt), FSDP_OK);
  assert_true(same_bits(bt_host, at_dense));
  /* core alone cannot copy strided on cpu2 (it must not read it); fsdp_copy can */
  fsdp_tensor *dst;
  assert_int_equal(fsdp_tensor_new(&dst, &cpu2_device, FSDP_DTYPE_F32, 2, SHAPE(5, 3),
                                   FSDP_ROLE_ACTIVATIONS), FSDP_OK);
  assert_int_equal(fsdp_tensor_copy(dst, at), FSDP_ERR);
  assert_msg_has("a strided copy on the cpu2 device needs its kernels");
  cpu2_reset();
  assert_int_equal(fsdp_copy(dst, at), FSDP_OK);
  assert_int_equal(cpu2_transfers(), 0);
  assert_true(same_bits(dst, at_dense));
  /* into a strided cpu2 destination from the cpu */
  fsdp_tensor *dt;
  assert_int_equal(fsdp_tensor_transpose(&dt, dst, 0, 1), FSDP_OK); /* (3, 5), strided */
  assert_int_equal(fsdp_copy(dt, a), FSDP_OK);
  assert_true(same_bits(dt, a));
  fsdp_tensor *h;
  cpu2_reset();
  assert_int_equal(fsdp_to_host(&h, dst), FSDP_OK);
  assert_ptr_equal(h->storage->device, &fsdp_device_cpu);
  assert_int_equal(cpu2_counts.to_host_bytes, 15 * 4);
  fsdp_tensor *ts[] = {b, c, ref_b, ref, d64, i64, back, bt, bt_host, at, at_dense, c2, dst, dt, h};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) fsdp_tensor_release(ts[i]);
  fsdp_tensor_release(a);
}

static void test_fill(void **state) {
  (void)state;
  fsdp_tensor *x, *ref, *xt, *rt;
  assert_int_equal(fsdp_tensor_new(&x, &cpu2_device, FSDP_DTYPE_BF16, 2, SHAPE(4, 6),
                                   FSDP_ROLE_ACTIVATIONS), FSDP_OK);
  assert_int_equal(fsdp_tensor_new(&ref, &fsdp_device_cpu, FSDP_DTYPE_BF16, 2, SHAPE(4, 6),
                                   FSDP_ROLE_ACTIVATIONS), FSDP_OK);
  /* the kernels fill cpu2: no host transfer; core's fill stages through from_host */
  cpu2_reset();
  assert_int_equal(fsdp_fill(x, 1.5), FSDP_OK);
  assert_int_equal(cpu2_transfers(), 0);
  assert_int_equal(fsdp_fill(ref, 1.5), FSDP_OK);
  assert_true(same_bits(x, ref));
  assert_int_equal(fsdp_tensor_fill(x, -2.25), FSDP_OK);
  assert_true(cpu2_counts.from_host > 0);
  assert_int_equal(fsdp_tensor_fill(ref, -2.25), FSDP_OK);
  assert_true(same_bits(x, ref));
  /* strided: core refuses on cpu2, fsdp_fill goes through a dense block and copy_strided */
  assert_int_equal(fsdp_tensor_narrow(&xt, x, 1, 1, 3), FSDP_OK);
  assert_int_equal(fsdp_tensor_narrow(&rt, ref, 1, 1, 3), FSDP_OK);
  assert_int_equal(fsdp_tensor_fill(xt, 7), FSDP_ERR);
  assert_msg_has("a strided fill on the cpu2 device needs its kernels");
  uint64_t v = x->version;
  cpu2_reset();
  assert_int_equal(fsdp_fill(xt, 7), FSDP_OK);
  assert_int_equal(cpu2_transfers(), 0);
  assert_true(xt->version > 0 && x->version == v); /* the view's version; storage untouched */
  assert_int_equal(fsdp_fill(rt, 7), FSDP_OK);
  assert_true(same_bits(x, ref));
  /* a device with data but no kernels: fsdp_fill says so (core's fill would still work) */
  static fsdp_device_i bare = {.name = "bare", .has_data = true, .alloc = cpu2_alloc,
                               .free = cpu2_free, .copy = cpu2_copy, .to_host = cpu2_to_host,
                               .from_host = cpu2_from_host};
  assert_int_equal(fsdp_device_register(&bare, NULL), FSDP_OK);
  fsdp_tensor *bt;
  assert_int_equal(fsdp_tensor_new(&bt, &bare, FSDP_DTYPE_F32, 1, SHAPE(3), FSDP_ROLE_OTHER),
                   FSDP_OK);
  assert_int_equal(fsdp_fill(bt, 1), FSDP_ERR);
  assert_msg_has("fill: no kernels on the bare device");
  fsdp_tensor_release(bt);
  /* meta: nothing to write */
  fsdp_tensor *m;
  assert_int_equal(fsdp_tensor_new(&m, &fsdp_device_meta, FSDP_DTYPE_F32, 1, SHAPE(3),
                                   FSDP_ROLE_ACTIVATIONS), FSDP_OK);
  assert_int_equal(fsdp_fill(m, 1), FSDP_OK);
  fsdp_tensor *ts[] = {x, ref, xt, rt, m};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) fsdp_tensor_release(ts[i]);
}

/* ---- collectives on device buffers -------------------------------------------------------- */

/* The local backend (and the world of one) move buffers of a device without host memory with
 * the device's copy and reduce them with its reduce_ranks, never by dereferencing them: every
 * collective on cpu2 buffers gives the bits of the same collective on host buffers, through
 * cpu2's copies and no host transfer. */
static bool run_coll(fsdp_comm *c, const fsdp_device_i *dev, fsdp_coll_op op, fsdp_dtype dt,
                     fsdp_reduce_op red, int64_t count, fsdp_tensor *send, fsdp_tensor *recv) {
  fsdp_coll k = {.op = op, .dtype = dt, .red = red, .root = fsdp_comm_world(c) - 1,
                 .count = count, .send = send ? fsdp_tensor_data(send, "test") : NULL,
                 .recv = fsdp_tensor_data(recv, "test"), .device = dev};
  snprintf(k.label, sizeof k.label, "%s", fsdp_coll_name(op));
  return fsdp_comm_run(c, &k) == FSDP_OK;
}

static bool rank_device_collectives(rank_ctx *ctx) {
  const int W = ctx->world, R = ctx->rank;
  const int64_t n = 37; /* no vector width divides it */
  const fsdp_dtype dts[] = {FSDP_DTYPE_F32, FSDP_DTYPE_BF16, FSDP_DTYPE_F64, FSDP_DTYPE_I64};
  for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++) {
    fsdp_dtype dt = dts[d];
    for (int op = FSDP_COLL_ALL_GATHER; op <= FSDP_COLL_BROADCAST; op++) {
      bool red = op == FSDP_COLL_REDUCE_SCATTER || op == FSDP_COLL_ALL_REDUCE;
      fsdp_reduce_op rop = dt == FSDP_DTYPE_I64 ? FSDP_RED_MAX : FSDP_RED_AVG;
      int64_t send_n = op == FSDP_COLL_REDUCE_SCATTER ? n * W : n;
      int64_t recv_n = op == FSDP_COLL_ALL_GATHER ? n * W : n;
      char name[32];
      snprintf(name, sizeof name, "coll.%d.%d.%d", (int)d, op, R);
      fsdp_tensor *hs = NULL, *ds = NULL, *hr, *dr;
      if (op == FSDP_COLL_ALL_GATHER || op == FSDP_COLL_REDUCE_SCATTER) {
        hs = rnd(&fsdp_device_cpu, FSDP_DTYPE_F32, 1, &send_n, name);
        fsdp_tensor *t;
        CHECK_OK(fsdp_to(&t, hs, &fsdp_device_cpu, dt, -1));
        fsdp_tensor_release(hs);
        hs = t;
        CHECK_OK(fsdp_to(&ds, hs, &cpu2_device, dt, -1));
      }
      hr = rnd(&fsdp_device_cpu, FSDP_DTYPE_F32, 1, &recv_n, name);
      fsdp_tensor *t;
      CHECK_OK(fsdp_to(&t, hr, &fsdp_device_cpu, dt, -1));
      fsdp_tensor_release(hr);
      hr = t;
      CHECK_OK(fsdp_to(&dr, hr, &cpu2_device, dt, -1));
      cpu2_reset();
      int64_t count = op == FSDP_COLL_REDUCE_SCATTER || op == FSDP_COLL_ALL_GATHER ? n : n;
      CHECK(run_coll(ctx->comm, &cpu2_device, (fsdp_coll_op)op, dt, rop, count, ds, dr));
      CHECK(cpu2_transfers() == 0);
      /* every rank copies or reduces something, except the root of a broadcast and a world
       * of one's in-place ops */
      bool moves = W > 1 && !(op == FSDP_COLL_BROADCAST && R == W - 1);
      if (moves && !red) CHECK(cpu2_counts.copy > 0);
      CHECK(run_coll(ctx->comm, NULL, (fsdp_coll_op)op, dt, rop, count, hs, hr));
      CHECK(same_bits(hr, dr));
      fsdp_tensor_release(hs);
      fsdp_tensor_release(ds);
      fsdp_tensor_release(hr);
      fsdp_tensor_release(dr);
    }
  }
  return true;
}

static void test_device_collectives(void **state) {
  (void)state;
  for (int W = 1; W <= 3; W++) run_ranks(W, rank_device_collectives, NULL);
}

/* A device whose copy fails mid-collective: every rank fails (the one whose copy failed with
 * its message, the others with it or with the poison it leaves), and the group stays poisoned. */
static int broken_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  (void)ctx, (void)dst, (void)src, (void)bytes;
  return fsdp_error("broken: the copy engine stopped");
}
static fsdp_device_i broken = {.name = "broken", .has_data = true, .alloc = cpu2_alloc,
                               .free = cpu2_free, .copy = broken_copy,
                               .to_host = cpu2_to_host, .from_host = cpu2_from_host};

static bool rank_broken_copy(rank_ctx *ctx) {
  float send[4] = {1, 2, 3, 4}, recv[8];
  fsdp_coll k = {.op = FSDP_COLL_ALL_GATHER, .dtype = FSDP_DTYPE_F32, .count = 4, .send = send,
                 .recv = recv, .device = &broken, .label = "g"};
  CHECK(fsdp_comm_run(ctx->comm, &k) == FSDP_ERR);
  CHECK(strstr(fsdp_error_msg(), "the copy engine stopped") != NULL);
  CHECK(fsdp_comm_barrier(ctx->comm, "after") == FSDP_ERR);
  CHECK(strstr(fsdp_error_msg(), "all_gather #1 'g': broken: the copy engine stopped") != NULL);
  return true;
}

static void test_device_collective_fails(void **state) {
  (void)state;
  static bool registered;
  if (!registered) assert_int_equal(fsdp_device_register(&broken, &fsdp_cpu_kernels), FSDP_OK);
  registered = true;
  run_ranks(2, rank_broken_copy, NULL);
}

/* A device without reduce_ranks cannot be reduced on (tests/c/test_comm.c: a backend that moves
 * host memory only refuses device buffers). */
static void test_device_collective_refusals(void **state) {
  (void)state;
  static fsdp_kernels_i noreduce;
  noreduce = fsdp_cpu_kernels;
  noreduce.reduce_ranks = NULL;
  static fsdp_device_i nored = {.name = "nored", .has_data = true, .alloc = cpu2_alloc,
                                .free = cpu2_free, .copy = cpu2_copy, .to_host = cpu2_to_host,
                                .from_host = cpu2_from_host};
  assert_int_equal(fsdp_device_register(&nored, &noreduce), FSDP_OK);
  fsdp_comm *c;
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
  float buf[4] = {1, 2, 3, 4};
  fsdp_coll k = {.op = FSDP_COLL_ALL_REDUCE, .dtype = FSDP_DTYPE_F32, .count = 4, .recv = buf,
                 .device = &nored, .label = "g"};
  assert_int_equal(fsdp_comm_run(c, &k), FSDP_ERR);
  assert_msg_has("all_reduce(f32 x4 sum, 'g') on nored: the nored device has no reduce_ranks "
                 "kernel");
  fsdp_comm_free(c); /* (the refusal poisoned it: the peers would have waited) */
  assert_int_equal(fsdp_comm_single_new(&c), FSDP_OK);
  k.op = FSDP_COLL_BROADCAST; /* no reduction: copies suffice */
  assert_int_equal(fsdp_comm_run(c, &k), FSDP_OK);
  fsdp_comm_free(c);
}

/* ---- FSDP units over cpu2 parameters ----------------------------------------------------- */

#define MAXW 2
#define STEPS 3
#define ROWS 8 /* the global batch, divisible by 1 and 2 */

/* One model trained on one device: fc1 (unit "fc1") -> gelu -> fc2 (root unit ""), mse. */
typedef struct {
  fsdp_tensor *p[4]; /* fc1.weight (6, 5), fc1.bias (6), fc2.weight (3, 6), fc2.bias (3) */
  fsdp_unit *inner, *root;
  float loss[STEPS];
  fsdp_tensor *shard[2]; /* the final shards (inner, root) on the host */
  long transfers;        /* cpu2 host transfers during forward, backward and the steps */
} trained;

static fsdp_tensor *param(const fsdp_device_i *dev, int ndim, const int64_t *shape,
                          const char *name) {
  fsdp_tensor *c = rnd(&fsdp_device_cpu, FSDP_DTYPE_F32, ndim, shape, name), *p;
  if (fsdp_to(&p, c, dev, FSDP_DTYPE_F32, FSDP_ROLE_PARAMS)) p = NULL;
  fsdp_tensor_release(c);
  if (p) p->requires_grad = p->is_param = true;
  return p;
}

/* rows [r * ROWS / W, (r + 1) * ROWS / W) of a (ROWS, cols) stream, on dev */
static fsdp_tensor *batch(const fsdp_device_i *dev, int64_t cols, const char *name, int r, int W) {
  fsdp_tensor *full = rnd(&fsdp_device_cpu, FSDP_DTYPE_F32, 2, SHAPE(ROWS, cols), name), *v, *t;
  int64_t a = r * ROWS / W, b = (r + 1) * ROWS / W;
  if (fsdp_tensor_narrow(&v, full, 0, a, b - a) || fsdp_to(&t, v, dev, FSDP_DTYPE_F32, -1))
    t = NULL;
  fsdp_tensor_release(v);
  fsdp_tensor_release(full);
  return t;
}

/* shard -= lr * grad shard through the device's sgd kernel, then zero_grad */
static bool step(fsdp_unit *u, bool count, long *transfers) {
  fsdp_tensor *s, *g;
  CHECK_OK(fsdp_unit_shard(u, &s));
  CHECK_OK(fsdp_unit_grad_shard(u, &g));
  const fsdp_kernels_i *k = fsdp_kernels_for(s, "test");
  CHECK(k);
  CHECK_OK(k->sgd_step(s->storage->device->ctx, FSDP_DTYPE_F32, fsdp_tensor_data(s, "test"), NULL,
                       fsdp_tensor_data(g, "test"), fsdp_tensor_numel(s), 0.1f, 0, 0.01f,
                       false));
  fsdp_tensor_written(s);
  fsdp_tensor_release(s);
  fsdp_tensor_release(g);
  if (count) *transfers += cpu2_transfers();
  CHECK_OK(fsdp_unit_zero_grad(u)); /* core's fill: through the host on cpu2 (not counted) */
  cpu2_reset();
  return true;
}

static bool train(rank_ctx *ctx, const fsdp_device_i *dev, trained *m, bool offload) {
  int W = ctx->world, R = ctx->rank;
  const char *names[4] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
  m->p[0] = param(dev, 2, SHAPE(6, 5), names[0]);
  m->p[1] = param(dev, 1, SHAPE(6), names[1]);
  m->p[2] = param(dev, 2, SHAPE(3, 6), names[2]);
  m->p[3] = param(dev, 1, SHAPE(3), names[3]);
  for (int i = 0; i < 4; i++) CHECK(m->p[i]);
  fsdp_unit_opts o = {.strategy = FSDP_STRATEGY_FULL, .reshard_after_forward = true,
                      .offload = offload};
  CHECK_OK(fsdp_unit_new(&m->inner, ctx->comm, "fc1", m->p, names, 2, &o));
  o.is_root = true;
  CHECK_OK(fsdp_unit_new(&m->root, ctx->comm, "", m->p + 2, names + 2, 2, &o));
  fsdp_unit_set_backward_prefetch(m->root, m->inner);
  fsdp_tensor *x = batch(dev, 5, "x", R, W), *y = batch(dev, 3, "y", R, W);
  CHECK(x && y);
  bool counting = dev == &cpu2_device && !offload; /* offload moves shards on purpose */
  cpu2_reset();
  for (int s = 0; s < STEPS; s++) {
    fsdp_tensor *h1, *h2, *out, *loss;
    CHECK_OK(fsdp_unit_pre_forward(m->root, m->inner));
    CHECK_OK(fsdp_unit_pre_forward(m->inner, NULL));
    CHECK_OK(fsdp_op_linear(&h1, x, m->p[0], m->p[1]));
    CHECK_OK(fsdp_op_unary(&h2, h1, FSDP_UNARY_GELU));
    CHECK_OK(fsdp_unit_post_forward(m->inner, true));
    CHECK_OK(fsdp_op_linear(&out, h2, m->p[2], m->p[3]));
    CHECK_OK(fsdp_unit_post_forward(m->root, true));
    CHECK_OK(fsdp_op_mse(&loss, out, y));
    fsdp_tensor_release(h1);
    fsdp_tensor_release(h2);
    fsdp_tensor_release(out);
    CHECK(loss->storage->device == dev);
    CHECK_OK(fsdp_backward(loss, NULL));
    /* the loss read back: the one transfer a step makes on purpose, not counted */
    long before = cpu2_transfers();
    fsdp_tensor *lh;
    CHECK_OK(fsdp_to_host(&lh, loss));
    m->loss[s] = *(float *)fsdp_tensor_data(lh, "test");
    fsdp_tensor_release(lh);
    fsdp_tensor_release(loss);
    if (counting) m->transfers += before;
    cpu2_reset();
    CHECK(step(m->inner, counting, &m->transfers) && step(m->root, counting, &m->transfers));
  }
  fsdp_tensor *shards[2];
  CHECK_OK(fsdp_unit_shard(m->inner, &shards[0]));
  CHECK_OK(fsdp_unit_shard(m->root, &shards[1]));
  for (int i = 0; i < 2; i++) {
    CHECK(shards[i]->storage->device == (offload ? &fsdp_device_cpu : dev));
    CHECK_OK(fsdp_to(&m->shard[i], shards[i], &fsdp_device_cpu, FSDP_DTYPE_F32, -1));
    fsdp_tensor_release(shards[i]);
  }
  fsdp_tensor_release(x);
  fsdp_tensor_release(y);
  return true;
}

static void trained_free(trained *m) {
  fsdp_unit_release(m->inner);
  fsdp_unit_release(m->root);
  for (int i = 0; i < 4; i++) fsdp_tensor_release(m->p[i]);
  for (int i = 0; i < 2; i++) fsdp_tensor_release(m->shard[i]);
}

static bool rank_units(rank_ctx *ctx) {
  trained a = {0}, b = {0}, c = {0};
  bool ok = train(ctx, &fsdp_device_cpu, &a, false) && train(ctx, &cpu2_device, &b, false) &&
            train(ctx, &cpu2_device, &c, true);
  if (ok) {
    /* gathers, reduce-scatters, gradient accumulation and the steps: no host transfer */
    if (b.transfers != 0) {
      char m[100];
      snprintf(m, sizeof m, "%ld host transfers on cpu2", b.transfers);
      ok = note_fail(__LINE__, m);
    }
    for (int s = 0; ok && s < STEPS; s++)
      if (memcmp(&a.loss[s], &b.loss[s], sizeof(float)) != 0) {
        char m[120];
        snprintf(m, sizeof m, "step %d: loss %.9g on cpu, %.9g on cpu2", s, (double)a.loss[s],
                 (double)b.loss[s]);
        ok = note_fail(__LINE__, m);
      }
    ok = ok && a.loss[STEPS - 1] < a.loss[0]; /* it trains */
    for (int i = 0; ok && i < 2; i++)
      if (!same_bits(a.shard[i], b.shard[i])) ok = note_fail(__LINE__, "shards differ");
    /* offload: shards and the steps on the host, compute on cpu2: the same bits */
    for (int s = 0; ok && s < STEPS; s++)
      if (memcmp(&a.loss[s], &c.loss[s], sizeof(float)) != 0)
        ok = note_fail(__LINE__, "offload: a loss differs");
    for (int i = 0; ok && i < 2; i++)
      if (!same_bits(a.shard[i], c.shard[i])) ok = note_fail(__LINE__, "offload: shards differ");
  }
  trained_free(&a);
  trained_free(&b);
  trained_free(&c);
  return ok;
}

static void test_units(void **state) {
  (void)state;
  for (int W = 1; W <= MAXW; W++) run_ranks(W, rank_units, NULL);
}

/* What a unit refuses to hold: parameters on two devices, on a device with data but no kernels,
 * and parameters that are not f32 (a unit keeps f32 masters). Nothing changes on refusal. */
static void test_unit_refusals(void **state) {
  (void)state;
  static fsdp_device_i nokernels = {.name = "nokernels", .has_data = true, .alloc = cpu2_alloc,
                                    .free = cpu2_free, .copy = cpu2_copy,
                                    .to_host = cpu2_to_host, .from_host = cpu2_from_host};
  assert_int_equal(fsdp_device_register(&nokernels, NULL), FSDP_OK);
  fsdp_comm *c = fsdp_comm_current();
  assert_non_null(c);
  fsdp_tensor *a, *b, *n, *h;
  assert_int_equal(fsdp_tensor_new(&a, &fsdp_device_cpu, FSDP_DTYPE_F32, 1, SHAPE(3),
                                   FSDP_ROLE_PARAMS), FSDP_OK);
  assert_int_equal(fsdp_tensor_new(&b, &cpu2_device, FSDP_DTYPE_F32, 1, SHAPE(4),
                                   FSDP_ROLE_PARAMS), FSDP_OK);
  assert_int_equal(fsdp_tensor_new(&n, &nokernels, FSDP_DTYPE_F32, 1, SHAPE(2),
                                   FSDP_ROLE_PARAMS), FSDP_OK);
  assert_int_equal(fsdp_tensor_new(&h, &fsdp_device_cpu, FSDP_DTYPE_BF16, 1, SHAPE(2),
                                   FSDP_ROLE_PARAMS), FSDP_OK);
  fsdp_unit *u = NULL;
  fsdp_tensor *two[] = {a, b};
  const char *names[] = {"a", "b"};
  assert_int_equal(fsdp_unit_new(&u, c, "m", two, names, 2, NULL), FSDP_ERR);
  assert_msg_has("wrap: unit 'm': parameters a (cpu) and b (cpu2) are on different devices; a "
                 "unit's parameters share one device");
  assert_int_equal(fsdp_unit_new(&u, c, "m", &n, names, 1, NULL), FSDP_ERR);
  assert_msg_has("wrap: unit 'm': parameter a is on the nokernels device; units take full "
                 "parameters (on a device with kernels, or meta)");
  assert_int_equal(fsdp_unit_new(&u, c, "m", &h, names, 1, NULL), FSDP_ERR);
  assert_msg_has("wrap: unit 'm': parameter a is bf16; units keep f32 masters (make it f32; the "
                 "wrap's mp option computes in bf16 or f16)");
  assert_null(u);
  fsdp_tensor *all[] = {a, b, n, h};
  for (int i = 0; i < 4; i++) {
    assert_null(all[i]->user); /* in no unit */
    assert_ptr_not_equal(all[i]->storage->device, &fsdp_device_sharded);
    fsdp_tensor_release(all[i]);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_registration),
      cmocka_unit_test(test_ops_match_cpu),
      cmocka_unit_test(test_first_gradient_failure),
      cmocka_unit_test(test_mixing_devices),
      cmocka_unit_test(test_to_and_copy),
      cmocka_unit_test(test_fill),
      cmocka_unit_test(test_device_collectives),
      cmocka_unit_test(test_device_collective_refusals),
      cmocka_unit_test(test_device_collective_fails),
      cmocka_unit_test(test_units),
      cmocka_unit_test(test_unit_refusals),
  };
  return cmocka_run_group_tests(tests, setup, NULL);
}
