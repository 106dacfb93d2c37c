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
