// Dynamic capacity: the EMA controller moves C_e to the measured load and,
// at the same total slot budget, drops fewer tokens than a static capacity.
#include "moe/error.h"
#include "moe/router.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

enum { T = 256, E = 8, K = 2, STEPS = 60 };

// Skewed synthetic router: expert e is favoured with weight w_e.
static void skewed_logits(tu_rng *r, float *logits) {
    static const float w[E] = {8, 4, 2, 1, 1, 1, 1, 1};
    for (int t = 0; t < T; t++)
        for (int e = 0; e < E; e++)
            logits[t * E + e] = 2.0f * logf(w[e]) + tu_normal(r);
}

static long drops_with(moe_plan *pl, const float *logits, const int *cap,
                       const moe_router_config *c) {
    ck_assert_int_eq(moe_router_forward(pl, logits, NULL, cap, T, E, c, false, 0), 0);
    moe_load_stats st;
    moe_plan_stats(pl, &st);
    return st.dropped;
}

START_TEST(test_dynamic_capacity_tracks_load_and_cuts_drops) {
    moe_router_config c;
    moe_router_config_default(&c);
    c.top_k = K;
    c.capacity_factor = 1.0;
    c.capacity_mode = MOE_CAPACITY_DYNAMIC;
    c.ema = 0.8;
    c.headroom = 0.1;
    c.capacity_factor_max = 4.0;
    moe_capacity_ctl ctl;
    ck_assert_int_eq(moe_capacity_ctl_init(&ctl, &c, T, E), 0);
    for (int e = 0; e < E; e++)
        ck_assert_int_eq(ctl.capacity[e], 64); // static start
    moe_plan pl;
    ck_assert_int_eq(moe_plan_alloc(&pl, T, E, K), 0);
    tu_rng r;
    tu_seed(&r, 11);
    float *logits = malloc(sizeof(float) * T * E * STEPS);
    double mean[E] = {0};
    for (int s = 0; s < STEPS; s++) {
        float *x = logits + (size_t)s * T * E;
        skewed_logits(&r, x);
        ck_assert_int_eq(moe_router_forward(&pl, x, NULL, ctl.capacity, T, E, &c, true, s), 0);
        for (int e = 0; e < E; e++) {
            ck_assert_int_eq(pl.capacity[e], ctl.capacity[e]);
            if (s >= STEPS / 2) mean[e] += pl.counts[e] / (double)(STEPS / 2);
        }
        moe_capacity_ctl_update(&ctl, &c, pl.counts, T);
    }
    // C_e follows the measured load (with headroom), hot and cold experts alike
    ck_assert(mean[0] > 2 * mean[7]);
    long budget = 0;
    for (int e = 0; e < E; e++) {
        double want = mean[e] * (1 + c.headroom);
        ck_assert_msg(fabs(ctl.capacity[e] - want) <= 0.15 * want + 2,
                      "expert %d: C_e = %d, measured load*(1+h) = %.1f", e, ctl.capacity[e], want);
        budget += ctl.capacity[e];
    }
    // Same total budget spread evenly (static): many more drops.
    int flat[E];
    for (int e = 0; e < E; e++)
        flat[e] = (int)(budget / E);
    long d_dyn = 0, d_static = 0;
    for (int s = STEPS / 2; s < STEPS; s++) {
        const float *x = logits + (size_t)s * T * E;
        d_dyn += drops_with(&pl, x, ctl.capacity, &c);
        d_static += drops_with(&pl, x, flat, &c);
    }
    printf("dynamic capacity: %ld drops vs %ld static at the same budget of %ld slots\n", d_dyn,
           d_static, budget);
    ck_assert_msg(d_dyn * 4 < d_static, "drops dynamic %ld vs static %ld at budget %ld", d_dyn,
                  d_static, budget);
    free(logits);
    moe_plan_free(&pl);
    moe_capacity_ctl_free(&ctl);
}
END_TEST

START_TEST(test_capacity_clamps_and_update_period) {
    moe_router_config c;
    moe_router_config_default(&c);
    c.top_k = 2;
    c.capacity_factor = 1.0;
    c.capacity_mode = MOE_CAPACITY_DYNAMIC;
    c.min_capacity = 5;
    c.capacity_factor_max = 1.5; // hi = ceil(2*40/4 * 1.5) = 30
    c.headroom = 0.0;
    c.ema = 0.5;
    c.update_every = 3;
    moe_capacity_ctl ctl;
    ck_assert_int_eq(moe_capacity_ctl_init(&ctl, &c, 40, 4), 0);
    const int counts[4] = {60, 20, 0, 0};
    moe_capacity_ctl_update(&ctl, &c, counts, 40);
    moe_capacity_ctl_update(&ctl, &c, counts, 40);
    for (int e = 0; e < 4; e++)
        ck_assert_int_eq(ctl.capacity[e], 20); // not yet
    moe_capacity_ctl_update(&ctl, &c, counts, 40);
    ck_assert_int_eq(ctl.capacity[0], 30); // 60 clamped to the cf_max bound
    ck_assert_int_eq(ctl.capacity[1], 20);
    ck_assert_int_eq(ctl.capacity[2], 5); // min_capacity
    // EMA: the first measurement seeds m_e, later ones blend with weight ema
    const int c2[4] = {0, 10, 0, 0};
    moe_capacity_ctl_update(&ctl, &c, c2, 40);
    ck_assert(fabs(ctl.ema[1] - 15.0) < 1e-12);
    moe_capacity_ctl_free(&ctl);

    c.capacity_factor = 0; // dropless has no capacity to adapt
    ck_assert_int_eq(moe_capacity_ctl_init(&ctl, &c, 40, 4), MOE_EINVAL);
}
END_TEST

// The controller's arithmetic by hand. k = 2, T = 40, E = 4: hi =
// ceil(2*40/4 * 4) = 80. headroom 0.25, ema 0.75.
// Step 1, loads (30, 10, 25, 15), seed m = the loads:
//   C = ceil(m * 1.25) = ceil(37.5, 12.5, 31.25, 18.75) = (38, 13, 32, 19)
//   (from the uniform guess 20 instead, m_0 = 22.5 and C_0 = 29; without the
//   headroom C = m; with floor instead of ceil C = (37, 12, 31, 18)).
// Step 2, loads (10, 30, 25, 15): m = .75 m + .25 load = (25, 15, 25, 15),
//   C = (32, 19, 32, 19) (the weights swapped give m_0 = 15).
START_TEST(test_dynamic_capacity_by_hand) {
    moe_router_config c;
    moe_router_config_default(&c);
    c.top_k = 2;
    c.capacity_factor = 1.0;
    c.capacity_mode = MOE_CAPACITY_DYNAMIC;
    c.min_capacity = 1;
    c.capacity_factor_max = 4.0;
    c.headroom = 0.25;
    c.ema = 0.75;
    moe_capacity_ctl ctl;
    ck_assert_int_eq(moe_capacity_ctl_init(&ctl, &c, 40, 4), 0);
    const int l1[4] = {30, 10, 25, 15}, c1[4] = {38, 13, 32, 19};
    moe_capacity_ctl_update(&ctl, &c, l1, 40);
    for (int e = 0; e < 4; e++) {
        ck_assert(ctl.ema[e] == l1[e]);
        ck_assert_int_eq(ctl.capacity[e], c1[e]);
    }
    const int l2[4] = {10, 30, 25, 15}, c2[4] = {32, 19, 32, 19};
    const double m2[4] = {25, 15, 25, 15};
    moe_capacity_ctl_update(&ctl, &c, l2, 40);
    for (int e = 0; e < 4; e++) {
        ck_assert(fabs(ctl.ema[e] - m2[e]) < 1e-12);
        ck_assert_int_eq(ctl.capacity[e], c2[e]);
    }
    moe_capacity_ctl_free(&ctl);
}
END_TEST

// min_capacity above the cf_max bound (hi = ceil(2*40/4 * 1) = 20 < 50): C_e
// never goes below min_capacity, as the static C = max(min_capacity, ...) does;
// a hot expert gets min_capacity too, not the lower bound 20.
START_TEST(test_dynamic_capacity_min_capacity_above_upper_bound) {
    moe_router_config c;
    moe_router_config_default(&c);
    c.top_k = 2;
    c.capacity_factor = 1.0;
    c.capacity_mode = MOE_CAPACITY_DYNAMIC;
    c.min_capacity = 50;
    c.capacity_factor_max = 1.0;
    c.headroom = 0.0;
    moe_capacity_ctl ctl;
    ck_assert_int_eq(moe_capacity_ctl_init(&ctl, &c, 40, 4), 0);
    const int counts[4] = {60, 20, 0, 0};
    moe_capacity_ctl_update(&ctl, &c, counts, 40);
    for (int e = 0; e < 4; e++)
        ck_assert_int_eq(ctl.capacity[e], 50);
    moe_capacity_ctl_free(&ctl);
}
END_TEST

static Suite *capacity_suite(void) {
    Suite *s = suite_create("capacity");
    TCase *tc = tcase_create("dynamic");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_dynamic_capacity_tracks_load_and_cuts_drops);
    tcase_add_test(tc, test_capacity_clamps_and_update_period);
    tcase_add_test(tc, test_dynamic_capacity_by_hand);
    tcase_add_test(tc, test_dynamic_capacity_min_capacity_above_upper_bound);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(capacity_suite());
}
