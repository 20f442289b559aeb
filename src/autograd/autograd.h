/*
 * autograd.h — the tape (a Wengert list) and the differentiable ops built on the kernels.
 *
 * Every op that runs while gradients are enabled and has an input that requires a gradient
 * appends one node to the calling thread's tape. A node retains its output, its inputs and
 * whatever it saved for backward; so activations live exactly as long as the tape needs them.
 * fsdp_backward walks the tape from the newest node to the oldest: a node whose output got a
 * gradient accumulates (+=) into its inputs' gradients; then the node is freed and, for a
 * non-leaf output, so is that output's gradient. Leaf tensors that require a gradient
 * (parameters) keep theirs in t->grad and accumulate across backward calls until dropped.
 *
 * Hook nodes carry a callback instead of math: backward calls it when it reaches the node's
 * place in the tape. FSDP uses them to gather a unit before its backward and reduce-scatter
 * its gradients after.
 *
 * The tape is per thread: each rank (a thread, with its own Lua state) has its own.
 */
#ifndef FSDP_AUTOGRAD_H
#define FSDP_AUTOGRAD_H

#include "core/core.h"
#include "kernels/kernels.h"

#define FSDP_NODE_MAX_IN 4
#define FSDP_NODE_MAX_SAVED 4

typedef int (*fsdp_backward_fn)(fsdp_node *n);
typedef int (*fsdp_hook_fn)(void *ud);

/* What a backward needs to tell that a tensor it reads was written since the forward: the
 * tensor's own version, and the version of the storage under it with that storage's id. A write
 * through another tensor over the same memory (a view, detach()) bumps only the storage's; as in
 * PyTorch, a write into a part of the memory the saved tensor does not cover counts too. Not
 * writes: a storage swapped since (an FSDP parameter resharded and gathered again), and writes
 * into an FSDP unit's flat buffers (fsdp_storage.unit_books: storage_id 0, never an id), which
 * hold many parameters and which the unit checks against its shard itself. */
typedef struct {
  uint64_t version, storage_id, storage_version;
} fsdp_stamp;

static inline fsdp_stamp fsdp_stamp_of(const fsdp_tensor *t) {
  return (fsdp_stamp){t->version, t->storage->unit_books ? 0 : t->storage->id,
                      t->storage->version};
}

static inline bool fsdp_stamp_changed(const fsdp_tensor *t, fsdp_stamp s) {
  return t->version != s.version ||
         (t->storage->id == s.storage_id && t->storage->version != s.storage_version);
}
/* The error for a changed t: "<what> was modified in place [through another tensor over its
 * memory] after the forward (...)" with the versions that tell, and what to do instead. */
int fsdp_stamp_error(const fsdp_tensor *t, fsdp_stamp s, const char *what);

struct fsdp_node {
  const char *op; /* for error messages: "linear", "layernorm", ... */
  fsdp_backward_fn backward;
  fsdp_backward_fn impl; /* for backward's own use (ops.c: the op's backward behind a wrapper) */
  fsdp_tensor *out; /* retained */
  int nin;
  fsdp_tensor *in[FSDP_NODE_MAX_IN]; /* retained; NULL for optional inputs (bias) */
  int nmore;
  fsdp_tensor **more; /* owned array of further inputs, retained (cat of many tensors) */
  int nsaved;
  fsdp_tensor *saved[FSDP_NODE_MAX_SAVED]; /* retained */
  float f[4];    /* scalar arguments */
  int64_t i[8];  /* integer arguments (sizes, dims) */
  /* Stamps of saved[k] and of out when recorded: backward refuses to read a tensor that was
   * modified in place since, instead of computing a wrong gradient. */
  fsdp_stamp saved_stamp[FSDP_NODE_MAX_SAVED];
  fsdp_stamp out_stamp;
  bool reads_out;    /* backward reads out's values (exp, softmax, ...): out is checked too */
  /* out shared an input's storage when recorded (view, transpose, narrow): its memory is that
   * input's, not made by this op (fsdp_tape_push sets it; fsdp_inplace_check reads it) */
  bool out_aliases_input;
  fsdp_hook_fn hook; /* hook node when non-NULL */
  void *hook_ud;
  void (*hook_free)(void *ud); /* called once when the node is freed; may be NULL */
};

/* ---- grad mode ----------------------------------------------------------------------- */
bool fsdp_grad_enabled(void);
bool fsdp_set_grad_enabled(bool on); /* returns the previous mode */

/* ---- tape ----------------------------------------------------------------------------- */
/* A fresh node (zeroed), not yet on the tape. NULL with an error on OOM. */
fsdp_node *fsdp_node_new(const char *op, fsdp_backward_fn backward);
/* Append n to this thread's tape (takes ownership; frees it on failure). */
int fsdp_tape_push(fsdp_node *n);
/* Record a hook node; ud is freed with hook_free when the node is freed (run or discarded). */
int fsdp_tape_hook(fsdp_hook_fn fn, void *ud, void (*hook_free)(void *));
/* Take the hook node whose user data is ud off the tape, newest first, and free it (its
 * hook_free runs): a hook pushed before a stretch of ops that recorded nothing it is needed
 * for. false when no such node is on the tape (or backward runs: the walk owns the tape). */
bool fsdp_tape_unhook(void *ud);
int64_t fsdp_tape_size(void);
/* Free the nodes nothing can reach any more (their output is referenced by the tape alone, and
 * so, transitively, are their inputs' producers): the graph of a forward whose results were
 * dropped without backward (an evaluation run with gradients on). Hook nodes are kept. Returns
 * how many nodes were freed. fsdp_tape_push runs it as the tape grows; the Lua binding runs it
 * after each collection it triggers. A no-op while backward runs. */
int64_t fsdp_tape_prune(void);
/* Drop every recorded node without running backward (frees saved activations). */
void fsdp_tape_clear(void);

/* A tape of its own, for the recomputation of a checkpointed region inside a backward:
 * fsdp_tape_enter saves this thread's tape, grad mode and backward state in *saved and starts
 * an empty tape with grad mode on and no backward running (so a backward over it may run);
 * fsdp_tape_leave frees whatever the inner tape still holds and brings *saved back. Calls
 * nest (a checkpoint inside a checkpoint's recomputation). */
typedef struct {
  fsdp_node **tape;
  int64_t len, cap, prune_at;
  bool in_backward, grad_on;
} fsdp_tape_frame;
void fsdp_tape_enter(fsdp_tape_frame *saved);
void fsdp_tape_leave(const fsdp_tape_frame *saved);
/* Whether t is the output of a node of the current tape. */
bool fsdp_tape_records(const fsdp_tensor *t);

/* In-place writes (the Lua methods add_, mul_, fill, zero, copy, set, and every function that
 * writes into a tensor it is given) are not recorded: a write into the memory of a graph still
 * to be differentiated would leave its values and its gradient disagreeing, silently. The node
 * of this thread's tape such a write into t would go behind: one that made the memory t views
 * (its output shares t's storage and was not a view of one of its inputs), whatever t is: that
 * output, a recorded view of it, a detach(), a view made under no_grad; in any grad mode.
 * *is_out: t is that node's output. NULL when nothing live is behind t: a leaf's memory
 * (parameters, inputs, optimizer state, and views of them, recorded or not), a tensor outside
 * any graph, a graph that backward has consumed or that was cleared. Memory of the roles
 * params, gathered, grads and optim is never a graph's. O(tape) for activations (and role
 * other), while the tape holds nodes. */
const fsdp_node *fsdp_tape_graph_behind(const fsdp_tensor *t, bool *is_out);
/* FSDP_OK when a write into t is safe (above), else FSDP_ERR with a message naming `what`
 * (the method or function), t, the op behind it and what to do instead: `instead` (e.g.
 * "write t = t * s instead (recorded)"; NULL: a clone() alone). */
int fsdp_inplace_check(const fsdp_tensor *t, const char *what, const char *instead);

/* Run backward from `root`. grad NULL means d(root)/d(root) = 1, only for a one-element root.
 * Consumes the whole tape (see above); root must still be on it (a second backward over the
 * same graph is an error, not a silent no-op). A leaf root only gets its seed and leaves the
 * tape alone. While it runs, grad mode is off (hooks may run ops; nothing is recorded) and a
 * nested fsdp_backward (from a hook) is an error. A saved tensor modified in place since its
 * op ran, through itself or another tensor over its memory (fsdp_stamp), fails the backward
 * with a message naming the op. */
int fsdp_backward(fsdp_tensor *root, fsdp_tensor *grad);

/* A function run on the backward's thread when its outermost backward ends, after the walk
 * (also when it failed): the layer above finishes there what its hooks left in flight (FSDP's
 * gradient reductions). Its error (with its own message) fails a backward that had none; after
 * a failed walk it runs for its cleanup and the walk's message stays. One per process, set
 * before any backward that needs it (setting it again replaces it). */
typedef int (*fsdp_backward_epilogue_fn)(void);
void fsdp_backward_set_epilogue(fsdp_backward_epilogue_fn fn);

/* fsdp_backward from root (recorded on the current tape, without a gradient yet) with `grad`
 * (root's shape and dtype, contiguous) as its gradient: the buffer itself is adopted
 * (retained), not copied, so its values reach root's producers bit for bit. */
int fsdp_backward_adopt(fsdp_tensor *root, fsdp_tensor *grad);

/* The gradient buffer of t, created zero-filled when absent (contiguous, t's shape). Used by
 * backward functions before they accumulate. Role: grads for leaves, activations otherwise.
 * Every call counts as an in-place write of t->grad (its version is bumped), so whoever set
 * t->grad to a buffer of its own can tell whether any gradient reached t since. */
void *fsdp_grad_acc(fsdp_tensor *t);
/* The same for a backward function that overwrites every element of a new buffer: when t has
 * no gradient yet, the buffer is created uninitialised and *fresh is true (the caller writes it
 * whole, or zero-fills it if it fails); otherwise *fresh is false and the caller accumulates.
 * Saves the zero-fill and the read of the zeros for the first gradient of an activation. */
void *fsdp_grad_acc_fresh(fsdp_tensor *t, bool *fresh);
/* Make g (a gradient computed for another tensor, e.g. a sum's output) t's gradient as it is,
 * without a copy, when t is an activation (not a leaf) with no gradient yet and g fits it (shape,
 * dtype, device, contiguous); false, changing nothing, otherwise. The buffer stays shared until
 * the other holders drop it: fsdp_grad_acc(t) writes into a copy while they have not. Leaves
 * never share: parameters' gradients are modified in place after backward (clipping, the
 * optimizer), which must not reach another parameter. */
bool fsdp_grad_share(fsdp_tensor *t, fsdp_tensor *g);
/* Whether op outputs from these inputs need recording. */
bool fsdp_needs_grad(fsdp_tensor *const *in, int n);

/* ---- differentiable ops (ops.c) --------------------------------------------------------
 * All return FSDP_OK and a new tensor in *out (one reference), or FSDP_ERR with a message that
 * names the op and the shapes involved. Inputs may be any strided view: ops make contiguous
 * copies where their kernels need them. */

typedef enum { FSDP_OP_ADD, FSDP_OP_SUB, FSDP_OP_MUL, FSDP_OP_DIV } fsdp_binary_op;
/* Broadcasting: the smaller operand's shape must be a suffix of the larger's. */
int fsdp_op_binary(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b, fsdp_binary_op op);
/* out = a * s + t */
int fsdp_op_affine(fsdp_tensor **out, fsdp_tensor *a, float s, float t);

int fsdp_op_unary(fsdp_tensor **out, fsdp_tensor *a, fsdp_unary_op op);
int fsdp_op_pow(fsdp_tensor **out, fsdp_tensor *a, float p);
/* gelu(x + b), b of x's last dim (a linear's bias): one pass forward and one backward (bias
 * gradient included) where the device has the bias_gelu slots and x is f32, bf16 or f16, else
 * add then gelu; the same values either way up to the rounding of the bias sum's order. */
int fsdp_op_bias_gelu(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *b);

int fsdp_op_matmul(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b);
int fsdp_op_linear(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *w, fsdp_tensor *b);
int fsdp_op_embedding(fsdp_tensor **out, fsdp_tensor *ids, fsdp_tensor *w);
int fsdp_op_layernorm(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *w, fsdp_tensor *b,
                      float eps);
/* sum = a + b (one shape and dtype) and out = layernorm(sum, w, b): a residual add and the
 * layernorm after it in one pass over memory where the device has the fused slot (the same
 * values and gradients as fsdp_op_binary then fsdp_op_layernorm, which it calls otherwise). */
int fsdp_op_add_layernorm(fsdp_tensor **sum, fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b,
                          fsdp_tensor *w, fsdp_tensor *bias, float eps);
int fsdp_op_softmax(fsdp_tensor **out, fsdp_tensor *x, int dim); /* dim 0-based */
int fsdp_op_attention(fsdp_tensor **out, fsdp_tensor *qkv, int n_head);
/* Dropout draws from the thread's seeded stream (fsdp_rng_next_dropout). */
int fsdp_op_dropout(fsdp_tensor **out, fsdp_tensor *x, float p);
int fsdp_op_cross_entropy(fsdp_tensor **out, fsdp_tensor *logits, fsdp_tensor *targets,
                          int ignore_index);
int fsdp_op_mse(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b);
int fsdp_op_sum(fsdp_tensor **out, fsdp_tensor *a);            /* all elements, 0-dim */
int fsdp_op_mean(fsdp_tensor **out, fsdp_tensor *a);
int fsdp_op_sum_dim(fsdp_tensor **out, fsdp_tensor *a, int dim, bool mean); /* dim 0-based */

/* A copy of a on dev (NULL: a's device) with dtype dt; a itself (retained) when it already is
 * both. Recorded for float dtypes: the gradient goes back converted to a's device and dtype.
 * To meta gives a shape-only tensor. */
int fsdp_op_to(fsdp_tensor **out, fsdp_tensor *a, const fsdp_device_i *dev, fsdp_dtype dt);

/* Views, recorded so gradients flow through them. */
int fsdp_op_view(fsdp_tensor **out, fsdp_tensor *a, int ndim, const int64_t *shape);
int fsdp_op_transpose(fsdp_tensor **out, fsdp_tensor *a, int d0, int d1);
int fsdp_op_narrow(fsdp_tensor **out, fsdp_tensor *a, int dim, int64_t start, int64_t len);
int fsdp_op_contiguous(fsdp_tensor **out, fsdp_tensor *a);
/* Comparisons: out = a cmp b elementwise, bool, not recorded (operands promoted as binary
 * ops, broadcast by suffix either way). */
int fsdp_op_compare(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b, fsdp_cmpop op);
/* out = cond ? a : b elementwise; cond any dtype (nonzero is true); the three broadcast by
 * suffix to the largest shape; a and b promoted. Gradients flow to a and b. */
int fsdp_op_where(fsdp_tensor **out, fsdp_tensor *cond, fsdp_tensor *a, fsdp_tensor *b);
/* out = min(max(a, lo), hi); NaN stays NaN; the gradient passes where lo <= a <= hi */
int fsdp_op_clamp(fsdp_tensor **out, fsdp_tensor *a, double lo, double hi);
/* Concatenate n >= 1 tensors along dim (0-based): same dtype, device and shape but for dim. */
int fsdp_op_cat(fsdp_tensor **out, fsdp_tensor *const *ts, int n, int dim);
/* Stack n >= 1 tensors of one shape along a new dim (0-based, 0..ndim). */
int fsdp_op_stack(fsdp_tensor **out, fsdp_tensor *const *ts, int n, int dim);
/* Maximum (max true) or minimum of a along dim: values (recorded; the gradient goes to the
 * chosen element) and/or indices (i64, 0-based, not recorded); either out may be NULL. The dim
 * is removed from the shape, unless keepdim. NaN counts as the largest and the smallest. Errors
 * name the op as the user called it: max or min, argmax or argmin when values is NULL. */
int fsdp_op_extreme(fsdp_tensor **values, fsdp_tensor **indices, fsdp_tensor *a, int dim,
                    bool max, bool keepdim);
/* The k largest (or smallest) along dim, sorted, with their i64 indices (ties: lower index
 * first). values recorded; either out may be NULL. sort is topk with k = the dim's size. */
int fsdp_op_topk(fsdp_tensor **values, fsdp_tensor **indices, fsdp_tensor *a, int64_t k,
                 int dim, bool largest);

/* A new tensor sharing storage, not recorded, requires_grad false. */
int fsdp_op_detach(fsdp_tensor **out, fsdp_tensor *a);

/* ---- random streams (tape.c) ----------------------------------------------------
 * Per-thread seed (fsdp.manual_seed) and the offsets of the anonymous streams (randn,
 * dropout). Same seed and same sequence of calls => same values on every rank. */
void fsdp_rng_manual_seed(uint64_t seed);
uint64_t fsdp_rng_seed(void);
/* The whole state of this thread's streams (seed and offsets), to run a region again with the
 * draws it had (activation checkpointing). Stream names are engine constants. */
#define FSDP_RNG_STREAMS 4
typedef struct {
  uint64_t seed;
  const char *name[FSDP_RNG_STREAMS];
  uint64_t next[FSDP_RNG_STREAMS];
} fsdp_rng_state;
void fsdp_rng_get_state(fsdp_rng_state *s);
void fsdp_rng_set_state(const fsdp_rng_state *s);
/* Reserve n elements of the named anonymous stream: returns its key, and the first element
 * index in *first. */
uint64_t fsdp_rng_reserve(const char *stream, int64_t n, uint64_t *first);

/* ---- activation checkpointing (checkpoint.c) -------------------------------------------
 * A region of forward (a module's forward) that ran with recording off, so it saved no
 * activations, is recorded as ONE node. Its backward runs the region again through
 * fsdp_recompute_fn: on a tape of its own (fsdp_tape_enter), grad mode on, the random
 * streams as they were when the region first ran (same dropout masks), with the same input
 * tensors; then it back-propagates the node's output gradient through that tape into the
 * inputs' and parameters' gradients and restores the streams, so the run continues exactly as
 * without checkpointing. Whatever the region needs for its recomputation that is not one of its
 * tensor inputs (its parameters: FSDP's "end" hook has gathered them by then) is fn's. */

/* Recompute the region from its inputs in[0..nin) (the tensors it was first given); *out gets
 * its output (one reference). FSDP_ERR with a message on failure. */
typedef int (*fsdp_recompute_fn)(void *ud, fsdp_tensor *const *in, int nin, fsdp_tensor **out);

/* Record the region that computed y (with recording off) from in[0..nin), the random streams
 * being `rng` before it ran. *out: a new tensor sharing y's storage, which requires a gradient;
 * its node retains the inputs and refuses to run when one was modified in place since (its
 * version changed). ud is freed with ud_free (may be NULL) when the node is freed, run or not,
 * and when this call fails. y must be of a floating dtype. */
int fsdp_op_checkpoint(fsdp_tensor **out, fsdp_tensor *y, fsdp_tensor *const *in, int nin,
                       const fsdp_rng_state *rng, fsdp_recompute_fn fn, void *ud,
                       void (*ud_free)(void *));

#endif
