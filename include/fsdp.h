/*
 * fsdp.h — the public embedding API of fsdprun (libfsdp). This header is the specification:
 * only symbols declared here with FSDP_API are exported from libfsdp.so.
 *
 * Stability: functions are added, never changed; freeing NULL is a no-op.
 */
#ifndef FSDP_H
#define FSDP_H

#ifdef __cplusplus
extern "C" {
#endif

#define FSDP_API __attribute__((visibility("default")))

#define FSDP_VERSION_MAJOR 0
#define FSDP_VERSION_MINOR 1
#define FSDP_VERSION_PATCH 0

/* The library's version string, e.g. "0.1.0". Static storage; never NULL. */
FSDP_API const char *fsdp_version(void);

struct lua_State;
/* Lua entry point of the engine module: `require "fsdp.core"`. Host programs that run their own
 * LuaJIT state may preload it (package.preload["fsdp.core"] = luaopen_fsdp_core). */
FSDP_API int luaopen_fsdp_core(struct lua_State *L);

#ifdef __cplusplus
}
#endif
#endif
