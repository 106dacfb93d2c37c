// The token-choice router over the CPU thread pool: the same bits whether it
// runs spread over the pool or serially (a call made inside a pool task runs
// serially), for every scoring, slot order and choice rule; the one-pass top-k
// against repeated argmax on tied scores; and the parallel logit check naming
// the first bad logit.
#include "kernels/cpu/cpu.h"
#include "moe/error.h"
#include "moe/router.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { T = 1000, E = 64, K = 8 };

typedef struct {
    moe_plan plan;
    float *dlogits;
    const float *logits, *dweight;
    const moe_router_config *cfg;
    int rc;
} route_run;

static void route_task(void *ctx, int i) {
    route_run *r = ctx;
    if (i) return;
    r->rc = moe_router_forward(&r->plan, r->logits, NULL, NULL, T, E, r->cfg, true, 7);
    if (!r->rc) moe_router_backward(r->dlogits, r->dweight, &r->plan, r->cfg, 0.01f, 0.001f);
}

static void same_plans(const moe_plan *a, const moe_plan *b, const char *what) {
#define SAME(f, n)                                                                                 \
    ck_assert_msg(!memcmp(a->f, b->f, (n) * sizeof *a->f), "%s: " #f " differs", what)
    SAME(expert, T * K);
    SAME(choice, T * K);
    SAME(slot, T * K);
    SAME(weight, T * K);
    SAME(probs, T * E);
    SAME(softmax, T * E);
    SAME(lse, T);
    SAME(counts, E);
    SAME(kept, E);
    SAME(offsets, E + 1);
    SAME(aux_f, E);
    SAME(order, T);
#undef SAME
    ck_assert_msg(!memcmp(&a->aux_loss, &b->aux_loss, 4), "%s: aux_loss differs", what);
    ck_assert_msg(!memcmp(&a->z_loss, &b->z_loss, 4), "%s: z_loss differs", what);
}

// Pooled (two threads on a machine with two cores or more) against serial,
// over configurations that exercise every per-token branch and the serial
// cross-token sums; T = 1000 spans several token ranges.
START_TEST(test_router_same_bits_pooled_and_serial) {
    tu_rng g;
    tu_seed(&g, 19);
    float *logits = malloc(sizeof(float) * T * E), *dweight = malloc(sizeof(float) * T * K);
    float bias[E];
    tu_fill_normal(&g, logits, (size_t)T * E, 2.0f);
    tu_fill_normal(&g, dweight, (size_t)T * K, 1.0f);
    tu_fill_normal(&g, bias, E, 0.05f);
    for (int c = 0; c < 8; c++) {
        moe_router_config cfg;
        moe_router_config_default(&cfg);
        cfg.top_k = K;
        cfg.capacity_factor = c % 2 ? 0.0 : 1.0; // dropless, or drops
        cfg.score = c & 2 ? MOE_SCORE_SIGMOID : MOE_SCORE_SOFTMAX;
        cfg.slot_order = c & 4 ? MOE_SLOT_PRIORITY : MOE_SLOT_POSITION;
        cfg.normalize_topk = c != 3;
        cfg.aux_counts_all_k = c & 1;
        if (c == 5) cfg.n_groups = 8, cfg.topk_groups = 3;
        if (c == 6) cfg.noise = MOE_NOISE_GUMBEL;
        route_run r[2];
        for (int s = 0; s < 2; s++) {
            r[s] = (route_run){.logits = logits, .dweight = dweight, .cfg = &cfg};
            ck_assert_int_eq(moe_plan_alloc(&r[s].plan, T, E, K), 0);
            r[s].plan.bias = c >= 4 ? bias : NULL;
            r[s].dlogits = calloc((size_t)T * E, sizeof(float));
        }
        route_task(&r[0], 0);                       // over the pool
        moe_cpu_parallel_for(2, route_task, &r[1]); // serially, inside one task
        char what[32];
        snprintf(what, sizeof what, "config %d", c);
        ck_assert_msg(r[0].rc == 0 && r[1].rc == 0, "%s: %s", what, moe_last_error());
        same_plans(&r[0].plan, &r[1].plan, what);
        ck_assert_msg(!memcmp(r[0].dlogits, r[1].dlogits, sizeof(float) * T * E),
                      "%s: dlogits differ", what);
        for (int s = 0; s < 2; s++)
            moe_plan_free(&r[s].plan), free(r[s].dlogits);
    }
    free(logits), free(dweight);
}
END_TEST

// Integer logits tie many scores; choice j must be the j-th pass of argmax
// over the biased scores, ties to the lower expert.
START_TEST(test_topk_is_repeated_argmax_with_ties) {
    tu_rng g;
    tu_seed(&g, 5);
    float *logits = malloc(sizeof(float) * T * E), bias[E];
    for (int i = 0; i < T * E; i++)
        logits[i] = roundf(tu_normal(&g));
    for (int e = 0; e < E; e++)
        bias[e] = e % 3 ? 0.0f : 0.125f;
    for (int b = 0; b < 2; b++) {
        moe_router_config cfg;
        moe_router_config_default(&cfg);
        cfg.top_k = K;
        cfg.capacity_factor = 0.0;
        moe_plan pl;
        ck_assert_int_eq(moe_plan_alloc(&pl, T, E, K), 0);
        pl.bias = b ? bias : NULL;
        ck_assert_int_eq(moe_router_forward(&pl, logits, NULL, NULL, T, E, &cfg, false, 0), 0);
        for (int t = 0; t < T; t++) {
            unsigned char taken[E];
            memset(taken, 0, sizeof taken);
            for (int j = 0; j < K; j++) {
                int best = -1;
                double best_s = 0.0;
                for (int e = 0; e < E; e++) {
                    double s = (double)pl.probs[(size_t)t * E + e] + (b ? bias[e] : 0.0f);
                    if (!taken[e] && (best < 0 || s > best_s)) best = e, best_s = s;
                }
                taken[best] = 1;
                ck_assert_msg(pl.choice[(size_t)t * K + j] == best,
                              "bias %d token %d choice %d: expert %d, want %d", b, t, j,
                              pl.choice[(size_t)t * K + j], best);
            }
        }
        moe_plan_free(&pl);
    }
    free(logits);
}
END_TEST

// Bad logits in two token ranges of the parallel check: the message names
// the first in token order.
START_TEST(test_check_logits_names_the_first_bad_logit) {
    enum { TL = 4096 };
    float *logits = calloc((size_t)TL * E, sizeof(float));
    logits[(size_t)3000 * E + 9] = INFINITY;
    logits[(size_t)1234 * E + 17] = NAN;
    moe_router_config cfg;
    moe_router_config_default(&cfg);
    cfg.top_k = K;
    moe_plan pl;
    ck_assert_int_eq(moe_plan_alloc(&pl, TL, E, K), 0);
    ck_assert_int_eq(moe_router_forward(&pl, logits, NULL, NULL, TL, E, &cfg, false, 0),
                     MOE_ENUMERIC);
    ck_assert_msg(strstr(moe_last_error(), "token 1234, expert 17"), "%s", moe_last_error());
    logits[(size_t)1234 * E + 17] = 0.0f;
    ck_assert_int_eq(moe_router_forward(&pl, logits, NULL, NULL, TL, E, &cfg, false, 0),
                     MOE_ENUMERIC);
    ck_assert_msg(strstr(moe_last_error(), "token 3000, expert 9"), "%s", moe_last_error());
    moe_plan_free(&pl);
    free(logits);
}
END_TEST

int main(void) {
    Suite *s = suite_create("router_threads");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_router_same_bits_pooled_and_serial);
    tcase_add_test(tc, test_topk_is_repeated_argmax_with_ties);
    tcase_add_test(tc, test_check_logits_names_the_first_bad_logit);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
