/*
 * typed_ref.h — inputs and the serial reference for typed collectives, shared by the local
 * backend's test (test_comm.c) and the mpi backend's (tests/mpi/test_mpi_comm.c), so both
 * backends are held to the same bits.
 *
 * The reference is written apart from src/comm/reduce.c: a left-to-right fold over ranks
 * 0..W-1 of one element at a time. bf16 is widened by shifting its bits and rounded to
 * nearest-even from the f32 remainder bits (not through core's conversion); f64 avg divides by
 * W; i64 sums wrap modulo 2^64.
 */
#ifndef FSDP_TEST_TYPED_REF_H
#define FSDP_TEST_TYPED_REF_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "comm/comm.h"

/* every dtype: all_gather and broadcast move each; the first four reduce */
static const fsdp_dtype typed_all[] = {FSDP_DTYPE_F32, FSDP_DTYPE_BF16, FSDP_DTYPE_F64,
                                       FSDP_DTYPE_I64, FSDP_DTYPE_U8,   FSDP_DTYPE_BOOL,
                                       FSDP_DTYPE_F16, FSDP_DTYPE_I32};
#define TYPED_ALL ((int)(sizeof typed_all / sizeof typed_all[0]))
#define TYPED_REDUCIBLE 4

static uint64_t typed_hash(int rank, int64_t i, int salt) {
  uint64_t h = (uint64_t)rank * 0x9E3779B97F4A7C15ull ^ (uint64_t)i * 0xC2B2AE3D27D4EB4Full ^
               (uint64_t)(salt + 1) * 0x165667B19E3779F9ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return h;
}

/* A real over many exponents (addition order shows in the low bits); NaN now and then. */
static double typed_real(int rank, int64_t i, int salt) {
  uint64_t h = typed_hash(rank, i, salt);
  if (h % 997 == 5) return NAN;
  double m = (double)(h % 1000003) / 1000003.0 - 0.5;
  return ldexp(m, (int)((h >> 40) % 24) - 12);
}

static uint16_t ref_bf16_round(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if (x != x) return (uint16_t)((u >> 16) | 0x40u);
  uint32_t lo = u >> 16, rest = u & 0xffffu;
  if (rest > 0x8000u || (rest == 0x8000u && (lo & 1u))) lo++;
  return (uint16_t)lo;
}

static float ref_bf16_widen(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float x;
  memcpy(&x, &u, 4);
  return x;
}

/* Element i of rank `rank`'s input for dtype dt, written to out (one element). */
static void typed_input(fsdp_dtype dt, int rank, int64_t i, int salt, void *out) {
  uint64_t h = typed_hash(rank, i, salt);
  double v = typed_real(rank, i, salt);
  switch (dt) {
  case FSDP_DTYPE_F32: { float f = (float)v; memcpy(out, &f, 4); break; }
  case FSDP_DTYPE_BF16: { uint16_t b = ref_bf16_round((float)v); memcpy(out, &b, 2); break; }
  case FSDP_DTYPE_F64: memcpy(out, &v, 8); break;
  case FSDP_DTYPE_I64: { /* full range: sums wrap */
    int64_t k = (int64_t)(h * 0x2545F4914F6CDD1Dull);
    memcpy(out, &k, 8);
    break;
  }
  case FSDP_DTYPE_I32: { int32_t k = (int32_t)h; memcpy(out, &k, 4); break; }
  case FSDP_DTYPE_F16: { uint16_t b = (uint16_t)h; memcpy(out, &b, 2); break; } /* any bits */
  case FSDP_DTYPE_BOOL: { uint8_t b = (uint8_t)(h & 1); memcpy(out, &b, 1); break; }
  default: { uint8_t b = (uint8_t)h; memcpy(out, &b, 1); break; } /* u8: any byte, NUL too */
  }
}

static double ref_fold(double s, double x, fsdp_reduce_op red) {
  switch (red) {
  case FSDP_RED_MAX: return (x > s || x != x) ? x : s;
  case FSDP_RED_MIN: return (x < s || x != x) ? x : s;
  default: return s + x;
  }
}

/* Element i of the reduction over ranks 0..W-1 of typed_input(dt, p, i, salt), into out. */
static void typed_ref_reduce(fsdp_dtype dt, int W, int64_t i, int salt, fsdp_reduce_op red,
                             void *out) {
  if (dt == FSDP_DTYPE_F32 || dt == FSDP_DTYPE_BF16) {
    float s = 0;
    for (int p = 0; p < W; p++) {
      float x;
      if (dt == FSDP_DTYPE_F32) {
        typed_input(dt, p, i, salt, &x);
      } else {
        uint16_t b;
        typed_input(dt, p, i, salt, &b);
        x = ref_bf16_widen(b);
      }
      /* a float sum done in double and rounded once is the f32 sum (53 >= 2 * 24 + 2 bits) */
      s = p == 0 ? x : (float)ref_fold(s, x, red);
    }
    if (red == FSDP_RED_AVG) s = s * (float)(1.0 / W);
    if (dt == FSDP_DTYPE_F32) memcpy(out, &s, 4);
    else { uint16_t b = ref_bf16_round(s); memcpy(out, &b, 2); }
  } else if (dt == FSDP_DTYPE_F64) {
    double s = 0;
    for (int p = 0; p < W; p++) {
      double x;
      typed_input(dt, p, i, salt, &x);
      s = p == 0 ? x : ref_fold(s, x, red);
    }
    if (red == FSDP_RED_AVG) s = s / (double)W;
    memcpy(out, &s, 8);
  } else { /* i64 */
    int64_t s = 0;
    for (int p = 0; p < W; p++) {
      int64_t x;
      typed_input(dt, p, i, salt, &x);
      if (p == 0) s = x;
      else if (red == FSDP_RED_MAX) s = x > s ? x : s;
      else if (red == FSDP_RED_MIN) s = x < s ? x : s;
      else s = (int64_t)((uint64_t)s + (uint64_t)x);
    }
    memcpy(out, &s, 8);
  }
}

/* Two elements of dtype dt agree: the same bits, or both NaN (a NaN's payload is not part of
 * the contract). */
static bool typed_same(fsdp_dtype dt, const void *a, const void *b) {
  size_t n = fsdp_dtype_size(dt);
  if (memcmp(a, b, n) == 0) return true;
  if (dt == FSDP_DTYPE_F32) {
    float x, y;
    memcpy(&x, a, 4);
    memcpy(&y, b, 4);
    return x != x && y != y;
  }
  if (dt == FSDP_DTYPE_F64) {
    double x, y;
    memcpy(&x, a, 8);
    memcpy(&y, b, 8);
    return x != x && y != y;
  }
  if (dt == FSDP_DTYPE_BF16) {
    uint16_t x, y;
    memcpy(&x, a, 2);
    memcpy(&y, b, 2);
    return (x & 0x7fffu) > 0x7f80u && (y & 0x7fffu) > 0x7f80u;
  }
  return false;
}

#endif
