/*
 * module.c — luaopen_fsdp_core: assembles the `fsdp.core` module from the binding files.
 * lua/fsdp/init.lua builds the user-facing `fsdp` module on top of it.
 */
#include "lua/binding.h"

/* Runs when the Lua state closes (the sentinel lives in the registry): freed tensors' blocks
 * sit in the cpu device's cache, which nothing else would give back before the process ends. */
static int trim_cache(lua_State *L) {
  (void)L;
  fsdp_device_cpu_trim();
  return 0;
}

static void anchor_trim_sentinel(lua_State *L) {
  lua_newuserdata(L, 1);
  lua_newtable(L);
  lua_pushcfunction(L, trim_cache);
  lua_setfield(L, -2, "__gc");
  lua_setmetatable(L, -2);
  luaL_ref(L, LUA_REGISTRYINDEX);
}

FSDP_API int luaopen_fsdp_core(lua_State *L) {
  /* created before any tensor, so it is finalized after every tensor at lua_close */
  anchor_trim_sentinel(L);
  lua_newtable(L);
  fsdp_lua_open_tensor(L);
  fsdp_lua_open_ops(L);
  fsdp_lua_open_bench(L);
  fsdp_lua_open_data(L);
  fsdp_lua_open_comm(L);
  fsdp_lua_open_fsdp(L);
  lua_pushstring(L, FSDP_VERSION_STRING);
  lua_setfield(L, -2, "version");
  return 1;
}
