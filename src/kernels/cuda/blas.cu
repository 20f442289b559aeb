/*
 * blas.cu — GEMM and the ops built on it (matmul, batched matmul, linear) through cuBLASLt.
 *
 * Row-major on column-major: a row-major matrix is its transpose in column-major, so
 * c = op(a) op(b) (row-major, M x N) is computed as c^T = op(b)^T op(a)^T: cuBLASLt's A is our
 * b, its B is our a, its D (N x M, ld ldc) is our c; the transpose flags carry over unchanged.
 *
 * Types: A and B in dt (f32, bf16, f16), C and D in dt, or in f32 for the weight gradients of
 * mixed precision (a bf16 product accumulated into an f32 buffer without rounding); compute in
 * f32 (CUBLAS_COMPUTE_32F: bf16/f16 on tensor cores with f32 accumulation). f32 GEMMs use TF32
 * only when fsdp_cuda_set_tf32 turns it on (blas.h). Backward slots accumulate with beta = 1.
 *
 * Algorithms: cublasLtMatmulAlgoGetHeuristic's first choice, cached per calling thread in a
 * small table keyed by everything the choice depends on (types, shapes, leading dimensions,
 * batch strides, epilogue, pointer alignments, workspace, TF32), so steady-state calls skip the
 * heuristic and a given shape always runs the same algorithm. cuBLASLt's reductions (split-K
 * included) run in a fixed order, so results repeat bit for bit with or without deterministic
 * mode.
 *
 * cuBLASLt is loaded on the first GEMM (dlopen, lt_api), not linked: the library is half a
 * gigabyte, and mapping it costs every process that links the engine ~0.3 s and ~200 MB of
 * resident memory at startup, with or without a GPU. Each thread has its own cuBLASLt handle
 * (created on its first GEMM) and algorithm table. The 32 MiB workspace (cuBLASLt's
 * recommendation for Hopper) is scratch of each call, from the caching allocator on the
 * thread's stream (lt_workspace): cheap in the steady state, freed as soon as the GEMM is
 * queued, so it neither outlives a memory domain nor shows as a leak. When the allocator
 * refuses it, the GEMM runs without a workspace.
 */
#include <atomic>
#include <dlfcn.h>
#include <mutex>
#include <stdio.h>
#include <string.h>

#include <cublasLt.h>

#include "kernels/cuda/blas.h"
#include "kernels/cuda/rows.cuh"

#define REFUSE(op, dt) fsdp_kernels_refuse(op, dt, "cuda")

/* ---- switches -------------------------------------------------------------------------------- */

static std::atomic<bool> tf32_on{false};

extern "C" bool fsdp_cuda_set_tf32(bool on) { return tf32_on.exchange(on); }
extern "C" bool fsdp_cuda_tf32(void) { return tf32_on.load(); }

/* ---- cuBLASLt, loaded on first use ----------------------------------------------------------- */

#define LT_STR2(x) #x
#define LT_STR(x) LT_STR2(x)
#define LT_LIBRARY "libcublasLt.so." LT_STR(CUBLAS_VER_MAJOR)

/* The functions this file calls, resolved once (lt_api_ready); the names mirror cuBLASLt's. */
static struct {
  bool ready;
  char error[320];
  decltype(&cublasLtCreate) Create;
  decltype(&cublasLtGetStatusString) GetStatusString;
  decltype(&cublasLtMatmulDescCreate) MatmulDescCreate;
  decltype(&cublasLtMatmulDescDestroy) MatmulDescDestroy;
  decltype(&cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  decltype(&cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
  decltype(&cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy;
  decltype(&cublasLtMatrixLayoutSetAttribute) MatrixLayoutSetAttribute;
  decltype(&cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate;
  decltype(&cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy;
  decltype(&cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute;
  decltype(&cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic;
  decltype(&cublasLtMatmul) Matmul;
} lt_api;

static std::once_flag lt_api_once;

static void lt_api_load(void) {
  /* never closed: the functions stay valid for the life of the process */
  void *h = dlopen(LT_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *e = dlerror();
    snprintf(lt_api.error, sizeof lt_api.error, "cannot load %s: %s", LT_LIBRARY,
             e ? e : "not found");
    return;
  }
#define LT_SYM(name)                                                                           \
  if (!(lt_api.name = (decltype(lt_api.name))dlsym(h, "cublasLt" #name))) {                    \
    snprintf(lt_api.error, sizeof lt_api.error, "%s has no cublasLt%s", LT_LIBRARY, #name);    \
    return;                                                                                    \
  }
  LT_SYM(Create)
  LT_SYM(GetStatusString)
  LT_SYM(MatmulDescCreate)
  LT_SYM(MatmulDescDestroy)
  LT_SYM(MatmulDescSetAttribute)
  LT_SYM(MatrixLayoutCreate)
  LT_SYM(MatrixLayoutDestroy)
  LT_SYM(MatrixLayoutSetAttribute)
  LT_SYM(MatmulPreferenceCreate)
  LT_SYM(MatmulPreferenceDestroy)
  LT_SYM(MatmulPreferenceSetAttribute)
  LT_SYM(MatmulAlgoGetHeuristic)
  LT_SYM(Matmul)
#undef LT_SYM
  lt_api.ready = true;
}

static int lt_api_ready(const char *what) {
  std::call_once(lt_api_once, lt_api_load);
  return lt_api.ready ? FSDP_OK : fsdp_error("cuda: %s: %s", what, lt_api.error);
}

/* ---- the thread's cuBLASLt context and algorithm cache --------------------------------------- */

#define LT_WORKSPACE ((size_t)32 << 20)
#define LT_CACHE 64

typedef struct { /* zeroed before filling, so memcmp compares it */
  int32_t ab, cd, compute, epilogue, ta, tb;
  int64_t m, n, k, lda, ldb, ldc, batch, sa, sb, sc;
  uint32_t align_a, align_b, align_c, align_bias;
  uint64_t workspace;
} lt_key;

typedef struct {
  lt_key key;
  cublasLtMatmulAlgo_t algo;
  bool used, found; /* found false: the heuristic had no algorithm for this key */
} lt_entry;

typedef struct {
  cublasLtHandle_t handle;
  lt_entry cache[LT_CACHE];
  int next; /* the entry a miss replaces once the table is full (round robin) */
} lt_state;

static thread_local lt_state lt;

static int lt_fail(const char *what, const char *call, cublasStatus_t s) {
  return fsdp_error("cuda: %s: %s: %s", what, call, lt_api.GetStatusString(s));
}

/* The calling thread's handle (created on first use). */
static int lt_context(const char *what, cublasLtHandle_t *handle) {
  if (lt_api_ready(what)) return FSDP_ERR;
  if (!lt.handle) {
    cublasStatus_t s = lt_api.Create(&lt.handle);
    if (s != CUBLAS_STATUS_SUCCESS) {
      lt.handle = NULL;
      return lt_fail(what, "cublasLtCreate", s);
    }
  }
  *handle = lt.handle;
  return FSDP_OK;
}

/* A workspace for one GEMM (*bytes 0 and *ws NULL when the allocator refuses one: cuBLASLt
 * then picks among algorithms that need none); lt_workspace_free once the GEMM is queued. */
static void lt_workspace(void **ws, size_t *bytes) {
  *bytes = LT_WORKSPACE;
  if (fsdp_cuda_scratch(ws, *bytes)) {
    fsdp_error_clear();
    *ws = NULL;
    *bytes = 0;
  }
}

static void lt_workspace_free(void *ws, size_t bytes) {
  if (ws) fsdp_cuda_scratch_free(ws, bytes);
}

static lt_entry *lt_lookup(const lt_key *k) {
  for (int i = 0; i < LT_CACHE; i++)
    if (lt.cache[i].used && !memcmp(&lt.cache[i].key, k, sizeof *k)) return &lt.cache[i];
  return NULL;
}

static lt_entry *lt_insert(const lt_key *k) {
  lt_entry *e = NULL;
  for (int i = 0; i < LT_CACHE && !e; i++)
    if (!lt.cache[i].used) e = &lt.cache[i];
  if (!e) {
    e = &lt.cache[lt.next];
    lt.next = (lt.next + 1) % LT_CACHE;
  }
  memset(e, 0, sizeof *e);
  e->key = *k;
  e->used = true;
  return e;
}

/* The largest power of two (up to 256) dividing the address of every matrix of a batch. */
static uint32_t align_of(const void *p, int64_t stride_bytes) {
  uintptr_t a = (uintptr_t)p | (uintptr_t)stride_bytes;
  uint32_t al = 256;
  while (al > 1 && a % al) al >>= 1;
  return al;
}

/* ---- one GEMM -------------------------------------------------------------------------------- */

/* c = alpha op(a) op(b) + beta c (+ bias), row-major, `batch` matrices `sa`, `sb`, `sc` elements
 * apart. a and b have type ab, c and the bias type cd. */
typedef struct {
  const char *what;
  cudaDataType_t ab, cd;
  bool ta, tb;
  int64_t M, N, K;
  const void *a;
  int64_t lda;
  const void *b;
  int64_t ldb;
  void *c;
  int64_t ldc;
  int64_t batch, sa, sb, sc;
  float alpha, beta;
  const void *bias; /* (N) added to every row of c by the epilogue; NULL: none */
} rm_gemm;

static size_t type_size(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

static cudaDataType_t cuda_type(fsdp_dtype dt) {
  return dt == FSDP_DTYPE_BF16 ? CUDA_R_16BF : dt == FSDP_DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

static const char *type_name(cudaDataType_t t) {
  return t == CUDA_R_16BF ? "bf16" : t == CUDA_R_16F ? "f16" : "f32";
}

typedef struct {
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulPreference_t pref;
} lt_descs;

static void lt_descs_free(lt_descs *d) {
  if (d->pref) lt_api.MatmulPreferenceDestroy(d->pref);
  if (d->lc) lt_api.MatrixLayoutDestroy(d->lc);
  if (d->lb) lt_api.MatrixLayoutDestroy(d->lb);
  if (d->la) lt_api.MatrixLayoutDestroy(d->la);
  if (d->op) lt_api.MatmulDescDestroy(d->op);
}

static int lt_layout(cublasLtMatrixLayout_t *l, const char *what, cudaDataType_t t, int64_t rows,
                     int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
  cublasStatus_t s = lt_api.MatrixLayoutCreate(l, t, (uint64_t)rows, (uint64_t)cols, ld);
  if (s != CUBLAS_STATUS_SUCCESS) {
    *l = NULL;
    return lt_fail(what, "cublasLtMatrixLayoutCreate", s);
  }
  if (batch > 1) {
    int32_t n = (int32_t)batch;
    s = lt_api.MatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof n);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = lt_api.MatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                          &stride, sizeof stride);
    if (s != CUBLAS_STATUS_SUCCESS) return lt_fail(what, "cublasLtMatrixLayoutSetAttribute", s);
  }
  return FSDP_OK;
}

static int lt_desc_attr(cublasLtMatmulDesc_t op, const char *what,
                        cublasLtMatmulDescAttributes_t attr, const void *v, size_t n) {
  cublasStatus_t s = lt_api.MatmulDescSetAttribute(op, attr, v, n);
  return s == CUBLAS_STATUS_SUCCESS ? FSDP_OK : lt_fail(what, "cublasLtMatmulDescSetAttribute", s);
}

/* Runs g. With a bias and no algorithm for the bias epilogue, runs nothing and sets *no_bias_algo
 * (the caller adds the bias another way); without a bias that is an error. */
static int lt_matmul_ws(const rm_gemm *g, cublasLtHandle_t handle, void *ws, size_t ws_bytes,
                        bool *no_bias_algo) {

  const int32_t compute = g->ab == CUDA_R_32F && fsdp_cuda_tf32()
                              ? (int32_t)CUBLAS_COMPUTE_32F_FAST_TF32
                              : (int32_t)CUBLAS_COMPUTE_32F;
  const int32_t opa = g->tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = g->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int32_t epilogue = g->bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  const size_t es = type_size(g->ab), cs = type_size(g->cd);

  lt_descs d;
  memset(&d, 0, sizeof d);
  cublasStatus_t s = lt_api.MatmulDescCreate(&d.op, (cublasComputeType_t)compute, CUDA_R_32F);
  if (s != CUBLAS_STATUS_SUCCESS) {
    d.op = NULL;
    return lt_fail(g->what, "cublasLtMatmulDescCreate", s);
  }
  int rc = lt_desc_attr(d.op, g->what, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
  if (!rc) rc = lt_desc_attr(d.op, g->what, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
  if (!rc && g->bias) {
    const int32_t bias_type = g->cd;
    rc = lt_desc_attr(d.op, g->what, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue);
    if (!rc)
      rc = lt_desc_attr(d.op, g->what, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g->bias,
                        sizeof g->bias);
    if (!rc)
      rc = lt_desc_attr(d.op, g->what, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                        sizeof bias_type);
  }
  /* cuBLASLt's A = our b: (N x K) after its op; stored K x N when transposed */
  if (!rc)
    rc = lt_layout(&d.la, g->what, g->ab, g->tb ? g->K : g->N, g->tb ? g->N : g->K, g->ldb,
                   g->batch, g->sb);
  /* its B = our a: (K x M) after its op */
  if (!rc)
    rc = lt_layout(&d.lb, g->what, g->ab, g->ta ? g->M : g->K, g->ta ? g->K : g->M, g->lda,
                   g->batch, g->sa);
  if (!rc) rc = lt_layout(&d.lc, g->what, g->cd, g->N, g->M, g->ldc, g->batch, g->sc);
  if (rc) {
    lt_descs_free(&d);
    return rc;
  }

  lt_key key;
  memset(&key, 0, sizeof key);
  key.ab = g->ab, key.cd = g->cd, key.compute = compute, key.epilogue = epilogue;
  key.ta = g->ta, key.tb = g->tb;
  key.m = g->M, key.n = g->N, key.k = g->K, key.lda = g->lda, key.ldb = g->ldb, key.ldc = g->ldc;
  key.batch = g->batch > 1 ? g->batch : 1;
  if (key.batch > 1) key.sa = g->sa, key.sb = g->sb, key.sc = g->sc;
  key.align_a = align_of(g->b, key.sb * (int64_t)es); /* cuBLASLt's A and B */
  key.align_b = align_of(g->a, key.sa * (int64_t)es);
  key.align_c = align_of(g->c, key.sc * (int64_t)cs);
  key.align_bias = g->bias ? align_of(g->bias, 0) : 0;
  key.workspace = ws_bytes;

  lt_entry *e = lt_lookup(&key);
  if (!e) {
    const uint64_t max_ws = ws_bytes;
    s = lt_api.MatmulPreferenceCreate(&d.pref);
    if (s != CUBLAS_STATUS_SUCCESS) {
      d.pref = NULL;
      lt_descs_free(&d);
      return lt_fail(g->what, "cublasLtMatmulPreferenceCreate", s);
    }
    struct {
      cublasLtMatmulPreferenceAttributes_t attr;
      const void *v;
      size_t n;
    } prefs[] = {
        {CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof max_ws},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_a, sizeof key.align_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_b, sizeof key.align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_c, sizeof key.align_c},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_c, sizeof key.align_c},
    };
    for (size_t i = 0; i < sizeof prefs / sizeof prefs[0]; i++) {
      s = lt_api.MatmulPreferenceSetAttribute(d.pref, prefs[i].attr, prefs[i].v, prefs[i].n);
      if (s != CUBLAS_STATUS_SUCCESS) {
        lt_descs_free(&d);
        return lt_fail(g->what, "cublasLtMatmulPreferenceSetAttribute", s);
      }
    }
    cublasLtMatmulHeuristicResult_t res;
    memset(&res, 0, sizeof res);
    int found = 0;
    s = lt_api.MatmulAlgoGetHeuristic(handle, d.op, d.la, d.lb, d.lc, d.lc, d.pref, 1, &res,
                                      &found);
    e = lt_insert(&key);
    e->found = s == CUBLAS_STATUS_SUCCESS && found > 0 && res.state == CUBLAS_STATUS_SUCCESS;
    if (e->found) e->algo = res.algo;
  }
  if (!e->found) {
    lt_descs_free(&d);
    if (g->bias && no_bias_algo) {
      *no_bias_algo = true;
      return FSDP_OK;
    }
    return fsdp_error("cuda: %s: cuBLASLt has no algorithm for %s (%lld x %lld) @ (%lld x %lld)%s",
                      g->what, type_name(g->ab), (long long)g->M, (long long)g->K,
                      (long long)g->K, (long long)g->N,
                      g->cd != g->ab ? " into f32" : "");
  }
  s = lt_api.Matmul(handle, d.op, &g->alpha, g->b, d.la, g->a, d.lb, &g->beta, g->c, d.lc, g->c,
                    d.lc, &e->algo, ws, ws_bytes, fsdp_cuda_stream());
  lt_descs_free(&d);
  return s == CUBLAS_STATUS_SUCCESS ? FSDP_OK : lt_fail(g->what, "cublasLtMatmul", s);
}

static int lt_matmul(const rm_gemm *g, bool *no_bias_algo) {
  cublasLtHandle_t handle = NULL;
  if (no_bias_algo) *no_bias_algo = false;
  if (lt_context(g->what, &handle)) return FSDP_ERR;
  void *ws;
  size_t ws_bytes;
  lt_workspace(&ws, &ws_bytes);
  int rc = lt_matmul_ws(g, handle, ws, ws_bytes, no_bias_algo);
  lt_workspace_free(ws, ws_bytes);
  return rc;
}

/* ---- small kernels: what a GEMM with K == 0 leaves, and the bias without an epilogue --------- */

/* c (M, N; ld ldc) = beta c, or 0 when beta is 0 (c is then not read: it may hold NaN) */
template <typename T>
static __global__ void scale_rows(T *c, int64_t M, int64_t N, int64_t ldc, float beta) {
  const int64_t n = M * N;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t at = (i / N) * ldc + i % N;
    stf(c, at, beta == 0.0f ? 0.0f : beta * ldf(c, at));
  }
}

/* out (M, N) = bias (N) broadcast over the rows */
template <typename T>
static __global__ void bias_rows(T *out, const T *bias, int64_t M, int64_t N) {
  const int64_t n = M * N;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = bias[i % N];
}

static int scale_c(fsdp_dtype dt, void *c, int64_t M, int64_t N, int64_t ldc, float beta,
                   const char *what) {
  const unsigned grid = grid_elems(M * N, 256);
  cudaStream_t st = fsdp_cuda_stream();
  switch (dt) {
  case FSDP_DTYPE_F32: scale_rows<<<grid, 256, 0, st>>>((float *)c, M, N, ldc, beta); break;
  case FSDP_DTYPE_BF16:
    scale_rows<<<grid, 256, 0, st>>>((__nv_bfloat16 *)c, M, N, ldc, beta);
    break;
  default: scale_rows<<<grid, 256, 0, st>>>((__half *)c, M, N, ldc, beta); break;
  }
  return fsdp_cuda_launched(what);
}

static int seed_bias(fsdp_dtype dt, void *out, const void *bias, int64_t M, int64_t N) {
  const unsigned grid = grid_elems(M * N, 256);
  cudaStream_t st = fsdp_cuda_stream();
  if (dt == FSDP_DTYPE_F32)
    bias_rows<<<grid, 256, 0, st>>>((float *)out, (const float *)bias, M, N);
  else /* bf16 and f16: the same two bytes */
    bias_rows<<<grid, 256, 0, st>>>((uint16_t *)out, (const uint16_t *)bias, M, N);
  return fsdp_cuda_launched("linear");
}

static bool is_f32_family(fsdp_dtype dt) {
  return dt == FSDP_DTYPE_F32 || dt == FSDP_DTYPE_BF16 || dt == FSDP_DTYPE_F16;
}

/* ---- the slots ------------------------------------------------------------------------------- */

int fsdp_cuda_gemm(void *ctx, fsdp_dtype dt, void *c, const void *a, const void *b, int M, int N,
                   int K, bool trans_a, bool trans_b, float alpha, float beta, int lda, int ldb,
                   int ldc) {
  // c (M, N; ldc), op(a) (M, K; lda), op(b) (K, N; ldb)
  if (!is_f32_family(dt)) return REFUSE("matmul", dt);
  if (M <= 0 || N <= 0) return FSDP_OK;
  if (K <= 0) return scale_c(dt, c, M, N, ldc, beta, "matmul");
  rm_gemm g = {"matmul", cuda_type(dt), cuda_type(dt), trans_a, trans_b, M, N, K, a, lda, b,
               ldb, c, ldc, 1, 0, 0, 0, alpha, beta, NULL};
  return lt_matmul(&g, NULL);
}

int fsdp_cuda_bmm_forward(void *ctx, fsdp_dtype dt, void *out, const void *a, const void *b,
                          int B, int M, int K, int N) {
  // out (B, M, N) = a (B, M, K) @ b (B, K, N)
  if (!is_f32_family(dt)) return REFUSE("matmul", dt);
  if (B <= 0 || M <= 0 || N <= 0) return FSDP_OK;
  if (K <= 0) return scale_c(dt, out, (int64_t)B * M, N, N, 0.0f, "matmul");
  const int64_t m = M, n = N, k = K;
  rm_gemm g = {"matmul", cuda_type(dt), cuda_type(dt), false, false, m, n, k, a, k, b, n, out, n,
               B, m * k, k * n, m * n, 1.0f, 0.0f, NULL};
  return lt_matmul(&g, NULL);
}

int fsdp_cuda_bmm_backward(void *ctx, fsdp_dtype dt, void *da, void *db, const void *dout,
                           const void *a, const void *b, int B, int M, int K, int N) {
  // da (B, M, K) += dout (B, M, N) @ b^T; db (B, K, N) += a^T @ dout; either may be NULL
  if (!is_f32_family(dt)) return REFUSE("matmul", dt);
  if (B <= 0 || M <= 0 || N <= 0 || K <= 0) return FSDP_OK; /* nothing to add */
  const int64_t m = M, n = N, k = K;
  const cudaDataType_t t = cuda_type(dt);
  if (da) {
    rm_gemm g = {"matmul", t, t, false, true, m, k, n, dout, n, b, n, da, k,
                 B, m * n, k * n, m * k, 1.0f, 1.0f, NULL};
    if (lt_matmul(&g, NULL)) return FSDP_ERR;
  }
  if (db) {
    rm_gemm g = {"matmul", t, t, true, false, k, n, m, a, k, dout, n, db, n,
                 B, m * k, m * n, k * n, 1.0f, 1.0f, NULL};
    if (lt_matmul(&g, NULL)) return FSDP_ERR;
  }
  return FSDP_OK;
}

int fsdp_cuda_linear_forward(void *ctx, fsdp_dtype dt, void *out, const void *inp,
                             const void *weight, const void *bias, int M, int K, int N) {
  // out (M, N) = inp (M, K) @ weight (N, K)^T + bias (N) or NULL
  if (!is_f32_family(dt)) return REFUSE("linear", dt);
  if (M <= 0 || N <= 0) return FSDP_OK;
  const int64_t m = M, n = N, k = K;
  if (K <= 0)
    return bias ? seed_bias(dt, out, bias, m, n) : scale_c(dt, out, m, n, n, 0.0f, "linear");
  const cudaDataType_t t = cuda_type(dt);
  rm_gemm g = {"linear", t, t, false, true, m, n, k, inp, k, weight, k, out, n,
               1, 0, 0, 0, 1.0f, 0.0f, bias};
  bool no_bias_algo = false;
  if (lt_matmul(&g, bias ? &no_bias_algo : NULL)) return FSDP_ERR;
  if (!no_bias_algo) return FSDP_OK;
  /* no algorithm with the bias epilogue for this shape: seed out with the bias and add the
   * product to it (beta = 1), which still rounds once */
  if (seed_bias(dt, out, bias, m, n)) return FSDP_ERR;
  g.bias = NULL;
  g.beta = 1.0f;
  return lt_matmul(&g, NULL);
}

int fsdp_cuda_linear_backward(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dinp, void *dweight,
                              void *dbias, const void *dout, const void *inp, const void *weight,
                              int M, int K, int N) {
  // dinp (M, K) += dout (M, N) @ weight (N, K); dweight (N, K, gdt) += dout^T @ inp (M, K);
  // dbias (N, gdt) += column sums of dout; each output may be NULL
  if (!is_f32_family(dt)) return REFUSE("linear", dt);
  if (gdt != dt && !(dt != FSDP_DTYPE_F32 && gdt == FSDP_DTYPE_F32))
    return REFUSE("linear (weight gradient)", gdt);
  if (M <= 0 || N <= 0) return FSDP_OK; /* every sum is empty */
  const int64_t m = M, n = N, k = K;
  const cudaDataType_t t = cuda_type(dt), gt = cuda_type(gdt);
  if (dinp && K > 0) {
    rm_gemm g = {"linear", t, t, false, false, m, k, n, dout, n, weight, k, dinp, k,
                 1, 0, 0, 0, 1.0f, 1.0f, NULL};
    if (lt_matmul(&g, NULL)) return FSDP_ERR;
  }
  if (dweight && K > 0) {
    rm_gemm g = {"linear", t, gt, true, false, n, k, m, dout, n, inp, k, dweight, k,
                 1, 0, 0, 0, 1.0f, 1.0f, NULL};
    if (lt_matmul(&g, NULL)) return FSDP_ERR;
  }
  if (!dbias) return FSDP_OK;
  switch (dt) {
  case FSDP_DTYPE_F32:
    return colsum_acc((float *)dbias, (float *)NULL, (const float *)dout, (const float *)NULL,
                      NULL, NULL, m, n, "linear");
  case FSDP_DTYPE_BF16: {
    const __nv_bfloat16 *g = (const __nv_bfloat16 *)dout, *none = NULL;
    if (gdt == FSDP_DTYPE_F32)
      return colsum_acc((float *)dbias, (float *)NULL, g, none, NULL, NULL, m, n, "linear");
    return colsum_acc((__nv_bfloat16 *)dbias, (__nv_bfloat16 *)NULL, g, none, NULL, NULL, m, n,
                      "linear");
  }
  default: {
    const __half *g = (const __half *)dout, *none = NULL;
    if (gdt == FSDP_DTYPE_F32)
      return colsum_acc((float *)dbias, (float *)NULL, g, none, NULL, NULL, m, n, "linear");
    return colsum_acc((__half *)dbias, (__half *)NULL, g, none, NULL, NULL, m, n, "linear");
  }
  }
}
