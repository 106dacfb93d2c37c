// The optimizer against hand computation: AdamW moments, bias correction and
// decoupled weight decay over two steps; which tensors decay (GPT-2 rule, or
// every tensor with train.decay_all) and the decayed ranges giving the byte
// mask's bits; bf16 moments (rounding to nearest even, one step against a
// double reference); the warmup + cosine schedule at its corners;
// global-norm clipping.
#include "kernels/cpu/cpu.h"
#include "moe/alloc.h"
#include "moe/bf16.h"
#include "moe/config.h"
#include "moe/error.h"
#include "moe/model.h"
#include "moe/optim.h"
#include "testutil.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

// Three views: a projection, a norm and the embedding, two floats each.
static moe_param_table table3(void) {
    moe_param_table t;
    moe_param_table_init(&t);
    const int64_t shape[1] = {2};
    ck_assert_int_eq(
        moe_param_table_add(&t, "model.layers.0.", "self_attn.q_proj.weight", 1, shape), 0);
    ck_assert_int_eq(moe_param_table_add(&t, "model.layers.0.", "input_layernorm.weight", 1, shape),
                     0);
    ck_assert_int_eq(moe_param_table_add(&t, "model.", "embed_tokens.weight", 1, shape), 0);
    return t;
}

START_TEST(test_adamw_two_steps_by_hand) {
    moe_param_table t = table3();
    moe_adamw opt;
    ck_assert_int_eq(moe_adamw_init(&opt, &t, false), 0);
    float p[6] = {1.0f, -2.0f, 0.5f, 1.5f, 3.0f, -1.0f};
    const float g[2][6] = {{0.1f, -0.2f, 0.3f, 0.0f, -0.5f, 1.0f},
                           {-0.3f, 0.1f, 0.2f, 0.4f, 0.5f, -1.0f}};
    const double lr = 0.01, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    double want[6], m[6] = {0}, v[6] = {0};
    for (int i = 0; i < 6; i++)
        want[i] = p[i];
    for (int s = 0; s < 2; s++) {
        moe_adamw_update(&opt, p, g[s], (float)lr, (float)b1, (float)b2, (float)eps, (float)wd);
        for (int i = 0; i < 6; i++) {
            m[i] = b1 * m[i] + (1 - b1) * g[s][i];
            v[i] = b2 * v[i] + (1 - b2) * g[s][i] * g[s][i];
            double mhat = m[i] / (1 - pow(b1, s + 1)), vhat = v[i] / (1 - pow(b2, s + 1));
            double decay = i < 2 ? wd : 0.0; // only the projection decays
            want[i] -= lr * (mhat / (sqrt(vhat) + eps) + decay * want[i]);
        }
        for (int i = 0; i < 6; i++)
            ck_assert_msg(fabs(p[i] - want[i]) <= 1e-6, "step %d param %d: %.8f vs %.8f", s, i,
                          p[i], want[i]);
    }
    ck_assert_int_eq(opt.step, 2);
    moe_adamw_free(&opt);
    moe_param_table_free(&t);
}
END_TEST

START_TEST(test_decay_mask) {
    moe_param_table t = table3();
    moe_adamw opt;
    ck_assert_int_eq(moe_adamw_init(&opt, &t, false), 0);
    const unsigned char gpt2[6] = {1, 1, 0, 0, 0, 0};
    unsigned char mask[6];
    moe_adamw_decay_mask(&opt, mask);
    ck_assert_int_eq(opt.n_decay, 1);
    for (int i = 0; i < 6; i++)
        ck_assert_int_eq(mask[i], gpt2[i]);
    moe_adamw_free(&opt);
    ck_assert_int_eq(moe_adamw_init(&opt, &t, true), 0);
    ck_assert_int_eq(opt.n_decay, 1); // adjacent decayed views: one range
    ck_assert_uint_eq(opt.decay[0], 0);
    ck_assert_uint_eq(opt.decay[1], 6);
    moe_adamw_decay_mask(&opt, mask);
    for (int i = 0; i < 6; i++)
        ck_assert_int_eq(mask[i], 1);
    moe_adamw_free(&opt);
    moe_param_table_free(&t);

    moe_config c; // the key: default off, typed bool
    moe_config_default(&c);
    ck_assert(!c.train.decay_all);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.decay_all=true"), 0);
    ck_assert(c.train.decay_all);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.decay_all=maybe"), MOE_EINVAL);
}
END_TEST

START_TEST(test_lr_schedule) {
    const float lr = 1e-3f, lo = 0.1f;
    ck_assert_float_eq_tol(moe_lr_schedule(0, 100, 10, lr, lo), 1e-4f, 1e-9f);
    ck_assert_float_eq_tol(moe_lr_schedule(9, 100, 10, lr, lo), 1e-3f, 1e-9f);
    ck_assert_float_eq_tol(moe_lr_schedule(10, 100, 10, lr, lo), 1e-3f, 1e-9f);   // cosine start
    ck_assert_float_eq_tol(moe_lr_schedule(55, 100, 10, lr, lo), 5.5e-4f, 1e-9f); // half way
    ck_assert_float_eq_tol(moe_lr_schedule(100, 100, 10, lr, lo), 1e-4f, 1e-9f);
    ck_assert_float_eq_tol(moe_lr_schedule(500, 100, 10, lr, lo), 1e-4f, 1e-9f); // stays at min
    ck_assert_float_eq_tol(moe_lr_schedule(3, 5, 5, lr, lo), 8e-4f, 1e-9f);      // all warmup
}
END_TEST

// train.lr may be anything up to FLT_MAX (a run meant to diverge uses 1e30):
// the schedule never exceeds lr_max, so no step of it may overflow to inf.
START_TEST(test_lr_schedule_stays_finite_up_to_flt_max) {
    const float big[] = {FLT_MAX, 3e38f, 1e30f};
    for (int i = 0; i < 3; i++) {
        const float lr = big[i];
        for (int step = 0; step < 12; step++) {
            float v = moe_lr_schedule(step, 20, 10, lr, 0.1f);
            ck_assert_msg(isfinite(v) && v > 0 && v <= lr, "lr %g step %d: %g", lr, step, v);
        }
        ck_assert(moe_lr_schedule(9, 20, 10, lr, 0.1f) == lr); // warmup ends at lr_max
        ck_assert_float_eq_tol(moe_lr_schedule(4, 20, 10, lr, 0.1f), lr / 2, lr * 1e-6f);
        ck_assert(moe_lr_schedule(40, 20, 10, lr, 0.1f) <= lr); // the cosine floor
        ck_assert(moe_lr_schedule(5, 20, 0, lr, 1.0f) == lr);   // no warmup, flat
    }
    // the largest step count a warmup allows (1e9) stays exact at its end
    ck_assert(moe_lr_schedule(999999999, 1000000000, 1000000000, FLT_MAX, 0.1f) == FLT_MAX);
}
END_TEST

START_TEST(test_grad_clip) {
    float g[2] = {3.0f, 4.0f};
    double norm = moe_grad_norm(g, 2);
    ck_assert_double_eq_tol(norm, 5.0, 1e-12);
    ck_assert_float_eq(moe_grad_clip(g, 2, norm, 10.0), 1.0f); // below the limit: untouched
    ck_assert_float_eq(g[0], 3.0f);
    float s = moe_grad_clip(g, 2, norm, 1.0);
    ck_assert_float_eq_tol(s, 0.2f, 1e-6f);
    ck_assert_double_eq_tol(moe_grad_norm(g, 2), 1.0, 1e-6);
    ck_assert_float_eq(moe_grad_clip(g, 2, NAN, 1.0), 1.0f);  // the caller stops on NaN
    ck_assert_float_eq(moe_grad_clip(g, 2, 50.0, 0.0), 1.0f); // 0: no clipping
}
END_TEST

// The fused pass equals moe_grad_clip followed by moe_adamw_update bit for
// bit (params and both moments), clipped or not, over a buffer of several
// of the kernel's chunks with a ragged end.
START_TEST(test_fused_clip_adamw_equals_two_passes) {
    enum { N = 3 * 32768 + 1001 };
    const int64_t shape[1] = {N};
    moe_param_table t;
    moe_param_table_init(&t);
    ck_assert_int_eq(moe_param_table_add(&t, "model.", "layers.0.mlp.weight", 1, shape), 0);
    tu_rng r;
    tu_seed(&r, 9);
    float *p0 = malloc(sizeof(float) * N), *g = malloc(sizeof(float) * N);
    float *pa = malloc(sizeof(float) * N), *pb = malloc(sizeof(float) * N);
    float *gc = malloc(sizeof(float) * N);
    tu_fill_normal(&r, p0, N, 1.0f);
    tu_fill_normal(&r, g, N, 0.1f);
    for (int clip = 0; clip < 2; clip++) {
        moe_adamw a, b;
        ck_assert_int_eq(moe_adamw_init(&a, &t, false), 0);
        ck_assert_int_eq(moe_adamw_init(&b, &t, false), 0);
        memcpy(pa, p0, sizeof(float) * N), memcpy(pb, p0, sizeof(float) * N);
        for (int step = 0; step < 3; step++) {
            const double norm = moe_grad_norm(g, N), max_norm = clip ? norm / 3 : 0.0;
            memcpy(gc, g, sizeof(float) * N);
            float s1 = moe_grad_clip(gc, N, norm, max_norm);
            moe_adamw_update(&a, pa, gc, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f);
            float s2 = moe_adamw_update_clipped(&b, pb, g, norm, max_norm, 1e-2f, 0.9f, 0.95f,
                                                1e-8f, 0.1f);
            ck_assert_float_eq(s1, s2);
            ck_assert(clip ? s1 < 1.0f : s1 == 1.0f);
        }
        ck_assert(!memcmp(pa, pb, sizeof(float) * N));
        ck_assert(!memcmp(a.m, b.m, sizeof(float) * N));
        ck_assert(!memcmp(a.v, b.v, sizeof(float) * N));
        ck_assert(memcmp(pa, p0, sizeof(float) * N)); // the step did move the weights
        moe_adamw_free(&a), moe_adamw_free(&b);
    }
    free(p0), free(g), free(pa), free(pb), free(gc);
    moe_param_table_free(&t);
}
END_TEST

// The chunked, vectorised sum of squares agrees with a plain double sum.
START_TEST(test_grad_norm_matches_plain_sum) {
    enum { N = 5 * 32768 + 77 };
    float *g = malloc(sizeof(float) * N);
    tu_rng r;
    tu_seed(&r, 10);
    tu_fill_normal(&r, g, N, 1.0f);
    double s = 0.0;
    for (int i = 0; i < N; i++)
        s += (double)g[i] * g[i];
    ck_assert_double_eq_tol(moe_grad_norm(g, N), sqrt(s), 1e-12 * sqrt(s));
    ck_assert_double_eq(moe_grad_norm(g, 5),
                        sqrt((double)g[0] * g[0] + (double)g[1] * g[1] + (double)g[2] * g[2] +
                             (double)g[3] * g[3] + (double)g[4] * g[4]));
    free(g);
}
END_TEST

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// Rounding to nearest even on hand-picked patterns: exact values, both
// directions of a tie, just off a tie, a carry into the exponent (and past
// the largest finite value), negatives, subnormals; NaN stays NaN.
START_TEST(test_bf16_round_to_nearest_even) {
    static const uint32_t cases[][2] = {
        {0x3f800000u, 0x3f80}, // 1.0: exact
        {0x3f808000u, 0x3f80}, // tie, kept bit even: down
        {0x3f818000u, 0x3f82}, // tie, kept bit odd: up to even
        {0x3f807fffu, 0x3f80}, // just below the tie
        {0x3f808001u, 0x3f81}, // just above the tie
        {0x3fff8000u, 0x4000}, // tie, odd: the carry makes 2.0 (exponent + 1)
        {0x3fffffffu, 0x4000}, // just below 2.0
        {0x7f7fffffu, 0x7f80}, // largest float: rounds to infinity
        {0xbf818000u, 0xbf82}, // negative tie, odd: away from zero
        {0xbf808000u, 0xbf80}, // negative tie, even
        {0x00018000u, 0x0002}, // subnormal tie, odd
        {0x00008000u, 0x0000}, // subnormal tie, even: zero
        {0x80000000u, 0x8000}, // -0
        {0x7f800000u, 0x7f80}, // +inf
        {0xff800000u, 0xff80}, // -inf
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        ck_assert_msg(moe_bf16_round(from_bits(cases[i][0])) == cases[i][1],
                      "0x%08x -> 0x%04x, expected 0x%04x", cases[i][0],
                      moe_bf16_round(from_bits(cases[i][0])), cases[i][1]);
    // NaNs whose payload sits in the dropped bits, or whose rounding would
    // carry out of the sign: still NaN, sign kept.
    static const uint32_t nans[] = {0x7f800001u, 0x7fffffffu, 0xff800001u, 0x7fc00000u};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        const uint16_t h = moe_bf16_round(from_bits(nans[i]));
        ck_assert_msg(isnan(moe_bf16_to_float(h)), "0x%08x -> 0x%04x", nans[i], h);
        ck_assert_uint_eq(h >> 15, nans[i] >> 31);
    }
    ck_assert(moe_bf16_to_float(0x3f81) == 1.0078125f); // widening is exact
    ck_assert_uint_eq(bits(moe_bf16_to_float(0xc0a0)), 0xc0a00000u);
}
END_TEST

// One bf16 step against a double reference: the stored moments are the
// reference moments rounded to nearest even, and the parameters move by the
// step of the unrounded moments (a step from the rounded ones would be off by
// up to 2^-9 of it, far above the tolerance). An fp32 optimizer started from
// the same moments gives the same parameter bits (the same float arithmetic)
// and moments whose rounding is the bf16 ones. N = 37 covers the 8-wide
// conversions and their scalar tail.
START_TEST(test_bf16_step_matches_double_reference) {
    enum { N = 37 };
    const int64_t s1[1] = {30}, s2[1] = {7};
    moe_param_table t;
    moe_param_table_init(&t);
    ck_assert_int_eq(moe_param_table_add(&t, "model.layers.0.", "mlp.weight", 1, s1), 0);
    ck_assert_int_eq(moe_param_table_add(&t, "model.layers.0.", "post_norm.weight", 1, s2), 0);
    moe_adamw opt;
    ck_assert_int_eq(moe_adamw_init_state(&opt, &t, false, MOE_ADAMW_BF16), 0);
    ck_assert(opt.m16 && opt.v16 && !opt.m && !opt.v);
    tu_rng r;
    tu_seed(&r, 21);
    float p[N], g[N], m0[N], v0[N];
    tu_fill_normal(&r, p, N, 1.0f);
    tu_fill_normal(&r, g, N, 0.2f);
    tu_fill_normal(&r, m0, N, 0.05f);
    tu_fill_normal(&r, v0, N, 0.01f);
    for (int i = 0; i < N; i++)
        v0[i] = v0[i] * v0[i];
    moe_adamw_moment_set(&opt, 0, 0, N, m0);
    moe_adamw_moment_set(&opt, 1, 0, N, v0);
    float mw[N], vw[N]; // the stored (rounded) moments, as the step reads them
    moe_adamw_moment_get(&opt, 0, 0, N, mw);
    moe_adamw_moment_get(&opt, 1, 0, N, vw);
    for (int i = 0; i < N; i++)
        ck_assert_uint_eq(bits(mw[i]), (uint32_t)moe_bf16_round(m0[i]) << 16);
    opt.step = 4; // this is step 5: bias corrections below one
    const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1, scale = 0.5;
    double want[N], wm[N], wv[N];
    for (int i = 0; i < N; i++) {
        const double gi = (double)g[i] * scale;
        wm[i] = b1 * mw[i] + (1 - b1) * gi;
        wv[i] = b2 * vw[i] + (1 - b2) * gi * gi;
        const double mhat = wm[i] / (1 - pow(b1, 5)), vhat = wv[i] / (1 - pow(b2, 5));
        want[i] = p[i] - lr * (mhat / (sqrt(vhat) + eps) + (i < 30 ? wd : 0.0) * p[i]);
    }
    // The fp32 optimizer from the same (widened) moments: the same arithmetic.
    moe_adamw o32;
    ck_assert_int_eq(moe_adamw_init(&o32, &t, false), 0);
    memcpy(o32.m, mw, sizeof mw), memcpy(o32.v, vw, sizeof vw);
    o32.step = 4;
    float p32[N];
    memcpy(p32, p, sizeof p);
    // max_norm = norm * scale clips by that scale (clip_scale's 1e-6 aside)
    moe_adamw_update_clipped(&opt, p, g, 1.0, scale * (1.0 + 1e-6), (float)lr, (float)b1, (float)b2,
                             (float)eps, (float)wd);
    moe_adamw_update_clipped(&o32, p32, g, 1.0, scale * (1.0 + 1e-6), (float)lr, (float)b1,
                             (float)b2, (float)eps, (float)wd);
    ck_assert(!memcmp(p, p32, sizeof p));
    for (int i = 0; i < N; i++)
        ck_assert(opt.m16[i] == moe_bf16_round(o32.m[i]) && opt.v16[i] == moe_bf16_round(o32.v[i]));
    moe_adamw_free(&o32);
    float mg[N], vg[N];
    moe_adamw_moment_get(&opt, 0, 0, N, mg);
    moe_adamw_moment_get(&opt, 1, 0, N, vg);
    for (int i = 0; i < N; i++) {
        ck_assert_msg(opt.m16[i] == moe_bf16_round((float)wm[i]), "m[%d]: 0x%04x vs %.9g", i,
                      opt.m16[i], wm[i]);
        ck_assert_msg(opt.v16[i] == moe_bf16_round((float)wv[i]), "v[%d]: 0x%04x vs %.9g", i,
                      opt.v16[i], wv[i]);
        ck_assert_msg(fabs(p[i] - want[i]) <= 2e-7, "param %d: %.9g vs %.9g", i, p[i], want[i]);
    }
    moe_adamw_free(&opt);
    moe_param_table_free(&t);
}
END_TEST

// The moments an update stores as bf16 round ties to nearest even in every
// lane: the 8-wide conversion (two vectors here) as well as the scalar tail.
// beta1 = 1/2 and m = 0 make the new first moment g / 2 exactly, so g = 2x
// with x halfway between two bf16 values lands the rounding on that tie.
START_TEST(test_bf16_moments_round_ties_to_even_in_every_lane) {
    enum { N = 19 }; // 2 vectors of 8 + a tail of 3
    const int64_t shape[1] = {N};
    moe_param_table t;
    moe_param_table_init(&t);
    ck_assert_int_eq(moe_param_table_add(&t, "model.layers.0.", "mlp.weight", 1, shape), 0);
    moe_adamw opt;
    ck_assert_int_eq(moe_adamw_init_state(&opt, &t, false, MOE_ADAMW_BF16), 0);
    // ties whose kept bit is even (round down) and odd (round up), both signs
    static const uint32_t tie[4] = {0x3f808000u, 0x3f818000u, 0xbf808000u, 0xbf818000u};
    static const uint16_t want[4] = {0x3f80, 0x3f82, 0xbf80, 0xbf82};
    float p[N], g[N];
    for (int i = 0; i < N; i++)
        p[i] = 1.0f, g[i] = 2.0f * from_bits(tie[i % 4]);
    moe_adamw_update(&opt, p, g, 1e-3f, 0.5f, 0.5f, 1e-8f, 0.0f);
    for (int i = 0; i < N; i++)
        ck_assert_msg(opt.m16[i] == want[i % 4], "m[%d] = 0x%04x, expected 0x%04x", i, opt.m16[i],
                      want[i % 4]);
    moe_adamw_free(&opt);
    moe_param_table_free(&t);
}
END_TEST

// Which tensors of a real model decay (README "Training": no decay on norm
// weights and embeddings): the token embedding, every RMSNorm weight and the
// task-routing embedding are left out; everything else, the untied LM head,
// the router gate and the experts included, decays.
START_TEST(test_decay_mask_over_a_model_table) {
    moe_config c;
    moe_config_default(&c);
    c.model.vocab_size = 40;
    c.model.d_model = 16;
    c.model.n_layers = 2;
    c.model.n_heads = 4;
    c.model.n_kv_heads = 2;
    c.model.d_ff = 12;
    c.model.tie_embeddings = false;
    c.moe.num_experts[0] = 4;
    c.moe.d_expert = 8;
    c.moe.n_task_layers = 1;
    c.moe.task_layers[0] = 0;
    moe_model m;
    ck_assert_msg(moe_model_init_table(&m, &c, 3) == 0, "%s", moe_last_error());
    static const char *const kept[] = {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.layers.0.block_sparse_moe.task_embedding.weight",
    };
    enum { N_KEPT = sizeof kept / sizeof kept[0] };
    for (int k = 0; k < N_KEPT; k++)
        ck_assert_msg(moe_param_table_find(&m.table, kept[k]), "no tensor %s", kept[k]);
    ck_assert_ptr_nonnull(moe_param_table_find(&m.table, "lm_head.weight"));
    moe_adamw opt;
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    unsigned char *mask = malloc(m.table.numel);
    moe_adamw_decay_mask(&opt, mask);
    int n_kept = 0;
    for (int i = 0; i < m.table.count; i++) {
        const moe_param_view *v = &m.table.views[i];
        bool decays = true;
        for (int k = 0; k < N_KEPT; k++)
            decays &= strcmp(v->name, kept[k]) != 0;
        n_kept += !decays;
        for (size_t j = 0; j < v->numel; j++)
            ck_assert_msg(mask[v->offset + j] == decays, "%s: element %zu decay %d, expected %d",
                          v->name, j, mask[v->offset + j], decays);
    }
    ck_assert_int_eq(n_kept, N_KEPT);
    free(mask);
    moe_adamw_free(&opt);
    moe_model_free(&m);
}
END_TEST

// The decayed ranges reproduce the byte mask bit for bit (params and both
// moments) over tensors that straddle the kernel's chunks, decayed and not,
// with adjacent decayed tensors merged into one range.
START_TEST(test_decay_ranges_equal_byte_mask_bitwise) {
    static const char *const names[] = {
        "self_attn.q_proj.weight", "input_layernorm.weight", "mlp.gate.weight",
        "mlp.up.weight",           "embed_tokens.weight",    "post_attention_layernorm.weight",
        "mlp.down.weight"};
    static const int64_t sizes[] = {40000, 7, 30001, 50000, 1000, 33, 40123};
    moe_param_table t;
    moe_param_table_init(&t);
    for (int i = 0; i < 7; i++)
        ck_assert_int_eq(moe_param_table_add(&t, "model.layers.0.", names[i], 1, &sizes[i]), 0);
    const size_t n = t.numel;
    moe_adamw opt;
    ck_assert_int_eq(moe_adamw_init(&opt, &t, false), 0);
    ck_assert_int_eq(opt.n_decay, 3); // q_proj; gate + up; down
    unsigned char *mask = malloc(n), *want = malloc(n);
    moe_adamw_decay_mask(&opt, mask);
    for (int i = 0; i < 7; i++) // the GPT-2 rule by hand
        memset(want + t.views[i].offset, i != 1 && i != 4 && i != 5, t.views[i].numel);
    ck_assert(!memcmp(mask, want, n));
    float *pa = malloc(sizeof(float) * n), *pb = malloc(sizeof(float) * n);
    float *g = malloc(sizeof(float) * n), *m = calloc(n, sizeof(float)),
          *v = calloc(n, sizeof(float));
    tu_rng r;
    tu_seed(&r, 5);
    tu_fill_normal(&r, pa, n, 1.0f);
    memcpy(pb, pa, sizeof(float) * n);
    for (long step = 1; step <= 3; step++) {
        tu_fill_normal(&r, g, n, 0.1f);
        const double norm = moe_grad_norm(g, n);
        const float s =
            moe_adamw_update_clipped(&opt, pa, g, norm, norm / 2, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f);
        ck_assert_int_eq(
            moe_cpu_adamw_scaled(pb, m, v, g, want, n, step, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, s),
            0);
    }
    ck_assert(!memcmp(pa, pb, sizeof(float) * n));
    ck_assert(!memcmp(opt.m, m, sizeof(float) * n));
    ck_assert(!memcmp(opt.v, v, sizeof(float) * n));
    free(mask), free(want), free(pa), free(pb), free(g), free(m), free(v);
    moe_adamw_free(&opt);
    moe_param_table_free(&t);
}
END_TEST

// bf16 states take 2 bytes per moment element (tracked, as moe plan counts
// them) and the key parses; a bad value names the key.
START_TEST(test_bf16_state_halves_optimizer_memory) {
    moe_param_table t = table3();
    size_t used[2];
    for (int k = 0; k < 2; k++) {
        moe_adamw opt;
        const size_t before = moe_mem_in_use();
        ck_assert_int_eq(moe_adamw_init_state(&opt, &t, false, k ? MOE_ADAMW_BF16 : MOE_ADAMW_FP32),
                         0);
        used[k] = moe_mem_in_use() - before;
        moe_adamw_free(&opt);
    }
    ck_assert_uint_eq(used[0], 2 * 6 * sizeof(float));
    ck_assert_uint_eq(used[1], 2 * 6 * sizeof(uint16_t));
    moe_param_table_free(&t);
    moe_adamw_state st;
    ck_assert_int_eq(moe_adamw_state_parse("bf16", &st), 0);
    ck_assert_int_eq(st, MOE_ADAMW_BF16);
    ck_assert_int_eq(moe_adamw_state_parse("fp16", &st), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "train.optimizer_state"));
    moe_config c;
    moe_config_default(&c);
    ck_assert_str_eq(c.train.optimizer_state, "fp32");
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.optimizer_state=bf16"), 0);
    ck_assert_str_eq(c.train.optimizer_state, "bf16");
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.optimizer_state=fp8"), MOE_EINVAL);
}
END_TEST

static Suite *optim_suite(void) {
    Suite *s = suite_create("optim");
    TCase *tc = tcase_create("optim");
    tcase_add_test(tc, test_adamw_two_steps_by_hand);
    tcase_add_test(tc, test_decay_mask);
    tcase_add_test(tc, test_lr_schedule);
    tcase_add_test(tc, test_lr_schedule_stays_finite_up_to_flt_max);
    tcase_add_test(tc, test_grad_clip);
    tcase_add_test(tc, test_fused_clip_adamw_equals_two_passes);
    tcase_add_test(tc, test_grad_norm_matches_plain_sum);
    tcase_add_test(tc, test_bf16_round_to_nearest_even);
    tcase_add_test(tc, test_bf16_step_matches_double_reference);
    tcase_add_test(tc, test_decay_ranges_equal_byte_mask_bitwise);
    tcase_add_test(tc, test_bf16_moments_round_ties_to_even_in_every_lane);
    tcase_add_test(tc, test_decay_mask_over_a_model_table);
    tcase_add_test(tc, test_bf16_state_halves_optimizer_memory);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(optim_suite());
}
