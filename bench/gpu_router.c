// GPU router benchmark (DESIGN "Performance targets": router kernels >= 50% of
// memory bandwidth): moe_cuda_router_forward on random logits, one JSON line
// per case with the achieved GB/s and its ratio to the device's peak DRAM
// bandwidth (memory clock x bus width). Bytes count the minimal traffic of
// the outputs the plan needs: logits read, probs written ([T, E] floats
// each), lse [T], choice, expert, slot and weight ([T, k] of 4 bytes each).
// Best of --reps after one warm-up; the time includes the call's one
// read-back (error flag and loss sums).
//
// usage: gpu_router [--reps N]
// Without a CUDA build or a GPU it prints why (as JSON) and exits 0.
#include "moe/error.h"
#include "moe/router.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/router_cuda.h"
#include "kernels/ops.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int run(int T, int E, int k, moe_slot_order order, int reps, double peak) {
    moe_router_config cfg;
    moe_router_config_default(&cfg);
    cfg.top_k = k;
    cfg.slot_order = order;
    float *h = malloc(sizeof(float) * (size_t)T * E);
    if (!h) return moe_fail(MOE_ENOMEM, "logits");
    uint64_t s = 88172645463325252ull;
    for (size_t i = 0; i < (size_t)T * E; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        h[i] = (float)((s >> 40) * (1.0 / 16777216.0) * 4.0 - 2.0);
    }
    float *d = moe_ops_cuda.alloc(sizeof(float) * (size_t)T * E);
    if (!d) return MOE_ENOMEM;
    MOE_TRY(moe_cuda_upload(d, h, sizeof(float) * (size_t)T * E));
    free(h);
    moe_cuda_plan plan;
    MOE_TRY(moe_cuda_plan_alloc(&plan, T, E, k));
    double best = 1e30;
    for (int rep = -1; rep < reps; rep++) {
        MOE_TRY(moe_cuda_synchronize());
        double t0 = now_s();
        MOE_TRY(moe_cuda_router_forward(&plan, d, NULL, NULL, T, E, &cfg, false, 0));
        double t = now_s() - t0; // the call ends with a synchronising read-back
        if (rep >= 0 && t < best) best = t;
    }
    double bytes = 2.0 * T * E * 4 + 4.0 * T + 4.0 * 4 * T * k;
    double gbps = bytes / best / 1e9;
    printf("{\"bench\":\"gpu_router\",\"T\":%d,\"E\":%d,\"k\":%d,\"slot_order\":\"%s\","
           "\"ms\":%.4f,\"gbps\":%.1f,\"peak_gbps\":%.1f,\"ratio_to_peak\":%.3f}\n",
           T, E, k, order == MOE_SLOT_PRIORITY ? "priority" : "position", best * 1e3, gbps, peak,
           peak > 0 ? gbps / peak : 0.0);
    moe_cuda_plan_free(&plan);
    moe_ops_cuda.free(d);
    return 0;
}
#endif

int main(int argc, char **argv) {
    int reps = 10;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: gpu_router [--reps N]\n");
            return 2;
        }
    }
#ifndef MOE_HAVE_CUDA
    (void)reps;
    printf("{\"bench\":\"gpu_router\",\"skipped\":\"built without CUDA\"}\n");
    return 0;
#else
    char why[256] = "";
    if (moe_cuda_device_count(why, sizeof why) == 0) {
        printf("{\"bench\":\"gpu_router\",\"skipped\":\"no CUDA device: %s\"}\n", why);
        return 0;
    }
    double peak = 0;
    if (moe_cuda_device_info(NULL, 0, NULL, &peak) < 0) {
        fprintf(stderr, "gpu_router: %s\n", moe_last_error());
        return 1;
    }
    const int cases[][3] = {{16384, 8, 2}, {262144, 8, 2}, {262144, 64, 2}, {262144, 128, 8}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        for (int o = 0; o < 2; o++)
            if (run(cases[i][0], cases[i][1], cases[i][2],
                    o ? MOE_SLOT_PRIORITY : MOE_SLOT_POSITION, reps, peak) < 0) {
                fprintf(stderr, "gpu_router: %s\n", moe_last_error());
                return 1;
            }
    moe_cuda_shutdown();
    return 0;
#endif
}
