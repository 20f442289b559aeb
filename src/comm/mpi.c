/*
 * mpi.c — the `mpi` backend (mpi.h) on Open MPI: one rank per process over MPI_COMM_WORLD.
 * docs/mpi.md describes the protocol, the progress strategy and what was measured.
 *
 * Native start/wait. The generic layer (comm.c) calls mpi_start when a collective is issued and
 * mpi_wait when its handle is waited; nothing runs on comm.c's worker thread. Collectives run one
 * at a time, in sequence order, from a queue (head = the running one). A collective is a small
 * state machine advanced by advance(): each call is one MPI_Testsome over its requests, then the
 * bookkeeping those completions allow (reducing a segment, posting the next receives, moving to
 * the next phase). advance() is driven by whichever thread has nothing better to do:
 *   - the caller inside mpi_wait (it spins: it is blocked anyway), or else
 *   - this communicator's progress thread, which polls with short sleeps while collectives are
 *     queued and nobody waits, so that a prefetched all-gather really moves while the caller
 *     computes (Open MPI 4.1 has no asynchronous progress of its own: "OMPI progress: no").
 * Every MPI call is made under g_mpi_mu, so MPI_THREAD_SERIALIZED is enough (requested with
 * MPI_Init_thread and checked); abort may send its message from any thread.
 *
 * A collective has two phases:
 *   arrive  every rank sends its fingerprint (mpi_hdr: sequence number, op, dtype, count,
 *           reduction, root, label, whether it asks for a label comparison) to every peer and
 *           receives theirs. This is the rendezvous (comm.h): when every header is in, every rank
 *           holds the same W fingerprints and reaches the same verdict (rank 0's against each
 *           other rank's, labels when any rank asks), so a mismatch fails everywhere with one
 *           message before a byte of data moves. It is also what names a missing rank on a
 *           timeout, and what a barrier is.
 *   data    all_gather  MPI_Iallgather (FSDP_MPI_ALLGATHER=p2p: one send and receive per peer)
 *           broadcast   MPI_Ibcast
 *           reduce_scatter  by hand (Open MPI's reduce_scatter is 3-5x slower here): every rank
 *                       sends chunk p of its input to rank p in segments, receives chunk r of
 *                       every peer's input into a window of staging segments, and reduces each
 *                       segment as soon as all of its pieces are in, in rank order 0..W-1 with
 *                       local.c's arithmetic (fsdp_comm_reduce, reduce.c, per dtype)
 *           all_reduce  the same reduce-scatter over local.c's chunks (multiples of 64 bytes),
 *                       then every rank sends its reduced chunk to every peer
 *           barrier     nothing (the arrival was the barrier)
 * So every output element has local.c's bits: mpi and local runs agree bit for bit, for every
 * dtype. Data moves as an MPI integer type of the dtype's size (MPI never does arithmetic
 * here), so counts on the wire are elements, as in fsdp_coll.
 *
 * Failure (comm.h): a poison is a message on its own tag, sent to every peer by the rank that
 * fails (fsdp_comm_abort, a timeout, an MPI error) and received through an always-posted
 * MPI_Irecv(ANY_SOURCE); the first one wins. A collective still arriving fails at once on a
 * poison. One whose peers have all arrived keeps going (its peers are moving its data) unless
 * no byte has moved for FSDP_MPI_POISON_GRACE seconds. Every wait is a poll, so it is timed:
 * the arrival by the timeout, the data phase by the timeout without progress. A timeout names
 * the ranks at fault: in the arrival, those missing (a probe asks the peers where they are); in
 * the data phase, those a pending receive waits for, else those a pending send waits for, or,
 * where the library collective cannot say, those that do not answer the same probe. A failed
 * collective may leave requests in flight, so a poisoned communicator's MPI communicators are
 * never used again (mpi_revive moves the group onto fresh duplicates) and MPI is not finalized (fsdp_mpi_finalize): the process exits nonzero and mpirun ends the job.
 * A rank whose communicator is freed tells its peers ("left after #N"); a peer waiting for it in
 * a later collective fails at once, as with the local backend.
 *
 * Tags: on `ctl` (a dup of MPI_COMM_WORLD) headers, poison and "left" messages; on `data`
 * (another dup) the data. Within a tag, MPI's non-overtaking order matches messages between two
 * ranks in posting order, and every rank posts in sequence order, so no tag carries a
 * sequence number.
 */
#include "comm/mpi.h"
#include "core/cond.h"

#include <mpi.h>

#include <errno.h>
#include <stdarg.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#define MPI_MSG_CAP FSDP_ERROR_CAP
#define TAG_HDR 1
#define TAG_POISON 2
#define TAG_LEFT 3
#define TAG_PROBE 4
#define TAG_PROBE_REPLY 5
#define TAG_RS 10
#define TAG_AG 11
/* elements per message at most (MPI counts are int) */
#define MAX_PIECE ((int64_t)1 << 28)
/* all_reduce chunk alignment in bytes: local.c's */
#define ALIGN_BYTES 64
#define NOT_LEFT UINT64_MAX
/* requests always posted: the poison, "left" and probe receives */
#define REQ_FIXED 3

/* ---- process-wide state ------------------------------------------------------------------- */

static pthread_mutex_t g_mpi_mu = PTHREAD_MUTEX_INITIALIZER;  /* every MPI call */
static pthread_mutex_t g_init_mu = PTHREAD_MUTEX_INITIALIZER; /* the fields below */
static bool g_we_initialized, g_finalized;
static int g_thread_level = -1;
static int g_live_comms;
static atomic_bool g_any_failed; /* a communicator of this process was poisoned */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_s(double s) {
  struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&ts, NULL);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static const char *level_name(int level) {
  switch (level) {
  case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
  case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
  case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
  case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  default: return "none";
  }
}

/* "MPI_Isend: MPI_ERR_TRUNCATE: message truncated" into buf */
static const char *mpi_err(char *buf, size_t n, const char *call, int err) {
  char s[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(err, s, &len) != MPI_SUCCESS) snprintf(s, sizeof s, "error %d", err);
  snprintf(buf, n, "%s: %s", call, s);
  return buf;
}

/* ---- tuning (environment, read when a communicator is made) --------------------------------- */

static int env_long(const char *name, long lo, long hi, long dflt, long *out) {
  *out = dflt;
  const char *s = getenv(name);
  if (!s || !*s) return FSDP_OK;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) {
    return fsdp_error("%s: expected a whole number in %ld..%ld, got '%s'", name, lo, hi, s);
  }
  *out = v;
  return FSDP_OK;
}

static int env_seconds(const char *name, double dflt, double *out) {
  *out = dflt;
  const char *s = getenv(name);
  if (!s || !*s) return FSDP_OK;
  char *end;
  double v = strtod(s, &end);
  if (end == s || *end || !(v >= 0) || !isfinite(v)) {
    return fsdp_error("%s: expected a number of seconds >= 0, got '%s'", name, s);
  }
  *out = v;
  return FSDP_OK;
}


/* ---- state ---------------------------------------------------------------------------------- */

/* A fingerprint on the wire (MPI_BYTE; every rank runs the same build). */
typedef struct mpi_hdr {
  uint64_t seq;
  int64_t count;
  int32_t op, dtype, red, root;
  char label[64];
} mpi_hdr;

typedef enum { OP_QUEUED = 0, OP_ARRIVE, OP_DATA, OP_DONE } op_state;

typedef struct mpi_op {
  fsdp_coll k;
  uint64_t seq;
  bool full_check;   /* this rank asks for the full fingerprint exchange */
  double timeout;
  op_state state;
  int rc;
  char *msg;         /* failure message (malloc'd) */
  double t_state;    /* when the arrival began */
  double t_progress; /* last completion in the data phase */
  bool done;         /* left the queue (guarded by mc->mu) */
  struct mpi_op *next;
} mpi_op;

typedef enum {
  RQ_POISON = 0, /* req[0]: the poison receive */
  RQ_LEFT,       /* req[1]: the "left" receive */
  RQ_PROBE,      /* req[2]: the probe receive (a peer timed out: where is this rank?) */
  RQ_HDR_RECV,
  RQ_PROBE_REPLY,
  RQ_PROBE_SEND,
  RQ_SEND,
  RQ_RECV,
  RQ_RECV_SEG, /* a reduce-scatter staging piece (slot) */
  RQ_LIB       /* a library collective (never cancelled: MPI forbids it) */
} rq_kind;

typedef struct rq_info {
  rq_kind kind;
  int peer;
  int slot;
  int64_t len; /* elements expected (receives) */
  bool aside;  /* not counted in mc->live: a probe in the data phase, which the data's
                * completion does not wait for */
} rq_info;

typedef enum { DP_NONE = 0, DP_RS, DP_AG } data_phase;

typedef struct mpi_comm {
  MPI_Comm data, ctl;
  int rank, world;
  int family_rank; /* the rank "rank R failed: ..." names: in MPI_COMM_WORLD */
  fsdp_comm *self;  /* the communicator over this one, once made (atomic: the progress thread) */
  /* tuning */
  int64_t seg_bytes; /* reduce-scatter segment */
  int window;       /* staging segments in flight */
  bool ag_p2p;      /* all_gather by hand instead of MPI_Iallgather */
  double poll_max;  /* the progress thread's longest sleep between polls, s */
  double grace;     /* data phase: how long a poison may wait for progress, s */

  /* the queue and its progress thread; everything below is guarded by mu */
  pthread_mutex_t mu;
  pthread_cond_t cv; /* progress thread: work queued, a waiter left, stop */
  mpi_op *head, *tail;
  atomic_int waiters;  /* callers inside mpi_wait (written under mu) */
  atomic_int nqueued;  /* collectives in the queue (written under mu) */
  atomic_bool stop;
  bool thread_started;
  bool deep; /* the progress thread sleeps until signalled */
  bool counted; /* in g_live_comms */
  pthread_t thread;

  /* requests: [0] poison, [1] left, [2] probe, [REQ_FIXED..nreq) the running collective's */
  MPI_Request *req;
  rq_info *info;
  int *idx;
  MPI_Status *st;
  int nreq, cap;
  int live; /* the running collective's requests not yet complete */

  /* arrival: the check vectors (comm.h) folded by MPI_Iallreduce(MAX); then, only when they
   * disagree or a rank asks for the full check, every header to every rank */
  uint64_t check_in[FSDP_CHECK_WORDS], check_out[FSDP_CHECK_WORDS];
  bool full_phase;   /* the headers are moving */
  bool probing;      /* the arrival (or the data phase) timed out: waiting for the peers'
                      * answers to a probe */
  double probe_end;  /* when to stop waiting for them */
  int probe_pending; /* answers still to come */
  uint64_t agreed;   /* the last collective every rank arrived at (its check completed) */
  uint64_t entered;  /* the last collective this rank began arriving at */
  uint64_t probe_in; /* a peer's probe (its sequence number) */
  uint64_t *probe_out; /* (world) our answer to each peer: `entered` when it asked */
  bool answered;       /* an answer was sent (MPI may read probe_out until the process ends) */
  bool revived;        /* mpi_revive: requests of the old MPI communicators may still point here */
  int nleft;           /* peers whose "left" message came */
  mpi_hdr my_hdr;
  mpi_hdr *hdrs;   /* (world) */
  bool *got;       /* (world) header of the running collective in */
  uint64_t *reached; /* (world) last sequence number each peer was seen entering */
  uint64_t *left_after; /* (world) NOT_LEFT, or the last collective of a rank that left */
  uint64_t left_in;
  uint64_t left_out; /* our own "left" message */
  uint64_t last_seq; /* last collective issued here (for our own "left" message) */

  /* data phase; counts in elements of the running collective's dtype */
  data_phase dphase;
  size_t esz;        /* its element size */
  MPI_Datatype mdt;  /* an MPI type of that size */
  int64_t seg;       /* reduce-scatter segment, elements */
  int64_t *lo, *hi; /* (world) chunk bounds (reduce-scatter part) */
  const char *in;
  char *out;
  char *stage; /* window x (world - 1) x seg_len elements */
  size_t stage_cap; /* bytes */
  int64_t seg_len, nseg, next_seg, segs_done;
  int64_t *slot_seg;            /* (window) the segment each staging slot receives */
  int *slot_pending;            /* (window) its pieces still to come */
  int *slot_req;                /* (window x (world - 1)) its requests' indices */
  const void **srcs;            /* (world) */

  /* poison: its own lock (abort may come from any thread, also inside advance) */
  pthread_mutex_t pmu;
  bool poisoned;
  char poison[MPI_MSG_CAP];
  char poison_in[MPI_MSG_CAP];
  char poison_out[MPI_MSG_CAP];
} mpi_comm;

/* ---- requests ------------------------------------------------------------------------------- */

static int req_reserve(mpi_comm *mc, int extra) {
  int need = mc->nreq + extra;
  if (need <= mc->cap) return FSDP_OK;
  int cap = mc->cap ? mc->cap : 16;
  while (cap < need) cap *= 2;
  MPI_Request *req = realloc(mc->req, (size_t)cap * sizeof *req);
  if (req) mc->req = req;
  rq_info *info = realloc(mc->info, (size_t)cap * sizeof *info);
  if (info) mc->info = info;
  int *idx = realloc(mc->idx, (size_t)cap * sizeof *idx);
  if (idx) mc->idx = idx;
  MPI_Status *st = realloc(mc->st, (size_t)cap * sizeof *st);
  if (st) mc->st = st;
  if (!req || !info || !idx || !st) return fsdp_error("mpi: out of memory for %d requests", cap);
  for (int i = mc->cap; i < cap; i++) mc->req[i] = MPI_REQUEST_NULL;
  mc->cap = cap;
  return FSDP_OK;
}

/* Post one nonblocking point-to-point call into request i (mc->nreq: a new one; else a
 * completed one reused). Caller holds mc->mu, not g_mpi_mu. Returns the MPI error code. */
static int post_at(mpi_comm *mc, int i, bool recv, rq_kind kind, void *buf, int64_t n,
                   MPI_Datatype dt, int peer, int tag, MPI_Comm comm, int slot, int64_t len) {
  pthread_mutex_lock(&g_mpi_mu);
  int err = recv ? MPI_Irecv(buf, (int)n, dt, peer, tag, comm, &mc->req[i])
                 : MPI_Isend(buf, (int)n, dt, peer, tag, comm, &mc->req[i]);
  pthread_mutex_unlock(&g_mpi_mu);
  if (err != MPI_SUCCESS) return err;
  mc->info[i] = (rq_info){.kind = kind, .peer = peer, .slot = slot, .len = len};
  if (i == mc->nreq) mc->nreq++;
  mc->live++;
  return MPI_SUCCESS;
}

/* Count the library collective just posted into request mc->nreq (room reserved with
 * req_reserve); it is never cancelled. */
static void track_lib(mpi_comm *mc) {
  mc->info[mc->nreq] = (rq_info){.kind = RQ_LIB, .peer = -1};
  mc->nreq++;
  mc->live++;
}

/* post_at a new request (room reserved with req_reserve). */
static int post(mpi_comm *mc, bool recv, rq_kind kind, void *buf, int64_t n, MPI_Datatype dt,
                int peer, int tag, MPI_Comm comm, int slot, int64_t len) {
  return post_at(mc, mc->nreq, recv, kind, buf, n, dt, peer, tag, comm, slot, len);
}

/* Give up the running collective's requests: cancel receives (so no late message lands in a
 * buffer the caller may free), free sends; library collectives cannot be cancelled and are left
 * to MPI (the communicator is poisoned: its MPI communicators are never used again). */
static void req_abandon(mpi_comm *mc) {
  pthread_mutex_lock(&g_mpi_mu);
  for (int i = REQ_FIXED; i < mc->nreq; i++) {
    if (mc->req[i] == MPI_REQUEST_NULL) continue;
    rq_kind k = mc->info[i].kind;
    if (k == RQ_LIB) continue;
    if (k == RQ_HDR_RECV || k == RQ_PROBE_REPLY || k == RQ_RECV || k == RQ_RECV_SEG)
      MPI_Cancel(&mc->req[i]);
    MPI_Request_free(&mc->req[i]);
  }
  pthread_mutex_unlock(&g_mpi_mu);
  for (int i = REQ_FIXED; i < mc->nreq; i++) mc->req[i] = MPI_REQUEST_NULL;
  mc->nreq = REQ_FIXED;
  mc->live = 0;
}

/* ---- poison --------------------------------------------------------------------------------- */

static bool is_poisoned(mpi_comm *mc, char *copy) {
  pthread_mutex_lock(&mc->pmu);
  bool p = mc->poisoned;
  if (p && copy) memcpy(copy, mc->poison, MPI_MSG_CAP);
  pthread_mutex_unlock(&mc->pmu);
  return p;
}

/* Poison this communicator with msg ("rank R failed: ..."); the first poison wins. With send,
 * tell every peer (their poison receive takes it), waiting at most a second for the sends to
 * leave: the caller is about to fail, and perhaps to exit. Takes neither mc->mu nor g_mpi_mu on
 * entry (it takes g_mpi_mu itself). */
static void poison_set(mpi_comm *mc, const char *msg, bool send) {
  pthread_mutex_lock(&mc->pmu);
  if (mc->poisoned) {
    pthread_mutex_unlock(&mc->pmu);
    return;
  }
  mc->poisoned = true;
  snprintf(mc->poison, sizeof mc->poison, "%s", msg);
  memcpy(mc->poison_out, mc->poison, sizeof mc->poison_out);
  pthread_mutex_unlock(&mc->pmu);
  atomic_store(&g_any_failed, true);
  if (!send || mc->world == 1) return;
  int n = mc->world - 1, k = 0;
  MPI_Request *reqs = calloc((size_t)n, sizeof *reqs);
  if (!reqs) return;
  int len = (int)strlen(mc->poison_out) + 1;
  pthread_mutex_lock(&g_mpi_mu);
  for (int p = 0; p < mc->world; p++) {
    if (p == mc->rank) continue;
    if (MPI_Isend(mc->poison_out, len, MPI_CHAR, p, TAG_POISON, mc->ctl, &reqs[k]) == MPI_SUCCESS)
      k++;
  }
  pthread_mutex_unlock(&g_mpi_mu);
  double t_end = now_s() + 1.0;
  for (;;) {
    int all = 0;
    pthread_mutex_lock(&g_mpi_mu);
    MPI_Testall(k, reqs, &all, MPI_STATUSES_IGNORE);
    pthread_mutex_unlock(&g_mpi_mu);
    if (all || now_s() > t_end) break;
    sleep_s(1e-4);
  }
  pthread_mutex_lock(&g_mpi_mu);
  for (int i = 0; i < k; i++)
    if (reqs[i] != MPI_REQUEST_NULL) MPI_Request_free(&reqs[i]);
  pthread_mutex_unlock(&g_mpi_mu);
  free(reqs);
}

/* Fail the running (or a queued) collective with msg, and poison the group with `poison`. */
static int op_fail_with(mpi_comm *mc, mpi_op *op, const char *msg, const char *poison,
                        bool send) {
  if (op->state == OP_ARRIVE || op->state == OP_DATA) req_abandon(mc);
  poison_set(mc, poison, send);
  op->rc = FSDP_ERR;
  op->msg = strdup(msg);
  op->state = OP_DONE;
  return FSDP_ERR;
}

/* Fail the running (or a queued) collective with a message: "<msg>" for it, and the group is
 * poisoned with "rank R failed: <msg>" (sent to the peers when send). */
static int op_fail(mpi_comm *mc, mpi_op *op, bool send, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int op_fail(mpi_comm *mc, mpi_op *op, bool send, const char *fmt, ...) {
  char msg[MPI_MSG_CAP];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  char full[MPI_MSG_CAP + 32];
  snprintf(full, sizeof full, "rank %d failed: %s", mc->family_rank, msg);
  return op_fail_with(mc, op, msg, full, send);
}

/* Fail a collective because the group is poisoned: its message is the poison itself. */
static int op_fail_poisoned(mpi_comm *mc, mpi_op *op, const char *poison) {
  if (op->state == OP_ARRIVE || op->state == OP_DATA) req_abandon(mc);
  op->rc = FSDP_ERR;
  op->msg = strdup(poison);
  op->state = OP_DONE;
  return FSDP_ERR;
}

static int op_fail_mpi(mpi_comm *mc, mpi_op *op, const char *call, int err) {
  char e[MPI_MAX_ERROR_STRING + 64];
  mpi_err(e, sizeof e, call, err);
  return op_fail(mc, op, true, "%s #%llu '%s': %s", fsdp_coll_name(op->k.op),
                 (unsigned long long)op->seq, op->k.label, e);
}

/* ---- arrival -------------------------------------------------------------------------------- */

static void hdr_to_coll(fsdp_coll *k, const mpi_hdr *h) {
  memset(k, 0, sizeof *k);
  k->op = (fsdp_coll_op)h->op;
  k->dtype = (fsdp_dtype)h->dtype;
  k->red = (fsdp_reduce_op)h->red;
  k->root = h->root;
  k->count = h->count;
  memcpy(k->label, h->label, sizeof k->label);
  k->label[sizeof k->label - 1] = '\0';
}

static int handle(mpi_comm *mc, mpi_op *op, int i, const MPI_Status *st, bool err_in_status);

/* A few progress rounds over the poison and "left" receives alone: a poison that has reached
 * this process (it may sit behind other messages in Open MPI's queues until something calls
 * into MPI) is seen before a collective begins or is declared arrived. */
static void drain_ctl(mpi_comm *mc) {
  for (int round = 0; round < 4 && !is_poisoned(mc, NULL); round++) {
    int outcount = 0;
    pthread_mutex_lock(&g_mpi_mu);
    int err = MPI_Testsome(REQ_FIXED, mc->req, &outcount, mc->idx, mc->st);
    pthread_mutex_unlock(&g_mpi_mu);
    if (outcount == MPI_UNDEFINED) break;
    for (int j = 0; j < outcount; j++)
      handle(mc, NULL, mc->idx[j], &mc->st[j], err == MPI_ERR_IN_STATUS);
  }
}

static int op_begin(mpi_comm *mc, mpi_op *op) {
  char poison[MPI_MSG_CAP];
  drain_ctl(mc);
  if (is_poisoned(mc, poison)) {
    return op_fail_poisoned(mc, op, poison);
  }
  op->state = OP_ARRIVE;
  op->t_state = now_s();
  mc->entered = op->seq;
  mc->full_phase = mc->probing = false;
  mpi_hdr *h = &mc->my_hdr;
  memset(h, 0, sizeof *h);
  h->seq = op->seq;
  h->count = op->k.count;
  h->op = (int32_t)op->k.op;
  h->dtype = (int32_t)op->k.dtype;
  h->red = (int32_t)op->k.red;
  h->root = op->k.root;
  memcpy(h->label, op->k.label, sizeof h->label);
  mc->hdrs[mc->rank] = *h;
  fsdp_coll_check_init(mc->check_in, &op->k, op->seq, op->full_check);
  mc->nreq = REQ_FIXED;
  mc->live = 0;
  if (mc->world == 1) {
    memcpy(mc->check_out, mc->check_in, sizeof mc->check_out);
    return FSDP_OK;
  }
  if (req_reserve(mc, 1) != FSDP_OK) return op_fail(mc, op, true, "%s", fsdp_error_msg());
  int i = mc->nreq;
  pthread_mutex_lock(&g_mpi_mu);
  int err = MPI_Iallreduce(mc->check_in, mc->check_out, FSDP_CHECK_WORDS, MPI_UINT64_T, MPI_MAX,
                           mc->ctl, &mc->req[i]);
  pthread_mutex_unlock(&g_mpi_mu);
  if (err != MPI_SUCCESS) return op_fail_mpi(mc, op, "MPI_Iallreduce (fingerprint check)", err);
  track_lib(mc);
  return FSDP_OK;
}

/* The check vectors disagree (or a rank asked for the full check): every rank sends its header
 * to every peer and receives theirs, so that verdict() can name the rank at fault. Every rank
 * read the same folded vector, so every rank comes here. */
static int full_begin(mpi_comm *mc, mpi_op *op) {
  mc->full_phase = true;
  for (int p = 0; p < mc->world; p++) mc->got[p] = p == mc->rank;
  mc->nreq = REQ_FIXED;
  mc->live = 0;
  if (req_reserve(mc, 2 * (mc->world - 1)) != FSDP_OK) {
    return op_fail(mc, op, true, "%s", fsdp_error_msg());
  }
  for (int k = 1; k < mc->world; k++) {
    int p = (mc->rank + k) % mc->world;
    int err = post(mc, true, RQ_HDR_RECV, &mc->hdrs[p], sizeof(mpi_hdr), MPI_BYTE, p, TAG_HDR,
                   mc->ctl, 0, 0);
    if (err == MPI_SUCCESS)
      err = post(mc, false, RQ_SEND, &mc->my_hdr, sizeof(mpi_hdr), MPI_BYTE, p, TAG_HDR, mc->ctl,
                 0, 0);
    if (err != MPI_SUCCESS) {
      return op_fail_mpi(mc, op, "MPI_Irecv/MPI_Isend (fingerprint)", err);
    }
  }
  return FSDP_OK;
}

/* The arrival timed out: ask every peer which collective it has reached (failure path only:
 * O(N) messages once). got[p]: p answered; reached[p]: its answer. A peer that is polling (it
 * waits in a collective, or its progress thread runs) answers at once; one that computes
 * outside collectives does not, and the collectives it completed speak for it. The data phase
 * of a library collective asks the same when it times out: every peer has arrived, so each
 * one still in the collective polls and answers, and one that does not answer is stopped,
 * hung, or gone (or finished the collective and computes outside collectives). There the
 * probe's requests are set aside from mc->live, so that data completing meanwhile still
 * completes the collective. */
static int probe_begin(mpi_comm *mc, mpi_op *op, double t) {
  mc->probing = true;
  mc->probe_pending = 0;
  /* long enough for a polling peer to answer on a loaded machine, short beside the timeout */
  double wait = op->timeout / 4;
  if (wait < 0.05) wait = 0.05;
  if (wait > 1.0) wait = 1.0;
  mc->probe_end = t + wait;
  for (int p = 0; p < mc->world; p++) mc->got[p] = p == mc->rank;
  if (req_reserve(mc, 2 * (mc->world - 1)) != FSDP_OK) {
    return op_fail(mc, op, true, "%s", fsdp_error_msg());
  }
  for (int k = 1; k < mc->world; k++) {
    int p = (mc->rank + k) % mc->world;
    int err = post(mc, true, RQ_PROBE_REPLY, &mc->reached[p], 1, MPI_UINT64_T, p,
                   TAG_PROBE_REPLY, mc->ctl, 0, 0);
    if (err == MPI_SUCCESS && op->state == OP_DATA) {
      mc->info[mc->nreq - 1].aside = true;
      mc->live--;
    }
    if (err == MPI_SUCCESS)
      err = post(mc, false, RQ_PROBE_SEND, &mc->entered, 1, MPI_UINT64_T, p, TAG_PROBE, mc->ctl,
                 0, 0);
    if (err == MPI_SUCCESS && op->state == OP_DATA) {
      mc->info[mc->nreq - 1].aside = true;
      mc->live--;
    }
    if (err != MPI_SUCCESS) return op_fail_mpi(mc, op, "MPI_Irecv/MPI_Isend (probe)", err);
    mc->probe_pending++;
  }
  return FSDP_OK;
}

/* "ranks 2, 3 have not arrived (sequence numbers they reached: rank 2 #11, rank 3 none)".
 * After a probe: a peer is missing when it did not answer or answered with an earlier
 * collective; one that did not answer has reached at least the last collective every rank
 * arrived at. In the full phase: a peer is missing when its header is not in. */
static bool peer_missing(const mpi_comm *mc, int p, uint64_t seq) {
  if (p == mc->rank) return false;
  if (mc->full_phase) return !mc->got[p];
  return !mc->got[p] || mc->reached[p] < seq;
}

/* fsdp_comm_peer_fn over the communicator's headers, for the collective `seq` */
typedef struct {
  const mpi_comm *mc;
  uint64_t seq;
} missing_ctx;

static bool mpi_peer(const void *ctx, int p, char *where, size_t n, bool *left) {
  const missing_ctx *m = ctx;
  const mpi_comm *mc = m->mc;
  if (!peer_missing(mc, p, m->seq)) return false;
  uint64_t r = mc->got[p] ? mc->reached[p] : mc->agreed;
  if (r == 0) snprintf(where, n, "none");
  else snprintf(where, n, "#%llu", (unsigned long long)r);
  *left = mc->left_after[p] != NOT_LEFT;
  return true;
}

static void describe_missing(const mpi_comm *mc, uint64_t seq, char *buf, size_t n) {
  if (fsdp_comm_describe_missing(buf, n, mc->world, mpi_peer, &(missing_ctx){mc, seq}) == 0)
    snprintf(buf, n, "every rank has arrived, but the fingerprint check has not completed");
}

/* After a data-phase probe: ": rank 1 does not answer" / ": ranks 1, 3 do not answer" (each
 * peer still in the collective polls, so it answers), or "; every rank answers". */
static void describe_silent(const mpi_comm *mc, char *buf, size_t n) {
  int count = 0;
  size_t at = 0;
  char list[128] = "";
  for (int p = 0; p < mc->world; p++) {
    if (p == mc->rank || mc->got[p]) continue;
    if (at < sizeof list)
      at += (size_t)snprintf(list + at, sizeof list - at, "%s%d", count ? ", " : "", p);
    count++;
  }
  if (count == 0) snprintf(buf, n, "; every rank answers");
  else snprintf(buf, n, ": rank%s %s do%s not answer", count > 1 ? "s" : "", list,
                count > 1 ? "" : "es");
}

/* Every header is in: the same verdict on every rank. false: the collective failed. */
static bool verdict(mpi_comm *mc, mpi_op *op) {
  fsdp_coll k0, kp;
  hdr_to_coll(&k0, &mc->hdrs[0]);
  for (int p = 1; p < mc->world; p++) {
    hdr_to_coll(&kp, &mc->hdrs[p]);
    if (fsdp_coll_matches(&k0, &kp) && mc->hdrs[p].seq == mc->hdrs[0].seq) continue;
    char a[160], b[160], msg[MPI_MSG_CAP];
    fsdp_coll_describe(a, sizeof a, &k0);
    fsdp_coll_describe(b, sizeof b, &kp);
    snprintf(msg, sizeof msg,
             "collective mismatch at #%llu: rank 0 called %s but rank %d called %s",
             (unsigned long long)op->seq, a, p, b);
    /* every rank sees the same headers and reaches this same message: nothing to send, and the
     * poison is the verdict itself, blaming no rank, so that every later collective fails with
     * the same message on every rank (as local.c's decide_locked) */
    op_fail_with(mc, op, msg, msg, false);
    return false;
  }
  return true;
}

/* ---- data ----------------------------------------------------------------------------------- */

static int peer_index(const mpi_comm *mc, int p) { return p < mc->rank ? p : p - 1; }

static char *stage_at(mpi_comm *mc, int slot, int p) {
  return mc->stage + ((size_t)slot * (size_t)(mc->world - 1) + (size_t)peer_index(mc, p)) *
                         (size_t)mc->seg_len * mc->esz;
}

/* element i of buf, in the running collective's dtype */
static char *elem(const mpi_comm *mc, const void *buf, int64_t i) {
  return (char *)buf + i * (int64_t)mc->esz;
}

/* An MPI type of the dtype's size: data is only moved, never reduced by MPI. */
static MPI_Datatype mpi_type_of_size(size_t esz) {
  switch (esz) {
  case 1: return MPI_UINT8_T;
  case 2: return MPI_UINT16_T;
  case 4: return MPI_UINT32_T;
  default: return MPI_UINT64_T;
  }
}

/* Post the receives of segment s into staging slot `slot`: new requests the first time, then
 * the slot's own (completed) requests again, so the request array stays window-sized. */
static int rs_post_segment(mpi_comm *mc, int64_t s, int slot, bool first) {
  int64_t m = mc->hi[mc->rank] - mc->lo[mc->rank];
  int64_t len = m - s * mc->seg_len < mc->seg_len ? m - s * mc->seg_len : mc->seg_len;
  mc->slot_seg[slot] = s;
  mc->slot_pending[slot] = mc->world - 1;
  for (int k = 1; k < mc->world; k++) {
    int p = (mc->rank + k) % mc->world;
    int *at = &mc->slot_req[(size_t)slot * (size_t)(mc->world - 1) + (size_t)peer_index(mc, p)];
    if (first) *at = mc->nreq;
    int err = post_at(mc, *at, true, RQ_RECV_SEG, stage_at(mc, slot, p), len, mc->mdt, p,
                      TAG_RS, mc->data, slot, len);
    if (err != MPI_SUCCESS) return err;
  }
  return MPI_SUCCESS;
}

/* The reduce-scatter part: rank p's chunk is [lo[p], hi[p]) of in; this rank's reduced chunk
 * goes to out. */
static int rs_begin(mpi_comm *mc, mpi_op *op) {
  const int W = mc->world, r = mc->rank;
  const char *what = fsdp_coll_name(op->k.op);
  unsigned long long seq = (unsigned long long)op->seq;
  int64_t m = mc->hi[r] - mc->lo[r];
  mc->dphase = DP_RS;
  mc->seg_len = m < mc->seg ? m : mc->seg;
  mc->nseg = mc->seg_len > 0 ? (m + mc->seg_len - 1) / mc->seg_len : 0;
  mc->next_seg = 0;
  mc->segs_done = 0;
  if (W == 1) { /* no peers: the reduction of one input (avg scales by 1) */
    mc->srcs[0] = elem(mc, mc->in, mc->lo[0]);
    fsdp_comm_reduce(mc->out, mc->srcs, 1, m, op->k.dtype, op->k.red);
    mc->segs_done = mc->nseg;
    return FSDP_OK;
  }
  int slots = mc->nseg < mc->window ? (int)mc->nseg : mc->window;
  int64_t sends = 0;
  for (int p = 0; p < W; p++) {
    int64_t mp = mc->hi[p] - mc->lo[p];
    if (p == r || mp == 0) continue;
    int64_t segp = mp < mc->seg ? mp : mc->seg;
    sends += (mp + segp - 1) / segp;
  }
  size_t need = (size_t)slots * (size_t)(W - 1) * (size_t)mc->seg_len * mc->esz;
  if (need > mc->stage_cap) {
    free(mc->stage);
    mc->stage = malloc(need);
    mc->stage_cap = mc->stage ? need : 0;
    if (!mc->stage) {
      return op_fail(mc, op, true, "%s #%llu '%s': out of memory for %zu staging bytes", what,
                     seq, op->k.label, need);
    }
  }
  if (sends > INT32_MAX / 4 || req_reserve(mc, (int)sends + slots * (W - 1)) != FSDP_OK) {
    return op_fail(mc, op, true, "%s #%llu '%s': out of memory for %lld requests", what, seq,
                   op->k.label, (long long)sends);
  }
  /* sends, starting with the next rank so the ranks do not all feed rank 0 first; each peer's
   * chunk is cut at that peer's segment length (the sizes of its receives) */
  for (int k = 1; k < W; k++) {
    int p = (r + k) % W;
    int64_t mp = mc->hi[p] - mc->lo[p];
    if (mp == 0) continue;
    int64_t segp = mp < mc->seg ? mp : mc->seg;
    for (int64_t o = 0; o < mp; o += segp) {
      int64_t len = mp - o < segp ? mp - o : segp;
      int err = post(mc, false, RQ_SEND, elem(mc, mc->in, mc->lo[p] + o), len, mc->mdt, p,
                     TAG_RS, mc->data, 0, 0);
      if (err != MPI_SUCCESS) return op_fail_mpi(mc, op, "MPI_Isend", err);
    }
  }
  for (int s = 0; s < slots; s++) {
    int err = rs_post_segment(mc, mc->next_seg++, s, true);
    if (err != MPI_SUCCESS) return op_fail_mpi(mc, op, "MPI_Irecv", err);
  }
  return FSDP_OK;
}

/* A staging slot is complete: reduce its segment, in rank order, and reuse the slot. */
static int rs_slot_done(mpi_comm *mc, mpi_op *op, int slot) {
  const int W = mc->world, r = mc->rank;
  int64_t s = mc->slot_seg[slot];
  int64_t m = mc->hi[r] - mc->lo[r];
  int64_t o = s * mc->seg_len;
  int64_t len = m - o < mc->seg_len ? m - o : mc->seg_len;
  for (int p = 0; p < W; p++)
    mc->srcs[p] = p == r ? elem(mc, mc->in, mc->lo[r] + o) : stage_at(mc, slot, p);
  fsdp_comm_reduce(elem(mc, mc->out, o), mc->srcs, W, len, op->k.dtype, op->k.red);
  mc->segs_done++;
  if (mc->next_seg < mc->nseg) {
    int err = rs_post_segment(mc, mc->next_seg++, slot, false);
    if (err != MPI_SUCCESS) return op_fail_mpi(mc, op, "MPI_Irecv", err);
  }
  return FSDP_OK;
}

/* all_reduce, second half: every rank sends its reduced chunk to every peer. */
static int ag_chunks_begin(mpi_comm *mc, mpi_op *op) {
  const int W = mc->world, r = mc->rank;
  mc->dphase = DP_AG;
  mc->nreq = REQ_FIXED;
  char *buf = op->k.recv;
  int64_t pieces = 0;
  for (int p = 0; p < W; p++) pieces += (mc->hi[p] - mc->lo[p] + MAX_PIECE - 1) / MAX_PIECE;
  if (req_reserve(mc, (int)(2 * pieces * W)) != FSDP_OK) {
    return op_fail(mc, op, true, "%s", fsdp_error_msg());
  }
  for (int k = 1; k < W; k++) {
    int p = (r + k) % W;
    for (int64_t o = mc->lo[p]; o < mc->hi[p]; o += MAX_PIECE) {
      int64_t len = mc->hi[p] - o < MAX_PIECE ? mc->hi[p] - o : MAX_PIECE;
      int err = post(mc, true, RQ_RECV, elem(mc, buf, o), len, mc->mdt, p, TAG_AG, mc->data, 0,
                     len);
      if (err != MPI_SUCCESS) return op_fail_mpi(mc, op, "MPI_Irecv", err);
    }
    for (int64_t o = mc->lo[r]; o < mc->hi[r]; o += MAX_PIECE) {
      int64_t len = mc->hi[r] - o < MAX_PIECE ? mc->hi[r] - o : MAX_PIECE;
      int err = post(mc, false, RQ_SEND, elem(mc, buf, o), len, mc->mdt, p, TAG_AG, mc->data, 0,
                     0);
      if (err != MPI_SUCCESS) return op_fail_mpi(mc, op, "MPI_Isend", err);
    }
  }
  return FSDP_OK;
}

static int data_begin(mpi_comm *mc, mpi_op *op) {
  const int W = mc->world, r = mc->rank;
  const fsdp_coll *k = &op->k;
  const int64_t n = k->count;
  op->state = OP_DATA;
  op->t_progress = now_s();
  mc->nreq = REQ_FIXED;
  mc->live = 0;
  mc->probing = false; /* the arrival's probe, if any, is over: every reply is in */
  mc->dphase = DP_NONE;
  mc->esz = fsdp_dtype_size(k->dtype);
  mc->mdt = mpi_type_of_size(mc->esz);
  mc->seg = mc->seg_bytes / (int64_t)mc->esz;
  if (k->op == FSDP_COLL_BARRIER || n == 0) return FSDP_OK; /* the same on every rank */
  switch (k->op) {
  case FSDP_COLL_ALL_GATHER: {
    bool in_place = k->send == elem(mc, k->recv, (int64_t)r * n);
    if (W == 1 || (!mc->ag_p2p && n <= MAX_PIECE)) {
      if (W == 1) {
        if (!in_place) memcpy(k->recv, k->send, (size_t)n * mc->esz);
        return FSDP_OK;
      }
      if (req_reserve(mc, 1) != FSDP_OK) return op_fail(mc, op, true, "%s", fsdp_error_msg());
      int i = mc->nreq;
      pthread_mutex_lock(&g_mpi_mu);
      int err = MPI_Iallgather(in_place ? MPI_IN_PLACE : k->send, (int)n, mc->mdt, k->recv,
                               (int)n, mc->mdt, mc->data, &mc->req[i]);
      pthread_mutex_unlock(&g_mpi_mu);
      if (err != MPI_SUCCESS) return op_fail_mpi(mc, op, "MPI_Iallgather", err);
      track_lib(mc);
      return FSDP_OK;
    }
    int64_t pieces = (n + MAX_PIECE - 1) / MAX_PIECE;
    if (req_reserve(mc, (int)(2 * pieces * (W - 1))) != FSDP_OK)
      return op_fail(mc, op, true, "%s", fsdp_error_msg());
    for (int j = 1; j < W; j++) {
      int p = (r + j) % W;
      for (int64_t o = 0; o < n; o += MAX_PIECE) {
        int64_t len = n - o < MAX_PIECE ? n - o : MAX_PIECE;
        int err = post(mc, true, RQ_RECV, elem(mc, k->recv, (int64_t)p * n + o), len, mc->mdt,
                       p, TAG_AG, mc->data, 0, len);
        if (err == MPI_SUCCESS)
          err = post(mc, false, RQ_SEND, elem(mc, k->send, o), len, mc->mdt, p, TAG_AG,
                     mc->data, 0, 0);
        if (err != MPI_SUCCESS) return op_fail_mpi(mc, op, "MPI_Irecv/MPI_Isend", err);
      }
    }
    if (!in_place) memcpy(elem(mc, k->recv, (int64_t)r * n), k->send, (size_t)n * mc->esz);
    return FSDP_OK;
  }
  case FSDP_COLL_BROADCAST: {
    if (W == 1) return FSDP_OK;
    int64_t pieces = (n + MAX_PIECE - 1) / MAX_PIECE;
    if (req_reserve(mc, (int)pieces) != FSDP_OK)
      return op_fail(mc, op, true, "%s", fsdp_error_msg());
    for (int64_t o = 0; o < n; o += MAX_PIECE) {
      int64_t len = n - o < MAX_PIECE ? n - o : MAX_PIECE;
      int i = mc->nreq;
      pthread_mutex_lock(&g_mpi_mu);
      int err = MPI_Ibcast(elem(mc, k->recv, o), (int)len, mc->mdt, k->root, mc->data,
                           &mc->req[i]);
      pthread_mutex_unlock(&g_mpi_mu);
      if (err != MPI_SUCCESS) return op_fail_mpi(mc, op, "MPI_Ibcast", err);
      track_lib(mc);
    }
    return FSDP_OK;
  }
  case FSDP_COLL_REDUCE_SCATTER:
    for (int p = 0; p < W; p++) {
      mc->lo[p] = (int64_t)p * n;
      mc->hi[p] = mc->lo[p] + n;
    }
    mc->in = k->send;
    mc->out = k->recv;
    rs_begin(mc, op);
    return FSDP_OK;
  case FSDP_COLL_ALL_REDUCE: {
    /* local.c's chunks: chunk p = [p * chunk, min(n, (p + 1) * chunk)), chunk a multiple of
     * 64 bytes */
    const int64_t align = ALIGN_BYTES / (int64_t)mc->esz;
    int64_t chunk = (n + W - 1) / W;
    chunk = (chunk + align - 1) / align * align;
    for (int p = 0; p < W; p++) {
      mc->lo[p] = (int64_t)p * chunk < n ? (int64_t)p * chunk : n;
      mc->hi[p] = mc->lo[p] + chunk < n ? mc->lo[p] + chunk : n;
    }
    mc->in = k->recv;
    mc->out = elem(mc, k->recv, mc->lo[r]);
    rs_begin(mc, op);
    return FSDP_OK;
  }
  default: return FSDP_OK;
  }
}

/* ---- advancing -------------------------------------------------------------------------------- */

static int handle(mpi_comm *mc, mpi_op *op, int i, const MPI_Status *st, bool err_in_status) {
  rq_info *in = &mc->info[i];
  if (in->kind == RQ_POISON) {
    char msg[MPI_MSG_CAP];
    memcpy(msg, mc->poison_in, sizeof msg);
    msg[sizeof msg - 1] = '\0';
    poison_set(mc, msg, false);
    /* the rest of the family (fsdp_comm_split) fails too, and tells its peers: a rank of
     * another group may be waiting for one that waits for the failed rank */
    fsdp_comm *self = __atomic_load_n(&mc->self, __ATOMIC_ACQUIRE);
    if (self) fsdp_comm_poison(self, msg);
    return FSDP_OK;
  }
  if (in->kind == RQ_LEFT) {
    int src = st->MPI_SOURCE;
    if (src >= 0 && src < mc->world && mc->left_after[src] == NOT_LEFT) {
      mc->left_after[src] = mc->left_in;
      mc->nleft++;
    }
    pthread_mutex_lock(&g_mpi_mu);
    MPI_Irecv(&mc->left_in, 1, MPI_UINT64_T, MPI_ANY_SOURCE, TAG_LEFT, mc->ctl, &mc->req[1]);
    pthread_mutex_unlock(&g_mpi_mu);
    return FSDP_OK;
  }
  if (in->kind == RQ_PROBE) {
    /* a peer timed out waiting: tell it which collective this rank has reached */
    int src = st->MPI_SOURCE;
    pthread_mutex_lock(&g_mpi_mu);
    if (src >= 0 && src < mc->world && src != mc->rank) {
      MPI_Request r;
      mc->probe_out[src] = mc->entered;
      if (MPI_Isend(&mc->probe_out[src], 1, MPI_UINT64_T, src, TAG_PROBE_REPLY, mc->ctl, &r) ==
          MPI_SUCCESS) {
        MPI_Request_free(&r);
        mc->answered = true;
      }
    }
    MPI_Irecv(&mc->probe_in, 1, MPI_UINT64_T, MPI_ANY_SOURCE, TAG_PROBE, mc->ctl, &mc->req[2]);
    pthread_mutex_unlock(&g_mpi_mu);
    return FSDP_OK;
  }
  if (!op || op->state == OP_DONE) return FSDP_OK;
  if (!in->aside) mc->live--;
  /* a probe's messages are no progress of the collective's data */
  if (in->kind != RQ_PROBE_REPLY && in->kind != RQ_PROBE_SEND) op->t_progress = now_s();
  if (err_in_status && st->MPI_ERROR != MPI_SUCCESS) {
    return op_fail_mpi(mc, op, in->kind == RQ_LIB ? "collective" : "point-to-point", st->MPI_ERROR);
  }
  switch (in->kind) {
  case RQ_HDR_RECV:
    mc->got[in->peer] = true;
    mc->reached[in->peer] = mc->hdrs[in->peer].seq;
    break;
  case RQ_PROBE_REPLY:
    mc->got[in->peer] = true;
    mc->probe_pending--;
    break;
  case RQ_RECV:
  case RQ_RECV_SEG: {
    int cnt = 0;
    MPI_Get_count(st, mc->mdt, &cnt);
    if (cnt != in->len) {
      return op_fail(mc, op, true,
                     "%s #%llu '%s': rank %d sent %d elements where %lld were expected",
                     fsdp_coll_name(op->k.op), (unsigned long long)op->seq, op->k.label,
                     in->peer, cnt, (long long)in->len);
    }
    if (in->kind == RQ_RECV_SEG && --mc->slot_pending[in->slot] == 0)
      rs_slot_done(mc, op, in->slot);
    break;
  }
  default: break;
  }
  return FSDP_OK;
}

/* The arrival is not complete: a peer that left before this collective, or the timeout (first
 * a probe of the peers, then the failure naming the missing ones). */
static int arrival_waits(mpi_comm *mc, mpi_op *op, double t) {
  for (int p = 0; mc->nleft && p < mc->world; p++) {
    if (mc->left_after[p] == NOT_LEFT || mc->left_after[p] >= op->seq) continue;
    if (mc->full_phase && mc->got[p]) continue;
    return op_fail(mc, op, true,
                   "rank %d left the group (its communicator was freed) after #%llu: %s "
                   "#%llu '%s' cannot complete",
                   p, (unsigned long long)mc->left_after[p], fsdp_coll_name(op->k.op),
                   (unsigned long long)op->seq, op->k.label);
  }
  if (t - op->t_state > op->timeout) {
    if (!mc->full_phase && !mc->probing) return probe_begin(mc, op, t);
    if (mc->probing && mc->probe_pending > 0 && t < mc->probe_end) return FSDP_OK;
    if (mc->probing) {
      bool any = false;
      for (int p = 0; p < mc->world; p++) any |= peer_missing(mc, p, op->seq);
      if (!any) {
        /* every peer says it is here: the check is slow, not stuck; another timeout */
        mc->probing = false;
        op->t_state = t;
        return FSDP_OK;
      }
    }
    char missing[MPI_MSG_CAP / 2];
    describe_missing(mc, op->seq, missing, sizeof missing);
    return op_fail(mc, op, true, "timeout after %g s in %s #%llu '%s': %s", op->timeout,
                   fsdp_coll_name(op->k.op), (unsigned long long)op->seq, op->k.label,
                   missing);
  }
  return FSDP_OK;
}

/* Append ", rank P" to the list in buf (at: its length) unless P is in it already. */
static size_t list_rank(char *buf, size_t n, size_t at, int p) {
  char r[32];
  snprintf(r, sizeof r, "rank %d", p);
  for (const char *s = buf; (s = strstr(s, r)) != NULL; s += strlen(r)) {
    char c = s[strlen(r)];
    if (c == '\0' || c == ',' || c == ' ') return at; /* (rank 1 is not rank 12) */
  }
  if (at >= n) return at;
  int k = snprintf(buf + at, n - at, "%s%s", at ? ", " : "", r);
  return k < 0 ? at : at + (size_t)k;
}

/* The data phase stalled: whom its pending requests wait for, into buf. Pending receives name
 * the ranks whose data has not come ("rank 2, rank 3"). With none, pending sends name the ranks
 * that have not taken this rank's data ("rank 1 to receive"): over shared memory with
 * single-copy transfers a receiver pulls the data out of the sender's posted send, so a rank
 * whose peer stopped may have every byte it needs and only its sends pending. false: a library
 * collective is pending, which names nobody (the caller probes). */
static bool data_waits_for(const mpi_comm *mc, char *buf, size_t n) {
  size_t recv_at = 0, send_at = 0;
  char sends[192] = "";
  buf[0] = '\0';
  for (int i = REQ_FIXED; i < mc->nreq; i++) {
    if (mc->req[i] == MPI_REQUEST_NULL || mc->info[i].aside) continue;
    switch (mc->info[i].kind) {
    case RQ_LIB: return false;
    case RQ_RECV:
    case RQ_RECV_SEG: recv_at = list_rank(buf, n, recv_at, mc->info[i].peer); break;
    case RQ_SEND: send_at = list_rank(sends, sizeof sends, send_at, mc->info[i].peer); break;
    default: break;
    }
  }
  if (recv_at == 0 && send_at > 0) snprintf(buf, n, "%s to receive", sends);
  else if (recv_at == 0) snprintf(buf, n, "a transfer it cannot name"); /* (live > 0: never) */
  return true;
}

/* After completions: phase changes, and the checks that end a collective that cannot
 * complete (a peer left, the group is poisoned, the timeout). */
static int op_check(mpi_comm *mc, mpi_op *op) {
  double t = now_s();
  char poison[MPI_MSG_CAP];
  if (op->state == OP_ARRIVE) {
    /* a poison that is already here wins over an arrival completed in the same round: the rank
     * that sent it may have given up on this collective */
    if (mc->live == 0) drain_ctl(mc);
    if (is_poisoned(mc, poison)) return op_fail_poisoned(mc, op, poison);
    if (mc->live == 0 && !mc->full_phase) {
      /* every rank has arrived; the folded check says whether their fingerprints agree */
      mc->agreed = op->seq;
      if (fsdp_coll_check_agrees(mc->check_out) && !mc->check_out[FSDP_CHECK_FULL])
        data_begin(mc, op);
      else
        full_begin(mc, op);
    } else if (mc->live == 0) {
      if (verdict(mc, op)) data_begin(mc, op);
    } else {
      return arrival_waits(mc, op, t);
    }
  }
  if (op->state != OP_DATA) return FSDP_OK;
  if (mc->live == 0 && mc->dphase == DP_RS && mc->segs_done < mc->nseg) {
    return op_fail(mc, op, true, "%s #%llu '%s': internal error: %lld of %lld segments reduced",
                   fsdp_coll_name(op->k.op), (unsigned long long)op->seq, op->k.label,
                   (long long)mc->segs_done, (long long)mc->nseg);
  }
  if (mc->live == 0 && mc->dphase == DP_RS && op->k.op == FSDP_COLL_ALL_REDUCE && mc->world > 1)
    ag_chunks_begin(mc, op);
  if (op->state != OP_DATA) return FSDP_OK;
  if (mc->live == 0) {
    if (mc->probing) req_abandon(mc); /* the probe's requests, set aside, still in flight */
    mc->nreq = REQ_FIXED;
    op->state = OP_DONE;
    op->rc = FSDP_OK;
    return FSDP_OK;
  }
  /* every rank arrived: the peers are moving this collective's data, so a poison waits for it
   * unless nothing moves (a peer that abandoned it) */
  if (is_poisoned(mc, poison) && t - op->t_progress > mc->grace)
    return op_fail_poisoned(mc, op, poison);
  if (t - op->t_progress > op->timeout) {
    char who[256] = "";
    if (!data_waits_for(mc, who, sizeof who)) {
      /* the library collective does not say whose data is missing: ask the peers, as the
       * arrival does, and name those that do not answer */
      if (!mc->probing) return probe_begin(mc, op, t);
      if (mc->probe_pending > 0 && t < mc->probe_end) return FSDP_OK;
      char silent[160];
      describe_silent(mc, silent, sizeof silent);
      snprintf(who, sizeof who, "the MPI collective%s", silent);
    }
    return op_fail(mc, op, true,
                   "timeout after %g s in %s #%llu '%s': every rank arrived, but no data has "
                   "moved for %g s (waiting for %s)",
                   op->timeout, fsdp_coll_name(op->k.op), (unsigned long long)op->seq,
                   op->k.label, op->timeout, who);
  }
  return FSDP_OK;
}

/* One round: begin the head collective if it is new, test every request once, act on what
 * completed. Caller holds mc->mu. Returns whether anything happened. */
static bool advance(mpi_comm *mc) {
  bool progressed = false;
  mpi_op *op = mc->head;
  if (op && op->state == OP_QUEUED) {
    op_begin(mc, op);
    progressed = true;
  }
  int outcount = 0;
  pthread_mutex_lock(&g_mpi_mu);
  int err = MPI_Testsome(mc->nreq, mc->req, &outcount, mc->idx, mc->st);
  pthread_mutex_unlock(&g_mpi_mu);
  if (outcount == MPI_UNDEFINED) outcount = 0;
  if (err != MPI_SUCCESS && err != MPI_ERR_IN_STATUS && op && op->state != OP_DONE) {
    op_fail_mpi(mc, op, "MPI_Testsome", err);
    outcount = 0;
  }
  for (int j = 0; j < outcount; j++) {
    handle(mc, op, mc->idx[j], &mc->st[j], err == MPI_ERR_IN_STATUS);
    progressed = true;
  }
  if (op && op->state != OP_DONE) op_check(mc, op);
  if (op && op->state == OP_DONE) {
    atomic_fetch_sub(&mc->nqueued, 1);
    mc->head = op->next;
    if (!mc->head) mc->tail = NULL;
    op->next = NULL;
    op->done = true;
    progressed = true;
    if (mc->head) op_begin(mc, mc->head); /* the next one's headers go out now */
    if (mc->head && mc->head->state == OP_DONE) progressed = true;
  }
  return progressed;
}

/* The progress thread's pause after a round where nothing happened, idle seconds after the last
 * progress: spin a few microseconds (a transfer in full swing completes requests back to back),
 * then sleep, longer the longer nothing happens: at most poll_max, or 20 x poll_max once nothing
 * has happened for 20 ms (a peer still computing: each poll costs the caller's compute a
 * little). */
static void pause_progress(double idle, double poll_max) {
  if (idle < 5e-6) {
    for (int i = 0; i < 32; i++) cpu_relax();
    return;
  }
  double s = idle / 4;
  double cap = idle < 2e-2 ? poll_max : 20 * poll_max;
  if (s > cap) s = cap;
  if (s < 2e-6) s = 2e-6;
  sleep_s(s);
}

/* A caller blocked in wait: it has nothing else to do, so it spins; after 2 ms without progress
 * it yields, after 50 ms it sleeps briefly (an oversubscribed machine needs the core for the
 * rank it is waiting for), after a second 1 ms at a time (a REPL's peers wait for a person). */
static void pause_waiter(double idle) {
  if (idle < 2e-3) {
    for (int i = 0; i < 16; i++) cpu_relax();
  } else if (idle < 5e-2) {
    sched_yield();
  } else if (idle < 1.0) {
    sleep_s(1e-4);
  } else {
    sleep_s(1e-3);
  }
}

/* Nothing for the progress thread to do (no collective queued, or a caller waits and drives
 * them): it naps NAP_S at a time without touching the lock (a nap that took mc->mu would fight
 * the waiter, which holds it while it polls, on the same core) and notices new work by itself,
 * so issuing a collective wakes nobody. After DEEP_S without work it sleeps on mc->cv until
 * signalled (mc->deep: mpi_start signals then). */
#define NAP_S 1e-3
#define DEEP_S 0.1

/* Work for the progress thread: a collective queued and nobody waiting (read without the
 * lock; the thread takes it before acting). */
static bool progress_wanted(mpi_comm *mc) {
  return atomic_load(&mc->nqueued) > 0 && atomic_load(&mc->waiters) == 0;
}

static void *progress_main(void *arg) {
  mpi_comm *mc = arg;
  prctl(PR_SET_TIMERSLACK, 1000UL); /* 1 us: the short sleeps mean what they say */
  double idle_since = now_s(), last_work = idle_since;
  while (!atomic_load(&mc->stop)) {
    if (!progress_wanted(mc)) {
      double t = now_s();
      if (atomic_load(&mc->nqueued) > 0) last_work = t; /* a waiter drives it */
      if (t - last_work > DEEP_S) {
        pthread_mutex_lock(&mc->mu);
        mc->deep = true;
        while (!atomic_load(&mc->stop) && !progress_wanted(mc)) pthread_cond_wait(&mc->cv, &mc->mu);
        mc->deep = false;
        pthread_mutex_unlock(&mc->mu);
        last_work = now_s();
      } else {
        sleep_s(NAP_S);
      }
      idle_since = now_s();
      continue;
    }
    pthread_mutex_lock(&mc->mu);
    bool p = mc->head && mc->waiters == 0 && advance(mc);
    pthread_mutex_unlock(&mc->mu);
    double t = now_s();
    last_work = t;
    if (p) idle_since = t;
    else pause_progress(t - idle_since, mc->poll_max);
  }
  return NULL;
}

/* ---- the vtable ------------------------------------------------------------------------------- */

static int mpi_start(fsdp_comm *c, const fsdp_coll *coll, uint64_t seq, void **native) {
  mpi_comm *mc = fsdp_comm_impl(c);
  *native = NULL;
  mpi_op *op = calloc(1, sizeof *op);
  if (!op) {
    char msg[160];
    snprintf(msg, sizeof msg, "%s #%llu '%s': out of memory", fsdp_coll_name(coll->op),
             (unsigned long long)seq, coll->label);
    char full[200];
    snprintf(full, sizeof full, "rank %d failed: %s", mc->family_rank, msg);
    poison_set(mc, full, true); /* the peers would wait for it */
    return fsdp_error("%s", msg);
  }
  op->k = *coll;
  op->seq = seq;
  op->full_check = fsdp_comm_full_check(c);
  op->timeout = fsdp_comm_timeout(c);
  pthread_mutex_lock(&mc->mu);
  mc->last_seq = seq;
  atomic_fetch_add(&mc->nqueued, 1);
  if (mc->tail) mc->tail->next = op;
  else mc->head = op;
  mc->tail = op;
  if (mc->head == op) advance(mc); /* post its headers now */
  if (mc->deep) pthread_cond_signal(&mc->cv); /* (a napping thread finds it by itself) */
  pthread_mutex_unlock(&mc->mu);
  *native = op;
  return FSDP_OK;
}

static int mpi_wait(fsdp_comm *c, void *native) {
  mpi_comm *mc = fsdp_comm_impl(c);
  mpi_op *op = native;
  pthread_mutex_lock(&mc->mu);
  mc->waiters++;
  double idle_since = now_s();
  while (!op->done) {
    bool p = advance(mc);
    if (op->done) break;
    pthread_mutex_unlock(&mc->mu);
    double t = now_s();
    if (p) idle_since = t;
    else pause_waiter(t - idle_since);
    pthread_mutex_lock(&mc->mu);
  }
  mc->waiters--;
  if (mc->head && mc->waiters == 0 && mc->deep) pthread_cond_signal(&mc->cv);
  pthread_mutex_unlock(&mc->mu);
  int rc = op->rc;
  if (rc != FSDP_OK) {
    fsdp_error("%s", op->msg ? op->msg : "collective failed (out of memory for its message)");
  }
  free(op->msg);
  free(op);
  return rc;
}

static int mpi_run(fsdp_comm *c, const fsdp_coll *coll, uint64_t seq) {
  void *native;
  if (mpi_start(c, coll, seq, &native) != FSDP_OK) return FSDP_ERR;
  return mpi_wait(c, native);
}

static void mpi_abort(fsdp_comm *c, const char *msg) {
  poison_set(fsdp_comm_impl(c), msg, true);
}

static bool mpi_poisoned(const fsdp_comm *c) {
  mpi_comm *mc = fsdp_comm_impl(c);
  /* nobody polls between collectives: look at the poison receive now (if nobody else is) */
  if (pthread_mutex_trylock(&mc->mu) == 0) {
    if (!mc->head) advance(mc);
    pthread_mutex_unlock(&mc->mu);
  }
  return is_poisoned(mc, NULL);
}

/* The three receives always posted on ctl (poison, "left", probe). Caller holds g_mpi_mu. */
static int post_fixed(mpi_comm *mc) {
  int err = MPI_Irecv(mc->poison_in, MPI_MSG_CAP, MPI_CHAR, MPI_ANY_SOURCE, TAG_POISON, mc->ctl,
                      &mc->req[0]);
  if (err == MPI_SUCCESS)
    err = MPI_Irecv(&mc->left_in, 1, MPI_UINT64_T, MPI_ANY_SOURCE, TAG_LEFT, mc->ctl,
                    &mc->req[1]);
  if (err == MPI_SUCCESS)
    err = MPI_Irecv(&mc->probe_in, 1, MPI_UINT64_T, MPI_ANY_SOURCE, TAG_PROBE, mc->ctl,
                    &mc->req[2]);
  return err;
}

/* fsdp_comm_revive: every rank calls it at once, its collectives failed and waited for. The old
 * MPI communicators may still hold requests of the failed collective (library ones cannot be
 * cancelled) and peers' poison messages, so they are left alone (never freed, as in mc_destroy)
 * and the group goes on over fresh duplicates of MPI_COMM_WORLD (MPI_Comm_dup is collective:
 * hence "at once"). */
static int mpi_revive(fsdp_comm *c, uint64_t seq) {
  mpi_comm *mc = fsdp_comm_impl(c);
  pthread_mutex_lock(&mc->mu);
  /* collectives started and never waited (a prefetch) fail on the poison, the running one at
   * the latest after the poison grace */
  while (mc->head && is_poisoned(mc, NULL)) advance(mc);
  if (mc->head) {
    pthread_mutex_unlock(&mc->mu);
    return fsdp_error("mpi: cannot revive the communicator while collectives are queued");
  }
  MPI_Comm data = MPI_COMM_NULL, ctl = MPI_COMM_NULL;
  pthread_mutex_lock(&g_mpi_mu);
  for (int i = 0; i < REQ_FIXED; i++) {
    if (mc->req[i] == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&mc->req[i]);
    MPI_Wait(&mc->req[i], MPI_STATUS_IGNORE);
  }
  int err = MPI_Comm_dup(MPI_COMM_WORLD, &data);
  if (err == MPI_SUCCESS) {
    err = MPI_Comm_dup(MPI_COMM_WORLD, &ctl);
    if (err != MPI_SUCCESS) MPI_Comm_free(&data); /* the first duplicate, never used */
  }
  if (err == MPI_SUCCESS) {
    MPI_Comm_set_errhandler(data, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(ctl, MPI_ERRORS_RETURN);
    mc->data = data;
    mc->ctl = ctl;
    err = post_fixed(mc);
  }
  pthread_mutex_unlock(&g_mpi_mu);
  mc->revived = true;
  if (err != MPI_SUCCESS) {
    pthread_mutex_unlock(&mc->mu);
    char e[MPI_MAX_ERROR_STRING + 32];
    return fsdp_error("mpi: cannot revive the communicator: %s",
                      mpi_err(e, sizeof e, "MPI_Comm_dup", err));
  }
  mc->nreq = REQ_FIXED;
  mc->live = 0;
  mc->dphase = DP_NONE;
  mc->full_phase = mc->probing = false;
  mc->agreed = mc->entered = mc->last_seq = seq;
  for (int p = 0; p < mc->world; p++) {
    mc->reached[p] = seq;
    mc->got[p] = false;
    mc->left_after[p] = NOT_LEFT;
  }
  mc->nleft = 0;
  pthread_mutex_lock(&mc->pmu);
  mc->poisoned = false;
  mc->poison[0] = '\0';
  pthread_mutex_unlock(&mc->pmu);
  pthread_mutex_unlock(&mc->mu);
  return FSDP_OK;
}

/* Stop the progress thread, say goodbye (tell_peers), release the receives and the memory.
 * Memory MPI may still write or read is never freed: after a failure (the poison and "left"
 * receives stay posted, abandoned requests may point at staging buffers) or when the goodbye
 * could not be sent within a second, the state is left allocated; the process is failing or
 * ending anyway. */
static void mc_destroy(mpi_comm *mc, bool tell_peers) {
  pthread_mutex_lock(&mc->mu);
  mc->stop = true;
  pthread_cond_broadcast(&mc->cv);
  pthread_mutex_unlock(&mc->mu);
  if (mc->thread_started) pthread_join(mc->thread, NULL);
  /* an answer to a probe may still be reading probe_out */
  bool leak = is_poisoned(mc, NULL) || mc->answered || mc->revived;
  /* comm.c waited for every collective, so nothing of ours is in flight. Tell the peers we left
   * (a peer waiting for us in a later collective fails at once). */
  if (tell_peers && !leak && mc->world > 1) {
    mc->left_out = mc->last_seq;
    int n = mc->world - 1, k = 0;
    MPI_Request *reqs = calloc((size_t)n, sizeof *reqs);
    if (reqs) {
      pthread_mutex_lock(&g_mpi_mu);
      for (int p = 0; p < mc->world; p++) {
        if (p != mc->rank && MPI_Isend(&mc->left_out, 1, MPI_UINT64_T, p, TAG_LEFT, mc->ctl,
                                       &reqs[k]) == MPI_SUCCESS)
          k++;
      }
      pthread_mutex_unlock(&g_mpi_mu);
      double t_end = now_s() + 1.0;
      int all = 0;
      for (;;) {
        pthread_mutex_lock(&g_mpi_mu);
        MPI_Testall(k, reqs, &all, MPI_STATUSES_IGNORE);
        pthread_mutex_unlock(&g_mpi_mu);
        if (all || now_s() > t_end) break;
        sleep_s(1e-4);
      }
      if (!all) {
        leak = true; /* the sends still read mc->left_out */
        pthread_mutex_lock(&g_mpi_mu);
        for (int i = 0; i < k; i++)
          if (reqs[i] != MPI_REQUEST_NULL) MPI_Request_free(&reqs[i]);
        pthread_mutex_unlock(&g_mpi_mu);
      }
      free(reqs);
    }
  }
  if (!is_poisoned(mc, NULL)) {
    /* The poison and left receives are cancelled. The communicators themselves are not freed:
     * a peer's "left" message may still be on its way, and a freed context id could be reused
     * by a later communicator that would then receive it. MPI_Finalize reclaims them. */
    pthread_mutex_lock(&g_mpi_mu);
    for (int i = 0; i < REQ_FIXED && i < mc->cap; i++) {
      if (mc->req[i] == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&mc->req[i]);
      MPI_Wait(&mc->req[i], MPI_STATUS_IGNORE);
    }
    pthread_mutex_unlock(&g_mpi_mu);
  }
  if (mc->counted) {
    pthread_mutex_lock(&g_init_mu);
    g_live_comms--;
    pthread_mutex_unlock(&g_init_mu);
  }
  if (leak) return;
  free(mc->req);
  free(mc->info);
  free(mc->idx);
  free(mc->st);
  free(mc->hdrs);
  free(mc->got);
  free(mc->reached);
  free(mc->probe_out);
  free(mc->left_after);
  free(mc->lo);
  free(mc->hi);
  free(mc->stage);
  free(mc->slot_seg);
  free(mc->slot_pending);
  free(mc->slot_req);
  free(mc->srcs);
  pthread_cond_destroy(&mc->cv);
  pthread_mutex_destroy(&mc->mu);
  pthread_mutex_destroy(&mc->pmu);
  free(mc);
}

static void mpi_free(fsdp_comm *c) { mc_destroy(fsdp_comm_impl(c), true); }

static int mpi_split(fsdp_comm *c, const fsdp_split *sp, fsdp_comm **out);

static const fsdp_comm_i mpi_vt = {
    .name = "mpi",
    .run = mpi_run,
    .host_buffers = true,
    .abort = mpi_abort,
    .free = mpi_free,
    .start = mpi_start,
    .wait = mpi_wait,
    .poisoned = mpi_poisoned,
    .revive = mpi_revive,
    .split = mpi_split,
};

/* ---- creation ------------------------------------------------------------------------------- */

static void finalize_at_exit(void) { fsdp_mpi_finalize(); }

/* MPI_Init_thread once per process (unless the host did), and the thread level check. */
static int mpi_init_once(void) {
  pthread_mutex_lock(&g_init_mu);
  int inited = 0, fin = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&fin);
  if (fin) {
    pthread_mutex_unlock(&g_init_mu);
    return fsdp_error("mpi backend: MPI is already finalized in this process (it cannot be "
                      "initialized twice)");
  }
  if (!inited) {
    const char *want_s = getenv("FSDP_MPI_THREAD");
    int want = MPI_THREAD_SERIALIZED;
    if (want_s && *want_s) {
      if (strcmp(want_s, "multiple") == 0) {
        want = MPI_THREAD_MULTIPLE;
      } else if (strcmp(want_s, "serialized") != 0) {
        pthread_mutex_unlock(&g_init_mu);
        return fsdp_error("FSDP_MPI_THREAD: expected 'serialized' or 'multiple', got '%s'",
                          want_s);
      }
    }
    int got = MPI_THREAD_SINGLE;
    if (MPI_Init_thread(NULL, NULL, want, &got) != MPI_SUCCESS) {
      pthread_mutex_unlock(&g_init_mu);
      return fsdp_error("mpi backend: MPI_Init_thread failed");
    }
    g_we_initialized = true;
    g_thread_level = got;
    atexit(finalize_at_exit);
  } else {
    MPI_Query_thread(&g_thread_level);
  }
  int level = g_thread_level;
  bool ours = g_we_initialized;
  pthread_mutex_unlock(&g_init_mu);
  if (level < MPI_THREAD_SERIALIZED) {
    return fsdp_error("mpi backend: MPI provides %s, but the backend calls MPI from its progress "
                      "thread and needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE (%s)",
                      level_name(level),
                      ours ? "this MPI library was built without thread support"
                           : "initialize MPI with MPI_Init_thread(..., MPI_THREAD_SERIALIZED, ...)");
  }
  return FSDP_OK;
}

/* A communicator over the MPI communicators data and ctl (made by the caller, ours from here,
 * under g_mpi_mu; MPI_COMM_NULL when making them failed: err says why). */
static int mpi_build(fsdp_comm **out, MPI_Comm data, MPI_Comm ctl, int err, int family_rank);

int fsdp_comm_mpi_new(fsdp_comm **out) {
  *out = NULL;
  if (mpi_init_once() != FSDP_OK) return FSDP_ERR;
  MPI_Comm data = MPI_COMM_NULL, ctl = MPI_COMM_NULL;
  pthread_mutex_lock(&g_mpi_mu);
  int err = MPI_Comm_dup(MPI_COMM_WORLD, &data);
  if (err == MPI_SUCCESS) err = MPI_Comm_dup(MPI_COMM_WORLD, &ctl);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  pthread_mutex_unlock(&g_mpi_mu);
  return mpi_build(out, data, ctl, err, rank);
}

/* fsdp_comm_split: MPI_Comm_split of both MPI communicators, ranked as the generic layer
 * decided (every rank of c is here at once: it has just left the exchange). */
static int mpi_split(fsdp_comm *c, const fsdp_split *sp, fsdp_comm **out) {
  mpi_comm *mc = fsdp_comm_impl(c);
  MPI_Comm data = MPI_COMM_NULL, ctl = MPI_COMM_NULL;
  pthread_mutex_lock(&g_mpi_mu);
  int err = MPI_Comm_split(mc->data, sp->color, sp->rank, &data);
  if (err == MPI_SUCCESS) err = MPI_Comm_split(mc->ctl, sp->color, sp->rank, &ctl);
  pthread_mutex_unlock(&g_mpi_mu);
  return mpi_build(out, data, ctl, err, mc->family_rank);
}

static int mpi_build(fsdp_comm **out, MPI_Comm data, MPI_Comm ctl, int err, int family_rank) {
  *out = NULL;
  long seg_kib, window, poll_us;
  double grace;
  if (env_long("FSDP_MPI_SEGMENT_KIB", 4, 1 << 20, 1024, &seg_kib) != FSDP_OK ||
      env_long("FSDP_MPI_WINDOW", 1, 64, 4, &window) != FSDP_OK ||
      env_long("FSDP_MPI_POLL_US", 1, 1000000, 50, &poll_us) != FSDP_OK ||
      env_seconds("FSDP_MPI_POISON_GRACE", 0.5, &grace) != FSDP_OK)
    return FSDP_ERR;
  const char *ag = getenv("FSDP_MPI_ALLGATHER");
  if (ag && *ag && strcmp(ag, "p2p") != 0 && strcmp(ag, "mpi") != 0)
    return fsdp_error("FSDP_MPI_ALLGATHER: expected 'mpi' or 'p2p', got '%s'", ag);

  mpi_comm *mc = calloc(1, sizeof *mc);
  if (!mc) return fsdp_error("mpi communicator: out of memory");
  mc->seg_bytes = (int64_t)seg_kib * 1024;
  mc->window = (int)window;
  mc->ag_p2p = ag && strcmp(ag, "p2p") == 0;
  mc->poll_max = (double)poll_us * 1e-6;
  mc->grace = grace;
  pthread_mutex_init(&mc->mu, NULL);
  pthread_mutex_init(&mc->pmu, NULL);
  fsdp_cond_init_monotonic(&mc->cv);

  mc->family_rank = family_rank;
  mc->data = data;
  mc->ctl = ctl;
  pthread_mutex_lock(&g_mpi_mu);
  if (err == MPI_SUCCESS) {
    MPI_Comm_set_errhandler(mc->data, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(mc->ctl, MPI_ERRORS_RETURN);
    MPI_Comm_rank(mc->ctl, &mc->rank);
    MPI_Comm_size(mc->ctl, &mc->world);
  }
  pthread_mutex_unlock(&g_mpi_mu);
  if (err != MPI_SUCCESS) {
    char e[MPI_MAX_ERROR_STRING + 32];
    free(mc);
    return fsdp_error("mpi communicator: %s", mpi_err(e, sizeof e, "MPI_Comm_dup/split", err));
  }
  const size_t W = (size_t)mc->world;
  mc->hdrs = calloc(W, sizeof *mc->hdrs);
  mc->got = calloc(W, sizeof *mc->got);
  mc->reached = calloc(W, sizeof *mc->reached);
  mc->probe_out = calloc(W, sizeof *mc->probe_out);
  mc->left_after = calloc(W, sizeof *mc->left_after);
  mc->lo = calloc(W, sizeof *mc->lo);
  mc->hi = calloc(W, sizeof *mc->hi);
  mc->srcs = calloc(W, sizeof *mc->srcs);
  mc->slot_seg = calloc((size_t)mc->window, sizeof *mc->slot_seg);
  mc->slot_pending = calloc((size_t)mc->window, sizeof *mc->slot_pending);
  mc->slot_req = calloc((size_t)mc->window * (W > 1 ? W - 1 : 1), sizeof *mc->slot_req);
  bool ok = mc->hdrs && mc->got && mc->reached && mc->probe_out && mc->left_after && mc->lo && mc->hi &&
            mc->srcs && mc->slot_seg && mc->slot_pending && mc->slot_req && req_reserve(mc, REQ_FIXED) == FSDP_OK;
  if (ok) {
    for (size_t p = 0; p < W; p++) mc->left_after[p] = NOT_LEFT;
    mc->nreq = REQ_FIXED;
    mc->info[0] = (rq_info){.kind = RQ_POISON, .peer = -1};
    mc->info[1] = (rq_info){.kind = RQ_LEFT, .peer = -1};
    mc->info[2] = (rq_info){.kind = RQ_PROBE, .peer = -1};
    pthread_mutex_lock(&g_mpi_mu);
    err = post_fixed(mc);
    pthread_mutex_unlock(&g_mpi_mu);
    ok = err == MPI_SUCCESS;
  }
  if (ok) {
    pthread_mutex_lock(&g_init_mu);
    g_live_comms++;
    pthread_mutex_unlock(&g_init_mu);
    mc->counted = true;
    ok = pthread_create(&mc->thread, NULL, progress_main, mc) == 0;
    mc->thread_started = ok;
    if (!ok) fsdp_error("mpi communicator: cannot start its progress thread");
  } else {
    fsdp_error("mpi communicator: out of memory");
  }
  if (ok && fsdp_comm_new_backend(out, &mpi_vt, mc, mc->rank, mc->world) == FSDP_OK) {
    __atomic_store_n(&mc->self, *out, __ATOMIC_RELEASE);
    return FSDP_OK;
  }
  /* failed: keep the message, undo what was made */
  char msg[MPI_MSG_CAP];
  snprintf(msg, sizeof msg, "%s", fsdp_error_msg());
  mc_destroy(mc, false);
  return fsdp_error("%s", msg);
}

bool fsdp_mpi_available(void) { return true; }

const char *fsdp_mpi_thread_level(void) {
  pthread_mutex_lock(&g_init_mu);
  int level = g_thread_level;
  pthread_mutex_unlock(&g_init_mu);
  switch (level) {
  case MPI_THREAD_SINGLE: return "single";
  case MPI_THREAD_FUNNELED: return "funneled";
  case MPI_THREAD_SERIALIZED: return "serialized";
  case MPI_THREAD_MULTIPLE: return "multiple";
  default: return "none";
  }
}

const char *fsdp_mpi_finalize_blocked(void) {
  static char why[64];
  const char *r = NULL;
  pthread_mutex_lock(&g_init_mu);
  int fin = 0;
  if (g_we_initialized && !g_finalized) MPI_Finalized(&fin); /* (the host may have) */
  if (g_we_initialized && !g_finalized && !fin) {
    if (atomic_load(&g_any_failed)) {
      r = "a communicator of this process failed, and collectives may be in flight";
    } else if (g_live_comms > 0) {
      snprintf(why, sizeof why, "%d communicator%s still open", g_live_comms,
               g_live_comms > 1 ? "s are" : " is");
      r = why;
    }
  }
  pthread_mutex_unlock(&g_init_mu);
  return r;
}

bool fsdp_mpi_finalize(void) {
  pthread_mutex_lock(&g_init_mu);
  int fin = 0;
  if (g_we_initialized && !g_finalized) MPI_Finalized(&fin); /* (the host may have) */
  if (fin) g_finalized = true;
  bool go = g_we_initialized && !g_finalized && g_live_comms == 0 &&
            !atomic_load(&g_any_failed);
  if (go) {
    MPI_Finalize();
    g_finalized = true;
  }
  pthread_mutex_unlock(&g_init_mu);
  return go;
}
