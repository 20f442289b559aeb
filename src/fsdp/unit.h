/*
 * unit.h — FSDP units: a set of parameters laid out in one flat buffer and sharded across the
 * ranks of a communicator (docs/ARCHITECTURE.md "Units and shards").
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
 * "shard" is the whole flat buffer. HYBRID (HSDP) is FULL over the unit's communicator, the
 * shard group (fsdp_comm_hybrid), with every gradient shard then averaged across the replicate
 * communicator (opts.replicate): a reduce-scatter inside the group, an all-reduce of the shard
 * across the groups, so every replica of a shard holds the average over all ranks.
 *
 * Gradients: during backward each parameter's .grad is a view into the unit's full flat
 * gradient buffer; when the unit's last pending backward use completes, that buffer is
 * reduce-scattered (average over ranks) and ADDED into the unit's gradient shard (so gradients
 * accumulate across backward calls until fsdp_unit_zero_grad), and the full buffer is freed
 * (with gradient sync off it is kept instead and reduced later: fsdp_unit_set_grad_sync).
 * Which parameters received a gradient is noted per parameter (fsdp_unit_param_has_grad).
 *
 * Backward protocol: pre_forward pushes a "begin" hook node onto the tape and post_forward an
 * "end" hook node, so the unit's ops lie between them. Backward reaches "end" first: it gathers
 * the unit (prefetching the backward-prefetch unit) and points each parameter's .grad into a
 * zeroed full gradient buffer (role grads); a gradient a parameter already has from an op
 * outside the unit's forward is added into it. "begin" fires after all the unit's ops: when it
 * is the unit's last pending use (a unit called k times has k begin/end pairs) it reduces, frees
 * the full gradient, drops the parameters' .grad and reshards (FULL and GRAD_OP, root too).
 * A parameter used by two units belongs to their closest common ancestor unit, whose
 * begin/end pair encloses the inner units' pairs, so it is gathered (and has its .grad)
 * whenever an inner unit's op touches it, forward or backward.
 *
 * Prefetch safety: a prefetch (asynchronous all-gather) reads the shard until it is consumed,
 * and a gather consumes it as is. So nothing may change a shard while its prefetch is in
 * flight. The engine keeps that true on its own where it can: a backward prefetch is issued
 * only for a unit whose backward is still to come, the root drops every unconsumed prefetch
 * of the thread at the end of its forward, and the end of every backward does (autograd's
 * epilogue, which also lands the gradient reduction in flight: so an optimizer step after
 * backward never races one). Without a root unit, reshard (or gather) a unit whose forward
 * prefetch may be left over before changing its shard.
 *
 * Errors name the unit ("gather: unit 'blocks.1': ...") and, where there is one, the parameter
 * path; layout errors start with "wrap: ". Parameter numbers in messages are 1-based.
 *
 * Everything here that communicates is collective: all ranks call it in the same order, and
 * every decision to communicate depends only on state that is the same on every rank.
 * Units are refcounted (the tape's hook nodes hold references); releasing never communicates.
 * Units and their parameters belong to one rank thread (the in-flight prefetch list is per
 * thread).
 */
#ifndef FSDP_UNIT_H
#define FSDP_UNIT_H

#include "comm/comm.h"
#include "core/core.h"

#define FSDP_ALIGN 16 /* elements: 64 bytes */

typedef enum {
  FSDP_STRATEGY_FULL = 0,
  FSDP_STRATEGY_GRAD_OP,
  FSDP_STRATEGY_NONE,
  FSDP_STRATEGY_HYBRID
} fsdp_strategy;
typedef enum { FSDP_UNIT_SHARDED = 0, FSDP_UNIT_GATHERED } fsdp_unit_state;

/* The device that backs a sharded parameter (has no data; see above). It is not in core's
 * device registry: its storages hold no bytes and are not accounted. A parameter's `device`
 * reads "sharded". */
extern fsdp_device_i fsdp_device_sharded;

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
  /* FULL only; the root never reshards after forward. "Default true" means: the Lua binding and
   * fsdp_unit_new(opts = NULL) use true; a zero-initialised C struct says false. */
  bool reshard_after_forward;
  /* Overlap each unit's gradient reduction with the rest of the backward (default true, as
   * reshard_after_forward; fsdp.wrap's prefetch option): its collective is started at the
   * unit's last "begin" hook and lands in the gradient shard before the next unit's starts, or
   * when the backward ends (unit.c, "reducing"), so one more full gradient is alive meanwhile.
   * Off: each reduction completes before the backward goes on. Not for hybrid, whose second
   * collective must follow the first on every rank at the same point. */
  bool overlap_reduce;
  /* Mixed precision (f32 = off; a zero-initialised struct says f32). param_dtype: the dtype the
   * forward and backward gather the parameters in (f32, bf16 or f16): the all-gather moves that
   * dtype, the parameters and their gradients have it while gathered for compute.
   * reduce_dtype: the dtype gradients are reduce-scattered in (f32 or bf16). The shard, the
   * gradient shard (and so the optimizer) stay f32; fsdp_unit_gather (full_params, apply,
   * unwrap) gathers the f32 masters. */
  fsdp_dtype param_dtype;
  fsdp_dtype reduce_dtype;
  /* Where the unit's buffers live; NULL: its parameters' device (the cpu when they are all meta).
   * Set, it must be the device of every parameter with data: it says where meta parameters'
   * shards go (a model built on meta, materialized straight onto that device). */
  const fsdp_device_i *device;
  /* CPU offload: the shard and the gradient shard (and so the optimizer's state and step) live
   * in host memory (the cpu device) while the parameters compute on the unit's device; a gather
   * copies the shard up first (in the compute dtype), the reduced gradient comes down into the
   * gradient shard. The unit's device must not be the cpu, and the strategy must shard (full or
   * grad_op: none computes on the shard itself). */
  bool offload;
  /* HYBRID only (and required there): the ranks holding the same shard in the other groups;
   * borrowed, it must outlive the unit (fsdp_comm_hybrid's pair lives as long as its parent). */
  fsdp_comm *replicate;
} fsdp_unit_opts;

typedef struct fsdp_unit fsdp_unit;

/* Collective. Build a unit over n distinct f32 parameters (each full: owning dense data on one
 * device with kernels, the same for all of them, or meta — then the shard is left zero for a
 * later materialize); the unit's buffers live on that device (cpu when all are meta). Copies this rank's
 * slice into the new flat shard and leaves the unit SHARDED (NONE: gathered). Before anything
 * moves, the layout (paths and shapes) is compared across ranks: a mismatch is an error naming
 * the first differing parameter on each side, and nothing changes, e.g.
 *   "wrap: unit 'blocks.1' differs across ranks at parameter 3: rank 0 has blocks.1.fc.weight
 *    (16, 16), rank 1 has blocks.1.fc.bias (16)"
 *   "wrap: unit 'b' differs across ranks: rank 0 has 4 parameters, rank 1 has 5; at parameter 5
 *    rank 0 has none, rank 1 has b.extra (4)"
 * (rank 0 against the first rank that differs from it). This rank's own checks (a parameter
 * listed twice, already in a unit — "wrap: parameter <path> already belongs to unit '<u>' ...",
 * not f32, on a device without kernels or another one than the others, not a leaf, a
 * param_dtype or reduce_dtype units do not take) are made collective the same way: the failing
 * rank gets its message, every other rank "wrap: unit '<path>' failed on rank R: <message>". The
 * check costs one all-gather of 3 i64 per rank (more only on a mismatch), labelled with the
 * unit path.
 * On success each parameter: gets its path as label (for error messages), loses any .grad,
 * gets contiguous strides, is backed by the sharded storage (NONE: by the shard) at its flat
 * offset, and records its unit in p->user (fsdp_param_unit). opts NULL: FULL, not root,
 * reshard_after_forward. */
int fsdp_unit_new(fsdp_unit **out, fsdp_comm *c, const char *path, fsdp_tensor *const *params,
                  const char *const *paths, int n, const fsdp_unit_opts *opts);
void fsdp_unit_retain(fsdp_unit *u);
/* The last release waits for (and discards) a prefetch in flight and lets go of the
 * parameters, which stay as they are: released while sharded they keep no data (unshard
 * first to keep the values). NULL is a no-op. */
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
const char *fsdp_strategy_name(fsdp_strategy s); /* "full", "grad_op", "none", "hybrid" */
/* HYBRID: the replicate communicator; NULL for the other strategies. */
fsdp_comm *fsdp_unit_replicate_comm(const fsdp_unit *u);
/* Whether a prefetch (asynchronous all-gather) is in flight: issued, not yet consumed by a
 * gather (or dropped by a reshard). */
bool fsdp_unit_prefetching(const fsdp_unit *u);
/* Whether the unit's gradient reduction is in flight (overlap_reduce): started by its backward,
 * not yet added into the gradient shard. The backward's end lands it, as does anything that
 * reads or changes the gradient shard (fsdp_unit_grad_shard, zero_grad, reduce_held,
 * unshard) and the next unit's reduction. */
bool fsdp_unit_reducing(const fsdp_unit *u);
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
 * tensors; new references to the same tensor on every call (an optimizer may key its state on
 * it). Writes to them land in the shard. NONE: the parameters view the shard itself. The
 * gradient shard is made (zeros) by the first backward or the first call here, so a unit that
 * never trained holds no gradient memory; making it can fail (out of memory, naming the unit).
 * fsdp_unit_grad_shard lands a reduction in flight first (fsdp_unit_reducing): the gradient
 * shard it gives is final. */
int fsdp_unit_shard(fsdp_unit *u, fsdp_tensor **out);
int fsdp_unit_grad_shard(fsdp_unit *u, fsdp_tensor **out);

/* Collective, idempotent. gather: all-gather the f32 shards into a full buffer (role gathered)
 * and point every parameter into it (waits for a prefetch in flight). reshard: parameters back
 * to sharded, full buffer freed (NONE: back to viewing the shard; a no-op without mixed
 * precision). A unit gathered in the compute dtype (mixed precision, between a forward and its
 * backward) is resharded and gathered again in f32 by gather; backward gathers in the compute
 * dtype again before its ops read the parameters.
 * The gathered values are a copy of the shards, and nothing is lost or read stale silently:
 * reshard (and every path that reshards: the end of a unit's forward or backward, unshard) fails
 * while a parameter has been written in place since the gather or the last writeback (the
 * change would be dropped), and gather fails on a unit still gathered whose shard has been
 * written since (its parameters hold the old values). reshard_discard drops such a change. */
int fsdp_unit_gather(fsdp_unit *u);
int fsdp_unit_reshard(fsdp_unit *u);
int fsdp_unit_reshard_discard(fsdp_unit *u);
/* The caller wrote the same change into the shard and into the gathered parameters (a mask
 * set while gathered): both hold the same values again, and the change is kept. */
int fsdp_unit_accept_changes(fsdp_unit *u);
/* Gathered, and its copy and its shard no longer match (a parameter or the shard written since
 * the gather or the last writeback): what reshard and gather refuse. Local: callers that must
 * fail on every rank agree on it first (the Lua Root's check_clean). */
bool fsdp_unit_dirty(const fsdp_unit *u);
/* While gathered: the parameters' dtype (f32, or the param dtype when gathered for compute). */
fsdp_dtype fsdp_unit_gathered_dtype(const fsdp_unit *u);
const fsdp_unit_opts *fsdp_unit_options(const fsdp_unit *u);
/* Collective. Start the all-gather, in the compute dtype, asynchronously (no-op if gathered or
 * already in flight, and for NONE). */
int fsdp_unit_prefetch(fsdp_unit *u);
/* Collective. Copy the gathered full buffer's values back into this rank's shard (after a
 * user changed parameters through full_params/apply with writeback). Needs the unit gathered
 * in f32 (fsdp_unit_gather; gathered in a compute dtype it is an error: the masters would be
 * rounded). Reads each parameter's current data (normally its view of the full buffer). */
int fsdp_unit_writeback(fsdp_unit *u);

/* Forward hooks (called by the Lua wrap layer around the unit module's forward). pre: gather
 * (consuming a prefetch), then prefetch `next` (may be NULL: the unit whose forward comes next,
 * in forward order), and with grad mode on push the "begin" hook. post: the use is recorded
 * when pre pushed a "begin" and either out_needs_grad (the module's output requires a
 * gradient: backward will pass through the unit's ops) or some parameter of the unit requires
 * one; then it pushes the matching "end" hook, else it takes the "begin" off the tape again
 * (a frozen unit that no gradient passes: its backward is never needed). Then reshard:
 * recorded — FULL when not root and reshard_after_forward, GRAD_OP and NONE never (backward
 * needs them); not recorded — FULL and GRAD_OP always, root included. The root's post also
 * drops leftover prefetches (see "Prefetch safety").
 * Frozen parameters (requires_grad false) get no .grad in backward; a unit none of whose
 * parameters requires a gradient makes no full gradient, reduces nothing and keeps no gradient
 * shard: its backward, when recorded, only gathers (for the gradients passing through it). A
 * partly frozen unit reduces its whole flat gradient, as an unfrozen one (frozen ranges are
 * zeros). Every rank must freeze the same parameters: the collectives depend on it. */
int fsdp_unit_pre_forward(fsdp_unit *u, fsdp_unit *next);
int fsdp_unit_post_forward(fsdp_unit *u, bool out_needs_grad);
/* Whether some parameter of the unit requires a gradient. */
bool fsdp_unit_trainable(const fsdp_unit *u);
/* Set p->requires_grad (p any tensor; the caller checked it may require one). Allowed at any
 * time: a unit's forward decides from it whether its backward is recorded, the backward which
 * parameters get gradients and whether the unit reduces (a change between a forward and its
 * backward applies to that backward). Freezing a unit's last trainable parameter frees the
 * unit's gradient shard (unless a recorded backward of the unit is still to come: then its
 * zero_grad does). Local, never fails. */
void fsdp_param_set_requires_grad(fsdp_tensor *p, bool on);
/* The unit to prefetch when this unit's "end" hook fires in backward: the unit whose backward
 * comes next, i.e. the one whose post_forward ran just before this unit's (for a root around
 * units 1..N run in order: root -> N, k -> k-1). Prefetched only if its backward is pending.
 * prev is retained (a cycle of prefetch units would keep them alive: set NULL to break one;
 * unshard clears it); u itself is ignored. */
void fsdp_unit_set_backward_prefetch(fsdp_unit *u, fsdp_unit *prev);

/* Gradient shard := 0, and no parameter has a gradient (fsdp_unit_param_has_grad). A full
 * gradient held with sync off (below) is dropped (zeroed instead while a backward is inside
 * the unit); a unit with no trainable parameter frees its gradient shard instead. */
int fsdp_unit_zero_grad(fsdp_unit *u);
/* The same for parameter i alone (0-based; a module inside a wrapped model that is not a unit,
 * or holds part of one, dropping its parameters' gradients): its range of the gradient shard
 * and of a full gradient held with sync off (or accumulating in a backward) := 0, and it has
 * no gradient (fsdp_unit_param_has_grad), so an optimizer skips it as a plain one skips a nil
 * p.grad. Local, never communicates; an error for a bad i. */
int fsdp_unit_zero_param_grad(fsdp_unit *u, int i);

/* Gradient synchronisation (fsdp.no_sync; on by default). With sync off, the backward that
 * completes the unit's uses keeps its full gradient (P elements of the gradient dtype, on the
 * unit's device) instead of reducing it: the parameters lose their .grad views and reshard as
 * usual, the next backward adds into the same buffer, and the first one that completes with
 * sync on reduce-scatters (NONE: all-reduces) the sum once, adds it into the gradient shard
 * and frees the buffer. So k backwards cost one reduction and P more elements per unit held
 * between them. Which parameters got a gradient is noted as usual. A recorded graph dropped
 * without a backward leaves the held gradient alone; unshard drops it. Local, never
 * communicates: every rank must set it alike, since it decides whether a backward reduces. */
void fsdp_unit_set_grad_sync(fsdp_unit *u, bool sync);
bool fsdp_unit_grad_sync(const fsdp_unit *u);
/* Whether the unit holds a full gradient accumulated with sync off that no backward with sync
 * on has reduced yet (the gradient shard does not include it: reduce it before a step). */
bool fsdp_unit_grad_unreduced(const fsdp_unit *u);
/* Collective. Reduce a held full gradient now, as the next backward with sync on would (into
 * the gradient shard, the buffer freed); nothing when the unit holds none. For an optimizer
 * step after a backward that left the unit out (layer drop) or that ran with sync off. An
 * error while a backward is inside the unit. */
int fsdp_unit_reduce_held(fsdp_unit *u);
/* Whether parameter i received a gradient on THIS rank since the last zero_grad (or since the
 * unit was made): some backward function accumulated into its .grad while the unit's backward
 * ran (a zero gradient counts), or it already had a .grad from an op outside the unit's
 * forward when the "end" hook came. A parameter that got none has a zero gradient shard, which
 * an optimizer must not mistake for a zero gradient (PyTorch skips a parameter whose grad is
 * None: no weight decay, no moment update). Ranks may differ (a parameter used on some ranks'
 * data only); the gradient shard holds the average over all ranks, so a caller agrees the flags
 * across ranks (fsdp.optim: one all_reduce "max" per step over all units). Local, never
 * communicates; false for a bad i. */
bool fsdp_unit_param_has_grad(const fsdp_unit *u, int i);

/* Collective. Gather, give every parameter its own dense storage (role params) holding its
 * full values, and detach the parameters from the unit (the unit keeps no parameter; p->user
 * cleared; labels stay; grads dropped). Used by unwrap; the unit should then be released.
 * Idempotent. Afterwards the unit is empty: numel 0, state SHARDED, and gather, reshard,
 * prefetch, writeback, zero_grad, forward hooks, shard and grad_shard are errors ("... was
 * unsharded (unwrapped) and holds no parameters"). The shard and gradient shard are freed at
 * once; views of them still held (fsdp.shard) have no data from then on, so reading or writing
 * through one is an error ("... is a view of the shard of a unit that was unsharded ...")
 * instead of a write that goes nowhere. A backward over a graph recorded through the unit
 * before the unshard fails when its gradients reach the unit's former parameters ("backward:
 * unit '<path>' was unsharded (fsdp.unwrap) after the forward that recorded this graph ...",
 * the gradients it gave them dropped); one that only passes a dropped graph's hooks goes on. */
int fsdp_unit_unshard(fsdp_unit *u);

#endif
