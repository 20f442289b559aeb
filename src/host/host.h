/*
 * host.h — the rank host: what runs ranks in a process, for every program that does (the
 * embedding runtime of include/fsdp.h in src/embed/, and fsdprun in src/cli/ on top of it as
 * lua.c is on lua.h). Compiled into the engine archive, so libfsdp.so and fsdprun carry the
 * same code.
 *
 * A host is `nranks` rank threads. Each owns a memory domain (current on its thread), a
 * communicator (current on its thread: one local group over the ranks, or one the program
 * gives, e.g. an mpi one, or none: a world of one made on first use), optionally a second
 * communicator `ctl` (the REPL's channel) and a Lua state the program makes on the thread.
 * The program hands every rank the same job (fsdp_host_run) and waits until all have done it.
 * Threads live until fsdp_host_free; states and communicators until the rank finishes
 * (fsdp_host_rank_finish) or its thread ends.
 *
 * Failure is collective (invariant 3). A rank whose Lua code fails calls
 * fsdp_host_rank_fail: its report is written (the first failing rank's in full, a peer's
 * "rank R failed: ..." as a one-line consequence), then its communicator is aborted so peers
 * blocked in a collective fail at once. Ranks not in a collective get a grace period
 * (FSDP_HOST_GRACE_S, the same that fsdprun gives SIGINT) to finish or fail; then a debug hook
 * raises "stopped N s after rank R failed: ..." in every rank still running Lua (interpreted
 * code stops at its next instruction). A rank still running FSDP_HOST_STOP_WAIT_S later is in
 * compiled Lua code (LuaJIT runs no hooks inside a trace: `while true do end`) or in a C call:
 * nothing can stop a thread there, so the host abandons it. fsdp_host_run returns without it;
 * it takes no more jobs; its thread, state and communicators stay until it returns on its own,
 * if ever, and then free themselves, and the host's memory lives until then (fsdp_host_free
 * does not wait). A program that can exit (fsdprun) exits; an embedding host keeps a spinning
 * thread.
 *
 * Locks: the host's lock guards jobs, the set of ranks running Lua and abandonment; a
 * separate one orders failure reports. Only the owner calls fsdp_host_run / fsdp_host_free;
 * the rank functions are called on the rank's own thread unless they say otherwise.
 */
#ifndef FSDP_HOST_H
#define FSDP_HOST_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include <lua.h>

#include "comm/comm.h"
#include "core/core.h"

#define FSDP_HOST_MAX_RANKS 1024
/* Seconds ranks get to stop after the first failure (and, in fsdprun, after SIGINT). */
#define FSDP_HOST_GRACE_S 2
/* Seconds between the hooks at the end of the grace period and abandoning a rank. */
#define FSDP_HOST_STOP_WAIT_S 2.0

typedef struct fsdp_host fsdp_host;

typedef struct fsdp_host_rank {
  fsdp_host *host;
  int rank, world;  /* in the whole job (an mpi rank: among the processes) */
  fsdp_comm *comm;  /* current on the rank's thread; NULL: a world of one made on first use */
  fsdp_comm *ctl;   /* the REPL's channel (opts.ctl / opts.ctl_comm), or NULL */
  fsdp_comm *boot;  /* opts.nccl: the communicator comm was bootstrapped over (it runs the
                     * checks and host-buffer collectives of comm), else NULL */
  lua_State *L;     /* made by the program on the rank's thread; closed by
                     * fsdp_host_rank_finish, or when the thread ends */
  void *ud;         /* the program's, per rank (set before the first job) */
  /* the host's own (host.c) */
  fsdp_mem_domain *domain;
  pthread_t thread;
  bool started, busy, abandoned;  /* under the host's lock */
  _Atomic(lua_State *) running;   /* the state inside fsdp_host_pcall, or NULL */
  lua_CFunction msgh;             /* the message handler of the innermost fsdp_host_pcall */
  atomic_bool held;               /* fsdp_host_rank_hold */
} fsdp_host_rank;

typedef struct fsdp_host_opts {
  int nranks;            /* rank threads: 1 .. FSDP_HOST_MAX_RANKS */
  bool group;            /* the ranks form one local group (rank i of nranks) */
  bool ctl;              /* with group: each rank also gets a communicator of a second group */
  /* Without group (nranks 1): the rank's communicators (an mpi rank's), or NULL (comm: a world
   * of one on demand). The host owns them from fsdp_host_new on, also when it fails. */
  fsdp_comm *comm, *ctl_comm;
  double timeout_s;      /* > 0: every rank's comm's (with group: FSDP_TIMEOUT is not read) */
  /* Each rank thread, once bound to its GPU, makes an nccl communicator over its comm (which
   * becomes its boot) and uses it as comm: NCCL moves cuda buffers, boot the rest (nccl.h).
   * fsdp_host_new waits for every rank's and fails with the first error. */
  bool nccl;
  const char *lua_dir;   /* the Lua library folder (copied), or NULL: package.path unchanged */
  void *ud;              /* passed back to the callbacks */
  /* A report to write whole, ending in a newline (fsdp_host_rank_fail, abandoned ranks).
   * NULL: nothing is written (fsdp_host_failure keeps the root cause). */
  void (*report)(void *ud, const char *text);
  /* The set of ranks running Lua changed (fsdp_host_pcall, fsdp_host_lua_leave, _resume): n run now;
   * first: a rank entered while none ran. Called under the host's lock, from any rank's
   * thread: it may call only fsdp_host_interrupted and fsdp_host_interrupt_clear(h, false). */
  void (*running)(void *ud, int n, bool first);
  /* The host is gone (after fsdp_host_free, or on the last abandoned rank's thread when it
   * ends): free what ud and the ranks' ud point to. Not called when fsdp_host_new fails. */
  void (*release)(void *ud);
} fsdp_host_opts;

/* Start the ranks' threads (they wait for jobs). FSDP_OK with *out set, or FSDP_ERR with the
 * message in fsdp_error_msg() ("cannot create the communicator of rank 2: ...") and nothing
 * left running. */
int fsdp_host_new(fsdp_host **out, const fsdp_host_opts *opts);

/* Let the ranks' threads end (each closes its state, leaves its group and frees its domain)
 * and join them, except abandoned ones, which free themselves when they return; what they use
 * (the host, opts.release) goes with the last of them. NULL is a no-op. */
void fsdp_host_free(fsdp_host *h);

int fsdp_host_nranks(const fsdp_host *h);
fsdp_host_rank *fsdp_host_rank_at(fsdp_host *h, int i);
const char *fsdp_host_lua_dir(const fsdp_host *h); /* NULL when none */
/* The rank whose thread calls, or NULL on any other thread. */
fsdp_host_rank *fsdp_host_current(void);
/* r's place among the ranks of this machine, as torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE say
 * it: with several rank threads, its rank among them; else the launcher's
 * (OMPI_COMM_WORLD_LOCAL_RANK / _SIZE, else LOCAL_RANK / LOCAL_WORLD_SIZE, else 0 of 1): the
 * local rank devices are bound by. */
void fsdp_host_rank_local(const fsdp_host_rank *r, int *local, int *local_world);
/* Most ranks on one machine that a launcher's local variables may describe. */
#define FSDP_HOST_MAX_LOCAL 1048576
/* Whether the launcher's local variables that a host of nranks ranks reads (only one of a single
 * rank does: OMPI_COMM_WORLD_LOCAL_RANK / _SIZE, else LOCAL_RANK / LOCAL_WORLD_SIZE) are well
 * formed: FSDP_OK, or FSDP_ERR naming the malformed one ("LOCAL_RANK='x' must be a non-negative
 * integer (below 1048576)"). fsdp_host_new refuses to start on the same. */
int fsdp_host_local_env_check(int nranks);

/* ---- jobs ------------------------------------------------------------------------------------ */

typedef void (*fsdp_host_job)(fsdp_host_rank *r, void *arg);

/* Run job(r, arg) on every rank's thread (abandoned ones excepted) and wait until each has
 * returned, or, once a rank failed, until the grace period and the stop wait are over (see
 * the top of this file). A host whose rank failed stays stopped: in a later job, ranks raise
 * the stop message at their first Lua instruction, and one that has not returned
 * FSDP_HOST_STOP_WAIT_S after the job began is abandoned. Returns the number of ranks
 * abandoned by this call (0: every rank returned). */
int fsdp_host_run(fsdp_host *h, fsdp_host_job job, void *arg);

/* Whether r was abandoned (any thread). */
bool fsdp_host_rank_abandoned(fsdp_host_rank *r);

/* Close r's state, then leave the group: free r's communicators, so that a peer still waiting
 * for r in a collective fails at once ("rank R left") instead of at the timeout. Also done
 * when the thread ends. */
void fsdp_host_rank_finish(fsdp_host_rank *r);

/* ---- running Lua ----------------------------------------------------------------------------- */

/* lua_pcall of the function below narg arguments under fsdp_host_traceback, with L marked as
 * r's running state (interrupts and the stop after a failure reach it). If r was abandoned
 * meanwhile, an error (the host's message) instead of results: whatever the program would do
 * with them, it must not, since its caller has gone. */
int fsdp_host_pcall(fsdp_host_rank *r, lua_State *L, int narg, int nres);
/* The same with another message handler (fsdprun's post-mortem, which may run the REPL before
 * it returns); the stop hook leaves it alone as it does fsdp_host_traceback. */
int fsdp_host_pcall_msgh(fsdp_host_rank *r, lua_State *L, int narg, int nres,
                         lua_CFunction msgh);

/* A pause inside fsdp_host_pcall (the REPL waiting for input): leave unmarks r's running
 * state and returns it (NULL if none); resume marks a state that leave returned again and
 * arms the stop hook only for a stop, not for an interrupt. */
lua_State *fsdp_host_lua_leave(fsdp_host_rank *r);
void fsdp_host_lua_resume(fsdp_host_rank *r, lua_State *L);
int fsdp_host_nrunning(fsdp_host *h); /* ranks running Lua now */

/* Ask every rank running Lua to raise "interrupted" at its next instruction, and ranks that
 * enter later too, until cleared. Async-signal-safe (lua_sethook, as lua.c's SIGINT handler).
 * Returns whether any rank was running Lua. */
bool fsdp_host_interrupt(fsdp_host *h);
bool fsdp_host_interrupted(const fsdp_host *h);
/* Forget the interrupt; if_idle: only when no rank runs Lua (checked under the lock). */
void fsdp_host_interrupt_clear(fsdp_host *h, bool if_idle);

/* ---- failures -------------------------------------------------------------------------------- */

/* r's Lua code (or its set-up) failed with msg, possibly followed by "\nstack traceback:...".
 * In this order: r's report goes to opts.report — with one rank msg itself; with several
 * "[rank R] msg", cut to its first line when msg is a peer's failure ("rank S failed: ...",
 * S != R) or when an earlier rank reported the same first line ("... (the same error as rank
 * S)") —; the first failure that is not a peer's is kept as the root cause; r's communicator
 * is aborted (peers fail with "rank R failed: <msg without its traceback>"); the grace period
 * starts. */
void fsdp_host_rank_fail(fsdp_host_rank *r, const char *msg);

/* r stays after its failure (a post-mortem REPL, fsdprun --debug-on-error): call it before
 * fsdp_host_rank_fail. From then on the stop after a failure comes at once, without the grace
 * period ("stopped: rank R failed: ..."), so that every rank stops where it is; r itself is
 * never stopped by it nor abandoned (fsdp_host_run waits for it without a deadline, and an
 * interrupt still reaches it); a rank that does not stop and is not held is abandoned
 * FSDP_HOST_STOP_WAIT_S after the last held rank returned (a peer in a long C call may still
 * come and hold itself meanwhile). */
void fsdp_host_rank_hold(fsdp_host_rank *r);

/* The failure to report for the whole run: the root cause ("[rank R] msg" with several ranks,
 * traceback included), else the first failure; then a line per abandoned rank. NULL when no
 * rank failed. Valid until fsdp_host_free. */
const char *fsdp_host_failure(fsdp_host *h);


/* ---- Lua states (setup.c) -------------------------------------------------------------------- */

/* Message handler: the error (or a description of a non-string error object) followed by the
 * stack traceback. */
int fsdp_host_traceback(lua_State *L);

/* Open the standard libraries (collector stopped meanwhile), prepend lua_dir's
 * "?.lua;?/init.lua" to package.path (lua_dir NULL: unchanged) and preload fsdp.core as the
 * engine of this binary (a core.so found on LUA_CPATH would be a second engine sharing no
 * tensors). On a rank's thread, os.getenv gives that rank's RANK, WORLD_SIZE, LOCAL_RANK and
 * LOCAL_WORLD_SIZE (torchrun's names): rank threads share one process environment. May
 * raise: call it in protected mode. */
void fsdp_host_openlibs(lua_State *L, const char *lua_dir);

/* The Lua library folder: <dir of this binary>/../share/fsdprun/lua (an installed tree; the
 * binary is libfsdp.so or the executable this code is linked into), else the source tree's
 * lua/ the build was made from. false when neither exists, with the places looked at in
 * tried. */
bool fsdp_host_find_lua_dir(char *out, size_t n, char *tried, size_t tried_n);

/* The thread rule: how many cpu threads each rank's kernels use (kernels/cpu/pool.h; a rank
 * may change its own later with fsdp.core.set_threads). For `world` rank threads of this
 * process: requested (> 0), else FSDP_THREADS, else FSDP_BLAS_THREADS (the old name), else
 * max(1, cores / world), cores being the CPUs this process may run on. Sets the process
 * default that every rank thread follows. FSDP_ERR, naming the variable, when the variable
 * that decides is not an integer in 1 .. FSDP_CPU_MAX_THREADS (1024). */
int fsdp_host_threads(int requested, int world);
/* The same for an mpi rank process, one of `local` on its machine: the variables, else the
 * CPUs this process may run on, at most max(1, online CPUs / local). */
int fsdp_host_mpi_threads(int local);

/* The rest of f (a recipe, stdin), malloc'd with a NUL after its *len bytes; NULL with errno
 * set when reading fails. */
char *fsdp_host_read_all(FILE *f, size_t *len);

#endif
