/*
 * cuda_test.h — what the GPU tests (tests/cuda/test_*.c) share: the device they hold against
 * the cpu, the skip rule, tensors moved there through fsdp_to, and the comparison.
 *
 * The device: "cuda" when the engine registered it. FSDP_CUDA_TEST_DEVICE=cpu2 runs the same
 * tests against tests/c's cpu2 device (the cpu's kernels behind device copies): on a machine
 * without a GPU that proves the harness itself (every runner, copy and comparison; refusals
 * then name the cpu, whose table cpu2 uses), and ctest runs it so (the *.harness entries).
 * Skipping: with no cuda device a test prints "no CUDA device: <reason>" and exits 77 (ctest's
 * SKIP_RETURN_CODE). A CUDA runtime that sees a GPU while the engine registered no device is a
 * failure, not a skip.
 * Tolerances, relative to max(|want|, 1e-3 of the output's largest |want|) so that elements
 * which cancel to near zero are held to the output's scale: f32 1e-5 (TF32 off), bf16 2e-2,
 * f16 5e-3, f64 1e-9; integers and bool exactly; NaN equals NaN.
 * FSDP_CUDA_TEST_QUICK=1 leaves out the largest sizes (compute-sanitizer runs, the harness).
 */
#ifndef FSDP_TEST_CUDA_TEST_H
#define FSDP_TEST_CUDA_TEST_H

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "../c/cpu2_device.h"
#include "core/core.h"
#include "kernels/kernels.h"

#define CT_SKIP 77

static const fsdp_device_i *ct_dev;  /* the device under test (cuda, or cpu2 for the harness) */
static const char *ct_refuser;       /* the device its refusals name */

static bool ct_quick(void) {
  const char *q = getenv("FSDP_CUDA_TEST_QUICK");
  return q && *q && strcmp(q, "0") != 0;
}

/* Picks the device under test into ct_dev. Returns 0 when there is one, CT_SKIP (having printed
 * why) when this machine has no GPU, 1 (having printed why) when something is broken. */
static int ct_pick_device(void) {
  fsdp_kernels_init();
  const char *want = getenv("FSDP_CUDA_TEST_DEVICE");
  if (want && strcmp(want, "cpu2") == 0) {
    if (cpu2_register()) {
      fprintf(stderr, "cpu2: %s\n", fsdp_error_msg());
      return 1;
    }
    ct_dev = &cpu2_device;
    ct_refuser = "cpu";
    printf("device under test: cpu2 (the harness on the cpu's kernels)\n");
    return 0;
  }
  if (want && *want && strcmp(want, "cuda") != 0) {
    fprintf(stderr, "FSDP_CUDA_TEST_DEVICE=%s: only cuda and cpu2 are known\n", want);
    return 1;
  }
  if (fsdp_device_count_of("cuda") > 0) {
    ct_dev = fsdp_device_find("cuda");
    ct_refuser = "cuda";
    char desc[256] = "";
    if (ct_dev && ct_dev->describe) ct_dev->describe(ct_dev->ctx, desc, sizeof desc);
    printf("device under test: cuda (%s)\n", desc[0] ? desc : "no description");
    return ct_dev ? 0 : 1;
  }
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    printf("no CUDA device: the CUDA runtime says: %s\n", cudaGetErrorString(e));
    return CT_SKIP;
  }
  if (n == 0) {
    printf("no CUDA device: the CUDA runtime sees no GPU\n");
    return CT_SKIP;
  }
  fprintf(stderr, "the CUDA runtime sees %d GPU(s) but the engine registered no cuda device "
                  "(fsdp_device_count_of(\"cuda\") is 0)\n", n);
  return 1;
}

/* ---- comparison ------------------------------------------------------------------------- */

static void ct_tolerance(fsdp_dtype dt, double *tol) {
  switch (dt) {
  case FSDP_DTYPE_F32: *tol = 1e-5; break;
  case FSDP_DTYPE_BF16: *tol = 2e-2; break;
  case FSDP_DTYPE_F16: *tol = 5e-3; break;
  case FSDP_DTYPE_F64: *tol = 1e-9; break;
  default: *tol = 0; break; /* integers and bool: exact */
  }
}

static long ct_compared; /* elements compared, for the "compared enough" checks */

/* Elements of got (host buffer of n elements of dt, from device `dev`) that differ from want (the
 * cpu's) beyond dt's tolerance; the first is described in why (prefixed by what). */
static int64_t ct_compare(const char *what, const char *dev, fsdp_dtype dt, const void *got,
                          const void *want, int64_t n, char *why, size_t nwhy) {
  double tol, scale = 0;
  ct_tolerance(dt, &tol);
  for (int64_t i = 0; i < n; i++) {
    double w = fsdp_dtype_load(want, dt, i);
    if (isfinite(w)) scale = fmax(scale, fabs(w));
  }
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++) {
    double g = fsdp_dtype_load(got, dt, i), w = fsdp_dtype_load(want, dt, i);
    bool ok = (isnan(g) && isnan(w)) || g == w ||
              (tol > 0 && fabs(g - w) <= tol * fmax(fabs(w), 1e-3 * scale));
    if (!ok && !bad++ && why)
      snprintf(why, nwhy, "%.300s: [%lld] = %.9g on %s, %.9g on the cpu (%s, tolerance %g of "
               "max(|cpu|, %.3g))", what, (long long)i, g, dev, w,
               fsdp_dtype_name(dt), tol, 1e-3 * scale);
  }
  ct_compared += n;
  return bad;
}

/* Whether the host buffers a and b hold the same bytes (n elements of dt). */
static bool ct_same_bits(const void *a, const void *b, fsdp_dtype dt, int64_t n) {
  return memcmp(a, b, (size_t)n * fsdp_dtype_size(dt)) == 0;
}

#endif
