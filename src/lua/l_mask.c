/*
 * l_mask.c — masks and magnitude pruning (src/fsdp/mask.h, which states the pruning order) as
 * functions of the `fsdp.core` module, for lua/fsdp/mask.lua and prune.lua; docs/pruning.md
 * is the manual. Tensors are 1-D contiguous views on one device and of one dtype; positions
 * (gbase, P, lead) are 0-based element offsets.
 *
 *   mask_apply(x, m)                        x[i] = +0 where m[i] == 0 (in place)
 *   count_zeros(x) -> n                     elements equal to 0 (+0 or -0)
 *   mask_check(m) -> bad, zeros, hash       values other than 0/1; zeros; a 32-bit hash of the
 *                                           zero positions (ranks compare it)
 *   mask_from_nonzero(mout, x) -> zeros     mout[i] = (x[i] != 0)
 *   prune_select(groups, collective, label) each group {pieces = {{x =, m =, gbase =,
 *                                           counts =}, ...}, k =} gets T and P: its k smallest
 *                                           elements; collective: histograms summed across
 *                                           the ranks (fsdp_prune_select)
 *   mask_select(mout, x, m|nil, T, gbase, P) -> zeros
 *                                           mout[i] = 0 when key < T, or key == T and
 *                                           gbase + i < P; else 1 (mout may be m itself)
 *   mask_nm(mout, x, m|nil, n, M, lead) -> groups
 *                                           N:M over full groups of M from index lead
 *   mask_values(out, x, m|nil)              out[i] = the N:M value of element i
 */
#include <math.h>
#include <stdint.h>

#include "fsdp/mask.h"
#include "lua/binding.h"

/* Argument idx: a tensor, or nil when optional. */
static fsdp_tensor *tensor_arg(lua_State *L, int idx, const char *fn, bool optional) {
  return optional && lua_isnoneornil(L, idx) ? NULL : fsdp_lua_arg_tensor(L, idx, fn);
}
#define T_ARG(idx) tensor_arg(L, idx, fn, false)
#define M_ARG(idx) tensor_arg(L, idx, fn, true)

/* Argument idx: an integer in [0, max] (a Lua number), or a Lua error naming what. */
static uint64_t uint_arg(lua_State *L, int idx, const char *fn, const char *what, double max) {
  lua_Number v = luaL_checknumber(L, idx);
  if (v < 0 || v != floor(v) || v > max)
    luaL_error(L, "%s: %s must be an integer in [0, %.0f] (got %f)", fn, what, max, (double)v);
  return (uint64_t)v;
}
#define POS_MAX 9007199254740992.0 /* 2^53: what a Lua number holds exactly */
#define KEY_MAX 4294967295.0

/* rc and the count it computed: the count pushed, or the engine error raised */
static int push_count(lua_State *L, int rc, const int64_t *n) {
  if (rc) fsdp_lua_error(L);
  lua_pushnumber(L, (lua_Number)*n);
  return 1;
}

static int l_mask_apply(lua_State *L) {
  const char *fn = "mask_apply";
  fsdp_tensor *x = T_ARG(1), *m = T_ARG(2);
  fsdp_lua_check_write(L, x, fn, NULL);
  if (fsdp_mask_apply(x, m)) fsdp_lua_error(L);
  return 0;
}

static int l_count_zeros(lua_State *L) {
  const char *fn = "count_zeros";
  int64_t z;
  return push_count(L, fsdp_mask_count_zeros(T_ARG(1), &z), &z);
}

static int l_mask_check(lua_State *L) {
  const char *fn = "mask_check";
  int64_t bad, z;
  uint32_t h;
  if (fsdp_mask_check(T_ARG(1), &bad, &z, &h)) fsdp_lua_error(L);
  lua_pushnumber(L, (lua_Number)bad);
  lua_pushnumber(L, (lua_Number)z);
  lua_pushnumber(L, (lua_Number)h);
  return 3;
}

static int l_mask_from_nonzero(lua_State *L) {
  const char *fn = "mask_from_nonzero";
  int64_t z;
  fsdp_tensor *mout = T_ARG(1), *x = T_ARG(2);
  fsdp_lua_check_write(L, mout, fn, NULL);
  return push_count(L, fsdp_mask_from_nonzero(mout, x, &z), &z);
}

static int l_mask_select(lua_State *L) {
  const char *fn = "mask_select";
  fsdp_tensor *mout = T_ARG(1), *x = T_ARG(2), *m = M_ARG(3);
  uint32_t T = (uint32_t)uint_arg(L, 4, fn, "the key T", KEY_MAX);
  uint64_t gbase = uint_arg(L, 5, fn, "gbase", POS_MAX), P = uint_arg(L, 6, fn, "P", POS_MAX);
  fsdp_lua_check_write(L, mout, fn, NULL);
  int64_t z;
  return push_count(L, fsdp_mask_select(mout, x, m, T, gbase, P, &z), &z);
}

static int l_mask_nm(lua_State *L) {
  const char *fn = "mask_nm";
  fsdp_tensor *mout = T_ARG(1), *x = T_ARG(2), *m = M_ARG(3);
  lua_Integer keep = luaL_checkinteger(L, 4), M = luaL_checkinteger(L, 5),
              lead = luaL_checkinteger(L, 6);
  fsdp_lua_check_write(L, mout, fn, NULL);
  int64_t groups;
  return push_count(L, fsdp_mask_nm(mout, x, m, keep, M, lead, &groups), &groups);
}

static int l_mask_values(lua_State *L) {
  const char *fn = "mask_values";
  fsdp_tensor *out = T_ARG(1), *x = T_ARG(2), *m = M_ARG(3);
  fsdp_lua_check_write(L, out, fn, NULL);
  if (fsdp_mask_values(out, x, m)) fsdp_lua_error(L);
  return 0;
}

/* ---- selection ---------------------------------------------------------------------------- */

/* The field `key` of the table at idx: a count or position (an integer in [0, 2^53]), or a Lua
 * error naming it and the `where` (group or piece) number i. */
static int64_t count_field(lua_State *L, int idx, const char *key, const char *where, int i) {
  lua_getfield(L, idx, key);
  lua_Number v = lua_tonumber(L, -1);
  if (lua_type(L, -1) != LUA_TNUMBER || v < 0 || v != floor(v) || v > POS_MAX)
    luaL_error(L, "prune_select: %s %d: %s must be an integer in [0, 2^53] (got %s)", where, i,
               key, luaL_typename(L, -1));
  lua_pop(L, 1);
  return (int64_t)v;
}

/* The field at idx (x or m of piece i of group gi): a tensor, or nil when optional. */
static fsdp_tensor *piece_tensor(lua_State *L, int idx, int gi, int i, const char *key,
                                 bool optional) {
  if (optional && lua_isnil(L, idx)) return NULL;
  fsdp_tensor *t = fsdp_lua_to_tensor(L, idx);
  if (t == NULL)
    luaL_error(L, "prune_select: group %d, piece %d: %s must be a %stensor (got %s)", gi, i, key,
               luaL_testudata(L, idx, FSDP_TENSOR_MT) ? "live " : "", luaL_typename(L, idx));
  return t;
}

/* The pieces table of group gi (1-based) pushed, and its length. */
static int push_pieces(lua_State *L, int gi) {
  lua_rawgeti(L, 1, gi);
  if (!lua_istable(L, -1))
    luaL_error(L, "prune_select: group %d is a %s, not a table", gi, luaL_typename(L, -1));
  lua_getfield(L, -1, "pieces");
  if (!lua_istable(L, -1))
    luaL_error(L, "prune_select: group %d: pieces is a %s, not a table", gi, luaL_typename(L, -1));
  lua_remove(L, -2);
  return (int)lua_objlen(L, -1);
}

/* prune_select(groups, collective, label). The groups table (argument 1) holds every tensor C
 * reads; the arrays C reads are userdata on the stack, so an error frees them. */
static int l_prune_select(lua_State *L) {
  const char *fn = "prune_select";
  luaL_checktype(L, 1, LUA_TTABLE);
  bool collective = lua_toboolean(L, 2);
  const char *label = luaL_optstring(L, 3, fn);
  lua_settop(L, 3);
  int ng = (int)lua_objlen(L, 1);
  size_t npieces = 0;
  for (int gi = 1; gi <= ng; gi++) {
    npieces += (size_t)push_pieces(L, gi);
    lua_pop(L, 1);
  }
  fsdp_prune_group *g = lua_newuserdata(L, (size_t)(ng > 0 ? ng : 1) * sizeof *g);
  fsdp_prune_piece *pc = lua_newuserdata(L, (npieces > 0 ? npieces : 1) * sizeof *pc);
  for (int gi = 0; gi < ng; gi++) {
    int np = push_pieces(L, gi + 1), pt = lua_gettop(L);
    lua_rawgeti(L, 1, gi + 1);
    g[gi] = (fsdp_prune_group){.pieces = pc, .npieces = np,
                               .k = count_field(L, pt + 1, "k", "group", gi + 1)};
    for (int i = 0; i < np; i++, pc++) {
      lua_rawgeti(L, pt, i + 1);
      int it = lua_gettop(L);
      luaL_checktype(L, it, LUA_TTABLE);
      lua_getfield(L, it, "x");
      lua_getfield(L, it, "m");
      lua_getfield(L, it, "counts");
      *pc = (fsdp_prune_piece){.x = piece_tensor(L, it + 1, gi + 1, i + 1, "x", false),
                               .m = piece_tensor(L, it + 2, gi + 1, i + 1, "m", true),
                               .gbase = (uint64_t)count_field(L, it, "gbase", "piece", i + 1),
                               .counts = lua_toboolean(L, it + 3)};
      lua_settop(L, it - 1);
    }
    lua_settop(L, pt - 1);
  }
  fsdp_comm *c = NULL;
  if (collective && !(c = fsdp_comm_current())) fsdp_lua_error(L);
  if (fsdp_prune_select(g, ng, c, label)) fsdp_lua_error(L);
  for (int gi = 0; gi < ng; gi++) {
    lua_rawgeti(L, 1, gi + 1);
    lua_pushnumber(L, (lua_Number)g[gi].T);
    lua_setfield(L, -2, "T");
    lua_pushnumber(L, (lua_Number)g[gi].P);
    lua_setfield(L, -2, "P");
    lua_pop(L, 1);
  }
  return 0;
}

static const luaL_Reg funcs[] = {
    {"mask_apply", l_mask_apply},   {"count_zeros", l_count_zeros},
    {"mask_check", l_mask_check},   {"mask_from_nonzero", l_mask_from_nonzero},
    {"prune_select", l_prune_select}, {"mask_select", l_mask_select},
    {"mask_nm", l_mask_nm},         {"mask_values", l_mask_values},
    {NULL, NULL}};

void fsdp_lua_open_mask(lua_State *L) { luaL_register(L, NULL, funcs); }
