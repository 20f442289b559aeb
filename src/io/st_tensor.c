/*
 * st_tensor.c — tensors through safetensors files (io.h): any dtype, any device with data, any
 * strides, in bounded host memory. The file layer (st_write.c, st_read.c) moves stored bytes;
 * this file converts between a stored dtype and a tensor's and moves data between devices with
 * the kernels' fsdp_copy, one piece of at most FSDP_IO_STAGE_BYTES at a time, so saving or
 * loading a tensor on a device without host memory never holds it whole on the host.
 *
 * Pieces are views of the tensor in row-major order: flat ranges of a contiguous tensor;
 * blocks of whole rows of a strided one (or, when one row is too big, its rows in turn). The
 * staging buffer is plain malloc (like the writer's own buffer), seen as a cpu tensor.
 */
#include <stdlib.h>
#include <string.h>

#include "io/io.h"
#include "kernels/kernels.h"

typedef int (*block_fn)(void *ctx, fsdp_tensor *blk);

/* fn on consecutive views of t, in row-major order, of at most max elements each. */
static int each_block(fsdp_tensor *t, int64_t max, block_fn fn, void *ctx) {
  int64_t n = fsdp_tensor_numel(t);
  if (n == 0) return FSDP_OK;
  if (fsdp_tensor_is_contiguous(t)) {
    for (int64_t a = 0; a < n; a += max) {
      int64_t k = n - a < max ? n - a : max, one = 1;
      fsdp_tensor *v;
      if (fsdp_tensor_new_view(&v, t, t->offset + a, 1, &k, &one)) return FSDP_ERR;
      int rc = fn(ctx, v);
      fsdp_tensor_release(v);
      if (rc) return rc;
    }
    return FSDP_OK;
  }
  /* strided (so at least one dimension): rows of dim 0 */
  int64_t inner = n / t->shape[0];
  if (inner <= max) {
    int64_t rows = max / inner, shape[FSDP_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    for (int64_t i = 0; i < t->shape[0]; i += rows) {
      shape[0] = t->shape[0] - i < rows ? t->shape[0] - i : rows;
      fsdp_tensor *v;
      if (fsdp_tensor_new_view(&v, t, t->offset + i * t->strides[0], t->ndim, shape, t->strides))
        return FSDP_ERR;
      int rc = fn(ctx, v);
      fsdp_tensor_release(v);
      if (rc) return rc;
    }
    return FSDP_OK;
  }
  for (int64_t i = 0; i < t->shape[0]; i++) {
    fsdp_tensor *v;
    if (fsdp_tensor_new_view(&v, t, t->offset + i * t->strides[0], t->ndim - 1, t->shape + 1,
                             t->strides + 1))
      return FSDP_ERR;
    int rc = each_block(v, max, fn, ctx);
    fsdp_tensor_release(v);
    if (rc) return rc;
  }
  return FSDP_OK;
}

/* ---- writing ------------------------------------------------------------------------------ */

typedef struct write_ctx {
  fsdp_io_st_writer *w;
  const char *name;
  fsdp_dtype dt; /* the entry's */
  void *stage;
} write_ctx;

static int write_block(void *ctx, fsdp_tensor *blk) {
  write_ctx *c = ctx;
  fsdp_tensor *h;
  if (fsdp_tensor_wrap(&h, c->stage, c->dt, blk->ndim, blk->shape)) return FSDP_ERR;
  int rc = fsdp_copy(h, blk);
  fsdp_tensor_release(h);
  if (rc)
    return fsdp_error_context("%s: tensor '%s'", fsdp_io_st_writer_path(c->w), c->name);
  return fsdp_io_st_writer_write(c->w, c->name, c->stage, fsdp_tensor_numel(blk));
}

int fsdp_io_st_write_tensor(fsdp_io_st_writer *w, const char *name, fsdp_tensor *t) {
  const fsdp_io_st_entry *e = fsdp_io_st_writer_find(w, name);
  if (e == NULL) return FSDP_ERR;
  const char *path = fsdp_io_st_writer_path(w);
  fsdp_dtype dt;
  if (!fsdp_io_dtype_to_tensor(e->dtype, &dt))
    return fsdp_error("%s: tensor '%s': entry dtype %s is not a tensor dtype (write its bytes "
                      "with fsdp_io_st_writer_write)",
                      path, name, fsdp_io_dtype_name(e->dtype));
  if (!t->storage->device->has_data) {
    fsdp_tensor_data(t, "write"); /* the device's own message */
    return fsdp_error_context("%s: tensor '%s'", path, name);
  }
  int64_t n = fsdp_tensor_numel(t);
  if (n == 0) return fsdp_io_st_writer_write(w, name, NULL, 0);
  if (t->storage->device->host_memory && t->dtype == dt && fsdp_tensor_is_contiguous(t))
    return fsdp_io_st_writer_write(w, name, fsdp_tensor_data(t, "write"), n);
  write_ctx c = {.w = w, .name = name, .dt = dt, .stage = malloc(FSDP_IO_STAGE_BYTES)};
  if (c.stage == NULL) return fsdp_error("%s: tensor '%s': out of memory", path, name);
  int rc = each_block(t, (int64_t)(FSDP_IO_STAGE_BYTES / fsdp_dtype_size(dt)), write_block, &c);
  free(c.stage);
  return rc;
}

/* ---- reading ------------------------------------------------------------------------------ */

typedef struct read_ctx {
  fsdp_tensor *dst; /* contiguous */
  fsdp_dtype dt;    /* the stored one */
  const char *path, *name;
} read_ctx;

static int read_piece(void *ctx, const void *bytes, int64_t at, int64_t n) {
  read_ctx *c = ctx;
  fsdp_tensor *h, *slice;
  int64_t one = 1;
  if (fsdp_tensor_wrap(&h, (void *)bytes, c->dt, 1, &n)) return FSDP_ERR;
  int rc = fsdp_tensor_new_view(&slice, c->dst, c->dst->offset + at, 1, &n, &one);
  if (rc == FSDP_OK) {
    rc = fsdp_copy(slice, h);
    fsdp_tensor_release(slice);
  }
  fsdp_tensor_release(h);
  return rc ? fsdp_error_context("%s: tensor '%s'", c->path, c->name) : FSDP_OK;
}

int fsdp_io_st_read_tensor(fsdp_io_st_reader *r, const char *name, int64_t first, int64_t count,
                           fsdp_tensor *dst) {
  const fsdp_io_st_entry *e = fsdp_io_st_reader_find(r, name);
  if (e == NULL) return FSDP_ERR;
  const char *path = fsdp_io_st_reader_path(r);
  fsdp_dtype dt;
  if (!fsdp_io_dtype_to_tensor(e->dtype, &dt))
    return fsdp_error("%s: tensor '%s': stored dtype %s has no tensor dtype, so it cannot be "
                      "read as %s (F32, BF16, F16, F64, I64, I32, U8 and BOOL can)",
                      path, name, fsdp_io_dtype_name(e->dtype), fsdp_dtype_name(dst->dtype));
  if (fsdp_tensor_numel(dst) != count)
    return fsdp_error("%s: tensor '%s': reading %lld elements into a tensor of %lld", path, name,
                      (long long)count, (long long)fsdp_tensor_numel(dst));
  if (!fsdp_tensor_is_contiguous(dst))
    return fsdp_error("%s: tensor '%s': the tensor read into (%s) must be contiguous", path,
                      name, FSDP_SHAPE_STR(dst));
  if (!dst->storage->device->has_data) {
    fsdp_tensor_data(dst, "read"); /* the device's own message */
    return fsdp_error_context("%s: tensor '%s'", path, name);
  }
  int rc;
  if (count == 0 || (dst->storage->device->host_memory && dst->dtype == dt)) {
    char none;
    rc = fsdp_io_st_reader_read(r, count ? fsdp_tensor_data(dst, "read") : &none, name, first,
                                count);
  } else {
    read_ctx c = {.dst = dst, .dt = dt, .path = path, .name = name};
    void *stage = malloc(FSDP_IO_STAGE_BYTES);
    if (stage == NULL) return fsdp_error("%s: tensor '%s': out of memory", path, name);
    rc = fsdp_io_st_reader_read_chunks(r, name, first, count, stage, FSDP_IO_STAGE_BYTES,
                                       read_piece, &c);
    free(stage);
  }
  if (rc == FSDP_OK) fsdp_tensor_written(dst);
  return rc;
}
