/*
 * rngtab.c — the fix-up tables that make the cuda device's normals the cpu's bit for bit
 * (exact.h explains why they exist): for every 24-bit input k of Box-Muller's logf and
 * sincosf, the host's C library result where it differs from the f32 that fsdp_x_log_u1 /
 * fsdp_x_sincos_u2 compute. Built once per process on a few threads (3 x 2^24 evaluations),
 * in host memory; the device uploads them per GPU (convert.cu).
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#include "core/core.h"
#include "kernels/cuda/exact.h"

#define PARTS 8 /* threads building the tables */

typedef struct list {
  uint32_t *key;
  float *value;
  size_t n, cap;
} list;

typedef struct part {
  uint32_t k0, k1;
  list l[3]; /* log, sin, cos */
  bool failed;
} part;

static bool push(list *l, uint32_t k, float v) {
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 4096;
    uint32_t *key = realloc(l->key, cap * sizeof *key);
    if (key) l->key = key;
    float *value = realloc(l->value, cap * sizeof *value);
    if (value) l->value = value;
    if (!key || !value) return false;
    l->cap = cap;
  }
  l->key[l->n] = k, l->value[l->n] = v;
  l->n++;
  return true;
}

/* the cpu's own computation (core's rng.c, normal4) next to the device's */
static void *build_part(void *arg) {
  part *p = arg;
  for (uint32_t k = p->k0; k < p->k1 && !p->failed; k++) {
    float u1 = (float)(k + 1) * (1.0f / 16777216.0f);
    float u2 = (float)k * (1.0f / 16777216.0f);
    float lg = logf(u1), s, c, ds, dc;
    sincosf(6.28318530717958647692f * u2, &s, &c);
    fsdp_x_sincos_u2(k, &ds, &dc);
    /* compared as bits: a NaN or a signed zero must match too */
    if (fsdp_x_f32_bits(lg) != fsdp_x_f32_bits(fsdp_x_log_u1(k))) p->failed |= !push(&p->l[0], k, lg);
    if (fsdp_x_f32_bits(s) != fsdp_x_f32_bits(ds)) p->failed |= !push(&p->l[1], k, s);
    if (fsdp_x_f32_bits(c) != fsdp_x_f32_bits(dc)) p->failed |= !push(&p->l[2], k, c);
  }
  return NULL;
}

static struct {
  fsdp_x_normal_tables t;
  uint32_t *mem;
  bool ok;
} tables;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void build(void) {
  part parts[PARTS] = {0};
  pthread_t th[PARTS];
  bool started[PARTS] = {0};
  uint32_t span = (1u << 24) / PARTS;
  for (int i = 0; i < PARTS; i++) {
    parts[i].k0 = (uint32_t)i * span;
    parts[i].k1 = i == PARTS - 1 ? 1u << 24 : (uint32_t)(i + 1) * span;
    started[i] = pthread_create(&th[i], NULL, build_part, &parts[i]) == 0;
    if (!started[i]) build_part(&parts[i]); /* no thread: do it here */
  }
  size_t total[3] = {0};
  bool failed = false;
  for (int i = 0; i < PARTS; i++) {
    if (started[i]) pthread_join(th[i], NULL);
    failed |= parts[i].failed;
    for (int f = 0; f < 3; f++) total[f] += parts[i].l[f].n;
  }
  /* one allocation: per table the bucket starts, the keys and the values */
  size_t words = 0;
  for (int f = 0; f < 3; f++) words += (FSDP_X_FIX_BUCKETS + 1) + 2 * total[f];
  uint32_t *mem = failed ? NULL : malloc(words * sizeof *mem);
  if (mem) {
    uint32_t *w = mem;
    fsdp_x_fixups *fx[3] = {&tables.t.log, &tables.t.sin, &tables.t.cos};
    for (int f = 0; f < 3; f++) {
      uint32_t *start = w, *key = w + FSDP_X_FIX_BUCKETS + 1;
      float *value = (float *)(key + total[f]);
      w = (uint32_t *)(value + total[f]);
      size_t n = 0;
      for (int i = 0; i < PARTS; i++) /* parts are in order of k, each sorted */
        for (size_t j = 0; j < parts[i].l[f].n; j++, n++)
          key[n] = parts[i].l[f].key[j], value[n] = parts[i].l[f].value[j];
      size_t e = 0;
      for (uint32_t b = 0; b <= FSDP_X_FIX_BUCKETS; b++) {
        while (e < n && (key[e] >> FSDP_X_FIX_SHIFT) < b) e++;
        start[b] = (uint32_t)e;
      }
      *fx[f] = (fsdp_x_fixups){.start = start, .key = key, .value = value};
    }
    tables.mem = mem;
    tables.ok = true;
  }
  for (int i = 0; i < PARTS; i++)
    for (int f = 0; f < 3; f++) free(parts[i].l[f].key), free(parts[i].l[f].value);
}

int fsdp_cuda_normal_fixups(const fsdp_x_normal_tables **out) {
  pthread_once(&once, build);
  *out = tables.ok ? &tables.t : NULL;
  return tables.ok ? FSDP_OK
                   : fsdp_error("cuda: out of host memory for the random normals' tables");
}
