/*
 * l_fsdp.c — the fsdp part of the fsdp.core module (placeholder until its owner fills it).
 */
#include "lua/binding.h"

void fsdp_lua_open_fsdp(lua_State *L) { (void)L; }
