/*
 * onednn.c — matrix products through oneDNN (gemm.h): its matmul primitive for the native bf16
 * path and f32 linears with a bias (gemm_bf16.c), bf16 attention's products batched over the
 * heads (attention_bf16.c) and the GEMM benchmark; dnnl_sgemm for f32 GEMMs where the choice
 * (gemm_bf16.c) takes it.
 *
 * Strided row-major operands map onto oneDNN memory descriptors by strides (a transposed
 * operand is the same matrix with its strides swapped), so nothing is copied; beta is a sum
 * post-op, alpha an output scale, the bias oneDNN's own. Creating a primitive costs tens of
 * microseconds to milliseconds (JIT), so each thread that plans keeps the last CACHE primitives
 * it made, keyed by the whole shape; the cache and the thread's stream are freed when the thread
 * exits. Scratch is the caller's (oneDNN's user scratchpad mode), so a primitive may run on any
 * thread and the memory report sees the bytes.
 *
 * Threads: Debian's oneDNN runs on OpenMP (libgomp) and would use every core per call; the rank's
 * pool owns the threads, so every thread that plans or runs sets its own OpenMP thread count to
 * 1 (omp_set_num_threads acts on the calling thread only, looked up at run time so that nothing
 * here links OpenMP), and oneDNN then runs inline without starting an OpenMP team. dnnl_sgemm
 * keeps no state of ours: it only needs that setting, once per thread.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

#include "kernels/cpu/gemm.h"

#define CACHE 128

struct fsdp_cpu_mm {
  fsdp_cpu_mm_shape s;
  dnnl_primitive_t prim;
  const_dnnl_primitive_desc_t pd; /* owned by prim */
  size_t scratch;
  uint64_t used; /* the thread's tick at the last plan: least recent is evicted */
};

typedef struct {
  fsdp_cpu_mm mm[CACHE];
  int n;
  uint64_t tick;
  dnnl_stream_t stream;
} thread_state;

static pthread_once_t once = PTHREAD_ONCE_INIT;
static pthread_key_t state_key;
static dnnl_engine_t engine;
static dnnl_status_t engine_status = dnnl_runtime_error;
static void (*omp_threads)(int);

static void state_free(void *p) {
  thread_state *t = p;
  for (int i = 0; i < t->n; i++)
    if (t->mm[i].prim) dnnl_primitive_destroy(t->mm[i].prim);
  if (t->stream) dnnl_stream_destroy(t->stream);
  free(t);
}

static void init_once(void) {
  engine_status = dnnl_engine_create(&engine, dnnl_cpu, 0);
  pthread_key_create(&state_key, state_free);
  omp_threads = (void (*)(int))dlsym(RTLD_DEFAULT, "omp_set_num_threads");
}

/* The calling thread's state, made on first use (one OpenMP thread from then on); NULL and the
 * error set when oneDNN cannot give an engine or a stream. */
static thread_state *state(void) {
  pthread_once(&once, init_once);
  if (engine_status != dnnl_success) {
    fsdp_error("onednn: no cpu engine (status %d)", (int)engine_status);
    return NULL;
  }
  thread_state *t = pthread_getspecific(state_key);
  if (t) return t;
  t = calloc(1, sizeof *t);
  if (!t) {
    fsdp_error("onednn: out of memory for a thread's state");
    return NULL;
  }
  dnnl_status_t st = dnnl_stream_create(&t->stream, engine, dnnl_stream_default_flags);
  if (st != dnnl_success) {
    free(t);
    fsdp_error("onednn: no stream (status %d)", (int)st);
    return NULL;
  }
  if (omp_threads) omp_threads(1);
  pthread_setspecific(state_key, t);
  return t;
}

/* The calling thread at one OpenMP thread, once per thread (dnnl_sgemm needs no other state). */
static _Thread_local bool one_thread;

int fsdp_cpu_onednn_sgemm(float *c, const float *a, const float *b, int M, int N, int K,
                          bool trans_a, bool trans_b, float alpha, float beta, int lda, int ldb,
                          int ldc) {
  if (!one_thread) {
    pthread_once(&once, init_once);
    if (omp_threads) omp_threads(1);
    one_thread = true;
  }
  dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, a, lda,
                                b, ldb, beta, c, ldc);
  if (st != dnnl_success)
    return fsdp_error("onednn: sgemm %d x %d x %d (trans %d%d, ld %d %d %d) failed (status %d)",
                      M, N, K, trans_a, trans_b, lda, ldb, ldc, (int)st);
  return FSDP_OK;
}

bool fsdp_cpu_onednn_avx512(void) {
  const unsigned want = dnnl_cpu_isa_avx512_core;
  return ((unsigned)dnnl_get_effective_cpu_isa() & want) == want;
}

bool fsdp_cpu_onednn_version(char *buf, size_t n) {
  const dnnl_version_t *v = dnnl_version();
  snprintf(buf, n, "%d.%d.%d", v->major, v->minor, v->patch);
  return true;
}

bool fsdp_cpu_onednn_bf16(void) {
  const unsigned want = dnnl_cpu_isa_avx512_core_bf16;
  return ((unsigned)dnnl_get_effective_cpu_isa() & want) == want;
}

static dnnl_data_type_t dnnl_dt(fsdp_dtype dt) {
  return dt == FSDP_DTYPE_BF16 ? dnnl_bf16 : dnnl_f32;
}

/* Row-major rows x cols with row stride ld, read transposed when trans: the (r, c) element of
 * the logical matrix is at c * ld + r then. */
static dnnl_status_t md_init(dnnl_memory_desc_t *md, fsdp_dtype dt, int rows, int cols, int ld,
                             bool trans, int batch, int64_t bs) {
  if (batch > 1) {
    dnnl_dims_t dims = {batch, rows, cols};
    dnnl_dims_t strides = {bs, trans ? 1 : ld, trans ? ld : 1};
    return dnnl_memory_desc_init_by_strides(md, 3, dims, dnnl_dt(dt), strides);
  }
  dnnl_dims_t dims = {rows, cols};
  dnnl_dims_t strides = {trans ? 1 : ld, trans ? ld : 1};
  return dnnl_memory_desc_init_by_strides(md, 2, dims, dnnl_dt(dt), strides);
}

/* The four user descriptors of a shape: src (M, K), weights (K, N), dst (M, N), bias (1, N). */
static dnnl_status_t shape_mds(const fsdp_cpu_mm_shape *s, dnnl_memory_desc_t *a,
                               dnnl_memory_desc_t *b, dnnl_memory_desc_t *c,
                               dnnl_memory_desc_t *bias) {
  if (s->batch > 1 && s->bdt != FSDP_DTYPE_COUNT) return dnnl_invalid_arguments;
  dnnl_status_t st = md_init(a, s->abdt, s->M, s->K, s->lda, s->trans_a, s->batch, s->bsa);
  if (st == dnnl_success)
    st = md_init(b, s->abdt, s->K, s->N, s->ldb, s->trans_b, s->batch, s->bsb);
  if (st == dnnl_success) st = md_init(c, s->cdt, s->M, s->N, s->ldc, false, s->batch, s->bsc);
  if (st == dnnl_success && s->bdt != FSDP_DTYPE_COUNT)
    st = md_init(bias, s->bdt, 1, s->N, s->N, false, 0, 0);
  return st;
}

static bool same_shape(const fsdp_cpu_mm_shape *x, const fsdp_cpu_mm_shape *y) {
  return x->abdt == y->abdt && x->cdt == y->cdt && x->bdt == y->bdt && x->M == y->M &&
         x->N == y->N && x->K == y->K && x->trans_a == y->trans_a && x->trans_b == y->trans_b &&
         x->lda == y->lda && x->ldb == y->ldb && x->ldc == y->ldc &&
         memcmp(&x->alpha, &y->alpha, sizeof x->alpha) == 0 &&
         memcmp(&x->beta, &y->beta, sizeof x->beta) == 0 &&
         (x->batch > 1 ? x->batch : 1) == (y->batch > 1 ? y->batch : 1) &&
         (x->batch <= 1 || (x->bsa == y->bsa && x->bsb == y->bsb && x->bsc == y->bsc));
}

static dnnl_status_t create(fsdp_cpu_mm *m, const fsdp_cpu_mm_shape *s) {
  dnnl_memory_desc_t a, b, c, bias;
  dnnl_matmul_desc_t desc;
  dnnl_primitive_attr_t attr = NULL;
  dnnl_post_ops_t po = NULL;
  dnnl_primitive_desc_t pd = NULL;
  dnnl_status_t st = shape_mds(s, &a, &b, &c, &bias);
  if (st == dnnl_success)
    st = dnnl_matmul_desc_init(&desc, &a, &b, s->bdt != FSDP_DTYPE_COUNT ? &bias : NULL, &c);
  if (st == dnnl_success) st = dnnl_primitive_attr_create(&attr);
  if (st == dnnl_success) st = dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
  if (st == dnnl_success && s->alpha != 1.0f)
    st = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &s->alpha);
  if (st == dnnl_success && s->beta != 0.0f) {
    st = dnnl_post_ops_create(&po);
    if (st == dnnl_success) st = dnnl_post_ops_append_sum(po, s->beta);
    if (st == dnnl_success) st = dnnl_primitive_attr_set_post_ops(attr, po);
  }
  if (st == dnnl_success) st = dnnl_primitive_desc_create(&pd, &desc, attr, engine, NULL);
  if (st == dnnl_success) st = dnnl_primitive_create(&m->prim, pd);
  if (st == dnnl_success) st = dnnl_primitive_get_primitive_desc(m->prim, &m->pd);
  if (st == dnnl_success) {
    const dnnl_memory_desc_t *sm = dnnl_primitive_desc_query_md(m->pd, dnnl_query_scratchpad_md, 0);
    m->scratch = sm ? dnnl_memory_desc_get_size(sm) : 0;
    m->s = *s;
  } else if (m->prim) {
    dnnl_primitive_destroy(m->prim);
    m->prim = NULL;
  }
  if (pd) dnnl_primitive_desc_destroy(pd);
  if (po) dnnl_post_ops_destroy(po);
  if (attr) dnnl_primitive_attr_destroy(attr);
  return st;
}

int fsdp_cpu_mm_plan(fsdp_cpu_mm **out, size_t *scratch, const fsdp_cpu_mm_shape *s) {
  thread_state *t = state();
  if (!t) return FSDP_ERR;
  t->tick++;
  fsdp_cpu_mm *m = NULL;
  for (int i = 0; i < t->n && !m; i++)
    if (same_shape(&t->mm[i].s, s)) m = &t->mm[i];
  if (!m) {
    if (t->n < CACHE) {
      m = &t->mm[t->n++];
    } else { /* replace the least recent in place: the other plans keep their addresses */
      m = &t->mm[0];
      for (int i = 1; i < CACHE; i++)
        if (t->mm[i].used < m->used) m = &t->mm[i];
      if (m->prim) dnnl_primitive_destroy(m->prim);
    }
    memset(m, 0, sizeof *m); /* M == 0: never matches a shape */
    dnnl_status_t st = create(m, s);
    if (st != dnnl_success) {
      memset(m, 0, sizeof *m);
      return fsdp_error("onednn: no matmul for %s x %s -> %s (%d x %d x %d, trans %d%d, "
                        "ld %d %d %d): status %d",
                        fsdp_dtype_name(s->abdt), fsdp_dtype_name(s->abdt),
                        fsdp_dtype_name(s->cdt), s->M, s->N, s->K, s->trans_a, s->trans_b,
                        s->lda, s->ldb, s->ldc, (int)st);
    }
  }
  m->used = t->tick;
  *out = m;
  *scratch = m->scratch;
  return FSDP_OK;
}

int fsdp_cpu_mm_run(const fsdp_cpu_mm *p, void *c, const void *a, const void *b,
                    const void *bias, void *scratch) {
  thread_state *t = state();
  if (!t) return FSDP_ERR;
  const fsdp_cpu_mm_shape *s = &p->s;
  dnnl_memory_desc_t ma, mb, mc, mbias;
  dnnl_memory_t mem[5] = {NULL, NULL, NULL, NULL, NULL};
  dnnl_exec_arg_t args[5];
  int nargs = 0;
  dnnl_status_t st = shape_mds(s, &ma, &mb, &mc, &mbias);
  struct {
    int arg;
    const dnnl_memory_desc_t *md;
    const void *data;
  } in[5] = {{DNNL_ARG_SRC, &ma, a}, {DNNL_ARG_WEIGHTS, &mb, b}, {DNNL_ARG_DST, &mc, c},
             {DNNL_ARG_BIAS, &mbias, bias}, {DNNL_ARG_SCRATCHPAD, NULL, scratch}};
  if (s->bdt == FSDP_DTYPE_COUNT) in[3].arg = -1;
  if (p->scratch == 0) in[4].arg = -1;
  else in[4].md = dnnl_primitive_desc_query_md(p->pd, dnnl_query_scratchpad_md, 0);
  for (int i = 0; i < 5 && st == dnnl_success; i++) {
    if (in[i].arg < 0) continue;
    st = dnnl_memory_create(&mem[nargs], in[i].md, engine, (void *)in[i].data);
    if (st == dnnl_success) args[nargs] = (dnnl_exec_arg_t){in[i].arg, mem[nargs]}, nargs++;
  }
  if (st == dnnl_success) st = dnnl_primitive_execute(p->prim, t->stream, nargs, args);
  if (st == dnnl_success) st = dnnl_stream_wait(t->stream);
  for (int i = 0; i < nargs; i++) dnnl_memory_destroy(mem[i]);
  if (st != dnnl_success)
    return fsdp_error("onednn: matmul %d x %d x %d failed (status %d)", s->M, s->N, s->K, (int)st);
  return FSDP_OK;
}

const char *fsdp_cpu_mm_impl(const fsdp_cpu_mm *p) {
  const char *impl = "?";
  dnnl_primitive_desc_query(p->pd, dnnl_query_impl_info_str, 0, &impl);
  return impl;
}
