/*
 * vec_scalar.c — the element-wise kernel bodies (vec_body.h) for the build's baseline target:
 * 4-lane vectors (SSE2 on x86-64), the level every processor runs (FSDP_CPU_ISA=scalar).
 */
#define FSDP_VW 4
#define FSDP_VEC_TABLE fsdp_cpu_vec_scalar
#include "kernels/cpu/vec_body.h"
