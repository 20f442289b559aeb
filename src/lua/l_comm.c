/*
 * l_comm.c — the ranks part of the fsdp.core module: rank, world size, the collectives a recipe
 * calls directly (barrier, all_reduce, broadcast), the byte collectives lua/fsdp/collective.lua
 * is built on (all_gather_bytes, broadcast_bytes, bytes_digest), traffic counters, timeout,
 * debug switch, flight recorder and abort. Every function works on the calling thread's
 * communicator (fsdp_comm_current(): the rank's, set by fsdprun; a world of one elsewhere).
 *
 * Tensors are reduced and broadcast in place (fsdp_comm_all_reduce_tensor, ..._broadcast_tensor)
 * and returned. Numbers (a Lua number, or an array of them for all_reduce) travel as f64, so
 * they come back exact: a double is broadcast bit for bit, and sums are those of doubles
 * (integers exact up to 2^53, as far as a Lua number holds them). Strings travel as bytes
 * (fsdp_comm_all_gather_bytes, fsdp_comm_broadcast_bytes: src/comm/values.c).
 *
 * Errors: argument errors are raised before any collective is issued, so a bad call fails on
 * the rank that made it (peers then see that rank's failure through the launcher's abort).
 * Communicator errors (a peer failed, a timeout, a fingerprint mismatch) become Lua errors with
 * the communicator's message.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "comm/comm.h"
#include "lua/binding.h"

static fsdp_comm *current(lua_State *L) {
  fsdp_comm *c = fsdp_comm_current();
  if (c == NULL) fsdp_lua_error(L); /* could not create the world of one */
  return c;
}

/* The optional label argument: NULL when absent. */
static const char *opt_label(lua_State *L, int idx, const char *fn) {
  if (lua_isnoneornil(L, idx)) return NULL;
  if (lua_type(L, idx) != LUA_TSTRING)
    luaL_error(L, "%s: the label must be a string, got %s", fn, luaL_typename(L, idx));
  return lua_tostring(L, idx);
}

/* ---- rank and world ----------------------------------------------------------------------- */

static int l_rank(lua_State *L) {
  lua_pushinteger(L, fsdp_comm_rank(current(L)));
  return 1;
}

static int l_world_size(lua_State *L) {
  lua_pushinteger(L, fsdp_comm_world(current(L)));
  return 1;
}

static int l_backend(lua_State *L) {
  lua_pushstring(L, fsdp_comm_backend(current(L)));
  return 1;
}

/* ---- collectives ---------------------------------------------------------------------------- */

static int l_barrier(lua_State *L) {
  fsdp_comm *c = current(L);
  const char *label = opt_label(L, 1, "barrier");
  if (fsdp_comm_barrier(c, label)) fsdp_lua_error(L);
  return 0;
}

static const char *const reduce_names[] = {"sum", "mean", "max", "min", NULL};
static const fsdp_reduce_op reduce_ops[] = {FSDP_RED_SUM, FSDP_RED_AVG, FSDP_RED_MAX,
                                            FSDP_RED_MIN};

static fsdp_reduce_op check_reduce_op(lua_State *L, int idx, const char *fn) {
  if (lua_isnoneornil(L, idx)) return FSDP_RED_SUM;
  if (lua_type(L, idx) == LUA_TSTRING) { /* checked first: lua_tostring converts numbers */
    const char *name = lua_tostring(L, idx);
    for (int i = 0; reduce_names[i] != NULL; i++)
      if (strcmp(name, reduce_names[i]) == 0) return reduce_ops[i];
    luaL_error(L, "%s: unknown op '%s' (sum, mean, max, min)", fn, name);
  }
  luaL_error(L, "%s: the op must be a string (sum, mean, max, min), got %s", fn,
             luaL_typename(L, idx));
  return FSDP_RED_SUM;
}

/* An array of numbers at idx as f64 in a userdata pushed on the stack (so a failing collective
 * that raises frees it); its length in *n. */
static double *numbers_arg(lua_State *L, int idx, const char *fn, int64_t *n) {
  size_t len = lua_objlen(L, idx);
  double *v = lua_newuserdata(L, (len ? len : 1) * sizeof *v);
  for (size_t i = 0; i < len; i++) {
    lua_rawgeti(L, idx, (int)i + 1);
    if (lua_type(L, -1) != LUA_TNUMBER)
      luaL_error(L, "%s: element %d of the array is %s, not a number", fn, (int)i + 1,
                 luaL_typename(L, -1));
    v[i] = lua_tonumber(L, -1);
    lua_pop(L, 1);
  }
  *n = (int64_t)len;
  return v;
}

static int l_all_reduce(lua_State *L) {
  fsdp_comm *c = current(L);
  fsdp_reduce_op red = check_reduce_op(L, 2, "all_reduce");
  const char *label = opt_label(L, 3, "all_reduce");
  if (lua_type(L, 1) == LUA_TNUMBER) {
    double v = lua_tonumber(L, 1);
    if (fsdp_comm_all_reduce(c, &v, 1, FSDP_DTYPE_F64, red, label)) fsdp_lua_error(L);
    lua_pushnumber(L, v);
    return 1;
  }
  if (lua_type(L, 1) == LUA_TTABLE) { /* an array of numbers: a new array of the results */
    int64_t n;
    double *v = numbers_arg(L, 1, "all_reduce", &n);
    if (fsdp_comm_all_reduce(c, v, n, FSDP_DTYPE_F64, red, label)) fsdp_lua_error(L);
    lua_createtable(L, (int)n, 0);
    for (int64_t i = 0; i < n; i++) {
      lua_pushnumber(L, v[i]);
      lua_rawseti(L, -2, (int)i + 1);
    }
    return 1;
  }
  fsdp_tensor *t = fsdp_lua_to_tensor(L, 1);
  if (t == NULL) {
    if (luaL_testudata(L, 1, FSDP_TENSOR_MT)) fsdp_lua_check_tensor(L, 1); /* freed: says so */
    luaL_error(L, "all_reduce: expected a number, an array of numbers or a tensor, got %s",
               luaL_typename(L, 1));
  }
  fsdp_lua_check_write(L, t, "all_reduce", "reduce its :item() (a number)");
  if (fsdp_comm_all_reduce_tensor(c, t, red, label)) fsdp_lua_error(L);
  lua_settop(L, 1);
  return 1;
}

/* The optional root argument (a rank number; 0 when absent). */
static int root_arg(lua_State *L, int idx, fsdp_comm *c, const char *fn) {
  if (lua_isnoneornil(L, idx)) return 0;
  int world = fsdp_comm_world(c);
  lua_Number r = lua_tonumber(L, idx);
  if (lua_type(L, idx) != LUA_TNUMBER)
    luaL_error(L, "%s: root must be a rank number, got %s", fn, luaL_typename(L, idx));
  if (r != floor(r) || r < 0 || r >= world)
    luaL_error(L, "%s: root %s is not a rank in [0, %d)", fn, lua_tostring(L, idx), world);
  return (int)r;
}

static int l_broadcast(lua_State *L) {
  fsdp_comm *c = current(L);
  int root = root_arg(L, 2, c, "broadcast");
  const char *label = opt_label(L, 3, "broadcast");
  if (lua_type(L, 1) == LUA_TNUMBER) {
    double v = lua_tonumber(L, 1);
    if (fsdp_comm_broadcast(c, &v, 1, FSDP_DTYPE_F64, root, label)) fsdp_lua_error(L);
    lua_pushnumber(L, v);
    return 1;
  }
  fsdp_tensor *t = fsdp_lua_to_tensor(L, 1);
  if (t == NULL) {
    if (luaL_testudata(L, 1, FSDP_TENSOR_MT)) fsdp_lua_check_tensor(L, 1);
    luaL_error(L, "broadcast: expected a number or a tensor, got %s", luaL_typename(L, 1));
  }
  fsdp_lua_check_write(L, t, "broadcast", NULL);
  if (fsdp_comm_broadcast_tensor(c, t, root, label)) fsdp_lua_error(L);
  lua_settop(L, 1);
  return 1;
}

/* ---- bytes ----------------------------------------------------------------------------------- */

/* The string at idx (numbers are not converted), or a Lua error naming fn. */
static const char *bytes_arg(lua_State *L, int idx, const char *fn, size_t *len) {
  if (lua_type(L, idx) != LUA_TSTRING)
    luaL_error(L, "%s: expected a string, got %s", fn, luaL_typename(L, idx));
  return lua_tolstring(L, idx, len);
}

/* fsdp_comm_alloc_fn: a userdata left on the stack (the collector frees it, raise or not) */
static void *alloc_userdata(void *ud, size_t n) { return lua_newuserdata((lua_State *)ud, n); }

/* all_gather_bytes(s [, label]) -> {rank 0's s, rank 1's s, ...} */
static int l_all_gather_bytes(lua_State *L) {
  fsdp_comm *c = current(L);
  size_t len, stride;
  const char *s = bytes_arg(L, 1, "all_gather_bytes", &len);
  const char *label = opt_label(L, 2, "all_gather_bytes");
  int W = fsdp_comm_world(c);
  int64_t *lens = lua_newuserdata(L, (size_t)W * sizeof *lens);
  char *all;
  if (fsdp_comm_all_gather_bytes(c, s, len, lens, &all, &stride, alloc_userdata, L, label))
    fsdp_lua_error(L);
  lua_createtable(L, W, 0);
  for (int p = 0; p < W; p++) {
    lua_pushlstring(L, all ? all + (size_t)p * stride : "", (size_t)lens[p]);
    lua_rawseti(L, -2, p + 1);
  }
  return 1;
}

/* broadcast_bytes(s, root [, label]) -> root's s (the other ranks' s is ignored: nil is fine). */
static int l_broadcast_bytes(lua_State *L) {
  fsdp_comm *c = current(L);
  int root = root_arg(L, 2, c, "broadcast_bytes");
  const char *label = opt_label(L, 3, "broadcast_bytes");
  size_t len = 0, n;
  const char *s = NULL, *out;
  if (fsdp_comm_rank(c) == root) s = bytes_arg(L, 1, "broadcast_bytes", &len);
  else if (!lua_isnil(L, 1) && lua_type(L, 1) != LUA_TSTRING)
    luaL_error(L, "broadcast_bytes: expected a string (or nil off the root), got %s",
               luaL_typename(L, 1));
  if (fsdp_comm_broadcast_bytes(c, s, len, root, &out, &n, alloc_userdata, L, label))
    fsdp_lua_error(L);
  if (out == s) lua_pushvalue(L, 1);
  else lua_pushlstring(L, out, n);
  return 1;
}

/* bytes_digest(s) -> two 32-bit halves of fsdp_comm_digest(s) (exact as Lua numbers and in f64
 * collectives): what collective.lua compares across ranks before sending whole values. */
static int l_bytes_digest(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  uint64_t h = fsdp_comm_digest(s, len);
  lua_pushnumber(L, (lua_Number)(h >> 32));
  lua_pushnumber(L, (lua_Number)(h & 0xffffffffu));
  return 2;
}

/* ---- accounting, debugging, failure ------------------------------------------------------- */

static void push_stats(lua_State *L, const fsdp_comm *c) {
  fsdp_comm_stats s;
  fsdp_comm_get_stats(c, &s);
  lua_createtable(L, 0, 2 * FSDP_COLL_COUNT + 5);
  int64_t calls = 0;
  for (int op = 0; op < FSDP_COLL_COUNT; op++) {
    const char *name = fsdp_coll_name((fsdp_coll_op)op);
    char key[64];
    snprintf(key, sizeof key, "%s_bytes", name);
    fsdp_lua_set_number(L, key, (lua_Number)s.bytes[op]);
    snprintf(key, sizeof key, "%s_calls", name);
    fsdp_lua_set_number(L, key, (lua_Number)s.calls[op]);
    calls += s.calls[op];
  }
  fsdp_lua_set_number(L, "calls", (lua_Number)calls);
  fsdp_lua_set_number(L, "busy_s", s.busy_s);
  fsdp_lua_set_number(L, "wait_s", s.wait_s);
}

/* The rank's communicator's counters; with hybrid sharding also those of its groups (the pair
 * of the last shard_size used): shard = {...}, replicate = {...}, shard_size = S. */
static int l_comm_stats(lua_State *L) {
  fsdp_comm *c = current(L), *sh, *rep;
  push_stats(L, c);
  int S = fsdp_comm_hybrid_last(c, &sh, &rep);
  if (S) {
    push_stats(L, sh);
    lua_setfield(L, -2, "shard");
    push_stats(L, rep);
    lua_setfield(L, -2, "replicate");
    lua_pushinteger(L, S);
    lua_setfield(L, -2, "shard_size");
  }
  return 1;
}

static int l_reset_comm_stats(lua_State *L) {
  fsdp_comm *c = current(L), *sh, *rep;
  fsdp_comm_reset_stats(c);
  if (fsdp_comm_hybrid_last(c, &sh, &rep)) {
    fsdp_comm_reset_stats(sh);
    fsdp_comm_reset_stats(rep);
  }
  return 0;
}

static int l_set_timeout(lua_State *L) {
  fsdp_comm *c = current(L);
  if (lua_type(L, 1) != LUA_TNUMBER || isnan(lua_tonumber(L, 1)))
    luaL_error(L, "set_timeout: expected seconds (a number; <= 0 for the default), got %s",
               luaL_typename(L, 1));
  fsdp_comm_set_timeout(c, lua_tonumber(L, 1));
  return 0;
}

static int l_timeout(lua_State *L) {
  lua_pushnumber(L, fsdp_comm_timeout(current(L)));
  return 1;
}

static int l_flight_recorder(lua_State *L) {
  char buf[16384];
  buf[0] = '\0';
  fsdp_comm_flight_recorder(current(L), buf, sizeof buf);
  lua_pushstring(L, buf);
  return 1;
}

static int l_abort(lua_State *L) {
  fsdp_comm *c = current(L);
  const char *msg = luaL_optstring(L, 1, "aborted");
  fsdp_comm_abort(c, msg);
  return 0;
}

static int l_poisoned(lua_State *L) {
  lua_pushboolean(L, fsdp_comm_poisoned(current(L)));
  return 1;
}

static const luaL_Reg comm_funcs[] = {
    {"rank", l_rank},
    {"world_size", l_world_size},
    {"backend", l_backend},
    {"barrier", l_barrier},
    {"all_reduce", l_all_reduce},
    {"broadcast", l_broadcast},
    {"all_gather_bytes", l_all_gather_bytes},
    {"broadcast_bytes", l_broadcast_bytes},
    {"bytes_digest", l_bytes_digest},
    {"comm_stats", l_comm_stats},
    {"reset_comm_stats", l_reset_comm_stats},
    {"set_timeout", l_set_timeout},
    {"timeout", l_timeout},
    {"flight_recorder", l_flight_recorder},
    {"abort", l_abort},
    {"poisoned", l_poisoned},
    {NULL, NULL},
};

void fsdp_lua_open_comm(lua_State *L) { luaL_register(L, NULL, comm_funcs); }
