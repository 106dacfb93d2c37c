// The device memory plan (moe_plan_device_memory, `moe plan` with train.device
// = cuda) against the allocations it predicts: the device path run on the CPU
// table allocates exactly the plan's bytes for that table (tracked, moe/alloc.h),
// the CUDA figures are the sizing functions the CUDA allocation code calls
// (moe/cuda_sizes.h), checked by hand on small cases, and the printed section.
#include "kernels/cpu/cpu.h"
#include "moe/alloc.h"
#include "moe/cuda_sizes.h"
#include "moe/error.h"
#include "moe/model.h"
#include "moe/optim.h"
#include "moe/plan.h"
#include "moe/task_experts.h"
#include "testutil.h"
#include "trainer/train_gpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static moe_config with(const char *const *sets) {
    moe_config c = tu_small_config();
    for (; sets && *sets; sets++)
        ck_assert_msg(moe_config_set(&c, NULL, *sets) == 0, "%s: %s", *sets, moe_last_error());
    return c;
}

// The GPU trainer on moe_ops_cpu: bytes its init takes (tracked) must be the
// plan's total for the CPU table, and a training step allocates no more.
static void check_cpu_table(const char *const *sets, const char *name) {
    moe_config c = with(sets);
    const int B = c.train.batch_size, T = c.model.seq_len;
    moe_model m;
    moe_adamw opt;
    char names[MOE_MAX_TASKS][MOE_NAME_MAX]; // the tasks the plan counts
    ck_assert_msg(moe_model_init(&m, &c, B, T, moe_config_task_names(&c, names)) == 0, "%s: %s",
                  name, moe_last_error());
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    moe_gpu_mem_plan p;
    ck_assert_msg(moe_plan_device_memory(&c, &moe_ops_cpu, &p) == 0, "%s: %s", name,
                  moe_last_error());
    ck_assert_uint_eq(p.total,
                      p.params + p.grads + p.optimizer + p.activations + p.moe + p.trainer);
    ck_assert_uint_eq(p.moe, 0); // the CPU table's copy runs the host model's MoE layers
    const size_t before = moe_mem_in_use();
    moe_gpu_trainer g;
    ck_assert_msg(moe_gpu_trainer_init(&g, &m, &opt, &c, (size_t)B * T, &moe_ops_cpu) == 0,
                  "%s: %s", name, moe_last_error());
    const size_t after = moe_mem_in_use();
    ck_assert_msg(after - before == p.total, "%s: device path took %zu bytes, plan says %zu", name,
                  after - before, p.total);
    int32_t *tok = calloc((size_t)B * T, sizeof *tok);
    ck_assert_ptr_nonnull(tok);
    for (int i = 0; i < B * T; i++)
        tok[i] = (i * 7 + 3) % c.model.vocab_size;
    double gn = 0;
    ck_assert_int_eq(moe_gpu_zero_grads(&g), 0);
    ck_assert_msg(moe_gpu_micro_batch(&g, tok, tok, NULL, B, T, 0) == 0, "%s", moe_last_error());
    ck_assert_msg(moe_gpu_optimizer_step(&g, &opt, 1, 1e-3f, &c, &gn) == 0, "%s", moe_last_error());
    ck_assert_uint_eq(moe_mem_in_use(), after);
    free(tok);
    moe_gpu_trainer_free(&g);
    ck_assert_uint_eq(moe_mem_in_use(), before);
    moe_adamw_free(&opt);
    moe_model_free(&m);
}

START_TEST(test_device_plan_equals_cpu_table_allocations) {
    const char *moe[] = {NULL};
    const char *dense[] = {"moe.every=0", NULL};
    const char *cce[] = {"loss.impl=cce", NULL};
    const char *batch8[] = {"train.batch_size=8", NULL};
    const char *tasks[] = {"moe.task_layers=[0]", "router.noise=jitter", NULL};
    const char *mst_moe[] = {"memory.mini_seq=4", "memory.recompute=moe", NULL};
    const char *mst_all[] = {"memory.mini_seq=2", "memory.recompute=all", "moe.every=2", NULL};
    check_cpu_table(mst_moe, "mini_seq_moe");
    check_cpu_table(mst_all, "mini_seq_all");
    check_cpu_table(moe, "moe");
    check_cpu_table(dense, "dense");
    check_cpu_table(cce, "cce");
    check_cpu_table(batch8, "batch8");
    check_cpu_table(tasks, "tasks");
}
END_TEST

START_TEST(test_cuda_plan_sizes_by_hand) {
    // T_max 4, E 2, k 1, sort temp 100: 23 buffers in moe_cuda_plan_alloc's order
    size_t s[MOE_CUDA_PLAN_BUFS];
    moe_cuda_plan_sizes(4, 2, 1, 100, s);
    const size_t want[MOE_CUDA_PLAN_BUFS] = {16,
                                             16,
                                             16,
                                             16,
                                             32,
                                             16,
                                             8,
                                             8,
                                             8,
                                             12,
                                             8,
                                             16,
                                             32,
                                             32,
                                             16,
                                             116,
                                             8,
                                             8,
                                             8,
                                             24,
                                             24,
                                             8,
                                             4 * MOE_MAX_TASKS};
    for (int i = 0; i < MOE_CUDA_PLAN_BUFS; i++)
        ck_assert_msg(s[i] == want[i], "buffer %d: %zu, want %zu", i, s[i], want[i]);
    ck_assert_uint_eq(moe_cuda_granule(0), 256);
    ck_assert_uint_eq(moe_cuda_granule(256), 256);
    ck_assert_uint_eq(moe_cuda_granule(257), 512);
    // a layer of T 4, D 8, H 16, E 2, k 1, no shared expert, no noise, no tasks:
    // 12 buffers under 256 bytes and R D 4 = 128, R 2H 4 = 512 (two), R H 4 = 256
    moe_layer_config lc = {0};
    lc.T_max = 4, lc.D = 8, lc.H = 16, lc.E = 2;
    moe_router_config_default(&lc.router);
    lc.router.top_k = 1;
    size_t b[MOE_CUDA_LAYER_BUFS];
    moe_cuda_layer_sizes(&lc, b);
    int nonzero = 0;
    for (int i = 0; i < MOE_CUDA_LAYER_BUFS; i++)
        nonzero += b[i] != 0;
    ck_assert_int_eq(nonzero,
                     12); // logits, row, xe, ab, h, ye, dlogits, dweight, dye, dxe, dh, dab
    ck_assert_uint_eq(b[3], 512);
    ck_assert_uint_eq(b[13], 512);
    // layer: 10 x 256 + 2 x 512; plan: 23 buffers of one granule (sort temp + 16 < 256)
    ck_assert_uint_eq(moe_cuda_layer_bytes(&lc, 100), 10 * 256 + 2 * 512 + 23 * 256);
    lc.router.noise = MOE_NOISE_JITTER; // three [T, D] buffers more
    ck_assert_uint_eq(moe_cuda_layer_bytes(&lc, 100), 13 * 256 + 2 * 512 + 23 * 256);
    // two mini-sequence chunks: the expert side holds Tc = 2 tokens (ab and dab
    // 2 * 2H * 4 = 256 bytes), dweight stays [T k], plus the chunk's offsets
    lc.router.noise = MOE_NOISE_NONE;
    lc.n_chunks = 2;
    moe_cuda_layer_sizes(&lc, b);
    ck_assert_uint_eq(b[1], 8); // the chunk's rows
    ck_assert_uint_eq(b[3], 256);
    ck_assert_uint_eq(b[9], 16); // dweight
    ck_assert_uint_eq(b[21], 12);
    ck_assert_uint_eq(moe_cuda_layer_bytes(&lc, 100), 13 * 256 + 23 * 256);
}
END_TEST

// The CUDA plan's parts are the sizing functions': MoE layers from
// moe_cuda_layer_bytes, the trainer's buffers as moe_gpu_trainer_bytes, cut
// cross-entropy's scratch as moe_cuda_cce_scratch_floats.
START_TEST(test_cuda_plan_parts_follow_size_functions) {
    moe_config c = with(NULL);
    moe_gpu_mem_plan p, p2;
    ck_assert_msg(moe_plan_device_memory(&c, NULL, &p) == 0, "%s", moe_last_error());
    const int B = c.train.batch_size, T = c.model.seq_len;
    moe_layer_config lc = {0};
    lc.T_max = B * T, lc.D = c.model.d_model, lc.H = c.model.d_ff;
    lc.router = c.router;
    size_t moe = 0;
    int n_moe = 0;
    for (int l = 0; l < c.model.n_layers; l++) {
        if (!moe_config_is_moe(&c, l)) continue;
        lc.E = moe_config_experts(&c, l);
        moe += moe_cuda_layer_bytes(&lc, moe_cuda_sort_tmp_bytes(B * T, NULL));
        n_moe++;
    }
    ck_assert_int_gt(n_moe, 0);
    ck_assert_uint_eq(p.moe, moe);
    moe_model_mem mm;
    ck_assert_int_eq(moe_model_memory(&c, B, T, 1, 1, 0, 0, &mm), 0);
    size_t opt = 0;
    ck_assert_uint_eq(p.trainer + p.optimizer,
                      moe_gpu_trainer_bytes(mm.n_params, (size_t)B * T, &moe_ops_cuda_sizes, &opt));
    ck_assert_uint_eq(p.optimizer, opt);
    ck_assert_uint_eq(p.params, moe_cuda_granule(mm.n_params * 4));
    // cut cross-entropy trades [N, V] logits for the CUDA scratch
    moe_config x = c;
    ck_assert_int_eq(moe_config_set(&x, NULL, "loss.impl=cce"), 0);
    ck_assert_int_eq(moe_plan_device_memory(&x, NULL, &p2), 0);
    const size_t N = (size_t)B * T, V = c.model.vocab_size;
    const size_t plain = (N * V + N * V) * 4; // logits and dlogits
    const size_t fused = (T * V + N + moe_cuda_cce_scratch_floats(B * T, (int)V)) * 4;
    ck_assert_uint_eq(p.activations - plain + fused, p2.activations);
    // mini-sequence chunks: MoE layers sized as moe_cuda_layer_bytes with
    // n_chunks, the attention state shared by the layers under recompute = all
    x = c;
    ck_assert_int_eq(moe_config_set(&x, NULL, "memory.mini_seq=4"), 0);
    ck_assert_int_eq(moe_config_set(&x, NULL, "memory.recompute=all"), 0);
    ck_assert_msg(moe_plan_device_memory(&x, NULL, &p2) == 0, "%s", moe_last_error());
    lc.n_chunks = 4;
    size_t moe4 = 0;
    for (int l = 0; l < c.model.n_layers; l++)
        if (moe_config_is_moe(&c, l)) {
            lc.E = moe_config_experts(&c, l);
            moe4 += moe_cuda_layer_bytes(&lc, moe_cuda_sort_tmp_bytes(B * T, NULL));
        }
    ck_assert_uint_eq(p2.moe, moe4);
    ck_assert_uint_lt(p2.moe, p.moe);
    ck_assert_uint_lt(p2.activations, p.activations);
}
END_TEST

// What `moe plan` prints for c on one rank (a static buffer).
static const char *plan_text(const moe_config *c) {
    static char text[8192];
    moe_machine mc = {1, 1, 1, {400, 100}, {2, 5}};
    char path[600];
    snprintf(path, sizeof path, "%s/plan.txt", tu_tmpdir());
    FILE *f = fopen(path, "w+");
    ck_assert_ptr_nonnull(f);
    ck_assert_msg(moe_plan_print(c, &mc, f) == 0, "%s", moe_last_error());
    rewind(f);
    text[fread(text, 1, sizeof text - 1, f)] = '\0';
    fclose(f);
    return text;
}

START_TEST(test_plan_prints_device_section_for_cuda) {
    moe_config c = with((const char *const[]){"train.device=cuda", NULL});
    moe_gpu_mem_plan p;
    ck_assert_int_eq(moe_plan_device_memory(&c, NULL, &p), 0);
    const char *text = plan_text(&c);
    char want[64];
    ck_assert_msg(strstr(text, "device memory per rank"), "%s", text);
    snprintf(want, sizeof want, "(%zu bytes)", p.total);
    ck_assert_msg(strstr(text, want), "no '%s' in:\n%s", want, text);
    ck_assert_msg(strstr(text, "not counted: the CUDA context"), "%s", text);
    // a setting the GPU refuses: the section says why
    c.router.score = MOE_SCORE_SIGMOID;
    ck_assert_int_eq(moe_plan_device_memory(&c, NULL, &p), MOE_EINVAL);
    text = plan_text(&c);
    ck_assert_msg(strstr(text, "not computed: training on the GPU does not support router.score"),
                  "%s", text);
}
END_TEST

START_TEST(test_plan_has_no_device_section_on_cpu) {
    moe_config c = with(NULL);
    const char *text = plan_text(&c);
    ck_assert_msg(!strstr(text, "device memory"), "%s", text);
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("plan_device");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_device_plan_equals_cpu_table_allocations);
    tcase_add_test(tc, test_cuda_plan_sizes_by_hand);
    tcase_add_test(tc, test_cuda_plan_parts_follow_size_functions);
    tcase_add_test(tc, test_plan_prints_device_section_for_cuda);
    tcase_add_test(tc, test_plan_has_no_device_section_on_cpu);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
