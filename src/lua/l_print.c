/*
 * l_print.c — Lua's print formatting for the hosts of Lua states (fsdprun's ranks, the
 * embedding runtime): each replaces `print` to send whole lines somewhere of its own.
 */
#include "lua/binding.h"

void fsdp_lua_print_line(lua_State *L, bool newline) {
  int n = lua_gettop(L);
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  for (int i = 1; i <= n; i++) {
    if (i > 1) luaL_addchar(&b, '\t');
    lua_getglobal(L, "tostring");
    lua_pushvalue(L, i);
    lua_call(L, 1, 1);
    if (lua_type(L, -1) != LUA_TSTRING && lua_type(L, -1) != LUA_TNUMBER)
      luaL_error(L, LUA_QL("tostring") " must return a string to " LUA_QL("print"));
    luaL_addvalue(&b);
  }
  if (newline) luaL_addchar(&b, '\n');
  luaL_pushresult(&b);
}
