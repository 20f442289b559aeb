/*
 * device.c — the device registry and the two built-in devices.
 *
 * A device is a table (fsdp_device_i). Callers never ask which device they hold, only whether
 * it has data and whether the host may read its memory. cpu and meta are always registered
 * (cpu first, then meta); other devices (and the cpu's kernels) arrive through
 * fsdp_device_register, called by src/kernels at start-up. Registration order is also the
 * column order of the memory report, and a device is never removed.
 *
 * cpu: 64-byte aligned, zero-filled host memory. meta: shape only — alloc hands back NULL and
 * free does nothing, so a meta model of any size costs no memory.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core/core.h"

/* ---- cpu ------------------------------------------------------------------------------- */

#define CPU_ALIGN 64

/* Block cache. A training step allocates the same activation and gradient sizes every step;
 * handing each back to glibc returns large blocks to the kernel (munmap) and the next step pays
 * a page fault and a kernel page clear per 4 KiB (measured: ~10% of a GPT step). Blocks of at
 * least CACHE_MIN bytes are therefore kept on per-size free lists, up to a total of
 * FSDP_CPU_CACHE bytes (default 2 GiB; 0 disables), shared by all threads under one mutex
 * (allocations are per op, not per element). Cached bytes are not live: the accounting in
 * alloc.c counts storages, and a cached block belongs to none. fsdp_device_cpu_trim() gives the
 * cache back. */
#define CACHE_MIN ((size_t)64 << 10)
/* Blocks of at least HUGE_MIN bytes ask for transparent huge pages over the whole 2 MiB pages
 * inside them (madvise; Debian's kernels give THP on request only). Kernels stream through
 * whole activations: with 4 KiB pages every 4 KiB costs a TLB miss and stops the hardware
 * prefetcher, and a bf16 slice of 2048 elements is exactly one such page. Measured: a GPT step
 * (L=6, d=384) about 4% faster (docs/PERFORMANCE.md). Where the kernel refuses, nothing changes. */
#define HUGE_PAGE ((size_t)2 << 20)
#define HUGE_MIN ((size_t)4 << 20)
#define CACHE_BUCKETS 128

typedef struct cached { struct cached *next; } cached;

static struct {
  pthread_mutex_t mu;
  bool configured;
  size_t cap, total;
  int nbuckets;
  struct { size_t size; cached *head; } bucket[CACHE_BUCKETS];
} cache = {.mu = PTHREAD_MUTEX_INITIALIZER};

static size_t round_size(size_t bytes) { return (bytes + 4095) & ~(size_t)4095; }

static char cache_env_error[160]; /* non-empty: FSDP_CPU_CACHE was malformed (default kept) */

/* Under cache.mu, or before any thread can allocate (fsdp_device_cpu_check). */
static void cache_configure(void) {
  if (cache.configured) return;
  cache.configured = true;
  cache.cap = (size_t)2 << 30;
  const char *env = getenv("FSDP_CPU_CACHE");
  int64_t v;
  if (!env || !*env) return;
  if (fsdp_mem_parse_size(env, &v) == FSDP_OK && v >= 0)
    cache.cap = (size_t)v;
  else
    snprintf(cache_env_error, sizeof cache_env_error,
             "FSDP_CPU_CACHE='%.64s': expected bytes, or a number with K, M or G", env);
}

int fsdp_device_cpu_check(void) {
  pthread_mutex_lock(&cache.mu);
  cache_configure();
  pthread_mutex_unlock(&cache.mu);
  return cache_env_error[0] ? fsdp_error("%s", cache_env_error) : FSDP_OK;
}

/* A cached block of exactly `size` bytes, or NULL. */
static void *cache_take(size_t size) {
  void *p = NULL;
  pthread_mutex_lock(&cache.mu);
  for (int i = 0; i < cache.nbuckets; i++)
    if (cache.bucket[i].size == size && cache.bucket[i].head) {
      cached *c = cache.bucket[i].head;
      cache.bucket[i].head = c->next;
      cache.total -= size;
      p = c;
      break;
    }
  pthread_mutex_unlock(&cache.mu);
  return p;
}

/* Keep the block if there is room; false means the caller frees it. */
static bool cache_put(void *p, size_t size) {
  bool kept = false;
  pthread_mutex_lock(&cache.mu);
  cache_configure();
  if (cache.total + size <= cache.cap) {
    int i = 0;
    while (i < cache.nbuckets && cache.bucket[i].size != size) i++;
    if (i == cache.nbuckets && cache.nbuckets < CACHE_BUCKETS) {
      cache.bucket[i].size = size;
      cache.bucket[i].head = NULL;
      cache.nbuckets++;
    }
    if (i < cache.nbuckets) {
      cached *c = p;
      c->next = cache.bucket[i].head;
      cache.bucket[i].head = c;
      cache.total += size;
      kept = true;
    }
  }
  pthread_mutex_unlock(&cache.mu);
  return kept;
}

static void raw_free(void *ptr) { free(((void **)ptr)[-1]); }

/* calloc keeps its lazy zeroing for fresh blocks (pages from the kernel are not written twice,
 * which matters for multi-GB parameter buffers); we over-allocate by CPU_ALIGN, round up, and
 * keep the raw pointer just below the aligned block so free can find it. malloc returns at
 * least 16-byte aligned memory, so the gap is 16..64 bytes: room for the pointer. */
static int cpu_alloc_impl(void **out, size_t bytes, bool zero) {
  *out = NULL;
  if (bytes > SIZE_MAX - 2 * CPU_ALIGN - 4096)
    return fsdp_error("cpu: cannot allocate %zu bytes (size overflow)", bytes);
  if (bytes >= CACHE_MIN) {
    bytes = round_size(bytes);
    void *p = cache_take(bytes);
    if (p) {
      if (zero) memset(p, 0, bytes);
      *out = p;
      return FSDP_OK;
    }
  }
  unsigned char *raw = zero ? calloc(1, bytes + CPU_ALIGN) : malloc(bytes + CPU_ALIGN);
  if (!raw) return fsdp_error("cpu: out of memory allocating %zu bytes", bytes);
  if (bytes >= HUGE_MIN) {
    uintptr_t lo = ((uintptr_t)raw + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1),
              hi = ((uintptr_t)raw + bytes + CPU_ALIGN) & ~(uintptr_t)(HUGE_PAGE - 1);
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
  }
  uintptr_t aligned = ((uintptr_t)raw + CPU_ALIGN) & ~(uintptr_t)(CPU_ALIGN - 1);
  ((void **)aligned)[-1] = raw;
  *out = (void *)aligned;
  return FSDP_OK;
}

static int cpu_alloc(void *ctx, void **out, size_t bytes) {
  (void)ctx;
  return cpu_alloc_impl(out, bytes, true);
}

static int cpu_alloc_uninit(void *ctx, void **out, size_t bytes) {
  (void)ctx;
  return cpu_alloc_impl(out, bytes, false);
}

static void cpu_free(void *ctx, void *ptr, size_t bytes) {
  (void)ctx;
  if (!ptr) return;
  if (bytes >= CACHE_MIN && cache_put(ptr, round_size(bytes))) return;
  raw_free(ptr);
}

void fsdp_device_cpu_trim(void) {
  pthread_mutex_lock(&cache.mu);
  for (int i = 0; i < cache.nbuckets; i++) {
    cached *c = cache.bucket[i].head;
    while (c) {
      cached *next = c->next;
      raw_free(c);
      c = next;
    }
    cache.bucket[i].head = NULL;
  }
  cache.nbuckets = 0;
  cache.total = 0;
  pthread_mutex_unlock(&cache.mu);
}

size_t fsdp_device_cpu_cached_bytes(void) {
  pthread_mutex_lock(&cache.mu);
  size_t t = cache.total;
  pthread_mutex_unlock(&cache.mu);
  return t;
}

/* copy, to_host and from_host are all memmove: the cpu's memory is host memory */
static int cpu_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  (void)ctx;
  if (bytes) memmove(dst, src, bytes);
  return FSDP_OK;
}

fsdp_device_i fsdp_device_cpu = {
    .name = "cpu",
    .has_data = true,
    .host_memory = true,
    .alloc = cpu_alloc,
    .alloc_uninit = cpu_alloc_uninit,
    .free = cpu_free,
    .copy = cpu_copy,
    .to_host = cpu_copy,
    .from_host = cpu_copy,
};

/* ---- meta ------------------------------------------------------------------------------- */

int fsdp_device_nodata_alloc(void *ctx, void **out, size_t bytes) {
  (void)ctx, (void)bytes;
  *out = NULL;
  return FSDP_OK;
}

void fsdp_device_nodata_free(void *ctx, void *ptr, size_t bytes) {
  (void)ctx, (void)ptr, (void)bytes;
}

fsdp_device_i fsdp_device_meta = {
    .name = "meta",
    .has_data = false,
    .alloc = fsdp_device_nodata_alloc,
    .free = fsdp_device_nodata_free,
};

/* ---- registry ------------------------------------------------------------------------------ */

static struct {
  pthread_mutex_t mu;
  int n;
  fsdp_device_i *dev[FSDP_MAX_DEVICES];
} reg = {.mu = PTHREAD_MUTEX_INITIALIZER, .n = 2, .dev = {&fsdp_device_cpu, &fsdp_device_meta}};

/* Readers do not lock: entries are written before n grows (release), and never change. */
static int reg_count(void) { return __atomic_load_n(&reg.n, __ATOMIC_ACQUIRE); }

int fsdp_device_register(fsdp_device_i *dev, const struct fsdp_kernels_i *kernels) {
  if (!dev || !dev->name || !dev->alloc || !dev->free)
    return fsdp_error("register device: a device needs a name, alloc and free");
  if (dev->has_data && (!dev->copy || !dev->to_host || !dev->from_host))
    return fsdp_error("register device '%s': a device with data needs copy, to_host and "
                      "from_host",
                      dev->name);
  int rc = FSDP_OK;
  pthread_mutex_lock(&reg.mu);
  int i = 0;
  while (i < reg.n && reg.dev[i] != dev) i++;
  if (i == reg.n) {
    for (int k = 0; k < reg.n; k++)
      if (strcmp(reg.dev[k]->name, dev->name) == 0)
        rc = fsdp_error("register device '%s': a different device has that name", dev->name);
    if (!rc && reg.n == FSDP_MAX_DEVICES)
      rc = fsdp_error("register device '%s': the registry is full (%d devices)", dev->name,
                      FSDP_MAX_DEVICES);
    if (!rc) {
      reg.dev[reg.n] = dev;
      __atomic_store_n(&reg.n, reg.n + 1, __ATOMIC_RELEASE);
    }
  }
  if (!rc) __atomic_store_n(&dev->kernels, kernels, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&reg.mu);
  return rc;
}

int fsdp_device_count(void) { return reg_count(); }

const fsdp_device_i *fsdp_device_at(int i) {
  return i >= 0 && i < reg_count() ? reg.dev[i] : NULL;
}

int fsdp_device_index(const fsdp_device_i *dev) {
  int n = reg_count();
  for (int i = 0; i < n; i++)
    if (reg.dev[i] == dev) return i;
  return -1;
}

int fsdp_device_count_of(const char *name) {
  int n = reg_count();
  for (int i = 0; name && i < n; i++)
    if (strcmp(reg.dev[i]->name, name) == 0) {
      const fsdp_device_i *d = reg.dev[i];
      return d->count ? d->count(d->ctx) : d->has_data ? 1 : 0;
    }
  return 0;
}

void fsdp_devices_bind(int local_rank) {
  int n = reg_count();
  for (int i = 0; i < n; i++)
    if (reg.dev[i]->bind) reg.dev[i]->bind(reg.dev[i]->ctx, local_rank);
}

const fsdp_device_i *fsdp_device_find(const char *name) {
  int n = reg_count();
  if (name)
    for (int i = 0; i < n; i++)
      if (strcmp(reg.dev[i]->name, name) == 0) return reg.dev[i];
  char known[256] = "";
  size_t len = 0;
  for (int i = 0; i < n && len < sizeof known; i++)
    len += (size_t)snprintf(known + len, sizeof known - len, "%s%s", i ? ", " : "",
                            reg.dev[i]->name);
  fsdp_error("unknown device '%s' (known devices: %s)", name ? name : "(null)", known);
  return NULL;
}
