/*
 * thread.h — the part of the cuda device's per-thread state other layers may use: the calling
 * rank thread's GPU and compute stream. The nccl backend (src/comm/nccl.c) orders its
 * communication stream against the compute stream with events, so neither waits on the host.
 * Everything else of the device is private to src/kernels/cuda (cuda.h).
 */
#ifndef FSDP_KERNELS_CUDA_THREAD_H
#define FSDP_KERNELS_CUDA_THREAD_H

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The calling thread's GPU index (its binding: local rank % GPUs; 0 when never bound). */
int fsdp_cuda_device(void);
/* The calling thread's compute stream, created on first use on its GPU (which it also selects);
 * 0 with the error set when that fails. */
cudaStream_t fsdp_cuda_stream(void);

#ifdef __cplusplus
}
#endif

#endif
