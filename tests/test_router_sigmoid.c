// router.score = sigmoid and router.route_scale (DeepSeek-V3 routing): a
// hand-computed 3 x 4 case, invariants on random inputs, softmax with
// route_scale 1 bit-identical to the softmax weights, central-difference
// gradients of the router backward, `moe train` end to end and bad values.
#include "moe/error.h"
#include "moe/router.h"
#include "moe/train.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static moe_router_config sig_cfg(int k, double cf, bool normalize, double scale) {
    moe_router_config c;
    moe_router_config_default(&c);
    c.score = MOE_SCORE_SIGMOID;
    c.top_k = k;
    c.capacity_factor = cf;
    c.min_capacity = 0;
    c.normalize_topk = normalize;
    c.route_scale = scale;
    return c;
}

static void route(moe_plan *pl, const float *logits, int T, int E, const moe_router_config *c) {
    ck_assert_int_eq(moe_plan_alloc(pl, T, E, c->top_k), 0);
    int rc = moe_router_forward(pl, logits, NULL, NULL, T, E, c, false, 0);
    ck_assert_msg(rc == 0, "route: %s", moe_last_error());
}

static double sigmoid(double x) {
    return 1.0 / (1.0 + exp(-x));
}

// t0: experts 1 and 3 tie at s(2); t1: 2 then 1; t2: four-way tie -> 0, 1.
static const float HAND[12] = {1, 2, 0, 2, -1, 0, 3, -2, 0.5f, 0.5f, 0.5f, 0.5f};
static const int HAND_EXPERT[6] = {1, 3, 2, 1, 0, 1};

START_TEST(test_sigmoid_hand_case_normalised_scaled) {
    moe_router_config c = sig_cfg(2, 0.0, true, 2.5); // dropless
    moe_plan pl;
    route(&pl, HAND, 3, 4, &c);
    ck_assert_mem_eq(pl.expert, HAND_EXPERT, sizeof HAND_EXPERT);
    // w = 2.5 s_i / (s_a + s_b): t0 equal scores, t1 s(3), s(0), t2 equal
    const double want[6] = {1.25, 1.25, 1.6394587188920768, 0.8605412811079234, 1.25, 1.25};
    for (int i = 0; i < 6; i++)
        ck_assert_msg(fabs(pl.weight[i] - want[i]) < 1e-6, "weight %d: %.9g vs %.9g", i,
                      pl.weight[i], want[i]);
    // the scores themselves are kept in probs
    ck_assert_double_eq_tol(pl.probs[0], 0.7310585786300049, 1e-7);
    ck_assert_double_eq_tol(pl.probs[11], 0.6224593312018546, 1e-7);
    // aux: f = (1/3, 1/3, 1/3, 0) from first choices, P_e = mean_t s_te / sum_e s_te
    ck_assert_double_eq_tol(pl.aux_loss, 1.0626316660125075, 1e-6);
    // z-loss stays on the logits: mean_t logsumexp^2
    ck_assert_double_eq_tol(pl.z_loss, 7.169532776752308, 1e-5);
    moe_plan_free(&pl);
}
END_TEST

START_TEST(test_sigmoid_hand_case_raw_scaled) {
    moe_router_config c = sig_cfg(2, 0.0, false, 2.5);
    moe_plan pl;
    route(&pl, HAND, 3, 4, &c);
    ck_assert_mem_eq(pl.expert, HAND_EXPERT, sizeof HAND_EXPERT);
    const double want[6] = {2.201992694944706,  2.201992694944706, 2.3814353170560834, 1.25,
                            1.5561483280046364, 1.5561483280046364};
    for (int i = 0; i < 6; i++)
        ck_assert_msg(fabs(pl.weight[i] - want[i]) < 1e-6, "weight %d: %.9g vs %.9g", i,
                      pl.weight[i], want[i]);
    moe_plan_free(&pl);
}
END_TEST

// Top-1 with raw weights: the weight is sigmoid(x) of the chosen expert, not
// its softmax probability.
START_TEST(test_sigmoid_unnormalised_weight_is_the_score) {
    const float x[4] = {-3, 0.25f, 4, 1};
    moe_router_config c = sig_cfg(1, 0.0, false, 1.0);
    moe_plan pl;
    route(&pl, x, 1, 4, &c);
    ck_assert_int_eq(pl.expert[0], 2);
    ck_assert_float_eq(pl.weight[0], (float)sigmoid(4.0)); // softmax would give ~0.93
    moe_plan_free(&pl);
}
END_TEST

// Aux loss on sigmoid scores: P_e = mean_t s_te / sum_e' s_te'. Logits
// (1, 0) and (2, 0): both tokens choose expert 0, so top-1 counts give
// f = (1, 0) and aux = 2 * P_0; with all k = 2 choices f = (1, 1) (sum k, as
// for softmax) and aux = 2 * (P_0 + P_1) = 2.
START_TEST(test_sigmoid_aux_loss_by_hand) {
    const float x[4] = {1, 0, 2, 0};
    double P0 = (sigmoid(1) / (sigmoid(1) + 0.5) + sigmoid(2) / (sigmoid(2) + 0.5)) / 2;
    moe_router_config c = sig_cfg(1, 0.0, true, 1.0);
    moe_plan pl;
    route(&pl, x, 2, 2, &c);
    ck_assert_double_eq_tol(pl.aux_loss, 2 * P0, 1e-6);
    moe_plan_free(&pl);
    c = sig_cfg(2, 0.0, true, 1.0);
    c.aux_counts_all_k = true;
    route(&pl, x, 2, 2, &c);
    ck_assert_double_eq_tol(pl.aux_loss, 2.0, 1e-6);
    moe_plan_free(&pl);
}
END_TEST

// Random inputs, with and without drops: k distinct experts, the choices are
// the k highest scores, each weight is the unbiased score (over the kept sum
// when normalised) times route_scale, and without drops normalised weights
// sum to route_scale.
START_TEST(test_sigmoid_invariants_random) {
    const int T = 96, E = 8, k = 3;
    const double cfs[2] = {0.0, 0.8};
    tu_rng r;
    tu_seed(&r, 7);
    float *x = malloc(sizeof(float) * T * E);
    for (int trial = 0; trial < 8; trial++) {
        tu_fill_normal(&r, x, (size_t)T * E, 2.0f);
        bool norm = trial % 2 == 0;
        double scale = trial < 4 ? 2.5 : 0.75;
        moe_router_config c = sig_cfg(k, cfs[(trial / 2) % 2], norm, scale);
        moe_plan pl;
        route(&pl, x, T, E, &c);
        int dropped = 0;
        for (int t = 0; t < T; t++) {
            const int *ch = pl.choice + t * k, *ex = pl.expert + t * k;
            const float *w = pl.weight + t * k, *xt = x + t * E;
            double S = 0, wsum = 0;
            for (int j = 0; j < k; j++) {
                for (int i = 0; i < j; i++)
                    ck_assert_int_ne(ch[i], ch[j]);
                for (int e = 0; e < E; e++) { // no unchosen expert scores higher
                    bool chosen = false;
                    for (int i = 0; i < k; i++)
                        chosen |= ch[i] == e;
                    if (!chosen) ck_assert(pl.probs[t * E + e] <= pl.probs[t * E + ch[j]]);
                }
                ck_assert_double_eq_tol(pl.probs[t * E + ch[j]], sigmoid(xt[ch[j]]), 1e-6);
                if (ex[j] >= 0) S += sigmoid(xt[ex[j]]);
                dropped += ex[j] < 0;
            }
            for (int j = 0; j < k; j++) {
                double want = ex[j] < 0 ? 0.0 : sigmoid(xt[ex[j]]) * scale / (norm ? S : 1.0);
                ck_assert_msg(fabs(w[j] - want) <= 1e-6 * (1 + fabs(want)),
                              "trial %d token %d choice %d: %.9g vs %.9g", trial, t, j, w[j], want);
                wsum += w[j];
            }
            if (norm && S > 0) ck_assert_double_eq_tol(wsum, scale, 1e-5);
        }
        if (c.capacity_factor > 0)
            ck_assert_int_gt(dropped, 0); // the case exercises dropping
        else
            ck_assert_int_eq(dropped, 0);
        moe_plan_free(&pl);
    }
    free(x);
}
END_TEST

// The softmax router with route_scale 1 keeps its weights exactly: each weight
// is (float)(p / sum of kept p) as before the key existed; a scale of 2 doubles
// every weight bit for bit and changes nothing else in the plan.
START_TEST(test_softmax_route_scale_one_is_unchanged) {
    const int T = 64, E = 6, k = 2;
    tu_rng r;
    tu_seed(&r, 11);
    float *x = malloc(sizeof(float) * T * E);
    tu_fill_normal(&r, x, (size_t)T * E, 1.5f);
    for (int pass = 0; pass < 2; pass++) {
        moe_router_config c;
        moe_router_config_default(&c);
        c.top_k = k;
        c.capacity_factor = 0.9;
        c.min_capacity = 0;
        c.normalize_topk = pass == 0;
        c.slot_order = MOE_SLOT_PRIORITY;
        moe_plan a, b;
        route(&a, x, T, E, &c);
        for (int t = 0; t < T; t++) {
            const float *p = a.probs + t * E;
            const int *ex = a.expert + t * k;
            double s = 0;
            for (int j = 0; j < k; j++)
                s += ex[j] >= 0 ? p[ex[j]] : 0.0;
            for (int j = 0; j < k; j++) {
                float w = ex[j] < 0 ? 0.0f : p[ex[j]];
                if (c.normalize_topk) w = s > 0 ? (float)(w / s) : 0.0f;
                ck_assert_msg(memcmp(&w, &a.weight[t * k + j], sizeof w) == 0,
                              "token %d choice %d: %.9g vs %.9g", t, j, a.weight[t * k + j], w);
            }
        }
        c.route_scale = 2.0;
        route(&b, x, T, E, &c);
        for (int i = 0; i < T * k; i++)
            ck_assert_float_eq(b.weight[i], 2.0f * a.weight[i]);
        ck_assert_mem_eq(a.expert, b.expert, sizeof(int) * T * k);
        ck_assert_mem_eq(a.slot, b.slot, sizeof(int) * T * k);
        ck_assert_mem_eq(a.probs, b.probs, sizeof(float) * T * E);
        ck_assert_float_eq(a.aux_loss, b.aux_loss);
        ck_assert_float_eq(a.z_loss, b.z_loss);
        moe_plan_free(&a);
        moe_plan_free(&b);
    }
    free(x);
}
END_TEST

// Capacity and BPR see the sigmoid scores: under priority order the tokens
// with the highest max score keep the contested expert's slots.
START_TEST(test_sigmoid_priority_keeps_confident_tokens) {
    // all four tokens want expert 0; capacity 2; t2, t3 are the most confident
    const float x[8] = {0.1f, 0, 0.2f, 0, 3.0f, 0, 2.0f, 0};
    moe_router_config c = sig_cfg(1, 1.0, true, 1.0);
    c.slot_order = MOE_SLOT_PRIORITY;
    moe_plan pl;
    route(&pl, x, 4, 2, &c);
    ck_assert_int_eq(pl.capacity[0], 2);
    const int want[4] = {-1, -1, 0, 0};
    ck_assert_mem_eq(pl.expert, want, sizeof want);
    ck_assert_float_eq(pl.weight[2], 1.0f); // normalised over the one kept choice
    moe_plan_free(&pl);
}
END_TEST

// L(logits) = sum w*r + a*aux + b*z with the routing held fixed.
static double router_loss(moe_plan *pl, const float *logits, const float *r, int T, int E,
                          const moe_router_config *c, double a, double b, const int *same_as) {
    ck_assert_int_eq(moe_router_forward(pl, logits, NULL, NULL, T, E, c, false, 0), 0);
    if (same_as && memcmp(same_as, pl->expert, sizeof(int) * T * c->top_k)) return NAN;
    double L = a * pl->aux_loss + b * pl->z_loss;
    for (int i = 0; i < T * c->top_k; i++)
        L += (double)pl->weight[i] * r[i];
    return L;
}

// Central differences against moe_router_backward; the relative error of the
// whole gradient vector must stay below 1e-3.
// Logits N(shift, 1.5^2), z-loss weight b.
static void check_grad_at(moe_router_config c, int T, int E, uint64_t seed, float shift, double b) {
    int k = c.top_k;
    tu_rng rng;
    tu_seed(&rng, seed);
    float *x = malloc(sizeof(float) * T * E), *r = malloc(sizeof(float) * T * k);
    float *dl = calloc((size_t)T * E, sizeof(float));
    int *expert = malloc(sizeof(int) * T * k);
    tu_fill_normal(&rng, x, (size_t)T * E, 1.5f);
    for (int i = 0; i < T * E; i++)
        x[i] += shift;
    tu_fill_normal(&rng, r, (size_t)T * k, 1.0f);
    const double a = 0.7;
    moe_plan pl;
    ck_assert_int_eq(moe_plan_alloc(&pl, T, E, k), 0);
    router_loss(&pl, x, r, T, E, &c, a, b, NULL);
    memcpy(expert, pl.expert, sizeof(int) * T * k);
    moe_router_backward(dl, r, &pl, &c, (float)a, (float)b);
    int checked = 0;
    double num2 = 0, diff2 = 0;
    for (int i = 0; i < T * E; i++) {
        const float h = 1e-2f;
        float x0 = x[i];
        x[i] = x0 + h;
        double lp = router_loss(&pl, x, r, T, E, &c, a, b, expert);
        x[i] = x0 - h;
        double lm = router_loss(&pl, x, r, T, E, &c, a, b, expert);
        x[i] = x0;
        if (isnan(lp) || isnan(lm)) continue; // the routing changed: not differentiable
        double fd = (lp - lm) / (double)((x0 + h) - (x0 - h));
        ck_assert_msg(fabs(fd - dl[i]) <= 2e-3 * fmax(fabs(fd), fabs(dl[i])) + 2e-4,
                      "dlogit[%d]: analytic %g vs numeric %g", i, dl[i], fd);
        num2 += fd * fd, diff2 += (fd - dl[i]) * (fd - dl[i]);
        checked++;
    }
    ck_assert_int_gt(checked, T * E / 2);
    ck_assert_msg(sqrt(diff2) < 1e-3 * sqrt(num2), "relative error %g", sqrt(diff2 / num2));
    free(x), free(r), free(dl), free(expert);
    moe_plan_free(&pl);
}

static void check_grad(moe_router_config c, int T, int E, uint64_t seed) {
    check_grad_at(c, T, E, seed, 0.0f, 0.3);
}

START_TEST(test_sigmoid_backward_finite_differences) {
    check_grad(sig_cfg(2, 1.25, true, 1.0), 12, 4, 1); // normalised, some drops
    check_grad(sig_cfg(2, 0.5, true, 2.5), 12, 4, 2);  // heavy drops, scaled
    check_grad(sig_cfg(1, 1.0, false, 1.0), 10, 5, 3); // top-1 raw score
    check_grad(sig_cfg(3, 0.0, false, 2.5), 10, 5, 4); // raw, dropless, scaled
    check_grad(sig_cfg(3, 0.0, true, 0.5), 6, 3, 5);   // k == E
    moe_router_config c = sig_cfg(2, 1.0, true, 2.5);  // all-k aux counts
    c.aux_counts_all_k = true;
    check_grad(c, 12, 6, 6);
}
END_TEST

// Logits near -46: scores of 1e-22 to 1e-18, as small as the 1e-20 the
// normalised weights add to the kept sum, so w = s / (S + 1e-20) is far from
// s / S and the backward must divide by the same S + 1e-20. No z-loss here:
// with lse near -45 its F32 value (about 2000) would drown the differences.
START_TEST(test_sigmoid_backward_tiny_scores) {
    check_grad_at(sig_cfg(2, 0.0, true, 1.0), 8, 4, 9, -46.0f, 0.0);
    check_grad_at(sig_cfg(3, 1.0, true, 2.5), 8, 5, 10, -46.0f, 0.0);
}
END_TEST

START_TEST(test_softmax_route_scale_backward_finite_differences) {
    moe_router_config c = sig_cfg(2, 1.0, true, 2.5);
    c.score = MOE_SCORE_SOFTMAX;
    check_grad(c, 12, 4, 7);
    c.normalize_topk = false;
    check_grad(c, 12, 4, 8);
}
END_TEST

START_TEST(test_config_keys_and_bad_values) {
    moe_router_config c;
    moe_router_config_default(&c);
    ck_assert_int_eq(c.score, MOE_SCORE_SOFTMAX);
    ck_assert_double_eq(c.route_scale, 1.0);
    ck_assert_int_eq(moe_router_config_set(&c, "router.score", "sigmoid"), 0);
    ck_assert_int_eq(c.score, MOE_SCORE_SIGMOID);
    ck_assert_int_eq(moe_router_config_set(&c, "router.route_scale", "2.5"), 0);
    ck_assert_double_eq(c.route_scale, 2.5);
    ck_assert_int_eq(moe_router_config_set(&c, "router.score", "relu"), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "router.score") &&
                      strstr(moe_last_error(), "softmax | sigmoid"),
                  "%s", moe_last_error());
    const char *bad[] = {"0", "-1", "nan", "inf", "x", ""};
    for (int i = 0; i < 6; i++) {
        ck_assert_int_eq(moe_router_config_set(&c, "router.route_scale", bad[i]), MOE_EINVAL);
        ck_assert_msg(strstr(moe_last_error(), "router.route_scale"), "%s", moe_last_error());
    }
    ck_assert_double_eq(c.route_scale, 2.5); // a refused value leaves the key alone
    c.route_scale = 0.0;                     // set behind the setter's back: the check refuses
    ck_assert_int_eq(moe_router_config_check(&c, 4), MOE_EINVAL);
    c.route_scale = 1.0;
    c.score = (moe_score)7;
    ck_assert_int_eq(moe_router_config_check(&c, 4), MOE_EINVAL);
}
END_TEST

// `moe train` with sigmoid scores: a few steps with finite losses; bad values
// of the new keys exit 2 naming the key; the GPU path refuses both by name.
START_TEST(test_cli_train_sigmoid_and_bad_values) {
    char dir[600], args[2048], cfgp[700];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(cfgp, sizeof cfgp, "%s/small.json", dir);
    FILE *f = fopen(cfgp, "w");
    ck_assert_ptr_nonnull(f);
    fputs("{\"model\": {\"d_model\": 32, \"n_layers\": 2, \"d_ff\": 48, \"seq_len\": 32},\n"
          " \"moe\": {\"num_experts\": 4}, \"router\": {\"score\": \"sigmoid\","
          " \"route_scale\": 2.5},\n \"train\": {\"batch_size\": 4, \"eval_every\": 0}}\n",
          f);
    fclose(f);
    snprintf(args, sizeof args, "train '%s' --steps 4 --out '%s/r'", cfgp, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    const char *res = tu_file_text(dir, "r/config.json");
    if (res[0]) { // the resolved config records the keys when the run writes one
        ck_assert_ptr_nonnull(strstr(res, "sigmoid"));
        ck_assert_ptr_nonnull(strstr(res, "route_scale"));
    }
    const char *sets[] = {"router.score=relu", "router.route_scale=0", "router.route_scale=-1",
                          "router.route_scale=nan"};
    for (int i = 0; i < 4; i++) {
        snprintf(args, sizeof args, "train '%s' --steps 2 --set %s --out '%s/bad%d'", cfgp, sets[i],
                 dir, i);
        ck_assert_int_eq(tu_run_moe(dir, args), 2);
        const char *err = tu_file_text(dir, "err.txt");
        ck_assert_msg(strstr(err, i ? "router.route_scale" : "router.score"), "%s: %s", sets[i],
                      err);
    }
    ck_assert_int_eq(tu_run_moe(dir, "train --help-config"), 0);
    const char *help = tu_file_text(dir, "out.txt");
    ck_assert_ptr_nonnull(strstr(help, "router.score"));
    ck_assert_ptr_nonnull(strstr(help, "router.route_scale"));
}
END_TEST

// The device training path (its op table run on the CPU here) has no sigmoid
// router yet: refused by key name before training.
START_TEST(test_device_path_refuses_sigmoid_and_route_scale) {
    moe_config c = tu_small_config();
    c.train.steps = 2;
    char out[700];
    moe_train_result r;
    moe_train_opts o = {0};
    o.quiet = true;
    o.device_ops = &moe_ops_cpu;
    c.router.score = MOE_SCORE_SIGMOID;
    snprintf(out, sizeof out, "%s/sig", tu_tmpdir());
    o.out_dir = out;
    ck_assert_int_eq(moe_train(&c, &o, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "router.score"), "%s", moe_last_error());
    c.router.score = MOE_SCORE_SOFTMAX;
    c.router.route_scale = 2.0;
    snprintf(out, sizeof out, "%s/scale", tu_tmpdir());
    o.out_dir = out;
    ck_assert_int_eq(moe_train(&c, &o, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "router.route_scale"), "%s", moe_last_error());
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("router_sigmoid");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_sigmoid_hand_case_normalised_scaled);
    tcase_add_test(tc, test_sigmoid_hand_case_raw_scaled);
    tcase_add_test(tc, test_sigmoid_unnormalised_weight_is_the_score);
    tcase_add_test(tc, test_sigmoid_aux_loss_by_hand);
    tcase_add_test(tc, test_sigmoid_invariants_random);
    tcase_add_test(tc, test_softmax_route_scale_one_is_unchanged);
    tcase_add_test(tc, test_sigmoid_priority_keeps_confident_tokens);
    tcase_add_test(tc, test_sigmoid_backward_finite_differences);
    tcase_add_test(tc, test_sigmoid_backward_tiny_scores);
    tcase_add_test(tc, test_softmax_route_scale_backward_finite_differences);
    tcase_add_test(tc, test_config_keys_and_bad_values);
    tcase_add_test(tc, test_cli_train_sigmoid_and_bad_values);
    tcase_add_test(tc, test_device_path_refuses_sigmoid_and_route_scale);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
