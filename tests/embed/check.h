/*
 * check.h — the checks the embedding tests (tests/embed/test_*.c) share. They are host programs
 * linked against libfsdp.so only, as a user's program is: no test framework, a count of checks
 * and failures, and main's exit status from them.
 */
#ifndef FSDP_TESTS_EMBED_CHECK_H
#define FSDP_TESTS_EMBED_CHECK_H

#include <stdio.h>
#include <string.h>

#include <fsdp.h>

static int checks, failures;

#define CHECK(cond, ...)                                                                          \
  do {                                                                                            \
    checks++;                                                                                     \
    if (!(cond)) {                                                                                \
      failures++;                                                                                 \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                             \
      fprintf(stderr, __VA_ARGS__);                                                               \
      fputc('\n', stderr);                                                                        \
    }                                                                                             \
  } while (0)

/* A status and a message fragment the last error must hold. */
#define EXPECT(rt, call, want_status, want_text)                                                  \
  do {                                                                                            \
    int st_ = (call);                                                                             \
    const char *msg_ = fsdp_last_error(rt);                                                       \
    CHECK(st_ == (want_status) && strstr(msg_, (want_text)) != NULL,                              \
          "%s returned %s, expected %s; message '%s' should hold '%s'", #call,                    \
          fsdp_status_name(st_), fsdp_status_name(want_status), msg_, want_text);                 \
  } while (0)

#define OK(rt, call) EXPECT(rt, call, FSDP_OK, "")

#endif
