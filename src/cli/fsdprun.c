/*
 * fsdprun.c — the `fsdprun` launcher: runs a Lua recipe (and -e chunks, and an interactive loop)
 * on the statically linked engine, on one rank or on N ranks that are threads of this process.
 *
 *   fsdprun [-n N] [--timeout=SECONDS] [--progress=MODE] [-e CODE]... [-i] [--debug-on-error]
 *           [--] recipe.lua
 *           [args...]
 *
 * Built on the rank host (src/host/host.h) as lua.c is on lua.h: the host owns the rank
 * threads, their memory domains, communicators and Lua states, the traceback handler, the
 * failure reports, the Lua library path and the grace period after a failure; this file is
 * the command line, what a rank runs, output, signals and the REPL's glue. A rank's whole run
 * happens inside one lua_cpcall; every chunk runs under fsdp_host_pcall (the traceback
 * handler), so an error prints "fsdprun: <message>\n<traceback>" and the process exits 1.
 * Usage errors exit 2, an interrupt (SIGINT) exits 130.
 *
 * Ranks. Without -n there is one rank whose communicator is the world of one that
 * fsdp_comm_current() makes on first use. With -n N (N >= 1) the host makes one local group
 * and N rank threads; all run the same -e chunks and recipe (SPMD). Threads share nothing in
 * Lua; they meet only in collectives. A rank leaves the group (fsdp_host_rank_finish) when its
 * run ends, so a peer still waiting for it in a collective fails at once ("rank R left")
 * instead of at the timeout. The thread rule (each rank's cpu threads: fsdp_host_threads) is
 * applied once, before the rank threads start.
 *
 * Under mpirun (or with --backend mpi) each process is one rank of an Open MPI job instead: see
 * "the mpi backend" below and docs/mpi.md.
 *
 * Failure is collective (invariant 3). A rank whose chunk raises reports and only
 * then aborts the communicator (fsdp_host_rank_fail), so the root cause is on stderr before any
 * peer wakes with "rank R failed: <message>"; a peer's report is one line. Ranks that are not
 * in a collective then get the grace period: a rank still running Lua after it is stopped by
 * a hook; one that still runs (a compiled loop, a C call) is abandoned, and fsdprun exits
 * without joining it (_exit, so that no exit-time destructor runs beside it).
 *
 * Output. `print` is replaced in every rank's state by one that builds the whole line and
 * writes it with one fwrite under g_out_mu, so lines of different ranks never interleave;
 * error reports take the same lock (and flush stdout first, to keep the order on a shared
 * pipe). io.write is Lua's own and unlocked.
 *
 * Post-mortem (--debug-on-error, FSDPRUN_DEBUG_ON_ERROR, fsdp.debug_on_error): the recipe and
 * -e chunks run under post_mortem_msgh, which on a rank's first error reports it and poisons
 * the group as above, but holds the rank (the host stops the others at once and never abandons
 * a held rank) and runs the REPL (fsdp_repl_post_mortem) before the stack unwinds; the peers
 * follow from wherever their own error (the collective's, or the stop's) caught them.
 *
 * The REPL (-i, fsdp.debug()) is src/cli/repl.c: this file gives it a host (rank, communicators,
 * how to run Lua under the traceback handler and ^C) and the rank's second communicator, `ctl`,
 * for the REPL's own traffic (the input from rank 0, every rank's outcome back), so that the
 * recipe's communicator can fail or fall out of step without taking the REPL with it. Inside
 * an evaluation, print is captured for grouping (fsdp_repl_capture). Each rank's state also
 * gets package.loaded.fsdprun = {repl = function(where)}, which fsdp.debug() calls.
 *
 * SIGINT: like lua.c, the handler sets a Lua hook that raises "interrupted" at the next Lua
 * instruction, here in every rank's state that is running a chunk (fsdp_host_interrupt).
 * LuaJIT does not run hooks inside compiled traces (`while true do end` never leaves its
 * trace), and a rank may be blocked in C (a kernel, a collective), so the handler also arms a
 * grace timer: if the run has not stopped within FSDP_HOST_GRACE_S seconds, the process prints
 * "fsdprun: interrupted" and exits 130 on its own. A second SIGINT kills at once. os.execute is
 * replaced in every rank's state by one that does not use system(3), which ignores SIGINT in the
 * whole process while it waits.
 */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <lauxlib.h>
#include <lua.h>
#include <luajit.h>
#include <lualib.h>

#include "cli/repl.h"
#include "comm/comm.h"
#include "comm/mpi.h"
#include "comm/nccl.h"
#include "core/core.h"
#include "kernels/kernels.h"
#include "fsdp.h"
#include "host/host.h"
#include "lua/binding.h"

#define PROGNAME "fsdprun"
#define EXIT_USAGE 2
#define EXIT_INTERRUPTED 130
#define FSDPRUN_MAX_RANKS FSDP_HOST_MAX_RANKS

/* What the command line asked for; argv indices refer to main's argv. Read-only once the
 * ranks run. */
typedef struct fsdprun_opts {
  int argc;
  char **argv;
  int nranks;        /* -n; 1 when absent */
  bool ranked;       /* -n given: rank threads over a local group (even for -n 1) */
  double timeout;    /* --timeout; 0 when absent (the communicator's default) */
  const char *backend; /* --backend: "local", "mpi", or NULL (mpi when mpirun started us) */
  bool nccl;           /* --backend nccl (or auto, with a GPU for every rank): data over NCCL */
  bool auto_backend;   /* --backend auto */
  bool interactive;  /* -i */
  const char *progress; /* --progress: "auto", "bar", "line", "off"; NULL when absent */
  int nexec;         /* number of -e chunks */
  const char **exec; /* (nexec) their code, in command-line order */
  int script;        /* argv index of the recipe; 0 when none */
  /* ranked runs: the recipe read once by main (stdin can be read only once), and its name */
  char *source;
  size_t source_len;
  const char *chunkname;
} fsdprun_opts;

/* One rank: the host's (thread, communicators, Lua state) and what fsdprun keeps. */
typedef struct rank_ctx {
  const fsdprun_opts *o;
  fsdp_host_rank *hr;
  int status;          /* this rank's exit status */
  lua_State *paused_L; /* the REPL's pause: the state a ^C would have stopped */
  bool exiting;        /* the rank called os.exit: its run unwinds and ends with status */
  bool failed;         /* reported by the post-mortem handler already */
} rank_ctx;

/* --debug-on-error, FSDPRUN_DEBUG_ON_ERROR or fsdp.debug_on_error(true) (any rank's thread) */
static atomic_bool g_debug_on_error;

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

/* The host's reports (a rank's failure, an abandoned rank): "fsdprun: " and the text in one
 * write (stderr is unbuffered; ranks of other processes share it under mpirun), under g_out_mu,
 * stdout flushed first (to keep the order when both go to one pipe). */
static void write_report(void *ud, const char *text) {
  (void)ud;
  char *line = malloc(sizeof PROGNAME ": " + strlen(text));
  if (line != NULL) sprintf(line, PROGNAME ": %s", text);
  pthread_mutex_lock(&g_out_mu);
  fflush(stdout);
  if (line == NULL) fputs(PROGNAME ": ", stderr);
  fputs(line != NULL ? line : text, stderr);
  fflush(stderr);
  pthread_mutex_unlock(&g_out_mu);
  free(line);
}

/* ---- signals --------------------------------------------------------------------------- */

/* The ranks' host while they run; the handlers read it. */
static fsdp_host *_Atomic g_host;
static bool g_rearm_interrupt; /* one rank: each run may be interrupted once (the REPL) */
/* The REPL (host_pause, host_reading): while any rank is inside it, SIGINT stays handled even
 * when no rank runs Lua, so that a ^C in the gap between reading an input and running it is
 * kept for that evaluation rather than killing the session; at rank 0's prompt (reading without
 * libedit, which takes ^C as a key itself) it still ends fsdprun. Atomics: the handler reads
 * them. */
static atomic_int g_in_repl;   /* ranks inside the REPL */
static atomic_int g_at_prompt; /* rank 0 is reading an input */

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

static void on_sigint(int sig) {
  (void)sig;
  static _Atomic double first_at;
  fsdp_host *h = g_host;
  if (h == NULL) _exit(EXIT_INTERRUPTED);
  double now = monotonic_s();
  if (fsdp_host_interrupted(h)) {
    /* A second ^C kills at once. One ^C can arrive twice (coreutils timeout signals the child
     * and then its process group), so a repeat within half a second is the same ^C. */
    if (now - first_at < 0.5) return;
    on_sigalrm(SIGALRM);
  }
  first_at = now;
  if (!fsdp_host_interrupt(h)) {
    if (g_in_repl > 0 && !g_at_prompt) return; /* pending: the next evaluation stops at once */
    _exit(EXIT_INTERRUPTED);
  }
  signal(SIGALRM, on_sigalrm);
  alarm(FSDP_HOST_GRACE_S);
}

/* The host's running set changed (under its lock). SIGINT is handled while any rank runs Lua
 * (or is in the REPL); the grace timer ends when none does. */
static void on_running(void *ud, int n, bool first) {
  (void)ud;
  if (first) {
    if (g_rearm_interrupt && g_in_repl == 0) fsdp_host_interrupt_clear(g_host, false);
    signal(SIGINT, on_sigint);
  } else if (n == 0) {
    if (g_in_repl == 0) signal(SIGINT, SIG_DFL);
    alarm(0);
  }
}

/* ---- running chunks -------------------------------------------------------------------- */

/* A chunk failed and this rank's run ends: report it and poison the group (the host). */
static void fail_rank(rank_ctx *rc, const char *msg) {
  rc->status = fsdp_host_interrupted(rc->hr->host) ? EXIT_INTERRUPTED : EXIT_FAILURE;
  fsdp_host_rank_fail(rc->hr, msg);
}

/* ---- os.exit ------------------------------------------------------------------------------ */

#define EXIT_UNWIND "os.exit: the rank's run ends"

/* Armed by os.exit: raises again at every instruction, so that a pcall in the recipe cannot
 * keep the rank running. */
static void exit_hook(lua_State *L, lua_Debug *ar) {
  (void)ar;
  luaL_error(L, EXIT_UNWIND);
}

/* os.exit([code]) in a rank. exit() would end the other ranks mid-collective and, under
 * mpirun, skip MPI_Finalize (mpirun then prints that the process "exiting improperly"). The
 * rank's run ends instead, as if its chunk had returned, with code as its status (true 0,
 * false 1, none 0): the error unwinds to the rank's outermost frame, the state is closed
 * (finalizers run, files close), the rank leaves the group and fsdprun ends the way it always
 * does, MPI finalized. */
static int l_rank_exit(lua_State *L) {
  rank_ctx *rc = lua_touserdata(L, lua_upvalueindex(1));
  int code = EXIT_SUCCESS;
  if (lua_isboolean(L, 1)) code = lua_toboolean(L, 1) ? EXIT_SUCCESS : EXIT_FAILURE;
  else if (!lua_isnoneornil(L, 1)) code = (int)luaL_checkinteger(L, 1) & 0xff;
  /* after a failure (os.exit in the post-mortem) the status stays the failure's */
  if (!rc->exiting && !rc->failed) rc->status = code;
  rc->exiting = true;
  lua_sethook(L, exit_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
  return luaL_error(L, EXIT_UNWIND);
}

/* ---- os.execute ------------------------------------------------------------------------- */

/* The status of `/bin/sh -c cmd`, as system(3) gives it: a wait status, the exit status 127
 * when the shell cannot be started, -1 when it cannot be waited for. system(3) itself ignores
 * SIGINT and SIGQUIT in the whole process while it waits, which would lose a ^C for every rank
 * (and with it the interrupt and the grace period). The command gets the dispositions that exec
 * gives it, as under system(3): fsdprun's handled SIGINT is the default again there, an ignored
 * signal stays ignored; it is in fsdprun's process group, so a ^C at the terminal reaches it too,
 * while a signal sent to fsdprun's pid alone does not. */
static int spawn_shell(const char *cmd) {
  extern char **environ;
  char *argv[] = {"sh", "-c", (char *)cmd, NULL};
  pid_t pid;
  if (posix_spawn(&pid, "/bin/sh", NULL, NULL, argv, environ) != 0) return 127 << 8;
  int status;
  pid_t w;
  while ((w = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
  }
  return w == pid ? status : -1;
}

/* os.execute([command]) in a rank: LuaJIT's (the status of system(3), or with Lua 5.2
 * compatibility true|nil, "exit"|"signal", code; without a command whether a shell exists),
 * but run by spawn_shell. Upvalue: whether LuaJIT has 5.2 compatibility. */
static int l_rank_execute(lua_State *L) {
  bool lua52 = lua_toboolean(L, lua_upvalueindex(1));
  const char *cmd = luaL_optstring(L, 1, NULL);
  if (cmd == NULL) {
    if (lua52) lua_pushboolean(L, 1);
    else lua_pushinteger(L, access("/bin/sh", X_OK) == 0);
    return 1;
  }
  int status = spawn_shell(cmd);
  /* A ^C at the terminal reaches the command and fsdprun together: the command dies of SIGINT
   * and the handler marks the run interrupted, in whichever order the threads get there. Raise
   * the interrupt here rather than let the rank run on until the hook's next instruction (which
   * a compiled loop never reaches); a command killed by SIGINT from elsewhere returns as usual
   * once the handler has had its chance (at most 0.2 s). */
  if (status != -1 && WIFSIGNALED(status) && WTERMSIG(status) == SIGINT && g_host) {
    for (int i = 0; i < 200 && !fsdp_host_interrupted(g_host); i++)
      nanosleep(&(struct timespec){0, 1000000}, NULL);
    if (fsdp_host_interrupted(g_host)) return luaL_error(L, "interrupted");
  }
  if (lua52) return luaL_execresult(L, status);
  lua_pushinteger(L, status);
  return 1;
}

/* Replace os.execute in the rank's state (os on top). LuaJIT built with Lua 5.2 compatibility
 * makes `goto` a keyword, which is how its os.execute's results are told apart. */
static void setup_execute(lua_State *L) {
  bool lua52 = luaL_loadstring(L, "local goto = 1") != 0;
  lua_pop(L, 1);
  lua_pushboolean(L, lua52);
  lua_pushcclosure(L, l_rank_execute, 1);
  lua_setfield(L, -2, "execute");
}

static int post_mortem_msgh(lua_State *L);

/* Run a chunk whose load status is given (the function, or the load error, on top) with narg
 * arguments above it; on failure report it and end the rank (after os.exit: end it quietly,
 * rc->status is the exit code). Returns the status. */
static int run_chunk(rank_ctx *rc, int status, int narg) {
  lua_State *L = rc->hr->L;
  if (status == 0) status = fsdp_host_pcall_msgh(rc->hr, L, narg, 0, post_mortem_msgh);
  if (status != 0) {
    if (!rc->exiting && !rc->failed) fail_rank(rc, lua_tostring(L, -1));
    lua_pop(L, 1);
  }
  return status;
}

static int dostring(rank_ctx *rc, const char *code, const char *chunkname) {
  int status = luaL_loadbuffer(rc->hr->L, code, strlen(code), chunkname);
  return run_chunk(rc, status, 0);
}

/* Load and run the recipe with argv[script+1..] as its varargs. */
static int dorecipe(rank_ctx *rc) {
  lua_State *L = rc->hr->L;
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

/* An input's evaluation. After an interrupted evaluation on several local ranks, a peer still
 * blocked in a collective with this rank would wait for the REPL timeout: once the ranks had
 * half a second to stop, poison the communicator so that it fails now. */
static int host_pcall(void *ctx, lua_State *L, int narg, int nres) {
  rank_ctx *rc = ctx;
  fsdp_host *h = rc->hr->host;
  int status = fsdp_host_pcall(rc->hr, L, narg, nres);
  if (status != 0 && fsdp_host_interrupted(h) && rc->hr->comm != NULL && rc->hr->world > 1) {
    bool busy = true;
    for (int i = 0; i < 50 && busy; i++) {
      busy = fsdp_host_nrunning(h) > 0;
      if (busy) nanosleep(&(struct timespec){.tv_nsec = 10000000}, NULL);
    }
    if (busy) fsdp_comm_abort(rc->hr->comm, "interrupted");
  }
  return status;
}

/* Entering the REPL (paused = true) and leaving it. While the REPL waits (for input, for its
 * peers) this rank runs no Lua: a ^C must not aim a hook at the state of the recipe that called
 * fsdp.debug(). Evaluations mark themselves running through host_pcall as usual. SIGINT stays
 * handled while any rank is in the REPL (g_in_repl, counted before the host's running set
 * changes, so that on_running sees it). */
static void host_pause(void *ctx, bool paused) {
  rank_ctx *rc = ctx;
  if (paused) {
    g_in_repl++;
    rc->paused_L = fsdp_host_lua_leave(rc->hr);
    signal(SIGINT, on_sigint);
  } else {
    g_in_repl--;
    fsdp_host_lua_resume(rc->hr, rc->paused_L);
    rc->paused_L = NULL;
  }
}

/* Rank 0 starts (true) or ends (false) reading an input; every rank waits for it. A new input
 * starts with no interrupt pending. */
static void host_reading(void *ctx, bool reading) {
  rank_ctx *rc = ctx;
  if (reading) fsdp_host_interrupt_clear(rc->hr->host, true);
  g_at_prompt = reading;
}

static void host_write(void *ctx, FILE *f, const char *s, size_t n) {
  (void)ctx;
  pthread_mutex_lock(&g_out_mu);
  if (f == stderr) fflush(stdout);
  fwrite(s, 1, n, f);
  fflush(f);
  pthread_mutex_unlock(&g_out_mu);
}

static bool host_exiting(void *ctx) { return ((rank_ctx *)ctx)->exiting; }

static fsdp_repl_host repl_host(rank_ctx *rc) {
  return (fsdp_repl_host){.rank = rc->hr->rank, .world = rc->hr->world, .comm = rc->hr->comm,
                          .ctl = rc->hr->ctl, .ctx = rc, .pcall = host_pcall,
                          .pause = host_pause, .reading = host_reading, .write = host_write,
                          .exiting = host_exiting};
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
  if (rc->exiting) return luaL_error(L, EXIT_UNWIND); /* os.exit in the REPL: the run ends */
  if (rc->hr->comm != NULL && fsdp_comm_poisoned(rc->hr->comm))
    return luaL_error(L, "fsdp.debug: the ranks' communicator was poisoned in the REPL (a "
                         "collective failed there): the recipe cannot go on");
  return 0;
}

/* package.loaded.fsdprun.debug_on_error([on]) -> the previous setting (fsdp.debug_on_error). */
static int l_fsdprun_debug_on_error(lua_State *L) {
  bool was = g_debug_on_error;
  if (!lua_isnoneornil(L, 1)) g_debug_on_error = lua_toboolean(L, 1);
  lua_pushboolean(L, was);
  return 1;
}

/* ---- the post-mortem (--debug-on-error) -------------------------------------------------- */

static bool is_identifier(const char *s) {
  if (!(isalpha((unsigned char)s[0]) || s[0] == '_')) return false;
  for (; *s; s++)
    if (!(isalnum((unsigned char)*s) || *s == '_')) return false;
  return true;
}

/* The value on top into _G[name] (raw: a strict _G must not raise in a message handler), or
 * dropped when name is not an identifier ("(for index)", a C function's ""). */
static void set_global(lua_State *L, const char *name) {
  if (!is_identifier(name)) {
    lua_pop(L, 1);
    return;
  }
  lua_pushstring(L, name);
  lua_insert(L, -2);
  lua_rawset(L, LUA_GLOBALSINDEX);
}

/* The locals and upvalues of L's Lua frames as globals, the outermost first, so that on a name
 * clash the frame nearer the error wins. Returns where the innermost one stands
 * ("recipe.lua:12") in where. */
static void frames_to_globals(lua_State *L, char *where, size_t n) {
  lua_Debug ar;
  int levels = 1; /* level 0 is the message handler */
  while (lua_getstack(L, levels, &ar)) levels++;
  snprintf(where, n, "?");
  for (int level = levels - 1; level >= 1; level--) {
    if (!lua_getstack(L, level, &ar) || !lua_getinfo(L, "fSl", &ar)) continue;
    if (strcmp(ar.what, "C") == 0) {
      lua_pop(L, 1);
      continue;
    }
    const char *name;
    for (int i = 1; (name = lua_getupvalue(L, -1, i)) != NULL; i++) set_global(L, name);
    lua_pop(L, 1);
    for (int i = 1; (name = lua_getlocal(L, &ar, i)) != NULL; i++) set_global(L, name);
    if (ar.currentline > 0) snprintf(where, n, "%s:%d", ar.short_src, ar.currentline);
  }
}

/* The post-mortem REPL on L for a rank that failed (held, reported), or one line saying why
 * there is none. */
static void open_post_mortem(rank_ctx *rc, lua_State *L, const char *where) {
  fsdp_host_rank *hr = rc->hr;
  fsdp_repl_host h = repl_host(rc);
  char err[1024];
  if (fsdp_repl_post_mortem(&h, L, where, err, sizeof err) != 0) {
    char line[1200];
    if (hr->world > 1) snprintf(line, sizeof line, "[rank %d] no post-mortem: %s\n", hr->rank, err);
    else snprintf(line, sizeof line, "no post-mortem: %s\n", err);
    write_report(NULL, line);
  }
}

/* The message handler of the recipe and -e chunks. Without --debug-on-error it is the host's
 * traceback handler. With it, the first error of the rank's run (its own, a collective that
 * failed because a peer did, the stop that the host sends when a peer failed) is reported as
 * without the flag, the rank is held (the host neither stops nor abandons it) and the REPL
 * runs here, before the stack unwinds: on a new Lua thread (this one is handling an error: an
 * error in an input would be "error in error handling" on it), with the stack's locals and
 * `err` as globals. An interrupt (^C) ends the run as usual. */
static int post_mortem_msgh(lua_State *L) {
  fsdp_host_traceback(L);
  fsdp_host_rank *hr = fsdp_host_current();
  rank_ctx *rc = hr != NULL ? hr->ud : NULL;
  /* os.exit unwinds as an error too: that is no failure */
  if (rc == NULL || !g_debug_on_error || rc->failed || rc->exiting ||
      fsdp_host_interrupted(hr->host))
    return 1;
  const char *msg = lua_tostring(L, -1);
  rc->failed = true;
  fsdp_host_rank_hold(hr);
  fail_rank(rc, msg);
  luaL_checkstack(L, 8, "post-mortem");
  char where[256];
  frames_to_globals(L, where, sizeof where);
  lua_pushvalue(L, -1);
  set_global(L, "err");
  lua_State *co = lua_newthread(L);
  open_post_mortem(rc, co, where);
  lua_pop(L, 1); /* co */
  return 1;
}

static void setup_fsdprun_module(lua_State *L, rank_ctx *rc) {
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "loaded");
  lua_newtable(L);
  lua_pushlightuserdata(L, rc);
  lua_pushcclosure(L, l_fsdprun_repl, 1);
  lua_setfield(L, -2, "repl");
  lua_pushcfunction(L, l_fsdprun_debug_on_error);
  lua_setfield(L, -2, "debug_on_error");
  lua_setfield(L, -2, "fsdprun");
  lua_pop(L, 2);
}

/* -i: the REPL after the recipe. Entering it is collective (a rank whose recipe failed makes
 * it an error on the others); a failure there fails the rank like a recipe error. */
static bool repl_after_recipe(rank_ctx *rc) {
  fsdp_repl_host h = repl_host(rc);
  char err[1024];
  if (fsdp_repl_run(&h, rc->hr->L, NULL, err, sizeof err) == 0) return !rc->exiting;
  if (!g_debug_on_error || rc->failed || rc->exiting || fsdp_host_interrupted(rc->hr->host)) {
    fail_rank(rc, err);
    return false;
  }
  /* --debug-on-error: this rank finished its recipe and learnt of a peer's failure at the
   * entry's collective, as a rank in a collective of the recipe does; it opens the post-mortem
   * as that rank would (without its stack, which is gone), rather than leaving the group and
   * its failed peer with "no post-mortem: ... left the group". */
  rc->failed = true;
  fsdp_host_rank_hold(rc->hr);
  fail_rank(rc, err);
  lua_State *L = rc->hr->L;
  int top = lua_gettop(L);
  lua_getglobal(L, "require"); /* the globals of -i (fsdp, nn), as its session sets them */
  lua_pushliteral(L, "fsdp.repl");
  if (lua_pcall(L, 1, 1, 0) == 0 && lua_istable(L, -1)) {
    lua_getfield(L, -1, "preload");
    lua_pcall(L, 0, 0, 0); /* a failure leaves a message, dropped below */
  }
  lua_settop(L, top);
  lua_pushstring(L, err);
  set_global(L, "err");
  open_post_mortem(rc, L, "the entry of the REPL of -i");
  return false;
}

/* ---- a rank's run ---------------------------------------------------------------------- */

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
  fsdp_host_openlibs(L, fsdp_host_lua_dir(rc->hr->host));
  lua_register(L, "print", rank_print);
  setup_arg(L, o);
  setup_fsdprun_module(L, rc);
  lua_getglobal(L, "os");
  lua_pushlightuserdata(L, rc);
  lua_pushcclosure(L, l_rank_exit, 1);
  lua_setfield(L, -2, "exit");
  setup_execute(L);
  lua_pop(L, 1);
  for (int i = 0; i < o->nexec; i++)
    if (dostring(rc, o->exec[i], "=(command line)") != 0) return 0;
  if (o->script > 0 && dorecipe(rc) != 0) return 0;
  if (o->interactive && !repl_after_recipe(rc)) return 0;
  rc->status = EXIT_SUCCESS;
  return 0;
}

/* torchrun's RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE in the environment of a process
 * that holds one rank (mpirun's, or a single run), for the programs its recipe starts; os.getenv
 * in any rank's state gives the same (src/host/setup.c). Threads of -n N share one environment:
 * theirs is left alone. */
static void export_rank_env(const fsdp_host_rank *r) {
  if (fsdp_host_nranks(r->host) != 1) return;
  int local, local_world;
  fsdp_host_rank_local(r, &local, &local_world);
  const char *names[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  const int vals[] = {r->rank, r->world, local, local_world};
  for (int i = 0; i < 4; i++) {
    char v[16];
    snprintf(v, sizeof v, "%d", vals[i]);
    setenv(names[i], v, 1);
  }
}

/* The job of every rank: make its state and run it, then leave the group. Errors outside any
 * chunk (out of memory in set-up) fail the rank like a chunk error. */
static void rank_job(fsdp_host_rank *r, void *arg) {
  (void)arg;
  rank_ctx *rc = r->ud;
  rc->status = EXIT_FAILURE;
  export_rank_env(r);
  r->L = luaL_newstate();
  if (r->L == NULL) {
    fail_rank(rc, "cannot create the Lua state: not enough memory");
  } else {
    int status = lua_cpcall(r->L, fsdprun_main, rc);
    if (status != 0) {
      fail_rank(rc, lua_tostring(r->L, -1));
      rc->status = EXIT_FAILURE;
    }
  }
  /* The state first, so that whatever its objects still had queued is waited for by their own
   * finalizers; then this rank leaves the group. */
  fsdp_host_rank_finish(r);
}

/* Run the ranks of this process on a host (ho: how many, over which communicators) and wait
 * for them. Returns the exit status: 0 when every rank succeeded, 130 when interrupted, else
 * 1. When a rank could not be stopped after a failure, exits the process without it. */
static int run_host(fsdprun_opts *o, fsdp_host_opts ho) {
  char dir[PATH_MAX];
  ho.lua_dir = fsdp_host_find_lua_dir(dir, sizeof dir, NULL, 0) ? dir : NULL;
  ho.report = write_report;
  ho.running = on_running;
  fsdp_host *h;
  if (fsdp_host_new(&h, &ho) != FSDP_OK) {
    fprintf(stderr, PROGNAME ": %s\n", fsdp_error_msg());
    return EXIT_FAILURE;
  }
  int n = fsdp_host_nranks(h);
  rank_ctx *ranks = calloc((size_t)n, sizeof *ranks);
  if (ranks == NULL) {
    fprintf(stderr, PROGNAME ": out of memory\n");
    fsdp_host_free(h);
    return EXIT_FAILURE;
  }
  for (int i = 0; i < n; i++) {
    ranks[i] = (rank_ctx){.o = o, .hr = fsdp_host_rank_at(h, i)};
    ranks[i].hr->ud = &ranks[i];
  }
  /* -n 1 -i, one rank without -n or under mpirun: each evaluation may be interrupted once;
   * with more ranks the REPL rearms before each input */
  g_rearm_interrupt = ranks[0].hr->world == 1;
  g_host = h;
  int abandoned = fsdp_host_run(h, rank_job, NULL);
  /* a failure makes it 1 (130 after SIGINT); else the first rank's nonzero os.exit code */
  int status = EXIT_SUCCESS, exited = EXIT_SUCCESS;
  bool interrupted = false;
  for (int i = 0; i < n; i++) {
    bool gone = fsdp_host_rank_abandoned(ranks[i].hr);
    int st = gone ? EXIT_FAILURE : ranks[i].status;
    if (st == EXIT_INTERRUPTED) interrupted = true;
    if (ranks[i].exiting && !ranks[i].failed && !gone) {
      if (exited == EXIT_SUCCESS) exited = st;
    } else if (st != EXIT_SUCCESS) {
      status = EXIT_FAILURE;
    }
  }
  if (status == EXIT_SUCCESS) status = exited;
  if (interrupted) status = EXIT_INTERRUPTED;
  if (abandoned > 0) {
    /* Nothing stops a thread in a compiled loop or a C call; only the process's end does. */
    fflush(NULL);
    _exit(status);
  }
  fsdp_host_free(h); /* no rank runs Lua: SIGINT is back to its default, no handler reads it */
  g_host = NULL;
  free(ranks);
  return status;
}

/* ---- several ranks ------------------------------------------------------------------------- */

/* Read the recipe once (a file, or stdin for "-") into o->source, and check that it compiles,
 * so a missing file or a syntax error is reported once rather than by every rank. Returns 0,
 * or 1 after reporting. */
static int load_recipe_once(fsdprun_opts *o) {
  if (o->source != NULL) return 0; /* a built-in subcommand's chunk (fsdprun sample) */
  const char *fname = o->argv[o->script];
  bool from_stdin = strcmp(fname, "-") == 0;
  FILE *f = from_stdin ? stdin : fopen(fname, "rb");
  if (f == NULL) {
    fprintf(stderr, PROGNAME ": cannot open %s: %s\n", fname, strerror(errno));
    return 1;
  }
  size_t len = 0;
  char *buf = fsdp_host_read_all(f, &len);
  int err = errno;
  if (!from_stdin) fclose(f);
  if (buf == NULL) {
    fprintf(stderr, PROGNAME ": cannot read %s: %s\n", from_stdin ? "stdin" : fname,
            strerror(err));
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

/* Each rank's cpu threads: FSDP_THREADS (or FSDP_BLAS_THREADS), else max(1, cores / N) with
 * -n N, else every core (fsdp_host_threads; docs/cli.md "Threads"). Returns 0, or EXIT_USAGE
 * after reporting a malformed variable. */
static int setup_threads(const fsdprun_opts *o) {
  if (fsdp_host_threads(0, o->ranked ? o->nranks : 1) != FSDP_OK) {
    fprintf(stderr, PROGNAME ": %s\n", fsdp_error_msg());
    return EXIT_USAGE;
  }
  return 0;
}

/* Run N rank threads over one local group (and a second group for the REPL's ctl: made up
 * front, fsdp.debug() may come from any recipe, so that a rank that leaves is seen there too)
 * and wait for all of them. */
static int run_ranks(fsdprun_opts *o) {
  if (o->script > 0 && load_recipe_once(o) != 0) return EXIT_FAILURE;
  return run_host(o, (fsdp_host_opts){.nranks = o->nranks, .group = true, .ctl = true,
                                      .timeout_s = o->timeout, .nccl = o->nccl});
}

/* --backend nccl / auto: whether this machine can. nccl without a build or a GPU is an error
 * naming what is missing; auto quietly stays with the threads' own backend. GPUs are counted
 * per process: under mpirun each rank checks its own machine (ranks = its local share). */
static int choose_nccl(fsdprun_opts *o, int ranks_here) {
  if (!o->nccl && !o->auto_backend) return 0;
  fsdp_kernels_init();
  int gpus = fsdp_device_count_of("cuda");
  const char *why = NULL;
  char buf[160];
  if (!fsdp_nccl_available()) {
    why = "fsdprun was built without NCCL";
  } else if (gpus < ranks_here) {
    snprintf(buf, sizeof buf, "%d rank%s on this machine, %d GPU%s (NCCL takes one GPU per rank; "
             "several ranks on one GPU: --backend local)", ranks_here, ranks_here == 1 ? "" : "s",
             gpus, gpus == 1 ? "" : "s");
    why = buf;
  }
  if (o->auto_backend) {
    o->nccl = why == NULL;
    return 0;
  }
  if (why) {
    fprintf(stderr, PROGNAME ": --backend nccl: %s\n", why);
    return EXIT_USAGE;
  }
  return 0;
}

/* ---- the mpi backend (docs/mpi.md) ------------------------------------------------ */

/* Whether mpirun (or another PMIx launcher) started this process. */
static bool mpi_launched(void) {
  return getenv("OMPI_COMM_WORLD_SIZE") != NULL || getenv("PMIX_RANK") != NULL;
}

/* Under mpirun a rank's stdout is a pseudo-terminal that mpirun reads and forwards, whatever
 * mpirun's own stdout is (a file, a pipe): the user sees a terminal only when mpirun's stdout
 * is one. mpirun is this process's parent on the node that launched the job; elsewhere the
 * parent is a daemon whose stdout is no terminal, which is right too (the bar is rank 0's). */
static bool mpi_stdout_is_terminal(void) {
  if (!isatty(STDOUT_FILENO)) return false;
  char path[64], target[256];
  snprintf(path, sizeof path, "/proc/%ld/fd/1", (long)getppid());
  ssize_t n = readlink(path, target, sizeof target - 1);
  if (n <= 0) return false;
  target[n] = '\0';
  return strncmp(target, "/dev/pts/", 9) == 0 || strncmp(target, "/dev/tty", 8) == 0;
}

/* fsdp.log's progress mode (lua/fsdp/log.lua reads FSDP_PROGRESS): --progress, else under
 * mpirun "line" when the user does not see a terminal (auto would see the rank's pty). */
static void setup_progress(const fsdprun_opts *o) {
  const char *env = getenv("FSDP_PROGRESS");
  if (o->progress != NULL) setenv("FSDP_PROGRESS", o->progress, 1);
  else if ((env == NULL || env[0] == '\0' || strcmp(env, "auto") == 0) && mpi_launched() &&
           !mpi_stdout_is_terminal())
    setenv("FSDP_PROGRESS", "line", 1);
}

/* The ranks of this job on this machine (mpirun's OMPI_COMM_WORLD_LOCAL_SIZE), at least 1. */
static int mpi_local_size(void) {
  const char *ls = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  long local = ls != NULL ? strtol(ls, NULL, 10) : 1;
  return local > 0 && local <= INT_MAX ? (int)local : 1;
}

/* Threads of one rank process: the variables (already checked by setup_threads), else the
 * CPUs this process may run on, at most this machine's share of them (fsdp_host_mpi_threads). */
static void mpi_threads(void) {
  if (fsdp_host_mpi_threads(mpi_local_size()) != FSDP_OK) fsdp_error_clear();
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
  fsdp_comm *comm = NULL, *ctl = NULL;
  if (fsdp_comm_mpi_new(&comm) != FSDP_OK || fsdp_comm_mpi_new(&ctl) != FSDP_OK) {
    fprintf(stderr, PROGNAME ": cannot create the mpi communicator: %s\n", fsdp_error_msg());
    fsdp_comm_free(comm);
    return EXIT_FAILURE;
  }
  int rank = fsdp_comm_rank(comm), world = fsdp_comm_world(comm);
  if (o->ranked && o->nranks != world) {
    if (rank == 0)
      fprintf(stderr, PROGNAME ": -n %d, but mpirun started %d ranks (leave -n out under "
              "mpirun)\n", o->nranks, world);
    fsdp_comm_free(comm);
    fsdp_comm_free(ctl);
    return EXIT_USAGE;
  }
  mpi_threads();
  /* nccl or auto: every rank must choose alike, so they agree on the minimum of their wishes */
  if (o->nccl || o->auto_backend) {
    bool asked = o->nccl;
    int bad = choose_nccl(o, mpi_local_size());
    double can = bad == 0 && o->nccl ? 1 : 0;
    if (fsdp_comm_all_reduce(comm, &can, 1, FSDP_DTYPE_F64, FSDP_RED_MIN, "fsdprun.backend")) {
      fprintf(stderr, PROGNAME ": %s\n", fsdp_error_msg());
      fsdp_comm_free(comm);
      fsdp_comm_free(ctl);
      return EXIT_FAILURE;
    }
    if (asked && can == 0) {
      if (bad == 0 && rank == 0)
        fprintf(stderr, PROGNAME ": --backend nccl: another rank cannot use NCCL (see its "
                "message)\n");
      fsdp_comm_free(comm);
      fsdp_comm_free(ctl);
      return EXIT_USAGE;
    }
    o->nccl = can != 0;
  }
  int status = run_host(o, (fsdp_host_opts){.nranks = 1, .comm = comm, .ctl_comm = ctl,
                                            .timeout_s = o->timeout, .nccl = o->nccl});
  /* After a failure MPI is left unfinalized (collectives may be in flight: MPI_Finalize could
   * wait for a hung peer forever) and the nonzero exit makes mpirun end the job, killing the
   * ranks still running. That holds when the recipe caught the failure and ended normally too
   * (pcall, the REPL): a process that exits 0 without MPI_Finalize is what mpirun reports as
   * "exiting improperly", which cannot be told from Open MPI's launch race, so it exits 1. */
  const char *blocked = fsdp_mpi_finalize_blocked();
  if (status == EXIT_SUCCESS && blocked) {
    fprintf(stderr, PROGNAME ": [rank %d] exits with status 1 without MPI_Finalize: %s\n", rank,
            blocked);
    status = EXIT_FAILURE;
  }
  fflush(stdout);
  fflush(stderr);
  /* Linger a second before a failing exit, so that the peers this rank's poison woke have
   * reported before mpirun ends the job. */
  if (status != EXIT_SUCCESS && world > 1) nanosleep(&(struct timespec){1, 0}, NULL);
  fsdp_mpi_finalize();
  return status;
}

/* The mpi backend, when --backend mpi asks for it or mpirun started this process (and
 * --backend local does not say otherwise). Returns -1 for the local backend, else the exit
 * status of this process's rank. */
static int run_mpi_backend(fsdprun_opts *o) {
  bool launched = mpi_launched();
  /* nccl and auto bootstrap over mpi when mpirun started this process, over threads else */
  bool wants = o->backend == NULL || o->nccl || o->auto_backend ? launched
                                                                : strcmp(o->backend, "mpi") == 0;
  if (!wants) return -1;
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

/* The environment that fsdprun reads later, checked before anything runs, as FSDP_THREADS is:
 * a launcher's local rank variables (read by one rank of a process: no -n, -n 1, under mpirun)
 * and FSDP_REPL_TIMEOUT (the REPL may open from any recipe, fsdp.debug()). Returns 0, or
 * EXIT_USAGE after reporting the malformed variable. */
static int check_env(const fsdprun_opts *o) {
  int nranks = o->ranked && !mpi_launched() ? o->nranks : 1;
  if (fsdp_host_local_env_check(nranks) != FSDP_OK) {
    fprintf(stderr, PROGNAME ": %s\n", fsdp_error_msg());
    return EXIT_USAGE;
  }
  char err[256];
  if (fsdp_repl_env_timeout(NULL, err, sizeof err) != 0) {
    fprintf(stderr, PROGNAME ": %s\n", err);
    return EXIT_USAGE;
  }
  return 0;
}

/* Without -n the rank's world of one is made on first use, where a malformed FSDP_TIMEOUT or
 * FSDP_COMM_CHECK is taken as unset (fsdp_comm_current must not fail: plain luajit and hosts
 * rely on it). fsdprun refuses them as -n 1's communicator creation does, before anything
 * runs, by making one world of one under the strict rules and dropping it. Returns 0, or
 * EXIT_FAILURE after reporting. */
static int check_world_of_one(void) {
  fsdp_comm *c = NULL;
  if (fsdp_comm_single_new(&c) != FSDP_OK) {
    fprintf(stderr, PROGNAME ": cannot create the communicator of rank 0: %s\n",
            fsdp_error_msg());
    return EXIT_FAILURE;
  }
  fsdp_comm_free(c);
  return 0;
}

/* ---- command line ---------------------------------------------------------------------- */

static void print_usage(FILE *f) {
  fprintf(f,
          "usage: " PROGNAME " [options] [--] recipe.lua [args...]\n"
          "       " PROGNAME " plot metrics.jsonl [-o out.svg] [--title=TEXT]"
          "   (see '" PROGNAME " plot --help')\n"
          "       " PROGNAME " [options] sample CHECKPOINT --prompt=TEXT [...]"
          "   (see '" PROGNAME " sample --help')\n"
          "       " PROGNAME " tokenize --out DIR (--model M | --vocab-size N) corpus..."
          "   (see '" PROGNAME " tokenize --help')\n"
          "Run a Lua training recipe on the fsdprun engine.\n"
          "\n"
          "options:\n"
          "  -n N        run N ranks, threads of this process (local backend; default 1)\n"
          "  --backend local|mpi|nccl|auto\n"
          "              how the ranks talk: threads of this process (local), or one process\n"
          "              per rank under Open MPI (mpi: the default when mpirun started\n"
          "              fsdprun; with -n N outside mpirun, fsdprun runs mpirun -np N itself);\n"
          "              nccl: cuda tensors move over NCCL, one GPU per rank, bootstrapped\n"
          "              over threads or (under mpirun) mpi; auto: nccl when every rank has a\n"
          "              GPU, else the default\n"
          "  --timeout=SECONDS\n"
          "              how long a collective waits for the other ranks (default 60)\n"
          "  --progress=auto|bar|line|off\n"
          "              fsdp.log's progress on rank 0: a bar redrawn in place, plain lines,\n"
          "              or none; auto (the default): the bar when standard output is a\n"
          "              terminal the user sees (under mpirun: when mpirun's is), else lines\n"
          "  -e CODE     run the Lua CODE before the recipe (may be repeated)\n"
          "  -i          open the REPL after the recipe (or alone), on every rank\n"
          "  --debug-on-error\n"
          "              when a rank raises, open the REPL where every rank stopped (the\n"
          "              failing rank at the error, with its locals); :quit exits 1\n"
          "              (also FSDPRUN_DEBUG_ON_ERROR=1, or fsdp.debug_on_error(true))\n"
          "  --          stop reading options\n"
          "  -h, --help  show this help and exit\n"
          "  -v, --version\n"
          "              print the version and exit\n"
          "\n"
          "A recipe named '-' is read from standard input. Recipe arguments are in the global\n"
          "`arg` (arg[0] is the recipe) and, parsed (--key=value, --flag), in fsdp.args.\n"
          "Every rank runs the same recipe; errors are reported as '[rank R] ...'.\n"
          "FSDP_THREADS=K sets each rank's cpu threads (default max(1, cores / N)).\n"
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

/* A timeout: any finite number of seconds > 0, as FSDP_TIMEOUT takes (a huge one is no limit in
 * practice: the communicators cap their waits at about 30 years). */
static bool parse_seconds(const char *s, double *out) {
  if ((s[0] < '0' || s[0] > '9') && s[0] != '.') return false;
  errno = 0;
  char *end;
  double v = strtod(s, &end);
  if (errno != 0 || *end != '\0' || !(v > 0) || !isfinite(v)) return false;
  *out = v;
  return true;
}

/* Whether a is the long option `name`, given as `name=VALUE` or `name VALUE` (then *i steps
 * over VALUE); *val is the value, or NULL where it is missing. */
static bool long_option(const char *a, const char *name, int argc, char **argv, int *i,
                        const char **val) {
  size_t n = strlen(name);
  if (strncmp(a, name, n) != 0 || (a[n] != '=' && a[n] != '\0')) return false;
  *val = a[n] == '=' ? a + n + 1 : (*i + 1 < argc ? argv[++*i] : NULL);
  return true;
}

/* Whether s (possibly NULL) is one of the NULL-terminated words */
static bool one_of(const char *s, const char *const *words) {
  for (; s && *words; words++)
    if (strcmp(s, *words) == 0) return true;
  return false;
}

/* Returns -1 to go on running, or an exit status (0 after --help/--version). */
static int parse_args(fsdprun_opts *o) {
  int argc = o->argc;
  char **argv = o->argv;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (a[0] != '-' || strcmp(a, "-") == 0) {
      o->script = i;
      /* plot and tokenize run in a plain Lua state without ranks (main), so they come first;
       * after fsdprun's options the word would otherwise be read as a recipe file named so,
       * and a run would end with "cannot open plot" */
      if (strcmp(a, "plot") == 0 || strcmp(a, "tokenize") == 0)
        return usage_error("'%s' runs without ranks and takes none of fsdprun's options: "
                           "'fsdprun %s ...'",
                           a, a);
      if (strcmp(a, "sample") == 0) {
        /* `fsdprun [options] sample CHECKPOINT ...`: the recipe is lua/fsdp/sample.lua's
         * command, on as many ranks as -n gives (docs/cli.md) */
        static const char chunk[] = "return require('fsdp.sample').command(...)";
        o->source = malloc(sizeof chunk); /* main frees it */
        if (o->source == NULL) return usage_error("out of memory%s%s", "", "");
        memcpy(o->source, chunk, sizeof chunk);
        o->source_len = sizeof chunk - 1;
        o->chunkname = "=fsdprun sample";
      }
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
    if (strcmp(a, "--debug-on-error") == 0) {
      g_debug_on_error = true;
      continue;
    }
    const char *val;
    if (long_option(a, "--timeout", argc, argv, &i, &val)) {
      if (val == NULL)
        return usage_error("--timeout needs a value: a positive number of seconds%s%s", "", "");
      if (!parse_seconds(val, &o->timeout))
        return usage_error("--timeout '%s': the timeout must be a positive number of seconds%s",
                           val, "");
      continue;
    }
    if (long_option(a, "--progress", argc, argv, &i, &val)) {
      if (val == NULL)
        return usage_error("--progress needs a value: 'auto', 'bar', 'line' or 'off'%s%s", "",
                           "");
      if (!one_of(val, (const char *const[]){"auto", "bar", "line", "off", NULL}))
        return usage_error("--progress '%s': expected 'auto', 'bar', 'line' or 'off'%s",
                           val, "");
      o->progress = val;
      continue;
    }
    if (long_option(a, "--backend", argc, argv, &i, &val)) {
      if (val == NULL)
        return usage_error("--backend needs a value: 'local', 'mpi', 'nccl' or 'auto'%s%s", "",
                           "");
      if (!one_of(val, (const char *const[]){"local", "mpi", "nccl", "auto", NULL}))
        return usage_error("--backend '%s': expected 'local', 'mpi', 'nccl' or 'auto'%s", val,
                           "");
      o->nccl = strcmp(val, "nccl") == 0;
      o->auto_backend = strcmp(val, "auto") == 0;
      o->backend = o->nccl || o->auto_backend ? NULL : val;
      continue;
    }
    if (a[1] == 'n' || a[1] == 'e') {
      val = a[2] != '\0' ? a + 2 : (i + 1 < argc ? argv[++i] : NULL);
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

/* `fsdprun plot ARGS...` (lua/fsdp/plot.lua, docs/plots.md) and `fsdprun tokenize ARGS...`
 * (lua/fsdp/tokenizer.lua, docs/data.md): subcommands written in Lua. They need no ranks, so
 * each runs in a plain state of its own (fsdp.core preloaded): `module`'s `command` parses
 * ARGS, prints its own messages and returns the exit status (0 done, 1 unreadable input or a
 * failure of the work itself, 2 usage error). */
static int run_lua_command(const char *name, const char *module, int argc, char **argv) {
  lua_State *L = luaL_newstate();
  if (L == NULL) {
    fprintf(stderr, PROGNAME ": cannot create the Lua state: not enough memory\n");
    return EXIT_FAILURE;
  }
  char dir[PATH_MAX];
  fsdp_host_openlibs(L, fsdp_host_find_lua_dir(dir, sizeof dir, NULL, 0) ? dir : NULL);
  lua_pushcfunction(L, fsdp_host_traceback);
  char code[128], chunk[64];
  snprintf(code, sizeof code, "return require('%s').command({...})", module);
  snprintf(chunk, sizeof chunk, "=" PROGNAME " %s", name);
  int status = luaL_loadbuffer(L, code, strlen(code), chunk);
  if (status == 0) {
    luaL_checkstack(L, argc, "too many arguments");
    for (int i = 2; i < argc; i++) lua_pushstring(L, argv[i]);
    status = lua_pcall(L, argc - 2, 1, 1);
  }
  int rc = EXIT_FAILURE;
  if (status != 0) {
    const char *msg = lua_tostring(L, -1);
    fprintf(stderr, PROGNAME " %s: %s\n", name,
            msg != NULL ? msg : "(error object is not a string)");
  } else {
    rc = (int)lua_tointeger(L, -1);
  }
  lua_close(L);
  fflush(stdout);
  return rc;
}

int main(int argc, char **argv) {
  if (argc >= 2 && strcmp(argv[1], "plot") == 0)
    return run_lua_command("plot", "fsdp.plot", argc, argv);
  if (argc >= 2 && strcmp(argv[1], "tokenize") == 0)
    return run_lua_command("tokenize", "fsdp.tokenizer", argc, argv);
  fsdprun_opts o = {.argc = argc, .argv = argv, .nranks = 1};
  const char *doe = getenv("FSDPRUN_DEBUG_ON_ERROR");
  g_debug_on_error = doe != NULL && doe[0] != '\0' && strcmp(doe, "0") != 0;
  o.exec = calloc((size_t)argc + 1, sizeof *o.exec);
  if (o.exec == NULL) {
    fprintf(stderr, PROGNAME ": out of memory\n");
    return EXIT_FAILURE;
  }
  int rc = parse_args(&o);
  if (rc < 0 && (setup_threads(&o) != 0 || check_env(&o) != 0)) rc = EXIT_USAGE;
  if (rc >= 0) {
    free(o.exec);
    return rc;
  }
  if (o.timeout > 0) {
    /* for communicators made later without fsdprun's help (the world of one reads it too) */
    char val[32];
    snprintf(val, sizeof val, "%.17g", o.timeout);
    setenv("FSDP_TIMEOUT", val, 1);
  }
  setup_progress(&o);
  int status = run_mpi_backend(&o); /* -1: not the mpi backend */
  if (status >= 0) {
    /* one rank of an mpirun job */
  } else if ((status = choose_nccl(&o, o.ranked ? o.nranks : 1)) != 0) {
    /* --backend nccl on a machine that cannot */
  } else if (o.ranked || o.nccl) {
    if (!o.ranked) o.nranks = 1;
    status = run_ranks(&o);
  } else if ((status = check_world_of_one()) == 0) {
    /* one rank with the world of one */
    status = run_host(&o, (fsdp_host_opts){.nranks = 1});
  }
  fflush(stdout);
  free(o.source);
  if (o.source != NULL && o.chunkname != NULL && o.chunkname[0] == '@')
    free((void *)o.chunkname);
  free(o.exec);
  return status;
}
