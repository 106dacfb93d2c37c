// The CPU expert op (kernels/ops.h expert_ffn_*) against the layer's
// block-by-block loop of matmul and swiglu ops (within float rounding: OpenBLAS
// rounds differently on differently split shapes), and its work splits against
// each other (bit for bit), for one block per expert and for several (expert
// parallelism's sources), with empty and multi-part blocks.
#include "kernels/cpu/cpu.h"
#include "kernels/ops.h"
#include "moe/error.h"
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// 2H = 400 rows of dw13: two weight-row parts.
enum { D = 48, H = 200, E = 3, MAXB = 2 * E };

typedef struct {
    int n_blocks, rows, off[MAXB], n[MAXB];
    size_t stride, w2off, nw;
    float *w, *x, *dy;
} problem;

static float *rnd(size_t n, unsigned *seed) {
    float *v = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++)
        v[i] = (float)rand_r(seed) / (float)RAND_MAX - 0.5f;
    return v;
}

// Blocks of the given sizes laid out back to back with a one-row gap
// (rows outside every block must be left alone).
static void setup(problem *p, const int *sizes, int n_blocks, unsigned seed) {
    memset(p, 0, sizeof *p);
    p->n_blocks = n_blocks;
    int r = 0;
    for (int b = 0; b < n_blocks; b++)
        p->off[b] = r, p->n[b] = sizes[b], r += sizes[b] + 1;
    p->rows = r;
    p->stride = 3 * (size_t)H * D, p->w2off = 2 * (size_t)H * D, p->nw = E * p->stride;
    p->w = rnd(p->nw, &seed), p->x = rnd((size_t)r * D, &seed), p->dy = rnd((size_t)r * D, &seed);
}

static void teardown(problem *p) {
    free(p->w), free(p->x), free(p->dy);
}

typedef struct {
    float *y, *ab, *h, *dx, *dw;
} result;

static void result_alloc(result *o, const problem *p, float fill) {
    size_t r = (size_t)p->rows;
    float **f[] = {&o->y, &o->ab, &o->h, &o->dx, &o->dw};
    size_t n[] = {r * D, r * 2 * H, r * H, r * D, p->nw};
    for (int i = 0; i < 5; i++) {
        *f[i] = malloc(sizeof(float) * n[i]);
        for (size_t j = 0; j < n[i]; j++)
            (*f[i])[j] = fill + 0.001f * (float)(j % 7);
    }
}

static void result_free(result *o) {
    free(o->y), free(o->ab), free(o->h), free(o->dx), free(o->dw);
}

// The layer's fallback: per block, per expert in source order for weights.
static void reference(result *o, const problem *p) {
    const moe_ops *ops = &moe_ops_cpu;
    const int n_src = p->n_blocks / E;
    float *dab = malloc(sizeof(float) * (size_t)p->rows * 2 * H);
    float *dh = malloc(sizeof(float) * (size_t)p->rows * H);
    float *tmp = malloc(sizeof(float) * p->stride);
    for (int b = 0; b < p->n_blocks; b++) {
        const int n = p->n[b], e = b % E;
        const size_t r = (size_t)p->off[b];
        if (!n) continue;
        const float *w13 = p->w + e * p->stride, *w2 = w13 + p->w2off;
        ops->matmul(o->ab + r * 2 * H, p->x + r * D, w13, n, 2 * H, D, false, true, 1, 0);
        ops->swiglu_forward(o->h + r * H, o->ab + r * 2 * H, n, H);
        ops->matmul(o->y + r * D, o->h + r * H, w2, n, D, H, false, true, 1, 0);
    }
    for (int e = 0; e < E; e++)
        for (int s = 0; s < n_src; s++) {
            const int b = s * E + e, n = p->n[b];
            const size_t r = (size_t)p->off[b];
            if (!n) continue;
            const float *w13 = p->w + e * p->stride, *w2 = w13 + p->w2off;
            float *dw13 = o->dw + e * p->stride, *dw2 = dw13 + p->w2off;
            if (n_src > 1) {
                memset(tmp, 0, sizeof(float) * p->stride);
                dw13 = tmp, dw2 = tmp + p->w2off;
            }
            const float *dy = p->dy + r * D;
            ops->matmul(dh, dy, w2, n, H, D, false, false, 1, 0);
            ops->matmul(dw2, dy, o->h + r * H, D, H, n, true, false, 1, 1);
            memset(dab, 0, sizeof(float) * (size_t)n * 2 * H);
            ops->swiglu_backward(dab, dh, o->ab + r * 2 * H, n, H);
            ops->matmul(dw13, dab, p->x + r * D, 2 * H, D, n, true, false, 1, 1);
            ops->matmul(o->dx + r * D, dab, w13, n, D, 2 * H, false, false, 1, 0);
            if (n_src > 1)
                for (size_t i = 0; i < p->stride; i++)
                    o->dw[e * p->stride + i] += tmp[i];
        }
    free(dab), free(dh), free(tmp);
}

static void run_op(result *o, const problem *p, int mode) {
    float *tmp = malloc(sizeof(float) * p->stride);
    ck_assert_int_eq(moe_cpu_expert_ffn_forward(o->y, o->ab, o->h, p->x, p->w, p->stride, p->w2off,
                                                p->off, p->n, p->n_blocks, E, D, H),
                     0);
    ck_assert_int_eq(moe_cpu_expert_ffn_backward_mode(o->dx, o->dw, tmp, p->dy, p->x, o->ab, o->h,
                                                      p->w, p->stride, p->w2off, p->off, p->n,
                                                      p->n_blocks, E, D, H, mode),
                     0);
    free(tmp);
}

// |a - b| <= tol * (1 + |b|) element by element; tol = 0: equal as floats.
static void assert_close(const float *a, const float *b, size_t n, double tol, const char *what,
                         int mode) {
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(tol == 0 ? a[i] == b[i] : fabs(a[i] - b[i]) <= tol * (1 + fabs(b[i])),
                      "mode %d: %s[%zu] = %.9g, reference %.9g", mode, what, i, (double)a[i],
                      (double)b[i]);
}

// Mode 1 (whole blocks) against mode 2 (three passes of parts) bit for bit,
// and each against the reference loop within float rounding.
static void check_against_reference(const int *sizes, int n_blocks) {
    problem p;
    setup(&p, sizes, n_blocks, 7u + (unsigned)n_blocks);
    result want, split, got;
    result_alloc(&want, &p, 0.25f), result_alloc(&split, &p, 0.25f);
    reference(&want, &p);
    run_op(&split, &p, 2);
    const size_t r = (size_t)p.rows;
    assert_close(split.y, want.y, r * D, 1e-5, "y", 2);
    assert_close(split.dx, want.dx, r * D, 1e-5, "dx", 2);
    assert_close(split.dw, want.dw, p.nw, 1e-5, "dw", 2);
    for (int mode = 0; mode <= 1; mode++) {
        result_alloc(&got, &p, 0.25f);
        run_op(&got, &p, mode);
        assert_close(got.y, split.y, r * D, 0, "y", mode);
        assert_close(got.dx, split.dx, r * D, 0, "dx", mode);
        assert_close(got.dw, split.dw, p.nw, 0, "dw", mode);
        result_free(&got);
    }
    // Gap rows (between blocks) keep their fill in every output.
    for (int b = 0; b < n_blocks; b++) {
        const size_t gap = (size_t)(p.off[b] + p.n[b]);
        for (int c = 0; c < D; c++) {
            const float fill = 0.25f + 0.001f * (float)((gap * D + c) % 7);
            ck_assert_msg(split.y[gap * D + c] == fill && split.dx[gap * D + c] == fill,
                          "gap row %zu written", gap);
        }
    }
    result_free(&want), result_free(&split);
    teardown(&p);
}

// 400 rows: two row parts; 0: an empty block; 1: a single row.
static const int one_src[E] = {400, 0, 17};
static const int two_src[2 * E] = {5, 1, 0, 260, 0, 33};

START_TEST(test_expert_ffn_blocks_match_the_loop_for_every_split) {
    check_against_reference(one_src, E);
}
END_TEST

START_TEST(test_expert_ffn_sources_add_in_order_like_the_loop) {
    check_against_reference(two_src, 2 * E); // mode 1 needs one block per expert: falls back
}
END_TEST

START_TEST(test_expert_ffn_refuses_blocks_not_a_multiple_of_experts) {
    problem p;
    setup(&p, two_src, 2 * E, 1u);
    result o;
    result_alloc(&o, &p, 0.0f);
    ck_assert_int_eq(moe_cpu_expert_ffn_forward(o.y, o.ab, o.h, p.x, p.w, p.stride, p.w2off, p.off,
                                                p.n, 2 * E - 1, E, D, H),
                     MOE_EINVAL);
    int bad[2 * E] = {1, 1, -1, 1, 1, 1};
    ck_assert_int_eq(moe_cpu_expert_ffn_forward(o.y, o.ab, o.h, p.x, p.w, p.stride, p.w2off, p.off,
                                                bad, 2 * E, E, D, H),
                     MOE_EINVAL);
    // a negative block offset would address rows before x: refused, not read
    int bad_off[2 * E];
    memcpy(bad_off, p.off, sizeof bad_off);
    bad_off[3] = -1;
    ck_assert_int_eq(moe_cpu_expert_ffn_forward(o.y, o.ab, o.h, p.x, p.w, p.stride, p.w2off,
                                                bad_off, p.n, 2 * E, E, D, H),
                     MOE_EINVAL);
    result_free(&o);
    teardown(&p);
}
END_TEST

int main(void) {
    Suite *s = suite_create("expert_ffn");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_expert_ffn_blocks_match_the_loop_for_every_split);
    tcase_add_test(tc, test_expert_ffn_sources_add_in_order_like_the_loop);
    tcase_add_test(tc, test_expert_ffn_refuses_blocks_not_a_multiple_of_experts);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
