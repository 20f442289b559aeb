/*
 * vec_avx2.c — the element-wise kernel bodies (vec_body.h) on 8-lane AVX2 vectors. Only this
 * file is compiled for AVX2 + FMA (the pragma), and isa.c calls it only where the processor
 * has both. ISO C never contracts a * b + c into an FMA (the bodies' fused multiply-adds are
 * written out and are fused at every level), so results equal the other levels'.
 */
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma")
#define FSDP_VW 8
#define FSDP_VEC_TABLE fsdp_cpu_vec_avx2
#include "kernels/cpu/vec_body.h"
#else
#include "kernels/cpu/isa.h"
const fsdp_cpu_vec_i fsdp_cpu_vec_avx2 = {0}; /* never selected off x86 (isa.c) */
#endif
