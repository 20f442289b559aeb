/*
 * alloc.c — the cuda device's caching allocator (pool.h says what it promises).
 *
 * Layout: a segment is one raw allocation, cut into blocks that list their address neighbours
 * (prev, next). Each GPU has two pools, small (blocks <= 2 MiB from 2 MiB segments, 512-byte
 * classes) and large (multiples of 2 MiB). A pool files its cached blocks in bins: one bin per
 * exact size class (small: 512 B steps up to 2 MiB; large: 2 MiB steps up to 2 GiB) plus, for
 * the large pool, one bin of bigger blocks kept sorted by size. A bitmap of non-empty bins
 * makes the best-fit search (the smallest cached block that fits and may be used on the
 * stream) a scan of a few words. Blocks handed out are found again by address in a hash table.
 *
 * Streams: a cached block carries the stream that last used it and is taken only by that
 * stream (stream order makes the reuse safe without synchronizing) or, once its stream has
 * been retired, by any (FSDP_CUDA_STREAM_IDLE). Neighbours merge when their tags allow it.
 *
 * One mutex guards everything: allocations are per op, and the rank threads of one process are
 * a handful. Accounting against fsdp.memory() stays in core (fsdp_mem_charge, by storage.c);
 * the statistics here are the pool's own (fsdp_cuda_memory_stats).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "core/core.h"
#include "kernels/cuda/pool.h"

#define SMALL_MAX ((size_t)1 << 20)     /* requests up to this go to the small pool */
#define SMALL_UNIT ((size_t)512)
#define SMALL_SEGMENT ((size_t)2 << 20) /* the small pool's segments */
#define LARGE_UNIT ((size_t)2 << 20)
#define SMALL_BINS (SMALL_SEGMENT / SMALL_UNIT + 1) /* classes 1..4096 */
#define LARGE_DIRECT 1024                           /* 2 MiB .. 2 GiB: one bin each */
#define LARGE_BINS (LARGE_DIRECT + 2)               /* + the sorted bin of bigger blocks */
#define MAX_BINS SMALL_BINS
#define MAP_WORDS ((MAX_BINS + 63) / 64)

typedef struct block {
  char *ptr;
  size_t size;      /* rounded */
  size_t requested; /* what the caller asked for (in use only) */
  void *stream;     /* in use: the stream it was handed to; cached: who may take it */
  struct block *prev, *next;   /* address neighbours in its segment */
  struct block *fprev, *fnext; /* its bin (cached only) */
  struct block *hnext;         /* hash chain (in use only) */
  int gpu;
  bool large, in_use;
} block;

typedef struct pool {
  int nbins;
  block *bin[MAX_BINS];
  uint64_t map[MAP_WORDS];
} pool;

typedef struct gpu_pools {
  pool small, large;
  fsdp_cuda_mem_stats st;
} gpu_pools;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static gpu_pools *gpus[FSDP_CUDA_MAX_GPUS];
static block **table; /* blocks in use, by address */
static size_t table_size, table_count;

/* ---- the CUDA backend --------------------------------------------------------------------- */

/* Run on `gpu` whatever the calling thread's current GPU (a storage may be freed, and the cache
 * emptied, on another thread than the one that allocated). */
static int switch_to(int gpu, int *prev) {
  if (cudaGetDevice(prev) != cudaSuccess) *prev = -1;
  if (*prev == gpu) return FSDP_OK;
  cudaError_t e = cudaSetDevice(gpu);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return fsdp_error("cuda: cannot use GPU %d: %s", gpu, cudaGetErrorString(e));
  }
  return FSDP_OK;
}

static void switch_back(int gpu, int prev) {
  if (prev >= 0 && prev != gpu) (void)cudaSetDevice(prev);
}

static int cuda_malloc(int gpu, void **out, size_t bytes, bool *oom) {
  int prev;
  *oom = false;
  if (switch_to(gpu, &prev)) return FSDP_ERR;
  cudaError_t e = cudaMalloc(out, bytes);
  switch_back(gpu, prev);
  if (e == cudaSuccess) return FSDP_OK;
  (void)cudaGetLastError(); /* not sticky: keep it from the next launch check */
  *oom = e == cudaErrorMemoryAllocation;
  return fsdp_error("cuda: cudaMalloc of %zu bytes on GPU %d: %s", bytes, gpu,
                    cudaGetErrorString(e));
}

static void cuda_free(int gpu, void *p) {
  int prev;
  if (switch_to(gpu, &prev)) return;
  (void)cudaFree(p);
  switch_back(gpu, prev);
}

static int cuda_synchronize(int gpu) {
  int prev;
  if (switch_to(gpu, &prev)) return FSDP_ERR;
  cudaError_t e = cudaDeviceSynchronize();
  switch_back(gpu, prev);
  if (e == cudaSuccess) return FSDP_OK;
  return fsdp_error("cuda: waiting for GPU %d: %s", gpu, cudaGetErrorString(e));
}

static void cuda_info(int gpu, size_t *free_bytes, size_t *total_bytes) {
  int prev;
  *free_bytes = *total_bytes = 0;
  if (switch_to(gpu, &prev)) return;
  if (cudaMemGetInfo(free_bytes, total_bytes) != cudaSuccess) (void)cudaGetLastError();
  switch_back(gpu, prev);
}

static const fsdp_cuda_pool_backend cuda_backend = {
    .malloc = cuda_malloc, .free = cuda_free, .synchronize = cuda_synchronize, .info = cuda_info};
static const fsdp_cuda_pool_backend *backend = &cuda_backend;

/* ---- bins --------------------------------------------------------------------------------------- */

static int bin_of(size_t size, bool large) {
  if (!large) return (int)(size / SMALL_UNIT);
  size_t u = size / LARGE_UNIT;
  return u <= LARGE_DIRECT ? (int)u : LARGE_DIRECT + 1;
}

static void bin_insert(pool *p, block *b) {
  int i = bin_of(b->size, b->large);
  block *prev = NULL, *at = p->bin[i];
  if (b->large && i == LARGE_DIRECT + 1) /* the sorted bin: smallest first */
    while (at && at->size < b->size) prev = at, at = at->fnext;
  b->fprev = prev;
  b->fnext = at;
  if (at) at->fprev = b;
  if (prev) prev->fnext = b;
  else p->bin[i] = b;
  p->map[i / 64] |= (uint64_t)1 << (i % 64);
}

static void bin_remove(pool *p, block *b) {
  int i = bin_of(b->size, b->large);
  if (b->fprev) b->fprev->fnext = b->fnext;
  else p->bin[i] = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  b->fprev = b->fnext = NULL;
  if (!p->bin[i]) p->map[i / 64] &= ~((uint64_t)1 << (i % 64));
}

static bool may_take(const block *b, void *stream) {
  return b->stream == stream || b->stream == FSDP_CUDA_STREAM_IDLE;
}

/* the smallest cached block of at least `size` bytes that `stream` may take, or NULL */
static block *bin_find(pool *p, size_t size, bool large, void *stream) {
  int i = bin_of(size, large);
  while (i < p->nbins) {
    uint64_t w = p->map[i / 64] >> (i % 64);
    if (!w) { /* the rest of this word is empty */
      i = (i / 64 + 1) * 64;
      continue;
    }
    i += __builtin_ctzll(w);
    if (i >= p->nbins) break;
    for (block *b = p->bin[i]; b; b = b->fnext)
      if (b->size >= size && may_take(b, stream)) return b;
    i++;
  }
  return NULL;
}

/* ---- blocks in use, by address -------------------------------------------------------------- */

static size_t slot_of(const void *ptr) {
  return (size_t)(((uintptr_t)ptr >> 9) * 0x9E3779B97F4A7C15ull >> 20) & (table_size - 1);
}

static int table_grow(void) {
  size_t n = table_size ? table_size * 2 : 1024;
  block **t = calloc(n, sizeof *t);
  if (!t) return fsdp_error("cuda: out of host memory for the allocator's table");
  block **old = table;
  size_t old_size = table_size;
  table = t, table_size = n;
  for (size_t i = 0; i < old_size; i++)
    for (block *b = old[i], *next; b; b = next) {
      next = b->hnext;
      size_t s = slot_of(b->ptr);
      b->hnext = table[s];
      table[s] = b;
    }
  free(old);
  return FSDP_OK;
}

static int table_add(block *b) {
  if (table_count + 1 > table_size && table_grow()) return FSDP_ERR;
  size_t s = slot_of(b->ptr);
  b->hnext = table[s];
  table[s] = b;
  table_count++;
  return FSDP_OK;
}

static block *table_take(const void *ptr) {
  if (!table_size) return NULL;
  for (block **at = &table[slot_of(ptr)]; *at; at = &(*at)->hnext)
    if ((*at)->ptr == ptr) {
      block *b = *at;
      *at = b->hnext;
      b->hnext = NULL;
      table_count--;
      return b;
    }
  return NULL;
}

/* ---- pools --------------------------------------------------------------------------------------- */

static gpu_pools *pools_of(int gpu) {
  if (gpu < 0 || gpu >= FSDP_CUDA_MAX_GPUS) return NULL;
  if (!gpus[gpu]) {
    gpus[gpu] = calloc(1, sizeof *gpus[gpu]);
    if (gpus[gpu]) {
      gpus[gpu]->small.nbins = (int)SMALL_BINS;
      gpus[gpu]->large.nbins = LARGE_BINS;
    }
  }
  return gpus[gpu];
}

static void peak(int64_t *peak_value, int64_t v) {
  if (v > *peak_value) *peak_value = v;
}

/* Give every wholly cached segment of one GPU back (the GPU is idle: the caller waited). */
static void release_cached(int gpu) {
  gpu_pools *g = gpus[gpu];
  if (!g) return;
  pool *ps[2] = {&g->small, &g->large};
  for (int k = 0; k < 2; k++)
    for (int i = 0; i < ps[k]->nbins; i++)
      for (block *b = ps[k]->bin[i], *next; b; b = next) {
        next = b->fnext;
        if (b->prev || b->next) continue; /* part of a segment still in use */
        bin_remove(ps[k], b);
        backend->free(gpu, b->ptr);
        g->st.reserved -= (int64_t)b->size;
        g->st.segments--;
        g->st.device_frees++;
        free(b);
      }
}

/* A new segment of `size` bytes as one cached block; on out of memory, wait for the GPU, empty
 * the cache and retry once. */
static int new_segment(int gpu, gpu_pools *g, size_t size, bool large, void *stream, block **out) {
  block *b = calloc(1, sizeof *b);
  if (!b) return fsdp_error("cuda: out of host memory for the allocator");
  void *p = NULL;
  bool oom = false;
  int rc = backend->malloc(gpu, &p, size, &oom);
  if (rc && oom && backend->synchronize(gpu) == FSDP_OK) {
    release_cached(gpu);
    rc = backend->malloc(gpu, &p, size, &oom);
    if (!rc) g->st.retries++;
  }
  if (rc) {
    free(b);
    if (!oom) return FSDP_ERR;
    g->st.ooms++;
    size_t fb = 0, tb = 0;
    if (backend->info) backend->info(gpu, &fb, &tb);
    return fsdp_error("cuda: out of memory allocating %zu bytes on GPU %d (%.2f GiB in use by "
                      "tensors, %.2f GiB reserved by the allocator, %.2f GiB free of %.2f GiB)",
                      size, gpu, (double)g->st.allocated / (1 << 30),
                      (double)g->st.reserved / (1 << 30), (double)fb / (1 << 30),
                      (double)tb / (1 << 30));
  }
  *b = (block){.ptr = p, .size = size, .stream = stream, .gpu = gpu, .large = large};
  g->st.reserved += (int64_t)size;
  peak(&g->st.reserved_peak, g->st.reserved);
  g->st.segments++;
  g->st.device_mallocs++;
  *out = b;
  return FSDP_OK;
}

/* Cut `size` bytes off the front of cached block b when the rest is worth keeping: the rest
 * stays cached (same stream tag). */
static int split(pool *p, block *b, size_t size) {
  size_t unit = b->large ? LARGE_UNIT : SMALL_UNIT;
  if (b->size - size < unit) return FSDP_OK;
  block *r = calloc(1, sizeof *r);
  if (!r) return FSDP_OK; /* keep the block whole */
  *r = (block){.ptr = b->ptr + size, .size = b->size - size, .stream = b->stream,
               .prev = b, .next = b->next, .gpu = b->gpu, .large = b->large};
  if (b->next) b->next->prev = r;
  b->next = r;
  b->size = size;
  bin_insert(p, r);
  return FSDP_OK;
}

int fsdp_cuda_pool_alloc(int gpu, void *stream, size_t bytes, void **out) {
  *out = NULL;
  if (bytes > ((size_t)1 << 62))
    return fsdp_error("cuda: cannot allocate %zu bytes (size overflow)", bytes);
  bool large = bytes > SMALL_MAX;
  size_t unit = large ? LARGE_UNIT : SMALL_UNIT;
  size_t size = bytes ? (bytes + unit - 1) / unit * unit : SMALL_UNIT;
  pthread_mutex_lock(&mu);
  int rc = FSDP_OK;
  gpu_pools *g = pools_of(gpu);
  if (!g) {
    rc = gpu < 0 || gpu >= FSDP_CUDA_MAX_GPUS ? fsdp_error("cuda: no GPU %d", gpu)
                                              : fsdp_error("cuda: out of host memory");
    goto done;
  }
  pool *p = large ? &g->large : &g->small;
  block *b = bin_find(p, size, large, stream);
  if (b) {
    bin_remove(p, b);
  } else {
    rc = new_segment(gpu, g, large ? size : SMALL_SEGMENT, large, stream, &b);
    if (rc) goto done;
  }
  split(p, b, size);
  if (table_add(b)) { /* out of host memory: keep the block cached */
    bin_insert(p, b);
    rc = FSDP_ERR;
    goto done;
  }
  b->in_use = true;
  b->stream = stream;
  b->requested = bytes;
  g->st.allocated += (int64_t)b->size;
  g->st.requested += (int64_t)bytes;
  g->st.blocks++;
  g->st.allocs++;
  peak(&g->st.allocated_peak, g->st.allocated);
  peak(&g->st.requested_peak, g->st.requested);
  *out = b->ptr;
done:
  pthread_mutex_unlock(&mu);
  return rc;
}

/* a and b (neighbours, both cached) may merge: the tag of the result, or NULL */
static void *merged_tag(const block *a, const block *b) {
  if (a->stream == b->stream || b->stream == FSDP_CUDA_STREAM_IDLE) return a->stream;
  if (a->stream == FSDP_CUDA_STREAM_IDLE) return b->stream;
  return NULL;
}

/* a takes in its next neighbour (out of the bins already), which is freed; tag from merged_tag */
static void absorb_next(block *a, void *tag) {
  block *n = a->next;
  a->size += n->size;
  a->next = n->next;
  if (n->next) n->next->prev = a;
  a->stream = tag;
  free(n);
}

void fsdp_cuda_pool_free(void *ptr) {
  if (!ptr) return;
  pthread_mutex_lock(&mu);
  block *b = table_take(ptr);
  if (!b) { /* not ours: a broken invariant, but never worth corrupting the pool over */
    pthread_mutex_unlock(&mu);
    return;
  }
  gpu_pools *g = gpus[b->gpu];
  pool *p = b->large ? &g->large : &g->small;
  b->in_use = false;
  g->st.allocated -= (int64_t)b->size;
  g->st.requested -= (int64_t)b->requested;
  g->st.blocks--;
  b->requested = 0;
  void *tag;
  block *n = b->next;
  if (n && !n->in_use && (tag = merged_tag(b, n))) { /* absorb the next block */
    bin_remove(p, n);
    absorb_next(b, tag);
  }
  block *v = b->prev;
  if (v && !v->in_use && (tag = merged_tag(v, b))) { /* the previous block absorbs it */
    bin_remove(p, v);
    absorb_next(v, tag);
    b = v;
  }
  bin_insert(p, b);
  pthread_mutex_unlock(&mu);
}

void fsdp_cuda_pool_retire_stream(int gpu, void *stream) {
  pthread_mutex_lock(&mu);
  gpu_pools *g = gpu >= 0 && gpu < FSDP_CUDA_MAX_GPUS ? gpus[gpu] : NULL;
  if (g) {
    pool *ps[2] = {&g->small, &g->large};
    for (int k = 0; k < 2; k++)
      for (int i = 0; i < ps[k]->nbins; i++)
        for (block *b = ps[k]->bin[i]; b; b = b->fnext)
          if (b->stream == stream) b->stream = FSDP_CUDA_STREAM_IDLE;
    for (size_t i = 0; i < table_size; i++)
      for (block *b = table[i]; b; b = b->hnext)
        if (b->gpu == gpu && b->stream == stream) b->stream = FSDP_CUDA_STREAM_IDLE;
  }
  pthread_mutex_unlock(&mu);
}

int fsdp_cuda_empty_cache(int gpu) {
  int rc = FSDP_OK;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < FSDP_CUDA_MAX_GPUS; i++) {
    if ((gpu >= 0 && i != gpu) || !gpus[i]) continue;
    if (backend->synchronize(i)) {
      rc = FSDP_ERR;
      continue;
    }
    release_cached(i);
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

int fsdp_cuda_memory_stats(int gpu, fsdp_cuda_mem_stats *out) {
  memset(out, 0, sizeof *out);
  if (gpu < 0 || gpu >= FSDP_CUDA_MAX_GPUS)
    return fsdp_error("cuda memory stats: no GPU %d", gpu);
  pthread_mutex_lock(&mu);
  if (gpus[gpu]) *out = gpus[gpu]->st;
  pthread_mutex_unlock(&mu);
  return FSDP_OK;
}

void fsdp_cuda_memory_reset_peak(int gpu) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < FSDP_CUDA_MAX_GPUS; i++) {
    if ((gpu >= 0 && i != gpu) || !gpus[i]) continue;
    fsdp_cuda_mem_stats *s = &gpus[i]->st;
    s->allocated_peak = s->allocated;
    s->requested_peak = s->requested;
    s->reserved_peak = s->reserved;
  }
  pthread_mutex_unlock(&mu);
}

void fsdp_cuda_pool_set_backend(const fsdp_cuda_pool_backend *b) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < FSDP_CUDA_MAX_GPUS; i++) {
    if (!gpus[i]) continue;
    pool *ps[2] = {&gpus[i]->small, &gpus[i]->large};
    for (int k = 0; k < 2; k++)
      for (int j = 0; j < ps[k]->nbins; j++)
        for (block *c = ps[k]->bin[j], *next; c; c = next) {
          next = c->fnext;
          if (!c->prev) backend->free(i, c->ptr); /* a segment's first block: its base */
          free(c);
        }
    free(gpus[i]);
    gpus[i] = NULL;
  }
  free(table);
  table = NULL;
  table_size = table_count = 0;
  backend = b ? b : &cuda_backend;
  pthread_mutex_unlock(&mu);
}
