/*
 * attention_bf16.c — causal self-attention on bf16 operands with the processor's bf16 dot
 * products (AVX512_BF16 through oneDNN matmuls, gemm.h), for the mixed-precision step. The other
 * way (half.c) widens a batch row to f32, runs the f32 kernel (attention.c) and narrows the
 * results: its products run at the f32 rate and the widening is a pass of its own.
 *
 * The same tiling as attention.c (query rows in tiles of ATT_BLOCK, each against the prefix of
 * keys it sees), with every head of a batch row in one batched matmul: q, k and v of head h are
 * column blocks of the row's (T, 3C) qkv, so head h's operands sit hs elements after head h-1's
 * and one strided product covers them all (6 heads: 6 times fewer calls than one per head).
 *
 * Forward, per query tile: scores (f32) = q k^T / sqrt(hs); the causal softmax rows (the f32
 * kernel's arithmetic, isa.h) storing att (bf16), the probabilities rounded once; out (bf16) =
 * att v. Nothing is kept for the backward: per query tile it recomputes the scores with the
 * same product, the same softmax rows and the same rounding (the forward's bf16 probabilities,
 * bit for bit), then datt (f32) = dout v^T, the softmax backward reading att and storing
 * dscores rounded to bf16 into a scratch, dq = dscores k / sqrt(hs); then per key tile, over
 * every query row that sees it: dv = att^T dout, dk = dscores^T q / sqrt(hs). Every output
 * element is written by one product (no bf16 running sums; added into dqkv with one rounding
 * when the backward accumulates).
 *
 * Against the widening way the products' sums run in another order and two operands are bf16
 * where that way keeps f32: the probabilities in att v and dscores in dq and dk. The results
 * differ by about bf16's precision (tests/c/test_half.c bounds them); each is computed by one
 * thread with one oneDNN thread and the tiles depend on T alone, so a batch row's results are
 * the same bits at any thread count and however the rows are split over ranks.
 *
 * Batch rows are shared out over the rank's threads, each task with its own scratch: the
 * scores (NH, T, T) f32 and att (bf16), for the backward also dscores (bf16). The path is
 * taken for every bf16 call it can serve, whatever the batch size and thread count, so that a
 * model's results do not depend on how its batch is split.
 */
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/half.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/pool.h"

#define ATT_BLOCK FSDP_CPU_ATT_BLOCK

typedef struct {
  uint16_t *out, *dqkv;
  const uint16_t *qkv, *dout;
  int B, T, C, NH, nchunks;
  float scale;
  bool set;           /* backward: dqkv written (else added: each product's sum post-op) */
  char *scratch;      /* per chunk: slot bytes */
  size_t slot, mm_bytes; /* slot: scores, att (+ dscores), oneDNN's scratch */
  atomic_int failed;  /* a product failed in a task (oneDNN): the caller takes the other way */
} bf_job;

/* The batched product over the heads; a, b and c are head 0's operands. A bf16 result of the
 * backward is added to dqkv's contents unless set (oneDNN's sum post-op: one rounding). */
static fsdp_cpu_mm_shape shape(const bf_job *j, fsdp_dtype cdt, int M, int N, int K, bool ta,
                               bool tb, int lda, int ldb, int ldc, int64_t bsa, int64_t bsb,
                               int64_t bsc, float alpha) {
  const bool add = j->dqkv && !j->set && cdt == FSDP_DTYPE_BF16;
  fsdp_cpu_mm_shape s = {.abdt = FSDP_DTYPE_BF16, .cdt = cdt, .bdt = FSDP_DTYPE_COUNT, .M = M,
                         .N = N, .K = K, .trans_a = ta, .trans_b = tb, .lda = lda, .ldb = ldb,
                         .ldc = ldc, .alpha = alpha, .beta = add ? 1.0f : 0.0f, .batch = j->NH,
                         .bsa = bsa, .bsb = bsb, .bsc = bsc};
  return s;
}

/* Plan and run one product on this thread; false (and j->failed) when oneDNN fails. */
static bool mm(bf_job *j, const fsdp_cpu_mm_shape *s, void *c, const void *a, const void *b,
               void *scratch) {
  fsdp_cpu_mm *p;
  size_t bytes;
  if (fsdp_cpu_mm_plan(&p, &bytes, s) != FSDP_OK || bytes > j->mm_bytes ||
      fsdp_cpu_mm_run(p, c, a, b, NULL, scratch) != FSDP_OK) {
    atomic_store(&j->failed, 1);
    return false;
  }
  return true;
}

/* The products of tile r0 into out, their count. Forward: the scores of query rows [r0, r1)
 * against keys [0, r1), then their probabilities times v. Backward: datt of those rows, dq from
 * their dscores, then for the key tile [r0, r1) (seen by the T - r0 query rows from r0 on) dv
 * and dk; and (out[4]) the forward's scores product again. */
static int tile_shapes(const bf_job *j, bool backward, int r0, fsdp_cpu_mm_shape *out) {
  const int T = j->T, C = j->C, C3 = 3 * C, hs = C / j->NH;
  const int64_t TT = (int64_t)T * T;
  const int rows = fsdp_cpu_att_rows(T, r0), cols = r0 + rows;
  const fsdp_dtype F32 = FSDP_DTYPE_F32, BF16 = FSDP_DTYPE_BF16;
  if (!backward) {
    out[0] = shape(j, F32, rows, cols, hs, false, true, C3, C3, T, hs, hs, TT, j->scale);
    out[1] = shape(j, BF16, rows, hs, cols, false, false, T, C3, C, TT, hs, hs, 1.0f);
    return 2;
  }
  out[0] = shape(j, F32, rows, cols, hs, false, true, C, C3, T, hs, hs, TT, 1.0f);
  out[1] = shape(j, BF16, rows, hs, cols, false, false, T, C3, C3, TT, hs, hs, j->scale);
  out[2] = shape(j, BF16, rows, hs, T - r0, true, false, T, C, C3, TT, hs, hs, 1.0f);
  out[3] = shape(j, BF16, rows, hs, T - r0, true, false, T, C3, C3, TT, hs, hs, j->scale);
  out[4] = shape(j, F32, rows, cols, hs, false, true, C3, C3, T, hs, hs, TT, j->scale);
  return 5;
}

/* The bf16 probabilities of query rows [r0, r0 + rows) of every head into att (NH, T, T), from
 * the f32 scores in S (NH, T, T) they leave softmaxed: the forward's, and the backward's
 * recomputation of them (the same product before, the same bits). */
static void probs_rows(uint16_t *att, float *S, int T, int NH, int r0, int rows) {
  const int64_t TT = (int64_t)T * T;
  const fsdp_cpu_vec_i *vec = fsdp_cpu_vec();
  for (int h = 0; h < NH; h++) vec->att_softmax_rows_bf16(att + h * TT, S + h * TT, T, r0, rows);
}

static char *slot_of(const bf_job *j, int64_t lo) {
  return j->scratch + (size_t)fsdp_cpu_chunk_at(j->B, 1, j->nchunks, lo) * j->slot;
}

static void forward_rows(void *ctx, int64_t lo, int64_t hi) {
  bf_job *j = ctx;
  const int T = j->T, C = j->C, C3 = 3 * C, NH = j->NH;
  const int64_t TT = (int64_t)T * T;
  char *slot = slot_of(j, lo);
  float *S = (float *)slot;
  uint16_t *att = (uint16_t *)(S + NH * TT);
  void *mms = slot + j->slot - j->mm_bytes;
  for (int64_t b = lo; b < hi && !atomic_load(&j->failed); b++) {
    const uint16_t *q = j->qkv + b * T * C3, *k = q + C, *v = q + 2 * C;
    uint16_t *out = j->out + b * T * C;
    for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) {
      const int rows = fsdp_cpu_att_rows(T, r0);
      fsdp_cpu_mm_shape s[2];
      tile_shapes(j, false, r0, s);
      if (!mm(j, &s[0], S + (int64_t)r0 * T, q + (int64_t)r0 * C3, k, mms)) return;
      probs_rows(att, S, T, NH, r0, rows);
      if (!mm(j, &s[1], out + (int64_t)r0 * C, att + (int64_t)r0 * T, v, mms)) return;
    }
  }
}

static void backward_rows(void *ctx, int64_t lo, int64_t hi) {
  bf_job *j = ctx;
  const int T = j->T, C = j->C, C3 = 3 * C, NH = j->NH;
  const int64_t TT = (int64_t)T * T;
  char *slot = slot_of(j, lo);
  float *S = (float *)slot;
  uint16_t *D = (uint16_t *)(S + NH * TT), *att = D + NH * TT;
  void *mms = slot + j->slot - j->mm_bytes;
  const fsdp_cpu_vec_i *vec = fsdp_cpu_vec();
  for (int64_t b = lo; b < hi && !atomic_load(&j->failed); b++) {
    const uint16_t *q = j->qkv + b * T * C3, *k = q + C, *v = q + 2 * C;
    const uint16_t *g = j->dout + b * T * C;
    uint16_t *dq = j->dqkv + b * T * C3, *dk = dq + C, *dv = dq + 2 * C;
    for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) { /* query tiles: att, datt, dscores, dq */
      const int rows = fsdp_cpu_att_rows(T, r0), cols = r0 + rows;
      fsdp_cpu_mm_shape s[5];
      tile_shapes(j, true, r0, s);
      /* the forward's probabilities again: scores into S, softmaxed and rounded into att */
      if (!mm(j, &s[4], S + (int64_t)r0 * T, q + (int64_t)r0 * C3, k, mms)) return;
      probs_rows(att, S, T, NH, r0, rows);
      if (!mm(j, &s[0], S + (int64_t)r0 * T, g + (int64_t)r0 * C, v, mms)) return;
      for (int h = 0; h < NH; h++)
        vec->att_softmax_backward_rows_bf16(D + h * TT, S + h * TT, att + h * TT, T, r0, rows,
                                            cols);
      if (!mm(j, &s[1], dq + (int64_t)r0 * C3, D + (int64_t)r0 * T, k, mms)) return;
    }
    for (int c0 = 0; c0 < T; c0 += ATT_BLOCK) { /* key tiles: dv, dk over rows c0.. */
      const int64_t corner = (int64_t)c0 * T + c0;
      fsdp_cpu_mm_shape s[5];
      tile_shapes(j, true, c0, s);
      if (!mm(j, &s[2], dv + (int64_t)c0 * C3, att + corner, g + (int64_t)c0 * C, mms)) return;
      if (!mm(j, &s[3], dk + (int64_t)c0 * C3, D + corner, q + (int64_t)c0 * C3, mms)) return;
    }
  }
}

/* Each tile height is its own product shape, a primitive in every thread's plan cache
 * (onednn.c): up to ATT_NATIVE_TILES tiles (6 shapes a tile, forward and backward) the
 * attention's plans and a model's GEMMs stay in it; longer sequences take the other way. */
#define ATT_NATIVE_TILES 8

/* Not the batch size or the thread count: the same rows give the same bits however a batch is
 * split over ranks, micro-batches and threads (a call with fewer rows than threads leaves some
 * threads idle). */
bool fsdp_cpu_bf16_attention_native(int B, int T, int C, int NH) {
  return fsdp_cpu_bf16_gemm_native() && B >= 1 && NH >= 1 && C % NH == 0 && T >= 1 &&
         T <= ATT_NATIVE_TILES * ATT_BLOCK;
}

/* Plan every shape on the calling thread (oneDNN's refusal shows here, before any output is
 * written), size the slots, run the rows. FSDP_CPU_OTHER_WAY when oneDNN refused, or failed
 * while every output is still to be rewritten; a failure after part of an accumulating backward
 * has been added into dqkv is an error (the other way would add it twice). */
static int run(bf_job *j, bool backward) {
  const int64_t TT = (int64_t)j->T * j->T;
  size_t most = 0;
  for (int r0 = 0; r0 < j->T; r0 += ATT_BLOCK) {
    fsdp_cpu_mm_shape shapes[5];
    const int ns = tile_shapes(j, backward, r0, shapes);
    for (int i = 0; i < ns; i++) {
      fsdp_cpu_mm *p;
      size_t bytes;
      if (fsdp_cpu_mm_plan(&p, &bytes, &shapes[i]) != FSDP_OK) return FSDP_CPU_OTHER_WAY;
      if (bytes > most) most = bytes;
    }
  }
  j->mm_bytes = (most + 63) / 64 * 64;
  /* scores and att; the backward also dscores */
  size_t work =
      (size_t)j->NH * (size_t)TT * (backward ? sizeof(float) + 4 : sizeof(float) + 2);
  j->slot = (work + 63) / 64 * 64 + j->mm_bytes;
  j->nchunks = fsdp_cpu_chunks(j->B, 1);
  fsdp_cpu_work w = {0};
  j->scratch = fsdp_cpu_work_buf(&w, (int64_t)(j->slot * (size_t)j->nchunks), 1);
  if (!w.failed)
    fsdp_cpu_parallel_for(j->B, 1, backward ? backward_rows : forward_rows, j);
  int rc = fsdp_cpu_work_done(&w);
  if (rc != FSDP_OK) return rc;
  if (!atomic_load(&j->failed)) return FSDP_OK;
  if (backward && !j->set)
    return fsdp_error("attention backward (bf16): a oneDNN product failed after part of the "
                      "gradient was added into dqkv");
  return FSDP_CPU_OTHER_WAY;
}

int fsdp_cpu_bf16_attention_forward(uint16_t *out, const uint16_t *qkv, int B, int T, int C,
                                    int NH) {
  bf_job j = {.out = out, .qkv = qkv, .B = B, .T = T, .C = C, .NH = NH,
              .scale = 1.0f / sqrtf((float)(C / NH))};
  return run(&j, false);
}

int fsdp_cpu_bf16_attention_backward(uint16_t *dqkv, const uint16_t *dout, const uint16_t *qkv,
                                     int B, int T, int C, int NH, bool set) {
  bf_job j = {.dqkv = dqkv, .dout = dout, .qkv = qkv, .B = B, .T = T, .C = C, .NH = NH,
              .set = set, .scale = 1.0f / sqrtf((float)(C / NH))};
  return run(&j, true);
}
