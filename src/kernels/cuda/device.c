/*
 * device.c — the CUDA device: registration (not yet: the device lands with its allocator).
 */
#include "kernels/cuda/cuda.h"

fsdp_device_i fsdp_device_cuda = {.name = "cuda"};

int fsdp_cuda_register(void) { return FSDP_OK; }

int fsdp_cuda_device(void) { return 0; }
cudaStream_t fsdp_cuda_stream(void) { return 0; }
bool fsdp_cuda_deterministic(void) { return false; }

int fsdp_cuda_check(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return FSDP_OK;
  return fsdp_error("cuda: %s: %s", what, cudaGetErrorString(e));
}

int fsdp_cuda_launched(const char *what) { return fsdp_cuda_check(cudaGetLastError(), what); }

int fsdp_cuda_scratch(void **out, size_t bytes) {
  (void)bytes;
  *out = NULL;
  return fsdp_error("cuda: no allocator yet");
}

void fsdp_cuda_scratch_free(void *p, size_t bytes) { (void)p, (void)bytes; }

int fsdp_cuda_set_deterministic(void *ctx, bool on) {
  (void)ctx, (void)on;
  return FSDP_OK;
}
