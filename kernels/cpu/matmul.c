// GEMM for the CPU backend: c = alpha * op(a) @ op(b) + beta * c, row-major,
// through single-threaded OpenBLAS cblas_sgemm calls spread over the backend's
// own thread pool (kernels/cpu/threads.c says why not OpenBLAS's threads).
#include "kernels/cpu/cpu.h"
#include "moe/error.h"

#include <cblas.h>

// Below this many multiply-adds a GEMM runs on the calling thread: waking a
// worker costs microseconds, a 64x64x64 product about ten.
#define SPLIT_MIN_MACS (1L << 19)

typedef struct {
    bool ta, tb, by_rows;
    int M, N, K, lda, ldb, ldc, parts;
    float alpha, beta;
    const float *a, *b;
    float *c;
} gemm_job;

static void gemm_part(void *ctx, int i) {
    const gemm_job *j = ctx;
    const int n = j->by_rows ? j->M : j->N, r0 = (int)((long)n * i / j->parts),
              r1 = (int)((long)n * (i + 1) / j->parts);
    if (r1 <= r0) return;
    const float *a = j->a, *b = j->b;
    float *c = j->c;
    int M = j->M, N = j->N;
    if (j->by_rows) { // rows r0..r1 of C: rows of op(a)
        a += j->ta ? (size_t)r0 : (size_t)r0 * j->lda;
        c += (size_t)r0 * j->ldc;
        M = r1 - r0;
    } else { // columns r0..r1 of C: columns of op(b)
        b += j->tb ? (size_t)r0 * j->ldb : (size_t)r0;
        c += r0;
        N = r1 - r0;
    }
    cblas_sgemm(CblasRowMajor, j->ta ? CblasTrans : CblasNoTrans, j->tb ? CblasTrans : CblasNoTrans,
                M, N, j->K, j->alpha, a, j->lda, b, j->ldb, j->beta, c, j->ldc);
}

void moe_cpu_sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float *a,
                   int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    gemm_job j = {trans_a, trans_b, M >= N, M, N, K, lda, ldb, ldc, 1, alpha, beta, a, b, c};
    const int threads = moe_cpu_threads(), rows = j.by_rows ? M : N;
    if ((long)M * N * K >= SPLIT_MIN_MACS && threads > 1 && rows >= 32) {
        // Parts of at least 16 rows (the micro-kernel's height), at most one per thread.
        j.parts = rows / 16 < threads ? rows / 16 : threads;
    }
    moe_cpu_parallel_for(j.parts, gemm_part, &j);
}

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
    moe_cpu_sgemm(trans_a, trans_b, M, N, K, alpha, a, trans_a ? M : K, b, trans_b ? K : N, beta, c,
                  N);
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
