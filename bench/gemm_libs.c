/*
 * gemm_libs.c — the GEMM libraries side by side at the GPT's shapes, one thread per call (not a
 * test; prints numbers, exits 0). docs/PERFORMANCE.md "GEMM libraries" reads it.
 *
 * f32: OpenBLAS (cblas_sgemm, at the kernels it picked for this processor), BLIS 0.9 (bli_sgemm; when built with
 * libblis-dev), oneDNN 2.6 dnnl_sgemm and oneDNN's matmul primitive (gemm.h; when the engine has
 * oneDNN). bf16 (mixed precision): the cpu table's bf16 slots with the conversion pass (widen to
 * f32, OpenBLAS, round) against the same slots on the native path (oneDNN bf16 x bf16 -> f32
 * accumulation), where the processor has AVX512_BF16.
 *
 * Shapes, for d in {256, 384, 768} and rows = B*T in {2048, 1024} (one rank, and each of 2):
 * the layer's four linears (qkv d -> 3d, proj d -> d, fc d -> 4d, fc2 4d -> d) and the tied head
 * (d -> 256), each as its three products: forward out = x W^T (NT), dinp += dout W (NN),
 * dW += dout^T x (TN); dW also by half its rows (the piece one of 2 threads takes when a GEMM is
 * split by output rows; forward and dinp halves are the 1024-row shapes). Attention (T = 256,
 * head size 64): attention.c's blocked products on strided views of qkv, forward and backward
 * over every head of one sequence, and the plain T x T x 64 products the bmm slot runs.
 * "layer" rows sum a layer's twelve linear products: the share of the step the choice decides.
 *
 * Timing: each (shape, library) runs >= 25 ms of calls per round, libraries interleaved within
 * a round (A, B, C, A, B, C, ...), best round of --rounds (default 3). The load average is
 * printed at the start and the end of every section: compare ratios within a run.
 *
 * Usage: gemm_libs [--d=256,384,768] [--rows=2048,1024] [--rounds=3] [--no-bf16] [--threads]
 *   --threads also starts each library at its default thread count afterwards and reports the
 *   threads the process holds (what a library starts behind the pool's back).
 */
#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/pool.h"
#include "kernels/kernels.h"

#ifdef FSDP_BENCH_BLIS
#include <blis.h>
#endif
#ifdef FSDP_BENCH_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void loadavg(const char *when) {
  char buf[128] = "?";
  FILE *f = fopen("/proc/loadavg", "r");
  if (f) {
    if (!fgets(buf, sizeof buf, f)) strcpy(buf, "?\n");
    fclose(f);
  }
  printf("# load average (%s): %s", when, buf);
}

static int threads_now(void) {
  int n = 0;
  DIR *d = opendir("/proc/self/task");
  if (!d) return -1;
  for (struct dirent *e; (e = readdir(d));)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

static void *xmalloc(size_t n) {
  void *p = aligned_alloc(64, (n + 63) / 64 * 64);
  if (!p) {
    fprintf(stderr, "gemm_libs: out of memory (%zu bytes)\n", n);
    exit(1);
  }
  return p;
}

/* ---- one product ---------------------------------------------------------------------------- */

typedef enum { FWD, DINP, DW, PLAIN } kind;

typedef struct {
  char name[48];
  kind kind;
  int rows, in, out; /* the linear's sizes (FWD, DINP, DW) */
  /* the GEMM: c (M, N) = op(a) (M, K) op(b) (K, N) + beta c */
  int M, N, K, lda, ldb, ldc;
  bool ta, tb;
  float beta;
} prob;

static prob linear_prob(const char *name, kind k, int rows, int in, int out, bool half) {
  prob p = {.kind = k, .rows = rows, .in = in, .out = out};
  snprintf(p.name, sizeof p.name, "%s", name);
  switch (k) {
  case FWD: /* out (rows, out) = x (rows, in) W (out, in)^T */
    p.M = rows, p.N = out, p.K = in, p.tb = true, p.lda = in, p.ldb = in, p.ldc = out;
    break;
  case DINP: /* dx (rows, in) += dout (rows, out) W (out, in) */
    p.M = rows, p.N = in, p.K = out, p.lda = out, p.ldb = in, p.ldc = in, p.beta = 1;
    break;
  default: /* dW (out, in) += dout^T x; half: the first out / 2 rows of dW */
    p.M = half ? out / 2 : out, p.N = in, p.K = rows, p.ta = true, p.lda = out, p.ldb = in,
    p.ldc = in, p.beta = 1;
    break;
  }
  return p;
}

static double flops(const prob *p) { return 2.0 * p->M * p->N * p->K; }

/* operands, f32 and bf16, big enough for the stored extents */
typedef struct {
  float *a, *b, *c;
  uint16_t *a16, *b16, *c16;
  int64_t na, nb, nc;
  void *scratch; /* oneDNN matmul's, scratch_size bytes */
  size_t scratch_size;
} bufs;

static void fill(float *p, int64_t n, uint32_t seed) {
  for (int64_t i = 0; i < n; i++) {
    seed = seed * 1664525u + 1013904223u;
    p[i] = (float)(seed >> 8) * (1.0f / 16777216.0f) - 0.5f;
  }
}

static void bufs_make(bufs *B, const prob *p) {
  B->na = (int64_t)(p->ta ? p->K : p->M) * p->lda;
  B->nb = (int64_t)(p->tb ? p->N : p->K) * p->ldb;
  B->nc = (int64_t)p->M * p->ldc;
  /* a DW piece reads dout's first M columns of `out`; the linear slots want whole tensors */
  if (p->kind == DW) B->na = (int64_t)p->rows * p->out, B->nc = (int64_t)p->out * p->in;
  B->a = xmalloc(4 * B->na), B->b = xmalloc(4 * B->nb), B->c = xmalloc(4 * B->nc);
  fill(B->a, B->na, 1), fill(B->b, B->nb, 2), fill(B->c, B->nc, 3);
  B->a16 = xmalloc(2 * B->na), B->b16 = xmalloc(2 * B->nb), B->c16 = xmalloc(2 * B->nc);
  fsdp_cpu_cast(B->a16, FSDP_DTYPE_BF16, B->a, FSDP_DTYPE_F32, B->na);
  fsdp_cpu_cast(B->b16, FSDP_DTYPE_BF16, B->b, FSDP_DTYPE_F32, B->nb);
  fsdp_cpu_cast(B->c16, FSDP_DTYPE_BF16, B->c, FSDP_DTYPE_F32, B->nc);
  B->scratch = NULL, B->scratch_size = 0;
}

static void bufs_free(bufs *B) {
  free(B->a), free(B->b), free(B->c), free(B->a16), free(B->b16), free(B->c16), free(B->scratch);
}

/* ---- the libraries ---------------------------------------------------------------------------- */

typedef struct lib {
  const char *name;
  bool bf16;                       /* a bf16 column (ratio against the conversion pass) */
  int (*run)(const prob *p, bufs *B); /* FSDP_OK, or FSDP_ERR when it cannot run p */
} lib;

/* OpenBLAS itself (the engine's fsdp_cpu_sgemm_serial may be oneDNN: "# engine" says which) */
static int run_openblas(const prob *p, bufs *B) {
  cblas_sgemm(CblasRowMajor, p->ta ? CblasTrans : CblasNoTrans, p->tb ? CblasTrans : CblasNoTrans,
              p->M, p->N, p->K, 1.0f, B->a, p->lda, B->b, p->ldb, p->beta, B->c, p->ldc);
  return FSDP_OK;
}

#ifdef FSDP_BENCH_BLIS
/* BLIS by dlopen (CMakeLists.txt says why), its functions by their header's prototypes */
static __typeof__(bli_sgemm) *blis_sgemm;
static __typeof__(bli_thread_set_num_threads) *blis_set_threads;
static __typeof__(bli_info_get_version_str) *blis_version;
static __typeof__(bli_arch_query_id) *blis_arch_id;
static __typeof__(bli_arch_string) *blis_arch_string;

static bool blis_load(void) {
  void *h = dlopen(FSDP_BENCH_BLIS, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    printf("# blis: %s: skipped\n", dlerror());
    return false;
  }
  blis_sgemm = (__typeof__(blis_sgemm))dlsym(h, "bli_sgemm");
  blis_set_threads = (__typeof__(blis_set_threads))dlsym(h, "bli_thread_set_num_threads");
  blis_version = (__typeof__(blis_version))dlsym(h, "bli_info_get_version_str");
  blis_arch_id = (__typeof__(blis_arch_id))dlsym(h, "bli_arch_query_id");
  blis_arch_string = (__typeof__(blis_arch_string))dlsym(h, "bli_arch_string");
  if (!blis_sgemm || !blis_set_threads || !blis_version || !blis_arch_id || !blis_arch_string) {
    printf("# blis: %s lacks a function the bench calls: skipped\n", FSDP_BENCH_BLIS);
    return false;
  }
  return true;
}

static int run_blis(const prob *p, bufs *B) {
  float alpha = 1.0f, beta = p->beta;
  /* op(a)(i, k) at i * rs + k * cs: a transposed operand is the stored one with strides swapped */
  blis_sgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, p->M, p->N, p->K, &alpha, B->a,
            p->ta ? 1 : p->lda, p->ta ? p->lda : 1, B->b, p->tb ? 1 : p->ldb, p->tb ? p->ldb : 1,
            &beta, B->c, p->ldc, 1);
  return FSDP_OK;
}
#endif

#ifdef FSDP_BENCH_ONEDNN
static int run_dnnl_sgemm(const prob *p, bufs *B) {
  return dnnl_sgemm(p->ta ? 'T' : 'N', p->tb ? 'T' : 'N', p->M, p->N, p->K, 1.0f, B->a, p->lda,
                    B->b, p->ldb, p->beta, B->c, p->ldc) == dnnl_success
             ? FSDP_OK
             : FSDP_ERR;
}

static int run_dnnl_matmul(const prob *p, bufs *B) {
  fsdp_cpu_mm_shape s = {FSDP_DTYPE_F32, FSDP_DTYPE_F32, FSDP_DTYPE_COUNT, p->M, p->N, p->K,
                         p->ta, p->tb, p->lda, p->ldb, p->ldc, 1.0f, p->beta, 0, 0, 0, 0};
  fsdp_cpu_mm *mm;
  size_t bytes;
  if (fsdp_cpu_mm_plan(&mm, &bytes, &s)) return FSDP_ERR;
  if (bytes > B->scratch_size) {
    free(B->scratch);
    B->scratch = xmalloc(bytes), B->scratch_size = bytes;
  }
  return fsdp_cpu_mm_run(mm, B->c, B->a, B->b, NULL, B->scratch);
}
#endif

static const fsdp_kernels_i *cpu;

/* the cpu table's bf16 slot for p: what a mixed-precision step runs (weight gradients in f32) */
static int run_slot(const prob *p, bufs *B) {
  switch (p->kind) {
  case FWD:
    return cpu->linear_forward(NULL, FSDP_DTYPE_BF16, B->c16, B->a16, B->b16, NULL, p->rows,
                               p->in, p->out);
  case DINP:
    return cpu->linear_backward(NULL, FSDP_DTYPE_BF16, FSDP_DTYPE_F32, B->c16, NULL, NULL, B->a16,
                                NULL, B->b16, p->rows, p->in, p->out);
  case DW:
    if (p->M != p->out) return FSDP_ERR; /* a piece: not a slot call */
    return cpu->linear_backward(NULL, FSDP_DTYPE_BF16, FSDP_DTYPE_F32, NULL, B->c, NULL, B->a16,
                                B->b16, NULL, p->rows, p->in, p->out);
  default:
    return cpu->gemm(NULL, FSDP_DTYPE_BF16, B->c16, B->a16, B->b16, p->M, p->N, p->K, p->ta,
                     p->tb, 1.0f, p->beta, p->lda, p->ldb, p->ldc);
  }
}

static int run_convert(const prob *p, bufs *B) {
  fsdp_cpu_bf16_gemm_force(0);
  int rc = run_slot(p, B);
  fsdp_cpu_bf16_gemm_force(-1);
  return rc;
}

static int run_native(const prob *p, bufs *B) {
  if (!fsdp_cpu_bf16_gemm_force(1)) return FSDP_ERR;
  int rc = run_slot(p, B);
  fsdp_cpu_bf16_gemm_force(-1);
  return rc;
}

static lib libs[8];
#ifdef FSDP_BENCH_BLIS
static bool have_blis;
#endif
static int nlibs;

/* ---- timing ----------------------------------------------------------------------------------- */

static int rounds = 3;

/* seconds per call of each library on p (negative: it could not run p), interleaved rounds */
static void time_prob(const prob *p, double *best) {
  bufs B;
  bufs_make(&B, p);
  for (int l = 0; l < nlibs; l++) best[l] = libs[l].run(p, &B) == FSDP_OK ? 1e30 : -1; /* warm */
  for (int r = 0; r < rounds; r++) {
    for (int l = 0; l < nlibs; l++) {
      if (best[l] < 0) continue;
      int calls = 0;
      double t0 = now(), t;
      do {
        libs[l].run(p, &B);
        calls++;
        t = now() - t0;
      } while (t < 0.025 || calls < 2);
      if (t / calls < best[l]) best[l] = t / calls;
    }
  }
  bufs_free(&B);
}

static void header(const char *title) {
  printf("\n%-30s %-15s", title, "M x N x K");
  for (int l = 0; l < nlibs; l++) printf(" %12s", libs[l].name);
  printf("   GFLOP/s; ratios: f32 vs openblas, bf16 native vs conversion\n");
}

/* one row: GFLOP/s per library, then the ratios */
static void row(const prob *p, const double *best) {
  char dims[32];
  snprintf(dims, sizeof dims, "%dx%dx%d %c%c", p->M, p->N, p->K, p->ta ? 'T' : 'N',
           p->tb ? 'T' : 'N');
  printf("%-30s %-15s", p->name, dims);
  for (int l = 0; l < nlibs; l++) {
    if (best[l] < 0) printf(" %12s", "-");
    else printf(" %12.1f", flops(p) / best[l] * 1e-9);
  }
  printf("  ");
  double conv = -1;
  for (int l = 0; l < nlibs; l++) {
    if (best[l] < 0) continue;
    if (!libs[l].bf16 && l > 0 && best[0] > 0) printf(" %s %.2f", libs[l].name, best[0] / best[l]);
    if (libs[l].bf16 && conv < 0) conv = best[l];
    else if (libs[l].bf16) printf(" %s %.2f", libs[l].name, conv / best[l]);
  }
  printf("\n");
}

/* totals of a group of rows: flops / summed time per library */
typedef struct {
  double fl, t[8];
  bool missing[8];
} total;

static void add(total *T, const prob *p, const double *best) {
  T->fl += flops(p);
  for (int l = 0; l < nlibs; l++) {
    if (best[l] < 0) T->missing[l] = true;
    else T->t[l] += best[l];
  }
}

static void total_row(const char *name, const total *T) {
  char dims[32];
  snprintf(dims, sizeof dims, "%.2f GFLOP", T->fl * 1e-9);
  printf("%-30s %-15s", name, dims);
  for (int l = 0; l < nlibs; l++) {
    if (T->missing[l]) printf(" %12s", "-");
    else printf(" %12.1f", T->fl / T->t[l] * 1e-9);
  }
  printf("  ");
  double conv = -1;
  for (int l = 0; l < nlibs; l++) {
    if (T->missing[l]) continue;
    if (!libs[l].bf16 && l > 0 && !T->missing[0]) printf(" %s %.2f", libs[l].name, T->t[0] / T->t[l]);
    if (libs[l].bf16 && conv < 0) conv = T->t[l];
    else if (libs[l].bf16) printf(" %s %.2f", libs[l].name, conv / T->t[l]);
  }
  printf("\n");
}

/* ---- sections ----------------------------------------------------------------------------------- */

static void linears(int d, int rows) {
  const struct {
    const char *name;
    int in, out;
  } lin[] = {{"qkv", d, 3 * d}, {"proj", d, d}, {"fc", d, 4 * d}, {"fc2", 4 * d, d},
             {"head", d, 256}};
  char title[64];
  snprintf(title, sizeof title, "d=%d rows=%d", d, rows);
  loadavg(title);
  header(title);
  total layer = {0}, layer_fwd = {0};
  for (int i = 0; i < 5; i++) {
    for (int k = 0; k < 4; k++) {
      kind kk = k == 3 ? DW : (kind)k;
      static const char *what[] = {"fwd", "dinp", "dW", "dW half"};
      char name[48];
      snprintf(name, sizeof name, "%s %s", lin[i].name, what[k]);
      prob p = linear_prob(name, kk, rows, lin[i].in, lin[i].out, k == 3);
      double best[8];
      time_prob(&p, best);
      row(&p, best);
      if (i < 4 && k < 3) add(&layer, &p, best);
      if (i < 4 && k == 0) add(&layer_fwd, &p, best);
    }
  }
  total_row("layer (12 products)", &layer);
  total_row("layer forward (4)", &layer_fwd);
  loadavg("end");
}

/* attention.c's products for one sequence: every head, forward then backward, ATT_BLOCK 64 */
typedef struct {
  int T, C, hs;
} att_shape;

static int att_products(const att_shape *s, prob *out) {
  int n = 0, C3 = 3 * s->C, T = s->T, hs = s->hs;
  for (int r0 = 0; r0 < T; r0 += 64) {
    int rows = T - r0 < 64 ? T - r0 : 64, cols = r0 + rows;
    prob f[] = {
        /* scores = q k^T, out = att v; datt = dout v^T, dv += att^T dout, dq += ds k, dk += ds^T q */
        {"", PLAIN, 0, 0, 0, rows, cols, hs, C3, C3, T, false, true, 0},
        {"", PLAIN, 0, 0, 0, rows, hs, cols, T, C3, s->C, false, false, 0},
        {"", PLAIN, 0, 0, 0, rows, cols, hs, s->C, C3, T, false, true, 0},
        {"", PLAIN, 0, 0, 0, cols, hs, rows, T, s->C, C3, true, false, 1},
        {"", PLAIN, 0, 0, 0, rows, hs, cols, T, C3, C3, false, false, 1},
        {"", PLAIN, 0, 0, 0, cols, hs, rows, T, C3, C3, true, false, 1},
    };
    for (int i = 0; i < 6; i++) out[n++] = f[i];
  }
  return n;
}

static void attention(int d) {
  att_shape s = {256, d, 64};
  prob ps[64];
  int n = att_products(&s, ps);
  char title[64];
  snprintf(title, sizeof title, "attention d=%d T=256 hs=64", d);
  loadavg(title);
  header(title);
  /* time the whole sequence per library as one "product": every head's blocks */
  int heads = d / 64;
  bufs B = {0};
  int64_t nq = (int64_t)s.T * 3 * d, nT = (int64_t)s.T * s.T, no = (int64_t)s.T * d;
  float *qkv = xmalloc(4 * nq), *att = xmalloc(4 * nT), *g = xmalloc(4 * no),
        *dq = xmalloc(4 * nq), *S = xmalloc(4 * nT), *o = xmalloc(4 * no);
  fill(qkv, nq, 5), fill(att, nT, 6), fill(g, no, 7), fill(dq, nq, 8), fill(S, nT, 9);
  double fl = 0, best[8];
  for (int i = 0; i < n; i++) fl += flops(&ps[i]);
  fl *= heads;
  for (int l = 0; l < nlibs; l++) best[l] = libs[l].bf16 ? -1 : 1e30;
  for (int r = 0; r <= rounds; r++) {
    for (int l = 0; l < nlibs; l++) {
      if (best[l] < 0) continue;
      int calls = 0;
      double t0 = now(), t;
      do {
        for (int h = 0; h < heads; h++) {
          for (int i = 0; i < n; i++) {
            const prob *p = &ps[i];
            int k = i % 6, r0 = (i / 6) * 64;
            float *q = qkv + h * 64, *kk = q + d, *v = q + 2 * d;
            float *Ab = att + (int64_t)r0 * s.T, *Sb = S + (int64_t)r0 * s.T;
            float *gb = g + (int64_t)r0 * d + h * 64;
            float *dqh = dq + h * 64, *dk = dqh + d, *dv = dqh + 2 * d;
            float *A[6] = {q + (int64_t)r0 * 3 * d, Ab, gb, Ab, Sb, Sb};
            float *Bm[6] = {kk, v, v, gb, kk, q + (int64_t)r0 * 3 * d};
            float *Cm[6] = {Ab, o + (int64_t)r0 * d + h * 64, Sb, dv, dqh + (int64_t)r0 * 3 * d,
                            dk};
            B.a = A[k], B.b = Bm[k], B.c = Cm[k];
            libs[l].run(p, &B);
          }
        }
        calls++;
        t = now() - t0;
      } while (t < 0.025 || calls < 2);
      if (r > 0 && t / calls < best[l]) best[l] = t / calls; /* round 0 warms up */
    }
  }
  free(B.scratch);
  total T = {.fl = fl};
  for (int l = 0; l < nlibs; l++) T.missing[l] = best[l] < 0, T.t[l] = best[l];
  char name[48];
  snprintf(name, sizeof name, "fwd+bwd blocks, %d heads", heads);
  total_row(name, &T);
  free(qkv), free(att), free(g), free(dq), free(S), free(o);
  /* the bmm slot's plain products: scores (T x T x hs) and att @ v (T x hs x T) */
  prob bmm[] = {{"bmm q k^T", PLAIN, 0, 0, 0, 256, 256, 64, 64, 64, 256, false, true, 0},
                {"bmm att v", PLAIN, 0, 0, 0, 256, 64, 256, 256, 64, 64, false, false, 0},
                {"bmm datt^T (TN, beta 1)", PLAIN, 0, 0, 0, 256, 64, 256, 256, 64, 64, true, false, 1}};
  for (int i = 0; i < 3; i++) {
    time_prob(&bmm[i], best);
    row(&bmm[i], best);
  }
  loadavg("end");
}

/* ---- threads ------------------------------------------------------------------------------------ */

static void *default_threads_call(void *arg) {
  (void)arg;
#ifdef FSDP_BENCH_ONEDNN
  /* a fresh thread: OpenMP's default thread count (every core), as oneDNN runs without the pin */
  enum { n = 512 };
  float *a = xmalloc(4 * n * n), *b = xmalloc(4 * n * n), *c = xmalloc(4 * n * n);
  fill(a, n * n, 1), fill(b, n * n, 2);
  dnnl_sgemm('N', 'N', n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
  free(a), free(b), free(c);
#endif
  return NULL;
}

static void thread_report(void) {
  printf("\n# threads the process holds (/proc/self/task)\n");
  printf("#   now, after the runs above with one thread per call: %d\n", threads_now());
#ifdef FSDP_BENCH_BLIS
  if (have_blis) {
  blis_set_threads(2);
  prob p = linear_prob("", FWD, 512, 512, 512, false);
  bufs B;
  bufs_make(&B, &p);
  run_blis(&p, &B);
  printf("#   after a BLIS call with 2 threads: %d (the pthread flavour joins its threads per call)\n",
         threads_now());
  blis_set_threads(1);
  bufs_free(&B);
  }
#endif
#ifdef FSDP_BENCH_ONEDNN
  pthread_t t;
  pthread_create(&t, NULL, default_threads_call, NULL);
  pthread_join(t, NULL);
  printf("#   after dnnl_sgemm on a fresh thread at OpenMP's default count: %d "
         "(libgomp keeps its team)\n", threads_now());
#endif
}

/* ---- main ---------------------------------------------------------------------------------------- */

static int parse_list(const char *s, int *out, int max) {
  int n = 0;
  while (*s && n < max) {
    out[n++] = atoi(s);
    const char *c = strchr(s, ',');
    if (!c) break;
    s = c + 1;
  }
  return n;
}

static const char *lib_of(void *fn) {
  Dl_info info;
  return dladdr(fn, &info) && info.dli_fname ? info.dli_fname : "?";
}

int main(int argc, char **argv) {
  int ds[8] = {256, 384, 768}, nd = 3, rowss[4] = {2048, 1024}, nrows = 2;
  bool bf16 = true, threads = false;
  for (int i = 1; i < argc; i++) {
    if (!strncmp(argv[i], "--d=", 4)) nd = parse_list(argv[i] + 4, ds, 8);
    else if (!strncmp(argv[i], "--rows=", 7)) nrows = parse_list(argv[i] + 7, rowss, 4);
    else if (!strncmp(argv[i], "--rounds=", 9)) rounds = atoi(argv[i] + 9);
    else if (!strcmp(argv[i], "--no-bf16")) bf16 = false;
    else if (!strcmp(argv[i], "--threads")) threads = true;
    else {
      fprintf(stderr, "usage: gemm_libs [--d=256,384,768] [--rows=2048,1024] [--rounds=3] "
                      "[--no-bf16] [--threads]\n");
      return 2;
    }
  }
  cpu = fsdp_kernels_of(&fsdp_device_cpu, "gemm_libs");
  printf("# gemm_libs: one thread per call; GFLOP/s, best of %d interleaved rounds\n", rounds);
  int t0 = threads_now();
  fsdp_cpu_set_blas_threads(1);
  /* the bf16 columns run the table's slots, which split a product over the rank's pool: one
   * thread too, like the libraries called directly */
  fsdp_cpu_set_threads(1);
  char desc[160];
  fsdp_cpu_gemm_describe(desc, sizeof desc);
  printf("# engine: %s\n", desc);
  void *cblas = dlsym(RTLD_DEFAULT, "cblas_sgemm");
  printf("# cblas_sgemm from %s; threads at start %d (OpenBLAS starts its workers when it loads)\n",
         cblas ? lib_of(cblas) : "?", t0);
  libs[nlibs++] = (lib){"openblas", false, run_openblas};
#ifdef FSDP_BENCH_BLIS
  have_blis = blis_load();
  if (have_blis) {
    blis_set_threads(1);
    printf("# blis %s, %s kernels, from %s\n", blis_version(), blis_arch_string(blis_arch_id()),
           lib_of((void *)blis_sgemm));
    libs[nlibs++] = (lib){"blis", false, run_blis};
  }
#else
  printf("# blis: not built in (install libblis-dev and reconfigure): skipped\n");
#endif
#ifdef FSDP_BENCH_ONEDNN
  char v[32];
  fsdp_cpu_onednn_version(v, sizeof v);
  {
    /* the plan pins this thread to one OpenMP thread before dnnl_sgemm runs here */
    fsdp_cpu_mm_shape s = {FSDP_DTYPE_F32, FSDP_DTYPE_F32, FSDP_DTYPE_COUNT, 64, 64, 64,
                           false, false, 64, 64, 64, 1.0f, 0.0f, 0, 0, 0, 0};
    fsdp_cpu_mm *mm;
    size_t bytes;
    if (fsdp_cpu_mm_plan(&mm, &bytes, &s) == FSDP_OK)
      printf("# onednn %s (%s for f32 matmul; effective isa 0x%x)\n", v, fsdp_cpu_mm_impl(mm),
             (unsigned)dnnl_get_effective_cpu_isa());
  }
  libs[nlibs++] = (lib){"dnnl_sgemm", false, run_dnnl_sgemm};
  libs[nlibs++] = (lib){"dnnl_matmul", false, run_dnnl_matmul};
#else
  printf("# onednn: not built in (install libdnnl-dev and reconfigure): skipped\n");
#endif
  if (bf16) {
    libs[nlibs++] = (lib){"bf16_convert", true, run_convert};
    if (fsdp_cpu_bf16_gemm_supported()) libs[nlibs++] = (lib){"bf16_onednn", true, run_native};
    else printf("# bf16 native path: not here (needs oneDNN and AVX512_BF16): conversion only\n");
  }
  printf("# threads after setting one per call: %d\n", threads_now());
  for (int i = 0; i < nd; i++)
    for (int r = 0; r < nrows; r++) linears(ds[i], rowss[r]);
  for (int i = 0; i < nd; i++)
    if (ds[i] % 64 == 0) attention(ds[i]);
  if (threads) thread_report();
  else printf("\n# threads the process holds now: %d\n", threads_now());
  return 0;
}
