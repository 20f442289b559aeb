/*
 * st_read.c — the validating safetensors reader (io.h; format in docs/checkpoints.md).
 *
 * open reads the 8-byte length and the JSON header once, checks everything that can be
 * checked without the data (see io.h) and keeps a plain table of entries; the cJSON tree is
 * dropped before open returns. Reads then fetch exactly the bytes asked for with pread (or
 * memcpy for an in-memory file), so a rank reading its shard touches only its shard's bytes.
 * Nothing in the reader changes after open: reads from several threads need no lock.
 *
 * Every message starts with the file's name and, where one is involved, the tensor's:
 *   "<file>: tensor '<name>': <what is wrong>".
 * The file is treated as hostile input (it is fuzzed): every length and offset is checked
 * before it is used, with overflow-checked arithmetic.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "io/io.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this reader uses it as it is"
#endif

#define CHUNK_BYTES ((size_t)1 << 20)
#define HEADER_PREFIX "{\"__metadata__\":{\"" FSDP_IO_HEADER_CHECKSUM_KEY "\":\""

struct fsdp_io_st_reader {
  char *path;
  int fd;                   /* -1 for an in-memory file */
  const unsigned char *mem; /* the in-memory file, borrowed */
  uint64_t size;            /* of the whole file */
  uint64_t data_start;      /* 8 + header length */
  int n;
  fsdp_io_st_entry *e;
  int *by_name; /* indices of e sorted by name, for find */
  int nmeta;
  fsdp_io_kv *meta;
};

/* ---- raw reads -------------------------------------------------------------------------- */

/* buf <- the file's bytes [off, off + n). A short read means the file shrank since open. */
static int read_at(const fsdp_io_st_reader *r, void *buf, size_t n, uint64_t off,
                   const char *tensor) {
  if (n == 0) return FSDP_OK;
  if (off > r->size || n > r->size - off)
    goto truncated;
  if (r->fd < 0) {
    memcpy(buf, r->mem + off, n);
    return FSDP_OK;
  }
  unsigned char *p = buf;
  while (n > 0) {
    size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
    ssize_t got = pread(r->fd, p, chunk, (off_t)off);
    if (got < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      if (tensor != NULL)
        return fsdp_error("%s: tensor '%s': read failed at byte %llu: %s", r->path, tensor,
                          (unsigned long long)off, strerror(e));
      return fsdp_error("%s: read failed at byte %llu: %s", r->path, (unsigned long long)off,
                        strerror(e));
    }
    if (got == 0) goto truncated;
    p += got;
    n -= (size_t)got;
    off += (uint64_t)got;
  }
  return FSDP_OK;
truncated:
  if (tensor != NULL)
    return fsdp_error("%s: tensor '%s': file ends before byte %llu (truncated since it was "
                      "opened?)",
                      r->path, tensor, (unsigned long long)(off + n));
  return fsdp_error("%s: file ends before byte %llu (truncated?)", r->path,
                    (unsigned long long)(off + n));
}

/* ---- parsing helpers -------------------------------------------------------------------- */

/* A JSON number that is an integer in [0, 2^53] (exact in a double). */
static bool json_u64(const cJSON *v, uint64_t *out) {
  if (!cJSON_IsNumber(v)) return false;
  double d = v->valuedouble;
  if (!(d >= 0.0) || d > 9007199254740992.0 || d != floor(d)) return false;
  *out = (uint64_t)d;
  return true;
}

static bool parse_hex16(const char *s, uint64_t *out) {
  uint64_t v = 0;
  for (int i = 0; i < 16; i++) {
    char c = s[i];
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return false;
    v = v << 4 | (uint64_t)d;
  }
  if (s[16] != '\0' && s[16] != '"') return false;
  *out = v;
  return true;
}

static int cmp_by_name(const void *a, const void *b, void *ctx) {
  const fsdp_io_st_reader *r = ctx;
  return strcmp(r->e[*(const int *)a].name, r->e[*(const int *)b].name);
}

static int cmp_by_offsets(const void *a, const void *b, void *ctx) {
  const fsdp_io_st_reader *r = ctx;
  const fsdp_io_st_entry *x = &r->e[*(const int *)a], *y = &r->e[*(const int *)b];
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

static int parse_entry(fsdp_io_st_reader *r, fsdp_io_st_entry *e, const cJSON *j,
                       uint64_t data_size) {
  const char *name = e->name;
  if (!cJSON_IsObject(j))
    return fsdp_error("%s: tensor '%s': its header entry is not a JSON object", r->path, name);
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(j, "dtype");
  const cJSON *shape = cJSON_GetObjectItemCaseSensitive(j, "shape");
  const cJSON *offs = cJSON_GetObjectItemCaseSensitive(j, "data_offsets");
  if (!cJSON_IsString(dt))
    return fsdp_error("%s: tensor '%s': missing or non-string \"dtype\"", r->path, name);
  int dtype = fsdp_io_dtype_from_name(dt->valuestring);
  if (dtype < 0)
    return fsdp_error("%s: tensor '%s': unknown dtype '%s'", r->path, name, dt->valuestring);
  e->dtype = (fsdp_io_dtype)dtype;
  if (!cJSON_IsArray(shape))
    return fsdp_error("%s: tensor '%s': missing or non-array \"shape\"", r->path, name);
  int ndim = cJSON_GetArraySize(shape);
  if (ndim > FSDP_MAX_DIMS)
    return fsdp_error("%s: tensor '%s': %d dimensions; at most %d are supported", r->path, name,
                      ndim, FSDP_MAX_DIMS);
  e->ndim = ndim;
  uint64_t numel = 1;
  int d = 0;
  for (const cJSON *s = shape->child; s != NULL; s = s->next, d++) {
    uint64_t v;
    if (!json_u64(s, &v))
      return fsdp_error("%s: tensor '%s': shape entry %d is not an integer >= 0", r->path, name,
                        d);
    e->shape[d] = (int64_t)v;
    if (__builtin_mul_overflow(numel, v, &numel) || numel > (uint64_t)INT64_MAX)
      return fsdp_error("%s: tensor '%s': element count overflows", r->path, name);
  }
  e->numel = (int64_t)numel;
  if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2)
    return fsdp_error("%s: tensor '%s': \"data_offsets\" must be an array [begin, end]", r->path,
                      name);
  if (!json_u64(offs->child, &e->begin) || !json_u64(offs->child->next, &e->end))
    return fsdp_error("%s: tensor '%s': \"data_offsets\" must hold integers >= 0", r->path,
                      name);
  if (e->end < e->begin)
    return fsdp_error("%s: tensor '%s': data_offsets [%llu, %llu) end before they begin", r->path,
                      name, (unsigned long long)e->begin, (unsigned long long)e->end);
  uint64_t bytes;
  if (__builtin_mul_overflow(numel, (uint64_t)fsdp_io_dtype_size(e->dtype), &bytes) ||
      bytes != e->end - e->begin) {
    char shp[96];
    return fsdp_error("%s: tensor '%s': data_offsets [%llu, %llu) hold %llu bytes but shape %s "
                      "of %s needs %llu",
                      r->path, name, (unsigned long long)e->begin, (unsigned long long)e->end,
                      (unsigned long long)(e->end - e->begin),
                      fsdp_shape_str(shp, sizeof shp, e->ndim, e->shape),
                      fsdp_io_dtype_name(e->dtype), (unsigned long long)bytes);
  }
  if (e->end > data_size)
    return fsdp_error("%s: tensor '%s': data_offsets [%llu, %llu) run past the data section "
                      "(%llu bytes): truncated file?",
                      r->path, name, (unsigned long long)e->begin, (unsigned long long)e->end,
                      (unsigned long long)data_size);
  return FSDP_OK;
}

static int parse_metadata(fsdp_io_st_reader *r, const cJSON *m) {
  if (!cJSON_IsObject(m))
    return fsdp_error("%s: header: \"__metadata__\" is not a JSON object", r->path);
  r->nmeta = cJSON_GetArraySize(m);
  r->meta = calloc((size_t)(r->nmeta > 0 ? r->nmeta : 1), sizeof *r->meta);
  if (r->meta == NULL) return fsdp_error("%s: out of memory", r->path);
  int i = 0;
  for (const cJSON *kv = m->child; kv != NULL; kv = kv->next, i++) {
    if (!cJSON_IsString(kv))
      return fsdp_error("%s: header: __metadata__ value of '%s' is not a string", r->path,
                        kv->string);
    r->meta[i].key = strdup(kv->string);
    r->meta[i].value = strdup(kv->valuestring);
    if (r->meta[i].key == NULL || r->meta[i].value == NULL)
      return fsdp_error("%s: out of memory", r->path);
    for (int j = 0; j < i; j++)
      if (strcmp(r->meta[j].key, kv->string) == 0)
        return fsdp_error("%s: header: __metadata__ key '%s' appears twice", r->path, kv->string);
  }
  return FSDP_OK;
}

/* The checksum keys of the metadata, attached to their entries. */
static int attach_checksums(fsdp_io_st_reader *r, bool header_checked) {
  size_t plen = strlen(FSDP_IO_CHECKSUM_PREFIX);
  for (int i = 0; i < r->nmeta; i++) {
    const char *key = r->meta[i].key, *value = r->meta[i].value;
    if (strcmp(key, FSDP_IO_HEADER_CHECKSUM_KEY) == 0) {
      if (!header_checked)
        return fsdp_error("%s: header: \"%s\" is not the header's first member or is malformed "
                          "(edited by another tool?): cannot check the header",
                          r->path, FSDP_IO_HEADER_CHECKSUM_KEY);
      continue;
    }
    if (strncmp(key, FSDP_IO_CHECKSUM_PREFIX, plen) != 0) continue;
    const char *name = key + plen;
    fsdp_io_st_entry *e = NULL;
    int lo = 0, hi = r->n - 1;
    while (lo <= hi) {
      int mid = (lo + hi) / 2, c = strcmp(r->e[r->by_name[mid]].name, name);
      if (c == 0) {
        e = &r->e[r->by_name[mid]];
        break;
      }
      if (c < 0) lo = mid + 1;
      else hi = mid - 1;
    }
    if (e == NULL)
      return fsdp_error("%s: header: __metadata__ holds a checksum for tensor '%s', which the "
                        "file does not have",
                        r->path, name);
    if (strlen(value) != 16 || !parse_hex16(value, &e->checksum))
      return fsdp_error("%s: tensor '%s': malformed checksum '%s' (16 lowercase hex digits "
                        "expected)",
                        r->path, name, value);
    e->has_checksum = true;
  }
  for (int i = 0; i < r->n; i++)
    if (r->e[i].has_checksum && !header_checked)
      return fsdp_error("%s: header: the file has tensor checksums but no header checksum (its "
                        "\"%s\" key was damaged or removed)",
                        r->path, FSDP_IO_HEADER_CHECKSUM_KEY);
  return FSDP_OK;
}

/* Every byte of the data section belongs to exactly one tensor. */
static int check_layout(fsdp_io_st_reader *r, uint64_t data_size) {
  int *order = malloc(sizeof *order * (size_t)(r->n > 0 ? r->n : 1));
  if (order == NULL) return fsdp_error("%s: out of memory", r->path);
  for (int i = 0; i < r->n; i++) order[i] = i;
  qsort_r(order, (size_t)r->n, sizeof *order, cmp_by_offsets, r);
  uint64_t pos = 0;
  const char *prev = NULL;
  int rc = FSDP_OK;
  for (int k = 0; k < r->n && rc == FSDP_OK; k++) {
    const fsdp_io_st_entry *e = &r->e[order[k]];
    if (e->begin < pos)
      rc = fsdp_error("%s: tensor '%s': data_offsets [%llu, %llu) overlap those of tensor '%s' "
                      "(which end at %llu)",
                      r->path, e->name, (unsigned long long)e->begin,
                      (unsigned long long)e->end, prev, (unsigned long long)pos);
    else if (e->begin > pos)
      rc = fsdp_error("%s: tensor '%s': hole in the data section: bytes [%llu, %llu) before it "
                      "belong to no tensor",
                      r->path, e->name, (unsigned long long)pos, (unsigned long long)e->begin);
    pos = e->end;
    prev = e->name;
  }
  if (rc == FSDP_OK && pos != data_size)
    rc = fsdp_error("%s: the data section has %llu bytes but its tensors cover %llu (trailing "
                    "bytes after tensor '%s')",
                    r->path, (unsigned long long)data_size, (unsigned long long)pos,
                    prev != NULL ? prev : "(none)");
  free(order);
  return rc;
}

/* Parse and validate the header: the body of open. */
static int parse_header(fsdp_io_st_reader *r) {
  unsigned char len8[8];
  if (r->size < 8)
    return fsdp_error("%s: not a safetensors file: %llu bytes, fewer than the 8-byte header "
                      "length",
                      r->path, (unsigned long long)r->size);
  if (read_at(r, len8, 8, 0, NULL)) return FSDP_ERR;
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | len8[i];
  if (hlen > r->size - 8)
    return fsdp_error("%s: header length field says %llu bytes but only %llu follow it "
                      "(truncated, or not a safetensors file)",
                      r->path, (unsigned long long)hlen, (unsigned long long)(r->size - 8));
  if (hlen > FSDP_IO_ST_MAX_HEADER)
    return fsdp_error("%s: header length field says %llu bytes, over the format's limit of %u",
                      r->path, (unsigned long long)hlen, FSDP_IO_ST_MAX_HEADER);
  if (hlen < 2)
    return fsdp_error("%s: header length field says %llu bytes: too short for a JSON object",
                      r->path, (unsigned long long)hlen);
  r->data_start = 8 + hlen;
  uint64_t data_size = r->size - r->data_start;
  char *text = malloc(hlen + 1);
  if (text == NULL) return fsdp_error("%s: out of memory for a %llu-byte header", r->path,
                                      (unsigned long long)hlen);
  cJSON *root = NULL;
  int rc = FSDP_ERR;
  if (read_at(r, text, hlen, 8, NULL)) goto done;
  text[hlen] = '\0';

  /* The header checksum first: a corrupted header is reported as corrupted, not as whatever
   * the damage happens to look like. */
  size_t plen = strlen(HEADER_PREFIX);
  bool header_checked = false;
  uint64_t stored;
  if (hlen >= plen + 17 && memcmp(text, HEADER_PREFIX, plen) == 0 &&
      parse_hex16(text + plen, &stored) && text[plen + 16] == '"') {
    XXH3_state_t *xs = XXH3_createState();
    if (xs == NULL) {
      fsdp_error("%s: out of memory", r->path);
      goto done;
    }
    XXH3_64bits_reset(xs);
    XXH3_64bits_update(xs, len8, 8);
    XXH3_64bits_update(xs, text, plen);
    XXH3_64bits_update(xs, "0000000000000000", 16);
    XXH3_64bits_update(xs, text + plen + 16, hlen - plen - 16);
    uint64_t computed = XXH3_64bits_digest(xs);
    XXH3_freeState(xs);
    if (computed != stored) {
      fsdp_error("%s: header checksum mismatch (stored %016llx, computed %016llx): the header "
                 "is corrupted",
                 r->path, (unsigned long long)stored, (unsigned long long)computed);
      goto done;
    }
    header_checked = true;
  }

  if (fsdp_io_json_refuse_nul(r->path, "header", text, hlen)) goto done;
  const char *end = NULL;
  root = cJSON_ParseWithLengthOpts(text, hlen, &end, 0);
  if (root == NULL) {
    size_t at = end != NULL && end >= text && end <= text + hlen ? (size_t)(end - text) : 0;
    fsdp_error("%s: header is not valid JSON (error near byte %zu of the header)", r->path, at);
    goto done;
  }
  for (const char *p = end; p < text + hlen; p++)
    if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
      fsdp_error("%s: header: unexpected byte 0x%02x after the JSON object, at byte %zu of the "
                 "header",
                 r->path, (unsigned char)*p, (size_t)(p - text));
      goto done;
    }
  if (!cJSON_IsObject(root)) {
    fsdp_error("%s: header is JSON but not an object", r->path);
    goto done;
  }

  int count = 0;
  const cJSON *meta = NULL;
  for (const cJSON *c = root->child; c != NULL; c = c->next) {
    if (strcmp(c->string, "__metadata__") != 0) {
      count++;
    } else if (meta != NULL) {
      fsdp_error("%s: header: \"__metadata__\" appears twice", r->path);
      goto done;
    } else {
      meta = c;
    }
  }
  r->e = calloc((size_t)(count > 0 ? count : 1), sizeof *r->e);
  r->by_name = malloc(sizeof *r->by_name * (size_t)(count > 0 ? count : 1));
  if (r->e == NULL || r->by_name == NULL) {
    fsdp_error("%s: out of memory", r->path);
    goto done;
  }
  if (meta != NULL && parse_metadata(r, meta)) goto done;
  for (const cJSON *c = root->child; c != NULL; c = c->next) {
    if (c == meta) continue;
    fsdp_io_st_entry *e = &r->e[r->n];
    if ((e->name = strdup(c->string)) == NULL) {
      fsdp_error("%s: out of memory", r->path);
      goto done;
    }
    r->by_name[r->n] = r->n;
    r->n++;
    if (parse_entry(r, e, c, data_size)) goto done;
  }
  qsort_r(r->by_name, (size_t)r->n, sizeof *r->by_name, cmp_by_name, r);
  for (int i = 1; i < r->n; i++)
    if (strcmp(r->e[r->by_name[i - 1]].name, r->e[r->by_name[i]].name) == 0) {
      fsdp_error("%s: tensor '%s' appears twice in the header", r->path,
                 r->e[r->by_name[i]].name);
      goto done;
    }
  if (check_layout(r, data_size)) goto done;
  if (attach_checksums(r, header_checked)) goto done;
  rc = FSDP_OK;
done:
  cJSON_Delete(root);
  free(text);
  return rc;
}

/* ---- open / close ------------------------------------------------------------------------ */

void fsdp_io_st_reader_close(fsdp_io_st_reader *r) {
  if (r == NULL) return;
  if (r->fd >= 0) close(r->fd);
  if (r->e != NULL)
    for (int i = 0; i < r->n; i++) free((char *)r->e[i].name);
  if (r->meta != NULL)
    for (int i = 0; i < r->nmeta; i++) {
      free((char *)r->meta[i].key);
      free((char *)r->meta[i].value);
    }
  free(r->e);
  free(r->by_name);
  free(r->meta);
  free(r->path);
  free(r);
}

static fsdp_io_st_reader *new_reader(const char *name) {
  fsdp_io_st_reader *r = calloc(1, sizeof *r);
  if (r == NULL) return NULL;
  r->fd = -1;
  if ((r->path = strdup(name)) == NULL) {
    free(r);
    return NULL;
  }
  return r;
}

int fsdp_io_st_reader_open(fsdp_io_st_reader **out, const char *path) {
  *out = NULL;
  fsdp_io_st_reader *r = new_reader(path);
  if (r == NULL) return fsdp_error("%s: out of memory", path);
  if (fsdp_io_open_regular(path, &r->fd, &r->size)) goto fail;
  if (parse_header(r)) goto fail;
  *out = r;
  return FSDP_OK;
fail:
  fsdp_io_st_reader_close(r);
  return FSDP_ERR;
}

int fsdp_io_st_reader_open_memory(fsdp_io_st_reader **out, const char *name, const void *data,
                                  size_t size) {
  *out = NULL;
  if (name == NULL) name = "(memory)";
  fsdp_io_st_reader *r = new_reader(name);
  if (r == NULL) return fsdp_error("%s: out of memory", name);
  r->mem = data;
  r->size = size;
  if (size > 0 && data == NULL) {
    fsdp_error("%s: NULL buffer of %zu bytes", name, size);
    fsdp_io_st_reader_close(r);
    return FSDP_ERR;
  }
  if (parse_header(r)) {
    fsdp_io_st_reader_close(r);
    return FSDP_ERR;
  }
  *out = r;
  return FSDP_OK;
}

/* ---- queries -------------------------------------------------------------------------- */

const char *fsdp_io_st_reader_path(const fsdp_io_st_reader *r) { return r->path; }
int fsdp_io_st_reader_count(const fsdp_io_st_reader *r) { return r->n; }

const fsdp_io_st_entry *fsdp_io_st_reader_entry(const fsdp_io_st_reader *r, int i) {
  return i >= 0 && i < r->n ? &r->e[i] : NULL;
}

const fsdp_io_st_entry *fsdp_io_st_reader_find(const fsdp_io_st_reader *r, const char *name) {
  int lo = 0, hi = r->n - 1;
  while (lo <= hi) {
    int mid = lo + (hi - lo) / 2, c = strcmp(r->e[r->by_name[mid]].name, name);
    if (c == 0) return &r->e[r->by_name[mid]];
    if (c < 0) lo = mid + 1;
    else hi = mid - 1;
  }
  fsdp_error("%s: tensor '%s': no such tensor in the file", r->path, name);
  return NULL;
}

int fsdp_io_st_reader_metadata_count(const fsdp_io_st_reader *r) { return r->nmeta; }

fsdp_io_kv fsdp_io_st_reader_metadata_at(const fsdp_io_st_reader *r, int i) {
  if (i < 0 || i >= r->nmeta) return (fsdp_io_kv){NULL, NULL};
  return r->meta[i];
}

const char *fsdp_io_st_reader_metadata_get(const fsdp_io_st_reader *r, const char *key) {
  for (int i = 0; i < r->nmeta; i++)
    if (strcmp(r->meta[i].key, key) == 0) return r->meta[i].value;
  return NULL;
}

/* ---- reading tensors ------------------------------------------------------------------- */

static int checksum_mismatch(const fsdp_io_st_reader *r, const fsdp_io_st_entry *e,
                             uint64_t computed) {
  return fsdp_error("%s: tensor '%s': checksum mismatch (stored %016llx, computed %016llx): its "
                    "data is corrupted",
                    r->path, e->name, (unsigned long long)e->checksum,
                    (unsigned long long)computed);
}

/* The entry `name` with [first, first + count) checked against it; NULL with an error. */
static const fsdp_io_st_entry *find_range(const fsdp_io_st_reader *r, const char *name,
                                          int64_t first, int64_t count) {
  const fsdp_io_st_entry *e = fsdp_io_st_reader_find(r, name);
  if (e == NULL) return NULL;
  if (first < 0 || count < 0 || first > e->numel || count > e->numel - first) {
    fsdp_error("%s: tensor '%s': %lld elements from element %lld are out of range (it has "
               "%lld)",
               r->path, name, (long long)count, (long long)first, (long long)e->numel);
    return NULL;
  }
  return e;
}

/* A BOOL element is one byte holding 0 or 1 (what every reader of the format assumes). */
static int check_bools(const fsdp_io_st_reader *r, const fsdp_io_st_entry *e,
                       const unsigned char *p, size_t n, int64_t first) {
  for (size_t i = 0; i < n; i++)
    if (p[i] > 1)
      return fsdp_error("%s: tensor '%s': BOOL element %lld holds %u, not 0 or 1: the data is "
                        "corrupted or not BOOL",
                        r->path, e->name, (long long)(first + (int64_t)i), p[i]);
  return FSDP_OK;
}

int fsdp_io_st_reader_read(fsdp_io_st_reader *r, void *out, const char *name, int64_t first,
                           int64_t count) {
  const fsdp_io_st_entry *e = find_range(r, name, first, count);
  if (e == NULL) return FSDP_ERR;
  size_t esz = fsdp_io_dtype_size(e->dtype), bytes = (size_t)count * esz;
  if (read_at(r, out, bytes, r->data_start + e->begin + (uint64_t)first * esz, name))
    return FSDP_ERR;
  if (first == 0 && count == e->numel && e->has_checksum) {
    uint64_t h = XXH3_64bits(out, bytes);
    if (h != e->checksum) return checksum_mismatch(r, e, h);
  }
  if (e->dtype == FSDP_IO_BOOL) return check_bools(r, e, out, bytes, first);
  return FSDP_OK;
}

int fsdp_io_st_reader_read_chunks(fsdp_io_st_reader *r, const char *name, int64_t first,
                                  int64_t count, void *buf, size_t buf_bytes,
                                  fsdp_io_st_sink sink, void *ctx) {
  const fsdp_io_st_entry *e = find_range(r, name, first, count);
  if (e == NULL) return FSDP_ERR;
  size_t esz = fsdp_io_dtype_size(e->dtype);
  size_t per = buf_bytes / esz;
  if (per == 0 && count > 0)
    return fsdp_error("%s: tensor '%s': a buffer of %zu bytes holds no %s element", r->path,
                      name, buf_bytes, fsdp_io_dtype_name(e->dtype));
  bool whole = first == 0 && count == e->numel && e->has_checksum;
  XXH3_state_t *xs = whole ? XXH3_createState() : NULL;
  if (whole && xs == NULL) return fsdp_error("%s: tensor '%s': out of memory", r->path, name);
  if (xs != NULL) XXH3_64bits_reset(xs);
  uint64_t off = r->data_start + e->begin + (uint64_t)first * esz;
  int rc = FSDP_OK;
  for (int64_t done = 0; done < count && rc == FSDP_OK;) {
    size_t n = (size_t)(count - done) < per ? (size_t)(count - done) : per;
    rc = read_at(r, buf, n * esz, off + (uint64_t)done * esz, name);
    if (rc == FSDP_OK && xs != NULL) XXH3_64bits_update(xs, buf, n * esz);
    if (rc == FSDP_OK && e->dtype == FSDP_IO_BOOL) rc = check_bools(r, e, buf, n, first + done);
    if (rc == FSDP_OK && sink != NULL) rc = sink(ctx, buf, done, (int64_t)n);
    done += (int64_t)n;
  }
  if (rc == FSDP_OK && xs != NULL) {
    uint64_t h = XXH3_64bits_digest(xs);
    if (h != e->checksum) rc = checksum_mismatch(r, e, h);
  }
  XXH3_freeState(xs);
  return rc;
}

int fsdp_io_st_reader_verify(fsdp_io_st_reader *r, const char *name) {
  const fsdp_io_st_entry *e = fsdp_io_st_reader_find(r, name);
  if (e == NULL) return FSDP_ERR;
  if (!e->has_checksum) return FSDP_OK;
  unsigned char *buf = malloc(CHUNK_BYTES);
  if (buf == NULL) return fsdp_error("%s: tensor '%s': out of memory", r->path, name);
  int rc = fsdp_io_st_reader_read_chunks(r, name, 0, e->numel, buf, CHUNK_BYTES, NULL, NULL);
  free(buf);
  return rc;
}
