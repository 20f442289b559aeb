/*
 * test_embed_log.c — fsdp.log inside an embedding runtime (include/fsdp.h, "callbacks"): its
 * output reaches the log callback as plain lines, one per shown step, also when the recipe asks
 * fsdp.log.setup for the progress bar, which the host cannot redraw in place.
 */
#include <stdlib.h>

#include "check.h"

typedef struct lines {
  int n;
  char text[8][160];
} lines;

static void on_log(void *ud, int rank, const char *line) {
  lines *l = ud;
  if (rank != 0 || l->n >= 8) return;
  snprintf(l->text[l->n++], sizeof l->text[0], "%s", line);
}

/* Three steps logged with fsdp.log.setup{total = 3, <extra>}: every step is shown (a run of 3
 * steps in lines mode shows each), one line each, with no terminal control characters. */
static void check_steps(const char *extra) {
  fsdp_runtime *rt = NULL;
  int st = fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2, .timeout_s = 30});
  CHECK(st == FSDP_OK, "fsdp_runtime_new: %s", fsdp_last_error(NULL));
  if (st != FSDP_OK) return;
  lines l = {0};
  OK(rt, fsdp_set_log_callback(rt, on_log, &l));
  char code[512];
  snprintf(code, sizeof code,
           "local fsdp = require 'fsdp'\n"
           "local t = 0\n"
           "fsdp.log.setup{total = 3, clock = function() t = t + 1; return t end%s}\n"
           "for i = 1, 3 do fsdp.log(i, {loss = i}) end\n"
           "fsdp.log.finish()",
           extra);
  OK(rt, fsdp_run_string(rt, code));
  CHECK(l.n == 3, "%s: %d lines, expected 3 (first '%s')", extra, l.n, l.n > 0 ? l.text[0] : "");
  for (int i = 0; i < l.n && i < 3; i++) {
    char want[32];
    snprintf(want, sizeof want, "step %d/3 | loss %d", i + 1, i + 1);
    CHECK(strncmp(l.text[i], want, strlen(want)) == 0 && strstr(l.text[i] + 1, "step ") == NULL &&
              strpbrk(l.text[i], "\r\033") == NULL,
          "%s: line %d is '%s', expected it to start with '%s'", extra, i + 1, l.text[i], want);
  }
  fsdp_runtime_free(rt);
}

int main(void) {
  check_steps("");
  check_steps(", progress = 'line'");
  check_steps(", progress = 'bar'");
  check_steps(", progress = 'auto'");
  printf("test_embed_log: %d checks, %d failures\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
