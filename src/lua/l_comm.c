/*
 * l_comm.c — the ranks part of the fsdp.core module: rank, world size, the collectives a recipe
 * calls directly (barrier, all_reduce, broadcast), traffic counters, timeout, debug switch,
 * flight recorder and abort. Every function works on the calling thread's communicator
 * (fsdp_comm_current(): the rank's, set by fsdprun; a world of one elsewhere). Owner: launcher.
 *
 * Tensors are reduced and broadcast in place (contiguous f32 tensors with data) and returned.
 *
 * Numbers are Lua doubles, and the communicator moves f32: a sum of counts past 2^24 or a
 * loss reduced through f32 would come back rounded, even in a world of one. So a number
 * travels exactly: each rank writes its double, cut into four 16-bit chunks stored as small
 * whole floats, into its own slot of a (world x 4) buffer of zeros; one all_reduce "sum" of
 * that buffer (adding zeros to whole numbers below 2^16 is exact) hands every rank every
 * rank's double, and each rank then reduces them in rank order 0..W-1 in double. All ranks get
 * the same bits, and the counters show one all_reduce call (of 16 x W bytes) per reduced
 * number. Broadcasting a number sends its four chunks the same way.
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

#define NUM_CHUNKS 4 /* 16-bit pieces of a double */

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

/* ---- numbers as exact chunks ------------------------------------------------------------- */

static void encode_double(float *out, double v) {
  uint64_t bits;
  memcpy(&bits, &v, sizeof bits);
  for (int k = 0; k < NUM_CHUNKS; k++) out[k] = (float)((bits >> (16 * k)) & 0xffffu);
}

static double decode_double(const float *in) {
  uint64_t bits = 0;
  for (int k = 0; k < NUM_CHUNKS; k++) bits |= (uint64_t)(uint32_t)in[k] << (16 * k);
  double v;
  memcpy(&v, &bits, sizeof v);
  return v;
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

/* The data of a tensor a collective may write in place, or a Lua error. */
static float *inplace_data(lua_State *L, fsdp_tensor *t, const char *fn) {
  float *d = fsdp_tensor_data(t, fn);
  if (d == NULL) fsdp_lua_error(L);
  if (!fsdp_tensor_is_contiguous(t))
    luaL_error(L, "%s: needs a contiguous tensor, got a strided view %s (use :contiguous())",
               fn, FSDP_SHAPE_STR(t));
  return d;
}

static double reduce_numbers(const float *slots, int world, fsdp_reduce_op red) {
  double acc = decode_double(slots);
  for (int r = 1; r < world; r++) {
    double v = decode_double(slots + (size_t)r * NUM_CHUNKS);
    switch (red) {
    case FSDP_RED_SUM:
    case FSDP_RED_AVG: acc += v; break;
    case FSDP_RED_MAX: /* a NaN anywhere wins, as in the tensor kernels */
      if (!isnan(acc) && (isnan(v) || v > acc)) acc = v;
      break;
    case FSDP_RED_MIN:
      if (!isnan(acc) && (isnan(v) || v < acc)) acc = v;
      break;
    }
  }
  if (red == FSDP_RED_AVG) acc /= world;
  return acc;
}

static int l_all_reduce(lua_State *L) {
  fsdp_comm *c = current(L);
  fsdp_reduce_op red = check_reduce_op(L, 2, "all_reduce");
  const char *label = opt_label(L, 3, "all_reduce");
  if (lua_type(L, 1) == LUA_TNUMBER) {
    int world = fsdp_comm_world(c), rank = fsdp_comm_rank(c);
    size_t n = (size_t)world * NUM_CHUNKS;
    /* a userdata, not malloc: the collective may fail and raise */
    float *slots = lua_newuserdata(L, n * sizeof *slots);
    memset(slots, 0, n * sizeof *slots);
    encode_double(slots + (size_t)rank * NUM_CHUNKS, lua_tonumber(L, 1));
    if (fsdp_comm_all_reduce(c, slots, (int64_t)n, FSDP_RED_SUM, label)) fsdp_lua_error(L);
    lua_pushnumber(L, reduce_numbers(slots, world, red));
    return 1;
  }
  fsdp_tensor *t = fsdp_lua_to_tensor(L, 1);
  if (t == NULL) {
    if (luaL_testudata(L, 1, FSDP_TENSOR_MT)) fsdp_lua_check_tensor(L, 1); /* freed: says so */
    luaL_error(L, "all_reduce: expected a number or a tensor, got %s", luaL_typename(L, 1));
  }
  float *d = inplace_data(L, t, "all_reduce");
  if (fsdp_comm_all_reduce(c, d, fsdp_tensor_numel(t), red, label)) fsdp_lua_error(L);
  t->version++;
  lua_settop(L, 1);
  return 1;
}

static int l_broadcast(lua_State *L) {
  fsdp_comm *c = current(L);
  int world = fsdp_comm_world(c);
  int root = 0;
  if (!lua_isnoneornil(L, 2)) {
    lua_Number r = lua_tonumber(L, 2);
    if (lua_type(L, 2) != LUA_TNUMBER)
      luaL_error(L, "broadcast: root must be a rank number, got %s", luaL_typename(L, 2));
    if (r != floor(r) || r < 0 || r >= world)
      luaL_error(L, "broadcast: root %s is not a rank in [0, %d)", lua_tostring(L, 2), world);
    root = (int)r;
  }
  const char *label = opt_label(L, 3, "broadcast");
  if (lua_type(L, 1) == LUA_TNUMBER) {
    float chunks[NUM_CHUNKS];
    encode_double(chunks, lua_tonumber(L, 1));
    if (fsdp_comm_broadcast(c, chunks, NUM_CHUNKS, root, label)) fsdp_lua_error(L);
    lua_pushnumber(L, decode_double(chunks));
    return 1;
  }
  fsdp_tensor *t = fsdp_lua_to_tensor(L, 1);
  if (t == NULL) {
    if (luaL_testudata(L, 1, FSDP_TENSOR_MT)) fsdp_lua_check_tensor(L, 1);
    luaL_error(L, "broadcast: expected a number or a tensor, got %s", luaL_typename(L, 1));
  }
  float *d = inplace_data(L, t, "broadcast");
  if (fsdp_comm_broadcast(c, d, fsdp_tensor_numel(t), root, label)) fsdp_lua_error(L);
  t->version++;
  lua_settop(L, 1);
  return 1;
}

/* ---- accounting, debugging, failure ------------------------------------------------------- */

static int l_comm_stats(lua_State *L) {
  fsdp_comm_stats s;
  fsdp_comm_get_stats(current(L), &s);
  lua_createtable(L, 0, 2 * FSDP_COLL_COUNT + 3);
  int64_t calls = 0;
  for (int op = 0; op < FSDP_COLL_COUNT; op++) {
    const char *name = fsdp_coll_name((fsdp_coll_op)op);
    char key[64];
    snprintf(key, sizeof key, "%s_bytes", name);
    lua_pushnumber(L, (lua_Number)s.bytes[op]);
    lua_setfield(L, -2, key);
    snprintf(key, sizeof key, "%s_calls", name);
    lua_pushnumber(L, (lua_Number)s.calls[op]);
    lua_setfield(L, -2, key);
    calls += s.calls[op];
  }
  lua_pushnumber(L, (lua_Number)calls);
  lua_setfield(L, -2, "calls");
  lua_pushnumber(L, s.busy_s);
  lua_setfield(L, -2, "busy_s");
  lua_pushnumber(L, s.wait_s);
  lua_setfield(L, -2, "wait_s");
  return 1;
}

static int l_reset_comm_stats(lua_State *L) {
  fsdp_comm_reset_stats(current(L));
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

static int l_set_debug(lua_State *L) {
  fsdp_comm *c = current(L);
  luaL_checkany(L, 1);
  fsdp_comm_set_debug(c, lua_toboolean(L, 1));
  return 0;
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
    {"comm_stats", l_comm_stats},
    {"reset_comm_stats", l_reset_comm_stats},
    {"set_timeout", l_set_timeout},
    {"timeout", l_timeout},
    {"set_debug", l_set_debug},
    {"flight_recorder", l_flight_recorder},
    {"abort", l_abort},
    {"poisoned", l_poisoned},
    {NULL, NULL},
};

void fsdp_lua_open_comm(lua_State *L) { luaL_register(L, NULL, comm_funcs); }
