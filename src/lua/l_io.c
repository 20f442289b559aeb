/*
 * l_io.c — the io layer (src/io) in `fsdp.core`: safetensors writers and readers, JSON
 * documents, and the fault injector for tests. Registered by fsdp_lua_open_io
 * (called from module.c). The checkpoint code of lua/fsdp builds fsdp.save / fsdp.load on it.
 *
 *   st_writer(path, entries, metadata) -> writer    entries = {{name =, shape = {...},
 *                                                   dtype =}, ...}: dtype as the format names
 *                                                   it ("F32", "BF16", "F16", "F64", "I64",
 *                                                   "I32", "U8", "BOOL") or as a tensor dtype
 *                                                   ("bf16"), F32 by default; metadata =
 *                                                   {key = "value", ...}, written sorted by key
 *     w:write(name, tensor)   append the tensor's values (any shape; it is flattened) to entry
 *                             `name`: entries are written in order, each in one or several
 *                             calls (a shard at a time). A tensor of the entry's dtype is
 *                             written as it is; another dtype is converted. Tensors that are
 *                             not contiguous host memory of the entry's dtype go through a
 *                             1 MiB host buffer, a piece at a time (fsdp_io_st_write_tensor)
 *     w:commit()              the file appears whole under `path`, or an error and nothing
 *     w:abort()               drop the temporary; __gc aborts a writer never committed
 *   st_open(path) -> reader
 *     r:entries()             { {name =, shape = {...}, dtype = "F32", tensor_dtype = "f32"
 *                             (nil for the format's dtypes that are no tensor dtype), offset =,
 *                             numel =, checksum = "16 hex digits" or nil}, ... } in header
 *                             order; offset = first byte within the data section
 *     r:metadata()            { key = value } (the writer's checksum keys included)
 *     r:read(name [, first [, count [, out]]]) -> a cpu tensor of the stored dtype: without
 *                             first, the whole tensor in its shape (checksum checked); with
 *                             first, a 1-D tensor of elements [first, first + count) of the
 *                             flattened tensor — first is a 0-based element offset, count
 *                             defaults to the rest; with out (a contiguous tensor of count
 *                             elements, any dtype and device), read into it, converting to its
 *                             dtype (fsdp_io_st_read_tensor), and return it
 *     r:verify([name])        check one tensor's checksum (or every tensor's) by reading it
 *     r:path(), r:close()     close is idempotent; a closed reader raises on use
 *   json_write(path, value [, opts])   value: tables (arrays 1..n, or string keys, written
 *                             sorted), strings (UTF-8), finite numbers (exact: integers as
 *                             integers, others with the fewest digits that read back the same
 *                             double), booleans; an empty table is written as {}. opts:
 *                             nonfinite = "error" (default) | "null" | "string" (NaN,
 *                             Infinity, -Infinity as those strings); first = {keys}: objects
 *                             put these keys first, in this order, the rest sorted
 *   json_read(path) -> value  objects and arrays become tables (arrays 1-based); null is nil
 *   io_fault(point, errno_name_or_number [, after_bytes])   this thread's next atomic-file
 *                             call at point ("open", "write", "fsync", "rename"; "none" clears)
 *                             fails with that errno; see fsdp_io_fault_set
 *
 * Checkpoint support (used by lua/fsdp/checkpoint.lua):
 *   json_encode(value [, opts]) -> compact JSON text (the rules and options of json_write)
 *   json_decode(text [, name [, opts]]) -> value   name stands for the source in messages;
 *                             opts: nonfinite = true (the strings "NaN", "Infinity",
 *                             "-Infinity" and those bare words read as numbers), null = v
 *                             (what null becomes; nil by default), raise = false (a syntax
 *                             error returns nil, the message, its line and column)
 *   ckpt_index_read(path) -> table   read and fully check a sharded checkpoint index
 *                             (fsdp_io_index_read: its checksum first); ckpt_index_write(path,
 *                             tbl) writes it as the current version with the checksum of its
 *                             bytes (tbl's version and index_xxh3 are replaced), checked by
 *                             the same rules, through an atomic file
 *   io_mkdirs(path)  io_listdir(path) -> sorted names  io_remove(path)  io_fsync_dir(path)
 *   io_size(path) -> bytes of a regular file, or nil and the message
 *   rng_state() -> {seed = "16 hex", streams = {randn = "16 hex", rand =, dropout =}}: the
 *                             calling thread's random state (autograd.h); set_rng_state(t)
 *                             restores one (streams absent from t restart at 0);
 *                             check_rng_state(t) raises what set_rng_state(t) would, changing
 *                             nothing (fsdp.load checks while staging)
 *
 * Resource rule (binding.h): every C object that must survive a Lua error lives in a userdata
 * whose __gc frees it (writer, reader, cJSON document), created before the call that fills it.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <sys/stat.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd.h"
#include "io/io.h"
#include "kernels/kernels.h"
#include "lua/binding.h"

#define WRITER_MT "fsdp.io.StWriter"
#define READER_MT "fsdp.io.StReader"
#define JSON_MT "fsdp.io.json"
#define JSON_MAX_DEPTH 64

typedef struct {
  fsdp_io_st_writer *w;
} writer_box;
typedef struct {
  fsdp_io_st_reader *r;
} reader_box;
typedef struct {
  cJSON *doc;
} json_box;

/* ---- safetensors writer ---------------------------------------------------------------- */

static int cmp_kv(const void *a, const void *b) {
  return strcmp(((const fsdp_io_kv *)a)->key, ((const fsdp_io_kv *)b)->key);
}

/* An entry's dtype: the format's name of a tensor dtype ("BF16") or a tensor dtype ("bf16"). */
static fsdp_io_dtype check_st_dtype(lua_State *L, int idx, int i, const char *name) {
  const char *s = lua_type(L, idx) == LUA_TSTRING ? lua_tostring(L, idx) : NULL;
  int io = s != NULL ? fsdp_io_dtype_from_name(s) : -1;
  fsdp_dtype t;
  if (s != NULL && io < 0 && fsdp_dtype_parse(s, &t) == FSDP_OK) io = fsdp_io_dtype_of_tensor(t);
  fsdp_error_clear();
  if (io < 0 || !fsdp_io_dtype_to_tensor((fsdp_io_dtype)io, &t))
    luaL_error(L, "st_writer: entries[%d] ('%s'): dtype must be one of F32, BF16, F16, F64, I64, "
                  "I32, U8, BOOL (or f32, bf16, ...), got %s",
               i, name, s != NULL ? s : luaL_typename(L, idx));
  return (fsdp_io_dtype)io;
}

static void check_entries(lua_State *L, int idx, fsdp_io_st_entry **out, int *nout) {
  luaL_checktype(L, idx, LUA_TTABLE);
  int n = (int)lua_objlen(L, idx);
  /* scratch owned by Lua: freed by the collector even if a check below raises */
  fsdp_io_st_entry *e = lua_newuserdata(L, sizeof *e * (size_t)(n > 0 ? n : 1));
  memset(e, 0, sizeof *e * (size_t)(n > 0 ? n : 1));
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, idx, i + 1);
    if (!lua_istable(L, -1))
      luaL_error(L, "st_writer: entries[%d] must be a table {name =, shape =}, got %s", i + 1,
                 luaL_typename(L, -1));
    lua_getfield(L, -1, "name");
    if (lua_type(L, -1) != LUA_TSTRING)
      luaL_error(L, "st_writer: entries[%d].name must be a string, got %s", i + 1,
                 luaL_typename(L, -1));
    size_t len;
    e[i].name = lua_tolstring(L, -1, &len); /* the string lives in the entries table */
    if (strlen(e[i].name) != len)
      luaL_error(L, "st_writer: entries[%d].name contains a zero byte", i + 1);
    lua_pop(L, 1);
    lua_getfield(L, -1, "dtype");
    e[i].dtype = FSDP_IO_F32;
    if (!lua_isnil(L, -1)) e[i].dtype = check_st_dtype(L, -1, i + 1, e[i].name);
    lua_pop(L, 1);
    lua_getfield(L, -1, "shape");
    if (!lua_istable(L, -1))
      luaL_error(L, "st_writer: entries[%d] ('%s'): shape must be a table of sizes, got %s",
                 i + 1, e[i].name, luaL_typename(L, -1));
    e[i].ndim = fsdp_lua_check_shape(L, lua_gettop(L), e[i].shape);
    for (int d = 0; d < e[i].ndim; d++)
      if (e[i].shape[d] < 0)
        luaL_error(L, "st_writer: entries[%d] ('%s'): size %d is negative", i + 1, e[i].name,
                   d + 1);
    lua_pop(L, 2);
  }
  *out = e;
  *nout = n;
}

static void check_metadata(lua_State *L, int idx, fsdp_io_kv **out, int *nout) {
  *out = NULL;
  *nout = 0;
  if (lua_isnoneornil(L, idx)) return;
  luaL_checktype(L, idx, LUA_TTABLE);
  int n = 0;
  for (lua_pushnil(L); lua_next(L, idx); lua_pop(L, 1)) n++;
  fsdp_io_kv *kv = lua_newuserdata(L, sizeof *kv * (size_t)(n > 0 ? n : 1));
  int i = 0;
  for (lua_pushnil(L); lua_next(L, idx); lua_pop(L, 1)) {
    if (lua_type(L, -2) != LUA_TSTRING)
      luaL_error(L, "st_writer: metadata keys must be strings, got a %s", luaL_typename(L, -2));
    if (lua_type(L, -1) != LUA_TSTRING) /* no conversion: it would break lua_next */
      luaL_error(L, "st_writer: metadata value of '%s' must be a string, got %s",
                 lua_tostring(L, -2), luaL_typename(L, -1));
    size_t klen, vlen;
    kv[i].key = lua_tolstring(L, -2, &klen);
    kv[i].value = lua_tolstring(L, -1, &vlen);
    if (strlen(kv[i].key) != klen || strlen(kv[i].value) != vlen)
      luaL_error(L, "st_writer: metadata '%s' contains a zero byte", kv[i].key);
    i++;
  }
  qsort(kv, (size_t)n, sizeof *kv, cmp_kv); /* the same file for the same table */
  *out = kv;
  *nout = n;
}

static int l_st_writer(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  lua_settop(L, 3); /* scratch userdata go above the arguments */
  fsdp_io_st_entry *entries;
  fsdp_io_kv *meta;
  int n, nmeta;
  check_entries(L, 2, &entries, &n);
  check_metadata(L, 3, &meta, &nmeta);
  writer_box *b = lua_newuserdata(L, sizeof *b);
  b->w = NULL;
  luaL_getmetatable(L, WRITER_MT);
  lua_setmetatable(L, -2);
  if (fsdp_io_st_writer_open(&b->w, path, entries, n, meta, nmeta)) return fsdp_lua_error(L);
  return 1;
}

static writer_box *check_writer(lua_State *L, const char *fn) {
  writer_box *b = luaL_checkudata(L, 1, WRITER_MT);
  if (b->w == NULL) luaL_error(L, "%s: the writer is closed (committed or aborted)", fn);
  return b;
}

static int l_writer_write(lua_State *L) {
  writer_box *b = check_writer(L, "w:write");
  const char *name = luaL_checkstring(L, 2);
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 3);
  if (!t->storage->device->has_data)
    luaL_error(L, "w:write('%s'): tensor %s is on the %s device and has no data", name,
               FSDP_SHAPE_STR(t), t->storage->device->name);
  if (fsdp_io_st_write_tensor(b->w, name, t)) return fsdp_lua_error(L);
  return 0;
}

static int l_writer_commit(lua_State *L) {
  writer_box *b = check_writer(L, "w:commit");
  fsdp_io_st_writer *w = b->w;
  b->w = NULL; /* commit frees it whatever happens */
  if (fsdp_io_st_writer_commit(w)) return fsdp_lua_error(L);
  return 0;
}

static int l_writer_abort(lua_State *L) {
  writer_box *b = luaL_checkudata(L, 1, WRITER_MT);
  fsdp_io_st_writer_abort(b->w);
  b->w = NULL;
  return 0;
}

static int l_writer_tostring(lua_State *L) {
  writer_box *b = luaL_checkudata(L, 1, WRITER_MT);
  lua_pushfstring(L, "safetensors writer (%s)", b->w != NULL ? "open" : "closed");
  return 1;
}

/* ---- safetensors reader ---------------------------------------------------------------- */

static int l_st_open(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  reader_box *b = lua_newuserdata(L, sizeof *b);
  b->r = NULL;
  luaL_getmetatable(L, READER_MT);
  lua_setmetatable(L, -2);
  if (fsdp_io_st_reader_open(&b->r, path)) return fsdp_lua_error(L);
  return 1;
}

static fsdp_io_st_reader *check_reader(lua_State *L, const char *fn) {
  reader_box *b = luaL_checkudata(L, 1, READER_MT);
  if (b->r == NULL) luaL_error(L, "%s: the reader is closed", fn);
  return b->r;
}

static void push_hex(lua_State *L, uint64_t v) {
  char hex[17];
  snprintf(hex, sizeof hex, "%016llx", (unsigned long long)v);
  lua_pushstring(L, hex);
}

static int l_reader_entries(lua_State *L) {
  fsdp_io_st_reader *r = check_reader(L, "r:entries");
  int n = fsdp_io_st_reader_count(r);
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    const fsdp_io_st_entry *e = fsdp_io_st_reader_entry(r, i);
    lua_createtable(L, 0, 6);
    lua_pushstring(L, e->name);
    lua_setfield(L, -2, "name");
    lua_createtable(L, e->ndim, 0);
    for (int d = 0; d < e->ndim; d++) {
      lua_pushnumber(L, (lua_Number)e->shape[d]);
      lua_rawseti(L, -2, d + 1);
    }
    lua_setfield(L, -2, "shape");
    lua_pushstring(L, fsdp_io_dtype_name(e->dtype));
    lua_setfield(L, -2, "dtype");
    fsdp_dtype tdt;
    if (fsdp_io_dtype_to_tensor(e->dtype, &tdt)) {
      lua_pushstring(L, fsdp_dtype_name(tdt));
      lua_setfield(L, -2, "tensor_dtype");
    }
    lua_pushnumber(L, (lua_Number)e->begin);
    lua_setfield(L, -2, "offset");
    lua_pushnumber(L, (lua_Number)e->numel);
    lua_setfield(L, -2, "numel");
    if (e->has_checksum) {
      push_hex(L, e->checksum);
      lua_setfield(L, -2, "checksum");
    }
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int l_reader_metadata(lua_State *L) {
  fsdp_io_st_reader *r = check_reader(L, "r:metadata");
  int n = fsdp_io_st_reader_metadata_count(r);
  lua_createtable(L, 0, n);
  for (int i = 0; i < n; i++) {
    fsdp_io_kv kv = fsdp_io_st_reader_metadata_at(r, i);
    lua_pushstring(L, kv.value);
    lua_setfield(L, -2, kv.key);
  }
  return 1;
}

/* An integer argument in [0, 2^53], or a Lua error naming it. */
static int64_t check_count(lua_State *L, int idx, const char *what) {
  if (lua_type(L, idx) != LUA_TNUMBER)
    luaL_error(L, "r:read: %s must be a number, got %s", what, luaL_typename(L, idx));
  lua_Number v = lua_tonumber(L, idx);
  if (v != floor(v) || v < 0 || v > 9007199254740992.0)
    luaL_error(L, "r:read: %s must be an integer >= 0, got %f", what, (double)v);
  return (int64_t)v;
}

static int l_reader_read(lua_State *L) {
  fsdp_io_st_reader *r = check_reader(L, "r:read");
  const char *name = luaL_checkstring(L, 2);
  const fsdp_io_st_entry *e = fsdp_io_st_reader_find(r, name);
  if (e == NULL) return fsdp_lua_error(L);
  int64_t first = 0, count = e->numel;
  int ndim = e->ndim;
  int64_t shape[FSDP_MAX_DIMS];
  memcpy(shape, e->shape, sizeof shape);
  if (!lua_isnoneornil(L, 3)) {
    first = check_count(L, 3, "first");
    count = lua_isnoneornil(L, 4) ? (first <= e->numel ? e->numel - first : 0)
                                  : check_count(L, 4, "count");
    ndim = 1;
    shape[0] = count;
  }
  /* the range is checked before anything is allocated (an absurd count must not allocate) */
  if (first > e->numel || count > e->numel - first) {
    fsdp_error("%s: tensor '%s': %lld elements from element %lld are out of range (it has "
               "%lld)",
               fsdp_io_st_reader_path(r), name, (long long)count, (long long)first,
               (long long)e->numel);
    return fsdp_lua_error(L);
  }
  /* an out tensor (argument 5): read straight into it (checkpoint loading stages into buffers
   * of the right role, which the optimizer then adopts) */
  if (!lua_isnoneornil(L, 5)) {
    fsdp_tensor *o = fsdp_lua_check_tensor(L, 5);
    if (!fsdp_tensor_is_contiguous(o) || fsdp_tensor_numel(o) != count)
      return luaL_error(L, "r:read: out must be a contiguous tensor of %f elements (got %s)",
                        (double)count, FSDP_SHAPE_STR(o));
    fsdp_lua_check_write(L, o, "r:read", NULL);
    if (fsdp_io_st_read_tensor(r, name, first, count, o)) return fsdp_lua_error(L);
    lua_pushvalue(L, 5);
    return 1;
  }
  /* a new tensor: the stored dtype, on the cpu */
  fsdp_dtype dt;
  if (!fsdp_io_dtype_to_tensor(e->dtype, &dt)) {
    fsdp_error("%s: tensor '%s': stored dtype %s has no tensor dtype (F32, BF16, F16, F64, I64, "
               "I32, U8 and BOOL can be read)",
               fsdp_io_st_reader_path(r), name, fsdp_io_dtype_name(e->dtype));
    return fsdp_lua_error(L);
  }
  fsdp_tensor *t;
  if (fsdp_tensor_new_uninit(&t, &fsdp_device_cpu, dt, ndim, shape, FSDP_ROLE_ACTIVATIONS))
    return fsdp_lua_error(L);
  fsdp_lua_push_tensor(L, t); /* owned by Lua before anything can raise */
  if (fsdp_io_st_read_tensor(r, name, first, count, t)) return fsdp_lua_error(L);
  t->version = 0;
  return 1;
}

static int l_reader_verify(lua_State *L) {
  fsdp_io_st_reader *r = check_reader(L, "r:verify");
  if (!lua_isnoneornil(L, 2)) {
    if (fsdp_io_st_reader_verify(r, luaL_checkstring(L, 2))) return fsdp_lua_error(L);
    return 0;
  }
  for (int i = 0; i < fsdp_io_st_reader_count(r); i++)
    if (fsdp_io_st_reader_verify(r, fsdp_io_st_reader_entry(r, i)->name))
      return fsdp_lua_error(L);
  return 0;
}

static int l_reader_path(lua_State *L) {
  lua_pushstring(L, fsdp_io_st_reader_path(check_reader(L, "r:path")));
  return 1;
}

static int l_reader_close(lua_State *L) {
  reader_box *b = luaL_checkudata(L, 1, READER_MT);
  fsdp_io_st_reader_close(b->r);
  b->r = NULL;
  return 0;
}

static int l_reader_tostring(lua_State *L) {
  reader_box *b = luaL_checkudata(L, 1, READER_MT);
  if (b->r == NULL) lua_pushstring(L, "safetensors reader (closed)");
  else
    lua_pushfstring(L, "safetensors reader (%s, %d tensors)", fsdp_io_st_reader_path(b->r),
                    fsdp_io_st_reader_count(b->r));
  return 1;
}

/* ---- JSON ----------------------------------------------------------------------------- */

static int json_gc(lua_State *L) {
  json_box *b = luaL_checkudata(L, 1, JSON_MT);
  cJSON_Delete(b->doc);
  b->doc = NULL;
  return 0;
}

static json_box *json_box_push(lua_State *L) {
  json_box *b = lua_newuserdata(L, sizeof *b);
  b->doc = NULL;
  luaL_getmetatable(L, JSON_MT);
  lua_setmetatable(L, -2);
  return b;
}

/* The shortest of %.15g, %.16g, %.17g that reads back as exactly v; integers as integers. */
static void format_number(char *buf, size_t n, double v) {
  if (v == floor(v) && fabs(v) < 9007199254740992.0) {
    snprintf(buf, n, "%lld", (long long)v);
    return;
  }
  for (int prec = 15; prec <= 17; prec++) {
    snprintf(buf, n, "%.*g", prec, v);
    if (strtod(buf, NULL) == v) return;
  }
}

static int cmp_cstr(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* How a conversion runs: the function named in messages, what a NaN or an infinity becomes
 * (JSON has neither), and the stack index of a list of keys that objects put first (0: none). */
enum { NONFINITE_ERROR, NONFINITE_NULL, NONFINITE_STRING };
typedef struct {
  const char *fn;
  int nonfinite;
  int first;
} json_enc;

/* The value at idx as a new cJSON item, attached to parent under key (object) or appended
 * (array) before its own children are built, so that the whole partial tree is owned by the
 * document's box if a Lua error cuts the conversion short. `where` names the value in
 * messages ("$.a.b[2]"). */
static void to_json(lua_State *L, const json_enc *e, int idx, cJSON *parent, const char *key,
                    const char *where, int depth, cJSON **root);

static void attach(lua_State *L, const json_enc *e, cJSON *parent, const char *key, cJSON *item,
                   cJSON **root, const char *where) {
  if (item == NULL) luaL_error(L, "%s: out of memory at %s", e->fn, where);
  if (parent == NULL) *root = item;
  else if (key != NULL) cJSON_AddItemToObject(parent, key, item);
  else cJSON_AddItemToArray(parent, item);
}

/* Keys sorted, those of e->first moved to the front in its order: the same table always
 * gives the same text. Returns the count; the array lives in a userdata left on the stack. */
static int object_keys(lua_State *L, const json_enc *e, int idx, int count, const char *where,
                       const char ***out) {
  const char **keys = lua_newuserdata(L, sizeof *keys * (size_t)(count > 0 ? count : 1));
  int n = 0;
  for (lua_pushnil(L); lua_next(L, idx); lua_pop(L, 1)) {
    size_t len;
    keys[n] = lua_tolstring(L, -2, &len);
    if (strlen(keys[n]) != len || !fsdp_io_utf8_valid(keys[n], len))
      luaL_error(L, "%s: %s has a key that is not valid UTF-8 text", e->fn, where);
    n++;
  }
  qsort(keys, (size_t)n, sizeof *keys, cmp_cstr);
  int front = 0;
  for (int f = 1; e->first != 0; f++) {
    lua_rawgeti(L, e->first, f);
    const char *want = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
    lua_pop(L, 1); /* the list still holds the string */
    if (want == NULL) break;
    for (int i = front; i < n; i++) {
      if (strcmp(keys[i], want) != 0) continue;
      const char *k = keys[i];
      memmove(keys + front + 1, keys + front, sizeof *keys * (size_t)(i - front));
      keys[front++] = k;
      break;
    }
  }
  *out = keys;
  return n;
}

static void table_to_json(lua_State *L, const json_enc *e, int idx, cJSON *parent,
                          const char *key, const char *where, int depth, cJSON **root) {
  if (depth > JSON_MAX_DEPTH)
    luaL_error(L, "%s: %s is nested deeper than %d levels (a cycle?)", e->fn, where,
               JSON_MAX_DEPTH);
  luaL_checkstack(L, 8, "json: too deep");
  /* an array has exactly the keys 1..n (n >= 1); anything else needs string keys */
  int count = 0, strings = 0;
  double max = 0;
  for (lua_pushnil(L); lua_next(L, idx); lua_pop(L, 1)) {
    count++;
    if (lua_type(L, -2) == LUA_TSTRING) {
      strings++;
    } else if (lua_type(L, -2) == LUA_TNUMBER) {
      double k = lua_tonumber(L, -2);
      if (k >= 1 && k == floor(k) && k > max) max = k;
    } else {
      luaL_error(L, "%s: %s has a %s key; keys must be strings (or 1..n for an array)", e->fn,
                 where, luaL_typename(L, -2));
    }
  }
  bool is_array = count > 0 && strings == 0 && max == (double)count;
  if (!is_array && strings != count)
    luaL_error(L, "%s: %s mixes string keys and number keys, or is an array with holes; JSON "
                  "has no such value",
               e->fn, where);
  cJSON *item = is_array ? cJSON_CreateArray() : cJSON_CreateObject();
  attach(L, e, parent, key, item, root, where);
  char sub[256];
  if (is_array) {
    for (int i = 1; i <= count; i++) {
      lua_rawgeti(L, idx, i);
      snprintf(sub, sizeof sub, "%s[%d]", where, i);
      to_json(L, e, lua_gettop(L), item, NULL, sub, depth + 1, root);
      lua_pop(L, 1);
    }
    return;
  }
  const char **keys;
  int n = object_keys(L, e, idx, count, where, &keys);
  for (int i = 0; i < n; i++) {
    lua_pushstring(L, keys[i]);
    lua_rawget(L, idx);
    snprintf(sub, sizeof sub, "%s.%s", where, keys[i]);
    to_json(L, e, lua_gettop(L), item, keys[i], sub, depth + 1, root);
    lua_pop(L, 1);
  }
  lua_pop(L, 1); /* keys */
}

static cJSON *nonfinite_to_json(lua_State *L, const json_enc *e, double v, const char *where) {
  if (e->nonfinite == NONFINITE_NULL) return cJSON_CreateNull();
  if (e->nonfinite == NONFINITE_STRING)
    return cJSON_CreateString(v != v ? "NaN" : v > 0 ? "Infinity" : "-Infinity");
  luaL_error(L, "%s: %s is %f, which JSON cannot hold", e->fn, where, v);
  return NULL;
}

static void to_json(lua_State *L, const json_enc *e, int idx, cJSON *parent, const char *key,
                    const char *where, int depth, cJSON **root) {
  switch (lua_type(L, idx)) {
  case LUA_TBOOLEAN:
    attach(L, e, parent, key, cJSON_CreateBool(lua_toboolean(L, idx)), root, where);
    break;
  case LUA_TNUMBER: {
    double v = lua_tonumber(L, idx);
    if (!isfinite(v)) {
      attach(L, e, parent, key, nonfinite_to_json(L, e, v, where), root, where);
      break;
    }
    char buf[40];
    format_number(buf, sizeof buf, v);
    attach(L, e, parent, key, cJSON_CreateRaw(buf), root, where);
    break;
  }
  case LUA_TSTRING: {
    size_t len;
    const char *s = lua_tolstring(L, idx, &len);
    if (strlen(s) != len) luaL_error(L, "%s: %s contains a zero byte", e->fn, where);
    if (!fsdp_io_utf8_valid(s, len))
      luaL_error(L, "%s: %s is not valid UTF-8", e->fn, where);
    attach(L, e, parent, key, cJSON_CreateString(s), root, where);
    break;
  }
  case LUA_TTABLE: table_to_json(L, e, idx, parent, key, where, depth, root); break;
  default:
    luaL_error(L, "%s: %s is a %s, which JSON cannot hold", e->fn, where,
               luaL_typename(L, idx));
  }
}

/* The options table at idx (absent or nil: none): its keys must be among `valid`
 * (NULL-terminated), or an error lists them. */
static void check_json_opts(lua_State *L, int idx, const char *fn, const char *const *valid) {
  if (lua_isnoneornil(L, idx)) return;
  luaL_checktype(L, idx, LUA_TTABLE);
  for (lua_pushnil(L); lua_next(L, idx); lua_pop(L, 1)) {
    const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
    int i = 0;
    while (valid[i] != NULL && (k == NULL || strcmp(k, valid[i]) != 0)) i++;
    if (valid[i] != NULL) continue;
    luaL_Buffer buf;
    luaL_buffinit(L, &buf);
    for (i = 0; valid[i] != NULL; i++) {
      if (i > 0) luaL_addstring(&buf, ", ");
      luaL_addstring(&buf, valid[i]);
    }
    luaL_pushresult(&buf);
    luaL_error(L, "%s: unknown option '%s' (valid: %s)", fn, k ? k : luaL_typename(L, -3),
               lua_tostring(L, -1));
  }
}

/* Encoding options at idx: {nonfinite = "error" | "null" | "string", first = {key, ...}}. */
static json_enc json_enc_opts(lua_State *L, int idx, const char *fn) {
  static const char *const valid[] = {"nonfinite", "first", NULL};
  static const char *const modes[] = {"error", "null", "string", NULL};
  json_enc e = {.fn = fn};
  check_json_opts(L, idx, fn, valid);
  if (lua_isnoneornil(L, idx)) return e;
  lua_getfield(L, idx, "nonfinite");
  if (!lua_isnil(L, -1)) {
    const char *m = lua_tostring(L, -1);
    while (m != NULL && modes[e.nonfinite] != NULL && strcmp(m, modes[e.nonfinite]) != 0)
      e.nonfinite++;
    if (m == NULL || modes[e.nonfinite] == NULL)
      luaL_error(L, "%s: nonfinite must be \"error\", \"null\" or \"string\", got %s", fn,
                 m ? m : luaL_typename(L, -1));
  }
  lua_pop(L, 1);
  lua_getfield(L, idx, "first");
  if (lua_istable(L, -1)) e.first = lua_gettop(L); /* stays on the stack for the conversion */
  else if (!lua_isnil(L, -1)) luaL_error(L, "%s: first must be a list of keys", fn);
  else lua_pop(L, 1);
  return e;
}

static int l_json_write(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  luaL_checkany(L, 2);
  json_enc e = json_enc_opts(L, 3, "json_write");
  json_box *b = json_box_push(L);
  to_json(L, &e, 2, NULL, NULL, "$", 0, &b->doc);
  int rc = fsdp_io_json_write_atomic(path, b->doc);
  cJSON_Delete(b->doc);
  b->doc = NULL;
  if (rc) return fsdp_lua_error(L);
  return 0;
}

/* How decoding runs: the strings "NaN", "Infinity", "-Infinity" as numbers, and the stack
 * index of the value null becomes (0: nil). */
typedef struct {
  bool nonfinite;
  int null;
} json_dec;

static void from_json(lua_State *L, const json_dec *d, const cJSON *j) {
  luaL_checkstack(L, 4, "json_read: too deep");
  if (cJSON_IsObject(j)) {
    lua_createtable(L, 0, cJSON_GetArraySize(j));
    for (const cJSON *c = j->child; c != NULL; c = c->next) {
      from_json(L, d, c);
      lua_setfield(L, -2, c->string);
    }
  } else if (cJSON_IsArray(j)) {
    lua_createtable(L, cJSON_GetArraySize(j), 0);
    int i = 1;
    for (const cJSON *c = j->child; c != NULL; c = c->next, i++) {
      from_json(L, d, c);
      lua_rawseti(L, -2, i);
    }
  } else if (cJSON_IsString(j)) {
    const char *s = j->valuestring;
    if (d->nonfinite && strcmp(s, "NaN") == 0) lua_pushnumber(L, NAN);
    else if (d->nonfinite && strcmp(s, "Infinity") == 0) lua_pushnumber(L, INFINITY);
    else if (d->nonfinite && strcmp(s, "-Infinity") == 0) lua_pushnumber(L, -INFINITY);
    else lua_pushstring(L, s);
  } else if (cJSON_IsNumber(j)) {
    lua_pushnumber(L, j->valuedouble);
  } else if (cJSON_IsBool(j)) {
    lua_pushboolean(L, cJSON_IsTrue(j));
  } else if (d->null != 0) {
    lua_pushvalue(L, d->null);
  } else {
    lua_pushnil(L); /* null */
  }
}

/* Push the document in b as a Lua value and free it. */
static void push_doc(lua_State *L, const json_dec *d, json_box *b) {
  from_json(L, d, b->doc);
  cJSON_Delete(b->doc);
  b->doc = NULL;
}

static int l_json_read(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  json_box *b = json_box_push(L);
  if (fsdp_io_json_read(path, &b->doc)) return fsdp_lua_error(L);
  push_doc(L, &(json_dec){0}, b);
  return 1;
}

/* ---- checkpoint support ------------------------------------------------------ */

static int l_json_encode(lua_State *L) {
  luaL_checkany(L, 1);
  json_enc e = json_enc_opts(L, 2, "json_encode");
  json_box *b = json_box_push(L);
  to_json(L, &e, 1, NULL, NULL, "$", 0, &b->doc);
  char *text = cJSON_PrintUnformatted(b->doc);
  cJSON_Delete(b->doc);
  b->doc = NULL;
  if (text == NULL) return luaL_error(L, "json_encode: out of memory");
  lua_pushstring(L, text);
  cJSON_free(text);
  return 1;
}

/* json_decode(text [, name [, opts]]): opts = {nonfinite = true, null = value, raise = false};
 * with raise = false a syntax error returns nil, the message, its line and column. */
static int l_json_decode(lua_State *L) {
  static const char *const valid[] = {"nonfinite", "null", "raise", NULL};
  size_t n;
  const char *text = luaL_checklstring(L, 1, &n);
  const char *name = luaL_optstring(L, 2, "(json text)");
  check_json_opts(L, 3, "json_decode", valid);
  json_dec d = {0};
  bool raise = true;
  if (lua_istable(L, 3)) {
    lua_getfield(L, 3, "nonfinite");
    d.nonfinite = lua_toboolean(L, -1);
    lua_getfield(L, 3, "raise");
    raise = lua_isnil(L, -1) || lua_toboolean(L, -1);
    lua_getfield(L, 3, "null");
    if (!lua_isnil(L, -1)) d.null = lua_gettop(L);
  }
  json_box *b = json_box_push(L);
  size_t line, col;
  if (fsdp_io_json_parse_ex(&b->doc, name, text, n, d.nonfinite ? FSDP_IO_JSON_NONFINITE : 0,
                            &line, &col)) {
    if (raise) return fsdp_lua_error(L);
    lua_pushnil(L);
    lua_pushstring(L, fsdp_error_msg());
    lua_pushnumber(L, (lua_Number)line);
    lua_pushnumber(L, (lua_Number)col);
    return 4;
  }
  push_doc(L, &d, b);
  return 1;
}

static int l_ckpt_index_read(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  json_box *b = json_box_push(L);
  if (fsdp_io_index_read(path, &b->doc)) return fsdp_lua_error(L);
  push_doc(L, &(json_dec){0}, b);
  return 1;
}

/* ckpt_index_write(path, index): checked and written atomically (fsdp_io_index_write) */
static int l_ckpt_index_write(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  json_enc e = {.fn = "ckpt_index_write"};
  json_box *b = json_box_push(L); /* frees the tree when to_json raises */
  to_json(L, &e, 2, NULL, NULL, "$", 0, &b->doc);
  int rc = fsdp_io_index_write(path, b->doc);
  cJSON_Delete(b->doc);
  b->doc = NULL;
  if (rc) return fsdp_lua_error(L);
  return 0;
}

static int l_io_mkdirs(lua_State *L) {
  if (fsdp_io_mkdirs(luaL_checkstring(L, 1))) return fsdp_lua_error(L);
  return 0;
}

static int cmp_name(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static int l_io_listdir(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  char **names;
  int n;
  if (fsdp_io_listdir(path, &names, &n)) return fsdp_lua_error(L);
  qsort(names, (size_t)n, sizeof *names, cmp_name);
  /* copy into Lua first: lua_createtable may raise (out of memory) and must not leak */
  if (!lua_checkstack(L, 2)) {
    fsdp_io_listdir_free(names, n);
    return luaL_error(L, "io_listdir: out of Lua stack");
  }
  lua_newtable(L);
  for (int i = 0; i < n; i++) {
    lua_pushstring(L, names[i]);
    lua_rawseti(L, -2, i + 1);
  }
  fsdp_io_listdir_free(names, n);
  return 1;
}

static int l_io_remove(lua_State *L) {
  if (fsdp_io_remove(luaL_checkstring(L, 1))) return fsdp_lua_error(L);
  return 0;
}

static int l_io_fsync_dir(lua_State *L) {
  if (fsdp_io_fsync_dir(luaL_checkstring(L, 1))) return fsdp_lua_error(L);
  return 0;
}

static int l_io_size(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  struct stat st;
  if (stat(path, &st) != 0) {
    lua_pushnil(L);
    lua_pushfstring(L, "%s: cannot stat: %s", path, strerror(errno));
    return 2;
  }
  if (!S_ISREG(st.st_mode)) {
    lua_pushnil(L);
    lua_pushfstring(L, "%s: not a regular file", path);
    return 2;
  }
  lua_pushnumber(L, (lua_Number)st.st_size);
  return 1;
}

/* The anonymous random streams of the engine (fsdp_rng_reserve's callers: l_tensor.c randn
 * and rand, ops.c dropout). The names stored by fsdp_rng_reserve must outlive the thread, so
 * only these literals are ever passed to it from here. */
static const char *const rng_streams[] = {"randn", "rand", "dropout"};
#define N_RNG_STREAMS (sizeof rng_streams / sizeof rng_streams[0])

static int l_rng_state(lua_State *L) {
  lua_createtable(L, 0, 2);
  push_hex(L, fsdp_rng_seed());
  lua_setfield(L, -2, "seed");
  lua_createtable(L, 0, N_RNG_STREAMS);
  for (size_t i = 0; i < N_RNG_STREAMS; i++) {
    uint64_t next;
    fsdp_rng_reserve(rng_streams[i], 0, &next); /* 0 elements: reads the offset */
    push_hex(L, next);
    lua_setfield(L, -2, rng_streams[i]);
  }
  lua_setfield(L, -2, "streams");
  return 1;
}

static uint64_t check_hex(lua_State *L, int idx, const char *what) {
  const char *s = lua_type(L, idx) == LUA_TSTRING ? lua_tostring(L, idx) : NULL;
  bool ok = s != NULL && strlen(s) == 16;
  for (int i = 0; ok && i < 16; i++)
    ok = (s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f');
  if (!ok) luaL_error(L, "set_rng_state: %s must be 16 lowercase hex digits", what);
  return (uint64_t)strtoull(s, NULL, 16);
}

/* Reads and checks the state at index 1 (raising as set_rng_state) into *seed and next[]. */
static void read_rng_state(lua_State *L, uint64_t *seed_out, uint64_t *next) {
  luaL_checktype(L, 1, LUA_TTABLE);
  lua_getfield(L, 1, "seed");
  uint64_t seed = check_hex(L, -1, "seed");
  lua_pop(L, 1);
  for (size_t i = 0; i < N_RNG_STREAMS; i++) next[i] = 0;
  lua_getfield(L, 1, "streams");
  if (!lua_isnil(L, -1)) {
    luaL_checktype(L, -1, LUA_TTABLE);
    for (lua_pushnil(L); lua_next(L, -2); lua_pop(L, 1)) {
      const char *name = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "?";
      size_t i = 0;
      while (i < N_RNG_STREAMS && strcmp(name, rng_streams[i]) != 0) i++;
      if (i == N_RNG_STREAMS)
        luaL_error(L, "set_rng_state: unknown random stream '%s' (randn, rand, dropout)", name);
      next[i] = check_hex(L, -1, name);
      if (next[i] % 4 != 0 || next[i] > ((uint64_t)1 << 62)) {
        char num[24]; /* luaL_error knows no %llu */
        snprintf(num, sizeof num, "%llu", (unsigned long long)next[i]);
        luaL_error(L, "set_rng_state: stream '%s' offset %s is not a multiple of 4 (below 2^62)",
                   name, num);
      }
    }
  }
  lua_pop(L, 1);
  *seed_out = seed;
}

static int l_check_rng_state(lua_State *L) {
  uint64_t seed, next[N_RNG_STREAMS];
  read_rng_state(L, &seed, next);
  return 0;
}

static int l_set_rng_state(lua_State *L) {
  uint64_t seed, next[N_RNG_STREAMS];
  read_rng_state(L, &seed, next);
  /* everything checked: reset to the seed (every stream at 0), then advance each stream */
  fsdp_rng_manual_seed(seed);
  for (size_t i = 0; i < N_RNG_STREAMS; i++) {
    uint64_t first;
    if (next[i] > 0) fsdp_rng_reserve(rng_streams[i], (int64_t)next[i], &first);
  }
  return 0;
}

/* ---- fault injection ------------------------------------------------------------------- */

static int l_io_fault(lua_State *L) {
  const char *point = luaL_checkstring(L, 1);
  int p = fsdp_io_fault_point_from_name(point);
  if (p < 0)
    return luaL_error(L, "io_fault: unknown point '%s' (open, write, fsync, rename or none)",
                      point);
  int err = 0;
  if (lua_type(L, 2) == LUA_TNUMBER) {
    err = (int)lua_tointeger(L, 2);
  } else if (p != FSDP_IO_FAULT_NONE) {
    static const struct {
      const char *name;
      int err;
    } names[] = {{"ENOSPC", ENOSPC}, {"EACCES", EACCES}, {"EIO", EIO},     {"EDQUOT", EDQUOT},
                 {"EROFS", EROFS},   {"EXDEV", EXDEV},   {"EPERM", EPERM}, {"ENOENT", ENOENT}};
    const char *name = luaL_checkstring(L, 2);
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
      if (strcmp(name, names[i].name) == 0) err = names[i].err;
    if (err == 0)
      return luaL_error(L, "io_fault: unknown errno name '%s' (ENOSPC, EACCES, EIO, EDQUOT, "
                           "EROFS, EXDEV, EPERM, ENOENT, or a number)",
                        name);
  }
  lua_Number after = luaL_optnumber(L, 3, 0);
  if (after < 0) return luaL_error(L, "io_fault: after_bytes must be >= 0");
  fsdp_io_fault_set((fsdp_io_fault_point)p, err, (uint64_t)after);
  return 0;
}

/* ---- registration ---------------------------------------------------------------------- */

static const luaL_Reg writer_methods[] = {
    {"write", l_writer_write}, {"commit", l_writer_commit}, {"abort", l_writer_abort},
    {NULL, NULL}};
static const luaL_Reg reader_methods[] = {
    {"entries", l_reader_entries}, {"metadata", l_reader_metadata}, {"read", l_reader_read},
    {"verify", l_reader_verify},   {"path", l_reader_path},         {"close", l_reader_close},
    {NULL, NULL}};
static const luaL_Reg io_funcs[] = {
    {"st_writer", l_st_writer}, {"st_open", l_st_open},   {"json_write", l_json_write},
    {"json_read", l_json_read}, {"io_fault", l_io_fault},
    /* checkpoint support */
    {"json_encode", l_json_encode}, {"json_decode", l_json_decode},
    {"ckpt_index_read", l_ckpt_index_read}, {"ckpt_index_write", l_ckpt_index_write},
    {"io_mkdirs", l_io_mkdirs}, {"io_listdir", l_io_listdir}, {"io_remove", l_io_remove},
    {"io_fsync_dir", l_io_fsync_dir}, {"io_size", l_io_size}, {"rng_state", l_rng_state},
    {"set_rng_state", l_set_rng_state}, {"check_rng_state", l_check_rng_state}, {NULL, NULL}};

static void new_class(lua_State *L, const char *mt, const luaL_Reg *methods, lua_CFunction gc,
                      lua_CFunction tostring) {
  luaL_newmetatable(L, mt);
  lua_newtable(L);
  luaL_register(L, NULL, methods);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, gc);
  lua_setfield(L, -2, "__gc");
  lua_pushcfunction(L, tostring);
  lua_setfield(L, -2, "__tostring");
  lua_pop(L, 1);
}

void fsdp_lua_open_io(lua_State *L) {
  new_class(L, WRITER_MT, writer_methods, l_writer_abort, l_writer_tostring);
  new_class(L, READER_MT, reader_methods, l_reader_close, l_reader_tostring);
  luaL_newmetatable(L, JSON_MT);
  lua_pushcfunction(L, json_gc);
  lua_setfield(L, -2, "__gc");
  lua_pop(L, 1);
  luaL_register(L, NULL, io_funcs);
}
