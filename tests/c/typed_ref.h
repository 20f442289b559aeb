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
#include <stdio.h>
#include <stdlib.h>
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

/* What typed_exercise saw: the first wrong element or failed call ("" when none), and how many
 * elements it compared. */
typedef struct typed_report {
  char wrong[512];
  long checks;
} typed_report;

static void typed_expect(typed_report *t, fsdp_dtype dt, const char *what, int64_t n, int64_t i,
                         const void *got, const void *want) {
  t->checks++;
  if (t->wrong[0] || typed_same(dt, got, want)) return;
  uint64_t g = 0, w = 0;
  memcpy(&g, got, fsdp_dtype_size(dt));
  memcpy(&w, want, fsdp_dtype_size(dt));
  snprintf(t->wrong, sizeof t->wrong, "%s %s n=%lld: element %lld has bits 0x%llx, want 0x%llx",
           fsdp_dtype_name(dt), what, (long long)n, (long long)i, (unsigned long long)g,
           (unsigned long long)w);
}

static bool typed_ok(typed_report *t, int rc, const char *what) {
  if (rc == FSDP_OK) return true;
  if (!t->wrong[0]) snprintf(t->wrong, sizeof t->wrong, "%s failed: %.400s", what, fsdp_error_msg());
  return false;
}

/* Every collective in every dtype on c (rank r of W), against the reference: all_gather (and in
 * place) and broadcast from every root for each dtype; reduce_scatter (and in place) and
 * all_reduce with every reduction the dtype has. Counts reach past the mpi backend's 4 KiB
 * test segments in every element size. Stops at the first failed call (the ranks stay in step
 * only while every call succeeds). */
static void typed_exercise(fsdp_comm *c, int W, int r, typed_report *t) {
  static const int64_t counts[] = {0, 1, 7, 33, 2049, 4099};
  for (int di = 0; di < TYPED_ALL && !t->wrong[0]; di++) {
    const fsdp_dtype dt = typed_all[di];
    const size_t esz = fsdp_dtype_size(dt);
    for (size_t ci = 0; ci < sizeof counts / sizeof counts[0] && !t->wrong[0]; ci++) {
      const int64_t n = counts[ci];
      const int salt = 100 * di + 10 * (int)ci;
      char *send = malloc(esz * (size_t)(n * W + 1));
      char *recv = malloc(esz * (size_t)(n * W + 1));
      char want[8];
      if (!send || !recv) {
        snprintf(t->wrong, sizeof t->wrong, "out of memory");
        free(send);
        free(recv);
        return;
      }
#define EL(buf, k) ((buf) + (size_t)(k) * esz)
      for (int in_place = 0; in_place < 2; in_place++) {
        memset(recv, 0xA5, esz * (size_t)(n * W));
        char *src = in_place ? EL(recv, r * n) : send;
        for (int64_t i = 0; i < n; i++) typed_input(dt, r, i, salt + in_place, EL(src, i));
        if (!typed_ok(t, fsdp_comm_all_gather(c, recv, src, n, dt, "ag"), "all_gather")) goto out;
        for (int p = 0; p < W; p++)
          for (int64_t i = 0; i < n; i++) {
            typed_input(dt, p, i, salt + in_place, want);
            typed_expect(t, dt, in_place ? "all_gather in place" : "all_gather", n, p * n + i,
                         EL(recv, p * n + i), want);
          }
      }
      for (int root = 0; root < W; root++) {
        for (int64_t i = 0; i < n; i++) typed_input(dt, r, i, salt + 2, EL(recv, i));
        if (!typed_ok(t, fsdp_comm_broadcast(c, recv, n, dt, root, "bc"), "broadcast")) goto out;
        for (int64_t i = 0; i < n; i++) {
          typed_input(dt, root, i, salt + 2, want);
          typed_expect(t, dt, "broadcast", n, i, EL(recv, i), want);
        }
      }
      for (int red = FSDP_RED_SUM; di < TYPED_REDUCIBLE && red <= FSDP_RED_MIN; red++) {
        if (!fsdp_comm_reduce_supported(dt, (fsdp_reduce_op)red)) continue;
        int s2 = salt + 3 + red;
        for (int in_place = 0; in_place < 2; in_place++) {
          for (int64_t i = 0; i < n * W; i++) typed_input(dt, r, i, s2, EL(send, i));
          char *out = in_place ? EL(send, r * n) : recv;
          if (!typed_ok(t, fsdp_comm_reduce_scatter(c, out, send, n, dt, (fsdp_reduce_op)red, "rs"),
                        "reduce_scatter"))
            goto out;
          for (int64_t i = 0; i < n; i++) {
            typed_ref_reduce(dt, W, r * n + i, s2, (fsdp_reduce_op)red, want);
            typed_expect(t, dt, in_place ? "reduce_scatter in place" : "reduce_scatter", n, i,
                         EL(out, i), want);
          }
        }
        for (int64_t i = 0; i < n; i++) typed_input(dt, r, i, s2 + 50, EL(recv, i));
        if (!typed_ok(t, fsdp_comm_all_reduce(c, recv, n, dt, (fsdp_reduce_op)red, "ar"),
                      "all_reduce"))
          goto out;
        for (int64_t i = 0; i < n; i++) {
          typed_ref_reduce(dt, W, i, s2 + 50, (fsdp_reduce_op)red, want);
          typed_expect(t, dt, "all_reduce", n, i, EL(recv, i), want);
        }
      }
#undef EL
    out:
      free(send);
      free(recv);
    }
  }
}

#endif
