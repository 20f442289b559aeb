/*
 * pool.h — private to src/kernels/cuda: the caching allocator behind the cuda device (alloc.c).
 * It includes no CUDA header (streams are opaque pointers, raw memory comes from a backend), so
 * tests/c can drive it with a fake backend on a machine without a GPU.
 *
 * Blocks are handed out per (GPU, stream). Requests up to 1 MiB are rounded up to 512 bytes and
 * carved out of 2 MiB segments; larger ones are rounded up to 2 MiB and get a segment of their
 * own when no cached block fits. A freed block is cached for its stream: the next request on
 * that stream may reuse it at once, because the stream runs in order (the kernels that used it
 * are queued before the ones that get it next), so nothing synchronizes. Cached neighbours in a
 * segment are merged; a cached block bigger than a request is split. The backend's malloc runs
 * only when no cached block fits; when it reports out of memory, the pool waits for the GPU,
 * gives every wholly cached segment back and retries once.
 */
#ifndef FSDP_KERNELS_CUDA_POOL_H
#define FSDP_KERNELS_CUDA_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define FSDP_CUDA_MAX_GPUS 64
/* The stream tag of a cached block any stream may take: its stream has finished with it
 * (fsdp_cuda_pool_retire_stream). Never a real stream handle. */
#define FSDP_CUDA_STREAM_IDLE ((void *)(uintptr_t)1)

/* Raw device memory, for the pool (alloc.c has the CUDA one). */
typedef struct fsdp_cuda_pool_backend {
  /* FSDP_OK, or FSDP_ERR with an error message; *oom says the device was out of memory */
  int (*malloc)(int gpu, void **out, size_t bytes, bool *oom);
  void (*free)(int gpu, void *p);
  /* wait until the GPU has finished everything queued on it (before memory leaves the pool) */
  int (*synchronize)(int gpu);
  /* free and total bytes of the GPU, for the out-of-memory message (may be NULL) */
  void (*info)(int gpu, size_t *free_bytes, size_t *total_bytes);
} fsdp_cuda_pool_backend;

/* What the pool holds on one GPU, as torch.cuda.memory_stats names it: allocated = bytes of
 * blocks handed out (rounded sizes), requested = the bytes asked for, reserved = bytes of
 * segments taken from the device (allocated + cached). Peaks since the last reset. */
typedef struct fsdp_cuda_mem_stats {
  int64_t allocated, allocated_peak;
  int64_t requested, requested_peak;
  int64_t reserved, reserved_peak;
  int64_t blocks;       /* blocks handed out now */
  int64_t segments;     /* segments held now */
  int64_t allocs;       /* allocations served, in total */
  int64_t device_mallocs, device_frees; /* segments taken from / given back to the device */
  int64_t retries;      /* allocations that succeeded after emptying the cache */
  int64_t ooms;         /* allocations that failed even after it */
} fsdp_cuda_mem_stats;

/* A block of at least `bytes` (0 gives a real block) on GPU `gpu` for `stream`. FSDP_ERR with
 * "cuda: out of memory ..." (naming the request, the GPU and what the pool holds) when the
 * device has no room even after emptying the cache. */
int fsdp_cuda_pool_alloc(int gpu, void *stream, size_t bytes, void **out);
/* Give a block back (from any thread); NULL is a no-op. */
void fsdp_cuda_pool_free(void *p);
/* `stream` (on gpu) is about to be destroyed and has finished all its work: the blocks tagged
 * with it, cached or in use, become free for any stream once cached. */
void fsdp_cuda_pool_retire_stream(int gpu, void *stream);
/* Give every wholly cached segment of `gpu` (-1: every GPU) back to the device, after waiting
 * for the GPU. FSDP_ERR if waiting failed (nothing is freed then). */
int fsdp_cuda_empty_cache(int gpu);
/* The statistics of one GPU; FSDP_ERR when gpu is out of range. */
int fsdp_cuda_memory_stats(int gpu, fsdp_cuda_mem_stats *out);
/* Peaks back to the current values (-1: every GPU). */
void fsdp_cuda_memory_reset_peak(int gpu);
/* Tests: use another backend (NULL: CUDA's). Only while the pool holds nothing: it forgets
 * its state (statistics included). */
void fsdp_cuda_pool_set_backend(const fsdp_cuda_pool_backend *b);

#endif
