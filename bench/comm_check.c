/*
 * comm_check.c — benchmark (not a test): what the always-on fingerprint check costs per
 * collective. Figures: docs/PERFORMANCE.md ("The fingerprint check").
 *
 *   build/bench/comm_check [--worlds=2,4,8] [--calls=2000] [--iters=9]      (local backend)
 *   mpirun -np N build/bench/comm_check --mpi [--calls=2000] [--iters=9]    (mpi backend)
 *
 * A barrier and an 8-float all_reduce carry no data worth the name, so their time is the
 * rendezvous, and the rendezvous is the check. Each is timed under the hash check (the default:
 * the ranks fold a 48-byte vector of fingerprint hashes) and under the full check
 * (fsdp_comm_set_full_check: every rank's whole fingerprint reaches every rank, the protocol
 * before hashing, O(N) messages per rank). Rounds interleave the four cases so the load of a
 * shared machine hits them alike; a round is --calls calls back to back, timed on rank 0 after a
 * barrier; reported: the median over --iters rounds in microseconds per call, and full / hash.
 * Under mpi, a raw MPI_Barrier round is the floor (what the transport costs without the engine).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "comm/comm.h"
#include "comm/mpi.h"

#if __has_include(<mpi.h>)
#include <mpi.h>
#define HAVE_MPI_H 1
#endif

static int g_calls = 2000, g_iters = 9;

static void check(int rc, int rank) {
  if (rc != FSDP_OK) {
    fprintf(stderr, "comm_check [rank %d]: %s\n", rank, fsdp_error_msg());
    exit(1);
  }
}

enum { C_BAR_HASH, C_BAR_FULL, C_AR_HASH, C_AR_FULL, C_RAW, NCASE };
static const char *const case_name[NCASE] = {"barrier", "barrier", "all_reduce x8", "all_reduce x8",
                                             "MPI_Barrier"};

/* One round of case k on this rank: `calls` collectives; seconds per call (rank 0's clock). */
static double round_of(fsdp_comm *c, int k, int rank) {
  float buf[8] = {0};
  fsdp_comm_set_full_check(c, k == C_BAR_FULL || k == C_AR_FULL);
  check(fsdp_comm_barrier(c, "sync"), rank);
  double t0 = bench_now();
  for (int i = 0; i < g_calls; i++) {
    switch (k) {
    case C_BAR_HASH:
    case C_BAR_FULL: check(fsdp_comm_barrier(c, "b"), rank); break;
    case C_AR_HASH:
    case C_AR_FULL: check(fsdp_comm_all_reduce(c, buf, 8, FSDP_DTYPE_F32, FSDP_RED_SUM, "ar"), rank); break;
#ifdef HAVE_MPI_H
    case C_RAW: MPI_Barrier(MPI_COMM_WORLD); break;
#endif
    default: break;
    }
  }
  return (bench_now() - t0) / g_calls;
}

static void report(const char *backend, int world, double t[NCASE][64], bool raw) {
  double m[NCASE];
  for (int k = 0; k < NCASE; k++) m[k] = (k == C_RAW && !raw) ? 0 : bench_median(t[k], g_iters);
  printf("%-6s %5d  %-14s %9.1f %9.1f %7.2f\n", backend, world, case_name[C_BAR_HASH],
         1e6 * m[C_BAR_HASH], 1e6 * m[C_BAR_FULL], m[C_BAR_FULL] / m[C_BAR_HASH]);
  printf("%-6s %5d  %-14s %9.1f %9.1f %7.2f\n", backend, world, case_name[C_AR_HASH],
         1e6 * m[C_AR_HASH], 1e6 * m[C_AR_FULL], m[C_AR_FULL] / m[C_AR_HASH]);
  if (raw) printf("%-6s %5d  %-14s %9.1f\n", backend, world, case_name[C_RAW], 1e6 * m[C_RAW]);
  fflush(stdout);
}

static void header(void) {
  printf("backend ranks  collective     hash(us)  full(us)  full/hash   (%d calls a round, median of %d)\n",
         g_calls, g_iters);
}

/* ---- local: rank threads ------------------------------------------------------------------ */

typedef struct {
  fsdp_local_group *g;
  int rank;
  double (*t)[64];
} local_arg;

static void *local_rank(void *p) {
  local_arg *a = p;
  fsdp_comm *c;
  check(fsdp_comm_local_new(&c, a->g, a->rank), a->rank);
  for (int it = 0; it < g_iters; it++) {
    for (int k = 0; k < C_RAW; k++) {
      double s = round_of(c, k, a->rank);
      if (a->rank == 0) a->t[k][it] = s;
    }
  }
  fsdp_comm_free(c);
  return NULL;
}

static void run_local(int world) {
  fsdp_local_group *g;
  check(fsdp_local_group_new(&g, world), 0);
  double t[NCASE][64];
  pthread_t th[64];
  local_arg a[64];
  for (int r = 0; r < world; r++) {
    a[r] = (local_arg){.g = g, .rank = r, .t = t};
    pthread_create(&th[r], NULL, local_rank, &a[r]);
  }
  for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
  fsdp_local_group_release(g);
  report("local", world, t, false);
}

int main(int argc, char **argv) {
  bool mpi = false;
  char worlds[128] = "2,4,8";
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--mpi") == 0) mpi = true;
    else if (strncmp(argv[i], "--calls=", 8) == 0) g_calls = atoi(argv[i] + 8);
    else if (strncmp(argv[i], "--iters=", 8) == 0) g_iters = atoi(argv[i] + 8);
    else if (strncmp(argv[i], "--worlds=", 9) == 0) snprintf(worlds, sizeof worlds, "%s", argv[i] + 9);
    else {
      fprintf(stderr, "comm_check: unknown argument '%s'\n", argv[i]);
      return 2;
    }
  }
  if (g_calls < 1 || g_iters < 1 || g_iters > 64) {
    fprintf(stderr, "comm_check: --calls must be >= 1 and --iters 1..64\n");
    return 2;
  }
  if (!mpi) {
    header();
    for (char *s = strtok(worlds, ","); s; s = strtok(NULL, ",")) {
      int w = atoi(s);
      if (w < 1 || w > 64) {
        fprintf(stderr, "comm_check: a world of %d ranks is outside 1..64\n", w);
        return 2;
      }
      run_local(w);
    }
    return 0;
  }
#ifndef HAVE_MPI_H
  fprintf(stderr, "comm_check: built without Open MPI (install libopenmpi-dev and rebuild)\n");
  return 2;
#else
  fsdp_comm *c;
  check(fsdp_comm_mpi_new(&c), -1);
  int rank = fsdp_comm_rank(c), world = fsdp_comm_world(c);
  double t[NCASE][64];
  for (int it = 0; it < g_iters; it++)
    for (int k = 0; k < NCASE; k++) t[k][it] = round_of(c, k, rank);
  if (rank == 0) {
    header();
    report("mpi", world, t, true);
  }
  fsdp_comm_free(c);
  return 0;
#endif
}
