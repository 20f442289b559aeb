/*
 * elementwise.cu — elementwise math on the cuda device: axpy, scale, binary ops with the
 * repeating-b broadcast, affine, unary ops, pow, clamp, comparisons, where, dropout.
 *
 * Each slot computes what the cpu's table computes, in the same dtypes and with the same
 * formulas: the f32 family in f32 (bf16 / f16 widened exactly and rounded back once), f64 and
 * the integers through double (i64 add / sub / mul exact), written with exact.h's
 * uncontracted operations. So results are the cpu's bit for bit, except where a C library
 * function enters (expf, logf, tanhf, powf: CUDA's are within 2 ulp of glibc's) and the sums
 * over repeats of a broadcast operand's gradient (double, in another order). GELU and dropout
 * are exact: GELU runs the cpu's own polynomial exp, dropout draws the cpu's Philox uniforms.
 *
 * Broadcast gradients (db of b repeating n / m times) are summed per element of b in double by
 * reduce_dim (common.cuh): no atomics, a fixed order.
 */
#include "kernels/cuda/common.cuh"

using namespace fsdp_cu;

static const char *const binop_names[] = {"add", "sub", "mul", "div"};

/* ---- axpy, scale ----------------------------------------------------------------------------- */

/* y += a x, in the cpu's arithmetic for T */
__device__ __forceinline__ void axpy_elem(float *y, float x, float a, double) {
  *y = XF_ADD(*y, XF_MUL(a, x));
}
__device__ __forceinline__ void axpy_elem(bf16 *y, bf16 x, float a, double) {
  *y = from_f<bf16>(XF_ADD(to_f(*y), XF_MUL(a, to_f(x))));
}
__device__ __forceinline__ void axpy_elem(f16 *y, f16 x, float a, double) {
  *y = from_f<f16>(XF_ADD(to_f(*y), XF_MUL(a, to_f(x))));
}
template <typename T> __device__ __forceinline__ void axpy_elem(T *y, T x, float, double a) {
  *y = from_d<T>(XD_ADD(to_d(*y), XD_MUL(a, to_d(x))));
}

template <typename T> __global__ void axpy_k(T *y, const T *x, float af, double ad, int64_t n) {
  FSDP_CU_LOOP(i, n) axpy_elem(&y[i], x[i], af, ad);
}

__global__ void add_f32_k(float *y, const float *x, int64_t n) {
  FSDP_CU_LOOP(i, n) y[i] = XF_ADD(y[i], x[i]);
}

int fsdp_cuda_axpy(void *ctx, fsdp_dtype dt, void *y, const void *x, double alpha, int64_t n) {
  if (dt == FSDP_DTYPE_BOOL || !known(dt)) return FSDP_CU_REFUSE("add", dt);
  if (n <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  if (dt == FSDP_DTYPE_F32 && (float)alpha == 1.0f) {
    add_f32_k<<<blocks_for(n), THREADS, 0, s>>>((float *)y, (const float *)x, n);
    return fsdp_cuda_launched("add");
  }
  return with_any(dt, [&](auto tag) {
    using T = decltype(tag);
    axpy_k<T><<<blocks_for(n), THREADS, 0, s>>>((T *)y, (const T *)x, (float)alpha, alpha, n);
    return fsdp_cuda_launched("add");
  });
}

template <typename T> __global__ void scale_k(T *y, double f, int64_t n) {
  FSDP_CU_LOOP(i, n) y[i] = from_d<T>(XD_MUL(to_d(y[i]), f));
}

__global__ void scale_f32_k(float *y, float f, int64_t n) {
  FSDP_CU_LOOP(i, n) y[i] = XF_MUL(y[i], f);
}

int fsdp_cuda_scale(void *ctx, fsdp_dtype dt, void *y, double s, int64_t n) {
  if (dt == FSDP_DTYPE_BOOL || !known(dt)) return FSDP_CU_REFUSE("mul", dt);
  if (n <= 0) return FSDP_OK;
  cudaStream_t st = fsdp_cuda_stream();
  if (dt == FSDP_DTYPE_F32) {
    scale_f32_k<<<blocks_for(n), THREADS, 0, st>>>((float *)y, (float)s, n);
    return fsdp_cuda_launched("mul");
  }
  return with_any(dt, [&](auto tag) { /* every other dtype through double, as the cpu */
    using T = decltype(tag);
    scale_k<T><<<blocks_for(n), THREADS, 0, st>>>((T *)y, s, n);
    return fsdp_cuda_launched("mul");
  });
}

/* ---- binary ops ---------------------------------------------------------------------------------- */

__device__ __forceinline__ float binop_f(float u, float v, fsdp_binop op) {
  switch (op) {
  case FSDP_BIN_ADD: return XF_ADD(u, v);
  case FSDP_BIN_SUB: return XF_SUB(u, v);
  case FSDP_BIN_MUL: return XF_MUL(u, v);
  default: return XF_DIV(u, v);
  }
}

__device__ __forceinline__ double binop_d(double u, double v, fsdp_binop op) {
  switch (op) {
  case FSDP_BIN_ADD: return XD_ADD(u, v);
  case FSDP_BIN_SUB: return XD_SUB(u, v);
  case FSDP_BIN_MUL: return XD_MUL(u, v);
  default: return XD_DIV(u, v);
  }
}

/* f32 family in f32 */
template <typename T>
__global__ void binary_f_k(T *out, const T *a, const T *b, int64_t n, int64_t m, fsdp_binop op) {
  FSDP_CU_LOOP(i, n) out[i] = from_f<T>(binop_f(to_f(a[i]), to_f(b[i % m]), op));
}

/* f64, i32, u8 through double (integer results saturate) */
template <typename T>
__global__ void binary_d_k(T *out, const T *a, const T *b, int64_t n, int64_t m, fsdp_binop op) {
  FSDP_CU_LOOP(i, n) out[i] = from_d<T>(binop_d(to_d(a[i]), to_d(b[i % m]), op));
}

/* i64 add, sub, mul: exact, wrapping */
__global__ void binary_i64_k(int64_t *out, const int64_t *a, const int64_t *b, int64_t n,
                             int64_t m, fsdp_binop op) {
  FSDP_CU_LOOP(i, n) {
    const uint64_t u = (uint64_t)a[i], v = (uint64_t)b[i % m];
    out[i] = (int64_t)(op == FSDP_BIN_ADD ? u + v : op == FSDP_BIN_SUB ? u - v : u * v);
  }
}

int fsdp_cuda_binary_forward(void *ctx, fsdp_dtype dt, void *out, const void *a, const void *b,
                             int64_t n, int64_t m, fsdp_binop op) {
  if ((unsigned)op > FSDP_BIN_DIV) return fsdp_error("binary: unknown op %d", (int)op);
  if (n <= 0 || m <= 0) return FSDP_OK;
  /* integer division would need a float result: divide float tensors instead */
  if (dt == FSDP_DTYPE_BOOL || !known(dt) || (is_int(dt) && op == FSDP_BIN_DIV))
    return FSDP_CU_REFUSE(binop_names[op], dt);
  cudaStream_t s = fsdp_cuda_stream();
  const unsigned g = blocks_for(n);
  if (dt == FSDP_DTYPE_I64) {
    binary_i64_k<<<g, THREADS, 0, s>>>((int64_t *)out, (const int64_t *)a, (const int64_t *)b,
                                       n, m, op);
    return fsdp_cuda_launched(binop_names[op]);
  }
  if (is_f32_family(dt))
    return with_float_family(dt, [&](auto tag) {
      using T = decltype(tag);
      binary_f_k<T><<<g, THREADS, 0, s>>>((T *)out, (const T *)a, (const T *)b, n, m, op);
      return fsdp_cuda_launched(binop_names[op]);
    });
  return with_any(dt, [&](auto tag) {
    using T = decltype(tag);
    binary_d_k<T><<<g, THREADS, 0, s>>>((T *)out, (const T *)a, (const T *)b, n, m, op);
    return fsdp_cuda_launched(binop_names[op]);
  });
}

/* The gradients, f32 family: ga = d(a op b)/da g, gb the term summed into db (the cpu's:
 * -(g a / b / b) is written g (a / b / b), subtracted) */
__device__ __forceinline__ float grad_a_f(float g, float v, fsdp_binop op) {
  return op == FSDP_BIN_MUL ? XF_MUL(g, v) : op == FSDP_BIN_DIV ? XF_DIV(g, v) : g;
}

__device__ __forceinline__ float grad_b_f(float g, float u, float v, fsdp_binop op) {
  return op == FSDP_BIN_MUL ? XF_MUL(g, u)
         : op == FSDP_BIN_DIV ? XF_MUL(g, XF_DIV(XF_DIV(u, v), v))
                              : g;
}

/* the f64 gradients (the cpu's central formulas); gb is added */
__device__ __forceinline__ double grad_a_d(double g, double v, fsdp_binop op) {
  return op == FSDP_BIN_MUL ? XD_MUL(g, v) : op == FSDP_BIN_DIV ? XD_DIV(g, v) : g;
}

__device__ __forceinline__ double grad_b_d(double g, double u, double v, fsdp_binop op) {
  return op == FSDP_BIN_ADD   ? g
         : op == FSDP_BIN_SUB ? -g
         : op == FSDP_BIN_MUL ? XD_MUL(g, u)
                              : XD_DIV(XD_MUL(-g, u), XD_MUL(v, v));
}

/* inputs the op reads: add and sub read neither a nor b (either may be NULL) */
#define LOAD_F(p, i) ((p) ? to_f((p)[i]) : 0.0f)
#define LOAD_D(p, i) ((p) ? to_d((p)[i]) : 0.0)

/* f32 family, m == n (or da alone): da and db may be one buffer (x * x): then one rounding */
template <typename T>
__global__ void binary_bw_f_k(T *da, T *db, const T *dout, const T *a, const T *b, int64_t n,
                              int64_t m, fsdp_binop op) {
  const bool sub_b = op == FSDP_BIN_SUB || op == FSDP_BIN_DIV;
  FSDP_CU_LOOP(i, n) {
    const float g = to_f(dout[i]);
    if (da) {
      float d = XF_ADD(to_f(da[i]), grad_a_f(g, LOAD_F(b, i % m), op));
      if (db == da) {
        const float gb = grad_b_f(g, LOAD_F(a, i), LOAD_F(b, i), op);
        d = sub_b ? XF_SUB(d, gb) : XF_ADD(d, gb);
      }
      da[i] = from_f<T>(d);
    }
    if (db && db != da) {
      const float gb = grad_b_f(g, LOAD_F(a, i), LOAD_F(b, i), op);
      const float d = to_f(db[i]);
      db[i] = from_f<T>(sub_b ? XF_SUB(d, gb) : XF_ADD(d, gb));
    }
  }
}

template <typename T>
__global__ void binary_bw_d_k(T *da, T *db, const T *dout, const T *a, const T *b, int64_t n,
                              int64_t m, fsdp_binop op) {
  FSDP_CU_LOOP(i, n) {
    const double g = to_d(dout[i]);
    if (da) da[i] = from_d<T>(XD_ADD(to_d(da[i]), grad_a_d(g, LOAD_D(b, i % m), op)));
    if (db) /* da == db: read after the write above, as the cpu's second pass */
      db[i] = from_d<T>(XD_ADD(to_d(db[i]), grad_b_d(g, LOAD_D(a, i), LOAD_D(b, i), op)));
  }
}

/* db summed over repeats: the terms, in double (the cpu's f32 products, widened) */
template <typename T> struct db_term_f {
  const T *g, *a, *b;
  int64_t m;
  fsdp_binop op;
  __device__ double operator()(int64_t, int64_t r, int64_t j) const {
    const int64_t i = r * m + j;
    const float gg = to_f(g[i]);
    if (op == FSDP_BIN_ADD || op == FSDP_BIN_SUB) return gg;
    if (op == FSDP_BIN_MUL || m == 1) return XF_MUL(gg, to_f(a[i])); /* scalar div: g a */
    const float v = to_f(b[j]);
    return XF_MUL(gg, XF_DIV(XF_DIV(to_f(a[i]), v), v));
  }
};

template <typename T> struct db_store_f {
  T *db;
  const T *b;
  int64_t m;
  fsdp_binop op;
  __device__ void operator()(int64_t, int64_t j, double s) const {
    const float d = to_f(db[j]);
    float r;
    if (op == FSDP_BIN_DIV && m == 1) { /* the cpu's scalar case divides the sum: s / b / b */
      const double v = to_f(b[0]);
      r = XF_SUB(d, (float)XD_DIV(XD_DIV(s, v), v));
    } else {
      r = op == FSDP_BIN_SUB || op == FSDP_BIN_DIV ? XF_SUB(d, (float)s) : XF_ADD(d, (float)s);
    }
    db[j] = from_f<T>(r);
  }
};

template <typename T> struct db_term_d {
  const T *g, *a, *b;
  int64_t m;
  fsdp_binop op;
  __device__ double operator()(int64_t, int64_t r, int64_t j) const {
    const int64_t i = r * m + j;
    return grad_b_d(to_d(g[i]), LOAD_D(a, i), LOAD_D(b, j), op);
  }
};

template <typename T> struct db_store_d {
  T *db;
  __device__ void operator()(int64_t, int64_t j, double s) const {
    db[j] = from_d<T>(XD_ADD(to_d(db[j]), s));
  }
};

int fsdp_cuda_binary_backward(void *ctx, fsdp_dtype dt, void *da, void *db, const void *dout,
                              const void *a, const void *b, int64_t n, int64_t m, fsdp_binop op) {
  if ((unsigned)op > FSDP_BIN_DIV) return fsdp_error("binary: unknown op %d", (int)op);
  if (n <= 0 || m <= 0) return FSDP_OK;
  if (!known(dt) || !fsdp_dtype_is_float(dt)) return FSDP_CU_REFUSE(binop_names[op], dt);
  const char *what = binop_names[op];
  cudaStream_t s = fsdp_cuda_stream();
  const bool lockstep = m == n && m > 1; /* the cpu's m == 1 case has its own db formula */
  return with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr bool dbl = sizeof(T) == 8;
    T *tda = (T *)da, *tdb = (T *)db;
    const T *tg = (const T *)dout, *ta = (const T *)a, *tb = (const T *)b;
    /* da (and db when it is the same buffer, or in lockstep) elementwise */
    T *ew_db = lockstep ? tdb : NULL;
    if (tda || ew_db) {
      if constexpr (dbl)
        binary_bw_d_k<T><<<blocks_for(n), THREADS, 0, s>>>(tda, ew_db, tg, ta, tb, n, m, op);
      else
        binary_bw_f_k<T><<<blocks_for(n), THREADS, 0, s>>>(tda, ew_db, tg, ta, tb, n, m, op);
      if (fsdp_cuda_launched(what)) return FSDP_ERR;
    }
    if (!tdb || lockstep) return FSDP_OK;
    /* db over the n / m repeats of b: (1, n / m, m) reduced over the middle */
    if constexpr (dbl)
      return reduce_dim<double>(1, n / m, m, db_term_d<T>{tg, ta, tb, m, op}, db_store_d<T>{tdb},
                                what);
    return reduce_dim<double>(1, n / m, m, db_term_f<T>{tg, ta, tb, m, op},
                              db_store_f<T>{tdb, tb, m, op}, what);
  });
}

/* ---- affine ------------------------------------------------------------------------------------- */

template <typename T>
__global__ void affine_f_k(T *out, const T *a, float sf, float tf, int64_t n) {
  FSDP_CU_LOOP(i, n) out[i] = from_f<T>(XF_ADD(XF_MUL(to_f(a[i]), sf), tf));
}

template <typename T>
__global__ void affine_d_k(T *out, const T *a, double sd, double td, int64_t n) {
  FSDP_CU_LOOP(i, n) out[i] = from_d<T>(XD_ADD(XD_MUL(to_d(a[i]), sd), td));
}

int fsdp_cuda_affine_forward(void *ctx, fsdp_dtype dt, void *out, const void *a, double s,
                             double t, int64_t n) {
  if (dt == FSDP_DTYPE_BOOL || !known(dt)) return FSDP_CU_REFUSE("affine", dt);
  if (n <= 0) return FSDP_OK;
  cudaStream_t st = fsdp_cuda_stream();
  if (is_f32_family(dt))
    return with_float_family(dt, [&](auto tag) {
      using T = decltype(tag);
      affine_f_k<T><<<blocks_for(n), THREADS, 0, st>>>((T *)out, (const T *)a, (float)s,
                                                       (float)t, n);
      return fsdp_cuda_launched("affine");
    });
  return with_any(dt, [&](auto tag) {
    using T = decltype(tag);
    affine_d_k<T><<<blocks_for(n), THREADS, 0, st>>>((T *)out, (const T *)a, s, t, n);
    return fsdp_cuda_launched("affine");
  });
}

__global__ void affine_bw_f32_k(float *da, const float *dout, float s, int64_t n) {
  FSDP_CU_LOOP(i, n) da[i] = XF_ADD(da[i], XF_MUL(dout[i], s));
}

int fsdp_cuda_affine_backward(void *ctx, fsdp_dtype dt, void *da, const void *dout, double s,
                              int64_t n) {
  if (!known(dt) || !fsdp_dtype_is_float(dt)) return FSDP_CU_REFUSE("affine", dt);
  if (dt != FSDP_DTYPE_F32) return fsdp_cuda_axpy(ctx, dt, da, dout, s, n); /* as the cpu */
  if (n <= 0) return FSDP_OK;
  affine_bw_f32_k<<<blocks_for(n), THREADS, 0, fsdp_cuda_stream()>>>((float *)da,
                                                                     (const float *)dout,
                                                                     (float)s, n);
  return fsdp_cuda_launched("affine");
}

/* ---- unary ops ---------------------------------------------------------------------------------- */

__device__ __forceinline__ float unary_f(fsdp_unary_op op, float x) {
  switch (op) {
  case FSDP_UNARY_RELU: return x <= 0.0f ? 0.0f : x; /* NaN passes */
  case FSDP_UNARY_GELU: return fsdp_x_gelu(x);
  case FSDP_UNARY_EXP: return expf(x);
  case FSDP_UNARY_LOG: return logf(x);
  case FSDP_UNARY_SQRT: return XF_SQRT(x);
  case FSDP_UNARY_TANH: return tanhf(x);
  case FSDP_UNARY_SIGMOID: return XF_DIV(1.0f, XF_ADD(1.0f, expf(-x)));
  case FSDP_UNARY_ABS: return fabsf(x);
  default: /* sign; NaN stays */
    return x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : x == x ? 0.0f : x;
  }
}

__device__ __forceinline__ double unary_d(fsdp_unary_op op, double x) {
  switch (op) {
  case FSDP_UNARY_RELU: return x <= 0 ? 0 : x;
  case FSDP_UNARY_GELU: {
    const double u = XD_MUL(0.7978845608028654,
                            XD_ADD(x, XD_MUL(XD_MUL(XD_MUL(0.044715, x), x), x)));
    return XD_MUL(XD_MUL(0.5, x), XD_ADD(1.0, tanh(u)));
  }
  case FSDP_UNARY_EXP: return exp(x);
  case FSDP_UNARY_LOG: return log(x);
  case FSDP_UNARY_SQRT: return sqrt(x);
  case FSDP_UNARY_TANH: return tanh(x);
  case FSDP_UNARY_SIGMOID: return XD_DIV(1.0, XD_ADD(1.0, exp(-x)));
  case FSDP_UNARY_ABS: return fabs(x);
  default: return x > 0 ? 1 : x < 0 ? -1 : x;
  }
}

template <typename T>
__global__ void unary_f_k(T *out, const T *in, int64_t n, fsdp_unary_op op) {
  FSDP_CU_LOOP(i, n) out[i] = from_f<T>(unary_f(op, to_f(in[i])));
}

template <typename T>
__global__ void unary_d_k(T *out, const T *in, int64_t n, fsdp_unary_op op) {
  FSDP_CU_LOOP(i, n) out[i] = from_d<T>(unary_d(op, to_d(in[i])));
}

int fsdp_cuda_unary_forward(void *ctx, fsdp_dtype dt, fsdp_unary_op op, void *out, const void *in,
                            int64_t n) {
  if ((unsigned)op >= FSDP_UNARY_COUNT) return fsdp_error("unary: unknown op %d", (int)op);
  /* integers: the ops whose result is an integer again */
  const bool int_ok = op == FSDP_UNARY_RELU || op == FSDP_UNARY_ABS || op == FSDP_UNARY_SIGN;
  if (dt == FSDP_DTYPE_BOOL || !known(dt) || (is_int(dt) && !int_ok))
    return FSDP_CU_REFUSE(fsdp_unary_name(op), dt);
  if (n <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  if (is_f32_family(dt))
    return with_float_family(dt, [&](auto tag) {
      using T = decltype(tag);
      unary_f_k<T><<<blocks_for(n), THREADS, 0, s>>>((T *)out, (const T *)in, n, op);
      return fsdp_cuda_launched(fsdp_unary_name(op));
    });
  return with_any(dt, [&](auto tag) {
    using T = decltype(tag);
    unary_d_k<T><<<blocks_for(n), THREADS, 0, s>>>((T *)out, (const T *)in, n, op);
    return fsdp_cuda_launched(fsdp_unary_name(op));
  });
}

/* the increment of din: x the forward's input, y its output (each op reads what it needs) */
__device__ __forceinline__ float unary_grad_f(fsdp_unary_op op, float g, float x, float y) {
  switch (op) {
  case FSDP_UNARY_RELU: return x > 0.0f ? g : 0.0f;
  case FSDP_UNARY_GELU: return XF_MUL(fsdp_x_gelu_grad(x), g);
  case FSDP_UNARY_EXP: return XF_MUL(g, y);
  case FSDP_UNARY_LOG: return XF_DIV(g, x);
  case FSDP_UNARY_SQRT: return XF_DIV(XF_MUL(g, 0.5f), y);
  case FSDP_UNARY_TANH: return XF_MUL(g, XF_SUB(1.0f, XF_MUL(y, y)));
  case FSDP_UNARY_SIGMOID: return XF_MUL(XF_MUL(g, y), XF_SUB(1.0f, y));
  default: /* abs: sign(x), 0 at 0 */
    return x > 0.0f ? g : x < 0.0f ? -g : 0.0f;
  }
}

__device__ __forceinline__ double unary_grad_d(fsdp_unary_op op, double g, double x, double y) {
  switch (op) {
  case FSDP_UNARY_RELU: return x > 0 ? g : 0;
  case FSDP_UNARY_GELU: {
    const double k = 0.7978845608028654;
    const double th = tanh(XD_MUL(k, XD_ADD(x, XD_MUL(XD_MUL(XD_MUL(0.044715, x), x), x))));
    const double d1 = XD_MUL(0.5, XD_ADD(1.0, th));
    const double d2 = XD_MUL(XD_MUL(XD_MUL(XD_MUL(0.5, x), XD_SUB(1.0, XD_MUL(th, th))), k),
                             XD_ADD(1.0, XD_MUL(XD_MUL(XD_MUL(3.0, 0.044715), x), x)));
    return XD_MUL(g, XD_ADD(d1, d2));
  }
  case FSDP_UNARY_EXP: return XD_MUL(g, y);
  case FSDP_UNARY_LOG: return XD_DIV(g, x);
  case FSDP_UNARY_SQRT: return XD_DIV(XD_MUL(g, 0.5), y);
  case FSDP_UNARY_TANH: return XD_MUL(g, XD_SUB(1.0, XD_MUL(y, y)));
  case FSDP_UNARY_SIGMOID: return XD_MUL(XD_MUL(g, y), XD_SUB(1.0, y));
  case FSDP_UNARY_ABS: return x > 0 ? g : x < 0 ? -g : 0;
  default: return 0; /* sign: zero almost everywhere */
  }
}

template <typename T>
__global__ void unary_bw_f_k(T *din, const T *dout, const T *in, const T *out, int64_t n,
                             fsdp_unary_op op) {
  FSDP_CU_LOOP(i, n) {
    float d = to_f(din[i]);
    if (op != FSDP_UNARY_SIGN) /* the cpu leaves din as it is for sign */
      d = XF_ADD(d, unary_grad_f(op, to_f(dout[i]), LOAD_F(in, i), LOAD_F(out, i)));
    din[i] = from_f<T>(d);
  }
}

template <typename T>
__global__ void unary_bw_d_k(T *din, const T *dout, const T *in, const T *out, int64_t n,
                             fsdp_unary_op op) {
  FSDP_CU_LOOP(i, n) {
    const double d = unary_grad_d(op, to_d(dout[i]), LOAD_D(in, i), LOAD_D(out, i));
    din[i] = from_d<T>(XD_ADD(to_d(din[i]), d));
  }
}

int fsdp_cuda_unary_backward(void *ctx, fsdp_dtype dt, fsdp_unary_op op, void *din,
                             const void *dout, const void *in, const void *out, int64_t n) {
  if ((unsigned)op >= FSDP_UNARY_COUNT) return fsdp_error("unary: unknown op %d", (int)op);
  if (!known(dt) || !fsdp_dtype_is_float(dt)) return FSDP_CU_REFUSE(fsdp_unary_name(op), dt);
  if (n <= 0) return FSDP_OK;
  if (dt == FSDP_DTYPE_F32 && op == FSDP_UNARY_SIGN) return FSDP_OK; /* nothing to add */
  cudaStream_t s = fsdp_cuda_stream();
  return with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 8)
      unary_bw_d_k<T><<<blocks_for(n), THREADS, 0, s>>>((T *)din, (const T *)dout,
                                                        (const T *)in, (const T *)out, n, op);
    else
      unary_bw_f_k<T><<<blocks_for(n), THREADS, 0, s>>>((T *)din, (const T *)dout,
                                                        (const T *)in, (const T *)out, n, op);
    return fsdp_cuda_launched(fsdp_unary_name(op));
  });
}

/* ---- pow, clamp ----------------------------------------------------------------------------------- */

template <typename T> __global__ void pow_k(T *out, const T *in, float pf, double pd, int64_t n) {
  FSDP_CU_LOOP(i, n) {
    if constexpr (sizeof(T) == 8) out[i] = from_d<T>(pow(to_d(in[i]), pd));
    else out[i] = from_f<T>(powf(to_f(in[i]), pf));
  }
}

int fsdp_cuda_pow_forward(void *ctx, fsdp_dtype dt, void *out, const void *in, double p,
                          int64_t n) {
  if (!known(dt) || !fsdp_dtype_is_float(dt)) return FSDP_CU_REFUSE("pow", dt);
  if (n <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  return with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    pow_k<T><<<blocks_for(n), THREADS, 0, s>>>((T *)out, (const T *)in, (float)p, p, n);
    return fsdp_cuda_launched("pow");
  });
}

template <typename T>
__global__ void pow_bw_k(T *din, const T *dout, const T *in, float pf, double pd, int64_t n) {
  FSDP_CU_LOOP(i, n) {
    if constexpr (sizeof(T) == 8) {
      const double d = XD_MUL(XD_MUL(to_d(dout[i]), pd), pow(to_d(in[i]), XD_SUB(pd, 1.0)));
      din[i] = from_d<T>(XD_ADD(to_d(din[i]), d));
    } else {
      const float d = XF_MUL(XF_MUL(to_f(dout[i]), pf), powf(to_f(in[i]), XF_SUB(pf, 1.0f)));
      din[i] = from_f<T>(XF_ADD(to_f(din[i]), d));
    }
  }
}

int fsdp_cuda_pow_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout, const void *in,
                           double p, int64_t n) {
  if (!known(dt) || !fsdp_dtype_is_float(dt)) return FSDP_CU_REFUSE("pow", dt);
  if (n <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  return with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    pow_bw_k<T><<<blocks_for(n), THREADS, 0, s>>>((T *)din, (const T *)dout, (const T *)in,
                                                  (float)p, p, n);
    return fsdp_cuda_launched("pow");
  });
}

__global__ void clamp_f32_k(float *out, const float *in, float lo, float hi, int64_t n) {
  FSDP_CU_LOOP(i, n) {
    const float x = in[i];
    out[i] = x < lo ? lo : x > hi ? hi : x; /* NaN stays */
  }
}

template <typename T>
__global__ void clamp_d_k(T *out, const T *in, double lo, double hi, int64_t n) {
  FSDP_CU_LOOP(i, n) {
    const double x = to_d(in[i]);
    out[i] = from_d<T>(x < lo ? lo : x > hi ? hi : x);
  }
}

int fsdp_cuda_clamp_forward(void *ctx, fsdp_dtype dt, void *out, const void *in, double lo,
                            double hi, int64_t n) {
  if (dt == FSDP_DTYPE_BOOL || !known(dt)) return FSDP_CU_REFUSE("clamp", dt);
  if (n <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  if (dt == FSDP_DTYPE_F32) {
    clamp_f32_k<<<blocks_for(n), THREADS, 0, s>>>((float *)out, (const float *)in, (float)lo,
                                                  (float)hi, n);
    return fsdp_cuda_launched("clamp");
  }
  return with_any(dt, [&](auto tag) { /* the rest through double, as the cpu */
    using T = decltype(tag);
    clamp_d_k<T><<<blocks_for(n), THREADS, 0, s>>>((T *)out, (const T *)in, lo, hi, n);
    return fsdp_cuda_launched("clamp");
  });
}

template <typename T>
__global__ void clamp_bw_k(T *din, const T *dout, const T *in, double lo, double hi, int64_t n) {
  FSDP_CU_LOOP(i, n) {
    const double x = to_d(in[i]);
    if (x >= lo && x <= hi) din[i] = from_d<T>(XD_ADD(to_d(din[i]), to_d(dout[i])));
  }
}

int fsdp_cuda_clamp_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                             const void *in, double lo, double hi, int64_t n) {
  if (!known(dt) || !fsdp_dtype_is_float(dt)) return FSDP_CU_REFUSE("clamp", dt);
  if (n <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  return with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    clamp_bw_k<T><<<blocks_for(n), THREADS, 0, s>>>((T *)din, (const T *)dout, (const T *)in,
                                                    lo, hi, n);
    return fsdp_cuda_launched("clamp");
  });
}

/* ---- compare, where ------------------------------------------------------------------------------ */

template <typename T>
__global__ void compare_k(uint8_t *out, const T *a, const T *b, int64_t n, int64_t m,
                          fsdp_cmpop op) {
  FSDP_CU_LOOP(i, n) {
    const double u = to_d(a[i]), v = to_d(b[i % m]);
    if (u != u || v != v) { /* NaN: only ne holds */
      out[i] = op == FSDP_CMP_NE;
      continue;
    }
    int c;
    if (u != v) c = u < v ? -1 : 1;
    else { /* i64 beyond 2^53: the exact values decide */
      const int64_t iu = exact_i64(a[i]), iv = exact_i64(b[i % m]);
      c = iu < iv ? -1 : iu > iv;
    }
    switch (op) {
    case FSDP_CMP_GT: out[i] = c > 0; break;
    case FSDP_CMP_GE: out[i] = c >= 0; break;
    case FSDP_CMP_LT: out[i] = c < 0; break;
    case FSDP_CMP_LE: out[i] = c <= 0; break;
    case FSDP_CMP_EQ: out[i] = c == 0; break;
    default: out[i] = c != 0; break;
    }
  }
}

int fsdp_cuda_compare(void *ctx, fsdp_dtype dt, fsdp_cmpop op, void *out, const void *a,
                      const void *b, int64_t n, int64_t m) {
  if (!known(dt)) return FSDP_CU_REFUSE("compare", dt);
  if (n <= 0 || m <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  return with_any(dt, [&](auto tag) {
    using T = decltype(tag);
    compare_k<T><<<blocks_for(n), THREADS, 0, s>>>((uint8_t *)out, (const T *)a, (const T *)b,
                                                   n, m, op);
    return fsdp_cuda_launched("compare");
  });
}

template <typename E>
__global__ void where_k(E *out, const uint8_t *cond, const E *a, const E *b, int64_t n) {
  FSDP_CU_LOOP(i, n) out[i] = cond[i] ? a[i] : b[i];
}

int fsdp_cuda_where(void *ctx, fsdp_dtype dt, void *out, const void *cond, const void *a,
                    const void *b, int64_t n) {
  if (!known(dt)) return FSDP_CU_REFUSE("where", dt);
  if (n <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  const unsigned g = blocks_for(n);
  const uint8_t *c = (const uint8_t *)cond;
  switch (fsdp_dtype_size(dt)) { /* elements are copied as they are stored */
  case 1: where_k<<<g, THREADS, 0, s>>>((uint8_t *)out, c, (const uint8_t *)a, (const uint8_t *)b, n); break;
  case 2: where_k<<<g, THREADS, 0, s>>>((uint16_t *)out, c, (const uint16_t *)a, (const uint16_t *)b, n); break;
  case 4: where_k<<<g, THREADS, 0, s>>>((uint32_t *)out, c, (const uint32_t *)a, (const uint32_t *)b, n); break;
  default: where_k<<<g, THREADS, 0, s>>>((uint64_t *)out, c, (const uint64_t *)a, (const uint64_t *)b, n);
  }
  return fsdp_cuda_launched("where");
}

/* ---- dropout ------------------------------------------------------------------------------------- */

/* One thread per Philox block: the uniforms of elements first + i, as the cpu's
 * fsdp_rng_uniform draws them; mask = u >= p ? 1 / (1 - p) : 0 in f32, out = in * mask. */
template <typename T>
__global__ void dropout_k(T *out, T *mask, const T *in, int64_t n, float p, float scale,
                          uint64_t first, uint64_t block0, int64_t nblocks, uint32_t k0,
                          uint32_t k1) {
  FSDP_CU_LOOP(t, nblocks) {
    const uint64_t block = block0 + (uint64_t)t;
    const bool keep_all = p <= 0.0f; /* u >= 0 always holds: the mask is all ones */
    uint32_t r[4] = {0, 0, 0, 0};
    if (!keep_all) fsdp_x_philox(r, block, k0, k1);
    for (int l = 0; l < 4; l++) {
      const uint64_t e = block * 4 + (uint64_t)l;
      if (e < first || e - first >= (uint64_t)n) continue;
      const int64_t i = (int64_t)(e - first);
      const float x = to_f(in[i]);
      if (keep_all) {
        mask[i] = from_f<T>(1.0f);
        out[i] = from_f<T>(x);
        continue;
      }
      const float mk = fsdp_x_uniform(r[l]) >= p ? scale : 0.0f;
      mask[i] = from_f<T>(mk);
      out[i] = from_f<T>(XF_MUL(x, mk));
    }
  }
}

int fsdp_cuda_dropout_forward(void *ctx, fsdp_dtype dt, void *out, void *mask, const void *in,
                              int64_t n, float p, uint64_t key, uint64_t first) {
  if (!is_f32_family(dt)) return FSDP_CU_REFUSE("dropout", dt);
  if (n <= 0) return FSDP_OK;
  const float scale = p >= 1.0f ? 0.0f : 1.0f / (1.0f - p);
  const uint64_t block0 = first >> 2, last = (first + (uint64_t)n - 1) >> 2;
  const int64_t nblocks = (int64_t)(last - block0 + 1);
  cudaStream_t s = fsdp_cuda_stream();
  return with_float_family(dt, [&](auto tag) {
    using T = decltype(tag);
    dropout_k<T><<<blocks_for(nblocks), THREADS, 0, s>>>((T *)out, (T *)mask, (const T *)in, n,
                                                         p, scale, first, block0, nblocks,
                                                         (uint32_t)key, (uint32_t)(key >> 32));
    return fsdp_cuda_launched("dropout");
  });
}

template <typename T>
__global__ void dropout_bw_k(T *din, const T *dout, const T *mask, int64_t n) {
  FSDP_CU_LOOP(i, n) din[i] = from_f<T>(XF_ADD(to_f(din[i]), XF_MUL(to_f(dout[i]), to_f(mask[i]))));
}

int fsdp_cuda_dropout_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                               const void *mask, int64_t n) {
  if (!is_f32_family(dt)) return FSDP_CU_REFUSE("dropout", dt);
  if (n <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  return with_float_family(dt, [&](auto tag) {
    using T = decltype(tag);
    dropout_bw_k<T><<<blocks_for(n), THREADS, 0, s>>>((T *)din, (const T *)dout,
                                                      (const T *)mask, n);
    return fsdp_cuda_launched("dropout");
  });
}
