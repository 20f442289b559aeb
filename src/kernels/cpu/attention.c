/*
 * attention.c — causal multi-head self-attention on a fused qkv buffer (llm.c layout),
 * forward and backward.
 *
 * q, k, v of head h are the column blocks [h*hs, (h+1)*hs) of qkv's three C-wide thirds, with
 * row stride 3C. Query rows are walked in tiles of ATT_BLOCK: rows [r0, r1) only see keys
 * [0, r1). The products are the instruction-set level's att_mm (isa.h), a register-blocked
 * kernel that reads the operands where they lie (strided views) except k and v, which it needs
 * transposed for q k^T and dout v^T: each pair packs them once (att_pack, hs x T floats each, rows
 * padded to 16). att_mm follows the causal mask at its block size (a few rows by a few vectors)
 * rather than the tile's: q k^T stops at each row block's diagonal, att v and dscores k sum
 * only the keys a row block sees, and the key-side products (dv, dk) only the query rows at or
 * after each key. A library GEMM per tile did the whole tile's rectangle (a quarter more work at
 * T = 256) and paid a call, a packing and allocation each time. Every element of a product is
 * one chain of fused multiply-adds in a fixed order, so the bits are the same at every level,
 * every thread count and either way of sharing the work. The softmax rows, forward and
 * backward, are the level's bodies too (isa.h), with the same property. Entries a product
 * writes above the diagonal are overwritten by the masked softmax (exact zeros there), and the
 * products that read past a row's diagonal read those zeros.
 *
 * Nothing of size T x T outlives a call: the forward computes a tile's probabilities in a
 * per-task scratch (its rows stay in the core's cache while they are multiplied with v) and
 * keeps only each row's max and reciprocal sum (`stats`, (B, NH, T, 2), when the caller gives
 * room for them); the backward recomputes each query tile's probabilities with the same
 * product, and from those two numbers a row in one pass (att_softmax_rows_saved: the same
 * exponentials times the same reciprocal, so the forward's bits; without stats, the same
 * softmax rows as the forward), just before it uses them. That costs one more q k^T product
 * per tile in the backward, and saves writing the (B, NH, T, T) probabilities to memory in the
 * forward, keeping them until the backward and reading them back (at T = 256 and 6 heads of
 * 64, 12.6 MB a layer for 8 sequences, against 98 KB of stats).
 *
 * The backward runs in two passes over a pair: query tiles (probabilities, datt, dscores, dq),
 * then key tiles (dk and dv as one product over every query row that sees the tile), keeping the
 * pair's probabilities and dscores in the scratch in between. Every element of dqkv is written
 * once, by one product, so set mode needs no zeroing pass.
 *
 * Threads: the (batch row, head) pairs are shared out over the pool, each pair's work on one
 * thread. When there are too few pairs to keep the threads busy (fewer than 4 a thread), every
 * pair is packed first and (pair, tile) items are shared out instead: the forward's query
 * tiles; the backward's query tiles, then its key tiles. Tiles are dealt longest-with-shortest
 * (0, n-1, 1, n-2, ...) so that contiguous chunks carry equal causal work. Either way each
 * element is the same chain of operations: the results are the same bits at any thread count.
 */
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/pool.h"

#include <math.h>

#define ATT_BLOCK FSDP_CPU_ATT_BLOCK

typedef struct att_job {
  float *out, *dqkv, *scratch;
  /* (B, NH, T, 2), per row the softmax's max and reciprocal sum, or NULL: the forward writes
   * keep, the backward reads saved */
  float *keep;
  const float *saved;
  float *packs; /* by tiles: every pair's k^T (and v^T) packed before the tiles run */
  const float *qkv, *dout;
  int B, T, C, NH, ntiles;
  int64_t items;  /* forward: the items shared out (pairs, or pairs x tiles) */
  int nchunks;    /* by pairs: chunks of pairs, a scratch slot each */
  float scale;
  bool set; /* backward: dqkv written, its old contents unread */
} att_job;

/* Whether (pair, tile) items are needed to keep the threads busy. */
static bool att_by_tile(int pairs, int ntiles, int threads) {
  return threads > 1 && ntiles > 1 && pairs < 4 * threads;
}

/* Floats of one (T, T) scratch matrix and of one packed (hs, T) operand, rounded up to 64
 * bytes: every matrix starts on a cache line (as the scratch does), whatever T. */
static int64_t tt_of(int T) { return ((int64_t)T * T + 15) / 16 * 16; }
static int ldk_of(int T) { return (T + 15) / 16 * 16; } /* att_mm reads whole vectors */
static int64_t pk_of(int T, int hs) { return (int64_t)ldk_of(T) * hs; }

/* chunks of n items shared out over threads (fsdp_cpu_chunks with the count given) */
static int64_t chunks_of(int64_t n, int threads) { return n < threads ? (n < 1 ? 1 : n) : threads; }

/* The k-th tile in dealing order: 0, n-1, 1, n-2, ... */
static int dealt_tile(int k, int ntiles) { return k % 2 == 0 ? k / 2 : ntiles - 1 - k / 2; }

/* Views of one pair's operands and of its work space. */
typedef struct att_views {
  const float *q, *k, *v, *g; // (T, hs) row stride 3C; g (T, hs) row stride C
  float *o;                   // forward: (T, hs) row stride C
  float *dq, *dk, *dv;        // backward: (T, hs) row stride 3C
  float *A, *S;               // (T, T): the probabilities; datt, then dscores
  float *kt, *vt;             // (hs, T): k and v transposed (vt in the backward only)
  int bh;                     // the pair: b * NH + h
} att_views;

/* pair bh's operands; its work space at `space` (the by-pairs layout: A, [S,] kt, [vt]) */
static att_views views(const att_job *j, int bh, float *space) {
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH, b = bh / j->NH, h = bh % j->NH;
  const int64_t TT = tt_of(T), PK = pk_of(T, hs);
  att_views w = {.bh = bh};
  w.q = j->qkv + (int64_t)b * T * C3 + h * hs;
  w.k = w.q + C;
  w.v = w.q + 2 * C;
  if (j->dqkv) {
    w.g = j->dout + (int64_t)b * T * C + h * hs;
    w.dq = j->dqkv + (int64_t)b * T * C3 + h * hs;
    w.dk = w.dq + C;
    w.dv = w.dq + 2 * C;
  } else {
    w.o = j->out + (int64_t)b * T * C + h * hs;
  }
  if (!space) return w; /* the forward by tiles: tile_views places the pack */
  w.A = space;
  if (j->dqkv) {
    w.S = space + TT;
    w.kt = space + 2 * TT;
    w.vt = w.kt + PK;
  } else {
    w.kt = space + TT;
  }
  return w;
}

/* floats of one by-pairs work space */
static int64_t space_of(int T, int hs, bool backward) {
  return (backward ? 2 : 1) * (tt_of(T) + pk_of(T, hs));
}

/* k^T (and v^T for the backward) of pair w into its packs */
static void pack_pair(const att_job *j, const att_views *w) {
  const fsdp_cpu_vec_i *vec = fsdp_cpu_vec();
  const int hs = j->C / j->NH;
  vec->att_pack(w->kt, ldk_of(j->T), w->k, 3 * (int64_t)j->C, j->T, hs);
  if (w->vt) vec->att_pack(w->vt, ldk_of(j->T), w->v, 3 * (int64_t)j->C, j->T, hs);
}

/* By tiles, pair bh's views: its probabilities and dscores (backward) in the scratch, its
 * packs after them. The forward's A is the chunk's (forward_tiles). */
static att_views tile_views(const att_job *j, int bh) {
  const int hs = j->C / j->NH;
  if (j->dqkv) return views(j, bh, j->scratch + (int64_t)bh * space_of(j->T, hs, true));
  att_views w = views(j, bh, NULL);
  w.kt = j->packs + (int64_t)bh * pk_of(j->T, hs);
  return w;
}

static void pack_pairs(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  for (int64_t bh = lo; bh < hi; bh++) {
    const att_views w = tile_views(j, (int)bh);
    pack_pair(j, &w);
  }
}

/* ---- forward --------------------------------------------------------------------------------- */

/* The probabilities of query rows [r0, r0 + ATT_BLOCK) of pair w into rows r0.. of A (T, T):
 * the forward's (keeping the rows' stats when there is room), and the backward's recomputation
 * of them (from the stats when kept, else the forward's call: the same bits either way). */
static void probs_tile(const att_job *j, const att_views *w, float *A, int r0) {
  const int T = j->T, C3 = 3 * j->C, hs = j->C / j->NH;
  const int rows = fsdp_cpu_att_rows(T, r0), cols = r0 + rows;
  const fsdp_cpu_vec_i *vec = fsdp_cpu_vec();
  /* scores[r0:r1, 0:r1] = q[r0:r1] @ k[0:r1]^T * scale, on and below the diagonal */
  vec->att_mm(A + (int64_t)r0 * T, T, w->q + (int64_t)r0 * C3, C3, 1, w->kt, ldk_of(T), rows,
              cols, hs, r0, FSDP_ATT_COLS, j->scale, false);
  const int64_t at = 2 * ((int64_t)w->bh * T + r0);
  if (j->saved) vec->att_softmax_rows_saved(A, T, r0, rows, cols, j->saved + at);
  else vec->att_softmax_rows(A, T, r0, rows, cols, j->keep ? j->keep + at : NULL);
}

/* Query rows [r0, r0 + ATT_BLOCK) of pair w: their probabilities in A, then out rows. */
static void forward_tile(const att_job *j, const att_views *w, float *A, int r0) {
  const int T = j->T, C = j->C, hs = C / j->NH;
  const int rows = fsdp_cpu_att_rows(T, r0), cols = r0 + rows;
  probs_tile(j, w, A, r0);
  /* out[r0:r1] = att[r0:r1, 0:r1] @ v[0:r1]: row t sums keys 0..t */
  fsdp_cpu_vec()->att_mm(w->o + (int64_t)r0 * C, C, A + (int64_t)r0 * T, T, 1, w->v, 3 * C,
                         rows, hs, cols, r0, FSDP_ATT_KHEAD, 1.0f, false);
}

/* the work space of the chunk of items that starts at lo */
static float *chunk_space(const att_job *j, int64_t items, int64_t lo, int64_t per) {
  return j->scratch + (int64_t)fsdp_cpu_chunk_at(items, 1, j->nchunks, lo) * per;
}

static void forward_pairs(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  float *space = chunk_space(j, j->items, lo, space_of(j->T, j->C / j->NH, false));
  for (int64_t bh = lo; bh < hi; bh++) {
    const att_views w = views(j, (int)bh, space);
    pack_pair(j, &w);
    for (int r0 = 0; r0 < j->T; r0 += ATT_BLOCK) forward_tile(j, &w, w.A, r0);
  }
}

static void forward_tiles(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  float *A = chunk_space(j, j->items, lo, tt_of(j->T));
  for (int64_t i = lo; i < hi; i++) {
    const att_views w = tile_views(j, (int)(i / j->ntiles));
    forward_tile(j, &w, A, ATT_BLOCK * dealt_tile((int)(i % j->ntiles), j->ntiles));
  }
}

static int64_t forward_items(int B, int T, int NH, int threads) {
  const int pairs = B * NH, ntiles = (T + ATT_BLOCK - 1) / ATT_BLOCK;
  return att_by_tile(pairs, ntiles, threads) ? (int64_t)pairs * ntiles : pairs;
}

int64_t fsdp_cpu_attention_scratch(int B, int T, int C, int NH, int threads, bool backward) {
  const int pairs = B * NH, ntiles = (T + ATT_BLOCK - 1) / ATT_BLOCK, hs = C / NH;
  const bool by_tile = att_by_tile(pairs, ntiles, threads);
  if (!backward) {
    const int64_t chunks = chunks_of(forward_items(B, T, NH, threads), threads);
    return by_tile ? chunks * tt_of(T) + pairs * pk_of(T, hs) : chunks * space_of(T, hs, false);
  }
  /* by tiles, every pair's space: the two passes share its probabilities, dscores and packs */
  return (by_tile ? pairs : chunks_of(pairs, threads)) * space_of(T, hs, true);
}

void fsdp_cpu_attention_forward(float *out, float *stats, float *scratch, const float *qkv,
                                int B, int T, int C, int NH) {
  // out (B, T, C), stats (B, NH, T, 2) or NULL, qkv (B, T, 3C),
  // scratch: fsdp_cpu_attention_scratch(B, T, C, NH, threads, false)
  att_job j = {.out = out, .keep = stats, .scratch = scratch, .qkv = qkv, .B = B, .T = T,
               .C = C, .NH = NH, .ntiles = (T + ATT_BLOCK - 1) / ATT_BLOCK,
               .scale = 1.0f / sqrtf((float)(C / NH))};
  const int pairs = B * NH;
  j.items = forward_items(B, T, NH, fsdp_cpu_threads());
  j.nchunks = fsdp_cpu_chunks(j.items, 1);
  if (j.items == pairs) {
    fsdp_cpu_parallel_for(pairs, 1, forward_pairs, &j);
    return;
  }
  j.packs = scratch + chunks_of(j.items, fsdp_cpu_threads()) * tt_of(T);
  fsdp_cpu_parallel_for(pairs, 1, pack_pairs, &j);
  fsdp_cpu_parallel_for(j.items, 1, forward_tiles, &j);
}

/* ---- backward -------------------------------------------------------------------------------- */

/* Query tile r0 of pair w: its probabilities again, datt = dout @ v^T, the softmax backward
 * into dscores (zero above the diagonal up to the tile's last column), and
 * dq = dscores @ k * scale (its rows belong to this tile alone: written in set mode, else
 * added). */
static void backward_query_tile(const att_job *j, const att_views *w, int r0) {
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH;
  const int rows = fsdp_cpu_att_rows(T, r0), cols = r0 + rows;
  const fsdp_cpu_vec_i *vec = fsdp_cpu_vec();
  float *Sb = w->S + (int64_t)r0 * T;
  probs_tile(j, w, w->A, r0);
  /* datt[r0:r1, 0:r1] = dout[r0:r1] @ v[0:r1]^T, on and below the diagonal */
  vec->att_mm(Sb, T, w->g + (int64_t)r0 * C, C, 1, w->vt, ldk_of(T), rows, cols, hs, r0,
              FSDP_ATT_COLS, 1.0f, false);
  vec->att_softmax_backward_rows(w->S, w->A, T, r0, rows, cols);
  /* dq[r0:r1] (+)= dscores[r0:r1, 0:r1] @ k[0:r1] * scale */
  vec->att_mm(w->dq + (int64_t)r0 * C3, C3, Sb, T, 1, w->k, C3, rows, hs, cols, r0,
              FSDP_ATT_KHEAD, j->scale, !j->set);
}

/* Key tile [c0, c1) of pair w: every query row t >= c0 sees it (att and dscores are zero
 * above the diagonal), so dv and dk of the tile are one product each over rows [c0, T):
 * att^T @ dout and dscores^T @ q * scale, each key row's whole sum in one chain (written in set
 * mode, else added). */
static void backward_keys(const att_job *j, const att_views *w, int c0) {
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH, n = fsdp_cpu_att_rows(T, c0);
  const fsdp_cpu_vec_i *vec = fsdp_cpu_vec();
  const int64_t at = (int64_t)c0 * T + c0;
  vec->att_mm(w->dv + (int64_t)c0 * C3, C3, w->A + at, 1, T, w->g + (int64_t)c0 * C, C, n, hs,
              T - c0, 0, FSDP_ATT_KTAIL, 1.0f, !j->set);
  vec->att_mm(w->dk + (int64_t)c0 * C3, C3, w->S + at, 1, T, w->q + (int64_t)c0 * C3, C3, n, hs,
              T - c0, 0, FSDP_ATT_KTAIL, j->scale, !j->set);
}

/* by tiles, before the query tiles: every pair's packs */
static void prepare_pairs(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  for (int64_t bh = lo; bh < hi; bh++) {
    const att_views w = tile_views(j, (int)bh);
    pack_pair(j, &w);
  }
}

/* One pair: its query tiles (the probabilities and dscores of every row stay in the task's
 * scratch), then its key tiles, the same products as the split by tiles (the same bits). */
static void backward_pairs(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  const int T = j->T, hs = j->C / j->NH;
  float *space = chunk_space(j, j->B * j->NH, lo, space_of(T, hs, true));
  for (int64_t bh = lo; bh < hi; bh++) {
    const att_views w = views(j, (int)bh, space);
    pack_pair(j, &w);
    for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) backward_query_tile(j, &w, r0);
    for (int c0 = 0; c0 < T; c0 += ATT_BLOCK) backward_keys(j, &w, c0);
  }
}

static void backward_query_tiles(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  for (int64_t i = lo; i < hi; i++) {
    const att_views w = tile_views(j, (int)(i / j->ntiles));
    backward_query_tile(j, &w, ATT_BLOCK * dealt_tile((int)(i % j->ntiles), j->ntiles));
  }
}

static void backward_key_tiles(void *ctx, int64_t lo, int64_t hi) {
  const att_job *j = ctx;
  for (int64_t i = lo; i < hi; i++) {
    const att_views w = tile_views(j, (int)(i / j->ntiles));
    backward_keys(j, &w, ATT_BLOCK * dealt_tile((int)(i % j->ntiles), j->ntiles));
  }
}

void fsdp_cpu_attention_backward(float *dqkv, float *scratch, const float *dout,
                                 const float *qkv, const float *stats, int B, int T, int C,
                                 int NH, bool set) {
  // dqkv (B, T, 3C), dout (B, T, C), qkv (B, T, 3C), stats: the forward's or NULL,
  // scratch: fsdp_cpu_attention_scratch(B, T, C, NH, threads, true)
  att_job j = {.dqkv = dqkv, .scratch = scratch, .saved = stats, .qkv = qkv, .dout = dout,
               .B = B, .T = T, .C = C, .NH = NH, .ntiles = (T + ATT_BLOCK - 1) / ATT_BLOCK,
               .scale = 1.0f / sqrtf((float)(C / NH)), .set = set};
  const int pairs = B * NH;
  j.nchunks = fsdp_cpu_chunks(pairs, 1);
  if (att_by_tile(pairs, j.ntiles, fsdp_cpu_threads())) {
    /* tiles of one pair run on different threads: pack every pair first */
    fsdp_cpu_parallel_for(pairs, 1, prepare_pairs, &j);
    fsdp_cpu_parallel_for((int64_t)pairs * j.ntiles, 1, backward_query_tiles, &j);
    fsdp_cpu_parallel_for((int64_t)pairs * j.ntiles, 1, backward_key_tiles, &j);
  } else {
    fsdp_cpu_parallel_for(pairs, 1, backward_pairs, &j);
  }
}
