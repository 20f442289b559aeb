/*
 * host.c — the rank host (host.h): rank threads and their jobs, the set of ranks running Lua
 * (interrupts, the stop after a failure), failure reports, the grace period, abandoning a rank
 * that cannot be stopped.
 *
 * Lifetime: refs counts the owner and every rank thread still alive; the last to let go frees
 * the host (opts.release first). An abandoned rank's thread may outlive fsdp_host_free by any
 * time, and everything it can still touch (its rank, the host, the program's ud) lives until
 * it lets go.
 *
 * The stop hook raises on the rank's own thread and finds its reason there (tl_rank): an
 * interrupt ("interrupted") or the stop after a failure (stop_msg). Hooks are set from other
 * threads too (the owner at the end of the grace period, a signal handler): lua_sethook only
 * swaps the hook fields, which the running thread reads as either the old or the new value.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <lauxlib.h>

#include "host/host.h"
#include "comm/nccl.h"
#include "core/cond.h"

#define HOST_RANK_STACK (16u << 20) /* C stack of a rank thread: as much as a main thread */
#define HOST_ABORT_MSG 1024         /* the longest message a failing rank aborts its group with */

struct fsdp_host {
  fsdp_host_opts o; /* o.lua_dir is the copy below */
  char *lua_dir;
  int nranks;
  fsdp_host_rank *ranks;
  atomic_int refs;
  pthread_mutex_t mu; /* guards what follows, up to fail_mu, and the ranks' busy/abandoned */
  pthread_cond_t job_cv;
  pthread_cond_t done_cv; /* CLOCK_MONOTONIC: fsdp_host_run waits with deadlines */
  uint64_t job_seq;
  fsdp_host_job job;
  void *job_arg;
  int pending; /* busy ranks that have not returned from the job */
  bool quit;
  int nrunning;
  bool failed;
  double failed_at;
  bool stop_begun;         /* fsdp_host_run has stopped the ranks (stop_ranks) */
  bool hold;               /* a rank holds after its failure (fsdp_host_rank_hold): no grace */
  char *stop_msg;          /* written before stopping is set, then read-only */
  atomic_int interrupted;
  atomic_int stopping;
  pthread_mutex_t fail_mu; /* the failure record */
  int first_rank;          /* the first root-cause report of several ranks: rank, first line */
  char *first_line;
  char *root;              /* the root cause's report, or NULL */
  char *first;             /* the first failure's report (a peer's failure, if no root) */
  int cause_rank;          /* the rank of root, else of first */
  char *cause_msg;         /* its message without traceback (the stop message quotes it) */
  char *abandoned;         /* a line per abandoned rank */
  char *failure;           /* fsdp_host_failure's answer */
  int init_pending;        /* o.nccl: ranks still making their communicator (under mu) */
  char *init_error;        /* the first rank's failure to make it, or NULL (under mu) */
};

static _Thread_local fsdp_host_rank *tl_rank;

static double monotonic_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts); /* async-signal-safe */
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the stop hook and the running set ------------------------------------------------------- */

static void stop_hook(lua_State *L, lua_Debug *ar) {
  /* Not inside the message handler: a rank whose collective failed is handling that error,
   * and raising again would replace it with "error in error handling". The hook stays armed
   * for the next instruction. */
  fsdp_host_rank *r = tl_rank;
  if (lua_getinfo(L, "f", ar)) {
    lua_CFunction f = lua_tocfunction(L, -1);
    bool in_handler = f == fsdp_host_traceback || (r != NULL && f != NULL && f == r->msgh);
    lua_pop(L, 1);
    if (in_handler) return;
  }
  lua_sethook(L, NULL, 0, 0);
  if (r == NULL) return;
  fsdp_host *h = r->host;
  if (atomic_load(&h->interrupted)) luaL_error(L, "interrupted");
  if (atomic_load(&h->stopping) && !atomic_load(&r->held)) luaL_error(L, "%s", h->stop_msg);
  /* neither (an interrupt cleared since): a stale hook, gone now */
}

static void arm(lua_State *L) {
  lua_sethook(L, stop_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
}

/* Set r's running state to L (NULL: none) and tell the program. Caller holds mu. */
static void set_running(fsdp_host_rank *r, lua_State *L, bool fresh) {
  fsdp_host *h = r->host;
  lua_State *was = atomic_load(&r->running);
  atomic_store(&r->running, L);
  h->nrunning += (L != NULL) - (was != NULL);
  if (h->o.running != NULL)
    h->o.running(h->o.ud, h->nrunning, fresh && was == NULL && L != NULL && h->nrunning == 1);
}

/* Enter; false (nothing marked) when the owner gave up on r already. */
static bool enter(fsdp_host_rank *r, lua_State *L) {
  fsdp_host *h = r->host;
  pthread_mutex_lock(&h->mu);
  bool go = !r->abandoned;
  if (go) {
    set_running(r, L, true);
    if (atomic_load(&h->interrupted) || (atomic_load(&h->stopping) && !atomic_load(&r->held)))
      arm(L);
  }
  pthread_mutex_unlock(&h->mu);
  return go;
}

void fsdp_host_lua_resume(fsdp_host_rank *r, lua_State *L) {
  fsdp_host *h = r->host;
  pthread_mutex_lock(&h->mu);
  set_running(r, L, false);
  if (L != NULL && atomic_load(&h->stopping) && !atomic_load(&r->held)) arm(L);
  pthread_mutex_unlock(&h->mu);
}

/* Leave; *abandoned says whether the owner gave up on r meanwhile. */
static lua_State *leave(fsdp_host_rank *r, bool *abandoned) {
  fsdp_host *h = r->host;
  pthread_mutex_lock(&h->mu);
  lua_State *L = atomic_load(&r->running);
  set_running(r, NULL, false);
  if (abandoned != NULL) *abandoned = r->abandoned;
  pthread_mutex_unlock(&h->mu);
  return L;
}

lua_State *fsdp_host_lua_leave(fsdp_host_rank *r) { return leave(r, NULL); }

int fsdp_host_nrunning(fsdp_host *h) {
  pthread_mutex_lock(&h->mu);
  int n = h->nrunning;
  pthread_mutex_unlock(&h->mu);
  return n;
}

int fsdp_host_pcall(fsdp_host_rank *r, lua_State *L, int narg, int nres) {
  return fsdp_host_pcall_msgh(r, L, narg, nres, fsdp_host_traceback);
}

int fsdp_host_pcall_msgh(fsdp_host_rank *r, lua_State *L, int narg, int nres,
                         lua_CFunction msgh) {
  int base = lua_gettop(L) - narg;
  lua_pushcfunction(L, msgh);
  lua_insert(L, base);
  bool abandoned = !enter(r, L);
  int status = 0;
  if (!abandoned) {
    lua_CFunction outer = r->msgh; /* calls nest (the REPL inside a recipe) */
    r->msgh = msgh;
    status = lua_pcall(L, narg, nres, base);
    r->msgh = outer;
    leave(r, &abandoned);
  }
  lua_remove(L, base);
  if (abandoned && status == 0) {
    lua_settop(L, base - 1);
    lua_pushfstring(L, "rank %d was abandoned: it did not stop within the grace period",
                    r->rank);
    status = LUA_ERRRUN;
  }
  return status;
}

bool fsdp_host_interrupt(fsdp_host *h) {
  atomic_store(&h->interrupted, 1);
  bool any = false;
  for (int i = 0; i < h->nranks; i++) {
    lua_State *L = atomic_load(&h->ranks[i].running);
    if (L != NULL) {
      arm(L);
      any = true;
    }
  }
  return any;
}

bool fsdp_host_interrupted(const fsdp_host *h) { return atomic_load(&h->interrupted) != 0; }

void fsdp_host_interrupt_clear(fsdp_host *h, bool if_idle) {
  if (!if_idle) {
    atomic_store(&h->interrupted, 0);
    return;
  }
  pthread_mutex_lock(&h->mu);
  if (h->nrunning == 0) atomic_store(&h->interrupted, 0);
  pthread_mutex_unlock(&h->mu);
}

/* ---- failures -------------------------------------------------------------------------------- */

/* Whether msg reports another rank's failure: "rank R failed: " with R != rank. */
static bool is_peer_failure(const char *msg, int rank) {
  for (const char *p = strstr(msg, "rank "); p != NULL; p = strstr(p + 1, "rank ")) {
    char *end;
    long r = strtol(p + 5, &end, 10);
    if (end != p + 5 && strncmp(end, " failed: ", 9) == 0 && r != rank) return true;
  }
  return false;
}

/* The length of msg without its traceback ("\nstack traceback:..."). */
static size_t message_len(const char *msg) {
  const char *tb = strstr(msg, "\nstack traceback:");
  return tb != NULL ? (size_t)(tb - msg) : strlen(msg);
}

void fsdp_host_rank_hold(fsdp_host_rank *r) {
  fsdp_host *h = r->host;
  pthread_mutex_lock(&h->mu);
  atomic_store(&r->held, true);
  h->hold = true;
  pthread_mutex_unlock(&h->mu);
  /* a stop hook armed before: it would fire, harmlessly, at every instruction of the REPL */
  lua_State *L = atomic_load(&r->running);
  if (L != NULL && !atomic_load(&h->interrupted)) lua_sethook(L, NULL, 0, 0);
}

void fsdp_host_rank_fail(fsdp_host_rank *r, const char *msg) {
  fsdp_host *h = r->host;
  if (msg == NULL) msg = "(error object is not a string)";
  int head = (int)strcspn(msg, "\n");
  int len = (int)message_len(msg);
  bool peer = is_peer_failure(msg, r->rank);
  bool several = r->world > 1;
  char *text;
  pthread_mutex_lock(&h->fail_mu);
  if (!several) {
    text = fsdp_strdup_printf("%s\n", msg);
  } else if (peer) {
    text = fsdp_strdup_printf("[rank %d] %.*s\n", r->rank, head, msg);
  } else if (h->first_line == NULL) {
    h->first_rank = r->rank;
    h->first_line = fsdp_strdup_printf("%.*s", head, msg);
    text = fsdp_strdup_printf("[rank %d] %s\n", r->rank, msg);
  } else if ((int)strlen(h->first_line) == head && strncmp(h->first_line, msg, head) == 0) {
    text = fsdp_strdup_printf("[rank %d] %.*s (the same error as rank %d)\n", r->rank, head, msg,
                              h->first_rank);
  } else {
    text = fsdp_strdup_printf("[rank %d] %s\n", r->rank, msg);
  }
  char *report = several ? fsdp_strdup_printf("[rank %d] %s", r->rank, msg) : strdup(msg);
  if (!peer && h->root == NULL) {
    h->root = report;
    report = NULL;
    free(h->cause_msg);
    h->cause_rank = r->rank;
    h->cause_msg = fsdp_strdup_printf("%.*s", len, msg);
  } else if (h->root == NULL && h->first == NULL) {
    h->first = report;
    report = NULL;
    h->cause_rank = r->rank;
    h->cause_msg = fsdp_strdup_printf("%.*s", len, msg);
  }
  free(report);
  /* the report is out before the abort wakes any peer: the root cause comes first */
  if (text != NULL && h->o.report != NULL) h->o.report(h->o.ud, text);
  pthread_mutex_unlock(&h->fail_mu);
  free(text);
  if (r->comm != NULL) {
    char abort_msg[HOST_ABORT_MSG];
    snprintf(abort_msg, sizeof abort_msg, "%.*s", len, msg);
    fsdp_comm_abort(r->comm, abort_msg);
  }
  pthread_mutex_lock(&h->mu);
  if (!h->failed) {
    h->failed = true;
    h->failed_at = monotonic_s();
    pthread_cond_broadcast(&h->done_cv); /* the owner now waits with a deadline */
  }
  pthread_mutex_unlock(&h->mu);
}

const char *fsdp_host_failure(fsdp_host *h) {
  pthread_mutex_lock(&h->fail_mu);
  const char *cause = h->root != NULL ? h->root : h->first;
  free(h->failure);
  h->failure = NULL;
  if (cause != NULL)
    h->failure =
        h->abandoned != NULL ? fsdp_strdup_printf("%s\n%s", cause, h->abandoned) : strdup(cause);
  pthread_mutex_unlock(&h->fail_mu);
  return h->failure;
}

/* The end of the grace period: ranks still running Lua raise stop_msg at their next
 * instruction, as do ranks that enter Lua from now on. Caller holds mu. */
static void stop_ranks(fsdp_host *h) {
  pthread_mutex_lock(&h->fail_mu);
  const char *cause = h->cause_msg != NULL ? h->cause_msg : "(no message)";
  h->stop_msg = h->hold ? fsdp_strdup_printf("stopped: rank %d failed: %s", h->cause_rank, cause)
                        : fsdp_strdup_printf("stopped %d s after rank %d failed: %s",
                                             FSDP_HOST_GRACE_S, h->cause_rank, cause);
  pthread_mutex_unlock(&h->fail_mu);
  if (h->stop_msg == NULL) h->stop_msg = strdup("stopped after another rank failed");
  if (h->stop_msg == NULL) return; /* out of memory: no hook; the ranks will be abandoned */
  atomic_store(&h->stopping, 1);
  for (int i = 0; i < h->nranks; i++) {
    lua_State *L = atomic_load(&h->ranks[i].running);
    if (L != NULL && !atomic_load(&h->ranks[i].held)) arm(L);
  }
}

/* Whether a held rank has not returned from the job. Caller holds mu. */
static bool held_busy(const fsdp_host *h) {
  for (int i = 0; i < h->nranks; i++)
    if (h->ranks[i].busy && atomic_load(&h->ranks[i].held)) return true;
  return false;
}

/* Give up on the ranks still busy. Caller holds mu. Returns how many. */
static int abandon_ranks(fsdp_host *h) {
  int n = 0;
  pthread_mutex_lock(&h->fail_mu);
  for (int i = 0; i < h->nranks; i++) {
    fsdp_host_rank *r = &h->ranks[i];
    if (!r->busy) continue;
    r->busy = false;
    r->abandoned = true;
    h->pending--;
    n++;
    char *line =
        fsdp_strdup_printf("[rank %d] did not stop within %d s after rank %d failed (it runs "
                           "compiled Lua code or a C call, which no hook reaches): abandoned",
                           r->rank, FSDP_HOST_GRACE_S, h->cause_rank);
    if (line == NULL) continue;
    if (h->o.report != NULL) {
      char *text = fsdp_strdup_printf("%s\n", line);
      if (text != NULL) h->o.report(h->o.ud, text);
      free(text);
    }
    char *all = h->abandoned != NULL ? fsdp_strdup_printf("%s\n%s", h->abandoned, line) : line;
    if (all != line) free(line);
    if (all != NULL) {
      free(h->abandoned);
      h->abandoned = all;
    }
  }
  pthread_mutex_unlock(&h->fail_mu);
  return n;
}

/* ---- jobs ------------------------------------------------------------------------------------ */

static void timed_wait(fsdp_host *h, double until) {
  struct timespec ts;
  ts.tv_sec = (time_t)until;
  ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
  if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
  pthread_cond_timedwait(&h->done_cv, &h->mu, &ts);
}

int fsdp_host_run(fsdp_host *h, fsdp_host_job job, void *arg) {
  pthread_mutex_lock(&h->mu);
  h->job = job;
  h->job_arg = arg;
  h->pending = 0;
  for (int i = 0; i < h->nranks; i++) {
    fsdp_host_rank *r = &h->ranks[i];
    r->busy = r->started && !r->abandoned;
    h->pending += r->busy;
  }
  h->job_seq++;
  pthread_cond_broadcast(&h->job_cv);
  double started = monotonic_s();
  double held_until = 0; /* when a held rank was last seen busy */
  int gave_up = 0;
  while (h->pending > 0) {
    if (!h->failed) {
      pthread_cond_wait(&h->done_cv, &h->mu);
      continue;
    }
    double now = monotonic_s(), stop_at = h->failed_at + (h->hold ? 0 : FSDP_HOST_GRACE_S);
    if (now < stop_at) {
      timed_wait(h, stop_at);
    } else if (!h->stop_begun) {
      h->stop_begun = true;
      stop_ranks(h);
    } else if (held_busy(h)) {
      /* a post-mortem: waited for without a deadline (a slow peer may still join it) */
      pthread_cond_wait(&h->done_cv, &h->mu);
      held_until = monotonic_s();
    } else {
      /* the stop wait counts from the stop, from the start of a job after it (the host stays
       * stopped), or from the end of the post-mortem */
      double base = stop_at > started ? stop_at : started;
      if (held_until > base) base = held_until;
      if (now < base + FSDP_HOST_STOP_WAIT_S) timed_wait(h, base + FSDP_HOST_STOP_WAIT_S);
      else gave_up += abandon_ranks(h);
    }
  }
  h->job = NULL;
  h->job_arg = NULL;
  pthread_mutex_unlock(&h->mu);
  return gave_up;
}

bool fsdp_host_rank_abandoned(fsdp_host_rank *r) {
  pthread_mutex_lock(&r->host->mu);
  bool a = r->abandoned;
  pthread_mutex_unlock(&r->host->mu);
  return a;
}

/* ---- ranks ----------------------------------------------------------------------------------- */

/* Close r's state (its hook cleared first: it must not fire in finalizers). */
static void rank_close(fsdp_host_rank *r) {
  if (r->L == NULL) return;
  lua_sethook(r->L, NULL, 0, 0); /* an armed hook must not fire in finalizers */
  lua_close(r->L);
  r->L = NULL;
}

void fsdp_host_rank_finish(fsdp_host_rank *r) {
  /* the state first: its finalizers may still wait for their collectives */
  rank_close(r);
  fsdp_comm_free(r->comm);
  r->comm = NULL;
  fsdp_comm_free(r->boot); /* after the nccl communicator stacked on it */
  r->boot = NULL;
  fsdp_comm_free(r->ctl);
  r->ctl = NULL;
}

static void destroy(fsdp_host *h) {
  if (h->o.release != NULL) h->o.release(h->o.ud);
  pthread_mutex_destroy(&h->mu);
  pthread_mutex_destroy(&h->fail_mu);
  pthread_cond_destroy(&h->job_cv);
  pthread_cond_destroy(&h->done_cv);
  free(h->ranks);
  free(h->lua_dir);
  free(h->stop_msg);
  free(h->first_line);
  free(h->root);
  free(h->first);
  free(h->cause_msg);
  free(h->abandoned);
  free(h->failure);
  free(h->init_error);
  free(h);
}

static void release(fsdp_host *h) {
  if (atomic_fetch_sub(&h->refs, 1) == 1) destroy(h);
}

/* A launcher's local rank or local world size: the first of `names` that is set and not empty,
 * an integer in lo .. FSDP_HOST_MAX_LOCAL (no sign, no blanks). Returns 1 with *out set, 0 when
 * none is set, -1 (the error set, naming the variable) when the one that decides is malformed:
 * atoi would wrap a huge value, take "-1" and "3x", and LOCAL_RANK + 1 could overflow. */
static int env_local(const char *const names[2], long lo, int *out, bool report) {
  for (int i = 0; i < 2; i++) {
    const char *v = getenv(names[i]);
    if (v == NULL || v[0] == '\0') continue;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (v[0] < '0' || v[0] > '9' || errno != 0 || *end != '\0' || x < lo ||
        x > (lo == 0 ? FSDP_HOST_MAX_LOCAL - 1 : FSDP_HOST_MAX_LOCAL)) {
      if (!report) return -1;
      if (lo == 0)
        fsdp_error("%s='%s' must be a non-negative integer (below %d)", names[i], v,
                   FSDP_HOST_MAX_LOCAL);
      else
        fsdp_error("%s='%s' must be a positive integer (at most %d)", names[i], v,
                   FSDP_HOST_MAX_LOCAL);
      return -1;
    }
    *out = (int)x;
    return 1;
  }
  return 0;
}

static const char *const LOCAL_RANK_VARS[2] = {"OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"};
static const char *const LOCAL_SIZE_VARS[2] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"};

int fsdp_host_local_env_check(int nranks) {
  if (nranks > 1) return FSDP_OK; /* rank threads: their own indices, the variables unread */
  int v;
  if (env_local(LOCAL_RANK_VARS, 0, &v, true) < 0 || env_local(LOCAL_SIZE_VARS, 1, &v, true) < 0)
    return FSDP_ERR;
  return FSDP_OK;
}

/* The rank's index among this machine's ranks (devices pick theirs from it): the thread's rank
 * when the host runs several, else the launcher's (mpirun, torchrun-style) LOCAL_RANK; 0 for a
 * malformed one, which fsdp_host_new refused already. */
static int local_rank(const fsdp_host *h, const fsdp_host_rank *r) {
  if (h->nranks > 1) return r->rank;
  int v;
  return env_local(LOCAL_RANK_VARS, 0, &v, false) == 1 ? v : 0;
}

void fsdp_host_rank_local(const fsdp_host_rank *r, int *local, int *local_world) {
  const fsdp_host *h = r->host;
  *local = local_rank(h, r);
  *local_world = h->nranks;
  int v;
  if (h->nranks == 1 && env_local(LOCAL_SIZE_VARS, 1, &v, false) == 1) *local_world = v;
  /* a launcher that set only LOCAL_RANK, or values that disagree: the rank is still one of
   * local_world (below 2^20, so no overflow) */
  if (*local_world <= *local) *local_world = *local + 1;
}

static void *rank_thread(void *arg) {
  fsdp_host_rank *r = arg;
  fsdp_host *h = r->host;
  tl_rank = r;
  fsdp_mem_domain_set(r->domain);
  fsdp_comm_set_current(r->comm);
  fsdp_devices_bind(local_rank(h, r));
  if (h->o.nccl) {
    /* on the rank's own thread: NCCL binds the communicator to the thread's GPU */
    fsdp_comm *nc = NULL;
    char *err = NULL;
    if (fsdp_comm_nccl_new(&nc, r->comm) == FSDP_OK) {
      r->boot = r->comm;
      r->comm = nc;
      fsdp_comm_set_current(nc);
    } else {
      err = fsdp_strdup_printf("rank %d: %s", r->rank, fsdp_error_msg());
    }
    pthread_mutex_lock(&h->mu);
    if (err && !h->init_error) h->init_error = err;
    else free(err);
    h->init_pending--;
    pthread_cond_broadcast(&h->done_cv);
    pthread_mutex_unlock(&h->mu);
  }
  uint64_t seen = 0;
  pthread_mutex_lock(&h->mu);
  for (;;) {
    while (!h->quit && h->job_seq == seen) pthread_cond_wait(&h->job_cv, &h->mu);
    if (h->quit) break;
    seen = h->job_seq;
    if (!r->busy) continue;
    fsdp_host_job job = h->job;
    void *job_arg = h->job_arg;
    pthread_mutex_unlock(&h->mu);
    job(r, job_arg);
    pthread_mutex_lock(&h->mu);
    if (r->abandoned) break; /* its caller has gone: no more jobs, clean up and go */
    r->busy = false;
    /* the owner waits for every held rank without a deadline, and then for the others */
    if (--h->pending == 0 || atomic_load(&r->held)) pthread_cond_broadcast(&h->done_cv);
  }
  pthread_mutex_unlock(&h->mu);
  /* From here the rank has left the group: a peer still in a collective fails at once. */
  fsdp_host_rank_finish(r);
  fsdp_mem_domain_free(r->domain); /* freed once its last storage goes */
  r->domain = NULL;
  tl_rank = NULL;
  release(h);
  return NULL;
}

int fsdp_host_nranks(const fsdp_host *h) { return h->nranks; }
fsdp_host_rank *fsdp_host_rank_at(fsdp_host *h, int i) { return &h->ranks[i]; }
const char *fsdp_host_lua_dir(const fsdp_host *h) { return h->lua_dir; }
fsdp_host_rank *fsdp_host_current(void) { return tl_rank; }

/* The ranks' communicators: one local group (and a second for ctl), or the given ones. */
static int make_comms(fsdp_host *h) {
  const fsdp_host_opts *o = &h->o;
  if (!o->group) {
    fsdp_host_rank *r = &h->ranks[0];
    r->comm = o->comm;
    r->ctl = o->ctl_comm;
    if (r->comm != NULL) {
      r->rank = fsdp_comm_rank(r->comm);
      r->world = fsdp_comm_world(r->comm);
    }
    return FSDP_OK;
  }
  fsdp_local_group *g = NULL, *cg = NULL;
  int st = FSDP_OK;
  if (fsdp_local_group_new(&g, h->nranks) != FSDP_OK ||
      (o->ctl && fsdp_local_group_new(&cg, h->nranks) != FSDP_OK))
    st = fsdp_error_context("cannot start %d ranks", h->nranks);
  /* an explicit timeout is the communicators' default from their creation on: FSDP_TIMEOUT is
   * then not read, so a malformed value there cannot fail them (fsdp.h: timeout_s) */
  if (st == FSDP_OK && o->timeout_s > 0) fsdp_local_group_set_timeout(g, o->timeout_s);
  for (int i = 0; st == FSDP_OK && i < h->nranks; i++) {
    fsdp_host_rank *r = &h->ranks[i];
    r->rank = i;
    r->world = h->nranks;
    if (fsdp_comm_local_new(&r->comm, g, i) != FSDP_OK ||
        (o->ctl && fsdp_comm_local_new(&r->ctl, cg, i) != FSDP_OK))
      st = fsdp_error_context("cannot create the communicator of rank %d", i);
  }
  fsdp_local_group_release(g); /* the communicators keep them */
  fsdp_local_group_release(cg);
  return st;
}

/* A host with its memory and locks, no communicators or threads yet; NULL on bad options or
 * out of memory (the message set). */
static fsdp_host *host_alloc(const fsdp_host_opts *opts) {
  int n = opts->nranks;
  if (n < 1 || n > FSDP_HOST_MAX_RANKS || (!opts->group && n != 1)) {
    fsdp_error("cannot start %d ranks: 1 .. %d rank threads%s", n, FSDP_HOST_MAX_RANKS,
               opts->group ? "" : ", 1 without a local group");
    return NULL;
  }
  fsdp_host *h = calloc(1, sizeof *h);
  if (h != NULL) {
    h->ranks = calloc((size_t)n, sizeof *h->ranks);
    if (opts->lua_dir != NULL) h->lua_dir = strdup(opts->lua_dir);
  }
  if (h == NULL || h->ranks == NULL || (opts->lua_dir != NULL && h->lua_dir == NULL)) {
    if (h != NULL) {
      free(h->ranks);
      free(h->lua_dir);
      free(h);
    }
    fsdp_error("cannot start %d ranks: out of memory", n);
    return NULL;
  }
  h->o = *opts;
  h->o.lua_dir = h->lua_dir;
  h->nranks = n;
  atomic_init(&h->refs, 1);
  h->first_rank = -1;
  h->cause_rank = -1;
  pthread_mutex_init(&h->mu, NULL);
  pthread_mutex_init(&h->fail_mu, NULL);
  pthread_cond_init(&h->job_cv, NULL);
  fsdp_cond_init_monotonic(&h->done_cv);
  for (int i = 0; i < n; i++) {
    h->ranks[i].host = h;
    h->ranks[i].world = 1;
  }
  return h;
}

int fsdp_host_new(fsdp_host **out, const fsdp_host_opts *opts) {
  *out = NULL;
  if (fsdp_host_local_env_check(opts->nranks > 0 ? opts->nranks : 1) != FSDP_OK) {
    fsdp_comm_free(opts->comm);
    fsdp_comm_free(opts->ctl_comm);
    return FSDP_ERR;
  }
  fsdp_host *h = host_alloc(opts);
  if (h == NULL) {
    fsdp_comm_free(opts->comm);
    fsdp_comm_free(opts->ctl_comm);
    return FSDP_ERR;
  }
  int n = h->nranks;
  int st = make_comms(h);
  for (int i = 0; st == FSDP_OK && i < n; i++) {
    fsdp_host_rank *r = &h->ranks[i];
    if (opts->timeout_s > 0 && r->comm != NULL) fsdp_comm_set_timeout(r->comm, opts->timeout_s);
    if ((r->domain = fsdp_mem_domain_new()) == NULL)
      st = fsdp_error("cannot create the memory domain of rank %d: out of memory", r->rank);
  }
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, HOST_RANK_STACK);
  h->init_pending = opts->nccl && st == FSDP_OK ? n : 0;
  for (int i = 0; st == FSDP_OK && i < n; i++) {
    fsdp_host_rank *r = &h->ranks[i];
    atomic_fetch_add(&h->refs, 1);
    int err = pthread_create(&r->thread, &attr, rank_thread, r);
    if (err != 0) {
      atomic_fetch_sub(&h->refs, 1);
      st = fsdp_error("cannot start the thread of rank %d: %s", r->rank, strerror(err));
      /* the started ones may wait in the bootstrap for this one: fail them */
      if (opts->nccl && r->comm) fsdp_comm_abort(r->comm, fsdp_error_msg());
      pthread_mutex_lock(&h->mu);
      h->init_pending -= n - i;
      pthread_mutex_unlock(&h->mu);
    } else {
      r->started = true;
    }
  }
  pthread_attr_destroy(&attr);
  if (opts->nccl) {
    /* every rank's nccl communicator made, or the first error (a failing rank poisons its
     * bootstrap, so the others stop waiting) */
    pthread_mutex_lock(&h->mu);
    while (h->init_pending > 0) pthread_cond_wait(&h->done_cv, &h->mu);
    if (st == FSDP_OK && h->init_error)
      st = fsdp_error("cannot create the nccl communicators: %s", h->init_error);
    pthread_mutex_unlock(&h->mu);
  }
  if (st != FSDP_OK) {
    char msg[FSDP_ERROR_CAP];
    snprintf(msg, sizeof msg, "%s", fsdp_error_msg());
    /* peers in other processes (mpi) would wait for this one in their first collective */
    for (int i = 0; i < n; i++)
      if (h->ranks[i].comm != NULL) fsdp_comm_abort(h->ranks[i].comm, msg);
    h->o.release = NULL;
    fsdp_host_free(h);
    return fsdp_error("%s", msg);
  }
  *out = h;
  return FSDP_OK;
}

void fsdp_host_free(fsdp_host *h) {
  if (h == NULL) return;
  pthread_mutex_lock(&h->mu);
  h->quit = true;
  pthread_cond_broadcast(&h->job_cv);
  pthread_mutex_unlock(&h->mu);
  for (int i = 0; i < h->nranks; i++) {
    fsdp_host_rank *r = &h->ranks[i];
    if (!r->started) {
      fsdp_host_rank_finish(r); /* no thread ever did */
      fsdp_mem_domain_free(r->domain);
      r->domain = NULL;
    } else if (fsdp_host_rank_abandoned(r)) {
      pthread_detach(r->thread); /* it frees itself if it ever returns */
    } else {
      pthread_join(r->thread, NULL);
    }
  }
  release(h);
}
