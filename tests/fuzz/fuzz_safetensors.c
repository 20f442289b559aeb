/*
 * fuzz_safetensors.c — libFuzzer target for the safetensors reader (src/io/st_read.c).
 * The input is a whole file, opened from memory. Beyond "no crash, no leak, no
 * out-of-bounds access" (ASan, UBSan) it checks the reader's promises:
 *   - a rejected file has a message that starts with the file's name;
 *   - an accepted file's entries are consistent (sizes = numel * dtype size, find finds each
 *     entry), and every tensor can be read whole (as its stored bytes), read by ranges, read
 *     in pieces (with the same outcome as whole) and verified without a crash; reading may
 *     fail (checksum, a BOOL byte that is not 0 or 1) but only with a message naming the file.
 * Built and run by tests/recipes/fuzz_io.sh (clang -fsanitize=fuzzer,address,undefined).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "io/io.h"

#define NAME "fuzz.safetensors"

static void check_message(void) {
  if (strncmp(fsdp_error_msg(), NAME ": ", strlen(NAME) + 2) != 0) __builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fsdp_io_st_reader *r = NULL;
  if (fsdp_io_st_reader_open_memory(&r, NAME, data, size) != FSDP_OK) {
    if (r != NULL) __builtin_trap();
    check_message();
    return 0;
  }
  int n = fsdp_io_st_reader_count(r);
  for (int i = 0; i < n; i++) {
    const fsdp_io_st_entry *e = fsdp_io_st_reader_entry(r, i);
    if (e->end < e->begin || e->end - e->begin != (uint64_t)e->numel * fsdp_io_dtype_size(e->dtype))
      __builtin_trap();
    if (e->end > size) __builtin_trap();
    if (fsdp_io_st_reader_find(r, e->name) != e) __builtin_trap();
    size_t esz = fsdp_io_dtype_size(e->dtype);
    unsigned char *out = malloc((size_t)e->numel * esz + 1);
    if (out == NULL) continue;
    if (fsdp_io_st_reader_read(r, out, e->name, 0, e->numel) != FSDP_OK) check_message();
    int64_t half = e->numel / 2;
    if (fsdp_io_st_reader_read(r, out, e->name, half, e->numel - half) != FSDP_OK)
      check_message();
    if (fsdp_io_st_reader_read(r, out, e->name, half, e->numel - half + 1) == FSDP_OK)
      __builtin_trap(); /* one past the end must fail */
    check_message();
    if (fsdp_io_st_reader_verify(r, e->name) != FSDP_OK) check_message();
    /* the same in pieces of one element and of a few: the same outcome as the whole read */
    int whole = fsdp_io_st_reader_read(r, out, e->name, 0, e->numel);
    if (whole != FSDP_OK) check_message();
    int chunked = fsdp_io_st_reader_read_chunks(r, e->name, 0, e->numel, out, 3 * esz, NULL, NULL);
    if (chunked != whole) __builtin_trap();
    if (chunked != FSDP_OK) check_message();
    if (e->numel > 0 &&
        fsdp_io_st_reader_read_chunks(r, e->name, 0, e->numel, out, esz - 1, NULL, NULL) == FSDP_OK)
      __builtin_trap(); /* a buffer that holds no element */
    free(out);
  }
  for (int i = 0; i < fsdp_io_st_reader_metadata_count(r); i++) {
    fsdp_io_kv kv = fsdp_io_st_reader_metadata_at(r, i);
    if (kv.key == NULL || kv.value == NULL) __builtin_trap();
    if (fsdp_io_st_reader_metadata_get(r, kv.key) == NULL) __builtin_trap();
  }
  fsdp_io_st_reader_close(r);
  return 0;
}
