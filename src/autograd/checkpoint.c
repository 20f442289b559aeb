/*
 * checkpoint.c — activation checkpointing: a region of forward recorded as one node whose
 * backward recomputes the region (autograd.h, "activation checkpointing").
 *
 * The node retains the region's tensor inputs (in n->more) and the region's output alias (n->out);
 * nothing the region computed inside is kept. Its backward, in order: refuse inputs modified in
 * place since; save the random streams and switch to a tape of its own; put the streams back as
 * they were when the region first ran; recompute; back-propagate the node's output gradient
 * (adopted, so the bits are those a plain backward would see) through the inner tape, which
 * accumulates straight into the inputs' and parameters' gradients in the order a plain backward
 * would; drop the inner tape; restore the streams. So a run with checkpointing computes the
 * same bits as one without, and draws the same random numbers afterwards.
 */
#include <stdio.h>
#include <stdlib.h>

#include "autograd/autograd.h"
#include "kernels/kernels.h"

typedef struct {
  fsdp_recompute_fn fn;
  void *ud;
  void (*ud_free)(void *);
  fsdp_rng_state rng;
  fsdp_stamp *stamps; /* of n->more[k] when recorded */
} ckpt;

static void ckpt_free(void *p) {
  ckpt *c = p;
  if (!c) return;
  if (c->ud_free) c->ud_free(c->ud);
  free(c->stamps);
  free(c);
}

/* The gradient of y, the recomputed output, reaches what the region computed it from. */
static int propagate(fsdp_node *n, fsdp_tensor *y) {
  fsdp_tensor *out = n->out;
  if (!fsdp_tensor_same_shape(y, out) || y->dtype != out->dtype)
    return fsdp_error("checkpoint: the recomputation gave %s %s where the forward gave %s %s: "
                      "a checkpointed forward must compute the same thing when run again",
                      fsdp_dtype_name(y->dtype), FSDP_SHAPE_STR(y), fsdp_dtype_name(out->dtype),
                      FSDP_SHAPE_STR(out));
  if (fsdp_tape_records(y)) return fsdp_backward_adopt(y, out->grad);
  /* y was not computed on the inner tape: an input or a parameter handed through (or nothing
   * that requires a gradient) */
  if (!y->requires_grad) return FSDP_OK;
  if (!fsdp_grad_acc(y)) return FSDP_ERR;
  return fsdp_add_into(y->grad, out->grad, 1.0);
}

static int ckpt_backward(fsdp_node *n) {
  ckpt *c = n->hook_ud;
  for (int k = 0; k < n->nmore; k++)
    if (fsdp_stamp_changed(n->more[k], c->stamps[k])) {
      char what[160];
      snprintf(what, sizeof what, "checkpoint: input %d %s of the checkpointed region", k + 1,
               FSDP_SHAPE_STR(n->more[k]));
      return fsdp_stamp_error(n->more[k], c->stamps[k], what);
    }
  fsdp_rng_state now;
  fsdp_rng_get_state(&now);
  fsdp_tape_frame outer;
  fsdp_tape_enter(&outer);
  fsdp_rng_set_state(&c->rng);
  fsdp_tensor *y = NULL;
  int rc = c->fn(c->ud, n->more, n->nmore, &y);
  if (!rc) rc = propagate(n, y);
  fsdp_tensor_release(y);
  fsdp_tape_leave(&outer);
  fsdp_rng_set_state(&now);
  return rc;
}

int fsdp_op_checkpoint(fsdp_tensor **out, fsdp_tensor *y, fsdp_tensor *const *in, int nin,
                       const fsdp_rng_state *rng, fsdp_recompute_fn fn, void *ud,
                       void (*ud_free)(void *)) {
  *out = NULL;
  if (!fsdp_dtype_is_float(y->dtype)) {
    if (ud_free) ud_free(ud);
    return fsdp_error("checkpoint: the region's output is %s %s; only a floating output has a "
                      "gradient to recompute for", fsdp_dtype_name(y->dtype), FSDP_SHAPE_STR(y));
  }
  fsdp_tensor *o;
  if (fsdp_op_detach(&o, y)) {
    if (ud_free) ud_free(ud);
    return fsdp_error_context("checkpoint");
  }
  ckpt *c = calloc(1, sizeof *c);
  fsdp_node *n = c ? fsdp_node_new("checkpoint", ckpt_backward) : NULL;
  fsdp_tensor **more = nin ? calloc((size_t)nin, sizeof *more) : NULL;
  fsdp_stamp *stamps = nin ? calloc((size_t)nin, sizeof *stamps) : NULL;
  if (!c || !n || (nin && (!more || !stamps))) {
    free(c);
    free(n);
    free(more);
    free(stamps);
    fsdp_tensor_release(o);
    if (ud_free) ud_free(ud);
    return fsdp_error("checkpoint: out of host memory recording the node");
  }
  *c = (ckpt){.fn = fn, .ud = ud, .ud_free = ud_free, .rng = *rng, .stamps = stamps};
  n->hook_ud = c; /* not a hook node (hook stays NULL): node_free frees c through hook_free */
  n->hook_free = ckpt_free;
  for (int k = 0; k < nin; k++) {
    fsdp_tensor_retain(in[k]);
    more[k] = in[k];
    stamps[k] = fsdp_stamp_of(in[k]);
  }
  n->more = more;
  n->nmore = nin;
  o->requires_grad = true;
  o->is_leaf = false;
  fsdp_tensor_retain(o);
  n->out = o;
  n->out_stamp = fsdp_stamp_of(o);
  if (fsdp_tape_push(n)) { /* frees n (and c, the inputs, its reference to o) */
    fsdp_tensor_release(o);
    return FSDP_ERR;
  }
  *out = o;
  return FSDP_OK;
}
