/*
 * attention.cu — causal multi-head self-attention on a fused qkv (B, T, 3C) (llm.c's layout: q,
 * k, v of head h are the columns [h hs, (h+1) hs) of qkv's three C-wide thirds), forward and
 * backward, FlashAttention-2 style: the (T, T) scores and probabilities never exist in memory.
 *
 * The forward saves the row log-sum-exps lse (B, NH, T) f32 (attention_saved), from which the
 * backward recomputes any probability as exp(score - lse). Every kernel works on 64 x 64 tiles
 * (64 query rows against 64 key columns) held in shared memory as f32, with 256 threads in a
 * 16 x 16 grid, each owning a 4 x 4 micro tile: rows 4 ty + i, columns tx + 16 j. The products
 * are plain f32 FMAs for every dtype (bf16 and f16 are converted on load and rounded once on
 * store); a row's 16 threads sit in one half warp, so row maxima and sums are xor shuffles, whose
 * every lane ends with the same bits. Causality: a query tile only visits key tiles up to the
 * diagonal, and only the diagonal tile is masked.
 *
 * Head sizes: the head dimension is padded with zeros to 32, 64 or 128 (one instantiation each),
 * so every hs <= 128 works; larger heads are refused.
 *
 * Backward (three kernels, no atomics, so deterministic whatever fsdp.deterministic says):
 *   1. D_i = rowsum(dO_i * O_i): the forward kernel again (O recomputed by the same online
 *      softmax), with an epilogue that dots O with dO instead of storing it;
 *   2. dQ: one block per query tile loops over its key tiles (dS = P (dP - D), dQ += dS K);
 *   3. dK, dV: one block per key tile loops over the query tiles at or below the diagonal
 *      (dV += P^T dO, dK += dS^T Q).
 * Each block owns the gradient rows it writes, so dqkv += ... is a plain read-add-round.
 */
#include "kernels/cuda/cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#define ATT_TILE 64       /* query rows and key columns per tile */
#define ATT_THREADS 256   /* 16 x 16, each a 4 x 4 micro tile of a 64 x 64 tile */
#define ATT_PLD (ATT_TILE + 1) /* row stride of a (64, 64) tile in shared memory */
#define ATT_MAX_HS 128
#define ATT_MAX_GRID (1 << 20) /* blocks per launch; the kernels grid-stride over their tiles */

namespace {

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename E> __device__ __forceinline__ E from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float x) {
  return __float2half_rn(x);
}

/* max / sum over the 16 threads of a row (lanes that differ in their low 4 bits); the whole
 * warp must call it */
__device__ __forceinline__ float row_max16(float v) {
  for (int off = 8; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ float row_sum16(float v) {
  for (int off = 8; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

/* dst (64, HSP) f32, row stride HSP + 1 (the pad keeps the micro-tile reads free of bank
 * conflicts) <- src rows [0, rows) of hs columns, row stride `stride`; zeros elsewhere */
template <typename E, int HSP>
__device__ __forceinline__ void load_tile(float *dst, const E *src, int64_t stride, int rows,
                                          int hs) {
  for (int e = threadIdx.x; e < ATT_TILE * HSP; e += ATT_THREADS) {
    const int r = e / HSP, d = e % HSP;
    float v = 0.0f;
    if (r < rows && d < hs) v = to_f32(src[(int64_t)r * stride + d]);
    dst[r * (HSP + 1) + d] = v;
  }
}

/* s[i][j] += sum_k A[4 ty + i][k] * Bm[tx + 16 j][k], k < K: a micro tile of A Bm^T */
template <int K, int LDA, int LDB>
__device__ __forceinline__ void mma_abt(float (&s)[4][4], const float *A, const float *Bm, int ty,
                                        int tx) {
#pragma unroll 4
  for (int k = 0; k < K; k++) {
    float a[4], b[4];
#pragma unroll
    for (int i = 0; i < 4; i++) a[i] = A[(4 * ty + i) * LDA + k];
#pragma unroll
    for (int j = 0; j < 4; j++) b[j] = Bm[(tx + 16 * j) * LDB + k];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int j = 0; j < 4; j++) s[i][j] = fmaf(a[i], b[j], s[i][j]);
  }
}

/* o[i][m] += sum_k P[4 ty + i][k] * V[k][tx + 16 m], k < 64: rows of a (64, 64) tile times a
 * (64, HSP) tile */
template <int HSP>
__device__ __forceinline__ void mma_pv(float (&o)[4][HSP / 16], const float *P, const float *V,
                                       int ty, int tx) {
#pragma unroll 4
  for (int k = 0; k < ATT_TILE; k++) {
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; i++) p[i] = P[(4 * ty + i) * ATT_PLD + k];
#pragma unroll
    for (int m = 0; m < HSP / 16; m++) {
      const float v = V[k * (HSP + 1) + tx + 16 * m];
#pragma unroll
      for (int i = 0; i < 4; i++) o[i][m] = fmaf(p[i], v, o[i][m]);
    }
  }
}

/* shared memory (bytes) of each kernel */
constexpr bool fwd_p_in_k(int hsp) { return hsp + 1 >= ATT_PLD; }
constexpr size_t fwd_smem(int hsp) {
  return sizeof(float) * (3 * ATT_TILE * (hsp + 1) + (fwd_p_in_k(hsp) ? 0 : ATT_TILE * ATT_PLD));
}
constexpr size_t dq_smem(int hsp) {
  return sizeof(float) * (4 * ATT_TILE * (hsp + 1) + ATT_TILE * ATT_PLD);
}
constexpr size_t dkv_smem(int hsp) {
  return sizeof(float) * (4 * ATT_TILE * (hsp + 1) + 2 * ATT_TILE * ATT_PLD + 2 * ATT_TILE);
}

/*
 * Forward, one block per (query tile, batch x head), the heaviest tiles (last rows) first:
 * online softmax over the key tiles 0..qb, O in registers. kD false: out (B, T, C) = softmax(q
 * k^T scale) v and rowstat (B, NH, T) = lse. kD true (backward's first pass): rowstat = D =
 * rowsum(dout * O), out unused.
 */
template <typename E, int HSP, bool kD>
__global__ void __launch_bounds__(ATT_THREADS)
    att_forward_kernel(E *out, float *rowstat, const E *qkv, const E *dout, int B, int Tn, int C,
                       int NH, float scale) {
  constexpr int LD = HSP + 1, M = HSP / 16;
  extern __shared__ float att_smem[];
  /* P takes K's place once S is computed where it fits (64 wide heads and up): 99 KiB for
   * 128 wide heads, so two blocks share an SM */
  float *Qs = att_smem, *Ks = Qs + ATT_TILE * LD, *Vs = Ks + ATT_TILE * LD,
        *Ps = fwd_p_in_k(HSP) ? Ks : Vs + ATT_TILE * LD;
  const int hs = C / NH, tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int nT = (Tn + ATT_TILE - 1) / ATT_TILE;
  const int64_t C3 = 3 * (int64_t)C, BH = (int64_t)B * NH, items = BH * nT;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int qb = nT - 1 - (int)(item / BH), q0 = qb * ATT_TILE;
    const int64_t bh = item % BH, b = bh / NH;
    const int h = (int)(bh % NH);
    const E *q = qkv + b * Tn * C3 + (int64_t)h * hs; // (T, hs), row stride 3C
    const E *k = q + C, *v = q + 2 * (int64_t)C;
    __syncthreads(); // the previous item is done with the tiles
    load_tile<E, HSP>(Qs, q + q0 * C3, C3, Tn - q0, hs);
    float m[4], l[4], o[4][M];
#pragma unroll
    for (int i = 0; i < 4; i++) {
      m[i] = -INFINITY, l[i] = 0.0f;
#pragma unroll
      for (int c = 0; c < M; c++) o[i][c] = 0.0f;
    }
    for (int kb = 0; kb <= qb; kb++) {
      const int k0 = kb * ATT_TILE;
      __syncthreads(); // the previous key tile's P V is done
      load_tile<E, HSP>(Ks, k + k0 * C3, C3, Tn - k0, hs);
      load_tile<E, HSP>(Vs, v + k0 * C3, C3, Tn - k0, hs);
      __syncthreads();
      float s[4][4] = {};
      mma_abt<HSP, LD, LD>(s, Qs, Ks, ty, tx);
      __syncthreads(); // K is read: P may overwrite it
#pragma unroll
      for (int i = 0; i < 4; i++) {
        /* the diagonal tile masks keys after the query; every row keeps key 0 of the tile,
         * so the running max is finite from the first tile on */
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          float x = s[i][j] * scale;
          if (kb == qb && tx + 16 * j > 4 * ty + i) x = -INFINITY;
          s[i][j] = x;
          mx = fmaxf(mx, x);
        }
        mx = row_max16(mx);
        const float mn = fmaxf(m[i], mx), alpha = expf(m[i] - mn);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const float p = expf(s[i][j] - mn);
          Ps[(4 * ty + i) * ATT_PLD + tx + 16 * j] = p;
          sum += p;
        }
        sum = row_sum16(sum);
        l[i] = l[i] * alpha + sum;
        m[i] = mn;
#pragma unroll
        for (int c = 0; c < M; c++) o[i][c] *= alpha;
      }
      __syncthreads();
      mma_pv<HSP>(o, Ps, Vs, ty, tx);
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int t = q0 + 4 * ty + i;
      const float inv = 1.0f / l[i];
      if constexpr (kD) {
        float dot = 0.0f;
        if (t < Tn) {
          const E *g = dout + (b * Tn + t) * C + (int64_t)h * hs;
#pragma unroll
          for (int c = 0; c < M; c++)
            if (tx + 16 * c < hs) dot += o[i][c] * inv * to_f32(g[tx + 16 * c]);
        }
        dot = row_sum16(dot);
        if (t < Tn && tx == 0) rowstat[bh * Tn + t] = dot;
      } else if (t < Tn) {
        E *y = out + (b * Tn + t) * C + (int64_t)h * hs;
#pragma unroll
        for (int c = 0; c < M; c++)
          if (tx + 16 * c < hs) y[tx + 16 * c] = from_f32<E>(o[i][c] * inv);
        if (tx == 0 && rowstat) rowstat[bh * Tn + t] = m[i] + logf(l[i]);
      }
    }
  }
}

/*
 * Backward, dQ: one block per (query tile, batch x head), looping over the key tiles 0..qb:
 * P = exp(S - lse), dP = dO V^T, dS = P (dP - D), dQ += dS K; then dq += scale dQ.
 */
template <typename E, int HSP>
__global__ void __launch_bounds__(ATT_THREADS, 1)
    att_backward_dq_kernel(E *dqkv, const E *dout, const E *qkv, const float *lse,
                           const float *D, int B, int Tn, int C, int NH, float scale) {
  constexpr int LD = HSP + 1, M = HSP / 16;
  extern __shared__ float att_smem[];
  float *Qs = att_smem, *Gs = Qs + ATT_TILE * LD, *Ks = Gs + ATT_TILE * LD,
        *Vs = Ks + ATT_TILE * LD, *Ss = Vs + ATT_TILE * LD;
  const int hs = C / NH, tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int nT = (Tn + ATT_TILE - 1) / ATT_TILE;
  const int64_t C3 = 3 * (int64_t)C, BH = (int64_t)B * NH, items = BH * nT;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int qb = nT - 1 - (int)(item / BH), q0 = qb * ATT_TILE;
    const int64_t bh = item % BH, b = bh / NH;
    const int h = (int)(bh % NH);
    const E *q = qkv + b * Tn * C3 + (int64_t)h * hs; // (T, hs), row stride 3C
    const E *k = q + C, *v = q + 2 * (int64_t)C;
    const E *g = dout + b * Tn * C + (int64_t)h * hs; // (T, hs), row stride C
    __syncthreads();
    load_tile<E, HSP>(Qs, q + q0 * C3, C3, Tn - q0, hs);
    load_tile<E, HSP>(Gs, g + q0 * (int64_t)C, C, Tn - q0, hs);
    float lr[4], dr[4], acc[4][M];
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int t = q0 + 4 * ty + i;
      lr[i] = t < Tn ? lse[bh * Tn + t] : 0.0f;
      dr[i] = t < Tn ? D[bh * Tn + t] : 0.0f;
#pragma unroll
      for (int c = 0; c < M; c++) acc[i][c] = 0.0f;
    }
    for (int kb = 0; kb <= qb; kb++) {
      const int k0 = kb * ATT_TILE;
      __syncthreads(); // the previous key tile's dS K is done
      load_tile<E, HSP>(Ks, k + k0 * C3, C3, Tn - k0, hs);
      load_tile<E, HSP>(Vs, v + k0 * C3, C3, Tn - k0, hs);
      __syncthreads();
      float s[4][4] = {}, dp[4][4] = {};
      mma_abt<HSP, LD, LD>(s, Qs, Ks, ty, tx);
      mma_abt<HSP, LD, LD>(dp, Gs, Vs, ty, tx);
#pragma unroll
      for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const int r = 4 * ty + i, c = tx + 16 * j;
          const bool live = q0 + r < Tn && (kb < qb || c <= r);
          const float p = live ? expf(s[i][j] * scale - lr[i]) : 0.0f;
          Ss[r * ATT_PLD + c] = live ? p * (dp[i][j] - dr[i]) : 0.0f;
        }
      __syncthreads();
      mma_pv<HSP>(acc, Ss, Ks, ty, tx);
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int t = q0 + 4 * ty + i;
      if (t >= Tn) continue;
      E *dq = dqkv + (b * Tn + t) * C3 + (int64_t)h * hs;
#pragma unroll
      for (int c = 0; c < M; c++) {
        const int d = tx + 16 * c;
        if (d < hs) dq[d] = from_f32<E>(to_f32(dq[d]) + scale * acc[i][c]);
      }
    }
  }
}

/*
 * Backward, dK and dV: one block per (key tile, batch x head), the heaviest (first) tiles first,
 * looping over the query tiles kb..: P^T = exp(S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - D),
 * dV += P^T dO, dK += dS^T Q; then dk += scale dK, dv += dV.
 */
template <typename E, int HSP>
__global__ void __launch_bounds__(ATT_THREADS, 1)
    att_backward_dkv_kernel(E *dqkv, const E *dout, const E *qkv, const float *lse,
                            const float *D, int B, int Tn, int C, int NH, float scale) {
  constexpr int LD = HSP + 1, M = HSP / 16;
  extern __shared__ float att_smem[];
  float *Ks = att_smem, *Vs = Ks + ATT_TILE * LD, *Qs = Vs + ATT_TILE * LD,
        *Gs = Qs + ATT_TILE * LD, *Ps = Gs + ATT_TILE * LD, *Ss = Ps + ATT_TILE * ATT_PLD,
        *Ls = Ss + ATT_TILE * ATT_PLD, *Ds = Ls + ATT_TILE;
  const int hs = C / NH, tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int nT = (Tn + ATT_TILE - 1) / ATT_TILE;
  const int64_t C3 = 3 * (int64_t)C, BH = (int64_t)B * NH, items = BH * nT;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int kb = (int)(item / BH), k0 = kb * ATT_TILE;
    const int64_t bh = item % BH, b = bh / NH;
    const int h = (int)(bh % NH);
    const E *q = qkv + b * Tn * C3 + (int64_t)h * hs; // (T, hs), row stride 3C
    const E *k = q + C, *v = q + 2 * (int64_t)C;
    const E *g = dout + b * Tn * C + (int64_t)h * hs; // (T, hs), row stride C
    __syncthreads();
    load_tile<E, HSP>(Ks, k + k0 * C3, C3, Tn - k0, hs);
    load_tile<E, HSP>(Vs, v + k0 * C3, C3, Tn - k0, hs);
    float dk[4][M], dv[4][M];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int c = 0; c < M; c++) dk[i][c] = 0.0f, dv[i][c] = 0.0f;
    for (int qb = kb; qb < nT; qb++) {
      const int q0 = qb * ATT_TILE;
      __syncthreads(); // the previous query tile's products are done
      load_tile<E, HSP>(Qs, q + q0 * C3, C3, Tn - q0, hs);
      load_tile<E, HSP>(Gs, g + q0 * (int64_t)C, C, Tn - q0, hs);
      if (threadIdx.x < ATT_TILE) {
        const int t = q0 + threadIdx.x;
        Ls[threadIdx.x] = t < Tn ? lse[bh * Tn + t] : 0.0f;
        Ds[threadIdx.x] = t < Tn ? D[bh * Tn + t] : 0.0f;
      }
      __syncthreads();
      /* rows: keys 4 ty + i; columns: queries tx + 16 j */
      float st[4][4] = {}, dpt[4][4] = {};
      mma_abt<HSP, LD, LD>(st, Ks, Qs, ty, tx);
      mma_abt<HSP, LD, LD>(dpt, Vs, Gs, ty, tx);
#pragma unroll
      for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const int c = 4 * ty + i, r = tx + 16 * j;
          /* queries past T and (on the diagonal tile) before the key do not see it; keys
           * past T are never seen by a query before T */
          const bool live = q0 + r < Tn && (qb > kb || r >= c);
          const float p = live ? expf(st[i][j] * scale - Ls[r]) : 0.0f;
          Ps[c * ATT_PLD + r] = p;
          Ss[c * ATT_PLD + r] = live ? p * (dpt[i][j] - Ds[r]) : 0.0f;
        }
      __syncthreads();
      mma_pv<HSP>(dv, Ps, Gs, ty, tx);
      mma_pv<HSP>(dk, Ss, Qs, ty, tx);
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int t = k0 + 4 * ty + i;
      if (t >= Tn) continue;
      E *dkr = dqkv + (b * Tn + t) * C3 + C + (int64_t)h * hs, *dvr = dkr + C;
#pragma unroll
      for (int c = 0; c < M; c++) {
        const int d = tx + 16 * c;
        if (d >= hs) continue;
        dkr[d] = from_f32<E>(to_f32(dkr[d]) + scale * dk[i][c]);
        dvr[d] = from_f32<E>(to_f32(dvr[d]) + dv[i][c]);
      }
    }
  }
}

/* Launch kernel over `items` tiles on the thread's stream, with `smem` bytes of dynamic shared
 * memory (opting in past the default 48 KiB, which the 128-wide heads need). */
template <typename... P, typename... A>
int att_launch(void (*kernel)(P...), size_t smem, int64_t items, const char *what, A... args) {
  if (smem > 48 * 1024) {
    int optin = 0;
    if (fsdp_cuda_check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                               fsdp_cuda_device()),
                        what))
      return FSDP_ERR;
    if ((size_t)optin < smem)
      return fsdp_error("%s: needs %zu bytes of shared memory per block, the GPU allows %d",
                        what, smem, optin);
    if (fsdp_cuda_check(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
            what))
      return FSDP_ERR;
  }
  const unsigned grid = (unsigned)(items < ATT_MAX_GRID ? items : ATT_MAX_GRID);
  kernel<<<grid, ATT_THREADS, smem, fsdp_cuda_stream()>>>(args...);
  return fsdp_cuda_launched(what);
}

template <typename E, int HSP>
int att_forward(void *out, float *lse, const void *qkv, int B, int T, int C, int NH) {
  const float scale = 1.0f / sqrtf((float)(C / NH));
  const int64_t items = (int64_t)B * NH * ((T + ATT_TILE - 1) / ATT_TILE);
  return att_launch(att_forward_kernel<E, HSP, false>, fwd_smem(HSP), items, "attention_forward",
                    (E *)out, lse, (const E *)qkv, (const E *)nullptr, B, T, C, NH, scale);
}

template <typename E, int HSP>
int att_backward(void *dqkv, const void *dout, const void *qkv, const float *lse, int B, int T,
                 int C, int NH) {
  const float scale = 1.0f / sqrtf((float)(C / NH));
  const int64_t tiles = (int64_t)B * NH * ((T + ATT_TILE - 1) / ATT_TILE);
  const size_t bytes = sizeof(float) * (size_t)B * NH * T;
  float *D; // (B, NH, T): rowsum(dout * out)
  if (fsdp_cuda_scratch((void **)&D, bytes)) return FSDP_ERR;
  int rc = att_launch(att_forward_kernel<E, HSP, true>, fwd_smem(HSP), tiles,
                      "attention_backward (D)", (E *)nullptr, D, (const E *)qkv,
                      (const E *)dout, B, T, C, NH, scale);
  if (rc == FSDP_OK)
    rc = att_launch(att_backward_dq_kernel<E, HSP>, dq_smem(HSP), tiles,
                    "attention_backward (dq)", (E *)dqkv, (const E *)dout, (const E *)qkv, lse,
                    (const float *)D, B, T, C, NH, scale);
  if (rc == FSDP_OK)
    rc = att_launch(att_backward_dkv_kernel<E, HSP>, dkv_smem(HSP), tiles,
                    "attention_backward (dk, dv)", (E *)dqkv, (const E *)dout, (const E *)qkv,
                    lse, (const float *)D, B, T, C, NH, scale);
  fsdp_cuda_scratch_free(D, bytes); // stream order keeps D alive for the kernels queued above
  return rc;
}

/* FSDP_OK when the cuda kernels take this shape; the head size picks the padded width */
int att_head_width(int C, int NH, int *hsp) {
  const int hs = C / NH;
  if (hs > ATT_MAX_HS)
    return fsdp_error("attention: head size %d is not supported on cuda (at most %d)", hs,
                      ATT_MAX_HS);
  *hsp = hs <= 32 ? 32 : hs <= 64 ? 64 : 128;
  return FSDP_OK;
}

template <typename E>
int att_forward_dt(void *out, float *lse, const void *qkv, int B, int T, int C, int NH, int hsp) {
  switch (hsp) {
  case 32: return att_forward<E, 32>(out, lse, qkv, B, T, C, NH);
  case 64: return att_forward<E, 64>(out, lse, qkv, B, T, C, NH);
  default: return att_forward<E, 128>(out, lse, qkv, B, T, C, NH);
  }
}

template <typename E>
int att_backward_dt(void *dqkv, const void *dout, const void *qkv, const float *lse, int B, int T,
                    int C, int NH, int hsp) {
  switch (hsp) {
  case 32: return att_backward<E, 32>(dqkv, dout, qkv, lse, B, T, C, NH);
  case 64: return att_backward<E, 64>(dqkv, dout, qkv, lse, B, T, C, NH);
  default: return att_backward<E, 128>(dqkv, dout, qkv, lse, B, T, C, NH);
  }
}

} // namespace

/* the row log-sum-exps of the scaled, masked scores: (B, NH, T) f32 */
int64_t fsdp_cuda_attention_saved(void *ctx, fsdp_dtype dt, int B, int T, int C, int NH,
                                  fsdp_dtype *saved_dt) {
  (void)ctx, (void)dt, (void)C;
  *saved_dt = FSDP_DTYPE_F32;
  return (int64_t)B * NH * T;
}

int fsdp_cuda_attention_forward(void *ctx, fsdp_dtype dt, void *out, void *att, const void *qkv,
                                int B, int T, int C, int NH) {
  // out (B, T, C), att = lse (B, NH, T) f32, qkv (B, T, 3C)
  (void)ctx;
  int hsp = 0;
  if (dt != FSDP_DTYPE_F32 && dt != FSDP_DTYPE_BF16 && dt != FSDP_DTYPE_F16)
    return fsdp_kernels_refuse("attention", dt, "cuda");
  if (att_head_width(C, NH, &hsp)) return FSDP_ERR;
  if ((int64_t)B * NH * T == 0) return FSDP_OK;
  float *lse = (float *)att;
  switch (dt) {
  case FSDP_DTYPE_BF16: return att_forward_dt<__nv_bfloat16>(out, lse, qkv, B, T, C, NH, hsp);
  case FSDP_DTYPE_F16: return att_forward_dt<__half>(out, lse, qkv, B, T, C, NH, hsp);
  default: return att_forward_dt<float>(out, lse, qkv, B, T, C, NH, hsp);
  }
}

int fsdp_cuda_attention_backward(void *ctx, fsdp_dtype dt, void *dqkv, const void *dout,
                                 const void *qkv, const void *att, int B, int T, int C, int NH,
                                 bool set_dqkv) {
  // dqkv (B, T, 3C) += (set_dqkv: =), dout (B, T, C), qkv (B, T, 3C), att = lse (B, NH, T) f32
  (void)ctx;
  int hsp = 0;
  if (dt != FSDP_DTYPE_F32 && dt != FSDP_DTYPE_BF16 && dt != FSDP_DTYPE_F16)
    return fsdp_kernels_refuse("attention", dt, "cuda");
  if (att_head_width(C, NH, &hsp)) return FSDP_ERR;
  if (!dqkv || (int64_t)B * NH * T == 0) return FSDP_OK;
  /* the kernels add: a buffer that was never filled starts from zeros */
  if (set_dqkv &&
      fsdp_cuda_check(cudaMemsetAsync(dqkv, 0, (size_t)B * T * 3 * C * fsdp_dtype_size(dt),
                                      fsdp_cuda_stream()),
                      "attention_backward"))
    return FSDP_ERR;
  const float *lse = (const float *)att;
  switch (dt) {
  case FSDP_DTYPE_BF16:
    return att_backward_dt<__nv_bfloat16>(dqkv, dout, qkv, lse, B, T, C, NH, hsp);
  case FSDP_DTYPE_F16: return att_backward_dt<__half>(dqkv, dout, qkv, lse, B, T, C, NH, hsp);
  default: return att_backward_dt<float>(dqkv, dout, qkv, lse, B, T, C, NH, hsp);
  }
}
