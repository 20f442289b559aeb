/*
 * host.c — what a rank's Lua state gets in an embedding runtime (include/fsdp.h), and the
 * calls from Lua back into the host: `print` and fsdp.log's output (to the log callback or
 * stdout), fsdp.host.next_batch (the data source), fsdp.host.model, and the internal helpers
 * runtime.c uses to look up and read parameters.
 *
 * Callbacks run on rank threads under rt->cb_mu, one at a time; no Lua error can be raised
 * while the lock is held (the host's data is copied into engine tensors first, and only then
 * pushed), so a failing rank never leaves the lock taken.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <lauxlib.h>

#include "embed/embed.h"
#include "lua/binding.h"

/* ---- output ---------------------------------------------------------------------------------- */

/* Hand one line (without its newline) to the log callback, or write it to stdout whole. */
static void emit_line(embed_rank *r, const char *s, size_t len) {
  fsdp_runtime *rt = r->rt;
  if (r->abandoned) return; /* its caller has gone: the host may have freed the callback's ud */
  pthread_mutex_lock(&rt->cb_mu);
  if (rt->log_fn != NULL) {
    rt->log_fn(rt->log_ud, r->rank, s); /* s is NUL-terminated at len (a Lua string) */
  } else {
    flockfile(stdout); /* whole lines: ranks' lines never interleave */
    fwrite(s, 1, len, stdout);
    putc_unlocked('\n', stdout);
    fflush(stdout);
    funlockfile(stdout);
  }
  pthread_mutex_unlock(&rt->cb_mu);
}

static embed_rank *rank_of(lua_State *L) {
  return (embed_rank *)lua_touserdata(L, lua_upvalueindex(1));
}

/* print, as Lua's (tostring of each argument, tab-separated), as one line. */
static int host_print(lua_State *L) {
  fsdp_lua_print_line(L, false);
  size_t len;
  const char *s = lua_tolstring(L, -1, &len);
  emit_line(rank_of(L), s, len);
  return 0;
}

/* emit(line): one line of fsdp.log output (the writer in HOST_LUA splits its text). */
static int host_emit(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  emit_line(rank_of(L), s, len);
  return 0;
}

/* ---- the data source ------------------------------------------------------------------------- */

bool embed_host_numel(const fsdp_host_tensor *h, int64_t *numel, char *err, size_t n) {
  if (h->ndim < 0 || h->ndim > FSDP_HOST_MAX_DIMS) {
    snprintf(err, n, "ndim %d is out of range (0 .. %d)", h->ndim, FSDP_HOST_MAX_DIMS);
    return false;
  }
  int64_t total = 1;
  for (int d = 0; d < h->ndim; d++) {
    if (h->shape[d] < 0) {
      snprintf(err, n, "shape[%d] = %lld is negative", d, (long long)h->shape[d]);
      return false;
    }
    if (h->shape[d] != 0 && total > INT64_MAX / 4 / h->shape[d]) {
      snprintf(err, n, "the shape holds too many elements");
      return false;
    }
    total *= h->shape[d];
  }
  if (total > 0 && h->data == NULL) {
    snprintf(err, n, "data is NULL for %lld elements", (long long)total);
    return false;
  }
  *numel = total;
  return true;
}

/* fsdp.host.next_batch([what]) -> the batch's tensors, or nil at the end of the data. */
static int host_next_batch(lua_State *L) {
  embed_rank *r = rank_of(L);
  fsdp_runtime *rt = r->rt;
  const char *what = luaL_optstring(L, 1, NULL);
  if (r->abandoned) return luaL_error(L, "fsdp.host.next_batch: the rank was abandoned");
  fsdp_batch batch;
  memset(&batch, 0, sizeof batch);
  batch.rank = r->rank;
  batch.world = rt->world;
  batch.index = r->batches;
  batch.what = what;
  fsdp_tensor *made[FSDP_BATCH_MAX] = {0};
  char err[320] = "";
  int status;
  pthread_mutex_lock(&rt->cb_mu);
  if (rt->data_fn == NULL) {
    status = FSDP_MISUSE;
    snprintf(err, sizeof err, "the host set no data source (fsdp_set_data_source)");
  } else {
    status = rt->data_fn(rt->data_ud, &batch);
    if (status == FSDP_OK) {
      if (batch.n < 1 || batch.n > FSDP_BATCH_MAX) {
        status = FSDP_ERROR;
        snprintf(err, sizeof err, "the data source returned %d tensors (1 .. %d expected)",
                 batch.n, FSDP_BATCH_MAX);
      }
      /* copy now: the host may reuse its buffers as soon as the lock is released */
      for (int i = 0; status == FSDP_OK && i < batch.n; i++) {
        const fsdp_host_tensor *h = &batch.tensors[i];
        int64_t numel;
        char why[160];
        if (!embed_host_numel(h, &numel, why, sizeof why)) {
          status = FSDP_ERROR;
          snprintf(err, sizeof err, "tensor %d of the data source's batch: %s", i + 1, why);
        } else if (fsdp_tensor_new_f32_uninit(&made[i], h->ndim, h->shape) != FSDP_OK) {
          status = FSDP_ERROR;
          snprintf(err, sizeof err, "tensor %d: %s", i + 1, fsdp_error_msg());
        } else if (numel > 0) {
          memcpy(fsdp_tensor_data(made[i], "next_batch"), h->data, (size_t)numel * sizeof(float));
        }
      }
    } else if (status == FSDP_ERROR) {
      batch.error[sizeof batch.error - 1] = '\0';
      snprintf(err, sizeof err, "%s",
               batch.error[0] != '\0' ? batch.error : "the data source failed (no message)");
    } else if (status != FSDP_DONE) {
      /* not one of its three answers: say which it gave, whatever batch->error holds */
      snprintf(err, sizeof err,
               "the data source returned status %d (%s); expected FSDP_OK, FSDP_DONE or "
               "FSDP_ERROR",
               status, fsdp_status_name(status));
      status = FSDP_ERROR;
    }
  }
  pthread_mutex_unlock(&rt->cb_mu);
  if (status != FSDP_OK) {
    for (int i = 0; i < FSDP_BATCH_MAX; i++) fsdp_tensor_release(made[i]);
    if (status == FSDP_DONE) {
      lua_pushnil(L);
      return 1;
    }
    return luaL_error(L, "fsdp.host.next_batch: %s", err);
  }
  r->batches++;
  /* Push them all (each push steals its reference). Only out of memory can raise here. */
  luaL_checkstack(L, batch.n, "fsdp.host.next_batch");
  for (int i = 0; i < batch.n; i++) fsdp_lua_push_tensor(L, made[i]);
  return batch.n;
}

/* ---- the Lua side ---------------------------------------------------------------------------- */

/* Runs once per rank state, with the C functions as its argument. Returns I, the table of
 * helpers runtime.c calls (anchored in the registry as r->host_ref). */
static const char HOST_LUA[] =
    "local C = ...\n"
    "local fsdp = require 'fsdp'\n"
    "local host = { embedded = true }\n"
    "local registered\n"
    "-- fsdp.host.model(m): the model fsdp_read_param / fsdp_param_shape read (every rank)\n"
    "function host.model(m)\n"
    "  if m ~= nil and (type(m) ~= 'table' or type(m.named_modules) ~= 'function') then\n"
    "    error('fsdp.host.model: expected an nn module (or nil), got a ' .. type(m), 2)\n"
    "  end\n"
    "  registered = m\n"
    "  return m\n"
    "end\n"
    "host.next_batch = C.next_batch\n"
    "rawset(fsdp, 'host', host)\n"
    "package.loaded['fsdp.host'] = host\n"
    "\n"
    "local I = {}\n"
    "local function the_model()\n"
    "  local m = registered or rawget(_G, 'model')\n"
    "  if m == nil then\n"
    "    error(\"no model: call fsdp.host.model(m) on every rank or set the global 'model'\", 0)\n"
    "  end\n"
    "  if type(m) ~= 'table' or type(m.named_modules) ~= 'function' then\n"
    "    error('the registered model is not an nn module (a ' .. type(m) .. ')', 0)\n"
    "  end\n"
    "  return m\n"
    "end\n"
    "-- The parameter at path and the module holding it (any path of a tied parameter).\n"
    "function I.find(path)\n"
    "  local m = the_model()\n"
    "  local is_param = require('fsdp.nn.module').is_param\n"
    "  local prefix, name = path:match('^(.*)%.([^%.]+)$')\n"
    "  if not prefix then prefix, name = '', path end\n"
    "  local owner\n"
    "  for p, mod in m:named_modules() do\n"
    "    if p == prefix then owner = mod; break end\n"
    "  end\n"
    "  local v = owner and (owner[name] or (tonumber(name) and owner[tonumber(name)]))\n"
    "  if not is_param(v) then\n"
    "    local first = m:named_parameters()()\n"
    "    error(('no parameter %q in the model%s'):format(path,\n"
    "      first and (' (paths look like %q)'):format(first) or ' (it has no parameters)'), 0)\n"
    "  end\n"
    "  return v, owner\n"
    "end\n"
    "-- Collective: the full value of the parameter at path, as a new contiguous tensor.\n"
    "function I.read(path)\n"
    "  local p, owner = I.find(path)\n"
    "  local out\n"
    "  fsdp.full_params(owner, function() out = p:clone() end, {writeback = false})\n"
    "  return out\n"
    "end\n"
    "\n"
    "-- fsdp.log writes to an object with write/flush: lines go to emit (the host's callback or\n"
    "-- stdout), never as the terminal's in-place progress line.\n"
    "local pending = ''\n"
    "local writer = {}\n"
    "function writer:write(...)\n"
    "  local s = pending .. table.concat({...})\n"
    "  s = s:gsub('\\r\\27%[K', '')\n"
    "  local start = 1\n"
    "  while true do\n"
    "    local nl = s:find('\\n', start, true)\n"
    "    if not nl then break end\n"
    "    C.emit(s:sub(start, nl - 1))\n"
    "    start = nl + 1\n"
    "  end\n"
    "  pending = s:sub(start)\n"
    "  return self\n"
    "end\n"
    "function writer:flush() return self end\n"
    "local log = require 'fsdp.log'\n"
    "local setup = log.setup\n"
    "function log.setup(opts)\n"
    "  if opts == nil then opts = {} end\n"
    "  if type(opts) == 'table' and opts.out == nil then\n"
    "    local o = {}\n"
    "    for k, v in pairs(opts) do o[k] = v end\n"
    "    -- the writer hands the host whole lines: a bar redrawn in place would reach it as\n"
    "    -- the text of every step run together on one line, so a bar is plain lines too\n"
    "    o.out = writer\n"
    "    if o.progress == nil or o.progress == 'bar' then\n"
    "      o.progress = 'line'\n"
    "    end\n"
    "    opts = o\n"
    "  end\n"
    "  return setup(opts)\n"
    "end\n"
    "log.setup()\n"
    "\n"
    "os.exit = function()\n"
    "  error('os.exit is not available in an embedded fsdp runtime (it would end the host "
    "program)', 2)\n"
    "end\n"
    "return I\n";

int embed_setup_state(lua_State *L) {
  embed_rank *r = (embed_rank *)lua_touserdata(L, 1);
  lua_settop(L, 0);
  fsdp_host_openlibs(L, fsdp_host_lua_dir(r->rt->host));
  lua_pushlightuserdata(L, r);
  lua_pushcclosure(L, host_print, 1);
  lua_setglobal(L, "print");

  /* arg: empty until fsdp_run_file sets it (fsdp.args is parsed from it when fsdp loads) */
  lua_newtable(L);
  lua_setglobal(L, "arg");

  if (luaL_loadbuffer(L, HOST_LUA, sizeof HOST_LUA - 1, "=fsdp.host") != 0) lua_error(L);
  lua_newtable(L);
  lua_pushlightuserdata(L, r);
  lua_pushcclosure(L, host_next_batch, 1);
  lua_setfield(L, -2, "next_batch");
  lua_pushlightuserdata(L, r);
  lua_pushcclosure(L, host_emit, 1);
  lua_setfield(L, -2, "emit");
  lua_call(L, 1, 1);
  r->host_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  return 0;
}
