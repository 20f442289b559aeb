/*
 * loss.c — cross-entropy (fused log-softmax, integral float targets, ignore_index) and mean
 * squared error, forward and backward.
 *
 * Cross-entropy is stable for any logit range: each row's max is subtracted before exp, and
 * the row's log-sum-exp is computed in double and saved, so the backward recomputes
 * softmax = exp(logit - lse) without a second reduction. Per-row losses are summed in double.
 */
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/vmath.h"

#include <math.h>

float fsdp_cpu_cross_entropy_forward(float *lse, const float *logits, const int64_t *targets,
                                     int64_t N, int V, int64_t ignore_index, int64_t *count) {
  // lse (N), logits (N, V), targets (N)
  double total = 0.0;
  int64_t counted = 0;
  for (int64_t i = 0; i < N; i++) {
    const int64_t tgt = targets[i];
    if (tgt == ignore_index) {
      lse[i] = 0.0f;
      continue;
    }
    const float *row = logits + i * V;
    const float mx = fsdp_row_max(row, V);
    const double l = (double)mx + log(fsdp_row_expsum(NULL, row, mx, V));
    lse[i] = (float)l;
    total += l - (double)row[tgt];
    counted++;
  }
  *count = counted;
  return counted ? (float)(total / (double)counted) : 0.0f;
}

void fsdp_cpu_cross_entropy_backward(float *dlogits, float dloss, const float *logits,
                                     const float *lse, const int64_t *targets, int64_t N, int V,
                                     int64_t ignore_index, int64_t count) {
  // dlogits (N, V), logits (N, V), lse (N), targets (N)
  if (count <= 0) return;
  const float sc = dloss / (float)count;
  for (int64_t i = 0; i < N; i++) {
    const int64_t tgt = targets[i];
    if (tgt == ignore_index) continue;
    const float *x = logits + i * V;
    float *d = dlogits + i * V;
    const float l = lse[i];
    int v = 0;
    for (; v + FSDP_VW <= V; v += FSDP_VW) {
      fsdp_vf p = fsdp_vf_exp(fsdp_vf_load(x + v) - l);
      fsdp_vf_store(d + v, fsdp_vf_load(d + v) + sc * p);
    }
    if (v < V) {
      int rem = V - v;
      fsdp_vf p = fsdp_vf_exp(fsdp_vf_load_part(x + v, rem, -INFINITY) - l);
      fsdp_vf_store_part(d + v, fsdp_vf_load_part(d + v, rem, 0.0f) + sc * p, rem);
    }
    d[tgt] -= sc;
  }
}

float fsdp_cpu_mse_forward(const float *a, const float *b, int64_t n) {
  // a (n), b (n)
  if (n <= 0) return 0.0f;
  double total = 0.0;
  int64_t i = 0;
  while (i < n) {
    int64_t end = i + 64 * FSDP_VW < n ? i + 64 * FSDP_VW : n;
    fsdp_vf acc = fsdp_vf_set(0.0f);
    for (; i + FSDP_VW <= end; i += FSDP_VW) {
      fsdp_vf d = fsdp_vf_load(a + i) - fsdp_vf_load(b + i);
      acc += d * d;
    }
    double tail = 0.0;
    for (; i < end; i++) tail += (double)(a[i] - b[i]) * (a[i] - b[i]);
    total += (double)fsdp_vf_hsum(acc) + tail;
  }
  return (float)(total / (double)n);
}

void fsdp_cpu_mse_backward(float *da, float *db, float dloss, const float *a, const float *b,
                           int64_t n) {
  // da (n), db (n), a (n), b (n); da and db may be the same buffer: one pass each
  if (n <= 0) return;
  const float k = 2.0f * dloss / (float)n;
  if (da) for (int64_t i = 0; i < n; i++) da[i] += k * (a[i] - b[i]);
  if (db) for (int64_t i = 0; i < n; i++) db[i] -= k * (a[i] - b[i]);
}
