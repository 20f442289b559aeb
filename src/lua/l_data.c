/*
 * l_data.c — the C helpers of the data loaders and of fsdp.log (lua/fsdp/data.lua, log.lua):
 * the byte-crunching parts that would be slow in Lua, and the few system calls Lua lacks.
 * Registered into `fsdp.core` by fsdp_lua_open_data (called from module.c):
 *
 *   gunzip(path [, max_bytes]) -> string      whole file (or its first max_bytes), gzip or plain
 *   from_bytes(str, offset, shape, scale [, dtype = "f32"])
 *                                             -> tensor: bytes [offset, offset+numel) * scale,
 *                                                converted to dtype (labels: "i64")
 *   index_rows(t, idx)                        -> new tensor of t's rows idx[1..B] (1-based), on
 *                                                t's device, in its dtype
 *   byte_windows(str, starts, T)              -> x (B, T), y (B, T), i64: x[b] = bytes
 *                                                [s_b, s_b+T), y[b] = bytes [s_b+1, s_b+T+1)
 *                                                (starts 0-based)
 *   isatty(fd) -> boolean
 *   list_dir(path) -> { {name =, kind =}, ... } (unsorted; kind as file_kind)
 *   file_kind(path [, follow]) -> "file" | "dir" | "link" | "other", or nil, message (lstat:
 *                      links not followed; with follow, stat: what a link points to)
 *
 * (fsdp.log also uses core.clock, the monotonic clock that l_bench.c registers.)
 * Every argument is checked before anything is allocated. Resources that must outlive a call
 * that can raise (a gzFile, a DIR, a growing buffer) live in a `closer` userdata whose __gc
 * frees them, so a Lua error (including out of memory) never leaks them (binding.h's rule).
 */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "kernels/kernels.h"
#include "lua/binding.h"

#define CLOSER_MT "fsdp.data.closer"

/* ---- resources owned by a userdata --------------------------------------------------- */

typedef struct closer {
  gzFile gz;
  DIR *dir;
  char *buf;
  size_t n, cap;
} closer;

static void closer_free(closer *c) {
  if (c->gz != NULL) gzclose(c->gz);
  if (c->dir != NULL) closedir(c->dir);
  free(c->buf);
  memset(c, 0, sizeof *c);
}

static int closer_gc(lua_State *L) {
  closer_free(luaL_checkudata(L, 1, CLOSER_MT));
  return 0;
}

static closer *closer_push(lua_State *L) {
  closer *c = lua_newuserdata(L, sizeof *c);
  memset(c, 0, sizeof *c);
  luaL_getmetatable(L, CLOSER_MT);
  lua_setmetatable(L, -2);
  return c;
}

/* ---- argument helpers ---------------------------------------------------------------- */

/* An integral number at idx, or a Lua error naming `what`. */
static int64_t check_int(lua_State *L, int idx, const char *fn, const char *what) {
  if (lua_type(L, idx) != LUA_TNUMBER)
    luaL_error(L, "%s: %s must be a number, got %s", fn, what, luaL_typename(L, idx));
  lua_Number v = lua_tonumber(L, idx);
  if (v != floor(v) || fabs(v) > 9007199254740992.0)
    luaL_error(L, "%s: %s must be an integer, got %f", fn, what, (double)v);
  return (int64_t)v;
}

/* Element i (1-based) of the array at idx as an integer in [lo, hi], or a Lua error. */
static int64_t check_array_int(lua_State *L, int idx, int i, int64_t lo, int64_t hi,
                               const char *fn, const char *what) {
  lua_rawgeti(L, idx, i);
  if (lua_type(L, -1) != LUA_TNUMBER)
    luaL_error(L, "%s: %s[%d] must be a number, got %s", fn, what, i, luaL_typename(L, -1));
  lua_Number v = lua_tonumber(L, -1);
  lua_pop(L, 1);
  if (v != floor(v) || v < (lua_Number)lo || v > (lua_Number)hi)
    luaL_error(L, "%s: %s[%d] = %f is out of range [%f, %f]", fn, what, i, (double)v,
               (double)lo, (double)hi);
  return (int64_t)v;
}

/* ---- gunzip --------------------------------------------------------------------------- */

static int l_gunzip(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int64_t max = -1; /* -1: the whole file */
  if (!lua_isnoneornil(L, 2)) {
    max = check_int(L, 2, "gunzip", "max_bytes");
    if (max < 0) luaL_error(L, "gunzip: max_bytes must be >= 0");
  }
  closer *c = closer_push(L);
  errno = 0;
  c->gz = gzopen(path, "rb");
  if (c->gz == NULL)
    return luaL_error(L, "gunzip: cannot open %s: %s", path,
                      errno != 0 ? strerror(errno) : "out of memory");
  gzbuffer(c->gz, 1u << 17);
  for (;;) {
    if (max >= 0 && c->n == (size_t)max) break;
    if (c->n == c->cap) {
      size_t cap = c->cap != 0 ? c->cap * 2 : (size_t)1 << 20;
      if (max >= 0 && cap > (size_t)max) cap = (size_t)max;
      char *buf = realloc(c->buf, cap);
      if (buf == NULL)
        return luaL_error(L, "gunzip: %s: out of memory after %zu bytes", path, c->n);
      c->buf = buf;
      c->cap = cap;
    }
    size_t want = c->cap - c->n;
    if (want > (size_t)1 << 30) want = (size_t)1 << 30;
    int got = gzread(c->gz, c->buf + c->n, (unsigned)want);
    if (got < 0) {
      int errnum;
      const char *msg = gzerror(c->gz, &errnum);
      return luaL_error(L, "gunzip: %s: %s", path, errnum == Z_ERRNO ? strerror(errno) : msg);
    }
    if (got == 0) break;
    c->n += (size_t)got;
  }
  /* A stream cut short reads as a short file with gzread; gzclose says so. Reading only a
   * prefix (max_bytes) leaves the stream unfinished by design. */
  bool whole = max < 0 || c->n < (size_t)max;
  int rc = gzclose(c->gz);
  c->gz = NULL;
  if (whole && rc != Z_OK)
    return luaL_error(L, "gunzip: %s: %s", path,
                      rc == Z_BUF_ERROR ? "unexpected end of file (truncated?)"
                                        : "error closing the stream");
  lua_pushlstring(L, c->buf != NULL ? c->buf : "", c->n);
  closer_free(c);
  return 1;
}

/* ---- tensors from bytes --------------------------------------------------------------- */

static int l_from_bytes(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  int64_t off = check_int(L, 2, "from_bytes", "byte offset");
  int64_t shape[FSDP_MAX_DIMS];
  luaL_checktype(L, 3, LUA_TTABLE);
  int nd = fsdp_lua_check_shape(L, 3, shape);
  float scale = (float)luaL_optnumber(L, 4, 1.0);
  fsdp_dtype dt = lua_isnoneornil(L, 5) ? FSDP_DTYPE_F32 : fsdp_lua_check_dtype(L, 5);
  int64_t numel = 1;
  for (int i = 0; i < nd; i++) {
    if (shape[i] < 0) luaL_error(L, "from_bytes: shape entry %d is %d", i + 1, (int)shape[i]);
    if (shape[i] != 0 && numel > INT64_MAX / shape[i])
      luaL_error(L, "from_bytes: shape is too large");
    numel *= shape[i];
  }
  if (off < 0 || off > (int64_t)len || numel > (int64_t)len - off)
    luaL_error(L, "from_bytes: %f bytes at offset %f do not fit in a string of %f bytes",
               (double)numel, (double)off, (double)len);
  fsdp_tensor *t;
  if (fsdp_tensor_new(&t, &fsdp_device_cpu, dt, nd, shape, FSDP_ROLE_OTHER) != FSDP_OK)
    return fsdp_lua_error(L);
  void *d = fsdp_tensor_data(t, "from_bytes"); // (numel)
  /* the 256 possible values, each byte * scale in f32 (as the f32 tensor holds them) converted
   * once to dt by the one conversion rule; then one table lookup per byte */
  _Alignas(8) char lut[256 * 8];
  const size_t es = fsdp_dtype_size(dt);
  for (int i = 0; i < 256; i++) fsdp_dtype_store(lut, dt, i, (double)((float)i * scale));
  const unsigned char *src = (const unsigned char *)s + off;
  for (int64_t i = 0; i < numel; i++) memcpy((char *)d + (size_t)i * es, lut + src[i] * es, es);
  fsdp_lua_push_tensor(L, t);
  return 1;
}

static int l_index_rows(lua_State *L) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  if (t->ndim < 1) luaL_error(L, "index_rows: a 0-dim tensor has no rows");
  if (fsdp_tensor_data(t, "index_rows") == NULL) return fsdp_lua_error(L);
  int64_t rows = t->shape[0];
  int B = (int)lua_objlen(L, 2);
  for (int i = 1; i <= B; i++) check_array_int(L, 2, i, 1, rows, "index_rows", "idx");
  int64_t shape[FSDP_MAX_DIMS];
  memcpy(shape, t->shape, sizeof shape);
  shape[0] = B;
  int64_t row = rows > 0 ? fsdp_tensor_numel(t) / rows : 0;
  /* rows move as bytes within t's device (its copy slot), in t's dtype: the loaders' tensors
   * may live on any device */
  fsdp_tensor *src, *out;
  if (fsdp_to(&src, t, t->storage->device, t->dtype, -1) != FSDP_OK) return fsdp_lua_error(L);
  if (fsdp_tensor_new_uninit(&out, t->storage->device, t->dtype, t->ndim, shape,
                             FSDP_ROLE_ACTIVATIONS) != FSDP_OK) {
    fsdp_tensor_release(src);
    return fsdp_lua_error(L);
  }
  const fsdp_device_i *dev = t->storage->device;
  const size_t rb = (size_t)row * fsdp_dtype_size(t->dtype);
  const char *sd = fsdp_tensor_data(src, "index_rows"); // (rows, row)
  char *od = fsdp_tensor_data(out, "index_rows");       // (B, row)
  int rc = FSDP_OK;
  for (int i = 0; i < B && rc == FSDP_OK; i++) {
    lua_rawgeti(L, 2, i + 1);
    int64_t r = (int64_t)lua_tonumber(L, -1) - 1;
    lua_pop(L, 1);
    rc = dev->copy(dev->ctx, od + (size_t)i * rb, sd + (size_t)r * rb, rb);
  }
  fsdp_tensor_release(src);
  if (rc != FSDP_OK) {
    fsdp_tensor_release(out);
    return fsdp_lua_error(L);
  }
  fsdp_lua_push_tensor(L, out);
  return 1;
}

static int l_byte_windows(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  luaL_checktype(L, 2, LUA_TTABLE);
  int64_t T = check_int(L, 3, "byte_windows", "window length");
  if (T < 1) luaL_error(L, "byte_windows: window length must be >= 1, got %d", (int)T);
  if ((int64_t)len < T + 1)
    luaL_error(L, "byte_windows: a window of %f bytes and its shifted target need %f bytes; "
               "the text has %f", (double)T, (double)(T + 1), (double)len);
  int B = (int)lua_objlen(L, 2);
  int64_t last = (int64_t)len - T - 1; /* the last start with room for the target */
  for (int i = 1; i <= B; i++) check_array_int(L, 2, i, 0, last, "byte_windows", "starts");
  /* ids are i64: a floating id would be cast to bf16 by a mixed-precision model's input cast */
  int64_t shape[2] = {B, T};
  fsdp_tensor *x, *y;
  if (fsdp_tensor_new_uninit(&x, &fsdp_device_cpu, FSDP_DTYPE_I64, 2, shape,
                             FSDP_ROLE_ACTIVATIONS) != FSDP_OK)
    return fsdp_lua_error(L);
  if (fsdp_tensor_new_uninit(&y, &fsdp_device_cpu, FSDP_DTYPE_I64, 2, shape,
                             FSDP_ROLE_ACTIVATIONS) != FSDP_OK) {
    fsdp_tensor_release(x);
    return fsdp_lua_error(L);
  }
  int64_t *xd = fsdp_tensor_data(x, "byte_windows"); // (B, T)
  int64_t *yd = fsdp_tensor_data(y, "byte_windows"); // (B, T)
  const unsigned char *u = (const unsigned char *)s;
  for (int b = 0; b < B; b++) {
    lua_rawgeti(L, 2, b + 1);
    int64_t start = (int64_t)lua_tonumber(L, -1);
    lua_pop(L, 1);
    for (int64_t t = 0; t < T; t++) {
      xd[b * T + t] = u[start + t];
      yd[b * T + t] = u[start + t + 1];
    }
  }
  fsdp_lua_push_tensor(L, x);
  fsdp_lua_push_tensor(L, y);
  return 2;
}

/* ---- system helpers ------------------------------------------------------------------- */

static int l_isatty(lua_State *L) {
  int fd = (int)check_int(L, 1, "isatty", "fd");
  lua_pushboolean(L, isatty(fd));
  return 1;
}

static const char *kind_of(mode_t m) {
  if (S_ISREG(m)) return "file";
  if (S_ISDIR(m)) return "dir";
  if (S_ISLNK(m)) return "link";
  return "other";
}

static int l_file_kind(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  bool follow = lua_toboolean(L, 2); /* a link's target (stat), not the link (lstat) */
  struct stat st;
  if ((follow ? stat(path, &st) : lstat(path, &st)) != 0) {
    lua_pushnil(L);
    lua_pushfstring(L, "%s: %s", path, strerror(errno));
    return 2;
  }
  lua_pushstring(L, kind_of(st.st_mode));
  return 1;
}

static int l_list_dir(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  closer *c = closer_push(L);
  c->dir = opendir(path);
  if (c->dir == NULL) return luaL_error(L, "list_dir: cannot open %s: %s", path, strerror(errno));
  lua_newtable(L);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(c->dir)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    lua_pushfstring(L, "%s/%s", path, e->d_name);
    struct stat st;
    const char *kind = lstat(lua_tostring(L, -1), &st) == 0 ? kind_of(st.st_mode) : "other";
    lua_pop(L, 1);
    lua_createtable(L, 0, 2);
    lua_pushstring(L, e->d_name);
    lua_setfield(L, -2, "name");
    lua_pushstring(L, kind);
    lua_setfield(L, -2, "kind");
    lua_rawseti(L, -2, ++n);
  }
  closer_free(c);
  return 1;
}

static const luaL_Reg data_funcs[] = {
    {"gunzip", l_gunzip},
    {"from_bytes", l_from_bytes},
    {"index_rows", l_index_rows},
    {"byte_windows", l_byte_windows},
    {"isatty", l_isatty},
    {"file_kind", l_file_kind},
    {"list_dir", l_list_dir},
    {NULL, NULL},
};

void fsdp_lua_open_data(lua_State *L) {
  if (luaL_newmetatable(L, CLOSER_MT)) {
    lua_pushcfunction(L, closer_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_pop(L, 1);
  luaL_register(L, NULL, data_funcs);
}
