/*
 * core.h — the bottom layer of the engine: errors, devices, storage, allocator accounting,
 * tensors (views over refcounted storage) and the counter-based RNG.
 *
 * Ownership: every fsdp_storage and fsdp_tensor is refcounted. A function that returns a new
 * object through an `out` pointer hands the caller one reference, to be dropped with
 * fsdp_tensor_release / fsdp_storage_release. Releasing NULL is a no-op. Refcounts are atomic:
 * rank threads may share storages (zero-copy collectives).
 *
 * Errors: fallible functions return int (FSDP_OK = 0, FSDP_ERR = -1) and leave a message in
 * the calling thread's error slot (fsdp_error_msg). Nothing here exits, aborts on user input,
 * or touches Lua. asserts guard broken invariants only.
 */
#ifndef FSDP_CORE_H
#define FSDP_CORE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define FSDP_OK 0
#define FSDP_ERR (-1)
#define FSDP_MAX_DIMS 8

/* ---- errors (error.c) ------------------------------------------------------------------ */

/* Bytes of a thread's error message (failure reports carry a flight recorder). */
#define FSDP_ERROR_CAP 4096

/* Set this thread's error message (printf-style). Always returns FSDP_ERR so callers can
 * `return fsdp_error("...")`. */
int fsdp_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Prepend context to the current message: "ctx: <old message>". Returns FSDP_ERR. */
int fsdp_error_context(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The calling thread's last message ("" when none). Valid until the next fsdp_error*. */
const char *fsdp_error_msg(void);
void fsdp_error_clear(void);

/* printf into a new string that the caller frees; NULL when out of memory */
char *fsdp_strdup_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
char *fsdp_strdup_vprintf(const char *fmt, va_list ap);

/* ---- dtypes, roles ------------------------------------------------------------------- */

/* Element types (dtype.c). bool is one byte holding 0 or 1. The bytes of bf16 / f16 values
 * are the IEEE binary16 / bfloat16 bit patterns in host (little-endian) order. */
typedef enum {
  FSDP_DTYPE_F32 = 0,
  FSDP_DTYPE_BF16,
  FSDP_DTYPE_F16,
  FSDP_DTYPE_F64,
  FSDP_DTYPE_I64,
  FSDP_DTYPE_I32,
  FSDP_DTYPE_U8,
  FSDP_DTYPE_BOOL,
  FSDP_DTYPE_COUNT
} fsdp_dtype;
size_t fsdp_dtype_size(fsdp_dtype dt);       /* 0 for an unknown dtype */
const char *fsdp_dtype_name(fsdp_dtype dt);  /* "f32", "bf16", ...; "?" when unknown */
/* Parse a dtype name: the short names above, or PyTorch's ("float32", "bfloat16", "float16",
 * "half", "float", "double", "float64", "int64", "long", "int32", "int", "uint8"). FSDP_ERR
 * with a message listing the valid names when unknown. */
int fsdp_dtype_parse(const char *name, fsdp_dtype *out);
bool fsdp_dtype_is_float(fsdp_dtype dt); /* f32, bf16, f16, f64 */

/* Scalar conversions. f32 -> bf16 / f16 round to nearest, ties to even; NaN stays NaN (made
 * quiet, sign kept), infinities stay infinities, f16 overflow gives infinity and values below
 * its subnormal range round to (signed) zero. Widening is exact. */
uint16_t fsdp_f32_to_bf16(float x);
float fsdp_bf16_to_f32(uint16_t h);
uint16_t fsdp_f32_to_f16(float x);
float fsdp_f16_to_f32(uint16_t h);
/* Element i of a buffer of dtype dt, read as a double / written from a double (integers
 * truncate toward zero and saturate at their range, NaN gives 0; bool is v != 0). For
 * printing, item(), get/set: single elements, not bulk math (that is a kernel's job). */
double fsdp_dtype_load(const void *buf, fsdp_dtype dt, int64_t i);
void fsdp_dtype_store(void *buf, fsdp_dtype dt, int64_t i, double v);

/* Reductions across ranks (collectives, and the kernel that reduces ranks' buffers on one
 * device). AVG is SUM followed, for f32 and bf16, by one multiplication by (float)(1.0 / n), for
 * f64 by one division by n; i64 has no AVG (docs/comm.md). MAX and MIN propagate NaN. */
typedef enum { FSDP_RED_SUM = 0, FSDP_RED_AVG, FSDP_RED_MAX, FSDP_RED_MIN } fsdp_reduce_op;

/* What a buffer is for; the allocator accounts live and peak bytes per device and role. */
typedef enum {
  FSDP_ROLE_OTHER = 0,
  FSDP_ROLE_PARAMS,
  FSDP_ROLE_GRADS,
  FSDP_ROLE_OPTIM,
  FSDP_ROLE_ACTIVATIONS,
  FSDP_ROLE_GATHERED,
  FSDP_ROLE_COUNT
} fsdp_role;
const char *fsdp_role_name(fsdp_role r); /* "other","params","grads","optim","activations","gathered" */

/* ---- devices (device.c) ---------------------------------------------------------------- */

/* A device is a table chosen by name at run time (ggml's device tables, Torch7's allocator with a
 * context): its memory (alloc/free), copies within it and to/from host memory, synchronize, and
 * its kernels (src/kernels/kernels.h). Callers never branch on which device they hold; they ask
 * `has_data` (shape only?) and `host_memory` (may the CPU dereference its pointers?). Every slot
 * gets the device's own context first. Adding a device is a folder under src/kernels/ that
 * defines one of these and registers it (docs/ARCHITECTURE.md, "Adding a device"). */
struct fsdp_kernels_i; /* src/kernels/kernels.h */
typedef struct fsdp_device_i {
  const char *name;   /* "cpu", "meta", ...; unique among registered devices */
  bool has_data;      /* false: shape only (meta) */
  bool host_memory;   /* its data pointers are host memory (cpu): the host reads them directly */
  void *ctx;          /* the device's own state (streams, pools); NULL for cpu */
  int (*alloc)(void *ctx, void **out, size_t bytes); /* zeroed memory; no-data devices: NULL */
  /* optional: memory whose contents are unspecified (for buffers a kernel overwrites whole) */
  int (*alloc_uninit)(void *ctx, void **out, size_t bytes);
  void (*free)(void *ctx, void *ptr, size_t bytes);
  /* Copies (required on devices with data, NULL on the others). copy stays within the device
   * (buffers may overlap: memmove semantics); to_host / from_host move bytes between the
   * device and host memory. They are ordered with the device's kernels: when to_host returns,
   * the host bytes are there. */
  int (*copy)(void *ctx, void *dst, const void *src, size_t bytes);
  int (*to_host)(void *ctx, void *host_dst, const void *src, size_t bytes);
  int (*from_host)(void *ctx, void *dst, const void *host_src, size_t bytes);
  /* optional: wait until every queued operation on the device is done (NULL: synchronous) */
  int (*synchronize)(void *ctx);
  /* optional: how many physical devices of this kind the machine has (fsdp.device_count);
   * NULL counts as 1 for a device with data, 0 without */
  int (*count)(void *ctx);
  /* optional: called on each rank's thread as it starts, with the rank's index among the ranks
   * of this machine: the device picks which physical one that thread uses (rank % count) */
  void (*bind)(void *ctx, int local_rank);
  /* optional: one line describing the device for fsdp.info() ("NVIDIA H200, sm_90, 139 GiB") */
  void (*describe)(void *ctx, char *buf, size_t n);
  /* optional: the device allocator's own figures for the calling thread's physical device (a
   * caching allocator holds more than the tensors do), as torch.cuda.memory_stats names them:
   * allocated = bytes handed out, reserved = bytes taken from the device (allocated + cached),
   * with their peaks since the last reset_peak. FSDP_ERR: none to give. */
  int (*memory_stats)(void *ctx, int64_t *allocated, int64_t *allocated_peak, int64_t *reserved,
                      int64_t *reserved_peak);
  void (*memory_reset_peak)(void *ctx); /* optional, with memory_stats */
  /* optional, devices without data: the error for reading a tensor's data, after
   * "<what>: <tensor or parameter label> " — e.g. "is sharded: gather its unit (u:gather()) or
   * use fsdp.full_params". NULL: "tensor on <name> device has no data". */
  const char *no_data;
  /* The device's kernel table, set when it is registered (NULL: no math on this device). */
  const struct fsdp_kernels_i *kernels;
} fsdp_device_i;

/* cpu: host memory. Its kernels are registered by src/kernels/cpu (fsdp_kernels_init). */
extern fsdp_device_i fsdp_device_cpu;
extern fsdp_device_i fsdp_device_meta;
/* alloc and free of a device without data (meta, and devices like it above core): nothing to
 * allocate (*out = NULL) or free */
int fsdp_device_nodata_alloc(void *ctx, void **out, size_t bytes);
void fsdp_device_nodata_free(void *ctx, void *ptr, size_t bytes);
/* Add a device to the registry (or update the kernels of one already there): dev must stay
 * valid for the life of the process. FSDP_ERR when another device has its name or the
 * registry is full (FSDP_MAX_DEVICES). Thread-safe; devices are registered once, at start. */
int fsdp_device_register(fsdp_device_i *dev, const struct fsdp_kernels_i *kernels);
/* Look a device up by name; NULL with an error naming it (and the known ones) if unknown. */
const fsdp_device_i *fsdp_device_find(const char *name);
/* The cpu device keeps freed blocks of >= 64 KiB for reuse, up to FSDP_CPU_CACHE bytes
 * (default 2 GiB, 0 disables). Cached bytes are not live bytes. trim gives them back. */
void fsdp_device_cpu_trim(void);
/* FSDP_OK, or FSDP_ERR naming FSDP_CPU_CACHE when its value is malformed
 * (the cache then keeps its default size). */
int fsdp_device_cpu_check(void);
size_t fsdp_device_cpu_cached_bytes(void);
/* The registry behind fsdp_device_find, in registration order (cpu, meta, then others): device
 * i is column i of a fsdp_mem_report. fsdp_device_index gives -1 for an unregistered device. */
int fsdp_device_count(void);
const fsdp_device_i *fsdp_device_at(int i); /* NULL when i is out of range */
int fsdp_device_index(const fsdp_device_i *dev);
/* Physical devices of the registered device named `name` (0 when none is registered). */
int fsdp_device_count_of(const char *name);
/* Every registered device's bind slot, on the calling (rank) thread. */
void fsdp_devices_bind(int local_rank);

/* ---- allocator accounting (alloc.c) ------------------------------------------------------ */

#define FSDP_MAX_DEVICES 8
typedef struct fsdp_mem_counts {
  int64_t live[FSDP_ROLE_COUNT];
  int64_t peak[FSDP_ROLE_COUNT];
  int64_t live_total, peak_total;
} fsdp_mem_counts;

typedef struct fsdp_mem_report {
  int ndevices;
  const char *device[FSDP_MAX_DEVICES];
  fsdp_mem_counts counts[FSDP_MAX_DEVICES];
} fsdp_mem_report;

/* A memory domain is the accounting unit: one per rank (the thread that runs a rank sets its
 * own with fsdp_mem_domain_set); threads that set none use the process domain. A storage
 * remembers the domain it was allocated in, so freeing it on another thread (GC) still
 * decrements the right counters. Domains are never freed while storages point at them. */
typedef struct fsdp_mem_domain fsdp_mem_domain;
fsdp_mem_domain *fsdp_mem_domain_new(void);   /* NULL on OOM */
void fsdp_mem_domain_set(fsdp_mem_domain *d); /* NULL: back to the process domain */
fsdp_mem_domain *fsdp_mem_domain_current(void);
void fsdp_mem_report_get(const fsdp_mem_domain *d, fsdp_mem_report *out); /* d NULL: current */
void fsdp_mem_reset_peak(fsdp_mem_domain *d);
/* Cap on the live bytes of each data-holding device in a domain (0 = none; meta allocations
 * are counted but never capped). FSDP_MEM_LIMIT in the environment (bytes, or with K/M/G
 * suffix) sets the process domain's cap, read once; new domains start with the process
 * domain's cap at the time they are made. An allocation past the cap fails with an error
 * naming the request, the live bytes and the cap, and counts nothing. */
void fsdp_mem_set_limit(fsdp_mem_domain *d, int64_t bytes);
int64_t fsdp_mem_get_limit(const fsdp_mem_domain *d); /* d NULL: current; 0 = none */
/* Drop the creator's reference to a domain made by fsdp_mem_domain_new. The domain is freed
 * once no storage allocated in it is live (deferred, like closing a SQLite connection with
 * live statements), so storages freed later (GC, another thread) still find their counters.
 * The process domain and NULL are ignored. If d is the calling thread's current domain the
 * thread goes back to the process domain; other threads must not still have it current. */
void fsdp_mem_domain_free(fsdp_mem_domain *d);
/* Parse a size as FSDP_MEM_LIMIT takes it: "1048576", "512K", "1.5M", "2G", "2GiB", "64mb"
 * (K/M/G/T are powers of 1024). FSDP_ERR with a message naming the text if malformed. */
int fsdp_mem_parse_size(const char *text, int64_t *out);
/* The accounting step of an allocation, for storage.c (and future allocators: everyone else
 * allocates through fsdp_storage_new). charge checks the cap and counts `bytes` of `role` on
 * `dev` in domain d (which it keeps alive until the matching uncharge); on error nothing is
 * counted. uncharge undoes exactly one charge, from any thread. */
int fsdp_mem_charge(fsdp_mem_domain *d, const fsdp_device_i *dev, fsdp_role role, size_t bytes);
void fsdp_mem_uncharge(fsdp_mem_domain *d, const fsdp_device_i *dev, fsdp_role role,
                       size_t bytes);

/* ---- storage (storage.c) ------------------------------------------------------------- */

typedef struct fsdp_storage {
  int refcount; /* atomic */
  const fsdp_device_i *device;
  void *data; /* NULL on meta */
  size_t bytes;
  fsdp_role role;
  fsdp_mem_domain *domain; /* where it was charged; NULL for wrapped memory */
  /* Bumped with the version of every tensor written in place over this memory, whichever view
   * it was: a gathered unit tells from it that its parameters, or its shard, changed, and a
   * backward that a write through another view (or detach()) changed what it saved. */
  uint64_t version;
  /* Unique for the process's life: tells this storage from one allocated later at the same
   * address (a backward compares versions only of the storage it recorded). */
  uint64_t id;
  /* An FSDP unit's flat buffer (its shard, a gathered copy): many parameters over one storage,
   * written in place by design (masks, full_params' writeback) and checked by the unit against
   * its shard. A backward does not compare this storage's version (autograd.h, fsdp_stamp). */
  bool unit_books;
} fsdp_storage;

int fsdp_storage_new(fsdp_storage **out, const fsdp_device_i *dev, size_t bytes, fsdp_role role);
/* Like fsdp_storage_new, but the contents are unspecified (for a buffer the caller overwrites
 * whole): saves clearing memory on the hot path. */
int fsdp_storage_new_uninit(fsdp_storage **out, const fsdp_device_i *dev, size_t bytes,
                            fsdp_role role);
/* Wrap memory the caller owns (not freed, not accounted); used for zero-copy views. */
int fsdp_storage_wrap(fsdp_storage **out, void *data, size_t bytes);
void fsdp_storage_retain(fsdp_storage *s);
/* A new fsdp_storage.id (from 1, any thread), for storages made outside storage.c. */
uint64_t fsdp_storage_new_id(void);
void fsdp_storage_release(fsdp_storage *s);

/* ---- tensors (tensor.c) ------------------------------------------------------------ */

typedef struct fsdp_node fsdp_node; /* autograd/ */

typedef struct fsdp_tensor {
  int refcount; /* atomic */
  fsdp_storage *storage; /* never NULL once created; may be swapped (fsdp_tensor_set_storage) */
  int64_t offset;        /* in elements */
  int ndim;
  int64_t shape[FSDP_MAX_DIMS];
  int64_t strides[FSDP_MAX_DIMS]; /* in elements */
  fsdp_dtype dtype;
  bool requires_grad; /* leaf: set by user; non-leaf: produced by a recorded op */
  bool is_param;      /* a parameter: identity is stable, storage may change (FSDP) */
  bool is_leaf;       /* not produced by a recorded op */
  /* grad is another tensor's gradient handed through unchanged (an addend of a sum, during
   * backward), or a view of one's memory (a view's input): fsdp_grad_acc copies it before the
   * first write while the tensor or its memory is still shared */
  bool grad_shared;
  struct fsdp_tensor *grad; /* owned reference or NULL */
  uint64_t version;   /* bumped by in-place writes (fsdp_tensor_written) */
  char *label;        /* optional owned name for errors (a parameter's path); NULL if none */
  void *user;         /* opaque slot for the layer above (e.g. FSDP parameter record) */
} fsdp_tensor;

/* New contiguous tensor, zero-filled on data devices. ndim 0 is a scalar (numel 1). */
int fsdp_tensor_new(fsdp_tensor **out, const fsdp_device_i *dev, fsdp_dtype dt, int ndim,
                    const int64_t *shape, fsdp_role role);
/* The same with contents unspecified: for buffers a kernel or a copy overwrites whole. */
int fsdp_tensor_new_uninit(fsdp_tensor **out, const fsdp_device_i *dev, fsdp_dtype dt, int ndim,
                           const int64_t *shape, fsdp_role role);
/* Shorthand: cpu, f32, role activations. */
int fsdp_tensor_new_f32(fsdp_tensor **out, int ndim, const int64_t *shape);
/* cpu, f32, role activations, contents unspecified: for op outputs a kernel writes whole. */
int fsdp_tensor_new_f32_uninit(fsdp_tensor **out, int ndim, const int64_t *shape);
/* A contiguous cpu tensor over host memory the caller owns (fsdp_storage_wrap: not freed, not
 * accounted; it must outlive the tensor and its views). */
int fsdp_tensor_wrap(fsdp_tensor **out, void *data, fsdp_dtype dt, int ndim,
                     const int64_t *shape);
/* A new tensor sharing `t`'s storage with the given geometry (no checks beyond bounds). */
int fsdp_tensor_new_view(fsdp_tensor **out, fsdp_tensor *t, int64_t offset, int ndim,
                         const int64_t *shape, const int64_t *strides);
void fsdp_tensor_retain(fsdp_tensor *t);
void fsdp_tensor_release(fsdp_tensor *t); /* also releases grad when the last ref goes */
/* t's elements were written in place: its version (autograd refuses a backward through a saved
 * tensor written since) and its storage's (writes through any view of the memory). */
static inline void fsdp_tensor_written(fsdp_tensor *t) {
  t->version++;
  t->storage->version++;
}

int64_t fsdp_tensor_numel(const fsdp_tensor *t);
bool fsdp_tensor_is_contiguous(const fsdp_tensor *t);
/* The row-major strides of shape (a dimension of size 0 counts as 1, so they stay distinct). */
void fsdp_contiguous_strides(int64_t *strides, int ndim, const int64_t *shape);
bool fsdp_tensor_same_shape(const fsdp_tensor *a, const fsdp_tensor *b);
/* "(2, 3)" into buf; returns buf. */
char *fsdp_shape_str(char *buf, size_t n, int ndim, const int64_t *shape);
#define FSDP_SHAPE_STR(t) fsdp_shape_str((char[96]){0}, 96, (t)->ndim, (t)->shape)

/* Pointer to element 0 of the view (storage data + offset, in bytes of its dtype) on its
 * device. NULL with error "<what>: tensor on meta device has no data" when the device has
 * none. */
void *fsdp_tensor_data(const fsdp_tensor *t, const char *what);
/* dst <- src over `shape` with element strides, in host memory, elements of esize bytes (a
 * byte copy: no conversion). The cpu kernels and fsdp_tensor_copy share it. */
void fsdp_host_copy_strided(void *dst, const int64_t *dst_strides, const void *src,
                            const int64_t *src_strides, size_t esize, int ndim,
                            const int64_t *shape);

/* Views (share storage; no autograd here — autograd/ops records them). */
/* shape may hold one -1 (inferred). Needs t contiguous; error names both shapes. */
int fsdp_tensor_view(fsdp_tensor **out, fsdp_tensor *t, int ndim, const int64_t *shape);
/* Swap dims d0 and d1 (0-based). */
int fsdp_tensor_transpose(fsdp_tensor **out, fsdp_tensor *t, int d0, int d1);
/* Elements [start, start + len) of dim (0-based); out of range is an error naming all four. */
int fsdp_tensor_narrow(fsdp_tensor **out, fsdp_tensor *t, int dim, int64_t start, int64_t len);
/* t itself (retained) if contiguous, else a contiguous copy. */
int fsdp_tensor_contiguous(fsdp_tensor **out, fsdp_tensor *t);
/* Deep copy into new contiguous storage on t's device, same role. */
int fsdp_tensor_clone(fsdp_tensor **out, fsdp_tensor *t);
/* dst <- src, same dtype (conversions are kernels: fsdp_copy in src/kernels), elementwise
 * over any strides on host memory (overlapping views of one storage are handled); on other
 * devices, and between devices, both must be contiguous. Shapes must match exactly (view one
 * side first to copy across shapes). Bumps dst->version. A meta dst takes nothing (shape only);
 * a meta src into a data-holding dst is an error. */
int fsdp_tensor_copy(fsdp_tensor *dst, const fsdp_tensor *src);
/* every element = v converted to t's dtype (fsdp_dtype_store); any strides on host memory,
 * contiguous elsewhere; bumps version; no-op on meta */
int fsdp_tensor_fill(fsdp_tensor *t, double v);
/* Replace t's backing storage (FSDP gather/reshard). Geometry is left to the caller. */
void fsdp_tensor_set_storage(fsdp_tensor *t, fsdp_storage *s, int64_t offset);
/* Name the tensor in error messages (a parameter's path); copies label; NULL clears. */
int fsdp_tensor_set_label(fsdp_tensor *t, const char *label);
/* Set or drop (g NULL) the gradient; retains g. */
void fsdp_tensor_set_grad(fsdp_tensor *t, fsdp_tensor *g);

/* ---- RNG (rng.c): Philox4x32-10, counter based --------------------------------------- */

/* Every random value is a pure function of (key, element index): a stream never depends on
 * the order tensors are created in, and a rank can generate any slice [first, first+n) of a
 * parameter's values on its own. */
uint64_t fsdp_rng_key(uint64_t seed, const char *stream); /* hash of seed and a name/path */
uint64_t fsdp_rng_key_mix(uint64_t key, uint64_t value);  /* derive a sub-key */
/* One Philox4x32-10 block with key (k0, k1) = (low, high 32 bits of key) and counter
 * (c0, c1, c2, c3) = (low, high 32 bits of counter, 0, 0). */
void fsdp_philox4x32(uint32_t out[4], uint64_t key, uint64_t counter);
/* The full-width primitive (Random123's philox4x32_R(10, ctr, key)); checked against its
 * known-answer vectors. */
void fsdp_philox4x32_10(uint32_t out[4], const uint32_t ctr[4], const uint32_t key[2]);
/* out[i] = uniform in [0, 1) for element first+i */
void fsdp_rng_uniform(float *out, int64_t n, uint64_t key, uint64_t first);
/* out[i] = mean + std * N(0,1) for element first+i (Box-Muller on Philox output) */
void fsdp_rng_normal(float *out, int64_t n, uint64_t key, uint64_t first, float mean, float std);

#endif
