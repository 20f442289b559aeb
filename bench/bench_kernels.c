/*
 * bench_kernels.c — throughput of the CPU kernels (not a test; prints numbers, exits 0).
 *
 *   sgemm GFLOP/s at 1024^3 and at the GPT layer shapes (M = B*T = 2048; K = 256 -> N = 768
 *   (qkv), 1024 (mlp up); K = 1024 -> N = 256 (mlp down)), through fsdp_cpu_linear_forward.
 *   The same linears with a bias (through oneDNN the bias is the matmul's epilogue, gemm.h).
 *   Time per call (forward + backward) of layernorm, gelu, softmax and attention at
 *   B = 8, T = 256, C = 256, NH = 4, plus attention's GFLOP/s as a fraction of plain sgemm;
 *   bf16 attention at that shape on the processor's bf16 products (attention_bf16.c) and the
 *   widening way (the f32 kernel on widened rows), where the processor has AVX512_BF16; the
 *   f32 -> bf16 narrowing of 64 Ki elements (in cache) and 16 Mi (memory), at the current
 *   instruction-set level (on AVX512_BF16 at the AVX-512 level: the processor's instruction)
 *   and with the level held to AVX2 (the integer loop).
 *   Then attention's pieces on one thread, one (batch row, head) pair: each product of the
 *   instruction-set level's att_mm over the 64-row tiles as attention.c calls it, the packing of
 *   k^T, and the softmax rows (the plain body on rows of 64 to 1024, attention's causal rows):
 *   GFLOP/s counted causally, ns per element; where the processor has AVX512_BF16 (at the
 *   AVX-512 level) the bf16 attention's products on the same pair (att_bf16.c), its packs, and
 *   its causal softmax rows (bf16 probabilities out; the backward's bf16 dscores).
 * Everything runs with 1 and then 2 threads of the rank's pool (kernels/cpu/pool.h; OpenBLAS
 * stays at 1 thread, called per block). Each measurement repeats until it has
 * run for ~0.25 s (best of those reps is reported), so the whole program takes ~10-20 s.
 *
 * Usage: bench_kernels [max_threads]   (default 2)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "core/core.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/half.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

static float *buf(int64_t n, float scale) { return bench_buf("bench_kernels", n, scale); }

/* Seconds per call: one warm-up call, then repeat until 0.25 s have passed; best call. */
static double time_call(bench_fn fn, void *ctx) { return bench_time_call(fn, ctx, 0.25); }

/* ---- gemm ------------------------------------------------------------------------------------ */

typedef struct {
  float *out, *inp, *weight, *bias;
  int M, K, N;
} gemm_ctx;

static void run_square(void *p) {
  gemm_ctx *g = p;
  fsdp_cpu_gemm(g->out, g->inp, g->weight, g->M, g->N, g->K, false, false, 1.0f, 0.0f, g->K,
                g->N, g->N);
}

static void run_linear(void *p) {
  gemm_ctx *g = p;
  fsdp_cpu_linear_forward(g->out, g->inp, g->weight, NULL, g->M, g->K, g->N);
}

static void run_linear_bias(void *p) {
  gemm_ctx *g = p;
  fsdp_cpu_linear_forward(g->out, g->inp, g->weight, g->bias, g->M, g->K, g->N);
}

static double bench_gemm(const char *label, bench_fn fn, int M, int K, int N) {
  gemm_ctx g = {buf((int64_t)M * N, 1), buf((int64_t)M * K, 1), buf((int64_t)N * K, 1),
                buf(N, 1), M, K, N};
  double t = time_call(fn, &g);
  double gflops = 2.0 * M * N * K / t * 1e-9;
  printf("  %-34s M=%-5d K=%-5d N=%-5d %8.2f ms  %7.1f GFLOP/s\n", label, M, K, N, t * 1e3,
         gflops);
  free(g.out), free(g.inp), free(g.weight), free(g.bias);
  return gflops;
}

/* ---- layer kernels at B=8, T=256, C=256, NH=4 ----------------------------------------------- */

enum { B = 8, T = 256, C = 256, NH = 4 };

typedef struct {
  float *x, *y, *dx, *dy, *w, *b, *dw, *db, *mean, *rstd;
} ln_ctx;

static void run_layernorm(void *p) {
  ln_ctx *c = p;
  fsdp_cpu_layernorm_forward(c->y, c->mean, c->rstd, c->x, c->w, c->b, B * T, C, 1e-5f);
  fsdp_cpu_layernorm_backward(c->dx, c->dw, c->db, c->dy, c->x, c->w, c->mean, c->rstd, B * T,
                              C);
}

typedef struct {
  float *x, *y, *dx, *dy;
  int64_t n;
  int rows, cols;
} ew_ctx;

static void run_gelu(void *p) {
  ew_ctx *c = p;
  fsdp_cpu_gelu_forward(c->y, c->x, c->n);
  fsdp_cpu_gelu_backward(c->dx, c->dy, c->x, c->n);
}

static void run_softmax(void *p) {
  ew_ctx *c = p;
  fsdp_cpu_softmax_forward(c->y, c->x, c->rows, c->cols);
  fsdp_cpu_softmax_backward(c->dx, c->dy, c->y, c->rows, c->cols);
}

typedef struct {
  float *qkv, *out, *dqkv, *dout, *scratch; /* scratch: enough for any thread count here */
} att_ctx;

/* the rows' softmax stats, kept by the forward for the backward as the engine does */
static float att_stats[B * NH * T * 2];

static void run_attention(void *p) {
  att_ctx *c = p;
  fsdp_cpu_attention_forward(c->out, att_stats, c->scratch, c->qkv, B, T, C, NH);
  fsdp_cpu_attention_backward(c->dqkv, c->scratch, c->dout, c->qkv, att_stats, B, T, C, NH,
                              false);
}

static void run_attention_fwd(void *p) {
  att_ctx *c = p;
  fsdp_cpu_attention_forward(c->out, att_stats, c->scratch, c->qkv, B, T, C, NH);
}

/* bf16 attention, forward + backward (dqkv written), the way fsdp_cpu_bf16_gemm_force chose */
typedef struct {
  uint16_t *qkv, *out, *dqkv, *dout;
} hatt_ctx;

static void run_attention_bf16(void *p) {
  hatt_ctx *c = p;
  if (fsdp_cpu_half_attention_forward(FSDP_DTYPE_BF16, c->out, att_stats, c->qkv, B, T, C,
                                      NH) ||
      fsdp_cpu_half_attention_backward(FSDP_DTYPE_BF16, c->dqkv, c->dout, c->qkv, att_stats, B, T,
                                       C, NH, true)) {
    fprintf(stderr, "bench_kernels: bf16 attention failed: %s\n", fsdp_error_msg());
    exit(1);
  }
}

static uint16_t *hbuf(int64_t n) {
  uint16_t *h = malloc(sizeof(uint16_t) * (size_t)n);
  float *f = buf(n, 1);
  if (!h) {
    fprintf(stderr, "bench_kernels: out of memory\n");
    exit(1);
  }
  fsdp_cpu_f32_to_bf16(h, f, n);
  free(f);
  return h;
}

typedef struct {
  uint16_t *h;
  const float *f;
  int64_t n;
} narrow_ctx;

static void run_narrow(void *p) {
  narrow_ctx *c = p;
  fsdp_cpu_f32_to_bf16(c->h, c->f, c->n);
}

/* ---- attention's pieces: one (batch row, head) pair through the level's table ------------- */

typedef struct {
  float *q, *A, *kt, *o;
  float *st; /* the causal rows' stats (max, reciprocal sum), T x 2 */
  int kind, rows; /* rows: softmax rows' length (0: attention's causal rows; -1: the same,
                   * rebuilt from the stats, as the backward does) */
} part_ctx;

/* The pair's products at T, hs = C / NH over its 64-row tiles as attention.c calls them (kind
 * 1: q k^T, 2: att v, 3: att^T dout by key tile, 4: packing k^T), or softmax rows. */
static void run_part(void *p) {
  part_ctx *c = p;
  const fsdp_cpu_vec_i *v = fsdp_cpu_vec();
  const int hs = C / NH, C3 = 3 * C, ldk = (T + 15) / 16 * 16;
  if (c->kind == 5) {
    if (c->rows > 0) v->softmax_forward(c->A, c->q, 0, (int64_t)T * T / 2 / c->rows, c->rows);
    else
      for (int r0 = 0; r0 < T; r0 += FSDP_CPU_ATT_BLOCK) {
        const int rows = fsdp_cpu_att_rows(T, r0);
        if (c->rows) v->att_softmax_rows_saved(c->A, T, r0, rows, r0 + rows, c->st + 2 * r0);
        else v->att_softmax_rows(c->A, T, r0, rows, r0 + rows, c->st + 2 * r0);
      }
    return;
  }
  for (int r0 = 0; r0 < T; r0 += FSDP_CPU_ATT_BLOCK) {
    const int rows = fsdp_cpu_att_rows(T, r0), cols = r0 + rows;
    if (c->kind == 1)
      v->att_mm(c->A + (int64_t)r0 * T, T, c->q + (int64_t)r0 * C3, C3, 1, c->kt, ldk, rows,
                cols, hs, r0, FSDP_ATT_COLS, 0.125f, false);
    else if (c->kind == 2)
      v->att_mm(c->o + (int64_t)r0 * C, C, c->A + (int64_t)r0 * T, T, 1, c->q + 2 * C, C3, rows,
                hs, cols, r0, FSDP_ATT_KHEAD, 1.0f, false);
    else if (c->kind == 3)
      v->att_mm(c->q + 2 * C + (int64_t)r0 * C3, C3, c->A + (int64_t)r0 * T + r0, 1, T,
                c->o + (int64_t)r0 * C, C, rows, hs, T - r0, 0, FSDP_ATT_KTAIL, 1.0f, true);
    else
      v->att_pack(c->kt, ldk, c->q + C, C3, T, hs);
  }
}

/* Kinds 1-3 of fn (products: GFLOP/s counted causally, against the same run's sgemm), then
 * kind 4 (packing: ns per element of `packed`). */
static void time_parts(void (*fn)(void *), void *ctx, int *kind, const char *const name[4],
                       double causal, double packed, double peak) {
  for (int k = 1; k <= 4; k++) {
    *kind = k;
    double t = time_call(fn, ctx);
    if (k < 4)
      printf("  %-34s %8.2f us  %7.1f GFLOP/s causal (%.2f of sgemm)\n", name[k - 1], t * 1e6,
             causal / t * 1e-9, causal / t * 1e-9 / peak);
    else
      printf("  %-34s %8.2f us  (%.2f ns/element)\n", name[k - 1], t * 1e6, t * 1e9 / packed);
  }
}

/* The bf16 attention's products (attention_bf16.c) on one pair, the same way: kind 1 q k^T,
 * 2 att v, 3 att^T dout by key tile with the tile's interleave of att, 4 the pair's packs (k^T
 * as words, v interleaved by rows). */
typedef struct {
  uint16_t *q, *att, *o;
  float *S;
  uint32_t *kt, *vi, *tile;
  int kind;
  uint16_t *d; /* kind 6's dscores */
  float *st;   /* kind 5 keeps the rows' stats, kind 7 rebuilds the rows from them */
} bpart_ctx;

static void run_part_bf16(void *p) {
  bpart_ctx *c = p;
  const int hs = C / NH, C3 = 3 * C, ldk = (T + 15) / 16 * 16, ldh = (hs + 15) / 16 * 16;
  const int TB = FSDP_CPU_ATT_BLOCK;
  for (int r0 = 0; r0 < T; r0 += TB) {
    const int rows = fsdp_cpu_att_rows(T, r0), cols = r0 + rows;
    if (c->kind == 5) /* the causal softmax rows into bf16 probabilities */
      fsdp_cpu_vec()->att_softmax_rows_bf16(c->att, c->S, T, r0, rows, cols, c->st + 2 * r0);
    else if (c->kind == 7) /* the same from their stats (the scores left in S) */
      fsdp_cpu_vec()->att_softmax_rows_saved_bf16(c->att, c->S, T, r0, rows, cols,
                                                  c->st + 2 * r0);
    else if (c->kind == 6) /* and their backward, bf16 dscores */
      fsdp_cpu_vec()->att_softmax_backward_rows_bf16(c->d, c->S, c->att, T, r0, rows, cols);
    else if (c->kind == 1)
      fsdp_cpu_att_bf16_mm(c->S + (int64_t)r0 * T, T, false, c->q + (int64_t)r0 * C3, C3, 2,
                           c->kt, ldk, rows, cols, hs, r0, FSDP_ATT_COLS, 0.125f, false);
    else if (c->kind == 2)
      fsdp_cpu_att_bf16_mm(c->o + (int64_t)r0 * C, C, true, c->att + (int64_t)r0 * T, T, 2,
                           c->vi, ldh, rows, hs, cols, r0, FSDP_ATT_KHEAD, 1.0f, false);
    else if (c->kind == 3) {
      fsdp_cpu_att_bf16_interleave(c->tile, TB, c->att + (int64_t)r0 * T + r0, T, T - r0, rows);
      fsdp_cpu_att_bf16_mm(c->o + (int64_t)r0 * C, C, true, (const uint16_t *)c->tile, 2, 2 * TB,
                           c->vi + (r0 / 2) * ldh, ldh, rows, hs, T - r0, 0, FSDP_ATT_KTAIL,
                           1.0f, true);
    } else if (r0 == 0) {
      fsdp_cpu_vec()->att_pack((float *)c->kt, ldk, (const float *)(c->q + C), C3 / 2, T, hs / 2);
      fsdp_cpu_att_bf16_interleave(c->vi, ldh, c->q + 2 * C, C3, T, hs);
    }
  }
}

static void bench_parts_bf16(double peak) {
  const int hs = C / NH, ldk = (T + 15) / 16 * 16, ldh = (hs + 15) / 16 * 16;
  bpart_ctx c = {hbuf((int64_t)T * 3 * C), hbuf((int64_t)T * T), hbuf((int64_t)T * C),
                 buf((int64_t)T * T, 1), malloc(4 * (size_t)hs * ldk),
                 malloc(4 * (size_t)T * ldh), malloc(4 * (size_t)T * FSDP_CPU_ATT_BLOCK), 0, NULL,
                 buf(2 * (int64_t)T, 1)};
  if (!c.kt || !c.vi || !c.tile) {
    fprintf(stderr, "bench_kernels: out of memory\n");
    exit(1);
  }
  for (int64_t i = 0; i < (int64_t)T * T; i++) c.att[i] = 0x3c00; /* 1/128 */
  const double causal = 2.0 * hs * T * (T + 1) / 2.0;
  const char *const name[4] = {"q k^T (64-row tiles)", "att v",
                               "att^T dout (key tiles, packed)", "packing k^T and v"};
  printf("bf16 products (AVX512_BF16), the same pair:\n");
  time_parts(run_part_bf16, &c, &c.kind, name, causal, 2.0 * T * hs, peak);
  c.d = hbuf((int64_t)T * T);
  /* kind 5 turns the scores in S into exponentials at every call: kind 7 runs on the scores
   * of one q k^T (kept here; the packs are made by now) and the stats one call of kind 5
   * takes of them */
  const char *const rows_name[3] = {"causal rows, bf16 out", "causal rows' backward, bf16",
                                    "the same rows from their stats"};
  float *scores = malloc(sizeof(float) * (size_t)T * T);
  if (!scores) {
    fprintf(stderr, "bench_kernels: out of memory\n");
    exit(1);
  }
  c.kind = 1, run_part_bf16(&c);
  memcpy(scores, c.S, sizeof(float) * (size_t)T * T);
  for (c.kind = 5; c.kind <= 7; c.kind++) {
    if (c.kind == 7) {
      memcpy(c.S, scores, sizeof(float) * (size_t)T * T);
      c.kind = 5, run_part_bf16(&c), c.kind = 7;
      memcpy(c.S, scores, sizeof(float) * (size_t)T * T);
    }
    double t = time_call(run_part_bf16, &c);
    printf("  %-34s %8.3f ns/element\n", rows_name[c.kind - 5], t * 1e9 / (T * (T + 1) / 2.0));
  }
  free(c.q), free(c.att), free(c.o), free(c.S), free(c.kt), free(c.vi), free(c.tile), free(c.d);
  free(c.st), free(scores);
}

static void bench_parts(double peak) {
  const int hs = C / NH, ldk = (T + 15) / 16 * 16;
  part_ctx c = {buf((int64_t)T * 3 * C, 1), buf((int64_t)T * T, 0.01f),
                buf((int64_t)hs * ldk, 1), buf((int64_t)T * C, 1), buf(2 * (int64_t)T, 1), 0, 0};
  const double causal = 2.0 * hs * T * (T + 1) / 2.0; /* a product's causal FLOPs */
  const char *const name[4] = {"q k^T (64-row tiles)", "att v", "att^T dout (key tiles)",
                               "packing k^T (4 times)"};
  printf("\nattention's pieces, one pair at T=%d hs=%d, one thread, %s level:\n", T, hs,
         fsdp_cpu_isa_name(fsdp_cpu_isa()));
  time_parts(run_part, &c, &c.kind, name, causal, 4.0 * T * hs, peak);
  const int lens[6] = {64, 128, 256, 1024, 0, -1};
  c.kind = 5;
  for (int i = 0; i < 6; i++) {
    c.rows = lens[i];
    double t = time_call(run_part, &c); /* rows 0 leave the stats that rows -1 read */
    char label[64];
    if (lens[i] > 0) snprintf(label, sizeof label, "softmax rows of %d", lens[i]);
    else if (lens[i] == 0) snprintf(label, sizeof label, "attention's causal rows (1..%d)", T);
    else snprintf(label, sizeof label, "the same from their stats");
    printf("  %-34s %8.3f ns/element\n", label,
           t * 1e9 / (lens[i] > 0 ? (double)(T * T / 2 / lens[i] * lens[i]) : T * (T + 1) / 2.0));
  }
  free(c.q), free(c.A), free(c.kt), free(c.o), free(c.st);
  if (fsdp_cpu_att_bf16_supported()) bench_parts_bf16(peak);
}

int main(int argc, char **argv) {
  int max_threads = argc > 1 ? atoi(argv[1]) : 2;
  if (max_threads < 1) max_threads = 1;
  const int64_t NT = (int64_t)B * T;

  ln_ctx ln = {buf(NT * C, 4), buf(NT * C, 1), buf(NT * C, 1), buf(NT * C, 1), buf(C, 1),
               buf(C, 1),      buf(C, 1),      buf(C, 1),      buf(NT, 1),     buf(NT, 1)};
  ew_ctx ge = {buf(NT * 4 * C, 6), buf(NT * 4 * C, 1), buf(NT * 4 * C, 1), buf(NT * 4 * C, 1),
               NT * 4 * C, 0, 0};
  ew_ctx sm = {buf((int64_t)B * NH * T * T, 8), buf((int64_t)B * NH * T * T, 1),
               buf((int64_t)B * NH * T * T, 1), buf((int64_t)B * NH * T * T, 1),
               (int64_t)B * NH * T * T, B * NH * T, T};
  att_ctx at = {buf(NT * 3 * C, 2), buf(NT * C, 1), buf(NT * 3 * C, 1), buf(NT * C, 1),
                buf(fsdp_cpu_attention_scratch(B, T, C, NH, FSDP_CPU_MAX_THREADS, true), 1)};

  hatt_ctx hat = {hbuf(NT * 3 * C), hbuf(NT * C), hbuf(NT * 3 * C), hbuf(NT * C)};
  float *fsmall = buf(1 << 16, 1), *fbig = buf((int64_t)1 << 24, 1);
  uint16_t *nsmall = hbuf(1 << 16), *nbig = hbuf((int64_t)1 << 24);

  printf("bench_kernels: CPU kernels, f32 (best of repeated calls)\n");
  double peak1 = 0;
  for (int threads = 1; threads <= max_threads; threads++) {
    fsdp_cpu_set_threads(threads);
    printf("\nthreads: %d\n", fsdp_cpu_threads());
    double peak = bench_gemm("sgemm a @ b", run_square, 1024, 1024, 1024);
    if (threads == 1) peak1 = peak;
    bench_gemm("linear (qkv)  inp @ w^T", run_linear, 2048, 256, 768);
    bench_gemm("linear (mlp up)  inp @ w^T", run_linear, 2048, 256, 1024);
    bench_gemm("linear (mlp down)  inp @ w^T", run_linear, 2048, 1024, 256);
    bench_gemm("linear (qkv) + bias", run_linear_bias, 2048, 256, 768);
    bench_gemm("linear (mlp down) + bias", run_linear_bias, 2048, 1024, 256);

    printf("  at B=%d T=%d C=%d NH=%d, forward + backward per call:\n", B, T, C, NH);
    double t = time_call(run_layernorm, &ln);
    printf("    %-30s %8.3f ms\n", "layernorm (B*T, C)", t * 1e3);
    t = time_call(run_gelu, &ge);
    printf("    %-30s %8.3f ms  (%.2f ns/element)\n", "gelu (B*T, 4C)", t * 1e3,
           t * 1e9 / (double)ge.n);
    t = time_call(run_softmax, &sm);
    printf("    %-30s %8.3f ms  (%.2f ns/element)\n", "softmax (B*NH*T, T)", t * 1e3,
           t * 1e9 / (double)sm.n);
    double tf = time_call(run_attention_fwd, &at);
    t = time_call(run_attention, &at);
    /* useful (causal, lower-triangle) flops: forward q@k^T and att@v, backward four products
     * of the same size; the kernel skips most of the upper triangle */
    const double hs = (double)C / NH;
    const double fwd_flops = (double)B * NH * 2.0 * (2.0 * T * (T + 1) / 2.0 * hs);
    printf("    %-30s %8.3f ms  (forward %.3f ms; %.1f GFLOP/s causal = %.0f%% of sgemm)\n",
           "attention", t * 1e3, tf * 1e3, 3.0 * fwd_flops / t * 1e-9,
           100.0 * 3.0 * fwd_flops / t * 1e-9 / peak);
    if (fsdp_cpu_bf16_gemm_supported()) {
      for (int native = 1; native >= 0; native--) {
        fsdp_cpu_bf16_gemm_force(native);
        t = time_call(run_attention_bf16, &hat);
        printf("    %-30s %8.3f ms\n", native ? "attention bf16, bf16 products" :
               "attention bf16, widened to f32", t * 1e3);
      }
      fsdp_cpu_bf16_gemm_force(-1);
    }
    for (int k = 0; k < 2; k++) {
      narrow_ctx nc = {k ? nbig : nsmall, k ? fbig : fsmall, k ? (int64_t)1 << 24 : 1 << 16};
      const fsdp_cpu_isa_level level = fsdp_cpu_isa();
      double tl = time_call(run_narrow, &nc);
      fsdp_cpu_isa_set(FSDP_CPU_ISA_AVX2 < level ? FSDP_CPU_ISA_AVX2 : level);
      double ti = time_call(run_narrow, &nc);
      fsdp_cpu_isa_set(level);
      printf("    f32 -> bf16 %-8lld %-9s %6.3f ns/element (%s), integer loop %6.3f\n",
             (long long)nc.n, k ? "(memory)" : "(cache)", tl * 1e9 / (double)nc.n,
             fsdp_cpu_isa_name(level), ti * 1e9 / (double)nc.n);
    }
  }
  fsdp_cpu_set_threads(1);
  bench_parts(peak1);
  return 0;
}
