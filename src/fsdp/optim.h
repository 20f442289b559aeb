/*
 * optim.h — what lua/fsdp/optim.lua steps with: the optimizer updates and the sum of squares of
 * a gradient (clipping, overflow checks), on one rank's buffers (a parameter, or a slice of a
 * unit's flat shard, with its gradient and state). The math is the kernel table's of the
 * parameter's device (kernels/kernels.h, "optimizers"), which decides the dtypes it updates;
 * the Lua library decides what to step and when, and communicates.
 *
 * Every buffer of an update is contiguous, has the parameter's number of elements, device and
 * dtype; a mismatch is an error naming the function and the buffer ("adamw_step: second moment
 * has 3 elements, the parameter has 4"). Updates are in place and bump the versions of what
 * they write (the parameter and the state).
 */
#ifndef FSDP_OPTIM_H
#define FSDP_OPTIM_H

#include <stdbool.h>
#include <stdint.h>

#include "core/core.h"

/* SGD (PyTorch's): buf is the momentum buffer, NULL without momentum (momentum != 0 needs
 * one); first_step initialises it from the gradient. */
int fsdp_optim_sgd_step(fsdp_tensor *p, const fsdp_tensor *g, fsdp_tensor *buf, float lr,
                        float momentum, float weight_decay, bool first_step);
/* AdamW (PyTorch's): m and v the first and second moments, step the 1-based step count.
 * The step uses g times grad_scale (finite, >= 0: gradient clipping's coefficient, 1 for none,
 * 0 for an infinite norm), bit for bit scaling g first, without writing g. mask (NULL: none)
 * is a pruning mask of p's shape: g is masked, the step taken and p masked
 * (lua/fsdp/mask.lua's rule), in one pass where the device has adamw_step_masked, else as the
 * three calls; g is written then (masked, not scaled). */
int fsdp_optim_adamw_step(fsdp_tensor *p, fsdp_tensor *g, fsdp_tensor *m, fsdp_tensor *v,
                          const fsdp_tensor *mask, float lr, float beta1, float beta2, float eps,
                          float weight_decay, float grad_scale, int64_t step);
/* *out = the sum of the squares of t's elements, in double, on t's device (any strides: a
 * strided t is made dense on its device first). */
int fsdp_optim_sumsq(fsdp_tensor *t, double *out);

#endif
