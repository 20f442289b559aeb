/*
 * tensor.c — tensors as refcounted views (offset, shape, strides) over refcounted storage;
 * the view operations, and the strided copy and fill everything else builds on.
 *
 * Ownership: a tensor holds one reference to its storage and one to its grad (if any); the
 * last tensor release drops both. Views share storage and never copy; `contiguous` and
 * `clone` are the only functions here that allocate data. A tensor's geometry is validated
 * when it is made (fsdp_tensor_new_view checks it stays inside its storage), so data loops
 * below trust it.
 *
 * Copy and fill run over millions of elements while models initialise: they merge dims that
 * are contiguous in memory into one (coalescing) and run a plain inner loop (memcpy when
 * both sides are dense), with no per-element calls.
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

/* ---- shape strings -------------------------------------------------------------- */

char *fsdp_shape_str(char *buf, size_t n, int ndim, const int64_t *shape) {
  if (!n) return buf;
  size_t len = 0;
  buf[0] = '\0';
#define PUT(...) \
  if (len < n) len += (size_t)snprintf(buf + len, n - len, __VA_ARGS__)
  PUT("(");
  for (int i = 0; i < ndim && shape; i++) PUT("%s%lld", i ? ", " : "", (long long)shape[i]);
  PUT(")");
#undef PUT
  return buf;
}

static char *strides_str(char *buf, size_t n, const fsdp_tensor *t) {
  return fsdp_shape_str(buf, n, t->ndim, t->strides);
}

/* ---- construction -------------------------------------------------------------------------- */

/* Validate a shape for an op; *numel gets the element count. */
static int check_shape(const char *what, int ndim, const int64_t *shape, size_t esize,
                       int64_t *numel) {
  if (ndim < 0 || ndim > FSDP_MAX_DIMS)
    return fsdp_error("%s: %d dimensions requested, at most %d are supported", what, ndim,
                      FSDP_MAX_DIMS);
  if (ndim > 0 && !shape) return fsdp_error("%s: no shape given for %d dimensions", what, ndim);
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0)
      return fsdp_error("%s: size %lld at dim %d of shape %s is negative", what,
                        (long long)shape[i], i, fsdp_shape_str((char[96]){0}, 96, ndim, shape));
    if (__builtin_mul_overflow(n, shape[i], &n) || n > INT64_MAX / (int64_t)esize)
      return fsdp_error("%s: shape %s has too many elements", what,
                        fsdp_shape_str((char[96]){0}, 96, ndim, shape));
  }
  *numel = n;
  return FSDP_OK;
}

static void contiguous_strides(int64_t *strides, int ndim, const int64_t *shape) {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    strides[i] = s;
    s *= shape[i] ? shape[i] : 1;
  }
}

/* A new tensor over s (retained). */
static int tensor_make(fsdp_tensor **out, fsdp_storage *s, int64_t offset, int ndim,
                       const int64_t *shape, const int64_t *strides, fsdp_dtype dt) {
  fsdp_tensor *t = calloc(1, sizeof *t);
  if (!t) return fsdp_error("tensor: out of host memory for the tensor header");
  t->refcount = 1;
  fsdp_storage_retain(s);
  t->storage = s;
  t->offset = offset;
  t->ndim = ndim;
  if (ndim) {
    memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
    memcpy(t->strides, strides, (size_t)ndim * sizeof *strides);
  }
  t->dtype = dt;
  t->is_leaf = true;
  *out = t;
  return FSDP_OK;
}

static int tensor_new(fsdp_tensor **out, const fsdp_device_i *dev, fsdp_dtype dt, int ndim,
                      const int64_t *shape, fsdp_role role, bool zero) {
  *out = NULL;
  if (!dev) return fsdp_error("new tensor: no device given");
  size_t esize = fsdp_dtype_size(dt);
  if (!esize) return fsdp_error("new tensor: unknown dtype %d", (int)dt);
  int64_t numel = 0;
  if (check_shape("new tensor", ndim, shape, esize, &numel) != FSDP_OK) return FSDP_ERR;
  fsdp_storage *s;
  if ((zero ? fsdp_storage_new : fsdp_storage_new_uninit)(&s, dev, (size_t)numel * esize, role) !=
      FSDP_OK)
    return FSDP_ERR;
  int64_t strides[FSDP_MAX_DIMS];
  contiguous_strides(strides, ndim, shape);
  int rc = tensor_make(out, s, 0, ndim, shape, strides, dt);
  fsdp_storage_release(s); /* the tensor holds it now (or nobody does) */
  return rc;
}

int fsdp_tensor_new(fsdp_tensor **out, const fsdp_device_i *dev, fsdp_dtype dt, int ndim,
                    const int64_t *shape, fsdp_role role) {
  return tensor_new(out, dev, dt, ndim, shape, role, true);
}

int fsdp_tensor_new_f32_uninit(fsdp_tensor **out, int ndim, const int64_t *shape) {
  return tensor_new(out, &fsdp_device_cpu, FSDP_DTYPE_F32, ndim, shape, FSDP_ROLE_ACTIVATIONS,
                    false);
}

int fsdp_tensor_new_f32(fsdp_tensor **out, int ndim, const int64_t *shape) {
  return fsdp_tensor_new(out, &fsdp_device_cpu, FSDP_DTYPE_F32, ndim, shape,
                         FSDP_ROLE_ACTIVATIONS);
}

int fsdp_tensor_new_view(fsdp_tensor **out, fsdp_tensor *t, int64_t offset, int ndim,
                         const int64_t *shape, const int64_t *strides) {
  *out = NULL;
  size_t esize = fsdp_dtype_size(t->dtype);
  int64_t numel = 0;
  if (check_shape("view", ndim, shape, esize, &numel) != FSDP_OK) return FSDP_ERR;
  if (ndim > 0 && !strides) return fsdp_error("view: no strides given");
  int64_t cap = (int64_t)(t->storage->bytes / esize);
  if (offset < 0) return fsdp_error("view: negative offset %lld", (long long)offset);
  if (numel > 0) { /* the lowest and highest element the view reaches must be in storage */
    int64_t lo = offset, hi = offset;
    bool overflow = false;
    for (int i = 0; i < ndim; i++) {
      int64_t ext;
      overflow |= __builtin_mul_overflow(shape[i] - 1, strides[i], &ext);
      overflow |= ext >= 0 ? __builtin_add_overflow(hi, ext, &hi)
                           : __builtin_add_overflow(lo, ext, &lo);
    }
    if (overflow || lo < 0 || hi >= cap)
      return fsdp_error("view: offset %lld, shape %s, strides %s reach elements [%lld, %lld] "
                        "outside the storage's %lld elements",
                        (long long)offset, fsdp_shape_str((char[96]){0}, 96, ndim, shape),
                        fsdp_shape_str((char[96]){0}, 96, ndim, strides), (long long)lo,
                        (long long)hi, (long long)cap);
  }
  return tensor_make(out, t->storage, offset, ndim, shape, strides, t->dtype);
}

void fsdp_tensor_retain(fsdp_tensor *t) {
  if (t) __atomic_fetch_add(&t->refcount, 1, __ATOMIC_RELAXED);
}

void fsdp_tensor_release(fsdp_tensor *t) {
  if (!t) return;
  int old = __atomic_fetch_sub(&t->refcount, 1, __ATOMIC_ACQ_REL);
  assert(old > 0 && "tensor released more often than retained");
  if (old != 1) return;
  fsdp_tensor_release(t->grad);
  fsdp_storage_release(t->storage);
  free(t->label);
  free(t);
}

int fsdp_tensor_set_label(fsdp_tensor *t, const char *label) {
  char *copy = NULL;
  if (label && !(copy = strdup(label))) return fsdp_error("label: out of memory");
  free(t->label);
  t->label = copy;
  return FSDP_OK;
}

/* ---- queries -------------------------------------------------------------------------------- */

int64_t fsdp_tensor_numel(const fsdp_tensor *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
  return n;
}

bool fsdp_tensor_is_contiguous(const fsdp_tensor *t) {
  if (fsdp_tensor_numel(t) == 0) return true;
  int64_t expected = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] == 1) continue; /* any stride is fine for a size-1 dim */
    if (t->strides[i] != expected) return false;
    expected *= t->shape[i];
  }
  return true;
}

bool fsdp_tensor_same_shape(const fsdp_tensor *a, const fsdp_tensor *b) {
  if (a->ndim != b->ndim) return false;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

float *fsdp_tensor_data(const fsdp_tensor *t, const char *what) {
  if (!what) what = "tensor";
  if (!t) {
    fsdp_error("%s: no tensor", what);
    return NULL;
  }
  const fsdp_storage *s = t->storage;
  if (!s->device->has_data) {
    if (s->device->no_data)
      fsdp_error("%s: %s %s %s", what, t->is_param ? "parameter" : "tensor",
                 t->label ? t->label : FSDP_SHAPE_STR(t), s->device->no_data);
    else
      fsdp_error("%s: tensor %s on %s device has no data", what, FSDP_SHAPE_STR(t),
                 s->device->name);
    return NULL;
  }
  return (float *)s->data + t->offset;
}

/* ---- views ----------------------------------------------------------------------------------- */

int fsdp_tensor_view(fsdp_tensor **out, fsdp_tensor *t, int ndim, const int64_t *shape) {
  *out = NULL;
  if (ndim < 0 || ndim > FSDP_MAX_DIMS)
    return fsdp_error("view: %d dimensions requested, at most %d are supported", ndim,
                      FSDP_MAX_DIMS);
  int64_t numel = fsdp_tensor_numel(t);
  char want[96], have[96];
  if (ndim > 0 && !shape) return fsdp_error("view: no shape given for %d dimensions", ndim);
  fsdp_shape_str(want, sizeof want, ndim, shape);
  fsdp_shape_str(have, sizeof have, t->ndim, t->shape);
  if (!fsdp_tensor_is_contiguous(t))
    return fsdp_error("view: tensor of shape %s (strides %s) is not contiguous; make a "
                      "contiguous copy first to view it as %s",
                      have, strides_str((char[96]){0}, 96, t), want);
  int64_t resolved[FSDP_MAX_DIMS];
  int infer = -1;
  int64_t known = 1;
  for (int i = 0; i < ndim; i++) {
    resolved[i] = shape[i];
    if (shape[i] == -1) {
      if (infer >= 0)
        return fsdp_error("view: shape %s has more than one -1 (tensor of shape %s)", want,
                          have);
      infer = i;
    } else if (shape[i] < 0) {
      return fsdp_error("view: shape %s has a negative size at dim %d (tensor of shape %s)",
                        want, i, have);
    } else if (__builtin_mul_overflow(known, shape[i], &known)) {
      return fsdp_error("view: shape %s has too many elements", want);
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel % known != 0)
      return fsdp_error("view: shape %s is invalid for a tensor of shape %s (%lld elements)",
                        want, have, (long long)numel);
    resolved[infer] = numel / known;
  } else if (known != numel) {
    return fsdp_error("view: shape %s is invalid for a tensor of shape %s (%lld elements)",
                      want, have, (long long)numel);
  }
  int64_t strides[FSDP_MAX_DIMS];
  contiguous_strides(strides, ndim, resolved);
  return fsdp_tensor_new_view(out, t, t->offset, ndim, resolved, strides);
}

int fsdp_tensor_transpose(fsdp_tensor **out, fsdp_tensor *t, int d0, int d1) {
  *out = NULL;
  if (d0 < 0 || d0 >= t->ndim || d1 < 0 || d1 >= t->ndim)
    return fsdp_error("transpose: dims %d and %d: out of range for a tensor of shape %s "
                      "(%d dims, numbered from 0)",
                      d0, d1, FSDP_SHAPE_STR(t), t->ndim);
  int64_t shape[FSDP_MAX_DIMS], strides[FSDP_MAX_DIMS];
  memcpy(shape, t->shape, sizeof shape);
  memcpy(strides, t->strides, sizeof strides);
  shape[d0] = t->shape[d1], shape[d1] = t->shape[d0];
  strides[d0] = t->strides[d1], strides[d1] = t->strides[d0];
  return fsdp_tensor_new_view(out, t, t->offset, t->ndim, shape, strides);
}

int fsdp_tensor_narrow(fsdp_tensor **out, fsdp_tensor *t, int dim, int64_t start, int64_t len) {
  *out = NULL;
  if (dim < 0 || dim >= t->ndim)
    return fsdp_error("narrow: dim %d out of range for a tensor of shape %s (%d dims, "
                      "numbered from 0)",
                      dim, FSDP_SHAPE_STR(t), t->ndim);
  int64_t size = t->shape[dim];
  if (start < 0 || len < 0 || start > size || len > size - start)
    return fsdp_error("narrow: dim %d, start %lld, length %lld is out of range for size %lld "
                      "(tensor of shape %s)",
                      dim, (long long)start, (long long)len, (long long)size,
                      FSDP_SHAPE_STR(t));
  int64_t shape[FSDP_MAX_DIMS];
  memcpy(shape, t->shape, sizeof shape);
  shape[dim] = len;
  return fsdp_tensor_new_view(out, t, t->offset + start * t->strides[dim], t->ndim, shape,
                              t->strides);
}

/* ---- strided loops ---------------------------------------------------------------------------- */

/* The iteration space of one or two same-shaped tensors after dropping size-1 dims and merging
 * each dim into its outer neighbour when both tensors are contiguous across the pair. */
typedef struct {
  int n;
  int64_t size[FSDP_MAX_DIMS];
  int64_t sa[FSDP_MAX_DIMS], sb[FSDP_MAX_DIMS]; /* strides of tensor a and b */
} fsdp_loop;

static void loop_init(fsdp_loop *L, int ndim, const int64_t *shape, const int64_t *sa,
                      const int64_t *sb) {
  int n = 0;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] == 1) continue;
    if (n > 0 && L->sa[n - 1] == sa[i] * shape[i] && L->sb[n - 1] == sb[i] * shape[i]) {
      L->size[n - 1] *= shape[i];
      L->sa[n - 1] = sa[i], L->sb[n - 1] = sb[i];
    } else {
      L->size[n] = shape[i], L->sa[n] = sa[i], L->sb[n] = sb[i];
      n++;
    }
  }
  if (n == 0) { /* a scalar or all size-1 dims: one element */
    L->size[0] = 1, L->sa[0] = 1, L->sb[0] = 1;
    n = 1;
  }
  L->n = n;
}

/* Two innermost dims where one side is strided along the innermost one (a transpose): walk
 * them in TILE x TILE tiles, so the strided side's cache lines are reused within a tile
 * instead of each being fetched once per element. */
#define TILE 32
static void copy_tiles(float *d, const float *s, int64_t rows, int64_t cols, int64_t dr,
                       int64_t dc, int64_t sr, int64_t sc) {
  for (int64_t i0 = 0; i0 < rows; i0 += TILE)
    for (int64_t j0 = 0; j0 < cols; j0 += TILE) {
      const int64_t i1 = i0 + TILE < rows ? i0 + TILE : rows;
      const int64_t j1 = j0 + TILE < cols ? j0 + TILE : cols;
      for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1; j++) d[i * dr + j * dc] = s[i * sr + j * sc];
    }
}

/* dst (geometry a) <- src (geometry b); numel > 0 */
static void copy_loop(float *dst, const float *src, const fsdp_loop *L) {
  const int in = L->n - 1;
  const int64_t m = L->size[in], da = L->sa[in], sb = L->sb[in];
  const bool tiled = L->n >= 2 && (da != 1 || sb != 1);
  const int nouter = tiled ? in - 1 : in; /* dims walked by the odometer */
  int64_t outer = 1;
  for (int k = 0; k < nouter; k++) outer *= L->size[k];
  int64_t idx[FSDP_MAX_DIMS] = {0}, od = 0, os = 0;
  for (int64_t o = 0; o < outer; o++) {
    float *d = dst + od;
    const float *s = src + os;
    if (tiled)
      copy_tiles(d, s, L->size[in - 1], m, L->sa[in - 1], da, L->sb[in - 1], sb);
    else if (da == 1 && sb == 1)
      memcpy(d, s, (size_t)m * sizeof *d);
    else /* a single strided dim */
      for (int64_t j = 0; j < m; j++) d[j * da] = s[j * sb];
    for (int k = nouter - 1; k >= 0; k--) { /* odometer over the outer dims */
      od += L->sa[k], os += L->sb[k];
      if (++idx[k] < L->size[k]) break;
      od -= L->sa[k] * L->size[k], os -= L->sb[k] * L->size[k];
      idx[k] = 0;
    }
  }
}

static void fill_loop(float *dst, float v, const fsdp_loop *L) {
  const int in = L->n - 1;
  const int64_t m = L->size[in], da = L->sa[in];
  int64_t outer = 1;
  for (int k = 0; k < in; k++) outer *= L->size[k];
  int64_t idx[FSDP_MAX_DIMS] = {0}, od = 0;
  for (int64_t o = 0; o < outer; o++) {
    float *d = dst + od;
    if (da == 1)
      for (int64_t j = 0; j < m; j++) d[j] = v;
    else
      for (int64_t j = 0; j < m; j++) d[j * da] = v;
    for (int k = in - 1; k >= 0; k--) {
      od += L->sa[k];
      if (++idx[k] < L->size[k]) break;
      od -= L->sa[k] * L->size[k];
      idx[k] = 0;
    }
  }
}

/* [lo, hi] element range a non-empty tensor touches in its storage */
static void extent(const fsdp_tensor *t, int64_t *lo, int64_t *hi) {
  *lo = *hi = t->offset;
  for (int i = 0; i < t->ndim; i++) {
    int64_t ext = (t->shape[i] - 1) * t->strides[i];
    if (ext >= 0) *hi += ext;
    else *lo += ext;
  }
}

static bool same_geometry(const fsdp_tensor *a, const fsdp_tensor *b) {
  if (a->offset != b->offset || !fsdp_tensor_same_shape(a, b)) return false;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != 1 && a->strides[i] != b->strides[i]) return false;
  return true;
}

/* ---- copies ----------------------------------------------------------------------------------- */

int fsdp_tensor_copy(fsdp_tensor *dst, const fsdp_tensor *src) {
  if (!fsdp_tensor_same_shape(dst, src))
    return fsdp_error("copy: shape mismatch: destination %s, source %s", FSDP_SHAPE_STR(dst),
                      FSDP_SHAPE_STR(src));
  if (dst->dtype != src->dtype)
    return fsdp_error("copy: dtype mismatch: destination %s, source %s",
                      fsdp_dtype_name(dst->dtype), fsdp_dtype_name(src->dtype));
  const fsdp_device_i *ddev = dst->storage->device, *sdev = src->storage->device;
  if (ddev->has_data && !sdev->has_data) {
    fsdp_tensor_data(src, "copy: source"); /* names the tensor and why it has no data */
    return FSDP_ERR;
  }
  /* A destination whose data lives elsewhere (a sharded parameter) must not swallow writes:
   * that is how pruning through stale references silently did nothing (seeds/004). */
  if (ddev->no_data) {
    fsdp_tensor_data(dst, "copy");
    return FSDP_ERR;
  }
  if (ddev->has_data && ddev != sdev)
    return fsdp_error("copy: from a %s tensor to a %s tensor is not supported", sdev->name,
                      ddev->name);
  dst->version++;
  if (!ddev->has_data) return FSDP_OK; /* shape only: nothing to write */
  int64_t numel = fsdp_tensor_numel(dst);
  if (numel == 0) return FSDP_OK;
  float *d = (float *)dst->storage->data + dst->offset;
  const float *s = (const float *)src->storage->data + src->offset;

  if (dst->storage->data == src->storage->data) { /* views of one buffer: may overlap */
    if (same_geometry(dst, src)) return FSDP_OK;
    int64_t dlo, dhi, slo, shi;
    extent(dst, &dlo, &dhi);
    extent(src, &slo, &shi);
    if (dlo <= shi && slo <= dhi) { /* read everything before writing anything */
      fsdp_tensor *tmp;
      if (fsdp_tensor_clone(&tmp, (fsdp_tensor *)src) != FSDP_OK)
        return fsdp_error_context("copy");
      uint64_t v = dst->version;
      int rc = fsdp_tensor_copy(dst, tmp);
      dst->version = v;
      fsdp_tensor_release(tmp);
      return rc;
    }
  }
  /* Both dense: one device copy (the device's own routine, so this path stays right for
   * devices whose memory the host cannot touch). The strided loop reads host memory. */
  if (ddev->copy && fsdp_tensor_is_contiguous(dst) && fsdp_tensor_is_contiguous(src))
    return ddev->copy(d, s, (size_t)numel * fsdp_dtype_size(dst->dtype));
  fsdp_loop L;
  loop_init(&L, dst->ndim, dst->shape, dst->strides, src->strides);
  copy_loop(d, s, &L);
  return FSDP_OK;
}

int fsdp_tensor_fill(fsdp_tensor *t, float v) {
  if (t->storage->device->no_data) { /* sharded: writes must not vanish (see copy) */
    fsdp_tensor_data(t, "fill");
    return FSDP_ERR;
  }
  t->version++;
  if (!t->storage->device->has_data || fsdp_tensor_numel(t) == 0) return FSDP_OK;
  fsdp_loop L;
  loop_init(&L, t->ndim, t->shape, t->strides, t->strides);
  fill_loop((float *)t->storage->data + t->offset, v, &L);
  return FSDP_OK;
}

int fsdp_tensor_clone(fsdp_tensor **out, fsdp_tensor *t) {
  *out = NULL;
  fsdp_tensor *c;
  /* uninitialised: the copy below writes every element */
  if (tensor_new(&c, t->storage->device, t->dtype, t->ndim, t->shape, t->storage->role, false) !=
      FSDP_OK)
    return FSDP_ERR;
  if (fsdp_tensor_copy(c, t) != FSDP_OK) {
    fsdp_tensor_release(c);
    return FSDP_ERR;
  }
  c->version = 0;
  *out = c;
  return FSDP_OK;
}

int fsdp_tensor_contiguous(fsdp_tensor **out, fsdp_tensor *t) {
  if (fsdp_tensor_is_contiguous(t)) {
    fsdp_tensor_retain(t);
    *out = t;
    return FSDP_OK;
  }
  return fsdp_tensor_clone(out, t);
}

/* ---- mutation --------------------------------------------------------------------------------- */

void fsdp_tensor_set_storage(fsdp_tensor *t, fsdp_storage *s, int64_t offset) {
  assert(s && "a tensor's storage is never NULL");
  fsdp_storage_retain(s); /* before releasing the old one: s may be the same storage */
  fsdp_storage_release(t->storage);
  t->storage = s;
  t->offset = offset;
}

void fsdp_tensor_set_grad(fsdp_tensor *t, fsdp_tensor *g) {
  fsdp_tensor_retain(g);
  fsdp_tensor_release(t->grad);
  t->grad = g;
}
