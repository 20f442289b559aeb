/*
 * binding.h — shared pieces of the `fsdp.core` Lua module (the only code that includes lua.h
 * besides src/cli). Each src/lua/l_*.c file registers its functions into the module table.
 *
 * Error rule: C engine calls return FSDP_ERR and leave a message; binding code frees its
 * temporaries first and then raises with fsdp_lua_error(L), which never returns. Nothing
 * that owns a resource may be live across a lua_error (LuaJIT unwinds C frames).
 */
#ifndef FSDP_LUA_BINDING_H
#define FSDP_LUA_BINDING_H

#include <stdbool.h>

#include <lauxlib.h>
#include <lua.h>

#include "core/core.h"
#include "fsdp.h"

#define FSDP_TENSOR_MT "fsdp.Tensor"

/* t[k] = v for the table on top of the stack (counters and figures handed to Lua) */
static inline void fsdp_lua_set_number(lua_State *L, const char *k, lua_Number v) {
  lua_pushnumber(L, v);
  lua_setfield(L, -2, k);
}

/* The options table at index opts (0: none) refuses keys not in valid (NULL-terminated),
 * naming the valid ones: "fn: unknown option 'k' (valid: a, b)". */
void fsdp_lua_check_keys(lua_State *L, int opts, const char *fn, const char *const *valid);

/* Push t as a Lua tensor. Steals one reference. The same C tensor always maps to the same
 * userdata while that userdata is alive (identity: m.head.weight == m.wte.weight). */
void fsdp_lua_push_tensor(lua_State *L, fsdp_tensor *t);
/* The tensor at idx (borrowed), or a Lua error "bad argument #idx to 'fn' (tensor expected,
 * got <type>)"; a freed tensor raises "tensor was freed". */
fsdp_tensor *fsdp_lua_check_tensor(lua_State *L, int idx);
/* NULL when the value at idx is not a (live) tensor. */
fsdp_tensor *fsdp_lua_to_tensor(lua_State *L, int idx);
/* fsdp_lua_check_tensor naming the function fn in its messages: Lua cannot name a metamethod
 * or a function reached through a tail call ("bad argument #1 to '?'"). */
fsdp_tensor *fsdp_lua_arg_tensor(lua_State *L, int idx, const char *fn);
/* A Lua error when writing into t in place would go behind a live autograd graph
 * (fsdp_inplace_check: what names the method or function, instead the recorded way or NULL).
 * Every binding that writes into a tensor it was given calls it before writing anything. */
void fsdp_lua_check_write(lua_State *L, const fsdp_tensor *t, const char *what,
                          const char *instead);
/* Raise the calling thread's engine error as a Lua error (prefixing nothing). */
int fsdp_lua_error(lua_State *L);
/* Read a shape from a Lua array (or varargs of numbers starting at idx). Returns ndim. */
int fsdp_lua_check_shape(lua_State *L, int idx, int64_t *shape);
/* An optional 1-based dimension at idx (negative counts from the end) as a 0-based dim of t;
 * def when absent; a Lua error naming `what` when out of range. */
int fsdp_lua_opt_dim(lua_State *L, fsdp_tensor *t, int idx, int def, const char *what);
/* The dtype named at idx ("f32", "bfloat16", ...); a Lua error listing the valid ones. */
fsdp_dtype fsdp_lua_check_dtype(lua_State *L, int idx);

/* In a binding function: run an op that returns a new tensor through OUT, then push it (the
 * reference moves to Lua) and return 1, or raise the engine error. */
#define PUSH_OR_RAISE(call)                                                                        \
  do {                                                                                             \
    fsdp_tensor *out_;                                                                             \
    if (call) fsdp_lua_error(L);                                                                   \
    fsdp_lua_push_tensor(L, out_);                                                                 \
    return 1;                                                                                      \
  } while (0)
#define OUT (&out_)

/* Identity-preserving boxes (l_box.c): a box is a userdata whose first member is the object
 * pointer. cache_new registers the weak-valued cache of one kind at the address cache_key;
 * push_cached pushes ptr's live box and returns true, or pushes nothing and returns false;
 * push_new pushes a new box of `size` bytes with metatable mt and records it. */
void fsdp_lua_box_cache_new(lua_State *L, const void *cache_key);
bool fsdp_lua_box_push_cached(lua_State *L, const void *cache_key, void *ptr);
void fsdp_lua_box_push_new(lua_State *L, const void *cache_key, void *ptr, size_t size,
                           const char *mt);
/* The object of the box (metatable mt) at idx, or a Lua error: "bad argument #idx to 'fn'
 * (<what> expected, got <type>)" (fn NULL: Lua names the calling function); when the box's
 * object was freed "<what> was freed<hint>", or with fn "fn: argument #idx is a freed
 * <what><hint>". */
void *fsdp_lua_box_check(lua_State *L, int idx, const char *mt, const char *fn, const char *what,
                         const char *hint);
/* The object of the box (metatable mt) at idx, which no longer holds it (NULL when it was
 * taken before): what __gc and free() release. */
void *fsdp_lua_box_take(lua_State *L, int idx, const char *mt);

/* print's formatting (tostring of every argument on the stack, tab-separated, and a newline
 * when asked): pushes the line as one string. For hosts that replace print. Raises like print
 * when a tostring does not return a string. */
void fsdp_lua_print_line(lua_State *L, bool newline);

/* Registration of each binding file into the module table at the top of the stack. */
void fsdp_lua_open_tensor(lua_State *L);
void fsdp_lua_open_ops(lua_State *L);
void fsdp_lua_open_data(lua_State *L);
void fsdp_lua_open_bench(lua_State *L);
void fsdp_lua_open_comm(lua_State *L);
void fsdp_lua_open_fsdp(lua_State *L);
void fsdp_lua_open_io(lua_State *L);
void fsdp_lua_open_mask(lua_State *L);
void fsdp_lua_open_checkpoint(lua_State *L);

/* fsdp_backward(t, g) run for L (t:backward()): a checkpointed region met on the way is
 * recomputed by calling back into L (l_checkpoint.c). */
int fsdp_lua_backward(lua_State *L, fsdp_tensor *t, fsdp_tensor *g);
/* L is closing: forget the checkpoint references noted for it (l_checkpoint.c). */
void fsdp_lua_checkpoint_forget(lua_State *L);
void fsdp_lua_open_tok(lua_State *L);

/* luaopen for require "fsdp.core" (exported from fsdp/core.so and preloaded by fsdprun). */
/* luaopen_fsdp_core is declared in include/fsdp.h (FSDP_API). */

#endif
