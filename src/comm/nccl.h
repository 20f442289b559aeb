/*
 * nccl.h — the `nccl` backend of the communicator (comm.h): one rank per GPU, collectives on
 * device buffers issued by NCCL on a communication stream of each rank. docs/nccl.md is the long
 * version.
 *
 * A NCCL communicator needs one 128-byte unique id, made by one rank (ncclGetUniqueId) and
 * known to all before any of them can start: the bootstrap. fsdprun shares it over a
 * communicator the ranks already have, the same way on every backend: the local group of the
 * rank threads of one process (`fsdprun -n N --backend nccl`), or Open MPI across processes and
 * machines (`mpirun -np N fsdprun --backend nccl`). That bootstrap communicator stays with the
 * NCCL one: it carries the fingerprint checks, the poison and the "left" messages, which NCCL
 * has no way to carry.
 *
 * nccl.c implements the backend when the build finds NCCL; nccl_stub.c otherwise answers with
 * "fsdprun was built without NCCL ...". The bootstrap (nccl_boot.c) is plain C in every build,
 * so it is tested on machines without a GPU with a stand-in for ncclGetUniqueId.
 */
#ifndef FSDP_COMM_NCCL_H
#define FSDP_COMM_NCCL_H

#include <stdbool.h>
#include <stdint.h>

#include "comm/comm.h"

#define FSDP_NCCL_ID_BYTES 128 /* NCCL_UNIQUE_ID_BYTES */

/* Makes a unique id (ncclGetUniqueId in the backend; a stand-in in tests): FSDP_OK, or FSDP_ERR
 * with a message. */
typedef int (*fsdp_nccl_id_fn)(uint8_t id[FSDP_NCCL_ID_BYTES], void *arg);

/* Every rank of boot returns holding the id that make() produced on rank 0: a broadcast over
 * boot labelled "nccl.unique_id" (so it takes part in boot's sequence and fingerprints like any
 * collective). make is called on rank 0 only. When it fails, rank 0 poisons boot with its
 * message, so every rank fails with "rank 0 failed: nccl bootstrap: <message>" instead of
 * waiting; a rank that never comes makes the others time out as in any collective. */
int fsdp_nccl_share_id(fsdp_comm *boot, uint8_t id[FSDP_NCCL_ID_BYTES], fsdp_nccl_id_fn make,
                       void *arg);

/* Whether this build has the nccl backend (false with nccl_stub.c). */
bool fsdp_nccl_available(void);

/* This rank's NCCL communicator over the ranks of boot (rank and world are boot's): the id is
 * shared over boot (fsdp_nccl_share_id with ncclGetUniqueId), then ncclCommInitRank on the
 * calling thread's GPU (the cuda device's binding: local rank % GPUs). boot is borrowed: it must
 * outlive the communicator, and no collective may be issued on it directly while the nccl
 * communicator is in use (their sequences would interleave differently on different ranks).
 * Collectives on the result take device buffers of the cuda device (fsdp_coll.device). */
int fsdp_comm_nccl_new(fsdp_comm **out, fsdp_comm *boot);

#endif
