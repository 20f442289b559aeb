/*
 * isa.c — which instruction set the element-wise kernels use (isa.h): detected once per
 * process on first use (the CPUID bits and the operating system's saved register state, as
 * GCC's __builtin_cpu_supports reports them), or forced by FSDP_CPU_ISA.
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>

#include "core/core.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"

static const char *const names[FSDP_CPU_ISA_COUNT] = {"scalar", "avx2", "avx512"};
static const char *const needs[FSDP_CPU_ISA_COUNT] = {
    "", "AVX2 and FMA", "AVX-512 (F, BW, DQ and VL) with AVX2 and FMA"};

static pthread_once_t once = PTHREAD_ONCE_INIT;
static fsdp_cpu_isa_level best_level;
static bool bf16_round; /* the AVX-512 level takes fsdp_cpu_vec_avx512bf16 */
static int level; /* read by every kernel call: relaxed atomics */
static char env_error[256]; /* FSDP_CPU_ISA's error, "" when it was fine */

static fsdp_cpu_isa_level detect(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return FSDP_CPU_ISA_AVX512;
  if (avx2) return FSDP_CPU_ISA_AVX2;
#endif
  return FSDP_CPU_ISA_SCALAR;
}

/* FSDP_CPU_ISA's rules; the message goes to err, not to the caller's error slot */
static int parse(const char *value, fsdp_cpu_isa_level best, fsdp_cpu_isa_level *out,
                 char *err, size_t errn) {
  *out = best;
  if (!value || !*value) return FSDP_OK;
  for (int l = 0; l < FSDP_CPU_ISA_COUNT; l++) {
    if (strcasecmp(value, names[l]) != 0) continue;
    if (l > (int)best) {
      snprintf(err, errn, "FSDP_CPU_ISA=%s: this processor lacks %s (its best is %s)", value,
               needs[l], names[best]);
      return FSDP_ERR;
    }
    *out = (fsdp_cpu_isa_level)l;
    return FSDP_OK;
  }
  snprintf(err, errn, "FSDP_CPU_ISA='%.64s': unknown instruction set (avx512, avx2 or scalar)",
           value);
  return FSDP_ERR;
}

static void init(void) {
  best_level = detect();
#if defined(__x86_64__) || defined(__i386__)
  bf16_round = best_level == FSDP_CPU_ISA_AVX512 && __builtin_cpu_supports("avx512bf16");
#endif
  fsdp_cpu_isa_level l;
  if (parse(getenv("FSDP_CPU_ISA"), best_level, &l, env_error, sizeof env_error) != FSDP_OK)
    l = best_level; /* the kernels keep working; fsdp_cpu_isa_check reports the error */
  __atomic_store_n(&level, (int)l, __ATOMIC_RELAXED);
}

fsdp_cpu_isa_level fsdp_cpu_isa(void) {
  pthread_once(&once, init);
  return (fsdp_cpu_isa_level)__atomic_load_n(&level, __ATOMIC_RELAXED);
}

fsdp_cpu_isa_level fsdp_cpu_isa_best(void) {
  pthread_once(&once, init);
  return best_level;
}

const char *fsdp_cpu_isa_name(fsdp_cpu_isa_level l) {
  return (unsigned)l < FSDP_CPU_ISA_COUNT ? names[l] : "?";
}

int fsdp_cpu_isa_set(fsdp_cpu_isa_level l) {
  pthread_once(&once, init);
  if ((unsigned)l >= FSDP_CPU_ISA_COUNT)
    return fsdp_error("cpu instruction set %d: no such level", (int)l);
  if (l > best_level)
    return fsdp_error("cpu instruction set %s: this processor lacks %s (its best is %s)",
                      names[l], needs[l], names[best_level]);
  __atomic_store_n(&level, (int)l, __ATOMIC_RELAXED);
  return FSDP_OK;
}

int fsdp_cpu_isa_parse(const char *value, fsdp_cpu_isa_level best, fsdp_cpu_isa_level *out) {
  char err[256];
  if (parse(value, best, out, err, sizeof err) != FSDP_OK) return fsdp_error("%s", err);
  return FSDP_OK;
}

const char *fsdp_cpu_isa_current(void) { return names[fsdp_cpu_isa()]; }

int fsdp_cpu_isa_check(void) {
  pthread_once(&once, init);
  return env_error[0] ? fsdp_error("%s", env_error) : FSDP_OK;
}

const fsdp_cpu_vec_i *fsdp_cpu_vec(void) {
  static const fsdp_cpu_vec_i *const tables[FSDP_CPU_ISA_COUNT] = {
      &fsdp_cpu_vec_scalar, &fsdp_cpu_vec_avx2, &fsdp_cpu_vec_avx512};
  fsdp_cpu_isa_level l = fsdp_cpu_isa(); /* (runs init) */
  return l == FSDP_CPU_ISA_AVX512 && bf16_round ? &fsdp_cpu_vec_avx512bf16 : tables[l];
}
