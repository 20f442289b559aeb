/*
 * l_mask.c — per-element helpers of masks and pruning (lua/fsdp/mask.lua, lua/fsdp/prune.lua)
 * as functions of the `fsdp.core` module. docs/pruning.md is the manual.
 *
 * Everything here works on ONE rank's 1-D contiguous views (a parameter flattened, or a slice
 * of a unit's flat shard), all on one device and of one dtype: the Lua layer decides which
 * slices and when to communicate, the device's kernel table (kernels/kernels.h, "masks")
 * computes. The one collective here is counts_all_reduce (an i64 sum of a histogram).
 *
 * Pruning order (the kernels' key). Magnitude pruning removes the k elements with the smallest
 * keys, where an element's key is a 32-bit unsigned integer:
 *     key = 0                                  when a mask is given and masks it (m == 0)
 *     key = (bits of |x| as a float) + 1       otherwise
 * Non-negative floats order like their bit patterns, so keys order like magnitudes, with masked
 * elements below every live one (a weight already pruned stays pruned first; a NaN sorts above
 * +inf). Equal keys are ordered by the element's global position (a number the Lua layer gives
 * as `gbase`, the position of the view's first element, 0-based; positions never depend on how
 * the model is sharded). So the selection is a total order, the same at any world size.
 * The k-th key is found by radix selection over histograms (mask_hist: 11 bits at a time), the
 * k-th position among the elements equal to it likewise (mask_hist_pos), and mask_select then
 * writes the mask.
 *
 * Histograms are int64 counts in a `counts` buffer (core.counts(n): n zeros), bucket b of a
 * histogram at offset off in out[off + b]; counts_all_reduce sums a buffer across ranks as i64
 * (exact at any count) and counts_totable reads it.
 *
 * N:M along a row: mask_nm keeps the n largest of each group of m consecutive elements, by the
 * value v = -1 for a masked element, +inf for a NaN, |x| otherwise; among equal values the lower
 * index goes first (the order of magnitude pruning: by value, then position).
 * mask_values writes those v for the groups a shard boundary cuts (Lua gathers them).
 *
 *   mask_apply(x, m)                        x[i] = 0 where m[i] == 0 (in place; exact +0)
 *   count_zeros(x) -> n                     elements equal to 0 (+0 or -0)
 *   mask_check(m) -> bad, zeros, hash       values other than 0/1; zeros; a 32-bit hash of the
 *                                           zero positions (ranks compare it)
 *   mask_from_nonzero(mout, x) -> zeros     mout[i] = (x[i] != 0)
 *   counts(n) -> out                        n int64 zeros
 *   counts_all_reduce(out [, label])        collective: sum across ranks (i64), in place
 *   counts_totable(out) -> {n numbers}
 *   mask_hist(out, off, x, m|nil, prefix, shift, width)
 *   mask_hist_pos(out, off, x, m|nil, T, gbase, prefix, shift, width)
 *   mask_select(mout, x, m|nil, T, gbase, P) -> zeros
 *                                           mout[i] = 0 when key < T, or key == T and
 *                                           gbase + i < P; else 1 (mout may be m itself:
 *                                           element i is read before it is written)
 *   mask_nm(mout, x, m|nil, n, M, lead) -> groups
 *                                           full groups of M starting at index `lead` (0-based);
 *                                           elements before it and a trailing partial group are
 *                                           left as they are
 *   mask_values(out, x, m|nil)              out[i] = v (see above)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "comm/comm.h"
#include "kernels/kernels.h"
#include "lua/binding.h"

#define COUNTS_MT "fsdp.counts"

typedef struct counts_buf {
  int64_t n;
  int64_t v[];
} counts_buf;

/* A tensor argument: contiguous; d is its data on its device (NULL when it has no elements). */
typedef struct {
  fsdp_tensor *t;
  void *d;
  int64_t n;
  int idx; /* its argument position, for messages */
} operand;

/* The tensor at idx, or a Lua error naming fn. `like` (the first tensor argument, or NULL):
 * the device and the dtype every other tensor argument must share (the kernels refuse the
 * dtypes they lack: the cpu computes masks in f32). */
static operand arg(lua_State *L, int idx, const char *fn, const operand *like) {
  fsdp_tensor *t = fsdp_lua_to_tensor(L, idx);
  if (!t)
    luaL_error(L, "bad argument #%d to '%s' (tensor expected, got %s)", idx, fn,
               luaL_typename(L, idx));
  if (!fsdp_tensor_is_contiguous(t))
    luaL_error(L, "%s: argument #%d must be contiguous (got shape %s)", fn, idx,
               FSDP_SHAPE_STR(t));
  if (like && t->storage->device != like->t->storage->device)
    luaL_error(L, "%s: argument #%d is on the %s device, argument #%d on %s (one device per "
               "call)", fn, idx, t->storage->device->name, like->idx,
               like->t->storage->device->name);
  if (like && t->dtype != like->t->dtype)
    luaL_error(L, "%s: argument #%d is %s, argument #%d %s (one dtype per call)", fn, idx,
               fsdp_dtype_name(t->dtype), like->idx, fsdp_dtype_name(like->t->dtype));
  operand o = {t, NULL, fsdp_tensor_numel(t), idx};
  if (o.n > 0 && !(o.d = fsdp_tensor_data(t, fn))) fsdp_lua_error(L);
  return o;
}

/* An optional mask argument: NULL data when nil; otherwise its length must be the values'. */
static operand opt_mask(lua_State *L, int idx, const char *fn, const operand *x) {
  if (lua_isnoneornil(L, idx)) return (operand){NULL, NULL, x->n, idx};
  operand m = arg(L, idx, fn, x);
  if (m.n != x->n)
    luaL_error(L, "%s: the mask has %d elements, the values %d", fn, (int)m.n, (int)x->n);
  return m;
}

static void same_len(lua_State *L, const char *fn, int64_t a, int64_t b) {
  if (a != b) luaL_error(L, "%s: the tensors have %d and %d elements", fn, (int)a, (int)b);
}

/* The kernel table of the values' device; NULL when there is nothing to compute (no elements:
 * every result is empty or 0, and no data is needed). */
static const fsdp_kernels_i *kernels(lua_State *L, const char *fn, const operand *x) {
  if (x->n == 0) return NULL;
  const fsdp_kernels_i *k = fsdp_kernels_for(x->t, fn);
  if (!k) fsdp_lua_error(L);
  return k;
}

#define CTX(o) ((o)->t->storage->device->ctx)

/* a kernel call's status: a Lua error with the engine's message when it failed */
static void check(lua_State *L, int rc) {
  if (rc) fsdp_lua_error(L);
}

static int width_arg(lua_State *L, int idx, const char *fn) {
  lua_Integer w = luaL_checkinteger(L, idx);
  if (w < 1 || w > 16) luaL_error(L, "%s: width must be 1..16 bits (got %d)", fn, (int)w);
  return (int)w;
}

/* ---- counts buffers -------------------------------------------------------------------- */

static counts_buf *counts_arg(lua_State *L, int idx, const char *fn) {
  counts_buf *b = luaL_testudata(L, idx, COUNTS_MT);
  if (!b)
    luaL_error(L, "bad argument #%d to '%s' (counts expected, got %s)", idx, fn,
               luaL_typename(L, idx));
  return b;
}

static int l_counts(lua_State *L) {
  lua_Number n = luaL_checknumber(L, 1);
  if (n < 0 || n != floor(n) || n > (lua_Number)(1 << 28))
    luaL_error(L, "counts: size must be an integer in [0, 2^28] (got %f)", (double)n);
  counts_buf *b = lua_newuserdata(L, sizeof *b + (size_t)n * sizeof b->v[0]);
  b->n = (int64_t)n;
  memset(b->v, 0, (size_t)n * sizeof b->v[0]);
  luaL_getmetatable(L, COUNTS_MT);
  lua_setmetatable(L, -2);
  return 1;
}

static int l_counts_all_reduce(lua_State *L) {
  counts_buf *b = counts_arg(L, 1, "counts_all_reduce");
  const char *label = luaL_optstring(L, 2, "counts");
  fsdp_comm *c = fsdp_comm_current();
  if (!c || fsdp_comm_all_reduce(c, b->v, b->n, FSDP_DTYPE_I64, FSDP_RED_SUM, label))
    fsdp_lua_error(L);
  return 0;
}

static int l_counts_totable(lua_State *L) {
  counts_buf *b = counts_arg(L, 1, "counts_totable");
  lua_createtable(L, (int)b->n, 0);
  for (int64_t i = 0; i < b->n; i++) {
    lua_pushnumber(L, (lua_Number)b->v[i]);
    lua_rawseti(L, -2, (int)i + 1);
  }
  return 1;
}

/* The histogram of nb buckets at (idx, idx + 1): a counts buffer and a 0-based offset; the
 * kernels add into it. */
static int64_t *hist_at(lua_State *L, int idx, const char *fn, int64_t nb) {
  counts_buf *b = counts_arg(L, idx, fn);
  lua_Number off = luaL_checknumber(L, idx + 1);
  if (off < 0 || off != floor(off) || off + (lua_Number)nb > (lua_Number)b->n)
    luaL_error(L, "%s: a histogram of %d buckets at offset %f does not fit %d counts", fn,
               (int)nb, (double)off, (int)b->n);
  return b->v + (int64_t)off;
}

/* ---- masks ------------------------------------------------------------------------------- */

static int l_mask_apply(lua_State *L) {
  const char *fn = "mask_apply";
  operand x = arg(L, 1, fn, NULL), m = arg(L, 2, fn, &x);
  same_len(L, fn, x.n, m.n);
  const fsdp_kernels_i *k = kernels(L, fn, &x);
  if (k) check(L, k->mask_apply(CTX(&x), x.t->dtype, x.d, m.d, x.n));
  x.t->version++;
  return 0;
}

static int l_count_zeros(lua_State *L) {
  operand x = arg(L, 1, "count_zeros", NULL);
  const fsdp_kernels_i *k = kernels(L, "count_zeros", &x);
  int64_t z = 0;
  if (k) check(L, k->count_zeros(CTX(&x), x.t->dtype, &z, x.d, x.n));
  lua_pushnumber(L, (lua_Number)z);
  return 1;
}

static int l_mask_check(lua_State *L) {
  operand m = arg(L, 1, "mask_check", NULL);
  const fsdp_kernels_i *k = kernels(L, "mask_check", &m);
  int64_t bad = 0, z = 0;
  uint32_t h = 2166136261u; /* FNV-1a of no positions */
  if (k) check(L, k->mask_check(CTX(&m), m.t->dtype, &bad, &z, &h, m.d, m.n));
  lua_pushnumber(L, (lua_Number)bad);
  lua_pushnumber(L, (lua_Number)z);
  lua_pushnumber(L, (lua_Number)h);
  return 3;
}

static int l_mask_from_nonzero(lua_State *L) {
  const char *fn = "mask_from_nonzero";
  operand mo = arg(L, 1, fn, NULL), x = arg(L, 2, fn, &mo);
  same_len(L, fn, mo.n, x.n);
  const fsdp_kernels_i *k = kernels(L, fn, &x);
  int64_t z = 0;
  if (k) check(L, k->mask_from_nonzero(CTX(&x), x.t->dtype, mo.d, &z, x.d, x.n));
  mo.t->version++;
  lua_pushnumber(L, (lua_Number)z);
  return 1;
}

/* ---- magnitude selection ------------------------------------------------------------------- */

/* prefix: the key bits above shift + width already chosen (a number < 2^32) */
static uint64_t prefix_arg(lua_State *L, int idx, const char *fn) {
  lua_Number p = luaL_checknumber(L, idx);
  if (p < 0 || p != floor(p) || p >= 18446744073709551616.0)
    luaL_error(L, "%s: prefix must be a non-negative integer (got %f)", fn, (double)p);
  return (uint64_t)p;
}

static int l_mask_hist(lua_State *L) {
  const char *fn = "mask_hist";
  operand x = arg(L, 3, fn, NULL), m = opt_mask(L, 4, fn, &x);
  uint64_t prefix = prefix_arg(L, 5, fn);
  int shift = (int)luaL_checkinteger(L, 6), width = width_arg(L, 7, fn);
  if (shift < 0 || shift + width > 32) luaL_error(L, "%s: shift + width must be <= 32", fn);
  int64_t *counts = hist_at(L, 1, fn, (int64_t)1 << width);
  const fsdp_kernels_i *k = kernels(L, fn, &x);
  if (k) check(L, k->mask_hist(CTX(&x), x.t->dtype, counts, x.d, m.d, x.n, prefix, shift, width));
  return 0;
}

static uint64_t pos_arg(lua_State *L, int idx, const char *fn, const char *what) {
  lua_Number p = luaL_checknumber(L, idx);
  if (p < 0 || p != floor(p) || p > 9007199254740992.0)
    luaL_error(L, "%s: %s must be an integer in [0, 2^53] (got %f)", fn, what, (double)p);
  return (uint64_t)p;
}

static uint32_t keyT_arg(lua_State *L, int idx, const char *fn) {
  lua_Number t = luaL_checknumber(L, idx);
  if (t < 0 || t != floor(t) || t > 4294967295.0)
    luaL_error(L, "%s: the key T must be an integer in [0, 2^32) (got %f)", fn, (double)t);
  return (uint32_t)t;
}

static int l_mask_hist_pos(lua_State *L) {
  const char *fn = "mask_hist_pos";
  operand x = arg(L, 3, fn, NULL), m = opt_mask(L, 4, fn, &x);
  uint32_t T = keyT_arg(L, 5, fn);
  uint64_t gbase = pos_arg(L, 6, fn, "gbase");
  uint64_t prefix = prefix_arg(L, 7, fn);
  int shift = (int)luaL_checkinteger(L, 8), width = width_arg(L, 9, fn);
  if (shift < 0 || shift + width > 63) luaL_error(L, "%s: shift + width must be <= 63", fn);
  int64_t *counts = hist_at(L, 1, fn, (int64_t)1 << width);
  const fsdp_kernels_i *k = kernels(L, fn, &x);
  if (k)
    check(L, k->mask_hist_pos(CTX(&x), x.t->dtype, counts, x.d, m.d, x.n, T, gbase, prefix,
                              shift, width));
  return 0;
}

static int l_mask_select(lua_State *L) {
  const char *fn = "mask_select";
  operand mo = arg(L, 1, fn, NULL), x = arg(L, 2, fn, &mo);
  same_len(L, fn, mo.n, x.n);
  operand m = opt_mask(L, 3, fn, &x);
  uint32_t T = keyT_arg(L, 4, fn);
  uint64_t gbase = pos_arg(L, 5, fn, "gbase"), P = pos_arg(L, 6, fn, "P");
  const fsdp_kernels_i *k = kernels(L, fn, &x);
  int64_t z = 0;
  if (k) check(L, k->mask_select(CTX(&x), x.t->dtype, mo.d, &z, x.d, m.d, x.n, T, gbase, P));
  mo.t->version++;
  lua_pushnumber(L, (lua_Number)z);
  return 1;
}

/* ---- N:M ----------------------------------------------------------------------------------- */

static int l_mask_nm(lua_State *L) {
  const char *fn = "mask_nm";
  operand mo = arg(L, 1, fn, NULL), x = arg(L, 2, fn, &mo);
  same_len(L, fn, mo.n, x.n);
  operand m = opt_mask(L, 3, fn, &x);
  lua_Integer keep = luaL_checkinteger(L, 4), M = luaL_checkinteger(L, 5),
              lead = luaL_checkinteger(L, 6);
  if (M < 1 || M > 4096 || keep < 0 || keep > M)
    luaL_error(L, "%s: need 0 <= n <= m <= 4096 (got n = %d, m = %d)", fn, (int)keep, (int)M);
  if (lead < 0) luaL_error(L, "%s: lead must be >= 0", fn);
  const fsdp_kernels_i *k = kernels(L, fn, &x);
  int64_t groups = 0;
  if (k)
    check(L, k->mask_nm(CTX(&x), x.t->dtype, mo.d, &groups, x.d, m.d, x.n, keep, M, lead));
  mo.t->version++;
  lua_pushnumber(L, (lua_Number)groups);
  return 1;
}

static int l_mask_values(lua_State *L) {
  const char *fn = "mask_values";
  operand out = arg(L, 1, fn, NULL), x = arg(L, 2, fn, &out);
  same_len(L, fn, out.n, x.n);
  operand m = opt_mask(L, 3, fn, &x);
  const fsdp_kernels_i *k = kernels(L, fn, &x);
  if (k) check(L, k->mask_values(CTX(&x), x.t->dtype, out.d, x.d, m.d, x.n));
  out.t->version++;
  return 0;
}

static const luaL_Reg funcs[] = {
    {"mask_apply", l_mask_apply},
    {"count_zeros", l_count_zeros},
    {"mask_check", l_mask_check},
    {"mask_from_nonzero", l_mask_from_nonzero},
    {"counts", l_counts},
    {"counts_all_reduce", l_counts_all_reduce},
    {"counts_totable", l_counts_totable},
    {"mask_hist", l_mask_hist},
    {"mask_hist_pos", l_mask_hist_pos},
    {"mask_select", l_mask_select},
    {"mask_nm", l_mask_nm},
    {"mask_values", l_mask_values},
    {NULL, NULL}};

void fsdp_lua_open_mask(lua_State *L) {
  luaL_newmetatable(L, COUNTS_MT);
  lua_pop(L, 1);
  luaL_register(L, NULL, funcs);
}
