/*
 * mpi_stub.c — the `mpi` backend when the build did not find Open MPI (CMakeLists.txt compiles
 * this file instead of mpi.c): every entry point of mpi.h exists and says how to get the real
 * one.
 */
#include "comm/mpi.h"

int fsdp_comm_mpi_new(fsdp_comm **out) {
  *out = NULL;
  return fsdp_error("fsdprun was built without Open MPI (install libopenmpi-dev and rebuild)");
}

bool fsdp_mpi_available(void) { return false; }

bool fsdp_mpi_finalize(void) { return false; }

const char *fsdp_mpi_finalize_blocked(void) { return NULL; }

const char *fsdp_mpi_thread_level(void) { return "none"; }
