// LM-head loss at GPT-2 vocabulary (V = 50257): plain (logits [N, V] and
// their gradient materialised) vs cut cross-entropy (one tile), forward and
// backward. Prints memory of the loss layer (bytes its buffers take) and time,
// one JSON line per implementation, and the largest gradient difference.
//   build/bench/cce [--tokens N] [--dim D]
#include "kernels/cpu/nn.h"

#include <cblas.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static uint64_t rng = 88172645463325252ull;
static float randn(void) {
    double u1, u2;
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    u1 = ((rng >> 11) + 1.0) / 9007199254740993.0;
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    u2 = (rng >> 11) / 9007199254740992.0;
    return (float)(sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2));
}

int main(int argc, char **argv) {
    int N = 1024, D = 768;
    const int V = 50257;
    for (int i = 1; i + 1 < argc; i++) {
        if (!strcmp(argv[i], "--tokens"))
            N = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--dim"))
            D = atoi(argv[++i]);
    }
    float *h = malloc(sizeof(float) * N * D), *W = malloc(sizeof(float) * V * D);
    int32_t *tg = malloc(sizeof(int32_t) * N);
    for (size_t i = 0; i < (size_t)N * D; i++)
        h[i] = randn();
    for (size_t i = 0; i < (size_t)V * D; i++)
        W[i] = 0.02f * randn();
    for (int n = 0; n < N; n++)
        tg[n] = (int32_t)((n * 7919u) % V);
    float *losses = malloc(sizeof(float) * N), *lse = malloc(sizeof(float) * N);
    float *dh0 = calloc((size_t)N * D, 4), *dW0 = calloc((size_t)V * D, 4);
    float *dh1 = calloc((size_t)N * D, 4), *dW1 = calloc((size_t)V * D, 4);
    double loss0, loss1;

    // plain: logits and dlogits [N, V]
    size_t plain_bytes = 2 * (size_t)N * V * sizeof(float);
    float *logits = malloc(plain_bytes / 2), *dlogits = calloc((size_t)N * V, 4);
    double t0 = now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, V, D, 1, h, D, W, D, 0, logits, V);
    moe_cpu_crossentropy_forward(losses, &loss0, logits, tg, N, V);
    double t1 = now();
    moe_cpu_crossentropy_backward(dlogits, logits, tg, N, V, 1.0f);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, D, V, 1, dlogits, V, W, D, 0, dh0, D);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, D, N, 1, dlogits, V, h, D, 0, dW0, D);
    double t2 = now();
    free(logits);
    free(dlogits);
    printf("{\"bench\":\"lm_loss\",\"impl\":\"plain\",\"tokens\":%d,\"dim\":%d,\"vocab\":%d,"
           "\"loss_layer_bytes\":%zu,\"fwd_ms\":%.1f,\"bwd_ms\":%.1f,\"loss\":%.6f}\n",
           N, D, V, plain_bytes, 1e3 * (t1 - t0), 1e3 * (t2 - t1), loss0);

    // cce: one tile of scratch and the saved lse
    size_t cce_bytes = (moe_cpu_cce_scratch_floats() + (size_t)N) * sizeof(float);
    float *scratch = malloc(moe_cpu_cce_scratch_floats() * sizeof(float));
    long skipped = 0;
    t0 = now();
    moe_cpu_cce_forward(losses, lse, &loss1, h, W, tg, N, D, V, scratch);
    t1 = now();
    moe_cpu_cce_backward(dh1, dW1, h, W, tg, lse, N, D, V, 1.0f, FLT_EPSILON, scratch, &skipped);
    t2 = now();
    double worst = 0, scale = 0;
    for (size_t i = 0; i < (size_t)V * D; i++) {
        scale = fmax(scale, fabs(dW0[i]));
        worst = fmax(worst, fabs((double)dW0[i] - dW1[i]));
    }
    for (size_t i = 0; i < (size_t)N * D; i++) {
        scale = fmax(scale, fabs(dh0[i]));
        worst = fmax(worst, fabs((double)dh0[i] - dh1[i]));
    }
    long tiles = (long)((N + MOE_CCE_NB - 1) / MOE_CCE_NB) * ((V + MOE_CCE_VB - 1) / MOE_CCE_VB);
    printf("{\"bench\":\"lm_loss\",\"impl\":\"cce\",\"tokens\":%d,\"dim\":%d,\"vocab\":%d,"
           "\"loss_layer_bytes\":%zu,\"fwd_ms\":%.1f,\"bwd_ms\":%.1f,\"loss\":%.6f,"
           "\"tiles_skipped\":%ld,\"tiles\":%ld,\"loss_rel_diff\":%.2e,\"grad_rel_diff\":%.2e,"
           "\"memory_ratio\":%.5f}\n",
           N, D, V, cce_bytes, 1e3 * (t1 - t0), 1e3 * (t2 - t1), loss1, skipped, tiles,
           fabs(loss1 - loss0) / loss0, worst / scale, (double)cce_bytes / plain_bytes);
    return 0;
}
