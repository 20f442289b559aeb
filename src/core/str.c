/*
 * str.c — strings formatted into memory of their own (file names, messages that outlive the
 * thread's error slot).
 */
#include <stdio.h>
#include <stdlib.h>

#include "core/core.h"

char *fsdp_strdup_vprintf(const char *fmt, va_list ap) {
  char *s;
  return vasprintf(&s, fmt, ap) < 0 ? NULL : s;
}

char *fsdp_strdup_printf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *s = fsdp_strdup_vprintf(fmt, ap);
  va_end(ap);
  return s;
}
