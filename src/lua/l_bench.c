/*
 * l_bench.c — measurement helpers for bench/ scripts: a wall clock, the cpu's f32 GEMM
 * throughput at a given shape, measured in the same process as the thing being compared, and
 * the time the calling thread's products took through the cpu kernel table.
 *
 * sgemm_gflops calls the cpu's f32 GEMM directly on its own host buffers, on purpose: it is the
 * ceiling of the cpu BLAS that the benchmarks compare a cpu training step against, not a tensor
 * op, so it neither takes tensors nor goes through a device's kernel table.
 */
#include <stdlib.h>
#include <time.h>

#include "kernels/cpu/kernels.h"
#include "lua/binding.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int l_clock(lua_State *L) {
  lua_pushnumber(L, now());
  return 1;
}

/* sgemm_gflops(M, N, K, seconds) -> GFLOP/s of c (M,N) = a (M,K) @ b (K,N)^T, split over the
 * calling rank's threads like every GEMM (kernels/cpu/pool.h): after one warm-up call, calls for
 * at least `seconds` in SGEMM_WINDOWS windows of equal length, and the fastest window's rate. On
 * a shared machine the other tenants' work only ever lowers a measured rate, so the fastest
 * window is the closest to what the GEMM can do here (one average over the whole time moved by
 * 2x between runs of the same binary). */
#define SGEMM_WINDOWS 5

static int l_sgemm_gflops(lua_State *L) {
  int M = (int)luaL_checkinteger(L, 1), N = (int)luaL_checkinteger(L, 2),
      K = (int)luaL_checkinteger(L, 3);
  double secs = luaL_optnumber(L, 4, 1.0);
  if (M <= 0 || N <= 0 || K <= 0) luaL_error(L, "sgemm_gflops: sizes must be positive");
  float *a = calloc((size_t)M * K, sizeof(float)), *b = calloc((size_t)K * N, sizeof(float)),
        *c = calloc((size_t)M * N, sizeof(float));
  if (!a || !b || !c) {
    free(a), free(b), free(c);
    return luaL_error(L, "sgemm_gflops: out of memory");
  }
  for (size_t i = 0; i < (size_t)M * K; i++) a[i] = (float)(i % 7) * 0.1f;
  for (size_t i = 0; i < (size_t)K * N; i++) b[i] = (float)(i % 5) * 0.1f;
  fsdp_cpu_gemm(c, a, b, M, N, K, false, true, 1.0f, 0.0f, K, K, N);
  double best = 0.0;
  for (int w = 0; w < SGEMM_WINDOWS; w++) {
    int iters = 0;
    double t0 = now(), t;
    do {
      fsdp_cpu_gemm(c, a, b, M, N, K, false, true, 1.0f, 0.0f, K, K, N);
      iters++;
      t = now() - t0;
    } while (t < secs / SGEMM_WINDOWS);
    double rate = 2.0 * M * N * K * iters / t / 1e9;
    if (rate > best) best = rate;
  }
  free(a), free(b), free(c);
  lua_pushnumber(L, best);
  return 1;
}

/* cpu_gemm_stats() -> {calls =, flops =, seconds =}: the calling rank thread's matrix products
 * through the cpu kernel table so far (kernels/cpu/kernels.h, fsdp_cpu_gemm_stats); a bench takes
 * the difference over its timed steps. */
static int l_cpu_gemm_stats(lua_State *L) {
  int64_t calls;
  double flops, seconds;
  fsdp_cpu_gemm_stats(&calls, &flops, &seconds);
  lua_createtable(L, 0, 3);
  lua_pushnumber(L, (lua_Number)calls);
  lua_setfield(L, -2, "calls");
  lua_pushnumber(L, flops);
  lua_setfield(L, -2, "flops");
  lua_pushnumber(L, seconds);
  lua_setfield(L, -2, "seconds");
  return 1;
}

static const luaL_Reg funcs[] = {{"clock", l_clock},
                                 {"sgemm_gflops", l_sgemm_gflops},
                                 {"cpu_gemm_stats", l_cpu_gemm_stats},
                                 {NULL, NULL}};

void fsdp_lua_open_bench(lua_State *L) { luaL_register(L, NULL, funcs); }
