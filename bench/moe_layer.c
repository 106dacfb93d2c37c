// CPU MoE layer benchmark (DESIGN "Performance targets"): forward, backward and
// forward+backward of the layer on the CPU op table, one JSON object per line,
// with effective GFLOP/s, the OpenBLAS sgemm rate measured in the same run and
// the share of time spent routing (gate + router + permute + unpermute).
//
// Effective FLOPs count useful work only: forward = 2*T*D*E (gate) +
// 6*rows*D*H (three expert projections over the kept assignments, rows);
// backward = 2 x forward. The sgemm references run the backend's GEMM
// (moe_cpu_sgemm: single-threaded OpenBLAS split over the pool, all threads,
// as the layer gets them): the dense [rows, D] @ [D, 2H] GEMM (the goal's
// reference, ratio_to_dense_sgemm) and the layer's own expert GEMM shape,
// x_e [rows/E, D] @ [w1;w3]^T [D, 2H] (M = rows/E, N = 2H, K = D). Times are the best repetition
// after one warm-up (the machine is shared; interference only ever adds time), the median is
// printed beside it; routing_share and phases_ms come from that best repetition; the sgemm rates
// are the best batch, batches interleaved with the layer's repetitions.
// others_load: the fraction of all cores that other processes used meanwhile.
//
// usage: moe_layer [--quick] [--reps N] [--shape E] [--machine NAME]
#include "moe/moe_layer.h"
#include "kernels/cpu/cpu.h"
#include "moe/error.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static uint64_t rng_state = 0x853c49e6748fea9bull;
static float randn(void) {
    // xorshift64* + Box-Muller; quality is irrelevant, speed and determinism matter
    double u[2];
    for (int i = 0; i < 2; i++) {
        rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
        u[i] = ((rng_state * 0x2545F4914F6CDD1Dull) >> 11) * (1.0 / 9007199254740992.0);
    }
    return (float)(sqrt(-2.0 * log(u[0] + 1e-300)) * cos(6.283185307179586 * u[1]));
}

static void fill(float *x, size_t n, float scale) {
    for (size_t i = 0; i < n; i++)
        x[i] = scale * randn();
}

// The sgemm reference: C[M,N] = A[M,K] @ B[N,K]^T (the layer's
// forward expert GEMM form) in batches about as long as one forward+backward
// of the layer, so that on a shared machine a batch and a repetition of the
// layer have the same chances of a quiet window. Batches run before
// the layer and again between its repetitions, and the best rate counts: on a
// shared machine the reference gets the same chances of a quiet moment.
typedef struct {
    int M, N, K, inner;
    float *a, *b, *c;
    double best; // GFLOP/s
} sgemm_ref;

static void sgemm_ref_batch(sgemm_ref *r) {
    double t0 = now_s();
    for (int i = 0; i < r->inner; i++)
        moe_cpu_sgemm(false, true, r->M, r->N, r->K, 1.0f, r->a, r->K, r->b, r->K, 0.0f, r->c,
                      r->N);
    double g = 2.0 * r->M * r->N * r->K * r->inner / (now_s() - t0) * 1e-9;
    if (g > r->best) r->best = g;
}

static int sgemm_ref_init(sgemm_ref *r, int M, int N, int K, int reps, double batch_s) {
    *r = (sgemm_ref){.M = M, .N = N, .K = K, .inner = 1};
    r->a = malloc(sizeof(float) * M * K), r->b = malloc(sizeof(float) * N * K);
    r->c = malloc(sizeof(float) * M * N);
    if (!r->a || !r->b || !r->c) return moe_fail(MOE_ENOMEM, "bench: sgemm reference buffers");
    fill(r->a, (size_t)M * K, 1.0f), fill(r->b, (size_t)N * K, 1.0f);
    for (;;) { // calibrate (also warms up)
        double t0 = now_s();
        sgemm_ref_batch(r);
        if (now_s() - t0 > batch_s || r->inner > (1 << 16)) break;
        r->inner *= 2;
    }
    r->best = 0;
    for (int q = 0; q < reps; q++)
        sgemm_ref_batch(r);
    return 0;
}

static void sgemm_ref_free(sgemm_ref *r) {
    free(r->a), free(r->b), free(r->c);
}

// CPU seconds used on the whole machine (/proc/stat, all cores, not idle), to
// report how much of it other processes took while we measured; -1 if unknown.
static double machine_busy_s(void) {
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return -1;
    unsigned long long v[8] = {0};
    int n = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
                   &v[4], &v[5], &v[6], &v[7]);
    fclose(f);
    if (n != 8) return -1;
    unsigned long long busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]; // minus idle, iowait
    return (double)busy / (double)sysconf(_SC_CLK_TCK);
}

static double process_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
    moe_layer_config cfg;
    float *flat, *gflat, *x, *y, *dy, *dx;
    moe_layer_params p, g;
    moe_layer_acts a;
    moe_layer_timing tm;
} bench_layer;

static int setup(bench_layer *b, int T, int D, int H, int E, int k) {
    memset(b, 0, sizeof *b);
    b->cfg.T_max = T, b->cfg.D = D, b->cfg.H = H, b->cfg.E = E;
    moe_router_config_default(&b->cfg.router);
    b->cfg.router.top_k = k;
    b->cfg.router.capacity_factor = 1.25;
    MOE_TRY(moe_layer_acts_alloc(&b->a, &b->cfg, &moe_ops_cpu));
    // Parameters, gradients and inputs in backend memory, as a trainer holds them.
    const moe_ops *ops = &moe_ops_cpu;
    size_t np = moe_layer_num_params(&b->cfg), nx = (size_t)T * D;
    b->flat = ops->alloc(np * sizeof(float));
    b->gflat = ops->alloc(np * sizeof(float));
    b->x = ops->alloc(nx * sizeof(float)), b->y = ops->alloc(nx * sizeof(float));
    b->dy = ops->alloc(nx * sizeof(float)), b->dx = ops->alloc(nx * sizeof(float));
    if (!b->flat || !b->gflat || !b->x || !b->y || !b->dy || !b->dx)
        return moe_fail(MOE_ENOMEM, "bench: out of memory for %zu parameters", np);
    ops->zero(b->gflat, np);
    ops->zero(b->dx, nx);
    moe_layer_params_view(&b->p, b->flat, &b->cfg);
    moe_layer_params_view(&b->g, b->gflat, &b->cfg);
    fill(b->flat, np, 1.0f / sqrtf((float)D));
    // A small gate keeps the softmax near uniform: choices are decided by small
    // random differences, so expert load is roughly balanced.
    fill(b->p.gate, (size_t)E * D, 0.1f / sqrtf((float)D));
    fill(b->x, nx, 1.0f), fill(b->dy, nx, 1.0f);
    return 0;
}

static void teardown(bench_layer *b) {
    moe_layer_acts_free(&b->a);
    void *bufs[] = {b->flat, b->gflat, b->x, b->y, b->dy, b->dx};
    for (int i = 0; i < 6; i++)
        moe_ops_cpu.free(bufs[i]);
}

static int forward(bench_layer *b) {
    return moe_layer_forward(b->y, b->x, NULL, NULL, b->cfg.T_max, &b->p, &b->a, true, 0);
}

static int backward(bench_layer *b) {
    float aux = (float)b->cfg.router.aux_loss_coef, z = (float)b->cfg.router.z_loss_coef;
    return moe_layer_backward(b->dx, &b->g, b->dy, b->x, NULL, b->cfg.T_max, &b->p, &b->a, aux, z);
}

static double routing_s(const moe_layer_timing *t) {
    return t->gate + t->router + t->permute + t->unpermute;
}

static const char *machine = "";

static int run_shape(int T, int D, int H, int E, int k, int reps) {
    bench_layer b;
    int rc = setup(&b, T, D, H, E, k);
    if (rc < 0) {
        teardown(&b);
        return rc;
    }
    MOE_TRY(forward(&b)); // warm-up: page in every buffer, OpenBLAS threads up
    MOE_TRY(backward(&b));
    double layer_s = now_s();
    MOE_TRY(forward(&b));
    MOE_TRY(backward(&b));
    layer_s = now_s() - layer_s;
    const int rows = b.a.plan.offsets[E];
    const double fwd_flop = 2.0 * T * D * E + 6.0 * rows * D * H;
    const int M = (rows + E - 1) / E;
    sgemm_ref ref, dense;
    MOE_TRY(sgemm_ref_init(&ref, M, 2 * H, D, reps, 0.5 * layer_s));
    MOE_TRY(sgemm_ref_init(&dense, rows, 2 * H, D, reps, 0.5 * layer_s));
    const int threads = moe_cpu_threads();
    const long ncpu = sysconf(_SC_NPROCESSORS_ONLN);

    static const char *cases[3] = {"forward", "backward", "fwd+bwd"};
    double *ms = malloc(sizeof(double) * reps), *share = malloc(sizeof(double) * reps);
    struct {
        double ms, med, share, others;
        moe_layer_timing tm;
    } res[3];
    for (int c = 0; c < 3; c++) {
        moe_layer_timing best_tm = {0};
        int best = 0;
        double wall0 = now_s(), busy0 = machine_busy_s(), own0 = process_cpu_s();
        for (int q = 0; q < reps; q++) {
            if (c == 1) MOE_TRY(forward(&b)); // backward needs its forward, untimed
            memset(&b.tm, 0, sizeof b.tm);
            b.a.timing = &b.tm;
            double t0 = now_s();
            if (c != 1) MOE_TRY(forward(&b));
            if (c != 0) MOE_TRY(backward(&b));
            double dt = now_s() - t0;
            b.a.timing = NULL;
            ms[q] = 1e3 * dt;
            share[q] = routing_s(&b.tm) / dt;
            if (ms[q] <= ms[best]) best = q, best_tm = b.tm;
            sgemm_ref_batch(&ref);
            sgemm_ref_batch(&dense);
        }
        double busy1 = machine_busy_s();
        double others = busy0 < 0 || busy1 < 0
                            ? -1
                            : (busy1 - busy0 - (process_cpu_s() - own0)) / (now_s() - wall0) / ncpu;
        res[c].ms = ms[best], res[c].share = share[best], res[c].tm = best_tm;
        res[c].med = median(ms, reps), res[c].others = others;
    }
    // Printed after all cases so that every line uses the same (final) reference.
    for (int c = 0; c < 3; c++) {
        const moe_layer_timing *tm = &res[c].tm;
        double flop = fwd_flop * (c == 0 ? 1 : c == 1 ? 2 : 3);
        double gf = flop / (res[c].ms * 1e-3) * 1e-9;
        printf("{\"bench\":\"moe_layer\",\"case\":\"%s\",\"shape\":{\"T\":%d,\"D\":%d,\"H\":%d,"
               "\"E\":%d,\"k\":%d},\"capacity_factor\":1.25,\"rows\":%d,\"ms\":%.2f,"
               "\"ms_median\":%.2f,\"gflops\":%.1f,\"sgemm_gflops\":%.1f,\"sgemm_shape\":{"
               "\"M\":%d,\"N\":%d,\"K\":%d},\"ratio_to_sgemm\":%.3f,"
               "\"sgemm_dense_gflops\":%.1f,\"ratio_to_dense_sgemm\":%.3f,"
               "\"routing_share\":%.4f,\"phases_ms\":{\"gate\":%.2f,\"router\":%.2f,"
               "\"permute\":%.2f,\"experts\":%.2f,\"unpermute\":%.2f},\"stat\":\"best\","
               "\"reps\":%d,\"threads\":%d,\"others_load\":%.2f,\"machine\":\"%s\"}\n",
               cases[c], T, D, H, E, k, rows, res[c].ms, res[c].med, gf, ref.best, M, 2 * H, D,
               gf / ref.best, dense.best, gf / dense.best, res[c].share, 1e3 * tm->gate,
               1e3 * tm->router, 1e3 * tm->permute, 1e3 * tm->experts, 1e3 * tm->unpermute, reps,
               threads, res[c].others, machine);
        fflush(stdout);
    }
    sgemm_ref_free(&ref);
    sgemm_ref_free(&dense);
    free(share);
    free(ms);
    teardown(&b);
    return 0;
}

int main(int argc, char **argv) {
    int reps = 7, only_E = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            reps = 2;
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc)
            only_E = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--machine") && i + 1 < argc)
            machine = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--quick] [--reps N] [--shape E] [--machine NAME]\n",
                    argv[0]);
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    // T, D, H, E, k: Mixtral-like, many experts, DeepSeek-style fine-grained experts.
    static const int shapes[][5] = {
        {4096, 512, 1024, 8, 2}, {4096, 512, 1024, 64, 2}, {4096, 512, 256, 128, 8}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int *d = shapes[s];
        if (only_E && d[3] != only_E) continue;
        int rc = run_shape(d[0], d[1], d[2], d[3], d[4], reps);
        if (rc < 0) {
            fprintf(stderr, "moe_layer bench: %s\n", moe_last_error());
            return 1;
        }
    }
    return 0;
}
