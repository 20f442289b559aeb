/*
 * comm.h — the communicator: collectives between ranks behind one interface (a vtable per
 * backend), with asynchronous handles, collective failure (poison + timeout), fingerprints,
 * a flight recorder and traffic counters.
 *
 * Layering: src/comm calls only src/core. Everything above (fsdp/, lua/, cli/) talks to an
 * fsdp_comm through the functions below and never knows which backend runs.
 *
 * Ordering: every collective a rank issues (blocking or asynchronous) takes the next sequence
 * number of that rank's communicator and completes in sequence order. Ranks must issue the
 * same collectives in the same order (SPMD); when they do not, the fingerprint check turns it
 * into an error naming both sides instead of a hang or a corruption.
 *
 * Failure (DESIGN.md invariant 3): fsdp_comm_abort(c, msg) poisons the whole group. Every rank
 * blocked in a collective, or entering one later, fails within the timeout with
 * "rank R failed: <msg>". A collective that waits longer than the timeout (default 60 s,
 * FSDP_TIMEOUT seconds in the environment, or fsdp_comm_set_timeout) fails with an error naming
 * the collective, its label and the ranks that have not arrived, then poisons the group so
 * the others fail too. On any failure the rank's flight recorder is appended to the message.
 *
 * Buffers: counts are in elements (f32). A buffer passed to an asynchronous collective must
 * stay valid and untouched until fsdp_comm_wait returns.
 */
#ifndef FSDP_COMM_H
#define FSDP_COMM_H

#include <stdbool.h>
#include <stdint.h>

#include "core/core.h"

typedef enum {
  FSDP_COLL_ALL_GATHER = 0,
  FSDP_COLL_REDUCE_SCATTER,
  FSDP_COLL_ALL_REDUCE,
  FSDP_COLL_BROADCAST,
  FSDP_COLL_BARRIER,
  FSDP_COLL_COUNT
} fsdp_coll_op;
const char *fsdp_coll_name(fsdp_coll_op op); /* "all_gather", ... */

typedef enum { FSDP_RED_SUM = 0, FSDP_RED_AVG, FSDP_RED_MAX, FSDP_RED_MIN } fsdp_reduce_op;

/* One collective, as issued by a rank. */
typedef struct fsdp_coll {
  fsdp_coll_op op;
  fsdp_dtype dtype;      /* FSDP_DTYPE_F32 */
  fsdp_reduce_op red;    /* reduce_scatter, all_reduce */
  int root;              /* broadcast */
  int64_t count;         /* all_gather: elements each rank sends (recv holds count * world);
                          * reduce_scatter: elements each rank receives (send holds count * world);
                          * all_reduce, broadcast: elements of buf; barrier: 0 */
  const float *send;     /* all_gather, reduce_scatter input */
  float *recv;           /* all_gather, reduce_scatter output; all_reduce / broadcast buffer */
  char label[64];        /* caller's label, e.g. the unit path ("blocks.1"); copied */
} fsdp_coll;

typedef struct fsdp_comm fsdp_comm;
typedef struct fsdp_comm_req fsdp_comm_req;

/* A backend. Only `run` is required: it performs one collective, blocking, and returns
 * FSDP_OK or FSDP_ERR with a message. The generic layer (comm.c) gives every backend sequence
 * numbers, asynchronous handles (a per-communicator worker thread that runs queued collectives
 * in order, so compute overlaps them), fingerprints, the flight recorder and the counters.
 * A backend with native nonblocking collectives (MPI) may fill the optional slots instead. */
typedef struct fsdp_comm_i {
  const char *name; /* "local", "mpi" */
  int (*run)(fsdp_comm *c, const fsdp_coll *coll, uint64_t seq);
  /* Poison the group with msg (already formatted "rank R failed: ..."); wakes blocked peers. */
  void (*abort)(fsdp_comm *c, const char *msg);
  void (*free)(fsdp_comm *c);
  /* optional: native asynchronous start/wait (NULL: the worker thread is used) */
  int (*start)(fsdp_comm *c, const fsdp_coll *coll, uint64_t seq, void **native);
  int (*wait)(fsdp_comm *c, void *native);
} fsdp_comm_i;

/* ---- creating communicators ----------------------------------------------------------- */

/* The local backend: ranks are threads of one process. A group is created once with the world
 * size; each rank thread then creates its communicator from it. The group is refcounted: it
 * lives until the last communicator made from it is freed. */
typedef struct fsdp_local_group fsdp_local_group;
int fsdp_local_group_new(fsdp_local_group **out, int world);
void fsdp_local_group_release(fsdp_local_group *g);
int fsdp_comm_local_new(fsdp_comm **out, fsdp_local_group *g, int rank);

/* A world of one (what a plain `luajit` or `fsdprun` without -n gets). */
int fsdp_comm_single_new(fsdp_comm **out);

void fsdp_comm_free(fsdp_comm *c); /* waits for queued collectives; NULL is a no-op */

/* ---- the calling thread's communicator --------------------------------------------------- */

/* Each rank thread sets its own; a thread that set none gets a world of one, created on first
 * use. Layers above take the communicator from here. */
void fsdp_comm_set_current(fsdp_comm *c);
fsdp_comm *fsdp_comm_current(void);

int fsdp_comm_rank(const fsdp_comm *c);
int fsdp_comm_world(const fsdp_comm *c);
const char *fsdp_comm_backend(const fsdp_comm *c);

/* ---- collectives (all collective: every rank calls them in the same order) ----------------- */

int fsdp_comm_all_gather(fsdp_comm *c, float *recv, const float *send, int64_t count,
                         const char *label);
int fsdp_comm_reduce_scatter(fsdp_comm *c, float *recv, const float *send, int64_t count,
                             fsdp_reduce_op red, const char *label);
int fsdp_comm_all_reduce(fsdp_comm *c, float *buf, int64_t count, fsdp_reduce_op red,
                         const char *label);
int fsdp_comm_broadcast(fsdp_comm *c, float *buf, int64_t count, int root, const char *label);
int fsdp_comm_barrier(fsdp_comm *c, const char *label);

/* Asynchronous: start a collective and get a handle (never NULL on FSDP_OK). Exactly one
 * fsdp_comm_wait per handle; it frees the handle and returns the collective's status (with its
 * message in this thread's error slot). */
int fsdp_comm_start(fsdp_comm *c, const fsdp_coll *coll, fsdp_comm_req **req);
int fsdp_comm_wait(fsdp_comm_req *req);
/* Blocking form of the same: start + wait. */
int fsdp_comm_run(fsdp_comm *c, const fsdp_coll *coll);

/* ---- failure ------------------------------------------------------------------------------ */

/* Poison the group: "rank <this rank> failed: <msg>". Idempotent; the first message wins. */
void fsdp_comm_abort(fsdp_comm *c, const char *msg);
bool fsdp_comm_poisoned(const fsdp_comm *c);
void fsdp_comm_set_timeout(fsdp_comm *c, double seconds); /* <= 0: default */
double fsdp_comm_timeout(const fsdp_comm *c);

/* ---- debugging and accounting ---------------------------------------------------------------- */

/* Fingerprints (op, dtype, count, label) are always compared for op and count (a mismatch
 * there would corrupt memory); labels too on a label's first use and on every call when
 * FSDP_DEBUG=1 or fsdp_comm_set_debug(c, true). */
void fsdp_comm_set_debug(fsdp_comm *c, bool on);

/* The last collectives of this rank, newest last, one per line:
 * "#12 all_gather f32 x1024 'blocks.1' done 0.4 ms". Writes at most n bytes; returns buf. */
char *fsdp_comm_flight_recorder(const fsdp_comm *c, char *buf, size_t n);

typedef struct fsdp_comm_stats {
  int64_t calls[FSDP_COLL_COUNT];
  /* bytes of the logical buffer each call moves, per rank: all_gather and reduce_scatter count
   * the full (world x count) buffer, all_reduce and broadcast the buffer, barrier 0 */
  int64_t bytes[FSDP_COLL_COUNT];
  double busy_s;     /* time spent running collectives (on the worker or caller) */
  double wait_s;     /* time callers spent blocked in fsdp_comm_wait / blocking calls */
} fsdp_comm_stats;
void fsdp_comm_get_stats(const fsdp_comm *c, fsdp_comm_stats *out);
void fsdp_comm_reset_stats(fsdp_comm *c);

#endif
