// The optimizer against hand computation: AdamW moments, bias correction and
// decoupled weight decay over two steps; which tensors decay (GPT-2 rule, or
// every tensor with train.decay_all); the warmup + cosine schedule at its
// corners; global-norm clipping.
#include "moe/config.h"
#include "moe/error.h"
#include "moe/optim.h"
#include "testutil.h"

#include <math.h>

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

static Suite *optim_suite(void) {
    Suite *s = suite_create("optim");
    TCase *tc = tcase_create("optim");
    tcase_add_test(tc, test_adamw_two_steps_by_hand);
    tcase_add_test(tc, test_decay_mask);
    tcase_add_test(tc, test_lr_schedule);
    tcase_add_test(tc, test_grad_clip);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(optim_suite());
}
