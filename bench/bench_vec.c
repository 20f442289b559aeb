/*
 * bench_vec.c — the element-wise cpu kernels at each instruction-set level (src/kernels/cpu/
 * isa.h), interleaved: ns per element of one call, and the same bytes through memcpy (not a
 * test; prints numbers, exits 0).
 *
 * Shapes are a GPT step's at B = 8, T = 256, d = 384 (2048 rows): layernorm (2048, 384),
 * GELU (2048, 1536; bias + GELU also on bf16 rows, as mixed precision runs it), cross-entropy
 * (2048, 256), binary add with a broadcast row (2048, 384), softmax (8 * 6 * 256, 256), mask
 * apply and AdamW 1 Mi. Each round times every level and
 * memcpy once (best of a few calls each), rounds alternate; the best round is printed. "bytes" counts each
 * array read and each written once per element; "memcpy x" is the kernel's time over memcpy's
 * for those bytes (memcpy of half of them: each byte read once and written once).
 * The kernels run on the pool's default threads (every core this process may use; `taskset -c 0`
 * gives one); note the load average with the figures.
 *
 * Usage: bench_vec [rounds] [kernel-name-substring]   (default 7 rounds, every kernel)
 *        bench_vec accuracy [stride]   GELU and its gradient against double over every
 *                                      stride-th float in [-30, 30] (default 1: all 2^31 or so)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cpu/half.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static float *buf(int64_t n, float lo, float hi) {
  float *p = malloc(sizeof(float) * (size_t)n);
  if (!p) {
    fprintf(stderr, "bench_vec: out of memory (%lld floats)\n", (long long)n);
    exit(1);
  }
  uint32_t s = 12345u + (uint32_t)n;
  for (int64_t i = 0; i < n; i++) {
    s = s * 1664525u + 1013904223u;
    p[i] = lo + (hi - lo) * ((float)(s >> 8) * (1.0f / 16777216.0f));
  }
  return p;
}

enum { ROWS = 2048, D = 384, V = 256, SM_ROWS = 8 * 6 * 256, SM_C = 256 };

typedef struct {
  float *x, *y, *dx, *dy, *w, *b, *dw, *db, *mean, *rstd;
  uint16_t *hx, *hy, *hdx, *hdy, *hb, *hw; /* x, y, dx, dy, b, w rounded to bf16 */
  int64_t *tgt;
  int64_t n, rows, cols;
} bctx;

typedef void (*kern_fn)(bctx *c);

static void k_gelu_fwd(bctx *c) { fsdp_cpu_gelu_forward(c->y, c->x, c->n); }
static void k_gelu_bwd(bctx *c) { fsdp_cpu_gelu_backward(c->dx, c->dy, c->x, c->n); }
static void k_bias_gelu_fwd(bctx *c) {
  fsdp_cpu_bias_gelu_forward(c->y, c->x, c->b, c->rows, (int)c->cols);
}
static void k_bias_gelu_bwd(bctx *c) {
  fsdp_cpu_bias_gelu_backward(c->dx, c->db, c->dy, c->x, c->b, c->rows, (int)c->cols, false);
}
/* the same on bf16 rows (the bias's gradient f32), as a mixed-precision step runs them */
static void k_bias_gelu_fwd_bf16(bctx *c) {
  fsdp_cpu_half_bias_gelu_forward(FSDP_DTYPE_BF16, c->hy, c->hx, c->hb, c->rows, (int)c->cols);
}
static void k_bias_gelu_bwd_bf16(bctx *c) {
  fsdp_cpu_half_bias_gelu_backward(FSDP_DTYPE_BF16, FSDP_DTYPE_F32, c->hdx, c->db, c->hdy, c->hx,
                                   c->hb, c->rows, (int)c->cols, true);
}
/* what the fused pair replaces: the bias seeded into the output (fsdp_cpu_linear_forward), the
 * GELU; the GELU's backward and the bias's column sum */
static void k_unfused_fwd(bctx *c) {
  for (int64_t r = 0; r < c->rows; r++)
    memcpy(c->dx + r * c->cols, c->b, sizeof(float) * (size_t)c->cols);
  fsdp_cpu_gelu_forward(c->y, c->x, c->n);
}
static void k_unfused_bwd(bctx *c) {
  fsdp_cpu_gelu_backward(c->dx, c->dy, c->x, c->n);
  fsdp_cpu_colsum_acc(c->db, c->dx, c->rows, c->cols);
}
static void k_ln_fwd(bctx *c) {
  fsdp_cpu_layernorm_forward(c->y, c->mean, c->rstd, c->x, c->w, c->b, c->rows, (int)c->cols,
                             1e-5f);
}
/* the residual add and the layernorm after it, fused (y the sum, dx the normalised rows) */
static void k_add_ln_fwd(bctx *c) {
  fsdp_cpu_add_layernorm_forward(c->y, c->dx, c->mean, c->rstd, c->x, c->dy, c->w, c->b,
                                 c->rows, (int)c->cols, 1e-5f);
}
/* both on bf16 rows with bf16 parameters, as a mixed-precision step runs them */
static void k_ln_fwd_bf16(bctx *c) {
  fsdp_cpu_half_layernorm_forward(FSDP_DTYPE_BF16, c->hy, c->mean, c->rstd, c->hx, c->hw, c->hb,
                                  c->rows, (int)c->cols, 1e-5f);
}
static void k_add_ln_fwd_bf16(bctx *c) {
  fsdp_cpu_half_add_layernorm_forward(FSDP_DTYPE_BF16, c->hy, c->hdx, c->mean, c->rstd, c->hx,
                                      c->hdy, c->hw, c->hb, c->rows, (int)c->cols, 1e-5f);
}
static void k_ln_bwd(bctx *c) {
  fsdp_cpu_layernorm_backward(c->dx, c->dw, c->db, c->dy, c->x, c->w, c->mean, c->rstd, c->rows,
                              (int)c->cols);
}
static void k_sm_fwd(bctx *c) { fsdp_cpu_softmax_forward(c->y, c->x, c->rows, (int)c->cols); }
static void k_sm_bwd(bctx *c) {
  fsdp_cpu_softmax_backward(c->dx, c->dy, c->y, c->rows, (int)c->cols);
}
static void k_ce_fwd(bctx *c) {
  int64_t count;
  fsdp_cpu_cross_entropy_forward(c->mean, c->x, c->tgt, c->rows, (int)c->cols, -100, &count);
}
static void k_ce_bwd(bctx *c) {
  fsdp_cpu_cross_entropy_backward(c->dx, 1.0f, c->x, c->mean, c->tgt, c->rows, (int)c->cols,
                                  -100, c->rows);
}
static void k_add(bctx *c) {
  fsdp_cpu_binary_forward(c->y, c->x, c->b, c->n, c->cols, FSDP_BIN_ADD);
}
static void k_add_bwd(bctx *c) {
  fsdp_cpu_binary_backward(c->dx, c->db, c->dy, c->x, c->b, c->n, c->cols, FSDP_BIN_ADD);
}
static void k_affine(bctx *c) { fsdp_cpu_affine_forward(c->y, c->x, 0.5f, 1.0f, c->n); }
static void k_relu(bctx *c) { fsdp_cpu_relu_forward(c->y, c->x, c->n); }
static void k_mask(bctx *c) { fsdp_cpu_mask_apply(c->y, c->w, c->n); }
static void k_adamw(bctx *c) { /* v = w > 0 */
  fsdp_cpu_adamw_step(c->y, c->dx, c->w, c->dy, c->n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 1.0f, 3);
}

typedef struct {
  const char *name;
  kern_fn fn;
  int64_t rows, cols;
  int bytes; /* per element */
} kernel;

static const kernel kernels[] = {
    {"gelu forward", k_gelu_fwd, ROWS, 4 * D, 8},
    {"gelu backward", k_gelu_bwd, ROWS, 4 * D, 16},
    {"bias+gelu forward", k_bias_gelu_fwd, ROWS, 4 * D, 8},
    {"bias, gelu forward", k_unfused_fwd, ROWS, 4 * D, 8},
    {"bias+gelu backward", k_bias_gelu_bwd, ROWS, 4 * D, 16},
    {"gelu backward, colsum", k_unfused_bwd, ROWS, 4 * D, 16},
    {"bias+gelu forward bf16", k_bias_gelu_fwd_bf16, ROWS, 4 * D, 4},
    {"bias+gelu backward bf16", k_bias_gelu_bwd_bf16, ROWS, 4 * D, 6},
    {"layernorm forward", k_ln_fwd, ROWS, D, 8},
    {"layernorm backward", k_ln_bwd, ROWS, D, 16},
    {"add+layernorm forward", k_add_ln_fwd, ROWS, D, 16},
    {"layernorm forward bf16", k_ln_fwd_bf16, ROWS, D, 4},
    {"add+layernorm fwd bf16", k_add_ln_fwd_bf16, ROWS, D, 8},
    {"softmax forward", k_sm_fwd, SM_ROWS, SM_C, 8},
    {"softmax backward", k_sm_bwd, SM_ROWS, SM_C, 16},
    {"cross_entropy forward", k_ce_fwd, ROWS, V, 4},
    {"cross_entropy backward", k_ce_bwd, ROWS, V, 12},
    {"add (broadcast row)", k_add, ROWS, D, 12},
    {"add backward (da, db)", k_add_bwd, ROWS, D, 12},
    {"affine", k_affine, ROWS, D, 8},
    {"relu", k_relu, ROWS, D, 8},
    {"mask apply", k_mask, 1024, 1024, 12},
    {"adamw", k_adamw, 1024, 1024, 28},
};

/* best of `reps` calls, seconds */
static double best_of(kern_fn fn, bctx *c, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; r++) {
    double t0 = now();
    fn(c);
    double dt = now() - t0;
    best = dt < best ? dt : best;
  }
  return best;
}

static float *g_src, *g_dst;
static size_t g_bytes;
static void k_memcpy(bctx *c) {
  (void)c;
  memcpy(g_dst, g_src, g_bytes);
}

/* GELU (tanh form) and its derivative in double, the functions the kernels approximate */
static double gelu_d(double x, double *grad) {
  const double s = 0.7978845608028654, a = 0.044715;
  double u = s * (x + a * x * x * x), q = 1.0 / (1.0 + exp(-2.0 * u));
  *grad = q + 2.0 * x * q * (1.0 - q) * s * (1.0 + 3.0 * a * x * x);
  return x * q;
}

/* Every stride-th float of [-30, 30] (by bit pattern) through fsdp_cpu_gelu_forward and
 * _backward at the level in force (every level gives the same bits): GELU's largest relative
 * error against gelu_d where |GELU| >= 1e-30, in three ranges of x, and the gradient's largest
 * absolute error. */
static int accuracy(uint32_t stride) {
  enum { N = 1 << 20 };
  static float x[N], y[N], g[N], one[N];
  double rel[3] = {0, 0, 0}, where[3] = {0, 0, 0}, gabs = 0, gwhere = 0;
  const char *range[3] = {"x >= -3", "-5 <= x < -3", "x < -5"};
  long long count = 0;
  for (int i = 0; i < N; i++) one[i] = 1.0f;
  printf("bench_vec accuracy: GELU against double at %s, every %u-th float in [-30, 30]\n",
         fsdp_cpu_isa_name(fsdp_cpu_isa()), stride);
  uint64_t u = 0;
  while (u < 0x100000000ull) {
    int n = 0;
    for (; n < N && u < 0x100000000ull; u += stride) {
      float f;
      uint32_t b = (uint32_t)u;
      memcpy(&f, &b, sizeof f);
      if (fabsf(f) <= 30.0f) x[n++] = f; /* NaN fails the test too */
    }
    fsdp_cpu_gelu_forward(y, x, n);
    memset(g, 0, sizeof(float) * (size_t)n);
    fsdp_cpu_gelu_backward(g, one, x, n);
    for (int i = 0; i < n; i++) {
      double dg, want = gelu_d(x[i], &dg);
      if (fabs(want) >= 1e-30) {
        int r = x[i] >= -3.0f ? 0 : x[i] >= -5.0f ? 1 : 2;
        double e = fabs(y[i] - want) / fabs(want);
        if (e > rel[r]) rel[r] = e, where[r] = x[i];
      }
      if (fabs(g[i] - dg) > gabs) gabs = fabs(g[i] - dg), gwhere = x[i];
    }
    count += n;
  }
  printf("  %lld floats\n", count);
  for (int r = 0; r < 3; r++)
    printf("  gelu %-14s largest relative error %.3g (x = %.7g)\n", range[r], rel[r], where[r]);
  printf("  gelu'                 largest absolute error %.3g (x = %.7g)\n", gabs, gwhere);
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "accuracy") == 0) {
    long stride = argc > 2 ? atol(argv[2]) : 1;
    return accuracy(stride < 1 ? 1u : (uint32_t)stride);
  }
  int rounds = argc > 1 ? atoi(argv[1]) : 7;
  const char *only = argc > 2 ? argv[2] : NULL;
  if (rounds < 1) rounds = 1;
  fsdp_cpu_isa_level best = fsdp_cpu_isa_best(), start = fsdp_cpu_isa();
  printf("bench_vec: levels scalar..%s (in force: %s), %d rounds, ns per element\n",
         fsdp_cpu_isa_name(best), fsdp_cpu_isa_name(start), rounds);
  printf("  %-24s %-12s %5s", "kernel", "shape", "bytes");
  for (int l = 0; l <= (int)best; l++) printf(" %9s", fsdp_cpu_isa_name((fsdp_cpu_isa_level)l));
  printf(" %9s %9s\n", "memcpy", "memcpy x");
  for (size_t k = 0; k < sizeof kernels / sizeof kernels[0]; k++) {
    const kernel *K = &kernels[k];
    if (only && !strstr(K->name, only)) continue;
    int64_t n = K->rows * K->cols;
    bctx c = {.x = buf(n, -4, 4), .y = buf(n, 0, 1), .dx = buf(n, -1, 1), .dy = buf(n, -1, 1),
              .w = buf(n, 0.5f, 1.5f), .b = buf(n, -1, 1), .dw = buf(K->cols, 0, 0),
              .db = buf(K->cols, 0, 0), .mean = buf(K->rows, 0, 0), .rstd = buf(K->rows, 1, 1),
              .tgt = malloc(sizeof(int64_t) * (size_t)K->rows), .n = n, .rows = K->rows,
              .cols = K->cols};
    for (int64_t i = 0; i < K->rows; i++) c.tgt[i] = (i * 7) % K->cols;
    /* the bf16 kernels' rows: the f32 ones rounded */
    const bool bf16 = K->fn == k_bias_gelu_fwd_bf16 || K->fn == k_bias_gelu_bwd_bf16 ||
                      K->fn == k_ln_fwd_bf16 || K->fn == k_add_ln_fwd_bf16;
    uint16_t **h[] = {&c.hx, &c.hy, &c.hdx, &c.hdy, &c.hb, &c.hw};
    float *f[] = {c.x, c.y, c.dx, c.dy, c.b, c.w};
    for (int i = 0; bf16 && i < 6; i++) {
      *h[i] = malloc(sizeof(uint16_t) * (size_t)n);
      if (!*h[i]) {
        fprintf(stderr, "bench_vec: out of memory (%lld bf16 elements)\n", (long long)n);
        return 1;
      }
      fsdp_cpu_f32_to_bf16(*h[i], f[i], n);
    }
    if (K->fn == k_mask)
      for (int64_t i = 0; i < n; i++) c.w[i] = (float)(i % 3 != 0);
    /* forward state the backward kernels read */
    fsdp_cpu_layernorm_forward(c.y, c.mean, c.rstd, c.x, c.w, c.b, K->rows, (int)K->cols, 1e-5f);
    if (K->fn == k_sm_bwd) fsdp_cpu_softmax_forward(c.y, c.x, K->rows, (int)K->cols);
    if (K->fn == k_ce_bwd) k_ce_fwd(&c);
    g_bytes = (size_t)n * (size_t)K->bytes / 2;
    g_src = malloc(g_bytes), g_dst = malloc(g_bytes);
    memset(g_src, 1, g_bytes), memset(g_dst, 2, g_bytes);
    double t[FSDP_CPU_ISA_COUNT + 1];
    for (int l = 0; l <= FSDP_CPU_ISA_COUNT; l++) t[l] = 1e30;
    const int reps = n * K->bytes > (64 << 20) ? 2 : 5;
    for (int r = 0; r < rounds; r++) {
      for (int l = 0; l <= (int)best; l++) {
        fsdp_cpu_isa_set((fsdp_cpu_isa_level)l);
        double s = best_of(K->fn, &c, reps);
        t[l] = s < t[l] ? s : t[l];
      }
      double s = best_of(k_memcpy, &c, reps);
      t[FSDP_CPU_ISA_COUNT] = s < t[FSDP_CPU_ISA_COUNT] ? s : t[FSDP_CPU_ISA_COUNT];
    }
    fsdp_cpu_isa_set(start);
    char shape[32];
    snprintf(shape, sizeof shape, "%lldx%lld", (long long)K->rows, (long long)K->cols);
    printf("  %-24s %-12s %5d", K->name, shape, K->bytes);
    for (int l = 0; l <= (int)best; l++) printf(" %9.3f", t[l] / (double)n * 1e9);
    printf(" %9.3f %9.2f\n", t[FSDP_CPU_ISA_COUNT] / (double)n * 1e9,
           t[best] / t[FSDP_CPU_ISA_COUNT]);
    free(c.x), free(c.y), free(c.dx), free(c.dy), free(c.w), free(c.b), free(c.dw), free(c.db);
    free(c.mean), free(c.rstd), free(c.tgt), free(g_src), free(g_dst);
    free(c.hx), free(c.hy), free(c.hdx), free(c.hdy), free(c.hb), free(c.hw);
  }
  return 0;
}
