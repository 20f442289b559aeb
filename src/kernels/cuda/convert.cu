/*
 * convert.cu — not yet implemented: every kernel refuses (replaced as the CUDA device lands).
 */
#include "kernels/cuda/cuda.h"

int fsdp_cuda_cast(void *ctx, void *out, fsdp_dtype odt, const void *in, fsdp_dtype idt,
                   int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("cast", odt, "cuda");
}

int fsdp_cuda_copy_strided(void *ctx, fsdp_dtype dt, void *dst, const int64_t *dst_strides,
                           const void *src, const int64_t *src_strides, int ndim,
                           const int64_t *shape) {
  (void)ctx;
  return fsdp_kernels_refuse("copy_strided", dt, "cuda");
}

int fsdp_cuda_add_strided(void *ctx, fsdp_dtype dt, void *dst, const int64_t *dst_strides,
                          const void *src, const int64_t *src_strides, int ndim,
                          const int64_t *shape) {
  (void)ctx;
  return fsdp_kernels_refuse("add_strided", dt, "cuda");
}

int fsdp_cuda_fill(void *ctx, fsdp_dtype dt, void *out, double v, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("fill", dt, "cuda");
}

int fsdp_cuda_arange(void *ctx, fsdp_dtype dt, void *out, double start, double step, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("arange", dt, "cuda");
}

int fsdp_cuda_random(void *ctx, fsdp_dtype dt, void *out, int64_t n, uint64_t key, uint64_t first,
                     bool normal, double a, double b) {
  (void)ctx;
  return fsdp_kernels_refuse("random", dt, "cuda");
}
