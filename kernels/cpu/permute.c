// Token <-> expert-contiguous row movement for the MoE layer (DESIGN "Data flow
// of one MoE layer"): dispatch indices from a plan, gather (permute), weighted
// combine (unpermute) and their backward passes, plus generic row gather/scatter.
// Token-major loops: each token writes only its own rows, so no two iterations
// touch the same output row (the CUDA twin needs no atomics), and token ranges
// run side by side on the pool with results that do not depend on the split.
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

// Token ranges for the pool: a few per thread, each at least ~64 KiB of rows.
typedef struct {
    float *out, *out2;
    const float *in, *in2, *weight;
    const int *row;
    int T, k, D, parts;
} rows_job;

static int token_parts(int T, int k, int D) {
    const long width = (long)k * D > 0 ? (long)k * D : 1; // k or D may be 0
    const long min_tokens = 1 + (16384 - 1) / width;
    long p = T / min_tokens, most = 4L * moe_cpu_threads();
    return (int)(p < 1 ? 1 : p > most ? most : p);
}

static void token_range(const rows_job *j, int i, long *t0, long *t1) {
    *t0 = (long)j->T * i / j->parts, *t1 = (long)j->T * (i + 1) / j->parts;
}

static void run_parts(rows_job *j, moe_cpu_task fn) {
    j->parts = token_parts(j->T, j->k, j->D);
    moe_cpu_parallel_for(j->parts, fn, j);
}

int moe_cpu_dispatch_rows(int *row, const int *expert, const int *slot, const int *offsets, int T,
                          int k) {
    for (long i = 0; i < (long)T * k; i++)
        row[i] = expert[i] >= 0 ? offsets[expert[i]] + slot[i] : -1;
    return 0;
}

// Counts per expert, their prefix sums, then each entry takes coff[e]++ (so
// coff[e] ends at the next segment's start and shifts back by one).
int moe_cpu_chunk_rows(int *crow, int *coff, const int *expert, int n, int E) {
    if (n < 0 || E < 1) return moe_fail(MOE_EINVAL, "chunk_rows: n=%d E=%d", n, E);
    memset(coff, 0, sizeof(int) * ((size_t)E + 1));
    for (int i = 0; i < n; i++) {
        if (expert[i] >= E)
            return moe_fail(MOE_EINVAL, "chunk_rows: entry %d names expert %d of %d", i, expert[i],
                            E);
        if (expert[i] >= 0) coff[expert[i] + 1]++;
    }
    for (int e = 0; e < E; e++)
        coff[e + 1] += coff[e];
    for (int i = 0; i < n; i++)
        crow[i] = expert[i] >= 0 ? coff[expert[i]]++ : -1;
    for (int e = E; e > 0; e--)
        coff[e] = coff[e - 1];
    coff[0] = 0;
    return 0;
}

static void permute_forward_part(void *ctx, int i) {
    const rows_job *q = ctx;
    const int k = q->k, D = q->D, *row = q->row;
    long t0, t1;
    token_range(q, i, &t0, &t1);
    for (long t = t0; t < t1; t++)
        for (int j = 0; j < k; j++) {
            int r = row[t * k + j];
            if (r >= 0) memcpy(q->out + (size_t)r * D, q->in + t * D, (size_t)D * sizeof(float));
        }
}

int moe_cpu_permute_forward(float *restrict xe, const float *restrict x, const int *row, int T,
                            int k, int D) {
    rows_job j = {.out = xe, .in = x, .row = row, .T = T, .k = k, .D = D};
    run_parts(&j, permute_forward_part);
    return 0;
}

static void permute_backward_part(void *ctx, int i) {
    const rows_job *q = ctx;
    const int k = q->k, D = q->D, *row = q->row;
    long t0, t1;
    token_range(q, i, &t0, &t1);
    for (long t = t0; t < t1; t++) {
        float *d = q->out + t * D;
        for (int j = 0; j < k; j++) {
            int r = row[t * k + j];
            if (r < 0) continue;
            axpy(d, q->in + (size_t)r * D, 1.0f, D);
        }
    }
}

int moe_cpu_permute_backward(float *restrict dx, const float *restrict dxe, const int *row, int T,
                             int k, int D) {
    rows_job j = {.out = dx, .in = dxe, .row = row, .T = T, .k = k, .D = D};
    run_parts(&j, permute_backward_part);
    return 0;
}

static void unpermute_forward_part(void *ctx, int i) {
    const rows_job *q = ctx;
    const int k = q->k, D = q->D, *row = q->row;
    long t0, t1;
    token_range(q, i, &t0, &t1);
    for (long t = t0; t < t1; t++) {
        float *o = q->out + t * D;
        memset(o, 0, (size_t)D * sizeof *o);
        for (int j = 0; j < k; j++) {
            int r = row[t * k + j];
            if (r < 0) continue;
            axpy(o, q->in + (size_t)r * D, q->weight[t * k + j], D);
        }
    }
}

int moe_cpu_unpermute_forward(float *restrict y, const float *restrict ye, const int *row,
                              const float *weight, int T, int k, int D) {
    rows_job j = {.out = y, .in = ye, .weight = weight, .row = row, .T = T, .k = k, .D = D};
    run_parts(&j, unpermute_forward_part);
    return 0;
}

static void unpermute_backward_part(void *ctx, int i) {
    const rows_job *q = ctx;
    const int k = q->k, D = q->D, *row = q->row;
    long t0, t1;
    token_range(q, i, &t0, &t1);
    for (long t = t0; t < t1; t++) {
        const float *g = q->in + t * D;
        for (int j = 0; j < k; j++) {
            int r = row[t * k + j];
            if (r < 0) continue;
            axpy(q->out + (size_t)r * D, g, q->weight[t * k + j], D);
            q->out2[t * k + j] += dot(g, q->in2 + (size_t)r * D, D);
        }
    }
}

int moe_cpu_unpermute_backward(float *restrict dye, float *restrict dweight,
                               const float *restrict dy, const float *restrict ye, const int *row,
                               const float *weight, int T, int k, int D) {
    rows_job j = {.out = dye,
                  .out2 = dweight,
                  .in = dy,
                  .in2 = ye,
                  .weight = weight,
                  .row = row,
                  .T = T,
                  .k = k,
                  .D = D};
    run_parts(&j, unpermute_backward_part);
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
