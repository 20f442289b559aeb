/*
 * mask.cu — not yet implemented: every kernel refuses (replaced as the CUDA device lands).
 */
#include "kernels/cuda/cuda.h"

int fsdp_cuda_mask_apply(void *ctx, fsdp_dtype dt, void *x, const void *m, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("mask_apply", dt, "cuda");
}

int fsdp_cuda_count_zeros(void *ctx, fsdp_dtype dt, int64_t *zeros, const void *x, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("count_zeros", dt, "cuda");
}

int fsdp_cuda_mask_check(void *ctx, fsdp_dtype dt, int64_t *bad, int64_t *zeros, uint32_t *hash,
                         const void *m, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("mask_check", dt, "cuda");
}

int fsdp_cuda_mask_from_nonzero(void *ctx, fsdp_dtype dt, void *mout, int64_t *zeros,
                                const void *x, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("mask_from_nonzero", dt, "cuda");
}

int fsdp_cuda_mask_hist(void *ctx, fsdp_dtype dt, int64_t *counts, const void *x, const void *m,
                        int64_t n, uint64_t prefix, int shift, int width) {
  (void)ctx;
  return fsdp_kernels_refuse("mask_hist", dt, "cuda");
}

int fsdp_cuda_mask_hist_pos(void *ctx, fsdp_dtype dt, int64_t *counts, const void *x,
                            const void *m, int64_t n, uint32_t T, uint64_t gbase, uint64_t prefix,
                            int shift, int width) {
  (void)ctx;
  return fsdp_kernels_refuse("mask_hist_pos", dt, "cuda");
}

int fsdp_cuda_mask_select(void *ctx, fsdp_dtype dt, void *mout, int64_t *pruned, const void *x,
                          const void *m, int64_t n, uint32_t T, uint64_t gbase, uint64_t P) {
  (void)ctx;
  return fsdp_kernels_refuse("mask_select", dt, "cuda");
}

int fsdp_cuda_mask_nm(void *ctx, fsdp_dtype dt, void *mout, int64_t *groups, const void *x,
                      const void *m, int64_t n, int64_t keep, int64_t M, int64_t lead) {
  (void)ctx;
  return fsdp_kernels_refuse("mask_nm", dt, "cuda");
}

int fsdp_cuda_mask_values(void *ctx, fsdp_dtype dt, void *out, const void *x, const void *m,
                          int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("mask_values", dt, "cuda");
}
