/*
 * l_ops.c — the functional ops (fsdp.F), grad mode, seeding, parameters and their
 * initialisation (src/fsdp/param.h), optimizer updates and sums of squares (src/fsdp/optim.h),
 * memory accounting and devices, as functions of the `fsdp.core` module. The cpu header is
 * here only for the BLAS thread count.
 */
#include <math.h>
#include <string.h>

#include "autograd/autograd.h"
#include "fsdp/optim.h"
#include "fsdp/param.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/pool.h"
#include "kernels/kernels.h"
#include "lua/binding.h"

/* The tensor argument idx of fsdp.F.<fn>, or a Lua error naming fn: through a tail call or
 * pcall Lua itself cannot name the function ("bad argument #1 to '?'"). */
static fsdp_tensor *arg(lua_State *L, int idx, const char *fn) {
  fsdp_tensor *t = fsdp_lua_to_tensor(L, idx);
  if (t) return t;
  if (luaL_testudata(L, idx, FSDP_TENSOR_MT))
    luaL_error(L, "%s: argument #%d is a freed tensor (t:free() was called on it)", fn, idx);
  luaL_error(L, "bad argument #%d to '%s' (tensor expected, got %s)", idx, fn,
             luaL_typename(L, idx));
  return NULL;
}

static fsdp_tensor *opt_arg(lua_State *L, int idx, const char *fn) {
  return lua_isnoneornil(L, idx) ? NULL : arg(L, idx, fn);
}

static lua_Number num_arg(lua_State *L, int idx, const char *fn, const char *what) {
  if (lua_type(L, idx) != LUA_TNUMBER)
    luaL_error(L, "bad argument #%d to '%s' (%s: number expected, got %s)", idx, fn, what,
               luaL_typename(L, idx));
  return lua_tonumber(L, idx);
}

/* ---- fsdp.F ---------------------------------------------------------------------------- */

static int f_linear(lua_State *L) {
  fsdp_tensor *x = arg(L, 1, "linear"), *w = arg(L, 2, "linear"), *b = opt_arg(L, 3, "linear");
  PUSH_OR_RAISE(fsdp_op_linear(OUT, x, w, b));
}

static int f_embedding(lua_State *L) {
  fsdp_tensor *ids = arg(L, 1, "embedding"), *w = arg(L, 2, "embedding");
  PUSH_OR_RAISE(fsdp_op_embedding(OUT, ids, w));
}

/* A layernorm's eps at idx (1e-5 when absent): a number > 0, as nn.LayerNorm's; 0, a negative
 * one or NaN would make the outputs NaN. */
static float eps_arg(lua_State *L, int idx, const char *fn) {
  if (lua_isnoneornil(L, idx)) return 1e-5f;
  lua_Number e = num_arg(L, idx, fn, "eps");
  if (!(e > 0)) luaL_error(L, "%s: eps must be a number > 0, got %g", fn, (double)e);
  return (float)e;
}

static int f_layernorm(lua_State *L) {
  fsdp_tensor *x = arg(L, 1, "layernorm"), *w = arg(L, 2, "layernorm"),
              *b = opt_arg(L, 3, "layernorm");
  float eps = eps_arg(L, 4, "layernorm");
  PUSH_OR_RAISE(fsdp_op_layernorm(OUT, x, w, b, eps));
}

/* F.add_layernorm(a, b, w, bias, eps) -> a + b, layernorm(a + b) */
static int f_add_layernorm(lua_State *L) {
  fsdp_tensor *a = arg(L, 1, "add_layernorm"), *b = arg(L, 2, "add_layernorm"),
              *w = arg(L, 3, "add_layernorm"), *bias = opt_arg(L, 4, "add_layernorm");
  float eps = eps_arg(L, 5, "add_layernorm");
  fsdp_tensor *sum, *out;
  if (fsdp_op_add_layernorm(&sum, &out, a, b, w, bias, eps)) fsdp_lua_error(L);
  fsdp_lua_push_tensor(L, sum);
  fsdp_lua_push_tensor(L, out);
  return 2;
}

static int f_attention(lua_State *L) {
  fsdp_tensor *qkv = arg(L, 1, "attention");
  lua_Number nh = num_arg(L, 2, "attention", "n_head");
  if (nh != floor(nh) || nh < 1 || nh > 1 << 20)
    luaL_error(L, "attention: n_head must be a positive integer, got %g (qkv %s)", (double)nh,
               FSDP_SHAPE_STR(qkv));
  PUSH_OR_RAISE(fsdp_op_attention(OUT, qkv, (int)nh));
}

static int f_dropout(lua_State *L) {
  fsdp_tensor *x = arg(L, 1, "dropout");
  float p = (float)num_arg(L, 2, "dropout", "p");
  if (p == 0.0f) { /* the identity: no mask, nothing recorded */
    lua_settop(L, 1);
    return 1;
  }
  PUSH_OR_RAISE(fsdp_op_dropout(OUT, x, p));
}

static int f_unary(lua_State *L, fsdp_unary_op op, const char *fn) {
  PUSH_OR_RAISE(fsdp_op_unary(OUT, arg(L, 1, fn), op));
}
static int f_gelu(lua_State *L) { return f_unary(L, FSDP_UNARY_GELU, "gelu"); }
static int f_relu(lua_State *L) { return f_unary(L, FSDP_UNARY_RELU, "relu"); }
/* bias_gelu(x, b) = gelu(x + b), fused where the device has it */
static int f_bias_gelu(lua_State *L) {
  fsdp_tensor *x = arg(L, 1, "bias_gelu"), *b = arg(L, 2, "bias_gelu");
  PUSH_OR_RAISE(fsdp_op_bias_gelu(OUT, x, b));
}
/* softmax(x, dim = -1): dim 1-based, negative from the end */
static int f_softmax(lua_State *L) {
  fsdp_tensor *x = arg(L, 1, "softmax");
  int dim = fsdp_lua_opt_dim(L, x, 2, x->ndim - 1, "softmax");
  PUSH_OR_RAISE(fsdp_op_softmax(OUT, x, dim));
}

static int f_cross_entropy(lua_State *L) {
  fsdp_tensor *logits = arg(L, 1, "cross_entropy"), *targets = arg(L, 2, "cross_entropy");
  lua_Number ignore = -1;
  if (lua_istable(L, 3)) {
    for (lua_pushnil(L); lua_next(L, 3); lua_pop(L, 1))
      if (lua_type(L, -2) != LUA_TSTRING || strcmp(lua_tostring(L, -2), "ignore_index") != 0)
        luaL_error(L, "cross_entropy: unknown option '%s' (valid: ignore_index)",
                   lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : luaL_typename(L, -2));
    lua_getfield(L, 3, "ignore_index");
    if (!lua_isnil(L, -1)) ignore = num_arg(L, -1, "cross_entropy", "ignore_index");
    lua_pop(L, 1);
  } else if (!lua_isnoneornil(L, 3)) {
    ignore = num_arg(L, 3, "cross_entropy", "ignore_index");
  }
  if (ignore != floor(ignore) || fabs(ignore) > 1e9)
    luaL_error(L, "cross_entropy: ignore_index must be an integer, got %g", (double)ignore);
  PUSH_OR_RAISE(fsdp_op_cross_entropy(OUT, logits, targets, (int)ignore));
}

static int f_mse(lua_State *L) {
  fsdp_tensor *a = arg(L, 1, "mse"), *b = arg(L, 2, "mse");
  PUSH_OR_RAISE(fsdp_op_mse(OUT, a, b));
}

static const luaL_Reg F[] = {
    {"linear", f_linear},   {"embedding", f_embedding}, {"layernorm", f_layernorm},
    {"attention", f_attention}, {"dropout", f_dropout}, {"gelu", f_gelu},
    {"relu", f_relu},       {"softmax", f_softmax},     {"cross_entropy", f_cross_entropy},
    {"mse", f_mse},         {"bias_gelu", f_bias_gelu}, {"add_layernorm", f_add_layernorm},
    {NULL, NULL}};

/* ---- grad mode, seeds ------------------------------------------------------------------- */

static int l_set_grad_enabled(lua_State *L) {
  lua_pushboolean(L, fsdp_set_grad_enabled(lua_toboolean(L, 1)));
  return 1;
}

static int l_is_grad_enabled(lua_State *L) {
  lua_pushboolean(L, fsdp_grad_enabled());
  return 1;
}

static int l_tape_size(lua_State *L) {
  lua_pushnumber(L, (lua_Number)fsdp_tape_size());
  return 1;
}

static int l_tape_clear(lua_State *L) {
  fsdp_tape_clear();
  return 0;
}

static int l_tape_prune(lua_State *L) {
  lua_pushnumber(L, (lua_Number)fsdp_tape_prune());
  return 1;
}

static uint64_t check_seed(lua_State *L, int idx) {
  lua_Number s = luaL_checknumber(L, idx);
  if (s != floor(s) || s < 0 || s > 9007199254740992.0)
    luaL_error(L, "seed must be an integer in [0, 2^53], got %g", (double)s);
  return (uint64_t)s;
}

static int l_manual_seed(lua_State *L) {
  fsdp_rng_manual_seed(check_seed(L, 1));
  return 0;
}

static int l_seed(lua_State *L) {
  lua_pushnumber(L, (lua_Number)fsdp_rng_seed());
  return 1;
}

/* ---- parameters and initialisation -------------------------------------------------- */

/* parameter(t) -> t, made a parameter in place (fsdp_param_make) */
static int l_parameter(lua_State *L) {
  if (fsdp_param_make(fsdp_lua_check_tensor(L, 1))) fsdp_lua_error(L);
  lua_settop(L, 1);
  return 1;
}

/* The optional element offset (argument idx, default 0): t's first element gets the value of
 * element `first` of the stream, so a rank fills its shard's slice of a parameter with exactly
 * the values a whole-parameter fill puts there (fsdp.materialize on a wrapped model). 0-based,
 * an integer in [0, 2^53]. */
static uint64_t check_first(lua_State *L, int idx, const char *what) {
  if (lua_isnoneornil(L, idx)) return 0;
  lua_Number f = luaL_checknumber(L, idx);
  if (f != floor(f) || f < 0 || f > 9007199254740992.0)
    luaL_error(L, "%s: element offset must be an integer >= 0, got %g", what, (double)f);
  return (uint64_t)f;
}

/* init_normal(t, seed, key, mean = 0, std = 1, first = 0) and init_uniform(t, seed, key, lo = 0,
 * hi = 1, first = 0): fsdp_param_init_random */
static int init_random(lua_State *L, const char *what, bool normal) {
  fsdp_tensor *t = fsdp_lua_check_tensor(L, 1);
  uint64_t seed = check_seed(L, 2);
  const char *path = luaL_checkstring(L, 3);
  float a = (float)luaL_optnumber(L, 4, 0.0), b = (float)luaL_optnumber(L, 5, 1.0);
  uint64_t first = check_first(L, 6, what);
  fsdp_lua_check_write(L, t, what, NULL);
  if (fsdp_param_init_random(t, what, seed, path, normal, a, b, first)) fsdp_lua_error(L);
  return 0;
}
static int l_init_normal(lua_State *L) { return init_random(L, "init_normal", true); }
static int l_init_uniform(lua_State *L) { return init_random(L, "init_uniform", false); }

/* ---- optimizer updates ----------------------------------------------------------------- */

/* sgd_step(p, g, buf|nil, lr, momentum = 0, weight_decay = 0, first_step) */
static int l_sgd_step(lua_State *L) {
  fsdp_tensor *p = fsdp_lua_check_tensor(L, 1), *g = fsdp_lua_check_tensor(L, 2);
  fsdp_tensor *buf = lua_isnoneornil(L, 3) ? NULL : fsdp_lua_check_tensor(L, 3);
  float lr = (float)luaL_checknumber(L, 4), mom = (float)luaL_optnumber(L, 5, 0),
        wd = (float)luaL_optnumber(L, 6, 0);
  fsdp_lua_check_write(L, p, "sgd_step", NULL);
  if (buf) fsdp_lua_check_write(L, buf, "sgd_step", NULL);
  if (fsdp_optim_sgd_step(p, g, buf, lr, mom, wd, lua_toboolean(L, 7))) fsdp_lua_error(L);
  return 0;
}

/* adamw_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step[, mask[, grad_scale]]):
 * with a mask, g is masked, the step taken and p masked (lua/fsdp/mask.lua's rule), fused
 * where the device has adamw_step_masked; the step uses g times grad_scale (finite, >= 0;
 * default 1; g is not scaled) */
static int l_adamw_step(lua_State *L) {
  fsdp_tensor *t[4];
  for (int i = 0; i < 4; i++) t[i] = fsdp_lua_check_tensor(L, i + 1);
  float h[5];
  for (int i = 0; i < 5; i++) h[i] = (float)luaL_checknumber(L, i + 5);
  lua_Number step = luaL_checknumber(L, 10);
  if (step < 1 || step != floor(step)) luaL_error(L, "adamw_step: step must be an integer >= 1");
  fsdp_tensor *mask = lua_isnoneornil(L, 11) ? NULL : fsdp_lua_check_tensor(L, 11);
  const float gscale = (float)luaL_optnumber(L, 12, 1.0);
  for (int i = 0; i < 4; i++) /* p, m and v are written; g too, with a mask */
    if (i != 1 || mask) fsdp_lua_check_write(L, t[i], "adamw_step", NULL);
  if (fsdp_optim_adamw_step(t[0], t[1], t[2], t[3], mask, h[0], h[1], h[2], h[3], h[4], gscale,
                            (int64_t)step))
    fsdp_lua_error(L);
  return 0;
}

/* sumsq(t) -> the sum of the squares of t's elements (double), on t's device */
static int l_sumsq(lua_State *L) {
  double s;
  if (fsdp_optim_sumsq(fsdp_lua_check_tensor(L, 1), &s)) fsdp_lua_error(L);
  lua_pushnumber(L, s);
  return 1;
}

/* ---- memory, threads ------------------------------------------------------------------- */

static int l_memory(lua_State *L) {
  fsdp_mem_report r;
  fsdp_mem_report_get(NULL, &r);
  lua_newtable(L);
  for (int d = 0; d < r.ndevices; d++) {
    const fsdp_mem_counts *c = &r.counts[d];
    lua_newtable(L);
    for (int k = 0; k < FSDP_ROLE_COUNT; k++) {
      lua_pushnumber(L, (lua_Number)c->live[k]);
      lua_setfield(L, -2, fsdp_role_name((fsdp_role)k));
      lua_pushnumber(L, (lua_Number)c->peak[k]);
      lua_pushfstring(L, "peak_%s", fsdp_role_name((fsdp_role)k));
      lua_insert(L, -2);
      lua_settable(L, -3);
    }
    lua_pushnumber(L, (lua_Number)c->live_total);
    lua_setfield(L, -2, "live");
    lua_pushnumber(L, (lua_Number)c->peak_total);
    lua_setfield(L, -2, "peak");
    /* the device allocator's own figures, where it has them (a caching allocator's reserve) */
    const fsdp_device_i *dev = fsdp_device_find(r.device[d]);
    int64_t al, alp, rs, rsp;
    if (dev && dev->memory_stats && dev->memory_stats(dev->ctx, &al, &alp, &rs, &rsp) == FSDP_OK) {
      lua_pushnumber(L, (lua_Number)al);
      lua_setfield(L, -2, "allocated");
      lua_pushnumber(L, (lua_Number)alp);
      lua_setfield(L, -2, "peak_allocated");
      lua_pushnumber(L, (lua_Number)rs);
      lua_setfield(L, -2, "reserved");
      lua_pushnumber(L, (lua_Number)rsp);
      lua_setfield(L, -2, "peak_reserved");
    }
    fsdp_error_clear();
    lua_setfield(L, -2, r.device[d]);
  }
  return 1;
}

static int l_reset_peak(lua_State *L) {
  fsdp_mem_reset_peak(fsdp_mem_domain_current());
  for (int i = 0; i < fsdp_device_count(); i++) {
    const fsdp_device_i *dev = fsdp_device_at(i);
    if (dev && dev->memory_reset_peak) dev->memory_reset_peak(dev->ctx);
  }
  return 0;
}

/* set_threads(n): the calling rank's cpu threads from now on (its pool, kernels/cpu/pool.h) */
static int l_set_threads(lua_State *L) {
  lua_Integer n = luaL_checkinteger(L, 1);
  if (n < 1 || n > FSDP_CPU_MAX_THREADS)
    luaL_error(L, "set_threads: the thread count must be 1 .. %d, got %f", FSDP_CPU_MAX_THREADS,
               (lua_Number)n);
  fsdp_cpu_set_threads((int)n);
  return 0;
}

static int l_get_threads(lua_State *L) {
  lua_pushinteger(L, fsdp_cpu_threads());
  return 1;
}

/* ---- devices, modes, build information ---------------------------------------------------- */

/* device_count(name) -> physical devices of that kind (0 for a name no device has) */
static int l_device_count(lua_State *L) {
  fsdp_kernels_init();
  lua_pushinteger(L, fsdp_device_count_of(luaL_checkstring(L, 1)));
  return 1;
}

/* deterministic([on]) -> the previous setting; without an argument, the current one */
static int l_deterministic(lua_State *L) {
  if (lua_isnoneornil(L, 1)) {
    lua_pushboolean(L, fsdp_kernels_deterministic());
    return 1;
  }
  luaL_checktype(L, 1, LUA_TBOOLEAN);
  lua_pushboolean(L, fsdp_kernels_set_deterministic(lua_toboolean(L, 1)));
  return 1;
}

/* devices() -> { {name =, count =, kernels = bool, has_data = bool, host_memory = bool,
 * description = string or nil}, ... } in registry order */
static int l_devices(lua_State *L) {
  fsdp_kernels_init();
  int n = fsdp_device_count();
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    const fsdp_device_i *d = fsdp_device_at(i);
    lua_createtable(L, 0, 6);
    lua_pushstring(L, d->name);
    lua_setfield(L, -2, "name");
    lua_pushinteger(L, fsdp_device_count_of(d->name));
    lua_setfield(L, -2, "count");
    lua_pushboolean(L, d->kernels != NULL);
    lua_setfield(L, -2, "kernels");
    lua_pushboolean(L, d->has_data);
    lua_setfield(L, -2, "has_data");
    lua_pushboolean(L, d->host_memory);
    lua_setfield(L, -2, "host_memory");
    if (d->describe) {
      char buf[256] = "";
      d->describe(d->ctx, buf, sizeof buf);
      lua_pushstring(L, buf);
      lua_setfield(L, -2, "description");
    }
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

/* cpu_features() -> {avx2 =, avx512f =, avx512bf16 =, ..., isa =}: what this processor has,
 * and the instruction set the element-wise kernels run at */
static int l_cpu_features(lua_State *L) {
  __builtin_cpu_init();
  lua_createtable(L, 0, 7);
  lua_pushstring(L, fsdp_cpu_isa_current());
  lua_setfield(L, -2, "isa");
  /* __builtin_cpu_supports takes a string literal only: no loop over names */
#define FEATURE(name) (lua_pushboolean(L, __builtin_cpu_supports(name)), lua_setfield(L, -2, name))
  FEATURE("avx2"), FEATURE("fma"), FEATURE("avx512f");
  FEATURE("avx512bw"), FEATURE("avx512vl"), FEATURE("avx512bf16");
#undef FEATURE
  return 1;
}

static const luaL_Reg funcs[] = {
    {"device_count", l_device_count}, {"deterministic", l_deterministic},
    {"devices", l_devices},       {"cpu_features", l_cpu_features},
    {"set_grad_enabled", l_set_grad_enabled}, {"is_grad_enabled", l_is_grad_enabled},
    {"tape_size", l_tape_size},   {"tape_clear", l_tape_clear},
    {"tape_prune", l_tape_prune},
    {"manual_seed", l_manual_seed}, {"seed", l_seed},
    {"parameter", l_parameter},   {"init_normal", l_init_normal},
    {"init_uniform", l_init_uniform}, {"sgd_step", l_sgd_step},
    {"adamw_step", l_adamw_step}, {"sumsq", l_sumsq},
    {"memory", l_memory},         {"reset_peak", l_reset_peak},
    {"set_threads", l_set_threads}, {"get_threads", l_get_threads},
    {NULL, NULL}};

void fsdp_lua_open_ops(lua_State *L) {
  luaL_register(L, NULL, funcs);
  lua_newtable(L);
  luaL_register(L, NULL, F);
  lua_setfield(L, -2, "F");
}
