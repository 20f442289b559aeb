/*
 * make_corpus.c — writes the seed corpus of the io fuzz targets (tests/fuzz/corpus/).
 * The seeds are committed; run this only to regenerate them after a format change:
 *   cc -std=c11 -D_GNU_SOURCE -Isrc -Iinclude tests/fuzz/make_corpus.c \
 *      $(ls src/io/*.c | grep -v st_tensor) src/core/*.c -lcjson -lxxhash -lm -lpthread \
 *      -o /tmp/make_corpus
 *   /tmp/make_corpus tests/fuzz/corpus
 * Valid files from the writer (with checksums, every tensor dtype) and by hand (without, as
 * other tools write them, with every dtype the reader knows), and invalid ones: one defect
 * each. Sharded checkpoint indexes (corpus/index/, for fuzz_index): valid ones and one-defect
 * ones, of version 1 (by hand, no checksum) and 2 (from the writer, with its checksum).
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/io.h"

static const char *dir;

static void put(const char *sub, const char *name, const void *data, size_t n) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s/%s", dir, sub, name);
  FILE *f = fopen(path, "wb");
  if (f == NULL || fwrite(data, 1, n, f) != n) {
    perror(path);
    exit(1);
  }
  fclose(f);
}

/* 8-byte length + json + data */
static void raw(const char *name, const char *json, const void *data, size_t ndata) {
  size_t n = strlen(json);
  unsigned char *buf = malloc(8 + n + ndata);
  for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((unsigned long long)n >> (8 * i));
  memcpy(buf + 8, json, n);
  memcpy(buf + 8 + n, data, ndata);
  put("safetensors", name, buf, 8 + n + ndata);
  free(buf);
}

static unsigned char *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  fseek(f, 0, SEEK_END);
  *n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *buf = malloc(*n);
  if (fread(buf, 1, *n, f) != *n) exit(1);
  fclose(f);
  return buf;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: make_corpus <corpus folder>\n");
    return 2;
  }
  dir = argv[1];
  char path[512];
  snprintf(path, sizeof path, "%s/safetensors/valid_fsdp.safetensors", dir);
  fsdp_io_st_entry e[3] = {{.name = "w", .ndim = 2, .shape = {2, 2}},
                           {.name = "b", .ndim = 0},
                           {.name = "z", .ndim = 1, .shape = {0}}};
  fsdp_io_kv kv[1] = {{"format", "pt"}};
  float x[4] = {1, -2, 0.5f, 3};
  fsdp_io_st_writer *w;
  if (fsdp_io_st_writer_open(&w, path, e, 3, kv, 1) || fsdp_io_st_writer_write(w, "w", x, 2) ||
      fsdp_io_st_writer_write(w, "w", x + 2, 2) || fsdp_io_st_writer_write(w, "b", x, 1) ||
      fsdp_io_st_writer_commit(w)) {
    fprintf(stderr, "%s\n", fsdp_error_msg());
    return 1;
  }
  size_t n;
  unsigned char *buf = slurp(path, &n);
  buf[n - 1] ^= 0x40; /* the scalar's last byte */
  put("safetensors", "bad_checksum.safetensors", buf, n);
  put("safetensors", "truncated.safetensors", buf, n - 3);
  free(buf);
  snprintf(path, sizeof path, "%s/safetensors/valid_empty.safetensors", dir);
  if (fsdp_io_st_writer_open(&w, path, NULL, 0, NULL, 0) || fsdp_io_st_writer_commit(w)) {
    fprintf(stderr, "%s\n", fsdp_error_msg());
    return 1;
  }

  /* every tensor dtype, from the writer: F32 BF16 F16 F64 I64 I32 U8 BOOL */
  snprintf(path, sizeof path, "%s/safetensors/valid_dtypes.safetensors", dir);
  static const fsdp_io_dtype tdt[8] = {FSDP_IO_F32, FSDP_IO_BF16, FSDP_IO_F16, FSDP_IO_F64,
                                       FSDP_IO_I64, FSDP_IO_I32,  FSDP_IO_U8,  FSDP_IO_BOOL};
  fsdp_io_st_entry te[8];
  unsigned char bytes[3 * 8];
  for (int i = 0; i < 24; i++) bytes[i] = (unsigned char)(i * 29 + 5);
  const unsigned char bools[3] = {1, 0, 1};
  for (int i = 0; i < 8; i++)
    te[i] = (fsdp_io_st_entry){.name = fsdp_io_dtype_name(tdt[i]), .dtype = tdt[i], .ndim = 1,
                               .shape = {3}};
  if (fsdp_io_st_writer_open(&w, path, te, 8, NULL, 0)) {
    fprintf(stderr, "%s\n", fsdp_error_msg());
    return 1;
  }
  for (int i = 0; i < 8; i++)
    if (fsdp_io_st_writer_write(w, te[i].name, tdt[i] == FSDP_IO_BOOL ? bools : bytes, 3)) {
      fprintf(stderr, "%s\n", fsdp_error_msg());
      return 1;
    }
  if (fsdp_io_st_writer_commit(w)) {
    fprintf(stderr, "%s\n", fsdp_error_msg());
    return 1;
  }

  unsigned char d[64];
  for (int i = 0; i < 64; i++) d[i] = (unsigned char)(i * 37 + 11);
  const unsigned char notbool[4] = {0, 1, 2, 1};
  raw("bad_bool.safetensors", "{\"b\":{\"dtype\":\"BOOL\",\"shape\":[4],\"data_offsets\":[0,4]}}",
      notbool, 4);
  raw("foreign_dtypes.safetensors",
      "{\"f32\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"f16\":{\"dtype\":\"F16\",\"shape\":[2,2],\"data_offsets\":[8,16]},"
      "\"bf16\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[16,20]},"
      "\"f64\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[20,28]},"
      "\"i64\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[28,36]},"
      "\"u8\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[36,40]},"
      "\"empty\":{\"dtype\":\"F32\",\"shape\":[0,3],\"data_offsets\":[40,40]},"
      "\"scalar\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[40,44]}}",
      d, 44);
  raw("foreign_meta.safetensors",
      "{\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]},"
      "\"__metadata__\":{\"format\":\"pt\",\"x\":\"\\u00e9\\n\"},"
      "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}   ",
      d, 8);
  raw("bad_overlap.safetensors",
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
      d, 12);
  raw("bad_hole.safetensors",
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
      d, 12);
  raw("bad_dtype.safetensors", "{\"a\":{\"dtype\":\"F33\",\"shape\":[1],\"data_offsets\":[0,4]}}",
      d, 4);
  raw("bad_size.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}",
      d, 8);
  raw("bad_json.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}",
      d, 4);
  unsigned char len[16] = {0xff, 0xff, 0, 0, 0, 0, 0, 0, '{', '}'};
  put("safetensors", "bad_length.safetensors", len, sizeof len);

  const char *idx =
      "{\n  \"format\": \"fsdprun-sharded\",\n  \"world_size\": 2,\n  \"step\": 50,\n"
      "  \"files\": [\"rank0.safetensors\", \"rank1.safetensors\"],\n"
      "  \"params\": [{\"path\": \"h.0.w\", \"shape\": [4, 4], \"offset\": 0}],\n"
      "  \"rng\": {\"seed\": \"0123456789abcdef\"},\n  \"extra\": {\"lr\": 0.001, \"ok\": true, "
      "\"none\": null}\n}\n";
  put("json", "index.json", idx, strlen(idx));
  const char *nums = "[0, -0, 1e308, 2.5e-308, 9007199254740993, -1.5E+3, \"\\ud83d\\ude00\"]";
  put("json", "numbers.json", nums, strlen(nums));
  const char *bad = "{\"a\": [1, 2,], \"b\": }";
  put("json", "bad.json", bad, strlen(bad));
  const char *deep = "[[[[[[[[[[[[[[[[{\"k\": [[[[\"v\"]]]]}]]]]]]]]]]]]]]]]";
  put("json", "deep.json", deep, strlen(deep));

  /* sharded checkpoint indexes (src/io/index.c) */
  const char *ok2 =
      "{\"format\": \"fsdprun.sharded\", \"version\": 1, \"generation\": 3, \"world_size\": 2,"
      " \"step\": 50,"
      " \"files\": [{\"rank\": 0, \"name\": \"g3-rank0-of2.safetensors\", \"bytes\": 100,"
      " \"header_xxh3\": \"0123456789abcdef\"},"
      " {\"rank\": 1, \"name\": \"g3-rank1-of2.safetensors\", \"bytes\": 100,"
      " \"header_xxh3\": \"fedcba9876543210\"}],"
      " \"params\": [{\"path\": \"wte.weight\", \"shape\": [4, 3], \"numel\": 12,"
      " \"aliases\": [\"head.weight\"], \"mask\": true, \"dtype\": \"BF16\","
      " \"slices\": [{\"rank\": 0, \"first\": 0, \"count\": 5}, {\"rank\": 1, \"first\": 5, \"count\": 7}]},"
      " {\"path\": \"b\", \"shape\": [], \"numel\": 1, \"slices\": [{\"rank\": 1, \"first\": 0, \"count\": 1}]},"
      " {\"path\": \"e\", \"shape\": [0], \"numel\": 0, \"slices\": {}}],"
      " \"optimizer\": {\"kind\": \"AdamW\", \"step\": 50, \"lr\": 0.001, \"hyper\": {\"betas\": [0.9, 0.999]},"
      " \"states\": [\"exp_avg\", \"exp_avg_sq\"]},"
      " \"rng\": [{\"seed\": \"0000000000000001\", \"streams\": {\"randn\": \"0000000000000008\"}},"
      " {\"seed\": \"0000000000000001\", \"streams\": {}}],"
      " \"loaders\": {\"train\": 50}, \"schedule\": {\"k\": 50}, \"extra\": [1, \"x\"],"
      " \"extra_tensors\": [{\"name\": \"fsdp.extra:1\", \"dtype\": \"I64\", \"shape\": [2]}]}";
  put("index", "ok_2ranks.json", ok2, strlen(ok2));
  const char *ok1 =
      "{\"format\": \"fsdprun.sharded\", \"version\": 1, \"generation\": 1, \"world_size\": 1,"
      " \"step\": 0, \"files\": [{\"rank\": 0, \"name\": \"g1-rank0-of1.safetensors\","
      " \"bytes\": 64, \"header_xxh3\": \"00000000000000aa\"}], \"params\": {}}";
  put("index", "ok_minimal.json", ok1, strlen(ok1));
  const char *hole =
      "{\"format\": \"fsdprun.sharded\", \"version\": 1, \"generation\": 1, \"world_size\": 2,"
      " \"step\": 0, \"files\": [{\"rank\": 0, \"name\": \"a\", \"bytes\": 64,"
      " \"header_xxh3\": \"00000000000000aa\"}, {\"rank\": 1, \"name\": \"b\", \"bytes\": 64,"
      " \"header_xxh3\": \"00000000000000bb\"}], \"params\": [{\"path\": \"w\", \"shape\": [8],"
      " \"numel\": 8, \"slices\": [{\"rank\": 0, \"first\": 0, \"count\": 3},"
      " {\"rank\": 1, \"first\": 4, \"count\": 4}]}]}";
  put("index", "bad_hole.json", hole, strlen(hole));
  const char *world =
      "{\"format\": \"fsdprun.sharded\", \"version\": 1, \"generation\": 1, \"world_size\": 3,"
      " \"step\": 0, \"files\": [{\"rank\": 0, \"name\": \"a\", \"bytes\": 64,"
      " \"header_xxh3\": \"00000000000000aa\"}], \"params\": []}";
  put("index", "bad_world.json", world, strlen(world));
  const char *badt =
      "{\"format\": \"fsdprun.sharded\", \"version\": 1, \"generation\": 1, \"world_size\": 1,"
      " \"step\": 0, \"files\": [{\"rank\": 0, \"name\": \"a\", \"bytes\": 64,"
      " \"header_xxh3\": \"00000000000000aa\"}], \"params\": [{\"path\": \"w\", \"shape\": [2],"
      " \"numel\": 2, \"dtype\": \"U16\", \"slices\": [{\"rank\": 0, \"first\": 0, \"count\": 2}]}]}";
  put("index", "bad_dtype.json", badt, strlen(badt));
  /* version 2: what fsdp_io_index_write writes (the checksum first, then the version), and the
   * same with one byte of its lr changed (valid JSON and schema, a checksum mismatch) */
  cJSON *doc = NULL;
  snprintf(path, sizeof path, "%s/index/ok_v2.json", dir);
  if (fsdp_io_index_parse(&doc, "ok_2ranks.json", ok2, strlen(ok2)) ||
      fsdp_io_index_write(path, doc)) {
    fprintf(stderr, "%s\n", fsdp_error_msg());
    return 1;
  }
  cJSON_Delete(doc);
  unsigned char *v2 = slurp(path, &n);
  const char *pat = "\"lr\":\t0.001";
  size_t at = 0;
  while (at + strlen(pat) <= n && memcmp(v2 + at, pat, strlen(pat)) != 0) at++;
  if (at + strlen(pat) > n) return 1;
  v2[at + strlen(pat) - 1] ^= 0x01; /* 0.001 -> 0.000 */
  put("index", "bad_v2_checksum.json", v2, n);
  free(v2);
  return 0;
}
