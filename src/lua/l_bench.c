/*
 * l_bench.c — measurement helpers for bench/ scripts: a wall clock, the cpu's f32 GEMM
 * throughput at a given shape, measured in the same process as the thing being compared, and
 * the time the calling thread's products took through the cpu kernel table.
 *
 * sgemm_gflops calls the cpu's f32 GEMM directly on its own host buffers, on purpose: it is the
 * ceiling of the cpu BLAS that the benchmarks compare a cpu training step against, not a tensor
 * op, so it neither takes tensors nor goes through a device's kernel table.
 */
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

/* sgemm_gflops(M, N, K, seconds = 1) -> GFLOP/s of c (M,N) = a (M,K) @ b (K,N)^T on the calling
 * rank's threads: fsdp_cpu_sgemm_gflops (kernels/cpu/kernels.h), the fastest of its windows. */
static int l_sgemm_gflops(lua_State *L) {
  const int M = (int)luaL_checkinteger(L, 1), N = (int)luaL_checkinteger(L, 2),
            K = (int)luaL_checkinteger(L, 3);
  double gflops;
  if (fsdp_cpu_sgemm_gflops(M, N, K, luaL_optnumber(L, 4, 1.0), &gflops) != FSDP_OK)
    return fsdp_lua_error(L);
  lua_pushnumber(L, gflops);
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
  fsdp_lua_set_number(L, "calls", (lua_Number)calls);
  fsdp_lua_set_number(L, "flops", flops);
  fsdp_lua_set_number(L, "seconds", seconds);
  return 1;
}

static const luaL_Reg funcs[] = {{"clock", l_clock},
                                 {"sgemm_gflops", l_sgemm_gflops},
                                 {"cpu_gemm_stats", l_cpu_gemm_stats},
                                 {NULL, NULL}};

void fsdp_lua_open_bench(lua_State *L) { luaL_register(L, NULL, funcs); }
