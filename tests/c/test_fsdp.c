/*
 * test_fsdp.c — FSDP units (src/fsdp): layout and padding, shard contents, gather/reshard,
 * the cross-rank layout check, the autograd-driven protocol (gradients at W ranks equal the
 * one-rank gradients for every strategy, a module called twice, an ancestor's parameter used
 * inside an inner unit), prefetch overlap, traffic counters, memory per rank, writeback, unshard,
 * which parameters received a gradient.
 *
 * Ranks are threads on a local group (W = 1..4, ranks.h: CHECK() in rank code, each rank's
 * memory domain empty at its end).
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "autograd/autograd.h"
#include "comm/comm.h"
#include "fsdp/unit.h"
#include "ranks.h"

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define NDIM(...) ((int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))
#define MAXW 4
/* release every tensor listed */
#define RELEASE_ALL(...)                                                                           \
  do {                                                                                             \
    fsdp_tensor *all_[] = {__VA_ARGS__};                                                           \
    for (size_t i_ = 0; i_ < sizeof all_ / sizeof *all_; i_++) fsdp_tensor_release(all_[i_]);     \
  } while (0)

/* ---- tensors ---------------------------------------------------------------------------------- */

/* A parameter (role params, requires_grad) with values in [-0.5, 0.5) from the name. */
static fsdp_tensor *param_new(const char *name, int ndim, const int64_t *shape) {
  fsdp_tensor *p;
  if (fsdp_tensor_new(&p, &fsdp_device_cpu, FSDP_DTYPE_F32, ndim, shape, FSDP_ROLE_PARAMS))
    return NULL;
  p->requires_grad = true;
  p->is_param = true;
  float *d = fsdp_tensor_data(p, "test");
  int64_t n = fsdp_tensor_numel(p);
  fsdp_rng_uniform(d, n, fsdp_rng_key(7, name), 0);
  for (int64_t k = 0; k < n; k++) d[k] -= 0.5f;
  return p;
}

static fsdp_tensor *data_new(const char *name, int64_t rows, int64_t cols) {
  fsdp_tensor *t;
  if (fsdp_tensor_new_f32(&t, 2, SHAPE(rows, cols))) return NULL;
  fsdp_rng_uniform(fsdp_tensor_data(t, "test"), rows * cols, fsdp_rng_key(11, name), 0);
  return t;
}

/* Rows [r * n / W, (r + 1) * n / W) of a (n, c) tensor, contiguous. */
static fsdp_tensor *rows_of(fsdp_tensor *t, int r, int W) {
  int64_t n = t->shape[0], a = r * n / W, b = (r + 1) * n / W;
  fsdp_tensor *v, *c;
  if (fsdp_tensor_narrow(&v, t, 0, a, b - a)) return NULL;
  int rc = fsdp_tensor_clone(&c, v);
  fsdp_tensor_release(v);
  return rc ? NULL : c;
}

static float *D(const fsdp_tensor *t) { return fsdp_tensor_data(t, "test"); }

static bool close_to(float a, float b, float tol) { return fabsf(a - b) <= tol * (1 + fabsf(b)); }

static int64_t live(fsdp_role role) {
  fsdp_mem_report r;
  fsdp_mem_report_get(NULL, &r);
  return r.counts[0].live[role]; /* device 0 is cpu */
}
static int64_t peak(fsdp_role role) {
  fsdp_mem_report r;
  fsdp_mem_report_get(NULL, &r);
  return r.counts[0].peak[role];
}

/* ---- layout and padding ---------------------------------------------------------------------- */

static bool rank_layout(rank_ctx *ctx) {
  int W = ctx->world, R = ctx->rank;
  /* numels 5, 16, 17, 0, 33: offsets 0, 16, 32, 64, 64; end 97 */
  fsdp_tensor *p[5] = {param_new("a", 1, SHAPE(5)), param_new("b", 2, SHAPE(4, 4)),
                       param_new("c", 1, SHAPE(17)), param_new("d", 2, SHAPE(0, 3)),
                       param_new("e", 3, SHAPE(3, 1, 11))};
  const char *paths[5] = {"m.a", "m.b", "m.c", "m.d", "m.e"};
  fsdp_unit *u;
  CHECK_OK(fsdp_unit_new(&u, ctx->comm, "m", p, paths, 5, NULL));
  const int64_t off[5] = {0, 16, 32, 64, 64};
  for (int i = 0; i < 5; i++) {
    const fsdp_unit_param *q = fsdp_unit_param_at(u, i);
    CHECK(q->offset == off[i]);
    CHECK(q->offset % FSDP_ALIGN == 0);
    CHECK(q->numel == fsdp_tensor_numel(p[i]));
    CHECK(strcmp(q->path, paths[i]) == 0);
    CHECK(q->param == p[i]);
  }
  const int64_t want_p[MAXW + 1] = {0, 112, 128, 144, 128}; /* 97 rounded up to W * 16 */
  CHECK(fsdp_unit_numel(u) == 71);
  CHECK(fsdp_unit_padded_numel(u) == want_p[W]);
  CHECK(fsdp_unit_shard_numel(u) == want_p[W] / W);
  CHECK(fsdp_unit_shard_offset(u) == R * (want_p[W] / W));
  CHECK(fsdp_unit_state_get(u) == FSDP_UNIT_SHARDED);
  CHECK(strcmp(fsdp_unit_path(u), "m") == 0 && fsdp_unit_nparams(u) == 5);
  /* slices: every element of every parameter is held by exactly one rank, once */
  for (int i = 0; i < 5; i++) {
    int64_t covered = 0;
    for (int r = 0; r < W; r++) {
      int64_t pf, sf, n = fsdp_unit_param_slice(u, i, r, &pf, &sf);
      if (!n) continue;
      CHECK(pf >= 0 && pf + n <= fsdp_tensor_numel(p[i]));
      CHECK(sf >= 0 && sf + n <= fsdp_unit_shard_numel(u));
      CHECK(r * fsdp_unit_shard_numel(u) + sf == off[i] + pf); /* the same flat element */
      covered += n;
    }
    CHECK(covered == fsdp_tensor_numel(p[i]));
  }
  fsdp_unit_release(u);
  for (int i = 0; i < 5; i++) fsdp_tensor_release(p[i]);
  return true;
}

static void test_layout(void **state) {
  (void)state;
  for (int W = 1; W <= MAXW; W++) run_ranks(W, rank_layout, NULL);
}

/* ---- shard contents, gather, reshard, the sharded message ---------------------------------- */

static bool rank_shard_gather(rank_ctx *ctx) {
  int W = ctx->world, R = ctx->rank;
  fsdp_tensor *p[3] = {param_new("w", 2, SHAPE(7, 5)), param_new("b", 1, SHAPE(7)),
                       param_new("g", 1, SHAPE(40))};
  const char *paths[3] = {"blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.0.ln.weight"};
  float *orig[3];
  for (int i = 0; i < 3; i++) {
    int64_t n = fsdp_tensor_numel(p[i]);
    orig[i] = malloc((size_t)n * sizeof(float));
    memcpy(orig[i], D(p[i]), (size_t)n * sizeof(float));
  }
  fsdp_unit *u;
  CHECK_OK(fsdp_unit_new(&u, ctx->comm, "blocks.0", p, paths, 3, NULL));
  /* the flat buffer: w at 0 (35), b at 48 (7), g at 64 (40), end 104 */
  int64_t P = fsdp_unit_padded_numel(u), S = fsdp_unit_shard_numel(u);
  CHECK(P % (W * FSDP_ALIGN) == 0 && P >= 104 && P < 104 + W * FSDP_ALIGN);
  fsdp_tensor *sh;
  CHECK_OK(fsdp_unit_shard(u, &sh));
  CHECK(sh->ndim == 1 && sh->shape[0] == S && sh->storage->role == FSDP_ROLE_PARAMS);
  for (int64_t j = 0; j < S; j++) {
    int64_t f = R * S + j;
    float want = 0;
    for (int i = 0; i < 3; i++) {
      const fsdp_unit_param *q = fsdp_unit_param_at(u, i);
      if (f >= q->offset && f < q->offset + q->numel) want = orig[i][f - q->offset];
    }
    CHECK(D(sh)[j] == want);
  }
  /* identity kept, data unreachable with the sharded message naming the path */
  for (int i = 0; i < 3; i++) {
    CHECK(fsdp_unit_param_at(u, i)->param == p[i]);
    CHECK(fsdp_param_unit(p[i]) == u);
    CHECK(p[i]->storage->device == &fsdp_device_sharded);
    CHECK(p[i]->grad == NULL);
  }
  CHECK(fsdp_tensor_data(p[0], "read") == NULL);
  CHECK_MSG("read: parameter blocks.0.fc.weight is sharded: gather its unit (u:gather()) or "
            "use fsdp.full_params; a wrapped model gathers its units when it is called (m(x)), "
            "not through m:forward(x)");
  /* an op on a sharded parameter fails (and says so) */
  fsdp_tensor *x = data_new("x", 2, 5), *y = NULL;
  CHECK(fsdp_op_linear(&y, x, p[0], p[1]) == FSDP_ERR);
  CHECK(strstr(fsdp_error_msg(), "sharded") != NULL);
  /* gather: exact values on every rank; idempotent (one all_gather) */
  fsdp_comm_reset_stats(ctx->comm);
  CHECK_OK(fsdp_unit_gather(u));
  CHECK_OK(fsdp_unit_gather(u));
  fsdp_comm_stats st;
  fsdp_comm_get_stats(ctx->comm, &st);
  CHECK(st.calls[FSDP_COLL_ALL_GATHER] == 1);
  CHECK(st.bytes[FSDP_COLL_ALL_GATHER] == P * 4);
  CHECK(fsdp_unit_state_get(u) == FSDP_UNIT_GATHERED);
  CHECK(live(FSDP_ROLE_GATHERED) == P * 4);
  for (int i = 0; i < 3; i++) {
    CHECK(p[i]->storage->device == &fsdp_device_cpu);
    CHECK(memcmp(D(p[i]), orig[i], (size_t)fsdp_tensor_numel(p[i]) * sizeof(float)) == 0);
  }
  CHECK(fsdp_tensor_is_contiguous(p[0]) && p[0]->offset == 0 && p[2]->offset == 64);
  CHECK_OK(fsdp_op_linear(&y, x, p[0], p[1])); /* ops work while gathered */
  fsdp_tensor_release(y);
  /* reshard: unreadable again, full buffer freed; idempotent */
  CHECK_OK(fsdp_unit_reshard(u));
  CHECK_OK(fsdp_unit_reshard(u));
  CHECK(fsdp_unit_state_get(u) == FSDP_UNIT_SHARDED);
  CHECK(live(FSDP_ROLE_GATHERED) == 0);
  CHECK(fsdp_tensor_data(p[1], "print") == NULL);
  CHECK_MSG("print: parameter blocks.0.fc.bias is sharded: gather its unit (u:gather()) or use "
            "fsdp.full_params; a wrapped model gathers its units when it is called (m(x)), not "
            "through m:forward(x)");
  /* writeback: change a parameter while gathered, write back, regather: the change stays */
  CHECK(fsdp_unit_writeback(u) == FSDP_ERR);
  CHECK(strstr(fsdp_error_msg(), "not gathered") != NULL);
  CHECK_OK(fsdp_unit_gather(u));
  CHECK_OK(fsdp_tensor_fill(p[1], 3.0f + (float)R)); /* rank-dependent: each writes its part */
  CHECK_OK(fsdp_unit_writeback(u));
  CHECK_OK(fsdp_unit_reshard(u));
  CHECK_OK(fsdp_unit_gather(u));
  for (int k = 0; k < 7; k++) { /* element k lives in the shard of rank (48 + k) / S */
    int owner = (int)((48 + k) / S);
    CHECK(D(p[1])[k] == 3.0f + (float)owner);
  }
  CHECK(memcmp(D(p[0]), orig[0], 35 * sizeof(float)) == 0);
  CHECK_OK(fsdp_unit_reshard(u));
  fsdp_tensor_release(sh);
  fsdp_tensor_release(x);
  fsdp_unit_release(u);
  for (int i = 0; i < 3; i++) {
    CHECK(fsdp_param_unit(p[i]) == NULL); /* released units let go of their parameters */
    fsdp_tensor_release(p[i]);
    free(orig[i]);
  }
  return true;
}

static void test_shard_gather(void **state) {
  (void)state;
  for (int W = 1; W <= MAXW; W++) run_ranks(W, rank_shard_gather, NULL);
}

/* ---- the cross-rank layout check ------------------------------------------------------------- */

typedef enum { MIS_ORDER, MIS_COUNT, MIS_LOCAL } mismatch_kind;

static bool rank_mismatch(rank_ctx *ctx) {
  mismatch_kind kind = *(mismatch_kind *)ctx->arg;
  int W = ctx->world, R = ctx->rank;
  bool odd = R == W - 1; /* the rank that differs */
  fsdp_tensor *lw = param_new("lw", 1, SHAPE(16)), *lb = param_new("lb", 1, SHAPE(16)),
              *fw = param_new("fw", 2, SHAPE(16, 16)), *fb = param_new("fb", 1, SHAPE(16)),
              *ex = param_new("ex", 1, SHAPE(4));
  fsdp_tensor *all[5] = {lw, lb, fw, fb, ex};
  fsdp_tensor *p[5] = {lw, lb, fw, fb, ex};
  const char *paths[5] = {"blocks.1.ln.weight", "blocks.1.ln.bias", "blocks.1.fc.weight",
                          "blocks.1.fc.bias", "blocks.1.extra"};
  int n = 4;
  if (odd && kind == MIS_ORDER) { /* swap fc.weight and fc.bias */
    p[2] = fb;
    p[3] = fw;
    paths[2] = "blocks.1.fc.bias";
    paths[3] = "blocks.1.fc.weight";
  }
  if (odd && kind == MIS_COUNT) n = 5;
  if (odd && kind == MIS_LOCAL) p[3] = fw; /* listed twice */
  fsdp_storage *before[5];
  for (int i = 0; i < 5; i++) before[i] = all[i]->storage;
  fsdp_comm_reset_stats(ctx->comm);
  fsdp_unit *u = NULL;
  CHECK(fsdp_unit_new(&u, ctx->comm, "blocks.1", p, paths, n, NULL) == FSDP_ERR);
  CHECK(u == NULL);
  char want[512];
  if (kind == MIS_ORDER)
    snprintf(want, sizeof want,
             "wrap: unit 'blocks.1' differs across ranks at parameter 3: rank 0 has "
             "blocks.1.fc.weight (16, 16), rank %d has blocks.1.fc.bias (16)",
             W - 1);
  else if (kind == MIS_COUNT)
    snprintf(want, sizeof want,
             "wrap: unit 'blocks.1' differs across ranks: rank 0 has 4 parameters, rank %d has "
             "5; at parameter 5 rank 0 has none, rank %d has blocks.1.extra (4)",
             W - 1, W - 1);
  else if (odd)
    snprintf(want, sizeof want,
             "wrap: unit 'blocks.1': parameter blocks.1.fc.bias is listed twice (also as "
             "blocks.1.fc.weight); a unit takes distinct parameters");
  else
    snprintf(want, sizeof want,
             "wrap: unit 'blocks.1' failed on rank %d: wrap: unit 'blocks.1': parameter "
             "blocks.1.fc.bias is listed twice (also as blocks.1.fc.weight); a unit takes "
             "distinct parameters",
             W - 1);
  CHECK_MSG(want);
  /* nothing moved: same storages, readable, unowned, unlabelled */
  for (int i = 0; i < 5; i++) {
    CHECK(all[i]->storage == before[i]);
    CHECK(D(all[i]) != NULL);
    CHECK(fsdp_param_unit(all[i]) == NULL);
    CHECK(all[i]->label == NULL);
  }
  /* and the communicator is fine: the same ranks can build the unit right after */
  fsdp_tensor *q[4] = {lw, lb, fw, fb};
  const char *qp[4] = {"blocks.1.ln.weight", "blocks.1.ln.bias", "blocks.1.fc.weight",
                       "blocks.1.fc.bias"};
  CHECK_OK(fsdp_unit_new(&u, ctx->comm, "blocks.1", q, qp, 4, NULL));
  /* a parameter already in a unit is an error naming it (a local check; every rank fails) */
  fsdp_unit *u2 = NULL;
  fsdp_tensor *r2[2] = {ex, fw};
  const char *r2p[2] = {"blocks.1.extra", "blocks.1.fc.weight"};
  CHECK(fsdp_unit_new(&u2, ctx->comm, "other", r2, r2p, 2, NULL) == FSDP_ERR);
  CHECK_MSG("wrap: parameter blocks.1.fc.weight already belongs to unit 'blocks.1' (a parameter "
            "belongs to exactly one unit: the closest common wrapped ancestor of its uses)");
  CHECK(ex->storage->device == &fsdp_device_cpu && fsdp_param_unit(ex) == NULL);
  fsdp_unit_release(u);
  for (int i = 0; i < 5; i++) fsdp_tensor_release(all[i]);
  return true;
}

static void test_layout_mismatch(void **state) {
  (void)state;
  for (mismatch_kind k = MIS_ORDER; k <= MIS_LOCAL; k++)
    for (int W = 2; W <= 3; W++) run_ranks(W, rank_mismatch, &k);
}

/* ---- a model: W ranks with hooks equal one rank ---------------------------------------------- */

typedef enum { NET_BASIC, NET_TWICE, NET_SHARED } net_kind;

typedef struct {
  net_kind kind;
  fsdp_strategy strategy;
  bool prefetch;
  bool root_is_root; /* false: the outer unit is built as a non-root unit */
} model_cfg;

#define NP 5
typedef struct {
  net_kind kind;
  int np;
  fsdp_tensor *p[NP];
  const char *path[NP];
  /* units: inner owns p[in[0..nin)], root owns p[out[0..nout)] */
  int nin, nout, in[NP], out[NP];
  fsdp_unit *inner, *root;
} net;

static bool net_init(net *n, net_kind kind) {
  memset(n, 0, sizeof *n);
  n->kind = kind;
  switch (kind) {
  case NET_BASIC: /* h = relu(fc1(x)), y = head(h) */
    n->np = 4;
    n->p[0] = param_new("fc1.weight", 2, SHAPE(8, 6));
    n->p[1] = param_new("fc1.bias", 1, SHAPE(8));
    n->p[2] = param_new("head.weight", 2, SHAPE(3, 8));
    n->p[3] = param_new("head.bias", 1, SHAPE(3));
    n->path[0] = "fc1.weight", n->path[1] = "fc1.bias";
    n->path[2] = "head.weight", n->path[3] = "head.bias";
    n->nin = 2, n->in[0] = 0, n->in[1] = 1;
    n->nout = 2, n->out[0] = 2, n->out[1] = 3;
    break;
  case NET_TWICE: /* h = tanh(fc(tanh(fc(x)))), y = head(h): the fc unit runs twice */
    n->np = 4;
    n->p[0] = param_new("fc.weight", 2, SHAPE(6, 6));
    n->p[1] = param_new("fc.bias", 1, SHAPE(6));
    n->p[2] = param_new("head.weight", 2, SHAPE(3, 6));
    n->p[3] = param_new("head.bias", 1, SHAPE(3));
    n->path[0] = "fc.weight", n->path[1] = "fc.bias";
    n->path[2] = "head.weight", n->path[3] = "head.bias";
    n->nin = 2, n->in[0] = 0, n->in[1] = 1;
    n->nout = 2, n->out[0] = 2, n->out[1] = 3;
    break;
  case NET_SHARED: /* inner: h = tanh(fc(proj(x))); root: y = head(proj(h)); proj is the root's */
    n->np = 5;
    n->p[0] = param_new("fc.weight", 2, SHAPE(6, 6));
    n->p[1] = param_new("fc.bias", 1, SHAPE(6));
    n->p[2] = param_new("proj.weight", 2, SHAPE(6, 6));
    n->p[3] = param_new("head.weight", 2, SHAPE(3, 6));
    n->p[4] = param_new("head.bias", 1, SHAPE(3));
    n->path[0] = "fc.weight", n->path[1] = "fc.bias", n->path[2] = "proj.weight";
    n->path[3] = "head.weight", n->path[4] = "head.bias";
    n->nin = 2, n->in[0] = 0, n->in[1] = 1;
    n->nout = 3, n->out[0] = 2, n->out[1] = 3, n->out[2] = 4;
    break;
  }
  for (int i = 0; i < n->np; i++)
    if (!n->p[i]) return false;
  return true;
}

static void net_free(net *n) {
  fsdp_unit_release(n->inner);
  fsdp_unit_release(n->root);
  for (int i = 0; i < n->np; i++) fsdp_tensor_release(n->p[i]);
}

static const char *inner_path(net_kind k) { return k == NET_BASIC ? "fc1" : "fc"; }

static int net_wrap(net *n, fsdp_comm *c, const model_cfg *cfg) {
  fsdp_tensor *ps[NP];
  const char *paths[NP];
  for (int i = 0; i < n->nin; i++) ps[i] = n->p[n->in[i]], paths[i] = n->path[n->in[i]];
  fsdp_unit_opts o = {.strategy = cfg->strategy, .reshard_after_forward = true,
                      .overlap_reduce = cfg->prefetch};
  if (fsdp_unit_new(&n->inner, c, inner_path(n->kind), ps, paths, n->nin, &o)) return FSDP_ERR;
  for (int i = 0; i < n->nout; i++) ps[i] = n->p[n->out[i]], paths[i] = n->path[n->out[i]];
  o.is_root = cfg->root_is_root;
  if (fsdp_unit_new(&n->root, c, "", ps, paths, n->nout, &o)) return FSDP_ERR;
  if (cfg->prefetch) fsdp_unit_set_backward_prefetch(n->root, n->inner);
  return FSDP_OK;
}

/* Temporaries of one forward, released together. */
typedef struct {
  fsdp_tensor *t[16];
  int n;
} pool;
static fsdp_tensor *keep(pool *pl, fsdp_tensor *t) {
  pl->t[pl->n++] = t;
  return t;
}
static void pool_free(pool *pl) {
  while (pl->n) fsdp_tensor_release(pl->t[--pl->n]);
}

#define TRY(call)                                                                                  \
  do {                                                                                             \
    if (call) goto fail;                                                                           \
  } while (0)
#define OP(dst, call)                                                                              \
  do {                                                                                             \
    if (call) goto fail;                                                                           \
    dst = keep(&pl, o_);                                                                           \
  } while (0)

/* loss = mse(net(x), tgt). With units, the unit hooks run around each unit's forward. */
static int net_forward(net *n, fsdp_tensor *x, fsdp_tensor *tgt, bool units, bool prefetch,
                       fsdp_tensor **loss) {
  pool pl = {.n = 0};
  fsdp_tensor *o_ = NULL, *h = NULL, *y, **p = n->p;
  *loss = NULL;
  if (units) TRY(fsdp_unit_pre_forward(n->root, prefetch ? n->inner : NULL));
  switch (n->kind) {
  case NET_BASIC:
    if (units) TRY(fsdp_unit_pre_forward(n->inner, NULL));
    OP(h, fsdp_op_linear(&o_, x, p[0], p[1]));
    OP(h, fsdp_op_unary(&o_, h, FSDP_UNARY_RELU));
    if (units) TRY(fsdp_unit_post_forward(n->inner, true));
    OP(y, fsdp_op_linear(&o_, h, p[2], p[3]));
    break;
  case NET_TWICE:
    h = x;
    for (int k = 0; k < 2; k++) {
      if (units) TRY(fsdp_unit_pre_forward(n->inner, NULL));
      OP(h, fsdp_op_linear(&o_, h, p[0], p[1]));
      OP(h, fsdp_op_unary(&o_, h, FSDP_UNARY_TANH));
      if (units) TRY(fsdp_unit_post_forward(n->inner, true));
    }
    OP(y, fsdp_op_linear(&o_, h, p[2], p[3]));
    break;
  case NET_SHARED:
    if (units) TRY(fsdp_unit_pre_forward(n->inner, NULL));
    OP(h, fsdp_op_linear(&o_, x, p[2], NULL)); /* the root's parameter, inside the inner unit */
    OP(h, fsdp_op_linear(&o_, h, p[0], p[1]));
    OP(h, fsdp_op_unary(&o_, h, FSDP_UNARY_TANH));
    if (units) TRY(fsdp_unit_post_forward(n->inner, true));
    OP(h, fsdp_op_linear(&o_, h, p[2], NULL));
    OP(y, fsdp_op_linear(&o_, h, p[3], p[4]));
    break;
  default:
    goto fail;
  }
  if (units) TRY(fsdp_unit_post_forward(n->root, true));
  TRY(fsdp_op_mse(loss, y, tgt));
  pool_free(&pl);
  return FSDP_OK;
fail:
  pool_free(&pl);
  return FSDP_ERR;
}

/* The one-rank reference: two SGD steps on the whole batch, unwrapped. grads[s][i] is param
 * i's gradient at step s; params[i] its values after both steps. */
typedef struct {
  float *grads[2][NP];
  float *params[NP];
} reference;

#define LR 0.1f
#define BATCH 12 /* divisible by 1..4 */

static bool reference_run(net_kind kind, reference *ref) {
  net n;
  CHECK(net_init(&n, kind));
  fsdp_tensor *x = data_new("x", BATCH, 6), *tgt = data_new("t", BATCH, 3);
  for (int s = 0; s < 2; s++) {
    fsdp_tensor *loss;
    CHECK_OK(net_forward(&n, x, tgt, false, false, &loss));
    CHECK_OK(fsdp_backward(loss, NULL));
    fsdp_tensor_release(loss);
    for (int i = 0; i < n.np; i++) {
      int64_t m = fsdp_tensor_numel(n.p[i]);
      CHECK(n.p[i]->grad);
      ref->grads[s][i] = malloc((size_t)m * sizeof(float));
      memcpy(ref->grads[s][i], D(n.p[i]->grad), (size_t)m * sizeof(float));
      for (int64_t k = 0; k < m; k++) D(n.p[i])[k] -= LR * D(n.p[i]->grad)[k];
      fsdp_tensor_set_grad(n.p[i], NULL);
    }
  }
  for (int i = 0; i < n.np; i++) {
    int64_t m = fsdp_tensor_numel(n.p[i]);
    ref->params[i] = malloc((size_t)m * sizeof(float));
    memcpy(ref->params[i], D(n.p[i]), (size_t)m * sizeof(float));
  }
  fsdp_tensor_release(x);
  fsdp_tensor_release(tgt);
  net_free(&n);
  return true;
}

static void reference_free(reference *ref) {
  for (int i = 0; i < NP; i++) {
    free(ref->grads[0][i]);
    free(ref->grads[1][i]);
    free(ref->params[i]);
  }
}

/* The gradient shard of unit u (owning net params idx[0..k)) equals the matching slice of the
 * reference gradients g (zero in the padding). */
static bool grad_shard_matches(fsdp_unit *u, const int *idx, float *const *g) {
  fsdp_tensor *gs;
  CHECK_OK(fsdp_unit_grad_shard(u, &gs));
  int64_t S = fsdp_unit_shard_numel(u), off = fsdp_unit_shard_offset(u);
  CHECK(gs->shape[0] == S && gs->storage->role == FSDP_ROLE_GRADS);
  for (int64_t j = 0; j < S; j++) {
    int64_t f = off + j;
    float want = 0;
    for (int i = 0; i < fsdp_unit_nparams(u); i++) {
      const fsdp_unit_param *q = fsdp_unit_param_at(u, i);
      if (f >= q->offset && f < q->offset + q->numel) want = g[idx[i]][f - q->offset];
    }
    if (!close_to(D(gs)[j], want, 1e-6f)) {
      char m[200];
      snprintf(m, sizeof m, "unit '%s' grad shard[%lld] = %.9g, want %.9g", fsdp_unit_path(u),
               (long long)j, (double)D(gs)[j], (double)want);
      fsdp_tensor_release(gs);
      return note_fail(__LINE__, m);
    }
  }
  fsdp_tensor_release(gs);
  return true;
}

/* shard -= LR * grad_shard; grad shard := 0 */
static bool sgd_step(fsdp_unit *u) {
  fsdp_tensor *s, *g;
  CHECK_OK(fsdp_unit_shard(u, &s));
  CHECK_OK(fsdp_unit_grad_shard(u, &g));
  for (int64_t j = 0; j < s->shape[0]; j++) D(s)[j] -= LR * D(g)[j];
  fsdp_tensor_release(s);
  fsdp_tensor_release(g);
  CHECK_OK(fsdp_unit_zero_grad(u));
  return true;
}

static bool after_backward(const net *n, const model_cfg *cfg) {
  fsdp_unit_state want =
      cfg->strategy == FSDP_STRATEGY_NONE ? FSDP_UNIT_GATHERED : FSDP_UNIT_SHARDED;
  CHECK(fsdp_unit_state_get(n->inner) == want);
  CHECK(fsdp_unit_state_get(n->root) == want);
  CHECK(fsdp_unit_pending_backward(n->inner) == 0 && fsdp_unit_pending_backward(n->root) == 0);
  CHECK(!fsdp_unit_prefetching(n->inner) && !fsdp_unit_prefetching(n->root));
  CHECK(!fsdp_unit_reducing(n->inner) && !fsdp_unit_reducing(n->root)); /* landed */
  for (int i = 0; i < n->np; i++) CHECK(n->p[i]->grad == NULL);
  CHECK(fsdp_tape_size() == 0);
  CHECK(live(FSDP_ROLE_GATHERED) == 0);
  int64_t gs = fsdp_unit_shard_numel(n->inner) + fsdp_unit_shard_numel(n->root);
  CHECK(live(FSDP_ROLE_GRADS) == gs * 4); /* the full gradients are gone */
  return true;
}

static bool rank_model(rank_ctx *ctx) {
  const model_cfg *cfg = ctx->arg;
  int W = ctx->world, R = ctx->rank;
  reference ref = {0};
  if (!reference_run(cfg->kind, &ref)) return false;
  net n;
  CHECK(net_init(&n, cfg->kind));
  CHECK_OK(net_wrap(&n, ctx->comm, cfg));
  fsdp_tensor *xf = data_new("x", BATCH, 6), *tf = data_new("t", BATCH, 3);
  fsdp_tensor *x = rows_of(xf, R, W), *tgt = rows_of(tf, R, W);
  CHECK(x && tgt);
  int64_t Pi = fsdp_unit_padded_numel(n.inner), Pr = fsdp_unit_padded_numel(n.root);
  for (int s = 0; s < 2; s++) {
    fsdp_comm_reset_stats(ctx->comm);
    fsdp_tensor *loss;
    CHECK_OK(net_forward(&n, x, tgt, true, cfg->prefetch, &loss));
    CHECK(fsdp_unit_pending_backward(n.inner) == (cfg->kind == NET_TWICE ? 2 : 1));
    CHECK(fsdp_unit_pending_backward(n.root) == 1);
    CHECK_OK(fsdp_backward(loss, NULL));
    fsdp_tensor_release(loss);
    if (!after_backward(&n, cfg)) return false;
    if (!grad_shard_matches(n.inner, n.in, ref.grads[s])) return false;
    if (!grad_shard_matches(n.root, n.out, ref.grads[s])) return false;
    /* traffic of one step */
    fsdp_comm_stats st;
    fsdp_comm_get_stats(ctx->comm, &st);
    int64_t ag = 0, rs = 0, ar = 0;
    if (cfg->strategy == FSDP_STRATEGY_FULL) {
      /* forward and backward all-gather each unit, except that the root stays gathered from its
       * forward into its backward; the fc unit of NET_TWICE is gathered for each call */
      int fwd_inner = cfg->kind == NET_TWICE ? 2 : 1;
      ag = (fwd_inner + 1) * Pi + (cfg->root_is_root ? 1 : 2) * Pr;
      rs = Pi + Pr;
    } else if (cfg->strategy == FSDP_STRATEGY_GRAD_OP) {
      ag = Pi + Pr; /* gathered once, kept until the end of backward (also between two calls) */
      rs = Pi + Pr;
    } else {
      ar = Pi + Pr;
    }
    if (cfg->strategy == FSDP_STRATEGY_NONE) CHECK(st.calls[FSDP_COLL_ALL_GATHER] == 0);
    if (st.bytes[FSDP_COLL_ALL_GATHER] != ag * 4 || st.bytes[FSDP_COLL_REDUCE_SCATTER] != rs * 4 ||
        st.bytes[FSDP_COLL_ALL_REDUCE] != ar * 4) {
      char m[300];
      snprintf(m, sizeof m,
               "step %d traffic: all_gather %lld B (want %lld), reduce_scatter %lld B (want "
               "%lld), all_reduce %lld B (want %lld); Pi %lld Pr %lld",
               s, (long long)st.bytes[FSDP_COLL_ALL_GATHER], (long long)ag * 4,
               (long long)st.bytes[FSDP_COLL_REDUCE_SCATTER], (long long)rs * 4,
               (long long)st.bytes[FSDP_COLL_ALL_REDUCE], (long long)ar * 4, (long long)Pi,
               (long long)Pr);
      return note_fail(__LINE__, m);
    }
    CHECK(sgd_step(n.inner) && sgd_step(n.root));
  }
  /* unshard: dense parameters with the trained values, owned by nobody */
  CHECK_OK(fsdp_unit_unshard(n.inner));
  CHECK_OK(fsdp_unit_unshard(n.root));
  CHECK_OK(fsdp_unit_unshard(n.root)); /* idempotent */
  CHECK(fsdp_unit_is_empty(n.root) && fsdp_unit_nparams(n.root) == 0);
  CHECK(fsdp_unit_gather(n.root) == FSDP_ERR);
  int64_t total = 0;
  for (int i = 0; i < n.np; i++) {
    fsdp_tensor *p = n.p[i];
    int64_t m = fsdp_tensor_numel(p);
    total += m;
    CHECK(fsdp_param_unit(p) == NULL);
    CHECK(p->storage->device == &fsdp_device_cpu && p->storage->role == FSDP_ROLE_PARAMS);
    CHECK(p->offset == 0 && p->storage->bytes == (size_t)m * 4);
    CHECK(fsdp_tensor_is_contiguous(p) && p->grad == NULL);
    for (int64_t k = 0; k < m; k++)
      if (!close_to(D(p)[k], ref.params[i][k], 1e-6f)) {
        char msg[200];
        snprintf(msg, sizeof msg, "%s[%lld] = %.9g after unshard, want %.9g", n.path[i],
                 (long long)k, (double)D(p)[k], (double)ref.params[i][k]);
        return note_fail(__LINE__, msg);
      }
  }
  CHECK(live(FSDP_ROLE_PARAMS) == total * 4);
  CHECK(live(FSDP_ROLE_GRADS) == 0 && live(FSDP_ROLE_GATHERED) == 0);
  fsdp_tensor_release(xf);
  fsdp_tensor_release(tf);
  fsdp_tensor_release(x);
  fsdp_tensor_release(tgt);
  net_free(&n);
  reference_free(&ref);
  return true;
}

static void run_model(net_kind kind, fsdp_strategy strategy, bool prefetch, bool root) {
  model_cfg cfg = {.kind = kind, .strategy = strategy, .prefetch = prefetch, .root_is_root = root};
  for (int W = 1; W <= MAXW; W++) run_ranks(W, rank_model, &cfg);
}

static void test_model_full(void **state) {
  (void)state;
  run_model(NET_BASIC, FSDP_STRATEGY_FULL, false, true);
  run_model(NET_BASIC, FSDP_STRATEGY_FULL, true, true);
  run_model(NET_BASIC, FSDP_STRATEGY_FULL, true, false); /* 2 all-gathers for every unit */
}
static void test_model_grad_op(void **state) {
  (void)state;
  run_model(NET_BASIC, FSDP_STRATEGY_GRAD_OP, true, true);
}
static void test_model_none(void **state) {
  (void)state;
  run_model(NET_BASIC, FSDP_STRATEGY_NONE, true, true);
}
static void test_module_called_twice(void **state) {
  (void)state;
  run_model(NET_TWICE, FSDP_STRATEGY_FULL, true, true);
  run_model(NET_TWICE, FSDP_STRATEGY_GRAD_OP, false, true);
  run_model(NET_TWICE, FSDP_STRATEGY_NONE, false, true);
}
static void test_ancestor_param_in_inner_unit(void **state) {
  (void)state;
  run_model(NET_SHARED, FSDP_STRATEGY_FULL, true, true);
  run_model(NET_SHARED, FSDP_STRATEGY_FULL, false, false);
  run_model(NET_SHARED, FSDP_STRATEGY_GRAD_OP, true, true);
  run_model(NET_SHARED, FSDP_STRATEGY_NONE, false, true);
}

/* ---- prefetch overlap ------------------------------------------------------------------------- */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
  double prefetch_s;   /* rank 0: how long its prefetch call took */
  double compute_done; /* rank 0: when its compute after the prefetch finished */
  double peer_issued;  /* rank 1: when it issued its part of the all-gather */
  bool in_flight_during_compute;
} overlap_info;

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000 * 1000};
  nanosleep(&ts, NULL);
}

static bool rank_prefetch(rank_ctx *ctx) {
  overlap_info *info = ctx->arg;
  int R = ctx->rank;
  fsdp_tensor *pa = param_new("a", 2, SHAPE(32, 32)), *pb = param_new("b", 2, SHAPE(32, 32));
  float *orig = malloc(32 * 32 * sizeof(float));
  memcpy(orig, D(pb), 32 * 32 * sizeof(float));
  const char *na = "a.weight", *nb = "b.weight";
  fsdp_unit *a, *b;
  fsdp_unit_opts o = {.strategy = FSDP_STRATEGY_FULL, .reshard_after_forward = true};
  CHECK_OK(fsdp_unit_new(&a, ctx->comm, "a", &pa, &na, 1, &o));
  CHECK_OK(fsdp_unit_new(&b, ctx->comm, "b", &pb, &nb, 1, &o));
  CHECK_OK(fsdp_unit_pre_forward(a, NULL)); /* blocking: both ranks leave it together */
  fsdp_tensor *x = data_new("x", 64, 32), *y;
  if (R == 0) {
    /* rank 0 issues b's all-gather and computes; rank 1 joins the all-gather only 300 ms
     * later, so rank 0's compute ran while its request was in flight */
    double t0 = now_s();
    CHECK_OK(fsdp_unit_prefetch(b));
    info->prefetch_s = now_s() - t0;
    CHECK(fsdp_unit_prefetching(b) && fsdp_unit_state_get(b) == FSDP_UNIT_SHARDED);
    CHECK_OK(fsdp_unit_prefetch(b)); /* a second prefetch is a no-op */
    CHECK_OK(fsdp_op_linear(&y, x, pa, NULL));
    fsdp_tensor_release(y);
    info->compute_done = now_s();
    info->in_flight_during_compute = fsdp_unit_prefetching(b);
  } else {
    sleep_ms(300);
    info->peer_issued = now_s();
    CHECK_OK(fsdp_unit_prefetch(b));
  }
  CHECK_OK(fsdp_unit_post_forward(a, true));
  CHECK_OK(fsdp_unit_pre_forward(b, NULL)); /* consumes the prefetch (rank 0 waits here) */
  CHECK(!fsdp_unit_prefetching(b) && fsdp_unit_state_get(b) == FSDP_UNIT_GATHERED);
  CHECK(memcmp(D(pb), orig, 32 * 32 * sizeof(float)) == 0);
  CHECK_OK(fsdp_unit_post_forward(b, true));
  /* pre_forward(a, next = b) issues b's prefetch once a is gathered */
  fsdp_comm_reset_stats(ctx->comm);
  CHECK_OK(fsdp_unit_pre_forward(a, b));
  CHECK(fsdp_unit_prefetching(b));
  CHECK_OK(fsdp_op_linear(&y, x, pa, NULL));
  fsdp_tensor_release(y);
  CHECK_OK(fsdp_unit_post_forward(a, true));
  CHECK_OK(fsdp_unit_pre_forward(b, NULL));
  CHECK(memcmp(D(pb), orig, 32 * 32 * sizeof(float)) == 0);
  CHECK_OK(fsdp_unit_post_forward(b, true));
  fsdp_comm_stats st;
  fsdp_comm_get_stats(ctx->comm, &st);
  CHECK(st.calls[FSDP_COLL_ALL_GATHER] == 2); /* a once, b once (the prefetch) */
  /* a prefetch nobody consumes is dropped by reshard */
  CHECK_OK(fsdp_unit_prefetch(a));
  CHECK(fsdp_unit_prefetching(a));
  CHECK_OK(fsdp_unit_reshard(a));
  CHECK(!fsdp_unit_prefetching(a) && fsdp_unit_state_get(a) == FSDP_UNIT_SHARDED);
  CHECK(live(FSDP_ROLE_GATHERED) == 0);
  /* and one still in flight when the unit is released is waited for */
  CHECK_OK(fsdp_unit_prefetch(b));
  fsdp_unit_release(a);
  fsdp_unit_release(b);
  fsdp_tensor_release(x);
  fsdp_tensor_release(pa);
  fsdp_tensor_release(pb);
  free(orig);
  return true;
}

static void test_prefetch_overlap(void **state) {
  (void)state;
  overlap_info info = {0};
  run_ranks(2, rank_prefetch, &info);
  assert_true(info.prefetch_s < 0.15);                  /* issuing did not wait for the peer */
  assert_true(info.in_flight_during_compute);
  assert_true(info.compute_done < info.peer_issued);    /* computed before the peer joined */
}

/* ---- the gradient reduction overlapped with the backward ------------------------------------ */

typedef struct {
  bool overlap;
  bool fail_peer;   /* rank 1 aborts its communicator instead of running its backward */
  bool root_frozen; /* the root has nothing to reduce: the walk itself succeeds */
  bool outer_unit;  /* the outer unit is not the root: its reduction overlaps too */
  _Atomic bool probed;
  double probe_t;   /* rank 0: when its probe ran */
  double peer_t;    /* rank 1: when it started its backward */
  bool reducing;    /* rank 0's inner unit's reduction was in flight at the probe */
  int64_t grads_at_probe, grads_after, grad_shards;
  char msg[256];
} overlap_cfg;

typedef struct {
  fsdp_unit *inner;
  overlap_cfg *cfg; /* rank 0's probe reports; rank 1's does nothing */
} probe;

/* A tape hook pushed before the inner unit's forward: in backward it runs right after the
 * inner unit's last "begin" hook (its reduction started), before the root's. */
static int probe_hook(void *ud) {
  probe *pr = ud;
  overlap_cfg *cfg = pr->cfg;
  if (!cfg) return FSDP_OK;
  cfg->probe_t = now_s();
  cfg->reducing = fsdp_unit_reducing(pr->inner);
  cfg->grads_at_probe = live(FSDP_ROLE_GRADS);
  atomic_store(&cfg->probed, true);
  return FSDP_OK;
}

/* NET_BASIC, grad_op (the backward gathers nothing, so only the reductions meet the peer).
 * Rank 1 starts its backward only once rank 0's probe has run (or after a while: 10 s with
 * overlap, 300 ms without). With overlap_reduce, rank 0's inner unit starts its reduce-scatter
 * and goes on: its probe runs before rank 1 has started, with the reduction in flight and the
 * inner unit's full gradient still alive. Without, the reduce-scatter waits for rank 1, and the
 * probe runs after rank 1 started. */
static bool rank_reduce_overlap(rank_ctx *ctx) {
  overlap_cfg *cfg = ctx->arg;
  int R = ctx->rank, W = ctx->world;
  net n;
  CHECK(net_init(&n, NET_BASIC));
  if (cfg->root_frozen)
    for (int i = 0; i < n.nout; i++) n.p[n.out[i]]->requires_grad = false;
  fsdp_tensor *ps[NP];
  const char *paths[NP];
  for (int i = 0; i < n.nin; i++) ps[i] = n.p[n.in[i]], paths[i] = n.path[n.in[i]];
  fsdp_unit_opts o = {.strategy = FSDP_STRATEGY_GRAD_OP, .overlap_reduce = cfg->overlap};
  CHECK_OK(fsdp_unit_new(&n.inner, ctx->comm, "fc1", ps, paths, n.nin, &o));
  for (int i = 0; i < n.nout; i++) ps[i] = n.p[n.out[i]], paths[i] = n.path[n.out[i]];
  o.is_root = !cfg->outer_unit;
  CHECK_OK(fsdp_unit_new(&n.root, ctx->comm, "", ps, paths, n.nout, &o));
  fsdp_tensor *xf = data_new("x", BATCH, 6), *tf = data_new("t", BATCH, 3);
  fsdp_tensor *x = rows_of(xf, R, W), *tgt = rows_of(tf, R, W), *h1, *h2, *y, *loss;
  probe *pr = calloc(1, sizeof *pr);
  CHECK(pr && x && tgt);
  *pr = (probe){.inner = n.inner, .cfg = R == 0 ? cfg : NULL};
  CHECK_OK(fsdp_unit_pre_forward(n.root, NULL));
  CHECK_OK(fsdp_tape_hook(probe_hook, pr, free));
  CHECK_OK(fsdp_unit_pre_forward(n.inner, NULL));
  CHECK_OK(fsdp_op_linear(&h1, x, n.p[0], n.p[1]));
  CHECK_OK(fsdp_op_unary(&h2, h1, FSDP_UNARY_RELU));
  CHECK_OK(fsdp_unit_post_forward(n.inner, true));
  CHECK_OK(fsdp_op_linear(&y, h2, n.p[2], n.p[3]));
  CHECK_OK(fsdp_unit_post_forward(n.root, true));
  CHECK_OK(fsdp_op_mse(&loss, y, tgt));
  if (R == 1) {
    for (int k = 0; k < (cfg->overlap ? 10000 : 300) && !atomic_load(&cfg->probed); k++)
      sleep_ms(1);
    cfg->peer_t = now_s();
  }
  if (cfg->fail_peer && R == 1) {
    fsdp_comm_abort(ctx->comm, "rank 1 gave up");
    fsdp_tape_clear();
  } else {
    int rc = fsdp_backward(loss, NULL);
    if (R == 0) {
      cfg->grads_after = live(FSDP_ROLE_GRADS);
      cfg->grad_shards = (fsdp_unit_shard_numel(n.inner) +
                          (cfg->root_frozen ? 0 : fsdp_unit_shard_numel(n.root))) * 4;
      snprintf(cfg->msg, sizeof cfg->msg, "%s", rc ? fsdp_error_msg() : "");
    }
    CHECK(!fsdp_unit_reducing(n.inner) && !fsdp_unit_reducing(n.root));
    CHECK((rc != FSDP_OK) == cfg->fail_peer);
  }
  RELEASE_ALL(loss, y, h1, h2, x, tgt, xf, tf);
  net_free(&n);
  return true;
}

static void test_reduce_overlap(void **state) {
  (void)state;
  overlap_cfg on = {.overlap = true}, off = {.overlap = false};
  run_ranks(2, rank_reduce_overlap, &on);
  run_ranks(2, rank_reduce_overlap, &off);
  /* overlapped: rank 0's backward went past the inner unit before rank 1 started its own, with
   * the reduction in flight and its full gradient alive; it had landed when backward returned */
  assert_true(on.probe_t < on.peer_t);
  assert_true(on.reducing);
  assert_true(on.grads_at_probe > on.grads_after);
  assert_int_equal(on.grads_after, on.grad_shards);
  /* not overlapped: the inner unit's reduce-scatter met rank 1 first */
  assert_true(off.probe_t > off.peer_t);
  assert_false(off.reducing);
  assert_int_equal(off.grads_after, off.grad_shards);
}

/* A reduction in flight that fails (the peer gave up): the backward fails, naming the unit
 * whose reduction it was when nothing else failed before it (the root has nothing to reduce),
 * and nothing is left in flight; no gradient memory is left (the full gradients are freed, and
 * the gradient shards, made when a first reduction lands, never were). */
static void test_reduce_overlap_failure(void **state) {
  (void)state;
  overlap_cfg frozen = {.overlap = true, .fail_peer = true, .root_frozen = true};
  run_ranks(2, rank_reduce_overlap, &frozen);
  assert_non_null(strstr(frozen.msg, "backward: unit 'fc1'"));
  assert_non_null(strstr(frozen.msg, "rank 1 gave up"));
  assert_true(frozen.grads_at_probe > 0);
  assert_int_equal(frozen.grads_after, 0);
  /* the root's own reduction fails first: its message is the backward's, and the inner one's
   * still lands (freed) */
  overlap_cfg both = {.overlap = true, .fail_peer = true};
  run_ranks(2, rank_reduce_overlap, &both);
  assert_non_null(strstr(both.msg, "rank 1 gave up"));
  assert_null(strstr(both.msg, "unit 'fc1'"));
  assert_int_equal(both.grads_after, 0);
  /* the outer unit overlaps too: starting its reduction lands the inner one's first, which
   * fails; the message is the inner unit's alone */
  overlap_cfg outer = {.overlap = true, .fail_peer = true, .outer_unit = true};
  run_ranks(2, rank_reduce_overlap, &outer);
  assert_non_null(strstr(outer.msg, "backward: unit 'fc1': "));
  assert_non_null(strstr(outer.msg, "rank 1 gave up"));
  assert_null(strstr(outer.msg, "unit ''"));
  assert_int_equal(outer.grads_after, 0);
}

/* Prefetches that would never be consumed are not left in flight (a later gather would hand
 * out values from before the optimizer step): a frozen unit gets no backward prefetch, and the
 * root drops leftovers at the end of its forward. */
static bool rank_stale_prefetch(rank_ctx *ctx) {
  fsdp_tensor *pf = param_new("frozen", 2, SHAPE(4, 4)), *pt = param_new("trained", 2, SHAPE(4, 4)),
              *pr = param_new("root", 1, SHAPE(4)), *px = param_new("unused", 1, SHAPE(8));
  pf->requires_grad = false;
  const char *nf = "f.weight", *nt = "t.weight", *nr = "scale", *nx = "x.bias";
  fsdp_unit_opts o = {.strategy = FSDP_STRATEGY_FULL, .reshard_after_forward = true};
  fsdp_unit *f, *t, *root, *x;
  CHECK_OK(fsdp_unit_new(&f, ctx->comm, "f", &pf, &nf, 1, &o));
  CHECK_OK(fsdp_unit_new(&t, ctx->comm, "t", &pt, &nt, 1, &o));
  CHECK_OK(fsdp_unit_new(&x, ctx->comm, "x", &px, &nx, 1, &o));
  o.is_root = true;
  CHECK_OK(fsdp_unit_new(&root, ctx->comm, "", &pr, &nr, 1, &o));
  fsdp_unit_set_backward_prefetch(root, t);
  fsdp_unit_set_backward_prefetch(t, f); /* f is frozen: its backward never comes */
  fsdp_tensor *in = data_new("in", 2, 4), *h1, *h2, *h3, *loss;
  fsdp_comm_reset_stats(ctx->comm);
  CHECK_OK(fsdp_unit_pre_forward(root, f));
  CHECK_OK(fsdp_unit_pre_forward(f, t));
  CHECK_OK(fsdp_op_linear(&h1, in, pf, NULL));
  CHECK(!h1->requires_grad);
  CHECK_OK(fsdp_unit_post_forward(f, h1->requires_grad));
  CHECK(fsdp_unit_pending_backward(f) == 0); /* nothing to record for a frozen unit */
  CHECK(fsdp_unit_state_get(f) == FSDP_UNIT_SHARDED);
  CHECK_OK(fsdp_unit_pre_forward(t, x)); /* x's forward will not run */
  CHECK(fsdp_unit_prefetching(x));
  CHECK_OK(fsdp_op_linear(&h2, h1, pt, NULL));
  CHECK_OK(fsdp_unit_post_forward(t, true));
  CHECK_OK(fsdp_op_binary(&h3, h2, pr, FSDP_OP_MUL));
  CHECK(fsdp_unit_prefetching(x));
  CHECK_OK(fsdp_unit_post_forward(root, true));
  CHECK(!fsdp_unit_prefetching(x)); /* dropped at the end of the forward */
  CHECK(live(FSDP_ROLE_GATHERED) == fsdp_unit_padded_numel(root) * 4);
  CHECK_OK(fsdp_op_sum(&loss, h3));
  CHECK_OK(fsdp_backward(loss, NULL));
  CHECK(!fsdp_unit_prefetching(f)); /* t's backward did not prefetch the frozen unit */
  fsdp_comm_stats st;
  fsdp_comm_get_stats(ctx->comm, &st);
  /* forward: root, f (prefetched by root), t (prefetched by f), x (dropped); backward: t */
  CHECK(st.calls[FSDP_COLL_ALL_GATHER] == 5);
  CHECK(st.calls[FSDP_COLL_REDUCE_SCATTER] == 2); /* t and the root; not the frozen f */
  CHECK(live(FSDP_ROLE_GATHERED) == 0);
  RELEASE_ALL(loss, h1, h2, h3, in, pf, pt, pr, px);
  fsdp_unit_release(f);
  fsdp_unit_release(t);
  fsdp_unit_release(x);
  fsdp_unit_release(root);
  return true;
}

static void test_stale_prefetch(void **state) {
  (void)state;
  for (int W = 1; W <= 2; W++) run_ranks(W, rank_stale_prefetch, NULL);
}

/* A tape hook that prefetches unit ud when backward reaches it. */
static int prefetch_hook(void *ud) { return fsdp_unit_prefetch(ud); }

/* No prefetch outlives a backward, whoever issued it and wherever: here a hook recorded before
 * the root's forward, so it runs after the root's last backward hook, prefetches a unit whose
 * backward is over. The end of the backward drops it (an optimizer step may change the shard
 * next). */
static bool rank_prefetch_after_root(rank_ctx *ctx) {
  fsdp_tensor *pa = param_new("a", 2, SHAPE(4, 4)), *pr = param_new("root", 1, SHAPE(4));
  const char *na = "a.weight", *nr = "scale";
  fsdp_unit_opts o = {.strategy = FSDP_STRATEGY_FULL, .reshard_after_forward = true};
  fsdp_unit *a, *root;
  CHECK_OK(fsdp_unit_new(&a, ctx->comm, "a", &pa, &na, 1, &o));
  o.is_root = true;
  CHECK_OK(fsdp_unit_new(&root, ctx->comm, "", &pr, &nr, 1, &o));
  fsdp_tensor *in = data_new("in", 2, 4), *h1, *h2, *loss;
  CHECK_OK(fsdp_tape_hook(prefetch_hook, a, NULL));
  CHECK_OK(fsdp_unit_pre_forward(root, NULL));
  CHECK_OK(fsdp_unit_pre_forward(a, NULL));
  CHECK_OK(fsdp_op_linear(&h1, in, pa, NULL));
  CHECK_OK(fsdp_unit_post_forward(a, true));
  CHECK_OK(fsdp_op_binary(&h2, h1, pr, FSDP_OP_MUL));
  CHECK_OK(fsdp_unit_post_forward(root, true));
  CHECK_OK(fsdp_op_sum(&loss, h2));
  CHECK_OK(fsdp_backward(loss, NULL));
  CHECK(!fsdp_unit_prefetching(a) && fsdp_unit_state_get(a) == FSDP_UNIT_SHARDED);
  CHECK(live(FSDP_ROLE_GATHERED) == 0);
  RELEASE_ALL(loss, h1, h2, in, pa, pr);
  fsdp_unit_release(a);
  fsdp_unit_release(root);
  return true;
}

static void test_prefetch_after_root(void **state) {
  (void)state;
  for (int W = 1; W <= 2; W++) run_ranks(W, rank_prefetch_after_root, NULL);
}

/* A fully frozen unit that gradients pass through (f, between the trainable a and the root):
 * recorded, gathered again in backward for the input gradient, but no full gradient, no
 * reduce-scatter and no gradient shard. A frozen unit no gradient reaches (g, first, its
 * input needs none) takes its "begin" hook off the tape again: nothing of it stays recorded. */
static bool rank_frozen_passthrough(rank_ctx *ctx) {
  fsdp_tensor *pg = param_new("g", 2, SHAPE(4, 4)), *pa = param_new("a", 2, SHAPE(4, 4)),
              *pf = param_new("f", 2, SHAPE(4, 4)), *pr = param_new("root", 1, SHAPE(4));
  pg->requires_grad = pf->requires_grad = false;
  const char *ng = "g.weight", *na = "a.weight", *nf = "f.weight", *nr = "scale";
  fsdp_unit_opts o = {.strategy = FSDP_STRATEGY_FULL, .reshard_after_forward = true};
  fsdp_unit *g, *a, *f, *root;
  CHECK_OK(fsdp_unit_new(&g, ctx->comm, "g", &pg, &ng, 1, &o));
  CHECK_OK(fsdp_unit_new(&a, ctx->comm, "a", &pa, &na, 1, &o));
  CHECK_OK(fsdp_unit_new(&f, ctx->comm, "f", &pf, &nf, 1, &o));
  o.is_root = true;
  CHECK_OK(fsdp_unit_new(&root, ctx->comm, "", &pr, &nr, 1, &o));
  CHECK(!fsdp_unit_trainable(g) && fsdp_unit_trainable(a) && !fsdp_unit_trainable(f));
  fsdp_tensor *in = data_new("in", 2, 4), *h0, *h1, *h2, *h3, *loss;
  fsdp_comm_reset_stats(ctx->comm);
  CHECK_OK(fsdp_unit_pre_forward(root, NULL));
  int64_t tape0 = fsdp_tape_size();
  CHECK_OK(fsdp_unit_pre_forward(g, NULL));
  CHECK(fsdp_unit_pending_backward(g) == 1); /* pushed, to be decided at post */
  CHECK_OK(fsdp_op_linear(&h0, in, pg, NULL));
  CHECK_OK(fsdp_unit_post_forward(g, h0->requires_grad));
  CHECK(fsdp_unit_pending_backward(g) == 0 && fsdp_tape_size() == tape0); /* off again */
  CHECK(fsdp_unit_state_get(g) == FSDP_UNIT_SHARDED);
  CHECK_OK(fsdp_unit_pre_forward(a, NULL));
  CHECK_OK(fsdp_op_linear(&h1, h0, pa, NULL));
  CHECK_OK(fsdp_unit_post_forward(a, h1->requires_grad));
  CHECK_OK(fsdp_unit_pre_forward(f, NULL));
  CHECK_OK(fsdp_op_linear(&h2, h1, pf, NULL));
  CHECK(h2->requires_grad);
  CHECK_OK(fsdp_unit_post_forward(f, h2->requires_grad));
  CHECK(fsdp_unit_pending_backward(f) == 1); /* recorded: its backward passes gradients on */
  CHECK_OK(fsdp_op_binary(&h3, h2, pr, FSDP_OP_MUL));
  CHECK_OK(fsdp_unit_post_forward(root, true));
  CHECK_OK(fsdp_op_sum(&loss, h3));
  CHECK_OK(fsdp_backward(loss, NULL));
  fsdp_comm_stats st;
  fsdp_comm_get_stats(ctx->comm, &st);
  /* forward: root, g, a, f; backward: f (for the input gradient) and a */
  CHECK(st.calls[FSDP_COLL_ALL_GATHER] == 6);
  CHECK(st.calls[FSDP_COLL_REDUCE_SCATTER] == 2); /* a and the root; not f, not g */
  CHECK(fsdp_unit_param_has_grad(a, 0) && !fsdp_unit_param_has_grad(f, 0));
  CHECK(!pf->grad && !pg->grad);
  /* gradient memory: the shards of a and the root only */
  CHECK(live(FSDP_ROLE_GRADS) ==
        (fsdp_unit_shard_numel(a) + fsdp_unit_shard_numel(root)) * (int64_t)sizeof(float));
  CHECK(live(FSDP_ROLE_GATHERED) == 0);
  /* freezing a's last trainable parameter frees its gradient shard */
  fsdp_param_set_requires_grad(pa, false);
  CHECK(live(FSDP_ROLE_GRADS) == fsdp_unit_shard_numel(root) * (int64_t)sizeof(float));
  RELEASE_ALL(loss, h0, h1, h2, h3, in, pg, pa, pf, pr);
  fsdp_unit_release(g);
  fsdp_unit_release(a);
  fsdp_unit_release(f);
  fsdp_unit_release(root);
  return true;
}

static void test_frozen_passthrough(void **state) {
  (void)state;
  for (int W = 1; W <= 3; W++) run_ranks(W, rank_frozen_passthrough, NULL);
}

/* ---- memory per rank ------------------------------------------------------------------------- */

/* A root (2 small params) and three inner units of different sizes, FULL, no prefetch: after
 * wrapping a rank holds its shards (params) only, after a backward also its gradient shards
 * (grads), made as each unit reduces; during a step the gathered memory peaks at the root plus
 * the largest inner unit. */
static bool rank_memory(rank_ctx *ctx) {
  int W = ctx->world, R = ctx->rank;
  enum { K = 3 };
  const int64_t width[K] = {24, 40, 16};
  fsdp_tensor *w[K], *b[K];
  fsdp_unit *inner[K], *root;
  char names[K][2][32];
  int64_t sumS = 0, maxP = 0, S[K], P[K];
  fsdp_unit_opts o = {.strategy = FSDP_STRATEGY_FULL, .reshard_after_forward = true};
  int64_t dim = 8;
  for (int k = 0; k < K; k++) {
    /* layer k: (dim_out, dim_in) with dim_in = dim */
    snprintf(names[k][0], 32, "layers.%d.weight", k);
    snprintf(names[k][1], 32, "layers.%d.bias", k);
    int64_t out = k == K - 1 ? 8 : width[k];
    w[k] = param_new(names[k][0], 2, SHAPE(out, dim));
    b[k] = param_new(names[k][1], 1, SHAPE(out));
    fsdp_tensor *ps[2] = {w[k], b[k]};
    const char *pp[2] = {names[k][0], names[k][1]};
    char path[16];
    snprintf(path, sizeof path, "layers.%d", k);
    CHECK_OK(fsdp_unit_new(&inner[k], ctx->comm, path, ps, pp, 2, &o));
    S[k] = fsdp_unit_shard_numel(inner[k]);
    P[k] = fsdp_unit_padded_numel(inner[k]);
    sumS += S[k];
    if (P[k] > maxP) maxP = P[k];
    dim = out;
  }
  fsdp_tensor *hw = param_new("head.weight", 2, SHAPE(2, 8)), *hb = param_new("head.bias", 1, SHAPE(2));
  fsdp_tensor *rp[2] = {hw, hb};
  const char *rpp[2] = {"head.weight", "head.bias"};
  o.is_root = true;
  CHECK_OK(fsdp_unit_new(&root, ctx->comm, "", rp, rpp, 2, &o));
  sumS += fsdp_unit_shard_numel(root);
  int64_t Pr = fsdp_unit_padded_numel(root);
  /* wrapped: total / W (plus padding) of parameters, no gradient yet, nothing gathered */
  CHECK(live(FSDP_ROLE_PARAMS) == sumS * 4);
  CHECK(live(FSDP_ROLE_GRADS) == 0);
  CHECK(live(FSDP_ROLE_GATHERED) == 0);
  fsdp_mem_reset_peak(NULL);
  fsdp_tensor *x = data_new("x", 4, 8), *xl = rows_of(x, R, W), *t = data_new("t", 4, 2),
              *tl = rows_of(t, R, W);
  pool pl = {.n = 0};
  fsdp_tensor *o_ = NULL, *h = xl, *loss;
  CHECK_OK(fsdp_unit_pre_forward(root, NULL));
  for (int k = 0; k < K; k++) {
    CHECK_OK(fsdp_unit_pre_forward(inner[k], NULL));
    CHECK_OK(fsdp_op_linear(&o_, h, w[k], b[k]));
    h = keep(&pl, o_);
    CHECK_OK(fsdp_unit_post_forward(inner[k], true));
    CHECK(fsdp_unit_state_get(inner[k]) == FSDP_UNIT_SHARDED);
  }
  CHECK_OK(fsdp_op_linear(&o_, h, hw, hb));
  h = keep(&pl, o_);
  CHECK_OK(fsdp_unit_post_forward(root, true));
  CHECK(fsdp_unit_state_get(root) == FSDP_UNIT_GATHERED); /* the root stays for backward */
  CHECK_OK(fsdp_op_mse(&loss, h, tl));
  CHECK_OK(fsdp_backward(loss, NULL));
  fsdp_tensor_release(loss);
  pool_free(&pl);
  CHECK(peak(FSDP_ROLE_GATHERED) == (Pr + maxP) * 4);
  CHECK(live(FSDP_ROLE_GATHERED) == 0);
  CHECK(live(FSDP_ROLE_GRADS) == sumS * 4);
  /* grads peak as inner unit k reduces: the root's and k's full gradients and the gradient
   * shards made so far (units K-1 .. k), or as the root reduces last: its full gradient and
   * every shard */
  int64_t want = Pr + sumS, made = 0;
  for (int k = K - 1; k >= 0; k--) {
    made += S[k];
    if (Pr + P[k] + made > want) want = Pr + P[k] + made;
  }
  CHECK(peak(FSDP_ROLE_GRADS) == want * 4);
  CHECK(live(FSDP_ROLE_PARAMS) == sumS * 4);
  for (int k = 0; k < K; k++) {
    fsdp_unit_release(inner[k]);
    fsdp_tensor_release(w[k]);
    fsdp_tensor_release(b[k]);
  }
  fsdp_unit_release(root);
  fsdp_tensor_release(hw);
  fsdp_tensor_release(hb);
  fsdp_tensor_release(x);
  fsdp_tensor_release(xl);
  fsdp_tensor_release(t);
  fsdp_tensor_release(tl);
  return true;
}

static void test_memory(void **state) {
  (void)state;
  for (int W = 1; W <= MAXW; W++) run_ranks(W, rank_memory, NULL);
}

/* The gradient shard is made on first request (or backward): none after wrapping, zeros then;
 * when the memory cap leaves no room for it, the request fails naming the unit. */
static bool rank_grad_shard_lazy(rank_ctx *ctx) {
  fsdp_tensor *w = param_new("w", 2, SHAPE(32, 16));
  const char *path = "blocks.3.fc.weight";
  fsdp_unit *u;
  CHECK_OK(fsdp_unit_new(&u, ctx->comm, "blocks.3", &w, &path, 1, NULL));
  int64_t S = fsdp_unit_shard_numel(u);
  CHECK(live(FSDP_ROLE_GRADS) == 0);
  fsdp_mem_domain *d = fsdp_mem_domain_current();
  int64_t cap = fsdp_mem_get_limit(d);
  fsdp_mem_report r;
  fsdp_mem_report_get(d, &r);
  fsdp_mem_set_limit(d, r.counts[0].live_total + S * 4 - 1); /* one byte short */
  fsdp_tensor *g;
  CHECK(fsdp_unit_grad_shard(u, &g) == FSDP_ERR && g == NULL);
  CHECK(strstr(fsdp_error_msg(), "unit 'blocks.3': its gradient shard") != NULL);
  CHECK(live(FSDP_ROLE_GRADS) == 0);
  fsdp_mem_set_limit(d, cap);
  fsdp_error_clear();
  CHECK_OK(fsdp_unit_zero_grad(u)); /* nothing to zero yet */
  CHECK(live(FSDP_ROLE_GRADS) == 0);
  CHECK_OK(fsdp_unit_grad_shard(u, &g));
  CHECK(live(FSDP_ROLE_GRADS) == S * 4 && fsdp_tensor_numel(g) == S);
  for (int64_t i = 0; i < S; i++) CHECK(D(g)[i] == 0.0f);
  fsdp_tensor *g2;
  CHECK_OK(fsdp_unit_grad_shard(u, &g2));
  CHECK(g2 == g); /* the same tensor on every call */
  fsdp_tensor_release(g2);
  fsdp_tensor_release(g);
  fsdp_unit_release(u);
  fsdp_tensor_release(w);
  return true;
}

static void test_grad_shard_lazy(void **state) {
  (void)state;
  for (int W = 1; W <= 2; W++) run_ranks(W, rank_grad_shard_lazy, NULL);
}

/* ---- hooks without backward, no_grad, meta parameters, NONE --------------------------------- */

static bool rank_misc(rank_ctx *ctx) {
  int W = ctx->world;
  fsdp_tensor *w = param_new("w", 2, SHAPE(4, 4)), *m;
  CHECK_OK(fsdp_tensor_new(&m, &fsdp_device_meta, FSDP_DTYPE_F32, 1, SHAPE(20), FSDP_ROLE_PARAMS));
  m->requires_grad = true;
  m->is_param = true;
  fsdp_tensor *ps[2] = {w, m};
  const char *pp[2] = {"w", "m"};
  fsdp_unit_opts o = {.strategy = FSDP_STRATEGY_FULL, .is_root = true, .reshard_after_forward = true};
  fsdp_unit *u;
  CHECK_OK(fsdp_unit_new(&u, ctx->comm, "u", ps, pp, 2, &o));
  /* the meta parameter's part of the shard is zero, and sharded like any other */
  CHECK(m->storage->device == &fsdp_device_sharded);
  CHECK_OK(fsdp_unit_gather(u));
  for (int k = 0; k < 20; k++) CHECK(D(m)[k] == 0.0f);
  CHECK_OK(fsdp_unit_reshard(u));
  /* forward with gradients recorded, then the graph dropped without backward */
  fsdp_tensor *x = data_new("x", 3, 4), *y;
  CHECK_OK(fsdp_unit_pre_forward(u, NULL));
  CHECK(fsdp_tape_size() == 1 && fsdp_unit_pending_backward(u) == 1);
  CHECK_OK(fsdp_op_linear(&y, x, w, NULL));
  CHECK_OK(fsdp_unit_post_forward(u, true));
  CHECK(fsdp_tape_size() == 3);
  CHECK(fsdp_unit_state_get(u) == FSDP_UNIT_GATHERED); /* root: kept for backward */
  fsdp_tensor_release(y);
  fsdp_tape_clear();
  CHECK(fsdp_unit_pending_backward(u) == 0);
  /* under no_grad nothing is recorded and even the root reshards after forward */
  bool prev = fsdp_set_grad_enabled(false);
  CHECK_OK(fsdp_unit_pre_forward(u, NULL));
  CHECK_OK(fsdp_op_linear(&y, x, w, NULL));
  fsdp_tensor_release(y);
  CHECK_OK(fsdp_unit_post_forward(u, true));
  fsdp_set_grad_enabled(prev);
  CHECK(fsdp_tape_size() == 0 && fsdp_unit_pending_backward(u) == 0);
  CHECK(fsdp_unit_state_get(u) == FSDP_UNIT_SHARDED);
  /* gradients accumulate across backward calls until zero_grad */
  for (int s = 0; s < 2; s++) {
    fsdp_tensor *loss;
    CHECK_OK(fsdp_unit_pre_forward(u, NULL));
    CHECK_OK(fsdp_op_linear(&y, x, w, NULL));
    CHECK_OK(fsdp_unit_post_forward(u, true));
    CHECK_OK(fsdp_op_sum(&loss, y));
    fsdp_tensor_release(y);
    CHECK_OK(fsdp_backward(loss, NULL));
    fsdp_tensor_release(loss);
  }
  fsdp_tensor *gs;
  CHECK_OK(fsdp_unit_grad_shard(u, &gs));
  /* d sum(x w^T) / d w[i][j] = sum_b x[b][j]; twice; the same on every rank (same x) */
  for (int64_t j = 0; j < gs->shape[0]; j++) {
    int64_t f = fsdp_unit_shard_offset(u) + j;
    float want = 0;
    if (f < 16)
      for (int r = 0; r < 3; r++) want += 2 * D(x)[r * 4 + f % 4];
    CHECK(close_to(D(gs)[j], want, 1e-6f));
  }
  CHECK_OK(fsdp_unit_zero_grad(u));
  for (int64_t j = 0; j < gs->shape[0]; j++) CHECK(D(gs)[j] == 0.0f);
  /* An op outside the unit's forward uses its (root: still gathered) parameter: that op's
   * backward runs before the unit's "end" hook and leaves a gradient of its own, which must
   * join the unit's gradient. loss = sum(linear(linear(x, w), w)), the outer call outside. */
  fsdp_tensor *z, *loss, *wr;
  CHECK_OK(fsdp_unit_pre_forward(u, NULL));
  CHECK_OK(fsdp_tensor_clone(&wr, w)); /* the reference: the same values, unsharded */
  wr->requires_grad = true;
  CHECK_OK(fsdp_op_linear(&y, x, w, NULL));
  CHECK_OK(fsdp_unit_post_forward(u, true));
  CHECK_OK(fsdp_op_linear(&z, y, w, NULL));
  fsdp_tensor_release(y);
  CHECK_OK(fsdp_op_sum(&loss, z));
  fsdp_tensor_release(z);
  CHECK_OK(fsdp_backward(loss, NULL));
  fsdp_tensor_release(loss);
  CHECK_OK(fsdp_op_linear(&y, x, wr, NULL));
  CHECK_OK(fsdp_op_linear(&z, y, wr, NULL));
  fsdp_tensor_release(y);
  CHECK_OK(fsdp_op_sum(&loss, z));
  fsdp_tensor_release(z);
  CHECK_OK(fsdp_backward(loss, NULL));
  fsdp_tensor_release(loss);
  for (int64_t j = 0; j < gs->shape[0]; j++) {
    int64_t f = fsdp_unit_shard_offset(u) + j;
    CHECK(close_to(D(gs)[j], f < 16 ? D(wr->grad)[f] : 0.0f, 1e-6f));
  }
  CHECK(w->grad == NULL);
  fsdp_tensor_release(wr);
  CHECK_OK(fsdp_unit_zero_grad(u));
  fsdp_tensor_release(gs);
  (void)W;
  /* NONE: parameters view the shard itself; gather and reshard change nothing */
  fsdp_tensor *v = param_new("v", 1, SHAPE(5));
  const char *vp = "v";
  fsdp_unit *n;
  o.strategy = FSDP_STRATEGY_NONE;
  CHECK_OK(fsdp_unit_new(&n, ctx->comm, "n", &v, &vp, 1, &o));
  fsdp_tensor *sh;
  CHECK_OK(fsdp_unit_shard(n, &sh));
  CHECK(fsdp_unit_shard_numel(n) == fsdp_unit_padded_numel(n) && fsdp_unit_shard_offset(n) == 0);
  CHECK(fsdp_unit_state_get(n) == FSDP_UNIT_GATHERED && v->storage == sh->storage);
  CHECK_OK(fsdp_unit_reshard(n));
  CHECK(fsdp_unit_state_get(n) == FSDP_UNIT_GATHERED && D(v) == D(sh));
  D(sh)[2] = 42.0f; /* writes to the shard are the parameter's values */
  CHECK(D(v)[2] == 42.0f);
  CHECK(live(FSDP_ROLE_GATHERED) == 0);
  fsdp_tensor_release(sh);
  fsdp_unit_release(n);
  fsdp_tensor_release(v);
  fsdp_tensor_release(x);
  fsdp_unit_release(u);
  fsdp_tensor_release(w);
  fsdp_tensor_release(m);
  return true;
}

static void test_misc(void **state) {
  (void)state;
  for (int W = 1; W <= 3; W++) run_ranks(W, rank_misc, NULL);
}

/* ---- which parameters received a gradient ------------------------------------------------------ */

/* Root unit over w (4, 4), b (4), spare (3, never used), z (2, 4: used on rank 0 only, with an
 * all-zero input: its gradient is exactly zero, and still counts), q (4: used only by an op
 * after the unit's forward) and f (4: frozen). loss = sum(linear(x, w, b)) [+ sum(linear(0, z))
 * on rank 0] + sum(q * q). */
static bool rank_has_grad(rank_ctx *ctx) {
  enum { W_, B_, SPARE, Z, Q, F, N };
  fsdp_tensor *p[N] = {param_new("w", 2, SHAPE(4, 4)), param_new("b", 1, SHAPE(4)),
                       param_new("spare", 1, SHAPE(3)), param_new("z", 2, SHAPE(2, 4)),
                       param_new("q", 1, SHAPE(4)), param_new("f", 1, SHAPE(4))};
  const char *pp[N] = {"w", "b", "spare", "z", "q", "f"};
  p[F]->requires_grad = false;
  fsdp_unit_opts o = {.strategy = FSDP_STRATEGY_FULL, .is_root = true, .reshard_after_forward = true};
  fsdp_unit *u;
  CHECK_OK(fsdp_unit_new(&u, ctx->comm, "u", p, pp, N, &o));
  for (int i = 0; i < N; i++) CHECK(!fsdp_unit_param_has_grad(u, i)); /* nothing yet */
  CHECK(!fsdp_unit_param_has_grad(u, -1) && !fsdp_unit_param_has_grad(u, N));
  fsdp_tensor *x = data_new("x", 3, 4), *x0;
  CHECK_OK(fsdp_tensor_new_f32(&x0, 2, SHAPE(3, 4)));
  for (int step = 0; step < 3; step++) {
    bool use_z = step == 0 && ctx->rank == 0; /* step 1: nobody; step 2: after zero_grad */
    fsdp_tensor *y, *t, *l1, *l2, *qq, *loss;
    CHECK_OK(fsdp_unit_pre_forward(u, NULL));
    CHECK_OK(fsdp_op_linear(&y, x, p[W_], p[B_]));
    CHECK_OK(fsdp_op_sum(&loss, y));
    fsdp_tensor_release(y);
    if (use_z) {
      CHECK_OK(fsdp_op_linear(&t, x0, p[Z], NULL));
      CHECK_OK(fsdp_op_sum(&l1, t));
      fsdp_tensor_release(t);
      CHECK_OK(fsdp_op_binary(&l2, loss, l1, FSDP_OP_ADD));
      fsdp_tensor_release(l1);
      fsdp_tensor_release(loss);
      loss = l2;
    }
    CHECK_OK(fsdp_unit_post_forward(u, true));
    /* outside the unit's forward: the root is still gathered */
    CHECK_OK(fsdp_op_binary(&qq, p[Q], p[Q], FSDP_OP_MUL));
    CHECK_OK(fsdp_op_sum(&l1, qq));
    fsdp_tensor_release(qq);
    CHECK_OK(fsdp_op_binary(&l2, loss, l1, FSDP_OP_ADD));
    fsdp_tensor_release(l1);
    fsdp_tensor_release(loss);
    CHECK_OK(fsdp_backward(l2, NULL));
    fsdp_tensor_release(l2);
    CHECK(fsdp_unit_param_has_grad(u, W_) && fsdp_unit_param_has_grad(u, B_));
    CHECK(fsdp_unit_param_has_grad(u, Q));
    CHECK(!fsdp_unit_param_has_grad(u, SPARE) && !fsdp_unit_param_has_grad(u, F));
    /* this rank's own answer: z got its (zero) gradient on rank 0, and keeps it until zero_grad */
    CHECK(fsdp_unit_param_has_grad(u, Z) == (step < 2 && ctx->rank == 0));
    if (step == 1) CHECK_OK(fsdp_unit_zero_grad(u));
    if (step == 1)
      for (int i = 0; i < N; i++) CHECK(!fsdp_unit_param_has_grad(u, i));
  }
  /* z's shard slice is exactly zero: only the flag tells its gradient from none */
  fsdp_tensor *gs;
  CHECK_OK(fsdp_unit_grad_shard(u, &gs));
  int64_t pf, sf, len = fsdp_unit_param_slice(u, Z, ctx->rank, &pf, &sf);
  for (int64_t k = 0; k < len; k++) CHECK(D(gs)[sf + k] == 0.0f);
  fsdp_tensor_release(gs);
  fsdp_tensor_release(x);
  fsdp_tensor_release(x0);
  fsdp_unit_release(u);
  for (int i = 0; i < N; i++) fsdp_tensor_release(p[i]);
  return true;
}

static void test_has_grad(void **state) {
  (void)state;
  for (int W = 1; W <= 3; W++) run_ranks(W, rank_has_grad, NULL);
}

/* ---- gradient sync off (fsdp.no_sync) --------------------------------------------------------- */

/* One forward + backward of loss = sum(linear(x, w)) through unit u. */
static bool sum_linear_backward(fsdp_unit *u, fsdp_tensor *x, fsdp_tensor *w) {
  fsdp_tensor *y, *loss;
  CHECK_OK(fsdp_unit_pre_forward(u, NULL));
  CHECK_OK(fsdp_op_linear(&y, x, w, NULL));
  CHECK_OK(fsdp_unit_post_forward(u, true));
  CHECK_OK(fsdp_op_sum(&loss, y));
  fsdp_tensor_release(y);
  CHECK_OK(fsdp_backward(loss, NULL));
  fsdp_tensor_release(loss);
  return true;
}

/* The gradient shard is `times` x d sum(x w^T) / dw (the same x on every rank). */
static bool grad_is(fsdp_unit *u, fsdp_tensor *x, int times) {
  fsdp_tensor *gs;
  CHECK_OK(fsdp_unit_grad_shard(u, &gs));
  for (int64_t j = 0; j < gs->shape[0]; j++) {
    int64_t f = fsdp_unit_shard_offset(u) + j;
    float want = 0;
    if (f < 16)
      for (int r = 0; r < 3; r++) want += (float)times * D(x)[r * 4 + f % 4];
    CHECK(close_to(D(gs)[j], want, 1e-6f));
  }
  fsdp_tensor_release(gs);
  return true;
}

static int64_t reduced_bytes(fsdp_comm *c) {
  fsdp_comm_stats st;
  fsdp_comm_get_stats(c, &st);
  return st.bytes[FSDP_COLL_REDUCE_SCATTER] + st.bytes[FSDP_COLL_ALL_REDUCE];
}

/* A tape hook that calls fsdp_unit_reduce_held (or zero_grad) while the unit's backward is
 * under way: pushed between the unit's pre_forward and its op, it runs after the op's
 * backward and before the unit's "begin" hook. */
typedef struct {
  fsdp_unit *u;
  bool zero;
  int rc;
  char msg[256];
} probe_ud;

static int probe_in_backward(void *ud) {
  probe_ud *p = ud;
  p->rc = p->zero ? fsdp_unit_zero_grad(p->u) : fsdp_unit_reduce_held(p->u);
  snprintf(p->msg, sizeof p->msg, "%s", p->rc ? fsdp_error_msg() : "");
  return FSDP_OK;
}

/* sum_linear_backward with the probe inside the unit's backward */
static bool probed_backward(fsdp_unit *u, fsdp_tensor *x, fsdp_tensor *w, probe_ud *probe) {
  fsdp_tensor *y, *loss;
  CHECK_OK(fsdp_unit_pre_forward(u, NULL));
  CHECK_OK(fsdp_tape_hook(probe_in_backward, probe, NULL));
  CHECK_OK(fsdp_op_linear(&y, x, w, NULL));
  CHECK_OK(fsdp_unit_post_forward(u, true));
  CHECK_OK(fsdp_op_sum(&loss, y));
  fsdp_tensor_release(y);
  CHECK_OK(fsdp_backward(loss, NULL));
  fsdp_tensor_release(loss);
  return true;
}

static bool rank_grad_sync(rank_ctx *ctx) {
  static const fsdp_strategy strategies[] = {FSDP_STRATEGY_FULL, FSDP_STRATEGY_GRAD_OP,
                                             FSDP_STRATEGY_NONE};
  for (int k = 0; k < 3; k++) {
    fsdp_tensor *w = param_new("w", 2, SHAPE(4, 4)), *x = data_new("x", 3, 4);
    const char *pp[1] = {"w"};
    fsdp_unit_opts o = {.strategy = strategies[k], .is_root = true, .reshard_after_forward = true};
    fsdp_unit *u;
    CHECK_OK(fsdp_unit_new(&u, ctx->comm, "u", &w, pp, 1, &o));
    CHECK(fsdp_unit_grad_sync(u) && !fsdp_unit_grad_unreduced(u));
    int64_t P = fsdp_unit_padded_numel(u) * 4, grads0 = live(FSDP_ROLE_GRADS);
    /* sync off: two backwards reduce nothing and hold the full gradient (P bytes); the
     * parameter keeps no .grad and reshards as usual */
    fsdp_unit_set_grad_sync(u, false);
    fsdp_comm_reset_stats(ctx->comm);
    for (int s = 0; s < 2; s++) CHECK(sum_linear_backward(u, x, w));
    CHECK(reduced_bytes(ctx->comm) == 0);
    CHECK(fsdp_unit_grad_unreduced(u) && !fsdp_unit_grad_sync(u));
    CHECK(live(FSDP_ROLE_GRADS) - grads0 == P);
    CHECK(w->grad == NULL);
    CHECK(fsdp_unit_param_has_grad(u, 0));
    if (strategies[k] != FSDP_STRATEGY_NONE) CHECK(fsdp_unit_state_get(u) == FSDP_UNIT_SHARDED);
    /* a graph dropped without backward leaves the held gradient alone */
    fsdp_tensor *y;
    CHECK_OK(fsdp_unit_pre_forward(u, NULL));
    CHECK_OK(fsdp_op_linear(&y, x, w, NULL));
    CHECK_OK(fsdp_unit_post_forward(u, true));
    fsdp_tensor_release(y);
    fsdp_tape_clear();
    CHECK(fsdp_unit_grad_unreduced(u) && live(FSDP_ROLE_GRADS) - grads0 == P);
    /* sync on: the third backward reduces the sum of all three once, and frees the buffer */
    fsdp_unit_set_grad_sync(u, true);
    CHECK(sum_linear_backward(u, x, w));
    CHECK(reduced_bytes(ctx->comm) == P);
    CHECK(!fsdp_unit_grad_unreduced(u));
    CHECK(grad_is(u, x, 3));
    int64_t shards = live(FSDP_ROLE_GRADS); /* the gradient shard, made by that backward */
    /* zero_grad drops a held gradient: what follows counts one backward only */
    CHECK_OK(fsdp_unit_zero_grad(u));
    fsdp_unit_set_grad_sync(u, false);
    CHECK(sum_linear_backward(u, x, w));
    CHECK(live(FSDP_ROLE_GRADS) - shards == P);
    CHECK_OK(fsdp_unit_zero_grad(u));
    CHECK(!fsdp_unit_grad_unreduced(u) && live(FSDP_ROLE_GRADS) == shards);
    CHECK(!fsdp_unit_param_has_grad(u, 0));
    fsdp_unit_set_grad_sync(u, true);
    CHECK(sum_linear_backward(u, x, w));
    CHECK(grad_is(u, x, 1));
    /* reduce_held reduces what a backward with sync off left (an optimizer step after a layer
     * dropped from the last backward), once */
    fsdp_unit_set_grad_sync(u, false);
    CHECK(sum_linear_backward(u, x, w));
    fsdp_unit_set_grad_sync(u, true);
    fsdp_comm_reset_stats(ctx->comm);
    CHECK_OK(fsdp_unit_reduce_held(u));
    CHECK_OK(fsdp_unit_reduce_held(u)); /* nothing held: nothing reduced */
    CHECK(reduced_bytes(ctx->comm) == P && !fsdp_unit_grad_unreduced(u));
    CHECK(live(FSDP_ROLE_GRADS) == shards);
    CHECK(grad_is(u, x, 2));
    /* ... but not while a backward is inside the unit (its gradient is still accumulating) */
    fsdp_unit_set_grad_sync(u, false);
    CHECK(sum_linear_backward(u, x, w));
    probe_ud probe = {.u = u};
    CHECK(probed_backward(u, x, w, &probe));
    CHECK(probe.rc == FSDP_ERR && strstr(probe.msg, "reduce_held: unit 'u' is inside a backward"));
    CHECK(fsdp_unit_grad_unreduced(u));
    CHECK_OK(fsdp_unit_reduce_held(u));
    CHECK(grad_is(u, x, 4)); /* both backwards of the held gradient, nothing lost */
    /* zero_grad inside a backward zeroes the held buffer in place (the backward still writes
     * into it): what the backward added before it is gone, the buffer stays held */
    CHECK(sum_linear_backward(u, x, w));
    probe_ud zero = {.u = u, .zero = true};
    CHECK(probed_backward(u, x, w, &zero));
    CHECK(zero.rc == FSDP_OK && fsdp_unit_grad_unreduced(u));
    CHECK(live(FSDP_ROLE_GRADS) - shards == P);
    CHECK_OK(fsdp_unit_reduce_held(u));
    CHECK(grad_is(u, x, 0));
    fsdp_unit_set_grad_sync(u, true);
    /* unshard drops a held gradient too */
    fsdp_unit_set_grad_sync(u, false);
    CHECK(sum_linear_backward(u, x, w));
    CHECK_OK(fsdp_unit_unshard(u));
    CHECK(!fsdp_unit_grad_unreduced(u) && w->grad == NULL);
    fsdp_unit_release(u);
    fsdp_tensor_release(w);
    fsdp_tensor_release(x);
    CHECK(live(FSDP_ROLE_GRADS) == grads0);
  }
  return true;
}

static void test_grad_sync(void **state) {
  (void)state;
  for (int W = 1; W <= 3; W++) run_ranks(W, rank_grad_sync, NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layout),
      cmocka_unit_test(test_shard_gather),
      cmocka_unit_test(test_layout_mismatch),
      cmocka_unit_test(test_model_full),
      cmocka_unit_test(test_model_grad_op),
      cmocka_unit_test(test_model_none),
      cmocka_unit_test(test_module_called_twice),
      cmocka_unit_test(test_ancestor_param_in_inner_unit),
      cmocka_unit_test(test_prefetch_overlap),
      cmocka_unit_test(test_reduce_overlap),
      cmocka_unit_test(test_reduce_overlap_failure),
      cmocka_unit_test(test_stale_prefetch),
      cmocka_unit_test(test_prefetch_after_root),
      cmocka_unit_test(test_frozen_passthrough),
      cmocka_unit_test(test_memory),
      cmocka_unit_test(test_grad_shard_lazy),
      cmocka_unit_test(test_misc),
      cmocka_unit_test(test_has_grad),
      cmocka_unit_test(test_grad_sync),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
