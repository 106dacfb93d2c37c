// CPU attention benchmark: the blocked causal GQA kernel (kernels/cpu/
// attention.c) forward and backward at long sequence lengths, against the
// sgemm rate of the same run. One JSON line per (seq_len, pass).
//
// FLOPs are the model's: forward 2 GEMMs of 2*T*T*hd per query head, halved
// by the causal mask (2*T^2*hd per head); backward 2 x forward (its score
// recomputation is not counted). The sgemm reference is moe_cpu_sgemm (the
// backend's own GEMM, same threads) on a square [1024 x 1024 x 1024] product,
// timed in batches interleaved with the attention repetitions; times and rates
// are medians. gemm_ratio = sgemm rate / attention rate (goal: at most 2).
//
// usage: attention [--seq T]... [--reps N] [--machine NAME]
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/nn.h"
#include "moe/error.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

static void fill(float *x, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = (float)((seed >> 8) * (1.0 / 16777216.0) - 0.5);
    }
}

enum { GEMM_N = 1024, MAX_REPS = 64 };

static double sgemm_seconds(const float *a, const float *b, float *c) {
    double t0 = now_s();
    moe_cpu_sgemm(false, true, GEMM_N, GEMM_N, GEMM_N, 1.0f, a, GEMM_N, b, GEMM_N, 0.0f, c, GEMM_N);
    return now_s() - t0;
}

int main(int argc, char **argv) {
    int seqs[8], n_seq = 0, reps = 5;
    const char *machine = "";
    const int B = 1, Hq = 8, Hkv = 2, hd = 64;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--seq") && i + 1 < argc && n_seq < 8)
            seqs[n_seq++] = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--machine") && i + 1 < argc)
            machine = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--seq T]... [--reps N] [--machine NAME]\n", argv[0]);
            return 2;
        }
    }
    if (!n_seq) seqs[n_seq++] = 1024, seqs[n_seq++] = 4096;
    if (reps < 1 || reps > MAX_REPS) reps = 5;
    float *ga = malloc(sizeof(float) * GEMM_N * GEMM_N),
          *gb = malloc(sizeof(float) * GEMM_N * GEMM_N);
    float *gc = malloc(sizeof(float) * GEMM_N * GEMM_N);
    if (!ga || !gb || !gc) return 1;
    fill(ga, (size_t)GEMM_N * GEMM_N, 1), fill(gb, (size_t)GEMM_N * GEMM_N, 2);
    sgemm_seconds(ga, gb, gc); // warm-up, starts the pool
    for (int si = 0; si < n_seq; si++) {
        const int T = seqs[si];
        const size_t nq = (size_t)B * T * Hq * hd, nk = (size_t)B * T * Hkv * hd;
        float *q = malloc(sizeof(float) * nq), *k = malloc(sizeof(float) * nk);
        float *v = malloc(sizeof(float) * nk), *out = malloc(sizeof(float) * nq);
        float *dout = malloc(sizeof(float) * nq), *dq = calloc(nq, sizeof(float));
        float *dk = calloc(nk, sizeof(float)), *dv = calloc(nk, sizeof(float));
        float *lse = malloc(sizeof(float) * B * Hq * T); // all the CPU kernel keeps of att
        float *sc = malloc(sizeof(float) * moe_cpu_attention_scratch_floats(B, T, Hq, Hkv, hd));
        if (!q || !k || !v || !out || !dout || !dq || !dk || !dv || !lse || !sc) return 1;
        fill(q, nq, 3), fill(k, nk, 4), fill(v, nk, 5), fill(dout, nq, 6);
        double tf[MAX_REPS], tb[MAX_REPS], tg[MAX_REPS];
        for (int r = -1; r < reps; r++) { // r = -1: warm-up
            double t0 = now_s();
            if (moe_cpu_attention_forward(out, lse, sc, q, k, v, B, T, Hq, Hkv, hd)) goto fail;
            double t1 = now_s();
            if (moe_cpu_attention_backward(dq, dk, dv, sc, dout, out, lse, q, k, v, B, T, Hq, Hkv,
                                           hd))
                goto fail;
            double t2 = now_s(), g = sgemm_seconds(ga, gb, gc);
            if (r >= 0) tf[r] = t1 - t0, tb[r] = t2 - t1, tg[r] = g;
        }
        const double flops_f = 2.0 * T * (double)T * hd * Hq * B, flops_b = 2 * flops_f;
        const double gemm = 2.0 * GEMM_N * GEMM_N * GEMM_N / median(tg, reps);
        const double mf = median(tf, reps), mb = median(tb, reps);
        const char *pass[2] = {"forward", "backward"};
        const double t[2] = {mf, mb}, fl[2] = {flops_f, flops_b};
        for (int p = 0; p < 2; p++)
            printf("{\"bench\":\"attention\",\"machine\":\"%s\",\"pass\":\"%s\",\"B\":%d,\"T\":%d,"
                   "\"n_heads\":%d,\"n_kv_heads\":%d,\"head_dim\":%d,\"threads\":%d,\"reps\":%d,"
                   "\"ms\":%.2f,\"gflops\":%.1f,\"sgemm_gflops\":%.1f,\"gemm_ratio\":%.2f}\n",
                   machine, pass[p], B, T, Hq, Hkv, hd, moe_cpu_threads(), reps, 1e3 * t[p],
                   fl[p] / t[p] * 1e-9, gemm * 1e-9, gemm / (fl[p] / t[p]));
        fflush(stdout);
        free(q), free(k), free(v), free(out), free(dout), free(dq), free(dk), free(dv), free(lse);
        free(sc);
    }
    free(ga), free(gb), free(gc);
    return 0;
fail:
    fprintf(stderr, "attention bench: %s\n", moe_last_error());
    return 1;
}
