// LM-head loss on the GPU: plain cross-entropy (logits and their gradient
// [N, V] materialised, cuBLAS fp32 GEMMs + kernels/cuda/crossentropy.cu) vs
// cut cross-entropy (kernels/cuda/cce.cu), forward + backward in fp32. One
// JSON line per vocabulary: the loss layer's bytes (the buffers each
// allocates, and the drop in cudaMemGetInfo's free memory while they exist),
// the best time of --reps after a warm-up, loss_bytes_ratio (cce / plain),
// speedup (plain time / cce time) and the largest relative differences of the
// loss and of dh, dW (max |a - b| / max |b|).
//   gpu_cce [--tokens 8192] [--dim 4096] [--vocab 32000,128000] [--reps 3] [--no-filter]
// Without a CUDA build or a GPU it prints why (as JSON) and exits 0.
#include "moe/error.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef MOE_HAVE_CUDA
#include "gpu_fill.h"
#include "kernels/cuda/cce_cuda.h"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/ops_cuda.h"

#include <cuda_runtime_api.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define CHECK(x)                                                                                   \
    do {                                                                                           \
        if ((x) < 0) {                                                                             \
            fprintf(stderr, "gpu_cce: %s:%d: %s\n", __FILE__, __LINE__, moe_last_error());         \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static void *dalloc(size_t bytes) {
    void *p = moe_cuda_alloc(bytes);
    if (!p) CHECK(-1);
    return p;
}

static size_t free_bytes(void) {
    size_t f = 0, t = 0;
    CHECK(moe_cuda_synchronize());
    cudaMemGetInfo(&f, &t);
    return f;
}

static double max_rel(const float *a, const float *b, size_t n) {
    double worst = 0, scale = 0;
    for (size_t i = 0; i < n; i++) {
        scale = fmax(scale, fabs(b[i]));
        worst = fmax(worst, fabs((double)a[i] - b[i]));
    }
    return scale > 0 ? worst / scale : worst;
}

typedef struct {
    double loss, fwd_ms, bwd_ms;
    size_t bytes, measured; // the loss layer's buffers; the drop in free memory
    long skipped;
} timing;

// The model's plain path (trainer/model.c): logits = h W^T, CE forward, then
// dlogits, dW += dlogits^T h, dh = dlogits W.
static timing plain(float *dh, float *dW, const float *h, const float *W, const int32_t *tg, int N,
                    int D, int V, int reps) {
    timing t = {0, 1e30, 1e30, 0, 0, 0};
    const size_t before = free_bytes();
    float *logits = dalloc((size_t)N * V * sizeof(float));
    float *dlogits = dalloc((size_t)N * V * sizeof(float));
    float *losses = dalloc((size_t)N * sizeof(float));
    t.bytes = 2 * moe_cuda_alloc_size((size_t)N * V * sizeof(float)) +
              moe_cuda_alloc_size((size_t)N * sizeof(float));
    t.measured = before - free_bytes();
    for (int r = 0; r <= reps; r++) { // r = 0: warm-up
        CHECK(moe_cuda_zero(dh, (size_t)N * D));
        CHECK(moe_cuda_zero(dW, (size_t)V * D));
        CHECK(moe_cuda_synchronize());
        double t0 = now_s();
        CHECK(moe_cuda_matmul(logits, h, W, N, V, D, false, true, 1.0f, 0.0f));
        CHECK(moe_cuda_crossentropy_forward(losses, &t.loss, logits, tg, N, V));
        CHECK(moe_cuda_synchronize());
        double t1 = now_s();
        CHECK(moe_cuda_zero(dlogits, (size_t)N * V));
        CHECK(moe_cuda_crossentropy_backward(dlogits, logits, tg, N, V, 1.0f));
        CHECK(moe_cuda_matmul(dW, dlogits, h, V, D, N, true, false, 1.0f, 1.0f));
        CHECK(moe_cuda_matmul(dh, dlogits, W, N, D, V, false, false, 1.0f, 0.0f));
        CHECK(moe_cuda_synchronize());
        double t2 = now_s();
        if (r && 1e3 * (t1 - t0) + 1e3 * (t2 - t1) < t.fwd_ms + t.bwd_ms)
            t.fwd_ms = 1e3 * (t1 - t0), t.bwd_ms = 1e3 * (t2 - t1);
    }
    moe_cuda_free(logits), moe_cuda_free(dlogits), moe_cuda_free(losses);
    return t;
}

static timing cce(float *dh, float *dW, const float *h, const float *W, const int32_t *tg, int N,
                  int D, int V, float eps, int reps) {
    timing t = {0, 1e30, 1e30, 0, 0, 0};
    const size_t ns = moe_cuda_cce_scratch_floats(N, V), before = free_bytes();
    float *scratch = dalloc(ns * sizeof(float));
    float *lse = dalloc((size_t)N * sizeof(float)), *losses = dalloc((size_t)N * sizeof(float));
    t.bytes = moe_cuda_alloc_size(ns * sizeof(float)) +
              2 * moe_cuda_alloc_size((size_t)N * sizeof(float));
    t.measured = before - free_bytes();
    for (int r = 0; r <= reps; r++) {
        CHECK(moe_cuda_zero(dh, (size_t)N * D));
        CHECK(moe_cuda_zero(dW, (size_t)V * D));
        CHECK(moe_cuda_synchronize());
        double t0 = now_s();
        CHECK(moe_cuda_cce_forward(losses, lse, &t.loss, h, W, tg, N, D, V, scratch));
        CHECK(moe_cuda_synchronize());
        double t1 = now_s();
        t.skipped = 0;
        CHECK(
            moe_cuda_cce_backward(dh, dW, h, W, tg, lse, N, D, V, 1.0f, eps, scratch, &t.skipped));
        CHECK(moe_cuda_synchronize());
        double t2 = now_s();
        if (r && 1e3 * (t1 - t0) + 1e3 * (t2 - t1) < t.fwd_ms + t.bwd_ms)
            t.fwd_ms = 1e3 * (t1 - t0), t.bwd_ms = 1e3 * (t2 - t1);
    }
    moe_cuda_free(scratch), moe_cuda_free(lse), moe_cuda_free(losses);
    return t;
}

static void run(const char *device, int N, int D, int V, float eps, int reps) {
    float *h = dalloc((size_t)N * D * sizeof(float)), *W = dalloc((size_t)V * D * sizeof(float));
    float *dh[2] = {dalloc((size_t)N * D * sizeof(float)), dalloc((size_t)N * D * sizeof(float))};
    float *dW[2] = {dalloc((size_t)V * D * sizeof(float)), dalloc((size_t)V * D * sizeof(float))};
    int32_t *tg = dalloc((size_t)N * sizeof(int32_t)), *host_tg = malloc(N * sizeof(int32_t));
    CHECK(bench_fill_device(h, (size_t)N * D, 1.0f, 1));
    CHECK(bench_fill_device(W, (size_t)V * D, 0.02f, 2));
    for (int n = 0; n < N; n++)
        host_tg[n] = (int32_t)((n * 7919u) % V);
    CHECK(moe_cuda_upload(tg, host_tg, N * sizeof(int32_t)));
    timing p = plain(dh[0], dW[0], h, W, tg, N, D, V, reps);
    timing c = cce(dh[1], dW[1], h, W, tg, N, D, V, eps, reps);
    const size_t rows = (size_t)(N > V ? N : V); // the larger of dh [N, D] and dW [V, D]
    float *a = malloc(rows * D * sizeof(float)), *b = malloc(rows * D * sizeof(float));
    if (!a || !b) {
        fprintf(stderr, "gpu_cce: host memory for two [%zu, %d] gradients\n", rows, D);
        exit(1);
    }
    CHECK(moe_cuda_download(a, dh[1], (size_t)N * D * sizeof(float)));
    CHECK(moe_cuda_download(b, dh[0], (size_t)N * D * sizeof(float)));
    const double e_dh = max_rel(a, b, (size_t)N * D);
    CHECK(moe_cuda_download(a, dW[1], (size_t)V * D * sizeof(float)));
    CHECK(moe_cuda_download(b, dW[0], (size_t)V * D * sizeof(float)));
    const double e_dw = max_rel(a, b, (size_t)V * D);
    const double plain_ms = p.fwd_ms + p.bwd_ms, cce_ms = c.fwd_ms + c.bwd_ms;
    printf("{\"bench\":\"gpu_cce\",\"device\":\"%s\",\"tokens\":%d,\"dim\":%d,\"vocab\":%d,"
           "\"filter\":%s,\"reps\":%d,\"plain_fwd_ms\":%.2f,\"plain_bwd_ms\":%.2f,"
           "\"cce_fwd_ms\":%.2f,\"cce_bwd_ms\":%.2f,\"speedup\":%.3f,"
           "\"plain_loss_bytes\":%zu,\"cce_loss_bytes\":%zu,\"plain_measured_bytes\":%zu,"
           "\"cce_measured_bytes\":%zu,\"loss_bytes_ratio\":%.5f,\"plain_loss\":%.7f,"
           "\"cce_loss\":%.7f,\"max_rel_loss_diff\":%.3g,\"max_rel_dh_diff\":%.3g,"
           "\"max_rel_dw_diff\":%.3g,\"skipped_tiles\":%ld}\n",
           device, N, D, V, eps > 0 ? "true" : "false", reps, p.fwd_ms, p.bwd_ms, c.fwd_ms,
           c.bwd_ms, plain_ms / cce_ms, p.bytes, c.bytes, p.measured, c.measured,
           (double)c.bytes / (double)p.bytes, p.loss, c.loss, fabs(c.loss - p.loss) / fabs(p.loss),
           e_dh, e_dw, c.skipped);
    fflush(stdout);
    free(a), free(b), free(host_tg);
    moe_cuda_free(h), moe_cuda_free(W), moe_cuda_free(tg);
    for (int i = 0; i < 2; i++)
        moe_cuda_free(dh[i]), moe_cuda_free(dW[i]);
}

int main(int argc, char **argv) {
    int N = 8192, D = 4096, reps = 3, n_vocab = 2;
    int vocab[16] = {32000, 128000};
    float eps = FLT_EPSILON; // loss.cce_filter's default
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            N = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--dim") && i + 1 < argc)
            D = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--no-filter"))
            eps = 0.0f;
        else if (!strcmp(argv[i], "--vocab") && i + 1 < argc) {
            n_vocab = 0;
            for (char *s = strtok(argv[++i], ","); s && n_vocab < 16; s = strtok(NULL, ","))
                vocab[n_vocab++] = atoi(s);
        } else {
            fprintf(stderr, "usage: gpu_cce [--tokens N] [--dim D] [--vocab V1,V2,...] "
                            "[--reps R] [--no-filter]\n");
            return 2;
        }
    }
    for (int i = 0; i < n_vocab; i++)
        if (N < 1 || D < 1 || reps < 1 || vocab[i] < 1) {
            fprintf(stderr, "gpu_cce: sizes and --reps must be positive\n");
            return 2;
        }
    char why[256] = "", name[256] = "";
    if (moe_cuda_device_count(why, sizeof why) == 0) {
        printf("{\"bench\":\"gpu_cce\",\"skipped\":\"no CUDA device: %s\"}\n", why);
        return 0;
    }
    CHECK(moe_cuda_init(0));
    CHECK(moe_cuda_device_info(name, sizeof name, NULL, NULL));
    for (int i = 0; i < n_vocab; i++)
        run(name, N, D, vocab[i], eps, reps);
    moe_cuda_shutdown();
    return 0;
}

#else

int main(void) {
    printf("{\"bench\":\"gpu_cce\",\"skipped\":\"built without CUDA\"}\n");
    return 0;
}

#endif
