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

void fsdp_contiguous_strides(int64_t *strides, int ndim, const int64_t *shape) {
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
  fsdp_contiguous_strides(strides, ndim, shape);
  int rc = tensor_make(out, s, 0, ndim, shape, strides, dt);
  fsdp_storage_release(s); /* the tensor holds it now (or nobody does) */
  return rc;
}

int fsdp_tensor_new(fsdp_tensor **out, const fsdp_device_i *dev, fsdp_dtype dt, int ndim,
                    const int64_t *shape, fsdp_role role) {
  return tensor_new(out, dev, dt, ndim, shape, role, true);
}

int fsdp_tensor_new_uninit(fsdp_tensor **out, const fsdp_device_i *dev, fsdp_dtype dt, int ndim,
                           const int64_t *shape, fsdp_role role) {
  return tensor_new(out, dev, dt, ndim, shape, role, false);
}

int fsdp_tensor_new_f32_uninit(fsdp_tensor **out, int ndim, const int64_t *shape) {
  return tensor_new(out, &fsdp_device_cpu, FSDP_DTYPE_F32, ndim, shape, FSDP_ROLE_ACTIVATIONS,
                    false);
}

int fsdp_tensor_new_f32(fsdp_tensor **out, int ndim, const int64_t *shape) {
  return fsdp_tensor_new(out, &fsdp_device_cpu, FSDP_DTYPE_F32, ndim, shape,
                         FSDP_ROLE_ACTIVATIONS);
}

int fsdp_tensor_wrap(fsdp_tensor **out, void *data, fsdp_dtype dt, int ndim,
                     const int64_t *shape) {
  *out = NULL;
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= shape[d];
  fsdp_storage *s;
  if (fsdp_storage_wrap(&s, data, (size_t)n * fsdp_dtype_size(dt))) return FSDP_ERR;
  /* a shape-only tensor of that geometry, then the wrapped storage under it */
  fsdp_tensor *t;
  if (fsdp_tensor_new(&t, &fsdp_device_meta, dt, ndim, shape, FSDP_ROLE_OTHER)) {
    fsdp_storage_release(s);
    return FSDP_ERR;
  }
  fsdp_tensor_set_storage(t, s, 0); /* t retains s */
  fsdp_storage_release(s);
  *out = t;
  return FSDP_OK;
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

void *fsdp_tensor_data(const fsdp_tensor *t, const char *what) {
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
  return (char *)s->data + (size_t)t->offset * fsdp_dtype_size(t->dtype);
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
  fsdp_contiguous_strides(strides, ndim, resolved);
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
 * instead of each being fetched once per element. Elements are moved as 1, 2, 4 or 8 byte
 * words: a copy never converts, so only the width matters. */
#define TILE 32
#define COPY_TILES(T)                                                                      \
  for (int64_t i0 = 0; i0 < rows; i0 += TILE)                                             \
    for (int64_t j0 = 0; j0 < cols; j0 += TILE) {                                         \
      const int64_t i1 = i0 + TILE < rows ? i0 + TILE : rows;                              \
      const int64_t j1 = j0 + TILE < cols ? j0 + TILE : cols;                              \
      for (int64_t i = i0; i < i1; i++)                                                    \
        for (int64_t j = j0; j < j1; j++)                                                  \
          ((T *)d)[i * dr + j * dc] = ((const T *)s)[i * sr + j * sc];                     \
    }
static void copy_tiles(void *d, const void *s, size_t esize, int64_t rows, int64_t cols,
                       int64_t dr, int64_t dc, int64_t sr, int64_t sc) {
  switch (esize) {
  case 1: COPY_TILES(uint8_t) break;
  case 2: COPY_TILES(uint16_t) break;
  case 4: COPY_TILES(uint32_t) break;
  default: COPY_TILES(uint64_t) break;
  }
}
#undef COPY_TILES

/* d[j * da] = s[j * sb] for j < m */
static void copy_span(void *d, const void *s, size_t esize, int64_t m, int64_t da, int64_t sb) {
  if (da == 1 && sb == 1) {
    memcpy(d, s, (size_t)m * esize);
    return;
  }
  switch (esize) {
  case 1: for (int64_t j = 0; j < m; j++) ((uint8_t *)d)[j * da] = ((const uint8_t *)s)[j * sb]; break;
  case 2: for (int64_t j = 0; j < m; j++) ((uint16_t *)d)[j * da] = ((const uint16_t *)s)[j * sb]; break;
  case 4: for (int64_t j = 0; j < m; j++) ((uint32_t *)d)[j * da] = ((const uint32_t *)s)[j * sb]; break;
  default: for (int64_t j = 0; j < m; j++) ((uint64_t *)d)[j * da] = ((const uint64_t *)s)[j * sb]; break;
  }
}

/* dst (geometry a) <- src (geometry b); numel > 0; strides in elements of esize bytes */
static void copy_loop(char *dst, const char *src, size_t esize, const fsdp_loop *L) {
  const int in = L->n - 1;
  const int64_t m = L->size[in], da = L->sa[in], sb = L->sb[in];
  const bool tiled = L->n >= 2 && (da != 1 || sb != 1);
  const int nouter = tiled ? in - 1 : in; /* dims walked by the odometer */
  int64_t outer = 1;
  for (int k = 0; k < nouter; k++) outer *= L->size[k];
  int64_t idx[FSDP_MAX_DIMS] = {0}, od = 0, os = 0;
  for (int64_t o = 0; o < outer; o++) {
    char *d = dst + od * (int64_t)esize;
    const char *s = src + os * (int64_t)esize;
    if (tiled)
      copy_tiles(d, s, esize, L->size[in - 1], m, L->sa[in - 1], da, L->sb[in - 1], sb);
    else
      copy_span(d, s, esize, m, da, sb);
    for (int k = nouter - 1; k >= 0; k--) { /* odometer over the outer dims */
      od += L->sa[k], os += L->sb[k];
      if (++idx[k] < L->size[k]) break;
      od -= L->sa[k] * L->size[k], os -= L->sb[k] * L->size[k];
      idx[k] = 0;
    }
  }
}

/* Every element of dst (geometry a) <- the esize-byte pattern at v. */
static void fill_loop(char *dst, const void *v, size_t esize, const fsdp_loop *L) {
  const int in = L->n - 1;
  const int64_t m = L->size[in], da = L->sa[in];
  int64_t outer = 1;
  for (int k = 0; k < in; k++) outer *= L->size[k];
  int64_t idx[FSDP_MAX_DIMS] = {0}, od = 0;
  uint64_t w = 0;
  memcpy(&w, v, esize);
  for (int64_t o = 0; o < outer; o++) {
    char *d = dst + od * (int64_t)esize;
    switch (esize) {
    case 1: for (int64_t j = 0; j < m; j++) ((uint8_t *)d)[j * da] = (uint8_t)w; break;
    case 2: for (int64_t j = 0; j < m; j++) ((uint16_t *)d)[j * da] = (uint16_t)w; break;
    case 4: {
      uint32_t x = (uint32_t)w;
      for (int64_t j = 0; j < m; j++) ((uint32_t *)d)[j * da] = x;
      break;
    }
    default: for (int64_t j = 0; j < m; j++) ((uint64_t *)d)[j * da] = w; break;
    }
    for (int k = in - 1; k >= 0; k--) {
      od += L->sa[k];
      if (++idx[k] < L->size[k]) break;
      od -= L->sa[k] * L->size[k];
      idx[k] = 0;
    }
  }
}

void fsdp_host_copy_strided(void *dst, const int64_t *dst_strides, const void *src,
                            const int64_t *src_strides, size_t esize, int ndim,
                            const int64_t *shape) {
  for (int i = 0; i < ndim; i++)
    if (shape[i] == 0) return;
  fsdp_loop L;
  loop_init(&L, ndim, shape, dst_strides, src_strides);
  copy_loop(dst, src, esize, &L);
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

/* Dense bytes between two devices: direct when one side is host memory, else through a
 * bounded host buffer. */
#define BOUNCE_BYTES ((size_t)1 << 20)
static int copy_across(const fsdp_device_i *ddev, void *d, const fsdp_device_i *sdev,
                       const void *s, size_t bytes) {
  if (ddev->host_memory) return sdev->to_host(sdev->ctx, d, s, bytes);
  if (sdev->host_memory) return ddev->from_host(ddev->ctx, d, s, bytes);
  void *buf = malloc(bytes < BOUNCE_BYTES ? (bytes ? bytes : 1) : BOUNCE_BYTES);
  if (!buf) return fsdp_error("copy: out of host memory for a staging buffer");
  int rc = FSDP_OK;
  for (size_t at = 0; !rc && at < bytes; at += BOUNCE_BYTES) {
    size_t n = bytes - at < BOUNCE_BYTES ? bytes - at : BOUNCE_BYTES;
    rc = sdev->to_host(sdev->ctx, buf, (const char *)s + at, n);
    if (!rc) rc = ddev->from_host(ddev->ctx, (char *)d + at, buf, n);
  }
  free(buf);
  return rc;
}

int fsdp_tensor_copy(fsdp_tensor *dst, const fsdp_tensor *src) {
  if (!fsdp_tensor_same_shape(dst, src))
    return fsdp_error("copy: shape mismatch: destination %s, source %s", FSDP_SHAPE_STR(dst),
                      FSDP_SHAPE_STR(src));
  if (dst->dtype != src->dtype)
    return fsdp_error("copy: dtype mismatch: destination %s, source %s (convert with "
                      "t:to(dtype))",
                      fsdp_dtype_name(dst->dtype), fsdp_dtype_name(src->dtype));
  const fsdp_device_i *ddev = dst->storage->device, *sdev = src->storage->device;
  if (ddev->has_data && !sdev->has_data) {
    fsdp_tensor_data(src, "copy: source"); /* names the tensor and why it has no data */
    return FSDP_ERR;
  }
  /* A destination whose data lives elsewhere (a sharded parameter) must not swallow writes:
   * that is how pruning through stale references silently did nothing. */
  if (ddev->no_data) {
    fsdp_tensor_data(dst, "copy");
    return FSDP_ERR;
  }
  fsdp_tensor_written(dst);
  if (!ddev->has_data) return FSDP_OK; /* shape only: nothing to write */
  int64_t numel = fsdp_tensor_numel(dst);
  if (numel == 0) return FSDP_OK;
  const size_t esize = fsdp_dtype_size(dst->dtype);
  char *d = fsdp_tensor_data(dst, "copy");
  const char *s = fsdp_tensor_data(src, "copy");
  const bool dense = fsdp_tensor_is_contiguous(dst) && fsdp_tensor_is_contiguous(src);

  if (ddev != sdev) {
    if (!dense)
      return fsdp_error("copy: from the %s device to the %s device needs contiguous tensors "
                        "(got %s and %s); make a contiguous copy first",
                        sdev->name, ddev->name, fsdp_tensor_is_contiguous(src) ? "contiguous"
                        : "strided", fsdp_tensor_is_contiguous(dst) ? "contiguous" : "strided");
    return copy_across(ddev, d, sdev, s, (size_t)numel * esize);
  }
  if (dst->storage->data == src->storage->data && !dense) { /* views of one buffer */
    if (same_geometry(dst, src)) return FSDP_OK;
    int64_t dlo, dhi, slo, shi;
    extent(dst, &dlo, &dhi);
    extent(src, &slo, &shi);
    if (dlo <= shi && slo <= dhi) { /* may overlap: read everything before writing anything */
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
  /* Both dense: one device copy (memmove semantics, so overlapping dense views are fine). */
  if (dense) return ddev->copy(ddev->ctx, d, s, (size_t)numel * esize);
  if (!ddev->host_memory)
    return fsdp_error("copy: a strided copy on the %s device needs its kernels (fsdp_copy)",
                      ddev->name);
  fsdp_loop L;
  loop_init(&L, dst->ndim, dst->shape, dst->strides, src->strides);
  copy_loop(d, s, esize, &L);
  return FSDP_OK;
}

int fsdp_tensor_fill(fsdp_tensor *t, double v) {
  if (t->storage->device->no_data) { /* sharded: writes must not vanish (see copy) */
    fsdp_tensor_data(t, "fill");
    return FSDP_ERR;
  }
  fsdp_tensor_written(t);
  const fsdp_device_i *dev = t->storage->device;
  int64_t numel = fsdp_tensor_numel(t);
  if (!dev->has_data || numel == 0) return FSDP_OK;
  const size_t esize = fsdp_dtype_size(t->dtype);
  unsigned char pattern[8];
  fsdp_dtype_store(pattern, t->dtype, 0, v);
  char *d = fsdp_tensor_data(t, "fill");
  if (dev->host_memory) {
    fsdp_loop L;
    loop_init(&L, t->ndim, t->shape, t->strides, t->strides);
    fill_loop(d, pattern, esize, &L);
    return FSDP_OK;
  }
  if (!fsdp_tensor_is_contiguous(t))
    return fsdp_error("fill: a strided fill on the %s device needs its kernels", dev->name);
  /* another device: fill a host block once, then send it as often as needed */
  size_t bytes = (size_t)numel * esize, chunk = bytes < BOUNCE_BYTES ? bytes : BOUNCE_BYTES;
  char *buf = malloc(chunk);
  if (!buf) return fsdp_error("fill: out of host memory for a staging buffer");
  for (size_t i = 0; i < chunk; i += esize) memcpy(buf + i, pattern, esize);
  int rc = FSDP_OK;
  for (size_t at = 0; !rc && at < bytes; at += chunk) {
    size_t n = bytes - at < chunk ? bytes - at : chunk;
    rc = dev->from_host(dev->ctx, d + at, buf, n);
  }
  free(buf);
  return rc;
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
  t->grad_shared = false;
}
