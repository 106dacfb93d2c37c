// router.type = expert_choice (Zhou et al. 2022): a hand-computed case with
// ties, the capacity rounding, invariants on random inputs, central-difference
// gradients of the router and of the MoE layer, tokens no expert takes pass
// through the layer unchanged, the memory plan, refused combinations, and
// `moe route` / `moe train` / `moe generate` / `moe plan` / `moe ablate` end to end.
#include "moe/config.h"
#include "moe/error.h"
#include "moe/moe_layer.h"
#include "moe/router.h"
#include "moe/safetensors.h"
#include "moe/train.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static moe_router_config ec_cfg(int k, double cf) {
    moe_router_config c;
    moe_router_config_default(&c);
    c.type = MOE_ROUTER_EXPERT_CHOICE;
    c.top_k = k;
    c.capacity_factor = cf;
    return c;
}

static void route(moe_plan *pl, const float *logits, int T, int E, const moe_router_config *c) {
    ck_assert_int_eq(moe_plan_alloc(pl, T, E, moe_router_plan_k(c, E)), 0);
    int rc = moe_router_forward(pl, logits, NULL, NULL, T, E, c, true, 0);
    ck_assert_msg(rc == 0, "route: %s", moe_last_error());
}

// T = 6, E = 3, k = 1, factor 1: C = 2. Softmax rows:
//   t0 (1/3, 1/3, 1/3)   t1 (.576, .212, .212)   t2 (.107, .787, .107)
//   t3 (.045, .045, .909) t4 (1/3, 1/3, 1/3)     t5 (.090, .245, .665)
// Expert 0: t1, then t0 and t4 tie at 1/3 -> t0 (lower index). Expert 1: t2,
// then t0 (1/3 beats t4 by index, t5 .245 below). Expert 2: t3, t5.
// t0 gets experts 0 and 1 (equal scores: lower expert first), t4 none.
static const float HAND[18] = {0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 1, 1, 1, -1, 0, 1};

START_TEST(test_ec_hand_case_with_ties) {
    moe_router_config c = ec_cfg(1, 1.0);
    moe_plan pl;
    route(&pl, HAND, 6, 3, &c);
    ck_assert_int_eq(pl.k, 3);
    const int want_ex[18] = {0, 1, -1, 0, -1, -1, 1, -1, -1, 2, -1, -1, -1, -1, -1, 2, -1, -1};
    // slots in token order: expert 0 {t0, t1}, expert 1 {t0, t2}, expert 2 {t3, t5}
    const int want_sl[18] = {0, 0, -1, 1, -1, -1, 1, -1, -1, 0, -1, -1, -1, -1, -1, 1, -1, -1};
    ck_assert_mem_eq(pl.expert, want_ex, sizeof want_ex);
    ck_assert_mem_eq(pl.slot, want_sl, sizeof want_sl);
    const double e1 = exp(1.0), e2 = exp(2.0), e3 = exp(3.0);
    const double want_w[18] = {1.0 / 3,
                               1.0 / 3,
                               0,
                               e1 / (e1 + 2),
                               0,
                               0,
                               e2 / (e2 + 2),
                               0,
                               0,
                               e3 / (e3 + 2),
                               0,
                               0,
                               0,
                               0,
                               0,
                               e1 / (exp(-1.0) + 1 + e1),
                               0,
                               0};
    for (int i = 0; i < 18; i++)
        ck_assert_msg(fabs(pl.weight[i] - want_w[i]) < 1e-6, "weight %d: %.9g vs %.9g", i,
                      pl.weight[i], want_w[i]);
    for (int e = 0; e < 3; e++) {
        ck_assert_int_eq(pl.counts[e], 2);
        ck_assert_int_eq(pl.kept[e], 2);
        ck_assert_int_eq(pl.capacity[e], 2);
        ck_assert_int_eq(pl.offsets[e], 2 * e);
    }
    ck_assert_int_eq(pl.offsets[3], 6);
    ck_assert_int_eq(pl.unrouted, 1);
    moe_load_stats st;
    moe_plan_stats(&pl, &st);
    ck_assert_int_eq(st.dropped, 1);
    ck_assert_double_eq_tol(st.drop_rate, 1.0 / 6, 1e-12);
    ck_assert_float_eq(pl.aux_loss, 0.0f);
    // z = mean_t lse_t^2, lse = log(sum_e exp(x))
    double z = 0;
    for (int t = 0; t < 6; t++) {
        double s = 0;
        for (int e = 0; e < 3; e++)
            s += exp(HAND[t * 3 + e]);
        z += log(s) * log(s);
    }
    ck_assert_double_eq_tol(pl.z_loss, z / 6, 1e-5);
    moe_plan_free(&pl);
}
END_TEST

// All tokens tie for every expert: each expert takes the C lowest token indices.
START_TEST(test_ec_all_ties_take_lowest_tokens) {
    float x[5 * 4] = {0};
    moe_router_config c = ec_cfg(2, 1.0); // C = ceil(1 * 2 * 5 / 4) = 3
    moe_plan pl;
    route(&pl, x, 5, 4, &c);
    for (int t = 0; t < 5; t++)
        for (int j = 0; j < 4; j++) {
            int want = t < 3 ? j : -1; // tokens 0..2 get every expert, in expert order
            ck_assert_int_eq(pl.expert[t * 4 + j], want);
            ck_assert_int_eq(pl.slot[t * 4 + j], t < 3 ? t : -1);
        }
    ck_assert_int_eq(pl.unrouted, 2);
    moe_plan_free(&pl);
}
END_TEST

START_TEST(test_ec_capacity_rounding) {
    moe_router_config c = ec_cfg(2, 1.25);
    ck_assert_int_eq(moe_expert_choice_capacity(&c, 10, 4), 7); // 6.25 rounds up
    c.capacity_factor = 1.1;
    ck_assert_int_eq(moe_expert_choice_capacity(&c, 40, 8), 11); // 11.000000000000002: not 12
    c.capacity_factor = 10;
    ck_assert_int_eq(moe_expert_choice_capacity(&c, 10, 4), 10); // at most T
    c.capacity_factor = 0.01;
    ck_assert_int_eq(moe_expert_choice_capacity(&c, 10, 4), 1); // at least 1
    c.min_capacity = 8;                                         // not used by expert choice
    ck_assert_int_eq(moe_expert_choice_capacity(&c, 10, 4), 1);
    ck_assert_int_eq(moe_expert_choice_capacity(&c, 0, 4), 0);
    ck_assert_int_eq(moe_router_rows_max(&c, 10, 4), 4);
    ck_assert_int_eq(moe_router_plan_k(&c, 4), 4);
    c.type = MOE_ROUTER_TOKEN_CHOICE;
    ck_assert_int_eq(moe_router_plan_k(&c, 4), 2);
    ck_assert_int_eq(moe_router_rows_max(&c, 10, 4), 20);
}
END_TEST

// Random logits: every expert takes exactly C tokens, no token twice; they are
// its top-C by score (no token left out scores higher, ties by index); each
// weight is route_scale times the pair's softmax score; a token's experts are
// listed in descending score, then -1; slots are dense and in token order.
START_TEST(test_ec_invariants_random) {
    const int T = 50, E = 6;
    tu_rng r;
    tu_seed(&r, 3);
    float *x = malloc(sizeof(float) * T * E);
    for (int trial = 0; trial < 8; trial++) {
        // quantised logits make ties common
        tu_fill_normal(&r, x, (size_t)T * E, 1.5f);
        if (trial % 2)
            for (int i = 0; i < T * E; i++)
                x[i] = roundf(x[i]);
        moe_router_config c = ec_cfg(1 + trial % 3, trial < 4 ? 1.0 : 2.0);
        c.route_scale = trial % 4 == 3 ? 2.5 : 1.0;
        const int C = moe_expert_choice_capacity(&c, T, E);
        moe_plan pl;
        route(&pl, x, T, E, &c);
        int taken[E][T], n_taken[E];
        memset(taken, 0, sizeof taken);
        memset(n_taken, 0, sizeof n_taken);
        int unrouted = 0;
        for (int t = 0; t < T; t++) {
            const int *ex = pl.expert + t * E, *sl = pl.slot + t * E;
            const float *w = pl.weight + t * E, *p = pl.probs + t * E;
            double s = 0, m = -INFINITY;
            for (int e = 0; e < E; e++)
                m = fmax(m, x[t * E + e]);
            for (int e = 0; e < E; e++)
                s += exp(x[t * E + e] - m);
            bool ended = false;
            unrouted += ex[0] < 0;
            for (int j = 0; j < E; j++) {
                if (ex[j] < 0) {
                    ended = true;
                    ck_assert_int_eq(sl[j], -1);
                    ck_assert_float_eq(w[j], 0.0f);
                    continue;
                }
                ck_assert_msg(!ended, "token %d: an expert after -1", t);
                ck_assert_int_eq(taken[ex[j]][t], 0);
                taken[ex[j]][t] = 1;
                n_taken[ex[j]]++;
                ck_assert_int_ge(sl[j], 0);
                ck_assert_int_lt(sl[j], C);
                double pe = exp(x[t * E + ex[j]] - m) / s;
                ck_assert_double_eq_tol(p[ex[j]], pe, 1e-6);
                ck_assert_float_eq(w[j], (float)(p[ex[j]] * c.route_scale));
                if (j > 0)
                    ck_assert(p[ex[j - 1]] > p[ex[j]] ||
                              (p[ex[j - 1]] == p[ex[j]] && ex[j - 1] < ex[j]));
            }
        }
        ck_assert_int_eq(pl.unrouted, unrouted);
        for (int e = 0; e < E; e++) {
            ck_assert_int_eq(n_taken[e], C); // exactly C (T >= C)
            ck_assert_int_eq(pl.kept[e], C);
            ck_assert_int_le(pl.kept[e], pl.capacity[e]);
            ck_assert_int_eq(pl.offsets[e + 1] - pl.offsets[e], C);
            float lo = INFINITY; // lowest taken score; its token index
            int lo_t = -1;
            for (int t = 0; t < T; t++)
                if (taken[e][t] && pl.probs[t * E + e] <= lo) lo = pl.probs[t * E + e], lo_t = t;
            for (int t = 0; t < T; t++)
                if (!taken[e][t]) {
                    float s = pl.probs[t * E + e];
                    ck_assert_msg(s < lo || (s == lo && t > lo_t),
                                  "expert %d left token %d (%.9g) but took %d (%.9g)", e, t, s,
                                  lo_t, lo);
                }
            // slots in token order: the i-th taken token has slot i
            int i = 0;
            for (int t = 0; t < T; t++)
                for (int j = 0; j < E; j++)
                    if (pl.expert[t * E + j] == e) ck_assert_int_eq(pl.slot[t * E + j], i++);
        }
        moe_plan_free(&pl);
    }
    free(x);
}
END_TEST

// L(logits) = sum w*r + b*z with the routing held fixed.
static double router_loss(moe_plan *pl, const float *x, const float *r, int T, int E,
                          const moe_router_config *c, double b, const int *same_as) {
    ck_assert_int_eq(moe_router_forward(pl, x, NULL, NULL, T, E, c, true, 0), 0);
    if (same_as && memcmp(same_as, pl->expert, sizeof(int) * T * E)) return NAN;
    double L = b * pl->z_loss;
    for (int i = 0; i < T * E; i++)
        L += (double)pl->weight[i] * r[i];
    return L;
}

static void check_router_grad(moe_router_config c, int T, int E, uint64_t seed) {
    tu_rng rng;
    tu_seed(&rng, seed);
    float *x = malloc(sizeof(float) * T * E), *r = malloc(sizeof(float) * T * E);
    float *dl = calloc((size_t)T * E, sizeof(float));
    int *expert = malloc(sizeof(int) * T * E);
    tu_fill_normal(&rng, x, (size_t)T * E, 1.5f);
    tu_fill_normal(&rng, r, (size_t)T * E, 1.0f);
    const double b = 0.3, aux = 0.7; // aux_scale must not matter: no aux loss
    moe_plan pl;
    ck_assert_int_eq(moe_plan_alloc(&pl, T, E, E), 0);
    router_loss(&pl, x, r, T, E, &c, b, NULL);
    memcpy(expert, pl.expert, sizeof(int) * T * E);
    moe_router_backward(dl, r, &pl, &c, (float)aux, (float)b);
    int checked = 0;
    double num2 = 0, diff2 = 0;
    for (int i = 0; i < T * E; i++) {
        const float h = 1e-2f;
        float x0 = x[i];
        x[i] = x0 + h;
        double lp = router_loss(&pl, x, r, T, E, &c, b, expert);
        x[i] = x0 - h;
        double lm = router_loss(&pl, x, r, T, E, &c, b, expert);
        x[i] = x0;
        if (isnan(lp) || isnan(lm)) continue; // the selection changed
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

START_TEST(test_ec_router_backward_finite_differences) {
    check_router_grad(ec_cfg(1, 1.0), 12, 4, 1);
    check_router_grad(ec_cfg(2, 1.25), 10, 5, 2);
    moe_router_config c = ec_cfg(2, 0.5); // many tokens without an expert, scaled weights
    c.route_scale = 2.5;
    check_router_grad(c, 12, 4, 3);
}
END_TEST

// ---- the MoE layer -------------------------------------------------------------------

typedef struct {
    moe_layer_config cfg;
    size_t np;
    float *flat, *gflat, *x, *y, *r, *dx;
    moe_layer_params p, g;
    moe_layer_acts a;
} layer_fx;

static void lfx_init(layer_fx *f, int T, int D, int H, int E, int k, double cf, int shared,
                     int chunks) {
    memset(f, 0, sizeof *f);
    moe_layer_config *c = &f->cfg;
    c->T_max = T, c->D = D, c->H = H, c->E = E, c->H_shared = shared ? H : 0;
    c->n_chunks = chunks;
    moe_router_config_default(&c->router);
    c->router.type = MOE_ROUTER_EXPERT_CHOICE;
    c->router.top_k = k;
    c->router.capacity_factor = cf;
    tu_rng r;
    tu_seed(&r, 5);
    f->np = moe_layer_num_params(c);
    f->flat = malloc(f->np * sizeof(float));
    f->gflat = calloc(f->np, sizeof(float));
    ck_assert_int_eq(moe_layer_params_view(&f->p, f->flat, c), 0);
    ck_assert_int_eq(moe_layer_params_view(&f->g, f->gflat, c), 0);
    tu_fill_normal(&r, f->flat, f->np, 1.0f / sqrtf((float)D));
    tu_fill_normal(&r, f->p.gate, (size_t)E * D, 1.0f);
    f->x = malloc(sizeof(float) * T * D), f->r = malloc(sizeof(float) * T * D);
    f->y = calloc((size_t)T * D, sizeof(float)), f->dx = calloc((size_t)T * D, sizeof(float));
    tu_fill_normal(&r, f->x, (size_t)T * D, 1.0f);
    tu_fill_normal(&r, f->r, (size_t)T * D, 1.0f);
    int rc = moe_layer_acts_alloc(&f->a, c, &moe_ops_cpu);
    ck_assert_msg(rc == 0, "acts: %s", moe_last_error());
}

static void lfx_free(layer_fx *f) {
    moe_layer_acts_free(&f->a);
    free(f->flat), free(f->gflat), free(f->x), free(f->y), free(f->r), free(f->dx);
}

static double lfx_loss(layer_fx *f) {
    int rc = moe_layer_forward(f->y, f->x, NULL, NULL, f->cfg.T_max, &f->p, &f->a, true, 0);
    ck_assert_msg(rc == 0, "forward: %s", moe_last_error());
    double L = 0.01 * f->a.plan.z_loss;
    for (int i = 0; i < f->cfg.T_max * f->cfg.D; i++)
        L += (double)f->y[i] * f->r[i];
    return L;
}

// y[t] = sum over t's pairs of w * FFN_e(x[t]) in double, against the layer.
START_TEST(test_ec_layer_matches_reference_and_unrouted_tokens_pass_through) {
    for (int chunks = 1; chunks <= 3; chunks += 2) {
        layer_fx f;
        const int T = 20, D = 8, H = 6, E = 4;
        lfx_init(&f, T, D, H, E, 1, 1.0, 0, chunks); // C = 5: many tokens get none
        lfx_loss(&f);
        const moe_plan *pl = &f.a.plan;
        ck_assert_int_gt(pl->unrouted, 0);
        for (int t = 0; t < T; t++) {
            const float *xt = f.x + t * D;
            for (int d = 0; d < D; d++) {
                double want = 0;
                for (int j = 0; j < E && pl->expert[t * E + j] >= 0; j++) {
                    const int e = pl->expert[t * E + j];
                    const float *w1 = moe_layer_w13(&f.p, e), *w3 = w1 + H * D;
                    const float *w2 = moe_layer_w2(&f.p, e);
                    double o = 0;
                    for (int h = 0; h < H; h++) {
                        double a = 0, b = 0;
                        for (int i = 0; i < D; i++)
                            a += (double)w1[h * D + i] * xt[i], b += (double)w3[h * D + i] * xt[i];
                        o += w2[d * H + h] * (a / (1 + exp(-a)) * b);
                    }
                    want += pl->weight[t * E + j] * o;
                }
                if (pl->expert[t * E] < 0) // no expert: the MoE adds exactly nothing
                    ck_assert_float_eq(f.y[t * D + d], 0.0f);
                else
                    ck_assert_msg(fabs(f.y[t * D + d] - want) < 1e-5 * (1 + fabs(want)),
                                  "chunks %d token %d dim %d: %g vs %g", chunks, t, d,
                                  f.y[t * D + d], want);
            }
        }
        lfx_free(&f);
    }
}
END_TEST

START_TEST(test_ec_layer_gradients_finite_differences) {
    layer_fx f;
    const int T = 12, D = 6, H = 5, E = 4;
    lfx_init(&f, T, D, H, E, 2, 1.0, 1, 1);
    memset(f.gflat, 0, f.np * sizeof(float));
    lfx_loss(&f);
    int rc = moe_layer_backward(f.dx, &f.g, f.r, f.x, NULL, T, &f.p, &f.a, 0.5f, 0.01f);
    ck_assert_msg(rc == 0, "backward: %s", moe_last_error());
    int *ex0 = malloc(sizeof(int) * T * E);
    memcpy(ex0, f.a.plan.expert, sizeof(int) * T * E);
    struct {
        float *v, *g;
        size_t n;
    } ts[3] = {{f.p.gate, f.g.gate, (size_t)E * D},
               {f.x, f.dx, (size_t)T * D},
               {moe_layer_w13(&f.p, 1), moe_layer_w13(&f.g, 1), 3 * (size_t)H * D}};
    for (int q = 0; q < 3; q++) {
        double num2 = 0, diff2 = 0;
        size_t skipped = 0;
        for (size_t i = 0; i < ts[q].n; i++) {
            float v = ts[q].v[i];
            ts[q].v[i] = v + 1e-2f;
            double lp = lfx_loss(&f);
            int same = !memcmp(ex0, f.a.plan.expert, sizeof(int) * T * E);
            ts[q].v[i] = v - 1e-2f;
            double lm = lfx_loss(&f);
            same = same && !memcmp(ex0, f.a.plan.expert, sizeof(int) * T * E);
            ts[q].v[i] = v;
            if (!same) {
                skipped++;
                continue;
            }
            double num = (lp - lm) / ((double)(v + 1e-2f) - (v - 1e-2f)), an = ts[q].g[i];
            num2 += num * num, diff2 += (an - num) * (an - num);
        }
        ck_assert_msg(skipped * 5 <= ts[q].n, "tensor %d: %zu of %zu change the routing", q,
                      skipped, ts[q].n);
        ck_assert_msg(num2 > 0 && sqrt(diff2) < 1e-3 * sqrt(num2), "tensor %d: relative error %g",
                      q, sqrt(diff2 / fmax(num2, 1e-30)));
    }
    free(ex0);
    lfx_free(&f);
}
END_TEST

// The layer's buffers hold E * C expert rows (not T * E): the estimate is the
// allocation and grows with C, not with E alone.
START_TEST(test_ec_memory_plan_sizes_rows_by_capacity) {
    moe_layer_config c;
    memset(&c, 0, sizeof c);
    c.T_max = 256, c.D = 64, c.H = 128, c.E = 8;
    moe_router_config_default(&c.router);
    c.router.top_k = 2;
    c.router.capacity_factor = 1.0;
    c.router.min_capacity = 0;
    size_t tc = moe_layer_acts_bytes(&c, &moe_ops_cpu);
    c.router.type = MOE_ROUTER_EXPERT_CHOICE; // E * C = 8 * 64 = 512 = T * k rows
    size_t ec = moe_layer_acts_bytes(&c, &moe_ops_cpu);
    // the same expert rows; the plan and dweight grow from [T, k] to [T, E]
    size_t extra = moe_plan_bytes(256, 8, 8) - moe_plan_bytes(256, 8, 2) + 256 * 6 * 4 * 2;
    ck_assert_msg(ec <= tc + extra + 4096 && ec >= tc, "tc %zu ec %zu extra %zu", tc, ec, extra);
    c.router.capacity_factor = 2.0; // twice the rows: xe, ab, h, ye, dye, dxe double
    size_t ec2 = moe_layer_acts_bytes(&c, &moe_ops_cpu);
    const size_t per_row = sizeof(float) * (4 * 64 + 3 * 128);
    ck_assert_msg(ec2 >= ec + 512 * per_row, "ec %zu ec2 %zu", ec, ec2);
    moe_layer_acts a;
    ck_assert_int_eq(moe_layer_acts_alloc(&a, &c, &moe_ops_cpu), 0);
    ck_assert_int_eq(a.plan.k, 8);
    moe_layer_acts_free(&a);
}
END_TEST

START_TEST(test_ec_bad_combinations_refused) {
    struct {
        const char *key, *value, *named;
    } bad[] = {{"router.score", "sigmoid", "router.score"},
               {"router.slot_order", "priority", "router.slot_order"},
               {"router.task_priority", "1,2", "router.task_priority"},
               {"router.noise", "gumbel", "router.noise"},
               {"capacity.mode", "dynamic", "capacity.mode"},
               {"router.capacity_factor", "0", "router.capacity_factor"}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        moe_router_config c = ec_cfg(2, 1.0);
        ck_assert_int_eq(moe_router_config_set(&c, bad[i].key, bad[i].value), 0);
        ck_assert_int_eq(moe_router_config_check(&c, 4), MOE_EINVAL);
        ck_assert_msg(strstr(moe_last_error(), bad[i].named) &&
                          strstr(moe_last_error(), "expert_choice"),
                      "%s: %s", bad[i].key, moe_last_error());
        c.type = MOE_ROUTER_TOKEN_CHOICE;                            // fine for token choice
        if (c.n_task_priority > 0) c.slot_order = MOE_SLOT_PRIORITY; // the order that reads them
        ck_assert_msg(moe_router_config_check(&c, 4) == 0, "%s: %s", bad[i].key, moe_last_error());
    }
    moe_router_config c;
    moe_router_config_default(&c);
    ck_assert_int_eq(c.type, MOE_ROUTER_TOKEN_CHOICE);
    ck_assert_int_eq(c.ec_fallback, MOE_EC_FALLBACK_NONE);
    ck_assert_int_eq(moe_router_config_set(&c, "router.type", "expert_choice"), 0);
    ck_assert_int_eq(moe_router_config_set(&c, "router.ec_fallback", "token_choice"), 0);
    ck_assert_int_eq(c.ec_fallback, MOE_EC_FALLBACK_TOKEN_CHOICE);
    ck_assert_int_eq(moe_router_config_set(&c, "router.type", "expert"), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "token_choice | expert_choice"), "%s", moe_last_error());
    // a per-expert capacity (dynamic controller) is refused by the router call
    moe_plan pl;
    ck_assert_int_eq(moe_plan_alloc(&pl, 6, 3, 3), 0);
    const int cap[3] = {2, 2, 2};
    ck_assert_int_eq(moe_router_forward(&pl, HAND, NULL, cap, 6, 3, &c, true, 0), MOE_EINVAL);
    moe_plan_free(&pl);
    // task-routed layers: the run config and the layer refuse it
    moe_config mc = tu_small_config();
    mc.router.type = MOE_ROUTER_EXPERT_CHOICE;
    ck_assert_int_eq(moe_config_check(&mc, NULL), 0);
    mc.moe.n_task_layers = 1;
    mc.moe.task_layers[0] = 0;
    ck_assert_int_eq(moe_config_check(&mc, NULL), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "moe.task_layers"), "%s", moe_last_error());
    moe_layer_config lc;
    memset(&lc, 0, sizeof lc);
    lc.T_max = 8, lc.D = 4, lc.H = 4, lc.E = 4, lc.n_tasks = 2;
    moe_router_config_default(&lc.router);
    lc.router.type = MOE_ROUTER_EXPERT_CHOICE;
    ck_assert_int_eq(moe_layer_config_check(&lc), MOE_EINVAL);
}
END_TEST

// ---- end to end ---------------------------------------------------------------------

// A short CPU run: the loss falls; aux contributes nothing; every MoE layer
// is balanced (same load per expert).
START_TEST(test_ec_training_loss_falls) {
    moe_config c = tu_small_config();
    c.router.type = MOE_ROUTER_EXPERT_CHOICE;
    c.router.aux_loss_coef = 0.5; // ignored under expert choice
    double losses[60];
    char out[700];
    snprintf(out, sizeof out, "%s/ec", tu_tmpdir());
    moe_train_opts o = {.out_dir = out, .quiet = true, .losses = losses};
    moe_train_result r;
    int rc = moe_train(&c, &o, &r);
    ck_assert_msg(rc == 0, "train: %s", moe_last_error());
    moe_eval_result_free(&r.eval);
    double first = (losses[0] + losses[1] + losses[2]) / 3, last = 0;
    for (int s = 0; s < c.train.steps; s++)
        ck_assert(isfinite(losses[s]));
    for (int s = c.train.steps - 3; s < c.train.steps; s++)
        last += losses[s] / 3;
    ck_assert_msg(last < 0.8 * first, "loss %g -> %g", first, last);
}
END_TEST

// The device training path (its op table run on the CPU here) refuses expert choice.
START_TEST(test_ec_device_path_refused) {
    moe_config c = tu_small_config();
    c.train.steps = 2;
    c.router.type = MOE_ROUTER_EXPERT_CHOICE;
    char out[700];
    snprintf(out, sizeof out, "%s/dev", tu_tmpdir());
    moe_train_opts o = {.out_dir = out, .quiet = true, .device_ops = &moe_ops_cpu};
    moe_train_result r;
    ck_assert_int_eq(moe_train(&c, &o, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "expert_choice"), "%s", moe_last_error());
}
END_TEST

static void write_small_config(const char *path, const char *router) {
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f,
            "{\"model\": {\"d_model\": 32, \"n_layers\": 2, \"d_ff\": 48, \"seq_len\": 32},\n"
            " \"moe\": {\"num_experts\": 4}, \"router\": {%s},\n"
            " \"train\": {\"batch_size\": 4, \"eval_every\": 0}}\n",
            router);
    fclose(f);
}

// generate refuses an expert-choice checkpoint (exit 2, naming the keys)
// unless router.ec_fallback = token_choice, which then generates.
START_TEST(test_ec_generate_refused_unless_fallback) {
    char dir[600], cfgp[700], args[2048];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(cfgp, sizeof cfgp, "%s/ec.json", dir);
    write_small_config(cfgp, "\"type\": \"expert_choice\"");
    snprintf(args, sizeof args, "train '%s' --steps 3 --out '%s/a'", cfgp, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "a/config.json"), "expert_choice"));
    snprintf(args, sizeof args, "generate '%s/a/checkpoint' --task copy --prompt abc --max-new 3",
             dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 2);
    const char *err = tu_file_text(dir, "err.txt");
    ck_assert_msg(strstr(err, "expert_choice") && strstr(err, "router.ec_fallback"), "%s", err);

    snprintf(args, sizeof args,
             "train '%s' --steps 3 --set router.ec_fallback=token_choice --out '%s/b'", cfgp, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    snprintf(args, sizeof args, "generate '%s/b/checkpoint' --task copy --prompt abc --max-new 3",
             dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
}
END_TEST

// moe route writes expert/slot/weight [T, E] and prints the tokens left out.
START_TEST(test_ec_cli_route_writes_plan) {
    char dir[600], in[700], out[700], args[2048];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(in, sizeof in, "%s/logits.safetensors", dir);
    snprintf(out, sizeof out, "%s/plan.safetensors", dir);
    const moe_st_entry e[] = {{"logits", MOE_ST_F32, 2, {6, 3}, HAND}};
    ck_assert_int_eq(moe_st_write(in, e, 1, NULL), 0);
    snprintf(args, sizeof args,
             "route --logits '%s' --set router.type=expert_choice --set router.top_k=1 "
             "--set router.capacity_factor=1 --out '%s'",
             in, out);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"), "1 of 6 tokens got no expert"));
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(out, &f), 0);
    int64_t shape[2];
    int *ex = NULL;
    ck_assert_int_eq(moe_st_load(f, "expert", MOE_ST_I32, 2, shape, (void **)&ex), 0);
    ck_assert_int_eq(shape[0], 6);
    ck_assert_int_eq(shape[1], 3);
    ck_assert_int_eq(ex[0], 0);
    ck_assert_int_eq(ex[1], 1);
    ck_assert_int_eq(ex[12], -1); // token 4: no expert
    free(ex);
    moe_st_close(f);
    // --example fixes the router type
    ck_assert_int_eq(tu_run_moe(dir, "route --example --set router.type=expert_choice"), 2);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "err.txt"), "router.type"));
    // bad combinations exit 2 naming the key
    snprintf(args, sizeof args,
             "route --logits '%s' --set router.type=expert_choice --set router.score=sigmoid "
             "--out '%s'",
             in, out);
    ck_assert_int_eq(tu_run_moe(dir, args), 2);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "err.txt"), "router.score"));
}
END_TEST

// moe plan, moe ablate over router.type, and --help-config list the keys.
START_TEST(test_ec_cli_plan_ablate_help) {
    char dir[600], cfgp[700], args[2048];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(cfgp, sizeof cfgp, "%s/base.json", dir);
    write_small_config(cfgp, "\"top_k\": 2");
    snprintf(args, sizeof args,
             "plan '%s' --set router.type=expert_choice --set parallel.ep=4 --nodes 1 "
             "--ranks-per-node 4",
             cfgp);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    snprintf(args, sizeof args,
             "ablate '%s' --steps 3 --grid router.type=token_choice,expert_choice "
             "--out '%s/abl'",
             cfgp, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s%s", tu_file_text(dir, "out.txt"),
                  tu_file_text(dir, "err.txt"));
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "abl/results.md"), "| expert_choice |"));
    ck_assert_int_eq(tu_run_moe(dir, "train --help-config"), 0);
    const char *help = tu_file_text(dir, "out.txt");
    ck_assert_ptr_nonnull(strstr(help, "router.type"));
    ck_assert_ptr_nonnull(strstr(help, "router.ec_fallback"));
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("router_ec");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_ec_hand_case_with_ties);
    tcase_add_test(tc, test_ec_all_ties_take_lowest_tokens);
    tcase_add_test(tc, test_ec_capacity_rounding);
    tcase_add_test(tc, test_ec_invariants_random);
    tcase_add_test(tc, test_ec_router_backward_finite_differences);
    tcase_add_test(tc, test_ec_layer_matches_reference_and_unrouted_tokens_pass_through);
    tcase_add_test(tc, test_ec_layer_gradients_finite_differences);
    tcase_add_test(tc, test_ec_memory_plan_sizes_rows_by_capacity);
    tcase_add_test(tc, test_ec_bad_combinations_refused);
    tcase_add_test(tc, test_ec_training_loss_falls);
    tcase_add_test(tc, test_ec_device_path_refused);
    tcase_add_test(tc, test_ec_generate_refused_unless_fallback);
    tcase_add_test(tc, test_ec_cli_route_writes_plan);
    tcase_add_test(tc, test_ec_cli_plan_ablate_help);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
