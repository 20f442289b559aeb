/*
 * embed.cu — embedding: a row gather forward, a deterministic scatter-add backward.
 *
 * Forward copies rows as bytes, whatever the dtype (floats and integers), in the widest unit
 * (16 bytes down to 1) that the row size and both buffers' alignment allow.
 *
 * Backward adds dout's rows into dweight's rows named by ids, without atomics, in the cpu's
 * order: the (id, position) pairs are sorted by id with CUB's radix sort (stable, so positions
 * stay ascending within an id), the starts of the runs of equal ids are selected, and one block
 * column per run walks its positions in order, keeping the sum in a register: dweight[id] +
 * dout[p1] + dout[p2] + ..., rounded to the gradient's dtype after every add (as the cpu
 * rounds a bf16 gradient once per occurrence; an f32 gradient — f32 tensors, or mixed
 * precision's — is exact f32 adds). So results equal the cpu's bit for bit and repeat run to
 * run, with deterministic mode on or off: an atomicAdd version would save the sort (tens of
 * microseconds for a batch of tokens) but not the gather, and rounds in a random order, so
 * there is one path. Caveat: one id repeated many times (padding) is summed by one thread per
 * column, four rows in flight at a time.
 *
 * Ids are checked by the callers (check_index); they are read as integers from any dtype.
 */
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>

#include "kernels/cuda/rows.cuh"

#define REFUSE(op, dt) fsdp_kernels_refuse(op, dt, "cuda")

/* ---- forward --------------------------------------------------------------------------------- */

/* out (N, units) = weight[ids] (rows of `units` copy units U) */
template <typename U>
static __global__ void gather_rows(U *out, const U *weight, const void *ids, fsdp_dtype idt,
                                   int64_t N, int64_t units) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const U *src = weight + ld_index(ids, idt, row) * units;
    U *dst = out + row * units;
    for (int64_t j = threadIdx.x; j < units; j += blockDim.x) dst[j] = src[j];
  }
}

template <typename U>
static int gather_t(void *out, const void *weight, const void *ids, fsdp_dtype idt, int64_t N,
                    size_t row_bytes) {
  const int64_t units = (int64_t)(row_bytes / sizeof(U));
  gather_rows<U><<<grid_for(N), row_threads(units), 0, fsdp_cuda_stream()>>>(
      (U *)out, (const U *)weight, ids, idt, N, units);
  return fsdp_cuda_launched("embedding");
}

int fsdp_cuda_embedding_forward(void *ctx, fsdp_dtype dt, void *out, const void *ids,
                                fsdp_dtype idt, const void *weight, int64_t N, int C) {
  // out (N, C) = weight (V, C) [ids (N)]
  if (dt == FSDP_DTYPE_BOOL || fsdp_dtype_size(dt) == 0) return REFUSE("embedding", dt);
  if (N <= 0 || C <= 0) return FSDP_OK;
  const size_t row = (size_t)C * fsdp_dtype_size(dt);
  const uintptr_t a = (uintptr_t)out | (uintptr_t)weight | (uintptr_t)row;
  if (a % 16 == 0) return gather_t<uint4>(out, weight, ids, idt, N, row);
  if (a % 8 == 0) return gather_t<uint2>(out, weight, ids, idt, N, row);
  if (a % 4 == 0) return gather_t<uint32_t>(out, weight, ids, idt, N, row);
  if (a % 2 == 0) return gather_t<uint16_t>(out, weight, ids, idt, N, row);
  return gather_t<uint8_t>(out, weight, ids, idt, N, row);
}

/* ---- backward -------------------------------------------------------------------------------- */

#define RUN_THREADS 128 /* columns per block */
#define RUN_BLOCKS 4096 /* runs taken at once (grid-stride beyond) */

/* keys[i] = ids[i], pos[i] = i */
static __global__ void embed_keys(int64_t *keys, int64_t *pos, const void *ids, fsdp_dtype idt,
                                  int64_t N) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N;
       i += (int64_t)gridDim.x * blockDim.x) {
    keys[i] = ld_index(ids, idt, i);
    pos[i] = i;
  }
}

/* flags[i] = 1 where the sorted keys start a run of equal ids */
static __global__ void embed_run_flags(uint8_t *flags, const int64_t *keys, int64_t N) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N;
       i += (int64_t)gridDim.x * blockDim.x)
    flags[i] = i == 0 || keys[i] != keys[i - 1];
}

/* x rounded to G's precision (and back to f32) */
template <typename G> static __device__ __forceinline__ float round_to(float x) {
  G t;
  stf(&t, 0, x);
  return ldf(&t, 0);
}

/* dweight[id] += dout[p] for the positions p of each run, in order; thread = one column */
template <typename T, typename G>
static __global__ void embed_runs(G *dweight, const T *dout, const int64_t *keys,
                                  const int64_t *pos, const int64_t *starts,
                                  const int64_t *nruns, int64_t N, int C) {
  // dweight (V, C), dout (N, C), keys/pos (N) sorted by id, starts (*nruns)
  const int64_t c = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t R = *nruns;
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const int64_t s = starts[r], e = r + 1 < R ? starts[r + 1] : N;
    const int64_t at = keys[s] * C + c;
    float acc = ldf(dweight, at);
    int64_t j = s;
    for (; j + 4 <= e; j += 4) { /* four loads in flight, then the adds in order */
      const float v0 = ldf(dout, pos[j] * C + c), v1 = ldf(dout, pos[j + 1] * C + c),
                  v2 = ldf(dout, pos[j + 2] * C + c), v3 = ldf(dout, pos[j + 3] * C + c);
      acc = round_to<G>(acc + v0);
      acc = round_to<G>(acc + v1);
      acc = round_to<G>(acc + v2);
      acc = round_to<G>(acc + v3);
    }
    for (; j < e; j++) acc = round_to<G>(acc + ldf(dout, pos[j] * C + c));
    stf(dweight, at, acc);
  }
}

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

template <typename T, typename G>
static int embedding_backward_t(G *dweight, const T *dout, const void *ids, fsdp_dtype idt,
                                int64_t N, int C) {
  if ((C + RUN_THREADS - 1) / RUN_THREADS > 65535)
    return fsdp_error("cuda: embedding: rows of %d elements are too long for the backward", C);
  cudaStream_t st = fsdp_cuda_stream();
  size_t sort_bytes = 0, select_bytes = 0;
  int rc = fsdp_cuda_check(cub::DeviceRadixSort::SortPairs(NULL, sort_bytes, (const int64_t *)NULL,
                                                           (int64_t *)NULL, (const int64_t *)NULL,
                                                           (int64_t *)NULL, N, 0, 64, st),
                           "embedding: sort");
  if (!rc)
    rc = fsdp_cuda_check(cub::DeviceSelect::Flagged(NULL, select_bytes, (const int64_t *)NULL,
                                                    (const uint8_t *)NULL, (int64_t *)NULL,
                                                    (int64_t *)NULL, N, st),
                         "embedding: select");
  if (rc) return rc;
  /* scratch: keys and positions in and out, run flags and starts, the run count, CUB's temp */
  const size_t n8 = align256((size_t)N * 8), n1 = align256((size_t)N);
  const size_t temp_bytes = align256(sort_bytes > select_bytes ? sort_bytes : select_bytes);
  const size_t bytes = 5 * n8 + n1 + 256 + temp_bytes;
  char *base;
  if (fsdp_cuda_scratch((void **)&base, bytes)) return FSDP_ERR;
  int64_t *keys_in = (int64_t *)base, *keys = (int64_t *)(base + n8);
  int64_t *pos_in = (int64_t *)(base + 2 * n8), *pos = (int64_t *)(base + 3 * n8);
  int64_t *starts = (int64_t *)(base + 4 * n8);
  uint8_t *flags = (uint8_t *)(base + 5 * n8);
  int64_t *nruns = (int64_t *)(base + 5 * n8 + n1);
  void *temp = base + 5 * n8 + n1 + 256;

  embed_keys<<<grid_elems(N, 256), 256, 0, st>>>(keys_in, pos_in, ids, idt, N);
  rc = fsdp_cuda_launched("embedding");
  if (!rc) {
    size_t tb = temp_bytes;
    rc = fsdp_cuda_check(cub::DeviceRadixSort::SortPairs(temp, tb, (const int64_t *)keys_in, keys,
                                                         (const int64_t *)pos_in, pos, N, 0, 64,
                                                         st),
                         "embedding: sort");
  }
  if (!rc) {
    embed_run_flags<<<grid_elems(N, 256), 256, 0, st>>>(flags, keys, N);
    rc = fsdp_cuda_launched("embedding");
  }
  if (!rc) { /* pos_in still holds 0, 1, ..., N - 1: the selected ones are the run starts */
    size_t tb = temp_bytes;
    rc = fsdp_cuda_check(cub::DeviceSelect::Flagged(temp, tb, (const int64_t *)pos_in,
                                                    (const uint8_t *)flags, starts, nruns, N, st),
                         "embedding: select");
  }
  if (!rc) {
    const dim3 grid((unsigned)(N < RUN_BLOCKS ? N : RUN_BLOCKS),
                    (unsigned)((C + RUN_THREADS - 1) / RUN_THREADS));
    embed_runs<T, G><<<grid, RUN_THREADS, 0, st>>>(dweight, dout, keys, pos, starts, nruns, N,
                                                   C);
    rc = fsdp_cuda_launched("embedding");
  }
  fsdp_cuda_scratch_free(base, bytes);
  return rc;
}

/* T: dout's type; the weight gradient is T or, under mixed precision, f32 */
template <typename T>
static int embedding_backward_g(fsdp_dtype gdt, void *dweight, const void *dout, const void *ids,
                                fsdp_dtype idt, int64_t N, int C) {
  if (gdt == FSDP_DTYPE_F32)
    return embedding_backward_t((float *)dweight, (const T *)dout, ids, idt, N, C);
  return embedding_backward_t((T *)dweight, (const T *)dout, ids, idt, N, C);
}

int fsdp_cuda_embedding_backward(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dweight,
                                 const void *dout, const void *ids, fsdp_dtype idt, int64_t N,
                                 int C) {
  // dweight (V, C, gdt) [ids (N)] += dout (N, C)
  if (dt != FSDP_DTYPE_F32 && dt != FSDP_DTYPE_BF16 && dt != FSDP_DTYPE_F16)
    return REFUSE("embedding", dt);
  if (gdt != dt && !(dt != FSDP_DTYPE_F32 && gdt == FSDP_DTYPE_F32))
    return REFUSE("embedding (weight gradient)", gdt);
  if (N <= 0 || C <= 0 || !dweight) return FSDP_OK;
  switch (dt) {
  case FSDP_DTYPE_F32:
    return embedding_backward_t((float *)dweight, (const float *)dout, ids, idt, N, C);
  case FSDP_DTYPE_BF16:
    return embedding_backward_g<__nv_bfloat16>(gdt, dweight, dout, ids, idt, N, C);
  default: return embedding_backward_g<__half>(gdt, dweight, dout, ids, idt, N, C);
  }
}
