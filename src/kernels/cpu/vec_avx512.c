/*
 * vec_avx512.c — the element-wise kernel bodies (vec_body.h) on 16-lane AVX-512 vectors
 * (F, BW, DQ, VL). Only this file is compiled for AVX-512 (the pragma), and isa.c calls it
 * only where the processor and the operating system support it.
 */
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,prefer-vector-width=512")
#define FSDP_VW 16
#define FSDP_VEC_TABLE fsdp_cpu_vec_avx512
#include "kernels/cpu/vec_body.h"
#else
#include "kernels/cpu/isa.h"
const fsdp_cpu_vec_i fsdp_cpu_vec_avx512 = {0}; /* never selected off x86 (isa.c) */
#endif
