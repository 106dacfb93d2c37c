// The optimizer against hand computation: AdamW moments, bias correction and
// decoupled weight decay over two steps; which tensors decay (GPT-2 rule, or
// every tensor with train.decay_all); the warmup + cosine schedule at its
// corners; global-norm clipping.
#include "moe/config.h"
#include "moe/error.h"
#include "moe/optim.h"
#include "testutil.h"

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
    for (int i = 0; i < 6; i++)
        ck_assert_int_eq(opt.decay[i], gpt2[i]);
    moe_adamw_free(&opt);
    ck_assert_int_eq(moe_adamw_init(&opt, &t, true), 0);
    for (int i = 0; i < 6; i++)
        ck_assert_int_eq(opt.decay[i], 1);
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
    ck_assert_double_eq(moe_grad_norm(g, 5), sqrt((double)g[0] * g[0] + (double)g[1] * g[1] +
                                                  (double)g[2] * g[2] + (double)g[3] * g[3] +
                                                  (double)g[4] * g[4]));
    free(g);
}
END_TEST

static Suite *optim_suite(void) {
    Suite *s = suite_create("optim");
    TCase *tc = tcase_create("optim");
    tcase_add_test(tc, test_adamw_two_steps_by_hand);
    tcase_add_test(tc, test_decay_mask);
    tcase_add_test(tc, test_lr_schedule);
    tcase_add_test(tc, test_grad_clip);
    tcase_add_test(tc, test_fused_clip_adamw_equals_two_passes);
    tcase_add_test(tc, test_grad_norm_matches_plain_sum);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(optim_suite());
}
