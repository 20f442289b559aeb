/*
 * gemm_bf16.c — which library runs the cpu GEMMs (gemm.h: f32 through OpenBLAS or oneDNN's
 * dnnl_sgemm, bf16 natively or by conversion) and its words for fsdp.info()
 * (fsdp_cpu_gemm_describe), and the products that run as oneDNN matmuls (the native bf16 path,
 * and f32 linears with a bias): one product split by rows of the output over the rank's threads
 * (pool.h), each piece a oneDNN matmul on one thread (onednn.c).
 *
 * The pieces depend only on M and the thread count, and each output row is written by one
 * piece, so a fixed thread count gives fixed bits. Plans are made and scratch is allocated on
 * the calling thread (the rank's: its memory domain counts the bytes); the pieces only run.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <cblas.h>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/half.h"
#include "kernels/cpu/pool.h"

/* rows of the output per piece at least: below that a piece runs far below the kernel's rate */
#define MIN_ROWS 64
#define MAX_PIECES 64

/* ---- the choice ------------------------------------------------------------------------------ */

static pthread_once_t once = PTHREAD_ONCE_INIT;
static atomic_llong products, f32_products;
/* f32: oneDNN's dnnl_sgemm wherever it runs AVX-512 code (avx512_core), OpenBLAS elsewhere.
 * Measured per processor in docs/PERFORMANCE.md "GEMM libraries": where OpenBLAS 0.3.21 does
 * not know an AVX-512 processor it runs its AVX2 (Haswell) kernels at half oneDNN's rate, and
 * where it does pick its AVX-512 kernels (Cooperlake on a Zen 4) dnnl_sgemm still ran the
 * model's products 1.02-1.21 x faster and the step 8-13% faster. On AVX2 processors oneDNN is
 * not taken (not measured on such a processor; OpenBLAS keeps its bits there).
 * bf16: natively where oneDNN has AVX512_BF16 code, by conversion elsewhere. */
static bool s_supported, supported;
/* the environment's words (FSDP_GEMM, FSDP_BF16_GEMM): -1 the default, 0 off, 1 on */
static int s_env = -1, env = -1;
static char env_error[256]; /* non-empty: a variable was malformed or asks for what is absent */
static atomic_int s_forced = -1, forced = -1; /* the *_force calls: -1 none, 0 off, 1 on */

/* One variable's value: "", "auto" or unset the default (-1), off_word 0, on_word 1; anything
 * else, or on_word where the library cannot run, leaves the default and records why. */
static int env_choice(const char *name, const char *off_word, const char *on_word, bool can,
                      const char *cannot) {
  const char *v = getenv(name);
  if (!v || !*v || strcasecmp(v, "auto") == 0) return -1;
  if (strcasecmp(v, off_word) == 0) return 0;
  if (strcasecmp(v, on_word) == 0) {
    if (can) return 1;
    if (!env_error[0]) snprintf(env_error, sizeof env_error, "%s=%s: %s", name, v, cannot);
    return -1;
  }
  if (!env_error[0])
    snprintf(env_error, sizeof env_error, "%s='%.64s': unknown (%s, %s or auto)", name, v,
             off_word, on_word);
  return -1;
}

static void decide(void) {
  supported = fsdp_cpu_onednn_bf16();
  s_supported = fsdp_cpu_onednn_avx512();
  s_env = env_choice("FSDP_GEMM", "openblas", "onednn", s_supported,
                     "oneDNN cannot run f32 GEMMs here (it needs oneDNN 2.x built in and a "
                     "processor with AVX-512)");
  env = env_choice("FSDP_BF16_GEMM", "convert", "native", supported,
                   "no native bf16 GEMMs here (they need oneDNN 2.x built in and a processor "
                   "with AVX512_BF16)");
}

int fsdp_cpu_gemm_check(void) {
  pthread_once(&once, decide);
  return env_error[0] ? fsdp_error("%s", env_error) : FSDP_OK;
}

bool fsdp_cpu_sgemm_supported(void) {
  pthread_once(&once, decide);
  return s_supported;
}

bool fsdp_cpu_sgemm_onednn(void) {
  pthread_once(&once, decide);
  int f = atomic_load_explicit(&s_forced, memory_order_relaxed);
  return s_supported && (f >= 0 ? f == 1 : s_env != 0);
}

bool fsdp_cpu_sgemm_force(int mode) {
  atomic_store(&s_forced, mode < 0 ? -1 : mode > 0);
  return fsdp_cpu_sgemm_onednn();
}

bool fsdp_cpu_bf16_gemm_supported(void) {
  pthread_once(&once, decide);
  return supported;
}

bool fsdp_cpu_bf16_gemm_native(void) {
  pthread_once(&once, decide);
  int f = atomic_load_explicit(&forced, memory_order_relaxed);
  return supported && (f >= 0 ? f == 1 : env != 0);
}

bool fsdp_cpu_bf16_gemm_force(int mode) {
  atomic_store(&forced, mode < 0 ? -1 : mode > 0);
  return fsdp_cpu_bf16_gemm_native();
}

int64_t fsdp_cpu_bf16_gemm_count(void) { return atomic_load(&products); }

/* fsdp.info()'s words for the choice */
void fsdp_cpu_gemm_describe(char *buf, size_t n) {
  /* openblas_get_config(): "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64" */
  char version[32] = "?", dnnl[32] = "";
  sscanf(openblas_get_config(), "OpenBLAS %31s", version);
  fsdp_cpu_onednn_version(dnnl, sizeof dnnl);
  int len;
  if (fsdp_cpu_sgemm_onednn())
    len = snprintf(buf, n, "f32 onednn %s (avx512_core)", dnnl);
  else
    len = snprintf(buf, n, "f32 openblas %s %s%s", version, openblas_get_corename(),
                   fsdp_cpu_sgemm_supported() ? " (onednn off)" : "");
  if (len < 0 || (size_t)len >= n) return;
  if (fsdp_cpu_bf16_gemm_native())
    snprintf(buf + len, n - (size_t)len, ", bf16 onednn %s (avx512_bf16)", dnnl);
  else
    snprintf(buf + len, n - (size_t)len, ", bf16 by conversion to f32%s",
             fsdp_cpu_bf16_gemm_supported() ? " (native path off)" : "");
}

/* ---- one product over the rank's threads -------------------------------------------------------- */

typedef struct {
  int n;                     /* pieces */
  int row0[MAX_PIECES + 1];  /* piece i: output rows [row0[i], row0[i + 1]) */
  fsdp_cpu_mm *mm[MAX_PIECES];
  void *scratch[MAX_PIECES];
  int status[MAX_PIECES];
  atomic_flag failed;        /* the first failing piece keeps its message in msg */
  char msg[256];
  char *c;
  const char *a;
  const void *b;
  const void *bias;
  size_t csize, asize;       /* bytes per element of c and of a */
  int lda, ldc;
  bool trans_a;
} job;

static void run_pieces(void *ctx, int64_t lo, int64_t hi) {
  job *j = ctx;
  for (int64_t i = lo; i < hi; i++) {
    int64_t r = j->row0[i];
    /* a's rows are its columns when it is read transposed */
    const char *a = j->a + (size_t)(j->trans_a ? r : r * j->lda) * j->asize;
    j->status[i] = fsdp_cpu_mm_run(j->mm[i], j->c + (size_t)r * (size_t)j->ldc * j->csize, a,
                                   j->b, j->bias, j->scratch[i]);
    /* pieces may run on other threads, each with its own error slot */
    if (j->status[i] != FSDP_OK && !atomic_flag_test_and_set(&j->failed))
      snprintf(j->msg, sizeof j->msg, "%s", fsdp_error_msg());
  }
}

/* c = alpha op(a) op(b) (+ bias) + beta c with a and b of abdt, as pieces of rows over the
 * threads (fsdp_cpu_bf16_gemm's contract, any abdt oneDNN takes) */
static int mm_gemm(fsdp_dtype abdt, void *c, fsdp_dtype cdt, const void *a, const void *b,
                   const void *bias, fsdp_dtype bdt, int M, int N, int K, bool trans_a,
                   bool trans_b, float alpha, float beta, int lda, int ldb, int ldc) {
  job j = {.failed = ATOMIC_FLAG_INIT, .c = c, .a = a, .b = b, .bias = bias,
           .csize = fsdp_dtype_size(cdt), .asize = fsdp_dtype_size(abdt), .lda = lda,
           .ldc = ldc, .trans_a = trans_a};
  int threads = fsdp_cpu_threads(), n = M / MIN_ROWS;
  n = n > threads ? threads : n;
  n = n > MAX_PIECES ? MAX_PIECES : n < 1 ? 1 : n;
  j.n = n;
  for (int i = 0; i <= n; i++) j.row0[i] = (int)((int64_t)M * i / n);
  fsdp_cpu_work w = {0};
  int rc = FSDP_OK;
  for (int i = 0; i < n && rc == FSDP_OK; i++) {
    fsdp_cpu_mm_shape s = {.abdt = abdt, .cdt = cdt,
                           .bdt = bias ? bdt : FSDP_DTYPE_COUNT, .M = j.row0[i + 1] - j.row0[i],
                           .N = N, .K = K, .trans_a = trans_a, .trans_b = trans_b, .lda = lda,
                           .ldb = ldb, .ldc = ldc, .alpha = alpha, .beta = beta};
    size_t bytes = 0;
    rc = fsdp_cpu_mm_plan(&j.mm[i], &bytes, &s);
    if (rc == FSDP_OK && bytes) {
      j.scratch[i] = fsdp_cpu_work_buf(&w, (int64_t)bytes, 1);
      if (!j.scratch[i]) rc = FSDP_ERR;
    }
  }
  if (rc == FSDP_OK) {
    fsdp_cpu_parallel_for(n, 1, run_pieces, &j);
    for (int i = 0; i < n && rc == FSDP_OK; i++)
      if (j.status[i] != FSDP_OK) rc = fsdp_error("%s", j.msg);
  }
  int done = fsdp_cpu_work_done(&w);
  return rc == FSDP_OK ? done : rc;
}

int fsdp_cpu_bf16_gemm(void *c, fsdp_dtype cdt, const uint16_t *a, const uint16_t *b,
                       const void *bias, fsdp_dtype bdt, int M, int N, int K, bool trans_a,
                       bool trans_b, float alpha, float beta, int lda, int ldb, int ldc) {
  atomic_fetch_add_explicit(&products, 1, memory_order_relaxed);
  return mm_gemm(FSDP_DTYPE_BF16, c, cdt, a, b, bias, bdt, M, N, K, trans_a, trans_b, alpha,
                 beta, lda, ldb, ldc);
}

int fsdp_cpu_sgemm_bias(float *c, const float *a, const float *b, const float *bias, int M,
                        int N, int K, int lda, int ldb, int ldc) {
  int rc = mm_gemm(FSDP_DTYPE_F32, c, FSDP_DTYPE_F32, a, b, bias, FSDP_DTYPE_F32, M, N, K, false,
                   true, 1.0f, 0.0f, lda, ldb, ldc);
  if (rc == FSDP_OK) atomic_fetch_add_explicit(&f32_products, 1, memory_order_relaxed);
  return rc;
}

int64_t fsdp_cpu_sgemm_bias_count(void) { return atomic_load(&f32_products); }
