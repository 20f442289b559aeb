/*
 * module.c — luaopen_fsdp_core: assembles the `fsdp.core` module from the binding files.
 * lua/fsdp/init.lua builds the user-facing `fsdp` module on top of it.
 */
#include "lua/binding.h"

FSDP_API int luaopen_fsdp_core(lua_State *L) {
  lua_newtable(L);
  fsdp_lua_open_tensor(L);
  fsdp_lua_open_ops(L);
  fsdp_lua_open_bench(L);
  fsdp_lua_open_data(L);
  lua_pushstring(L, FSDP_VERSION_STRING);
  lua_setfield(L, -2, "version");
  return 1;
}
