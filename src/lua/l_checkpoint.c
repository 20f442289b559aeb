/*
 * l_checkpoint.c — activation checkpointing between Lua and the tape (autograd.h,
 * fsdp_op_checkpoint): core.checkpoint_rng(), core.checkpoint(y, rng, fn, inputs...), and the
 * backward every t:backward() runs through (fsdp_lua_backward), which is where a checkpoint
 * node calls back into Lua to recompute its region. lua/fsdp/nn/checkpoint.lua is the user side.
 *
 * A node keeps its recomputation function in this state's registry (a reference). Nodes are
 * freed where no Lua state is at hand (tape pruning, a cleared tape), so freeing one only notes
 * its reference in a per-thread list; the references are dropped at the next checkpoint or
 * backward on that state, and forgotten when the state closes (fsdp_lua_checkpoint_forget). A
 * note carries the registry's address, so a thread that runs two Lua states drops each
 * reference in its own.
 */
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd.h"
#include "lua/binding.h"

typedef struct {
  int ref;           /* the recomputation function, in the registry */
  const void *owner; /* that registry's address */
} lua_ckpt;

static _Thread_local lua_State *tl_backward_L; /* the state running backward on this thread */
static _Thread_local lua_ckpt *dead;
static _Thread_local int ndead, capdead;

static const void *registry_of(lua_State *L) { return lua_topointer(L, LUA_REGISTRYINDEX); }

static void ud_free(void *p) {
  lua_ckpt *c = p;
  if (ndead == capdead) {
    int cap = capdead ? capdead * 2 : 16;
    lua_ckpt *d = realloc(dead, (size_t)cap * sizeof *d);
    if (!d) { /* the reference stays (a few bytes in the registry); nothing breaks */
      free(c);
      return;
    }
    dead = d;
    capdead = cap;
  }
  dead[ndead++] = *c;
  free(c);
}

/* Drop (unref) or forget the noted references of L's registry. */
static void sweep(lua_State *L, bool unref) {
  const void *owner = registry_of(L);
  int keep = 0;
  for (int i = 0; i < ndead; i++) {
    if (dead[i].owner == owner) {
      if (unref) luaL_unref(L, LUA_REGISTRYINDEX, dead[i].ref);
    } else {
      dead[keep++] = dead[i];
    }
  }
  ndead = keep;
  if (ndead == 0) {
    free(dead);
    dead = NULL;
    capdead = 0;
  }
}

void fsdp_lua_checkpoint_forget(lua_State *L) { sweep(L, false); }

/* fsdp_recompute_fn: call the node's function with its inputs on the state running backward. */
static int recompute(void *p, fsdp_tensor *const *in, int nin, fsdp_tensor **out) {
  lua_ckpt *c = p;
  lua_State *L = tl_backward_L;
  if (!L || registry_of(L) != c->owner)
    return fsdp_error("checkpoint: the region was recorded by another Lua state than the one "
                      "running this backward");
  if (!lua_checkstack(L, nin + 4)) return fsdp_error("checkpoint: Lua stack overflow");
  int top = lua_gettop(L);
  lua_rawgeti(L, LUA_REGISTRYINDEX, c->ref);
  for (int k = 0; k < nin; k++) {
    fsdp_tensor_retain(in[k]);
    fsdp_lua_push_tensor(L, in[k]);
  }
  if (lua_pcall(L, nin, 1, 0)) {
    const char *msg = lua_tostring(L, -1);
    fsdp_error("%s", msg ? msg : "(error object is not a string)");
    lua_settop(L, top);
    return FSDP_ERR;
  }
  fsdp_tensor *y = fsdp_lua_to_tensor(L, -1);
  if (!y) {
    fsdp_error("checkpoint: the recomputation returned %s, not a tensor", luaL_typename(L, -1));
    lua_settop(L, top);
    return FSDP_ERR;
  }
  fsdp_tensor_retain(y);
  *out = y;
  lua_settop(L, top);
  return FSDP_OK;
}

int fsdp_lua_backward(lua_State *L, fsdp_tensor *t, fsdp_tensor *g) {
  sweep(L, true);
  lua_State *prev = tl_backward_L;
  tl_backward_L = L;
  int rc = fsdp_backward(t, g);
  tl_backward_L = prev;
  return rc;
}

/* checkpoint_rng() -> the random streams' state, an opaque string for checkpoint() */
static int l_checkpoint_rng(lua_State *L) {
  fsdp_rng_state s;
  memset(&s, 0, sizeof s);
  fsdp_rng_get_state(&s);
  lua_pushlstring(L, (const char *)&s, sizeof s);
  return 1;
}

/* checkpoint(y, rng, fn, inputs...) -> a tensor sharing y's storage, recorded as one node whose
 * backward calls fn(inputs...) with recording on and the streams set to rng (fsdp_op_checkpoint).
 * fn must return the recomputed output; it should hold no tensor of its own (the node retains
 * the inputs). */
static int l_checkpoint(lua_State *L) {
  fsdp_tensor *y = fsdp_lua_arg_tensor(L, 1, "checkpoint");
  size_t len;
  const char *rng = luaL_checklstring(L, 2, &len);
  if (len != sizeof(fsdp_rng_state))
    return luaL_error(L, "checkpoint: argument #2 is not a state from checkpoint_rng()");
  luaL_checktype(L, 3, LUA_TFUNCTION);
  int nin = lua_gettop(L) - 3;
  fsdp_tensor **in = lua_newuserdata(L, (size_t)(nin ? nin : 1) * sizeof *in);
  for (int k = 0; k < nin; k++) in[k] = fsdp_lua_arg_tensor(L, 4 + k, "checkpoint");
  sweep(L, true);
  fsdp_rng_state st;
  memcpy(&st, rng, sizeof st);
  lua_pushvalue(L, 3);
  int ref = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_ckpt *c = malloc(sizeof *c);
  if (!c) {
    luaL_unref(L, LUA_REGISTRYINDEX, ref);
    return luaL_error(L, "checkpoint: out of host memory");
  }
  *c = (lua_ckpt){.ref = ref, .owner = registry_of(L)};
  PUSH_OR_RAISE(fsdp_op_checkpoint(OUT, y, in, nin, &st, recompute, c, ud_free));
}

static const luaL_Reg fns[] = {
    {"checkpoint_rng", l_checkpoint_rng}, {"checkpoint", l_checkpoint}, {NULL, NULL}};

void fsdp_lua_open_checkpoint(lua_State *L) { luaL_register(L, NULL, fns); }
