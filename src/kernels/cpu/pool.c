/*
 * pool.c — the rank's threads for the cpu kernels (pool.h).
 *
 * Each thread that calls fsdp_cpu_parallel_for with more than one chunk owns a pool
 * (thread-local): its workers and one job slot. Ranks are threads (src/host), so every rank has
 * its own pool and never waits on another rank's kernels.
 *
 * A job: the owner writes fn, ctx and the chunking into the slot, then publishes one 64-bit
 * claim word (job sequence << 32 | chunks << 16 | next unclaimed chunk) with release order and
 * bumps `gen`, the workers' futex word. Chunk 0 is the owner's; anyone (owner or worker) takes
 * the next chunk by a compare-and-swap on the claim word, which fails for a stale job, so a
 * late worker can never run a chunk of a job it did not see published. `remaining` counts
 * unfinished chunks; the owner waits for it to reach 0 (spinning briefly, then yielding as the
 * workers do below, then on a futex),
 * which is also what keeps the slot unchanged while anyone still reads it. Who runs a chunk
 * never changes what it computes: results depend on the chunking alone.
 *
 * Waiting: after a job a worker spins SPIN_NS on `gen` (the next kernel usually follows within
 * microseconds), then keeps checking it between sched_yield calls until YIELD_NS, then sleeps
 * on the futex; the owner wakes sleepers only when there are some. Yielding keeps a worker off
 * the futex through the owner's short serial stretches (the Lua and autograd work between two
 * kernels often takes longer than SPIN_NS, and on a shared host a woken thread can wait long
 * for its core), while any other runnable thread on that core (a rank's communication thread,
 * another process) gets it. No thread spins while its owner is busy elsewhere for longer than
 * SPIN_NS, or yields for longer than YIELD_NS. Workers block every signal (signals are the rank
 * threads' business).
 *
 * Lifetime: a pthread key destructor joins a rank thread's workers when it exits; a library
 * destructor does the same for the thread that exits the process (or unloads the library), so
 * tools such as valgrind see every worker joined. A forked child forgets the workers it did
 * not inherit and starts new ones on its next job.
 */
#include "kernels/cpu/pool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* How long an idle thread spins before sleeping on its futex (docs/PERFORMANCE.md, "The
 * rank's thread pool": a futex wake costs ~5-60 us on a loaded machine, a spinning worker picks a
 * job up in well under a microsecond). */
#define SPIN_NS 50000
/* Until when an idle worker yields its core, checking for the next job in between, before it
 * sleeps (docs/PERFORMANCE.md, "The rank's thread pool": at 50 us alone the workers of a
 * one-rank L=4 step went to sleep some 70 times a step). */
#define YIELD_NS 500000

typedef struct pool {
  int nworkers;
  bool create_failed; /* pthread_create failed: run with the workers there are */
  pthread_t tids[FSDP_CPU_MAX_THREADS];
  /* the job: written by the owner before the claim word is published */
  fsdp_cpu_task fn;
  void *ctx;
  int64_t n, unit;
  int nchunks;
  uint32_t seq;
  _Atomic uint64_t claim;
  _Atomic int32_t remaining;     /* owner's futex word */
  _Atomic int32_t owner_waiting;
  _Atomic uint32_t gen;          /* workers' futex word */
  _Atomic int32_t sleepers;
  _Atomic int32_t stop;
} pool;

static __thread pool *tl_pool;
static __thread int tl_threads; /* 0: the process default */
static __thread int tl_depth;   /* > 0 inside a task, and always on workers */

static _Atomic int g_default;   /* 0: fsdp_cpu_cores() */
static pthread_key_t g_key;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static _Atomic bool g_key_live;

/* ---- futex and clock ------------------------------------------------------------------------- */

static void futex_wait(void *word, uint32_t val) {
  syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake(void *word, int n) {
  syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* ---- thread counts --------------------------------------------------------------------------- */

static int clamp_threads(int n) { return n > FSDP_CPU_MAX_THREADS ? FSDP_CPU_MAX_THREADS : n; }

int fsdp_cpu_cores(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)(n < FSDP_CPU_MAX_THREADS ? n : FSDP_CPU_MAX_THREADS) : 1;
}

void fsdp_cpu_set_default_threads(int n) { atomic_store(&g_default, n < 1 ? 0 : clamp_threads(n)); }

int fsdp_cpu_default_threads(void) {
  int n = atomic_load_explicit(&g_default, memory_order_relaxed);
  return n > 0 ? n : clamp_threads(fsdp_cpu_cores());
}

int fsdp_cpu_threads(void) {
  if (tl_depth > 0) return 1;
  return tl_threads > 0 ? tl_threads : fsdp_cpu_default_threads();
}

void fsdp_cpu_set_threads(int n) {
  tl_threads = n < 1 ? 0 : clamp_threads(n);
  if (tl_pool && tl_pool->nworkers + 1 > fsdp_cpu_threads()) fsdp_cpu_pool_release();
}

/* ---- chunks ---------------------------------------------------------------------------------- */

int fsdp_cpu_chunks(int64_t n, int64_t grain) {
  if (n <= 0) return 1;
  if (grain < 1) grain = 1;
  const int threads = fsdp_cpu_threads();
  return n / grain < threads ? (n / grain < 1 ? 1 : (int)(n / grain)) : threads;
}

/* Boundaries are multiples of unit (16 when grain is, else 1) over n / unit whole units; the
 * last chunk ends at n. */
static void chunk_bounds(int64_t n, int64_t unit, int nchunks, int i, int64_t *lo, int64_t *hi) {
  const int64_t units = n / unit;
  *lo = unit * ((int64_t)i * units / nchunks);
  *hi = i == nchunks - 1 ? n : unit * ((int64_t)(i + 1) * units / nchunks);
}

static int64_t chunk_unit(int64_t grain) { return grain % 16 == 0 ? 16 : 1; }

void fsdp_cpu_chunk_bounds(int64_t n, int64_t grain, int nchunks, int i, int64_t *lo,
                           int64_t *hi) {
  if (nchunks <= 1) {
    *lo = 0;
    *hi = n;
    return;
  }
  chunk_bounds(n, chunk_unit(grain < 1 ? 1 : grain), nchunks, i, lo, hi);
}

int fsdp_cpu_chunk_at(int64_t n, int64_t grain, int nchunks, int64_t lo) {
  for (int i = 0; i < nchunks; i++) {
    int64_t a, b;
    fsdp_cpu_chunk_bounds(n, grain, nchunks, i, &a, &b);
    if (a == lo) return i;
  }
  return 0;
}

static void run_chunk(pool *p, int i) {
  int64_t lo, hi;
  chunk_bounds(p->n, p->unit, p->nchunks, i, &lo, &hi);
  p->fn(p->ctx, lo, hi);
  if (atomic_fetch_sub(&p->remaining, 1) == 1 && atomic_load(&p->owner_waiting))
    futex_wake(&p->remaining, 1);
}

/* Take and run unclaimed chunks of whatever job is published until none is left. */
static void claim_chunks(pool *p) {
  uint64_t c = atomic_load_explicit(&p->claim, memory_order_acquire);
  for (;;) {
    unsigned next = (unsigned)(c & 0xffff), nch = (unsigned)((c >> 16) & 0xffff);
    if (next >= nch) return;
    if (atomic_compare_exchange_weak_explicit(&p->claim, &c, c + 1, memory_order_acq_rel,
                                              memory_order_acquire)) {
      run_chunk(p, (int)next);
      c = atomic_load_explicit(&p->claim, memory_order_acquire);
    }
  }
}

/* ---- workers --------------------------------------------------------------------------------- */

/* Wait a while for done(p, arg) before the caller sleeps on its futex: spinning SPIN_NS, then
 * yielding until YIELD_NS ("Waiting" above). The workers wait so for the next job, the owner
 * for the workers' chunks. */
static inline void wait_awhile(const pool *p, bool (*done)(const pool *, uint32_t),
                               uint32_t arg) {
  const int64_t t0 = now_ns();
  for (int k = 0; !done(p, arg); k++) {
    cpu_relax();
    if ((k & 63) == 63 && now_ns() > t0 + SPIN_NS) break;
  }
  while (!done(p, arg) && now_ns() < t0 + YIELD_NS) sched_yield();
}

static bool job_after(const pool *p, uint32_t g) {
  return atomic_load_explicit(&p->gen, memory_order_relaxed) != g;
}

static bool chunks_done(const pool *p, uint32_t unused) {
  (void)unused;
  return atomic_load_explicit(&p->remaining, memory_order_acquire) == 0;
}

static void *worker_main(void *arg) {
  pool *p = arg;
  tl_depth = 1;
  uint32_t g = atomic_load(&p->gen);
  for (;;) {
    claim_chunks(p);
    wait_awhile(p, job_after, g);
    if (atomic_load(&p->gen) == g) {
      atomic_fetch_add(&p->sleepers, 1);
      /* stop is set before gen moves: a g read after the last move still sees it here */
      if (atomic_load(&p->gen) == g && !atomic_load(&p->stop)) futex_wait(&p->gen, g);
      atomic_fetch_sub(&p->sleepers, 1);
    }
    if (atomic_load(&p->stop)) break;
    g = atomic_load(&p->gen);
  }
  return NULL;
}

static void pool_stop(pool *p) {
  atomic_store(&p->stop, 1);
  atomic_fetch_add(&p->gen, 1);
  futex_wake(&p->gen, p->nworkers);
  for (int i = 0; i < p->nworkers; i++) pthread_join(p->tids[i], NULL);
  p->nworkers = 0;
  atomic_store(&p->stop, 0);
}

static void key_destructor(void *arg) {
  pool *p = arg;
  pool_stop(p);
  free(p);
  if (tl_pool == p) tl_pool = NULL;
}

/* A forked child has only the thread that forked: its pool's workers are gone (the owner would
 * run every chunk itself, but exit would join threads that do not exist). */
static void after_fork_child(void) {
  if (tl_pool) {
    tl_pool->nworkers = 0;
    tl_pool->create_failed = false;
    atomic_store(&tl_pool->sleepers, 0);
  }
}

static void make_key(void) {
  if (pthread_key_create(&g_key, key_destructor) == 0) atomic_store(&g_key_live, true);
  pthread_atfork(NULL, NULL, after_fork_child);
}

/* The process (or this library) is going away on this thread: join its workers, and make sure
 * no thread exiting later runs a destructor in unloaded code. */
__attribute__((destructor)) static void pool_unload(void) {
  fsdp_cpu_pool_release();
  if (atomic_exchange(&g_key_live, false)) pthread_key_delete(g_key);
}

void fsdp_cpu_pool_release(void) {
  pool *p = tl_pool;
  if (!p || tl_depth > 0) return; /* not from inside a task: its workers are in use */
  tl_pool = NULL;
  if (atomic_load(&g_key_live)) pthread_setspecific(g_key, NULL);
  pool_stop(p);
  free(p);
}

int fsdp_cpu_pool_workers(void) { return tl_pool ? tl_pool->nworkers : 0; }

int fsdp_cpu_pool_sleeping(void) { return tl_pool ? atomic_load(&tl_pool->sleepers) : 0; }

/* The calling thread's pool with at least `want` workers started (fewer if threads cannot be
 * created: the owner then runs the rest of the chunks); NULL without memory. */
static pool *pool_get(int want) {
  pool *p = tl_pool;
  if (!p) {
    pthread_once(&g_once, make_key);
    if (!atomic_load(&g_key_live) || !(p = calloc(1, sizeof *p))) return NULL;
    if (pthread_setspecific(g_key, p) != 0) {
      free(p);
      return NULL;
    }
    tl_pool = p;
  }
  if (p->nworkers < want && !p->create_failed) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    while (p->nworkers < want) {
      if (pthread_create(&p->tids[p->nworkers], NULL, worker_main, p) != 0) {
        p->create_failed = true;
        break;
      }
      p->nworkers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
  }
  return p;
}

/* ---- parallel_for ---------------------------------------------------------------------------- */

void fsdp_cpu_parallel_for(int64_t n, int64_t grain, fsdp_cpu_task fn, void *ctx) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  const int nchunks = fsdp_cpu_chunks(n, grain);
  if (nchunks < 2) {
    fn(ctx, 0, n);
    return;
  }
  const int64_t unit = chunk_unit(grain);
  tl_depth++;
  pool *p = pool_get(nchunks - 1);
  if (!p) {
    /* no memory for a pool: the same chunks, in order, on this thread */
    for (int i = 0; i < nchunks; i++) {
      int64_t lo, hi;
      chunk_bounds(n, unit, nchunks, i, &lo, &hi);
      fn(ctx, lo, hi);
    }
    tl_depth--;
    return;
  }
  p->fn = fn;
  p->ctx = ctx;
  p->n = n;
  p->unit = unit;
  p->nchunks = nchunks;
  p->seq++;
  atomic_store_explicit(&p->remaining, nchunks, memory_order_relaxed);
  atomic_store_explicit(&p->claim, (uint64_t)p->seq << 32 | (uint64_t)nchunks << 16 | 1,
                        memory_order_release);
  atomic_fetch_add(&p->gen, 1);
  if (atomic_load(&p->sleepers) > 0) futex_wake(&p->gen, nchunks - 1);
  run_chunk(p, 0);
  claim_chunks(p);
  /* wait for the workers' chunks: a while (a worker's chunk on a core the host slows can end a
   * little later than ours), then on the futex */
  wait_awhile(p, chunks_done, 0);
  for (;;) {
    int32_t r = atomic_load(&p->remaining);
    if (r == 0) break;
    atomic_store(&p->owner_waiting, 1);
    r = atomic_load(&p->remaining);
    if (r != 0) futex_wait(&p->remaining, (uint32_t)r);
    atomic_store(&p->owner_waiting, 0);
  }
  tl_depth--;
}
