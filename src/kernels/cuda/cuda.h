/*
 * cuda.h — private to src/kernels/cuda: the CUDA device's context and the functions behind its
 * kernel table (table.c), one group per file. Each kernel function has exactly its slot's
 * signature and conventions (src/kernels/kernels.h): context first, dtype, outputs, inputs,
 * sizes; dense row-major device buffers; backward slots accumulate; a dtype a kernel lacks is
 * refused with fsdp_kernels_refuse("op", dt, "cuda").
 *
 * Threads and streams: every rank thread uses one GPU (bind: local rank % device count) and one
 * compute stream of its own; every kernel is launched on the calling thread's stream
 * (fsdp_cuda_stream) and nothing synchronizes the host except copies to the host and results
 * that land in host memory (counts, sumsq), which the slot conventions allow.
 * Memory: device buffers come from the caching allocator (alloc.c, pool.h): size classes,
 * blocks reused in stream order, no cudaMalloc/cudaFree in the steady state. Scratch a kernel
 * needs for one call comes from there too (fsdp_cuda_scratch), so fsdp.memory() counts it.
 * Deterministic mode (fsdp.deterministic): kernels read fsdp_cuda_deterministic() and then use
 * no atomics in reductions (fixed orders), so results repeat bit for bit.
 * docs/cuda.md describes the device, its allocator and the kernels.
 */
#ifndef FSDP_KERNELS_CUDA_H
#define FSDP_KERNELS_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus /* the .cu files are C++: the engine's C headers keep C linkage */
extern "C" {
#endif

#include "core/core.h"
#include "kernels/cuda/pool.h"
#include "kernels/cuda/thread.h"
#include "kernels/kernels.h"

/* ---- the device (device.c, alloc.c) ------------------------------------------------------ */

extern fsdp_device_i fsdp_device_cuda;
extern const fsdp_kernels_i fsdp_cuda_kernels;
/* Register the cuda device when this machine has a GPU (fsdp_kernels_init calls it). A machine
 * without one (or without a driver) registers nothing: fsdp.device_count("cuda") is 0. */
int fsdp_cuda_register(void);

/* The calling thread's GPU index and compute stream: thread.h (the stream is created on first
 * use, on the thread's bound GPU; 0 with the error set when that fails). */
/* FSDP_OK once the calling thread has its GPU selected and its stream created (creating them
 * if needed); FSDP_ERR with the CUDA error otherwise. */
int fsdp_cuda_thread_ready(void);
/* Whether deterministic mode is on (fsdp.deterministic): a process-wide atomic flag. */
bool fsdp_cuda_deterministic(void);

/* FSDP_OK, or FSDP_ERR with "cuda: <what>: <CUDA's message>" when e is an error. */
int fsdp_cuda_check(cudaError_t e, const char *what);
/* After a kernel launch: the launch's error (bad configuration, no kernel image for this GPU)
 * as fsdp_cuda_check does. */
int fsdp_cuda_launched(const char *what);

/* Scratch device memory for one kernel call, from the caching allocator on the thread's stream,
 * charged to the thread's memory domain as activations (fsdp_mem_charge; no storage): free it
 * with fsdp_cuda_scratch_free, on the same thread and with the same size, once the kernels that
 * use it are queued (stream order keeps the reuse safe). 0 bytes gives a real pointer. */
int fsdp_cuda_scratch(void **out, size_t bytes);
void fsdp_cuda_scratch_free(void *p, size_t bytes);

/* The allocator's own statistics per GPU (allocated / reserved / peaks, as
 * torch.cuda.memory_stats), emptying its cache, resetting peaks: pool.h. */

/* ---- kernels: one group per file, each function its slot of fsdp_kernels_i ------------------ */

/* convert.cu */
int fsdp_cuda_cast(void *ctx, void *out, fsdp_dtype odt, const void *in, fsdp_dtype idt,
                   int64_t n);
int fsdp_cuda_copy_strided(void *ctx, fsdp_dtype dt, void *dst, const int64_t *dst_strides,
                           const void *src, const int64_t *src_strides, int ndim,
                           const int64_t *shape);
int fsdp_cuda_add_strided(void *ctx, fsdp_dtype dt, void *dst, const int64_t *dst_strides,
                          const void *src, const int64_t *src_strides, int ndim,
                          const int64_t *shape);
int fsdp_cuda_fill(void *ctx, fsdp_dtype dt, void *out, double v, int64_t n);
int fsdp_cuda_arange(void *ctx, fsdp_dtype dt, void *out, double start, double step, int64_t n);
int fsdp_cuda_random(void *ctx, fsdp_dtype dt, void *out, int64_t n, uint64_t key, uint64_t first,
                     bool normal, double a, double b);

/* elementwise.cu */
int fsdp_cuda_axpy(void *ctx, fsdp_dtype dt, void *y, const void *x, double alpha, int64_t n);
int fsdp_cuda_scale(void *ctx, fsdp_dtype dt, void *y, double s, int64_t n);
int fsdp_cuda_binary_forward(void *ctx, fsdp_dtype dt, void *out, const void *a, const void *b,
                             int64_t n, int64_t m, fsdp_binop op);
int fsdp_cuda_binary_backward(void *ctx, fsdp_dtype dt, void *da, void *db, const void *dout,
                              const void *a, const void *b, int64_t n, int64_t m, fsdp_binop op);
int fsdp_cuda_affine_forward(void *ctx, fsdp_dtype dt, void *out, const void *a, double s,
                             double t, int64_t n);
int fsdp_cuda_affine_backward(void *ctx, fsdp_dtype dt, void *da, const void *dout, double s,
                              int64_t n);
int fsdp_cuda_unary_forward(void *ctx, fsdp_dtype dt, fsdp_unary_op op, void *out, const void *in,
                            int64_t n);
int fsdp_cuda_unary_backward(void *ctx, fsdp_dtype dt, fsdp_unary_op op, void *din,
                             const void *dout, const void *in, const void *out, int64_t n);
int fsdp_cuda_pow_forward(void *ctx, fsdp_dtype dt, void *out, const void *in, double p,
                          int64_t n);
int fsdp_cuda_pow_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout, const void *in,
                           double p, int64_t n);
int fsdp_cuda_clamp_forward(void *ctx, fsdp_dtype dt, void *out, const void *in, double lo,
                            double hi, int64_t n);
int fsdp_cuda_clamp_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                             const void *in, double lo, double hi, int64_t n);
int fsdp_cuda_compare(void *ctx, fsdp_dtype dt, fsdp_cmpop op, void *out, const void *a,
                      const void *b, int64_t n, int64_t m);
int fsdp_cuda_where(void *ctx, fsdp_dtype dt, void *out, const void *cond, const void *a,
                    const void *b, int64_t n);
int fsdp_cuda_dropout_forward(void *ctx, fsdp_dtype dt, void *out, void *mask, const void *in,
                              int64_t n, float p, uint64_t key, uint64_t first);
int fsdp_cuda_dropout_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                               const void *mask, int64_t n);

/* reduce.cu */
int fsdp_cuda_check_index(void *ctx, fsdp_dtype idt, const void *ids, int64_t n, int64_t lo,
                          int64_t hi, const int64_t *ignore, int64_t *bad, double *bad_value);
int fsdp_cuda_sum(void *ctx, fsdp_dtype dt, void *out, const void *in, int64_t n, bool mean);
int fsdp_cuda_sumsq(void *ctx, fsdp_dtype dt, double *host_out, const void *in, int64_t n);
int fsdp_cuda_sum_dim_forward(void *ctx, fsdp_dtype dt, void *out, const void *in, int64_t outer,
                              int64_t R, int64_t inner, double scale);
int fsdp_cuda_sum_dim_backward(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                               int64_t outer, int64_t R, int64_t inner, double scale);
int fsdp_cuda_extreme_dim(void *ctx, fsdp_dtype dt, bool max, void *values, int64_t *index,
                          const void *in, int64_t outer, int64_t R, int64_t inner);
int fsdp_cuda_topk(void *ctx, fsdp_dtype dt, void *values, int64_t *index, const void *in,
                   int64_t outer, int64_t R, int64_t inner, int64_t k, bool largest);
int fsdp_cuda_index_add_dim(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                            const int64_t *index, int64_t outer, int64_t R, int64_t inner,
                            int64_t K);

/* optim.cu */
int fsdp_cuda_sgd_step(void *ctx, fsdp_dtype dt, void *param, void *buf, const void *grad,
                       int64_t n, float lr, float momentum, float weight_decay, bool first_step);
int fsdp_cuda_adamw_step(void *ctx, fsdp_dtype dt, void *param, void *m, void *v,
                         const void *grad, int64_t n, float lr, float beta1, float beta2,
                         float eps, float weight_decay, float grad_scale, int64_t step);

/* mask.cu */
int fsdp_cuda_mask_apply(void *ctx, fsdp_dtype dt, void *x, const void *m, int64_t n);
int fsdp_cuda_count_zeros(void *ctx, fsdp_dtype dt, int64_t *zeros, const void *x, int64_t n);
int fsdp_cuda_mask_check(void *ctx, fsdp_dtype dt, int64_t *bad, int64_t *zeros, uint32_t *hash,
                         const void *m, int64_t n);
int fsdp_cuda_mask_from_nonzero(void *ctx, fsdp_dtype dt, void *mout, int64_t *zeros,
                                const void *x, int64_t n);
int fsdp_cuda_mask_hist(void *ctx, fsdp_dtype dt, int64_t *counts, const void *x, const void *m,
                        int64_t n, uint64_t prefix, int shift, int width);
int fsdp_cuda_mask_hist_pos(void *ctx, fsdp_dtype dt, int64_t *counts, const void *x,
                            const void *m, int64_t n, uint32_t T, uint64_t gbase, uint64_t prefix,
                            int shift, int width);
int fsdp_cuda_mask_select(void *ctx, fsdp_dtype dt, void *mout, int64_t *pruned, const void *x,
                          const void *m, int64_t n, uint32_t T, uint64_t gbase, uint64_t P);
int fsdp_cuda_mask_nm(void *ctx, fsdp_dtype dt, void *mout, int64_t *groups, const void *x,
                      const void *m, int64_t n, int64_t keep, int64_t M, int64_t lead);
int fsdp_cuda_mask_values(void *ctx, fsdp_dtype dt, void *out, const void *x, const void *m,
                          int64_t n);

/* blas.cu */
int fsdp_cuda_gemm(void *ctx, fsdp_dtype dt, void *c, const void *a, const void *b, int M, int N,
                   int K, bool trans_a, bool trans_b, float alpha, float beta, int lda, int ldb,
                   int ldc);
int fsdp_cuda_bmm_forward(void *ctx, fsdp_dtype dt, void *out, const void *a, const void *b,
                          int B, int M, int K, int N);
int fsdp_cuda_bmm_backward(void *ctx, fsdp_dtype dt, void *da, void *db, const void *dout,
                           const void *a, const void *b, int B, int M, int K, int N);
int fsdp_cuda_linear_forward(void *ctx, fsdp_dtype dt, void *out, const void *inp,
                             const void *weight, const void *bias, int M, int K, int N);
int fsdp_cuda_linear_backward(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dweight,
                              void *dbias, const void *dout, const void *inp, const void *weight,
                              int M, int K, int N);

/* norm.cu */
int fsdp_cuda_layernorm_forward(void *ctx, fsdp_dtype dt, void *out, float *mean, float *rstd,
                                const void *inp, const void *weight, const void *bias, int64_t N,
                                int C, float eps);
int fsdp_cuda_layernorm_backward(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dinp,
                                 void *dweight, void *dbias, const void *dout, const void *inp,
                                 const void *weight, const float *mean, const float *rstd,
                                 int64_t N, int C);
int fsdp_cuda_softmax_forward(void *ctx, fsdp_dtype dt, void *out, const void *inp, int64_t N,
                              int C);
int fsdp_cuda_softmax_backward(void *ctx, fsdp_dtype dt, void *dinp, const void *dout,
                               const void *out, int64_t N, int C);

/* loss.cu */
int fsdp_cuda_cross_entropy_forward(void *ctx, fsdp_dtype dt, float *loss, float *lse,
                                    const void *logits, const void *targets, fsdp_dtype tdt,
                                    int64_t N, int V, int64_t ignore, int64_t *count);
int fsdp_cuda_cross_entropy_backward(void *ctx, fsdp_dtype dt, void *dlogits, const float *dloss,
                                     const void *logits, const float *lse, const void *targets,
                                     fsdp_dtype tdt, int64_t N, int V, int64_t ignore,
                                     int64_t count);
int fsdp_cuda_mse_forward(void *ctx, fsdp_dtype dt, float *out, const void *a, const void *b,
                          int64_t n);
int fsdp_cuda_mse_backward(void *ctx, fsdp_dtype dt, void *da, void *db, const float *dloss,
                           const void *a, const void *b, int64_t n);

/* embed.cu */
int fsdp_cuda_embedding_forward(void *ctx, fsdp_dtype dt, void *out, const void *ids,
                                fsdp_dtype idt, const void *weight, int64_t N, int C);
int fsdp_cuda_embedding_backward(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dweight,
                                 const void *dout, const void *ids, fsdp_dtype idt, int64_t N,
                                 int C);

/* attention.cu */
int64_t fsdp_cuda_attention_saved(void *ctx, fsdp_dtype dt, int B, int T, int C, int NH,
                                  fsdp_dtype *saved_dt);
int fsdp_cuda_attention_forward(void *ctx, fsdp_dtype dt, void *out, void *att, const void *qkv,
                                int B, int T, int C, int NH);
int fsdp_cuda_attention_backward(void *ctx, fsdp_dtype dt, void *dqkv, const void *dout,
                                 const void *qkv, const void *att, int B, int T, int C, int NH,
                                 bool set_dqkv);

/* device.c */
int fsdp_cuda_set_deterministic(void *ctx, bool on);

/* ranks.cu */
int fsdp_cuda_reduce_ranks(void *ctx, fsdp_dtype dt, fsdp_reduce_op red, void *out,
                           const void *const *src, int nsrc, int64_t n);

#ifdef __cplusplus
}
#endif

#endif
