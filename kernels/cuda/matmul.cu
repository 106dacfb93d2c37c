// GEMM for the CUDA backend through cuBLAS: c = alpha * op(a) @ op(b) + beta * c
// with row-major operands. cuBLAS is column-major, and a row-major [M, N]
// matrix is the column-major [N, M] matrix c^T = op(b)^T op(a)^T, so the call
// swaps the operands: gemm(op_b, op_a, N, M, K, b, a) with the row-major leading
// dimensions (a: trans_a ? M : K, b: trans_b ? K : N, c: N), as the CPU's lda.
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops_cuda.h"

#include <stdlib.h>
#include <string.h>

// c = beta * c (beta = 0 writes 0, NaN in c included): the K = 0 case, which
// cuBLAS would treat the same but rejects with lda = 0.
__global__ static void scale_kernel(float *c, size_t n, float beta) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        c[i] = beta == 0.0f ? 0.0f : beta * c[i];
}

static int gemm(float *c, const float *a, const float *b, int M, int N, int K, bool trans_a,
                bool trans_b, float alpha, float beta, cublasComputeType_t compute) {
    if (M < 0 || N < 0 || K < 0)
        return moe_fail(MOE_EINVAL, "matmul: negative size M=%d N=%d K=%d", M, N, K);
    if (M == 0 || N == 0) return 0;
    moe_cuda_ctx ctx = {};
    MOE_TRY(moe_cuda_ctx_get(&ctx));
    if (K == 0) {
        size_t n = (size_t)M * N;
        scale_kernel<<<moe_cuda_blocks(n, 256), 256, 0, ctx.stream>>>(c, n, beta);
        CUDA_LAUNCH_CHECK();
        return 0;
    }
    cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    int lda = trans_a ? M : K, ldb = trans_b ? K : N;
    if (compute == CUBLAS_COMPUTE_32F) {
        CUBLAS_TRY(
            cublasSgemm(ctx.cublas, op_b, op_a, N, M, K, &alpha, b, ldb, a, lda, &beta, c, N));
    } else {
        CUBLAS_TRY(cublasGemmEx(ctx.cublas, op_b, op_a, N, M, K, &alpha, b, CUDA_R_32F, ldb, a,
                                CUDA_R_32F, lda, &beta, c, CUDA_R_32F, N, compute,
                                CUBLAS_GEMM_DEFAULT));
    }
    return 0;
}

extern "C" int moe_cuda_matmul(float *c, const float *a, const float *b, int M, int N, int K,
                               bool trans_a, bool trans_b, float alpha, float beta) {
    return gemm(c, a, b, M, N, K, trans_a, trans_b, alpha, beta, CUBLAS_COMPUTE_32F);
}

// bf16 tensor cores, fp32 storage and accumulation: cuBLAS rounds the inputs
// to bf16 internally (about 3 significant digits: the 1e-2 test tolerance).
extern "C" int moe_cuda_matmul_bf16(float *c, const float *a, const float *b, int M, int N, int K,
                                    bool trans_a, bool trans_b, float alpha, float beta) {
    return gemm(c, a, b, M, N, K, trans_a, trans_b, alpha, beta, CUBLAS_COMPUTE_32F_FAST_16BF);
}

// ---- grouped GEMMs over expert segments ---------------------------------------------
// One cublasGemmGroupedBatchedEx call (cuBLAS >= 12.5) with one group per
// non-empty segment: sizes and leading dimensions are host arrays, the
// operand pointers a device array written per call by small kernels that
// carry the pointers in their launch parameters (a copy from pageable host
// memory may wait for the stream, which would stall every grouped GEMM). Where cuBLAS does not
// support the compute type for grouped GEMMs (NOT_SUPPORTED / INVALID_VALUE),
// the segments run as one GEMM each on the same stream.

typedef struct {
    cublasOperation_t ta, tb;
    int m, n, k, lda, ldb, ldc;
    const float *a, *b;
    float *c;
} gemm_desc; // one column-major call (operands already swapped)

// Up to PTRS_PER_LAUNCH pointers by value: the kernel writes them to dst.
#define PTRS_PER_LAUNCH 400 // 3.2 KB of the 4 KB parameter space
typedef struct {
    const void *p[PTRS_PER_LAUNCH];
} ptr_block;

__global__ static void write_ptrs_kernel(const void **dst, ptr_block b, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        dst[i] = b.p[i];
}

// dptr[0, n) = ptr[0, n) on the stream, without a host-to-device copy.
static int upload_ptrs(void **dptr, const void *const *ptr, int n, cudaStream_t stream) {
    for (int i0 = 0; i0 < n; i0 += PTRS_PER_LAUNCH) {
        const int m = n - i0 < PTRS_PER_LAUNCH ? n - i0 : PTRS_PER_LAUNCH;
        ptr_block b;
        memcpy(b.p, ptr + i0, sizeof(void *) * (size_t)m);
        write_ptrs_kernel<<<1, 128, 0, stream>>>((const void **)dptr + i0, b, m);
        CUDA_LAUNCH_CHECK();
    }
    return 0;
}

// Grouped calls cuBLAS refused (a compute type its grouped GEMM lacks) and
// ran as one GEMM per segment instead: the benches report it.
static long grouped_fallbacks;

extern "C" long moe_cuda_grouped_fallbacks(void) {
    return grouped_fallbacks;
}

static int run_grouped(const gemm_desc *d, int G, float alpha, float beta,
                       cublasComputeType_t compute) {
    if (G == 0) return 0;
    moe_cuda_ctx ctx = {};
    MOE_TRY(moe_cuda_ctx_get(&ctx));
    int rc = 0;
    cublasOperation_t *ta = (cublasOperation_t *)malloc(sizeof *ta * 2 * G), *tb = ta ? ta + G : 0;
    int *iv = (int *)malloc(sizeof(int) * 6 * G + sizeof(int) * G);
    float *ab = (float *)malloc(sizeof(float) * 2 * G);
    const void **ptr = (const void **)malloc(sizeof(void *) * 3 * G);
    void **dptr = NULL;
    if (!ta || !iv || !ab || !ptr) {
        rc = moe_fail(MOE_ENOMEM, "grouped GEMM: host arrays for %d groups", G);
        goto done;
    }
    {
        int *m = iv, *n = m + G, *k = n + G, *lda = k + G, *ldb = lda + G, *ldc = ldb + G,
            *gs = ldc + G;
        for (int g = 0; g < G; g++) {
            ta[g] = d[g].ta, tb[g] = d[g].tb;
            m[g] = d[g].m, n[g] = d[g].n, k[g] = d[g].k;
            lda[g] = d[g].lda, ldb[g] = d[g].ldb, ldc[g] = d[g].ldc, gs[g] = 1;
            ab[g] = alpha, ab[G + g] = beta;
            ptr[g] = d[g].a, ptr[G + g] = d[g].b, ptr[2 * G + g] = d[g].c;
        }
        cudaError_t e = cudaMallocAsync((void **)&dptr, sizeof(void *) * 3 * G, ctx.stream);
        if (e != cudaSuccess) dptr = NULL;
        if (e == cudaSuccess && (rc = upload_ptrs(dptr, ptr, 3 * G, ctx.stream)) < 0) goto done;
        if (e != cudaSuccess) {
            cudaGetLastError(); // reported here; later calls start clean
            rc = moe_fail(MOE_EDEVICE, "%s:%d: grouped GEMM pointer array: %s", __FILE__, __LINE__,
                          cudaGetErrorString(e));
            goto done;
        }
        cublasStatus_t st = cublasGemmGroupedBatchedEx(
            ctx.cublas, ta, tb, m, n, k, ab, (const void *const *)dptr, CUDA_R_32F, lda,
            (const void *const *)(dptr + G), CUDA_R_32F, ldb, ab + G, (void *const *)(dptr + 2 * G),
            CUDA_R_32F, ldc, G, gs, compute);
        if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) {
            grouped_fallbacks++;
            for (int g = 0; g < G && !rc; g++) { // per-segment fallback
                st = cublasGemmEx(ctx.cublas, ta[g], tb[g], m[g], n[g], k[g], &alpha, d[g].a,
                                  CUDA_R_32F, lda[g], d[g].b, CUDA_R_32F, ldb[g], &beta, d[g].c,
                                  CUDA_R_32F, ldc[g], compute, CUBLAS_GEMM_DEFAULT);
                if (st != CUBLAS_STATUS_SUCCESS)
                    rc = moe_fail(MOE_EDEVICE, "%s:%d: cublasGemmEx (segment %d): %s", __FILE__,
                                  __LINE__, g, moe_cublas_status_string(st));
            }
        } else if (st != CUBLAS_STATUS_SUCCESS) {
            rc = moe_fail(MOE_EDEVICE, "%s:%d: cublasGemmGroupedBatchedEx (%d groups): %s",
                          __FILE__, __LINE__, G, moe_cublas_status_string(st));
        }
    }
done:
    if (dptr) cudaFreeAsync(dptr, ctx.stream); // stream-ordered: after the GEMMs
    free(ta), free(iv), free(ab), free(ptr);
    return rc;
}

// Checks that offsets [G + 1] never decrease (op names the caller in the
// message), then allocates room for one descriptor per segment.
static int alloc_descs(gemm_desc **d, const int *offsets, int G, const char *op) {
    for (int g = 0; g < G; g++)
        if (offsets[g + 1] < offsets[g])
            return moe_fail(MOE_EINVAL, "%s: offsets decrease at %d", op, g);
    *d = (gemm_desc *)malloc(sizeof **d * (size_t)(G > 0 ? G : 1));
    if (!*d) return moe_fail(MOE_ENOMEM, "grouped GEMM: %d groups", G);
    return 0;
}

static int grouped(float *c, const float *a, const float *b, size_t b_stride, const int *offsets,
                   int G, int N, int K, bool trans_b, float alpha, float beta,
                   cublasComputeType_t compute) {
    if (G < 0 || N < 0 || K < 1)
        return moe_fail(MOE_EINVAL, "matmul_grouped: G=%d N=%d K=%d", G, N, K);
    gemm_desc *d;
    MOE_TRY(alloc_descs(&d, offsets, G, "matmul_grouped"));
    int n_desc = 0;
    for (int g = 0; g < G; g++) {
        const int r0 = offsets[g], n = offsets[g + 1] - offsets[g];
        if (n == 0 || N == 0) continue;
        // row-major c_g [n, N] = a_g [n, K] op(b_g): column-major gemm(op_b, N, N, n, K)
        d[n_desc++] = (gemm_desc){trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                  CUBLAS_OP_N,
                                  N,
                                  n,
                                  K,
                                  trans_b ? K : N,
                                  K,
                                  N,
                                  b + (size_t)g * b_stride,
                                  a + (size_t)r0 * K,
                                  c + (size_t)r0 * N};
    }
    int rc = run_grouped(d, n_desc, alpha, beta, compute);
    free(d);
    return rc;
}

static int grouped_wgrad(float *c, size_t c_stride, const float *a, const float *b,
                         const int *offsets, int G, int M, int N, float alpha, float beta,
                         cublasComputeType_t compute) {
    if (G < 0 || M < 0 || N < 0)
        return moe_fail(MOE_EINVAL, "matmul_grouped_wgrad: G=%d M=%d N=%d", G, M, N);
    gemm_desc *d;
    MOE_TRY(alloc_descs(&d, offsets, G, "matmul_grouped_wgrad"));
    int n_desc = 0;
    for (int g = 0; g < G; g++) {
        const int r0 = offsets[g], n = offsets[g + 1] - offsets[g];
        if (n == 0 || M == 0 || N == 0) continue;
        // row-major c_g [M, N] = a_g^T [M, n] b_g [n, N], a_g stored [n, M]:
        // column-major gemm(N, T, N, M, n) with b_g (ld N) first, a_g (ld M) second
        d[n_desc++] = (gemm_desc){CUBLAS_OP_N,
                                  CUBLAS_OP_T,
                                  N,
                                  M,
                                  n,
                                  N,
                                  M,
                                  N,
                                  b + (size_t)r0 * N,
                                  a + (size_t)r0 * M,
                                  c + (size_t)g * c_stride};
    }
    int rc = run_grouped(d, n_desc, alpha, beta, compute);
    free(d);
    return rc;
}

extern "C" int moe_cuda_matmul_grouped(float *c, const float *a, const float *b, size_t b_stride,
                                       const int *offsets, int G, int N, int K, bool trans_b,
                                       float alpha, float beta) {
    return grouped(c, a, b, b_stride, offsets, G, N, K, trans_b, alpha, beta, CUBLAS_COMPUTE_32F);
}

extern "C" int moe_cuda_matmul_grouped_wgrad(float *c, size_t c_stride, const float *a,
                                             const float *b, const int *offsets, int G, int M,
                                             int N, float alpha, float beta) {
    return grouped_wgrad(c, c_stride, a, b, offsets, G, M, N, alpha, beta, CUBLAS_COMPUTE_32F);
}

extern "C" int moe_cuda_matmul_grouped_bf16(float *c, const float *a, const float *b,
                                            size_t b_stride, const int *offsets, int G, int N,
                                            int K, bool trans_b, float alpha, float beta) {
    return grouped(c, a, b, b_stride, offsets, G, N, K, trans_b, alpha, beta,
                   CUBLAS_COMPUTE_32F_FAST_16BF);
}

extern "C" int moe_cuda_matmul_grouped_wgrad_bf16(float *c, size_t c_stride, const float *a,
                                                  const float *b, const int *offsets, int G, int M,
                                                  int N, float alpha, float beta) {
    return grouped_wgrad(c, c_stride, a, b, offsets, G, M, N, alpha, beta,
                         CUBLAS_COMPUTE_32F_FAST_16BF);
}
