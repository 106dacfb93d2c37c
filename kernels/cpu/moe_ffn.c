// The MoE layer's experts as one CPU op (kernels/ops.h expert_ffn_*): the
// blocks' GEMMs run single-threaded, several at a time over the pool, instead
// of each small GEMM being split over the threads (with 64 experts of 128 rows
// the split GEMMs, their wake-ups and the serial SwiGLU between them cost a
// quarter of the time). Work items never split a sum: rows of a block's
// activations, or rows of a weight gradient, in parts that depend on the
// sizes alone, so the results do not depend on the thread count or timing.
#include "kernels/cpu/cpu.h"
#include "moe/error.h"

#include <cblas.h>
#include <stdlib.h>

// Rows per work item: big enough that OpenBLAS runs near its peak (packing a
// weight matrix is amortised over the rows), small enough to balance 2-16
// threads over 8 experts.
enum { PART_ROWS = 256, MIN_BLOCK_TASKS = 16 };

typedef struct {
    float *y, *ab, *h, *dx, *dw, *dw_tmp;
    const float *x, *dy, *w;
    size_t w_stride, w2_offset;
    const int *off, *n;
    int n_blocks, E, D, H, n_src;
    int *task; // packed items, largest first: (block or expert) << 8 | part
    int *parts;
} ffn_job;

static void sgemm1(bool ta, bool tb, int M, int N, int K, float beta, const float *a, int lda,
                   const float *b, int ldb, float *c, int ldc) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
                K, 1.0f, a, lda, b, ldb, beta, c, ldc);
}

static int n_parts(int rows) {
    int p = (rows + PART_ROWS / 2) / PART_ROWS;
    return p < 1 ? 1 : p > 255 ? 255 : p;
}

static void part_range(int rows, int parts, int p, int *r0, int *r1) {
    *r0 = (int)((long)rows * p / parts), *r1 = (int)((long)rows * (p + 1) / parts);
}

static const float *w13_of(const ffn_job *j, int b) {
    return j->w + (size_t)(b % j->E) * j->w_stride;
}

// Items sorted by size, largest first (longest-processing-time order): the
// last items to start are the short ones, so the threads finish together.
// sizes[] is parallel to task[]; insertion sort keeps equal sizes in order.
static void sort_tasks(int *task, long *size, int n) {
    for (int i = 1; i < n; i++) {
        int t = task[i];
        long s = size[i];
        int q = i;
        for (; q > 0 && size[q - 1] < s; q--)
            task[q] = task[q - 1], size[q] = size[q - 1];
        task[q] = t, size[q] = s;
    }
}

// ---- forward ---------------------------------------------------------------------------

static void fwd_item(void *ctx, int i) {
    const ffn_job *j = ctx;
    const int b = j->task[i] >> 8, p = j->task[i] & 255, D = j->D, H = j->H;
    int r0, r1;
    part_range(j->n[b], j->parts[b], p, &r0, &r1);
    const size_t r = (size_t)j->off[b] + (size_t)r0;
    const int m = r1 - r0;
    const float *w13 = w13_of(j, b), *w2 = w13 + j->w2_offset;
    float *ab = j->ab + r * 2 * H, *h = j->h + r * H;
    sgemm1(false, true, m, 2 * H, D, 0.0f, j->x + r * D, D, w13, D, ab, 2 * H);
    moe_cpu_swiglu_forward(h, ab, m, H);
    sgemm1(false, true, m, D, H, 0.0f, h, H, w2, H, j->y + r * D, D);
}

// Items (block, row part) over the non-empty blocks; returns their count or -1.
static int row_items(ffn_job *j) {
    int n = 0;
    for (int b = 0; b < j->n_blocks; b++)
        if (j->n[b] > 0) n += (j->parts[b] = n_parts(j->n[b]));
    j->task = malloc(sizeof(int) * (n ? n : 1));
    long *size = malloc(sizeof(long) * (n ? n : 1));
    if (!j->task || !size) {
        free(size);
        return -1;
    }
    int q = 0;
    for (int b = 0; b < j->n_blocks; b++)
        for (int p = 0; j->n[b] > 0 && p < j->parts[b]; p++) {
            int r0, r1;
            part_range(j->n[b], j->parts[b], p, &r0, &r1);
            j->task[q] = b << 8 | p, size[q++] = r1 - r0;
        }
    sort_tasks(j->task, size, n);
    free(size);
    return n;
}

static int check_blocks(const char *op, const int *off, const int *n, int n_blocks, int E, int D,
                        int H) {
    if (n_blocks < 0 || E < 1 || D < 1 || H < 1 || n_blocks % E || n_blocks / E > (1 << 22))
        return moe_fail(MOE_EINVAL, "%s: %d blocks over %d experts, D=%d H=%d", op, n_blocks, E, D,
                        H);
    for (int b = 0; b < n_blocks; b++)
        if (n[b] < 0 || off[b] < 0)
            return moe_fail(MOE_EINVAL, "%s: block %d has %d rows at %d", op, b, n[b], off[b]);
    return 0;
}

int moe_cpu_expert_ffn_forward(float *y, float *ab, float *h, const float *x, const float *w,
                               size_t w_stride, size_t w2_offset, const int *off, const int *n,
                               int n_blocks, int E, int D, int H) {
    MOE_TRY(check_blocks("expert_ffn_forward", off, n, n_blocks, E, D, H));
    int parts[n_blocks > 0 ? n_blocks : 1];
    ffn_job j = {.y = y,
                 .ab = ab,
                 .h = h,
                 .x = x,
                 .w = w,
                 .w_stride = w_stride,
                 .w2_offset = w2_offset,
                 .off = off,
                 .n = n,
                 .n_blocks = n_blocks,
                 .E = E,
                 .D = D,
                 .H = H,
                 .parts = parts};
    int items = row_items(&j);
    if (items < 0) return moe_fail(MOE_ENOMEM, "expert_ffn_forward: %d blocks", n_blocks);
    moe_cpu_parallel_for(items, fwd_item, &j);
    free(j.task);
    return 0;
}

// ---- backward --------------------------------------------------------------------------
//
// Per block (rows x, dy; saved ab, h): dw2 += dy^T h; dh = dy w2 (into h);
// dab = swiglu'(dh) (into ab); dw13 += dab^T x; dx = dab w13. Weight
// gradients take the blocks of an expert in block order (source by source);
// with one block per expert the GEMM adds into dw directly (beta = 1), with
// several each block's product is formed in dw_tmp and then added: the sum a
// single process forms over the sources' micro-batches, bit for bit.

// dW rows [r0, r1) of expert e, for the w2 (which = 0) or w13 (1) gradient.
static void wgrad_rows(const ffn_job *j, int e, int which, int r0, int r1) {
    const int D = j->D, H = j->H, N = which ? D : H;
    const size_t base = (size_t)e * j->w_stride + (which ? 0 : j->w2_offset);
    float *dw = j->dw + base + (size_t)r0 * N;
    for (int s = 0; s < j->n_src; s++) {
        const int b = s * j->E + e, m = j->n[b];
        if (m == 0) continue;
        const size_t r = (size_t)j->off[b];
        // which = 0: dw2 [D, H] = dy^T [D, m] h [m, H]; 1: dw13 [2H, D] = dab^T [2H, m] x [m, D]
        const float *a = which ? j->ab + r * 2 * H + r0 : j->dy + r * D + r0;
        const float *bm = which ? j->x + r * D : j->h + r * H;
        const int lda = which ? 2 * H : D, ldb = which ? D : H;
        if (j->n_src == 1) {
            sgemm1(true, false, r1 - r0, N, m, 1.0f, a, lda, bm, ldb, dw, N);
        } else {
            float *tmp = j->dw_tmp + (which ? 0 : j->w2_offset) + (size_t)r0 * N;
            sgemm1(true, false, r1 - r0, N, m, 0.0f, a, lda, bm, ldb, tmp, N);
            for (size_t i = 0; i < (size_t)(r1 - r0) * N; i++)
                dw[i] += tmp[i];
        }
    }
}

// Rows [r0, r1) of block b: dh, dab, dx.
static void act_rows(const ffn_job *j, int b, int r0, int r1) {
    const int D = j->D, H = j->H, m = r1 - r0;
    const size_t r = (size_t)j->off[b] + (size_t)r0;
    const float *w13 = w13_of(j, b), *w2 = w13 + j->w2_offset;
    float *dh = j->h + r * H, *dab = j->ab + r * 2 * H;
    sgemm1(false, false, m, H, D, 0.0f, j->dy + r * D, D, w2, H, dh, H);
    moe_cpu_swiglu_backward_inplace(dab, dh, m, H);
    sgemm1(false, false, m, D, 2 * H, 0.0f, dab, 2 * H, w13, D, j->dx + r * D, D);
}

// One item per block (one block per expert): everything in the order above,
// in the same row parts as the three-pass split. OpenBLAS's bits depend on
// the shapes it is given (edge kernels), so the parts are a function of the
// sizes only: the split over threads never changes a result.
static void wgrad_parts(const ffn_job *j, int e, int which) {
    const int rows = which ? 2 * j->H : j->D, parts = n_parts(rows);
    for (int p = 0; p < parts; p++) {
        int r0, r1;
        part_range(rows, parts, p, &r0, &r1);
        if (r1 > r0) wgrad_rows(j, e, which, r0, r1);
    }
}

static void bwd_block(void *ctx, int i) {
    const ffn_job *j = ctx;
    const int b = j->task[i] >> 8;
    wgrad_parts(j, b, 0);
    for (int p = 0; p < j->parts[b]; p++) {
        int r0, r1;
        part_range(j->n[b], j->parts[b], p, &r0, &r1);
        act_rows(j, b, r0, r1);
    }
    wgrad_parts(j, b, 1);
}

static void bwd_rows(void *ctx, int i) {
    const ffn_job *j = ctx;
    const int b = j->task[i] >> 8, p = j->task[i] & 255;
    int r0, r1;
    part_range(j->n[b], j->parts[b], p, &r0, &r1);
    act_rows(j, b, r0, r1);
}

typedef struct {
    const ffn_job *j;
    int which, e0, e1, parts; // experts [e0, e1), each dW split in parts row ranges
} wgrad_job;

static void wgrad_item(void *ctx, int i) {
    const wgrad_job *g = ctx;
    const int e = g->e0 + i / g->parts, p = i % g->parts;
    int r0, r1;
    part_range(g->which ? 2 * g->j->H : g->j->D, g->parts, p, &r0, &r1);
    if (r1 > r0) wgrad_rows(g->j, e, g->which, r0, r1);
}

// One weight gradient (which) of every expert, in row parts; with a shared
// dw_tmp (several blocks per expert) one expert at a time.
static void wgrad_all(const ffn_job *j, int which) {
    const int rows = which ? 2 * j->H : j->D, parts = n_parts(rows);
    if (j->n_src == 1) {
        wgrad_job g = {j, which, 0, j->E, parts};
        moe_cpu_parallel_for(j->E * parts, wgrad_item, &g);
        return;
    }
    for (int e = 0; e < j->E; e++) {
        wgrad_job g = {j, which, e, e + 1, parts};
        moe_cpu_parallel_for(parts, wgrad_item, &g);
    }
}

int moe_cpu_expert_ffn_backward_mode(float *dx, float *dw, float *dw_tmp, const float *dy,
                                     const float *x, float *ab, float *h, const float *w,
                                     size_t w_stride, size_t w2_offset, const int *off,
                                     const int *n, int n_blocks, int E, int D, int H, int mode) {
    MOE_TRY(check_blocks("expert_ffn_backward", off, n, n_blocks, E, D, H));
    int parts[n_blocks > 0 ? n_blocks : 1];
    ffn_job j = {.ab = ab,
                 .h = h,
                 .dx = dx,
                 .dw = dw,
                 .dw_tmp = dw_tmp,
                 .x = x,
                 .dy = dy,
                 .w = w,
                 .w_stride = w_stride,
                 .w2_offset = w2_offset,
                 .off = off,
                 .n = n,
                 .n_blocks = n_blocks,
                 .E = E,
                 .D = D,
                 .H = H,
                 .n_src = n_blocks / E,
                 .parts = parts};
    int items = row_items(&j);
    if (items < 0) return moe_fail(MOE_ENOMEM, "expert_ffn_backward: %d blocks", n_blocks);
    if (mode == 0) { // automatic: whole blocks when there are enough of them to balance
        int busy = 0;
        for (int b = 0; b < n_blocks; b++)
            busy += n[b] > 0;
        const int want = 4 * moe_cpu_threads();
        mode = j.n_src == 1 && busy >= (want > MIN_BLOCK_TASKS ? want : MIN_BLOCK_TASKS) ? 1 : 2;
    }
    if (mode == 1 && j.n_src == 1) {
        // One item per non-empty block, largest first (row_items' order).
        int q = 0;
        for (int i = 0; i < items; i++)
            if ((j.task[i] & 255) == 0) j.task[q++] = j.task[i];
        moe_cpu_parallel_for(q, bwd_block, &j);
    } else {
        wgrad_all(&j, 0);                          // uses h
        moe_cpu_parallel_for(items, bwd_rows, &j); // h becomes dh, ab dab
        wgrad_all(&j, 1);                          // uses dab
    }
    free(j.task);
    return 0;
}

int moe_cpu_expert_ffn_backward(float *dx, float *dw, float *dw_tmp, const float *dy,
                                const float *x, float *ab, float *h, const float *w,
                                size_t w_stride, size_t w2_offset, const int *off, const int *n,
                                int n_blocks, int E, int D, int H) {
    return moe_cpu_expert_ffn_backward_mode(dx, dw, dw_tmp, dy, x, ab, h, w, w_stride, w2_offset,
                                            off, n, n_blocks, E, D, H, 0);
}
