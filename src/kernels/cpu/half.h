/*
 * half.h — private to src/kernels/cpu: the bf16 / f16 conversion pass (half.c) behind the cpu
 * table's half-precision slots. Same arguments as the f32 kernels of kernels.h plus the dtype
 * (bf16 or f16); each returns FSDP_OK, or FSDP_ERR when its scratch cannot be allocated.
 */
#ifndef FSDP_KERNELS_CPU_HALF_H
#define FSDP_KERNELS_CPU_HALF_H

#include "kernels/cpu/kernels.h"

/* The scratch of one kernel call (table.c and half.c): storages through core, role
 * activations, so the memory report shows what the conversion pass costs. */
#define FSDP_CPU_WORK_MAX 10
typedef struct {
  fsdp_storage *s[FSDP_CPU_WORK_MAX];
  int n;
  bool failed; /* a buffer could not be allocated (the error is set) */
} fsdp_cpu_work;
/* n elements of esize bytes, 64-byte aligned; NULL (and w->failed) on failure */
void *fsdp_cpu_work_buf(fsdp_cpu_work *w, int64_t n, size_t esize);
/* Release every buffer; FSDP_ERR when one could not be allocated. */
int fsdp_cpu_work_done(fsdp_cpu_work *w);

int fsdp_cpu_half_axpy(fsdp_dtype dt, void *y, const void *x, float alpha, int64_t n);
int fsdp_cpu_half_affine_forward(fsdp_dtype dt, void *out, const void *a, float s, float t,
                                 int64_t n);
int fsdp_cpu_half_binary_forward(fsdp_dtype dt, void *out, const void *a, const void *b,
                                 int64_t n, int64_t m, fsdp_binop op);
int fsdp_cpu_half_binary_backward(fsdp_dtype dt, void *da, void *db, const void *dout,
                                  const void *a, const void *b, int64_t n, int64_t m,
                                  fsdp_binop op);
/* f32: the table's f32 unary forward / backward */
int fsdp_cpu_half_unary_forward(fsdp_dtype dt, fsdp_unary_op op, void *out, const void *in,
                                int64_t n,
                                void (*f32)(fsdp_unary_op, float *, const float *, int64_t));
int fsdp_cpu_half_unary_backward(fsdp_dtype dt, fsdp_unary_op op, void *din, const void *dout,
                                 const void *in, const void *out, int64_t n,
                                 void (*f32)(fsdp_unary_op, float *, const float *,
                                             const float *, const float *, int64_t));
int fsdp_cpu_half_dropout_forward(fsdp_dtype dt, void *out, void *mask, const void *in,
                                  int64_t n, float p, uint64_t key, uint64_t first);
int fsdp_cpu_half_dropout_backward(fsdp_dtype dt, void *din, const void *dout, const void *mask,
                                   int64_t n);
/* bias + GELU (kernels.h's fsdp_cpu_bias_gelu_*); gdt: the dtype of dbias, dt or f32 */
int fsdp_cpu_half_bias_gelu_forward(fsdp_dtype dt, void *out, const void *inp, const void *bias,
                                    int64_t N, int C);
int fsdp_cpu_half_bias_gelu_backward(fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dbias,
                                     const void *dout, const void *inp, const void *bias,
                                     int64_t N, int C, bool set_dinp);
/* Whether a product of dt with these sizes takes the native bf16 path (gemm.h): bf16, the path
 * on, M, N, K >= 1 and not tiny. Then the table's gemm slot calls fsdp_cpu_bf16_gemm and its bmm
 * slots the two below (same arguments as the f32 kernels; bf16 gradients += as theirs); linear
 * checks it itself. */
bool fsdp_cpu_half_native(fsdp_dtype dt, int M, int N, int K);
int fsdp_cpu_half_bmm_forward(fsdp_dtype dt, void *out, const void *a, const void *b, int B,
                              int M, int K, int N);
int fsdp_cpu_half_bmm_backward(fsdp_dtype dt, void *da, void *db, const void *dout,
                               const void *a, const void *b, int B, int M, int K, int N);
int fsdp_cpu_half_linear_forward(fsdp_dtype dt, void *out, const void *inp, const void *weight,
                                 const void *bias, int M, int K, int N);
/* gdt: the dtype of dweight and dbias, dt or f32 (kernels.h) */
int fsdp_cpu_half_linear_backward(fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dweight,
                                  void *dbias, const void *dout, const void *inp,
                                  const void *weight, int M, int K, int N);
int fsdp_cpu_half_layernorm_forward(fsdp_dtype dt, void *out, float *mean, float *rstd,
                                    const void *inp, const void *weight, const void *bias,
                                    int64_t N, int C, float eps);
int fsdp_cpu_half_add_layernorm_forward(fsdp_dtype dt, void *sum, void *out, float *mean,
                                        float *rstd, const void *a, const void *b,
                                        const void *weight, const void *bias, int64_t N, int C,
                                        float eps);
int fsdp_cpu_half_layernorm_backward(fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dweight,
                                     void *dbias, const void *dout, const void *inp,
                                     const void *weight, const float *mean, const float *rstd,
                                     int64_t N, int C);
int fsdp_cpu_half_softmax_forward(fsdp_dtype dt, void *out, const void *inp, int64_t N, int C);
int fsdp_cpu_half_softmax_backward(fsdp_dtype dt, void *dinp, const void *dout, const void *out,
                                   int64_t N, int C);
int fsdp_cpu_half_cross_entropy_forward(fsdp_dtype dt, float *loss, float *lse,
                                        const void *logits, const int64_t *targets, int64_t N,
                                        int V, int64_t ignore, int64_t *count);
int fsdp_cpu_half_cross_entropy_backward(fsdp_dtype dt, void *dlogits, float dloss,
                                         const void *logits, const float *lse,
                                         const int64_t *targets, int64_t N, int V,
                                         int64_t ignore, int64_t count);
/* Native bf16 attention (attention_bf16.c): whether it takes a call of these sizes (the native
 * bf16 products on, AVX512_BF16 at the AVX-512 level, even T and head size, T within its
 * bound), and the two kernels (set: dqkv written, else added). Each returns FSDP_OK, FSDP_ERR
 * (message set: scratch over the budget) or FSDP_CPU_OTHER_WAY (qkv or dout not at an even
 * address of 32-bit words; nothing written: the caller computes it all the widening way). */
#define FSDP_CPU_OTHER_WAY 2
bool fsdp_cpu_bf16_attention_native(int B, int T, int C, int NH);
/* whether qkv and dout (NULL: the forward) are where the native kernels take them: else
 * FSDP_CPU_OTHER_WAY */
bool fsdp_cpu_bf16_attention_aligned(const void *qkv, const void *dout);
int fsdp_cpu_bf16_attention_forward(uint16_t *out, float *stats, const uint16_t *qkv, int B,
                                    int T, int C, int NH);
int fsdp_cpu_bf16_attention_backward(uint16_t *dqkv, const uint16_t *dout, const uint16_t *qkv,
                                     const float *stats, int B, int T, int C, int NH, bool set);
/* The bf16 attention's products on AVX512_BF16 (att_bf16.c); supported: the processor has it
 * and the AVX-512 level is in force (FSDP_CPU_ISA). c (M, N, row stride ldc, f32 or bf16 when
 * cbf16) = alpha * a @ b (acc: + c, a bf16 c rounded once), sums f32. a's (m, k) element at
 * a[m * sam + (k / 2) * sap + k % 2]: pairs adjacent along k, read as one 32-bit word. b is
 * (K / 2, N) words, row stride ldb, each the pair (b[k][n], b[k + 1][n]) in its low and high
 * half, rows readable up to N rounded up to 16. kind and diag as isa.h's att_mm, bounds taken in
 * whole pairs: the element of a pair past a bound (and past K) must be zero in a. Denormal
 * inputs count as zero, denormal results are flushed (the instruction's rule). */
bool fsdp_cpu_att_bf16_supported(void);
void fsdp_cpu_att_bf16_mm(void *c, int64_t ldc, bool cbf16, const uint16_t *a, int64_t sam,
                          int64_t sap, const uint32_t *b, int64_t ldb, int M, int N, int K,
                          int diag, int kind, float alpha, bool acc);
/* dst (rows / 2 rounded up, cols rounded up to 16) words: dst[r / 2][c] = (src[r][c],
 * src[r + 1][c]), zeros past the last row and column (rows of src with stride lds) */
void fsdp_cpu_att_bf16_interleave(uint32_t *dst, int64_t ldd, const uint16_t *src, int64_t lds,
                                  int rows, int cols);
/* The half dtypes' attention, natively or widened to f32. stats: (B, NH, T, 2) f32, each query
 * row's softmax max and reciprocal sum, or NULL; the forward writes them, the backward rebuilds
 * the probabilities from them in one pass (the forward's bits either way: without them it
 * recomputes each row whole). The forward and the backward of one call must see the same
 * settings (FSDP_BF16_GEMM, the instruction-set level): the native way's stats are not the
 * widening way's. */
int fsdp_cpu_half_attention_forward(fsdp_dtype dt, void *out, float *stats, const void *qkv,
                                    int B, int T, int C, int NH);
int fsdp_cpu_half_attention_backward(fsdp_dtype dt, void *dqkv, const void *dout,
                                     const void *qkv, const float *stats, int B, int T, int C,
                                     int NH, bool set_dqkv);
int fsdp_cpu_half_mse_forward(fsdp_dtype dt, float *out, const void *a, const void *b,
                              int64_t n);
int fsdp_cpu_half_mse_backward(fsdp_dtype dt, void *da, void *db, float dloss, const void *a,
                               const void *b, int64_t n);
/* sum (or sum of squares) of n half values, in double */
int fsdp_cpu_half_sum(fsdp_dtype dt, double *out, const void *in, int64_t n, bool squares);

#endif
