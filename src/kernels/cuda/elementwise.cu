/*
 * elementwise.cu — not yet implemented: every kernel refuses (replaced as the CUDA device lands).
 */
#include "kernels/cuda/cuda.h"

int fsdp_cuda_axpy(void *ctx, fsdp_dtype dt, void *y, const void *x, double alpha, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("axpy", dt, "cuda");
}

int fsdp_cuda_scale(void *ctx, fsdp_dtype dt, void *y, double s, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("scale", dt, "cuda");
}

int fsdp_cuda_binary_forward(void *ctx, fsdp_dtype dt, void *out, const void *a, const void *b,
                             int64_t n, int64_t m, fsdp_binop op) {
  (void)ctx;
  return fsdp_kernels_refuse("binary", dt, "cuda");
}

int fsdp_cuda_binary_backward(void *ctx, fsdp_dtype dt, void *da, void *db, const void *dout,
                              const void *a, const void *b, int64_t n, int64_t m, fsdp_binop op) {
  (void)ctx;
  return fsdp_kernels_refuse("binary", dt, "cuda");
}

int fsdp_cuda_affine_forward(void *ctx, fsdp_dtype dt, void *out, const void *a, double s,
                             double t, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("affine_forward", dt, "cuda");
}

int fsdp_cuda_affine_backward(void *ctx, fsdp_dtype dt, void *da, const void *dout, double s,
                              int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("affine_backward", dt, "cuda");
}

int fsdp_cuda_unary_forward(void *ctx, fsdp_dtype dt, fsdp_unary_op op, void *out, const void *in,
                            int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("unary_forward", dt, "cuda");
}

int fsdp_cuda_unary_backward(void *ctx, fsdp_dtype dt, fsdp_unary_op op, void *din,
                             const void *dout, const void *in, const void *out, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("unary_backward", dt, "cuda");
}

int fsdp_cuda_pow_forward(void *ctx, fsdp_dtype dt, void *out, const void *in, double p,
                          int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("pow_forward", dt, "cuda");
}

int fsdp_cuda_pow_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout, const void *in,
                           double p, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("pow_backward", dt, "cuda");
}

int fsdp_cuda_clamp_forward(void *ctx, fsdp_dtype dt, void *out, const void *in, double lo,
                            double hi, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("clamp_forward", dt, "cuda");
}

int fsdp_cuda_clamp_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                             const void *in, double lo, double hi, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("clamp_backward", dt, "cuda");
}

int fsdp_cuda_compare(void *ctx, fsdp_dtype dt, fsdp_cmpop op, void *out, const void *a,
                      const void *b, int64_t n, int64_t m) {
  (void)ctx;
  return fsdp_kernels_refuse("compare", dt, "cuda");
}

int fsdp_cuda_where(void *ctx, fsdp_dtype dt, void *out, const void *cond, const void *a,
                    const void *b, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("where", dt, "cuda");
}

int fsdp_cuda_dropout_forward(void *ctx, fsdp_dtype dt, void *out, void *mask, const void *in,
                              int64_t n, float p, uint64_t key, uint64_t first) {
  (void)ctx;
  return fsdp_kernels_refuse("dropout_forward", dt, "cuda");
}

int fsdp_cuda_dropout_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                               const void *mask, int64_t n) {
  (void)ctx;
  return fsdp_kernels_refuse("dropout_backward", dt, "cuda");
}
