/*
 * fsdprun.c — the `fsdprun` launcher: runs a Lua recipe (and -e chunks, and an interactive loop)
 * on the statically linked engine, on one rank or on N ranks that are threads of this process.
 * Owner: launcher.
 *
 *   fsdprun [-n N] [--timeout=SECONDS] [-e CODE]... [-i] [--] recipe.lua [args...]
 *
 * Shaped like lua.c / luajit.c: a rank's whole run happens inside one lua_cpcall; every chunk
 * runs under lua_pcall with a traceback message handler, so an error prints
 * "fsdprun: <message>\n<traceback>" and the process exits 1. Usage errors exit 2, an interrupt
 * (SIGINT) exits 130.
 *
 * Ranks. Without -n there is one rank, run on the main thread, whose communicator is the
 * world of one that fsdp_comm_current() makes on first use. With -n N (N >= 1) fsdprun makes
 * one local group and N rank threads. Each thread has its own memory domain, its own
 * communicator (set as the thread's current one) and its own lua_State set up exactly like the
 * single rank's; all run the same -e chunks and recipe (SPMD). Threads share nothing in Lua;
 * they meet only in collectives. A rank thread frees its communicator when its run ends, so a
 * peer still waiting for it in a collective fails at once ("rank R left") instead of at the
 * timeout. BLAS threads are set once, before the rank threads start, to
 * max(1, cores / N) (FSDP_BLAS_THREADS overrides): OpenBLAS's count is process-wide.
 *
 * Under mpirun (or with --backend mpi) each process is one rank of an Open MPI job instead: see
 * "the mpi backend" below and docs/mpi.md.
 *
 * Failure is collective (DESIGN.md invariant 3). A rank whose chunk raises prints its report
 * and only then aborts the communicator, so the root cause is on stderr before any peer wakes
 * with "rank R failed: <message>". A report whose message is such a peer failure is one line;
 * the root cause gets its traceback. The process exits after every rank thread has returned.
 *
 * Output. `print` is replaced in every rank's state by one that builds the whole line and
 * writes it with one fwrite under g_out_mu, so lines of different ranks never interleave;
 * error reports take the same lock (and flush stdout first, to keep the order on a shared
 * pipe). io.write is Lua's own and unlocked.
 *
 * Library discovery never depends on the user's environment: package.path gets the first
 * existing of <exe dir>/../share/fsdprun/lua (installed tree) and FSDP_SOURCE_LUA_DIR (build
 * tree) prepended, and package.preload["fsdp.core"] is the engine linked into this executable
 * (a core.so found on LUA_CPATH is never loaded here: two engines in one process would not
 * share tensors).
 *
 * The REPL (-i, fsdp.debug()) is src/cli/repl.c: this file gives it a host (rank, communicators,
 * how to run Lua under the traceback handler and ^C) and a second communicator per rank, `ctl`,
 * for the REPL's own traffic (the input from rank 0, every rank's outcome back), so that the
 * recipe's communicator can fail or fall out of step without taking the REPL with it. Inside
 * an evaluation, print is captured for grouping (fsdp_repl_capture). Each rank's state also
 * gets package.loaded.fsdprun = {repl = function(where)}, which fsdp.debug() calls.
 *
 * SIGINT: like lua.c, the handler sets a Lua hook that raises "interrupted" at the next Lua
 * instruction, here in every rank's state that is running a chunk (g_running). LuaJIT does not
 * run hooks inside compiled traces (`while true do end` never leaves its trace), and a rank may
 * be blocked in C (a kernel, a collective), so the handler also arms a grace timer: if the run
 * has not stopped within FSDPRUN_INTERRUPT_GRACE_S seconds, the process prints
 * "fsdprun: interrupted" and exits 130 on its own. A second SIGINT kills at once.
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <lauxlib.h>
#include <lua.h>
#include <luajit.h>
#include <lualib.h>

#include "cli/repl.h"
#include "comm/comm.h"
#include "comm/mpi.h"
#include "core/core.h"
#include "fsdp.h"
#include "kernels/cpu/kernels.h"
#include "lua/binding.h"

#ifndef FSDP_SOURCE_LUA_DIR
#define FSDP_SOURCE_LUA_DIR ""
#endif

#define PROGNAME "fsdprun"
#define EXIT_USAGE 2
#define EXIT_INTERRUPTED 130
#define FSDPRUN_INTERRUPT_GRACE_S 2
#define FSDPRUN_MAX_RANKS 1024
#define FSDPRUN_RANK_STACK (16u << 20) /* C stack of a rank thread: as much as a main thread */

/* What the command line asked for; argv indices refer to main's argv. Read-only once the
 * ranks run. */
typedef struct fsdprun_opts {
  int argc;
  char **argv;
  int nranks;        /* -n; 1 when absent */
  bool ranked;       /* -n given: rank threads over a local group (even for -n 1) */
  double timeout;    /* --timeout; 0 when absent (the communicator's default) */
  const char *backend; /* --backend: "local", "mpi", or NULL (mpi when mpirun started us) */
  bool interactive;  /* -i */
  int nexec;         /* number of -e chunks */
  const char **exec; /* (nexec) their code, in command-line order */
  int script;        /* argv index of the recipe; 0 when none */
  /* ranked runs: the recipe read once by main (stdin can be read only once), and its name */
  char *source;
  size_t source_len;
  const char *chunkname;
} fsdprun_opts;

/* One rank: its thread, communicator and Lua state. */
typedef struct rank_ctx {
  const fsdprun_opts *o;
  int rank, world;
  fsdp_comm *comm; /* NULL: the thread's default (a world of one) */
  fsdp_comm *ctl;  /* the REPL's channel between the ranks (NULL: a world of one) */
  lua_State *L;
  int status;      /* this rank's exit status */
  lua_State *paused_L; /* the REPL's pause: the state a ^C would have stopped (g_running) */
  pthread_t thread;
} rank_ctx;

/* ---- output ------------------------------------------------------------------------------ */

static pthread_mutex_t g_out_mu = PTHREAD_MUTEX_INITIALIZER;

/* print, as Lua's (tostring of each argument, tab-separated, newline), written as one line
 * under g_out_mu. */
static int rank_print(lua_State *L) {
  fsdp_lua_print_line(L, true);
  size_t len;
  const char *s = lua_tolstring(L, -1, &len);
  if (fsdp_repl_capture(s, len)) return 0; /* a REPL input on several ranks: grouped later */
  pthread_mutex_lock(&g_out_mu);
  fwrite(s, 1, len, stdout);
  pthread_mutex_unlock(&g_out_mu);
  return 0;
}

/* Write text (a whole report) to stderr under g_out_mu, stdout flushed first. */
static void write_err(const char *text) {
  pthread_mutex_lock(&g_out_mu);
  fflush(stdout); /* keep stdout and stderr in order when both go to one pipe */
  fputs(text, stderr);
  fflush(stderr);
  pthread_mutex_unlock(&g_out_mu);
}

/* ---- signals --------------------------------------------------------------------------- */

/* g_running[r]: the state whose chunk a SIGINT should stop on rank r, or NULL. Each rank writes
 * only its own slot; the handler reads them all. */
static _Atomic(lua_State *) *g_running;
static int g_nslots;
static int g_nrunning; /* ranks inside docall; under g_sig_mu */
static pthread_mutex_t g_sig_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int g_interrupted; /* lock-free atomics are async-signal-safe */
static bool g_rearm_interrupt; /* one rank: each run may be interrupted once (the REPL) */
/* The REPL (host_pause, host_reading): while any rank is inside it, SIGINT stays handled even
 * when no rank runs Lua, so that a ^C in the gap between reading an input and running it is
 * kept for that evaluation rather than killing the session; at rank 0's prompt (reading without
 * libedit, which takes ^C as a key itself) it still ends fsdprun. Atomics: the handler reads
 * them. */
static atomic_int g_in_repl;   /* ranks inside the REPL; changed under g_sig_mu */
static atomic_int g_at_prompt; /* rank 0 is reading an input */

static int traceback_handler(lua_State *L);

static void interrupt_hook(lua_State *L, lua_Debug *ar) {
  /* Not inside the message handler: a rank blocked in a collective when ^C came fails with its
   * peer's error, and raising again while that error is being handled would replace it with
   * "error in error handling". The hook stays armed for the next chunk. */
  if (lua_getinfo(L, "f", ar)) {
    bool in_handler = lua_tocfunction(L, -1) == traceback_handler;
    lua_pop(L, 1);
    if (in_handler) return;
  }
  lua_sethook(L, NULL, 0, 0);
  luaL_error(L, "interrupted");
}

static void on_sigalrm(int sig) {
  (void)sig;
  static const char msg[] = PROGNAME ": interrupted (the running code did not stop in time)\n";
  ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
  (void)w;
  _exit(EXIT_INTERRUPTED);
}

static double monotonic_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts); /* async-signal-safe */
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void set_interrupt_hook(lua_State *L) {
  /* lua_sethook is safe to call from a signal handler (lua.c and luajit.c rely on it); from
   * another thread it only swaps the hook fields and the dispatch table's entries, which the
   * running thread reads as either the old or the new value. */
  lua_sethook(L, interrupt_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
}

static void on_sigint(int sig) {
  (void)sig;
  static _Atomic double first_at;
  double now = monotonic_s();
  if (g_interrupted) {
    /* A second ^C kills at once. One ^C can arrive twice (coreutils timeout signals the child
     * and then its process group), so a repeat within half a second is the same ^C. */
    if (now - first_at < 0.5) return;
    on_sigalrm(SIGALRM);
  }
  g_interrupted = 1;
  first_at = now;
  bool any = false;
  for (int r = 0; r < g_nslots; r++) {
    lua_State *L = g_running[r];
    if (L != NULL) {
      set_interrupt_hook(L);
      any = true;
    }
  }
  if (!any) {
    if (g_in_repl > 0 && !g_at_prompt) return; /* pending: the next evaluation stops at once */
    _exit(EXIT_INTERRUPTED);
  }
  signal(SIGALRM, on_sigalrm);
  alarm(FSDPRUN_INTERRUPT_GRACE_S);
}

/* A rank enters / leaves a chunk. The SIGINT handler is installed while any rank runs one. */
static void running_enter(rank_ctx *rc, lua_State *L) {
  pthread_mutex_lock(&g_sig_mu);
  if (g_nrunning++ == 0) {
    if (g_rearm_interrupt && g_in_repl == 0) g_interrupted = 0; /* the REPL rearms itself */
    signal(SIGINT, on_sigint);
  }
  g_running[rc->rank] = L;
  /* a ^C that came while this rank was between chunks stops this chunk too */
  if (g_interrupted) set_interrupt_hook(L);
  pthread_mutex_unlock(&g_sig_mu);
}

static void running_leave(rank_ctx *rc) {
  pthread_mutex_lock(&g_sig_mu);
  g_running[rc->rank] = NULL;
  if (--g_nrunning == 0) {
    if (g_in_repl == 0) signal(SIGINT, SIG_DFL);
    alarm(0);
  }
  pthread_mutex_unlock(&g_sig_mu);
}

/* ---- running chunks -------------------------------------------------------------------- */

/* Message handler: the error message (or a description of a non-string error object) followed
 * by the stack traceback. */
static int traceback_handler(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING)
      msg = lua_tostring(L, -1);
    else
      msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

/* Call the function below narg arguments on the stack under the traceback handler, with SIGINT
 * turned into a Lua error while it runs. Returns the lua_pcall status. */
static int docall_on(rank_ctx *rc, lua_State *L, int narg, int nres) {
  int base = lua_gettop(L) - narg;
  lua_pushcfunction(L, traceback_handler);
  lua_insert(L, base);
  running_enter(rc, L);
  int status = lua_pcall(L, narg, nres, base);
  running_leave(rc);
  lua_remove(L, base);
  return status;
}

static int docall(rank_ctx *rc, int narg, int nres) { return docall_on(rc, rc->L, narg, nres); }

/* Whether msg reports another rank's failure ("rank R failed: ..." with R not this rank): the
 * communicator's wording when a peer aborted or timed out. */
static bool is_peer_failure(const char *msg, int rank) {
  for (const char *p = strstr(msg, "rank "); p != NULL; p = strstr(p + 1, "rank ")) {
    char *end;
    long r = strtol(p + 5, &end, 10);
    if (end != p + 5 && strncmp(end, " failed: ", 9) == 0 && r != rank) return true;
  }
  return false;
}

/* The first line of the first root-cause report of a multi-rank run, so that ranks failing
 * with the very same error (a typo every rank runs into, a collective mismatch both sides see)
 * say so in one line. Only the first line: what follows (a flight recorder) is per rank. */
static char g_first_msg[512];
static int g_first_rank = -1;

/* Length of msg without its traceback. */
static size_t message_len(const char *msg) {
  const char *tb = strstr(msg, "\nstack traceback:");
  return tb != NULL ? (size_t)(tb - msg) : strlen(msg);
}

/* Print the error message on top of the stack (if status is an error) and pop it. With several
 * ranks the report is prefixed "[rank R] "; a peer's failure, or the same error a rank already
 * reported in full, is cut to its first line. */
static int report(rank_ctx *rc, int status) {
  if (status == 0) return status;
  lua_State *L = rc->L;
  const char *msg = lua_tostring(L, -1);
  if (msg == NULL) msg = "(error object is not a string)";
  if (rc->world > 1) {
    size_t len = strlen(msg), head = strcspn(msg, "\n");
    int same_as = -1;
    if (is_peer_failure(msg, rc->rank)) {
      len = head;
    } else {
      pthread_mutex_lock(&g_out_mu);
      if (g_first_rank < 0) {
        g_first_rank = rc->rank;
        snprintf(g_first_msg, sizeof g_first_msg, "%.*s", (int)head, msg);
      } else if (head < sizeof g_first_msg && strlen(g_first_msg) == head &&
                 strncmp(g_first_msg, msg, head) == 0) {
        same_as = g_first_rank;
      }
      pthread_mutex_unlock(&g_out_mu);
    }
    lua_pushfstring(L, PROGNAME ": [rank %d] ", rc->rank);
    if (same_as >= 0) {
      lua_pushlstring(L, msg, head);
      lua_pushfstring(L, " (the same error as rank %d)\n", same_as);
    } else {
      lua_pushlstring(L, msg, len);
      lua_pushliteral(L, "\n");
    }
    lua_concat(L, 3);
  } else {
    lua_pushfstring(L, PROGNAME ": %s\n", msg);
  }
  write_err(lua_tostring(L, -1));
  lua_pop(L, 2);
  return status;
}

/* A chunk failed and this rank's run ends: poison the group so peers fail fast with
 * "rank R failed: <message>" (the message without the traceback). Called after report(), so
 * the root cause is printed before any peer wakes. */
static void fail_rank(rank_ctx *rc, const char *full_msg) {
  rc->status = g_interrupted ? EXIT_INTERRUPTED : EXIT_FAILURE;
  if (rc->comm == NULL) return;
  size_t len = message_len(full_msg);
  char msg[1024];
  snprintf(msg, sizeof msg, "%.*s", (int)(len < sizeof msg ? len : sizeof msg - 1), full_msg);
  fsdp_comm_abort(rc->comm, msg);
}

/* Run a chunk whose load status is given (the function, or the load error, on top) with narg
 * arguments above it; on failure report it and end the rank. Returns the status. */
static int run_chunk(rank_ctx *rc, int status, int narg) {
  lua_State *L = rc->L;
  if (status == 0) status = docall(rc, narg, 0);
  if (status != 0) {
    const char *m = lua_tostring(L, -1);
    lua_pushstring(L, m != NULL ? m : "(error object is not a string)");
    lua_insert(L, -2);
    report(rc, status);
    fail_rank(rc, lua_tostring(L, -1));
    lua_pop(L, 1);
  }
  return status;
}

static int dostring(rank_ctx *rc, const char *code, const char *chunkname) {
  int status = luaL_loadbuffer(rc->L, code, strlen(code), chunkname);
  return run_chunk(rc, status, 0);
}

/* Load and run the recipe with argv[script+1..] as its varargs. */
static int dorecipe(rank_ctx *rc) {
  lua_State *L = rc->L;
  const fsdprun_opts *o = rc->o;
  int status;
  if (o->source != NULL) {
    status = luaL_loadbuffer(L, o->source, o->source_len, o->chunkname);
  } else {
    const char *fname = o->argv[o->script];
    if (strcmp(fname, "-") == 0) fname = NULL; /* stdin */
    status = luaL_loadfile(L, fname);
  }
  int narg = 0;
  if (status == 0) {
    narg = o->argc - o->script - 1;
    luaL_checkstack(L, narg + 3, "too many arguments to the recipe");
    for (int i = o->script + 1; i < o->argc; i++) lua_pushstring(L, o->argv[i]);
  }
  return run_chunk(rc, status, narg);
}

/* ---- the REPL's host (src/cli/repl.c) ------------------------------------------------------ */

/* An input's evaluation: docall on the REPL's state. An interrupt hook left armed by an earlier
 * ^C that never fired (the rank was blocked in C and failed there) is cleared first, unless a
 * new ^C is pending. After an interrupted evaluation on several local ranks, a peer still
 * blocked in a collective with this rank would wait for the REPL timeout: once the ranks had
 * half a second to stop, poison the communicator so that it fails now. */
static int host_pcall(void *ctx, lua_State *L, int narg, int nres) {
  rank_ctx *rc = ctx;
  if (!g_interrupted && lua_gethook(L) == interrupt_hook) lua_sethook(L, NULL, 0, 0);
  int status = docall_on(rc, L, narg, nres);
  if (status != 0 && g_interrupted && rc->comm != NULL && rc->world > 1) {
    bool busy = true;
    for (int i = 0; i < 50 && busy; i++) {
      pthread_mutex_lock(&g_sig_mu);
      busy = g_nrunning > 0;
      pthread_mutex_unlock(&g_sig_mu);
      if (busy) nanosleep(&(struct timespec){.tv_nsec = 10000000}, NULL);
    }
    if (busy) fsdp_comm_abort(rc->comm, "interrupted");
  }
  return status;
}

/* Entering the REPL (paused = true) and leaving it. While the REPL waits (for input, for its
 * peers) this rank runs no Lua: a ^C must not aim a hook at the state of the recipe that called
 * fsdp.debug(). Evaluations mark themselves running through docall as usual. SIGINT stays
 * handled while any rank is in the REPL (see g_in_repl). */
static void host_pause(void *ctx, bool paused) {
  rank_ctx *rc = ctx;
  pthread_mutex_lock(&g_sig_mu);
  if (paused) {
    g_in_repl++;
    signal(SIGINT, on_sigint);
    rc->paused_L = g_running[rc->rank];
    if (rc->paused_L != NULL) {
      g_running[rc->rank] = NULL;
      if (--g_nrunning == 0) alarm(0);
    }
  } else {
    g_in_repl--;
    if (rc->paused_L != NULL) {
      g_nrunning++;
      g_running[rc->rank] = rc->paused_L;
      rc->paused_L = NULL;
    }
    if (g_nrunning == 0 && g_in_repl == 0) signal(SIGINT, SIG_DFL);
  }
  pthread_mutex_unlock(&g_sig_mu);
}

/* Rank 0 starts (true) or ends (false) reading an input; every rank waits for it. A new input
 * starts with no interrupt pending. */
static void host_reading(void *ctx, bool reading) {
  (void)ctx;
  pthread_mutex_lock(&g_sig_mu);
  if (reading && g_nrunning == 0) g_interrupted = 0;
  g_at_prompt = reading;
  pthread_mutex_unlock(&g_sig_mu);
}

static void host_write(void *ctx, FILE *f, const char *s, size_t n) {
  (void)ctx;
  pthread_mutex_lock(&g_out_mu);
  if (f == stderr) fflush(stdout);
  fwrite(s, 1, n, f);
  fflush(f);
  pthread_mutex_unlock(&g_out_mu);
}

static fsdp_repl_host repl_host(rank_ctx *rc) {
  return (fsdp_repl_host){.rank = rc->rank, .world = rc->world, .comm = rc->comm,
                          .ctl = rc->ctl, .ctx = rc, .pcall = host_pcall, .pause = host_pause,
                          .reading = host_reading, .write = host_write};
}

/* package.loaded.fsdprun.repl(where): the REPL, from fsdp.debug() (lua/fsdp/repl.lua), on the
 * calling Lua thread. Raises when the REPL could not run, or when it left the ranks'
 * communicator poisoned (the recipe cannot go on). */
static int l_fsdprun_repl(lua_State *L) {
  rank_ctx *rc = lua_touserdata(L, lua_upvalueindex(1));
  const char *where = luaL_optstring(L, 1, NULL);
  fsdp_repl_host h = repl_host(rc);
  char err[1024];
  if (fsdp_repl_run(&h, L, where, err, sizeof err) != 0)
    return luaL_error(L, "fsdp.debug: %s", err);
  if (rc->comm != NULL && fsdp_comm_poisoned(rc->comm))
    return luaL_error(L, "fsdp.debug: the ranks' communicator was poisoned in the REPL (a "
                         "collective failed there): the recipe cannot go on");
  return 0;
}

static void setup_fsdprun_module(lua_State *L, rank_ctx *rc) {
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "loaded");
  lua_newtable(L);
  lua_pushlightuserdata(L, rc);
  lua_pushcclosure(L, l_fsdprun_repl, 1);
  lua_setfield(L, -2, "repl");
  lua_setfield(L, -2, "fsdprun");
  lua_pop(L, 2);
}

/* -i: the REPL after the recipe. Entering it is collective (a rank whose recipe failed makes
 * it an error on the others); a failure there fails the rank like a recipe error. */
static bool repl_after_recipe(rank_ctx *rc) {
  fsdp_repl_host h = repl_host(rc);
  char err[1024];
  if (fsdp_repl_run(&h, rc->L, NULL, err, sizeof err) == 0) return true;
  lua_pushstring(rc->L, err);
  report(rc, LUA_ERRRUN);
  fail_rank(rc, err);
  return false;
}

/* ---- set-up ---------------------------------------------------------------------------- */

static bool is_dir(const char *path) {
  struct stat st;
  return path[0] != '\0' && stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The Lua library folder: installed tree first, then the source tree this binary was built
 * from. Returns false when neither exists. */
static bool find_lua_dir(char *out, size_t n) {
  char exe[PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len > 0) {
    exe[len] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash != NULL) {
      *slash = '\0';
      char cand[PATH_MAX + 32];
      snprintf(cand, sizeof cand, "%s/../share/fsdprun/lua", exe);
      char real[PATH_MAX];
      if (is_dir(cand) && realpath(cand, real) != NULL) {
        snprintf(out, n, "%s", real);
        return true;
      }
    }
  }
  if (is_dir(FSDP_SOURCE_LUA_DIR)) {
    snprintf(out, n, "%s", FSDP_SOURCE_LUA_DIR);
    return true;
  }
  return false;
}

static void setup_package(lua_State *L) {
  lua_getglobal(L, "package");
  char dir[PATH_MAX];
  if (find_lua_dir(dir, sizeof dir)) {
    lua_getfield(L, -1, "path");
    const char *old = lua_tostring(L, -1);
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", dir, dir, old != NULL ? old : "");
    lua_setfield(L, -3, "path");
    lua_pop(L, 1);
  }
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, luaopen_fsdp_core);
  lua_setfield(L, -2, "fsdp.core");
  lua_pop(L, 2);
}

/* The global `arg`, as luajit sets it: arg[0] is the recipe, arg[1..] its arguments, and the
 * interpreter and its options at negative indices. Without a recipe, arg[0] is the program. */
static void setup_arg(lua_State *L, const fsdprun_opts *o) {
  int zero = o->script > 0 ? o->script : 0;
  lua_createtable(L, o->argc - zero, zero + 1);
  for (int i = 0; i < o->argc; i++) {
    lua_pushstring(L, o->argv[i]);
    lua_rawseti(L, -2, i - zero);
  }
  lua_setglobal(L, "arg");
}

/* A rank's run, inside lua_cpcall: set the state up, run the -e chunks, the recipe and the
 * loop. rc->status says how it ended. */
static int fsdprun_main(lua_State *L) {
  rank_ctx *rc = (rank_ctx *)lua_touserdata(L, 1);
  const fsdprun_opts *o = rc->o;
  lua_settop(L, 0);
  lua_gc(L, LUA_GCSTOP, 0);
  luaL_openlibs(L);
  lua_gc(L, LUA_GCRESTART, -1);
  lua_register(L, "print", rank_print);
  setup_package(L);
  setup_arg(L, o);
  setup_fsdprun_module(L, rc);
  for (int i = 0; i < o->nexec; i++)
    if (dostring(rc, o->exec[i], "=(command line)") != 0) return 0;
  if (o->script > 0 && dorecipe(rc) != 0) return 0;
  if (o->interactive && !repl_after_recipe(rc)) return 0;
  rc->status = EXIT_SUCCESS;
  return 0;
}

/* Create the rank's state and run it; errors outside any chunk (out of memory in set-up) are
 * reported and fail the rank like a chunk error. */
static void run_rank(rank_ctx *rc) {
  rc->status = EXIT_FAILURE;
  rc->L = luaL_newstate();
  if (rc->L == NULL) {
    static const char msg[] = "cannot create the Lua state: not enough memory";
    char line[128];
    snprintf(line, sizeof line, PROGNAME ": %s\n", msg);
    write_err(line);
    if (rc->comm != NULL) fsdp_comm_abort(rc->comm, msg);
    return;
  }
  int status = lua_cpcall(rc->L, fsdprun_main, rc);
  if (status != 0) {
    const char *m = lua_tostring(rc->L, -1);
    lua_pushstring(rc->L, m != NULL ? m : "(error object is not a string)");
    lua_insert(rc->L, -2);
    report(rc, status);
    fail_rank(rc, lua_tostring(rc->L, -1));
    rc->status = EXIT_FAILURE;
  }
  lua_sethook(rc->L, NULL, 0, 0); /* an interrupt hook left armed must not fire in finalizers */
  lua_close(rc->L);
  rc->L = NULL;
}

/* A rank thread: its memory domain and communicator are this thread's current ones. */
static void *rank_thread(void *arg) {
  rank_ctx *rc = arg;
  fsdp_mem_domain *dom = fsdp_mem_domain_new();
  if (dom == NULL) {
    write_err(PROGNAME ": cannot create a memory domain: not enough memory\n");
    fsdp_comm_abort(rc->comm, "cannot create a memory domain: not enough memory");
    fsdp_comm_free(rc->comm);
    rc->comm = NULL;
    fsdp_comm_free(rc->ctl);
    rc->ctl = NULL;
    rc->status = EXIT_FAILURE;
    return NULL;
  }
  fsdp_mem_domain_set(dom);
  fsdp_comm_set_current(rc->comm);
  run_rank(rc);
  /* After lua_close, so that whatever the state's objects still had queued is waited for by
   * their own finalizers first. From here this rank has left the group: a peer waiting for it
   * in a collective fails at once ("rank R left") rather than at the timeout. */
  fsdp_comm_free(rc->comm);
  rc->comm = NULL;
  fsdp_comm_free(rc->ctl);
  rc->ctl = NULL;
  fsdp_mem_domain_free(dom); /* freed once its last storage goes */
  return NULL;
}

/* ---- several ranks ------------------------------------------------------------------------- */

/* Read the recipe once (a file, or stdin for "-") into o->source, and check that it compiles,
 * so a missing file or a syntax error is reported once rather than by every rank. Returns 0,
 * or 1 after reporting. */
static int load_recipe_once(fsdprun_opts *o) {
  const char *fname = o->argv[o->script];
  bool from_stdin = strcmp(fname, "-") == 0;
  FILE *f = from_stdin ? stdin : fopen(fname, "rb");
  if (f == NULL) {
    fprintf(stderr, PROGNAME ": cannot open %s: %s\n", fname, strerror(errno));
    return 1;
  }
  size_t cap = 1 << 16, len = 0;
  char *buf = malloc(cap);
  while (buf != NULL) {
    size_t n = fread(buf + len, 1, cap - len, f);
    len += n;
    if (len < cap) break;
    char *bigger = realloc(buf, cap * 2);
    if (bigger == NULL) {
      free(buf);
      buf = NULL;
      break;
    }
    buf = bigger;
    cap *= 2;
  }
  bool read_failed = buf == NULL || ferror(f);
  if (!from_stdin) fclose(f);
  if (read_failed) {
    fprintf(stderr, PROGNAME ": cannot read %s: %s\n", from_stdin ? "stdin" : fname,
            buf == NULL ? "not enough memory" : strerror(errno));
    free(buf);
    return 1;
  }
  o->source = buf;
  o->source_len = len;
  if (from_stdin) {
    o->chunkname = "=stdin";
  } else {
    size_t n = strlen(fname) + 2;
    char *name = malloc(n);
    if (name == NULL) {
      fprintf(stderr, PROGNAME ": out of memory\n");
      return 1;
    }
    snprintf(name, n, "@%s", fname);
    o->chunkname = name;
  }
  lua_State *L = luaL_newstate();
  if (L == NULL) {
    fprintf(stderr, PROGNAME ": cannot create the Lua state: not enough memory\n");
    return 1;
  }
  int status = luaL_loadbuffer(L, o->source, o->source_len, o->chunkname);
  if (status != 0) fprintf(stderr, PROGNAME ": %s\n", lua_tostring(L, -1));
  lua_close(L);
  return status != 0 ? 1 : 0;
}

static bool parse_positive_int(const char *s, int *out);

/* BLAS threads for N ranks: FSDP_BLAS_THREADS, else max(1, cores / N). Returns 0, or
 * EXIT_USAGE after reporting a malformed FSDP_BLAS_THREADS. Without -n only the variable is
 * applied (OpenBLAS keeps its own default otherwise, as before). */
static int setup_blas_threads(const fsdprun_opts *o) {
  const char *env = getenv("FSDP_BLAS_THREADS");
  int n = 0;
  if (env != NULL && env[0] != '\0') {
    if (!parse_positive_int(env, &n)) {
      fprintf(stderr, PROGNAME ": FSDP_BLAS_THREADS='%s' must be a positive integer\n", env);
      return EXIT_USAGE;
    }
  } else if (o->ranked && o->nranks > 1) {
    /* One BLAS thread per rank. max(1, cores/N) would oversubscribe nothing, but Debian's
     * OpenBLAS 0.3.21 (pthread build) is not safe with several multithreaded callers at once:
     * its gemm lock exists once per transpose variant, and a step mixes NN, NT and TN
     * (docs/comm.md "BLAS threads"; measured 1.6 vs 47.5 GFLOP/s). One thread per caller is
     * safe (tests/c/test_blas_threads.c) and, on this 2-core machine, what cores/N gives anyway.
     * FSDP_BLAS_THREADS overrides. */
    n = 1;
  }
  if (n > 0) fsdp_cpu_set_blas_threads(n);
  return 0;
}

/* Run N rank threads over one local group and wait for all of them. Returns the exit
 * status: 0 when every rank succeeded, 130 when interrupted, else 1. */
static int run_ranks(fsdprun_opts *o) {
  int world = o->nranks;
  if (o->script > 0 && load_recipe_once(o) != 0) return EXIT_FAILURE;
  rank_ctx *ranks = calloc((size_t)world, sizeof *ranks);
  g_running = calloc((size_t)world, sizeof *g_running);
  fsdp_local_group *group = NULL, *ctl_group = NULL;
  if (ranks == NULL || g_running == NULL || fsdp_local_group_new(&group, world) != FSDP_OK ||
      fsdp_local_group_new(&ctl_group, world) != FSDP_OK) {
    fprintf(stderr, PROGNAME ": cannot start %d ranks: %s\n", world,
            ranks == NULL || g_running == NULL ? "out of memory" : fsdp_error_msg());
    fsdp_local_group_release(group);
    free(ranks);
    free((void *)g_running);
    return EXIT_FAILURE;
  }
  g_nslots = world;
  g_rearm_interrupt = world == 1; /* -n 1 -i: each evaluation may be interrupted once; with
                                   * more ranks the REPL rearms before each input */
  int status = EXIT_SUCCESS, made = 0;
  for (; made < world; made++) {
    rank_ctx *rc = &ranks[made];
    *rc = (rank_ctx){.o = o, .rank = made, .world = world};
    /* ctl: the REPL's own group (fsdp.debug() may come from any recipe), made up front so
     * that a rank that leaves is seen by its peers there too ("rank R left") */
    if (fsdp_comm_local_new(&rc->comm, group, made) != FSDP_OK ||
        fsdp_comm_local_new(&rc->ctl, ctl_group, made) != FSDP_OK) {
      fprintf(stderr, PROGNAME ": cannot create the communicator of rank %d: %s\n", made,
              fsdp_error_msg());
      fsdp_comm_free(rc->comm);
      rc->comm = NULL;
      status = EXIT_FAILURE;
      break;
    }
    if (o->timeout > 0) fsdp_comm_set_timeout(rc->comm, o->timeout);
  }
  fsdp_local_group_release(group); /* the communicators keep them */
  fsdp_local_group_release(ctl_group);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, FSDPRUN_RANK_STACK);
  int started = 0;
  if (status == EXIT_SUCCESS) {
    for (; started < world; started++) {
      int err = pthread_create(&ranks[started].thread, &attr, rank_thread, &ranks[started]);
      if (err != 0) {
        char msg[160];
        snprintf(msg, sizeof msg, "cannot start the thread of rank %d: %s", started,
                 strerror(err));
        write_err(PROGNAME ": ");
        write_err(msg);
        write_err("\n");
        /* the ranks already running would wait for this one in their first collective */
        fsdp_comm_abort(ranks[started].comm, msg);
        status = EXIT_FAILURE;
        break;
      }
    }
  }
  pthread_attr_destroy(&attr);
  bool interrupted = false;
  for (int r = 0; r < started; r++) {
    pthread_join(ranks[r].thread, NULL);
    if (ranks[r].status == EXIT_INTERRUPTED) interrupted = true;
    if (ranks[r].status != EXIT_SUCCESS && status == EXIT_SUCCESS) status = EXIT_FAILURE;
  }
  if (interrupted) status = EXIT_INTERRUPTED;
  for (int r = started; r < made; r++) { /* never started */
    fsdp_comm_free(ranks[r].comm);
    fsdp_comm_free(ranks[r].ctl);
  }
  free(ranks);
  g_nslots = 0;
  free((void *)g_running);
  g_running = NULL;
  return status;
}

/* ---- the mpi backend (owner: mpi; docs/mpi.md) ------------------------------------------------ */

/* Whether mpirun (or another PMIx launcher) started this process. */
static bool mpi_launched(void) {
  return getenv("OMPI_COMM_WORLD_SIZE") != NULL || getenv("PMIX_RANK") != NULL;
}

/* BLAS threads of one rank process: FSDP_BLAS_THREADS (already applied), else the CPUs this
 * process may run on, at most this node's share of them (mpirun binds 1-2 ranks a core each,
 * more ranks to a socket or not at all). One caller per process: no OpenBLAS threading issue. */
static void mpi_blas_threads(void) {
  const char *env = getenv("FSDP_BLAS_THREADS");
  if (env != NULL && env[0] != '\0') return;
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  long cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : online;
  const char *ls = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  long local = ls != NULL ? strtol(ls, NULL, 10) : 1;
  long share = local > 0 ? online / local : online;
  long n = cpus < share ? cpus : share;
  fsdp_cpu_set_blas_threads(n > 0 ? (int)n : 1);
}

/* fsdprun -n N --backend mpi outside mpirun: start the job on this machine, N copies of this
 * executable with the same arguments under mpirun (FSDP_MPIRUN names another launcher). Returns
 * only on failure. */
static int exec_mpirun(const fsdprun_opts *o) {
  char self[PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) {
    fprintf(stderr, PROGNAME ": --backend mpi: cannot find this executable: %s\n", strerror(errno));
    return EXIT_FAILURE;
  }
  self[len] = '\0';
  const char *mpirun = getenv("FSDP_MPIRUN");
  if (mpirun == NULL || mpirun[0] == '\0') mpirun = "mpirun";
  char np[16];
  snprintf(np, sizeof np, "%d", o->nranks);
  const char **args = calloc((size_t)o->argc + 8, sizeof *args);
  if (args == NULL) {
    fprintf(stderr, PROGNAME ": out of memory\n");
    return EXIT_FAILURE;
  }
  int k = 0;
  args[k++] = mpirun;
  args[k++] = "-np";
  args[k++] = np;
  if (o->nranks > sysconf(_SC_NPROCESSORS_ONLN)) args[k++] = "--oversubscribe";
  if (geteuid() == 0) args[k++] = "--allow-run-as-root"; /* containers often run as root */
  args[k++] = self;
  for (int i = 1; i < o->argc; i++) args[k++] = o->argv[i];
  args[k] = NULL;
  fflush(stdout);
  fflush(stderr);
  execvp(mpirun, (char *const *)args);
  fprintf(stderr, PROGNAME ": --backend mpi: cannot run %s: %s (install openmpi-bin, or start "
          "fsdprun under mpirun yourself)\n", mpirun, strerror(errno));
  free(args);
  return EXIT_FAILURE;
}

/* One rank of an mpirun job (or, without mpirun, a world of one on MPI): the rank runs on a
 * thread like a local rank, over two mpi communicators (the recipe's and the REPL's `ctl`). */
static int run_mpi_rank(fsdprun_opts *o) {
  if (o->script > 0 && strcmp(o->argv[o->script], "-") == 0 && mpi_launched()) {
    fprintf(stderr, PROGNAME ": the mpi backend cannot read the recipe from standard input "
            "(mpirun gives it to rank 0 only): name a file\n");
    return EXIT_USAGE;
  }
  if (o->script > 0 && load_recipe_once(o) != 0) return EXIT_FAILURE;
  rank_ctx rc = {.o = o};
  if (fsdp_comm_mpi_new(&rc.comm) != FSDP_OK || fsdp_comm_mpi_new(&rc.ctl) != FSDP_OK) {
    fprintf(stderr, PROGNAME ": cannot create the mpi communicator: %s\n", fsdp_error_msg());
    fsdp_comm_free(rc.comm);
    return EXIT_FAILURE;
  }
  rc.rank = fsdp_comm_rank(rc.comm);
  rc.world = fsdp_comm_world(rc.comm);
  if (o->ranked && o->nranks != rc.world) {
    if (rc.rank == 0)
      fprintf(stderr, PROGNAME ": -n %d, but mpirun started %d ranks (leave -n out under "
              "mpirun)\n", o->nranks, rc.world);
    fsdp_comm_free(rc.comm);
    fsdp_comm_free(rc.ctl);
    return EXIT_USAGE;
  }
  if (o->timeout > 0) fsdp_comm_set_timeout(rc.comm, o->timeout);
  mpi_blas_threads();
  g_running = calloc((size_t)rc.world, sizeof *g_running);
  if (g_running == NULL) {
    fprintf(stderr, PROGNAME ": out of memory\n");
    return EXIT_FAILURE;
  }
  g_nslots = rc.world;
  g_rearm_interrupt = rc.world == 1;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, FSDPRUN_RANK_STACK);
  int err = pthread_create(&rc.thread, &attr, rank_thread, &rc);
  pthread_attr_destroy(&attr);
  if (err != 0) {
    fprintf(stderr, PROGNAME ": cannot start the rank's thread: %s\n", strerror(err));
    fsdp_comm_abort(rc.comm, "cannot start the rank's thread");
    fsdp_comm_free(rc.comm);
    fsdp_comm_free(rc.ctl);
    rc.status = EXIT_FAILURE;
  } else {
    pthread_join(rc.thread, NULL); /* it frees both communicators */
  }
  g_nslots = 0;
  free((void *)g_running);
  g_running = NULL;
  fflush(stdout);
  fflush(stderr);
  /* After a failure MPI is left unfinalized (collectives may be in flight) and the nonzero exit
   * makes mpirun end the job, killing the ranks still running. Linger a second first, so that
   * the peers this rank's poison woke have reported too. */
  if (rc.status != EXIT_SUCCESS && rc.world > 1) nanosleep(&(struct timespec){1, 0}, NULL);
  fsdp_mpi_finalize();
  return rc.status;
}

/* The mpi backend, when --backend mpi asks for it or mpirun started this process (and
 * --backend local does not say otherwise). Returns -1 for the local backend, else the exit
 * status of this process's rank. */
static int run_mpi_backend(fsdprun_opts *o) {
  bool launched = mpi_launched();
  if (o->backend != NULL ? strcmp(o->backend, "mpi") != 0 : !launched) return -1;
  if (!fsdp_mpi_available()) {
    fsdp_comm *c = NULL;
    fsdp_comm_mpi_new(&c); /* the stub's message */
    fprintf(stderr, PROGNAME ": %s%s\n", launched ? "started by mpirun, but " : "--backend mpi: ",
            fsdp_error_msg());
    return EXIT_FAILURE;
  }
  if (!launched && o->ranked && o->nranks > 1) return exec_mpirun(o);
  return run_mpi_rank(o);
}

/* ---- command line ---------------------------------------------------------------------- */

static void print_usage(FILE *f) {
  fprintf(f,
          "usage: " PROGNAME " [options] [--] recipe.lua [args...]\n"
          "       " PROGNAME " plot metrics.jsonl [-o out.svg] [--title=TEXT]"
          "   (see '" PROGNAME " plot --help')\n"
          "Run a Lua training recipe on the fsdprun engine.\n"
          "\n"
          "options:\n"
          "  -n N        run N ranks, threads of this process (local backend; default 1)\n"
          "  --backend local|mpi\n"
          "              how the ranks talk: threads of this process (local), or one process\n"
          "              per rank under Open MPI (mpi: the default when mpirun started\n"
          "              fsdprun; with -n N outside mpirun, fsdprun runs mpirun -np N itself)\n"
          "  --timeout=SECONDS\n"
          "              how long a collective waits for the other ranks (default 60)\n"
          "  -e CODE     run the Lua CODE before the recipe (may be repeated)\n"
          "  -i          open the REPL after the recipe (or alone), on every rank\n"
          "  --          stop reading options\n"
          "  -h, --help  show this help and exit\n"
          "  -v, --version\n"
          "              print the version and exit\n"
          "\n"
          "A recipe named '-' is read from standard input. Recipe arguments are in the global\n"
          "`arg` (arg[0] is the recipe) and, parsed (--key=value, --flag), in fsdp.args.\n"
          "Every rank runs the same recipe; errors are reported as '[rank R] ...'.\n"
          "Exit status: 0 success, 1 Lua error (on any rank), 2 usage error, 130 interrupted.\n");
}

static int usage_error(const char *fmt, const char *a, const char *b) {
  fprintf(stderr, PROGNAME ": ");
  fprintf(stderr, fmt, a, b);
  fprintf(stderr, " (try '" PROGNAME " --help')\n");
  return EXIT_USAGE;
}

static bool parse_positive_int(const char *s, int *out) {
  if (s[0] < '0' || s[0] > '9') return false;
  errno = 0;
  char *end;
  long v = strtol(s, &end, 10);
  if (errno != 0 || *end != '\0' || v <= 0 || v > INT_MAX) return false;
  *out = (int)v;
  return true;
}

static bool parse_seconds(const char *s, double *out) {
  if ((s[0] < '0' || s[0] > '9') && s[0] != '.') return false;
  errno = 0;
  char *end;
  double v = strtod(s, &end);
  if (errno != 0 || *end != '\0' || !(v > 0) || v > 1e9) return false;
  *out = v;
  return true;
}

/* Returns -1 to go on running, or an exit status (0 after --help/--version). */
static int parse_args(fsdprun_opts *o) {
  int argc = o->argc;
  char **argv = o->argv;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (a[0] != '-' || strcmp(a, "-") == 0) {
      o->script = i;
      break;
    }
    if (strcmp(a, "--") == 0) {
      if (i + 1 < argc) o->script = i + 1;
      break;
    }
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      print_usage(stdout);
      return EXIT_SUCCESS;
    }
    if (strcmp(a, "--version") == 0 || strcmp(a, "-v") == 0) {
      printf(PROGNAME " %s (" LUAJIT_VERSION ")\n", fsdp_version());
      return EXIT_SUCCESS;
    }
    if (strcmp(a, "-i") == 0) {
      o->interactive = true;
      continue;
    }
    if (strncmp(a, "--timeout", 9) == 0 && (a[9] == '=' || a[9] == '\0')) {
      const char *val = a[9] == '=' ? a + 10 : (i + 1 < argc ? argv[++i] : NULL);
      if (val == NULL) return usage_error("--timeout needs a number of seconds%s%s", "", "");
      if (!parse_seconds(val, &o->timeout))
        return usage_error("--timeout '%s': the timeout must be a positive number of seconds%s",
                           val, "");
      continue;
    }
    if (strncmp(a, "--backend", 9) == 0 && (a[9] == '=' || a[9] == '\0')) {
      const char *val = a[9] == '=' ? a + 10 : (i + 1 < argc ? argv[++i] : NULL);
      if (val == NULL || (strcmp(val, "local") != 0 && strcmp(val, "mpi") != 0))
        return usage_error("--backend '%s': expected 'local' or 'mpi'%s", val ? val : "", "");
      o->backend = val;
      continue;
    }
    if (a[1] == 'n' || a[1] == 'e') {
      const char *val = a[2] != '\0' ? a + 2 : (i + 1 < argc ? argv[++i] : NULL);
      if (a[1] == 'n') {
        if (val == NULL) return usage_error("-n needs a number of ranks%s%s", "", "");
        if (!parse_positive_int(val, &o->nranks))
          return usage_error("-n '%s': the number of ranks must be a positive integer%s", val,
                             "");
        if (o->nranks > FSDPRUN_MAX_RANKS)
          return usage_error("-n '%s': at most %s ranks run as threads of one process", val,
                             "1024");
        o->ranked = true;
      } else {
        if (val == NULL) return usage_error("-e needs Lua code as its argument%s%s", "", "");
        o->exec[o->nexec++] = val;
      }
      continue;
    }
    return usage_error("unknown option '%s'%s", a, "");
  }
  if (o->script == 0 && o->nexec == 0 && !o->interactive)
    return usage_error("no recipe given%s%s", "", "");
  return -1;
}

/* `fsdprun plot ARGS...`: a subcommand written in Lua (lua/fsdp/plot.lua, docs/plots.md). It
 * needs no ranks and no engine, so it runs in a plain state of its own: fsdp.plot.command parses
 * ARGS, prints its own messages and returns the exit status (0 written, 1 unreadable input or
 * nothing to plot, 2 usage error). */
static int run_plot(int argc, char **argv) {
  lua_State *L = luaL_newstate();
  if (L == NULL) {
    fprintf(stderr, PROGNAME ": cannot create the Lua state: not enough memory\n");
    return EXIT_FAILURE;
  }
  luaL_openlibs(L);
  setup_package(L);
  lua_pushcfunction(L, traceback_handler);
  int status = luaL_loadstring(L, "return require('fsdp.plot').command({...})");
  if (status == 0) {
    luaL_checkstack(L, argc, "too many arguments to plot");
    for (int i = 2; i < argc; i++) lua_pushstring(L, argv[i]);
    status = lua_pcall(L, argc - 2, 1, 1);
  }
  int rc = EXIT_FAILURE;
  if (status != 0) {
    const char *msg = lua_tostring(L, -1);
    fprintf(stderr, PROGNAME ": %s\n", msg != NULL ? msg : "(error object is not a string)");
  } else {
    rc = (int)lua_tointeger(L, -1);
  }
  lua_close(L);
  fflush(stdout);
  return rc;
}

int main(int argc, char **argv) {
  if (argc >= 2 && strcmp(argv[1], "plot") == 0) return run_plot(argc, argv);
  fsdprun_opts o = {.argc = argc, .argv = argv, .nranks = 1};
  o.exec = calloc((size_t)argc + 1, sizeof *o.exec);
  if (o.exec == NULL) {
    fprintf(stderr, PROGNAME ": out of memory\n");
    return EXIT_FAILURE;
  }
  int rc = parse_args(&o);
  if (rc < 0 && setup_blas_threads(&o) != 0) rc = EXIT_USAGE;
  if (rc >= 0) {
    free(o.exec);
    return rc;
  }
  if (o.timeout > 0) {
    /* for communicators made later without fsdprun's help (the world of one reads it too) */
    char val[32];
    snprintf(val, sizeof val, "%g", o.timeout);
    setenv("FSDP_TIMEOUT", val, 1);
  }
  int status = run_mpi_backend(&o); /* -1: not the mpi backend */
  if (status >= 0) {
    /* one rank of an mpirun job */
  } else if (o.ranked) {
    status = run_ranks(&o);
  } else {
    /* one rank on the main thread, in the process memory domain, with the world of one */
    static _Atomic(lua_State *) slot[1];
    g_running = slot;
    g_nslots = 1;
    g_rearm_interrupt = true;
    rank_ctx rank0 = {.o = &o, .rank = 0, .world = 1};
    run_rank(&rank0);
    status = rank0.status;
  }
  fflush(stdout);
  free(o.source);
  if (o.source != NULL && o.chunkname != NULL && o.chunkname[0] == '@')
    free((void *)o.chunkname);
  free(o.exec);
  return status;
}
