/*
 * elementwise.c — binary ops with suffix broadcasting, scalar affine, and embedding lookup.
 *
 * Broadcasting: a (n), b (m), n % m == 0, b repeats n / m times (its shape is a suffix of a's).
 * Forward kernels may run in place with out == a exactly (no restrict on them).
 * Backward kernels accumulate; da and db may be the same buffer (x * x hands both gradients to
 * one tensor), so each is updated in its own pass. Gradients of a broadcast b are summed over
 * the repeats in double, chunk by chunk, so that long batch dimensions lose no precision.
 */
#include "kernels/cpu/kernels.h"

#include <string.h>

/* out[0..len) = a op b over one span (b a span too) */
static void binary_span(float *out, const float *a, const float *b, int64_t len, fsdp_binop op) {
  switch (op) {
  case FSDP_BIN_ADD: for (int64_t i = 0; i < len; i++) out[i] = a[i] + b[i]; break;
  case FSDP_BIN_SUB: for (int64_t i = 0; i < len; i++) out[i] = a[i] - b[i]; break;
  case FSDP_BIN_MUL: for (int64_t i = 0; i < len; i++) out[i] = a[i] * b[i]; break;
  case FSDP_BIN_DIV: for (int64_t i = 0; i < len; i++) out[i] = a[i] / b[i]; break;
  }
}

/* out[0..len) = a op s (b a scalar) */
static void binary_scalar(float *out, const float *a, float s, int64_t len, fsdp_binop op) {
  switch (op) {
  case FSDP_BIN_ADD: for (int64_t i = 0; i < len; i++) out[i] = a[i] + s; break;
  case FSDP_BIN_SUB: for (int64_t i = 0; i < len; i++) out[i] = a[i] - s; break;
  case FSDP_BIN_MUL: for (int64_t i = 0; i < len; i++) out[i] = a[i] * s; break;
  case FSDP_BIN_DIV: for (int64_t i = 0; i < len; i++) out[i] = a[i] / s; break;
  }
}

void fsdp_cpu_binary_forward(float *out, const float *a, const float *b, int64_t n, int64_t m,
                             fsdp_binop op) {
  // out (n), a (n), b (m)
  if (n <= 0 || m <= 0) return;
  if (m == 1) {
    binary_scalar(out, a, b[0], n, op);
    return;
  }
  for (int64_t r = 0; r < n; r += m) binary_span(out + r, a + r, b, m, op);
}

/* da (n) += dout * d(a op b)/da, with b repeating */
static void binary_backward_a(float *da, const float *dout, const float *b, int64_t n,
                              int64_t m, fsdp_binop op) {
  switch (op) {
  case FSDP_BIN_ADD:
  case FSDP_BIN_SUB:
    for (int64_t i = 0; i < n; i++) da[i] += dout[i];
    break;
  case FSDP_BIN_MUL:
    if (m == 1) {
      const float s = b[0];
      for (int64_t i = 0; i < n; i++) da[i] += dout[i] * s;
      break;
    }
    for (int64_t r = 0; r < n; r += m) {
      float *d = da + r;
      const float *g = dout + r;
      for (int64_t j = 0; j < m; j++) d[j] += g[j] * b[j];
    }
    break;
  case FSDP_BIN_DIV:
    if (m == 1) {
      const float s = b[0];
      for (int64_t i = 0; i < n; i++) da[i] += dout[i] / s;
      break;
    }
    for (int64_t r = 0; r < n; r += m) {
      float *d = da + r;
      const float *g = dout + r;
      for (int64_t j = 0; j < m; j++) d[j] += g[j] / b[j];
    }
    break;
  }
}

#define DB_CHUNK 256

/* db (m) += sum over repeats of dout * d(a op b)/db */
static void binary_backward_b(float *db, const float *dout, const float *a, const float *b,
                              int64_t n, int64_t m, fsdp_binop op) {
  double acc[DB_CHUNK];
  for (int64_t j0 = 0; j0 < m; j0 += DB_CHUNK) {
    int64_t len = m - j0 < DB_CHUNK ? m - j0 : DB_CHUNK;
    memset(acc, 0, sizeof(double) * (size_t)len);
    const float *bj = b + j0;
    for (int64_t r = 0; r < n; r += m) {
      const float *g = dout + r + j0, *aj = a + r + j0;
      switch (op) {
      case FSDP_BIN_ADD:
      case FSDP_BIN_SUB:
        for (int64_t j = 0; j < len; j++) acc[j] += (double)g[j];
        break;
      case FSDP_BIN_MUL:
        for (int64_t j = 0; j < len; j++) acc[j] += (double)(g[j] * aj[j]);
        break;
      case FSDP_BIN_DIV:
        /* d(a/b)/db = -a / b^2, written (a / b) / b so that b^2 cannot underflow first */
        for (int64_t j = 0; j < len; j++) acc[j] += (double)(g[j] * (aj[j] / bj[j] / bj[j]));
        break;
      }
    }
    if (op == FSDP_BIN_SUB || op == FSDP_BIN_DIV) {
      for (int64_t j = 0; j < len; j++) db[j0 + j] -= (float)acc[j];
    } else {
      for (int64_t j = 0; j < len; j++) db[j0 + j] += (float)acc[j];
    }
  }
}

/* The m == 1 (scalar b) case of binary_backward_b: one long reduction, in double. */
static void binary_backward_b_scalar(float *db, const float *dout, const float *a, float b,
                                     int64_t n, fsdp_binop op) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int64_t i = 0;
  switch (op) {
  case FSDP_BIN_ADD:
  case FSDP_BIN_SUB:
    for (; i + 4 <= n; i += 4) {
      s0 += dout[i]; s1 += dout[i + 1]; s2 += dout[i + 2]; s3 += dout[i + 3];
    }
    for (; i < n; i++) s0 += dout[i];
    break;
  case FSDP_BIN_MUL:
  case FSDP_BIN_DIV:
    for (; i + 4 <= n; i += 4) {
      s0 += dout[i] * a[i]; s1 += dout[i + 1] * a[i + 1];
      s2 += dout[i + 2] * a[i + 2]; s3 += dout[i + 3] * a[i + 3];
    }
    for (; i < n; i++) s0 += dout[i] * a[i];
    break;
  }
  double s = (s0 + s1) + (s2 + s3);
  switch (op) {
  case FSDP_BIN_ADD: db[0] += (float)s; break;
  case FSDP_BIN_SUB: db[0] -= (float)s; break;
  case FSDP_BIN_MUL: db[0] += (float)s; break;
  case FSDP_BIN_DIV: db[0] -= (float)(s / b / b); break;
  }
}

void fsdp_cpu_binary_backward(float *da, float *db, const float *dout, const float *a,
                              const float *b, int64_t n, int64_t m, fsdp_binop op) {
  // da (n), db (m), dout (n), a (n), b (m)
  if (n <= 0 || m <= 0) return;
  if (da) binary_backward_a(da, dout, b, n, m, op);
  if (db) {
    if (m == 1) binary_backward_b_scalar(db, dout, a, b[0], n, op);
    else binary_backward_b(db, dout, a, b, n, m, op);
  }
}

void fsdp_cpu_affine_forward(float *out, const float *a, float s, float t, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = a[i] * s + t;
}

void fsdp_cpu_affine_backward(float *da, const float *dout, float s, int64_t n) {
  for (int64_t i = 0; i < n; i++) da[i] += dout[i] * s;
}

/* ---- embedding ----------------------------------------------------------------------------- */

void fsdp_cpu_embedding_forward(float *out, const int64_t *ids, const float *weight, int64_t N,
                                int C) {
  // out (N, C), ids (N), weight (V, C)
  for (int64_t i = 0; i < N; i++)
    memcpy(out + i * C, weight + ids[i] * C, sizeof(float) * (size_t)C);
}

void fsdp_cpu_embedding_backward(float *dweight, const float *dout, const int64_t *ids, int64_t N,
                                 int C) {
  // dweight (V, C), dout (N, C), ids (N)
  for (int64_t i = 0; i < N; i++) {
    float *restrict dst = dweight + ids[i] * C;
    const float *restrict src = dout + i * C;
    for (int c = 0; c < C; c++) dst[c] += src[c];
  }
}
