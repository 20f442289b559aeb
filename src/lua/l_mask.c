/*
 * l_mask.c — per-element helpers of masks and pruning (lua/fsdp/mask.lua, lua/fsdp/prune.lua)
 * as functions of the `fsdp.core` module. docs/pruning.md is the manual.
 *
 * Everything here works on ONE rank's 1-D contiguous float views (a parameter flattened, or a
 * slice of a unit's flat shard): the Lua layer decides which slices and when to communicate.
 * The one collective here is counts_all_reduce (an i64 sum of a histogram).
 *
 * Pruning order. Magnitude pruning removes the k elements with the smallest keys, where an
 * element's key is a 32-bit unsigned integer:
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
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "lua/binding.h"

#define COUNTS_MT "fsdp.counts"

typedef struct counts_buf {
  int64_t n;
  int64_t v[];
} counts_buf;

/* The contiguous float data of the tensor at idx, with its length; a Lua error names fn. The
 * tensor's version is bumped when `write` (in-place writers). */
static float *view_arg(lua_State *L, int idx, const char *fn, int64_t *n, bool write) {
  fsdp_tensor *t = fsdp_lua_to_tensor(L, idx);
  if (!t)
    luaL_error(L, "bad argument #%d to '%s' (tensor expected, got %s)", idx, fn,
               luaL_typename(L, idx));
  if (t->dtype != FSDP_DTYPE_F32) luaL_error(L, "%s: argument #%d must be a float32 tensor", fn, idx);
  if (!fsdp_tensor_is_contiguous(t))
    luaL_error(L, "%s: argument #%d must be contiguous (got shape %s)", fn, idx,
               FSDP_SHAPE_STR(t));
  *n = fsdp_tensor_numel(t);
  if (*n == 0) return NULL;
  float *d = fsdp_tensor_data(t, fn);
  if (!d) fsdp_lua_error(L);
  if (write) t->version++;
  return d;
}

/* An optional mask argument: NULL when nil; otherwise its length must be n. */
static const float *opt_mask(lua_State *L, int idx, const char *fn, int64_t n) {
  if (lua_isnoneornil(L, idx)) return NULL;
  int64_t k;
  const float *m = view_arg(L, idx, fn, &k, false);
  if (k != n)
    luaL_error(L, "%s: the mask has %d elements, the values %d", fn, (int)k, (int)n);
  return m;
}

static void same_len(lua_State *L, const char *fn, int64_t a, int64_t b) {
  if (a != b) luaL_error(L, "%s: the tensors have %d and %d elements", fn, (int)a, (int)b);
}

/* Branch-free (the loops below run it over whole shards; a masked/unmasked branch would be
 * mispredicted half the time at 50% sparsity). */
static inline uint32_t key_of(float x, const float *m, int64_t i) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  uint32_t k = (bits & 0x7FFFFFFFu) + 1u;
  if (m) k &= 0u - (uint32_t)(m[i] != 0.0f);
  return k;
}

static float value_of(float x, const float *m, int64_t i) {
  if (m && m[i] == 0.0f) return -1.0f;
  if (isnan(x)) return INFINITY;
  return fabsf(x);
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

/* Add counts[0..nb) into the histogram at (idx, idx + 1): a counts buffer and a 0-based offset. */
static void hist_add(lua_State *L, int idx, const char *fn, const int64_t *counts, int64_t nb) {
  counts_buf *b = counts_arg(L, idx, fn);
  lua_Number off = luaL_checknumber(L, idx + 1);
  if (off < 0 || off != floor(off) || off + (lua_Number)nb > (lua_Number)b->n)
    luaL_error(L, "%s: a histogram of %d buckets at offset %f does not fit %d counts", fn,
               (int)nb, (double)off, (int)b->n);
  int64_t *out = b->v + (int64_t)off;
  for (int64_t i = 0; i < nb; i++) out[i] += counts[i];
}

/* ---- masks ------------------------------------------------------------------------------- */

static int l_mask_apply(lua_State *L) {
  int64_t n, k;
  float *x = view_arg(L, 1, "mask_apply", &n, true);
  const float *m = view_arg(L, 2, "mask_apply", &k, false);
  same_len(L, "mask_apply", n, k);
  /* bitwise and with all-ones or zero: branch-free (vectorizes), exact, +0 for masked */
  for (int64_t i = 0; i < n; i++) {
    uint32_t bits;
    memcpy(&bits, &x[i], sizeof bits);
    bits &= 0u - (uint32_t)(m[i] != 0.0f);
    memcpy(&x[i], &bits, sizeof bits);
  }
  return 0;
}

static int l_count_zeros(lua_State *L) {
  int64_t n, z = 0;
  const float *x = view_arg(L, 1, "count_zeros", &n, false);
  for (int64_t i = 0; i < n; i++) z += x[i] == 0.0f;
  lua_pushnumber(L, (lua_Number)z);
  return 1;
}

static int l_mask_check(lua_State *L) {
  int64_t n, bad = 0, z = 0;
  const float *m = view_arg(L, 1, "mask_check", &n, false);
  uint32_t h = 2166136261u; /* FNV-1a over the zero positions */
  for (int64_t i = 0; i < n; i++) {
    if (m[i] == 0.0f) {
      z++;
      uint32_t v = (uint32_t)i;
      for (int b = 0; b < 4; b++) {
        h ^= (v >> (8 * b)) & 0xFFu;
        h *= 16777619u;
      }
    } else if (m[i] != 1.0f) {
      bad++;
    }
  }
  lua_pushnumber(L, (lua_Number)bad);
  lua_pushnumber(L, (lua_Number)z);
  lua_pushnumber(L, (lua_Number)h);
  return 3;
}

static int l_mask_from_nonzero(lua_State *L) {
  int64_t n, k, z = 0;
  float *mo = view_arg(L, 1, "mask_from_nonzero", &n, true);
  const float *x = view_arg(L, 2, "mask_from_nonzero", &k, false);
  same_len(L, "mask_from_nonzero", n, k);
  for (int64_t i = 0; i < n; i++) {
    mo[i] = x[i] != 0.0f ? 1.0f : 0.0f;
    z += x[i] == 0.0f;
  }
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
  int64_t n;
  const float *x = view_arg(L, 3, fn, &n, false);
  const float *m = opt_mask(L, 4, fn, n);
  uint64_t prefix = prefix_arg(L, 5, fn);
  int shift = (int)luaL_checkinteger(L, 6), width = width_arg(L, 7, fn);
  if (shift < 0 || shift + width > 32) luaL_error(L, "%s: shift + width must be <= 32", fn);
  int64_t nb = (int64_t)1 << width;
  int64_t *counts = lua_newuserdata(L, sizeof *counts * (size_t)nb);
  memset(counts, 0, sizeof *counts * (size_t)nb);
  /* 4 interleaved sub-histograms (32-bit: flushed before they could overflow): weights crowd
   * into few buckets, and consecutive increments of one counter would wait on each other */
  uint32_t *sub = lua_newuserdata(L, sizeof *sub * 4 * (size_t)nb);
  const uint64_t bmask = (uint64_t)(nb - 1);
  const int top = shift + width;
  for (int64_t i0 = 0; i0 < n; i0 += (int64_t)1 << 30) {
    int64_t i1 = n - i0 < ((int64_t)1 << 30) ? n : i0 + ((int64_t)1 << 30);
    memset(sub, 0, sizeof *sub * 4 * (size_t)nb);
    if (m) {
      for (int64_t i = i0; i < i1; i++) {
        uint64_t k = key_of(x[i], m, i);
        if ((k >> top) == prefix) sub[(i & 3) * nb + (int64_t)((k >> shift) & bmask)]++;
      }
    } else {
      for (int64_t i = i0; i < i1; i++) {
        uint64_t k = key_of(x[i], NULL, i);
        if ((k >> top) == prefix) sub[(i & 3) * nb + (int64_t)((k >> shift) & bmask)]++;
      }
    }
    for (int64_t b = 0; b < nb; b++)
      counts[b] += (int64_t)sub[b] + sub[nb + b] + sub[2 * nb + b] + sub[3 * nb + b];
  }
  hist_add(L, 1, fn, counts, nb);
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
  int64_t n;
  const float *x = view_arg(L, 3, fn, &n, false);
  const float *m = opt_mask(L, 4, fn, n);
  uint32_t T = keyT_arg(L, 5, fn);
  uint64_t gbase = pos_arg(L, 6, fn, "gbase");
  uint64_t prefix = prefix_arg(L, 7, fn);
  int shift = (int)luaL_checkinteger(L, 8), width = width_arg(L, 9, fn);
  if (shift < 0 || shift + width > 63) luaL_error(L, "%s: shift + width must be <= 63", fn);
  int64_t nb = (int64_t)1 << width;
  int64_t *counts = lua_newuserdata(L, sizeof *counts * (size_t)nb);
  memset(counts, 0, sizeof *counts * (size_t)nb);
  for (int64_t i = 0; i < n; i++) {
    if (key_of(x[i], m, i) != T) continue;
    uint64_t pos = gbase + (uint64_t)i;
    if ((pos >> (shift + width)) == prefix) counts[(pos >> shift) & (uint64_t)(nb - 1)]++;
  }
  hist_add(L, 1, fn, counts, nb);
  return 0;
}

static int l_mask_select(lua_State *L) {
  const char *fn = "mask_select";
  int64_t n, k, z = 0;
  float *mo = view_arg(L, 1, fn, &n, true);
  const float *x = view_arg(L, 2, fn, &k, false);
  same_len(L, fn, n, k);
  const float *m = opt_mask(L, 3, fn, n);
  uint32_t T = keyT_arg(L, 4, fn);
  uint64_t gbase = pos_arg(L, 5, fn, "gbase"), P = pos_arg(L, 6, fn, "P");
  for (int64_t i = 0; i < n; i++) {
    uint32_t key = key_of(x[i], m, i);
    int pruned = (key < T) | ((key == T) & (gbase + (uint64_t)i < P));
    mo[i] = (float)(1 - pruned);
    z += pruned;
  }
  lua_pushnumber(L, (lua_Number)z);
  return 1;
}

/* ---- N:M ----------------------------------------------------------------------------------- */

static int l_mask_nm(lua_State *L) {
  const char *fn = "mask_nm";
  int64_t n, k;
  float *mo = view_arg(L, 1, fn, &n, true);
  const float *x = view_arg(L, 2, fn, &k, false);
  same_len(L, fn, n, k);
  const float *m = opt_mask(L, 3, fn, n);
  lua_Integer keep = luaL_checkinteger(L, 4), M = luaL_checkinteger(L, 5),
              lead = luaL_checkinteger(L, 6);
  if (M < 1 || M > 4096 || keep < 0 || keep > M)
    luaL_error(L, "%s: need 0 <= n <= m <= 4096 (got n = %d, m = %d)", fn, (int)keep, (int)M);
  if (lead < 0) luaL_error(L, "%s: lead must be >= 0", fn);
  int64_t groups = 0;
  for (int64_t g = lead; g + M <= n; g += M, groups++) {
    for (int64_t i = g; i < g + M; i++) {
      float vi = value_of(x[i], m, i);
      int64_t above = 0; /* elements of the group ranked before i */
      for (int64_t j = g; j < g + M; j++) {
        if (j == i) continue;
        float vj = value_of(x[j], m, j);
        above += vj > vi || (vj == vi && j > i);
      }
      mo[i] = above < keep ? 1.0f : 0.0f;
    }
  }
  lua_pushnumber(L, (lua_Number)groups);
  return 1;
}

static int l_mask_values(lua_State *L) {
  int64_t n, k;
  float *out = view_arg(L, 1, "mask_values", &n, true);
  const float *x = view_arg(L, 2, "mask_values", &k, false);
  same_len(L, "mask_values", n, k);
  const float *m = opt_mask(L, 3, "mask_values", n);
  for (int64_t i = 0; i < n; i++) out[i] = value_of(x[i], m, i);
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
