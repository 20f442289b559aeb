/*
 * fuzz_index.c — libFuzzer target for the sharded checkpoint index reader
 * (fsdp_io_index_parse: JSON parse + schema check, src/io/index.c). Beyond
 * ASan/UBSan it holds the checker to its promises, re-derived here independently:
 *   - a rejected index has a message naming the file and no document;
 *   - an accepted one has one file per rank (files[i].rank == i), and every parameter's slices
 *     are in order, one per rank at most, ranks in range, and tile [0, numel) exactly, numel
 *     being the product of the shape — what the loader relies on to compute ranges without
 *     checking again; checking it twice gives the same answer;
 *   - a parameter's or an extra tensor's dtype, when given, is one of the eight tensor dtypes
 *     as the format names them (what the loader maps to tensor dtypes);
 *   - an index of version 2 is accepted only with a checksum that matches at its start.
 * An input that starts with the checksum prefix is also tried restamped (its checksum made to
 * match), so that mutations of version 2 indexes reach the JSON parser and the schema check
 * rather than all stopping at the checksum.
 * Built and run by tests/recipes/fuzz_io.sh (seeds: tests/fuzz/corpus/index/).
 */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "io/io.h"

#define NAME "fuzz_index.json"

static void check_dtype(const cJSON *v) {
  static const char *const ok[] = {"F32", "BF16", "F16", "F64", "I64", "I32", "U8", "BOOL"};
  if (v == NULL) return;
  if (!cJSON_IsString(v)) __builtin_trap();
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
    if (strcmp(v->valuestring, ok[i]) == 0) return;
  __builtin_trap();
}

static double num(const cJSON *o, const char *k) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  if (!cJSON_IsNumber(v)) __builtin_trap();
  return v->valuedouble;
}

static void one(const char *text, size_t size) {
  cJSON *doc = NULL;
  if (fsdp_io_index_parse(&doc, NAME, text, size) != FSDP_OK) {
    if (doc != NULL || strncmp(fsdp_error_msg(), NAME ": ", strlen(NAME) + 2) != 0)
      __builtin_trap();
    return;
  }
  /* version 2 only with the checksum at its fixed place */
  const size_t plen = strlen(FSDP_IO_INDEX_PREFIX);
  if (num(doc, "version") == 2 &&
      (size < plen + 17 || memcmp(text, FSDP_IO_INDEX_PREFIX, plen) != 0))
    __builtin_trap();
  double world = num(doc, "world_size");
  const cJSON *files = cJSON_GetObjectItemCaseSensitive(doc, "files");
  if (world < 1 || cJSON_GetArraySize(files) != (int)world) __builtin_trap();
  int i = 0;
  for (const cJSON *f = files->child; f; f = f->next, i++)
    if (num(f, "rank") != i) __builtin_trap();
  const cJSON *params = cJSON_GetObjectItemCaseSensitive(doc, "params");
  for (const cJSON *p = params ? params->child : NULL; p; p = p->next) {
    double numel = 1;
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(p, "shape");
    for (const cJSON *d = shape->child; d; d = d->next) numel *= d->valuedouble;
    if (num(p, "numel") != numel) __builtin_trap();
    double next = 0;
    unsigned char seen[64] = {0};
    for (const cJSON *s = cJSON_GetObjectItemCaseSensitive(p, "slices")->child; s; s = s->next) {
      double r = num(s, "rank"), first = num(s, "first"), count = num(s, "count");
      if (r < 0 || r >= world || count < 1 || first != next) __builtin_trap();
      if (r < 64) {
        if (seen[(int)r]) __builtin_trap();
        seen[(int)r] = 1;
      }
      next = first + count;
    }
    if (next != numel) __builtin_trap();
    check_dtype(cJSON_GetObjectItemCaseSensitive(p, "dtype"));
  }
  const cJSON *xs = cJSON_GetObjectItemCaseSensitive(doc, "extra_tensors");
  for (const cJSON *x = xs ? xs->child : NULL; x; x = x->next) {
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(x, "dtype");
    if (dt == NULL) __builtin_trap();
    check_dtype(dt);
  }
  if (fsdp_io_index_check(doc, NAME) != FSDP_OK) __builtin_trap();
  cJSON_Delete(doc);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  one((const char *)data, size);
  char *copy = malloc(size + 1);
  if (copy == NULL) return 0;
  memcpy(copy, data, size);
  copy[size] = '\0';
  if (fsdp_io_index_stamp(copy, size, NAME) == FSDP_OK) one(copy, size);
  free(copy);
  return 0;
}
