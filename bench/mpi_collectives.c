/*
 * mpi_collectives.c — benchmark (not a test): all_gather and reduce_scatter bandwidth through
 * the engine's mpi backend versus raw MPI on the same buffers, and whether an asynchronous
 * all_gather advances while the caller computes. Figures: docs/mpi.md.
 *
 *   mpirun -np 2 build/bench/mpi_collectives [--sizes=1,16,64] [--iters=7]
 *   mpirun -np 2 --mca btl tcp,self build/bench/mpi_collectives      (over TCP)
 *
 * Per shard size (MiB per rank; the full buffer is world x shard), the operations of a row run
 * twice untimed, then --iters rounds of each in turn (interleaved, so that the load of a shared
 * machine hits them alike), each call started together (MPI_Barrier) and timed as the slowest
 * rank's. Reported: the median time as algbw = full buffer bytes / time (the convention of
 * nccl-tests and docs/mpi.md), and "vs raw", the median over rounds of raw time / engine time
 * (the faster raw reduce-scatter of the round). Operations:
 *   all_gather      raw MPI_Allgather                    vs fsdp_comm_all_gather
 *   reduce_scatter  raw MPI_Reduce_scatter_block (sum)   vs fsdp_comm_reduce_scatter (sum)
 *                   raw by hand: MPI_Sendrecv with every peer into staging, then the add in
 *                   rank order (the ones to beat)
 * Progress: the 16 MiB all_gather started nonblocking, then 3x its blocking time of compute that
 * makes no MPI call, then the wait: raw (MPI_Iallgather ... MPI_Wait) against the engine
 * (fsdp_comm_start ... fsdp_comm_wait). Open MPI does not progress without calls, so the raw
 * wait is about the whole transfer; the engine's progress thread should leave little to wait.
 *
 * Built with the other benchmarks (every .c in bench/); without Open MPI it says so and exits.
 */
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

#ifndef HAVE_MPI_H
int main(void) {
  printf("mpi_collectives: built without Open MPI (install libopenmpi-dev and rebuild)\n");
  return 0;
}
#else

static int g_rank, g_world;

typedef void (*op_fn)(void *ctx);

/* The slowest rank's time of one call, every rank starting together. */
static double once(op_fn fn, void *ctx) {
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = bench_now();
  fn(ctx);
  double dt = bench_now() - t0, worst;
  MPI_Allreduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

/* The ops of one row, interleaved: iteration k runs each op once, in turn, so that a change of
 * load on a shared machine hits them alike. t[j] gets op j's median time; ratio the median over
 * iterations of t_op0 / t_op_last (raw / engine when the engine is last). */
static void timed_row(op_fn *fns, int nfn, void *ctx, int iters, double *t, double *ratio) {
  double *all = malloc((size_t)(iters * nfn) * sizeof *all), *r = malloc((size_t)iters * sizeof *r);
  for (int j = 0; j < nfn; j++) fns[j](ctx), fns[j](ctx); /* warm up */
  for (int k = 0; k < iters; k++) {
    for (int j = 0; j < nfn; j++) all[j * iters + k] = once(fns[j], ctx);
    double best_raw = all[k];
    for (int j = 1; j < nfn - 1; j++)
      if (all[j * iters + k] < best_raw) best_raw = all[j * iters + k];
    r[k] = best_raw / all[(nfn - 1) * iters + k];
  }
  for (int j = 0; j < nfn; j++) t[j] = bench_median(all + j * iters, iters);
  *ratio = bench_median(r, iters);
  free(all);
  free(r);
}

typedef struct bench {
  fsdp_comm *c;
  int64_t n;        /* floats per shard */
  float *ag_send;   /* (n) */
  float *ag_recv;   /* (world * n) */
  float *rs_send;   /* (world * n) */
  float *rs_recv;   /* (n) */
  float *stage;     /* ((world - 1) * n) for the hand-written reduce-scatter */
} bench;

static void check(int rc) {
  if (rc != FSDP_OK) {
    fprintf(stderr, "[rank %d] %s\n", g_rank, fsdp_error_msg());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

static void raw_ag(void *p) {
  bench *b = p;
  MPI_Allgather(b->ag_send, (int)b->n, MPI_FLOAT, b->ag_recv, (int)b->n, MPI_FLOAT,
                MPI_COMM_WORLD);
}
static void eng_ag(void *p) {
  bench *b = p;
  check(fsdp_comm_all_gather(b->c, b->ag_recv, b->ag_send, b->n, FSDP_DTYPE_F32, "bench.ag"));
}
static void raw_rs_lib(void *p) {
  bench *b = p;
  MPI_Reduce_scatter_block(b->rs_send, b->rs_recv, (int)b->n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}
/* MPI_Sendrecv with every peer (pairwise: send chunk dst, receive from src), then the sum in
 * rank order. */
static void raw_rs_hand(void *p) {
  bench *b = p;
  const int W = g_world, r = g_rank;
  const int64_t n = b->n;
  for (int k = 1; k < W; k++) {
    int dst = (r + k) % W, src = (r - k + W) % W;
    int slot = src < r ? src : src - 1;
    MPI_Sendrecv(b->rs_send + (int64_t)dst * n, (int)n, MPI_FLOAT, dst, 7, b->stage + slot * n,
                 (int)n, MPI_FLOAT, src, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
  const float *own = b->rs_send + (int64_t)r * n;
  for (int64_t i = 0; i < n; i++) {
    float s = 0;
    for (int q = 0; q < W; q++) s += q == r ? own[i] : b->stage[(q < r ? q : q - 1) * n + i];
    b->rs_recv[i] = s;
  }
}
static void eng_rs(void *p) {
  bench *b = p;
  check(fsdp_comm_reduce_scatter(b->c, b->rs_recv, b->rs_send, b->n, FSDP_DTYPE_F32, FSDP_RED_SUM, "bench.rs"));
}

static void busy(double seconds) {
  volatile double x = 0;
  double t0 = bench_now();
  while (bench_now() - t0 < seconds) x = x + 1.0;
}

/* The wait after `compute` seconds of compute, raw and through the engine (median of 5). */
static void progress(bench *b, double compute, double *raw_wait, double *eng_wait) {
  double rw[5], ew[5];
  for (int k = 0; k < 5; k++) {
    MPI_Request req;
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Iallgather(b->ag_send, (int)b->n, MPI_FLOAT, b->ag_recv, (int)b->n, MPI_FLOAT,
                   MPI_COMM_WORLD, &req);
    busy(compute);
    double t0 = bench_now();
    MPI_Wait(&req, MPI_STATUS_IGNORE);
    double dt = bench_now() - t0;
    MPI_Allreduce(&dt, &rw[k], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);

    MPI_Barrier(MPI_COMM_WORLD);
    fsdp_coll kk = {.op = FSDP_COLL_ALL_GATHER, .dtype = FSDP_DTYPE_F32, .count = b->n,
                    .send = b->ag_send, .recv = b->ag_recv};
    snprintf(kk.label, sizeof kk.label, "bench.progress");
    fsdp_comm_req *r;
    check(fsdp_comm_start(b->c, &kk, &r));
    busy(compute);
    t0 = bench_now();
    check(fsdp_comm_wait(r));
    dt = bench_now() - t0;
    MPI_Allreduce(&dt, &ew[k], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  }
  qsort(rw, 5, sizeof *rw, bench_cmp_double);
  qsort(ew, 5, sizeof *ew, bench_cmp_double);
  *raw_wait = rw[2];
  *eng_wait = ew[2];
}

int main(int argc, char **argv) {
  int iters = 15;
  char sizes_s[256] = "1,16,64";
  for (int i = 1; i < argc; i++) {
    if (strncmp(argv[i], "--iters=", 8) == 0) iters = atoi(argv[i] + 8);
    else if (strncmp(argv[i], "--sizes=", 8) == 0) snprintf(sizes_s, sizeof sizes_s, "%s", argv[i] + 8);
  }
  if (iters < 1) iters = 1;
  fsdp_comm *c;
  if (fsdp_comm_mpi_new(&c) != FSDP_OK) {
    fprintf(stderr, "mpi_collectives: %s\n", fsdp_error_msg());
    return 1;
  }
  g_rank = fsdp_comm_rank(c);
  g_world = fsdp_comm_world(c);
  if (g_rank == 0) {
    char lib[MPI_MAX_LIBRARY_VERSION_STRING];
    int len;
    MPI_Get_library_version(lib, &len);
    char *nl = strchr(lib, '\n');
    if (nl) *nl = '\0';
    printf("mpi_collectives: %d ranks, %s, thread level %s, median of %d\n", g_world, lib,
           fsdp_mpi_thread_level(), iters);
    printf("%-15s %8s %12s %12s %12s %7s\n", "op", "shard", "raw GB/s", "raw2 GB/s", "engine GB/s",
           "vs raw");
  }
  bench b = {.c = c};
  char *save = NULL;
  for (char *tok = strtok_r(sizes_s, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    int mib = atoi(tok);
    if (mib <= 0) continue;
    b.n = (int64_t)mib * (1 << 20) / 4;
    const int64_t n = b.n, W = g_world;
    b.ag_send = malloc((size_t)n * 4);
    b.ag_recv = malloc((size_t)(n * W) * 4);
    b.rs_send = malloc((size_t)(n * W) * 4);
    b.rs_recv = malloc((size_t)n * 4);
    b.stage = malloc((size_t)(n * (W > 1 ? W - 1 : 1)) * 4);
    if (!b.ag_send || !b.ag_recv || !b.rs_send || !b.rs_recv || !b.stage) {
      fprintf(stderr, "out of memory at %d MiB\n", mib);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int64_t i = 0; i < n; i++) b.ag_send[i] = (float)(i % 1000) + g_rank;
    for (int64_t i = 0; i < n * W; i++) b.rs_send[i] = (float)(i % 777) * 0.5f;
    memset(b.ag_recv, 0, (size_t)(n * W) * 4);
    memset(b.rs_recv, 0, (size_t)n * 4);
    memset(b.stage, 0, (size_t)(n * (W > 1 ? W - 1 : 1)) * 4);
    double bytes = (double)(n * W) * 4;
    double t[3], ratio;
    op_fn ag[] = {raw_ag, eng_ag};
    timed_row(ag, 2, &b, iters, t, &ratio);
    if (g_rank == 0)
      printf("%-15s %5d MiB %12.2f %12s %12.2f %6.0f%%\n", "all_gather", mib, bytes / t[0] / 1e9,
             "-", bytes / t[1] / 1e9, 100.0 * ratio);
    op_fn rs[] = {raw_rs_lib, raw_rs_hand, eng_rs};
    timed_row(rs, 3, &b, iters, t, &ratio);
    if (g_rank == 0)
      printf("%-15s %5d MiB %12.2f %12.2f %12.2f %6.0f%%\n", "reduce_scatter", mib,
             bytes / t[0] / 1e9, bytes / t[1] / 1e9, bytes / t[2] / 1e9, 100.0 * ratio);
    if (mib == 16 && g_world > 1) {
      double tb[9];
      for (int k = 0; k < 9; k++) tb[k] = once(raw_ag, &b);
      double t_block = bench_median(tb, 9), rw, ew;
      progress(&b, 3 * t_block, &rw, &ew);
      if (g_rank == 0)
        printf("progress: 16 MiB all_gather (%.2f ms blocking), then %.2f ms of compute without "
               "MPI calls: the wait takes %.2f ms raw (MPI_Iallgather/MPI_Wait), %.2f ms through "
               "the engine\n", t_block * 1e3, 3 * t_block * 1e3, rw * 1e3, ew * 1e3);
    }
    free(b.ag_send);
    free(b.ag_recv);
    free(b.rs_send);
    free(b.rs_recv);
    free(b.stage);
  }
  if (g_rank == 0) printf("(raw: MPI_Allgather; MPI_Reduce_scatter_block; raw2: MPI_Sendrecv + add)\n");
  fsdp_comm_free(c);
  fsdp_mpi_finalize();
  return 0;
}
#endif
