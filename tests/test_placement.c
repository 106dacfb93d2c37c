// Expert placement (moe/placement.h): the static table is today's contiguous
// blocks, the greedy replicates hot experts (hand-computed cases), the token
// split by source rank, properties on random loads, the placement.* keys'
// refusals, and the `moe plan` model.
#include "moe/config.h"
#include "moe/error.h"
#include "moe/placement.h"
#include "moe/plan.h"
#include "testutil.h"

#include <stdio.h>
#include <string.h>

START_TEST(test_placement_static_is_contiguous_blocks) {
    moe_placement t;
    ck_assert_int_eq(moe_placement_init(&t, 8, 4, 3), 0);
    static const int want[12] = {0, 1, -1, 2, 3, -1, 4, 5, -1, 6, 7, -1};
    for (int i = 0; i < 12; i++)
        ck_assert_int_eq(t.slot[i], want[i]);
    ck_assert(moe_placement_is_static(&t));
    for (int e = 0; e < 8; e++)
        for (int s = 0; s < 4; s++)
            ck_assert_int_eq(moe_placement_dest(&t, e, s), e / 2);
    moe_placement_free(&t);
}
END_TEST

// placement.mode = move, no spare slot: experts 2 and 3 (the only load) share
// rank 1 (home loads 0, 2, 0, 0). The hottest of rank 1 (2, lower index)
// swaps with rank 0's first expert (lowest rank and slot at equal gain): loads
// 1, 1, 0, 0, and no further swap lowers the maximum 1.
START_TEST(test_placement_move_swaps_a_hot_home_away) {
    moe_placement t;
    ck_assert_int_eq(moe_placement_init(&t, 8, 4, 2), 0);
    t.moves = true;
    const double load[8] = {0, 0, 1, 1, 0, 0, 0, 0};
    ck_assert_int_eq(moe_placement_update(&t, load), 0);
    const int want[8] = {2, 1, 0, 3, 4, 5, 6, 7};
    for (int j = 0; j < 8; j++)
        ck_assert_int_eq(t.slot[j], want[j]);
    ck_assert_int_eq(moe_placement_home(&t, 2), 0);
    ck_assert_int_eq(moe_placement_home(&t, 0), 1);
    ck_assert_int_eq(moe_placement_dest(&t, 2, 3), 0);
    ck_assert(!moe_placement_is_static(&t));
    moe_placement_free(&t);
}
END_TEST

// With one spare slot each, the moved homes leave ranks 2 and 3 free to
// replicate 2 and 3: every rank computes a quarter of the load (the
// replicate-only table stops at max/mean 2).
START_TEST(test_placement_move_balances_two_hot_experts_on_one_rank) {
    for (int moves = 0; moves < 2; moves++) {
        moe_placement t;
        ck_assert_int_eq(moe_placement_init(&t, 8, 4, 3), 0);
        t.moves = moves;
        const double load[8] = {0, 0, 4, 4, 0, 0, 0, 0};
        double tok[4], mx = 0;
        ck_assert_int_eq(moe_placement_update(&t, load), 0);
        moe_placement_rank_tokens(&t, load, tok);
        for (int r = 0; r < 4; r++)
            mx = tok[r] > mx ? tok[r] : mx;
        ck_assert_double_eq(mx, moves ? 2.0 : 4.0); // mean 2
        moe_placement_free(&t);
    }
}
END_TEST

// Balanced load: nothing to gain, the homes stay contiguous.
START_TEST(test_placement_move_balanced_load_keeps_homes) {
    moe_placement t;
    ck_assert_int_eq(moe_placement_init(&t, 8, 4, 3), 0);
    t.moves = true;
    const double load[8] = {3, 3, 3, 3, 3, 3, 3, 3};
    ck_assert_int_eq(moe_placement_update(&t, load), 0);
    ck_assert(moe_placement_is_static(&t));
    moe_placement_free(&t);
}
END_TEST

// Random loads: every expert keeps exactly one home slot, each rank El of
// them, the holder lists start at that home, and the largest home load never
// grows; a second update from the moved table keeps it valid.
START_TEST(test_placement_move_keeps_one_home_per_expert) {
    unsigned x = 12345;
    for (int trial = 0; trial < 200; trial++) {
        const int P = 2 + trial % 4, El = 1 + trial % 3, E = P * El, S = El + trial % 2;
        moe_placement t;
        ck_assert_int_eq(moe_placement_init(&t, E, P, S), 0);
        t.moves = true;
        for (int round = 0; round < 2; round++) {
            double load[E], before = 0, after = 0;
            for (int e = 0; e < E; e++)
                x = x * 1103515245u + 12345u, load[e] = (x >> 16) % 100;
            for (int r = 0; r < P; r++) {
                double h = 0;
                for (int j = 0; j < El; j++)
                    h += load[t.slot[r * S + j]];
                before = h > before ? h : before;
            }
            ck_assert_int_eq(moe_placement_update(&t, load), 0);
            int seen[E];
            memset(seen, 0, sizeof seen);
            for (int r = 0; r < P; r++) {
                double h = 0;
                for (int j = 0; j < El; j++) {
                    const int e = t.slot[r * S + j];
                    ck_assert(e >= 0 && e < E);
                    seen[e]++, h += load[e];
                    ck_assert_int_eq(moe_placement_home(&t, e), r);
                }
                after = h > after ? h : after;
            }
            for (int e = 0; e < E; e++)
                ck_assert_int_eq(seen[e], 1);
            ck_assert(after <= before);
        }
        moe_placement_free(&t);
    }
}
END_TEST

START_TEST(test_placement_uniform_load_stays_static) {
    moe_placement t;
    ck_assert_int_eq(moe_placement_init(&t, 8, 4, 4), 0);
    const double load[8] = {5, 5, 5, 5, 5, 5, 5, 5};
    ck_assert_int_eq(moe_placement_update(&t, load), 0);
    ck_assert(moe_placement_is_static(&t));
    moe_placement_free(&t);
}
END_TEST

// 8 experts on 4 ranks, one spare slot each, expert 0 carries 10 of 17.
// Rank loads 11, 2, 2, 2: a replica of 0 on rank 1 (least loaded, lowest)
// takes the largest load to 7, one on rank 2 to 6, one on rank 3 to 4.5:
// every rank holds 0 and serves its own tokens of it: 3.5, 4.5, 4.5, 4.5.
// Then no rank lacking expert 1 has a free slot.
START_TEST(test_placement_replicates_the_hot_expert) {
    moe_placement t;
    ck_assert_int_eq(moe_placement_init(&t, 8, 4, 3), 0);
    const double load[8] = {10, 1, 1, 1, 1, 1, 1, 1};
    ck_assert_int_eq(moe_placement_update(&t, load), 0);
    static const int want[12] = {0, 1, -1, 2, 3, 0, 4, 5, 0, 6, 7, 0};
    for (int i = 0; i < 12; i++)
        ck_assert_int_eq(t.slot[i], want[i]);
    ck_assert_int_eq(t.n_hold[0], 4);
    for (int s = 0; s < 4; s++)
        ck_assert_int_eq(moe_placement_dest(&t, 0, s), s);
    double tok[4];
    moe_placement_rank_tokens(&t, load, tok);
    ck_assert_double_eq_tol(tok[0], 3.5, 1e-12);
    for (int r = 1; r < 4; r++)
        ck_assert_double_eq_tol(tok[r], 4.5, 1e-12);
    moe_placement_free(&t);
}
END_TEST

// Non-holders are dealt round-robin over the holders, home first: 8 ranks,
// expert 0 held by ranks 0, 1, 2, 3 -> sources 4, 5, 6, 7 go to 0, 1, 2, 3.
START_TEST(test_placement_dest_deals_non_holders_by_source_rank) {
    moe_placement t;
    ck_assert_int_eq(moe_placement_init(&t, 8, 8, 2), 0);
    for (int r = 1; r < 4; r++) {
        t.slot[r * 2 + 1] = 0;
        t.hold[t.n_hold[0]++] = r;
    }
    for (int s = 0; s < 8; s++)
        ck_assert_int_eq(moe_placement_dest(&t, 0, s), s < 4 ? s : s - 4);
    ck_assert_int_eq(moe_placement_slot_of(&t, 2, 0), 1);
    ck_assert_int_eq(moe_placement_slot_of(&t, 5, 0), -1);
    moe_placement_free(&t);
}
END_TEST

// Capacity follows replicas. 8 ranks, expert 0 held by ranks 0, 1, 2: the
// deal sends 3, 6 to rank 0, 4, 7 to rank 1, 5 to rank 2. Each holder's
// budget is 8 c: with c = 1, 8 over sources {0, 3, 6} is 3, 3, 2; over
// {1, 4, 7} the same; rank 2's sources {2, 5} get 4 each. Expert 1 (one
// holder) keeps c.
START_TEST(test_placement_capacity_splits_each_holders_budget) {
    moe_placement t;
    ck_assert_int_eq(moe_placement_init(&t, 8, 8, 2), 0);
    for (int r = 1; r < 3; r++) {
        t.slot[r * 2 + 1] = 0;
        t.hold[t.n_hold[0]++] = r;
    }
    static const int want[8] = {3, 3, 4, 3, 3, 4, 2, 2};
    for (int s = 0; s < 8; s++) {
        ck_assert_int_eq(moe_placement_capacity(&t, 0, s, 1), want[s]);
        ck_assert_int_eq(moe_placement_capacity(&t, 1, s, 1), 1);
        ck_assert_int_eq(moe_placement_capacity(&t, 1, s, 7), 7);
    }
    // Any c: every holder's sources share exactly 8 c, none gets less than c.
    for (int c = 0; c < 40; c++) {
        int got[8] = {0};
        for (int s = 0; s < 8; s++) {
            const int cs = moe_placement_capacity(&t, 0, s, c);
            ck_assert_int_ge(cs, c);
            got[moe_placement_dest(&t, 0, s)] += cs;
        }
        for (int h = 0; h < 3; h++)
            ck_assert_int_eq(got[h], 8 * c);
    }
    moe_placement_free(&t);
}
END_TEST

// Random loads: each expert keeps its home slot, no rank holds an expert
// twice, holders and slots agree, tokens are conserved, the largest rank
// load never grows, and the same load gives the same table.
START_TEST(test_placement_properties_on_random_loads) {
    tu_rng r;
    tu_seed(&r, 42);
    for (int it = 0; it < 200; it++) {
        const int P = 2 + it % 7, El = 1 + it % 3, E = P * El, S = El + 1 + it % 2;
        double load[E], tok[P], tok0[P];
        for (int e = 0; e < E; e++)
            load[e] = tu_uniform(&r) < 0.2 ? 50 * tu_uniform(&r) : tu_uniform(&r);
        moe_placement t, u;
        ck_assert_int_eq(moe_placement_init(&t, E, P, S), 0);
        ck_assert_int_eq(moe_placement_init(&u, E, P, S), 0);
        moe_placement_rank_tokens(&t, load, tok0);
        ck_assert_int_eq(moe_placement_update(&t, load), 0);
        ck_assert_int_eq(moe_placement_update(&u, load), 0);
        ck_assert(!memcmp(t.slot, u.slot, sizeof(int) * P * S));
        moe_placement_rank_tokens(&t, load, tok);
        double sum = 0, sum0 = 0, mx = 0, mx0 = 0;
        for (int p = 0; p < P; p++) {
            sum += tok[p], sum0 += tok0[p];
            mx = tok[p] > mx ? tok[p] : mx, mx0 = tok0[p] > mx0 ? tok0[p] : mx0;
        }
        ck_assert_double_eq_tol(sum, sum0, 1e-9 * sum0);
        ck_assert(mx <= mx0);
        for (int e = 0; e < E; e++) {
            ck_assert_int_eq(t.slot[(e / El) * S + e % El], e);
            ck_assert_int_eq(t.hold[e * P], e / El);
            int copies = 0;
            for (int j = 0; j < P * S; j++)
                copies += t.slot[j] == e;
            ck_assert_int_eq(copies, t.n_hold[e]);
            for (int i = 0; i < t.n_hold[e]; i++)
                ck_assert_int_ge(moe_placement_slot_of(&t, t.hold[e * P + i], e), 0);
        }
        moe_placement_free(&t);
        moe_placement_free(&u);
    }
}
END_TEST

// The deal by its definition (moe/placement.h), to check the closed forms
// the library uses so a plan of P ranks stays O(P^2): dest, capacity and the
// rank loads of tables with random replicas equal these.
static int ref_dest(const moe_placement *t, int e, int s) {
    const int n = t->n_hold[e], *h = t->hold + e * t->P;
    int below = 0;
    for (int r = 0; r < s; r++) {
        int held = 0;
        for (int i = 0; i < n; i++)
            held |= h[i] == r;
        below += !held;
    }
    for (int i = 0; i < n; i++)
        if (h[i] == s) return s;
    return h[below % n];
}

static int ref_capacity(const moe_placement *t, int e, int s, int c) {
    if (t->n_hold[e] == 1 || c <= 0) return c;
    const int h = ref_dest(t, e, s);
    int m = 0, idx = 0;
    for (int r = 0; r < t->P; r++)
        if (ref_dest(t, e, r) == h) idx += r < s, m++;
    const long budget = (long)t->P * c;
    return (int)(budget / m + (idx < budget % m));
}

START_TEST(test_placement_closed_forms_match_the_deal) {
    tu_rng r;
    tu_seed(&r, 7);
    for (int it = 0; it < 300; it++) {
        const int P = 2 + it % 11, El = 1 + it % 3, E = P * El, S = El + 1 + it % 3;
        moe_placement t;
        ck_assert_int_eq(moe_placement_init(&t, E, P, S), 0);
        for (int k = 0; k < P * (S - El); k++) { // random replicas in free spare slots
            const int e = (int)(tu_uniform(&r) * E) % E, q = (int)(tu_uniform(&r) * P) % P;
            if (moe_placement_slot_of(&t, q, e) >= 0) continue;
            const int j = moe_placement_slot_of(&t, q, -1);
            if (j < 0) continue;
            t.slot[q * S + j] = e;
            t.hold[e * P + t.n_hold[e]++] = q;
        }
        double load[E], tok[P], want[P];
        for (int p = 0; p < P; p++)
            want[p] = 0;
        for (int e = 0; e < E; e++)
            load[e] = tu_uniform(&r);
        for (int s = 0; s < P; s++)
            for (int e = 0; e < E; e++) {
                ck_assert_int_eq(moe_placement_dest(&t, e, s), ref_dest(&t, e, s));
                for (int c = 0; c < 5; c++)
                    ck_assert_int_eq(moe_placement_capacity(&t, e, s, c * 3 + 1),
                                     ref_capacity(&t, e, s, c * 3 + 1));
                want[ref_dest(&t, e, s)] += load[e] / P;
            }
        moe_placement_rank_tokens(&t, load, tok);
        for (int p = 0; p < P; p++)
            ck_assert_double_eq_tol(tok[p], want[p], 1e-12 * (1 + want[p]));
        moe_placement_free(&t);
    }
}
END_TEST

static void expect_refused(const char *const *sets, int n, const char *key) {
    moe_config c;
    moe_config_default(&c);
    for (int i = 0; i < n; i++)
        ck_assert_msg(moe_config_set(&c, NULL, sets[i]) == 0, "%s: %s", sets[i], moe_last_error());
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), key), "'%s' does not name %s", moe_last_error(), key);
}

START_TEST(test_placement_keys_refuse_bad_combinations) {
    const char *no_ep[] = {"placement.mode=replicate", "placement.slots_per_rank=9"};
    expect_refused(no_ep, 2, "placement.slots_per_rank");
    const char *ep1[] = {"placement.mode=replicate"};
    expect_refused(ep1, 1, "placement.mode");
    const char *few[] = {"parallel.ep=4", "placement.slots_per_rank=1"};
    expect_refused(few, 2, "placement.slots_per_rank");
    const char *no_spare[] = {"parallel.ep=4", "placement.mode=replicate",
                              "placement.slots_per_rank=2"};
    expect_refused(no_spare, 3, "placement.slots_per_rank");
    const char *ec[] = {"parallel.ep=4", "placement.mode=replicate", "placement.slots_per_rank=3",
                        "router.type=expert_choice"};
    expect_refused(ec, 4, "placement.mode");
    const char *dedup[] = {"parallel.ep=4", "placement.mode=replicate",
                           "placement.slots_per_rank=3", "comm.node_dedup=true"};
    expect_refused(dedup, 4, "placement.mode");
    const char *gpu[] = {"parallel.ep=4", "placement.mode=replicate", "placement.slots_per_rank=3",
                         "train.device=cuda"};
    expect_refused(gpu, 4, "placement.mode");
    moe_config c;
    moe_config_default(&c);
    ck_assert_int_eq(moe_config_set(&c, NULL, "placement.mode=spread"), MOE_EINVAL);
    ck_assert_int_eq(moe_config_set(&c, NULL, "placement.update_every=0"), MOE_EINVAL);
    const char *ok[] = {"parallel.ep=4", "placement.mode=replicate", "placement.slots_per_rank=3",
                        "placement.update_every=5"};
    for (int i = 0; i < 4; i++)
        ck_assert_int_eq(moe_config_set(&c, NULL, ok[i]), 0);
    ck_assert_int_eq(moe_config_check(&c, NULL), 0);
}
END_TEST

// moe plan: 4 ranks, 8 experts, dropless, expert 0 takes half of the 2*32
// assignments of each rank: static rank 0 computes 4*32 + 4*32/7, the rest
// 2*4*32/7; with one spare slot each, rank tokens balance better, the total
// is kept, and nothing drops either way.
START_TEST(test_plan_models_placement_for_any_ranks) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {"model.seq_len=16", "train.batch_size=2", "router.capacity_factor=0",
                          "parallel.ep=4", "model.n_layers=2"};
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(moe_config_set(&c, NULL, sets[i]), 0);
    double t0[8], t1[8];
    moe_place_plan pp = {.tokens = {t0, t1}};
    ck_assert_int_eq(moe_plan_placement(&c, 0.5, NULL, &pp), 0);
    ck_assert_int_eq(pp.S, 3);
    ck_assert_double_eq_tol(t0[0], 128 + 128.0 / 7, 1e-9);
    for (int r = 1; r < 4; r++)
        ck_assert_double_eq_tol(t0[r], 256.0 / 7, 1e-9);
    double s0 = 0, s1 = 0;
    for (int r = 0; r < 4; r++)
        s0 += t0[r], s1 += t1[r];
    ck_assert_double_eq_tol(s0, s1, 1e-9);
    ck_assert(pp.max_mean[1] < pp.max_mean[0]);
    ck_assert_double_eq_tol(pp.max_mean[0], (128 + 128.0 / 7) / 64, 1e-9);
    ck_assert(pp.replicas > 0);
    ck_assert(pp.drop_rate[0] == 0 && pp.drop_rate[1] == 0);
    ck_assert(pp.a2a_bytes[1] < pp.a2a_bytes[0]);
    // 8 ranks (any number the experts divide).
    ck_assert_int_eq(moe_config_set(&c, NULL, "parallel.ep=8"), 0);
    ck_assert_int_eq(moe_plan_placement(&c, 0.5, NULL, &pp), 0);
    ck_assert_int_eq(pp.P, 8);
    ck_assert(pp.max_mean[1] < 0.5 * pp.max_mean[0]);
    // Balanced routing: nothing to replicate.
    ck_assert_int_eq(moe_plan_placement(&c, 0, NULL, &pp), 0);
    ck_assert_int_eq(pp.replicas, 0);
    ck_assert_double_eq_tol(pp.max_mean[0], 1, 1e-12);
    ck_assert_int_eq(moe_plan_placement(&c, 1.5, NULL, &pp), MOE_EINVAL);
    // Top-2 routing gives no expert more than half the assignments.
    ck_assert_int_eq(moe_plan_placement(&c, 0.6, NULL, &pp), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "expert 0 takes 60.0%"));
    const double one_hot[8] = {1, 0, 0, 0, 0, 0, 0, 0};
    ck_assert_int_eq(moe_plan_placement(&c, 0, one_hot, &pp), MOE_EINVAL);
}
END_TEST

// moe plan with drops: 4 ranks, 8 experts, 32 tokens per rank, k = 2, C = 8;
// experts 2 and 3 (both on rank 1) take every assignment: 32 rows per source
// each, 8 kept: 75% drop, rank 1 computes 4 * 16. Replicas of 2 on rank 0
// and of 3 on rank 2: each holder's budget 4 * 8 = 32 over its two sources,
// 16 each: 50% drop; rank 1 computes 2 from sources 1, 2 and 3 from 1, 0.
START_TEST(test_plan_drops_fall_with_replica_capacity) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {"model.seq_len=16", "train.batch_size=2", "router.capacity_factor=1.0",
                          "parallel.ep=4", "model.n_layers=2"};
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(moe_config_set(&c, NULL, sets[i]), 0);
    double t0[4], t1[4];
    const double load[8] = {0, 0, 1, 1, 0, 0, 0, 0};
    moe_place_plan pp = {.tokens = {t0, t1}};
    ck_assert_int_eq(moe_plan_placement(&c, 0, load, &pp), 0);
    ck_assert_int_eq(pp.replicas, 2);
    ck_assert_double_eq_tol(pp.drop_rate[0], 0.75, 1e-12);
    ck_assert_double_eq_tol(pp.drop_rate[1], 0.5, 1e-12);
    static const double w0[4] = {0, 64, 0, 0}, w1[4] = {32, 64, 32, 0};
    for (int r = 0; r < 4; r++) {
        ck_assert_double_eq_tol(t0[r], w0[r], 1e-9);
        ck_assert_double_eq_tol(t1[r], w1[r], 1e-9);
    }
}
END_TEST

// The skewed-load config (an MPI run: parallel.ep = 4) loads and passes its
// checks, at 8 ranks too with one spare slot each.
START_TEST(test_placement_skewed_config_checks) {
    moe_config c;
    moe_config_default(&c);
    moe_config_src *src = moe_config_src_new();
    int rc = moe_config_load(&c, src, MOE_SOURCE_DIR "/configs/placement_skewed.json");
    if (rc == 0) rc = moe_config_check(&c, src);
    moe_config_src_free(src);
    ck_assert_msg(rc == 0, "%s", moe_last_error());
    ck_assert_str_eq(c.placement.mode, "replicate");
    ck_assert_int_eq(moe_config_set(&c, NULL, "parallel.ep=8"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "placement.slots_per_rank=2"), 0);
    ck_assert_int_eq(moe_config_check(&c, NULL), 0);
}
END_TEST

static Suite *placement_suite(void) {
    Suite *s = suite_create("placement");
    TCase *tc = tcase_create("table");
    tcase_add_test(tc, test_placement_static_is_contiguous_blocks);
    tcase_add_test(tc, test_placement_uniform_load_stays_static);
    tcase_add_test(tc, test_placement_move_swaps_a_hot_home_away);
    tcase_add_test(tc, test_placement_move_balances_two_hot_experts_on_one_rank);
    tcase_add_test(tc, test_placement_move_balanced_load_keeps_homes);
    tcase_add_test(tc, test_placement_move_keeps_one_home_per_expert);
    tcase_add_test(tc, test_placement_replicates_the_hot_expert);
    tcase_add_test(tc, test_placement_dest_deals_non_holders_by_source_rank);
    tcase_add_test(tc, test_placement_capacity_splits_each_holders_budget);
    tcase_add_test(tc, test_placement_properties_on_random_loads);
    tcase_add_test(tc, test_placement_closed_forms_match_the_deal);
    tcase_add_test(tc, test_placement_keys_refuse_bad_combinations);
    tcase_add_test(tc, test_plan_models_placement_for_any_ranks);
    tcase_add_test(tc, test_plan_drops_fall_with_replica_capacity);
    tcase_add_test(tc, test_placement_skewed_config_checks);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(placement_suite());
}
