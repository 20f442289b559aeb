/*
 * gemm.h — private to src/kernels/cpu: the libraries behind the cpu GEMMs and the native bf16
 * GEMM path.
 *
 * f32: fsdp_cpu_sgemm_serial (kernels.h; gemm.c): oneDNN's dnnl_sgemm where oneDNN runs
 * AVX-512 code, OpenBLAS elsewhere (docs/PERFORMANCE.md "GEMM libraries" has the figures).
 * bf16: on a processor with AVX512_BF16 and a build with oneDNN, bf16 products run as oneDNN
 * matmuls (bf16 x bf16 with f32 accumulation, gemm_bf16.c over onednn.c) split by rows of the
 * output over the rank's threads (pool.h), one oneDNN thread per piece; elsewhere they take the
 * conversion pass (half.c, table.c: widen to f32, sgemm, round back). FSDP_GEMM and
 * FSDP_BF16_GEMM override the choice (docs/cli.md "GEMM library").
 */
#ifndef FSDP_KERNELS_CPU_GEMM_H
#define FSDP_KERNELS_CPU_GEMM_H

#include "kernels/cpu/kernels.h"

/* ---- f32: OpenBLAS or oneDNN (the choice in gemm_bf16.c) -------------------------------------- */

/* Whether f32 GEMMs (fsdp_cpu_sgemm_serial) run through oneDNN's dnnl_sgemm now: supported
 * (below), and neither FSDP_GEMM=openblas nor fsdp_cpu_sgemm_force(0) turned it off.
 * Otherwise OpenBLAS. */
bool fsdp_cpu_sgemm_onednn(void);
/* Whether oneDNN could take f32 GEMMs here: built in, and it runs AVX-512 code (avx512_core).
 * It then does by default. */
bool fsdp_cpu_sgemm_supported(void);
/* Tests and benchmarks: 1 oneDNN (where supported), 0 OpenBLAS, -1 back to the default.
 * Returns whether oneDNN is now taken. Process-wide. */
bool fsdp_cpu_sgemm_force(int mode);

/* ---- the native bf16 path (gemm_bf16.c) ------------------------------------------------------ */

/* Whether bf16 GEMMs take the native path now: built with oneDNN, the processor has
 * AVX512_BF16, and neither FSDP_BF16_GEMM=convert nor fsdp_cpu_bf16_gemm_force(0) turned it
 * off. */
bool fsdp_cpu_bf16_gemm_native(void);
/* Whether the native path could run here (oneDNN built in, AVX512_BF16): what "on" can mean. */
bool fsdp_cpu_bf16_gemm_supported(void);
/* Tests and benchmarks: 1 native (where supported), 0 conversion pass, -1 back to the default
 * (the environment's choice, else native where supported). Returns whether the native path is
 * now taken. Process-wide. */
bool fsdp_cpu_bf16_gemm_force(int mode);

/* Products the native path has run in this process (tests check which path a slot took). */
int64_t fsdp_cpu_bf16_gemm_count(void);

/* c (M, N) = alpha * op(a) @ op(b) + beta * c, a and b bf16 (row-major, row strides lda / ldb,
 * op as in fsdp_cpu_gemm), c of cdt (bf16 or f32, row stride ldc); bias (N elements of bdt) is
 * added to every row when non-NULL. beta == 0 ignores c's contents. M, N, K >= 1. Products are
 * exact, sums are f32 (in oneDNN's order), a bf16 c is rounded once at the end; denormal bf16
 * inputs count as zero. Call only when fsdp_cpu_bf16_gemm_native(); FSDP_ERR when oneDNN or the
 * scratch fails (message set), c is then unspecified. */
int fsdp_cpu_bf16_gemm(void *c, fsdp_dtype cdt, const uint16_t *a, const uint16_t *b,
                       const void *bias, fsdp_dtype bdt, int M, int N, int K, bool trans_a,
                       bool trans_b, float alpha, float beta, int lda, int ldb, int ldc);

/* c (M, N) = a (M, K, row stride lda) @ b^T (b: N x K, row stride ldb) + bias (N), f32, as
 * oneDNN matmuls with the bias in their epilogue, split by rows over the rank's threads like
 * fsdp_cpu_bf16_gemm (a fixed thread count gives fixed bits). A linear forward with a bias
 * otherwise seeds c's rows with the bias and lets sgemm add into them: one more pass over c,
 * measured 5% of the product in isolation and more inside a step, where c is not in cache.
 * Call only when fsdp_cpu_sgemm_onednn(); FSDP_ERR (message set) when oneDNN or the scratch
 * fails, c then unspecified (the caller computes it the other way). */
int fsdp_cpu_sgemm_bias(float *c, const float *a, const float *b, const float *bias, int M,
                        int N, int K, int lda, int ldb, int ldc);
/* Products fsdp_cpu_sgemm_bias has completed in this process (tests check which path ran). */
int64_t fsdp_cpu_sgemm_bias_count(void);

/* What runs the GEMMs here, e.g. "f32 onednn 2.6.3 (avx512_core), bf16 onednn 2.6.3
 * (avx512_bf16)" or "f32 openblas 0.3.21 Haswell, bf16 by conversion to f32", into buf (always
 * terminated). */
void fsdp_cpu_gemm_describe(char *buf, size_t n);

/* ---- oneDNN (onednn.c; onednn_stub.c in a build without it) -------------------------------- */

/* One product for oneDNN: a and b of abdt, c of cdt, bias of bdt (FSDP_DTYPE_COUNT: none).
 * batch > 1 makes it `batch` products at once, the i-th operands at element offsets i * bsa,
 * i * bsb, i * bsc from the given pointers (attention's heads: column blocks of one buffer);
 * batched products take no bias. */
typedef struct {
  fsdp_dtype abdt, cdt, bdt;
  int M, N, K;
  bool trans_a, trans_b;
  int lda, ldb, ldc;
  float alpha, beta;
  int batch;
  int64_t bsa, bsb, bsc;
} fsdp_cpu_mm_shape;

typedef struct fsdp_cpu_mm fsdp_cpu_mm; /* a ready matmul primitive */

/* c = alpha op(a) op(b) + beta c in f32 through dnnl_sgemm on the calling thread alone (arguments
 * as fsdp_cpu_sgemm_serial's). FSDP_ERR (message set) when oneDNN refuses or is not built in. */
int fsdp_cpu_onednn_sgemm(float *c, const float *a, const float *b, int M, int N, int K,
                          bool trans_a, bool trans_b, float alpha, float beta, int lda, int ldb,
                          int ldc);
/* Whether oneDNN is built in and runs AVX-512 code here (avx512_core or better). */
bool fsdp_cpu_onednn_avx512(void);
/* Whether oneDNN is built in; its version ("2.6.3") into buf ("" without). */
bool fsdp_cpu_onednn_version(char *buf, size_t n);
/* Whether oneDNN is built in and runs bf16 products natively on this processor (its ISA check:
 * AVX512_BF16 or better, lowered by DNNL_MAX_CPU_ISA). */
bool fsdp_cpu_onednn_bf16(void);
/* The primitive for s, from the calling thread's cache (created on a miss; the calling thread
 * is set to one OpenMP thread first). It stays valid until this thread's next plan call that
 * misses or the thread exits. *scratch: the bytes of scratch fsdp_cpu_mm_run needs.
 * FSDP_ERR (message set) when oneDNN refuses. */
int fsdp_cpu_mm_plan(fsdp_cpu_mm **out, size_t *scratch, const fsdp_cpu_mm_shape *s);
/* Run a planned product on the calling thread (any thread; one oneDNN thread); scratch holds
 * the plan's bytes (may be NULL when 0). FSDP_ERR (message set) on failure. */
int fsdp_cpu_mm_run(const fsdp_cpu_mm *p, void *c, const void *a, const void *b,
                    const void *bias, void *scratch);
/* The implementation oneDNN picked for p ("brg:avx512_core_bf16", "gemm:jit", ...). */
const char *fsdp_cpu_mm_impl(const fsdp_cpu_mm *p);

#endif
