// GPU MoE layer benchmark (DESIGN "Performance targets"): forward+backward of
// the layer on the CUDA op table (grouped expert GEMMs, CUDA router) in bf16
// tensor-core GEMMs (fp32 storage and accumulation) or fp32, one JSON object
// per line with effective TFLOP/s and the ratio to cuBLAS dense GEMMs of the
// same shapes measured in the same run (target >= 0.7).
//
// Effective FLOPs as bench/moe_layer.c: forward = 2 T D E (gate) + 6 rows D H
// (three expert projections over the kept assignments), backward = 2 x
// forward. The dense reference runs [rows, D] @ [D, 2H] and [rows, H] @
// [H, D] (the forward's expert GEMMs without segments) on the same buffers.
// Times are the best of --reps repetitions after one warm-up.
//
// usage: gpu_moe_layer [--quick] [--fp32] [--reps N] [--shape T,D,H,E,k] [--capacity F]
// --shape: e.g. 16384,4096,1408,64,6 (fine-grained experts); --capacity:
// router.capacity_factor (default 1.25; 0: dropless, as bench/torch_moe_layer.py).
// Without a CUDA build or a GPU it prints why (as JSON) and exits 0.
#include "moe/error.h"
#include "moe/moe_layer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef MOE_HAVE_CUDA
#include "gpu_fill.h"
#include "kernels/cuda/cuda.h"
#include "moe/moe_layer_cuda.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int run(int T, int D, int H, int E, int k, double capacity, const moe_ops *ops, int reps) {
    moe_layer_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.T_max = T, cfg.D = D, cfg.H = H, cfg.E = E;
    moe_router_config_default(&cfg.router);
    cfg.router.top_k = k;
    cfg.router.capacity_factor = capacity;
    size_t np = moe_layer_num_params(&cfg);
    float *par = ops->alloc(np * 4), *grad = ops->alloc(np * 4);
    float *x = ops->alloc((size_t)T * D * 4), *y = ops->alloc((size_t)T * D * 4);
    float *dy = ops->alloc((size_t)T * D * 4), *dx = ops->alloc((size_t)T * D * 4);
    if (!par || !grad || !x || !y || !dy || !dx) return MOE_ENOMEM;
    moe_layer_params p, g;
    MOE_TRY(moe_layer_params_view(&p, par, &cfg));
    MOE_TRY(moe_layer_params_view(&g, grad, &cfg));
    MOE_TRY(bench_fill_device(par, np, 1.0f / 64, 1));
    MOE_TRY(bench_fill_device(p.gate, (size_t)E * D, 1.0f, 2));
    MOE_TRY(bench_fill_device(x, (size_t)T * D, 1.0f, 3));
    MOE_TRY(bench_fill_device(dy, (size_t)T * D, 1.0f, 4));
    moe_layer_cuda_acts a;
    MOE_TRY(moe_layer_cuda_acts_alloc(&a, &cfg, ops));

    double best = 1e30, best_dense = 1e30;
    int rows = 0;
    for (int rep = -1; rep < reps; rep++) { // rep -1: warm-up
        MOE_TRY(moe_cuda_synchronize());
        double t0 = now_s();
        MOE_TRY(moe_layer_cuda_forward(y, x, NULL, NULL, T, &p, &a, false, 0));
        MOE_TRY(ops->zero(dx, (size_t)T * D));
        MOE_TRY(moe_layer_cuda_backward(dx, &g, dy, x, NULL, T, &p, &a, 0.01f, 0.0f));
        MOE_TRY(moe_cuda_synchronize());
        double t = now_s() - t0;
        if (rep >= 0 && t < best) best = t;
        rows = a.offsets_h[E];
        // dense reference on the layer's own buffers and expert 0's weights
        t0 = now_s();
        MOE_TRY(
            ops->matmul(a.ab, a.xe, moe_layer_w13(&p, 0), rows, 2 * H, D, false, true, 1.0f, 0.0f));
        MOE_TRY(ops->matmul(a.ye, a.h, moe_layer_w2(&p, 0), rows, D, H, false, true, 1.0f, 0.0f));
        MOE_TRY(moe_cuda_synchronize());
        t = now_s() - t0;
        if (rep >= 0 && t < best_dense) best_dense = t;
    }
    double fwd = 2.0 * T * D * E + 6.0 * rows * (double)D * H;
    double tflops = 3.0 * fwd / best / 1e12;
    double dense_tflops = 6.0 * rows * (double)D * H / best_dense / 1e12;
    char name[256] = "";
    moe_cuda_device_info(name, sizeof name, NULL, NULL);
    printf(
        "{\"bench\":\"gpu_moe_layer\",\"device\":\"%s\",\"dtype\":\"%s\",\"T\":%d,\"D\":%d,"
        "\"H\":%d,\"E\":%d,\"k\":%d,\"capacity_factor\":%g,\"rows\":%d,\"ms\":%.3f,\"tflops\":%.2f,"
        "\"dense_tflops\":%.2f,\"ratio_to_dense\":%.3f,\"aux_loss\":%.4f,"
        "\"grouped_fallbacks\":%ld}\n",
        name, ops == &moe_ops_cuda ? "fp32" : "bf16", T, D, H, E, k, capacity, rows, best * 1e3,
        tflops, dense_tflops, tflops / dense_tflops, a.plan.aux_loss, moe_cuda_grouped_fallbacks());
    moe_layer_cuda_acts_free(&a);
    ops->free(par), ops->free(grad), ops->free(x), ops->free(y), ops->free(dy), ops->free(dx);
    return 0;
}
#endif

int main(int argc, char **argv) {
    int quick = 0, fp32 = 0, reps = 5, shape[5] = {16384, 4096, 14336, 8, 2};
    double capacity = 1.25;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
            if (sscanf(argv[++i], "%d,%d,%d,%d,%d", &shape[0], &shape[1], &shape[2], &shape[3],
                       &shape[4]) != 5 ||
                shape[0] < 1 || shape[1] < 1 || shape[2] < 1 || shape[3] < 1 || shape[4] < 1 ||
                shape[4] > shape[3]) {
                fprintf(stderr, "gpu_moe_layer: --shape %s: expected T,D,H,E,k (k <= E)\n",
                        argv[i]);
                return 2;
            }
        } else if (!strcmp(argv[i], "--capacity") && i + 1 < argc) {
            char *end;
            capacity = strtod(argv[++i], &end);
            if (*end || capacity < 0) {
                fprintf(stderr, "gpu_moe_layer: --capacity %s: expected a factor >= 0\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(argv[i], "--fp32"))
            fp32 = 1;
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: gpu_moe_layer [--quick] [--fp32] [--reps N] [--shape "
                            "T,D,H,E,k] [--capacity F]\n");
            return 2;
        }
    }
#ifndef MOE_HAVE_CUDA
    (void)quick, (void)fp32, (void)reps, (void)capacity, (void)shape;
    printf("{\"bench\":\"gpu_moe_layer\",\"skipped\":\"built without CUDA\"}\n");
    return 0;
#else
    char why[256] = "";
    if (moe_cuda_device_count(why, sizeof why) == 0) {
        printf("{\"bench\":\"gpu_moe_layer\",\"skipped\":\"no CUDA device: %s\"}\n", why);
        return 0;
    }
    const moe_ops *ops = fp32 ? &moe_ops_cuda : &moe_ops_cuda_bf16;
    int rc = quick ? run(2048, 1024, 2048, 8, 2, capacity, ops, reps)
                   : run(shape[0], shape[1], shape[2], shape[3], shape[4], capacity, ops, reps);
    if (rc < 0) {
        fprintf(stderr, "gpu_moe_layer: %s\n", moe_last_error());
        return 1;
    }
    moe_cuda_shutdown();
    return 0;
#endif
}
