/*
 * att_bf16.c — the bf16 attention's products on AVX512_BF16's dot products (VDPBF16PS): each
 * instruction multiplies 16 pairs of bf16 by 16 pairs and adds both products of a pair into an
 * f32 lane, twice the f32 rate of a fused multiply-add. Only this file is compiled for AVX512_BF16
 * (the pragma); attention_bf16.c calls it where fsdp_cpu_att_bf16_supported() says so.
 *
 * A pair is two bf16 elements adjacent along the sum (k, k + 1), read as one 32-bit word (the
 * element at k in its low half). a's pairs are broadcast, one row at a time; b is read in
 * vectors of 16 pairs, so it must be laid out as (K / 2, N) words: the two rows k and k + 1 of b
 * interleaved (fsdp_cpu_att_bf16_interleave), or, where b is the transpose of a row-major
 * (N, K) operand, that operand's words transposed (its rows hold the pairs already: a 32-bit
 * transpose, isa.h's att_pack). The same holds for a transposed a: a^T's pairs are the
 * interleave of two rows of a.
 */
#include "kernels/cpu/half.h"
#include "kernels/cpu/isa.h"

#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")
#include <immintrin.h>

bool fsdp_cpu_att_bf16_supported(void) {
  return fsdp_cpu_isa() == FSDP_CPU_ISA_AVX512 && __builtin_cpu_supports("avx512bf16");
}

/* Register blocks of MR rows by NV vectors of 16 lanes: 24 accumulators of the 32 registers,
 * with room for b's 4 vectors and a broadcast (the f32 kernel's blocks, isa.h's att_mm). */
#define MR 6
#define NV 4

static inline __m512i pair_at(const uint16_t *p) {
  uint32_t w;
  memcpy(&w, p, sizeof w);
  return _mm512_set1_epi32((int)w);
}

/* One block: rows [0, mr) by vectors [0, nz) of c over kp pairs; with `tail` the last vector
 * holds `last` columns (stores masked; b is read whole: its rows are padded). mr, nz and tail
 * are constants at every call (block_any), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void block(
    const int mr, const int nz, const bool tail, int last, int kp, const uint16_t *a,
    int64_t sam, int64_t sap, const uint32_t *b, int64_t ldb, void *c, int64_t ldc, bool cbf16,
    float alpha, bool acc) {
  __m512 s[MR][NV];
  for (int m = 0; m < mr; m++)
    for (int z = 0; z < nz; z++) s[m][z] = _mm512_setzero_ps();
  for (int p = 0; p < kp; p++) {
    const uint32_t *bp = b + p * ldb;
    __m512i bv[NV];
    for (int z = 0; z < nz; z++) bv[z] = _mm512_loadu_si512(bp + z * 16);
    const uint16_t *ap = a + p * sap;
    for (int m = 0; m < mr; m++) {
      const __m512i av = pair_at(ap + m * sam);
      for (int z = 0; z < nz; z++)
        s[m][z] = _mm512_dpbf16_ps(s[m][z], (__m512bh)av, (__m512bh)bv[z]);
    }
  }
  const __m512 al = _mm512_set1_ps(alpha);
  const __mmask16 lm = tail ? (__mmask16)((1u << last) - 1) : (__mmask16)0xffff;
  for (int m = 0; m < mr; m++)
    for (int z = 0; z < nz; z++) {
      const __mmask16 k = tail && z == nz - 1 ? lm : (__mmask16)0xffff;
      __m512 r = _mm512_mul_ps(s[m][z], al);
      if (cbf16) {
        uint16_t *cp = (uint16_t *)c + m * ldc + z * 16;
        if (acc) {
          const __m512i old = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, cp));
          r = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(old, 16)), r);
        }
        _mm256_mask_storeu_epi16(cp, k, (__m256i)_mm512_cvtneps_pbh(r));
      } else {
        float *cp = (float *)c + m * ldc + z * 16;
        if (acc) r = _mm512_add_ps(_mm512_maskz_loadu_ps(k, cp), r);
        _mm512_mask_storeu_ps(cp, k, r);
      }
    }
}

static void block_any(int mr, int nz, bool tail, int last, int kp, const uint16_t *a,
                      int64_t sam, int64_t sap, const uint32_t *b, int64_t ldb, void *c,
                      int64_t ldc, bool cbf16, float alpha, bool acc) {
#define B_(m, z, t) block(m, z, t, last, kp, a, sam, sap, b, ldb, c, ldc, cbf16, alpha, acc)
#define Z_(m, z) \
  case ((m) * NV + (z) - 1) * 2: B_(m, z, false); break; \
  case ((m) * NV + (z) - 1) * 2 + 1: B_(m, z, true); break;
#define M_(m) Z_(m, 1) Z_(m, 2) Z_(m, 3) Z_(m, 4)
  switch ((mr * NV + nz - 1) * 2 + tail) {
    M_(1) M_(2) M_(3) M_(4) M_(5) M_(6)
  default: break; /* mr in [1, MR], nz in [1, NV] by construction */
  }
#undef B_
#undef Z_
#undef M_
}

void fsdp_cpu_att_bf16_mm(void *c, int64_t ldc, bool cbf16, const uint16_t *a, int64_t sam,
                          int64_t sap, const uint32_t *b, int64_t ldb, int M, int N, int K,
                          int diag, int kind, float alpha, bool acc) {
  const int NR = NV * 16;
  const size_t csize = cbf16 ? 2 : 4;
  for (int m0 = 0; m0 < M; m0 += MR) {
    const int mr = M - m0 < MR ? M - m0 : MR;
    /* the f32 kernel's bounds in whole pairs: a pair a bound cuts holds a zero in a outside it */
    int n1, k0, k1;
    fsdp_cpu_att_bounds(kind, m0, mr, diag, N, K, 16, &n1, &k0, &k1);
    const int p0 = k0 / 2, p1 = (k1 + 1) / 2;
    for (int n0 = 0; n0 < n1; n0 += NR) {
      const int w = n1 - n0 < NR ? n1 - n0 : NR, nz = (w + 15) / 16;
      const int last = w - (nz - 1) * 16;
      block_any(mr, nz, last != 16, last, p1 - p0, a + m0 * sam + p0 * sap, sam, sap,
                b + p0 * ldb + n0, ldb, (char *)c + ((size_t)m0 * ldc + n0) * csize, ldc, cbf16,
                alpha, acc);
    }
  }
}

void fsdp_cpu_att_bf16_interleave(uint32_t *dst, int64_t ldd, const uint16_t *src, int64_t lds,
                                  int rows, int cols) {
  const int wide = (cols + 15) / 16 * 16;
  for (int r = 0; r < rows; r += 2) {
    const uint16_t *x = src + r * lds, *y = r + 1 < rows ? x + lds : NULL;
    uint32_t *d = dst + (r / 2) * ldd;
    for (int c = 0; c < wide; c += 16) {
      const __mmask16 k = cols - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (cols - c)) - 1);
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, x + c));
      const __m512i hi = y ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, y + c))
                           : _mm512_setzero_si512();
      _mm512_storeu_si512(d + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

#else
bool fsdp_cpu_att_bf16_supported(void) { return false; }
void fsdp_cpu_att_bf16_mm(void *c, int64_t ldc, bool cbf16, const uint16_t *a, int64_t sam,
                          int64_t sap, const uint32_t *b, int64_t ldb, int M, int N, int K,
                          int diag, int kind, float alpha, bool acc) {
  (void)c, (void)ldc, (void)cbf16, (void)a, (void)sam, (void)sap, (void)b, (void)ldb, (void)M;
  (void)N, (void)K, (void)diag, (void)kind, (void)alpha, (void)acc;
}
void fsdp_cpu_att_bf16_interleave(uint32_t *dst, int64_t ldd, const uint16_t *src, int64_t lds,
                                  int rows, int cols) {
  (void)dst, (void)ldd, (void)src, (void)lds, (void)rows, (void)cols;
}
#endif
