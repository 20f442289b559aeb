/*
 * ops.c — differentiable ops: validate shapes, run the forward kernel, record a tape node whose
 * backward calls the matching backward kernel.
 *
 * Gradient buffers are always contiguous in the logical (row-major) order of their tensor's
 * shape, whatever the tensor's own strides. So a kernel that reads contiguous copies of its
 * inputs writes input gradients straight into fsdp_grad_acc(original input); only the view
 * ops (transpose, narrow) need strided accumulation.
 *
 * Node layout convention: in[k] are the tensors gradients flow into (NULL for absent optional
 * inputs); saved[k] are contiguous copies (or the same tensors) the backward reads.
 * Owner: grad.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd.h"
#include "kernels/cpu/kernels.h"

/* ---- helpers ---------------------------------------------------------------------------- */

static int64_t prod(const int64_t *s, int n) {
  int64_t p = 1;
  for (int i = 0; i < n; i++) p *= s[i];
  return p;
}

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
  if (fsdp_tensor_new(&c, t->storage->device, t->dtype, t->ndim, t->shape,
                      FSDP_ROLE_ACTIVATIONS))
    return fsdp_error_context("%s", op);
  if (fsdp_tensor_copy(c, t)) {
    fsdp_tensor_release(c);
    return fsdp_error_context("%s", op);
  }
  *out = c;
  return FSDP_OK;
}

/* Op outputs: every forward kernel writes its whole output, so no clearing is needed. */
static int new_out(fsdp_tensor **out, int ndim, const int64_t *shape, const char *op) {
  if (fsdp_tensor_new_f32_uninit(out, ndim, shape)) return fsdp_error_context("%s", op);
  return FSDP_OK;
}

static float *D(fsdp_tensor *t) { return (float *)fsdp_tensor_data(t, "op"); }

/* What a recorded op's backward needs besides tensors: sizes and dims (n->i), one float
 * (n->f[0]), and whether it reads its output (so an in-place change of it is caught). */
typedef struct {
  int64_t i[8];
  float f0;
  bool reads_out;
} rec_args;
/* ARGS(M, K, N): integer arguments only. */
#define ARGS(...) (&(const rec_args){.i = {__VA_ARGS__}})

/* Record a node if any of in[] requires a gradient; marks *out as a non-leaf that does.
 * Retains *out, in[] and saved[]; a (may be NULL) goes into the node. On failure *out is
 * released and set to NULL, so callers just return the status. */
static int record(const char *op, fsdp_backward_fn fn, fsdp_tensor **out, fsdp_tensor **in,
                  int nin, fsdp_tensor **saved, int nsaved, const rec_args *a) {
  if (!fsdp_needs_grad(in, nin)) return FSDP_OK;
  fsdp_node *n = fsdp_node_new(op, fn);
  if (!n) goto fail;
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
      n->saved_version[i] = saved[i]->version;
    }
  }
  if (a) {
    memcpy(n->i, a->i, sizeof a->i);
    n->f[0] = a->f0;
    n->reads_out = a->reads_out;
  }
  n->out_version = o->version;
  if (fsdp_tape_push(n) == FSDP_OK) return FSDP_OK;
fail:
  fsdp_tensor_release(*out);
  *out = NULL;
  return FSDP_ERR;
}

/* Gradient buffer of input k if it wants one, else NULL (kernels skip NULL outputs). */
static int grad_of(fsdp_node *n, int k, float **g) {
  *g = NULL;
  fsdp_tensor *t = n->in[k];
  if (!t || !t->requires_grad) return FSDP_OK;
  *g = fsdp_grad_acc(t);
  return *g ? FSDP_OK : FSDP_ERR;
}

/* dst[idx] += src[idx] over a shape, both with their own element strides. */
static void strided_add(float *dst, const int64_t *ds, const float *src, const int64_t *ss,
                        int nd, const int64_t *shape) {
  if (nd == 0) {
    dst[0] += src[0];
    return;
  }
  int64_t n = prod(shape, nd);
  if (n == 0) return;
  int last = nd - 1;
  int64_t L = shape[last], dsl = ds[last], ssl = ss[last];
  int64_t idx[FSDP_MAX_DIMS] = {0};
  for (int64_t r = 0; r < n / L; r++) {
    int64_t od = 0, os = 0;
    for (int k = 0; k < last; k++) {
      od += idx[k] * ds[k];
      os += idx[k] * ss[k];
    }
    for (int64_t j = 0; j < L; j++) dst[od + j * dsl] += src[os + j * ssl];
    for (int k = last - 1; k >= 0; k--) {
      if (++idx[k] < shape[k]) break;
      idx[k] = 0;
    }
  }
}

static void contiguous_strides(int64_t *st, int nd, const int64_t *shape) {
  int64_t s = 1;
  for (int k = nd - 1; k >= 0; k--) {
    st[k] = s;
    s *= shape[k];
  }
}

/* Every v[i] an integer in [lo, hi) (or equal to *ignore when ignore is non-NULL); else the
 * first offending index in *bad. Compares in float: casting NaN or a huge value to an integer
 * type would be undefined. */
static bool is_integral_in(const float *v, int64_t n, int64_t lo, int64_t hi, const int *ignore,
                           int64_t *bad) {
  for (int64_t i = 0; i < n; i++) {
    float x = v[i];
    if (ignore && x == (float)*ignore) continue;
    if (!(x >= (float)lo && x < (float)hi) || x != floorf(x)) {
      *bad = i;
      return false;
    }
  }
  return true;
}

/* ---- binary elementwise with suffix broadcasting ------------------------------------------ */

static const char *binop_name[] = {"add", "sub", "mul", "div"};

static int bw_binary(fsdp_node *n) {
  float *da, *db;
  if (grad_of(n, 0, &da) || grad_of(n, 1, &db)) return FSDP_ERR;
  int64_t N = n->i[0], M = n->i[1];
  if (M == 0) return FSDP_OK; /* no elements (then N is 0 too) */
  fsdp_cpu_binary_backward(da, db, D(n->out->grad), D(n->saved[0]), D(n->saved[1]), N, M,
                           (fsdp_binop)n->i[2]);
  return FSDP_OK;
}

/* b's shape a suffix of a's (or b a single element) */
static bool is_suffix(const fsdp_tensor *a, const fsdp_tensor *b) {
  if (fsdp_tensor_numel(b) == 1) return true;
  if (b->ndim > a->ndim) return false;
  for (int k = 1; k <= b->ndim; k++)
    if (b->shape[b->ndim - k] != a->shape[a->ndim - k]) return false;
  return true;
}

static int bw_expand(fsdp_node *n) {
  float *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  const float *g = D(n->out->grad);
  int64_t N = n->i[0], M = n->i[1];
  if (M == 0) return FSDP_OK;
  for (int64_t r = 0; r < N / M; r++)
    for (int64_t j = 0; j < M; j++) da[j] += g[r * M + j];
  return FSDP_OK;
}

/* a repeated to `like`'s shape (a's shape a suffix of like's); recorded. */
static int expand_to(fsdp_tensor **out, fsdp_tensor *a, const fsdp_tensor *like, const char *op) {
  fsdp_tensor *ac;
  if (contig(&ac, a, op)) return FSDP_ERR;
  int64_t N = fsdp_tensor_numel(like), M = fsdp_tensor_numel(ac);
  if (new_out(out, like->ndim, like->shape, op)) {
    fsdp_tensor_release(ac);
    return FSDP_ERR;
  }
  float *o = D(*out);
  const float *s = D(ac);
  for (int64_t r = 0; M > 0 && r < N / M; r++) memcpy(o + r * M, s, (size_t)M * sizeof(float));
  fsdp_tensor_release(ac);
  return record("expand", bw_expand, out, &a, 1, NULL, 0, ARGS(N, M));
}

int fsdp_op_binary(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b, fsdp_binary_op op) {
  const char *name = binop_name[op];
  fsdp_tensor *ea = NULL;
  if (!is_suffix(a, b)) {
    if (!is_suffix(b, a))
      return fsdp_error("%s: shapes %s and %s do not broadcast (one shape must end with the "
                        "other)", name, FSDP_SHAPE_STR(a), FSDP_SHAPE_STR(b));
    if (expand_to(&ea, a, b, name)) return FSDP_ERR;
    a = ea;
  }
  fsdp_tensor *ac = NULL, *bc = NULL;
  int rc = FSDP_ERR;
  if (contig(&ac, a, name) || contig(&bc, b, name)) goto done;
  int64_t N = fsdp_tensor_numel(ac), M = fsdp_tensor_numel(bc);
  if (new_out(out, a->ndim, a->shape, name)) goto done;
  if (M > 0) fsdp_cpu_binary_forward(D(*out), D(ac), D(bc), N, M, (fsdp_binop)op);
  fsdp_tensor *in[2] = {a, b}, *sv[2] = {ac, bc};
  rc = record(name, bw_binary, out, in, 2, sv, 2, ARGS(N, M, op));
done:
  fsdp_tensor_release(ac);
  fsdp_tensor_release(bc);
  fsdp_tensor_release(ea);
  return rc;
}

static int bw_affine(fsdp_node *n) {
  float *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (da) fsdp_cpu_affine_backward(da, D(n->out->grad), n->f[0], fsdp_tensor_numel(n->out));
  return FSDP_OK;
}

int fsdp_op_affine(fsdp_tensor **out, fsdp_tensor *a, float s, float t) {
  fsdp_tensor *ac;
  if (contig(&ac, a, "affine")) return FSDP_ERR;
  int rc = new_out(out, a->ndim, a->shape, "affine");
  if (!rc) {
    fsdp_cpu_affine_forward(D(*out), D(ac), s, t, fsdp_tensor_numel(ac));
    rc = record("affine", bw_affine, out, &a, 1, NULL, 0, &(const rec_args){.f0 = s});
  }
  fsdp_tensor_release(ac);
  return rc;
}

/* ---- unary ----------------------------------------------------------------------------- */

static const char *unary_name[] = {"relu", "gelu", "exp", "log", "sqrt", "tanh", "sigmoid"};

static int bw_unary(fsdp_node *n) {
  float *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (!da) return FSDP_OK;
  const float *g = D(n->out->grad), *x = D(n->saved[0]), *y = D(n->out);
  int64_t N = fsdp_tensor_numel(n->out);
  switch ((fsdp_unary_op)n->i[0]) {
  case FSDP_UNARY_RELU: fsdp_cpu_relu_backward(da, g, x, N); break;
  case FSDP_UNARY_GELU: fsdp_cpu_gelu_backward(da, g, x, N); break;
  case FSDP_UNARY_EXP:
    for (int64_t i = 0; i < N; i++) da[i] += g[i] * y[i];
    break;
  case FSDP_UNARY_LOG:
    for (int64_t i = 0; i < N; i++) da[i] += g[i] / x[i];
    break;
  case FSDP_UNARY_SQRT:
    for (int64_t i = 0; i < N; i++) da[i] += g[i] * 0.5f / y[i];
    break;
  case FSDP_UNARY_TANH:
    for (int64_t i = 0; i < N; i++) da[i] += g[i] * (1.0f - y[i] * y[i]);
    break;
  case FSDP_UNARY_SIGMOID:
    for (int64_t i = 0; i < N; i++) da[i] += g[i] * y[i] * (1.0f - y[i]);
    break;
  }
  return FSDP_OK;
}

int fsdp_op_unary(fsdp_tensor **out, fsdp_tensor *a, fsdp_unary_op op) {
  const char *name = unary_name[op];
  fsdp_tensor *ac;
  if (contig(&ac, a, name)) return FSDP_ERR;
  int rc = new_out(out, a->ndim, a->shape, name);
  if (!rc) {
    float *y = D(*out);
    const float *x = D(ac);
    int64_t N = fsdp_tensor_numel(ac);
    switch (op) {
    case FSDP_UNARY_RELU: fsdp_cpu_relu_forward(y, x, N); break;
    case FSDP_UNARY_GELU: fsdp_cpu_gelu_forward(y, x, N); break;
    case FSDP_UNARY_EXP:
      for (int64_t i = 0; i < N; i++) y[i] = expf(x[i]);
      break;
    case FSDP_UNARY_LOG:
      for (int64_t i = 0; i < N; i++) y[i] = logf(x[i]);
      break;
    case FSDP_UNARY_SQRT:
      for (int64_t i = 0; i < N; i++) y[i] = sqrtf(x[i]);
      break;
    case FSDP_UNARY_TANH:
      for (int64_t i = 0; i < N; i++) y[i] = tanhf(x[i]);
      break;
    case FSDP_UNARY_SIGMOID:
      for (int64_t i = 0; i < N; i++) y[i] = 1.0f / (1.0f + expf(-x[i]));
      break;
    }
    bool reads_out = op == FSDP_UNARY_EXP || op == FSDP_UNARY_SQRT || op == FSDP_UNARY_TANH ||
                     op == FSDP_UNARY_SIGMOID;
    rc = record(name, bw_unary, out, &a, 1, &ac, 1,
                &(const rec_args){.i = {op}, .reads_out = reads_out});
  }
  fsdp_tensor_release(ac);
  return rc;
}

static int bw_pow(fsdp_node *n) {
  float *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (!da) return FSDP_OK;
  const float *g = D(n->out->grad), *x = D(n->saved[0]);
  float p = n->f[0];
  int64_t N = fsdp_tensor_numel(n->out);
  for (int64_t i = 0; i < N; i++) da[i] += g[i] * p * powf(x[i], p - 1.0f);
  return FSDP_OK;
}

int fsdp_op_pow(fsdp_tensor **out, fsdp_tensor *a, float p) {
  fsdp_tensor *ac;
  if (contig(&ac, a, "pow")) return FSDP_ERR;
  int rc = new_out(out, a->ndim, a->shape, "pow");
  if (!rc) {
    float *y = D(*out);
    const float *x = D(ac);
    int64_t N = fsdp_tensor_numel(ac);
    for (int64_t i = 0; i < N; i++) y[i] = powf(x[i], p);
    rc = record("pow", bw_pow, out, &a, 1, &ac, 1, &(const rec_args){.f0 = p});
  }
  fsdp_tensor_release(ac);
  return rc;
}

/* ---- matmul, linear ------------------------------------------------------------------- */

/* i[0..3] = batch, M, K, N ; i[4] = 1 for a batched product, 0 for "a flattened to (M, K)
 * times a 2-D b" */
static int bw_matmul(fsdp_node *n) {
  float *da, *db;
  if (grad_of(n, 0, &da) || grad_of(n, 1, &db)) return FSDP_ERR;
  int B = (int)n->i[0], M = (int)n->i[1], K = (int)n->i[2], N = (int)n->i[3];
  if (B == 0 || M == 0 || K == 0 || N == 0) return FSDP_OK; /* an empty product: zero grads */
  const float *g = D(n->out->grad), *a = D(n->saved[0]), *b = D(n->saved[1]);
  if (!n->i[4]) {
    if (da) fsdp_cpu_gemm(da, g, b, M, K, N, false, true, 1.0f, 1.0f, N, N, K);
    if (db) fsdp_cpu_gemm(db, a, g, K, N, M, true, false, 1.0f, 1.0f, K, N, N);
  } else {
    fsdp_cpu_bmm_backward(da, db, g, a, b, B, M, K, N);
  }
  return FSDP_OK;
}

int fsdp_op_matmul(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b) {
  int64_t B = 1, M, K, N;
  int64_t oshape[FSDP_MAX_DIMS];
  int ond;
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
    for (int k = 0; k < a->ndim - 2; k++)
      if (a->shape[k] != b->shape[k]) goto bad;
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
  if (new_out(out, ond, oshape, "matmul")) goto done;
  if (fsdp_tensor_numel(*out) > 0 && K > 0) {
    if (b->ndim == 2)
      fsdp_cpu_gemm(D(*out), D(ac), D(bc), (int)M, (int)N, (int)K, false, false, 1.0f, 0.0f,
                    (int)K, (int)N, (int)N);
    else
      fsdp_cpu_bmm_forward(D(*out), D(ac), D(bc), (int)B, (int)M, (int)K, (int)N);
  } else {
    fsdp_tensor_fill(*out, 0.0f); /* an empty inner dimension sums nothing */
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

static int bw_linear(fsdp_node *n) {
  float *dx, *dw, *db;
  if (grad_of(n, 0, &dx) || grad_of(n, 1, &dw) || grad_of(n, 2, &db)) return FSDP_ERR;
  fsdp_cpu_linear_backward(dx, dw, db, D(n->out->grad), D(n->saved[0]), D(n->saved[1]),
                           (int)n->i[0], (int)n->i[1], (int)n->i[2]);
  return FSDP_OK;
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
  int64_t M = K ? fsdp_tensor_numel(x) / K : 0;
  int64_t oshape[FSDP_MAX_DIMS];
  memcpy(oshape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
  oshape[x->ndim - 1] = N;
  fsdp_tensor *xc = NULL, *wc = NULL, *bc = NULL;
  int rc = FSDP_ERR;
  if (contig(&xc, x, "linear") || contig(&wc, w, "linear") || (b && contig(&bc, b, "linear")))
    goto done;
  if (new_out(out, x->ndim, oshape, "linear")) goto done;
  fsdp_cpu_linear_forward(D(*out), D(xc), D(wc), bc ? D(bc) : NULL, (int)M, (int)K, (int)N);
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
  float *dw;
  if (grad_of(n, 1, &dw)) return FSDP_ERR;
  if (dw) fsdp_cpu_embedding_backward(dw, D(n->out->grad), D(n->saved[0]), n->i[0], (int)n->i[1]);
  return FSDP_OK;
}

int fsdp_op_embedding(fsdp_tensor **out, fsdp_tensor *ids, fsdp_tensor *w) {
  if (w->ndim != 2)
    return fsdp_error("embedding: weight must be 2-D (num, dim), got %s", FSDP_SHAPE_STR(w));
  if (ids->ndim + 1 > FSDP_MAX_DIMS)
    return fsdp_error("embedding: ids %s have too many dimensions", FSDP_SHAPE_STR(ids));
  int64_t V = w->shape[0], C = w->shape[1], N = fsdp_tensor_numel(ids);
  fsdp_tensor *ic = NULL, *wc = NULL;
  int rc = FSDP_ERR;
  if (contig(&ic, ids, "embedding") || contig(&wc, w, "embedding")) goto done;
  int64_t bad;
  if (!is_integral_in(D(ic), N, 0, V, NULL, &bad)) {
    fsdp_error("embedding: id %g at position %lld is not an integer in [0, %lld) (weight %s)",
               (double)D(ic)[bad], (long long)bad + 1, (long long)V, FSDP_SHAPE_STR(w));
    goto done;
  }
  int64_t oshape[FSDP_MAX_DIMS];
  memcpy(oshape, ids->shape, sizeof(int64_t) * (size_t)ids->ndim);
  oshape[ids->ndim] = C;
  if (new_out(out, ids->ndim + 1, oshape, "embedding")) goto done;
  fsdp_cpu_embedding_forward(D(*out), D(ic), D(wc), N, (int)C);
  fsdp_tensor *in[2] = {ids, w}, *sv[1] = {ic};
  rc = record("embedding", bw_embedding, out, in, 2, sv, 1, ARGS(N, C));
done:
  fsdp_tensor_release(ic);
  fsdp_tensor_release(wc);
  return rc;
}

/* ---- layernorm, softmax -------------------------------------------------------------------- */

static int bw_layernorm(fsdp_node *n) {
  float *dx, *dw, *db;
  if (grad_of(n, 0, &dx) || grad_of(n, 1, &dw) || grad_of(n, 2, &db)) return FSDP_ERR;
  fsdp_cpu_layernorm_backward(dx, dw, db, D(n->out->grad), D(n->saved[0]), D(n->saved[1]),
                              D(n->saved[2]), D(n->saved[3]), n->i[0], (int)n->i[1]);
  return FSDP_OK;
}

int fsdp_op_layernorm(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *w, fsdp_tensor *b,
                      float eps) {
  int64_t C = x->ndim ? x->shape[x->ndim - 1] : 0;
  if (w->ndim != 1 || w->shape[0] != C || (b && (b->ndim != 1 || b->shape[0] != C)))
    return fsdp_error("layernorm: input %s needs weight and bias of shape (%lld), got %s and %s",
                      FSDP_SHAPE_STR(x), (long long)C, FSDP_SHAPE_STR(w),
                      b ? FSDP_SHAPE_STR(b) : "none");
  int64_t N = C ? fsdp_tensor_numel(x) / C : 0;
  fsdp_tensor *xc = NULL, *wc = NULL, *bc = NULL, *mean = NULL, *rstd = NULL;
  int rc = FSDP_ERR;
  if (contig(&xc, x, "layernorm") || contig(&wc, w, "layernorm") ||
      (b && contig(&bc, b, "layernorm")))
    goto done;
  if (new_out(&mean, 1, &N, "layernorm") || new_out(&rstd, 1, &N, "layernorm")) goto done;
  if (new_out(out, x->ndim, x->shape, "layernorm")) goto done;
  fsdp_cpu_layernorm_forward(D(*out), D(mean), D(rstd), D(xc), D(wc), bc ? D(bc) : NULL, N,
                             (int)C, eps);
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

static int bw_softmax(fsdp_node *n) {
  float *dx;
  if (grad_of(n, 0, &dx)) return FSDP_ERR;
  if (dx) fsdp_cpu_softmax_backward(dx, D(n->out->grad), D(n->out), n->i[0], (int)n->i[1]);
  return FSDP_OK;
}

int fsdp_op_softmax(fsdp_tensor **out, fsdp_tensor *x) {
  if (x->ndim < 1) return fsdp_error("softmax: needs at least one dimension, got a scalar");
  int64_t C = x->shape[x->ndim - 1], N = C ? fsdp_tensor_numel(x) / C : 0;
  fsdp_tensor *xc;
  if (contig(&xc, x, "softmax")) return FSDP_ERR;
  int rc = new_out(out, x->ndim, x->shape, "softmax");
  if (!rc) {
    fsdp_cpu_softmax_forward(D(*out), D(xc), N, (int)C);
    rc = record("softmax", bw_softmax, out, &x, 1, NULL, 0,
                &(const rec_args){.i = {N, C}, .reads_out = true});
  }
  fsdp_tensor_release(xc);
  return rc;
}

/* ---- attention ---------------------------------------------------------------------------- */

static int bw_attention(fsdp_node *n) {
  float *dqkv;
  if (grad_of(n, 0, &dqkv)) return FSDP_ERR;
  if (!dqkv) return FSDP_OK;
  const fsdp_tensor *att = n->saved[1];
  fsdp_tensor *scratch;
  if (fsdp_tensor_new_f32(&scratch, att->ndim, att->shape)) return FSDP_ERR;
  fsdp_cpu_attention_backward(dqkv, D(scratch), D(n->out->grad), D(n->saved[0]),
                              D(n->saved[1]), (int)n->i[0], (int)n->i[1], (int)n->i[2],
                              (int)n->i[3]);
  fsdp_tensor_release(scratch);
  return FSDP_OK;
}

int fsdp_op_attention(fsdp_tensor **out, fsdp_tensor *qkv, int n_head) {
  if (qkv->ndim != 3 || qkv->shape[2] % 3 != 0)
    return fsdp_error("attention: qkv must be (B, T, 3C), got %s", FSDP_SHAPE_STR(qkv));
  int64_t B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3;
  if (n_head <= 0 || C % n_head != 0)
    return fsdp_error("attention: %lld channels do not split into %d heads (qkv %s)",
                      (long long)C, n_head, FSDP_SHAPE_STR(qkv));
  fsdp_tensor *qc = NULL, *att = NULL;
  int rc = FSDP_ERR;
  if (contig(&qc, qkv, "attention")) goto done;
  int64_t ashape[4] = {B, n_head, T, T}, oshape[3] = {B, T, C};
  if (new_out(&att, 4, ashape, "attention") || new_out(out, 3, oshape, "attention")) goto done;
  fsdp_cpu_attention_forward(D(*out), D(att), D(qc), (int)B, (int)T, (int)C, n_head);
  fsdp_tensor *sv[2] = {qc, att};
  rc = record("attention", bw_attention, out, &qkv, 1, sv, 2, ARGS(B, T, C, n_head));
done:
  fsdp_tensor_release(qc);
  fsdp_tensor_release(att);
  return rc;
}

/* ---- dropout ---------------------------------------------------------------------------------- */

static int bw_dropout(fsdp_node *n) {
  float *dx;
  if (grad_of(n, 0, &dx)) return FSDP_ERR;
  if (dx) fsdp_cpu_dropout_backward(dx, D(n->out->grad), D(n->saved[0]), fsdp_tensor_numel(n->out));
  return FSDP_OK;
}

int fsdp_op_dropout(fsdp_tensor **out, fsdp_tensor *x, float p) {
  if (!(p >= 0.0f && p < 1.0f))
    return fsdp_error("dropout: probability %g is not in [0, 1) (input %s)", (double)p,
                      FSDP_SHAPE_STR(x));
  fsdp_tensor *xc = NULL, *mask = NULL;
  int rc = FSDP_ERR;
  if (contig(&xc, x, "dropout")) goto done;
  int64_t N = fsdp_tensor_numel(xc);
  if (new_out(&mask, x->ndim, x->shape, "dropout") || new_out(out, x->ndim, x->shape, "dropout"))
    goto done;
  uint64_t first;
  uint64_t key = fsdp_rng_reserve("dropout", N, &first);
  fsdp_cpu_dropout_forward(D(*out), D(mask), D(xc), N, p, key, first);
  rc = record("dropout", bw_dropout, out, &x, 1, &mask, 1, NULL);
done:
  fsdp_tensor_release(xc);
  fsdp_tensor_release(mask);
  return rc;
}

/* ---- losses, reductions -------------------------------------------------------------------- */

static int bw_cross_entropy(fsdp_node *n) {
  float *dl;
  if (grad_of(n, 0, &dl)) return FSDP_ERR;
  if (dl)
    fsdp_cpu_cross_entropy_backward(dl, D(n->out->grad)[0], D(n->saved[0]), D(n->saved[2]),
                                    D(n->saved[1]), n->i[0], (int)n->i[1], (int)n->i[2], n->i[3]);
  return FSDP_OK;
}

int fsdp_op_cross_entropy(fsdp_tensor **out, fsdp_tensor *logits, fsdp_tensor *targets,
                          int ignore_index) {
  if (logits->ndim < 1)
    return fsdp_error("cross_entropy: logits must have a class dimension, got a scalar");
  int64_t V = logits->shape[logits->ndim - 1], N = V ? fsdp_tensor_numel(logits) / V : 0;
  bool shape_ok = targets->ndim == logits->ndim - 1;
  for (int k = 0; shape_ok && k < targets->ndim; k++)
    shape_ok = targets->shape[k] == logits->shape[k];
  if (!shape_ok && !(targets->ndim == 1 && targets->shape[0] == N))
    return fsdp_error("cross_entropy: targets %s do not match logits %s (targets need the "
                      "logits' shape without its last dimension)",
                      FSDP_SHAPE_STR(targets), FSDP_SHAPE_STR(logits));
  fsdp_tensor *lc = NULL, *tc = NULL, *lse = NULL;
  int rc = FSDP_ERR;
  if (contig(&lc, logits, "cross_entropy") || contig(&tc, targets, "cross_entropy")) goto done;
  int64_t bad;
  if (!is_integral_in(D(tc), N, 0, V, &ignore_index, &bad)) {
    fsdp_error("cross_entropy: target %g at position %lld is not a class in [0, %lld) nor the "
               "ignore index %d (logits %s, targets %s)",
               (double)D(tc)[bad], (long long)bad + 1, (long long)V, ignore_index,
               FSDP_SHAPE_STR(logits), FSDP_SHAPE_STR(targets));
    goto done;
  }
  if (new_out(&lse, 1, &N, "cross_entropy") || new_out(out, 0, NULL, "cross_entropy")) goto done;
  int64_t count;
  D(*out)[0] = fsdp_cpu_cross_entropy_forward(D(lse), D(lc), D(tc), N, (int)V, ignore_index, &count);
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
  float *da, *db;
  if (grad_of(n, 0, &da) || grad_of(n, 1, &db)) return FSDP_ERR;
  fsdp_cpu_mse_backward(da, db, D(n->out->grad)[0], D(n->saved[0]), D(n->saved[1]),
                        fsdp_tensor_numel(n->saved[0]));
  return FSDP_OK;
}

int fsdp_op_mse(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b) {
  if (!fsdp_tensor_same_shape(a, b))
    return fsdp_error("mse: shapes %s and %s differ", FSDP_SHAPE_STR(a), FSDP_SHAPE_STR(b));
  fsdp_tensor *ac = NULL, *bc = NULL;
  int rc = FSDP_ERR;
  if (contig(&ac, a, "mse") || contig(&bc, b, "mse")) goto done;
  if (new_out(out, 0, NULL, "mse")) goto done;
  int64_t N = fsdp_tensor_numel(ac);
  D(*out)[0] = N ? fsdp_cpu_mse_forward(D(ac), D(bc), N) : 0.0f;
  fsdp_tensor *in[2] = {a, b}, *sv[2] = {ac, bc};
  rc = record("mse", bw_mse, out, in, 2, sv, 2, NULL);
done:
  fsdp_tensor_release(ac);
  fsdp_tensor_release(bc);
  return rc;
}

static int bw_sum(fsdp_node *n) {
  float *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (!da) return FSDP_OK;
  float g = D(n->out->grad)[0] * n->f[0];
  int64_t N = n->i[0];
  for (int64_t i = 0; i < N; i++) da[i] += g;
  return FSDP_OK;
}

static int sum_all(fsdp_tensor **out, fsdp_tensor *a, bool mean) {
  const char *name = mean ? "mean" : "sum";
  fsdp_tensor *ac;
  if (contig(&ac, a, name)) return FSDP_ERR;
  int64_t N = fsdp_tensor_numel(ac);
  int rc = new_out(out, 0, NULL, name);
  if (!rc) {
    double s = fsdp_cpu_sum(D(ac), N);
    D(*out)[0] = (float)(mean ? (N ? s / (double)N : NAN) : s);
    rc = record(name, bw_sum, out, &a, 1, NULL, 0,
                &(const rec_args){.i = {N}, .f0 = mean ? 1.0f / (float)N : 1.0f});
  }
  fsdp_tensor_release(ac);
  return rc;
}

int fsdp_op_sum(fsdp_tensor **out, fsdp_tensor *a) { return sum_all(out, a, false); }
int fsdp_op_mean(fsdp_tensor **out, fsdp_tensor *a) { return sum_all(out, a, true); }

static int bw_sum_dim(fsdp_node *n) {
  float *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (!da) return FSDP_OK;
  int64_t outer = n->i[0], R = n->i[1], inner = n->i[2];
  const float *g = D(n->out->grad);
  float s = n->f[0];
  for (int64_t o = 0; o < outer; o++)
    for (int64_t r = 0; r < R; r++) {
      float *d = da + (o * R + r) * inner;
      const float *gg = g + o * inner;
      for (int64_t j = 0; j < inner; j++) d[j] += s * gg[j];
    }
  return FSDP_OK;
}

int fsdp_op_sum_dim(fsdp_tensor **out, fsdp_tensor *a, int dim, bool mean) {
  const char *name = mean ? "mean" : "sum";
  if (dim < 0 || dim >= a->ndim)
    return fsdp_error("%s: dimension %d out of range for a tensor %s", name, dim + 1,
                      FSDP_SHAPE_STR(a));
  int64_t outer = prod(a->shape, dim), R = a->shape[dim],
          inner = prod(a->shape + dim + 1, a->ndim - dim - 1);
  int64_t oshape[FSDP_MAX_DIMS];
  int ond = 0;
  for (int k = 0; k < a->ndim; k++)
    if (k != dim) oshape[ond++] = a->shape[k];
  fsdp_tensor *ac;
  if (contig(&ac, a, name)) return FSDP_ERR;
  int rc = new_out(out, ond, oshape, name);
  if (!rc) {
    fsdp_cpu_sum_dim_forward(D(*out), D(ac), outer, R, inner);
    float s = mean ? (R ? 1.0f / (float)R : NAN) : 1.0f;
    if (mean) {
      float *o = D(*out);
      for (int64_t i = 0; i < outer * inner; i++) o[i] *= s;
    }
    rc = record(name, bw_sum_dim, out, &a, 1, NULL, 0,
                &(const rec_args){.i = {outer, R, inner}, .f0 = s});
  }
  fsdp_tensor_release(ac);
  return rc;
}

/* ---- views ------------------------------------------------------------------------------- */

/* view/contiguous: the flat logical order is unchanged, gradients add elementwise. When the
 * input is a non-leaf without a gradient yet, it takes the output's gradient buffer as its
 * own (a view of it: gradient buffers are contiguous in logical order, so the bytes are the
 * same): no zero-fill and no pass over what can be a (B*T, V) logits gradient. The output's
 * gradient is dropped right after this node, so nothing else writes through the alias. Leaf
 * gradients (parameters) keep their own storage, accounted as grads. */
static int bw_flat(fsdp_node *n) {
  fsdp_tensor *in = n->in[0];
  if (!in->requires_grad) return FSDP_OK;
  if (!in->grad && !in->is_leaf && fsdp_tensor_is_contiguous(n->out->grad)) {
    fsdp_tensor *g;
    if (fsdp_tensor_view(&g, n->out->grad, in->ndim, in->shape)) return FSDP_ERR;
    in->grad = g; /* the new reference moves into in */
    return FSDP_OK;
  }
  float *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  const float *g = D(n->out->grad);
  int64_t N = fsdp_tensor_numel(n->out);
  for (int64_t i = 0; i < N; i++) da[i] += g[i];
  return FSDP_OK;
}

/* A contiguous copy of a, not recorded: accounted as an activation; a meta tensor gives a
 * meta copy (views and copies are shape-only operations). */
static int copy_contiguous(fsdp_tensor **out, fsdp_tensor *a) {
  if (fsdp_tensor_new(out, a->storage->device, a->dtype, a->ndim, a->shape,
                      FSDP_ROLE_ACTIVATIONS))
    return FSDP_ERR;
  if (fsdp_tensor_copy(*out, a)) {
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
  float *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (!da) return FSDP_OK;
  const fsdp_tensor *o = n->out;
  int64_t ds[FSDP_MAX_DIMS], ss[FSDP_MAX_DIMS];
  contiguous_strides(ds, n->in[0]->ndim, n->in[0]->shape);
  int64_t t = ds[n->i[0]];
  ds[n->i[0]] = ds[n->i[1]];
  ds[n->i[1]] = t;
  contiguous_strides(ss, o->ndim, o->shape);
  strided_add(da, ds, D(o->grad), ss, o->ndim, o->shape);
  return FSDP_OK;
}

int fsdp_op_transpose(fsdp_tensor **out, fsdp_tensor *a, int d0, int d1) {
  if (fsdp_tensor_transpose(out, a, d0, d1)) return FSDP_ERR; /* "transpose: ..." */
  return record("transpose", bw_transpose, out, &a, 1, NULL, 0, ARGS(d0, d1));
}

/* i[0] dim, i[1] start */
static int bw_narrow(fsdp_node *n) {
  float *da;
  if (grad_of(n, 0, &da)) return FSDP_ERR;
  if (!da) return FSDP_OK;
  const fsdp_tensor *o = n->out;
  int64_t ds[FSDP_MAX_DIMS], ss[FSDP_MAX_DIMS];
  contiguous_strides(ds, n->in[0]->ndim, n->in[0]->shape);
  contiguous_strides(ss, o->ndim, o->shape);
  strided_add(da + n->i[1] * ds[n->i[0]], ds, D(o->grad), ss, o->ndim, o->shape);
  return FSDP_OK;
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
