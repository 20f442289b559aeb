/*
 * rng.c — counter-based random numbers: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel
 * random numbers: as easy as 1, 2, 3", SC 2011), bit-exact with Random123's philox4x32_R(10).
 *
 * Every value is a pure function of (key, element index). Element e of a stream lives in
 * Philox block e / 4, lane e % 4, so any slice [first, first + n) can be generated on its own:
 * a rank materializes only its shard of a parameter and gets exactly the values a one-rank run
 * would have put there, whatever the world size and whatever order tensors are created in.
 * Keys come from hashing (seed, parameter path); nothing here has state.
 *
 * Conversions: uniform takes the top 24 bits of a lane ((x >> 8) * 2^-24, in [0, 1), exact in
 * f32). normal is Box-Muller on lane pairs (0, 1) and (2, 3) of a block: the first lane of a
 * pair gives the radius from u1 = ((x >> 8) + 1) * 2^-24, in (0, 1] so log never sees 0, the
 * second the angle; lane 0/2 gets r cos, lane 1/3 gets r sin. With 24-bit u1 the largest
 * |value| is sqrt(2 ln 2^24) ~ 5.77 std: tails beyond that (probability ~1e-8) are cut.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sincosf (the build defines it for every file) */
#endif
#include <math.h>
#include <stdint.h>

#include "core/core.h"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u /* golden ratio */
#define PHILOX_W1 0xBB67AE85u /* sqrt(3) - 1 */

static inline void philox10(uint32_t out[4], uint32_t c0, uint32_t c1, uint32_t c2,
                            uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; r++) {
    if (r) k0 += PHILOX_W0, k1 += PHILOX_W1; /* key schedule: bump before rounds 2..10 */
    uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
    uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
    uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
    uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
    c1 = (uint32_t)p1;
    c3 = (uint32_t)p0;
    c0 = n0, c2 = n2;
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

void fsdp_philox4x32_10(uint32_t out[4], const uint32_t ctr[4], const uint32_t key[2]) {
  philox10(out, ctr[0], ctr[1], ctr[2], ctr[3], key[0], key[1]);
}

void fsdp_philox4x32(uint32_t out[4], uint64_t key, uint64_t counter) {
  philox10(out, (uint32_t)counter, (uint32_t)(counter >> 32), 0, 0, (uint32_t)key,
           (uint32_t)(key >> 32));
}

/* ---- keys -------------------------------------------------------------------------------- */

/* splitmix64's finalizer: a bijection on 64 bits with full avalanche */
static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t fsdp_rng_key(uint64_t seed, const char *stream) {
  uint64_t h = 0xCBF29CE484222325ull; /* FNV-1a over the stream name */
  for (const unsigned char *p = (const unsigned char *)(stream ? stream : ""); *p; p++)
    h = (h ^ *p) * 0x100000001B3ull;
  /* bijective in h for a fixed seed and in seed for a fixed h: distinct names (or seeds)
   * whose FNV hashes differ never share a key */
  return mix64(mix64(seed + 0x9E3779B97F4A7C15ull) ^ h);
}

uint64_t fsdp_rng_key_mix(uint64_t key, uint64_t value) {
  return mix64(key ^ mix64(value + 0x9E3779B97F4A7C15ull));
}

/* ---- streams ------------------------------------------------------------------------------ */

#define TWO_POW_M24 (1.0f / 16777216.0f)

void fsdp_rng_uniform(float *out, int64_t n, uint64_t key, uint64_t first) {
  const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
  int64_t i = 0;
  uint64_t e = first;
  while (i < n) {
    uint64_t block = e >> 2;
    uint32_t r[4];
    philox10(r, (uint32_t)block, (uint32_t)(block >> 32), 0, 0, k0, k1);
    for (unsigned lane = (unsigned)(e & 3); lane < 4 && i < n; lane++, i++, e++)
      out[i] = (float)(r[lane] >> 8) * TWO_POW_M24;
  }
}

/* The 4 standard normals of one block. */
static inline void normal4(float z[4], uint64_t block, uint32_t k0, uint32_t k1) {
  uint32_t r[4];
  philox10(r, (uint32_t)block, (uint32_t)(block >> 32), 0, 0, k0, k1);
  for (int p = 0; p < 4; p += 2) {
    float u1 = (float)((r[p] >> 8) + 1) * TWO_POW_M24; /* (0, 1] */
    float u2 = (float)(r[p + 1] >> 8) * TWO_POW_M24;   /* [0, 1) */
    float rad = sqrtf(-2.0f * logf(u1));
    float s, c;
    sincosf(6.28318530717958647692f * u2, &s, &c);
    z[p] = rad * c;
    z[p + 1] = rad * s;
  }
}

void fsdp_rng_normal(float *out, int64_t n, uint64_t key, uint64_t first, float mean,
                     float std) {
  const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
  int64_t i = 0;
  uint64_t e = first;
  float z[4];
  while (i < n && (e & 3)) { /* head: the rest of a block another slice started */
    normal4(z, e >> 2, k0, k1);
    for (unsigned lane = (unsigned)(e & 3); lane < 4 && i < n; lane++, i++, e++)
      out[i] = mean + std * z[lane];
  }
  for (; i + 4 <= n; i += 4, e += 4) { /* whole blocks */
    normal4(z, e >> 2, k0, k1);
    out[i] = mean + std * z[0];
    out[i + 1] = mean + std * z[1];
    out[i + 2] = mean + std * z[2];
    out[i + 3] = mean + std * z[3];
  }
  if (i < n) { /* tail */
    normal4(z, e >> 2, k0, k1);
    for (unsigned lane = 0; i < n; lane++, i++) out[i] = mean + std * z[lane];
  }
}
