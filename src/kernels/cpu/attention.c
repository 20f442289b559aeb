/*
 * attention.c — causal multi-head self-attention on a fused qkv buffer (llm.c layout),
 * forward and backward.
 *
 * All products are sgemm calls on strided views: q, k, v of head h are the column blocks
 * [h*hs, (h+1)*hs) of qkv's three C-wide thirds, with row stride 3C, so nothing is copied.
 * Causality is exploited by walking query rows in tiles of ATT_BLOCK: rows [r0, r1) only see
 * keys [0, r1), so each tile multiplies against a prefix of k / v and about half the
 * T x T work of a full product is skipped. Entries a tile's gemm writes above the diagonal
 * are overwritten by the masked softmax (exact zeros there). The softmax rows, forward and
 * backward, are the instruction-set level's bodies (isa.h: vectors of the level's width, the
 * same bits at every level).
 *
 * Nothing of size T x T outlives a call: the forward computes a tile's probabilities in a
 * per-task scratch (its rows stay in the core's cache while they are multiplied with v) and
 * keeps nothing; the backward recomputes each query tile's probabilities with the same
 * product and the same softmax rows, so they are the forward's bits, just before it uses them.
 * That costs one more q k^T product per tile in the backward, and saves writing the
 * (B, NH, T, T) probabilities to memory in the forward, keeping them until the backward and
 * reading them back (at T = 256 and 6 heads of 64, 12.6 MB a layer for 8 sequences).
 *
 * Threads: the (batch row, head) pairs are shared out over the pool, each pair's work on one
 * thread (the gemms inside a task run serially), so the results are those of one thread. When
 * there are too few pairs to keep the threads busy (fewer than 4 a thread), the forward shares
 * out (pair, query tile) items instead, and the backward runs in two passes: query tiles
 * (probabilities, datt, dscores, dq), then key tiles (dk and dv as one product over every query
 * row that sees the tile); the two passes keep each pair's probabilities and dscores in the
 * scratch in between. Tiles are dealt longest-with-shortest (0, n-1, 1, n-2, ...) so that
 * contiguous chunks carry equal causal work.
 */
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/pool.h"

#include <math.h>
#include <string.h>

#define ATT_BLOCK FSDP_CPU_ATT_BLOCK

typedef struct att_job {
  float *out, *dqkv, *scratch;
  const float *qkv, *dout;
  int B, T, C, NH, ntiles;
  int64_t items;  /* forward: the items shared out (pairs, or pairs x tiles) */
  int nchunks;    /* forward, backward by pairs: chunks of items, a scratch slot each */
  float scale;
  bool set; /* backward: dqkv written, its old contents unread (zeroed pair by pair) */
} att_job;

/* Whether (pair, tile) items are needed to keep the threads busy. */
static bool att_by_tile(int pairs, int ntiles, int threads) {
  return threads > 1 && ntiles > 1 && pairs < 4 * threads;
}

/* Floats of one (T, T) scratch matrix, rounded up to 64 bytes: every matrix starts on a cache
 * line (as the scratch does), whatever T. */
static int64_t tt_of(int T) { return ((int64_t)T * T + 15) / 16 * 16; }

/* chunks of n items shared out over threads (fsdp_cpu_chunks with the count given) */
static int64_t chunks_of(int64_t n, int threads) { return n < threads ? (n < 1 ? 1 : n) : threads; }

/* The k-th tile in dealing order: 0, n-1, 1, n-2, ... */
static int dealt_tile(int k, int ntiles) { return k % 2 == 0 ? k / 2 : ntiles - 1 - k / 2; }

/* ---- forward --------------------------------------------------------------------------------- */

/* The probabilities of query rows [r0, r0 + ATT_BLOCK) of pair bh into rows r0.. of A (T, T):
 * the forward's, and the backward's recomputation of them (the same call, the same bits). */
static void probs_tile(const att_job *j, float *A, int bh, int r0) {
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH, b = bh / j->NH, h = bh % j->NH;
  const float *q = j->qkv + (int64_t)b * T * C3 + h * hs; // (T, hs), row stride 3C
  const int rows = fsdp_cpu_att_rows(T, r0), cols = r0 + rows;
  /* scores[r0:r1, 0:r1] = q[r0:r1] @ k[0:r1]^T * scale */
  fsdp_cpu_gemm(A + (int64_t)r0 * T, q + (int64_t)r0 * C3, q + C, rows, cols, hs, false, true,
                j->scale, 0.0f, C3, C3, T);
  fsdp_cpu_vec()->att_softmax_rows(A, T, r0, rows);
}

/* Query rows [r0, r0 + ATT_BLOCK) of pair bh: their probabilities in A (the task's scratch),
 * then out rows. */
static void forward_tile(const att_job *j, float *A, int bh, int r0) {
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH, b = bh / j->NH, h = bh % j->NH;
  const float *v = j->qkv + (int64_t)b * T * C3 + h * hs + 2 * C;
  float *o = j->out + (int64_t)b * T * C + h * hs; // (T, hs), row stride C
  const int rows = fsdp_cpu_att_rows(T, r0), cols = r0 + rows;
  probs_tile(j, A, bh, r0);
  /* out[r0:r1] = att[r0:r1, 0:r1] @ v[0:r1] */
  fsdp_cpu_gemm(o + (int64_t)r0 * C, A + (int64_t)r0 * T, v, rows, hs, cols, false, false, 1.0f,
                0.0f, T, C3, C);
}

/* the (T, T) scratch of the chunk of items that starts at lo */
static float *forward_slot(const att_job *j, int64_t lo) {
  return j->scratch + (int64_t)fsdp_cpu_chunk_at(j->items, 1, j->nchunks, lo) * tt_of(j->T);
}

static void forward_pairs(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  float *A = forward_slot(j, lo);
  for (int64_t bh = lo; bh < hi; bh++)
    for (int r0 = 0; r0 < j->T; r0 += ATT_BLOCK) forward_tile(j, A, (int)bh, r0);
}

static void forward_tiles(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  float *A = forward_slot(j, lo);
  for (int64_t i = lo; i < hi; i++)
    forward_tile(j, A, (int)(i / j->ntiles),
                 ATT_BLOCK * dealt_tile((int)(i % j->ntiles), j->ntiles));
}

static int64_t forward_items(int B, int T, int NH, int threads) {
  const int pairs = B * NH, ntiles = (T + ATT_BLOCK - 1) / ATT_BLOCK;
  return att_by_tile(pairs, ntiles, threads) ? (int64_t)pairs * ntiles : pairs;
}

int64_t fsdp_cpu_attention_scratch(int B, int T, int NH, int threads, bool backward) {
  const int64_t TT = tt_of(T);
  const int pairs = B * NH, ntiles = (T + ATT_BLOCK - 1) / ATT_BLOCK;
  if (!backward) return chunks_of(forward_items(B, T, NH, threads), threads) * TT;
  /* probabilities and dscores: per task by pairs, per pair when two passes share them */
  if (att_by_tile(pairs, ntiles, threads)) return 2 * pairs * TT;
  return 2 * chunks_of(pairs, threads) * TT;
}

void fsdp_cpu_attention_forward(float *out, float *scratch, const float *qkv, int B, int T,
                                int C, int NH) {
  // out (B, T, C), qkv (B, T, 3C), scratch: fsdp_cpu_attention_scratch(B, T, NH, threads, false)
  att_job j = {.out = out, .scratch = scratch, .qkv = qkv, .B = B, .T = T, .C = C, .NH = NH,
               .ntiles = (T + ATT_BLOCK - 1) / ATT_BLOCK,
               .scale = 1.0f / sqrtf((float)(C / NH))};
  j.items = forward_items(B, T, NH, fsdp_cpu_threads());
  j.nchunks = fsdp_cpu_chunks(j.items, 1);
  fsdp_cpu_parallel_for(j.items, 1, j.items == B * NH ? forward_pairs : forward_tiles, &j);
}

/* ---- backward -------------------------------------------------------------------------------- */

/* Views of pair bh's operands; A and S in scratch (A, S). */
typedef struct att_views {
  const float *q, *k, *v, *g; // (T, hs) row stride 3C; g (T, hs) row stride C
  float *dq, *dk, *dv;        // (T, hs) row stride 3C
  float *A, *S;               // (T, T): the probabilities; datt, then dscores
} att_views;

static att_views views(const att_job *j, int bh, float *A, float *S) {
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH, b = bh / j->NH, h = bh % j->NH;
  att_views w;
  w.q = j->qkv + (int64_t)b * T * C3 + h * hs;
  w.k = w.q + C;
  w.v = w.q + 2 * C;
  w.dq = j->dqkv + (int64_t)b * T * C3 + h * hs;
  w.dk = w.dq + C;
  w.dv = w.dq + 2 * C;
  w.A = A;
  w.S = S;
  w.g = j->dout + (int64_t)b * T * C + h * hs;
  return w;
}

/* Query tile r0 of pair bh: its probabilities again, datt = dout @ v^T, the softmax backward
 * into dscores (zero above the diagonal up to the tile's last column), and
 * dq += dscores @ k * scale. */
static void backward_query_tile(const att_job *j, const att_views *w, int bh, int r0) {
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH;
  const int rows = fsdp_cpu_att_rows(T, r0), cols = r0 + rows;
  float *Sb = w->S + (int64_t)r0 * T;
  probs_tile(j, w->A, bh, r0);
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
    const att_views w = views(j, (int)bh, NULL, NULL);
    zero_pair(j, &w);
  }
}

/* the (T, T) probabilities and dscores of pair bh when two passes share them */
static att_views pair_views(const att_job *j, int bh) {
  const int64_t TT = tt_of(j->T);
  float *A = j->scratch + 2 * bh * TT;
  return views(j, bh, A, A + TT);
}

/* One pair, tile by tile: after each query tile, dv and dk receive its rows' contributions. */
static void backward_pairs(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH;
  const int64_t TT = tt_of(T);
  float *A = j->scratch + 2 * (int64_t)fsdp_cpu_chunk_at(j->B * j->NH, 1, j->nchunks, lo) * TT;
  for (int64_t bh = lo; bh < hi; bh++) {
    const att_views w = views(j, (int)bh, A, A + TT);
    if (j->set) zero_pair(j, &w);
    for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) {
      const int rows = fsdp_cpu_att_rows(T, r0), cols = r0 + rows;
      const float *Ab = w.A + (int64_t)r0 * T, *gb = w.g + (int64_t)r0 * C;
      backward_query_tile(j, &w, (int)bh, r0);
      /* dv[0:r1] += att[r0:r1, 0:r1]^T @ dout[r0:r1] */
      fsdp_cpu_gemm(w.dv, Ab, gb, cols, hs, rows, true, false, 1.0f, 1.0f, T, C, C3);
      /* dk[0:r1] += dscores[r0:r1, 0:r1]^T @ q[r0:r1] * scale */
      fsdp_cpu_gemm(w.dk, w.S + (int64_t)r0 * T, w.q + (int64_t)r0 * C3, cols, hs, rows, true,
                    false, j->scale, 1.0f, T, C3, C3);
    }
  }
}

static void backward_query_tiles(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  for (int64_t i = lo; i < hi; i++) {
    const int bh = (int)(i / j->ntiles);
    const att_views w = pair_views(j, bh);
    backward_query_tile(j, &w, bh, ATT_BLOCK * dealt_tile((int)(i % j->ntiles), j->ntiles));
  }
}

/* Key tile [c0, c1) of one pair: every query row t >= c0 sees it (att and dscores are zero
 * above the diagonal), so dv and dk of the tile are one product each over rows [c0, T). */
static void backward_key_tiles(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH;
  for (int64_t i = lo; i < hi; i++) {
    const att_views w = pair_views(j, (int)(i / j->ntiles));
    const int c0 = ATT_BLOCK * dealt_tile((int)(i % j->ntiles), j->ntiles);
    const int n = fsdp_cpu_att_rows(T, c0);
    /* dv[c0:c1] += att[c0:T, c0:c1]^T @ dout[c0:T] */
    fsdp_cpu_gemm(w.dv + (int64_t)c0 * C3, w.A + (int64_t)c0 * T + c0, w.g + (int64_t)c0 * C, n,
                  hs, T - c0, true, false, 1.0f, 1.0f, T, C, C3);
    /* dk[c0:c1] += dscores[c0:T, c0:c1]^T @ q[c0:T] * scale */
    fsdp_cpu_gemm(w.dk + (int64_t)c0 * C3, w.S + (int64_t)c0 * T + c0, w.q + (int64_t)c0 * C3, n,
                  hs, T - c0, true, false, j->scale, 1.0f, T, C3, C3);
  }
}

void fsdp_cpu_attention_backward(float *dqkv, float *scratch, const float *dout,
                                 const float *qkv, int B, int T, int C, int NH, bool set) {
  // dqkv (B, T, 3C), dout (B, T, C), qkv (B, T, 3C),
  // scratch: fsdp_cpu_attention_scratch(B, T, NH, threads, true)
  att_job j = {.dqkv = dqkv, .scratch = scratch, .qkv = qkv, .dout = dout, .B = B, .T = T,
               .C = C, .NH = NH, .ntiles = (T + ATT_BLOCK - 1) / ATT_BLOCK,
               .scale = 1.0f / sqrtf((float)(C / NH)), .set = set};
  const int pairs = B * NH;
  j.nchunks = fsdp_cpu_chunks(pairs, 1);
  if (att_by_tile(pairs, j.ntiles, fsdp_cpu_threads())) {
    /* tiles of one pair run on different threads: zero every pair first */
    if (set) fsdp_cpu_parallel_for(pairs, 1, zero_pairs, &j);
    fsdp_cpu_parallel_for((int64_t)pairs * j.ntiles, 1, backward_query_tiles, &j);
    fsdp_cpu_parallel_for((int64_t)pairs * j.ntiles, 1, backward_key_tiles, &j);
  } else {
    fsdp_cpu_parallel_for(pairs, 1, backward_pairs, &j);
  }
}
