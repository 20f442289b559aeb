/*
 * error.c — the per-thread error slot of the engine.
 *
 * Ranks are threads, so the message lives in thread-local storage: one rank's failure never
 * overwrites another's message. Fallible functions set it and return FSDP_ERR; callers add
 * context on the way up with fsdp_error_context ("wrap(model): unit 3: <message>").
 * Messages longer than the slot are truncated, never overflowed.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"


static _Thread_local char error_msg[FSDP_ERROR_CAP];

/* Set the slot to the formatted message, or with `context` to "message: <what it held>",
 * truncated at the slot's end (the head holds the context and the cause). Formats into a
 * scratch buffer first: arguments may point into error_msg itself
 * (fsdp_error("%s", fsdp_error_msg())), and vsnprintf must not read what it writes. */
static void set_msg(bool context, const char *fmt, va_list ap) {
  char tmp[FSDP_ERROR_CAP];
  vsnprintf(tmp, sizeof tmp, fmt, ap);
  if (context) {
    size_t n = strlen(tmp);
    if (n + 2 < sizeof tmp) {
      memcpy(tmp + n, ": ", 2);
      n += 2;
    }
    size_t old = strlen(error_msg);
    if (old > sizeof tmp - 1 - n) old = sizeof tmp - 1 - n;
    memcpy(tmp + n, error_msg, old);
    tmp[n + old] = '\0';
  }
  memcpy(error_msg, tmp, sizeof tmp);
}

int fsdp_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_msg(false, fmt, ap);
  va_end(ap);
  return FSDP_ERR;
}

int fsdp_error_context(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_msg(true, fmt, ap);
  va_end(ap);
  return FSDP_ERR;
}

const char *fsdp_error_msg(void) { return error_msg; }

void fsdp_error_clear(void) { error_msg[0] = '\0'; }
