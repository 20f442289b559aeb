/*
 * storage.c — refcounted buffers on a device, charged to a memory domain.
 *
 * A storage owns its device memory (unless wrapped) and remembers the domain it was charged
 * to, so the last release — on whatever thread it happens — frees on the right device and
 * uncharges the right ledger. The refcount is the header's plain `int`, driven with the
 * GCC/Clang __atomic builtins (the operations C11 <stdatomic.h> compiles to): keeping the field
 * a plain int keeps the struct readable from any C (and FFI) code.
 */
#include <assert.h>
#include <stdlib.h>

#include "core/core.h"

uint64_t fsdp_storage_new_id(void) {
  static uint64_t last;
  return __atomic_add_fetch(&last, 1, __ATOMIC_RELAXED);
}

static int storage_new(fsdp_storage **out, const fsdp_device_i *dev, size_t bytes,
                       fsdp_role role, bool zero) {
  *out = NULL;
  if (!dev) return fsdp_error("storage: no device given");
  fsdp_mem_domain *domain = fsdp_mem_domain_current();
  if (fsdp_mem_charge(domain, dev, role, bytes) != FSDP_OK) return FSDP_ERR;
  fsdp_storage *s = malloc(sizeof *s);
  if (!s) {
    fsdp_mem_uncharge(domain, dev, role, bytes);
    return fsdp_error("storage: out of host memory for the storage header");
  }
  void *data = NULL;
  int (*alloc)(void *, void **, size_t) =
      !zero && dev->alloc_uninit ? dev->alloc_uninit : dev->alloc;
  if (alloc(dev->ctx, &data, bytes) != FSDP_OK) {
    free(s);
    fsdp_mem_uncharge(domain, dev, role, bytes);
    return FSDP_ERR;
  }
  *s = (fsdp_storage){.refcount = 1, .device = dev, .data = data, .bytes = bytes,
                      .role = role, .domain = domain, .id = fsdp_storage_new_id()};
  *out = s;
  return FSDP_OK;
}

int fsdp_storage_new(fsdp_storage **out, const fsdp_device_i *dev, size_t bytes,
                     fsdp_role role) {
  return storage_new(out, dev, bytes, role, true);
}

int fsdp_storage_new_uninit(fsdp_storage **out, const fsdp_device_i *dev, size_t bytes,
                            fsdp_role role) {
  return storage_new(out, dev, bytes, role, false);
}

int fsdp_storage_wrap(fsdp_storage **out, void *data, size_t bytes) {
  *out = NULL;
  if (!data && bytes) return fsdp_error("storage: cannot wrap NULL as %zu bytes", bytes);
  fsdp_storage *s = malloc(sizeof *s);
  if (!s) return fsdp_error("storage: out of host memory for the storage header");
  *s = (fsdp_storage){.refcount = 1, .device = &fsdp_device_cpu, .data = data,
                      .bytes = bytes, .role = FSDP_ROLE_OTHER, .domain = NULL,
                      .id = fsdp_storage_new_id()};
  *out = s;
  return FSDP_OK;
}

void fsdp_storage_retain(fsdp_storage *s) {
  if (s) __atomic_fetch_add(&s->refcount, 1, __ATOMIC_RELAXED);
}

void fsdp_storage_release(fsdp_storage *s) {
  if (!s) return;
  int old = __atomic_fetch_sub(&s->refcount, 1, __ATOMIC_ACQ_REL);
  assert(old > 0 && "storage released more often than retained");
  if (old != 1) return;
  if (s->domain) { /* owned and charged; wrapped memory belongs to the caller */
    s->device->free(s->device->ctx, s->data, s->bytes);
    fsdp_mem_uncharge(s->domain, s->device, s->role, s->bytes);
  }
  free(s);
}
