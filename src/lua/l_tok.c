/*
 * l_tok.c — tokenizers (src/tok/tok.h) and memory-mapped token files (src/io/tokens.h) for
 * lua/fsdp/tokenizer.lua and lua/fsdp/data.lua. Registered into `fsdp.core` by
 * fsdp_lua_open_tok (module.c):
 *
 *   tok_available() -> boolean            false in a build without SentencePiece
 *   tok_train{inputs = {paths}, vocab_size =, model =, model_type = "bpe" | "unigram",
 *             threads =, character_coverage =, max_sentences =}
 *   tok_load(path) -> tokenizer           userdata, methods:
 *     t:encode(str) -> {ids}              ids from 0, a Lua array
 *     t:encode_packed(str, elem_size) -> string   the ids as little-endian uint16 (2) or
 *                                         uint32 (4), and their count
 *     t:decode({ids}) -> string           t:vocab_size()  t:piece(id)  t:special_id(name)
 *     t:free()                            idempotent; a freed tokenizer raises on use
 *   tokens_open(path, elem_size, count [, vocab]) -> token file   userdata, methods:
 *     f:windows(starts, T [, target = true]) -> x (B, T) [, y (B, T)], i64 tensors
 *     f:count()  f:path()  f:close()      close is idempotent
 *
 * Resource rule (binding.h): C objects live in userdata created before the call that fills
 * them; buffers the C side mallocs are held by a scratch userdata until copied into Lua.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "io/tokens.h"
#include "lua/binding.h"
#include "tok/tok.h"

#define TOK_MT "fsdp.Tokenizer"
#define TOKFILE_MT "fsdp.TokenFile"
#define SCRATCH_MT "fsdp.tok.scratch"

/* ---- scratch: a malloc'd buffer owned by a userdata --------------------------------------- */

static int scratch_gc(lua_State *L) {
  void **p = luaL_checkudata(L, 1, SCRATCH_MT);
  free(*p);
  *p = NULL;
  return 0;
}

static void **scratch_push(lua_State *L) {
  void **p = lua_newuserdata(L, sizeof *p);
  *p = NULL;
  luaL_getmetatable(L, SCRATCH_MT);
  lua_setmetatable(L, -2);
  return p;
}

/* ---- argument helpers --------------------------------------------------------------------- */

static int64_t check_int(lua_State *L, int idx, const char *fn, const char *what, int64_t lo,
                         int64_t hi) {
  if (lua_type(L, idx) != LUA_TNUMBER)
    luaL_error(L, "%s: %s must be an integer, got %s", fn, what, luaL_typename(L, idx));
  lua_Number v = lua_tonumber(L, idx);
  if (v != floor(v) || v < (lua_Number)lo || v > (lua_Number)hi)
    luaL_error(L, "%s: %s must be an integer in [%f, %f], got %f", fn, what, (double)lo,
               (double)hi, (double)v);
  return (int64_t)v;
}

/* Field `name` of the table at idx as an integer (def when absent). */
static int64_t opt_field_int(lua_State *L, int idx, const char *name, int64_t def, int64_t lo,
                             int64_t hi) {
  lua_getfield(L, idx, name);
  int64_t v = def;
  if (!lua_isnil(L, -1)) v = check_int(L, lua_gettop(L), "tok_train", name, lo, hi);
  lua_pop(L, 1);
  return v;
}

/* ---- training ----------------------------------------------------------------------------- */

static int l_tok_available(lua_State *L) {
  lua_pushboolean(L, fsdp_tok_available());
  return 1;
}

static int l_tok_train(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  lua_getfield(L, 1, "inputs");
  if (!lua_istable(L, -1)) luaL_error(L, "tok_train: inputs must be an array of paths");
  int n = (int)lua_objlen(L, -1);
  if (n < 1) luaL_error(L, "tok_train: inputs is empty");
  /* the path array lives in a userdata; the strings stay referenced by the inputs table */
  const char **paths = lua_newuserdata(L, (size_t)n * sizeof *paths);
  for (int i = 1; i <= n; i++) {
    lua_rawgeti(L, -2, i);
    if (lua_type(L, -1) != LUA_TSTRING)
      luaL_error(L, "tok_train: inputs[%d] must be a string, got %s", i, luaL_typename(L, -1));
    paths[i - 1] = lua_tostring(L, -1);
    lua_pop(L, 1);
  }
  fsdp_tok_train_opts o = {.inputs = paths, .ninputs = n};
  o.vocab_size = (int)opt_field_int(L, 1, "vocab_size", 0, 1, 1 << 30);
  if (o.vocab_size == 0) luaL_error(L, "tok_train: vocab_size is required");
  o.threads = (int)opt_field_int(L, 1, "threads", 1, 1, 1024);
  o.max_sentences = opt_field_int(L, 1, "max_sentences", 0, 0, INT64_C(1) << 52);
  lua_getfield(L, 1, "model");
  o.model = lua_tostring(L, -1);
  if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "tok_train: model must be a path");
  lua_getfield(L, 1, "model_type");
  if (!lua_isnil(L, -1)) {
    if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "tok_train: model_type must be a string");
    o.model_type = lua_tostring(L, -1);
  }
  lua_getfield(L, 1, "character_coverage");
  if (!lua_isnil(L, -1)) {
    if (lua_type(L, -1) != LUA_TNUMBER)
      luaL_error(L, "tok_train: character_coverage must be a number");
    o.character_coverage = lua_tonumber(L, -1);
    if (!(o.character_coverage > 0 && o.character_coverage <= 1))
      luaL_error(L, "tok_train: character_coverage must be in (0, 1], got %f",
                 o.character_coverage);
  }
  if (fsdp_tok_train(&o)) return fsdp_lua_error(L);
  return 0;
}

/* ---- tokenizer ---------------------------------------------------------------------------- */

static fsdp_tok *check_tok(lua_State *L, int idx) {
  return fsdp_lua_box_check(L, idx, TOK_MT, NULL, "tokenizer", "");
}

static int l_tok_load(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  fsdp_tok **box = lua_newuserdata(L, sizeof *box);
  *box = NULL;
  luaL_getmetatable(L, TOK_MT);
  lua_setmetatable(L, -2);
  if (fsdp_tok_load(box, path)) return fsdp_lua_error(L);
  return 1;
}

static int l_tok_gc(lua_State *L) {
  fsdp_tok_free(fsdp_lua_box_take(L, 1, TOK_MT));
  return 0;
}

static int l_tok_vocab_size(lua_State *L) {
  lua_pushinteger(L, fsdp_tok_vocab_size(check_tok(L, 1)));
  return 1;
}

static int l_tok_piece(lua_State *L) {
  fsdp_tok *t = check_tok(L, 1);
  int V = fsdp_tok_vocab_size(t);
  int id = (int)check_int(L, 2, "tokenizer:piece", "id", 0, V - 1);
  lua_pushstring(L, fsdp_tok_piece(t, id));
  return 1;
}

static int l_tok_special_id(lua_State *L) {
  int id = fsdp_tok_special_id(check_tok(L, 1), luaL_checkstring(L, 2));
  if (id < 0) return 0;
  lua_pushinteger(L, id);
  return 1;
}

/* Encode the string at 2: the ids in a scratch userdata left on the stack. */
static int32_t *encode(lua_State *L, fsdp_tok *t, size_t *n) {
  size_t len;
  const char *s = luaL_checklstring(L, 2, &len);
  void **sc = scratch_push(L);
  int32_t *ids;
  if (fsdp_tok_encode(t, s, len, &ids, n)) fsdp_lua_error(L);
  *sc = ids;
  return ids;
}

static int l_tok_encode(lua_State *L) {
  fsdp_tok *t = check_tok(L, 1);
  size_t n;
  int32_t *ids = encode(L, t, &n);
  lua_createtable(L, (int)n, 0);
  for (size_t i = 0; i < n; i++) {
    lua_pushinteger(L, ids[i]);
    lua_rawseti(L, -2, (int)i + 1);
  }
  return 1;
}

static int l_tok_encode_packed(lua_State *L) {
  fsdp_tok *t = check_tok(L, 1);
  int es = (int)check_int(L, 3, "tokenizer:encode_packed", "elem_size", 2, 4);
  if (es == 3) luaL_error(L, "tokenizer:encode_packed: elem_size must be 2 or 4, got 3");
  if (es == 2 && fsdp_tok_vocab_size(t) > 65536)
    luaL_error(L, "tokenizer:encode_packed: a vocabulary of %d does not fit uint16 ids",
               fsdp_tok_vocab_size(t));
  size_t n;
  int32_t *ids = encode(L, t, &n);
  /* packed in place: each id's bytes land at or below where the id was read */
  unsigned char *out = (unsigned char *)ids;
  for (size_t i = 0; i < n; i++) {
    uint32_t v = (uint32_t)ids[i];
    unsigned char b[4] = {v & 0xff, (v >> 8) & 0xff, (v >> 16) & 0xff, v >> 24};
    memcpy(out + i * (size_t)es, b, (size_t)es);
  }
  lua_pushlstring(L, (const char *)out, n * (size_t)es);
  lua_pushinteger(L, (lua_Integer)n);
  return 2;
}

static int l_tok_decode(lua_State *L) {
  fsdp_tok *t = check_tok(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  const int V = fsdp_tok_vocab_size(t);
  size_t n = lua_objlen(L, 2);
  int32_t *ids = lua_newuserdata(L, (n > 0 ? n : 1) * sizeof *ids);
  for (size_t i = 0; i < n; i++) {
    lua_rawgeti(L, 2, (int)i + 1);
    if (lua_type(L, -1) != LUA_TNUMBER)
      luaL_error(L, "tokenizer:decode: id at position %d is a %s, not a number", (int)i + 1,
                 luaL_typename(L, -1));
    lua_Number v = lua_tonumber(L, -1);
    if (v != floor(v)) /* NaN too; an infinite id is out of range below */
      luaL_error(L, "tokenizer:decode: id %f at position %d is not an integer id", (double)v,
                 (int)i + 1);
    if (!(v >= 0 && v < V))
      luaL_error(L, "tokenizer:decode: id %f at position %d is out of range [0, %d)", (double)v,
                 (int)i + 1, V);
    ids[i] = (int32_t)v;
    lua_pop(L, 1);
  }
  void **sc = scratch_push(L);
  char *text;
  size_t len;
  if (fsdp_tok_decode(t, ids, n, &text, &len)) return fsdp_lua_error(L);
  *sc = text;
  lua_pushlstring(L, text, len);
  return 1;
}

static int l_tok_free(lua_State *L) {
  luaL_checkudata(L, 1, TOK_MT);
  return l_tok_gc(L);
}

static int l_tok_tostring(lua_State *L) {
  fsdp_tok **box = luaL_checkudata(L, 1, TOK_MT);
  if (*box == NULL)
    lua_pushstring(L, "tokenizer (freed)");
  else
    lua_pushfstring(L, "tokenizer (%d pieces)", fsdp_tok_vocab_size(*box));
  return 1;
}

/* ---- token files -------------------------------------------------------------------------- */

static fsdp_io_tokens *check_file(lua_State *L, int idx) {
  return fsdp_lua_box_check(L, idx, TOKFILE_MT, NULL, "token file", "");
}

static int l_tokens_open(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int es = (int)check_int(L, 2, "tokens_open", "elem_size", 1, 8);
  int64_t count = check_int(L, 3, "tokens_open", "count", 0, INT64_C(1) << 52);
  int64_t vocab = lua_isnoneornil(L, 4) ? 0
                                        : check_int(L, 4, "tokens_open", "vocab", 0,
                                                    INT64_C(1) << 32);
  fsdp_io_tokens **box = lua_newuserdata(L, sizeof *box);
  *box = NULL;
  luaL_getmetatable(L, TOKFILE_MT);
  lua_setmetatable(L, -2);
  if (fsdp_io_tokens_open(box, path, es, count, vocab)) return fsdp_lua_error(L);
  return 1;
}

static int l_tokens_gc(lua_State *L) {
  fsdp_io_tokens_close(fsdp_lua_box_take(L, 1, TOKFILE_MT));
  return 0;
}

static int l_tokens_close(lua_State *L) { return l_tokens_gc(L); }

static int l_tokens_count(lua_State *L) {
  lua_pushnumber(L, (lua_Number)fsdp_io_tokens_count(check_file(L, 1)));
  return 1;
}

static int l_tokens_path(lua_State *L) {
  lua_pushstring(L, fsdp_io_tokens_path(check_file(L, 1)));
  return 1;
}

static int l_tokens_windows(lua_State *L) {
  fsdp_io_tokens *f = check_file(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  int64_t T = check_int(L, 3, "token file:windows", "window length", 1, INT64_C(1) << 40);
  bool target = lua_isnoneornil(L, 4) || lua_toboolean(L, 4);
  int B = (int)lua_objlen(L, 2);
  int64_t *starts = lua_newuserdata(L, (size_t)(B > 0 ? B : 1) * sizeof *starts);
  for (int i = 0; i < B; i++) {
    lua_rawgeti(L, 2, i + 1);
    starts[i] = check_int(L, lua_gettop(L), "token file:windows", "start", 0, INT64_C(1) << 52);
    lua_pop(L, 1);
  }
  int64_t shape[2] = {B, T};
  fsdp_tensor *x, *y = NULL;
  if (fsdp_tensor_new_uninit(&x, &fsdp_device_cpu, FSDP_DTYPE_I64, 2, shape,
                             FSDP_ROLE_ACTIVATIONS) != FSDP_OK)
    return fsdp_lua_error(L);
  if (target && fsdp_tensor_new_uninit(&y, &fsdp_device_cpu, FSDP_DTYPE_I64, 2, shape,
                                       FSDP_ROLE_ACTIVATIONS) != FSDP_OK) {
    fsdp_tensor_release(x);
    return fsdp_lua_error(L);
  }
  int64_t *xd = fsdp_tensor_data(x, "windows");                        // (B, T)
  int64_t *yd = y != NULL ? fsdp_tensor_data(y, "windows") : NULL;     // (B, T)
  if (fsdp_io_tokens_windows(f, xd, yd, starts, B, T)) {
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    return fsdp_lua_error(L);
  }
  fsdp_lua_push_tensor(L, x);
  if (y == NULL) return 1;
  fsdp_lua_push_tensor(L, y);
  return 2;
}

/* ---- registration ------------------------------------------------------------------------- */

static const luaL_Reg tok_methods[] = {
    {"encode", l_tok_encode},         {"encode_packed", l_tok_encode_packed},
    {"decode", l_tok_decode},         {"vocab_size", l_tok_vocab_size},
    {"piece", l_tok_piece},           {"special_id", l_tok_special_id},
    {"free", l_tok_free},             {NULL, NULL},
};

static const luaL_Reg file_methods[] = {
    {"windows", l_tokens_windows}, {"count", l_tokens_count}, {"path", l_tokens_path},
    {"close", l_tokens_close},     {NULL, NULL},
};

static const luaL_Reg tok_funcs[] = {
    {"tok_available", l_tok_available},
    {"tok_train", l_tok_train},
    {"tok_load", l_tok_load},
    {"tokens_open", l_tokens_open},
    {NULL, NULL},
};

static void new_class(lua_State *L, const char *mt, const luaL_Reg *methods, lua_CFunction gc) {
  luaL_newmetatable(L, mt);
  lua_pushcfunction(L, gc);
  lua_setfield(L, -2, "__gc");
  lua_newtable(L);
  luaL_register(L, NULL, methods);
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);
}

void fsdp_lua_open_tok(lua_State *L) {
  luaL_newmetatable(L, SCRATCH_MT);
  lua_pushcfunction(L, scratch_gc);
  lua_setfield(L, -2, "__gc");
  lua_pop(L, 1);
  new_class(L, TOK_MT, tok_methods, l_tok_gc);
  luaL_getmetatable(L, TOK_MT);
  lua_pushcfunction(L, l_tok_tostring);
  lua_setfield(L, -2, "__tostring");
  lua_pop(L, 1);
  new_class(L, TOKFILE_MT, file_methods, l_tokens_gc);
  luaL_register(L, NULL, tok_funcs);
}
