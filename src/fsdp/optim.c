/*
 * optim.c — optimizer updates and sums of squares (optim.h): the checks, then one kernel call.
 */
#include <math.h>

#include "fsdp/optim.h"
#include "kernels/kernels.h"

/* The data of buffer t of an update of parameter p (role names it in messages), or NULL. */
static void *state(const fsdp_tensor *t, const fsdp_tensor *p, const char *fn,
                   const char *role) {
  int64_t n = fsdp_tensor_numel(p);
  if (fsdp_tensor_numel(t) != n) {
    fsdp_error("%s: %s has %lld elements, the parameter has %lld", fn, role,
               (long long)fsdp_tensor_numel(t), (long long)n);
    return NULL;
  }
  if (!fsdp_tensor_is_contiguous(t)) {
    fsdp_error("%s: %s must be contiguous", fn, role);
    return NULL;
  }
  if (t->storage->device != p->storage->device) {
    fsdp_error("%s: %s is on the %s device, the parameter on %s", fn, role,
               t->storage->device->name, p->storage->device->name);
    return NULL;
  }
  if (t->dtype != p->dtype) {
    fsdp_error("%s: %s is %s, the parameter %s", fn, role, fsdp_dtype_name(t->dtype),
               fsdp_dtype_name(p->dtype));
    return NULL;
  }
  return fsdp_tensor_data(t, fn);
}

int fsdp_optim_sgd_step(fsdp_tensor *p, const fsdp_tensor *g, fsdp_tensor *buf, float lr,
                        float momentum, float weight_decay, bool first_step) {
  const char *fn = "sgd_step";
  void *pd, *gd, *bd = NULL;
  if (!(pd = state(p, p, fn, "parameter")) || !(gd = state(g, p, fn, "gradient")) ||
      (buf && !(bd = state(buf, p, fn, "momentum buffer"))))
    return FSDP_ERR;
  if (momentum != 0.0f && !buf)
    return fsdp_error("%s: momentum %g needs a buffer", fn, (double)momentum);
  const fsdp_kernels_i *k = fsdp_kernels_for(p, fn);
  if (!k || k->sgd_step(p->storage->device->ctx, p->dtype, pd, bd, gd, fsdp_tensor_numel(p),
                        lr, momentum, weight_decay, first_step))
    return FSDP_ERR;
  fsdp_tensor_written(p);
  if (buf) fsdp_tensor_written(buf);
  return FSDP_OK;
}

int fsdp_optim_adamw_step(fsdp_tensor *p, fsdp_tensor *g, fsdp_tensor *m, fsdp_tensor *v,
                          const fsdp_tensor *mask, float lr, float beta1, float beta2, float eps,
                          float weight_decay, float grad_scale, int64_t step) {
  const char *fn = "adamw_step";
  void *pd, *gd, *md, *vd, *kd = NULL;
  if (!(pd = state(p, p, fn, "parameter")) || !(gd = state(g, p, fn, "gradient")) ||
      !(md = state(m, p, fn, "first moment")) || !(vd = state(v, p, fn, "second moment")) ||
      (mask && !(kd = state(mask, p, fn, "mask"))))
    return FSDP_ERR;
  if (step < 1) return fsdp_error("%s: step must be an integer >= 1", fn);
  if (!(grad_scale >= 0.0f) || !isfinite(grad_scale))
    return fsdp_error("%s: grad_scale must be a finite number >= 0 (got %g)", fn,
                      (double)grad_scale);
  const fsdp_kernels_i *k = fsdp_kernels_for(p, fn);
  if (!k) return FSDP_ERR;
  void *ctx = p->storage->device->ctx;
  const int64_t n = fsdp_tensor_numel(p);
  int rc;
  if (!mask)
    rc = k->adamw_step(ctx, p->dtype, pd, md, vd, gd, n, lr, beta1, beta2, eps, weight_decay,
                       grad_scale, step);
  else if (k->adamw_step_masked) /* optional: one pass */
    rc = k->adamw_step_masked(ctx, p->dtype, pd, md, vd, gd, kd, n, lr, beta1, beta2, eps,
                              weight_decay, grad_scale, step);
  else
    rc = k->mask_apply(ctx, p->dtype, gd, kd, n) ||
         k->adamw_step(ctx, p->dtype, pd, md, vd, gd, n, lr, beta1, beta2, eps, weight_decay,
                       grad_scale, step) ||
         k->mask_apply(ctx, p->dtype, pd, kd, n);
  if (rc) return FSDP_ERR;
  fsdp_tensor_written(p);
  fsdp_tensor_written(m);
  fsdp_tensor_written(v);
  if (mask) fsdp_tensor_written(g);
  return FSDP_OK;
}

int fsdp_optim_sumsq(fsdp_tensor *t, double *out) {
  *out = 0;
  if (!fsdp_tensor_data(t, "sumsq")) return FSDP_ERR;
  fsdp_tensor *c; /* t itself when dense, else a dense copy on t's device */
  if (fsdp_to(&c, t, t->storage->device, t->dtype, FSDP_ROLE_ACTIVATIONS)) return FSDP_ERR;
  const fsdp_kernels_i *k = fsdp_kernels_for(c, "sumsq");
  int rc = !k || k->sumsq(c->storage->device->ctx, c->dtype, out, fsdp_tensor_data(c, "sumsq"),
                          fsdp_tensor_numel(c));
  fsdp_tensor_release(c);
  return rc ? FSDP_ERR : FSDP_OK;
}
