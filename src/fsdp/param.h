/*
 * param.h — making a tensor a parameter, and filling parameters with their initial values
 * (lua/fsdp/nn: nn.Parameter, path-based initialisation; fsdp.materialize on a shard's slice).
 *
 * Invariant 1 (docs/ARCHITECTURE.md): a parameter is an object with a stable identity. Both
 * functions change what backs a tensor or its values, never which object it is.
 */
#ifndef FSDP_PARAM_H
#define FSDP_PARAM_H

#include <stdbool.h>
#include <stdint.h>

#include "core/core.h"

/* Make t (a leaf) a parameter in place: its values move into a storage of its own, dense and
 * accounted as params, unless they already are; is_param is set, and requires_grad when t is of
 * a float dtype (an integer or bool parameter holds values kept with the model). A tensor
 * computed by a recorded op is an error ("Parameter: tensor (2, 3) was computed by a recorded
 * op; pass a leaf (use detach())"). */
int fsdp_param_make(fsdp_tensor *t);

/* Fill t with elements [first, first + numel) of the Philox stream of (seed, path): normal
 * (mean a, std b) or uniform in [a, b), on t's device and in its dtype. So a rank fills its
 * shard's slice of a parameter with exactly the values a whole-parameter fill puts there. A
 * tensor on a device without data (meta) is left as it is: its values come at materialize
 * time. t must be contiguous; `what` names the caller in messages. Bumps t->version. */
int fsdp_param_init_random(fsdp_tensor *t, const char *what, uint64_t seed, const char *path,
                           bool normal, double a, double b, uint64_t first);

#endif
