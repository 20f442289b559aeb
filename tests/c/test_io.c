/*
 * test_io.c — the io layer (src/io): atomic files (commit, abort, injected faults, the
 * previous file left intact, no temporaries left behind), the safetensors writer and reader
 * (round trip, an independent parse of the written bytes, range reads, every validation error
 * on hand-made and damaged files, including a flip of every single header byte), tensors of
 * every dtype through files (bit-exact round trips, conversions on load, a device without host
 * memory staged through bounded pieces), the JSON helper, the sharded checkpoint index check (a
 * valid index and one defect at a time) and the folder helpers.
 *
 * Each test works in a fresh folder under $TMPDIR (or /tmp) and removes it.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <cjson/cJSON.h>
#include <xxhash.h>

#include "io/io.h"
#include "kernels/kernels.h"

/* ---- helpers ------------------------------------------------------------------------------ */

typedef struct fixture {
  char dir[256];
} fixture;

static int setup_dir(void **state) {
  fixture *fx = calloc(1, sizeof *fx);
  if (fx == NULL) return -1;
  const char *tmp = getenv("TMPDIR");
  snprintf(fx->dir, sizeof fx->dir, "%s/fsdp_test_io.XXXXXX", tmp != NULL ? tmp : "/tmp");
  if (mkdtemp(fx->dir) == NULL) {
    free(fx);
    return -1;
  }
  fsdp_io_fault_set(FSDP_IO_FAULT_NONE, 0, 0);
  *state = fx;
  return 0;
}

/* The folder holds plain files (and maybe one subfolder of plain files) only. */
static void remove_tree(const char *dir) {
  DIR *d = opendir(dir);
  if (d == NULL) return;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    char p[512];
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    struct stat st;
    if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode)) {
      chmod(p, 0700);
      remove_tree(p);
    } else {
      unlink(p);
    }
  }
  closedir(d);
  rmdir(dir);
}

static int teardown_dir(void **state) {
  fixture *fx = *state;
  fsdp_io_fault_set(FSDP_IO_FAULT_NONE, 0, 0);
  remove_tree(fx->dir);
  free(fx);
  return 0;
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, setup_dir, teardown_dir)

static char *path_in(const fixture *fx, const char *name) {
  static _Thread_local char buf[4][1024];
  static _Thread_local int k;
  char *p = buf[k++ % 4];
  snprintf(p, 1024, "%s/%s", fx->dir, name);
  return p;
}

static void expect_error(int rc, const char *needle) {
  assert_int_equal(rc, FSDP_ERR);
  if (strstr(fsdp_error_msg(), needle) == NULL)
    fail_msg("error message \"%s\" does not contain \"%s\"", fsdp_error_msg(), needle);
}

static void expect_msg_has(const char *needle) {
  if (strstr(fsdp_error_msg(), needle) == NULL)
    fail_msg("error message \"%s\" does not contain \"%s\"", fsdp_error_msg(), needle);
}

/* The whole file into a malloc'd buffer. */
static unsigned char *slurp(const char *path, size_t *size) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *buf = malloc((size_t)n + 1);
  assert_non_null(buf);
  assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
  fclose(f);
  *size = (size_t)n;
  return buf;
}

static void spit(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(data, 1, n, f), n);
  fclose(f);
}

/* A safetensors file made by hand: 8-byte length, `json` as given (no padding), data. */
static void write_raw(const char *path, const char *json, const void *data, size_t ndata) {
  size_t n = strlen(json);
  unsigned char *buf = malloc(8 + n + ndata + 1);
  assert_non_null(buf);
  for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)n >> (8 * i));
  memcpy(buf + 8, json, n);
  if (ndata) memcpy(buf + 8 + n, data, ndata);
  spit(path, buf, 8 + n + ndata);
  free(buf);
}

/* Names of files in dir containing ".tmp." (leftover temporaries). */
static int count_temps(const char *dir) {
  DIR *d = opendir(dir);
  assert_non_null(d);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strstr(e->d_name, ".tmp.") != NULL) n++;
  closedir(d);
  return n;
}

static bool exists(const char *path) { return access(path, F_OK) == 0; }

static void fill(float *x, int64_t n, float base) {
  for (int64_t i = 0; i < n; i++) x[i] = base + 0.25f * (float)i;
}

/* The standard small model: a (2, 3), b scalar, c (0,), d (4, 1, 2), e (1000). */
#define NENT 5
static const fsdp_io_st_entry ENTRIES[NENT] = {
    {.name = "a", .ndim = 2, .shape = {2, 3}},
    {.name = "b", .ndim = 0},
    {.name = "c", .ndim = 1, .shape = {0}},
    {.name = "layer.0/w \"quoted\"\tü", .ndim = 3, .shape = {4, 1, 2}},
    {.name = "e", .ndim = 1, .shape = {1000}},
};
static const int64_t NUMEL[NENT] = {6, 1, 0, 8, 1000};
static const fsdp_io_kv META[2] = {{"format", "pt"}, {"note \"x\"\n", "välue"}};

static float *model_data(int i) {
  static float data[NENT][1000];
  fill(data[i], NUMEL[i], (float)(i * 100));
  return data[i];
}

/* Write the standard model to path, e in three pieces (a shard per call). */
static int write_model(const char *path) {
  fsdp_io_st_writer *w;
  if (fsdp_io_st_writer_open(&w, path, ENTRIES, NENT, META, 2)) return FSDP_ERR;
  int rc = fsdp_io_st_writer_write(w, "a", model_data(0), 6);
  rc = rc ? rc : fsdp_io_st_writer_write(w, "b", model_data(1), 1);
  rc = rc ? rc : fsdp_io_st_writer_write(w, ENTRIES[3].name, model_data(3), 8);
  rc = rc ? rc : fsdp_io_st_writer_write(w, "e", model_data(4), 300);
  rc = rc ? rc : fsdp_io_st_writer_write(w, "e", model_data(4) + 300, 0);
  rc = rc ? rc : fsdp_io_st_writer_write(w, "e", model_data(4) + 300, 400);
  rc = rc ? rc : fsdp_io_st_writer_write(w, "e", model_data(4) + 700, 300);
  if (rc) {
    fsdp_io_st_writer_abort(w);
    return rc;
  }
  return fsdp_io_st_writer_commit(w);
}

/* ---- safetensors: round trip and independent parse ----------------------------------------- */

static void test_round_trip(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "model.safetensors");
  assert_int_equal(write_model(path), FSDP_OK);
  assert_int_equal(count_temps(fx->dir), 0);

  fsdp_io_st_reader *r;
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  assert_string_equal(fsdp_io_st_reader_path(r), path);
  assert_int_equal(fsdp_io_st_reader_count(r), NENT);
  for (int i = 0; i < NENT; i++) {
    const fsdp_io_st_entry *e = fsdp_io_st_reader_entry(r, i);
    assert_string_equal(e->name, ENTRIES[i].name); /* header order = given order */
    assert_int_equal(e->dtype, FSDP_IO_F32);
    assert_int_equal(e->ndim, ENTRIES[i].ndim);
    for (int d = 0; d < e->ndim; d++) assert_int_equal(e->shape[d], ENTRIES[i].shape[d]);
    assert_int_equal(e->numel, NUMEL[i]);
    assert_int_equal(e->end - e->begin, (uint64_t)NUMEL[i] * 4);
    assert_true(e->has_checksum);
    assert_ptr_equal(fsdp_io_st_reader_find(r, ENTRIES[i].name), e);
    float out[1000];
    memset(out, 0xff, sizeof out);
    assert_int_equal(fsdp_io_st_reader_read(r, out, e->name, 0, e->numel), FSDP_OK);
    assert_memory_equal(out, model_data(i), (size_t)NUMEL[i] * 4);
    assert_int_equal(fsdp_io_st_reader_verify(r, e->name), FSDP_OK);
  }
  assert_null(fsdp_io_st_reader_entry(r, NENT));
  assert_null(fsdp_io_st_reader_find(r, "nope"));
  expect_msg_has(path);
  expect_msg_has("'nope'");
  /* user metadata, in order, then the writer's checksum keys */
  assert_int_equal(fsdp_io_st_reader_metadata_count(r), 1 + 2 + NENT);
  assert_string_equal(fsdp_io_st_reader_metadata_at(r, 0).key, FSDP_IO_HEADER_CHECKSUM_KEY);
  assert_string_equal(fsdp_io_st_reader_metadata_at(r, 1).key, "format");
  assert_string_equal(fsdp_io_st_reader_metadata_at(r, 2).key, "note \"x\"\n");
  assert_string_equal(fsdp_io_st_reader_metadata_get(r, "note \"x\"\n"), "välue");
  assert_null(fsdp_io_st_reader_metadata_get(r, "absent"));
  assert_null(fsdp_io_st_reader_metadata_at(r, 99).key);
  fsdp_io_st_reader_close(r);
  fsdp_io_st_reader_close(NULL);
}

/* Bit patterns for dtype dt: floats include NaNs with payloads, infinities, -0 and
 * subnormals; bool is 0/1. Deterministic. */
static void fill_bits(void *p, fsdp_dtype dt, int64_t n, uint64_t seed) {
  unsigned char *b = p;
  size_t es = fsdp_dtype_size(dt);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    if (dt == FSDP_DTYPE_BOOL) {
      b[i] = (unsigned char)(x & 1);
    } else {
      memcpy(b + (size_t)i * es, &x, es);
    }
  }
  if (dt == FSDP_DTYPE_F32 && n >= 4) {
    const uint32_t sp[4] = {0x7FC00001u, 0xFF800000u, 0x80000000u, 0x00000001u};
    memcpy(p, sp, sizeof sp);
  }
}

/* What any safetensors reader does (u64 LE length, JSON, data), with cJSON and xxHash only:
 * the file at path holds entries e[0..n) in order, with the dtype names given, data[i] as
 * their bytes, checksums over exactly those bytes and a header checksum. Returns the parsed
 * __metadata__ (owned by *root) for further checks. */
static const cJSON *parse_independently(const char *path, const fsdp_io_st_entry *e,
                                        const char *const *dtype_names, const size_t *esize,
                                        const void *const *data_of, int n, cJSON **root_out,
                                        unsigned char **buf_out) {
  size_t size;
  unsigned char *buf = slurp(path, &size);
  assert_true(size >= 8);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | buf[i];
  assert_true(8 + hlen <= size);
  assert_int_equal(hlen % 8, 0);
  assert_int_equal(buf[8], '{');
  const char *json = (const char *)buf + 8;
  size_t jend = hlen;
  while (jend > 0 && json[jend - 1] == ' ') jend--; /* padding is spaces only */
  assert_int_equal(json[jend - 1], '}');
  assert_true(fsdp_io_utf8_valid(json, hlen));
  cJSON *root = cJSON_ParseWithLength(json, jend);
  assert_non_null(root);
  const unsigned char *data = buf + 8 + hlen;
  uint64_t data_size = size - 8 - hlen;
  const cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "__metadata__");
  assert_true(cJSON_IsObject(meta));
  for (const cJSON *kv = meta->child; kv; kv = kv->next) assert_true(cJSON_IsString(kv));
  assert_int_equal(cJSON_GetArraySize(root), 1 + n);
  uint64_t pos = 0;
  int i = 0;
  for (const cJSON *t = root->child; t; t = t->next) {
    if (t == meta) continue;
    assert_string_equal(t->string, e[i].name);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(t, "dtype")->valuestring,
                        dtype_names[i]);
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(t, "shape");
    assert_int_equal(cJSON_GetArraySize(shape), e[i].ndim);
    uint64_t numel = 1;
    for (int d = 0; d < e[i].ndim; d++) {
      assert_int_equal((int64_t)cJSON_GetArrayItem(shape, d)->valuedouble, e[i].shape[d]);
      numel *= (uint64_t)e[i].shape[d];
    }
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(t, "data_offsets");
    uint64_t b = (uint64_t)cJSON_GetArrayItem(off, 0)->valuedouble;
    uint64_t end = (uint64_t)cJSON_GetArrayItem(off, 1)->valuedouble;
    assert_int_equal(b, pos); /* contiguous, in entry order, no holes */
    assert_int_equal(end - b, numel * esize[i]);
    if (end > b) assert_memory_equal(data + b, data_of[i], end - b);
    /* the checksum key is XXH3_64bits (seed 0) of exactly these bytes */
    char key[128], hex[17];
    snprintf(key, sizeof key, "%s%s", FSDP_IO_CHECKSUM_PREFIX, e[i].name);
    const cJSON *sum = cJSON_GetObjectItemCaseSensitive(meta, key);
    assert_true(cJSON_IsString(sum));
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH3_64bits(data + b, end - b));
    assert_string_equal(sum->valuestring, hex);
    pos = end;
    i++;
  }
  assert_int_equal(i, n);
  assert_int_equal(pos, data_size); /* nothing after the last tensor */
  /* the header checksum: the first member, over length + JSON with its own digits zeroed */
  const char *prefix = "{\"__metadata__\":{\"" FSDP_IO_HEADER_CHECKSUM_KEY "\":\"";
  assert_memory_equal(json, prefix, strlen(prefix));
  char stored[17];
  memcpy(stored, json + strlen(prefix), 16);
  stored[16] = '\0';
  memset((char *)json + strlen(prefix), '0', 16);
  char hex[17];
  snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH3_64bits(buf, 8 + hlen));
  assert_string_equal(stored, hex);
  *root_out = root;
  *buf_out = buf;
  return meta;
}

static void test_independent_parse(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "model.safetensors");
  assert_int_equal(write_model(path), FSDP_OK);
  const char *names[NENT];
  size_t sizes[NENT];
  const void *datas[NENT];
  for (int i = 0; i < NENT; i++) names[i] = "F32", sizes[i] = 4, datas[i] = model_data(i);
  cJSON *root;
  unsigned char *buf;
  const cJSON *meta = parse_independently(path, ENTRIES, names, sizes, datas, NENT, &root, &buf);
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(meta, "format")->valuestring, "pt");
  assert_string_equal(cJSON_GetObjectItemCaseSensitive(meta, "note \"x\"\n")->valuestring,
                      "välue");
  cJSON_Delete(root);
  free(buf);

  /* every tensor dtype, written from tensors: the format's names, sizes and bytes as they are
   * in memory (little-endian IEEE / two's complement, bool 0/1) */
  static const char *const st_names[FSDP_DTYPE_COUNT] = {
      [FSDP_DTYPE_F32] = "F32", [FSDP_DTYPE_BF16] = "BF16", [FSDP_DTYPE_F16] = "F16",
      [FSDP_DTYPE_F64] = "F64", [FSDP_DTYPE_I64] = "I64",   [FSDP_DTYPE_I32] = "I32",
      [FSDP_DTYPE_U8] = "U8",   [FSDP_DTYPE_BOOL] = "BOOL"};
  path = path_in(fx, "dtypes.safetensors");
  fsdp_io_st_entry e[FSDP_DTYPE_COUNT];
  char ename[FSDP_DTYPE_COUNT][16];
  const char *dnames[FSDP_DTYPE_COUNT];
  size_t esz[FSDP_DTYPE_COUNT];
  const void *dd[FSDP_DTYPE_COUNT];
  fsdp_tensor *t[FSDP_DTYPE_COUNT];
  for (int k = 0; k < FSDP_DTYPE_COUNT; k++) {
    int64_t shape[2] = {3, 7 + k};
    assert_int_equal(fsdp_tensor_new(&t[k], &fsdp_device_cpu, (fsdp_dtype)k, 2, shape,
                                     FSDP_ROLE_OTHER), FSDP_OK);
    fill_bits(fsdp_tensor_data(t[k], "test"), (fsdp_dtype)k, 3 * (7 + k), (uint64_t)k + 11);
    snprintf(ename[k], sizeof ename[k], "t_%s", fsdp_dtype_name((fsdp_dtype)k));
    e[k] = (fsdp_io_st_entry){.name = ename[k],
                              .dtype = (fsdp_io_dtype)fsdp_io_dtype_of_tensor((fsdp_dtype)k),
                              .ndim = 2, .shape = {3, 7 + k}};
    dnames[k] = st_names[k];
    esz[k] = fsdp_dtype_size((fsdp_dtype)k);
    dd[k] = fsdp_tensor_data(t[k], "test");
  }
  fsdp_io_st_writer *w;
  assert_int_equal(fsdp_io_st_writer_open(&w, path, e, FSDP_DTYPE_COUNT, NULL, 0), FSDP_OK);
  for (int k = 0; k < FSDP_DTYPE_COUNT; k++)
    assert_int_equal(fsdp_io_st_write_tensor(w, ename[k], t[k]), FSDP_OK);
  assert_int_equal(fsdp_io_st_writer_commit(w), FSDP_OK);
  parse_independently(path, e, dnames, esz, dd, FSDP_DTYPE_COUNT, &root, &buf);
  cJSON_Delete(root);
  free(buf);
  for (int k = 0; k < FSDP_DTYPE_COUNT; k++) fsdp_tensor_release(t[k]);
}

/* A file without any fsdp keys (as other tools write it) is a standard file: it opens. */
static void test_foreign_file(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "foreign.safetensors");
  float x[3] = {1, 2, 3};
  write_raw(path,
            "{\"x\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]},"
            "\"__metadata__\":{\"format\":\"pt\"}}",
            x, sizeof x);
  fsdp_io_st_reader *r;
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  const fsdp_io_st_entry *e = fsdp_io_st_reader_find(r, "x");
  assert_false(e->has_checksum);
  float out[3];
  assert_int_equal(fsdp_io_st_reader_read(r, out, "x", 0, 3), FSDP_OK);
  assert_memory_equal(out, x, sizeof x);
  assert_int_equal(fsdp_io_st_reader_verify(r, "x"), FSDP_OK); /* nothing to check */
  assert_string_equal(fsdp_io_st_reader_metadata_get(r, "format"), "pt");
  fsdp_io_st_reader_close(r);

  /* no tensors at all, empty JSON object */
  write_raw(path, "{}", NULL, 0);
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  assert_int_equal(fsdp_io_st_reader_count(r), 0);
  fsdp_io_st_reader_close(r);
}

static void test_empty_model(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "empty.safetensors");
  fsdp_io_st_writer *w;
  assert_int_equal(fsdp_io_st_writer_open(&w, path, NULL, 0, NULL, 0), FSDP_OK);
  assert_int_equal(fsdp_io_st_writer_commit(w), FSDP_OK);
  fsdp_io_st_reader *r;
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  assert_int_equal(fsdp_io_st_reader_count(r), 0);
  assert_int_equal(fsdp_io_st_reader_metadata_count(r), 1);
  fsdp_io_st_reader_close(r);
}

/* ---- range reads, conversions --------------------------------------------------------------- */

static void test_range_reads(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "model.safetensors");
  assert_int_equal(write_model(path), FSDP_OK);
  fsdp_io_st_reader *r;
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  const float *e = model_data(4);
  float out[1000];
  const int64_t ranges[][2] = {{0, 10}, {990, 10}, {333, 334}, {500, 0}, {1000, 0}, {0, 999}};
  for (size_t k = 0; k < sizeof ranges / sizeof ranges[0]; k++) {
    memset(out, 0, sizeof out);
    assert_int_equal(fsdp_io_st_reader_read(r, out, "e", ranges[k][0], ranges[k][1]), FSDP_OK);
    assert_memory_equal(out, e + ranges[k][0], (size_t)ranges[k][1] * 4);
  }
  /* ranks reading their shards concatenate to the tensor */
  for (int64_t s = 0; s < 4; s++)
    assert_int_equal(fsdp_io_st_reader_read(r, out + 250 * s, "e", 250 * s, 250), FSDP_OK);
  assert_memory_equal(out, e, 4000);
  expect_error(fsdp_io_st_reader_read(r, out, "e", 990, 11), "out of range");
  expect_msg_has(path);
  expect_msg_has("'e'");
  expect_error(fsdp_io_st_reader_read(r, out, "e", -1, 1), "out of range");
  expect_error(fsdp_io_st_reader_read(r, out, "e", 1001, 0), "out of range");
  expect_error(fsdp_io_st_reader_read(r, out, "e", 0, -5), "out of range");
  expect_error(fsdp_io_st_reader_read(r, out, "e", INT64_MAX, INT64_MAX), "out of range");
  expect_error(fsdp_io_st_reader_read(r, out, "zz", 0, 1), "'zz': no such tensor");
  fsdp_io_st_reader_close(r);
}

typedef struct reader_job {
  fsdp_io_st_reader *r;
  int shard;
  float out[250];
  int rc;
} reader_job;

static void *read_shard(void *arg) {
  reader_job *j = arg;
  for (int rep = 0; rep < 50 && j->rc == FSDP_OK; rep++)
    j->rc = fsdp_io_st_reader_read(j->r, j->out, "e", 250 * j->shard, 250);
  return NULL;
}

/* Rank threads share one reader. */
static void test_concurrent_reads(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "model.safetensors");
  assert_int_equal(write_model(path), FSDP_OK);
  fsdp_io_st_reader *r;
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  reader_job jobs[4];
  pthread_t th[4];
  for (int s = 0; s < 4; s++) {
    jobs[s] = (reader_job){.r = r, .shard = s};
    assert_int_equal(pthread_create(&th[s], NULL, read_shard, &jobs[s]), 0);
  }
  for (int s = 0; s < 4; s++) {
    pthread_join(th[s], NULL);
    assert_int_equal(jobs[s].rc, FSDP_OK);
    assert_memory_equal(jobs[s].out, model_data(4) + 250 * s, 1000);
  }
  fsdp_io_st_reader_close(r);
}

/* A new zeroed cpu tensor of n elements (1-D). */
static fsdp_tensor *cpu_tensor(fsdp_dtype dt, int64_t n) {
  fsdp_tensor *t;
  assert_int_equal(fsdp_tensor_new(&t, &fsdp_device_cpu, dt, 1, &n, FSDP_ROLE_OTHER), FSDP_OK);
  return t;
}

/* A sink that takes `left` pieces, then fails. */
static int sink_calls;
static int failing_sink(void *ctx, const void *bytes, int64_t at, int64_t n) {
  int *left = ctx;
  sink_calls++;
  if ((*left)-- <= 0) return fsdp_error("sink: no more (piece at %lld)", (long long)at);
  return FSDP_OK;
}

/* A foreign file of F16, BF16, F64, I64 and I16 tensors: raw reads give the stored bytes; reads
 * into f32 tensors convert; I16 has no tensor dtype. */
static void test_conversions(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "mixed.safetensors");
  /* F16: 1, -2, 0.5, 65504 (max), 2^-24 (smallest subnormal), inf, -0 */
  const uint16_t h[7] = {0x3C00, 0xC000, 0x3800, 0x7BFF, 0x0001, 0x7C00, 0x8000};
  /* BF16: 1, -3, 2^-133 (subnormal) */
  const uint16_t bf[3] = {0x3F80, 0xC040, 0x0001};
  const double d[2] = {1.5, -1e300};
  const int64_t ints[2] = {7, -7};
  const int16_t shorts[2] = {3, -3};
  unsigned char data[14 + 6 + 16 + 16 + 4];
  memcpy(data, h, 14);
  memcpy(data + 14, bf, 6);
  memcpy(data + 20, d, 16);
  memcpy(data + 36, ints, 16);
  memcpy(data + 52, shorts, 4);
  write_raw(path,
            "{\"h\":{\"dtype\":\"F16\",\"shape\":[7],\"data_offsets\":[0,14]},"
            "\"bf\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[14,20]},"
            "\"d\":{\"dtype\":\"F64\",\"shape\":[1,2],\"data_offsets\":[20,36]},"
            "\"i\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[36,52]},"
            "\"s\":{\"dtype\":\"I16\",\"shape\":[2],\"data_offsets\":[52,56]}}",
            data, sizeof data);
  fsdp_io_st_reader *r;
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  uint16_t raw[7];
  assert_int_equal(fsdp_io_st_reader_read(r, raw, "h", 0, 7), FSDP_OK);
  assert_memory_equal(raw, h, sizeof h); /* the bytes as stored */
  assert_int_equal(fsdp_io_st_reader_read(r, raw, "h", 2, 3), FSDP_OK);
  assert_memory_equal(raw, h + 2, 6);
  int16_t rs[2];
  assert_int_equal(fsdp_io_st_reader_read(r, rs, "s", 0, 2), FSDP_OK);
  assert_memory_equal(rs, shorts, 4);
  /* in pieces: a buffer must hold one element */
  unsigned char small[8];
  expect_error(fsdp_io_st_reader_read_chunks(r, "d", 0, 2, small, 7, NULL, NULL),
               "tensor 'd': a buffer of 7 bytes holds no F64 element");
  assert_int_equal(fsdp_io_st_reader_read_chunks(r, "d", 0, 2, small, 8, NULL, NULL), FSDP_OK);
  int left = 1;
  sink_calls = 0;
  expect_error(fsdp_io_st_reader_read_chunks(r, "h", 0, 7, small, 4, failing_sink, &left),
               "sink: no more (piece at 2)");
  assert_int_equal(sink_calls, 2); /* stopped at the failing piece */

  fsdp_tensor *t = cpu_tensor(FSDP_DTYPE_F32, 7);
  float *out = fsdp_tensor_data(t, "test");
  assert_int_equal(fsdp_io_st_read_tensor(r, "h", 0, 7, t), FSDP_OK);
  const float hf[7] = {1.0f, -2.0f, 0.5f, 65504.0f, 5.9604644775390625e-8f, INFINITY, -0.0f};
  assert_memory_equal(out, hf, sizeof hf);
  fsdp_tensor_release(t);
  t = cpu_tensor(FSDP_DTYPE_F32, 3);
  out = fsdp_tensor_data(t, "test");
  assert_int_equal(fsdp_io_st_read_tensor(r, "h", 2, 3, t), FSDP_OK);
  assert_memory_equal(out, hf + 2, 12);
  assert_int_equal(fsdp_io_st_read_tensor(r, "bf", 0, 3, t), FSDP_OK);
  assert_true(out[0] == 1.0f && out[1] == -3.0f && out[2] > 0.0f && out[2] < 1e-38f);
  fsdp_tensor_release(t);
  t = cpu_tensor(FSDP_DTYPE_F32, 2);
  out = fsdp_tensor_data(t, "test");
  assert_int_equal(fsdp_io_st_read_tensor(r, "d", 0, 2, t), FSDP_OK);
  assert_true(out[0] == 1.5f && out[1] == -INFINITY); /* F64 rounds, overflowing to inf */
  assert_int_equal(fsdp_io_st_read_tensor(r, "i", 0, 2, t), FSDP_OK);
  assert_true(out[0] == 7.0f && out[1] == -7.0f);
  expect_error(fsdp_io_st_read_tensor(r, "s", 0, 2, t),
               "tensor 's': stored dtype I16 has no tensor dtype, so it cannot be read as f32");
  expect_msg_has(path);
  expect_error(fsdp_io_st_read_tensor(r, "i", 0, 1, t), "reading 1 elements into a tensor of 2");
  expect_error(fsdp_io_st_read_tensor(r, "i", 1, 2, t), "out of range");
  expect_error(fsdp_io_st_read_tensor(r, "zz", 0, 2, t), "'zz': no such tensor");
  fsdp_tensor_release(t);
  assert_int_equal(fsdp_io_st_reader_entry(r, 3)->dtype, FSDP_IO_I64);
  fsdp_io_st_reader_close(r);
}

/* ---- tensors of every dtype ---------------------------------------------------------------- */

#define NDT FSDP_DTYPE_COUNT
#define DT_NUMEL 300001 /* f64: 2.4 MB, three staging pieces */

/* Every tensor dtype round-trips bit for bit through a file: written whole (contiguous, in
 * host memory), in shards, and from a strided view; read back as new tensors and by ranges. */
static void test_dtype_round_trip(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "dtypes.safetensors");
  fsdp_io_st_entry e[2 * NDT];
  char names[2 * NDT][32];
  fsdp_tensor *src[NDT], *tr[NDT];
  for (int k = 0; k < NDT; k++) {
    fsdp_dtype dt = (fsdp_dtype)k;
    src[k] = cpu_tensor(dt, DT_NUMEL);
    fill_bits(fsdp_tensor_data(src[k], "test"), dt, DT_NUMEL, (uint64_t)k + 1);
    /* a (3, 5) tensor transposed: (5, 3) with strides (1, 5) */
    int64_t shp[2] = {3, 5}, tshape[2] = {5, 3}, tstrides[2] = {1, 5};
    fsdp_tensor *base;
    assert_int_equal(fsdp_tensor_new(&base, &fsdp_device_cpu, dt, 2, shp, FSDP_ROLE_OTHER), FSDP_OK);
    fill_bits(fsdp_tensor_data(base, "test"), dt, 15, (uint64_t)k + 100);
    assert_int_equal(fsdp_tensor_new_view(&tr[k], base, 0, 2, tshape, tstrides), FSDP_OK);
    fsdp_tensor_release(base);
    snprintf(names[2 * k], 32, "whole.%s", fsdp_dtype_name(dt));
    snprintf(names[2 * k + 1], 32, "strided.%s", fsdp_dtype_name(dt));
    int io = fsdp_io_dtype_of_tensor(dt);
    assert_true(io >= 0);
    e[2 * k] = (fsdp_io_st_entry){.name = names[2 * k], .dtype = (fsdp_io_dtype)io, .ndim = 1,
                                  .shape = {DT_NUMEL}};
    e[2 * k + 1] = (fsdp_io_st_entry){.name = names[2 * k + 1], .dtype = (fsdp_io_dtype)io,
                                      .ndim = 2, .shape = {5, 3}};
  }
  fsdp_io_st_writer *w;
  assert_int_equal(fsdp_io_st_writer_open(&w, path, e, 2 * NDT, NULL, 0), FSDP_OK);
  for (int k = 0; k < NDT; k++) {
    if (k % 2 == 0) {
      assert_int_equal(fsdp_io_st_write_tensor(w, names[2 * k], src[k]), FSDP_OK);
    } else { /* two shards, as views */
      int64_t a = DT_NUMEL / 3, b = DT_NUMEL - a, one = 1;
      fsdp_tensor *s1, *s2;
      assert_int_equal(fsdp_tensor_new_view(&s1, src[k], 0, 1, &a, &one), FSDP_OK);
      assert_int_equal(fsdp_tensor_new_view(&s2, src[k], a, 1, &b, &one), FSDP_OK);
      assert_int_equal(fsdp_io_st_write_tensor(w, names[2 * k], s1), FSDP_OK);
      assert_int_equal(fsdp_io_st_write_tensor(w, names[2 * k], s2), FSDP_OK);
      fsdp_tensor_release(s1);
      fsdp_tensor_release(s2);
    }
    assert_int_equal(fsdp_io_st_write_tensor(w, names[2 * k + 1], tr[k]), FSDP_OK);
  }
  assert_int_equal(fsdp_io_st_writer_commit(w), FSDP_OK);

  fsdp_io_st_reader *r;
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  for (int k = 0; k < NDT; k++) {
    fsdp_dtype dt = (fsdp_dtype)k, back;
    size_t es = fsdp_dtype_size(dt);
    const fsdp_io_st_entry *en = fsdp_io_st_reader_find(r, names[2 * k]);
    assert_int_equal(en->dtype, fsdp_io_dtype_of_tensor(dt));
    assert_true(fsdp_io_dtype_to_tensor(en->dtype, &back));
    assert_int_equal(back, dt);
    assert_int_equal(en->end - en->begin, (uint64_t)DT_NUMEL * es);
    /* whole, as the stored dtype: bit for bit (direct into host memory) */
    fsdp_tensor *t = cpu_tensor(dt, DT_NUMEL);
    assert_int_equal(fsdp_io_st_read_tensor(r, names[2 * k], 0, DT_NUMEL, t), FSDP_OK);
    assert_memory_equal(fsdp_tensor_data(t, "test"), fsdp_tensor_data(src[k], "test"),
                        (size_t)DT_NUMEL * es);
    fsdp_tensor_release(t);
    /* a range */
    t = cpu_tensor(dt, 1000);
    assert_int_equal(fsdp_io_st_read_tensor(r, names[2 * k], 12345, 1000, t), FSDP_OK);
    assert_memory_equal(fsdp_tensor_data(t, "test"),
                        (char *)fsdp_tensor_data(src[k], "test") + 12345 * es, 1000 * es);
    fsdp_tensor_release(t);
    /* the strided one, in row-major order of the view */
    t = cpu_tensor(dt, 15);
    assert_int_equal(fsdp_io_st_read_tensor(r, names[2 * k + 1], 0, 15, t), FSDP_OK);
    const char *base = (const char *)fsdp_tensor_data(tr[k], "test");
    for (int i = 0; i < 5; i++)
      for (int j = 0; j < 3; j++)
        assert_memory_equal((char *)fsdp_tensor_data(t, "test") + (size_t)(i * 3 + j) * es,
                            base + (size_t)(i * 1 + j * 5) * es, es);
    fsdp_tensor_release(t);
    assert_int_equal(fsdp_io_st_reader_verify(r, names[2 * k]), FSDP_OK);
  }
  fsdp_io_st_reader_close(r);

  /* damage: a flipped byte in each dtype's tensor is a checksum mismatch, read directly or
   * through the staging pieces (converting to another dtype) */
  size_t size;
  unsigned char *buf = slurp(path, &size);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | buf[i];
  fsdp_io_st_reader *clean;
  assert_int_equal(fsdp_io_st_reader_open_memory(&clean, "clean", buf, size), FSDP_OK);
  for (int k = 0; k < NDT; k++) {
    fsdp_dtype dt = (fsdp_dtype)k;
    const fsdp_io_st_entry *en = fsdp_io_st_reader_find(clean, names[2 * k]);
    uint64_t at = 8 + hlen + en->begin + (en->end - en->begin) / 2;
    unsigned char flip = dt == FSDP_DTYPE_BOOL ? 0x01 : 0x10; /* a BOOL byte stays 0 or 1 */
    buf[at] ^= flip;
    assert_int_equal(fsdp_io_st_reader_open_memory(&r, "bad.safetensors", buf, size), FSDP_OK);
    fsdp_tensor *t = cpu_tensor(dt, DT_NUMEL);
    expect_error(fsdp_io_st_read_tensor(r, names[2 * k], 0, DT_NUMEL, t), "checksum mismatch");
    expect_msg_has(names[2 * k]);
    fsdp_tensor_release(t);
    t = cpu_tensor(dt == FSDP_DTYPE_F64 ? FSDP_DTYPE_F32 : FSDP_DTYPE_F64, DT_NUMEL);
    expect_error(fsdp_io_st_read_tensor(r, names[2 * k], 0, DT_NUMEL, t), "checksum mismatch");
    fsdp_tensor_release(t);
    fsdp_io_st_reader_close(r);
    buf[at] ^= flip;
  }
  /* a BOOL byte that is neither 0 nor 1 */
  const fsdp_io_st_entry *bo = fsdp_io_st_reader_find(clean, "whole.bool");
  buf[8 + hlen + bo->begin + 7] = 2;
  assert_int_equal(fsdp_io_st_reader_open_memory(&r, "bad.safetensors", buf, size), FSDP_OK);
  fsdp_tensor *t = cpu_tensor(FSDP_DTYPE_BOOL, 10);
  expect_error(fsdp_io_st_read_tensor(r, "whole.bool", 0, 10, t),
               "tensor 'whole.bool': BOOL element 7 holds 2, not 0 or 1");
  fsdp_tensor_release(t);
  t = cpu_tensor(FSDP_DTYPE_F32, 10);
  expect_error(fsdp_io_st_read_tensor(r, "whole.bool", 0, 10, t), "BOOL element 7 holds 2");
  fsdp_tensor_release(t);
  expect_error(fsdp_io_st_reader_verify(r, "whole.bool"), "BOOL element 7");
  fsdp_io_st_reader_close(r);
  fsdp_io_st_reader_close(clean);
  free(buf);
  for (int k = 0; k < NDT; k++) {
    fsdp_tensor_release(src[k]);
    fsdp_tensor_release(tr[k]);
  }
}

/* Loading into a tensor of another dtype converts: bf16 into f32 widens exactly (all 65536
 * patterns), f32 into bf16 rounds to nearest even (NaN quiet with its sign, infinities kept),
 * integers and bools follow fsdp_dtype_store. Writing a tensor into an entry of another dtype
 * converts the same way. */
static void test_read_convert(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "conv.safetensors");
  const int64_t NB = 65536, NF = 400000; /* NF f32: 1.6 MB, two staging pieces */
  fsdp_tensor *bf = cpu_tensor(FSDP_DTYPE_BF16, NB), *f = cpu_tensor(FSDP_DTYPE_F32, NF);
  uint16_t *bfp = fsdp_tensor_data(bf, "test");
  for (int64_t i = 0; i < NB; i++) bfp[i] = (uint16_t)i;
  uint32_t *fp = fsdp_tensor_data(f, "test");
  fill_bits(fp, FSDP_DTYPE_F32, NF, 7);
  static const uint32_t special[] = {
      0x3F808000u, /* 1 + 2^-8: a tie, rounds to even 0x3F80 */
      0x3F818000u, /* a tie that rounds up to even 0x3F82 */
      0x3F808001u, /* just above a tie: up */
      0x7F7FFFFFu, /* FLT_MAX rounds to +inf */
      0x7F800000u, 0xFF800000u, /* infinities */
      0x7FC00000u, 0xFFC00000u, /* quiet NaNs */
      0x7F800001u, /* a signalling NaN becomes quiet, not inf */
      0x80000000u, 0x00000001u, /* -0, the smallest subnormal (rounds to 0) */
  };
  static const uint16_t special_bf[] = {0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x7F80, 0xFF80,
                                        0x7FC0, 0xFFC0, 0x7FC0, 0x8000, 0x0000};
  memcpy(fp, special, sizeof special);
  const float ints_src[8] = {1.7f, -2.5f, NAN, 1e20f, -1e20f, 0.0f, 255.5f, -0.5f};
  fsdp_tensor *fi = cpu_tensor(FSDP_DTYPE_F32, 8);
  memcpy(fsdp_tensor_data(fi, "test"), ints_src, sizeof ints_src);
  fsdp_tensor *b8 = cpu_tensor(FSDP_DTYPE_BOOL, 3), *i64 = cpu_tensor(FSDP_DTYPE_I64, 3);
  memcpy(fsdp_tensor_data(b8, "test"), (uint8_t[3]){1, 0, 1}, 3);
  memcpy(fsdp_tensor_data(i64, "test"), (int64_t[3]){-3, 1ll << 40, 9007199254740993ll}, 24);
  fsdp_io_st_entry e[6] = {
      {.name = "bf", .dtype = FSDP_IO_BF16, .ndim = 1, .shape = {NB}},
      {.name = "f", .dtype = FSDP_IO_F32, .ndim = 1, .shape = {NF}},
      {.name = "fi", .dtype = FSDP_IO_F32, .ndim = 1, .shape = {8}},
      {.name = "b", .dtype = FSDP_IO_BOOL, .ndim = 1, .shape = {3}},
      {.name = "i", .dtype = FSDP_IO_I64, .ndim = 1, .shape = {3}},
      /* written from the f32 tensor, converted by the writer */
      {.name = "f_as_bf", .dtype = FSDP_IO_BF16, .ndim = 1, .shape = {NF}},
  };
  fsdp_io_st_writer *w;
  assert_int_equal(fsdp_io_st_writer_open(&w, path, e, 6, NULL, 0), FSDP_OK);
  assert_int_equal(fsdp_io_st_write_tensor(w, "bf", bf), FSDP_OK);
  assert_int_equal(fsdp_io_st_write_tensor(w, "f", f), FSDP_OK);
  assert_int_equal(fsdp_io_st_write_tensor(w, "fi", fi), FSDP_OK);
  assert_int_equal(fsdp_io_st_write_tensor(w, "b", b8), FSDP_OK);
  assert_int_equal(fsdp_io_st_write_tensor(w, "i", i64), FSDP_OK);
  assert_int_equal(fsdp_io_st_write_tensor(w, "f_as_bf", f), FSDP_OK);
  assert_int_equal(fsdp_io_st_writer_commit(w), FSDP_OK);

  fsdp_io_st_reader *r;
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  /* BF16 -> f32: exact widening, every pattern (NaNs included, bit for bit) */
  fsdp_tensor *t = cpu_tensor(FSDP_DTYPE_F32, NB);
  assert_int_equal(fsdp_io_st_read_tensor(r, "bf", 0, NB, t), FSDP_OK);
  const uint32_t *tp = fsdp_tensor_data(t, "test");
  for (int64_t i = 0; i < NB; i++)
    if (tp[i] != (uint32_t)i << 16) fail_msg("bf16 %04llx widened to %08x", (long long)i, tp[i]);
  fsdp_tensor_release(t);
  /* F32 -> bf16: round to nearest even, as the core's scalar conversion */
  t = cpu_tensor(FSDP_DTYPE_BF16, NF);
  assert_int_equal(fsdp_io_st_read_tensor(r, "f", 0, NF, t), FSDP_OK);
  const uint16_t *hp = fsdp_tensor_data(t, "test");
  for (size_t i = 0; i < sizeof special_bf / sizeof special_bf[0]; i++)
    if (hp[i] != special_bf[i])
      fail_msg("f32 %08x -> bf16 %04x, expected %04x", special[i], hp[i], special_bf[i]);
  for (int64_t i = 0; i < NF; i++) {
    float x;
    memcpy(&x, &fp[i], 4);
    if (hp[i] != fsdp_f32_to_bf16(x))
      fail_msg("element %lld: f32 %08x -> bf16 %04x", (long long)i, fp[i], hp[i]);
  }
  /* the writer's conversion gives the same bits */
  fsdp_tensor *t2 = cpu_tensor(FSDP_DTYPE_BF16, NF);
  assert_int_equal(fsdp_io_st_read_tensor(r, "f_as_bf", 0, NF, t2), FSDP_OK);
  assert_memory_equal(fsdp_tensor_data(t2, "test"), hp, (size_t)NF * 2);
  fsdp_tensor_release(t2);
  /* a range read into bf16, through the staging pieces */
  t2 = cpu_tensor(FSDP_DTYPE_BF16, 5);
  assert_int_equal(fsdp_io_st_read_tensor(r, "f", 2, 5, t2), FSDP_OK);
  assert_memory_equal(fsdp_tensor_data(t2, "test"), hp + 2, 10);
  fsdp_tensor_release(t2);
  fsdp_tensor_release(t);
  /* F32 -> integers: truncate toward zero, saturate, NaN -> 0; -> u8 and bool */
  t = cpu_tensor(FSDP_DTYPE_I32, 8);
  assert_int_equal(fsdp_io_st_read_tensor(r, "fi", 0, 8, t), FSDP_OK);
  const int32_t want_i32[8] = {1, -2, 0, INT32_MAX, INT32_MIN, 0, 255, 0};
  assert_memory_equal(fsdp_tensor_data(t, "test"), want_i32, sizeof want_i32);
  fsdp_tensor_release(t);
  t = cpu_tensor(FSDP_DTYPE_U8, 8);
  assert_int_equal(fsdp_io_st_read_tensor(r, "fi", 0, 8, t), FSDP_OK);
  const uint8_t want_u8[8] = {1, 0, 0, 255, 0, 0, 255, 0};
  assert_memory_equal(fsdp_tensor_data(t, "test"), want_u8, 8);
  fsdp_tensor_release(t);
  t = cpu_tensor(FSDP_DTYPE_BOOL, 8);
  assert_int_equal(fsdp_io_st_read_tensor(r, "fi", 0, 8, t), FSDP_OK);
  const uint8_t want_b[8] = {1, 1, 1, 1, 1, 0, 1, 1};
  assert_memory_equal(fsdp_tensor_data(t, "test"), want_b, 8);
  fsdp_tensor_release(t);
  /* BOOL -> f32 and f64; I64 -> f32 (rounds beyond 2^24) and -> i32 (saturates) */
  t = cpu_tensor(FSDP_DTYPE_F32, 3);
  assert_int_equal(fsdp_io_st_read_tensor(r, "b", 0, 3, t), FSDP_OK);
  assert_memory_equal(fsdp_tensor_data(t, "test"), ((float[3]){1, 0, 1}), 12);
  assert_int_equal(fsdp_io_st_read_tensor(r, "i", 0, 3, t), FSDP_OK);
  assert_memory_equal(fsdp_tensor_data(t, "test"),
                      ((float[3]){-3.0f, 1099511627776.0f, 9007199254740992.0f}), 12);
  fsdp_tensor_release(t);
  t = cpu_tensor(FSDP_DTYPE_I32, 3);
  assert_int_equal(fsdp_io_st_read_tensor(r, "i", 0, 3, t), FSDP_OK);
  assert_memory_equal(fsdp_tensor_data(t, "test"), ((int32_t[3]){-3, INT32_MAX, INT32_MAX}), 12);
  fsdp_tensor_release(t);
  /* a destination that is not contiguous, or has no data, is refused */
  int64_t shp[2] = {2, 3}, tsh[2] = {3, 2}, tst[2] = {1, 3};
  fsdp_tensor *base, *tv;
  assert_int_equal(fsdp_tensor_new(&base, &fsdp_device_cpu, FSDP_DTYPE_F32, 2, shp, FSDP_ROLE_OTHER),
                   FSDP_OK);
  assert_int_equal(fsdp_tensor_new_view(&tv, base, 0, 2, tsh, tst), FSDP_OK);
  expect_error(fsdp_io_st_read_tensor(r, "f", 0, 6, tv), "must be contiguous");
  fsdp_tensor_release(tv);
  fsdp_tensor_release(base);
  assert_int_equal(fsdp_tensor_new(&tv, &fsdp_device_meta, FSDP_DTYPE_F32, 1, (int64_t[1]){6},
                                   FSDP_ROLE_OTHER),
                   FSDP_OK);
  expect_error(fsdp_io_st_read_tensor(r, "f", 0, 6, tv), "meta device has no data");
  expect_msg_has("tensor 'f'");
  fsdp_tensor_release(tv);
  fsdp_io_st_reader_close(r);
  /* the writer refuses what it cannot write: no data, a dtype that is no tensor's */
  fsdp_io_st_entry e2[2] = {{.name = "x", .dtype = FSDP_IO_F32, .ndim = 1, .shape = {6}},
                            {.name = "s", .dtype = FSDP_IO_I16, .ndim = 1, .shape = {2}}};
  assert_int_equal(fsdp_io_st_writer_open(&w, path, e2, 2, NULL, 0), FSDP_OK);
  assert_int_equal(fsdp_tensor_new(&tv, &fsdp_device_meta, FSDP_DTYPE_F32, 1, (int64_t[1]){6},
                                   FSDP_ROLE_OTHER),
                   FSDP_OK);
  expect_error(fsdp_io_st_write_tensor(w, "x", tv), "meta device has no data");
  expect_msg_has("tensor 'x'");
  fsdp_tensor_release(tv);
  expect_error(fsdp_io_st_write_tensor(w, "nope", fi), "'nope' is not one of the file's entries");
  expect_error(fsdp_io_st_write_tensor(w, "s", fi), "entry dtype I16 is not a tensor dtype");
  fsdp_io_st_writer_abort(w);
  fsdp_tensor_release(bf);
  fsdp_tensor_release(f);
  fsdp_tensor_release(fi);
  fsdp_tensor_release(b8);
  fsdp_tensor_release(i64);
}

/* A device whose memory the host may not touch (as a GPU's): its tensors are saved and loaded
 * through pieces of at most FSDP_IO_STAGE_BYTES, never whole. Its memory is host memory in
 * truth (so the cpu kernels can serve it); the copies count the bytes of each transfer. */
static size_t hostless_max, hostless_total;
static int hl_alloc(void *ctx, void **out, size_t bytes) {
  *out = calloc(1, bytes ? bytes : 1);
  return *out ? FSDP_OK : fsdp_error("hostless: out of memory");
}
static void hl_free(void *ctx, void *p, size_t bytes) { free(p); }
static int hl_copy(void *ctx, void *d, const void *s, size_t n) {
  memmove(d, s, n);
  return FSDP_OK;
}
static int hl_transfer(void *ctx, void *d, const void *s, size_t n) {
  if (n > hostless_max) hostless_max = n;
  hostless_total += n;
  memcpy(d, s, n);
  return FSDP_OK;
}
static fsdp_device_i hostless = {.name = "hostless", .has_data = true, .host_memory = false,
                                 .alloc = hl_alloc, .free = hl_free, .copy = hl_copy,
                                 .to_host = hl_transfer, .from_host = hl_transfer};

static void test_hostless_device(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "dev.safetensors");
  if (fsdp_device_find("hostless") == NULL)
    assert_int_equal(fsdp_device_register(&hostless, fsdp_kernels_of(&fsdp_device_cpu, "test")),
                     FSDP_OK);
  fsdp_error_clear();
  const int64_t N = 700000; /* 2.8 MB of f32 */
  fsdp_tensor *h = cpu_tensor(FSDP_DTYPE_F32, N), *d, *db;
  float *hp = fsdp_tensor_data(h, "test");
  for (int64_t i = 0; i < N; i++) hp[i] = (float)i * 0.37f - 5.0f;
  assert_int_equal(fsdp_to(&d, h, &hostless, FSDP_DTYPE_F32, FSDP_ROLE_OTHER), FSDP_OK);
  assert_int_equal(fsdp_to(&db, h, &hostless, FSDP_DTYPE_BF16, FSDP_ROLE_OTHER), FSDP_OK);
  /* a strided view on the device: (1000, 700) transposed */
  int64_t tsh[2] = {700, 1000}, tst[2] = {1, 700};
  fsdp_tensor *dt, *dt2;
  assert_int_equal(fsdp_tensor_new_view(&dt, d, 0, 2, tsh, tst), FSDP_OK);
  /* (350000, 2) transposed: one row (350000 elements, stride 2) is more than a piece */
  int64_t tsh2[2] = {2, 350000}, tst2[2] = {1, 2};
  assert_int_equal(fsdp_tensor_new_view(&dt2, d, 0, 2, tsh2, tst2), FSDP_OK);
  fsdp_io_st_entry e[5] = {{.name = "f", .dtype = FSDP_IO_F32, .ndim = 1, .shape = {N}},
                           {.name = "bf", .dtype = FSDP_IO_BF16, .ndim = 1, .shape = {N}},
                           {.name = "bf_as_f", .dtype = FSDP_IO_F32, .ndim = 1, .shape = {N}},
                           {.name = "t", .dtype = FSDP_IO_F32, .ndim = 2, .shape = {700, 1000}},
                           {.name = "t2", .dtype = FSDP_IO_F32, .ndim = 2, .shape = {2, 350000}}};
  hostless_max = hostless_total = 0;
  fsdp_io_st_writer *w;
  assert_int_equal(fsdp_io_st_writer_open(&w, path, e, 5, NULL, 0), FSDP_OK);
  assert_int_equal(fsdp_io_st_write_tensor(w, "f", d), FSDP_OK);
  assert_int_equal(fsdp_io_st_write_tensor(w, "bf", db), FSDP_OK);
  assert_int_equal(fsdp_io_st_write_tensor(w, "bf_as_f", db), FSDP_OK);
  assert_int_equal(fsdp_io_st_write_tensor(w, "t", dt), FSDP_OK);
  assert_int_equal(fsdp_io_st_write_tensor(w, "t2", dt2), FSDP_OK);
  assert_int_equal(fsdp_io_st_writer_commit(w), FSDP_OK);
  assert_true(hostless_max > 0 && hostless_max <= FSDP_IO_STAGE_BYTES);
  assert_true(hostless_total >= (size_t)N * (4 + 2 + 4 + 4 + 4)); /* everything came over */

  fsdp_io_st_reader *r;
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  fsdp_tensor *out = cpu_tensor(FSDP_DTYPE_F32, N);
  assert_int_equal(fsdp_io_st_read_tensor(r, "f", 0, N, out), FSDP_OK); /* host side */
  assert_memory_equal(fsdp_tensor_data(out, "test"), hp, (size_t)N * 4);
  /* into tensors on the device: f32, and f32 -> bf16 */
  fsdp_tensor *d2, *d3, *back;
  int64_t n = N;
  assert_int_equal(fsdp_tensor_new(&d2, &hostless, FSDP_DTYPE_F32, 1, &n, FSDP_ROLE_OTHER), FSDP_OK);
  assert_int_equal(fsdp_tensor_new(&d3, &hostless, FSDP_DTYPE_BF16, 1, &n, FSDP_ROLE_OTHER), FSDP_OK);
  hostless_max = 0;
  assert_int_equal(fsdp_io_st_read_tensor(r, "f", 0, N, d2), FSDP_OK);
  assert_int_equal(fsdp_io_st_read_tensor(r, "f", 0, N, d3), FSDP_OK);
  assert_true(hostless_max > 0 && hostless_max <= FSDP_IO_STAGE_BYTES);
  assert_int_equal(fsdp_to_host(&back, d2), FSDP_OK);
  assert_memory_equal(fsdp_tensor_data(back, "test"), hp, (size_t)N * 4);
  fsdp_tensor_release(back);
  fsdp_tensor *want;
  assert_int_equal(fsdp_to_host(&back, d3), FSDP_OK);
  assert_int_equal(fsdp_to_host(&want, db), FSDP_OK);
  assert_memory_equal(fsdp_tensor_data(back, "test"), fsdp_tensor_data(want, "test"), (size_t)N * 2);
  fsdp_tensor_release(back);
  /* the BF16 entry and the bf16 tensor written as F32: the same values */
  fsdp_tensor *wb = cpu_tensor(FSDP_DTYPE_BF16, N);
  assert_int_equal(fsdp_io_st_read_tensor(r, "bf", 0, N, wb), FSDP_OK);
  assert_memory_equal(fsdp_tensor_data(wb, "test"), fsdp_tensor_data(want, "test"), (size_t)N * 2);
  assert_int_equal(fsdp_io_st_read_tensor(r, "bf_as_f", 0, N, wb), FSDP_OK);
  assert_memory_equal(fsdp_tensor_data(wb, "test"), fsdp_tensor_data(want, "test"), (size_t)N * 2);
  fsdp_tensor_release(wb);
  fsdp_tensor_release(want);
  /* the strided view's values in its row-major order */
  assert_int_equal(fsdp_io_st_read_tensor(r, "t", 0, N, out), FSDP_OK);
  const float *op = fsdp_tensor_data(out, "test");
  for (int64_t i = 0; i < 700; i += 37)
    for (int64_t j = 0; j < 1000; j += 53) assert_true(op[i * 1000 + j] == hp[i + j * 700]);
  assert_int_equal(fsdp_io_st_read_tensor(r, "t2", 0, N, out), FSDP_OK);
  for (int64_t i = 0; i < 2; i++)
    for (int64_t j = 0; j < 350000; j += 997) assert_true(op[i * 350000 + j] == hp[i + j * 2]);
  assert_true(op[350000 + 349999] == hp[1 + 349999 * 2]);
  fsdp_io_st_reader_close(r);
  fsdp_tensor_release(out);
  fsdp_tensor_release(d2);
  fsdp_tensor_release(d3);
  fsdp_tensor_release(dt);
  fsdp_tensor_release(dt2);
  fsdp_tensor_release(d);
  fsdp_tensor_release(db);
  fsdp_tensor_release(h);
}

/* ---- damaged files -------------------------------------------------------------------------- */

static void test_truncated(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "model.safetensors");
  assert_int_equal(write_model(path), FSDP_OK);
  size_t size;
  unsigned char *buf = slurp(path, &size);
  fsdp_io_st_reader *r = (void *)1;
  /* one byte short: the last tensor runs past the end */
  assert_int_equal(truncate(path, (off_t)size - 1), 0);
  expect_error(fsdp_io_st_reader_open(&r, path), "run past the data section");
  assert_null(r);
  expect_msg_has(path);
  expect_msg_has("tensor 'e'");
  /* cut inside the header, inside the length, empty */
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | buf[i];
  assert_int_equal(truncate(path, (off_t)(8 + hlen / 2)), 0);
  expect_error(fsdp_io_st_reader_open(&r, path), "header length field says");
  expect_msg_has(path);
  assert_int_equal(truncate(path, 5), 0);
  expect_error(fsdp_io_st_reader_open(&r, path), "fewer than the 8-byte header length");
  assert_int_equal(truncate(path, 0), 0);
  expect_error(fsdp_io_st_reader_open(&r, path), "not a safetensors file");
  /* one byte too many: trailing bytes belong to no tensor */
  unsigned char *more = malloc(size + 1);
  memcpy(more, buf, size);
  more[size] = 0;
  spit(path, more, size + 1);
  expect_error(fsdp_io_st_reader_open(&r, path), "trailing bytes after tensor 'e'");
  free(more);
  /* a file that shrinks after open: the read says so */
  spit(path, buf, size);
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  assert_int_equal(truncate(path, (off_t)size - 8), 0);
  float out[1000];
  expect_error(fsdp_io_st_reader_read(r, out, "e", 0, 1000), "tensor 'e': file ends before");
  fsdp_io_st_reader_close(r);
  free(buf);
}

static void test_corrupted_data(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "model.safetensors");
  assert_int_equal(write_model(path), FSDP_OK);
  size_t size;
  unsigned char *buf = slurp(path, &size);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | buf[i];
  /* every data byte of every tensor, one at a time (a few per tensor keeps it fast) */
  fsdp_io_st_reader *clean;
  assert_int_equal(fsdp_io_st_reader_open_memory(&clean, "clean", buf, size), FSDP_OK);
  for (int i = 0; i < NENT; i++) {
    const fsdp_io_st_entry *e = fsdp_io_st_reader_entry(clean, i);
    for (uint64_t b = e->begin; b < e->end; b += (e->end - e->begin) / 5 + 1) {
      buf[8 + hlen + b] ^= 0x10;
      fsdp_io_st_reader *r;
      assert_int_equal(fsdp_io_st_reader_open_memory(&r, "mem.safetensors", buf, size), FSDP_OK);
      float out[1000];
      expect_error(fsdp_io_st_reader_read(r, out, e->name, 0, e->numel), "checksum mismatch");
      expect_msg_has("mem.safetensors: tensor '");
      expect_msg_has(e->name);
      expect_error(fsdp_io_st_reader_verify(r, e->name), "its data is corrupted");
      /* the other tensors still read */
      for (int j = 0; j < NENT; j++)
        if (j != i)
          assert_int_equal(fsdp_io_st_reader_read(r, out, ENTRIES[j].name, 0, NUMEL[j]), FSDP_OK);
      fsdp_io_st_reader_close(r);
      buf[8 + hlen + b] ^= 0x10;
    }
  }
  fsdp_io_st_reader_close(clean);
  /* and through a real file */
  buf[size - 1] ^= 0x01;
  spit(path, buf, size);
  fsdp_io_st_reader *r;
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  float out[1000];
  expect_error(fsdp_io_st_reader_read(r, out, "e", 0, 1000), "checksum mismatch");
  expect_msg_has(path);
  expect_msg_has("tensor 'e'");
  /* a range read does not see it; verify does */
  assert_int_equal(fsdp_io_st_reader_read(r, out, "e", 0, 999), FSDP_OK);
  expect_error(fsdp_io_st_reader_verify(r, "e"), "checksum mismatch");
  fsdp_io_st_reader_close(r);
  free(buf);
}

/* Every single header byte (length field included), flipped in two ways, is an error. */
static void test_header_flips(void **state) {
  (void)state;
  fixture *fx = *state;
  const char *path = path_in(fx, "model.safetensors");
  assert_int_equal(write_model(path), FSDP_OK);
  size_t size;
  unsigned char *buf = slurp(path, &size);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | buf[i];
  const unsigned char masks[2] = {0x01, 0x20};
  int checksum_errors = 0;
  for (uint64_t b = 0; b < 8 + hlen; b++)
    for (int m = 0; m < 2; m++) {
      buf[b] ^= masks[m];
      fsdp_io_st_reader *r = NULL;
      int rc = fsdp_io_st_reader_open_memory(&r, "flip.safetensors", buf, size);
      if (rc != FSDP_ERR)
        fail_msg("flipping bit mask 0x%02x of header byte %llu ('%c') went unnoticed", masks[m],
                 (unsigned long long)b, buf[b] ^ masks[m]);
      assert_null(r);
      expect_msg_has("flip.safetensors: ");
      if (strstr(fsdp_error_msg(), "header checksum mismatch")) checksum_errors++;
      buf[b] ^= masks[m];
    }
  assert_true(checksum_errors > (int)hlen); /* most flips are caught by the checksum */
  fsdp_io_st_reader *r;
  assert_int_equal(fsdp_io_st_reader_open_memory(&r, "ok", buf, size), FSDP_OK);
  fsdp_io_st_reader_close(r);
  /* the same through a file: the message names it */
  buf[8 + hlen - 1] = '!'; /* a padding byte */
  spit(path, buf, size);
  expect_error(fsdp_io_st_reader_open(&r, path), "header checksum mismatch");
  expect_msg_has(path);
  free(buf);
}

static void test_wrong_length_and_magic(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "bad.safetensors");
  fsdp_io_st_reader *r;
  const char *text = "this is not a safetensors file, just some text\n";
  spit(path, text, strlen(text));
  expect_error(fsdp_io_st_reader_open(&r, path), "header length field says");
  expect_msg_has(path);
  unsigned char huge[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, '{', '}'};
  spit(path, huge, sizeof huge);
  expect_error(fsdp_io_st_reader_open(&r, path), "header length field says 18446744073709551615");
  /* a length that points inside the JSON */
  write_raw(path, "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", "abcd", 4);
  size_t size;
  unsigned char *buf = slurp(path, &size);
  buf[0] -= 4;
  spit(path, buf, size);
  expect_error(fsdp_io_st_reader_open(&r, path), "header is not valid JSON");
  expect_msg_has(path);
  /* a length too long by 4: the JSON takes the data's first bytes */
  buf[0] += 8;
  spit(path, buf, size);
  expect_error(fsdp_io_st_reader_open(&r, path), "after the JSON object");
  buf[0] = 1;
  for (int i = 1; i < 8; i++) buf[i] = 0;
  spit(path, buf, size);
  expect_error(fsdp_io_st_reader_open(&r, path), "too short for a JSON object");
  /* just over the format's limit */
  uint64_t big = (uint64_t)FSDP_IO_ST_MAX_HEADER + 1;
  int fd = open(path, O_WRONLY | O_TRUNC);
  assert_true(fd >= 0);
  unsigned char len8[8];
  for (int i = 0; i < 8; i++) len8[i] = (unsigned char)(big >> (8 * i));
  assert_int_equal(write(fd, len8, 8), 8);
  assert_int_equal(ftruncate(fd, (off_t)(8 + big)), 0); /* sparse */
  close(fd);
  expect_error(fsdp_io_st_reader_open(&r, path), "over the format's limit");
  /* a folder, a missing file */
  expect_error(fsdp_io_st_reader_open(&r, fx->dir), "not a regular file");
  const char *missing = path_in(fx, "missing.safetensors");
  expect_error(fsdp_io_st_reader_open(&r, missing), "cannot open: No such file or directory");
  expect_msg_has(missing);
  free(buf);
}

/* Hand-made headers, one defect each: the message names the file and the tensor. */
static void test_bad_headers(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "hand.safetensors");
  static const struct {
    const char *json;
    size_t ndata;
    const char *needle;
  } cases[] = {
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
       12, "tensor 'b': data_offsets [4, 12) overlap those of tensor 'a'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
       8, "overlap those of tensor"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
       20, "tensor 'b': hole in the data section: bytes [8, 12)"},
      {"{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12,
       "tensor 'b': hole in the data section: bytes [0, 4)"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8,
       "tensor 'a': data_offsets [0, 8) hold 8 bytes but shape (3) of F32 needs 12"},
      {"{\"a\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
       "tensor 'a': unknown dtype 'F33'"},
      {"{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "tensor 'a': missing or non-string"},
      {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, "tensor 'a': missing or non-array"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "tensor 'a': \"data_offsets\" must be"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8,
       "tensor 'a': \"data_offsets\" must be"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,-8]}}", 8,
       "tensor 'a': \"data_offsets\" must hold integers"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}", 8,
       "end before they begin"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}}", 8,
       "tensor 'a': shape entry 0 is not an integer"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,2],\"data_offsets\":[0,8]}}", 8,
       "tensor 'a': 9 dimensions"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}}", 8,
       "tensor 'a': element count overflows"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4,
       "tensor 'a': data_offsets [0, 8) run past the data section (4 bytes)"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
       16, "tensor 'a' appears twice"},
      {"{\"a\":[1,2]}", 0, "tensor 'a': its header entry is not a JSON object"},
      {"{\"__metadata__\":{\"k\":1}}", 0, "__metadata__ value of 'k' is not a string"},
      {"{\"__metadata__\":[]}", 0, "\"__metadata__\" is not a JSON object"},
      {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, "\"__metadata__\" appears twice"},
      {"{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, "key 'k' appears twice"},
      {"[1,2,3]", 0, "header is JSON but not an object"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8,
       "header is not valid JSON"},
      {"{\"a\":1} x", 0, "unexpected byte 0x78 after the JSON object"},
      /* cJSON would read this key as "wte.weight" */
      {"{\"wte.weight\\u0000evil\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
       "header: the string \"wte.weight\\u0000evil\" (byte 1) holds a NUL character"},
      {"{\"__metadata__\":{\"k\":\"v\\u0000w\"}}", 0,
       "header: the string \"v\\u0000w\" (byte 21) holds a NUL character"},
      {"{\"__metadata__\":{\"fsdp.xxh3_64.zz\":\"0000000000000000\"}}", 0,
       "checksum for tensor 'zz', which the file does not have"},
      {"{\"__metadata__\":{\"fsdp.xxh3_64.a\":\"00000000000000zz\"},"
       "\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}",
       0, "tensor 'a': malformed checksum"},
      {"{\"__metadata__\":{\"fsdp.xxh3_64.a\":\"2d06800538d394c2\"},"
       "\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}",
       0, "tensor checksums but no header checksum"},
      {"{\"__metadata__\":{\"x\":\"1\",\"fsdp.header.xxh3_64\":\"0000000000000000\"}}", 0,
       "is not the header's first member"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    char data[32] = {0};
    write_raw(path, cases[k].json, data, cases[k].ndata);
    fsdp_io_st_reader *r = (void *)1;
    int rc = fsdp_io_st_reader_open(&r, path);
    if (rc != FSDP_ERR) fail_msg("case %zu (%s) opened", k, cases[k].json);
    assert_null(r);
    if (strstr(fsdp_error_msg(), cases[k].needle) == NULL ||
        strncmp(fsdp_error_msg(), path, strlen(path)) != 0)
      fail_msg("case %zu: \"%s\" does not start with the path or lacks \"%s\"", k,
               fsdp_error_msg(), cases[k].needle);
  }
  /* a raw NUL byte in a name is refused the same way (as \u0000 in the message); an escaped
   * backslash before "u0000" is no NUL, and neither is \u00001 spelled otherwise */
  static const char raw[] = "{\"a\0b\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}";
  unsigned char buf[8 + sizeof raw - 1];
  for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((sizeof raw - 1) >> (8 * i));
  memcpy(buf + 8, raw, sizeof raw - 1);
  spit(path, buf, sizeof buf);
  fsdp_io_st_reader *r = (void *)1;
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_ERR);
  expect_msg_has("header: the string \"a\\u0000b\" (byte 1) holds a NUL character");
  write_raw(path, "{\"a\\\\u0000\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}",
            NULL, 0);
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  assert_non_null(fsdp_io_st_reader_find(r, "a\\u0000"));
  fsdp_io_st_reader_close(r);
  /* zero-size tensors anywhere, dims of 0, and a scalar are fine */
  write_raw(path,
            "{\"z\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[0,0]},"
            "\"s\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[0,2]},"
            "\"y\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2,4]}}",
            "abcd", 4);
  assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
  assert_int_equal(fsdp_io_st_reader_count(r), 3);
  assert_int_equal(fsdp_io_st_reader_find(r, "s")->numel, 1);
  fsdp_io_st_reader_close(r);
}

/* ---- writer errors ------------------------------------------------------------------------- */

static void test_writer_errors(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "w.safetensors");
  fsdp_io_st_writer *w = (void *)1;
  fsdp_io_st_entry dup[2] = {{.name = "x", .ndim = 1, .shape = {2}},
                             {.name = "x", .ndim = 1, .shape = {2}}};
  expect_error(fsdp_io_st_writer_open(&w, path, dup, 2, NULL, 0), "tensor 'x' appears twice");
  assert_null(w);
  expect_msg_has(path);
  fsdp_io_st_entry bad[1] = {{.name = "x", .dtype = (fsdp_io_dtype)99, .ndim = 1, .shape = {2}}};
  expect_error(fsdp_io_st_writer_open(&w, path, bad, 1, NULL, 0), "tensor 'x': unknown dtype 99");
  bad[0] = (fsdp_io_st_entry){.name = "x", .ndim = 1, .shape = {-2}};
  expect_error(fsdp_io_st_writer_open(&w, path, bad, 1, NULL, 0), "negative size");
  bad[0] = (fsdp_io_st_entry){.name = "x", .ndim = 9};
  expect_error(fsdp_io_st_writer_open(&w, path, bad, 1, NULL, 0), "9 dimensions");
  bad[0] = (fsdp_io_st_entry){.name = "__metadata__"};
  expect_error(fsdp_io_st_writer_open(&w, path, bad, 1, NULL, 0), "cannot name a tensor");
  bad[0] = (fsdp_io_st_entry){.name = ""};
  expect_error(fsdp_io_st_writer_open(&w, path, bad, 1, NULL, 0), "empty tensor name");
  bad[0] = (fsdp_io_st_entry){.name = "bad\xff"};
  expect_error(fsdp_io_st_writer_open(&w, path, bad, 1, NULL, 0), "not valid UTF-8");
  bad[0] = (fsdp_io_st_entry){.name = "x", .ndim = 3, .shape = {1 << 30, 1 << 30, 1 << 30}};
  expect_error(fsdp_io_st_writer_open(&w, path, bad, 1, NULL, 0), "overflows");
  fsdp_io_kv kv[2] = {{"fsdp.xxh3_64.x", "1"}, {"k", "v"}};
  expect_error(fsdp_io_st_writer_open(&w, path, dup, 1, kv, 1), "reserved");
  kv[0] = (fsdp_io_kv){"k", "w"};
  expect_error(fsdp_io_st_writer_open(&w, path, dup, 1, kv, 2), "metadata key 'k' appears twice");
  kv[0] = (fsdp_io_kv){"k", "\xc0\xaf"}; /* overlong '/' */
  expect_error(fsdp_io_st_writer_open(&w, path, dup, 1, kv, 1), "not valid UTF-8");
  assert_false(exists(path));
  assert_int_equal(count_temps(fx->dir), 0);

  /* order, overrun, incomplete commit — with a previous file in place */
  assert_int_equal(write_model(path), FSDP_OK);
  size_t size0;
  unsigned char *before = slurp(path, &size0);
  assert_int_equal(fsdp_io_st_writer_open(&w, path, ENTRIES, NENT, NULL, 0), FSDP_OK);
  float x[8] = {0};
  expect_error(fsdp_io_st_writer_write(w, "nope", x, 1), "'nope' is not one of the file's entries");
  expect_error(fsdp_io_st_writer_write(w, "b", x, 1),
               "tensor 'b' written before 'a' is complete (0 of 24 bytes)");
  expect_msg_has(path);
  assert_int_equal(fsdp_io_st_writer_write(w, "a", x, 4), FSDP_OK);
  expect_error(fsdp_io_st_writer_write(w, "a", x, 3), "runs past its end (6 elements)");
  expect_error(fsdp_io_st_writer_write(w, "a", x, -1), "negative element count");
  assert_int_equal(fsdp_io_st_writer_write(w, "a", x, 2), FSDP_OK);
  expect_error(fsdp_io_st_writer_write(w, "a", x, 1), "'a' is already complete");
  assert_int_equal(fsdp_io_st_writer_write(w, "b", x, 1), FSDP_OK);
  /* c has no elements: d comes next */
  expect_error(fsdp_io_st_writer_write(w, "e", x, 1), "before 'layer.0/w");
  expect_error(fsdp_io_st_writer_commit(w), "incomplete at commit: 0 of 32 bytes");
  expect_msg_has(path);
  size_t size1;
  unsigned char *after = slurp(path, &size1);
  assert_int_equal(size0, size1);
  assert_memory_equal(before, after, size0);
  assert_int_equal(count_temps(fx->dir), 0);
  free(before);
  free(after);
  fsdp_io_st_writer_abort(NULL);
}

/* Interrupted writes (abort, injected ENOSPC/EIO/rename failure) leave the previous file. */
static void test_interrupted_writes(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "model.safetensors");
  assert_int_equal(write_model(path), FSDP_OK);
  size_t size0;
  unsigned char *before = slurp(path, &size0);

  static const struct {
    fsdp_io_fault_point point;
    int err;
    uint64_t after;
    const char *needle;
  } faults[] = {
      {FSDP_IO_FAULT_NONE, 0, 0, NULL}, /* plain abort */
      {FSDP_IO_FAULT_OPEN, EACCES, 0, "Permission denied"},
      {FSDP_IO_FAULT_WRITE, ENOSPC, 0, "No space left on device"},
      {FSDP_IO_FAULT_WRITE, ENOSPC, 1000, "write failed at byte"},
      {FSDP_IO_FAULT_FSYNC, EIO, 0, "fsync"},
      {FSDP_IO_FAULT_RENAME, EXDEV, 0, "cannot rename"},
  };
  for (size_t k = 0; k < sizeof faults / sizeof faults[0]; k++) {
    fsdp_io_fault_set(faults[k].point, faults[k].err, faults[k].after);
    fsdp_io_st_writer *w = NULL;
    int rc = fsdp_io_st_writer_open(&w, path, ENTRIES, NENT, META, 2);
    float zeros[1000] = {0};
    for (int i = 0; i < NENT && rc == FSDP_OK; i++)
      rc = fsdp_io_st_writer_write(w, ENTRIES[i].name, zeros, NUMEL[i]);
    if (faults[k].point == FSDP_IO_FAULT_NONE) {
      assert_int_equal(rc, FSDP_OK);
      fsdp_io_st_writer_abort(w);
    } else {
      if (rc == FSDP_OK) rc = fsdp_io_st_writer_commit(w);
      else fsdp_io_st_writer_abort(w);
      expect_error(rc, faults[k].needle);
      expect_msg_has(path);
    }
    size_t size1;
    unsigned char *after = slurp(path, &size1);
    assert_int_equal(size0, size1);
    assert_memory_equal(before, after, size0);
    free(after);
    assert_int_equal(count_temps(fx->dir), 0);
    fsdp_io_st_reader *r;
    assert_int_equal(fsdp_io_st_reader_open(&r, path), FSDP_OK);
    float out[1000];
    assert_int_equal(fsdp_io_st_reader_read(r, out, "e", 0, 1000), FSDP_OK);
    assert_memory_equal(out, model_data(4), 4000);
    fsdp_io_st_reader_close(r);
  }
  /* a fault fires once: the next save succeeds */
  fsdp_io_fault_set(FSDP_IO_FAULT_WRITE, ENOSPC, 10);
  assert_int_equal(write_model(path), FSDP_ERR);
  assert_int_equal(write_model(path), FSDP_OK);
  free(before);
}

/* ---- atomic files ------------------------------------------------------------------------ */

static void test_atomic_basics(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "f.bin");
  fsdp_io_atomic *f;
  assert_int_equal(fsdp_io_atomic_open(&f, path), FSDP_OK);
  assert_string_equal(fsdp_io_atomic_path(f), path);
  char want[64], host[256] = {0};
  gethostname(host, sizeof host - 1);
  host[strcspn(host, ".")] = '\0'; /* the tag maps a dot (and past it) to '-' */
  snprintf(want, sizeof want, ".%ld.%ld", (long)getpid(), (long)gettid());
  char tmp[1024];
  snprintf(tmp, sizeof tmp, "%s", fsdp_io_atomic_temp_path(f));
  assert_non_null(strstr(tmp, "/.f.bin.tmp."));
  assert_non_null(strstr(tmp, host));
  assert_string_equal(tmp + strlen(tmp) - strlen(want), want);
  assert_true(exists(tmp));
  assert_false(exists(path)); /* nothing under the final name before commit */
  /* bytes on both sides of the 1 MiB buffer, a patch across the flushed/buffered boundary */
  size_t n = (3u << 20) / 2;
  unsigned char *src = malloc(n + (2u << 20));
  for (size_t i = 0; i < n + (2u << 20); i++) src[i] = (unsigned char)(i * 7 + 3);
  assert_int_equal(fsdp_io_atomic_write(f, src, 10), FSDP_OK);
  assert_int_equal(fsdp_io_atomic_write(f, src + 10, n - 10), FSDP_OK);
  assert_int_equal(fsdp_io_atomic_write(f, src + n, 2u << 20), FSDP_OK); /* direct */
  assert_int_equal(fsdp_io_atomic_write(f, src + n, 0), FSDP_OK);
  assert_int_equal(fsdp_io_atomic_size(f), n + (2u << 20));
  unsigned char patch[100];
  memset(patch, 0xAB, sizeof patch);
  assert_int_equal(fsdp_io_atomic_pwrite(f, patch, 100, (1u << 20) - 50), FSDP_OK);
  memcpy(src + (1u << 20) - 50, patch, 100);
  assert_int_equal(fsdp_io_atomic_pwrite(f, patch, 4, 0), FSDP_OK);
  memcpy(src, patch, 4);
  expect_error(fsdp_io_atomic_pwrite(f, patch, 2, n + (2u << 20) - 1), "past the");
  assert_int_equal(fsdp_io_atomic_commit(f), FSDP_OK);
  assert_false(exists(tmp));
  size_t size;
  unsigned char *got = slurp(path, &size);
  assert_int_equal(size, n + (2u << 20));
  assert_memory_equal(got, src, size);
  free(got);
  /* small writes that stay in the buffer, then a patch in the buffer */
  assert_int_equal(fsdp_io_atomic_open(&f, path), FSDP_OK);
  for (int i = 0; i < 100; i++) assert_int_equal(fsdp_io_atomic_write(f, "abc", 3), FSDP_OK);
  assert_int_equal(fsdp_io_atomic_pwrite(f, "XY", 2, 298), FSDP_OK);
  assert_int_equal(fsdp_io_atomic_commit(f), FSDP_OK);
  got = slurp(path, &size);
  assert_int_equal(size, 300);
  assert_memory_equal(got + 294, "abcaXY", 6);
  free(got);
  assert_int_equal(count_temps(fx->dir), 0);
  fsdp_io_atomic_abort(NULL);
  free(src);
}

static void test_atomic_abort_and_stale(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "f.txt");
  spit(path, "old", 3);
  fsdp_io_atomic *f;
  assert_int_equal(fsdp_io_atomic_open(&f, path), FSDP_OK);
  assert_int_equal(fsdp_io_atomic_write(f, "new content", 11), FSDP_OK);
  fsdp_io_atomic_abort(f);
  size_t size;
  unsigned char *got = slurp(path, &size);
  assert_int_equal(size, 3);
  assert_memory_equal(got, "old", 3);
  free(got);
  assert_int_equal(count_temps(fx->dir), 0);
  /* a leftover temporary with this pid and tid (a crashed process) is replaced */
  char stale[512];
  assert_int_equal(fsdp_io_atomic_open(&f, path), FSDP_OK);
  snprintf(stale, sizeof stale, "%s", fsdp_io_atomic_temp_path(f));
  fsdp_io_atomic_abort(f);
  spit(stale, "stale junk", 10);
  assert_int_equal(fsdp_io_atomic_open(&f, path), FSDP_OK);
  assert_int_equal(fsdp_io_atomic_write(f, "new", 3), FSDP_OK);
  assert_int_equal(fsdp_io_atomic_commit(f), FSDP_OK);
  got = slurp(path, &size);
  assert_int_equal(size, 3);
  assert_memory_equal(got, "new", 3);
  free(got);
  assert_int_equal(count_temps(fx->dir), 0);
  /* a relative path (the temporary goes to the working folder) */
  char cwd[512];
  assert_non_null(getcwd(cwd, sizeof cwd));
  assert_int_equal(chdir(fx->dir), 0);
  assert_int_equal(fsdp_io_atomic_open(&f, "rel.txt"), FSDP_OK);
  assert_int_equal(strncmp(fsdp_io_atomic_temp_path(f), ".rel.txt.tmp.", 13), 0);
  assert_int_equal(fsdp_io_atomic_commit(f), FSDP_OK);
  assert_int_equal(chdir(cwd), 0);
  assert_true(exists(path_in(fx, "rel.txt")));
  /* a failed write makes the handle refuse the rest; commit then cleans up */
  fsdp_io_fault_set(FSDP_IO_FAULT_WRITE, EIO, 0);
  assert_int_equal(fsdp_io_atomic_open(&f, path), FSDP_OK);
  char big[(1 << 20) + 1] = {0};
  expect_error(fsdp_io_atomic_write(f, big, sizeof big), "Input/output error");
  expect_error(fsdp_io_atomic_write(f, "x", 1), "Input/output error");
  expect_error(fsdp_io_atomic_commit(f), "write failed at byte 0: Input/output error");
  assert_int_equal(count_temps(fx->dir), 0);
  got = slurp(path, &size);
  assert_memory_equal(got, "new", 3);
  free(got);
}

/* A process killed during a save leaves its temporary behind; the next atomic file opened in
 * that folder removes it, and only it: a live process's temporary, another host's and
 * files that are no temporary stay. */
static void test_atomic_stale_of_dead_process(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "m.safetensors");
  pid_t child = fork();
  assert_true(child >= 0);
  if (child == 0) { /* a save killed midway: kill -9 */
    fsdp_io_atomic *cf;
    if (fsdp_io_atomic_open(&cf, path) == FSDP_OK) fsdp_io_atomic_write(cf, "partial", 7);
    raise(SIGKILL);
    _exit(1);
  }
  int status;
  assert_int_equal(waitpid(child, &status, 0), child);
  assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  assert_int_equal(count_temps(fx->dir), 1); /* the dead process's */
  /* the same dead pid in the name format before hosts were recorded, and on another host */
  char legacy[512], other[512], plain[512];
  snprintf(legacy, sizeof legacy, "%s/.old.bin.tmp.%ld.%ld", fx->dir, (long)child, (long)child);
  snprintf(other, sizeof other, "%s/.m.bin.tmp.elsewhere-7.%ld.%ld", fx->dir, (long)child,
           (long)child);
  snprintf(plain, sizeof plain, "%s/.notes.tmp", fx->dir);
  spit(legacy, "x", 1);
  spit(other, "x", 1);
  spit(plain, "x", 1);
  /* a live process's save in progress (this one's: another thread's would look the same) */
  fsdp_io_atomic *live;
  assert_int_equal(fsdp_io_atomic_open(&live, path_in(fx, "live.bin")), FSDP_OK);
  char live_tmp[512];
  snprintf(live_tmp, sizeof live_tmp, "%s", fsdp_io_atomic_temp_path(live));
  /* opening it already swept the folder: the dead process's temporaries are gone */
  assert_int_equal(count_temps(fx->dir), 2); /* live's and the other host's */
  assert_false(exists(legacy));
  assert_true(exists(other));
  assert_true(exists(plain));
  assert_true(exists(live_tmp));
  /* the next save into the folder leaves the live one alone */
  fsdp_io_atomic *f;
  assert_int_equal(fsdp_io_atomic_open(&f, path), FSDP_OK);
  assert_int_equal(fsdp_io_atomic_write(f, "whole", 5), FSDP_OK);
  assert_int_equal(fsdp_io_atomic_commit(f), FSDP_OK);
  assert_true(exists(live_tmp));
  fsdp_io_atomic_abort(live);
  assert_int_equal(count_temps(fx->dir), 1); /* the other host's */
  remove(other);
  remove(plain);
}

static void test_atomic_unwritable(void **state) {
  fixture *fx = *state;
  fsdp_io_atomic *f = (void *)1;
  const char *missing = path_in(fx, "no/such/folder/x.bin");
  expect_error(fsdp_io_atomic_open(&f, missing), "No such file or directory");
  assert_null(f);
  expect_msg_has(missing);
  const char *file = path_in(fx, "plain");
  spit(file, "x", 1);
  const char *under_file = path_in(fx, "plain/x.bin");
  expect_error(fsdp_io_atomic_open(&f, under_file), "Not a directory");
  expect_msg_has(under_file);
  expect_error(fsdp_io_atomic_open(&f, ""), "empty path");
  expect_error(fsdp_io_atomic_open(&f, path_in(fx, "dir/")), "folder name");
  char longname[300];
  memset(longname, 'n', 250);
  longname[250] = '\0';
  expect_error(fsdp_io_atomic_open(&f, path_in(fx, longname)), "file name too long");
  /* a read-only folder: a real EACCES unless running as root, which ignores permissions */
  const char *ro = path_in(fx, "ro");
  assert_int_equal(mkdir(ro, 0500), 0);
  const char *in_ro = path_in(fx, "ro/x.safetensors");
  fsdp_io_st_writer *w = (void *)1;
  int rc = fsdp_io_st_writer_open(&w, in_ro, ENTRIES, 1, NULL, 0);
  if (geteuid() != 0) {
    expect_error(rc, "Permission denied");
    expect_msg_has(in_ro);
    assert_null(w);
  } else {
    assert_int_equal(rc, FSDP_OK);
    fsdp_io_st_writer_abort(w);
    fsdp_io_fault_set(FSDP_IO_FAULT_OPEN, EACCES, 0);
    expect_error(fsdp_io_st_writer_open(&w, in_ro, ENTRIES, 1, NULL, 0), "Permission denied");
    expect_msg_has(in_ro);
  }
  assert_int_equal(count_temps(ro), 0);
}

static void test_fault_names(void **state) {
  (void)state;
  assert_int_equal(fsdp_io_fault_point_from_name("write"), FSDP_IO_FAULT_WRITE);
  assert_int_equal(fsdp_io_fault_point_from_name("rename"), FSDP_IO_FAULT_RENAME);
  assert_int_equal(fsdp_io_fault_point_from_name("none"), FSDP_IO_FAULT_NONE);
  assert_int_equal(fsdp_io_fault_point_from_name("bogus"), -1);
  assert_int_equal(fsdp_io_dtype_from_name("BF16"), FSDP_IO_BF16);
  assert_int_equal(fsdp_io_dtype_from_name("F4"), -1);
  assert_int_equal(fsdp_io_dtype_size(FSDP_IO_F64), 8);
  assert_string_equal(fsdp_io_dtype_name(FSDP_IO_U16), "U16");
  assert_true(fsdp_io_utf8_valid("aé€😀", strlen("aé€😀")));
  assert_false(fsdp_io_utf8_valid("\xed\xa0\x80", 3)); /* surrogate */
  assert_false(fsdp_io_utf8_valid("\xf4\x90\x80\x80", 4)); /* > U+10FFFF */
  assert_false(fsdp_io_utf8_valid("\xe2\x82", 2));         /* cut short */
}

/* ---- JSON ---------------------------------------------------------------------------------- */

static void test_json(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "index.json");
  cJSON *doc = cJSON_CreateObject();
  cJSON_AddNumberToObject(doc, "world_size", 4);
  cJSON_AddStringToObject(doc, "name", "ckpt \"1\"");
  cJSON *arr = cJSON_AddArrayToObject(doc, "files");
  cJSON_AddItemToArray(arr, cJSON_CreateString("rank0.safetensors"));
  assert_int_equal(fsdp_io_json_write_atomic(path, doc), FSDP_OK);
  assert_int_equal(count_temps(fx->dir), 0);
  cJSON *back = NULL;
  assert_int_equal(fsdp_io_json_read(path, &back), FSDP_OK);
  assert_true(cJSON_Compare(doc, back, 1));
  cJSON_Delete(back);
  /* a failed rewrite keeps the old index */
  fsdp_io_fault_set(FSDP_IO_FAULT_RENAME, EIO, 0);
  cJSON_AddBoolToObject(doc, "extra", 1);
  expect_error(fsdp_io_json_write_atomic(path, doc), "cannot rename");
  assert_int_equal(fsdp_io_json_read(path, &back), FSDP_OK);
  assert_null(cJSON_GetObjectItem(back, "extra"));
  cJSON_Delete(back);
  cJSON_Delete(doc);
  expect_error(fsdp_io_json_write_atomic(path, NULL), "no JSON document");

  spit(path, "{\n  \"a\": 1,\n  \"b\": [1, 2,, 3]\n}\n", 32);
  back = (void *)1;
  expect_error(fsdp_io_json_read(path, &back), "not valid JSON: error at line 3, column 14");
  assert_null(back);
  expect_msg_has(path);
  spit(path, "{} {}", 5);
  expect_error(fsdp_io_json_read(path, &back), "unexpected text after the document");
  spit(path, "", 0);
  expect_error(fsdp_io_json_read(path, &back), "empty file");
  expect_error(fsdp_io_json_read(path_in(fx, "none.json"), &back), "cannot open");
  expect_msg_has("none.json");
  expect_error(fsdp_io_json_read(fx->dir, &back), "not a regular file");
  /* a NUL in a key would alias "a\u0000b" to "a" */
  spit(path, "{\"a\\u0000b\": 1}", 15);
  expect_error(fsdp_io_json_read(path, &back),
               "JSON document: the string \"a\\u0000b\" (byte 1) holds a NUL character");
  assert_null(back);
  assert_int_equal(fsdp_io_json_parse(&back, "m", "[1, 2] \n", 8), FSDP_OK);
  assert_int_equal(cJSON_GetArraySize(back), 2);
  cJSON_Delete(back);
}

/* The bare words NaN, Infinity and -Infinity parse as strings only when asked, never inside a
 * string, and an error's line and column are those of the caller's text. */
static void test_json_parse_nonfinite(void **state) {
  (void)state;
  static const char text[] = "{\"a\": NaN, \"b\": [Infinity, -Infinity], \"s\": \"NaN \\\" NaN\"}";
  cJSON *doc = (void *)1;
  size_t line = 9, col = 9;
  expect_error(fsdp_io_json_parse_ex(&doc, "m", text, strlen(text), 0, &line, &col),
               "m: not valid JSON: error at line 1, column 7 (unexpected 'N')");
  assert_null(doc);
  assert_int_equal(line, 1);
  assert_int_equal(col, 7);
  assert_int_equal(
      fsdp_io_json_parse_ex(&doc, "m", text, strlen(text), FSDP_IO_JSON_NONFINITE, NULL, NULL),
      FSDP_OK);
  assert_string_equal(cJSON_GetObjectItem(doc, "a")->valuestring, "NaN");
  cJSON *b = cJSON_GetObjectItem(doc, "b");
  assert_string_equal(cJSON_GetArrayItem(b, 0)->valuestring, "Infinity");
  assert_string_equal(cJSON_GetArrayItem(b, 1)->valuestring, "-Infinity");
  assert_string_equal(cJSON_GetObjectItem(doc, "s")->valuestring, "NaN \" NaN");
  cJSON_Delete(doc);
  /* after two rewritten words, on the next line: the column of the text as given */
  static const char bad[] = "[NaN, -Infinity,\n  1, x]";
  expect_error(
      fsdp_io_json_parse_ex(&doc, "m", bad, strlen(bad), FSDP_IO_JSON_NONFINITE, &line, &col),
      "error at line 2, column 6 (unexpected 'x')");
  assert_int_equal(line, 2);
  assert_int_equal(col, 6);
  expect_error(fsdp_io_json_parse_ex(&doc, "m", "[1, NaN", 7, FSDP_IO_JSON_NONFINITE, &line, &col),
               "error at line 1, column 8 (unexpected end of text)");
  expect_error(fsdp_io_json_parse_ex(&doc, "m", "[1] NaN", 7, FSDP_IO_JSON_NONFINITE, &line, &col),
               "unexpected text after the document at line 1, column 5");
}

/* ---- checkpoint index (index.c) ----------------------------------------------------------- */

/* A valid 2-rank index; each case below replaces one piece of it. */
static const char *const INDEX_OK =
    "{\"format\": \"fsdprun.sharded\", \"version\": 1, \"generation\": 3, \"world_size\": 2,"
    " \"step\": 50,"
    " \"files\": [{\"rank\": 0, \"name\": \"g3-rank0-of2.safetensors\", \"bytes\": 100,"
    "   \"header_xxh3\": \"0123456789abcdef\"},"
    "  {\"rank\": 1, \"name\": \"g3-rank1-of2.safetensors\", \"bytes\": 100,"
    "   \"header_xxh3\": \"fedcba9876543210\"}],"
    " \"params\": [{\"path\": \"wte.weight\", \"shape\": [4, 3], \"numel\": 12,"
    "   \"aliases\": [\"head.weight\"], \"mask\": true, \"dtype\": \"BF16\","
    "   \"slices\": [{\"rank\": 0, \"first\": 0, \"count\": 5}, {\"rank\": 1, \"first\": 5, \"count\": 7}]},"
    "  {\"path\": \"b\", \"shape\": [], \"numel\": 1, \"dtype\": \"I64\","
    "   \"slices\": [{\"rank\": 1, \"first\": 0, \"count\": 1}]},"
    "  {\"path\": \"e\", \"shape\": [0], \"numel\": 0, \"slices\": {}}],"
    " \"optimizer\": {\"kind\": \"AdamW\", \"step\": 50, \"lr\": 0.001, \"hyper\": {},"
    "   \"states\": [\"exp_avg\", \"exp_avg_sq\"]},"
    " \"rng\": [{\"seed\": \"0000000000000001\", \"streams\": {\"randn\": \"0000000000000008\"}},"
    "  {\"seed\": \"0000000000000001\", \"streams\": {}}],"
    " \"loaders\": {\"train\": 50}, \"schedule\": {\"k\": 50}, \"extra\": [1, \"x\"],"
    " \"extra_tensors\": [{\"name\": \"fsdp.extra:1\", \"dtype\": \"BF16\", \"shape\": [2, 3]},"
    "  {\"name\": \"fsdp.extra:2\", \"dtype\": \"BOOL\", \"shape\": []}]}";

static char *replace_once(const char *s, const char *from, const char *to) {
  const char *at = strstr(s, from);
  assert_non_null(at);
  size_t n = strlen(s) - strlen(from) + strlen(to);
  char *out = malloc(n + 1);
  assert_non_null(out);
  memcpy(out, s, (size_t)(at - s));
  strcpy(out + (at - s), to);
  strcat(out, at + strlen(from));
  return out;
}

static void test_index(void **state) {
  (void)state;
  cJSON *doc = NULL;
  assert_int_equal(fsdp_io_index_parse(&doc, "idx.json", INDEX_OK, strlen(INDEX_OK)), FSDP_OK);
  assert_non_null(doc);
  cJSON_Delete(doc);
  static const struct {
    const char *from, *to, *expect;
  } cases[] = {
      {"\"fsdprun.sharded\"", "\"other\"", "not a sharded checkpoint index"},
      {"\"version\": 1", "\"version\": 3", "index version must be 1 or 2"},
      {"\"version\": 1", "\"version\": 0", "index version must be 1 or 2"},
      {"\"world_size\": 2", "\"world_size\": 3", "the index cannot serve its world size"},
      {"\"world_size\": 2", "\"world_size\": 0", "'world_size' must be an integer from 1"},
      {"\"step\": 50,", "\"step\": 1.5,", "'step' must be an integer"},
      {"\"rank\": 1, \"name\"", "\"rank\": 0, \"name\"", "files[1].rank must be 1"},
      {"g3-rank1-of2.safetensors", "../x", "plain file name"},
      {"g3-rank1-of2.safetensors", ".hidden", "plain file name"},
      {"g3-rank1-of2.safetensors", "g3-rank0-of2.safetensors", "listed for two ranks"},
      {"\"bytes\": 100,", "\"bytes\": 7,", "'bytes' must be an integer >= 8"},
      {"fedcba9876543210", "FEDCBA9876543210", "16 lowercase hex digits"},
      {"\"numel\": 12", "\"numel\": 13", "param 'wte.weight': 'numel' must be the product"},
      {"\"shape\": [4, 3]", "\"shape\": [4, -3]", "param 'wte.weight': 'shape' must hold"},
      {"\"count\": 5}", "\"count\": 4}", "param 'wte.weight': no rank holds elements [4, 5)"},
      {"\"first\": 5, \"count\": 7", "\"first\": 4, \"count\": 7",
       "param 'wte.weight': slice of rank 1 starts at element 4"},
      {"\"first\": 5, \"count\": 7", "\"first\": 5, \"count\": 8", "past the parameter's 12 elements"},
      {"\"first\": 5, \"count\": 7", "\"first\": 5, \"count\": 6",
       "param 'wte.weight': no rank holds elements [11, 12)"},
      {"{\"rank\": 1, \"first\": 5", "{\"rank\": 0, \"first\": 5", "rank 0 holds two slices"},
      {"{\"rank\": 1, \"first\": 5", "{\"rank\": 2, \"first\": 5", "slices[1] must be"},
      {"\"count\": 5}", "\"count\": 0}", "slices[0] must be"},
      {"\"path\": \"b\"", "\"path\": \"wte.weight\"", "param path 'wte.weight' appears twice"},
      {"\"path\": \"b\"", "\"path\": \"head.weight\"", "param path 'head.weight' appears twice"},
      {"\"path\": \"b\"", "\"path\": \"a:b\"", "without ':'"},
      {"\"mask\": true", "\"mask\": 1", "'mask' must be true or false"},
      {"\"kind\": \"AdamW\"", "\"kind\": 3", "optimizer: 'kind'"},
      {"\"exp_avg_sq\"]", "\"exp_avg\"]", "state 'exp_avg' is listed twice"},
      {"\"exp_avg_sq\"]", "\"mask\"]", "not 'mask'"},
      {"\"seed\": \"0000000000000001\", \"streams\": {}", "\"seed\": \"1\", \"streams\": {}",
       "rng[1] must be"},
      {"\"train\": 50", "\"train\": -1", "loaders.train must be an integer >= 0"},
      {"\"schedule\": {\"k\": 50}", "\"schedule\": 3", "'schedule' must be an object"},
      {"\"dtype\": \"BF16\",", "\"dtype\": \"I16\",", "param 'wte.weight': 'dtype' must be one of"},
      {"\"dtype\": \"BF16\",", "\"dtype\": \"bf16\",", "param 'wte.weight': 'dtype' must be one of"},
      {"\"dtype\": \"I64\"", "\"dtype\": 64", "param 'b': 'dtype' must be one of"},
      {"\"dtype\": \"BOOL\"", "\"dtype\": \"U16\"", "extra_tensors[1] must be"},
      {"\"shape\": [2, 3]}", "\"shape\": [2, -3]}", "extra_tensors[0] must be"},
      {"{\"name\": \"fsdp.extra:1\",", "{\"name\": \"\",", "extra_tensors[0] must be"},
      {"\"fsdp.extra:2\"", "\"fsdp.extra:1\"", "extra tensor 'fsdp.extra:1' is listed twice"},
      {"\"extra_tensors\": [", "\"extra_tensors\": 3, \"x\": [", "'extra_tensors' must be an array"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *text = replace_once(INDEX_OK, cases[i].from, cases[i].to);
    doc = (void *)1;
    int rc = fsdp_io_index_parse(&doc, "idx.json", text, strlen(text));
    if (rc != FSDP_ERR || strstr(fsdp_error_msg(), cases[i].expect) == NULL ||
        strncmp(fsdp_error_msg(), "idx.json: ", 10) != 0)
      fail_msg("case %zu (%s -> %s): rc %d, message \"%s\", expected \"%s\"", i, cases[i].from,
               cases[i].to, rc, fsdp_error_msg(), cases[i].expect);
    assert_null(doc);
    free(text);
  }
  expect_error(fsdp_io_index_parse(&doc, "idx.json", "[]", 2), "must be a JSON object");
  expect_error(fsdp_io_index_parse(&doc, "idx.json", "{", 1), "not valid JSON");
}

static void test_index_read(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "index.json");
  cJSON *doc = NULL;
  expect_error(fsdp_io_index_read(path, &doc), "cannot open");
  spit(path, INDEX_OK, strlen(INDEX_OK));
  assert_int_equal(fsdp_io_index_read(path, &doc), FSDP_OK);
  assert_int_equal(cJSON_GetObjectItem(doc, "step")->valueint, 50);
  cJSON_Delete(doc);
  char *bad = replace_once(INDEX_OK, "\"numel\": 12", "\"numel\": 11");
  spit(path, bad, strlen(bad));
  free(bad);
  expect_error(fsdp_io_index_read(path, &doc), "index.json: param 'wte.weight'");
  assert_null(doc);
}

/* fsdp_io_index_write checks what it writes: a good index reads back, a bad one is refused
 * and leaves the file as it was */
static void test_index_write(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "written.json");
  cJSON *doc = NULL, *back = NULL;
  assert_int_equal(fsdp_io_index_parse(&doc, "idx.json", INDEX_OK, strlen(INDEX_OK)), FSDP_OK);
  assert_int_equal(fsdp_io_index_write(path, doc), FSDP_OK);
  assert_int_equal(fsdp_io_index_read(path, &back), FSDP_OK);
  assert_int_equal(cJSON_GetObjectItem(back, "step")->valueint, 50);
  cJSON_Delete(back);
  cJSON_ReplaceItemInObject(doc, "step", cJSON_CreateString("fifty"));
  expect_error(fsdp_io_index_write(path, doc), "written.json:");
  assert_int_equal(fsdp_io_index_read(path, &back), FSDP_OK); /* the first one, still */
  cJSON_Delete(back);
  cJSON_Delete(doc);
  expect_error(fsdp_io_index_write(path, NULL), "no JSON document");
}

/* The index's checksum (version 2): what the writer writes starts with the prefix and the
 * checksum, reads back, and carries the version; every single byte changed in any of 8 ways
 * (each bit) is an error naming the file: the checksum's own digits and the prefix included,
 * and most of them are checksum mismatches found before the JSON is parsed. */
static void test_index_checksum(void **state) {
  fixture *fx = *state;
  const char *path = path_in(fx, "index.json");
  cJSON *doc = NULL, *back = NULL;
  assert_int_equal(fsdp_io_index_parse(&doc, "idx.json", INDEX_OK, strlen(INDEX_OK)), FSDP_OK);
  /* a stale checksum and version in doc are replaced */
  cJSON_AddStringToObject(doc, FSDP_IO_INDEX_CHECKSUM_KEY, "ffffffffffffffff");
  assert_int_equal(fsdp_io_index_write(path, doc), FSDP_OK);
  size_t size;
  unsigned char *buf = slurp(path, &size);
  buf[size] = '\0';
  assert_memory_equal(buf, FSDP_IO_INDEX_PREFIX, strlen(FSDP_IO_INDEX_PREFIX));
  assert_non_null(strstr((char *)buf, "\",\n\t\"version\":\t2,\n"));
  assert_int_equal(buf[size - 1], '\n');
  assert_int_equal(fsdp_io_index_read(path, &back), FSDP_OK);
  assert_int_equal(cJSON_GetObjectItem(back, "version")->valueint, FSDP_IO_INDEX_VERSION);
  char digits[17] = {0};
  memcpy(digits, buf + strlen(FSDP_IO_INDEX_PREFIX), 16);
  assert_string_equal(cJSON_GetObjectItem(back, FSDP_IO_INDEX_CHECKSUM_KEY)->valuestring, digits);
  cJSON_DeleteItemFromObject(back, "version");
  cJSON_DeleteItemFromObject(back, FSDP_IO_INDEX_CHECKSUM_KEY);
  cJSON_DeleteItemFromObject(doc, "version");
  cJSON_DeleteItemFromObject(doc, FSDP_IO_INDEX_CHECKSUM_KEY);
  assert_true(cJSON_Compare(doc, back, 1));
  cJSON_Delete(back);
  cJSON_Delete(doc);

  int mismatches = 0;
  for (size_t b = 0; b < size; b++)
    for (int bit = 0; bit < 8; bit++) {
      buf[b] ^= (unsigned char)(1u << bit);
      back = (void *)1;
      int rc = fsdp_io_index_parse(&back, "flip.json", (char *)buf, size);
      if (rc != FSDP_ERR)
        fail_msg("flipping bit %d of index byte %zu ('%c') went unnoticed", bit, b,
                 buf[b] ^ (1u << bit));
      assert_null(back);
      expect_msg_has("flip.json: ");
      if (strstr(fsdp_error_msg(), "index checksum mismatch")) mismatches++;
      buf[b] ^= (unsigned char)(1u << bit);
    }
  assert_true(mismatches > (int)(7 * size)); /* most: the prefix's flips are the others */
  /* "lr": 0.001 -> 0.000 (valid JSON, valid schema): the checksum, naming the file */
  char *lr = strstr((char *)buf, "\"lr\":\t0.001");
  assert_non_null(lr);
  lr[strlen("\"lr\":\t0.00")] ^= 0x01;
  spit(path, buf, size);
  expect_error(fsdp_io_index_read(path, &back), "index.json: index checksum mismatch (stored ");
  assert_null(back);
  /* restamped (what a program that means the change does), it reads */
  assert_int_equal(fsdp_io_index_stamp((char *)buf, size, "x"), FSDP_OK);
  assert_int_equal(fsdp_io_index_parse(&back, "idx.json", (char *)buf, size), FSDP_OK);
  assert_true(cJSON_GetObjectItem(cJSON_GetObjectItem(back, "optimizer"), "lr")->valuedouble == 0);
  cJSON_Delete(back);
  /* damaged digits: named as such */
  buf[strlen(FSDP_IO_INDEX_PREFIX) + 3] = 'g';
  expect_error(fsdp_io_index_parse(&back, "idx.json", (char *)buf, size),
               "idx.json: the index's checksum (its first member, 'index_xxh3') is not 16");
  free(buf);

  /* version 2 rewritten by another program (another layout, the checksum elsewhere) */
  char *moved = replace_once(INDEX_OK, "\"version\": 1",
                             "\"version\": 2, \"index_xxh3\": \"0123456789abcdef\"");
  expect_error(fsdp_io_index_parse(&back, "idx.json", moved, strlen(moved)),
               "idx.json: an index of version 2 starts with its checksum");
  assert_null(back);
  free(moved);
  moved = replace_once(INDEX_OK, "\"version\": 1", "\"version\": 2");
  expect_error(fsdp_io_index_parse(&back, "idx.json", moved, strlen(moved)),
               "idx.json: an index of version 2 starts with its checksum");
  /* the document alone (no text to check the checksum against): the member's form */
  cJSON *parsed = cJSON_Parse(moved);
  expect_error(fsdp_io_index_check(parsed, "idx.json"),
               "idx.json: 'index_xxh3' must be 16 lowercase hex digits");
  cJSON_Delete(parsed);
  free(moved);
  /* version 1 (before the checksum): read unchecked, as before */
  assert_int_equal(fsdp_io_index_parse(&back, "idx.json", INDEX_OK, strlen(INDEX_OK)), FSDP_OK);
  cJSON_Delete(back);
  /* stamp needs the prefix */
  char plain[] = "{\"a\": 1}";
  expect_error(fsdp_io_index_stamp(plain, strlen(plain), "p.json"),
               "p.json: the index text does not start with its checksum member");
}

/* ---- folders (fs.c) ----------------------------------------------------------------------- */

static void test_folders(void **state) {
  fixture *fx = *state;
  char sub[600];
  snprintf(sub, sizeof sub, "%s/a/b/", fx->dir);
  assert_int_equal(fsdp_io_mkdirs(sub), FSDP_OK);
  assert_int_equal(fsdp_io_mkdirs(sub), FSDP_OK); /* idempotent */
  char f1[700], f2[700];
  snprintf(f1, sizeof f1, "%s/a/b/one", fx->dir);
  snprintf(f2, sizeof f2, "%s/a/b/two", fx->dir);
  spit(f1, "1", 1);
  spit(f2, "2", 1);
  char **names;
  int n;
  snprintf(sub, sizeof sub, "%s/a/b", fx->dir);
  assert_int_equal(fsdp_io_listdir(sub, &names, &n), FSDP_OK);
  assert_int_equal(n, 2);
  assert_true((strcmp(names[0], "one") == 0 && strcmp(names[1], "two") == 0) ||
              (strcmp(names[0], "two") == 0 && strcmp(names[1], "one") == 0));
  fsdp_io_listdir_free(names, n);
  assert_int_equal(fsdp_io_remove(f1), FSDP_OK);
  assert_int_equal(fsdp_io_remove(f1), FSDP_OK); /* already gone: fine */
  assert_int_equal(fsdp_io_fsync_dir(sub), FSDP_OK);
  assert_int_equal(fsdp_io_listdir(sub, &names, &n), FSDP_OK);
  assert_int_equal(n, 1);
  fsdp_io_listdir_free(names, n);
  char under_file[800];
  snprintf(under_file, sizeof under_file, "%s/x", f2);
  expect_error(fsdp_io_mkdirs(under_file), "cannot create folder");
  expect_error(fsdp_io_mkdirs(f2), "exists and is not a folder");
  snprintf(sub, sizeof sub, "%s/none", fx->dir);
  expect_error(fsdp_io_listdir(sub, &names, &n), "cannot open folder");
  expect_error(fsdp_io_fsync_dir(sub), "cannot open folder");
  expect_error(fsdp_io_mkdirs(""), "empty path");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      T(test_round_trip),
      T(test_independent_parse),
      T(test_foreign_file),
      T(test_empty_model),
      T(test_range_reads),
      T(test_concurrent_reads),
      T(test_conversions),
      T(test_dtype_round_trip),
      T(test_read_convert),
      T(test_hostless_device),
      T(test_truncated),
      T(test_corrupted_data),
      T(test_header_flips),
      T(test_wrong_length_and_magic),
      T(test_bad_headers),
      T(test_writer_errors),
      T(test_interrupted_writes),
      T(test_atomic_basics),
      T(test_atomic_abort_and_stale),
      T(test_atomic_stale_of_dead_process),
      T(test_atomic_unwritable),
      T(test_fault_names),
      T(test_json),
      cmocka_unit_test(test_json_parse_nonfinite),
      T(test_index),
      T(test_index_read),
      T(test_index_write),
      T(test_index_checksum),
      T(test_folders),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
