/*
 * comm.c — the generic layer of the communicator (comm.h): sequence numbers, the request queue
 * and its worker thread, label fingerprint bookkeeping, the flight recorder, the counters, the
 * calling thread's current communicator, and the world of one.
 *
 * Threads and locks: everything mutable in a fsdp_comm is guarded by c->mu, except what only
 * the thread running a collective touches (run_full_check, read by the backend on that same thread). The backend runs with c->mu released, so stats and the recorder stay readable while
 * a collective blocks. One collective runs at a time per communicator: on the worker thread, or
 * inline on the caller when nothing is queued or running (a blocking call with an idle queue;
 * any call on a world of one, which never waits). Requests leave the queue in FIFO order, which
 * is sequence order.
 *
 * Error messages: a collective that fails on the worker thread leaves its message in the
 * worker's (thread-local) error slot; exec_end() copies it, with the flight recorder appended, into
 * the request, and fsdp_comm_wait moves it into the waiter's slot.
 *
 * Families (fsdp_comm_split): a sub-communicator is linked under its parent (g_family_mu guards
 * the links); a poison or a failed collective on any member poisons every member.
 */
#include "comm/comm.h"
#include "kernels/kernels.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FSDP_COMM_RECORDER 64
/* Messages are built to fit the engine's error slot (FSDP_ERROR_CAP bytes, core.h). */
#define FSDP_COMM_MSG_CAP FSDP_ERROR_CAP
#define FSDP_COMM_DEFAULT_TIMEOUT 60.0

typedef enum { REC_EMPTY = 0, REC_QUEUED, REC_RUNNING, REC_DONE, REC_FAILED } rec_state;
static const char *const rec_state_name[] = {"", "queued", "running", "done", "failed"};

typedef struct rec_entry {
  uint64_t seq;
  fsdp_coll_op op;
  fsdp_dtype dtype;
  int64_t count;
  char label[64];
  double t_issue, t_start, t_end; /* monotonic seconds */
  rec_state state;
} rec_entry;

struct fsdp_comm_req {
  fsdp_comm *c;
  fsdp_coll coll;
  uint64_t seq;
  bool full_check;
  bool done;    /* guarded by c->mu */
  int rc;
  char *msg;    /* failure message (malloc'd), NULL on success */
  void *native; /* backend handle (vt->start) */
  fsdp_comm_req *next;             /* queue link */
  fsdp_comm_req *prev_out, *next_out; /* outstanding list (not yet waited) */
};

struct fsdp_comm {
  const fsdp_comm_i *vt;
  void *impl;
  int rank, world;
  double t0; /* creation time */

  pthread_mutex_t mu;
  pthread_cond_t work_cv; /* worker: a request was queued, the caller's inline run ended, stop */
  pthread_cond_t done_cv; /* waiters: a request completed */
  uint64_t seq;           /* last sequence number issued */
  fsdp_comm_req *head, *tail;  /* queued, not yet running */
  fsdp_comm_req *outstanding;  /* every handle not yet waited */
  bool worker_started, worker_busy, inline_busy, stop;
  pthread_t worker;

  double timeout;         /* seconds, > 0 */
  double default_timeout; /* the creator's, else FSDP_TIMEOUT or 60 */
  bool full_check; /* FSDP_COMM_CHECK=full: every rank's fingerprint reaches every rank */
  fsdp_comm_stats stats;
  rec_entry rec[FSDP_COMM_RECORDER];

  /* poison for backends without an abort slot (a world of one) */
  bool poisoned;
  char poison[FSDP_COMM_MSG_CAP];

  /* fsdp_comm_set_refuse's message ("" when collectives are allowed); under mu */
  char refuse[FSDP_COMM_MSG_CAP];

  bool run_full_check;   /* likewise */

  /* the family (fsdp_comm_split): links under g_family_mu */
  fsdp_comm *parent, *children, *next_sibling;
  int family_rank;     /* this rank in the family's root: what messages name */
  int hybrid_size;     /* a child made by fsdp_comm_hybrid for this shard_size (0: not) */
  bool hybrid_replicate; /* ... its replicate member (else its shard member) */
  int hybrid_last;     /* the last shard_size fsdp_comm_hybrid made a pair for (0: none) */
};

/* Guards every communicator's family links. Recursive: poisoning a family calls backends'
 * abort, and a backend stacked on another communicator (nccl) poisons that one in turn. */
static pthread_mutex_t g_family_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- names and fingerprints ------------------------------------------------------------- */

const char *fsdp_coll_name(fsdp_coll_op op) {
  static const char *const names[] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast",
                                      "barrier"};
  return (unsigned)op < FSDP_COLL_COUNT ? names[op] : "?";
}

const char *fsdp_reduce_name(fsdp_reduce_op red) {
  static const char *const names[] = {"sum", "avg", "max", "min"};
  return (unsigned)red <= FSDP_RED_MIN ? names[red] : "?";
}

static bool op_has_red(fsdp_coll_op op) {
  return op == FSDP_COLL_REDUCE_SCATTER || op == FSDP_COLL_ALL_REDUCE;
}

/* Where a collective's buffers live, by name: "host" for host memory. */
static const char *coll_place(const fsdp_coll *k) {
  return k->device && !k->device->host_memory ? k->device->name : "host";
}

bool fsdp_coll_matches(const fsdp_coll *a, const fsdp_coll *b) {
  if (a->op != b->op || a->dtype != b->dtype || a->count != b->count) return false;
  if (strcmp(coll_place(a), coll_place(b)) != 0) return false;
  if (op_has_red(a->op) && a->red != b->red) return false;
  if (a->op == FSDP_COLL_BROADCAST && a->root != b->root) return false;
  if (strncmp(a->label, b->label, sizeof a->label) != 0) return false;
  return true;
}

/* splitmix64's finaliser: every input bit moves every output bit */
static uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

uint64_t fsdp_coll_hash(const fsdp_coll *k, uint64_t seq) {
  /* exactly what fsdp_coll_matches compares (red and root only where they apply), and seq */
  uint64_t h = mix64(seq ^ 0x6673647072756e31ull);
  h = mix64(h ^ (uint64_t)k->op);
  h = mix64(h ^ (uint64_t)k->dtype);
  h = mix64(h ^ (uint64_t)k->count);
  h = mix64(h ^ (op_has_red(k->op) ? (uint64_t)k->red + 1 : 0));
  h = mix64(h ^ (k->op == FSDP_COLL_BROADCAST ? (uint64_t)(uint32_t)k->root + 1 : 0));
  for (const char *p = coll_place(k); *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ull;
  h = mix64(h);
  size_t n = strnlen(k->label, sizeof k->label);
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)k->label[i]) * 1099511628211ull;
  return mix64(h ^ n);
}

void fsdp_coll_check_init(uint64_t v[FSDP_CHECK_WORDS], const fsdp_coll *k, uint64_t seq,
                          bool full) {
  uint64_t h = fsdp_coll_hash(k, seq);
  v[0] = h;
  v[1] = ~h;
  v[FSDP_CHECK_FULL] = full;
}

void fsdp_coll_check_fold(uint64_t acc[FSDP_CHECK_WORDS], const uint64_t v[FSDP_CHECK_WORDS]) {
  for (int i = 0; i < FSDP_CHECK_WORDS; i++)
    if (v[i] > acc[i]) acc[i] = v[i];
}

bool fsdp_coll_check_agrees(const uint64_t acc[FSDP_CHECK_WORDS]) {
  /* max(h) == min(h) = ~max(~h): every rank's hash is the same */
  return acc[0] == ~acc[1];
}

char *fsdp_coll_describe(char *buf, size_t n, const fsdp_coll *coll) {
  const char *dt = fsdp_dtype_name(coll->dtype);
  if (coll->op == FSDP_COLL_BARRIER) {
    snprintf(buf, n, "barrier('%.63s')", coll->label);
  } else if (op_has_red(coll->op)) {
    snprintf(buf, n, "%s(%s x%lld %s, '%.63s')", fsdp_coll_name(coll->op), dt,
             (long long)coll->count, fsdp_reduce_name(coll->red), coll->label);
  } else if (coll->op == FSDP_COLL_BROADCAST) {
    snprintf(buf, n, "broadcast(%s x%lld root %d, '%.63s')", dt, (long long)coll->count,
             coll->root, coll->label);
  } else {
    snprintf(buf, n, "%s(%s x%lld, '%.63s')", fsdp_coll_name(coll->op), dt,
             (long long)coll->count, coll->label);
  }
  if (strcmp(coll_place(coll), "host") != 0) {
    size_t at = strlen(buf);
    if (at < n) snprintf(buf + at, n - at, " on %s", coll_place(coll));
  }
  return buf;
}

int fsdp_comm_describe_missing(char *buf, size_t n, int world, fsdp_comm_peer_fn peer,
                               const void *ctx) {
  char where[64];
  bool left;
  int missing = 0;
  for (int p = 0; p < world; p++) missing += peer(ctx, p, where, sizeof where, &left);
  if (n > 0) buf[0] = '\0';
  if (missing == 0) return 0;
  size_t at = (size_t)snprintf(buf, n, "%s", missing == 1 ? "rank " : "ranks ");
  for (int p = 0, k = 0; p < world && at < n; p++)
    if (peer(ctx, p, where, sizeof where, &left))
      at += (size_t)snprintf(buf + at, n - at, "%s%d", k++ ? ", " : "", p);
  if (at < n)
    at += (size_t)snprintf(buf + at, n - at, " %s not arrived (%s reached:",
                           missing == 1 ? "has" : "have",
                           missing == 1 ? "sequence number it" : "sequence numbers they");
  for (int p = 0, k = 0; p < world && at < n; p++)
    if (peer(ctx, p, where, sizeof where, &left))
      at += (size_t)snprintf(buf + at, n - at, "%s rank %d %s%s", k++ ? "," : "", p, where,
                             left ? " (left)" : "");
  if (at < n) snprintf(buf + at, n - at, ")");
  return missing;
}

int64_t fsdp_coll_bytes(const fsdp_coll *coll, int world) {
  int64_t elem = (int64_t)fsdp_dtype_size(coll->dtype);
  switch (coll->op) {
  case FSDP_COLL_ALL_GATHER:
  case FSDP_COLL_REDUCE_SCATTER: return coll->count * world * elem;
  case FSDP_COLL_ALL_REDUCE:
  case FSDP_COLL_BROADCAST: return coll->count * elem;
  default: return 0;
  }
}

/* ---- environment ------------------------------------------------------------------------ */

static int env_timeout(double *out, bool strict) {
  *out = FSDP_COMM_DEFAULT_TIMEOUT;
  const char *s = getenv("FSDP_TIMEOUT");
  if (!s || !*s) return FSDP_OK;
  char *end;
  double v = strtod(s, &end);
  while (*end == ' ') end++;
  if (end == s || *end || !(v > 0) || !isfinite(v)) {
    if (!strict) return FSDP_OK;
    return fsdp_error("FSDP_TIMEOUT: expected a number of seconds > 0, got '%s'", s);
  }
  *out = v;
  return FSDP_OK;
}

/* FSDP_COMM_CHECK: "hash" (the default: the ranks agree on a hash of their fingerprints in
 * O(log N), the full fingerprints move only after a mismatch) or "full" (every rank's full
 * fingerprint reaches every rank on every collective: O(N) per rank, the check as it was before
 * hashing; kept for measurement and for suspicion of the hash). */
static int env_full_check(bool *out, bool strict) {
  *out = false;
  const char *s = getenv("FSDP_COMM_CHECK");
  if (!s || !*s || strcmp(s, "hash") == 0) return FSDP_OK;
  if (strcmp(s, "full") == 0) {
    *out = true;
    return FSDP_OK;
  }
  if (!strict) return FSDP_OK;
  return fsdp_error("FSDP_COMM_CHECK: expected 'hash' or 'full', got '%s'", s);
}

/* ---- creation ------------------------------------------------------------------------------ */

/* timeout > 0: the default timeout, given by the creator in place of FSDP_TIMEOUT, which is then
 * not read (a malformed value there must not fail a communicator that never uses it). */
static int comm_create(fsdp_comm **out, const fsdp_comm_i *vt, void *impl, int rank, int world,
                       bool strict_env, double timeout) {
  *out = NULL;
  if (!(timeout > 0 && isfinite(timeout)) && env_timeout(&timeout, strict_env) != FSDP_OK)
    return FSDP_ERR;
  bool full_check;
  if (env_full_check(&full_check, strict_env) != FSDP_OK) return FSDP_ERR;
  fsdp_comm *c = calloc(1, sizeof *c);
  if (!c) return fsdp_error("communicator: out of memory");
  c->vt = vt;
  c->impl = impl;
  c->rank = rank;
  c->world = world;
  c->t0 = now_s();
  c->timeout = c->default_timeout = timeout;
  c->full_check = full_check;
  c->family_rank = rank;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->work_cv, NULL);
  pthread_cond_init(&c->done_cv, NULL);
  *out = c;
  return FSDP_OK;
}

int fsdp_comm_new_backend_timeout(fsdp_comm **out, const fsdp_comm_i *vt, void *impl, int rank,
                                  int world, double timeout) {
  if (!vt || !vt->run) return fsdp_error("communicator: backend without run");
  if (world < 1 || rank < 0 || rank >= world) {
    return fsdp_error("communicator: rank %d out of range for world %d", rank, world);
  }
  return comm_create(out, vt, impl, rank, world, true, timeout);
}

int fsdp_comm_new_backend(fsdp_comm **out, const fsdp_comm_i *vt, void *impl, int rank,
                          int world) {
  return fsdp_comm_new_backend_timeout(out, vt, impl, rank, world, 0);
}

void *fsdp_comm_impl(const fsdp_comm *c) { return c->impl; }


int fsdp_comm_rank(const fsdp_comm *c) { return c->rank; }
int fsdp_comm_world(const fsdp_comm *c) { return c->world; }
const char *fsdp_comm_backend(const fsdp_comm *c) { return c->vt->name; }

/* ---- flight recorder --------------------------------------------------------------------- */

static void fmt_duration(char *buf, size_t n, double s) {
  if (s < 1.0) snprintf(buf, n, "%.1f ms", s * 1e3);
  else snprintf(buf, n, "%.2f s", s);
}

static int rec_line(char *buf, size_t n, const rec_entry *e, double now) {
  char dur[32] = "";
  switch (e->state) {
  case REC_QUEUED: fmt_duration(dur, sizeof dur, now - e->t_issue); break;
  case REC_RUNNING: fmt_duration(dur, sizeof dur, now - e->t_start); break;
  default: fmt_duration(dur, sizeof dur, e->t_end - e->t_start); break;
  }
  char what[40];
  if (e->op == FSDP_COLL_BARRIER) snprintf(what, sizeof what, "barrier");
  else snprintf(what, sizeof what, "%s %s x%lld", fsdp_coll_name(e->op),
                fsdp_dtype_name(e->dtype), (long long)e->count);
  return snprintf(buf, n, "#%llu %s '%s' %s %s\n", (unsigned long long)e->seq, what, e->label,
                  rec_state_name[e->state], dur);
}

/* Render the recorder into buf (n bytes with the NUL), newest last, dropping the oldest lines
 * that do not fit. Caller holds c->mu. Returns the length written. */
static size_t rec_render_locked(const fsdp_comm *c, char *buf, size_t n) {
  if (n == 0) return 0;
  buf[0] = '\0';
  double now = now_s();
  /* entries in sequence order: seqs c->seq - k + 1 .. c->seq live at seq % RECORDER */
  uint64_t newest = c->seq;
  uint64_t have = newest < FSDP_COMM_RECORDER ? newest : FSDP_COMM_RECORDER;
  if (have == 0) {
    snprintf(buf, n, "(no collectives)\n");
    return strlen(buf);
  }
  /* walk from the newest back while the lines fit, then write them oldest first */
  size_t total = 0;
  uint64_t first = newest + 1;
  char line[192];
  for (uint64_t k = 0; k < have; k++) {
    const rec_entry *e = &c->rec[(newest - k) % FSDP_COMM_RECORDER];
    int len = rec_line(line, sizeof line, e, now);
    if (len < 0) break;
    if (total + (size_t)len + 1 > n) break;
    total += (size_t)len;
    first = newest - k;
  }
  size_t at = 0;
  for (uint64_t s = first; s <= newest && first <= newest; s++) {
    const rec_entry *e = &c->rec[s % FSDP_COMM_RECORDER];
    int len = rec_line(buf + at, n - at, e, now);
    if (len < 0 || at + (size_t)len >= n) break;
    at += (size_t)len;
  }
  buf[at] = '\0';
  return at;
}

char *fsdp_comm_flight_recorder(const fsdp_comm *c, char *buf, size_t n) {
  if (!buf || n == 0) return buf;
  fsdp_comm *m = (fsdp_comm *)c; /* the lock is not part of the logical state */
  pthread_mutex_lock(&m->mu);
  rec_render_locked(c, buf, n);
  pthread_mutex_unlock(&m->mu);
  return buf;
}

/* "<msg>\nflight recorder (rank R, newest last):\n<lines>" into a new buffer of the error
 * slot's size. Caller holds c->mu. */
static char *failure_message_locked(const fsdp_comm *c, const char *msg) {
  char *out = malloc(FSDP_COMM_MSG_CAP);
  if (!out) return NULL;
  int len = snprintf(out, FSDP_COMM_MSG_CAP, "%s\nflight recorder (rank %d, newest last):\n",
                     msg, c->family_rank);
  if (len < 0 || (size_t)len >= FSDP_COMM_MSG_CAP - 1) return out;
  size_t at = (size_t)len;
  at += rec_render_locked(c, out + at, FSDP_COMM_MSG_CAP - at);
  if (at > 0 && out[at - 1] == '\n') out[at - 1] = '\0'; /* no trailing newline */
  return out;
}

/* ---- stats -------------------------------------------------------------------------------- */

void fsdp_comm_get_stats(const fsdp_comm *c, fsdp_comm_stats *out) {
  fsdp_comm *m = (fsdp_comm *)c;
  pthread_mutex_lock(&m->mu);
  *out = c->stats;
  pthread_mutex_unlock(&m->mu);
}

void fsdp_comm_reset_stats(fsdp_comm *c) {
  pthread_mutex_lock(&c->mu);
  memset(&c->stats, 0, sizeof c->stats);
  pthread_mutex_unlock(&c->mu);
}

/* ---- settings and failure --------------------------------------------------------------- */

void fsdp_comm_set_timeout(fsdp_comm *c, double seconds) {
  pthread_mutex_lock(&c->mu);
  c->timeout = seconds > 0 && isfinite(seconds) ? seconds : c->default_timeout;
  pthread_mutex_unlock(&c->mu);
}

double fsdp_comm_timeout(const fsdp_comm *c) {
  fsdp_comm *m = (fsdp_comm *)c;
  pthread_mutex_lock(&m->mu);
  double t = c->timeout;
  pthread_mutex_unlock(&m->mu);
  return t;
}

void fsdp_comm_set_full_check(fsdp_comm *c, bool on) {
  pthread_mutex_lock(&c->mu);
  c->full_check = on;
  pthread_mutex_unlock(&c->mu);
}

bool fsdp_comm_full_check(const fsdp_comm *c) { return c->run_full_check; }

void fsdp_comm_abort(fsdp_comm *c, const char *msg) {
  if (!c) return;
  char full[FSDP_COMM_MSG_CAP];
  snprintf(full, sizeof full, "rank %d failed: %s", c->family_rank, msg ? msg : "(no message)");
  fsdp_comm_poison(c, full);
}

static void poison_one(fsdp_comm *c, const char *full) {
  if (c->vt->abort) {
    c->vt->abort(c, full);
    return;
  }
  pthread_mutex_lock(&c->mu);
  if (!c->poisoned) {
    c->poisoned = true;
    snprintf(c->poison, sizeof c->poison, "%s", full);
  }
  pthread_mutex_unlock(&c->mu);
}

static void poison_tree(fsdp_comm *c, const char *full) {
  poison_one(c, full);
  for (fsdp_comm *k = c->children; k; k = k->next_sibling) poison_tree(k, full);
}

/* The whole family: a rank waiting in a sub-communicator must fail too when a rank outside its
 * group fails (it may be waiting for a peer that waits for the failed rank). */
void fsdp_comm_poison(fsdp_comm *c, const char *full) {
  if (!c) return;
  pthread_mutex_lock(&g_family_mu);
  fsdp_comm *root = c;
  while (root->parent) root = root->parent;
  poison_tree(root, full);
  pthread_mutex_unlock(&g_family_mu);
}

/* A collective of a family member failed: its group is poisoned (by the backend); the rest of
 * the family follows with the same message ("rank R failed: ..." as it came, else this rank's). */
static void family_failed(fsdp_comm *c, const char *msg) {
  pthread_mutex_lock(&g_family_mu);
  bool family = c->parent || c->children;
  pthread_mutex_unlock(&g_family_mu);
  if (!family) return;
  char *end;
  bool formatted = strncmp(msg, "rank ", 5) == 0 && (strtol(msg + 5, &end, 10), end > msg + 5) &&
                   strncmp(end, " failed: ", 9) == 0;
  if (formatted) {
    char full[FSDP_COMM_MSG_CAP];
    snprintf(full, sizeof full, "%s", msg);
    char *rec = strstr(full, "\nflight recorder (");
    if (rec) *rec = '\0';
    fsdp_comm_poison(c, full);
  } else {
    fsdp_comm_abort(c, msg);
  }
}

uint64_t fsdp_comm_drain(fsdp_comm *c) {
  pthread_mutex_lock(&c->mu);
  while (c->head || c->worker_busy || c->inline_busy) pthread_cond_wait(&c->done_cv, &c->mu);
  uint64_t seq = c->seq;
  pthread_mutex_unlock(&c->mu);
  return seq;
}

int fsdp_comm_revive(fsdp_comm *c, uint64_t seq) {
  pthread_mutex_lock(&g_family_mu);
  bool family = c->parent || c->children;
  pthread_mutex_unlock(&g_family_mu);
  if (family)
    return fsdp_error("cannot revive the communicator: it belongs to a family with "
                      "sub-communicators (hybrid sharding), whose members cannot be revived "
                      "together");
  if (c->vt->abort && !c->vt->revive)
    return fsdp_error("the %s backend cannot lift the poison of its group (collectives may "
                      "still be in flight)", c->vt->name);
  pthread_mutex_lock(&c->mu);
  uint64_t issued = c->seq;
  pthread_mutex_unlock(&c->mu);
  if (seq < issued)
    return fsdp_error("cannot revive the communicator at #%llu: rank %d issued #%llu already",
                      (unsigned long long)seq, c->rank, (unsigned long long)issued);
  /* the backend first (without c->mu: it takes its own locks), so that its refusal changes
   * nothing here */
  if (c->vt->revive && c->vt->revive(c, seq) != FSDP_OK) return FSDP_ERR;
  pthread_mutex_lock(&c->mu);
  /* the numbers this rank skips: recorded as such, not as older collectives' entries */
  for (uint64_t s = c->seq + 1; s <= seq && s - c->seq <= FSDP_COMM_RECORDER; s++) {
    rec_entry *e = &c->rec[s % FSDP_COMM_RECORDER];
    *e = (rec_entry){.seq = s, .op = FSDP_COLL_BARRIER, .state = REC_FAILED};
    snprintf(e->label, sizeof e->label, "(skipped: revived)");
  }
  c->seq = seq;
  c->poisoned = false;
  c->poison[0] = '\0';
  pthread_mutex_unlock(&c->mu);
  return FSDP_OK;
}

void fsdp_comm_set_refuse(fsdp_comm *c, const char *msg) {
  if (!c) return;
  pthread_mutex_lock(&c->mu);
  snprintf(c->refuse, sizeof c->refuse, "%s", msg ? msg : "");
  pthread_mutex_unlock(&c->mu);
}

bool fsdp_comm_poisoned(const fsdp_comm *c) {
  if (c->vt->poisoned) return c->vt->poisoned(c);
  fsdp_comm *m = (fsdp_comm *)c;
  pthread_mutex_lock(&m->mu);
  bool p = c->poisoned;
  pthread_mutex_unlock(&m->mu);
  return p;
}

/* ---- validation --------------------------------------------------------------------------- */

/* Whether [a, a + na) and [b, b + nb) share a byte (sizes in bytes). */
static bool overlaps(const void *a, int64_t na, const void *b, int64_t nb) {
  if (na == 0 || nb == 0) return false;
  uintptr_t a0 = (uintptr_t)a, a1 = a0 + (uintptr_t)na, b0 = (uintptr_t)b, b1 = b0 + (uintptr_t)nb;
  return a0 < b1 && b0 < a1;
}

/* p + i elements of esz bytes */
static const char *elem_at(const void *p, int64_t i, size_t esz) {
  return (const char *)p + i * (int64_t)esz;
}

static int validate(const fsdp_comm *c, const fsdp_coll *k) {
  char what[160];
  fsdp_coll_describe(what, sizeof what, k);
  if ((unsigned)k->op >= FSDP_COLL_COUNT) return fsdp_error("collective: unknown op %d", (int)k->op);
  if ((unsigned)k->dtype >= FSDP_DTYPE_COUNT)
    return fsdp_error("%s: unknown dtype %d", what, (int)k->dtype);
  if (k->count < 0) return fsdp_error("%s: negative count", what);
  if (k->count > INT64_MAX / 8 / c->world) return fsdp_error("%s: count too large", what);
  if (op_has_red(k->op) && (unsigned)k->red > FSDP_RED_MIN) {
    return fsdp_error("%s: unknown reduction %d", what, (int)k->red);
  }
  if (op_has_red(k->op) && !fsdp_comm_reduce_supported(k->dtype, k->red)) {
    if (k->dtype == FSDP_DTYPE_I64 && k->red == FSDP_RED_AVG)
      return fsdp_error("%s: avg is not defined for i64 (reduce with sum and divide)", what);
    return fsdp_error("%s: %s is not defined for %s (reductions take f32, bf16, f64, i64)", what,
                      fsdp_reduce_name(k->red), fsdp_dtype_name(k->dtype));
  }
  bool on_device = k->device && !k->device->host_memory;
  if (on_device && !c->vt->device_buffers) {
    return fsdp_error("%s: the buffers are on the %s device, but the %s backend moves host "
                      "memory only (move them to the cpu%s)", what, k->device->name, c->vt->name,
                      strcmp(k->device->name, "cuda") == 0 ? ", or use --backend nccl" : "");
  }
  if (!on_device && !c->vt->host_buffers) {
    return fsdp_error("%s: the buffers are in host memory, but the %s backend moves device "
                      "buffers only (move them to the GPU: t:to(\"cuda\"))", what, c->vt->name);
  }
  if (on_device && (!k->device->has_data || !k->device->copy)) {
    return fsdp_error("%s: the %s device has no data to move", what, k->device->name);
  }
  if (on_device && op_has_red(k->op) &&
      (!k->device->kernels || !k->device->kernels->reduce_ranks)) {
    return fsdp_error("%s: the %s device has no reduce_ranks kernel", what, k->device->name);
  }
  const size_t esz = fsdp_dtype_size(k->dtype);
  int64_t n = k->count * (int64_t)esz, w = c->world; /* bytes */
  switch (k->op) {
  case FSDP_COLL_ALL_GATHER:
    if (n > 0 && (!k->send || !k->recv)) return fsdp_error("%s: NULL buffer", what);
    if (k->send != elem_at(k->recv, c->rank * k->count, esz) &&
        overlaps(k->send, n, k->recv, n * w)) {
      return fsdp_error("%s: send overlaps recv (in place means send == recv + rank * count)",
                        what);
    }
    break;
  case FSDP_COLL_REDUCE_SCATTER:
    if (n > 0 && (!k->send || !k->recv)) return fsdp_error("%s: NULL buffer", what);
    if (k->recv != elem_at(k->send, c->rank * k->count, esz) &&
        overlaps(k->send, n * w, k->recv, n)) {
      return fsdp_error("%s: send overlaps recv (in place means recv == send + rank * count)",
                        what);
    }
    break;
  case FSDP_COLL_ALL_REDUCE:
    if (n > 0 && !k->recv) return fsdp_error("%s: NULL buffer", what);
    break;
  case FSDP_COLL_BROADCAST:
    if (k->root < 0 || k->root >= c->world) {
      return fsdp_error("%s: root %d out of range for world %d", what, k->root, c->world);
    }
    if (n > 0 && !k->recv) return fsdp_error("%s: NULL buffer", what);
    break;
  case FSDP_COLL_BARRIER:
    if (n != 0) return fsdp_error("%s: count must be 0", what);
    break;
  default: break;
  }
  return FSDP_OK;
}

/* ---- running ------------------------------------------------------------------------------ */

/* A request runs in two halves on the thread that runs it: begin (recorder "running", the
 * label flag, and for a native backend its start) and end (the collective itself or the native
 * wait, then the recorder, busy time and failure message). c->mu not held on entry. */
static void exec_begin(fsdp_comm *c, fsdp_comm_req *r) {
  rec_entry *e = &c->rec[r->seq % FSDP_COMM_RECORDER];
  pthread_mutex_lock(&c->mu);
  if (e->seq == r->seq) { /* (a ring slot may already hold a newer collective) */
    e->state = REC_RUNNING;
    e->t_start = now_s();
  }
  c->run_full_check = r->full_check;
  bool own_poison = !c->vt->abort && c->poisoned;
  char poison[FSDP_COMM_MSG_CAP];
  if (own_poison) memcpy(poison, c->poison, sizeof poison);
  pthread_mutex_unlock(&c->mu);
  r->rc = FSDP_OK;
  if (own_poison) r->rc = fsdp_error("%s", poison);
  else if (c->vt->start) r->rc = c->vt->start(c, &r->coll, r->seq, &r->native);
}

static void exec_end(fsdp_comm *c, fsdp_comm_req *r) {
  double t0 = now_s();
  int rc = r->rc;
  if (rc == FSDP_OK) {
    if (c->vt->start) rc = c->vt->wait(c, r->native);
    else rc = c->vt->run(c, &r->coll, r->seq);
  }
  pthread_mutex_lock(&c->mu);
  double t1 = now_s();
  rec_entry *e = &c->rec[r->seq % FSDP_COMM_RECORDER];
  /* busy: the collective's own time (for a native one, from its start to the end of wait) */
  double t_start = e->seq == r->seq ? e->t_start : t0;
  c->stats.busy_s += t1 - t_start;
  if (e->seq == r->seq) {
    e->state = rc == FSDP_OK ? REC_DONE : REC_FAILED;
    e->t_end = t1;
  }
  r->rc = rc;
  if (rc != FSDP_OK) r->msg = failure_message_locked(c, fsdp_error_msg());
  pthread_mutex_unlock(&c->mu);
  if (rc != FSDP_OK) family_failed(c, fsdp_error_msg());
}

static void *worker_main(void *arg) {
  fsdp_comm *c = arg;
  pthread_mutex_lock(&c->mu);
  for (;;) {
    while ((!c->head && !c->stop) || c->inline_busy) pthread_cond_wait(&c->work_cv, &c->mu);
    if (!c->head) break; /* stopping, and the queue is drained */
    fsdp_comm_req *r = c->head;
    c->head = r->next;
    if (!c->head) c->tail = NULL;
    r->next = NULL;
    c->worker_busy = true;
    pthread_mutex_unlock(&c->mu);
    exec_begin(c, r);
    exec_end(c, r);
    pthread_mutex_lock(&c->mu);
    r->done = true;
    c->worker_busy = false;
    pthread_cond_broadcast(&c->done_cv);
  }
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

typedef enum { PATH_INLINE, PATH_QUEUED, PATH_NATIVE } issue_path;

/* Issue a collective: validate, take a sequence number, record it, count it, and decide who
 * runs it: the caller now (inline), the worker (queued), or the backend natively. */
static int issue(fsdp_comm *c, const fsdp_coll *coll, bool blocking, fsdp_comm_req **out,
                 issue_path *path) {
  *out = NULL;
  if (!c) return fsdp_error("collective: no communicator");
  if (!coll) return fsdp_error("collective: no fsdp_coll");
  pthread_mutex_lock(&c->mu);
  bool refused = c->refuse[0] != '\0';
  if (refused) fsdp_error("%s '%s': %s", fsdp_coll_name(coll->op), coll->label, c->refuse);
  pthread_mutex_unlock(&c->mu);
  if (refused) return FSDP_ERR; /* this rank alone: nothing issued, nothing to poison */
  if (validate(c, coll) != FSDP_OK) {
    /* the peers would wait for this rank forever: fail them too */
    fsdp_comm_abort(c, fsdp_error_msg());
    return FSDP_ERR;
  }
  fsdp_comm_req *r = calloc(1, sizeof *r);
  if (!r) {
    fsdp_error("%s: out of memory", fsdp_coll_name(coll->op));
    fsdp_comm_abort(c, fsdp_error_msg());
    return FSDP_ERR;
  }
  r->c = c;
  r->coll = *coll;
  r->coll.label[sizeof r->coll.label - 1] = '\0';

  pthread_mutex_lock(&c->mu);
  /* Inline when nothing is ahead of it and waiting on the caller's thread costs nothing: a
   * blocking call, or a world of one (it never waits on peers). A native backend orders its
   * own collectives: every one is started here, in sequence order. */
  bool idle = !c->head && !c->worker_busy && !c->inline_busy;
  if (c->vt->start) *path = PATH_NATIVE;
  else if (idle && (blocking || c->world == 1)) *path = PATH_INLINE;
  else *path = PATH_QUEUED;
  if (*path == PATH_QUEUED && !c->worker_started) {
    if (pthread_create(&c->worker, NULL, worker_main, c) != 0) {
      pthread_mutex_unlock(&c->mu);
      free(r);
      fsdp_error("%s: cannot start the communicator's worker thread", fsdp_coll_name(coll->op));
      fsdp_comm_abort(c, fsdp_error_msg());
      return FSDP_ERR;
    }
    c->worker_started = true;
  }
  r->seq = ++c->seq;
  r->full_check = c->full_check;
  rec_entry *e = &c->rec[r->seq % FSDP_COMM_RECORDER];
  memset(e, 0, sizeof *e);
  e->seq = r->seq;
  e->op = coll->op;
  e->dtype = coll->dtype;
  e->count = coll->count;
  memcpy(e->label, r->coll.label, sizeof e->label);
  e->t_issue = now_s();
  e->state = REC_QUEUED;
  c->stats.calls[coll->op]++;
  c->stats.bytes[coll->op] += fsdp_coll_bytes(coll, c->world);
  r->next_out = c->outstanding; /* outstanding list, for fsdp_comm_free */
  if (c->outstanding) c->outstanding->prev_out = r;
  c->outstanding = r;
  if (*path == PATH_INLINE) {
    c->inline_busy = true;
  } else if (*path == PATH_QUEUED) {
    if (c->tail) c->tail->next = r;
    else c->head = r;
    c->tail = r;
    pthread_cond_signal(&c->work_cv);
  }
  pthread_mutex_unlock(&c->mu);
  *out = r;
  return FSDP_OK;
}

static void run_inline_now(fsdp_comm *c, fsdp_comm_req *r) {
  exec_begin(c, r);
  exec_end(c, r);
  pthread_mutex_lock(&c->mu);
  r->done = true;
  c->inline_busy = false;
  pthread_cond_signal(&c->work_cv);
  pthread_cond_broadcast(&c->done_cv);
  pthread_mutex_unlock(&c->mu);
}

static int issue_and_dispatch(fsdp_comm *c, const fsdp_coll *coll, bool blocking,
                              fsdp_comm_req **out) {
  issue_path path = PATH_QUEUED;
  if (issue(c, coll, blocking, out, &path) != FSDP_OK) return FSDP_ERR;
  if (path == PATH_INLINE) run_inline_now(c, *out);
  else if (path == PATH_NATIVE) exec_begin(c, *out); /* finished in fsdp_comm_wait */
  return FSDP_OK;
}

int fsdp_comm_start(fsdp_comm *c, const fsdp_coll *coll, fsdp_comm_req **req) {
  *req = NULL;
  return issue_and_dispatch(c, coll, false, req);
}

/* Wait for r (or, native, finish it here), unlink and free it; its status, with its message
 * in the calling thread's error slot. */
static int finish(fsdp_comm_req *r, double t_wait0) {
  fsdp_comm *c = r->c;
  if (c->vt->start) {
    exec_end(c, r);
    pthread_mutex_lock(&c->mu);
    r->done = true;
  } else {
    pthread_mutex_lock(&c->mu);
    while (!r->done) pthread_cond_wait(&c->done_cv, &c->mu);
  }
  c->stats.wait_s += now_s() - t_wait0;
  if (r->prev_out) r->prev_out->next_out = r->next_out;
  else c->outstanding = r->next_out;
  if (r->next_out) r->next_out->prev_out = r->prev_out;
  pthread_mutex_unlock(&c->mu);
  int rc = r->rc;
  if (rc != FSDP_OK) {
    if (r->msg) fsdp_error("%s", r->msg);
    else fsdp_error("%s #%llu failed (out of memory for its message)",
                    fsdp_coll_name(r->coll.op), (unsigned long long)r->seq);
  }
  free(r->msg);
  free(r);
  return rc;
}

int fsdp_comm_wait(fsdp_comm_req *req) {
  if (!req) return fsdp_error("fsdp_comm_wait: NULL handle");
  return finish(req, now_s());
}

int fsdp_comm_run(fsdp_comm *c, const fsdp_coll *coll) {
  double t0 = now_s();
  fsdp_comm_req *r;
  if (issue_and_dispatch(c, coll, true, &r) != FSDP_OK) return FSDP_ERR;
  return finish(r, t0);
}

/* ---- the blocking shorthands ---------------------------------------------------------------- */

static void set_label(fsdp_coll *k, const char *label) {
  snprintf(k->label, sizeof k->label, "%s", label ? label : "");
}

int fsdp_comm_all_gather(fsdp_comm *c, void *recv, const void *send, int64_t count,
                         fsdp_dtype dtype, const char *label) {
  fsdp_coll k = {.op = FSDP_COLL_ALL_GATHER, .dtype = dtype, .count = count, .send = send,
                 .recv = recv};
  set_label(&k, label);
  return fsdp_comm_run(c, &k);
}

int fsdp_comm_reduce_scatter(fsdp_comm *c, void *recv, const void *send, int64_t count,
                             fsdp_dtype dtype, fsdp_reduce_op red, const char *label) {
  fsdp_coll k = {.op = FSDP_COLL_REDUCE_SCATTER, .dtype = dtype, .red = red, .count = count,
                 .send = send, .recv = recv};
  set_label(&k, label);
  return fsdp_comm_run(c, &k);
}

int fsdp_comm_all_reduce(fsdp_comm *c, void *buf, int64_t count, fsdp_dtype dtype,
                         fsdp_reduce_op red, const char *label) {
  fsdp_coll k = {.op = FSDP_COLL_ALL_REDUCE, .dtype = dtype, .red = red, .count = count,
                 .recv = buf};
  set_label(&k, label);
  return fsdp_comm_run(c, &k);
}

int fsdp_comm_broadcast(fsdp_comm *c, void *buf, int64_t count, fsdp_dtype dtype, int root,
                        const char *label) {
  fsdp_coll k = {.op = FSDP_COLL_BROADCAST, .dtype = dtype, .root = root, .count = count,
                 .recv = buf};
  set_label(&k, label);
  return fsdp_comm_run(c, &k);
}

int fsdp_comm_barrier(fsdp_comm *c, const char *label) {
  fsdp_coll k = {.op = FSDP_COLL_BARRIER, .dtype = FSDP_DTYPE_F32};
  set_label(&k, label);
  return fsdp_comm_run(c, &k);
}

/* ---- freeing and the current communicator --------------------------------------------------- */

static _Thread_local fsdp_comm *tl_current;
static pthread_key_t lazy_key;
static pthread_once_t lazy_once = PTHREAD_ONCE_INIT;

void fsdp_comm_free(fsdp_comm *c) {
  if (!c) return;
  /* sub-communicators first (each waits for its own collectives), then out of the parent's list */
  for (;;) {
    pthread_mutex_lock(&g_family_mu);
    fsdp_comm *k = c->children;
    pthread_mutex_unlock(&g_family_mu);
    if (!k) break;
    fsdp_comm_free(k);
  }
  pthread_mutex_lock(&g_family_mu);
  if (c->parent) {
    fsdp_comm **at = &c->parent->children;
    while (*at && *at != c) at = &(*at)->next_sibling;
    if (*at) *at = c->next_sibling;
    c->parent = NULL;
  }
  pthread_mutex_unlock(&g_family_mu);
  if (tl_current == c) tl_current = NULL;
  pthread_mutex_lock(&c->mu);
  c->stop = true;
  pthread_cond_broadcast(&c->work_cv);
  bool joined = c->worker_started;
  pthread_mutex_unlock(&c->mu);
  if (joined) pthread_join(c->worker, NULL); /* drains the queue first */
  /* handles nobody waited on (a native one is finished first: the backend holds it) */
  for (fsdp_comm_req *r = c->outstanding, *next; r; r = next) {
    next = r->next_out;
    if (c->vt->start && r->rc == FSDP_OK && !r->done) c->vt->wait(c, r->native);
    free(r->msg);
    free(r);
  }
  if (c->vt->free) c->vt->free(c);
  pthread_cond_destroy(&c->done_cv);
  pthread_cond_destroy(&c->work_cv);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

static void lazy_destroy(void *p) { fsdp_comm_free(p); }
static void lazy_make_key(void) { pthread_key_create(&lazy_key, lazy_destroy); }

void fsdp_comm_set_current(fsdp_comm *c) { tl_current = c; }

static int single_create(fsdp_comm **out, bool strict_env);

fsdp_comm *fsdp_comm_current(void) {
  if (tl_current) return tl_current;
  pthread_once(&lazy_once, lazy_make_key);
  fsdp_comm *c = pthread_getspecific(lazy_key);
  if (!c) {
    if (single_create(&c, false) != FSDP_OK) return NULL;
    pthread_setspecific(lazy_key, c);
  }
  return c;
}

/* ---- the world of one ----------------------------------------------------------------------- */

/* Every collective of one rank is a local copy; the reductions see one contribution, so sum,
 * max and min are the identity and avg multiplies or divides by 1 (the same bits). */
static int single_run(fsdp_comm *c, const fsdp_coll *k, uint64_t seq) {
  (void)c;
  (void)seq;
  if ((k->op == FSDP_COLL_ALL_GATHER || k->op == FSDP_COLL_REDUCE_SCATTER) && k->count > 0 &&
      k->recv != k->send) {
    size_t bytes = (size_t)k->count * fsdp_dtype_size(k->dtype);
    if (k->device && !k->device->host_memory)
      return k->device->copy(k->device->ctx, k->recv, k->send, bytes); /* in device order */
    memcpy(k->recv, k->send, bytes);
  }
  return FSDP_OK;
}

static const fsdp_comm_i single_vt = {
    .name = "local",
    .run = single_run,
    .host_buffers = true,
    .device_buffers = true,
};

static int single_create(fsdp_comm **out, bool strict_env) {
  return comm_create(out, &single_vt, NULL, 0, 1, strict_env, 0);
}

int fsdp_comm_single_new(fsdp_comm **out) { return single_create(out, true); }

/* ---- sub-communicators ------------------------------------------------------------------------ */

fsdp_comm *fsdp_comm_parent(const fsdp_comm *c) {
  pthread_mutex_lock(&g_family_mu);
  fsdp_comm *p = c->parent;
  pthread_mutex_unlock(&g_family_mu);
  return p;
}

int fsdp_comm_family_rank(const fsdp_comm *c) { return c->family_rank; }

/* Every rank of c: the ranks that passed `color`, in (key, rank) order. */
typedef struct {
  int64_t key;
  int rank;
} split_member;

static int member_cmp(const void *a, const void *b) {
  const split_member *x = a, *y = b;
  if (x->key != y->key) return x->key < y->key ? -1 : 1;
  return (x->rank > y->rank) - (x->rank < y->rank);
}

/* A world of one splits into a world of one. */
static int single_split(fsdp_comm *c, const fsdp_split *s, fsdp_comm **out) {
  (void)c;
  (void)s;
  return single_create(out, false);
}

int fsdp_comm_split(fsdp_comm *c, int color, int key, fsdp_comm **out) {
  *out = NULL;
  if (!c) return fsdp_error("comm split: no communicator");
  int (*split)(fsdp_comm *, const fsdp_split *, fsdp_comm **) =
      c->vt == &single_vt ? single_split : c->vt->split;
  /* the same on every rank (one backend): refused before anything is issued */
  if (!split)
    return fsdp_error("comm split: the %s backend has no sub-communicators yet (hybrid "
                      "sharding needs them): use the local or mpi backend", c->vt->name);
  const int W = c->world;
  int64_t mine[2] = {color, key};
  int64_t *all = malloc((size_t)W * sizeof mine);
  split_member *m = malloc((size_t)W * sizeof *m);
  int *members = malloc((size_t)W * sizeof *members);
  if (!all || !m || !members) {
    free(all);
    free(m);
    free(members);
    fsdp_error("comm split: out of memory");
    fsdp_comm_abort(c, fsdp_error_msg()); /* the peers would wait in the exchange */
    return FSDP_ERR;
  }
  int rc = fsdp_comm_all_gather(c, all, mine, 2, FSDP_DTYPE_I64, "comm split");
  fsdp_comm *sub = NULL;
  int64_t failed = -1; /* the first rank whose part failed */
  char why[512] = "";
  if (rc == FSDP_OK) {
    pthread_mutex_lock(&c->mu);
    uint64_t tag = c->seq; /* the exchange's: the same on every rank */
    pthread_mutex_unlock(&c->mu);
    for (int p = 0; p < W && failed < 0; p++)
      if (all[2 * p] < 0) failed = p;
    if (failed >= 0) {
      snprintf(why, sizeof why, "rank %lld passed color %lld (colors are >= 0)",
               (long long)failed, (long long)all[2 * failed]);
    } else {
      int n = 0;
      for (int p = 0; p < W; p++)
        if (all[2 * p] == color) m[n++] = (split_member){all[2 * p + 1], p};
      qsort(m, (size_t)n, sizeof *m, member_cmp);
      int me = 0;
      for (int i = 0; i < n; i++) {
        members[i] = m[i].rank;
        if (m[i].rank == c->rank) me = i;
      }
      fsdp_split sp = {.color = color, .rank = me, .world = n, .members = members, .tag = tag};
      int mrc = split(c, &sp, &sub);
      /* whether every rank made its communicator: one more collective on c */
      int64_t flag = mrc == FSDP_OK ? W : c->rank;
      if (mrc != FSDP_OK) snprintf(why, sizeof why, "%s", fsdp_error_msg());
      rc = fsdp_comm_all_reduce(c, &flag, 1, FSDP_DTYPE_I64, FSDP_RED_MIN, "comm split done");
      if (rc == FSDP_OK && flag < W) failed = flag;
      if (rc == FSDP_OK && failed >= 0 && failed != c->rank)
        snprintf(why, sizeof why, "it failed on rank %lld", (long long)failed);
    }
  }
  free(all);
  free(m);
  free(members);
  if (rc != FSDP_OK || failed >= 0) {
    fsdp_comm_free(sub);
    if (rc != FSDP_OK) return fsdp_error_context("comm split");
    return fsdp_error("comm split: %s", why);
  }
  /* the parent's settings, its family, its rank for messages */
  pthread_mutex_lock(&c->mu);
  double timeout = c->timeout;
  bool full = c->full_check;
  pthread_mutex_unlock(&c->mu);
  fsdp_comm_set_timeout(sub, timeout);
  fsdp_comm_set_full_check(sub, full);
  pthread_mutex_lock(&g_family_mu);
  sub->family_rank = c->family_rank;
  sub->parent = c;
  sub->next_sibling = c->children;
  c->children = sub;
  pthread_mutex_unlock(&g_family_mu);
  *out = sub;
  return FSDP_OK;
}

static fsdp_comm *hybrid_child(const fsdp_comm *c, int size, bool replicate) {
  for (fsdp_comm *k = c->children; k; k = k->next_sibling)
    if (k->hybrid_size == size && k->hybrid_replicate == replicate) return k;
  return NULL;
}

int fsdp_comm_hybrid(fsdp_comm *c, int shard_size, fsdp_comm **shard, fsdp_comm **replicate) {
  *shard = *replicate = NULL;
  if (!c) return fsdp_error("hybrid sharding: no communicator");
  const int W = c->world, r = c->rank, S = shard_size;
  if (S < 1 || S > W || W % S != 0)
    return fsdp_error("hybrid sharding: shard_size %d does not divide the world of %d ranks "
                      "(groups of shard_size ranks shard, the groups replicate: pick a divisor "
                      "of %d)", S, W, W);
  pthread_mutex_lock(&g_family_mu);
  fsdp_comm *sh = hybrid_child(c, S, false), *rep = hybrid_child(c, S, true);
  pthread_mutex_unlock(&g_family_mu);
  if (!sh || !rep) { /* the same on every rank: the pairs were made in the same order */
    if (fsdp_comm_split(c, r / S, r % S, &sh) != FSDP_OK) return FSDP_ERR;
    if (fsdp_comm_split(c, r % S, r / S, &rep) != FSDP_OK) {
      fsdp_comm_free(sh);
      return FSDP_ERR;
    }
    pthread_mutex_lock(&g_family_mu);
    sh->hybrid_size = rep->hybrid_size = S;
    rep->hybrid_replicate = true;
    pthread_mutex_unlock(&g_family_mu);
  }
  pthread_mutex_lock(&g_family_mu);
  c->hybrid_last = S;
  pthread_mutex_unlock(&g_family_mu);
  *shard = sh;
  *replicate = rep;
  return FSDP_OK;
}

int fsdp_comm_hybrid_last(const fsdp_comm *c, fsdp_comm **shard, fsdp_comm **replicate) {
  pthread_mutex_lock(&g_family_mu);
  int S = c->hybrid_last;
  *shard = S ? hybrid_child(c, S, false) : NULL;
  *replicate = S ? hybrid_child(c, S, true) : NULL;
  pthread_mutex_unlock(&g_family_mu);
  return *shard && *replicate ? S : 0;
}
