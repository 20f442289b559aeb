/*
 * mask.c — masks and magnitude pruning (mask.h): argument checks around the kernel table's mask
 * slots, and the radix selection of the k smallest elements of groups spread over ranks.
 */
#include <stdlib.h>
#include <string.h>

#include "fsdp/mask.h"
#include "kernels/kernels.h"

/* A tensor argument: t contiguous, d its data (NULL without elements), n its length, idx its
 * position (1-based) for messages. */
typedef struct {
  const fsdp_tensor *t;
  void *d;
  int64_t n;
  int idx;
} operand;

/* Check t as argument idx of fn; `like` (NULL for the first tensor): the device and dtype it
 * must share. t NULL is an absent optional mask: o->d NULL, o->n = like's length. */
static int operand_of(operand *o, const fsdp_tensor *t, int idx, const char *fn,
                      const operand *like) {
  *o = (operand){t, NULL, like ? like->n : 0, idx};
  if (t == NULL) return FSDP_OK;
  if (!fsdp_tensor_is_contiguous(t))
    return fsdp_error("%s: argument #%d must be contiguous (got shape %s)", fn, idx,
                      FSDP_SHAPE_STR(t));
  if (like && t->storage->device != like->t->storage->device)
    return fsdp_error("%s: argument #%d is on the %s device, argument #%d on %s (one device per "
                      "call)",
                      fn, idx, t->storage->device->name, like->idx,
                      like->t->storage->device->name);
  if (like && t->dtype != like->t->dtype)
    return fsdp_error("%s: argument #%d is %s, argument #%d %s (one dtype per call)", fn, idx,
                      fsdp_dtype_name(t->dtype), like->idx, fsdp_dtype_name(like->t->dtype));
  o->n = fsdp_tensor_numel(t);
  if (o->n > 0 && !(o->d = fsdp_tensor_data(t, fn))) return FSDP_ERR;
  return FSDP_OK;
}

/* The values x and their optional mask m (arguments ix and ix + 1), same length. */
static int values_and_mask(operand *x, operand *m, const fsdp_tensor *xt, const fsdp_tensor *mt,
                           int ix, const char *fn, const operand *like) {
  if (operand_of(x, xt, ix, fn, like) || operand_of(m, mt, ix + 1, fn, x)) return FSDP_ERR;
  if (m->n != x->n)
    return fsdp_error("%s: the mask has %lld elements, the values %lld", fn, (long long)m->n,
                      (long long)x->n);
  return FSDP_OK;
}

static int same_len(const char *fn, const operand *a, const operand *b) {
  if (a->n == b->n) return FSDP_OK;
  return fsdp_error("%s: the tensors have %lld and %lld elements", fn, (long long)a->n,
                    (long long)b->n);
}

/* The kernel table of the values' device, or NULL: *skip when there is nothing to compute (no
 * elements: every result is empty or 0, and no data is needed), an error otherwise. */
static const fsdp_kernels_i *kernels(const operand *x, const char *fn, bool *skip) {
  *skip = x->n == 0;
  return *skip ? NULL : fsdp_kernels_for(x->t, fn);
}

/* The operand of fn(a) and the kernels: FSDP_OK with *k, or with *skip when there are no
 * elements. */
static int one_of(operand *a, const fsdp_tensor *at, const char *fn, const fsdp_kernels_i **k,
                  bool *skip) {
  if (operand_of(a, at, 1, fn, NULL)) return FSDP_ERR;
  *k = kernels(a, fn, skip);
  return *skip || *k ? FSDP_OK : FSDP_ERR;
}

/* The same for fn(a, b): arguments 1 and 2, the same length. */
static int pair_of(operand *a, operand *b, const fsdp_tensor *at, const fsdp_tensor *bt,
                   const char *fn, const fsdp_kernels_i **k, bool *skip) {
  if (operand_of(a, at, 1, fn, NULL) || operand_of(b, bt, 2, fn, a) || same_len(fn, a, b))
    return FSDP_ERR;
  *k = kernels(a, fn, skip);
  return *skip || *k ? FSDP_OK : FSDP_ERR;
}

/* The same for fn(out, x, m|NULL, ...): an output, the values and their optional mask. */
static int out_of(operand *o, operand *x, operand *m, const fsdp_tensor *ot,
                  const fsdp_tensor *xt, const fsdp_tensor *mt, const char *fn,
                  const fsdp_kernels_i **k, bool *skip) {
  if (operand_of(o, ot, 1, fn, NULL) || values_and_mask(x, m, xt, mt, 2, fn, o) ||
      same_len(fn, o, x))
    return FSDP_ERR;
  *k = kernels(x, fn, skip);
  return *skip || *k ? FSDP_OK : FSDP_ERR;
}

/* the kernel's status; t's version bumped when it wrote (or had nothing to write) */
static int wrote(fsdp_tensor *t, int rc) {
  if (rc) return FSDP_ERR;
  fsdp_tensor_written(t);
  return FSDP_OK;
}

#define CTX(o) ((o)->t->storage->device->ctx)

int fsdp_mask_apply(fsdp_tensor *x, const fsdp_tensor *m) {
  operand xo, mo;
  const fsdp_kernels_i *k;
  bool skip;
  if (pair_of(&xo, &mo, x, m, "mask_apply", &k, &skip)) return FSDP_ERR;
  return wrote(x, !skip && k->mask_apply(CTX(&xo), x->dtype, xo.d, mo.d, xo.n));
}

int fsdp_mask_count_zeros(const fsdp_tensor *x, int64_t *zeros) {
  operand xo;
  const fsdp_kernels_i *k;
  bool skip;
  *zeros = 0;
  if (one_of(&xo, x, "count_zeros", &k, &skip)) return FSDP_ERR;
  return skip ? FSDP_OK : k->count_zeros(CTX(&xo), x->dtype, zeros, xo.d, xo.n);
}

int fsdp_mask_check(const fsdp_tensor *m, int64_t *bad, int64_t *zeros, uint32_t *hash) {
  operand mo;
  const fsdp_kernels_i *k;
  bool skip;
  *bad = *zeros = 0;
  *hash = 2166136261u; /* FNV-1a of no positions */
  if (one_of(&mo, m, "mask_check", &k, &skip)) return FSDP_ERR;
  return skip ? FSDP_OK : k->mask_check(CTX(&mo), m->dtype, bad, zeros, hash, mo.d, mo.n);
}

int fsdp_mask_from_nonzero(fsdp_tensor *mout, const fsdp_tensor *x, int64_t *zeros) {
  operand oo, xo;
  const fsdp_kernels_i *k;
  bool skip;
  *zeros = 0;
  if (pair_of(&oo, &xo, mout, x, "mask_from_nonzero", &k, &skip)) return FSDP_ERR;
  return wrote(mout,
               !skip && k->mask_from_nonzero(CTX(&xo), x->dtype, oo.d, zeros, xo.d, xo.n));
}

int fsdp_mask_select(fsdp_tensor *mout, const fsdp_tensor *x, const fsdp_tensor *m, uint32_t T,
                     uint64_t gbase, uint64_t P, int64_t *pruned) {
  operand oo, xo, mo;
  const fsdp_kernels_i *k;
  bool skip;
  *pruned = 0;
  if (out_of(&oo, &xo, &mo, mout, x, m, "mask_select", &k, &skip)) return FSDP_ERR;
  return wrote(mout, !skip && k->mask_select(CTX(&xo), x->dtype, oo.d, pruned, xo.d, mo.d, xo.n,
                                             T, gbase, P));
}

int fsdp_mask_nm(fsdp_tensor *mout, const fsdp_tensor *x, const fsdp_tensor *m, int64_t keep,
                 int64_t M, int64_t lead, int64_t *groups) {
  const char *fn = "mask_nm";
  operand oo, xo, mo;
  const fsdp_kernels_i *k;
  bool skip;
  *groups = 0;
  if (M < 1 || M > 4096 || keep < 0 || keep > M)
    return fsdp_error("%s: need 0 <= n <= m <= 4096 (got n = %lld, m = %lld)", fn,
                      (long long)keep, (long long)M);
  if (lead < 0) return fsdp_error("%s: lead must be >= 0", fn);
  if (out_of(&oo, &xo, &mo, mout, x, m, fn, &k, &skip)) return FSDP_ERR;
  return wrote(mout, !skip && k->mask_nm(CTX(&xo), x->dtype, oo.d, groups, xo.d, mo.d, xo.n,
                                         keep, M, lead));
}

int fsdp_mask_values(fsdp_tensor *out, const fsdp_tensor *x, const fsdp_tensor *m) {
  operand oo, xo, mo;
  const fsdp_kernels_i *k;
  bool skip;
  if (out_of(&oo, &xo, &mo, out, x, m, "mask_values", &k, &skip)) return FSDP_ERR;
  return wrote(out, !skip && k->mask_values(CTX(&xo), x->dtype, oo.d, xo.d, mo.d, xo.n));
}

/* ---- selection ---------------------------------------------------------------------------- */

/* {shift, width} of each pass: keys have 32 bits, positions fewer than 33 */
static const int KEY_PASSES[3][2] = {{21, 11}, {10, 11}, {0, 10}};
static const int POS_PASSES[3][2] = {{22, 11}, {11, 11}, {0, 11}};
#define MAX_BUCKETS 2048 /* 2^11 */

/* Per group during a selection. */
typedef struct {
  bool active;   /* still narrowing down */
  int64_t rem;   /* rank within what prefix selects of the element sought (1-based) */
  int64_t last;  /* elements equal to the value found so far */
  uint64_t prefix;
} state;

/* One piece's histogram, added into h: of its keys (pos false) or of the positions of its
 * elements of key T. */
static int piece_hist(int64_t *h, const fsdp_prune_piece *pc, int i, bool pos, uint32_t T,
                      uint64_t prefix, int shift, int width) {
  const char *fn = pos ? "mask_hist_pos" : "mask_hist";
  operand xo, mo;
  bool skip = false;
  const fsdp_kernels_i *k = NULL;
  int rc = values_and_mask(&xo, &mo, pc->x, pc->m, 1, fn, NULL) ||
           (!(k = kernels(&xo, fn, &skip)) && !skip);
  if (!rc && !skip)
    rc = pos ? k->mask_hist_pos(CTX(&xo), pc->x->dtype, h, xo.d, mo.d, xo.n, T, pc->gbase,
                                prefix, shift, width)
             : k->mask_hist(CTX(&xo), pc->x->dtype, h, xo.d, mo.d, xo.n, prefix, shift, width);
  return rc ? fsdp_error_context("piece %d", i + 1) : FSDP_OK;
}

/* The passes over every active group: on return each active group's prefix is the value
 * sought (key, or position among the elements of key T), rem what is left of its rank within
 * the elements equal to it, last how many those are. h holds ngroups x 2^11 counts. */
static int radix(fsdp_prune_group *g, state *st, int ngroups, int64_t *h, bool pos,
                 fsdp_comm *comm, const char *label) {
  const int (*passes)[2] = pos ? POS_PASSES : KEY_PASSES;
  for (int gi = 0; gi < ngroups; gi++) st[gi].prefix = 0;
  for (int p = 0; p < 3; p++) {
    int shift = passes[p][0], width = passes[p][1];
    int64_t nb = (int64_t)1 << width;
    memset(h, 0, (size_t)(ngroups * nb) * sizeof *h);
    for (int gi = 0; gi < ngroups; gi++) {
      if (!st[gi].active) continue;
      for (int i = 0; i < g[gi].npieces; i++) {
        const fsdp_prune_piece *pc = &g[gi].pieces[i];
        if (pc->counts &&
            piece_hist(h + gi * nb, pc, i, pos, g[gi].T, st[gi].prefix, shift, width))
          return fsdp_error_context("%s: group %d", label, gi + 1);
      }
    }
    /* every rank sums, active groups or not: the same collective on every rank */
    if (comm && fsdp_comm_all_reduce(comm, h, ngroups * nb, FSDP_DTYPE_I64, FSDP_RED_SUM, label))
      return FSDP_ERR;
    for (int gi = 0; gi < ngroups; gi++) {
      if (!st[gi].active) continue;
      const int64_t *hg = h + gi * nb;
      int64_t cum = 0, b = 0;
      while (b < nb && cum + hg[b] < st[gi].rem) cum += hg[b++];
      if (b == nb)
        return fsdp_error("%s: group %d has %lld elements fewer than the %lld to select", label,
                          gi + 1, (long long)(st[gi].rem - cum), (long long)g[gi].k);
      st[gi].rem -= cum;
      st[gi].prefix = (st[gi].prefix << width) | (uint64_t)b;
      st[gi].last = hg[b];
    }
  }
  return FSDP_OK;
}

int fsdp_prune_select(fsdp_prune_group *groups, int ngroups, fsdp_comm *comm,
                      const char *label) {
  if (label == NULL) label = "prune";
  if (ngroups < 0 || (ngroups > 0 && groups == NULL))
    return fsdp_error("%s: %d groups at %p", label, ngroups, (void *)groups);
  for (int gi = 0; gi < ngroups; gi++)
    if (groups[gi].k < 0 || groups[gi].npieces < 0 ||
        (groups[gi].npieces > 0 && groups[gi].pieces == NULL))
      return fsdp_error("%s: group %d: k %lld with %d pieces", label, gi + 1,
                        (long long)groups[gi].k, groups[gi].npieces);
  /* ngroups x 2^11 counts, and the states (at least one of each: malloc(0) may be NULL) */
  int64_t *h = malloc((size_t)(ngroups > 0 ? ngroups : 1) * MAX_BUCKETS * sizeof *h);
  state *st = calloc((size_t)(ngroups > 0 ? ngroups : 1), sizeof *st);
  int rc = FSDP_ERR;
  if (h == NULL || st == NULL) {
    fsdp_error("%s: out of memory for the histograms of %d groups", label, ngroups);
    goto done;
  }
  for (int gi = 0; gi < ngroups; gi++) {
    st[gi].active = groups[gi].k > 0;
    st[gi].rem = groups[gi].k;
    groups[gi].T = 0;
    groups[gi].P = 0; /* k == 0: nothing is selected */
  }
  if (radix(groups, st, ngroups, h, false, comm, label)) goto done;
  bool need_pos = false;
  for (int gi = 0; gi < ngroups; gi++) {
    if (!st[gi].active) continue;
    groups[gi].T = (uint32_t)st[gi].prefix;
    if (st[gi].rem < st[gi].last) { /* only part of the elements of key T go: by position */
      need_pos = true;
    } else {
      st[gi].active = false;
      groups[gi].P = (uint64_t)1 << 53; /* every element of key T goes */
    }
  }
  /* need_pos is the same on every rank: it follows from the summed histograms */
  if (need_pos) {
    if (radix(groups, st, ngroups, h, true, comm, label)) goto done;
    for (int gi = 0; gi < ngroups; gi++)
      if (st[gi].active) groups[gi].P = st[gi].prefix + 1;
  }
  rc = FSDP_OK;
done:
  free(h);
  free(st);
  return rc;
}
