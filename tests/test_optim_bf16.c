// bf16 optimizer states (train.optimizer_state = bf16): training with them
// falls as fp32 does; checkpoints keep F32 moments and resume bit for bit
// (synchronous and asynchronous saves), an fp32 checkpoint resumes into bf16
// with its moments rounded to nearest even; moe plan counts 2 bytes per
// moment element exactly; the GPU trainer refuses them naming the key.
#include "kernels/ops.h"
#include "moe/alloc.h"
#include "moe/bf16.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/model.h"
#include "moe/optim.h"
#include "moe/plan.h"
#include "moe/safetensors.h"
#include "moe/train.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static moe_config small(const char *state) {
    moe_config c = tu_small_config();
    char kv[64];
    snprintf(kv, sizeof kv, "train.optimizer_state=%s", state);
    ck_assert_int_eq(moe_config_set(&c, NULL, kv), 0);
    return c;
}

// 20 steps: the loss falls by a wide margin with bf16 moments, and each of
// the last five steps' losses stays within 2% of the fp32 run's (they part
// only by the moments' rounding).
START_TEST(test_bf16_training_loss_falls_and_tracks_fp32) {
    double l32[20] = {0}, l16[20] = {0};
    moe_config c32 = small("fp32"), c16 = small("bf16");
    c32.train.steps = c16.train.steps = 20;
    tu_train(&c32, tu_path(tu_tmpdir(), "fp32", ""), NULL, l32, 0);
    tu_train(&c16, tu_path(tu_tmpdir(), "bf16", ""), NULL, l16, 0);
    ck_assert_msg(l16[19] < l16[0] - 1.0, "bf16 loss %g -> %g", l16[0], l16[19]);
    ck_assert(l16[0] == l32[0]); // the first forward sees the same weights
    bool differ = false;
    for (int i = 15; i < 20; i++) {
        ck_assert_msg(fabs(l16[i] - l32[i]) <= 0.02 * l32[i], "step %d: bf16 %.6g, fp32 %.6g",
                      i + 1, l16[i], l32[i]);
        differ |= l16[i] != l32[i];
    }
    ck_assert(differ); // the option took effect
}
END_TEST

// Eight straight steps equal four, a synchronous save, a resume and four more,
// bit for bit: losses and the final checkpoint (weights and moments).
START_TEST(test_bf16_resume_is_bit_identical) {
    moe_config c = small("bf16");
    c.train.steps = 8;
    c.router.capacity_mode = MOE_CAPACITY_DYNAMIC;
    const char *dir = tu_tmpdir();
    double la[8] = {0}, lb[8] = {0};
    tu_train(&c, tu_path(dir, "straight", ""), NULL, la, 0);
    tu_train(&c, tu_path(dir, "halves", ""), NULL, lb, 4);
    tu_train(&c, tu_path(dir, "halves", ""), tu_path(dir, "halves", "checkpoint"), lb, 0);
    for (int i = 0; i < 8; i++)
        ck_assert_msg(la[i] == lb[i], "step %d: %.9g vs %.9g", i + 1, la[i], lb[i]);
    tu_assert_same_checkpoint(tu_path(dir, "straight", "checkpoint"),
                              tu_path(dir, "halves", "checkpoint"));
}
END_TEST

// The same from a checkpoint an asynchronous save wrote (its snapshot holds
// the bf16 moments as stored).
START_TEST(test_bf16_resume_from_async_checkpoint_is_bit_identical) {
    moe_config c = small("bf16");
    c.train.steps = 6;
    c.train.ckpt_every = 2;
    c.train.keep_checkpoints = 3;
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.async_checkpoint=true"), 0);
    const char *dir = tu_tmpdir();
    double straight[6] = {0}, resumed[6] = {0};
    tu_train(&c, tu_path(dir, "astraight", ""), NULL, straight, 0);
    tu_train(&c, tu_path(dir, "aresumed", ""), tu_path(dir, "astraight", "checkpoint-2"), resumed,
             0);
    for (int i = 2; i < 6; i++)
        ck_assert_msg(straight[i] == resumed[i], "step %d: %.9g vs %.9g", i + 1, straight[i],
                      resumed[i]);
    tu_assert_same_checkpoint(tu_path(dir, "astraight", "checkpoint-6"),
                              tu_path(dir, "aresumed", "checkpoint-6"));
    // and the async save's files equal a synchronous save's of the same state
    moe_config s = c;
    s.train.async_checkpoint = false;
    tu_train(&s, tu_path(dir, "sync", ""), NULL, NULL, 0);
    tu_assert_same_checkpoint(tu_path(dir, "astraight", "checkpoint-4"),
                              tu_path(dir, "sync", "checkpoint-4"));
}
END_TEST

// A checkpoint of an fp32 run loads into bf16 moments rounded to nearest
// even; saved again from bf16 the moments are F32 tensors holding exactly
// the widened bf16 values; a bf16 run resumes from the fp32 checkpoint.
START_TEST(test_fp32_checkpoint_resumes_into_bf16_rounded) {
    const char *dir = tu_tmpdir();
    moe_config c32 = small("fp32"), c16 = small("bf16");
    c32.train.steps = c16.train.steps = 6;
    tu_train(&c32, tu_path(dir, "f32", ""), NULL, NULL, 3);
    const char *ck = tu_path(dir, "f32", "checkpoint");
    moe_model m;
    moe_adamw a, b;
    moe_train_state st;
    ck_assert_int_eq(moe_model_init(&m, &c16, 4, 32, 5), 0);
    ck_assert_int_eq(moe_adamw_init(&a, &m.table, false), 0);
    ck_assert_int_eq(moe_adamw_init_state(&b, &m.table, false, MOE_ADAMW_BF16), 0);
    ck_assert_msg(moe_ckpt_load(ck, &m, &a, &st) == 0, "%s", moe_last_error());
    ck_assert_msg(moe_ckpt_load(ck, &m, &b, &st) == 0, "%s", moe_last_error());
    ck_assert_int_eq(b.step, 3);
    size_t inexact = 0;
    for (size_t i = 0; i < a.n; i++) {
        ck_assert_uint_eq(b.m16[i], moe_bf16_round(a.m[i]));
        ck_assert_uint_eq(b.v16[i], moe_bf16_round(a.v[i]));
        inexact += moe_bf16_to_float(b.m16[i]) != a.m[i];
    }
    ck_assert_uint_gt(inexact, a.n / 2); // the fp32 moments did need rounding
    const char *again = tu_path(dir, "again", "");
    ck_assert_msg(moe_ckpt_save(again, &m, &b, &st, NULL) == 0, "%s", moe_last_error());
    moe_st_file *f;
    ck_assert_int_eq(moe_st_open(tu_path(dir, "again", "optimizer.safetensors"), &f), 0);
    const moe_param_view *v = &m.table.views[1];
    char name[MOE_PARAM_NAME_MAX + 16];
    snprintf(name, sizeof name, "%s.exp_avg_sq", v->name);
    const moe_st_tensor *t = moe_st_find(f, name);
    ck_assert_ptr_nonnull(t);
    ck_assert_int_eq(t->dtype, MOE_ST_F32);
    float *x = malloc(sizeof(float) * v->numel);
    ck_assert_int_eq(moe_st_read(f, t, x, sizeof(float) * v->numel), 0);
    for (size_t i = 0; i < v->numel; i++)
        ck_assert(x[i] == moe_bf16_to_float(b.v16[v->offset + i]));
    free(x);
    moe_st_close(f);
    moe_adamw_free(&a), moe_adamw_free(&b);
    moe_model_free(&m);
    tu_train(&c16, tu_path(dir, "f32", ""), ck, NULL, 0); // a bf16 run continues it
}
END_TEST

// moe plan's optimizer and snapshot figures equal the tracked bytes the
// optimizer and the asynchronous save allocate, fp32 and bf16.
START_TEST(test_plan_counts_bf16_moments_exactly) {
    for (int k = 0; k < 2; k++) {
        moe_config c = small(k ? "bf16" : "fp32");
        ck_assert_int_eq(moe_config_set(&c, NULL, "train.async_checkpoint=true"), 0);
        moe_mem_plan plan;
        ck_assert_int_eq(moe_plan_memory(&c, 1, 0, &plan), 0);
        moe_model m;
        ck_assert_int_eq(moe_model_init(&m, &c, 4, 32, 5), 0);
        moe_adamw opt;
        size_t before = moe_mem_in_use();
        ck_assert_int_eq(moe_adamw_init_state(&opt, &m.table, false, k ? MOE_ADAMW_BF16 : 0), 0);
        ck_assert_uint_eq(moe_mem_in_use() - before, plan.optimizer);
        ck_assert_uint_eq(plan.optimizer, 2 * plan.n_params * (k ? 2 : 4));
        moe_ckpt_async *a;
        before = moe_mem_in_use();
        ck_assert_int_eq(moe_ckpt_async_init(&a, &m, NULL), 0);
        ck_assert_uint_eq(moe_mem_in_use() - before, plan.ckpt_snapshot);
        ck_assert_uint_eq(plan.ckpt_snapshot, plan.n_params * (k ? 8 : 12));
        moe_ckpt_async_free(a);
        moe_adamw_free(&opt);
        moe_model_free(&m);
    }
}
END_TEST

// train.device = cuda with bf16 states is refused by the config check, and
// the GPU trainer (here on the CPU table) refuses a bf16 optimizer: both
// name the key.
START_TEST(test_gpu_refuses_bf16_states) {
    moe_config c = small("bf16");
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.device=cuda"), 0);
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "train.optimizer_state = bf16"), "%s", moe_last_error());
    c = small("bf16");
    c.train.steps = 2;
    moe_train_opts o = {.out_dir = tu_path(tu_tmpdir(), "dev", ""), .quiet = true};
    o.device_ops = &moe_ops_cpu;
    moe_train_result r;
    ck_assert_int_eq(moe_train(&c, &o, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "train.optimizer_state = bf16"), "%s", moe_last_error());
}
END_TEST

int main(void) {
    Suite *s = suite_create("optim_bf16");
    TCase *tc = tcase_create("optim_bf16");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_bf16_training_loss_falls_and_tracks_fp32);
    tcase_add_test(tc, test_bf16_resume_is_bit_identical);
    tcase_add_test(tc, test_bf16_resume_from_async_checkpoint_is_bit_identical);
    tcase_add_test(tc, test_fp32_checkpoint_resumes_into_bf16_rounded);
    tcase_add_test(tc, test_plan_counts_bf16_moments_exactly);
    tcase_add_test(tc, test_gpu_refuses_bf16_states);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
