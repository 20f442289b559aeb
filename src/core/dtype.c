/*
 * dtype.c — element types: sizes, names, and scalar conversions between them.
 *
 * The f32 <-> bf16 / f16 conversions here are the reference the kernels' bulk conversions are
 * tested against: round to nearest even, NaN kept (quiet), infinities kept, f16 subnormals
 * handled exactly. They work on bit patterns, so they do not depend on the FPU's rounding mode
 * or on a compiler's _Float16 support.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"

static const struct {
  const char *name;
  size_t size;
} table[FSDP_DTYPE_COUNT] = {
    [FSDP_DTYPE_F32] = {"f32", 4}, [FSDP_DTYPE_BF16] = {"bf16", 2},
    [FSDP_DTYPE_F16] = {"f16", 2}, [FSDP_DTYPE_F64] = {"f64", 8},
    [FSDP_DTYPE_I64] = {"i64", 8}, [FSDP_DTYPE_I32] = {"i32", 4},
    [FSDP_DTYPE_U8] = {"u8", 1},   [FSDP_DTYPE_BOOL] = {"bool", 1},
};

size_t fsdp_dtype_size(fsdp_dtype dt) {
  return (unsigned)dt < FSDP_DTYPE_COUNT ? table[dt].size : 0;
}

const char *fsdp_dtype_name(fsdp_dtype dt) {
  return (unsigned)dt < FSDP_DTYPE_COUNT ? table[dt].name : "?";
}

bool fsdp_dtype_is_float(fsdp_dtype dt) {
  return dt == FSDP_DTYPE_F32 || dt == FSDP_DTYPE_BF16 || dt == FSDP_DTYPE_F16 ||
         dt == FSDP_DTYPE_F64;
}

int fsdp_dtype_parse(const char *name, fsdp_dtype *out) {
  static const struct {
    const char *alias;
    fsdp_dtype dt;
  } aliases[] = {
      {"float32", FSDP_DTYPE_F32}, {"float", FSDP_DTYPE_F32},    {"bfloat16", FSDP_DTYPE_BF16},
      {"float16", FSDP_DTYPE_F16}, {"half", FSDP_DTYPE_F16},     {"float64", FSDP_DTYPE_F64},
      {"double", FSDP_DTYPE_F64},  {"int64", FSDP_DTYPE_I64},    {"long", FSDP_DTYPE_I64},
      {"int32", FSDP_DTYPE_I32},   {"int", FSDP_DTYPE_I32},      {"uint8", FSDP_DTYPE_U8},
  };
  if (name) {
    for (int i = 0; i < FSDP_DTYPE_COUNT; i++)
      if (strcmp(name, table[i].name) == 0) return *out = (fsdp_dtype)i, FSDP_OK;
    for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
      if (strcmp(name, aliases[i].alias) == 0) return *out = aliases[i].dt, FSDP_OK;
  }
  return fsdp_error("unknown dtype '%s' (valid: f32, bf16, f16, f64, i64, i32, u8, bool)",
                    name ? name : "(null)");
}

/* ---- bf16 / f16 ---------------------------------------------------------------------------- */

static uint32_t f32_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

static float bits_f32(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

uint16_t fsdp_f32_to_bf16(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even; overflow rounds up to inf */
  return (uint16_t)(u >> 16);
}

float fsdp_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t fsdp_f32_to_f16(float x) {
  uint32_t u = f32_bits(x);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
  if (a < 0x38800000u) {                                 /* below 2^-14: f16 subnormal */
    if (a < 0x33000000u) return sign;                    /* below half the smallest: 0 */
    /* the value is m * 2^(e-150) with an implicit bit; a subnormal f16 counts 2^-24 units */
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    int shift = 126 - (int)(a >> 23); /* 14..24: how far m must move to count 2^-24 units */
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
  }
  /* normal: rebias the exponent (127 -> 15) and round the mantissa from 23 to 10 bits */
  uint32_t r = a - 0x38000000u;
  r += 0xfffu + ((r >> 13) & 1u);
  return (uint16_t)(sign | (r >> 13));
}

float fsdp_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13)); /* inf, NaN */
  if (e == 0) { /* zero or subnormal: m * 2^-24, exact in f32 */
    float v = (float)m * 0x1p-24f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* ---- single elements ------------------------------------------------------------------------ */

double fsdp_dtype_load(const void *buf, fsdp_dtype dt, int64_t i) {
  switch (dt) {
  case FSDP_DTYPE_F32: return ((const float *)buf)[i];
  case FSDP_DTYPE_BF16: return fsdp_bf16_to_f32(((const uint16_t *)buf)[i]);
  case FSDP_DTYPE_F16: return fsdp_f16_to_f32(((const uint16_t *)buf)[i]);
  case FSDP_DTYPE_F64: return ((const double *)buf)[i];
  case FSDP_DTYPE_I64: return (double)((const int64_t *)buf)[i];
  case FSDP_DTYPE_I32: return ((const int32_t *)buf)[i];
  case FSDP_DTYPE_U8: return ((const uint8_t *)buf)[i];
  case FSDP_DTYPE_BOOL: return ((const uint8_t *)buf)[i] != 0;
  default: return NAN;
  }
}

/* v truncated toward zero and clamped to [lo, hi]; NaN -> 0 */
static double to_int(double v, double lo, double hi) {
  if (v != v) return 0;
  v = trunc(v);
  return v < lo ? lo : v > hi ? hi : v;
}

void fsdp_dtype_store(void *buf, fsdp_dtype dt, int64_t i, double v) {
  switch (dt) {
  case FSDP_DTYPE_F32: ((float *)buf)[i] = (float)v; break;
  case FSDP_DTYPE_BF16: ((uint16_t *)buf)[i] = fsdp_f32_to_bf16((float)v); break;
  case FSDP_DTYPE_F16: ((uint16_t *)buf)[i] = fsdp_f32_to_f16((float)v); break;
  case FSDP_DTYPE_F64: ((double *)buf)[i] = v; break;
  case FSDP_DTYPE_I64: {
    /* 2^63 is not an int64: clamp just below it */
    double c = to_int(v, -9223372036854775808.0, 9223372036854774784.0);
    ((int64_t *)buf)[i] = (int64_t)c;
    break;
  }
  case FSDP_DTYPE_I32: ((int32_t *)buf)[i] = (int32_t)to_int(v, -2147483648.0, 2147483647.0); break;
  case FSDP_DTYPE_U8: ((uint8_t *)buf)[i] = (uint8_t)to_int(v, 0, 255); break;
  case FSDP_DTYPE_BOOL: ((uint8_t *)buf)[i] = v != 0; break;
  default: break;
  }
}
