/*
 * comm.h — the communicator: collectives between ranks behind one interface (a vtable per
 * backend), with asynchronous handles, collective failure (poison + timeout), fingerprints,
 * a flight recorder and traffic counters. docs/comm.md is the long version.
 *
 * Layering: src/comm calls only src/core. Everything above (fsdp/, lua/, cli/) talks to an
 * fsdp_comm through the functions below and never knows which backend runs.
 *
 * Threads: a communicator belongs to one rank; one thread issues its collectives (start, run,
 * the blocking calls) and waits on its handles. Stats, the flight recorder, abort and
 * fsdp_comm_poisoned may be called from any thread.
 *
 * Ordering: every collective a rank issues (blocking or asynchronous) takes the next sequence
 * number of that rank's communicator (1, 2, ...) and completes in sequence order: asynchronous
 * ones run in FIFO order on a per-communicator worker thread, and a blocking call queues
 * behind them (when nothing is queued it runs on the calling thread). Ranks must issue the
 * same collectives in the same order (SPMD); when they do not, the fingerprint check turns it
 * into an error naming both sides instead of a hang or a corruption.
 *
 * Failure (invariant 3): fsdp_comm_abort(c, msg) poisons the whole group. Every rank
 * blocked in a collective, or entering one later, fails within the timeout with
 * "rank R failed: <msg>". A collective that waits longer than the timeout (default 60 s,
 * FSDP_TIMEOUT seconds in the environment, or fsdp_comm_set_timeout) fails with an error naming
 * the collective, its label and the ranks that have not arrived, then poisons the group so
 * the others fail too. On any failure the rank's flight recorder is appended to the message
 * ("\nflight recorder (rank R, newest last):\n#11 ...\n#12 ..."), as many of the newest entries
 * as fit in the error slot. A collective whose peers have all arrived runs to completion on
 * every rank even if the group is poisoned meanwhile: it succeeds or fails everywhere.
 * Invalid arguments (NULL buffer, negative count, overlapping buffers, root out of range, a
 * reduction the dtype has not) are an error on the calling rank that also poisons the group:
 * its peers could never complete.
 *
 * Dtypes: every collective carries one (fsdp_coll.dtype) and counts are in elements of it.
 * all_gather and broadcast move any dtype (byte copies). Reductions (reduce_scatter,
 * all_reduce) are defined for f32, bf16, f64 and i64: bf16 is widened to f32, reduced in f32
 * and rounded to bf16 once; i64 sums wrap modulo 2^64 and have no avg. Other dtypes (u8, bool,
 * f16, i32) reduce to an error naming the dtype and the reduction. The arithmetic of a
 * reduction is the backend's: local and mpi reduce in rank order through reduce.c and give the
 * same bits (docs/comm.md), but an implementation of this interface (NCCL, say) may reduce in
 * another order, so callers must not rely on bit-identical results across backends.
 *
 * Buffers: A buffer passed to an asynchronous collective must stay valid and untouched until
 * fsdp_comm_wait returns. all_gather may run in place (send == recv + rank * count elements),
 * and so may reduce_scatter (recv == send + rank * count elements); otherwise send and recv
 * must not overlap.
 */
#ifndef FSDP_COMM_H
#define FSDP_COMM_H

#include <stdbool.h>
#include <stddef.h>
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
const char *fsdp_coll_name(fsdp_coll_op op); /* "all_gather", ...; "?" when out of range */

/* fsdp_reduce_op (core.h): AVG is SUM followed, for f32 and bf16, by one multiplication by
 * (float)(1.0 / world), for f64 by one division by world; i64 has no AVG (see docs/comm.md). MAX
 * and MIN propagate NaN. */
const char *fsdp_reduce_name(fsdp_reduce_op red); /* "sum", "avg", "max", "min" */

/* One collective, as issued by a rank. */
typedef struct fsdp_coll {
  fsdp_coll_op op;
  fsdp_dtype dtype;      /* element type of send and recv; counts are in its elements */
  fsdp_reduce_op red;    /* reduce_scatter, all_reduce */
  int root;              /* broadcast */
  int64_t count;         /* all_gather: elements each rank sends (recv holds count * world);
                          * reduce_scatter: elements each rank receives (send holds count * world);
                          * all_reduce, broadcast: elements of buf; barrier: 0 */
  const void *send;      /* all_gather, reduce_scatter input */
  void *recv;            /* all_gather, reduce_scatter output; all_reduce / broadcast buffer */
  char label[64];        /* caller's label, e.g. the unit path ("blocks.1"); copied */
  /* The device send and recv live on: NULL (or a device with host memory) for host memory.
   * Otherwise the backend moves them with the device's copy and reduces them with its kernel
   * table's reduce_ranks, in the calling thread's device order (local, world of one), or
   * refuses (mpi: host memory only). Not part of the fingerprint. */
  const fsdp_device_i *device;
} fsdp_coll;

typedef struct fsdp_comm fsdp_comm;
typedef struct fsdp_comm_req fsdp_comm_req;
struct fsdp_split;

/* A backend. Only `run` is required: it performs one collective, blocking, and returns
 * FSDP_OK or FSDP_ERR with a message. The generic layer (comm.c) gives every backend sequence
 * numbers, asynchronous handles (a per-communicator worker thread that runs queued collectives
 * in order, so compute overlaps them), fingerprints, the flight recorder and the counters.
 * A backend with native nonblocking collectives (MPI) may fill the optional slots instead.
 * Arguments reaching a backend are already validated (see fsdp_comm_start). */
typedef struct fsdp_comm_i {
  const char *name; /* "local", "mpi" */
  int (*run)(fsdp_comm *c, const fsdp_coll *coll, uint64_t seq);
  /* Which buffers the backend moves: host memory (fsdp_coll.device NULL or a host-memory
   * device), buffers on devices without host memory, or both. The generic layer refuses the
   * others before a collective is issued. */
  bool host_buffers, device_buffers;
  /* Poison the group with msg (already formatted "rank R failed: ..."); wakes blocked peers.
   * Optional: NULL keeps the poison in the communicator itself (a world of one). */
  void (*abort)(fsdp_comm *c, const char *msg);
  void (*free)(fsdp_comm *c); /* optional: frees the backend's state (fsdp_comm_impl) */
  /* optional: native asynchronous start/wait (NULL: the worker thread is used). start must
   * not block on peers; its failure, or wait's, is the collective's failure. */
  int (*start)(fsdp_comm *c, const fsdp_coll *coll, uint64_t seq, void **native);
  int (*wait)(fsdp_comm *c, void *native);
  /* optional (required with abort): whether the group is poisoned, by any rank */
  bool (*poisoned)(const fsdp_comm *c);
  /* optional: lift the group's poison; the next collective of every rank is seq + 1 (see
   * fsdp_comm_revive). Called by every rank; must be idempotent. */
  int (*revive)(fsdp_comm *c, uint64_t seq);
  /* optional: make this rank's communicator of a split (fsdp_comm_split), already agreed by
   * the generic layer: every rank of c calls it at once with its own fsdp_split. NULL: the
   * backend has no sub-communicators, and fsdp_comm_split refuses before issuing anything. */
  int (*split)(fsdp_comm *c, const struct fsdp_split *s, fsdp_comm **out);
} fsdp_comm_i;

/* One rank's part of a split, as the generic layer computed it from every rank's color and key:
 * the ranks of the parent in the new communicator (`members`, world entries, in new-rank order;
 * rank = this rank's index there), and a tag that is the same on every rank of the parent and
 * different for every split of it (the sequence number of the exchange). */
typedef struct fsdp_split {
  int color, rank, world;
  const int *members;
  uint64_t tag;
} fsdp_split;

/* ---- creating communicators ----------------------------------------------------------- */

/* The local backend: ranks are threads of one process. A group is created once with the world
 * size; each rank thread then creates its communicator from it (once per rank). The group is
 * refcounted: it lives until the creator's reference and every communicator made from it are
 * gone (fsdp_local_group_release after the rank threads are started is fine).
 * A rank whose communicator is freed has left: a peer waiting for it in a collective fails at
 * once ("rank R left ...") instead of at the timeout. */
typedef struct fsdp_local_group fsdp_local_group;
int fsdp_local_group_new(fsdp_local_group **out, int world); /* 1 <= world <= 4096 */
void fsdp_local_group_release(fsdp_local_group *g);         /* NULL is a no-op */
/* seconds > 0: the default timeout of the communicators made from g from now on and of those
 * split from them, in place of FSDP_TIMEOUT, which their creation then does not read (the
 * embedding runtime's explicit timeout_s). Call it before the ranks make their communicators. */
void fsdp_local_group_set_timeout(fsdp_local_group *g, double seconds);
int fsdp_comm_local_new(fsdp_comm **out, fsdp_local_group *g, int rank);

/* A world of one (what a plain `luajit` or `fsdprun` without -n gets). Its collectives are
 * local copies (all_gather/reduce_scatter copy send to recv; avg multiplies by 1), counted in
 * the stats and recorded like any other; asynchronous ones complete at start. */
int fsdp_comm_single_new(fsdp_comm **out);

/* Creation reads FSDP_TIMEOUT (seconds > 0; not when the group has a timeout of its own:
 * fsdp_local_group_set_timeout) and FSDP_COMM_CHECK (hash/full) from
 * the environment; a malformed FSDP_TIMEOUT or FSDP_COMM_CHECK is an error naming it. */

/* Waits for queued collectives (each finishes, fails on a poisoned group, or times out), frees
 * handles never waited on (waiting on them afterwards is a use-after-free) and, if c is the
 * calling thread's current communicator, unsets it. NULL is a no-op. */
void fsdp_comm_free(fsdp_comm *c);

/* ---- sub-communicators (a family: a communicator, its sub-communicators, theirs) ------------ */

/* Collective over c: split it like MPI_Comm_split. The ranks passing the same color (>= 0)
 * form one sub-communicator, ranked by key, then by their rank in c. It belongs to c: freed
 * with it (children first), or earlier by fsdp_comm_free. Costs two collectives on c (the
 * colors and keys, then whether every rank made its communicator). FSDP_ERR on every rank
 * alike: a negative color, a backend without sub-communicators (nccl, for now; refused before
 * anything is issued), a failed creation on any rank (named).
 * Failure holds for the family as one group (invariant 3): a poison or a failed collective on
 * any member poisons every member (the parent and all sub-communicators), so a rank waiting
 * in a sub-communicator fails too when a rank outside its group fails. Messages name the rank
 * of the family's root communicator ("rank 3 failed: ..."); sequence numbers, the flight
 * recorder and the stats are each member's own. A family with sub-communicators cannot be
 * revived (fsdp_comm_revive refuses). */
int fsdp_comm_split(fsdp_comm *c, int color, int key, fsdp_comm **out);
/* Collective over c the first time (then a lookup, the same on every rank): hybrid sharding's
 * pair for groups of shard_size consecutive ranks. shard: the group of rank r, ranks
 * [r - r % S, r - r % S + S), with rank r % S in it; replicate: the ranks with the same index in
 * every group (r % S, r % S + S, ...), with rank r / S in it. Kept by c (one pair per
 * shard_size), freed with it; both borrowed. shard_size must divide the world: otherwise an
 * error on every rank before anything is issued. */
int fsdp_comm_hybrid(fsdp_comm *c, int shard_size, fsdp_comm **shard, fsdp_comm **replicate);
/* The pair fsdp_comm_hybrid made last on c: its shard_size, or 0 (and NULLs) when none.
 * Not collective. */
int fsdp_comm_hybrid_last(const fsdp_comm *c, fsdp_comm **shard, fsdp_comm **replicate);
/* The communicator c was split from, or NULL. */
fsdp_comm *fsdp_comm_parent(const fsdp_comm *c);

/* ---- the calling thread's communicator --------------------------------------------------- */

/* Each rank thread sets its own; a thread that set none (or set NULL) gets a world of one,
 * created on first use and freed when the thread exits. set_current does not take ownership.
 * fsdp_comm_current returns NULL only if creating that world of one fails (out of memory). */
void fsdp_comm_set_current(fsdp_comm *c);
fsdp_comm *fsdp_comm_current(void);

int fsdp_comm_rank(const fsdp_comm *c);
int fsdp_comm_world(const fsdp_comm *c);
const char *fsdp_comm_backend(const fsdp_comm *c); /* "local" (a world of one too), "mpi" */

/* ---- collectives (all collective: every rank calls them in the same order) ----------------- */

/* Blocking. count is in elements of dtype. FSDP_OK, or FSDP_ERR with the message (and flight
 * recorder) in the error slot. label may be NULL (""); it is truncated to 63 bytes. */
int fsdp_comm_all_gather(fsdp_comm *c, void *recv, const void *send, int64_t count,
                         fsdp_dtype dtype, const char *label);
int fsdp_comm_reduce_scatter(fsdp_comm *c, void *recv, const void *send, int64_t count,
                             fsdp_dtype dtype, fsdp_reduce_op red, const char *label);
int fsdp_comm_all_reduce(fsdp_comm *c, void *buf, int64_t count, fsdp_dtype dtype,
                         fsdp_reduce_op red, const char *label);
int fsdp_comm_broadcast(fsdp_comm *c, void *buf, int64_t count, fsdp_dtype dtype, int root,
                        const char *label);
int fsdp_comm_barrier(fsdp_comm *c, const char *label);

/* ---- values (values.c): collective too -------------------------------------------------- */

/* A tensor (contiguous, with data, in its own dtype, on its own device) reduced or broadcast in
 * place; bumps t->version. A strided view is an error naming the function ("all_reduce: needs a
 * contiguous tensor, got a strided view (2, 2) ..."), raised before anything is issued. */
int fsdp_comm_all_reduce_tensor(fsdp_comm *c, fsdp_tensor *t, fsdp_reduce_op red,
                                const char *label);
int fsdp_comm_broadcast_tensor(fsdp_comm *c, fsdp_tensor *t, int root, const char *label);

/* Where the byte collectives put what they receive: n bytes the caller owns (the Lua binding's
 * are userdata, so an error raised later frees them), or NULL when out of memory. */
typedef void *(*fsdp_comm_alloc_fn)(void *ud, size_t n);
/* Every rank's byte string (s, len bytes): lens (world entries, the caller's) gets each rank's
 * length, *all a buffer of world x *stride bytes from alloc holding rank p's string at
 * all + p * stride. Two collectives: the lengths (i64), then the strings padded to the longest
 * (u8); only the first when every string is empty (*all NULL, *stride 0). */
int fsdp_comm_all_gather_bytes(fsdp_comm *c, const void *s, size_t len, int64_t *lens,
                               char **all, size_t *stride, fsdp_comm_alloc_fn alloc, void *ud,
                               const char *label);
/* root's byte string on every rank: *out and *out_len. The root sends s as it is and gets s
 * back; every other rank ignores its s (NULL is fine) and gets len + 1 bytes from alloc, NUL
 * terminated. Two collectives: the length (i64), then the bytes (u8). A root that is no rank
 * is an error before anything is issued. */
int fsdp_comm_broadcast_bytes(fsdp_comm *c, const void *s, size_t len, int root,
                              const char **out, size_t *out_len, fsdp_comm_alloc_fn alloc,
                              void *ud, const char *label);
/* Not collective: a 64-bit FNV-1a hash of n bytes, what ranks compare before sending whole
 * values (lua/fsdp/collective.lua). */
uint64_t fsdp_comm_digest(const void *s, size_t n);

/* Asynchronous: start a collective and get a handle (never NULL on FSDP_OK). Exactly one
 * fsdp_comm_wait per handle; it frees the handle and returns the collective's status (with its
 * message in this thread's error slot). Handles may be waited in any order (waiting on a later
 * one first simply waits for the earlier ones to run too). start itself fails only on invalid
 * arguments or out of memory (no sequence number is taken then). */
int fsdp_comm_start(fsdp_comm *c, const fsdp_coll *coll, fsdp_comm_req **req);
int fsdp_comm_wait(fsdp_comm_req *req);
/* Blocking form of the same: start + wait. */
int fsdp_comm_run(fsdp_comm *c, const fsdp_coll *coll);

/* ---- failure ------------------------------------------------------------------------------ */

/* Poison the group: "rank <this rank> failed: <msg>". Idempotent; the first message wins
 * (whether it came from an abort, a timeout or a fingerprint mismatch). Any thread. */
void fsdp_comm_abort(fsdp_comm *c, const char *msg);
bool fsdp_comm_poisoned(const fsdp_comm *c);
/* While msg is non-NULL and non-empty, every collective issued on c (blocking or started)
 * fails at once on the calling rank with "<op> '<label>': <msg>", taking no sequence number,
 * counting nothing and poisoning nothing: the REPL's ":rank K" mode, where only one rank runs
 * an input. NULL or "" lifts it. Any thread. */
void fsdp_comm_set_refuse(fsdp_comm *c, const char *msg);
/* seconds <= 0: the default (the group's timeout, else FSDP_TIMEOUT or 60) */
void fsdp_comm_set_timeout(fsdp_comm *c, double seconds);

/* Reviving a poisoned group (fsdprun's post-mortem REPL), in three steps that every rank takes,
 * with something else (the REPL's own channel) between them to agree and to wait: once no rank
 * issues collectives on c any more, fsdp_comm_drain waits for c's queued ones (they fail on
 * the poisoned group) and returns the last sequence number c issued; every rank then calls
 * fsdp_comm_revive with the largest of them, and only when all have returned issues
 * collectives again, numbered from seq + 1 on every rank. FSDP_ERR (nothing changed) when the
 * backend cannot (nccl: its work may still be in flight) or seq is below c's. */
uint64_t fsdp_comm_drain(fsdp_comm *c);
int fsdp_comm_revive(fsdp_comm *c, uint64_t seq);
double fsdp_comm_timeout(const fsdp_comm *c);

/* ---- debugging and accounting ---------------------------------------------------------------- */

/* Fingerprints (op, dtype, count, where the buffers live, reduction and root where they apply,
 * label) are compared on every collective: a mismatch fails the collective on every rank with
 * "collective mismatch at #12: rank 0 called all_gather(f32 x1024, 'blocks.1') but rank 1
 * called all_gather(bf16 x1024, 'blocks.1')" and poisons the group with it. The label counts
 * too: two units of the same size reduced in a different order on two ranks would otherwise
 * pass, and the replicas drift apart. */
/* The fingerprint check costs O(log N) per collective: the ranks fold hashes of their
 * fingerprints (an all-reduce of 24 bytes on mpi, a counter on local) and exchange the full
 * fingerprints only when the hashes disagree. Full check on (FSDP_COMM_CHECK=full, or this call,
 * on any rank) makes every collective exchange them all (O(N) per rank): the old protocol, kept
 * for measurement and for suspicion of the hash. Between collectives. */
void fsdp_comm_set_full_check(fsdp_comm *c, bool on);

/* The last 64 collectives of this rank, newest last, one per line:
 * "#12 all_gather f32 x1024 'blocks.1' done 0.4 ms" (states: queued, running, done, failed;
 * the time is how long it ran, or has been queued/running so far). "(no collectives)\n" when
 * empty. Writes at most n bytes (NUL included; the oldest lines are dropped to fit); returns
 * buf. */
char *fsdp_comm_flight_recorder(const fsdp_comm *c, char *buf, size_t n);

typedef struct fsdp_comm_stats {
  int64_t calls[FSDP_COLL_COUNT];
  /* bytes of the logical buffer each call moves, per rank (elements x the dtype's size):
   * all_gather and reduce_scatter count the full (world x count) buffer, all_reduce and
   * broadcast the buffer, barrier 0 */
  int64_t bytes[FSDP_COLL_COUNT];
  double busy_s;     /* time spent running collectives (on the worker or caller) */
  double wait_s;     /* time callers spent blocked in fsdp_comm_wait / blocking calls */
} fsdp_comm_stats;
/* Counted when a collective is issued (a failing one counts too). Any thread. */
void fsdp_comm_get_stats(const fsdp_comm *c, fsdp_comm_stats *out);
void fsdp_comm_reset_stats(fsdp_comm *c);

/* ---- for backends (src/comm/ only) ----------------------------------------------------------- */

/* Wrap a backend in a communicator: the generic layer owns it from here (vt->free(c) frees
 * impl when the communicator is freed; on error nothing is taken). Reads the environment as
 * described above. */
int fsdp_comm_new_backend(fsdp_comm **out, const fsdp_comm_i *vt, void *impl, int rank,
                          int world);
/* The same with a default timeout (> 0) that the creator gives: FSDP_TIMEOUT is then not read.
 * timeout <= 0: as fsdp_comm_new_backend. */
int fsdp_comm_new_backend_timeout(fsdp_comm **out, const fsdp_comm_i *vt, void *impl, int rank,
                                  int world, double timeout);
void *fsdp_comm_impl(const fsdp_comm *c);
/* This rank's rank in the family's root communicator (its own rank outside a family): the
 * rank a backend's "rank R failed: ..." names. */
int fsdp_comm_family_rank(const fsdp_comm *c);
/* Poison the group with a message already formatted "rank R failed: ..." (what vt->abort
 * receives): a backend that stacks on another communicator passes its poison down with it. */
void fsdp_comm_poison(fsdp_comm *c, const char *full);
/* Fingerprint helpers: equal op, dtype, count, where the buffers live (host memory or a
 * device's name), red and root where they apply, label;
 * "all_gather(f32 x1024, 'blocks.1')" into buf, " on cuda" added for device buffers (returns
 * buf). */
bool fsdp_coll_matches(const fsdp_coll *a, const fsdp_coll *b);
/* A 64-bit hash of what fsdp_coll_matches compares, and seq: two fingerprints that match hash
 * alike; two that do not collide with probability 2^-64. */
uint64_t fsdp_coll_hash(const fsdp_coll *k, uint64_t seq);
/* The scalable check. Each rank makes a vector of FSDP_CHECK_WORDS words from its fingerprint
 * (init); the ranks combine their vectors with an elementwise max (fold; MPI_MAX over
 * MPI_UINT64_T gives the same), by any tree; the combined vector says whether every rank's
 * fingerprint was the same (agrees): it holds max(h) and max(~h) = ~min(h) of the hash, and
 * whether any rank asks for the full check (word FSDP_CHECK_FULL). A backend whose ranks do not agree, or
 * one of whose ranks asks, exchanges the full fingerprints (and names the rank at fault). */
#define FSDP_CHECK_WORDS 3
#define FSDP_CHECK_FULL 2
void fsdp_coll_check_init(uint64_t v[FSDP_CHECK_WORDS], const fsdp_coll *k, uint64_t seq,
                          bool full);
void fsdp_coll_check_fold(uint64_t acc[FSDP_CHECK_WORDS], const uint64_t v[FSDP_CHECK_WORDS]);
bool fsdp_coll_check_agrees(const uint64_t acc[FSDP_CHECK_WORDS]);
/* Inside vt->run / vt->start: whether this rank asks for the full check for this collective
 * (fsdp_comm_set_full_check when it was issued). */
bool fsdp_comm_full_check(const fsdp_comm *c);
char *fsdp_coll_describe(char *buf, size_t n, const fsdp_coll *coll);
/* A backend's view of peer p for a timeout message: whether it is missing and, when it is,
 * where it is (where: "#11", "none", "never joined") and whether it left. */
typedef bool (*fsdp_comm_peer_fn)(const void *ctx, int p, char *where, size_t n, bool *left);
/* "ranks 2, 3 have not arrived (sequence numbers they reached: rank 2 #11, rank 3 none)" over
 * ranks [0, world) into buf; returns how many are missing (0: buf is "", the caller says why). */
int fsdp_comm_describe_missing(char *buf, size_t n, int world, fsdp_comm_peer_fn peer,
                               const void *ctx);
/* Bytes the stats count for one collective on a world of `world` ranks. */
int64_t fsdp_coll_bytes(const fsdp_coll *coll, int world);

/* Whether reduction red is defined for dtype (f32, bf16, f64, i64; no avg for i64). */
bool fsdp_comm_reduce_supported(fsdp_dtype dtype, fsdp_reduce_op red);
/* For backends: out[i] = src[0][i] (+) src[1][i] (+) ... (+) src[nsrc-1][i] for i < m elements
 * of dtype, left to right (bf16: in f32, rounded once at the end); AVG then scales as described
 * at fsdp_reduce_op. out may be one of the inputs. The local and mpi backends reduce through this
 * function, so they give the same bits (reduce.c). dtype and red must be supported. */
void fsdp_comm_reduce(void *out, const void *const *src, int nsrc, int64_t m, fsdp_dtype dtype,
                      fsdp_reduce_op red);

#endif
