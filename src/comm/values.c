/*
 * values.c — collectives over values rather than raw buffers (comm.h): a tensor reduced or
 * broadcast in place, byte strings of any length from every rank or from one, and the digest
 * ranks compare before sending whole values. Built on the typed collectives; what they
 * receive goes into memory the caller's allocator gives (the Lua binding's userdata).
 */
#include <stdio.h>
#include <string.h>

#include "comm/comm.h"

/* The buffer of a tensor a collective writes in place: contiguous, with data. */
static void *inplace(fsdp_tensor *t, const char *fn) {
  void *d = fsdp_tensor_data(t, fn);
  if (d == NULL) return NULL;
  if (!fsdp_tensor_is_contiguous(t)) {
    fsdp_error("%s: needs a contiguous tensor, got a strided view %s (use :contiguous())", fn,
               FSDP_SHAPE_STR(t));
    return NULL;
  }
  return d;
}

static int run_inplace(fsdp_comm *c, fsdp_coll *coll, fsdp_tensor *t, const char *fn,
                       const char *label) {
  if ((coll->recv = inplace(t, fn)) == NULL) return FSDP_ERR;
  coll->dtype = t->dtype;
  coll->count = fsdp_tensor_numel(t);
  coll->device = t->storage->device;
  snprintf(coll->label, sizeof coll->label, "%s", label ? label : "");
  if (fsdp_comm_run(c, coll)) return FSDP_ERR;
  fsdp_tensor_written(t);
  return FSDP_OK;
}

int fsdp_comm_all_reduce_tensor(fsdp_comm *c, fsdp_tensor *t, fsdp_reduce_op red,
                                const char *label) {
  fsdp_coll coll = {.op = FSDP_COLL_ALL_REDUCE, .red = red};
  return run_inplace(c, &coll, t, "all_reduce", label);
}

int fsdp_comm_broadcast_tensor(fsdp_comm *c, fsdp_tensor *t, int root, const char *label) {
  fsdp_coll coll = {.op = FSDP_COLL_BROADCAST, .root = root};
  return run_inplace(c, &coll, t, "broadcast", label);
}

int fsdp_comm_all_gather_bytes(fsdp_comm *c, const void *s, size_t len, int64_t *lens,
                               char **all, size_t *stride, fsdp_comm_alloc_fn alloc, void *ud,
                               const char *label) {
  int world = fsdp_comm_world(c), rank = fsdp_comm_rank(c);
  *all = NULL;
  *stride = 0;
  if (len > 0 && s == NULL) return fsdp_error("all_gather_bytes: NULL string of %zu bytes", len);
  lens[rank] = (int64_t)len;
  if (fsdp_comm_all_gather(c, lens, lens + rank, 1, FSDP_DTYPE_I64, label)) return FSDP_ERR;
  int64_t max = 0;
  for (int p = 0; p < world; p++)
    if (lens[p] > max) max = lens[p];
  if (max == 0) return FSDP_OK; /* every string is empty: the lengths said it all */
  /* the same size on every rank, so a failed allocation is this rank's error alone */
  char *buf = alloc(ud, (size_t)max * (size_t)world + 1);
  if (buf == NULL)
    return fsdp_error("all_gather_bytes: out of memory for %d x %lld bytes", world,
                      (long long)max);
  char *mine = buf + (size_t)rank * (size_t)max;
  if (len > 0) memcpy(mine, s, len);
  memset(mine + len, 0, (size_t)max - len);
  if (fsdp_comm_all_gather(c, buf, mine, max, FSDP_DTYPE_U8, label)) return FSDP_ERR;
  *all = buf;
  *stride = (size_t)max;
  return FSDP_OK;
}

int fsdp_comm_broadcast_bytes(fsdp_comm *c, const void *s, size_t len, int root,
                              const char **out, size_t *out_len, fsdp_comm_alloc_fn alloc,
                              void *ud, const char *label) {
  int world = fsdp_comm_world(c);
  *out = NULL;
  *out_len = 0;
  if (root < 0 || root >= world)
    return fsdp_error("broadcast_bytes: root %d is not a rank in [0, %d)", root, world);
  bool me = fsdp_comm_rank(c) == root;
  if (me && len > 0 && s == NULL)
    return fsdp_error("broadcast_bytes: NULL string of %zu bytes", len);
  int64_t n = me ? (int64_t)len : 0;
  if (fsdp_comm_broadcast(c, &n, 1, FSDP_DTYPE_I64, root, label)) return FSDP_ERR;
  /* the root's string is only read: sent as it is ("" stands for a NULL one of no bytes; the
   * count-0 broadcast still runs, so every rank issues the same two collectives) */
  char *buf = me ? (char *)(s != NULL ? s : "") : alloc(ud, (size_t)n + 1);
  if (buf == NULL && !me)
    return fsdp_error("broadcast_bytes: out of memory for %lld bytes", (long long)n);
  if (fsdp_comm_broadcast(c, buf, n, FSDP_DTYPE_U8, root, label)) return FSDP_ERR;
  if (!me) buf[n] = '\0';
  *out = buf;
  *out_len = (size_t)n;
  return FSDP_OK;
}

uint64_t fsdp_comm_digest(const void *s, size_t n) {
  const unsigned char *p = s;
  uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}
