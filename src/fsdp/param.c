/*
 * param.c — parameters made in place and filled from their random streams (param.h).
 */
#include <string.h>

#include "fsdp/param.h"
#include "kernels/kernels.h"

int fsdp_param_make(fsdp_tensor *t) {
  if (!t->is_leaf)
    return fsdp_error("Parameter: tensor %s was computed by a recorded op; pass a leaf (use "
                      "detach())",
                      FSDP_SHAPE_STR(t));
  int64_t n = fsdp_tensor_numel(t);
  if (t->storage->role != FSDP_ROLE_PARAMS || !fsdp_tensor_is_contiguous(t) || t->offset != 0 ||
      t->storage->bytes != (size_t)n * fsdp_dtype_size(t->dtype)) {
    fsdp_tensor *p;
    if (fsdp_tensor_new(&p, t->storage->device, t->dtype, t->ndim, t->shape, FSDP_ROLE_PARAMS))
      return FSDP_ERR;
    if (t->storage->device->has_data && fsdp_copy(p, t)) {
      fsdp_tensor_release(p);
      return FSDP_ERR;
    }
    fsdp_tensor_set_storage(t, p->storage, 0);
    memcpy(t->strides, p->strides, sizeof t->strides);
    fsdp_tensor_release(p);
  }
  t->requires_grad = fsdp_dtype_is_float(t->dtype); /* only float tensors can */
  t->is_param = true;
  return FSDP_OK;
}

int fsdp_param_init_random(fsdp_tensor *t, const char *what, uint64_t seed, const char *path,
                           bool normal, double a, double b, uint64_t first) {
  if (t->storage->device->has_data) {
    if (!fsdp_tensor_is_contiguous(t))
      return fsdp_error("%s: needs a contiguous tensor, got a strided view %s", what,
                        FSDP_SHAPE_STR(t));
    const fsdp_kernels_i *k = fsdp_kernels_for(t, what);
    void *d = k ? fsdp_tensor_data(t, what) : NULL;
    if (!d || k->random(t->storage->device->ctx, t->dtype, d, fsdp_tensor_numel(t),
                        fsdp_rng_key(seed, path), first, normal, a, b))
      return FSDP_ERR;
  }
  fsdp_tensor_written(t);
  return FSDP_OK;
}
