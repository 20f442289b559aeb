/*
 * l_fsdp.c — the units part of the fsdp.core module (docs/fsdp.md, "units"): units as Lua
 * userdata over fsdp_unit (src/fsdp/unit.h), core.unit_new and core.param_unit.
 *
 * A box owns one reference to its unit; `__gc` drops it and is idempotent. As with tensors,
 * a registry cache (weak values) maps a C unit to its box, so the same unit always comes back
 * as the same userdata while that userdata lives (core.param_unit(p) == u). Units work on the
 * calling thread's communicator (fsdp_comm_current()) at creation and keep it.
 *
 * Positions are 1-based here (parameter indices, slices) and 0-based in C; offsets are flat
 * element offsets, 0-based as the contract says.
 */
#include <stdio.h>
#include <string.h>

#include "comm/comm.h"
#include "fsdp/unit.h"
#include "kernels/kernels.h"
#include "lua/binding.h"

#define FSDP_UNIT_MT "fsdp.Unit"

typedef struct {
  fsdp_unit *u;
} unit_box;

static const char UNIT_CACHE_KEY = 'u'; /* registry key (address) of the identity cache */

/* Push u as a Lua unit. Steals one reference. */
static void push_unit(lua_State *L, fsdp_unit *u) {
  if (fsdp_lua_box_push_cached(L, &UNIT_CACHE_KEY, u)) {
    fsdp_unit_release(u); /* the box already holds one */
    return;
  }
  fsdp_lua_box_push_new(L, &UNIT_CACHE_KEY, u, sizeof(unit_box), FSDP_UNIT_MT);
}

static fsdp_unit *check_unit(lua_State *L, int idx) {
  return fsdp_lua_box_check(L, idx, FSDP_UNIT_MT, NULL, "unit", "");
}

static fsdp_unit *opt_unit(lua_State *L, int idx) {
  return lua_isnoneornil(L, idx) ? NULL : check_unit(L, idx);
}

/* ---- core.unit_new(path, params, paths, opts) ------------------------------------------------ */

static fsdp_strategy check_strategy(lua_State *L, const char *s) {
  if (strcmp(s, "full") == 0) return FSDP_STRATEGY_FULL;
  if (strcmp(s, "grad_op") == 0) return FSDP_STRATEGY_GRAD_OP;
  if (strcmp(s, "none") == 0) return FSDP_STRATEGY_NONE;
  if (strcmp(s, "hybrid") == 0) return FSDP_STRATEGY_HYBRID;
  luaL_error(L, "unit_new: unknown strategy '%s' (expected \"full\", \"grad_op\", \"none\" or "
             "\"hybrid\")", s);
  return FSDP_STRATEGY_FULL;
}

static bool opt_bool(lua_State *L, int opts, const char *key, bool dflt) {
  if (!opts) return dflt;
  lua_getfield(L, opts, key);
  bool v = lua_isnil(L, -1) ? dflt : lua_toboolean(L, -1);
  lua_pop(L, 1);
  return v;
}

static int l_unit_new(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  luaL_checktype(L, 3, LUA_TTABLE);
  int opts = lua_isnoneornil(L, 4) ? 0 : 4;
  if (opts) luaL_checktype(L, 4, LUA_TTABLE);
  int n = (int)lua_objlen(L, 2);
  if ((int)lua_objlen(L, 3) != n)
    luaL_error(L, "unit_new: %d parameters but %d paths", n, (int)lua_objlen(L, 3));
  /* Temporary arrays as userdata: collected by Lua, so a Lua error leaks nothing. The path
   * strings stay valid while the paths table (argument 3) is on the stack. */
  fsdp_tensor **params = lua_newuserdata(L, sizeof *params * (size_t)(n ? n : 1));
  const char **paths = lua_newuserdata(L, sizeof *paths * (size_t)(n ? n : 1));
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, 2, i + 1);
    params[i] = fsdp_lua_to_tensor(L, -1);
    if (!params[i])
      luaL_error(L, "unit_new: params[%d] is a %s, expected a parameter tensor", i + 1,
                 luaL_typename(L, -1));
    lua_pop(L, 1);
    lua_rawgeti(L, 3, i + 1);
    if (lua_type(L, -1) != LUA_TSTRING)
      luaL_error(L, "unit_new: paths[%d] is a %s, expected a string", i + 1,
                 luaL_typename(L, -1));
    paths[i] = lua_tostring(L, -1);
    lua_pop(L, 1);
  }
  fsdp_unit_opts o = {.strategy = FSDP_STRATEGY_FULL, .reshard_after_forward = true,
                      .overlap_reduce = true};
  if (opts) {
    lua_getfield(L, opts, "strategy");
    if (!lua_isnil(L, -1)) {
      if (lua_type(L, -1) != LUA_TSTRING)
        luaL_error(L, "unit_new: strategy must be a string, got a %s", luaL_typename(L, -1));
      o.strategy = check_strategy(L, lua_tostring(L, -1));
    }
    lua_pop(L, 1);
  }
  o.is_root = opt_bool(L, opts, "root", false);
  o.reshard_after_forward = opt_bool(L, opts, "reshard_after_forward", true);
  o.offload = opt_bool(L, opts, "offload", false);
  o.overlap_reduce = opt_bool(L, opts, "overlap_reduce", true);
  /* mixed precision: param_dtype / reduce_dtype names (f32 when absent); device: where the
   * buffers go (a device name; absent: the parameters') */
  o.param_dtype = o.reduce_dtype = FSDP_DTYPE_F32;
  if (opts) {
    lua_getfield(L, opts, "device");
    if (!lua_isnil(L, -1)) {
      if (lua_type(L, -1) != LUA_TSTRING)
        luaL_error(L, "unit_new: device must be a device name, got a %s", luaL_typename(L, -1));
      if (!(o.device = fsdp_device_find(lua_tostring(L, -1)))) fsdp_lua_error(L);
    }
    lua_pop(L, 1);
    lua_getfield(L, opts, "param_dtype");
    if (!lua_isnil(L, -1)) o.param_dtype = fsdp_lua_check_dtype(L, -1);
    lua_getfield(L, opts, "reduce_dtype");
    if (!lua_isnil(L, -1)) o.reduce_dtype = fsdp_lua_check_dtype(L, -1);
    lua_pop(L, 2);
  }
  /* hybrid: the unit shards over its group of shard_size ranks (fsdp_comm_hybrid: made once,
   * collectively, kept by the rank's communicator) and averages gradients across the groups */
  fsdp_comm *c = fsdp_comm_current();
  if (!c) luaL_error(L, "unit_new: no communicator (out of memory)");
  lua_Integer shard_size = 0;
  if (opts) {
    lua_getfield(L, opts, "shard_size");
    if (!lua_isnil(L, -1)) {
      if (lua_type(L, -1) != LUA_TNUMBER || lua_tonumber(L, -1) != (lua_Number)lua_tointeger(L, -1))
        luaL_error(L, "unit_new: shard_size must be a whole number, got %s", luaL_typename(L, -1));
      shard_size = lua_tointeger(L, -1);
    }
    lua_pop(L, 1);
  }
  if ((o.strategy == FSDP_STRATEGY_HYBRID) != (shard_size != 0))
    luaL_error(L, "unit_new: shard_size goes with strategy \"hybrid\" (and only with it)");
  if (o.strategy == FSDP_STRATEGY_HYBRID) {
    if (shard_size < 1 || shard_size > INT32_MAX)
      luaL_error(L, "unit_new: shard_size must be >= 1, got %d", (int)shard_size);
    fsdp_comm *shard;
    if (fsdp_comm_hybrid(c, (int)shard_size, &shard, &o.replicate)) fsdp_lua_error(L);
    c = shard;
  }
  fsdp_unit *u;
  if (fsdp_unit_new(&u, c, path, params, paths, n, &o)) fsdp_lua_error(L);
  push_unit(L, u);
  return 1;
}

static int l_param_unit(lua_State *L) {
  fsdp_tensor *p = fsdp_lua_check_tensor(L, 1);
  fsdp_unit *u = fsdp_param_unit(p);
  if (!u) {
    lua_pushnil(L);
    return 1;
  }
  fsdp_unit_retain(u);
  push_unit(L, u);
  return 1;
}

/* ---- parameters between meta and dense (fsdp.materialize, unwrap of a meta model) ---------- */

static void contiguous_strides(int64_t *strides, int ndim, const int64_t *shape) {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    strides[i] = s;
    s *= shape[i] ? shape[i] : 1;
  }
}

/* A parameter as messages name it: its label (its path, once a model is wrapped or loaded), or
 * its dtype and shape ("the f32 parameter (2, 3)") in buf. */
static const char *param_name_in(char *buf, size_t cap, const fsdp_tensor *p) {
  if (p->label) return p->label;
  char shape[96];
  snprintf(buf, cap, "the %s parameter %s", fsdp_dtype_name(p->dtype),
           fsdp_shape_str(shape, sizeof shape, p->ndim, p->shape));
  return buf;
}
#define param_name(p) param_name_in((char[128]){0}, 128, (p))

/* core.param_materialize(p [, device]): a parameter on the meta device gets dense, zero-filled
 * storage of its size on device (the cpu by default; role params), in place: the same tensor object, so every reference to it (a tie,
 * an optimizer's list, a saved local) sees the new storage. Returns p. */
static int l_param_materialize(lua_State *L) {
  fsdp_tensor *p = fsdp_lua_check_tensor(L, 1);
  const fsdp_device_i *dev = &fsdp_device_cpu;
  if (!lua_isnoneornil(L, 2) && !(dev = fsdp_device_find(luaL_checkstring(L, 2))))
    return fsdp_lua_error(L);
  if (!dev->has_data)
    luaL_error(L, "param_materialize: the %s device holds no values", dev->name);
  if (p->storage->device != &fsdp_device_meta)
    luaL_error(L, "param_materialize: %s is on the %s device, not meta", param_name(p),
               p->storage->device->name);
  if (fsdp_param_unit(p))
    luaL_error(L, "param_materialize: %s belongs to a unit (materialize the wrapped model)",
               param_name(p));
  fsdp_storage *s;
  size_t bytes = (size_t)fsdp_tensor_numel(p) * fsdp_dtype_size(p->dtype);
  if (fsdp_storage_new(&s, dev, bytes, FSDP_ROLE_PARAMS)) return fsdp_lua_error(L);
  contiguous_strides(p->strides, p->ndim, p->shape);
  fsdp_tensor_set_storage(p, s, 0);
  fsdp_storage_release(s);
  lua_settop(L, 1);
  return 1;
}

/* core.param_to(p, device, dtype): a plain parameter's values moved to another device and/or
 * dtype, in place (the same parameter object: ties and saved references stay; its gradient
 * moves with it). A parameter of a unit is refused: move a model before wrapping it. Returns p. */
static int l_param_to(lua_State *L) {
  fsdp_tensor *p = fsdp_lua_check_tensor(L, 1);
  const fsdp_device_i *dev = fsdp_device_find(luaL_checkstring(L, 2));
  if (!dev) return fsdp_lua_error(L);
  fsdp_dtype dt = lua_isnoneornil(L, 3) ? p->dtype : fsdp_lua_check_dtype(L, 3);
  if (fsdp_param_unit(p))
    luaL_error(L, "to: %s belongs to a unit: move the model before wrapping it (or wrap it "
               "with its parameters where they should live)", param_name(p));
  if (dt != p->dtype && !fsdp_dtype_is_float(dt)) /* an integer parameter may keep its own */
    luaL_error(L, "to: %s: parameters take a float dtype, not %s", param_name(p),
               fsdp_dtype_name(dt));
  if (p->storage->device == dev && p->dtype == dt) {
    lua_settop(L, 1);
    return 1;
  }
  fsdp_tensor *moved = NULL, *grad = NULL;
  if (p->storage->device->has_data) {
    if (fsdp_to(&moved, p, dev, dt, FSDP_ROLE_PARAMS)) return fsdp_lua_error(L);
    if (p->grad && fsdp_to(&grad, p->grad, dev, dt, FSDP_ROLE_GRADS)) {
      fsdp_tensor_release(moved);
      return fsdp_lua_error(L);
    }
  } else if (dev->has_data) {
    luaL_error(L, "to: %s is on the %s device and has no values to move: materialize it first "
               "(fsdp.materialize(model, {device = \"%s\"}))", param_name(p),
               p->storage->device->name, dev->name);
  } else if (fsdp_tensor_new(&moved, dev, dt, p->ndim, p->shape, FSDP_ROLE_PARAMS)) {
    return fsdp_lua_error(L); /* meta to meta: only the dtype changes */
  }
  contiguous_strides(p->strides, p->ndim, p->shape);
  p->offset = 0;
  fsdp_tensor_set_storage(p, moved->storage, moved->offset);
  p->dtype = dt;
  fsdp_tensor_written(p);
  fsdp_tensor_set_grad(p, grad);
  fsdp_tensor_release(grad);
  fsdp_tensor_release(moved);
  lua_settop(L, 1);
  return 1;
}

/* core.param_to_meta(p): the reverse, for a parameter that never got values (unwrapping a model
 * that was wrapped on meta and not materialized): its storage becomes a meta one (no data), in
 * place; its gradient is dropped. Returns p. */
static int l_param_to_meta(lua_State *L) {
  fsdp_tensor *p = fsdp_lua_check_tensor(L, 1);
  if (fsdp_param_unit(p))
    luaL_error(L, "param_to_meta: %s belongs to a unit", param_name(p));
  if (p->storage->device != &fsdp_device_meta) {
    fsdp_storage *s;
    size_t bytes = (size_t)fsdp_tensor_numel(p) * fsdp_dtype_size(p->dtype);
    if (fsdp_storage_new(&s, &fsdp_device_meta, bytes, FSDP_ROLE_PARAMS))
      return fsdp_lua_error(L);
    contiguous_strides(p->strides, p->ndim, p->shape);
    fsdp_tensor_set_storage(p, s, 0);
    fsdp_storage_release(s);
  }
  fsdp_tensor_set_grad(p, NULL);
  lua_settop(L, 1);
  return 1;
}

/* core.same_storage(a, b): whether two tensors are backed by the same storage right now (ties:
 * one object has one storage; tests check it through every state). */
static int l_same_storage(lua_State *L) {
  fsdp_tensor *a = fsdp_lua_check_tensor(L, 1), *b = fsdp_lua_check_tensor(L, 2);
  lua_pushboolean(L, a->storage == b->storage);
  return 1;
}

/* ---- methods ------------------------------------------------------------------------------ */

/* u:params() or u:paths(): a list in the unit's parameter order */
static int param_list(lua_State *L, bool paths) {
  fsdp_unit *u = check_unit(L, 1);
  int n = fsdp_unit_nparams(u);
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    const fsdp_unit_param *p = fsdp_unit_param_at(u, i);
    if (paths) {
      lua_pushstring(L, p->path);
    } else {
      fsdp_tensor_retain(p->param);
      fsdp_lua_push_tensor(L, p->param);
    }
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int l_params(lua_State *L) { return param_list(L, false); }
static int l_paths(lua_State *L) { return param_list(L, true); }

static int l_state(lua_State *L) {
  fsdp_unit *u = check_unit(L, 1);
  lua_pushstring(L, fsdp_unit_state_get(u) == FSDP_UNIT_GATHERED ? "gathered" : "sharded");
  return 1;
}

/* u:dtypes() -> {param =, reduce =, gathered = (nil while sharded)}: mixed precision */
static int l_dtypes(lua_State *L) {
  fsdp_unit *u = check_unit(L, 1);
  const fsdp_unit_opts *o = fsdp_unit_options(u);
  lua_createtable(L, 0, 3);
  lua_pushstring(L, fsdp_dtype_name(o->param_dtype));
  lua_setfield(L, -2, "param");
  lua_pushstring(L, fsdp_dtype_name(o->reduce_dtype));
  lua_setfield(L, -2, "reduce");
  if (fsdp_unit_state_get(u) == FSDP_UNIT_GATHERED) {
    lua_pushstring(L, fsdp_dtype_name(fsdp_unit_gathered_dtype(u)));
    lua_setfield(L, -2, "gathered");
  }
  return 1;
}

static int l_strategy(lua_State *L) {
  lua_pushstring(L, fsdp_strategy_name(fsdp_unit_strategy(check_unit(L, 1))));
  return 1;
}

/* u:groups() -> {shard_rank =, shard_size =, replica =, replicas =}: where this rank sits in
 * the unit's sharding (replica 0 of 1 unless hybrid) */
static int l_groups(lua_State *L) {
  fsdp_unit *u = check_unit(L, 1);
  fsdp_comm *c = fsdp_unit_comm(u), *rep = fsdp_unit_replicate_comm(u);
  lua_createtable(L, 0, 4);
  lua_pushinteger(L, fsdp_comm_rank(c));
  lua_setfield(L, -2, "shard_rank");
  lua_pushinteger(L, fsdp_comm_world(c));
  lua_setfield(L, -2, "shard_size");
  lua_pushinteger(L, rep ? fsdp_comm_rank(rep) : 0);
  lua_setfield(L, -2, "replica");
  lua_pushinteger(L, rep ? fsdp_comm_world(rep) : 1);
  lua_setfield(L, -2, "replicas");
  return 1;
}

#define UNIT_ACTION(name, call)                                                                    \
  static int name(lua_State *L) {                                                                  \
    fsdp_unit *u = check_unit(L, 1);                                                               \
    if (call) fsdp_lua_error(L);                                                                   \
    return 0;                                                                                      \
  }
UNIT_ACTION(l_gather, fsdp_unit_gather(u))

/* u:reshard([{discard = true}]): discard drops changes written to the gathered parameters
 * (without it such a change is an error, not lost silently). */
static int l_reshard(lua_State *L) {
  static const char *const valid[] = {"discard", NULL};
  fsdp_unit *u = check_unit(L, 1);
  bool discard = false;
  if (!lua_isnoneornil(L, 2)) {
    luaL_checktype(L, 2, LUA_TTABLE);
    fsdp_lua_check_keys(L, 2, "reshard", valid);
    lua_getfield(L, 2, "discard");
    if (!lua_isnil(L, -1) && !lua_isboolean(L, -1))
      luaL_error(L, "reshard: discard must be a boolean (got %s)", luaL_typename(L, -1));
    discard = lua_toboolean(L, -1);
    lua_pop(L, 1);
  }
  if (discard ? fsdp_unit_reshard_discard(u) : fsdp_unit_reshard(u)) fsdp_lua_error(L);
  return 0;
}
UNIT_ACTION(l_prefetch, fsdp_unit_prefetch(u))
UNIT_ACTION(l_writeback, fsdp_unit_writeback(u))
UNIT_ACTION(l_accept_changes, fsdp_unit_accept_changes(u))

static int l_dirty(lua_State *L) {
  lua_pushboolean(L, fsdp_unit_dirty(check_unit(L, 1)));
  return 1;
}
UNIT_ACTION(l_zero_grad, fsdp_unit_zero_grad(u))
UNIT_ACTION(l_unshard, fsdp_unit_unshard(u))
UNIT_ACTION(l_reduce_held, fsdp_unit_reduce_held(u))

static int l_pre_forward(lua_State *L) {
  fsdp_unit *u = check_unit(L, 1);
  fsdp_unit *next = opt_unit(L, 2);
  if (fsdp_unit_pre_forward(u, next)) fsdp_lua_error(L);
  return 0;
}

/* u:post_forward([out_needs_grad]): whether the module's output requires a gradient; absent:
 * true (the use is recorded whenever pre_forward recorded it). */
static int l_post_forward(lua_State *L) {
  fsdp_unit *u = check_unit(L, 1);
  bool out_grad = lua_isnoneornil(L, 2) ? true : lua_toboolean(L, 2);
  if (fsdp_unit_post_forward(u, out_grad)) fsdp_lua_error(L);
  return 0;
}

static int l_trainable(lua_State *L) {
  lua_pushboolean(L, fsdp_unit_trainable(check_unit(L, 1)));
  return 1;
}

static int l_set_backward_prefetch(lua_State *L) {
  fsdp_unit *u = check_unit(L, 1);
  fsdp_unit_set_backward_prefetch(u, opt_unit(L, 2));
  return 0;
}

static int l_shard(lua_State *L) {
  fsdp_tensor *t;
  if (fsdp_unit_shard(check_unit(L, 1), &t)) fsdp_lua_error(L);
  fsdp_lua_push_tensor(L, t);
  return 1;
}

static int l_grad_shard(lua_State *L) {
  fsdp_tensor *t;
  if (fsdp_unit_grad_shard(check_unit(L, 1), &t)) fsdp_lua_error(L);
  fsdp_lua_push_tensor(L, t);
  return 1;
}

static int l_layout(lua_State *L) {
  fsdp_unit *u = check_unit(L, 1);
  int n = fsdp_unit_nparams(u), W = fsdp_comm_world(fsdp_unit_comm(u));
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    const fsdp_unit_param *q = fsdp_unit_param_at(u, i);
    lua_createtable(L, 0, 5);
    lua_pushstring(L, q->path);
    lua_setfield(L, -2, "path");
    fsdp_lua_set_number(L, "offset", (lua_Number)q->offset);
    fsdp_lua_set_number(L, "numel", (lua_Number)q->numel);
    lua_createtable(L, q->ndim, 0);
    for (int d = 0; d < q->ndim; d++) {
      lua_pushnumber(L, (lua_Number)q->shape[d]);
      lua_rawseti(L, -2, d + 1);
    }
    lua_setfield(L, -2, "shape");
    lua_createtable(L, 0, W);
    for (int r = 0; r < W; r++) {
      int64_t pf, sf, len = fsdp_unit_param_slice(u, i, r, &pf, &sf);
      if (!len) continue;
      lua_createtable(L, 2, 0);
      lua_pushnumber(L, (lua_Number)(pf + 1));
      lua_rawseti(L, -2, 1);
      lua_pushnumber(L, (lua_Number)(pf + len));
      lua_rawseti(L, -2, 2);
      lua_rawseti(L, -2, r);
    }
    lua_setfield(L, -2, "slices");
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int l_local_slices(lua_State *L) {
  fsdp_unit *u = check_unit(L, 1);
  int n = fsdp_unit_nparams(u), rank = fsdp_comm_rank(fsdp_unit_comm(u)), k = 0;
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    int64_t pf, sf, len = fsdp_unit_param_slice(u, i, rank, &pf, &sf);
    if (!len) continue;
    const fsdp_unit_param *q = fsdp_unit_param_at(u, i);
    lua_createtable(L, 0, 6);
    fsdp_lua_set_number(L, "index", (lua_Number)(i + 1));
    lua_pushstring(L, q->path);
    lua_setfield(L, -2, "path");
    fsdp_tensor_retain(q->param);
    fsdp_lua_push_tensor(L, q->param);
    lua_setfield(L, -2, "param");
    fsdp_lua_set_number(L, "shard_first", (lua_Number)(sf + 1));
    fsdp_lua_set_number(L, "shard_last", (lua_Number)(sf + len));
    fsdp_lua_set_number(L, "param_first", (lua_Number)(pf + 1));
    lua_rawseti(L, -2, ++k);
  }
  return 1;
}

/* u:has_grad(i): whether parameter i (1-based, as in u:params()) received a gradient on this
 * rank since u:zero_grad() (unit.h, fsdp_unit_param_has_grad); fsdp.optim agrees it across
 * ranks before stepping. */
static int l_has_grad(lua_State *L) {
  fsdp_unit *u = check_unit(L, 1);
  lua_Number i = luaL_checknumber(L, 2);
  int n = fsdp_unit_nparams(u);
  if (!(i >= 1 && i <= n) || i != (lua_Number)(int)i) /* in range first: then the cast is safe */
    luaL_error(L, "has_grad: %s is not a parameter index of unit '%s' (1 to %d)",
               lua_tostring(L, 2), fsdp_unit_path(u), n);
  lua_pushboolean(L, fsdp_unit_param_has_grad(u, (int)i - 1));
  return 1;
}

/* u:zero_param_grad(i): parameter i (1-based, as in u:params()) loses its gradient: its
 * range of the gradient shard (and of a held full gradient) := 0, and u:has_grad(i) is false
 * (unit.h, fsdp_unit_zero_param_grad; Module:zero_grad on a part of a wrapped model). */
static int l_zero_param_grad(lua_State *L) {
  fsdp_unit *u = check_unit(L, 1);
  lua_Number i = luaL_checknumber(L, 2);
  int n = fsdp_unit_nparams(u);
  if (!(i >= 1 && i <= n) || i != (lua_Number)(int)i) /* in range first: then the cast is safe */
    luaL_error(L, "zero_param_grad: %s is not a parameter index of unit '%s' (1 to %d)",
               lua_tostring(L, 2), fsdp_unit_path(u), n);
  if (fsdp_unit_zero_param_grad(u, (int)i - 1)) fsdp_lua_error(L);
  return 0;
}

/* u:set_grad_sync(on): with false, backwards keep the unit's full gradient unreduced until one
 * with true completes (unit.h, fsdp_unit_set_grad_sync; fsdp.no_sync drives it). */
static int l_set_grad_sync(lua_State *L) {
  fsdp_unit *u = check_unit(L, 1);
  luaL_checktype(L, 2, LUA_TBOOLEAN);
  fsdp_unit_set_grad_sync(u, lua_toboolean(L, 2));
  return 0;
}

static int l_grad_sync(lua_State *L) {
  lua_pushboolean(L, fsdp_unit_grad_sync(check_unit(L, 1)));
  return 1;
}

/* u:grad_unreduced(): the unit holds gradients accumulated with sync off, not reduced yet. */
static int l_grad_unreduced(lua_State *L) {
  lua_pushboolean(L, fsdp_unit_grad_unreduced(check_unit(L, 1)));
  return 1;
}

static int l_numel(lua_State *L) {
  lua_pushnumber(L, (lua_Number)fsdp_unit_numel(check_unit(L, 1)));
  return 1;
}
static int l_padded_numel(lua_State *L) {
  lua_pushnumber(L, (lua_Number)fsdp_unit_padded_numel(check_unit(L, 1)));
  return 1;
}
static int l_shard_numel(lua_State *L) {
  lua_pushnumber(L, (lua_Number)fsdp_unit_shard_numel(check_unit(L, 1)));
  return 1;
}

static int l_tostring(lua_State *L) {
  unit_box *b = luaL_checkudata(L, 1, FSDP_UNIT_MT);
  if (!b->u) {
    lua_pushstring(L, "unit(freed)");
    return 1;
  }
  fsdp_unit *u = b->u;
  lua_pushfstring(L, "unit('%s', %s, %d parameters, %d elements, %s)", fsdp_unit_path(u),
                  fsdp_strategy_name(fsdp_unit_strategy(u)), fsdp_unit_nparams(u),
                  (int)fsdp_unit_numel(u),
                  fsdp_unit_state_get(u) == FSDP_UNIT_GATHERED ? "gathered" : "sharded");
  return 1;
}

/* __index: methods (upvalue 1), then the fields path and is_root; other keys give nil. */
static int l_index(lua_State *L) {
  fsdp_unit *u = check_unit(L, 1);
  lua_pushvalue(L, 2);
  lua_rawget(L, lua_upvalueindex(1));
  if (!lua_isnil(L, -1)) return 1;
  lua_pop(L, 1);
  const char *k = lua_tostring(L, 2);
  if (k && strcmp(k, "path") == 0) {
    lua_pushstring(L, fsdp_unit_path(u));
    return 1;
  }
  if (k && strcmp(k, "is_root") == 0) {
    lua_pushboolean(L, fsdp_unit_is_root(u));
    return 1;
  }
  return 0;
}

static int l_gc(lua_State *L) {
  fsdp_unit_release(fsdp_lua_box_take(L, 1, FSDP_UNIT_MT));
  return 0;
}

static const luaL_Reg methods[] = {
    {"params", l_params},
    {"paths", l_paths},
    {"state", l_state},
    {"strategy", l_strategy},
    {"groups", l_groups},
    {"dtypes", l_dtypes},
    {"gather", l_gather},
    {"reshard", l_reshard},
    {"prefetch", l_prefetch},
    {"writeback", l_writeback},
    {"accept_changes", l_accept_changes},
    {"dirty", l_dirty},
    {"pre_forward", l_pre_forward},
    {"post_forward", l_post_forward},
    {"set_backward_prefetch", l_set_backward_prefetch},
    {"shard", l_shard},
    {"grad_shard", l_grad_shard},
    {"zero_grad", l_zero_grad},
    {"layout", l_layout},
    {"local_slices", l_local_slices},
    {"has_grad", l_has_grad},
    {"zero_param_grad", l_zero_param_grad},
    {"set_grad_sync", l_set_grad_sync},
    {"grad_sync", l_grad_sync},
    {"grad_unreduced", l_grad_unreduced},
    {"reduce_held", l_reduce_held},
    {"trainable", l_trainable},
    {"numel", l_numel},
    {"padded_numel", l_padded_numel},
    {"shard_numel", l_shard_numel},
    {"unshard", l_unshard},
    {NULL, NULL}};

static const luaL_Reg functions[] = {
    {"unit_new", l_unit_new}, {"param_unit", l_param_unit},
    {"param_materialize", l_param_materialize}, {"param_to_meta", l_param_to_meta},
    {"param_to", l_param_to},
    {"same_storage", l_same_storage}, {NULL, NULL}};

void fsdp_lua_open_fsdp(lua_State *L) {
  fsdp_lua_box_cache_new(L, &UNIT_CACHE_KEY);

  luaL_newmetatable(L, FSDP_UNIT_MT);
  lua_pushcfunction(L, l_gc);
  lua_setfield(L, -2, "__gc");
  lua_pushcfunction(L, l_tostring);
  lua_setfield(L, -2, "__tostring");
  lua_newtable(L);
  luaL_register(L, NULL, methods);
  lua_pushcclosure(L, l_index, 1);
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);

  luaL_register(L, NULL, functions);
}
