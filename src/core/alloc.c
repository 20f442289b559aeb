/*
 * alloc.c — memory accounting: live and peak bytes per memory domain, device and role, and
 * the optional byte cap (FSDP_MEM_LIMIT) that turns "this model would not fit" into an error
 * before the machine starts swapping.
 *
 * A domain is one rank's ledger. The thread that runs a rank makes it current
 * (fsdp_mem_domain_set, a thread-local); threads that set none charge the process domain.
 * Every counter is atomic because a storage charged on one thread may be released on
 * another (Lua GC, a peer rank dropping a zero-copy buffer): the storage remembers its
 * domain and uncharges exactly there.
 *
 * Lifetime: a domain made by fsdp_mem_domain_new holds one reference for its creator and one
 * per live charge; it is freed when the last goes (fsdp_mem_domain_free drops the creator's).
 * The process domain is static and never freed.
 *
 * The cap is checked with a compare-and-swap on the device's live total, so two threads
 * allocating in one domain at once cannot both slip under it. Meta allocations are counted
 * (what they would cost once materialized) but never capped.
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

struct fsdp_mem_domain {
  _Atomic int64_t live[FSDP_MAX_DEVICES][FSDP_ROLE_COUNT];
  _Atomic int64_t peak[FSDP_MAX_DEVICES][FSDP_ROLE_COUNT];
  _Atomic int64_t live_total[FSDP_MAX_DEVICES];
  _Atomic int64_t peak_total[FSDP_MAX_DEVICES];
  _Atomic int64_t limit; /* bytes per data-holding device; 0 = none */
  _Atomic int64_t refs;  /* creator + one per live charge (unused for the process domain) */
  bool is_process;
};

static fsdp_mem_domain process_domain = {.is_process = true};
static _Thread_local fsdp_mem_domain *current_domain; /* NULL: the process domain */

static const char *const role_names[FSDP_ROLE_COUNT] = {
    [FSDP_ROLE_OTHER] = "other",         [FSDP_ROLE_PARAMS] = "params",
    [FSDP_ROLE_GRADS] = "grads",         [FSDP_ROLE_OPTIM] = "optim",
    [FSDP_ROLE_ACTIVATIONS] = "activations", [FSDP_ROLE_GATHERED] = "gathered",
};

const char *fsdp_role_name(fsdp_role r) {
  return (unsigned)r < FSDP_ROLE_COUNT ? role_names[r] : "?";
}

/* ---- sizes --------------------------------------------------------------------------------- */

/* Parse without touching the error slot (the environment is read lazily, inside calls that
 * must not clobber the caller's message); on failure writes why into err. */
static int parse_size(const char *text, int64_t *out, char *err, size_t errn) {
  const char *p = text;
  while (p && isspace((unsigned char)*p)) p++;
  char *end = NULL;
  double v = p ? strtod(p, &end) : 0;
  if (!p || end == p || !(v >= 0) || isinf(v)) goto bad;
  p = end;
  while (isspace((unsigned char)*p)) p++; /* "3 K" */
  double mult = 1;
  switch (tolower((unsigned char)*p)) {
  case 'k': mult = 1024.0; break;
  case 'm': mult = 1024.0 * 1024; break;
  case 'g': mult = 1024.0 * 1024 * 1024; break;
  case 't': mult = 1024.0 * 1024 * 1024 * 1024; break;
  }
  if (mult > 1) {
    p++;
    if (*p == 'i' || *p == 'I') p++;
  }
  if (*p == 'b' || *p == 'B') p++;
  while (isspace((unsigned char)*p)) p++;
  if (*p) goto bad;
  v *= mult;
  if (v >= 9.2e18) goto bad;
  *out = (int64_t)v;
  return FSDP_OK;
bad:
  snprintf(err, errn,
           "cannot parse size '%s' (expected a byte count, optionally with a K, M, G or T "
           "suffix, e.g. 512M or 2G)",
           text ? text : "(null)");
  return FSDP_ERR;
}

int fsdp_mem_parse_size(const char *text, int64_t *out) {
  char err[256];
  if (parse_size(text, out, err, sizeof err) != FSDP_OK) return fsdp_error("%s", err);
  return FSDP_OK;
}

/* "1.5 MiB"; exact bytes below 1 KiB */
static char *human_bytes(char *buf, size_t n, int64_t b) {
  static const char *const units[] = {"KiB", "MiB", "GiB", "TiB"};
  if (b < 1024 && b > -1024) {
    snprintf(buf, n, "%lld B", (long long)b);
    return buf;
  }
  double v = (double)b;
  int u = -1;
  while (u < 3 && (v >= 1024 || v <= -1024)) v /= 1024, u++;
  snprintf(buf, n, "%.1f %s", v, units[u]);
  return buf;
}

/* ---- the environment ----------------------------------------------------------------------- */

static pthread_once_t env_once = PTHREAD_ONCE_INIT;
static char env_error[320]; /* non-empty: FSDP_MEM_LIMIT was malformed; allocations fail */

static void read_env(void) {
  const char *s = getenv("FSDP_MEM_LIMIT");
  if (!s || !*s) return;
  int64_t v;
  char err[256];
  if (parse_size(s, &v, err, sizeof err) != FSDP_OK)
    snprintf(env_error, sizeof env_error, "FSDP_MEM_LIMIT: %s", err);
  else
    atomic_store(&process_domain.limit, v);
}

static void ensure_env(void) { pthread_once(&env_once, read_env); }

/* ---- domains ------------------------------------------------------------------------------- */

fsdp_mem_domain *fsdp_mem_domain_new(void) {
  ensure_env();
  fsdp_mem_domain *d = calloc(1, sizeof *d);
  if (!d) return NULL;
  atomic_store(&d->limit, atomic_load(&process_domain.limit));
  atomic_store(&d->refs, 1);
  return d;
}

static void domain_unref(fsdp_mem_domain *d) {
  if (!d->is_process && atomic_fetch_sub(&d->refs, 1) == 1) free(d);
}

void fsdp_mem_domain_free(fsdp_mem_domain *d) {
  if (!d || d->is_process) return;
  if (current_domain == d) current_domain = NULL;
  domain_unref(d);
}

void fsdp_mem_domain_set(fsdp_mem_domain *d) {
  current_domain = (d && !d->is_process) ? d : NULL;
}

fsdp_mem_domain *fsdp_mem_domain_current(void) {
  return current_domain ? current_domain : &process_domain;
}

void fsdp_mem_set_limit(fsdp_mem_domain *d, int64_t bytes) {
  ensure_env(); /* so a later first read of the environment cannot overwrite this */
  if (!d) d = fsdp_mem_domain_current();
  atomic_store(&d->limit, bytes > 0 ? bytes : 0);
}

int64_t fsdp_mem_get_limit(const fsdp_mem_domain *d) {
  ensure_env();
  if (!d) d = fsdp_mem_domain_current();
  return atomic_load(&((fsdp_mem_domain *)d)->limit);
}

void fsdp_mem_report_get(const fsdp_mem_domain *cd, fsdp_mem_report *out) {
  /* atomic loads need a non-const object; the domain is not modified */
  fsdp_mem_domain *d = cd ? (fsdp_mem_domain *)cd : fsdp_mem_domain_current();
  memset(out, 0, sizeof *out);
  out->ndevices = fsdp_device_count();
  for (int i = 0; i < out->ndevices; i++) {
    out->device[i] = fsdp_device_at(i)->name;
    fsdp_mem_counts *c = &out->counts[i];
    for (int r = 0; r < FSDP_ROLE_COUNT; r++) {
      c->live[r] = atomic_load(&d->live[i][r]);
      c->peak[r] = atomic_load(&d->peak[i][r]);
    }
    c->live_total = atomic_load(&d->live_total[i]);
    c->peak_total = atomic_load(&d->peak_total[i]);
  }
}

void fsdp_mem_reset_peak(fsdp_mem_domain *d) {
  if (!d) d = fsdp_mem_domain_current();
  for (int i = 0; i < FSDP_MAX_DEVICES; i++) {
    for (int r = 0; r < FSDP_ROLE_COUNT; r++)
      atomic_store(&d->peak[i][r], atomic_load(&d->live[i][r]));
    atomic_store(&d->peak_total[i], atomic_load(&d->live_total[i]));
  }
}

/* ---- charging ------------------------------------------------------------------------------ */

static void atomic_max(_Atomic int64_t *p, int64_t v) {
  int64_t old = atomic_load_explicit(p, memory_order_relaxed);
  while (old < v && !atomic_compare_exchange_weak(p, &old, v)) {
  }
}

int fsdp_mem_charge(fsdp_mem_domain *d, const fsdp_device_i *dev, fsdp_role role,
                    size_t bytes) {
  ensure_env();
  if (env_error[0]) return fsdp_error("%s", env_error);
  if (!d) d = fsdp_mem_domain_current();
  int di = fsdp_device_index(dev);
  if (di < 0)
    return fsdp_error("allocating on device '%s': not a registered device",
                      dev && dev->name ? dev->name : "(null)");
  if ((unsigned)role >= FSDP_ROLE_COUNT)
    return fsdp_error("allocating on %s: invalid memory role %d", dev->name, (int)role);
  if (bytes > (size_t)INT64_MAX / 2)
    return fsdp_error("allocating %zu bytes on %s: size too large", bytes, dev->name);
  int64_t b = (int64_t)bytes;

  int64_t total;
  if (dev->has_data) {
    int64_t limit = atomic_load(&d->limit);
    int64_t old = atomic_load(&d->live_total[di]);
    do {
      total = old + b;
      if (limit > 0 && total > limit) {
        char req[32], want[32], cap[32];
        human_bytes(req, sizeof req, b);
        human_bytes(want, sizeof want, total);
        human_bytes(cap, sizeof cap, limit);
        if (strcmp(want, cap) == 0) { /* rounding hid the difference: show exact bytes */
          snprintf(want, sizeof want, "%lld bytes", (long long)total);
          snprintf(cap, sizeof cap, "%lld bytes", (long long)limit);
        }
        return fsdp_error("out of memory budget: allocating %s of %s on %s would bring live "
                          "bytes to %s, limit is %s (FSDP_MEM_LIMIT)",
                          req, role_names[role], dev->name, want, cap);
      }
    } while (!atomic_compare_exchange_weak(&d->live_total[di], &old, total));
  } else {
    total = atomic_fetch_add(&d->live_total[di], b) + b;
  }
  atomic_max(&d->peak_total[di], total);
  atomic_max(&d->peak[di][role], atomic_fetch_add(&d->live[di][role], b) + b);
  if (!d->is_process) atomic_fetch_add(&d->refs, 1);
  return FSDP_OK;
}

void fsdp_mem_uncharge(fsdp_mem_domain *d, const fsdp_device_i *dev, fsdp_role role,
                       size_t bytes) {
  if (!d) d = fsdp_mem_domain_current();
  int di = fsdp_device_index(dev);
  /* only ever called to undo a successful charge, which validated both */
  if (di < 0 || (unsigned)role >= FSDP_ROLE_COUNT) return;
  atomic_fetch_sub(&d->live[di][role], (int64_t)bytes);
  atomic_fetch_sub(&d->live_total[di], (int64_t)bytes);
  domain_unref(d);
}
