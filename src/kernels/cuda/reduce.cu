/*
 * reduce.cu — reductions and index kernels on the cuda device: check_index, sum / mean, sumsq,
 * sum over a dim and its backward, max / min over a dim, topk (a sort along a dim),
 * index_add over a dim.
 *
 * Sums accumulate in double (integers in wrapping int64, as the cpu) through reduce_dim
 * (common.cuh): fixed chunking, block trees, no atomics, so results repeat bit for bit; they
 * can differ from the cpu's in the last bits of the double (another summation order), which
 * after rounding to f32 is almost never visible. max / min and the first bad index reduce with
 * an order-independent combine (ties to the lower index, the first NaN wins), so they are the
 * cpu's exactly. topk sorts with CUB's stable segmented sort on keys that order like the cpu's
 * comparison (NaN largest, -0 == +0, i64 exact). index_add adds each destination's sources in
 * the cpu's order, one thread per destination column; only outside deterministic mode, and only
 * when there are few columns and many sources, it adds with atomics instead.
 */
#include <cub/device/device_segmented_sort.cuh>

#include "kernels/cuda/common.cuh"

using namespace fsdp_cu;

/* ---- the first index where a predicate holds ---------------------------------------------------- */

constexpr int64_t NONE = INT64_MAX;

__device__ __forceinline__ int64_t block_min(int64_t v) {
  __shared__ int64_t warp_min[32];
  for (int o = 16; o > 0; o >>= 1) {
    const int64_t w = __shfl_down_sync(0xffffffffu, v, o);
    v = w < v ? w : v;
  }
  if ((threadIdx.x & 31) == 0) warp_min[threadIdx.x >> 5] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? warp_min[threadIdx.x] : NONE;
  if (threadIdx.x < 32)
    for (int o = 16; o > 0; o >>= 1) {
      const int64_t w = __shfl_down_sync(0xffffffffu, v, o);
      v = w < v ? w : v;
    }
  __syncthreads();
  return v;
}

template <typename Pred> __global__ void first_pass1(int64_t n, Pred bad, int64_t *partial) {
  int64_t first = NONE;
  FSDP_CU_LOOP(i, n) {
    if (bad(i)) { /* i only grows: the thread's first */
      first = i;
      break;
    }
  }
  first = block_min(first);
  if (threadIdx.x == 0) partial[blockIdx.x] = first;
}

__global__ void first_pass2(int64_t nb, const int64_t *partial, int64_t *out) {
  int64_t first = NONE;
  for (int64_t b = threadIdx.x; b < nb; b += blockDim.x) first = partial[b] < first ? partial[b] : first;
  first = block_min(first);
  if (threadIdx.x == 0) *out = first;
}

/* *at (host) = the first i < n where bad(i), -1 when none */
template <typename Pred> static int first_where(int64_t n, Pred bad, int64_t *at, const char *what) {
  *at = -1;
  if (n <= 0) return FSDP_OK;
  const unsigned nb = blocks_for(n) < 1024 ? blocks_for(n) : 1024;
  int64_t *buf;
  const size_t bytes = (nb + 1) * sizeof(int64_t);
  if (fsdp_cuda_scratch((void **)&buf, bytes)) return FSDP_ERR;
  cudaStream_t s = fsdp_cuda_stream();
  first_pass1<<<nb, THREADS, 0, s>>>(n, bad, buf + 1);
  int rc = fsdp_cuda_launched(what);
  if (!rc) {
    first_pass2<<<1, THREADS, 0, s>>>(nb, buf + 1, buf);
    rc = fsdp_cuda_launched(what);
  }
  int64_t v = NONE;
  if (!rc) rc = to_host_now(&v, buf, sizeof v, what);
  fsdp_cuda_scratch_free(buf, bytes);
  if (!rc && v != NONE) *at = v;
  return rc;
}

/* ---- check_index --------------------------------------------------------------------------------- */

template <typename T> struct bad_int_index {
  const T *ids;
  int64_t lo, hi, ignore;
  bool has_ignore;
  __device__ bool operator()(int64_t i) const {
    const int64_t v = ids[i];
    return !((has_ignore && v == ignore) || (v >= lo && v < hi));
  }
};

/* floats (and u8) holding integers, compared as doubles */
template <typename T> struct bad_float_index {
  const T *ids;
  double lo, hi, ignore;
  bool has_ignore;
  __device__ bool operator()(int64_t i) const {
    const double x = to_d(ids[i]);
    if (has_ignore && x == ignore) return false;
    return !(x >= lo && x < hi) || x != floor(x);
  }
};

int fsdp_cuda_check_index(void *ctx, fsdp_dtype idt, const void *ids, int64_t n, int64_t lo,
                          int64_t hi, const int64_t *ignore, int64_t *bad, double *bad_value) {
  *bad = -1;
  const bool ints = idt == FSDP_DTYPE_I64 || idt == FSDP_DTYPE_I32;
  if (!ints && !(known(idt) && fsdp_dtype_is_float(idt)) && idt != FSDP_DTYPE_U8)
    return FSDP_CU_REFUSE("index", idt);
  int64_t at = -1;
  int rc;
  const bool has_ig = ignore != NULL;
  const int64_t ig = ignore ? *ignore : 0;
  if (idt == FSDP_DTYPE_I64)
    rc = first_where(n, bad_int_index<int64_t>{(const int64_t *)ids, lo, hi, ig, has_ig}, &at, "index");
  else if (idt == FSDP_DTYPE_I32)
    rc = first_where(n, bad_int_index<int32_t>{(const int32_t *)ids, lo, hi, ig, has_ig}, &at, "index");
  else
    rc = with_any(idt, [&](auto tag) {
      using T = decltype(tag);
      return first_where(n, bad_float_index<T>{(const T *)ids, (double)lo, (double)hi,
                                              (double)ig, has_ig}, &at, "index");
    });
  if (rc || at < 0) return rc;
  unsigned char v[8];
  const size_t es = fsdp_dtype_size(idt);
  if (to_host_now(v, (const char *)ids + (size_t)at * es, es, "index")) return FSDP_ERR;
  *bad = at;
  *bad_value = fsdp_dtype_load(v, idt, 0);
  return FSDP_OK;
}

/* ---- sum, mean, sumsq ---------------------------------------------------------------------------- */

/* terms (o, r, j) of a dense (outer, R, inner) buffer */
template <typename T> struct term_d { /* the value as a double */
  const T *x;
  int64_t R, inner;
  __device__ double operator()(int64_t o, int64_t r, int64_t j) const {
    return to_d(x[(o * R + r) * inner + j]);
  }
};

template <typename T> struct term_sq { /* its square, in double */
  const T *x;
  __device__ double operator()(int64_t, int64_t r, int64_t) const {
    const double v = to_d(x[r]);
    return XD_MUL(v, v);
  }
};

template <typename T> struct term_i64 { /* integers: wrapping int64 */
  const T *x;
  int64_t R, inner;
  __device__ uint64_t operator()(int64_t o, int64_t r, int64_t j) const {
    return (uint64_t)(int64_t)x[(o * R + r) * inner + j];
  }
};

template <typename T> struct store_sum {
  T *out;
  int64_t n;
  bool mean;
  __device__ void operator()(int64_t, int64_t, double s) const {
    out[0] = from_d<T>(mean ? (n ? XD_DIV(s, (double)n) : (double)NAN) : s);
  }
};

struct store_i64 {
  int64_t *out;
  int64_t inner;
  __device__ void operator()(int64_t o, int64_t j, uint64_t s) const {
    out[o * inner + j] = (int64_t)s;
  }
};

struct store_double {
  double *out;
  __device__ void operator()(int64_t, int64_t, double s) const { out[0] = s; }
};

int fsdp_cuda_sum(void *ctx, fsdp_dtype dt, void *out, const void *in, int64_t n, bool mean) {
  if (dt == FSDP_DTYPE_BOOL || !known(dt) || (mean && !fsdp_dtype_is_float(dt)))
    return FSDP_CU_REFUSE(mean ? "mean" : "sum", dt);
  const char *what = mean ? "mean" : "sum";
  if (is_int(dt)) /* into an i64, wrapping like the i64 add: exact beyond 2^53 */
    return with_int(dt, [&](auto tag) {
      using T = decltype(tag);
      return reduce_dim<uint64_t>(1, n, 1, term_i64<T>{(const T *)in, n, 1},
                                  store_i64{(int64_t *)out, 1}, what);
    });
  return with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    return reduce_dim<double>(1, n, 1, term_d<T>{(const T *)in, n, 1},
                              store_sum<T>{(T *)out, n, mean}, what);
  });
}

int fsdp_cuda_sumsq(void *ctx, fsdp_dtype dt, double *host_out, const void *in, int64_t n) {
  if (!known(dt) || !fsdp_dtype_is_float(dt)) return FSDP_CU_REFUSE("sumsq", dt);
  double *d;
  if (fsdp_cuda_scratch((void **)&d, sizeof *d)) return FSDP_ERR;
  int rc = with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    return reduce_dim<double>(1, n, 1, term_sq<T>{(const T *)in}, store_double{d}, "sumsq");
  });
  if (!rc) rc = to_host_now(host_out, d, sizeof *host_out, "sumsq");
  fsdp_cuda_scratch_free(d, sizeof *d);
  return rc;
}

/* ---- sum over a dim ------------------------------------------------------------------------------ */

/* f32 family: the double sum rounded to f32, then scaled in f32 (the cpu's order) */
template <typename T> struct store_dim_f {
  T *out;
  int64_t inner;
  float scale;
  bool scaled;
  __device__ void operator()(int64_t o, int64_t j, double s) const {
    float v = (float)s;
    if (scaled) v = XF_MUL(v, scale);
    out[o * inner + j] = from_f<T>(v);
  }
};

/* f64 and the integers: the double sum scaled in double */
template <typename T> struct store_dim_d {
  T *out;
  int64_t inner;
  double scale;
  __device__ void operator()(int64_t o, int64_t j, double s) const {
    out[o * inner + j] = from_d<T>(XD_MUL(s, scale));
  }
};

int fsdp_cuda_sum_dim_forward(void *ctx, fsdp_dtype dt, void *out, const void *in, int64_t outer,
                              int64_t R, int64_t inner, double scale) {
  if (dt == FSDP_DTYPE_BOOL || !known(dt)) return FSDP_CU_REFUSE("sum", dt);
  if (dt == FSDP_DTYPE_I64 && scale == 1.0) /* exact beyond 2^53, as the i64 add */
    return reduce_dim<uint64_t>(outer, R, inner, term_i64<int64_t>{(const int64_t *)in, R, inner},
                                store_i64{(int64_t *)out, inner}, "sum");
  if (is_f32_family(dt))
    return with_float_family(dt, [&](auto tag) {
      using T = decltype(tag);
      return reduce_dim<double>(outer, R, inner, term_d<T>{(const T *)in, R, inner},
                                store_dim_f<T>{(T *)out, inner, (float)scale, scale != 1.0},
                                "sum");
    });
  return with_any(dt, [&](auto tag) {
    using T = decltype(tag);
    return reduce_dim<double>(outer, R, inner, term_d<T>{(const T *)in, R, inner},
                              store_dim_d<T>{(T *)out, inner, scale}, "sum");
  });
}

template <typename T>
__global__ void sum_dim_bw_k(T *din, const T *dout, int64_t outer, int64_t R, int64_t inner,
                             float sf, double sd) {
  FSDP_CU_LOOP(i, outer * R * inner) {
    const int64_t j = i % inner, o = i / (R * inner);
    if constexpr (sizeof(T) == 8)
      din[i] = from_d<T>(XD_ADD(to_d(din[i]), XD_MUL(sd, to_d(dout[o * inner + j]))));
    else
      din[i] = from_f<T>(XF_ADD(to_f(din[i]), XF_MUL(sf, to_f(dout[o * inner + j]))));
  }
}

int fsdp_cuda_sum_dim_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                               int64_t outer, int64_t R, int64_t inner, double scale) {
  if (!known(dt) || !fsdp_dtype_is_float(dt)) return FSDP_CU_REFUSE("sum", dt);
  const int64_t n = outer * R * inner;
  if (n <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  return with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    sum_dim_bw_k<T><<<blocks_for(n), THREADS, 0, s>>>((T *)din, (const T *)dout, outer, R, inner,
                                                      (float)scale, scale);
    return fsdp_cuda_launched("sum");
  });
}

/* ---- max / min over a dim -------------------------------------------------------------------- */

/* a candidate: its value (double), exact i64 value, index; r < 0: none */
struct cand {
  double v;
  int64_t e, r;
};

/* the better of two candidates: a NaN beats any number, then the larger (max) or smaller
 * value, then the lower index — an order-independent rule, equal to the cpu's scan */
__device__ __forceinline__ cand better(cand a, cand b, bool max) {
  if (a.r < 0) return b;
  if (b.r < 0) return a;
  const bool an = a.v != a.v, bn = b.v != b.v;
  if (an || bn) return an && bn ? (a.r < b.r ? a : b) : an ? a : b;
  int c = a.v != b.v ? (a.v < b.v ? -1 : 1) : (a.e < b.e ? -1 : a.e > b.e);
  if (!max) c = -c;
  return c > 0 ? a : c < 0 ? b : (a.r < b.r ? a : b);
}

template <typename T>
__device__ __forceinline__ void extreme_store(void *values, int64_t *index, const T *in,
                                              int64_t o, int64_t R, int64_t inner, int64_t j,
                                              int64_t best) {
  if (values) ((T *)values)[o * inner + j] = in[(o * R + best) * inner + j]; /* as stored */
  if (index) index[o * inner + j] = best;
}

/* one thread per (o, j), scanning r in order */
template <typename T>
__global__ void extreme_cols_k(void *values, int64_t *index, const T *in, int64_t outer,
                               int64_t R, int64_t inner, bool max) {
  FSDP_CU_LOOP(t, outer * inner) {
    const int64_t o = t / inner, j = t % inner;
    cand best = {0, 0, -1};
    for (int64_t r = 0; r < R; r++) {
      const T x = in[(o * R + r) * inner + j];
      best = better(best, cand{to_d(x), exact_i64(x), r}, max);
      if (best.v != best.v) break; /* the first NaN wins */
    }
    extreme_store(values, index, in, o, R, inner, j, best.r);
  }
}

/* one block per row (inner == 1): threads take strided elements, then a tree of `better` */
template <typename T>
__global__ void extreme_rows_k(void *values, int64_t *index, const T *in, int64_t outer,
                               int64_t R, bool max) {
  __shared__ cand warp_best[32];
  for (int64_t o = blockIdx.x; o < outer; o += gridDim.x) {
    cand best = {0, 0, -1};
    for (int64_t r = threadIdx.x; r < R; r += blockDim.x) {
      const T x = in[o * R + r];
      best = better(best, cand{to_d(x), exact_i64(x), r}, max);
    }
    for (int s = 16; s > 0; s >>= 1) {
      cand other = {__shfl_down_sync(0xffffffffu, best.v, s),
                    __shfl_down_sync(0xffffffffu, best.e, s),
                    __shfl_down_sync(0xffffffffu, best.r, s)};
      best = better(best, other, max);
    }
    if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < (int)(blockDim.x >> 5); w++) best = better(best, warp_best[w], max);
      extreme_store(values, index, in, o, R, 1, 0, best.r);
    }
    __syncthreads();
  }
}

int fsdp_cuda_extreme_dim(void *ctx, fsdp_dtype dt, bool max, void *values, int64_t *index,
                          const void *in, int64_t outer, int64_t R, int64_t inner) {
  if (!known(dt)) return FSDP_CU_REFUSE(max ? "max" : "min", dt);
  if (outer <= 0 || inner <= 0 || R <= 0 || (!values && !index)) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  return with_any(dt, [&](auto tag) {
    using T = decltype(tag);
    if (inner == 1 && R >= 1024)
      extreme_rows_k<T><<<blocks_for(outer, 1), THREADS, 0, s>>>(values, index, (const T *)in,
                                                                 outer, R, max);
    else
      extreme_cols_k<T><<<blocks_for(outer * inner), THREADS, 0, s>>>(values, index,
                                                                      (const T *)in, outer, R,
                                                                      inner, max);
    return fsdp_cuda_launched(max ? "max" : "min");
  });
}

/* ---- topk ----------------------------------------------------------------------------------------- */

/* A key whose unsigned order is the cpu's order of values: NaN above everything, -0 == +0,
 * doubles by their bits made monotonic, integers exact. */
template <typename T> __device__ __forceinline__ uint64_t sort_key(T x) {
  double d = to_d(x);
  if (d != d) return ~(uint64_t)0;
  if (d == 0) d = 0; /* -0 sorts with +0 */
  const uint64_t u = fsdp_x_f64_bits(d);
  return u >> 63 ? ~u : u | ((uint64_t)1 << 63);
}
template <> __device__ __forceinline__ uint64_t sort_key<int64_t>(int64_t x) {
  return (uint64_t)x ^ ((uint64_t)1 << 63);
}
template <> __device__ __forceinline__ uint64_t sort_key<int32_t>(int32_t x) {
  return (uint64_t)(int64_t)x ^ ((uint64_t)1 << 63);
}
template <> __device__ __forceinline__ uint64_t sort_key<uint8_t>(uint8_t x) { return x; }
template <> __device__ __forceinline__ uint64_t sort_key<b8>(b8 x) { return x.v != 0; }

/* keys and positions in segment order: segment (o, j) holds r = 0..R-1 */
template <typename T>
__global__ void topk_keys_k(uint64_t *keys, int32_t *pos, int64_t *offsets, const T *in,
                            int64_t outer, int64_t R, int64_t inner) {
  const int64_t segs = outer * inner;
  FSDP_CU_LOOP(t, segs * R) {
    const int64_t seg = t / R, r = t % R, o = seg / inner, j = seg % inner;
    keys[t] = sort_key(in[(o * R + r) * inner + j]);
    pos[t] = (int32_t)r;
    if (r == 0) offsets[seg] = t;
    if (t == segs * R - 1) offsets[segs] = segs * R;
  }
}

template <typename T>
__global__ void topk_out_k(T *values, int64_t *index, const int32_t *pos, const T *in,
                           int64_t outer, int64_t R, int64_t inner, int64_t k) {
  FSDP_CU_LOOP(t, outer * inner * k) {
    const int64_t seg = t / k, q = t % k, o = seg / inner, j = seg % inner;
    const int64_t r = pos[seg * R + q], at = (o * k + q) * inner + j;
    if (values) values[at] = in[(o * R + r) * inner + j];
    if (index) index[at] = r;
  }
}

int fsdp_cuda_topk(void *ctx, fsdp_dtype dt, void *values, int64_t *index, const void *in,
                   int64_t outer, int64_t R, int64_t inner, int64_t k, bool largest) {
  if (!known(dt)) return FSDP_CU_REFUSE("topk", dt);
  if (outer <= 0 || inner <= 0 || R <= 0 || k <= 0 || (!values && !index)) return FSDP_OK;
  if (k > R) return fsdp_error("topk: k = %lld of %lld elements", (long long)k, (long long)R);
  if (R > INT32_MAX)
    return fsdp_error("topk: %lld elements along the dim (the cuda device sorts up to 2^31 - 1)",
                      (long long)R);
  const int64_t segs = outer * inner, n = segs * R;
  cudaStream_t s = fsdp_cuda_stream();
  /* scratch: keys in and out, positions in and out, segment offsets, then CUB's own */
  const size_t kb = (size_t)n * 8, pb = ((size_t)n * 4 + 7) / 8 * 8, ob = (size_t)(segs + 1) * 8;
  size_t temp = 0;
  const uint64_t *nk = NULL;
  const int32_t *np = NULL;
  const int64_t *no = NULL;
  cudaError_t e =
      largest ? cub::DeviceSegmentedSort::StableSortPairsDescending(
                    NULL, temp, nk, (uint64_t *)NULL, np, (int32_t *)NULL, n, segs, no, no + 1, s)
              : cub::DeviceSegmentedSort::StableSortPairs(
                    NULL, temp, nk, (uint64_t *)NULL, np, (int32_t *)NULL, n, segs, no, no + 1,
                    s);
  if (fsdp_cuda_check(e, "topk")) return FSDP_ERR;
  const size_t bytes = 2 * kb + 2 * pb + ob + temp;
  char *buf;
  if (fsdp_cuda_scratch((void **)&buf, bytes)) return FSDP_ERR;
  uint64_t *kin = (uint64_t *)buf, *kout = (uint64_t *)(buf + kb);
  int32_t *pin = (int32_t *)(buf + 2 * kb), *pout = (int32_t *)(buf + 2 * kb + pb);
  int64_t *off = (int64_t *)(buf + 2 * kb + 2 * pb);
  void *tmp = buf + 2 * kb + 2 * pb + ob;
  int rc = with_any(dt, [&](auto tag) {
    using T = decltype(tag);
    topk_keys_k<T><<<blocks_for(n), THREADS, 0, s>>>(kin, pin, off, (const T *)in, outer, R,
                                                     inner);
    if (fsdp_cuda_launched("topk")) return FSDP_ERR;
    size_t t = temp;
    const int64_t *co = off;
    cudaError_t err =
        largest ? cub::DeviceSegmentedSort::StableSortPairsDescending(
                      tmp, t, kin, kout, pin, pout, n, segs, co, co + 1, s)
                : cub::DeviceSegmentedSort::StableSortPairs(tmp, t, kin, kout, pin, pout, n,
                                                            segs, co, co + 1, s);
    if (fsdp_cuda_check(err, "topk")) return FSDP_ERR;
    topk_out_k<T><<<blocks_for(segs * k), THREADS, 0, s>>>((T *)values, index, pout,
                                                           (const T *)in, outer, R, inner, k);
    return fsdp_cuda_launched("topk");
  });
  fsdp_cuda_scratch_free(buf, bytes);
  return rc;
}

/* ---- index_add over a dim -------------------------------------------------------------------- */

/* one thread per (o, j): its K sources in order, each added through double (the cpu's loop) */
template <typename T>
__global__ void index_add_k(T *din, const T *dout, const int64_t *index, int64_t outer,
                            int64_t R, int64_t inner, int64_t K) {
  FSDP_CU_LOOP(t, outer * inner) {
    const int64_t o = t / inner, j = t % inner;
    for (int64_t q = 0; q < K; q++) {
      const int64_t src = (o * K + q) * inner + j, dst = (o * R + index[src]) * inner + j;
      din[dst] = from_d<T>(XD_ADD(to_d(din[dst]), to_d(dout[src])));
    }
  }
}

/* outside deterministic mode, few columns with many sources each: one thread per source */
template <typename T>
__global__ void index_add_atomic_k(T *din, const T *dout, const int64_t *index, int64_t outer,
                                   int64_t R, int64_t inner, int64_t K) {
  FSDP_CU_LOOP(src, outer * K * inner) {
    const int64_t j = src % inner, o = src / (K * inner);
    atomicAdd(&din[(o * R + index[src]) * inner + j], dout[src]);
  }
}

int fsdp_cuda_index_add_dim(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                            const int64_t *index, int64_t outer, int64_t R, int64_t inner,
                            int64_t K) {
  if (!known(dt) || !fsdp_dtype_is_float(dt)) return FSDP_CU_REFUSE("index_add", dt);
  if (outer <= 0 || inner <= 0 || K <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  const bool atomics = !fsdp_cuda_deterministic() && outer * inner < 4096 && K >= 256;
  return with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    if (atomics)
      index_add_atomic_k<T><<<blocks_for(outer * K * inner), THREADS, 0, s>>>(
          (T *)din, (const T *)dout, index, outer, R, inner, K);
    else
      index_add_k<T><<<blocks_for(outer * inner), THREADS, 0, s>>>((T *)din, (const T *)dout,
                                                                   index, outer, R, inner, K);
    return fsdp_cuda_launched("index_add");
  });
}
