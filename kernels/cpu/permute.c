// Token <-> expert-contiguous row movement for the MoE layer (DESIGN "Data flow
// of one MoE layer"): dispatch indices from a plan, gather (permute), weighted
// combine (unpermute) and their backward passes, plus generic row gather/scatter.
// Token-major loops: each token writes only its own rows, so no two iterations
// touch the same output row (the CUDA twin needs no atomics).
#include "kernels/cpu/cpu.h"
#include "moe/error.h"

#include <string.h>

// o[0..n) += w * s[0..n)
static inline void axpy(float *restrict o, const float *restrict s, float w, int n) {
    for (int i = 0; i < n; i++)
        o[i] += w * s[i];
}

// Dot product with 16 independent partial sums (one vector's worth): a single
// accumulator would serialise on FP-add latency and cannot vectorise without
// reassociation (no -ffast-math here). Fixed order: deterministic.
static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++)
            acc[l] += a[i + l] * b[i + l];
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            acc[l] += acc[l + w];
    float s = acc[0];
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

int moe_cpu_dispatch_rows(int *row, const int *expert, const int *slot, const int *offsets, int T,
                          int k) {
    for (long i = 0; i < (long)T * k; i++)
        row[i] = expert[i] >= 0 ? offsets[expert[i]] + slot[i] : -1;
    return 0;
}

int moe_cpu_permute_forward(float *restrict xe, const float *restrict x, const int *row, int T,
                            int k, int D) {
    for (long t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int r = row[t * k + j];
            if (r >= 0) memcpy(xe + (size_t)r * D, x + t * D, (size_t)D * sizeof *x);
        }
    return 0;
}

int moe_cpu_permute_backward(float *restrict dx, const float *restrict dxe, const int *row, int T,
                             int k, int D) {
    for (long t = 0; t < T; t++) {
        float *d = dx + t * D;
        for (int j = 0; j < k; j++) {
            int r = row[t * k + j];
            if (r < 0) continue;
            axpy(d, dxe + (size_t)r * D, 1.0f, D);
        }
    }
    return 0;
}

int moe_cpu_unpermute_forward(float *restrict y, const float *restrict ye, const int *row,
                              const float *weight, int T, int k, int D) {
    for (long t = 0; t < T; t++) {
        float *o = y + t * D;
        memset(o, 0, (size_t)D * sizeof *o);
        for (int j = 0; j < k; j++) {
            int r = row[t * k + j];
            if (r < 0) continue;
            axpy(o, ye + (size_t)r * D, weight[t * k + j], D);
        }
    }
    return 0;
}

int moe_cpu_unpermute_backward(float *restrict dye, float *restrict dweight,
                               const float *restrict dy, const float *restrict ye, const int *row,
                               const float *weight, int T, int k, int D) {
    for (long t = 0; t < T; t++) {
        const float *g = dy + t * D;
        for (int j = 0; j < k; j++) {
            int r = row[t * k + j];
            if (r < 0) continue;
            axpy(dye + (size_t)r * D, g, weight[t * k + j], D);
            dweight[t * k + j] += dot(g, ye + (size_t)r * D, D);
        }
    }
    return 0;
}

int moe_cpu_gather_rows(float *restrict out, const float *restrict in, const int *idx, int n,
                        int D) {
    for (long i = 0; i < n; i++) {
        if (idx[i] >= 0)
            memcpy(out + i * D, in + (size_t)idx[i] * D, (size_t)D * sizeof *in);
        else
            memset(out + i * D, 0, (size_t)D * sizeof *out);
    }
    return 0;
}

int moe_cpu_scatter_add_rows(float *restrict out, const float *restrict in, const int *idx, int n,
                             int D) {
    for (long i = 0; i < n; i++) {
        if (idx[i] < 0) continue;
        axpy(out + (size_t)idx[i] * D, in + i * D, 1.0f, D);
    }
    return 0;
}
