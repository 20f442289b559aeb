/*
 * json.c — JSON documents on disk (io.h): written through an atomic file, read whole and
 * parsed with cJSON. The checkpoint index is one such document; its schema lives with the
 * fsdp layer, this file only moves text and reports where it is broken.
 *
 * cJSON's own error pointer is a process global (racy between rank threads); the parse end
 * that cJSON_ParseWithLengthOpts returns is used instead.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/io.h"

#define JSON_MAX_BYTES ((uint64_t)1 << 30)

int fsdp_io_text_write_atomic(const char *path, const char *text) {
  fsdp_io_atomic *f;
  int rc = fsdp_io_atomic_open(&f, path);
  if (rc != FSDP_OK) return rc;
  if (fsdp_io_atomic_write(f, text, strlen(text)) || fsdp_io_atomic_write(f, "\n", 1)) {
    fsdp_io_atomic_abort(f);
    return FSDP_ERR;
  }
  return fsdp_io_atomic_commit(f);
}

int fsdp_io_json_print(const cJSON *doc, const char *path, char **text) {
  *text = doc != NULL ? cJSON_Print(doc) : NULL;
  if (doc == NULL) return fsdp_error("%s: no JSON document to write", path);
  if (*text == NULL) return fsdp_error("%s: cannot print the JSON document (out of memory)", path);
  return FSDP_OK;
}

int fsdp_io_json_write_atomic(const char *path, const cJSON *doc) {
  char *text;
  if (fsdp_io_json_print(doc, path, &text)) return FSDP_ERR;
  int rc = fsdp_io_text_write_atomic(path, text);
  cJSON_free(text);
  return rc;
}

/* 1-based line and column of byte `at` of text, for messages. */
static void line_col(const char *text, size_t at, size_t *line, size_t *col) {
  *line = 1;
  *col = 1;
  for (size_t i = 0; i < at; i++) {
    if (text[i] == '\n') {
      (*line)++;
      *col = 1;
    } else {
      (*col)++;
    }
  }
}

/* The bare word of a non-finite number at text[i] (outside a string): its length, or 0. */
static size_t nonfinite_word(const char *text, size_t size, size_t i) {
  static const char *const words[] = {"NaN", "Infinity", "-Infinity"};
  for (int k = 0; k < 3; k++) {
    size_t n = strlen(words[k]);
    if (size - i >= n && memcmp(text + i, words[k], n) == 0) return n;
  }
  return 0;
}

/* text as cJSON is given it: copied, NUL-terminated (so that a document cut short fails at
 * the NUL, which says "end of text"), and with FSDP_IO_JSON_NONFINITE the bare words quoted.
 * *quoted (malloc'd, *nquoted entries) lists where in the copy each quoted word starts, to map
 * positions back to the caller's text. NULL when out of memory. */
static char *parse_copy(const char *text, size_t size, unsigned flags, size_t *len,
                        size_t **quoted, size_t *nquoted) {
  size_t words = 0;
  *quoted = NULL;
  *nquoted = 0;
  if (flags & FSDP_IO_JSON_NONFINITE) {
    bool in_string = false;
    for (size_t i = 0; i < size; i++) {
      if (in_string) {
        if (text[i] == '\\') i++;
        else if (text[i] == '"') in_string = false;
      } else if (text[i] == '"') {
        in_string = true;
      } else {
        size_t n = nonfinite_word(text, size, i);
        if (n > 0) {
          words++;
          i += n - 1;
        }
      }
    }
  }
  char *buf = malloc(size + 2 * words + 1);
  if (buf == NULL) return NULL;
  if (words == 0) {
    if (size > 0) memcpy(buf, text, size);
    *len = size;
    buf[size] = '\0';
    return buf;
  }
  *quoted = malloc(words * sizeof **quoted);
  if (*quoted == NULL) {
    free(buf);
    return NULL;
  }
  size_t o = 0;
  bool in_string = false;
  for (size_t i = 0; i < size; i++) {
    size_t n = 0;
    if (in_string) {
      if (text[i] == '\\' && i + 1 < size) buf[o++] = text[i++];
      else if (text[i] == '"') in_string = false;
    } else if (text[i] == '"') {
      in_string = true;
    } else {
      n = nonfinite_word(text, size, i);
    }
    if (n == 0) {
      buf[o++] = text[i];
      continue;
    }
    (*quoted)[(*nquoted)++] = o;
    buf[o++] = '"';
    memcpy(buf + o, text + i, n);
    o += n;
    buf[o++] = '"';
    i += n - 1;
  }
  buf[o] = '\0';
  *len = o;
  return buf;
}

/* A position in the copy as one in the caller's text: each quoted word before it added two
 * bytes; a position inside a quoted word is the word's start. */
static size_t unquote_pos(size_t at, const size_t *quoted, size_t nquoted, const char *copy) {
  size_t shift = 0;
  for (size_t k = 0; k < nquoted && quoted[k] < at; k++) {
    size_t end = quoted[k] + 1;
    while (copy[end] != '"') end++;
    if (at <= end) return quoted[k] - shift;
    shift += 2;
  }
  return at - shift;
}

int fsdp_io_json_parse_ex(cJSON **out, const char *name, const char *text, size_t size,
                          unsigned flags, size_t *err_line, size_t *err_col) {
  *out = NULL;
  if (err_line) *err_line = 0;
  if (err_col) *err_col = 0;
  if (name == NULL) name = "(memory)";
  if (size > 0 && text == NULL) return fsdp_error("%s: NULL buffer of %zu bytes", name, size);
  if (size == 0) return fsdp_error("%s: empty file, not a JSON document", name);
  if (fsdp_io_json_refuse_nul(name, "JSON document", text, size)) return FSDP_ERR;
  size_t len, *quoted, nquoted;
  char *copy = parse_copy(text, size, flags, &len, &quoted, &nquoted);
  if (copy == NULL) return fsdp_error("%s: out of memory for %zu bytes of JSON", name, size);
  const char *end = NULL;
  cJSON *doc = cJSON_ParseWithLengthOpts(copy, len + 1, &end, 0);
  size_t at = end != NULL && end >= copy && end <= copy + len ? (size_t)(end - copy) : 0;
  const char *what = NULL;
  char why[32];
  if (doc == NULL) {
    what = "error";
  } else {
    while (at < len && (copy[at] == ' ' || copy[at] == '\t' || copy[at] == '\n' ||
                        copy[at] == '\r'))
      at++;
    if (at < len) what = "unexpected text after the document";
  }
  if (what == NULL) {
    free(copy);
    free(quoted);
    *out = doc;
    return FSDP_OK;
  }
  cJSON_Delete(doc);
  if (at >= len) snprintf(why, sizeof why, "unexpected end of text");
  else if (copy[at] >= 0x20 && copy[at] < 0x7f) snprintf(why, sizeof why, "unexpected '%c'", copy[at]);
  else snprintf(why, sizeof why, "unexpected byte 0x%02x", (unsigned char)copy[at]);
  size_t pos = unquote_pos(at, quoted, nquoted, copy);
  free(copy);
  free(quoted);
  size_t line, col;
  line_col(text, pos < size ? pos : size, &line, &col);
  if (err_line) *err_line = line;
  if (err_col) *err_col = col;
  if (strcmp(what, "error") == 0)
    return fsdp_error("%s: not valid JSON: error at line %zu, column %zu (%s)", name, line, col,
                      why);
  return fsdp_error("%s: not valid JSON: %s at line %zu, column %zu", name, what, line, col);
}

int fsdp_io_json_parse(cJSON **out, const char *name, const char *text, size_t size) {
  return fsdp_io_json_parse_ex(out, name, text, size, 0, NULL, NULL);
}

int fsdp_io_text_read(const char *path, char **text, size_t *size) {
  *text = NULL;
  *size = 0;
  int fd;
  uint64_t bytes;
  if (fsdp_io_open_regular(path, &fd, &bytes)) return FSDP_ERR;
  if (bytes > JSON_MAX_BYTES) {
    close(fd);
    return fsdp_error("%s: %lld bytes, more than a JSON document may have here (%llu)", path,
                      (long long)bytes, (unsigned long long)JSON_MAX_BYTES);
  }
  size_t want = (size_t)bytes;
  char *buf = malloc(want + 1);
  if (buf == NULL) {
    close(fd);
    return fsdp_error("%s: out of memory for %zu bytes", path, want);
  }
  size_t got = 0;
  while (got < want) {
    ssize_t n = read(fd, buf + got, want - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int e = errno;
      free(buf);
      close(fd);
      return fsdp_error("%s: read failed: %s", path, strerror(e));
    }
    if (n == 0) break; /* shrank while reading: parse what is there, the parser will judge */
    got += (size_t)n;
  }
  close(fd);
  buf[got] = '\0';
  *text = buf;
  *size = got;
  return FSDP_OK;
}

int fsdp_io_json_read(const char *path, cJSON **out) {
  *out = NULL;
  char *text;
  size_t size;
  if (fsdp_io_text_read(path, &text, &size)) return FSDP_ERR;
  int rc = fsdp_io_json_parse(out, path, text, size);
  free(text);
  return rc;
}
