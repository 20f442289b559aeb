/*
 * tape.c — the per-thread tape, grad mode, backward, and the per-thread random streams.
 *
 * Ownership: the tape owns its nodes; a node owns one reference to each tensor it points at.
 * Backward frees each node right after running it, so the activations it saved are released
 * as early as the reverse walk allows (peak memory is the forward's, not forward + backward).
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd.h"
#include "kernels/kernels.h"

static _Thread_local bool grad_on = true;
static _Thread_local fsdp_node **tape;
static _Thread_local int64_t tape_len, tape_cap;
static _Thread_local bool in_backward;
/* fsdp_tape_push prunes when the tape reaches this length (then twice what survived) */
#define PRUNE_MIN 4096
static _Thread_local int64_t prune_at = PRUNE_MIN;

bool fsdp_grad_enabled(void) { return grad_on; }

bool fsdp_set_grad_enabled(bool on) {
  bool prev = grad_on;
  grad_on = on;
  return prev;
}

bool fsdp_needs_grad(fsdp_tensor *const *in, int n) {
  if (!grad_on) return false;
  for (int i = 0; i < n; i++)
    if (in[i] && in[i]->requires_grad) return true;
  return false;
}

fsdp_node *fsdp_node_new(const char *op, fsdp_backward_fn backward) {
  fsdp_node *n = calloc(1, sizeof *n);
  if (!n) {
    fsdp_error("%s: out of memory recording the autograd node", op);
    return NULL;
  }
  n->op = op;
  n->backward = backward;
  return n;
}

static void node_free(fsdp_node *n) {
  if (!n) return;
  /* A non-leaf's gradient only means something while its node is on the tape: a node dropped
   * without running (tape cleared, backward failed half-way) must not leave one behind. */
  if (n->out && !n->out->is_leaf) fsdp_tensor_set_grad(n->out, NULL);
  fsdp_tensor_release(n->out);
  for (int i = 0; i < n->nin; i++) fsdp_tensor_release(n->in[i]);
  for (int i = 0; i < n->nmore; i++) fsdp_tensor_release(n->more[i]);
  free(n->more);
  for (int i = 0; i < n->nsaved; i++) fsdp_tensor_release(n->saved[i]);
  if (n->hook_free) n->hook_free(n->hook_ud);
  free(n);
}

int fsdp_tape_push(fsdp_node *n) {
  if (tape_len >= prune_at) {
    fsdp_tape_prune();
    prune_at = tape_len * 2 > PRUNE_MIN ? tape_len * 2 : PRUNE_MIN;
  }
  if (tape_len == tape_cap) {
    int64_t cap = tape_cap ? tape_cap * 2 : 256;
    fsdp_node **t = realloc(tape, (size_t)cap * sizeof *t);
    if (!t) {
      const char *op = n->op;
      node_free(n);
      return fsdp_error("%s: out of memory growing the autograd tape", op);
    }
    tape = t;
    tape_cap = cap;
  }
  if (n->out) {
    for (int i = 0; i < n->nin; i++)
      if (n->in[i] && n->in[i]->storage == n->out->storage) n->out_aliases_input = true;
    for (int i = 0; i < n->nmore; i++)
      if (n->more[i] && n->more[i]->storage == n->out->storage) n->out_aliases_input = true;
  }
  tape[tape_len++] = n;
  return FSDP_OK;
}

int fsdp_tape_hook(fsdp_hook_fn fn, void *ud, void (*hook_free)(void *)) {
  fsdp_node *n = fsdp_node_new("hook", NULL);
  if (!n) {
    if (hook_free) hook_free(ud);
    return FSDP_ERR;
  }
  n->hook = fn;
  n->hook_ud = ud;
  n->hook_free = hook_free;
  return fsdp_tape_push(n);
}

int64_t fsdp_tape_size(void) { return tape_len; }

bool fsdp_tape_unhook(void *ud) {
  if (in_backward) return false;
  for (int64_t k = tape_len - 1; k >= 0; k--) {
    fsdp_node *n = tape[k];
    if (!n->hook || n->hook_ud != ud) continue;
    memmove(tape + k, tape + k + 1, (size_t)(tape_len - k - 1) * sizeof *tape);
    tape_len--;
    node_free(n);
    return true;
  }
  return false;
}

/* A node whose output only the node itself still references can never be reached: no newer
 * node consumes it (a consumer holds a reference) and nobody holds it to call backward on it.
 * Walking newest to oldest, freeing such a node drops its references to its inputs, which may
 * make older nodes unreachable in the same pass. Hook nodes stay: their place is their
 * meaning. */
int64_t fsdp_tape_prune(void) {
  if (in_backward) return 0;
  int64_t keep = tape_len, freed = 0;
  for (int64_t r = tape_len - 1; r >= 0; r--) {
    fsdp_node *n = tape[r];
    if (!n->hook && __atomic_load_n(&n->out->refcount, __ATOMIC_ACQUIRE) == 1) {
      node_free(n);
      freed++;
    } else {
      tape[--keep] = n; /* keep >= r: only slots already read are written */
    }
  }
  /* keep == 0: the kept nodes are in place (and an empty tape has no array: memmove(NULL, ...)
   * is undefined even for 0 bytes) */
  if (keep > 0) memmove(tape, tape + keep, (size_t)(tape_len - keep) * sizeof *tape);
  tape_len -= keep;
  return freed;
}

void fsdp_tape_clear(void) {
  /* Free newest first: mirrors backward, so outputs die before the inputs they came from. */
  while (tape_len > 0) node_free(tape[--tape_len]);
  free(tape);
  tape = NULL;
  tape_cap = 0;
}

/* fresh NULL: a new buffer is zero-filled; else it is left as allocated and *fresh says so */
static void *grad_acc(fsdp_tensor *t, bool *fresh) {
  if (fresh) *fresh = false;
  if (t->grad && t->grad_shared) {
    /* Another tensor's gradient, handed through (fsdp_grad_share), or a view of one (the
     * backward of view and contiguous). Once t holds the only reference left, to the tensor
     * and to its memory, it is t's own; before that, writing into it would change the other
     * tensors' gradients too, so t gets a copy. In the residual stream the sharers are done
     * by then (a node's output gradient is dropped once the node ran), so no copy is made. */
    fsdp_tensor *g = t->grad;
    if (__atomic_load_n(&g->refcount, __ATOMIC_ACQUIRE) > 1 ||
        __atomic_load_n(&g->storage->refcount, __ATOMIC_ACQUIRE) > 1) {
      fsdp_tensor *own;
      if (fsdp_tensor_new_uninit(&own, g->storage->device, g->dtype, g->ndim, g->shape,
                                 FSDP_ROLE_ACTIVATIONS))
        return NULL;
      if (fsdp_copy(own, g)) {
        fsdp_tensor_release(own);
        return NULL;
      }
      fsdp_tensor_set_grad(t, own);
      fsdp_tensor_release(own);
    }
    t->grad_shared = false;
  }
  if (!t->grad) {
    fsdp_tensor *g;
    fsdp_role role = t->is_leaf ? FSDP_ROLE_GRADS : FSDP_ROLE_ACTIVATIONS;
    const fsdp_device_i *dev = t->storage->device;
    if (fresh ? fsdp_tensor_new_uninit(&g, dev, t->dtype, t->ndim, t->shape, role)
              : fsdp_tensor_new(&g, dev, t->dtype, t->ndim, t->shape, role))
      return NULL;
    t->grad = g; /* the new reference moves into t */
    if (fresh) *fresh = true;
  }
  /* a write: whoever installed t->grad can see that a gradient arrived */
  fsdp_tensor_written(t->grad);
  return fsdp_tensor_data(t->grad, "gradient");
}

void *fsdp_grad_acc(fsdp_tensor *t) { return grad_acc(t, NULL); }

void *fsdp_grad_acc_fresh(fsdp_tensor *t, bool *fresh) { return grad_acc(t, fresh); }

bool fsdp_grad_share(fsdp_tensor *t, fsdp_tensor *g) {
  if (t->grad || t->is_leaf || !t->requires_grad || !fsdp_tensor_same_shape(t, g) ||
      t->dtype != g->dtype || t->storage->device != g->storage->device ||
      !fsdp_tensor_is_contiguous(g))
    return false;
  fsdp_tensor_set_grad(t, g);
  t->grad_shared = true;
  return true;
}

int fsdp_stamp_error(const fsdp_tensor *t, fsdp_stamp s, const char *what) {
  const bool direct = t->version != s.version;
  return fsdp_error("%s was modified in place%s after the forward (%s %llu, now %llu); modify a "
                    "clone() instead, or modify it after backward",
                    what, direct ? "" : " through another tensor over its memory (a view or "
                                        "detach())",
                    direct ? "version" : "its memory's version",
                    (unsigned long long)(direct ? s.version : s.storage_version),
                    (unsigned long long)(direct ? t->version : t->storage->version));
}

/* The tensors n's backward reads must be as they were when n was recorded. */
static int check_versions(const fsdp_node *n) {
  for (int k = 0; k <= n->nsaved; k++) {
    const fsdp_tensor *t = k < n->nsaved ? n->saved[k] : (n->reads_out ? n->out : NULL);
    fsdp_stamp want = k < n->nsaved ? n->saved_stamp[k] : n->out_stamp;
    if (t && fsdp_stamp_changed(t, want)) {
      char what[160];
      snprintf(what, sizeof what, "a tensor %s that %s saved for its gradient",
               FSDP_SHAPE_STR(t), n->op);
      return fsdp_stamp_error(t, want, what);
    }
  }
  return FSDP_OK;
}

static int walk(fsdp_tensor *root);

void fsdp_tape_enter(fsdp_tape_frame *saved) {
  *saved = (fsdp_tape_frame){.tape = tape, .len = tape_len, .cap = tape_cap,
                             .prune_at = prune_at, .in_backward = in_backward,
                             .grad_on = grad_on};
  tape = NULL;
  tape_len = tape_cap = 0;
  prune_at = PRUNE_MIN;
  in_backward = false;
  grad_on = true;
}

void fsdp_tape_leave(const fsdp_tape_frame *saved) {
  fsdp_tape_clear();
  tape = saved->tape;
  tape_len = saved->len;
  tape_cap = saved->cap;
  prune_at = saved->prune_at;
  in_backward = saved->in_backward;
  grad_on = saved->grad_on;
}

bool fsdp_tape_records(const fsdp_tensor *t) {
  for (int64_t k = tape_len - 1; k >= 0; k--) /* the output sought is almost always newest */
    if (tape[k]->out == t) return true;
  return false;
}

const fsdp_node *fsdp_tape_graph_behind(const fsdp_tensor *t, bool *is_out) {
  *is_out = false;
  /* Recorded ops make their outputs as activations: memory of another role (a parameter's, a
   * unit's gathered buffer, gradients, optimizer state) is a leaf's, whatever view of it is
   * written, even one a checkpoint node's output shares (a checkpointed forward may return a
   * view of a parameter). Optimizers and masks write there without a walk of the tape. */
  fsdp_role role = t->storage->role;
  if (t->is_param || (role != FSDP_ROLE_ACTIVATIONS && role != FSDP_ROLE_OTHER)) return NULL;
  /* The storage is compared, not the element ranges: an op's output owns its storage whole
   * (a fresh one), so every view of it is the graph's memory. A view node's output is its
   * input's memory (noted when recorded: FSDP swaps a parameter's storage after its views
   * were recorded), a leaf's when the input is one, so writing through it is writing that
   * leaf. Newest first: the tensor written is almost always recent. */
  for (int64_t k = tape_len - 1; k >= 0; k--) {
    const fsdp_node *n = tape[k];
    if (!n->hook && n->out && !n->out_aliases_input && n->out->storage == t->storage) {
      *is_out = n->out == t;
      return n;
    }
  }
  return NULL;
}

int fsdp_inplace_check(const fsdp_tensor *t, const char *what, const char *instead) {
  bool is_out;
  const fsdp_node *n = fsdp_tape_graph_behind(t, &is_out);
  if (!n) return FSDP_OK;
  /* affine is the engine's name for a tensor-and-number +, -, *, / (and neg) */
  const char *op = strcmp(n->op, "affine") == 0 ? "affine (a tensor and a number: +, -, *, /)"
                                                : n->op;
  char whose[192];
  if (is_out)
    snprintf(whose, sizeof whose, "was made by %s", op);
  else
    snprintf(whose, sizeof whose, "shares the memory of a tensor %s that was made by %s",
             FSDP_SHAPE_STR(n->out), op);
  return fsdp_error("%s: this tensor %s %s and is part of the autograd graph; an in-place "
                    "write is not recorded and would make the gradient wrong: %s%s "
                    "(docs/tensor.md \"Autograd and in-place updates\")",
                    what, FSDP_SHAPE_STR(t), whose, instead ? instead : "write into a clone()",
                    instead ? ", or write into a clone()" : " instead");
}

static _Atomic(fsdp_backward_epilogue_fn) epilogue;
/* walks running on this thread: a checkpointed region's backward runs inside its outer one */
static _Thread_local int walk_depth;

void fsdp_backward_set_epilogue(fsdp_backward_epilogue_fn fn) { atomic_store(&epilogue, fn); }

/* The walk of a backward whose root gradient is in place. */
static int run_walk(fsdp_tensor *root) {
  /* Hooks may run ops (FSDP gathers): nothing they do is recorded onto the tape being
   * consumed, and they cannot start a nested backward. */
  in_backward = true;
  bool prev = fsdp_set_grad_enabled(false);
  walk_depth++;
  int rc = walk(root);
  walk_depth--;
  fsdp_set_grad_enabled(prev);
  in_backward = false;
  fsdp_backward_epilogue_fn fn = atomic_load(&epilogue);
  if (walk_depth > 0 || !fn) return rc;
  if (!rc) return fn(); /* its message names what failed (FSDP's: "backward: unit ...") */
  /* the walk's message is the one to report: the epilogue's (a peer failed too) would hide it */
  char *msg = fsdp_strdup_printf("%s", fsdp_error_msg());
  (void)fn();
  fsdp_error("%s", msg ? msg : "backward failed (out of host memory for its message)");
  free(msg);
  return rc;
}

int fsdp_backward_adopt(fsdp_tensor *root, fsdp_tensor *grad) {
  if (in_backward) return fsdp_error("backward: called while a backward is running");
  if (root->is_leaf || !fsdp_tape_records(root))
    return fsdp_error("backward: tensor %s is not recorded on this tape", FSDP_SHAPE_STR(root));
  if (!fsdp_tensor_same_shape(grad, root) || grad->dtype != root->dtype ||
      !fsdp_tensor_is_contiguous(grad))
    return fsdp_error("backward: gradient %s does not fit tensor %s", FSDP_SHAPE_STR(grad),
                      FSDP_SHAPE_STR(root));
  if (root->grad) {
    if (fsdp_add_into(root->grad, grad, 1.0)) return fsdp_error_context("backward");
  } else {
    fsdp_tensor_set_grad(root, grad);
  }
  return run_walk(root);
}

int fsdp_backward(fsdp_tensor *root, fsdp_tensor *grad) {
  if (in_backward)
    return fsdp_error("backward: called while a backward is running (from a hook); record "
                      "the work and run it after backward returns");
  if (!root->requires_grad) {
    return fsdp_error("backward: the tensor %s does not require a gradient (nothing that "
                      "produced it requires one, or it was computed under no_grad)",
                      FSDP_SHAPE_STR(root));
  }
  if (!root->is_leaf) {
    /* The root must still be on the tape: otherwise its graph is gone (a second backward over
     * the same graph, or a cleared tape) and walking the tape would silently do nothing but
     * drop whatever else was recorded. The root is almost always the newest node. */
    int64_t k = tape_len - 1;
    while (k >= 0 && tape[k]->out != root) k--;
    if (k < 0)
      return fsdp_error("backward: the graph of tensor %s is no longer recorded (a backward "
                        "already ran over it: each consumes every graph recorded before it "
                        "ran, so sum the losses and run one backward; or the tape was "
                        "cleared)",
                        FSDP_SHAPE_STR(root));
  }
  if (grad) {
    if (!fsdp_tensor_same_shape(grad, root))
      return fsdp_error("backward: gradient shape %s does not match tensor shape %s",
                        FSDP_SHAPE_STR(grad), FSDP_SHAPE_STR(root));
  } else if (fsdp_tensor_numel(root) != 1) {
    return fsdp_error("backward: tensor %s has %lld elements; call backward on a scalar (e.g. "
                      "a loss) or pass a gradient of the same shape",
                      FSDP_SHAPE_STR(root), (long long)fsdp_tensor_numel(root));
  }
  if (!fsdp_grad_acc(root)) return fsdp_error_context("backward");
  if (grad) {
    if (fsdp_add_into(root->grad, grad, 1.0)) return fsdp_error_context("backward gradient");
  } else {
    fsdp_tensor *one;
    int rc = fsdp_tensor_new(&one, root->storage->device, root->dtype, root->ndim, root->shape,
                             FSDP_ROLE_ACTIVATIONS);
    if (!rc) rc = fsdp_fill(one, 1.0);
    if (!rc) rc = fsdp_add_into(root->grad, one, 1.0);
    fsdp_tensor_release(one);
    if (rc) return fsdp_error_context("backward");
  }
  /* d(leaf)/d(leaf): the seed is the whole answer; other recorded graphs stay recorded. */
  if (root->is_leaf) return FSDP_OK;
  return run_walk(root);
}

/* The reverse walk of fsdp_backward, once the root's gradient is seeded. */
static int walk(fsdp_tensor *root) {
  int rc = FSDP_OK;
  while (tape_len > 0) {
    fsdp_node *n = tape[--tape_len];
    if (n->hook) {
      rc = n->hook(n->hook_ud);
      if (rc) fsdp_error_context("backward hook");
    } else if (n->out->grad) {
      rc = check_versions(n);
      if (!rc) rc = n->backward(n);
      if (rc) fsdp_error_context("backward of %s", n->op);
      /* every consumer of a non-leaf output is newer, so its gradient is complete and used */
      if (!n->out->is_leaf) fsdp_tensor_set_grad(n->out, NULL);
    }
    node_free(n);
    if (rc) {
      fsdp_tape_clear(); /* a half-run backward leaves nothing usable behind */
      return FSDP_ERR;
    }
  }
  if (!root->is_leaf) fsdp_tensor_set_grad(root, NULL);
  return FSDP_OK;
}

/* ---- per-thread random streams -------------------------------------------------------- */

#define RNG_STREAMS FSDP_RNG_STREAMS
static _Thread_local uint64_t rng_seed = 0;
static _Thread_local struct {
  const char *name;
  uint64_t next;
} rng_streams[RNG_STREAMS];

void fsdp_rng_manual_seed(uint64_t seed) {
  rng_seed = seed;
  memset(rng_streams, 0, sizeof rng_streams);
}

uint64_t fsdp_rng_seed(void) { return rng_seed; }

uint64_t fsdp_rng_reserve(const char *stream, int64_t n, uint64_t *first) {
  int slot = -1;
  for (int i = 0; i < RNG_STREAMS; i++) {
    if (rng_streams[i].name && strcmp(rng_streams[i].name, stream) == 0) { slot = i; break; }
    if (!rng_streams[i].name && slot < 0) slot = i;
  }
  if (slot < 0) slot = RNG_STREAMS - 1; /* names are engine constants; never more than a few */
  if (!rng_streams[slot].name) rng_streams[slot].name = stream;
  *first = rng_streams[slot].next;
  /* keep each call's range aligned to a Philox block so normals pair up the same way */
  rng_streams[slot].next += (uint64_t)((n + 3) & ~(int64_t)3);
  return fsdp_rng_key(rng_seed, stream);
}

void fsdp_rng_get_state(fsdp_rng_state *s) {
  s->seed = rng_seed;
  for (int i = 0; i < RNG_STREAMS; i++) {
    s->name[i] = rng_streams[i].name;
    s->next[i] = rng_streams[i].next;
  }
}

void fsdp_rng_set_state(const fsdp_rng_state *s) {
  rng_seed = s->seed;
  for (int i = 0; i < RNG_STREAMS; i++) {
    rng_streams[i].name = s->name[i];
    rng_streams[i].next = s->next[i];
  }
}
