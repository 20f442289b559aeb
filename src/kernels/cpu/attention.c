/*
 * attention.c — causal multi-head self-attention on a fused qkv buffer (llm.c layout),
 * forward and backward.
 *
 * All products are sgemm calls on strided views: q, k, v of head h are the column blocks
 * [h*hs, (h+1)*hs) of qkv's three C-wide thirds, with row stride 3C, so nothing is copied.
 * Causality is exploited by walking query rows in blocks of ATT_BLOCK: rows [r0, r1) only see
 * keys [0, r1), so each block multiplies against a prefix of k / v and about half the
 * T x T work of a full product is skipped. Entries a block's gemm writes above the diagonal
 * are overwritten by the masked softmax (att holds exact zeros there).
 */
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/vmath.h"

#include <math.h>
#include <string.h>

#define ATT_BLOCK 64

void fsdp_cpu_attention_forward(float *out, float *att, const float *qkv, int B, int T, int C,
                                int NH) {
  // out (B, T, C), att (B, NH, T, T), qkv (B, T, 3C)
  const int C3 = 3 * C, hs = C / NH;
  const float scale = 1.0f / sqrtf((float)hs);
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      const float *q = qkv + (int64_t)b * T * C3 + h * hs; // (T, hs), row stride 3C
      const float *k = q + C, *v = q + 2 * C;
      float *A = att + ((int64_t)b * NH + h) * T * T; // (T, T)
      float *o = out + (int64_t)b * T * C + h * hs;   // (T, hs), row stride C
      for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) {
        const int rows = T - r0 < ATT_BLOCK ? T - r0 : ATT_BLOCK, cols = r0 + rows;
        float *Ab = A + (int64_t)r0 * T;
        /* scores[r0:r1, 0:r1] = q[r0:r1] @ k[0:r1]^T * scale */
        fsdp_cpu_gemm(Ab, q + (int64_t)r0 * C3, k, rows, cols, hs, false, true, scale, 0.0f,
                      C3, C3, T);
        for (int t = r0; t < r0 + rows; t++) {
          float *row = A + (int64_t)t * T;
          const int len = t + 1;
          float mx = fsdp_row_max(row, len);
          float inv = (float)(1.0 / fsdp_row_expsum(row, row, mx, len));
          for (int j = 0; j < len; j++) row[j] *= inv;
          memset(row + len, 0, sizeof(float) * (size_t)(T - len));
        }
        /* out[r0:r1] = att[r0:r1, 0:r1] @ v[0:r1] */
        fsdp_cpu_gemm(o + (int64_t)r0 * C, Ab, v, rows, hs, cols, false, false, 1.0f, 0.0f, T,
                      C3, C);
      }
    }
  }
}

void fsdp_cpu_attention_backward(float *dqkv, float *scratch, const float *dout,
                                 const float *qkv, const float *att, int B, int T, int C,
                                 int NH) {
  // dqkv (B, T, 3C), scratch (B, NH, T, T), dout (B, T, C), qkv (B, T, 3C), att (B, NH, T, T)
  const int C3 = 3 * C, hs = C / NH;
  const float scale = 1.0f / sqrtf((float)hs);
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      const float *q = qkv + (int64_t)b * T * C3 + h * hs; // (T, hs), row stride 3C
      const float *k = q + C, *v = q + 2 * C;
      float *dq = dqkv + (int64_t)b * T * C3 + h * hs;
      float *dk = dq + C, *dv = dq + 2 * C;
      const float *A = att + ((int64_t)b * NH + h) * T * T; // (T, T)
      float *S = scratch + ((int64_t)b * NH + h) * T * T;   // datt, then dscores
      const float *g = dout + (int64_t)b * T * C + h * hs;  // (T, hs), row stride C
      for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) {
        const int rows = T - r0 < ATT_BLOCK ? T - r0 : ATT_BLOCK, cols = r0 + rows;
        const float *Ab = A + (int64_t)r0 * T, *gb = g + (int64_t)r0 * C;
        float *Sb = S + (int64_t)r0 * T;
        /* datt[r0:r1, 0:r1] = dout[r0:r1] @ v[0:r1]^T */
        fsdp_cpu_gemm(Sb, gb, v, rows, cols, hs, false, true, 1.0f, 0.0f, C, C3, T);
        /* dv[0:r1] += att[r0:r1, 0:r1]^T @ dout[r0:r1] */
        fsdp_cpu_gemm(dv, Ab, gb, cols, hs, rows, true, false, 1.0f, 1.0f, T, C, C3);
        /* softmax backward, row by row over the causal prefix */
        for (int t = r0; t < r0 + rows; t++) {
          const float *restrict a = A + (int64_t)t * T;
          float *restrict s = S + (int64_t)t * T;
          const int len = t + 1;
          float dot = (float)fsdp_row_dot(a, s, len);
          for (int j = 0; j < len; j++) s[j] = a[j] * (s[j] - dot);
          memset(s + len, 0, sizeof(float) * (size_t)(cols - len));
        }
        /* dq[r0:r1] += dscores[r0:r1, 0:r1] @ k[0:r1] * scale */
        fsdp_cpu_gemm(dq + (int64_t)r0 * C3, Sb, k, rows, hs, cols, false, false, scale, 1.0f, T,
                      C3, C3);
        /* dk[0:r1] += dscores[r0:r1, 0:r1]^T @ q[r0:r1] * scale */
        fsdp_cpu_gemm(dk, Sb, q + (int64_t)r0 * C3, cols, hs, rows, true, false, scale, 1.0f, T,
                      C3, C3);
      }
    }
  }
}
