/*
 * nccl_boot.c — sharing a NCCL unique id over a communicator the ranks already have (nccl.h).
 * Plain C in every build: the backend (nccl.c) passes ncclGetUniqueId, the tests a stand-in.
 */
#include "comm/nccl.h"

#include <stdio.h>
#include <string.h>

int fsdp_nccl_share_id(fsdp_comm *boot, uint8_t id[FSDP_NCCL_ID_BYTES], fsdp_nccl_id_fn make,
                       void *arg) {
  if (!boot) return fsdp_error("nccl bootstrap: no communicator to share the unique id over");
  if (!make) return fsdp_error("nccl bootstrap: no function to make the unique id");
  memset(id, 0, FSDP_NCCL_ID_BYTES);
  if (fsdp_comm_rank(boot) == 0 && make(id, arg) != FSDP_OK) {
    char msg[FSDP_ERROR_CAP];
    snprintf(msg, sizeof msg, "nccl bootstrap: %s", fsdp_error_msg());
    fsdp_comm_abort(boot, msg); /* the peers are (or will be) waiting in the broadcast */
    return fsdp_error("%s", msg);
  }
  if (fsdp_comm_broadcast(boot, id, FSDP_NCCL_ID_BYTES, FSDP_DTYPE_U8, 0, "nccl.unique_id")) {
    return fsdp_error_context("nccl bootstrap");
  }
  return FSDP_OK;
}
