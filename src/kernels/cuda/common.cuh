/*
 * common.cuh — private to src/kernels/cuda (C++): what the general kernels share. Element types
 * and their conversions (exactly the cpu's: exact.h), launch shapes, dtype dispatch, block
 * reductions and one deterministic reduction over a dimension (reduce_dim).
 *
 * Launches: 256 threads a block and grid-stride loops over int64 indices, with the grid capped
 * (MAX_BLOCKS), so any size works with one launch.
 */
#ifndef FSDP_KERNELS_CUDA_COMMON_CUH
#define FSDP_KERNELS_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/cuda.h"
#include "kernels/cuda/exact.h"

namespace fsdp_cu {

typedef __nv_bfloat16 bf16;
typedef __half f16;
/* bool elements: one byte, 0 or 1 (a type of its own, so that it differs from u8) */
struct b8 {
  uint8_t v;
};

constexpr int THREADS = 256;
constexpr int64_t MAX_BLOCKS = (int64_t)1 << 20;

inline unsigned blocks_for(int64_t n, int threads = THREADS) {
  int64_t b = (n + threads - 1) / threads;
  return (unsigned)(b < 1 ? 1 : b > MAX_BLOCKS ? MAX_BLOCKS : b);
}

#define FSDP_CU_LOOP(i, n)                                                                  \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (int64_t)(n);      \
       i += (int64_t)blockDim.x * gridDim.x)

/* ---- elements as f32 (the f32 family: the cpu widens bf16 / f16 exactly and rounds back to
 * nearest even) --------------------------------------------------------------------------- */

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return fsdp_x_bf16_to_f32(__bfloat16_as_ushort(x)); }
__device__ __forceinline__ float to_f(f16 x) { return fsdp_x_f16_to_f32(__half_as_ushort(x)); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float v) {
  return __ushort_as_bfloat16(fsdp_x_f32_to_bf16(v));
}
template <> __device__ __forceinline__ f16 from_f<f16>(float v) {
  return __ushort_as_half(fsdp_x_f32_to_f16(v));
}
template <> __device__ __forceinline__ double from_f<double>(float v) { return v; }

/* ---- elements as double (core's fsdp_dtype_load / fsdp_dtype_store) ----------------------- */

__device__ __forceinline__ double to_d(float x) { return x; }
__device__ __forceinline__ double to_d(bf16 x) { return to_f(x); }
__device__ __forceinline__ double to_d(f16 x) { return to_f(x); }
__device__ __forceinline__ double to_d(double x) { return x; }
__device__ __forceinline__ double to_d(int64_t x) { return (double)x; }
__device__ __forceinline__ double to_d(int32_t x) { return x; }
__device__ __forceinline__ double to_d(uint8_t x) { return x; }
__device__ __forceinline__ double to_d(b8 x) { return x.v != 0; }

/* truncated toward zero and clamped; NaN -> 0 */
__device__ __forceinline__ double to_int(double v, double lo, double hi) {
  if (v != v) return 0;
  v = trunc(v);
  return v < lo ? lo : v > hi ? hi : v;
}

template <typename T> __device__ __forceinline__ T from_d(double v);
template <> __device__ __forceinline__ float from_d<float>(double v) { return (float)v; }
template <> __device__ __forceinline__ bf16 from_d<bf16>(double v) { return from_f<bf16>((float)v); }
template <> __device__ __forceinline__ f16 from_d<f16>(double v) { return from_f<f16>((float)v); }
template <> __device__ __forceinline__ double from_d<double>(double v) { return v; }
template <> __device__ __forceinline__ int64_t from_d<int64_t>(double v) {
  return (int64_t)to_int(v, -9223372036854775808.0, 9223372036854774784.0);
}
template <> __device__ __forceinline__ int32_t from_d<int32_t>(double v) {
  return (int32_t)to_int(v, -2147483648.0, 2147483647.0);
}
template <> __device__ __forceinline__ uint8_t from_d<uint8_t>(double v) {
  return (uint8_t)to_int(v, 0, 255);
}
template <> __device__ __forceinline__ b8 from_d<b8>(double v) { return b8{(uint8_t)(v != 0)}; }

/* i64 elements also carry their exact value, which orders doubles that compare equal (the cpu's
 * exact_i64); 0 for the other types */
__device__ __forceinline__ int64_t exact_i64(int64_t x) { return x; }
template <typename T> __device__ __forceinline__ int64_t exact_i64(T) { return 0; }

/* ---- dtype dispatch: f(T{}) for the element type of dt ------------------------------------- */

inline bool is_half(fsdp_dtype dt) { return dt == FSDP_DTYPE_BF16 || dt == FSDP_DTYPE_F16; }
inline bool is_f32_family(fsdp_dtype dt) { return dt == FSDP_DTYPE_F32 || is_half(dt); }
inline bool is_int(fsdp_dtype dt) {
  return dt == FSDP_DTYPE_I64 || dt == FSDP_DTYPE_I32 || dt == FSDP_DTYPE_U8;
}
inline bool known(fsdp_dtype dt) { return (unsigned)dt < FSDP_DTYPE_COUNT; }

template <typename F> int with_float_family(fsdp_dtype dt, F &&f) {
  switch (dt) {
  case FSDP_DTYPE_F32: return f(float{});
  case FSDP_DTYPE_BF16: return f(bf16{});
  default: return f(f16{});
  }
}

template <typename F> int with_float(fsdp_dtype dt, F &&f) {
  return is_f32_family(dt) ? with_float_family(dt, f) : f(double{});
}

template <typename F> int with_int(fsdp_dtype dt, F &&f) {
  switch (dt) {
  case FSDP_DTYPE_I64: return f(int64_t{});
  case FSDP_DTYPE_I32: return f(int32_t{});
  default: return f(uint8_t{});
  }
}

template <typename F> int with_any(fsdp_dtype dt, F &&f) {
  if (is_f32_family(dt) || dt == FSDP_DTYPE_F64) return with_float(dt, f);
  return is_int(dt) ? with_int(dt, f) : f(b8{});
}

#define FSDP_CU_REFUSE(op, dt) fsdp_kernels_refuse(op, dt, "cuda")

/* ---- block reductions ------------------------------------------------------------------------ */

/* The sum of v over the block, in thread 0 (a fixed tree: the same bits every run).
 * blockDim.x is a multiple of 32, at most 1024. */
template <typename Acc> __device__ Acc block_sum(Acc v) {
  __shared__ Acc warp_sums[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (lane == 0) warp_sums[w] = v;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  v = threadIdx.x < nw ? warp_sums[threadIdx.x] : Acc(0);
  if (w == 0)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  __syncthreads(); /* warp_sums may be reused by the next call */
  return v;
}

/* ---- reduce_dim: out(o, j) = sum over r of term(o, r, j), in Acc, in a fixed order --------------
 * The layout is (outer, R, inner). Load is a functor `Acc operator()(int64_t o, int64_t r,
 * int64_t j) const`, Store `void operator()(int64_t o, int64_t j, Acc total) const`. Acc is
 * double (floats) or uint64_t (counts, wrapping integer sums). No atomics: long R is cut into
 * chunks whose partial sums a second pass adds in chunk order; the cut depends on the sizes
 * only, so results repeat bit for bit. */

template <typename Acc, typename Load, typename Store>
__global__ void rows_pass1(int64_t rows, int64_t R, int64_t C, int64_t RC, Load load,
                           Store store, Acc *partial) {
  // one block per (row, chunk); a row is contiguous (inner == 1)
  for (int64_t blk = blockIdx.x; blk < rows * C; blk += gridDim.x) {
    const int64_t o = blk / C, c = blk % C;
    const int64_t r0 = c * RC, r1 = r0 + RC < R ? r0 + RC : R;
    Acc acc = Acc(0);
    for (int64_t r = r0 + threadIdx.x; r < r1; r += blockDim.x) acc += load(o, r, 0);
    acc = block_sum(acc);
    if (threadIdx.x == 0) {
      if (C == 1) store(o, 0, acc);
      else partial[blk] = acc;
    }
  }
}

template <typename Acc, typename Load, typename Store>
__global__ void cols_pass1(int64_t outer, int64_t R, int64_t inner, int64_t C, int64_t RC,
                           Load load, Store store, Acc *partial) {
  // one thread per (o, chunk, j), j fastest: neighbouring threads read neighbouring elements
  FSDP_CU_LOOP(t, outer * C * inner) {
    const int64_t j = t % inner, oc = t / inner, o = oc / C, c = oc % C;
    const int64_t r0 = c * RC, r1 = r0 + RC < R ? r0 + RC : R;
    Acc acc = Acc(0);
    for (int64_t r = r0; r < r1; r++) acc += load(o, r, j);
    if (C == 1) store(o, j, acc);
    else partial[t] = acc;
  }
}

template <typename Acc, typename Store>
__global__ void chunks_pass2(int64_t outer, int64_t inner, int64_t C, const Acc *partial,
                             Store store) {
  FSDP_CU_LOOP(t, outer * inner) {
    const int64_t o = t / inner, j = t % inner;
    Acc acc = Acc(0);
    for (int64_t c = 0; c < C; c++) acc += partial[(o * C + c) * inner + j];
    store(o, j, acc);
  }
}

template <typename Acc, typename Store> __global__ void store_zero(int64_t n, int64_t inner, Store store) {
  FSDP_CU_LOOP(t, n) store(t / inner, t % inner, Acc(0));
}

template <typename Acc, typename Load, typename Store>
int reduce_dim(int64_t outer, int64_t R, int64_t inner, Load load, Store store,
               const char *what) {
  cudaStream_t s = fsdp_cuda_stream();
  if (outer <= 0 || inner <= 0) return FSDP_OK;
  if (R <= 0) {
    store_zero<Acc><<<blocks_for(outer * inner), THREADS, 0, s>>>(outer * inner, inner, store);
    return fsdp_cuda_launched(what);
  }
  const bool rows = inner == 1 && R >= 256;
  int64_t C;
  if (rows) { /* blocks of 256 threads; about 1024 blocks in all when rows are few and long */
    C = outer >= 1024 ? 1 : (1024 + outer - 1) / outer;
    const int64_t most = (R + 4095) / 4096; /* at least 4096 elements a chunk */
    C = C < most ? C : most;
  } else { /* threads: about 128 Ki of them, at least 64 elements a chunk */
    const int64_t n = outer * inner;
    C = n >= 131072 ? 1 : (131072 + n - 1) / n;
    const int64_t most = (R + 63) / 64;
    C = C < most ? C : most;
  }
  if (C < 1) C = 1;
  const int64_t RC = (R + C - 1) / C;
  Acc *partial = NULL;
  const size_t pbytes = C > 1 ? (size_t)(outer * C * inner) * sizeof(Acc) : 0;
  if (pbytes && fsdp_cuda_scratch((void **)&partial, pbytes)) return FSDP_ERR;
  int rc;
  if (rows)
    rows_pass1<Acc><<<blocks_for(outer * C, 1), THREADS, 0, s>>>(outer, R, C, RC, load, store,
                                                                 partial);
  else
    cols_pass1<Acc><<<blocks_for(outer * C * inner), THREADS, 0, s>>>(outer, R, inner, C, RC,
                                                                      load, store, partial);
  rc = fsdp_cuda_launched(what);
  if (!rc && C > 1) {
    chunks_pass2<Acc><<<blocks_for(outer * inner), THREADS, 0, s>>>(outer, inner, C, partial,
                                                                    store);
    rc = fsdp_cuda_launched(what);
  }
  if (partial) fsdp_cuda_scratch_free(partial, pbytes);
  return rc;
}

/* ---- results that land in host memory ---------------------------------------------------------- */

/* host <- device bytes, after everything queued before on the thread's stream */
inline int to_host_now(void *host, const void *dev, size_t bytes, const char *what) {
  cudaStream_t s = fsdp_cuda_stream();
  if (fsdp_cuda_check(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, s), what))
    return FSDP_ERR;
  return fsdp_cuda_check(cudaStreamSynchronize(s), what);
}

} // namespace fsdp_cu

#endif
