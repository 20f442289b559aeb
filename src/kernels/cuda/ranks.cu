/*
 * ranks.cu — reduce_ranks on the cuda device: the ranks' buffers of one collective reduced
 * elementwise, for the local backend when its rank threads share a GPU (src/comm/local.c). The
 * arithmetic is the cpu's (src/kernels/cpu/ranks.c) element by element, uncontracted (exact.h),
 * so a collective gives the same bits on the GPU as on the host: a left fold over the ranks in
 * rank order in f32 (bf16 widened exactly, rounded once to nearest even at the end), f64 or
 * wrapping i64; AVG then multiplies by (float)(1.0 / n) (f32, bf16) or divides by n (f64); MAX
 * and MIN take a NaN wherever one appears. No atomics: each element is one thread's.
 *
 * The inputs' addresses travel in the launch's parameters (up to MAX_SRC pointers, 8 KiB, well
 * inside the 32 KiB a kernel's parameters may hold since CUDA 12.1), so no upload precedes the
 * launch.
 */
#include "kernels/cuda/common.cuh"

using namespace fsdp_cu;

#define MAX_SRC 1024

struct srcs {
  const void *p[MAX_SRC];
};

__device__ __forceinline__ float fold_f(float t, float b, int red) {
  if (red == FSDP_RED_MAX) return (b > t || b != b) ? b : t;
  if (red == FSDP_RED_MIN) return (b < t || b != b) ? b : t;
  return XF_ADD(t, b);
}

__device__ __forceinline__ double fold_d(double t, double b, int red) {
  if (red == FSDP_RED_MAX) return (b > t || b != b) ? b : t;
  if (red == FSDP_RED_MIN) return (b < t || b != b) ? b : t;
  return XD_ADD(t, b);
}

template <typename T>
__global__ void reduce_f_k(T *out, srcs s, int nsrc, int64_t n, int red, float scale) {
  FSDP_CU_LOOP(i, n) {
    float t = to_f(((const T *)s.p[0])[i]);
    for (int p = 1; p < nsrc; p++) t = fold_f(t, to_f(((const T *)s.p[p])[i]), red);
    if (red == FSDP_RED_AVG) t = XF_MUL(t, scale);
    out[i] = from_f<T>(t);
  }
}

__global__ void reduce_d_k(double *out, srcs s, int nsrc, int64_t n, int red) {
  FSDP_CU_LOOP(i, n) {
    double t = ((const double *)s.p[0])[i];
    for (int p = 1; p < nsrc; p++) t = fold_d(t, ((const double *)s.p[p])[i], red);
    if (red == FSDP_RED_AVG) t = XD_DIV(t, (double)nsrc);
    out[i] = t;
  }
}

__global__ void reduce_i_k(int64_t *out, srcs s, int nsrc, int64_t n, int red) {
  FSDP_CU_LOOP(i, n) {
    int64_t t = ((const int64_t *)s.p[0])[i];
    for (int p = 1; p < nsrc; p++) {
      int64_t b = ((const int64_t *)s.p[p])[i];
      if (red == FSDP_RED_MAX) t = b > t ? b : t;
      else if (red == FSDP_RED_MIN) t = b < t ? b : t;
      else t = (int64_t)((uint64_t)t + (uint64_t)b); /* wraps, as the cpu's */
    }
    out[i] = t;
  }
}

int fsdp_cuda_reduce_ranks(void *ctx, fsdp_dtype dt, fsdp_reduce_op red, void *out,
                           const void *const *src, int nsrc, int64_t n) {
  (void)ctx;
  bool ok = dt == FSDP_DTYPE_F32 || dt == FSDP_DTYPE_BF16 || dt == FSDP_DTYPE_F64 ||
            (dt == FSDP_DTYPE_I64 && red != FSDP_RED_AVG);
  if (!ok || (unsigned)red > FSDP_RED_MIN) return FSDP_CU_REFUSE("reduce_ranks", dt);
  if (nsrc < 1 || nsrc > MAX_SRC)
    return fsdp_error("reduce_ranks: %d inputs on cuda (1 to %d: ranks sharing one GPU)", nsrc,
                      MAX_SRC);
  if (n <= 0) return FSDP_OK;
  srcs s;
  for (int p = 0; p < nsrc; p++) s.p[p] = src[p];
  cudaStream_t st = fsdp_cuda_stream();
  if (!st) return FSDP_ERR;
  const float scale = (float)(1.0 / nsrc);
  switch (dt) {
  case FSDP_DTYPE_F32:
    reduce_f_k<float><<<blocks_for(n), THREADS, 0, st>>>((float *)out, s, nsrc, n, red, scale);
    break;
  case FSDP_DTYPE_BF16:
    reduce_f_k<bf16><<<blocks_for(n), THREADS, 0, st>>>((bf16 *)out, s, nsrc, n, red, scale);
    break;
  case FSDP_DTYPE_F64:
    reduce_d_k<<<blocks_for(n), THREADS, 0, st>>>((double *)out, s, nsrc, n, red);
    break;
  default:
    reduce_i_k<<<blocks_for(n), THREADS, 0, st>>>((int64_t *)out, s, nsrc, n, red);
    break;
  }
  return fsdp_cuda_launched("reduce_ranks");
}
