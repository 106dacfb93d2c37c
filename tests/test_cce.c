// Cut cross-entropy equals the plain LM-head loss: the loss and both
// gradients within 1e-5 relative, with gradient filtering off and on, on
// shapes that are not multiples of the tile, with ignored targets.
#include "kernels/cpu/nn.h"
#include "moe/error.h"
#include "testutil.h"

#include <cblas.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { N = 150, D = 24, V = 1300 };

static double max_rel(const float *a, const float *b, size_t n) {
    double worst = 0, scale = 0;
    for (size_t i = 0; i < n; i++)
        scale = fmax(scale, fabs(b[i]));
    for (size_t i = 0; i < n; i++)
        worst = fmax(worst, fabs((double)a[i] - b[i]));
    return scale > 0 ? worst / scale : worst;
}

static void compare(float hscale, float filter, int expect_skips) {
    tu_rng r;
    tu_seed(&r, 17);
    float *h = malloc(sizeof(float) * N * D), *W = malloc(sizeof(float) * V * D);
    tu_fill_normal(&r, h, N * D, hscale);
    tu_fill_normal(&r, W, (size_t)V * D, 1.0f);
    int32_t target[N];
    for (int n = 0; n < N; n++)
        target[n] = n % 7 == 3 ? -1 : (int32_t)(tu_uniform(&r) * V);
    if (expect_skips) { // tokens >= 700 are improbable for every position (rare words)
        for (int n = 0; n < N; n++) {
            h[(size_t)n * D] = 5.0f;
            if (target[n] >= 700) target[n] %= 700;
        }
        for (int v = 700; v < V; v++)
            W[(size_t)v * D] = -10.0f;
    }
    // plain: materialise the logits
    float *logits = malloc(sizeof(float) * N * V), *dlog = calloc((size_t)N * V, sizeof(float));
    float *losses = malloc(sizeof(float) * N), *lse = malloc(sizeof(float) * N);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, V, D, 1, h, D, W, D, 0, logits, V);
    double plain, cce;
    ck_assert_int_eq(moe_cpu_crossentropy_forward(losses, &plain, logits, target, N, V), 0);
    ck_assert_int_eq(moe_cpu_crossentropy_backward(dlog, logits, target, N, V, 1.0f), 0);
    float *dh0 = calloc(N * D, sizeof(float)), *dW0 = calloc((size_t)V * D, sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, D, V, 1, dlog, V, W, D, 0, dh0, D);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, D, N, 1, dlog, V, h, D, 0, dW0, D);
    // cce: one tile of scratch
    float *scratch = tu_guarded_alloc(moe_cpu_cce_scratch_floats());
    float *dh = calloc(N * D, sizeof(float)), *dW = calloc((size_t)V * D, sizeof(float));
    ck_assert_int_eq(moe_cpu_cce_forward(losses, lse, &cce, h, W, target, N, D, V, scratch), 0);
    long skipped = 0;
    ck_assert_int_eq(
        moe_cpu_cce_backward(dh, dW, h, W, target, lse, N, D, V, 1.0f, filter, scratch, &skipped),
        0);
    ck_assert(tu_guards_intact(scratch, moe_cpu_cce_scratch_floats()));
    ck_assert_msg(fabs(cce - plain) <= 1e-5 * fabs(plain), "loss %.9g vs %.9g", cce, plain);
    double eh = max_rel(dh, dh0, N * D), ew = max_rel(dW, dW0, (size_t)V * D);
    ck_assert_msg(eh <= 1e-5 && ew <= 1e-5, "dh %.3g dW %.3g relative (filter %g)", eh, ew, filter);
    if (expect_skips)
        ck_assert_msg(skipped > 0, "filtering skipped no tile");
    else if (filter == 0)
        ck_assert_int_eq(skipped, 0);
    tu_guarded_free(scratch, moe_cpu_cce_scratch_floats());
    free(h), free(W), free(logits), free(dlog), free(losses), free(lse);
    free(dh0), free(dW0), free(dh), free(dW);
}

START_TEST(test_cce_matches_plain_without_filtering) {
    compare(0.3f, 0.0f, 0);
}
END_TEST

START_TEST(test_cce_matches_plain_with_filtering) {
    compare(0.3f, FLT_EPSILON, 0);
}
END_TEST

// A vocabulary region no position favours: its tiles fall below epsilon and
// are skipped, and the gradients still match.
START_TEST(test_cce_filtering_skips_tiles) {
    compare(0.3f, FLT_EPSILON, 1);
}
END_TEST

// One position, D = 1, h = 1, so the logits are W itself, over two tiles of
// the vocabulary (MOE_CCE_VB each); returns the tiles the backward skipped
// and leaves dW (the logits' gradient, dloss = 1).
static long one_position(const float *W, int V, int32_t target, float filter, float *dW) {
    const float h = 1.0f;
    float loss, lse, dh = 0;
    double mean;
    float *scratch = malloc(sizeof(float) * moe_cpu_cce_scratch_floats());
    ck_assert_int_eq(moe_cpu_cce_forward(&loss, &lse, &mean, &h, W, &target, 1, 1, V, scratch), 0);
    memset(dW, 0, sizeof(float) * (size_t)V);
    long skipped = 0;
    ck_assert_int_eq(moe_cpu_cce_backward(&dh, dW, &h, W, &target, &lse, 1, 1, V, 1.0f, filter,
                                          scratch, &skipped),
                     0);
    free(scratch);
    return skipped;
}

// A tile that holds the target is never skipped, however improbable its
// entries (CCE sec 4.3: only tiles with no target may go): the target is a
// rare word in the second tile, every probability there about e^-30 / VB,
// and its gradient p - 1 ~ -1 must arrive.
START_TEST(test_cce_filtering_keeps_the_target_tile) {
    enum { V2 = 2 * MOE_CCE_VB };
    float *W = calloc(V2, sizeof(float)), *dW = malloc(sizeof(float) * V2);
    for (int v = MOE_CCE_VB; v < V2; v++)
        W[v] = -30.0f;
    const int32_t t = MOE_CCE_VB + 100;
    ck_assert_int_eq(one_position(W, V2, t, FLT_EPSILON, dW), 0);
    ck_assert_float_eq_tol(dW[t], -1.0f, 1e-6);
    ck_assert_float_eq_tol(dW[0], 1.0f / MOE_CCE_VB, 1e-6); // p of the first tile
    free(W), free(dW);
}
END_TEST

// The filter skips a tile only when every probability in it is below
// filter_eps: one entry of the second tile at p = 1.5e-3 keeps the tile with
// filter_eps = 1e-3 (its gradient p arrives) and lets it go with 2e-3.
START_TEST(test_cce_filter_threshold_is_filter_eps) {
    enum { V2 = 2 * MOE_CCE_VB };
    float *W = calloc(V2, sizeof(float)), *dW = malloc(sizeof(float) * V2);
    for (int v = MOE_CCE_VB; v < V2; v++)
        W[v] = -100.0f; // p = 0 in float
    // p = e^l / (VB + e^l) = 1.5e-3
    const double el = 1.5e-3 * MOE_CCE_VB / (1 - 1.5e-3);
    const int hot = MOE_CCE_VB + 7;
    W[hot] = (float)log(el);
    const double p = exp((double)W[hot]) / (MOE_CCE_VB + exp((double)W[hot]));
    ck_assert(p > 1.4e-3 && p < 1.6e-3);
    ck_assert_int_eq(one_position(W, V2, 0, 1e-3f, dW), 0);
    ck_assert_float_eq_tol(dW[hot], p, 1e-7);
    ck_assert_int_eq(one_position(W, V2, 0, 2e-3f, dW), 1);
    ck_assert_float_eq(dW[hot], 0.0f);
    free(W), free(dW);
}
END_TEST

START_TEST(test_cce_rejects_bad_targets) {
    float h[4] = {0}, W[8] = {0}, losses[2], lse[2], scratch[MOE_CCE_NB * MOE_CCE_VB];
    int32_t bad[2] = {0, 4};
    double m;
    ck_assert_int_eq(moe_cpu_cce_forward(losses, lse, &m, h, W, bad, 2, 2, 4, scratch), MOE_EINVAL);
}
END_TEST

static Suite *cce_suite(void) {
    Suite *s = suite_create("cce");
    TCase *tc = tcase_create("cce");
    tcase_add_test(tc, test_cce_matches_plain_without_filtering);
    tcase_add_test(tc, test_cce_matches_plain_with_filtering);
    tcase_add_test(tc, test_cce_filtering_skips_tiles);
    tcase_add_test(tc, test_cce_filtering_keeps_the_target_tile);
    tcase_add_test(tc, test_cce_filter_threshold_is_filter_eps);
    tcase_add_test(tc, test_cce_rejects_bad_targets);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(cce_suite());
}
