// Training on the GPU (train.device = cuda) against the CPU: 20 steps of the
// same small MoE model from the same seed give the same loss at every step
// (within 1e-3 relative: the GPU sums in other orders and the differences
// compound through AdamW), in fp32 and, looser, with bf16 GEMMs; the run
// writes the same files (checkpoint from the device parameters, evaluation
// on the host). Without CUDA or a device it prints why and exits 77
// (ctest: skipped).
#include "moe/error.h"
#include "moe/plan.h"
#include "moe/train.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cuda.h"

static moe_config small(const char *device, const char *compute) {
    moe_config c = tu_small_config();
    c.train.steps = 20;
    snprintf(c.train.device, sizeof c.train.device, "%s", device);
    snprintf(c.train.compute, sizeof c.train.compute, "%s", compute);
    return c;
}

// sets: extra config assignments (NULL-terminated), or NULL.
static void run_with(const char *device, const char *compute, double *losses, const char *name,
                     const char *const *sets) {
    moe_config c = small(device, compute);
    for (; sets && *sets; sets++)
        ck_assert_msg(moe_config_set(&c, NULL, *sets) == 0, "%s", moe_last_error());
    moe_train_opts o = {0};
    char out[600];
    snprintf(out, sizeof out, "%s/%s", tu_tmpdir(), name);
    o.out_dir = out;
    o.quiet = true;
    o.losses = losses;
    moe_train_result r;
    int rc = moe_train(&c, &o, &r);
    ck_assert_msg(rc == 0, "%s run: %s", device, moe_last_error());
    ck_assert_int_eq(r.steps, 20);
    ck_assert_msg(isfinite(r.eval.val_loss), "%s: val loss %g", device, r.eval.val_loss);
    moe_eval_result_free(&r.eval);
}

static void run(const char *device, const char *compute, double *losses, const char *name) {
    run_with(device, compute, losses, name, NULL);
}

START_TEST(test_gpu_training_losses_match_cpu) {
    double cpu[20], gpu[20], bf16[20];
    run("cpu", "fp32", cpu, "cpu");
    run("cuda", "fp32", gpu, "cuda");
    for (int s = 0; s < 20; s++)
        ck_assert_msg(fabs(gpu[s] - cpu[s]) <= 1e-3 * fabs(cpu[s]), "step %d: gpu %.7f, cpu %.7f",
                      s, gpu[s], cpu[s]);
    ck_assert_msg(cpu[19] < cpu[0] - 0.5, "the loss must fall: %g -> %g", cpu[0], cpu[19]);
    run("cuda", "bf16", bf16, "bf16");
    for (int s = 0; s < 20; s++)
        ck_assert_msg(fabs(bf16[s] - cpu[s]) <= 3e-2 * fabs(cpu[s]),
                      "step %d: gpu bf16 %.7f, cpu %.7f", s, bf16[s], cpu[s]);
}
END_TEST

// No floating-point atomics in the sums (issue 14 item 7): two identical GPU
// runs give the same losses and the same checkpoint bytes.
START_TEST(test_gpu_training_is_deterministic) {
    double a[20], b[20];
    run("cuda", "fp32", a, "det_a");
    run("cuda", "fp32", b, "det_b");
    for (int s = 0; s < 20; s++)
        ck_assert_msg(a[s] == b[s], "step %d: %.9g then %.9g", s, a[s], b[s]);
    char ca[700], cb[700];
    snprintf(ca, sizeof ca, "%s/det_a/checkpoint", tu_tmpdir());
    snprintf(cb, sizeof cb, "%s/det_b/checkpoint", tu_tmpdir());
    tu_assert_same_checkpoint(ca, cb);
}
END_TEST

// Router noise (jitter on the gate input, Gumbel choices), task priorities in
// BPR order and task-level routing on the GPU: the CPU's losses step by step,
// same tolerance as the plain comparison.
static void gpu_matches_cpu(const char *const *sets, const char *name) {
    double cpu[20], gpu[20];
    char dir[64];
    snprintf(dir, sizeof dir, "%s_cpu", name);
    run_with("cpu", "fp32", cpu, dir, sets);
    snprintf(dir, sizeof dir, "%s_cuda", name);
    run_with("cuda", "fp32", gpu, dir, sets);
    for (int s = 0; s < 20; s++)
        ck_assert_msg(fabs(gpu[s] - cpu[s]) <= 1e-3 * fabs(cpu[s]),
                      "%s step %d: gpu %.7f, cpu %.7f", name, s, gpu[s], cpu[s]);
}

START_TEST(test_gpu_training_with_router_jitter_matches_cpu) {
    const char *sets[] = {"router.noise=jitter", "router.noise_eps=0.1", NULL};
    gpu_matches_cpu(sets, "jitter");
}
END_TEST

START_TEST(test_gpu_training_with_router_gumbel_matches_cpu) {
    const char *sets[] = {"router.noise=gumbel", "router.top_k=2", NULL};
    gpu_matches_cpu(sets, "gumbel");
}
END_TEST

START_TEST(test_gpu_training_with_task_priority_matches_cpu) {
    const char *sets[] = {"router.slot_order=priority", "router.task_priority=1,3,2,3,0",
                          "router.capacity_factor=1.0", NULL};
    gpu_matches_cpu(sets, "task_priority");
}
END_TEST

START_TEST(test_gpu_training_with_task_layers_matches_cpu) {
    const char *sets[] = {"moe.task_layers=[0]", "router.noise=jitter", NULL};
    gpu_matches_cpu(sets, "task_layers");
}
END_TEST

// memory.mini_seq with recompute = moe (chunked MoE layers, dense FFN and LM
// head) and = all (attention recomputed from each layer's input too).
START_TEST(test_gpu_training_with_mini_seq_matches_cpu) {
    const char *moe[] = {"memory.mini_seq=4", "memory.recompute=moe", "moe.shared_experts=1", NULL};
    gpu_matches_cpu(moe, "mini_seq_moe");
    const char *all[] = {"memory.mini_seq=3", "memory.recompute=all", "moe.every=2", NULL};
    gpu_matches_cpu(all, "mini_seq_all");
}
END_TEST

START_TEST(test_gpu_training_refuses_unsupported_configs) {
    moe_config c = small("cuda", "fp32");
    c.router.score = MOE_SCORE_SIGMOID;
    moe_train_opts o = {0};
    char out[600];
    snprintf(out, sizeof out, "%s/sigmoid", tu_tmpdir());
    o.out_dir = out;
    o.quiet = true;
    moe_train_result r;
    ck_assert_int_eq(moe_train(&c, &o, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "router.score = sigmoid"), "%s", moe_last_error());
}
END_TEST

// Issue 14 item 5: the tracked device peak of a few training steps
// (moe_cuda_mem_peak: every moe_cuda_alloc, router plans included) equals
// `moe plan`'s device total, dense and MoE, fp32 and bf16 GEMMs, cut
// cross-entropy, two batch sizes, task routing with jitter, mini-sequence
// chunks with recompute = moe and all. The issue allows 3%; the tracked part
// is exact.
static void peak_matches_plan(const char *compute, const char *const *sets, const char *name) {
    moe_config c = small("cuda", compute);
    c.train.steps = 3;
    for (; sets && *sets; sets++)
        ck_assert_msg(moe_config_set(&c, NULL, *sets) == 0, "%s", moe_last_error());
    moe_gpu_mem_plan p;
    ck_assert_msg(moe_plan_device_memory(&c, NULL, &p) == 0, "%s: %s", name, moe_last_error());
    ck_assert_msg(!p.sort_tmp_estimated, "%s: cub's temp size should be exact on a GPU", name);
    moe_train_opts o = {0};
    char out[600];
    snprintf(out, sizeof out, "%s/peak_%s", tu_tmpdir(), name);
    o.out_dir = out;
    o.quiet = true;
    ck_assert_int_eq(moe_cuda_init(0), 0);
    const size_t base = moe_cuda_mem_in_use();
    moe_cuda_mem_reset_peak();
    moe_train_result r;
    ck_assert_msg(moe_train(&c, &o, &r) == 0, "%s: %s", name, moe_last_error());
    moe_eval_result_free(&r.eval);
    const size_t peak = moe_cuda_mem_peak() - base;
    ck_assert_msg(peak == p.total, "%s: tracked device peak %zu bytes, plan %zu (%.3f%%)", name,
                  peak, p.total, 100.0 * ((double)peak - (double)p.total) / (double)p.total);
    ck_assert_uint_eq(moe_cuda_mem_in_use(), base); // all freed
}

START_TEST(test_gpu_device_peak_equals_plan) {
    const char *dense[] = {"moe.every=0", NULL};
    const char *cce[] = {"loss.impl=cce", NULL};
    const char *batch8[] = {"train.batch_size=8", NULL};
    const char *tasks[] = {"moe.task_layers=[0]", "router.noise=jitter", NULL};
    const char *mst_moe[] = {"memory.mini_seq=4", "memory.recompute=moe", NULL};
    const char *mst_all[] = {"memory.mini_seq=2", "memory.recompute=all", "train.batch_size=8",
                             NULL};
    peak_matches_plan("fp32", mst_moe, "mini_seq_moe");
    peak_matches_plan("bf16", mst_all, "mini_seq_all_bf16");
    peak_matches_plan("fp32", NULL, "moe_fp32");
    peak_matches_plan("bf16", NULL, "moe_bf16");
    peak_matches_plan("fp32", dense, "dense_fp32");
    peak_matches_plan("fp32", cce, "moe_cce");
    peak_matches_plan("bf16", batch8, "moe_bf16_batch8");
    peak_matches_plan("fp32", tasks, "moe_tasks_jitter");
}
END_TEST

static Suite *gpu_suite(void) {
    Suite *s = suite_create("train_gpu");
    TCase *tc = tcase_create("cuda_vs_cpu");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_gpu_training_losses_match_cpu);
    tcase_add_test(tc, test_gpu_training_is_deterministic);
    tcase_add_test(tc, test_gpu_training_with_router_jitter_matches_cpu);
    tcase_add_test(tc, test_gpu_training_with_router_gumbel_matches_cpu);
    tcase_add_test(tc, test_gpu_training_with_task_priority_matches_cpu);
    tcase_add_test(tc, test_gpu_training_with_task_layers_matches_cpu);
    tcase_add_test(tc, test_gpu_training_with_mini_seq_matches_cpu);
    tcase_add_test(tc, test_gpu_training_refuses_unsupported_configs);
    tcase_add_test(tc, test_gpu_device_peak_equals_plan);
    suite_add_tcase(s, tc);
    return s;
}

#else

static Suite *gpu_suite(void) {
    return suite_create("train_gpu");
}

#endif

int main(void) {
    return tu_run_gpu(gpu_suite(), "GPU training");
}
