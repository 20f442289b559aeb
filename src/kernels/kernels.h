/*
 * kernels.h — the kernel table: the math of one device, behind the same slots on every device
 * (ggml's backend interface, llm.c's same-named kernels per device). Autograd, the FSDP units
 * and the Lua binding look a table up from a tensor's device (fsdp_kernels_of) and never name a
 * device; a device's folder (src/kernels/cpu, ...) fills one table and registers it.
 *
 * Slot conventions:
 * - context first (the device's ctx), then the dtype the slot computes in, then outputs, inputs
 *   and sizes (llm.c's order). Buffers are dense, contiguous and row-major on the device, unless
 *   a slot takes strides.
 * - `dt` is the dtype of the slot's float tensors (activations, weights and their gradients).
 *   Auxiliary buffers are always f32 (layernorm's mean and rstd, cross-entropy's lse), index
 *   buffers carry their own dtype argument (ids, targets: f32 holding integers, i64 or i32),
 *   index outputs are i64, comparison outputs are bool (one byte, 0 or 1).
 * - Every slot returns FSDP_OK, or FSDP_ERR with a message. A dtype a slot does not compute in
 *   is refused with "op <name> has no kernel for <dtype> on <device>" (fsdp_kernels_refuse), so
 *   callers can offer every dtype and let the table decide.
 * - Backward slots ACCUMULATE (+=) into input gradients; a NULL gradient output is skipped.
 *   Gradients have the dtype of their tensor, except the weight gradients of the slots that take
 *   `gdt` (linear, layernorm, embedding): those are in gdt, which is dt or f32 (mixed precision
 *   keeps parameter gradients in f32, so a gradient is rounded once, after the ranks' sum).
 *   Outputs never alias inputs, except where the cpu header (src/kernels/cpu/kernels.h) says the
 *   f32 kernels allow it; every table honours the same rules.
 * - Scalars that reach the host (sumsq, counts) are host pointers; the call waits for them.
 * - Results are pure functions of the inputs on one device (fixed reduction orders), unless the
 *   device's docs say otherwise.
 */
#ifndef FSDP_KERNELS_H
#define FSDP_KERNELS_H

#include <stdbool.h>
#include <stdint.h>

#include "core/core.h"

typedef enum { FSDP_BIN_ADD, FSDP_BIN_SUB, FSDP_BIN_MUL, FSDP_BIN_DIV } fsdp_binop;

typedef enum {
  FSDP_UNARY_RELU, FSDP_UNARY_GELU, FSDP_UNARY_EXP, FSDP_UNARY_LOG, FSDP_UNARY_SQRT,
  FSDP_UNARY_TANH, FSDP_UNARY_SIGMOID, FSDP_UNARY_ABS, FSDP_UNARY_SIGN, FSDP_UNARY_COUNT
} fsdp_unary_op;
const char *fsdp_unary_name(fsdp_unary_op op); /* "relu", ... */

typedef enum { FSDP_CMP_GT, FSDP_CMP_GE, FSDP_CMP_LT, FSDP_CMP_LE, FSDP_CMP_EQ, FSDP_CMP_NE } fsdp_cmpop;

typedef struct fsdp_kernels_i {
  /* ---- conversions and data movement ---- */
  /* out (n, odt) = in (n, idt) converted (fsdp_dtype_store's rules, rounding to nearest even) */
  int (*cast)(void *ctx, void *out, fsdp_dtype odt, const void *in, fsdp_dtype idt, int64_t n);
  /* dst <- src (same dtype) over shape with element strides (a stride may be 0 on src) */
  int (*copy_strided)(void *ctx, fsdp_dtype dt, void *dst, const int64_t *dst_strides,
                      const void *src, const int64_t *src_strides, int ndim,
                      const int64_t *shape);
  /* dst += src over shape with element strides; dst strides may be 0 (summing repeats) */
  int (*add_strided)(void *ctx, fsdp_dtype dt, void *dst, const int64_t *dst_strides,
                     const void *src, const int64_t *src_strides, int ndim,
                     const int64_t *shape);
  int (*axpy)(void *ctx, fsdp_dtype dt, void *y, const void *x, double alpha, int64_t n); /* y += a x */
  int (*scale)(void *ctx, fsdp_dtype dt, void *y, double s, int64_t n);                 /* y *= s */
  /* out[i] = start + i * step */
  int (*arange)(void *ctx, fsdp_dtype dt, void *out, double start, double step, int64_t n);
  /* out[i] = element first + i of the Philox stream `key`: normal (mean a, std b) or uniform
   * in [a, b); the same values on every device */
  int (*random)(void *ctx, fsdp_dtype dt, void *out, int64_t n, uint64_t key, uint64_t first,
                bool normal, double a, double b);

  /* ---- linear algebra ---- */
  /* c = alpha op(a) op(b) + beta c (cblas semantics, row-major, leading dimensions) */
  int (*gemm)(void *ctx, fsdp_dtype dt, void *c, const void *a, const void *b, int M, int N,
              int K, bool trans_a, bool trans_b, float alpha, float beta, int lda, int ldb,
              int ldc);
  int (*bmm_forward)(void *ctx, fsdp_dtype dt, void *out, const void *a, const void *b, int B,
                     int M, int K, int N);
  int (*bmm_backward)(void *ctx, fsdp_dtype dt, void *da, void *db, const void *dout,
                      const void *a, const void *b, int B, int M, int K, int N);
  /* out (M, N) = inp (M, K) weight (N, K)^T + bias (N) */
  int (*linear_forward)(void *ctx, fsdp_dtype dt, void *out, const void *inp,
                        const void *weight, const void *bias, int M, int K, int N);
  int (*linear_backward)(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dweight,
                         void *dbias,
                         const void *dout, const void *inp, const void *weight, int M, int K,
                         int N);

  /* ---- elementwise ---- */
  /* a (n), b (m) repeating along leading dims (n % m == 0) */
  int (*binary_forward)(void *ctx, fsdp_dtype dt, void *out, const void *a, const void *b,
                        int64_t n, int64_t m, fsdp_binop op);
  int (*binary_backward)(void *ctx, fsdp_dtype dt, void *da, void *db, const void *dout,
                         const void *a, const void *b, int64_t n, int64_t m, fsdp_binop op);
  int (*affine_forward)(void *ctx, fsdp_dtype dt, void *out, const void *a, double s, double t,
                        int64_t n); /* out = a s + t */
  int (*affine_backward)(void *ctx, fsdp_dtype dt, void *da, const void *dout, double s,
                         int64_t n);
  int (*unary_forward)(void *ctx, fsdp_dtype dt, fsdp_unary_op op, void *out, const void *in,
                       int64_t n);
  /* in: the forward's input, out: its output (each op reads what it needs) */
  int (*unary_backward)(void *ctx, fsdp_dtype dt, fsdp_unary_op op, void *din,
                        const void *dout, const void *in, const void *out, int64_t n);
  int (*pow_forward)(void *ctx, fsdp_dtype dt, void *out, const void *in, double p, int64_t n);
  int (*pow_backward)(void *ctx, fsdp_dtype dt, void *din, const void *dout, const void *in,
                      double p, int64_t n);
  int (*clamp_forward)(void *ctx, fsdp_dtype dt, void *out, const void *in, double lo,
                       double hi, int64_t n);
  /* din += dout where lo <= in <= hi */
  int (*clamp_backward)(void *ctx, fsdp_dtype dt, void *din, const void *dout, const void *in,
                        double lo, double hi, int64_t n);
  /* out (n, bool) = a (n) cmp b (m, repeating as in binary) */
  int (*compare)(void *ctx, fsdp_dtype dt, fsdp_cmpop op, void *out, const void *a,
                 const void *b, int64_t n, int64_t m);
  /* out = cond ? a : b, all (n); cond bool */
  int (*where)(void *ctx, fsdp_dtype dt, void *out, const void *cond, const void *a,
               const void *b, int64_t n);
  /* dropout: mask (n, dt) = u >= p ? 1 / (1 - p) : 0 with u uniform from (key, first + i) */
  int (*dropout_forward)(void *ctx, fsdp_dtype dt, void *out, void *mask, const void *in,
                         int64_t n, float p, uint64_t key, uint64_t first);
  int (*dropout_backward)(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                          const void *mask, int64_t n);

  /* ---- indices ---- */
  /* *bad = the first i whose ids[i] is not an integer in [lo, hi) (nor *ignore, when ignore is
   * non-NULL), -1 when all are; *bad_value its value */
  int (*check_index)(void *ctx, fsdp_dtype idt, const void *ids, int64_t n, int64_t lo,
                     int64_t hi, const int64_t *ignore, int64_t *bad, double *bad_value);
  /* out (N, C) = weight[ids] ; ids (N) of dtype idt, checked by the caller */
  int (*embedding_forward)(void *ctx, fsdp_dtype dt, void *out, const void *ids,
                           fsdp_dtype idt, const void *weight, int64_t N, int C);
  int (*embedding_backward)(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dweight,
                            const void *dout,
                            const void *ids, fsdp_dtype idt, int64_t N, int C);

  /* ---- normalisation, attention, losses ---- */
  int (*layernorm_forward)(void *ctx, fsdp_dtype dt, void *out, float *mean, float *rstd,
                           const void *inp, const void *weight, const void *bias, int64_t N,
                           int C, float eps);
  int (*layernorm_backward)(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dweight,
                            void *dbias,
                            const void *dout, const void *inp, const void *weight,
                            const float *mean, const float *rstd, int64_t N, int C);
  /* softmax over the last dim of (N, C) */
  int (*softmax_forward)(void *ctx, fsdp_dtype dt, void *out, const void *inp, int64_t N, int C);
  int (*softmax_backward)(void *ctx, fsdp_dtype dt, void *dinp, const void *dout,
                          const void *out, int64_t N, int C);
  /* causal self-attention on a fused qkv (B, T, 3C). `att` is what the forward saves for the
   * backward, in a layout the device chooses: attention_saved gives its element count and dtype
   * (the probabilities, (B, NH, T, T) of dt; the row log-sum-exps, (B, NH, T) f32, as a fused
   * kernel that never materialises them keeps them (CUDA); the rows' max and reciprocal sum,
   * (B, NH, T, 2) f32, for a backward that recomputes the scores (the cpu's, f32, bf16 and
   * f16); or nothing (0 elements, att unused) when the backward recomputes the probabilities
   * whole). The backward adds into dqkv, or with set_dqkv writes it whole without reading it
   * (its first gradient: the buffer was never filled). */
  int64_t (*attention_saved)(void *ctx, fsdp_dtype dt, int B, int T, int C, int NH,
                             fsdp_dtype *saved_dt);
  int (*attention_forward)(void *ctx, fsdp_dtype dt, void *out, void *att, const void *qkv,
                           int B, int T, int C, int NH);
  int (*attention_backward)(void *ctx, fsdp_dtype dt, void *dqkv, const void *dout,
                            const void *qkv, const void *att, int B, int T, int C, int NH,
                            bool set_dqkv);
  /* loss (1, f32) = mean over counted rows of -log softmax(logits)[target]; lse (N) saved;
   * *count (host) = the rows counted (target != ignore) */
  int (*cross_entropy_forward)(void *ctx, fsdp_dtype dt, float *loss, float *lse,
                               const void *logits, const void *targets, fsdp_dtype tdt,
                               int64_t N, int V, int64_t ignore, int64_t *count);
  /* dlogits += dloss[0] / count (softmax - onehot) on counted rows; dloss (1, f32) */
  int (*cross_entropy_backward)(void *ctx, fsdp_dtype dt, void *dlogits, const float *dloss,
                                const void *logits, const float *lse, const void *targets,
                                fsdp_dtype tdt, int64_t N, int V, int64_t ignore,
                                int64_t count);
  /* out (1, f32) = mean((a - b)^2) */
  int (*mse_forward)(void *ctx, fsdp_dtype dt, float *out, const void *a, const void *b,
                     int64_t n);
  int (*mse_backward)(void *ctx, fsdp_dtype dt, void *da, void *db, const float *dloss,
                      const void *a, const void *b, int64_t n);

  /* ---- reductions ---- */
  /* out (1) = sum of in (n), divided by n when mean, accumulated in double and rounded once;
   * out has dtype dt for floats, i64 for integers (mean: floats only) */
  int (*sum)(void *ctx, fsdp_dtype dt, void *out, const void *in, int64_t n, bool mean);
  int (*sumsq)(void *ctx, fsdp_dtype dt, double *host_out, const void *in, int64_t n);
  /* out (outer, inner) = scale * sum_r in (outer, R, inner) */
  int (*sum_dim_forward)(void *ctx, fsdp_dtype dt, void *out, const void *in, int64_t outer,
                         int64_t R, int64_t inner, double scale);
  /* din (outer, R, inner) += scale * dout (outer, inner) broadcast over R */
  int (*sum_dim_backward)(void *ctx, fsdp_dtype dt, void *din, const void *dout, int64_t outer,
                          int64_t R, int64_t inner, double scale);
  /* max or min of in (outer, R, inner) over R: values (outer, inner, dt) and their first index
   * (i64; either output may be NULL). NaN wins (as a maximum and as a minimum). */
  int (*extreme_dim)(void *ctx, fsdp_dtype dt, bool max, void *values, int64_t *index,
                     const void *in, int64_t outer, int64_t R, int64_t inner);
  /* the k largest (or smallest) of in (outer, R, inner) along R, sorted, with their indices:
   * values (outer, k, inner), index (outer, k, inner) i64; ties keep the lower index first
   * (a stable sort); NaN sorts as the largest */
  int (*topk)(void *ctx, fsdp_dtype dt, void *values, int64_t *index, const void *in,
              int64_t outer, int64_t R, int64_t inner, int64_t k, bool largest);
  /* din (outer, R, inner) [index] += dout (outer, K, inner): the backward of a gather along R */
  int (*index_add_dim)(void *ctx, fsdp_dtype dt, void *din, const void *dout,
                       const int64_t *index, int64_t outer, int64_t R, int64_t inner, int64_t K);

  /* ---- optimizers (f32 master buffers, in place) ---- */
  int (*sgd_step)(void *ctx, fsdp_dtype dt, void *param, void *buf, const void *grad, int64_t n,
                  float lr, float momentum, float weight_decay, bool first_step);
  /* the gradient is read times grad_scale (gradient clipping's coefficient, 1 for none: the
   * same bits as scaling grad first) and not written */
  int (*adamw_step)(void *ctx, fsdp_dtype dt, void *param, void *m, void *v, const void *grad,
                    int64_t n, float lr, float beta1, float beta2, float eps,
                    float weight_decay, float grad_scale, int64_t step);
  /* optional: adamw_step with a mask (n, dt) fused in, bitwise mask_apply(grad, mask), the
   * step, mask_apply(param, mask) (grad is left masked, not scaled). NULL: the binding makes
   * those three calls. */
  int (*adamw_step_masked)(void *ctx, fsdp_dtype dt, void *param, void *m, void *v, void *grad,
                           const void *mask, int64_t n, float lr, float beta1, float beta2,
                           float eps, float weight_decay, float grad_scale, int64_t step);

  /* ---- fill, masks and magnitude pruning ----
   * What src/fsdp/mask.c computes masks and the pruning selection with (docs/pruning.md).
   * x, m, mout and out are dense buffers of n elements of dt; m NULL means no mask. Counts,
   * hashes and histograms land in host memory (the caller sums histograms across ranks). An
   * element's key orders it by magnitude, as a 32-bit unsigned integer: 0 when m[i] == 0, else
   * (the bits of |x[i]| as an f32) + 1 (a NaN above +inf); its value (N:M) is -1 when
   * m[i] == 0, +inf for a NaN, else |x[i]|. Elements with equal keys are ordered by their
   * global position gbase + i. Results are exact and independent of how the caller slices a
   * tensor. */
  int (*fill)(void *ctx, fsdp_dtype dt, void *out, double v, int64_t n); /* out[i] = v */
  /* x[i] = +0 where m[i] == 0 (other elements keep their bits) */
  int (*mask_apply)(void *ctx, fsdp_dtype dt, void *x, const void *m, int64_t n);
  /* *zeros = elements equal to 0 (+0 or -0) */
  int (*count_zeros)(void *ctx, fsdp_dtype dt, int64_t *zeros, const void *x, int64_t n);
  /* *bad = elements other than 0 and 1, *zeros = elements equal to 0, *hash = 32-bit FNV-1a
   * over the positions i of the zeros in order, each as 4 little-endian bytes of (uint32) i */
  int (*mask_check)(void *ctx, fsdp_dtype dt, int64_t *bad, int64_t *zeros, uint32_t *hash,
                    const void *m, int64_t n);
  /* mout[i] = (x[i] != 0); *zeros = elements of x equal to 0 */
  int (*mask_from_nonzero)(void *ctx, fsdp_dtype dt, void *mout, int64_t *zeros, const void *x,
                           int64_t n);
  /* counts (host, 2^width) += histogram of key bits [shift, shift + width) over the elements
   * whose key bits above shift + width equal prefix; 1 <= width <= 16, shift + width <= 32 */
  int (*mask_hist)(void *ctx, fsdp_dtype dt, int64_t *counts, const void *x, const void *m,
                   int64_t n, uint64_t prefix, int shift, int width);
  /* counts (host, 2^width) += histogram of position bits [shift, shift + width) of gbase + i
   * over the elements whose key is T and whose position bits above shift + width equal
   * prefix; 1 <= width <= 16, shift + width <= 63 */
  int (*mask_hist_pos)(void *ctx, fsdp_dtype dt, int64_t *counts, const void *x, const void *m,
                       int64_t n, uint32_t T, uint64_t gbase, uint64_t prefix, int shift,
                       int width);
  /* mout[i] = 0 when key < T, or key == T and gbase + i < P; else 1. *pruned = the zeros
   * written. mout may be m itself. */
  int (*mask_select)(void *ctx, fsdp_dtype dt, void *mout, int64_t *pruned, const void *x,
                     const void *m, int64_t n, uint32_t T, uint64_t gbase, uint64_t P);
  /* N:M: over each full group of M elements starting at lead (0 <= keep <= M <= 4096), mout
   * = 1 for the keep largest values (equal values: the higher index ranks first), 0 for the
   * rest; elements before lead and a trailing partial group are left as they are; *groups =
   * the full groups. mout may be m itself. */
  int (*mask_nm)(void *ctx, fsdp_dtype dt, void *mout, int64_t *groups, const void *x,
                 const void *m, int64_t n, int64_t keep, int64_t M, int64_t lead);
  /* out[i] = the value of element i (for groups a shard boundary cuts) */
  int (*mask_values)(void *ctx, fsdp_dtype dt, void *out, const void *x, const void *m,
                     int64_t n);

  /* ---- collectives ---- */
  /* out[i] = src[0][i] (+) src[1][i] (+) ... (+) src[nsrc-1][i] for i < n: the exact arithmetic
   * of the collectives (docs/comm.md): a left fold in f32 (bf16 inputs widened, one rounding at
   * the end), f64 or wrapping i64; AVG then * (float)(1.0 / nsrc) (f32, bf16) or / nsrc (f64);
   * MAX and MIN propagate NaN. Every buffer is this device's (the ranks' buffers on one device);
   * out may be one of the inputs. f32, bf16, f64, i64 (no AVG for i64); 1 <= nsrc <= 4096. */
  int (*reduce_ranks)(void *ctx, fsdp_dtype dt, fsdp_reduce_op red, void *out,
                      const void *const *src, int nsrc, int64_t n);

  /* ---- optional fusions ---- */
  /* optional: out (N, C) = gelu(inp (N, C) + bias (C)), and its backward: dinp += t (set_dinp:
   * dinp = t, its old contents never read), dbias += the column sums of t, t = gelu'(inp +
   * bias) dout (dinp or dbias may be NULL; with set_dinp, dinp may be dout itself: autograd
   * writes the input gradient over the output's when nothing else reads that); gdt is
   * dbias's dtype (dt, or f32 when dt is bf16 or f16: mixed precision). fsdp_op_bias_gelu calls
   * them for f32, bf16 and f16 and composes add and gelu for other dtypes or where the slots
   * are NULL. */
  int (*bias_gelu_forward)(void *ctx, fsdp_dtype dt, void *out, const void *inp,
                           const void *bias, int64_t N, int C);
  int (*bias_gelu_backward)(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dbias,
                            const void *dout, const void *inp, const void *bias, int64_t N,
                            int C, bool set_dinp);
  /* optional: sum (N, C) = a + b and out = layernorm(sum) (mean, rstd as layernorm_forward),
   * in one pass over the rows: a residual add and the layernorm after it read a and b once and
   * the sum is normalised while still in cache. The same bits as binary_forward (add) and then
   * layernorm_forward on the stored sum (in dt: bf16 and f16 round the sum first).
   * fsdp_op_add_layernorm makes those two calls where the slot is NULL. */
  int (*add_layernorm_forward)(void *ctx, fsdp_dtype dt, void *sum, void *out, float *mean,
                               float *rstd, const void *a, const void *b, const void *weight,
                               const void *bias, int64_t N, int C, float eps);

  /* ---- modes ---- */
  /* optional: deterministic mode on or off (fsdp.deterministic): every kernel then gives
   * bitwise repeatable results (no atomics in reductions). NULL: always deterministic. */
  int (*set_deterministic)(void *ctx, bool on);
} fsdp_kernels_i;

/* Register the devices this build has (the cpu's kernels, then any other device folder's).
 * Idempotent and thread-safe; fsdp_kernels_of calls it, so nobody else has to. */
void fsdp_kernels_init(void);
/* The kernel table of dev; NULL with "<what>: no kernels on the <name> device" when it has
 * none (meta, sharded). */
const fsdp_kernels_i *fsdp_kernels_of(const fsdp_device_i *dev, const char *what);
/* Deterministic mode on every registered device with kernels (fsdp.deterministic); returns the
 * previous setting. Devices without the slot are always deterministic. */
bool fsdp_kernels_set_deterministic(bool on);
bool fsdp_kernels_deterministic(void);
/* For kernel tables: "op <op> has no kernel for <dtype> on <device>"; returns FSDP_ERR. */
int fsdp_kernels_refuse(const char *op, fsdp_dtype dt, const char *device);

/* ---- tensor-level helpers (dispatch.c): what every layer above uses to move data ---------- */

/* dst <- src: any dtypes (converted), strides and devices (staged through the host when
 * neither side is host memory). Shapes must match. Bumps dst->version. Meta rules as
 * fsdp_tensor_copy. */
int fsdp_copy(fsdp_tensor *dst, const fsdp_tensor *src);
/* A new contiguous tensor on dev with dtype dt holding t's values (role: t's storage role, or
 * `role` when >= 0). t itself (retained) when it already is one. */
int fsdp_to(fsdp_tensor **out, fsdp_tensor *t, const fsdp_device_i *dev, fsdp_dtype dt,
            int role);
/* t's values as a contiguous tensor in host memory (t retained when it already is one): for
 * reading elements on the host (printing, item, saving). */
int fsdp_to_host(fsdp_tensor **out, fsdp_tensor *t);
/* dst += alpha * src, same shape (any strides on src; dst contiguous); dtypes may differ (src
 * is converted first). Bumps dst->version. */
int fsdp_add_into(fsdp_tensor *dst, const fsdp_tensor *src, double alpha);
/* Pointer + kernel table of a tensor's data for a kernel call: NULL with an error naming
 * `what` when t has no data or its device has no kernels. */
const fsdp_kernels_i *fsdp_kernels_for(const fsdp_tensor *t, const char *what);
/* Every element of t = v (fsdp_dtype_store's conversion), any strides, through t's kernels on
 * a device without host memory (core's fsdp_tensor_fill would stage through the host).
 * Bumps t->version; a no-op on meta; a sharded (no_data) tensor is an error. */
int fsdp_fill(fsdp_tensor *t, double v);

#endif
