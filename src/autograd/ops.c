/*
 * ops.c — differentiable ops: validate shapes, dtypes and devices, run the forward kernel of the
 * inputs' device (its kernel table: kernels/kernels.h), record a tape node whose backward calls
 * the matching backward kernel. Nothing here names a device or loops over tensor data.
 *
 * Gradient buffers are always contiguous in the logical (row-major) order of their tensor's
 * shape, whatever the tensor's own strides, and have the tensor's dtype. So a kernel that reads
 * contiguous copies of its inputs writes input gradients straight into fsdp_grad_acc(original
 * input); only the view ops (transpose, narrow, expand) need strided accumulation.
 *
 * Dtypes: an op computes in the dtype of its float operands, which must agree, except binary
 * arithmetic, comparisons and where, which promote (f64 > f32 > bf16, f16; bf16 with f16 gives
 * f32; an integer operand takes the float's dtype) through recorded `to` casts, so gradients
 * flow back in each operand's own dtype. A dtype an op's kernel lacks is refused by the kernel
 * table ("op gelu has no kernel for i64 on cpu").
 *
 * Node layout convention: in[k] are the tensors gradients flow into (NULL for absent optional
 * inputs); saved[k] are contiguous copies (or the same tensors) the backward reads.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd.h"

/* ---- helpers ---------------------------------------------------------------------------- */

static int64_t prod(const int64_t *s, int n) {
  int64_t p = 1;
  for (int i = 0; i < n; i++) p *= s[i];
  return p;
}

static const fsdp_device_i *dev_of(const fsdp_tensor *t) { return t->storage->device; }

/* The kernel table of the device every given tensor (NULLs skipped) is on; an error naming
 * the op when they are on different devices or the device has no data or no kernels. */
static const fsdp_kernels_i *kernels(const char *op, fsdp_tensor *const *ts, int n) {
  const fsdp_tensor *first = NULL;
  for (int i = 0; i < n; i++) {
    if (!ts[i]) continue;
    if (!fsdp_tensor_data(ts[i], op)) return NULL; /* names the tensor and why it has no data */
    if (!first) first = ts[i];
    else if (dev_of(ts[i]) != dev_of(first)) {
      fsdp_error("%s: tensors on different devices (%s and %s); move one with t:to(\"%s\")", op,
                 dev_of(first)->name, dev_of(ts[i])->name, dev_of(first)->name);
      return NULL;
    }
  }
  return first ? fsdp_kernels_of(dev_of(first), op) : NULL;
}
#define KERNELS(op, ...) kernels(op, (fsdp_tensor *const[]){__VA_ARGS__}, \
                                 (int)(sizeof((fsdp_tensor *const[]){__VA_ARGS__}) / sizeof(fsdp_tensor *)))

/* Float operands of one op must share a dtype: an error naming both otherwise. */
static int same_dtype(const char *op, const fsdp_tensor *a, const fsdp_tensor *b) {
  if (!a || !b || a->dtype == b->dtype) return FSDP_OK;
  return fsdp_error("%s: dtypes %s and %s differ (convert one with t:to(\"%s\"))", op,
                    fsdp_dtype_name(a->dtype), fsdp_dtype_name(b->dtype),
                    fsdp_dtype_name(a->dtype));
}

/* The kernel's context and the dtype it computes in, from the op's main tensor */
#define CTX(t) (dev_of(t)->ctx)

/* A contiguous version of t whose data is readable: t retained, or a copy accounted as an
 * activation (a strided view of a parameter is copied for the kernel; the copy is not a
 * parameter). The error names the op and the tensor's shape. */
static int contig(fsdp_tensor **out, fsdp_tensor *t, const char *op) {
  *out = NULL;
  if (!fsdp_tensor_data(t, op)) return FSDP_ERR; /* names the tensor and why it has no data */
  if (fsdp_tensor_is_contiguous(t)) {
    fsdp_tensor_retain(t);
    *out = t;
    return FSDP_OK;
  }
  fsdp_tensor *c;
  if (fsdp_tensor_new_uninit(&c, dev_of(t), t->dtype, t->ndim, t->shape, FSDP_ROLE_ACTIVATIONS))
    return fsdp_error_context("%s", op);
  if (fsdp_copy(c, t)) {
    fsdp_tensor_release(c);
    return fsdp_error_context("%s", op);
  }
  *out = c;
  return FSDP_OK;
}

/* Op outputs on `like`'s device: every forward kernel writes its whole output, so no clearing
 * is needed. */
static int new_out(fsdp_tensor **out, const fsdp_tensor *like, fsdp_dtype dt, int ndim,
                   const int64_t *shape, const char *op) {
  if (fsdp_tensor_new_uninit(out, dev_of(like), dt, ndim, shape, FSDP_ROLE_ACTIVATIONS))
    return fsdp_error_context("%s", op);
  return FSDP_OK;
}

static void *D(const fsdp_tensor *t) { return t ? fsdp_tensor_data(t, "op") : NULL; }

/* What a recorded op's backward needs besides tensors: sizes and dims (n->i), two doubles'
 * worth of floats (n->f), and whether it reads its output (so an in-place change is caught). */
typedef struct {
  int64_t i[8];
  float f0, f1;
  bool reads_out;
} rec_args;
/* ARGS(M, K, N): integer arguments only. */
#define ARGS(...) (&(const rec_args){.i = {__VA_ARGS__}})

static int run_backward(fsdp_node *n);

/* Record a node if any of in[] requires a gradient; marks *out as a non-leaf that does.
 * Retains *out, in[] and saved[]; a (may be NULL) goes into the node. On failure *out is
 * released and set to NULL, so callers just return the status. */
static int record(const char *op, fsdp_backward_fn fn, fsdp_tensor **out, fsdp_tensor **in,
                  int nin, fsdp_tensor **saved, int nsaved, const rec_args *a) {
  if (!fsdp_needs_grad(in, nin)) return FSDP_OK;
  fsdp_node *n = fsdp_node_new(op, run_backward);
  if (!n) goto fail;
  n->impl = fn;
  fsdp_tensor *o = *out;
  o->requires_grad = true;
  o->is_leaf = false;
  fsdp_tensor_retain(o);
  n->out = o;
  n->nin = nin;
  for (int i = 0; i < nin; i++) {
    n->in[i] = in[i];
    if (in[i]) fsdp_tensor_retain(in[i]);
  }
  n->nsaved = nsaved;
  for (int i = 0; i < nsaved; i++) {
    n->saved[i] = saved[i];
    if (saved[i]) {
      fsdp_tensor_retain(saved[i]);
      n->saved_stamp[i] = fsdp_stamp_of(saved[i]);
    }
  }
  if (a) {
    memcpy(n->i, a->i, sizeof a->i);
    n->f[0] = a->f0;
    n->f[1] = a->f1;
    n->reads_out = a->reads_out;
  }
  n->out_stamp = fsdp_stamp_of(o);
  if (fsdp_tape_push(n) == FSDP_OK) return FSDP_OK;
fail:
  fsdp_tensor_release(*out);
  *out = NULL;
  return FSDP_ERR;
}

/* Gradient buffers in another dtype than their tensor: mixed precision keeps parameter
 * gradients in f32 while the parameters compute in bf16. Slots with a gradient dtype (linear,
 * layernorm, embedding: `gdt`) write those directly; for every other op the kernel accumulates
 * into a zeroed buffer of the tensor's dtype (a detour), added into the real gradient once the
 * op's backward ran (run_backward; cat, whose inputs are unbounded, after each input). */
typedef struct {
  fsdp_tensor *t, *tmp;
} detour;
static _Thread_local detour detours[FSDP_NODE_MAX_IN + 8];
static _Thread_local int ndetours;

/* t's gradient buffer for a kernel that writes it in t's dtype */
static int grad_buf(fsdp_tensor *t, void **g) {
  *g = fsdp_grad_acc(t);
  if (!*g) return FSDP_ERR;
  if (t->grad->dtype == t->dtype) return FSDP_OK;
  if (ndetours == (int)(sizeof detours / sizeof detours[0]))
    return fsdp_error("backward: too many gradients of another dtype in one op");
  fsdp_tensor *tmp;
  if (fsdp_tensor_new(&tmp, dev_of(t), t->dtype, t->ndim, t->shape, FSDP_ROLE_ACTIVATIONS))
    return FSDP_ERR;
  detours[ndetours++] = (detour){t, tmp};
  *g = D(tmp);
  return FSDP_OK;
}

/* Add the detours into their tensors' gradients (when rc is FSDP_OK) and drop them. */
static int flush_detours(int rc) {
  for (int i = 0; i < ndetours; i++) {
    if (!rc) rc = fsdp_add_into(detours[i].t->grad, detours[i].tmp, 1.0);
    fsdp_tensor_release(detours[i].tmp);
  }
  ndetours = 0;
  return rc;
}

static int run_backward(fsdp_node *n) {
  ndetours = 0;
  return flush_detours(n->impl(n));
}

/* Gradient buffer of input k if it wants one, else NULL (kernels skip NULL outputs). */
static int grad_of(fsdp_node *n, int k, void **g) {
  *g = NULL;
  fsdp_tensor *t = n->in[k];
  if (!t || !t->requires_grad) return FSDP_OK;
  return grad_buf(t, g);
}

/* The same for a slot that writes weight gradients in their own dtype (*gdt: the buffer's; the
 * tensor's when there is none) */
static int wgrad_of(fsdp_node *n, int k, void **g, fsdp_dtype *gdt) {
  *g = NULL;
  fsdp_tensor *t = n->in[k];
  if (t) *gdt = t->dtype;
  if (!t || !t->requires_grad) return FSDP_OK;
  *g = fsdp_grad_acc(t);
  if (*g) *gdt = t->grad->dtype;
  return *g ? FSDP_OK : FSDP_ERR;
}

/* The kernel table and context of a node's device (its output's). */
#define NK(n) (dev_of((n)->out)->kernels)
#define NCTX(n) (dev_of((n)->out)->ctx)
#define NDT(n) ((n)->out->dtype)

/* Input k's gradient buffer for a backward function that, when `whole` (it writes every
 * element) and the input has no gradient yet, writes the gradient rather than adds it: the new
 * buffer is then left uninitialised (*fresh; fsdp_grad_acc_fresh), which spares a fill and a
 * read of the zeros. Otherwise grad_of's buffer, to add into. */
static int grad_out(fsdp_node *n, int k, bool whole, void **g, bool *fresh) {
  fsdp_tensor *t = n->in[k];
  *fresh = false;
  if (whole && t && t->requires_grad && !t->grad && NK(n)->fill) {
    *g = fsdp_grad_acc_fresh(t, fresh);
    return *g ? FSDP_OK : FSDP_ERR;
  }
  return grad_of(n, k, g);
}

/* rc of the writer of a grad_out (or grad_over_out) buffer: one it was to write whole and
 * failed to is zero-filled, never left as allocated or half written */
static int grad_out_done(fsdp_node *n, int k, void *g, bool fresh, int rc) {
  if (rc && fresh) {
    const fsdp_tensor *gt = n->in[k]->grad;
    NK(n)->fill(NCTX(n), gt->dtype, g, 0.0, fsdp_tensor_numel(gt));
  }
  return rc;
}

static void contiguous_strides(int64_t *st, int nd, const int64_t *shape) {
  int64_t s = 1;
  for (int k = nd - 1; k >= 0; k--) {
    st[k] = s;
    s *= shape[k];
  }
}

/* ids and targets: integers, or f32/f64 holding integers. bf16 and f16 hold integers exactly
 * only up to 256 and 2048, so an id in them is most likely one a mixed-precision input cast
 * rounded: refused by dtype, before any value is looked at. what: "id" or "target". */
static int check_id_dtype(const char *op, const char *what, const fsdp_tensor *ids) {
  if (ids->dtype != FSDP_DTYPE_BF16 && ids->dtype != FSDP_DTYPE_F16) return FSDP_OK;
  const char *dt = fsdp_dtype_name(ids->dtype);
  bool bf = ids->dtype == FSDP_DTYPE_BF16;
  return fsdp_error("%s: %ss are %s; %ss must be integers (i64) or f32 — %s %s %s above %d "
                    "is not exact (a model wrapped with mixed precision casts floating inputs to "
                    "%s: give it i64 %ss, e.g. fsdp.tensor(t, {dtype = \"i64\"}))",
                    op, what, dt, what, bf ? "a" : "an", dt, what, bf ? 256 : 2048, dt, what);
}

/* *bad = the first id not an index in [lo, hi) (nor *ignore), -1 when all are; *bad_value its
 * value. The caller words the error. */
static int check_ids(const char *op, fsdp_tensor *ids, int64_t V, const int64_t *ignore,
                     int64_t *bad, double *bad_value) {
  const fsdp_kernels_i *k = KERNELS(op, ids);
  if (!k) return FSDP_ERR;
  return k->check_index(CTX(ids), ids->dtype, D(ids), fsdp_tensor_numel(ids), 0, V, ignore, bad,
                        bad_value);
}

/* ---- dtype and device conversion (recorded) -------------------------------------------------- */

static fsdp_dtype promote(fsdp_dtype a, fsdp_dtype b) {
  if (a == b) return a;
  bool fa = fsdp_dtype_is_float(a), fb = fsdp_dtype_is_float(b);
  if (fa != fb) return fa ? a : b;
  static const int rank[FSDP_DTYPE_COUNT] = {
      [FSDP_DTYPE_BOOL] = 0, [FSDP_DTYPE_U8] = 1, [FSDP_DTYPE_I32] = 2, [FSDP_DTYPE_I64] = 3,
      [FSDP_DTYPE_BF16] = 1, [FSDP_DTYPE_F16] = 1, [FSDP_DTYPE_F32] = 2, [FSDP_DTYPE_F64] = 3};
  if (rank[a] == rank[b]) return FSDP_DTYPE_F32; /* bf16 with f16 */
  return rank[a] > rank[b] ? a : b;
}

/* backward of to: the gradient goes back to the input's device and dtype, added */
static int bw_to(fsdp_node *n) {
  fsdp_tensor *in = n->in[0];
  if (!in->requires_grad) return FSDP_OK;
  if (!fsdp_grad_acc(in)) return FSDP_ERR;
  return fsdp_add_into(in->grad, n->out->grad, 1.0);
}

int fsdp_op_to(fsdp_tensor **out, fsdp_tensor *a, const fsdp_device_i *dev, fsdp_dtype dt) {
  *out = NULL;
  if (!dev) dev = dev_of(a);
  if (dev_of(a) == dev && a->dtype == dt) { /* nothing to do: the same tensor, as PyTorch */
    fsdp_tensor_retain(a);
    *out = a;
    return FSDP_OK;
  }
  if (!dev->has_data) { /* to meta: a shape-only tensor */
    if (fsdp_tensor_new(out, dev, dt, a->ndim, a->shape, FSDP_ROLE_ACTIVATIONS))
      return fsdp_error_context("to");
  } else {
    if (a->requires_grad && !fsdp_dtype_is_float(dt))
      return fsdp_error("to: a tensor that requires a gradient cannot become %s (gradients "
                        "need a float dtype; detach() it first)",
                        fsdp_dtype_name(dt));
    if (fsdp_to(out, a, dev, dt, FSDP_ROLE_ACTIVATIONS)) return fsdp_error_context("to");
  }
  if (!fsdp_dtype_is_float(dt) || !dev->has_data) return FSDP_OK;
  return record("to", bw_to, out, &a, 1, NULL, 0, NULL);
}

/* ---- binary elementwise with suffix broadcasting ------------------------------------------ */

static const char *binop_name[] = {"add", "sub", "mul", "div"};

/* Same shapes: a new gradient of an addend (either of a sum, the first of a difference) is dout
 * itself (the residual stream's adds: both addends' gradients start there). An activation takes
 * dout's buffer as it is (fsdp_grad_share: no pass over memory; whoever adds into it later gets
 * a copy while dout is still shared); a parameter gets a copy in a buffer that is never
 * zero-filled. x + x: x shares dout, then the kernel adds into x's own copy. */
static int bw_binary(fsdp_node *n) {
  const int64_t N = n->i[0], M = n->i[1];
  const fsdp_binop op = (fsdp_binop)n->i[2];
  if (M == 0) return FSDP_OK; /* no elements (then N is 0 too) */
  const bool copies = M == N && NK(n)->cast;
  void *d[2];
  for (int k = 0; k < 2; k++) {
    bool fresh;
    const bool whole = copies && (op == FSDP_BIN_ADD || (op == FSDP_BIN_SUB && k == 0));
    d[k] = NULL;
    if (whole && n->in[k] && fsdp_grad_share(n->in[k], n->out->grad)) continue;
    if (grad_out(n, k, whole, &d[k], &fresh)) return FSDP_ERR;
    if (!fresh) continue;
    int rc = NK(n)->cast(NCTX(n), d[k], NDT(n), D(n->out->grad), NDT(n), N);
    if (grad_out_done(n, k, d[k], fresh, rc)) return FSDP_ERR;
    d[k] = NULL;
  }
  if (!d[0] && !d[1]) return FSDP_OK;
  return NK(n)->binary_backward(NCTX(n), NDT(n), d[0], d[1], D(n->out->grad), D(n->saved[0]),
                                D(n->saved[1]), N, M, op);
}

/* b's shape a suffix of a's (or b a single element) */
static bool is_suffix(const fsdp_tensor *a, const fsdp_tensor *b) {
  if (fsdp_tensor_numel(b) == 1) return true;
  if (b->ndim > a->ndim) return false;
  for (int k = 1; k <= b->ndim; k++)
    if (b->shape[b->ndim - k] != a->shape[a->ndim - k]) return false;
  return true;
}

/* i[0] = N, i[1] = M: the output (N) repeats the input (M); the gradient sums the repeats */
static int bw_expand(fsdp_node *n) {
  void *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  int64_t N = n->i[0], M = n->i[1];
  if (!da || M == 0) return FSDP_OK;
  int64_t shape[2] = {N / M, M}, ds[2] = {0, 1}, ss[2] = {M, 1};
  return NK(n)->add_strided(NCTX(n), NDT(n), da, ds, D(n->out->grad), ss, 2, shape);
}

/* a repeated to `like`'s shape (a's shape a suffix of like's); recorded. */
static int expand_to(fsdp_tensor **out, fsdp_tensor *a, const fsdp_tensor *like, const char *op) {
  const fsdp_kernels_i *k = KERNELS(op, a);
  if (!k) return FSDP_ERR;
  int64_t N = fsdp_tensor_numel(like), M = fsdp_tensor_numel(a);
  if (new_out(out, a, a->dtype, like->ndim, like->shape, op)) return FSDP_ERR;
  /* a's elements in logical order, repeated: a stride-0 outer dim over a's own strides */
  int64_t shape[FSDP_MAX_DIMS + 1], ds[FSDP_MAX_DIMS + 1], ss[FSDP_MAX_DIMS + 1];
  shape[0] = M ? N / M : 0;
  ss[0] = 0;
  memcpy(shape + 1, a->shape, sizeof(int64_t) * (size_t)a->ndim);
  memcpy(ss + 1, a->strides, sizeof(int64_t) * (size_t)a->ndim);
  contiguous_strides(ds, a->ndim + 1, shape);
  if (M > 0 && k->copy_strided(CTX(a), a->dtype, D(*out), ds, D(a), ss, a->ndim + 1, shape)) {
    fsdp_tensor_release(*out);
    *out = NULL;
    return FSDP_ERR;
  }
  return record("expand", bw_expand, out, &a, 1, NULL, 0, ARGS(N, M));
}

/* a and b in their promoted dtype (recorded casts; new references) */
static int promoted(const char *op, fsdp_tensor **pa, fsdp_tensor **pb, fsdp_tensor *a,
                    fsdp_tensor *b) {
  *pa = *pb = NULL;
  fsdp_dtype dt = promote(a->dtype, b->dtype);
  if (fsdp_op_to(pa, a, NULL, dt) || fsdp_op_to(pb, b, NULL, dt)) {
    fsdp_tensor_release(*pa);
    *pa = NULL;
    return fsdp_error_context("%s", op);
  }
  return FSDP_OK;
}

int fsdp_op_binary(fsdp_tensor **out, fsdp_tensor *a0, fsdp_tensor *b0, fsdp_binary_op op) {
  *out = NULL;
  const char *name = binop_name[op];
  if (!KERNELS(name, a0, b0)) return FSDP_ERR;
  if (!is_suffix(a0, b0) && !is_suffix(b0, a0))
    return fsdp_error("%s: shapes %s and %s do not broadcast (one shape must end with the "
                      "other)", name, FSDP_SHAPE_STR(a0), FSDP_SHAPE_STR(b0));
  fsdp_tensor *a, *b, *ea = NULL, *ac = NULL, *bc = NULL;
  if (promoted(name, &a, &b, a0, b0)) return FSDP_ERR;
  int rc = FSDP_ERR;
  /* the output has b's shape when b does not end a's, and when a is one element with fewer
   * dimensions (a number with a (1, 1) tensor gives (1, 1), not a scalar) */
  if (!is_suffix(a, b) || (fsdp_tensor_numel(a) == 1 && b->ndim > a->ndim)) {
    if (expand_to(&ea, a, b, name)) goto done;
    fsdp_tensor_release(a);
    a = ea;
    ea = NULL;
  }
  if (contig(&ac, a, name) || contig(&bc, b, name)) goto done;
  int64_t N = fsdp_tensor_numel(ac), M = fsdp_tensor_numel(bc);
  if (new_out(out, a, a->dtype, a->ndim, a->shape, name)) goto done;
  if (M > 0 && dev_of(a)->kernels->binary_forward(CTX(a), a->dtype, D(*out), D(ac), D(bc), N, M,
                                                  (fsdp_binop)op)) {
    fsdp_tensor_release(*out);
    *out = NULL;
    goto done;
  }
  fsdp_tensor *in[2] = {a, b}, *sv[2] = {ac, bc};
  rc = record(name, bw_binary, out, in, 2, sv, 2, ARGS(N, M, op));
done:
  fsdp_tensor_release(a);
  fsdp_tensor_release(b);
  fsdp_tensor_release(ac);
  fsdp_tensor_release(bc);
  return rc;
}

/* Run a forward kernel call `call` (an int expression using *out) and record, or release *out
 * on failure. */
#define RUN(call)                                                                                  \
  do {                                                                                             \
    if (call) {                                                                                    \
      fsdp_tensor_release(*out);                                                                   \
      *out = NULL;                                                                                 \
      rc = FSDP_ERR;                                                                               \
      goto done;                                                                                   \
    }                                                                                              \
  } while (0)

static int bw_affine(fsdp_node *n) {
  void *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (!da) return FSDP_OK;
  return NK(n)->affine_backward(NCTX(n), NDT(n), da, D(n->out->grad), n->f[0],
                                fsdp_tensor_numel(n->out));
}

int fsdp_op_affine(fsdp_tensor **out, fsdp_tensor *a, float s, float t) {
  const fsdp_kernels_i *k = KERNELS("affine", a);
  if (!k) return FSDP_ERR;
  fsdp_tensor *ac;
  if (contig(&ac, a, "affine")) return FSDP_ERR;
  int rc = new_out(out, a, a->dtype, a->ndim, a->shape, "affine");
  if (rc) goto done;
  RUN(k->affine_forward(CTX(a), a->dtype, D(*out), D(ac), s, t, fsdp_tensor_numel(ac)));
  rc = record("affine", bw_affine, out, &a, 1, NULL, 0, &(const rec_args){.f0 = s});
done:
  fsdp_tensor_release(ac);
  return rc;
}

/* ---- unary ----------------------------------------------------------------------------- */

static int bw_unary(fsdp_node *n) {
  void *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (!da) return FSDP_OK;
  return NK(n)->unary_backward(NCTX(n), NDT(n), (fsdp_unary_op)n->i[0], da, D(n->out->grad),
                               D(n->saved[0]), D(n->out), fsdp_tensor_numel(n->out));
}

int fsdp_op_unary(fsdp_tensor **out, fsdp_tensor *a, fsdp_unary_op op) {
  const char *name = fsdp_unary_name(op);
  const fsdp_kernels_i *k = KERNELS(name, a);
  if (!k) return FSDP_ERR;
  fsdp_tensor *ac;
  if (contig(&ac, a, name)) return FSDP_ERR;
  int rc = new_out(out, a, a->dtype, a->ndim, a->shape, name);
  if (rc) goto done;
  RUN(k->unary_forward(CTX(a), a->dtype, op, D(*out), D(ac), fsdp_tensor_numel(ac)));
  bool reads_out = op == FSDP_UNARY_EXP || op == FSDP_UNARY_SQRT || op == FSDP_UNARY_TANH ||
                   op == FSDP_UNARY_SIGMOID;
  rc = record(name, bw_unary, out, &a, 1, &ac, 1,
              &(const rec_args){.i = {op}, .reads_out = reads_out});
done:
  fsdp_tensor_release(ac);
  return rc;
}

/* ---- bias + gelu ------------------------------------------------------------------------ */

/* Input k's first gradient written over the output's, for a backward that writes it whole
 * and whose kernel allows dinp == dout (each element of dout read before that element of dinp
 * is written): when nothing but the output holds the output's gradient (no view, no Lua
 * handle, no other sharer), fsdp_grad_share hands it to input k, and the output drops it once
 * n ran, so nobody sees it change. That spares one buffer of the input's size at the
 * backward's peak. True: *g is that buffer, to be written whole as grad_out's fresh one (and
 * zero-filled by grad_out_done should the kernel fail). */
static bool grad_over_out(fsdp_node *n, int k, void **g) {
  fsdp_tensor *t = n->in[k], *og = n->out->grad;
  if (!t || !og || !NK(n)->fill || __atomic_load_n(&og->refcount, __ATOMIC_ACQUIRE) != 1 ||
      __atomic_load_n(&og->storage->refcount, __ATOMIC_ACQUIRE) != 1 || !fsdp_grad_share(t, og))
    return false;
  fsdp_tensor_written(og); /* a write, as fsdp_grad_acc's */
  *g = D(og);
  return true;
}

/* x's gradient, when it is its first (x is a linear's output), is written, not added: into the
 * output's gradient when that is free (grad_over_out), else into a buffer that is never
 * zero-filled (as bw_linear's input gradient) */
static int bw_bias_gelu(fsdp_node *n) {
  void *dx, *db;
  fsdp_dtype gb = NDT(n);
  bool fresh = grad_over_out(n, 0, &dx);
  if (!fresh && grad_out(n, 0, true, &dx, &fresh)) return FSDP_ERR;
  int rc = wgrad_of(n, 1, &db, &gb);
  if (!rc && (dx || db))
    rc = NK(n)->bias_gelu_backward(NCTX(n), NDT(n), gb, dx, db, D(n->out->grad),
                                   D(n->saved[0]), D(n->saved[1]), n->i[0], (int)n->i[1], fresh);
  return grad_out_done(n, 0, dx, fresh, rc);
}

int fsdp_op_bias_gelu(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *b) {
  if (x->ndim < 1 || b->ndim != 1 || b->shape[0] != x->shape[x->ndim - 1])
    return fsdp_error("bias_gelu: bias %s does not match input %s: need (%lld)",
                      FSDP_SHAPE_STR(b), FSDP_SHAPE_STR(x),
                      (long long)(x->ndim ? x->shape[x->ndim - 1] : 0));
  const fsdp_kernels_i *k = KERNELS("bias_gelu", x, b);
  if (!k || same_dtype("bias_gelu", x, b)) return FSDP_ERR;
  const bool fused_dtype = x->dtype == FSDP_DTYPE_F32 || x->dtype == FSDP_DTYPE_BF16 ||
                           x->dtype == FSDP_DTYPE_F16;
  if (!k->bias_gelu_forward || !k->bias_gelu_backward || !fused_dtype) {
    fsdp_tensor *h;
    if (fsdp_op_binary(&h, x, b, FSDP_OP_ADD)) return FSDP_ERR;
    int rc = fsdp_op_unary(out, h, FSDP_UNARY_GELU);
    fsdp_tensor_release(h);
    return rc;
  }
  const int64_t C = b->shape[0], N = C ? fsdp_tensor_numel(x) / C : 0;
  fsdp_tensor *xc = NULL, *bc = NULL;
  int rc = FSDP_ERR;
  if (contig(&xc, x, "bias_gelu") || contig(&bc, b, "bias_gelu")) goto done;
  if (new_out(out, x, x->dtype, x->ndim, x->shape, "bias_gelu")) goto done;
  RUN(k->bias_gelu_forward(CTX(x), x->dtype, D(*out), D(xc), D(bc), N, (int)C));
  fsdp_tensor *in[2] = {x, b}, *sv[2] = {xc, bc};
  rc = record("bias_gelu", bw_bias_gelu, out, in, 2, sv, 2, ARGS(N, C));
done:
  fsdp_tensor_release(xc);
  fsdp_tensor_release(bc);
  return rc;
}

static int bw_pow(fsdp_node *n) {
  void *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  /* x^0 is 1 everywhere: its gradient is 0, at x = 0 too, where p x^(p - 1) is 0 * inf, NaN
   * (PyTorch's convention as well) */
  if (!da || n->f[0] == 0.0f) return FSDP_OK;
  return NK(n)->pow_backward(NCTX(n), NDT(n), da, D(n->out->grad), D(n->saved[0]), n->f[0],
                             fsdp_tensor_numel(n->out));
}

int fsdp_op_pow(fsdp_tensor **out, fsdp_tensor *a, float p) {
  const fsdp_kernels_i *k = KERNELS("pow", a);
  if (!k) return FSDP_ERR;
  fsdp_tensor *ac;
  if (contig(&ac, a, "pow")) return FSDP_ERR;
  int rc = new_out(out, a, a->dtype, a->ndim, a->shape, "pow");
  if (rc) goto done;
  RUN(k->pow_forward(CTX(a), a->dtype, D(*out), D(ac), p, fsdp_tensor_numel(ac)));
  rc = record("pow", bw_pow, out, &a, 1, &ac, 1, &(const rec_args){.f0 = p});
done:
  fsdp_tensor_release(ac);
  return rc;
}

/* ---- matmul, linear ------------------------------------------------------------------- */

/* i[0..3] = batch, M, K, N ; i[4] = 1 for a batched product, 0 for "a flattened to (M, K)
 * times a 2-D b" */
static int bw_matmul(fsdp_node *n) {
  void *da, *db;
  if (grad_of(n, 0, &da) || grad_of(n, 1, &db)) return FSDP_ERR;
  int B = (int)n->i[0], M = (int)n->i[1], K = (int)n->i[2], N = (int)n->i[3];
  if (B == 0 || M == 0 || K == 0 || N == 0) return FSDP_OK; /* an empty product: zero grads */
  const void *g = D(n->out->grad), *a = D(n->saved[0]), *b = D(n->saved[1]);
  const fsdp_kernels_i *k = NK(n);
  void *ctx = NCTX(n);
  fsdp_dtype dt = NDT(n);
  if (n->i[4]) return k->bmm_backward(ctx, dt, da, db, g, a, b, B, M, K, N);
  if (da && k->gemm(ctx, dt, da, g, b, M, K, N, false, true, 1.0f, 1.0f, N, N, K))
    return FSDP_ERR;
  if (db && k->gemm(ctx, dt, db, a, g, K, N, M, true, false, 1.0f, 1.0f, K, N, N))
    return FSDP_ERR;
  return FSDP_OK;
}

int fsdp_op_matmul(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b) {
  int64_t B = 1, M, K, N;
  int64_t oshape[FSDP_MAX_DIMS];
  int ond;
  const fsdp_kernels_i *k = KERNELS("matmul", a, b);
  if (!k || same_dtype("matmul", a, b)) return FSDP_ERR;
  if (a->ndim < 1 || b->ndim < 2) goto bad;
  if (b->ndim == 2) {
    K = a->shape[a->ndim - 1];
    if (b->shape[0] != K) goto bad;
    N = b->shape[1];
    M = K ? fsdp_tensor_numel(a) / K : 0;
    ond = a->ndim;
    memcpy(oshape, a->shape, sizeof(int64_t) * (size_t)ond);
    oshape[ond - 1] = N;
  } else {
    if (a->ndim != b->ndim) goto bad;
    for (int q = 0; q < a->ndim - 2; q++)
      if (a->shape[q] != b->shape[q]) goto bad;
    M = a->shape[a->ndim - 2];
    K = a->shape[a->ndim - 1];
    if (b->shape[b->ndim - 2] != K) goto bad;
    N = b->shape[b->ndim - 1];
    B = prod(a->shape, a->ndim - 2);
    ond = a->ndim;
    memcpy(oshape, a->shape, sizeof(int64_t) * (size_t)ond);
    oshape[ond - 1] = N;
  }
  fsdp_tensor *ac = NULL, *bc = NULL;
  int rc = FSDP_ERR;
  if (contig(&ac, a, "matmul") || contig(&bc, b, "matmul")) goto done;
  if (new_out(out, a, a->dtype, ond, oshape, "matmul")) goto done;
  if (fsdp_tensor_numel(*out) > 0 && K > 0) {
    if (b->ndim == 2)
      RUN(k->gemm(CTX(a), a->dtype, D(*out), D(ac), D(bc), (int)M, (int)N, (int)K, false, false,
                  1.0f, 0.0f, (int)K, (int)N, (int)N));
    else
      RUN(k->bmm_forward(CTX(a), a->dtype, D(*out), D(ac), D(bc), (int)B, (int)M, (int)K,
                         (int)N));
  } else {
    RUN(fsdp_tensor_fill(*out, 0.0)); /* an empty inner dimension sums nothing */
  }
  fsdp_tensor *in[2] = {a, b}, *sv[2] = {ac, bc};
  rc = record("matmul", bw_matmul, out, in, 2, sv, 2, ARGS(B, M, K, N, b->ndim != 2));
done:
  fsdp_tensor_release(ac);
  fsdp_tensor_release(bc);
  return rc;
bad:
  return fsdp_error("matmul: shapes %s and %s do not match (need (..., M, K) @ (K, N) or "
                    "batched (..., M, K) @ (..., K, N) with equal batch dims)",
                    FSDP_SHAPE_STR(a), FSDP_SHAPE_STR(b));
}

/* A linear's input gradient, when it is the input's first (the usual case: a layernorm's or an
 * activation's output feeds one linear), is written by a GEMM with beta = 0 into a buffer that is
 * never zero-filled: one pass over it instead of three (fill, read, write). */
static int bw_linear(fsdp_node *n) {
  void *dx, *dw, *db;
  fsdp_dtype gw = NDT(n), gb = NDT(n);
  bool fresh;
  const fsdp_kernels_i *k = NK(n);
  if (grad_out(n, 0, k->gemm != NULL, &dx, &fresh)) return FSDP_ERR;
  int rc = wgrad_of(n, 1, &dw, &gw) || wgrad_of(n, 2, &db, &gb) ? FSDP_ERR : FSDP_OK;
  if (!rc && dw && db && gw != gb)
    rc = fsdp_error("linear: the weight's gradient is %s, the bias's %s", fsdp_dtype_name(gw),
                    fsdp_dtype_name(gb));
  const int M = (int)n->i[0], K = (int)n->i[1], N = (int)n->i[2];
  if (!rc && fresh) /* dx (M, K) = dout (M, N) @ weight (N, K) */
    rc = k->gemm(NCTX(n), NDT(n), dx, D(n->out->grad), D(n->saved[1]), M, K, N, false, false,
                 1.0, 0.0, N, K, K);
  if (!rc && (!fresh || dw || db))
    rc = k->linear_backward(NCTX(n), NDT(n), dw ? gw : gb, fresh ? NULL : dx, dw, db,
                            D(n->out->grad), D(n->saved[0]), D(n->saved[1]), M, K, N);
  return grad_out_done(n, 0, dx, fresh, rc);
}

int fsdp_op_linear(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *w, fsdp_tensor *b) {
  if (w->ndim != 2)
    return fsdp_error("linear: weight must be 2-D (out_features, in_features), got %s",
                      FSDP_SHAPE_STR(w));
  int64_t N = w->shape[0], K = w->shape[1];
  if (x->ndim < 1 || x->shape[x->ndim - 1] != K)
    return fsdp_error("linear: input %s does not match weight %s: input features %lld != "
                      "in_features %lld",
                      FSDP_SHAPE_STR(x), FSDP_SHAPE_STR(w),
                      (long long)(x->ndim ? x->shape[x->ndim - 1] : 0), (long long)K);
  if (b && (b->ndim != 1 || b->shape[0] != N))
    return fsdp_error("linear: bias %s does not match weight %s: need (%lld)", FSDP_SHAPE_STR(b),
                      FSDP_SHAPE_STR(w), (long long)N);
  const fsdp_kernels_i *k = KERNELS("linear", x, w, b);
  if (!k || same_dtype("linear", x, w) || same_dtype("linear", x, b)) return FSDP_ERR;
  int64_t M = K ? fsdp_tensor_numel(x) / K : 0;
  int64_t oshape[FSDP_MAX_DIMS];
  memcpy(oshape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
  oshape[x->ndim - 1] = N;
  fsdp_tensor *xc = NULL, *wc = NULL, *bc = NULL;
  int rc = FSDP_ERR;
  if (contig(&xc, x, "linear") || contig(&wc, w, "linear") || (b && contig(&bc, b, "linear")))
    goto done;
  if (new_out(out, x, x->dtype, x->ndim, oshape, "linear")) goto done;
  RUN(k->linear_forward(CTX(x), x->dtype, D(*out), D(xc), D(wc), D(bc), (int)M, (int)K, (int)N));
  fsdp_tensor *in[3] = {x, w, b}, *sv[2] = {xc, wc};
  rc = record("linear", bw_linear, out, in, 3, sv, 2, ARGS(M, K, N));
done:
  fsdp_tensor_release(xc);
  fsdp_tensor_release(wc);
  fsdp_tensor_release(bc);
  return rc;
}

/* ---- embedding --------------------------------------------------------------------------- */

static int bw_embedding(fsdp_node *n) {
  void *dw;
  fsdp_dtype gdt = NDT(n);
  if (wgrad_of(n, 1, &dw, &gdt)) return FSDP_ERR;
  if (!dw) return FSDP_OK;
  const fsdp_tensor *ids = n->saved[0];
  return NK(n)->embedding_backward(NCTX(n), NDT(n), gdt, dw, D(n->out->grad), D(ids), ids->dtype,
                                   n->i[0], (int)n->i[1]);
}

int fsdp_op_embedding(fsdp_tensor **out, fsdp_tensor *ids, fsdp_tensor *w) {
  if (w->ndim != 2)
    return fsdp_error("embedding: weight must be 2-D (num, dim), got %s", FSDP_SHAPE_STR(w));
  if (ids->ndim + 1 > FSDP_MAX_DIMS)
    return fsdp_error("embedding: ids %s have too many dimensions", FSDP_SHAPE_STR(ids));
  if (check_id_dtype("embedding", "id", ids)) return FSDP_ERR;
  const fsdp_kernels_i *k = KERNELS("embedding", ids, w);
  if (!k) return FSDP_ERR;
  int64_t V = w->shape[0], C = w->shape[1], N = fsdp_tensor_numel(ids);
  fsdp_tensor *ic = NULL, *wc = NULL;
  int rc = FSDP_ERR;
  if (contig(&ic, ids, "embedding") || contig(&wc, w, "embedding")) goto done;
  int64_t bad;
  double bv;
  if (check_ids("embedding", ic, V, NULL, &bad, &bv)) goto done;
  if (bad >= 0) {
    fsdp_error("embedding: id %g at position %lld is not an integer in [0, %lld) (weight %s)",
               bv, (long long)bad + 1, (long long)V, FSDP_SHAPE_STR(w));
    goto done;
  }
  int64_t oshape[FSDP_MAX_DIMS];
  memcpy(oshape, ids->shape, sizeof(int64_t) * (size_t)ids->ndim);
  oshape[ids->ndim] = C;
  if (new_out(out, w, w->dtype, ids->ndim + 1, oshape, "embedding")) goto done;
  RUN(k->embedding_forward(CTX(w), w->dtype, D(*out), D(ic), ic->dtype, D(wc), N, (int)C));
  fsdp_tensor *in[2] = {ids, w}, *sv[1] = {ic};
  rc = record("embedding", bw_embedding, out, in, 2, sv, 1, ARGS(N, C));
done:
  fsdp_tensor_release(ic);
  fsdp_tensor_release(wc);
  return rc;
}

/* ---- layernorm, softmax -------------------------------------------------------------------- */

static int bw_layernorm(fsdp_node *n) {
  void *dx, *dw, *db;
  fsdp_dtype gw = NDT(n), gb = NDT(n);
  if (grad_of(n, 0, &dx) || wgrad_of(n, 1, &dw, &gw) || wgrad_of(n, 2, &db, &gb))
    return FSDP_ERR;
  if (dw && db && gw != gb)
    return fsdp_error("layernorm: the weight's gradient is %s, the bias's %s",
                      fsdp_dtype_name(gw), fsdp_dtype_name(gb));
  return NK(n)->layernorm_backward(NCTX(n), NDT(n), dw ? gw : gb, dx, dw, db, D(n->out->grad),
                                   D(n->saved[0]),
                                   D(n->saved[1]), D(n->saved[2]), D(n->saved[3]), n->i[0],
                                   (int)n->i[1]);
}

/* layernorm's weight and bias (b may be NULL) against its input x: shape (C), x's dtype */
static int layernorm_params_check(const fsdp_tensor *x, const fsdp_tensor *w,
                                  const fsdp_tensor *b) {
  const int64_t C = x->ndim ? x->shape[x->ndim - 1] : 0;
  if (w->ndim != 1 || w->shape[0] != C || (b && (b->ndim != 1 || b->shape[0] != C)))
    return fsdp_error("layernorm: input %s needs weight and bias of shape (%lld), got %s and %s",
                      FSDP_SHAPE_STR(x), (long long)C, FSDP_SHAPE_STR(w),
                      b ? FSDP_SHAPE_STR(b) : "none");
  if (same_dtype("layernorm", x, w) || same_dtype("layernorm", x, b)) return FSDP_ERR;
  return FSDP_OK;
}

int fsdp_op_layernorm(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *w, fsdp_tensor *b,
                      float eps) {
  if (layernorm_params_check(x, w, b)) return FSDP_ERR;
  const fsdp_kernels_i *k = KERNELS("layernorm", x, w, b);
  if (!k) return FSDP_ERR;
  const int64_t C = x->ndim ? x->shape[x->ndim - 1] : 0;
  int64_t N = C ? fsdp_tensor_numel(x) / C : 0;
  fsdp_tensor *xc = NULL, *wc = NULL, *bc = NULL, *mean = NULL, *rstd = NULL;
  int rc = FSDP_ERR;
  if (contig(&xc, x, "layernorm") || contig(&wc, w, "layernorm") ||
      (b && contig(&bc, b, "layernorm")))
    goto done;
  if (new_out(&mean, x, FSDP_DTYPE_F32, 1, &N, "layernorm") ||
      new_out(&rstd, x, FSDP_DTYPE_F32, 1, &N, "layernorm"))
    goto done;
  if (new_out(out, x, x->dtype, x->ndim, x->shape, "layernorm")) goto done;
  RUN(k->layernorm_forward(CTX(x), x->dtype, D(*out), D(mean), D(rstd), D(xc), D(wc), D(bc), N,
                           (int)C, eps));
  fsdp_tensor *in[3] = {x, w, b}, *sv[4] = {xc, wc, mean, rstd};
  rc = record("layernorm", bw_layernorm, out, in, 3, sv, 4, ARGS(N, C));
done:
  fsdp_tensor_release(xc);
  fsdp_tensor_release(wc);
  fsdp_tensor_release(bc);
  fsdp_tensor_release(mean);
  fsdp_tensor_release(rstd);
  return rc;
}

/* sum = a + b and out = layernorm(sum, w, bias): the kernel's fused slot where a and b have one
 * shape and dtype, recorded as the add and the layernorm would be (two nodes: backward is
 * theirs); the two ops otherwise. */
int fsdp_op_add_layernorm(fsdp_tensor **sum, fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b,
                          fsdp_tensor *w, fsdp_tensor *bias, float eps) {
  *sum = *out = NULL;
  const fsdp_kernels_i *k = KERNELS("layernorm", a, b, w, bias);
  if (!k) return FSDP_ERR;
  const int64_t C = a->ndim ? a->shape[a->ndim - 1] : 0;
  if (!k->add_layernorm_forward || !fsdp_tensor_same_shape(a, b) || a->dtype != b->dtype ||
      a->ndim < 1) {
    if (fsdp_op_binary(sum, a, b, FSDP_OP_ADD)) return FSDP_ERR;
    if (fsdp_op_layernorm(out, *sum, w, bias, eps)) {
      fsdp_tensor_release(*sum);
      *sum = NULL;
      return FSDP_ERR;
    }
    return FSDP_OK;
  }
  if (layernorm_params_check(a, w, bias)) return FSDP_ERR;
  const int64_t N = C ? fsdp_tensor_numel(a) / C : 0, n = fsdp_tensor_numel(a);
  fsdp_tensor *ac = NULL, *bc = NULL, *wc = NULL, *biasc = NULL, *mean = NULL, *rstd = NULL;
  int rc = FSDP_ERR;
  if (contig(&ac, a, "add") || contig(&bc, b, "add") || contig(&wc, w, "layernorm") ||
      (bias && contig(&biasc, bias, "layernorm")))
    goto done;
  if (new_out(&mean, a, FSDP_DTYPE_F32, 1, &N, "layernorm") ||
      new_out(&rstd, a, FSDP_DTYPE_F32, 1, &N, "layernorm") ||
      new_out(sum, a, a->dtype, a->ndim, a->shape, "add") ||
      new_out(out, a, a->dtype, a->ndim, a->shape, "layernorm"))
    goto fail;
  if (k->add_layernorm_forward(CTX(a), a->dtype, D(*sum), D(*out), D(mean), D(rstd), D(ac),
                               D(bc), D(wc), D(biasc), N, (int)C, eps))
    goto fail;
  fsdp_tensor *in2[2] = {a, b}, *sv2[2] = {ac, bc};
  if (record("add", bw_binary, sum, in2, 2, sv2, 2, ARGS(n, n, FSDP_OP_ADD))) goto fail;
  fsdp_tensor *in3[3] = {*sum, w, bias}, *sv4[4] = {*sum, wc, mean, rstd};
  if (record("layernorm", bw_layernorm, out, in3, 3, sv4, 4, ARGS(N, C))) goto fail;
  rc = FSDP_OK;
  goto done;
fail:
  /* (a recorded add whose sum nobody holds any more is dropped with the tape's next prune) */
  fsdp_tensor_release(*sum);
  fsdp_tensor_release(*out);
  *sum = *out = NULL;
done:
  fsdp_tensor_release(ac);
  fsdp_tensor_release(bc);
  fsdp_tensor_release(wc);
  fsdp_tensor_release(biasc);
  fsdp_tensor_release(mean);
  fsdp_tensor_release(rstd);
  return rc;
}

static int bw_softmax(fsdp_node *n) {
  void *dx;
  if (grad_of(n, 0, &dx)) return FSDP_ERR;
  if (!dx) return FSDP_OK;
  return NK(n)->softmax_backward(NCTX(n), NDT(n), dx, D(n->out->grad), D(n->out), n->i[0],
                                 (int)n->i[1]);
}

/* softmax over the last dimension */
static int softmax_last(fsdp_tensor **out, fsdp_tensor *x) {
  const fsdp_kernels_i *k = KERNELS("softmax", x);
  if (!k) return FSDP_ERR;
  int64_t C = x->shape[x->ndim - 1], N = C ? fsdp_tensor_numel(x) / C : 0;
  fsdp_tensor *xc;
  if (contig(&xc, x, "softmax")) return FSDP_ERR;
  int rc = new_out(out, x, x->dtype, x->ndim, x->shape, "softmax");
  if (rc) goto done;
  RUN(k->softmax_forward(CTX(x), x->dtype, D(*out), D(xc), N, (int)C));
  rc = record("softmax", bw_softmax, out, &x, 1, NULL, 0,
              &(const rec_args){.i = {N, C}, .reads_out = true});
done:
  fsdp_tensor_release(xc);
  return rc;
}

int fsdp_op_softmax(fsdp_tensor **out, fsdp_tensor *x, int dim) {
  *out = NULL;
  if (x->ndim < 1) return fsdp_error("softmax: needs at least one dimension, got a scalar");
  if (dim < 0 || dim >= x->ndim)
    return fsdp_error("softmax: dimension %d out of range for a tensor %s", dim + 1,
                      FSDP_SHAPE_STR(x));
  if (dim == x->ndim - 1) return softmax_last(out, x);
  /* another dim: move it last (recorded views), softmax, move it back */
  fsdp_tensor *t = NULL, *s = NULL;
  int rc = fsdp_op_transpose(&t, x, dim, x->ndim - 1);
  if (!rc) rc = softmax_last(&s, t);
  if (!rc) rc = fsdp_op_transpose(out, s, dim, x->ndim - 1);
  fsdp_tensor_release(t);
  fsdp_tensor_release(s);
  return rc;
}

/* ---- attention ---------------------------------------------------------------------------- */

/* qkv's gradient, when it is its first (qkv is a linear's output), is written, not added: the
 * buffer is never zero-filled (as bw_linear's input gradient) */
static int bw_attention(fsdp_node *n) {
  void *dqkv;
  bool fresh;
  if (grad_out(n, 0, true, &dqkv, &fresh)) return FSDP_ERR;
  if (!dqkv) return FSDP_OK;
  int rc = NK(n)->attention_backward(NCTX(n), NDT(n), dqkv, D(n->out->grad), D(n->saved[0]),
                                     D(n->saved[1]), (int)n->i[0], (int)n->i[1], (int)n->i[2],
                                     (int)n->i[3], fresh);
  return grad_out_done(n, 0, dqkv, fresh, rc);
}

int fsdp_op_attention(fsdp_tensor **out, fsdp_tensor *qkv, int n_head) {
  if (qkv->ndim != 3 || qkv->shape[2] % 3 != 0)
    return fsdp_error("attention: qkv must be (B, T, 3C), got %s", FSDP_SHAPE_STR(qkv));
  int64_t B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3;
  if (n_head <= 0 || C % n_head != 0)
    return fsdp_error("attention: %lld channels do not split into %d heads (qkv %s)",
                      (long long)C, n_head, FSDP_SHAPE_STR(qkv));
  const fsdp_kernels_i *k = KERNELS("attention", qkv);
  if (!k) return FSDP_ERR;
  fsdp_tensor *qc = NULL, *att = NULL;
  int rc = FSDP_ERR;
  if (contig(&qc, qkv, "attention")) goto done;
  /* what the forward saves for the backward: the device decides (kernels.h) */
  fsdp_dtype sdt;
  int64_t saved = k->attention_saved(CTX(qkv), qkv->dtype, (int)B, (int)T, (int)C, n_head, &sdt),
          oshape[3] = {B, T, C};
  if (new_out(&att, qkv, sdt, 1, &saved, "attention") ||
      new_out(out, qkv, qkv->dtype, 3, oshape, "attention"))
    goto done;
  RUN(k->attention_forward(CTX(qkv), qkv->dtype, D(*out), D(att), D(qc), (int)B, (int)T, (int)C,
                           n_head));
  fsdp_tensor *sv[2] = {qc, att};
  rc = record("attention", bw_attention, out, &qkv, 1, sv, 2, ARGS(B, T, C, n_head));
done:
  fsdp_tensor_release(qc);
  fsdp_tensor_release(att);
  return rc;
}

/* ---- dropout ---------------------------------------------------------------------------------- */

static int bw_dropout(fsdp_node *n) {
  void *dx;
  if (grad_of(n, 0, &dx)) return FSDP_ERR;
  if (!dx) return FSDP_OK;
  return NK(n)->dropout_backward(NCTX(n), NDT(n), dx, D(n->out->grad), D(n->saved[0]),
                                 fsdp_tensor_numel(n->out));
}

int fsdp_op_dropout(fsdp_tensor **out, fsdp_tensor *x, float p) {
  if (!(p >= 0.0f && p < 1.0f))
    return fsdp_error("dropout: probability %g is not in [0, 1) (input %s)", (double)p,
                      FSDP_SHAPE_STR(x));
  const fsdp_kernels_i *k = KERNELS("dropout", x);
  if (!k) return FSDP_ERR;
  fsdp_tensor *xc = NULL, *mask = NULL;
  int rc = FSDP_ERR;
  if (contig(&xc, x, "dropout")) goto done;
  int64_t N = fsdp_tensor_numel(xc);
  if (new_out(&mask, x, x->dtype, x->ndim, x->shape, "dropout") ||
      new_out(out, x, x->dtype, x->ndim, x->shape, "dropout"))
    goto done;
  uint64_t first;
  uint64_t key = fsdp_rng_reserve("dropout", N, &first);
  RUN(k->dropout_forward(CTX(x), x->dtype, D(*out), D(mask), D(xc), N, p, key, first));
  rc = record("dropout", bw_dropout, out, &x, 1, &mask, 1, NULL);
done:
  fsdp_tensor_release(xc);
  fsdp_tensor_release(mask);
  return rc;
}

/* ---- losses, reductions -------------------------------------------------------------------- */

/* i: N, V, ignore, count. The loss and its gradient are f32; dlogits in the logits' dtype. */
static int bw_cross_entropy(fsdp_node *n) {
  void *dl;
  if (grad_of(n, 0, &dl)) return FSDP_ERR;
  if (!dl) return FSDP_OK;
  const fsdp_tensor *logits = n->saved[0], *targets = n->saved[1];
  return NK(n)->cross_entropy_backward(NCTX(n), logits->dtype, dl, D(n->out->grad), D(logits),
                                       D(n->saved[2]), D(targets), targets->dtype, n->i[0],
                                       (int)n->i[1], n->i[2], n->i[3]);
}

int fsdp_op_cross_entropy(fsdp_tensor **out, fsdp_tensor *logits, fsdp_tensor *targets,
                          int ignore_index) {
  if (logits->ndim < 1)
    return fsdp_error("cross_entropy: logits must have a class dimension, got a scalar");
  int64_t V = logits->shape[logits->ndim - 1], N = V ? fsdp_tensor_numel(logits) / V : 0;
  bool shape_ok = targets->ndim == logits->ndim - 1;
  for (int q = 0; shape_ok && q < targets->ndim; q++)
    shape_ok = targets->shape[q] == logits->shape[q];
  if (!shape_ok && !(targets->ndim == 1 && targets->shape[0] == N))
    return fsdp_error("cross_entropy: targets %s do not match logits %s (targets need the "
                      "logits' shape without its last dimension)",
                      FSDP_SHAPE_STR(targets), FSDP_SHAPE_STR(logits));
  if (check_id_dtype("cross_entropy", "target", targets)) return FSDP_ERR;
  const fsdp_kernels_i *k = KERNELS("cross_entropy", logits, targets);
  if (!k) return FSDP_ERR;
  fsdp_tensor *lc = NULL, *tc = NULL, *lse = NULL;
  int rc = FSDP_ERR;
  if (contig(&lc, logits, "cross_entropy") || contig(&tc, targets, "cross_entropy")) goto done;
  int64_t bad, ignore = ignore_index;
  double bv;
  if (check_ids("cross_entropy", tc, V, &ignore, &bad, &bv)) goto done;
  if (bad >= 0) {
    fsdp_error("cross_entropy: target %g at position %lld is not a class in [0, %lld) nor the "
               "ignore index %d (logits %s, targets %s)",
               bv, (long long)bad + 1, (long long)V, ignore_index, FSDP_SHAPE_STR(logits),
               FSDP_SHAPE_STR(targets));
    goto done;
  }
  /* the loss is f32 whatever the logits are: it is what users print and compare */
  if (new_out(&lse, logits, FSDP_DTYPE_F32, 1, &N, "cross_entropy") ||
      new_out(out, logits, FSDP_DTYPE_F32, 0, NULL, "cross_entropy"))
    goto done;
  int64_t count = 0;
  RUN(k->cross_entropy_forward(CTX(logits), logits->dtype, D(*out), D(lse), D(lc), D(tc),
                               tc->dtype, N, (int)V, ignore, &count));
  fsdp_tensor *in[1] = {logits}, *sv[3] = {lc, tc, lse};
  rc = record("cross_entropy", bw_cross_entropy, out, in, 1, sv, 3,
              ARGS(N, V, ignore_index, count));
done:
  fsdp_tensor_release(lc);
  fsdp_tensor_release(tc);
  fsdp_tensor_release(lse);
  return rc;
}

static int bw_mse(fsdp_node *n) {
  void *da, *db;
  if (grad_of(n, 0, &da) || grad_of(n, 1, &db)) return FSDP_ERR;
  const fsdp_tensor *a = n->saved[0];
  return NK(n)->mse_backward(NCTX(n), a->dtype, da, db, D(n->out->grad), D(a), D(n->saved[1]),
                             fsdp_tensor_numel(a));
}

int fsdp_op_mse(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b) {
  if (!fsdp_tensor_same_shape(a, b))
    return fsdp_error("mse: shapes %s and %s differ", FSDP_SHAPE_STR(a), FSDP_SHAPE_STR(b));
  const fsdp_kernels_i *k = KERNELS("mse", a, b);
  if (!k || same_dtype("mse", a, b)) return FSDP_ERR;
  fsdp_tensor *ac = NULL, *bc = NULL;
  int rc = FSDP_ERR;
  if (contig(&ac, a, "mse") || contig(&bc, b, "mse")) goto done;
  if (new_out(out, a, FSDP_DTYPE_F32, 0, NULL, "mse")) goto done;
  RUN(k->mse_forward(CTX(a), a->dtype, D(*out), D(ac), D(bc), fsdp_tensor_numel(ac)));
  fsdp_tensor *in[2] = {a, b}, *sv[2] = {ac, bc};
  rc = record("mse", bw_mse, out, in, 2, sv, 2, NULL);
done:
  fsdp_tensor_release(ac);
  fsdp_tensor_release(bc);
  return rc;
}

/* The scale of a mean over R elements: 1 / R in double for f64, whose gradient and values an
 * f32 reciprocal would leave with f32's precision; the f32 reciprocal for the other dtypes,
 * whose kernels multiply by it as a float. */
static double mean_scale(fsdp_dtype dt, int64_t R) {
  if (R == 0) return NAN;
  return dt == FSDP_DTYPE_F64 ? 1.0 / (double)R : (double)(1.0f / (float)R);
}

/* sum over a middle axis: i[0..2] = outer, R, inner; i[3] 1 for a mean */
static int bw_sum_dim(fsdp_node *n) {
  void *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (!da) return FSDP_OK;
  return NK(n)->sum_dim_backward(NCTX(n), NDT(n), da, D(n->out->grad), n->i[0], n->i[1],
                                 n->i[2], n->i[3] ? mean_scale(NDT(n), n->i[1]) : 1.0);
}

static int sum_all(fsdp_tensor **out, fsdp_tensor *a, bool mean) {
  const char *name = mean ? "mean" : "sum";
  const fsdp_kernels_i *k = KERNELS(name, a);
  if (!k) return FSDP_ERR;
  fsdp_tensor *ac;
  if (contig(&ac, a, name)) return FSDP_ERR;
  int64_t N = fsdp_tensor_numel(ac);
  /* integers sum to i64, as PyTorch */
  fsdp_dtype odt = fsdp_dtype_is_float(a->dtype) ? a->dtype : FSDP_DTYPE_I64;
  int rc = new_out(out, a, odt, 0, NULL, name);
  if (rc) goto done;
  RUN(k->sum(CTX(a), a->dtype, D(*out), D(ac), N, mean));
  rc = record(name, bw_sum_dim, out, &a, 1, NULL, 0, ARGS(1, N, 1, mean));
done:
  fsdp_tensor_release(ac);
  return rc;
}

int fsdp_op_sum(fsdp_tensor **out, fsdp_tensor *a) { return sum_all(out, a, false); }
int fsdp_op_mean(fsdp_tensor **out, fsdp_tensor *a) { return sum_all(out, a, true); }

int fsdp_op_sum_dim(fsdp_tensor **out, fsdp_tensor *a, int dim, bool mean) {
  const char *name = mean ? "mean" : "sum";
  if (dim < 0 || dim >= a->ndim)
    return fsdp_error("%s: dimension %d out of range for a tensor %s", name, dim + 1,
                      FSDP_SHAPE_STR(a));
  const fsdp_kernels_i *k = KERNELS(name, a);
  if (!k) return FSDP_ERR;
  if (mean && !fsdp_dtype_is_float(a->dtype))
    return fsdp_error("mean: needs a float tensor, got %s (convert it with t:to(\"f32\"))",
                      fsdp_dtype_name(a->dtype));
  if (a->dtype == FSDP_DTYPE_U8 || a->dtype == FSDP_DTYPE_I32) {
    /* integers sum to i64, as the whole-tensor sum does (not saturating at 255); never
     * recorded: integer tensors carry no gradient */
    fsdp_tensor *wide;
    if (fsdp_to(&wide, a, dev_of(a), FSDP_DTYPE_I64, FSDP_ROLE_ACTIVATIONS))
      return fsdp_error_context("%s", name);
    int rc = fsdp_op_sum_dim(out, wide, dim, false);
    fsdp_tensor_release(wide);
    return rc;
  }
  int64_t outer = prod(a->shape, dim), R = a->shape[dim],
          inner = prod(a->shape + dim + 1, a->ndim - dim - 1);
  int64_t oshape[FSDP_MAX_DIMS];
  int ond = 0;
  for (int q = 0; q < a->ndim; q++)
    if (q != dim) oshape[ond++] = a->shape[q];
  fsdp_tensor *ac;
  if (contig(&ac, a, name)) return FSDP_ERR;
  int rc = new_out(out, a, a->dtype, ond, oshape, name);
  if (rc) goto done;
  RUN(k->sum_dim_forward(CTX(a), a->dtype, D(*out), D(ac), outer, R, inner,
                         mean ? mean_scale(a->dtype, R) : 1.0));
  rc = record(name, bw_sum_dim, out, &a, 1, NULL, 0, ARGS(outer, R, inner, mean));
done:
  fsdp_tensor_release(ac);
  return rc;
}

/* ---- views ------------------------------------------------------------------------------- */

/* view/contiguous: the flat logical order is unchanged, gradients add elementwise. When the
 * input is a non-leaf without a gradient yet, it takes the output's gradient buffer as its
 * own (a view of it: gradient buffers are contiguous in logical order, so the bytes are the
 * same): no zero-fill and no pass over what can be a (B*T, V) logits gradient. The output's
 * gradient is dropped right after this node, but the buffer may still be another tensor's
 * gradient (the output was an addend of a sum: fsdp_grad_share), so the alias is marked
 * shared: a later write into the input's gradient goes into a copy while any other tensor
 * still holds that memory (fsdp_grad_acc), and in place once none does. Leaf gradients
 * (parameters) keep their own storage, accounted as grads. */
static int bw_flat(fsdp_node *n) {
  fsdp_tensor *in = n->in[0];
  if (!in->requires_grad) return FSDP_OK;
  if (!in->grad && !in->is_leaf && fsdp_tensor_is_contiguous(n->out->grad)) {
    fsdp_tensor *g;
    if (fsdp_tensor_view(&g, n->out->grad, in->ndim, in->shape)) return FSDP_ERR;
    in->grad = g; /* the new reference moves into in */
    in->grad_shared = true;
    return FSDP_OK;
  }
  void *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  return NK(n)->axpy(NCTX(n), NDT(n), da, D(n->out->grad), 1.0, fsdp_tensor_numel(n->out));
}

/* A contiguous copy of a, not recorded: accounted as an activation; a meta tensor gives a
 * meta copy (views and copies are shape-only operations). */
static int copy_contiguous(fsdp_tensor **out, fsdp_tensor *a) {
  if (fsdp_tensor_new_uninit(out, dev_of(a), a->dtype, a->ndim, a->shape, FSDP_ROLE_ACTIVATIONS))
    return FSDP_ERR;
  if (fsdp_copy(*out, a)) {
    fsdp_tensor_release(*out);
    *out = NULL;
    return FSDP_ERR;
  }
  return FSDP_OK;
}

int fsdp_op_contiguous(fsdp_tensor **out, fsdp_tensor *a) {
  if (fsdp_tensor_is_contiguous(a)) {
    fsdp_tensor_retain(a);
    *out = a;
    return FSDP_OK;
  }
  if (copy_contiguous(out, a)) return fsdp_error_context("contiguous");
  return record("contiguous", bw_flat, out, &a, 1, NULL, 0, NULL);
}

/* Like reshape: a non-contiguous input is copied first. The copy is recorded only once the
 * view is known to be valid, so a bad shape leaves nothing on the tape. */
int fsdp_op_view(fsdp_tensor **out, fsdp_tensor *a, int ndim, const int64_t *shape) {
  fsdp_tensor *ac = a;
  bool copied = !fsdp_tensor_is_contiguous(a);
  if (!copied) fsdp_tensor_retain(a);
  else if (copy_contiguous(&ac, a)) return fsdp_error_context("view %s", FSDP_SHAPE_STR(a));
  int rc = fsdp_tensor_view(out, ac, ndim, shape);
  if (!rc) {
    if (copied) {
      rc = record("contiguous", bw_flat, &ac, &a, 1, NULL, 0, NULL);
      if (rc) { /* ac is gone: the view over it goes too */
        fsdp_tensor_release(*out);
        *out = NULL;
        return FSDP_ERR;
      }
    }
    rc = record("view", bw_flat, out, &ac, 1, NULL, 0, NULL);
  }
  fsdp_tensor_release(ac);
  return rc;
}

/* i[0], i[1]: the swapped dims */
static int bw_transpose(fsdp_node *n) {
  void *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (!da) return FSDP_OK;
  const fsdp_tensor *o = n->out;
  int64_t ds[FSDP_MAX_DIMS], ss[FSDP_MAX_DIMS];
  contiguous_strides(ds, n->in[0]->ndim, n->in[0]->shape);
  int64_t t = ds[n->i[0]];
  ds[n->i[0]] = ds[n->i[1]];
  ds[n->i[1]] = t;
  contiguous_strides(ss, o->ndim, o->shape);
  return NK(n)->add_strided(NCTX(n), NDT(n), da, ds, D(o->grad), ss, o->ndim, o->shape);
}

int fsdp_op_transpose(fsdp_tensor **out, fsdp_tensor *a, int d0, int d1) {
  if (fsdp_tensor_transpose(out, a, d0, d1)) return FSDP_ERR; /* "transpose: ..." */
  return record("transpose", bw_transpose, out, &a, 1, NULL, 0, ARGS(d0, d1));
}

/* i[0] dim, i[1] start */
static int bw_narrow(fsdp_node *n) {
  void *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (!da) return FSDP_OK;
  const fsdp_tensor *o = n->out;
  int64_t ds[FSDP_MAX_DIMS], ss[FSDP_MAX_DIMS];
  contiguous_strides(ds, n->in[0]->ndim, n->in[0]->shape);
  contiguous_strides(ss, o->ndim, o->shape);
  char *base = (char *)da + n->i[1] * ds[n->i[0]] * (int64_t)fsdp_dtype_size(NDT(n));
  return NK(n)->add_strided(NCTX(n), NDT(n), base, ds, D(o->grad), ss, o->ndim, o->shape);
}

int fsdp_op_narrow(fsdp_tensor **out, fsdp_tensor *a, int dim, int64_t start, int64_t len) {
  if (fsdp_tensor_narrow(out, a, dim, start, len)) return FSDP_ERR; /* "narrow: ..." */
  return record("narrow", bw_narrow, out, &a, 1, NULL, 0, ARGS(dim, start));
}

int fsdp_op_detach(fsdp_tensor **out, fsdp_tensor *a) {
  if (fsdp_tensor_new_view(out, a, a->offset, a->ndim, a->shape, a->strides))
    return fsdp_error_context("detach");
  (*out)->requires_grad = false;
  (*out)->is_leaf = true;
  return FSDP_OK;
}

/* ---- comparisons, where, clamp ----------------------------------------------------------- */

int fsdp_op_compare(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b, fsdp_cmpop op) {
  static const char *names[] = {"gt", "ge", "lt", "le", "eq", "ne"};
  static const fsdp_cmpop flipped[] = {FSDP_CMP_LT, FSDP_CMP_LE, FSDP_CMP_GT, FSDP_CMP_GE,
                                       FSDP_CMP_EQ, FSDP_CMP_NE};
  *out = NULL;
  const char *name = names[op];
  const fsdp_kernels_i *k = KERNELS(name, a, b);
  if (!k) return FSDP_ERR;
  if (!is_suffix(a, b)) { /* a is the smaller one: compare b with a, the other way round */
    if (!is_suffix(b, a))
      return fsdp_error("%s: shapes %s and %s do not broadcast (one shape must end with the "
                        "other)", name, FSDP_SHAPE_STR(a), FSDP_SHAPE_STR(b));
    fsdp_tensor *t = a;
    a = b, b = t;
    op = flipped[op];
  }
  fsdp_dtype dt = promote(a->dtype, b->dtype);
  fsdp_tensor *ac = NULL, *bc = NULL;
  int rc = FSDP_ERR;
  if (fsdp_to(&ac, a, dev_of(a), dt, FSDP_ROLE_ACTIVATIONS) ||
      fsdp_to(&bc, b, dev_of(a), dt, FSDP_ROLE_ACTIVATIONS)) {
    fsdp_error_context("%s", name);
    goto done;
  }
  if (new_out(out, a, FSDP_DTYPE_BOOL, a->ndim, a->shape, name)) goto done;
  RUN(k->compare(CTX(a), dt, op, D(*out), D(ac), D(bc), fsdp_tensor_numel(ac),
                 fsdp_tensor_numel(bc)));
  rc = FSDP_OK;
done:
  fsdp_tensor_release(ac);
  fsdp_tensor_release(bc);
  return rc;
}

/* saved[0]: cond (bool, the output's shape). The gradient of a is where(cond, g, 0), of b
 * where(cond, 0, g). */
static int bw_where(fsdp_node *n) {
  void *da, *db;
  if (grad_of(n, 0, &da) || grad_of(n, 1, &db)) return FSDP_ERR;
  const fsdp_tensor *o = n->out;
  int64_t N = fsdp_tensor_numel(o);
  fsdp_tensor *zero = NULL, *part = NULL;
  int rc = fsdp_tensor_new(&zero, dev_of(o), o->dtype, o->ndim, o->shape, FSDP_ROLE_ACTIVATIONS);
  if (!rc) rc = fsdp_tensor_new_uninit(&part, dev_of(o), o->dtype, o->ndim, o->shape,
                                       FSDP_ROLE_ACTIVATIONS);
  const fsdp_kernels_i *k = NK(n);
  void *ctx = NCTX(n);
  for (int side = 0; side < 2 && !rc; side++) {
    void *d = side ? db : da;
    if (!d) continue;
    const void *g = D(o->grad), *z = D(zero);
    rc = k->where(ctx, o->dtype, D(part), D(n->saved[0]), side ? z : g, side ? g : z, N);
    if (!rc) rc = k->axpy(ctx, o->dtype, d, D(part), 1.0, N);
  }
  fsdp_tensor_release(zero);
  fsdp_tensor_release(part);
  return rc;
}

/* t as the given shape (a suffix of it): t retained when it already has it; expanded
 * (recorded) otherwise */
static int expand_as(fsdp_tensor **out, fsdp_tensor *t, const fsdp_tensor *like,
                     const char *op) {
  if (fsdp_tensor_same_shape(t, like)) {
    fsdp_tensor_retain(t);
    *out = t;
    return FSDP_OK;
  }
  if (!is_suffix(like, t))
    return fsdp_error("%s: shape %s does not broadcast to %s (it must end the other)", op,
                      FSDP_SHAPE_STR(t), FSDP_SHAPE_STR(like));
  return expand_to(out, t, like, op);
}

int fsdp_op_where(fsdp_tensor **out, fsdp_tensor *cond, fsdp_tensor *a, fsdp_tensor *b) {
  *out = NULL;
  const fsdp_kernels_i *k = KERNELS("where", cond, a, b);
  if (!k) return FSDP_ERR;
  /* the output shape: the one of the three the others are suffixes of, so the most dimensions
   * (an empty (0, 4) holds fewer elements than the (4) or the number that broadcast to it) */
  fsdp_tensor *big = cond;
  fsdp_tensor *const ops[2] = {a, b};
  for (int i = 0; i < 2; i++)
    if (ops[i]->ndim > big->ndim ||
        (ops[i]->ndim == big->ndim && fsdp_tensor_numel(ops[i]) > fsdp_tensor_numel(big)))
      big = ops[i];
  fsdp_tensor *pa = NULL, *pb = NULL, *ea = NULL, *eb = NULL, *c1 = NULL, *cb = NULL,
              *ac = NULL, *bc = NULL;
  int rc = FSDP_ERR;
  if (promoted("where", &pa, &pb, a, b)) return FSDP_ERR;
  if (expand_as(&ea, pa, big, "where") || expand_as(&eb, pb, big, "where")) goto done;
  /* cond as bool of the output's shape (not recorded: no gradient flows into a condition) */
  if (fsdp_to(&c1, cond, dev_of(cond), FSDP_DTYPE_BOOL, FSDP_ROLE_ACTIVATIONS)) goto done;
  if (!fsdp_tensor_same_shape(c1, big)) {
    bool was = fsdp_set_grad_enabled(false);
    int erc = expand_as(&cb, c1, big, "where");
    fsdp_set_grad_enabled(was);
    if (erc) goto done;
  } else {
    cb = c1;
    fsdp_tensor_retain(cb);
  }
  if (contig(&ac, ea, "where") || contig(&bc, eb, "where")) goto done;
  if (new_out(out, ea, ea->dtype, big->ndim, big->shape, "where")) goto done;
  RUN(k->where(CTX(ea), ea->dtype, D(*out), D(cb), D(ac), D(bc), fsdp_tensor_numel(cb)));
  fsdp_tensor *in[2] = {ea, eb}, *sv[1] = {cb};
  rc = record("where", bw_where, out, in, 2, sv, 1, NULL);
done:
  fsdp_tensor_release(pa);
  fsdp_tensor_release(pb);
  fsdp_tensor_release(ea);
  fsdp_tensor_release(eb);
  fsdp_tensor_release(c1);
  fsdp_tensor_release(cb);
  fsdp_tensor_release(ac);
  fsdp_tensor_release(bc);
  return rc;
}

/* f[0], f[1] would lose precision for large bounds: the bounds travel in i[0], i[1] as bits */
static int bw_clamp(fsdp_node *n) {
  void *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (!da) return FSDP_OK;
  double lo, hi;
  memcpy(&lo, &n->i[0], sizeof lo);
  memcpy(&hi, &n->i[1], sizeof hi);
  return NK(n)->clamp_backward(NCTX(n), NDT(n), da, D(n->out->grad), D(n->saved[0]), lo, hi,
                               fsdp_tensor_numel(n->out));
}

int fsdp_op_clamp(fsdp_tensor **out, fsdp_tensor *a, double lo, double hi) {
  *out = NULL;
  if (lo > hi) return fsdp_error("clamp: min %g is above max %g", lo, hi);
  const fsdp_kernels_i *k = KERNELS("clamp", a);
  if (!k) return FSDP_ERR;
  fsdp_tensor *ac;
  if (contig(&ac, a, "clamp")) return FSDP_ERR;
  int rc = new_out(out, a, a->dtype, a->ndim, a->shape, "clamp");
  if (rc) goto done;
  RUN(k->clamp_forward(CTX(a), a->dtype, D(*out), D(ac), lo, hi, fsdp_tensor_numel(ac)));
  rec_args args = {0};
  memcpy(&args.i[0], &lo, sizeof lo);
  memcpy(&args.i[1], &hi, sizeof hi);
  rc = record("clamp", bw_clamp, out, &a, 1, &ac, 1, &args);
done:
  fsdp_tensor_release(ac);
  return rc;
}

/* ---- cat, stack ------------------------------------------------------------------------------ */

/* i[0] dim; the inputs' sizes along dim are their own shapes. Each input's gradient is its
 * slice of the output's. */
static int bw_cat(fsdp_node *n) {
  const fsdp_tensor *o = n->out;
  int dim = (int)n->i[0];
  int64_t ss[FSDP_MAX_DIMS], start = 0;
  contiguous_strides(ss, o->ndim, o->shape);
  const size_t es = fsdp_dtype_size(o->dtype);
  for (int i = 0; i < n->nmore; i++) {
    fsdp_tensor *t = n->more[i];
    int64_t len = t->shape[dim];
    if (t->requires_grad) {
      void *d;
      if (grad_buf(t, &d)) return FSDP_ERR;
      int64_t ds[FSDP_MAX_DIMS];
      contiguous_strides(ds, t->ndim, t->shape);
      const char *g = (const char *)D(o->grad) + start * ss[dim] * (int64_t)es;
      int rc = NK(n)->add_strided(NCTX(n), NDT(n), d, ds, g, ss, t->ndim, t->shape);
      if (flush_detours(rc)) return FSDP_ERR; /* one input's detour at a time */
    }
    start += len;
  }
  return FSDP_OK;
}

int fsdp_op_cat(fsdp_tensor **out, fsdp_tensor *const *ts, int n, int dim) {
  *out = NULL;
  if (n < 1) return fsdp_error("cat: needs at least one tensor");
  const fsdp_tensor *t0 = ts[0];
  if (dim < 0 || dim >= t0->ndim)
    return fsdp_error("cat: dimension %d out of range for tensors %s", dim + 1,
                      FSDP_SHAPE_STR(t0));
  int64_t total = 0;
  for (int i = 0; i < n; i++) {
    const fsdp_tensor *t = ts[i];
    bool ok = t->ndim == t0->ndim;
    for (int q = 0; ok && q < t->ndim; q++) ok = q == dim || t->shape[q] == t0->shape[q];
    if (!ok)
      return fsdp_error("cat: tensor %d has shape %s, tensor 1 %s: they must agree except in "
                        "dimension %d", i + 1, FSDP_SHAPE_STR(t), FSDP_SHAPE_STR(t0), dim + 1);
    if (t->dtype != t0->dtype)
      return fsdp_error("cat: tensor %d is %s, tensor 1 %s (convert with t:to())", i + 1,
                        fsdp_dtype_name(t->dtype), fsdp_dtype_name(t0->dtype));
    if (!kernels("cat", (fsdp_tensor *const[]){ts[0], ts[i]}, 2)) return FSDP_ERR;
    total += t->shape[dim];
  }
  int64_t shape[FSDP_MAX_DIMS];
  memcpy(shape, t0->shape, sizeof(int64_t) * (size_t)t0->ndim);
  shape[dim] = total;
  if (new_out(out, t0, t0->dtype, t0->ndim, shape, "cat")) return FSDP_ERR;
  int64_t start = 0;
  for (int i = 0; i < n; i++) {
    fsdp_tensor *slot;
    int rc = fsdp_tensor_narrow(&slot, *out, dim, start, ts[i]->shape[dim]);
    if (!rc) rc = fsdp_copy(slot, ts[i]);
    fsdp_tensor_release(slot);
    if (rc) {
      fsdp_tensor_release(*out);
      *out = NULL;
      return fsdp_error_context("cat");
    }
    start += ts[i]->shape[dim];
  }
  (*out)->version = 0;
  if (!fsdp_needs_grad(ts, n)) return FSDP_OK;
  fsdp_node *node = fsdp_node_new("cat", run_backward);
  fsdp_tensor **more = calloc((size_t)n, sizeof *more);
  if (!node || !more) {
    free(node);
    free(more);
    fsdp_tensor_release(*out);
    *out = NULL;
    return fsdp_error("cat: out of memory recording the autograd node");
  }
  node->impl = bw_cat;
  fsdp_tensor *o = *out;
  o->requires_grad = true;
  o->is_leaf = false;
  fsdp_tensor_retain(o);
  node->out = o;
  node->out_stamp = fsdp_stamp_of(o);
  node->i[0] = dim;
  for (int i = 0; i < n; i++) {
    fsdp_tensor_retain(ts[i]);
    more[i] = ts[i];
  }
  node->more = more;
  node->nmore = n;
  if (fsdp_tape_push(node)) {
    fsdp_tensor_release(*out);
    *out = NULL;
    return FSDP_ERR;
  }
  return FSDP_OK;
}

int fsdp_op_stack(fsdp_tensor **out, fsdp_tensor *const *ts, int n, int dim) {
  *out = NULL;
  if (n < 1) return fsdp_error("stack: needs at least one tensor");
  const fsdp_tensor *t0 = ts[0];
  if (dim < 0 || dim > t0->ndim || t0->ndim + 1 > FSDP_MAX_DIMS)
    return fsdp_error("stack: dimension %d out of range for tensors %s", dim + 1,
                      FSDP_SHAPE_STR(t0));
  for (int i = 0; i < n; i++)
    if (!fsdp_tensor_same_shape(ts[i], t0))
      return fsdp_error("stack: tensor %d has shape %s, tensor 1 %s: stacked tensors share "
                        "one shape", i + 1, FSDP_SHAPE_STR(ts[i]), FSDP_SHAPE_STR(t0));
  fsdp_tensor **views = calloc((size_t)n, sizeof *views);
  if (!views) return fsdp_error("stack: out of memory");
  int rc = FSDP_OK;
  for (int i = 0; i < n && !rc; i++) {
    int64_t shape[FSDP_MAX_DIMS];
    for (int q = 0, r = 0; q <= t0->ndim; q++) shape[q] = q == dim ? 1 : t0->shape[r++];
    rc = fsdp_op_view(&views[i], ts[i], t0->ndim + 1, shape);
  }
  if (!rc) rc = fsdp_op_cat(out, views, n, dim);
  for (int i = 0; i < n; i++) fsdp_tensor_release(views[i]);
  free(views);
  return rc ? fsdp_error_context("stack") : FSDP_OK;
}

/* ---- max, min, argmax, topk, sort along a dim -------------------------------------------------- */

/* i[0..3] = outer, R, inner, K; saved[0] the i64 indices (outer, K, inner) */
static int bw_gather_dim(fsdp_node *n) {
  void *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (!da) return FSDP_OK;
  return NK(n)->index_add_dim(NCTX(n), NDT(n), da, D(n->out->grad), D(n->saved[0]), n->i[0],
                              n->i[1], n->i[2], n->i[3]);
}

/* values / indices of shape `shape` from a (outer, R, inner) reduced to (outer, K, inner) by
 * run(values, indices); indices always computed (the backward needs them) */
static int along_dim(fsdp_tensor **values, fsdp_tensor **indices, fsdp_tensor *a, int dim,
                     int64_t K, int ndim, const int64_t *shape, const char *name,
                     bool is_max, bool largest, bool top) {
  if (values) *values = NULL;
  if (indices) *indices = NULL;
  const fsdp_kernels_i *k = KERNELS(name, a);
  if (!k) return FSDP_ERR;
  int64_t outer = prod(a->shape, dim), R = a->shape[dim],
          inner = prod(a->shape + dim + 1, a->ndim - dim - 1);
  fsdp_tensor *ac = NULL, *idx = NULL, *val = NULL;
  int rc = FSDP_ERR;
  if (contig(&ac, a, name)) return FSDP_ERR;
  if (new_out(&idx, a, FSDP_DTYPE_I64, ndim, shape, name)) goto done;
  if (values && new_out(&val, a, a->dtype, ndim, shape, name)) goto done;
  if (outer * inner * K > 0) {
    int krc = top ? k->topk(CTX(a), a->dtype, D(val), D(idx), D(ac), outer, R, inner, K, largest)
                  : k->extreme_dim(CTX(a), a->dtype, is_max, D(val), D(idx), D(ac), outer, R,
                                   inner);
    if (krc) goto done;
  }
  if (values) {
    *values = val;
    val = NULL;
    fsdp_tensor *sv[1] = {idx};
    if (record(name, bw_gather_dim, values, &a, 1, sv, 1, ARGS(outer, R, inner, K))) goto done;
  }
  if (indices) {
    *indices = idx;
    idx = NULL;
  }
  rc = FSDP_OK;
done:
  fsdp_tensor_release(ac);
  fsdp_tensor_release(idx);
  fsdp_tensor_release(val);
  if (rc && values) {
    fsdp_tensor_release(*values);
    *values = NULL;
  }
  return rc;
}

int fsdp_op_extreme(fsdp_tensor **values, fsdp_tensor **indices, fsdp_tensor *a, int dim,
                    bool max, bool keepdim) {
  const char *name = !values ? (max ? "argmax" : "argmin") : max ? "max" : "min";
  if (dim < 0 || dim >= a->ndim)
    return fsdp_error("%s: dimension %d out of range for a tensor %s", name, dim + 1,
                      FSDP_SHAPE_STR(a));
  if (a->shape[dim] == 0)
    return fsdp_error("%s: dimension %d of the tensor %s is empty", name, dim + 1,
                      FSDP_SHAPE_STR(a));
  int64_t shape[FSDP_MAX_DIMS];
  int nd = 0;
  for (int q = 0; q < a->ndim; q++)
    if (q != dim) shape[nd++] = a->shape[q];
    else if (keepdim) shape[nd++] = 1;
  return along_dim(values, indices, a, dim, 1, nd, shape, name, max, max, false);
}

int fsdp_op_topk(fsdp_tensor **values, fsdp_tensor **indices, fsdp_tensor *a, int64_t k,
                 int dim, bool largest) {
  if (dim < 0 || dim >= a->ndim)
    return fsdp_error("topk: dimension %d out of range for a tensor %s", dim + 1,
                      FSDP_SHAPE_STR(a));
  if (k < 0 || k > a->shape[dim])
    return fsdp_error("topk: k = %lld is not in [0, %lld] (dimension %d of a tensor %s)",
                      (long long)k, (long long)a->shape[dim], dim + 1, FSDP_SHAPE_STR(a));
  int64_t shape[FSDP_MAX_DIMS];
  memcpy(shape, a->shape, sizeof(int64_t) * (size_t)a->ndim);
  shape[dim] = k;
  return along_dim(values, indices, a, dim, k, a->ndim, shape, "topk", largest, largest, true);
}
