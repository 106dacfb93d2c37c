// The device memory of expert parallelism on the GPU (parallel.ep > 1): the
// CUDA layer's expert-side buffers (moe_cuda_layer_ep_sizes, the ones
// moe/src/moe_ep_rows.c allocates) checked by hand, and the plan of a
// rank (moe_plan_device_memory) against the one-process plan: E / ep experts'
// parameters, gradients and moments fewer, the expert-side buffers more.
#include "moe/cuda_sizes.h"
#include "moe/error.h"
#include "moe/plan.h"
#include "testutil.h"

START_TEST(test_cuda_ep_buffers_by_hand) {
    // T_max 4, D 8, H 16, E 4, k 2 on 2 ranks: R = 2 * 4 * 2 = 16 rows
    moe_layer_config lc = {0};
    lc.T_max = 4, lc.D = 8, lc.H = 16, lc.E = 4;
    moe_router_config_default(&lc.router);
    lc.router.top_k = 2;
    size_t s[MOE_CUDA_EP_BUFS];
    moe_cuda_layer_ep_sizes(&lc, s); // one process: none
    for (int i = 0; i < MOE_CUDA_EP_BUFS; i++)
        ck_assert_msg(s[i] == 0, "ep 1: buffer %d has %zu bytes", i, s[i]);
    const size_t one = moe_cuda_layer_bytes(&lc, 100);
    lc.ep_size = 2, lc.ep_rank = 1;
    moe_cuda_layer_ep_sizes(&lc, s);
    // xr [R, D], abr [R, 2H], hr [R, H], yr = dyr [R, D], dxr [R, D], dhr [R, H], dabr [R, 2H]
    const size_t want[MOE_CUDA_EP_BUFS] = {512, 2048, 1024, 512, 512, 1024, 2048};
    for (int i = 0; i < MOE_CUDA_EP_BUFS; i++)
        ck_assert_msg(s[i] == want[i], "buffer %d: %zu, want %zu", i, s[i], want[i]);
    // every size a multiple of the granule: the layer grows by their sum
    ck_assert_uint_eq(moe_cuda_layer_bytes(&lc, 100) - one, 7680);
}
END_TEST

// A rank's plan with parallel.ep = 2 against one process's: the expert shard
// halves the expert parameters (and their gradients and moments), and each
// MoE layer adds its expert-side buffers.
START_TEST(test_gpu_plan_of_an_expert_parallel_rank) {
    moe_config c = tu_small_config();
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.device=cuda"), 0);
    moe_gpu_mem_plan one, two;
    ck_assert_msg(moe_plan_device_memory(&c, NULL, &one) == 0, "%s", moe_last_error());
    c.parallel.ep = 2;
    ck_assert_msg(moe_plan_device_memory(&c, NULL, &two) == 0, "ep 2: %s", moe_last_error());
    const size_t D = (size_t)c.model.d_model, H = c.moe.d_expert ? c.moe.d_expert : c.model.d_ff;
    const size_t T = (size_t)c.train.batch_size * c.model.seq_len, k = (size_t)c.router.top_k;
    size_t shard = 0, ep_bufs = 0;
    for (int l = 0; l < c.model.n_layers; l++) {
        const int E = moe_config_experts(&c, l);
        if (!E) continue;
        shard += (size_t)(E / 2) * 3 * H * D; // the other rank's experts
        const size_t R = 2 * T * k,
                     sz[7] = {R * D, R * 2 * H, R * H, R * D, R * D, R * H, R * 2 * H};
        for (int i = 0; i < 7; i++)
            ep_bufs += moe_cuda_granule(sz[i] * sizeof(float));
    }
    ck_assert_uint_gt(shard, 0);
    ck_assert_uint_eq(two.moe, one.moe + ep_bufs);
    // each buffer rounded to the 256-byte granule
    const size_t less = one.params - two.params;
    ck_assert_msg(less + 256 > shard * 4 && less < shard * 4 + 256,
                  "parameters: %zu bytes fewer, the other rank's experts are %zu", less, shard * 4);
    ck_assert_uint_lt(two.optimizer, one.optimizer);
    ck_assert_uint_eq(two.total, two.params + two.grads + two.optimizer + two.activations +
                                     two.moe + two.trainer);
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("plan_device_ep");
    TCase *tc = tcase_create("plan_device_ep");
    tcase_add_test(tc, test_cuda_ep_buffers_by_hand);
    tcase_add_test(tc, test_gpu_plan_of_an_expert_parallel_rank);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
