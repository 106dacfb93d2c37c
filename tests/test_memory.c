// The memory estimate (moe plan, moe train --dry-run) against the measured
// high-water mark of the library's allocations during training, over configs
// that vary sequence length, batch, experts, top-k, capacity, loss, dense
// layers, accumulation, chunking, recompute and task routing: exact (the
// layouts are shared, and every tracked buffer is in the plan).
#include "moe/alloc.h"
#include "moe/error.h"
#include "moe/model.h"
#include "moe/plan.h"
#include "moe/train.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static const char *variants[][4] = {
    {"model.seq_len=16", "", "", ""},
    {"train.optimizer_state=bf16", "", "", ""},
    {"model.seq_len=64", "", "", ""},
    {"train.batch_size=8", "", "", ""},
    {"moe.num_experts=16", "", "", ""},
    {"router.top_k=1", "", "", ""},
    {"router.capacity_factor=0", "", "", ""},
    {"router.capacity_factor=2.0", "router.noise=jitter", "", ""},
    {"loss.impl=cce", "", "", ""},
    {"moe.every=2", "moe.shared_experts=1", "", ""},
    {"train.grad_accum=2", "capacity.mode=dynamic", "", ""},
    {"moe.task_layers=[1]", "router.capacity_factor=0", "", ""},
    {"moe.num_experts=[4,8]", "moe.d_expert=64", "", ""},
    {"memory.mini_seq=4", "memory.recompute=moe", "", ""},
    {"memory.mini_seq=8", "memory.recompute=moe", "moe.every=2", "loss.impl=cce"},
    {"memory.mini_seq=4", "memory.recompute=all", "model.seq_len=64", ""},
    {"model.seq_len=200", "train.batch_size=2", "", ""},
    {"model.seq_len=200", "train.batch_size=2", "memory.mini_seq=4", "memory.recompute=all"},
};

START_TEST(test_estimate_matches_measured_peak) {
    moe_config c;
    moe_config_default(&c);
    const char *base[] = {"model.d_model=32",   "model.n_layers=2",  "model.d_ff=48",
                          "model.seq_len=32",   "moe.num_experts=4", "train.batch_size=4",
                          "train.eval_every=0", "train.steps=3"};
    for (int i = 0; i < 8; i++)
        ck_assert_int_eq(moe_config_set(&c, NULL, base[i]), 0);
    for (int j = 0; j < 4 && variants[_i][j][0]; j++)
        ck_assert_msg(moe_config_set(&c, NULL, variants[_i][j]) == 0, "%s", moe_last_error());
    ck_assert_msg(moe_config_check(&c, NULL) == 0, "%s", moe_last_error());
    moe_mem_plan plan;
    ck_assert_int_eq(moe_plan_memory(&c, 1, 0, &plan), 0);
    char out[700];
    snprintf(out, sizeof out, "%s/run", tu_tmpdir());
    size_t before = moe_mem_in_use();
    moe_mem_reset_peak();
    // stop after the last step: a checkpoint is written but no evaluation runs
    moe_train_opts o = {.out_dir = out, .quiet = true, .stop_after = 3};
    moe_train_result r;
    ck_assert_msg(moe_train(&c, &o, &r) == 0, "%s", moe_last_error());
    size_t measured = moe_mem_peak() - before;
    ck_assert_int_eq(moe_mem_in_use(), before); // everything freed
    double err = fabs((double)plan.total - (double)measured) / (double)measured;
    printf("%-40s predicted %10zu measured %10zu error %.4f%%\n", variants[_i][0], plan.total,
           measured, 100 * err);
    // every buffer of a training run is in the plan: the prediction is exact
    ck_assert_msg(plan.total == measured, "%s: predicted %zu, measured %zu", variants[_i][0],
                  plan.total, measured);
}
END_TEST

// The CPU attention saves one log-sum-exp per query row, so no buffer of the
// model grows with T^2: the dense activations at T, 2T and 3T have a zero
// second difference (a [B, Hq, T, T] buffer would leave 2 * L * B * Hq * T^2
// floats), with and without chunking, recompute and cut cross-entropy.
START_TEST(test_activations_linear_in_seq_len) {
    static const char *sets[][3] = {
        {"", "", ""},
        {"memory.mini_seq=4", "memory.recompute=all", "loss.impl=cce"},
    };
    for (size_t v = 0; v < sizeof sets / sizeof sets[0]; v++) {
        moe_config c;
        moe_config_default(&c);
        ck_assert_int_eq(moe_config_set(&c, NULL, "model.seq_len=1024"), 0);
        for (int j = 0; j < 3 && sets[v][j][0]; j++)
            ck_assert_int_eq(moe_config_set(&c, NULL, sets[v][j]), 0);
        size_t a[3];
        for (int i = 0; i < 3; i++) {
            moe_model_mem mm;
            ck_assert_msg(moe_model_memory(&c, 2, 256 * (i + 1), 1, 1, 0, 0, &mm) == 0, "%s",
                          moe_last_error());
            a[i] = mm.activations;
        }
        ck_assert_uint_gt(a[1], a[0]);
        ck_assert_msg(a[2] + a[0] == 2 * a[1], "set %zu: activations %zu, %zu, %zu bytes", v, a[0],
                      a[1], a[2]);
    }
}
END_TEST

static Suite *memory_suite(void) {
    Suite *s = suite_create("memory");
    TCase *tc = tcase_create("estimate");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_estimate_matches_measured_peak, 0,
                        sizeof variants / sizeof variants[0]);
    tcase_add_test(tc, test_activations_linear_in_seq_len);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(memory_suite());
}
