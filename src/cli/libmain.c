/*
 * libmain.c — the parts of the public API (include/fsdp.h) that are not Lua: compiled into
 * libfsdp.so, fsdp/core.so and the fsdprun executable (never into the static engine, so each
 * of those links it exactly once). Owner: cli.
 */
#include "fsdp.h"

#ifndef FSDP_VERSION_STRING
#error "FSDP_VERSION_STRING must be defined by the build (CMakeLists.txt: fsdp_engine)"
#endif

FSDP_API const char *fsdp_version(void) { return FSDP_VERSION_STRING; }
