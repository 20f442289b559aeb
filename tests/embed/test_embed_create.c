/*
 * test_embed_create.c — what fsdp_runtime_new takes from its options and from the environment
 * (include/fsdp.h: fsdp_runtime_opts; linked against libfsdp.so only, like a host program).
 *
 * lua_path: a folder without the library is FSDP_ERROR even when LUA_PATH would find a copy of
 * it elsewhere; a library that fails to load is FSDP_ERROR naming the folder; the host's own
 * modules on LUA_PATH still load, with lua_path given or found; a relative lua_path still names
 * its folder after the host changed its working directory. timeout_s > 0: FSDP_TIMEOUT is
 * not read (a malformed value there fails nothing, not even a communicator split later), and
 * the runtime's timeout is the ranks' default; timeout_s 0: a malformed FSDP_TIMEOUT fails
 * creation naming it.
 *
 * Needs FSDP_SOURCE_DIR (ctest sets it): the source tree's Lua library, put on LUA_PATH.
 * Exit status 0 when every check passed, 77 (skipped) without FSDP_SOURCE_DIR.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fsdp.h>

#include "check.h"

static bool has(const char *s, const char *part) { return strstr(s, part) != NULL; }

static char tmp[64];          /* this test's folder */
static const char *src_lua;   /* the source tree's Lua library */

/* <tmp>/<rel> as a new string in buf */
static const char *at(char *buf, size_t n, const char *rel) {
  snprintf(buf, n, "%s/%s", tmp, rel);
  return buf;
}

static void write_file(const char *rel, const char *text) {
  char path[256];
  FILE *f = fopen(at(path, sizeof path, rel), "w");
  CHECK(f != NULL, "cannot write %s", path);
  if (f == NULL) return;
  fputs(text, f);
  fclose(f);
}

/* Setting or restoring an environment variable (NULL: unset). */
static void set_env(const char *name, const char *value) {
  if (value != NULL)
    setenv(name, value, 1);
  else
    unsetenv(name);
}

static char *saved_env(const char *name) {
  const char *v = getenv(name);
  return v != NULL ? strdup(v) : NULL;
}

/* ---- lua_path -------------------------------------------------------------------------------- */

static void test_lua_path(void) {
  char path[512], lpath[1024], dir[256];
  char *saved = saved_env("LUA_PATH");
  /* the real library and a module of the host's on LUA_PATH, as a user's environment may have */
  snprintf(lpath, sizeof lpath, "%s/?.lua;%s/?/init.lua;%s/mods/?.lua;;", src_lua, src_lua, tmp);
  set_env("LUA_PATH", lpath);

  fsdp_runtime *rt = (fsdp_runtime *)1;
  at(dir, sizeof dir, "empty");
  int st = fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2, .lua_path = dir});
  snprintf(path, sizeof path, "lua_path '%s' holds no fsdp Lua library", dir);
  CHECK(st == FSDP_ERROR && has(fsdp_last_error(NULL), path) &&
            has(fsdp_last_error(NULL), "fsdp/init.lua not found"),
        "a folder without the library, with the library on LUA_PATH: %s: '%s'",
        fsdp_status_name(st), fsdp_last_error(NULL));
  CHECK(rt == NULL, "*out is NULL after a refused lua_path");
  if (rt != NULL && rt != (fsdp_runtime *)1) fsdp_runtime_free(rt);

  /* a folder with a library that fails: every rank fails to load it, nothing is left running */
  rt = (fsdp_runtime *)1;
  at(dir, sizeof dir, "broken");
  st = fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2, .lua_path = dir});
  snprintf(path, sizeof path, "loading the fsdp library from %s", dir);
  CHECK(st == FSDP_ERROR && has(fsdp_last_error(NULL), path) &&
            has(fsdp_last_error(NULL), "this library is broken"),
        "a library that fails to load: %s: '%s'", fsdp_status_name(st), fsdp_last_error(NULL));
  CHECK(rt == NULL, "*out is NULL after a library that fails to load");

  /* the host's own modules keep loading from LUA_PATH, after the library's folder */
  const char *given[2] = {NULL, src_lua};
  for (int i = 0; i < 2; i++) {
    rt = NULL;
    st = fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2, .lua_path = given[i]});
    CHECK(st == FSDP_OK, "lua_path %s: %s: '%s'", given[i] ? given[i] : "NULL",
          fsdp_status_name(st), fsdp_last_error(NULL));
    if (rt == NULL) continue;
    st = fsdp_run_string(rt, "assert(require('embed_user_mod').answer == 42)");
    CHECK(st == FSDP_OK, "lua_path %s: a module on LUA_PATH: %s: '%s'",
          given[i] ? given[i] : "NULL", fsdp_status_name(st), fsdp_last_error(rt));
    fsdp_runtime_free(rt);
  }
  set_env("LUA_PATH", saved);
  free(saved);
}

/* A relative lua_path names the folder as the working directory was at creation: a module the
 * ranks load later (fsdp.nn, on first use) still comes from it after the host changed its
 * working directory. No LUA_PATH, which would find the library by itself. */
static void test_relative_lua_path(const char *src) {
  char *saved = saved_env("LUA_PATH");
  char cwd[1024];
  set_env("LUA_PATH", NULL);
  CHECK(getcwd(cwd, sizeof cwd) != NULL && chdir(src) == 0, "cannot enter %s", src);
  fsdp_runtime *rt = NULL;
  int st = fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2, .lua_path = "lua"});
  CHECK(st == FSDP_OK, "lua_path 'lua' in %s: %s: '%s'", src, fsdp_status_name(st),
        fsdp_last_error(NULL));
  CHECK(chdir(tmp) == 0, "cannot enter %s", tmp);
  if (rt != NULL) {
    OK(rt, fsdp_run_string(rt, "local m = require('fsdp').nn.Linear(2, 3)\n"
                               "assert(m.weight:shape()[1] == 3)"));
    fsdp_runtime_free(rt);
  }
  CHECK(chdir(cwd) == 0, "cannot go back to %s", cwd);
  set_env("LUA_PATH", saved);
  free(saved);
}

/* ---- timeout_s and FSDP_TIMEOUT -------------------------------------------------------------- */

static void test_timeout(void) {
  char *saved = saved_env("FSDP_TIMEOUT");
  set_env("FSDP_TIMEOUT", "abc");

  /* timeout_s given: the variable is not read (as FSDP_THREADS is not, with blas_threads) */
  fsdp_runtime *rt = NULL;
  int st = fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2, .timeout_s = 7});
  CHECK(st == FSDP_OK, "timeout_s 7, FSDP_TIMEOUT=abc: %s: '%s'", fsdp_status_name(st),
        fsdp_last_error(NULL));
  if (rt != NULL) {
    /* the runtime's timeout is the ranks' default; a split (hybrid sharding) makes new
     * communicators, which must not read the variable either */
    st = fsdp_run_string(rt, "local fsdp = require 'fsdp'\n"
                             "assert(fsdp.core.timeout() == 7, 'timeout ' .. fsdp.core.timeout())\n"
                             "fsdp.core.set_timeout(2)\n"
                             "fsdp.core.set_timeout(0)\n"
                             "assert(fsdp.core.timeout() == 7, 'default ' .. fsdp.core.timeout())\n"
                             "local m = fsdp.wrap(fsdp.nn.Linear(4, 2),\n"
                             "                    {strategy = 'hybrid', shard_size = 1})\n"
                             "local loss = m(fsdp.ones{3, 4}):sum()\n"
                             "loss:backward()\n"
                             "assert(fsdp.all_reduce(1, 'sum') == 2)");
    CHECK(st == FSDP_OK, "timeout_s 7, FSDP_TIMEOUT=abc: running: %s: '%s'",
          fsdp_status_name(st), fsdp_last_error(rt));
    fsdp_runtime_free(rt);
  }

  /* no timeout_s: the variable is the default, and a malformed one is refused naming it */
  rt = (fsdp_runtime *)1;
  st = fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2});
  CHECK(st == FSDP_ERROR && has(fsdp_last_error(NULL), "FSDP_TIMEOUT") &&
            has(fsdp_last_error(NULL), "'abc'"),
        "timeout_s 0, FSDP_TIMEOUT=abc: %s: '%s'", fsdp_status_name(st), fsdp_last_error(NULL));
  CHECK(rt == NULL, "*out is NULL after a malformed FSDP_TIMEOUT");
  set_env("FSDP_TIMEOUT", "9");
  rt = NULL;
  st = fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 1});
  CHECK(st == FSDP_OK, "timeout_s 0, FSDP_TIMEOUT=9: %s: '%s'", fsdp_status_name(st),
        fsdp_last_error(NULL));
  if (rt != NULL) {
    st = fsdp_run_string(rt, "local t = require('fsdp').core.timeout()\n"
                             "assert(t == 9, 'timeout ' .. t)");
    CHECK(st == FSDP_OK, "FSDP_TIMEOUT=9: %s: '%s'", fsdp_status_name(st), fsdp_last_error(rt));
    fsdp_runtime_free(rt);
  }
  set_env("FSDP_TIMEOUT", saved);
  free(saved);
}

int main(void) {
  alarm(getenv("FSDP_UNDER_VALGRIND") ? 300 : 60); /* a hang fails the test */
  const char *src = getenv("FSDP_SOURCE_DIR");
  if (src == NULL || src[0] == '\0') {
    printf("test_embed_create: skipped (FSDP_SOURCE_DIR is not set)\n");
    return 77;
  }
  char lua_dir[1024];
  snprintf(lua_dir, sizeof lua_dir, "%s/lua", src);
  src_lua = lua_dir;
  snprintf(tmp, sizeof tmp, "/tmp/fsdp_embed_create.XXXXXX");
  if (mkdtemp(tmp) == NULL) {
    perror("mkdtemp");
    return 1;
  }
  char p[256];
  mkdir(at(p, sizeof p, "empty"), 0755);
  mkdir(at(p, sizeof p, "broken"), 0755);
  mkdir(at(p, sizeof p, "broken/fsdp"), 0755);
  mkdir(at(p, sizeof p, "mods"), 0755);
  write_file("broken/fsdp/init.lua", "error('this library is broken', 0)\n");
  write_file("mods/embed_user_mod.lua", "return {answer = 42}\n");

  test_lua_path();
  test_relative_lua_path(src);
  test_timeout();

  const char *made[] = {"mods/embed_user_mod.lua", "broken/fsdp/init.lua", "broken/fsdp",
                        "broken", "empty", "mods"};
  for (size_t i = 0; i < sizeof made / sizeof made[0]; i++) remove(at(p, sizeof p, made[i]));
  rmdir(tmp);

  printf("test_embed_create: %d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
