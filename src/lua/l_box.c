/*
 * l_box.c — identity-preserving userdata boxes for C objects (tensors, units).
 *
 * A box is a userdata whose first member is the object pointer and which owns one reference
 * to it. A weak-valued table in the registry (one per kind, at the address cache_key) maps the
 * object's address to its live box, so the same C object always comes back as the same Lua
 * value while that value lives: parameter identity (ties, references saved before wrapping) is
 * plain Lua identity. A box whose pointer was cleared (freed) no longer matches.
 */
#include "lua/binding.h"

void fsdp_lua_box_cache_new(lua_State *L, const void *cache_key) {
  lua_pushlightuserdata(L, (void *)cache_key);
  lua_newtable(L);
  lua_newtable(L);
  lua_pushstring(L, "v");
  lua_setfield(L, -2, "__mode");
  lua_setmetatable(L, -2);
  lua_rawset(L, LUA_REGISTRYINDEX);
}

bool fsdp_lua_box_push_cached(lua_State *L, const void *cache_key, void *ptr) {
  lua_pushlightuserdata(L, (void *)cache_key);
  lua_rawget(L, LUA_REGISTRYINDEX);
  lua_pushlightuserdata(L, ptr);
  lua_rawget(L, -2);
  void **box = lua_touserdata(L, -1);
  if (box && *box == ptr) {
    lua_remove(L, -2);
    return true;
  }
  lua_pop(L, 2);
  return false;
}

void *fsdp_lua_box_check(lua_State *L, int idx, const char *mt, const char *fn, const char *what,
                         const char *hint) {
  void **box = luaL_testudata(L, idx, mt);
  if (box == NULL) {
    if (fn != NULL)
      luaL_error(L, "bad argument #%d to '%s' (%s expected, got %s)", idx, fn, what,
                 luaL_typename(L, idx));
    luaL_argerror(L, idx, lua_pushfstring(L, "%s expected, got %s", what, luaL_typename(L, idx)));
  }
  if (*box == NULL) {
    if (fn != NULL) luaL_error(L, "%s: argument #%d is a freed %s%s", fn, idx, what, hint);
    luaL_error(L, "%s was freed%s", what, hint);
  }
  return *box;
}

void *fsdp_lua_box_take(lua_State *L, int idx, const char *mt) {
  void **box = luaL_checkudata(L, idx, mt);
  void *p = *box;
  *box = NULL;
  return p;
}

void fsdp_lua_box_push_new(lua_State *L, const void *cache_key, void *ptr, size_t size,
                           const char *mt) {
  lua_pushlightuserdata(L, (void *)cache_key);
  lua_rawget(L, LUA_REGISTRYINDEX);
  void **box = lua_newuserdata(L, size);
  *box = ptr;
  luaL_getmetatable(L, mt);
  lua_setmetatable(L, -2);
  lua_pushlightuserdata(L, ptr);
  lua_pushvalue(L, -2);
  lua_rawset(L, -4);
  lua_remove(L, -2);
}
