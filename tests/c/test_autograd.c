/*
 * test_autograd.c — the autograd layer (src/autograd): every differentiable op's gradient
 * against central finite differences, the tape's bookkeeping (accumulation, freeing, no_grad,
 * hooks, memory), and every op's error paths.
 *
 * Gradient checks: for an op out = f(in...), the autograd gradient of L = sum(out * R) (R a
 * fixed random tensor, passed to fsdp_backward as the seed gradient) w.r.t. each input is
 * compared with (L(x + eps) - L(x - eps)) / 2 eps, with L summed in double from the forward.
 * The error reported is max_i |autograd_i - fd_i| / max_i |fd_i| (the gradient's own scale,
 * so entries near zero do not blow it up); a deliberately wrong backward is checked to fail
 * the same test (test_gradcheck_catches_wrong_backward), and so is a NaN gradient. Ops whose
 * kernels have f64 (binary, affine, unary, pow, reductions, views, where, clamp, cat,
 * selection) are checked in f64 too, with steps of 1e-5 and a tolerance of 1e-8, which an
 * f32-rounded constant in a backward fails; the others (matmul, linear, layernorm, softmax,
 * attention, losses, ...) in f32 only. Ops are also checked on strided inputs and size-1
 * dimensions, and those whose backward writes a first gradient rather than adding to it
 * (linear, bias_gelu, attention, view) with an input that already holds one. The selection ops
 * (where, clamp, cat, stack, max/min, topk, sort) use inputs a step cannot reorder or push
 * across a bound; `to` is checked across dtypes and across two devices ("cpu2" below: the cpu
 * under another name), which the device-mismatch errors use too.
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
#include "kernels/cpu/gemm.h"

/* ---- helpers ---------------------------------------------------------------------------- */

static uint64_t lcg_state = 88172645463325252ull;
static void rng_reset(uint64_t s) { lcg_state = s ? s : 1; }
static double urand(void) { /* xorshift64*: uniform in [0, 1) */
  lcg_state ^= lcg_state >> 12;
  lcg_state ^= lcg_state << 25;
  lcg_state ^= lcg_state >> 27;
  return (double)((lcg_state * 2685821657736338717ull) >> 11) / 9007199254740992.0;
}

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define NDIM(...) ((int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))

static fsdp_tensor *mk(int ndim, const int64_t *shape) {
  fsdp_tensor *t;
  assert_int_equal(fsdp_tensor_new_f32(&t, ndim, shape), FSDP_OK);
  return t;
}

/* uniform in [lo, hi) */
static fsdp_tensor *rnd(int ndim, const int64_t *shape, double lo, double hi) {
  fsdp_tensor *t = mk(ndim, shape);
  float *d = fsdp_tensor_data(t, "test");
  for (int64_t i = 0; i < fsdp_tensor_numel(t); i++) d[i] = (float)(lo + (hi - lo) * urand());
  return t;
}

/* magnitude in [lo, hi), random sign: keeps values away from kinks and poles */
static fsdp_tensor *rnd_away(int ndim, const int64_t *shape, double lo, double hi) {
  fsdp_tensor *t = rnd(ndim, shape, lo, hi);
  float *d = fsdp_tensor_data(t, "test");
  for (int64_t i = 0; i < fsdp_tensor_numel(t); i++)
    if (urand() < 0.5) d[i] = -d[i];
  return t;
}

static fsdp_tensor *from(int ndim, const int64_t *shape, const float *v) {
  fsdp_tensor *t = mk(ndim, shape);
  memcpy(fsdp_tensor_data(t, "test"), v, sizeof(float) * (size_t)fsdp_tensor_numel(t));
  return t;
}

static fsdp_tensor *meta(int ndim, const int64_t *shape) {
  fsdp_tensor *t;
  assert_int_equal(fsdp_tensor_new(&t, &fsdp_device_meta, FSDP_DTYPE_F32, ndim, shape,
                                   FSDP_ROLE_ACTIVATIONS),
                   FSDP_OK);
  return t;
}

/* A transposed (non-contiguous) view of a fresh random tensor of shape (..., b, a), so the
 * view has shape (..., a, b). The view holds the only reference to its storage. */
static fsdp_tensor *rnd_transposed(int ndim, const int64_t *shape, double lo, double hi) {
  int64_t s[FSDP_MAX_DIMS];
  memcpy(s, shape, sizeof(int64_t) * (size_t)ndim);
  s[ndim - 1] = shape[ndim - 2];
  s[ndim - 2] = shape[ndim - 1];
  fsdp_tensor *base = rnd(ndim, s, lo, hi), *v;
  assert_int_equal(fsdp_tensor_transpose(&v, base, ndim - 2, ndim - 1), FSDP_OK);
  fsdp_tensor_release(base);
  assert_false(fsdp_tensor_is_contiguous(v));
  return v;
}

/* Offset in elements of element i (row-major logical order) of any strided view. */
static int64_t elem_off(const fsdp_tensor *t, int64_t i) {
  int64_t off = 0;
  for (int k = t->ndim - 1; k >= 0; k--) {
    off += (i % t->shape[k]) * t->strides[k];
    i /= t->shape[k];
  }
  return off;
}

/* Pointer to element i of an f32 view. */
static float *elem(fsdp_tensor *t, int64_t i) {
  assert_int_equal(t->dtype, FSDP_DTYPE_F32);
  return (float *)fsdp_tensor_data(t, "test") + elem_off(t, i);
}

/* Element i of an f32 or f64 view as a double, and its store (rounded to the dtype) */
static double getv(fsdp_tensor *t, int64_t i) {
  if (t->dtype == FSDP_DTYPE_F64) return ((double *)fsdp_tensor_data(t, "test"))[elem_off(t, i)];
  return *elem(t, i);
}
static void setv(fsdp_tensor *t, int64_t i, double v) {
  if (t->dtype == FSDP_DTYPE_F64) ((double *)fsdp_tensor_data(t, "test"))[elem_off(t, i)] = v;
  else *elem(t, i) = (float)v;
}

/* Logical-order contents of t as a malloc'd double array. */
static double *values(fsdp_tensor *t) {
  int64_t n = fsdp_tensor_numel(t);
  double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++) v[i] = getv(t, i);
  return v;
}

/* t (an f32 tensor or view, consumed) in another dtype with the same layout: the whole storage
 * converted, then the same view over it, so a transposed or narrowed input stays one. */
static fsdp_tensor *as_dtype(fsdp_tensor *t, fsdp_dtype dt) {
  assert_int_equal(t->dtype, FSDP_DTYPE_F32);
  int64_t n = (int64_t)(t->storage->bytes / sizeof(float));
  fsdp_tensor *base, *v;
  assert_int_equal(fsdp_tensor_new(&base, &fsdp_device_cpu, dt, 1, &n, FSDP_ROLE_ACTIVATIONS),
                   FSDP_OK);
  const float *src = t->storage->data;
  void *d = fsdp_tensor_data(base, "test");
  for (int64_t i = 0; i < n; i++) {
    if (dt == FSDP_DTYPE_F64) ((double *)d)[i] = src[i];
    else if (dt == FSDP_DTYPE_I64) ((int64_t *)d)[i] = (int64_t)src[i];
    else fail_msg("as_dtype: %s", fsdp_dtype_name(dt));
  }
  assert_int_equal(fsdp_tensor_new_view(&v, base, t->offset, t->ndim, t->shape, t->strides),
                   FSDP_OK);
  fsdp_tensor_release(base);
  fsdp_tensor_release(t);
  return v;
}
static fsdp_tensor *f64(fsdp_tensor *t) { return as_dtype(t, FSDP_DTYPE_F64); }
static fsdp_tensor *i64(fsdp_tensor *t) { return as_dtype(t, FSDP_DTYPE_I64); }

/* live bytes of a memory domain, all devices and roles */
static int64_t domain_live(fsdp_mem_domain *d) {
  fsdp_mem_report r;
  fsdp_mem_report_get(d, &r);
  int64_t live = 0;
  for (int i = 0; i < r.ndevices; i++) live += r.counts[i].live_total;
  return live;
}

static int64_t live_bytes(fsdp_role role) {
  fsdp_mem_report r;
  fsdp_mem_report_get(NULL, &r);
  return r.counts[0].live[role];
}

/* rc must be FSDP_ERR and the message must contain every given substring. */
static void expect_err_(int rc, const char *file, int line, ...) {
  const char *msg = fsdp_error_msg();
  if (rc != FSDP_ERR) {
    fprintf(stderr, "%s:%d: expected FSDP_ERR, got %d\n", file, line, rc);
    fail();
  }
  va_list ap;
  va_start(ap, line);
  for (const char *s; (s = va_arg(ap, const char *));) {
    if (!strstr(msg, s)) {
      fprintf(stderr, "%s:%d: error message \"%s\" lacks \"%s\"\n", file, line, msg, s);
      va_end(ap);
      fail();
    }
  }
  va_end(ap);
}
#define EXPECT_ERR(rc, ...) expect_err_((rc), __FILE__, __LINE__, __VA_ARGS__, (const char *)NULL)

/* ---- the gradient checker ---------------------------------------------------------------- */

/* gc_case literals below leave the optional trailing fields (eps, tol) to their defaults */
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

typedef int (*fwd_fn)(fsdp_tensor **out, fsdp_tensor **in, const void *ctx);

typedef struct {
  const char *name;
  fwd_fn f;
  const void *ctx;
  int nin;
  fsdp_tensor *in[4];
  unsigned wrt;   /* bit k: check the gradient w.r.t. in[k] */
  double eps;     /* 0: 1e-2, or 1e-5 when every checked input is f64 */
  double tol;     /* 0: 2e-3, or 1e-8 when every checked input is f64 */
} gc_case;

static double loss_value(fsdp_tensor *out, const double *R) {
  double L = 0;
  for (int64_t i = 0; i < fsdp_tensor_numel(out); i++) L += getv(out, i) * R[i];
  return L;
}

/* Every checked input is f64: steps of 1e-5 and a tolerance of 1e-8 (f32: 1e-2 and 2e-3) */
static bool checks_f64(const gc_case *c) {
  for (int k = 0; k < c->nin; k++)
    if ((c->wrt & (1u << k)) && c->in[k]->dtype != FSDP_DTYPE_F64) return false;
  return true;
}

/* Runs the check; returns the worst error over the checked inputs (and prints each). The
 * inputs keep their values; their requires_grad and grad are reset afterwards. */
static double gradcheck_measure(gc_case *c) {
  double eps = c->eps > 0 ? c->eps : checks_f64(c) ? 1e-5 : 1e-2, worst = 0;
  fsdp_tape_clear();
  bool prev = fsdp_set_grad_enabled(true);
  for (int k = 0; k < c->nin; k++) {
    if (!c->in[k]) continue;
    c->in[k]->requires_grad = false;
    fsdp_tensor_set_grad(c->in[k], NULL);
  }
  for (int k = 0; k < c->nin; k++)
    if (c->wrt & (1u << k)) c->in[k]->requires_grad = true;

  fsdp_tensor *out = NULL;
  if (c->f(&out, c->in, c->ctx)) {
    fprintf(stderr, "%s: forward failed: %s\n", c->name, fsdp_error_msg());
    fail();
  }
  assert_true(out->requires_grad);
  assert_false(out->is_leaf);
  int64_t n = fsdp_tensor_numel(out);
  fsdp_tensor *R = rnd(out->ndim, out->shape, -1, 1);
  if (out->dtype == FSDP_DTYPE_F64) R = f64(R);
  double *Rv = values(R);
  if (fsdp_backward(out, R)) {
    fprintf(stderr, "%s: backward failed: %s\n", c->name, fsdp_error_msg());
    fail();
  }
  assert_int_equal(fsdp_tape_size(), 0);
  assert_null(out->grad); /* a non-leaf's gradient is freed once used */
  fsdp_tensor_release(out);
  fsdp_tensor_release(R);

  fsdp_set_grad_enabled(false);
  for (int k = 0; k < c->nin; k++) {
    if (!(c->wrt & (1u << k))) continue;
    fsdp_tensor *x = c->in[k];
    if (!x->grad) {
      fprintf(stderr, "%s: input %d got no gradient\n", c->name, k);
      fail();
    }
    assert_true(fsdp_tensor_same_shape(x->grad, x));
    assert_true(fsdp_tensor_is_contiguous(x->grad));
    double *ag = values(x->grad);
    int64_t m = fsdp_tensor_numel(x);
    double maxdiff = 0, maxfd = 0, maxrel = 0;
    bool nan = false; /* a NaN on either side fails the check (comparisons would skip it) */
    for (int64_t i = 0; i < m; i++) {
      double v = getv(x, i), L[2], at[2];
      for (int s = 0; s < 2; s++) {
        setv(x, i, v + (s ? -eps : eps));
        at[s] = getv(x, i); /* the step actually taken, in x's dtype */
        fsdp_tensor *o;
        if (c->f(&o, c->in, c->ctx)) {
          fprintf(stderr, "%s: forward failed: %s\n", c->name, fsdp_error_msg());
          fail();
        }
        assert_int_equal(fsdp_tensor_numel(o), n);
        L[s] = loss_value(o, Rv);
        fsdp_tensor_release(o);
      }
      setv(x, i, v);
      double fd = (L[0] - L[1]) / (at[0] - at[1]);
      double d = fabs(ag[i] - fd);
      if (d != d) {
        fprintf(stderr, "%s: d/in%d[%lld]: autograd %g, finite differences %g\n", c->name, k,
                (long long)i, ag[i], fd);
        nan = true;
      }
      if (d > maxdiff) maxdiff = d;
      if (fabs(fd) > maxfd) maxfd = fabs(fd);
      double rel = d / fmax(fabs(fd), 1e-3);
      if (rel > maxrel) maxrel = rel;
    }
    double err = nan ? NAN : maxdiff / fmax(maxfd, 1e-6);
    printf("  gradcheck %-34s d/in%d: max err %.2e (scaled), max elementwise rel %.2e, "
           "max |g| %.2e\n",
           c->name, k, err, maxrel, maxfd);
    if (err != err || err > worst) worst = err; /* a NaN sticks */
    free(ag);
  }
  assert_int_equal(fsdp_tape_size(), 0); /* nothing recorded under no_grad */
  free(Rv);
  for (int k = 0; k < c->nin; k++) {
    if (!c->in[k]) continue;
    c->in[k]->requires_grad = false;
    fsdp_tensor_set_grad(c->in[k], NULL);
  }
  fsdp_set_grad_enabled(prev);
  return worst;
}

static void gradcheck(gc_case c) {
  double tol = c.tol > 0 ? c.tol : checks_f64(&c) ? 1e-8 : 2e-3;
  double err = gradcheck_measure(&c);
  if (!(err <= tol)) {
    fprintf(stderr, "%s: gradient error %.3e exceeds %.1e\n", c.name, err, tol);
    fail();
  }
  for (int k = 0; k < c.nin; k++) {
    bool dup = false;
    for (int j = 0; j < k; j++) dup |= c.in[j] == c.in[k];
    if (!dup) fsdp_tensor_release(c.in[k]);
  }
}

/* ---- forward functions (ctx carries the op's scalar arguments) ----------------------------- */

static int f_binary(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_binary(o, in[0], in[1], *(const fsdp_binary_op *)ctx);
}
static int f_affine(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  const float *st = ctx;
  return fsdp_op_affine(o, in[0], st[0], st[1]);
}
static int f_unary(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_unary(o, in[0], *(const fsdp_unary_op *)ctx);
}
static int f_pow(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_pow(o, in[0], *(const float *)ctx);
}
static int f_matmul(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_matmul(o, in[0], in[1]);
}
static int f_linear(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_linear(o, in[0], in[1], in[2]);
}
static int f_embedding(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_embedding(o, in[0], in[1]);
}
static int f_layernorm(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_layernorm(o, in[0], in[1], in[2], 1e-5f);
}
static int f_softmax(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_softmax(o, in[0], in[0]->ndim - 1);
}
static int f_attention(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_attention(o, in[0], *(const int *)ctx);
}
static int f_dropout(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  fsdp_rng_manual_seed(1234); /* the same mask on every call */
  return fsdp_op_dropout(o, in[0], *(const float *)ctx);
}
static int f_cross_entropy(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_cross_entropy(o, in[0], in[1], *(const int *)ctx);
}
static int f_mse(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_mse(o, in[0], in[1]);
}
/* mse(a, 2a + 0.5): both of mse's gradients flow into the one input */
static int f_mse_shifted(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  fsdp_tensor *b;
  if (fsdp_op_affine(&b, in[0], 2.0f, 0.5f)) return FSDP_ERR;
  int rc = fsdp_op_mse(o, in[0], b);
  fsdp_tensor_release(b);
  return rc;
}
static int f_sum(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_sum(o, in[0]);
}
static int f_mean(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_mean(o, in[0]);
}
typedef struct {
  int dim;
  bool mean;
} sum_dim_ctx;
static int f_sum_dim(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  const sum_dim_ctx *c = ctx;
  return fsdp_op_sum_dim(o, in[0], c->dim, c->mean);
}
typedef struct {
  int ndim;
  int64_t shape[FSDP_MAX_DIMS];
} view_ctx;
static int f_view(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  const view_ctx *c = ctx;
  return fsdp_op_view(o, in[0], c->ndim, c->shape);
}
static int f_transpose(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  const int *d = ctx;
  return fsdp_op_transpose(o, in[0], d[0], d[1]);
}
static int f_narrow(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  const int64_t *a = ctx; /* dim, start, len */
  return fsdp_op_narrow(o, in[0], (int)a[0], a[1], a[2]);
}
static int f_contiguous(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_contiguous(o, in[0]);
}
/* a composite: narrow -> transpose -> view -> matmul -> gelu -> sum_dim */
static int f_composite(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  fsdp_tensor *a = NULL, *b = NULL, *c = NULL, *d = NULL, *e = NULL;
  int rc = fsdp_op_narrow(&a, in[0], 1, 1, 4) || fsdp_op_transpose(&b, a, 0, 1) ||
           fsdp_op_view(&c, b, 2, SHAPE(2, 6)) || fsdp_op_matmul(&d, c, in[1]) ||
           fsdp_op_unary(&e, d, FSDP_UNARY_GELU) || fsdp_op_sum_dim(o, e, 0, true);
  fsdp_tensor_release(a);
  fsdp_tensor_release(b);
  fsdp_tensor_release(c);
  fsdp_tensor_release(d);
  fsdp_tensor_release(e);
  return rc ? FSDP_ERR : FSDP_OK;
}

/* ---- gradient checks --------------------------------------------------------------------- */

static const fsdp_binary_op OP_ADD = FSDP_OP_ADD, OP_SUB = FSDP_OP_SUB, OP_MUL = FSDP_OP_MUL,
                            OP_DIV = FSDP_OP_DIV;

static void test_grad_binary(void **state) {
  (void)state;
  rng_reset(1);
  const fsdp_binary_op *ops[] = {&OP_ADD, &OP_SUB, &OP_MUL, &OP_DIV};
  const char *names[] = {"add", "sub", "mul", "div"};
  for (int i = 0; i < 4; i++) {
    char nm[64];
    snprintf(nm, sizeof nm, "%s same shape", names[i]);
    gradcheck((gc_case){nm, f_binary, ops[i], 2,
                        {rnd_away(2, SHAPE(3, 4), 0.5, 1.5), rnd_away(2, SHAPE(3, 4), 0.5, 1.5)},
                        3});
    snprintf(nm, sizeof nm, "%s (2,3,4) op (3,4)", names[i]);
    gradcheck((gc_case){nm, f_binary, ops[i], 2,
                        {rnd_away(3, SHAPE(2, 3, 4), 0.5, 1.5), rnd_away(2, SHAPE(3, 4), 0.5, 1.5)},
                        3});
    snprintf(nm, sizeof nm, "%s (4) op (2,3,4)", names[i]);
    gradcheck((gc_case){nm, f_binary, ops[i], 2,
                        {rnd_away(1, SHAPE(4), 0.5, 1.5), rnd_away(3, SHAPE(2, 3, 4), 0.5, 1.5)},
                        3});
    snprintf(nm, sizeof nm, "%s (2,3) op scalar", names[i]);
    gradcheck((gc_case){nm, f_binary, ops[i], 2,
                        {rnd_away(2, SHAPE(2, 3), 0.5, 1.5), rnd_away(0, NULL, 0.5, 1.5)}, 3});
    snprintf(nm, sizeof nm, "%s scalar op (2,3)", names[i]);
    gradcheck((gc_case){nm, f_binary, ops[i], 2,
                        {rnd_away(0, NULL, 0.5, 1.5), rnd_away(2, SHAPE(2, 3), 0.5, 1.5)}, 3});
    snprintf(nm, sizeof nm, "%s transposed inputs", names[i]);
    gradcheck((gc_case){nm, f_binary, ops[i], 2,
                        {rnd_transposed(3, SHAPE(2, 3, 4), 0.5, 1.5),
                         rnd_transposed(2, SHAPE(3, 4), 0.5, 1.5)},
                        3});
  }
}

static void test_grad_affine(void **state) {
  (void)state;
  rng_reset(2);
  static const float st[2] = {-1.5f, 0.25f};
  gradcheck((gc_case){"affine", f_affine, st, 1, {rnd(2, SHAPE(3, 4), -1, 1)}, 1});
  gradcheck((gc_case){"affine transposed", f_affine, st, 1,
                      {rnd_transposed(2, SHAPE(3, 4), -1, 1)}, 1});
}

static void test_grad_unary(void **state) {
  (void)state;
  rng_reset(3);
  static const fsdp_unary_op ops[] = {FSDP_UNARY_RELU, FSDP_UNARY_GELU, FSDP_UNARY_EXP,
                                      FSDP_UNARY_LOG,  FSDP_UNARY_SQRT, FSDP_UNARY_TANH,
                                      FSDP_UNARY_SIGMOID};
  static const char *names[] = {"relu", "gelu", "exp", "log", "sqrt", "tanh", "sigmoid"};
  for (int i = 0; i < 7; i++) {
    bool positive = ops[i] == FSDP_UNARY_LOG || ops[i] == FSDP_UNARY_SQRT;
    char nm[64];
    snprintf(nm, sizeof nm, "%s", names[i]);
    /* values 0.05 or more from relu's kink, positive for log and sqrt */
    fsdp_tensor *x = positive ? rnd(3, SHAPE(2, 3, 5), 0.3, 2.0) : rnd_away(3, SHAPE(2, 3, 5), 0.05, 3.0);
    gradcheck((gc_case){nm, f_unary, &ops[i], 1, {x}, 1});
    snprintf(nm, sizeof nm, "%s transposed", names[i]);
    x = positive ? rnd_transposed(2, SHAPE(4, 3), 0.3, 2.0) : rnd_transposed(2, SHAPE(4, 3), 0.05, 3.0);
    if (!positive) { /* random signs */
      for (int64_t j = 0; j < 12; j++)
        if (urand() < 0.5) *elem(x, j) = -*elem(x, j);
    }
    gradcheck((gc_case){nm, f_unary, &ops[i], 1, {x}, 1});
  }
}

static void test_grad_pow(void **state) {
  (void)state;
  rng_reset(4);
  static const float ps[] = {2.0f, 3.0f, 0.5f, -1.0f, 1.5f};
  for (int i = 0; i < 5; i++) {
    char nm[64];
    snprintf(nm, sizeof nm, "pow %g", (double)ps[i]);
    gradcheck((gc_case){nm, f_pow, &ps[i], 1, {rnd(2, SHAPE(3, 4), 0.5, 2.0)}, 1});
  }
  gradcheck((gc_case){"pow 2 of negative, transposed", f_pow, &ps[0], 1,
                      {rnd_transposed(2, SHAPE(3, 4), -2.0, -0.5)}, 1});
}

static void test_grad_matmul(void **state) {
  (void)state;
  rng_reset(5);
  gradcheck((gc_case){"matmul (3,4)@(4,5)", f_matmul, NULL, 2,
                      {rnd(2, SHAPE(3, 4), -1, 1), rnd(2, SHAPE(4, 5), -1, 1)}, 3});
  gradcheck((gc_case){"matmul (2,3,4)@(2,4,5)", f_matmul, NULL, 2,
                      {rnd(3, SHAPE(2, 3, 4), -1, 1), rnd(3, SHAPE(2, 4, 5), -1, 1)}, 3});
  gradcheck((gc_case){"matmul (2,2,3,4)@(2,2,4,5)", f_matmul, NULL, 2,
                      {rnd(4, SHAPE(2, 2, 3, 4), -1, 1), rnd(4, SHAPE(2, 2, 4, 5), -1, 1)}, 3});
  gradcheck((gc_case){"matmul (2,3,4)@(4,5)", f_matmul, NULL, 2,
                      {rnd(3, SHAPE(2, 3, 4), -1, 1), rnd(2, SHAPE(4, 5), -1, 1)}, 3});
  gradcheck((gc_case){"matmul (4)@(4,5)", f_matmul, NULL, 2,
                      {rnd(1, SHAPE(4), -1, 1), rnd(2, SHAPE(4, 5), -1, 1)}, 3});
  gradcheck((gc_case){"matmul transposed inputs", f_matmul, NULL, 2,
                      {rnd_transposed(2, SHAPE(3, 4), -1, 1), rnd_transposed(2, SHAPE(4, 5), -1, 1)},
                      3});
  gradcheck((gc_case){"matmul batched transposed", f_matmul, NULL, 2,
                      {rnd_transposed(3, SHAPE(2, 3, 4), -1, 1),
                       rnd_transposed(3, SHAPE(2, 4, 5), -1, 1)},
                      3});
  gradcheck((gc_case){"matmul only b", f_matmul, NULL, 2,
                      {rnd(2, SHAPE(3, 4), -1, 1), rnd(2, SHAPE(4, 5), -1, 1)}, 2});
}

static void test_grad_linear(void **state) {
  (void)state;
  rng_reset(6);
  gradcheck((gc_case){"linear bias, x (2,3,4)", f_linear, NULL, 3,
                      {rnd(3, SHAPE(2, 3, 4), -1, 1), rnd(2, SHAPE(5, 4), -1, 1),
                       rnd(1, SHAPE(5), -1, 1)},
                      7});
  gradcheck((gc_case){"linear no bias, x (3,4)", f_linear, NULL, 3,
                      {rnd(2, SHAPE(3, 4), -1, 1), rnd(2, SHAPE(5, 4), -1, 1), NULL}, 3});
  gradcheck((gc_case){"linear x (4)", f_linear, NULL, 3,
                      {rnd(1, SHAPE(4), -1, 1), rnd(2, SHAPE(5, 4), -1, 1), rnd(1, SHAPE(5), -1, 1)},
                      7});
  gradcheck((gc_case){"linear transposed x and w", f_linear, NULL, 3,
                      {rnd_transposed(2, SHAPE(3, 4), -1, 1), rnd_transposed(2, SHAPE(5, 4), -1, 1),
                       rnd(1, SHAPE(5), -1, 1)},
                      7});
  gradcheck((gc_case){"linear only weight", f_linear, NULL, 3,
                      {rnd(2, SHAPE(3, 4), -1, 1), rnd(2, SHAPE(5, 4), -1, 1), rnd(1, SHAPE(5), -1, 1)},
                      2});
}

static void test_grad_embedding(void **state) {
  (void)state;
  rng_reset(7);
  static const float ids[] = {0, 4, 2, 2, 1, 4}; /* repeats: gradients must add */
  gradcheck((gc_case){"embedding ids (2,3), w (5,4)", f_embedding, NULL, 2,
                      {from(2, SHAPE(2, 3), ids), rnd(2, SHAPE(5, 4), -1, 1)}, 2});
  gradcheck((gc_case){"embedding transposed w", f_embedding, NULL, 2,
                      {from(1, SHAPE(6), ids), rnd_transposed(2, SHAPE(5, 4), -1, 1)}, 2});
}

static void test_grad_layernorm(void **state) {
  (void)state;
  rng_reset(8);
  gradcheck((gc_case){"layernorm bias (2,3,6)", f_layernorm, NULL, 3,
                      {rnd(3, SHAPE(2, 3, 6), -2, 2), rnd(1, SHAPE(6), 0.5, 1.5),
                       rnd(1, SHAPE(6), -1, 1)},
                      7});
  gradcheck((gc_case){"layernorm no bias (4,5)", f_layernorm, NULL, 3,
                      {rnd(2, SHAPE(4, 5), -2, 2), rnd(1, SHAPE(5), 0.5, 1.5), NULL}, 3,
                      });
  gradcheck((gc_case){"layernorm transposed x", f_layernorm, NULL, 3,
                      {rnd_transposed(2, SHAPE(4, 5), -2, 2), rnd(1, SHAPE(5), 0.5, 1.5),
                       rnd(1, SHAPE(5), -1, 1)},
                      7});
}

static void test_grad_softmax(void **state) {
  (void)state;
  rng_reset(9);
  gradcheck((gc_case){"softmax (2,3,5)", f_softmax, NULL, 1, {rnd(3, SHAPE(2, 3, 5), -2, 2)}, 1});
  gradcheck((gc_case){"softmax transposed", f_softmax, NULL, 1,
                      {rnd_transposed(2, SHAPE(4, 5), -2, 2)}, 1});
}

static void test_grad_attention(void **state) {
  (void)state;
  rng_reset(10);
  static const int nh3 = 3, nh1 = 1, nh2 = 2;
  gradcheck((gc_case){"attention B2 T5 C6 NH3", f_attention, &nh3, 1,
                      {rnd(3, SHAPE(2, 5, 18), -1, 1)}, 1});
  gradcheck((gc_case){"attention B1 T7 C4 NH1", f_attention, &nh1, 1,
                      {rnd(3, SHAPE(1, 7, 12), -1, 1)}, 1});
  gradcheck((gc_case){"attention B1 T1 C4 NH2", f_attention, &nh2, 1,
                      {rnd(3, SHAPE(1, 1, 12), -1, 1)}, 1});
  /* a strided qkv: a narrowed slice of a wider buffer */
  fsdp_tensor *wide = rnd(3, SHAPE(2, 3, 15), -1, 1), *qkv;
  assert_int_equal(fsdp_tensor_narrow(&qkv, wide, 2, 1, 12), FSDP_OK);
  fsdp_tensor_release(wide);
  gradcheck((gc_case){"attention narrowed qkv NH2", f_attention, &nh2, 1, {qkv}, 1});
}

/* ~70 positions: T = 70 spans the kernel's 64-row causal blocks */
static void test_grad_attention_long(void **state) {
  (void)state;
  rng_reset(11);
  static const int nh = 2;
  gradcheck((gc_case){"attention B1 T70 C4 NH2", f_attention, &nh, 1,
                      {rnd(3, SHAPE(1, 70, 12), -1, 1)}, 1});
}

static void test_grad_dropout(void **state) {
  (void)state;
  rng_reset(12);
  static const float p = 0.3f;
  fsdp_tensor *x = rnd_away(2, SHAPE(8, 16), 0.5, 1.5);
  gradcheck((gc_case){"dropout p=0.3", f_dropout, &p, 1, {x}, 1});

  /* the mask: every output is 0 or x / (1 - p); the gradient is R * (the same mask) */
  x = rnd_away(2, SHAPE(8, 16), 0.5, 1.5);
  x->requires_grad = true;
  fsdp_tensor *y, *R = rnd(2, SHAPE(8, 16), -1, 1);
  fsdp_rng_manual_seed(99);
  assert_int_equal(fsdp_op_dropout(&y, x, p), FSDP_OK);
  const float *xv = fsdp_tensor_data(x, "t"), *yv = fsdp_tensor_data(y, "t"),
              *rv = fsdp_tensor_data(R, "t");
  int zeros = 0;
  float scale = 1.0f / (1.0f - p);
  float mask[128];
  for (int i = 0; i < 128; i++) {
    if (yv[i] == 0.0f) {
      mask[i] = 0;
      zeros++;
    } else {
      assert_float_equal(yv[i], xv[i] * scale, 1e-6);
      mask[i] = scale;
    }
  }
  printf("  dropout p=0.3: %d of 128 dropped\n", zeros);
  assert_true(zeros > 128 * 0.15 && zeros < 128 * 0.45);
  assert_int_equal(fsdp_backward(y, R), FSDP_OK);
  const float *g = fsdp_tensor_data(x->grad, "t");
  for (int i = 0; i < 128; i++) assert_float_equal(g[i], rv[i] * mask[i], 1e-6);

  /* same seed => same mask; the stream moves on => a different one */
  fsdp_tensor *y2, *y3;
  fsdp_rng_manual_seed(99);
  assert_int_equal(fsdp_op_dropout(&y2, x, p), FSDP_OK);
  assert_memory_equal(fsdp_tensor_data(y2, "t"), yv, sizeof(float) * 128);
  assert_int_equal(fsdp_op_dropout(&y3, x, p), FSDP_OK);
  assert_memory_not_equal(fsdp_tensor_data(y3, "t"), yv, sizeof(float) * 128);
  /* p = 0 is the identity */
  fsdp_tensor *y4;
  static const float zero = 0.0f;
  assert_int_equal(fsdp_op_dropout(&y4, x, zero), FSDP_OK);
  assert_memory_equal(fsdp_tensor_data(y4, "t"), xv, sizeof(float) * 128);
  fsdp_tape_clear();
  fsdp_tensor_release(y);
  fsdp_tensor_release(y2);
  fsdp_tensor_release(y3);
  fsdp_tensor_release(y4);
  fsdp_tensor_release(R);
  fsdp_tensor_release(x);
}

static void test_grad_cross_entropy(void **state) {
  (void)state;
  rng_reset(13);
  static const int ign = -1, ign7 = 7;
  static const float t1[] = {0, 3, -1, 2, 4, -1}, t2[] = {1, 7, 0, 4, 7, 3}, t3[] = {2, 0, 1, 4};
  gradcheck((gc_case){"cross_entropy (6,5) ignore -1", f_cross_entropy, &ign, 2,
                      {rnd(2, SHAPE(6, 5), -2, 2), from(1, SHAPE(6), t1)}, 1});
  gradcheck((gc_case){"cross_entropy (2,3,5) ignore 7", f_cross_entropy, &ign7, 2,
                      {rnd(3, SHAPE(2, 3, 5), -2, 2), from(2, SHAPE(2, 3), t2)}, 1});
  gradcheck((gc_case){"cross_entropy (2,2,5) flat targets", f_cross_entropy, &ign, 2,
                      {rnd(3, SHAPE(2, 2, 5), -2, 2), from(1, SHAPE(4), t3)}, 1});
  gradcheck((gc_case){"cross_entropy transposed logits", f_cross_entropy, &ign, 2,
                      {rnd_transposed(2, SHAPE(4, 5), -2, 2), from(1, SHAPE(4), t3)}, 1});
  gradcheck((gc_case){"cross_entropy V=37 (vector tail)", f_cross_entropy, &ign, 2,
                      {rnd(2, SHAPE(4, 37), -3, 3), from(1, SHAPE(4), t3)}, 1});

  /* the value: mean over counted rows of lse - logit[target] */
  static const float lg[] = {1, 2, 3, 0, 0, 0}, tg[] = {2, -1};
  fsdp_tensor *l = from(2, SHAPE(2, 3), lg), *t = from(1, SHAPE(2), tg), *o;
  assert_int_equal(fsdp_op_cross_entropy(&o, l, t, -1), FSDP_OK);
  double want = log(exp(1) + exp(2) + exp(3)) - 3;
  assert_float_equal(((float *)fsdp_tensor_data(o, "t"))[0], want, 1e-6);
  fsdp_tensor_release(o);
  fsdp_tensor_release(l);
  fsdp_tensor_release(t);

  /* every target ignored: loss 0 and a zero gradient, not NaN */
  static const float all_ign[] = {-1, -1};
  l = rnd(2, SHAPE(2, 3), -1, 1);
  l->requires_grad = true;
  t = from(1, SHAPE(2), all_ign);
  assert_int_equal(fsdp_op_cross_entropy(&o, l, t, -1), FSDP_OK);
  assert_float_equal(((float *)fsdp_tensor_data(o, "t"))[0], 0.0f, 0);
  assert_int_equal(fsdp_backward(o, NULL), FSDP_OK);
  for (int i = 0; i < 6; i++) assert_float_equal(((float *)fsdp_tensor_data(l->grad, "t"))[i], 0.0f, 0);
  fsdp_tensor_release(o);
  fsdp_tensor_release(l);
  fsdp_tensor_release(t);
}

static void test_grad_mse(void **state) {
  (void)state;
  rng_reset(14);
  gradcheck((gc_case){"mse (3,4)", f_mse, NULL, 2,
                      {rnd(2, SHAPE(3, 4), -1, 1), rnd(2, SHAPE(3, 4), -1, 1)}, 3});
  gradcheck((gc_case){"mse transposed", f_mse, NULL, 2,
                      {rnd_transposed(2, SHAPE(3, 4), -1, 1), rnd(2, SHAPE(3, 4), -1, 1)}, 3});
  fsdp_tensor *a = rnd(2, SHAPE(3, 4), -1, 1);
  gradcheck((gc_case){"mse(a, 2a + 0.5) through one tensor", f_mse_shifted, NULL, 1, {a}, 1});
  a = rnd_away(2, SHAPE(3, 4), 0.5, 1.5);
  gradcheck((gc_case){"mul(a, a) same tensor", f_binary, &OP_MUL, 2, {a, a}, 3});
}

static void test_grad_reductions(void **state) {
  (void)state;
  rng_reset(15);
  gradcheck((gc_case){"sum (2,3,4)", f_sum, NULL, 1, {rnd(3, SHAPE(2, 3, 4), -1, 1)}, 1});
  gradcheck((gc_case){"mean (2,3,4)", f_mean, NULL, 1, {rnd(3, SHAPE(2, 3, 4), -1, 1)}, 1});
  gradcheck((gc_case){"sum transposed", f_sum, NULL, 1, {rnd_transposed(2, SHAPE(3, 4), -1, 1)}, 1});
  gradcheck((gc_case){"mean of scalar", f_mean, NULL, 1, {rnd(0, NULL, -1, 1)}, 1});
  for (int d = 0; d < 3; d++)
    for (int m = 0; m < 2; m++) {
      sum_dim_ctx c = {d, m == 1};
      char nm[64];
      snprintf(nm, sizeof nm, "%s dim %d of (2,3,4)", m ? "mean" : "sum", d);
      gradcheck((gc_case){nm, f_sum_dim, &c, 1, {rnd(3, SHAPE(2, 3, 4), -1, 1)}, 1});
      snprintf(nm, sizeof nm, "%s dim %d of transposed", m ? "mean" : "sum", d);
      gradcheck((gc_case){nm, f_sum_dim, &c, 1, {rnd_transposed(3, SHAPE(2, 3, 4), -1, 1)}, 1});
    }
}

static void test_grad_views(void **state) {
  (void)state;
  rng_reset(16);
  view_ctx v1 = {2, {4, 6}}, v2 = {3, {2, -1, 3}};
  gradcheck((gc_case){"view (2,3,4)->(4,6)", f_view, &v1, 1, {rnd(3, SHAPE(2, 3, 4), -1, 1)}, 1});
  gradcheck((gc_case){"view transposed->(2,-1,3)", f_view, &v2, 1,
                      {rnd_transposed(3, SHAPE(2, 3, 4), -1, 1)}, 1});
  static const int tr01[2] = {0, 1}, tr02[2] = {0, 2}, tr11[2] = {1, 1};
  gradcheck((gc_case){"transpose 0,1", f_transpose, tr01, 1, {rnd(3, SHAPE(2, 3, 4), -1, 1)}, 1});
  gradcheck((gc_case){"transpose 0,2", f_transpose, tr02, 1, {rnd(3, SHAPE(2, 3, 4), -1, 1)}, 1});
  gradcheck((gc_case){"transpose 1,1", f_transpose, tr11, 1, {rnd(3, SHAPE(2, 3, 4), -1, 1)}, 1});
  gradcheck((gc_case){"transpose of transposed", f_transpose, tr01, 1,
                      {rnd_transposed(2, SHAPE(3, 4), -1, 1)}, 1});
  static const int64_t n0[3] = {0, 1, 2}, n1[3] = {1, 0, 1}, n2[3] = {2, 2, 2};
  gradcheck((gc_case){"narrow dim0", f_narrow, n0, 1, {rnd(3, SHAPE(3, 3, 4), -1, 1)}, 1});
  gradcheck((gc_case){"narrow dim1", f_narrow, n1, 1, {rnd(3, SHAPE(3, 3, 4), -1, 1)}, 1});
  gradcheck((gc_case){"narrow dim2", f_narrow, n2, 1, {rnd(3, SHAPE(3, 3, 4), -1, 1)}, 1});
  gradcheck((gc_case){"narrow of transposed", f_narrow, n1, 1,
                      {rnd_transposed(2, SHAPE(3, 4), -1, 1)}, 1});
  gradcheck((gc_case){"contiguous of transposed", f_contiguous, NULL, 1,
                      {rnd_transposed(3, SHAPE(2, 3, 4), -1, 1)}, 1});
  gradcheck((gc_case){"composite narrow/transpose/view/matmul/gelu/mean", f_composite, NULL, 2,
                      {rnd(2, SHAPE(3, 6), -1, 1), rnd(2, SHAPE(6, 5), -1, 1)}, 3});
}

/* The checker itself must catch a wrong gradient: an op whose backward is 10% off, and one
 * whose gradient has a NaN (which a plain max over the differences would skip). */
static bool wrong_nan;
static int bw_wrong(fsdp_node *n) {
  float *da = fsdp_grad_acc(n->in[0]);
  if (!da) return FSDP_ERR;
  const float *g = fsdp_tensor_data(n->out->grad, "t");
  for (int64_t i = 0; i < fsdp_tensor_numel(n->out); i++)
    da[i] += wrong_nan ? (i == 4 ? NAN : 2.0f * g[i]) : 2.2f * g[i];
  return FSDP_OK;
}
static int f_wrong_double(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  if (fsdp_op_affine(o, in[0], 2.0f, 0.0f)) return FSDP_ERR;
  if (fsdp_grad_enabled() && fsdp_tape_size() > 0) {
    /* swap the recorded node's backward for the wrong one */
    fsdp_node *n = fsdp_node_new("wrong", bw_wrong);
    n->out = *o;
    fsdp_tensor_retain(*o);
    n->nin = 1;
    n->in[0] = in[0];
    fsdp_tensor_retain(in[0]);
    fsdp_tape_clear();
    (*o)->requires_grad = true;
    (*o)->is_leaf = false;
    if (fsdp_tape_push(n)) return FSDP_ERR;
  }
  return FSDP_OK;
}
static void test_gradcheck_catches_wrong_backward(void **state) {
  (void)state;
  rng_reset(17);
  gc_case c = {"deliberately wrong backward", f_wrong_double, NULL, 1, {rnd(2, SHAPE(3, 3), -1, 1)}, 1};
  double err = gradcheck_measure(&c);
  assert_true(err > 0.05);
  wrong_nan = true;
  err = gradcheck_measure(&c);
  wrong_nan = false;
  assert_true(isnan(err));
  fsdp_tensor_release(c.in[0]);
}

/* ---- the selection and shaping ops, dtype and device conversion -------------------------- */

/* Values k * 0.1 - n / 20 in a shuffled order: all distinct and 0.1 apart, so an argmax or a
 * sort order does not change under the checker's +-1e-2 steps. */
static fsdp_tensor *rnd_distinct(int ndim, const int64_t *shape) {
  fsdp_tensor *t = mk(ndim, shape);
  int64_t n = fsdp_tensor_numel(t);
  float *d = fsdp_tensor_data(t, "test");
  for (int64_t i = 0; i < n; i++) d[i] = (float)(0.1 * (double)i - 0.05 * (double)n);
  for (int64_t i = n - 1; i > 0; i--) { /* Fisher-Yates */
    int64_t j = (int64_t)(urand() * (double)(i + 1));
    float x = d[i];
    d[i] = d[j];
    d[j] = x;
  }
  return t;
}

/* uniform in [lo, hi), each value at least `gap` from b0 and b1 (clamp's kinks) */
static fsdp_tensor *rnd_avoid(int ndim, const int64_t *shape, double lo, double hi, double b0,
                              double b1, double gap) {
  fsdp_tensor *t = mk(ndim, shape);
  float *d = fsdp_tensor_data(t, "test");
  for (int64_t i = 0; i < fsdp_tensor_numel(t); i++) {
    double x;
    do x = lo + (hi - lo) * urand();
    while (fabs(x - b0) < gap || fabs(x - b1) < gap);
    d[i] = (float)x;
  }
  return t;
}

/* A second device with data: the cpu's memory and kernels under another name, so ops can be
 * given tensors of two devices. */
static fsdp_device_i cpu2_dev;
static const fsdp_device_i *cpu2(void) {
  if (!cpu2_dev.name) {
    cpu2_dev = fsdp_device_cpu;
    cpu2_dev.name = "cpu2";
    cpu2_dev.kernels = NULL;
    const fsdp_kernels_i *k = fsdp_kernels_of(&fsdp_device_cpu, "test");
    assert_non_null(k);
    assert_int_equal(fsdp_device_register(&cpu2_dev, k), FSDP_OK);
  }
  return &cpu2_dev;
}

static int f_where(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_where(o, in[0], in[1], in[2]);
}
static int f_clamp(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  const double *b = ctx;
  return fsdp_op_clamp(o, in[0], b[0], b[1]);
}
typedef struct {
  int dim, n;
} list_ctx;
static int f_cat(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  const list_ctx *c = ctx;
  return fsdp_op_cat(o, in, c->n, c->dim);
}
static int f_stack(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  const list_ctx *c = ctx;
  return fsdp_op_stack(o, in, c->n, c->dim);
}
typedef struct {
  int dim;
  bool max, keepdim;
} extreme_ctx;
/* the values (the recorded output); the indices are made and dropped */
static int f_extreme(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  const extreme_ctx *c = ctx;
  fsdp_tensor *idx = NULL;
  int rc = fsdp_op_extreme(o, &idx, in[0], c->dim, c->max, c->keepdim);
  if (!rc) assert_int_equal(idx->dtype, FSDP_DTYPE_I64);
  fsdp_tensor_release(idx);
  return rc;
}
typedef struct {
  int64_t k; /* -1: the whole dim (sort) */
  int dim;
  bool largest;
} topk_ctx;
static int f_topk(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  const topk_ctx *c = ctx;
  int64_t k = c->k < 0 ? in[0]->shape[c->dim] : c->k;
  return fsdp_op_topk(o, NULL, in[0], k, c->dim, c->largest);
}
/* max along a dim plus the sum along it: the gather's backward adds to a gradient that the
 * sum's backward (run first) already holds */
static int f_max_plus_sum(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  int dim = *(const int *)ctx;
  fsdp_tensor *m = NULL, *s = NULL;
  int rc = fsdp_op_extreme(&m, NULL, in[0], dim, true, false) ||
           fsdp_op_sum_dim(&s, in[0], dim, false) || fsdp_op_binary(o, m, s, FSDP_OP_ADD);
  fsdp_tensor_release(m);
  fsdp_tensor_release(s);
  return rc ? FSDP_ERR : FSDP_OK;
}
static int f_softmax_dim(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_softmax(o, in[0], *(const int *)ctx);
}
/* f32 -> f64, tanh computed in f64, -> f32: both conversions are recorded */
static int f_to_f64_tanh(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  fsdp_tensor *a = NULL, *b = NULL;
  int rc = fsdp_op_to(&a, in[0], NULL, FSDP_DTYPE_F64) ||
           fsdp_op_unary(&b, a, FSDP_UNARY_TANH) || fsdp_op_to(o, b, NULL, FSDP_DTYPE_F32);
  if (!rc) assert_int_equal(a->dtype, FSDP_DTYPE_F64);
  fsdp_tensor_release(a);
  fsdp_tensor_release(b);
  return rc ? FSDP_ERR : FSDP_OK;
}
/* an f64 tensor times an f32 one: the f32 operand is promoted (a recorded to) */
static int f_mul_promoted(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  fsdp_tensor *a = NULL, *p = NULL;
  int rc = fsdp_op_to(&a, in[0], NULL, FSDP_DTYPE_F64) ||
           fsdp_op_binary(&p, a, in[1], FSDP_OP_MUL) || fsdp_op_to(o, p, NULL, FSDP_DTYPE_F32);
  if (!rc) assert_int_equal(p->dtype, FSDP_DTYPE_F64);
  fsdp_tensor_release(a);
  fsdp_tensor_release(p);
  return rc ? FSDP_ERR : FSDP_OK;
}
/* to the second device, exp there, back to the cpu */
static int f_to_device(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  fsdp_tensor *a = NULL, *b = NULL;
  int rc = fsdp_op_to(&a, in[0], cpu2(), FSDP_DTYPE_F32) ||
           fsdp_op_unary(&b, a, FSDP_UNARY_EXP) ||
           fsdp_op_to(o, b, &fsdp_device_cpu, FSDP_DTYPE_F32);
  if (!rc) assert_ptr_equal(b->storage->device, cpu2());
  fsdp_tensor_release(a);
  fsdp_tensor_release(b);
  return rc ? FSDP_ERR : FSDP_OK;
}

static void test_grad_abs(void **state) {
  (void)state;
  rng_reset(40);
  static const fsdp_unary_op abs_op = FSDP_UNARY_ABS;
  gradcheck((gc_case){"abs (2,3,5)", f_unary, &abs_op, 1, {rnd_away(3, SHAPE(2, 3, 5), 0.05, 3)}, 1});
  fsdp_tensor *x = rnd_transposed(2, SHAPE(4, 3), 0.05, 3);
  for (int64_t j = 0; j < 12; j++)
    if (urand() < 0.5) *elem(x, j) = -*elem(x, j);
  gradcheck((gc_case){"abs transposed", f_unary, &abs_op, 1, {x}, 1});
}

static void test_grad_where(void **state) {
  (void)state;
  rng_reset(41);
  static const float c12[] = {1, 0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 0}, c4[] = {0, 1, 1, 0};
  gradcheck((gc_case){"where same shapes", f_where, NULL, 3,
                      {from(2, SHAPE(3, 4), c12), rnd(2, SHAPE(3, 4), -1, 1), rnd(2, SHAPE(3, 4), -1, 1)},
                      6});
  gradcheck((gc_case){"where b (4) broadcast", f_where, NULL, 3,
                      {from(2, SHAPE(3, 4), c12), rnd(2, SHAPE(3, 4), -1, 1), rnd(1, SHAPE(4), -1, 1)},
                      6});
  gradcheck((gc_case){"where a (4) broadcast, cond (4)", f_where, NULL, 3,
                      {from(1, SHAPE(4), c4), rnd(1, SHAPE(4), -1, 1), rnd(2, SHAPE(3, 4), -1, 1)},
                      6});
  gradcheck((gc_case){"where cond (4), b scalar", f_where, NULL, 3,
                      {from(1, SHAPE(4), c4), rnd(2, SHAPE(3, 4), -1, 1), rnd(0, NULL, -1, 1)}, 6});
  gradcheck((gc_case){"where transposed a, only a", f_where, NULL, 3,
                      {from(2, SHAPE(3, 4), c12), rnd_transposed(2, SHAPE(3, 4), -1, 1),
                       rnd(2, SHAPE(3, 4), -1, 1)},
                      2});
}

static void test_grad_clamp(void **state) {
  (void)state;
  rng_reset(42);
  static const double both[2] = {-1.0, 0.5}, below[2] = {-INFINITY, 0.25}, above[2] = {-0.5, INFINITY};
  gradcheck((gc_case){"clamp [-1, 0.5]", f_clamp, both, 1,
                      {rnd_avoid(2, SHAPE(4, 5), -2, 2, -1.0, 0.5, 0.05)}, 1});
  gradcheck((gc_case){"clamp max only", f_clamp, below, 1,
                      {rnd_avoid(2, SHAPE(4, 5), -2, 2, 0.25, 0.25, 0.05)}, 1});
  gradcheck((gc_case){"clamp min only", f_clamp, above, 1,
                      {rnd_avoid(2, SHAPE(4, 5), -2, 2, -0.5, -0.5, 0.05)}, 1});
  fsdp_tensor *x = rnd_transposed(2, SHAPE(4, 5), -2, 2);
  for (int64_t j = 0; j < 20; j++) /* away from the bounds */
    while (fabs(*elem(x, j) + 1.0) < 0.05 || fabs(*elem(x, j) - 0.5) < 0.05) *elem(x, j) += 0.1f;
  gradcheck((gc_case){"clamp transposed", f_clamp, both, 1, {x}, 1});
}

static void test_grad_cat_stack(void **state) {
  (void)state;
  rng_reset(43);
  static const list_ctx d0n3 = {0, 3}, d1n2 = {1, 2}, d2n3 = {2, 3}, d0n1 = {0, 1}, d1n3 = {1, 3};
  gradcheck((gc_case){"cat dim 0 of 3", f_cat, &d0n3, 3,
                      {rnd(3, SHAPE(2, 3, 4), -1, 1), rnd(3, SHAPE(1, 3, 4), -1, 1),
                       rnd(3, SHAPE(3, 3, 4), -1, 1)},
                      7});
  gradcheck((gc_case){"cat dim 1, transposed input", f_cat, &d1n2, 2,
                      {rnd(3, SHAPE(2, 1, 4), -1, 1), rnd_transposed(3, SHAPE(2, 3, 4), -1, 1)}, 3});
  gradcheck((gc_case){"cat dim 2 of 3, transposed middle", f_cat, &d2n3, 3,
                      {rnd(3, SHAPE(2, 3, 1), -1, 1), rnd_transposed(3, SHAPE(2, 3, 4), -1, 1),
                       rnd(3, SHAPE(2, 3, 2), -1, 1)},
                      7});
  gradcheck((gc_case){"cat of one", f_cat, &d0n1, 1, {rnd(2, SHAPE(2, 3), -1, 1)}, 1});
  fsdp_tensor *x = rnd(2, SHAPE(2, 3), -1, 1);
  gradcheck((gc_case){"cat {x, y, x} dim 1", f_cat, &d1n3, 3, {x, rnd(2, SHAPE(2, 1), -1, 1), x}, 7});
  gradcheck((gc_case){"cat only the middle", f_cat, &d0n3, 3,
                      {rnd(2, SHAPE(1, 3), -1, 1), rnd(2, SHAPE(2, 3), -1, 1), rnd(2, SHAPE(1, 3), -1, 1)},
                      2});
  static const list_ctx s0n2 = {0, 2}, s1n3 = {1, 3}, s2n2 = {2, 2};
  gradcheck((gc_case){"stack dim 0", f_stack, &s0n2, 2,
                      {rnd(2, SHAPE(2, 3), -1, 1), rnd(2, SHAPE(2, 3), -1, 1)}, 3});
  gradcheck((gc_case){"stack dim 1 of 3, transposed", f_stack, &s1n3, 3,
                      {rnd(2, SHAPE(2, 3), -1, 1), rnd_transposed(2, SHAPE(2, 3), -1, 1),
                       rnd(2, SHAPE(2, 3), -1, 1)},
                      7});
  gradcheck((gc_case){"stack dim 2 (last)", f_stack, &s2n2, 2,
                      {rnd(2, SHAPE(2, 3), -1, 1), rnd(2, SHAPE(2, 3), -1, 1)}, 3});
}

static void test_grad_max_min_topk_sort(void **state) {
  (void)state;
  rng_reset(44);
  for (int d = 0; d < 3; d++)
    for (int m = 0; m < 2; m++)
      for (int keep = 0; keep < 2; keep++) {
        extreme_ctx c = {d, m == 1, keep == 1};
        char nm[64];
        snprintf(nm, sizeof nm, "%s dim %d%s of (3,4,5)", m ? "max" : "min", d,
                 keep ? " keepdim" : "");
        gradcheck((gc_case){nm, f_extreme, &c, 1, {rnd_distinct(3, SHAPE(3, 4, 5))}, 1});
      }
  static const extreme_ctx max0 = {0, true, false};
  fsdp_tensor *t = rnd_transposed(2, SHAPE(4, 5), -1, 1);
  fsdp_tensor *dist = rnd_distinct(2, SHAPE(4, 5));
  for (int64_t i = 0; i < 20; i++) *elem(t, i) = ((float *)fsdp_tensor_data(dist, "t"))[i];
  fsdp_tensor_release(dist);
  gradcheck((gc_case){"max dim 0 of transposed", f_extreme, &max0, 1, {t}, 1});
  static const int dim1 = 1;
  gradcheck((gc_case){"max + sum along dim 1 (gradients add)", f_max_plus_sum, &dim1, 1,
                      {rnd_distinct(2, SHAPE(3, 4))}, 1});

  static const topk_ctx k2d1 = {2, 1, true}, k3d0 = {3, 0, false}, k1d1 = {1, 1, false},
                        sort1 = {-1, 1, false}, sort0 = {-1, 0, true};
  gradcheck((gc_case){"topk 2 largest dim 1", f_topk, &k2d1, 1, {rnd_distinct(2, SHAPE(3, 5))}, 1});
  gradcheck((gc_case){"topk 3 smallest dim 0", f_topk, &k3d0, 1, {rnd_distinct(2, SHAPE(4, 5))}, 1});
  gradcheck((gc_case){"topk 1 smallest dim 1 of (2,3,4)", f_topk, &k1d1, 1,
                      {rnd_distinct(3, SHAPE(2, 3, 4))}, 1});
  gradcheck((gc_case){"sort ascending dim 1", f_topk, &sort1, 1, {rnd_distinct(2, SHAPE(4, 5))}, 1});
  gradcheck((gc_case){"sort descending dim 0", f_topk, &sort0, 1, {rnd_distinct(2, SHAPE(4, 5))}, 1});
}

static void test_grad_softmax_dim(void **state) {
  (void)state;
  rng_reset(45);
  static const int d0 = 0, d1 = 1;
  gradcheck((gc_case){"softmax dim 0 of (2,3,4)", f_softmax_dim, &d0, 1, {rnd(3, SHAPE(2, 3, 4), -2, 2)}, 1});
  gradcheck((gc_case){"softmax dim 1 of (2,3,4)", f_softmax_dim, &d1, 1, {rnd(3, SHAPE(2, 3, 4), -2, 2)}, 1});
  gradcheck((gc_case){"softmax dim 0 of transposed", f_softmax_dim, &d0, 1,
                      {rnd_transposed(2, SHAPE(4, 5), -2, 2)}, 1});
  /* the values: each slice along dim 0 sums to 1 */
  fsdp_tensor *x = rnd(3, SHAPE(2, 3, 4), -2, 2), *s;
  assert_int_equal(fsdp_op_softmax(&s, x, 0), FSDP_OK);
  for (int64_t j = 0; j < 12; j++) {
    double sum = *elem(s, j) + *elem(s, 12 + j);
    assert_float_equal(sum, 1.0, 1e-6);
  }
  fsdp_tensor_release(s);
  fsdp_tensor_release(x);
}

static void test_grad_to(void **state) {
  (void)state;
  rng_reset(46);
  gradcheck((gc_case){"to f64, tanh in f64, to f32", f_to_f64_tanh, NULL, 1, {rnd(2, SHAPE(3, 4), -2, 2)}, 1});
  gradcheck((gc_case){"f64 * f32 promoted", f_mul_promoted, NULL, 2,
                      {rnd(2, SHAPE(3, 4), -2, 2), rnd(1, SHAPE(4), -2, 2)}, 3});
  gradcheck((gc_case){"to cpu2, exp there, to cpu", f_to_device, NULL, 1, {rnd(2, SHAPE(3, 4), -1, 1)}, 1});
  /* the gradient arrives in the input's own dtype and device */
  fsdp_tensor *x = rnd(1, SHAPE(3), -1, 1), *y, *s;
  x->requires_grad = true;
  assert_int_equal(fsdp_op_to(&y, x, cpu2(), FSDP_DTYPE_F64), FSDP_OK);
  assert_int_equal(y->dtype, FSDP_DTYPE_F64);
  assert_ptr_equal(y->storage->device, cpu2());
  assert_int_equal(fsdp_op_sum(&s, y), FSDP_OK);
  assert_int_equal(fsdp_backward(s, NULL), FSDP_OK);
  assert_int_equal(x->grad->dtype, FSDP_DTYPE_F32);
  assert_ptr_equal(x->grad->storage->device, &fsdp_device_cpu);
  for (int i = 0; i < 3; i++) assert_float_equal(((float *)fsdp_tensor_data(x->grad, "t"))[i], 1.0f, 0);
  fsdp_tensor_release(y);
  fsdp_tensor_release(s);
  /* to the same dtype and device is the tensor itself, nothing recorded */
  assert_int_equal(fsdp_op_to(&y, x, NULL, FSDP_DTYPE_F32), FSDP_OK);
  assert_ptr_equal(y, x);
  assert_int_equal(fsdp_tape_size(), 0);
  fsdp_tensor_release(y);
  /* to an integer dtype is not recorded, and refused while x requires a gradient */
  x->requires_grad = false;
  assert_int_equal(fsdp_op_to(&y, x, NULL, FSDP_DTYPE_I64), FSDP_OK);
  assert_false(y->requires_grad);
  assert_int_equal(fsdp_tape_size(), 0);
  fsdp_tensor_release(y);
  fsdp_tensor_release(x);
}

/* ---- f64, the fused ops, size-1 dimensions, strided inputs, accumulating paths ------------- */

static int f_bias_gelu(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  return fsdp_op_bias_gelu(o, in[0], in[1]);
}
/* layernorm(a + b) + sum / 2: both outputs of the fused op carry a gradient, and the sum's
 * arrives from two consumers */
static int f_add_layernorm(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  fsdp_tensor *sum = NULL, *ln = NULL, *h = NULL;
  int rc = fsdp_op_add_layernorm(&sum, &ln, in[0], in[1], in[2], in[3], 1e-5f) ||
           fsdp_op_affine(&h, sum, 0.5f, 0.0f) || fsdp_op_binary(o, ln, h, FSDP_OP_ADD);
  fsdp_tensor_release(sum);
  fsdp_tensor_release(ln);
  fsdp_tensor_release(h);
  return rc ? FSDP_ERR : FSDP_OK;
}
/* op(x, ...) + x[..., :n]: the add's backward, which runs first, gives x a gradient, so the
 * op's own backward takes its accumulating path (no first-gradient shortcut) */
typedef enum { ACC_LINEAR, ACC_BIAS_GELU, ACC_ATTENTION, ACC_LAYERNORM, ACC_CROSS_ENTROPY } acc_op;
static int f_accumulating(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  fsdp_tensor *y = NULL, *x = NULL;
  int rc = FSDP_ERR;
  switch (*(const acc_op *)ctx) {
  case ACC_LINEAR: rc = fsdp_op_linear(&y, in[0], in[1], in[2]); break;
  case ACC_BIAS_GELU: rc = fsdp_op_bias_gelu(&y, in[0], in[1]); break;
  case ACC_ATTENTION: rc = fsdp_op_attention(&y, in[0], 2); break;
  case ACC_LAYERNORM: rc = fsdp_op_layernorm(&y, in[0], in[1], in[2], 1e-5f); break;
  case ACC_CROSS_ENTROPY: rc = fsdp_op_cross_entropy(&y, in[0], in[1], -1); break;
  }
  if (!rc && y->ndim == 0) { /* a loss: add the logits' sum */
    rc = fsdp_op_sum(&x, in[0]);
  } else if (!rc) {
    rc = fsdp_op_narrow(&x, in[0], in[0]->ndim - 1, 0, y->shape[y->ndim - 1]);
  }
  if (!rc) rc = fsdp_op_binary(o, y, x, FSDP_OP_ADD);
  fsdp_tensor_release(y);
  fsdp_tensor_release(x);
  return rc;
}
/* A view whose output is an addend of a same-shape add: the add hands the view's output and
 * the other addend b one gradient buffer, and the view hands its memory on to its input y. y
 * and b each have an older consumer (p, q), whose backward adds into their gradient later:
 * neither write may reach the other's gradient, in either order.
 *   y = x * 1, b = z * 1, p = y * y, q = b * b, s = view(y) + b, out = s * s + p + q */
static int f_view_of_shared(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  fsdp_tensor *y = NULL, *b = NULL, *p = NULL, *q = NULL, *v = NULL, *s = NULL, *m = NULL,
              *t = NULL;
  const fsdp_tensor *x = in[0];
  int rc = fsdp_op_affine(&y, in[0], 1.0f, 0.0f) || fsdp_op_affine(&b, in[1], 1.0f, 0.0f) ||
           fsdp_op_binary(&p, y, y, FSDP_OP_MUL) || fsdp_op_binary(&q, b, b, FSDP_OP_MUL) ||
           fsdp_op_view(&v, y, x->ndim, x->shape) || fsdp_op_binary(&s, v, b, FSDP_OP_ADD) ||
           fsdp_op_binary(&m, s, s, FSDP_OP_MUL) || fsdp_op_binary(&t, m, p, FSDP_OP_ADD) ||
           fsdp_op_binary(o, t, q, FSDP_OP_ADD);
  fsdp_tensor *all[] = {y, b, p, q, v, s, m, t};
  for (int i = 0; i < 8; i++) fsdp_tensor_release(all[i]);
  return rc ? FSDP_ERR : FSDP_OK;
}

/* Every op with an f64 kernel, in f64: a tolerance of 1e-8 of the gradient's scale catches what
 * f32's 2e-3 cannot (a constant or a step computed in f32) */
static void test_grad_f64_elementwise(void **state) {
  (void)state;
  rng_reset(60);
  const fsdp_binary_op *ops[] = {&OP_ADD, &OP_SUB, &OP_MUL, &OP_DIV};
  const char *names[] = {"add", "sub", "mul", "div"};
  for (int i = 0; i < 4; i++) {
    char nm[64];
    snprintf(nm, sizeof nm, "f64 %s same shape", names[i]);
    gradcheck((gc_case){nm, f_binary, ops[i], 2,
                        {f64(rnd_away(2, SHAPE(3, 4), 0.5, 1.5)),
                         f64(rnd_away(2, SHAPE(3, 4), 0.5, 1.5))},
                        3});
    snprintf(nm, sizeof nm, "f64 %s (2,3,4) op transposed (3,4)", names[i]);
    gradcheck((gc_case){nm, f_binary, ops[i], 2,
                        {f64(rnd_away(3, SHAPE(2, 3, 4), 0.5, 1.5)),
                         f64(rnd_transposed(2, SHAPE(3, 4), 0.5, 1.5))},
                        3});
    snprintf(nm, sizeof nm, "f64 %s (4) op (2,3,4)", names[i]);
    gradcheck((gc_case){nm, f_binary, ops[i], 2,
                        {f64(rnd_away(1, SHAPE(4), 0.5, 1.5)),
                         f64(rnd_away(3, SHAPE(2, 3, 4), 0.5, 1.5))},
                        3});
    snprintf(nm, sizeof nm, "f64 %s (1,1) op (2,3)", names[i]);
    gradcheck((gc_case){nm, f_binary, ops[i], 2,
                        {f64(rnd_away(2, SHAPE(1, 1), 0.5, 1.5)),
                         f64(rnd_away(2, SHAPE(2, 3), 0.5, 1.5))},
                        3});
  }
  static const float st[2] = {-1.5f, 0.25f};
  gradcheck((gc_case){"f64 affine transposed", f_affine, st, 1,
                      {f64(rnd_transposed(2, SHAPE(3, 4), -1, 1))}, 1});
  static const fsdp_unary_op uops[] = {FSDP_UNARY_RELU, FSDP_UNARY_GELU, FSDP_UNARY_EXP,
                                       FSDP_UNARY_LOG,  FSDP_UNARY_SQRT, FSDP_UNARY_TANH,
                                       FSDP_UNARY_SIGMOID, FSDP_UNARY_ABS, FSDP_UNARY_SIGN};
  for (int i = 0; i < 9; i++) {
    bool positive = uops[i] == FSDP_UNARY_LOG || uops[i] == FSDP_UNARY_SQRT;
    char nm[64];
    snprintf(nm, sizeof nm, "f64 %s", fsdp_unary_name(uops[i]));
    fsdp_tensor *x = positive ? rnd(2, SHAPE(3, 5), 0.3, 2.0) : rnd_away(2, SHAPE(3, 5), 0.05, 3.0);
    gradcheck((gc_case){nm, f_unary, &uops[i], 1, {f64(x)}, 1});
  }
  static const fsdp_unary_op sign = FSDP_UNARY_SIGN;
  gradcheck((gc_case){"sign (zero gradient)", f_unary, &sign, 1,
                      {rnd_away(2, SHAPE(3, 5), 0.05, 3.0)}, 1});
  static const float ps[] = {2.0f, 3.0f, 0.5f, -1.0f, 1.5f};
  for (int i = 0; i < 5; i++) {
    char nm[64];
    snprintf(nm, sizeof nm, "f64 pow %g", (double)ps[i]);
    gradcheck((gc_case){nm, f_pow, &ps[i], 1, {f64(rnd(2, SHAPE(3, 4), 0.5, 2.0))}, 1});
  }
  /* x^0 is 1 everywhere: its gradient is 0, at x = 0 too (not 0 * 0^-1) */
  static const float p0 = 0.0f, xs[] = {0, 0.5f, -1.5f, 0, 2, -0.25f};
  gradcheck((gc_case){"pow 0 through 0", f_pow, &p0, 1, {from(2, SHAPE(2, 3), xs)}, 1});
  gradcheck((gc_case){"f64 pow 0 through 0", f_pow, &p0, 1, {f64(from(2, SHAPE(2, 3), xs))}, 1});
}

static void test_grad_f64_reductions_selection(void **state) {
  (void)state;
  rng_reset(61);
  gradcheck((gc_case){"f64 sum transposed", f_sum, NULL, 1,
                      {f64(rnd_transposed(2, SHAPE(3, 4), -1, 1))}, 1});
  gradcheck((gc_case){"f64 mean (3,7)", f_mean, NULL, 1, {f64(rnd(2, SHAPE(3, 7), -1, 1))}, 1});
  for (int d = 0; d < 3; d++)
    for (int m = 0; m < 2; m++) {
      sum_dim_ctx c = {d, m == 1};
      char nm[64];
      snprintf(nm, sizeof nm, "f64 %s dim %d of (3,5,7)", m ? "mean" : "sum", d);
      gradcheck((gc_case){nm, f_sum_dim, &c, 1, {f64(rnd(3, SHAPE(3, 5, 7), -1, 1))}, 1});
    }
  /* and the values: an f64 mean of three ones is 1, not 3 * (float)(1 / 3) */
  static const float ones[6] = {1, 1, 1, 1, 1, 1};
  fsdp_tensor *o6 = f64(from(2, SHAPE(2, 3), ones)), *mo;
  assert_int_equal(fsdp_op_sum_dim(&mo, o6, 1, true), FSDP_OK);
  assert_true(getv(mo, 0) == 1.0 && getv(mo, 1) == 1.0);
  fsdp_tensor_release(mo);
  fsdp_tensor_release(o6);
  view_ctx v = {3, {2, -1, 3}};
  gradcheck((gc_case){"f64 view of transposed", f_view, &v, 1,
                      {f64(rnd_transposed(3, SHAPE(2, 3, 4), -1, 1))}, 1});
  static const int tr02[2] = {0, 2};
  gradcheck((gc_case){"f64 transpose 0,2", f_transpose, tr02, 1,
                      {f64(rnd(3, SHAPE(2, 3, 4), -1, 1))}, 1});
  static const int64_t n1[3] = {1, 1, 2};
  gradcheck((gc_case){"f64 narrow of transposed", f_narrow, n1, 1,
                      {f64(rnd_transposed(2, SHAPE(3, 4), -1, 1))}, 1});
  static const float c12[] = {1, 0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 0};
  gradcheck((gc_case){"f64 where, b (4) broadcast", f_where, NULL, 3,
                      {from(2, SHAPE(3, 4), c12), f64(rnd_transposed(2, SHAPE(3, 4), -1, 1)),
                       f64(rnd(1, SHAPE(4), -1, 1))},
                      6});
  gradcheck((gc_case){"where f64 a, f32 b promoted", f_where, NULL, 3,
                      {from(2, SHAPE(3, 4), c12), f64(rnd(2, SHAPE(3, 4), -1, 1)),
                       rnd(1, SHAPE(4), -1, 1)},
                      6});
  static const double both[2] = {-1.0, 0.5};
  gradcheck((gc_case){"f64 clamp [-1, 0.5]", f_clamp, both, 1,
                      {f64(rnd_avoid(2, SHAPE(4, 5), -2, 2, -1.0, 0.5, 0.05))}, 1});
  static const list_ctx d1n3 = {1, 3}, s0n2 = {0, 2};
  gradcheck((gc_case){"f64 cat dim 1, transposed middle", f_cat, &d1n3, 3,
                      {f64(rnd(2, SHAPE(3, 1), -1, 1)), f64(rnd_transposed(2, SHAPE(3, 4), -1, 1)),
                       f64(rnd(2, SHAPE(3, 2), -1, 1))},
                      7});
  gradcheck((gc_case){"f64 stack dim 0", f_stack, &s0n2, 2,
                      {f64(rnd(2, SHAPE(2, 3), -1, 1)), f64(rnd(2, SHAPE(2, 3), -1, 1))}, 3});
  for (int d = 0; d < 3; d++) {
    extreme_ctx c = {d, d != 1, d == 2};
    char nm[64];
    snprintf(nm, sizeof nm, "f64 %s dim %d of (3,4,5)", c.max ? "max" : "min", d);
    gradcheck((gc_case){nm, f_extreme, &c, 1, {f64(rnd_distinct(3, SHAPE(3, 4, 5)))}, 1});
  }
  static const topk_ctx k2d1 = {2, 1, true}, sort0 = {-1, 0, false};
  gradcheck((gc_case){"f64 topk 2 largest dim 1", f_topk, &k2d1, 1,
                      {f64(rnd_distinct(2, SHAPE(3, 5)))}, 1});
  gradcheck((gc_case){"f64 sort ascending dim 0", f_topk, &sort0, 1,
                      {f64(rnd_distinct(2, SHAPE(4, 5)))}, 1});
}

/* bias_gelu: the fused kernel (f32) on every input layout, and the add-then-gelu path (f64) */
static void test_grad_bias_gelu(void **state) {
  (void)state;
  rng_reset(62);
  gradcheck((gc_case){"bias_gelu x (2,3,5)", f_bias_gelu, NULL, 2,
                      {rnd(3, SHAPE(2, 3, 5), -3, 3), rnd(1, SHAPE(5), -1, 1)}, 3});
  gradcheck((gc_case){"bias_gelu x (37), vector tail", f_bias_gelu, NULL, 2,
                      {rnd(1, SHAPE(37), -3, 3), rnd(1, SHAPE(37), -1, 1)}, 3});
  gradcheck((gc_case){"bias_gelu transposed x", f_bias_gelu, NULL, 2,
                      {rnd_transposed(2, SHAPE(4, 5), -3, 3), rnd(1, SHAPE(5), -1, 1)}, 3});
  gradcheck((gc_case){"bias_gelu only b", f_bias_gelu, NULL, 2,
                      {rnd(2, SHAPE(4, 5), -3, 3), rnd(1, SHAPE(5), -1, 1)}, 2});
  gradcheck((gc_case){"bias_gelu only x", f_bias_gelu, NULL, 2,
                      {rnd(2, SHAPE(4, 5), -3, 3), rnd(1, SHAPE(5), -1, 1)}, 1});
  gradcheck((gc_case){"f64 bias_gelu (add, gelu)", f_bias_gelu, NULL, 2,
                      {f64(rnd(3, SHAPE(2, 3, 5), -3, 3)), f64(rnd(1, SHAPE(5), -1, 1))}, 3});
}

/* add_layernorm: the fused slot (a and b of one shape) and the two ops (b broadcast) */
static void test_grad_add_layernorm(void **state) {
  (void)state;
  rng_reset(63);
  gradcheck((gc_case){"add_layernorm (2,3,6)", f_add_layernorm, NULL, 4,
                      {rnd(3, SHAPE(2, 3, 6), -2, 2), rnd(3, SHAPE(2, 3, 6), -2, 2),
                       rnd(1, SHAPE(6), 0.5, 1.5), rnd(1, SHAPE(6), -1, 1)},
                      15});
  gradcheck((gc_case){"add_layernorm (3,37) no bias, transposed a", f_add_layernorm, NULL, 4,
                      {rnd_transposed(2, SHAPE(3, 37), -2, 2), rnd(2, SHAPE(3, 37), -2, 2),
                       rnd(1, SHAPE(37), 0.5, 1.5), NULL},
                      7});
  gradcheck((gc_case){"add_layernorm b (5) broadcast", f_add_layernorm, NULL, 4,
                      {rnd(2, SHAPE(4, 5), -2, 2), rnd(1, SHAPE(5), -2, 2),
                       rnd(1, SHAPE(5), 0.5, 1.5), rnd(1, SHAPE(5), -1, 1)},
                      15});
  gradcheck((gc_case){"add_layernorm only the bias", f_add_layernorm, NULL, 4,
                      {rnd(2, SHAPE(4, 5), -2, 2), rnd(2, SHAPE(4, 5), -2, 2),
                       rnd(1, SHAPE(5), 0.5, 1.5), rnd(1, SHAPE(5), -1, 1)},
                      8});
}

/* Size-1 dimensions everywhere they can be; wider rows than a vector (layernorm, softmax) */
static void test_grad_size_one(void **state) {
  (void)state;
  rng_reset(64);
  gradcheck((gc_case){"matmul (1,1)@(1,3)", f_matmul, NULL, 2,
                      {rnd(2, SHAPE(1, 1), -1, 1), rnd(2, SHAPE(1, 3), -1, 1)}, 3});
  gradcheck((gc_case){"matmul (2,3,1)@(2,1,1)", f_matmul, NULL, 2,
                      {rnd(3, SHAPE(2, 3, 1), -1, 1), rnd(3, SHAPE(2, 1, 1), -1, 1)}, 3});
  gradcheck((gc_case){"linear K=1 N=1", f_linear, NULL, 3,
                      {rnd(2, SHAPE(3, 1), -1, 1), rnd(2, SHAPE(1, 1), -1, 1),
                       rnd(1, SHAPE(1), -1, 1)},
                      7});
  gradcheck((gc_case){"layernorm C=1 (zero gradients)", f_layernorm, NULL, 3,
                      {rnd(2, SHAPE(3, 1), -2, 2), rnd(1, SHAPE(1), 0.5, 1.5),
                       rnd(1, SHAPE(1), -1, 1)},
                      7});
  fsdp_tensor *wbase = rnd(1, SHAPE(74), 0.5, 1.5), *w; /* every second element: strided */
  assert_int_equal(fsdp_tensor_new_view(&w, wbase, 1, 1, SHAPE(37), SHAPE(2)), FSDP_OK);
  fsdp_tensor_release(wbase);
  gradcheck((gc_case){"layernorm (3,37), strided weight", f_layernorm, NULL, 3,
                      {rnd(2, SHAPE(3, 37), -2, 2), w, rnd(1, SHAPE(37), -1, 1)}, 7});
  gradcheck((gc_case){"softmax C=1", f_softmax, NULL, 1, {rnd(2, SHAPE(3, 1), -2, 2)}, 1});
  gradcheck((gc_case){"softmax (2,37)", f_softmax, NULL, 1, {rnd(2, SHAPE(2, 37), -2, 2)}, 1});
  static const int d0 = 0;
  gradcheck((gc_case){"softmax over a size-1 dim 0", f_softmax_dim, &d0, 1,
                      {rnd(2, SHAPE(1, 4), -2, 2)}, 1});
  static const sum_dim_ctx s1 = {1, false}, m1 = {1, true}, s0 = {0, true};
  gradcheck((gc_case){"sum over a size-1 dim", f_sum_dim, &s1, 1,
                      {rnd(3, SHAPE(2, 1, 3), -1, 1)}, 1});
  gradcheck((gc_case){"mean over a size-1 dim", f_sum_dim, &m1, 1,
                      {rnd(3, SHAPE(2, 1, 3), -1, 1)}, 1});
  gradcheck((gc_case){"mean dim 0 of a vector (to a scalar)", f_sum_dim, &s0, 1,
                      {rnd(1, SHAPE(5), -1, 1)}, 1});
  static const extreme_ctx mx1 = {1, true, true};
  gradcheck((gc_case){"max over a size-1 dim", f_extreme, &mx1, 1,
                      {rnd_distinct(3, SHAPE(2, 1, 3))}, 1});
  gradcheck((gc_case){"mul (2,3) op (1,1)", f_binary, &OP_MUL, 2,
                      {rnd_away(2, SHAPE(2, 3), 0.5, 1.5), rnd_away(2, SHAPE(1, 1), 0.5, 1.5)}, 3});
  gradcheck((gc_case){"div (1) op (2,3)", f_binary, &OP_DIV, 2,
                      {rnd_away(1, SHAPE(1), 0.5, 1.5), rnd_away(2, SHAPE(2, 3), 0.5, 1.5)}, 3});
  gradcheck((gc_case){"sub (0,4) op (4): b's gradient is 0", f_binary, &OP_SUB, 2,
                      {rnd(2, SHAPE(0, 4), -1, 1), rnd(1, SHAPE(4), -1, 1)}, 2});
  static const float z1[] = {0, 0, 0};
  static const int ign = -1;
  gradcheck((gc_case){"cross_entropy V=1", f_cross_entropy, &ign, 2,
                      {rnd(2, SHAPE(3, 1), -2, 2), from(1, SHAPE(3), z1)}, 1});
  static const float id3[] = {3};
  gradcheck((gc_case){"embedding of a 0-d id", f_embedding, NULL, 2,
                      {from(0, NULL, id3), rnd(2, SHAPE(5, 4), -1, 1)}, 2});
  gradcheck((gc_case){"embedding V=1", f_embedding, NULL, 2,
                      {from(1, SHAPE(3), z1), rnd(2, SHAPE(1, 4), -1, 1)}, 2});
  static const int64_t nl1[3] = {1, 2, 1};
  gradcheck((gc_case){"narrow to length 1", f_narrow, nl1, 1, {rnd(2, SHAPE(3, 4), -1, 1)}, 1});
  view_ctx v = {3, {2, 1, 3}};
  gradcheck((gc_case){"view adding a size-1 dim", f_view, &v, 1, {rnd(2, SHAPE(2, 3), -1, 1)}, 1});
  static const int nh2 = 2;
  gradcheck((gc_case){"attention B2 T1 C4 NH2", f_attention, &nh2, 1,
                      {rnd(3, SHAPE(2, 1, 12), -1, 1)}, 1});
  static const list_ctx d0n3 = {0, 3};
  gradcheck((gc_case){"cat with an empty piece", f_cat, &d0n3, 3,
                      {rnd(2, SHAPE(2, 3), -1, 1), rnd(2, SHAPE(0, 3), -1, 1),
                       rnd(2, SHAPE(1, 3), -1, 1)},
                      5});
}

/* Ids, targets and inputs as the other layouts and dtypes ops accept */
static void test_grad_layouts(void **state) {
  (void)state;
  rng_reset(65);
  static const float ids[] = {0, 4, 2, 2, 1, 4};
  gradcheck((gc_case){"embedding i64 ids", f_embedding, NULL, 2,
                      {i64(from(2, SHAPE(2, 3), ids)), rnd(2, SHAPE(5, 4), -1, 1)}, 2});
  gradcheck((gc_case){"embedding transposed ids", f_embedding, NULL, 2,
                      {i64(rnd_transposed(2, SHAPE(2, 3), 0, 4.99)), rnd(2, SHAPE(5, 4), -1, 1)},
                      2});
  static const int ign = -1, ign0 = 0;
  static const float t6[] = {0, 3, 0, 2, 4, 1}, t8[] = {2, 9, 0, 9, 4, 9, 1, 9};
  gradcheck((gc_case){"cross_entropy i64 targets", f_cross_entropy, &ign, 2,
                      {rnd(2, SHAPE(6, 5), -2, 2), i64(from(1, SHAPE(6), t6))}, 1});
  gradcheck((gc_case){"cross_entropy ignore_index 0 (a class)", f_cross_entropy, &ign0, 2,
                      {rnd(2, SHAPE(6, 5), -2, 2), from(1, SHAPE(6), t6)}, 1});
  fsdp_tensor *t8t = from(2, SHAPE(4, 2), t8), *tn;
  assert_int_equal(fsdp_tensor_narrow(&tn, t8t, 1, 0, 1), FSDP_OK); /* {2, 0, 4, 1}, strided */
  fsdp_tensor_release(t8t);
  gradcheck((gc_case){"cross_entropy strided targets (4,1)", f_cross_entropy, &ign, 2,
                      {rnd(3, SHAPE(4, 1, 5), -2, 2), tn}, 1});
  static const float p = 0.3f;
  gradcheck((gc_case){"dropout transposed x", f_dropout, &p, 1,
                      {rnd_transposed(2, SHAPE(8, 16), -1, 1)}, 1});
  gradcheck((gc_case){"mse only b, transposed", f_mse, NULL, 2,
                      {rnd(2, SHAPE(3, 4), -1, 1), rnd_transposed(2, SHAPE(3, 4), -1, 1)}, 2});
  gradcheck((gc_case){"mse of scalars", f_mse, NULL, 2,
                      {rnd(0, NULL, -1, 1), rnd(0, NULL, -1, 1)}, 3});
  fsdp_tensor *wide = rnd(3, SHAPE(3, 2, 15), -1, 1), *qkv, *qt;
  assert_int_equal(fsdp_tensor_narrow(&qkv, wide, 2, 3, 12), FSDP_OK);
  assert_int_equal(fsdp_tensor_transpose(&qt, qkv, 0, 1), FSDP_OK); /* (2, 3, 12), strided */
  fsdp_tensor_release(wide);
  fsdp_tensor_release(qkv);
  static const int nh2 = 2;
  gradcheck((gc_case){"attention transposed narrowed qkv", f_attention, &nh2, 1, {qt}, 1});
}

/* Inputs that already hold a gradient when the op's backward runs */
static void test_grad_accumulating(void **state) {
  (void)state;
  rng_reset(66);
  static const acc_op lin = ACC_LINEAR, bg = ACC_BIAS_GELU, att = ACC_ATTENTION,
                      ln = ACC_LAYERNORM, ce = ACC_CROSS_ENTROPY;
  gradcheck((gc_case){"linear, x's gradient accumulated", f_accumulating, &lin, 3,
                      {rnd(2, SHAPE(3, 5), -1, 1), rnd(2, SHAPE(4, 5), -1, 1),
                       rnd(1, SHAPE(4), -1, 1)},
                      7});
  gradcheck((gc_case){"bias_gelu, x's gradient accumulated", f_accumulating, &bg, 2,
                      {rnd(2, SHAPE(3, 5), -3, 3), rnd(1, SHAPE(5), -1, 1)}, 3});
  gradcheck((gc_case){"attention, qkv's gradient accumulated", f_accumulating, &att, 1,
                      {rnd(3, SHAPE(2, 3, 12), -1, 1)}, 1});
  gradcheck((gc_case){"layernorm, x's gradient accumulated", f_accumulating, &ln, 3,
                      {rnd(2, SHAPE(3, 5), -2, 2), rnd(1, SHAPE(5), 0.5, 1.5),
                       rnd(1, SHAPE(5), -1, 1)},
                      7});
  static const float t3[] = {2, -1, 4};
  gradcheck((gc_case){"cross_entropy, logits' gradient accumulated", f_accumulating, &ce, 2,
                      {rnd(2, SHAPE(3, 5), -2, 2), from(1, SHAPE(3), t3)}, 1});
  gradcheck((gc_case){"view of an addend sharing its gradient", f_view_of_shared, NULL, 2,
                      {rnd(2, SHAPE(3, 4), -1, 1), rnd(2, SHAPE(3, 4), -1, 1)}, 3});
}

/* ---- tape semantics ---------------------------------------------------------------------- */

static void test_used_twice(void **state) {
  (void)state;
  rng_reset(20);
  fsdp_tensor *x = rnd(1, SHAPE(5), -1, 1), *y, *z, *s;
  x->requires_grad = true;
  /* y = x * x ; z = y + x ; s = sum(z) => ds/dx = 2x + 1 */
  assert_int_equal(fsdp_op_binary(&y, x, x, FSDP_OP_MUL), FSDP_OK);
  assert_int_equal(fsdp_op_binary(&z, y, x, FSDP_OP_ADD), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&s, z), FSDP_OK);
  assert_int_equal(fsdp_tape_size(), 3);
  assert_int_equal(fsdp_backward(s, NULL), FSDP_OK);
  const float *xv = fsdp_tensor_data(x, "t"), *g = fsdp_tensor_data(x->grad, "t");
  for (int i = 0; i < 5; i++) assert_float_equal(g[i], 2 * xv[i] + 1, 1e-6);
  assert_null(y->grad);
  assert_null(z->grad);
  assert_null(s->grad);
  fsdp_tensor_release(y);
  fsdp_tensor_release(z);
  fsdp_tensor_release(s);
  fsdp_tensor_release(x);
}

/* A sum's addends that are activations take dout's buffer as their gradient (no copy); an
 * addend that later gets more gradient while the buffer is still shared writes into a copy.
 * a = 2p, b = 3q, m = a * w, s = a + b, u = s + m: backward reaches the adds first (a and b
 * share u's gradient), then m's product adds w into a's gradient while m and b still hold the
 * buffer: dp = 2 (1 + w), dq = 3. Writing into the shared buffer would give dq = 3 (1 + w). */
static void test_shared_addend_gradient(void **state) {
  (void)state;
  rng_reset(32);
  fsdp_tensor *p = rnd(1, SHAPE(7), -1, 1), *q = rnd(1, SHAPE(7), -1, 1);
  fsdp_tensor *w = rnd(1, SHAPE(7), -1, 1), *a, *b, *m, *s, *u, *l;
  p->requires_grad = q->requires_grad = true;
  assert_int_equal(fsdp_op_affine(&a, p, 2.0f, 0.0f), FSDP_OK);
  assert_int_equal(fsdp_op_affine(&b, q, 3.0f, 0.0f), FSDP_OK);
  assert_int_equal(fsdp_op_binary(&m, a, w, FSDP_OP_MUL), FSDP_OK);
  assert_int_equal(fsdp_op_binary(&s, a, b, FSDP_OP_ADD), FSDP_OK);
  assert_int_equal(fsdp_op_binary(&u, s, m, FSDP_OP_ADD), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&l, u), FSDP_OK);
  assert_int_equal(fsdp_backward(l, NULL), FSDP_OK);
  const float *wv = fsdp_tensor_data(w, "t");
  const float *gp = fsdp_tensor_data(p->grad, "t"), *gq = fsdp_tensor_data(q->grad, "t");
  for (int i = 0; i < 7; i++) {
    assert_float_equal(gp[i], 2 * (1 + wv[i]), 1e-6);
    assert_float_equal(gq[i], 3.0f, 1e-6);
  }
  assert_false(p->grad_shared || q->grad_shared);
  fsdp_tensor *all[] = {p, q, w, a, b, m, s, u, l};
  for (int i = 0; i < 9; i++) fsdp_tensor_release(all[i]);
}

/* fsdp_grad_share itself: only an activation without a gradient takes a buffer that fits it;
 * writing through fsdp_grad_acc copies while another holder is left (and fails cleanly, the
 * shared buffer kept, when the copy cannot be made), and writes in place once it is the last. */
static void test_grad_share(void **state) {
  (void)state;
  rng_reset(34);
  fsdp_tensor *x = rnd(2, SHAPE(3, 4), -1, 1), *a, *g = rnd(2, SHAPE(3, 4), -1, 1);
  fsdp_tensor *other = rnd(1, SHAPE(12), -1, 1);
  x->requires_grad = true;
  assert_false(fsdp_grad_share(x, g)); /* a leaf */
  assert_int_equal(fsdp_op_affine(&a, x, 1.0f, 0.0f), FSDP_OK);
  assert_false(fsdp_grad_share(a, other)); /* another shape */
  assert_true(fsdp_grad_share(a, g));
  assert_ptr_equal(a->grad, g);
  assert_false(fsdp_grad_share(a, g)); /* it has a gradient now */
  const float *gv = fsdp_tensor_data(g, "t");
  float before[12];
  memcpy(before, gv, sizeof before);
  /* the copy over the memory budget: an error, and a still holds the shared buffer */
  fsdp_mem_domain *d = fsdp_mem_domain_new();
  assert_non_null(d);
  fsdp_mem_domain_set(d);
  fsdp_mem_set_limit(d, 1);
  assert_null(fsdp_grad_acc(a));
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  assert_ptr_equal(a->grad, g);
  assert_true(a->grad_shared);
  fsdp_mem_set_limit(d, 0);
  /* g is still held here: a's first write goes into a copy of it */
  float *av = fsdp_grad_acc(a);
  assert_non_null(av);
  assert_ptr_not_equal(a->grad, g);
  assert_false(a->grad_shared);
  for (int i = 0; i < 12; i++) {
    assert_true(av[i] == before[i]);
    av[i] += 1.0f;
    assert_true(gv[i] == before[i]);
  }
  /* the last holder writes in place */
  fsdp_tensor *b;
  assert_int_equal(fsdp_op_affine(&b, x, 1.0f, 0.0f), FSDP_OK);
  assert_true(fsdp_grad_share(b, g));
  fsdp_tensor_release(g);
  assert_ptr_equal(fsdp_grad_acc(b), gv);
  assert_false(b->grad_shared);
  fsdp_tape_clear();
  fsdp_tensor *all[] = {x, a, b, other};
  for (int i = 0; i < 4; i++) fsdp_tensor_release(all[i]);
  fsdp_mem_domain_set(NULL);
  fsdp_mem_domain_free(d);
}

/* A linear's input gradient, when it is the input's first, is written by a GEMM into a buffer
 * that was never zero-filled; when the input already has a gradient, the linear adds to it.
 * Both orders give ds/dx = the column sums of w + 1 for s = sum(x + linear(x)). */
static void test_linear_first_gradient(void **state) {
  (void)state;
  rng_reset(31);
  fsdp_tensor *w = rnd(2, SHAPE(4, 4), -1, 1);
  const float *wv = fsdp_tensor_data(w, "t");
  for (int order = 0; order < 2; order++) {
    fsdp_tensor *x = rnd(2, SHAPE(3, 4), -1, 1), *y, *c, *z, *s;
    x->requires_grad = true;
    assert_int_equal(fsdp_op_affine(&c, x, 1.0f, 0.0f), FSDP_OK);
    assert_int_equal(fsdp_op_linear(&y, x, w, NULL), FSDP_OK);
    /* order 0: the add's backward reaches x first (x + linear(x) with x used directly);
     * order 1: the linear's does (the affine copy of x is recorded before the linear) */
    assert_int_equal(fsdp_op_binary(&z, order ? c : x, y, FSDP_OP_ADD), FSDP_OK);
    assert_int_equal(fsdp_op_sum(&s, z), FSDP_OK);
    assert_int_equal(fsdp_backward(s, NULL), FSDP_OK);
    const float *g = fsdp_tensor_data(x->grad, "t");
    for (int i = 0; i < 3; i++)
      for (int k = 0; k < 4; k++) {
        float want = 1.0f;
        for (int n = 0; n < 4; n++) want += wv[n * 4 + k];
        assert_float_equal(g[i * 4 + k], want, 1e-5);
      }
    fsdp_tensor *all[] = {x, y, c, z, s};
    for (int i = 0; i < 5; i++) fsdp_tensor_release(all[i]);
  }
  fsdp_tensor_release(w);
}

/* The GEMM that writes a first input gradient fails (bf16 through the conversion pass, whose f32
 * scratch is over the memory budget): the error comes back and the new gradient holds zeros,
 * never what the allocator left there. */
static void test_linear_first_gradient_failure(void **state) {
  (void)state;
  fsdp_cpu_bf16_gemm_force(0);
  fsdp_mem_domain *d = fsdp_mem_domain_new();
  assert_non_null(d);
  fsdp_mem_domain_set(d);
  enum { M = 64, K = 64, N = 64 };
  fsdp_tensor *x, *w, *y, *s;
  assert_int_equal(fsdp_tensor_new(&x, &fsdp_device_cpu, FSDP_DTYPE_BF16, 2, SHAPE(M, K),
                                   FSDP_ROLE_OTHER),
                   FSDP_OK);
  assert_int_equal(fsdp_tensor_new(&w, &fsdp_device_cpu, FSDP_DTYPE_BF16, 2, SHAPE(N, K),
                                   FSDP_ROLE_OTHER),
                   FSDP_OK);
  uint16_t *xv = fsdp_tensor_data(x, "t"), *wv = fsdp_tensor_data(w, "t");
  for (int i = 0; i < M * K; i++) xv[i] = fsdp_f32_to_bf16(0.01f * (float)(i % 7));
  for (int i = 0; i < N * K; i++) wv[i] = fsdp_f32_to_bf16(0.02f * (float)(i % 5));
  x->requires_grad = true;
  assert_int_equal(fsdp_op_linear(&y, x, w, NULL), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&s, y), FSDP_OK);
  const int64_t live = domain_live(d);
  /* room for y's and x's bf16 gradients (8 KiB each) and for the sum's backward (16 KiB of
   * scratch, given back), not for the GEMM's f32 copies (16 KiB each) on top of both gradients */
  fsdp_mem_set_limit(d, live + 28 * 1024);
  assert_int_equal(fsdp_backward(s, NULL), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  assert_non_null(x->grad);
  const uint16_t *g = fsdp_tensor_data(x->grad, "t");
  for (int i = 0; i < M * K; i++) assert_int_equal(g[i], 0);
  fsdp_mem_set_limit(d, 0);
  fsdp_tape_clear();
  fsdp_tensor *all[] = {x, w, y, s};
  for (int i = 0; i < 4; i++) fsdp_tensor_release(all[i]);
  fsdp_mem_domain_set(NULL);
  fsdp_mem_domain_free(d);
  fsdp_cpu_bf16_gemm_force(-1);
}

/* The same for bias + GELU's input gradient: bf16, the kernel's f32 copy of the bias over the
 * memory budget, and the new gradient comes back zero-filled with the error. */
static void test_bias_gelu_first_gradient_failure(void **state) {
  (void)state;
  fsdp_mem_domain *d = fsdp_mem_domain_new();
  assert_non_null(d);
  fsdp_mem_domain_set(d);
  enum { C = 2048 };
  const int64_t u = C * 2; /* bytes of one bf16 row */
  fsdp_tensor *x, *b, *y, *s;
  assert_int_equal(fsdp_tensor_new(&x, &fsdp_device_cpu, FSDP_DTYPE_BF16, 2, SHAPE(1, C),
                                   FSDP_ROLE_OTHER),
                   FSDP_OK);
  assert_int_equal(fsdp_tensor_new(&b, &fsdp_device_cpu, FSDP_DTYPE_BF16, 1, SHAPE(C),
                                   FSDP_ROLE_OTHER),
                   FSDP_OK);
  uint16_t *xv = fsdp_tensor_data(x, "t");
  for (int i = 0; i < C; i++) xv[i] = fsdp_f32_to_bf16(0.01f * (float)(i % 7));
  x->requires_grad = true;
  assert_int_equal(fsdp_op_bias_gelu(&y, x, b), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&s, y), FSDP_OK);
  const int64_t live = domain_live(d);
  /* the sum's backward needs y's gradient and f32 scratch (3 rows' bytes at once), x's new
   * gradient one more row, and the bias's f32 copy two: one too many */
  fsdp_mem_set_limit(d, live + 3 * u + 1024);
  assert_int_equal(fsdp_backward(s, NULL), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  assert_non_null(x->grad);
  const uint16_t *g = fsdp_tensor_data(x->grad, "t");
  for (int i = 0; i < C; i++) assert_int_equal(g[i], 0);
  fsdp_mem_set_limit(d, 0);
  fsdp_tape_clear();
  fsdp_tensor *all[] = {x, b, y, s};
  for (int i = 0; i < 4; i++) fsdp_tensor_release(all[i]);
  fsdp_mem_domain_set(NULL);
  fsdp_mem_domain_free(d);
}

/* A hook that notes a tensor's gradient buffer when it fires, and can hold a reference to it. */
typedef struct {
  fsdp_tensor *watch;
  const void *data; /* watch's gradient's data when the hook fired (NULL: none) */
  bool hold;
  fsdp_tensor *held;
} grad_seen;

static int grad_seen_fn(void *p) {
  grad_seen *u = p;
  u->data = u->watch->grad ? fsdp_tensor_data(u->watch->grad, "t") : NULL;
  if (u->hold && u->watch->grad) {
    u->held = u->watch->grad;
    fsdp_tensor_retain(u->held);
  }
  return FSDP_OK;
}

/* p (leaf) -> x = p + 0 -> [after] y = bias_gelu(x, b) -> [before] z = y * w -> sum. `before`
 * fires between the product's backward and bias + GELU's, `after` just after bias + GELU's. */
static void bias_gelu_chain(fsdp_tensor *p, fsdp_tensor *b, fsdp_tensor *w, grad_seen *before,
                            grad_seen *after) {
  fsdp_tensor *x, *y, *z, *l;
  assert_int_equal(fsdp_op_affine(&x, p, 1.0f, 0.0f), FSDP_OK);
  after->watch = x;
  assert_int_equal(fsdp_tape_hook(grad_seen_fn, after, NULL), FSDP_OK);
  assert_int_equal(fsdp_op_bias_gelu(&y, x, b), FSDP_OK);
  before->watch = y;
  assert_int_equal(fsdp_tape_hook(grad_seen_fn, before, NULL), FSDP_OK);
  assert_int_equal(fsdp_op_binary(&z, y, w, FSDP_OP_MUL), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&l, z), FSDP_OK);
  assert_int_equal(fsdp_backward(l, NULL), FSDP_OK);
  fsdp_tensor *all[] = {x, y, z, l};
  for (int i = 0; i < 4; i++) fsdp_tensor_release(all[i]);
}

/* bias + GELU's input gradient is written over its output's gradient when nothing else holds
 * that (the same buffer before and after its backward), and into a buffer of its own when
 * something does (here the hook's reference); both give the same bits, and the held gradient
 * keeps its values. */
static void test_bias_gelu_gradient_over_output(void **state) {
  (void)state;
  rng_reset(35);
  enum { N = 6, C = 40 };
  fsdp_tensor *p = rnd(2, SHAPE(N, C), -3, 3), *b = rnd(1, SHAPE(C), -1, 1);
  fsdp_tensor *w = rnd(2, SHAPE(N, C), -2, 2);
  p->requires_grad = b->requires_grad = true;
  grad_seen before = {0}, after = {0};
  bias_gelu_chain(p, b, w, &before, &after);
  assert_non_null(before.data);
  assert_ptr_equal(after.data, before.data);
  float dp[N * C], db[C];
  memcpy(dp, fsdp_tensor_data(p->grad, "t"), sizeof dp);
  memcpy(db, fsdp_tensor_data(b->grad, "t"), sizeof db);
  fsdp_tensor_set_grad(p, NULL);
  fsdp_tensor_set_grad(b, NULL);

  grad_seen held = {.hold = true}, after2 = {0};
  bias_gelu_chain(p, b, w, &held, &after2);
  assert_non_null(held.held);
  assert_non_null(after2.data);
  assert_ptr_not_equal(after2.data, held.data);
  const float *g = fsdp_tensor_data(held.held, "t"), *wv = fsdp_tensor_data(w, "t");
  for (int i = 0; i < N * C; i++) assert_true(g[i] == wv[i]); /* d sum(y * w) / dy */
  assert_memory_equal(fsdp_tensor_data(p->grad, "t"), dp, sizeof dp);
  assert_memory_equal(fsdp_tensor_data(b->grad, "t"), db, sizeof db);
  fsdp_tensor *all[] = {p, b, w, held.held};
  for (int i = 0; i < 4; i++) fsdp_tensor_release(all[i]);
}

/* The same failure when the input gradient was to be written over the output's: the bias's
 * gradient over the memory budget, and x's gradient (the output's buffer, which held dout)
 * comes back zero-filled. x is an activation whose own node already ran, so its gradient
 * outlives the failed backward. */
static void test_bias_gelu_gradient_over_output_failure(void **state) {
  (void)state;
  rng_reset(36);
  enum { N = 4, C = 64 };
  fsdp_mem_domain *d = fsdp_mem_domain_new();
  assert_non_null(d);
  fsdp_mem_domain_set(d);
  fsdp_tensor *p = rnd(2, SHAPE(N, C), -1, 1), *b = rnd(1, SHAPE(C), -1, 1);
  fsdp_tensor *g = rnd(2, SHAPE(N, C), 1, 2), *x, *s, *y;
  p->requires_grad = b->requires_grad = true;
  assert_int_equal(fsdp_op_affine(&x, p, 1.0f, 0.0f), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&s, x), FSDP_OK);
  assert_int_equal(fsdp_backward(s, NULL), FSDP_OK); /* x's node is gone */
  assert_null(x->grad);
  assert_int_equal(fsdp_op_bias_gelu(&y, x, b), FSDP_OK);
  const int64_t live = domain_live(d);
  /* y's gradient fits, b's does not */
  fsdp_mem_set_limit(d, live + N * C * 4 + C * 2);
  assert_int_equal(fsdp_backward(y, g), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  assert_non_null(strstr(fsdp_error_msg(), "bias_gelu"));
  assert_non_null(x->grad);
  const float *xg = fsdp_tensor_data(x->grad, "t");
  for (int i = 0; i < N * C; i++) assert_true(xg[i] == 0.0f);
  assert_null(b->grad);
  fsdp_mem_set_limit(d, 0);
  fsdp_tensor *all[] = {p, b, g, x, s, y};
  for (int i = 0; i < 6; i++) fsdp_tensor_release(all[i]);
  fsdp_mem_domain_set(NULL);
  fsdp_mem_domain_free(d);
}

/* And for attention's: its workspace over the memory budget, qkv's new gradient zero-filled. */
static void test_attention_first_gradient_failure(void **state) {
  (void)state;
  rng_reset(33);
  fsdp_mem_domain *d = fsdp_mem_domain_new();
  assert_non_null(d);
  fsdp_mem_domain_set(d);
  enum { T = 32, C = 8, NH = 2 };
  fsdp_tensor *qkv = rnd(3, SHAPE(1, T, 3 * C), -1, 1), *y, *s;
  qkv->requires_grad = true;
  assert_int_equal(fsdp_op_attention(&y, qkv, NH), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&s, y), FSDP_OK);
  const int64_t live = domain_live(d);
  /* y's gradient (1 KiB), qkv's (3 KiB) and some room; not the (NH, T, T) workspace (8 KiB) */
  fsdp_mem_set_limit(d, live + 6 * 1024);
  assert_int_equal(fsdp_backward(s, NULL), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  assert_non_null(qkv->grad);
  const float *g = fsdp_tensor_data(qkv->grad, "t");
  for (int i = 0; i < T * 3 * C; i++) assert_true(g[i] == 0.0f);
  fsdp_mem_set_limit(d, 0);
  fsdp_tape_clear();
  fsdp_tensor *all[] = {qkv, y, s};
  for (int i = 0; i < 3; i++) fsdp_tensor_release(all[i]);
  fsdp_mem_domain_set(NULL);
  fsdp_mem_domain_free(d);
}

/* The fused residual add + layernorm failing (bf16: the kernel's f32 copies of the weight and
 * bias over the memory budget; then the outputs themselves): an error naming the budget, both
 * results NULL, nothing recorded and nothing left allocated. */
static void test_add_layernorm_failure(void **state) {
  (void)state;
  fsdp_mem_domain *d = fsdp_mem_domain_new();
  assert_non_null(d);
  fsdp_mem_domain_set(d);
  enum { C = 2048 };
  fsdp_tensor *x, *a, *w, *b;
  fsdp_tensor **all[] = {&x, &a, &w, &b};
  for (int i = 0; i < 4; i++)
    assert_int_equal(fsdp_tensor_new(all[i], &fsdp_device_cpu, FSDP_DTYPE_BF16, i < 2 ? 2 : 1,
                                     i < 2 ? SHAPE(1, C) : SHAPE(C), FSDP_ROLE_OTHER),
                     FSDP_OK);
  x->requires_grad = true;
  const int64_t tape = fsdp_tape_size();
  const int64_t live = domain_live(d);
  /* room for the outputs (4 KiB each, mean and rstd), not for the 16 KiB of f32 copies; then
   * not even for the outputs */
  const int64_t room[2] = {8 * 1024 + 1024, 1024};
  for (int k = 0; k < 2; k++) {
    fsdp_mem_set_limit(d, live + room[k]);
    fsdp_tensor *s = (fsdp_tensor *)1, *y = (fsdp_tensor *)1;
    assert_int_equal(fsdp_op_add_layernorm(&s, &y, x, a, w, b, 1e-5f), FSDP_ERR);
    assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
    /* the kernel's scratch first, then the sum (new_out names the op) */
    assert_int_equal(strncmp(fsdp_error_msg(), "add: ", 5) == 0, k == 1);
    assert_null(s);
    assert_null(y);
    assert_int_equal(fsdp_tape_size(), tape);
    fsdp_mem_set_limit(d, 0);
    assert_int_equal(domain_live(d), live);
  }
  /* with room it works, recorded as the add and the layernorm */
  fsdp_tensor *s, *y;
  assert_int_equal(fsdp_op_add_layernorm(&s, &y, x, a, w, b, 1e-5f), FSDP_OK);
  assert_int_equal(fsdp_tape_size(), tape + 2);
  fsdp_tape_clear();
  fsdp_tensor_release(s);
  fsdp_tensor_release(y);
  for (int i = 0; i < 4; i++) fsdp_tensor_release(*all[i]);
  fsdp_mem_domain_set(NULL);
  fsdp_mem_domain_free(d);
}

static void test_accumulate_and_free(void **state) {
  (void)state;
  rng_reset(21);
  fsdp_tensor *w = rnd(2, SHAPE(3, 4), -1, 1), *x = rnd(2, SHAPE(2, 4), -1, 1);
  w->requires_grad = true;
  int64_t act0 = live_bytes(FSDP_ROLE_ACTIVATIONS);
  float first[12];
  for (int round = 0; round < 2; round++) {
    fsdp_tensor *h, *a, *l;
    assert_int_equal(fsdp_op_linear(&h, x, w, NULL), FSDP_OK);
    assert_int_equal(fsdp_op_unary(&a, h, FSDP_UNARY_TANH), FSDP_OK);
    assert_int_equal(fsdp_op_sum(&l, a), FSDP_OK);
    assert_int_equal(fsdp_backward(l, NULL), FSDP_OK);
    assert_int_equal(fsdp_tape_size(), 0);
    assert_null(h->grad); /* non-leaf gradients are freed after backward */
    assert_null(a->grad);
    assert_null(x->grad); /* x does not require a gradient */
    assert_non_null(w->grad);
    const float *g = fsdp_tensor_data(w->grad, "t");
    if (round == 0) memcpy(first, g, sizeof first);
    else
      for (int i = 0; i < 12; i++) assert_float_equal(g[i], 2 * first[i], 1e-6);
    fsdp_tensor_release(h);
    fsdp_tensor_release(a);
    fsdp_tensor_release(l);
  }
  /* every activation (outputs, saved tensors, non-leaf gradients) is gone */
  assert_int_equal(live_bytes(FSDP_ROLE_ACTIVATIONS), act0);
  assert_int_equal(live_bytes(FSDP_ROLE_GRADS) >= 12 * 4, true);
  int64_t grads = live_bytes(FSDP_ROLE_GRADS);
  fsdp_tensor_release(w);
  assert_int_equal(live_bytes(FSDP_ROLE_GRADS), grads - 12 * 4);
  fsdp_tensor_release(x);
}

static void test_no_grad(void **state) {
  (void)state;
  rng_reset(22);
  fsdp_tensor *x = rnd(2, SHAPE(2, 3), -1, 1), *y, *z;
  x->requires_grad = true;
  bool prev = fsdp_set_grad_enabled(false);
  assert_true(prev);
  assert_false(fsdp_grad_enabled());
  assert_int_equal(fsdp_op_unary(&y, x, FSDP_UNARY_EXP), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&z, y), FSDP_OK);
  assert_int_equal(fsdp_tape_size(), 0);
  assert_false(y->requires_grad);
  assert_true(y->is_leaf);
  EXPECT_ERR(fsdp_backward(z, NULL), "backward", "does not require a gradient");
  assert_true(fsdp_set_grad_enabled(prev) == false);
  assert_true(fsdp_grad_enabled());
  fsdp_tensor_release(y);
  fsdp_tensor_release(z);
  /* an op whose inputs need no gradient records nothing either */
  x->requires_grad = false;
  assert_int_equal(fsdp_op_unary(&y, x, FSDP_UNARY_EXP), FSDP_OK);
  assert_int_equal(fsdp_tape_size(), 0);
  fsdp_tensor_release(y);
  fsdp_tensor_release(x);
}

static void test_backward_errors(void **state) {
  (void)state;
  rng_reset(23);
  fsdp_tensor *x = rnd(2, SHAPE(2, 3), -1, 1), *y, *s;
  x->requires_grad = true;
  assert_int_equal(fsdp_op_unary(&y, x, FSDP_UNARY_TANH), FSDP_OK);
  /* non-scalar root without a gradient */
  EXPECT_ERR(fsdp_backward(y, NULL), "backward", "(2, 3)", "6 elements");
  assert_int_equal(fsdp_tape_size(), 1); /* a refused backward leaves the tape alone */
  /* gradient of the wrong shape */
  fsdp_tensor *g = rnd(1, SHAPE(6), -1, 1);
  EXPECT_ERR(fsdp_backward(y, g), "backward", "(6)", "(2, 3)");
  fsdp_tensor_release(g);
  assert_int_equal(fsdp_op_sum(&s, y), FSDP_OK);
  assert_int_equal(fsdp_backward(s, NULL), FSDP_OK);
  /* twice */
  EXPECT_ERR(fsdp_backward(s, NULL), "backward", "already");
  assert_null(s->grad);
  /* twice, with something else recorded in between: still an error, not a silent no-op */
  fsdp_tensor *other;
  assert_int_equal(fsdp_op_unary(&other, x, FSDP_UNARY_RELU), FSDP_OK);
  assert_int_equal(fsdp_tape_size(), 1);
  EXPECT_ERR(fsdp_backward(s, NULL), "backward", "already");
  assert_int_equal(fsdp_tape_size(), 1);
  fsdp_tape_clear();
  fsdp_tensor_release(other);
  /* backward from a leaf that requires a gradient: d(x)/d(x) */
  fsdp_tensor *one = rnd(0, NULL, -1, 1);
  one->requires_grad = true;
  assert_int_equal(fsdp_backward(one, NULL), FSDP_OK);
  assert_float_equal(((float *)fsdp_tensor_data(one->grad, "t"))[0], 1.0f, 0);
  fsdp_tensor_release(one);
  fsdp_tensor_release(y);
  fsdp_tensor_release(s);
  fsdp_tensor_release(x);
}

/* A tensor saved for backward and modified in place afterwards is refused, not used. */
static void test_inplace_after_forward(void **state) {
  (void)state;
  rng_reset(27);
  fsdp_tensor *w = rnd(2, SHAPE(3, 4), -1, 1), *x = rnd(2, SHAPE(2, 4), -1, 1), *h, *l;
  w->requires_grad = true;
  /* the input linear saved (x itself: contiguous) */
  assert_int_equal(fsdp_op_linear(&h, x, w, NULL), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&l, h), FSDP_OK);
  assert_int_equal(fsdp_tensor_fill(x, 0.0f), FSDP_OK);
  EXPECT_ERR(fsdp_backward(l, NULL), "backward of linear", "(2, 4)", "modified in place");
  assert_int_equal(fsdp_tape_size(), 0);
  fsdp_tensor_release(h);
  fsdp_tensor_release(l);
  /* the same written through another tensor over x's memory: x's own version stays */
  fsdp_tensor *xv;
  assert_int_equal(fsdp_op_linear(&h, x, w, NULL), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&l, h), FSDP_OK);
  assert_int_equal(fsdp_tensor_new_view(&xv, x, 4, 1, SHAPE(4), (int64_t[]){1}), FSDP_OK);
  const uint64_t xver = x->version;
  assert_int_equal(fsdp_tensor_fill(xv, 1.0f), FSDP_OK);
  assert_int_equal(x->version, xver);
  EXPECT_ERR(fsdp_backward(l, NULL), "backward of linear", "(2, 4)",
             "modified in place through another tensor over its memory");
  assert_int_equal(fsdp_tape_size(), 0);
  fsdp_tensor_release(xv);
  fsdp_tensor_release(h);
  fsdp_tensor_release(l);
  /* x moved to another storage since (as FSDP moves a parameter between its shard and a
   * gathered copy) is not a write: that storage's versions are not the recorded one's */
  fsdp_tensor *x2;
  assert_int_equal(fsdp_tensor_clone(&x2, x), FSDP_OK);
  assert_int_equal(fsdp_op_linear(&h, x, w, NULL), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&l, h), FSDP_OK);
  assert_int_equal(fsdp_tensor_fill(x2, 1.0f), FSDP_OK); /* its storage's version moves */
  fsdp_tensor_set_storage(x, x2->storage, 0);
  assert_int_equal(fsdp_backward(l, NULL), FSDP_OK);
  fsdp_tensor_release(x2);
  fsdp_tensor_release(h);
  fsdp_tensor_release(l);
  fsdp_tensor_set_grad(w, NULL);
  /* an output exp reads in its backward */
  fsdp_tensor *e, *s;
  assert_int_equal(fsdp_op_unary(&e, w, FSDP_UNARY_EXP), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&s, e), FSDP_OK);
  assert_int_equal(fsdp_tensor_fill(e, 1.0f), FSDP_OK);
  EXPECT_ERR(fsdp_backward(s, NULL), "backward of exp", "(3, 4)", "modified in place");
  fsdp_tensor_release(e);
  fsdp_tensor_release(s);
  /* an output mul does not read: modifying it is fine and the gradient is exact */
  fsdp_tensor_set_grad(w, NULL);
  fsdp_tensor *m;
  assert_int_equal(fsdp_op_affine(&m, w, 3.0f, 0.0f), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&s, m), FSDP_OK);
  assert_int_equal(fsdp_tensor_fill(m, 7.0f), FSDP_OK);
  assert_int_equal(fsdp_backward(s, NULL), FSDP_OK);
  for (int i = 0; i < 12; i++) assert_float_equal(((float *)fsdp_tensor_data(w->grad, "t"))[i], 3.0f, 0);
  fsdp_tensor_release(m);
  fsdp_tensor_release(s);
  fsdp_tensor_release(w);
  fsdp_tensor_release(x);
}

/* ---- hooks ------------------------------------------------------------------------------- */

typedef struct {
  int id;
  int *order; /* shared log of firing order */
  int *n_fired;
  fsdp_tensor *watch_have, *watch_none; /* must / must not have a gradient when it fires */
  bool ok;
  int fail;     /* return an error when nonzero */
  int *n_freed;
} hook_ud;

static int hook_fn(void *p) {
  hook_ud *u = p;
  u->order[(*u->n_fired)++] = u->id;
  u->ok = (!u->watch_have || u->watch_have->grad) && (!u->watch_none || !u->watch_none->grad);
  if (u->fail) return fsdp_error("hook %d refused", u->id);
  return FSDP_OK;
}

static void hook_free(void *p) {
  hook_ud *u = p;
  (*u->n_freed)++;
}

static void test_hooks(void **state) {
  (void)state;
  rng_reset(24);
  int order[4] = {0}, fired = 0, freed = 0;
  fsdp_tensor *x = rnd(2, SHAPE(2, 3), -1, 1), *h1, *h2, *h3, *l;
  x->requires_grad = true;
  hook_ud a = {.id = 1, .order = order, .n_fired = &fired, .n_freed = &freed};
  hook_ud b = {.id = 2, .order = order, .n_fired = &fired, .n_freed = &freed};
  assert_int_equal(fsdp_op_unary(&h1, x, FSDP_UNARY_TANH), FSDP_OK);
  assert_int_equal(fsdp_tape_hook(hook_fn, &a, hook_free), FSDP_OK); /* between h1 and h2 */
  assert_int_equal(fsdp_op_unary(&h2, h1, FSDP_UNARY_EXP), FSDP_OK);
  assert_int_equal(fsdp_tape_hook(hook_fn, &b, hook_free), FSDP_OK); /* between h2 and h3 */
  assert_int_equal(fsdp_op_affine(&h3, h2, 2.0f, 0.0f), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&l, h3), FSDP_OK);
  assert_int_equal(fsdp_tape_size(), 6);
  /* when b fires, h2's gradient is complete and h1's not started; when a fires, h1 has one
   * and x does not yet */
  a.watch_have = h1;
  a.watch_none = x;
  b.watch_have = h2;
  b.watch_none = h1;
  assert_int_equal(fsdp_backward(l, NULL), FSDP_OK);
  assert_int_equal(fired, 2);
  assert_int_equal(order[0], 2);
  assert_int_equal(order[1], 1);
  assert_true(a.ok);
  assert_true(b.ok);
  assert_int_equal(freed, 2); /* each ud freed once, after it ran */
  assert_int_equal(fsdp_tape_size(), 0);
  assert_non_null(x->grad);
  fsdp_tensor_release(h1);
  fsdp_tensor_release(h2);
  fsdp_tensor_release(h3);
  fsdp_tensor_release(l);

  /* cleared without backward: not run, but freed */
  fired = freed = 0;
  assert_int_equal(fsdp_op_unary(&h1, x, FSDP_UNARY_TANH), FSDP_OK);
  assert_int_equal(fsdp_tape_hook(hook_fn, &a, hook_free), FSDP_OK);
  assert_int_equal(fsdp_tape_hook(hook_fn, &b, hook_free), FSDP_OK);
  fsdp_tape_clear();
  assert_int_equal(fired, 0);
  assert_int_equal(freed, 2);
  assert_int_equal(fsdp_tape_size(), 0);
  fsdp_tensor_release(h1);

  /* a hook with no free function */
  fired = freed = 0;
  assert_int_equal(fsdp_tape_hook(hook_fn, &a, NULL), FSDP_OK);
  fsdp_tape_clear();
  assert_int_equal(freed, 0);

  /* a failing hook fails backward with its message, and the tape is dropped (freeing uds) */
  fired = freed = 0;
  fsdp_tensor_set_grad(x, NULL);
  a.fail = 1;
  a.watch_have = a.watch_none = b.watch_have = b.watch_none = NULL;
  assert_int_equal(fsdp_op_unary(&h1, x, FSDP_UNARY_TANH), FSDP_OK);
  assert_int_equal(fsdp_tape_hook(hook_fn, &b, hook_free), FSDP_OK);
  assert_int_equal(fsdp_tape_hook(hook_fn, &a, hook_free), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&l, h1), FSDP_OK);
  EXPECT_ERR(fsdp_backward(l, NULL), "hook", "hook 1 refused");
  assert_int_equal(fired, 1); /* b never ran */
  assert_int_equal(freed, 2);
  assert_int_equal(fsdp_tape_size(), 0);
  assert_null(h1->grad); /* nothing half-computed left on non-leaves */
  fsdp_tensor_release(h1);
  fsdp_tensor_release(l);
  fsdp_tensor_release(x);
}

/* A hook that runs ops and tries a nested backward while backward runs. */
typedef struct {
  fsdp_tensor *x; /* requires a gradient */
  bool grad_was_on, op_recorded, ok;
  int nested_rc;
  char nested_msg[256];
} busy_ud;

static int busy_hook(void *p) {
  busy_ud *u = p;
  u->grad_was_on = fsdp_grad_enabled();
  int64_t before = fsdp_tape_size();
  fsdp_tensor *y, *s;
  u->ok = fsdp_op_unary(&y, u->x, FSDP_UNARY_EXP) == FSDP_OK &&
          fsdp_op_sum(&s, y) == FSDP_OK;
  u->op_recorded = fsdp_tape_size() != before || y->requires_grad;
  u->nested_rc = fsdp_backward(s, NULL);
  snprintf(u->nested_msg, sizeof u->nested_msg, "%s", fsdp_error_msg());
  fsdp_tensor_release(y);
  fsdp_tensor_release(s);
  return FSDP_OK;
}

static void test_hook_runs_ops(void **state) {
  (void)state;
  rng_reset(28);
  fsdp_tensor *x = rnd(1, SHAPE(3), -1, 1), *h, *l;
  x->requires_grad = true;
  busy_ud u = {.x = x};
  assert_int_equal(fsdp_op_unary(&h, x, FSDP_UNARY_TANH), FSDP_OK);
  assert_int_equal(fsdp_tape_hook(busy_hook, &u, NULL), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&l, h), FSDP_OK);
  assert_int_equal(fsdp_backward(l, NULL), FSDP_OK);
  assert_true(u.ok);
  assert_false(u.grad_was_on);
  assert_false(u.op_recorded);
  assert_int_equal(u.nested_rc, FSDP_ERR);
  assert_non_null(strstr(u.nested_msg, "while a backward is running"));
  assert_true(fsdp_grad_enabled()); /* restored */
  assert_int_equal(fsdp_tape_size(), 0);
  assert_non_null(x->grad);
  fsdp_tensor_release(h);
  fsdp_tensor_release(l);
  fsdp_tensor_release(x);
}

static void test_tape_clear_frees_activations(void **state) {
  (void)state;
  rng_reset(25);
  fsdp_tensor *w = rnd(2, SHAPE(8, 8), -1, 1), *wl = rnd(1, SHAPE(8), 0.5, 1.5);
  w->requires_grad = true;
  wl->requires_grad = true;
  int64_t act0 = live_bytes(FSDP_ROLE_ACTIVATIONS);
  fsdp_tensor *x = rnd(3, SHAPE(2, 4, 24), -1, 1), *qkv_t, *a, *h, *n, *g, *l;
  static const float tg[] = {0, 1, 2, 3, 4, 5, 6, 7};
  fsdp_tensor *t = from(2, SHAPE(4, 2), tg);
  x->requires_grad = true;
  /* a transposed input makes ops save contiguous copies: those must go too */
  assert_int_equal(fsdp_op_transpose(&qkv_t, x, 0, 1), FSDP_OK);
  assert_int_equal(fsdp_op_attention(&a, qkv_t, 2), FSDP_OK);
  assert_int_equal(fsdp_op_linear(&h, a, w, NULL), FSDP_OK);
  assert_int_equal(fsdp_op_layernorm(&n, h, wl, NULL, 1e-5f), FSDP_OK);
  assert_int_equal(fsdp_op_unary(&g, n, FSDP_UNARY_GELU), FSDP_OK);
  assert_int_equal(fsdp_op_cross_entropy(&l, g, t, -1), FSDP_OK);
  assert_true(fsdp_tape_size() >= 5);
  /* drop our references: only the tape keeps the graph alive now */
  fsdp_tensor_release(qkv_t);
  fsdp_tensor_release(a);
  fsdp_tensor_release(h);
  fsdp_tensor_release(n);
  fsdp_tensor_release(g);
  int64_t act1 = live_bytes(FSDP_ROLE_ACTIVATIONS);
  fsdp_tensor_release(x);
  fsdp_tensor_release(t);
  fsdp_tensor_release(l);
  assert_true(act1 > act0);
  fsdp_tape_clear();
  assert_int_equal(fsdp_tape_size(), 0);
  assert_int_equal(live_bytes(FSDP_ROLE_ACTIVATIONS), act0);
  fsdp_tensor_release(w);
  fsdp_tensor_release(wl);
}

/* Graphs whose results were all dropped are freed by fsdp_tape_prune; live ones stay whole. */
static void test_prune(void **state) {
  (void)state;
  rng_reset(29);
  int64_t act0 = live_bytes(FSDP_ROLE_ACTIVATIONS);
  fsdp_tensor *x = rnd(2, SHAPE(4, 5), -1, 1), *h1, *h2, *h3;
  x->requires_grad = true;
  int fired = 0, freed = 0, order[4];
  hook_ud u = {.id = 1, .order = order, .n_fired = &fired, .n_freed = &freed};
  assert_int_equal(fsdp_op_unary(&h1, x, FSDP_UNARY_TANH), FSDP_OK);
  assert_int_equal(fsdp_tape_hook(hook_fn, &u, hook_free), FSDP_OK);
  assert_int_equal(fsdp_op_unary(&h2, h1, FSDP_UNARY_EXP), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&h3, h2), FSDP_OK);
  assert_int_equal(fsdp_tape_prune(), 0); /* everything is held */
  fsdp_tensor_release(h2);                /* held by the sum node still */
  assert_int_equal(fsdp_tape_prune(), 0);
  fsdp_tensor_release(h3); /* now sum and exp are unreachable; tanh's output is held */
  assert_int_equal(fsdp_tape_prune(), 2);
  assert_int_equal(fsdp_tape_size(), 2); /* tanh and the hook */
  assert_int_equal(freed, 0);
  /* the surviving graph still works */
  fsdp_tensor *s;
  assert_int_equal(fsdp_op_sum(&s, h1), FSDP_OK);
  assert_int_equal(fsdp_backward(s, NULL), FSDP_OK);
  assert_int_equal(fired, 1);
  const float *xv = fsdp_tensor_data(x, "t"), *g = fsdp_tensor_data(x->grad, "t");
  for (int i = 0; i < 20; i++) {
    float t = tanhf(xv[i]);
    assert_float_equal(g[i], 1 - t * t, 1e-6);
  }
  fsdp_tensor_release(s);
  fsdp_tensor_release(h1);
  /* dropped results never pile up: the tape prunes itself as it grows */
  int64_t most = 0;
  for (int i = 0; i < 10000; i++) {
    fsdp_tensor *o;
    assert_int_equal(fsdp_op_unary(&o, x, FSDP_UNARY_EXP), FSDP_OK);
    fsdp_tensor_release(o);
    if (fsdp_tape_size() > most) most = fsdp_tape_size();
  }
  assert_true(most <= 4096);
  fsdp_tape_clear();
  fsdp_tensor_release(x);
  assert_int_equal(live_bytes(FSDP_ROLE_ACTIVATIONS), act0);
  /* a cleared tape has no array: pruning it moves nothing (UBSan traps a memmove from NULL,
   * even of 0 bytes, in the FSDP_SANITIZE build) */
  assert_int_equal(fsdp_tape_prune(), 0);
  assert_int_equal(fsdp_tape_size(), 0);
}

static void test_detach(void **state) {
  (void)state;
  rng_reset(26);
  fsdp_tensor *x = rnd(2, SHAPE(2, 3), -1, 1), *y, *d, *z;
  x->requires_grad = true;
  assert_int_equal(fsdp_op_unary(&y, x, FSDP_UNARY_EXP), FSDP_OK);
  assert_int_equal(fsdp_op_detach(&d, y), FSDP_OK);
  assert_false(d->requires_grad);
  assert_true(d->is_leaf);
  assert_ptr_equal(fsdp_tensor_data(d, "t"), fsdp_tensor_data(y, "t"));
  fsdp_tape_clear();
  assert_int_equal(fsdp_op_unary(&z, d, FSDP_UNARY_EXP), FSDP_OK);
  assert_int_equal(fsdp_tape_size(), 0);
  fsdp_tensor_release(x);
  fsdp_tensor_release(y);
  fsdp_tensor_release(d);
  fsdp_tensor_release(z);
}

/* ---- error paths ---------------------------------------------------------------------------- */

static void test_errors_shapes(void **state) {
  (void)state;
  rng_reset(30);
  int64_t act0 = live_bytes(FSDP_ROLE_ACTIVATIONS);
  fsdp_tensor *o = NULL;
  fsdp_tensor *a23 = rnd(2, SHAPE(2, 3), -1, 1), *b4 = rnd(1, SHAPE(4), -1, 1),
              *b45 = rnd(2, SHAPE(4, 5), -1, 1), *b234 = rnd(3, SHAPE(2, 3, 4), -1, 1),
              *b345 = rnd(3, SHAPE(3, 4, 5), -1, 1), *s = rnd(0, NULL, -1, 1);
  a23->requires_grad = true; /* errors must not record anything either */

  const char *bn[] = {"add", "sub", "mul", "div"};
  for (int i = 0; i < 4; i++) {
    EXPECT_ERR(fsdp_op_binary(&o, a23, b4, (fsdp_binary_op)i), bn[i], "(2, 3)", "(4)",
               "broadcast");
    EXPECT_ERR(fsdp_op_binary(&o, b4, a23, (fsdp_binary_op)i), bn[i], "(2, 3)", "(4)");
  }
  EXPECT_ERR(fsdp_op_matmul(&o, a23, b45), "matmul", "(2, 3)", "(4, 5)");
  EXPECT_ERR(fsdp_op_matmul(&o, b234, b345), "matmul", "(2, 3, 4)", "(3, 4, 5)");
  EXPECT_ERR(fsdp_op_matmul(&o, a23, b4), "matmul", "(2, 3)", "(4)");
  EXPECT_ERR(fsdp_op_matmul(&o, s, b45), "matmul", "()", "(4, 5)");
  EXPECT_ERR(fsdp_op_linear(&o, a23, b4, NULL), "linear", "weight", "(4)");
  EXPECT_ERR(fsdp_op_linear(&o, a23, b45, NULL), "linear", "(2, 3)", "(4, 5)");
  fsdp_tensor *w53 = rnd(2, SHAPE(5, 3), -1, 1);
  EXPECT_ERR(fsdp_op_linear(&o, a23, w53, b4), "linear", "bias", "(4)", "(5, 3)");
  EXPECT_ERR(fsdp_op_linear(&o, s, w53, NULL), "linear", "()", "(5, 3)");

  static const float bad_ids[][2] = {{0, 5}, {1.5f, 0}, {-1, 0}, {NAN, 0}};
  const char *bad_txt[] = {"5", "1.5", "-1", "nan"};
  for (int i = 0; i < 4; i++) {
    fsdp_tensor *ids = from(1, SHAPE(2), bad_ids[i]), *w = rnd(2, SHAPE(5, 3), -1, 1);
    w->requires_grad = true;
    EXPECT_ERR(fsdp_op_embedding(&o, ids, w), "embedding", bad_txt[i], "(5, 3)", "[0, 5)");
    fsdp_tensor_release(ids);
    fsdp_tensor_release(w);
  }
  EXPECT_ERR(fsdp_op_embedding(&o, a23, b4), "embedding", "weight", "(4)");
  /* bf16 and f16 ids and targets are refused by dtype (zeros, so every value is in range) */
  fsdp_tensor *ibf, *if16, *w53e = rnd(2, SHAPE(5, 3), -1, 1), *lg23 = rnd(2, SHAPE(2, 3), -1, 1);
  assert_int_equal(fsdp_tensor_new(&ibf, &fsdp_device_cpu, FSDP_DTYPE_BF16, 1, SHAPE(2),
                                   FSDP_ROLE_OTHER), FSDP_OK);
  assert_int_equal(fsdp_tensor_new(&if16, &fsdp_device_cpu, FSDP_DTYPE_F16, 1, SHAPE(2),
                                   FSDP_ROLE_OTHER), FSDP_OK);
  EXPECT_ERR(fsdp_op_embedding(&o, ibf, w53e), "embedding: ids are bf16; ids must be integers "
             "(i64) or f32", "a bf16 id above 256 is not exact");
  EXPECT_ERR(fsdp_op_embedding(&o, if16, w53e), "embedding: ids are f16",
             "an f16 id above 2048 is not exact");
  EXPECT_ERR(fsdp_op_cross_entropy(&o, lg23, ibf, -1), "cross_entropy: targets are bf16",
             "a bf16 target above 256 is not exact");
  EXPECT_ERR(fsdp_op_cross_entropy(&o, lg23, if16, -1), "cross_entropy: targets are f16",
             "an f16 target above 2048 is not exact");
  fsdp_tensor_release(ibf);
  fsdp_tensor_release(if16);
  fsdp_tensor_release(w53e);
  fsdp_tensor_release(lg23);

  fsdp_tensor *w2 = rnd(1, SHAPE(2), -1, 1), *w3 = rnd(1, SHAPE(3), -1, 1);
  EXPECT_ERR(fsdp_op_layernorm(&o, a23, w2, NULL, 1e-5f), "layernorm", "(2, 3)", "(2)");
  EXPECT_ERR(fsdp_op_layernorm(&o, a23, w3, w2, 1e-5f), "layernorm", "(2, 3)", "(2)");
  EXPECT_ERR(fsdp_op_layernorm(&o, a23, a23, NULL, 1e-5f), "layernorm", "(2, 3)");
  EXPECT_ERR(fsdp_op_softmax(&o, s, 0), "softmax", "scalar");

  fsdp_tensor *q2 = rnd(2, SHAPE(5, 18), -1, 1), *q17 = rnd(3, SHAPE(2, 5, 17), -1, 1),
              *q18 = rnd(3, SHAPE(2, 5, 18), -1, 1);
  EXPECT_ERR(fsdp_op_attention(&o, q2, 3), "attention", "(5, 18)");
  EXPECT_ERR(fsdp_op_attention(&o, q17, 1), "attention", "(2, 5, 17)", "3C");
  EXPECT_ERR(fsdp_op_attention(&o, q18, 4), "attention", "(2, 5, 18)", "4 heads", "6 channels");
  EXPECT_ERR(fsdp_op_attention(&o, q18, 0), "attention", "(2, 5, 18)", "0 heads");
  EXPECT_ERR(fsdp_op_attention(&o, q18, -2), "attention", "(2, 5, 18)");

  EXPECT_ERR(fsdp_op_dropout(&o, a23, 1.0f), "dropout", "probability 1", "(2, 3)");
  EXPECT_ERR(fsdp_op_dropout(&o, a23, -0.1f), "dropout", "-0.1", "(2, 3)");
  EXPECT_ERR(fsdp_op_dropout(&o, a23, NAN), "dropout", "nan");

  fsdp_tensor *lg = rnd(2, SHAPE(2, 3), -1, 1);
  static const float t_range[] = {0, 3}, t_frac[] = {0.5f, 1}, t_neg[] = {-2, 1};
  fsdp_tensor *tr = from(1, SHAPE(2), t_range), *tf = from(1, SHAPE(2), t_frac),
              *tn = from(1, SHAPE(2), t_neg), *t3 = from(1, SHAPE(3), (float[]){0, 1, 2});
  EXPECT_ERR(fsdp_op_cross_entropy(&o, lg, tr, -1), "cross_entropy", "target 3", "[0, 3)",
             "(2, 3)");
  EXPECT_ERR(fsdp_op_cross_entropy(&o, lg, tf, -1), "cross_entropy", "0.5", "(2, 3)");
  EXPECT_ERR(fsdp_op_cross_entropy(&o, lg, tn, -1), "cross_entropy", "-2", "ignore");
  EXPECT_ERR(fsdp_op_cross_entropy(&o, lg, t3, -1), "cross_entropy", "(3)", "(2, 3)");
  EXPECT_ERR(fsdp_op_cross_entropy(&o, s, t3, -1), "cross_entropy", "scalar");

  EXPECT_ERR(fsdp_op_mse(&o, a23, b4), "mse", "(2, 3)", "(4)");
  EXPECT_ERR(fsdp_op_sum_dim(&o, a23, 2, false), "sum", "dimension", "(2, 3)");
  EXPECT_ERR(fsdp_op_sum_dim(&o, a23, -1, true), "mean", "dimension", "(2, 3)");
  EXPECT_ERR(fsdp_op_view(&o, a23, 2, SHAPE(4, 2)), "view", "(4, 2)", "(2, 3)");
  EXPECT_ERR(fsdp_op_view(&o, a23, 2, SHAPE(-1, -1)), "view", "(2, 3)");
  EXPECT_ERR(fsdp_op_view(&o, a23, 2, SHAPE(-1, 4)), "view", "(-1, 4)", "(2, 3)");
  fsdp_tensor *a23t;
  assert_int_equal(fsdp_op_transpose(&a23t, a23, 0, 1), FSDP_OK);
  fsdp_tape_clear();
  EXPECT_ERR(fsdp_op_view(&o, a23t, 2, SHAPE(4, 2)), "view", "(4, 2)", "(3, 2)");
  assert_int_equal(fsdp_tape_size(), 0); /* the copy a strided view needs is not recorded */
  fsdp_tensor_release(a23t);
  EXPECT_ERR(fsdp_op_transpose(&o, a23, 0, 2), "transpose", "(2, 3)");
  EXPECT_ERR(fsdp_op_narrow(&o, a23, 1, 2, 2), "narrow", "(2, 3)");
  EXPECT_ERR(fsdp_op_narrow(&o, a23, 2, 0, 1), "narrow", "(2, 3)");
  /* context is added once, not stacked ("transpose: transpose: ...") */
  fsdp_op_transpose(&o, a23, 0, 2);
  assert_null(strstr(fsdp_error_msg(), "transpose: transpose"));
  fsdp_op_narrow(&o, a23, 1, 2, 2);
  assert_null(strstr(fsdp_error_msg(), "narrow: narrow"));

  assert_int_equal(fsdp_tape_size(), 0);
  fsdp_tensor *all[] = {a23, b4, b45, b234, b345, s, w53, w2, w3, q2, q17, q18, lg, tr, tf, tn, t3};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) fsdp_tensor_release(all[i]);
  assert_int_equal(live_bytes(FSDP_ROLE_ACTIVATIONS), act0); /* nothing leaked on error paths */
}

static void test_errors_meta(void **state) {
  (void)state;
  rng_reset(31);
  fsdp_tensor *o = NULL;
  fsdp_tensor *m23 = meta(2, SHAPE(2, 3)), *c23 = rnd(2, SHAPE(2, 3), -1, 1),
              *m53 = meta(2, SHAPE(5, 3)), *m3 = meta(1, SHAPE(3)), *c3 = rnd(1, SHAPE(3), 1, 2),
              *mq = meta(3, SHAPE(1, 2, 6)), *mids = meta(1, SHAPE(2)),
              *cw = rnd(2, SHAPE(5, 3), -1, 1);
  m53->requires_grad = true;
#define META(call, op, shape) EXPECT_ERR(call, op, "has no data", "meta", shape)
  META(fsdp_op_binary(&o, m23, c23, FSDP_OP_ADD), "add", "(2, 3)");
  META(fsdp_op_binary(&o, c23, m23, FSDP_OP_MUL), "mul", "(2, 3)");
  META(fsdp_op_affine(&o, m23, 1, 2), "affine", "(2, 3)");
  META(fsdp_op_unary(&o, m23, FSDP_UNARY_GELU), "gelu", "(2, 3)");
  META(fsdp_op_pow(&o, m23, 2), "pow", "(2, 3)");
  fsdp_tensor *m34 = meta(2, SHAPE(3, 4));
  META(fsdp_op_matmul(&o, c23, m34), "matmul", "(3, 4)");
  META(fsdp_op_matmul(&o, m23, m34), "matmul", "(2, 3)");
  fsdp_tensor_release(m34);
  META(fsdp_op_linear(&o, c23, m53, NULL), "linear", "(5, 3)");
  META(fsdp_op_linear(&o, m23, cw, NULL), "linear", "(2, 3)");
  META(fsdp_op_embedding(&o, mids, cw), "embedding", "(2)");
  META(fsdp_op_layernorm(&o, m23, c3, NULL, 1e-5f), "layernorm", "(2, 3)");
  META(fsdp_op_layernorm(&o, c23, m3, NULL, 1e-5f), "layernorm", "(3)");
  META(fsdp_op_softmax(&o, m23, 1), "softmax", "(2, 3)");
  META(fsdp_op_attention(&o, mq, 1), "attention", "(1, 2, 6)");
  META(fsdp_op_dropout(&o, m23, 0.5f), "dropout", "(2, 3)");
  META(fsdp_op_cross_entropy(&o, m23, mids, -1), "cross_entropy", "(2, 3)");
  META(fsdp_op_mse(&o, m23, c23), "mse", "(2, 3)");
  META(fsdp_op_sum(&o, m23), "sum", "(2, 3)");
  META(fsdp_op_mean(&o, m23), "mean", "(2, 3)");
  META(fsdp_op_sum_dim(&o, m23, 0, false), "sum", "(2, 3)");
#undef META
  /* shape-only ops work on meta tensors and give meta tensors */
  fsdp_tensor *mt, *mc, *mv, *mn;
  assert_int_equal(fsdp_op_transpose(&mt, m23, 0, 1), FSDP_OK);
  assert_int_equal(fsdp_op_contiguous(&mc, mt), FSDP_OK);
  assert_int_equal(fsdp_op_view(&mv, mt, 1, SHAPE(-1)), FSDP_OK);
  assert_int_equal(fsdp_op_narrow(&mn, mt, 0, 1, 2), FSDP_OK);
  fsdp_tensor *ms[] = {mt, mc, mv, mn};
  for (int i = 0; i < 4; i++) {
    assert_false(ms[i]->storage->device->has_data);
    EXPECT_ERR(fsdp_op_sum(&o, ms[i]), "sum", "has no data");
    fsdp_tensor_release(ms[i]);
  }
  fsdp_tape_clear();
  assert_int_equal(fsdp_tape_size(), 0);
  fsdp_tensor *all[] = {m23, c23, m53, m3, c3, mq, mids, cw};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) fsdp_tensor_release(all[i]);
}

/* rc must be FSDP_ERR with exactly this message. */
static void expect_msg_(int rc, const char *want, const char *file, int line) {
  if (rc != FSDP_ERR || strcmp(fsdp_error_msg(), want) != 0) {
    fprintf(stderr, "%s:%d: expected FSDP_ERR \"%s\", got %d \"%s\"\n", file, line, want, rc,
            fsdp_error_msg());
    fail();
  }
}
#define EXPECT_MSG(rc, want) expect_msg_((rc), (want), __FILE__, __LINE__)

static fsdp_tensor *mk_dt(fsdp_dtype dt, int ndim, const int64_t *shape) {
  fsdp_tensor *t;
  assert_int_equal(fsdp_tensor_new(&t, &fsdp_device_cpu, dt, ndim, shape, FSDP_ROLE_ACTIVATIONS),
                   FSDP_OK);
  return t;
}

static void test_errors_selection(void **state) {
  (void)state;
  rng_reset(47);
  int64_t act0 = live_bytes(FSDP_ROLE_ACTIVATIONS);
  fsdp_tensor *o = NULL, *i = NULL;
  fsdp_tensor *a23 = rnd(2, SHAPE(2, 3), -1, 1), *b24 = rnd(2, SHAPE(2, 4), -1, 1),
              *b4 = rnd(1, SHAPE(4), -1, 1), *a34 = rnd(2, SHAPE(3, 4), -1, 1),
              *e30 = rnd(2, SHAPE(3, 0), -1, 1), *s = rnd(0, NULL, -1, 1),
              *d23 = mk_dt(FSDP_DTYPE_F64, 2, SHAPE(2, 3)), *i23 = mk_dt(FSDP_DTYPE_I64, 2, SHAPE(2, 3)),
              *b2 = mk_dt(FSDP_DTYPE_BOOL, 1, SHAPE(2));
  a23->requires_grad = true; /* errors must not record anything */

  EXPECT_MSG(fsdp_op_cat(&o, (fsdp_tensor *[]){a23, b24}, 2, 0),
             "cat: tensor 2 has shape (2, 4), tensor 1 (2, 3): they must agree except in dimension 1");
  EXPECT_MSG(fsdp_op_cat(&o, (fsdp_tensor *[]){a23, b4}, 2, 1),
             "cat: tensor 2 has shape (4), tensor 1 (2, 3): they must agree except in dimension 2");
  EXPECT_MSG(fsdp_op_cat(&o, (fsdp_tensor *[]){a23, d23}, 2, 0),
             "cat: tensor 2 is f64, tensor 1 f32 (convert with t:to())");
  EXPECT_MSG(fsdp_op_cat(&o, (fsdp_tensor *[]){a23, a23, i23}, 3, 1),
             "cat: tensor 3 is i64, tensor 1 f32 (convert with t:to())");
  EXPECT_MSG(fsdp_op_cat(&o, (fsdp_tensor *[]){a23}, 1, 2), "cat: dimension 3 out of range for tensors (2, 3)");
  EXPECT_MSG(fsdp_op_cat(&o, (fsdp_tensor *[]){s}, 1, 0), "cat: dimension 1 out of range for tensors ()");
  EXPECT_MSG(fsdp_op_cat(&o, NULL, 0, 0), "cat: needs at least one tensor");
  EXPECT_MSG(fsdp_op_stack(&o, (fsdp_tensor *[]){a23, b24}, 2, 0),
             "stack: tensor 2 has shape (2, 4), tensor 1 (2, 3): stacked tensors share one shape");
  EXPECT_MSG(fsdp_op_stack(&o, (fsdp_tensor *[]){a23}, 1, 3), "stack: dimension 4 out of range for tensors (2, 3)");
  EXPECT_MSG(fsdp_op_stack(&o, NULL, 0, 0), "stack: needs at least one tensor");

  EXPECT_MSG(fsdp_op_topk(&o, &i, a34, 5, 1, true), "topk: k = 5 is not in [0, 4] (dimension 2 of a tensor (3, 4))");
  EXPECT_MSG(fsdp_op_topk(&o, &i, a34, -1, 0, false), "topk: k = -1 is not in [0, 3] (dimension 1 of a tensor (3, 4))");
  EXPECT_MSG(fsdp_op_topk(&o, &i, a34, 1, 2, true), "topk: dimension 3 out of range for a tensor (3, 4)");
  EXPECT_MSG(fsdp_op_extreme(&o, &i, a34, 2, true, false), "max: dimension 3 out of range for a tensor (3, 4)");
  EXPECT_MSG(fsdp_op_extreme(&o, &i, a34, -1, false, false), "min: dimension 0 out of range for a tensor (3, 4)");
  EXPECT_MSG(fsdp_op_extreme(&o, NULL, e30, 1, false, false), "min: dimension 2 of the tensor (3, 0) is empty");
  EXPECT_MSG(fsdp_op_clamp(&o, a23, 1.0, -1.0), "clamp: min 1 is above max -1");
  EXPECT_MSG(fsdp_op_softmax(&o, a23, 2), "softmax: dimension 3 out of range for a tensor (2, 3)");

  EXPECT_MSG(fsdp_op_where(&o, a23, b4, a23), "where: shape (4) does not broadcast to (2, 3) (it must end the other)");
  EXPECT_MSG(fsdp_op_where(&o, a23, a23, b4), "where: shape (4) does not broadcast to (2, 3) (it must end the other)");
  EXPECT_MSG(fsdp_op_where(&o, b4, a23, a23), "where: shape (4) does not broadcast to (2, 3) (it must end the other)");
  EXPECT_MSG(fsdp_op_compare(&o, a23, b4, FSDP_CMP_GT),
             "gt: shapes (2, 3) and (4) do not broadcast (one shape must end with the other)");
  EXPECT_MSG(fsdp_op_compare(&o, b4, a23, FSDP_CMP_NE),
             "ne: shapes (4) and (2, 3) do not broadcast (one shape must end with the other)");

  /* dtypes a kernel lacks come back as the kernel table's refusal */
  EXPECT_MSG(fsdp_op_softmax(&o, d23, 1), "op softmax has no kernel for f64 on cpu");
  EXPECT_MSG(fsdp_op_unary(&o, i23, FSDP_UNARY_EXP), "op exp has no kernel for i64 on cpu");
  EXPECT_MSG(fsdp_op_clamp(&o, b2, 0, 1), "op clamp has no kernel for bool on cpu");
  EXPECT_MSG(fsdp_op_binary(&o, b2, b2, FSDP_OP_ADD), "op add has no kernel for bool on cpu");
  EXPECT_MSG(fsdp_op_binary(&o, i23, i23, FSDP_OP_DIV), "op div has no kernel for i64 on cpu");

  /* requires_grad on an integer tensor: to() refuses to make one */
  EXPECT_MSG(fsdp_op_to(&o, a23, NULL, FSDP_DTYPE_I64),
             "to: a tensor that requires a gradient cannot become i64 (gradients need a float "
             "dtype; detach() it first)");
  EXPECT_MSG(fsdp_op_to(&o, a23, NULL, FSDP_DTYPE_BOOL),
             "to: a tensor that requires a gradient cannot become bool (gradients need a float "
             "dtype; detach() it first)");

  assert_int_equal(fsdp_tape_size(), 0);
  fsdp_tensor *all[] = {a23, b24, b4, a34, e30, s, d23, i23, b2};
  for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) fsdp_tensor_release(all[k]);
  assert_int_equal(live_bytes(FSDP_ROLE_ACTIVATIONS), act0); /* nothing leaked on error paths */
}

/* Tensors of two devices in one op: an error naming both, before any work. */
static void test_errors_devices(void **state) {
  (void)state;
  rng_reset(48);
  const fsdp_device_i *dev2 = cpu2();
  fsdp_tensor *o = NULL, *i = NULL, *a = rnd(2, SHAPE(2, 3), -1, 1), *b;
  a->requires_grad = true;
  assert_int_equal(fsdp_op_to(&b, a, dev2, FSDP_DTYPE_F32), FSDP_OK);
  fsdp_tape_clear();
  assert_ptr_equal(b->storage->device, dev2);
  const char *to_cpu = "tensors on different devices (cpu and cpu2); move one with t:to(\"cpu\")";
  char want[160];
#define DEV_ERR(call, op)                                    \
  do {                                                       \
    snprintf(want, sizeof want, "%s: %s", op, to_cpu);       \
    EXPECT_MSG(call, want);                                  \
  } while (0)
  DEV_ERR(fsdp_op_binary(&o, a, b, FSDP_OP_ADD), "add");
  DEV_ERR(fsdp_op_binary(&o, a, b, FSDP_OP_DIV), "div");
  DEV_ERR(fsdp_op_compare(&o, a, b, FSDP_CMP_EQ), "eq");
  DEV_ERR(fsdp_op_where(&o, a, a, b), "where");
  DEV_ERR(fsdp_op_cat(&o, (fsdp_tensor *[]){a, b}, 2, 0), "cat");
  DEV_ERR(fsdp_op_stack(&o, (fsdp_tensor *[]){a, b}, 2, 0), "stack: cat");
  DEV_ERR(fsdp_op_mse(&o, a, b), "mse");
  fsdp_tensor *w = rnd(2, SHAPE(3, 4), -1, 1);
  DEV_ERR(fsdp_op_matmul(&o, w, b), "matmul");
  fsdp_tensor_release(w);
#undef DEV_ERR
  /* one device at a time works, and to() moves between them */
  assert_int_equal(fsdp_op_extreme(&o, &i, b, 1, true, false), FSDP_OK);
  assert_ptr_equal(o->storage->device, dev2);
  assert_ptr_equal(i->storage->device, dev2);
  fsdp_tensor_release(o);
  fsdp_tensor_release(i);
  fsdp_tensor *back;
  assert_int_equal(fsdp_op_to(&back, b, &fsdp_device_cpu, FSDP_DTYPE_F32), FSDP_OK);
  assert_int_equal(fsdp_op_binary(&o, a, back, FSDP_OP_SUB), FSDP_OK);
  for (int k = 0; k < 6; k++) assert_float_equal(((float *)fsdp_tensor_data(o, "t"))[k], 0.0f, 0);
  fsdp_tape_clear();
  fsdp_tensor_release(o);
  fsdp_tensor_release(back);
  fsdp_tensor_release(b);
  fsdp_tensor_release(a);
}

/* Empty dimensions compute nothing and do not crash (nor call BLAS with bad leading dims). */
static void test_empty(void **state) {
  (void)state;
  rng_reset(32);
  fsdp_tensor *a = rnd(3, SHAPE(0, 3, 4), -1, 1), *b = rnd(3, SHAPE(0, 4, 5), -1, 1),
              *x = rnd(2, SHAPE(0, 4), -1, 1), *w = rnd(2, SHAPE(5, 4), -1, 1), *o, *s;
  a->requires_grad = b->requires_grad = w->requires_grad = true;
  assert_int_equal(fsdp_op_matmul(&o, a, b), FSDP_OK);
  assert_int_equal(o->shape[0], 0);
  assert_int_equal(fsdp_op_sum(&s, o), FSDP_OK);
  assert_int_equal(fsdp_backward(s, NULL), FSDP_OK);
  fsdp_tensor_release(o);
  fsdp_tensor_release(s);
  assert_int_equal(fsdp_op_linear(&o, x, w, NULL), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&s, o), FSDP_OK);
  assert_int_equal(fsdp_backward(s, NULL), FSDP_OK);
  for (int i = 0; i < 20; i++) assert_float_equal(((float *)fsdp_tensor_data(w->grad, "t"))[i], 0, 0);
  fsdp_tensor_release(o);
  fsdp_tensor_release(s);
  /* broadcasting with no elements, both ways round */
  fsdp_tensor *e0 = rnd(1, SHAPE(0), -1, 1), *e20 = rnd(2, SHAPE(2, 0), -1, 1);
  e0->requires_grad = e20->requires_grad = true;
  for (int k = 0; k < 4; k++) {
    assert_int_equal(fsdp_op_binary(&o, e0, e20, (fsdp_binary_op)k), FSDP_OK);
    assert_int_equal(o->ndim, 2);
    assert_int_equal(fsdp_op_sum(&s, o), FSDP_OK);
    assert_int_equal(fsdp_backward(s, NULL), FSDP_OK);
    fsdp_tensor_release(o);
    fsdp_tensor_release(s);
    assert_int_equal(fsdp_op_binary(&o, e20, e0, (fsdp_binary_op)k), FSDP_OK);
    assert_int_equal(fsdp_op_mean(&s, o), FSDP_OK);
    assert_int_equal(fsdp_backward(s, NULL), FSDP_OK);
    fsdp_tensor_release(o);
    fsdp_tensor_release(s);
  }
  /* an empty reduction is 0 (sum) */
  fsdp_tensor *e30 = rnd(2, SHAPE(3, 0), -1, 1);
  assert_int_equal(fsdp_op_sum_dim(&o, e30, 1, false), FSDP_OK);
  for (int i = 0; i < 3; i++) assert_float_equal(((float *)fsdp_tensor_data(o, "t"))[i], 0.0f, 0);
  fsdp_tensor_release(o);
  fsdp_tensor_release(e30);
  fsdp_tensor_release(e0);
  fsdp_tensor_release(e20);
  fsdp_tensor_release(a);
  fsdp_tensor_release(b);
  fsdp_tensor_release(x);
  fsdp_tensor_release(w);
}

/* ---- activation checkpointing (checkpoint.c) ---------------------------------------------- */

typedef struct {
  fsdp_tensor *w; /* borrowed */
  int mode;       /* 0 the region, 1 fails, 2 gives another shape */
  int calls, frees;
} region_ud;

/* The region: relu(dropout(affine(x @ w, 2, 1), 0.3)) */
static int region(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *w) {
  fsdp_tensor *a, *b, *c;
  if (fsdp_op_matmul(&a, x, w)) return FSDP_ERR;
  int rc = fsdp_op_affine(&b, a, 2.0f, 1.0f);
  fsdp_tensor_release(a);
  if (rc) return rc;
  rc = fsdp_op_dropout(&c, b, 0.3f);
  fsdp_tensor_release(b);
  if (rc) return rc;
  rc = fsdp_op_unary(out, c, FSDP_UNARY_RELU);
  fsdp_tensor_release(c);
  return rc;
}

static int region_recompute(void *p, fsdp_tensor *const *in, int nin, fsdp_tensor **out) {
  region_ud *r = p;
  r->calls++;
  assert_int_equal(nin, 1);
  assert_true(fsdp_grad_enabled()); /* recording, on a tape of its own */
  assert_int_equal(fsdp_tape_size(), 0);
  if (r->mode == 1) return fsdp_error("recompute failed on purpose");
  if (region(out, in[0], r->w)) return FSDP_ERR;
  if (r->mode == 2) {
    fsdp_tensor *n;
    int rc = fsdp_op_narrow(&n, *out, 0, 0, 1);
    fsdp_tensor_release(*out);
    *out = rc ? NULL : n;
    return rc;
  }
  return FSDP_OK;
}

static void region_free(void *p) { ((region_ud *)p)->frees++; }

/* The region run checkpointed on x: *out is the node's output. */
static void checkpointed(fsdp_tensor **out, fsdp_tensor *x, region_ud *r) {
  fsdp_rng_state rng;
  fsdp_rng_get_state(&rng);
  bool prev = fsdp_set_grad_enabled(false);
  fsdp_tensor *y;
  assert_int_equal(region(&y, x, r->w), FSDP_OK);
  fsdp_set_grad_enabled(prev);
  assert_false(y->requires_grad);
  assert_int_equal(fsdp_op_checkpoint(out, y, &x, 1, &rng, region_recompute, r, region_free),
                   FSDP_OK);
  assert_true((*out)->requires_grad);
  assert_true((*out)->storage == y->storage); /* the output itself, no copy */
  fsdp_tensor_release(y);
}

static bool same_bits(fsdp_tensor *a, fsdp_tensor *b) {
  return fsdp_tensor_numel(a) == fsdp_tensor_numel(b) &&
         memcmp(fsdp_tensor_data(a, "t"), fsdp_tensor_data(b, "t"),
                sizeof(float) * (size_t)fsdp_tensor_numel(a)) == 0;
}

static int adopt_in_hook(void *ud) {
  fsdp_tensor **t = ud;
  EXPECT_ERR(fsdp_backward_adopt(t[0], t[1]), "backward: called while a backward is running");
  return FSDP_OK;
}

/* ---- the backward's epilogue ------------------------------------------------------------- */

static int epilogue_calls, epilogue_walks; /* calls, and walks running during the last call */
static bool epilogue_fails;
static int epilogue(void) {
  epilogue_calls++;
  epilogue_walks = fsdp_tape_size();
  return epilogue_fails ? fsdp_error("epilogue failed on purpose") : FSDP_OK;
}

static int failing_hook(void *ud) {
  (void)ud;
  return fsdp_error("hook failed on purpose");
}

/* It runs once per outermost backward, after the walk (the tape consumed), not at the end of a
 * checkpointed region's inner backward; its error fails the backward with its message; after
 * a failed walk it runs too, and the walk's message is the one reported. */
static void test_backward_epilogue(void **state) {
  (void)state;
  fsdp_backward_set_epilogue(epilogue);
  rng_reset(17);
  fsdp_tensor *x0 = rnd(2, SHAPE(3, 4), -1, 1), *w = rnd(2, SHAPE(4, 5), -1, 1), *x, *o, *s;
  w->requires_grad = true;
  x0->requires_grad = true;
  /* a checkpointed region: its recomputation's backward is a walk inside the outer one */
  region_ud r = {.w = w};
  assert_int_equal(fsdp_op_affine(&x, x0, 1.0f, 0.0f), FSDP_OK);
  checkpointed(&o, x, &r);
  assert_int_equal(fsdp_op_sum(&s, o), FSDP_OK);
  epilogue_calls = 0;
  epilogue_walks = -1;
  assert_int_equal(fsdp_backward(s, NULL), FSDP_OK);
  assert_int_equal(r.calls, 1);
  assert_int_equal(epilogue_calls, 1);
  assert_int_equal(epilogue_walks, 0); /* after the walk: the tape is consumed */
  fsdp_tensor_release(s);
  fsdp_tensor_release(o);
  fsdp_tensor_release(x);
  /* the epilogue's failure is the backward's */
  epilogue_fails = true;
  assert_int_equal(fsdp_op_affine(&x, x0, 2.0f, 0.0f), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&s, x), FSDP_OK);
  EXPECT_ERR(fsdp_backward(s, NULL), "epilogue failed on purpose");
  assert_int_equal(epilogue_calls, 2);
  fsdp_tensor_release(s);
  fsdp_tensor_release(x);
  /* a failed walk: the epilogue runs (its cleanup), the walk's message stays */
  assert_int_equal(fsdp_op_affine(&x, x0, 2.0f, 0.0f), FSDP_OK);
  assert_int_equal(fsdp_tape_hook(failing_hook, NULL, NULL), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&s, x), FSDP_OK);
  EXPECT_ERR(fsdp_backward(s, NULL), "hook failed on purpose");
  assert_null(strstr(fsdp_error_msg(), "epilogue"));
  assert_int_equal(epilogue_calls, 3);
  assert_int_equal(fsdp_tape_size(), 0);
  epilogue_fails = false;
  fsdp_backward_set_epilogue(NULL);
  fsdp_tensor_release(s);
  fsdp_tensor_release(x);
  fsdp_tensor_release(x0);
  fsdp_tensor_release(w);
}

static void test_checkpoint(void **state) {
  (void)state;
  rng_reset(91);
  fsdp_tensor *x0 = rnd(2, SHAPE(3, 4), -1, 1), *w = rnd(2, SHAPE(4, 5), -1, 1);
  fsdp_tensor *seed = rnd(2, SHAPE(3, 5), -1, 1);
  w->requires_grad = true;
  x0->requires_grad = true;
  /* plain: x = x0 * 1 (a recorded input), the region, backward with `seed` */
  fsdp_rng_manual_seed(5);
  fsdp_tensor *x, *o;
  assert_int_equal(fsdp_op_affine(&x, x0, 1.0f, 0.0f), FSDP_OK);
  assert_int_equal(region(&o, x, w), FSDP_OK);
  int64_t plain_nodes = fsdp_tape_size();
  assert_int_equal(fsdp_backward(o, seed), FSDP_OK);
  fsdp_tensor *gx = x0->grad, *gw = w->grad;
  fsdp_tensor_retain(gx);
  fsdp_tensor_retain(gw);
  fsdp_rng_state after_plain;
  fsdp_rng_get_state(&after_plain);
  fsdp_tensor_release(o);
  fsdp_tensor_release(x);
  fsdp_tensor_set_grad(x0, NULL);
  fsdp_tensor_set_grad(w, NULL);

  /* checkpointed: one node for the region, the same bits, the streams where they were */
  fsdp_rng_manual_seed(5);
  region_ud r = {.w = w};
  assert_int_equal(fsdp_op_affine(&x, x0, 1.0f, 0.0f), FSDP_OK);
  checkpointed(&o, x, &r);
  assert_int_equal(fsdp_tape_size(), 2);
  assert_true(plain_nodes > 2);
  assert_true(fsdp_tape_records(o));
  assert_false(fsdp_tape_records(x0));
  assert_int_equal(fsdp_backward(o, seed), FSDP_OK);
  assert_int_equal(r.calls, 1);
  assert_int_equal(r.frees, 1);
  assert_int_equal(fsdp_tape_size(), 0);
  assert_true(same_bits(x0->grad, gx));
  assert_true(same_bits(w->grad, gw));
  fsdp_rng_state after_ck;
  fsdp_rng_get_state(&after_ck);
  assert_memory_equal(after_ck.next, after_plain.next, sizeof after_ck.next);
  fsdp_tensor_release(o);

  /* dropped without backward: never run, its ud freed once */
  r = (region_ud){.w = w};
  checkpointed(&o, x, &r);
  fsdp_tape_clear();
  assert_int_equal(r.calls, 0);
  assert_int_equal(r.frees, 1);
  fsdp_tensor_release(o);
  fsdp_tensor_release(x);

  /* an input modified in place after the forward */
  assert_int_equal(fsdp_op_affine(&x, x0, 1.0f, 0.0f), FSDP_OK);
  r = (region_ud){.w = w};
  checkpointed(&o, x, &r);
  assert_int_equal(fsdp_tensor_fill(x, 0.0), FSDP_OK);
  EXPECT_ERR(fsdp_backward(o, seed), "backward of checkpoint",
             "input 1 (3, 4) of the checkpointed region was modified in place");
  assert_int_equal(r.calls, 0);
  assert_int_equal(fsdp_tape_size(), 0);
  fsdp_tensor_release(o);
  fsdp_tensor_release(x);

  /* a failing recomputation, one of another shape */
  for (int mode = 1; mode <= 2; mode++) {
    assert_int_equal(fsdp_op_affine(&x, x0, 1.0f, 0.0f), FSDP_OK);
    r = (region_ud){.w = w, .mode = mode};
    checkpointed(&o, x, &r);
    if (mode == 1)
      EXPECT_ERR(fsdp_backward(o, seed), "backward of checkpoint", "recompute failed on purpose");
    else
      EXPECT_ERR(fsdp_backward(o, seed), "the recomputation gave f32 (1, 5) where the forward "
                                         "gave f32 (3, 5)");
    assert_int_equal(fsdp_tape_size(), 0);
    assert_true(fsdp_grad_enabled()); /* the outer modes came back */
    fsdp_tensor_release(o);
    fsdp_tensor_release(x);
  }

  /* an integral output has no gradient to recompute for; ud freed on the refusal */
  fsdp_tensor *ids;
  assert_int_equal(fsdp_tensor_new(&ids, &fsdp_device_cpu, FSDP_DTYPE_I64, 1, SHAPE(3),
                                   FSDP_ROLE_ACTIVATIONS),
                   FSDP_OK);
  fsdp_rng_state rng;
  fsdp_rng_get_state(&rng);
  r = (region_ud){.w = w};
  EXPECT_ERR(fsdp_op_checkpoint(&o, ids, &x0, 1, &rng, region_recompute, &r, region_free),
             "checkpoint: the region's output is i64 (3); only a floating output");
  assert_null(o);
  assert_int_equal(r.frees, 1);
  fsdp_tensor_release(ids);

  /* fsdp_backward_adopt's refusals */
  fsdp_tensor *t, *g = rnd(1, SHAPE(2), -1, 1);
  EXPECT_ERR(fsdp_backward_adopt(x0, seed), "backward: tensor (3, 4) is not recorded on this tape");
  assert_int_equal(fsdp_op_affine(&x, x0, 1.0f, 0.0f), FSDP_OK);
  EXPECT_ERR(fsdp_backward_adopt(x, g), "backward: gradient (2) does not fit tensor (3, 4)");
  fsdp_tensor *pair[2] = {x, seed};
  assert_int_equal(fsdp_op_affine(&t, x, 3.0f, 0.0f), FSDP_OK);
  assert_int_equal(fsdp_tape_hook(adopt_in_hook, pair, NULL), FSDP_OK);
  assert_int_equal(fsdp_op_sum(&o, t), FSDP_OK);
  assert_int_equal(fsdp_backward(o, NULL), FSDP_OK);
  fsdp_tensor_release(o);
  fsdp_tensor_release(t);
  fsdp_tensor_release(x);
  fsdp_tensor_release(g);

  fsdp_tensor_release(gx);
  fsdp_tensor_release(gw);
  fsdp_tensor_release(seed);
  fsdp_tensor_release(w);
  fsdp_tensor_release(x0);
}

/* The checkpointed region against finite differences, with its input a leaf (no recorded op
 * before the node) and the weight it reads requiring a gradient as well. Under no_grad (the
 * checker's steps) the region runs plain. */
static region_ud fd_region;
static int f_checkpointed(fsdp_tensor **o, fsdp_tensor **in, const void *ctx) {
  fsdp_rng_manual_seed(9); /* one dropout mask for every call */
  if (!fsdp_grad_enabled()) return region(o, in[0], in[1]);
  fd_region = (region_ud){.w = in[1]};
  checkpointed(o, in[0], &fd_region);
  return FSDP_OK;
}
static void test_grad_checkpoint(void **state) {
  (void)state;
  rng_reset(92);
  gradcheck((gc_case){"checkpoint relu(dropout(2 x@w + 1))", f_checkpointed, NULL, 2,
                      {rnd(2, SHAPE(3, 4), -1, 1), rnd(2, SHAPE(4, 5), -1, 1)}, 3});
  assert_int_equal(fd_region.calls, 1); /* the backward recomputed the region once */
  assert_int_equal(fd_region.frees, 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gradcheck_catches_wrong_backward),
      cmocka_unit_test(test_grad_binary),
      cmocka_unit_test(test_grad_affine),
      cmocka_unit_test(test_grad_unary),
      cmocka_unit_test(test_grad_pow),
      cmocka_unit_test(test_grad_matmul),
      cmocka_unit_test(test_grad_linear),
      cmocka_unit_test(test_grad_embedding),
      cmocka_unit_test(test_grad_layernorm),
      cmocka_unit_test(test_grad_softmax),
      cmocka_unit_test(test_grad_attention),
      cmocka_unit_test(test_grad_attention_long),
      cmocka_unit_test(test_grad_dropout),
      cmocka_unit_test(test_grad_cross_entropy),
      cmocka_unit_test(test_grad_mse),
      cmocka_unit_test(test_grad_reductions),
      cmocka_unit_test(test_grad_views),
      cmocka_unit_test(test_grad_abs),
      cmocka_unit_test(test_grad_where),
      cmocka_unit_test(test_grad_clamp),
      cmocka_unit_test(test_grad_cat_stack),
      cmocka_unit_test(test_grad_max_min_topk_sort),
      cmocka_unit_test(test_grad_softmax_dim),
      cmocka_unit_test(test_grad_to),
      cmocka_unit_test(test_grad_f64_elementwise),
      cmocka_unit_test(test_grad_f64_reductions_selection),
      cmocka_unit_test(test_grad_bias_gelu),
      cmocka_unit_test(test_grad_add_layernorm),
      cmocka_unit_test(test_grad_size_one),
      cmocka_unit_test(test_grad_layouts),
      cmocka_unit_test(test_grad_accumulating),
      cmocka_unit_test(test_used_twice),
      cmocka_unit_test(test_shared_addend_gradient),
      cmocka_unit_test(test_grad_share),
      cmocka_unit_test(test_bias_gelu_gradient_over_output),
      cmocka_unit_test(test_bias_gelu_gradient_over_output_failure),
      cmocka_unit_test(test_add_layernorm_failure),
      cmocka_unit_test(test_linear_first_gradient),
      cmocka_unit_test(test_linear_first_gradient_failure),
      cmocka_unit_test(test_bias_gelu_first_gradient_failure),
      cmocka_unit_test(test_attention_first_gradient_failure),
      cmocka_unit_test(test_accumulate_and_free),
      cmocka_unit_test(test_no_grad),
      cmocka_unit_test(test_backward_errors),
      cmocka_unit_test(test_inplace_after_forward),
      cmocka_unit_test(test_hooks),
      cmocka_unit_test(test_hook_runs_ops),
      cmocka_unit_test(test_tape_clear_frees_activations),
      cmocka_unit_test(test_prune),
      cmocka_unit_test(test_detach),
      cmocka_unit_test(test_errors_shapes),
      cmocka_unit_test(test_errors_meta),
      cmocka_unit_test(test_errors_selection),
      cmocka_unit_test(test_errors_devices),
      cmocka_unit_test(test_empty),
      cmocka_unit_test(test_checkpoint),
      cmocka_unit_test(test_grad_checkpoint),
      cmocka_unit_test(test_backward_epilogue),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
