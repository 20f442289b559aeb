/*
 * test_dtypes.c — the cpu kernel table (src/kernels/cpu/table.c) across dtypes ("dtype x op").
 *
 * For every slot of the table and every dtype, either the slot works and matches the f32 kernel
 * run on the same inputs rounded to that dtype (bf16 within 1e-2 relative, f16 1e-3, f64 1e-6 of
 * the output's scale, integers and bool exactly after the f32 result is stored in the dtype), or
 * it refuses with exactly "op <name> has no kernel for <dtype> on cpu". The support matrix is
 * written down once, in `rows` below, and printed by the test; docs/tensor.md's table follows it.
 * A new slot in kernels.h makes test_every_slot_has_rows fail until it gets rows here.
 *
 * Also: every cast pair against core's scalar rule (fsdp_dtype_store of fsdp_dtype_load), and
 * the bulk bf16 / f16 conversions (fsdp_cpu_*, fsdp_cpu_cast, the table's cast) against core's
 * scalar fsdp_f32_to_bf16 / fsdp_f32_to_f16 and their inverses, bit for bit, on every 16-bit
 * pattern, around every rounding boundary, and on random f32 bit patterns (NaN, infinities and
 * subnormals included).
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

#include "core/core.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"
#include "kernels/kernels.h"

/* ---- dtype sets ------------------------------------------------------------------------- */

#define B_(dt) (1u << FSDP_DTYPE_##dt)
#define F32 B_(F32)
#define HALF (B_(BF16) | B_(F16))
#define F32H (F32 | HALF)             /* f32 kernels, bf16/f16 by the conversion pass */
#define FLOATS (F32H | B_(F64))
#define INTS (B_(I64) | B_(I32) | B_(U8))
#define NUMS (FLOATS | INTS)          /* everything but bool */
#define ALL (NUMS | B_(BOOL))

/* ---- one run of a slot --------------------------------------------------------------------

 * A run computes in dtype dt with input values rounded to vt: the test run has dt = vt = the
 * dtype under test; its reference has dt = f32 and the same vt, so both see the same values.
 * Inputs come from one xorshift stream, so both runs draw the same numbers in the same order. */

#define MAX_BUF 40
#define MAX_OUT 8

typedef struct {
  fsdp_dtype dt, vt;
  uint64_t rng;
  int nbuf;
  void *buf[MAX_BUF];
  int nout;
  struct {
    const void *p;
    fsdp_dtype dt;
    int64_t n;
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

/* a value for vt: f32-representable (so an f64 run and its f32 reference see the same
 * numbers), then rounded to vt */
static double draw(run *r, gen g) {
  fsdp_dtype vt = r->vt;
  double v;
  if (g == G_BOOL) v = irand(r, 0, 1);
  else if (vt == FSDP_DTYPE_BOOL) v = g == G_POS ? 1 : irand(r, 0, 1);
  else if (!fsdp_dtype_is_float(vt))
    v = g == G_POS ? irand(r, 1, 6) : g == G_UNIT ? irand(r, 0, 1)
        : vt == FSDP_DTYPE_U8 ? irand(r, 0, 6) : irand(r, -3, 3);
  else
    v = (float)(g == G_POS ? 0.5 + 1.5 * urand(r) : g == G_UNIT ? urand(r) : -2 + 4 * urand(r));
  unsigned char b[8];
  fsdp_dtype_store(b, vt, 0, v);
  return fsdp_dtype_load(b, vt, 0);
}

static void *alloc(run *r, fsdp_dtype dt, int64_t n) {
  assert_true(r->nbuf < MAX_BUF);
  void *p = calloc((size_t)(n ? n : 1), fsdp_dtype_size(dt));
  assert_non_null(p);
  r->buf[r->nbuf++] = p;
  return p;
}

/* an input of dtype dt holding n drawn values */
static void *in_dt(run *r, fsdp_dtype dt, int64_t n, gen g) {
  void *p = alloc(r, dt, n);
  for (int64_t i = 0; i < n; i++) fsdp_dtype_store(p, dt, i, draw(r, g));
  return p;
}
static void *in(run *r, int64_t n, gen g) { return in_dt(r, r->dt, n, g); }

/* an input holding the given values (ids, targets, indices) */
static void *vals_dt(run *r, fsdp_dtype dt, int64_t n, const double *v) {
  void *p = alloc(r, dt, n);
  for (int64_t i = 0; i < n; i++) fsdp_dtype_store(p, dt, i, v[i]);
  return p;
}

static void *keep(run *r, void *p, fsdp_dtype dt, int64_t n) {
  assert_true(r->nout < MAX_OUT);
  r->out[r->nout].p = p;
  r->out[r->nout].dt = dt;
  r->out[r->nout].n = n;
  r->nout++;
  return p;
}
/* an output the slot writes whole */
static void *out_dt(run *r, fsdp_dtype dt, int64_t n) { return keep(r, alloc(r, dt, n), dt, n); }
static void *out(run *r, int64_t n) { return out_dt(r, r->dt, n); }
/* an output the slot adds to (+=): starts with drawn values */
static void *acc(run *r, int64_t n, gen g) { return keep(r, in(r, n, g), r->dt, n); }

static void run_free(run *r) {
  for (int i = 0; i < r->nbuf; i++) free(r->buf[i]);
  r->nbuf = r->nout = 0;
}

static const fsdp_kernels_i *K(void) {
  const fsdp_kernels_i *k = fsdp_kernels_of(&fsdp_device_cpu, "test");
  assert_non_null(k);
  return k;
}
#define CTX NULL /* the cpu's context */
#define DT (r->dt)

/* ---- the slots, one runner each ------------------------------------------------------------ */

typedef int (*run_fn)(run *r, int arg);
#define N_EL 37 /* elementwise length: no vector width divides it */

static int r_cast_to(run *r, int a) { /* f32 -> dt */
  const void *x = in_dt(r, FSDP_DTYPE_F32, N_EL, G_SIGNED);
  return K()->cast(CTX, out(r, N_EL), DT, x, FSDP_DTYPE_F32, N_EL);
}
static int r_cast_from(run *r, int a) { /* dt -> f32 */
  const void *x = in(r, N_EL, G_SIGNED);
  return K()->cast(CTX, out_dt(r, FSDP_DTYPE_F32, N_EL), FSDP_DTYPE_F32, x, DT, N_EL);
}
static int r_copy_strided(run *r, int a) { /* dst (4, 3) <- src (3, 4) transposed, and a row repeated */
  const void *src = in(r, 12, G_SIGNED);
  static const int64_t shape[2] = {4, 3}, ds[2] = {3, 1}, ss[2] = {1, 4}, s0[2] = {0, 1};
  int rc = K()->copy_strided(CTX, DT, out(r, 12), ds, src, ss, 2, shape);
  return rc ? rc : K()->copy_strided(CTX, DT, out(r, 12), ds, src, s0, 2, shape);
}
static int r_add_strided(run *r, int a) { /* dst (3, 4) += src (4, 3) transposed */
  void *dst = acc(r, 12, G_SIGNED);
  const void *src = in(r, 12, G_SIGNED);
  static const int64_t shape[2] = {3, 4}, ds[2] = {4, 1}, ss[2] = {1, 3};
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

enum { M_ = 3, N_ = 4, K_ = 5 };
static int r_gemm(run *r, int a) { /* c = 1.5 a^T b + 0.5 c, and c2 = a2 b2^T */
  const void *at = in(r, K_ * M_, G_SIGNED), *b = in(r, K_ * N_, G_SIGNED);
  int rc = K()->gemm(CTX, DT, acc(r, M_ * N_, G_SIGNED), at, b, M_, N_, K_, true, false, 1.5f,
                     0.5f, M_, N_, N_);
  const void *a2 = in(r, M_ * K_, G_SIGNED), *bt = in(r, N_ * K_, G_SIGNED);
  return rc ? rc : K()->gemm(CTX, DT, out(r, M_ * N_), a2, bt, M_, N_, K_, false, true, 1.0f,
                             0.0f, K_, K_, N_);
}
static int r_bmm_forward(run *r, int a) {
  const void *x = in(r, 2 * M_ * K_, G_SIGNED), *y = in(r, 2 * K_ * N_, G_SIGNED);
  return K()->bmm_forward(CTX, DT, out(r, 2 * M_ * N_), x, y, 2, M_, K_, N_);
}
static int r_bmm_backward(run *r, int a) {
  void *da = acc(r, 2 * M_ * K_, G_SIGNED), *db = acc(r, 2 * K_ * N_, G_SIGNED);
  const void *g = in(r, 2 * M_ * N_, G_SIGNED), *x = in(r, 2 * M_ * K_, G_SIGNED),
             *y = in(r, 2 * K_ * N_, G_SIGNED);
  return K()->bmm_backward(CTX, DT, da, db, g, x, y, 2, M_, K_, N_);
}
static int r_linear_forward(run *r, int a) {
  const void *x = in(r, M_ * K_, G_SIGNED), *w = in(r, N_ * K_, G_SIGNED), *b = in(r, N_, G_SIGNED);
  return K()->linear_forward(CTX, DT, out(r, M_ * N_), x, w, b, M_, K_, N_);
}
/* a weight gradient the slot adds to: in the row's dtype, or f32 (arg 1: mixed precision's
 * f32 parameter gradients, the `gdt` of linear, layernorm and embedding) */
static fsdp_dtype wgdt(run *r, int f32) { return f32 ? FSDP_DTYPE_F32 : r->dt; }
static void *wacc(run *r, int f32, int64_t n, gen g) {
  return keep(r, in_dt(r, wgdt(r, f32), n, g), wgdt(r, f32), n);
}
static int r_linear_backward(run *r, int a) {
  void *dx = acc(r, M_ * K_, G_SIGNED), *dw = wacc(r, a, N_ * K_, G_SIGNED),
       *db = wacc(r, a, N_, G_SIGNED);
  const void *g = in(r, M_ * N_, G_SIGNED), *x = in(r, M_ * K_, G_SIGNED), *w = in(r, N_ * K_, G_SIGNED);
  return K()->linear_backward(CTX, DT, wgdt(r, a), dx, dw, db, g, x, w, M_, K_, N_);
}

/* binary ops: a (12) op b (4) repeating; b away from 0 for div */
static int r_binary_forward(run *r, int op) {
  const void *x = in(r, 12, G_SIGNED), *y = in(r, 4, op == FSDP_BIN_DIV ? G_POS : G_SIGNED);
  return K()->binary_forward(CTX, DT, out(r, 12), x, y, 12, 4, (fsdp_binop)op);
}
static int r_binary_backward(run *r, int op) {
  void *da = acc(r, 12, G_SIGNED), *db = acc(r, 4, G_SIGNED);
  const void *g = in(r, 12, G_SIGNED), *x = in(r, 12, G_SIGNED),
             *y = in(r, 4, op == FSDP_BIN_DIV ? G_POS : G_SIGNED);
  return K()->binary_backward(CTX, DT, da, db, g, x, y, 12, 4, (fsdp_binop)op);
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
static int r_compare(run *r, int a) { /* all six, a (12) against b (4) repeating */
  const void *x = in(r, 12, G_SIGNED), *y = in(r, 4, G_SIGNED);
  for (int op = FSDP_CMP_GT; op <= FSDP_CMP_NE; op++) {
    int rc = K()->compare(CTX, DT, (fsdp_cmpop)op, out_dt(r, FSDP_DTYPE_BOOL, 12), x, y, 12, 4);
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
/* ids of dtype dt: in range, one ignored (9), one bad (7) */
static int r_check_index(run *r, int a) {
  static const double ids[] = {0, 1, 4, 9, 2, 7, 3};
  const int64_t ignore = 9;
  int64_t *bad = out_dt(r, FSDP_DTYPE_I64, 1);
  double *bad_value = out_dt(r, FSDP_DTYPE_F64, 1);
  int rc = K()->check_index(CTX, DT, vals_dt(r, DT, 7, ids), 7, 0, 5, &ignore, bad, bad_value);
  if (!rc) assert_int_equal(*bad, 5);
  return rc;
}
static const double ids5[] = {4, 0, 2, 1}; /* distinct rows (see embedding_backward's row) */
static int r_embedding_forward(run *r, int a) {
  const void *w = in(r, 5 * 3, G_SIGNED), *ids = vals_dt(r, FSDP_DTYPE_I64, 4, ids5);
  return K()->embedding_forward(CTX, DT, out(r, 4 * 3), ids, FSDP_DTYPE_I64, w, 4, 3);
}
static int r_embedding_backward(run *r, int a) {
  void *dw = wacc(r, a, 5 * 3, G_SIGNED);
  const void *g = in(r, 4 * 3, G_SIGNED), *ids = vals_dt(r, FSDP_DTYPE_F32, 4, ids5);
  return K()->embedding_backward(CTX, DT, wgdt(r, a), dw, g, ids, FSDP_DTYPE_F32, 4, 3);
}
static int r_layernorm_forward(run *r, int a) {
  const void *x = in(r, 3 * 8, G_SIGNED), *w = in(r, 8, G_POS), *b = in(r, 8, G_SIGNED);
  float *mean = out_dt(r, FSDP_DTYPE_F32, 3), *rstd = out_dt(r, FSDP_DTYPE_F32, 3);
  return K()->layernorm_forward(CTX, DT, out(r, 3 * 8), mean, rstd, x, w, b, 3, 8, 1e-5f);
}
static int r_layernorm_backward(run *r, int a) {
  void *dx = acc(r, 3 * 8, G_SIGNED), *dw = wacc(r, a, 8, G_SIGNED), *db = wacc(r, a, 8, G_SIGNED);
  const void *g = in(r, 3 * 8, G_SIGNED), *x = in(r, 3 * 8, G_SIGNED), *w = in(r, 8, G_POS);
  const float *mean = in_dt(r, FSDP_DTYPE_F32, 3, G_SIGNED), *rstd = in_dt(r, FSDP_DTYPE_F32, 3, G_POS);
  return K()->layernorm_backward(CTX, DT, wgdt(r, a), dx, dw, db, g, x, w, mean, rstd, 3, 8);
}
/* x + x: a sum every dtype holds exactly, so the f32 kernel on widened inputs is the reference
 * here too (bf16 and f16 normalise the sum as stored, rounded: test_half checks that against
 * the add and the layernorm one after the other) */
static int r_add_layernorm_forward(run *r, int a) {
  const void *x = in(r, 3 * 8, G_SIGNED), *w = in(r, 8, G_POS), *b = in(r, 8, G_SIGNED);
  float *mean = out_dt(r, FSDP_DTYPE_F32, 3), *rstd = out_dt(r, FSDP_DTYPE_F32, 3);
  void *sum = out(r, 3 * 8);
  return K()->add_layernorm_forward(CTX, DT, sum, out(r, 3 * 8), mean, rstd, x, x, w, b, 3, 8,
                                    1e-5f);
}
static int r_softmax_forward(run *r, int a) {
  return K()->softmax_forward(CTX, DT, out(r, 3 * 7), in(r, 3 * 7, G_SIGNED), 3, 7);
}
static int r_softmax_backward(run *r, int a) {
  void *d = acc(r, 3 * 7, G_SIGNED);
  const void *g = in(r, 3 * 7, G_SIGNED);
  return K()->softmax_backward(CTX, DT, d, g, in(r, 3 * 7, G_UNIT), 3, 7);
}
enum { AB = 1, AT = 3, AC = 4, AH = 2 };
/* Attention in bf16 by the widening way (the f32 kernel on widened rows, held to this file's
 * bf16 tolerance; no saved state is passed, so the f32 backward recomputes the rows whole, as
 * the half dtypes' always does; tests/c/test_kernels.c runs it from the rows' stats): with the processor's bf16 products (attention_bf16.c) its products read the
 * probabilities and score gradients rounded to bf16, and tests/c/test_half.c holds that way to
 * its own bounds. */
static int r_attention_forward(run *r, int a) {
  const void *qkv = in(r, AB * AT * 3 * AC, G_SIGNED);
  fsdp_cpu_bf16_gemm_force(0);
  int rc = K()->attention_forward(CTX, DT, out(r, AB * AT * AC), NULL, qkv, AB, AT, AC, AH);
  fsdp_cpu_bf16_gemm_force(-1);
  return rc;
}
static int r_attention_backward(run *r, int a) {
  void *d = acc(r, AB * AT * 3 * AC, G_SIGNED);
  const void *g = in(r, AB * AT * AC, G_SIGNED), *qkv = in(r, AB * AT * 3 * AC, G_SIGNED);
  fsdp_cpu_bf16_gemm_force(0);
  int rc = K()->attention_backward(CTX, DT, d, g, qkv, NULL, AB, AT, AC, AH, false);
  fsdp_cpu_bf16_gemm_force(-1);
  return rc;
}
/* the saved state: the cpu keeps each query row's softmax max and reciprocal sum ((B, NH, T, 2)
 * f32) for f32 and the half dtypes, nothing for the others; as outputs (i64, the same for every
 * dtype): whether the size is that, and whether the dtype is f32 */
static int r_attention_saved(run *r, int a) {
  fsdp_dtype sdt = FSDP_DTYPE_BOOL;
  int64_t n = K()->attention_saved(CTX, DT, AB, AT, AC, AH, &sdt);
  int64_t *o = out_dt(r, FSDP_DTYPE_I64, 2);
  const bool keeps = DT == FSDP_DTYPE_F32 || DT == FSDP_DTYPE_BF16 || DT == FSDP_DTYPE_F16;
  const int64_t want = keeps ? (int64_t)AB * AH * AT * 2 : 0;
  o[0] = n == want ? 1 : 0;
  o[1] = sdt == FSDP_DTYPE_F32 ? 1 : 0;
  return n == want && sdt == FSDP_DTYPE_F32
             ? FSDP_OK
             : fsdp_error("attention_saved: %lld of %s, want %lld of f32", (long long)n,
                          fsdp_dtype_name(sdt), (long long)want);
}
/* three ranks' buffers summed (and the same through max), out aliasing the first input too */
static int r_reduce_ranks(run *r, int a) {
  const void *src[3] = {in(r, N_EL, G_SIGNED), in(r, N_EL, G_SIGNED), in(r, N_EL, G_SIGNED)};
  int rc = K()->reduce_ranks(CTX, DT, a ? FSDP_RED_MAX : FSDP_RED_SUM, out(r, N_EL), src, 3, N_EL);
  void *inplace = acc(r, N_EL, G_SIGNED);
  const void *src2[2] = {inplace, src[1]};
  if (rc) return rc;
  return K()->reduce_ranks(CTX, DT, FSDP_RED_SUM, inplace, src2, 2, N_EL);
}
/* deterministic mode: the cpu is always deterministic; the slot accepts both settings */
static int r_set_deterministic(run *r, int a) {
  return K()->set_deterministic(CTX, true) || K()->set_deterministic(CTX, false);
}
static const double targets4[] = {0, 3, -1, 4};
static int r_cross_entropy_forward(run *r, int a) {
  const void *logits = in(r, 4 * 5, G_SIGNED), *t = vals_dt(r, FSDP_DTYPE_I64, 4, targets4);
  float *loss = out_dt(r, FSDP_DTYPE_F32, 1), *lse = out_dt(r, FSDP_DTYPE_F32, 4);
  int64_t *count = out_dt(r, FSDP_DTYPE_I64, 1);
  return K()->cross_entropy_forward(CTX, DT, loss, lse, logits, t, FSDP_DTYPE_I64, 4, 5, -1, count);
}
static int r_cross_entropy_backward(run *r, int a) {
  void *d = acc(r, 4 * 5, G_SIGNED);
  static const double dl[] = {1.5};
  const float *dloss = vals_dt(r, FSDP_DTYPE_F32, 1, dl);
  const void *logits = in(r, 4 * 5, G_SIGNED), *lse = in_dt(r, FSDP_DTYPE_F32, 4, G_POS),
             *t = vals_dt(r, FSDP_DTYPE_I64, 4, targets4);
  return K()->cross_entropy_backward(CTX, DT, d, dloss, logits, lse, t, FSDP_DTYPE_I64, 4, 5, -1, 3);
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
  return K()->sumsq(CTX, DT, out_dt(r, FSDP_DTYPE_F64, 1), x, N_EL);
}
static int r_sum_dim_forward(run *r, int a) { /* (2, 3, 4) over the middle */
  return K()->sum_dim_forward(CTX, DT, out(r, 2 * 4), in(r, 2 * 3 * 4, G_SIGNED), 2, 3, 4, 1.0);
}
static int r_sum_dim_backward(run *r, int a) {
  void *d = acc(r, 2 * 3 * 4, G_SIGNED);
  return K()->sum_dim_backward(CTX, DT, d, in(r, 2 * 4, G_SIGNED), 2, 3, 4, 0.5);
}
static int r_extreme_dim(run *r, int max) { /* (2, 5, 3) over the middle */
  const void *x = in(r, 2 * 5 * 3, G_SIGNED);
  int64_t *idx = out_dt(r, FSDP_DTYPE_I64, 2 * 3);
  return K()->extreme_dim(CTX, DT, max, out(r, 2 * 3), idx, x, 2, 5, 3);
}
static int r_topk(run *r, int largest) {
  const void *x = in(r, 2 * 5 * 3, G_SIGNED);
  int64_t *idx = out_dt(r, FSDP_DTYPE_I64, 2 * 2 * 3);
  return K()->topk(CTX, DT, out(r, 2 * 2 * 3), idx, x, 2, 5, 3, 2, largest);
}
static int r_index_add_dim(run *r, int a) {
  static const double index[] = {4, 0, 2, 1, 1, 3, 0, 2, 3, 3, 4, 0}; /* (2, 2, 3) into R = 5 */
  void *d = acc(r, 2 * 5 * 3, G_SIGNED);
  const void *g = in(r, 2 * 2 * 3, G_SIGNED);
  const int64_t *ix = vals_dt(r, FSDP_DTYPE_I64, 12, index);
  return K()->index_add_dim(CTX, DT, d, g, ix, 2, 5, 3, 2);
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
static int r_adamw_step_masked(run *r, int a) {
  void *p = acc(r, N_EL, G_SIGNED), *m = acc(r, N_EL, G_SIGNED), *v = acc(r, N_EL, G_POS);
  void *g = acc(r, N_EL, G_SIGNED);
  return K()->adamw_step_masked(CTX, DT, p, m, v, g, in(r, N_EL, G_BOOL), N_EL, 1e-2f, 0.9f,
                                0.99f, 1e-8f, 0.01f, 0.75f, 3);
}
static int r_bias_gelu_forward(run *r, int a) {
  const void *x = in(r, 3 * 8, G_SIGNED), *b = in(r, 8, G_SIGNED);
  return K()->bias_gelu_forward(CTX, DT, out(r, 3 * 8), x, b, 3, 8);
}
static int r_bias_gelu_backward(run *r, int a) {
  void *dx = acc(r, 3 * 8, G_SIGNED), *db = wacc(r, a, 8, G_SIGNED);
  const void *g = in(r, 3 * 8, G_SIGNED), *x = in(r, 3 * 8, G_SIGNED), *b = in(r, 8, G_SIGNED);
  return K()->bias_gelu_backward(CTX, DT, wgdt(r, a), dx, db, g, x, b, 3, 8, false);
}

/* fill and the masks / magnitude-pruning helpers (counts land in host int64 outputs) */
static int r_fill(run *r, int a) { return K()->fill(CTX, DT, out(r, N_EL), -1.75, N_EL); }
static void *host_i64(run *r, int64_t n) { return out_dt(r, FSDP_DTYPE_I64, n); }
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
  return K()->mask_select(CTX, DT, out(r, N_EL), host_i64(r, 1), x, NULL, N_EL, 0x3f800001u, 0, 3);
}
static int r_mask_nm(run *r, int a) {
  const void *x = in(r, N_EL, G_SIGNED);
  return K()->mask_nm(CTX, DT, acc(r, N_EL, G_BOOL), host_i64(r, 1), x, NULL, N_EL, 2, 4, 1);
}
static int r_mask_values(run *r, int a) {
  const void *x = in(r, N_EL, G_SIGNED), *m = in(r, N_EL, G_BOOL);
  return K()->mask_values(CTX, DT, out(r, N_EL), x, m, N_EL);
}

/* ---- the support matrix ---------------------------------------------------------------------

 * One row per slot (per op for slots that take one): the dtypes it computes in, and the op name
 * of its refusal for the others. */
typedef struct {
  const char *slot;
  const char *refuse; /* "op <refuse> has no kernel for <dtype> on cpu" */
  unsigned dtypes;
  run_fn fn;
  int arg;
} row;

static const row rows[] = {
    /* conversions and data movement */
    {"cast dtype -> f32", "-", ALL, r_cast_from, 0},
    {"cast f32 -> dtype", "-", ALL, r_cast_to, 0},
    {"copy_strided", "-", ALL, r_copy_strided, 0},
    {"add_strided", "add", NUMS, r_add_strided, 0},
    {"axpy", "add", NUMS, r_axpy, 0},
    {"scale", "mul", NUMS, r_scale, 0},
    {"arange", "-", ALL, r_arange, 0},
    {"random normal", "randn", FLOATS, r_random, 1},
    {"random uniform", "rand", FLOATS, r_random, 0},
    /* linear algebra */
    {"gemm", "matmul", F32H, r_gemm, 0},
    {"bmm_forward", "matmul", F32H, r_bmm_forward, 0},
    {"bmm_backward", "matmul", F32H, r_bmm_backward, 0},
    {"linear_forward", "linear", F32H, r_linear_forward, 0},
    {"linear_backward", "linear", F32H, r_linear_backward, 0},
    {"linear_backward, f32 weight grads", "linear", F32H, r_linear_backward, 1},
    /* elementwise */
    {"binary_forward add", "add", NUMS, r_binary_forward, FSDP_BIN_ADD},
    {"binary_forward sub", "sub", NUMS, r_binary_forward, FSDP_BIN_SUB},
    {"binary_forward mul", "mul", NUMS, r_binary_forward, FSDP_BIN_MUL},
    {"binary_forward div", "div", FLOATS, r_binary_forward, FSDP_BIN_DIV},
    {"binary_backward add", "add", FLOATS, r_binary_backward, FSDP_BIN_ADD},
    {"binary_backward sub", "sub", FLOATS, r_binary_backward, FSDP_BIN_SUB},
    {"binary_backward mul", "mul", FLOATS, r_binary_backward, FSDP_BIN_MUL},
    {"binary_backward div", "div", FLOATS, r_binary_backward, FSDP_BIN_DIV},
    {"affine_forward", "affine", NUMS, r_affine_forward, 0},
    {"affine_backward", "affine", FLOATS, r_affine_backward, 0},
    {"unary_forward relu", "relu", NUMS, r_unary_forward, FSDP_UNARY_RELU},
    {"unary_forward gelu", "gelu", FLOATS, r_unary_forward, FSDP_UNARY_GELU},
    {"unary_forward exp", "exp", FLOATS, r_unary_forward, FSDP_UNARY_EXP},
    {"unary_forward log", "log", FLOATS, r_unary_forward, FSDP_UNARY_LOG},
    {"unary_forward sqrt", "sqrt", FLOATS, r_unary_forward, FSDP_UNARY_SQRT},
    {"unary_forward tanh", "tanh", FLOATS, r_unary_forward, FSDP_UNARY_TANH},
    {"unary_forward sigmoid", "sigmoid", FLOATS, r_unary_forward, FSDP_UNARY_SIGMOID},
    {"unary_forward abs", "abs", NUMS, r_unary_forward, FSDP_UNARY_ABS},
    {"unary_forward sign", "sign", NUMS, r_unary_forward, FSDP_UNARY_SIGN},
    {"unary_backward relu", "relu", FLOATS, r_unary_backward, FSDP_UNARY_RELU},
    {"unary_backward gelu", "gelu", FLOATS, r_unary_backward, FSDP_UNARY_GELU},
    {"unary_backward exp", "exp", FLOATS, r_unary_backward, FSDP_UNARY_EXP},
    {"unary_backward log", "log", FLOATS, r_unary_backward, FSDP_UNARY_LOG},
    {"unary_backward sqrt", "sqrt", FLOATS, r_unary_backward, FSDP_UNARY_SQRT},
    {"unary_backward tanh", "tanh", FLOATS, r_unary_backward, FSDP_UNARY_TANH},
    {"unary_backward sigmoid", "sigmoid", FLOATS, r_unary_backward, FSDP_UNARY_SIGMOID},
    {"unary_backward abs", "abs", FLOATS, r_unary_backward, FSDP_UNARY_ABS},
    {"unary_backward sign", "sign", FLOATS, r_unary_backward, FSDP_UNARY_SIGN},
    {"pow_forward", "pow", FLOATS, r_pow_forward, 0},
    {"pow_backward", "pow", FLOATS, r_pow_backward, 0},
    {"clamp_forward", "clamp", NUMS, r_clamp_forward, 0},
    {"clamp_backward", "clamp", FLOATS, r_clamp_backward, 0},
    {"compare (gt ge lt le eq ne)", "-", ALL, r_compare, 0},
    {"where", "-", ALL, r_where, 0},
    {"dropout_forward", "dropout", F32H, r_dropout_forward, 0},
    {"dropout_backward", "dropout", F32H, r_dropout_backward, 0},
    /* indices (check_index: the dtype is the ids') */
    {"check_index", "index", NUMS, r_check_index, 0},
    {"embedding_forward", "embedding", NUMS, r_embedding_forward, 0},
    {"embedding_backward", "embedding", F32H, r_embedding_backward, 0},
    {"embedding_backward, f32 weight grads", "embedding", F32H, r_embedding_backward, 1},
    /* normalisation, attention, losses */
    {"layernorm_forward", "layernorm", F32H, r_layernorm_forward, 0},
    {"layernorm_backward", "layernorm", F32H, r_layernorm_backward, 0},
    {"layernorm_backward, f32 weight grads", "layernorm", F32H, r_layernorm_backward, 1},
    {"softmax_forward", "softmax", F32H, r_softmax_forward, 0},
    {"softmax_backward", "softmax", F32H, r_softmax_backward, 0},
    {"attention_saved", "-", ALL, r_attention_saved, 0},
    {"attention_forward", "attention", F32H, r_attention_forward, 0},
    {"attention_backward", "attention", F32H, r_attention_backward, 0},
    {"cross_entropy_forward", "cross_entropy", F32H, r_cross_entropy_forward, 0},
    {"cross_entropy_backward", "cross_entropy", F32H, r_cross_entropy_backward, 0},
    {"mse_forward", "mse", F32H, r_mse_forward, 0},
    {"mse_backward", "mse", F32H, r_mse_backward, 0},
    /* reductions */
    {"sum", "sum", NUMS, r_sum, 0},
    {"sum (mean)", "mean", FLOATS, r_sum, 1},
    {"sumsq", "sumsq", FLOATS, r_sumsq, 0},
    {"sum_dim_forward", "sum", NUMS, r_sum_dim_forward, 0},
    {"sum_dim_backward", "sum", FLOATS, r_sum_dim_backward, 0},
    {"extreme_dim max", "-", ALL, r_extreme_dim, 1},
    {"extreme_dim min", "-", ALL, r_extreme_dim, 0},
    {"topk largest", "-", ALL, r_topk, 1},
    {"topk smallest", "-", ALL, r_topk, 0},
    {"index_add_dim", "index_add", FLOATS, r_index_add_dim, 0},
    /* optimizers */
    {"sgd_step", "sgd_step", F32, r_sgd_step, 0},
    {"adamw_step", "adamw_step", F32, r_adamw_step, 0},
    {"adamw_step_masked", "adamw_step", F32, r_adamw_step_masked, 0},
    /* fill, masks and magnitude pruning */
    {"fill", "-", ALL, r_fill, 0},
    {"mask_apply", "mask_apply", F32, r_mask_apply, 0},
    {"count_zeros", "count_zeros", F32, r_count_zeros, 0},
    {"mask_check", "mask_check", F32, r_mask_check, 0},
    {"mask_from_nonzero", "mask_from_nonzero", F32, r_mask_from_nonzero, 0},
    {"mask_hist", "mask_hist", F32, r_mask_hist, 0},
    {"mask_hist_pos", "mask_hist_pos", F32, r_mask_hist_pos, 0},
    {"mask_select", "mask_select", F32, r_mask_select, 0},
    {"mask_nm", "mask_nm", F32, r_mask_nm, 0},
    {"mask_values", "mask_values", F32, r_mask_values, 0},
    /* collectives */
    {"reduce_ranks sum", "reduce_ranks", B_(F32) | B_(BF16) | B_(F64) | B_(I64), r_reduce_ranks, 0},
    {"reduce_ranks max", "reduce_ranks", B_(F32) | B_(BF16) | B_(F64) | B_(I64), r_reduce_ranks, 1},
    /* optional fusions */
    {"bias_gelu_forward", "bias_gelu", F32H, r_bias_gelu_forward, 0},
    {"bias_gelu_backward", "bias_gelu", F32H, r_bias_gelu_backward, 0},
    {"bias_gelu_backward, f32 bias grad", "bias_gelu", F32H, r_bias_gelu_backward, 1},
    {"add_layernorm_forward", "layernorm", F32H, r_add_layernorm_forward, 0},
    /* modes */
    {"set_deterministic", "-", ALL, r_set_deterministic, 0},
};
#define NROWS ((int)(sizeof rows / sizeof rows[0]))

/* The slots the rows above cover: every member of fsdp_kernels_i. */
#define NSLOTS 65

/* ---- comparison ----------------------------------------------------------------------------- */

/* tolerance relative to max(|want|, floor * the output's largest |want|) */
static void tolerance(fsdp_dtype dt, double *tol, double *floor_frac) {
  switch (dt) {
  case FSDP_DTYPE_BF16: *tol = 1e-2, *floor_frac = 1e-3; break;
  case FSDP_DTYPE_F16: *tol = 1e-3, *floor_frac = 1e-3; break;
  /* the f32 reference itself rounds in f32: f64 is held to 1e-6 of the output's scale */
  case FSDP_DTYPE_F64: *tol = 1e-6, *floor_frac = 1.0; break;
  default: *tol = 0, *floor_frac = 0; break; /* f32 (the same kernel), integers, bool: exact */
  }
}

static int compared; /* elements compared over the whole matrix: the test must compare some */
static char why[512]; /* the first mismatch check_row found */

/* The number of elements of got that differ from ref beyond the tolerance (the first is
 * described in `why`). */
static int compare_outputs(const row *rw, fsdp_dtype dt, const run *got, const run *ref) {
  int bad = 0;
  assert_int_equal(got->nout, ref->nout);
  for (int k = 0; k < got->nout; k++) {
    int64_t n = got->out[k].n;
    fsdp_dtype gdt = got->out[k].dt, rdt = ref->out[k].dt;
    double tol, floor_frac, scale = 0;
    tolerance(gdt, &tol, &floor_frac);
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(fsdp_dtype_load(ref->out[k].p, rdt, i)));
    for (int64_t i = 0; i < n; i++) {
      double g = fsdp_dtype_load(got->out[k].p, gdt, i), want = fsdp_dtype_load(ref->out[k].p, rdt, i);
      if (!fsdp_dtype_is_float(gdt)) { /* the f32 result as this dtype stores it */
        unsigned char b[8];
        fsdp_dtype_store(b, gdt, 0, want);
        want = fsdp_dtype_load(b, gdt, 0);
      }
      bool ok = (g != g && want != want) || g == want ||
                fabs(g - want) <= tol * fmax(fabs(want), floor_frac * scale);
      if (!ok && !bad++)
        snprintf(why, sizeof why, "%s, %s: output %d [%lld] = %.9g, the f32 kernel gives %.9g "
                 "(tolerance %g)", rw->slot, fsdp_dtype_name(dt), k, (long long)i, g, want, tol);
      compared++;
    }
  }
  return bad;
}

/* Whether slot row rw behaves for dt as the row says (else `why` says how not). */
static bool check_row(const row *rw, fsdp_dtype dt) {
  const char *name = fsdp_dtype_name(dt);
  bool ok = true;
  run got = {.dt = dt, .vt = dt, .rng = 0x9e3779b97f4a7c15ull};
  fsdp_error_clear();
  int rc = rw->fn(&got, rw->arg);
  if (rw->dtypes & (1u << dt)) {
    run ref = {.dt = FSDP_DTYPE_F32, .vt = dt, .rng = 0x9e3779b97f4a7c15ull};
    if (rc) {
      snprintf(why, sizeof why, "%s, %s: expected to work, failed: %s", rw->slot, name, fsdp_error_msg());
      ok = false;
    } else if (rw->fn(&ref, rw->arg)) {
      snprintf(why, sizeof why, "%s: the f32 reference failed: %s", rw->slot, fsdp_error_msg());
      ok = false;
    } else {
      ok = compare_outputs(rw, dt, &got, &ref) == 0;
    }
    run_free(&ref);
  } else {
    char want[128];
    snprintf(want, sizeof want, "op %s has no kernel for %s on cpu", rw->refuse, name);
    if (rc != FSDP_ERR || strcmp(fsdp_error_msg(), want) != 0) {
      snprintf(why, sizeof why, "%s, %s: expected \"%s\", got %s \"%s\"", rw->slot, name, want,
               rc ? "an error" : "success", rc ? fsdp_error_msg() : "");
      ok = false;
    }
  }
  run_free(&got);
  return ok;
}

static void test_matrix(void **state) {
  (void)state;
  printf("  %-28s", "slot \\ dtype");
  for (int d = 0; d < FSDP_DTYPE_COUNT; d++) printf(" %5s", fsdp_dtype_name((fsdp_dtype)d));
  printf("\n");
  compared = 0;
  int failed = 0;
  for (int i = 0; i < NROWS; i++) {
    printf("  %-28s", rows[i].slot);
    for (int d = 0; d < FSDP_DTYPE_COUNT; d++) {
      bool ok = check_row(&rows[i], (fsdp_dtype)d);
      printf(" %5s", !ok ? "FAIL" : rows[i].dtypes & (1u << d) ? "yes" : "-");
      if (!ok && !failed++) fprintf(stderr, "%s\n", why);
    }
    printf("\n");
  }
  printf("  %d elements compared\n", compared);
  if (failed) fail_msg("%d (slot, dtype) pairs differ from the matrix; the first: %s", failed, why);
  assert_true(compared > 5000);
}

/* A slot added to kernels.h needs rows here (and a line in docs/tensor.md). */
static void test_every_slot_has_rows(void **state) {
  (void)state;
  typedef void (*slot)(void);
  size_t n = sizeof(fsdp_kernels_i) / sizeof(slot);
  if (n != NSLOTS)
    fail_msg("fsdp_kernels_i has %zu slots, this test covers %d: add rows for the new ones", n, NSLOTS);
  slot s[NSLOTS];
  memcpy(s, K(), sizeof s);
  for (size_t i = 0; i < n; i++)
    if (!s[i]) fail_msg("slot %zu of the cpu table is NULL", i);
}

/* The checker catches each way a row can be wrong: a kernel whose bf16 result is 10% off, a
 * refusal where the row says "works", a success where it says "refused". */
static const fsdp_kernels_i *real;
static int off_by_10pct(void *ctx, fsdp_dtype dt, void *out, const void *a, const void *b,
                        int64_t n, int64_t m, fsdp_binop op) {
  int rc = real->binary_forward(ctx, dt, out, a, b, n, m, op);
  if (!rc && dt == FSDP_DTYPE_BF16)
    for (int64_t i = 0; i < n; i++) fsdp_dtype_store(out, dt, i, 1.1 * fsdp_dtype_load(out, dt, i));
  return rc;
}
static fsdp_kernels_i broken;
static int r_broken_add(run *r, int a) {
  const void *x = in(r, 12, G_SIGNED), *y = in(r, 4, G_SIGNED);
  return broken.binary_forward(CTX, DT, out(r, 12), x, y, 12, 4, FSDP_BIN_ADD);
}
static void test_checker_catches(void **state) {
  (void)state;
  real = K();
  broken = *real;
  broken.binary_forward = off_by_10pct;
  const row wrong_values = {"add, 10% off in bf16", "add", NUMS, r_broken_add, 0};
  assert_false(check_row(&wrong_values, FSDP_DTYPE_BF16));
  assert_non_null(strstr(why, "the f32 kernel gives"));
  assert_true(check_row(&wrong_values, FSDP_DTYPE_F32)); /* f32 is untouched */
  const row claims_bf16 = {"sgd_step", "sgd_step", F32H, r_sgd_step, 0};
  assert_false(check_row(&claims_bf16, FSDP_DTYPE_BF16));
  assert_non_null(strstr(why, "expected to work, failed: op sgd_step has no kernel for bf16 on cpu"));
  const row claims_refusal = {"unary_forward gelu", "gelu", F32, r_unary_forward, FSDP_UNARY_GELU};
  assert_false(check_row(&claims_refusal, FSDP_DTYPE_F64));
  assert_non_null(strstr(why, "expected \"op gelu has no kernel for f64 on cpu\", got success"));
  const row wrong_name = {"unary_forward gelu", "tanh", FLOATS, r_unary_forward, FSDP_UNARY_GELU};
  assert_false(check_row(&wrong_name, FSDP_DTYPE_I64));
  assert_non_null(strstr(why, "got an error \"op gelu has no kernel for i64 on cpu\""));
}

/* ---- the f32 results themselves -------------------------------------------------------------

 * The matrix holds every dtype to the f32 kernels; the slots without a kernel file of their own
 * (table.c's loops: compare, where, clamp, abs, sign, max/min, topk, index_add) are held here to
 * plain loops, so a wrong f32 kernel cannot pass by agreeing with itself. */

static void test_f32_selection_slots(void **state) {
  (void)state;
  const fsdp_kernels_i *k = K();
  const float a[6] = {1, -2, NAN, 3, 3, -0.5f}, b[2] = {3, -0.5f};
  /* compare: a (6) against b (2) repeating; NaN compares false but for ne */
  static const uint8_t want_cmp[6][6] = {
      {0, 0, 0, 1, 0, 0}, {0, 0, 0, 1, 1, 1}, {1, 1, 0, 0, 0, 0},
      {1, 1, 0, 0, 1, 1}, {0, 0, 0, 0, 1, 1}, {1, 1, 1, 1, 0, 0}};
  for (int op = FSDP_CMP_GT; op <= FSDP_CMP_NE; op++) {
    uint8_t o[6];
    assert_int_equal(k->compare(CTX, FSDP_DTYPE_F32, (fsdp_cmpop)op, o, a, b, 6, 2), FSDP_OK);
    assert_memory_equal(o, want_cmp[op], 6);
  }
  /* where */
  const uint8_t c[6] = {1, 0, 0, 1, 1, 0};
  const float x[6] = {1, 2, 3, 4, 5, 6}, y[6] = {-1, -2, -3, -4, -5, -6}, want_w[6] = {1, -2, -3, 4, 5, -6};
  float w[6];
  assert_int_equal(k->where(CTX, FSDP_DTYPE_F32, w, c, x, y, 6), FSDP_OK);
  assert_memory_equal(w, want_w, sizeof w);
  /* clamp to [-1, 2]: NaN stays; the gradient passes where -1 <= x <= 2 (bounds included) */
  const float cx[6] = {-3, -1, 0.5f, 2, 7, NAN};
  float cy[6], cg[6] = {10, 10, 10, 10, 10, 10};
  const float ones[6] = {1, 1, 1, 1, 1, 1};
  assert_int_equal(k->clamp_forward(CTX, FSDP_DTYPE_F32, cy, cx, -1, 2, 6), FSDP_OK);
  const float want_c[5] = {-1, -1, 0.5f, 2, 2};
  assert_memory_equal(cy, want_c, sizeof want_c);
  assert_true(isnan(cy[5]));
  assert_int_equal(k->clamp_backward(CTX, FSDP_DTYPE_F32, cg, ones, cx, -1, 2, 6), FSDP_OK);
  const float want_cg[6] = {10, 11, 11, 11, 10, 10};
  assert_memory_equal(cg, want_cg, sizeof cg);
  /* abs and sign, forward and backward (sign(x) for abs, 0 at 0; nothing for sign) */
  const float ux[5] = {-2, 0, 3, -0.0f, NAN};
  float uy[5], ug[5] = {1, 1, 1, 1, 1};
  assert_int_equal(k->unary_forward(CTX, FSDP_DTYPE_F32, FSDP_UNARY_ABS, uy, ux, 5), FSDP_OK);
  assert_true(uy[0] == 2 && uy[1] == 0 && uy[2] == 3 && uy[3] == 0 && isnan(uy[4]));
  assert_int_equal(k->unary_forward(CTX, FSDP_DTYPE_F32, FSDP_UNARY_SIGN, uy, ux, 5), FSDP_OK);
  assert_true(uy[0] == -1 && uy[1] == 0 && uy[2] == 1 && uy[3] == 0 && isnan(uy[4]));
  const float g2[5] = {2, 2, 2, 2, 2};
  assert_int_equal(k->unary_backward(CTX, FSDP_DTYPE_F32, FSDP_UNARY_ABS, ug, g2, ux, NULL, 4), FSDP_OK);
  const float want_ug[4] = {-1, 1, 3, 1};
  assert_memory_equal(ug, want_ug, sizeof want_ug);
  assert_int_equal(k->unary_backward(CTX, FSDP_DTYPE_F32, FSDP_UNARY_SIGN, ug, g2, ux, uy, 4), FSDP_OK);
  assert_memory_equal(ug, want_ug, sizeof want_ug);

  /* max / min over R of (outer 2, R 4, inner 2): first index among ties; NaN wins */
  const float e[16] = {1, 5, 7, 5, 7, 0, -1, 5, /* outer 0: columns {1,7,7,-1} and {5,5,0,5} */
                       0, 2, NAN, 9, 4, 9, 4, -9}; /* outer 1: {0,NaN,4,4} and {2,9,9,-9} */
  float ev[4];
  int64_t ei[4];
  assert_int_equal(k->extreme_dim(CTX, FSDP_DTYPE_F32, true, ev, ei, e, 2, 4, 2), FSDP_OK);
  assert_true(ev[0] == 7 && ev[1] == 5 && isnan(ev[2]) && ev[3] == 9);
  assert_true(ei[0] == 1 && ei[1] == 0 && ei[2] == 1 && ei[3] == 1);
  assert_int_equal(k->extreme_dim(CTX, FSDP_DTYPE_F32, false, ev, ei, e, 2, 4, 2), FSDP_OK);
  assert_true(ev[0] == -1 && ev[1] == 0 && isnan(ev[2]) && ev[3] == -9);
  assert_true(ei[0] == 3 && ei[1] == 2 && ei[2] == 1 && ei[3] == 3);

  /* topk along R = 6 (outer 1, inner 1): sorted, ties by index, NaN the largest */
  const float t[6] = {2, NAN, 5, 2, -1, 5};
  float tv[6];
  int64_t ti[6];
  assert_int_equal(k->topk(CTX, FSDP_DTYPE_F32, tv, ti, t, 1, 6, 1, 6, true), FSDP_OK);
  const int64_t want_desc[6] = {1, 2, 5, 0, 3, 4};
  assert_memory_equal(ti, want_desc, sizeof ti);
  assert_true(isnan(tv[0]) && tv[1] == 5 && tv[2] == 5 && tv[3] == 2 && tv[5] == -1);
  assert_int_equal(k->topk(CTX, FSDP_DTYPE_F32, tv, ti, t, 1, 6, 1, 3, false), FSDP_OK);
  const int64_t want_asc[3] = {4, 0, 3};
  assert_memory_equal(ti, want_asc, sizeof want_asc);
  assert_true(tv[0] == -1 && tv[1] == 2 && tv[2] == 2);
  /* a long row of ties keeps index order (qsort alone is not stable) */
  enum { LONG = 200 };
  float tie[LONG];
  int64_t tix[LONG];
  float tiev[LONG];
  for (int i = 0; i < LONG; i++) tie[i] = (float)(i % 3);
  assert_int_equal(k->topk(CTX, FSDP_DTYPE_F32, tiev, tix, tie, 1, LONG, 1, LONG, false), FSDP_OK);
  for (int i = 1; i < LONG; i++)
    assert_true(tiev[i - 1] < tiev[i] || (tiev[i - 1] == tiev[i] && tix[i - 1] < tix[i]));

  /* index_add over R = 3 (outer 1, inner 2), K = 3 with a repeated index: adds up */
  float d[6] = {1, 1, 1, 1, 1, 1};
  const float g[6] = {1, 2, 3, 4, 5, 6};
  const int64_t ix[6] = {2, 0, 2, 1, 0, 1};
  assert_int_equal(k->index_add_dim(CTX, FSDP_DTYPE_F32, d, g, ix, 1, 3, 2, 3), FSDP_OK);
  /* column 0 gets g[0] and g[2] at row 2, g[4] at row 0; column 1 g[1] at row 0, g[3] and g[5]
   * at row 1 */
  const float want_ia[6] = {1 + 5, 1 + 2, 1, 1 + 4 + 6, 1 + 1 + 3, 1};
  assert_memory_equal(d, want_ia, sizeof d);
}

/* ---- casts ------------------------------------------------------------------------------------ */

/* Every (from, to) pair of the table's cast against core's scalar rule, byte for byte. */
static void test_cast_pairs(void **state) {
  (void)state;
  const double v[] = {0.0, -0.0, 1.0, -1.0, 0.5, 1.5, 2.5, -2.5, 3.7, -3.7, 127.5, 255.0, 256.0,
                      300.0, -129.0, 65504.0, 65519.0, 65520.0, 1e10, -1e10, 2147483647.0,
                      2147483648.0, 1099511627777.0, 9007199254740993.0, 1e-8, 1e-40, 3.4e38,
                      1.0 + 1.0 / 256, 1.0 + 3.0 / 256, NAN, INFINITY, -INFINITY};
  const int64_t n = (int64_t)(sizeof v / sizeof v[0]);
  for (int i = 0; i < FSDP_DTYPE_COUNT; i++) {
    fsdp_dtype idt = (fsdp_dtype)i;
    unsigned char src[sizeof v / sizeof v[0] * 8];
    for (int64_t k = 0; k < n; k++) fsdp_dtype_store(src, idt, k, v[k]);
    for (int o = 0; o < FSDP_DTYPE_COUNT; o++) {
      fsdp_dtype odt = (fsdp_dtype)o;
      unsigned char got[sizeof src], want[sizeof src];
      memset(got, 0xa5, sizeof got);
      assert_int_equal(K()->cast(CTX, got, odt, src, idt, n), FSDP_OK);
      for (int64_t k = 0; k < n; k++) fsdp_dtype_store(want, odt, k, fsdp_dtype_load(src, idt, k));
      for (int64_t k = 0; k < n; k++) {
        size_t es = fsdp_dtype_size(odt);
        if (memcmp(got + k * (int64_t)es, want + k * (int64_t)es, es) != 0)
          fail_msg("cast %s -> %s of %g: got %g, the scalar rule gives %g", fsdp_dtype_name(idt),
                   fsdp_dtype_name(odt), fsdp_dtype_load(src, idt, k), fsdp_dtype_load(got, odt, k),
                   fsdp_dtype_load(want, odt, k));
      }
    }
  }
}

static uint32_t bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

/* f32 inputs whose narrowing is checked: every 16-bit pattern as the top half with low halves
 * at and around bf16's rounding boundary (0x8000: a tie), the midpoints between consecutive f16
 * values and their neighbours, random bit patterns (NaN, inf, subnormals among them), and
 * hand-picked specials. */
static float *narrowing_inputs(int64_t *count) {
  static const uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1000, 0x2000};
  static const uint32_t specials[] = {0x7f800001, 0xff800001, 0x7fc00000, 0xffc00000, 0x7fffffff,
                                      0x7f800000, 0xff800000, 0x00000001, 0x007fffff, 0x80000001,
                                      0x807fffff, 0x7f7fffff, 0x7f7f8000, 0x7f7f7fff, 0x477fe000,
                                      0x477ff000, 0x477fefff, 0x33000000, 0x33000001, 0x32ffffff,
                                      0x38800000, 0x387fffff, 0x80000000, 0x00000000};
  const int64_t nlow = 8, nrand = 1 << 17, nmid = 65536 * 3;
  int64_t n = 65536 * nlow + nmid + nrand + (int64_t)(sizeof specials / 4);
  uint32_t *u = malloc((size_t)n * 4);
  float *f = malloc((size_t)n * 4);
  assert_true(u && f);
  int64_t k = 0;
  for (uint32_t h = 0; h < 65536; h++)
    for (int64_t j = 0; j < nlow; j++) u[k++] = h << 16 | lows[j];
  for (uint32_t h = 0; h < 65536; h++) { /* f16 midpoints: (x(h) + x(h+1)) / 2 and its neighbours */
    float a = fsdp_f16_to_f32((uint16_t)h), b = fsdp_f16_to_f32((uint16_t)(h + 1));
    float mid = isfinite(a) && isfinite(b) ? (float)(((double)a + (double)b) / 2) : a;
    u[k++] = bits(mid);
    u[k++] = bits(mid) + 1;
    u[k++] = bits(mid) - 1;
  }
  uint64_t s = 0x2545f4914f6cdd1dull;
  for (int64_t j = 0; j < nrand; j++) {
    s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
    u[k++] = (uint32_t)((s * 0x2545f4914f6cdd1dull) >> 32);
  }
  for (size_t j = 0; j < sizeof specials / 4; j++) u[k++] = specials[j];
  assert_int_equal(k, n);
  memcpy(f, u, (size_t)n * 4);
  free(u);
  *count = n;
  return f;
}

static void test_bulk_conversions(void **state) {
  (void)state;
  /* widening: every bf16 and every f16 pattern */
  uint16_t all[65536];
  float wide[65536], wide2[65536];
  for (int h = 0; h < 65536; h++) all[h] = (uint16_t)h;
  fsdp_cpu_bf16_to_f32(wide, all, 65536);
  assert_int_equal(K()->cast(CTX, wide2, FSDP_DTYPE_F32, all, FSDP_DTYPE_BF16, 65536), FSDP_OK);
  for (int h = 0; h < 65536; h++) {
    uint32_t want = bits(fsdp_bf16_to_f32((uint16_t)h));
    if (bits(wide[h]) != want || bits(wide2[h]) != want)
      fail_msg("bf16 %04x widens to %08x / %08x, core gives %08x", h, bits(wide[h]), bits(wide2[h]), want);
  }
  fsdp_cpu_f16_to_f32(wide, all, 65536);
  fsdp_cpu_cast(wide2, FSDP_DTYPE_F32, all, FSDP_DTYPE_F16, 65536);
  for (int h = 0; h < 65536; h++) {
    uint32_t want = bits(fsdp_f16_to_f32((uint16_t)h));
    if (bits(wide[h]) != want || bits(wide2[h]) != want)
      fail_msg("f16 %04x widens to %08x / %08x, core gives %08x", h, bits(wide[h]), bits(wide2[h]), want);
  }
  /* narrowing */
  int64_t n;
  float *x = narrowing_inputs(&n);
  uint16_t *a = malloc((size_t)n * 2), *b = malloc((size_t)n * 2), *c = malloc((size_t)n * 2);
  assert_true(a && b && c);
  fsdp_cpu_f32_to_bf16(a, x, n);
  fsdp_cpu_cast(b, FSDP_DTYPE_BF16, x, FSDP_DTYPE_F32, n);
  assert_int_equal(K()->cast(CTX, c, FSDP_DTYPE_BF16, x, FSDP_DTYPE_F32, n), FSDP_OK);
  int64_t nan = 0, sub = 0, inf = 0, ties = 0;
  for (int64_t i = 0; i < n; i++) {
    uint16_t want = fsdp_f32_to_bf16(x[i]);
    if (a[i] != want || b[i] != want || c[i] != want)
      fail_msg("bf16 of %08x (%g): bulk %04x, cast %04x, table %04x; core %04x", bits(x[i]),
               (double)x[i], a[i], b[i], c[i], want);
    nan += isnan(x[i]) != 0, inf += isinf(x[i]) != 0, sub += fpclassify(x[i]) == FP_SUBNORMAL;
    ties += (bits(x[i]) & 0xffff) == 0x8000;
  }
  assert_true(nan > 100 && inf >= 2 && sub > 100 && ties >= 65536);
  fsdp_cpu_f32_to_f16(a, x, n);
  fsdp_cpu_cast(b, FSDP_DTYPE_F16, x, FSDP_DTYPE_F32, n);
  assert_int_equal(K()->cast(CTX, c, FSDP_DTYPE_F16, x, FSDP_DTYPE_F32, n), FSDP_OK);
  for (int64_t i = 0; i < n; i++) {
    uint16_t want = fsdp_f32_to_f16(x[i]);
    if (a[i] != want || b[i] != want || c[i] != want)
      fail_msg("f16 of %08x (%g): bulk %04x, cast %04x, table %04x; core %04x", bits(x[i]),
               (double)x[i], a[i], b[i], c[i], want);
  }
  printf("  %lld f32 values narrowed to bf16 and f16 (%lld NaN, %lld subnormal, %lld bf16 ties)\n",
         (long long)n, (long long)nan, (long long)sub, (long long)ties);
  free(a);
  free(b);
  free(c);
  free(x);
}

/* The conversion rule itself on a few values, so the bulk-equals-scalar checks above cannot
 * pass on a shared mistake: ties to even, NaN kept, overflow to infinity. */
static void test_rounding_rule(void **state) {
  (void)state;
  assert_int_equal(fsdp_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);        /* tie: even (down) */
  assert_int_equal(fsdp_f32_to_bf16(1.0f + 0x3p-8f), 0x3f82);        /* tie: even (up) */
  assert_int_equal(fsdp_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
  assert_int_equal(fsdp_f32_to_bf16(-INFINITY), 0xff80);
  assert_int_equal(fsdp_f32_to_bf16(3.4e38f), 0x7f80);               /* rounds up to inf */
  assert_true(isnan(fsdp_bf16_to_f32(fsdp_f32_to_bf16(NAN))));
  assert_int_equal(fsdp_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);         /* tie: even (down) */
  assert_int_equal(fsdp_f32_to_f16(1.0f + 0x3p-11f), 0x3c02);         /* tie: even (up) */
  assert_int_equal(fsdp_f32_to_f16(65504.0f), 0x7bff);
  assert_int_equal(fsdp_f32_to_f16(65520.0f), 0x7c00);               /* the tie past max: inf */
  assert_int_equal(fsdp_f32_to_f16(0x1p-24f), 0x0001);               /* smallest subnormal */
  assert_int_equal(fsdp_f32_to_f16(0x1p-25f), 0x0000);               /* half of it: tie to 0 */
  assert_int_equal(fsdp_f32_to_f16(-0x1.8p-25f), 0x8001);            /* above the tie: up */
  assert_true(isnan(fsdp_f16_to_f32(fsdp_f32_to_f16(-NAN))));
}

/* The conversion pass's scratch over the memory budget: the slot fails with the budget's
 * message, writes nothing, and gives back what it had taken (table.c's whole-buffer pass:
 * gemm; half.c's chunked pass: linear; an i64 copy of f32 ids: embedding). */
static void test_scratch_budget(void **state) {
  (void)state;
  fsdp_cpu_bf16_gemm_force(0); /* the conversion pass (the native path: test_gemm_bf16.c) */
  fsdp_mem_domain *d = fsdp_mem_domain_new();
  assert_non_null(d);
  fsdp_mem_domain_set(d);
  enum { M = 64, C = 64 };
  static uint16_t a[M * C], b[C * M], c[M * M], w[M * C], out[M * M];
  static float ids[M];
  static float emb[M * C];
  for (int i = 0; i < M * C; i++) a[i] = b[i] = w[i] = fsdp_f32_to_bf16(1.0f);
  for (int i = 0; i < M; i++) ids[i] = (float)i;
  /* a little more than one f32 copy of a: the second buffer of the call is refused */
  fsdp_mem_set_limit(d, (int64_t)M * C * 4 + 1024);
  memset(c, 0, sizeof c);
  assert_int_equal(K()->gemm(CTX, FSDP_DTYPE_BF16, c, a, b, M, M, C, false, false, 1.0f, 0.0f, C, M,
                             M),
                   FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  for (int i = 0; i < M * M; i++) assert_int_equal(c[i], 0);
  assert_int_equal(K()->linear_forward(CTX, FSDP_DTYPE_BF16, out, a, w, NULL, M, C, M), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  fsdp_mem_set_limit(d, 16); /* not even the ids' i64 copy */
  assert_int_equal(K()->embedding_forward(CTX, FSDP_DTYPE_F32, emb, ids, FSDP_DTYPE_F32, emb, M, C),
                   FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "out of memory budget"));
  fsdp_mem_report r;
  fsdp_mem_report_get(d, &r);
  for (int i = 0; i < r.ndevices; i++) assert_int_equal(r.counts[i].live_total, 0);
  fsdp_mem_domain_set(NULL);
  fsdp_mem_domain_free(d);
  fsdp_cpu_bf16_gemm_force(-1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_scratch_budget),
      cmocka_unit_test(test_every_slot_has_rows),
      cmocka_unit_test(test_checker_catches),
      cmocka_unit_test(test_matrix),
      cmocka_unit_test(test_f32_selection_slots),
      cmocka_unit_test(test_rounding_rule),
      cmocka_unit_test(test_cast_pairs),
      cmocka_unit_test(test_bulk_conversions),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
