/*
 * test_cuda_ops.c — every differentiable op of src/autograd (fsdp_op_*) forward and backward on
 * the device under test (cuda_test.h: cuda, or cpu2 for the harness) against the cpu.
 *
 * A case builds its inputs on the host from one stream, moves them to a device with fsdp_to
 * (float inputs become leaves that require a gradient), runs one op, and backpropagates
 * loss = sum(y * w) for a drawn w of y's shape. The output, any index output and every input's
 * gradient must agree with the cpu's within the dtype's tolerance (f32 1e-5, bf16 2e-2). Cases
 * run in f32 and in bf16; where the cpu computes a case in bf16 the device must too.
 *
 * Deterministic mode: every case twice on the device gives the same bits (outputs and
 * gradients). This is also the program scripts/gpu-check runs under compute-sanitizer
 * (memcheck, racecheck) with FSDP_CUDA_TEST_QUICK=1.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "autograd/autograd.h"
#include "cuda_test.h"

/* ---- inputs ------------------------------------------------------------------------------- */

typedef enum {
  I_SIGNED, /* floats in [-2, 2), in the case's dtype, requiring a gradient */
  I_POS,    /* floats in [0.5, 2) (log, sqrt, pow, div) */
  I_IDS,    /* i64 in [0, mod) */
  I_TARGETS,/* i64 in [0, mod), every seventh -1 (ignored) */
  I_BOOL,   /* bool 0/1 */
} ikind;

typedef struct {
  ikind kind;
  int ndim;
  int64_t shape[4];
  int64_t mod;
} ispec;

#define MAXIN 3
typedef int (*op_fn)(fsdp_tensor **o, fsdp_tensor **x);

typedef struct {
  const char *name;
  int nin;
  ispec in[MAXIN];
  op_fn fn;
  bool heavy; /* left out under FSDP_CUDA_TEST_QUICK */
} op_case;

static uint64_t rng_state;
static double urand(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (double)((rng_state * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0;
}

static int64_t numel_of(const ispec *s) {
  int64_t n = 1;
  for (int i = 0; i < s->ndim; i++) n *= s->shape[i];
  return n;
}

/* a host tensor of spec s drawn from the stream, in dt for floats */
static fsdp_tensor *host_input(const ispec *s, fsdp_dtype dt) {
  fsdp_dtype t = s->kind == I_IDS || s->kind == I_TARGETS ? FSDP_DTYPE_I64
                 : s->kind == I_BOOL                      ? FSDP_DTYPE_BOOL
                                                          : dt;
  fsdp_tensor *h;
  assert_int_equal(fsdp_tensor_new(&h, &fsdp_device_cpu, t, s->ndim, s->shape,
                                   FSDP_ROLE_ACTIVATIONS), FSDP_OK);
  void *p = fsdp_tensor_data(h, "test");
  int64_t n = numel_of(s);
  for (int64_t i = 0; i < n; i++) {
    double v;
    switch (s->kind) {
    case I_POS: v = (float)(0.5 + 1.5 * urand()); break;
    case I_IDS: v = (double)(int64_t)(urand() * (double)s->mod); break;
    case I_TARGETS: v = i % 7 == 3 ? -1 : (double)(int64_t)(urand() * (double)s->mod); break;
    case I_BOOL: v = urand() < 0.5; break;
    default: v = (float)(-2 + 4 * urand()); break;
    }
    fsdp_dtype_store(p, t, i, v);
  }
  return h;
}

/* ---- one run of a case on one device -------------------------------------------------------- */

typedef struct {
  fsdp_tensor *x[MAXIN]; /* the inputs, on the device */
  fsdp_tensor *y[2];     /* the op's outputs (y[1]: indices, when the op has them) */
  fsdp_tensor *read[2 + MAXIN]; /* host copies: y[0], y[1], then each float input's gradient */
  int nread;
} result;

static void result_free(result *r) {
  for (int i = 0; i < MAXIN; i++) fsdp_tensor_release(r->x[i]);
  for (int i = 0; i < 2; i++) fsdp_tensor_release(r->y[i]);
  for (int i = 0; i < r->nread; i++) fsdp_tensor_release(r->read[i]);
  memset(r, 0, sizeof *r);
}

static void read_back(result *r, fsdp_tensor *t) {
  fsdp_tensor *h = NULL;
  if (t && fsdp_to_host(&h, t)) fail_msg("reading back: %s", fsdp_error_msg());
  r->read[r->nread++] = h; /* NULL when there is nothing (no gradient) */
}

/* Runs case c in dtype dt on dev (inputs from the stream at `seed`). FSDP_OK, or the op's error
 * (its message in fsdp_error_msg) when the op refuses. */
static int run_case(result *r, const op_case *c, fsdp_dtype dt, const fsdp_device_i *dev,
                    uint64_t seed) {
  memset(r, 0, sizeof *r);
  rng_state = seed;
  for (int i = 0; i < c->nin; i++) {
    fsdp_tensor *h = host_input(&c->in[i], dt);
    if (fsdp_to(&r->x[i], h, dev, h->dtype, FSDP_ROLE_ACTIVATIONS))
      fail_msg("%s: moving input %d to %s: %s", c->name, i, dev->name, fsdp_error_msg());
    fsdp_tensor_release(h);
    if (fsdp_dtype_is_float(r->x[i]->dtype)) r->x[i]->requires_grad = true;
  }
  fsdp_rng_manual_seed(7); /* dropout's stream: the same mask on both devices */
  int rc = c->fn(r->y, r->x);
  if (rc) {
    fsdp_tape_clear();
    return rc;
  }
  fsdp_tensor *y = r->y[0];
  if (fsdp_dtype_is_float(y->dtype) && y->requires_grad) {
    ispec ws = {I_SIGNED, y->ndim, {0}, 0};
    memcpy(ws.shape, y->shape, sizeof(int64_t) * (size_t)y->ndim);
    fsdp_tensor *wh = host_input(&ws, y->dtype), *w, *p, *l;
    if (fsdp_to(&w, wh, y->storage->device, y->dtype, FSDP_ROLE_ACTIVATIONS))
      fail_msg("%s: %s", c->name, fsdp_error_msg());
    fsdp_tensor_release(wh);
    if (fsdp_op_binary(&p, y, w, FSDP_OP_MUL) || fsdp_op_sum(&l, p))
      fail_msg("%s: the loss on %s: %s", c->name, dev->name, fsdp_error_msg());
    if (fsdp_backward(l, NULL)) fail_msg("%s: backward on %s: %s", c->name, dev->name, fsdp_error_msg());
    fsdp_tensor_release(w);
    fsdp_tensor_release(p);
    fsdp_tensor_release(l);
  }
  fsdp_tape_clear();
  read_back(r, r->y[0]);
  read_back(r, r->y[1]);
  for (int i = 0; i < c->nin; i++)
    if (fsdp_dtype_is_float(r->x[i]->dtype)) read_back(r, r->x[i]->grad);
  return FSDP_OK;
}

static const char *what_of(int k) {
  static const char *names[] = {"output", "indices", "grad of input 1", "grad of input 2",
                                "grad of input 3"};
  return names[k];
}

/* ---- the ops ------------------------------------------------------------------------------------ */

#define OPF(name) static int name(fsdp_tensor **o, fsdp_tensor **x)
OPF(o_add) { return fsdp_op_binary(o, x[0], x[1], FSDP_OP_ADD); }
OPF(o_sub) { return fsdp_op_binary(o, x[0], x[1], FSDP_OP_SUB); }
OPF(o_mul) { return fsdp_op_binary(o, x[0], x[1], FSDP_OP_MUL); }
OPF(o_div) { return fsdp_op_binary(o, x[0], x[1], FSDP_OP_DIV); }
OPF(o_affine) { return fsdp_op_affine(o, x[0], -1.5f, 0.25f); }
OPF(o_relu) { return fsdp_op_unary(o, x[0], FSDP_UNARY_RELU); }
OPF(o_gelu) { return fsdp_op_unary(o, x[0], FSDP_UNARY_GELU); }
OPF(o_exp) { return fsdp_op_unary(o, x[0], FSDP_UNARY_EXP); }
OPF(o_log) { return fsdp_op_unary(o, x[0], FSDP_UNARY_LOG); }
OPF(o_sqrt) { return fsdp_op_unary(o, x[0], FSDP_UNARY_SQRT); }
OPF(o_tanh) { return fsdp_op_unary(o, x[0], FSDP_UNARY_TANH); }
OPF(o_sigmoid) { return fsdp_op_unary(o, x[0], FSDP_UNARY_SIGMOID); }
OPF(o_abs) { return fsdp_op_unary(o, x[0], FSDP_UNARY_ABS); }
OPF(o_sign) { return fsdp_op_unary(o, x[0], FSDP_UNARY_SIGN); }
OPF(o_pow) { return fsdp_op_pow(o, x[0], 1.5f); }
OPF(o_square) { return fsdp_op_pow(o, x[0], 2.0f); }
OPF(o_matmul) { return fsdp_op_matmul(o, x[0], x[1]); }
OPF(o_linear) { return fsdp_op_linear(o, x[0], x[1], x[2]); }
OPF(o_linear_nobias) { return fsdp_op_linear(o, x[0], x[1], NULL); }
OPF(o_embedding) { return fsdp_op_embedding(o, x[0], x[1]); }
OPF(o_layernorm) { return fsdp_op_layernorm(o, x[0], x[1], x[2], 1e-5f); }
OPF(o_softmax_last) { return fsdp_op_softmax(o, x[0], x[0]->ndim - 1); }
OPF(o_softmax_0) { return fsdp_op_softmax(o, x[0], 0); }
OPF(o_attention_2) { return fsdp_op_attention(o, x[0], 2); }
OPF(o_attention_12) { return fsdp_op_attention(o, x[0], 12); }
OPF(o_dropout) { return fsdp_op_dropout(o, x[0], 0.25f); }
OPF(o_cross_entropy) { return fsdp_op_cross_entropy(o, x[0], x[1], -1); }
OPF(o_mse) { return fsdp_op_mse(o, x[0], x[1]); }
OPF(o_sum) { return fsdp_op_sum(o, x[0]); }
OPF(o_mean) { return fsdp_op_mean(o, x[0]); }
OPF(o_sum_dim) { return fsdp_op_sum_dim(o, x[0], 1, false); }
OPF(o_mean_dim) { return fsdp_op_sum_dim(o, x[0], 0, true); }
OPF(o_where) { return fsdp_op_where(o, x[0], x[1], x[2]); }
OPF(o_clamp) { return fsdp_op_clamp(o, x[0], -0.5, 1.25); }
OPF(o_cat) { return fsdp_op_cat(o, x, 3, 1); }
OPF(o_stack) { return fsdp_op_stack(o, x, 2, 0); }
OPF(o_max) { return fsdp_op_extreme(&o[0], &o[1], x[0], 1, true, false); }
OPF(o_min) { return fsdp_op_extreme(&o[0], &o[1], x[0], 0, false, true); }
OPF(o_topk) { return fsdp_op_topk(&o[0], &o[1], x[0], 5, 1, true); }
OPF(o_sort) { return fsdp_op_topk(&o[0], &o[1], x[0], x[0]->shape[0], 0, false); }
OPF(o_compare) { return fsdp_op_compare(o, x[0], x[1], FSDP_CMP_GE); }
OPF(o_view) { return fsdp_op_view(o, x[0], 2, (const int64_t[]){-1, x[0]->shape[2]}); }
OPF(o_narrow) { return fsdp_op_narrow(o, x[0], 1, 3, 17); }
OPF(o_transpose) { /* transpose, then a strided copy on the device */
  fsdp_tensor *t;
  int rc = fsdp_op_transpose(&t, x[0], 0, 2);
  if (!rc) rc = fsdp_op_contiguous(o, t);
  fsdp_tensor_release(t);
  return rc;
}
OPF(o_to_dtype) { /* to the other float dtype and back: both conversions recorded */
  fsdp_tensor *t;
  fsdp_dtype other = x[0]->dtype == FSDP_DTYPE_F32 ? FSDP_DTYPE_BF16 : FSDP_DTYPE_F32;
  int rc = fsdp_op_to(&t, x[0], NULL, other);
  if (!rc) rc = fsdp_op_to(o, t, NULL, x[0]->dtype);
  fsdp_tensor_release(t);
  return rc;
}
OPF(o_via_cpu) { /* to the cpu, tanh there, and back to the input's device */
  fsdp_tensor *c, *t;
  const fsdp_device_i *dev = x[0]->storage->device;
  int rc = fsdp_op_to(&c, x[0], &fsdp_device_cpu, x[0]->dtype);
  if (rc) return rc;
  rc = fsdp_op_unary(&t, c, FSDP_UNARY_TANH);
  fsdp_tensor_release(c);
  if (!rc) rc = fsdp_op_to(o, t, dev, x[0]->dtype);
  fsdp_tensor_release(t);
  return rc;
}

#define S1(a) 1, {a}
#define S2(a, b) 2, {a, b}
#define S3(a, b, c) 3, {a, b, c}
#define F(shape) {I_SIGNED, shape, 0}
#define P(shape) {I_POS, shape, 0}

static const op_case cases[] = {
    {"add (broadcast)", 2, {F(S2(7, 33)), F(S1(33))}, o_add, false},
    {"sub", 2, {F(S2(7, 33)), F(S2(7, 33))}, o_sub, false},
    {"mul (broadcast)", 2, {F(S3(3, 5, 33)), F(S2(5, 33))}, o_mul, false},
    {"div (broadcast)", 2, {F(S2(7, 33)), P(S1(33))}, o_div, false},
    {"affine", 1, {F(S2(7, 33))}, o_affine, false},
    {"relu", 1, {F(S2(7, 33))}, o_relu, false},
    {"gelu", 1, {F(S2(7, 33))}, o_gelu, false},
    {"exp", 1, {F(S2(7, 33))}, o_exp, false},
    {"log", 1, {P(S2(7, 33))}, o_log, false},
    {"sqrt", 1, {P(S2(7, 33))}, o_sqrt, false},
    {"tanh", 1, {F(S2(7, 33))}, o_tanh, false},
    {"sigmoid", 1, {F(S2(7, 33))}, o_sigmoid, false},
    {"abs", 1, {F(S2(7, 33))}, o_abs, false},
    {"sign", 1, {F(S2(7, 33))}, o_sign, false},
    {"pow 1.5", 1, {P(S2(7, 33))}, o_pow, false},
    {"pow 2", 1, {F(S2(7, 33))}, o_square, false},
    {"matmul (2-d)", 2, {F(S2(37, 65)), F(S2(65, 29))}, o_matmul, false},
    {"matmul (batched)", 2, {F(S3(3, 17, 33)), F(S3(3, 33, 9))}, o_matmul, false},
    {"linear", 3, {F(S3(2, 13, 65)), F(S2(29, 65)), F(S1(29))}, o_linear, false},
    {"linear (no bias)", 2, {F(S2(26, 65)), F(S2(29, 65))}, o_linear_nobias, false},
    {"embedding", 2, {{I_IDS, S2(3, 17), 50}, F(S2(50, 33))}, o_embedding, false},
    {"layernorm", 3, {F(S3(5, 7, 129)), P(S1(129)), F(S1(129))}, o_layernorm, false},
    {"layernorm (d 768)", 3, {F(S2(64, 768)), P(S1(768)), F(S1(768))}, o_layernorm, false},
    {"softmax (last dim)", 1, {F(S2(9, 101))}, o_softmax_last, false},
    {"softmax (dim 1 of 2)", 1, {F(S2(9, 101))}, o_softmax_0, false},
    {"attention (T 65, 2 heads of 64)", 1, {F(S3(2, 65, 3 * 128))}, o_attention_2, false},
    {"attention (T 256, 12 heads of 64)", 1, {F(S3(1, 256, 3 * 768))}, o_attention_12, false},
    {"attention (T 1024, 2 heads of 128)", 1, {F(S3(1, 1024, 3 * 256))}, o_attention_2, true},
    {"dropout", 1, {F(S2(7, 333))}, o_dropout, false},
    {"cross_entropy (ignore -1)", 2, {F(S3(2, 9, 101)), {I_TARGETS, S2(2, 9), 101}},
     o_cross_entropy, false},
    {"cross_entropy (vocab 50304)", 2, {F(S2(16, 50304)), {I_TARGETS, S1(16), 50304}},
     o_cross_entropy, false},
    {"mse", 2, {F(S2(7, 33)), F(S2(7, 33))}, o_mse, false},
    {"sum", 1, {F(S2(70, 333))}, o_sum, false},
    {"mean", 1, {F(S2(70, 333))}, o_mean, false},
    {"sum over dim 2 of 3", 1, {F(S3(5, 201, 7))}, o_sum_dim, false},
    {"mean over dim 1 of 2", 1, {F(S2(301, 9))}, o_mean_dim, false},
    {"where", 3, {{I_BOOL, S2(7, 33), 0}, F(S2(7, 33)), F(S2(7, 33))}, o_where, false},
    {"clamp", 1, {F(S2(7, 33))}, o_clamp, false},
    {"cat (dim 2 of 2)", 3, {F(S2(7, 5)), F(S2(7, 33)), F(S2(7, 1))}, o_cat, false},
    {"stack", 2, {F(S2(7, 33)), F(S2(7, 33))}, o_stack, false},
    {"max over dim 2", 1, {F(S3(4, 301, 3))}, o_max, false},
    {"min over dim 1 (keepdim)", 1, {F(S2(301, 5))}, o_min, false},
    {"topk 5 over dim 2", 1, {F(S3(4, 301, 3))}, o_topk, false},
    {"sort over dim 1", 1, {F(S2(257, 3))}, o_sort, false},
    {"compare (ge, broadcast)", 2, {F(S2(7, 33)), F(S1(33))}, o_compare, false},
    {"view", 1, {F(S3(3, 5, 33))}, o_view, false},
    {"narrow", 1, {F(S3(3, 25, 7))}, o_narrow, false},
    {"transpose + contiguous", 1, {F(S3(3, 5, 33))}, o_transpose, false},
    {"to the other dtype and back", 1, {F(S2(7, 33))}, o_to_dtype, false},
    {"to the cpu and back", 1, {F(S2(7, 33))}, o_via_cpu, false},
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

/* ---- against the cpu --------------------------------------------------------------------------- */

static char why[1024];

/* 0: agree; 1: differ (why says how); -1: the cpu refuses (skipped) */
static int check_case(const op_case *c, fsdp_dtype dt, uint64_t seed) {
  result ref, got;
  fsdp_error_clear();
  if (run_case(&ref, c, dt, &fsdp_device_cpu, seed)) {
    snprintf(why, sizeof why, "the cpu refuses: %.300s", fsdp_error_msg());
    result_free(&ref);
    return -1;
  }
  int bad = 0;
  if (run_case(&got, c, dt, ct_dev, seed)) {
    snprintf(why, sizeof why, "%s, %s: works on the cpu, fails on %s: %.300s", c->name,
             fsdp_dtype_name(dt), ct_dev->name, fsdp_error_msg());
    bad = 1;
  } else {
    assert_int_equal(ref.nread, got.nread);
    for (int k = 0; k < ref.nread && !bad; k++) {
      fsdp_tensor *a = got.read[k], *b = ref.read[k];
      char what[256];
      snprintf(what, sizeof what, "%s, %s, %s", c->name, fsdp_dtype_name(dt), what_of(k));
      if (!a != !b || (a && (a->dtype != b->dtype || !fsdp_tensor_same_shape(a, b)))) {
        snprintf(why, sizeof why, "%s: present, dtype or shape differ from the cpu's", what);
        bad = 1;
      } else if (a && ct_compare(what, ct_dev->name, a->dtype, fsdp_tensor_data(a, "test"),
                                 fsdp_tensor_data(b, "test"), fsdp_tensor_numel(a), why,
                                 sizeof why)) {
        bad = 1;
      }
    }
    /* a gradient must have arrived where the output is differentiable */
    if (!bad && ref.y[0]->requires_grad)
      for (int i = 0; i < c->nin; i++)
        if (fsdp_dtype_is_float(ref.x[i]->dtype) && !ref.x[i]->grad) {
          snprintf(why, sizeof why, "%s: no gradient reached input %d on the cpu", c->name, i + 1);
          bad = 1;
        }
  }
  result_free(&ref);
  result_free(&got);
  return bad;
}

static void test_ops_match_cpu(void **state) {
  (void)state;
  int failed = 0, ran = 0;
  char first[sizeof why] = "";
  ct_compared = 0;
  for (int i = 0; i < NCASES; i++) {
    if (cases[i].heavy && ct_quick()) continue;
    for (int d = 0; d < 2; d++) {
      fsdp_dtype dt = d ? FSDP_DTYPE_BF16 : FSDP_DTYPE_F32;
      int v = check_case(&cases[i], dt, 0x5eed0000u + (uint64_t)i);
      printf("  %-36s %-4s %s\n", cases[i].name, fsdp_dtype_name(dt),
             v < 0 ? "- (the cpu refuses)" : v ? "FAIL" : "ok");
      fflush(stdout);
      if (v > 0) {
        if (!failed++) snprintf(first, sizeof first, "%s", why);
        fprintf(stderr, "  %s\n", why);
      }
      ran += v == 0;
    }
  }
  printf("  %d (op, dtype) cases agree, %ld elements compared\n", ran, ct_compared);
  if (failed) fail_msg("%d (op, dtype) cases differ from the cpu; the first: %s", failed, first);
  assert_true(ran >= NCASES); /* f32 everywhere, and bf16 mostly */
}

/* Deterministic mode: each case twice on the device, the same bits. */
static void test_deterministic(void **state) {
  (void)state;
  bool prev = fsdp_kernels_set_deterministic(true);
  int failed = 0, compared = 0;
  for (int i = 0; i < NCASES; i++) {
    if (cases[i].heavy && ct_quick()) continue;
    for (int d = 0; d < 2; d++) {
      fsdp_dtype dt = d ? FSDP_DTYPE_BF16 : FSDP_DTYPE_F32;
      result a, b;
      uint64_t seed = 0xd00d0000u + (uint64_t)i;
      int ra = run_case(&a, &cases[i], dt, ct_dev, seed);
      int rb = ra ? ra : run_case(&b, &cases[i], dt, ct_dev, seed);
      if (ra || rb) { /* refusals are test_ops_match_cpu's business */
        result_free(&a);
        if (!ra) result_free(&b);
        continue;
      }
      for (int k = 0; k < a.nread; k++) {
        fsdp_tensor *x = a.read[k], *y = b.read[k];
        if (!x) continue;
        compared++;
        if (!y || !ct_same_bits(fsdp_tensor_data(x, "test"), fsdp_tensor_data(y, "test"),
                                x->dtype, fsdp_tensor_numel(x))) {
          fprintf(stderr, "  %s, %s, %s: two runs differ in deterministic mode\n", cases[i].name,
                  fsdp_dtype_name(dt), what_of(k));
          failed++;
        }
      }
      result_free(&a);
      result_free(&b);
    }
  }
  fsdp_kernels_set_deterministic(prev);
  printf("  %d results compared bit for bit between two runs\n", compared);
  if (failed) fail_msg("%d results differ between two runs in deterministic mode", failed);
  assert_true(compared > 2 * NCASES);
}

/* The comparison can fail: the same case from another stream differs (checked on the cpu alone,
 * so it runs on every machine). */
static void test_checker_catches(void **state) {
  (void)state;
  result a, b;
  assert_int_equal(run_case(&a, &cases[0], FSDP_DTYPE_F32, &fsdp_device_cpu, 1), FSDP_OK);
  assert_int_equal(run_case(&b, &cases[0], FSDP_DTYPE_F32, &fsdp_device_cpu, 2), FSDP_OK);
  char w[512];
  assert_true(ct_compare("t", "cpu", FSDP_DTYPE_F32, fsdp_tensor_data(a.read[0], "test"),
                         fsdp_tensor_data(b.read[0], "test"), fsdp_tensor_numel(a.read[0]), w,
                         sizeof w) > 0);
  assert_non_null(strstr(w, "t: ["));
  /* both inputs of add got a gradient, read back */
  assert_non_null(a.read[2]);
  assert_non_null(a.read[3]);
  result_free(&a);
  result_free(&b);
}

int main(void) {
  fsdp_kernels_init();
  const struct CMUnitTest self[] = {cmocka_unit_test(test_checker_catches)};
  int rc = cmocka_run_group_tests_name("checker", self, NULL, NULL);
  if (rc) return rc;
  rc = ct_pick_device();
  if (rc) return rc;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ops_match_cpu),
      cmocka_unit_test(test_deterministic),
  };
  return cmocka_run_group_tests_name("cuda ops", tests, NULL, NULL);
}
