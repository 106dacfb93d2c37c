// comm.node_dedup without MPI: the key (default off, --set, bad values refused
// by name, documented in --help-config), its refusal on the device training
// path, and moe plan's inter-node bytes with it. The exchange itself runs
// under MPI in tests/mpi_node_dedup.c.
#include "kernels/ops.h"
#include "moe/config.h"
#include "moe/error.h"
#include "moe/plan.h"
#include "moe/train.h"
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

START_TEST(test_node_dedup_key_default_set_and_refused) {
    moe_config c;
    moe_config_default(&c);
    ck_assert(!c.comm.node_dedup);
    ck_assert_int_eq(moe_config_set(&c, NULL, "comm.node_dedup=true"), 0);
    ck_assert(c.comm.node_dedup);
    ck_assert_int_eq(moe_config_set(&c, NULL, "comm.node_dedup=maybe"), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "comm.node_dedup"), "%s", moe_last_error());
    char dir[600], path[700];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(path, sizeof path, "%s/help.txt", dir);
    FILE *f = fopen(path, "w+");
    ck_assert_ptr_nonnull(f);
    moe_config_help(f);
    fclose(f);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "help.txt"), "comm.node_dedup"));
}
END_TEST

// The device training path (CUDA/NCCL) has no node-deduplicated exchange.
START_TEST(test_device_path_refuses_node_dedup) {
    moe_config c = tu_small_config();
    c.train.steps = 1;
    c.comm.node_dedup = true;
    char out[700];
    snprintf(out, sizeof out, "%s/dev", tu_tmpdir());
    moe_train_result r;
    moe_train_opts o = {0};
    o.quiet = true;
    o.out_dir = out;
    o.device_ops = &moe_ops_cpu;
    ck_assert_int_eq(moe_train(&c, &o, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "comm.node_dedup"), "%s", moe_last_error());
}
END_TEST

// moe plan at 16 nodes x 8 ranks, E = 256, top-8: with node_dedup the
// inter-node bytes are below the per-choice exchange's and fall with
// topk_groups by half the one-copy-per-node figure's fall (two of its four
// exchanges are deduplicated; the return paths stay per choice).
START_TEST(test_plan_node_dedup_inter_bytes_fall_with_topk_groups) {
    moe_config c = tu_small_config();
    ck_assert_int_eq(moe_config_set(&c, NULL, "moe.num_experts=256"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "router.top_k=8"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "parallel.ep=128"), 0);
    moe_machine mc = {128, 16, 8, {400, 100}, {2, 5}};
    const int tgs[4] = {1, 2, 4, 0};
    int moe_layers = 0;
    for (int l = 0; l < c.model.n_layers; l++)
        moe_layers += moe_config_experts(&c, l) > 0;
    const long slack = 4L * moe_layers * c.train.grad_accum; // llround per layer
    moe_a2a_plan on[4], off;
    for (int i = 0; i < 4; i++) {
        c.router.topk_groups = tgs[i];
        for (int algo = 0; algo < 2; algo++) {
            c.comm.node_dedup = false;
            ck_assert_int_eq(moe_plan_a2a(&c, &mc, (moe_a2a_algo)algo, &off), 0);
            c.comm.node_dedup = true;
            ck_assert_int_eq(moe_plan_a2a(&c, &mc, (moe_a2a_algo)algo, &on[i]), 0);
            ck_assert(on[i].node_dedup && !off.node_dedup);
            ck_assert_int_lt(on[i].bytes_inter, off.bytes_inter);
            ck_assert_int_eq(on[i].calls, off.calls + 3L * c.train.grad_accum * moe_layers);
        }
        if (i) {
            const long fall = on[i].bytes_inter - on[i - 1].bytes_inter;
            const long half = (on[i].bytes_inter_node_copy - on[i - 1].bytes_inter_node_copy) / 2;
            ck_assert_int_gt(fall, 0);
            ck_assert_msg(labs(fall - half) <= slack, "topk_groups %d: +%ld bytes, expected +%ld",
                          tgs[i], fall, half);
        }
    }
}
END_TEST

int main(void) {
    Suite *s = suite_create("node_dedup");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_node_dedup_key_default_set_and_refused);
    tcase_add_test(tc, test_device_path_refuses_node_dedup);
    tcase_add_test(tc, test_plan_node_dedup_inter_bytes_fall_with_topk_groups);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
