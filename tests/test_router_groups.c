// Group-limited routing (router.n_groups, router.topk_groups): hand-computed
// cases with ties, the group score rules (max without a bias or with one of
// zeros, top-2 sum with a non-zero one), invariants on random inputs for both score functions with
// noise, priority order and capacity, bit-identity with no grouping, bad combinations refused by
// key, the node-count default, the device path's refusal and `moe plan`'s inter-node bytes falling
// with topk_groups.
#include "moe/config.h"
#include "moe/error.h"
#include "moe/parallel.h"
#include "moe/plan.h"
#include "moe/router.h"
#include "moe/train.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static moe_router_config grp_cfg(int k, int ng, int tg) {
    moe_router_config c;
    moe_router_config_default(&c);
    c.top_k = k;
    c.capacity_factor = 0.0; // dropless: choices are the kept experts
    c.min_capacity = 0;
    c.n_groups = ng;
    c.topk_groups = tg;
    return c;
}

static void route(moe_plan *pl, const float *logits, int T, int E, const moe_router_config *c,
                  bool training) {
    ck_assert_int_eq(moe_plan_alloc(pl, T, E, c->top_k), 0);
    int rc = moe_router_forward(pl, logits, NULL, NULL, T, E, c, training, 7);
    ck_assert_msg(rc == 0, "route: %s", moe_last_error());
}

// E = 8 in 4 groups of 2, top-1 group (no bias: a group scores its best).
//  t0: groups score 5, 4, 0, 4.5 -> group 0 -> experts 0, 1 (global top-2 is 0, 6)
//  t1: groups 0 and 1 tie at 1 -> group 0 (lower); inside it 0 and 1 tie -> 0, 1
//  t2: group 3 (best 2) -> 7 then 6
static const float HAND1[24] = {5, 0, 4, 4, 0, 0, 4.5f, 0, 1, 1, 1, 0,
                                0, 0, 0, 0, 0, 0, 0,    0, 0, 0, 1, 2};
static const int HAND1_EXPERT[6] = {0, 1, 0, 1, 7, 6};

START_TEST(test_groups_hand_case_top1_group_with_ties) {
    for (int sig = 0; sig < 2; sig++) { // sigmoid is monotone: the same choices
        moe_router_config c = grp_cfg(2, 4, 1);
        c.score = sig ? MOE_SCORE_SIGMOID : MOE_SCORE_SOFTMAX;
        moe_plan pl;
        route(&pl, HAND1, 3, 8, &c, false);
        ck_assert_mem_eq(pl.expert, HAND1_EXPERT, sizeof HAND1_EXPERT);
        moe_plan_free(&pl);
    }
}
END_TEST

// E = 8 in 4 groups, k = 3, two groups: group bests 3, 0, 2.95, 2.92 -> groups
// 0 and 2 -> experts 0 (3), 4 (2.95), 1 (2.9). Without groups: 0, 4, 6.
static const float HAND2[8] = {3, 2.9f, 0, 0, 2.95f, -5, 2.92f, 0};

START_TEST(test_groups_hand_case_top2_groups) {
    moe_router_config c = grp_cfg(3, 4, 2);
    moe_plan pl;
    route(&pl, HAND2, 1, 8, &c, false);
    ck_assert_int_eq(pl.expert[0], 0);
    ck_assert_int_eq(pl.expert[1], 4);
    ck_assert_int_eq(pl.expert[2], 1);
    moe_plan_free(&pl);
    c.topk_groups = 0; // every group
    route(&pl, HAND2, 1, 8, &c, false);
    ck_assert_int_eq(pl.expert[2], 6);
    moe_plan_free(&pl);
}
END_TEST

// The group score: the best score without a bias (DeepSeek-V2), the sum of
// the two best biased scores with a non-zero one (DeepSeek-V3).
START_TEST(test_group_score_max_without_bias_top2_sum_with_bias) {
    const float p[8] = {0.9f, 0.1f, 0.6f, 0.6f, 0.2f, 0.2f, 0.3f, 0.3f};
    const float bias[8] = {0, 0, -0.5f, -0.5f, 0, 0, 0.4f, 0.4f};
    const float tiny[8] = {0, 0, 0, 0, 0, 0, 0, 1e-30f}; // non-zero, moves no sum
    moe_router_config c = grp_cfg(2, 4, 1);
    unsigned char allow[8];
    double gs[8];                                       // n_groups of scratch: 8 in the last case
    moe_router_groups_allow(allow, gs, p, NULL, 8, &c); // max: group 0 (0.9)
    const unsigned char g0[8] = {1, 1, 0, 0, 0, 0, 0, 0};
    ck_assert_mem_eq(allow, g0, 8);
    ck_assert_double_eq_tol(gs[1], 0.6, 1e-7);
    moe_router_groups_allow(allow, gs, p, tiny, 8, &c); // sums 1.0, 1.2, 0.4, 0.6: group 1
    const unsigned char g1[8] = {0, 0, 1, 1, 0, 0, 0, 0};
    ck_assert_mem_eq(allow, g1, 8);
    ck_assert_double_eq_tol(gs[0], 1.0, 1e-7);
    moe_router_groups_allow(allow, gs, p, bias, 8, &c); // 1.0, 0.2, 0.4, 1.4: group 3
    const unsigned char g3[8] = {0, 0, 0, 0, 0, 0, 1, 1};
    ck_assert_mem_eq(allow, g3, 8);
    c.topk_groups = 2; // then group 0; ties of sums go to the lower group
    const float q[8] = {0.5f, 0.5f, 0.5f, 0.5f, 0.9f, 0.1f, 0, 0};
    moe_router_groups_allow(allow, gs, q, tiny, 8, &c); // 1.0, 1.0, 1.0, 0: groups 0, 1
    const unsigned char g01[8] = {1, 1, 1, 1, 0, 0, 0, 0};
    ck_assert_mem_eq(allow, g01, 8);
    c = grp_cfg(1, 8, 2); // one expert per group: its score alone
    moe_router_groups_allow(allow, gs, p, tiny, 8, &c);
    ck_assert_double_eq_tol(gs[0], 0.9, 1e-7);
    const unsigned char two[8] = {1, 0, 1, 0, 0, 0, 0, 0};
    ck_assert_mem_eq(allow, two, 8);
}
END_TEST

// Under an expert budget (inference: moe_plan.usable) a left-out expert
// counts in no group's score: a group scores its usable experts only, one
// usable expert by itself, none at -inf. Groups [0,1] [2,3] [4,5] [6,7].
START_TEST(test_group_score_counts_usable_experts_only) {
    const float p[8] = {0.9f, 0.1f, 0.6f, 0.6f, 0.2f, 0.2f, 0.3f, 0.3f};
    const float bias[8] = {0, 0, -0.5f, -0.5f, 0, 0, 0.4f, 0.4f};
    moe_router_config c = grp_cfg(2, 4, 1);
    unsigned char allow[8];
    double gs[4];
    bool usable[8] = {false, true, true, true, true, true, true, true};
    // no bias, best score: expert 0's 0.9 made group 0 win; without it 0.1,
    // 0.6, 0.2, 0.3 pick group 1
    moe_router_groups_allow_usable(allow, gs, p, NULL, usable, 8, &c);
    const unsigned char g1[8] = {0, 0, 1, 1, 0, 0, 0, 0};
    ck_assert_mem_eq(allow, g1, 8);
    ck_assert_double_eq_tol(gs[0], 0.1, 1e-7);
    // biased, top-2 sums 1.0, 0.2, 0.4, 1.4 pick group 3; expert 7 left out,
    // group 3 scores its one usable expert (0.7) and group 0 wins
    for (int e = 0; e < 8; e++)
        usable[e] = e != 7;
    moe_router_groups_allow_usable(allow, gs, p, bias, usable, 8, &c);
    const unsigned char g0[8] = {1, 1, 0, 0, 0, 0, 0, 0};
    ck_assert_mem_eq(allow, g0, 8);
    ck_assert_double_eq_tol(gs[3], 0.7, 1e-7);
    ck_assert_double_eq_tol(gs[0], 1.0, 1e-7);
    // a group with no usable expert scores -inf
    usable[6] = false;
    moe_router_groups_allow_usable(allow, gs, p, bias, usable, 8, &c);
    ck_assert(isinf(gs[3]) && gs[3] < 0);
    ck_assert_mem_eq(allow, g0, 8);
    // NULL: every expert usable, as moe_router_groups_allow
    moe_router_groups_allow_usable(allow, gs, p, bias, NULL, 8, &c);
    const unsigned char g3[8] = {0, 0, 0, 0, 0, 0, 1, 1};
    ck_assert_mem_eq(allow, g3, 8);
}
END_TEST

// A bias of zeros (training's bias before its first move, a checkpoint saved
// then) scores groups by their best score, as no bias does, so training, eval
// and generate (which attach no bias of zeros) and moe route agree. Logits
// [3, -5, 2.5, 2.5] in 2 groups, one kept: the best score picks group 0 and
// expert 0; the top-2 sum (2 e^2.5 > e^3 + e^-5) would pick expert 2.
START_TEST(test_zero_bias_routes_as_no_bias) {
    const float x[4] = {3, -5, 2.5f, 2.5f}, zero[4] = {0}, negz[4] = {-0.0f, 0, -0.0f, 0};
    const float *biases[3] = {NULL, zero, negz};
    moe_router_config c = grp_cfg(1, 2, 1);
    for (int i = 0; i < 3; i++) {
        moe_plan pl;
        ck_assert_int_eq(moe_plan_alloc(&pl, 1, 4, 1), 0);
        pl.bias = biases[i];
        ck_assert_int_eq(moe_router_forward(&pl, x, NULL, NULL, 1, 4, &c, false, 0), 0);
        ck_assert_int_eq(pl.expert[0], 0);
        moe_plan_free(&pl);
    }
    // random batches, k = 2 of 8 in 4 groups, two kept: zeros = none, bit for bit
    float r[64 * 8];
    srand(11);
    for (int i = 0; i < 64 * 8; i++)
        r[i] = (float)((rand() / (double)RAND_MAX - 0.5) * 6.0);
    const float zero8[8] = {0};
    moe_plan a, b;
    c = grp_cfg(2, 4, 2);
    ck_assert_int_eq(moe_plan_alloc(&a, 64, 8, 2), 0);
    ck_assert_int_eq(moe_plan_alloc(&b, 64, 8, 2), 0);
    b.bias = zero8;
    ck_assert_int_eq(moe_router_forward(&a, r, NULL, NULL, 64, 8, &c, false, 0), 0);
    ck_assert_int_eq(moe_router_forward(&b, r, NULL, NULL, 64, 8, &c, false, 0), 0);
    ck_assert_mem_eq(a.expert, b.expert, sizeof(int) * 64 * 2);
    ck_assert_mem_eq(a.weight, b.weight, sizeof(float) * 64 * 2);
    moe_plan_free(&a);
    moe_plan_free(&b);
}
END_TEST

static void rand_logits(float *x, size_t n, unsigned seed) {
    srand(seed);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((rand() / (double)RAND_MAX - 0.5) * 6.0);
}

// Every token: k distinct experts, all in its topk_groups chosen groups, at
// most topk_groups groups used; every chosen group scores at least as much as
// any other; without noise the choices are the top-k of the allowed experts.
START_TEST(test_groups_invariants_random) {
    enum { T = 96, E = 16 };
    float *x = malloc(sizeof(float) * T * E);
    int cases = 0;
    for (int ng = 2; ng <= 8; ng *= 2)
        for (int tg = 1; tg < ng; tg++)
            for (int variant = 0; variant < 4; variant++) {
                const int s = E / ng, k = tg * s < 4 ? tg * s : 4;
                moe_router_config c = grp_cfg(k, ng, tg);
                c.score = variant & 1 ? MOE_SCORE_SIGMOID : MOE_SCORE_SOFTMAX;
                const bool noisy = variant & 2;
                if (noisy) {
                    c.noise = MOE_NOISE_GUMBEL;
                    c.slot_order = MOE_SLOT_PRIORITY;
                    c.capacity_factor = 1.0;
                }
                rand_logits(x, (size_t)T * E, 100u + (unsigned)(ng * 10 + tg) + variant);
                moe_plan pl;
                route(&pl, x, T, E, &c, noisy);
                for (int t = 0; t < T; t++) {
                    const float *p = pl.probs + (size_t)t * E;
                    const int *ch = pl.choice + (size_t)t * k;
                    double gs[E];
                    for (int g = 0; g < ng; g++) {
                        gs[g] = -1e300;
                        for (int e = g * s; e < (g + 1) * s; e++)
                            if (p[e] > gs[g]) gs[g] = p[e];
                    }
                    int used[E] = {0}, n_used = 0;
                    for (int j = 0; j < k; j++) {
                        ck_assert(ch[j] >= 0 && ch[j] < E);
                        for (int i = 0; i < j; i++)
                            ck_assert_int_ne(ch[i], ch[j]);
                        if (!used[ch[j] / s]++) n_used++;
                    }
                    ck_assert_int_le(n_used, tg);
                    // chosen groups score >= every group left out (ties allowed)
                    double lo = 1e300, hi = -1e300;
                    for (int g = 0; g < ng; g++)
                        if (used[g] && gs[g] < lo) lo = gs[g];
                    int n_above = 0;
                    for (int g = 0; g < ng; g++)
                        if (!used[g] && gs[g] > lo) hi = gs[g] > hi ? gs[g] : hi, n_above++;
                    // a token may not need all tg groups: only tg - n_used
                    // unused groups may score above its lowest used one
                    ck_assert_int_le(n_above, tg - n_used);
                    if (!noisy) { // top-k of the allowed experts: nothing allowed beats a choice
                        float worst = p[ch[k - 1]];
                        ck_assert(worst <= p[ch[0]]);
                        for (int e = 0; e < E; e++) {
                            bool taken = false;
                            for (int j = 0; j < k; j++)
                                taken |= ch[j] == e;
                            if (!taken && used[e / s]) ck_assert(p[e] <= worst);
                        }
                    }
                    (void)hi;
                }
                moe_plan_free(&pl);
                cases++;
            }
    ck_assert_int_eq(cases, 4 * (1 + 3 + 7));
    free(x);
}
END_TEST

// n_groups = 1, topk_groups = 0 or topk_groups = n_groups: the same bits as
// no grouping (choices, slots, weights, losses), with noise and priority.
START_TEST(test_groups_off_is_bit_identical) {
    enum { T = 64, E = 8 };
    float x[T * E];
    rand_logits(x, T * E, 5);
    const int settings[4][2] = {{1, 0}, {1, 1}, {4, 0}, {4, 4}};
    for (int sig = 0; sig < 2; sig++) {
        moe_router_config ref = grp_cfg(2, 0, 0);
        ref.score = sig ? MOE_SCORE_SIGMOID : MOE_SCORE_SOFTMAX;
        ref.noise = MOE_NOISE_GUMBEL;
        ref.slot_order = MOE_SLOT_PRIORITY;
        ref.capacity_factor = 1.0;
        moe_plan a;
        route(&a, x, T, E, &ref, true);
        for (int i = 0; i < 4; i++) {
            moe_router_config c = ref;
            c.n_groups = settings[i][0], c.topk_groups = settings[i][1];
            ck_assert(!moe_router_groups_active(&c));
            moe_plan b;
            route(&b, x, T, E, &c, true);
            ck_assert_mem_eq(a.expert, b.expert, sizeof(int) * T * 2);
            ck_assert_mem_eq(a.slot, b.slot, sizeof(int) * T * 2);
            ck_assert_mem_eq(a.weight, b.weight, sizeof(float) * T * 2);
            ck_assert_mem_eq(&a.aux_loss, &b.aux_loss, sizeof a.aux_loss);
            ck_assert_mem_eq(&a.z_loss, &b.z_loss, sizeof a.z_loss);
            moe_plan_free(&b);
        }
        moe_plan_free(&a);
    }
}
END_TEST

// Gumbel-sampled second choices stay inside the token's group.
START_TEST(test_groups_gumbel_second_choice_stays_in_group) {
    enum { T = 256, E = 8 };
    float x[T * E];
    rand_logits(x, T * E, 9);
    moe_router_config c = grp_cfg(2, 4, 1);
    c.noise = MOE_NOISE_GUMBEL;
    moe_plan pl;
    route(&pl, x, T, E, &c, true);
    for (int t = 0; t < T; t++)
        ck_assert_int_eq(pl.choice[2 * t] / 2, pl.choice[2 * t + 1] / 2);
    moe_plan_free(&pl);
}
END_TEST

START_TEST(test_bad_group_combinations_refused_by_key) {
    static const struct {
        int E, k, ng, tg;
        const char *key;
    } bad[] = {{8, 2, 3, 1, "router.n_groups"},
               {8, 2, 4, 5, "router.topk_groups = 5 exceeds router.n_groups = 4"},
               {8, 3, 4, 1, "router.top_k = 3"},
               {16, 8, 8, 3, "router.topk_groups = 3"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        moe_router_config c = grp_cfg(bad[i].k, bad[i].ng, bad[i].tg);
        ck_assert_int_eq(moe_router_config_check(&c, bad[i].E), MOE_EINVAL);
        ck_assert_msg(strstr(moe_last_error(), bad[i].key), "%s", moe_last_error());
    }
    moe_router_config c = grp_cfg(2, 0, 0);
    ck_assert_int_eq(moe_router_config_set(&c, "router.n_groups", "-1"), MOE_EINVAL);
    ck_assert_int_eq(moe_router_config_set(&c, "router.topk_groups", "x"), MOE_EINVAL);
    // good edge: 4 groups of 2, 2 groups hold exactly k = 4
    c = grp_cfg(4, 4, 2);
    ck_assert_int_eq(moe_router_config_check(&c, 8), 0);
    // the run config names the key, for every layer of a pyramid
    moe_config cfg = tu_small_config();
    ck_assert_int_eq(moe_config_set(&cfg, NULL, "moe.num_experts=[8, 12]"), 0);
    ck_assert_int_eq(moe_config_set(&cfg, NULL, "model.n_layers=2"), 0);
    ck_assert_int_eq(moe_config_set(&cfg, NULL, "moe.every=1"), 0);
    ck_assert_int_eq(moe_config_set(&cfg, NULL, "router.n_groups=8"), 0);
    ck_assert_int_eq(moe_config_check(&cfg, NULL), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "router.n_groups = 8 does not divide the 12"), "%s",
                  moe_last_error());
    ck_assert_int_eq(moe_config_set(&cfg, NULL, "router.n_groups=4"), 0);
    ck_assert_int_eq(moe_config_check(&cfg, NULL), 0);
}
END_TEST

// n_groups = 0 in one process: one node, so one group and no limit, written
// into the resolved config; an explicit n_groups is kept.
START_TEST(test_node_default_resolves_to_one_group_in_one_process) {
    moe_comm *world;
    ck_assert_int_eq(moe_comm_local(&world), 0);
    moe_config cfg = tu_small_config();
    cfg.router.n_groups = 0, cfg.router.topk_groups = 2;
    moe_parallel p;
    ck_assert_int_eq(moe_parallel_init(&p, world, &cfg), 0);
    ck_assert_int_eq(moe_parallel_ep_nodes(&p), 1);
    ck_assert_int_eq(moe_parallel_resolve_groups(&p, &cfg), 0);
    ck_assert_int_eq(cfg.router.n_groups, 1);
    ck_assert_int_eq(cfg.router.topk_groups, 0);
    cfg.router.n_groups = 4, cfg.router.topk_groups = 2;
    ck_assert_int_eq(moe_parallel_resolve_groups(&p, &cfg), 0);
    ck_assert_int_eq(cfg.router.n_groups, 4);
    ck_assert_int_eq(cfg.router.topk_groups, 2);
    moe_parallel_free(&p);
    moe_comm_free(world);
}
END_TEST

// `moe train` with groups runs; --help-config documents both keys.
START_TEST(test_cli_train_with_groups_and_help) {
    char dir[600], args[2048], cfgp[700];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(cfgp, sizeof cfgp, "%s/small.json", dir);
    FILE *f = fopen(cfgp, "w");
    ck_assert_ptr_nonnull(f);
    fputs("{\"model\": {\"d_model\": 16, \"n_layers\": 1, \"d_ff\": 16, \"seq_len\": 8},\n"
          " \"moe\": {\"num_experts\": 8}, \"router\": {\"n_groups\": 4, \"topk_groups\": 1},\n"
          " \"train\": {\"batch_size\": 2, \"eval_every\": 0}}\n",
          f);
    fclose(f);
    snprintf(args, sizeof args, "train '%s' --steps 2 --quiet --out '%s/run'", cfgp, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    const char *res = tu_file_text(dir, "run/config.json");
    ck_assert_ptr_nonnull(strstr(res, "\"topk_groups\": 1"));
    snprintf(args, sizeof args, "train '%s' --set router.top_k=3 --steps 1 --out '%s/bad'", cfgp,
             dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 2);
    ck_assert_msg(strstr(tu_file_text(dir, "err.txt"), "router.topk_groups"), "%s",
                  tu_file_text(dir, "err.txt"));
    ck_assert_int_eq(tu_run_moe(dir, "train --help-config"), 0);
    const char *help = tu_file_text(dir, "out.txt");
    ck_assert_ptr_nonnull(strstr(help, "router.n_groups"));
    ck_assert_ptr_nonnull(strstr(help, "router.topk_groups"));
}
END_TEST

// The device training path has no group-limited router: refused by key.
START_TEST(test_device_path_refuses_groups) {
    moe_config c = tu_small_config();
    c.train.steps = 1;
    c.router.n_groups = 2, c.router.topk_groups = 1;
    char out[700];
    snprintf(out, sizeof out, "%s/dev", tu_tmpdir());
    moe_train_result r;
    moe_train_opts o = {0};
    o.quiet = true;
    o.out_dir = out;
    o.device_ops = &moe_ops_cpu;
    ck_assert_int_eq(moe_train(&c, &o, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "router.topk_groups"), "%s", moe_last_error());
}
END_TEST

// moe plan at 16 nodes x 8 ranks, E = 256, top-8: the nodes a token reaches
// and the per-node-copy bytes fall with topk_groups (topk_groups = 1: one
// node, remote with probability 15/16); the row exchange's do not change.
START_TEST(test_plan_inter_node_bytes_fall_with_topk_groups) {
    moe_config c = tu_small_config();
    ck_assert_int_eq(moe_config_set(&c, NULL, "moe.num_experts=256"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "router.top_k=8"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "parallel.ep=128"), 0);
    moe_machine mc = {128, 16, 8, {400, 100}, {2, 5}};
    const int tgs[4] = {1, 2, 4, 0};
    moe_a2a_plan p[4];
    for (int i = 0; i < 4; i++) {
        c.router.topk_groups = tgs[i];
        ck_assert_int_eq(moe_plan_a2a(&c, &mc, MOE_A2A_HIERARCHICAL, &p[i]), 0);
        ck_assert_int_eq(p[i].nodes, 16);
        ck_assert_int_eq(p[i].n_groups, 16);
        ck_assert_int_eq(p[i].bytes_inter, p[0].bytes_inter);
        if (i) ck_assert_int_lt(p[i - 1].bytes_inter_node_copy, p[i].bytes_inter_node_copy);
        if (i) ck_assert(p[i - 1].remote_nodes < p[i].remote_nodes);
    }
    ck_assert_double_eq_tol(p[0].remote_nodes, 15.0 / 16, 1e-12);
    ck_assert(p[1].remote_nodes <= 2 * 15.0 / 16 && p[3].remote_nodes < 8);
    ck_assert_int_gt(p[0].bytes_inter, 0);
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("router_groups");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_groups_hand_case_top1_group_with_ties);
    tcase_add_test(tc, test_groups_hand_case_top2_groups);
    tcase_add_test(tc, test_group_score_max_without_bias_top2_sum_with_bias);
    tcase_add_test(tc, test_group_score_counts_usable_experts_only);
    tcase_add_test(tc, test_zero_bias_routes_as_no_bias);
    tcase_add_test(tc, test_groups_invariants_random);
    tcase_add_test(tc, test_groups_off_is_bit_identical);
    tcase_add_test(tc, test_groups_gumbel_second_choice_stays_in_group);
    tcase_add_test(tc, test_bad_group_combinations_refused_by_key);
    tcase_add_test(tc, test_node_default_resolves_to_one_group_in_one_process);
    tcase_add_test(tc, test_cli_train_with_groups_and_help);
    tcase_add_test(tc, test_device_path_refuses_groups);
    tcase_add_test(tc, test_plan_inter_node_bytes_fall_with_topk_groups);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
