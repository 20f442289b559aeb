/*
 * runtime.c — the embedding runtime of include/fsdp.h: jobs on the rank host's threads
 * (src/host/host.h) and the public functions.
 *
 * Jobs. The host thread (holding rt->api_mu) sets the job's arguments (rt->job) and runs a
 * job function on every rank (fsdp_host_run), which returns once every rank has run it, or,
 * after a failure, once the grace period is over (a rank that could not be stopped is
 * abandoned: it breaks the runtime and its outcome is never read). Each job runs the rank's
 * Lua work inside lua_cpcall, so no Lua error (not even out of memory) escapes into C frames
 * that hold resources; a rank's outcome is r->status and r->msg, which the host folds into one
 * status (collect()).
 *
 * A call runs in phases, each a job: first a phase that cannot touch a collective (compile the
 * chunk, look the function or the parameter up, wrap inputs); only if every rank succeeded
 * there, the phase that runs user code (fsdp_host_pcall). A Lua error in user code fails the
 * rank through the host (fsdp_host_rank_fail: its communicator is aborted, so peers blocked in
 * a collective fail fast with "rank R failed: ...", invariant 3) and breaks the
 * runtime: the group is poisoned for good.
 *
 * Inputs of fsdp_call are host memory wrapped in storages (fsdp_storage_wrap: not owned, not
 * accounted). After the call the rank frees the Lua tensors it made of them (t:free()) and
 * then looks at each storage's refcount: anything left (a view, an autograd record) means Lua
 * code kept a pointer into host memory, and the storage gets a copy of its bytes that it owns
 * (detach_storage), so the host may reuse its buffers as soon as the call returns.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <lauxlib.h>

#include "embed/embed.h"
#include "kernels/cpu/pool.h"
#include "kernels/kernels.h"
#include "lua/binding.h"

#define EMBED_MAX_RANKS FSDP_HOST_MAX_RANKS

/* ---- errors ---------------------------------------------------------------------------------- */

static _Thread_local char tl_err[1024]; /* fsdp_last_error(NULL) */

/* Whether the calling thread is a rank's (a callback's): such calls are refused. */
static bool on_rank_thread(void) { return fsdp_host_current() != NULL; }

/* *slot = the formatted message (NULL when out of memory), the one it held freed */
static void replace_msg(char **slot, const char *fmt, va_list ap) {
  char *s = fsdp_strdup_vprintf(fmt, ap);
  free(*slot);
  *slot = s;
}

int embed_fail(embed_rank *r, int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  replace_msg(&r->msg, fmt, ap);
  va_end(ap);
  r->status = status;
  return status;
}

/* Set rt's last error (printf-style); returns status. */
static int set_error(fsdp_runtime *rt, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int set_error(fsdp_runtime *rt, int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  replace_msg(&rt->err, fmt, ap);
  va_end(ap);
  return status;
}

static int set_tl_error(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int set_tl_error(int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tl_err, sizeof tl_err, fmt, ap);
  va_end(ap);
  return status;
}

FSDP_API const char *fsdp_status_name(int status) {
  switch (status) {
  case FSDP_OK: return "ok";
  case FSDP_DONE: return "done";
  case FSDP_ERROR: return "error";
  case FSDP_MISUSE: return "misuse";
  case FSDP_BROKEN: return "broken";
  case FSDP_NOMEM: return "out of memory";
  default: return "unknown status";
  }
}

FSDP_API const char *fsdp_last_error(const fsdp_runtime *rt) {
  /* On a rank thread (inside a callback) every call is refused with its message in tl_err, and
   * rt->err is not touched there: the host thread frees and rewrites it under api_mu, which a
   * callback cannot take (the call that runs it holds it), and nothing orders the two once
   * that call is over (a rank abandoned in a callback outlives it). So a callback reads its
   * own refusals, whichever rt it names. */
  if (rt == NULL || on_rank_thread()) return tl_err;
  return rt->err != NULL ? rt->err : "";
}

/* ---- rank threads and jobs ------------------------------------------------------------------- */

/* The text of the error object at idx, for a message: Lua code may raise any value, and a
 * table's has no text here. Never NULL. */
static const char *error_text(lua_State *L, int idx) {
  const char *m = lua_tostring(L, idx);
  return m != NULL ? m : "(error object is not a string)";
}

/* lua_cpcall(L, f, r) on the rank's state; an error outside user code (out of memory) is
 * FSDP_ERROR unless f already set a status. */
static void protected(embed_rank *r, lua_CFunction f) {
  lua_State *L = r->hr->L;
  if (L == NULL) {
    embed_fail(r, FSDP_ERROR, "rank %d has no Lua state", r->rank);
    return;
  }
  int st = lua_cpcall(L, f, r);
  if (st != 0) {
    if (r->status == FSDP_OK) embed_fail(r, FSDP_ERROR, "%s", error_text(L, -1));
    lua_pop(L, 1);
  }
}

/* A job on one rank: the outcome starts clean. An abandoned rank (host.h) runs nothing more;
 * what it does from here on (its state's finalizers) must not reach the host program. */
static void run_job(fsdp_host_rank *hr, void *arg) {
  fsdp_runtime *rt = arg;
  embed_rank *r = hr->ud;
  r->status = FSDP_OK;
  free(r->msg);
  r->msg = NULL;
  if (rt->job_cp != NULL)
    protected(r, rt->job_cp);
  else
    rt->job_fn(r);
  if (fsdp_host_rank_abandoned(hr)) r->abandoned = true;
}

/* Run fn on every rank and wait for them (or for the grace period: host.h). Caller holds
 * api_mu. */
static void dispatch(fsdp_runtime *rt, embed_job_fn fn) {
  rt->job_fn = fn;
  rt->job_cp = NULL;
  fsdp_host_run(rt->host, run_job, rt);
}

/* dispatch a job that is one lua_cpcall of f (protected) */
static void dispatch_protected(fsdp_runtime *rt, lua_CFunction f) {
  rt->job_fn = NULL;
  rt->job_cp = f;
  fsdp_host_run(rt->host, run_job, rt);
}

/* Fold the ranks' outcomes of the last job into rt's status and message: FSDP_OK; the first
 * failing rank's status and message; FSDP_BROKEN (and the runtime broken) when any rank failed
 * in user code, was abandoned, or the group is poisoned, with the host's report of the root
 * cause (the first failure that is not a peer's "rank R failed: ...") and of abandoned ranks.
 * An abandoned rank's own outcome is never read: its thread may still write it. */
static int collect(fsdp_runtime *rt) {
  int root = -1;
  bool broken = false;
  for (int i = 0; i < rt->world; i++) {
    embed_rank *r = &rt->ranks[i];
    if (fsdp_host_rank_abandoned(r->hr)) {
      broken = true;
      continue;
    }
    if (r->status == FSDP_BROKEN) broken = true;
    if (r->status != FSDP_OK && root < 0) root = i;
  }
  if (!broken && rt->ranks[0].hr->comm != NULL && fsdp_comm_poisoned(rt->ranks[0].hr->comm))
    broken = true;
  if (root < 0 && !broken) {
    free(rt->err);
    rt->err = NULL;
    return FSDP_OK;
  }
  const char *failure = broken ? fsdp_host_failure(rt->host) : NULL;
  const char *msg = root >= 0 && rt->ranks[root].msg != NULL ? rt->ranks[root].msg
                                                              : "the ranks' group was poisoned";
  int status = root >= 0 ? rt->ranks[root].status : FSDP_BROKEN;
  if (failure != NULL)
    set_error(rt, status, "%s", failure);
  else if (rt->world > 1 && root >= 0)
    set_error(rt, status, "[rank %d] %s", root, msg);
  else
    set_error(rt, status, "%s", msg);
  if (broken) {
    status = FSDP_BROKEN;
    rt->broken = true;
    free(rt->broken_msg);
    rt->broken_msg = rt->err != NULL ? strdup(rt->err) : NULL;
  }
  return status;
}

/* User code failed on this rank with the message on top of the stack: record it, and fail the
 * rank through the host (peers fail fast, the grace period starts). */
static void fail_user(embed_rank *r, lua_State *L) {
  const char *m = error_text(L, -1);
  embed_fail(r, FSDP_BROKEN, "%s", m);
  fsdp_host_rank_fail(r->hr, m);
}

static embed_rank *cp_rank(lua_State *L) { return (embed_rank *)lua_touserdata(L, 1); }

/* The current call's registry slot: unref it (pushing nothing). */
static void drop_pending(embed_rank *r) {
  if (r->pending_ref != LUA_NOREF && r->hr->L != NULL) {
    luaL_unref(r->hr->L, LUA_REGISTRYINDEX, r->pending_ref);
  }
  r->pending_ref = LUA_NOREF;
}

/* ---- init ------------------------------------------------------------------------------------ */

static int job_init(embed_rank *r) {
  lua_State *L = luaL_newstate();
  if (L == NULL)
    return embed_fail(r, FSDP_NOMEM, "cannot create the Lua state of rank %d: out of memory",
                      r->rank);
  r->hr->L = L;
  r->host_ref = LUA_NOREF;
  r->pending_ref = LUA_NOREF;
  int st = lua_cpcall(L, embed_setup_state, r);
  if (st != 0) {
    embed_fail(r, FSDP_ERROR, "loading the fsdp library from %s: %s",
               fsdp_host_lua_dir(r->rt->host), error_text(L, -1));
    lua_pop(L, 1);
  }
  return r->status;
}

/* ---- running chunks -------------------------------------------------------------------------- */

/* Phase 1: compile the job's code; the function waits in the registry. */
static int cp_load(lua_State *L) {
  embed_rank *r = cp_rank(L);
  const embed_job *j = &r->rt->job;
  if (luaL_loadbuffer(L, j->code, j->code_len, j->chunkname) != 0) {
    embed_fail(r, FSDP_ERROR, "%s", error_text(L, -1));
    return 0;
  }
  r->pending_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  return 0;
}

/* Phase 2: set arg / fsdp.args (run_file), run the function under the traceback handler. */
static int cp_run(lua_State *L) {
  embed_rank *r = cp_rank(L);
  const embed_job *j = &r->rt->job;
  lua_settop(L, 0);
  lua_rawgeti(L, LUA_REGISTRYINDEX, r->pending_ref);
  drop_pending(r);
  int narg = 0;
  if (j->path != NULL) {
    luaL_checkstack(L, j->argc + 4, "too many arguments");
    lua_createtable(L, j->argc, 1);
    lua_pushstring(L, j->path);
    lua_rawseti(L, -2, 0);
    for (int i = 0; i < j->argc; i++) {
      lua_pushstring(L, j->argv[i]);
      lua_rawseti(L, -2, i + 1);
    }
    lua_setglobal(L, "arg");
    /* fsdp.args = fsdp.parse_args(arg) */
    lua_getglobal(L, "require");
    lua_pushliteral(L, "fsdp");
    lua_call(L, 1, 1);
    lua_getfield(L, -1, "parse_args");
    lua_getglobal(L, "arg");
    lua_call(L, 1, 1);
    lua_setfield(L, -2, "args");
    lua_pop(L, 1);
    for (int i = 0; i < j->argc; i++) lua_pushstring(L, j->argv[i]);
    narg = j->argc;
  }
  if (fsdp_host_pcall(r->hr, L, narg, 0) != 0) fail_user(r, L);
  return 0;
}

/* ---- fsdp_call ------------------------------------------------------------------------------- */

/* This rank's first input and result within the job's arrays. */
static const fsdp_host_tensor *rank_inputs(const embed_job *j, int rank) {
  return j->per_rank ? j->in + (size_t)rank * (size_t)j->n_in : j->in;
}
static fsdp_host_tensor *rank_outputs(const embed_job *j, int rank) {
  if (j->out == NULL) return NULL;
  if (j->per_rank) return j->out + (size_t)rank * (size_t)j->n_out;
  return rank == 0 ? j->out : NULL; /* fsdp_call: rank 0's results only */
}

/* A tensor over the host's memory (fsdp_tensor_wrap). Its storage is remembered in r->wrapped
 * (one reference) for release_inputs. */
static int wrap_input(embed_rank *r, fsdp_tensor **out, const fsdp_host_tensor *h) {
  if (fsdp_tensor_wrap(out, h->data, FSDP_DTYPE_F32, h->ndim, h->shape) != FSDP_OK)
    return FSDP_ERR;
  fsdp_storage_retain((*out)->storage);
  r->wrapped[r->nwrapped++] = (*out)->storage; /* our reference */
  return FSDP_OK;
}

/* Phase 1: the function must be a global function; inputs are wrapped and the function and
 * its arguments wait in a registry table {fn, x1, x2, ...}. */
static int cp_call_prepare(lua_State *L) {
  embed_rank *r = cp_rank(L);
  const embed_job *j = &r->rt->job;
  lua_settop(L, 0);
  lua_getglobal(L, j->fn);
  if (lua_type(L, -1) != LUA_TFUNCTION) {
    embed_fail(r, FSDP_ERROR, "'%s' is not a global function (it is a %s value)", j->fn,
               luaL_typename(L, -1));
    return 0;
  }
  lua_createtable(L, j->n_in + 1, 0);
  lua_pushvalue(L, 1);
  lua_rawseti(L, -2, 1);
  r->pending_ref = luaL_ref(L, LUA_REGISTRYINDEX); /* from here release_inputs cleans up */
  lua_rawgeti(L, LUA_REGISTRYINDEX, r->pending_ref);
  const fsdp_host_tensor *in = rank_inputs(j, r->rank);
  for (int i = 0; i < j->n_in; i++) {
    fsdp_tensor *t;
    if (wrap_input(r, &t, &in[i]) != FSDP_OK) {
      embed_fail(r, FSDP_ERROR, "input %d: %s", i + 1, fsdp_error_msg());
      return 0;
    }
    fsdp_lua_push_tensor(L, t);
    lua_rawseti(L, -2, i + 2);
  }
  return 0;
}
static int job_call_prepare(embed_rank *r) {
  const embed_job *j = &r->rt->job;
  r->nwrapped = 0;
  r->wrapped = j->n_in > 0 ? calloc((size_t)j->n_in, sizeof *r->wrapped) : NULL;
  if (j->n_in > 0 && r->wrapped == NULL) return embed_fail(r, FSDP_ERROR, "out of memory");
  protected(r, cp_call_prepare);
  return r->status;
}

/* The number of elements out's buffer holds; 0 for a shape query (no data), whose shape is not
 * read (check_host_tensors checked only its ndim). */
static int64_t out_capacity(const fsdp_host_tensor *out) {
  if (out->data == NULL) return 0;
  int64_t cap = 1;
  for (int d = 0; d < out->ndim; d++) cap *= out->shape[d];
  return cap;
}

/* Free a rank's staged results. */
static void free_results(embed_rank *r) {
  if (r->results == NULL) return;
  for (int k = 0; k < r->nresults; k++) free(r->results[k].data);
  free(r->results);
  r->results = NULL;
  r->nresults = 0;
}

/* Read result k (at stack index idx) for out (may be NULL: this rank reports nothing), which is
 * out[at] of the host's array (messages name it so), into res: out itself is written later,
 * by deliver_results. */
static int copy_result(embed_rank *r, lua_State *L, int idx, int k, int at,
                       const fsdp_host_tensor *out, embed_result *res) {
  const char *fn = r->rt->job.fn;
  if (lua_type(L, idx) == LUA_TNUMBER) {
    if (out == NULL) return FSDP_OK;
    int64_t cap = out_capacity(out);
    if (out->data != NULL && cap != 1)
      return embed_fail(r, FSDP_ERROR,
                        "result %d of '%s' is a number, but out[%d] holds %lld elements", k + 1,
                        fn, at, (long long)cap);
    if (out->data != NULL) {
      res->data = malloc(sizeof(float));
      if (res->data == NULL) return embed_fail(r, FSDP_ERROR, "result %d: out of memory", k + 1);
      res->data[0] = (float)lua_tonumber(L, idx);
      res->numel = 1;
    }
    res->ndim = 0;
    res->set = true;
    return FSDP_OK;
  }
  fsdp_tensor *t = fsdp_lua_to_tensor(L, idx);
  if (t == NULL)
    return embed_fail(r, FSDP_ERROR, "result %d of '%s' is a %s, expected a tensor or a number",
                      k + 1, fn, lua_isnil(L, idx) ? "nil (missing)" : luaL_typename(L, idx));
  if (out == NULL) return FSDP_OK;
  int64_t numel = fsdp_tensor_numel(t), cap = out_capacity(out);
  if (out->data != NULL && numel != cap)
    return embed_fail(r, FSDP_ERROR,
                      "result %d of '%s' has shape %s (%lld elements), but out[%d] holds %lld",
                      k + 1, fn, FSDP_SHAPE_STR(t), (long long)numel, at, (long long)cap);
  if (out->data != NULL && numel > 0) {
    /* the values as contiguous f32 in host memory, from any device and dtype */
    fsdp_tensor *c;
    if (fsdp_to(&c, t, &fsdp_device_cpu, FSDP_DTYPE_F32, FSDP_ROLE_ACTIVATIONS) != FSDP_OK)
      return embed_fail(r, FSDP_ERROR, "result %d of '%s': %s", k + 1, fn, fsdp_error_msg());
    const float *src = fsdp_tensor_data(c, "fsdp_call result");
    res->data = src != NULL ? malloc((size_t)numel * sizeof(float)) : NULL;
    if (res->data == NULL) {
      fsdp_tensor_release(c);
      return embed_fail(r, FSDP_ERROR, "result %d of '%s': %s", k + 1, fn,
                        src == NULL ? fsdp_error_msg() : "out of memory");
    }
    memcpy(res->data, src, (size_t)numel * sizeof(float));
    res->numel = numel;
    fsdp_tensor_release(c);
  }
  res->ndim = t->ndim;
  for (int d = 0; d < t->ndim; d++) res->shape[d] = t->shape[d];
  res->set = true;
  return FSDP_OK;
}

/* On the host thread, once every rank has finished the call and released its inputs: each
 * rank's staged results into the host's buffers and shapes. An abandoned rank's are not read
 * (its thread may still write them; runtime_release frees them). */
static void deliver_results(fsdp_runtime *rt) {
  const embed_job *j = &rt->job;
  for (int i = 0; i < rt->world; i++) {
    embed_rank *r = &rt->ranks[i];
    fsdp_host_tensor *out = rank_outputs(j, i);
    if (r->results == NULL || fsdp_host_rank_abandoned(r->hr)) continue;
    for (int k = 0; out != NULL && k < j->n_out; k++) {
      const embed_result *res = &r->results[k];
      if (!res->set) continue;
      if (out[k].data != NULL && res->data != NULL)
        memcpy(out[k].data, res->data, (size_t)res->numel * sizeof(float));
      out[k].ndim = res->ndim;
      for (int d = 0; d < res->ndim; d++) out[k].shape[d] = res->shape[d];
    }
    free_results(r);
  }
}

/* Phase 2: call, then copy this rank's results. */
static int cp_call_run(lua_State *L) {
  embed_rank *r = cp_rank(L);
  const embed_job *j = &r->rt->job;
  lua_settop(L, 0);
  luaL_checkstack(L, j->n_in + j->n_out + 4, "too many arguments");
  lua_rawgeti(L, LUA_REGISTRYINDEX, r->pending_ref);
  for (int i = 1; i <= j->n_in + 1; i++) lua_rawgeti(L, 1, i);
  lua_remove(L, 1);
  if (fsdp_host_pcall(r->hr, L, j->n_in, j->n_out) != 0) {
    fail_user(r, L);
    return 0;
  }
  const fsdp_host_tensor *out = rank_outputs(j, r->rank);
  if (out != NULL && j->n_out > 0) {
    r->results = calloc((size_t)j->n_out, sizeof *r->results);
    if (r->results == NULL) return embed_fail(r, FSDP_ERROR, "results: out of memory"), 0;
    r->nresults = j->n_out;
  }
  /* fsdp_call_ranks: this rank's results are out[rank * n_out ...] of the host's array */
  int first = j->per_rank ? r->rank * j->n_out : 0;
  for (int k = 0; k < j->n_out; k++)
    if (copy_result(r, L, 1 + k, k, first + k, out != NULL ? &out[k] : NULL,
                    out != NULL ? &r->results[k] : NULL) != FSDP_OK)
      break;
  lua_settop(L, 0);
  return 0;
}

/* Give the storage s (wrapped host memory still referenced from the rank's objects) a copy of
 * its bytes that it owns and that is charged to this rank's domain, so the host's buffer is
 * no longer read. storage.c frees data only when domain is set: the fields move together. */
static int detach_storage(fsdp_storage *s) {
  if (s->bytes == 0 || s->domain != NULL) return FSDP_OK;
  fsdp_storage *own;
  if (fsdp_storage_new_uninit(&own, &fsdp_device_cpu, s->bytes, FSDP_ROLE_OTHER) != FSDP_OK)
    return FSDP_ERR;
  memcpy(own->data, s->data, s->bytes);
  s->data = own->data;
  s->role = own->role;
  s->domain = own->domain;
  own->data = NULL; /* own's header goes; its memory and its charge now belong to s */
  own->domain = NULL;
  fsdp_storage_release(own);
  return FSDP_OK;
}

/* Free the Lua tensors made of the inputs (they raise "tensor was freed" if kept). */
static int cp_free_inputs(lua_State *L) {
  embed_rank *r = cp_rank(L);
  if (r->pending_ref == LUA_NOREF) return 0;
  lua_rawgeti(L, LUA_REGISTRYINDEX, r->pending_ref);
  int n = (int)lua_objlen(L, -1);
  for (int i = 2; i <= n; i++) {
    lua_rawgeti(L, -1, i);
    if (fsdp_lua_to_tensor(L, -1) != NULL) {
      lua_getfield(L, -1, "free");
      lua_insert(L, -2);
      lua_call(L, 1, 0);
    } else {
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
  drop_pending(r);
  return 0;
}

/* After a call (successful or not): no input may still read host memory. */
static void release_inputs(embed_rank *r) {
  /* An abandoned rank's caller has gone, and the host's buffers maybe with it: they are not
   * read again (the storages still point into them, but the state is only ever closed). */
  bool abandoned = fsdp_host_rank_abandoned(r->hr);
  if (r->hr->L != NULL && r->pending_ref != LUA_NOREF) {
    int keep = r->status;
    char *keep_msg = r->msg;
    r->msg = NULL;
    r->status = FSDP_OK;
    protected(r, cp_free_inputs);
    if (r->status != FSDP_OK) keep = FSDP_BROKEN; /* could not free: the storages detach */
    free(r->msg);
    r->msg = keep_msg;
    r->status = keep;
    drop_pending(r);
  }
  for (int i = 0; i < r->nwrapped; i++) {
    fsdp_storage *s = r->wrapped[i];
    if (!abandoned && __atomic_load_n(&s->refcount, __ATOMIC_ACQUIRE) > 1 &&
        detach_storage(s) != FSDP_OK) {
      /* Nothing else is safe: Lua still points into host memory the host is about to reuse.
       * Poison, so the runtime runs no more Lua. */
      if (r->status != FSDP_BROKEN) {
        embed_fail(r, FSDP_BROKEN, "input %d was kept by Lua code and cannot be copied: %s",
                   i + 1, fsdp_error_msg());
        fsdp_host_rank_fail(r->hr, r->msg);
      }
    }
    fsdp_storage_release(s);
  }
  free(r->wrapped);
  r->wrapped = NULL;
  r->nwrapped = 0;
}

static int job_call_run(embed_rank *r) {
  protected(r, cp_call_run);
  release_inputs(r);
  return r->status;
}
static int job_call_cancel(embed_rank *r) {
  release_inputs(r);
  return r->status;
}

/* ---- parameters ------------------------------------------------------------------------------ */

/* I[name](path) under pcall, or as user code (fsdp_host_pcall: a collective that may fail on
 * every rank); leaves its one result. */
static int call_helper(lua_State *L, embed_rank *r, const char *name, bool user_code) {
  lua_settop(L, 0);
  lua_rawgeti(L, LUA_REGISTRYINDEX, r->host_ref);
  lua_getfield(L, -1, name);
  lua_remove(L, -2);
  lua_pushstring(L, r->rt->job.path);
  return user_code ? fsdp_host_pcall(r->hr, L, 1, 1) : lua_pcall(L, 1, 1, 0);
}

/* Phase 1 (every rank, nothing collective): find the parameter; rank 0 reports its shape. */
static int cp_param_lookup(lua_State *L) {
  embed_rank *r = cp_rank(L);
  embed_job *j = &r->rt->job;
  if (call_helper(L, r, "find", false) != 0) {
    /* the model's own code runs here (named_modules): it may raise any value */
    embed_fail(r, FSDP_ERROR, "%s", error_text(L, -1));
    return 0;
  }
  fsdp_tensor *t = fsdp_lua_to_tensor(L, -1);
  if (t == NULL) return embed_fail(r, FSDP_ERROR, "parameter '%s' was freed", j->path), 0;
  if (t->storage->device == &fsdp_device_meta) {
    embed_fail(r, FSDP_ERROR,
               "parameter '%s' is on the meta device (shape only): materialize the model first",
               j->path);
    return 0;
  }
  if (r->rank == 0) {
    j->ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++) j->shape[d] = t->shape[d];
  }
  return 0;
}

/* Phase 2 (collective): gather as needed, clone; rank 0 copies into the host buffer. */
static int cp_param_read(lua_State *L) {
  embed_rank *r = cp_rank(L);
  embed_job *j = &r->rt->job;
  if (call_helper(L, r, "read", true) != 0) {
    fail_user(r, L);
    return 0;
  }
  if (r->rank != 0) return 0;
  fsdp_tensor *t = fsdp_lua_to_tensor(L, -1), *h = NULL;
  if (t == NULL || fsdp_tensor_data(t, "fsdp_read_param") == NULL)
    return embed_fail(r, FSDP_ERROR, "reading parameter '%s': %s", j->path, fsdp_error_msg()), 0;
  if (fsdp_tensor_numel(t) != j->count || !fsdp_tensor_is_contiguous(t))
    return embed_fail(r, FSDP_ERROR, "parameter '%s' changed while it was read", j->path), 0;
  /* f32 in host memory, from whatever device and dtype the parameter has */
  if (fsdp_to(&h, t, &fsdp_device_cpu, FSDP_DTYPE_F32, FSDP_ROLE_ACTIVATIONS) != FSDP_OK)
    return embed_fail(r, FSDP_ERROR, "reading parameter '%s': %s", j->path, fsdp_error_msg()), 0;
  memcpy(j->buf, fsdp_tensor_data(h, "fsdp_read_param"), (size_t)j->count * sizeof(float));
  fsdp_tensor_release(h);
  lua_settop(L, 0);
  return 0;
}

/* ---- the public functions -------------------------------------------------------------------- */

static bool is_dir(const char *path) {
  struct stat st;
  return path[0] != '\0' && stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Whether dir holds the fsdp Lua library. Asked here rather than left to `require "fsdp"`:
 * package.path goes on with the user's LUA_PATH after dir, where require could find another
 * copy of the library, and the runtime would then run a library the host did not name. */
static bool has_lua_library(const char *dir) {
  char path[PATH_MAX + 16];
  struct stat st;
  int n = snprintf(path, sizeof path, "%s/fsdp/init.lua", dir);
  return n > 0 && (size_t)n < sizeof path && stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* The Lua library: opts.lua_path, else next to libfsdp or in the source tree
 * (fsdp_host_find_lua_dir). Returns a status with a message in tl_err. */
static int find_lua_dir(char *out, size_t n, const char *given) {
  if (given != NULL) {
    if (!is_dir(given))
      return set_tl_error(FSDP_ERROR, "fsdp_runtime_new: lua_path '%s' is not a folder", given);
    if (!has_lua_library(given))
      return set_tl_error(FSDP_ERROR,
                          "fsdp_runtime_new: lua_path '%s' holds no fsdp Lua library "
                          "(fsdp/init.lua not found there)",
                          given);
    /* absolute: the ranks require modules of the library lazily (fsdp.nn on first use), when
     * the host may have changed its working directory */
    char real[PATH_MAX];
    if (realpath(given, real) == NULL)
      return set_tl_error(FSDP_ERROR, "fsdp_runtime_new: lua_path '%s': %s", given,
                          strerror(errno));
    snprintf(out, n, "%s", real);
    return FSDP_OK;
  }
  char tried[2 * PATH_MAX + 64];
  if (!fsdp_host_find_lua_dir(out, n, tried, sizeof tried))
    return set_tl_error(FSDP_ERROR,
                        "fsdp_runtime_new: cannot find the fsdp Lua library (looked in %s); set "
                        "fsdp_runtime_opts.lua_path",
                        tried);
  return FSDP_OK;
}

FSDP_API int fsdp_runtime_world(const fsdp_runtime *rt) { return rt != NULL ? rt->world : 0; }

/* The host is gone (opts.release): free the runtime. On the thread of the last abandoned rank
 * when there is one (host.h), any time after fsdp_runtime_free. */
static void runtime_release(void *ud) {
  fsdp_runtime *rt = ud;
  for (int i = 0; i < rt->world; i++) {
    free(rt->ranks[i].msg);
    free(rt->ranks[i].wrapped);
    free_results(&rt->ranks[i]);
  }
  free(rt->ranks);
  free(rt->err);
  free(rt->broken_msg);
  pthread_mutex_destroy(&rt->api_mu);
  pthread_mutex_destroy(&rt->cb_mu);
  free(rt);
}

/* Close every rank (fsdp_host_free), then free rt when the last rank has gone. */
static void runtime_destroy(fsdp_runtime *rt) {
  if (rt->host != NULL)
    fsdp_host_free(rt->host);
  else
    runtime_release(rt);
}

FSDP_API int fsdp_runtime_new(fsdp_runtime **out, const fsdp_runtime_opts *opts) {
  if (out == NULL) return set_tl_error(FSDP_MISUSE, "fsdp_runtime_new: out is NULL");
  *out = NULL;
  tl_err[0] = '\0';
  if (on_rank_thread())
    return set_tl_error(FSDP_MISUSE, "fsdp_runtime_new: called from inside a runtime callback");
  fsdp_runtime_opts o = {0};
  if (opts != NULL) {
    /* size 0: this first version's fields; otherwise the fields both sides know */
    size_t n = opts->size == 0 || opts->size > sizeof o ? sizeof o : opts->size;
    memcpy(&o, opts, n);
  }
  if (o.world == 0) o.world = 1;
  if (o.world < 1 || o.world > EMBED_MAX_RANKS)
    return set_tl_error(FSDP_MISUSE, "fsdp_runtime_new: world %d is out of range (1 .. %d)",
                        o.world, EMBED_MAX_RANKS);
  if (o.backend != NULL && strcmp(o.backend, "local") != 0)
    return set_tl_error(FSDP_ERROR,
                        "fsdp_runtime_new: backend '%s' cannot be embedded (only 'local': ranks "
                        "are threads of this process)",
                        o.backend);
  if (o.blas_threads < 0 || o.blas_threads > FSDP_CPU_MAX_THREADS)
    return set_tl_error(FSDP_MISUSE, "fsdp_runtime_new: blas_threads %d is out of range (0 .. %d)",
                        o.blas_threads, FSDP_CPU_MAX_THREADS);
  char lua_dir[PATH_MAX];
  int status = find_lua_dir(lua_dir, sizeof lua_dir, o.lua_path);
  if (status != FSDP_OK) return status;
  /* the thread rule: the default of every rank thread (fsdp.h) */
  if (fsdp_host_threads(o.blas_threads, o.world) != FSDP_OK)
    return set_tl_error(FSDP_MISUSE, "fsdp_runtime_new: %s", fsdp_error_msg());

  fsdp_runtime *rt = calloc(1, sizeof *rt);
  if (rt != NULL) rt->ranks = calloc((size_t)o.world, sizeof *rt->ranks);
  if (rt == NULL || rt->ranks == NULL) {
    free(rt);
    return set_tl_error(FSDP_NOMEM, "fsdp_runtime_new: out of memory");
  }
  rt->world = o.world;
  pthread_mutex_init(&rt->api_mu, NULL);
  pthread_mutex_init(&rt->cb_mu, NULL);
  fsdp_host_opts ho = {.nranks = o.world, .group = true, .timeout_s = o.timeout_s,
                       .lua_dir = lua_dir, .ud = rt, .release = runtime_release};
  if (fsdp_host_new(&rt->host, &ho) != FSDP_OK) {
    set_tl_error(FSDP_ERROR, "fsdp_runtime_new: %s", fsdp_error_msg());
    runtime_release(rt);
    return FSDP_ERROR;
  }
  for (int i = 0; i < o.world; i++) {
    embed_rank *r = &rt->ranks[i];
    r->rt = rt;
    r->rank = i;
    r->hr = fsdp_host_rank_at(rt->host, i);
    r->hr->ud = r;
    r->host_ref = LUA_NOREF;
    r->pending_ref = LUA_NOREF;
  }
  dispatch(rt, job_init);
  status = collect(rt);
  if (status != FSDP_OK) {
    set_tl_error(status == FSDP_BROKEN ? FSDP_ERROR : status, "fsdp_runtime_new: %s",
                 fsdp_last_error(rt));
    if (status == FSDP_BROKEN) status = FSDP_ERROR;
    runtime_destroy(rt);
    return status;
  }
  *out = rt;
  return FSDP_OK;
}

FSDP_API void fsdp_runtime_free(fsdp_runtime *rt) {
  if (rt == NULL || on_rank_thread()) return; /* from a callback: refused (fsdp.h) */
  pthread_mutex_lock(&rt->api_mu);
  pthread_mutex_unlock(&rt->api_mu);
  runtime_destroy(rt);
}

/* Common entry of a call: argument and state checks; on FSDP_OK the caller holds api_mu. */
static int enter(fsdp_runtime *rt, const char *what) {
  if (rt == NULL) return set_tl_error(FSDP_MISUSE, "%s: the runtime is NULL", what);
  if (on_rank_thread()) {
    /* not rt->err: the host thread owns it while the call that runs this callback is out;
     * fsdp_last_error(rt) on this thread reads tl_err */
    return set_tl_error(FSDP_MISUSE, "%s: called from inside a runtime callback", what);
  }
  pthread_mutex_lock(&rt->api_mu);
  if (rt->broken) {
    set_error(rt, FSDP_BROKEN,
              "%s: the runtime is broken by an earlier failure (free it and create a new one): "
              "%s",
              what, rt->broken_msg != NULL ? rt->broken_msg : "(no message)");
    pthread_mutex_unlock(&rt->api_mu);
    return FSDP_BROKEN;
  }
  free(rt->err);
  rt->err = NULL;
  memset(&rt->job, 0, sizeof rt->job);
  return FSDP_OK;
}

static int leave(fsdp_runtime *rt, int status) {
  memset(&rt->job, 0, sizeof rt->job);
  pthread_mutex_unlock(&rt->api_mu);
  return status;
}

/* After a failed first phase: ranks drop what it left (a compiled chunk, wrapped inputs).
 * Keeps the failure's message; returns st, or FSDP_BROKEN if an input could not be let go. */
static int cancel(fsdp_runtime *rt, int st) {
  char *saved = rt->err;
  rt->err = NULL;
  dispatch(rt, job_call_cancel);
  int again = collect(rt);
  if (again == FSDP_BROKEN) {
    free(saved);
    return again;
  }
  free(rt->err);
  rt->err = saved;
  return st;
}

/* Compile on every rank, then run (the job's code, chunkname and path are set). */
static int load_and_run(fsdp_runtime *rt) {
  dispatch_protected(rt, cp_load);
  int status = collect(rt);
  if (status != FSDP_OK) return cancel(rt, status); /* a rank that compiled holds its chunk */
  dispatch_protected(rt, cp_run);
  return collect(rt);
}

FSDP_API int fsdp_run_string(fsdp_runtime *rt, const char *code) {
  int st = enter(rt, "fsdp_run_string");
  if (st != FSDP_OK) return st;
  if (code == NULL) return leave(rt, set_error(rt, FSDP_MISUSE, "fsdp_run_string: code is NULL"));
  rt->job.code = code;
  rt->job.code_len = strlen(code);
  rt->job.chunkname = "=host";
  return leave(rt, load_and_run(rt));
}

/* The whole file, or NULL with errno set: EISDIR for a folder, as fsdprun reports it, whatever
 * reading a folder's stream does on this libc. */
static char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return NULL;
  struct stat st;
  if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) {
    fclose(f);
    errno = EISDIR;
    return NULL;
  }
  char *buf = fsdp_host_read_all(f, len);
  int err = errno;
  fclose(f);
  errno = err;
  return buf;
}

FSDP_API int fsdp_run_file(fsdp_runtime *rt, const char *path, int argc,
                           const char *const *argv) {
  int st = enter(rt, "fsdp_run_file");
  if (st != FSDP_OK) return st;
  if (path == NULL) return leave(rt, set_error(rt, FSDP_MISUSE, "fsdp_run_file: path is NULL"));
  if (argc < 0 || (argc > 0 && argv == NULL))
    return leave(rt, set_error(rt, FSDP_MISUSE, "fsdp_run_file: argc %d with argv %s", argc,
                               argv == NULL ? "NULL" : "given"));
  for (int i = 0; i < argc; i++)
    if (argv[i] == NULL)
      return leave(rt, set_error(rt, FSDP_MISUSE, "fsdp_run_file: argv[%d] is NULL", i));
  size_t len;
  char *code = read_file(path, &len);
  if (code == NULL)
    return leave(rt, set_error(rt, FSDP_ERROR, "cannot read %s: %s", path, strerror(errno)));
  size_t n = strlen(path) + 2;
  char *chunkname = malloc(n);
  if (chunkname == NULL) {
    free(code);
    return leave(rt, set_error(rt, FSDP_ERROR, "fsdp_run_file: out of memory"));
  }
  snprintf(chunkname, n, "@%s", path);
  rt->job.code = code;
  rt->job.code_len = len;
  rt->job.chunkname = chunkname;
  rt->job.path = path;
  rt->job.argc = argc;
  rt->job.argv = argv;
  st = load_and_run(rt);
  free(code);
  free(chunkname);
  return leave(rt, st);
}

/* The host tensors of a call (side "in" or "out"), each described well (embed_host_numel); with
 * shape_queries, a tensor without data is one, whose shape is only written: its shape is not
 * read, but its ndim still must be in range (a result's shape is written over ndim entries). */
static int check_host_tensors(fsdp_runtime *rt, const char *what, const char *side,
                              const fsdp_host_tensor *t, int n, bool shape_queries) {
  for (int i = 0; i < n; i++) {
    int64_t numel;
    char why[160];
    if (shape_queries && t[i].data == NULL) {
      if (t[i].ndim < 0 || t[i].ndim > FSDP_HOST_MAX_DIMS)
        return set_error(rt, FSDP_MISUSE, "%s: %s[%d]: ndim %d is out of range (0 .. %d)", what,
                         side, i, t[i].ndim, FSDP_HOST_MAX_DIMS);
      continue;
    }
    if (!embed_host_numel(&t[i], &numel, why, sizeof why))
      return set_error(rt, FSDP_MISUSE, "%s: %s[%d]: %s", what, side, i, why);
  }
  return FSDP_OK;
}

static int call_common(fsdp_runtime *rt, const char *what, bool per_rank, const char *fn,
                       const fsdp_host_tensor *in, int n_in, fsdp_host_tensor *out, int n_out) {
  int st = enter(rt, what);
  if (st != FSDP_OK) return st;
  if (fn == NULL) return leave(rt, set_error(rt, FSDP_MISUSE, "%s: fn is NULL", what));
  if (n_in < 0 || n_out < 0 || n_in > 200 || n_out > 200)
    return leave(rt, set_error(rt, FSDP_MISUSE, "%s: n_in %d / n_out %d out of range (0 .. 200)",
                               what, n_in, n_out));
  if ((n_in > 0 && in == NULL) || (n_out > 0 && out == NULL))
    return leave(rt, set_error(rt, FSDP_MISUSE, "%s: %s is NULL", what,
                               n_in > 0 && in == NULL ? "in" : "out"));
  int sets = per_rank ? rt->world : 1;
  st = check_host_tensors(rt, what, "in", in, sets * n_in, false);
  if (st == FSDP_OK) st = check_host_tensors(rt, what, "out", out, sets * n_out, true);
  if (st != FSDP_OK) return leave(rt, st);
  rt->job.fn = fn;
  rt->job.in = in;
  rt->job.n_in = n_in;
  rt->job.out = out;
  rt->job.n_out = n_out;
  rt->job.per_rank = per_rank;
  dispatch(rt, job_call_prepare);
  st = collect(rt);
  if (st != FSDP_OK) return leave(rt, cancel(rt, st));
  dispatch(rt, job_call_run);
  st = collect(rt);
  deliver_results(rt);
  return leave(rt, st);
}

FSDP_API int fsdp_call(fsdp_runtime *rt, const char *fn, const fsdp_host_tensor *in, int n_in,
                       fsdp_host_tensor *out, int n_out) {
  return call_common(rt, "fsdp_call", false, fn, in, n_in, out, n_out);
}

FSDP_API int fsdp_call_ranks(fsdp_runtime *rt, const char *fn, const fsdp_host_tensor *in,
                             int n_in, fsdp_host_tensor *out, int n_out) {
  return call_common(rt, "fsdp_call_ranks", true, fn, in, n_in, out, n_out);
}

static int param_lookup(fsdp_runtime *rt, const char *what, const char *path) {
  if (path == NULL) return set_error(rt, FSDP_MISUSE, "%s: path is NULL", what);
  rt->job.path = path;
  dispatch_protected(rt, cp_param_lookup);
  int st = collect(rt);
  if (st != FSDP_OK) set_error(rt, st, "%s: %s", what, fsdp_last_error(rt));
  return st;
}

FSDP_API int fsdp_param_shape(fsdp_runtime *rt, const char *path, int *ndim,
                              int64_t shape[FSDP_HOST_MAX_DIMS]) {
  int st = enter(rt, "fsdp_param_shape");
  if (st != FSDP_OK) return st;
  if (ndim == NULL || shape == NULL)
    return leave(rt, set_error(rt, FSDP_MISUSE, "fsdp_param_shape: ndim or shape is NULL"));
  st = param_lookup(rt, "fsdp_param_shape", path);
  if (st == FSDP_OK) {
    *ndim = rt->job.ndim;
    for (int d = 0; d < rt->job.ndim; d++) shape[d] = rt->job.shape[d];
  }
  return leave(rt, st);
}

FSDP_API int fsdp_read_param(fsdp_runtime *rt, const char *path, float *buf, int64_t count) {
  int st = enter(rt, "fsdp_read_param");
  if (st != FSDP_OK) return st;
  if (count < 0 || (count > 0 && buf == NULL))
    return leave(rt, set_error(rt, FSDP_MISUSE, "fsdp_read_param: buf %s with count %lld",
                               buf == NULL ? "NULL" : "given", (long long)count));
  st = param_lookup(rt, "fsdp_read_param", path);
  if (st != FSDP_OK) return leave(rt, st);
  int64_t numel = 1;
  for (int d = 0; d < rt->job.ndim; d++) numel *= rt->job.shape[d];
  if (numel != count) {
    char shape[96];
    fsdp_shape_str(shape, sizeof shape, rt->job.ndim, rt->job.shape);
    return leave(rt, set_error(rt, FSDP_ERROR,
                               "fsdp_read_param: parameter '%s' has shape %s (%lld elements), "
                               "the buffer holds %lld",
                               path, shape, (long long)numel, (long long)count));
  }
  rt->job.buf = buf;
  rt->job.count = count;
  dispatch_protected(rt, cp_param_read);
  return leave(rt, collect(rt));
}

/* The callback setters are calls like the others (enter): refused from a callback, FSDP_BROKEN
 * on a broken runtime, and the last error cleared on success. The lock order is api_mu, then
 * cb_mu; rank threads take only cb_mu (a callback calling in is refused before api_mu), so the
 * host thread never waits for cb_mu while a rank waits for api_mu. */
FSDP_API int fsdp_set_log_callback(fsdp_runtime *rt, fsdp_log_fn fn, void *ud) {
  int st = enter(rt, "fsdp_set_log_callback");
  if (st != FSDP_OK) return st;
  pthread_mutex_lock(&rt->cb_mu);
  rt->log_fn = fn;
  rt->log_ud = fn != NULL ? ud : NULL;
  pthread_mutex_unlock(&rt->cb_mu);
  return leave(rt, FSDP_OK);
}

FSDP_API int fsdp_set_data_source(fsdp_runtime *rt, fsdp_data_fn fn, void *ud) {
  int st = enter(rt, "fsdp_set_data_source");
  if (st != FSDP_OK) return st;
  pthread_mutex_lock(&rt->cb_mu);
  rt->data_fn = fn;
  rt->data_ud = fn != NULL ? ud : NULL;
  pthread_mutex_unlock(&rt->cb_mu);
  return leave(rt, FSDP_OK);
}
