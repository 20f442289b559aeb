/*
 * gemm_peak.c — the chip's dense bf16 matrix rate, measured with cuBLASLt directly (not through
 * the engine), as the denominator of MFU in bench/gpu_step.lua and bench/anchors/torch_gpt2.py
 * (scripts/gpu-check runs it first and hands the figure to both). Not a test.
 *
 *   gemm_peak [M N K] [iterations]      default 8192 8192 8192, 20
 *
 * C (M, N) = A (M, K) B (K, N) in bf16 with f32 accumulation (CUBLAS_COMPUTE_32F), both operands
 * K-major (cuBLAS's "TN"), uniform random values in [-1, 1) (zeros run faster on this hardware
 * and would flatter the peak), the best algorithm of cuBLASLt's heuristic with 64 MiB of
 * workspace; 3 warm-up products, then `iterations` timed with CUDA events. Prints a line and a
 * JSON line {"what": "gemm_peak", ..., "tflops": x}. Exits 77 without a GPU.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>
#include <cuda_runtime.h>

#define CUDA_OK(call)                                                                           \
  do {                                                                                          \
    cudaError_t e_ = (call);                                                                    \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "gemm_peak: %s: %s\n", #call, cudaGetErrorString(e_));                   \
      return 1;                                                                                 \
    }                                                                                           \
  } while (0)
#define LT_OK(call)                                                                             \
  do {                                                                                          \
    cublasStatus_t s_ = (call);                                                                 \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                          \
      fprintf(stderr, "gemm_peak: %s: cuBLAS status %d\n", #call, (int)s_);                    \
      return 1;                                                                                 \
    }                                                                                           \
  } while (0)

/* n bf16 values uniform in [-1, 1) (rounded to nearest even from f32) */
static uint16_t *random_bf16(size_t n, uint64_t seed) {
  uint16_t *h = malloc(n * sizeof *h);
  if (!h) return NULL;
  uint64_t s = seed;
  for (size_t i = 0; i < n; i++) {
    s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
    float f = (float)((double)((s * 0x2545f4914f6cdd1dull) >> 40) / 16777216.0 * 2.0 - 1.0);
    uint32_t u;
    memcpy(&u, &f, 4);
    h[i] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
  return h;
}

int main(int argc, char **argv) {
  int64_t M = 8192, N = 8192, K = 8192;
  int iters = 20;
  if (argc >= 4) M = atoll(argv[1]), N = atoll(argv[2]), K = atoll(argv[3]);
  if (argc >= 5) iters = atoi(argv[4]);
  if (M <= 0 || N <= 0 || K <= 0 || iters <= 0) {
    fprintf(stderr, "usage: gemm_peak [M N K] [iterations]\n");
    return 2;
  }
  int ndev = 0;
  cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev == 0) {
    printf("no CUDA device: %s\n", e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    return 77;
  }
  struct cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));

  size_t na = (size_t)M * K, nb = (size_t)K * N, nc = (size_t)M * N, ws_bytes = 64u << 20;
  uint16_t *ha = random_bf16(na, 1), *hb = random_bf16(nb, 2);
  if (!ha || !hb) {
    fprintf(stderr, "gemm_peak: out of host memory\n");
    return 1;
  }
  void *a, *b, *c, *ws;
  CUDA_OK(cudaMalloc(&a, na * 2));
  CUDA_OK(cudaMalloc(&b, nb * 2));
  CUDA_OK(cudaMalloc(&c, nc * 2));
  CUDA_OK(cudaMalloc(&ws, ws_bytes));
  CUDA_OK(cudaMemcpy(a, ha, na * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(b, hb, nb * 2, cudaMemcpyHostToDevice));
  free(ha), free(hb);

  cublasLtHandle_t lt;
  LT_OK(cublasLtCreate(&lt));
  cublasLtMatmulDesc_t op;
  LT_OK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  LT_OK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  LT_OK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  /* column-major: A stored (K, M) and transposed, B stored (K, N), C (M, N) */
  cublasLtMatrixLayout_t la, lb, lc;
  LT_OK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, (uint64_t)K, (uint64_t)M, K));
  LT_OK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, (uint64_t)K, (uint64_t)N, K));
  LT_OK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, (uint64_t)M, (uint64_t)N, M));
  cublasLtMatmulPreference_t pref;
  LT_OK(cublasLtMatmulPreferenceCreate(&pref));
  LT_OK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &ws_bytes, sizeof ws_bytes));
  cublasLtMatmulHeuristicResult_t heur;
  int found = 0;
  LT_OK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heur, &found));
  if (found == 0) {
    fprintf(stderr, "gemm_peak: cuBLASLt has no algorithm for this product\n");
    return 1;
  }
  float alpha = 1.0f, beta = 0.0f;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  for (int i = 0; i < 3; i++)
    LT_OK(cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, c, lc, c, lc, &heur.algo, ws,
                         ws_bytes, stream));
  cudaEvent_t t0, t1;
  CUDA_OK(cudaEventCreate(&t0));
  CUDA_OK(cudaEventCreate(&t1));
  CUDA_OK(cudaEventRecord(t0, stream));
  for (int i = 0; i < iters; i++)
    LT_OK(cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, c, lc, c, lc, &heur.algo, ws,
                         ws_bytes, stream));
  CUDA_OK(cudaEventRecord(t1, stream));
  CUDA_OK(cudaEventSynchronize(t1));
  float ms = 0;
  CUDA_OK(cudaEventElapsedTime(&ms, t0, t1));
  double tflops = 2.0 * (double)M * N * K * iters / (ms * 1e-3) / 1e12;
  printf("gemm_peak: %s, bf16 %lldx%lldx%lld (f32 accumulation, random data): %.3f ms per "
         "product, %.1f TFLOP/s\n", prop.name, (long long)M, (long long)N, (long long)K,
         ms / iters, tflops);
  printf("{\"what\": \"gemm_peak\", \"gpu\": \"%s\", \"dtype\": \"bf16\", \"M\": %lld, \"N\": %lld, "
         "\"K\": %lld, \"iterations\": %d, \"ms\": %.4f, \"tflops\": %.2f}\n", prop.name,
         (long long)M, (long long)N, (long long)K, iters, ms / iters, tflops);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(lt);
  cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(ws);
  return 0;
}
