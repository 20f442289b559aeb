/*
 * repl.h — the SPMD REPL of fsdprun (src/cli/repl.c): every input runs on every rank (or on one
 * rank after ":rank K"), rank 0 reads the terminal (libedit: editing, history, completion) and
 * prints the results grouped by rank. docs/REPL.md is the manual.
 *
 * The REPL knows nothing about threads, processes or signals: the launcher (fsdprun.c) hands it
 * a host, which says who this rank is, which communicators to use and how to run Lua code
 * (traceback handler, ^C). The ranks talk to each other only through `ctl`, a communicator of
 * their own (never the recipe's: that one may be poisoned or out of step after a failed input),
 * so the same code runs over the local backend (ranks are threads) and over MPI (processes).
 */
#ifndef FSDP_CLI_REPL_H
#define FSDP_CLI_REPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include <lua.h>

#include "comm/comm.h"

typedef struct fsdp_repl_host {
  int rank, world;
  fsdp_comm *comm; /* the rank's communicator (units and fsdp.barrier use it); NULL: a world of
                    * one made on demand, where nothing can hang */
  fsdp_comm *ctl;  /* the REPL's channel between the ranks; required when world > 1 */
  void *ctx;       /* passed back to the callbacks */
  /* lua_pcall of the function below narg arguments, with the launcher's traceback handler and
   * SIGINT turned into the error "interrupted" */
  int (*pcall)(void *ctx, lua_State *L, int narg, int nres);
  /* paused = true when the REPL starts on this rank: it no longer runs Lua between inputs
   * (evaluations go through pcall), so ^C must not be aimed at the caller's state; false when
   * it ends: back to what it was before */
  void (*pause)(void *ctx, bool paused);
  /* rank 0 starts (true) or stops (false) reading an input: a ^C at the prompt is the
   * reader's, and the next evaluation starts with no interrupt pending */
  void (*reading)(void *ctx, bool reading);
  /* write text whole to f (stdout or stderr) under the launcher's output lock, flushed */
  void (*write)(void *ctx, FILE *f, const char *s, size_t n);
  /* optional: whether this rank asked to end its run (os.exit) in the input just evaluated;
   * the REPL then ends on every rank, and the caller ends the run */
  bool (*exiting)(void *ctx);
} fsdp_repl_host;

/* Run the REPL on state L (the running Lua thread) until ":quit" or end of input. Collective
 * when world > 1: every rank calls it, and it starts with a barrier on comm (labelled
 * "fsdp.repl") so that a rank that failed or is elsewhere is an error, not a hang. `where`
 * names the caller for the banner (NULL after the recipe, "recipe.lua:12" for fsdp.debug()).
 * Returns 0 when the user left, or -1 with a message in err (the entry barrier failed, the
 * channel failed, or the REPL was entered again from inside an input). */
int fsdp_repl_run(const fsdp_repl_host *h, lua_State *L, const char *where, char *err,
                  size_t errn);

/* The post-mortem REPL (fsdprun --debug-on-error), after a failure: every rank calls it, the
 * failing one and its peers, each from where it stopped. Unlike fsdp_repl_run it meets on ctl
 * (waiting at most the REPL timeout for the others) and first revives comm, which the failure
 * poisoned, so that collectives run again in the session (fsdp_comm_revive; where a backend
 * cannot, nccl, comm stays poisoned and the session says so once). where: this rank's place
 * ("recipe.lua:12"). Returns 0 when the user left, or -1 with a message in err. */
int fsdp_repl_post_mortem(const fsdp_repl_host *h, lua_State *L, const char *where, char *err,
                          size_t errn);

/* FSDP_REPL_TIMEOUT, the REPL's collective timeout, from the environment: 0 with *out (when not
 * NULL) its seconds, or 0 when it is unset or empty; -1 with a message naming it in err when it
 * is not a finite number of seconds > 0. fsdprun refuses to start on the latter. */
int fsdp_repl_env_timeout(double *out, char *err, size_t errn);

/* While an input is evaluated on a rank of a world > 1, `print` output is collected so that
 * rank 0 can group it: returns true when s was taken (the launcher's print then writes
 * nothing). Thread-local: only the evaluating rank's thread is affected. */
bool fsdp_repl_capture(const char *s, size_t n);

#endif
