/*
 * index.c — the checkpoint index of a sharded checkpoint (io.h, docs/checkpoints.md "Sharded
 * checkpoints"): a JSON document that names one safetensors file per rank and says which
 * flat element ranges of which parameter each file holds. This file checks the document's
 * whole schema before anyone acts on it, so that the loader (lua/fsdp/checkpoint.lua) can
 * compute ranges from it without re-checking, and so that the fuzz target can hold the
 * checker to its promises.
 *
 * The index's own bytes are protected as a rank file's header is (docs/checkpoints.md "The
 * index's checksum"): version 2 starts with a fixed prefix and the XXH3 of the whole file, so
 * the reader finds the checksum without trusting the JSON and checks it before anything else;
 * one flipped bit that keeps the JSON and the schema valid ("lr": 0.003 -> 0.002) would
 * otherwise load and silently change the resumed run. Version 1 indexes (written before the
 * checksum) have none and are read unchecked.
 *
 * What is checked (everything, first error wins; messages name the file and the field, and
 * the parameter where there is one):
 *   the checksum, when the text starts with the prefix (always, for version 2);
 *   format "fsdprun.sharded", version 1 or 2, world_size in [1, 2^20], generation and step
 *   integers >= 0; version 2: index_xxh3 16 lowercase hex digits;
 *   files: exactly world_size objects, files[i].rank == i, name a plain file name (no '/',
 *   not starting with '.', valid UTF-8, at most 255 bytes, names unique), bytes >= 8,
 *   header_xxh3 16 lowercase hex digits;
 *   params: path non-empty, unique, valid UTF-8, without ':' (it separates the state names in
 *   the rank files); shape at most FSDP_MAX_DIMS sizes >= 0 with numel = their product
 *   (overflow-checked, below 2^53); aliases (optional) strings unique across every path and
 *   alias; mask (optional) boolean; dtype (optional, F32 when absent) the stored dtype of its
 *   slices, a tensor dtype as the format names it ("F32", "BF16", "F16", "F64", "I64",
 *   "I32", "U8", "BOOL"); slices {rank in [0, world), first >= 0, count >= 1},
 *   sorted by first, at most one per rank, tiling [0, numel) exactly: a hole, an overlap or
 *   a range past the end is an error naming the parameter and the elements;
 *   optimizer (optional): kind string, step integer >= 0, lr finite number, hyper object,
 *   states array of unique non-empty names without ':';
 *   rng (optional): world_size objects {seed = 16 hex, streams = {name = 16 hex}};
 *   loaders (optional): object of integers >= 0; schedule (optional): object; extra: any;
 *   extra_tensors (optional): the tensors of extra, held by rank 0's file: objects {name
 *   (non-empty, unique), dtype (a tensor dtype as above), shape (as a param's)}.
 * Integers are JSON numbers with integral values in [0, 2^53]. An empty list may also be
 * written as {} (Lua's JSON writer cannot tell an empty array from an empty object).
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "io/io.h"

#define MAX_WORLD (1 << 20)
#define INT_MAX_EXACT 9007199254740992.0 /* 2^53 */

/* An integer-valued number in [lo, 2^53]; false when absent or not one. */
static bool get_int(const cJSON *obj, const char *key, double lo, int64_t *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
  if (!cJSON_IsNumber(v)) return false;
  double d = v->valuedouble;
  if (!(d >= lo) || d > INT_MAX_EXACT || d != floor(d)) return false;
  *out = (int64_t)d;
  return true;
}

static bool is_hex16(const cJSON *v) {
  if (!cJSON_IsString(v) || v->valuestring == NULL || strlen(v->valuestring) != 16) return false;
  for (const char *p = v->valuestring; *p; p++)
    if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'))) return false;
  return true;
}

/* An array, or an empty object: Lua cannot tell an empty array from an empty table, and its
 * JSON writer prints an empty table as {}. Iterating ->child works for both. */
static bool is_list(const cJSON *v) {
  return cJSON_IsArray(v) || (cJSON_IsObject(v) && v->child == NULL);
}

static bool is_text(const cJSON *v) {
  return cJSON_IsString(v) && v->valuestring != NULL && v->valuestring[0] != '\0' &&
         fsdp_io_utf8_valid(v->valuestring, strlen(v->valuestring));
}

/* A stored dtype name that is a tensor dtype ("BF16"). */
static bool is_tensor_dtype(const cJSON *v) {
  fsdp_dtype t;
  int io = cJSON_IsString(v) && v->valuestring != NULL ? fsdp_io_dtype_from_name(v->valuestring)
                                                       : -1;
  return io >= 0 && fsdp_io_dtype_to_tensor((fsdp_io_dtype)io, &t);
}

/* A shape: at most FSDP_MAX_DIMS integers >= 0 whose product is at most 2^53; *numel set. */
static bool shape_numel(const cJSON *shape, double *numel) {
  if (!is_list(shape) || cJSON_GetArraySize(shape) > FSDP_MAX_DIMS) return false;
  double n = 1;
  for (const cJSON *d = shape->child; d != NULL; d = d->next) {
    if (!cJSON_IsNumber(d) || !(d->valuedouble >= 0) || d->valuedouble != floor(d->valuedouble) ||
        d->valuedouble > INT_MAX_EXACT)
      return false;
    n *= d->valuedouble;
    if (n > INT_MAX_EXACT) return false;
  }
  *numel = n;
  return true;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The first name that appears twice in names[0..n) (sorted in place), or NULL. */
static const char *first_duplicate(const char **names, size_t n) {
  qsort(names, n, sizeof *names, cmp_str);
  for (size_t i = 1; i < n; i++)
    if (strcmp(names[i - 1], names[i]) == 0) return names[i];
  return NULL;
}

/* rc, or where it is FSDP_OK an error naming the first of names[0..n) listed twice (as "<what>
 * '<name>'"); frees names */
static int unique_names(int rc, const char **names, int n, const char *name, const char *what) {
  if (rc == FSDP_OK) {
    const char *dup = first_duplicate(names, (size_t)n);
    if (dup) rc = fsdp_error("%s: %s '%s' is listed twice", name, what, dup);
  }
  free(names);
  return rc;
}

static int check_files(const cJSON *doc, const char *name, int64_t world) {
  const cJSON *files = cJSON_GetObjectItemCaseSensitive(doc, "files");
  if (!cJSON_IsArray(files)) return fsdp_error("%s: 'files' must be an array", name);
  int64_t n = cJSON_GetArraySize(files);
  if (n != world)
    return fsdp_error("%s: world_size is %lld but 'files' lists %lld files: the index cannot "
                      "serve its world size (a file per rank)",
                      name, (long long)world, (long long)n);
  const char **names = malloc(sizeof *names * (size_t)(n > 0 ? n : 1));
  if (names == NULL) return fsdp_error("%s: out of memory", name);
  int64_t i = 0;
  int rc = FSDP_OK;
  for (const cJSON *f = files->child; f != NULL; f = f->next, i++) {
    int64_t rank, bytes;
    if (!cJSON_IsObject(f)) {
      rc = fsdp_error("%s: files[%lld] must be an object", name, (long long)i);
      break;
    }
    if (!get_int(f, "rank", 0, &rank) || rank != i) {
      rc = fsdp_error("%s: files[%lld].rank must be %lld", name, (long long)i, (long long)i);
      break;
    }
    const cJSON *fn = cJSON_GetObjectItemCaseSensitive(f, "name");
    if (!is_text(fn) || strchr(fn->valuestring, '/') != NULL || fn->valuestring[0] == '.' ||
        strlen(fn->valuestring) > 255) {
      rc = fsdp_error("%s: files[%lld] (rank %lld): 'name' must be a plain file name in the "
                      "checkpoint folder (no '/', not starting with '.')",
                      name, (long long)i, (long long)i);
      break;
    }
    names[i] = fn->valuestring;
    if (!get_int(f, "bytes", 8, &bytes)) {
      rc = fsdp_error("%s: files[%lld] ('%s'): 'bytes' must be an integer >= 8", name,
                      (long long)i, fn->valuestring);
      break;
    }
    if (!is_hex16(cJSON_GetObjectItemCaseSensitive(f, "header_xxh3"))) {
      rc = fsdp_error("%s: files[%lld] ('%s'): 'header_xxh3' must be 16 lowercase hex digits",
                      name, (long long)i, fn->valuestring);
      break;
    }
  }
  if (rc == FSDP_OK) {
    const char *dup = first_duplicate(names, (size_t)n);
    if (dup != NULL) rc = fsdp_error("%s: file '%s' is listed for two ranks", name, dup);
  }
  free(names);
  return rc;
}

/* One parameter's shape, numel and slices. */
static int check_param(const cJSON *p, const char *name, int64_t index, int64_t world,
                       unsigned char *rank_seen) {
  const char *path = cJSON_GetObjectItemCaseSensitive(p, "path")->valuestring;
  const cJSON *shape = cJSON_GetObjectItemCaseSensitive(p, "shape");
  if (!is_list(shape) || cJSON_GetArraySize(shape) > FSDP_MAX_DIMS)
    return fsdp_error("%s: param '%s': 'shape' must be an array of at most %d sizes", name,
                      path, FSDP_MAX_DIMS);
  double numel = 1;
  for (const cJSON *d = shape->child; d != NULL; d = d->next) {
    if (!cJSON_IsNumber(d) || !(d->valuedouble >= 0) || d->valuedouble != floor(d->valuedouble) ||
        d->valuedouble > INT_MAX_EXACT)
      return fsdp_error("%s: param '%s': 'shape' must hold integers >= 0", name, path);
    numel *= d->valuedouble;
    if (numel > INT_MAX_EXACT)
      return fsdp_error("%s: param '%s': shape has more than 2^53 elements", name, path);
  }
  int64_t n;
  if (!get_int(p, "numel", 0, &n) || (double)n != numel)
    return fsdp_error("%s: param '%s': 'numel' must be the product of the shape (%.0f)", name,
                      path, numel);
  const cJSON *mask = cJSON_GetObjectItemCaseSensitive(p, "mask");
  if (mask != NULL && !cJSON_IsBool(mask))
    return fsdp_error("%s: param '%s': 'mask' must be true or false", name, path);
  const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(p, "dtype");
  if (dtype != NULL && !is_tensor_dtype(dtype))
    return fsdp_error("%s: param '%s': 'dtype' must be one of F32, BF16, F16, F64, I64, I32, U8, "
                      "BOOL",
                      name, path);
  const cJSON *slices = cJSON_GetObjectItemCaseSensitive(p, "slices");
  if (!is_list(slices))
    return fsdp_error("%s: param '%s': 'slices' must be an array", name, path);
  memset(rank_seen, 0, (size_t)world);
  int64_t next = 0, k = 0;
  for (const cJSON *s = slices->child; s != NULL; s = s->next, k++) {
    int64_t rank, first, count;
    if (!cJSON_IsObject(s) || !get_int(s, "rank", 0, &rank) || rank >= world ||
        !get_int(s, "first", 0, &first) || !get_int(s, "count", 1, &count))
      return fsdp_error("%s: param '%s': slices[%lld] must be {rank (0 to %lld), first >= 0, "
                        "count >= 1}",
                        name, path, (long long)k, (long long)(world - 1));
    if (rank_seen[rank])
      return fsdp_error("%s: param '%s': rank %lld holds two slices", name, path,
                        (long long)rank);
    rank_seen[rank] = 1;
    if (first > next)
      return fsdp_error("%s: param '%s': no rank holds elements [%lld, %lld) (slices must "
                        "cover the parameter, in order)",
                        name, path, (long long)next, (long long)first);
    if (first < next)
      return fsdp_error("%s: param '%s': slice of rank %lld starts at element %lld, inside "
                        "the previous slice (which ends at %lld)",
                        name, path, (long long)rank, (long long)first, (long long)next);
    if ((double)first + (double)count > (double)n)
      return fsdp_error("%s: param '%s': slice of rank %lld ends at element %lld, past the "
                        "parameter's %lld elements",
                        name, path, (long long)rank, (long long)(first + count), (long long)n);
    next = first + count;
  }
  if (next != n)
    return fsdp_error("%s: param '%s': no rank holds elements [%lld, %lld) (slices must cover "
                      "the parameter)",
                      name, path, (long long)next, (long long)n);
  (void)index;
  return FSDP_OK;
}

static int check_params(const cJSON *doc, const char *name, int64_t world) {
  const cJSON *params = cJSON_GetObjectItemCaseSensitive(doc, "params");
  if (!is_list(params)) return fsdp_error("%s: 'params' must be an array", name);
  /* every path and alias, for the uniqueness check */
  size_t cap = 16, nn = 0;
  const char **names = malloc(sizeof *names * cap);
  unsigned char *rank_seen = malloc((size_t)world);
  int rc = FSDP_OK;
  if (names == NULL || rank_seen == NULL) {
    rc = fsdp_error("%s: out of memory", name);
    goto done;
  }
  int64_t i = 0;
  for (const cJSON *p = params->child; p != NULL; p = p->next, i++) {
    if (!cJSON_IsObject(p)) {
      rc = fsdp_error("%s: params[%lld] must be an object", name, (long long)i);
      goto done;
    }
    const cJSON *path = cJSON_GetObjectItemCaseSensitive(p, "path");
    if (!is_text(path) || strchr(path->valuestring, ':') != NULL) {
      rc = fsdp_error("%s: params[%lld]: 'path' must be a non-empty UTF-8 string without ':'",
                      name, (long long)i);
      goto done;
    }
    if (check_param(p, name, i, world, rank_seen)) {
      rc = FSDP_ERR;
      goto done;
    }
    const cJSON *aliases = cJSON_GetObjectItemCaseSensitive(p, "aliases");
    if (aliases != NULL && !is_list(aliases)) {
      rc = fsdp_error("%s: param '%s': 'aliases' must be an array of paths", name,
                      path->valuestring);
      goto done;
    }
    size_t want = nn + 1 + (size_t)(aliases ? cJSON_GetArraySize(aliases) : 0);
    if (want > cap) {
      while (cap < want) cap *= 2;
      const char **grown = realloc(names, sizeof *names * cap);
      if (grown == NULL) {
        rc = fsdp_error("%s: out of memory", name);
        goto done;
      }
      names = grown;
    }
    names[nn++] = path->valuestring;
    for (const cJSON *a = aliases ? aliases->child : NULL; a != NULL; a = a->next) {
      if (!is_text(a) || strchr(a->valuestring, ':') != NULL) {
        rc = fsdp_error("%s: param '%s': 'aliases' must hold non-empty paths without ':'",
                        name, path->valuestring);
        goto done;
      }
      names[nn++] = a->valuestring;
    }
  }
  const char *dup = first_duplicate(names, nn);
  if (dup != NULL) rc = fsdp_error("%s: param path '%s' appears twice", name, dup);
done:
  free(names);
  free(rank_seen);
  return rc;
}

static int check_optimizer(const cJSON *doc, const char *name) {
  const cJSON *o = cJSON_GetObjectItemCaseSensitive(doc, "optimizer");
  if (o == NULL) return FSDP_OK;
  if (!cJSON_IsObject(o)) return fsdp_error("%s: 'optimizer' must be an object", name);
  int64_t step;
  const cJSON *lr = cJSON_GetObjectItemCaseSensitive(o, "lr");
  if (!is_text(cJSON_GetObjectItemCaseSensitive(o, "kind")))
    return fsdp_error("%s: optimizer: 'kind' must be a name", name);
  if (!get_int(o, "step", 0, &step))
    return fsdp_error("%s: optimizer: 'step' must be an integer >= 0", name);
  if (!cJSON_IsNumber(lr) || !isfinite(lr->valuedouble))
    return fsdp_error("%s: optimizer: 'lr' must be a number", name);
  if (!cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(o, "hyper")))
    return fsdp_error("%s: optimizer: 'hyper' must be an object", name);
  const cJSON *states = cJSON_GetObjectItemCaseSensitive(o, "states");
  if (!is_list(states))
    return fsdp_error("%s: optimizer: 'states' must be an array of names", name);
  int n = cJSON_GetArraySize(states), i = 0;
  const char **names = malloc(sizeof *names * (size_t)(n > 0 ? n : 1));
  if (names == NULL) return fsdp_error("%s: out of memory", name);
  int rc = FSDP_OK;
  for (const cJSON *s = states->child; s != NULL; s = s->next, i++) {
    if (!is_text(s) || strchr(s->valuestring, ':') != NULL || strcmp(s->valuestring, "mask") == 0) {
      rc = fsdp_error("%s: optimizer: states[%d] must be a name without ':' (and not 'mask')",
                      name, i);
      break;
    }
    names[i] = s->valuestring;
  }
  return unique_names(rc, names, n, name, "optimizer: state");
}

static int check_extra_tensors(const cJSON *doc, const char *name) {
  const cJSON *xs = cJSON_GetObjectItemCaseSensitive(doc, "extra_tensors");
  if (xs == NULL) return FSDP_OK;
  if (!is_list(xs)) return fsdp_error("%s: 'extra_tensors' must be an array", name);
  int n = cJSON_GetArraySize(xs), i = 0;
  const char **names = malloc(sizeof *names * (size_t)(n > 0 ? n : 1));
  if (names == NULL) return fsdp_error("%s: out of memory", name);
  int rc = FSDP_OK;
  for (const cJSON *x = xs->child; x != NULL; x = x->next, i++) {
    const cJSON *xn = cJSON_GetObjectItemCaseSensitive(x, "name");
    double numel;
    if (!cJSON_IsObject(x) || !is_text(xn) ||
        !is_tensor_dtype(cJSON_GetObjectItemCaseSensitive(x, "dtype")) ||
        !shape_numel(cJSON_GetObjectItemCaseSensitive(x, "shape"), &numel)) {
      rc = fsdp_error("%s: extra_tensors[%d] must be {name, dtype (F32, BF16, F16, F64, I64, "
                      "I32, U8 or BOOL), shape (sizes >= 0)}",
                      name, i);
      break;
    }
    names[i] = xn->valuestring;
  }
  return unique_names(rc, names, n, name, "extra tensor");
}

static int check_rng(const cJSON *doc, const char *name, int64_t world) {
  const cJSON *rng = cJSON_GetObjectItemCaseSensitive(doc, "rng");
  if (rng == NULL) return FSDP_OK;
  if (!cJSON_IsArray(rng) || cJSON_GetArraySize(rng) != world)
    return fsdp_error("%s: 'rng' must be an array of %lld states (one per rank)", name,
                      (long long)world);
  int64_t i = 0;
  for (const cJSON *r = rng->child; r != NULL; r = r->next, i++) {
    const cJSON *streams = cJSON_GetObjectItemCaseSensitive(r, "streams");
    if (!cJSON_IsObject(r) || !is_hex16(cJSON_GetObjectItemCaseSensitive(r, "seed")) ||
        !cJSON_IsObject(streams))
      return fsdp_error("%s: rng[%lld] must be {seed = 16 hex digits, streams = {...}}", name,
                        (long long)i);
    for (const cJSON *s = streams->child; s != NULL; s = s->next)
      if (!is_hex16(s) || s->string == NULL || s->string[0] == '\0')
        return fsdp_error("%s: rng[%lld].streams: each stream must be 16 hex digits", name,
                          (long long)i);
  }
  return FSDP_OK;
}

int fsdp_io_index_check(const cJSON *doc, const char *name) {
  if (name == NULL) name = "(index)";
  if (!cJSON_IsObject(doc)) return fsdp_error("%s: a checkpoint index must be a JSON object", name);
  const cJSON *format = cJSON_GetObjectItemCaseSensitive(doc, "format");
  if (!cJSON_IsString(format) || format->valuestring == NULL ||
      strcmp(format->valuestring, FSDP_IO_INDEX_FORMAT) != 0)
    return fsdp_error("%s: not a sharded checkpoint index ('format' is not \"%s\")", name,
                      FSDP_IO_INDEX_FORMAT);
  int64_t version, world, v;
  if (!get_int(doc, "version", 0, &version) || version < 1 || version > FSDP_IO_INDEX_VERSION)
    return fsdp_error("%s: index version must be 1 or %d (the versions this build reads)", name,
                      FSDP_IO_INDEX_VERSION);
  if (version >= 2 && !is_hex16(cJSON_GetObjectItemCaseSensitive(doc, FSDP_IO_INDEX_CHECKSUM_KEY)))
    return fsdp_error("%s: '%s' must be 16 lowercase hex digits (the index's checksum)", name,
                      FSDP_IO_INDEX_CHECKSUM_KEY);
  if (!get_int(doc, "world_size", 1, &world) || world > MAX_WORLD)
    return fsdp_error("%s: 'world_size' must be an integer from 1 to %d", name, MAX_WORLD);
  if (!get_int(doc, "generation", 0, &v))
    return fsdp_error("%s: 'generation' must be an integer >= 0", name);
  if (!get_int(doc, "step", 0, &v)) return fsdp_error("%s: 'step' must be an integer >= 0", name);
  if (check_files(doc, name, world) || check_params(doc, name, world) ||
      check_optimizer(doc, name) || check_rng(doc, name, world) ||
      check_extra_tensors(doc, name))
    return FSDP_ERR;
  const cJSON *loaders = cJSON_GetObjectItemCaseSensitive(doc, "loaders");
  if (loaders != NULL) {
    if (!cJSON_IsObject(loaders)) return fsdp_error("%s: 'loaders' must be an object", name);
    for (const cJSON *l = loaders->child; l != NULL; l = l->next)
      if (!cJSON_IsNumber(l) || !(l->valuedouble >= 0) || l->valuedouble != floor(l->valuedouble) ||
          l->valuedouble > INT_MAX_EXACT)
        return fsdp_error("%s: loaders.%s must be an integer >= 0 (a cursor)", name,
                          l->string ? l->string : "?");
  }
  const cJSON *schedule = cJSON_GetObjectItemCaseSensitive(doc, "schedule");
  if (schedule != NULL && !cJSON_IsObject(schedule))
    return fsdp_error("%s: 'schedule' must be an object", name);
  return FSDP_OK;
}

/* ---- the checksum ------------------------------------------------------------------------ */

#define PREFIX_LEN (sizeof FSDP_IO_INDEX_PREFIX - 1)

static bool parse_hex16(const char *s, uint64_t *out) {
  uint64_t v = 0;
  for (int i = 0; i < 16; i++) {
    char c = s[i];
    if (c >= '0' && c <= '9') v = v << 4 | (uint64_t)(c - '0');
    else if (c >= 'a' && c <= 'f') v = v << 4 | (uint64_t)(c - 'a' + 10);
    else return false;
  }
  *out = v;
  return true;
}

/* true when text[0..size) has the prefix, 16 characters and '"' (the digits are not checked) */
static bool has_prefix(const char *text, size_t size) {
  return text != NULL && size >= PREFIX_LEN + 17 &&
         memcmp(text, FSDP_IO_INDEX_PREFIX, PREFIX_LEN) == 0 && text[PREFIX_LEN + 16] == '"';
}

/* XXH3 of text[0..size) with the 16 digits after the prefix read as '0's (has_prefix holds) */
static int checksum_of(const char *text, size_t size, const char *name, uint64_t *out) {
  XXH3_state_t *xs = XXH3_createState();
  if (xs == NULL) return fsdp_error("%s: out of memory", name);
  XXH3_64bits_reset(xs);
  XXH3_64bits_update(xs, text, PREFIX_LEN);
  XXH3_64bits_update(xs, "0000000000000000", 16);
  XXH3_64bits_update(xs, text + PREFIX_LEN + 16, size - PREFIX_LEN - 16);
  *out = XXH3_64bits_digest(xs);
  XXH3_freeState(xs);
  return FSDP_OK;
}

int fsdp_io_index_stamp(char *text, size_t size, const char *name) {
  if (name == NULL) name = "(index)";
  if (!has_prefix(text, size))
    return fsdp_error("%s: the index text does not start with its checksum member (%s)", name,
                      FSDP_IO_INDEX_CHECKSUM_KEY);
  uint64_t h = 0;
  if (checksum_of(text, size, name, &h)) return FSDP_ERR;
  char digits[17];
  snprintf(digits, sizeof digits, "%016llx", (unsigned long long)h);
  memcpy(text + PREFIX_LEN, digits, 16);
  return FSDP_OK;
}

/* The checksum at the start of text, checked; *stamped says whether there was one. Looked for
 * at its fixed place, before the JSON is parsed: a damaged index is reported as damaged, not as
 * whatever the damage happens to look like. */
static int verify_checksum(const char *text, size_t size, const char *name, bool *stamped) {
  *stamped = false;
  if (text == NULL || size < PREFIX_LEN || memcmp(text, FSDP_IO_INDEX_PREFIX, PREFIX_LEN) != 0)
    return FSDP_OK;
  uint64_t stored, computed = 0;
  if (!has_prefix(text, size) || !parse_hex16(text + PREFIX_LEN, &stored))
    return fsdp_error("%s: the index's checksum (its first member, '%s') is not 16 lowercase "
                      "hex digits: the index is corrupted",
                      name, FSDP_IO_INDEX_CHECKSUM_KEY);
  if (checksum_of(text, size, name, &computed)) return FSDP_ERR;
  if (computed != stored)
    return fsdp_error("%s: index checksum mismatch (stored %016llx, computed %016llx): the index "
                      "is corrupted",
                      name, (unsigned long long)stored, (unsigned long long)computed);
  *stamped = true;
  return FSDP_OK;
}

int fsdp_io_index_parse(cJSON **out, const char *name, const char *text, size_t size) {
  *out = NULL;
  if (name == NULL) name = "(index)";
  bool stamped;
  if (verify_checksum(text, size, name, &stamped)) return FSDP_ERR;
  if (fsdp_io_json_parse(out, name, text, size)) return FSDP_ERR;
  /* a version 2 index without the checksum at its start: before the schema, which whatever
   * rewrote it may have broken too */
  int rc = FSDP_OK;
  int64_t version = 0;
  if (cJSON_IsObject(*out) && get_int(*out, "version", 0, &version) && version >= 2 &&
      version <= FSDP_IO_INDEX_VERSION && !stamped)
    rc = fsdp_error("%s: an index of version %lld starts with its checksum ('%s', the first "
                    "member), this one does not: it was damaged, or rewritten by another "
                    "program (fsdp.core.ckpt_index_write writes an index with its checksum)",
                    name, (long long)version, FSDP_IO_INDEX_CHECKSUM_KEY);
  if (rc == FSDP_OK) rc = fsdp_io_index_check(*out, name);
  if (rc != FSDP_OK) {
    cJSON_Delete(*out);
    *out = NULL;
  }
  return rc;
}

int fsdp_io_index_write(const char *path, const cJSON *doc) {
  if (doc == NULL) return fsdp_error("%s: no JSON document to write", path);
  if (!cJSON_IsObject(doc)) return fsdp_io_index_check(doc, path);
  /* the checksum first (a placeholder until the text is known), then the version, then doc's
   * other members, borrowed */
  cJSON *top = cJSON_CreateObject();
  bool ok = top != NULL &&
            cJSON_AddStringToObject(top, FSDP_IO_INDEX_CHECKSUM_KEY, "0000000000000000") &&
            cJSON_AddNumberToObject(top, "version", FSDP_IO_INDEX_VERSION);
  for (cJSON *c = doc->child; ok && c != NULL; c = c->next) {
    if (c->string == NULL || strcmp(c->string, FSDP_IO_INDEX_CHECKSUM_KEY) == 0 ||
        strcmp(c->string, "version") == 0)
      continue;
    ok = cJSON_AddItemReferenceToObject(top, c->string, c);
  }
  char *text = ok ? cJSON_Print(top) : NULL;
  cJSON_Delete(top);
  if (text == NULL) return fsdp_error("%s: cannot print the index (out of memory)", path);
  /* the file's bytes: the text and a final newline, all covered by the checksum */
  size_t n = strlen(text);
  char *bytes = malloc(n + 2);
  if (bytes == NULL) {
    cJSON_free(text);
    return fsdp_error("%s: out of memory", path);
  }
  memcpy(bytes, text, n);
  cJSON_free(text);
  bytes[n++] = '\n';
  bytes[n] = '\0';
  /* checked as the text a reader will parse (numbers may be raw text in doc), checksum too */
  cJSON *parsed = NULL;
  int rc = fsdp_io_index_stamp(bytes, n, path);
  if (rc == FSDP_OK) rc = fsdp_io_index_parse(&parsed, path, bytes, n);
  cJSON_Delete(parsed);
  fsdp_io_atomic *f = NULL;
  if (rc == FSDP_OK) rc = fsdp_io_atomic_open(&f, path);
  if (rc == FSDP_OK) {
    if (fsdp_io_atomic_write(f, bytes, n)) {
      fsdp_io_atomic_abort(f);
      rc = FSDP_ERR;
    } else {
      rc = fsdp_io_atomic_commit(f);
    }
  }
  free(bytes);
  return rc;
}

int fsdp_io_index_read(const char *path, cJSON **out) {
  *out = NULL;
  char *text;
  size_t size;
  if (fsdp_io_text_read(path, &text, &size)) return FSDP_ERR;
  int rc = fsdp_io_index_parse(out, path, text, size);
  free(text);
  return rc;
}
