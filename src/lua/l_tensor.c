/*
 * l_tensor.c — tensors as Lua userdata: constructors, methods, operators, printing.
 *
 * A userdata box owns one reference to its C tensor. The registry keeps a weak-valued cache
 * from C tensor address to box, so the same C tensor always comes back as the same userdata
 * while that userdata lives: parameter identity (ties, references saved before wrapping) is
 * plain Lua identity. `t:free()` and `__gc` drop the reference and are idempotent; a freed
 * tensor raises "tensor was freed" on use.
 *
 * Positions and dimensions are 1-based here (Lua users' convention) and 0-based in C.
 * Owner: grad.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd.h"
#include "kernels/cpu/kernels.h"
#include "lua/binding.h"

typedef struct {
  fsdp_tensor *t;
} tensor_box;

static const char CACHE_KEY = 'c'; /* registry key (address) of the identity cache */

int fsdp_lua_error(lua_State *L) {
  const char *msg = fsdp_error_msg();
  luaL_where(L, 1);
  if (lua_objlen(L, -1) == 0) {
    lua_pop(L, 1);
    luaL_where(L, 2);
  }
  lua_pushstring(L, msg[0] ? msg : "unknown engine error");
  lua_concat(L, 2);
  return lua_error(L);
}

/* Memory pressure. A tensor's box is a few bytes to Lua's collector, while the buffer behind
 * it can be megabytes: left alone, the collector runs only when Lua's own small heap grows,
 * and a training loop piles up hundreds of steps of dead activations (measured: 40x the
 * live set). So the binding counts the bytes of fresh storages it hands to Lua and runs a
 * full collection once that passes a threshold: at least 64 MiB, and 16x the Lua heap, so
 * the collection's cost (proportional to the Lua heap) stays small next to the allocation
 * it follows. After collecting, the tape drops the graphs whose results were collected
 * (fsdp_tape_prune): an evaluation loop run with gradients on does not pile up either. Per
 * thread, like the ranks' Lua states. */
#define GC_MIN_BYTES ((int64_t)64 << 20)
static _Thread_local int64_t gc_pending, gc_threshold = GC_MIN_BYTES;

static void gc_account(lua_State *L, const fsdp_tensor *t) {
  const fsdp_storage *s = t->storage;
  /* a view of a storage something else already holds adds nothing */
  if (!s->device->has_data || __atomic_load_n(&s->refcount, __ATOMIC_RELAXED) != 1) return;
  gc_pending += (int64_t)s->bytes;
  if (gc_pending < gc_threshold) return;
  gc_pending = 0;
  lua_gc(L, LUA_GCCOLLECT, 0);
  fsdp_tape_prune(); /* graphs whose results Lua just dropped */
  int64_t heap = (int64_t)lua_gc(L, LUA_GCCOUNT, 0) * 1024;
  gc_threshold = heap * 16 > GC_MIN_BYTES ? heap * 16 : GC_MIN_BYTES;
}

/* May run a full garbage collection before creating the box (t itself is safe: the caller's
 * reference is not Lua's), so a caller must not hold a borrowed pointer to a tensor that
 * only an unreachable Lua value keeps alive. Arguments on the caller's stack are reachable. */
void fsdp_lua_push_tensor(lua_State *L, fsdp_tensor *t) {
  if (fsdp_lua_box_push_cached(L, &CACHE_KEY, t)) {
    fsdp_tensor_release(t); /* the box already holds a reference */
    return;
  }
  gc_account(L, t);
  fsdp_lua_box_push_new(L, &CACHE_KEY, t, sizeof(tensor_box), FSDP_TENSOR_MT);
}

fsdp_tensor *fsdp_lua_to_tensor(lua_State *L, int idx) {
  tensor_box *b = luaL_testudata(L, idx, FSDP_TENSOR_MT);
  return b ? b->t : NULL;
}

fsdp_tensor *fsdp_lua_check_tensor(lua_State *L, int idx) {
  tensor_box *b = luaL_testudata(L, idx, FSDP_TENSOR_MT);
  if (!b) {
    const char *msg = lua_pushfstring(L, "tensor expected, got %s", luaL_typename(L, idx));
    luaL_argerror(L, idx, msg);
  }
  if (!b->t) luaL_error(L, "tensor was freed (t:free() was called on it)");
  return b->t;
}

static fsdp_tensor *opt_tensor(lua_State *L, int idx) {
  return lua_isnoneornil(L, idx) ? NULL : fsdp_lua_check_tensor(L, idx);
}

/* Like fsdp_lua_check_tensor, naming the function itself: Lua cannot name a metamethod or a
 * function reached through a tail call ("bad argument #1 to '?'"). */
static fsdp_tensor *arg_tensor(lua_State *L, int idx, const char *fn) {
  tensor_box *b = luaL_testudata(L, idx, FSDP_TENSOR_MT);
  if (!b)
    luaL_error(L, "bad argument #%d to '%s' (tensor expected, got %s)", idx, fn,
               luaL_typename(L, idx));
  if (!b->t) luaL_error(L, "%s: argument #%d is a freed tensor (t:free() was called on it)", fn, idx);
  return b->t;
}

/* The data of t, or a Lua error naming the op, the shape and the device. */
static float *need_data(lua_State *L, fsdp_tensor *t, const char *what) {
  float *d = fsdp_tensor_data(t, what); /* names the tensor and why it has no data */
  if (!d) fsdp_lua_error(L);
  return d;
}

int fsdp_lua_check_shape(lua_State *L, int idx, int64_t *shape) {
  int n = 0;
  if (lua_istable(L, idx)) {
    n = (int)lua_objlen(L, idx);
    if (n > FSDP_MAX_DIMS) luaL_error(L, "shape has %d dimensions; at most %d", n, FSDP_MAX_DIMS);
    for (int i = 0; i < n; i++) {
      lua_rawgeti(L, idx, i + 1);
      if (!lua_isnumber(L, -1))
        luaL_error(L, "shape entry %d is a %s, expected a number", i + 1, luaL_typename(L, -1));
      lua_Number v = lua_tonumber(L, -1);
      lua_pop(L, 1);
      if (v != floor(v) || v < -1 || v > 9007199254740992.0)
        luaL_error(L, "shape entry %d is %g; sizes are integers >= 0", i + 1, (double)v);
      shape[i] = (int64_t)v;
    }
    return n;
  }
  int top = lua_gettop(L);
  for (int i = idx; i <= top && lua_type(L, i) == LUA_TNUMBER; i++) {
    if (n == FSDP_MAX_DIMS) luaL_error(L, "shape has more than %d dimensions", FSDP_MAX_DIMS);
    lua_Number v = lua_tonumber(L, i);
    if (v != floor(v) || v < -1 || v > 9007199254740992.0)
      luaL_error(L, "shape entry %d is %g; sizes are integers >= 0", n + 1, (double)v);
    shape[n++] = (int64_t)v;
  }
  if (n == 0 && !lua_isnoneornil(L, idx) && !lua_istable(L, idx))
    luaL_argerror(L, idx, "shape expected (a table of sizes or sizes as arguments)");
  return n;
}

static void check_sizes(lua_State *L, int n, const int64_t *shape) {
  for (int i = 0; i < n; i++)
    if (shape[i] < 0) luaL_error(L, "shape entry %d is %d; sizes are integers >= 0", i + 1, (int)shape[i]);
}

/* ---- constructors ---------------------------------------------------------------------- */

/* Index of an options table argument after a shape given as table or varargs. */
/* Index of the options table that may follow a shape read from idx (a table, or ndim numbers),
 * 0 when there is none; anything else there is an error rather than silently ignored. */
static int opts_index(lua_State *L, int idx, int ndim, const char *fn) {
  int next = lua_istable(L, idx) ? idx + 1 : idx + ndim;
  if (lua_isnoneornil(L, next)) return 0;
  if (!lua_istable(L, next))
    luaL_error(L, "%s: expected an options table (e.g. {device = \"meta\"}) after the shape, "
               "got a %s", fn, luaL_typename(L, next));
  return next;
}

static const fsdp_device_i *opt_device(lua_State *L, int opts) {
  if (!opts) return &fsdp_device_cpu;
  lua_getfield(L, opts, "device");
  if (!lua_isnil(L, -1) && lua_type(L, -1) != LUA_TSTRING)
    luaL_error(L, "device must be a name (\"cpu\" or \"meta\"), got a %s", luaL_typename(L, -1));
  const char *name = lua_isnil(L, -1) ? "cpu" : lua_tostring(L, -1);
  const fsdp_device_i *d = fsdp_device_find(name);
  lua_pop(L, 1);
  if (!d) fsdp_lua_error(L);
  return d;
}

/* opts.role: what the memory accounting files the tensor under ("params", "grads", "optim",
 * "activations", "gathered", "other"); activations by default. */
static fsdp_role opt_role(lua_State *L, int opts) {
  if (!opts) return FSDP_ROLE_ACTIVATIONS;
  lua_getfield(L, opts, "role");
  fsdp_role role = FSDP_ROLE_ACTIVATIONS;
  if (!lua_isnil(L, -1)) {
    const char *name = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "";
    int k = 0;
    while (k < FSDP_ROLE_COUNT && strcmp(fsdp_role_name((fsdp_role)k), name) != 0) k++;
    if (k == FSDP_ROLE_COUNT)
      luaL_error(L, "role must be one of params, grads, optim, activations, gathered, other; got %s",
                 lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : luaL_typename(L, -1));
    role = (fsdp_role)k;
  }
  lua_pop(L, 1);
  return role;
}

static fsdp_tensor *new_tensor_role(lua_State *L, const fsdp_device_i *dev, int n,
                                    const int64_t *shape, fsdp_role role) {
  fsdp_tensor *t;
  check_sizes(L, n, shape);
  if (fsdp_tensor_new(&t, dev, FSDP_DTYPE_F32, n, shape, role)) fsdp_lua_error(L);
  return t;
}

static fsdp_tensor *new_tensor(lua_State *L, const fsdp_device_i *dev, int n, const int64_t *shape) {
  return new_tensor_role(L, dev, n, shape, FSDP_ROLE_ACTIVATIONS);
}

static int filled(lua_State *L, float v, const char *fn) {
  int64_t shape[FSDP_MAX_DIMS];
  int n = fsdp_lua_check_shape(L, 1, shape);
  int opts = opts_index(L, 1, n, fn);
  const fsdp_device_i *dev = opt_device(L, opts);
  fsdp_tensor *t = new_tensor_role(L, dev, n, shape, opt_role(L, opts));
  if (v != 0.0f && dev->has_data) fsdp_tensor_fill(t, v);
  fsdp_lua_push_tensor(L, t);
  return 1;
}

static int l_zeros(lua_State *L) { return filled(L, 0.0f, "zeros"); }
static int l_ones(lua_State *L) { return filled(L, 1.0f, "ones"); }
/* zero-filled too: the allocator hands out zeroed memory anyway */
static int l_empty(lua_State *L) { return filled(L, 0.0f, "empty"); }

/* full(shape_table, v) or full(d1, d2, ..., v): with varargs the last number is the value. */
static int l_full(lua_State *L) {
  int64_t shape[FSDP_MAX_DIMS];
  float v;
  if (lua_istable(L, 1)) {
    v = (float)luaL_checknumber(L, 2);
  } else {
    int top = lua_gettop(L);
    if (top < 1) luaL_error(L, "full: expected a shape and a value");
    v = (float)luaL_checknumber(L, top);
    lua_settop(L, top - 1);
  }
  int n = fsdp_lua_check_shape(L, 1, shape);
  fsdp_tensor *t = new_tensor(L, &fsdp_device_cpu, n, shape);
  fsdp_tensor_fill(t, v);
  fsdp_lua_push_tensor(L, t);
  return 1;
}

static int random_tensor(lua_State *L, bool normal) {
  int64_t shape[FSDP_MAX_DIMS];
  int n = fsdp_lua_check_shape(L, 1, shape);
  fsdp_tensor *t = new_tensor(L, &fsdp_device_cpu, n, shape);
  int64_t N = fsdp_tensor_numel(t);
  uint64_t first;
  uint64_t key = fsdp_rng_reserve(normal ? "randn" : "rand", N, &first);
  float *d = fsdp_tensor_data(t, "randn");
  if (normal) fsdp_rng_normal(d, N, key, first, 0.0f, 1.0f);
  else fsdp_rng_uniform(d, N, key, first);
  fsdp_lua_push_tensor(L, t);
  return 1;
}

static int l_randn(lua_State *L) { return random_tensor(L, true); }
static int l_rand(lua_State *L) { return random_tensor(L, false); }

static int l_arange(lua_State *L) {
  lua_Number a = 0, b, step = 1;
  if (lua_gettop(L) >= 2) {
    a = luaL_checknumber(L, 1);
    b = luaL_checknumber(L, 2);
    step = luaL_optnumber(L, 3, 1);
  } else {
    b = luaL_checknumber(L, 1);
  }
  if (step == 0) luaL_error(L, "arange: step must not be 0");
  lua_Number count = ceil((b - a) / step);
  if (!(count < 9007199254740992.0)) /* also NaN and inf */
    luaL_error(L, "arange: [%g, %g) in steps of %g is not a finite range", (double)a, (double)b,
               (double)step);
  int64_t n = count > 0 ? (int64_t)count : 0;
  fsdp_tensor *t = new_tensor(L, &fsdp_device_cpu, 1, &n);
  float *d = fsdp_tensor_data(t, "arange");
  for (int64_t i = 0; i < n; i++) d[i] = (float)(a + (lua_Number)i * step);
  fsdp_lua_push_tensor(L, t);
  return 1;
}

/* Shape of a nested table (rectangular), validated while walking. */
static int nested_shape(lua_State *L, int idx, int64_t *shape) {
  int n = 0;
  lua_pushvalue(L, idx);
  while (lua_istable(L, -1)) {
    if (n == FSDP_MAX_DIMS) luaL_error(L, "tensor: nesting deeper than %d levels", FSDP_MAX_DIMS);
    shape[n++] = (int64_t)lua_objlen(L, -1);
    if (shape[n - 1] == 0) break;
    lua_rawgeti(L, -1, 1);
    lua_remove(L, -2);
  }
  lua_pop(L, 1);
  return n;
}

static void nested_fill(lua_State *L, int idx, int dim, int n, const int64_t *shape, float **p) {
  if ((int64_t)lua_objlen(L, idx) != shape[dim])
    luaL_error(L, "tensor: ragged nested table (dimension %d has %d entries here, %d in the "
               "first row)", dim + 1, (int)lua_objlen(L, idx), (int)shape[dim]);
  for (int64_t i = 0; i < shape[dim]; i++) {
    lua_rawgeti(L, idx, (int)i + 1);
    if (dim == n - 1) {
      if (lua_type(L, -1) == LUA_TTABLE)
        luaL_error(L, "tensor: ragged nested table (a row where a number was expected, at "
                   "depth %d)", dim + 1);
      if (lua_type(L, -1) != LUA_TNUMBER)
        luaL_error(L, "tensor: entry is a %s, expected a number", luaL_typename(L, -1));
      *(*p)++ = (float)lua_tonumber(L, -1);
    } else {
      if (!lua_istable(L, -1)) luaL_error(L, "tensor: ragged nested table (a number where a row was expected)");
      nested_fill(L, lua_gettop(L), dim + 1, n, shape, p);
    }
    lua_pop(L, 1);
  }
}

static int l_tensor(lua_State *L) {
  if (lua_type(L, 1) == LUA_TNUMBER) {
    fsdp_tensor *t = new_tensor(L, &fsdp_device_cpu, 0, NULL);
    fsdp_tensor_data(t, "tensor")[0] = (float)lua_tonumber(L, 1);
    fsdp_lua_push_tensor(L, t);
    return 1;
  }
  luaL_checktype(L, 1, LUA_TTABLE);
  int64_t shape[FSDP_MAX_DIMS];
  int n = nested_shape(L, 1, shape);
  fsdp_tensor *t;
  if (fsdp_tensor_new(&t, &fsdp_device_cpu, FSDP_DTYPE_F32, n, shape, FSDP_ROLE_ACTIVATIONS))
    fsdp_lua_error(L);
  fsdp_lua_push_tensor(L, t); /* owned by Lua before anything can raise */
  float *p = fsdp_tensor_data(t, "tensor");
  nested_fill(L, 1, 0, n, shape, &p); /* also with no elements: {{}, {1}} is still ragged */
  return 1;
}

/* ---- basic methods ------------------------------------------------------------------------- */

static int l_shape(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  lua_createtable(L, t->ndim, 0);
  for (int i = 0; i < t->ndim; i++) {
    lua_pushnumber(L, (lua_Number)t->shape[i]);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int l_numel(lua_State *L) {
  lua_pushnumber(L, (lua_Number)fsdp_tensor_numel(fsdp_lua_check_tensor(L, 1)));
  return 1;
}

static int l_dim(lua_State *L) {
  lua_pushinteger(L, fsdp_lua_check_tensor(L, 1)->ndim);
  return 1;
}

static const float *read_data(lua_State *L, fsdp_tensor *t, const char *what) {
  return need_data(L, t, what);
}

static int l_item(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  if (fsdp_tensor_numel(t) != 1)
    luaL_error(L, "item: tensor %s has %d elements; item() needs exactly one",
               FSDP_SHAPE_STR(t), (int)fsdp_tensor_numel(t));
  lua_pushnumber(L, read_data(L, t, "item")[0]);
  return 1;
}

static void push_nested(lua_State *L, const float *d, const fsdp_tensor *t, int dim) {
  if (dim == t->ndim) {
    lua_pushnumber(L, d[0]);
    return;
  }
  lua_createtable(L, (int)t->shape[dim], 0);
  for (int64_t i = 0; i < t->shape[dim]; i++) {
    push_nested(L, d + i * t->strides[dim], t, dim + 1);
    lua_rawseti(L, -2, (int)i + 1);
  }
}

static int l_totable(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  const float *d = read_data(L, t, "totable");
  if (t->ndim == 0) {
    lua_pushnumber(L, d[0]);
    return 1;
  }
  push_nested(L, d, t, 0);
  return 1;
}

/* Element offset of 1-based positions at stack [idx, idx + ndim). */
static int64_t position(lua_State *L, fsdp_tensor *t, int idx, const char *what) {
  int64_t off = 0;
  for (int k = 0; k < t->ndim; k++) {
    lua_Number v = luaL_checknumber(L, idx + k);
    if (v != floor(v) || v < 1 || v > (lua_Number)t->shape[k])
      luaL_error(L, "%s: position %g is out of range for dimension %d of size %d in a tensor %s "
                 "(positions start at 1)", what, (double)v, k + 1, (int)t->shape[k],
                 FSDP_SHAPE_STR(t));
    off += ((int64_t)v - 1) * t->strides[k];
  }
  return off;
}

static int l_get(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  if (lua_gettop(L) - 1 != t->ndim)
    luaL_error(L, "get: tensor %s needs %d positions, got %d", FSDP_SHAPE_STR(t), t->ndim,
               lua_gettop(L) - 1);
  int64_t off = position(L, t, 2, "get");
  lua_pushnumber(L, read_data(L, t, "get")[off]);
  return 1;
}

static int l_set(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  if (lua_gettop(L) - 2 != t->ndim)
    luaL_error(L, "set: tensor %s needs %d positions and a value, got %d arguments",
               FSDP_SHAPE_STR(t), t->ndim, lua_gettop(L) - 1);
  int64_t off = position(L, t, 2, "set");
  float v = (float)luaL_checknumber(L, t->ndim + 2);
  ((float *)read_data(L, t, "set"))[off] = v;
  t->version++;
  lua_settop(L, 1);
  return 1;
}

static int l_fill(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  float v = (float)luaL_checknumber(L, 2);
  if (fsdp_tensor_fill(t, v)) fsdp_lua_error(L);
  t->version++;
  lua_settop(L, 1);
  return 1;
}

static int l_zero(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  if (fsdp_tensor_fill(t, 0.0f)) fsdp_lua_error(L);
  t->version++;
  lua_settop(L, 1);
  return 1;
}

static int l_copy(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1), *s = fsdp_lua_check_tensor(L, 2);
  if (fsdp_tensor_copy(t, s)) fsdp_lua_error(L);
  t->version++;
  lua_settop(L, 1);
  return 1;
}

/* A detached deep copy (not recorded; requires_grad false). Accounted as an activation even
 * when t is a parameter: a copy of a parameter is not one. */
static int l_clone(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1), *c;
  /* a meta tensor clones to meta; a tensor whose data is elsewhere (sharded) cannot clone */
  if (!t->storage->device->has_data && t->storage->device->no_data) need_data(L, t, "clone");
  if (fsdp_tensor_new(&c, t->storage->device, t->dtype, t->ndim, t->shape,
                      FSDP_ROLE_ACTIVATIONS))
    fsdp_lua_error(L);
  if (fsdp_tensor_copy(c, t)) {
    fsdp_tensor_release(c);
    fsdp_lua_error(L);
  }
  c->version = 0;
  fsdp_lua_push_tensor(L, c);
  return 1;
}

static int l_free(lua_State *L) {
  tensor_box *b = luaL_checkudata(L, 1, FSDP_TENSOR_MT);
  fsdp_tensor *t = b->t;
  b->t = NULL;
  fsdp_tensor_release(t);
  return 0;
}

static int l_is_contiguous(lua_State *L) {
  lua_pushboolean(L, fsdp_tensor_is_contiguous(fsdp_lua_check_tensor(L, 1)));
  return 1;
}

/* ---- differentiable methods -------------------------------------------------------------- */

static int l_view(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  int64_t shape[FSDP_MAX_DIMS];
  int n = fsdp_lua_check_shape(L, 2, shape);
  PUSH_OR_RAISE(fsdp_op_view(OUT, t, n, shape));
}

static int check_dim(lua_State *L, fsdp_tensor *t, int idx, const char *what) {
  lua_Number d = luaL_checknumber(L, idx);
  if (d < 0) d += t->ndim + 1; /* -1 is the last dimension */
  if (d != floor(d) || d < 1 || d > t->ndim)
    luaL_error(L, "%s: dimension %g out of range for a tensor %s (dimensions start at 1)", what,
               (double)luaL_checknumber(L, idx), FSDP_SHAPE_STR(t));
  return (int)d - 1;
}

static int l_transpose(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  int d0 = lua_isnoneornil(L, 2) ? t->ndim - 2 : check_dim(L, t, 2, "transpose");
  int d1 = lua_isnoneornil(L, 3) ? t->ndim - 1 : check_dim(L, t, 3, "transpose");
  if (t->ndim < 2 && lua_isnoneornil(L, 2)) luaL_error(L, "transpose: tensor %s has fewer than 2 dimensions", FSDP_SHAPE_STR(t));
  PUSH_OR_RAISE(fsdp_op_transpose(OUT, t, d0, d1));
}

static int l_narrow(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  int dim = check_dim(L, t, 2, "narrow");
  lua_Number start = luaL_checknumber(L, 3), len = luaL_checknumber(L, 4);
  lua_Number size = (lua_Number)t->shape[dim];
  if (start != floor(start) || len != floor(len) || start < 1 || len < 0 ||
      start - 1 + len > size)
    luaL_error(L, "narrow: start %g, length %g is out of range for dimension %d of size %g in a "
               "tensor %s (positions start at 1)", (double)start, (double)len, dim + 1,
               (double)size, FSDP_SHAPE_STR(t));
  PUSH_OR_RAISE(fsdp_op_narrow(OUT, t, dim, (int64_t)start - 1, (int64_t)len));
}

static int l_contiguous(lua_State *L) {
  PUSH_OR_RAISE(fsdp_op_contiguous(OUT, fsdp_lua_check_tensor(L, 1)));
}

static int l_detach(lua_State *L) { PUSH_OR_RAISE(fsdp_op_detach(OUT, fsdp_lua_check_tensor(L, 1))); }

static int l_matmul(lua_State *L) {
  PUSH_OR_RAISE(fsdp_op_matmul(OUT, fsdp_lua_check_tensor(L, 1), fsdp_lua_check_tensor(L, 2)));
}

static int reduce(lua_State *L, bool mean) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  if (lua_isnoneornil(L, 2)) PUSH_OR_RAISE(mean ? fsdp_op_mean(OUT, t) : fsdp_op_sum(OUT, t));
  int d = check_dim(L, t, 2, mean ? "mean" : "sum");
  PUSH_OR_RAISE(fsdp_op_sum_dim(OUT, t, d, mean));
}

static int l_sum(lua_State *L) { return reduce(L, false); }
static int l_mean(lua_State *L) { return reduce(L, true); }

#define UNARY(fn, op)                                                                              \
  static int fn(lua_State *L) { PUSH_OR_RAISE(fsdp_op_unary(OUT, fsdp_lua_check_tensor(L, 1), op)); }
UNARY(l_relu, FSDP_UNARY_RELU)
UNARY(l_gelu, FSDP_UNARY_GELU)
UNARY(l_exp, FSDP_UNARY_EXP)
UNARY(l_log, FSDP_UNARY_LOG)
UNARY(l_sqrt, FSDP_UNARY_SQRT)
UNARY(l_tanh, FSDP_UNARY_TANH)
UNARY(l_sigmoid, FSDP_UNARY_SIGMOID)

static int l_softmax(lua_State *L) { PUSH_OR_RAISE(fsdp_op_softmax(OUT, fsdp_lua_check_tensor(L, 1))); }

static int l_pow(lua_State *L) {
  PUSH_OR_RAISE(fsdp_op_pow(OUT, fsdp_lua_check_tensor(L, 1), (float)luaL_checknumber(L, 2)));
}

static const char *const arith_name[] = {"add", "sub", "mul", "div"};

/* Arithmetic: tensor op tensor, tensor op number, number op tensor. */
static int arith(lua_State *L, fsdp_binary_op op) {
  fsdp_tensor *a = fsdp_lua_to_tensor(L, 1), *b = fsdp_lua_to_tensor(L, 2);
  bool an = lua_type(L, 1) == LUA_TNUMBER, bn = lua_type(L, 2) == LUA_TNUMBER;
  if (a && b) PUSH_OR_RAISE(fsdp_op_binary(OUT, a, b, op));
  /* with a number the op is an affine map (or pow): name the operator the user wrote */
  if ((a && bn) || (an && b)) need_data(L, a ? a : b, arith_name[op]);
  if (a && bn) {
    float s = (float)lua_tonumber(L, 2);
    switch (op) {
    case FSDP_OP_ADD: PUSH_OR_RAISE(fsdp_op_affine(OUT, a, 1.0f, s));
    case FSDP_OP_SUB: PUSH_OR_RAISE(fsdp_op_affine(OUT, a, 1.0f, -s));
    case FSDP_OP_MUL: PUSH_OR_RAISE(fsdp_op_affine(OUT, a, s, 0.0f));
    case FSDP_OP_DIV: PUSH_OR_RAISE(fsdp_op_affine(OUT, a, 1.0f / s, 0.0f));
    }
  }
  if (an && b) {
    float s = (float)lua_tonumber(L, 1);
    switch (op) {
    case FSDP_OP_ADD: PUSH_OR_RAISE(fsdp_op_affine(OUT, b, 1.0f, s));
    case FSDP_OP_SUB: PUSH_OR_RAISE(fsdp_op_affine(OUT, b, -1.0f, s));
    case FSDP_OP_MUL: PUSH_OR_RAISE(fsdp_op_affine(OUT, b, s, 0.0f));
    case FSDP_OP_DIV: {
      fsdp_tensor *inv;
      if (fsdp_op_pow(&inv, b, -1.0f)) fsdp_lua_error(L);
      fsdp_tensor *out;
      int rc = fsdp_op_affine(&out, inv, s, 0.0f);
      fsdp_tensor_release(inv);
      if (rc) fsdp_lua_error(L);
      fsdp_lua_push_tensor(L, out);
      return 1;
    }
    }
  }
  /* a freed tensor or a wrong type: name what was given */
  for (int i = 1; i <= 2; i++) {
    tensor_box *bx = luaL_testudata(L, i, FSDP_TENSOR_MT);
    if (bx && !bx->t)
      luaL_error(L, "%s: operand %d is a freed tensor (t:free() was called on it)",
                 arith_name[op], i);
  }
  return luaL_error(L, "%s: expected tensors or numbers, got %s and %s", arith_name[op],
                    a ? "tensor" : luaL_typename(L, 1), b ? "tensor" : luaL_typename(L, 2));
}

static int l_add(lua_State *L) { return arith(L, FSDP_OP_ADD); }
static int l_sub(lua_State *L) { return arith(L, FSDP_OP_SUB); }
static int l_mul(lua_State *L) { return arith(L, FSDP_OP_MUL); }
static int l_div(lua_State *L) { return arith(L, FSDP_OP_DIV); }
static int l_unm(lua_State *L) {
  PUSH_OR_RAISE(fsdp_op_affine(OUT, arg_tensor(L, 1, "neg"), -1.0f, 0.0f));
}

static int l_backward(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1), *g = opt_tensor(L, 2);
  if (fsdp_backward(t, g)) fsdp_lua_error(L);
  return 0;
}

/* ---- non-differentiable reductions and in-place updates ------------------------------------ */

static fsdp_tensor *contiguous_data(lua_State *L, fsdp_tensor *t, const char *what) {
  if (!fsdp_tensor_data(t, what)) fsdp_lua_error(L);
  fsdp_tensor *c;
  if (fsdp_tensor_contiguous(&c, t)) fsdp_lua_error(L);
  return c;
}

static int l_argmax(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  if (t->ndim < 1) luaL_error(L, "argmax: needs at least one dimension");
  int64_t C = t->shape[t->ndim - 1];
  if (C == 0) luaL_error(L, "argmax: last dimension is empty");
  fsdp_tensor *c = contiguous_data(L, t, "argmax"), *out;
  if (fsdp_tensor_new_f32(&out, t->ndim - 1, t->shape)) {
    fsdp_tensor_release(c);
    fsdp_lua_error(L);
  }
  const float *x = fsdp_tensor_data(c, "argmax");
  float *o = fsdp_tensor_data(out, "argmax");
  int64_t N = fsdp_tensor_numel(c) / C;
  for (int64_t r = 0; r < N; r++) {
    const float *row = x + r * C;
    int64_t best = 0;
    for (int64_t j = 1; j < C; j++)
      if (row[j] > row[best]) best = j;
    o[r] = (float)best;
  }
  fsdp_tensor_release(c);
  fsdp_lua_push_tensor(L, out);
  return 1;
}

static int extreme(lua_State *L, bool want_max) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  int64_t N = fsdp_tensor_numel(t);
  if (N == 0) luaL_error(L, "%s: tensor is empty", want_max ? "max" : "min");
  fsdp_tensor *c = contiguous_data(L, t, want_max ? "max" : "min");
  const float *x = fsdp_tensor_data(c, "max");
  float m = x[0];
  for (int64_t i = 1; i < N; i++) m = want_max ? (x[i] > m ? x[i] : m) : (x[i] < m ? x[i] : m);
  fsdp_tensor_release(c);
  lua_pushnumber(L, m);
  return 1;
}

static int l_max(lua_State *L) { return extreme(L, true); }
static int l_min(lua_State *L) { return extreme(L, false); }

/* In-place updates for optimizers and clipping: contiguous buffers, no autograd. */
static float *inplace_data(lua_State *L, fsdp_tensor *t, const char *what) {
  float *d = fsdp_tensor_data(t, what);
  if (!d) fsdp_lua_error(L);
  if (!fsdp_tensor_is_contiguous(t))
    luaL_error(L, "%s: needs a contiguous tensor, got a strided view %s", what, FSDP_SHAPE_STR(t));
  return d;
}

static int l_add_(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1), *u = fsdp_lua_check_tensor(L, 2);
  float alpha = (float)luaL_optnumber(L, 3, 1.0);
  if (fsdp_tensor_numel(t) != fsdp_tensor_numel(u) || !fsdp_tensor_same_shape(t, u))
    luaL_error(L, "add_: shapes %s and %s differ", FSDP_SHAPE_STR(t), FSDP_SHAPE_STR(u));
  float *d = inplace_data(L, t, "add_");
  const float *s = inplace_data(L, u, "add_");
  int64_t N = fsdp_tensor_numel(t);
  for (int64_t i = 0; i < N; i++) d[i] += alpha * s[i];
  t->version++;
  lua_settop(L, 1);
  return 1;
}

static int l_mul_(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  float s = (float)luaL_checknumber(L, 2);
  float *d = inplace_data(L, t, "mul_");
  int64_t N = fsdp_tensor_numel(t);
  for (int64_t i = 0; i < N; i++) d[i] *= s;
  t->version++;
  lua_settop(L, 1);
  return 1;
}

/* ---- printing --------------------------------------------------------------------------- */

static void fmt_value(luaL_Buffer *b, float v) {
  char s[32];
  if (v == floorf(v) && fabsf(v) < 1e7f) snprintf(s, sizeof s, "%.0f", (double)v);
  else snprintf(s, sizeof s, "%.4g", (double)v);
  luaL_addstring(b, s);
}

/* Print with at most `edge` items at each end of every dimension. */
static void fmt_dim(luaL_Buffer *b, const float *d, const fsdp_tensor *t, int dim, int indent) {
  const int edge = 3;
  if (dim == t->ndim) {
    fmt_value(b, d[0]);
    return;
  }
  luaL_addchar(b, '[');
  int64_t n = t->shape[dim];
  for (int64_t i = 0; i < n; i++) {
    if (n > 2 * edge && i == edge) {
      luaL_addstring(b, dim == t->ndim - 1 ? "..., " : "...,\n");
      if (dim != t->ndim - 1)
        for (int k = 0; k <= indent; k++) luaL_addchar(b, ' ');
      i = n - edge;
    }
    fmt_dim(b, d + i * t->strides[dim], t, dim + 1, indent + 1);
    if (i + 1 < n) {
      if (dim == t->ndim - 1) luaL_addstring(b, ", ");
      else {
        luaL_addstring(b, ",\n");
        for (int k = 0; k <= indent; k++) luaL_addchar(b, ' ');
      }
    }
  }
  luaL_addchar(b, ']');
}

static int l_tostring(lua_State *L) {
  tensor_box *bx = luaL_checkudata(L, 1, FSDP_TENSOR_MT);
  if (!bx->t) {
    lua_pushstring(L, "tensor(freed)");
    return 1;
  }
  fsdp_tensor *t = bx->t;
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  char head[160];
  snprintf(head, sizeof head, "tensor(%s, %s, %s%s)", FSDP_SHAPE_STR(t), fsdp_dtype_name(t->dtype),
           t->storage->device->name, t->is_param ? ", parameter" : (t->requires_grad ? ", requires_grad" : ""));
  luaL_addstring(&b, head);
  if (t->storage->device->has_data) {
    luaL_addchar(&b, '\n');
    fmt_dim(&b, fsdp_tensor_data(t, "print"), t, 0, 0);
  }
  luaL_pushresult(&b);
  return 1;
}

/* ---- fields ------------------------------------------------------------------------------ */

/* __index: methods first (the method table is upvalue 1: one rawget on the hot path), then
 * fields. Unknown string keys give nil (duck typing: `if v.forward then`); other keys are an
 * error, since t[i] looks like element access and silently giving nil would hide a bug. */
static int l_index(lua_State *L) {
  tensor_box *bx = luaL_checkudata(L, 1, FSDP_TENSOR_MT);
  lua_pushvalue(L, 2);
  lua_rawget(L, lua_upvalueindex(1));
  if (!lua_isnil(L, -1)) return 1;
  lua_pop(L, 1);
  if (lua_type(L, 2) != LUA_TSTRING)
    luaL_error(L, "tensor: cannot index a tensor with a %s; use t:get(i, ...) and t:set(i, ..., "
               "v) for elements (positions start at 1)", luaL_typename(L, 2));
  {
    const char *k = lua_tostring(L, 2);
    fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
    if (strcmp(k, "grad") == 0) {
      if (!t->grad) return 0;
      fsdp_tensor_retain(t->grad);
      fsdp_lua_push_tensor(L, t->grad);
      return 1;
    }
    if (strcmp(k, "requires_grad") == 0) { lua_pushboolean(L, t->requires_grad); return 1; }
    if (strcmp(k, "is_param") == 0) { lua_pushboolean(L, t->is_param); return 1; }
    if (strcmp(k, "is_leaf") == 0) { lua_pushboolean(L, t->is_leaf); return 1; }
    if (strcmp(k, "has_data") == 0) {
      lua_pushboolean(L, t->storage->device->has_data);
      return 1;
    }
    if (strcmp(k, "device") == 0) { lua_pushstring(L, t->storage->device->name); return 1; }
    if (strcmp(k, "has_data") == 0) { lua_pushboolean(L, t->storage->device->has_data); return 1; }
    if (strcmp(k, "dtype") == 0) { lua_pushstring(L, fsdp_dtype_name(t->dtype)); return 1; }
    if (strcmp(k, "version") == 0) { lua_pushnumber(L, (lua_Number)t->version); return 1; }
  }
  (void)bx;
  return 0;
}

static int l_newindex(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  const char *k = luaL_checkstring(L, 2);
  if (strcmp(k, "grad") == 0) {
    if (lua_isnil(L, 3)) {
      fsdp_tensor_set_grad(t, NULL);
      return 0;
    }
    fsdp_tensor *g = fsdp_lua_check_tensor(L, 3);
    if (!fsdp_tensor_same_shape(g, t))
      luaL_error(L, "grad: shape %s does not match the tensor's %s", FSDP_SHAPE_STR(g),
                 FSDP_SHAPE_STR(t));
    if (!fsdp_tensor_is_contiguous(g)) luaL_error(L, "grad: must be a contiguous tensor");
    fsdp_tensor_set_grad(t, g);
    return 0;
  }
  if (strcmp(k, "requires_grad") == 0) {
    if (!t->is_leaf) luaL_error(L, "requires_grad: can only be set on a leaf tensor (one not computed by a recorded op); use detach()");
    t->requires_grad = lua_toboolean(L, 3);
    return 0;
  }
  return luaL_error(L, "tensor has no settable field '%s' (settable: grad, requires_grad)", k);
}

static int l_gc(lua_State *L) {
  tensor_box *b = luaL_checkudata(L, 1, FSDP_TENSOR_MT);
  fsdp_tensor *t = b->t;
  b->t = NULL;
  fsdp_tensor_release(t);
  return 0;
}

static const luaL_Reg methods[] = {
    {"shape", l_shape},       {"numel", l_numel},         {"dim", l_dim},
    {"item", l_item},         {"totable", l_totable},     {"clone", l_clone},
    {"view", l_view},         {"reshape", l_view},        {"free", l_free},
    {"get", l_get},           {"set", l_set},             {"fill", l_fill},
    {"zero", l_zero},         {"copy", l_copy},           {"add", l_add},
    {"sub", l_sub},           {"mul", l_mul},             {"div", l_div},
    {"neg", l_unm},           {"matmul", l_matmul},       {"sum", l_sum},
    {"mean", l_mean},         {"relu", l_relu},           {"gelu", l_gelu},
    {"exp", l_exp},           {"log", l_log},             {"sqrt", l_sqrt},
    {"tanh", l_tanh},         {"sigmoid", l_sigmoid},     {"softmax", l_softmax},
    {"pow", l_pow},           {"transpose", l_transpose}, {"narrow", l_narrow},
    {"contiguous", l_contiguous}, {"is_contiguous", l_is_contiguous},
    {"detach", l_detach},     {"backward", l_backward},   {"argmax", l_argmax},
    {"max", l_max},           {"min", l_min},             {"add_", l_add_},
    {"mul_", l_mul_},         {NULL, NULL}};

static const luaL_Reg metamethods[] = {
    {"__newindex", l_newindex}, {"__gc", l_gc},
    {"__tostring", l_tostring}, {"__add", l_add},     {"__sub", l_sub},
    {"__mul", l_mul},     {"__div", l_div},           {"__unm", l_unm},
    {NULL, NULL}};

/* is_tensor(x): true for a live tensor userdata (a freed one is false). */
static int l_is_tensor(lua_State *L) {
  lua_pushboolean(L, fsdp_lua_to_tensor(L, 1) != NULL);
  return 1;
}

static const luaL_Reg constructors[] = {
    {"is_tensor", l_is_tensor},
    {"tensor", l_tensor}, {"zeros", l_zeros}, {"ones", l_ones}, {"full", l_full},
    {"empty", l_empty},   {"randn", l_randn}, {"rand", l_rand}, {"arange", l_arange},
    {NULL, NULL}};

void fsdp_lua_open_tensor(lua_State *L) {
  fsdp_lua_box_cache_new(L, &CACHE_KEY); /* identity cache: weak values */

  luaL_newmetatable(L, FSDP_TENSOR_MT);
  luaL_register(L, NULL, metamethods);
  lua_newtable(L);
  luaL_register(L, NULL, methods);
  lua_pushvalue(L, -1);
  lua_setfield(L, -3, "__methods");
  lua_pushvalue(L, -1);
  lua_pushcclosure(L, l_index, 1);
  lua_setfield(L, -3, "__index");
  lua_setfield(L, -3, "Tensor"); /* module.Tensor = methods, so Lua code can add methods */
  lua_pop(L, 1);
  luaL_register(L, NULL, constructors);
}
