/*
 * embed.h — internals of the embedding runtime (include/fsdp.h), shared by the files of
 * src/embed/ and compiled only into libfsdp.so.
 *
 * A runtime is a rank host (src/host/host.h: `world` rank threads over one local group, each
 * with a Lua state, a memory domain and a communicator, as `fsdprun -n N` runs ranks) plus
 * what the public API adds. The host thread hands all ranks the same job (a function run on
 * each rank thread, fsdp_host_run), waits until every rank has finished it, then reads each
 * rank's status and message. Host-level synchronization between jobs lets a call check things
 * on every rank (a syntax error, a missing function, a parameter's size) before any rank runs
 * user code, so those errors leave the runtime usable. Lua errors inside user code fail the
 * rank through the host (peers fail fast, a rank that does not stop is abandoned after the
 * grace period) and break the runtime (fsdp.h "Errors").
 *
 * runtime.c: jobs and the public functions. host.c: what each rank's Lua state gets (print,
 * the fsdp.log writer, fsdp.host) and the callbacks into the host.
 */
#ifndef FSDP_EMBED_H
#define FSDP_EMBED_H

#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include <lua.h>

#include "comm/comm.h"
#include "core/core.h"
#include "fsdp.h"
#include "host/host.h"

typedef struct embed_rank embed_rank;

/* One result of fsdp_call on a rank, copied out of Lua and held until the host thread hands it
 * to the host's buffer (deliver_results in runtime.c). */
typedef struct embed_result {
  bool set;                          /* the result was read (else out[k] is left alone) */
  float *data;                       /* malloc'd values, or NULL: a shape query, no elements */
  int64_t numel;
  int ndim;
  int64_t shape[FSDP_HOST_MAX_DIMS];
} embed_result;
typedef int (*embed_job_fn)(embed_rank *r); /* runs on the rank's thread */

struct embed_rank {
  fsdp_runtime *rt;
  fsdp_host_rank *hr; /* its thread, communicator and Lua state (NULL until the init job) */
  int rank;
  int host_ref;       /* registry: the internal table of the fsdp.host chunk (I) */
  int pending_ref;    /* registry: the current call's function and arguments, or LUA_NOREF */
  int64_t batches;    /* batches this rank has received from the data source */
  bool abandoned;     /* (its own thread) the host gave up on it: no more callbacks */
  /* the current job's outcome */
  int status;         /* FSDP_OK, FSDP_ERROR (nothing broken), FSDP_BROKEN (user code raised) */
  char *msg;          /* malloc'd message of a failure, or NULL */
  /* fsdp_call: host memory wrapped as this rank's inputs (one reference each, dropped after
   * the call: see release_inputs in runtime.c) */
  fsdp_storage **wrapped;
  int nwrapped;
  /* fsdp_call: this rank's results (n_out of them, or NULL), written to the host's buffers
   * only once every rank has finished and let go of its inputs: a result buffer may be an
   * input's memory, which other ranks, and views kept by Lua, still read until then */
  embed_result *results;
  int nresults;
};

/* A job's arguments, set by the host thread before dispatch and read-only while ranks run. */
typedef struct embed_job {
  const char *code;      /* run_string; run_file: the file's contents */
  size_t code_len;
  const char *chunkname;
  const char *path;      /* run_file: arg[0]; read_param: the parameter path */
  int argc;
  const char *const *argv;
  const char *fn;        /* fsdp_call: the global function */
  const fsdp_host_tensor *in;
  int n_in;
  bool per_rank;         /* in/out indexed by rank */
  fsdp_host_tensor *out;
  int n_out;
  float *buf;            /* read_param: rank 0 copies here */
  int64_t count;
  int ndim;              /* param_shape / read_param: rank 0's answer */
  int64_t shape[FSDP_HOST_MAX_DIMS];
} embed_job;

/* Freed when its host is (fsdp_runtime_free, or later, on the thread of the last abandoned
 * rank: see host.h), since such a rank may still write its embed_rank. */
struct fsdp_runtime {
  int world;
  fsdp_host *host;
  embed_rank *ranks;
  pthread_mutex_t api_mu; /* one host call at a time */
  embed_job_fn job_fn;    /* the current job, run on every rank */
  lua_CFunction job_cp;   /* or this, run in protected mode on every rank */
  embed_job job;          /* its arguments */
  bool broken;
  char *broken_msg;       /* the failure that broke it */
  char *err;              /* fsdp_last_error; NULL: "" */
  pthread_mutex_t cb_mu;  /* serializes callbacks; guards the four fields below */
  fsdp_log_fn log_fn;
  void *log_ud;
  fsdp_data_fn data_fn;
  void *data_ud;
};

/* Set up a new rank state inside lua_cpcall (host.c): the host's libraries, package.path and
 * fsdp.core preload (fsdp_host_openlibs), print, require "fsdp", fsdp.host, the fsdp.log
 * writer, no os.exit. Leaves r->host_ref set. Raises on failure. */
int embed_setup_state(lua_State *L);

/* Check a host tensor (ndim, shape, data) and give its number of elements; false with a
 * message in err. */
bool embed_host_numel(const fsdp_host_tensor *h, int64_t *numel, char *err, size_t n);

/* Set this rank's failure (status and printf-style message); returns status. */
int embed_fail(embed_rank *r, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
