/*
 * attention.c — causal multi-head self-attention on a fused qkv buffer (llm.c layout),
 * forward and backward.
 *
 * All products are sgemm calls on strided views: q, k, v of head h are the column blocks
 * [h*hs, (h+1)*hs) of qkv's three C-wide thirds, with row stride 3C, so nothing is copied.
 * Causality is exploited by walking query rows in tiles of ATT_BLOCK: rows [r0, r1) only see
 * keys [0, r1), so each tile multiplies against a prefix of k / v and about half the
 * T x T work of a full product is skipped. Entries a tile's gemm writes above the diagonal
 * are overwritten by the masked softmax (att holds exact zeros there). The softmax rows, forward
 * and backward, are the instruction-set level's bodies (isa.h: vectors of the level's width,
 * the same bits at every level).
 *
 * Threads: the (batch row, head) pairs are shared out over the pool, each pair's work on one
 * thread (its T x T slice of att stays in that core's cache; the gemms inside a task run
 * serially), so the results are those of one thread. When there are too few pairs to keep the
 * threads busy (fewer than 4 a thread), the forward shares out (pair, query tile) items
 * instead, and the backward runs in two passes: query tiles (datt, dscores, dq), then key tiles
 * (dk and dv as one product over every query row that sees the tile). Tiles are dealt
 * longest-with-shortest (0, n-1, 1, n-2, ...) so that contiguous chunks carry equal causal work.
 */
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/pool.h"

#include <math.h>
#include <string.h>

#define ATT_BLOCK 64

typedef struct att_job {
  float *out, *att, *dqkv, *scratch;
  const float *qkv, *dout, *att_in;
  int B, T, C, NH, ntiles;
  float scale;
  bool set; /* backward: dqkv written, its old contents unread (zeroed pair by pair) */
} att_job;

/* Whether (pair, tile) items are needed to keep the threads busy. */
static bool att_by_tile(int pairs, int ntiles) {
  const int threads = fsdp_cpu_threads();
  return threads > 1 && ntiles > 1 && pairs < 4 * threads;
}

/* The k-th tile in dealing order: 0, n-1, 1, n-2, ... */
static int dealt_tile(int k, int ntiles) { return k % 2 == 0 ? k / 2 : ntiles - 1 - k / 2; }

/* ---- forward --------------------------------------------------------------------------------- */

/* Query rows [r0, r0 + ATT_BLOCK) of pair bh: att rows and out rows. */
static void forward_tile(const att_job *j, int bh, int r0) {
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH, b = bh / j->NH, h = bh % j->NH;
  const float *q = j->qkv + (int64_t)b * T * C3 + h * hs; // (T, hs), row stride 3C
  const float *k = q + C, *v = q + 2 * C;
  float *A = j->att + (int64_t)bh * T * T;             // (T, T)
  float *o = j->out + (int64_t)b * T * C + h * hs;     // (T, hs), row stride C
  const int rows = T - r0 < ATT_BLOCK ? T - r0 : ATT_BLOCK, cols = r0 + rows;
  float *Ab = A + (int64_t)r0 * T;
  /* scores[r0:r1, 0:r1] = q[r0:r1] @ k[0:r1]^T * scale */
  fsdp_cpu_gemm(Ab, q + (int64_t)r0 * C3, k, rows, cols, hs, false, true, j->scale, 0.0f, C3,
                C3, T);
  fsdp_cpu_vec()->att_softmax_rows(A, T, r0, rows);
  /* out[r0:r1] = att[r0:r1, 0:r1] @ v[0:r1] */
  fsdp_cpu_gemm(o + (int64_t)r0 * C, Ab, v, rows, hs, cols, false, false, 1.0f, 0.0f, T, C3, C);
}

static void forward_pairs(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  for (int64_t bh = lo; bh < hi; bh++)
    for (int r0 = 0; r0 < j->T; r0 += ATT_BLOCK) forward_tile(j, (int)bh, r0);
}

static void forward_tiles(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  for (int64_t i = lo; i < hi; i++)
    forward_tile(j, (int)(i / j->ntiles), ATT_BLOCK * dealt_tile((int)(i % j->ntiles), j->ntiles));
}

void fsdp_cpu_attention_forward(float *out, float *att, const float *qkv, int B, int T, int C,
                                int NH) {
  // out (B, T, C), att (B, NH, T, T), qkv (B, T, 3C)
  att_job j = {.out = out, .att = att, .qkv = qkv, .B = B, .T = T, .C = C, .NH = NH,
               .ntiles = (T + ATT_BLOCK - 1) / ATT_BLOCK,
               .scale = 1.0f / sqrtf((float)(C / NH))};
  const int pairs = B * NH;
  if (att_by_tile(pairs, j.ntiles))
    fsdp_cpu_parallel_for((int64_t)pairs * j.ntiles, 1, forward_tiles, &j);
  else
    fsdp_cpu_parallel_for(pairs, 1, forward_pairs, &j);
}

/* ---- backward -------------------------------------------------------------------------------- */

/* Views of pair bh's operands. */
typedef struct att_views {
  const float *q, *k, *v, *A, *g; // (T, hs) row stride 3C; A (T, T); g (T, hs) row stride C
  float *dq, *dk, *dv, *S;        // (T, hs) row stride 3C; S (T, T): datt, then dscores
} att_views;

static att_views views(const att_job *j, int bh) {
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH, b = bh / j->NH, h = bh % j->NH;
  att_views w;
  w.q = j->qkv + (int64_t)b * T * C3 + h * hs;
  w.k = w.q + C;
  w.v = w.q + 2 * C;
  w.dq = j->dqkv + (int64_t)b * T * C3 + h * hs;
  w.dk = w.dq + C;
  w.dv = w.dq + 2 * C;
  w.A = j->att_in + (int64_t)bh * T * T;
  w.S = j->scratch + (int64_t)bh * T * T;
  w.g = j->dout + (int64_t)b * T * C + h * hs;
  return w;
}

/* Query tile r0 of one pair: datt = dout @ v^T, the softmax backward into dscores (zero above
 * the diagonal up to the tile's last column), and dq += dscores @ k * scale. */
static void backward_query_tile(const att_job *j, const att_views *w, int r0) {
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH;
  const int rows = T - r0 < ATT_BLOCK ? T - r0 : ATT_BLOCK, cols = r0 + rows;
  float *Sb = w->S + (int64_t)r0 * T;
  /* datt[r0:r1, 0:r1] = dout[r0:r1] @ v[0:r1]^T */
  fsdp_cpu_gemm(Sb, w->g + (int64_t)r0 * C, w->v, rows, cols, hs, false, true, 1.0f, 0.0f, C, C3,
                T);
  fsdp_cpu_vec()->att_softmax_backward_rows(w->S, w->A, T, r0, rows, cols);
  /* dq[r0:r1] += dscores[r0:r1, 0:r1] @ k[0:r1] * scale */
  fsdp_cpu_gemm(w->dq + (int64_t)r0 * C3, Sb, w->k, rows, hs, cols, false, false, j->scale, 1.0f,
                T, C3, C3);
}

/* Zero pair bh's columns of dq, dk and dv (set mode): they are accumulated right after, so
 * the zeros are written in cache, not in a pass of their own over dqkv. */
static void zero_pair(const att_job *j, const att_views *w) {
  const int hs = j->C / j->NH;
  const int64_t C3 = 3 * (int64_t)j->C;
  for (int t = 0; t < j->T; t++) {
    memset(w->dq + t * C3, 0, sizeof(float) * (size_t)hs);
    memset(w->dk + t * C3, 0, sizeof(float) * (size_t)hs);
    memset(w->dv + t * C3, 0, sizeof(float) * (size_t)hs);
  }
}

static void zero_pairs(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  for (int64_t bh = lo; bh < hi; bh++) {
    const att_views w = views(j, (int)bh);
    zero_pair(j, &w);
  }
}

/* One pair, tile by tile: after each query tile, dv and dk receive its rows' contributions. */
static void backward_pairs(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH;
  for (int64_t bh = lo; bh < hi; bh++) {
    const att_views w = views(j, (int)bh);
    if (j->set) zero_pair(j, &w);
    for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) {
      const int rows = T - r0 < ATT_BLOCK ? T - r0 : ATT_BLOCK, cols = r0 + rows;
      const float *Ab = w.A + (int64_t)r0 * T, *gb = w.g + (int64_t)r0 * C;
      /* dv[0:r1] += att[r0:r1, 0:r1]^T @ dout[r0:r1] */
      fsdp_cpu_gemm(w.dv, Ab, gb, cols, hs, rows, true, false, 1.0f, 1.0f, T, C, C3);
      backward_query_tile(j, &w, r0);
      /* dk[0:r1] += dscores[r0:r1, 0:r1]^T @ q[r0:r1] * scale */
      fsdp_cpu_gemm(w.dk, w.S + (int64_t)r0 * T, w.q + (int64_t)r0 * C3, cols, hs, rows, true,
                    false, j->scale, 1.0f, T, C3, C3);
    }
  }
}

static void backward_query_tiles(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  for (int64_t i = lo; i < hi; i++) {
    const att_views w = views(j, (int)(i / j->ntiles));
    backward_query_tile(j, &w, ATT_BLOCK * dealt_tile((int)(i % j->ntiles), j->ntiles));
  }
}

/* Key tile [c0, c1) of one pair: every query row t >= c0 sees it (att and dscores are zero
 * above the diagonal), so dv and dk of the tile are one product each over rows [c0, T). */
static void backward_key_tiles(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH;
  for (int64_t i = lo; i < hi; i++) {
    const att_views w = views(j, (int)(i / j->ntiles));
    const int c0 = ATT_BLOCK * dealt_tile((int)(i % j->ntiles), j->ntiles);
    const int n = T - c0 < ATT_BLOCK ? T - c0 : ATT_BLOCK;
    /* dv[c0:c1] += att[c0:T, c0:c1]^T @ dout[c0:T] */
    fsdp_cpu_gemm(w.dv + (int64_t)c0 * C3, w.A + (int64_t)c0 * T + c0, w.g + (int64_t)c0 * C, n,
                  hs, T - c0, true, false, 1.0f, 1.0f, T, C, C3);
    /* dk[c0:c1] += dscores[c0:T, c0:c1]^T @ q[c0:T] * scale */
    fsdp_cpu_gemm(w.dk + (int64_t)c0 * C3, w.S + (int64_t)c0 * T + c0, w.q + (int64_t)c0 * C3, n,
                  hs, T - c0, true, false, j->scale, 1.0f, T, C3, C3);
  }
}

void fsdp_cpu_attention_backward(float *dqkv, float *scratch, const float *dout,
                                 const float *qkv, const float *att, int B, int T, int C, int NH,
                                 bool set) {
  // dqkv (B, T, 3C), scratch (B, NH, T, T), dout (B, T, C), qkv (B, T, 3C), att (B, NH, T, T)
  att_job j = {.dqkv = dqkv, .scratch = scratch, .qkv = qkv, .dout = dout, .att_in = att,
               .B = B, .T = T, .C = C, .NH = NH, .ntiles = (T + ATT_BLOCK - 1) / ATT_BLOCK,
               .scale = 1.0f / sqrtf((float)(C / NH)), .set = set};
  const int pairs = B * NH;
  if (att_by_tile(pairs, j.ntiles)) {
    /* tiles of one pair run on different threads: zero every pair first */
    if (set) fsdp_cpu_parallel_for(pairs, 1, zero_pairs, &j);
    fsdp_cpu_parallel_for((int64_t)pairs * j.ntiles, 1, backward_query_tiles, &j);
    fsdp_cpu_parallel_for((int64_t)pairs * j.ntiles, 1, backward_key_tiles, &j);
  } else {
    fsdp_cpu_parallel_for(pairs, 1, backward_pairs, &j);
  }
}
