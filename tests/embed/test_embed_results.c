/*
 * test_embed_results.c — fsdp_call's results when the host's result buffer is also an input
 * (an in-place update, x = f(x)): the result reaches the buffer only after every rank has
 * finished the call and let go of its inputs. So a rank still computing reads the call's input,
 * not a faster rank's result, and a view of the input that Lua keeps holds the call's values
 * (include/fsdp.h: inputs are copied before the host gets its buffers back).
 */
#include <stdlib.h>
#include <unistd.h>

#include "check.h"

static const char CODE[] =
    "local fsdp = require 'fsdp'\n"
    "local core = require 'fsdp.core'\n"
    "function double(x)\n"
    "  kept = x:view{-1}\n"
    "  if fsdp.rank() == 1 then\n" /* rank 0 returns at once; rank 1 reads the input later */
    "    local t = core.clock()\n"
    "    while core.clock() - t < 0.3 do end\n"
    "    seen = x:sum():item()\n"
    "  end\n"
    "  return x * 2\n"
    "end\n";

static void check_in_place(int world) {
  fsdp_runtime *rt = NULL;
  int st = fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = world, .timeout_s = 30});
  CHECK(st == FSDP_OK, "fsdp_runtime_new(world %d): %s", world, fsdp_last_error(NULL));
  if (st != FSDP_OK) return;
  OK(rt, fsdp_run_string(rt, CODE));
  float a[4] = {1, 2, 3, 4};
  fsdp_host_tensor t = {.data = a, .ndim = 1, .shape = {4}};
  OK(rt, fsdp_call(rt, "double", &t, 1, &t, 1));
  CHECK(a[0] == 2 && a[1] == 4 && a[2] == 6 && a[3] == 8, "world %d: result %g %g %g %g", world,
        a[0], a[1], a[2], a[3]);
  CHECK(t.ndim == 1 && t.shape[0] == 4, "world %d: result shape ndim %d, %lld", world, t.ndim,
        (long long)t.shape[0]);
  /* every rank's kept view holds the call's input; rank 1 read it after rank 0 had returned */
  float kept[2] = {0, 0}, seen[2] = {0, 0};
  fsdp_host_tensor outs[4] = {{.data = &kept[0]}, {.data = &seen[0]},
                              {.data = &kept[1]}, {.data = &seen[1]}};
  OK(rt, fsdp_run_string(rt, "function report() return kept:sum(), seen or 10 end"));
  OK(rt, fsdp_call_ranks(rt, "report", NULL, 0, outs, 2));
  for (int r = 0; r < world; r++)
    CHECK(kept[r] == 10 && seen[r] == 10,
          "world %d, rank %d: the kept view sums to %g and the input read %g, expected 10 (the "
          "call's input, not its result)",
          world, r, kept[r], seen[r]);
  fsdp_runtime_free(rt);
}

int main(void) {
  alarm(getenv("FSDP_UNDER_VALGRIND") ? 300 : 60); /* a hang fails the test */
  check_in_place(1);
  check_in_place(2);
  printf("test_embed_results: %d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
