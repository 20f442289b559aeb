/*
 * unit.h — FSDP units: a set of parameters laid out in one flat buffer and sharded across the
 * ranks of a communicator (DESIGN.md "Units and shards").
 *
 * Layout: the unit's distinct parameters, in the order given, each starting at a multiple of
 * FSDP_ALIGN elements, the total padded to a multiple of world * FSDP_ALIGN. With padded size P
 * and world W, the shard size is S = P / W and rank r holds elements [r*S, (r+1)*S).
 *
 * Parameter identity (invariant 1): a unit never replaces a parameter object. It only changes
 * what backs it (fsdp_tensor_set_storage): while the unit is sharded, every parameter is backed
 * by a no-data storage on the "sharded" device, so reading it raises "parameter <path> is
 * sharded: gather its unit (u:gather()) or use fsdp.full_params"; while gathered, each
 * parameter is a view into the unit's full flat buffer.
 *
 * Strategies: FULL (ZeRO-3) reshards after forward (except the root) and after backward;
 * GRAD_OP (ZeRO-2) keeps parameters gathered from forward until the end of backward; NONE
 * (replicated) keeps the full buffer on every rank, all-reduces (averages) gradients, and its
 * "shard" is the whole flat buffer.
 *
 * Gradients: during backward each parameter's .grad is a view into the unit's full flat
 * gradient buffer; when the unit's last pending backward use completes, that buffer is
 * reduce-scattered (average over ranks) and ADDED into the unit's gradient shard (so gradients
 * accumulate across backward calls until fsdp_unit_zero_grad), and the full buffer is freed.
 *
 * Everything here that communicates is collective: all ranks call it in the same order.
 * Units are refcounted (the tape's hook nodes hold references).
 */
#ifndef FSDP_UNIT_H
#define FSDP_UNIT_H

#include "comm/comm.h"
#include "core/core.h"

#define FSDP_ALIGN 16 /* elements: 64 bytes */

typedef enum { FSDP_STRATEGY_FULL = 0, FSDP_STRATEGY_GRAD_OP, FSDP_STRATEGY_NONE } fsdp_strategy;
typedef enum { FSDP_UNIT_SHARDED = 0, FSDP_UNIT_GATHERED } fsdp_unit_state;

/* The device that backs a sharded parameter (has no data; see above). */
extern const fsdp_device_i fsdp_device_sharded;

typedef struct fsdp_unit_param {
  fsdp_tensor *param; /* retained */
  char *path;         /* dotted path of the parameter's first use ("blocks.1.mlp.fc.weight") */
  int64_t offset;     /* first element in the flat buffer */
  int64_t numel;
  int ndim;
  int64_t shape[FSDP_MAX_DIMS];
} fsdp_unit_param;

typedef struct fsdp_unit_opts {
  fsdp_strategy strategy;
  bool is_root;
  bool reshard_after_forward; /* FULL only; default true (the root never reshards after forward) */
} fsdp_unit_opts;

typedef struct fsdp_unit fsdp_unit;

/* Collective. Build a unit over n distinct parameters (each full: owning dense data on the cpu
 * device, or meta — then the shard is left zero for a later materialize). Copies this rank's
 * slice into the new flat shard and leaves the unit SHARDED (NONE: gathered). Before anything
 * moves, the layout (paths and shapes) is compared across ranks: a mismatch is an error naming
 * the first differing parameter on each side, and nothing changes. */
int fsdp_unit_new(fsdp_unit **out, fsdp_comm *c, const char *path, fsdp_tensor *const *params,
                  const char *const *paths, int n, const fsdp_unit_opts *opts);
void fsdp_unit_retain(fsdp_unit *u);
void fsdp_unit_release(fsdp_unit *u);

/* Queries. Parameter indices are 0-based here (the Lua binding shows them 1-based). */
const char *fsdp_unit_path(const fsdp_unit *u);
int fsdp_unit_nparams(const fsdp_unit *u);
const fsdp_unit_param *fsdp_unit_param_at(const fsdp_unit *u, int i);
int64_t fsdp_unit_numel(const fsdp_unit *u);        /* sum of parameter numels */
int64_t fsdp_unit_padded_numel(const fsdp_unit *u); /* P */
int64_t fsdp_unit_shard_numel(const fsdp_unit *u);  /* S (P for NONE) */
int64_t fsdp_unit_shard_offset(const fsdp_unit *u); /* r*S (0 for NONE) */
fsdp_unit_state fsdp_unit_state_get(const fsdp_unit *u);
fsdp_strategy fsdp_unit_strategy(const fsdp_unit *u);
fsdp_comm *fsdp_unit_comm(const fsdp_unit *u);

bool fsdp_unit_is_root(const fsdp_unit *u);
const char *fsdp_strategy_name(fsdp_strategy s); /* "full", "grad_op", "none" */
/* Whether a prefetch (asynchronous all-gather) is in flight: issued, not yet consumed by a
 * gather (or dropped by a reshard). */
bool fsdp_unit_prefetching(const fsdp_unit *u);
/* "begin" hooks of this unit on the tape that have not run yet (uses still to backward). */
int fsdp_unit_pending_backward(const fsdp_unit *u);
/* true once fsdp_unit_unshard ran: the unit holds no parameters; everything but queries,
 * unshard and release is then an error. */
bool fsdp_unit_is_empty(const fsdp_unit *u);
/* The unit that owns parameter p (kept in p->user while p belongs to it), or NULL. Borrowed. */
fsdp_unit *fsdp_param_unit(const fsdp_tensor *p);
/* The part of parameter i that `rank` holds: returns its length (0 when none) and, 0-based,
 * where it starts in the parameter's flattened elements (*param_first) and in that rank's
 * shard (*shard_first). NONE: every rank holds every parameter whole. */
int64_t fsdp_unit_param_slice(const fsdp_unit *u, int i, int rank, int64_t *param_first,
                              int64_t *shard_first);
/* The flat shard (S elements, role params) and gradient shard (S elements, role grads) as 1-D
 * tensors; new references. Writes to them land in the shard. */
int fsdp_unit_shard(fsdp_unit *u, fsdp_tensor **out);
int fsdp_unit_grad_shard(fsdp_unit *u, fsdp_tensor **out);

/* Collective, idempotent. gather: all-gather the shards into a full buffer (role gathered) and
 * point every parameter into it (waits for a prefetch in flight). reshard: parameters back to
 * sharded, full buffer freed (a no-op for NONE). */
int fsdp_unit_gather(fsdp_unit *u);
int fsdp_unit_reshard(fsdp_unit *u);
/* Collective. Start the all-gather asynchronously (no-op if gathered or already in flight). */
int fsdp_unit_prefetch(fsdp_unit *u);
/* Collective. Copy the gathered full buffer's values back into this rank's shard (after a
 * user changed parameters through full_params/apply with writeback). Needs the unit gathered. */
int fsdp_unit_writeback(fsdp_unit *u);

/* Forward hooks (called by the Lua wrap layer around the unit module's forward). pre: gather
 * and, if gradients are recorded, push the unit's "begin" tape hook. post: push the "end" tape
 * hook (when recording) and reshard if the strategy says so. `next` (may be NULL) is the unit
 * to prefetch once this one is gathered (forward order). */
int fsdp_unit_pre_forward(fsdp_unit *u, fsdp_unit *next);
int fsdp_unit_post_forward(fsdp_unit *u);
/* The unit to prefetch when this unit's backward begins (reverse forward order); may be NULL. */
void fsdp_unit_set_backward_prefetch(fsdp_unit *u, fsdp_unit *prev);

/* Gradient shard := 0. */
int fsdp_unit_zero_grad(fsdp_unit *u);

/* Collective. Gather, give every parameter its own dense storage (role params) holding its
 * full values, and detach the parameters from the unit (the unit keeps no parameter). Used by
 * unwrap; the unit should then be released. */
int fsdp_unit_unshard(fsdp_unit *u);

#endif
