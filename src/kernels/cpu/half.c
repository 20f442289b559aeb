/*
 * half.c — the bf16 / f16 kernels of the cpu table: a conversion pass around the f32 kernels,
 * and bf16 kernels of their own where they pay.
 *
 * The cpu has no half-precision arithmetic outside the native bf16 GEMMs (gemm.h), so a half
 * kernel widens its inputs to f32, runs the f32 kernel and rounds the outputs back once
 * (gradients that accumulate are widened first, so += keeps its meaning). Doing that over whole
 * tensors would allocate f32 copies of every activation a kernel touches, so it goes piece by
 * piece, in the way each kernel allows:
 *  - element-wise and row kernels: one task per thread, slices on the task's stack (the fused
 *    pass below); every output element is the f32 kernel's on the widened inputs, rounded once;
 *  - bias + GELU and layernorm's backward on bf16: the instruction-set level's own bodies,
 *    loading and storing bf16 lanes;
 *  - sums over rows: the f32 kernel's fixed blocks (layernorm), column tiles (bias + GELU on
 *    f16), column sums read straight from bf16 (a linear's bias);
 *  - attention: one batch row per task; GEMM-based kernels without the native path, losses and
 *    rows longer than a slice: chunks of rows (at most CHUNK elements per buffer).
 * Small operands (a weight, a bias, a broadcast operand) are widened once per call; their
 * gradients accumulate in f32 and are rounded once at the end.
 *
 * Heap scratch is allocated through core (role activations), so the memory report includes it.
 * Results are deterministic and do not depend on the thread count (tests/c/test_half.c); the
 * chunked loops can differ in the last f32 bits from one whole-tensor call (a weight gradient
 * sums its chunks' products in chunk order), which is below bf16's precision.
 */
#include <math.h>
#include <string.h>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/half.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/pool.h"

#define CHUNK ((int64_t)1 << 16) /* elements of f32 scratch per buffer: 256 KiB */
/* GEMM-based kernels take bigger chunks: a GEMM of a few dozen rows runs far below the BLAS's
 * speed, and re-reads the whole weight per chunk */
#define GEMM_CHUNK ((int64_t)1 << 20)
/* M * N * K below which a bf16 product keeps the conversion pass even where the native path is
 * taken: oneDNN's fixed cost per call (a few microseconds) outweighs the conversions there */
#define NATIVE_MIN ((int64_t)32 * 32 * 32)

/* ---- scratch --------------------------------------------------------------------------------- */

void *fsdp_cpu_work_buf(fsdp_cpu_work *w, int64_t n, size_t esize) {
  if (w->n == FSDP_CPU_WORK_MAX) {
    fsdp_error("cpu: too many scratch buffers in one kernel call");
    w->failed = true;
    return NULL;
  }
  fsdp_storage *s;
  if (fsdp_storage_new_uninit(&s, &fsdp_device_cpu, (size_t)(n > 0 ? n : 1) * esize,
                              FSDP_ROLE_ACTIVATIONS)) {
    w->failed = true;
    return NULL;
  }
  w->s[w->n++] = s;
  return s->data;
}

int fsdp_cpu_work_done(fsdp_cpu_work *w) {
  for (int i = 0; i < w->n; i++) fsdp_storage_release(w->s[i]);
  w->n = 0;
  return w->failed ? FSDP_ERR : FSDP_OK;
}

/* n f32 elements of scratch */
static float *tmp(fsdp_cpu_work *w, int64_t n) { return fsdp_cpu_work_buf(w, n, sizeof(float)); }

/* scratch for an optional buffer: NULL when p is NULL */
static float *opt(fsdp_cpu_work *w, const void *p, int64_t n) { return p ? tmp(w, n) : NULL; }

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* rows of `row` elements per chunk of at most `elems` */
static int64_t rows_in(int64_t elems, int64_t row) {
  int64_t r = elems / (row > 0 ? row : 1);
  return r < 1 ? 1 : r;
}
static int64_t chunk_rows(int64_t row) { return rows_in(CHUNK, row); }

/* f32 <- elements [off, off + n) of a half buffer (nothing for NULL) */
static void get(float *w, const void *src, fsdp_dtype dt, int64_t off, int64_t n) {
  if (src && w) fsdp_cpu_cast(w, FSDP_DTYPE_F32, (const uint16_t *)src + off, dt, n);
}

/* elements [off, off + n) of a half buffer <- f32 (nothing for NULL) */
static void put(void *dst, fsdp_dtype dt, int64_t off, const float *w, int64_t n) {
  if (dst && w) fsdp_cpu_cast((uint16_t *)dst + off, dt, w, FSDP_DTYPE_F32, n);
}

/* a whole small operand widened once (NULL stays NULL) */
static float *whole(fsdp_cpu_work *w, const void *src, fsdp_dtype dt, int64_t n) {
  float *f = opt(w, src, n);
  get(f, src, dt, 0, n);
  return f;
}

/* ---- the fused pass: conversion and math in one task per thread -----------------------------
 * Most kernels of the pass handle each element (or each row) on its own. Those run as one
 * parallel_for over the rank's threads (pool.h); each task walks its range in slices of at most
 * SLICE f32 elements per operand, widens the slice's inputs into buffers on its stack, runs the
 * f32 kernel on them (inline: inside a task the pool runs serially) and narrows the outputs
 * back. The f32 copies never leave the core's L1/L2, and both cores convert as well as compute,
 * in one dispatch per call. An element's result does not depend on the slicing, so the bits are
 * those of one f32 call on widened tensors. Kernels with sums across rows (weight and bias
 * gradients, losses) keep the chunked loops further down, and so do rows longer than SLICE. */
#define SLICE 2048 /* f32 elements per operand buffer: 8 KiB; MAP_MAX of them, 48 KiB of stack */
#define MAP_MAX 6

typedef struct hmap hmap;
/* rows [u0, u0 + nu) of the call; f[i] the widened slice of operand i (NULL when absent) */
typedef void (*hmap_fn)(const hmap *m, float *const *f, int64_t u0, int64_t nu);
struct hmap {
  fsdp_dtype dt;
  void *p[MAP_MAX]; /* the half operands, NULL where absent */
  unsigned rd, wr;  /* bit i: operand i is widened before fn / narrowed after it */
  unsigned keep;    /* bit i: fn gets a buffer for operand i even when p[i] is NULL */
  int64_t row;      /* elements per row (1 for element-wise kernels) */
  hmap_fn fn;
  /* the kernel's other arguments */
  const float *w0, *w1; /* whole f32 operands (a broadcast b, layernorm's weight and bias) */
  float *r0, *r1;       /* f32 per-row outputs or inputs (layernorm's mean and rstd, lse) */
  const int64_t *targets;
  float s, t;
  int op;
  bool same; /* binary backward: db is da (x * x) */
  uint64_t key, first;
  int64_t ignore, count;
  /* the table's f32 unary kernels */
  void (*uf)(fsdp_unary_op, float *, const float *, int64_t);
  void (*ub)(fsdp_unary_op, float *, const float *, const float *, const float *, int64_t);
};

static void widen(float *f, const void *src, fsdp_dtype dt, int64_t off, int64_t n) {
  const uint16_t *s = (const uint16_t *)src + off;
  if (dt == FSDP_DTYPE_BF16) fsdp_cpu_bf16_to_f32(f, s, n);
  else fsdp_cpu_f16_to_f32(f, s, n);
}

static void narrow(void *dst, fsdp_dtype dt, int64_t off, const float *f, int64_t n) {
  uint16_t *d = (uint16_t *)dst + off;
  if (dt == FSDP_DTYPE_BF16) fsdp_cpu_f32_to_bf16(d, f, n);
  else fsdp_cpu_f32_to_f16(d, f, n);
}

static void hmap_task(void *ctx, int64_t lo, int64_t hi) {
  const hmap *m = ctx;
  _Alignas(64) float buf[MAP_MAX][SLICE];
  float *f[MAP_MAX];
  for (int i = 0; i < MAP_MAX; i++) f[i] = m->p[i] || (m->keep >> i & 1u) ? buf[i] : NULL;
  const int64_t per = SLICE / m->row;
  for (int64_t u = lo; u < hi; u += per) {
    const int64_t nu = min64(per, hi - u), off = u * m->row, len = nu * m->row;
    for (int i = 0; i < MAP_MAX; i++)
      if (m->p[i] && (m->rd >> i & 1u)) widen(buf[i], m->p[i], m->dt, off, len);
    /* ask for the next slice's inputs now, so that memory works while fn computes */
    const int64_t next = min64(per, hi - u - nu) * m->row;
    for (int i = 0; i < MAP_MAX; i++)
      if (m->p[i] && (m->rd >> i & 1u))
        for (int64_t k = 0; k < next; k += 32)
          __builtin_prefetch((const uint16_t *)m->p[i] + off + len + k);
    m->fn(m, f, u, nu);
    for (int i = 0; i < MAP_MAX; i++)
      if (m->p[i] && (m->wr >> i & 1u)) narrow(m->p[i], m->dt, off, buf[i], len);
  }
}

/* Whether rows of m->row elements fit the slices (else the caller takes its chunked loop). */
static bool hmap_fits(int64_t row) { return row >= 1 && row <= SLICE; }

/* Run m over `rows` rows of m->row elements. */
static void hmap_run(hmap *m, int64_t rows) {
  int64_t grain = FSDP_CPU_GRAIN_HEAVY / m->row;
  fsdp_cpu_parallel_for(rows, grain < 1 ? 1 : grain, hmap_task, m);
}

/* ---- elementwise ------------------------------------------------------------------------------- */

static void axpy_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  (void)u0;
  for (int64_t i = 0; i < nu; i++) f[0][i] += m->s * f[1][i];
}

int fsdp_cpu_half_axpy(fsdp_dtype dt, void *y, const void *x, float alpha, int64_t n) {
  hmap m = {.dt = dt, .p = {y, (void *)x}, .rd = 3, .wr = 1, .keep = 3, .row = 1, .fn = axpy_fn,
            .s = alpha};
  hmap_run(&m, n);
  return FSDP_OK;
}

static void affine_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  (void)u0;
  fsdp_cpu_affine_forward(f[0], f[1], m->s, m->t, nu);
}

int fsdp_cpu_half_affine_forward(fsdp_dtype dt, void *out, const void *a, float s, float t,
                                 int64_t n) {
  hmap m = {.dt = dt, .p = {out, (void *)a}, .rd = 2, .wr = 1, .keep = 3, .row = 1,
            .fn = affine_fn, .s = s, .t = t};
  hmap_run(&m, n);
  return FSDP_OK;
}

/* rows of m->row elements of a against the whole b (w0) repeating every row; m->row == 1 with
 * w0 NULL: a and b in lockstep (f[2]) */
static void binary_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  (void)u0;
  int64_t len = nu * m->row;
  fsdp_cpu_binary_forward(f[0], f[1], m->w0 ? m->w0 : f[2], len, m->w0 ? m->row : len,
                          (fsdp_binop)m->op);
}

/* out = op(a, b) with b repeating every m elements of a's n */
int fsdp_cpu_half_binary_forward(fsdp_dtype dt, void *out, const void *a, const void *b,
                                 int64_t n, int64_t m, fsdp_binop op) {
  if (m == n) {
    hmap h = {.dt = dt, .p = {out, (void *)a, (void *)b}, .rd = 6, .wr = 1, .keep = 7, .row = 1,
              .fn = binary_fn, .op = op};
    hmap_run(&h, n);
    return FSDP_OK;
  }
  fsdp_cpu_work w = {0};
  float *fb = whole(&w, b, dt, m);
  if (!w.failed && hmap_fits(m)) {
    hmap h = {.dt = dt, .p = {out, (void *)a}, .rd = 2, .wr = 1, .keep = 3, .row = m,
              .fn = binary_fn, .w0 = fb, .op = op};
    hmap_run(&h, n / m);
    return fsdp_cpu_work_done(&w);
  }
  /* rows longer than a slice: a in chunks of whole repeats */
  int64_t step = m * chunk_rows(m);
  float *fa = tmp(&w, min64(n, step)), *fo = tmp(&w, min64(n, step));
  for (int64_t off = 0; !w.failed && off < n; off += step) {
    int64_t len = min64(step, n - off);
    get(fa, a, dt, off, len);
    fsdp_cpu_binary_forward(fo, fa, fb, len, m, op);
    put(out, dt, off, fo, len);
  }
  return fsdp_cpu_work_done(&w);
}

/* operands: da, db (NULL when it is da: x * x), dout, a, b */
static void binary_bw_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  (void)u0;
  fsdp_cpu_binary_backward(f[0], m->same ? f[0] : f[1], f[2], f[3], f[4], nu, nu,
                           (fsdp_binop)m->op);
}

int fsdp_cpu_half_binary_backward(fsdp_dtype dt, void *da, void *db, const void *dout,
                                  const void *a, const void *b, int64_t n, int64_t m,
                                  fsdp_binop op) {
  if (m == n) { /* lockstep; da and db may be one buffer (x * x) */
    const bool same = db == da;
    hmap h = {.dt = dt, .p = {da, same ? NULL : db, (void *)dout, (void *)a, (void *)b},
              .rd = 0x1f, .wr = 3, .keep = 0x1c, .row = 1, .fn = binary_bw_fn, .op = op,
              .same = same};
    hmap_run(&h, n);
    return FSDP_OK;
  }
  /* broadcast: b and its gradient whole (f32 across chunks), a and its gradient in chunks */
  fsdp_cpu_work w = {0};
  int64_t step = m * chunk_rows(m), c = min64(n, step);
  float *fb = whole(&w, b, dt, m), *fdb = whole(&w, db, dt, m);
  float *fg = tmp(&w, c), *fa = tmp(&w, c), *fda = opt(&w, da, c);
  for (int64_t off = 0; !w.failed && off < n; off += step) {
    int64_t len = min64(step, n - off);
    get(fg, dout, dt, off, len);
    get(fa, a, dt, off, len);
    get(fda, da, dt, off, len);
    fsdp_cpu_binary_backward(fda, fdb, fg, fa, fb, len, m, op);
    put(da, dt, off, fda, len);
  }
  if (!w.failed) put(db, dt, 0, fdb, m);
  return fsdp_cpu_work_done(&w);
}

static void unary_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  (void)u0;
  m->uf((fsdp_unary_op)m->op, f[0], f[1], nu);
}

int fsdp_cpu_half_unary_forward(fsdp_dtype dt, fsdp_unary_op op, void *out, const void *in,
                                int64_t n, void (*f32)(fsdp_unary_op, float *, const float *, int64_t)) {
  hmap m = {.dt = dt, .p = {out, (void *)in}, .rd = 2, .wr = 1, .keep = 3, .row = 1,
            .fn = unary_fn, .op = op, .uf = f32};
  hmap_run(&m, n);
  return FSDP_OK;
}

/* operands: din, dout, in, out */
static void unary_bw_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  (void)u0;
  m->ub((fsdp_unary_op)m->op, f[0], f[1], f[2], f[3], nu);
}

int fsdp_cpu_half_unary_backward(fsdp_dtype dt, fsdp_unary_op op, void *din, const void *dout,
                                 const void *in, const void *out, int64_t n,
                                 void (*f32)(fsdp_unary_op, float *, const float *,
                                             const float *, const float *, int64_t)) {
  hmap m = {.dt = dt, .p = {din, (void *)dout, (void *)in, (void *)out}, .rd = 0xf, .wr = 1,
            .keep = 3, .row = 1, .fn = unary_bw_fn, .op = op, .ub = f32};
  hmap_run(&m, n);
  return FSDP_OK;
}

/* operands: out, mask, in; element u0 + i draws u from the stream at first + u0 + i, so the
 * mask is the one a single call draws */
static void dropout_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  fsdp_cpu_dropout_forward(f[0], f[1], f[2], nu, m->s, m->key, m->first + (uint64_t)u0);
}

int fsdp_cpu_half_dropout_forward(fsdp_dtype dt, void *out, void *mask, const void *in,
                                  int64_t n, float p, uint64_t key, uint64_t first) {
  hmap m = {.dt = dt, .p = {out, mask, (void *)in}, .rd = 4, .wr = 3, .keep = 7, .row = 1,
            .fn = dropout_fn, .s = p, .key = key, .first = first};
  hmap_run(&m, n);
  return FSDP_OK;
}

static void dropout_bw_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  (void)m, (void)u0;
  fsdp_cpu_dropout_backward(f[0], f[1], f[2], nu);
}

int fsdp_cpu_half_dropout_backward(fsdp_dtype dt, void *din, const void *dout, const void *mask,
                                   int64_t n) {
  hmap m = {.dt = dt, .p = {din, (void *)dout, (void *)mask}, .rd = 7, .wr = 1, .keep = 7,
            .row = 1, .fn = dropout_bw_fn};
  hmap_run(&m, n);
  return FSDP_OK;
}

/* A weight gradient (n elements of gdt) to accumulate into in f32: the buffer itself when it is
 * f32 (mixed precision), else a widened copy put back by put_grad. */
static float *grad_acc(fsdp_cpu_work *w, void *g, fsdp_dtype gdt, fsdp_dtype dt, int64_t n) {
  return gdt == FSDP_DTYPE_F32 ? g : whole(w, g, dt, n);
}

static void put_grad(void *g, fsdp_dtype gdt, fsdp_dtype dt, const float *f, int64_t n) {
  if (gdt != FSDP_DTYPE_F32) put(g, dt, 0, f, n);
}

/* ---- bias + GELU -------------------------------------------------------------------------- */

static void bias_gelu_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  (void)u0;
  fsdp_cpu_bias_gelu_forward(f[0], f[1], m->w0, nu, (int)m->row);
}

/* bf16 runs natively: the level's bodies load and store bf16 lanes themselves (vmath.h), so
 * the memory traffic overlaps the GELU's arithmetic and nothing goes through f32 buffers; f16
 * takes the pass. One call's arguments: y is the forward's out, or the backward's dinp. */
typedef struct {
  fsdp_dtype dt;
  void *y;
  const void *dout, *inp;
  const float *bias;
  float *dbias;
  int64_t N;
  int C;
  bool set;
} bias_gelu_job;

static void bias_gelu_bf16_fw_task(void *ctx, int64_t lo, int64_t hi) {
  const bias_gelu_job *j = ctx;
  fsdp_cpu_vec()->bias_gelu_forward_bf16(j->y, j->inp, j->bias, lo, hi, j->C);
}

static void bias_gelu_bf16_bw_task(void *ctx, int64_t lo, int64_t hi) {
  const bias_gelu_job *j = ctx;
  fsdp_cpu_vec()->bias_gelu_backward_cols_bf16(j->y, j->dbias, j->dout, j->inp, j->bias, j->N,
                                               j->C, (int)lo, (int)hi, j->set);
}

int fsdp_cpu_half_bias_gelu_forward(fsdp_dtype dt, void *out, const void *inp, const void *bias,
                                    int64_t N, int C) {
  fsdp_cpu_work w = {0};
  float *fb = whole(&w, bias, dt, C);
  if (!w.failed && dt == FSDP_DTYPE_BF16) {
    bias_gelu_job j = {.dt = dt, .y = out, .inp = inp, .bias = fb, .N = N, .C = C};
    fsdp_cpu_parallel_for(N, fsdp_cpu_grain_rows(C, FSDP_CPU_GRAIN_HEAVY), bias_gelu_bf16_fw_task,
                          &j);
    return fsdp_cpu_work_done(&w);
  }
  if (!w.failed && hmap_fits(C)) {
    hmap m = {.dt = dt, .p = {out, (void *)inp}, .rd = 2, .wr = 1, .keep = 3, .row = C,
              .fn = bias_gelu_fn, .w0 = fb};
    hmap_run(&m, N);
    return fsdp_cpu_work_done(&w);
  }
  int64_t rows = chunk_rows(C), c = min64(N, rows);
  float *fi = tmp(&w, c * C), *fo = tmp(&w, c * C);
  for (int64_t r = 0; !w.failed && r < N; r += rows) {
    int64_t len = min64(rows, N - r);
    get(fi, inp, dt, r * C, len * C);
    fsdp_cpu_bias_gelu_forward(fo, fi, fb, len, C);
    put(out, dt, r * C, fo, len * C);
  }
  return fsdp_cpu_work_done(&w);
}

/* The backward sums over rows (the bias gradient), so it is split by columns, as the f32
 * kernel is. bf16: the level's body on bf16 rows, the f32 kernel's sums exactly. f16: a task
 * takes whole columns and walks them in tiles of BG_ROWS rows x BG_COLS columns, widened into
 * its stack; each tile's column sums (in double, rounded to f32 once per tile) are added in
 * double in row order. The tiles depend on the sizes alone, so the bias gradient has the same
 * bits at any thread count. */
#define BG_COLS 256
#define BG_ROWS (SLICE / BG_COLS)

static void tile_in(float *f, const void *src, fsdp_dtype dt, int64_t r0, int rows, int C,
                    int64_t c0, int w) {
  for (int r = 0; r < rows; r++) widen(f + (int64_t)r * w, src, dt, (r0 + r) * C + c0, w);
}

static void tile_out(void *dst, fsdp_dtype dt, const float *f, int64_t r0, int rows, int C,
                     int64_t c0, int w) {
  for (int r = 0; r < rows; r++) narrow(dst, dt, (r0 + r) * C + c0, f + (int64_t)r * w, w);
}

static void bias_gelu_bw_task(void *ctx, int64_t lo, int64_t hi) {
  const bias_gelu_job *j = ctx;
  const fsdp_cpu_vec_i *vec = fsdp_cpu_vec();
  _Alignas(64) float g[SLICE], x[SLICE], d[SLICE], db[BG_COLS];
  double acc[BG_COLS];
  for (int64_t c0 = lo; c0 < hi; c0 += BG_COLS) {
    const int w = (int)min64(BG_COLS, hi - c0);
    memset(acc, 0, sizeof(double) * (size_t)w);
    for (int64_t r0 = 0; r0 < j->N; r0 += BG_ROWS) {
      const int rows = (int)min64(BG_ROWS, j->N - r0);
      tile_in(g, j->dout, j->dt, r0, rows, j->C, c0, w);
      tile_in(x, j->inp, j->dt, r0, rows, j->C, c0, w);
      if (j->y && !j->set) tile_in(d, j->y, j->dt, r0, rows, j->C, c0, w);
      memset(db, 0, sizeof(float) * (size_t)w);
      vec->bias_gelu_backward_cols(j->y ? d : NULL, j->dbias ? db : NULL, g, x, j->bias + c0, rows,
                                   w, 0, w, j->set);
      if (j->y) tile_out(j->y, j->dt, d, r0, rows, j->C, c0, w);
      for (int k = 0; k < w; k++) acc[k] += (double)db[k];
    }
    if (j->dbias)
      for (int k = 0; k < w; k++) j->dbias[c0 + k] += (float)acc[k];
  }
}

int fsdp_cpu_half_bias_gelu_backward(fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dbias,
                                     const void *dout, const void *inp, const void *bias,
                                     int64_t N, int C, bool set_dinp) {
  if (N <= 0 || (!dinp && !dbias)) return FSDP_OK;
  fsdp_cpu_work w = {0};
  float *fb = whole(&w, bias, dt, C), *fdb = dbias ? grad_acc(&w, dbias, gdt, dt, C) : NULL;
  if (!w.failed) {
    bias_gelu_job j = {.dt = dt, .y = dinp, .dout = dout, .inp = inp, .bias = fb, .dbias = fdb,
                       .N = N, .C = C, .set = set_dinp};
    if (dt == FSDP_DTYPE_BF16) {
      /* by columns as the f32 kernel: each column's rows added in order, any thread count */
      int64_t grain = fsdp_cpu_grain_rows(N, FSDP_CPU_GRAIN_HEAVY);
      fsdp_cpu_parallel_for(C, grain < 64 ? 64 : grain, bias_gelu_bf16_bw_task, &j);
    } else {
      fsdp_cpu_parallel_for(C, BG_COLS, bias_gelu_bw_task, &j);
    }
    if (dbias) put_grad(dbias, gdt, dt, fdb, C);
  }
  return fsdp_cpu_work_done(&w);
}

/* ---- products: the native bf16 path where it is taken (gemm.h) ------------------------------ */

bool fsdp_cpu_half_native(fsdp_dtype dt, int M, int N, int K) {
  return dt == FSDP_DTYPE_BF16 && M > 0 && N > 0 && K > 0 &&
         (int64_t)M * N * K >= NATIVE_MIN && fsdp_cpu_bf16_gemm_native();
}

int fsdp_cpu_half_bmm_forward(fsdp_dtype dt, void *out, const void *a, const void *b, int B,
                              int M, int K, int N) {
  // out (B, M, N), a (B, M, K), b (B, K, N)
  const uint16_t *pa = a, *pb = b;
  uint16_t *po = out;
  for (int i = 0; i < B; i++) {
    if (fsdp_cpu_bf16_gemm(po + (int64_t)i * M * N, dt, pa + (int64_t)i * M * K,
                           pb + (int64_t)i * K * N, NULL, dt, M, N, K, false, false, 1.0f, 0.0f,
                           K, N, N))
      return FSDP_ERR;
  }
  return FSDP_OK;
}

int fsdp_cpu_half_bmm_backward(fsdp_dtype dt, void *da, void *db, const void *dout,
                               const void *a, const void *b, int B, int M, int K, int N) {
  // da (B, M, K), db (B, K, N), dout (B, M, N), a (B, M, K), b (B, K, N)
  const uint16_t *pa = a, *pb = b, *pg = dout;
  uint16_t *pda = da, *pdb = db;
  for (int i = 0; i < B; i++) {
    const uint16_t *g = pg + (int64_t)i * M * N;
    if (da && fsdp_cpu_bf16_gemm(pda + (int64_t)i * M * K, dt, g, pb + (int64_t)i * K * N, NULL,
                                 dt, M, K, N, false, true, 1.0f, 1.0f, N, N, K))
      return FSDP_ERR;
    if (db && fsdp_cpu_bf16_gemm(pdb + (int64_t)i * K * N, dt, pa + (int64_t)i * M * K, g, NULL,
                                 dt, K, N, M, true, false, 1.0f, 1.0f, K, N, N))
      return FSDP_ERR;
  }
  return FSDP_OK;
}

/* ---- rows: linear, layernorm, softmax, cross-entropy ---------------------------------------- */

int fsdp_cpu_half_linear_forward(fsdp_dtype dt, void *out, const void *inp, const void *weight,
                                 const void *bias, int M, int K, int N) {
  if (fsdp_cpu_half_native(dt, M, N, K)) {
    return fsdp_cpu_bf16_gemm(out, dt, inp, weight, bias, dt, M, N, K, false, true, 1.0f, 0.0f,
                              K, K, N);
  }
  fsdp_cpu_work w = {0};
  int64_t rows = rows_in(GEMM_CHUNK, K > N ? K : N), c = min64(M, rows);
  float *fw = whole(&w, weight, dt, (int64_t)N * K), *fb = whole(&w, bias, dt, N);
  float *fi = tmp(&w, c * K), *fo = tmp(&w, c * N);
  for (int64_t r = 0; !w.failed && r < M; r += rows) {
    int64_t len = min64(rows, M - r);
    get(fi, inp, dt, r * K, len * K);
    fsdp_cpu_linear_forward(fo, fi, fw, fb, (int)len, K, N);
    put(out, dt, r * N, fo, len * N);
  }
  return fsdp_cpu_work_done(&w);
}

/* dbias (N, of gdt) += the column sums of dout (M, N), read in its own dtype */
static int half_bias_grad(fsdp_dtype dt, fsdp_dtype gdt, void *dbias, const void *dout, int M,
                          int N) {
  fsdp_cpu_work w = {0};
  float *fdb = grad_acc(&w, dbias, gdt, dt, N);
  if (!w.failed) {
    fsdp_cpu_colsum_acc_half(fdb, dout, dt, M, N);
    put_grad(dbias, gdt, dt, fdb, N);
  }
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_linear_backward(fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dweight,
                                  void *dbias, const void *dout, const void *inp,
                                  const void *weight, int M, int K, int N) {
  if (fsdp_cpu_half_native(dt, M, N, K)) {
    /* dinp (M, K) += dout @ weight ; dweight (N, K) += dout^T @ inp, in gdt */
    if (dinp && fsdp_cpu_bf16_gemm(dinp, dt, dout, weight, NULL, dt, M, K, N, false, false, 1.0f,
                                   1.0f, N, K, K))
      return FSDP_ERR;
    if (dweight && fsdp_cpu_bf16_gemm(dweight, gdt, dout, inp, NULL, dt, N, K, M, true, false,
                                      1.0f, 1.0f, N, K, K))
      return FSDP_ERR;
    return dbias ? half_bias_grad(dt, gdt, dbias, dout, M, N) : FSDP_OK;
  }
  fsdp_cpu_work w = {0};
  int64_t rows = rows_in(GEMM_CHUNK, K > N ? K : N), c = min64(M, rows);
  float *fw = dinp ? whole(&w, weight, dt, (int64_t)N * K) : NULL;
  float *fdw = grad_acc(&w, dweight, gdt, dt, (int64_t)N * K);
  float *fdb = grad_acc(&w, dbias, gdt, dt, N);
  float *fg = tmp(&w, c * N), *fi = dweight ? tmp(&w, c * K) : NULL, *fdi = opt(&w, dinp, c * K);
  for (int64_t r = 0; !w.failed && r < M; r += rows) {
    int64_t len = min64(rows, M - r);
    get(fg, dout, dt, r * N, len * N);
    get(fi, inp, dt, r * K, len * K);
    get(fdi, dinp, dt, r * K, len * K);
    fsdp_cpu_linear_backward(fdi, fdw, fdb, fg, fi, fw, (int)len, K, N);
    put(dinp, dt, r * K, fdi, len * K);
  }
  if (!w.failed) {
    put_grad(dweight, gdt, dt, fdw, (int64_t)N * K);
    put_grad(dbias, gdt, dt, fdb, N);
  }
  return fsdp_cpu_work_done(&w);
}

/* operands: out, inp; w0, w1 weight and bias; r0, r1 mean and rstd */
static void layernorm_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  fsdp_cpu_layernorm_forward(f[0], m->r0 + u0, m->r1 + u0, f[1], m->w0, m->w1, nu, (int)m->row,
                             m->s);
}

/* Layernorm's forward on bf16 rows up to FSDP_CPU_LN_ROW_MAX, after the residual add when b
 * is given (sum = a + b): the level's bf16 body (isa.h), each row widened once into an f32 row
 * on the stack, the add's sum rounded and stored on the way; weight and bias widened once. */
typedef struct {
  uint16_t *out, *sum;
  float *mean, *rstd;
  const uint16_t *a, *b;
  const float *w, *bias;
  int C;
  float eps;
} ln_fw_job;

static void ln_fw_bf16_task(void *ctx, int64_t lo, int64_t hi) {
  const ln_fw_job *j = ctx;
  fsdp_cpu_vec()->layernorm_forward_bf16(j->out, j->sum, j->mean, j->rstd, j->a, j->b, j->w,
                                         j->bias, lo, hi, j->C, j->eps);
}

static bool ln_fw_native(fsdp_dtype dt, int C) {
  return dt == FSDP_DTYPE_BF16 && C >= 1 && C <= FSDP_CPU_LN_ROW_MAX;
}

static int ln_fw_bf16(void *out, void *sum, float *mean, float *rstd, const void *a,
                      const void *b, const void *weight, const void *bias, int64_t N, int C,
                      float eps) {
  fsdp_cpu_work w = {0};
  ln_fw_job j = {.out = out, .sum = sum, .mean = mean, .rstd = rstd, .a = a, .b = b,
                 .w = whole(&w, weight, FSDP_DTYPE_BF16, C),
                 .bias = whole(&w, bias, FSDP_DTYPE_BF16, C), .C = C, .eps = eps};
  if (!w.failed)
    fsdp_cpu_parallel_for(N, fsdp_cpu_grain_rows(C, FSDP_CPU_GRAIN), ln_fw_bf16_task, &j);
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_layernorm_forward(fsdp_dtype dt, void *out, float *mean, float *rstd,
                                    const void *inp, const void *weight, const void *bias,
                                    int64_t N, int C, float eps) {
  if (ln_fw_native(dt, C))
    return ln_fw_bf16(out, NULL, mean, rstd, inp, NULL, weight, bias, N, C, eps);
  fsdp_cpu_work w = {0};
  float *fw = whole(&w, weight, dt, C), *fb = whole(&w, bias, dt, C);
  if (!w.failed && hmap_fits(C)) {
    hmap m = {.dt = dt, .p = {out, (void *)inp}, .rd = 2, .wr = 1, .keep = 3, .row = C,
              .fn = layernorm_fn, .w0 = fw, .w1 = fb, .r0 = mean, .r1 = rstd, .s = eps};
    hmap_run(&m, N);
    return fsdp_cpu_work_done(&w);
  }
  int64_t rows = chunk_rows(C), c = min64(N, rows);
  float *fi = tmp(&w, c * C), *fo = tmp(&w, c * C);
  for (int64_t r = 0; !w.failed && r < N; r += rows) {
    int64_t len = min64(rows, N - r);
    get(fi, inp, dt, r * C, len * C);
    fsdp_cpu_layernorm_forward(fo, mean + r, rstd + r, fi, fw, fb, len, C, eps);
    put(out, dt, r * C, fo, len * C);
  }
  return fsdp_cpu_work_done(&w);
}

/* operands: sum, out (narrowed), a, b (widened); w0, w1 weight and bias; r0, r1 mean and rstd.
 * The sum is rounded to the dtype before it is normalised: the layernorm reads the sum as it is
 * stored, as the unfused add and layernorm do. */
static void add_layernorm_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  const int64_t len = nu * m->row;
  uint16_t h[SLICE];
  fsdp_cpu_binary_forward(f[0], f[2], f[3], len, len, FSDP_BIN_ADD);
  narrow(h, m->dt, 0, f[0], len);
  widen(f[0], h, m->dt, 0, len);
  fsdp_cpu_layernorm_forward(f[1], m->r0 + u0, m->r1 + u0, f[0], m->w0, m->w1, nu, (int)m->row,
                             m->s);
}

int fsdp_cpu_half_add_layernorm_forward(fsdp_dtype dt, void *sum, void *out, float *mean,
                                        float *rstd, const void *a, const void *b,
                                        const void *weight, const void *bias, int64_t N, int C,
                                        float eps) {
  if (ln_fw_native(dt, C))
    return ln_fw_bf16(out, sum, mean, rstd, a, b, weight, bias, N, C, eps);
  if (!hmap_fits(C)) { /* rows longer than a slice: the two kernels one after the other */
    const int64_t n = N * C;
    if (fsdp_cpu_half_binary_forward(dt, sum, a, b, n, n, FSDP_BIN_ADD)) return FSDP_ERR;
    return fsdp_cpu_half_layernorm_forward(dt, out, mean, rstd, sum, weight, bias, N, C, eps);
  }
  fsdp_cpu_work w = {0};
  float *fw = whole(&w, weight, dt, C), *fb = whole(&w, bias, dt, C);
  if (!w.failed) {
    hmap m = {.dt = dt, .p = {sum, out, (void *)a, (void *)b}, .rd = 0xc, .wr = 0x3, .keep = 3,
              .row = C, .fn = add_layernorm_fn, .w0 = fw, .w1 = fb, .r0 = mean, .r1 = rstd,
              .s = eps};
    hmap_run(&m, N);
  }
  return fsdp_cpu_work_done(&w);
}

/* Layernorm's backward as the f32 kernel does it (norm.c): the parameter terms go into one
 * partial sum per block of LN_BLOCK_ROWS rows (rows in order inside a block), the blocks' partials
 * are then added in block order; blocks are fixed by N alone. On bf16 a task runs the level's
 * bf16 row body over its block (loads widen, stores round: no scratch); on f16 it widens its
 * block's rows a slice at a time for the f32 row body. Either way each row's terms go into the
 * block's partials as in f32, so the sums have the f32 kernel's bits. */
#define LN_BLOCK_ROWS 64

typedef struct {
  fsdp_dtype dt;
  void *dinp;
  const void *dout, *inp;
  const float *weight, *mean, *rstd;
  float *pw, *pb; /* (blocks, C) partials, zeroed; or dweight / dbias themselves (one block) */
  int64_t N, block_rows;
  int C;
} ln_bw_job;

static void ln_bw_task(void *ctx, int64_t lo, int64_t hi) {
  const ln_bw_job *j = ctx;
  const fsdp_cpu_vec_i *vec = fsdp_cpu_vec();
  const int C = j->C;
  const int64_t per = SLICE / C;
  _Alignas(64) float g[SLICE], x[SLICE], d[SLICE];
  for (int64_t b = lo; b < hi; b++) {
    const int64_t r0 = b * j->block_rows, r1 = min64(r0 + j->block_rows, j->N);
    float *pw = j->pw ? j->pw + (j->block_rows < j->N ? b * C : 0) : NULL;
    float *pb = j->pb ? j->pb + (j->block_rows < j->N ? b * C : 0) : NULL;
    if (j->dt == FSDP_DTYPE_BF16) { /* the level's bf16 body: no slices to widen */
      const int64_t off = r0 * C;
      vec->layernorm_backward_bf16(j->dinp ? (uint16_t *)j->dinp + off : NULL, pw, pb,
                                   (const uint16_t *)j->dout + off,
                                   (const uint16_t *)j->inp + off, j->weight, j->mean + r0,
                                   j->rstd + r0, 0, r1 - r0, C);
      continue;
    }
    for (int64_t r = r0; r < r1; r += per) {
      const int64_t nr = min64(per, r1 - r), off = r * C, len = nr * C;
      widen(g, j->dout, j->dt, off, len);
      widen(x, j->inp, j->dt, off, len);
      if (j->dinp) widen(d, j->dinp, j->dt, off, len);
      vec->layernorm_backward(j->dinp ? d : NULL, pw, pb, g, x, j->weight, j->mean + r,
                              j->rstd + r, 0, nr, C);
      if (j->dinp) narrow(j->dinp, j->dt, off, d, len);
    }
  }
}

static int half_layernorm_backward_blocks(fsdp_dtype dt, fsdp_dtype gdt, void *dinp,
                                          void *dweight, void *dbias, const void *dout,
                                          const void *inp, const void *weight,
                                          const float *mean, const float *rstd, int64_t N,
                                          int C) {
  fsdp_cpu_work w = {0};
  float *fw = whole(&w, weight, dt, C);
  float *fdw = dweight ? grad_acc(&w, dweight, gdt, dt, C) : NULL;
  float *fdb = dbias ? grad_acc(&w, dbias, gdt, dt, C) : NULL;
  const int64_t blocks = (N + LN_BLOCK_ROWS - 1) / LN_BLOCK_ROWS;
  ln_bw_job j = {.dt = dt, .dinp = dinp, .dout = dout, .inp = inp, .weight = fw, .mean = mean,
                 .rstd = rstd, .N = N, .block_rows = LN_BLOCK_ROWS, .C = C};
  if ((!fdw && !fdb) || blocks <= 1) {
    /* no sums to order, or one block: rows straight into the sums, rows of the pass split
     * over the threads only when there are no sums */
    j.pw = fdw, j.pb = fdb, j.block_rows = N;
    if (!w.failed && (fdw || fdb)) ln_bw_task(&j, 0, 1);
    else if (!w.failed) {
      j.block_rows = C <= SLICE ? SLICE / C : 1; /* longer rows: bf16 only, one a block */
      const int64_t nb = (N + j.block_rows - 1) / j.block_rows,
                    grain = FSDP_CPU_GRAIN / (j.block_rows * C);
      fsdp_cpu_parallel_for(nb, grain < 1 ? 1 : grain, ln_bw_task, &j);
    }
  } else {
    float *part = tmp(&w, blocks * C * 2);
    if (!w.failed) {
      memset(part, 0, sizeof(float) * (size_t)(blocks * C * 2));
      j.pw = fdw ? part : NULL;
      j.pb = fdb ? part + blocks * C : NULL;
      fsdp_cpu_parallel_for(blocks, 1, ln_bw_task, &j);
      for (int k = 0; k < 2; k++) { /* dst += p[0] + p[1] + ..., blocks in order */
        float *p = k ? j.pb : j.pw, *dst = k ? fdb : fdw;
        if (!p) continue;
        for (int64_t b = 1; b < blocks; b++)
          for (int c = 0; c < C; c++) p[c] += p[b * C + c];
        for (int c = 0; c < C; c++) dst[c] += p[c];
      }
    }
  }
  if (!w.failed) {
    if (dweight) put_grad(dweight, gdt, dt, fdw, C);
    if (dbias) put_grad(dbias, gdt, dt, fdb, C);
  }
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_layernorm_backward(fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dweight,
                                     void *dbias, const void *dout, const void *inp,
                                     const void *weight, const float *mean, const float *rstd,
                                     int64_t N, int C) {
  if (N <= 0) return FSDP_OK;
  /* bf16 rows of any length go through the level's bf16 row body: nothing to widen */
  if (hmap_fits(C) || dt == FSDP_DTYPE_BF16)
    return half_layernorm_backward_blocks(dt, gdt, dinp, dweight, dbias, dout, inp, weight,
                                          mean, rstd, N, C);
  fsdp_cpu_work w = {0};
  int64_t rows = chunk_rows(C), c = min64(N, rows);
  float *fw = whole(&w, weight, dt, C), *fdw = grad_acc(&w, dweight, gdt, dt, C),
        *fdb = grad_acc(&w, dbias, gdt, dt, C);
  float *fg = tmp(&w, c * C), *fi = tmp(&w, c * C), *fdi = opt(&w, dinp, c * C);
  for (int64_t r = 0; !w.failed && r < N; r += rows) {
    int64_t len = min64(rows, N - r);
    get(fg, dout, dt, r * C, len * C);
    get(fi, inp, dt, r * C, len * C);
    get(fdi, dinp, dt, r * C, len * C);
    fsdp_cpu_layernorm_backward(fdi, fdw, fdb, fg, fi, fw, mean + r, rstd + r, len, C);
    put(dinp, dt, r * C, fdi, len * C);
  }
  if (!w.failed) {
    put_grad(dweight, gdt, dt, fdw, C);
    put_grad(dbias, gdt, dt, fdb, C);
  }
  return fsdp_cpu_work_done(&w);
}

static void softmax_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  (void)u0;
  fsdp_cpu_softmax_forward(f[0], f[1], nu, (int)m->row);
}

static void softmax_bw_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  (void)u0;
  fsdp_cpu_softmax_backward(f[0], f[1], f[2], nu, (int)m->row);
}

int fsdp_cpu_half_softmax_forward(fsdp_dtype dt, void *out, const void *inp, int64_t N, int C) {
  if (hmap_fits(C)) {
    hmap m = {.dt = dt, .p = {out, (void *)inp}, .rd = 2, .wr = 1, .keep = 3, .row = C,
              .fn = softmax_fn};
    hmap_run(&m, N);
    return FSDP_OK;
  }
  fsdp_cpu_work w = {0};
  int64_t rows = chunk_rows(C), c = min64(N, rows);
  float *fi = tmp(&w, c * C), *fo = tmp(&w, c * C);
  for (int64_t r = 0; !w.failed && r < N; r += rows) {
    int64_t len = min64(rows, N - r);
    get(fi, inp, dt, r * C, len * C);
    fsdp_cpu_softmax_forward(fo, fi, len, C);
    put(out, dt, r * C, fo, len * C);
  }
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_softmax_backward(fsdp_dtype dt, void *dinp, const void *dout, const void *out,
                                   int64_t N, int C) {
  if (hmap_fits(C)) {
    hmap m = {.dt = dt, .p = {dinp, (void *)dout, (void *)out}, .rd = 7, .wr = 1, .keep = 7,
              .row = C, .fn = softmax_bw_fn};
    hmap_run(&m, N);
    return FSDP_OK;
  }
  fsdp_cpu_work w = {0};
  int64_t rows = chunk_rows(C), c = min64(N, rows);
  float *fg = tmp(&w, c * C), *fo = tmp(&w, c * C), *fd = tmp(&w, c * C);
  for (int64_t r = 0; !w.failed && r < N; r += rows) {
    int64_t len = min64(rows, N - r);
    get(fg, dout, dt, r * C, len * C);
    get(fo, out, dt, r * C, len * C);
    get(fd, dinp, dt, r * C, len * C);
    fsdp_cpu_softmax_backward(fd, fg, fo, len, C);
    put(dinp, dt, r * C, fd, len * C);
  }
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_cross_entropy_forward(fsdp_dtype dt, float *loss, float *lse,
                                        const void *logits, const int64_t *targets, int64_t N,
                                        int V, int64_t ignore, int64_t *count) {
  fsdp_cpu_work w = {0};
  int64_t rows = chunk_rows(V), c = min64(N, rows), counted = 0;
  float *fl = tmp(&w, c * V);
  double total = 0;
  for (int64_t r = 0; !w.failed && r < N; r += rows) {
    int64_t len = min64(rows, N - r), k = 0;
    get(fl, logits, dt, r * V, len * V);
    float mean = fsdp_cpu_cross_entropy_forward(lse + r, fl, targets + r, len, V, ignore, &k);
    total += (double)mean * (double)k;
    counted += k;
  }
  *count = counted;
  loss[0] = counted ? (float)(total / (double)counted) : 0.0f;
  return fsdp_cpu_work_done(&w);
}

/* operands: dlogits, logits; r0 lse */
static void cross_entropy_bw_fn(const hmap *m, float *const *f, int64_t u0, int64_t nu) {
  fsdp_cpu_cross_entropy_backward(f[0], m->s, f[1], m->r0 + u0, m->targets + u0, nu, (int)m->row,
                                  m->ignore, m->count);
}

int fsdp_cpu_half_cross_entropy_backward(fsdp_dtype dt, void *dlogits, float dloss,
                                         const void *logits, const float *lse,
                                         const int64_t *targets, int64_t N, int V,
                                         int64_t ignore, int64_t count) {
  if (hmap_fits(V)) {
    hmap m = {.dt = dt, .p = {dlogits, (void *)logits}, .rd = 3, .wr = 1, .keep = 3, .row = V,
              .fn = cross_entropy_bw_fn, .r0 = (float *)lse, .targets = targets, .s = dloss,
              .ignore = ignore, .count = count};
    hmap_run(&m, N);
    return FSDP_OK;
  }
  fsdp_cpu_work w = {0};
  int64_t rows = chunk_rows(V), c = min64(N, rows);
  float *fl = tmp(&w, c * V), *fd = tmp(&w, c * V);
  for (int64_t r = 0; !w.failed && r < N; r += rows) {
    int64_t len = min64(rows, N - r);
    get(fl, logits, dt, r * V, len * V);
    get(fd, dlogits, dt, r * V, len * V);
    fsdp_cpu_cross_entropy_backward(fd, dloss, fl, lse + r, targets + r, len, V, ignore, count);
    put(dlogits, dt, r * V, fd, len * V);
  }
  return fsdp_cpu_work_done(&w);
}

/* ---- attention ----------------------------------------------------------------------------------
 * One batch row at a time: its qkv rows are widened (one contiguous stretch), the f32 kernel
 * runs on them and its output rows are narrowed back, keeping the f32 kernel's row stats (a
 * batch row's are contiguous in the (B, NH, T, 2) layout); the backward widens the row again and
 * the f32 kernel rebuilds the probabilities from them (f32, the forward's bits). With at
 * least two rows a thread, the rows are shared out over the threads, each task with its own
 * scratch slot (allocated up front) and the f32 kernel serial inside it, so every conversion
 * runs on the thread that uses the data. Otherwise (fewer rows, e.g. sampling one sequence) the
 * rows go one after the other and the f32 kernel splits each over the threads. */
typedef struct {
  fsdp_dtype dt;
  void *out, *dqkv;
  const void *qkv, *dout;
  float *keep;        /* forward: the rows' stats, or NULL */
  const float *saved; /* backward: the forward's stats, or NULL */
  int B, T, C, NH, nchunks;
  int64_t slot; /* floats per task's scratch slot */
  float *scratch;
  bool set; /* backward: dqkv written, not added (never read) */
} att_job;

/* the scratch slot of the chunk that starts at lo */
static float *att_slot(const att_job *j, int64_t lo) {
  return j->scratch + (int64_t)fsdp_cpu_chunk_at(j->B, 1, j->nchunks, lo) * j->slot;
}

/* batch row b's stats in st (NULL: none) */
static float *row_stats(const float *st, const att_job *j, int64_t b) {
  return st ? (float *)st + b * j->NH * j->T * 2 : NULL;
}

/* n floats rounded up to 64 bytes: each buffer in a slot starts on a cache line, as the
 * separate buffers of the one-row-at-a-time way do */
static int64_t al16(int64_t n) { return (n + 15) / 16 * 16; }

static void att_forward_rows(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  const int64_t nq = (int64_t)j->T * 3 * j->C, no = (int64_t)j->T * j->C;
  float *fq = att_slot(j, lo), *fo = fq + al16(nq), *sc = fo + al16(no);
  for (int64_t b = lo; b < hi; b++) {
    widen(fq, j->qkv, j->dt, b * nq, nq);
    fsdp_cpu_attention_forward(fo, row_stats(j->keep, j, b), sc, fq, 1, j->T, j->C, j->NH);
    narrow(j->out, j->dt, b * no, fo, no);
  }
}

static void att_backward_rows(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  const int64_t nq = (int64_t)j->T * 3 * j->C, no = (int64_t)j->T * j->C;
  float *fq = att_slot(j, lo), *fd = fq + al16(nq), *fg = fd + al16(nq), *sc = fg + al16(no);
  for (int64_t b = lo; b < hi; b++) {
    widen(fq, j->qkv, j->dt, b * nq, nq);
    if (!j->set) widen(fd, j->dqkv, j->dt, b * nq, nq);
    widen(fg, j->dout, j->dt, b * no, no);
    fsdp_cpu_attention_backward(fd, sc, fg, fq, row_stats(j->saved, j, b), 1, j->T, j->C, j->NH,
                                j->set);
    narrow(j->dqkv, j->dt, b * nq, fd, nq);
  }
}

/* the rows shared out over the threads; false when there are too few to (the caller loops) */
static bool att_rows(att_job *j, bool backward, int *rc) {
  const int threads = fsdp_cpu_threads();
  if (threads > 1 && j->B < 2 * threads) return false;
  const int64_t nq = (int64_t)j->T * 3 * j->C, no = (int64_t)j->T * j->C;
  /* inside a task the f32 kernel runs on one thread */
  const int64_t sc = fsdp_cpu_attention_scratch(1, j->T, j->C, j->NH, 1, backward);
  j->nchunks = fsdp_cpu_chunks(j->B, 1);
  j->slot = (backward ? 2 * al16(nq) : al16(nq)) + al16(no) + al16(sc);
  fsdp_cpu_work w = {0};
  j->scratch = tmp(&w, j->slot * j->nchunks);
  if (!w.failed)
    fsdp_cpu_parallel_for(j->B, 1, backward ? att_backward_rows : att_forward_rows, j);
  *rc = fsdp_cpu_work_done(&w);
  return true;
}

/* ---- attention: one batch element at a time ---------------------------------------------------- */

/* Whether the native way takes the forward of this call (the backward's own conditions include
 * these): otherwise the widening way computes it, and its stats are the f32 kernel's. */
static bool att_native_forward(fsdp_dtype dt, const void *qkv, int B, int T, int C, int NH) {
  return dt == FSDP_DTYPE_BF16 && fsdp_cpu_bf16_attention_native(B, T, C, NH) &&
         fsdp_cpu_bf16_attention_aligned(qkv, NULL);
}

int fsdp_cpu_half_attention_forward(fsdp_dtype dt, void *out, float *stats, const void *qkv,
                                    int B, int T, int C, int NH) {
  if (dt == FSDP_DTYPE_BF16 && fsdp_cpu_bf16_attention_native(B, T, C, NH)) {
    int rc = fsdp_cpu_bf16_attention_forward(out, stats, qkv, B, T, C, NH);
    if (rc != FSDP_CPU_OTHER_WAY) return rc;
  }
  att_job j = {.dt = dt, .out = out, .keep = stats, .qkv = qkv, .B = B, .T = T, .C = C,
               .NH = NH};
  int rc;
  if (att_rows(&j, false, &rc)) return rc;
  fsdp_cpu_work w = {0};
  int64_t nq = (int64_t)T * 3 * C, no = (int64_t)T * C;
  float *fq = tmp(&w, nq), *fo = tmp(&w, no),
        *sc = tmp(&w, fsdp_cpu_attention_scratch(1, T, C, NH, fsdp_cpu_threads(), false));
  for (int b = 0; !w.failed && b < B; b++) {
    get(fq, qkv, dt, b * nq, nq);
    fsdp_cpu_attention_forward(fo, row_stats(stats, &j, b), sc, fq, 1, T, C, NH);
    put(out, dt, b * no, fo, no);
  }
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_attention_backward(fsdp_dtype dt, void *dqkv, const void *dout,
                                     const void *qkv, const float *stats, int B, int T, int C,
                                     int NH, bool set_dqkv) {
  if (dt == FSDP_DTYPE_BF16 && fsdp_cpu_bf16_attention_native(B, T, C, NH)) {
    int rc = fsdp_cpu_bf16_attention_backward(dqkv, dout, qkv, stats, B, T, C, NH, set_dqkv);
    if (rc != FSDP_CPU_OTHER_WAY) return rc;
  }
  /* the stats of a native forward (dout misaligned here) are not the widened scores' */
  if (att_native_forward(dt, qkv, B, T, C, NH)) stats = NULL;
  att_job j = {.dt = dt, .dqkv = dqkv, .qkv = qkv, .dout = dout, .saved = stats, .B = B,
               .T = T, .C = C, .NH = NH, .set = set_dqkv};
  int rc;
  if (att_rows(&j, true, &rc)) return rc;
  fsdp_cpu_work w = {0};
  int64_t nq = (int64_t)T * 3 * C, no = (int64_t)T * C;
  float *fq = tmp(&w, nq), *fg = tmp(&w, no), *fd = tmp(&w, nq),
        *sc = tmp(&w, fsdp_cpu_attention_scratch(1, T, C, NH, fsdp_cpu_threads(), true));
  for (int b = 0; !w.failed && b < B; b++) {
    get(fq, qkv, dt, b * nq, nq);
    get(fg, dout, dt, b * no, no);
    if (!set_dqkv) get(fd, dqkv, dt, b * nq, nq);
    fsdp_cpu_attention_backward(fd, sc, fg, fq, row_stats(stats, &j, b), 1, T, C, NH, set_dqkv);
    put(dqkv, dt, b * nq, fd, nq);
  }
  return fsdp_cpu_work_done(&w);
}

/* ---- losses, reductions -------------------------------------------------------------------------- */

int fsdp_cpu_half_mse_forward(fsdp_dtype dt, float *out, const void *a, const void *b,
                              int64_t n) {
  fsdp_cpu_work w = {0};
  float *fa = tmp(&w, min64(n, CHUNK)), *fb = tmp(&w, min64(n, CHUNK));
  double total = 0;
  for (int64_t off = 0; !w.failed && off < n; off += CHUNK) {
    int64_t len = min64(CHUNK, n - off);
    get(fa, a, dt, off, len);
    get(fb, b, dt, off, len);
    total += (double)fsdp_cpu_mse_forward(fa, fb, len) * (double)len;
  }
  out[0] = n ? (float)(total / (double)n) : 0.0f;
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_mse_backward(fsdp_dtype dt, void *da, void *db, float dloss, const void *a,
                               const void *b, int64_t n) {
  fsdp_cpu_work w = {0};
  int64_t c = min64(n, CHUNK);
  float *fa = tmp(&w, c), *fb = tmp(&w, c), *fda = opt(&w, da, c);
  float *fdb = db == da ? fda : opt(&w, db, c);
  for (int64_t off = 0; !w.failed && off < n; off += CHUNK) {
    int64_t len = min64(CHUNK, n - off);
    get(fa, a, dt, off, len);
    get(fb, b, dt, off, len);
    get(fda, da, dt, off, len);
    if (db != da) get(fdb, db, dt, off, len);
    /* the kernel scales by 2 / its own length: give it this chunk's share of dloss */
    fsdp_cpu_mse_backward(fda, fdb, dloss * (float)len / (float)n, fa, fb, len);
    put(da, dt, off, fda, len);
    if (db != da) put(db, dt, off, fdb, len);
  }
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_sum(fsdp_dtype dt, double *out, const void *in, int64_t n, bool squares) {
  fsdp_cpu_work w = {0};
  float *f = tmp(&w, min64(n, CHUNK));
  double s = 0;
  for (int64_t off = 0; !w.failed && off < n; off += CHUNK) {
    int64_t len = min64(CHUNK, n - off);
    get(f, in, dt, off, len);
    s += squares ? fsdp_cpu_sumsq(f, len) : fsdp_cpu_sum(f, len);
  }
  *out = s;
  return fsdp_cpu_work_done(&w);
}
