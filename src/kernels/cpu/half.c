/*
 * half.c — the bf16 / f16 conversion pass of the cpu table, chunk by chunk.
 *
 * Debian's OpenBLAS has no bf16 GEMM, so half-precision kernels widen their inputs to f32, run
 * the f32 kernel and round the outputs back (gradients that accumulate are widened first, so +=
 * keeps its meaning). Doing that over whole tensors would allocate f32 copies of every
 * activation a kernel touches: the mixed-precision step's peak memory would carry several full
 * f32 activations on top of the bf16 ones it saves. So the pass works on chunks of rows (at most
 * CHUNK elements per buffer): the scratch stays a few hundred KiB, in cache, and a tensor's
 * conversion and its math run back to back. Small operands (a weight, a bias, a broadcast
 * operand) are widened once per call; their gradients accumulate in f32 across chunks and are
 * rounded once at the end.
 *
 * Scratch is allocated through core (role activations), so the memory report includes it.
 * Results are deterministic; they can differ in the last f32 bits from one whole-tensor call
 * (a weight gradient sums its chunks' products in chunk order), which is below bf16's precision.
 */
#include <math.h>
#include <string.h>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/half.h"

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

/* ---- elementwise ------------------------------------------------------------------------------- */

int fsdp_cpu_half_axpy(fsdp_dtype dt, void *y, const void *x, float alpha, int64_t n) {
  fsdp_cpu_work w = {0};
  float *fx = tmp(&w, min64(n, CHUNK)), *fy = tmp(&w, min64(n, CHUNK));
  for (int64_t off = 0; !w.failed && off < n; off += CHUNK) {
    int64_t len = min64(CHUNK, n - off);
    get(fx, x, dt, off, len);
    get(fy, y, dt, off, len);
    for (int64_t i = 0; i < len; i++) fy[i] += alpha * fx[i];
    put(y, dt, off, fy, len);
  }
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_affine_forward(fsdp_dtype dt, void *out, const void *a, float s, float t,
                                 int64_t n) {
  fsdp_cpu_work w = {0};
  float *fa = tmp(&w, min64(n, CHUNK)), *fo = tmp(&w, min64(n, CHUNK));
  for (int64_t off = 0; !w.failed && off < n; off += CHUNK) {
    int64_t len = min64(CHUNK, n - off);
    get(fa, a, dt, off, len);
    fsdp_cpu_affine_forward(fo, fa, s, t, len);
    put(out, dt, off, fo, len);
  }
  return fsdp_cpu_work_done(&w);
}

/* out = op(a, b) with b repeating every m elements of a's n */
int fsdp_cpu_half_binary_forward(fsdp_dtype dt, void *out, const void *a, const void *b,
                                 int64_t n, int64_t m, fsdp_binop op) {
  fsdp_cpu_work w = {0};
  if (m == n) { /* same shapes: both in lockstep */
    float *fa = tmp(&w, min64(n, CHUNK)), *fb = tmp(&w, min64(n, CHUNK)),
          *fo = tmp(&w, min64(n, CHUNK));
    for (int64_t off = 0; !w.failed && off < n; off += CHUNK) {
      int64_t len = min64(CHUNK, n - off);
      get(fa, a, dt, off, len);
      get(fb, b, dt, off, len);
      fsdp_cpu_binary_forward(fo, fa, fb, len, len, op);
      put(out, dt, off, fo, len);
    }
    return fsdp_cpu_work_done(&w);
  }
  /* broadcast: b whole, a in chunks of whole repeats */
  int64_t step = m * chunk_rows(m);
  float *fb = whole(&w, b, dt, m), *fa = tmp(&w, min64(n, step)), *fo = tmp(&w, min64(n, step));
  for (int64_t off = 0; !w.failed && off < n; off += step) {
    int64_t len = min64(step, n - off);
    get(fa, a, dt, off, len);
    fsdp_cpu_binary_forward(fo, fa, fb, len, m, op);
    put(out, dt, off, fo, len);
  }
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_binary_backward(fsdp_dtype dt, void *da, void *db, const void *dout,
                                  const void *a, const void *b, int64_t n, int64_t m,
                                  fsdp_binop op) {
  fsdp_cpu_work w = {0};
  if (m == n) { /* lockstep; da and db may be one buffer (x * x) */
    int64_t c = min64(n, CHUNK);
    float *fg = tmp(&w, c), *fa = tmp(&w, c), *fb = tmp(&w, c), *fda = opt(&w, da, c);
    float *fdb = db == da ? fda : opt(&w, db, c);
    for (int64_t off = 0; !w.failed && off < n; off += CHUNK) {
      int64_t len = min64(CHUNK, n - off);
      get(fg, dout, dt, off, len);
      get(fa, a, dt, off, len);
      get(fb, b, dt, off, len);
      get(fda, da, dt, off, len);
      if (db != da) get(fdb, db, dt, off, len);
      fsdp_cpu_binary_backward(fda, fdb, fg, fa, fb, len, len, op);
      put(da, dt, off, fda, len);
      if (db != da) put(db, dt, off, fdb, len);
    }
    return fsdp_cpu_work_done(&w);
  }
  /* broadcast: b and its gradient whole (f32 across chunks), a and its gradient in chunks */
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

int fsdp_cpu_half_unary_forward(fsdp_dtype dt, fsdp_unary_op op, void *out, const void *in,
                                int64_t n, void (*f32)(fsdp_unary_op, float *, const float *, int64_t)) {
  fsdp_cpu_work w = {0};
  float *fi = tmp(&w, min64(n, CHUNK)), *fo = tmp(&w, min64(n, CHUNK));
  for (int64_t off = 0; !w.failed && off < n; off += CHUNK) {
    int64_t len = min64(CHUNK, n - off);
    get(fi, in, dt, off, len);
    f32(op, fo, fi, len);
    put(out, dt, off, fo, len);
  }
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_unary_backward(fsdp_dtype dt, fsdp_unary_op op, void *din, const void *dout,
                                 const void *in, const void *out, int64_t n,
                                 void (*f32)(fsdp_unary_op, float *, const float *,
                                             const float *, const float *, int64_t)) {
  fsdp_cpu_work w = {0};
  int64_t c = min64(n, CHUNK);
  float *fg = tmp(&w, c), *fi = opt(&w, in, c), *fo = opt(&w, out, c), *fd = tmp(&w, c);
  for (int64_t off = 0; !w.failed && off < n; off += CHUNK) {
    int64_t len = min64(CHUNK, n - off);
    get(fg, dout, dt, off, len);
    get(fi, in, dt, off, len);
    get(fo, out, dt, off, len);
    get(fd, din, dt, off, len);
    f32(op, fd, fg, fi, fo, len);
    put(din, dt, off, fd, len);
  }
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_dropout_forward(fsdp_dtype dt, void *out, void *mask, const void *in,
                                  int64_t n, float p, uint64_t key, uint64_t first) {
  fsdp_cpu_work w = {0};
  int64_t c = min64(n, CHUNK);
  float *fi = tmp(&w, c), *fo = tmp(&w, c), *fm = tmp(&w, c);
  for (int64_t off = 0; !w.failed && off < n; off += CHUNK) {
    int64_t len = min64(CHUNK, n - off);
    get(fi, in, dt, off, len);
    /* element off + i draws u from the stream at first + off + i: the same mask as one call */
    fsdp_cpu_dropout_forward(fo, fm, fi, len, p, key, first + (uint64_t)off);
    put(out, dt, off, fo, len);
    put(mask, dt, off, fm, len);
  }
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_dropout_backward(fsdp_dtype dt, void *din, const void *dout, const void *mask,
                                   int64_t n) {
  fsdp_cpu_work w = {0};
  int64_t c = min64(n, CHUNK);
  float *fg = tmp(&w, c), *fm = tmp(&w, c), *fd = tmp(&w, c);
  for (int64_t off = 0; !w.failed && off < n; off += CHUNK) {
    int64_t len = min64(CHUNK, n - off);
    get(fg, dout, dt, off, len);
    get(fm, mask, dt, off, len);
    get(fd, din, dt, off, len);
    fsdp_cpu_dropout_backward(fd, fg, fm, len);
    put(din, dt, off, fd, len);
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

/* A weight gradient (n elements of gdt) to accumulate into in f32: the buffer itself when it is
 * f32 (mixed precision), else a widened copy put back by put_grad. */
static float *grad_acc(fsdp_cpu_work *w, void *g, fsdp_dtype gdt, fsdp_dtype dt, int64_t n) {
  return gdt == FSDP_DTYPE_F32 ? g : whole(w, g, dt, n);
}

static void put_grad(void *g, fsdp_dtype gdt, fsdp_dtype dt, const float *f, int64_t n) {
  if (gdt != FSDP_DTYPE_F32) put(g, dt, 0, f, n);
}

/* dbias (N, of gdt) += the column sums of dout (M, N), widened chunk by chunk */
static int half_bias_grad(fsdp_dtype dt, fsdp_dtype gdt, void *dbias, const void *dout, int M,
                          int N) {
  fsdp_cpu_work w = {0};
  int64_t rows = chunk_rows(N);
  float *fdb = grad_acc(&w, dbias, gdt, dt, N), *fg = tmp(&w, min64(M, rows) * N);
  for (int64_t r = 0; !w.failed && r < M; r += rows) {
    int64_t len = min64(rows, M - r);
    get(fg, dout, dt, r * N, len * N);
    fsdp_cpu_colsum_acc(fdb, fg, len, N);
  }
  if (!w.failed) put_grad(dbias, gdt, dt, fdb, N);
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

int fsdp_cpu_half_layernorm_forward(fsdp_dtype dt, void *out, float *mean, float *rstd,
                                    const void *inp, const void *weight, const void *bias,
                                    int64_t N, int C, float eps) {
  fsdp_cpu_work w = {0};
  int64_t rows = chunk_rows(C), c = min64(N, rows);
  float *fw = whole(&w, weight, dt, C), *fb = whole(&w, bias, dt, C);
  float *fi = tmp(&w, c * C), *fo = tmp(&w, c * C);
  for (int64_t r = 0; !w.failed && r < N; r += rows) {
    int64_t len = min64(rows, N - r);
    get(fi, inp, dt, r * C, len * C);
    fsdp_cpu_layernorm_forward(fo, mean + r, rstd + r, fi, fw, fb, len, C, eps);
    put(out, dt, r * C, fo, len * C);
  }
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_layernorm_backward(fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dweight,
                                     void *dbias, const void *dout, const void *inp,
                                     const void *weight, const float *mean, const float *rstd,
                                     int64_t N, int C) {
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

int fsdp_cpu_half_softmax_forward(fsdp_dtype dt, void *out, const void *inp, int64_t N, int C) {
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

int fsdp_cpu_half_cross_entropy_backward(fsdp_dtype dt, void *dlogits, float dloss,
                                         const void *logits, const float *lse,
                                         const int64_t *targets, int64_t N, int V,
                                         int64_t ignore, int64_t count) {
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

/* ---- attention: one batch element at a time ---------------------------------------------------- */

int fsdp_cpu_half_attention_forward(fsdp_dtype dt, void *out, void *att, const void *qkv, int B,
                                    int T, int C, int NH) {
  fsdp_cpu_work w = {0};
  int64_t nq = (int64_t)T * 3 * C, no = (int64_t)T * C, na = (int64_t)NH * T * T;
  float *fq = tmp(&w, nq), *fo = tmp(&w, no), *fa = tmp(&w, na);
  for (int b = 0; !w.failed && b < B; b++) {
    get(fq, qkv, dt, b * nq, nq);
    fsdp_cpu_attention_forward(fo, fa, fq, 1, T, C, NH);
    put(out, dt, b * no, fo, no);
    put(att, dt, b * na, fa, na);
  }
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_half_attention_backward(fsdp_dtype dt, void *dqkv, const void *dout,
                                     const void *qkv, const void *att, int B, int T, int C,
                                     int NH) {
  fsdp_cpu_work w = {0};
  int64_t nq = (int64_t)T * 3 * C, no = (int64_t)T * C, na = (int64_t)NH * T * T;
  float *fq = tmp(&w, nq), *fg = tmp(&w, no), *fa = tmp(&w, na), *fd = tmp(&w, nq),
        *scratch = tmp(&w, na);
  for (int b = 0; !w.failed && b < B; b++) {
    get(fq, qkv, dt, b * nq, nq);
    get(fg, dout, dt, b * no, no);
    get(fa, att, dt, b * na, na);
    get(fd, dqkv, dt, b * nq, nq);
    fsdp_cpu_attention_backward(fd, scratch, fg, fq, fa, 1, T, C, NH);
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
