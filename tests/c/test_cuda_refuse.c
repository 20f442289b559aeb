/*
 * test_cuda_refuse.c — what the CUDA kernels of blas.cu, norm.cu, loss.cu and embed.cu decide
 * before touching a GPU, so it runs on any machine with a CUDA build: every dtype a slot lacks
 * is refused with the cpu's op name ("op matmul has no kernel for i64 on cuda"), weight
 * gradients in a dtype other than dt (or f32 under a half dt) are refused, embedding rows too
 * long for the backward's grid are an error, and the TF32 switch (blas.h) reports its previous
 * setting. The kernels' numbers are checked against the cpu on a GPU (tests/cuda).
 *
 * Built without the cuda device (no toolkit, or -DFSDP_CUDA=OFF), the tests skip.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "core/core.h"

#ifdef FSDP_HAVE_CUDA /* the build has the cuda device (CMakeLists.txt) */
#define HAVE_CUDA 1
#include "kernels/cuda/blas.h"
#include "kernels/cuda/cuda.h"
#endif

#ifdef HAVE_CUDA

/* A pointer the refusing kernels never dereference (nor pass to CUDA). */
static char dummy[64];
#define P ((void *)dummy)
#define F ((float *)dummy)

#define I64 FSDP_DTYPE_I64
#define F32 FSDP_DTYPE_F32
#define BF16 FSDP_DTYPE_BF16
#define F16 FSDP_DTYPE_F16

static void assert_refused(int rc, const char *msg) {
  assert_int_equal(rc, FSDP_ERR);
  assert_string_equal(fsdp_error_msg(), msg);
  fsdp_error_clear();
}

static void test_gemms_refuse_dtypes(void **state) {
  (void)state;
  const fsdp_dtype bad[] = {FSDP_DTYPE_F64, I64, FSDP_DTYPE_I32, FSDP_DTYPE_U8, FSDP_DTYPE_BOOL};
  char msg[128];
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    snprintf(msg, sizeof msg, "op matmul has no kernel for %s on cuda", fsdp_dtype_name(bad[i]));
    assert_refused(fsdp_cuda_gemm(NULL, bad[i], P, P, P, 2, 2, 2, false, false, 1, 0, 2, 2, 2),
                   msg);
    assert_refused(fsdp_cuda_bmm_forward(NULL, bad[i], P, P, P, 1, 2, 2, 2), msg);
    assert_refused(fsdp_cuda_bmm_backward(NULL, bad[i], P, P, P, P, P, 1, 2, 2, 2), msg);
    snprintf(msg, sizeof msg, "op linear has no kernel for %s on cuda", fsdp_dtype_name(bad[i]));
    assert_refused(fsdp_cuda_linear_forward(NULL, bad[i], P, P, P, P, 2, 2, 2), msg);
    assert_refused(fsdp_cuda_linear_backward(NULL, bad[i], bad[i], P, P, P, P, P, P, 2, 2, 2),
                   msg);
  }
  /* sizes do not matter: a dtype is refused even when there is nothing to compute */
  assert_refused(fsdp_cuda_gemm(NULL, I64, P, P, P, 0, 0, 0, false, false, 1, 0, 1, 1, 1),
                 "op matmul has no kernel for i64 on cuda");
}

static void test_weight_gradient_dtypes(void **state) {
  (void)state;
  /* gdt is dt, or f32 under bf16/f16: f16 under bf16 and bf16 under f32 are refused */
  assert_refused(fsdp_cuda_linear_backward(NULL, BF16, F16, P, P, P, P, P, P, 2, 2, 2),
                 "op linear (weight gradient) has no kernel for f16 on cuda");
  assert_refused(fsdp_cuda_linear_backward(NULL, F32, BF16, P, P, P, P, P, P, 2, 2, 2),
                 "op linear (weight gradient) has no kernel for bf16 on cuda");
  assert_refused(fsdp_cuda_layernorm_backward(NULL, F16, BF16, P, P, P, P, P, P, F, F, 2, 2),
                 "op layernorm (weight gradient) has no kernel for bf16 on cuda");
  assert_refused(fsdp_cuda_embedding_backward(NULL, F32, F16, P, P, P, I64, 2, 2),
                 "op embedding (weight gradient) has no kernel for f16 on cuda");
}

static void test_rows_refuse_dtypes(void **state) {
  (void)state;
  const fsdp_dtype bad[] = {FSDP_DTYPE_F64, I64, FSDP_DTYPE_I32, FSDP_DTYPE_U8, FSDP_DTYPE_BOOL};
  char msg[128];
  int64_t count = -1;
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    const char *dn = fsdp_dtype_name(bad[i]);
    snprintf(msg, sizeof msg, "op layernorm has no kernel for %s on cuda", dn);
    assert_refused(fsdp_cuda_layernorm_forward(NULL, bad[i], P, F, F, P, P, P, 2, 2, 1e-5f), msg);
    assert_refused(fsdp_cuda_layernorm_backward(NULL, bad[i], bad[i], P, P, P, P, P, P, F, F, 2,
                                                2),
                   msg);
    snprintf(msg, sizeof msg, "op softmax has no kernel for %s on cuda", dn);
    assert_refused(fsdp_cuda_softmax_forward(NULL, bad[i], P, P, 2, 2), msg);
    assert_refused(fsdp_cuda_softmax_backward(NULL, bad[i], P, P, P, 2, 2), msg);
    snprintf(msg, sizeof msg, "op cross_entropy has no kernel for %s on cuda", dn);
    assert_refused(fsdp_cuda_cross_entropy_forward(NULL, bad[i], F, F, P, P, I64, 2, 2, -1,
                                                   &count),
                   msg);
    assert_refused(fsdp_cuda_cross_entropy_backward(NULL, bad[i], P, F, P, F, P, I64, 2, 2, -1,
                                                    2),
                   msg);
    snprintf(msg, sizeof msg, "op mse has no kernel for %s on cuda", dn);
    assert_refused(fsdp_cuda_mse_forward(NULL, bad[i], F, P, P, 2), msg);
    assert_refused(fsdp_cuda_mse_backward(NULL, bad[i], P, P, F, P, P, 2), msg);
    snprintf(msg, sizeof msg, "op embedding has no kernel for %s on cuda", dn);
    assert_refused(fsdp_cuda_embedding_backward(NULL, bad[i], bad[i], P, P, P, I64, 2, 2), msg);
  }
  assert_int_equal(count, -1); /* a refused forward writes nothing */
  /* the forward gathers rows of any dtype but bool */
  assert_refused(fsdp_cuda_embedding_forward(NULL, FSDP_DTYPE_BOOL, P, P, I64, P, 2, 2),
                 "op embedding has no kernel for bool on cuda");
}

static void test_embedding_rows_too_long(void **state) {
  (void)state;
  /* the backward's grid has a block per 128 columns in y (at most 65535) */
  const int C = 65536 * 128;
  assert_int_equal(fsdp_cuda_embedding_backward(NULL, F32, F32, P, P, P, I64, 2, C), FSDP_ERR);
  assert_non_null(strstr(fsdp_error_msg(), "embedding: rows of 8388608 elements are too long"));
  fsdp_error_clear();
}

static void test_tf32_switch(void **state) {
  (void)state;
  assert_false(fsdp_cuda_tf32()); /* off by default */
  assert_false(fsdp_cuda_set_tf32(true));
  assert_true(fsdp_cuda_tf32());
  assert_true(fsdp_cuda_set_tf32(false));
  assert_false(fsdp_cuda_tf32());
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gemms_refuse_dtypes),
      cmocka_unit_test(test_weight_gradient_dtypes),
      cmocka_unit_test(test_rows_refuse_dtypes),
      cmocka_unit_test(test_embedding_rows_too_long),
      cmocka_unit_test(test_tf32_switch),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

#else

static void test_skipped(void **state) {
  (void)state;
  printf("skipped: built without the cuda device\n");
  skip();
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_skipped)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}

#endif
