/*
 * st_write.c — the streaming safetensors writer (io.h; format in docs/checkpoints.md).
 *
 * The header must precede the data but the checksums are only known once the data has gone
 * by, so the header reserves a fixed-width field for each: every checksum is a JSON string of
 * exactly 16 hex digits, written as "0000000000000000" and patched at commit (the writer keeps
 * the header, records where each field starts, and rewrites the header in place with one
 * pwrite). The header checksum is the first member of the header so that a reader finds it at
 * a fixed offset without trusting the JSON it protects.
 *
 * Memory: the header, one XXH3 state and the atomic file's 1 MiB buffer; tensor bytes go from
 * the caller's buffer to the file (large writes bypass the buffer).
 *
 * Invariants: entries [0, cur) are complete and their checksums are in sums[]; `done` bytes of
 * entry cur have been written and hashed into `xs`; entries with no bytes are complete from
 * the start (cur skips them).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "io/io.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this writer copies host values as they are"
#endif

typedef struct wentry {
  fsdp_io_st_entry e;  /* as given to open; e.name is ours */
  size_t esize;        /* bytes per element */
  uint64_t begin, end; /* data_offsets */
  size_t sum_at;       /* offset of its 16 hex digits in hdr */
} wentry;

struct fsdp_io_st_writer {
  fsdp_io_atomic *file;
  int n;
  wentry *e;
  uint64_t *sums;
  char *hdr; /* 8-byte length + JSON + padding */
  size_t hdr_len;
  size_t header_sum_at;
  int cur;
  uint64_t done;
  XXH3_state_t *xs;
};

/* ---- a growing string ----------------------------------------------------------------- */

typedef struct sbuf {
  char *p;
  size_t n, cap;
  bool oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
  if (b->oom) return;
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + n + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (p == NULL) {
      b->oom = true;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = '\0';
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_u64(sbuf *b, uint64_t v) {
  char tmp[24];
  sb_put(b, tmp, (size_t)snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v));
}

/* The body of a JSON string literal (RFC 8259), without its quotes: quotes, backslashes and
 * control characters escaped; the text is valid UTF-8 (checked by the caller) and passes
 * through as it is. */
static void sb_json_chars(sbuf *b, const char *s) {
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    char esc[8];
    switch (*p) {
    case '"': sb_put(b, "\\\"", 2); break;
    case '\\': sb_put(b, "\\\\", 2); break;
    case '\n': sb_put(b, "\\n", 2); break;
    case '\r': sb_put(b, "\\r", 2); break;
    case '\t': sb_put(b, "\\t", 2); break;
    default:
      if (*p < 0x20) sb_put(b, esc, (size_t)snprintf(esc, sizeof esc, "\\u%04x", *p));
      else sb_put(b, (const char *)p, 1);
    }
  }
}

static void sb_json_string(sbuf *b, const char *s) {
  sb_put(b, "\"", 1);
  sb_json_chars(b, s);
  sb_put(b, "\"", 1);
}

#define ZERO_SUM "0000000000000000"

/* ---- validation ----------------------------------------------------------------------- */

static int cmp_str_ptr(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* A duplicate among names[0..n) (sorted in place), or NULL. */
static const char *find_duplicate(const char **names, int n) {
  qsort(names, (size_t)n, sizeof *names, cmp_str_ptr);
  for (int i = 1; i < n; i++)
    if (strcmp(names[i - 1], names[i]) == 0) return names[i];
  return NULL;
}

static int check_text(const char *path, const char *what, const char *s) {
  if (s == NULL) return fsdp_error("%s: %s is NULL", path, what);
  if (!fsdp_io_utf8_valid(s, strlen(s)))
    return fsdp_error("%s: %s '%s' is not valid UTF-8", path, what, s);
  return FSDP_OK;
}

static int check_entries(const char *path, const fsdp_io_st_entry *entries, int n,
                         const fsdp_io_kv *meta, int nmeta) {
  if (n < 0 || nmeta < 0) return fsdp_error("%s: negative entry or metadata count", path);
  for (int i = 0; i < n; i++) {
    const fsdp_io_st_entry *e = &entries[i];
    if (check_text(path, "tensor name", e->name)) return FSDP_ERR;
    if (e->name[0] == '\0') return fsdp_error("%s: entry %d has an empty tensor name", path, i);
    if (strcmp(e->name, "__metadata__") == 0)
      return fsdp_error("%s: '__metadata__' cannot name a tensor", path);
    if ((unsigned)e->dtype >= FSDP_IO_DTYPE_COUNT)
      return fsdp_error("%s: tensor '%s': unknown dtype %d", path, e->name, (int)e->dtype);
    if (e->ndim < 0 || e->ndim > FSDP_MAX_DIMS)
      return fsdp_error("%s: tensor '%s': %d dimensions; at most %d", path, e->name, e->ndim,
                        FSDP_MAX_DIMS);
    for (int d = 0; d < e->ndim; d++)
      if (e->shape[d] < 0)
        return fsdp_error("%s: tensor '%s': negative size %lld in dimension %d", path, e->name,
                          (long long)e->shape[d], d);
  }
  for (int i = 0; i < nmeta; i++) {
    if (check_text(path, "metadata key", meta[i].key)) return FSDP_ERR;
    if (check_text(path, "metadata value", meta[i].value))
      return fsdp_error_context("key '%s'", meta[i].key);
    if (strcmp(meta[i].key, FSDP_IO_HEADER_CHECKSUM_KEY) == 0 ||
        strncmp(meta[i].key, FSDP_IO_CHECKSUM_PREFIX, strlen(FSDP_IO_CHECKSUM_PREFIX)) == 0)
      return fsdp_error("%s: metadata key '%s' is reserved for the writer's checksums", path,
                        meta[i].key);
  }
  int most = n > nmeta ? n : nmeta;
  const char **names = malloc(sizeof *names * (size_t)(most > 0 ? most : 1));
  if (names == NULL) return fsdp_error("%s: out of memory", path);
  for (int i = 0; i < n; i++) names[i] = entries[i].name;
  const char *dup = find_duplicate(names, n);
  int rc = FSDP_OK;
  if (dup != NULL) {
    rc = fsdp_error("%s: tensor '%s' appears twice in the entries", path, dup);
  } else {
    for (int i = 0; i < nmeta; i++) names[i] = meta[i].key;
    dup = find_duplicate(names, nmeta);
    if (dup != NULL) rc = fsdp_error("%s: metadata key '%s' appears twice", path, dup);
  }
  free(names);
  return rc;
}

/* ---- writer ---------------------------------------------------------------------------- */

static void free_writer(fsdp_io_st_writer *w) {
  if (w->e != NULL)
    for (int i = 0; i < w->n; i++) free((char *)w->e[i].e.name);
  free(w->e);
  free(w->sums);
  free(w->hdr);
  if (w->xs != NULL) XXH3_freeState(w->xs);
  free(w);
}

static uint64_t entry_bytes(const wentry *e) { return e->end - e->begin; }

static void skip_empty(fsdp_io_st_writer *w) {
  while (w->cur < w->n && entry_bytes(&w->e[w->cur]) == 0) w->cur++;
}

/* Lay the data out, build the header with zeroed checksum fields and remember where they are. */
static int build_header(fsdp_io_st_writer *w, const char *path, const fsdp_io_st_entry *entries,
                        const fsdp_io_kv *meta, int nmeta) {
  uint64_t off = 0;
  for (int i = 0; i < w->n; i++) {
    const fsdp_io_st_entry *e = &entries[i];
    uint64_t bytes = w->e[i].esize;
    for (int d = 0; d < e->ndim; d++)
      if (__builtin_mul_overflow(bytes, (uint64_t)e->shape[d], &bytes))
        return fsdp_error("%s: tensor '%s': size overflows 64 bits", path, e->name);
    w->e[i].begin = off;
    if (__builtin_add_overflow(off, bytes, &off))
      return fsdp_error("%s: total size overflows 64 bits at tensor '%s'", path, e->name);
    w->e[i].end = off;
  }
  sbuf b = {0};
  sb_put(&b, "\0\0\0\0\0\0\0\0", 8); /* the length, filled in below */
  sb_str(&b, "{\"__metadata__\":{\"" FSDP_IO_HEADER_CHECKSUM_KEY "\":\"");
  w->header_sum_at = b.n;
  sb_str(&b, ZERO_SUM "\"");
  for (int i = 0; i < nmeta; i++) {
    sb_put(&b, ",", 1);
    sb_json_string(&b, meta[i].key);
    sb_put(&b, ":", 1);
    sb_json_string(&b, meta[i].value);
  }
  for (int i = 0; i < w->n; i++) {
    /* the prefix is plain ASCII, so the escaped key is the prefix + the escaped name */
    sb_str(&b, ",\"" FSDP_IO_CHECKSUM_PREFIX);
    sb_json_chars(&b, entries[i].name);
    sb_str(&b, "\":\"");
    w->e[i].sum_at = b.n;
    sb_str(&b, ZERO_SUM "\"");
  }
  sb_put(&b, "}", 1);
  for (int i = 0; i < w->n; i++) {
    const fsdp_io_st_entry *e = &entries[i];
    sb_put(&b, ",", 1);
    sb_json_string(&b, e->name);
    sb_str(&b, ":{\"dtype\":\"");
    sb_str(&b, fsdp_io_dtype_name(e->dtype));
    sb_str(&b, "\",\"shape\":[");
    for (int d = 0; d < e->ndim; d++) {
      if (d > 0) sb_put(&b, ",", 1);
      sb_u64(&b, (uint64_t)e->shape[d]);
    }
    sb_str(&b, "],\"data_offsets\":[");
    sb_u64(&b, w->e[i].begin);
    sb_put(&b, ",", 1);
    sb_u64(&b, w->e[i].end);
    sb_str(&b, "]}");
  }
  sb_put(&b, "}", 1);
  while (b.n % 8 != 0) sb_put(&b, " ", 1); /* 8 + JSON is then a multiple of 8 too */
  if (b.oom) {
    free(b.p);
    return fsdp_error("%s: out of memory building the header", path);
  }
  uint64_t json_len = b.n - 8;
  if (json_len > FSDP_IO_ST_MAX_HEADER) {
    free(b.p);
    return fsdp_error("%s: header of %llu bytes exceeds the format's limit of %u bytes", path,
                      (unsigned long long)json_len, FSDP_IO_ST_MAX_HEADER);
  }
  for (int i = 0; i < 8; i++) b.p[i] = (char)(unsigned char)(json_len >> (8 * i));
  w->hdr = b.p;
  w->hdr_len = b.n;
  return FSDP_OK;
}

int fsdp_io_st_writer_open(fsdp_io_st_writer **out, const char *path,
                           const fsdp_io_st_entry *entries, int nentries,
                           const fsdp_io_kv *metadata, int nmetadata) {
  *out = NULL;
  if (path == NULL) return fsdp_error("safetensors writer: NULL path");
  if (check_entries(path, entries, nentries, metadata, nmetadata)) return FSDP_ERR;
  fsdp_io_st_writer *w = calloc(1, sizeof *w);
  if (w == NULL) return fsdp_error("%s: out of memory", path);
  w->n = nentries;
  w->e = calloc((size_t)(nentries > 0 ? nentries : 1), sizeof *w->e);
  w->sums = calloc((size_t)(nentries > 0 ? nentries : 1), sizeof *w->sums);
  w->xs = XXH3_createState();
  if (w->e == NULL || w->sums == NULL || w->xs == NULL) goto oom;
  for (int i = 0; i < nentries; i++) {
    w->e[i].e = entries[i];
    w->e[i].esize = fsdp_io_dtype_size(entries[i].dtype);
    if ((w->e[i].e.name = strdup(entries[i].name)) == NULL) goto oom;
  }
  if (build_header(w, path, entries, metadata, nmetadata)) goto fail;
  uint64_t empty = XXH3_64bits(NULL, 0);
  for (int i = 0; i < nentries; i++)
    if (entry_bytes(&w->e[i]) == 0) w->sums[i] = empty;
  XXH3_64bits_reset(w->xs);
  skip_empty(w);
  if (fsdp_io_atomic_open(&w->file, path)) goto fail;
  if (fsdp_io_atomic_write(w->file, w->hdr, w->hdr_len)) goto fail;
  *out = w;
  return FSDP_OK;
oom:
  fsdp_error("%s: out of memory", path);
fail:
  fsdp_io_atomic_abort(w->file);
  free_writer(w);
  return FSDP_ERR;
}

static int index_of(const fsdp_io_st_writer *w, const char *name) {
  for (int i = 0; i < w->n; i++)
    if (strcmp(w->e[i].e.name, name) == 0) return i;
  return -1;
}

const fsdp_io_st_entry *fsdp_io_st_writer_find(const fsdp_io_st_writer *w, const char *name) {
  int i = name != NULL ? index_of(w, name) : -1;
  if (i < 0) {
    fsdp_error("%s: tensor '%s' is not one of the file's entries", fsdp_io_atomic_path(w->file),
               name != NULL ? name : "(null)");
    return NULL;
  }
  return &w->e[i].e;
}

const char *fsdp_io_st_writer_path(const fsdp_io_st_writer *w) {
  return fsdp_io_atomic_path(w->file);
}

int fsdp_io_st_writer_write(fsdp_io_st_writer *w, const char *name, const void *data,
                            int64_t count) {
  const char *path = fsdp_io_atomic_path(w->file);
  if (name == NULL) return fsdp_error("%s: write with a NULL tensor name", path);
  if (count < 0)
    return fsdp_error("%s: tensor '%s': negative element count %lld", path, name,
                      (long long)count);
  if (w->cur == w->n || strcmp(w->e[w->cur].e.name, name) != 0) {
    int i = index_of(w, name);
    if (i < 0) return fsdp_error("%s: tensor '%s' is not one of the file's entries", path, name);
    if (count == 0) return FSDP_OK; /* nothing to place: order does not matter */
    if (i < w->cur || w->cur == w->n)
      return fsdp_error("%s: tensor '%s' is already complete (%llu bytes); this write of %lld "
                        "elements runs past its end",
                        path, name, (unsigned long long)entry_bytes(&w->e[i]), (long long)count);
    const wentry *c = &w->e[w->cur];
    return fsdp_error("%s: tensor '%s' written before '%s' is complete (%llu of %llu bytes): "
                      "tensors are written in entry order",
                      path, name, c->e.name, (unsigned long long)w->done,
                      (unsigned long long)entry_bytes(c));
  }
  wentry *e = &w->e[w->cur];
  uint64_t left = entry_bytes(e) - w->done;
  if ((uint64_t)count > left / e->esize)
    return fsdp_error("%s: tensor '%s': write of %lld elements at element %llu runs past its end "
                      "(%llu elements)",
                      path, name, (long long)count, (unsigned long long)(w->done / e->esize),
                      (unsigned long long)(entry_bytes(e) / e->esize));
  size_t bytes = (size_t)count * e->esize;
  if (bytes == 0) return FSDP_OK;
  XXH3_64bits_update(w->xs, data, bytes);
  if (fsdp_io_atomic_write(w->file, data, bytes))
    return fsdp_error_context("writing tensor '%s'", name);
  w->done += bytes;
  if (w->done == entry_bytes(e)) {
    w->sums[w->cur] = XXH3_64bits_digest(w->xs);
    XXH3_64bits_reset(w->xs);
    w->done = 0;
    w->cur++;
    skip_empty(w);
  }
  return FSDP_OK;
}

static void put_hex(char *at, uint64_t v) {
  char tmp[17];
  snprintf(tmp, sizeof tmp, "%016llx", (unsigned long long)v);
  memcpy(at, tmp, 16);
}

int fsdp_io_st_writer_commit(fsdp_io_st_writer *w) {
  const char *path = fsdp_io_atomic_path(w->file);
  if (w->cur < w->n) {
    const wentry *c = &w->e[w->cur];
    fsdp_error("%s: tensor '%s' is incomplete at commit: %llu of %llu bytes written", path,
               c->e.name, (unsigned long long)w->done, (unsigned long long)entry_bytes(c));
    fsdp_io_st_writer_abort(w);
    return FSDP_ERR;
  }
  for (int i = 0; i < w->n; i++) put_hex(w->hdr + w->e[i].sum_at, w->sums[i]);
  /* the header's own checksum covers the length and the JSON with its field still zero */
  put_hex(w->hdr + w->header_sum_at, XXH3_64bits(w->hdr, w->hdr_len));
  int rc = fsdp_io_atomic_pwrite(w->file, w->hdr, w->hdr_len, 0);
  if (rc == FSDP_OK) {
    rc = fsdp_io_atomic_commit(w->file);
  } else {
    fsdp_io_atomic_abort(w->file);
  }
  w->file = NULL;
  free_writer(w);
  return rc;
}

void fsdp_io_st_writer_abort(fsdp_io_st_writer *w) {
  if (w == NULL) return;
  fsdp_io_atomic_abort(w->file);
  free_writer(w);
}
