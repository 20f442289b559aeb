/*
 * device.c — the cuda device: its table (fsdp_device_cuda), registration, and the state each
 * thread keeps on its GPU.
 *
 * Threads: every thread that touches the device has one record (thread-local, created on first
 * use): its GPU (local rank % GPU count, set by bind; GPU 0 for a thread that was never bound),
 * its compute stream (created on first use, non-blocking: it never waits for the legacy
 * default stream), and two pinned staging buffers for host copies (cuBLASLt's handles are
 * blas.cu's). Rank threads come and go (src/host): a pthread key destructor waits for the
 * thread's stream, gives its blocks to the allocator as free for any stream, and destroys the
 * stream and the buffers.
 *
 * Host copies: to_host copies through the staging buffers chunk by chunk (the GPU fills one
 * while the host empties the other) and returns when the bytes are in host memory. from_host
 * copies each chunk into a staging buffer and queues its upload, so it returns as soon as the
 * last chunk is queued: the caller's buffer is no longer needed by then. A staging buffer is
 * reused only after its upload has finished (an event per buffer).
 *
 * A storage may be freed on another thread (GC): free only hands the block back to the
 * allocator, which keeps it for the stream that used it (alloc.c), so nothing here needs the
 * freeing thread's GPU. Memory written on one thread's stream is visible to another thread's
 * stream once the first has synchronized (fsdp_device_i.synchronize), as for any two streams.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/cuda/cuda.h"

#define STAGE_BYTES ((size_t)4 << 20)      /* each of the two pinned buffers of a thread */

typedef struct cuda_thread {
  int gpu;
  bool ready;          /* GPU selected and stream created */
  cudaStream_t stream;
  void *stage[2];
  cudaEvent_t staged[2]; /* recorded after each use of a buffer */
  bool pending[2];       /* an upload or download from the buffer may still run */
  bool stage_failed;     /* no pinned memory: copy straight from and to pageable memory */
  int next;
} cuda_thread;

static _Thread_local cuda_thread *tl;
static pthread_key_t thread_key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;
static atomic_bool deterministic;

/* ---- errors ------------------------------------------------------------------------------ */

int fsdp_cuda_check(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return FSDP_OK;
  return fsdp_error("cuda: %s: %s", what, cudaGetErrorString(e));
}

int fsdp_cuda_launched(const char *what) { return fsdp_cuda_check(cudaGetLastError(), what); }

/* ---- GPUs ----------------------------------------------------------------------------------- */

static int gpu_count = -1;
static pthread_once_t count_once = PTHREAD_ONCE_INIT;

static void count_gpus(void) {
  int n = 0;
  /* No NVIDIA device node (the Linux driver's /dev/nvidiactl, WSL's /dev/dxg): no GPU, and no
   * reason to have the CUDA runtime look for a driver (dlopen) to learn it. */
  if (access("/dev/nvidiactl", F_OK) != 0 && access("/dev/dxg", F_OK) != 0) {
    gpu_count = 0;
    return;
  }
  if (cudaGetDeviceCount(&n) != cudaSuccess) { /* no driver, no GPU: no device */
    (void)cudaGetLastError();
    n = 0;
  }
  gpu_count = n < FSDP_CUDA_MAX_GPUS ? n : FSDP_CUDA_MAX_GPUS;
}

static int cuda_count(void *ctx) {
  (void)ctx;
  pthread_once(&count_once, count_gpus);
  return gpu_count;
}

/* ---- the thread's record ------------------------------------------------------------------- */

static void thread_release(cuda_thread *t) {
  if (t->ready) {
    (void)cudaSetDevice(t->gpu);
    (void)cudaStreamSynchronize(t->stream);
  }
  for (int i = 0; i < 2; i++) {
    if (t->stage[i]) (void)cudaFreeHost(t->stage[i]);
    if (t->staged[i]) (void)cudaEventDestroy(t->staged[i]);
  }
  if (t->ready) {
    fsdp_cuda_pool_retire_stream(t->gpu, t->stream);
    (void)cudaStreamDestroy(t->stream);
  }
  (void)cudaGetLastError();
  int gpu = t->gpu;
  memset(t, 0, sizeof *t);
  t->gpu = gpu;
}

static void thread_exit(void *p) {
  cuda_thread *t = p;
  thread_release(t);
  free(t);
  tl = NULL;
}

static void make_key(void) { (void)pthread_key_create(&thread_key, thread_exit); }

static cuda_thread *thread_get(void) {
  if (!tl) {
    pthread_once(&key_once, make_key);
    cuda_thread *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    if (pthread_setspecific(thread_key, t) != 0) {
      free(t);
      return NULL;
    }
    tl = t;
  }
  return tl;
}

/* The calling thread's record with its GPU selected and its stream created. */
static cuda_thread *thread_ready(void) {
  cuda_thread *t = thread_get();
  if (!t) {
    fsdp_error("cuda: out of host memory for the thread's state");
    return NULL;
  }
  if (t->ready) return t;
  if (fsdp_cuda_check(cudaSetDevice(t->gpu), "selecting the thread's GPU") ||
      fsdp_cuda_check(cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking),
                      "creating the thread's stream")) {
    (void)cudaGetLastError(); /* reported here, not again by the next launch check */
    return NULL;
  }
  t->ready = true;
  return t;
}

int fsdp_cuda_thread_ready(void) { return thread_ready() ? FSDP_OK : FSDP_ERR; }

int fsdp_cuda_device(void) {
  cuda_thread *t = thread_get();
  return t ? t->gpu : 0;
}

cudaStream_t fsdp_cuda_stream(void) {
  cuda_thread *t = thread_ready();
  return t ? t->stream : 0;
}

static void cuda_bind(void *ctx, int local_rank) {
  int n = cuda_count(ctx);
  cuda_thread *t = thread_get();
  if (n <= 0 || !t) return;
  int gpu = (local_rank > 0 ? local_rank : 0) % n;
  if (t->ready && t->gpu != gpu) thread_release(t); /* rebound: start over on the new GPU */
  t->gpu = gpu;
  if (cudaSetDevice(gpu) != cudaSuccess) (void)cudaGetLastError(); /* reported on first use */
}

/* ---- deterministic mode ---------------------------------------------------------------------- */

int fsdp_cuda_set_deterministic(void *ctx, bool on) {
  (void)ctx;
  atomic_store(&deterministic, on);
  return FSDP_OK;
}

bool fsdp_cuda_deterministic(void) { return atomic_load(&deterministic); }

/* ---- memory ------------------------------------------------------------------------------------- */

static int cuda_alloc_impl(void **out, size_t bytes, bool zero) {
  *out = NULL;
  cuda_thread *t = thread_ready();
  if (!t) return FSDP_ERR;
  if (fsdp_cuda_pool_alloc(t->gpu, t->stream, bytes, out)) return FSDP_ERR;
  if (zero && bytes && fsdp_cuda_check(cudaMemsetAsync(*out, 0, bytes, t->stream), "zeroing")) {
    fsdp_cuda_pool_free(*out);
    *out = NULL;
    return FSDP_ERR;
  }
  return FSDP_OK;
}

static int cuda_alloc(void *ctx, void **out, size_t bytes) {
  (void)ctx;
  return cuda_alloc_impl(out, bytes, true);
}

static int cuda_alloc_uninit(void *ctx, void **out, size_t bytes) {
  (void)ctx;
  return cuda_alloc_impl(out, bytes, false);
}

static void cuda_free(void *ctx, void *ptr, size_t bytes) {
  (void)ctx, (void)bytes;
  fsdp_cuda_pool_free(ptr);
}

/* Scratch is charged to the calling thread's domain as activations, directly (no storage): the
 * kernel frees it on the same thread before it returns. */
int fsdp_cuda_scratch(void **out, size_t bytes) {
  *out = NULL;
  fsdp_mem_domain *d = fsdp_mem_domain_current();
  if (fsdp_mem_charge(d, &fsdp_device_cuda, FSDP_ROLE_ACTIVATIONS, bytes)) return FSDP_ERR;
  if (cuda_alloc_impl(out, bytes, false)) {
    fsdp_mem_uncharge(d, &fsdp_device_cuda, FSDP_ROLE_ACTIVATIONS, bytes);
    return FSDP_ERR;
  }
  return FSDP_OK;
}

void fsdp_cuda_scratch_free(void *p, size_t bytes) {
  if (!p) return;
  fsdp_cuda_pool_free(p);
  fsdp_mem_uncharge(fsdp_mem_domain_current(), &fsdp_device_cuda, FSDP_ROLE_ACTIVATIONS, bytes);
}

/* ---- copies ------------------------------------------------------------------------------------- */

static int cuda_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  (void)ctx;
  if (!bytes || dst == src) return FSDP_OK;
  cuda_thread *t = thread_ready();
  if (!t) return FSDP_ERR;
  const char *d = dst, *s = src;
  if (d < s + bytes && s < d + bytes) { /* overlapping: cudaMemcpy may not, go through scratch */
    void *tmp;
    if (fsdp_cuda_scratch(&tmp, bytes)) return FSDP_ERR;
    int rc = fsdp_cuda_check(cudaMemcpyAsync(tmp, src, bytes, cudaMemcpyDeviceToDevice,
                                             t->stream), "copy");
    if (!rc)
      rc = fsdp_cuda_check(cudaMemcpyAsync(dst, tmp, bytes, cudaMemcpyDeviceToDevice,
                                           t->stream), "copy");
    fsdp_cuda_scratch_free(tmp, bytes);
    return rc;
  }
  return fsdp_cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, t->stream),
                         "copy");
}

/* The thread's staging buffers, created on first use; false when pinned memory is not to be
 * had (copies then go straight to and from pageable memory). */
static bool stage_ready(cuda_thread *t) {
  if (t->stage[1]) return true;
  if (t->stage_failed) return false;
  for (int i = 0; i < 2; i++) {
    if ((!t->stage[i] && cudaHostAlloc(&t->stage[i], STAGE_BYTES, cudaHostAllocDefault)) ||
        (!t->staged[i] && cudaEventCreateWithFlags(&t->staged[i], cudaEventDisableTiming))) {
      (void)cudaGetLastError();
      for (int k = 0; k < 2; k++) {
        if (t->stage[k]) (void)cudaFreeHost(t->stage[k]);
        if (t->staged[k]) (void)cudaEventDestroy(t->staged[k]);
        t->stage[k] = NULL, t->staged[k] = NULL;
      }
      t->stage_failed = true;
      return false;
    }
  }
  return true;
}

/* The next staging buffer, once whatever last used it has finished. */
static int stage_take(cuda_thread *t, int *out) {
  int b = t->next;
  t->next ^= 1;
  if (t->pending[b] && fsdp_cuda_check(cudaEventSynchronize(t->staged[b]), "host copy"))
    return FSDP_ERR;
  t->pending[b] = false;
  *out = b;
  return FSDP_OK;
}

static int stage_queued(cuda_thread *t, int b) {
  t->pending[b] = true;
  return fsdp_cuda_check(cudaEventRecord(t->staged[b], t->stream), "host copy");
}

static int cuda_to_host(void *ctx, void *host_dst, const void *src, size_t bytes) {
  (void)ctx;
  if (!bytes) return FSDP_OK;
  cuda_thread *t = thread_ready();
  if (!t) return FSDP_ERR;
  if (!stage_ready(t)) {
    if (fsdp_cuda_check(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost,
                                        t->stream), "copy to host"))
      return FSDP_ERR;
    return fsdp_cuda_check(cudaStreamSynchronize(t->stream), "copy to host");
  }
  /* chunk i downloads into one buffer while the host empties chunk i - 1 from the other */
  int prev = -1;
  size_t prev_off = 0, prev_len = 0;
  for (size_t off = 0;; off += STAGE_BYTES) {
    int b = -1;
    size_t len = off < bytes ? (bytes - off < STAGE_BYTES ? bytes - off : STAGE_BYTES) : 0;
    if (len) {
      if (stage_take(t, &b)) return FSDP_ERR;
      if (fsdp_cuda_check(cudaMemcpyAsync(t->stage[b], (const char *)src + off, len,
                                          cudaMemcpyDeviceToHost, t->stream), "copy to host") ||
          stage_queued(t, b))
        return FSDP_ERR;
    }
    if (prev >= 0) {
      if (fsdp_cuda_check(cudaEventSynchronize(t->staged[prev]), "copy to host"))
        return FSDP_ERR;
      t->pending[prev] = false;
      memcpy((char *)host_dst + prev_off, t->stage[prev], prev_len);
    }
    if (!len) break;
    prev = b, prev_off = off, prev_len = len;
  }
  return FSDP_OK;
}

static int cuda_from_host(void *ctx, void *dst, const void *host_src, size_t bytes) {
  (void)ctx;
  if (!bytes) return FSDP_OK;
  cuda_thread *t = thread_ready();
  if (!t) return FSDP_ERR;
  if (!stage_ready(t)) { /* pageable: wait, the caller may reuse its buffer on return */
    if (fsdp_cuda_check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice,
                                        t->stream), "copy from host"))
      return FSDP_ERR;
    return fsdp_cuda_check(cudaStreamSynchronize(t->stream), "copy from host");
  }
  for (size_t off = 0; off < bytes; off += STAGE_BYTES) {
    size_t len = bytes - off < STAGE_BYTES ? bytes - off : STAGE_BYTES;
    int b;
    if (stage_take(t, &b)) return FSDP_ERR;
    memcpy(t->stage[b], (const char *)host_src + off, len);
    if (fsdp_cuda_check(cudaMemcpyAsync((char *)dst + off, t->stage[b], len,
                                        cudaMemcpyHostToDevice, t->stream), "copy from host") ||
        stage_queued(t, b))
      return FSDP_ERR;
  }
  return FSDP_OK;
}

static int cuda_synchronize(void *ctx) {
  (void)ctx;
  cuda_thread *t = thread_get();
  if (!t || !t->ready) return FSDP_OK; /* nothing was ever queued by this thread */
  return fsdp_cuda_check(cudaStreamSynchronize(t->stream), "synchronize");
}

/* the allocator's figures for the calling thread's GPU (fsdp.memory()'s cuda entry) */
static int cuda_memory_stats(void *ctx, int64_t *allocated, int64_t *allocated_peak,
                             int64_t *reserved, int64_t *reserved_peak) {
  (void)ctx;
  fsdp_cuda_mem_stats st;
  if (fsdp_cuda_memory_stats(fsdp_cuda_device(), &st)) return FSDP_ERR;
  *allocated = st.allocated, *allocated_peak = st.allocated_peak;
  *reserved = st.reserved, *reserved_peak = st.reserved_peak;
  return FSDP_OK;
}

static void cuda_memory_reset_peak(void *ctx) {
  (void)ctx;
  fsdp_cuda_memory_reset_peak(fsdp_cuda_device());
}

static void cuda_describe(void *ctx, char *buf, size_t n) {
  (void)ctx;
  struct cudaDeviceProp p;
  int gpu = fsdp_cuda_device();
  if (cudaGetDeviceProperties(&p, gpu) != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(buf, n, "GPU %d (no properties)", gpu);
    return;
  }
  snprintf(buf, n, "%s, sm_%d%d, %zu GiB", p.name, p.major, p.minor,
           p.totalGlobalMem >> 30);
}

fsdp_device_i fsdp_device_cuda = {
    .name = "cuda",
    .has_data = true,
    .host_memory = false,
    .alloc = cuda_alloc,
    .alloc_uninit = cuda_alloc_uninit,
    .free = cuda_free,
    .copy = cuda_copy,
    .to_host = cuda_to_host,
    .from_host = cuda_from_host,
    .synchronize = cuda_synchronize,
    .count = cuda_count,
    .bind = cuda_bind,
    .describe = cuda_describe,
    .memory_stats = cuda_memory_stats,
    .memory_reset_peak = cuda_memory_reset_peak,
};

int fsdp_cuda_register(void) {
  if (cuda_count(NULL) < 1) return FSDP_OK; /* no GPU here: "cuda" stays unknown */
  return fsdp_device_register(&fsdp_device_cuda, &fsdp_cuda_kernels);
}
