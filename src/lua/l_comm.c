/*
 * l_comm.c — the comm part of the fsdp.core module (placeholder until its owner fills it).
 */
#include "lua/binding.h"

void fsdp_lua_open_comm(lua_State *L) { (void)L; }
