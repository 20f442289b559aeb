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
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/io.h"

#define JSON_MAX_BYTES ((uint64_t)1 << 30)

int fsdp_io_text_write_atomic(const char *path, const char *text) {
  fsdp_io_atomic *f;
  if (fsdp_io_atomic_open(&f, path)) return FSDP_ERR;
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

int fsdp_io_json_parse(cJSON **out, const char *name, const char *text, size_t size) {
  *out = NULL;
  if (name == NULL) name = "(memory)";
  if (size > 0 && text == NULL) return fsdp_error("%s: NULL buffer of %zu bytes", name, size);
  if (size == 0) return fsdp_error("%s: empty file, not a JSON document", name);
  if (fsdp_io_json_refuse_nul(name, "JSON document", text, size)) return FSDP_ERR;
  const char *end = NULL;
  cJSON *doc = cJSON_ParseWithLengthOpts(text, size, &end, 0);
  size_t at = end != NULL && end >= text && end <= text + size ? (size_t)(end - text) : 0;
  if (doc == NULL) {
    size_t line, col;
    line_col(text, at, &line, &col);
    return fsdp_error("%s: not valid JSON: error at line %zu, column %zu", name, line, col);
  }
  for (size_t i = at; i < size; i++)
    if (text[i] != ' ' && text[i] != '\t' && text[i] != '\n' && text[i] != '\r') {
      size_t line, col;
      line_col(text, i, &line, &col);
      cJSON_Delete(doc);
      return fsdp_error("%s: not valid JSON: unexpected text after the document at line %zu, "
                        "column %zu",
                        name, line, col);
    }
  *out = doc;
  return FSDP_OK;
}

int fsdp_io_json_read(const char *path, cJSON **out) {
  *out = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fsdp_error("%s: cannot open: %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    return fsdp_error("%s: cannot stat: %s", path, strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return fsdp_error("%s: not a regular file", path);
  }
  if ((uint64_t)st.st_size > JSON_MAX_BYTES) {
    close(fd);
    return fsdp_error("%s: %lld bytes, more than a JSON document may have here (%llu)", path,
                      (long long)st.st_size, (unsigned long long)JSON_MAX_BYTES);
  }
  size_t size = (size_t)st.st_size;
  char *text = malloc(size + 1);
  if (text == NULL) {
    close(fd);
    return fsdp_error("%s: out of memory for %zu bytes", path, size);
  }
  size_t got = 0;
  while (got < size) {
    ssize_t n = read(fd, text + got, size - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int e = errno;
      free(text);
      close(fd);
      return fsdp_error("%s: read failed: %s", path, strerror(e));
    }
    if (n == 0) break; /* shrank while reading: parse what is there, the parser will judge */
    got += (size_t)n;
  }
  close(fd);
  text[got] = '\0';
  int rc = fsdp_io_json_parse(out, path, text, got);
  free(text);
  return rc;
}
