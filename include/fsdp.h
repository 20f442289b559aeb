/*
 * fsdp.h — the public embedding API of fsdprun (libfsdp). This header is the specification:
 * only symbols declared here with FSDP_API are exported from libfsdp.so. docs/EMBEDDING.md
 * is the tutorial (a minimal host program, building, the Lua side); examples/host_trainer.c
 * is a complete host.
 *
 * Stability: functions are added, never changed; structs passed in by the host only grow at
 * the end (see fsdp_runtime_opts.size); freeing NULL is a no-op.
 *
 * ---------------------------------------------------------------------------------------------
 * Overview
 *
 * A host program creates a runtime: `world` ranks, each a thread of the host process with its
 * own LuaJIT state (the `fsdp` library loaded), its own memory domain and its own communicator
 * (the local backend: ranks meet in collectives through shared memory). The host then runs
 * Lua on every rank (SPMD: each call runs the same code on all ranks and returns when all of
 * them have finished):
 *
 *     fsdp_runtime *rt;
 *     if (fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2}) != FSDP_OK) {
 *       fprintf(stderr, "%s\n", fsdp_last_error(NULL));
 *       return 1;
 *     }
 *     fsdp_run_string(rt, "model = require('fsdp').nn.Linear(4, 1)");
 *     fsdp_run_file(rt, "recipe.lua", 0, NULL);
 *     fsdp_call(rt, "train_step", in, 2, out, 1);     // a global Lua function, host tensors
 *     fsdp_read_param(rt, "weight", buf, 4);          // a parameter's full value
 *     fsdp_runtime_free(rt);
 *
 * Threads. One host thread at a time calls into a runtime (calls from several threads are
 * serialized by a lock). Lua runs on the rank threads, never on the caller's thread; the
 * calling thread blocks until every rank has finished. Callbacks (logging, data source) run on
 * rank threads, one at a time (the runtime serializes them), and must not call into the
 * runtime: such a call returns FSDP_MISUSE, with its message for fsdp_last_error on that
 * thread (the message of the call in progress, the host thread's, is left alone).
 *
 * Errors. Every fallible function returns a status: FSDP_OK (0) or a negative code below, and
 * leaves a message for fsdp_last_error(rt). Nothing in libfsdp exits or aborts the host
 * process on an error, a Lua error or bad input; `os.exit` is disabled in the ranks' states.
 * Two kinds of failure:
 *   - FSDP_ERROR, FSDP_MISUSE: the call failed before any rank ran user code, or after every
 *     rank finished it (a syntax error, an unknown function, a parameter that does not exist,
 *     a result that does not fit its buffer, bad arguments). Nothing changed on the ranks and
 *     the runtime remains usable.
 *   - FSDP_BROKEN: Lua code raised an error on some rank (or a collective timed out). That
 *     rank poisoned the ranks' group so that the others failed fast instead of waiting in a
 *     collective (the rule of fsdprun: a collective completes on every rank or fails on every
 *     rank). The ranks' states may be half-way through a step and their communicators can run
 *     no more collectives, so the runtime is broken for good: every later call returns
 *     FSDP_BROKEN with the first failure's message, and only fsdp_last_error and
 *     fsdp_runtime_free remain useful. Make a new runtime to go on. The failing call's message
 *     is the root cause, "[rank R] <message>" followed by its Lua stack traceback.
 *
 * Ranks that do not stop. When a rank fails, peers blocked in a collective fail at once; peers
 * that are computing get a grace period of 2 seconds to finish or fail. Then every rank still
 * running Lua gets the error "stopped 2 s after rank R failed: <message>" at its next
 * interpreted instruction, and a rank that has still not returned two seconds later (a loop
 * LuaJIT compiled, such as `while true do end`, which no hook reaches, or a long C call) is
 * abandoned: the call returns FSDP_BROKEN with the root cause followed by a line
 * "[rank R] did not stop within 2 s after rank S failed (...): abandoned". Nothing can end a
 * thread there: an abandoned rank's thread goes on (a spinning one uses a core until the
 * process ends); fsdp_runtime_free does not wait for it, and it frees its Lua state, its
 * communicator and what is left of the runtime itself if it ever returns, without calling the
 * host's callbacks again. Until then it may still read the inputs of the call that failed
 * (fsdp_call): if a rank may be stuck in C code reading them, keep those buffers alive.
 *
 * Memory. The runtime owns everything it creates; the host owns the buffers it passes in.
 * Inputs are read in place (zero-copy) while a call runs; results are copied out into host
 * buffers. fsdp_runtime_free closes every rank's Lua state and frees its tensors, even tensors
 * still referenced from Lua globals, then frees the communicators and memory domains and joins
 * the rank threads (an abandoned rank's thread frees its own, see above).
 * ---------------------------------------------------------------------------------------------
 */
#ifndef FSDP_H
#define FSDP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FSDP_API __attribute__((visibility("default")))

#define FSDP_VERSION_MAJOR 0
#define FSDP_VERSION_MINOR 1
#define FSDP_VERSION_PATCH 0

/* The library's version string, e.g. "0.1.0". Static storage; never NULL. */
FSDP_API const char *fsdp_version(void);

struct lua_State;
/* Lua entry point of the engine module: `require "fsdp.core"`. Host programs that run their own
 * LuaJIT state may preload it (package.preload["fsdp.core"] = luaopen_fsdp_core). Most hosts
 * want a runtime (below) instead, which does this on every rank. */
FSDP_API int luaopen_fsdp_core(struct lua_State *L);

/* ---- status codes ---------------------------------------------------------------------------- */

/* FSDP_OK is spelled as in the engine's own headers (a plain 0), so both may be included. */
#define FSDP_OK 0          /* success */
#define FSDP_DONE 1        /* a data source has no more batches (fsdp_data_fn) */
#define FSDP_ERROR (-1)    /* failed; the runtime is unchanged and usable */
#define FSDP_MISUSE (-2)   /* bad arguments, or a call from inside a callback; usable */
#define FSDP_BROKEN (-3)   /* Lua failed on a rank: the runtime can run nothing more */
#define FSDP_NOMEM (-4)    /* out of memory (creating a runtime) */

/* "ok", "done", "error", "misuse", "broken", "out of memory"; "unknown status" otherwise.
 * Static storage. */
FSDP_API const char *fsdp_status_name(int status);

/* ---- host tensors ---------------------------------------------------------------------------- */

#define FSDP_HOST_MAX_DIMS 8

/* A dense float32 array in host memory, row-major and contiguous: element (i0, i1, ...) is
 * data[((i0 * shape[1] + i1) * shape[2] + ...)]. ndim 0 is a scalar (one element). data may be
 * NULL only where a function says so (no elements, or a shape query). */
typedef struct fsdp_host_tensor {
  float *data;
  int ndim;                              /* 0 .. FSDP_HOST_MAX_DIMS */
  int64_t shape[FSDP_HOST_MAX_DIMS];     /* shape[0 .. ndim-1], each >= 0 */
} fsdp_host_tensor;

/* ---- runtimes -------------------------------------------------------------------------------- */

typedef struct fsdp_runtime fsdp_runtime; /* opaque */

/* Options of fsdp_runtime_new. Zero-initialize (a compound literal does) and set what you
 * need: every zero field means its default. New fields are only ever appended. */
typedef struct fsdp_runtime_opts {
  /* sizeof(fsdp_runtime_opts) as the host was compiled, or 0 for this first version's fields:
   * a newer libfsdp then reads only the fields the host knows about. */
  size_t size;
  /* Number of ranks (threads of this process), 1 .. 1024. 0: 1. */
  int world;
  /* "local" (ranks are threads of this process) or NULL (the same). Other backends ("mpi",
   * where each process is one rank) are not embeddable yet: FSDP_ERROR naming them. */
  const char *backend;
  /* Seconds a collective waits for the other ranks before it fails (and breaks the runtime).
   * > 0: also the ranks' default timeout (fsdp.core.set_timeout(0) returns to it), and
   * FSDP_TIMEOUT is not read. <= 0: the engine's default, FSDP_TIMEOUT in the environment,
   * else 60; a malformed FSDP_TIMEOUT is then FSDP_ERROR naming it. */
  double timeout_s;
  /* Folder of the fsdp Lua library (the one holding fsdp/init.lua). NULL: found next to
   * libfsdp: <libdir>/../share/fsdprun/lua of an installed tree, else the lua/ folder of the
   * source tree libfsdp was built from. It is prepended to every rank's package.path (the
   * host's own modules on LUA_PATH still load); a relative path is made absolute at creation,
   * so changing the working directory later does not lose the library. A path that is no
   * folder, or a folder without fsdp/init.lua, is FSDP_ERROR ("not found"), even where
   * LUA_PATH would find the library. */
  const char *lua_path;
  /* Each rank's cpu threads (the name is historical: they run every cpu kernel, GEMMs
   * included), 0 .. 1024, else FSDP_MISUSE. 0: FSDP_THREADS from the environment, else
   * FSDP_BLAS_THREADS, else max(1, cores / world); a malformed variable is FSDP_MISUSE naming
   * it. The count is the process default of rank threads: it stays set after the runtime is
   * freed. */
  int blas_threads;
} fsdp_runtime_opts;

/* Create a runtime: start `world` rank threads, each with a new Lua state (standard libraries,
 * package.path set, require "fsdp" done, fsdp.host installed), a memory domain and a
 * communicator. opts may be NULL (all defaults).
 * On FSDP_OK *out is the runtime, to be freed with fsdp_runtime_free. Otherwise *out is NULL,
 * nothing is left running, and fsdp_last_error(NULL) on the calling thread says why (FSDP_MISUSE:
 * bad options; FSDP_ERROR: the Lua library was not found or failed to load, a malformed
 * FSDP_TIMEOUT, a thread could not start; FSDP_NOMEM). */
FSDP_API int fsdp_runtime_new(fsdp_runtime **out, const fsdp_runtime_opts *opts);

/* Close every rank's Lua state (tensors still referenced from Lua are freed with it), free the
 * communicators and memory domains, join the rank threads and free rt. Works on a broken
 * runtime; does not wait for an abandoned rank ("Ranks that do not stop" above). NULL is a
 * no-op. Must not be called from a callback. */
FSDP_API void fsdp_runtime_free(fsdp_runtime *rt);

/* The number of ranks (opts.world as created); 0 for NULL. */
FSDP_API int fsdp_runtime_world(const fsdp_runtime *rt);

/* The message of the last failed call on rt ("" after a successful one), e.g.
 * "[rank 1] recipe.lua:12: boom\nstack traceback:\n...". rt NULL: the calling thread's last
 * failure of a call given no runtime (fsdp_runtime_new). Inside a callback (on a rank thread),
 * for rt or NULL: the message of the last call refused on that thread ("called from inside a
 * runtime callback"). Valid until the next call on rt (on this thread, for NULL and inside a
 * callback). Never NULL. */
FSDP_API const char *fsdp_last_error(const fsdp_runtime *rt);

/* ---- running Lua on every rank --------------------------------------------------------------- */

/* Run the Lua file at path on every rank, as fsdprun runs a recipe: the global `arg` holds
 * arg[0] = path and arg[1..argc] = argv[0..argc-1], which are also the chunk's varargs, and
 * fsdp.args is parsed again from them (--key=value, --flag). argv may be NULL when argc is 0.
 * The file is read and compiled once first: a file that cannot be read (missing, a folder:
 * "cannot read <path>: <reason>", fsdprun's words) or a syntax error is FSDP_ERROR and runs
 * nothing. Returns when every rank has finished: FSDP_OK, or FSDP_BROKEN if the code
 * raised an error on any rank (at the latest 4 s after that error, even if another rank
 * never stops: "Ranks that do not stop" above). Globals the file sets stay for later calls. */
FSDP_API int fsdp_run_file(fsdp_runtime *rt, const char *path, int argc, const char *const *argv);

/* Run a chunk of Lua source on every rank (chunk name "=host": errors read "host:3: ...").
 * Compiled on every rank first: a syntax error is FSDP_ERROR and runs nothing. Otherwise as
 * fsdp_run_file. */
FSDP_API int fsdp_run_string(fsdp_runtime *rt, const char *code);

/* Call the global Lua function `fn` on every rank with n_in tensors and copy rank 0's first
 * n_out results into out[0 .. n_out-1].
 *
 * Inputs: every rank receives in[0 .. n_in-1] as fsdp tensors that are views of the host's
 * memory (zero-copy: nothing is copied in). They are valid during the call only: when it
 * returns, the runtime frees the Lua tensors (a kept reference raises "tensor was freed"), and
 * if Lua code kept anything else pointing into the host's memory (a view such as x:view{...},
 * an autograd record) that memory is copied first so the host may reuse its buffers at once.
 * Every rank sees the same memory: Lua code must not write into inputs (use x:clone()).
 * fsdp_call_ranks gives each rank its own inputs.
 *
 * Results: each out[k] is a host tensor whose shape the host sets to what it expects; result k
 * (a tensor of that many elements, or a number when the shape holds one element) is copied
 * into out[k].data, and out[k].ndim / shape are set to the result's shape (a number: ndim 0).
 * Results reach out[] once every rank has finished the call and let go of its inputs, so a
 * result buffer may also be an input (an in-place update, x = f(x)): no rank reads a result as
 * its input. With out[k].data NULL nothing is copied and only the shape is reported
 * (out[k].shape is not read, but out[k].ndim must be in range as for any host tensor). A
 * missing result, a result of another type or of another number of elements is FSDP_ERROR
 * (after the function ran: its effects stay, and the runtime remains usable). n_out may be 0
 * (out may be NULL); n_in and n_out are at most 200 each (more is FSDP_MISUSE).
 *
 * Returns FSDP_OK; FSDP_ERROR when fn is not a global function on every rank (nothing runs) or
 * a result did not fit; FSDP_MISUSE for a bad host tensor (NULL data with elements, ndim or a
 * shape out of range); FSDP_BROKEN when fn raised an error on any rank. */
FSDP_API int fsdp_call(fsdp_runtime *rt, const char *fn, const fsdp_host_tensor *in, int n_in,
                       fsdp_host_tensor *out, int n_out);

/* As fsdp_call, with inputs and results per rank: rank r receives in[r * n_in + i] (i < n_in)
 * and its results go to out[r * n_out + k] (k < n_out); in holds world * n_in tensors and out
 * world * n_out. Each rank may write into its own inputs (the host's memory). */
FSDP_API int fsdp_call_ranks(fsdp_runtime *rt, const char *fn, const fsdp_host_tensor *in,
                             int n_in, fsdp_host_tensor *out, int n_out);

/* ---- parameters ------------------------------------------------------------------------------ */

/* The model whose parameters these functions read is the one Lua registered with
 * fsdp.host.model(m) on every rank, else the global `model`. path is a dotted parameter path
 * as m:named_parameters() gives it ("blocks.1.mlp.fc.weight"); a tied parameter may be named
 * by any of its paths ("head.weight" as well as "wte.weight"). */

/* Copy the full value of a parameter into buf (count floats: exactly the parameter's number of
 * elements, row-major). Collective on the ranks: if the model is wrapped (fsdp.wrap) the unit
 * that owns the parameter is gathered for the read (fsdp.full_params of the module holding it,
 * without writeback) and resharded after, so it works at any point between calls. FSDP_ERROR
 * (nothing run, runtime usable): no registered model, no such parameter, count differs from
 * its size (the message gives the size), a parameter on the meta device; FSDP_BROKEN: the
 * gather failed. */
FSDP_API int fsdp_read_param(fsdp_runtime *rt, const char *path, float *buf, int64_t count);

/* The shape of a parameter, without reading it (not collective): *ndim and shape[0 .. ndim-1].
 * Errors as fsdp_read_param's lookup. */
FSDP_API int fsdp_param_shape(fsdp_runtime *rt, const char *path, int *ndim,
                              int64_t shape[FSDP_HOST_MAX_DIMS]);

/* ---- callbacks ------------------------------------------------------------------------------- */

/* Output of the ranks. Without a callback, `print` on any rank writes its line to stdout (whole
 * lines, never interleaved between ranks) and fsdp.log writes plain progress lines (never the
 * terminal's in-place line) to stdout. With one, each print call and each line fsdp.log writes
 * (rank 0 only) is handed to fn instead: rank, and the text without its final newline (a
 * printed value may itself hold newlines). Called on rank threads, one call at a time. io.write
 * and io.stdout are Lua's own and not redirected. */
typedef void (*fsdp_log_fn)(void *ud, int rank, const char *line);

/* Set (or, fn NULL, remove) the log callback; ud is passed back. Takes effect for output
 * written after it returns. FSDP_MISUSE from a callback; FSDP_BROKEN (nothing changed) on a
 * broken runtime, as every call. */
FSDP_API int fsdp_set_log_callback(fsdp_runtime *rt, fsdp_log_fn fn, void *ud);

/* A batch handed from the host to a rank: the runtime fills the fields marked "in", the data
 * source fills those marked "out". */
#define FSDP_BATCH_MAX 8
typedef struct fsdp_batch {
  int rank;                 /* in: the rank asking */
  int world;                /* in: the number of ranks */
  int64_t index;            /* in: how many batches this rank has received before (0, 1, ...) */
  const char *what;         /* in: the string given to fsdp.host.next_batch(what), or NULL */
  int n;                    /* out: number of tensors, 1 .. FSDP_BATCH_MAX */
  fsdp_host_tensor tensors[FSDP_BATCH_MAX]; /* out: host memory, copied when fn returns */
  char error[256];          /* out: with FSDP_ERROR, what went wrong (NUL-terminated) */
} fsdp_batch;

/* The data source: fill batch for batch->rank and return FSDP_OK, or FSDP_DONE when there is
 * no more data, or FSDP_ERROR with a message in batch->error. The tensors' contents are copied
 * into new engine tensors as soon as fn returns, so they may point into a buffer the host
 * reuses. Called on rank threads, one call at a time (the runtime serializes them). */
typedef int (*fsdp_data_fn)(void *ud, fsdp_batch *batch);

/* Set (or, fn NULL, remove) the data source. In Lua, on any rank:
 *     local x, y = fsdp.host.next_batch()        -- nil at the end of the data
 *     local v = fsdp.host.next_batch("val")      -- batch->what = "val"
 * next_batch returns the batch's tensors (fresh tensors owned by Lua), or nil after FSDP_DONE;
 * FSDP_ERROR raises "fsdp.host.next_batch: <batch->error>", as does calling it with no data
 * source set; any other status raises "... the data source returned status N (<its name>) ...".
 * FSDP_MISUSE from a callback; FSDP_BROKEN (nothing changed) on a broken runtime. */
FSDP_API int fsdp_set_data_source(fsdp_runtime *rt, fsdp_data_fn fn, void *ud);

#ifdef __cplusplus
}
#endif
#endif
