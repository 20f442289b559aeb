/*
 * vec_avx512bf16.c — the AVX-512 bodies (vec_body.h) again, on processors that also have
 * AVX512_BF16: their bf16 stores round with VCVTNEPS2BF16 (vmath.h's fsdp_vh_round, same
 * bits). isa.c takes this table for the AVX-512 level where the processor has the instruction,
 * vec_avx512.c's elsewhere; the f32 bodies are the same code in both.
 */
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,prefer-vector-width=512")
#define FSDP_VW 16
#if !defined(__clang__) /* the intrinsic's vector type casts as GCC allows */
#define FSDP_VH_HW 1
#endif
#define FSDP_VEC_TABLE fsdp_cpu_vec_avx512bf16
#include "kernels/cpu/vec_body.h"
#else
#include "kernels/cpu/isa.h"
const fsdp_cpu_vec_i fsdp_cpu_vec_avx512bf16 = {0}; /* never selected off x86 (isa.c) */
#endif
