/*
 * module.c — luaopen_fsdp_core: assembles the `fsdp.core` module from the binding files.
 * lua/fsdp/init.lua builds the user-facing `fsdp` module on top of it.
 */
#include "autograd/autograd.h"
#include "core/core.h"
#include "kernels/cpu/kernels.h"
#include "lua/binding.h"

/* Runs when the Lua state closes (the sentinel lives in the registry). The tape is this
 * thread's and may still hold nodes (a forward without backward; FSDP hook nodes hold units
 * and parameters): drop them while the communicator is still there. Freed tensors' blocks sit
 * in the cpu device's cache, which nothing else would give back before the process ends. */
static int close_state(lua_State *L) {
  fsdp_tape_clear();
  fsdp_lua_checkpoint_forget(L);
  fsdp_device_cpu_trim();
  return 0;
}

static void anchor_trim_sentinel(lua_State *L) {
  lua_newuserdata(L, 1);
  lua_newtable(L);
  lua_pushcfunction(L, close_state);
  lua_setfield(L, -2, "__gc");
  lua_setmetatable(L, -2);
  luaL_ref(L, LUA_REGISTRYINDEX);
}

FSDP_API int luaopen_fsdp_core(lua_State *L) {
  /* created before any tensor, so it is finalized after every tensor at lua_close */
  anchor_trim_sentinel(L);
  /* a bad FSDP_CPU_ISA, FSDP_GEMM, FSDP_BF16_GEMM or FSDP_CPU_CACHE fails here, at require,
   * rather than running at another level, on another library or with another cache than asked */
  if (fsdp_cpu_isa_check() != FSDP_OK || fsdp_cpu_gemm_check() != FSDP_OK ||
      fsdp_device_cpu_check() != FSDP_OK)
    return luaL_error(L, "%s", fsdp_error_msg());
  lua_newtable(L);
  fsdp_lua_open_tensor(L);
  fsdp_lua_open_ops(L);
  fsdp_lua_open_bench(L);
  fsdp_lua_open_data(L);
  fsdp_lua_open_comm(L);
  fsdp_lua_open_fsdp(L);
  fsdp_lua_open_io(L);
  fsdp_lua_open_mask(L);
  fsdp_lua_open_checkpoint(L);
  fsdp_lua_open_tok(L);
  lua_pushstring(L, FSDP_VERSION_STRING);
  lua_setfield(L, -2, "version");
  return 1;
}
