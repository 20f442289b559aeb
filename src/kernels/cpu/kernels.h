/*
 * kernels.h — CPU math on dense, contiguous, row-major f32 buffers: forward and backward of
 * every op the engine records. No tensors, no allocation (callers pass scratch), no errors:
 * callers (autograd/ops.c) validate shapes and indices before calling.
 *
 * Conventions (llm.c): outputs first, then inputs, then sizes. A shape comment on each pointer.
 * Backward functions ACCUMULATE (+=) into input gradients (dinp, dweight, ...): the caller
 * zero-fills a fresh gradient buffer, and a tensor used twice receives the sum.
 * GEMM goes through OpenBLAS (cblas_sgemm); nothing on a hot path is a naive triple loop.
 *
 * Aliasing: outputs never alias inputs, except where a function says so: the elementwise
 * forwards (binary, affine, relu, gelu, dropout) may run in place with out == input exactly,
 * and gradient outputs of one call may be the same buffer where an op takes the same tensor
 * twice (binary_backward da == db for x * x, mse_backward, linear/bmm_backward).
 * Determinism: results are pure functions of the inputs (fixed reduction orders, no threads
 * other than OpenBLAS's), so reruns are bitwise identical for a fixed BLAS thread count.
 * Precision: reductions over unbounded lengths (sum, sumsq, mse, column sums, cross-entropy
 * losses, bias gradients) accumulate in double; row reductions over a feature dimension use
 * float SIMD lanes with double between blocks. exp / tanh are SIMD polynomials within 2 ulp.
 *
 * These are the f32 kernels; table.c puts them behind the cpu's kernel table (kernels/kernels.h),
 * which adds the other dtypes (bf16 and f16 by converting to f32 and back around these calls).
 */
#ifndef FSDP_KERNELS_CPU_H
#define FSDP_KERNELS_CPU_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/kernels.h"

/* The cpu's kernel table (table.c) and its registration (fsdp_kernels_init calls it). */
extern const fsdp_kernels_i fsdp_cpu_kernels;
int fsdp_cpu_register(void);

/* ---- reducing ranks' buffers (ranks.c) ---------------------------------------------------- */

/* Whether fsdp_cpu_reduce_ranks takes (dtype, red): f32, bf16, f64 with any reduction, i64
 * without avg. */
bool fsdp_cpu_reduce_supported(fsdp_dtype dtype, fsdp_reduce_op red);
/* out[i] = src[0][i] (+) ... (+) src[nsrc-1][i], left to right, for i < m: the collectives'
 * exact arithmetic (kernels.h, reduce_ranks). out may be one of the inputs. */
void fsdp_cpu_reduce_ranks(void *out, const void *const *src, int nsrc, int64_t m,
                           fsdp_dtype dtype, fsdp_reduce_op red);

/* ---- BLAS ---------------------------------------------------------------------------- */

/* c = alpha * op(a) @ op(b) + beta * c, row-major; op(a) (M, K), op(b) (K, N), c (M, N).
 * lda/ldb/ldc are row strides of the stored matrices (as in cblas).
 * beta == 0 ignores the contents of c (NaN included). M, N or K == 0 is allowed. */
void fsdp_cpu_gemm(float *c, const float *a, const float *b, int M, int N, int K, bool trans_a,
                   bool trans_b, float alpha, float beta, int lda, int ldb, int ldc);
/* The same product on the calling thread alone (gemm.c: the library behind every cpu GEMM);
 * K >= 1, M, N >= 1. fsdp_cpu_gemm splits its work into calls of this. */
void fsdp_cpu_sgemm_serial(float *c, const float *a, const float *b, int M, int N, int K,
                           bool trans_a, bool trans_b, float alpha, float beta, int lda, int ldb,
                           int ldc);
/* OpenBLAS's own threads per call: 1 (pinned on the first GEMM or query; the rank's pool is the
 * parallelism, pool.h) unless this overrides it from now on (benchmarks, experiments; n < 1
 * means 1). Process-wide: OpenBLAS has no per-thread count. */
void fsdp_cpu_set_blas_threads(int n);
int fsdp_cpu_get_blas_threads(void);
/* The instruction set the element-wise kernels run at: "avx512", "avx2" or "scalar" (isa.c:
 * the best this processor has, or FSDP_CPU_ISA's). */
const char *fsdp_cpu_isa_current(void);
/* FSDP_OK, or FSDP_ERR naming FSDP_CPU_ISA when its value is unknown or asks for an
 * instruction set this processor lacks (the kernels then run at the best level). */
int fsdp_cpu_isa_check(void);
/* FSDP_OK, or FSDP_ERR naming FSDP_GEMM or FSDP_BF16_GEMM when its value is unknown or asks for
 * a library that cannot run here (the GEMMs then take the default; gemm.h). */
int fsdp_cpu_gemm_check(void);

/* ---- linear / matmul ------------------------------------------------------------------- */

/* out (M, N) = inp (M, K) @ weight(N, K)^T + bias (N) ; bias may be NULL */
void fsdp_cpu_linear_forward(float *out, const float *inp, const float *weight,
                             const float *bias, int M, int K, int N);
/* dinp (M, K) += dout @ weight ; dweight (N, K) += dout^T @ inp ; dbias (N) += sum_m dout.
 * Any of dinp, dweight, dbias may be NULL (not needed). */
void fsdp_cpu_linear_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                              const float *inp, const float *weight, int M, int K, int N);

/* Batched matmul: for each b < B: out[b] (M, N) = a[b] (M, K) @ b[b] (K, N). */
void fsdp_cpu_bmm_forward(float *out, const float *a, const float *b, int B, int M, int K, int N);
/* da[b] += dout[b] @ b[b]^T ; db[b] += a[b]^T @ dout[b] ; either may be NULL */
void fsdp_cpu_bmm_backward(float *da, float *db, const float *dout, const float *a,
                           const float *b, int B, int M, int K, int N);

/* The matrix products the calling thread has run through the cpu kernel table (its gemm, bmm and
 * linear slots, any dtype) since the thread started: calls, FLOPs (2 M N K per product: a
 * linear's backward counts its input and weight gradients, a bmm each of its B products) and
 * the wall seconds from each slot's entry to its return. That time includes what the slot does
 * around its products (the pool's dispatch and waits, a linear's bias epilogue or column sum, a
 * half dtype's conversions). A call the slot refuses or fails is not counted. For benchmarks:
 * the rate the GEMMs reach inside a training step, against the same GEMM alone. Attention's own
 * products (attention.c) are not counted. */
void fsdp_cpu_gemm_stats(int64_t *calls, double *flops, double *seconds);

/* The benchmarks' reference rate: GFLOP/s of c (M, N) = a (M, K) @ b (N, K)^T through
 * fsdp_cpu_gemm on buffers of its own (split over the calling thread's pool like every GEMM):
 * after one warm-up call, calls for at least `seconds` in FSDP_CPU_SGEMM_WINDOWS windows of
 * equal length, and the fastest window's mean rate. On a shared machine the other tenants' work
 * only ever lowers a measured rate, so the fastest window is the closest to what the GEMM can do
 * here (one average over the whole time moved by 2x between runs of the same binary).
 * fsdp.core.sgemm_gflops (bench/gpt_step.lua's "sgemm GF/s") and bench/step_floor use it.
 * FSDP_ERR (message set) for sizes < 1, seconds not > 0, or no memory. */
#define FSDP_CPU_SGEMM_WINDOWS 5
int fsdp_cpu_sgemm_gflops(int M, int N, int K, double seconds, double *gflops);

/* ---- elementwise with broadcasting over leading dimensions ------------------------------
 * a has n elements, b has m elements, n % m == 0: b repeats along the leading dimensions
 * (b's shape is a suffix of a's). out has n elements. m == n is the plain case. */
void fsdp_cpu_binary_forward(float *out, const float *a, const float *b, int64_t n, int64_t m,
                             fsdp_binop op);
/* da (n) += ..., db (m) += sum over repeats of ...; da or db may be NULL */
void fsdp_cpu_binary_backward(float *da, float *db, const float *dout, const float *a,
                              const float *b, int64_t n, int64_t m, fsdp_binop op);
/* out = a * s + t (scale and shift by scalars) */
void fsdp_cpu_affine_forward(float *out, const float *a, float s, float t, int64_t n);
/* da += dout * s */
void fsdp_cpu_affine_backward(float *da, const float *dout, float s, int64_t n);

/* ---- activations ------------------------------------------------------------------------ */

void fsdp_cpu_relu_forward(float *out, const float *inp, int64_t n);
void fsdp_cpu_relu_backward(float *dinp, const float *dout, const float *inp, int64_t n);
/* GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
void fsdp_cpu_gelu_forward(float *out, const float *inp, int64_t n);
void fsdp_cpu_gelu_backward(float *dinp, const float *dout, const float *inp, int64_t n);
/* out (N, C) = gelu(inp (N, C) + bias (C)): a linear's bias and its GELU in one pass */
void fsdp_cpu_bias_gelu_forward(float *out, const float *inp, const float *bias, int64_t N,
                                int C);
/* dinp (N, C) += t (set: dinp = t, its old contents unread), dbias (C) += column sums of t
 * (double, rows in order), t = gelu'(inp + bias) dout, one pass; dinp or dbias may be NULL */
void fsdp_cpu_bias_gelu_backward(float *dinp, float *dbias, const float *dout, const float *inp,
                                 const float *bias, int64_t N, int C, bool set);

/* Dropout with probability p: mask[i] = (u_i >= p) ? 1/(1-p) : 0 where u_i is
 * fsdp_rng_uniform(key, first + i); out = inp * mask. mask (n) is saved for backward.
 * p <= 0: mask all ones (no RNG call); p >= 1: mask all zeros. */
void fsdp_cpu_dropout_forward(float *out, float *mask, const float *inp, int64_t n, float p,
                              uint64_t key, uint64_t first);
void fsdp_cpu_dropout_backward(float *dinp, const float *dout, const float *mask, int64_t n);

/* ---- embedding --------------------------------------------------------------------------- */

/* out (N, C) = weight[ids[i]] ; ids (N) in [0, V) (checked by caller) */
void fsdp_cpu_embedding_forward(float *out, const int64_t *ids, const float *weight, int64_t N,
                                int C);
/* dweight (V, C) += scatter-add of dout (N, C) rows at ids */
void fsdp_cpu_embedding_backward(float *dweight, const float *dout, const int64_t *ids,
                                 int64_t N, int C);

/* ---- normalisation, softmax ---------------------------------------------------------------- */

/* out (N, C) = (inp - mean) * rstd * weight + bias ; mean (N), rstd (N) saved for backward;
 * rstd = 1 / sqrt(biased variance + eps). bias may be NULL; weight may be NULL (taken as 1). */
void fsdp_cpu_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                const float *weight, const float *bias, int64_t N, int C,
                                float eps);
/* sum = a + b, out = layernorm(sum): fsdp_cpu_binary_forward then fsdp_cpu_layernorm_forward on
 * blocks of rows that stay in L2 (the same bits) */
void fsdp_cpu_add_layernorm_forward(float *sum, float *out, float *mean, float *rstd,
                                    const float *a, const float *b, const float *weight,
                                    const float *bias, int64_t N, int C, float eps);
/* dinp (N, C) += ..., dweight (C) += ..., dbias (C) += ... ; any of the three may be NULL;
 * weight NULL as in the forward. */
void fsdp_cpu_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                 const float *inp, const float *weight, const float *mean,
                                 const float *rstd, int64_t N, int C);

/* out (N, C) = softmax of each row of inp (N, C); -inf entries get probability 0 */
void fsdp_cpu_softmax_forward(float *out, const float *inp, int64_t N, int C);
/* dinp += out * (dout - sum(dout * out)) per row */
void fsdp_cpu_softmax_backward(float *dinp, const float *dout, const float *out, int64_t N, int C);

/* ---- attention ------------------------------------------------------------------------------ */

/* Causal multi-head self-attention on a fused qkv projection (llm.c layout).
 * qkv (B, T, 3C): q = qkv[..., 0:C], k = qkv[..., C:2C], v = qkv[..., 2C:3C], each split into
 * NH heads of hs = C / NH. out (B, T, C) = heads concatenated. Scores are scaled by 1/sqrt(hs).
 * Nothing is saved for the backward: it recomputes the probabilities (the same bits). scratch
 * is caller-provided workspace of fsdp_cpu_attention_scratch floats for the same sizes and
 * the calling context's fsdp_cpu_threads() (which decides how the work is shared out: 1 inside
 * a pool task); no contents are read. */
int64_t fsdp_cpu_attention_scratch(int B, int T, int C, int NH, int threads, bool backward);
/* The attention kernels' tile (f32 here, bf16 in attention_bf16.c): query rows r0 .. r0 +
 * fsdp_cpu_att_rows(T, r0) - 1 against the keys [0, r0 + rows) they see. */
#define FSDP_CPU_ATT_BLOCK 64
static inline int fsdp_cpu_att_rows(int T, int r0) {
  return T - r0 < FSDP_CPU_ATT_BLOCK ? T - r0 : FSDP_CPU_ATT_BLOCK;
}
/* stats: NULL, or (B, NH, T, 2) floats that receive each query row's softmax max and
 * reciprocal sum, for the backward to rebuild the probabilities in one pass */
void fsdp_cpu_attention_forward(float *out, float *stats, float *scratch, const float *qkv,
                                int B, int T, int C, int NH);
/* dqkv (B, T, 3C) += ... (set: dqkv = ..., its old contents unread); stats: the forward's, or
 * NULL (the probabilities recomputed whole): the same bits either way */
void fsdp_cpu_attention_backward(float *dqkv, float *scratch, const float *dout,
                                 const float *qkv, const float *stats, int B, int T, int C,
                                 int NH, bool set);

/* ---- losses and reductions ------------------------------------------------------------------- */

/* Cross-entropy fused with log-softmax over rows of logits (N, V) with integral targets (N).
 * Rows whose target == ignore_index are skipped. lse (N) receives each row's log-sum-exp
 * (saved for backward). Returns the mean loss over counted rows (0 when none) and stores the
 * count in *count. Rows are stable for any logit range (row max subtracted); targets must be
 * valid class ids on counted rows (checked by the caller). */
float fsdp_cpu_cross_entropy_forward(float *lse, const float *logits, const int64_t *targets,
                                     int64_t N, int V, int64_t ignore_index, int64_t *count);
/* dlogits (N, V) += dloss / count * (softmax - onehot) on counted rows */
void fsdp_cpu_cross_entropy_backward(float *dlogits, float dloss, const float *logits,
                                     const float *lse, const int64_t *targets, int64_t N, int V,
                                     int64_t ignore_index, int64_t count);

/* mean((a - b)^2) over n elements */
float fsdp_cpu_mse_forward(const float *a, const float *b, int64_t n);
/* da += dloss * 2 (a - b) / n ; db -= the same ; either may be NULL */
void fsdp_cpu_mse_backward(float *da, float *db, float dloss, const float *a, const float *b,
                           int64_t n);

/* Sum of n elements (pairwise / blocked in double for accuracy). */
double fsdp_cpu_sum(const float *a, int64_t n);
/* Reduce inp (outer, R, inner) over the middle axis: out (outer, inner) = sum_r inp. */
void fsdp_cpu_sum_dim_forward(float *out, const float *inp, int64_t outer, int64_t R,
                              int64_t inner);
/* dinp (outer, R, inner) += broadcast of dout (outer, inner) */
void fsdp_cpu_sum_dim_backward(float *dinp, const float *dout, int64_t outer, int64_t R,
                               int64_t inner);
/* Sum of squares (double) — used by gradient-norm clipping. */
double fsdp_cpu_sumsq(const float *a, int64_t n);
/* out (C) += column sums of inp (R, C), accumulated in double: bias-style gradients. */
void fsdp_cpu_colsum_acc(float *out, const float *inp, int64_t R, int64_t C);
/* The same for inp in bf16 or f16 (read as it is, no f32 copy): each column's sum is the f32
 * kernel's on the widened matrix. */
void fsdp_cpu_colsum_acc_half(float *out, const void *inp, fsdp_dtype dt, int64_t R, int64_t C);

/* ---- dtype conversions (convert.c) ---------------------------------------------------------
 * Bulk forms of core's scalar conversions (same bits: round to nearest even, NaN kept). */
void fsdp_cpu_bf16_to_f32(float *out, const uint16_t *in, int64_t n);
void fsdp_cpu_f32_to_bf16(uint16_t *out, const float *in, int64_t n);
void fsdp_cpu_f16_to_f32(float *out, const uint16_t *in, int64_t n);
void fsdp_cpu_f32_to_f16(uint16_t *out, const float *in, int64_t n);
/* out (n, odt) = in (n, idt) for any pair of dtypes */
void fsdp_cpu_cast(void *out, fsdp_dtype odt, const void *in, fsdp_dtype idt, int64_t n);

/* ---- optimizers (update in place, over flat buffers) ----------------------------------------- */

/* SGD with momentum and (coupled, L2) weight decay, PyTorch semantics:
 * g = grad + wd * p ; buf = momentum * buf + g (buf = g on the first step) ; p -= lr * buf.
 * buf may be NULL when momentum == 0. */
void fsdp_cpu_sgd_step(float *param, float *buf, const float *grad, int64_t n, float lr,
                       float momentum, float weight_decay, bool first_step);
/* AdamW (decoupled weight decay), PyTorch semantics; step counts from 1, g = grad * gscale
 * (gradient clipping's coefficient, read in; grad itself is not written):
 * p -= lr * wd * p ; m = b1 m + (1-b1) g ; v = b2 v + (1-b2) g^2 ;
 * p -= lr * (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps) */
void fsdp_cpu_adamw_step(float *param, float *m, float *v, const float *grad, int64_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay,
                         float gscale, int64_t step);
/* The same fused with a mask, bitwise fsdp_cpu_mask_apply(grad, mask), the step, then
 * fsdp_cpu_mask_apply(param, mask), in one pass (grad is left masked, as there, not scaled). */
void fsdp_cpu_adamw_step_masked(float *param, float *m, float *v, float *grad, const float *mask,
                                int64_t n, float lr, float beta1, float beta2, float eps,
                                float weight_decay, float gscale, int64_t step);

/* ---- masks and magnitude pruning (mask.c) ----------------------------------------------------
 * The f32 forms of the mask slots of kernels/kernels.h (the key order is described there).
 * m may be NULL (no mask) where it is a const input. Counts are added (+=) or returned. */
void fsdp_cpu_mask_apply(float *x, const float *m, int64_t n);
int64_t fsdp_cpu_count_zeros(const float *x, int64_t n);
void fsdp_cpu_mask_check(int64_t *bad, int64_t *zeros, uint32_t *hash, const float *m,
                         int64_t n);
int64_t fsdp_cpu_mask_from_nonzero(float *mout, const float *x, int64_t n);
/* sub: scratch of 4 << width counters */
void fsdp_cpu_mask_hist(int64_t *counts, uint32_t *sub, const float *x, const float *m,
                        int64_t n, uint64_t prefix, int shift, int width);
void fsdp_cpu_mask_hist_pos(int64_t *counts, const float *x, const float *m, int64_t n,
                            uint32_t T, uint64_t gbase, uint64_t prefix, int shift, int width);
int64_t fsdp_cpu_mask_select(float *mout, const float *x, const float *m, int64_t n, uint32_t T,
                             uint64_t gbase, uint64_t P);
/* M <= 4096 */
int64_t fsdp_cpu_mask_nm(float *mout, const float *x, const float *m, int64_t n, int64_t keep,
                         int64_t M, int64_t lead);
void fsdp_cpu_mask_values(float *out, const float *x, const float *m, int64_t n);

#endif
