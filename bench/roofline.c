// The machine's ceilings for the CPU performance goals (README "CPU
// performance"): the fused multiply-add peak of one thread and of all pool
// threads, and the single-threaded sgemm rate of the BLAS the build links
// (OpenBLAS) beside any other BLAS named with --lib (loaded at run time, e.g.
// Debian's BLIS: --lib /usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4),
// (in a link namespace of its own) on the GEMM shapes of the d_model 512 / seq 256 training config
// (batch 8: T = 2048 tokens a step, D = 512, H = 1024, E = 8, top-2: 512 rows
// an expert; 4 heads of 128, 2 kv heads) and of configs/tiny.json (512
// tokens, D = 128, H = 256: 128 rows an expert), plus the backend's own sgemm (OpenBLAS
// split over the pool) at the dense shape. One JSON line per figure; sgemm
// lines carry of_peak, their rate over the peak of the same thread count.
//
// The peak loop is twelve independent 8-wide FMA chains per thread (two FMA
// pipes of four cycles' latency need eight); built without FMA it prints no
// peak line.
//   build/bench/roofline [--lib PATH]... [--machine NAME]
#define _GNU_SOURCE // dlmopen
#include "kernels/cpu/cpu.h"

#include <cblas.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __FMA__
#include <immintrin.h>
#endif

typedef void (*sgemm_fn)(enum CBLAS_ORDER, enum CBLAS_TRANSPOSE, enum CBLAS_TRANSPOSE, int, int,
                         int, float, const float *, int, const float *, int, float, float *, int);

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

enum { CHAINS = 12, PEAK_ITERS = 20000000 };

#ifdef __FMA__
typedef struct {
    float out[64];
} peak_job;

static void peak_task(void *ctx, int t) {
    __m256 a[CHAINS];
    for (int i = 0; i < CHAINS; i++)
        a[i] = _mm256_set1_ps(0.001f * (float)(i + t));
    const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
    for (long k = 0; k < PEAK_ITERS; k++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++)
            a[i] = _mm256_fmadd_ps(a[i], b, c);
    }
    __m256 s = a[0];
    for (int i = 1; i < CHAINS; i++)
        s = _mm256_add_ps(s, a[i]);
    float o[8];
    _mm256_storeu_ps(o, s);
    ((peak_job *)ctx)->out[t % 64] = o[0]; // kept, so the loop is not dropped
}

// GFLOP/s of `threads` threads running the loop at once (best of 3).
static double fma_peak(int threads) {
    peak_job J;
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        const double t0 = now();
        if (threads == 1)
            peak_task(&J, 0);
        else
            moe_cpu_parallel_for(threads, peak_task, &J);
        const double dt = now() - t0;
        if (dt < best) best = dt;
    }
    return threads * (double)PEAK_ITERS * CHAINS * 16 / best / 1e9;
}
#endif

typedef struct {
    const char *name;
    int M, N, K;
    bool ta, tb;
} shape;

// C[M,N] = op(A) op(B), row-major; the layer's forward and the two
// backward GEMMs of an expert, and the dense projections.
static const shape SHAPES[] = {
    {"d512_expert_w13_fwd", 512, 2048, 512, false, true},
    {"d512_expert_w2_fwd", 512, 512, 1024, false, true},
    {"d512_expert_dw13", 2048, 512, 512, true, false},
    {"d512_expert_dx", 512, 512, 2048, false, false},
    {"d512_attn_qkv_fwd", 2048, 1024, 512, false, true},
    {"tiny_expert_w13_fwd", 128, 512, 128, false, true},
    {"tiny_expert_dw13", 512, 128, 128, true, false},
};

static double gemm_rate(sgemm_fn f, const shape *s, float *a, float *b, float *c) {
    const double flops = 2.0 * s->M * s->N * s->K;
    const int reps = 3 + (int)(2e9 / flops);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        const double t0 = now();
        f(CblasRowMajor, s->ta ? CblasTrans : CblasNoTrans, s->tb ? CblasTrans : CblasNoTrans, s->M,
          s->N, s->K, 1.0f, a, s->ta ? s->M : s->K, b, s->tb ? s->K : s->N, 0.0f, c, s->N);
        const double dt = now() - t0;
        if (dt < best) best = dt;
    }
    return flops / best / 1e9;
}

static void pool_sgemm(enum CBLAS_ORDER o, enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb, int M,
                       int N, int K, float alpha, const float *a, int lda, const float *b, int ldb,
                       float beta, float *c, int ldc) {
    (void)o;
    moe_cpu_sgemm(ta == CblasTrans, tb == CblasTrans, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
}

int main(int argc, char **argv) {
    const char *machine = "", *libs[8];
    int n_libs = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--machine") && i + 1 < argc)
            machine = argv[++i];
        else if (!strcmp(argv[i], "--lib") && i + 1 < argc && n_libs < 8)
            libs[n_libs++] = argv[++i];
        else {
            fprintf(stderr, "usage: roofline [--lib PATH]... [--machine NAME]\n");
            return 2;
        }
    }
    const int threads = moe_cpu_threads();
    double peak1 = 0, peak_all = 0;
#ifdef __FMA__
    peak1 = fma_peak(1), peak_all = fma_peak(threads);
    printf("{\"bench\":\"roofline\",\"machine\":\"%s\",\"figure\":\"fma_peak\",\"threads\":1,"
           "\"gflops\":%.1f}\n",
           machine, peak1);
    printf("{\"bench\":\"roofline\",\"machine\":\"%s\",\"figure\":\"fma_peak\",\"threads\":%d,"
           "\"gflops\":%.1f}\n",
           machine, threads, peak_all);
#endif
    const size_t big = (size_t)4096 * 2048;
    float *a = malloc(big * sizeof(float)), *b = malloc(big * sizeof(float));
    float *c = malloc(big * sizeof(float));
    if (!a || !b || !c) {
        fprintf(stderr, "roofline: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < big; i++)
        a[i] = 0.01f * (float)(i % 97), b[i] = 0.02f * (float)(i % 89), c[i] = 0.0f;
    sgemm_fn fns[9] = {cblas_sgemm};
    const char *names[9] = {"openblas (linked)"};
    int n_fns = 1;
    for (int l = 0; l < n_libs; l++) {
        // a namespace of its own: a library whose cblas_sgemm calls sgemm_ (BLIS
        // does) would otherwise bind it to the linked OpenBLAS's
        void *h = dlmopen(LM_ID_NEWLM, libs[l], RTLD_NOW | RTLD_LOCAL);
        sgemm_fn f = h ? (sgemm_fn)dlsym(h, "cblas_sgemm") : NULL;
        if (!f) {
            fprintf(stderr, "roofline: %s: no cblas_sgemm (%s)\n", libs[l],
                    h ? "symbol missing" : dlerror());
            return 1;
        }
        // named by its folder and file (blis-pthread/libblis.so.4)
        const char *name = libs[l] + strlen(libs[l]);
        for (int slashes = 0; name > libs[l] && slashes < 2; name--)
            if (name[-1] == '/' && ++slashes == 2) break;
        fns[n_fns] = f, names[n_fns++] = name;
    }
    for (size_t s = 0; s < sizeof SHAPES / sizeof *SHAPES; s++)
        for (int l = 0; l < n_fns; l++) {
            const double r = gemm_rate(fns[l], &SHAPES[s], a, b, c);
            printf("{\"bench\":\"roofline\",\"machine\":\"%s\",\"figure\":\"sgemm\",\"lib\":\"%s\","
                   "\"threads\":1,\"shape\":\"%s\",\"M\":%d,\"N\":%d,\"K\":%d,\"gflops\":%.1f,"
                   "\"of_peak\":%.3f}\n",
                   machine, names[l], SHAPES[s].name, SHAPES[s].M, SHAPES[s].N, SHAPES[s].K, r,
                   peak1 > 0 ? r / peak1 : 0.0);
        }
    const double r = gemm_rate(pool_sgemm, &SHAPES[0], a, b, c);
    printf(
        "{\"bench\":\"roofline\",\"machine\":\"%s\",\"figure\":\"sgemm\",\"lib\":\"moe_cpu_sgemm "
        "(openblas over the pool)\",\"threads\":%d,\"shape\":\"%s\",\"M\":%d,\"N\":%d,\"K\":%d,"
        "\"gflops\":%.1f,\"of_peak\":%.3f}\n",
        machine, threads, SHAPES[0].name, SHAPES[0].M, SHAPES[0].N, SHAPES[0].K, r,
        peak_all > 0 ? r / peak_all : 0.0);
    free(a), free(b), free(c);
    return 0;
}
