// GEMM for the CPU backend: c = alpha * op(a) @ op(b) + beta * c, row-major,
// through OpenBLAS cblas_sgemm (threads from OPENBLAS_NUM_THREADS).
#include "kernels/cpu/cpu.h"
#include "moe/error.h"

#include <cblas.h>

int moe_cpu_matmul(float *c, const float *a, const float *b, int M, int N, int K, bool trans_a,
                   bool trans_b, float alpha, float beta) {
    if (M < 0 || N < 0 || K < 0)
        return moe_fail(MOE_EINVAL, "matmul: negative size M=%d N=%d K=%d", M, N, K);
    if (M == 0 || N == 0) return 0;
    if (K == 0) { // nothing to multiply; BLAS would reject lda = 0
        for (long i = 0; i < (long)M * N; i++)
            c[i] = beta == 0.0f ? 0.0f : beta * c[i];
        return 0;
    }
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, a, trans_a ? M : K, b,
                trans_b ? K : N, beta, c, N);
    return 0;
}

// Grouped GEMMs: one sgemm per non-empty segment, the calls the MoE layer
// makes expert by expert (so results equal its per-expert loop bit for bit).
int moe_cpu_matmul_grouped(float *c, const float *a, const float *b, size_t b_stride,
                           const int *offsets, int G, int N, int K, bool trans_b, float alpha,
                           float beta) {
    if (G < 0 || N < 0 || K < 1)
        return moe_fail(MOE_EINVAL, "matmul_grouped: G=%d N=%d K=%d", G, N, K);
    for (int g = 0; g < G; g++) {
        const int r0 = offsets[g], n = offsets[g + 1] - offsets[g];
        if (n < 0) return moe_fail(MOE_EINVAL, "matmul_grouped: offsets decrease at %d", g);
        if (n == 0) continue;
        MOE_TRY(moe_cpu_matmul(c + (size_t)r0 * N, a + (size_t)r0 * K, b + (size_t)g * b_stride, n,
                               N, K, false, trans_b, alpha, beta));
    }
    return 0;
}

int moe_cpu_matmul_grouped_wgrad(float *c, size_t c_stride, const float *a, const float *b,
                                 const int *offsets, int G, int M, int N, float alpha, float beta) {
    if (G < 0 || M < 0 || N < 0)
        return moe_fail(MOE_EINVAL, "matmul_grouped_wgrad: G=%d M=%d N=%d", G, M, N);
    for (int g = 0; g < G; g++) {
        const int r0 = offsets[g], n = offsets[g + 1] - offsets[g];
        if (n < 0) return moe_fail(MOE_EINVAL, "matmul_grouped_wgrad: offsets decrease at %d", g);
        if (n == 0) continue;
        MOE_TRY(moe_cpu_matmul(c + (size_t)g * c_stride, a + (size_t)r0 * M, b + (size_t)r0 * N, M,
                               N, n, true, false, alpha, beta));
    }
    return 0;
}
