/*
 * tokens.c — memory-mapped token files (tokens.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/core.h"
#include "io/io.h"
#include "io/tokens.h"

struct fsdp_io_tokens {
  char *path;
  const unsigned char *map; /* NULL for an empty file */
  size_t bytes;
  int64_t count, vocab;
  int elem_size;
};

int fsdp_io_tokens_open(fsdp_io_tokens **out, const char *path, int elem_size, int64_t count,
                        int64_t vocab) {
  *out = NULL;
  if (elem_size != 2 && elem_size != 4)
    return fsdp_error("%s: ids of %d bytes: only 2 (uint16) and 4 (uint32) are token files", path,
                      elem_size);
  if (count < 0) return fsdp_error("%s: negative token count %lld", path, (long long)count);
  int fd;
  uint64_t size;
  if (fsdp_io_open_regular(path, &fd, &size)) return FSDP_ERR;
  if (size != (uint64_t)count * (uint64_t)elem_size) {
    close(fd);
    return fsdp_error("%s: wrong size: %lld bytes, but %lld ids of %d bytes need %lld (truncated, "
                      "or the sidecar does not describe this file)",
                      path, (long long)size, (long long)count, elem_size,
                      (long long)count * elem_size);
  }
  fsdp_io_tokens *t = calloc(1, sizeof *t);
  if (t != NULL) t->path = fsdp_strdup_printf("%s", path);
  if (t == NULL || t->path == NULL) {
    close(fd);
    free(t);
    return fsdp_error("%s: out of memory", path);
  }
  t->bytes = (size_t)size;
  t->count = count;
  t->vocab = vocab;
  t->elem_size = elem_size;
  if (t->bytes > 0) {
    void *m = mmap(NULL, t->bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      int e = errno;
      close(fd);
      free(t->path);
      free(t);
      return fsdp_error("%s: cannot map %zu bytes: %s", path, (size_t)size, strerror(e));
    }
    /* windows land anywhere: read-ahead would only fill memory with pages nobody asked for */
    madvise(m, t->bytes, MADV_RANDOM);
    t->map = m;
  }
  close(fd); /* the mapping keeps the file */
  *out = t;
  return FSDP_OK;
}

void fsdp_io_tokens_close(fsdp_io_tokens *t) {
  if (t == NULL) return;
  if (t->map != NULL) munmap((void *)t->map, t->bytes);
  free(t->path);
  free(t);
}

int64_t fsdp_io_tokens_count(const fsdp_io_tokens *t) { return t->count; }
const char *fsdp_io_tokens_path(const fsdp_io_tokens *t) { return t->path; }

static inline int64_t id_at(const fsdp_io_tokens *t, int64_t i) {
  const unsigned char *p = t->map + (size_t)i * (size_t)t->elem_size;
  if (t->elem_size == 2) return (int64_t)p[0] | (int64_t)p[1] << 8;
  return (int64_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                   (uint32_t)p[3] << 24);
}

/* Give back the pages of ids [first, first + n): the data stays in the page cache. A read fault
 * maps the cached pages around the one asked for too (the kernel's fault-around, 64 KiB aligned
 * by default), so the range given back is widened to those 64 KiB blocks, within the map. */
#define FAULT_AROUND ((uintptr_t)65536)
static void release(const fsdp_io_tokens *t, int64_t first, int64_t n) {
  uintptr_t base = (uintptr_t)t->map, end = base + t->bytes;
  uintptr_t lo = base + (size_t)first * (size_t)t->elem_size;
  uintptr_t hi = lo + (size_t)n * (size_t)t->elem_size;
  lo &= ~(FAULT_AROUND - 1);
  hi = (hi + FAULT_AROUND - 1) & ~(FAULT_AROUND - 1);
  if (lo < base) lo = base;
  if (hi > end) hi = end;
  madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

int fsdp_io_tokens_windows(const fsdp_io_tokens *t, int64_t *x, int64_t *y, const int64_t *starts,
                           int B, int64_t T) {
  if (T < 1) return fsdp_error("%s: window length %lld must be >= 1", t->path, (long long)T);
  const int64_t need = y != NULL ? T + 1 : T;
  if (t->count < need)
    return fsdp_error("%s: %lld tokens; a window of %lld%s needs %lld", t->path,
                      (long long)t->count, (long long)T, y != NULL ? " and its target" : "",
                      (long long)need);
  const int64_t last = t->count - need;
  for (int b = 0; b < B; b++)
    if (starts[b] < 0 || starts[b] > last)
      return fsdp_error("%s: window start %lld is out of range [0, %lld]", t->path,
                        (long long)starts[b], (long long)last);
  for (int b = 0; b < B; b++) {
    const int64_t s = starts[b];
    for (int64_t i = 0; i < need; i++) {
      int64_t v = id_at(t, s + i);
      if (t->vocab > 0 && v >= t->vocab) {
        for (int c = 0; c <= b; c++) release(t, starts[c], need);
        return fsdp_error("%s: token %lld is %lld, not below the vocabulary size %lld (a corrupt "
                          "file, or the sidecar's vocab_size is wrong)",
                          t->path, (long long)(s + i), (long long)v, (long long)t->vocab);
      }
      if (i < T) x[b * T + i] = v;
      if (y != NULL && i > 0) y[b * T + i - 1] = v;
    }
  }
  for (int b = 0; b < B; b++) release(t, starts[b], need);
  return FSDP_OK;
}
