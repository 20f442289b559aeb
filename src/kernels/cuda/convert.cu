/*
 * convert.cu — conversions and data movement on the cuda device: cast, strided copy and add,
 * fill, arange, random. Every value is the cpu's, bit for bit: conversions follow core's rules
 * (exact.h, common.cuh), random draws the same Philox stream with the same float operations
 * (normals through the fix-up tables of exact.h / rngtab.c), and add_strided adds each
 * destination's repeats one after another in the cpu's order.
 */
#include <pthread.h>

#include "kernels/cuda/common.cuh"

using namespace fsdp_cu;

/* ---- cast ---------------------------------------------------------------------------------- */

template <typename I, typename O> __global__ void cast_k(O *out, const I *in, int64_t n) {
  FSDP_CU_LOOP(i, n) out[i] = from_d<O>(to_d(in[i]));
}

int fsdp_cuda_cast(void *ctx, void *out, fsdp_dtype odt, const void *in, fsdp_dtype idt,
                   int64_t n) {
  if (!known(odt)) return FSDP_CU_REFUSE("cast", odt);
  if (!known(idt)) return FSDP_CU_REFUSE("cast", idt);
  if (n <= 0) return FSDP_OK;
  if (odt == idt) /* memmove semantics, as the cpu's */
    return fsdp_device_cuda.copy(ctx, out, in, (size_t)n * fsdp_dtype_size(odt));
  cudaStream_t s = fsdp_cuda_stream();
  return with_any(idt, [&](auto it) {
    using I = decltype(it);
    return with_any(odt, [&](auto ot) {
      using O = decltype(ot);
      cast_k<I, O><<<blocks_for(n), THREADS, 0, s>>>((O *)out, (const I *)in, n);
      return fsdp_cuda_launched("cast");
    });
  });
}

/* ---- strided copy and add ------------------------------------------------------------------- */

#define GEOM_DIMS 16 /* views add a dim to FSDP_MAX_DIMS (expand): room to spare */

/* dims in row-major order; a copy visits every element, an add only the destination dims and
 * loops over the repeat dims (destination stride 0) inside one thread */
struct geom {
  int nd;
  int64_t shape[GEOM_DIMS], ds[GEOM_DIMS], ss[GEOM_DIMS];
};

static int geom_of(geom *g, int ndim, const int64_t *shape, const int64_t *ds,
                   const int64_t *ss, int64_t *n, const char *op) {
  if (ndim < 0 || ndim > GEOM_DIMS)
    return fsdp_error("%s: %d dims (the cuda device takes up to %d)", op, ndim, GEOM_DIMS);
  g->nd = ndim;
  *n = 1;
  for (int k = 0; k < ndim; k++) {
    g->shape[k] = shape[k], g->ds[k] = ds[k], g->ss[k] = ss[k];
    *n *= shape[k];
  }
  return FSDP_OK;
}

/* element sizes as unsigned words: a copy moves bytes */
template <typename E> __global__ void copy_strided_k(E *dst, const E *src, geom g, int64_t n) {
  FSDP_CU_LOOP(i, n) {
    int64_t rem = i, od = 0, os = 0;
    for (int k = g.nd - 1; k >= 0; k--) {
      const int64_t x = rem % g.shape[k];
      rem /= g.shape[k];
      od += x * g.ds[k];
      os += x * g.ss[k];
    }
    dst[od] = src[os];
  }
}

int fsdp_cuda_copy_strided(void *ctx, fsdp_dtype dt, void *dst, const int64_t *dst_strides,
                           const void *src, const int64_t *src_strides, int ndim,
                           const int64_t *shape) {
  geom g;
  int64_t n = 0;
  if (!known(dt)) return FSDP_CU_REFUSE("copy", dt);
  if (geom_of(&g, ndim, shape, dst_strides, src_strides, &n, "copy")) return FSDP_ERR;
  if (n <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  const unsigned b = blocks_for(n);
  switch (fsdp_dtype_size(dt)) {
  case 1: copy_strided_k<<<b, THREADS, 0, s>>>((uint8_t *)dst, (const uint8_t *)src, g, n); break;
  case 2: copy_strided_k<<<b, THREADS, 0, s>>>((uint16_t *)dst, (const uint16_t *)src, g, n); break;
  case 4: copy_strided_k<<<b, THREADS, 0, s>>>((uint32_t *)dst, (const uint32_t *)src, g, n); break;
  default: copy_strided_k<<<b, THREADS, 0, s>>>((uint64_t *)dst, (const uint64_t *)src, g, n);
  }
  return fsdp_cuda_launched("copy");
}

/* dst + src as the cpu adds them: f32 in f32, the rest through double, rounded each time */
__device__ __forceinline__ float add_elem(float a, float b) { return XF_ADD(a, b); }
template <typename T> __device__ __forceinline__ T add_elem(T a, T b) {
  return from_d<T>(XD_ADD(to_d(a), to_d(b)));
}

/* g: the destination dims (first dn of them, in order) then the repeat dims (rn) */
template <typename T>
__global__ void add_strided_k(T *dst, const T *src, geom g, int dn, int rn, int64_t n,
                              int64_t reps) {
  FSDP_CU_LOOP(i, n) {
    int64_t rem = i, od = 0, os = 0;
    for (int k = dn - 1; k >= 0; k--) {
      const int64_t x = rem % g.shape[k];
      rem /= g.shape[k];
      od += x * g.ds[k];
      os += x * g.ss[k];
    }
    T acc = dst[od];
    for (int64_t r = 0; r < reps; r++) { /* the repeats in row-major order: the cpu's order */
      int64_t q = r, o = os;
      for (int k = dn + rn - 1; k >= dn; k--) {
        o += (q % g.shape[k]) * g.ss[k];
        q /= g.shape[k];
      }
      acc = add_elem(acc, src[o]);
    }
    dst[od] = acc;
  }
}

int fsdp_cuda_add_strided(void *ctx, fsdp_dtype dt, void *dst, const int64_t *dst_strides,
                          const void *src, const int64_t *src_strides, int ndim,
                          const int64_t *shape) {
  if (dt == FSDP_DTYPE_BOOL || !known(dt)) return FSDP_CU_REFUSE("add", dt);
  geom all, g;
  int64_t n = 0;
  if (geom_of(&all, ndim, shape, dst_strides, src_strides, &n, "add")) return FSDP_ERR;
  if (n <= 0) return FSDP_OK;
  /* one thread per destination element (dims with a stride, in order), summing its repeats
   * (dims of stride 0, in order) itself: no two threads write one element */
  int dn = 0, rn = 0;
  int64_t dests = 1, reps = 1;
  for (int k = 0; k < ndim; k++)
    if (shape[k] == 1 || dst_strides[k] != 0) {
      g.shape[dn] = shape[k], g.ds[dn] = dst_strides[k], g.ss[dn] = src_strides[k];
      dests *= shape[k];
      dn++;
    }
  for (int k = 0; k < ndim; k++)
    if (shape[k] != 1 && dst_strides[k] == 0) {
      g.shape[dn + rn] = shape[k], g.ds[dn + rn] = 0, g.ss[dn + rn] = src_strides[k];
      reps *= shape[k];
      rn++;
    }
  g.nd = dn + rn;
  cudaStream_t s = fsdp_cuda_stream();
  return with_any(dt, [&](auto tag) {
    using T = decltype(tag);
    add_strided_k<T><<<blocks_for(dests), THREADS, 0, s>>>((T *)dst, (const T *)src, g, dn, rn,
                                                           dests, reps);
    return fsdp_cuda_launched("add");
  });
}

/* ---- fill, arange ----------------------------------------------------------------------------- */

template <typename E> __global__ void fill_k(E *out, E v, int64_t n) {
  FSDP_CU_LOOP(i, n) out[i] = v;
}

int fsdp_cuda_fill(void *ctx, fsdp_dtype dt, void *out, double v, int64_t n) {
  if (!known(dt)) return FSDP_CU_REFUSE("fill", dt);
  if (n <= 0) return FSDP_OK;
  unsigned char pat[8] = {0};
  fsdp_dtype_store(pat, dt, 0, v); /* the element's bytes, converted once on the host */
  const size_t es = fsdp_dtype_size(dt);
  cudaStream_t s = fsdp_cuda_stream();
  bool same = true;
  for (size_t k = 1; k < es; k++) same &= pat[k] == pat[0];
  if (same) /* zeros, and every one-byte dtype */
    return fsdp_cuda_check(cudaMemsetAsync(out, pat[0], (size_t)n * es, s), "fill");
  const unsigned b = blocks_for(n);
  if (es == 2) {
    uint16_t w;
    memcpy(&w, pat, 2);
    fill_k<<<b, THREADS, 0, s>>>((uint16_t *)out, w, n);
  } else if (es == 4) {
    uint32_t w;
    memcpy(&w, pat, 4);
    fill_k<<<b, THREADS, 0, s>>>((uint32_t *)out, w, n);
  } else {
    uint64_t w;
    memcpy(&w, pat, 8);
    fill_k<<<b, THREADS, 0, s>>>((uint64_t *)out, w, n);
  }
  return fsdp_cuda_launched("fill");
}

template <typename T> __global__ void arange_k(T *out, double start, double step, int64_t n) {
  FSDP_CU_LOOP(i, n) out[i] = from_d<T>(XD_ADD(start, XD_MUL((double)i, step)));
}

int fsdp_cuda_arange(void *ctx, fsdp_dtype dt, void *out, double start, double step, int64_t n) {
  if (!known(dt)) return FSDP_CU_REFUSE("arange", dt);
  if (n <= 0) return FSDP_OK;
  cudaStream_t s = fsdp_cuda_stream();
  return with_any(dt, [&](auto tag) {
    using T = decltype(tag);
    arange_k<T><<<blocks_for(n), THREADS, 0, s>>>((T *)out, start, step, n);
    return fsdp_cuda_launched("arange");
  });
}

/* ---- random ------------------------------------------------------------------------------------- */

/* The fix-up tables on each GPU: uploaded on the first normal drawn there, kept for the life of
 * the process (about 4.5 MB, outside the pool: they belong to no tensor). */
static pthread_mutex_t tables_mu = PTHREAD_MUTEX_INITIALIZER;
static fsdp_x_normal_tables tables_on[FSDP_CUDA_MAX_GPUS];
static bool tables_ready[FSDP_CUDA_MAX_GPUS];

static size_t up256(size_t n) { return (n + 255) / 256 * 256; }

static int upload_fixups(const fsdp_x_fixups *h, fsdp_x_fixups *d, char **at) {
  const size_t nk = h->start[FSDP_X_FIX_BUCKETS];
  const size_t sizes[3] = {(FSDP_X_FIX_BUCKETS + 1) * 4, nk * 4, nk * 4};
  const void *src[3] = {h->start, h->key, h->value};
  for (int i = 0; i < 3; i++) {
    if (sizes[i] && fsdp_cuda_check(cudaMemcpy(*at, src[i], sizes[i], cudaMemcpyHostToDevice),
                                     "randn tables"))
      return FSDP_ERR;
    if (i == 0) d->start = (const uint32_t *)*at;
    else if (i == 1) d->key = (const uint32_t *)*at;
    else d->value = (const float *)*at;
    *at += up256(sizes[i]);
  }
  return FSDP_OK;
}

static int normal_tables(fsdp_x_normal_tables *out) {
  const fsdp_x_normal_tables *h;
  if (fsdp_cuda_thread_ready() || fsdp_cuda_normal_fixups(&h)) return FSDP_ERR;
  const int gpu = fsdp_cuda_device();
  int rc = FSDP_OK;
  pthread_mutex_lock(&tables_mu);
  if (!tables_ready[gpu]) {
    const fsdp_x_fixups *hs[3] = {&h->log, &h->sin, &h->cos};
    fsdp_x_fixups *ds[3] = {&tables_on[gpu].log, &tables_on[gpu].sin, &tables_on[gpu].cos};
    size_t bytes = 0;
    for (int i = 0; i < 3; i++)
      bytes += up256((FSDP_X_FIX_BUCKETS + 1) * 4) +
               2 * up256((size_t)hs[i]->start[FSDP_X_FIX_BUCKETS] * 4);
    char *mem = NULL;
    rc = fsdp_cuda_check(cudaMalloc((void **)&mem, bytes), "randn tables");
    char *at = mem;
    for (int i = 0; !rc && i < 3; i++) rc = upload_fixups(hs[i], ds[i], &at);
    /* a copy from pageable memory may still be in flight when cudaMemcpy returns */
    if (!rc) rc = fsdp_cuda_check(cudaDeviceSynchronize(), "randn tables");
    if (rc && mem) (void)cudaFree(mem);
    tables_ready[gpu] = !rc;
  }
  *out = tables_on[gpu];
  pthread_mutex_unlock(&tables_mu);
  return rc;
}

/* One thread per Philox block: its 4 values, those of them in [first, first + n). */
template <typename T>
__global__ void random_k(T *out, int64_t n, uint64_t first, uint64_t block0, int64_t nblocks,
                         uint32_t k0, uint32_t k1, bool normal, float a, float ba, bool affine,
                         fsdp_x_normal_tables tab) {
  FSDP_CU_LOOP(t, nblocks) {
    const uint64_t block = block0 + (uint64_t)t;
    float z[4];
    if (normal) {
      fsdp_x_normal4(z, block, k0, k1, &tab);
      for (int l = 0; l < 4; l++) z[l] = XF_ADD(a, XF_MUL(ba, z[l])); /* mean + std z */
    } else {
      uint32_t r[4];
      fsdp_x_philox(r, block, k0, k1);
      for (int l = 0; l < 4; l++) {
        z[l] = fsdp_x_uniform(r[l]);
        if (affine) z[l] = XF_ADD(a, XF_MUL(ba, z[l])); /* a + (b - a) u */
      }
    }
    for (int l = 0; l < 4; l++) {
      const uint64_t e = block * 4 + (uint64_t)l;
      if (e < first || e - first >= (uint64_t)n) continue;
      out[e - first] = from_d<T>((double)z[l]); /* the stream is f32: widened or rounded */
    }
  }
}

int fsdp_cuda_random(void *ctx, fsdp_dtype dt, void *out, int64_t n, uint64_t key, uint64_t first,
                     bool normal, double a, double b) {
  if (!known(dt) || !fsdp_dtype_is_float(dt)) return FSDP_CU_REFUSE(normal ? "randn" : "rand", dt);
  if (n <= 0) return FSDP_OK;
  fsdp_x_normal_tables tab = {};
  if (normal && normal_tables(&tab)) return FSDP_ERR;
  const uint64_t block0 = first >> 2, last = (first + (uint64_t)n - 1) >> 2;
  const int64_t nblocks = (int64_t)(last - block0 + 1);
  /* the cpu's scalars: normal (mean, std) as f32; uniform a + (b - a) u with both as f32 */
  const float fa = (float)a, fba = normal ? (float)b : (float)(b - a);
  const bool affine = !normal && (a != 0.0 || b != 1.0);
  cudaStream_t s = fsdp_cuda_stream();
  return with_float(dt, [&](auto tag) {
    using T = decltype(tag);
    random_k<T><<<blocks_for(nblocks), THREADS, 0, s>>>((T *)out, n, first, block0, nblocks,
                                                        (uint32_t)key, (uint32_t)(key >> 32),
                                                        normal, fa, fba, affine, tab);
    return fsdp_cuda_launched(normal ? "randn" : "rand");
  });
}
