/*
 * cuda_stub.c — compiled when the CUDA device is not (no CUDA toolkit, or -DFSDP_CUDA=OFF):
 * registration does nothing, so "cuda" is an unknown device and fsdp.device_count("cuda") is 0.
 * Nothing above src/kernels changes.
 */
#include "core/core.h"

int fsdp_cuda_register(void);
int fsdp_cuda_register(void) { return FSDP_OK; }
