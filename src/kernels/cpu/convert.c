/*
 * convert.c — bulk dtype conversions on the cpu. The narrowing loops are branch-free integer
 * arithmetic on the bit patterns (the same rounding as core's fsdp_f32_to_bf16, which the tests
 * compare them with), so they vectorise; the widening ones are shifts. f32 -> bf16 takes the
 * processor's own instruction where it has AVX512_BF16 (below), with the same bits.
 *
 * Mixed precision runs a conversion pass around every f32 kernel a bf16 op calls, so these are
 * on the hot path: they are compiled for AVX-512 and AVX2 next to the baseline and the loader
 * picks the version for the processor it runs on (target_clones), and a long conversion is split
 * over the rank's threads (pool.h): run on the calling thread alone, it left the other core idle
 * through a tenth of a bf16 step. Each element converts on its own: the same bits at any count.
 */
#include <stdbool.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"

#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

CLONES void fsdp_cpu_bf16_to_f32(float *out, const uint16_t *in, int64_t n) {
  uint32_t *o = (uint32_t *)out;
  for (int64_t i = 0; i < n; i++) o[i] = (uint32_t)in[i] << 16;
}

CLONES static void f32_to_bf16_int(uint16_t *out, const float *in, int64_t n) {
  const uint32_t *u = (const uint32_t *)in;
  for (int64_t i = 0; i < n; i++) {
    uint32_t x = u[i];
    uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    uint32_t q = (x >> 16) | 0x40u; /* NaN: keep sign and payload top, make it quiet */
    out[i] = (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? q : r);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
/* AVX512_BF16's VCVTNEPS2BF16 narrows 16 lanes in one instruction with the same rounding (to
 * nearest even; a NaN keeps its sign and top payload bits and is made quiet) except that it
 * reads subnormal inputs as zero. A vector holding a subnormal (rare in training data: below
 * 1.2e-38; isa.h's fsdp_cpu_subnormal16) goes through the integer loop, so the bits are the
 * same. Measured on 64 K - 512 K elements (in cache, where the conversion pass works): 0.08
 * against 0.15 ns an element. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void
f32_to_bf16_hw(uint16_t *out, const float *in, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 x = _mm512_loadu_ps(in + i);
    if (__builtin_expect(fsdp_cpu_subnormal16(_mm512_castps_si512(x)) != 0, 0))
      f32_to_bf16_int(out + i, in + i, 16);
    else
      _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(x));
  }
  if (i < n) f32_to_bf16_int(out + i, in + i, n - i);
}

/* The instruction is used at the AVX-512 level only (FSDP_CPU_ISA=avx2 or scalar tests the
 * integer loop on the same processor). */
static bool hw_bf16(void) {
  return fsdp_cpu_isa() == FSDP_CPU_ISA_AVX512 && __builtin_cpu_supports("avx512bf16");
}
#else
static void f32_to_bf16_hw(uint16_t *out, const float *in, int64_t n) {
  f32_to_bf16_int(out, in, n);
}
static bool hw_bf16(void) { return false; }
#endif

void fsdp_cpu_f32_to_bf16(uint16_t *out, const float *in, int64_t n) {
  if (n >= 16 && hw_bf16())
    f32_to_bf16_hw(out, in, n);
  else
    f32_to_bf16_int(out, in, n);
}

void fsdp_cpu_f16_to_f32(float *out, const uint16_t *in, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = fsdp_f16_to_f32(in[i]);
}

void fsdp_cpu_f32_to_f16(uint16_t *out, const float *in, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = fsdp_f32_to_f16(in[i]);
}

static void cast_serial(void *out, fsdp_dtype odt, const void *in, fsdp_dtype idt, int64_t n) {
  if (odt == idt) {
    memmove(out, in, (size_t)n * fsdp_dtype_size(odt));
    return;
  }
  if (idt == FSDP_DTYPE_F32) {
    if (odt == FSDP_DTYPE_BF16) return fsdp_cpu_f32_to_bf16(out, in, n);
    if (odt == FSDP_DTYPE_F16) return fsdp_cpu_f32_to_f16(out, in, n);
  }
  if (odt == FSDP_DTYPE_F32) {
    if (idt == FSDP_DTYPE_BF16) return fsdp_cpu_bf16_to_f32(out, in, n);
    if (idt == FSDP_DTYPE_F16) return fsdp_cpu_f16_to_f32(out, in, n);
  }
  /* everything else element by element through double (exact for every dtype but i64 values
   * beyond 2^53, which then round) */
  if (odt == FSDP_DTYPE_I64 && idt == FSDP_DTYPE_I32) {
    for (int64_t i = 0; i < n; i++) ((int64_t *)out)[i] = ((const int32_t *)in)[i];
    return;
  }
  for (int64_t i = 0; i < n; i++) fsdp_dtype_store(out, odt, i, fsdp_dtype_load(in, idt, i));
}

typedef struct {
  void *out;
  const void *in;
  fsdp_dtype odt, idt;
} cast_ctx;

static void cast_task(void *ctx, int64_t lo, int64_t hi) {
  const cast_ctx *c = ctx;
  cast_serial((char *)c->out + (size_t)lo * fsdp_dtype_size(c->odt), c->odt,
              (const char *)c->in + (size_t)lo * fsdp_dtype_size(c->idt), c->idt, hi - lo);
}

void fsdp_cpu_cast(void *out, fsdp_dtype odt, const void *in, fsdp_dtype idt, int64_t n) {
  const char *o = out, *i = in;
  const bool overlap = o < i + (size_t)n * fsdp_dtype_size(idt) &&
                       i < o + (size_t)n * fsdp_dtype_size(odt);
  if (n < 2 * FSDP_CPU_GRAIN_HEAVY || odt == idt || overlap) {
    /* short; a copy (memmove is at memory speed already); or in place, where one chunk would
     * overwrite what another has yet to read */
    cast_serial(out, odt, in, idt, n);
    return;
  }
  cast_ctx c = {.out = out, .in = in, .odt = odt, .idt = idt};
  fsdp_cpu_parallel_for(n, FSDP_CPU_GRAIN_HEAVY, cast_task, &c);
}
