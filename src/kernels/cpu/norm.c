/*
 * norm.c — layer normalisation and row softmax, forward and backward.
 *
 * Rows are independent; row reductions use the SIMD helpers of vmath.h (float lanes, blocks
 * summed in double), elementwise parts are plain restrict loops the compiler vectorises.
 * Layernorm computes the variance from centred values (two passes over a row that is in
 * cache) rather than E[x^2] - E[x]^2, which cancels catastrophically for large means.
 */
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/vmath.h"

#include <math.h>

void fsdp_cpu_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                                const float *weight, const float *bias, int64_t N, int C,
                                float eps) {
  // out (N, C), mean (N), rstd (N), inp (N, C), weight (C) or NULL (= 1), bias (C) or NULL
  for (int64_t n = 0; n < N; n++) {
    const float *restrict x = inp + n * C;
    float *restrict y = out + n * C;
    float m = (float)(fsdp_row_sum(x, C) / C);
    fsdp_vf acc = fsdp_vf_set(0.0f);
    int c = 0;
    for (; c + FSDP_VW <= C; c += FSDP_VW) {
      fsdp_vf d = fsdp_vf_load(x + c) - m;
      acc += d * d;
    }
    float tail = 0.0f;
    for (; c < C; c++) tail += (x[c] - m) * (x[c] - m);
    float var = (fsdp_vf_hsum(acc) + tail) / (float)C;
    float s = 1.0f / sqrtf(var + eps);
    if (weight && bias) {
      for (c = 0; c < C; c++) y[c] = (x[c] - m) * s * weight[c] + bias[c];
    } else if (weight) {
      for (c = 0; c < C; c++) y[c] = (x[c] - m) * s * weight[c];
    } else if (bias) {
      for (c = 0; c < C; c++) y[c] = (x[c] - m) * s + bias[c];
    } else {
      for (c = 0; c < C; c++) y[c] = (x[c] - m) * s;
    }
    mean[n] = m;
    rstd[n] = s;
  }
}

void fsdp_cpu_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                 const float *inp, const float *weight, const float *mean,
                                 const float *rstd, int64_t N, int C) {
  // dinp (N, C), dweight (C), dbias (C), dout (N, C), inp (N, C), weight (C) or NULL,
  // mean (N), rstd (N); dinp, dweight, dbias may each be NULL
  for (int64_t n = 0; n < N; n++) {
    const float *restrict g = dout + n * C;
    const float *restrict x = inp + n * C;
    const float m = mean[n], s = rstd[n];
    if (dbias) {
      float *restrict db = dbias;
      for (int c = 0; c < C; c++) db[c] += g[c];
    }
    if (dweight) {
      float *restrict dw = dweight;
      for (int c = 0; c < C; c++) dw[c] += (x[c] - m) * s * g[c];
    }
    if (!dinp) continue;
    /* dx = s * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = w * dout */
    float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
    if (weight) {
      fsdp_vf a = fsdp_vf_set(0.0f), b = fsdp_vf_set(0.0f);
      int c = 0;
      for (; c + FSDP_VW <= C; c += FSDP_VW) {
        fsdp_vf dxhat = fsdp_vf_load(weight + c) * fsdp_vf_load(g + c);
        a += dxhat;
        b += dxhat * ((fsdp_vf_load(x + c) - m) * s);
      }
      for (; c < C; c++) {
        float dxhat = weight[c] * g[c];
        sum_dxhat += dxhat;
        sum_dxhat_xhat += dxhat * ((x[c] - m) * s);
      }
      sum_dxhat += fsdp_vf_hsum(a);
      sum_dxhat_xhat += fsdp_vf_hsum(b);
    } else {
      fsdp_vf a = fsdp_vf_set(0.0f), b = fsdp_vf_set(0.0f);
      int c = 0;
      for (; c + FSDP_VW <= C; c += FSDP_VW) {
        fsdp_vf dxhat = fsdp_vf_load(g + c);
        a += dxhat;
        b += dxhat * ((fsdp_vf_load(x + c) - m) * s);
      }
      for (; c < C; c++) {
        sum_dxhat += g[c];
        sum_dxhat_xhat += g[c] * ((x[c] - m) * s);
      }
      sum_dxhat += fsdp_vf_hsum(a);
      sum_dxhat_xhat += fsdp_vf_hsum(b);
    }
    const float mean_dxhat = sum_dxhat / (float)C, mean_dxhat_xhat = sum_dxhat_xhat / (float)C;
    float *restrict dx = dinp + n * C;
    if (weight) {
      for (int c = 0; c < C; c++) {
        float xhat = (x[c] - m) * s;
        dx[c] += s * (weight[c] * g[c] - mean_dxhat - xhat * mean_dxhat_xhat);
      }
    } else {
      for (int c = 0; c < C; c++) {
        float xhat = (x[c] - m) * s;
        dx[c] += s * (g[c] - mean_dxhat - xhat * mean_dxhat_xhat);
      }
    }
  }
}

void fsdp_cpu_softmax_forward(float *out, const float *inp, int64_t N, int C) {
  // out (N, C), inp (N, C)
  for (int64_t n = 0; n < N; n++) {
    const float *x = inp + n * C;
    float *restrict y = out + n * C;
    float mx = fsdp_row_max(x, C);
    float inv = (float)(1.0 / fsdp_row_expsum(y, x, mx, C));
    for (int c = 0; c < C; c++) y[c] *= inv;
  }
}

void fsdp_cpu_softmax_backward(float *dinp, const float *dout, const float *out, int64_t N,
                               int C) {
  // dinp (N, C), dout (N, C), out (N, C)
  for (int64_t n = 0; n < N; n++) {
    const float *restrict g = dout + n * C, *restrict y = out + n * C;
    float *restrict d = dinp + n * C;
    float dot = (float)fsdp_row_dot(g, y, C);
    for (int c = 0; c < C; c++) d[c] += y[c] * (g[c] - dot);
  }
}
