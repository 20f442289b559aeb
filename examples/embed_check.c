/*
 * embed_check.c — the test program of the embedding API (include/fsdp.h): every function, its
 * error paths and the promises of the header (errors never exit the host, a Lua error on one
 * rank fails the call on every rank and breaks the runtime, inputs are zero-copy and safe to
 * reuse after the call, freeing a runtime with live tensors is safe). It lives in examples/
 * because it is built exactly like a host program (libfsdp.so and fsdp.h only). Run by
 * tests/recipes/embed_api.sh, natively and under valgrind.
 *
 *   embed_check            exit status 0 when every check passes; each failure is printed
 */
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <fsdp.h>

static int checks, failures;

#define CHECK(cond, ...)                                                                          \
  do {                                                                                            \
    checks++;                                                                                     \
    if (!(cond)) {                                                                                \
      failures++;                                                                                 \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                             \
      fprintf(stderr, __VA_ARGS__);                                                               \
      fputc('\n', stderr);                                                                        \
    }                                                                                             \
  } while (0)

/* A status and a message fragment the last error must hold. */
#define EXPECT(rt, call, want_status, want_text)                                                  \
  do {                                                                                            \
    int st_ = (call);                                                                             \
    const char *msg_ = fsdp_last_error(rt);                                                       \
    CHECK(st_ == (want_status) && strstr(msg_, (want_text)) != NULL,                              \
          "%s returned %s, expected %s; message '%s' should hold '%s'", #call,                    \
          fsdp_status_name(st_), fsdp_status_name(want_status), msg_, want_text);                 \
  } while (0)

#define OK(rt, call) EXPECT(rt, call, FSDP_OK, "")

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static fsdp_runtime *make(int world) {
  fsdp_runtime *rt = NULL;
  int st = fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = world, .timeout_s = 30});
  CHECK(st == FSDP_OK && rt != NULL, "fsdp_runtime_new(world %d): %s", world,
        fsdp_last_error(NULL));
  return rt;
}

static float call_number(fsdp_runtime *rt, const char *fn) {
  float v = NAN;
  fsdp_host_tensor out = {.data = &v, .ndim = 0};
  int st = fsdp_call(rt, fn, NULL, 0, &out, 1);
  CHECK(st == FSDP_OK, "fsdp_call(%s): %s", fn, fsdp_last_error(rt));
  return v;
}

/* ---- creation and options -------------------------------------------------------------------- */

static void test_create(void) {
  fsdp_runtime_free(NULL); /* a no-op */
  CHECK(fsdp_runtime_world(NULL) == 0, "world of NULL");
  CHECK(strcmp(fsdp_status_name(FSDP_BROKEN), "broken") == 0, "status name");
  CHECK(strcmp(fsdp_status_name(42), "unknown status") == 0, "unknown status name");
  fsdp_runtime *rt = (fsdp_runtime *)1;
  EXPECT(NULL, fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = -1}), FSDP_MISUSE,
         "world -1 is out of range");
  CHECK(rt == NULL, "*out is NULL after a failure");
  EXPECT(NULL, fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 5000}), FSDP_MISUSE,
         "out of range");
  EXPECT(NULL, fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.backend = "mpi"}), FSDP_ERROR,
         "backend 'mpi' cannot be embedded");
  /* no library there: FSDP_ERROR, as for a folder that lacks it (fsdp.h) */
  EXPECT(NULL, fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.lua_path = "/nonexistent/lua"}),
         FSDP_ERROR, "lua_path '/nonexistent/lua' is not a folder");
  /* a folder without the library: refused before any rank starts, whatever LUA_PATH holds */
  EXPECT(NULL, fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2, .lua_path = "/tmp"}),
         FSDP_ERROR, "lua_path '/tmp' holds no fsdp Lua library (fsdp/init.lua not found");
  EXPECT(NULL, fsdp_runtime_new(NULL, NULL), FSDP_MISUSE, "out is NULL");
  /* the thread rule: opts.blas_threads, else FSDP_THREADS, else max(1, cores / world) */
  EXPECT(NULL, fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.blas_threads = -1}), FSDP_MISUSE,
         "blas_threads -1 is out of range (0 .. 1024)");
  EXPECT(NULL, fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.blas_threads = 1025}), FSDP_MISUSE,
         "blas_threads 1025 is out of range (0 .. 1024)");
  const char *env = getenv("FSDP_THREADS");
  char *saved = env ? strdup(env) : NULL;
  setenv("FSDP_THREADS", "lots", 1);
  EXPECT(NULL, fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2}), FSDP_MISUSE,
         "FSDP_THREADS='lots' must be a positive integer");
  CHECK(rt == NULL, "*out is NULL after a bad FSDP_THREADS");
  OK(NULL, fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2, .blas_threads = 3}));
  if (rt != NULL) {
    OK(rt, fsdp_run_string(rt, "local t = require('fsdp').core.get_threads()\n"
                               "assert(t == 3, 'threads ' .. t)"));
    fsdp_runtime_free(rt);
  }
  setenv("FSDP_THREADS", "2", 1);
  OK(NULL, fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2}));
  if (rt != NULL) {
    OK(rt, fsdp_run_string(rt, "local fsdp = require 'fsdp'\n"
                               "assert(fsdp.info().threads == 2, 'threads ' .. fsdp.info().threads)"));
    fsdp_runtime_free(rt);
  }
  unsetenv("FSDP_THREADS");
  OK(NULL, fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2}));
  if (rt != NULL) {
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    char code[160];
    snprintf(code, sizeof code,
             "local t = require('fsdp').core.get_threads()\n"
             "assert(t >= 1 and t <= math.max(1, math.floor(%ld / 2)), 'threads ' .. t)", cores);
    OK(rt, fsdp_run_string(rt, code));
    fsdp_runtime_free(rt);
  }
  if (saved) setenv("FSDP_THREADS", saved, 1);
  free(saved);
  rt = NULL;
  /* defaults: one rank */
  OK(NULL, fsdp_runtime_new(&rt, NULL));
  CHECK(fsdp_runtime_world(rt) == 1, "default world %d", fsdp_runtime_world(rt));
  OK(rt, fsdp_run_string(rt, "assert(require('fsdp').world_size() == 1)"));
  CHECK(strcmp(fsdp_last_error(rt), "") == 0, "no error after success: '%s'",
        fsdp_last_error(rt));
  fsdp_runtime_free(rt);
}

/* ---- running code ---------------------------------------------------------------------------- */

static void test_run(void) {
  fsdp_runtime *rt = make(2);
  if (rt == NULL) return;
  EXPECT(rt, fsdp_run_string(rt, "x = = 1"), FSDP_ERROR, "host:1:");
  EXPECT(rt, fsdp_run_string(rt, NULL), FSDP_MISUSE, "code is NULL");
  /* still usable: SPMD, each rank its own state */
  OK(rt, fsdp_run_string(rt, "local fsdp = require 'fsdp'\n"
                             "r = fsdp.rank(); n = fsdp.world_size()\n"
                             "total = fsdp.all_reduce(r + 1, 'sum')\n"
                             "function answer() return total * 10 + n end"));
  CHECK(call_number(rt, "answer") == 32, "all_reduce over 2 ranks");
  /* a file, its arguments, fsdp.args */
  char path[] = "/tmp/embed_check_XXXXXX.lua";
  int fd = mkstemps(path, 4);
  CHECK(fd >= 0, "mkstemps");
  if (fd >= 0) {
    const char *src = "local a, b = ...\n"
                      "local fsdp = require 'fsdp'\n"
                      "assert(arg[0]:match('embed_check_'), arg[0])\n"
                      "assert(a == '--lr=0.5' and b == 'plain' and arg[2] == 'plain')\n"
                      "assert(fsdp.args.lr == 0.5 and fsdp.args[1] == 'plain')\n"
                      "function from_file() return 7 end\n";
    CHECK(write(fd, src, strlen(src)) == (ssize_t)strlen(src), "write");
    close(fd);
    const char *argv[] = {"--lr=0.5", "plain"};
    OK(rt, fsdp_run_file(rt, path, 2, argv));
    CHECK(call_number(rt, "from_file") == 7, "global set by the file");
    EXPECT(rt, fsdp_run_file(rt, path, 1, NULL), FSDP_MISUSE, "argc 1 with argv NULL");
    unlink(path);
  }
  /* declared arguments (a refusal is an error here: no os.exit), each rank's RANK */
  char dpath[] = "/tmp/embed_check_args_XXXXXX.lua";
  fd = mkstemps(dpath, 4);
  CHECK(fd >= 0, "mkstemps");
  if (fd >= 0) {
    const char *src = "local fsdp = require 'fsdp'\n"
                      "local a = fsdp.args{{'steps', 1, 'integer', 'optimizer steps'}}\n"
                      "assert(a.steps == 5 and fsdp.args.steps == 5)\n"
                      "assert(os.getenv('RANK') == tostring(fsdp.rank()))\n"
                      "assert(os.getenv('WORLD_SIZE') == '2' and os.getenv('LOCAL_WORLD_SIZE') == '2')\n";
    CHECK(write(fd, src, strlen(src)) == (ssize_t)strlen(src), "write");
    close(fd);
    const char *good[] = {"--steps", "5"}, *bad[] = {"--step=5"};
    OK(rt, fsdp_run_file(rt, dpath, 2, good));
    /* every rank raises it: a failure of ranks breaks the runtime, so in one of its own */
    fsdp_runtime *rt2 = make(2);
    if (rt2 != NULL) {
      EXPECT(rt2, fsdp_run_file(rt2, dpath, 1, bad), FSDP_BROKEN,
             ".lua: unknown argument --step; did you mean --steps?");
      fsdp_runtime_free(rt2);
    }
    unlink(dpath);
  }
  EXPECT(rt, fsdp_run_file(rt, "/nonexistent/recipe.lua", 0, NULL), FSDP_ERROR,
         "cannot read /nonexistent/recipe.lua");
  /* a folder: fsdprun's words */
  EXPECT(rt, fsdp_run_file(rt, "/tmp", 0, NULL), FSDP_ERROR, "cannot read /tmp: Is a directory");
  /* os.exit would end the host: it raises instead (and that breaks the runtime) */
  EXPECT(rt, fsdp_run_string(rt, "os.exit(3)"), FSDP_BROKEN, "os.exit is not available");
  fsdp_runtime_free(rt);
}

/* ---- fsdp_call: inputs, results -------------------------------------------------------------- */

static const char CALL_LUA[] =
    "local fsdp = require 'fsdp'\n"
    "function sum2(x, y) return x:sum():item() + y:sum():item() end\n"
    "function shapes(x) return x, x:view{-1}, 2.5 end\n"
    "function double_in_place(x) x:mul_(2); return x:sum():item() + fsdp.rank() * 1000 end\n"
    "function keep(x) saved = x; view = x:view{-1}; return 0 end\n"
    "function kept_sum() return view:sum():item() end\n"
    "function kept_freed() return (pcall(function() return saved:sum() end)) and 1 or 0 end\n"
    "function nothing() end\n"
    "function text() return 'a string' end\n";

static void test_call(void) {
  fsdp_runtime *rt = make(2);
  if (rt == NULL) return;
  OK(rt, fsdp_run_string(rt, CALL_LUA));
  float a[6] = {1, 2, 3, 4, 5, 6}, b[2] = {10, 20};
  fsdp_host_tensor in[2] = {{.data = a, .ndim = 2, .shape = {2, 3}},
                            {.data = b, .ndim = 1, .shape = {2}}};
  float r = NAN;
  fsdp_host_tensor out = {.data = &r, .ndim = 0};
  OK(rt, fsdp_call(rt, "sum2", in, 2, &out, 1));
  CHECK(r == 51, "sum2 = %g", r);

  /* shapes: a (2,3) result into a buffer of 6 declared (6), a query (data NULL), a number */
  float m[6] = {0}, flat[6] = {0}, num = 0;
  fsdp_host_tensor outs[3] = {{.data = m, .ndim = 1, .shape = {6}},
                              {.data = NULL, .ndim = 0},
                              {.data = &num, .ndim = 1, .shape = {1}}};
  OK(rt, fsdp_call(rt, "shapes", in, 1, outs, 3));
  CHECK(outs[0].ndim == 2 && outs[0].shape[0] == 2 && outs[0].shape[1] == 3 && m[5] == 6,
        "tensor result: ndim %d", outs[0].ndim);
  CHECK(outs[1].ndim == 1 && outs[1].shape[0] == 6, "shape query: ndim %d", outs[1].ndim);
  CHECK(num == 2.5f && outs[2].ndim == 0, "number result %g", num);
  (void)flat;

  /* results that do not fit: an error after the call, the runtime stays usable */
  float small[2];
  fsdp_host_tensor bad = {.data = small, .ndim = 1, .shape = {2}};
  EXPECT(rt, fsdp_call(rt, "shapes", in, 1, &bad, 1), FSDP_ERROR,
         "result 1 of 'shapes' has shape (2, 3) (6 elements), but out[0] holds 2");
  EXPECT(rt, fsdp_call(rt, "nothing", NULL, 0, &out, 1), FSDP_ERROR, "nil (missing)");
  EXPECT(rt, fsdp_call(rt, "text", NULL, 0, &out, 1), FSDP_ERROR,
         "is a string, expected a tensor or a number");
  EXPECT(rt, fsdp_call(rt, "no_such_function", NULL, 0, NULL, 0), FSDP_ERROR,
         "'no_such_function' is not a global function (it is a nil value)");
  fsdp_host_tensor broken_in = {.data = NULL, .ndim = 1, .shape = {3}};
  EXPECT(rt, fsdp_call(rt, "sum2", &broken_in, 1, NULL, 0), FSDP_MISUSE,
         "in[0]: data is NULL for 3 elements");
  fsdp_host_tensor neg = {.data = a, .ndim = 1, .shape = {-1}};
  EXPECT(rt, fsdp_call(rt, "sum2", &neg, 1, NULL, 0), FSDP_MISUSE, "shape[0] = -1 is negative");
  fsdp_host_tensor deep = {.data = a, .ndim = 9};
  EXPECT(rt, fsdp_call(rt, "sum2", &deep, 1, NULL, 0), FSDP_MISUSE, "ndim 9 is out of range");
  EXPECT(rt, fsdp_call(rt, NULL, NULL, 0, NULL, 0), FSDP_MISUSE, "fn is NULL");
  EXPECT(rt, fsdp_call(rt, "sum2", NULL, 1, NULL, 0), FSDP_MISUSE, "in is NULL");

  /* per-rank inputs, written in place: zero-copy, each rank its own buffer and result */
  float x0[3] = {1, 1, 1}, x1[3] = {2, 2, 2}, r0 = 0, r1 = 0;
  fsdp_host_tensor pin[2] = {{.data = x0, .ndim = 1, .shape = {3}},
                             {.data = x1, .ndim = 1, .shape = {3}}};
  fsdp_host_tensor pout[2] = {{.data = &r0, .ndim = 0}, {.data = &r1, .ndim = 0}};
  OK(rt, fsdp_call_ranks(rt, "double_in_place", pin, 1, pout, 1));
  CHECK(x0[2] == 2 && x1[2] == 4, "in-place writes reach host memory: %g %g", x0[2], x1[2]);
  CHECK(r0 == 6 && r1 == 1012, "per-rank results %g %g", r0, r1);

  /* inputs kept by Lua: the tensor is freed, a view keeps a copy of the bytes */
  float k[4] = {1, 2, 3, 4};
  fsdp_host_tensor kin = {.data = k, .ndim = 1, .shape = {4}};
  OK(rt, fsdp_call(rt, "keep", &kin, 1, NULL, 0));
  for (int i = 0; i < 4; i++) k[i] = -100; /* the host reuses its buffer */
  CHECK(call_number(rt, "kept_sum") == 10, "a kept view reads the values of the call");
  CHECK(call_number(rt, "kept_freed") == 0, "a kept input tensor is freed");
  fsdp_runtime_free(rt); /* `view` still lives in Lua: freed with the state */
}

/* ---- parameters ------------------------------------------------------------------------------ */

static const char PARAM_LUA[] =
    "local fsdp = require 'fsdp'\n"
    "local nn = fsdp.nn\n"
    "fsdp.manual_seed(3)\n"
    "local Net = nn.Module:extend('Net')\n"
    "function Net:init()\n"
    "  self.emb = nn.Embedding(5, 6)\n"
    "  self.blocks = nn.ModuleList{nn.Linear(6, 6), nn.Linear(6, 6)}\n"
    "  self.head = nn.Linear(6, 5, {bias = false})\n"
    "  self.head.weight = self.emb.weight   -- tied\n"
    "end\n"
    "net = Net()\n"
    "ref = {}\n"
    "for path, p in net:named_parameters() do ref[path] = p:clone() end\n"
    "local names = {'emb.weight', 'blocks.2.weight', 'blocks.2.bias'}\n"
    "function get_ref(i) return ref[names[i:item()]] end\n";

static void read_and_compare(fsdp_runtime *rt, const char *path, int which, int64_t count) {
  float got[64], want[64];
  int ndim;
  int64_t shape[FSDP_HOST_MAX_DIMS];
  OK(rt, fsdp_param_shape(rt, path, &ndim, shape));
  int64_t numel = 1;
  for (int d = 0; d < ndim; d++) numel *= shape[d];
  CHECK(numel == count, "%s: %lld elements", path, (long long)numel);
  OK(rt, fsdp_read_param(rt, path, got, count));
  float idx = (float)which;
  fsdp_host_tensor in = {.data = &idx, .ndim = 0};
  fsdp_host_tensor out = {.data = want, .ndim = 1, .shape = {count}};
  OK(rt, fsdp_call(rt, "get_ref", &in, 1, &out, 1));
  CHECK(memcmp(got, want, (size_t)count * sizeof(float)) == 0, "%s: values differ", path);
}

static void test_params(void) {
  fsdp_runtime *rt = make(2);
  if (rt == NULL) return;
  float buf[64];
  EXPECT(rt, fsdp_read_param(rt, "emb.weight", buf, 30), FSDP_ERROR,
         "no model: call fsdp.host.model(m)");
  OK(rt, fsdp_run_string(rt, PARAM_LUA));
  OK(rt, fsdp_run_string(rt, "require('fsdp').host.model(net)"));
  /* unwrapped, then wrapped: the same full values */
  for (int wrapped = 0; wrapped < 2; wrapped++) {
    read_and_compare(rt, "emb.weight", 1, 30);
    read_and_compare(rt, "head.weight", 1, 30); /* the tie's second path */
    read_and_compare(rt, "blocks.2.weight", 2, 36);
    read_and_compare(rt, "blocks.2.bias", 3, 6);
    if (!wrapped)
      OK(rt, fsdp_run_string(rt, "local fsdp = require 'fsdp'\n"
                                 "fsdp.wrap(net, {policy = fsdp.policy.modules{fsdp.nn.Linear}})\n"
                                 "assert(fsdp.units(net)[1]:state() == 'sharded')"));
  }
  OK(rt, fsdp_run_string(rt, "assert(require('fsdp').units(net)[1]:state() == 'sharded', "
                             "'read_param resharded what it gathered')"));
  EXPECT(rt, fsdp_read_param(rt, "blocks.2.weight", buf, 35), FSDP_ERROR,
         "parameter 'blocks.2.weight' has shape (6, 6) (36 elements), the buffer holds 35");
  EXPECT(rt, fsdp_read_param(rt, "blocks.9.weight", buf, 36), FSDP_ERROR,
         "no parameter \"blocks.9.weight\" in the model (paths look like \"emb.weight\")");
  EXPECT(rt, fsdp_read_param(rt, "blocks.2.forward", buf, 36), FSDP_ERROR, "no parameter");
  EXPECT(rt, fsdp_read_param(rt, "emb.weight", NULL, 30), FSDP_MISUSE, "buf NULL");
  int ndim;
  int64_t shape[FSDP_HOST_MAX_DIMS];
  EXPECT(rt, fsdp_param_shape(rt, NULL, &ndim, shape), FSDP_MISUSE, "path is NULL");
  /* the global `model` is the fallback */
  OK(rt, fsdp_run_string(rt, "local fsdp = require 'fsdp'\n"
                             "fsdp.host.model(nil)\n"
                             "model = fsdp.nn.Linear(2, 3)"));
  OK(rt, fsdp_param_shape(rt, "weight", &ndim, shape));
  CHECK(ndim == 2 && shape[0] == 3 && shape[1] == 2, "global model: weight (3, 2)");
  EXPECT(rt, fsdp_run_string(rt, "require('fsdp').host.model(42)"), FSDP_BROKEN,
         "fsdp.host.model: expected an nn module");
  fsdp_runtime_free(rt); /* a wrapped model with sharded units in a broken runtime */
}

/* A GPT sharded one unit per Block, after a training step: read_param equals what
 * fsdp.full_params shows in Lua, for a block's weight and for the tied head. */
static const char GPT_LUA[] =
    "local fsdp = require 'fsdp'\n"
    "local nn = fsdp.nn\n"
    "fsdp.manual_seed(5)\n"
    "gpt = nn.GPT{vocab = 16, ctx = 8, d = 8, layers = 2, heads = 2, tie = true}\n"
    "fsdp.host.model(fsdp.wrap(gpt, {policy = fsdp.policy.modules{nn.Block}}))\n"
    "local opt = fsdp.optim.AdamW(gpt, {lr = 0.01})\n"
    "local x = fsdp.tensor{{1, 2, 3, 4, 5, 6, 7, 8}}\n"
    "local y = fsdp.tensor{{2, 3, 4, 5, 6, 7, 8, 9}}\n"
    "nn.F.cross_entropy(gpt(x), y):backward()\n"
    "opt:step()\n"
    "function full(which)\n"
    "  local out\n"
    "  fsdp.full_params(gpt, function(m)\n"
    "    out = (which:item() == 1 and m.blocks[1].mlp.fc.weight or m.wte.weight):clone()\n"
    "  end, {writeback = false})\n"
    "  return out\n"
    "end\n";

static void test_gpt(void) {
  fsdp_runtime *rt = make(2);
  if (rt == NULL) return;
  OK(rt, fsdp_run_string(rt, GPT_LUA));
  const char *paths[2] = {"blocks.1.mlp.fc.weight", "head.weight"};
  for (int k = 0; k < 2; k++) {
    int ndim;
    int64_t shape[FSDP_HOST_MAX_DIMS];
    OK(rt, fsdp_param_shape(rt, paths[k], &ndim, shape));
    int64_t n = ndim == 2 ? shape[0] * shape[1] : 0;
    CHECK(n == (k == 0 ? 32 * 8 : 16 * 8), "%s: %lld elements", paths[k], (long long)n);
    float got[256], want[256], which = (float)(k + 1);
    if (n != (k == 0 ? 32 * 8 : 16 * 8)) continue;
    OK(rt, fsdp_read_param(rt, paths[k], got, n));
    fsdp_host_tensor in = {.data = &which, .ndim = 0};
    fsdp_host_tensor out = {.data = want, .ndim = 1, .shape = {n}};
    OK(rt, fsdp_call(rt, "full", &in, 1, &out, 1));
    CHECK(memcmp(got, want, (size_t)n * sizeof(float)) == 0, "%s differs from full_params",
          paths[k]);
  }
  fsdp_runtime_free(rt);
}

/* ---- failures -------------------------------------------------------------------------------- */

static void test_failure(void) {
  fsdp_runtime *rt = make(2);
  if (rt == NULL) return;
  /* rank 1 fails while rank 0 waits in a collective: both return at once (not at the
   * timeout), the root cause is reported, the runtime is broken */
  double t0 = now_s();
  EXPECT(rt, fsdp_run_string(rt, "local fsdp = require 'fsdp'\n"
                                 "if fsdp.rank() == 1 then error('boom') end\n"
                                 "fsdp.barrier()"),
         FSDP_BROKEN, "[rank 1] host:2: boom\nstack traceback:");
  double dt = now_s() - t0;
  CHECK(dt < 10, "the failure took %.1f s (the timeout is 30 s)", dt);
  EXPECT(rt, fsdp_run_string(rt, "x = 1"), FSDP_BROKEN,
         "broken by an earlier failure (free it and create a new one): [rank 1] host:2: boom");
  EXPECT(rt, fsdp_call(rt, "f", NULL, 0, NULL, 0), FSDP_BROKEN, "broken");
  float v;
  EXPECT(rt, fsdp_read_param(rt, "w", &v, 1), FSDP_BROKEN, "broken");
  fsdp_runtime_free(rt);

  /* a collective that never completes: the timeout fails it and breaks the runtime */
  rt = NULL;
  OK(NULL, fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2, .timeout_s = 0.5}));
  if (rt != NULL) {
    EXPECT(rt, fsdp_run_string(rt, "local fsdp = require 'fsdp'\n"
                                   "if fsdp.rank() == 0 then fsdp.barrier('lonely') end"),
           FSDP_BROKEN, "lonely");
    fsdp_runtime_free(rt);
  }

  /* an error in a called function, with inputs: they are released all the same */
  rt = make(2);
  if (rt == NULL) return;
  OK(rt, fsdp_run_string(rt, "function f(x) keep = x:view{-1}; error('bad input') end"));
  float x[3] = {1, 2, 3};
  fsdp_host_tensor in = {.data = x, .ndim = 1, .shape = {3}};
  EXPECT(rt, fsdp_call(rt, "f", &in, 1, NULL, 0), FSDP_BROKEN, "bad input");
  fsdp_runtime_free(rt);
}

/* ---- callbacks ------------------------------------------------------------------------------- */

typedef struct cb_state {
  fsdp_runtime *rt;
  int lines[2];
  char last[2][128];
  int reentry; /* status of a call made from inside the callback */
  int done_after;
} cb_state;

static void on_log(void *ud, int rank, const char *line) {
  cb_state *s = ud;
  if (rank < 0 || rank > 1) return;
  s->lines[rank]++;
  snprintf(s->last[rank], sizeof s->last[rank], "%s", line);
  s->reentry = fsdp_run_string(s->rt, "x = 1");
}

static int source(void *ud, fsdp_batch *b) {
  cb_state *s = ud;
  static float data[2][4];
  if (b->what != NULL && strcmp(b->what, "fail") == 0) {
    snprintf(b->error, sizeof b->error, "the host says no (rank %d)", b->rank);
    return FSDP_ERROR;
  }
  if (b->index >= s->done_after) return FSDP_DONE;
  for (int i = 0; i < 4; i++) data[b->rank][i] = (float)(b->rank * 100 + b->index * 10 + i);
  b->n = 2;
  b->tensors[0] = (fsdp_host_tensor){.data = data[b->rank], .ndim = 2, .shape = {2, 2}};
  b->tensors[1] = (fsdp_host_tensor){.data = data[b->rank], .ndim = 0};
  return FSDP_OK;
}

static void test_callbacks(void) {
  cb_state s = {.done_after = 3};
  fsdp_runtime *rt = make(2);
  if (rt == NULL) return;
  s.rt = rt;
  OK(rt, fsdp_set_log_callback(rt, on_log, &s));
  OK(rt, fsdp_run_string(rt, "local fsdp = require 'fsdp'\n"
                             "print('hello from', fsdp.rank(), nil)\n"
                             "fsdp.log.setup{every = 1}\n"
                             "fsdp.log(1, {loss = 0.5})\n"
                             "fsdp.log.print('note')"));
  CHECK(s.lines[0] == 3 && s.lines[1] == 1, "lines per rank: %d %d", s.lines[0], s.lines[1]);
  CHECK(strcmp(s.last[1], "hello from\t1\tnil") == 0, "rank 1 printed '%s'", s.last[1]);
  CHECK(strcmp(s.last[0], "note") == 0, "rank 0's last line '%s'", s.last[0]);
  CHECK(s.reentry == FSDP_MISUSE, "a call from a callback: %s", fsdp_status_name(s.reentry));
  OK(rt, fsdp_set_log_callback(rt, NULL, NULL));

  EXPECT(rt, fsdp_run_string(rt, "return"), FSDP_OK, ""); /* nothing to do */
  OK(rt, fsdp_set_data_source(rt, source, &s));
  OK(rt, fsdp_run_string(rt, "local fsdp = require 'fsdp'\n"
                             "function pull()\n"
                             "  local n, total = 0, 0\n"
                             "  while true do\n"
                             "    local x, y = fsdp.host.next_batch()\n"
                             "    if not x then break end\n"
                             "    assert(x:dim() == 2 and y:dim() == 0)\n"
                             "    n = n + 1; total = total + x:sum():item() + y:item()\n"
                             "  end\n"
                             "  return n, total\n"
                             "end"));
  float n[2], total[2];
  fsdp_host_tensor outs[4] = {{.data = &n[0]}, {.data = &total[0]}, {.data = &n[1]},
                              {.data = &total[1]}};
  OK(rt, fsdp_call_ranks(rt, "pull", NULL, 0, outs, 2));
  /* rank r, batch k: values r*100 + k*10 + i, i = 0..3; the scalar is the first of them */
  CHECK(n[0] == 3 && n[1] == 3, "batches %g %g", n[0], n[1]);
  CHECK(total[0] == 6 * 3 + 4 * 30 + 30 && total[1] == total[0] + 3 * 500,
        "batch contents %g %g", total[0], total[1]);
  EXPECT(rt, fsdp_run_string(rt, "require('fsdp').host.next_batch('fail')"), FSDP_BROKEN,
         "fsdp.host.next_batch: the host says no (rank ");
  fsdp_runtime_free(rt);

  rt = make(1);
  if (rt == NULL) return;
  EXPECT(rt, fsdp_run_string(rt, "require('fsdp').host.next_batch()"), FSDP_BROKEN,
         "the host set no data source");
  fsdp_runtime_free(rt);
}

/* ---- lifetimes ------------------------------------------------------------------------------- */

typedef struct thread_arg {
  int world, status;
  float result;
} thread_arg;

static void *run_other(void *p) {
  thread_arg *a = p;
  fsdp_runtime *rt = NULL;
  a->status = fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = a->world});
  if (a->status != FSDP_OK) return NULL;
  a->status = fsdp_run_string(rt, "local fsdp = require 'fsdp'\n"
                                  "function f() return fsdp.all_reduce(1, 'sum') end");
  fsdp_host_tensor out = {.data = &a->result};
  if (a->status == FSDP_OK) a->status = fsdp_call(rt, "f", NULL, 0, &out, 1);
  fsdp_runtime_free(rt);
  return NULL;
}

static void test_lifetimes(void) {
  /* two runtimes at once, on two host threads: separate groups */
  thread_arg a = {.world = 2}, b = {.world = 3};
  pthread_t ta, tb;
  pthread_create(&ta, NULL, run_other, &a);
  pthread_create(&tb, NULL, run_other, &b);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  CHECK(a.status == FSDP_OK && a.result == 2, "runtime A: %d %g", a.status, a.result);
  CHECK(b.status == FSDP_OK && b.result == 3, "runtime B: %d %g", b.status, b.result);

  /* freed with live tensors everywhere: globals, a gathered unit, a tape without backward */
  fsdp_runtime *rt = make(2);
  if (rt == NULL) return;
  OK(rt, fsdp_run_string(rt, "local fsdp = require 'fsdp'\n"
                             "big = fsdp.randn{64, 64}\n"
                             "m = fsdp.nn.Linear(16, 16)\n"
                             "fsdp.wrap(m)\n"
                             "fsdp.units(m)[1]:gather()\n"
                             "pending = m(fsdp.randn{4, 16}):sum()   -- never backward"));
  fsdp_runtime_free(rt);
}

int main(void) {
  test_create();
  test_run();
  test_call();
  test_params();
  test_gpt();
  test_failure();
  test_callbacks();
  test_lifetimes();
  if (failures == 0) printf("embed_check: %d checks passed\n", checks);
  else printf("embed_check: %d of %d checks FAILED\n", failures, checks);
  return failures == 0 ? 0 : 1;
}
