/*
 * activations.c — ReLU, GELU (tanh approximation) and dropout, forward and backward.
 *
 * GELU uses the vectorised exp of vmath.h, with tanh(u) written through sigmoid(2u); one code
 * path serves full vectors and tails, so a value's result does not depend on where it sits in
 * the buffer. Its backward is the exact derivative of the same tanh formula.
 * Dropout draws its uniforms from the counter-based core RNG into the mask buffer itself, so
 * no scratch is needed and element i's decision is a pure function of (key, first + i): any
 * rank can reproduce any slice.
 */
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/vmath.h"
#include "core/core.h"

#define GELU_S 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_A 0.044715f

void fsdp_cpu_relu_forward(float *out, const float *inp, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = inp[i] > 0.0f ? inp[i] : 0.0f;
}

void fsdp_cpu_relu_backward(float *dinp, const float *dout, const float *inp, int64_t n) {
  for (int64_t i = 0; i < n; i++) dinp[i] += inp[i] > 0.0f ? dout[i] : 0.0f;
}

/* 0.5 x (1 + tanh(u)) == x * sigmoid(2u) == x / (1 + e^{-2u}),  u = s (x + a x^3): one exp and
 * one division, and no 1 + tanh cancellation for negative x. */
static inline fsdp_vf gelu_v(fsdp_vf x) {
  fsdp_vf u = GELU_S * (x + GELU_A * x * x * x);
  return x / (1.0f + fsdp_vf_exp(-2.0f * u));
}

void fsdp_cpu_gelu_forward(float *out, const float *inp, int64_t n) {
  int64_t i = 0;
  for (; i + FSDP_VW <= n; i += FSDP_VW) fsdp_vf_store(out + i, gelu_v(fsdp_vf_load(inp + i)));
  if (i < n) {
    int rem = (int)(n - i);
    fsdp_vf_store_part(out + i, gelu_v(fsdp_vf_load_part(inp + i, rem, 0.0f)), rem);
  }
}

/* d gelu / dx = 0.5 (1 + t) + 0.5 x (1 - t^2) u',  t = tanh(u), u' = s (1 + 3 a x^2);
 * with q = sigmoid(2u) = (1 + t) / 2 this is q + 2 x q (1 - q) u'. */
static inline fsdp_vf gelu_grad_v(fsdp_vf x) {
  fsdp_vf x2 = x * x;
  fsdp_vf u = GELU_S * (x + GELU_A * x2 * x);
  fsdp_vf q = 1.0f / (1.0f + fsdp_vf_exp(-2.0f * u));
  return q + 2.0f * x * q * (1.0f - q) * (GELU_S * (1.0f + 3.0f * GELU_A * x2));
}

void fsdp_cpu_gelu_backward(float *dinp, const float *dout, const float *inp, int64_t n) {
  int64_t i = 0;
  for (; i + FSDP_VW <= n; i += FSDP_VW) {
    fsdp_vf grad = gelu_grad_v(fsdp_vf_load(inp + i));
    fsdp_vf_store(dinp + i, fsdp_vf_load(dinp + i) + grad * fsdp_vf_load(dout + i));
  }
  if (i < n) {
    int rem = (int)(n - i);
    fsdp_vf d = fsdp_vf_load_part(dinp + i, rem, 0.0f) +
                gelu_grad_v(fsdp_vf_load_part(inp + i, rem, 0.0f)) *
                    fsdp_vf_load_part(dout + i, rem, 0.0f);
    fsdp_vf_store_part(dinp + i, d, rem);
  }
}

void fsdp_cpu_dropout_forward(float *out, float *mask, const float *inp, int64_t n, float p,
                              uint64_t key, uint64_t first) {
  // out (n), mask (n), inp (n)
  if (p <= 0.0f) {
    /* u >= 0 always holds: skip the RNG, the mask is all ones */
    for (int64_t i = 0; i < n; i++) {
      mask[i] = 1.0f;
      out[i] = inp[i];
    }
    return;
  }
  const float scale = p >= 1.0f ? 0.0f : 1.0f / (1.0f - p);
  fsdp_rng_uniform(mask, n, key, first); /* the uniforms, turned into the mask in place */
  for (int64_t i = 0; i < n; i++) {
    mask[i] = mask[i] >= p ? scale : 0.0f;
    out[i] = inp[i] * mask[i];
  }
}

void fsdp_cpu_dropout_backward(float *dinp, const float *dout, const float *mask, int64_t n) {
  for (int64_t i = 0; i < n; i++) dinp[i] += dout[i] * mask[i];
}
