/*
 * util.c — small pieces the io layer shares: the safetensors dtype table (and how it maps to
 * tensor dtypes) and UTF-8 validation (names and metadata must be valid UTF-8 for the JSON
 * header to be readable by strict readers such as the reference Rust implementation), and the
 * search for NUL characters in JSON strings (cJSON decodes "\u0000" into a C string that ends
 * there: "a\u0000b" would read as "a").
 */
#include <stdio.h>
#include <string.h>

#include "io/io.h"

/* Names as the safetensors format spells them, and their sizes in bytes. */
static const struct {
  const char *name;
  size_t size;
} dtypes[FSDP_IO_DTYPE_COUNT] = {
    [FSDP_IO_F32] = {"F32", 4},         [FSDP_IO_F16] = {"F16", 2},
    [FSDP_IO_BF16] = {"BF16", 2},       [FSDP_IO_F64] = {"F64", 8},
    [FSDP_IO_BOOL] = {"BOOL", 1},       [FSDP_IO_U8] = {"U8", 1},
    [FSDP_IO_I8] = {"I8", 1},           [FSDP_IO_F8_E5M2] = {"F8_E5M2", 1},
    [FSDP_IO_F8_E4M3] = {"F8_E4M3", 1}, [FSDP_IO_I16] = {"I16", 2},
    [FSDP_IO_U16] = {"U16", 2},         [FSDP_IO_I32] = {"I32", 4},
    [FSDP_IO_U32] = {"U32", 4},         [FSDP_IO_I64] = {"I64", 8},
    [FSDP_IO_U64] = {"U64", 8},
};

const char *fsdp_io_dtype_name(fsdp_io_dtype dt) {
  return (unsigned)dt < FSDP_IO_DTYPE_COUNT ? dtypes[dt].name : "?";
}

size_t fsdp_io_dtype_size(fsdp_io_dtype dt) {
  return (unsigned)dt < FSDP_IO_DTYPE_COUNT ? dtypes[dt].size : 0;
}

int fsdp_io_dtype_from_name(const char *name) {
  for (int i = 0; i < FSDP_IO_DTYPE_COUNT; i++)
    if (strcmp(name, dtypes[i].name) == 0) return i;
  return -1;
}

/* Stored dtype <-> tensor dtype: the eight the engine has, bit for bit the same encodings. */
static const struct {
  fsdp_io_dtype io;
  fsdp_dtype t;
} tensor_dtypes[] = {
    {FSDP_IO_F32, FSDP_DTYPE_F32}, {FSDP_IO_BF16, FSDP_DTYPE_BF16}, {FSDP_IO_F16, FSDP_DTYPE_F16},
    {FSDP_IO_F64, FSDP_DTYPE_F64}, {FSDP_IO_I64, FSDP_DTYPE_I64},   {FSDP_IO_I32, FSDP_DTYPE_I32},
    {FSDP_IO_U8, FSDP_DTYPE_U8},   {FSDP_IO_BOOL, FSDP_DTYPE_BOOL},
};
#define N_TENSOR_DTYPES (sizeof tensor_dtypes / sizeof tensor_dtypes[0])

bool fsdp_io_dtype_to_tensor(fsdp_io_dtype dt, fsdp_dtype *out) {
  for (size_t i = 0; i < N_TENSOR_DTYPES; i++)
    if (tensor_dtypes[i].io == dt) {
      *out = tensor_dtypes[i].t;
      return true;
    }
  return false;
}

int fsdp_io_dtype_of_tensor(fsdp_dtype dt) {
  for (size_t i = 0; i < N_TENSOR_DTYPES; i++)
    if (tensor_dtypes[i].t == dt) return (int)tensor_dtypes[i].io;
  return -1;
}

bool fsdp_io_utf8_valid(const char *s, size_t n) {
  const unsigned char *p = (const unsigned char *)s, *end = p + n;
  while (p < end) {
    unsigned c = *p++;
    if (c < 0x80) continue;
    int more;
    unsigned cp, min;
    if ((c & 0xE0) == 0xC0) more = 1, cp = c & 0x1F, min = 0x80;
    else if ((c & 0xF0) == 0xE0) more = 2, cp = c & 0x0F, min = 0x800;
    else if ((c & 0xF8) == 0xF0) more = 3, cp = c & 0x07, min = 0x10000;
    else return false;
    if (end - p < more) return false;
    for (int i = 0; i < more; i++) {
      if ((p[i] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i] & 0x3F);
    }
    p += more;
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
  }
  return true;
}

int fsdp_io_json_refuse_nul(const char *name, const char *what, const char *text, size_t n) {
  size_t start = 0, end = n;
  bool in_string = false, has_nul = false;
  for (size_t i = 0; i < n && !(has_nul && !in_string); i++) {
    char c = text[i];
    if (!in_string) {
      if (c == '"') in_string = true, start = i;
    } else if (c == '\0') {
      has_nul = true;
    } else if (c == '\\') {
      i++; /* the escaped character: an escaped quote ends nothing */
      if (i + 4 < n && text[i] == 'u' && memcmp(text + i + 1, "0000", 4) == 0) has_nul = true;
    } else if (c == '"') {
      in_string = false;
      end = i + 1;
    }
  }
  if (!has_nul) return FSDP_OK;
  /* the string as the file spells it, a raw NUL or control byte as its \u escape, cut at 64 */
  char shown[64 * 6 + 4];
  size_t o = 0;
  for (size_t i = start; i < end && i < start + 64; i++) {
    unsigned char c = (unsigned char)text[i];
    if (c < 0x20) o += (size_t)snprintf(shown + o, sizeof shown - o, "\\u%04x", c);
    else shown[o++] = (char)c;
  }
  shown[o] = '\0';
  return fsdp_error("%s: %s: the string %s%s (byte %zu) holds a NUL character (\\u0000), which "
                    "would cut it short",
                    name, what, shown, end - start > 64 ? "..." : "", start);
}
