/*
 * cpu2_device.h — a second device for tests, registered only through the public registration
 * (fsdp_device_register): its memory is host memory, but its table says host_memory = false,
 * so every generic path that must not dereference device pointers (cross-device copies,
 * fsdp_to / fsdp_to_host, core's fill and copy, the binding's element access) has to go through
 * its to_host / from_host, which count their calls. Its kernels are the cpu's table (less the
 * optional fused slots), so results must be bitwise those of the cpu. Shared by
 * tests/c/test_devices.c and the Lua test module
 * tests/c/lua_cpu2.c (busted: tests/lua/devices_spec.lua).
 *
 * What it cannot catch: a stray host dereference of its pointers works (the memory is the
 * host's); the counters show which route a path takes, not that no other route exists.
 */
#ifndef FSDP_TEST_CPU2_DEVICE_H
#define FSDP_TEST_CPU2_DEVICE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "kernels/cpu/kernels.h"

/* Calls (and bytes) of the calling thread since its last cpu2_reset: per thread, so each rank
 * thread counts its own transfers while the others run. */
typedef struct cpu2_stats {
  long to_host, from_host, copy;
  long to_host_bytes, from_host_bytes;
} cpu2_stats;

static _Thread_local cpu2_stats cpu2_counts;

/* An allocator's own figures, as a caching allocator reports them (memory_stats): bytes handed
 * out (allocated, rounded to 64) and a reserve that never shrinks (reserved), process-wide. */
static _Atomic long long cpu2_allocated, cpu2_allocated_peak, cpu2_reserved_peak;

static void cpu2_account(long long delta) {
  long long now = atomic_fetch_add(&cpu2_allocated, delta) + delta;
  long long p = atomic_load(&cpu2_allocated_peak);
  while (now > p && !atomic_compare_exchange_weak(&cpu2_allocated_peak, &p, now)) {}
  p = atomic_load(&cpu2_reserved_peak);
  while (now > p && !atomic_compare_exchange_weak(&cpu2_reserved_peak, &p, now)) {}
}

static int cpu2_alloc_impl(void **out, size_t bytes, bool zero) {
  size_t n = (bytes + 63) & ~(size_t)63; /* 64-byte aligned, a real pointer for 0 bytes */
  *out = aligned_alloc(64, n ? n : 64);
  if (!*out) return fsdp_error("cpu2: out of memory allocating %zu bytes", bytes);
  cpu2_account((long long)(n ? n : 64));
  if (zero) memset(*out, 0, bytes);
  return FSDP_OK;
}
static int cpu2_alloc(void *ctx, void **out, size_t bytes) {
  (void)ctx;
  return cpu2_alloc_impl(out, bytes, true);
}
static int cpu2_alloc_uninit(void *ctx, void **out, size_t bytes) {
  (void)ctx;
  return cpu2_alloc_impl(out, bytes, false);
}
static void cpu2_free(void *ctx, void *ptr, size_t bytes) {
  (void)ctx;
  if (ptr) {
    size_t n = (bytes + 63) & ~(size_t)63;
    cpu2_account(-(long long)(n ? n : 64));
  }
  free(ptr);
}
static int cpu2_memory_stats(void *ctx, int64_t *allocated, int64_t *allocated_peak,
                             int64_t *reserved, int64_t *reserved_peak) {
  (void)ctx;
  *allocated = atomic_load(&cpu2_allocated);
  *allocated_peak = atomic_load(&cpu2_allocated_peak);
  *reserved = *reserved_peak = atomic_load(&cpu2_reserved_peak); /* the reserve never shrinks */
  return FSDP_OK;
}
static void cpu2_memory_reset_peak(void *ctx) {
  (void)ctx;
  atomic_store(&cpu2_allocated_peak, atomic_load(&cpu2_allocated));
}
static int cpu2_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  (void)ctx;
  cpu2_counts.copy++;
  if (bytes) memmove(dst, src, bytes);
  return FSDP_OK;
}
static int cpu2_to_host(void *ctx, void *host_dst, const void *src, size_t bytes) {
  (void)ctx;
  cpu2_counts.to_host++;
  cpu2_counts.to_host_bytes += (long)bytes;
  if (bytes) memcpy(host_dst, src, bytes);
  return FSDP_OK;
}
static int cpu2_from_host(void *ctx, void *dst, const void *host_src, size_t bytes) {
  (void)ctx;
  cpu2_counts.from_host++;
  cpu2_counts.from_host_bytes += (long)bytes;
  if (bytes) memcpy(dst, host_src, bytes);
  return FSDP_OK;
}

static fsdp_device_i cpu2_device = {
    .name = "cpu2",
    .has_data = true,
    .host_memory = false,
    .alloc = cpu2_alloc,
    .alloc_uninit = cpu2_alloc_uninit,
    .free = cpu2_free,
    .copy = cpu2_copy,
    .to_host = cpu2_to_host,
    .from_host = cpu2_from_host,
    .memory_stats = cpu2_memory_stats,
    .memory_reset_peak = cpu2_memory_reset_peak,
};

/* The cpu's table without its optional fused slots, so the callers' paths for a device that
 * lacks them run here (and must give the cpu's bits). */
static fsdp_kernels_i cpu2_kernels;
static pthread_once_t cpu2_kernels_once = PTHREAD_ONCE_INIT;
static void cpu2_kernels_init(void) {
  cpu2_kernels = fsdp_cpu_kernels;
  cpu2_kernels.adamw_step_masked = NULL;
  cpu2_kernels.bias_gelu_forward = NULL;
  cpu2_kernels.bias_gelu_backward = NULL;
  cpu2_kernels.add_layernorm_forward = NULL;
}

/* Idempotent: registering the same table again only sets its kernels again. */
static inline int cpu2_register(void) {
  pthread_once(&cpu2_kernels_once, cpu2_kernels_init);
  return fsdp_device_register(&cpu2_device, &cpu2_kernels);
}

static inline void cpu2_reset(void) { memset(&cpu2_counts, 0, sizeof cpu2_counts); }

/* this thread's host transfers (either way) since its last reset */
static inline long cpu2_transfers(void) { return cpu2_counts.to_host + cpu2_counts.from_host; }

#endif
