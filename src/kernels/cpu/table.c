/*
 * table.c — the cpu's kernel table (kernels/kernels.h): each slot switches on the dtype at its
 * entry and calls the f32 kernels of this folder.
 *
 * bf16 and f16 run as a conversion pass: inputs are widened into f32 scratch, the f32 kernel
 * runs, outputs are rounded back (gradients that accumulate are widened first, so += keeps its
 * meaning). Scratch is allocated per call through core (role activations), so the memory report
 * shows what the pass costs. Debian's OpenBLAS has no bf16 GEMM; a native bf16 path replaces a
 * slot's conversion without changing its callers.
 *
 * f64 and the integer dtypes get the slots that make sense for them (data movement, arithmetic,
 * comparisons, reductions, sorting) as plain loops through double or int64; the others refuse
 * them by name.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/half.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

#define REFUSE(op, dt) fsdp_kernels_refuse(op, dt, "cpu")

static bool is_half(fsdp_dtype dt) { return dt == FSDP_DTYPE_BF16 || dt == FSDP_DTYPE_F16; }
static bool is_int(fsdp_dtype dt) {
  return dt == FSDP_DTYPE_I64 || dt == FSDP_DTYPE_I32 || dt == FSDP_DTYPE_U8;
}

/* ---- the conversion pass: f32 scratch for one kernel call (fsdp_cpu_work, half.h) ---------- */

static float *tmp_f32(fsdp_cpu_work *t, int64_t n) { return fsdp_cpu_work_buf(t, n, sizeof(float)); }

/* An f32 copy of in (n elements of dt); NULL stays NULL (and on allocation failure: t->failed). */
static const float *widen(fsdp_cpu_work *t, const void *in, fsdp_dtype dt, int64_t n) {
  if (!in || dt == FSDP_DTYPE_F32) return in;
  float *w = tmp_f32(t, n);
  if (w) fsdp_cpu_cast(w, FSDP_DTYPE_F32, in, dt, n);
  return w;
}

/* f32 scratch for an output: uninitialised (acc false) or holding out's values (acc true, for
 * gradients that accumulate). NULL stays NULL. */
static float *out_f32(fsdp_cpu_work *t, void *out, fsdp_dtype dt, int64_t n, bool acc) {
  if (!out || dt == FSDP_DTYPE_F32) return out;
  float *w = tmp_f32(t, n);
  if (w && acc) fsdp_cpu_cast(w, FSDP_DTYPE_F32, out, dt, n);
  return w;
}

/* out (dt) <- w (f32) when w is a scratch copy */
static void narrow(void *out, fsdp_dtype dt, const float *w, int64_t n) {
  if (out && dt != FSDP_DTYPE_F32) fsdp_cpu_cast(out, dt, w, FSDP_DTYPE_F32, n);
}

/* ---- conversions and data movement ---------------------------------------------------------- */

static int k_cast(void *ctx, void *out, fsdp_dtype odt, const void *in, fsdp_dtype idt,
                  int64_t n) {
  fsdp_cpu_cast(out, odt, in, idt, n);
  return FSDP_OK;
}

static int k_copy_strided(void *ctx, fsdp_dtype dt, void *dst, const int64_t *ds,
                          const void *src, const int64_t *ss, int ndim, const int64_t *shape) {
  fsdp_host_copy_strided(dst, ds, src, ss, fsdp_dtype_size(dt), ndim, shape);
  return FSDP_OK;
}

/* Element access through double, for the dtypes without a loop of their own. */
#define LD(p, dt, i) fsdp_dtype_load(p, dt, i)
#define ST(p, dt, i, v) fsdp_dtype_store(p, dt, i, v)

static int k_add_strided(void *ctx, fsdp_dtype dt, void *dst, const int64_t *ds,
                         const void *src, const int64_t *ss, int nd, const int64_t *shape) {
  if (dt == FSDP_DTYPE_BOOL) return REFUSE("add", dt);
  int64_t n = 1;
  for (int k = 0; k < nd; k++) n *= shape[k];
  if (n == 0) return FSDP_OK;
  int last = nd - 1;
  int64_t L = nd ? shape[last] : 1, dsl = nd ? ds[last] : 0, ssl = nd ? ss[last] : 0;
  int64_t idx[FSDP_MAX_DIMS] = {0};
  for (int64_t r = 0; r < n / L; r++) {
    int64_t od = 0, os = 0;
    for (int k = 0; k < last; k++) {
      od += idx[k] * ds[k];
      os += idx[k] * ss[k];
    }
    if (dt == FSDP_DTYPE_F32) {
      float *d = (float *)dst + od;
      const float *s = (const float *)src + os;
      for (int64_t j = 0; j < L; j++) d[j * dsl] += s[j * ssl];
    } else {
      for (int64_t j = 0; j < L; j++)
        ST(dst, dt, od + j * dsl, LD(dst, dt, od + j * dsl) + LD(src, dt, os + j * ssl));
    }
    for (int k = last - 1; k >= 0; k--) {
      if (++idx[k] < shape[k]) break;
      idx[k] = 0;
    }
  }
  return FSDP_OK;
}

/* y += a x and y *= a over f32, split over the rank's threads: gradient accumulation, the
 * gradient shards' adds and scaling run over whole parameter sets, and on the calling thread
 * alone the other core idled through them. Each element on its own: the same bits at any split. */
typedef struct {
  float *y;
  const float *x;
  float a;
} axpy_ctx;

static void axpy_task(void *ctx, int64_t lo, int64_t hi) {
  const axpy_ctx *c = ctx;
  float *restrict yy = c->y;
  const float *restrict xx = c->x;
  const float a = c->a;
  if (!xx)
    for (int64_t i = lo; i < hi; i++) yy[i] *= a;
  else if (a == 1.0f)
    for (int64_t i = lo; i < hi; i++) yy[i] += xx[i];
  else
    for (int64_t i = lo; i < hi; i++) yy[i] += a * xx[i];
}

static int k_axpy(void *ctx, fsdp_dtype dt, void *y, const void *x, double alpha, int64_t n) {
  if (dt == FSDP_DTYPE_F32) {
    axpy_ctx c = {.y = y, .x = x, .a = (float)alpha};
    fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, axpy_task, &c);
    return FSDP_OK;
  }
  if (dt == FSDP_DTYPE_BOOL) return REFUSE("add", dt);
  if (is_half(dt)) return fsdp_cpu_half_axpy(dt, y, x, (float)alpha, n);
  for (int64_t i = 0; i < n; i++) ST(y, dt, i, LD(y, dt, i) + alpha * LD(x, dt, i));
  return FSDP_OK;
}

static int k_scale(void *ctx, fsdp_dtype dt, void *y, double s, int64_t n) {
  if (dt == FSDP_DTYPE_F32) {
    axpy_ctx c = {.y = y, .x = NULL, .a = (float)s};
    fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN, axpy_task, &c);
    return FSDP_OK;
  }
  if (dt == FSDP_DTYPE_BOOL) return REFUSE("mul", dt);
  for (int64_t i = 0; i < n; i++) ST(y, dt, i, LD(y, dt, i) * s);
  return FSDP_OK;
}

static int k_arange(void *ctx, fsdp_dtype dt, void *out, double start, double step, int64_t n) {
  for (int64_t i = 0; i < n; i++) ST(out, dt, i, start + (double)i * step);
  return FSDP_OK;
}

static int k_random(void *ctx, fsdp_dtype dt, void *out, int64_t n, uint64_t key,
                    uint64_t first, bool normal, double a, double b) {
  if (!fsdp_dtype_is_float(dt)) return REFUSE(normal ? "randn" : "rand", dt);
  fsdp_cpu_work t = {0};
  float *w = dt == FSDP_DTYPE_F32 ? out : tmp_f32(&t, n); /* the stream is f32 everywhere */
  if (!w) return fsdp_cpu_work_done(&t);
  if (normal) {
    fsdp_rng_normal(w, n, key, first, (float)a, (float)b);
  } else {
    fsdp_rng_uniform(w, n, key, first);
    if (a != 0.0 || b != 1.0)
      for (int64_t i = 0; i < n; i++) w[i] = (float)a + (float)(b - a) * w[i];
  }
  if (w != out) fsdp_cpu_cast(out, dt, w, FSDP_DTYPE_F32, n);
  return fsdp_cpu_work_done(&t);
}

/* ---- linear algebra --------------------------------------------------------------------------- */

/* The calling thread's products through the slots below (fsdp_cpu_gemm_stats). Each slot runs
 * on the thread that called it and returns when its product is done (the pool's threads work
 * inside the call), so the wall time from entry to return is what the caller waited. */
static _Thread_local struct {
  int64_t calls;
  double flops, seconds;
} tally;

static double tally_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A slot's call that started at t0 and ran `products` (M, N, K) matrix products; rc, its
 * result, passed through. A refused or failed call did not run them and is not counted. */
static int tally_add(int rc, double t0, double products, int M, int N, int K) {
  if (rc != FSDP_OK) return rc;
  tally.calls++;
  tally.flops += products * 2.0 * (double)M * (double)N * (double)K;
  tally.seconds += tally_now() - t0;
  return rc;
}

void fsdp_cpu_gemm_stats(int64_t *calls, double *flops, double *seconds) {
  *calls = tally.calls;
  *flops = tally.flops;
  *seconds = tally.seconds;
}

static int gemm_run(fsdp_dtype dt, void *c, const void *a, const void *b, int M, int N, int K,
                    bool ta, bool tb, float alpha, float beta, int lda, int ldb, int ldc) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_gemm(c, a, b, M, N, K, ta, tb, alpha, beta, lda, ldb, ldc);
    return FSDP_OK;
  }
  if (!is_half(dt)) return REFUSE("matmul", dt);
  if (fsdp_cpu_half_native(dt, M, N, K))
    return fsdp_cpu_bf16_gemm(c, dt, a, b, NULL, dt, M, N, K, ta, tb, alpha, beta, lda, ldb, ldc);
  /* stored extents of a, b, c with their leading dimensions */
  int64_t na = (int64_t)(ta ? K : M) * lda, nb = (int64_t)(tb ? N : K) * ldb,
          nc = (int64_t)M * ldc;
  fsdp_cpu_work t = {0};
  const float *wa = widen(&t, a, dt, na), *wb = widen(&t, b, dt, nb);
  /* c's padding columns (ldc > N) go back as they were: widen them too */
  float *wc = out_f32(&t, c, dt, nc, beta != 0.0f || ldc != N);
  if (!t.failed) {
    fsdp_cpu_gemm(wc, wa, wb, M, N, K, ta, tb, alpha, beta, lda, ldb, ldc);
    narrow(c, dt, wc, nc);
  }
  return fsdp_cpu_work_done(&t);
}

static int k_gemm(void *ctx, fsdp_dtype dt, void *c, const void *a, const void *b, int M, int N,
                  int K, bool ta, bool tb, float alpha, float beta, int lda, int ldb, int ldc) {
  const double t0 = tally_now();
  return tally_add(gemm_run(dt, c, a, b, M, N, K, ta, tb, alpha, beta, lda, ldb, ldc), t0, 1, M,
                   N, K);
}

static int bmm_forward_run(fsdp_dtype dt, void *out, const void *a, const void *b, int B, int M,
                           int K, int N) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_bmm_forward(out, a, b, B, M, K, N);
    return FSDP_OK;
  }
  if (!is_half(dt)) return REFUSE("matmul", dt);
  if (fsdp_cpu_half_native(dt, M, N, K)) return fsdp_cpu_half_bmm_forward(dt, out, a, b, B, M, K, N);
  fsdp_cpu_work t = {0};
  int64_t no = (int64_t)B * M * N;
  const float *wa = widen(&t, a, dt, (int64_t)B * M * K);
  const float *wb = widen(&t, b, dt, (int64_t)B * K * N);
  float *wo = out_f32(&t, out, dt, no, false);
  if (!t.failed) {
    fsdp_cpu_bmm_forward(wo, wa, wb, B, M, K, N);
    narrow(out, dt, wo, no);
  }
  return fsdp_cpu_work_done(&t);
}

static int k_bmm_forward(void *ctx, fsdp_dtype dt, void *out, const void *a, const void *b,
                         int B, int M, int K, int N) {
  const double t0 = tally_now();
  return tally_add(bmm_forward_run(dt, out, a, b, B, M, K, N), t0, B, M, N, K);
}

static int bmm_backward_run(fsdp_dtype dt, void *da, void *db, const void *dout, const void *a,
                            const void *b, int B, int M, int K, int N) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_bmm_backward(da, db, dout, a, b, B, M, K, N);
    return FSDP_OK;
  }
  if (!is_half(dt)) return REFUSE("matmul", dt);
  if (fsdp_cpu_half_native(dt, M, N, K))
    return fsdp_cpu_half_bmm_backward(dt, da, db, dout, a, b, B, M, K, N);
  fsdp_cpu_work t = {0};
  int64_t nA = (int64_t)B * M * K, nB = (int64_t)B * K * N;
  const float *wg = widen(&t, dout, dt, (int64_t)B * M * N);
  const float *wa = widen(&t, a, dt, nA), *wb = widen(&t, b, dt, nB);
  float *wda = out_f32(&t, da, dt, nA, true);
  float *wdb = da == db ? wda : out_f32(&t, db, dt, nB, true);
  if (!t.failed) {
    fsdp_cpu_bmm_backward(wda, wdb, wg, wa, wb, B, M, K, N);
    narrow(da, dt, wda, nA);
    if (db != da) narrow(db, dt, wdb, nB);
  }
  return fsdp_cpu_work_done(&t);
}

static int k_bmm_backward(void *ctx, fsdp_dtype dt, void *da, void *db, const void *dout,
                          const void *a, const void *b, int B, int M, int K, int N) {
  const double t0 = tally_now();
  return tally_add(bmm_backward_run(dt, da, db, dout, a, b, B, M, K, N), t0,
                   (double)B * ((da != NULL) + (db != NULL)), M, N, K);
}

static int linear_forward_run(fsdp_dtype dt, void *out, const void *inp, const void *weight,
                              const void *bias, int M, int K, int N) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_linear_forward(out, inp, weight, bias, M, K, N);
    return FSDP_OK;
  }
  if (!is_half(dt)) return REFUSE("linear", dt);
  return fsdp_cpu_half_linear_forward(dt, out, inp, weight, bias, M, K, N);
}

/* the weight gradients' dtype: dt, or f32 under a half dt */
static bool grad_dtype_ok(fsdp_dtype dt, fsdp_dtype gdt) {
  return gdt == dt || (is_half(dt) && gdt == FSDP_DTYPE_F32);
}

static int k_linear_forward(void *ctx, fsdp_dtype dt, void *out, const void *inp,
                            const void *weight, const void *bias, int M, int K, int N) {
  const double t0 = tally_now();
  return tally_add(linear_forward_run(dt, out, inp, weight, bias, M, K, N), t0, 1, M, N, K);
}

static int linear_backward_run(fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dweight,
                               void *dbias, const void *dout, const void *inp,
                               const void *weight, int M, int K, int N) {
  if (dt != FSDP_DTYPE_F32 && !is_half(dt)) return REFUSE("linear", dt);
  if (!grad_dtype_ok(dt, gdt)) return REFUSE("linear (weight gradient)", gdt);
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_linear_backward(dinp, dweight, dbias, dout, inp, weight, M, K, N);
    return FSDP_OK;
  }
  return fsdp_cpu_half_linear_backward(dt, gdt, dinp, dweight, dbias, dout, inp, weight, M, K,
                                       N);
}

static int k_linear_backward(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dinp,
                             void *dweight, void *dbias, const void *dout, const void *inp,
                             const void *weight, int M, int K, int N) {
  const double t0 = tally_now();
  return tally_add(linear_backward_run(dt, gdt, dinp, dweight, dbias, dout, inp, weight, M, K, N),
                   t0, (dinp != NULL) + (dweight != NULL), M, N, K);
}

/* ---- elementwise ------------------------------------------------------------------------------ */

static int k_binary_forward(void *ctx, fsdp_dtype dt, void *out, const void *a, const void *b,
                            int64_t n, int64_t m, fsdp_binop op) {
  static const char *names[] = {"add", "sub", "mul", "div"};
  if (n <= 0 || m <= 0) return FSDP_OK;
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_binary_forward(out, a, b, n, m, op);
    return FSDP_OK;
  }
  if (is_half(dt)) return fsdp_cpu_half_binary_forward(dt, out, a, b, n, m, op);
  /* integer division would need a float result: divide float tensors instead */
  if (dt == FSDP_DTYPE_BOOL || (is_int(dt) && op == FSDP_BIN_DIV)) return REFUSE(names[op], dt);
  if (dt == FSDP_DTYPE_I64) { /* exact beyond 2^53 */
    int64_t *o = out;
    const int64_t *x = a, *y = b;
    for (int64_t i = 0; i < n; i++) {
      int64_t u = x[i], v = y[i % m];
      o[i] = op == FSDP_BIN_ADD ? (int64_t)((uint64_t)u + (uint64_t)v)
             : op == FSDP_BIN_SUB ? (int64_t)((uint64_t)u - (uint64_t)v)
                                  : (int64_t)((uint64_t)u * (uint64_t)v);
    }
    return FSDP_OK;
  }
  for (int64_t i = 0; i < n; i++) {
    double u = LD(a, dt, i), v = LD(b, dt, i % m);
    double r = op == FSDP_BIN_ADD ? u + v : op == FSDP_BIN_SUB ? u - v
               : op == FSDP_BIN_MUL ? u * v : u / v;
    ST(out, dt, i, r);
  }
  return FSDP_OK;
}

static int k_binary_backward(void *ctx, fsdp_dtype dt, void *da, void *db, const void *dout,
                             const void *a, const void *b, int64_t n, int64_t m, fsdp_binop op) {
  static const char *names[] = {"add", "sub", "mul", "div"};
  if (n <= 0 || m <= 0) return FSDP_OK;
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_binary_backward(da, db, dout, a, b, n, m, op);
    return FSDP_OK;
  }
  if (dt == FSDP_DTYPE_F64) {
    for (int64_t i = 0; i < n; i++) {
      double g = LD(dout, dt, i), u = LD(a, dt, i), v = LD(b, dt, i % m);
      double ga = op == FSDP_BIN_MUL ? g * v : op == FSDP_BIN_DIV ? g / v : g;
      double gb = op == FSDP_BIN_ADD ? g : op == FSDP_BIN_SUB ? -g
                  : op == FSDP_BIN_MUL ? g * u : -g * u / (v * v);
      if (da) ST(da, dt, i, LD(da, dt, i) + ga);
      if (db) ST(db, dt, i % m, LD(db, dt, i % m) + gb);
    }
    return FSDP_OK;
  }
  if (!is_half(dt)) return REFUSE(names[op], dt);
  return fsdp_cpu_half_binary_backward(dt, da, db, dout, a, b, n, m, op);
}

static int k_affine_forward(void *ctx, fsdp_dtype dt, void *out, const void *a, double s,
                            double tt, int64_t n) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_affine_forward(out, a, (float)s, (float)tt, n);
    return FSDP_OK;
  }
  if (is_half(dt)) return fsdp_cpu_half_affine_forward(dt, out, a, (float)s, (float)tt, n);
  if (dt == FSDP_DTYPE_BOOL) return REFUSE("affine", dt);
  for (int64_t i = 0; i < n; i++) ST(out, dt, i, LD(a, dt, i) * s + tt);
  return FSDP_OK;
}

static int k_affine_backward(void *ctx, fsdp_dtype dt, void *da, const void *dout, double s,
                             int64_t n) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_affine_backward(da, dout, (float)s, n);
    return FSDP_OK;
  }
  if (!fsdp_dtype_is_float(dt)) return REFUSE("affine", dt);
  return k_axpy(ctx, dt, da, dout, s, n);
}

/* f32 unary math that has no kernel file of its own */
static void unary_f32(fsdp_unary_op op, float *y, const float *x, int64_t n) {
  switch (op) {
  case FSDP_UNARY_RELU: fsdp_cpu_relu_forward(y, x, n); break;
  case FSDP_UNARY_GELU: fsdp_cpu_gelu_forward(y, x, n); break;
  case FSDP_UNARY_EXP: for (int64_t i = 0; i < n; i++) y[i] = expf(x[i]); break;
  case FSDP_UNARY_LOG: for (int64_t i = 0; i < n; i++) y[i] = logf(x[i]); break;
  case FSDP_UNARY_SQRT: for (int64_t i = 0; i < n; i++) y[i] = sqrtf(x[i]); break;
  case FSDP_UNARY_TANH: for (int64_t i = 0; i < n; i++) y[i] = tanhf(x[i]); break;
  case FSDP_UNARY_SIGMOID:
    for (int64_t i = 0; i < n; i++) y[i] = 1.0f / (1.0f + expf(-x[i]));
    break;
  case FSDP_UNARY_ABS: for (int64_t i = 0; i < n; i++) y[i] = fabsf(x[i]); break;
  case FSDP_UNARY_SIGN:
    for (int64_t i = 0; i < n; i++)
      y[i] = x[i] > 0.0f ? 1.0f : x[i] < 0.0f ? -1.0f : x[i] == x[i] ? 0.0f : x[i];
    break;
  default: break;
  }
}

static void unary_bw_f32(fsdp_unary_op op, float *da, const float *g, const float *x,
                         const float *y, int64_t n) {
  switch (op) {
  case FSDP_UNARY_RELU: fsdp_cpu_relu_backward(da, g, x, n); break;
  case FSDP_UNARY_GELU: fsdp_cpu_gelu_backward(da, g, x, n); break;
  case FSDP_UNARY_EXP: for (int64_t i = 0; i < n; i++) da[i] += g[i] * y[i]; break;
  case FSDP_UNARY_LOG: for (int64_t i = 0; i < n; i++) da[i] += g[i] / x[i]; break;
  case FSDP_UNARY_SQRT: for (int64_t i = 0; i < n; i++) da[i] += g[i] * 0.5f / y[i]; break;
  case FSDP_UNARY_TANH: for (int64_t i = 0; i < n; i++) da[i] += g[i] * (1.0f - y[i] * y[i]); break;
  case FSDP_UNARY_SIGMOID:
    for (int64_t i = 0; i < n; i++) da[i] += g[i] * y[i] * (1.0f - y[i]);
    break;
  case FSDP_UNARY_ABS: /* sign(x); 0 at 0, as PyTorch */
    for (int64_t i = 0; i < n; i++) da[i] += x[i] > 0.0f ? g[i] : x[i] < 0.0f ? -g[i] : 0.0f;
    break;
  case FSDP_UNARY_SIGN: break; /* zero almost everywhere */
  default: break;
  }
}

static double unary_f64(fsdp_unary_op op, double x) {
  switch (op) {
  case FSDP_UNARY_RELU: return x <= 0 ? 0 : x; /* NaN passes */
  case FSDP_UNARY_GELU: return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
  case FSDP_UNARY_EXP: return exp(x);
  case FSDP_UNARY_LOG: return log(x);
  case FSDP_UNARY_SQRT: return sqrt(x);
  case FSDP_UNARY_TANH: return tanh(x);
  case FSDP_UNARY_SIGMOID: return 1.0 / (1.0 + exp(-x));
  case FSDP_UNARY_ABS: return fabs(x);
  case FSDP_UNARY_SIGN: return x > 0 ? 1 : x < 0 ? -1 : x;
  default: return NAN;
  }
}

static int k_unary_forward(void *ctx, fsdp_dtype dt, fsdp_unary_op op, void *out,
                           const void *in, int64_t n) {
  if (dt == FSDP_DTYPE_F32) {
    unary_f32(op, out, in, n);
    return FSDP_OK;
  }
  if (is_half(dt)) return fsdp_cpu_half_unary_forward(dt, op, out, in, n, unary_f32);
  /* integers: the ops whose result is an integer again */
  bool int_ok = op == FSDP_UNARY_RELU || op == FSDP_UNARY_ABS || op == FSDP_UNARY_SIGN;
  if (dt == FSDP_DTYPE_BOOL || (is_int(dt) && !int_ok)) return REFUSE(fsdp_unary_name(op), dt);
  for (int64_t i = 0; i < n; i++) ST(out, dt, i, unary_f64(op, LD(in, dt, i)));
  return FSDP_OK;
}

static int k_unary_backward(void *ctx, fsdp_dtype dt, fsdp_unary_op op, void *din,
                            const void *dout, const void *in, const void *out, int64_t n) {
  if (dt == FSDP_DTYPE_F32) {
    unary_bw_f32(op, din, dout, in, out, n);
    return FSDP_OK;
  }
  if (dt == FSDP_DTYPE_F64) { /* through f32 math would lose what f64 is for: central formulas */
    for (int64_t i = 0; i < n; i++) {
      double g = LD(dout, dt, i), x = in ? LD(in, dt, i) : 0, y = out ? LD(out, dt, i) : 0, d;
      switch (op) {
      case FSDP_UNARY_RELU: d = x > 0 ? g : 0; break;
      case FSDP_UNARY_GELU: {
        const double k = 0.7978845608028654, u = k * (x + 0.044715 * x * x * x), th = tanh(u);
        d = g * (0.5 * (1 + th) + 0.5 * x * (1 - th * th) * k * (1 + 3 * 0.044715 * x * x));
        break;
      }
      case FSDP_UNARY_EXP: d = g * y; break;
      case FSDP_UNARY_LOG: d = g / x; break;
      case FSDP_UNARY_SQRT: d = g * 0.5 / y; break;
      case FSDP_UNARY_TANH: d = g * (1 - y * y); break;
      case FSDP_UNARY_SIGMOID: d = g * y * (1 - y); break;
      case FSDP_UNARY_ABS: d = x > 0 ? g : x < 0 ? -g : 0; break;
      default: d = 0; break;
      }
      ST(din, dt, i, LD(din, dt, i) + d);
    }
    return FSDP_OK;
  }
  if (!is_half(dt)) return REFUSE(fsdp_unary_name(op), dt);
  return fsdp_cpu_half_unary_backward(dt, op, din, dout, in, out, n, unary_bw_f32);
}

static int k_pow_forward(void *ctx, fsdp_dtype dt, void *out, const void *in, double p,
                         int64_t n) {
  if (!fsdp_dtype_is_float(dt)) return REFUSE("pow", dt);
  if (dt == FSDP_DTYPE_F64) {
    for (int64_t i = 0; i < n; i++) ST(out, dt, i, pow(LD(in, dt, i), p));
    return FSDP_OK;
  }
  fsdp_cpu_work t = {0};
  const float *x = widen(&t, in, dt, n);
  float *y = out_f32(&t, out, dt, n, false);
  if (!t.failed) {
    for (int64_t i = 0; i < n; i++) y[i] = powf(x[i], (float)p);
    narrow(out, dt, y, n);
  }
  return fsdp_cpu_work_done(&t);
}

static int k_pow_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout, const void *in,
                          double p, int64_t n) {
  if (!fsdp_dtype_is_float(dt)) return REFUSE("pow", dt);
  if (dt == FSDP_DTYPE_F64) {
    for (int64_t i = 0; i < n; i++)
      ST(din, dt, i, LD(din, dt, i) + LD(dout, dt, i) * p * pow(LD(in, dt, i), p - 1));
    return FSDP_OK;
  }
  fsdp_cpu_work t = {0};
  const float *g = widen(&t, dout, dt, n), *x = widen(&t, in, dt, n);
  float *d = out_f32(&t, din, dt, n, true);
  if (!t.failed) {
    const float pf = (float)p;
    for (int64_t i = 0; i < n; i++) d[i] += g[i] * pf * powf(x[i], pf - 1.0f);
    narrow(din, dt, d, n);
  }
  return fsdp_cpu_work_done(&t);
}

static int k_clamp_forward(void *ctx, fsdp_dtype dt, void *out, const void *in, double lo,
                           double hi, int64_t n) {
  if (dt == FSDP_DTYPE_BOOL) return REFUSE("clamp", dt);
  if (dt == FSDP_DTYPE_F32) {
    float *y = out;
    const float *x = in;
    const float l = (float)lo, h = (float)hi;
    for (int64_t i = 0; i < n; i++) y[i] = x[i] < l ? l : x[i] > h ? h : x[i]; /* NaN stays */
    return FSDP_OK;
  }
  for (int64_t i = 0; i < n; i++) {
    double x = LD(in, dt, i);
    ST(out, dt, i, x < lo ? lo : x > hi ? hi : x);
  }
  return FSDP_OK;
}

static int k_clamp_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                            const void *in, double lo, double hi, int64_t n) {
  if (!fsdp_dtype_is_float(dt)) return REFUSE("clamp", dt);
  for (int64_t i = 0; i < n; i++) {
    double x = LD(in, dt, i);
    if (x >= lo && x <= hi) ST(din, dt, i, LD(din, dt, i) + LD(dout, dt, i));
  }
  return FSDP_OK;
}

/* Comparisons, max/min and sorting read elements as doubles; an i64 beyond 2^53 rounds there,
 * so i64 elements also carry their exact value, which decides between equal doubles (the
 * rounding is monotonic). 0 for the other dtypes. */
static int64_t exact_i64(const void *p, fsdp_dtype dt, int64_t i) {
  return dt == FSDP_DTYPE_I64 ? ((const int64_t *)p)[i] : 0;
}

/* -1, 0, 1: how (u, iu) orders against (v, iv); u and v not NaN */
static int order(double u, int64_t iu, double v, int64_t iv) {
  if (u != v) return u < v ? -1 : 1;
  return iu < iv ? -1 : iu > iv;
}

static int k_compare(void *ctx, fsdp_dtype dt, fsdp_cmpop op, void *out, const void *a,
                     const void *b, int64_t n, int64_t m) {
  uint8_t *o = out;
  if (m <= 0) return FSDP_OK;
  for (int64_t i = 0; i < n; i++) {
    double u = LD(a, dt, i), v = LD(b, dt, i % m);
    if (u != u || v != v) { /* NaN: only ne holds */
      o[i] = op == FSDP_CMP_NE;
      continue;
    }
    int c = order(u, exact_i64(a, dt, i), v, exact_i64(b, dt, i % m));
    switch (op) {
    case FSDP_CMP_GT: o[i] = c > 0; break;
    case FSDP_CMP_GE: o[i] = c >= 0; break;
    case FSDP_CMP_LT: o[i] = c < 0; break;
    case FSDP_CMP_LE: o[i] = c <= 0; break;
    case FSDP_CMP_EQ: o[i] = c == 0; break;
    default: o[i] = c != 0; break;
    }
  }
  return FSDP_OK;
}

static int k_where(void *ctx, fsdp_dtype dt, void *out, const void *cond, const void *a,
                   const void *b, int64_t n) {
  const uint8_t *c = cond;
  const size_t es = fsdp_dtype_size(dt);
  char *o = out;
  const char *x = a, *y = b;
  for (int64_t i = 0; i < n; i++) memcpy(o + i * (int64_t)es, (c[i] ? x : y) + i * (int64_t)es, es);
  return FSDP_OK;
}

static int k_dropout_forward(void *ctx, fsdp_dtype dt, void *out, void *mask, const void *in,
                             int64_t n, float p, uint64_t key, uint64_t first) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_dropout_forward(out, mask, in, n, p, key, first);
    return FSDP_OK;
  }
  if (!is_half(dt)) return REFUSE("dropout", dt);
  return fsdp_cpu_half_dropout_forward(dt, out, mask, in, n, p, key, first);
}

static int k_dropout_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                              const void *mask, int64_t n) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_dropout_backward(din, dout, mask, n);
    return FSDP_OK;
  }
  if (!is_half(dt)) return REFUSE("dropout", dt);
  return fsdp_cpu_half_dropout_backward(dt, din, dout, mask, n);
}

/* ---- indices ----------------------------------------------------------------------------------- */

static int k_check_index(void *ctx, fsdp_dtype idt, const void *ids, int64_t n, int64_t lo,
                         int64_t hi, const int64_t *ignore, int64_t *bad, double *bad_value) {
  *bad = -1;
  if (idt == FSDP_DTYPE_I64 || idt == FSDP_DTYPE_I32) {
    for (int64_t i = 0; i < n; i++) {
      int64_t v = idt == FSDP_DTYPE_I64 ? ((const int64_t *)ids)[i] : ((const int32_t *)ids)[i];
      if ((ignore && v == *ignore) || (v >= lo && v < hi)) continue;
      *bad = i, *bad_value = (double)v;
      return FSDP_OK;
    }
    return FSDP_OK;
  }
  if (!fsdp_dtype_is_float(idt) && idt != FSDP_DTYPE_U8) return REFUSE("index", idt);
  /* floats holding integers: compared as doubles (casting NaN or a huge value to an integer
   * type would be undefined) */
  for (int64_t i = 0; i < n; i++) {
    double x = LD(ids, idt, i);
    if (ignore && x == (double)*ignore) continue;
    if (!(x >= (double)lo && x < (double)hi) || x != floor(x)) {
      *bad = i, *bad_value = x;
      return FSDP_OK;
    }
  }
  return FSDP_OK;
}

/* An index buffer (ids, targets: integers in range, checked by the callers) as the i64 the
 * kernels take: ids itself when it is i64 (the data loaders' dtype), else a converted copy
 * (exact: the values are integers). NULL on allocation failure. */
static const int64_t *ids_i64(fsdp_cpu_work *t, const void *ids, fsdp_dtype idt, int64_t n) {
  if (idt == FSDP_DTYPE_I64) return ids;
  int64_t *w = fsdp_cpu_work_buf(t, n, sizeof(int64_t));
  if (w) fsdp_cpu_cast(w, FSDP_DTYPE_I64, ids, idt, n);
  return w;
}

static int k_embedding_forward(void *ctx, fsdp_dtype dt, void *out, const void *ids,
                               fsdp_dtype idt, const void *weight, int64_t N, int C) {
  if (!fsdp_dtype_is_float(dt) && !is_int(dt)) return REFUSE("embedding", dt);
  fsdp_cpu_work t = {0};
  const int64_t *id = ids_i64(&t, ids, idt, N);
  if (!id) return fsdp_cpu_work_done(&t);
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_embedding_forward(out, id, weight, N, C);
  } else { /* rows are copied, whatever the dtype */
    const size_t row = (size_t)C * fsdp_dtype_size(dt);
    for (int64_t i = 0; i < N; i++)
      memcpy((char *)out + (size_t)i * row, (const char *)weight + (size_t)id[i] * row, row);
  }
  return fsdp_cpu_work_done(&t);
}

static int k_embedding_backward(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dweight,
                                const void *dout, const void *ids, fsdp_dtype idt, int64_t N,
                                int C) {
  if (dt != FSDP_DTYPE_F32 && !is_half(dt)) return REFUSE("embedding", dt);
  if (!grad_dtype_ok(dt, gdt)) return REFUSE("embedding (weight gradient)", gdt);
  fsdp_cpu_work t = {0};
  const int64_t *id = ids_i64(&t, ids, idt, N);
  if (!id) return fsdp_cpu_work_done(&t);
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_embedding_backward(dweight, dout, id, N, C);
    return fsdp_cpu_work_done(&t);
  }
  /* half: one row at a time; an f32 gradient (mixed precision) takes each row without rounding */
  float *acc = tmp_f32(&t, 2 * (int64_t)C);
  if (!acc) return fsdp_cpu_work_done(&t);
  const size_t hs = fsdp_dtype_size(dt);
  for (int64_t i = 0; i < N; i++) {
    fsdp_cpu_cast(acc + C, FSDP_DTYPE_F32, (const char *)dout + (size_t)i * C * hs, dt, C);
    if (gdt == FSDP_DTYPE_F32) {
      float *drow = (float *)dweight + id[i] * C;
      for (int c = 0; c < C; c++) drow[c] += acc[C + c];
      continue;
    }
    char *drow = (char *)dweight + (size_t)id[i] * C * hs;
    fsdp_cpu_cast(acc, FSDP_DTYPE_F32, drow, dt, C);
    for (int c = 0; c < C; c++) acc[c] += acc[C + c];
    fsdp_cpu_cast(drow, dt, acc, FSDP_DTYPE_F32, C);
  }
  return fsdp_cpu_work_done(&t);
}

/* ---- normalisation, attention, losses ------------------------------------------------------- */

static int k_layernorm_forward(void *ctx, fsdp_dtype dt, void *out, float *mean, float *rstd,
                               const void *inp, const void *weight, const void *bias, int64_t N,
                               int C, float eps) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_layernorm_forward(out, mean, rstd, inp, weight, bias, N, C, eps);
    return FSDP_OK;
  }
  if (!is_half(dt)) return REFUSE("layernorm", dt);
  return fsdp_cpu_half_layernorm_forward(dt, out, mean, rstd, inp, weight, bias, N, C, eps);
}

static int k_layernorm_backward(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dinp,
                                void *dweight, void *dbias, const void *dout, const void *inp,
                                const void *weight, const float *mean, const float *rstd,
                                int64_t N, int C) {
  if (dt != FSDP_DTYPE_F32 && !is_half(dt)) return REFUSE("layernorm", dt);
  if (!grad_dtype_ok(dt, gdt)) return REFUSE("layernorm (weight gradient)", gdt);
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
    return FSDP_OK;
  }
  return fsdp_cpu_half_layernorm_backward(dt, gdt, dinp, dweight, dbias, dout, inp, weight,
                                          mean, rstd, N, C);
}

static int k_softmax_forward(void *ctx, fsdp_dtype dt, void *out, const void *inp, int64_t N,
                             int C) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_softmax_forward(out, inp, N, C);
    return FSDP_OK;
  }
  if (!is_half(dt)) return REFUSE("softmax", dt);
  return fsdp_cpu_half_softmax_forward(dt, out, inp, N, C);
}

static int k_softmax_backward(void *ctx, fsdp_dtype dt, void *dinp, const void *dout,
                              const void *out, int64_t N, int C) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_softmax_backward(dinp, dout, out, N, C);
    return FSDP_OK;
  }
  if (!is_half(dt)) return REFUSE("softmax", dt);
  return fsdp_cpu_half_softmax_backward(dt, dinp, dout, out, N, C);
}

/* the cpu's kernels are deterministic whatever the setting (fixed reduction orders) */
static int k_set_deterministic(void *ctx, bool on) { return FSDP_OK; }

static int k_reduce_ranks(void *ctx, fsdp_dtype dt, fsdp_reduce_op red, void *out,
                          const void *const *src, int nsrc, int64_t n) {
  if (!fsdp_cpu_reduce_supported(dt, red)) return fsdp_kernels_refuse("reduce_ranks", dt, "cpu");
  if (nsrc < 1) return fsdp_error("reduce_ranks: %d inputs (at least 1)", nsrc);
  fsdp_cpu_reduce_ranks(out, src, nsrc, n, dt, red);
  return FSDP_OK;
}

/* The cpu's backward recomputes the probabilities (attention.c, attention_bf16.c, half.c); f32,
 * bf16 and f16 keep each query row's softmax max and reciprocal sum, (B, NH, T, 2) f32, to
 * rebuild a row in one pass. */
static int64_t k_attention_saved(void *ctx, fsdp_dtype dt, int B, int T, int C, int NH,
                                 fsdp_dtype *saved_dt) {
  *saved_dt = FSDP_DTYPE_F32;
  return dt == FSDP_DTYPE_F32 || is_half(dt) ? (int64_t)B * NH * T * 2 : 0;
}

/* the f32 kernel's workspace: scratch of this call, accounted as activations */
static float *attention_scratch(fsdp_cpu_work *w, int B, int T, int C, int NH, bool backward) {
  return fsdp_cpu_work_buf(
      w, fsdp_cpu_attention_scratch(B, T, C, NH, fsdp_cpu_threads(), backward), sizeof(float));
}

static int k_attention_forward(void *ctx, fsdp_dtype dt, void *out, void *att, const void *qkv,
                               int B, int T, int C, int NH) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_work w = {0};
    float *scratch = attention_scratch(&w, B, T, C, NH, false);
    if (!w.failed) fsdp_cpu_attention_forward(out, att, scratch, qkv, B, T, C, NH);
    return fsdp_cpu_work_done(&w);
  }
  if (!is_half(dt)) return REFUSE("attention", dt);
  return fsdp_cpu_half_attention_forward(dt, out, att, qkv, B, T, C, NH);
}

static int k_attention_backward(void *ctx, fsdp_dtype dt, void *dqkv, const void *dout,
                                const void *qkv, const void *att, int B, int T, int C, int NH,
                                bool set_dqkv) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_work w = {0};
    float *scratch = attention_scratch(&w, B, T, C, NH, true);
    if (!w.failed)
      fsdp_cpu_attention_backward(dqkv, scratch, dout, qkv, att, B, T, C, NH, set_dqkv);
    return fsdp_cpu_work_done(&w);
  }
  if (!is_half(dt)) return REFUSE("attention", dt);
  return fsdp_cpu_half_attention_backward(dt, dqkv, dout, qkv, att, B, T, C, NH, set_dqkv);
}

static int k_cross_entropy_forward(void *ctx, fsdp_dtype dt, float *loss, float *lse,
                                   const void *logits, const void *targets, fsdp_dtype tdt,
                                   int64_t N, int V, int64_t ignore, int64_t *count) {
  if (dt != FSDP_DTYPE_F32 && !is_half(dt)) return REFUSE("cross_entropy", dt);
  fsdp_cpu_work t = {0};
  const int64_t *tg = ids_i64(&t, targets, tdt, N);
  if (!tg) return fsdp_cpu_work_done(&t);
  if (dt == FSDP_DTYPE_F32) {
    loss[0] = fsdp_cpu_cross_entropy_forward(lse, logits, tg, N, V, ignore, count);
    return fsdp_cpu_work_done(&t);
  }
  int rc = fsdp_cpu_half_cross_entropy_forward(dt, loss, lse, logits, tg, N, V, ignore, count);
  return fsdp_cpu_work_done(&t) || rc ? FSDP_ERR : FSDP_OK;
}

static int k_cross_entropy_backward(void *ctx, fsdp_dtype dt, void *dlogits, const float *dloss,
                                    const void *logits, const float *lse, const void *targets,
                                    fsdp_dtype tdt, int64_t N, int V, int64_t ignore,
                                    int64_t count) {
  if (dt != FSDP_DTYPE_F32 && !is_half(dt)) return REFUSE("cross_entropy", dt);
  fsdp_cpu_work t = {0};
  const int64_t *tg = ids_i64(&t, targets, tdt, N);
  if (!tg) return fsdp_cpu_work_done(&t);
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_cross_entropy_backward(dlogits, dloss[0], logits, lse, tg, N, V, ignore, count);
    return fsdp_cpu_work_done(&t);
  }
  int rc = fsdp_cpu_half_cross_entropy_backward(dt, dlogits, dloss[0], logits, lse, tg, N, V,
                                                 ignore, count);
  return fsdp_cpu_work_done(&t) || rc ? FSDP_ERR : FSDP_OK;
}

static int k_mse_forward(void *ctx, fsdp_dtype dt, float *out, const void *a, const void *b,
                         int64_t n) {
  if (is_half(dt)) return fsdp_cpu_half_mse_forward(dt, out, a, b, n);
  if (dt != FSDP_DTYPE_F32) return REFUSE("mse", dt);
  out[0] = n ? fsdp_cpu_mse_forward(a, b, n) : 0.0f;
  return FSDP_OK;
}

static int k_mse_backward(void *ctx, fsdp_dtype dt, void *da, void *db, const float *dloss,
                          const void *a, const void *b, int64_t n) {
  if (is_half(dt)) return fsdp_cpu_half_mse_backward(dt, da, db, dloss[0], a, b, n);
  if (dt != FSDP_DTYPE_F32) return REFUSE("mse", dt);
  fsdp_cpu_mse_backward(da, db, dloss[0], a, b, n);
  return FSDP_OK;
}

/* ---- reductions ----------------------------------------------------------------------------------- */

static int k_sum(void *ctx, fsdp_dtype dt, void *out, const void *in, int64_t n, bool mean) {
  if (dt == FSDP_DTYPE_BOOL || (mean && !fsdp_dtype_is_float(dt))) return REFUSE(mean ? "mean" : "sum", dt);
  if (is_int(dt)) { /* in int64, wrapping like the i64 add: exact beyond 2^53 */
    uint64_t s = 0;
    for (int64_t i = 0; i < n; i++)
      s += dt == FSDP_DTYPE_I64 ? (uint64_t)((const int64_t *)in)[i]
                                : (uint64_t)(int64_t)LD(in, dt, i);
    ((int64_t *)out)[0] = (int64_t)s;
    return FSDP_OK;
  }
  double s = 0;
  if (dt == FSDP_DTYPE_F64) {
    for (int64_t i = 0; i < n; i++) s += ((const double *)in)[i];
  } else if (dt == FSDP_DTYPE_F32) {
    s = fsdp_cpu_sum(in, n);
  } else if (fsdp_cpu_half_sum(dt, &s, in, n, false)) {
    return FSDP_ERR;
  }
  ST(out, dt, 0, mean ? (n ? s / (double)n : NAN) : s);
  return FSDP_OK;
}

static int k_sumsq(void *ctx, fsdp_dtype dt, double *host_out, const void *in, int64_t n) {
  if (!fsdp_dtype_is_float(dt)) return REFUSE("sumsq", dt);
  if (dt == FSDP_DTYPE_F64) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += ((const double *)in)[i] * ((const double *)in)[i];
    *host_out = s;
    return FSDP_OK;
  }
  if (dt == FSDP_DTYPE_F32) {
    *host_out = fsdp_cpu_sumsq(in, n);
    return FSDP_OK;
  }
  return fsdp_cpu_half_sum(dt, host_out, in, n, true);
}

static int k_sum_dim_forward(void *ctx, fsdp_dtype dt, void *out, const void *in, int64_t outer,
                             int64_t R, int64_t inner, double scale) {
  int64_t no = outer * inner;
  if (dt == FSDP_DTYPE_BOOL) return REFUSE("sum", dt);
  if (dt == FSDP_DTYPE_I64 && scale == 1.0) { /* exact beyond 2^53, as the i64 add */
    const int64_t *x = in;
    for (int64_t o = 0; o < outer; o++)
      for (int64_t j = 0; j < inner; j++) {
        uint64_t s = 0;
        for (int64_t r = 0; r < R; r++) s += (uint64_t)x[(o * R + r) * inner + j];
        ((int64_t *)out)[o * inner + j] = (int64_t)s;
      }
    return FSDP_OK;
  }
  if (dt == FSDP_DTYPE_F64 || is_int(dt)) {
    for (int64_t o = 0; o < outer; o++)
      for (int64_t j = 0; j < inner; j++) {
        double s = 0;
        for (int64_t r = 0; r < R; r++) s += LD(in, dt, (o * R + r) * inner + j);
        ST(out, dt, o * inner + j, s * scale);
      }
    return FSDP_OK;
  }
  fsdp_cpu_work t = {0};
  const float *wi = widen(&t, in, dt, outer * R * inner);
  float *wo = out_f32(&t, out, dt, no, false);
  if (!t.failed) {
    fsdp_cpu_sum_dim_forward(wo, wi, outer, R, inner);
    if (scale != 1.0)
      for (int64_t i = 0; i < no; i++) wo[i] *= (float)scale;
    narrow(out, dt, wo, no);
  }
  return fsdp_cpu_work_done(&t);
}

static int k_sum_dim_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                              int64_t outer, int64_t R, int64_t inner, double scale) {
  int64_t ni = outer * R * inner;
  if (!fsdp_dtype_is_float(dt)) return REFUSE("sum", dt);
  if (dt == FSDP_DTYPE_F64) {
    for (int64_t o = 0; o < outer; o++)
      for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < inner; j++) {
          int64_t i = (o * R + r) * inner + j;
          ST(din, dt, i, LD(din, dt, i) + scale * LD(dout, dt, o * inner + j));
        }
    return FSDP_OK;
  }
  fsdp_cpu_work t = {0};
  const float *g = widen(&t, dout, dt, outer * inner);
  float *d = out_f32(&t, din, dt, ni, true);
  if (!t.failed) {
    const float s = (float)scale;
    for (int64_t o = 0; o < outer; o++)
      for (int64_t r = 0; r < R; r++) {
        float *dd = d + (o * R + r) * inner;
        const float *gg = g + o * inner;
        for (int64_t j = 0; j < inner; j++) dd[j] += s * gg[j];
      }
    narrow(din, dt, d, ni);
  }
  return fsdp_cpu_work_done(&t);
}

/* (a, ia) ranks above (b, ib): larger (NaN largest; ia, ib as exact_i64) */
static bool above(double a, int64_t ia, double b, int64_t ib) {
  if (a != a || b != b) return a != a && b == b;
  return order(a, ia, b, ib) > 0;
}

static int k_extreme_dim(void *ctx, fsdp_dtype dt, bool max, void *values, int64_t *index,
                         const void *in, int64_t outer, int64_t R, int64_t inner) {
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < inner; j++) {
      int64_t best = 0, at = o * R * inner + j;
      double bv = LD(in, dt, at);
      int64_t bi = exact_i64(in, dt, at);
      for (int64_t r = 1; r < R && bv == bv; r++) {
        at = (o * R + r) * inner + j;
        double v = LD(in, dt, at);
        int64_t vi = exact_i64(in, dt, at);
        if (v != v || (max ? above(v, vi, bv, bi) : above(bv, bi, v, vi)))
          best = r, bv = v, bi = vi;
      }
      if (values) /* copied as stored: no rounding */
        memcpy((char *)values + (o * inner + j) * (int64_t)fsdp_dtype_size(dt),
               (const char *)in + ((o * R + best) * inner + j) * (int64_t)fsdp_dtype_size(dt),
               fsdp_dtype_size(dt));
      if (index) index[o * inner + j] = best;
    }
  return FSDP_OK;
}

typedef struct {
  double v;
  int64_t exact; /* exact_i64 */
  int64_t i;
} keyed;

static int cmp_desc(const void *pa, const void *pb) {
  const keyed *a = pa, *b = pb;
  if (above(a->v, a->exact, b->v, b->exact)) return -1;
  if (above(b->v, b->exact, a->v, a->exact)) return 1;
  return a->i < b->i ? -1 : a->i > b->i; /* stable: lower index first */
}

static int cmp_asc(const void *pa, const void *pb) {
  const keyed *a = pa, *b = pb;
  if (above(b->v, b->exact, a->v, a->exact)) return -1;
  if (above(a->v, a->exact, b->v, b->exact)) return 1;
  return a->i < b->i ? -1 : a->i > b->i;
}

static int k_topk(void *ctx, fsdp_dtype dt, void *values, int64_t *index, const void *in,
                  int64_t outer, int64_t R, int64_t inner, int64_t k, bool largest) {
  keyed *row = malloc(sizeof *row * (size_t)(R ? R : 1));
  if (!row) return fsdp_error("topk: out of host memory for %lld keys", (long long)R);
  const size_t es = fsdp_dtype_size(dt);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < inner; j++) {
      for (int64_t r = 0; r < R; r++) {
        int64_t at = (o * R + r) * inner + j;
        row[r] = (keyed){LD(in, dt, at), exact_i64(in, dt, at), r};
      }
      qsort(row, (size_t)R, sizeof *row, largest ? cmp_desc : cmp_asc);
      for (int64_t q = 0; q < k; q++) {
        int64_t at = (o * k + q) * inner + j;
        if (values)
          memcpy((char *)values + at * (int64_t)es,
                 (const char *)in + ((o * R + row[q].i) * inner + j) * (int64_t)es, es);
        if (index) index[at] = row[q].i;
      }
    }
  free(row);
  return FSDP_OK;
}

static int k_index_add_dim(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                           const int64_t *index, int64_t outer, int64_t R, int64_t inner,
                           int64_t K) {
  if (!fsdp_dtype_is_float(dt)) return REFUSE("index_add", dt);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t q = 0; q < K; q++)
      for (int64_t j = 0; j < inner; j++) {
        int64_t src = (o * K + q) * inner + j, dst = (o * R + index[src]) * inner + j;
        ST(din, dt, dst, LD(din, dt, dst) + LD(dout, dt, src));
      }
  return FSDP_OK;
}

/* ---- optimizers -------------------------------------------------------------------------------- */

static int k_sgd_step(void *ctx, fsdp_dtype dt, void *param, void *buf, const void *grad,
                      int64_t n, float lr, float momentum, float weight_decay, bool first_step) {
  if (dt != FSDP_DTYPE_F32) return REFUSE("sgd_step", dt);
  fsdp_cpu_sgd_step(param, buf, grad, n, lr, momentum, weight_decay, first_step);
  return FSDP_OK;
}

static int k_adamw_step(void *ctx, fsdp_dtype dt, void *param, void *m, void *v,
                        const void *grad, int64_t n, float lr, float beta1, float beta2,
                        float eps, float weight_decay, float grad_scale, int64_t step) {
  if (dt != FSDP_DTYPE_F32) return REFUSE("adamw_step", dt);
  fsdp_cpu_adamw_step(param, m, v, grad, n, lr, beta1, beta2, eps, weight_decay, grad_scale,
                      step);
  return FSDP_OK;
}

static int k_bias_gelu_forward(void *ctx, fsdp_dtype dt, void *out, const void *inp,
                               const void *bias, int64_t N, int C) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_bias_gelu_forward(out, inp, bias, N, C);
    return FSDP_OK;
  }
  if (!is_half(dt)) return REFUSE("bias_gelu", dt);
  return fsdp_cpu_half_bias_gelu_forward(dt, out, inp, bias, N, C);
}

static int k_add_layernorm_forward(void *ctx, fsdp_dtype dt, void *sum, void *out, float *mean,
                                   float *rstd, const void *a, const void *b, const void *weight,
                                   const void *bias, int64_t N, int C, float eps) {
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_add_layernorm_forward(sum, out, mean, rstd, a, b, weight, bias, N, C, eps);
    return FSDP_OK;
  }
  if (!is_half(dt)) return REFUSE("layernorm", dt);
  return fsdp_cpu_half_add_layernorm_forward(dt, sum, out, mean, rstd, a, b, weight, bias, N, C,
                                             eps);
}

static int k_bias_gelu_backward(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dinp,
                                void *dbias, const void *dout, const void *inp, const void *bias,
                                int64_t N, int C, bool set_dinp) {
  if (dt != FSDP_DTYPE_F32 && !is_half(dt)) return REFUSE("bias_gelu", dt);
  if (!grad_dtype_ok(dt, gdt)) return REFUSE("bias_gelu (bias gradient)", gdt);
  if (dt == FSDP_DTYPE_F32) {
    fsdp_cpu_bias_gelu_backward(dinp, dbias, dout, inp, bias, N, C, set_dinp);
    return FSDP_OK;
  }
  return fsdp_cpu_half_bias_gelu_backward(dt, gdt, dinp, dbias, dout, inp, bias, N, C, set_dinp);
}

static int k_adamw_step_masked(void *ctx, fsdp_dtype dt, void *param, void *m, void *v,
                               void *grad, const void *mask, int64_t n, float lr, float beta1,
                               float beta2, float eps, float weight_decay, float grad_scale,
                               int64_t step) {
  if (dt != FSDP_DTYPE_F32) return REFUSE("adamw_step", dt);
  fsdp_cpu_adamw_step_masked(param, m, v, grad, mask, n, lr, beta1, beta2, eps, weight_decay,
                             grad_scale, step);
  return FSDP_OK;
}

/* ---- fill, masks ------------------------------------------------------------------------- */

static int k_fill(void *ctx, fsdp_dtype dt, void *out, double v, int64_t n) {
  unsigned char pat[8];
  fsdp_dtype_store(pat, dt, 0, v);
  switch (fsdp_dtype_size(dt)) { /* the element's bytes, repeated: no per-element conversion */
  case 1: memset(out, pat[0], (size_t)n); break;
  case 2: {
    uint16_t w, *o = out;
    memcpy(&w, pat, 2);
    for (int64_t i = 0; i < n; i++) o[i] = w;
    break;
  }
  case 4: {
    uint32_t w, *o = out;
    memcpy(&w, pat, 4);
    for (int64_t i = 0; i < n; i++) o[i] = w;
    break;
  }
  default: {
    uint64_t w, *o = out;
    memcpy(&w, pat, 8);
    for (int64_t i = 0; i < n; i++) o[i] = w;
  }
  }
  return FSDP_OK;
}

/* The masks compute in f32 only: their keys are the bits of an f32. */
#define MASK_F32(op, dt) if ((dt) != FSDP_DTYPE_F32) return REFUSE(op, dt)

static int k_mask_apply(void *ctx, fsdp_dtype dt, void *x, const void *m, int64_t n) {
  MASK_F32("mask_apply", dt);
  fsdp_cpu_mask_apply(x, m, n);
  return FSDP_OK;
}

static int k_count_zeros(void *ctx, fsdp_dtype dt, int64_t *zeros, const void *x, int64_t n) {
  MASK_F32("count_zeros", dt);
  *zeros = fsdp_cpu_count_zeros(x, n);
  return FSDP_OK;
}

static int k_mask_check(void *ctx, fsdp_dtype dt, int64_t *bad, int64_t *zeros, uint32_t *hash,
                        const void *m, int64_t n) {
  MASK_F32("mask_check", dt);
  fsdp_cpu_mask_check(bad, zeros, hash, m, n);
  return FSDP_OK;
}

static int k_mask_from_nonzero(void *ctx, fsdp_dtype dt, void *mout, int64_t *zeros,
                               const void *x, int64_t n) {
  MASK_F32("mask_from_nonzero", dt);
  *zeros = fsdp_cpu_mask_from_nonzero(mout, x, n);
  return FSDP_OK;
}

static int k_mask_hist(void *ctx, fsdp_dtype dt, int64_t *counts, const void *x, const void *m,
                       int64_t n, uint64_t prefix, int shift, int width) {
  MASK_F32("mask_hist", dt);
  fsdp_cpu_work t = {0};
  /* 4 << width 32-bit counters: the bytes of as many f32 */
  uint32_t *sub = (uint32_t *)tmp_f32(&t, (int64_t)4 << width);
  if (sub) fsdp_cpu_mask_hist(counts, sub, x, m, n, prefix, shift, width);
  return fsdp_cpu_work_done(&t);
}

static int k_mask_hist_pos(void *ctx, fsdp_dtype dt, int64_t *counts, const void *x,
                           const void *m, int64_t n, uint32_t T, uint64_t gbase, uint64_t prefix,
                           int shift, int width) {
  MASK_F32("mask_hist_pos", dt);
  fsdp_cpu_mask_hist_pos(counts, x, m, n, T, gbase, prefix, shift, width);
  return FSDP_OK;
}

static int k_mask_select(void *ctx, fsdp_dtype dt, void *mout, int64_t *pruned, const void *x,
                         const void *m, int64_t n, uint32_t T, uint64_t gbase, uint64_t P) {
  MASK_F32("mask_select", dt);
  *pruned = fsdp_cpu_mask_select(mout, x, m, n, T, gbase, P);
  return FSDP_OK;
}

static int k_mask_nm(void *ctx, fsdp_dtype dt, void *mout, int64_t *groups, const void *x,
                     const void *m, int64_t n, int64_t keep, int64_t M, int64_t lead) {
  MASK_F32("mask_nm", dt);
  *groups = fsdp_cpu_mask_nm(mout, x, m, n, keep, M, lead);
  return FSDP_OK;
}

static int k_mask_values(void *ctx, fsdp_dtype dt, void *out, const void *x, const void *m,
                         int64_t n) {
  MASK_F32("mask_values", dt);
  fsdp_cpu_mask_values(out, x, m, n);
  return FSDP_OK;
}

const fsdp_kernels_i fsdp_cpu_kernels = {
    .cast = k_cast,
    .copy_strided = k_copy_strided,
    .add_strided = k_add_strided,
    .axpy = k_axpy,
    .scale = k_scale,
    .arange = k_arange,
    .random = k_random,
    .gemm = k_gemm,
    .bmm_forward = k_bmm_forward,
    .bmm_backward = k_bmm_backward,
    .linear_forward = k_linear_forward,
    .linear_backward = k_linear_backward,
    .binary_forward = k_binary_forward,
    .binary_backward = k_binary_backward,
    .affine_forward = k_affine_forward,
    .affine_backward = k_affine_backward,
    .unary_forward = k_unary_forward,
    .unary_backward = k_unary_backward,
    .pow_forward = k_pow_forward,
    .pow_backward = k_pow_backward,
    .clamp_forward = k_clamp_forward,
    .clamp_backward = k_clamp_backward,
    .compare = k_compare,
    .where = k_where,
    .dropout_forward = k_dropout_forward,
    .dropout_backward = k_dropout_backward,
    .check_index = k_check_index,
    .embedding_forward = k_embedding_forward,
    .embedding_backward = k_embedding_backward,
    .layernorm_forward = k_layernorm_forward,
    .layernorm_backward = k_layernorm_backward,
    .softmax_forward = k_softmax_forward,
    .softmax_backward = k_softmax_backward,
    .attention_saved = k_attention_saved,
    .set_deterministic = k_set_deterministic,
    .reduce_ranks = k_reduce_ranks,
    .attention_forward = k_attention_forward,
    .attention_backward = k_attention_backward,
    .cross_entropy_forward = k_cross_entropy_forward,
    .cross_entropy_backward = k_cross_entropy_backward,
    .mse_forward = k_mse_forward,
    .mse_backward = k_mse_backward,
    .sum = k_sum,
    .sumsq = k_sumsq,
    .sum_dim_forward = k_sum_dim_forward,
    .sum_dim_backward = k_sum_dim_backward,
    .extreme_dim = k_extreme_dim,
    .topk = k_topk,
    .index_add_dim = k_index_add_dim,
    .sgd_step = k_sgd_step,
    .adamw_step = k_adamw_step,
    .adamw_step_masked = k_adamw_step_masked,
    .bias_gelu_forward = k_bias_gelu_forward,
    .bias_gelu_backward = k_bias_gelu_backward,
    .add_layernorm_forward = k_add_layernorm_forward,
    .fill = k_fill,
    .mask_apply = k_mask_apply,
    .count_zeros = k_count_zeros,
    .mask_check = k_mask_check,
    .mask_from_nonzero = k_mask_from_nonzero,
    .mask_hist = k_mask_hist,
    .mask_hist_pos = k_mask_hist_pos,
    .mask_select = k_mask_select,
    .mask_nm = k_mask_nm,
    .mask_values = k_mask_values,
};

/* fsdp.info()'s line for the cpu: which library runs its GEMMs (gemm.h) */
static void cpu_describe(void *ctx, char *buf, size_t n) {
  (void)ctx;
  int len = snprintf(buf, n, "gemm ");
  if (len >= 0 && (size_t)len < n) fsdp_cpu_gemm_describe(buf + len, n - (size_t)len);
}

/* The cpu registers itself: its device (in core) gets this table, and its description here
 * (core does not know the kernels' libraries). */
int fsdp_cpu_register(void) {
  fsdp_device_cpu.describe = cpu_describe;
  return fsdp_device_register(&fsdp_device_cpu, &fsdp_cpu_kernels);
}
