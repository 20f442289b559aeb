/*
 * norm.cu — layer normalisation and row softmax, forward and backward.
 *
 * One block per row (grid-stride over rows), a few elements per thread; row statistics in f32
 * through fixed-order block reductions (rows.cuh), rows re-read from global memory (L1/L2) for
 * each pass rather than staged in shared memory. As on the cpu, the variance comes from
 * centred values (x - mean)^2, not E[x^2] - mean^2, which cancels for large means; mean and
 * rstd are saved in f32. The weight and bias gradients are column sums (rows.cuh's two-pass
 * colsum_acc: per-run partial sums in scratch, then the runs added in order), so every result
 * repeats bit for bit: no atomics.
 */
#include "kernels/cuda/rows.cuh"

#define REFUSE(op, dt) fsdp_kernels_refuse(op, dt, "cuda")

/* ---- layernorm ------------------------------------------------------------------------------- */

template <typename T>
static __global__ void layernorm_forward_rows(T *out, float *mean, float *rstd, const T *inp,
                                              const T *weight, const T *bias, int64_t N, int C,
                                              float eps) {
  // out (N, C), mean (N), rstd (N), inp (N, C), weight (C) or NULL (= 1), bias (C) or NULL
  __shared__ float sh[32];
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const T *x = inp + row * C;
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += ldf(x, c);
    const float m = block_sum(s, sh) / (float)C;
    float v = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float d = ldf(x, c) - m;
      v += d * d;
    }
    const float r = 1.0f / sqrtf(block_sum(v, sh) / (float)C + eps);
    T *y = out + row * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      float o = (ldf(x, c) - m) * r;
      if (weight) o *= ldf(weight, c);
      if (bias) o += ldf(bias, c);
      stf(y, c, o);
    }
    if (threadIdx.x == 0) {
      mean[row] = m;
      rstd[row] = r;
    }
  }
}

/* dinp += rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), dxhat = weight * dout */
template <typename T>
static __global__ void layernorm_backward_rows(T *dinp, const T *dout, const T *inp,
                                               const T *weight, const float *mean,
                                               const float *rstd, int64_t N, int C) {
  // dinp (N, C), dout (N, C), inp (N, C), weight (C) or NULL, mean (N), rstd (N)
  __shared__ float sh[32];
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const T *g = dout + row * C, *x = inp + row * C;
    const float m = mean[row], s = rstd[row];
    float a = 0.0f, b = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float dxhat = weight ? ldf(weight, c) * ldf(g, c) : ldf(g, c);
      a += dxhat;
      b += dxhat * ((ldf(x, c) - m) * s);
    }
    const float mean_dxhat = block_sum(a, sh) / (float)C;
    const float mean_dxhat_xhat = block_sum(b, sh) / (float)C;
    T *dx = dinp + row * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float dxhat = weight ? ldf(weight, c) * ldf(g, c) : ldf(g, c);
      const float xhat = (ldf(x, c) - m) * s;
      stf(dx, c, ldf(dx, c) + s * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat));
    }
  }
}

template <typename T>
static int layernorm_forward_t(T *out, float *mean, float *rstd, const T *inp, const T *weight,
                               const T *bias, int64_t N, int C, float eps) {
  layernorm_forward_rows<T><<<grid_for(N), row_threads(C), 0, fsdp_cuda_stream()>>>(
      out, mean, rstd, inp, weight, bias, N, C, eps);
  return fsdp_cuda_launched("layernorm");
}

template <typename T, typename G>
static int layernorm_backward_t(T *dinp, G *dweight, G *dbias, const T *dout, const T *inp,
                                const T *weight, const float *mean, const float *rstd,
                                int64_t N, int C) {
  if (dinp) {
    layernorm_backward_rows<T><<<grid_for(N), row_threads(C), 0, fsdp_cuda_stream()>>>(
        dinp, dout, inp, weight, mean, rstd, N, C);
    if (fsdp_cuda_launched("layernorm")) return FSDP_ERR;
  }
  return colsum_acc(dbias, dweight, dout, inp, mean, rstd, N, C, "layernorm");
}

int fsdp_cuda_layernorm_forward(void *ctx, fsdp_dtype dt, void *out, float *mean, float *rstd,
                                const void *inp, const void *weight, const void *bias, int64_t N,
                                int C, float eps) {
  if (dt != FSDP_DTYPE_F32 && dt != FSDP_DTYPE_BF16 && dt != FSDP_DTYPE_F16)
    return REFUSE("layernorm", dt);
  if (N <= 0 || C <= 0) return FSDP_OK;
  switch (dt) {
  case FSDP_DTYPE_F32:
    return layernorm_forward_t((float *)out, mean, rstd, (const float *)inp,
                               (const float *)weight, (const float *)bias, N, C, eps);
  case FSDP_DTYPE_BF16:
    return layernorm_forward_t((__nv_bfloat16 *)out, mean, rstd, (const __nv_bfloat16 *)inp,
                               (const __nv_bfloat16 *)weight, (const __nv_bfloat16 *)bias, N, C,
                               eps);
  default:
    return layernorm_forward_t((__half *)out, mean, rstd, (const __half *)inp,
                               (const __half *)weight, (const __half *)bias, N, C, eps);
  }
}

/* T: the activations' type; G: the weight gradients' (T, or float under mixed precision) */
template <typename T>
static int layernorm_backward_g(fsdp_dtype gdt, void *dinp, void *dweight, void *dbias,
                                const void *dout, const void *inp, const void *weight,
                                const float *mean, const float *rstd, int64_t N, int C) {
  if (gdt == FSDP_DTYPE_F32)
    return layernorm_backward_t((T *)dinp, (float *)dweight, (float *)dbias, (const T *)dout,
                                (const T *)inp, (const T *)weight, mean, rstd, N, C);
  return layernorm_backward_t((T *)dinp, (T *)dweight, (T *)dbias, (const T *)dout,
                              (const T *)inp, (const T *)weight, mean, rstd, N, C);
}

int fsdp_cuda_layernorm_backward(void *ctx, fsdp_dtype dt, fsdp_dtype gdt, void *dinp,
                                 void *dweight, void *dbias, const void *dout, const void *inp,
                                 const void *weight, const float *mean, const float *rstd,
                                 int64_t N, int C) {
  if (dt != FSDP_DTYPE_F32 && dt != FSDP_DTYPE_BF16 && dt != FSDP_DTYPE_F16)
    return REFUSE("layernorm", dt);
  if (gdt != dt && !(dt != FSDP_DTYPE_F32 && gdt == FSDP_DTYPE_F32))
    return REFUSE("layernorm (weight gradient)", gdt);
  if (N <= 0 || C <= 0) return FSDP_OK;
  switch (dt) {
  case FSDP_DTYPE_F32:
    return layernorm_backward_g<float>(gdt, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                                       N, C);
  case FSDP_DTYPE_BF16:
    return layernorm_backward_g<__nv_bfloat16>(gdt, dinp, dweight, dbias, dout, inp, weight,
                                               mean, rstd, N, C);
  default:
    return layernorm_backward_g<__half>(gdt, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                                        N, C);
  }
}

/* ---- softmax over the last dim ------------------------------------------------------------------

 * Stable: the row's maximum is subtracted before exp, so exp(-inf - max) = 0 for masked entries
 * and large logits do not overflow. A row that is all -inf gives NaN, as on the cpu. */

template <typename T>
static __global__ void softmax_forward_rows(T *out, const T *inp, int64_t N, int C) {
  // out (N, C), inp (N, C)
  __shared__ float sh[32];
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const T *x = inp + row * C;
    float s;
    const float mx = row_max_sumexp(x, C, sh, &s);
    const float inv = 1.0f / s;
    T *y = out + row * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) stf(y, c, expf(ldf(x, c) - mx) * inv);
  }
}

/* dinp += out (dout - sum(dout out)) */
template <typename T>
static __global__ void softmax_backward_rows(T *dinp, const T *dout, const T *out, int64_t N,
                                             int C) {
  // dinp (N, C), dout (N, C), out (N, C)
  __shared__ float sh[32];
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const T *g = dout + row * C, *y = out + row * C;
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += ldf(g, c) * ldf(y, c);
    const float dot = block_sum(s, sh);
    T *d = dinp + row * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
      stf(d, c, ldf(d, c) + ldf(y, c) * (ldf(g, c) - dot));
  }
}

int fsdp_cuda_softmax_forward(void *ctx, fsdp_dtype dt, void *out, const void *inp, int64_t N,
                              int C) {
  if (dt != FSDP_DTYPE_F32 && dt != FSDP_DTYPE_BF16 && dt != FSDP_DTYPE_F16)
    return REFUSE("softmax", dt);
  if (N <= 0 || C <= 0) return FSDP_OK;
  const unsigned grid = grid_for(N);
  const int threads = row_threads(C);
  cudaStream_t st = fsdp_cuda_stream();
  switch (dt) {
  case FSDP_DTYPE_F32:
    softmax_forward_rows<<<grid, threads, 0, st>>>((float *)out, (const float *)inp, N, C);
    break;
  case FSDP_DTYPE_BF16:
    softmax_forward_rows<<<grid, threads, 0, st>>>((__nv_bfloat16 *)out,
                                                   (const __nv_bfloat16 *)inp, N, C);
    break;
  default:
    softmax_forward_rows<<<grid, threads, 0, st>>>((__half *)out, (const __half *)inp, N, C);
    break;
  }
  return fsdp_cuda_launched("softmax");
}

int fsdp_cuda_softmax_backward(void *ctx, fsdp_dtype dt, void *dinp, const void *dout,
                               const void *out, int64_t N, int C) {
  if (dt != FSDP_DTYPE_F32 && dt != FSDP_DTYPE_BF16 && dt != FSDP_DTYPE_F16)
    return REFUSE("softmax", dt);
  if (N <= 0 || C <= 0 || !dinp) return FSDP_OK;
  const unsigned grid = grid_for(N);
  const int threads = row_threads(C);
  cudaStream_t st = fsdp_cuda_stream();
  switch (dt) {
  case FSDP_DTYPE_F32:
    softmax_backward_rows<<<grid, threads, 0, st>>>((float *)dinp, (const float *)dout,
                                                    (const float *)out, N, C);
    break;
  case FSDP_DTYPE_BF16:
    softmax_backward_rows<<<grid, threads, 0, st>>>((__nv_bfloat16 *)dinp,
                                                    (const __nv_bfloat16 *)dout,
                                                    (const __nv_bfloat16 *)out, N, C);
    break;
  default:
    softmax_backward_rows<<<grid, threads, 0, st>>>((__half *)dinp, (const __half *)dout,
                                                    (const __half *)out, N, C);
    break;
  }
  return fsdp_cuda_launched("softmax");
}
