/*
 * device.c — the device registry and the two built-in devices.
 *
 * A device is a vtable (fsdp_device_i). Callers never ask which device they hold, only whether
 * it has data. Adding a device (cuda) means one more const instance and one more entry in
 * `registry` below; nothing else in the engine changes. The registry order is fixed (cpu
 * first) because it is also the column order of the memory report.
 *
 * cpu: 64-byte aligned, zero-filled host memory. meta: shape only — alloc hands back NULL and
 * free does nothing, so a meta model of any size costs no memory.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

/* ---- cpu ------------------------------------------------------------------------------- */

#define CPU_ALIGN 64

/* calloc keeps its lazy zeroing (fresh pages from the kernel are not written twice, which
 * matters for multi-GB parameter buffers); we over-allocate by CPU_ALIGN, round up, and keep
 * calloc's pointer just below the aligned block so free can find it. calloc returns at least
 * 16-byte aligned memory, so the gap is 16..64 bytes: room for the pointer. */
static int cpu_alloc(void **out, size_t bytes) {
  *out = NULL;
  if (bytes > SIZE_MAX - 2 * CPU_ALIGN)
    return fsdp_error("cpu: cannot allocate %zu bytes (size overflow)", bytes);
  unsigned char *raw = calloc(1, bytes + CPU_ALIGN);
  if (!raw) return fsdp_error("cpu: out of memory allocating %zu bytes", bytes);
  uintptr_t aligned = ((uintptr_t)raw + CPU_ALIGN) & ~(uintptr_t)(CPU_ALIGN - 1);
  ((void **)aligned)[-1] = raw;
  *out = (void *)aligned;
  return FSDP_OK;
}

static void cpu_free(void *ptr, size_t bytes) {
  (void)bytes;
  if (ptr) free(((void **)ptr)[-1]);
}

static int cpu_copy(void *dst, const void *src, size_t bytes) {
  if (bytes) memmove(dst, src, bytes);
  return FSDP_OK;
}

const fsdp_device_i fsdp_device_cpu = {
    .name = "cpu",
    .has_data = true,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy = cpu_copy,
};

/* ---- meta ------------------------------------------------------------------------------- */

static int meta_alloc(void **out, size_t bytes) {
  (void)bytes;
  *out = NULL;
  return FSDP_OK;
}

static void meta_free(void *ptr, size_t bytes) { (void)ptr, (void)bytes; }

const fsdp_device_i fsdp_device_meta = {
    .name = "meta",
    .has_data = false,
    .alloc = meta_alloc,
    .free = meta_free,
    .copy = NULL, /* optional slot: nothing to copy */
};

/* ---- registry ------------------------------------------------------------------------------ */

static const fsdp_device_i *const registry[] = {&fsdp_device_cpu, &fsdp_device_meta};
#define NREGISTRY ((int)(sizeof registry / sizeof registry[0]))
_Static_assert(NREGISTRY <= FSDP_MAX_DEVICES, "raise FSDP_MAX_DEVICES");

int fsdp_device_count(void) { return NREGISTRY; }

const fsdp_device_i *fsdp_device_at(int i) {
  return i >= 0 && i < NREGISTRY ? registry[i] : NULL;
}

int fsdp_device_index(const fsdp_device_i *dev) {
  for (int i = 0; i < NREGISTRY; i++)
    if (registry[i] == dev) return i;
  return -1;
}

const fsdp_device_i *fsdp_device_find(const char *name) {
  if (name)
    for (int i = 0; i < NREGISTRY; i++)
      if (strcmp(registry[i]->name, name) == 0) return registry[i];
  char known[128] = "";
  size_t len = 0;
  for (int i = 0; i < NREGISTRY && len < sizeof known; i++)
    len += (size_t)snprintf(known + len, sizeof known - len, "%s%s", i ? ", " : "",
                            registry[i]->name);
  fsdp_error("unknown device '%s' (known devices: %s)", name ? name : "(null)", known);
  return NULL;
}
