// Auxiliary-loss-free load balancing (router.bias_update_rate, router/bias.c):
// hand-computed selection with a bias that flips choices while the weights
// stay unbiased, the update rule's direction and sum, MaxVio by hand, a
// skewed training run balanced by the bias, bit-exact resume, the bias in
// checkpoints, `moe route`, `moe export` and metrics.jsonl, and bad values.
#include "moe/checkpoint.h"
#include "moe/cli/cli.h"
#include "moe/error.h"
#include "moe/export.h"
#include "moe/infer.h"
#include "moe/router.h"
#include "moe/safetensors.h"
#include "moe/train.h"
#include "testutil.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int run_cli(const char **args) {
    int n = 0;
    while (args[n])
        n++;
    return moe_cli_main(n, (char **)args);
}
#define MOE(...) run_cli((const char *[]){"moe", __VA_ARGS__, NULL})

static moe_router_config cfg_k(int k, bool normalize, moe_score score) {
    moe_router_config c;
    moe_router_config_default(&c);
    c.top_k = k;
    c.capacity_factor = 0.0; // dropless: selection alone decides the plan
    c.normalize_topk = normalize;
    c.score = score;
    return c;
}

static void route(moe_plan *pl, const float *x, const float *bias, int T, int E,
                  const moe_router_config *c) {
    ck_assert_int_eq(moe_plan_alloc(pl, T, E, c->top_k), 0);
    pl->bias = bias;
    ck_assert_msg(moe_router_forward(pl, x, NULL, NULL, T, E, c, false, 0) == 0, "%s",
                  moe_last_error());
}

// Token 0: p = softmax(2, 1, 0, -1) = (.6439, .2369, .0871, .0321); bias 0.2 on
// expert 2 lifts it over expert 1 (.2871 > .2369): choices 0, 2.
// Token 1: four equal logits, bias (-.1, 0, .1, 0): choice 2, then 1 and 3 tie
// at .25 and the lower index wins.
static const float X[8] = {2, 1, 0, -1, 0, 0, 0, 0};
static const float B[4] = {0, 0, 0.2f, 0};
static const float B2[4] = {-0.1f, 0, 0.1f, 0};

START_TEST(test_bias_flips_choice_weights_stay_unbiased) {
    moe_router_config c = cfg_k(2, true, MOE_SCORE_SOFTMAX);
    moe_plan pl, ref;
    route(&ref, X, NULL, 1, 4, &c);
    ck_assert_int_eq(ref.expert[0], 0);
    ck_assert_int_eq(ref.expert[1], 1);
    route(&pl, X, B, 1, 4, &c);
    ck_assert_int_eq(pl.expert[0], 0);
    ck_assert_int_eq(pl.expert[1], 2);
    double S = exp(2.0) + exp(1.0) + 1.0 + exp(-1.0), p0 = exp(2.0) / S, p2 = 1.0 / S;
    ck_assert_double_eq_tol(pl.weight[0], p0 / (p0 + p2), 1e-6);
    ck_assert_double_eq_tol(pl.weight[1], p2 / (p0 + p2), 1e-6);
    // the scores the plan keeps are the unbiased ones
    ck_assert_float_eq(pl.probs[2], ref.probs[2]);
    ck_assert_int_eq(pl.counts[2], 1);
    ck_assert_int_eq(pl.counts[1], 0);
    moe_plan_free(&pl);
    moe_plan_free(&ref);

    // raw weights: the chosen experts' unbiased probabilities
    c = cfg_k(2, false, MOE_SCORE_SOFTMAX);
    route(&pl, X, B, 1, 4, &c);
    ck_assert_double_eq_tol(pl.weight[0], p0, 1e-6);
    ck_assert_double_eq_tol(pl.weight[1], p2, 1e-6);
    moe_plan_free(&pl);

    c = cfg_k(2, true, MOE_SCORE_SOFTMAX);
    route(&pl, X + 4, B2, 1, 4, &c);
    ck_assert_int_eq(pl.expert[0], 2);
    ck_assert_int_eq(pl.expert[1], 1); // tie with expert 3: the lower index
    ck_assert_float_eq(pl.weight[0], 0.5f);
    ck_assert_float_eq(pl.weight[1], 0.5f);
    moe_plan_free(&pl);
}
END_TEST

// Sigmoid scores (DeepSeek-V3): s = (.7311, .5, .6225, .2689); bias
// (-.3, 0, 0, .4) gives (.4311, .5, .6225, .6689): choices 3 then 2, weights
// s3 / (s3 + s2) and s2 / (s3 + s2) of the unbiased scores, times route_scale.
START_TEST(test_bias_with_sigmoid_scores_hand_case) {
    const float x[4] = {1, 0, 0.5f, -1}, b[4] = {-0.3f, 0, 0, 0.4f};
    moe_router_config c = cfg_k(2, true, MOE_SCORE_SIGMOID);
    c.route_scale = 2.5;
    moe_plan pl;
    route(&pl, x, b, 1, 4, &c);
    ck_assert_int_eq(pl.expert[0], 3);
    ck_assert_int_eq(pl.expert[1], 2);
    double s2 = 1 / (1 + exp(-0.5)), s3 = 1 / (1 + exp(1.0));
    ck_assert_double_eq_tol(pl.weight[0], 2.5 * s3 / (s2 + s3), 1e-6);
    ck_assert_double_eq_tol(pl.weight[1], 2.5 * s2 / (s2 + s3), 1e-6);
    moe_plan_free(&pl);
}
END_TEST

// The biased score is (double)p + (double)b (README "Router semantics"): tiny
// scores that would tie in F32 still order. Logits [-20, -10, 10], bias
// [.5, .5, 0]: p = (e^-30, e^-20, 1) roughly, and .5 + e^-20 rounds to .5 in
// F32, so an F32 sum would tie experts 0 and 1 and choose [2, 0]; the double
// sum chooses [2, 1].
// Group scores too: 2 groups of 2, one kept, bias .5 everywhere, logits
// [10, -30, 10, -20]: the groups tie on their best expert (p0 = p2) and differ
// only in e^-40 vs e^-30 below .5, so group 1 wins (expert 2); an F32 sum ties
// them and gives group 0 (expert 0).
START_TEST(test_biased_scores_are_summed_in_double) {
    const float x[3] = {-20, -10, 10}, b[3] = {0.5f, 0.5f, 0};
    moe_router_config c = cfg_k(2, true, MOE_SCORE_SOFTMAX);
    moe_plan pl;
    route(&pl, x, b, 1, 3, &c);
    ck_assert_int_eq(pl.choice[0], 2);
    ck_assert_int_eq(pl.choice[1], 1);
    moe_plan_free(&pl);

    const float xg[4] = {10, -30, 10, -20}, bg[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    c = cfg_k(1, true, MOE_SCORE_SOFTMAX);
    c.n_groups = 2;
    c.topk_groups = 1;
    route(&pl, xg, bg, 1, 4, &c);
    ck_assert_int_eq(pl.choice[0], 2);
    moe_plan_free(&pl);
}
END_TEST

// A zero bias routes exactly as no bias: the same plan, bit for bit.
START_TEST(test_zero_bias_equals_no_bias) {
    enum { T = 64, E = 8 };
    float x[T * E], zero[E] = {0};
    tu_rng r;
    tu_seed(&r, 7);
    tu_fill_normal(&r, x, T * E, 1.0f);
    moe_router_config c = cfg_k(2, true, MOE_SCORE_SOFTMAX);
    c.capacity_factor = 1.0;
    moe_plan a, b;
    route(&a, x, NULL, T, E, &c);
    route(&b, x, zero, T, E, &c);
    ck_assert_mem_eq(a.expert, b.expert, sizeof(int) * T * 2);
    ck_assert_mem_eq(a.weight, b.weight, sizeof(float) * T * 2);
    ck_assert_mem_eq(a.kept, b.kept, sizeof(int) * E);
    moe_plan_free(&a);
    moe_plan_free(&b);
}
END_TEST

// load (8, 2, 5, 5), mean 5: expert 0 overloaded goes down by rate, expert 1
// underloaded up, experts 2 and 3 at the mean stay. Net change rate * (1 - 1).
START_TEST(test_bias_update_direction_and_sum) {
    const double load[4] = {8, 2, 5, 5};
    float b[4] = {0.5f, -0.25f, 0, 1};
    moe_router_bias_update(b, load, 4, 0.125);
    const float want[4] = {0.375f, -0.125f, 0, 1};
    ck_assert_mem_eq(b, want, sizeof want);
    // mean 4/3, not an integer: two under, one over; the sum moves by +rate
    const double l3[3] = {1, 1, 2};
    float b3[3] = {0, 0, 0};
    moe_router_bias_update(b3, l3, 3, 0.25);
    ck_assert_float_eq(b3[0], 0.25f);
    ck_assert_float_eq(b3[1], 0.25f);
    ck_assert_float_eq(b3[2], -0.25f);
    ck_assert_float_eq(b3[0] + b3[1] + b3[2], 0.25f);
    // balanced or empty load: nothing moves
    const double even[3] = {4, 4, 4}, none[3] = {0, 0, 0};
    moe_router_bias_update(b3, even, 3, 0.25);
    moe_router_bias_update(b3, none, 3, 0.25);
    ck_assert_float_eq(b3[2], -0.25f);
}
END_TEST

START_TEST(test_max_vio_by_hand) {
    const double load[4] = {8, 2, 5, 5}, even[4] = {3, 3, 3, 3}, one[4] = {0, 12, 0, 0},
                 none[4] = {0};
    ck_assert_double_eq_tol(moe_router_max_vio(load, 4), 8.0 / 5.0 - 1.0, 1e-15);
    ck_assert_double_eq(moe_router_max_vio(even, 4), 0.0);
    ck_assert_double_eq(moe_router_max_vio(one, 4), 3.0); // E - 1
    ck_assert_double_eq(moe_router_max_vio(none, 4), 0.0);
}
END_TEST

// A skewed setup: sigmoid scores and no aux loss. Without a bias, routing
// collapses within a few dozen steps onto two experts per layer (MaxVio near
// its bound E/k - 1 = 3); the bias must keep the run's mean MaxVio and the
// last step's well below that (both runs deterministic).
static moe_config skewed(double rate) {
    moe_config c = tu_small_config();
    c.train.steps = 60;
    c.train.lr = 1e-3;
    c.router.score = MOE_SCORE_SIGMOID;
    c.router.aux_loss_coef = 0.0;
    c.router.capacity_factor = 0.0; // dropless: MaxVio measures choices only
    c.moe.num_experts[0] = 8;
    c.router.bias_update_rate = rate;
    return c;
}

static double train_max_vio(const moe_config *c, const char *name, double *last) {
    char out[700];
    snprintf(out, sizeof out, "%s/%s", tu_tmpdir(), name);
    moe_train_opts o = {.out_dir = out, .quiet = true, .stop_after = c->train.steps};
    moe_train_result r;
    ck_assert_msg(moe_train(c, &o, &r) == 0, "%s", moe_last_error());
    // the last metrics line: max_vio per layer
    char path[800];
    snprintf(path, sizeof path, "%s/metrics.jsonl", out);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    char line[8192], prev[8192] = "";
    while (fgets(line, sizeof line, f))
        if (strstr(line, "\"step\"")) snprintf(prev, sizeof prev, "%s", line);
    fclose(f);
    json_error_t e;
    json_t *doc = json_loads(prev, 0, &e);
    ck_assert_msg(doc != NULL, "metrics line: %s", e.text);
    json_t *layers = json_object_get(doc, "layers");
    ck_assert_int_eq(json_array_size(layers), 2);
    *last = 0;
    for (size_t i = 0; i < 2; i++) {
        json_t *L = json_array_get(layers, i), *load = json_object_get(L, "load");
        ck_assert(json_is_number(json_object_get(L, "max_vio")));
        // one process, no accumulation: the step's global load is the plan's
        double ld[8], v = json_number_value(json_object_get(L, "max_vio"));
        for (int x = 0; x < 8; x++)
            ld[x] = json_number_value(json_array_get(load, x));
        ck_assert_double_eq_tol(v, moe_router_max_vio(ld, 8), 1e-6);
        *last += v / 2;
    }
    json_decref(doc);
    return r.max_vio;
}

START_TEST(test_training_with_bias_lowers_max_vio) {
    double last0, last1;
    moe_config c0 = skewed(0.0), c1 = skewed(0.001);
    double v0 = train_max_vio(&c0, "off", &last0), v1 = train_max_vio(&c1, "on", &last1);
    printf("mean MaxVio over 60 steps: rate 0 %.3f, rate 0.001 %.3f; last step %.3f vs %.3f\n", v0,
           v1, last0, last1);
    ck_assert_msg(v0 > 2.0 && last0 > 2.5, "the setup is not skewed: MaxVio %.3f, last %.3f", v0,
                  last0);
    ck_assert_msg(v1 < 0.6 * v0, "MaxVio with the bias %.3f, without %.3f", v1, v0);
    ck_assert_msg(last1 < 0.5 * last0, "last-step MaxVio %.3f vs %.3f", last1, last0);
}
END_TEST

static void read_bias(const char *ckpt, int l, float *out, int E) {
    moe_st_set *s;
    ck_assert_msg(moe_st_set_open(ckpt, &s) == 0, "%s", moe_last_error());
    bool found = false;
    ck_assert_int_eq(moe_ckpt_bias_read(s, ckpt, l, E, out, &found), 0);
    ck_assert(found);
    moe_st_set_close(s);
}

// Straight 8 steps vs 4 + resume 4, with the bias moving every step: the same
// losses, model (bias included), optimizer and trainer state, bit for bit.
START_TEST(test_resume_is_bit_exact_with_bias) {
    moe_config c = skewed(0.01);
    c.train.steps = 8;
    c.train.lr = 1e-2;
    c.train.grad_accum = 2;
    c.router.capacity_factor = 1.0;
    const char *dir = tu_tmpdir();
    char a[600], b[600], ckb[700], pa[700], pb[700];
    snprintf(a, sizeof a, "%s/straight", dir);
    snprintf(b, sizeof b, "%s/halves", dir);
    snprintf(ckb, sizeof ckb, "%s/checkpoint", b);
    double la[8] = {0}, lb[8] = {0};
    moe_train_result r;
    moe_train_opts o = {.out_dir = a, .quiet = true, .losses = la};
    ck_assert_int_eq(moe_train(&c, &o, &r), 0);
    moe_eval_result_free(&r.eval);
    moe_train_opts h1 = {.out_dir = b, .quiet = true, .losses = lb, .stop_after = 4};
    ck_assert_int_eq(moe_train(&c, &h1, &r), 0);
    float half[8], full[8];
    read_bias(ckb, 0, half, 8);
    moe_train_opts h2 = {.out_dir = b, .resume_dir = ckb, .quiet = true, .losses = lb};
    ck_assert_msg(moe_train(&c, &h2, &r) == 0, "%s", moe_last_error());
    moe_eval_result_free(&r.eval);
    for (int i = 0; i < 8; i++)
        ck_assert_msg(la[i] == lb[i], "step %d: %.9g vs %.9g", i, la[i], lb[i]);
    snprintf(pa, sizeof pa, "%s/checkpoint", a);
    snprintf(pb, sizeof pb, "%s/checkpoint", b);
    tu_assert_same_checkpoint(pa, pb);
    // the bias moved by multiples of the rate: after 4 steps |b_e| <= 4 rate,
    // non-zero somewhere, and it went on moving after the resume
    read_bias(ckb, 0, full, 8);
    bool moved = false, changed = false;
    for (int e = 0; e < 8; e++) {
        ck_assert(fabsf(half[e]) <= 4 * 0.01f + 1e-6f);
        moved |= half[e] != 0, changed |= half[e] != full[e];
    }
    ck_assert(moved && changed);
}
END_TEST

// A checkpoint with a non-zero bias brings it into a model that would not
// move it (rate 0): loaded and routing with it; a bad bias tensor is refused.
START_TEST(test_checkpoint_bias_loads_and_bad_bias_refused) {
    moe_config c = tu_ckpt_config();
    c.router.bias_update_rate = 0.01;
    moe_model m;
    moe_adamw opt;
    ck_assert_int_eq(moe_model_init(&m, &c, 2, 16, 5), 0);
    ck_assert(m.bias_on && m.a[0].moe.plan.bias == moe_model_bias(&m, 0));
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    float *b = moe_model_bias(&m, 1);
    for (int e = 0; e < 4; e++)
        b[e] = 0.25f * (e - 1);
    moe_train_state st = {0};
    char ck[600];
    snprintf(ck, sizeof ck, "%s/ck", tu_tmpdir());
    ck_assert_msg(moe_ckpt_save(ck, &m, &opt, &st, NULL) == 0, "%s", moe_last_error());
    moe_adamw_free(&opt);
    moe_model_free(&m);

    moe_config c0 = tu_ckpt_config(); // rate 0: no bias of its own
    ck_assert_int_eq(moe_model_init(&m, &c0, 2, 16, 5), 0);
    ck_assert(!m.bias_on && m.a[1].moe.plan.bias == NULL);
    ck_assert_msg(moe_ckpt_load(ck, &m, NULL, NULL) == 0, "%s", moe_last_error());
    ck_assert(m.bias_on && m.a[1].moe.plan.bias == moe_model_bias(&m, 1));
    for (int e = 0; e < 4; e++)
        ck_assert_float_eq(moe_model_bias(&m, 1)[e], 0.25f * (e - 1));
    moe_model_free(&m);

    // a bias of the wrong length, then a NaN: refused naming the tensor
    float bad[5] = {0, 0, 0, 0, 0};
    moe_st_entry e5 = {
        "model.layers.0.block_sparse_moe.gate.e_score_correction_bias", MOE_ST_F32, 1, {5}, bad};
    char p[700], bad_dir[600];
    snprintf(bad_dir, sizeof bad_dir, "%s", tu_tmpdir()); // a fresh folder per call
    snprintf(p, sizeof p, "%s/model.safetensors", bad_dir);
    ck_assert_int_eq(moe_st_write(p, &e5, 1, NULL), 0);
    snprintf(p, sizeof p, "%s", bad_dir);
    moe_st_set *s;
    float out[4];
    bool found;
    ck_assert_int_eq(moe_st_set_open(p, &s), 0);
    ck_assert_int_eq(moe_ckpt_bias_read(s, p, 0, 4, out, &found), MOE_EFORMAT);
    ck_assert_msg(strstr(moe_last_error(), "e_score_correction_bias") &&
                      strstr(moe_last_error(), "F32 [4]"),
                  "%s", moe_last_error());
    ck_assert(!found);
    moe_st_set_close(s);
    e5.shape[0] = 4;
    bad[2] = NAN;
    snprintf(p, sizeof p, "%s/model.safetensors", bad_dir);
    ck_assert_int_eq(moe_st_write(p, &e5, 1, NULL), 0);
    snprintf(p, sizeof p, "%s", bad_dir);
    ck_assert_int_eq(moe_st_set_open(p, &s), 0);
    int rc = moe_ckpt_bias_read(s, p, 0, 4, out, &found);
    ck_assert_msg(rc == MOE_EFORMAT || rc == MOE_ENUMERIC, "rc %d", rc);
    moe_st_set_close(s);
    // names: only the canonical spelling of an existing layer
    ck_assert_int_eq(moe_ckpt_bias_layer(e5.name), 0);
    ck_assert_int_eq(
        moe_ckpt_bias_layer("model.layers.03.block_sparse_moe.gate.e_score_correction_bias"), -1);
    ck_assert_int_eq(moe_ckpt_bias_layer("model.layers.1.block_sparse_moe.gate.weight"), -1);
}
END_TEST

// Inference (`moe generate`, `moe eval`) routes with the checkpoint's bias: the
// KV-cache prefill equals the training forward of the loaded model, and a bias
// that moves choices changes the logits.
START_TEST(test_inference_routes_with_the_checkpoint_bias) {
    moe_config c = tu_ckpt_config();
    c.router.bias_update_rate = 0.01;
    moe_model m;
    moe_adamw opt;
    ck_assert_int_eq(moe_model_init(&m, &c, 2, 16, 5), 0);
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    for (int l = 0; l < 2; l++)
        for (int e = 0; e < 4; e++)
            moe_model_bias(&m, l)[e] = e == 3 - l ? 0.5f : 0.0f; // every token picks 3 - l
    moe_train_state st = {0};
    char ck[600];
    snprintf(ck, sizeof ck, "%s/ck", tu_tmpdir());
    ck_assert_int_eq(moe_ckpt_save(ck, &m, &opt, &st, NULL), 0);
    moe_adamw_free(&opt);
    moe_model_free(&m);

    moe_config c0 = tu_ckpt_config();
    moe_model ref, plain;
    ck_assert_int_eq(moe_model_init(&ref, &c0, 1, 16, 5), 0);
    ck_assert_int_eq(moe_model_init(&plain, &c0, 1, 16, 5), 0);
    ck_assert_int_eq(moe_ckpt_load(ck, &ref, NULL, NULL), 0);
    ck_assert_int_eq(moe_ckpt_load(ck, &plain, NULL, NULL), 0);
    for (int l = 0; l < 2; l++) // the same weights routed without the bias
        plain.a[l].moe.plan.bias = NULL;
    ref.dropless = plain.dropless = true;
    int32_t tok[7] = {128 + 2, 'c', 'a', 'b', 'x', 'q', 'm'}, tid = 2;
    ck_assert_int_eq(moe_model_forward(&ref, tok, NULL, &tid, 1, 7, false, 0), 0);
    ck_assert_int_eq(moe_model_forward(&plain, tok, NULL, &tid, 1, 7, false, 0), 0);
    for (int t = 0; t < 7; t++)
        ck_assert_int_eq(ref.a[1].moe.plan.choice[t * 2], 2);
    moe_infer e;
    moe_infer_opts o = {.task = "sort"};
    ck_assert_msg(moe_infer_open(&e, ck, &o) == 0, "%s", moe_last_error());
    ck_assert_ptr_nonnull(e.layer[0].plan.bias);
    int seq[7] = {0}, pos[7] = {0, 1, 2, 3, 4, 5, 6};
    ck_assert_msg(moe_infer_forward(&e, tok, seq, pos, 7) == 0, "%s", moe_last_error());
    double worst = 0, moved = 0;
    for (int i = 0; i < 7 * ref.V; i++) {
        worst = fmax(worst, fabs(e.logits[i] - ref.logits[i]));
        moved = fmax(moved, fabs(plain.logits[i] - ref.logits[i]));
    }
    ck_assert_msg(worst <= 1e-5, "inference vs forward: %g", worst);
    ck_assert_msg(moved > 1e-4, "the bias did not change the logits (%g)", moved);
    moe_infer_free(&e);
    moe_model_free(&ref);
    moe_model_free(&plain);
}
END_TEST

// Export: a zero bias is left out (Mixtral has none), a non-zero one refused.
START_TEST(test_export_refuses_nonzero_bias) {
    moe_config c = tu_ckpt_config();
    c.router.bias_update_rate = 0.01;
    char ck[600], out[600];
    snprintf(ck, sizeof ck, "%s/zero", tu_tmpdir());
    snprintf(out, sizeof out, "%s/hf-zero", tu_tmpdir());
    tu_save_checkpoint(&c, ck);
    ck_assert_msg(moe_export_hf(ck, out) == 0, "%s", moe_last_error());
    char p[700];
    snprintf(p, sizeof p, "%s/model.safetensors", out);
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(p, &f), 0);
    ck_assert_ptr_null(
        moe_st_find(f, "model.layers.0.block_sparse_moe.gate.e_score_correction_bias"));
    ck_assert_ptr_nonnull(moe_st_find(f, "model.layers.0.block_sparse_moe.gate.weight"));
    moe_st_close(f);

    moe_model m;
    moe_adamw opt;
    ck_assert_int_eq(moe_model_init(&m, &c, 2, 16, 5), 0);
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    moe_model_bias(&m, 1)[3] = -0.01f;
    moe_train_state st = {0};
    snprintf(ck, sizeof ck, "%s/moved", tu_tmpdir());
    snprintf(out, sizeof out, "%s/hf-moved", tu_tmpdir());
    ck_assert_int_eq(moe_ckpt_save(ck, &m, &opt, &st, NULL), 0);
    moe_adamw_free(&opt);
    moe_model_free(&m);
    ck_assert_int_eq(moe_export_hf(ck, out), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "model.layers.1.block_sparse_moe.gate.e_score_"
                                           "correction_bias") &&
                      strstr(moe_last_error(), "router.bias_update_rate"),
                  "%s", moe_last_error());
    ck_assert_int_eq(tu_count_entries(out), -1); // nothing written
}
END_TEST

// `moe route` with a 'bias' tensor in the logits file: the plan of
// moe_router_forward with that bias; a bias of the wrong length exits 2.
START_TEST(test_route_reads_bias_from_logits_file) {
    enum { T = 16, E = 4 };
    float x[T * E], b[E] = {0.3f, -0.2f, 0.05f, 0};
    tu_rng r;
    tu_seed(&r, 3);
    tu_fill_normal(&r, x, T * E, 1.0f);
    char in[700], out[700];
    snprintf(in, sizeof in, "%s/logits.safetensors", tu_tmpdir());
    snprintf(out, sizeof out, "%s/plan.safetensors", tu_tmpdir());
    moe_st_entry e[2] = {{"logits", MOE_ST_F32, 2, {T, E}, x}, {"bias", MOE_ST_F32, 1, {E}, b}};
    ck_assert_int_eq(moe_st_write(in, e, 2, NULL), 0);
    ck_assert_int_eq(
        MOE("route", "--logits", in, "--set", "router.capacity_factor=1", "--out", out), 0);
    moe_router_config c;
    moe_router_config_default(&c);
    c.capacity_factor = 1.0;
    moe_plan pl, nb;
    route(&pl, x, b, T, E, &c);
    route(&nb, x, NULL, T, E, &c);
    ck_assert_msg(memcmp(pl.choice, nb.choice, sizeof(int) * T * 2) != 0,
                  "the bias should change some choice in this batch");
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(out, &f), 0);
    const char *names[] = {"expert", "weight", "counts"};
    const void *want[] = {pl.expert, pl.weight, pl.counts};
    for (int i = 0; i < 3; i++) {
        const moe_st_tensor *t = moe_st_find(f, names[i]);
        ck_assert_ptr_nonnull(t);
        void *got = malloc(t->nbytes);
        ck_assert_int_eq(moe_st_read(f, t, got, t->nbytes), 0);
        ck_assert_msg(!memcmp(got, want[i], t->nbytes), "'%s' differs", names[i]);
        free(got);
    }
    ck_assert_str_eq(moe_st_meta(f, "route.bias"), "true");
    moe_st_close(f);
    moe_plan_free(&pl);
    moe_plan_free(&nb);

    e[1].shape[0] = E - 1;
    ck_assert_int_eq(moe_st_write(in, e, 2, NULL), 0);
    unlink(out);
    ck_assert_int_eq(MOE("route", "--logits", in, "--out", out), 2);
    ck_assert(access(out, F_OK) != 0);
}
END_TEST

START_TEST(test_bad_bias_update_rate_refused) {
    moe_config c;
    const char *bad[] = {"router.bias_update_rate=-0.001", "router.bias_update_rate=2",
                         "router.bias_update_rate=nan", "router.bias_update_rate=fast"};
    for (int i = 0; i < 4; i++) {
        moe_config_default(&c);
        ck_assert_msg(moe_config_set(&c, NULL, bad[i]) < 0, "%s accepted", bad[i]);
        ck_assert_msg(strstr(moe_last_error(), "router.bias_update_rate"), "%s", moe_last_error());
    }
    moe_config_default(&c);
    ck_assert_int_eq(moe_config_set(&c, NULL, "router.bias_update_rate=0.001"), 0);
    ck_assert_double_eq(c.router.bias_update_rate, 0.001);
    ck_assert_int_eq(moe_config_check(&c, NULL), 0);
    // gumbel picks choices 2..k off the biased scores
    c.router.noise = MOE_NOISE_GUMBEL;
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "router.bias_update_rate") &&
                      strstr(moe_last_error(), "gumbel"),
                  "%s", moe_last_error());
    // task-routed layers pick experts per task
    moe_config_default(&c);
    c.router.bias_update_rate = 0.001;
    c.moe.n_task_layers = 1;
    c.moe.task_layers[0] = 0;
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "moe.task_layers"), "%s", moe_last_error());
    moe_router_config rc;
    moe_router_config_default(&rc);
    ck_assert_int_lt(moe_router_config_set(&rc, "router.bias_update_rate", "1.5"), 0);
    ck_assert_int_eq(moe_router_config_set(&rc, "router.bias_update_rate", "0.5"), 0);
}
END_TEST

// The GPU training path (here on the CPU table) refuses the bias by name.
START_TEST(test_device_path_refuses_bias) {
    moe_config c = tu_small_config();
    c.train.steps = 2;
    c.router.bias_update_rate = 0.001;
    char out[700];
    snprintf(out, sizeof out, "%s/dev", tu_tmpdir());
    moe_train_opts o = {.out_dir = out, .quiet = true, .device_ops = &moe_ops_cpu};
    moe_train_result r;
    ck_assert_int_eq(moe_train(&c, &o, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "router.bias_update_rate"), "%s", moe_last_error());
}
END_TEST

// `moe plan` takes the key, and the --help-config table documents it.
START_TEST(test_plan_and_help_config_know_the_key) {
    char cfg[700];
    snprintf(cfg, sizeof cfg, "%s/configs/tiny.json --set router.bias_update_rate=0.001",
             MOE_SOURCE_DIR);
    char args[900];
    snprintf(args, sizeof args, "plan %s", cfg);
    ck_assert_int_eq(tu_run_moe(tu_dir, args), 0);
    snprintf(args, sizeof args, "plan %s/configs/tiny.json --set router.bias_update_rate=-1",
             MOE_SOURCE_DIR);
    ck_assert_int_eq(tu_run_moe(tu_dir, args), 2);
    ck_assert_ptr_nonnull(strstr(tu_file_text(tu_dir, "err.txt"), "router.bias_update_rate"));
    ck_assert_int_eq(tu_run_moe(tu_dir, "train --help-config"), 0);
    ck_assert_ptr_nonnull(strstr(tu_file_text(tu_dir, "out.txt"), "router.bias_update_rate"));
}
END_TEST

static Suite *bias_suite(void) {
    Suite *s = suite_create("router_bias");
    TCase *tc = tcase_create("rule");
    tcase_add_test(tc, test_bias_flips_choice_weights_stay_unbiased);
    tcase_add_test(tc, test_bias_with_sigmoid_scores_hand_case);
    tcase_add_test(tc, test_biased_scores_are_summed_in_double);
    tcase_add_test(tc, test_zero_bias_equals_no_bias);
    tcase_add_test(tc, test_bias_update_direction_and_sum);
    tcase_add_test(tc, test_max_vio_by_hand);
    tcase_add_test(tc, test_bad_bias_update_rate_refused);
    suite_add_tcase(s, tc);
    tc = tcase_create("train");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_training_with_bias_lowers_max_vio);
    tcase_add_test(tc, test_resume_is_bit_exact_with_bias);
    tcase_add_test(tc, test_checkpoint_bias_loads_and_bad_bias_refused);
    tcase_add_test(tc, test_inference_routes_with_the_checkpoint_bias);
    tcase_add_test(tc, test_export_refuses_nonzero_bias);
    tcase_add_test(tc, test_route_reads_bias_from_logits_file);
    tcase_add_test(tc, test_device_path_refuses_bias);
    suite_add_tcase(s, tc);
    tc = tcase_create("cli");
    tcase_add_checked_fixture(tc, tu_dir_setup, tu_dir_teardown);
    tcase_add_test(tc, test_plan_and_help_config_know_the_key);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(bias_suite());
}
