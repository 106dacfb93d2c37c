// The CPU op table (kernels/ops.h) against naive double-precision references on
// random inputs; SwiGLU backward against central differences; every output in a
// guarded buffer whose guards must survive.
#include "kernels/ops.h"
#include "moe/error.h"
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const moe_ops *ops = &moe_ops_cpu;

// max |a - b| / max(1, |b|) over n entries.
static double max_rel_err(const float *a, const double *b, size_t n) {
    double m = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]) / fmax(1.0, fabs(b[i]));
        if (!(d <= m)) m = d; // NaN propagates as failure
    }
    return m;
}

// ---- matmul ---------------------------------------------------------------------

// c = alpha * op(a) op(b) + beta * c0 in double; a stored [K,M] when ta, b [N,K] when tb.
static void ref_matmul(double *c, const float *a, const float *b, const float *c0, int M, int N,
                       int K, int ta, int tb, float alpha, float beta) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0.0;
            for (int l = 0; l < K; l++) {
                double av = ta ? a[(size_t)l * M + i] : a[(size_t)i * K + l];
                double bv = tb ? b[(size_t)j * K + l] : b[(size_t)l * N + j];
                s += av * bv;
            }
            c[(size_t)i * N + j] = alpha * s + (beta == 0.0f ? 0.0 : beta * (double)c0[i * N + j]);
        }
}

START_TEST(test_matmul_matches_reference_all_transposes) {
    tu_rng r;
    tu_seed(&r, 11);
    const int shapes[][3] = {{1, 1, 1}, {7, 5, 3}, {33, 17, 65}, {64, 128, 96}, {3, 200, 1}};
    const float ab[][2] = {{1.0f, 0.0f}, {0.5f, 1.0f}, {-2.0f, 0.25f}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++)
                for (size_t q = 0; q < sizeof ab / sizeof ab[0]; q++) {
                    int M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
                    float *a = malloc(sizeof(float) * M * K), *b = malloc(sizeof(float) * K * N);
                    float *c0 = malloc(sizeof(float) * M * N);
                    double *ref = malloc(sizeof(double) * M * N);
                    float *c = tu_guarded_alloc((size_t)M * N);
                    tu_fill_normal(&r, a, (size_t)M * K, 1.0f);
                    tu_fill_normal(&r, b, (size_t)K * N, 1.0f);
                    tu_fill_normal(&r, c0, (size_t)M * N, 1.0f);
                    memcpy(c, c0, sizeof(float) * M * N);
                    ck_assert_int_eq(ops->matmul(c, a, b, M, N, K, ta, tb, ab[q][0], ab[q][1]), 0);
                    ref_matmul(ref, a, b, c0, M, N, K, ta, tb, ab[q][0], ab[q][1]);
                    double err = max_rel_err(c, ref, (size_t)M * N);
                    // fp32 rounding grows with K; a wrong index or transpose errs by O(1)
                    ck_assert_msg(err < 1e-6 * (K + 8), "M=%d N=%d K=%d ta=%d tb=%d: err %g", M, N,
                                  K, ta, tb, err);
                    ck_assert(tu_guards_intact(c, (size_t)M * N));
                    tu_guarded_free(c, (size_t)M * N);
                    free(a), free(b), free(c0), free(ref);
                }
}
END_TEST

START_TEST(test_matmul_beta_zero_ignores_nan_and_k_zero_scales) {
    float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1};
    float *c = tu_guarded_alloc(4);
    for (int i = 0; i < 4; i++)
        c[i] = NAN;
    ck_assert_int_eq(ops->matmul(c, a, b, 2, 2, 3, false, false, 1.0f, 0.0f), 0);
    // [1 2 3; 4 5 6] @ [1 0; 0 1; 1 1] = [4 5; 10 11]
    ck_assert_float_eq(c[0], 4);
    ck_assert_float_eq(c[1], 5);
    ck_assert_float_eq(c[2], 10);
    ck_assert_float_eq(c[3], 11);
    ck_assert_int_eq(ops->matmul(c, a, b, 2, 2, 0, false, false, 1.0f, 0.5f), 0);
    ck_assert_float_eq(c[0], 2);
    ck_assert_float_eq(c[3], 5.5f);
    ck_assert_int_eq(ops->matmul(c, a, b, 2, 2, 0, false, false, 1.0f, 0.0f), 0);
    ck_assert_float_eq(c[0], 0);
    ck_assert_float_eq(c[3], 0);
    c[0] = 7;
    ck_assert_int_eq(ops->matmul(c, a, b, 0, 2, 3, false, false, 1.0f, 0.0f), 0); // M = 0: no-op
    ck_assert_float_eq(c[0], 7);
    ck_assert_int_eq(ops->matmul(c, a, b, -1, 2, 3, false, false, 1.0f, 0.0f), MOE_EINVAL);
    ck_assert(tu_guards_intact(c, 4));
    tu_guarded_free(c, 4);
}
END_TEST

// ---- swiglu -----------------------------------------------------------------------

static double silu_d(double a) {
    return a / (1.0 + exp(-a));
}

START_TEST(test_swiglu_forward_matches_reference) {
    tu_rng r;
    tu_seed(&r, 5);
    const int n = 9, H = 37;
    float *ab = malloc(sizeof(float) * n * 2 * H);
    tu_fill_normal(&r, ab, (size_t)n * 2 * H, 3.0f);
    ab[0] = -100.0f, ab[1] = 100.0f; // saturated sigmoid stays finite
    float *h = tu_guarded_alloc((size_t)n * H);
    double *ref = malloc(sizeof(double) * n * H);
    ck_assert_int_eq(ops->swiglu_forward(h, ab, n, H), 0);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < H; j++)
            ref[i * H + j] = silu_d(ab[i * 2 * H + j]) * ab[i * 2 * H + H + j];
    ck_assert_double_lt(max_rel_err(h, ref, (size_t)n * H), 1e-6);
    ck_assert(tu_guards_intact(h, (size_t)n * H));
    tu_guarded_free(h, (size_t)n * H);
    free(ab), free(ref);
}
END_TEST

START_TEST(test_swiglu_backward_matches_central_differences_and_adds) {
    tu_rng r;
    tu_seed(&r, 6);
    const int n = 5, H = 23;
    const size_t nab = (size_t)n * 2 * H, nh = (size_t)n * H;
    float *ab = malloc(sizeof(float) * nab), *dh = malloc(sizeof(float) * nh);
    float *hp = malloc(sizeof(float) * nh), *hm = malloc(sizeof(float) * nh);
    tu_fill_normal(&r, ab, nab, 2.0f);
    tu_fill_normal(&r, dh, nh, 1.0f);
    float *dab = tu_guarded_alloc(nab);
    for (size_t i = 0; i < nab; i++)
        dab[i] = 0.25f; // backward must add to this
    ck_assert_int_eq(ops->swiglu_backward(dab, dh, ab, n, H), 0);
    // L = sum(h * dh); perturb each input, the op itself evaluates L in float,
    // summed in double; the step is the representable difference.
    double worst = 0.0;
    for (size_t i = 0; i < nab; i++) {
        float v = ab[i];
        float vp = v + 1e-2f, vm = v - 1e-2f;
        ab[i] = vp;
        ops->swiglu_forward(hp, ab, n, H);
        ab[i] = vm;
        ops->swiglu_forward(hm, ab, n, H);
        ab[i] = v;
        double lp = 0, lm = 0;
        for (size_t q = 0; q < nh; q++)
            lp += (double)hp[q] * dh[q], lm += (double)hm[q] * dh[q];
        double num = (lp - lm) / ((double)vp - vm);
        double an = dab[i] - 0.25;
        double err = fabs(an - num) / fmax(fabs(num), 1e-1);
        if (err > worst) worst = err;
    }
    ck_assert_msg(worst < 1e-3, "worst relative error %g", worst);
    ck_assert(tu_guards_intact(dab, nab));
    tu_guarded_free(dab, nab);
    free(ab), free(dh), free(hp), free(hm);
}
END_TEST

// ---- permute / unpermute -------------------------------------------------------------

// A random dispatch: T tokens, k distinct experts each, some dropped, rows dense
// per expert (slot = arrival order), like a router plan.
typedef struct {
    int T, k, E, rows;
    int *expert, *slot, offsets[17];
    float *weight;
} fake_plan;

static void fake_plan_make(fake_plan *fp, tu_rng *r, int T, int k, int E, int cap) {
    fp->T = T, fp->k = k, fp->E = E;
    fp->expert = malloc(sizeof(int) * T * k);
    fp->slot = malloc(sizeof(int) * T * k);
    fp->weight = malloc(sizeof(float) * T * k);
    int kept[16] = {0};
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int e;
            int again;
            do { // distinct experts per token
                e = (int)(tu_uniform(r) * E);
                again = 0;
                for (int i = 0; i < j; i++) {
                    int prev = fp->expert[t * k + i];
                    again |= (prev >= 0 ? prev : -1 - prev) == e;
                }
            } while (again);
            fp->weight[t * k + j] = tu_uniform(r);
            if (kept[e] < cap) {
                fp->expert[t * k + j] = e;
                fp->slot[t * k + j] = kept[e]++;
            } else {
                fp->expert[t * k + j] = -1 - e; // remember e for distinctness, mark dropped
                fp->slot[t * k + j] = -1;
                fp->weight[t * k + j] = 0.0f;
            }
        }
    for (int i = 0; i < T * k; i++)
        if (fp->expert[i] < 0) fp->expert[i] = -1;
    fp->offsets[0] = 0;
    for (int e = 0; e < E; e++)
        fp->offsets[e + 1] = fp->offsets[e] + kept[e];
    fp->rows = fp->offsets[E];
}

static void fake_plan_free(fake_plan *fp) {
    free(fp->expert), free(fp->slot), free(fp->weight);
}

START_TEST(test_dispatch_rows_are_offset_plus_slot) {
    tu_rng r;
    tu_seed(&r, 21);
    fake_plan fp;
    fake_plan_make(&fp, &r, 40, 2, 5, 12);
    int *row = malloc(sizeof(int) * 80);
    ck_assert_int_eq(ops->dispatch_rows(row, fp.expert, fp.slot, fp.offsets, 40, 2), 0);
    int *seen = calloc(fp.rows, sizeof(int)), dropped = 0;
    for (int i = 0; i < 80; i++) {
        if (fp.expert[i] < 0) {
            ck_assert_int_eq(row[i], -1);
            dropped++;
            continue;
        }
        ck_assert_int_eq(row[i], fp.offsets[fp.expert[i]] + fp.slot[i]);
        ck_assert_int_lt(row[i], fp.rows);
        seen[row[i]]++;
    }
    for (int i = 0; i < fp.rows; i++)
        ck_assert_int_eq(seen[i], 1); // a bijection onto rows
    ck_assert_int_gt(dropped, 0);
    free(row), free(seen);
    fake_plan_free(&fp);
}
END_TEST

// A hand-numbered chunk: expert 2 holds entries 0, 3, 6 (rows 3, 4, 5 after
// expert 0's two and expert 1's one), expert 3 none, dropped entries -1.
START_TEST(test_chunk_rows_number_entries_in_expert_then_entry_order) {
    const int expert[8] = {2, 0, -1, 2, 1, 0, 2, -1};
    const int want_row[8] = {3, 0, -1, 4, 2, 1, 5, -1}, want_off[5] = {0, 2, 3, 6, 6};
    int crow[8], coff[5];
    ck_assert_int_eq(ops->chunk_rows(crow, coff, expert, 8, 4), 0);
    ck_assert_mem_eq(crow, want_row, sizeof want_row);
    ck_assert_mem_eq(coff, want_off, sizeof want_off);
    ck_assert_int_eq(ops->chunk_rows(crow, coff, expert, 0, 4), 0); // an empty chunk
    ck_assert_int_eq(coff[4], 0);
    const int bad[2] = {1, 4}; // expert 4 of 4
    ck_assert_int_eq(ops->chunk_rows(crow, coff, bad, 2, 4), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "expert 4 of 4"));
}
END_TEST

START_TEST(test_permute_and_unpermute_match_reference_and_are_adjoint) {
    tu_rng r;
    tu_seed(&r, 22);
    const int T = 37, k = 2, E = 6, D = 19;
    fake_plan fp;
    fake_plan_make(&fp, &r, T, k, E, 10);
    int *row = malloc(sizeof(int) * T * k);
    ops->dispatch_rows(row, fp.expert, fp.slot, fp.offsets, T, k);
    const size_t nx = (size_t)T * D, ne = (size_t)fp.rows * D;
    float *x = malloc(sizeof(float) * nx), *dy = malloc(sizeof(float) * nx);
    float *ye = malloc(sizeof(float) * ne), *g = malloc(sizeof(float) * ne);
    tu_fill_normal(&r, x, nx, 1.0f), tu_fill_normal(&r, dy, nx, 1.0f);
    tu_fill_normal(&r, ye, ne, 1.0f), tu_fill_normal(&r, g, ne, 1.0f);
    float *xe = tu_guarded_alloc(ne), *dx = tu_guarded_alloc(nx), *y = tu_guarded_alloc(nx);
    float *dye = tu_guarded_alloc(ne), *dw = tu_guarded_alloc((size_t)T * k);
    double *ref = calloc(nx > ne ? nx : ne, sizeof(double));

    // permute forward: every kept pair's row holds its token
    ck_assert_int_eq(ops->permute_forward(xe, x, row, T, k, D), 0);
    for (int i = 0; i < T * k; i++)
        if (row[i] >= 0)
            ck_assert_mem_eq(xe + (size_t)row[i] * D, x + (size_t)(i / k) * D, sizeof(float) * D);

    // permute backward adds: dx[t] = 1 + sum over kept j of g[row]
    for (size_t i = 0; i < nx; i++)
        dx[i] = 1.0f, ref[i] = 1.0;
    for (int i = 0; i < T * k; i++)
        if (row[i] >= 0)
            for (int c = 0; c < D; c++)
                ref[(size_t)(i / k) * D + c] += g[(size_t)row[i] * D + c];
    ck_assert_int_eq(ops->permute_backward(dx, g, row, T, k, D), 0);
    ck_assert_double_lt(max_rel_err(dx, ref, nx), 1e-6);
    // adjoint: <permute(x), g> = <x, permute^T(g)>
    double l = 0, rgt = 0;
    for (size_t i = 0; i < ne; i++)
        l += (double)xe[i] * g[i];
    for (size_t i = 0; i < nx; i++)
        rgt += (double)x[i] * (dx[i] - 1.0);
    ck_assert_double_lt(fabs(l - rgt), 1e-4 * fmax(1.0, fabs(l)));

    // unpermute forward overwrites (NaN in y must vanish), dropped pairs add 0
    for (size_t i = 0; i < nx; i++)
        y[i] = NAN, ref[i] = 0.0;
    for (int i = 0; i < T * k; i++)
        if (row[i] >= 0)
            for (int c = 0; c < D; c++)
                ref[(size_t)(i / k) * D + c] += (double)fp.weight[i] * ye[(size_t)row[i] * D + c];
    ck_assert_int_eq(ops->unpermute_forward(y, ye, row, fp.weight, T, k, D), 0);
    ck_assert_double_lt(max_rel_err(y, ref, nx), 1e-6);

    // unpermute backward adds into dye and dweight
    for (size_t i = 0; i < ne; i++)
        dye[i] = 0.5f;
    for (int i = 0; i < T * k; i++)
        dw[i] = 2.0f;
    ck_assert_int_eq(ops->unpermute_backward(dye, dw, dy, ye, row, fp.weight, T, k, D), 0);
    for (int i = 0; i < T * k; i++) {
        if (row[i] < 0) {
            ck_assert_float_eq(dw[i], 2.0f);
            continue;
        }
        double dot = 0;
        for (int c = 0; c < D; c++) {
            double want = 0.5 + (double)fp.weight[i] * dy[(size_t)(i / k) * D + c];
            ck_assert_double_lt(fabs(dye[(size_t)row[i] * D + c] - want), 1e-6);
            dot += (double)dy[(size_t)(i / k) * D + c] * ye[(size_t)row[i] * D + c];
        }
        ck_assert_double_lt(fabs(dw[i] - 2.0 - dot), 1e-5 * fmax(1.0, fabs(dot)));
    }
    ck_assert(tu_guards_intact(xe, ne) && tu_guards_intact(dx, nx) && tu_guards_intact(y, nx));
    ck_assert(tu_guards_intact(dye, ne) && tu_guards_intact(dw, (size_t)T * k));
    tu_guarded_free(xe, ne), tu_guarded_free(dx, nx), tu_guarded_free(y, nx);
    tu_guarded_free(dye, ne), tu_guarded_free(dw, (size_t)T * k);
    free(x), free(dy), free(ye), free(g), free(ref), free(row);
    fake_plan_free(&fp);
}
END_TEST

START_TEST(test_gather_rows_and_scatter_add_rows) {
    tu_rng r;
    tu_seed(&r, 23);
    const int m = 4, n = 11, D = 7;
    int idx[11] = {2, 0, -1, 3, 3, 1, 2, -1, 0, 0, 3};
    float *in = malloc(sizeof(float) * m * D), *g = malloc(sizeof(float) * n * D);
    tu_fill_normal(&r, in, (size_t)m * D, 1.0f), tu_fill_normal(&r, g, (size_t)n * D, 1.0f);
    float *out = tu_guarded_alloc((size_t)n * D), *acc = tu_guarded_alloc((size_t)m * D);
    for (int i = 0; i < n * D; i++)
        out[i] = NAN;
    ck_assert_int_eq(ops->gather_rows(out, in, idx, n, D), 0);
    for (int i = 0; i < n; i++)
        for (int c = 0; c < D; c++)
            ck_assert_float_eq(out[i * D + c], idx[i] < 0 ? 0.0f : in[idx[i] * D + c]);
    for (int i = 0; i < m * D; i++)
        acc[i] = 1.0f;
    ck_assert_int_eq(ops->scatter_add_rows(acc, g, idx, n, D), 0);
    for (int q = 0; q < m; q++)
        for (int c = 0; c < D; c++) {
            double want = 1.0;
            for (int i = 0; i < n; i++)
                if (idx[i] == q) want += g[i * D + c];
            ck_assert_double_lt(fabs(acc[q * D + c] - want), 1e-5);
        }
    ck_assert(tu_guards_intact(out, (size_t)n * D) && tu_guards_intact(acc, (size_t)m * D));
    tu_guarded_free(out, (size_t)n * D), tu_guarded_free(acc, (size_t)m * D);
    free(in), free(g);
}
END_TEST

START_TEST(test_elementwise_zero_mul_mul_add_and_alloc_alignment) {
    const size_t n = 1000;
    float *a = ops->alloc(n * sizeof(float)), *b = ops->alloc(n * sizeof(float));
    ck_assert_ptr_nonnull(a);
    ck_assert_ptr_nonnull(b);
    ck_assert_uint_eq((uintptr_t)a % 64, 0);
    for (size_t i = 0; i < n; i++)
        a[i] = (float)i, b[i] = 0.5f;
    float *o = tu_guarded_alloc(n);
    ck_assert_int_eq(ops->mul(o, a, b, n), 0);
    for (size_t i = 0; i < n; i++)
        ck_assert_float_eq(o[i], 0.5f * (float)i);
    ck_assert_int_eq(ops->mul_add(o, a, b, n), 0);
    for (size_t i = 0; i < n; i++)
        ck_assert_float_eq(o[i], (float)i);
    ck_assert_int_eq(ops->mul(a, a, b, n), 0); // aliasing allowed
    ck_assert_float_eq(a[10], 5.0f);
    ck_assert_int_eq(ops->zero(o, n), 0);
    for (size_t i = 0; i < n; i++)
        ck_assert_float_eq(o[i], 0.0f);
    ck_assert(tu_guards_intact(o, n));
    tu_guarded_free(o, n);
    ops->free(a);
    ops->free(b);
    const size_t big = (9u << 20) / sizeof(float) + 3; // the huge-page path
    float *c = ops->alloc(big * sizeof(float));
    ck_assert_ptr_nonnull(c);
    ck_assert_uint_eq((uintptr_t)c % 64, 0);
    ck_assert_int_eq(ops->zero(c, big), 0);
    c[big - 1] = 1.0f;
    ck_assert_float_eq(c[big - 2] + c[big - 1], 1.0f);
    ops->free(c);
}
END_TEST

START_TEST(test_op_table_is_complete) {
    const void *f[] = {(void *)ops->alloc,
                       (void *)ops->free,
                       (void *)ops->zero,
                       (void *)ops->matmul,
                       (void *)ops->swiglu_forward,
                       (void *)ops->swiglu_backward,
                       (void *)ops->dispatch_rows,
                       (void *)ops->chunk_rows,
                       (void *)ops->permute_forward,
                       (void *)ops->permute_backward,
                       (void *)ops->unpermute_forward,
                       (void *)ops->unpermute_backward,
                       (void *)ops->gather_rows,
                       (void *)ops->scatter_add_rows,
                       (void *)ops->mul,
                       (void *)ops->mul_add};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        ck_assert_msg(f[i] != NULL, "op %zu of %s is NULL", i, ops->name);
    ck_assert_str_eq(ops->name, "cpu");
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("kernels");
    TCase *tc = tcase_create("cpu");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_op_table_is_complete);
    tcase_add_test(tc, test_matmul_matches_reference_all_transposes);
    tcase_add_test(tc, test_matmul_beta_zero_ignores_nan_and_k_zero_scales);
    tcase_add_test(tc, test_swiglu_forward_matches_reference);
    tcase_add_test(tc, test_swiglu_backward_matches_central_differences_and_adds);
    tcase_add_test(tc, test_dispatch_rows_are_offset_plus_slot);
    tcase_add_test(tc, test_chunk_rows_number_entries_in_expert_then_entry_order);
    tcase_add_test(tc, test_permute_and_unpermute_match_reference_and_are_adjoint);
    tcase_add_test(tc, test_gather_rows_and_scatter_add_rows);
    tcase_add_test(tc, test_elementwise_zero_mul_mul_add_and_alloc_alignment);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
