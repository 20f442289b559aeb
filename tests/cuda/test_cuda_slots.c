/*
 * test_cuda_slots.c — every slot of the cuda kernel table against the cpu's on the same inputs.
 *
 * Each row runs one slot (per op for slots that take one) on the cpu and on the device under
 * test (cuda_test.h: cuda, or cpu2 for the harness), with inputs drawn on the host from one
 * stream and copied to the device through fsdp_to, outputs read back through fsdp_to_host, and
 * compares every output within the dtype's tolerance. Rows run in every dtype at the sizes of
 * tests/c/test_dtypes.c (tiny, odd), and in f32 and bf16 at large odd sizes too (many blocks,
 * grid-stride loops, long rows for the block reductions, repeated indices for the scatters).
 * Where the cpu refuses a dtype the device must refuse it with the same op name ("op gelu has no
 * kernel for i64 on cuda"); where the cpu computes, the device must compute f32 and bf16 (and
 * i64 ids in check_index) and may refuse the other dtypes, which the matrix shows as "ref".
 *
 * Also: the attention slot at T in {1, 63, 64, 65, 1024} and head sizes {32, 64, 128}, each
 * device's backward reading its own forward's saved state (attention_saved says its layout);
 * deterministic mode (fsdp_kernels_set_deterministic): every row twice gives the same bits; and
 * the checker itself, against a device whose kernels are wrong on purpose.
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

#include "cuda_test.h"

/* ---- dtype sets --------------------------------------------------------------------------- */

#define B_(dt) (1u << FSDP_DTYPE_##dt)
#define MUST (B_(F32) | B_(BF16)) /* computed on the device wherever the cpu computes them */

/* ---- one run of a slot on one device ---------------------------------------------------------

 * Inputs are drawn on the host (xorshift, as test_dtypes.c) and moved to the run's device with
 * fsdp_to; outputs are tensors on the device (zeroed) read back with fsdp_to_host after the call;
 * scalars the slot conventions put in host memory (counts, sumsq, check_index's result) are host
 * buffers. Two runs with the same seed draw the same inputs in the same order. */

#define MAX_T 48
#define MAX_OUT 10

typedef struct {
  const fsdp_device_i *dev;
  fsdp_dtype dt;
  uint64_t rng;
  bool big; /* the large sizes */
  int nt;
  fsdp_tensor *t[MAX_T];
  int nh;
  void *h[MAX_T];
  int nout;
  struct {
    fsdp_tensor *t; /* a device output, or NULL for a host one */
    void *host;     /* the host output, or (after run_read) the device output's values */
    fsdp_tensor *read;
    fsdp_dtype dt;
    int64_t n;
    const char *name;
  } out[MAX_OUT];
} run;

typedef enum {
  G_SIGNED, /* floats in [-2, 2); integers -3..3 (u8 0..6); bool 0/1 */
  G_POS,    /* floats in [0.5, 2); integers 1..6; bool 1 */
  G_UNIT,   /* floats in [0, 1); integers and bool 0/1 */
  G_BOOL,   /* 0/1 whatever the dtype */
} gen;

static double urand(run *r) { /* xorshift64*: uniform in [0, 1) */
  r->rng ^= r->rng >> 12;
  r->rng ^= r->rng << 25;
  r->rng ^= r->rng >> 27;
  return (double)((r->rng * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0;
}

static int irand(run *r, int lo, int hi) { return lo + (int)(urand(r) * (hi - lo + 1)); }

static double draw(run *r, fsdp_dtype vt, gen g) {
  double v;
  if (g == G_BOOL) v = irand(r, 0, 1);
  else if (vt == FSDP_DTYPE_BOOL) v = g == G_POS ? 1 : irand(r, 0, 1);
  else if (!fsdp_dtype_is_float(vt))
    v = g == G_POS ? irand(r, 1, 6) : g == G_UNIT ? irand(r, 0, 1)
        : vt == FSDP_DTYPE_U8 ? irand(r, 0, 6) : irand(r, -3, 3);
  else
    v = (float)(g == G_POS ? 0.5 + 1.5 * urand(r) : g == G_UNIT ? urand(r) : -2 + 4 * urand(r));
  return v;
}

static void *keep_host(run *r, void *p) {
  assert_non_null(p);
  assert_true(r->nh < MAX_T);
  return r->h[r->nh++] = p;
}

/* n values of dt from `values` (or drawn by g when values is NULL), on the run's device */
static void *upload(run *r, fsdp_dtype dt, int64_t n, gen g, const double *values) {
  fsdp_tensor *h, *d;
  int64_t shape = n;
  assert_int_equal(fsdp_tensor_new(&h, &fsdp_device_cpu, dt, 1, &shape, FSDP_ROLE_ACTIVATIONS),
                   FSDP_OK);
  void *p = fsdp_tensor_data(h, "test");
  for (int64_t i = 0; i < n; i++) fsdp_dtype_store(p, dt, i, values ? values[i] : draw(r, dt, g));
  if (fsdp_to(&d, h, r->dev, dt, FSDP_ROLE_ACTIVATIONS))
    fail_msg("fsdp_to %s: %s", r->dev->name, fsdp_error_msg());
  fsdp_tensor_release(h);
  assert_true(r->nt < MAX_T);
  r->t[r->nt++] = d;
  return fsdp_tensor_data(d, "test");
}

static void *in_dt(run *r, fsdp_dtype dt, int64_t n, gen g) { return upload(r, dt, n, g, NULL); }
static void *in(run *r, int64_t n, gen g) { return in_dt(r, r->dt, n, g); }
static void *vals_dt(run *r, fsdp_dtype dt, int64_t n, const double *v) {
  return upload(r, dt, n, G_SIGNED, v);
}

static void keep_out(run *r, fsdp_tensor *t, void *host, fsdp_dtype dt, int64_t n) {
  assert_true(r->nout < MAX_OUT);
  r->out[r->nout].t = t;
  r->out[r->nout].host = host;
  r->out[r->nout].read = NULL;
  r->out[r->nout].dt = dt;
  r->out[r->nout].n = n;
  r->nout++;
}

/* an output the slot writes whole, on the device (zeroed) */
static void *out_dt(run *r, fsdp_dtype dt, int64_t n) {
  fsdp_tensor *t;
  int64_t shape = n;
  if (fsdp_tensor_new(&t, r->dev, dt, 1, &shape, FSDP_ROLE_ACTIVATIONS))
    fail_msg("output on %s: %s", r->dev->name, fsdp_error_msg());
  assert_true(r->nt < MAX_T);
  r->t[r->nt++] = t;
  keep_out(r, t, NULL, dt, n);
  return fsdp_tensor_data(t, "test");
}
static void *out(run *r, int64_t n) { return out_dt(r, r->dt, n); }
/* an output the slot adds to (+=): starts with drawn values */
static void *acc_dt(run *r, fsdp_dtype dt, int64_t n, gen g) {
  void *p = in_dt(r, dt, n, g);
  keep_out(r, r->t[r->nt - 1], NULL, dt, n);
  return p;
}
static void *acc(run *r, int64_t n, gen g) { return acc_dt(r, r->dt, n, g); }
/* an output in host memory (counts, sumsq, check_index's result), zeroed */
static void *host_out(run *r, fsdp_dtype dt, int64_t n) {
  void *p = keep_host(r, calloc((size_t)(n ? n : 1), fsdp_dtype_size(dt)));
  keep_out(r, NULL, p, dt, n);
  return p;
}

/* the outputs' values in host memory (out[k].host) */
static void run_read(run *r) {
  for (int k = 0; k < r->nout; k++) {
    if (!r->out[k].t) continue;
    if (fsdp_to_host(&r->out[k].read, r->out[k].t))
      fail_msg("reading an output from %s: %s", r->dev->name, fsdp_error_msg());
    r->out[k].host = fsdp_tensor_data(r->out[k].read, "test");
  }
}

static void run_free(run *r) {
  for (int k = 0; k < r->nout; k++) fsdp_tensor_release(r->out[k].read);
  for (int i = 0; i < r->nt; i++) fsdp_tensor_release(r->t[i]);
  for (int i = 0; i < r->nh; i++) free(r->h[i]);
  r->nt = r->nh = r->nout = 0;
}

static const fsdp_kernels_i *Kof(const run *r) {
  const fsdp_kernels_i *k = fsdp_kernels_of(r->dev, "test");
  if (!k) fail_msg("%s", fsdp_error_msg());
  return k;
}
#define K() Kof(r)
#define CTX (r->dev->ctx)
#define DT (r->dt)
#define BIG (r->big)

/* ---- the slots, one runner each (shapes: test_dtypes.c's, then the large ones) ------------ */

typedef int (*run_fn)(run *r, int arg);
#define N_EL (BIG ? 300007 : 37) /* elementwise length: no vector width divides it */

static int r_cast_to(run *r, int a) { /* f32 -> dt */
  const void *x = in_dt(r, FSDP_DTYPE_F32, N_EL, G_SIGNED);
  return K()->cast(CTX, out(r, N_EL), DT, x, FSDP_DTYPE_F32, N_EL);
}
static int r_cast_from(run *r, int a) { /* dt -> f32 */
  const void *x = in(r, N_EL, G_SIGNED);
  return K()->cast(CTX, out_dt(r, FSDP_DTYPE_F32, N_EL), FSDP_DTYPE_F32, x, DT, N_EL);
}
/* dst (R, C) <- src (C, R) transposed, and src's first row repeated (stride 0) */
static int r_copy_strided(run *r, int a) {
  int64_t R = BIG ? 301 : 4, C = BIG ? 257 : 3;
  const void *src = in(r, R * C, G_SIGNED);
  const int64_t shape[2] = {R, C}, ds[2] = {C, 1}, ss[2] = {1, R}, s0[2] = {0, 1};
  int rc = K()->copy_strided(CTX, DT, out(r, R * C), ds, src, ss, 2, shape);
  return rc ? rc : K()->copy_strided(CTX, DT, out(r, R * C), ds, src, s0, 2, shape);
}
static int r_add_strided(run *r, int a) { /* dst (R, C) += src (C, R) transposed */
  int64_t R = BIG ? 257 : 3, C = BIG ? 301 : 4;
  void *dst = acc(r, R * C, G_SIGNED);
  const void *src = in(r, R * C, G_SIGNED);
  const int64_t shape[2] = {R, C}, ds[2] = {C, 1}, ss[2] = {1, R};
  return K()->add_strided(CTX, DT, dst, ds, src, ss, 2, shape);
}
static int r_axpy(run *r, int a) {
  void *y = acc(r, N_EL, G_SIGNED);
  return K()->axpy(CTX, DT, y, in(r, N_EL, G_SIGNED), -2.0, N_EL);
}
static int r_scale(run *r, int a) { return K()->scale(CTX, DT, acc(r, N_EL, G_SIGNED), -1.5, N_EL); }
static int r_arange(run *r, int a) { return K()->arange(CTX, DT, out(r, N_EL), -2.0, 0.5, N_EL); }
static int r_random(run *r, int normal) {
  return K()->random(CTX, DT, out(r, N_EL), N_EL, 42, 7, normal, normal ? 0.5 : -1.0,
                     normal ? 2.0 : 3.0);
}

#define GM (BIG ? 67 : 3)
#define GN (BIG ? 129 : 4)
#define GK (BIG ? 257 : 5)
static int r_gemm(run *r, int a) { /* c = 1.5 a^T b + 0.5 c, and c2 = a2 b2^T */
  int M = GM, N = GN, Kd = GK;
  const void *at = in(r, Kd * M, G_SIGNED), *b = in(r, Kd * N, G_SIGNED);
  int rc = K()->gemm(CTX, DT, acc(r, M * N, G_SIGNED), at, b, M, N, Kd, true, false, 1.5f, 0.5f,
                     M, N, N);
  const void *a2 = in(r, M * Kd, G_SIGNED), *bt = in(r, N * Kd, G_SIGNED);
  return rc ? rc : K()->gemm(CTX, DT, out(r, M * N), a2, bt, M, N, Kd, false, true, 1.0f, 0.0f,
                             Kd, Kd, N);
}
#define GB (BIG ? 3 : 2)
static int r_bmm_forward(run *r, int a) {
  const void *x = in(r, GB * GM * GK, G_SIGNED), *y = in(r, GB * GK * GN, G_SIGNED);
  return K()->bmm_forward(CTX, DT, out(r, GB * GM * GN), x, y, GB, GM, GK, GN);
}
static int r_bmm_backward(run *r, int a) {
  void *da = acc(r, GB * GM * GK, G_SIGNED), *db = acc(r, GB * GK * GN, G_SIGNED);
  const void *g = in(r, GB * GM * GN, G_SIGNED), *x = in(r, GB * GM * GK, G_SIGNED),
             *y = in(r, GB * GK * GN, G_SIGNED);
  return K()->bmm_backward(CTX, DT, da, db, g, x, y, GB, GM, GK, GN);
}
static int r_linear_forward(run *r, int a) {
  const void *x = in(r, GM * GK, G_SIGNED), *w = in(r, GN * GK, G_SIGNED), *b = in(r, GN, G_SIGNED);
  return K()->linear_forward(CTX, DT, out(r, GM * GN), x, w, b, GM, GK, GN);
}
/* a weight gradient the slot adds to: in the row's dtype, or f32 (arg 1: mixed precision's f32
 * parameter gradients, the `gdt` of linear, layernorm and embedding) */
static fsdp_dtype wgdt(run *r, int f32) { return f32 ? FSDP_DTYPE_F32 : r->dt; }
static void *wacc(run *r, int f32, int64_t n, gen g) { return acc_dt(r, wgdt(r, f32), n, g); }
static int r_linear_backward(run *r, int a) {
  void *dx = acc(r, GM * GK, G_SIGNED), *dw = wacc(r, a, GN * GK, G_SIGNED),
       *db = wacc(r, a, GN, G_SIGNED);
  const void *g = in(r, GM * GN, G_SIGNED), *x = in(r, GM * GK, G_SIGNED),
             *w = in(r, GN * GK, G_SIGNED);
  return K()->linear_backward(CTX, DT, wgdt(r, a), dx, dw, db, g, x, w, GM, GK, GN);
}

/* binary ops: a (n) op b (m) repeating; b away from 0 for div */
#define BN (BIG ? 301 * 1001 : 12)
#define BM (BIG ? 301 : 4)
static int r_binary_forward(run *r, int op) {
  const void *x = in(r, BN, G_SIGNED), *y = in(r, BM, op == FSDP_BIN_DIV ? G_POS : G_SIGNED);
  return K()->binary_forward(CTX, DT, out(r, BN), x, y, BN, BM, (fsdp_binop)op);
}
static int r_binary_backward(run *r, int op) {
  void *da = acc(r, BN, G_SIGNED), *db = acc(r, BM, G_SIGNED);
  const void *g = in(r, BN, G_SIGNED), *x = in(r, BN, G_SIGNED),
             *y = in(r, BM, op == FSDP_BIN_DIV ? G_POS : G_SIGNED);
  return K()->binary_backward(CTX, DT, da, db, g, x, y, BN, BM, (fsdp_binop)op);
}
static int r_affine_forward(run *r, int a) {
  return K()->affine_forward(CTX, DT, out(r, N_EL), in(r, N_EL, G_SIGNED), -1.5, 2.0, N_EL);
}
static int r_affine_backward(run *r, int a) {
  void *da = acc(r, N_EL, G_SIGNED);
  return K()->affine_backward(CTX, DT, da, in(r, N_EL, G_SIGNED), -1.5, N_EL);
}
static gen unary_gen(int op) {
  return op == FSDP_UNARY_LOG || op == FSDP_UNARY_SQRT ? G_POS : G_SIGNED;
}
static int r_unary_forward(run *r, int op) {
  const void *x = in(r, N_EL, unary_gen(op));
  return K()->unary_forward(CTX, DT, (fsdp_unary_op)op, out(r, N_EL), x, N_EL);
}
static int r_unary_backward(run *r, int op) {
  void *d = acc(r, N_EL, G_SIGNED);
  const void *g = in(r, N_EL, G_SIGNED), *x = in(r, N_EL, unary_gen(op)), *y = in(r, N_EL, G_POS);
  return K()->unary_backward(CTX, DT, (fsdp_unary_op)op, d, g, x, y, N_EL);
}
static int r_pow_forward(run *r, int a) {
  return K()->pow_forward(CTX, DT, out(r, N_EL), in(r, N_EL, G_POS), 1.5, N_EL);
}
static int r_pow_backward(run *r, int a) {
  void *d = acc(r, N_EL, G_SIGNED);
  const void *g = in(r, N_EL, G_SIGNED);
  return K()->pow_backward(CTX, DT, d, g, in(r, N_EL, G_POS), 1.5, N_EL);
}
static int r_clamp_forward(run *r, int a) {
  return K()->clamp_forward(CTX, DT, out(r, N_EL), in(r, N_EL, G_SIGNED), -1.0, 1.5, N_EL);
}
static int r_clamp_backward(run *r, int a) {
  void *d = acc(r, N_EL, G_SIGNED);
  const void *g = in(r, N_EL, G_SIGNED);
  return K()->clamp_backward(CTX, DT, d, g, in(r, N_EL, G_SIGNED), -1.0, 1.5, N_EL);
}
static int r_compare(run *r, int a) { /* all six, a (n) against b (m) repeating */
  const void *x = in(r, BN, G_SIGNED), *y = in(r, BM, G_SIGNED);
  for (int op = FSDP_CMP_GT; op <= FSDP_CMP_NE; op++) {
    int rc = K()->compare(CTX, DT, (fsdp_cmpop)op, out_dt(r, FSDP_DTYPE_BOOL, BN), x, y, BN, BM);
    if (rc) return rc;
  }
  return FSDP_OK;
}
static int r_where(run *r, int a) {
  const void *c = in_dt(r, FSDP_DTYPE_BOOL, N_EL, G_BOOL), *x = in(r, N_EL, G_SIGNED),
             *y = in(r, N_EL, G_SIGNED);
  return K()->where(CTX, DT, out(r, N_EL), c, x, y, N_EL);
}
static int r_dropout_forward(run *r, int a) {
  const void *x = in(r, N_EL, G_SIGNED);
  return K()->dropout_forward(CTX, DT, out(r, N_EL), out(r, N_EL), x, N_EL, 0.3f, 99, 5);
}
static int r_dropout_backward(run *r, int a) {
  void *d = acc(r, N_EL, G_SIGNED);
  const void *g = in(r, N_EL, G_SIGNED);
  return K()->dropout_backward(CTX, DT, d, g, in(r, N_EL, G_POS), N_EL);
}
/* ids of dtype dt: in range, ignored ones (9), bad ones (7 and 5); the first bad one counts */
static int r_check_index(run *r, int a) {
  static const double small[] = {0, 1, 4, 9, 2, 7, 3};
  const int64_t ignore = 9;
  int64_t n = BIG ? 100003 : 7;
  double *ids = keep_host(r, malloc((size_t)n * sizeof(double)));
  if (BIG) {
    for (int64_t i = 0; i < n; i++) ids[i] = i % 11 == 3 ? 9 : (double)(i % 5);
    ids[99999] = 7, ids[80000] = 5, ids[77777] = 7; /* the first bad one is 77777 */
  } else {
    memcpy(ids, small, sizeof small);
  }
  int64_t *bad = host_out(r, FSDP_DTYPE_I64, 1);
  double *bad_value = host_out(r, FSDP_DTYPE_F64, 1);
  int rc = K()->check_index(CTX, DT, vals_dt(r, DT, n, ids), n, 0, 5, &ignore, bad, bad_value);
  if (!rc) assert_int_equal(*bad, BIG ? 77777 : 5);
  return rc;
}
/* ids: distinct rows (small, as test_dtypes.c), repeated rows (large: the scatter adds up) */
#define EN (BIG ? 4099 : 4)
#define EC (BIG ? 771 : 3)
#define EV (BIG ? 1000 : 5)
static double *emb_ids(run *r) {
  static const double ids5[] = {4, 0, 2, 1};
  double *ids = keep_host(r, malloc(EN * sizeof(double)));
  for (int64_t i = 0; i < EN; i++) ids[i] = BIG ? (double)((i * 37) % EV) : ids5[i];
  return ids;
}
static int r_embedding_forward(run *r, int a) {
  const void *w = in(r, EV * EC, G_SIGNED), *ids = vals_dt(r, FSDP_DTYPE_I64, EN, emb_ids(r));
  return K()->embedding_forward(CTX, DT, out(r, EN * EC), ids, FSDP_DTYPE_I64, w, EN, EC);
}
static int r_embedding_backward(run *r, int a) {
  void *dw = wacc(r, a, EV * EC, G_SIGNED);
  const void *g = in(r, EN * EC, G_SIGNED), *ids = vals_dt(r, FSDP_DTYPE_F32, EN, emb_ids(r));
  return K()->embedding_backward(CTX, DT, wgdt(r, a), dw, g, ids, FSDP_DTYPE_F32, EN, EC);
}
#define LN (BIG ? 67 : 3)
#define LC (BIG ? 1001 : 8)
static int r_layernorm_forward(run *r, int a) {
  const void *x = in(r, LN * LC, G_SIGNED), *w = in(r, LC, G_POS), *b = in(r, LC, G_SIGNED);
  float *mean = out_dt(r, FSDP_DTYPE_F32, LN), *rstd = out_dt(r, FSDP_DTYPE_F32, LN);
  return K()->layernorm_forward(CTX, DT, out(r, LN * LC), mean, rstd, x, w, b, LN, LC, 1e-5f);
}
static int r_layernorm_backward(run *r, int a) {
  void *dx = acc(r, LN * LC, G_SIGNED), *dw = wacc(r, a, LC, G_SIGNED), *db = wacc(r, a, LC, G_SIGNED);
  const void *g = in(r, LN * LC, G_SIGNED), *x = in(r, LN * LC, G_SIGNED), *w = in(r, LC, G_POS);
  const float *mean = in_dt(r, FSDP_DTYPE_F32, LN, G_SIGNED),
              *rstd = in_dt(r, FSDP_DTYPE_F32, LN, G_POS);
  return K()->layernorm_backward(CTX, DT, wgdt(r, a), dx, dw, db, g, x, w, mean, rstd, LN, LC);
}
#define SN (BIG ? 33 : 3)
#define SC (BIG ? 5003 : 7)
static int r_softmax_forward(run *r, int a) {
  return K()->softmax_forward(CTX, DT, out(r, SN * SC), in(r, SN * SC, G_SIGNED), SN, SC);
}
static int r_softmax_backward(run *r, int a) {
  void *d = acc(r, SN * SC, G_SIGNED);
  const void *g = in(r, SN * SC, G_SIGNED);
  return K()->softmax_backward(CTX, DT, d, g, in(r, SN * SC, G_UNIT), SN, SC);
}

/* attention: each device's backward reads its own forward's saved state, in the layout its
 * attention_saved gives, so forward and backward run in one row; the saved state itself is not
 * compared (the layouts differ). */
typedef struct {
  int B, T, C, NH;
} att_shape;
static att_shape att_cur = {1, 3, 4, 2};
static const att_shape att_big = {2, 129, 256, 4}; /* the matrix's large size: head size 64 */
static int run_attention(run *r, bool backward) {
  att_shape s = r->big ? att_big : att_cur;
  int64_t nq = (int64_t)s.B * s.T * 3 * s.C, no = (int64_t)s.B * s.T * s.C;
  fsdp_dtype sdt = FSDP_DTYPE_BOOL;
  int64_t ns = K()->attention_saved(CTX, DT, s.B, s.T, s.C, s.NH, &sdt);
  if (ns < 0) return FSDP_ERR;
  const void *qkv = in(r, nq, G_SIGNED);
  fsdp_tensor *saved;
  int64_t shape = ns ? ns : 1;
  if (fsdp_tensor_new(&saved, r->dev, sdt, 1, &shape, FSDP_ROLE_ACTIVATIONS))
    fail_msg("attention's saved state (%lld of %s): %s", (long long)ns, fsdp_dtype_name(sdt),
             fsdp_error_msg());
  assert_true(r->nt < MAX_T);
  r->t[r->nt++] = saved;
  void *o = out(r, no);
  int rc = K()->attention_forward(CTX, DT, o, fsdp_tensor_data(saved, "test"), qkv, s.B, s.T,
                                  s.C, s.NH);
  if (rc || !backward) return rc;
  void *d = acc(r, nq, G_SIGNED);
  const void *g = in(r, no, G_SIGNED);
  return K()->attention_backward(CTX, DT, d, g, qkv, fsdp_tensor_data(saved, "test"), s.B, s.T,
                                 s.C, s.NH, false);
}
static int r_attention_forward(run *r, int a) { return run_attention(r, false); }
static int r_attention_backward(run *r, int a) { return run_attention(r, true); }
/* the saved state's size: the probabilities (B, NH, T, T) of dt, a fused kernel's row
 * log-sum-exps (B, NH, T) f32, the rows' max and reciprocal sum (B, NH, T, 2) f32, or nothing
 * (kernels.h): each device may choose one of them, not a fifth */
static int r_attention_saved(run *r, int a) {
  if (!fsdp_dtype_is_float(DT)) return FSDP_OK; /* attention computes in floats only */
  att_shape s = BIG ? (att_shape){2, 65, 128, 2} : (att_shape){1, 3, 4, 2};
  fsdp_dtype sdt = FSDP_DTYPE_BOOL;
  int64_t n = K()->attention_saved(CTX, DT, s.B, s.T, s.C, s.NH, &sdt);
  int64_t probs = (int64_t)s.B * s.NH * s.T * s.T, lse = (int64_t)s.B * s.NH * s.T;
  if ((n == probs && sdt == DT) || ((n == lse || n == 2 * lse) && sdt == FSDP_DTYPE_F32) ||
      n == 0)
    return FSDP_OK;
  return fsdp_error("attention_saved: %lld elements of %s, neither the probabilities (%lld of "
                    "%s) nor the row log-sum-exps (%lld of f32) nor the rows' max and reciprocal "
                    "sum (%lld of f32) nor nothing", (long long)n, fsdp_dtype_name(sdt),
                    (long long)probs, fsdp_dtype_name(DT), (long long)lse, (long long)(2 * lse));
}
/* deterministic mode: the slot accepts both settings (left off) */
static int r_set_deterministic(run *r, int a) {
  if (!K()->set_deterministic) return FSDP_OK;
  return K()->set_deterministic(CTX, true) || K()->set_deterministic(CTX, false);
}
/* targets: -1 is ignored */
#define CN (BIG ? 67 : 4)
#define CV (BIG ? 50257 : 5)
static double *ce_targets(run *r, int64_t *count) {
  static const double t4[] = {0, 3, -1, 4};
  double *t = keep_host(r, malloc(CN * sizeof(double)));
  *count = 0;
  for (int64_t i = 0; i < CN; i++) {
    t[i] = BIG ? (i % 7 == 2 ? -1 : (double)((i * 7919) % CV)) : t4[i];
    *count += t[i] != -1;
  }
  return t;
}
static int r_cross_entropy_forward(run *r, int a) {
  int64_t counted;
  const void *logits = in(r, CN * CV, G_SIGNED),
             *t = vals_dt(r, FSDP_DTYPE_I64, CN, ce_targets(r, &counted));
  float *loss = out_dt(r, FSDP_DTYPE_F32, 1), *lse = out_dt(r, FSDP_DTYPE_F32, CN);
  int64_t *count = host_out(r, FSDP_DTYPE_I64, 1);
  return K()->cross_entropy_forward(CTX, DT, loss, lse, logits, t, FSDP_DTYPE_I64, CN, CV, -1,
                                    count);
}
static int r_cross_entropy_backward(run *r, int a) {
  void *d = acc(r, CN * CV, G_SIGNED);
  static const double dl[] = {1.5};
  const float *dloss = vals_dt(r, FSDP_DTYPE_F32, 1, dl);
  /* lse consistent with the logits is not needed: both devices get the same numbers */
  int64_t count;
  const void *logits = in(r, CN * CV, G_SIGNED), *lse = in_dt(r, FSDP_DTYPE_F32, CN, G_POS),
             *t = vals_dt(r, FSDP_DTYPE_I64, CN, ce_targets(r, &count));
  return K()->cross_entropy_backward(CTX, DT, d, dloss, logits, lse, t, FSDP_DTYPE_I64, CN, CV,
                                     -1, count);
}
static int r_mse_forward(run *r, int a) {
  const void *x = in(r, N_EL, G_SIGNED), *y = in(r, N_EL, G_SIGNED);
  return K()->mse_forward(CTX, DT, out_dt(r, FSDP_DTYPE_F32, 1), x, y, N_EL);
}
static int r_mse_backward(run *r, int a) {
  void *da = acc(r, N_EL, G_SIGNED), *db = acc(r, N_EL, G_SIGNED);
  static const double dl[] = {0.7};
  const float *dloss = vals_dt(r, FSDP_DTYPE_F32, 1, dl);
  const void *x = in(r, N_EL, G_SIGNED), *y = in(r, N_EL, G_SIGNED);
  return K()->mse_backward(CTX, DT, da, db, dloss, x, y, N_EL);
}
static int r_sum(run *r, int mean) { /* floats sum to their dtype, integers to i64 */
  fsdp_dtype odt = fsdp_dtype_is_float(DT) ? DT : FSDP_DTYPE_I64;
  const void *x = in(r, N_EL, G_SIGNED);
  return K()->sum(CTX, DT, out_dt(r, odt, 1), x, N_EL, mean);
}
static int r_sumsq(run *r, int a) {
  const void *x = in(r, N_EL, G_SIGNED);
  return K()->sumsq(CTX, DT, host_out(r, FSDP_DTYPE_F64, 1), x, N_EL);
}
#define DO (BIG ? 5 : 2)
#define DR (BIG ? 2003 : 3)
#define DI (BIG ? 3 : 4)
static int r_sum_dim_forward(run *r, int a) { /* (outer, R, inner) over the middle */
  return K()->sum_dim_forward(CTX, DT, out(r, DO * DI), in(r, DO * DR * DI, G_SIGNED), DO, DR, DI,
                              1.0);
}
static int r_sum_dim_backward(run *r, int a) {
  void *d = acc(r, DO * DR * DI, G_SIGNED);
  return K()->sum_dim_backward(CTX, DT, d, in(r, DO * DI, G_SIGNED), DO, DR, DI, 0.5);
}
#define XO (BIG ? 3 : 2)
#define XR (BIG ? 4001 : 5)
#define XI (BIG ? 5 : 3)
static int r_extreme_dim(run *r, int max) { /* (outer, R, inner) over the middle; ties in bf16 */
  const void *x = in(r, XO * XR * XI, G_SIGNED);
  int64_t *idx = out_dt(r, FSDP_DTYPE_I64, XO * XI);
  return K()->extreme_dim(CTX, DT, max, out(r, XO * XI), idx, x, XO, XR, XI);
}
#define TK (BIG ? 17 : 2)
static int r_topk(run *r, int largest) {
  const void *x = in(r, XO * XR * XI, G_SIGNED);
  int64_t *idx = out_dt(r, FSDP_DTYPE_I64, XO * TK * XI);
  return K()->topk(CTX, DT, out(r, XO * TK * XI), idx, x, XO, XR, XI, TK, largest);
}
static int r_index_add_dim(run *r, int a) { /* dout (outer, K, inner) into R, indices repeat */
  static const double small[] = {4, 0, 2, 1, 1, 3, 0, 2, 3, 3, 4, 0}; /* (2, 2, 3) into R = 5 */
  int64_t O = BIG ? 3 : 2, R = BIG ? 501 : 5, I = BIG ? 7 : 3, Kk = BIG ? 1000 : 2;
  double *index = keep_host(r, malloc((size_t)(O * Kk * I) * sizeof(double)));
  for (int64_t i = 0; i < O * Kk * I; i++) index[i] = BIG ? (double)((i * 131) % R) : small[i];
  void *d = acc(r, O * R * I, G_SIGNED);
  const void *g = in(r, O * Kk * I, G_SIGNED);
  const int64_t *ix = vals_dt(r, FSDP_DTYPE_I64, O * Kk * I, index);
  return K()->index_add_dim(CTX, DT, d, g, ix, O, R, I, Kk);
}
static int r_sgd_step(run *r, int a) {
  void *p = acc(r, N_EL, G_SIGNED), *buf = acc(r, N_EL, G_SIGNED);
  return K()->sgd_step(CTX, DT, p, buf, in(r, N_EL, G_SIGNED), N_EL, 0.1f, 0.9f, 0.01f, false);
}
static int r_adamw_step(run *r, int a) {
  void *p = acc(r, N_EL, G_SIGNED), *m = acc(r, N_EL, G_SIGNED), *v = acc(r, N_EL, G_POS);
  return K()->adamw_step(CTX, DT, p, m, v, in(r, N_EL, G_SIGNED), N_EL, 1e-2f, 0.9f, 0.99f,
                         1e-8f, 0.01f, 0.75f, 3);
}

/* fill and the masks / magnitude-pruning helpers (counts land in host i64 outputs) */
static int r_fill(run *r, int a) { return K()->fill(CTX, DT, out(r, N_EL), -1.75, N_EL); }
static void *host_i64(run *r, int64_t n) { return host_out(r, FSDP_DTYPE_I64, n); }
static int r_mask_apply(run *r, int a) {
  const void *m = in(r, N_EL, G_BOOL);
  return K()->mask_apply(CTX, DT, acc(r, N_EL, G_SIGNED), m, N_EL);
}
static int r_count_zeros(run *r, int a) {
  return K()->count_zeros(CTX, DT, host_i64(r, 1), in(r, N_EL, G_BOOL), N_EL);
}
static int r_mask_check(run *r, int a) {
  int64_t *cnt = host_i64(r, 3);
  uint32_t hash = 0;
  int rc = K()->mask_check(CTX, DT, cnt, cnt + 1, &hash, in(r, N_EL, G_BOOL), N_EL);
  cnt[2] = hash;
  return rc;
}
static int r_mask_from_nonzero(run *r, int a) {
  const void *x = in(r, N_EL, G_BOOL);
  return K()->mask_from_nonzero(CTX, DT, out(r, N_EL), host_i64(r, 1), x, N_EL);
}
static int r_mask_hist(run *r, int a) {
  const void *x = in(r, N_EL, G_SIGNED), *m = in(r, N_EL, G_BOOL);
  return K()->mask_hist(CTX, DT, host_i64(r, 256), x, m, N_EL, 0, 24, 8);
}
static int r_mask_hist_pos(run *r, int a) {
  const void *x = in(r, N_EL, G_BOOL);
  return K()->mask_hist_pos(CTX, DT, host_i64(r, 16), x, NULL, N_EL, 0x3f800001u, 5, 0, 0, 4);
}
static int r_mask_select(run *r, int a) {
  const void *x = in(r, N_EL, G_SIGNED);
  return K()->mask_select(CTX, DT, out(r, N_EL), host_i64(r, 1), x, NULL, N_EL, 0x3f800001u, 0,
                          3);
}
static int r_mask_nm(run *r, int a) {
  const void *x = in(r, N_EL, G_SIGNED);
  return K()->mask_nm(CTX, DT, acc(r, N_EL, G_BOOL), host_i64(r, 1), x, NULL, N_EL, 2, 4, 1);
}
/* three ranks' buffers folded (sum, or max), and in place into the first of two */
static int r_reduce_ranks(run *r, int a) {
  const void *src[3] = {in(r, N_EL, G_SIGNED), in(r, N_EL, G_SIGNED), in(r, N_EL, G_SIGNED)};
  int rc = K()->reduce_ranks(CTX, DT, a ? FSDP_RED_MAX : FSDP_RED_AVG, out(r, N_EL), src, 3, N_EL);
  if (rc) return rc;
  void *inplace = acc(r, N_EL, G_SIGNED);
  const void *src2[2] = {inplace, src[1]};
  return K()->reduce_ranks(CTX, DT, FSDP_RED_SUM, inplace, src2, 2, N_EL);
}
static int r_mask_values(run *r, int a) {
  const void *x = in(r, N_EL, G_SIGNED), *m = in(r, N_EL, G_BOOL);
  return K()->mask_values(CTX, DT, out(r, N_EL), x, m, N_EL);
}

/* ---- the rows ------------------------------------------------------------------------------ */

typedef struct {
  const char *slot;
  run_fn fn;
  int arg;
  unsigned must; /* dtypes the device computes wherever the cpu does */
} row;

static const row rows[] = {
    {"cast dtype -> f32", r_cast_from, 0, MUST},
    {"cast f32 -> dtype", r_cast_to, 0, MUST},
    {"copy_strided", r_copy_strided, 0, MUST},
    {"add_strided", r_add_strided, 0, MUST},
    {"axpy", r_axpy, 0, MUST},
    {"scale", r_scale, 0, MUST},
    {"arange", r_arange, 0, MUST},
    {"random normal", r_random, 1, MUST},
    {"random uniform", r_random, 0, MUST},
    {"gemm", r_gemm, 0, MUST},
    {"bmm_forward", r_bmm_forward, 0, MUST},
    {"bmm_backward", r_bmm_backward, 0, MUST},
    {"linear_forward", r_linear_forward, 0, MUST},
    {"linear_backward", r_linear_backward, 0, MUST},
    {"linear_backward, f32 wgrads", r_linear_backward, 1, MUST},
    {"binary_forward add", r_binary_forward, FSDP_BIN_ADD, MUST},
    {"binary_forward sub", r_binary_forward, FSDP_BIN_SUB, MUST},
    {"binary_forward mul", r_binary_forward, FSDP_BIN_MUL, MUST},
    {"binary_forward div", r_binary_forward, FSDP_BIN_DIV, MUST},
    {"binary_backward add", r_binary_backward, FSDP_BIN_ADD, MUST},
    {"binary_backward sub", r_binary_backward, FSDP_BIN_SUB, MUST},
    {"binary_backward mul", r_binary_backward, FSDP_BIN_MUL, MUST},
    {"binary_backward div", r_binary_backward, FSDP_BIN_DIV, MUST},
    {"affine_forward", r_affine_forward, 0, MUST},
    {"affine_backward", r_affine_backward, 0, MUST},
    {"unary_forward relu", r_unary_forward, FSDP_UNARY_RELU, MUST},
    {"unary_forward gelu", r_unary_forward, FSDP_UNARY_GELU, MUST},
    {"unary_forward exp", r_unary_forward, FSDP_UNARY_EXP, MUST},
    {"unary_forward log", r_unary_forward, FSDP_UNARY_LOG, MUST},
    {"unary_forward sqrt", r_unary_forward, FSDP_UNARY_SQRT, MUST},
    {"unary_forward tanh", r_unary_forward, FSDP_UNARY_TANH, MUST},
    {"unary_forward sigmoid", r_unary_forward, FSDP_UNARY_SIGMOID, MUST},
    {"unary_forward abs", r_unary_forward, FSDP_UNARY_ABS, MUST},
    {"unary_forward sign", r_unary_forward, FSDP_UNARY_SIGN, MUST},
    {"unary_backward relu", r_unary_backward, FSDP_UNARY_RELU, MUST},
    {"unary_backward gelu", r_unary_backward, FSDP_UNARY_GELU, MUST},
    {"unary_backward exp", r_unary_backward, FSDP_UNARY_EXP, MUST},
    {"unary_backward log", r_unary_backward, FSDP_UNARY_LOG, MUST},
    {"unary_backward sqrt", r_unary_backward, FSDP_UNARY_SQRT, MUST},
    {"unary_backward tanh", r_unary_backward, FSDP_UNARY_TANH, MUST},
    {"unary_backward sigmoid", r_unary_backward, FSDP_UNARY_SIGMOID, MUST},
    {"unary_backward abs", r_unary_backward, FSDP_UNARY_ABS, MUST},
    {"unary_backward sign", r_unary_backward, FSDP_UNARY_SIGN, MUST},
    {"pow_forward", r_pow_forward, 0, MUST},
    {"pow_backward", r_pow_backward, 0, MUST},
    {"clamp_forward", r_clamp_forward, 0, MUST},
    {"clamp_backward", r_clamp_backward, 0, MUST},
    {"compare (all six)", r_compare, 0, MUST},
    {"where", r_where, 0, MUST},
    {"dropout_forward", r_dropout_forward, 0, MUST},
    {"dropout_backward", r_dropout_backward, 0, MUST},
    /* check_index's dtype is the ids': i64 is what models feed it */
    {"check_index", r_check_index, 0, MUST | B_(I64)},
    {"embedding_forward", r_embedding_forward, 0, MUST},
    {"embedding_backward", r_embedding_backward, 0, MUST},
    {"embedding_backward, f32 wgrads", r_embedding_backward, 1, MUST},
    {"layernorm_forward", r_layernorm_forward, 0, MUST},
    {"layernorm_backward", r_layernorm_backward, 0, MUST},
    {"layernorm_backward, f32 wgrads", r_layernorm_backward, 1, MUST},
    {"softmax_forward", r_softmax_forward, 0, MUST},
    {"softmax_backward", r_softmax_backward, 0, MUST},
    {"attention_saved", r_attention_saved, 0, MUST},
    {"attention_forward", r_attention_forward, 0, MUST},
    {"attention fwd + backward", r_attention_backward, 0, MUST},
    {"cross_entropy_forward", r_cross_entropy_forward, 0, MUST},
    {"cross_entropy_backward", r_cross_entropy_backward, 0, MUST},
    {"mse_forward", r_mse_forward, 0, MUST},
    {"mse_backward", r_mse_backward, 0, MUST},
    {"sum", r_sum, 0, MUST},
    {"sum (mean)", r_sum, 1, MUST},
    {"sumsq", r_sumsq, 0, MUST},
    {"sum_dim_forward", r_sum_dim_forward, 0, MUST},
    {"sum_dim_backward", r_sum_dim_backward, 0, MUST},
    {"extreme_dim max", r_extreme_dim, 1, MUST},
    {"extreme_dim min", r_extreme_dim, 0, MUST},
    {"topk largest", r_topk, 1, MUST},
    {"topk smallest", r_topk, 0, MUST},
    {"index_add_dim", r_index_add_dim, 0, MUST},
    {"sgd_step", r_sgd_step, 0, MUST},
    {"adamw_step", r_adamw_step, 0, MUST},
    {"fill", r_fill, 0, MUST},
    {"mask_apply", r_mask_apply, 0, MUST},
    {"count_zeros", r_count_zeros, 0, MUST},
    {"mask_check", r_mask_check, 0, MUST},
    {"mask_from_nonzero", r_mask_from_nonzero, 0, MUST},
    {"mask_hist", r_mask_hist, 0, MUST},
    {"mask_hist_pos", r_mask_hist_pos, 0, MUST},
    {"mask_select", r_mask_select, 0, MUST},
    {"mask_nm", r_mask_nm, 0, MUST},
    {"mask_values", r_mask_values, 0, MUST},
    {"reduce_ranks avg", r_reduce_ranks, 0, MUST | B_(F64)},
    {"reduce_ranks max", r_reduce_ranks, 1, MUST | B_(F64) | B_(I64)},
    {"set_deterministic", r_set_deterministic, 0, MUST},
};
#define NROWS ((int)(sizeof rows / sizeof rows[0]))

/* ---- checking one row ---------------------------------------------------------------------- */

typedef enum { R_OK, R_REFUSED_BOTH, R_REFUSED_HERE, R_FAIL } verdict;

static char why[1024];

static void run_init(run *r, const fsdp_device_i *dev, fsdp_dtype dt, bool big) {
  memset(r, 0, sizeof *r);
  r->dev = dev, r->dt = dt, r->big = big, r->rng = 0x9e3779b97f4a7c15ull;
}

/* the cpu's refusal, with its device named as `dev` names it */
static void refusal_for(char *out, size_t n, const char *cpu_msg, const char *dev) {
  const char *at = strstr(cpu_msg, " on cpu");
  if (!at || at[7] != '\0') {
    snprintf(out, n, "%s", cpu_msg);
    return;
  }
  snprintf(out, n, "%.*s on %s", (int)(at - cpu_msg), cpu_msg, dev);
}

/* Row rw in dtype dt at one size on the cpu and on `dev` (whose refusals name `refuser`). */
static verdict check_row_on(const row *rw, fsdp_dtype dt, bool big, const fsdp_device_i *dev,
                            const char *refuser) {
  const char *name = fsdp_dtype_name(dt);
  run ref, got;
  run_init(&ref, &fsdp_device_cpu, dt, big);
  run_init(&got, dev, dt, big);
  fsdp_error_clear();
  int rc_ref = rw->fn(&ref, rw->arg);
  char cpu_msg[512];
  snprintf(cpu_msg, sizeof cpu_msg, "%s", rc_ref ? fsdp_error_msg() : "");
  fsdp_error_clear();
  int rc = rw->fn(&got, rw->arg);
  const char *msg = rc ? fsdp_error_msg() : "";
  verdict v = R_OK;
  if (rc_ref) {
    char want[600];
    refusal_for(want, sizeof want, cpu_msg, refuser);
    if (!strstr(cpu_msg, "has no kernel for")) {
      snprintf(why, sizeof why, "%s, %s: the cpu failed: %.300s", rw->slot, name, cpu_msg);
      v = R_FAIL;
    } else if (!rc || strcmp(msg, want) != 0) {
      snprintf(why, sizeof why, "%s, %s: the cpu refuses (\"%.200s\"), %s: expected \"%.200s\", "
               "got %s \"%.200s\"", rw->slot, name, cpu_msg, dev->name, want,
               rc ? "an error" : "success", msg);
      v = R_FAIL;
    } else {
      v = R_REFUSED_BOTH;
    }
  } else if (rc) {
    char want_prefix[64];
    snprintf(want_prefix, sizeof want_prefix, "has no kernel for %s on %s", name, refuser);
    if ((rw->must & (1u << dt)) || !strstr(msg, want_prefix)) {
      snprintf(why, sizeof why, "%s, %s: works on the cpu, fails on %s: %.300s", rw->slot, name,
               dev->name, msg);
      v = R_FAIL;
    } else {
      v = R_REFUSED_HERE;
    }
  } else {
    run_read(&ref);
    run_read(&got);
    assert_int_equal(ref.nout, got.nout);
    for (int k = 0; k < got.nout && v == R_OK; k++) {
      assert_int_equal(ref.out[k].n, got.out[k].n);
      char what[128];
      snprintf(what, sizeof what, "%s, %s%s, output %d", rw->slot, name, big ? " (large)" : "", k);
      if (ct_compare(what, dev->name, got.out[k].dt, got.out[k].host, ref.out[k].host, got.out[k].n, why,
                     sizeof why))
        v = R_FAIL;
    }
  }
  run_free(&ref);
  run_free(&got);
  return v;
}

static verdict check_row(const row *rw, fsdp_dtype dt, bool big) {
  return check_row_on(rw, dt, big, ct_dev, ct_refuser);
}

/* ---- the matrix ------------------------------------------------------------------------------ */

static void test_matrix(void **state) {
  (void)state;
  static const char *mark[] = {"yes", "-", "ref", "FAIL"};
  printf("  %-32s", "slot \\ dtype");
  for (int d = 0; d < FSDP_DTYPE_COUNT; d++) printf(" %5s", fsdp_dtype_name((fsdp_dtype)d));
  printf(" %6s %6s\n", "f32 L", "bf16 L");
  ct_compared = 0;
  int failed = 0;
  char first[sizeof why] = "";
  for (int i = 0; i < NROWS; i++) {
    printf("  %-32s", rows[i].slot);
    for (int d = 0; d < FSDP_DTYPE_COUNT + 2; d++) {
      bool big = d >= FSDP_DTYPE_COUNT;
      fsdp_dtype dt = big ? (d == FSDP_DTYPE_COUNT ? FSDP_DTYPE_F32 : FSDP_DTYPE_BF16) : (fsdp_dtype)d;
      verdict v = check_row(&rows[i], dt, big);
      printf(big ? " %6s" : " %5s", mark[v]);
      fflush(stdout);
      if (v == R_FAIL) {
        if (!failed++) snprintf(first, sizeof first, "%s", why);
        fprintf(stderr, "  %s\n", why);
      }
    }
    printf("\n");
  }
  printf("  %ld elements compared; yes: both compute and agree, -: both refuse, ref: the cpu "
         "computes and %s refuses, L: large sizes\n", ct_compared, ct_dev->name);
  if (failed) fail_msg("%d (slot, dtype) pairs fail; the first: %s", failed, first);
  assert_true(ct_compared > 1000000);
}

/* Attention at T in {1, 63, 64, 65, 1024} and head sizes {32, 64, 128} (2 heads, batch 2),
 * f32 and bf16, forward and backward. */
static void test_attention_sizes(void **state) {
  (void)state;
  static const int Ts[] = {1, 63, 64, 65, 1024}, HS[] = {32, 64, 128};
  const row *fwd = NULL, *bwd = NULL;
  for (int i = 0; i < NROWS; i++) {
    if (rows[i].fn == r_attention_forward) fwd = &rows[i];
    if (rows[i].fn == r_attention_backward) bwd = &rows[i];
  }
  assert_true(fwd && bwd);
  int failed = 0, ran = 0;
  char first[sizeof why] = "";
  for (size_t t = 0; t < sizeof Ts / sizeof Ts[0]; t++)
    for (size_t h = 0; h < sizeof HS / sizeof HS[0]; h++)
      for (int d = 0; d < 2; d++) {
        if (ct_quick() && Ts[t] == 1024) continue;
        fsdp_dtype dt = d ? FSDP_DTYPE_BF16 : FSDP_DTYPE_F32;
        att_cur = (att_shape){2, Ts[t], 2 * HS[h], 2};
        const row *rs[2] = {fwd, bwd};
        for (int k = 0; k < 2; k++) {
          verdict v = check_row(rs[k], dt, false);
          ran++;
          if (v != R_OK) {
            if (v != R_FAIL) snprintf(why, sizeof why, "refused");
            char line[sizeof why];
            snprintf(line, sizeof line, "T %d, head size %d, %s: %.900s", Ts[t], HS[h],
                     fsdp_dtype_name(dt), why);
            if (!failed++) snprintf(first, sizeof first, "%s", line);
            fprintf(stderr, "  %s\n", line);
          }
        }
        printf("  attention B 2, T %4d, 2 heads of %3d, %-4s: %s\n", Ts[t], HS[h],
               fsdp_dtype_name(dt), failed ? "FAIL so far" : "ok");
      }
  att_cur = (att_shape){1, 3, 4, 2};
  if (failed) fail_msg("%d of %d attention cases fail; the first: %s", failed, ran, first);
}

/* ---- deterministic mode: every row twice on the device gives the same bits ------------------ */

static void test_deterministic(void **state) {
  (void)state;
  bool prev = fsdp_kernels_set_deterministic(true);
  int failed = 0, compared = 0;
  static const fsdp_dtype dts[] = {FSDP_DTYPE_F32, FSDP_DTYPE_BF16};
  for (int i = 0; i < NROWS; i++)
    for (int d = 0; d < 2; d++) {
      if (rows[i].fn == r_set_deterministic) continue; /* it would turn the mode off */
      run a, b;
      run_init(&a, ct_dev, dts[d], true);
      run_init(&b, ct_dev, dts[d], true);
      int ra = rows[i].fn(&a, rows[i].arg), rb = rows[i].fn(&b, rows[i].arg);
      if (ra || rb) { /* refusals are the matrix's business */
        run_free(&a), run_free(&b);
        continue;
      }
      run_read(&a), run_read(&b);
      for (int k = 0; k < a.nout; k++) {
        compared++;
        if (!ct_same_bits(a.out[k].host, b.out[k].host, a.out[k].dt, a.out[k].n)) {
          fprintf(stderr, "  %s, %s (large), output %d: two runs differ in deterministic mode\n",
                  rows[i].slot, fsdp_dtype_name(dts[d]), k);
          failed++;
        }
      }
      run_free(&a), run_free(&b);
    }
  /* attention backward at a long sequence, where a fused kernel would reduce across blocks */
  att_cur = ct_quick() ? (att_shape){2, 65, 128, 2} : (att_shape){2, 1024, 128, 2};
  for (int d = 0; d < 2; d++) {
    run a, b;
    run_init(&a, ct_dev, dts[d], false);
    run_init(&b, ct_dev, dts[d], false);
    assert_int_equal(r_attention_backward(&a, 0) || r_attention_backward(&b, 0), FSDP_OK);
    run_read(&a), run_read(&b);
    for (int k = 0; k < a.nout; k++, compared++)
      if (!ct_same_bits(a.out[k].host, b.out[k].host, a.out[k].dt, a.out[k].n)) {
        fprintf(stderr, "  attention T %d, %s, output %d: two runs differ in deterministic mode\n",
                att_cur.T, fsdp_dtype_name(dts[d]), k);
        failed++;
      }
    run_free(&a), run_free(&b);
  }
  att_cur = (att_shape){1, 3, 4, 2};
  fsdp_kernels_set_deterministic(prev);
  printf("  %d outputs compared bit for bit between two runs\n", compared);
  if (failed) fail_msg("%d outputs differ between two runs in deterministic mode", failed);
  assert_true(compared > 150);
}

/* ---- the checker catches each way a device can be wrong -------------------------------------

 * A device "wrong" with the cpu's kernels but for: binary_forward 10% off in bf16, unary gelu 1
 * part in 1e4 off in f32, tanh refusing bf16, sgd_step refusing f32, and abs computing (not
 * refusing) bool. */

static int wrong_binary(void *ctx, fsdp_dtype dt, void *out, const void *a, const void *b,
                        int64_t n, int64_t m, fsdp_binop op) {
  int rc = fsdp_cpu_kernels.binary_forward(ctx, dt, out, a, b, n, m, op);
  if (!rc && dt == FSDP_DTYPE_BF16)
    for (int64_t i = 0; i < n; i++) fsdp_dtype_store(out, dt, i, 1.1 * fsdp_dtype_load(out, dt, i));
  return rc;
}
static int wrong_unary(void *ctx, fsdp_dtype dt, fsdp_unary_op op, void *out, const void *in,
                       int64_t n) {
  if (op == FSDP_UNARY_ABS && dt == FSDP_DTYPE_BOOL) {
    memcpy(out, in, (size_t)n);
    return FSDP_OK;
  }
  if (op == FSDP_UNARY_TANH && dt == FSDP_DTYPE_BF16) return fsdp_kernels_refuse("tanh", dt, "cpu");
  int rc = fsdp_cpu_kernels.unary_forward(ctx, dt, op, out, in, n);
  if (!rc && op == FSDP_UNARY_GELU && dt == FSDP_DTYPE_F32) ((float *)out)[n / 2] *= 1.0001f;
  return rc;
}
static int wrong_sgd(void *ctx, fsdp_dtype dt, void *param, void *buf, const void *grad,
                     int64_t n, float lr, float momentum, float wd, bool first) {
  return fsdp_kernels_refuse("sgd_step", dt, "cpu");
}
static fsdp_kernels_i wrong_kernels;
static fsdp_device_i wrong_device;

static void test_checker_catches(void **state) {
  (void)state;
  wrong_kernels = fsdp_cpu_kernels;
  wrong_kernels.binary_forward = wrong_binary;
  wrong_kernels.unary_forward = wrong_unary;
  wrong_kernels.sgd_step = wrong_sgd;
  wrong_device = cpu2_device;
  wrong_device.name = "wrong";
  assert_int_equal(fsdp_device_register(&wrong_device, &wrong_kernels), FSDP_OK);
  const row add = {"binary_forward add", r_binary_forward, FSDP_BIN_ADD, MUST};
  assert_int_equal(check_row_on(&add, FSDP_DTYPE_F32, false, &wrong_device, "cpu"), R_OK);
  assert_int_equal(check_row_on(&add, FSDP_DTYPE_BF16, true, &wrong_device, "cpu"), R_FAIL);
  assert_non_null(strstr(why, "on wrong"));
  const row gelu = {"unary_forward gelu", r_unary_forward, FSDP_UNARY_GELU, MUST};
  assert_int_equal(check_row_on(&gelu, FSDP_DTYPE_F32, false, &wrong_device, "cpu"), R_FAIL);
  assert_non_null(strstr(why, "tolerance 1e-05"));
  assert_int_equal(check_row_on(&gelu, FSDP_DTYPE_BF16, false, &wrong_device, "cpu"), R_OK);
  const row sgd = {"sgd_step", r_sgd_step, 0, MUST};
  assert_int_equal(check_row_on(&sgd, FSDP_DTYPE_F32, false, &wrong_device, "cpu"), R_FAIL);
  assert_non_null(strstr(why, "works on the cpu, fails on wrong"));
  assert_int_equal(check_row_on(&sgd, FSDP_DTYPE_BF16, false, &wrong_device, "cpu"),
                   R_REFUSED_BOTH);
  /* a refusal naming another device than the one expected */
  assert_int_equal(check_row_on(&sgd, FSDP_DTYPE_BF16, false, &wrong_device, "cuda"), R_FAIL);
  assert_non_null(strstr(why, "has no kernel for bf16 on cuda"));
  const row abs_ = {"unary_forward abs", r_unary_forward, FSDP_UNARY_ABS, MUST};
  assert_int_equal(check_row_on(&abs_, FSDP_DTYPE_BOOL, false, &wrong_device, "cpu"), R_FAIL);
  assert_non_null(strstr(why, "got success"));
  /* a dtype outside `must` may be refused by the device, one inside may not */
  const row tanh_f32 = {"unary_forward tanh", r_unary_forward, FSDP_UNARY_TANH, B_(F32)};
  assert_int_equal(check_row_on(&tanh_f32, FSDP_DTYPE_BF16, false, &wrong_device, "cpu"),
                   R_REFUSED_HERE);
  const row tanh_ = {"unary_forward tanh", r_unary_forward, FSDP_UNARY_TANH, MUST};
  assert_int_equal(check_row_on(&tanh_, FSDP_DTYPE_BF16, false, &wrong_device, "cpu"), R_FAIL);
  assert_non_null(strstr(why, "works on the cpu, fails on wrong: op tanh has no kernel"));
  /* the comparison itself: NaN equals NaN, integers are exact, the floor scales with the output */
  float a[3] = {NAN, 1.0f, 1e-9f}, b[3] = {NAN, 1.0f, 2e-9f};
  assert_int_equal(ct_compare("t", "wrong", FSDP_DTYPE_F32, a, b, 3, NULL, 0), 0);
  int64_t i1[2] = {3, 4}, i2[2] = {3, 5};
  assert_int_equal(ct_compare("t", "wrong", FSDP_DTYPE_I64, i1, i2, 2, NULL, 0), 1);
  float c[2] = {1.0f, 1.00002f}, d[2] = {1.0f, 1.0f};
  assert_int_equal(ct_compare("t", "wrong", FSDP_DTYPE_F32, c, d, 2, NULL, 0), 1);
}

int main(void) {
  fsdp_kernels_init();
  /* the checker runs on the cpu alone, so it runs (and can fail) on every machine */
  const struct CMUnitTest self[] = {cmocka_unit_test(test_checker_catches)};
  int rc = cmocka_run_group_tests_name("checker", self, NULL, NULL);
  if (rc) return rc;
  rc = ct_pick_device();
  if (rc) return rc;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matrix),
      cmocka_unit_test(test_attention_sizes),
      cmocka_unit_test(test_deterministic),
  };
  return cmocka_run_group_tests_name("cuda slots", tests, NULL, NULL);
}
