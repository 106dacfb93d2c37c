// Mini-sequence chunking (memory.mini_seq with memory.recompute = moe | all):
// the same losses and gradients as the unchunked model (within 1e-5 relative:
// weight gradients add up chunk by chunk instead of in one GEMM), for dense,
// MoE (drops, shared expert, task routing, jitter) and both losses; recompute
// = all (attention recomputed too) bit-identical to recompute = moe; less
// activation memory; and the bad flag combinations fail clearly.
#include "moe/error.h"
#include "moe/model.h"
#include "moe/plan.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

enum { B = 2, T = 12, V = 40 };

static moe_config base(void) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {
        "model.vocab_size=40",   "model.d_model=16",   "model.n_layers=2",
        "model.n_heads=4",       "model.n_kv_heads=2", "model.d_ff=12",
        "moe.num_experts=4",     "moe.d_expert=8",     "router.capacity_factor=1.0",
        "router.min_capacity=1", "model.seq_len=12"};
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        ck_assert_int_eq(moe_config_set(&c, NULL, sets[i]), 0);
    return c;
}

// a: c as given; b: c with `chunks` chunks and `recompute`. exact: bit for bit.
static void compare(moe_config c, int chunks, const char *recompute, bool exact, const char *what) {
    moe_model a, b;
    ck_assert_int_eq(moe_model_init(&a, &c, B, T, 3), 0);
    char s1[32], s2[48];
    snprintf(s1, sizeof s1, "memory.mini_seq=%d", chunks);
    snprintf(s2, sizeof s2, "memory.recompute=%s", recompute);
    ck_assert_int_eq(moe_config_set(&c, NULL, s1), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, s2), 0);
    ck_assert_msg(moe_model_init(&b, &c, B, T, 3) == 0, "%s: %s", what, moe_last_error());
    int32_t in[B * T], tg[B * T], task[B] = {0, 2};
    for (int i = 0; i < B * T; i++)
        in[i] = (i * 7) % V, tg[i] = i % 5 == 2 ? -1 : (i * 3 + 1) % V;
    for (int step = 0; step < 2; step++) { // twice: chunks must not leave state behind
        memset(a.grads, 0, sizeof(float) * moe_model_numel(&a));
        memset(b.grads, 0, sizeof(float) * moe_model_numel(&b));
        ck_assert_int_eq(moe_model_forward(&a, in, tg, task, B, T, true, step), 0);
        ck_assert_int_eq(moe_model_forward(&b, in, tg, task, B, T, true, step), 0);
        const double tol = exact ? 0 : 1e-5;
        ck_assert_msg(fabs(a.loss - b.loss) <= tol * fabs(a.loss), "%s: loss %.9g vs %.9g", what,
                      a.loss, b.loss);
        ck_assert_int_eq(moe_model_backward(&a, in, tg, task), 0);
        ck_assert_int_eq(moe_model_backward(&b, in, tg, task), 0);
        for (int v = 0; v < a.table.count; v++) {
            const moe_param_view *pv = &a.table.views[v];
            double worst = 0, scale = 0;
            for (size_t i = 0; i < pv->numel; i++) {
                scale = fmax(scale, fabs(a.grads[pv->offset + i]));
                worst =
                    fmax(worst, fabs((double)a.grads[pv->offset + i] - b.grads[pv->offset + i]));
            }
            ck_assert_msg(worst <= (exact ? 0 : 1e-5 * scale + 1e-9),
                          "%s: %s differs by %.3g of %.3g", what, pv->name, worst, scale);
        }
    }
    moe_model_free(&a);
    moe_model_free(&b);
}

START_TEST(test_chunked_equals_unchunked) {
    moe_config c = base();
    compare(c, 3, "moe", false, "moe, 3 chunks");
    compare(c, 5, "moe", false, "moe, 5 uneven chunks");
    compare(c, 3, "all", false, "moe, 3 chunks, recompute all");
    moe_config_set(&c, NULL, "moe.every=2");
    compare(c, 4, "moe", false, "dense + moe");
    compare(c, 4, "all", false, "dense + moe, recompute all");
    c = base();
    moe_config_set(&c, NULL, "moe.shared_experts=1");
    moe_config_set(&c, NULL, "router.noise=jitter");
    compare(c, 4, "moe", false, "shared expert, jitter");
    c = base();
    moe_config_set(&c, NULL, "moe.task_layers=[0]");
    moe_config_set(&c, NULL, "loss.impl=cce");
    compare(c, 2, "moe", false, "task routing, cce");
    c = base();
    moe_config_set(&c, NULL, "router.capacity_factor=0");
    moe_config_set(&c, NULL, "router.top_k=1");
    compare(c, 6, "moe", false, "dropless top-1");
}
END_TEST

// Recomputing attention from the layer input replays the same operations on
// the same inputs: recompute = all equals recompute = moe bit for bit.
START_TEST(test_recompute_all_is_exact) {
    moe_config c = base();
    moe_config_set(&c, NULL, "model.n_layers=3");
    moe_config_set(&c, NULL, "moe.every=2");
    moe_config_set(&c, NULL, "memory.mini_seq=3");
    moe_config_set(&c, NULL, "memory.recompute=moe");
    compare(c, 3, "all", true, "recompute all vs moe");
}
END_TEST

START_TEST(test_chunking_saves_activation_memory) {
    moe_config c = base();
    ck_assert_int_eq(moe_config_set(&c, NULL, "model.seq_len=64"), 0);
    moe_mem_plan plain, chunked;
    ck_assert_int_eq(moe_plan_memory(&c, 1, 0, &plain), 0);
    moe_config_set(&c, NULL, "memory.mini_seq=8");
    moe_config_set(&c, NULL, "memory.recompute=moe");
    ck_assert_int_eq(moe_plan_memory(&c, 1, 0, &chunked), 0);
    printf("MoE buffers %zu -> %zu bytes, dense activations %zu -> %zu bytes\n", plain.moe,
           chunked.moe, plain.activations, chunked.activations);
    ck_assert(chunked.moe < plain.moe / 2);
    ck_assert(chunked.activations < plain.activations);
    // recompute = all keeps one layer's attention buffers instead of n_layers
    moe_mem_plan all;
    moe_config_set(&c, NULL, "memory.recompute=all");
    ck_assert_int_eq(moe_plan_memory(&c, 1, 0, &all), 0);
    const size_t N = 16 * 64 /* default batch */,
                 att = (size_t)16 * 4 * 64 /* lse */ + N * (16 + 1 + 16 + 8 + 8 + 16);
    printf("recompute = all: dense activations %zu bytes\n", all.activations);
    ck_assert_uint_eq(chunked.activations - all.activations, sizeof(float) * att);
}
END_TEST

START_TEST(test_chunking_flag_errors) {
    moe_config c = base();
    moe_config_set(&c, NULL, "memory.mini_seq=4");
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL); // recompute = none
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "recompute = moe"));
    moe_config_set(&c, NULL, "memory.recompute=moe");
    ck_assert_int_eq(moe_config_check(&c, NULL), 0);
    moe_config_set(&c, NULL, "memory.mini_seq=13"); // more chunks than seq_len 12
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
    moe_config_set(&c, NULL, "memory.mini_seq=1");
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL); // recompute without chunks
    ck_assert_int_eq(moe_config_set(&c, NULL, "memory.recompute=some"), MOE_EINVAL);
    ck_assert_int_eq(moe_config_set(&c, NULL, "memory.recompute=all"), 0);
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL); // all without chunks too
    c = base();
    moe_config_set(&c, NULL, "memory.mini_seq=4");
    moe_config_set(&c, NULL, "memory.recompute=moe");
    moe_config_set(&c, NULL, "parallel.ep=2");
    ck_assert_int_eq(moe_config_check(&c, NULL), MOE_EINVAL);
}
END_TEST

static Suite *chunking_suite(void) {
    Suite *s = suite_create("chunking");
    TCase *tc = tcase_create("chunking");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_chunked_equals_unchunked);
    tcase_add_test(tc, test_recompute_all_is_exact);
    tcase_add_test(tc, test_chunking_saves_activation_memory);
    tcase_add_test(tc, test_chunking_flag_errors);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(chunking_suite());
}
