/*
 * host_trainer.c — a host program that embeds fsdprun (include/fsdp.h): 2 local ranks train a
 * small MLP, defined in a Lua string, on a regression task whose data lives in this program's
 * memory; the ranks pull their batches from here (the data source), report through the log
 * callback, and the trained weights are read back to check, in C, that they are what the
 * engine evaluated. Exit status 0 when everything checks out.
 *
 *   host_trainer [--steps=N] [--quiet]
 *
 * Build against an installed tree:  cc host_trainer.c $(pkg-config --cflags --libs fsdp)
 * Run by tests/recipes/embed_example.sh (also under valgrind) and embed_install.sh.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

enum { IN = 8, HIDDEN = 32, OUT = 4, BATCH = 16, NTRAIN = 1024, NVAL = 256 };

/* The model and the functions the host calls, run on every rank. Batches come from the host
 * (fsdp.host.next_batch); each rank gets its own, and the sharded optimizer averages the
 * gradients, so the 2 ranks train on 2 x BATCH rows per step. */
static const char MODEL_LUA[] =
    "local fsdp = require 'fsdp'\n"
    "local nn = fsdp.nn\n"
    "fsdp.manual_seed(7)\n"
    "local Net = nn.Module:extend('Net')\n"
    "function Net:init(i, h, o)\n"
    "  self.fc1 = nn.Linear(i, h)\n"
    "  self.fc2 = nn.Linear(h, o)\n"
    "end\n"
    "function Net:forward(x) return self.fc2(self.fc1(x):relu()) end\n"
    "model = fsdp.host.model(Net(8, 32, 4))    -- fsdp_read_param reads this model\n"
    "fsdp.wrap(model, {policy = fsdp.policy.modules{nn.Linear}})\n"
    "local opt = fsdp.optim.AdamW(model, {lr = 0.01, weight_decay = 0})\n"
    "local step = 0\n"
    "-- One epoch: until the host's data source says it is done. Returns the mean loss of\n"
    "-- the epoch's last step over the ranks.\n"
    "function train_epoch()\n"
    "  local last\n"
    "  while true do\n"
    "    local x, y = fsdp.host.next_batch()\n"
    "    if x == nil then break end\n"
    "    step = step + 1\n"
    "    opt:zero_grad()\n"
    "    local loss = nn.F.mse(model(x), y)\n"
    "    loss:backward()\n"
    "    opt:step()\n"
    "    last = fsdp.all_reduce(loss:item(), 'mean')\n"
    "    fsdp.log(step, {loss = last})\n"
    "  end\n"
    "  return last\n"
    "end\n"
    "-- Loss on host memory (x, y are views of the host's arrays for this call only).\n"
    "function evaluate(x, y)\n"
    "  return fsdp.no_grad(function() return nn.F.mse(model(x), y):item() end)\n"
    "end\n"
    "fsdp.log.setup{every = 25}\n";

/* The host's data: x uniform in [-1, 1], y = tanh(A x + c) for a fixed A, c. */
typedef struct data {
  float xtrain[NTRAIN][IN], ytrain[NTRAIN][OUT];
  float xval[NVAL][IN], yval[NVAL][OUT];
  int64_t limit;   /* a rank's batch index at which the current epoch ends */
  int steps;       /* batches per rank per epoch */
  int batches[2];  /* served, per rank */
} data;

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float uniform(void) { /* xorshift64*: reproducible, no libc rand */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (float)((rng_state * 2685821657736338717ull) >> 40) / (float)(1 << 24) * 2.0f - 1.0f;
}

static void make_data(data *d) {
  float A[OUT][IN], c[OUT];
  for (int o = 0; o < OUT; o++) {
    for (int i = 0; i < IN; i++) A[o][i] = uniform();
    c[o] = 0.2f * uniform();
  }
  for (int n = 0; n < NTRAIN + NVAL; n++) {
    float *x = n < NTRAIN ? d->xtrain[n] : d->xval[n - NTRAIN];
    float *y = n < NTRAIN ? d->ytrain[n] : d->yval[n - NTRAIN];
    for (int i = 0; i < IN; i++) x[i] = uniform();
    for (int o = 0; o < OUT; o++) {
      float s = c[o];
      for (int i = 0; i < IN; i++) s += A[o][i] * x[i];
      y[o] = tanhf(s);
    }
  }
}

/* The data source: rank r's k-th batch is rows [(k * world + r) * BATCH, +BATCH) of the training
 * set (wrapping around), handed out as views of this program's arrays (the runtime copies them
 * before this returns to Lua). */
static int next_batch(void *ud, fsdp_batch *b) {
  data *d = ud;
  if (b->index >= d->limit) return FSDP_DONE;
  int64_t first = ((b->index * b->world + b->rank) * BATCH) % NTRAIN;
  b->n = 2;
  b->tensors[0] = (fsdp_host_tensor){.data = d->xtrain[first], .ndim = 2, .shape = {BATCH, IN}};
  b->tensors[1] = (fsdp_host_tensor){.data = d->ytrain[first], .ndim = 2, .shape = {BATCH, OUT}};
  if (b->rank < 2) d->batches[b->rank]++;
  return FSDP_OK;
}

typedef struct log_state {
  bool quiet;
  int lines, loss_lines;
} log_state;

static void on_log(void *ud, int rank, const char *line) {
  log_state *s = ud;
  s->lines++;
  if (strstr(line, "loss") != NULL) s->loss_lines++;
  if (!s->quiet) printf("[lua %d] %s\n", rank, line);
}

/* The MLP's forward and MSE in C, with weights read back from the runtime. */
typedef struct weights {
  float w1[HIDDEN][IN], b1[HIDDEN], w2[OUT][HIDDEN], b2[OUT];
} weights;

static double host_mse(const weights *w, const data *d) {
  double sum = 0;
  for (int n = 0; n < NVAL; n++) {
    float h[HIDDEN];
    for (int j = 0; j < HIDDEN; j++) {
      float s = w->b1[j];
      for (int i = 0; i < IN; i++) s += w->w1[j][i] * d->xval[n][i];
      h[j] = s > 0 ? s : 0;
    }
    for (int o = 0; o < OUT; o++) {
      float s = w->b2[o];
      for (int j = 0; j < HIDDEN; j++) s += w->w2[o][j] * h[j];
      double e = (double)s - d->yval[n][o];
      sum += e * e;
    }
  }
  return sum / (NVAL * OUT);
}

/* Read one parameter, checking its shape first. */
static int read_param(fsdp_runtime *rt, const char *path, float *buf, int ndim_want,
                      const int64_t *shape_want) {
  int ndim;
  int64_t shape[FSDP_HOST_MAX_DIMS];
  if (fsdp_param_shape(rt, path, &ndim, shape) != FSDP_OK) return -1;
  int64_t count = 1;
  bool same = ndim == ndim_want;
  for (int k = 0; k < ndim; k++) {
    count *= shape[k];
    if (same && shape[k] != shape_want[k]) same = false;
  }
  if (!same) {
    fprintf(stderr, "host_trainer: %s has an unexpected shape (%d dims)\n", path, ndim);
    return -1;
  }
  return fsdp_read_param(rt, path, buf, count);
}

static double evaluate(fsdp_runtime *rt, data *d, int *status) {
  fsdp_host_tensor in[2] = {
      {.data = &d->xval[0][0], .ndim = 2, .shape = {NVAL, IN}},
      {.data = &d->yval[0][0], .ndim = 2, .shape = {NVAL, OUT}},
  };
  float loss = NAN;
  fsdp_host_tensor out = {.data = &loss, .ndim = 0};
  *status = fsdp_call(rt, "evaluate", in, 2, &out, 1);
  return loss;
}

int main(int argc, char **argv) {
  int epochs = 6, steps = 40;
  log_state logs = {0};
  for (int i = 1; i < argc; i++) {
    if (strncmp(argv[i], "--steps=", 8) == 0) steps = atoi(argv[i] + 8);
    else if (strcmp(argv[i], "--quiet") == 0) logs.quiet = true;
    else {
      fprintf(stderr, "usage: host_trainer [--steps=N] [--quiet]\n");
      return 2;
    }
  }
  if (steps < 1) steps = 1;
  data *d = calloc(1, sizeof *d);
  weights *w = calloc(1, sizeof *w);
  if (d == NULL || w == NULL) return 1;
  make_data(d);
  d->steps = steps;

  fsdp_runtime *rt = NULL;
  int rc = 1, st;
  if (fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.world = 2, .timeout_s = 60}) != FSDP_OK) {
    fprintf(stderr, "host_trainer: %s\n", fsdp_last_error(NULL));
    goto out;
  }
  printf("fsdp %s: %d ranks\n", fsdp_version(), fsdp_runtime_world(rt));
  fsdp_set_log_callback(rt, on_log, &logs);
  fsdp_set_data_source(rt, next_batch, d);
#define CHECK(call)                                                                               \
  do {                                                                                            \
    if ((st = (call)) != FSDP_OK) {                                                               \
      fprintf(stderr, "host_trainer: %s: %s (%s)\n", #call, fsdp_last_error(rt),                  \
              fsdp_status_name(st));                                                              \
      goto out;                                                                                   \
    }                                                                                             \
  } while (0)

  CHECK(fsdp_run_string(rt, MODEL_LUA));
  double before = evaluate(rt, d, &st);
  CHECK(st);
  printf("validation loss before training: %.6f\n", before);

  float last = NAN;
  for (int e = 0; e < epochs; e++) {
    d->limit += steps;
    fsdp_host_tensor out = {.data = &last, .ndim = 0};
    CHECK(fsdp_call(rt, "train_epoch", NULL, 0, &out, 1));
  }
  double after = evaluate(rt, d, &st);
  CHECK(st);
  printf("validation loss after %d steps: %.6f (last training loss %.6f)\n", epochs * steps,
         after, last);

  CHECK(read_param(rt, "fc1.weight", &w->w1[0][0], 2, (int64_t[]){HIDDEN, IN}));
  CHECK(read_param(rt, "fc1.bias", w->b1, 1, (int64_t[]){HIDDEN}));
  CHECK(read_param(rt, "fc2.weight", &w->w2[0][0], 2, (int64_t[]){OUT, HIDDEN}));
  CHECK(read_param(rt, "fc2.bias", w->b2, 1, (int64_t[]){OUT}));
  double host = host_mse(w, d);
  printf("validation loss from the weights read back, computed here: %.6f\n", host);

  bool ok = true;
  if (!(after < 0.2 * before)) {
    fprintf(stderr, "host_trainer: the loss did not fall enough (%.6f -> %.6f)\n", before, after);
    ok = false;
  }
  if (!(fabs(host - after) <= 1e-4 * fabs(after) + 1e-6)) {
    fprintf(stderr, "host_trainer: weights read back give %.8f, the engine %.8f\n", host, after);
    ok = false;
  }
  if (d->batches[0] != epochs * steps || d->batches[1] != epochs * steps) {
    fprintf(stderr, "host_trainer: served %d and %d batches, expected %d each\n", d->batches[0],
            d->batches[1], epochs * steps);
    ok = false;
  }
  if (logs.loss_lines == 0) {
    fprintf(stderr, "host_trainer: no fsdp.log line reached the log callback\n");
    ok = false;
  }
  printf("%s\n", ok ? "host_trainer: ok" : "host_trainer: FAILED");
  rc = ok ? 0 : 1;
out:
  fsdp_runtime_free(rt);
  free(d);
  free(w);
  return rc;
}
