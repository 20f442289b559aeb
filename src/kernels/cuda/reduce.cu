/*
 * reduce.cu — not yet implemented: every kernel refuses (replaced as the CUDA device lands).
 */
#include "kernels/cuda/cuda.h"

int fsdp_cuda_check_index(void *ctx, fsdp_dtype idt, const void *ids, int64_t n, int64_t lo,
                          int64_t hi, const int64_t *ignore, int64_t *bad, double *bad_value) {
  (void)ctx;
  return fsdp_kernels_refuse("check_index", idt, "cuda");
}

int fsdp_cuda_sum(void *ctx, fsdp_dtype dt, void *out, const void *in, int64_t n, bool mean) {
  (void)ctx;
  return fsdp_kernels_refuse("sum", dt, "cuda");
}

int fsdp_cuda_sumsq(void *ctx, fsdp_dtype dt, double *host_out, const void *in, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("sumsq", dt, "cuda");
}

int fsdp_cuda_sum_dim_forward(void *ctx, fsdp_dtype dt, void *out, const void *in, int64_t outer,
                              int64_t R, int64_t inner, double scale) {
  (void)ctx;
  return fsdp_kernels_refuse("sum_dim_forward", dt, "cuda");
}

int fsdp_cuda_sum_dim_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                               int64_t outer, int64_t R, int64_t inner, double scale) {
  (void)ctx;
  return fsdp_kernels_refuse("sum_dim_backward", dt, "cuda");
}

int fsdp_cuda_extreme_dim(void *ctx, fsdp_dtype dt, bool max, void *values, int64_t *index,
                          const void *in, int64_t outer, int64_t R, int64_t inner) {
  (void)ctx;
  return fsdp_kernels_refuse("extreme_dim", dt, "cuda");
}

int fsdp_cuda_topk(void *ctx, fsdp_dtype dt, void *values, int64_t *index, const void *in,
                   int64_t outer, int64_t R, int64_t inner, int64_t k, bool largest) {
  (void)ctx;
  return fsdp_kernels_refuse("topk", dt, "cuda");
}

int fsdp_cuda_index_add_dim(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                            const int64_t *index, int64_t outer, int64_t R, int64_t inner,
                            int64_t K) {
  (void)ctx;
  return fsdp_kernels_refuse("index_add_dim", dt, "cuda");
}
