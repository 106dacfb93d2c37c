// GEMM for the CUDA backend through cuBLAS: c = alpha * op(a) @ op(b) + beta * c
// with row-major operands. cuBLAS is column-major, and a row-major [M, N]
// matrix is the column-major [N, M] matrix c^T = op(b)^T op(a)^T, so the call
// swaps the operands: gemm(op_b, op_a, N, M, K, b, a) with the row-major leading
// dimensions (a: trans_a ? M : K, b: trans_b ? K : N, c: N), as the CPU's lda.
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops_cuda.h"

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
