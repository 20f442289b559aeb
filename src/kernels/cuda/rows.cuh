/*
 * rows.cuh — private to blas.cu, norm.cu, loss.cu and embed.cu: element access for the float
 * dtypes, warp and block reductions, launch sizes, index loads and the deterministic column sum
 * that linear's bias gradient and layernorm's weight gradients share.
 *
 * Everything here is static or a template, so each file gets its own copy and no symbol leaves
 * it. Arithmetic is f32 (bf16 and f16 are widened on load and rounded once on store, to nearest
 * even); sums that run over many rows or elements (column sums, the losses' means) accumulate
 * in double, as the cpu kernels do.
 *
 * Reductions are fixed-order trees (shuffles, then shared memory), so a kernel's result depends
 * on its inputs and launch sizes only: no atomics anywhere in these files.
 */
#ifndef FSDP_KERNELS_CUDA_ROWS_CUH
#define FSDP_KERNELS_CUDA_ROWS_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "kernels/cuda/cuda.h"

/* ---- element access: f32 arithmetic for every float dtype ------------------------------------ */

static __device__ __forceinline__ float ldf(const float *p, int64_t i) { return p[i]; }
static __device__ __forceinline__ float ldf(const __nv_bfloat16 *p, int64_t i) {
  return __bfloat162float(p[i]);
}
static __device__ __forceinline__ float ldf(const __half *p, int64_t i) {
  return __half2float(p[i]);
}

static __device__ __forceinline__ void stf(float *p, int64_t i, float v) { p[i] = v; }
static __device__ __forceinline__ void stf(__nv_bfloat16 *p, int64_t i, float v) {
  p[i] = __float2bfloat16(v);
}
static __device__ __forceinline__ void stf(__half *p, int64_t i, float v) {
  p[i] = __float2half(v);
}

/* ---- reductions ------------------------------------------------------------------------------ */

/* Butterfly (xor) shuffles: every lane ends with the same bits, since each step only swaps the
 * operands of an addition. */
template <typename T> static __device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

static __device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/* The sum of v over the block (blockDim.x a multiple of 32, at most 1024), returned to every
 * thread. `sh` is 32 elements of shared memory; every thread of the block must call. */
template <typename T> static __device__ T block_sum(T v, T *sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nwarps ? sh[lane] : T(0);
    v = warp_sum(v);
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  v = sh[0];
  __syncthreads(); /* sh is free for the next call */
  return v;
}

/* The maximum over the block (NaN is dropped by fmaxf unless every value is NaN; callers that
 * must propagate NaN see it again in their sums). */
static __device__ float block_max(float v, float *sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nwarps ? sh[lane] : -INFINITY;
    v = warp_max(v);
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  v = sh[0];
  __syncthreads();
  return v;
}

/* A row's maximum and the sum of exp(x - max) over its n elements: the stable softmax's two
 * passes. Every thread of the block must call; each gets both. */
template <typename T>
static __device__ float row_max_sumexp(const T *x, int n, float *sh, float *sumexp) {
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, ldf(x, i));
  mx = block_max(mx, sh);
  float s = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += expf(ldf(x, i) - mx);
  *sumexp = block_sum(s, sh);
  return mx;
}

/* ---- launch sizes ---------------------------------------------------------------------------- */

/* Threads for one block per row of C elements: a few elements per thread, a multiple of 32. */
static inline int row_threads(int64_t C) {
  if (C <= 128) return 32;
  if (C <= 512) return 128;
  if (C <= 2048) return 256;
  if (C <= 8192) return 512;
  return 1024;
}

/* Blocks for n independent items (rows) taken in a grid-stride loop: every item gets a block up
 * to the cap, so any count works. */
static inline unsigned grid_for(int64_t n) {
  const int64_t cap = (int64_t)1 << 20;
  return (unsigned)(n < 1 ? 1 : n < cap ? n : cap);
}

/* Blocks of `threads` for n elements in a grid-stride loop. */
static inline unsigned grid_elems(int64_t n, int threads) {
  return grid_for((n + threads - 1) / threads);
}

/* ---- indices --------------------------------------------------------------------------------- */

/* Element i of an index buffer (ids, targets) of dtype dt, as an integer: floats hold integers
 * (the callers check them); a value no int64 holds (NaN, huge) reads as INT64_MIN, which no
 * row or class has. */
static __device__ __forceinline__ int64_t ld_index(const void *p, fsdp_dtype dt, int64_t i) {
  double v;
  switch (dt) {
  case FSDP_DTYPE_I64: return ((const int64_t *)p)[i];
  case FSDP_DTYPE_I32: return ((const int32_t *)p)[i];
  case FSDP_DTYPE_U8: return ((const uint8_t *)p)[i];
  case FSDP_DTYPE_BOOL: return ((const uint8_t *)p)[i] != 0;
  case FSDP_DTYPE_F32: v = ((const float *)p)[i]; break;
  case FSDP_DTYPE_F64: v = ((const double *)p)[i]; break;
  case FSDP_DTYPE_BF16: v = __bfloat162float(((const __nv_bfloat16 *)p)[i]); break;
  case FSDP_DTYPE_F16: v = __half2float(((const __half *)p)[i]); break;
  default: return INT64_MIN;
  }
  return v >= -9.2e18 && v <= 9.2e18 ? (int64_t)v : INT64_MIN;
}

/* ---- column sums: the bias and layernorm weight gradients -----------------------------------

 * Pass 1 (colsum_partial): the rows are cut into `chunks` runs of `rpc` rows; block (x, y)
 * sums columns [32 x, 32 x + 32) over run y, each of its 8 thread rows taking every 8th row, and
 * combines the 8 partial sums in a fixed order into part[y][c] (double). Pass 2 (colsum_finish)
 * adds the runs in order and accumulates into the gradient, rounding once. With `inp` given the
 * kernel also sums g * xhat = g (x - mean) rstd (layernorm's weight gradient) into part2. */

#define COLSUM_TX 32
#define COLSUM_TY 8

typedef struct {
  int64_t chunks, rpc; /* runs of rows, rows per run */
} colsum_plan;

static inline colsum_plan colsum_plan_for(int64_t R) {
  colsum_plan p;
  p.chunks = (R + 127) / 128; /* >= 16 rows per thread row */
  if (p.chunks > 256) p.chunks = 256;
  if (p.chunks < 1) p.chunks = 1;
  p.rpc = (R + p.chunks - 1) / p.chunks;
  if (p.rpc < 1) p.rpc = 1;
  return p;
}

template <typename T>
static __global__ void colsum_partial(double *part, double *part2, const T *g, const T *inp,
                                      const float *mean, const float *rstd, int64_t R, int64_t C,
                                      int64_t rpc) {
  // part (chunks, C), part2 (chunks, C) or NULL, g (R, C), inp (R, C) or NULL, mean/rstd (R)
  __shared__ double s1[COLSUM_TY][COLSUM_TX + 1], s2[COLSUM_TY][COLSUM_TX + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = (int64_t)blockIdx.x * COLSUM_TX + tx;
  const int64_t r0 = (int64_t)blockIdx.y * rpc, r1 = r0 + rpc < R ? r0 + rpc : R;
  double a = 0.0, b = 0.0;
  if (c < C) {
    for (int64_t r = r0 + ty; r < r1; r += COLSUM_TY) {
      const float gv = ldf(g, r * C + c);
      a += (double)gv;
      if (inp) b += (double)((ldf(inp, r * C + c) - mean[r]) * rstd[r] * gv);
    }
  }
  s1[ty][tx] = a;
  s2[ty][tx] = b;
  __syncthreads();
  if (ty == 0 && c < C) {
    double sa = 0.0, sb = 0.0;
    for (int k = 0; k < COLSUM_TY; k++) {
      sa += s1[k][tx];
      sb += s2[k][tx];
    }
    if (part) part[blockIdx.y * C + c] = sa;
    if (part2) part2[blockIdx.y * C + c] = sb;
  }
}

/* out (C, G) += the sum over runs of part (chunks, C), in run order, rounded once */
template <typename G>
static __global__ void colsum_finish(G *out, const double *part, int64_t chunks, int64_t C) {
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < C;
       c += (int64_t)gridDim.x * blockDim.x) {
    double s = 0.0;
    for (int64_t k = 0; k < chunks; k++) s += part[k * C + c];
    stf(out, c, (float)((double)ldf(out, c) + s));
  }
}

/* sum (C, G) += column sums of g (R, C) and wsum (C, G) += column sums of g * xhat (inp, mean
 * and rstd given); either output may be NULL. Scratch: the runs' partial sums. */
template <typename T, typename G>
static int colsum_acc(G *sum, G *wsum, const T *g, const T *inp, const float *mean,
                      const float *rstd, int64_t R, int64_t C, const char *what) {
  if ((!sum && !wsum) || R <= 0 || C <= 0) return FSDP_OK;
  const colsum_plan p = colsum_plan_for(R);
  const size_t part_bytes = (size_t)p.chunks * (size_t)C * sizeof(double);
  const size_t bytes = part_bytes * (sum && wsum ? 2 : 1);
  void *scratch;
  if (fsdp_cuda_scratch(&scratch, bytes)) return FSDP_ERR;
  double *part = sum ? (double *)scratch : NULL;
  double *part2 = wsum ? (double *)((char *)scratch + (sum ? part_bytes : 0)) : NULL;
  cudaStream_t st = fsdp_cuda_stream();
  dim3 grid((unsigned)((C + COLSUM_TX - 1) / COLSUM_TX), (unsigned)p.chunks);
  dim3 block(COLSUM_TX, COLSUM_TY);
  colsum_partial<T><<<grid, block, 0, st>>>(part, part2, g, wsum ? inp : NULL, mean, rstd, R, C,
                                            p.rpc);
  int rc = fsdp_cuda_launched(what);
  if (!rc && sum) {
    colsum_finish<G><<<grid_elems(C, 256), 256, 0, st>>>(sum, part, p.chunks, C);
    rc = fsdp_cuda_launched(what);
  }
  if (!rc && wsum) {
    colsum_finish<G><<<grid_elems(C, 256), 256, 0, st>>>(wsum, part2, p.chunks, C);
    rc = fsdp_cuda_launched(what);
  }
  fsdp_cuda_scratch_free(scratch, bytes);
  return rc;
}

#endif
