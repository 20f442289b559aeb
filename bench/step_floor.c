/*
 * step_floor.c — the least time the f32 GPT train step's kernels take on this machine, each
 * timed alone at the step's shapes, and the ratio to the same-run sgemm that step time would
 * give (not a test; prints numbers, exits 0). docs/PERFORMANCE.md, "The ceiling", reads it.
 *
 * The model is bench/gpt_step.lua's (vocab 256, context 256, batch 8, tied head, heads of 64).
 * One rank runs the whole batch on both of its threads; at --ranks=2 each rank has 4 sequences
 * and one thread, and the figures are one rank's, taken while the other core idles (no
 * contention for the shared cache, no collectives: a floor, not a forecast). Per step and rank:
 *
 *   GEMMs      every library product of the step as the engine calls it: a layer's four
 *              linears (forward with the bias in the product where the step does, input and
 *              weight gradients) and the tied head's three products, through the cpu kernels
 *   attention  the engine's op, forward and backward over the rank's sequences; and, as a
 *              floor for any implementation, its products alone at the sgemm rate (the
 *              backward's recomputation of q k^T included: 7 products of the 6 counted)
 *   the rest   two layernorms forward and backward a layer, bias + GELU both ways, the column
 *              sums of three biases' gradients; the final layernorm, the two embeddings,
 *              cross-entropy, AdamW over the rank's share of the parameters
 *
 * Each kernel is called repeatedly on the same buffers for --reps_s seconds and its best call
 * counts: operands as warm as they can be, every dispatch of the pool as quick as it gets. Work
 * the step does and this leaves out (the residual adds, which the step fuses into the
 * layernorms, copies, the pool's waits, the Lua between kernels, collectives) only lowers the
 * floor. The step's FLOPs are bench/gpt_step.lua's convention (6 x non-embedding parameters x
 * tokens + 6 x L x T x d per token for causal attention), and its reference sgemm, (B/N x T, d)
 * @ (d, 4d) on the rank's threads, is measured by the same function (fsdp_cpu_sgemm_gflops),
 * before and after the kernels, the better of the two. "ceiling" = counted FLOPs / (floor time
 * x sgemm rate): no step made of these kernels reaches more; "bound" is the same with
 * attention's products at the sgemm rate in place of the op.
 *
 * Usage: step_floor [--ranks=1|2] [--models=4,6,12] [--reps_s=0.2] [--products]
 *   --products also prints each GEMM's rate (forward, input and weight gradients) above its
 *   model's line.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

#define V 256
#define T 256
#define BATCH 8

static double reps_s = 0.2;
static bool products; /* --products: each GEMM's rate */

static float *buf(int64_t n) { return bench_buf("step_floor", n, 1.0f); }

/* ---- one timed kernel ---------------------------------------------------------------------- */

typedef struct job job;
struct job {
  void (*run)(const job *);
  float *a, *b, *c, *d, *e, *f, *g, *h;
  int64_t *ids;
  int64_t n;
  int M, N, K;
};

static void call(void *p) {
  const job *j = p;
  j->run(j);
}

/* seconds of run's best call */
static double best(void (*run)(const job *), job j) {
  j.run = run;
  return bench_time_call(call, &j, reps_s);
}

/* out d (M, N) = a (M, K) @ w b (N, K)^T [+ bias c] */
static void run_fwd(const job *j) {
  fsdp_cpu_linear_forward(j->d, j->a, j->b, j->c, j->M, j->K, j->N);
}
/* dinp e (M, K) += dout d (M, N) @ w b (N, K) */
static void run_dinp(const job *j) {
  fsdp_cpu_gemm(j->e, j->d, j->b, j->M, j->K, j->N, false, false, 1.0f, 1.0f, j->N, j->K, j->K);
}
/* dw f (N, K) += dout d (M, N)^T @ a (M, K) */
static void run_dw(const job *j) {
  fsdp_cpu_gemm(j->f, j->d, j->a, j->N, j->K, j->M, true, false, 1.0f, 1.0f, j->N, j->K, j->K);
}
/* M sequences of T tokens, N = C channels in heads of 64 */
static void run_attention(const job *j) {
  const int B = j->M, C = j->N, NH = C / 64;
  fsdp_cpu_attention_forward(j->b, j->g, j->h, j->a, B, T, C, NH);
  fsdp_cpu_attention_backward(j->d, j->h, j->c, j->a, j->g, B, T, C, NH, true);
}
/* e: weight, bias, their gradients (N each) */
static void run_ln_fwd(const job *j) {
  fsdp_cpu_layernorm_forward(j->b, j->c, j->d, j->a, j->e, j->e + j->N, j->M, j->N, 1e-5f);
}
static void run_ln_bwd(const job *j) {
  fsdp_cpu_layernorm_backward(j->g, j->e + 2 * j->N, j->e + 3 * j->N, j->h, j->a, j->e, j->c,
                              j->d, j->M, j->N);
}
static void run_bias_gelu_fwd(const job *j) {
  fsdp_cpu_bias_gelu_forward(j->b, j->a, j->c, j->M, j->N);
}
static void run_bias_gelu_bwd(const job *j) {
  fsdp_cpu_bias_gelu_backward(j->d, j->e, j->g, j->a, j->c, j->M, j->N, true);
}
static void run_colsum(const job *j) { fsdp_cpu_colsum_acc(j->b, j->a, j->M, j->N); }
static void run_embedding(const job *j) {
  fsdp_cpu_embedding_forward(j->b, j->ids, j->a, j->M, j->N);
  fsdp_cpu_embedding_backward(j->c, j->b, j->ids, j->M, j->N);
}
static void run_cross_entropy(const job *j) {
  int64_t count = 0;
  fsdp_cpu_cross_entropy_forward(j->b, j->a, j->ids, j->M, j->N, -1, &count);
  fsdp_cpu_cross_entropy_backward(j->c, 1.0f, j->a, j->b, j->ids, j->M, j->N, -1, count);
}
static void run_adamw(const job *j) {
  fsdp_cpu_adamw_step(j->a, j->b, j->c, j->d, j->n, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 10);
}

/* The reference, (rows, d) @ (d, 4d), as bench/gpt_step.lua takes it (fsdp_cpu_sgemm_gflops):
 * windows of reps_s / 2 each, the fastest */
static double reference(int rows, int d) {
  double gflops;
  if (fsdp_cpu_sgemm_gflops(rows, 4 * d, d, FSDP_CPU_SGEMM_WINDOWS * reps_s / 2, &gflops) !=
      FSDP_OK) {
    fprintf(stderr, "step_floor: %s\n", fsdp_error_msg());
    exit(1);
  }
  return gflops * 1e9;
}

/* ---- one model ----------------------------------------------------------------------------- */

static void model(int L, int d, int ranks) {
  const int B = BATCH / ranks, rows = B * T, NH = d / 64;
  const int64_t big = (int64_t)rows * 4 * d, wbig = (int64_t)4 * d * d;
  float *x = buf(big), *w = buf(wbig), *y = buf(big), *dy = buf(big), *dx = buf(big),
        *dw = buf(wbig), *bias = buf(4 * d), *db = buf(4 * d), *q = buf(big), *r = buf(big);
  float *small = buf(2 * (int64_t)rows), *lnp = buf(4 * (int64_t)d);
  float *stats = buf((int64_t)B * NH * T * 2);
  float *scratch = buf(fsdp_cpu_attention_scratch(B, T, d, NH, fsdp_cpu_threads(), true));
  int64_t *ids = malloc(sizeof(int64_t) * (size_t)rows);
  if (!ids) {
    fprintf(stderr, "step_floor: out of memory\n");
    exit(1);
  }
  for (int i = 0; i < rows; i++) ids[i] = (i * 7919) % V;

  /* the reference before the kernels (and after them: the better) */
  const double sgemm_before = reference(rows, d);

  /* GEMMs: K -> N of a layer's linears, and whether the forward takes its bias in the product
   * (the MLP's first one's bias goes with its GELU); the tied head once */
  const int lin[5][3] = {{d, 3 * d, 1}, {d, d, 1}, {d, 4 * d, 0}, {4 * d, d, 1}, {d, V, 0}};
  const char *names[5] = {"qkv", "proj", "fc", "fc2", "head"};
  double gemm = 0, gemm_flops = 0;
  for (int i = 0; i < 5; i++) {
    const int K = lin[i][0], N = lin[i][1], times = i < 4 ? L : 1;
    const job j = {.a = x, .b = w, .c = lin[i][2] ? bias : NULL, .d = y, .e = dx, .f = dw,
                   .M = rows, .N = N, .K = K};
    const double t1 = best(run_fwd, j), t2 = best(run_dinp, j), t3 = best(run_dw, j);
    const double f = 2.0 * rows * N * K;
    if (products)
      printf("#   %-5s %4d -> %4d: forward %6.1f, input gradient %6.1f, weight gradient %6.1f "
             "GFLOP/s\n",
             names[i], K, N, 1e-9 * f / t1, 1e-9 * f / t2, 1e-9 * f / t3);
    gemm += times * (t1 + t2 + t3);
    gemm_flops += times * 3.0 * f;
  }

  /* attention, the engine's op, L layers */
  const job aj = {.a = q, .b = y, .c = dy, .d = r, .g = stats, .h = scratch, .M = B, .N = d};
  const double att_op = L * best(run_attention, aj);

  /* the rest */
  const job ln = {.a = x, .b = y, .c = small, .d = small + rows, .e = lnp, .g = dx, .h = dy,
                  .M = rows, .N = d};
  const double t_ln = best(run_ln_fwd, ln) + best(run_ln_bwd, ln);
  const job bg = {.a = x, .b = y, .c = bias, .d = dx, .e = db, .g = dy, .M = rows, .N = 4 * d};
  const double t_bg = best(run_bias_gelu_fwd, bg) + best(run_bias_gelu_bwd, bg);
  double t_cs = 0;
  const int cs_n[3] = {3 * d, d, d}; /* qkv, proj, fc2 (fc's with its GELU) */
  for (int i = 0; i < 3; i++) {
    const job cj = {.a = dy, .b = db, .M = rows, .N = cs_n[i]};
    t_cs += best(run_colsum, cj);
  }
  const job ej = {.a = w, .b = y, .c = dw, .ids = ids, .M = rows, .N = d};
  const job xj = {.a = y, .b = small, .c = dx, .ids = ids, .M = rows, .N = V};
  const int64_t params =
      (int64_t)L * (12LL * d * d + 13LL * d) + 2LL * d + (int64_t)V * d + (int64_t)T * d;
  const int64_t share = (params + ranks - 1) / ranks;
  float *p = buf(share), *m = buf(share), *v = buf(share), *g = buf(share);
  for (int64_t i = 0; i < share; i++) v[i] = v[i] < 0 ? -v[i] : v[i];
  const job oj = {.a = p, .b = m, .c = v, .d = g, .n = share};
  const double rest = L * (2 * t_ln + t_bg + t_cs) + t_ln + 2 * best(run_embedding, ej) +
                      best(run_cross_entropy, xj) + best(run_adamw, oj);

  const double sgemm_after = reference(rows, d);
  const double sgemm = sgemm_before > sgemm_after ? sgemm_before : sgemm_after;
  const int64_t nonemb = params - (int64_t)V * d - (int64_t)T * d;
  const double att_flops = 6.0 * L * T * d * rows; /* counted: causal, forward and backward */
  const double counted = 6.0 * nonemb * rows + att_flops; /* this rank's tokens */
  const double att_bound = att_flops * 7.0 / 6.0 / sgemm;
  const double floor_s = gemm + att_op + rest, bound_s = gemm + att_bound + rest;
  printf("L%-2d d=%-4d %d  %7.1f  %7.4f %6.1f%%  %7.4f %7.4f  %7.4f  %7.4f %7.4f   %5.3f  %5.3f\n",
         L, d, ranks, sgemm * 1e-9, gemm, 100.0 * gemm_flops / gemm / sgemm, att_op, att_bound,
         rest, floor_s, bound_s, counted / floor_s / sgemm, counted / bound_s / sgemm);
  fflush(stdout);
  free(x), free(w), free(y), free(dy), free(dx), free(dw), free(bias), free(db), free(q);
  free(r), free(small), free(lnp), free(stats), free(scratch), free(ids);
  free(p), free(m), free(v), free(g);
}

int main(int argc, char **argv) {
  int ranks = 1;
  const char *models = "4,6,12";
  for (int i = 1; i < argc; i++) {
    if (!strncmp(argv[i], "--ranks=", 8)) ranks = atoi(argv[i] + 8);
    else if (!strncmp(argv[i], "--models=", 9)) models = argv[i] + 9;
    else if (!strncmp(argv[i], "--reps_s=", 9)) reps_s = atof(argv[i] + 9);
    else if (!strcmp(argv[i], "--products")) products = true;
    else {
      fprintf(stderr, "usage: step_floor [--ranks=1|2] [--models=4,6,12] [--reps_s=0.2] "
                      "[--products]\n");
      return 2;
    }
  }
  if (ranks != 1 && ranks != 2) {
    fprintf(stderr, "step_floor: --ranks must be 1 or 2\n");
    return 2;
  }
  if (!(reps_s > 0)) {
    fprintf(stderr, "step_floor: --reps_s must be a positive number of seconds\n");
    return 2;
  }
  int layers[8], nmodels = 0;
  char list[64];
  snprintf(list, sizeof list, "%s", models);
  for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
    const int L = atoi(tok);
    if (L != 4 && L != 6 && L != 12) {
      fprintf(stderr, "step_floor: models are 4, 6 and 12 (layers), got %s\n", tok);
      return 2;
    }
    if (nmodels == 8) {
      fprintf(stderr, "step_floor: at most 8 models a run\n");
      return 2;
    }
    layers[nmodels++] = L;
  }
  /* the thread rule without FSDP_THREADS: cores / ranks (docs/cli.md, "Ranks") */
  const int threads = fsdp_cpu_cores() / ranks > 0 ? fsdp_cpu_cores() / ranks : 1;
  fsdp_cpu_set_threads(threads);
  printf("# step_floor: one rank of %d, %d thread(s); seconds a step, each kernel's best call\n",
         ranks, threads);
  printf("# model    N  sgemm GF/s  GEMMs s  GEMM:sg  attn s  attn@sg  rest s   floor s bound s"
         "   ceiling bound\n");
  for (int i = 0; i < nmodels; i++)
    model(layers[i], layers[i] == 4 ? 256 : layers[i] == 6 ? 384 : 768, ranks);
  return 0;
}
