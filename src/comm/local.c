/*
 * local.c — the `local` backend: ranks are threads of one process sharing a fsdp_local_group.
 * The algorithm and its guarantees are described in docs/comm.md.
 *
 * Rendezvous. For the collective with sequence number s, each rank's running thread publishes
 * its fsdp_coll (buffer pointers and fingerprint) in its slot of the group, folds its check
 * vector (comm.h: hashes of the fingerprint) into the group's, counts itself in and waits until
 * all W ranks have. The last to arrive reads the folded vector and records the verdict
 * (go_seq = s, go_ok); everyone reads it. Each rank does O(1) work to arrive; the full
 * fingerprints are compared (O(W), by the last rank) only when the hashes disagree, to name the
 * rank at fault, or on every collective under FSDP_COMM_CHECK=full. Under the group mutex, "all arrived" and
 * "poisoned" are decided once per collective: either the last rank arrives before any poison
 * (the collective runs on every rank) or a poison comes first (it fails on every rank; the
 * last rank sees the poison before publishing). The arrival wait is the only timed wait
 * (pthread_cond_timedwait on CLOCK_MONOTONIC).
 *
 * Data, zero-copy: every rank reads its peers' buffers directly (no staging); counts are in
 * elements of the collective's dtype, copies are of bytes:
 *   all_gather      rank r copies each rank p's send into its own recv[p*count, (p+1)*count)
 *   reduce_scatter  rank r reduces chunk r of every rank's send, in rank order 0..W-1 (in place
 *                   too: recv == send + r * count is read by rank r alone, tile by tile, before
 *                   the tile is written)
 *   all_reduce      reduce-scatter (rank r reduces its chunk of every rank's buffer, in rank
 *                   order, into its own buffer), sync, all-gather of the reduced chunks
 *   broadcast       every rank but the root copies the root's buffer
 * then a completion sync, so that no rank returns (and frees or reuses its buffers) while a
 * peer may still read them. The syncs after the arrival are untimed: every rank has arrived,
 * and all that remains is bounded memory work on threads the engine owns; a poison raised
 * meanwhile is seen by the next collective.
 *
 * Reproducibility: each output element is computed by exactly one rank, always as
 * ((x0 + x1) + x2) + ... + x(W-1) by fsdp_comm_reduce (reduce.c: per dtype, avg included),
 * independent of tiling, vector width or which rank computes it; every other rank copies those
 * bits. So all ranks hold identical bits, and runs repeat bit for bit.
 *
 * Sub-groups (local_split, for fsdp_comm_split): a group made from another shares its root's
 * mutex, condition variable and poison (the family's), so a poison anywhere fails every waiter
 * of the family at once; rendezvous, syncs and slots stay per group.
 */
#include "comm/comm.h"
#include "core/cond.h"
#include "kernels/kernels.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LOCAL_MAX_WORLD 4096
#define LOCAL_MSG_CAP 1024
/* all_reduce chunk boundaries at multiples of 64 bytes: no two ranks write the same cache
 * line */
#define LOCAL_ALIGN_BYTES 64

typedef struct local_slot {
  fsdp_coll coll;     /* published for the collective `arrived` */
  uint64_t arrived;   /* last sequence number published (0: none yet) */
  bool joined;        /* a communicator exists (or existed) for this rank */
  bool left;          /* ... and was freed */
} local_slot;

/* A split being made (local_split): the group of one color, until every member has joined. */
typedef struct split_entry {
  const fsdp_local_group *parent;
  uint64_t tag;
  int color, joined;
  fsdp_local_group *g;
  struct split_entry *next;
} split_entry;

struct fsdp_local_group {
  int world;
  int refs; /* creator + one per communicator (+ one per live sub-group: the root); under mu */
  /* A family (a group and the groups split from it) shares the root's lock, condition variable
   * and poison: a poison anywhere wakes and fails every waiter of the family. */
  fsdp_local_group *fam; /* the root (itself for a root); a sub-group holds a reference */
  pthread_mutex_t *mu;   /* &fam->own_mu */
  pthread_cond_t *cv;    /* &fam->own_cv: CLOCK_MONOTONIC; every state change broadcasts */
  pthread_mutex_t own_mu;
  pthread_cond_t own_cv;
  bool poisoned; /* the family's (read fam->poisoned) */
  double timeout; /* the family's default timeout (> 0), or 0: FSDP_TIMEOUT's (read fam->timeout) */
  char poison[LOCAL_MSG_CAP];
  split_entry *splits; /* the family's splits in progress (root only) */
  uint64_t go_seq; /* last collective all ranks arrived at */
  bool go_ok;      /* its fingerprints matched */
  char verdict[LOCAL_MSG_CAP];
  /* the collective being arrived at (every rank arrives at go_seq + 1 next: none can pass it
   * before all have arrived) */
  int narrived;
  uint64_t check[FSDP_CHECK_WORDS]; /* the arrived ranks' check vectors, folded */
  int nleft;                        /* ranks whose communicator was freed */
  /* the syncs inside a collective: a counting barrier */
  int nsync;
  uint64_t sync_gen;
  local_slot slot[];
};

typedef struct local_comm {
  fsdp_local_group *g;
  int rank;
  const void **srcs; /* (world) scratch: the inputs of one reduction */
} local_comm;

/* ---- group --------------------------------------------------------------------------------- */

int fsdp_local_group_new(fsdp_local_group **out, int world) {
  *out = NULL;
  if (world < 1 || world > LOCAL_MAX_WORLD) {
    return fsdp_error("local group: world size %d out of range 1..%d", world, LOCAL_MAX_WORLD);
  }
  fsdp_local_group *g = calloc(1, sizeof *g + (size_t)world * sizeof(local_slot));
  if (!g) return fsdp_error("local group: out of memory");
  g->world = world;
  g->refs = 1;
  g->fam = g;
  g->mu = &g->own_mu;
  g->cv = &g->own_cv;
  pthread_mutex_init(&g->own_mu, NULL);
  fsdp_cond_init_monotonic(&g->own_cv);
  *out = g;
  return FSDP_OK;
}

void fsdp_local_group_set_timeout(fsdp_local_group *g, double seconds) {
  g->fam->timeout = seconds > 0 ? seconds : 0;
}

void fsdp_local_group_release(fsdp_local_group *g) {
  if (!g) return;
  fsdp_local_group *fam = g->fam;
  pthread_mutex_lock(g->mu);
  bool last = --g->refs == 0;
  pthread_mutex_unlock(g->mu);
  if (!last) return;
  if (fam != g) { /* a sub-group: its lock is the root's, which it holds a reference on */
    free(g);
    fsdp_local_group_release(fam);
    return;
  }
  pthread_cond_destroy(&g->own_cv);
  pthread_mutex_destroy(&g->own_mu);
  free(g);
}

/* ---- poison ------------------------------------------------------------------------------- */

static void poison_locked(fsdp_local_group *g, const char *msg) {
  fsdp_local_group *f = g->fam;
  if (!f->poisoned) {
    f->poisoned = true;
    size_t len = strlen(msg);
    if (len >= sizeof f->poison) len = sizeof f->poison - 1; /* truncated, never overflowed */
    memcpy(f->poison, msg, len);
    f->poison[len] = '\0';
  }
  pthread_cond_broadcast(g->cv);
}

static void local_abort(fsdp_comm *c, const char *msg) {
  local_comm *lc = fsdp_comm_impl(c);
  pthread_mutex_lock(lc->g->mu);
  poison_locked(lc->g, msg);
  pthread_mutex_unlock(lc->g->mu);
}

/* Every rank calls it with the same seq, none inside a collective (fsdp_comm_revive). */
static int local_revive(fsdp_comm *c, uint64_t seq) {
  local_comm *lc = fsdp_comm_impl(c);
  fsdp_local_group *g = lc->g;
  pthread_mutex_lock(g->mu);
  if (g->nleft > 0) {
    pthread_mutex_unlock(g->mu);
    return fsdp_error("cannot revive the group: a rank has left it");
  }
  g->fam->poisoned = false; /* (the generic layer refuses a family with sub-groups) */
  g->fam->poison[0] = '\0';
  g->go_seq = seq;
  g->go_ok = true;
  g->narrived = 0;
  pthread_mutex_unlock(g->mu);
  return FSDP_OK;
}

static bool local_poisoned(const fsdp_comm *c) {
  local_comm *lc = fsdp_comm_impl(c);
  pthread_mutex_lock(lc->g->mu);
  bool p = lc->g->fam->poisoned;
  pthread_mutex_unlock(lc->g->mu);
  return p;
}

/* ---- rendezvous ---------------------------------------------------------------------------- */

/* The last rank to arrive. The folded check vector says whether every rank's fingerprint
 * hashed alike, so every rank reads the same verdict. When they do not (or under FSDP_COMM_CHECK=full) the fingerprints
 * themselves are compared with rank 0's, which names the rank at fault. A mismatch poisons the
 * group: the ranks have diverged. */
static void decide_locked(fsdp_local_group *g, uint64_t seq) {
  g->go_seq = seq;
  g->go_ok = true;
  bool full = g->check[FSDP_CHECK_FULL] || !fsdp_coll_check_agrees(g->check);
  g->narrived = 0;
  if (!full) {
    pthread_cond_broadcast(g->cv);
    return;
  }
  for (int p = 1; p < g->world; p++) {
    if (fsdp_coll_matches(&g->slot[0].coll, &g->slot[p].coll)) continue;
    char a[160], b[160];
    snprintf(g->verdict, sizeof g->verdict,
             "collective mismatch at #%llu: rank 0 called %s but rank %d called %s",
             (unsigned long long)seq, fsdp_coll_describe(a, sizeof a, &g->slot[0].coll), p,
             fsdp_coll_describe(b, sizeof b, &g->slot[p].coll));
    g->go_ok = false;
    poison_locked(g, g->verdict);
    break;
  }
  pthread_cond_broadcast(g->cv);
}

/* fsdp_comm_peer_fn over the group's slots, for the collective `seq` (ctx: a missing_ctx) */
typedef struct {
  const fsdp_local_group *g;
  uint64_t seq;
} missing_ctx;

static bool local_peer(const void *ctx, int p, char *where, size_t n, bool *left) {
  const missing_ctx *m = ctx;
  const local_slot *s = &m->g->slot[p];
  if (s->arrived == m->seq) return false;
  if (!s->joined) snprintf(where, n, "never joined");
  else if (s->arrived == 0) snprintf(where, n, "none");
  else snprintf(where, n, "#%llu", (unsigned long long)s->arrived);
  *left = s->left;
  return true;
}

static void deadline_after(struct timespec *ts, double seconds) {
  if (seconds > 1e9) seconds = 1e9; /* ~30 years: keeps tv_sec in range */
  clock_gettime(CLOCK_MONOTONIC, ts);
  double whole = (double)(int64_t)seconds;
  ts->tv_sec += (time_t)whole;
  ts->tv_nsec += (long)((seconds - whole) * 1e9);
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec += 1;
    ts->tv_nsec -= 1000000000L;
  }
}

/* Publish and wait for every rank. FSDP_OK: the collective runs (fingerprints matched). */
static int arrive(fsdp_comm *c, local_comm *lc, const fsdp_coll *coll, uint64_t seq) {
  fsdp_local_group *g = lc->g;
  int r = lc->rank;
  double timeout = fsdp_comm_timeout(c);
  pthread_mutex_lock(g->mu);
  if (g->fam->poisoned) goto poisoned;
  g->slot[r].coll = *coll;
  g->slot[r].arrived = seq;
  uint64_t v[FSDP_CHECK_WORDS];
  fsdp_coll_check_init(v, coll, seq, fsdp_comm_full_check(c));
  if (g->narrived == 0) memcpy(g->check, v, sizeof v);
  else fsdp_coll_check_fold(g->check, v);
  if (++g->narrived == g->world) {
    decide_locked(g, seq);
  } else {
    struct timespec deadline;
    deadline_after(&deadline, timeout);
    while (g->go_seq < seq) {
      if (g->fam->poisoned) goto poisoned;
      for (int p = 0; g->nleft && p < g->world; p++) {
        if (g->slot[p].left && g->slot[p].arrived != seq) {
          char msg[LOCAL_MSG_CAP];
          snprintf(msg, sizeof msg,
                   "rank %d left the group (its communicator was freed) after #%llu: %s #%llu "
                   "'%s' cannot complete",
                   p, (unsigned long long)g->slot[p].arrived, fsdp_coll_name(coll->op),
                   (unsigned long long)seq, coll->label);
          char full[LOCAL_MSG_CAP + 32];
          snprintf(full, sizeof full, "rank %d failed: %s", fsdp_comm_family_rank(c), msg);
          poison_locked(g, full);
          pthread_mutex_unlock(g->mu);
          return fsdp_error("%s", msg);
        }
      }
      int rc = pthread_cond_timedwait(g->cv, g->mu, &deadline);
      if (rc == ETIMEDOUT && g->go_seq < seq && !g->fam->poisoned) {
        char missing[LOCAL_MSG_CAP / 2];
        fsdp_comm_describe_missing(missing, sizeof missing, g->world, local_peer,
                                   &(missing_ctx){g, seq});
        char msg[LOCAL_MSG_CAP];
        snprintf(msg, sizeof msg, "timeout after %g s in %s #%llu '%s': %s", timeout,
                 fsdp_coll_name(coll->op), (unsigned long long)seq, coll->label, missing);
        char full[LOCAL_MSG_CAP + 32];
        snprintf(full, sizeof full, "rank %d failed: %s", fsdp_comm_family_rank(c), msg);
        poison_locked(g, full);
        pthread_mutex_unlock(g->mu);
        return fsdp_error("%s", msg);
      }
    }
  }
  /* go_seq == seq: the verdict stays until this rank arrives at seq + 1 */
  if (!g->go_ok) {
    char verdict[LOCAL_MSG_CAP];
    memcpy(verdict, g->verdict, sizeof verdict);
    pthread_mutex_unlock(g->mu);
    return fsdp_error("%s", verdict);
  }
  pthread_mutex_unlock(g->mu);
  return FSDP_OK;

poisoned:;
  char poison[LOCAL_MSG_CAP];
  memcpy(poison, g->fam->poison, sizeof poison);
  pthread_mutex_unlock(g->mu);
  return fsdp_error("%s", poison);
}

/* A sync inside a collective (all ranks have arrived): wait until every rank has reached it
 * (a counting barrier: O(1) per rank). Untimed on purpose (see the file comment). */
static void sync_ranks(local_comm *lc) {
  fsdp_local_group *g = lc->g;
  pthread_mutex_lock(g->mu);
  uint64_t gen = g->sync_gen;
  if (++g->nsync == g->world) {
    g->nsync = 0;
    g->sync_gen++;
    pthread_cond_broadcast(g->cv);
  } else {
    while (g->sync_gen == gen) pthread_cond_wait(g->cv, g->mu);
  }
  pthread_mutex_unlock(g->mu);
}

/* ---- data movement: host memory, or a device's copy and reduce_ranks ------------------------ */

/* How one collective moves its data. Host memory: memcpy and fsdp_comm_reduce (reduce.c, shared
 * with the mpi backend so both give the same bits). Device buffers (ranks sharing one device,
 * e.g. rank threads on one GPU): the device's copy and its kernel table's reduce_ranks, queued in
 * the calling thread's device order, which reproduces reduce.c's bits; the device is
 * synchronized before the rank arrives (its buffers are final when peers read them) and before
 * every sync (its writes are done before peers read them or return). The first error is kept and
 * returned after the final sync, so the peers are never left waiting. */
typedef struct mover {
  const fsdp_device_i *dev; /* NULL: host memory */
  int rc;
} mover;

/* element i of buf (esz bytes each) */
static char *at(const void *buf, int64_t i, size_t esz) { return (char *)buf + i * (int64_t)esz; }

static void copy_elems(mover *m, void *dst, const void *src, int64_t n, size_t esz) {
  if (n <= 0 || dst == src) return;
  if (!m->dev) {
    memcpy(dst, src, (size_t)n * esz);
  } else if (!m->rc) {
    m->rc = m->dev->copy(m->dev->ctx, dst, src, (size_t)n * esz);
  }
}

static void reduce_elems(mover *m, void *out, const void *const *src, int W, int64_t n,
                         const fsdp_coll *coll) {
  if (!m->dev) {
    fsdp_comm_reduce(out, src, W, n, coll->dtype, coll->red);
  } else if (!m->rc && n > 0) {
    m->rc = m->dev->kernels->reduce_ranks(m->dev->ctx, coll->dtype, coll->red, out, src, W, n);
  }
}

static void device_done(mover *m) {
  if (m->dev && !m->rc && m->dev->synchronize) m->rc = m->dev->synchronize(m->dev->ctx);
}

/* A device operation of this rank's part failed: fail the collective and poison the group
 * with its message (the peers must not wait for this rank, nor trust its part). */
static int device_failed(fsdp_comm *c, const fsdp_coll *coll, uint64_t seq) {
  char msg[LOCAL_MSG_CAP];
  snprintf(msg, sizeof msg, "%s #%llu '%s': %s", fsdp_coll_name(coll->op),
           (unsigned long long)seq, coll->label, fsdp_error_msg());
  fsdp_comm_abort(c, msg);
  return fsdp_error("%s", msg);
}

/* ---- run ----------------------------------------------------------------------------------- */

static int local_run(fsdp_comm *c, const fsdp_coll *coll, uint64_t seq) {
  local_comm *lc = fsdp_comm_impl(c);
  fsdp_local_group *g = lc->g;
  const int r = lc->rank, W = g->world;
  const int64_t n = coll->count;
  const size_t esz = fsdp_dtype_size(coll->dtype);
  const bool moves = coll->op != FSDP_COLL_BARRIER && n > 0;
  mover m = {.dev = coll->device && !coll->device->host_memory ? coll->device : NULL};
  if (moves) device_done(&m); /* this rank's buffers are final before peers may read them */
  if (m.rc) return device_failed(c, coll, seq); /* the peers would wait for this rank */
  if (arrive(c, lc, coll, seq) != FSDP_OK) return FSDP_ERR;
  if (!moves) return FSDP_OK; /* same on every rank */
  /* Peers' slots are stable until the final sync: they were published under the mutex before
   * go, and a rank publishes again only after every rank passed that sync. */
  const local_slot *s = g->slot;
  switch (coll->op) {
  case FSDP_COLL_ALL_GATHER:
    /* start with the next rank's shard so the ranks do not all read rank 0 first */
    for (int k = 0; k < W; k++) {
      int p = (r + k) % W;
      copy_elems(&m, at(coll->recv, (int64_t)p * n, esz), s[p].coll.send, n, esz);
    }
    break;
  case FSDP_COLL_REDUCE_SCATTER:
    for (int p = 0; p < W; p++) lc->srcs[p] = at(s[p].coll.send, (int64_t)r * n, esz);
    reduce_elems(&m, coll->recv, lc->srcs, W, n, coll);
    break;
  case FSDP_COLL_ALL_REDUCE: {
    /* chunk p = [p * chunk, min(n, (p + 1) * chunk)), chunk a multiple of 64 bytes */
    const int64_t align = LOCAL_ALIGN_BYTES / (int64_t)esz;
    int64_t chunk = (n + W - 1) / W;
    chunk = (chunk + align - 1) / align * align;
    int64_t lo = (int64_t)r * chunk < n ? (int64_t)r * chunk : n;
    int64_t hi = lo + chunk < n ? lo + chunk : n;
    for (int p = 0; p < W; p++) lc->srcs[p] = at(s[p].coll.recv, lo, esz);
    reduce_elems(&m, at(coll->recv, lo, esz), lc->srcs, W, hi - lo, coll);
    device_done(&m);
    sync_ranks(lc); /* every chunk reduced (and every read of the unreduced inputs done) */
    for (int k = 1; k < W; k++) {
      int p = (r + k) % W;
      int64_t plo = (int64_t)p * chunk < n ? (int64_t)p * chunk : n;
      int64_t phi = plo + chunk < n ? plo + chunk : n;
      copy_elems(&m, at(coll->recv, plo, esz), at(s[p].coll.recv, plo, esz), phi - plo, esz);
    }
    break;
  }
  case FSDP_COLL_BROADCAST:
    if (r != coll->root) copy_elems(&m, coll->recv, s[coll->root].coll.recv, n, esz);
    break;
  default: break;
  }
  device_done(&m);
  sync_ranks(lc); /* nobody returns while a peer may still read its buffers */
  /* a failed device operation: this rank's result is wrong, so the ranks no longer agree */
  return m.rc ? device_failed(c, coll, seq) : FSDP_OK;
}

/* ---- communicators ------------------------------------------------------------------------- */

static void local_free(fsdp_comm *c) {
  local_comm *lc = fsdp_comm_impl(c);
  fsdp_local_group *g = lc->g;
  pthread_mutex_lock(g->mu);
  g->slot[lc->rank].left = true;
  g->nleft++;
  pthread_cond_broadcast(g->cv);
  pthread_mutex_unlock(g->mu);
  free(lc->srcs);
  free(lc);
  fsdp_local_group_release(g);
}

/* Every rank of c calls it at once (fsdp_comm_split). The first member of a color to come
 * makes the sub-group (in the family: it shares the root's lock and poison) and leaves it in
 * the root's list of splits in progress, keyed by the parent group, the split's tag and the
 * color; the others find it there; the last to join takes it off the list. */
static int local_split(fsdp_comm *c, const fsdp_split *sp, fsdp_comm **out) {
  local_comm *lc = fsdp_comm_impl(c);
  fsdp_local_group *g = lc->g, *fam = g->fam;
  pthread_mutex_lock(g->mu);
  split_entry *e = fam->splits;
  while (e && !(e->parent == g && e->tag == sp->tag && e->color == sp->color)) e = e->next;
  if (!e) {
    e = calloc(1, sizeof *e);
    fsdp_local_group *sub =
        e ? calloc(1, sizeof *sub + (size_t)sp->world * sizeof(local_slot)) : NULL;
    if (!sub) {
      pthread_mutex_unlock(g->mu);
      free(e);
      return fsdp_error("local communicator: out of memory for a sub-group");
    }
    sub->world = sp->world;
    sub->refs = 1; /* the entry's, dropped by the last member to join */
    sub->fam = fam;
    sub->mu = fam->mu;
    sub->cv = fam->cv;
    fam->refs++; /* the sub-group's on the root (its lock) */
    *e = (split_entry){.parent = g, .tag = sp->tag, .color = sp->color, .g = sub,
                       .next = fam->splits};
    fam->splits = e;
  }
  fsdp_local_group *sub = e->g;
  sub->refs++; /* this member's, while it makes its communicator */
  bool last = ++e->joined == sp->world;
  if (last) {
    split_entry **at = &fam->splits;
    while (*at != e) at = &(*at)->next;
    *at = e->next;
    free(e);
    sub->refs--; /* the entry's: every member holds its own now */
  }
  pthread_mutex_unlock(g->mu);
  int rc = fsdp_comm_local_new(out, sub, sp->rank);
  fsdp_local_group_release(sub);
  return rc;
}

static const fsdp_comm_i local_vt = {
    .name = "local",
    .run = local_run,
    .host_buffers = true,
    .device_buffers = true,
    .abort = local_abort,
    .free = local_free,
    .poisoned = local_poisoned,
    .revive = local_revive,
    .split = local_split,
};

int fsdp_comm_local_new(fsdp_comm **out, fsdp_local_group *g, int rank) {
  *out = NULL;
  if (!g) return fsdp_error("local communicator: no group");
  if (rank < 0 || rank >= g->world) {
    return fsdp_error("local communicator: rank %d out of range for world %d", rank, g->world);
  }
  local_comm *lc = calloc(1, sizeof *lc);
  const void **srcs = calloc((size_t)g->world, sizeof *srcs);
  if (!lc || !srcs) {
    free(lc);
    free(srcs);
    return fsdp_error("local communicator: out of memory");
  }
  lc->g = g;
  lc->rank = rank;
  lc->srcs = srcs;
  pthread_mutex_lock(g->mu);
  if (g->slot[rank].joined) {
    pthread_mutex_unlock(g->mu);
    free(srcs);
    free(lc);
    return fsdp_error("local communicator: rank %d already has a communicator in this group",
                      rank);
  }
  g->slot[rank].joined = true;
  g->refs++;
  pthread_mutex_unlock(g->mu);
  if (fsdp_comm_new_backend_timeout(out, &local_vt, lc, rank, g->world, g->fam->timeout) !=
      FSDP_OK) {
    pthread_mutex_lock(g->mu);
    g->slot[rank].joined = false;
    pthread_mutex_unlock(g->mu);
    free(srcs);
    free(lc);
    fsdp_local_group_release(g);
    return FSDP_ERR;
  }
  return FSDP_OK;
}
