/*
 * lua_cpu2.c — the cpu2 test device (cpu2_device.h) for busted specs
 * (tests/lua/devices_spec.lua):
 *   local cpu2 = require "fsdp_cpu2"   -- before anything loads fsdp.core
 * registers cpu2 and puts this module's fsdp.core (the same engine the device is registered in)
 * into package.loaded, so `require "fsdp"` then uses it. Returns a table: transfers() -> to_host,
 * from_host (calls since reset), reset(). Built for the tests only (CMakeLists.txt), never
 * installed: a program loads either this or lib/fsdp/core.so, never both.
 */
#include "cpu2_device.h"
#include "lua/binding.h"

static int l_transfers(lua_State *L) {
  lua_pushnumber(L, (lua_Number)cpu2_counts.to_host);
  lua_pushnumber(L, (lua_Number)cpu2_counts.from_host);
  return 2;
}

static int l_reset(lua_State *L) {
  (void)L;
  cpu2_reset();
  return 0;
}

FSDP_API int luaopen_fsdp_cpu2(lua_State *L) {
  lua_getfield(L, LUA_REGISTRYINDEX, "_LOADED");
  lua_getfield(L, -1, "fsdp.core");
  if (!lua_isnil(L, -1))
    return luaL_error(L, "fsdp_cpu2: require it before fsdp.core is loaded (it brings its own)");
  lua_pop(L, 1);
  if (cpu2_register()) return luaL_error(L, "fsdp_cpu2: %s", fsdp_error_msg());
  luaopen_fsdp_core(L);
  lua_setfield(L, -2, "fsdp.core");
  lua_pop(L, 1);
  lua_newtable(L);
  lua_pushcfunction(L, l_transfers);
  lua_setfield(L, -2, "transfers");
  lua_pushcfunction(L, l_reset);
  lua_setfield(L, -2, "reset");
  return 1;
}
