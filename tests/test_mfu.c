// Model FLOPs utilisation: the FLOPs per token of a small config counted by
// hand (trainer/mfu.c states the formula), the sgemm rate measured through
// the op table, and the mfu / sgemm_gflops fields of metrics.jsonl (present
// and positive on the CPU path, absent on the device path; never their value).
#include "moe/error.h"
#include "moe/mfu.h"
#include "moe/train.h"
#include "testutil.h"

#include <jansson.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

// D 8, 2 heads of 4 (QD 8), 1 KV head (KD 4), T 4, vocab 16, d_ff 12; layer 1
// MoE (every 2): 4 experts of H 6, top-2, one shared expert.
static moe_config hand_config(void) {
    moe_config c;
    moe_config_default(&c);
    c.model.vocab_size = 16;
    c.model.d_model = 8;
    c.model.n_layers = 2;
    c.model.n_heads = 2;
    c.model.n_kv_heads = 1;
    c.model.d_ff = 12;
    c.model.seq_len = 4;
    c.moe.every = 2;
    c.moe.n_num_experts = 1;
    c.moe.num_experts[0] = 4;
    c.moe.d_expert = 6;
    c.moe.shared_experts = 1;
    c.router.top_k = 2;
    return c;
}

START_TEST(test_flops_per_token_counted_by_hand) {
    moe_config c = hand_config();
    // per layer: projections 2*8*(2*8 + 2*4) = 384, causal attention 2*T*QD = 64
    // layer 0 dense FFN 2*3*8*12 = 576; layer 1 experts 2*3*8*6*(2+1) = 864,
    // gate 2*8*4 = 64; LM head 2*8*16 = 256. Forward 2*448 + 576 + 928 + 256 =
    // 2656, training 3 x 2656.
    ck_assert_double_eq(moe_model_flops_per_token(&c), 7968.0);
}
END_TEST

START_TEST(test_routed_flops_per_token_by_hand) {
    moe_config c = hand_config();
    // layer 1's routed experts only: 3 x 2*3*8*6*2 = 1728 (the shared expert
    // and the gate are computed for every token, dropped or not)
    ck_assert_double_eq(moe_model_routed_flops_per_token(&c), 1728.0);
    c.moe.every = 0;
    ck_assert_double_eq(moe_model_routed_flops_per_token(&c), 0.0);
}
END_TEST

START_TEST(test_flops_per_token_dense_model_by_hand) {
    moe_config c = hand_config();
    c.moe.every = 0; // no MoE layer: both layers use d_ff
    // forward 2*448 + 2*576 + 256 = 2304
    ck_assert_double_eq(moe_model_flops_per_token(&c), 3 * 2304.0);
}
END_TEST

START_TEST(test_sgemm_rate_is_finite_and_positive) {
    double g = -1;
    ck_assert_msg(moe_sgemm_rate(64, &g) == 0, "%s", moe_last_error());
    ck_assert_msg(isfinite(g) && g > 0, "rate %g", g);
}
END_TEST

// Every step record of dir/metrics.jsonl: mfu present (or absent) as
// `want_mfu`, finite and positive; sgemm_gflops only in the first record.
static void check_records(const char *dir, bool want_mfu, long steps) {
    char path[700], line[65536];
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "%s missing", path);
    long n = 0;
    while (fgets(line, sizeof line, f)) {
        json_error_t err;
        json_t *j = json_loads(line, 0, &err);
        ck_assert_msg(j != NULL, "%s: %s", path, err.text);
        if (!json_object_get(j, "step")) { // an eval record
            json_decref(j);
            continue;
        }
        json_t *mfu = json_object_get(j, "mfu"), *sg = json_object_get(j, "sgemm_gflops");
        if (want_mfu) {
            ck_assert_msg(json_is_number(mfu), "step record %ld has no mfu", n + 1);
            double v = json_number_value(mfu);
            ck_assert_msg(isfinite(v) && v > 0, "step %ld: mfu %g", n + 1, v);
        } else {
            ck_assert_msg(mfu == NULL, "step %ld: mfu on the device path", n + 1);
        }
        if (n == 0 && want_mfu)
            ck_assert_msg(json_is_number(sg) && json_number_value(sg) > 0,
                          "first record: sgemm_gflops missing");
        else
            ck_assert_msg(sg == NULL, "step %ld: sgemm_gflops repeated", n + 1);
        n++;
        json_decref(j);
    }
    fclose(f);
    ck_assert_int_eq(n, steps);
}

START_TEST(test_metrics_records_carry_positive_mfu) {
    moe_config c = tu_small_config();
    c.train.steps = 4;
    char out[600];
    snprintf(out, sizeof out, "%s/run", tu_tmpdir());
    moe_train_opts o = {.out_dir = out, .quiet = true};
    moe_train_result r;
    ck_assert_msg(moe_train(&c, &o, &r) == 0, "%s", moe_last_error());
    moe_eval_result_free(&r.eval);
    ck_assert_msg(isfinite(r.mfu) && r.mfu > 0 && r.sgemm_gflops > 0, "mfu %g, sgemm %g", r.mfu,
                  r.sgemm_gflops);
    check_records(out, true, 4);
}
END_TEST

START_TEST(test_device_path_reports_no_mfu) {
    moe_config c = tu_small_config();
    c.train.steps = 3;
    char out[600];
    snprintf(out, sizeof out, "%s/dev", tu_tmpdir());
    moe_train_opts o = {.out_dir = out, .quiet = true, .device_ops = &moe_ops_cpu};
    moe_train_result r;
    ck_assert_msg(moe_train(&c, &o, &r) == 0, "%s", moe_last_error());
    moe_eval_result_free(&r.eval);
    ck_assert(r.mfu == 0 && r.sgemm_gflops == 0);
    check_records(out, false, 3);
}
END_TEST

int main(void) {
    Suite *s = suite_create("mfu");
    TCase *tc = tcase_create("mfu");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_flops_per_token_counted_by_hand);
    tcase_add_test(tc, test_routed_flops_per_token_by_hand);
    tcase_add_test(tc, test_flops_per_token_dense_model_by_hand);
    tcase_add_test(tc, test_sgemm_rate_is_finite_and_positive);
    tcase_add_test(tc, test_metrics_records_carry_positive_mfu);
    tcase_add_test(tc, test_device_path_reports_no_mfu);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
