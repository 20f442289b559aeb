/*
 * mask.cu — masks and magnitude pruning on the cuda device (the mask slots of kernels.h,
 * docs/pruning.md): f32 only, as the cpu, with the cpu's keys, values and tie rules
 * (src/kernels/cpu/mask.c, exact.h), so the masks are the same bits on both devices.
 *
 * Counts (zeros, pruned) are integer sums by reduce_dim (no atomics). Histograms count with
 * integer atomics, in shared memory per block when the bins fit, else in global memory: integer
 * counts are exact in any order, so they repeat bit for bit in every mode. mask_check's FNV-1a
 * hash runs over the zero positions in order, which no parallel split preserves: the GPU packs
 * the zero positions into a bitmap (one bit per element) and the host hashes that, chunk by
 * chunk, at a 32nd of the bytes of the mask.
 */
#include <stdlib.h>

#include "kernels/cuda/common.cuh"

using namespace fsdp_cu;

#define MASK_F32(op, dt) \
  if ((dt) != FSDP_DTYPE_F32) return FSDP_CU_REFUSE(op, dt)

/* ---- counting -------------------------------------------------------------------------------- */

struct is_zero {
  const float *x;
  __device__ uint64_t operator()(int64_t, int64_t r, int64_t) const { return x[r] == 0.0f; }
};

struct is_bad_mask { /* neither 0 nor 1 */
  const float *m;
  __device__ uint64_t operator()(int64_t, int64_t r, int64_t) const {
    return m[r] != 0.0f && m[r] != 1.0f;
  }
};

struct store_count {
  uint64_t *out;
  __device__ void operator()(int64_t, int64_t, uint64_t s) const { *out = s; }
};

/* *host = the number of elements of [0, n) where term is 1 */
template <typename Term> static int count(int64_t n, Term term, int64_t *host, const char *what) {
  uint64_t *d, v = 0;
  if (fsdp_cuda_scratch((void **)&d, sizeof *d)) return FSDP_ERR;
  int rc = reduce_dim<uint64_t>(1, n, 1, term, store_count{d}, what);
  if (!rc) rc = to_host_now(&v, d, sizeof v, what);
  fsdp_cuda_scratch_free(d, sizeof *d);
  *host = (int64_t)v;
  return rc;
}

/* ---- apply, zeros, check ------------------------------------------------------------------------ */

__global__ void mask_apply_k(float *x, const float *m, int64_t n) {
  FSDP_CU_LOOP(i, n) if (m[i] == 0.0f) x[i] = 0.0f; /* +0; other elements keep their bits */
}

int fsdp_cuda_mask_apply(void *ctx, fsdp_dtype dt, void *x, const void *m, int64_t n) {
  MASK_F32("mask_apply", dt);
  if (n <= 0) return FSDP_OK;
  mask_apply_k<<<blocks_for(n), THREADS, 0, fsdp_cuda_stream()>>>((float *)x, (const float *)m,
                                                                   n);
  return fsdp_cuda_launched("mask_apply");
}

int fsdp_cuda_count_zeros(void *ctx, fsdp_dtype dt, int64_t *zeros, const void *x, int64_t n) {
  MASK_F32("count_zeros", dt);
  return count(n, is_zero{(const float *)x}, zeros, "count_zeros");
}

/* bit b of word w: m[32 w + b] == 0 (a warp's ballot over 32 consecutive elements) */
__global__ void zero_bits_k(uint32_t *words, const float *m, int64_t n) {
  const int64_t lane = threadIdx.x & 31;
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  for (int64_t w = warp; w * 32 < n; w += warps) { /* uniform across the warp */
    const int64_t i = w * 32 + lane;
    const unsigned bits = __ballot_sync(0xffffffffu, i < n && m[i] == 0.0f);
    if (lane == 0) words[w] = bits;
  }
}

#define CHECK_CHUNK ((int64_t)1 << 27) /* elements a bitmap chunk covers: 16 MiB of words */

int fsdp_cuda_mask_check(void *ctx, fsdp_dtype dt, int64_t *bad, int64_t *zeros, uint32_t *hash,
                         const void *m, int64_t n) {
  MASK_F32("mask_check", dt);
  const float *mm = (const float *)m;
  *bad = 0, *zeros = 0, *hash = 2166136261u;
  if (n <= 0) return FSDP_OK;
  if (count(n, is_bad_mask{mm}, bad, "mask_check")) return FSDP_ERR;
  const int64_t chunk = n < CHECK_CHUNK ? n : CHECK_CHUNK, cw = (chunk + 31) / 32;
  const size_t wbytes = (size_t)cw * 4;
  uint32_t *dwords, *hwords = (uint32_t *)malloc(wbytes);
  if (!hwords) return fsdp_error("mask_check: out of host memory for %zu bytes", wbytes);
  if (fsdp_cuda_scratch((void **)&dwords, wbytes)) {
    free(hwords);
    return FSDP_ERR;
  }
  int rc = FSDP_OK;
  uint32_t h = 2166136261u;
  int64_t z = 0;
  for (int64_t off = 0; !rc && off < n; off += chunk) {
    const int64_t len = n - off < chunk ? n - off : chunk, nw = (len + 31) / 32;
    zero_bits_k<<<blocks_for(len), THREADS, 0, fsdp_cuda_stream()>>>(dwords, mm + off, len);
    rc = fsdp_cuda_launched("mask_check");
    if (!rc) rc = fsdp_device_cuda.to_host(ctx, hwords, dwords, (size_t)nw * 4);
    for (int64_t w = 0; !rc && w < nw; w++) /* the zeros in order, as the cpu hashes them */
      for (uint32_t bits = hwords[w]; bits; bits &= bits - 1) {
        h = fsdp_x_fnv_u32(h, (uint32_t)(off + w * 32 + __builtin_ctz(bits)));
        z++;
      }
  }
  fsdp_cuda_scratch_free(dwords, wbytes);
  free(hwords);
  if (!rc) *zeros = z, *hash = h;
  return rc;
}

__global__ void from_nonzero_k(float *mout, const float *x, int64_t n) {
  FSDP_CU_LOOP(i, n) mout[i] = x[i] != 0.0f ? 1.0f : 0.0f;
}

int fsdp_cuda_mask_from_nonzero(void *ctx, fsdp_dtype dt, void *mout, int64_t *zeros,
                                const void *x, int64_t n) {
  MASK_F32("mask_from_nonzero", dt);
  *zeros = 0;
  if (n <= 0) return FSDP_OK;
  /* the count first: mout may be x itself */
  if (count(n, is_zero{(const float *)x}, zeros, "mask_from_nonzero")) return FSDP_ERR;
  from_nonzero_k<<<blocks_for(n), THREADS, 0, fsdp_cuda_stream()>>>((float *)mout,
                                                                     (const float *)x, n);
  return fsdp_cuda_launched("mask_from_nonzero");
}

/* ---- histograms ----------------------------------------------------------------------------------- */

#define SHARED_BINS 4096 /* bins a block counts in shared memory (16 KiB) */

/* the bin of element i, or -1 when it is not counted */
struct key_bin { /* mask_hist: key bits [shift, shift + width) under `prefix` */
  const float *x, *m;
  uint64_t prefix;
  int shift, width;
  __device__ int64_t operator()(int64_t i) const {
    const uint64_t k = fsdp_x_mask_key(x[i], m, i);
    if ((k >> (shift + width)) != prefix) return -1;
    return (int64_t)((k >> shift) & (((uint64_t)1 << width) - 1));
  }
};

struct pos_bin { /* mask_hist_pos: position bits of the elements whose key is T */
  const float *x, *m;
  uint32_t T;
  uint64_t gbase, prefix;
  int shift, width;
  __device__ int64_t operator()(int64_t i) const {
    if (fsdp_x_mask_key(x[i], m, i) != T) return -1;
    const uint64_t pos = gbase + (uint64_t)i;
    if ((pos >> (shift + width)) != prefix) return -1;
    return (int64_t)((pos >> shift) & (((uint64_t)1 << width) - 1));
  }
};

template <typename Bin>
__global__ void hist_shared_k(unsigned long long *hist, int64_t n, int nb, Bin bin) {
  __shared__ unsigned int local[SHARED_BINS];
  for (int b = threadIdx.x; b < nb; b += blockDim.x) local[b] = 0;
  __syncthreads();
  FSDP_CU_LOOP(i, n) {
    const int64_t b = bin(i);
    if (b >= 0) atomicAdd(&local[b], 1u); /* a block counts < 2^32 elements: see the grid cap */
  }
  __syncthreads();
  for (int b = threadIdx.x; b < nb; b += blockDim.x)
    if (local[b]) atomicAdd(&hist[b], (unsigned long long)local[b]);
}

template <typename Bin>
__global__ void hist_global_k(unsigned long long *hist, int64_t n, Bin bin) {
  FSDP_CU_LOOP(i, n) {
    const int64_t b = bin(i);
    if (b >= 0) atomicAdd(&hist[b], 1ull);
  }
}

/* counts (host, 2^width) += the histogram of bin over [0, n) */
template <typename Bin>
static int histogram(int64_t *counts, int64_t n, int width, Bin bin, const char *what) {
  if (width < 1 || width > 16)
    return fsdp_error("%s: width %d (1..16)", what, width);
  if (n <= 0) return FSDP_OK;
  const int nb = 1 << width;
  const size_t bytes = (size_t)nb * sizeof(unsigned long long);
  unsigned long long *d, *h = (unsigned long long *)malloc(bytes);
  if (!h) return fsdp_error("%s: out of host memory", what);
  if (fsdp_cuda_scratch((void **)&d, bytes)) {
    free(h);
    return FSDP_ERR;
  }
  cudaStream_t s = fsdp_cuda_stream();
  int rc = fsdp_cuda_check(cudaMemsetAsync(d, 0, bytes, s), what);
  if (!rc) {
    /* blocks_for caps the grid at 2^20 blocks of 256 threads: each thread of a block visits at
     * most n / 2^28 elements, so a block counts fewer than 2^32 below n = 2^52 */
    if (nb <= SHARED_BINS) hist_shared_k<<<blocks_for(n), THREADS, 0, s>>>(d, n, nb, bin);
    else hist_global_k<<<blocks_for(n), THREADS, 0, s>>>(d, n, bin);
    rc = fsdp_cuda_launched(what);
  }
  if (!rc) rc = to_host_now(h, d, bytes, what);
  fsdp_cuda_scratch_free(d, bytes);
  if (!rc)
    for (int b = 0; b < nb; b++) counts[b] += (int64_t)h[b];
  free(h);
  return rc;
}

int fsdp_cuda_mask_hist(void *ctx, fsdp_dtype dt, int64_t *counts, const void *x, const void *m,
                        int64_t n, uint64_t prefix, int shift, int width) {
  MASK_F32("mask_hist", dt);
  if (shift < 0 || shift + width > 32)
    return fsdp_error("mask_hist: bits [%d, %d) of a 32-bit key", shift, shift + width);
  return histogram(counts, n, width,
                   key_bin{(const float *)x, (const float *)m, prefix, shift, width},
                   "mask_hist");
}

int fsdp_cuda_mask_hist_pos(void *ctx, fsdp_dtype dt, int64_t *counts, const void *x,
                            const void *m, int64_t n, uint32_t T, uint64_t gbase, uint64_t prefix,
                            int shift, int width) {
  MASK_F32("mask_hist_pos", dt);
  if (shift < 0 || shift + width > 63)
    return fsdp_error("mask_hist_pos: bits [%d, %d) of a position", shift, shift + width);
  return histogram(counts, n, width,
                   pos_bin{(const float *)x, (const float *)m, T, gbase, prefix, shift, width},
                   "mask_hist_pos");
}

/* ---- selection ---------------------------------------------------------------------------------- */

__global__ void select_k(float *mout, const float *x, const float *m, int64_t n, uint32_t T,
                         uint64_t gbase, uint64_t P) {
  FSDP_CU_LOOP(i, n) { /* mout may be m: element i is read before it is written */
    const uint32_t key = fsdp_x_mask_key(x[i], m, i);
    const bool pruned = key < T || (key == T && gbase + (uint64_t)i < P);
    mout[i] = pruned ? 0.0f : 1.0f;
  }
}

int fsdp_cuda_mask_select(void *ctx, fsdp_dtype dt, void *mout, int64_t *pruned, const void *x,
                          const void *m, int64_t n, uint32_t T, uint64_t gbase, uint64_t P) {
  MASK_F32("mask_select", dt);
  *pruned = 0;
  if (n <= 0) return FSDP_OK;
  select_k<<<blocks_for(n), THREADS, 0, fsdp_cuda_stream()>>>((float *)mout, (const float *)x,
                                                               (const float *)m, n, T, gbase, P);
  if (fsdp_cuda_launched("mask_select")) return FSDP_ERR;
  /* every element was written 0 or 1: the pruned ones are mout's zeros */
  return count(n, is_zero{(const float *)mout}, pruned, "mask_select");
}

/* N:M. Element i of a group ranks above those with a smaller value, or an equal value and a
 * lower index; the `keep` best stay. Small groups: one thread each; large: one block each. */
#define NM_THREAD_MAX 32

__global__ void nm_small_k(float *mout, const float *x, const float *m, int64_t groups,
                           int64_t keep, int M, int64_t lead) {
  FSDP_CU_LOOP(g, groups) {
    const int64_t base = lead + g * M;
    float v[NM_THREAD_MAX];
    for (int i = 0; i < M; i++) v[i] = fsdp_x_mask_value(x[base + i], m, base + i);
    for (int i = 0; i < M; i++) { /* the whole group is read before mout (maybe m) is written */
      int64_t above = 0;
      for (int j = 0; j < M; j++)
        if (j != i) above += v[j] > v[i] || (v[j] == v[i] && j > i);
      mout[base + i] = above < keep ? 1.0f : 0.0f;
    }
  }
}

__global__ void nm_block_k(float *mout, const float *x, const float *m, int64_t groups,
                           int64_t keep, int M, int64_t lead) {
  extern __shared__ float v[]; /* M values */
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const int64_t base = lead + g * M;
    for (int i = threadIdx.x; i < M; i += blockDim.x)
      v[i] = fsdp_x_mask_value(x[base + i], m, base + i);
    __syncthreads();
    for (int i = threadIdx.x; i < M; i += blockDim.x) {
      int64_t above = 0;
      for (int j = 0; j < M; j++)
        if (j != i) above += v[j] > v[i] || (v[j] == v[i] && j > i);
      mout[base + i] = above < keep ? 1.0f : 0.0f;
    }
    __syncthreads(); /* v is reloaded for the next group */
  }
}

int fsdp_cuda_mask_nm(void *ctx, fsdp_dtype dt, void *mout, int64_t *groups, const void *x,
                      const void *m, int64_t n, int64_t keep, int64_t M, int64_t lead) {
  MASK_F32("mask_nm", dt);
  if (M < 1 || M > 4096 || keep < 0 || keep > M)
    return fsdp_error("mask_nm: %lld of %lld (0 <= keep <= M <= 4096, M >= 1)", (long long)keep,
                      (long long)M);
  if (lead < 0) lead = 0;
  *groups = n - lead >= M ? (n - lead) / M : 0;
  if (*groups == 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  if (M <= NM_THREAD_MAX)
    nm_small_k<<<blocks_for(*groups), THREADS, 0, s>>>((float *)mout, (const float *)x,
                                                        (const float *)m, *groups, keep, (int)M,
                                                        lead);
  else
    nm_block_k<<<blocks_for(*groups, 1), THREADS, (size_t)M * sizeof(float), s>>>(
        (float *)mout, (const float *)x, (const float *)m, *groups, keep, (int)M, lead);
  return fsdp_cuda_launched("mask_nm");
}

__global__ void mask_values_k(float *out, const float *x, const float *m, int64_t n) {
  FSDP_CU_LOOP(i, n) out[i] = fsdp_x_mask_value(x[i], m, i);
}

int fsdp_cuda_mask_values(void *ctx, fsdp_dtype dt, void *out, const void *x, const void *m,
                          int64_t n) {
  MASK_F32("mask_values", dt);
  if (n <= 0) return FSDP_OK;
  mask_values_k<<<blocks_for(n), THREADS, 0, fsdp_cuda_stream()>>>((float *)out,
                                                                    (const float *)x,
                                                                    (const float *)m, n);
  return fsdp_cuda_launched("mask_values");
}
