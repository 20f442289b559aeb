/*
 * setup.c — what every rank's Lua state gets from the host (src/host/host.h): the standard
 * libraries, the fsdp Lua library on package.path (found next to the binary, never through
 * the user's environment), fsdp.core preloaded as this binary's engine, and the traceback
 * message handler; with the thread rule (each rank's cpu threads) and reading a recipe whole.
 */
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <lauxlib.h>
#include <lualib.h>

#include "host/host.h"
#include "kernels/cpu/pool.h"
#include "lua/binding.h"

#ifndef FSDP_SOURCE_LUA_DIR
#define FSDP_SOURCE_LUA_DIR ""
#endif

/* Where lua/fsdp/nn/module.lua leaves the traceback of an error raised inside a module call,
 * taken at the error point: the outermost call raises the error again, from a frame that has
 * lost every frame inside forward. */
#define TRACEBACK_KEY "fsdp.traceback"

int fsdp_host_traceback(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING)
      msg = lua_tostring(L, -1);
    else
      msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  /* taken once; kept only when it is this error's ("<msg>\nstack traceback:...") */
  lua_getfield(L, LUA_REGISTRYINDEX, TRACEBACK_KEY);
  lua_pushnil(L);
  lua_setfield(L, LUA_REGISTRYINDEX, TRACEBACK_KEY);
  size_t n = strlen(msg), tn;
  const char *tb = lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, &tn) : NULL;
  if (tb != NULL && tn > n && memcmp(tb, msg, n) == 0 && tb[n] == '\n') return 1;
  lua_pop(L, 1);
  luaL_traceback(L, L, msg, 1);
  return 1;
}

/* os.getenv(name) with the rank's own values for torchrun's four names (upvalues 2..5, in
 * RANK_VARS order); any other name goes to the original (upvalue 1). */
static const char *const RANK_VARS[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};

static int rank_getenv(lua_State *L) {
  const char *name = luaL_checkstring(L, 1);
  for (int i = 0; i < 4; i++) {
    if (strcmp(name, RANK_VARS[i]) == 0) {
      lua_pushvalue(L, lua_upvalueindex(i + 2));
      return 1;
    }
  }
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, 1);
  return 1;
}

static void setup_rank_env(lua_State *L, const fsdp_host_rank *r) {
  int local, local_world;
  fsdp_host_rank_local(r, &local, &local_world);
  const int vals[4] = {r->rank, r->world, local, local_world};
  lua_getglobal(L, "os");
  lua_getfield(L, -1, "getenv");
  for (int i = 0; i < 4; i++) lua_pushfstring(L, "%d", vals[i]);
  lua_pushcclosure(L, rank_getenv, 5);
  lua_setfield(L, -2, "getenv");
  lua_pop(L, 1);
}

void fsdp_host_openlibs(lua_State *L, const char *lua_dir) {
  lua_gc(L, LUA_GCSTOP, 0);
  luaL_openlibs(L);
  lua_gc(L, LUA_GCRESTART, -1);
  lua_getglobal(L, "package");
  if (lua_dir != NULL) {
    lua_getfield(L, -1, "path");
    const char *old = lua_tostring(L, -1);
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", lua_dir, lua_dir, old != NULL ? old : "");
    lua_setfield(L, -3, "path");
    lua_pop(L, 1);
  }
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, luaopen_fsdp_core);
  lua_setfield(L, -2, "fsdp.core");
  lua_pop(L, 2);
  const fsdp_host_rank *r = fsdp_host_current();
  if (r != NULL) setup_rank_env(L, r);
}

static bool is_dir(const char *path) {
  struct stat st;
  return path[0] != '\0' && stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The file this code was loaded from: the shared library holding it, or the executable (whose
 * link map has no name, and whose dladdr name is only argv[0]). */
static bool binary_path(char *out, size_t n) {
  Dl_info info;
  struct link_map *map = NULL;
  if (dladdr1((void *)&fsdp_host_find_lua_dir, &info, (void **)&map, RTLD_DL_LINKMAP) != 0 &&
      map != NULL && map->l_name != NULL && map->l_name[0] != '\0') {
    snprintf(out, n, "%s", map->l_name);
    return true;
  }
  ssize_t len = readlink("/proc/self/exe", out, n - 1);
  if (len <= 0) return false;
  out[len] = '\0';
  return true;
}

bool fsdp_host_find_lua_dir(char *out, size_t n, char *tried, size_t tried_n) {
  char bin[PATH_MAX];
  char cand[PATH_MAX + 32] = "";
  if (binary_path(bin, sizeof bin)) {
    char *slash = strrchr(bin, '/');
    if (slash != NULL) {
      *slash = '\0';
      snprintf(cand, sizeof cand, "%s/../share/fsdprun/lua", bin);
      char real[PATH_MAX];
      if (is_dir(cand) && realpath(cand, real) != NULL) {
        snprintf(out, n, "%s", real);
        return true;
      }
    }
  }
  if (is_dir(FSDP_SOURCE_LUA_DIR)) {
    snprintf(out, n, "%s", FSDP_SOURCE_LUA_DIR);
    return true;
  }
  if (tried != NULL) snprintf(tried, tried_n, "'%s' and '%s'", cand, FSDP_SOURCE_LUA_DIR);
  return false;
}

/* A thread count from the environment variable `name`: 0 when unset or empty, -1 (with the
 * error set, naming the variable) when it is not an integer in 1 .. FSDP_CPU_MAX_THREADS. */
static int env_threads(const char *name) {
  const char *env = getenv(name);
  if (env == NULL || env[0] == '\0') return 0;
  char *end;
  errno = 0;
  long v = strtol(env, &end, 10);
  if (env[0] < '0' || env[0] > '9' || errno != 0 || *end != '\0' || v < 1 ||
      v > FSDP_CPU_MAX_THREADS) {
    fsdp_error("%s='%s' must be a positive integer (at most %d)", name, env,
               FSDP_CPU_MAX_THREADS);
    return -1;
  }
  return (int)v;
}

/* The count the environment asks for: FSDP_THREADS, else FSDP_BLAS_THREADS (its old name);
 * 0 when neither is set, -1 when the one that decides is malformed. */
static int env_rank_threads(void) {
  int n = env_threads("FSDP_THREADS");
  return n != 0 ? n : env_threads("FSDP_BLAS_THREADS");
}

int fsdp_host_threads(int requested, int world) {
  int n = requested > 0 ? requested : env_rank_threads();
  if (n < 0) return FSDP_ERR;
  if (n == 0) {
    n = fsdp_cpu_cores() / (world > 0 ? world : 1);
    if (n < 1) n = 1;
  }
  fsdp_cpu_set_default_threads(n);
  return FSDP_OK;
}

int fsdp_host_mpi_threads(int local) {
  int n = env_rank_threads();
  if (n < 0) return FSDP_ERR;
  if (n == 0) {
    /* mpirun binds each rank to a core or two, to a socket, or not at all: the CPUs this
     * process may use, at most this machine's share of them */
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    long share = online / (local > 0 ? local : 1);
    n = fsdp_cpu_cores();
    if (share < n) n = (int)share;
    if (n < 1) n = 1;
  }
  fsdp_cpu_set_default_threads(n);
  return FSDP_OK;
}

char *fsdp_host_read_all(FILE *f, size_t *len) {
  size_t cap = 1 << 16, n = 0;
  errno = 0;
  char *buf = malloc(cap);
  while (buf != NULL) {
    n += fread(buf + n, 1, cap - 1 - n, f);
    if (n < cap - 1) break;
    char *bigger = realloc(buf, cap * 2);
    if (bigger == NULL) {
      free(buf);
      buf = NULL;
      break;
    }
    buf = bigger;
    cap *= 2;
  }
  if (buf == NULL) {
    errno = ENOMEM;
    return NULL;
  }
  if (ferror(f)) {
    int err = errno != 0 ? errno : EIO;
    free(buf);
    errno = err;
    return NULL;
  }
  buf[n] = '\0';
  *len = n;
  return buf;
}
