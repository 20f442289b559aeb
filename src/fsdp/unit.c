/*
 * unit.c — FSDP units (unit.h): the flat layout and its cross-rank check, the shard, gather /
 * reshard / prefetch, and the autograd hooks that drive them during backward.
 *
 * Buffers of a unit (all 1-D f32 tensors on the cpu device, P padded elements, S per rank):
 *   shard       (S)  role params    this rank's slice of the flat parameters (NONE: all P, and
 *                                   the parameters view it directly)
 *   grad_shard  (S)  role grads     this rank's slice of the averaged gradients (accumulates);
 *                                   made at the first backward or request (a wrapped model that
 *                                   never trained holds no gradient memory, as FSDP2)
 *   full        (P)  role gathered  only while gathered: what the parameters view
 *   full_grad   (P)  role grads     only during backward: what the parameters' .grad view
 * While sharded, every parameter is backed by `sharded`, a storage on the no-data "sharded"
 * device with the unit's full logical size, at the parameter's flat offset: gathering or
 * resharding swaps the storage and never touches a parameter's geometry, so views of a sharded
 * parameter can still be made (and fail with the sharded message when read).
 *
 * Backward protocol (docs/ARCHITECTURE.md "Units and shards"): pre_forward pushes a "begin" hook node and
 * post_forward an "end" hook node, so the tape reads begin, <the unit's ops>, end. Backward
 * walks newest first: "end" gathers the unit and points every parameter's .grad into a zeroed
 * full gradient; the ops in between accumulate into it; "begin" fires after all of them. A unit
 * called k times per forward has k begin/end pairs: `pending_bwd` counts the begins still to
 * come and only the last one reduces, frees and reshards. An ancestor's pair encloses its inner
 * units' pairs, so an ancestor's parameter used by an inner unit's op is gathered (and has its
 * .grad) whenever that op runs, forward or backward.
 *
 * Every decision that leads to a collective (gathered or not, prefetch in flight or not, the
 * pending count) depends only on state that is identical on all ranks (SPMD), so ranks issue
 * the same collectives in the same order. Releasing a unit never communicates (Lua may collect
 * it at different times on different ranks).
 *
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd.h"
#include "fsdp/unit.h"
#include "kernels/kernels.h"

/* ---- the sharded device ------------------------------------------------------------------ */

fsdp_device_i fsdp_device_sharded = {
    .name = "sharded",
    .has_data = false,
    .alloc = fsdp_device_nodata_alloc,
    .free = fsdp_device_nodata_free,
    /* the hint: m:forward(x) runs the module's own forward past the unit's gather */
    .no_data = "is sharded: gather its unit (u:gather()) or use fsdp.full_params; a wrapped "
               "model gathers its units when it is called (m(x)), not through m:forward(x)",
};

/* What backs the shard and gradient shard of a unit after unshard, for the views of them that
 * outlive it (fsdp.shard(p) hands them out): no data, so a write through one raises instead
 * of landing in memory nobody reads any more. */
static fsdp_device_i fsdp_device_unsharded = {
    .name = "unsharded",
    .has_data = false,
    .alloc = fsdp_device_nodata_alloc,
    .free = fsdp_device_nodata_free,
    .no_data = "is a view of the shard of a unit that was unsharded (fsdp.unwrap): writes to it "
               "would go nowhere; the parameters hold the values now (take fsdp.shard(param) "
               "again)",
};

/* The device is not in core's registry (it holds no bytes to account), so its storages are
 * made here, unaccounted (domain NULL: release only frees the header). */
static int sharded_storage_new(fsdp_storage **out, size_t bytes) {
  fsdp_storage *s = malloc(sizeof *s);
  if (!s) return fsdp_error("wrap: out of host memory for a storage header");
  *s = (fsdp_storage){.refcount = 1, .device = &fsdp_device_sharded, .data = NULL,
                      .bytes = bytes, .role = FSDP_ROLE_PARAMS, .domain = NULL,
                      .id = fsdp_storage_new_id()};
  *out = s;
  return FSDP_OK;
}

/* ---- the unit ---------------------------------------------------------------------------- */

struct fsdp_unit {
  int refcount; /* atomic */
  fsdp_comm *comm;
  char *path;
  fsdp_unit_opts opts;
  int rank, world;
  int n;
  fsdp_unit_param *params;
  bool *got_grad; /* per parameter: a gradient reached it on this rank since zero_grad */
  int64_t numel, padded, shard_numel, shard_offset;
  fsdp_tensor *shard;      // (S) role params (NONE: (P), viewed by the parameters)
  fsdp_tensor *grad_shard; // (S) role grads; NULL until first needed (grad_shard_need)
  fsdp_tensor *full;       // (P) role gathered, while gathered (NONE: the shard)
  fsdp_tensor *full_grad;  // (P) role grads, during backward
  const fsdp_device_i *device; /* where the buffers live: the parameters' (cpu for meta ones) */
  const fsdp_device_i *shard_device; /* the shards': device, or the cpu under offload */
  fsdp_storage *sharded;   /* no data; backs the parameters while sharded */
  fsdp_comm_req *req;      /* a prefetch in flight ... */
  fsdp_tensor *req_buf;    /* ... the (P) buffer it gathers into ... */
  fsdp_tensor *req_send;   /* ... and its send buffer when it is not the shard (a cast) */
  fsdp_dtype gathered_dt;  /* while gathered: the dtype of `full` and of the parameters */
  /* While gathered: the storage versions (fsdp_tensor_written) of `full` and of the shard when
   * the gathered values last matched the shard. `full` written since holds a change a reshard
   * would drop; the shard written since leaves the gathered values stale. */
  uint64_t full_seen, shard_seen;
  fsdp_unit *if_next;      /* the thread's list of units with a prefetch in flight */
  fsdp_unit **if_pprev;    /* NULL when not on it */
  fsdp_unit *bwd_prefetch; /* retained; may be NULL */
  fsdp_unit_state state;
  int pending_bwd; /* "begin" hooks on the tape that have not run */
  /* "begin" hooks pushed by pre_forwards that await their post_forward, newest first */
  struct hook_ud *open;
  bool no_sync;    /* fsdp_unit_set_grad_sync(false): keep full_grad instead of reducing it */
  bool grad_held;  /* full_grad holds gradients of backwards that finished under no_sync */
  bool emptied;    /* unshard ran: the unit holds no parameters */
  /* After an unshard with graphs still recorded through the unit: its former parameters, to
   * tell a backward that reaches them (an error) from one that only passes a dropped graph. */
  struct stale_param *stale;
  int nstale;
};

/* A former parameter and the .grad it had when backward reached the unit's "end" hook. */
typedef struct stale_param {
  fsdp_tensor *param;     /* retained */
  fsdp_tensor *grad_seen; /* retained; may be NULL */
  uint64_t version_seen;
  bool seen;
} stale_param;

/* Units whose prefetch is in flight, per thread (a rank's units live on its thread). A
 * prefetch that is never consumed would be consumed later with stale values (after an
 * optimizer step changed the shard) while its send buffer, the shard, is still being read:
 * the root drops every leftover at the end of its forward, and every backward's end does
 * (backward_done). */
static _Thread_local fsdp_unit *inflight_head;

static void inflight_add(fsdp_unit *u) {
  u->if_next = inflight_head;
  if (inflight_head) inflight_head->if_pprev = &u->if_next;
  inflight_head = u;
  u->if_pprev = &inflight_head;
}

static void inflight_remove(fsdp_unit *u) {
  if (!u->if_pprev) return;
  *u->if_pprev = u->if_next;
  if (u->if_next) u->if_next->if_pprev = u->if_pprev;
  u->if_next = NULL;
  u->if_pprev = NULL;
}

/* Wait for u's prefetch (already issued on every rank: waiting is local) and discard it. */
static int drop_prefetch(fsdp_unit *u) {
  if (!u->req) return FSDP_OK;
  inflight_remove(u);
  int rc = fsdp_comm_wait(u->req);
  u->req = NULL;
  fsdp_tensor_release(u->req_buf);
  fsdp_tensor_release(u->req_send);
  u->req_buf = u->req_send = NULL;
  return rc;
}

static int drop_all_prefetches(void) {
  int rc = FSDP_OK;
  while (inflight_head) {
    fsdp_unit *u = inflight_head;
    if (drop_prefetch(u)) rc = fsdp_error_context("prefetch of unit '%s'", u->path);
  }
  return rc;
}

/* The gradient reduction in flight on this thread (at most one; retained). finish_backward
 * starts a unit's reduce-scatter and lets the backward go on while it runs, so the peers'
 * arrival and the reduction itself overlap the next unit's backward instead of stalling it;
 * the reduced chunk is added into the gradient shard when it lands: before the next
 * reduction starts, at the end of the backward (backward_done) and before anything reads or
 * changes the gradient shard. Waiting never issues a collective (the request was issued on
 * every rank), so landing it may happen at a different point on each rank. */
static _Thread_local struct {
  fsdp_unit *u;       /* retained; NULL: none in flight */
  fsdp_comm_req *req;
  fsdp_tensor *buf;   /* the full gradient it reduces in place (retained) */
} reducing;

static int reduce_add(fsdp_unit *u, fsdp_tensor *red);

/* Wait for the reduction in flight, add its chunk into its unit's gradient shard, free its
 * buffer. On failure nothing is added and the buffer goes all the same. */
static int land_reduction(void) {
  fsdp_unit *u = reducing.u;
  if (!u) return FSDP_OK;
  fsdp_tensor *red = reducing.buf;
  int rc = fsdp_comm_wait(reducing.req);
  reducing.u = NULL, reducing.req = NULL, reducing.buf = NULL;
  if (!rc) rc = reduce_add(u, red);
  fsdp_tensor_release(red);
  if (rc) fsdp_error_context("backward: unit '%s'", u->path);
  fsdp_unit_release(u);
  return rc;
}

/* fsdp_backward's epilogue (autograd.h), after every outermost backward on this thread: the
 * reduction in flight lands (every gradient shard is final) and the prefetches nobody consumed
 * are dropped (a backward that did not reach a unit it prefetched, or failed half way). */
static int backward_done(void) {
  int rc = land_reduction();
  if (drop_all_prefetches() && !rc) rc = fsdp_error_context("backward");
  return rc;
}

static const char *strategy_name(fsdp_strategy s) {
  switch (s) {
  case FSDP_STRATEGY_FULL: return "full";
  case FSDP_STRATEGY_GRAD_OP: return "grad_op";
  case FSDP_STRATEGY_HYBRID: return "hybrid";
  default: return "none";
  }
}

/* A 1-D tensor of n elements of dt on dev; zero-filled, or with unspecified contents for a
 * buffer a collective overwrites whole. */
static int flat_new(fsdp_tensor **out, const fsdp_device_i *dev, fsdp_dtype dt, int64_t n,
                    fsdp_role role, bool zero) {
  return (zero ? fsdp_tensor_new : fsdp_tensor_new_uninit)(out, dev, dt, 1, &n, role);
}

static void *flat_data(fsdp_tensor *t) { return fsdp_tensor_data(t, "unit"); }

/* t itself (retained) when contiguous, else a contiguous copy on its device (through the
 * kernels: the device's memory may not be host memory) */
static int dense_of(fsdp_tensor **out, fsdp_tensor *t) {
  return fsdp_to(out, t, t->storage->device, t->dtype, FSDP_ROLE_ACTIVATIONS);
}

/* dst's flat elements [doff, doff + n) <- (add: +=) src's [soff, soff + n), both contiguous, on
 * whatever devices and in whatever dtypes they are: through the kernels, never a host loop. */
static int flat_range(fsdp_tensor *dst, int64_t doff, fsdp_tensor *src, int64_t soff, int64_t n,
                      bool add) {
  static const int64_t one = 1;
  fsdp_tensor *d, *sv;
  if (fsdp_tensor_new_view(&d, dst, dst->offset + doff, 1, &n, &one)) return FSDP_ERR;
  if (fsdp_tensor_new_view(&sv, src, src->offset + soff, 1, &n, &one)) {
    fsdp_tensor_release(d);
    return FSDP_ERR;
  }
  int rc = add ? fsdp_add_into(d, sv, 1.0) : fsdp_copy(d, sv);
  fsdp_tensor_release(d);
  fsdp_tensor_release(sv);
  return rc;
}

static int copy_range(fsdp_tensor *dst, int64_t doff, fsdp_tensor *src, int64_t soff, int64_t n) {
  return flat_range(dst, doff, src, soff, n, false);
}

static int add_range(fsdp_tensor *dst, int64_t doff, fsdp_tensor *src, int64_t soff, int64_t n) {
  return flat_range(dst, doff, src, soff, n, true);
}

static int64_t round_up(int64_t x, int64_t m) { return m ? (x + m - 1) / m * m : x; }

static int check_live(const fsdp_unit *u, const char *what) {
  if (u->emptied)
    return fsdp_error("%s: unit '%s' was unsharded (unwrapped) and holds no parameters", what,
                      u->path);
  return FSDP_OK;
}

/* ---- queries ----------------------------------------------------------------------------- */

const char *fsdp_unit_path(const fsdp_unit *u) { return u->path; }
int fsdp_unit_nparams(const fsdp_unit *u) { return u->n; }
const fsdp_unit_param *fsdp_unit_param_at(const fsdp_unit *u, int i) {
  return i >= 0 && i < u->n ? &u->params[i] : NULL;
}
int64_t fsdp_unit_numel(const fsdp_unit *u) { return u->numel; }
int64_t fsdp_unit_padded_numel(const fsdp_unit *u) { return u->padded; }
int64_t fsdp_unit_shard_numel(const fsdp_unit *u) { return u->shard_numel; }
int64_t fsdp_unit_shard_offset(const fsdp_unit *u) { return u->shard_offset; }
fsdp_unit_state fsdp_unit_state_get(const fsdp_unit *u) { return u->state; }
fsdp_strategy fsdp_unit_strategy(const fsdp_unit *u) { return u->opts.strategy; }
const char *fsdp_strategy_name(fsdp_strategy s) { return strategy_name(s); }
fsdp_comm *fsdp_unit_comm(const fsdp_unit *u) { return u->comm; }
fsdp_comm *fsdp_unit_replicate_comm(const fsdp_unit *u) {
  return u->opts.strategy == FSDP_STRATEGY_HYBRID ? u->opts.replicate : NULL;
}
bool fsdp_unit_is_root(const fsdp_unit *u) { return u->opts.is_root; }
bool fsdp_unit_prefetching(const fsdp_unit *u) { return u->req != NULL; }
bool fsdp_unit_reducing(const fsdp_unit *u) { return reducing.u == u; }
int fsdp_unit_pending_backward(const fsdp_unit *u) { return u->pending_bwd; }
bool fsdp_unit_is_empty(const fsdp_unit *u) { return u->emptied; }

bool fsdp_unit_trainable(const fsdp_unit *u) {
  for (int i = 0; i < u->n; i++)
    if (u->params[i].param->requires_grad) return true;
  return false;
}

fsdp_unit *fsdp_param_unit(const fsdp_tensor *p) { return p ? (fsdp_unit *)p->user : NULL; }

static int64_t slice_of(const fsdp_unit *u, const fsdp_unit_param *p, int rank,
                        int64_t *param_first, int64_t *shard_first) {
  *param_first = *shard_first = 0;
  int64_t lo = 0, hi = u->padded; /* NONE: every rank holds everything */
  if (u->opts.strategy != FSDP_STRATEGY_NONE) {
    lo = (int64_t)rank * u->shard_numel;
    hi = lo + u->shard_numel;
  }
  int64_t a = p->offset > lo ? p->offset : lo;
  int64_t b = p->offset + p->numel < hi ? p->offset + p->numel : hi;
  if (b <= a) return 0;
  *param_first = a - p->offset;
  *shard_first = a - lo;
  return b - a;
}

int64_t fsdp_unit_param_slice(const fsdp_unit *u, int i, int rank, int64_t *param_first,
                              int64_t *shard_first) {
  *param_first = *shard_first = 0;
  if (i < 0 || i >= u->n || rank < 0 || rank >= u->world) return 0;
  return slice_of(u, &u->params[i], rank, param_first, shard_first);
}

int fsdp_unit_shard(fsdp_unit *u, fsdp_tensor **out) {
  *out = NULL;
  if (check_live(u, "shard")) return FSDP_ERR;
  fsdp_tensor_retain(u->shard);
  *out = u->shard;
  return FSDP_OK;
}

/* The gradient shard, made (zeros) on first use. */
static int grad_shard_need(fsdp_unit *u) {
  if (u->grad_shard) return FSDP_OK;
  if (flat_new(&u->grad_shard, u->shard_device, FSDP_DTYPE_F32, u->shard_numel, FSDP_ROLE_GRADS,
               true))
    return fsdp_error_context("unit '%s': its gradient shard (%lld elements)", u->path,
                              (long long)u->shard_numel);
  return FSDP_OK;
}

int fsdp_unit_grad_shard(fsdp_unit *u, fsdp_tensor **out) {
  *out = NULL;
  if (check_live(u, "grad_shard") || land_reduction() || grad_shard_need(u)) return FSDP_ERR;
  fsdp_tensor_retain(u->grad_shard);
  *out = u->grad_shard;
  return FSDP_OK;
}

/* ---- the cross-rank layout check --------------------------------------------------------- */

#define TEXT_BYTES 256 /* a parameter description or an error, with its NUL */

static uint64_t fnv1a(uint64_t h, const char *s) {
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
  return (h ^ 0xff) * 0x100000001b3ull; /* terminator: "ab"+"c" differs from "a"+"bc" */
}
#define FNV_BASIS 0xcbf29ce484222325ull

/* "blocks.1.fc.weight (16, 16)" */
static void param_desc(char *buf, size_t n, const char *path, const fsdp_tensor *t) {
  snprintf(buf, n, "%s %s", path, FSDP_SHAPE_STR(t));
}

/* Exchange one text per rank as bytes: all[r * TEXT_BYTES ...] gets rank r's (NUL-terminated,
 * cut to TEXT_BYTES - 1). */
static int text_exchange(fsdp_comm *c, char *all, const char *mine, const char *label) {
  char text[TEXT_BYTES] = {0};
  snprintf(text, sizeof text, "%s", mine);
  if (fsdp_comm_all_gather(c, all, text, TEXT_BYTES, FSDP_DTYPE_U8, label)) return FSDP_ERR;
  for (int r = 0; r < fsdp_comm_world(c); r++) all[(size_t)r * TEXT_BYTES + TEXT_BYTES - 1] = 0;
  return FSDP_OK;
}

/* Collective. Every rank learns whether every rank's layout (count, paths, shapes) and local
 * validation agree; FSDP_ERR with the same explanation on every rank when not. `local_err` is
 * this rank's validation error (NULL when fine): a rank that failed to validate still takes
 * part, so its peers fail with its message instead of waiting for it. */
static int layout_check(fsdp_comm *c, const char *upath, fsdp_tensor *const *params,
                        const char *const *paths, int n, const char *local_err) {
  int W = fsdp_comm_world(c);
  enum { H = 3 }; /* parameter count, validated (1/0), hash of the descriptions */
  int64_t head[H];
  int64_t *heads = NULL, *all = NULL, *mine = NULL;
  char *texts = NULL;
  int rc = FSDP_ERR;
  char desc[TEXT_BYTES];
  uint64_t h = FNV_BASIS;
  for (int i = 0; !local_err && i < n; i++) {
    param_desc(desc, sizeof desc, paths[i], params[i]);
    h = fnv1a(h, desc);
  }
  head[0] = n;
  head[1] = local_err ? 0 : 1;
  head[2] = (int64_t)h;
  heads = malloc(sizeof *heads * H * (size_t)W);
  texts = malloc((size_t)TEXT_BYTES * (size_t)W);
  if (!heads || !texts) {
    fsdp_error("wrap: unit '%s': out of host memory", upath);
    goto done;
  }
  if (fsdp_comm_all_gather(c, heads, head, H, FSDP_DTYPE_I64, upath)) {
    fsdp_error_context("wrap: unit '%s': layout check", upath);
    goto done;
  }
  int bad_rank = -1;
  int64_t max_n = 0;
  for (int r = 0; r < W; r++) {
    if (heads[r * H + 1] == 0 && bad_rank < 0) bad_rank = r;
    if (heads[r * H] > max_n) max_n = heads[r * H];
  }
  if (bad_rank >= 0) { /* someone failed to validate: every rank says who and why */
    if (text_exchange(c, texts, local_err ? local_err : "", upath)) goto done;
    if (local_err)
      fsdp_error("%s", local_err);
    else
      fsdp_error("wrap: unit '%s' failed on rank %d: %s", upath, bad_rank,
                 texts + (size_t)bad_rank * TEXT_BYTES);
    goto done;
  }
  bool same = true;
  for (int r = 1; r < W; r++)
    if (memcmp(heads, heads + r * H, sizeof head) != 0) same = false;
  if (same) {
    rc = FSDP_OK;
    goto done;
  }
  /* The layouts differ: find the first differing parameter from per-parameter hashes (a
   * missing parameter hashes as the empty description, which no parameter has), then exchange
   * its description. */
  all = malloc(sizeof *all * (size_t)max_n * (size_t)W);
  mine = malloc(sizeof *mine * (size_t)(max_n ? max_n : 1));
  if (!all || !mine) {
    fsdp_error("wrap: unit '%s': out of host memory", upath);
    goto done;
  }
  for (int64_t i = 0; i < max_n; i++) {
    if (i < n) param_desc(desc, sizeof desc, paths[i], params[i]);
    else desc[0] = '\0';
    mine[i] = (int64_t)fnv1a(FNV_BASIS, desc);
  }
  if (max_n && fsdp_comm_all_gather(c, all, mine, max_n, FSDP_DTYPE_I64, upath)) goto done;
  int at = -1, other = -1;
  for (int64_t i = 0; i < max_n && at < 0; i++)
    for (int r = 1; r < W; r++)
      if (all[i] != all[(size_t)r * (size_t)max_n + (size_t)i]) {
        at = (int)i;
        other = r;
        break;
      }
  if (at < 0) { /* counts equal to max_n everywhere and no per-parameter hash differs */
    for (int r = 1; r < W && other < 0; r++)
      if (heads[r * H] != heads[0]) other = r;
    fsdp_error("wrap: unit '%s' differs across ranks (rank 0 and rank %d have different "
               "parameter lists)",
               upath, other < 0 ? 1 : other);
    goto done;
  }
  if (at < n)
    param_desc(desc, sizeof desc, paths[at], params[at]);
  else
    desc[0] = '\0';
  if (text_exchange(c, texts, desc, upath)) goto done;
  const char *a = texts, *b = texts + (size_t)other * TEXT_BYTES;
  int n0 = (int)heads[0], nr = (int)heads[other * H];
  if (n0 != nr)
    fsdp_error("wrap: unit '%s' differs across ranks: rank 0 has %d parameters, rank %d has "
               "%d; at parameter %d rank 0 has %s, rank %d has %s",
               upath, n0, other, nr, at + 1, a[0] ? a : "none", other, b[0] ? b : "none");
  else
    fsdp_error("wrap: unit '%s' differs across ranks at parameter %d: rank 0 has %s, rank %d "
               "has %s",
               upath, at + 1, a, other, b);
done:
  free(heads);
  free(all);
  free(mine);
  free(texts);
  return rc;
}

/* This rank's validation of the parameters (before anything moves). */
static int validate(const char *upath, fsdp_tensor *const *params, const char *const *paths,
                    int n) {
  for (int i = 0; i < n; i++) {
    const fsdp_tensor *p = params[i];
    const char *path = paths[i] ? paths[i] : "?";
    if (!p || !paths[i])
      return fsdp_error("wrap: unit '%s': parameter %d has no %s", upath, i + 1,
                        p ? "path" : "tensor");
    if (p->dtype != FSDP_DTYPE_F32)
      return fsdp_error("wrap: unit '%s': parameter %s is %s; units keep f32 masters (make it "
                        "f32; the wrap's mp option computes in bf16 or f16)",
                        upath, path, fsdp_dtype_name(p->dtype));
    if (p->user) {
      const fsdp_unit *o = p->user;
      return fsdp_error("wrap: parameter %s already belongs to unit '%s' (a parameter belongs "
                        "to exactly one unit: the closest common wrapped ancestor of its uses)",
                        path, o->path);
    }
    const fsdp_device_i *dev = p->storage->device;
    if (dev->no_data || (dev->has_data && !fsdp_kernels_of(dev, "wrap")))
      return fsdp_error("wrap: unit '%s': parameter %s is on the %s device; units take full "
                        "parameters (on a device with kernels, or meta)",
                        upath, path, dev->name);
    for (int j = 0; j < i; j++) {
      const fsdp_device_i *other = params[j]->storage->device;
      if (dev->has_data && other->has_data && other != dev)
        return fsdp_error("wrap: unit '%s': parameters %s (%s) and %s (%s) are on different "
                          "devices; a unit's parameters share one device",
                          upath, paths[j], other->name, path, dev->name);
    }
    if (!p->is_leaf)
      return fsdp_error("wrap: unit '%s': %s is not a leaf tensor (computed by a recorded op)",
                        upath, path);
    for (int j = 0; j < i; j++)
      if (params[j] == p)
        return fsdp_error("wrap: unit '%s': parameter %s is listed twice (also as %s); a unit "
                          "takes distinct parameters",
                          upath, path, paths[j]);
  }
  return FSDP_OK;
}

/* ---- construction ------------------------------------------------------------------------ */

/* ---- an emptied unit's graphs ------------------------------------------------------------ */

static void stale_forget(fsdp_unit *u) {
  for (int i = 0; i < u->nstale; i++) {
    fsdp_tensor_release(u->stale[i].grad_seen);
    u->stale[i].grad_seen = NULL;
    u->stale[i].seen = false;
  }
}

static void stale_free(fsdp_unit *u) {
  stale_forget(u);
  for (int i = 0; i < u->nstale; i++) fsdp_tensor_release(u->stale[i].param);
  free(u->stale);
  u->stale = NULL;
  u->nstale = 0;
}

/* Backward reached the "end" hook of an emptied unit: note each former parameter's .grad. */
static void stale_snapshot(fsdp_unit *u) {
  stale_forget(u);
  for (int i = 0; i < u->nstale; i++) {
    stale_param *s = &u->stale[i];
    s->grad_seen = s->param->grad;
    fsdp_tensor_retain(s->grad_seen);
    s->version_seen = s->grad_seen ? s->grad_seen->version : 0;
    s->seen = true;
  }
}

/* Did a gradient reach a former parameter since the snapshot (the recorded graph runs through
 * the unit's ops)? If so, drop the gradients the aborted backward gave parameters that had none:
 * it leaves nothing half-made behind. */
static bool stale_reached(fsdp_unit *u) {
  bool reached = false;
  for (int i = 0; i < u->nstale; i++) {
    stale_param *s = &u->stale[i];
    fsdp_tensor *g = s->param->grad;
    if (s->seen && (g != s->grad_seen || (g && g->version != s->version_seen))) reached = true;
  }
  if (reached)
    for (int i = 0; i < u->nstale; i++)
      if (u->stale[i].seen && !u->stale[i].grad_seen) fsdp_tensor_set_grad(u->stale[i].param, NULL);
  return reached;
}

/* One recorded use of an emptied unit is gone (its "begin" hook ran or was freed). */
static void stale_use_done(fsdp_unit *u) {
  stale_forget(u);
  if (--u->pending_bwd == 0) stale_free(u);
}

static void unit_free(fsdp_unit *u) {
  drop_prefetch(u);
  for (int i = 0; i < u->n; i++) {
    fsdp_tensor *p = u->params[i].param;
    if (p->user == u) p->user = NULL;
    if (u->full_grad && p->grad && p->grad->storage == u->full_grad->storage)
      fsdp_tensor_set_grad(p, NULL);
    fsdp_tensor_release(p);
    free(u->params[i].path);
  }
  free(u->params);
  free(u->got_grad);
  stale_free(u);
  fsdp_tensor_release(u->shard);
  fsdp_tensor_release(u->grad_shard);
  fsdp_tensor_release(u->full);
  fsdp_tensor_release(u->full_grad);
  fsdp_storage_release(u->sharded);
  fsdp_unit_release(u->bwd_prefetch);
  free(u->path);
  free(u);
}

void fsdp_unit_retain(fsdp_unit *u) {
  if (u) __atomic_fetch_add(&u->refcount, 1, __ATOMIC_RELAXED);
}

void fsdp_unit_release(fsdp_unit *u) {
  if (!u) return;
  if (__atomic_fetch_sub(&u->refcount, 1, __ATOMIC_ACQ_REL) == 1) unit_free(u);
}

int fsdp_unit_new(fsdp_unit **out, fsdp_comm *c, const char *path, fsdp_tensor *const *params,
                  const char *const *paths, int n, const fsdp_unit_opts *opts) {
  *out = NULL;
  if (!c) return fsdp_error("wrap: unit '%s': no communicator", path ? path : "?");
  if (!path) path = "";
  fsdp_unit_opts o = opts ? *opts
                          : (fsdp_unit_opts){.strategy = FSDP_STRATEGY_FULL,
                                             .reshard_after_forward = true,
                                             .overlap_reduce = true};
  /* the same function every time: a plain store, so any unit made registers it before the
   * backward that needs it, with no once-flag to keep */
  fsdp_backward_set_epilogue(backward_done);
  /* Local validation first, but its verdict travels with the layout check (collective). */
  int valid = FSDP_ERR;
  if (n < 0 || (n > 0 && (!params || !paths)))
    fsdp_error("wrap: unit '%s': bad parameter list (%d parameters)", path, n);
  else if (o.strategy != FSDP_STRATEGY_FULL && o.strategy != FSDP_STRATEGY_GRAD_OP &&
           o.strategy != FSDP_STRATEGY_NONE && o.strategy != FSDP_STRATEGY_HYBRID)
    fsdp_error("wrap: unit '%s': unknown strategy %d", path, (int)o.strategy);
  else if (o.strategy == FSDP_STRATEGY_HYBRID && !o.replicate)
    fsdp_error("wrap: unit '%s': strategy hybrid needs its replicate communicator", path);
  else if (!fsdp_dtype_is_float(o.param_dtype) || o.param_dtype == FSDP_DTYPE_F64)
    fsdp_error("wrap: unit '%s': parameters cannot be gathered as %s (mixed precision takes "
               "f32, bf16 or f16)", path, fsdp_dtype_name(o.param_dtype));
  else if (o.reduce_dtype != FSDP_DTYPE_F32 && o.reduce_dtype != FSDP_DTYPE_BF16)
    fsdp_error("wrap: unit '%s': gradients cannot be reduced in %s (f32 or bf16)", path,
               fsdp_dtype_name(o.reduce_dtype));
  else
    valid = validate(path, params, paths, n);
  if (valid == FSDP_OK && o.device) { /* the buffers' device: every parameter with data is there */
    if (!o.device->has_data || !fsdp_kernels_of(o.device, "wrap"))
      valid = fsdp_error("wrap: unit '%s': the %s device cannot hold a unit's buffers", path,
                         o.device->name);
    for (int i = 0; valid == FSDP_OK && i < n; i++) {
      const fsdp_device_i *d = params[i]->storage->device;
      if (d->has_data && d != o.device)
        valid = fsdp_error("wrap: unit '%s': parameter %s is on the %s device, the unit's "
                           "buffers go on %s; move the model there first (model:to(\"%s\"))",
                           path, paths[i], d->name, o.device->name, o.device->name);
    }
  }
  if (valid == FSDP_OK && o.offload) {
    const fsdp_device_i *d = o.device;
    for (int i = 0; !d && i < n; i++)
      if (params[i]->storage->device->has_data) d = params[i]->storage->device;
    if (o.strategy == FSDP_STRATEGY_NONE)
      valid = fsdp_error("wrap: unit '%s': offload = \"cpu\" needs a sharding strategy (full, grad_op or "
                         "hybrid): strategy none computes on the shard itself", path);
    else if (!d || d->host_memory)
      valid = fsdp_error("wrap: unit '%s': offload = \"cpu\" keeps the shards in host memory "
                         "while the parameters compute on a device, but these are on the %s "
                         "(move the model to its device first, or give wrap a device)",
                         path, d ? d->name : "meta device with no device given");
  }
  char errbuf[TEXT_BYTES];
  const char *local_err = NULL;
  if (valid != FSDP_OK) {
    snprintf(errbuf, sizeof errbuf, "%s", fsdp_error_msg());
    local_err = errbuf;
    n = 0; /* nothing of this rank's list is looked at again */
  }
  if (layout_check(c, path, params, paths, n, local_err)) return FSDP_ERR;

  int W = fsdp_comm_world(c), R = fsdp_comm_rank(c);
  fsdp_unit *u = calloc(1, sizeof *u);
  if (!u) return fsdp_error("wrap: unit '%s': out of host memory", path);
  u->refcount = 1;
  u->comm = c;
  u->opts = o;
  u->rank = R;
  u->world = W;
  u->path = strdup(path);
  u->params = calloc((size_t)(n ? n : 1), sizeof *u->params);
  u->got_grad = calloc((size_t)(n ? n : 1), sizeof *u->got_grad);
  if (!u->path || !u->params || !u->got_grad) goto oom;
  /* layout: each parameter at a multiple of FSDP_ALIGN, the total padded to W * FSDP_ALIGN */
  int64_t end = 0;
  for (int i = 0; i < n; i++) {
    fsdp_unit_param *q = &u->params[i];
    q->path = strdup(paths[i]);
    if (!q->path) goto oom;
    q->offset = round_up(end, FSDP_ALIGN);
    q->numel = fsdp_tensor_numel(params[i]);
    q->ndim = params[i]->ndim;
    memcpy(q->shape, params[i]->shape, sizeof q->shape);
    end = q->offset + q->numel;
    u->numel += q->numel;
  }
  u->padded = round_up(end, (int64_t)W * FSDP_ALIGN);
  bool none = o.strategy == FSDP_STRATEGY_NONE;
  u->shard_numel = none ? u->padded : u->padded / W;
  u->shard_offset = none ? 0 : (int64_t)R * u->shard_numel;
  u->device = o.device ? o.device : &fsdp_device_cpu;
  for (int i = 0; !o.device && i < n; i++)
    if (params[i]->storage->device->has_data) u->device = params[i]->storage->device;
  u->shard_device = o.offload ? &fsdp_device_cpu : u->device;
  if (flat_new(&u->shard, u->shard_device, FSDP_DTYPE_F32, u->shard_numel, FSDP_ROLE_PARAMS,
               true) ||
      sharded_storage_new(&u->sharded, (size_t)u->padded * sizeof(float)))
    goto fail;
  u->shard->storage->unit_books = true;
  /* fill this rank's slice from each full parameter (meta ones stay zero) */
  for (int i = 0; i < n; i++) {
    fsdp_tensor *p = params[i];
    if (!p->storage->device->has_data) continue;
    int64_t pf, sf, len = slice_of(u, &u->params[i], R, &pf, &sf);
    if (!len) continue;
    fsdp_tensor *pc;
    if (dense_of(&pc, p)) goto fail;
    int crc = copy_range(u->shard, sf, pc, pf, len);
    fsdp_tensor_release(pc);
    if (crc) goto fail;
  }
  if (none) {
    fsdp_tensor_retain(u->shard);
    u->full = u->shard;
  }
  /* Nothing can fail from here: the parameters change backing only now. */
  u->n = n;
  for (int i = 0; i < n; i++) {
    fsdp_tensor *p = params[i];
    fsdp_unit_param *q = &u->params[i];
    fsdp_tensor_retain(p);
    q->param = p;
    fsdp_tensor_set_label(p, q->path); /* best effort: only error messages use it */
    fsdp_tensor_set_grad(p, NULL);     /* gradients live in the grad shard from now on */
    fsdp_contiguous_strides(p->strides, p->ndim, p->shape);
    fsdp_tensor_set_storage(p, none ? u->shard->storage : u->sharded, q->offset);
    p->user = u;
  }
  u->state = none ? FSDP_UNIT_GATHERED : FSDP_UNIT_SHARDED;
  u->gathered_dt = FSDP_DTYPE_F32;
  *out = u;
  return FSDP_OK;
oom:
  fsdp_error("out of host memory");
fail:
  fsdp_error_context("wrap: unit '%s'", path);
  for (int i = 0; u->params && i < n; i++) free(u->params[i].path); /* u->n is still 0 */
  unit_free(u);
  return FSDP_ERR;
}

/* ---- gather, reshard, prefetch -------------------------------------------------------------- */

/* Point every parameter at `buf` (P elements) and make it the unit's full buffer; the
 * parameters take its dtype (f32, or the compute dtype under mixed precision). */
/* The gathered values and the shard hold the same values now (gathered, written back, or both
 * changed alike): what check_unchanged and the stale-shard check compare against. */
static void note_matched(fsdp_unit *u) {
  u->full_seen = u->full->storage->version;
  u->shard_seen = u->shard->storage->version;
}

static void install(fsdp_unit *u, fsdp_tensor *buf) {
  fsdp_tensor_release(u->full);
  u->full = buf; /* the reference moves in */
  buf->storage->unit_books = true;
  for (int i = 0; i < u->n; i++) {
    fsdp_tensor *p = u->params[i].param;
    fsdp_tensor_set_storage(p, buf->storage, u->params[i].offset);
    p->dtype = buf->dtype;
  }
  u->state = FSDP_UNIT_GATHERED;
  u->gathered_dt = buf->dtype;
  note_matched(u);
}

/* Gathered, with the parameters viewing a buffer of their own (not NONE's view of the f32
 * shard, where a write is a write of the shard). */
static bool gathered_copy(const fsdp_unit *u) {
  return u->state == FSDP_UNIT_GATHERED && u->full && u->full->storage != u->shard->storage;
}

/* A parameter was written in place since the gather or the last writeback: no shard holds the
 * change (a reshard would drop it, and another rank's copy may not have it). Writes through
 * fsdp.full_params / fsdp.apply are written back before anything else reads or drops the
 * copy; any other write to a gathered unit (a reference kept from before wrapping, between a
 * forward and its backward) is refused at the next gather or reshard rather than lost or
 * adopted. */
static int check_unchanged(fsdp_unit *u, const char *what) {
  if (!gathered_copy(u) || u->full->storage->version == u->full_seen) return FSDP_OK;
  return fsdp_error("%s: unit '%s': a parameter of it was written while it was gathered (%s), "
                    "and no shard holds the change: change a wrapped model's parameters "
                    "inside fsdp.full_params or fsdp.apply (by hand: u:gather(), change, "
                    "u:writeback()), or drop the change with u:reshard{discard = true}",
                    what, u->path,
                    u->gathered_dt == u->shard->dtype ? "f32" : "for compute, mixed precision");
}

static void coll_label(char *dst, const char *path) {
  snprintf(dst, sizeof ((fsdp_coll *)0)->label, "%s", path);
}

/* A collective of the unit's buffers, labelled with its path: they live on the unit's device,
 * which the backend moves through (a device without host memory: its copies and
 * reduce_ranks). */
static fsdp_coll unit_coll(const fsdp_unit *u, fsdp_coll_op op, fsdp_dtype dt, int64_t count,
                           const void *send, void *recv, fsdp_reduce_op red) {
  fsdp_coll coll = {.op = op, .dtype = dt, .red = red, .count = count, .send = send,
                    .recv = recv, .device = u->device};
  coll_label(coll.label, u->path);
  return coll;
}

/* Wait for the prefetch in flight and install its buffer. */
static int finish_prefetch(fsdp_unit *u) {
  fsdp_comm_req *req = u->req;
  fsdp_tensor *buf = u->req_buf;
  inflight_remove(u);
  u->req = NULL;
  u->req_buf = NULL;
  int rc = fsdp_comm_wait(req);
  fsdp_tensor_release(u->req_send);
  u->req_send = NULL;
  if (rc) {
    fsdp_tensor_release(buf);
    return fsdp_error_context("gather: unit '%s'", u->path);
  }
  install(u, buf);
  return FSDP_OK;
}

/* What a gather in dtype dt sends: the shard itself, or (mixed precision) its values in dt. */
static int gather_send(fsdp_unit *u, fsdp_dtype dt, fsdp_tensor **send) {
  if (fsdp_to(send, u->shard, u->device, dt, FSDP_ROLE_GATHERED))
    return fsdp_error_context("gather: unit '%s'", u->path);
  return FSDP_OK;
}

/* The replicated strategy holds every element: a "gather" in dt is the shard itself (f32) or
 * its values cast to dt, with no communication. */
static int gather_replicated(fsdp_unit *u, fsdp_dtype dt) {
  fsdp_tensor *buf;
  if (gather_send(u, dt, &buf)) return FSDP_ERR;
  install(u, buf);
  return FSDP_OK;
}

/* The compute dtype of the unit's parameters (mixed precision's param dtype; f32 without). */
static fsdp_dtype compute_dt(const fsdp_unit *u) { return u->opts.param_dtype; }

/* The dtype the parameters' gradients accumulate in during backward: f32 unless the compute
 * and the reduce dtype are the same narrower one. Rounding a rank's partial gradient to bf16
 * before the ranks' sum would make N ranks differ from 1 rank by bf16's precision; in f32 they
 * agree as f32 runs do, and the reduce dtype decides the one rounding there is. */
static fsdp_dtype grad_dt(const fsdp_unit *u) {
  return u->opts.param_dtype == u->opts.reduce_dtype ? u->opts.param_dtype : FSDP_DTYPE_F32;
}

static int reshard_impl(fsdp_unit *u);

/* Gather with the parameters in dtype dt. A unit gathered in the other dtype is resharded
 * first (full_params asks for f32 masters between a forward and its backward; the backward
 * gathers in the compute dtype again before its ops read the parameters). */
static int gather_as(fsdp_unit *u, fsdp_dtype dt) {
  if (u->state == FSDP_UNIT_GATHERED) {
    /* The gathered values are the shard's as of the gather: a shard written since (through
     * u:shard() or fsdp.shard by hand; the optimizers and loads reshard first) is refused
     * rather than computed with stale values. */
    if (gathered_copy(u) && u->shard->storage->version != u->shard_seen)
      return fsdp_error("gather: unit '%s': its shard was written while its parameters were "
                        "gathered, which still hold the old values: reshard the unit "
                        "(u:reshard()) before writing its shard",
                        u->path);
    if (check_unchanged(u, "gather")) return FSDP_ERR;
    if (u->gathered_dt == dt) return FSDP_OK;
    if (reshard_impl(u)) return FSDP_ERR;
    if (u->state == FSDP_UNIT_GATHERED && u->gathered_dt == dt) return FSDP_OK; /* replicated */
  }
  if (u->req) {
    if (u->req_buf->dtype == dt) return finish_prefetch(u);
    if (drop_prefetch(u)) return fsdp_error_context("gather: unit '%s'", u->path);
  }
  if (u->opts.strategy == FSDP_STRATEGY_NONE) return gather_replicated(u, dt);
  fsdp_tensor *buf, *send = NULL;
  if (flat_new(&buf, u->device, dt, u->padded, FSDP_ROLE_GATHERED, u->padded == 0))
    return fsdp_error_context("gather: unit '%s'", u->path);
  int rc = u->padded ? gather_send(u, dt, &send) : FSDP_OK;
  if (!rc && u->padded) {
    fsdp_coll coll = unit_coll(u, FSDP_COLL_ALL_GATHER, dt, u->shard_numel, flat_data(send),
                               flat_data(buf), FSDP_RED_SUM);
    if (fsdp_comm_run(u->comm, &coll)) rc = fsdp_error_context("gather: unit '%s'", u->path);
  }
  fsdp_tensor_release(send);
  if (rc) {
    fsdp_tensor_release(buf);
    return FSDP_ERR;
  }
  install(u, buf);
  return FSDP_OK;
}

int fsdp_unit_prefetch(fsdp_unit *u) {
  if (check_live(u, "prefetch")) return FSDP_ERR;
  if (u->state == FSDP_UNIT_GATHERED || u->req || u->padded == 0 ||
      u->opts.strategy == FSDP_STRATEGY_NONE)
    return FSDP_OK;
  fsdp_dtype dt = compute_dt(u);
  fsdp_tensor *buf, *send;
  if (flat_new(&buf, u->device, dt, u->padded, FSDP_ROLE_GATHERED, false))
    return fsdp_error_context("prefetch: unit '%s'", u->path);
  if (gather_send(u, dt, &send)) {
    fsdp_tensor_release(buf);
    return fsdp_error_context("prefetch");
  }
  fsdp_coll coll = unit_coll(u, FSDP_COLL_ALL_GATHER, dt, u->shard_numel, flat_data(send),
                             flat_data(buf), FSDP_RED_SUM);
  if (fsdp_comm_start(u->comm, &coll, &u->req)) {
    u->req = NULL;
    fsdp_tensor_release(buf);
    fsdp_tensor_release(send);
    return fsdp_error_context("prefetch: unit '%s'", u->path);
  }
  u->req_buf = buf;
  u->req_send = send; /* the shard itself (retained) or its cast copy: kept until the wait */
  inflight_add(u);
  return FSDP_OK;
}

int fsdp_unit_gather(fsdp_unit *u) {
  if (check_live(u, "gather")) return FSDP_ERR;
  return gather_as(u, FSDP_DTYPE_F32);
}

/* Parameters back to sharded (replicated: back to viewing the f32 shard). */
static int reshard_impl(fsdp_unit *u) {
  /* a prefetch nobody consumed: let it land, then drop it */
  if (drop_prefetch(u)) return fsdp_error_context("reshard: unit '%s'", u->path);
  if (u->state == FSDP_UNIT_SHARDED) return FSDP_OK;
  if (check_unchanged(u, "reshard")) return FSDP_ERR;
  if (u->opts.strategy == FSDP_STRATEGY_NONE) {
    if (u->gathered_dt == FSDP_DTYPE_F32) return FSDP_OK;
    fsdp_tensor_retain(u->shard);
    install(u, u->shard);
    return FSDP_OK;
  }
  for (int i = 0; i < u->n; i++) {
    fsdp_tensor *p = u->params[i].param;
    fsdp_tensor_set_storage(p, u->sharded, u->params[i].offset);
    p->dtype = u->shard->dtype; /* a sharded parameter is its f32 master */
  }
  fsdp_tensor_release(u->full);
  u->full = NULL;
  u->state = FSDP_UNIT_SHARDED;
  return FSDP_OK;
}

int fsdp_unit_reshard(fsdp_unit *u) {
  if (check_live(u, "reshard")) return FSDP_ERR;
  return reshard_impl(u);
}

bool fsdp_unit_dirty(const fsdp_unit *u) {
  return gathered_copy(u) &&
         (u->full->storage->version != u->full_seen ||
          u->shard->storage->version != u->shard_seen);
}

int fsdp_unit_accept_changes(fsdp_unit *u) {
  if (check_live(u, "accept_changes")) return FSDP_ERR;
  if (gathered_copy(u)) note_matched(u);
  return FSDP_OK;
}

int fsdp_unit_reshard_discard(fsdp_unit *u) {
  if (check_live(u, "reshard")) return FSDP_ERR;
  if (gathered_copy(u)) u->full_seen = u->full->storage->version;
  return reshard_impl(u);
}

fsdp_dtype fsdp_unit_gathered_dtype(const fsdp_unit *u) { return u->gathered_dt; }
const fsdp_unit_opts *fsdp_unit_options(const fsdp_unit *u) { return &u->opts; }

int fsdp_unit_writeback(fsdp_unit *u) {
  if (check_live(u, "writeback")) return FSDP_ERR;
  if (u->state != FSDP_UNIT_GATHERED)
    return fsdp_error("writeback: unit '%s' is not gathered (gather it, change its "
                      "parameters, then write back)",
                      u->path);
  /* gathered for a mixed-precision forward: writing those values back would round the f32
   * masters to the compute dtype */
  if (u->gathered_dt != u->shard->dtype)
    return fsdp_error("writeback: unit '%s' is gathered in %s for compute (mixed precision); "
                      "gather it (u:gather(): the f32 masters), change its parameters, then "
                      "write back",
                      u->path, fsdp_dtype_name(u->gathered_dt));
  /* From each parameter's current data, wherever it points (normally the full buffer). */
  for (int i = 0; i < u->n; i++) {
    int64_t pf, sf, len = fsdp_unit_param_slice(u, i, u->rank, &pf, &sf);
    if (!len) continue;
    fsdp_tensor *pc;
    if (dense_of(&pc, u->params[i].param))
      return fsdp_error_context("writeback: unit '%s'", u->path);
    int rc = copy_range(u->shard, sf, pc, pf, len);
    fsdp_tensor_release(pc);
    if (rc) return fsdp_error_context("writeback: unit '%s'", u->path);
  }
  fsdp_tensor_written(u->shard);
  note_matched(u); /* every rank wrote back its own slice */
  return FSDP_OK;
}

static bool grad_is_ours(const fsdp_unit *u, const fsdp_tensor *p);
static void drop_full_grad(fsdp_unit *u);
/* A unit whose parameters are all frozen keeps no gradient shard (made again, zeros, when one
 * is unfrozen and trains). */
static void frozen_grad_shard_drop(fsdp_unit *u) {
  if (!u->grad_shard || fsdp_unit_trainable(u) || u->pending_bwd > 0) return;
  fsdp_tensor_release(u->grad_shard);
  u->grad_shard = NULL;
}

int fsdp_unit_zero_grad(fsdp_unit *u) {
  if (check_live(u, "zero_grad") || land_reduction()) return FSDP_ERR;
  memset(u->got_grad, 0, (size_t)u->n * sizeof *u->got_grad);
  if (u->grad_held) {
    bool in_backward = false; /* views exist only between a backward's end and begin hooks */
    for (int i = 0; i < u->n; i++)
      if (grad_is_ours(u, u->params[i].param)) in_backward = true;
    if (!in_backward) drop_full_grad(u); /* frees what no_sync held */
    else if (fsdp_fill(u->full_grad, 0.0)) return fsdp_error_context("zero_grad: unit '%s'", u->path);
  }
  frozen_grad_shard_drop(u);
  return u->grad_shard ? fsdp_fill(u->grad_shard, 0.0) : FSDP_OK;
}

/* t's flat elements [off, off + n) := 0 (t contiguous, 1-D), through the kernels. */
static int zero_range(fsdp_tensor *t, int64_t off, int64_t n) {
  static const int64_t one = 1;
  if (n <= 0) return FSDP_OK;
  fsdp_tensor *v;
  if (fsdp_tensor_new_view(&v, t, t->offset + off, 1, &n, &one)) return FSDP_ERR;
  int rc = fsdp_fill(v, 0.0);
  fsdp_tensor_release(v);
  return rc;
}

int fsdp_unit_zero_param_grad(fsdp_unit *u, int i) {
  if (check_live(u, "zero_grad") || land_reduction()) return FSDP_ERR;
  if (i < 0 || i >= u->n)
    return fsdp_error("zero_grad: unit '%s' has no parameter %d (it has %d)", u->path, i + 1,
                      u->n);
  const fsdp_unit_param *q = &u->params[i];
  u->got_grad[i] = false;
  /* a held (no_sync) full gradient would bring the dropped gradient back when it is reduced */
  if (u->full_grad && zero_range(u->full_grad, q->offset, q->numel))
    return fsdp_error_context("zero_grad: unit '%s', parameter '%s'", u->path, q->path);
  if (u->grad_shard) {
    int64_t pf, sf, len = slice_of(u, q, u->rank, &pf, &sf);
    if (zero_range(u->grad_shard, sf, len))
      return fsdp_error_context("zero_grad: unit '%s', parameter '%s'", u->path, q->path);
  }
  return FSDP_OK;
}

void fsdp_unit_set_grad_sync(fsdp_unit *u, bool sync) { u->no_sync = !sync; }
bool fsdp_unit_grad_sync(const fsdp_unit *u) { return !u->no_sync; }
bool fsdp_unit_grad_unreduced(const fsdp_unit *u) { return u->grad_held; }

/* Any time: every decision reads requires_grad when it is made (post_forward: is the use
 * recorded; hook_end: which parameters get a .grad and whether to reduce), all of it the same
 * on every rank that changed it alike. */
void fsdp_param_set_requires_grad(fsdp_tensor *p, bool on) {
  fsdp_unit *u = fsdp_param_unit(p);
  p->requires_grad = on;
  if (u && !on) frozen_grad_shard_drop(u);
}

bool fsdp_unit_param_has_grad(const fsdp_unit *u, int i) {
  return i >= 0 && i < u->n && u->got_grad[i];
}

void fsdp_unit_set_backward_prefetch(fsdp_unit *u, fsdp_unit *prev) {
  if (prev == u) prev = NULL; /* a unit prefetching itself is a reference cycle, and useless */
  fsdp_unit_retain(prev);
  fsdp_unit_release(u->bwd_prefetch);
  u->bwd_prefetch = prev;
}

/* ---- backward ------------------------------------------------------------------------------- */

typedef struct hook_ud {
  fsdp_unit *u; /* retained */
  bool begin;   /* "begin" (pushed by pre_forward) or "end" (pushed by post_forward) */
  bool ran;
  bool open;                /* on u->open: its post_forward has not come yet */
  struct hook_ud *open_next;
} hook_ud;

static bool grad_is_ours(const fsdp_unit *u, const fsdp_tensor *p) {
  return u->full_grad && p->grad && p->grad->storage == u->full_grad->storage;
}

/* Drop the parameters' .grad views of the full gradient (the buffer stays). */
static void drop_grad_views(fsdp_unit *u) {
  for (int i = 0; i < u->n; i++)
    if (grad_is_ours(u, u->params[i].param)) fsdp_tensor_set_grad(u->params[i].param, NULL);
}

/* Drop the full gradient and the parameters' views of it. */
static void drop_full_grad(fsdp_unit *u) {
  drop_grad_views(u);
  fsdp_tensor_release(u->full_grad);
  u->full_grad = NULL;
  u->grad_held = false;
}

/* Backward reached the unit's last forward use: gather, prefetch the unit whose backward
 * comes next, and give every parameter a .grad view into the zeroed full gradient. */
static int hook_end(void *ud) {
  hook_ud *h = ud;
  fsdp_unit *u = h->u;
  h->ran = true;
  if (u->emptied) {
    stale_snapshot(u);
    return FSDP_OK;
  }
  if (gather_as(u, compute_dt(u))) return FSDP_ERR;
  /* only a unit whose backward is still to come in this backward (a "begin" of it is on the
   * tape): a frozen unit's, or one not used in this forward, would never be consumed */
  fsdp_unit *v = u->bwd_prefetch;
  if (v && !v->emptied && v->pending_bwd > 0 && fsdp_unit_prefetch(v)) return FSDP_ERR;
  /* Frozen: the gather above is for the gradients that pass through the unit's ops to
   * trainable parameters before it; none of its own: no full gradient, nothing to reduce. */
  if (!fsdp_unit_trainable(u)) return FSDP_OK;
  /* finish_backward converts the gradients to the reduce dtype when it differs */
  if (!u->full_grad &&
      flat_new(&u->full_grad, u->device, grad_dt(u), u->padded, FSDP_ROLE_GRADS, true))
    return fsdp_error_context("backward: unit '%s'", u->path);
  for (int i = 0; i < u->n; i++) {
    fsdp_unit_param *q = &u->params[i];
    fsdp_tensor *p = q->param;
    if (!p->requires_grad || grad_is_ours(u, p)) continue; /* 2nd use: same buffer */
    /* A gradient that accumulated before (an op outside the unit's forward used p) joins. */
    if (p->grad) {
      u->got_grad[i] = true;
      fsdp_tensor *gc;
      if (dense_of(&gc, p->grad)) return FSDP_ERR;
      int rc = add_range(u->full_grad, q->offset, gc, 0, q->numel);
      fsdp_tensor_release(gc);
      if (rc) return fsdp_error_context("backward: unit '%s'", u->path);
    }
    int64_t strides[FSDP_MAX_DIMS];
    fsdp_contiguous_strides(strides, q->ndim, q->shape);
    fsdp_tensor *g;
    if (fsdp_tensor_new_view(&g, u->full_grad, q->offset, q->ndim, q->shape, strides))
      return fsdp_error_context("backward: unit '%s'", u->path);
    fsdp_tensor_set_grad(p, g);
    fsdp_tensor_release(g);
  }
  return FSDP_OK;
}

/* Add this rank's part of the reduced gradient `red` into the f32 gradient shard. */
static int reduce_add(fsdp_unit *u, fsdp_tensor *red) {
  int rc = grad_shard_need(u);
  if (!rc) rc = add_range(u->grad_shard, 0, red, u->shard_offset, u->shard_numel);
  if (!rc) fsdp_tensor_written(u->grad_shard);
  return rc;
}

/* Average the full gradient across ranks in the reduce dtype (in place: a converted copy when
 * it differs) and add this rank's part into the f32 gradient shard, which accumulates until
 * zero_grad. Collective; clobbers the full gradient. With `overlap`, a reduction that needs
 * nothing after its one collective (not hybrid) is started and left in flight (reducing), to
 * land later; the full gradient's buffer stays with it. `what` prefixes errors. */
static int reduce_full_grad(fsdp_unit *u, const char *what, bool overlap) {
  if (!u->full_grad || !u->padded) return FSDP_OK;
  fsdp_tensor *red;
  int rc = fsdp_to(&red, u->full_grad, u->device, u->opts.reduce_dtype, FSDP_ROLE_GRADS);
  if (rc) return fsdp_error_context("%s: unit '%s'", what, u->path);
  void *fg = flat_data(red);
  /* NONE: every rank averages the whole buffer; else, in place: this rank's chunk of the full
   * gradient receives the average */
  fsdp_coll coll =
      u->opts.strategy == FSDP_STRATEGY_NONE
          ? unit_coll(u, FSDP_COLL_ALL_REDUCE, red->dtype, u->padded, NULL, fg, FSDP_RED_AVG)
          : unit_coll(u, FSDP_COLL_REDUCE_SCATTER, red->dtype, u->shard_numel, fg,
                      (char *)fg + u->shard_offset * (int64_t)fsdp_dtype_size(red->dtype),
                      FSDP_RED_AVG);
  const bool hybrid = u->opts.strategy == FSDP_STRATEGY_HYBRID &&
                      fsdp_comm_world(u->opts.replicate) > 1;
  if (overlap && !hybrid) {
    /* one in flight: its buffer is the only extra full gradient; a failure landing it is the
     * earlier unit's, and says so */
    if (land_reduction()) {
      fsdp_tensor_release(red);
      return FSDP_ERR;
    }
    if (fsdp_comm_start(u->comm, &coll, &reducing.req)) {
      reducing.req = NULL;
      fsdp_tensor_release(red);
      return fsdp_error_context("%s: unit '%s'", what, u->path);
    }
    fsdp_unit_retain(u);
    reducing.u = u;
    reducing.buf = red;
    return FSDP_OK;
  }
  rc = fsdp_comm_run(u->comm, &coll);
  /* HYBRID: the group's average, averaged across the groups holding the same shard */
  if (!rc && hybrid) {
    fsdp_coll rep = unit_coll(u, FSDP_COLL_ALL_REDUCE, red->dtype, u->shard_numel, NULL,
                              coll.recv, FSDP_RED_AVG);
    rc = fsdp_comm_run(u->opts.replicate, &rep);
  }
  if (!rc) rc = reduce_add(u, red);
  fsdp_tensor_release(red);
  if (rc) return fsdp_error_context("%s: unit '%s'", what, u->path);
  return FSDP_OK;
}

/* Every use of the unit has its gradient: average across ranks into the gradient shard (added:
 * it accumulates until zero_grad), free the full gradient, reshard. */
static int finish_backward(fsdp_unit *u) {
  int rc = FSDP_OK;
  /* fsdp_grad_acc bumps the version of the .grad view it writes into (created at version 0) */
  for (int i = 0; i < u->n; i++) {
    fsdp_tensor *p = u->params[i].param;
    if (grad_is_ours(u, p) && p->grad->version != 0) u->got_grad[i] = true;
  }
  if (u->no_sync && u->full_grad) {
    /* fsdp.no_sync: the full gradient stays for the next backward to add into (hook_end finds
     * it); only the views go, so the parameters reshard as usual and hold no .grad */
    drop_grad_views(u);
    u->grad_held = true;
    return reshard_impl(u);
  }
  /* overlapped with the backward of the units still to come; the root's is the backward's
   * last, so waiting on it now costs nothing and leaves no buffer behind */
  rc = reduce_full_grad(u, "backward", u->opts.overlap_reduce && u->world > 1 &&
                                           !u->opts.is_root);
  drop_full_grad(u);
  if (!rc) rc = reshard_impl(u); /* replicated: only undoes a mixed-precision copy */
  return rc;
}

int fsdp_unit_reduce_held(fsdp_unit *u) {
  if (check_live(u, "reduce_held")) return FSDP_ERR;
  if (!u->grad_held) return FSDP_OK;
  for (int i = 0; i < u->n; i++)
    if (grad_is_ours(u, u->params[i].param))
      return fsdp_error("reduce_held: unit '%s' is inside a backward (its gradients are still "
                        "accumulating)", u->path);
  int rc = land_reduction();
  if (!rc) rc = reduce_full_grad(u, "reduce_held", false);
  drop_full_grad(u);
  return rc;
}

static int hook_begin(void *ud) {
  hook_ud *h = ud;
  fsdp_unit *u = h->u;
  h->ran = true;
  if (u->emptied) {
    bool reached = stale_reached(u);
    stale_use_done(u);
    if (reached)
      return fsdp_error("backward: unit '%s' was unsharded (fsdp.unwrap) after the forward that "
                        "recorded this graph: its gradients cannot reach the shards any more; "
                        "run the forward again", u->path);
    return FSDP_OK;
  }
  if (--u->pending_bwd > 0) return FSDP_OK; /* an earlier use of the unit is still to come */
  return finish_backward(u);
}

/* A hook node freed without running (tape cleared, backward failed): forget the use it
 * stood for. Nothing here communicates: ranks may clear tapes at different times. */
static void hook_free(void *ud) {
  hook_ud *h = ud;
  fsdp_unit *u = h->u;
  for (hook_ud **pp = &u->open; h->open && *pp; pp = &(*pp)->open_next)
    if (*pp == h) {
      *pp = h->open_next;
      break;
    }
  if (h->begin && !h->ran && u->emptied) {
    stale_reached(u); /* a backward stopped inside the unit: its partial gradients go */
    stale_use_done(u);
  } else if (h->begin && !h->ran && --u->pending_bwd == 0) {
    /* gradients held under no_sync stay (a graph dropped without backward took none of them;
     * one stopped half way leaves its partial sums, as it does in a plain model's .grad) */
    if (u->grad_held) drop_grad_views(u);
    else drop_full_grad(u);
    drop_prefetch(u);
  }
  fsdp_unit_release(u);
  free(h);
}

static int push_hook(fsdp_unit *u, bool begin) {
  hook_ud *h = malloc(sizeof *h);
  if (!h) return fsdp_error("forward: unit '%s': out of host memory", u->path);
  fsdp_unit_retain(u);
  *h = (hook_ud){.u = u, .begin = begin};
  if (begin) u->pending_bwd++; /* before the push: a failed push frees h through hook_free */
  if (fsdp_tape_hook(begin ? hook_begin : hook_end, h, hook_free)) return FSDP_ERR;
  if (begin) { /* pushed: it awaits its post_forward */
    h->open = true;
    h->open_next = u->open;
    u->open = h;
  }
  return FSDP_OK;
}

int fsdp_unit_pre_forward(fsdp_unit *u, fsdp_unit *next) {
  if (check_live(u, "forward")) return FSDP_ERR;
  if (gather_as(u, compute_dt(u))) return FSDP_ERR;
  if (next && next != u && !next->emptied && fsdp_unit_prefetch(next)) return FSDP_ERR;
  /* Whether backward will need the unit is known only at post_forward (a frozen unit's ops
   * are recorded when gradients reach its inputs from inner units or earlier ones): the
   * "begin" goes on the tape now, where it must lie, and comes off there if not. A failed
   * push has already released (hook_free) the pending use it counted. */
  if (fsdp_grad_enabled() && push_hook(u, true))
    return fsdp_error_context("forward: unit '%s'", u->path);
  return FSDP_OK;
}

int fsdp_unit_post_forward(fsdp_unit *u, bool out_needs_grad) {
  if (check_live(u, "forward")) return FSDP_ERR;
  hook_ud *h = u->open;
  bool rec = false;
  if (h) {
    u->open = h->open_next;
    h->open = false;
    h->open_next = NULL;
    /* Recorded unless no gradient flows out of the unit and none of its parameters wants
     * one (a frozen unit with nothing trainable below it): then backward never passes it. */
    rec = out_needs_grad || fsdp_unit_trainable(u) || !fsdp_tape_unhook(h);
    if (rec && push_hook(u, false)) return fsdp_error_context("forward: unit '%s'", u->path);
  }
  /* Recorded: backward will come and gather again. FULL frees the parameters now unless the
   * unit is the root (its backward starts right away) or asked to keep them; GRAD_OP keeps
   * them until its backward. Not recorded: no backward will reshard, so both do it now. */
  fsdp_strategy s = u->opts.strategy;
  bool reshard = !rec || ((s == FSDP_STRATEGY_FULL || s == FSDP_STRATEGY_HYBRID) &&
                          !u->opts.is_root &&
                          u->opts.reshard_after_forward);
  if (reshard && reshard_impl(u)) return FSDP_ERR; /* replicated: undoes a mixed-precision copy */
  /* the forward is over: a forward prefetch still in flight was for a unit that did not run */
  return u->opts.is_root ? drop_all_prefetches() : FSDP_OK;
}

/* ---- unshard ----------------------------------------------------------------------------------- */

/* Free a storage's memory now and back it by the unsharded device, whoever still holds it. */
static void disown_storage(fsdp_storage *s) {
  if (s->device == &fsdp_device_unsharded) return;
  if (s->domain) {
    s->device->free(s->device->ctx, s->data, s->bytes);
    fsdp_mem_uncharge(s->domain, s->device, s->role, s->bytes);
  }
  *s = (fsdp_storage){.refcount = s->refcount, .device = &fsdp_device_unsharded, .data = NULL,
                      .bytes = s->bytes, .role = s->role, .domain = NULL,
                      .version = s->version, .id = s->id, .unit_books = s->unit_books};
}

int fsdp_unit_unshard(fsdp_unit *u) {
  if (u->emptied) return FSDP_OK;
  if (land_reduction()) return fsdp_error_context("unshard");
  /* gather refuses a changed copy (check_unchanged) */
  if (fsdp_unit_gather(u)) return fsdp_error_context("unshard");
  /* allocate everything first, so a failure leaves the unit as it was */
  fsdp_tensor **dense = calloc((size_t)(u->n ? u->n : 1), sizeof *dense);
  stale_param *stale = NULL;
  if (dense && u->pending_bwd > 0 && u->n > 0) { /* graphs through the unit are still recorded */
    stale = calloc((size_t)u->n, sizeof *stale);
    if (!stale) {
      free(dense);
      dense = NULL;
    }
  }
  if (!dense) return fsdp_error("unshard: unit '%s': out of host memory", u->path);
  for (int i = 0; i < u->n; i++) {
    fsdp_unit_param *q = &u->params[i];
    if (fsdp_tensor_new_uninit(&dense[i], u->device, FSDP_DTYPE_F32, q->ndim, q->shape,
                               FSDP_ROLE_PARAMS) ||
        copy_range(dense[i], 0, u->full, q->offset, q->numel)) {
      for (int j = 0; j <= i; j++) fsdp_tensor_release(dense[j]);
      free(dense);
      free(stale);
      return fsdp_error_context("unshard: unit '%s'", u->path);
    }
  }
  drop_full_grad(u);
  for (int i = 0; i < u->n; i++) {
    fsdp_unit_param *q = &u->params[i];
    fsdp_tensor *p = q->param;
    fsdp_tensor_set_storage(p, dense[i]->storage, 0);
    fsdp_tensor_release(dense[i]);
    if (p->user == u) p->user = NULL;
    if (stale) stale[i].param = p; /* the reference moves there */
    else fsdp_tensor_release(p);
    free(q->path);
  }
  free(dense);
  if (stale) {
    u->stale = stale;
    u->nstale = u->n;
  }
  u->n = 0;
  drop_prefetch(u);
  disown_storage(u->shard->storage);
  if (u->grad_shard) disown_storage(u->grad_shard->storage); /* made by the first backward */
  fsdp_tensor_release(u->full);
  fsdp_tensor_release(u->shard);
  fsdp_tensor_release(u->grad_shard);
  u->full = u->shard = u->grad_shard = NULL;
  fsdp_unit_release(u->bwd_prefetch);
  u->bwd_prefetch = NULL;
  u->numel = u->padded = u->shard_numel = u->shard_offset = 0;
  u->state = FSDP_UNIT_SHARDED;
  u->emptied = true;
  return FSDP_OK;
}
