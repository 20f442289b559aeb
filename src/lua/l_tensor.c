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
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd.h"
#include "fsdp/unit.h"
#include "lua/binding.h"

typedef struct {
  fsdp_tensor *t;
} tensor_box;

static const char CACHE_KEY = 'c'; /* registry key (address) of the identity cache */
#define FREED_HINT " (t:free() was called on it)"

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

void fsdp_lua_check_write(lua_State *L, const fsdp_tensor *t, const char *what,
                          const char *instead) {
  if (fsdp_inplace_check(t, what, instead)) fsdp_lua_error(L);
}

fsdp_tensor *fsdp_lua_to_tensor(lua_State *L, int idx) {
  tensor_box *b = luaL_testudata(L, idx, FSDP_TENSOR_MT);
  return b ? b->t : NULL;
}

fsdp_tensor *fsdp_lua_check_tensor(lua_State *L, int idx) {
  return fsdp_lua_box_check(L, idx, FSDP_TENSOR_MT, NULL, "tensor", FREED_HINT);
}

static fsdp_tensor *opt_tensor(lua_State *L, int idx) {
  return lua_isnoneornil(L, idx) ? NULL : fsdp_lua_check_tensor(L, idx);
}

fsdp_tensor *fsdp_lua_arg_tensor(lua_State *L, int idx, const char *fn) {
  return fsdp_lua_box_check(L, idx, FSDP_TENSOR_MT, fn, "tensor", FREED_HINT);
}
#define arg_tensor fsdp_lua_arg_tensor

/* The data of t, or a Lua error naming the op, the shape and the device. */
static void *need_data(lua_State *L, fsdp_tensor *t, const char *what) {
  void *d = fsdp_tensor_data(t, what); /* names the tensor and why it has no data */
  if (!d) fsdp_lua_error(L);
  return d;
}

/* t's values readable on the host: a contiguous host tensor (t itself when it is one); the
 * caller releases it. A Lua error when t has no data. */
static fsdp_tensor *host_values(lua_State *L, fsdp_tensor *t, const char *what) {
  need_data(L, t, what);
  fsdp_tensor *h;
  if (fsdp_to_host(&h, t)) fsdp_lua_error(L);
  return h;
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

/* The number at idx, or a Lua error naming the function and the argument (a C function called
 * through pcall or a tail call has no name Lua could give). */
static lua_Number num_arg(lua_State *L, int idx, const char *fn, const char *what) {
  if (lua_type(L, idx) != LUA_TNUMBER)
    luaL_error(L, "bad argument #%d to '%s' (%s: number expected, got %s)", idx, fn, what,
               luaL_typename(L, idx));
  return lua_tonumber(L, idx);
}

/* A Lua error unless idx holds a table, naming the function and the argument. */
static void table_arg(lua_State *L, int idx, const char *fn, const char *what) {
  if (!lua_istable(L, idx))
    luaL_error(L, "bad argument #%d to '%s' (%s: table expected, got %s)", idx, fn, what,
               luaL_typename(L, idx));
}

/* ---- constructors ---------------------------------------------------------------------- */

/* Index of an options table argument after a shape given as table or varargs. */
/* Index of the options table that may follow a shape read from idx (a table, or ndim numbers),
 * 0 when there is none; anything else there is an error rather than silently ignored. */
/* Whether the table at idx has a string key (options written into a shape or nested table:
 * fsdp.zeros{2, 3, dtype = "bf16"}). */
static bool has_string_key(lua_State *L, int idx) {
  if (!lua_istable(L, idx)) return false;
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    lua_pop(L, 1);
    if (lua_type(L, -1) == LUA_TSTRING) {
      lua_pop(L, 1);
      return true;
    }
  }
  return false;
}

/* The options of a factory: in the shape table itself (its string keys), or in a table after
 * it; 0 when there are none. Both at once is an error (which would win is not obvious). */
static int opts_index(lua_State *L, int idx, int ndim, const char *fn) {
  int next = lua_istable(L, idx) ? idx + 1 : idx + ndim;
  bool inside = has_string_key(L, idx);
  if (lua_isnoneornil(L, next)) return inside ? idx : 0;
  if (!lua_istable(L, next))
    luaL_error(L, "%s: expected an options table (e.g. {device = \"meta\"}) after the shape, "
               "got a %s", fn, luaL_typename(L, next));
  if (inside)
    luaL_error(L, "%s: options given both in the shape table and after it; give them in one "
               "place", fn);
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

fsdp_dtype fsdp_lua_check_dtype(lua_State *L, int idx) {
  if (lua_type(L, idx) != LUA_TSTRING)
    luaL_error(L, "dtype must be a name (\"f32\", \"bf16\", ...), got a %s", luaL_typename(L, idx));
  fsdp_dtype dt;
  if (fsdp_dtype_parse(lua_tostring(L, idx), &dt)) fsdp_lua_error(L);
  return dt;
}

/* opts.dtype, f32 by default */
static fsdp_dtype opt_dtype(lua_State *L, int opts) {
  if (!opts) return FSDP_DTYPE_F32;
  lua_getfield(L, opts, "dtype");
  fsdp_dtype dt = lua_isnil(L, -1) ? FSDP_DTYPE_F32 : fsdp_lua_check_dtype(L, -1);
  lua_pop(L, 1);
  return dt;
}

/* Options tables refuse keys they do not know, naming the valid ones. */
/* shape: the index of the shape (or nested rows) argument, whose table may hold the options
 * too: its array part is then not an option. */
static void check_keys_in(lua_State *L, int opts, int shape, const char *fn,
                          const char *const *valid) {
  if (!opts) return;
  lua_pushnil(L);
  while (lua_next(L, opts)) {
    lua_pop(L, 1);
    if (opts == shape && lua_type(L, -1) == LUA_TNUMBER) continue;
    bool ok = false;
    if (lua_type(L, -1) == LUA_TSTRING)
      for (int i = 0; valid[i] && !ok; i++) ok = strcmp(lua_tostring(L, -1), valid[i]) == 0;
    if (!ok) {
      luaL_Buffer b;
      luaL_buffinit(L, &b);
      for (int i = 0; valid[i]; i++) {
        if (i) luaL_addstring(&b, ", ");
        luaL_addstring(&b, valid[i]);
      }
      luaL_pushresult(&b);
      luaL_error(L, "%s: unknown option '%s' (valid: %s)", fn,
                 lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : luaL_typename(L, -2),
                 lua_tostring(L, -1));
    }
  }
}

void fsdp_lua_check_keys(lua_State *L, int opts, const char *fn, const char *const *valid) {
  check_keys_in(L, opts, 0, fn, valid);
}

static const char *const factory_keys[] = {"device", "dtype", "role", NULL};

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

static fsdp_tensor *new_tensor_role(lua_State *L, const fsdp_device_i *dev, fsdp_dtype dt,
                                    int n, const int64_t *shape, fsdp_role role) {
  fsdp_tensor *t;
  check_sizes(L, n, shape);
  if (fsdp_tensor_new(&t, dev, dt, n, shape, role)) fsdp_lua_error(L);
  return t;
}

/* A new tensor from the options table at opts (0: none): device, dtype, role. */
static fsdp_tensor *new_from_opts(lua_State *L, int opts, int n, const int64_t *shape,
                                  const char *fn) {
  check_keys_in(L, opts, 1, fn, factory_keys); /* the shape is argument 1 */
  return new_tensor_role(L, opt_device(L, opts), opt_dtype(L, opts), n, shape,
                         opt_role(L, opts));
}

static int filled(lua_State *L, double v, const char *fn) {
  int64_t shape[FSDP_MAX_DIMS];
  int n = fsdp_lua_check_shape(L, 1, shape);
  int opts = opts_index(L, 1, n, fn);
  fsdp_tensor *t = new_from_opts(L, opts, n, shape, fn);
  fsdp_lua_push_tensor(L, t); /* owned by Lua before anything can raise */
  if (v != 0.0 && fsdp_fill(t, v)) fsdp_lua_error(L);
  return 1;
}

static int l_zeros(lua_State *L) { return filled(L, 0.0, "zeros"); }
static int l_ones(lua_State *L) { return filled(L, 1.0, "ones"); }
/* zero-filled too: the allocator hands out zeroed memory anyway */
static int l_empty(lua_State *L) { return filled(L, 0.0, "empty"); }

/* full(shape_table, v [, opts]) or full(d1, d2, ..., v): with varargs the last number is the
 * value. */
static int l_full(lua_State *L) {
  int64_t shape[FSDP_MAX_DIMS];
  double v;
  int opts = 0;
  if (lua_istable(L, 1)) {
    v = num_arg(L, 2, "full", "value");
    if (!lua_isnoneornil(L, 3)) {
      table_arg(L, 3, "full", "options");
      if (has_string_key(L, 1))
        luaL_error(L, "full: options given both in the shape table and after the value; give "
                   "them in one place");
      opts = 3;
    } else if (has_string_key(L, 1)) {
      opts = 1;
    }
  } else {
    int top = lua_gettop(L);
    if (top < 1) luaL_error(L, "full: expected a shape and a value");
    v = num_arg(L, top, "full", "value");
    lua_settop(L, top - 1);
  }
  int n = fsdp_lua_check_shape(L, 1, shape);
  fsdp_tensor *t = new_from_opts(L, opts, n, shape, "full");
  fsdp_lua_push_tensor(L, t);
  if (fsdp_fill(t, v)) fsdp_lua_error(L);
  return 1;
}

/* randn(shape [, opts]), rand(shape [, opts]): the thread's seeded streams, any float dtype
 * and device (the values are the same on every device: the stream is computed in f32) */
static int random_tensor(lua_State *L, bool normal) {
  const char *fn = normal ? "randn" : "rand";
  int64_t shape[FSDP_MAX_DIMS];
  int n = fsdp_lua_check_shape(L, 1, shape);
  int opts = opts_index(L, 1, n, fn);
  fsdp_tensor *t = new_from_opts(L, opts, n, shape, fn);
  fsdp_lua_push_tensor(L, t);
  if (!t->storage->device->has_data) return 1;
  int64_t N = fsdp_tensor_numel(t);
  uint64_t first;
  uint64_t key = fsdp_rng_reserve(normal ? "randn" : "rand", N, &first);
  const fsdp_kernels_i *k = fsdp_kernels_for(t, fn);
  if (!k || k->random(t->storage->device->ctx, t->dtype, need_data(L, t, fn), N, key, first,
                      normal, 0.0, 1.0))
    fsdp_lua_error(L);
  return 1;
}

static int l_randn(lua_State *L) { return random_tensor(L, true); }
static int l_rand(lua_State *L) { return random_tensor(L, false); }

/* arange(n), arange(a, b [, step]), each optionally followed by an options table */
static int l_arange(lua_State *L) {
  int opts = 0, top = lua_gettop(L);
  if (top >= 1 && lua_istable(L, top)) {
    opts = top;
    top--;
  }
  lua_Number a = 0, b, step = 1;
  if (top >= 2) {
    a = luaL_checknumber(L, 1);
    b = luaL_checknumber(L, 2);
    step = top >= 3 ? luaL_checknumber(L, 3) : 1;
  } else {
    b = luaL_checknumber(L, 1);
  }
  if (step == 0) luaL_error(L, "arange: step must not be 0");
  lua_Number count = ceil((b - a) / step);
  if (!(count < 9007199254740992.0)) /* also NaN and inf */
    luaL_error(L, "arange: [%g, %g) in steps of %g is not a finite range", (double)a, (double)b,
               (double)step);
  int64_t n = count > 0 ? (int64_t)count : 0;
  fsdp_tensor *t = new_from_opts(L, opts, 1, &n, "arange");
  fsdp_lua_push_tensor(L, t);
  if (!t->storage->device->has_data) return 1;
  const fsdp_kernels_i *k = fsdp_kernels_for(t, "arange");
  if (!k || k->arange(t->storage->device->ctx, t->dtype, need_data(L, t, "arange"), a, step, n))
    fsdp_lua_error(L);
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

static void nested_fill(lua_State *L, int idx, int dim, int n, const int64_t *shape, void *buf,
                        fsdp_dtype dt, int64_t *at) {
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
      fsdp_dtype_store(buf, dt, (*at)++, lua_tonumber(L, -1));
    } else {
      if (!lua_istable(L, -1)) luaL_error(L, "tensor: ragged nested table (a number where a row was expected)");
      nested_fill(L, lua_gettop(L), dim + 1, n, shape, buf, dt, at);
    }
    lua_pop(L, 1);
  }
}

/* tensor(number | nested table [, opts]): built on the host in the wanted dtype, then moved
 * to the wanted device */
static int l_tensor(lua_State *L) {
  int opts = has_string_key(L, 1) ? 1 : 0;
  if (!lua_isnoneornil(L, 2)) {
    table_arg(L, 2, "tensor", "options");
    if (opts)
      luaL_error(L, "tensor: options given both in the table and after it; give them in one "
                 "place");
    opts = 2;
  }
  check_keys_in(L, opts, 1, "tensor", factory_keys);
  const fsdp_device_i *dev = opt_device(L, opts);
  fsdp_dtype dt = opt_dtype(L, opts);
  fsdp_role role = opt_role(L, opts);
  int64_t shape[FSDP_MAX_DIMS];
  int n = 0;
  if (lua_type(L, 1) != LUA_TNUMBER) {
    if (!lua_istable(L, 1))
      luaL_error(L, "bad argument #1 to 'tensor' (values: a number or a nested table of numbers "
                 "expected, got %s)", luaL_typename(L, 1));
    n = nested_shape(L, 1, shape);
  }
  const fsdp_device_i *host = dev->host_memory || !dev->has_data ? dev : &fsdp_device_cpu;
  fsdp_tensor *t = new_tensor_role(L, host, dt, n, shape, role);
  fsdp_lua_push_tensor(L, t); /* owned by Lua before anything can raise */
  if (!host->has_data) return 1;
  void *p = need_data(L, t, "tensor");
  int64_t at = 0;
  if (n == 0 && lua_type(L, 1) == LUA_TNUMBER) fsdp_dtype_store(p, dt, 0, lua_tonumber(L, 1));
  else nested_fill(L, 1, 0, n, shape, p, dt, &at); /* also with no elements: {{}, {1}} is ragged */
  if (host != dev) {
    fsdp_tensor *d;
    if (fsdp_to(&d, t, dev, dt, role)) fsdp_lua_error(L);
    lua_pop(L, 1);
    fsdp_lua_push_tensor(L, d);
  }
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

static int l_item(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  if (fsdp_tensor_numel(t) != 1)
    luaL_error(L, "item: tensor %s has %d elements; item() needs exactly one",
               FSDP_SHAPE_STR(t), (int)fsdp_tensor_numel(t));
  fsdp_tensor *h = host_values(L, t, "item");
  lua_pushnumber(L, fsdp_dtype_load(fsdp_tensor_data(h, "item"), h->dtype, 0));
  fsdp_tensor_release(h);
  return 1;
}

/* d: element 0 of a host tensor with t's shape and strides */
static void push_nested(lua_State *L, const char *d, const fsdp_tensor *t, int dim) {
  if (dim == t->ndim) {
    lua_pushnumber(L, fsdp_dtype_load(d, t->dtype, 0));
    return;
  }
  const int64_t step = t->strides[dim] * (int64_t)fsdp_dtype_size(t->dtype);
  lua_createtable(L, (int)t->shape[dim], 0);
  for (int64_t i = 0; i < t->shape[dim]; i++) {
    push_nested(L, d + i * step, t, dim + 1);
    lua_rawseti(L, -2, (int)i + 1);
  }
}

static int l_totable(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  fsdp_tensor *h = host_values(L, t, "totable");
  /* a Lua error below would leak h: the walk only pushes numbers and tables */
  push_nested(L, fsdp_tensor_data(h, "totable"), h, 0);
  fsdp_tensor_release(h);
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
  const char *d = need_data(L, t, "get");
  const fsdp_device_i *dev = t->storage->device;
  unsigned char v[8];
  size_t es = fsdp_dtype_size(t->dtype);
  if (dev->to_host(dev->ctx, v, d + off * (int64_t)es, es)) fsdp_lua_error(L);
  lua_pushnumber(L, fsdp_dtype_load(v, t->dtype, 0));
  return 1;
}

static int l_set(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  if (lua_gettop(L) - 2 != t->ndim)
    luaL_error(L, "set: tensor %s needs %d positions and a value, got %d arguments",
               FSDP_SHAPE_STR(t), t->ndim, lua_gettop(L) - 1);
  fsdp_lua_check_write(L, t, "set", "build the values out of place (t = fsdp.where(mask, v, t))");
  int64_t off = position(L, t, 2, "set");
  double x = num_arg(L, t->ndim + 2, "set", "value");
  char *d = need_data(L, t, "set");
  const fsdp_device_i *dev = t->storage->device;
  unsigned char v[8];
  size_t es = fsdp_dtype_size(t->dtype);
  fsdp_dtype_store(v, t->dtype, 0, x);
  if (dev->from_host(dev->ctx, d + off * (int64_t)es, v, es)) fsdp_lua_error(L);
  fsdp_tensor_written(t);
  lua_settop(L, 1);
  return 1;
}

static int l_fill(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  double v = num_arg(L, 2, "fill", "value");
  fsdp_lua_check_write(L, t, "fill", "make a new tensor (fsdp.full(t:shape(), v))");
  if (fsdp_fill(t, v)) fsdp_lua_error(L);
  lua_settop(L, 1);
  return 1;
}

static int l_zero(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  fsdp_lua_check_write(L, t, "zero", "make a new tensor (fsdp.zeros(t:shape()))");
  if (fsdp_fill(t, 0.0)) fsdp_lua_error(L);
  lua_settop(L, 1);
  return 1;
}

static int l_copy(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1), *s = fsdp_lua_check_tensor(L, 2);
  fsdp_lua_check_write(L, t, "copy", "use the source itself (src:to(t:dtype()) converts it)");
  if (fsdp_copy(t, s)) fsdp_lua_error(L);
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
  if (fsdp_copy(c, t)) {
    fsdp_tensor_release(c);
    fsdp_lua_error(L);
  }
  c->version = 0;
  fsdp_lua_push_tensor(L, c);
  return 1;
}

/* t:free() and __gc: idempotent */
static int l_free(lua_State *L) {
  fsdp_tensor_release(fsdp_lua_box_take(L, 1, FSDP_TENSOR_MT));
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

/* An optional 1-based dimension argument (negative counts from the end) as a 0-based dim;
 * def when absent. */
int fsdp_lua_opt_dim(lua_State *L, fsdp_tensor *t, int idx, int def, const char *what) {
  return lua_isnoneornil(L, idx) ? def : check_dim(L, t, idx, what);
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

static int l_softmax(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  int dim = fsdp_lua_opt_dim(L, t, 2, t->ndim - 1, "softmax");
  PUSH_OR_RAISE(fsdp_op_softmax(OUT, t, dim));
}

/* t:to(dtype | device [, dtype | device]) or t:to{device =, dtype =}: a copy on that device
 * with that dtype (t itself when it already is both), recorded for gradients. */
static int l_to(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  const fsdp_device_i *dev = t->storage->device;
  fsdp_dtype dt = t->dtype;
  if (lua_istable(L, 2)) {
    static const char *const keys[] = {"device", "dtype", NULL};
    fsdp_lua_check_keys(L, 2, "to", keys);
    lua_getfield(L, 2, "device");
    if (!lua_isnil(L, -1)) {
      if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "to: device must be a name");
      if (!(dev = fsdp_device_find(lua_tostring(L, -1)))) fsdp_lua_error(L);
    }
    lua_getfield(L, 2, "dtype");
    if (!lua_isnil(L, -1)) dt = fsdp_lua_check_dtype(L, -1);
    lua_pop(L, 2);
  } else {
    int top = lua_gettop(L);
    if (top < 2) luaL_error(L, "to: expected a dtype or a device name (t:to(\"bf16\"), t:to(\"cpu\"))");
    for (int i = 2; i <= top; i++) {
      const char *name = luaL_checkstring(L, i);
      fsdp_dtype d;
      const fsdp_device_i *v;
      if (fsdp_dtype_parse(name, &d) == FSDP_OK) dt = d;
      else if ((v = fsdp_device_find(name)) != NULL) dev = v;
      else luaL_error(L, "to: '%s' is neither a dtype (f32, bf16, f16, f64, i64, i32, u8, "
                      "bool) nor a device: %s", name, fsdp_error_msg());
    }
  }
  fsdp_error_clear();
  PUSH_OR_RAISE(fsdp_op_to(OUT, t, dev, dt));
}

static int l_dtype(lua_State *L) {
  lua_pushstring(L, fsdp_dtype_name(fsdp_lua_check_tensor(L, 1)->dtype));
  return 1;
}

static int l_pow(lua_State *L) {
  PUSH_OR_RAISE(fsdp_op_pow(OUT, fsdp_lua_check_tensor(L, 1), (float)luaL_checknumber(L, 2)));
}

static const char *const arith_name[] = {"add", "sub", "mul", "div"};

static fsdp_tensor *operand(lua_State *L, int idx, fsdp_tensor *like, const char *fn);

/* Arithmetic: tensor op tensor, tensor op number, number op tensor. */
static int arith(lua_State *L, fsdp_binary_op op) {
  fsdp_tensor *a = fsdp_lua_to_tensor(L, 1), *b = fsdp_lua_to_tensor(L, 2);
  bool an = lua_type(L, 1) == LUA_TNUMBER, bn = lua_type(L, 2) == LUA_TNUMBER;
  if (a && b) PUSH_OR_RAISE(fsdp_op_binary(OUT, a, b, op));
  /* The affine and pow paths below take the number as an f32 scale: right for the f32 family,
   * not for f64 (precision) or integers (i * 2.5 would truncate, i / 2 divide silently). Those
   * make the number a tensor and take the binary op's promotion and refusals. */
  fsdp_tensor *t = a && bn ? a : an ? b : NULL;
  /* Division by a number divides: x / 3 is not x * (1/3) in floats, and 1/s overflows for the
   * smallest divisors (0 / 1e-39 would be NaN). f32 divides by the number as an f32 scalar
   * tensor, and so does number / tensor in every float dtype; bf16 and f16 tensor / number
   * keep the f32 reciprocal, whose error their own rounding dominates, unless it overflows. */
  bool divide = op == FSDP_OP_DIV && t &&
                (t->dtype == FSDP_DTYPE_F32 || an || !isfinite(1.0f / (float)lua_tonumber(L, 2)));
  if (t && (divide || (t->dtype != FSDP_DTYPE_F32 && t->dtype != FSDP_DTYPE_BF16 &&
                       t->dtype != FSDP_DTYPE_F16))) {
    need_data(L, t, arith_name[op]);
    fsdp_tensor *x = a ? a : operand(L, 1, t, arith_name[op]);
    fsdp_tensor *y = b ? b : operand(L, 2, t, arith_name[op]);
    PUSH_OR_RAISE(fsdp_op_binary(OUT, x, y, op));
  }
  /* with a number the op is an affine map (or pow): name the operator the user wrote */
  if ((a && bn) || (an && b)) need_data(L, a ? a : b, arith_name[op]);
  if (a && bn) {
    float s = (float)lua_tonumber(L, 2);
    switch (op) {
    case FSDP_OP_ADD: PUSH_OR_RAISE(fsdp_op_affine(OUT, a, 1.0f, s));
    case FSDP_OP_SUB: PUSH_OR_RAISE(fsdp_op_affine(OUT, a, 1.0f, -s));
    /* + -0: x * s + +0 would turn a product -0 into +0 */
    case FSDP_OP_MUL: PUSH_OR_RAISE(fsdp_op_affine(OUT, a, s, -0.0f));
    case FSDP_OP_DIV: PUSH_OR_RAISE(fsdp_op_affine(OUT, a, 1.0f / s, -0.0f));
    }
  }
  if (an && b) {
    float s = (float)lua_tonumber(L, 1);
    switch (op) {
    case FSDP_OP_ADD: PUSH_OR_RAISE(fsdp_op_affine(OUT, b, 1.0f, s));
    case FSDP_OP_SUB: PUSH_OR_RAISE(fsdp_op_affine(OUT, b, -1.0f, s));
    case FSDP_OP_MUL: PUSH_OR_RAISE(fsdp_op_affine(OUT, b, s, -0.0f));
    case FSDP_OP_DIV: break; /* divided above */
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
static int l_unm(lua_State *L) { /* -x, not 0 - x: -(+0) is -0 */
  PUSH_OR_RAISE(fsdp_op_affine(OUT, arg_tensor(L, 1, "neg"), -1.0f, -0.0f));
}

static int l_backward(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1), *g = opt_tensor(L, 2);
  if (fsdp_lua_backward(L, t, g)) fsdp_lua_error(L);
  return 0;
}

/* ---- non-differentiable reductions and in-place updates ------------------------------------ */

/* ---- selection: max, min, argmax, topk, sort, comparisons, where, clamp, cat, stack ------------ */

/* t:max(dim [, keepdim]) -> values, indices (i64, 0-based) */
static int extreme_dim(lua_State *L, fsdp_tensor *t, bool want_max) {
  const char *fn = want_max ? "max" : "min";
  int dim = check_dim(L, t, 2, fn);
  bool keep = lua_toboolean(L, 3);
  fsdp_tensor *v, *i;
  if (fsdp_op_extreme(&v, &i, t, dim, want_max, keep)) fsdp_lua_error(L);
  fsdp_lua_push_tensor(L, v);
  fsdp_lua_push_tensor(L, i);
  return 2;
}

/* max() / min() of every element, as a number (NaN when any is NaN); max(dim) / min(dim):
 * values and indices along dim */
static int extreme(lua_State *L, bool want_max) {
  const char *fn = want_max ? "max" : "min";
  fsdp_tensor *t = arg_tensor(L, 1, fn);
  if (!lua_isnoneornil(L, 2)) return extreme_dim(L, t, want_max);
  int64_t N = fsdp_tensor_numel(t);
  need_data(L, t, fn);
  if (N == 0) luaL_error(L, "%s: tensor is empty", fn);
  /* a dense copy on t's device when t is strided; the result, one element there, is read back */
  fsdp_tensor *c, *r = NULL;
  if (fsdp_to(&c, t, t->storage->device, t->dtype, FSDP_ROLE_ACTIVATIONS)) fsdp_lua_error(L);
  const fsdp_device_i *dev = c->storage->device;
  unsigned char v[8];
  const fsdp_kernels_i *k = fsdp_kernels_for(c, fn);
  int rc = !k || fsdp_tensor_new_uninit(&r, dev, c->dtype, 0, NULL, FSDP_ROLE_ACTIVATIONS) ||
           k->extreme_dim(dev->ctx, c->dtype, want_max, fsdp_tensor_data(r, fn), NULL,
                          fsdp_tensor_data(c, fn), 1, N, 1) ||
           dev->to_host(dev->ctx, v, fsdp_tensor_data(r, fn), fsdp_dtype_size(c->dtype));
  fsdp_tensor_release(c);
  fsdp_tensor_release(r);
  if (rc) fsdp_lua_error(L);
  lua_pushnumber(L, fsdp_dtype_load(v, t->dtype, 0));
  return 1;
}

static int l_max(lua_State *L) { return extreme(L, true); }
static int l_min(lua_State *L) { return extreme(L, false); }

/* argmax(t [, dim = last]) -> i64 indices (0-based) */
static int l_argmax(lua_State *L) {
  fsdp_tensor *t = arg_tensor(L, 1, "argmax");
  if (t->ndim < 1) luaL_error(L, "argmax: needs at least one dimension");
  int dim = fsdp_lua_opt_dim(L, t, 2, t->ndim - 1, "argmax");
  PUSH_OR_RAISE(fsdp_op_extreme(NULL, OUT, t, dim, true, false));
}

/* Options of topk / sort: {dim =, largest = | descending =}; unknown keys refused. */
static int sel_dim(lua_State *L, fsdp_tensor *t, int opts, const char *fn, const char *flag,
                   bool *on) {
  int dim = t->ndim - 1;
  if (!opts) return dim;
  const char *const keys[] = {"dim", flag, NULL};
  fsdp_lua_check_keys(L, opts, fn, keys);
  lua_getfield(L, opts, "dim");
  if (!lua_isnil(L, -1)) dim = check_dim(L, t, lua_gettop(L), fn);
  lua_getfield(L, opts, flag);
  if (!lua_isnil(L, -1)) *on = lua_toboolean(L, -1);
  lua_pop(L, 2);
  return dim;
}

static int opt_table(lua_State *L, int idx, const char *fn) {
  if (lua_isnoneornil(L, idx)) return 0;
  if (!lua_istable(L, idx)) luaL_error(L, "%s: expected an options table, got a %s", fn, luaL_typename(L, idx));
  return idx;
}

/* topk(t, k [, {dim = -1, largest = true}]) -> values, indices */
static int l_topk(lua_State *L) {
  fsdp_tensor *t = arg_tensor(L, 1, "topk");
  if (t->ndim < 1) luaL_error(L, "topk: needs at least one dimension");
  lua_Number k = luaL_checknumber(L, 2);
  if (k != floor(k) || fabs(k) > 9007199254740992.0) /* also inf: keeps the cast defined */
    luaL_error(L, "topk: k must be an integer, got %g", (double)k);
  bool largest = true;
  int dim = sel_dim(L, t, opt_table(L, 3, "topk"), "topk", "largest", &largest);
  fsdp_tensor *v, *i;
  if (fsdp_op_topk(&v, &i, t, (int64_t)k, dim, largest)) fsdp_lua_error(L);
  fsdp_lua_push_tensor(L, v);
  fsdp_lua_push_tensor(L, i);
  return 2;
}

/* sort(t [, {dim = -1, descending = false}]) -> values, indices (stable) */
static int l_sort(lua_State *L) {
  fsdp_tensor *t = arg_tensor(L, 1, "sort");
  if (t->ndim < 1) luaL_error(L, "sort: needs at least one dimension");
  bool desc = false;
  int dim = sel_dim(L, t, opt_table(L, 2, "sort"), "sort", "descending", &desc);
  fsdp_tensor *v, *i;
  if (fsdp_op_topk(&v, &i, t, t->shape[dim], dim, desc)) fsdp_lua_error(L);
  fsdp_lua_push_tensor(L, v);
  fsdp_lua_push_tensor(L, i);
  return 2;
}

/* A tensor operand, or a number made into a one-element tensor like `like` (its device; its
 * dtype when it holds v exactly). With an integer tensor, a number the dtype cannot hold does
 * not saturate (u8 > -1 must stay true): an integer becomes i64, anything else f32, and the op
 * promotes. */
static fsdp_tensor *operand(lua_State *L, int idx, fsdp_tensor *like, const char *fn) {
  if (lua_type(L, idx) != LUA_TNUMBER) return arg_tensor(L, idx, fn);
  double v = lua_tonumber(L, idx);
  fsdp_dtype dt = like->dtype;
  if (!fsdp_dtype_is_float(dt)) {
    unsigned char buf[8];
    fsdp_dtype_store(buf, dt, 0, v);
    if (fsdp_dtype_load(buf, dt, 0) != v) {
      fsdp_dtype_store(buf, FSDP_DTYPE_I64, 0, v);
      dt = fsdp_dtype_load(buf, FSDP_DTYPE_I64, 0) == v ? FSDP_DTYPE_I64 : FSDP_DTYPE_F32;
    }
  }
  fsdp_tensor *t;
  if (fsdp_tensor_new(&t, like->storage->device, dt, 0, NULL, FSDP_ROLE_ACTIVATIONS))
    fsdp_lua_error(L);
  fsdp_lua_push_tensor(L, t); /* owned by Lua (the stack keeps it alive for the call) */
  lua_replace(L, idx);
  if (fsdp_fill(t, v)) fsdp_lua_error(L);
  return t;
}

static int compare(lua_State *L, fsdp_cmpop op, const char *fn) {
  fsdp_tensor *a, *b;
  if (lua_type(L, 1) == LUA_TNUMBER) {
    b = arg_tensor(L, 2, fn);
    a = operand(L, 1, b, fn);
  } else {
    a = arg_tensor(L, 1, fn);
    b = operand(L, 2, a, fn);
  }
  PUSH_OR_RAISE(fsdp_op_compare(OUT, a, b, op));
}

static int l_gt(lua_State *L) { return compare(L, FSDP_CMP_GT, "gt"); }
static int l_ge(lua_State *L) { return compare(L, FSDP_CMP_GE, "ge"); }
static int l_lt(lua_State *L) { return compare(L, FSDP_CMP_LT, "lt"); }
static int l_le(lua_State *L) { return compare(L, FSDP_CMP_LE, "le"); }
static int l_eq(lua_State *L) { return compare(L, FSDP_CMP_EQ, "eq"); }
static int l_ne(lua_State *L) { return compare(L, FSDP_CMP_NE, "ne"); }

/* where(cond, a, b): a and b tensors or numbers */
static int l_where(lua_State *L) {
  fsdp_tensor *c = arg_tensor(L, 1, "where");
  fsdp_tensor *like = fsdp_lua_to_tensor(L, 2) ? fsdp_lua_to_tensor(L, 2)
                      : fsdp_lua_to_tensor(L, 3) ? fsdp_lua_to_tensor(L, 3) : NULL;
  if (!like) { /* two numbers: f32 values on the condition's device */
    fsdp_tensor *f;
    if (fsdp_tensor_new(&f, c->storage->device, FSDP_DTYPE_F32, 0, NULL, FSDP_ROLE_ACTIVATIONS))
      fsdp_lua_error(L);
    fsdp_lua_push_tensor(L, f);
    like = f;
  }
  fsdp_tensor *a = operand(L, 2, like, "where"), *b = operand(L, 3, like, "where");
  PUSH_OR_RAISE(fsdp_op_where(OUT, c, a, b));
}

/* clamp(t, min, max): either bound may be nil */
static int l_clamp(lua_State *L) {
  fsdp_tensor *t = arg_tensor(L, 1, "clamp");
  double lo = lua_isnoneornil(L, 2) ? -INFINITY : luaL_checknumber(L, 2);
  double hi = lua_isnoneornil(L, 3) ? INFINITY : luaL_checknumber(L, 3);
  if (lua_isnoneornil(L, 2) && lua_isnoneornil(L, 3))
    luaL_error(L, "clamp: give a min, a max or both");
  PUSH_OR_RAISE(fsdp_op_clamp(OUT, t, lo, hi));
}

/* The tensors of a Lua array (1-based) into a C array; a Lua error names a bad entry. */
static fsdp_tensor **tensor_list(lua_State *L, int idx, const char *fn, int *n) {
  luaL_checktype(L, idx, LUA_TTABLE);
  *n = (int)lua_objlen(L, idx);
  if (*n < 1) luaL_error(L, "%s: expected a non-empty array of tensors", fn);
  fsdp_tensor **ts = lua_newuserdata(L, sizeof *ts * (size_t)*n); /* freed by the GC */
  for (int i = 0; i < *n; i++) {
    lua_rawgeti(L, idx, i + 1);
    ts[i] = fsdp_lua_to_tensor(L, -1);
    if (!ts[i] && luaL_testudata(L, -1, FSDP_TENSOR_MT))
      luaL_error(L, "%s: entry %d is a freed tensor%s", fn, i + 1, FREED_HINT);
    if (!ts[i]) luaL_error(L, "%s: entry %d is a %s, expected a tensor", fn, i + 1, luaL_typename(L, -1));
    lua_pop(L, 1);
  }
  return ts;
}

/* cat({t1, t2, ...} [, dim = 1]) */
static int l_cat(lua_State *L) {
  int n;
  lua_settop(L, 2); /* tensor_list pushes its array above the optional dim */
  fsdp_tensor **ts = tensor_list(L, 1, "cat", &n);
  if (ts[0]->ndim < 1) luaL_error(L, "cat: cannot concatenate scalars (use stack)");
  int dim = fsdp_lua_opt_dim(L, ts[0], 2, 0, "cat");
  PUSH_OR_RAISE(fsdp_op_cat(OUT, ts, n, dim));
}

/* stack({t1, t2, ...} [, dim = 1]): the new dimension goes at dim (1..ndim+1) */
static int l_stack(lua_State *L) {
  int n;
  lua_settop(L, 2); /* tensor_list pushes its array above the optional dim */
  fsdp_tensor **ts = tensor_list(L, 1, "stack", &n);
  int dim = 0;
  if (!lua_isnoneornil(L, 2)) {
    lua_Number d = luaL_checknumber(L, 2);
    if (d < 0) d += ts[0]->ndim + 2;
    if (d != floor(d) || d < 1 || d > ts[0]->ndim + 1)
      luaL_error(L, "stack: dimension %g out of range for tensors %s (1..%d)",
                 (double)luaL_checknumber(L, 2), FSDP_SHAPE_STR(ts[0]), ts[0]->ndim + 1);
    dim = (int)d - 1;
  }
  PUSH_OR_RAISE(fsdp_op_stack(OUT, ts, n, dim));
}

UNARY(l_abs, FSDP_UNARY_ABS)
UNARY(l_sign, FSDP_UNARY_SIGN)

/* In-place updates for optimizers and clipping: contiguous destinations, not recorded (so a
 * tensor of a live graph is refused: fsdp_lua_check_write). */
static int l_add_(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1), *u = fsdp_lua_check_tensor(L, 2);
  double alpha = luaL_optnumber(L, 3, 1.0);
  fsdp_lua_check_write(L, t, "add_", "write t = t + alpha * u instead (recorded)");
  if (!fsdp_tensor_same_shape(t, u))
    luaL_error(L, "add_: shapes %s and %s differ", FSDP_SHAPE_STR(t), FSDP_SHAPE_STR(u));
  need_data(L, t, "add_");
  need_data(L, u, "add_");
  if (!fsdp_tensor_is_contiguous(t)) /* before fsdp_add_into's "add: ..." */
    luaL_error(L, "add_: needs a contiguous tensor, got a strided view %s", FSDP_SHAPE_STR(t));
  if (fsdp_add_into(t, u, alpha)) fsdp_lua_error(L);
  lua_settop(L, 1);
  return 1;
}

static int l_mul_(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  double s = luaL_checknumber(L, 2);
  fsdp_lua_check_write(L, t, "mul_", "write t = t * s instead (recorded)");
  need_data(L, t, "mul_");
  if (!fsdp_tensor_is_contiguous(t))
    luaL_error(L, "mul_: needs a contiguous tensor, got a strided view %s", FSDP_SHAPE_STR(t));
  const fsdp_kernels_i *k = fsdp_kernels_for(t, "mul_");
  if (!k || k->scale(t->storage->device->ctx, t->dtype, fsdp_tensor_data(t, "mul_"), s,
                     fsdp_tensor_numel(t)))
    fsdp_lua_error(L);
  fsdp_tensor_written(t);
  lua_settop(L, 1);
  return 1;
}

/* ---- printing --------------------------------------------------------------------------- */

static void fmt_value(luaL_Buffer *b, double v) {
  char s[32];
  if (v != v) snprintf(s, sizeof s, "nan"); /* not "-nan": 0/0 has its sign bit set on x86 */
  else if (v == floor(v) && fabs(v) < 1e15) snprintf(s, sizeof s, "%.0f", v);
  else snprintf(s, sizeof s, "%.4g", v);
  luaL_addstring(b, s);
}

/* Print with at most `edge` items at each end of every dimension. */
static void fmt_dim(luaL_Buffer *b, const char *d, const fsdp_tensor *t, int dim, int indent) {
  const int edge = 3;
  if (dim == t->ndim) {
    fmt_value(b, fsdp_dtype_load(d, t->dtype, 0));
    return;
  }
  const int64_t step = t->strides[dim] * (int64_t)fsdp_dtype_size(t->dtype);
  luaL_addchar(b, '[');
  int64_t n = t->shape[dim];
  for (int64_t i = 0; i < n; i++) {
    if (n > 2 * edge && i == edge) {
      luaL_addstring(b, dim == t->ndim - 1 ? "..., " : "...,\n");
      if (dim != t->ndim - 1)
        for (int k = 0; k <= indent; k++) luaL_addchar(b, ' ');
      i = n - edge;
    }
    fmt_dim(b, d + i * step, t, dim + 1, indent + 1);
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
    fsdp_tensor *h;
    if (fsdp_to_host(&h, t)) fsdp_lua_error(L);
    luaL_addchar(&b, '\n');
    fmt_dim(&b, fsdp_tensor_data(h, "print"), h, 0, 0);
    fsdp_tensor_release(h);
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
    if (g->dtype != t->dtype || g->storage->device != t->storage->device)
      luaL_error(L, "grad: a %s tensor on %s cannot be the gradient of a %s tensor on %s",
                 fsdp_dtype_name(g->dtype), g->storage->device->name, fsdp_dtype_name(t->dtype),
                 t->storage->device->name);
    fsdp_tensor_set_grad(t, g);
    return 0;
  }
  if (strcmp(k, "requires_grad") == 0) {
    if (!t->is_leaf) luaL_error(L, "requires_grad: can only be set on a leaf tensor (one not computed by a recorded op); use detach()");
    /* lua_toboolean would read "no", 0 and nil as a choice the user did not make */
    if (!lua_isboolean(L, 3))
      luaL_error(L, "requires_grad: must be true or false (got %s)", luaL_typename(L, 3));
    if (lua_toboolean(L, 3) && !fsdp_dtype_is_float(t->dtype))
      luaL_error(L, "requires_grad: only float tensors can require a gradient (this one is %s)",
                 fsdp_dtype_name(t->dtype));
    fsdp_param_set_requires_grad(t, lua_toboolean(L, 3));
    return 0;
  }
  return luaL_error(L, "tensor has no settable field '%s' (settable: grad, requires_grad)", k);
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
    {"mul_", l_mul_},         {"to", l_to},               {"dtype", l_dtype},
    {"abs", l_abs},           {"sign", l_sign},           {"gt", l_gt},
    {"ge", l_ge},             {"lt", l_lt},               {"le", l_le},
    {"eq", l_eq},             {"ne", l_ne},               {"where", l_where},
    {"clamp", l_clamp},       {"topk", l_topk},           {"sort", l_sort},
    {"cat", l_cat},           {"stack", l_stack},
    {NULL, NULL}};

static const luaL_Reg metamethods[] = {
    {"__newindex", l_newindex}, {"__gc", l_free},
    {"__tostring", l_tostring}, {"__add", l_add},     {"__sub", l_sub},
    {"__mul", l_mul},     {"__div", l_div},           {"__unm", l_unm},
    {NULL, NULL}};

/* dtype_name(x): the canonical name of a dtype name ("bfloat16" -> "bf16"), nil when x names
 * none. */
static int l_dtype_name(lua_State *L) {
  fsdp_dtype dt;
  if (lua_type(L, 1) == LUA_TSTRING && fsdp_dtype_parse(lua_tostring(L, 1), &dt) == FSDP_OK)
    lua_pushstring(L, fsdp_dtype_name(dt));
  else
    lua_pushnil(L);
  fsdp_error_clear();
  return 1;
}

/* grad_of(t) -> t.grad (nil when it has none), fresh: true when this call made the gradient's Lua
 * value, which the caller may then free (t:free()) once done with it if it handed it to no one.
 * Optimizers do: without it each step's gradients would outlive zero_grad until Lua's collector
 * found the value the optimizer made. */
static int l_grad_of(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1), *g = t->grad;
  if (!g) {
    lua_pushnil(L);
    lua_pushboolean(L, 0);
    return 2;
  }
  bool fresh = !fsdp_lua_box_push_cached(L, &CACHE_KEY, g);
  if (fresh) {
    fsdp_tensor_retain(g);
    fsdp_lua_push_tensor(L, g);
  }
  lua_pushboolean(L, fresh);
  return 2;
}

/* is_tensor(x): true for a live tensor userdata (a freed one is false). */
static int l_is_tensor(lua_State *L) {
  lua_pushboolean(L, fsdp_lua_to_tensor(L, 1) != NULL);
  return 1;
}

/* memory_stamp(t) -> id, version: t's storage and that storage's version (fsdp_storage), which
 * every in-place write through any tensor over the memory (a view, detach()) bumps; t.version
 * counts only writes through t. Both as numbers (exact below 2^53). */
static int l_memory_stamp(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  lua_pushnumber(L, (lua_Number)t->storage->id);
  lua_pushnumber(L, (lua_Number)t->storage->version);
  return 2;
}

static const luaL_Reg constructors[] = {
    {"is_tensor", l_is_tensor}, {"dtype_name", l_dtype_name}, {"grad_of", l_grad_of},
    {"memory_stamp", l_memory_stamp},
    {"tensor", l_tensor}, {"zeros", l_zeros}, {"ones", l_ones}, {"full", l_full},
    {"empty", l_empty},   {"randn", l_randn}, {"rand", l_rand}, {"arange", l_arange},
    {NULL, NULL}};

/* Tensor functions that are also methods: fsdp.abs(t) is t:abs(). */
static const luaL_Reg functions[] = {
    {"abs", l_abs},     {"sign", l_sign},   {"where", l_where}, {"cat", l_cat},
    {"stack", l_stack}, {"topk", l_topk},   {"sort", l_sort},   {"clamp", l_clamp},
    {"argmax", l_argmax}, {"gt", l_gt},     {"ge", l_ge},       {"lt", l_lt},
    {"le", l_le},       {"eq", l_eq},       {"ne", l_ne},       {"max", l_max},
    {"min", l_min},     {NULL, NULL}};

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
  luaL_register(L, NULL, functions);
}
