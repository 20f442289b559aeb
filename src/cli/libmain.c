/*
 * libmain.c — the parts of the public API (include/fsdp.h) that every binary carries
 * (fsdp_version): compiled into libfsdp.so, fsdp/core.so and the fsdprun executable (never into
 * the static engine, so each of those links it exactly once). The embedding runtime
 * (fsdp_runtime_*, fsdp_call, ...) is src/embed/, compiled into libfsdp.so only.
 */
#include "fsdp.h"

#ifndef FSDP_VERSION_STRING
#error "FSDP_VERSION_STRING must be defined by the build (CMakeLists.txt: fsdp_engine)"
#endif

FSDP_API const char *fsdp_version(void) { return FSDP_VERSION_STRING; }
