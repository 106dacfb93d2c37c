// Every config in configs/ (but manpages.json, whose corpus README shows how
// to prepare) loads, passes its checks and trains: a short run
// at reduced width (the feature keys untouched) has finite losses that fall.
#include "moe/error.h"
#include "moe/train.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static void run_config(const char *name) {
    char path[1024], out[700];
    snprintf(path, sizeof path, "%s/configs/%s.json", MOE_SOURCE_DIR, name);
    moe_config c;
    moe_config_default(&c);
    moe_config_src *src = moe_config_src_new();
    int rc = moe_config_load(&c, src, path);
    if (rc == 0) rc = moe_config_check(&c, src);
    moe_config_src_free(src);
    ck_assert_msg(rc == 0, "%s: %s", name, moe_last_error());
    // Reduced width for test time; layers, experts and router keys stay.
    ck_assert_int_eq(moe_config_set(&c, NULL, "model.d_model=32"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "model.d_ff=48"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "model.seq_len=32"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.batch_size=4"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.steps=40"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.warmup_steps=4"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.eval_every=0"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.lr=1e-2"), 0);
    snprintf(out, sizeof out, "%s/%s", tu_tmpdir(), name);
    double losses[40];
    moe_train_opts o = {.out_dir = out, .quiet = true, .losses = losses};
    moe_train_result r;
    rc = moe_train(&c, &o, &r);
    ck_assert_msg(rc == 0, "%s: %s", name, moe_last_error());
    double first = 0, last = 0;
    for (int i = 0; i < 40; i++)
        ck_assert_msg(isfinite(losses[i]), "%s: step %d", name, i);
    for (int i = 0; i < 5; i++)
        first += losses[i] / 5, last += losses[35 + i] / 5;
    ck_assert_msg(last < first - 1.0, "%s: loss %g -> %g", name, first, last);
    moe_eval_result_free(&r.eval);
}

START_TEST(test_config_trains) {
    static const char *names[] = {"tiny",
                                  "switch_top1",
                                  "top2_position",
                                  "bpr_priority",
                                  "dynamic_capacity",
                                  "task_moe",
                                  "pr_moe",
                                  "dense",
                                  "sigmoid_router",
                                  "expert_choice",
                                  "router_softmax_aux",
                                  "router_sigmoid_bias",
                                  "router_node_limited"};
    run_config(names[_i]);
}
END_TEST

static Suite *configs_suite(void) {
    Suite *s = suite_create("configs");
    TCase *tc = tcase_create("configs");
    tcase_set_timeout(tc, 300);
    tcase_add_loop_test(tc, test_config_trains, 0, 13);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(configs_suite());
}
