/*
 * blas.h — private to src/kernels/cuda: the switches of the cuBLASLt GEMMs (blas.cu).
 */
#ifndef FSDP_KERNELS_CUDA_BLAS_H
#define FSDP_KERNELS_CUDA_BLAS_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* TF32 for f32 GEMMs (matmul, linear, bmm on f32 tensors): off by default, so f32 products are
 * exact f32 (CUBLAS_COMPUTE_32F) and match the cpu; on, cuBLASLt may round the inputs to TF32
 * (10-bit mantissa, CUBLAS_COMPUTE_32F_FAST_TF32) for several times the speed. Process-wide,
 * read at every GEMM call; returns the previous setting. bf16 and f16 GEMMs are unaffected. */
bool fsdp_cuda_set_tf32(bool on);
bool fsdp_cuda_tf32(void);

#ifdef __cplusplus
}
#endif

#endif
