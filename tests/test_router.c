// Router semantics: hand-computed cases for each mode, invariants on random
// inputs, and central-difference gradient checks of the backward pass.
#include "moe/error.h"
#include "moe/router.h"
#include "router/internal.h"
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static moe_router_config cfg_k(int k, double cf, int min_cap) {
    moe_router_config c;
    moe_router_config_default(&c);
    c.top_k = k;
    c.capacity_factor = cf;
    c.min_capacity = min_cap;
    return c;
}

static void route(moe_plan *plan, const float *logits, const int *task, int T, int E,
                  const moe_router_config *c) {
    ck_assert_int_eq(moe_plan_alloc(plan, T, E, c->top_k), 0);
    int rc = moe_router_forward(plan, logits, task, NULL, T, E, c, false, 0);
    ck_assert_msg(rc == 0, "route failed: %s", moe_last_error());
}

// Four tokens all prefer expert 0, capacity 2. Position keeps the first two
// tokens; priority keeps the two most confident ones (t2, t3).
START_TEST(test_position_vs_priority_drop_different_tokens) {
    const float logits[] = {0.1f, 0, 0.2f, 0, 3.0f, 0, 2.0f, 0};
    moe_router_config c = cfg_k(1, 1.0, 0);
    moe_plan pl;
    route(&pl, logits, NULL, 4, 2, &c);
    ck_assert_int_eq(pl.capacity[0], 2);
    int want_pos[] = {0, 0, -1, -1}, want_slot[] = {0, 1, -1, -1};
    for (int t = 0; t < 4; t++) {
        ck_assert_int_eq(pl.expert[t], want_pos[t]);
        ck_assert_int_eq(pl.slot[t], want_slot[t]);
    }
    moe_plan_free(&pl);

    c.slot_order = MOE_SLOT_PRIORITY;
    route(&pl, logits, NULL, 4, 2, &c);
    int want_pri[] = {-1, -1, 0, 0}, want_pslot[] = {-1, -1, 0, 1};
    for (int t = 0; t < 4; t++) {
        ck_assert_int_eq(pl.expert[t], want_pri[t]);
        ck_assert_int_eq(pl.slot[t], want_pslot[t]);
        // top-1 with normalize_topk: kept weight 1, dropped 0
        ck_assert_float_eq(pl.weight[t], want_pri[t] < 0 ? 0.0f : 1.0f);
    }
    ck_assert_int_eq(pl.counts[0], 4);
    ck_assert_int_eq(pl.kept[0], 2);
    moe_plan_free(&pl);
}
END_TEST

// Task priorities outrank confidence: task 1 (priority 2) keeps its tokens
// t1, t3 (t3 first: more confident), task 0 (priority 1) loses both.
START_TEST(test_priority_task_priority_first) {
    const float logits[] = {0.1f, 0, 0.2f, 0, 3.0f, 0, 2.0f, 0};
    const int task[] = {0, 1, 0, 1};
    moe_router_config c = cfg_k(1, 1.0, 0);
    c.slot_order = MOE_SLOT_PRIORITY;
    c.n_task_priority = 2;
    c.task_priority[0] = 1;
    c.task_priority[1] = 2;
    moe_plan pl;
    route(&pl, logits, task, 4, 2, &c);
    int want_e[] = {-1, 0, -1, 0}, want_s[] = {-1, 1, -1, 0};
    for (int t = 0; t < 4; t++) {
        ck_assert_int_eq(pl.expert[t], want_e[t]);
        ck_assert_int_eq(pl.slot[t], want_s[t]);
    }
    // a task id with no priority entry is an error, not a silent 0
    const int bad[] = {0, 1, 2, 0};
    ck_assert_int_eq(moe_router_forward(&pl, logits, bad, NULL, 4, 2, &c, false, 0), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "task id 2"));
    // priorities set but no task ids: an error, not a read through NULL
    ck_assert_int_eq(moe_router_forward(&pl, logits, NULL, NULL, 4, 2, &c, false, 0), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "no task ids"));
    moe_plan_free(&pl);
}
END_TEST

// Top-2, three experts, capacity 2. All first choices are placed before any
// second choice (GShard order). Position drops t2's first choice, priority
// (t2 most confident) drops t1's.
START_TEST(test_top2_first_choices_before_second) {
    const float logits[] = {3, 2, 0, 3, 0, 2, 4, 2, 0};
    moe_router_config c = cfg_k(2, 1.0, 0);
    moe_plan pl;
    route(&pl, logits, NULL, 3, 3, &c);
    int want_e[] = {0, 1, 0, 2, -1, 1}, want_s[] = {0, 0, 1, 0, -1, 1};
    for (int a = 0; a < 6; a++) {
        ck_assert_int_eq(pl.expert[a], want_e[a]);
        ck_assert_int_eq(pl.slot[a], want_s[a]);
    }
    int want_counts[] = {3, 2, 1}, want_kept[] = {2, 2, 1}, want_off[] = {0, 2, 4, 5};
    for (int e = 0; e < 3; e++) {
        ck_assert_int_eq(pl.counts[e], want_counts[e]);
        ck_assert_int_eq(pl.kept[e], want_kept[e]);
    }
    for (int e = 0; e < 4; e++)
        ck_assert_int_eq(pl.offsets[e], want_off[e]);
    // t2 lost its first choice: its only kept choice gets weight 1
    ck_assert_float_eq(pl.weight[4], 0.0f);
    ck_assert_float_eq_tol(pl.weight[5], 1.0f, 1e-7);
    // t0 keeps both: weights p0/(p0+p1) = e^3/(e^3+e^2)
    ck_assert_float_eq_tol(pl.weight[0], (float)(exp(3) / (exp(3) + exp(2))), 1e-6);
    moe_plan_free(&pl);

    c.slot_order = MOE_SLOT_PRIORITY;
    route(&pl, logits, NULL, 3, 3, &c);
    int want_pe[] = {0, 1, -1, 2, 0, 1}, want_ps[] = {1, 1, -1, 0, 0, 0};
    for (int a = 0; a < 6; a++) {
        ck_assert_int_eq(pl.expert[a], want_pe[a]);
        ck_assert_int_eq(pl.slot[a], want_ps[a]);
    }
    moe_plan_free(&pl);
}
END_TEST

START_TEST(test_capacity_formula) {
    moe_router_config c = cfg_k(2, 1.25, 0);
    ck_assert_int_eq(moe_capacity_static(&c, 10, 4), 7); // ceil(6.25)
    c.min_capacity = 8;
    ck_assert_int_eq(moe_capacity_static(&c, 10, 4), 8); // min_capacity wins
    c = cfg_k(1, 1.1, 0);
    ck_assert_int_eq(moe_capacity_static(&c, 20, 2), 11);
    // k*T*cf/E = 2*25*1.1/5 is 11.000000000000002 in double: the ceiling
    // ignores the representation error (a plain ceil gives 12)
    c = cfg_k(2, 1.1, 0);
    ck_assert_int_eq(moe_capacity_static(&c, 25, 5), 11);
    c = cfg_k(2, 1.0, 4);
    ck_assert_int_eq(moe_capacity_static(&c, 2, 8), 4); // T < min_capacity
    c = cfg_k(2, 0.0, 4);
    ck_assert_int_eq(moe_capacity_static(&c, 100, 8), -1); // dropless
    c = cfg_k(2, 1e12, 4);
    ck_assert_int_eq(moe_capacity_static(&c, 8, 4), 2147483647); // saturates, never wraps
}
END_TEST

// Dropless: capacity is the largest count, nothing is dropped even when every
// token picks the same expert.
START_TEST(test_dropless_keeps_everything) {
    enum { T = 9, E = 3 };
    float logits[T * E];
    for (int t = 0; t < T; t++) {
        logits[t * E] = 5;
        logits[t * E + 1] = (float)t * 0.1f;
        logits[t * E + 2] = 0;
    }
    moe_router_config c = cfg_k(2, 0.0, 4);
    moe_plan pl;
    route(&pl, logits, NULL, T, E, &c);
    for (int e = 0; e < E; e++) {
        ck_assert_int_eq(pl.capacity[e], 9);
        ck_assert_int_eq(pl.kept[e], pl.counts[e]);
    }
    for (int a = 0; a < T * 2; a++)
        ck_assert_int_ge(pl.expert[a], 0);
    moe_plan_free(&pl);
}
END_TEST

// Switch top-1: normalize_topk=false keeps the raw probability.
START_TEST(test_top1_raw_probability) {
    const float logits[] = {1, 0, 0, 2};
    moe_router_config c = cfg_k(1, 2.0, 0);
    c.normalize_topk = false;
    moe_plan pl;
    route(&pl, logits, NULL, 2, 2, &c);
    float p = (float)(exp(1) / (exp(1) + 1));
    ck_assert_int_eq(pl.expert[0], 0);
    ck_assert_float_eq_tol(pl.weight[0], p, 1e-6);
    ck_assert_int_eq(pl.expert[1], 1);
    ck_assert_float_eq_tol(pl.weight[1], (float)(exp(2) / (exp(2) + 1)), 1e-6);
    moe_plan_free(&pl);
}
END_TEST

START_TEST(test_ties_go_to_lower_expert) {
    const float logits[] = {0, 0, 0, 0, 1, 2, 2, 0, 7, 7, 7, 7};
    moe_router_config c = cfg_k(2, 0.0, 0);
    moe_plan pl;
    route(&pl, logits, NULL, 3, 4, &c);
    int want[] = {0, 1, 1, 2, 0, 1};
    for (int a = 0; a < 6; a++)
        ck_assert_int_eq(pl.choice[a], want[a]);
    // equal probabilities: both weights 1/2
    ck_assert_float_eq_tol(pl.weight[0], 0.5f, 1e-7);
    moe_plan_free(&pl);
}
END_TEST

// T=2, E=2, k=1: p = (1/2, 1/2) and (3/4, 1/4); both pick expert 0.
// aux = 2 * (1 * 0.625 + 0 * 0.375) = 1.25; all-k (k=2): 2 * (1*0.625 +
// 1*0.375) = 2; z = (ln^2 2 + ln^2 4) / 2.
START_TEST(test_aux_and_z_loss_values) {
    const float logits[] = {0, 0, (float)log(3.0), 0};
    moe_router_config c = cfg_k(1, 2.0, 0);
    moe_plan pl;
    route(&pl, logits, NULL, 2, 2, &c);
    ck_assert_float_eq_tol(pl.aux_loss, 1.25f, 1e-6);
    double ln2 = log(2.0), ln4 = log(4.0);
    ck_assert_float_eq_tol(pl.z_loss, (float)((ln2 * ln2 + ln4 * ln4) / 2), 1e-6);
    moe_plan_free(&pl);

    c = cfg_k(2, 2.0, 0);
    c.aux_counts_all_k = true;
    route(&pl, logits, NULL, 2, 2, &c);
    ck_assert_float_eq_tol(pl.aux_loss, 2.0f, 1e-6);
    c.aux_counts_all_k = false;
    ck_assert_int_eq(moe_router_forward(&pl, logits, NULL, NULL, 2, 2, &c, false, 0), 0);
    ck_assert_float_eq_tol(pl.aux_loss, 1.25f, 1e-6);
    moe_plan_free(&pl);
}
END_TEST

// f_e counts choices before dropping (DESIGN "Router semantics"). Four tokens
// with p = (3/4, 1/4) all pick expert 0, C = 2 keeps two: f = (1, 0) and
// aux = 2 * (1 * 3/4 + 0 * 1/4) = 1.5. Counting the kept choices instead
// (f = (1/2, 0)) would give 0.75.
START_TEST(test_aux_loss_counts_choices_before_dropping) {
    const float l3 = (float)log(3.0);
    const float logits[] = {l3, 0, l3, 0, l3, 0, l3, 0};
    moe_router_config c = cfg_k(1, 1.0, 0);
    moe_plan pl;
    route(&pl, logits, NULL, 4, 2, &c);
    ck_assert_int_eq(pl.counts[0], 4);
    ck_assert_int_eq(pl.kept[0], 2);
    ck_assert_float_eq_tol(pl.aux_loss, 1.5f, 1e-6);
    // all-k: the dropped second choices (expert 1) count too: f = (1, 1), aux = 2
    c = cfg_k(2, 0.5, 0); // C = ceil(2*4/2 * 0.5) = 2 for both experts
    c.aux_counts_all_k = true;
    moe_plan_free(&pl);
    route(&pl, logits, NULL, 4, 2, &c);
    ck_assert_int_eq(pl.kept[0] + pl.kept[1], 4);
    ck_assert_float_eq_tol(pl.aux_loss, 2.0f, 1e-6);
    moe_plan_free(&pl);
}
END_TEST

// Priority order with two tokens (the smallest batch with an order to sort):
// both pick expert 0, C = ceil(1*2/2 * 0.5) = 1; the more confident t1 keeps it.
START_TEST(test_priority_order_with_two_tokens) {
    const float logits[] = {0.1f, 0, 3.0f, 0};
    moe_router_config c = cfg_k(1, 0.5, 0);
    c.slot_order = MOE_SLOT_PRIORITY;
    moe_plan pl;
    route(&pl, logits, NULL, 2, 2, &c);
    ck_assert_int_eq(pl.capacity[0], 1);
    ck_assert_int_eq(pl.expert[0], -1);
    ck_assert_int_eq(pl.expert[1], 0);
    ck_assert_int_eq(pl.slot[1], 0);
    moe_plan_free(&pl);
}
END_TEST

// Load statistics of the top-2 plan of test_top2_first_choices_before_second
// (position order): counts (3, 2, 1), kept (2, 2, 1), C = 2 each. Drop rate
// is over the assigned choices, padding over the capacity:
// dropped 1 of 6 assigned, 1 empty slot of 6.
START_TEST(test_plan_stats_by_hand) {
    const float logits[] = {3, 2, 0, 3, 0, 2, 4, 2, 0};
    moe_router_config c = cfg_k(2, 1.0, 0);
    moe_plan pl;
    route(&pl, logits, NULL, 3, 3, &c);
    moe_load_stats st;
    moe_plan_stats(&pl, &st);
    ck_assert_int_eq(st.assigned, 6);
    ck_assert_int_eq(st.kept, 5);
    ck_assert_int_eq(st.dropped, 1);
    ck_assert_int_eq(st.capacity, 6);
    ck_assert_int_eq(st.max_count, 3);
    ck_assert_int_eq(st.min_count, 1);
    ck_assert_double_eq_tol(st.drop_rate, 1.0 / 6, 1e-12);
    ck_assert_double_eq_tol(st.padding, 1.0 / 6, 1e-12);
    // min_capacity 4: C = 4, nothing dropped, 12 - 6 = 6 of 12 slots empty
    c.min_capacity = 4;
    ck_assert_int_eq(moe_router_forward(&pl, logits, NULL, NULL, 3, 3, &c, false, 0), 0);
    moe_plan_stats(&pl, &st);
    ck_assert_int_eq(st.dropped, 0);
    ck_assert_double_eq_tol(st.drop_rate, 0.0, 1e-12);
    ck_assert_double_eq_tol(st.padding, 0.5, 1e-12);
    moe_plan_free(&pl);
}
END_TEST

// plan.usable (inference under an expert budget): a left-out expert is never
// chosen, with or without Gumbel noise. Logits (0, 3, 1, 2) with expert 1 left
// out: choices 3, 2 and weights e^2 / (e^2 + e) and e / (e^2 + e).
START_TEST(test_usable_experts_only_are_chosen) {
    enum { T = 32, E = 4 };
    float logits[T * E];
    for (int t = 0; t < T; t++) {
        logits[t * E] = 0, logits[t * E + 1] = 3, logits[t * E + 2] = 1, logits[t * E + 3] = 2;
    }
    const bool usable[E] = {true, false, true, true};
    moe_router_config c = cfg_k(2, 0.0, 0);
    moe_plan pl;
    ck_assert_int_eq(moe_plan_alloc(&pl, T, E, 2), 0);
    pl.usable = usable;
    ck_assert_int_eq(moe_router_forward(&pl, logits, NULL, NULL, T, E, &c, false, 0), 0);
    ck_assert_int_eq(pl.choice[0], 3);
    ck_assert_int_eq(pl.choice[1], 2);
    double e1 = exp(1.0), e2 = exp(2.0);
    ck_assert_float_eq_tol(pl.weight[0], (float)(e2 / (e2 + e1)), 1e-6);
    ck_assert_float_eq_tol(pl.weight[1], (float)(e1 / (e2 + e1)), 1e-6);
    // Gumbel second choices: over the usable experts other than the first
    c.noise = MOE_NOISE_GUMBEL;
    for (uint64_t step = 0; step < 4; step++) {
        ck_assert_int_eq(moe_router_forward(&pl, logits, NULL, NULL, T, E, &c, true, step), 0);
        for (int a = 0; a < T * 2; a++)
            ck_assert_int_ne(pl.choice[a], 1);
    }
    moe_plan_free(&pl);
}
END_TEST

// The defaults DESIGN "Router config keys" documents, key by key.
START_TEST(test_config_defaults_as_documented) {
    moe_router_config c;
    moe_router_config_default(&c);
    ck_assert_int_eq(c.top_k, 2);
    ck_assert(c.capacity_factor == 1.25);
    ck_assert_int_eq(c.min_capacity, 4);
    ck_assert_int_eq(c.slot_order, MOE_SLOT_POSITION);
    ck_assert(c.normalize_topk);
    ck_assert_int_eq(c.noise, MOE_NOISE_NONE);
    ck_assert(c.noise_eps == 0.01);
    ck_assert(c.aux_loss_coef == 0.01);
    ck_assert(c.z_loss_coef == 0.001);
    ck_assert(!c.aux_counts_all_k);
    ck_assert_int_eq(c.n_task_priority, 0);
    ck_assert(c.seed == 0);
    ck_assert_int_eq(c.capacity_mode, MOE_CAPACITY_STATIC);
    ck_assert(c.ema == 0.9);
    ck_assert(c.headroom == 0.1);
    ck_assert_int_eq(c.update_every, 1);
    ck_assert(c.capacity_factor_max == 2.0);
    ck_assert_int_eq(c.score, MOE_SCORE_SOFTMAX);
    ck_assert(c.route_scale == 1.0);
    ck_assert_int_eq(c.type, MOE_ROUTER_TOKEN_CHOICE);
    ck_assert_int_eq(moe_router_config_check(&c, 8), 0);
}
END_TEST

START_TEST(test_nan_logit_rejected) {
    float logits[] = {0, 1, 2, NAN, 0, 0};
    moe_router_config c = cfg_k(1, 1.0, 0);
    moe_plan pl;
    ck_assert_int_eq(moe_plan_alloc(&pl, 3, 2, 1), 0);
    ck_assert_int_eq(moe_router_forward(&pl, logits, NULL, NULL, 3, 2, &c, false, 0), MOE_ENUMERIC);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "token 1, expert 1"));
    moe_plan_free(&pl);
}
END_TEST

START_TEST(test_config_set_and_check) {
    moe_router_config c;
    moe_router_config_default(&c);
    ck_assert_int_eq(moe_router_config_set(&c, "router.top_k", "3"), 0);
    ck_assert_int_eq(c.top_k, 3);
    ck_assert_int_eq(moe_router_config_set(&c, "router.slot_order", "priority"), 0);
    ck_assert_int_eq(c.slot_order, MOE_SLOT_PRIORITY);
    ck_assert_int_eq(moe_router_config_set(&c, "router.task_priority", "3,1.5,2"), 0);
    ck_assert_int_eq(c.n_task_priority, 3);
    ck_assert(c.task_priority[1] == 1.5);
    ck_assert_int_eq(moe_router_config_set(&c, "capacity.mode", "dynamic"), 0);
    ck_assert_int_eq(moe_router_config_set(&c, "router.top_kk", "3"), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "router.top_kk"));
    ck_assert_int_eq(moe_router_config_set(&c, "router.top_k", "two"), MOE_EINVAL);
    ck_assert_int_eq(moe_router_config_set(&c, "router.noise", "loud"), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "none | jitter | gumbel"));
    ck_assert_int_eq(moe_router_config_set(&c, "router.task_priority", "1,2,"), MOE_EINVAL);
    ck_assert_int_eq(moe_router_config_set(&c, "router.normalize_topk", "maybe"), MOE_EINVAL);
    ck_assert_int_eq(moe_router_config_check(&c, 8), 0);
    ck_assert_int_eq(moe_router_config_check(&c, 2), MOE_EINVAL); // top_k 3 > 2
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "router.top_k = 3"));
    ck_assert_int_eq(moe_router_config_set(&c, "router.capacity_factor", "0"), 0);
    ck_assert_int_eq(moe_router_config_check(&c, 8), MOE_EINVAL); // dynamic + dropless
}
END_TEST

// Position order hands out slots by token index and never reads task
// priorities: the router's own check refuses the pair, so every caller (the
// run config, moe route, the library) refuses it with one message.
START_TEST(test_config_check_refuses_task_priorities_under_position_order) {
    moe_router_config c;
    moe_router_config_default(&c);
    ck_assert_int_eq(moe_router_config_set(&c, "router.task_priority", "1,2"), 0);
    ck_assert_int_eq(c.slot_order, MOE_SLOT_POSITION); // the default
    ck_assert_int_eq(moe_router_config_check(&c, 4), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "router.task_priority is set with "
                                           "router.slot_order = position") != NULL,
                  "%s", moe_last_error());
    ck_assert_int_eq(moe_router_config_set(&c, "router.slot_order", "priority"), 0);
    ck_assert_msg(moe_router_config_check(&c, 4) == 0, "%s", moe_last_error());
    // position order without priorities is the default and passes
    ck_assert_int_eq(moe_router_config_set(&c, "router.slot_order", "position"), 0);
    ck_assert_int_eq(moe_router_config_set(&c, "router.task_priority", "[]"), 0);
    ck_assert_msg(moe_router_config_check(&c, 4) == 0, "%s", moe_last_error());
}
END_TEST

// Properties that must hold for any input, over many random configurations.
START_TEST(test_invariants_random) {
    tu_rng r;
    tu_seed(&r, 42);
    for (int iter = 0; iter < 300; iter++) {
        int E = 1 + (int)(tu_uniform(&r) * 12);
        int k = 1 + (int)(tu_uniform(&r) * E);
        int T = (int)(tu_uniform(&r) * 40);
        moe_router_config c = cfg_k(k, tu_uniform(&r) < 0.2f ? 0.0 : 0.25 + 2 * tu_uniform(&r),
                                    (int)(tu_uniform(&r) * 5));
        c.slot_order = tu_uniform(&r) < 0.5f ? MOE_SLOT_POSITION : MOE_SLOT_PRIORITY;
        c.normalize_topk = tu_uniform(&r) < 0.7f;
        c.noise = tu_uniform(&r) < 0.3f ? MOE_NOISE_GUMBEL : MOE_NOISE_NONE;
        float *logits = malloc(sizeof(float) * (T * E + 1));
        tu_fill_normal(&r, logits, (size_t)T * E, 2.0f);
        // a skewed expert makes overflow common
        for (int t = 0; t < T; t++)
            logits[t * E] += 1.5f;
        moe_plan pl;
        ck_assert_int_eq(moe_plan_alloc(&pl, T, E, k), 0);
        ck_assert_int_eq(moe_router_forward(&pl, logits, NULL, NULL, T, E, &c, true, iter), 0);

        int *seen = calloc((size_t)E * (2 * T * k + 1), sizeof(int));
        int *cnt = calloc(E, sizeof(int)), *kept = calloc(E, sizeof(int));
        for (int t = 0; t < T; t++) {
            double wsum = 0;
            int any = 0;
            // choice 0 is the argmax of p (lowest index among ties)
            const float *p = pl.probs + (size_t)t * E;
            int am = 0;
            for (int e = 1; e < E; e++)
                if (p[e] > p[am]) am = e;
            ck_assert_int_eq(pl.choice[t * k], am);
            for (int j = 0; j < k; j++) {
                int a = t * k + j, ch = pl.choice[a], e = pl.expert[a];
                for (int i = 0; i < j; i++)
                    ck_assert_int_ne(pl.choice[t * k + i], ch);
                cnt[ch]++;
                if (e < 0) {
                    ck_assert_int_eq(pl.slot[a], -1);
                    ck_assert_float_eq(pl.weight[a], 0.0f);
                    continue;
                }
                ck_assert_int_eq(e, ch);
                ck_assert_int_ge(pl.slot[a], 0);
                ck_assert_int_lt(pl.slot[a], pl.capacity[e]);
                ck_assert_int_eq(seen[(size_t)e * (2 * T * k + 1) + pl.slot[a]]++, 0);
                kept[e]++;
                wsum += pl.weight[a];
                any = 1;
            }
            if (c.normalize_topk && any) ck_assert_double_eq_tol(wsum, 1.0, 1e-5);
        }
        int off = 0;
        for (int e = 0; e < E; e++) {
            ck_assert_int_eq(cnt[e], pl.counts[e]);
            ck_assert_int_eq(kept[e], pl.kept[e]);
            ck_assert_int_le(pl.kept[e], pl.capacity[e]);
            // an expert drops only when it is full
            if (pl.kept[e] < pl.counts[e]) ck_assert_int_eq(pl.kept[e], pl.capacity[e]);
            ck_assert_int_eq(pl.offsets[e], off);
            off += pl.kept[e];
            if (c.capacity_factor <= 0) ck_assert_int_eq(pl.kept[e], pl.counts[e]);
        }
        ck_assert_int_eq(pl.offsets[E], off);
        moe_load_stats st;
        moe_plan_stats(&pl, &st);
        ck_assert_int_eq(st.assigned, (long)T * k);
        ck_assert_int_eq(st.kept, off);
        free(seen);
        free(cnt);
        free(kept);
        free(logits);
        moe_plan_free(&pl);
    }
}
END_TEST

START_TEST(test_noise_is_seeded) {
    enum { T = 64, E = 8 };
    tu_rng r;
    tu_seed(&r, 7);
    float logits[T * E];
    tu_fill_normal(&r, logits, T * E, 0.3f);
    moe_router_config c = cfg_k(2, 0.0, 0);
    c.noise = MOE_NOISE_GUMBEL;
    moe_plan a, b;
    ck_assert_int_eq(moe_plan_alloc(&a, T, E, 2), 0);
    ck_assert_int_eq(moe_plan_alloc(&b, T, E, 2), 0);
    ck_assert_int_eq(moe_router_forward(&a, logits, NULL, NULL, T, E, &c, true, 5), 0);
    ck_assert_int_eq(moe_router_forward(&b, logits, NULL, NULL, T, E, &c, true, 5), 0);
    ck_assert_mem_eq(a.choice, b.choice, sizeof(int) * T * 2);
    ck_assert_int_eq(moe_router_forward(&b, logits, NULL, NULL, T, E, &c, true, 6), 0);
    int diff = 0;
    for (int t = 0; t < T; t++) {
        ck_assert_int_eq(a.choice[2 * t], b.choice[2 * t]); // first choice: no noise
        diff += a.choice[2 * t + 1] != b.choice[2 * t + 1];
    }
    ck_assert_int_gt(diff, 5); // second choices resampled by the step
    // not training: no noise, second choice is the second largest p
    ck_assert_int_eq(moe_router_forward(&b, logits, NULL, NULL, T, E, &c, false, 6), 0);
    for (int t = 0; t < T; t++) {
        const float *p = b.probs + t * E;
        int c0 = b.choice[2 * t], c1 = b.choice[2 * t + 1];
        for (int e = 0; e < E; e++)
            if (e != c0) ck_assert(p[e] <= p[c1]);
    }
    moe_plan_free(&a);
    moe_plan_free(&b);

    float x[256], y[256], z[256];
    for (int i = 0; i < 256; i++)
        x[i] = y[i] = z[i] = 1.0f + i;
    moe_router_jitter(x, 256, 0.01, 3, 10);
    moe_router_jitter(y, 256, 0.01, 3, 10);
    moe_router_jitter(z, 256, 0.01, 3, 11);
    ck_assert_mem_eq(x, y, sizeof x);
    int changed = 0;
    for (int i = 0; i < 256; i++) {
        float base = 1.0f + i;
        ck_assert(fabsf(x[i] / base - 1.0f) <= 0.0100001f);
        changed += x[i] != z[i];
    }
    ck_assert_int_gt(changed, 200);
}
END_TEST

// L(logits) = sum w*r + a*aux + b*z with the routing held fixed.
static double router_loss(moe_plan *pl, const float *logits, const float *r, int T, int E,
                          const moe_router_config *c, double a, double b, int *same_as) {
    ck_assert_int_eq(moe_router_forward(pl, logits, NULL, NULL, T, E, c, false, 0), 0);
    if (same_as && memcmp(same_as, pl->expert, sizeof(int) * T * c->top_k)) return NAN;
    double L = a * pl->aux_loss + b * pl->z_loss;
    for (int i = 0; i < T * c->top_k; i++)
        L += (double)pl->weight[i] * r[i];
    return L;
}

static void check_router_grad(int T, int E, int k, int normalize, int all_k, double cf,
                              uint64_t seed) {
    tu_rng rng;
    tu_seed(&rng, seed);
    moe_router_config c = cfg_k(k, cf, 0);
    c.normalize_topk = normalize;
    c.aux_counts_all_k = all_k;
    float *logits = malloc(sizeof(float) * T * E), *r = malloc(sizeof(float) * T * k);
    float *dl = calloc((size_t)T * E, sizeof(float));
    int *expert = malloc(sizeof(int) * T * k);
    tu_fill_normal(&rng, logits, (size_t)T * E, 1.5f);
    tu_fill_normal(&rng, r, (size_t)T * k, 1.0f);
    const double a = 0.7, b = 0.3;
    moe_plan pl;
    ck_assert_int_eq(moe_plan_alloc(&pl, T, E, k), 0);
    router_loss(&pl, logits, r, T, E, &c, a, b, NULL);
    memcpy(expert, pl.expert, sizeof(int) * T * k);
    moe_router_backward(dl, r, &pl, &c, (float)a, (float)b);
    int checked = 0;
    for (int i = 0; i < T * E; i++) {
        const float h = 1e-2f;
        float x0 = logits[i];
        logits[i] = x0 + h;
        double lp = router_loss(&pl, logits, r, T, E, &c, a, b, expert);
        logits[i] = x0 - h;
        double lm = router_loss(&pl, logits, r, T, E, &c, a, b, expert);
        logits[i] = x0;
        if (isnan(lp) || isnan(lm)) continue; // routing changed: not differentiable here
        // f_e of the aux loss is piecewise constant; it stays fixed when the
        // choices do, which the expert comparison above guarantees.
        double fd = (lp - lm) / (2.0 * h);
        ck_assert_msg(fabs(fd - dl[i]) <= 2e-3 * fmax(fabs(fd), fabs(dl[i])) + 2e-4,
                      "dlogit[%d]: analytic %g vs numeric %g", i, dl[i], fd);
        checked++;
    }
    ck_assert_int_gt(checked, T * E / 2);
    free(logits);
    free(r);
    free(dl);
    free(expert);
    moe_plan_free(&pl);
}

START_TEST(test_router_backward_finite_differences) {
    check_router_grad(12, 4, 2, 1, 0, 1.25, 1); // normalised top-2, some drops
    check_router_grad(12, 4, 2, 1, 0, 0.5, 2);  // heavy drops
    check_router_grad(10, 5, 1, 0, 0, 1.0, 3);  // Switch top-1, raw p
    check_router_grad(10, 5, 3, 1, 1, 0.0, 4);  // dropless, all-k aux
    check_router_grad(6, 3, 3, 1, 0, 1.0, 5);   // k == E
}
END_TEST

// backward adds into dlogits rather than overwriting
START_TEST(test_router_backward_accumulates) {
    const float logits[] = {1, 0, 0.5f, 0.2f, 0.3f, -1};
    const float dw[] = {0.3f, -0.2f, 0.1f, 0.4f};
    moe_router_config c = cfg_k(2, 2.0, 0);
    moe_plan pl;
    route(&pl, logits, NULL, 2, 3, &c);
    float d1[6] = {0}, d2[6] = {1, 2, 3, 4, 5, 6};
    moe_router_backward(d1, dw, &pl, &c, 0.5f, 0.25f);
    moe_router_backward(d2, dw, &pl, &c, 0.5f, 0.25f);
    for (int i = 0; i < 6; i++)
        ck_assert_float_eq_tol(d2[i], d1[i] + (i + 1), 1e-6);
    moe_plan_free(&pl);
}
END_TEST

// The choices of one token by their definition (the router's former code):
// k passes of argmax over the allowed experts not yet taken, on p + bias, or
// on logits + Gumbel noise for choices 2..k; only a strictly larger score
// replaces the best, so ties go to the lower expert.
static void topk_reference(int *ch, const float *p, const float *bias, const float *x, int E, int k,
                           bool gumbel, const moe_router_config *c, uint64_t step, size_t row) {
    unsigned char allow[64];
    double gscore[64];
    const bool grouped = moe_router_groups_active(c);
    if (grouped) moe_router_groups_allow(allow, gscore, p, bias, E, c);
    for (int j = 0; j < k; j++) {
        int best = -1;
        double best_s = 0.0;
        for (int e = 0; e < E; e++) {
            int taken = grouped && !allow[e];
            for (int i = 0; i < j; i++)
                taken |= ch[i] == e;
            if (taken) continue;
            double s = bias ? (double)p[e] + bias[e] : p[e];
            if (j > 0 && gumbel) s = x[e] + moe_noise_gumbel(c->seed, step, row * E + e);
            if (best < 0 || s > best_s) best = e, best_s = s;
        }
        ch[j] = best;
    }
}

// The heap top-k picks the same experts in the same order as k passes of
// argmax, ties included: logits from three values (many equal scores), a bias
// with ties of its own, groups and Gumbel noise on random small cases.
START_TEST(test_topk_equals_argmax_passes_with_ties) {
    tu_rng r;
    tu_seed(&r, 77);
    for (int iter = 0; iter < 600; iter++) {
        int E = 1 + (int)(tu_uniform(&r) * 16), k = 1 + (int)(tu_uniform(&r) * E);
        int T = 1 + (int)(tu_uniform(&r) * 20);
        moe_router_config c = cfg_k(k, 0.0, 0);
        c.score = tu_uniform(&r) < 0.3f ? MOE_SCORE_SIGMOID : MOE_SCORE_SOFTMAX;
        bool gumbel = tu_uniform(&r) < 0.3f;
        c.noise = gumbel ? MOE_NOISE_GUMBEL : MOE_NOISE_NONE;
        c.seed = (uint64_t)iter;
        for (int ng = E; ng > 1; ng--) // the largest group count whose groups can hold k
            if (E % ng == 0 && tu_uniform(&r) < 0.3f) {
                int tg = 1 + (int)(tu_uniform(&r) * ng);
                if ((long)tg * (E / ng) >= k) c.n_groups = ng, c.topk_groups = tg;
                break;
            }
        float *x = malloc(sizeof(float) * T * E), bias[16];
        for (int i = 0; i < T * E; i++)
            x[i] = 0.5f * (float)(int)(tu_uniform(&r) * 3);
        for (int e = 0; e < E; e++)
            bias[e] = 0.25f * (float)(int)(tu_uniform(&r) * 2);
        moe_plan pl;
        ck_assert_int_eq(moe_plan_alloc(&pl, T, E, k), 0);
        pl.bias = tu_uniform(&r) < 0.4f ? bias : NULL;
        const uint64_t step = 3;
        ck_assert_msg(moe_router_forward(&pl, x, NULL, NULL, T, E, &c, true, step) == 0, "%s",
                      moe_last_error());
        int want[16];
        for (int t = 0; t < T; t++) {
            topk_reference(want, pl.probs + (size_t)t * E, pl.bias, x + (size_t)t * E, E, k, gumbel,
                           &c, step, t);
            for (int j = 0; j < k; j++)
                ck_assert_msg(pl.choice[t * k + j] == want[j],
                              "iter %d token %d choice %d: %d, want %d (E %d k %d)", iter, t, j,
                              pl.choice[t * k + j], want[j], E, k);
        }
        moe_plan_free(&pl);
        free(x);
    }
}
END_TEST

// top_k = E = 65536 (the moe.num_experts limit): no stack array of E or k
// entries (they overflowed a thread's stack); every token takes every expert
// in descending score, ties to the lower expert; the backward runs too.
START_TEST(test_topk_at_the_expert_limit) {
    enum { TW = 3, EW = MOE_MAX_EXPERTS };
    float *x = malloc(sizeof(float) * TW * EW), *dl = calloc((size_t)TW * EW, sizeof(float));
    float *dw = malloc(sizeof(float) * TW * EW);
    for (int i = 0; i < TW * EW; i++)
        x[i] = (float)((i * 7919) % 13) * 0.25f, dw[i] = 1.0f;
    moe_router_config c = cfg_k(EW, 0.0, 0);
    moe_plan pl;
    ck_assert_int_eq(moe_plan_alloc(&pl, TW, EW, EW), 0);
    ck_assert_int_eq(moe_router_forward(&pl, x, NULL, NULL, TW, EW, &c, false, 0), 0);
    for (int t = 0; t < TW; t++) {
        const int *ch = pl.choice + (size_t)t * EW;
        const float *xt = x + (size_t)t * EW;
        for (int j = 1; j < EW; j++)
            ck_assert(xt[ch[j - 1]] > xt[ch[j]] ||
                      (xt[ch[j - 1]] == xt[ch[j]] && ch[j - 1] < ch[j]));
    }
    moe_router_backward(dl, dw, &pl, &c, 0.01f, 0.001f);
    for (int i = 0; i < TW * EW; i++)
        ck_assert(isfinite(dl[i]));
    moe_plan_free(&pl);
    free(x), free(dl), free(dw);
}
END_TEST

static Suite *router_suite(void) {
    Suite *s = suite_create("router");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_position_vs_priority_drop_different_tokens);
    tcase_add_test(tc, test_priority_task_priority_first);
    tcase_add_test(tc, test_config_check_refuses_task_priorities_under_position_order);
    tcase_add_test(tc, test_top2_first_choices_before_second);
    tcase_add_test(tc, test_capacity_formula);
    tcase_add_test(tc, test_dropless_keeps_everything);
    tcase_add_test(tc, test_top1_raw_probability);
    tcase_add_test(tc, test_ties_go_to_lower_expert);
    tcase_add_test(tc, test_aux_and_z_loss_values);
    tcase_add_test(tc, test_aux_loss_counts_choices_before_dropping);
    tcase_add_test(tc, test_priority_order_with_two_tokens);
    tcase_add_test(tc, test_plan_stats_by_hand);
    tcase_add_test(tc, test_usable_experts_only_are_chosen);
    tcase_add_test(tc, test_config_defaults_as_documented);
    tcase_add_test(tc, test_nan_logit_rejected);
    tcase_add_test(tc, test_config_set_and_check);
    tcase_add_test(tc, test_invariants_random);
    tcase_add_test(tc, test_noise_is_seeded);
    tcase_add_test(tc, test_router_backward_finite_differences);
    tcase_add_test(tc, test_router_backward_accumulates);
    tcase_add_test(tc, test_topk_equals_argmax_passes_with_ties);
    tcase_add_test(tc, test_topk_at_the_expert_limit);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(router_suite());
}
