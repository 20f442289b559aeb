/*
 * dispatch.c — moving tensor data between dtypes, strides and devices through the kernel
 * tables: what autograd, the FSDP units and the binding use instead of loops over host
 * pointers. Core's fsdp_tensor_copy handles same-dtype copies core can do on its own (host
 * memory, or dense buffers between devices); everything else lands here.
 */
#include <string.h>

#include "kernels/kernels.h"

const fsdp_kernels_i *fsdp_kernels_for(const fsdp_tensor *t, const char *what) {
  if (!fsdp_tensor_data(t, what)) return NULL;
  return fsdp_kernels_of(t->storage->device, what);
}

static void dense_strides(int64_t *st, int nd, const int64_t *shape) {
  int64_t s = 1;
  for (int k = nd - 1; k >= 0; k--) {
    st[k] = s;
    s *= shape[k] ? shape[k] : 1;
  }
}

/* A contiguous copy of t on its own device, same dtype. */
static int dense_copy(fsdp_tensor **out, fsdp_tensor *t, fsdp_role role) {
  const fsdp_kernels_i *k = fsdp_kernels_for(t, "copy");
  if (!k) return FSDP_ERR;
  if (fsdp_tensor_new_uninit(out, t->storage->device, t->dtype, t->ndim, t->shape, role))
    return FSDP_ERR;
  int64_t st[FSDP_MAX_DIMS];
  dense_strides(st, t->ndim, t->shape);
  if (k->copy_strided(t->storage->device->ctx, t->dtype, fsdp_tensor_data(*out, "copy"), st,
                      fsdp_tensor_data(t, "copy"), t->strides, t->ndim, t->shape)) {
    fsdp_tensor_release(*out);
    *out = NULL;
    return FSDP_ERR;
  }
  return FSDP_OK;
}

int fsdp_copy(fsdp_tensor *dst, const fsdp_tensor *src) {
  const fsdp_device_i *ddev = dst->storage->device, *sdev = src->storage->device;
  bool plain = dst->dtype == src->dtype &&
               ((ddev->host_memory && sdev->host_memory) ||
                (fsdp_tensor_is_contiguous(dst) && fsdp_tensor_is_contiguous(src)));
  /* what core does alone, including every meta, no-data and shape error */
  if (plain || !ddev->has_data || !sdev->has_data || !fsdp_tensor_same_shape(dst, src))
    return fsdp_tensor_copy(dst, src);
  if (fsdp_tensor_numel(dst) == 0) {
    fsdp_tensor_written(dst);
    return FSDP_OK;
  }
  fsdp_tensor *s = (fsdp_tensor *)src, *tmp = NULL;
  int rc = FSDP_ERR;
  /* 1. the source's values, dense and in dst's dtype, still on the source's device */
  if (!fsdp_tensor_is_contiguous(s) || s->dtype != dst->dtype) {
    fsdp_tensor *dense = NULL;
    if (!fsdp_tensor_is_contiguous(s)) {
      if (dense_copy(&dense, s, FSDP_ROLE_ACTIVATIONS)) return fsdp_error_context("copy");
      s = dense;
    }
    if (s->dtype != dst->dtype) {
      /* a dense destination on the source's device takes the cast itself: no buffer in
       * between and no second pass over the values (every mixed-precision gather and gradient
       * conversion goes this way); any other gets a dense buffer in its dtype on the source's
       * device, moved to it in step 2 */
      const bool direct =
          fsdp_tensor_is_contiguous(dst) && ddev == sdev && dst->storage != s->storage;
      const fsdp_kernels_i *k = fsdp_kernels_for(s, "copy");
      if (!k || (!direct && fsdp_tensor_new_uninit(&tmp, sdev, dst->dtype, s->ndim, s->shape,
                                                   FSDP_ROLE_ACTIVATIONS))) {
        fsdp_tensor_release(dense);
        return fsdp_error_context("copy");
      }
      void *to = fsdp_tensor_data(direct ? dst : tmp, "copy");
      rc = to ? k->cast(sdev->ctx, to, dst->dtype, fsdp_tensor_data(s, "copy"), s->dtype,
                        fsdp_tensor_numel(s))
              : FSDP_ERR;
      fsdp_tensor_release(dense);
      if (rc) {
        fsdp_tensor_release(tmp);
        return fsdp_error_context("copy");
      }
      if (direct) {
        fsdp_tensor_written(dst);
        return FSDP_OK;
      }
      s = tmp;
    } else {
      tmp = dense;
    }
  }
  /* 2. into dst: directly when dst is dense (core moves dense bytes between devices), else
   * onto dst's device first and then through its strided copy */
  if (fsdp_tensor_is_contiguous(dst) || (ddev == sdev && ddev->host_memory)) {
    rc = fsdp_tensor_copy(dst, s);
  } else {
    fsdp_tensor *near = NULL;
    const fsdp_kernels_i *k = fsdp_kernels_for(dst, "copy");
    rc = !k || fsdp_tensor_new_uninit(&near, ddev, dst->dtype, dst->ndim, dst->shape,
                                      FSDP_ROLE_ACTIVATIONS);
    if (!rc && s->storage->device != ddev) rc = fsdp_tensor_copy(near, s);
    const fsdp_tensor *from = s->storage->device != ddev ? near : s;
    if (!rc) {
      int64_t st[FSDP_MAX_DIMS];
      dense_strides(st, dst->ndim, dst->shape);
      rc = k->copy_strided(ddev->ctx, dst->dtype, fsdp_tensor_data(dst, "copy"), dst->strides,
                           fsdp_tensor_data(from, "copy"), st, dst->ndim, dst->shape);
      if (!rc) fsdp_tensor_written(dst);
    }
    fsdp_tensor_release(near);
    if (rc) rc = FSDP_ERR;
  }
  fsdp_tensor_release(tmp);
  return rc ? fsdp_error_context("copy") : FSDP_OK;
}

int fsdp_to(fsdp_tensor **out, fsdp_tensor *t, const fsdp_device_i *dev, fsdp_dtype dt,
            int role) {
  *out = NULL;
  if (t->storage->device == dev && t->dtype == dt && fsdp_tensor_is_contiguous(t)) {
    fsdp_tensor_retain(t);
    *out = t;
    return FSDP_OK;
  }
  if (!fsdp_tensor_data(t, "to")) return FSDP_ERR;
  fsdp_tensor *o;
  fsdp_role r = role >= 0 ? (fsdp_role)role : t->storage->role;
  if (fsdp_tensor_new_uninit(&o, dev, dt, t->ndim, t->shape, r)) return FSDP_ERR;
  if (fsdp_copy(o, t)) {
    fsdp_tensor_release(o);
    return FSDP_ERR;
  }
  o->version = 0;
  *out = o;
  return FSDP_OK;
}

int fsdp_to_host(fsdp_tensor **out, fsdp_tensor *t) {
  *out = NULL;
  if (!fsdp_tensor_data(t, "to host")) return FSDP_ERR;
  if (t->storage->device->host_memory && fsdp_tensor_is_contiguous(t)) {
    fsdp_tensor_retain(t);
    *out = t;
    return FSDP_OK;
  }
  return fsdp_to(out, t, &fsdp_device_cpu, t->dtype, FSDP_ROLE_ACTIVATIONS);
}

int fsdp_add_into(fsdp_tensor *dst, const fsdp_tensor *src, double alpha) {
  if (!fsdp_tensor_same_shape(dst, src))
    return fsdp_error("add: shapes %s and %s differ", FSDP_SHAPE_STR(dst), FSDP_SHAPE_STR(src));
  if (!fsdp_tensor_is_contiguous(dst))
    return fsdp_error("add: the destination %s must be contiguous", FSDP_SHAPE_STR(dst));
  const fsdp_kernels_i *k = fsdp_kernels_for(dst, "add");
  if (!k || !fsdp_tensor_data(src, "add")) return FSDP_ERR;
  fsdp_tensor *s;
  if (fsdp_to(&s, (fsdp_tensor *)src, dst->storage->device, dst->dtype, FSDP_ROLE_ACTIVATIONS))
    return fsdp_error_context("add");
  int rc = k->axpy(dst->storage->device->ctx, dst->dtype, fsdp_tensor_data(dst, "add"),
                   fsdp_tensor_data(s, "add"), alpha, fsdp_tensor_numel(dst));
  fsdp_tensor_release(s);
  if (!rc) fsdp_tensor_written(dst);
  return rc;
}

int fsdp_fill(fsdp_tensor *t, double v) {
  const fsdp_device_i *dev = t->storage->device;
  /* core fills host memory in place, and knows the meta and sharded rules */
  if (dev->host_memory || !dev->has_data) return fsdp_tensor_fill(t, v);
  const fsdp_kernels_i *k = fsdp_kernels_for(t, "fill");
  if (!k) return FSDP_ERR;
  int64_t n = fsdp_tensor_numel(t);
  int rc;
  if (fsdp_tensor_is_contiguous(t)) {
    rc = k->fill(dev->ctx, t->dtype, fsdp_tensor_data(t, "fill"), v, n);
  } else { /* a dense block of v, then one strided copy into t */
    fsdp_tensor *d;
    if (fsdp_tensor_new_uninit(&d, dev, t->dtype, t->ndim, t->shape, FSDP_ROLE_ACTIVATIONS))
      return FSDP_ERR;
    int64_t st[FSDP_MAX_DIMS];
    dense_strides(st, t->ndim, t->shape);
    rc = k->fill(dev->ctx, t->dtype, fsdp_tensor_data(d, "fill"), v, n);
    if (!rc)
      rc = k->copy_strided(dev->ctx, t->dtype, fsdp_tensor_data(t, "fill"), t->strides,
                           fsdp_tensor_data(d, "fill"), st, t->ndim, t->shape);
    fsdp_tensor_release(d);
  }
  if (rc) return fsdp_error_context("fill");
  fsdp_tensor_written(t);
  return FSDP_OK;
}
