/*
 * loss.cu — cross-entropy (fused log-softmax, integer targets of any dtype, ignore_index) and
 * mean squared error, forward and backward.
 *
 * Cross-entropy: one block per row computes the row's maximum, its sum of exp(logit - max) and
 * lse = max + log(sum) (saved, f32), so the backward recomputes softmax = exp(logit - lse)
 * without a reduction. The per-row losses go to scratch in double; one block then sums them in
 * a fixed order and writes the mean to the device `loss`, and the counted rows to the host
 * (*count: the one host result, copied back with the stream synchronized). A target outside
 * [0, V) (the callers check targets, so only a bug gets here) gives a NaN loss rather than a
 * read out of bounds.
 *
 * dloss is a device pointer (one f32), read by the backward kernels, so nothing waits for it.
 * Sums run in double in fixed orders (rows.cuh): results repeat bit for bit, no atomics.
 */
#include "kernels/cuda/rows.cuh"

#define REFUSE(op, dt) fsdp_kernels_refuse(op, dt, "cuda")

static bool is_f32_family(fsdp_dtype dt) {
  return dt == FSDP_DTYPE_F32 || dt == FSDP_DTYPE_BF16 || dt == FSDP_DTYPE_F16;
}

/* ---- cross-entropy --------------------------------------------------------------------------- */

template <typename T>
static __global__ void ce_forward_rows(float *lse, double *row_loss, const T *logits,
                                       const void *targets, fsdp_dtype tdt, int64_t N, int V,
                                       int64_t ignore) {
  // lse (N), row_loss (N), logits (N, V), targets (N) of tdt
  __shared__ float sh[32];
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const int64_t t = ld_index(targets, tdt, row); /* the same for the whole block */
    if (t == ignore) {
      if (threadIdx.x == 0) lse[row] = 0.0f, row_loss[row] = 0.0;
      continue;
    }
    const T *x = logits + row * V;
    float s;
    const float mx = row_max_sumexp(x, V, sh, &s);
    if (threadIdx.x == 0) {
      const double l = (double)mx + log((double)s);
      lse[row] = (float)l;
      row_loss[row] = t >= 0 && t < V ? l - (double)ldf(x, t) : (double)NAN;
    }
  }
}

/* One block: loss[0] = the mean of the counted rows' losses, *count_out = their number. */
static __global__ void ce_mean(float *loss, long long *count_out, const double *row_loss,
                               const void *targets, fsdp_dtype tdt, int64_t N, int64_t ignore) {
  __shared__ double shd[32];
  __shared__ long long shk[32];
  double s = 0.0;
  long long k = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    if (ld_index(targets, tdt, i) == ignore) continue;
    s += row_loss[i];
    k++;
  }
  s = block_sum(s, shd);
  k = block_sum(k, shk);
  if (threadIdx.x == 0) {
    *count_out = k;
    loss[0] = k ? (float)(s / (double)k) : 0.0f;
  }
}

/* dlogits += dloss[0] / count (softmax - onehot(target)) on counted rows */
template <typename T>
static __global__ void ce_backward_rows(T *dlogits, const float *dloss, const T *logits,
                                        const float *lse, const void *targets, fsdp_dtype tdt,
                                        int64_t N, int V, int64_t ignore, int64_t count) {
  // dlogits (N, V), logits (N, V), lse (N), targets (N) of tdt
  const float sc = dloss[0] / (float)count;
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const int64_t t = ld_index(targets, tdt, row);
    if (t == ignore) continue;
    const T *x = logits + row * V;
    T *d = dlogits + row * V;
    const float l = lse[row];
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
      float g = ldf(d, v) + sc * expf(ldf(x, v) - l);
      if (v == t) g -= sc;
      stf(d, v, g);
    }
  }
}

template <typename T>
static int ce_forward_t(float *loss, float *lse, const T *logits, const void *targets,
                        fsdp_dtype tdt, int64_t N, int V, int64_t ignore, int64_t *count) {
  const size_t bytes = (size_t)N * sizeof(double) + sizeof(long long);
  void *scratch;
  if (fsdp_cuda_scratch(&scratch, bytes)) return FSDP_ERR;
  double *row_loss = (double *)scratch;
  long long *count_dev = (long long *)(row_loss + N);
  cudaStream_t st = fsdp_cuda_stream();
  ce_forward_rows<T><<<grid_for(N), row_threads(V), 0, st>>>(lse, row_loss, logits, targets, tdt,
                                                             N, V, ignore);
  int rc = fsdp_cuda_launched("cross_entropy");
  if (!rc) {
    ce_mean<<<1, 1024, 0, st>>>(loss, count_dev, row_loss, targets, tdt, N, ignore);
    rc = fsdp_cuda_launched("cross_entropy");
  }
  long long k = 0;
  if (!rc)
    rc = fsdp_cuda_check(cudaMemcpyAsync(&k, count_dev, sizeof k, cudaMemcpyDeviceToHost, st),
                         "cross_entropy: reading the count");
  if (!rc) rc = fsdp_cuda_check(cudaStreamSynchronize(st), "cross_entropy: reading the count");
  fsdp_cuda_scratch_free(scratch, bytes);
  if (!rc) *count = (int64_t)k;
  return rc;
}

int fsdp_cuda_cross_entropy_forward(void *ctx, fsdp_dtype dt, float *loss, float *lse,
                                    const void *logits, const void *targets, fsdp_dtype tdt,
                                    int64_t N, int V, int64_t ignore, int64_t *count) {
  if (!is_f32_family(dt)) return REFUSE("cross_entropy", dt);
  if (N <= 0 || V <= 0) { /* no rows (or no classes: nothing a target could name) */
    *count = 0;
    return fsdp_cuda_check(cudaMemsetAsync(loss, 0, sizeof(float), fsdp_cuda_stream()),
                           "cross_entropy");
  }
  switch (dt) {
  case FSDP_DTYPE_F32:
    return ce_forward_t(loss, lse, (const float *)logits, targets, tdt, N, V, ignore, count);
  case FSDP_DTYPE_BF16:
    return ce_forward_t(loss, lse, (const __nv_bfloat16 *)logits, targets, tdt, N, V, ignore,
                        count);
  default:
    return ce_forward_t(loss, lse, (const __half *)logits, targets, tdt, N, V, ignore, count);
  }
}

int fsdp_cuda_cross_entropy_backward(void *ctx, fsdp_dtype dt, void *dlogits, const float *dloss,
                                     const void *logits, const float *lse, const void *targets,
                                     fsdp_dtype tdt, int64_t N, int V, int64_t ignore,
                                     int64_t count) {
  if (!is_f32_family(dt)) return REFUSE("cross_entropy", dt);
  if (count <= 0 || N <= 0 || V <= 0 || !dlogits) return FSDP_OK;
  const unsigned grid = grid_for(N);
  const int threads = row_threads(V);
  cudaStream_t st = fsdp_cuda_stream();
  switch (dt) {
  case FSDP_DTYPE_F32:
    ce_backward_rows<<<grid, threads, 0, st>>>((float *)dlogits, dloss, (const float *)logits,
                                               lse, targets, tdt, N, V, ignore, count);
    break;
  case FSDP_DTYPE_BF16:
    ce_backward_rows<<<grid, threads, 0, st>>>((__nv_bfloat16 *)dlogits, dloss,
                                               (const __nv_bfloat16 *)logits, lse, targets, tdt,
                                               N, V, ignore, count);
    break;
  default:
    ce_backward_rows<<<grid, threads, 0, st>>>((__half *)dlogits, dloss,
                                               (const __half *)logits, lse, targets, tdt, N, V,
                                               ignore, count);
    break;
  }
  return fsdp_cuda_launched("cross_entropy");
}

/* ---- mean squared error ---------------------------------------------------------------------- */

#define MSE_THREADS 256
#define MSE_MAX_BLOCKS 1024

/* part[block] = this block's share of sum((a - b)^2) (double) */
template <typename T>
static __global__ void mse_partial(double *part, const T *a, const T *b, int64_t n) {
  __shared__ double sh[32];
  double s = 0.0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float d = ldf(a, i) - ldf(b, i);
    s += (double)(d * d);
  }
  s = block_sum(s, sh);
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}

/* one block: out[0] = sum of part (nb) / n */
static __global__ void mse_finish(float *out, const double *part, int nb, int64_t n) {
  __shared__ double sh[32];
  double s = 0.0;
  for (int i = threadIdx.x; i < nb; i += blockDim.x) s += part[i];
  s = block_sum(s, sh);
  if (threadIdx.x == 0) out[0] = (float)(s / (double)n);
}

/* da += 2 dloss / n (a - b), db -= the same; da and db may be one buffer (a single pass) */
template <typename T>
static __global__ void mse_backward_k(T *da, T *db, const float *dloss, const T *a, const T *b,
                                      int64_t n) {
  const float k = 2.0f * dloss[0] / (float)n;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float d = ldf(a, i) - ldf(b, i);
    if (da == db) { /* both adds in f32, one rounding: as the cpu's two passes over one buffer */
      stf(da, i, (ldf(da, i) + k * d) - k * d);
      continue;
    }
    if (da) stf(da, i, ldf(da, i) + k * d);
    if (db) stf(db, i, ldf(db, i) - k * d);
  }
}

template <typename T>
static int mse_forward_t(float *out, const T *a, const T *b, int64_t n) {
  int nb = (int)grid_elems(n, MSE_THREADS);
  if (nb > MSE_MAX_BLOCKS) nb = MSE_MAX_BLOCKS;
  const size_t bytes = (size_t)nb * sizeof(double);
  void *part;
  if (fsdp_cuda_scratch(&part, bytes)) return FSDP_ERR;
  cudaStream_t st = fsdp_cuda_stream();
  mse_partial<T><<<nb, MSE_THREADS, 0, st>>>((double *)part, a, b, n);
  int rc = fsdp_cuda_launched("mse");
  if (!rc) {
    mse_finish<<<1, MSE_THREADS, 0, st>>>(out, (const double *)part, nb, n);
    rc = fsdp_cuda_launched("mse");
  }
  fsdp_cuda_scratch_free(part, bytes);
  return rc;
}

int fsdp_cuda_mse_forward(void *ctx, fsdp_dtype dt, float *out, const void *a, const void *b,
                          int64_t n) {
  if (!is_f32_family(dt)) return REFUSE("mse", dt);
  if (n <= 0)
    return fsdp_cuda_check(cudaMemsetAsync(out, 0, sizeof(float), fsdp_cuda_stream()), "mse");
  switch (dt) {
  case FSDP_DTYPE_F32: return mse_forward_t(out, (const float *)a, (const float *)b, n);
  case FSDP_DTYPE_BF16:
    return mse_forward_t(out, (const __nv_bfloat16 *)a, (const __nv_bfloat16 *)b, n);
  default: return mse_forward_t(out, (const __half *)a, (const __half *)b, n);
  }
}

int fsdp_cuda_mse_backward(void *ctx, fsdp_dtype dt, void *da, void *db, const float *dloss,
                           const void *a, const void *b, int64_t n) {
  if (!is_f32_family(dt)) return REFUSE("mse", dt);
  if (n <= 0 || (!da && !db)) return FSDP_OK;
  const unsigned grid = grid_elems(n, 256);
  cudaStream_t st = fsdp_cuda_stream();
  switch (dt) {
  case FSDP_DTYPE_F32:
    mse_backward_k<<<grid, 256, 0, st>>>((float *)da, (float *)db, dloss, (const float *)a,
                                         (const float *)b, n);
    break;
  case FSDP_DTYPE_BF16:
    mse_backward_k<<<grid, 256, 0, st>>>((__nv_bfloat16 *)da, (__nv_bfloat16 *)db, dloss,
                                         (const __nv_bfloat16 *)a, (const __nv_bfloat16 *)b, n);
    break;
  default:
    mse_backward_k<<<grid, 256, 0, st>>>((__half *)da, (__half *)db, dloss, (const __half *)a,
                                         (const __half *)b, n);
    break;
  }
  return fsdp_cuda_launched("mse");
}
