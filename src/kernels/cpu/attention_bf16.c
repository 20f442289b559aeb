/*
 * attention_bf16.c — causal self-attention on bf16 operands with the processor's bf16 dot
 * products (AVX512_BF16's VDPBF16PS, att_bf16.c), for the mixed-precision step. The other way
 * (half.c) widens a batch row to f32, runs the f32 kernel (attention.c) and narrows the results:
 * its products run at the f32 rate and the widening is a pass of its own.
 *
 * The shape of attention.c: each (batch row, head) pair on one thread, query rows in tiles of
 * ATT_BLOCK, each against the keys it sees, the products following the causal mask at their
 * register block's size. The products read bf16 pairs adjacent along the sum; the operands that
 * are not laid out so are packed once per pair: k and v transposed (q k^T, dout v^T: their rows
 * hold the pairs, so a transpose of 32-bit words, isa.h's att_pack), k, v, q and dout with two
 * rows interleaved (att v, dscores k, and the key tiles' att^T dout and dscores^T q), and for
 * each key tile the probabilities and dscores below it, interleaved by rows.
 *
 * Forward, per query tile: scores (f32) = q k^T / sqrt(hs); the causal softmax rows (the f32
 * kernel's arithmetic, isa.h) storing att (bf16), the probabilities rounded once, and keeping
 * each row's max and reciprocal sum when the caller gives room for them; out (bf16) = att v.
 * The backward recomputes each query tile's scores with the same product and rebuilds att from
 * the stats in one pass (att_softmax_rows_saved_bf16: the same exponentials times the same
 * reciprocal, the same rounding; without stats, the forward's rows again): the forward's bf16
 * probabilities, bit for bit. Then datt (f32) = dout v^T, the softmax backward reading att
 * and storing dscores rounded to bf16, dq = dscores k / sqrt(hs); then per key tile, over
 * every query row that sees it: dv = att^T dout, dk = dscores^T q / sqrt(hs). Every output
 * element is written by one product (no bf16 running sums; added into dqkv with one rounding
 * when the backward accumulates).
 *
 * Against the widening way the products' sums run in another order and two operands are bf16
 * where that way keeps f32: the probabilities in att v and dscores in dq and dk. The results
 * differ by about bf16's precision (tests/c/test_half.c bounds them); each pair is computed by
 * one thread in a fixed order, so the results are the same bits at any thread count and however
 * the rows are split over ranks.
 *
 * Where it runs: the native bf16 products on (FSDP_BF16_GEMM), AVX512_BF16 at the AVX-512 level,
 * even T and head size (pairs never straddle a row or a head), T up to ATT_NATIVE_T (the
 * per-task scratch holds a pair's T x T scores, probabilities and dscores), and qkv and dout at
 * even addresses of 32-bit words. Elsewhere the widening way computes it.
 */
#include <math.h>
#include <stdint.h>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/half.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/pool.h"

#define ATT_BLOCK FSDP_CPU_ATT_BLOCK
#define ATT_NATIVE_T 1024

typedef struct {
  uint16_t *out, *dqkv;
  const uint16_t *qkv, *dout;
  /* (B, NH, T, 2), per row the softmax's max and reciprocal sum, or NULL: the forward writes
   * keep, the backward reads saved */
  float *keep;
  const float *saved;
  int B, T, C, NH, nchunks;
  float scale;
  bool set;      /* backward: dqkv written (else added, one rounding) */
  char *scratch; /* per chunk: slot bytes */
  size_t slot;
} bf_job;

/* 32-bit words: a row of T (the transposed packs: k^T, v^T), of hs (the interleaved packs) */
static int64_t ld_t(int T) { return (T + 15) / 16 * 16; }
static int64_t ld_h(int hs) { return (hs + 15) / 16 * 16; }

/* One task's scratch: the pair's scores (T x T f32), probabilities and, in the backward,
 * dscores (T x T bf16), then the packs (64-byte aligned each). */
typedef struct {
  float *S;
  uint16_t *att, *D;
  uint32_t *kt, *vt, *ki, *vi, *qi, *gi, *tile_a, *tile_d;
} bf_work;

static size_t round64(size_t n) { return (n + 63) / 64 * 64; }

static size_t work_layout(const bf_job *j, bool backward, char *base, bf_work *w) {
  const int T = j->T, hs = j->C / j->NH;
  const size_t TT = (size_t)T * (size_t)T;
  const size_t tpack = round64((size_t)(hs / 2) * (size_t)ld_t(T) * 4),
               ipack = round64((size_t)(T / 2) * (size_t)ld_h(hs) * 4),
               tile = round64((size_t)(T / 2) * ATT_BLOCK * 4);
  size_t off = 0;
#define TAKE(field, type, bytes, when)                                              \
  do {                                                                              \
    if (w) w->field = (when) ? (type *)(base + off) : NULL;                         \
    if (when) off += (bytes);                                                       \
  } while (0)
  TAKE(S, float, round64(TT * 4), true);
  TAKE(att, uint16_t, round64(TT * 2), true);
  TAKE(D, uint16_t, round64(TT * 2), backward);
  TAKE(kt, uint32_t, tpack, true);
  TAKE(vt, uint32_t, tpack, backward);
  TAKE(ki, uint32_t, ipack, backward);
  TAKE(vi, uint32_t, ipack, !backward);
  TAKE(qi, uint32_t, ipack, backward);
  TAKE(gi, uint32_t, ipack, backward);
  TAKE(tile_a, uint32_t, tile, backward);
  TAKE(tile_d, uint32_t, tile, backward);
#undef TAKE
  return off;
}

static char *slot_of(const bf_job *j, int64_t lo) {
  return j->scratch + (size_t)fsdp_cpu_chunk_at((int64_t)j->B * j->NH, 1, j->nchunks, lo) *
                          j->slot;
}

/* S rows [r0, r0 + rows) of pair pr = scale q k^T against the keys they see, their
 * probabilities rounded into att (the forward's, keeping the rows' stats when there is room,
 * and the backward's recomputation, in one pass from the stats when kept: the same bits) */
static void probs_tile(const bf_job *j, const bf_work *w, int64_t pr, const uint16_t *q, int r0,
                       int rows) {
  const int T = j->T, hs = j->C / j->NH;
  const fsdp_cpu_vec_i *vec = fsdp_cpu_vec();
  fsdp_cpu_att_bf16_mm(w->S + (int64_t)r0 * T, T, false, q + (int64_t)r0 * 3 * j->C, 3 * j->C,
                       2, w->kt, ld_t(T), rows, r0 + rows, hs, r0, FSDP_ATT_COLS, j->scale,
                       false);
  const int64_t at = 2 * (pr * T + r0);
  if (j->saved)
    vec->att_softmax_rows_saved_bf16(w->att, w->S, T, r0, rows, r0 + rows, j->saved + at);
  else
    vec->att_softmax_rows_bf16(w->att, w->S, T, r0, rows, r0 + rows,
                               j->keep ? j->keep + at : NULL);
}

/* k (or v) of one head, T rows of hs with stride 3C, transposed as 32-bit words: (hs / 2, T) */
static void pack_t(uint32_t *dst, const uint16_t *src, int T, int hs, int C3) {
  fsdp_cpu_vec()->att_pack((float *)dst, ld_t(T), (const float *)src, C3 / 2, T, hs / 2);
}

static void forward_pairs(void *ctx, int64_t lo, int64_t hi) {
  bf_job *j = ctx;
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH;
  bf_work w;
  work_layout(j, false, slot_of(j, lo), &w);
  for (int64_t pr = lo; pr < hi; pr++) {
    const int64_t b = pr / j->NH, h = pr % j->NH;
    const uint16_t *q = j->qkv + b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C;
    uint16_t *out = j->out + b * T * C + h * hs;
    pack_t(w.kt, k, T, hs, C3);
    fsdp_cpu_att_bf16_interleave(w.vi, ld_h(hs), v, C3, T, hs);
    for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) {
      const int rows = fsdp_cpu_att_rows(T, r0), cols = r0 + rows;
      probs_tile(j, &w, pr, q, r0, rows);
      fsdp_cpu_att_bf16_mm(out + (int64_t)r0 * C, C, true, w.att + (int64_t)r0 * T, T, 2, w.vi,
                           ld_h(hs), rows, hs, cols, r0, FSDP_ATT_KHEAD, 1.0f, false);
    }
  }
}

static void backward_pairs(void *ctx, int64_t lo, int64_t hi) {
  bf_job *j = ctx;
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH;
  const fsdp_cpu_vec_i *vec = fsdp_cpu_vec();
  bf_work w;
  work_layout(j, true, slot_of(j, lo), &w);
  const int64_t lh = ld_h(hs);
  for (int64_t pr = lo; pr < hi; pr++) {
    const int64_t b = pr / j->NH, h = pr % j->NH;
    const uint16_t *q = j->qkv + b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C;
    const uint16_t *g = j->dout + b * T * C + h * hs;
    uint16_t *dq = j->dqkv + b * T * C3 + h * hs, *dk = dq + C, *dv = dq + 2 * C;
    pack_t(w.kt, k, T, hs, C3);
    pack_t(w.vt, v, T, hs, C3);
    fsdp_cpu_att_bf16_interleave(w.ki, lh, k, C3, T, hs);
    fsdp_cpu_att_bf16_interleave(w.qi, lh, q, C3, T, hs);
    fsdp_cpu_att_bf16_interleave(w.gi, lh, g, C, T, hs);
    for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) { /* query tiles: att, datt, dscores, dq */
      const int rows = fsdp_cpu_att_rows(T, r0), cols = r0 + rows;
      probs_tile(j, &w, pr, q, r0, rows);
      fsdp_cpu_att_bf16_mm(w.S + (int64_t)r0 * T, T, false, g + (int64_t)r0 * C, C, 2, w.vt,
                           ld_t(T), rows, cols, hs, r0, FSDP_ATT_COLS, 1.0f, false);
      vec->att_softmax_backward_rows_bf16(w.D, w.S, w.att, T, r0, rows, cols);
      fsdp_cpu_att_bf16_mm(dq + (int64_t)r0 * C3, C3, true, w.D + (int64_t)r0 * T, T, 2, w.ki,
                           lh, rows, hs, cols, r0, FSDP_ATT_KHEAD, j->scale, !j->set);
    }
    for (int c0 = 0; c0 < T; c0 += ATT_BLOCK) { /* key tiles: dv, dk over the rows from c0 */
      const int n = fsdp_cpu_att_rows(T, c0);
      const int64_t corner = (int64_t)c0 * T + c0;
      /* the tile's columns of att and dscores, rows c0.. interleaved: a^T's pairs */
      fsdp_cpu_att_bf16_interleave(w.tile_a, ATT_BLOCK, w.att + corner, T, T - c0, n);
      fsdp_cpu_att_bf16_interleave(w.tile_d, ATT_BLOCK, w.D + corner, T, T - c0, n);
      fsdp_cpu_att_bf16_mm(dv + (int64_t)c0 * C3, C3, true, (const uint16_t *)w.tile_a, 2,
                           2 * ATT_BLOCK, w.gi + (c0 / 2) * lh, lh, n, hs, T - c0, 0,
                           FSDP_ATT_KTAIL, 1.0f, !j->set);
      fsdp_cpu_att_bf16_mm(dk + (int64_t)c0 * C3, C3, true, (const uint16_t *)w.tile_d, 2,
                           2 * ATT_BLOCK, w.qi + (c0 / 2) * lh, lh, n, hs, T - c0, 0,
                           FSDP_ATT_KTAIL, j->scale, !j->set);
    }
  }
}

/* Not the batch size or the thread count: the same rows give the same bits however a batch is
 * split over ranks, micro-batches and threads. */
bool fsdp_cpu_bf16_attention_native(int B, int T, int C, int NH) {
  return fsdp_cpu_bf16_gemm_native() && fsdp_cpu_att_bf16_supported() && B >= 1 && NH >= 1 &&
         C % NH == 0 && (C / NH) % 2 == 0 && T >= 2 && T % 2 == 0 && T <= ATT_NATIVE_T;
}

/* the transposed packs move whole 32-bit words: both operands at even 16-bit addresses */
bool fsdp_cpu_bf16_attention_aligned(const void *qkv, const void *dout) {
  return ((uintptr_t)qkv | (uintptr_t)dout) % 4 == 0;
}

/* FSDP_CPU_OTHER_WAY when an operand is not aligned so; FSDP_ERR when the scratch is refused. */
static int run(bf_job *j, bool backward) {
  if (!fsdp_cpu_bf16_attention_aligned(j->qkv, backward ? j->dout : NULL))
    return FSDP_CPU_OTHER_WAY;
  const int64_t pairs = (int64_t)j->B * j->NH;
  j->slot = work_layout(j, backward, NULL, NULL);
  j->nchunks = fsdp_cpu_chunks(pairs, 1);
  fsdp_cpu_work w = {0};
  j->scratch = fsdp_cpu_work_buf(&w, (int64_t)(j->slot * (size_t)j->nchunks), 1);
  if (!w.failed) fsdp_cpu_parallel_for(pairs, 1, backward ? backward_pairs : forward_pairs, j);
  return fsdp_cpu_work_done(&w);
}

int fsdp_cpu_bf16_attention_forward(uint16_t *out, float *stats, const uint16_t *qkv, int B,
                                    int T, int C, int NH) {
  bf_job j = {.out = out, .keep = stats, .qkv = qkv, .B = B, .T = T, .C = C, .NH = NH,
              .scale = 1.0f / sqrtf((float)(C / NH))};
  return run(&j, false);
}

int fsdp_cpu_bf16_attention_backward(uint16_t *dqkv, const uint16_t *dout, const uint16_t *qkv,
                                     const float *stats, int B, int T, int C, int NH, bool set) {
  bf_job j = {.dqkv = dqkv, .dout = dout, .qkv = qkv, .saved = stats, .B = B, .T = T, .C = C,
              .NH = NH, .set = set, .scale = 1.0f / sqrtf((float)(C / NH))};
  return run(&j, true);
}
