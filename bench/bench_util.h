/*
 * bench_util.h — the helpers the C benches share (not a test): a monotonic clock, seeded input
 * buffers, best-of timing of one call and the median of a run of times. Header-only, static
 * inline, so each bench stays one .c file that CMake's glob of bench .c files builds on its own.
 */
#ifndef FSDP_BENCH_UTIL_H
#define FSDP_BENCH_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* Seconds on the monotonic clock. */
static inline double bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* n floats in [-scale/2, scale/2), the same every run (fixed LCG seed); the caller frees. Out of
 * memory ends the bench (prog names it): a bench is a program, not library code. */
static inline float *bench_buf(const char *prog, int64_t n, float scale) {
  float *p = malloc(sizeof(float) * (size_t)n);
  if (!p) {
    fprintf(stderr, "%s: out of memory (%lld floats)\n", prog, (long long)n);
    exit(1);
  }
  uint32_t s = 12345u;
  for (int64_t i = 0; i < n; i++) {
    s = s * 1664525u + 1013904223u;
    p[i] = scale * ((float)(s >> 8) * (1.0f / 16777216.0f) - 0.5f);
  }
  return p;
}

/* Seconds per call: one warm-up call, then at least 3 calls and until min_s seconds have passed;
 * the best call (the least disturbed by a shared machine). */
typedef void (*bench_fn)(void *ctx);
static inline double bench_time_call(bench_fn fn, void *ctx, double min_s) {
  fn(ctx);
  double best = 1e30, start = bench_now();
  int reps = 0;
  while (reps < 3 || bench_now() - start < min_s) {
    double t0 = bench_now();
    fn(ctx);
    double dt = bench_now() - t0;
    best = dt < best ? dt : best;
    reps++;
  }
  return best;
}

/* qsort order of doubles. */
static inline int bench_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Median of x[0..n); sorts x in place. */
static inline double bench_median(double *x, int n) {
  qsort(x, (size_t)n, sizeof *x, bench_cmp_double);
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

#endif
