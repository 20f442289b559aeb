/*
 * nccl.c — the `nccl` backend (nccl.h): one rank per GPU, collectives on cuda buffers issued by
 * NCCL on a communication stream of each rank, ordered against the rank's compute stream with
 * events, so neither stream waits on the host. docs/nccl.md is the long version.
 *
 * Two communicators per rank. NCCL moves the data; the bootstrap communicator (local threads or
 * Open MPI, fsdp_comm_nccl_new's boot) carries everything NCCL cannot: the unique id, the
 * fingerprint check before every collective, the poison, and collectives on host buffers (a
 * number all-reduced by a recipe, a unit's fingerprint at wrap time), which it runs itself.
 *
 * A collective on cuda buffers (start):
 *   check     the check vector of comm.h folded over boot (an all_reduce MAX of six 64-bit
 *             words, O(log N)); when the hashes disagree (or a rank asks for the full check),
 *             every rank's fingerprint is all-gathered over boot and compared with rank 0's,
 *             so a mismatch fails every rank with the same message before NCCL sees a count
 *             that could overrun a buffer. The check blocks the host for one round trip of
 *             boot; the data does not wait for the host.
 *   order     an event recorded on the calling thread's compute stream, waited by the
 *             communication stream: the collective reads its inputs after the kernels that
 *             wrote them.
 *   data      the NCCL call on the communication stream, then a `done` event.
 * wait: the compute stream waits for `done` (a stream wait, not a host one): whatever the
 * caller runs next on the GPU reads the results.
 *
 * Failure: NCCL cannot fail a collective on every rank by itself, and a missing peer hangs it.
 * A watchdog thread per communicator looks at the collectives in flight every millisecond or
 * so: one that has not completed within the timeout, or an asynchronous NCCL error, aborts the
 * NCCL communicator (ncclCommAbort: its kernels return) and poisons boot with the message, so the
 * peers' watchdogs (which watch boot's poison) abort theirs: every rank fails within the timeout,
 * with the failing rank's message at the next collective or wait, instead of hanging. A
 * communicator that failed is never used again.
 *
 * libnccl.so.2 is loaded when the first communicator is made (dlopen), not linked: the library
 * is ~200 MB and most runs never use it.
 */
#include "comm/nccl.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "kernels/cuda/thread.h"
#include "kernels/kernels.h"

#define NCCL_LIBRARY "libnccl.so.2"
#define MSG_CAP FSDP_ERROR_CAP
#define DOG_NAP_S 1e-3

/* ---- the library --------------------------------------------------------------------------- */

static struct {
  __typeof__(ncclGetUniqueId) *GetUniqueId;
  __typeof__(ncclCommInitRankConfig) *CommInitRankConfig;
  __typeof__(ncclCommInitRank) *CommInitRank;
  __typeof__(ncclCommAbort) *CommAbort;
  __typeof__(ncclCommDestroy) *CommDestroy;
  __typeof__(ncclCommGetAsyncError) *CommGetAsyncError;
  __typeof__(ncclGetErrorString) *GetErrorString;
  __typeof__(ncclGetLastError) *GetLastError;
  __typeof__(ncclAllGather) *AllGather;
  __typeof__(ncclReduceScatter) *ReduceScatter;
  __typeof__(ncclAllReduce) *AllReduce;
  __typeof__(ncclBroadcast) *Broadcast;
} api;
static char load_error[512];
static pthread_once_t load_once = PTHREAD_ONCE_INIT;

static void load(void) {
  void *h = dlopen(NCCL_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(load_error, sizeof load_error, "cannot load %s: %s", NCCL_LIBRARY, dlerror());
    return;
  }
#define SYM(name)                                                                               \
  do {                                                                                          \
    void *f = dlsym(h, "nccl" #name);                                                           \
    if (!f) {                                                                                   \
      snprintf(load_error, sizeof load_error, "%s lacks nccl%s", NCCL_LIBRARY, #name);          \
      return;                                                                                   \
    }                                                                                           \
    memcpy(&api.name, &f, sizeof f); /* POSIX: dlsym's result converts to a function pointer */ \
  } while (0)
  SYM(GetUniqueId);
  SYM(CommInitRankConfig);
  SYM(CommInitRank);
  SYM(CommAbort);
  SYM(CommDestroy);
  SYM(CommGetAsyncError);
  SYM(GetErrorString);
  SYM(GetLastError);
  SYM(AllGather);
  SYM(ReduceScatter);
  SYM(AllReduce);
  SYM(Broadcast);
#undef SYM
}

bool fsdp_nccl_available(void) { return true; }

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void nap(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&ts, NULL);
}

/* ---- state --------------------------------------------------------------------------------- */

typedef struct nccl_op {
  cudaEvent_t done;
  uint64_t seq;
  fsdp_coll_op op;
  char label[64];
  double t_start;
  bool waited;             /* the caller's wait has ordered its stream after `done` */
  bool host;               /* a host-buffer collective run by boot: req below, no event */
  fsdp_comm_req *req;
  struct nccl_op *next;    /* in flight, oldest first (device ops only) */
} nccl_op;

typedef struct nccl_comm {
  fsdp_comm *boot;
  ncclComm_t nc;
  int rank, world, gpu;
  cudaStream_t cs; /* the communication stream */
  cudaEvent_t ready;
  double timeout;

  pthread_mutex_t mu; /* everything below; the NCCL calls are made under it too */
  pthread_t dog;
  bool dog_started, stop;
  nccl_op *head, *tail; /* device collectives not yet retired by the watchdog */
  bool failed;
  char msg[MSG_CAP]; /* why, when failed */
} nccl_comm;

static const char *nccl_err(ncclResult_t r) {
  static _Thread_local char buf[512];
  const char *last = api.GetLastError ? api.GetLastError(NULL) : NULL;
  snprintf(buf, sizeof buf, "%s%s%s", api.GetErrorString ? api.GetErrorString(r) : "NCCL error",
           last && *last ? ": " : "", last && *last ? last : "");
  return buf;
}

/* Fail this communicator (under mu): abort NCCL (its kernels return), poison boot so the peers
 * fail too. full: "rank R failed: ...". */
static void fail_locked(nccl_comm *nc, const char *full) {
  if (nc->failed) return;
  nc->failed = true;
  snprintf(nc->msg, sizeof nc->msg, "%s", full);
  if (nc->nc) (void)api.CommAbort(nc->nc);
  nc->nc = NULL;
  fsdp_comm_poison(nc->boot, full);
}

/* A non-blocking communicator may answer ncclInProgress: poll it to its end (bounded by the
 * timeout). */
static ncclResult_t settle(nccl_comm *nc, ncclResult_t r) {
  double t0 = now_s();
  while (r == ncclInProgress && nc->nc) {
    ncclResult_t st = ncclSuccess;
    if (api.CommGetAsyncError(nc->nc, &st) != ncclSuccess) return ncclInternalError;
    r = st;
    if (r == ncclInProgress) {
      if (now_s() - t0 > nc->timeout) return ncclInProgress;
      nap(1e-5);
    }
  }
  return r;
}

/* ---- the watchdog ------------------------------------------------------------------------------ */

static void *watchdog(void *arg) {
  nccl_comm *nc = arg;
  pthread_mutex_lock(&nc->mu);
  while (!nc->stop) {
    if (!nc->failed) {
      /* retire what completed and was waited; time the oldest in flight */
      while (nc->head) {
        nccl_op *op = nc->head;
        cudaError_t e = cudaEventQuery(op->done);
        if (e == cudaErrorNotReady) {
          if (now_s() - op->t_start > nc->timeout) {
            char full[MSG_CAP];
            snprintf(full, sizeof full,
                     "rank %d failed: timeout after %g s in %s #%llu '%s': the NCCL collective "
                     "has not completed (a peer is missing, stuck, or failed)",
                     nc->rank, nc->timeout, fsdp_coll_name(op->op), (unsigned long long)op->seq,
                     op->label);
            fail_locked(nc, full);
          }
          break;
        }
        if (e != cudaSuccess) {
          char full[MSG_CAP];
          snprintf(full, sizeof full, "rank %d failed: %s #%llu '%s': cuda: %s", nc->rank,
                   fsdp_coll_name(op->op), (unsigned long long)op->seq, op->label,
                   cudaGetErrorString(e));
          (void)cudaGetLastError();
          fail_locked(nc, full);
          break;
        }
        if (!op->waited) break; /* the caller's wait still needs the event */
        nc->head = op->next;
        if (!nc->head) nc->tail = NULL;
        (void)cudaEventDestroy(op->done);
        free(op);
      }
      ncclResult_t st = ncclSuccess;
      if (!nc->failed && nc->nc && api.CommGetAsyncError(nc->nc, &st) == ncclSuccess &&
          st != ncclSuccess && st != ncclInProgress) {
        char full[MSG_CAP];
        snprintf(full, sizeof full, "rank %d failed: NCCL: %s", nc->rank, nccl_err(st));
        fail_locked(nc, full);
      }
      if (!nc->failed && fsdp_comm_poisoned(nc->boot)) {
        /* a peer failed: stop our NCCL kernels; the next collective reads boot's message */
        nc->failed = true;
        snprintf(nc->msg, sizeof nc->msg,
                 "a peer failed (the group is poisoned); its message is in its report");
        if (nc->nc) (void)api.CommAbort(nc->nc);
        nc->nc = NULL;
      }
    }
    pthread_mutex_unlock(&nc->mu);
    nap(DOG_NAP_S);
    pthread_mutex_lock(&nc->mu);
  }
  pthread_mutex_unlock(&nc->mu);
  return NULL;
}

/* ---- the fingerprint check over boot ------------------------------------------------------- */

/* A fingerprint on the wire of boot's all_gather (every rank runs the same build). */
typedef struct wire_fp {
  int32_t op, dtype, red, root;
  int64_t count;
  char label[64];
  char place[16]; /* "cuda" (device buffers are all this backend moves) */
} wire_fp;

static int check(nccl_comm *nc, const fsdp_coll *k, uint64_t seq, bool full) {
  uint64_t v[FSDP_CHECK_WORDS];
  int64_t w[FSDP_CHECK_WORDS];
  fsdp_coll_check_init(v, k, seq, full);
  /* boot reduces i64 (signed): flip the top bit, so signed order is the unsigned order */
  for (int i = 0; i < FSDP_CHECK_WORDS; i++) w[i] = (int64_t)(v[i] ^ 0x8000000000000000ull);
  if (fsdp_comm_all_reduce(nc->boot, w, FSDP_CHECK_WORDS, FSDP_DTYPE_I64, FSDP_RED_MAX,
                           k->label))
    return FSDP_ERR;
  for (int i = 0; i < FSDP_CHECK_WORDS; i++) v[i] = (uint64_t)w[i] ^ 0x8000000000000000ull;
  if (fsdp_coll_check_agrees(v) && !v[FSDP_CHECK_FULL]) return FSDP_OK;
  /* disagreement (or the full check): every fingerprint to every rank, then rank 0's verdict */
  wire_fp mine = {.op = k->op, .dtype = k->dtype, .red = k->red, .root = k->root,
                  .count = k->count};
  memcpy(mine.label, k->label, sizeof mine.label);
  snprintf(mine.place, sizeof mine.place, "%s", k->device ? k->device->name : "host");
  wire_fp *all = calloc((size_t)nc->world, sizeof *all);
  if (!all) return fsdp_error("%s #%llu: out of memory for the fingerprints",
                              fsdp_coll_name(k->op), (unsigned long long)seq);
  memcpy(&all[nc->rank], &mine, sizeof mine);
  int rc = fsdp_comm_all_gather(nc->boot, all, &all[nc->rank], sizeof mine, FSDP_DTYPE_U8, k->label);
  if (rc) {
    free(all);
    return FSDP_ERR;
  }
  fsdp_coll a, b;
  memset(&a, 0, sizeof a);
  memset(&b, 0, sizeof b);
  a.op = all[0].op, a.dtype = all[0].dtype, a.red = all[0].red, a.root = all[0].root;
  a.count = all[0].count;
  memcpy(a.label, all[0].label, sizeof a.label);
  a.label[sizeof a.label - 1] = '\0';
  a.device = k->device;
  for (int p = 1; p < nc->world; p++) {
    b.op = all[p].op, b.dtype = all[p].dtype, b.red = all[p].red, b.root = all[p].root;
    b.count = all[p].count;
    memcpy(b.label, all[p].label, sizeof b.label);
    b.label[sizeof b.label - 1] = '\0';
    b.device = k->device;
    if (fsdp_coll_matches(&a, &b)) continue;
    char da[160], db[160], msg[MSG_CAP];
    snprintf(msg, sizeof msg, "collective mismatch at #%llu: rank 0 called %s but rank %d called %s",
             (unsigned long long)seq, fsdp_coll_describe(da, sizeof da, &a), p,
             fsdp_coll_describe(db, sizeof db, &b));
    free(all);
    pthread_mutex_lock(&nc->mu);
    /* every rank reaches this message: each fails itself (boot stays healthy for the report) */
    if (!nc->failed) {
      nc->failed = true;
      snprintf(nc->msg, sizeof nc->msg, "%s", msg);
      if (nc->nc) (void)api.CommAbort(nc->nc);
      nc->nc = NULL;
    }
    pthread_mutex_unlock(&nc->mu);
    return fsdp_error("%s", msg);
  }
  free(all);
  return FSDP_OK;
}

/* ---- the vtable ------------------------------------------------------------------------------- */

static int dtype_of(fsdp_dtype dt, ncclDataType_t *out) {
  switch (dt) {
  case FSDP_DTYPE_F32: *out = ncclFloat32; return FSDP_OK;
  case FSDP_DTYPE_BF16: *out = ncclBfloat16; return FSDP_OK;
  case FSDP_DTYPE_F16: *out = ncclFloat16; return FSDP_OK;
  case FSDP_DTYPE_F64: *out = ncclFloat64; return FSDP_OK;
  case FSDP_DTYPE_I64: *out = ncclInt64; return FSDP_OK;
  case FSDP_DTYPE_I32: *out = ncclInt32; return FSDP_OK;
  case FSDP_DTYPE_U8:
  case FSDP_DTYPE_BOOL: *out = ncclUint8; return FSDP_OK;
  default: return FSDP_ERR;
  }
}

static ncclRedOp_t red_of(fsdp_reduce_op red) {
  switch (red) {
  case FSDP_RED_AVG: return ncclAvg;
  case FSDP_RED_MAX: return ncclMax;
  case FSDP_RED_MIN: return ncclMin;
  default: return ncclSum;
  }
}

/* The failure message of a failed communicator, as the collective's error. */
static int failed_error(nccl_comm *nc, const fsdp_coll *k, uint64_t seq) {
  char msg[MSG_CAP];
  memcpy(msg, nc->msg, sizeof msg);
  pthread_mutex_unlock(&nc->mu);
  /* a peer's failure: boot's next collective carries its message */
  if (strncmp(msg, "a peer failed", 13) == 0 && fsdp_comm_barrier(nc->boot, "nccl.poisoned"))
    return FSDP_ERR;
  return fsdp_error("%s #%llu '%s': %s", fsdp_coll_name(k->op), (unsigned long long)seq, k->label,
                    msg);
}

static int nccl_start(fsdp_comm *c, const fsdp_coll *k, uint64_t seq, void **native) {
  nccl_comm *nc = fsdp_comm_impl(c);
  *native = NULL;
  nccl_op *op = calloc(1, sizeof *op);
  if (!op) return fsdp_error("%s #%llu: out of memory", fsdp_coll_name(k->op), (unsigned long long)seq);
  op->seq = seq;
  op->op = k->op;
  memcpy(op->label, k->label, sizeof op->label);
  bool on_device = k->device && !k->device->host_memory;
  if (!on_device) {
    /* host buffers: boot runs it (its own sequence, checks and failure rules) */
    op->host = true;
    fsdp_coll hk = *k;
    if (fsdp_comm_start(nc->boot, &hk, &op->req)) {
      free(op);
      return FSDP_ERR;
    }
    *native = op;
    return FSDP_OK;
  }
  if (strcmp(k->device->name, "cuda") != 0) {
    free(op);
    return fsdp_error("%s #%llu '%s': NCCL moves cuda buffers, these are on the %s device",
                      fsdp_coll_name(k->op), (unsigned long long)seq, k->label, k->device->name);
  }
  pthread_mutex_lock(&nc->mu);
  if (nc->failed) {
    free(op);
    return failed_error(nc, k, seq);
  }
  pthread_mutex_unlock(&nc->mu);
  if (check(nc, k, seq, fsdp_comm_full_check(c))) {
    free(op);
    return FSDP_ERR;
  }
  ncclDataType_t dt;
  if (dtype_of(k->dtype, &dt)) {
    free(op);
    return fsdp_error("%s #%llu '%s': NCCL has no %s", fsdp_coll_name(k->op),
                      (unsigned long long)seq, k->label, fsdp_dtype_name(k->dtype));
  }
  cudaStream_t compute = fsdp_cuda_stream();
  if (!compute) {
    free(op);
    return FSDP_ERR;
  }
  pthread_mutex_lock(&nc->mu);
  if (nc->failed) {
    free(op);
    return failed_error(nc, k, seq);
  }
  cudaError_t ce = cudaEventCreateWithFlags(&op->done, cudaEventDisableTiming);
  if (ce == cudaSuccess) ce = cudaEventRecord(nc->ready, compute);
  if (ce == cudaSuccess) ce = cudaStreamWaitEvent(nc->cs, nc->ready, 0);
  ncclResult_t r = ncclSuccess;
  size_t n = (size_t)k->count;
  if (ce == cudaSuccess) {
    switch (k->op) {
    case FSDP_COLL_ALL_GATHER: r = api.AllGather(k->send, k->recv, n, dt, nc->nc, nc->cs); break;
    case FSDP_COLL_REDUCE_SCATTER:
      r = api.ReduceScatter(k->send, k->recv, n, dt, red_of(k->red), nc->nc, nc->cs);
      break;
    case FSDP_COLL_ALL_REDUCE:
      r = api.AllReduce(k->recv, k->recv, n, dt, red_of(k->red), nc->nc, nc->cs);
      break;
    case FSDP_COLL_BROADCAST:
      r = api.Broadcast(k->recv, k->recv, n, dt, k->root, nc->nc, nc->cs);
      break;
    default: break; /* a barrier: the check was the barrier */
    }
    r = settle(nc, r);
  }
  if (ce == cudaSuccess && r == ncclSuccess) ce = cudaEventRecord(op->done, nc->cs);
  if (ce != cudaSuccess || r != ncclSuccess) {
    char msg[MSG_CAP / 2], full[MSG_CAP];
    snprintf(msg, sizeof msg, "%s #%llu '%s': %s", fsdp_coll_name(k->op),
             (unsigned long long)seq, k->label,
             ce != cudaSuccess ? cudaGetErrorString(ce) : nccl_err(r));
    snprintf(full, sizeof full, "rank %d failed: %s", nc->rank, msg);
    (void)cudaGetLastError();
    fail_locked(nc, full);
    if (op->done) (void)cudaEventDestroy(op->done);
    free(op);
    pthread_mutex_unlock(&nc->mu);
    return fsdp_error("%s", msg);
  }
  op->t_start = now_s();
  if (nc->tail) nc->tail->next = op;
  else nc->head = op;
  nc->tail = op;
  pthread_mutex_unlock(&nc->mu);
  *native = op;
  return FSDP_OK;
}

static int nccl_wait(fsdp_comm *c, void *native) {
  nccl_comm *nc = fsdp_comm_impl(c);
  nccl_op *op = native;
  if (op->host) {
    int rc = fsdp_comm_wait(op->req);
    free(op);
    return rc;
  }
  cudaStream_t compute = fsdp_cuda_stream();
  pthread_mutex_lock(&nc->mu);
  int rc = FSDP_OK;
  if (nc->failed) {
    char msg[MSG_CAP];
    memcpy(msg, nc->msg, sizeof msg);
    rc = fsdp_error("%s #%llu '%s': %s", fsdp_coll_name(op->op), (unsigned long long)op->seq,
                    op->label, msg);
  } else if (!compute) {
    rc = FSDP_ERR;
  } else {
    cudaError_t ce = cudaStreamWaitEvent(compute, op->done, 0);
    if (ce != cudaSuccess) rc = fsdp_error("%s #%llu '%s': cuda: %s", fsdp_coll_name(op->op),
                                           (unsigned long long)op->seq, op->label,
                                           cudaGetErrorString(ce));
  }
  op->waited = true; /* the watchdog retires it once complete (or frees it when the comm goes) */
  pthread_mutex_unlock(&nc->mu);
  return rc;
}

static int nccl_run(fsdp_comm *c, const fsdp_coll *k, uint64_t seq) {
  void *native;
  if (nccl_start(c, k, seq, &native)) return FSDP_ERR;
  return nccl_wait(c, native);
}

static void nccl_abort(fsdp_comm *c, const char *full) {
  nccl_comm *nc = fsdp_comm_impl(c);
  pthread_mutex_lock(&nc->mu);
  fail_locked(nc, full);
  pthread_mutex_unlock(&nc->mu);
  fsdp_comm_poison(nc->boot, full); /* (also when it had failed already: the peers must know) */
}

static bool nccl_poisoned(const fsdp_comm *c) {
  nccl_comm *nc = fsdp_comm_impl(c);
  pthread_mutex_lock(&nc->mu);
  bool f = nc->failed;
  pthread_mutex_unlock(&nc->mu);
  return f || fsdp_comm_poisoned(nc->boot);
}

static void destroy(nccl_comm *nc) {
  if (nc->dog_started) {
    pthread_mutex_lock(&nc->mu);
    nc->stop = true;
    pthread_mutex_unlock(&nc->mu);
    pthread_join(nc->dog, NULL);
  }
  if (nc->nc) {
    /* healthy: let the queued work finish, then free NCCL's resources */
    if (nc->cs) (void)cudaStreamSynchronize(nc->cs);
    (void)api.CommDestroy(nc->nc);
  }
  for (nccl_op *op = nc->head, *next; op; op = next) {
    next = op->next;
    (void)cudaEventDestroy(op->done);
    free(op);
  }
  if (nc->ready) (void)cudaEventDestroy(nc->ready);
  if (nc->cs) (void)cudaStreamDestroy(nc->cs);
  (void)cudaGetLastError();
  pthread_mutex_destroy(&nc->mu);
  free(nc);
}

static void nccl_free(fsdp_comm *c) { destroy(fsdp_comm_impl(c)); }

static const fsdp_comm_i nccl_vt = {
    .name = "nccl",
    .run = nccl_run,
    .host_buffers = true,   /* run by boot */
    .device_buffers = true, /* cuda buffers only: checked in start */
    .abort = nccl_abort,
    .free = nccl_free,
    .start = nccl_start,
    .wait = nccl_wait,
    .poisoned = nccl_poisoned,
};

/* ---- creation --------------------------------------------------------------------------------- */

static int make_id(uint8_t id[FSDP_NCCL_ID_BYTES], void *arg) {
  (void)arg;
  ncclUniqueId u;
  ncclResult_t r = api.GetUniqueId(&u);
  if (r != ncclSuccess) return fsdp_error("ncclGetUniqueId: %s", nccl_err(r));
  memcpy(id, u.internal, FSDP_NCCL_ID_BYTES);
  return FSDP_OK;
}

/* ncclCommInitRankConfig, non-blocking, polled with the timeout and boot's poison: a peer that
 * fails or never comes ends the wait instead of hanging it. */
static int init_rank(nccl_comm *nc, const uint8_t id[FSDP_NCCL_ID_BYTES]) {
  ncclUniqueId u;
  memcpy(u.internal, id, FSDP_NCCL_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = NULL;
  ncclResult_t r = api.CommInitRankConfig(&comm, nc->world, u, nc->rank, &config);
  double t0 = now_s();
  while (r == ncclInProgress) {
    ncclResult_t st = ncclSuccess;
    if (api.CommGetAsyncError(comm, &st) != ncclSuccess) st = ncclInternalError;
    r = st;
    if (r != ncclInProgress) break;
    if (fsdp_comm_poisoned(nc->boot) || now_s() - t0 > nc->timeout) {
      (void)api.CommAbort(comm);
      if (fsdp_comm_poisoned(nc->boot)) {
        /* a peer failed: its message arrives with boot's next collective */
        if (fsdp_comm_barrier(nc->boot, "nccl.init")) return FSDP_ERR;
      }
      return fsdp_error("ncclCommInitRank: no answer from every rank within %g s", nc->timeout);
    }
    nap(1e-4);
  }
  if (r != ncclSuccess) {
    if (comm) (void)api.CommAbort(comm);
    return fsdp_error("ncclCommInitRank on GPU %d: %s%s", nc->gpu, nccl_err(r),
                      r == ncclInvalidUsage
                          ? " (NCCL takes one GPU per rank: for several ranks on one GPU use "
                            "the local backend)"
                          : "");
  }
  nc->nc = comm;
  return FSDP_OK;
}

int fsdp_comm_nccl_new(fsdp_comm **out, fsdp_comm *boot) {
  *out = NULL;
  if (!boot) return fsdp_error("nccl backend: no bootstrap communicator");
  pthread_once(&load_once, load);
  int rank = fsdp_comm_rank(boot);
  const char *fail = NULL;
  char why[MSG_CAP];
  if (load_error[0]) {
    snprintf(why, sizeof why, "nccl backend: %s", load_error);
    fail = why;
  }
  nccl_comm *nc = fail ? NULL : calloc(1, sizeof *nc);
  if (!fail && !nc) fail = "nccl backend: out of memory";
  if (!fail) {
    nc->boot = boot;
    nc->rank = rank;
    nc->world = fsdp_comm_world(boot);
    nc->timeout = fsdp_comm_timeout(boot);
    pthread_mutex_init(&nc->mu, NULL);
    nc->gpu = fsdp_cuda_device();
    if (!fsdp_cuda_stream() ||
        cudaStreamCreateWithFlags(&nc->cs, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&nc->ready, cudaEventDisableTiming) != cudaSuccess) {
      snprintf(why, sizeof why, "nccl backend: GPU %d: %s", nc->gpu,
               cudaGetErrorString(cudaGetLastError()));
      fail = why;
    }
  }
  if (fail) {
    /* the peers are about to wait for this rank in the bootstrap: fail them too */
    char msg[MSG_CAP];
    snprintf(msg, sizeof msg, "%s", fail);
    fsdp_comm_abort(boot, msg);
    if (nc) destroy(nc);
    return fsdp_error("%s", msg);
  }
  uint8_t id[FSDP_NCCL_ID_BYTES];
  if (fsdp_nccl_share_id(boot, id, make_id, NULL) || init_rank(nc, id)) {
    char msg[MSG_CAP];
    snprintf(msg, sizeof msg, "%s", fsdp_error_msg());
    fsdp_comm_abort(boot, msg);
    destroy(nc);
    return fsdp_error("%s", msg);
  }
  if (pthread_create(&nc->dog, NULL, watchdog, nc) != 0) {
    fsdp_comm_abort(boot, "nccl backend: cannot start the watchdog thread");
    destroy(nc);
    return fsdp_error("nccl backend: cannot start the watchdog thread");
  }
  nc->dog_started = true;
  if (fsdp_comm_new_backend(out, &nccl_vt, nc, rank, nc->world) != FSDP_OK) {
    char msg[MSG_CAP];
    snprintf(msg, sizeof msg, "%s", fsdp_error_msg());
    fsdp_comm_abort(boot, msg);
    destroy(nc);
    return fsdp_error("%s", msg);
  }
  return FSDP_OK;
}
