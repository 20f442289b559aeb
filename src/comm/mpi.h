/*
 * mpi.h — the `mpi` backend of the communicator (comm.h) on Open MPI: one rank per process,
 * ranks and world taken from MPI_COMM_WORLD. docs/mpi.md is the long version.
 *
 * mpi.c implements it when the build finds Open MPI; otherwise mpi_stub.c answers every call
 * with "fsdprun was built without Open MPI ...". Nothing above src/comm needs to know which.
 *
 * Everything of comm.h holds (sequence order, fingerprints, poison, timeout, flight recorder,
 * stats); the reductions have the local backend's exact arithmetic, so a run gives the same
 * bits on either backend at the same world size.
 */
#ifndef FSDP_COMM_MPI_H
#define FSDP_COMM_MPI_H

#include <stdbool.h>

#include "comm/comm.h"

/* This process's communicator over MPI_COMM_WORLD. Initializes MPI (MPI_Init_thread asking for
 * MPI_THREAD_SERIALIZED; FSDP_MPI_THREAD=multiple asks for MPI_THREAD_MULTIPLE) unless the
 * host already did, in which case it must have at least MPI_THREAD_SERIALIZED (the backend
 * calls MPI from its progress thread, one call at a time). Collective over MPI_COMM_WORLD:
 * every process creates its communicators in the same order. Reads FSDP_TIMEOUT like the
 * other backends, and the FSDP_MPI_* tuning variables of docs/mpi.md. */
int fsdp_comm_mpi_new(fsdp_comm **out);

/* Whether this build has the mpi backend (false with mpi_stub.c). */
bool fsdp_mpi_available(void);

/* Finalize MPI if this library initialized it and nothing failed: after a failure (a poisoned
 * communicator: collectives may be left in flight) MPI_Finalize could wait for peers forever, so
 * it is skipped and the process should exit nonzero (mpirun then ends the job). Call it once,
 * after freeing the communicators, from the thread that created the first one. Returns whether
 * MPI was finalized. A no-op without the backend or when the host initialized MPI. */
bool fsdp_mpi_finalize(void);

/* Why fsdp_mpi_finalize would skip MPI_Finalize now ("a communicator of this process failed,
 * ..."; "2 communicators are still open"), or NULL when it would finalize or has nothing to do (the
 * host initialized MPI, or it is finalized already, or there is no backend). A process that
 * would end with status 0 but gets a reason must not: mpirun reports a process that exits 0
 * without MPI_Finalize as "exiting improperly", the message of Open MPI's launch race. */
const char *fsdp_mpi_finalize_blocked(void);

/* MPI's thread level as granted ("serialized", "multiple", ...; "none" before MPI_Init). */
const char *fsdp_mpi_thread_level(void);

#endif
