// The op table's decoder and optimizer entries on the CPU: they are the
// reference kernels themselves (kernels/cpu/nn.h), and the table's AdamW,
// sum of squares and scaling reproduce the trainer's optimizer
// (trainer/optim.c) bit for bit, so a backend compared with the table is
// compared with what training runs.
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/nn.h"
#include "kernels/ops.h"
#include "moe/error.h"
#include "moe/optim.h"
#include "testutil.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

static const moe_ops *ops = &moe_ops_cpu;

// Every slot filled: a NULL entry would crash a caller, not fail a test. The
// fused expert op is optional (callers loop over expert blocks without it).
static bool optional_entry(size_t offset) {
    return offset == offsetof(moe_ops, expert_ffn_forward) ||
           offset == offsetof(moe_ops, expert_ffn_backward);
}

static void assert_complete(const moe_ops *t) {
    for (size_t off = sizeof(const char *); off < sizeof *t; off += sizeof(void *)) {
        const void *slot = *(const void *const *)((const char *)t + off);
        ck_assert_msg(slot != NULL || optional_entry(off), "moe_ops %s entry at byte %zu is NULL",
                      t->name, off);
    }
}

START_TEST(test_cpu_table_has_every_op) {
    assert_complete(ops);
#ifdef MOE_HAVE_CUDA // the CUDA tables are complete too (no device needed to look)
    assert_complete(&moe_ops_cuda);
    assert_complete(&moe_ops_cuda_bf16);
    ck_assert_str_eq(moe_ops_cuda.name, "cuda");
    ck_assert_ptr_ne((void *)moe_ops_cuda.matmul, (void *)moe_ops_cuda_bf16.matmul);
#endif
    ck_assert_ptr_nonnull((void *)ops->expert_ffn_forward); // the CPU has the fused op
    ck_assert_ptr_eq((void *)ops->rmsnorm_forward, (void *)moe_cpu_rmsnorm_forward);
    ck_assert_ptr_eq((void *)ops->attention_backward, (void *)moe_cpu_attention_backward);
    ck_assert_ptr_eq((void *)ops->crossentropy_forward, (void *)moe_cpu_crossentropy_forward);
}
END_TEST

// The CPU saves one log-sum-exp per query row; its scratch is one slot per
// pool thread: backward's transposed Q and dO of a head (T rounded to 64
// times head_dim, twice), D and lse (twice 320), two 64x64 tiles and K, V, Q,
// dO rows [320 x head_dim rounded to 16], plus three [320 x 48] accumulators
// when head_dim (40) is not a multiple of 16; with
// GQA also dK and dV per query head (2 x B x Hq x [320 x hd padded]). CUDA
// saves the probabilities and needs one query head's [B, T, T] scratch.
START_TEST(test_attention_buffer_sizes_per_backend) {
    const size_t threads = (size_t)moe_cpu_threads();
    ck_assert_uint_eq(ops->attention_state_floats(2, 300, 6), 2 * 6 * 300);
    ck_assert_uint_eq(ops->attention_scratch_floats(2, 300, 6, 6, 64),
                      threads * (2 * 320 * 64 + 2 * 320 + 2 * 64 * 64 + 4 * 320 * 64));
    ck_assert_uint_eq(ops->attention_scratch_floats(2, 300, 6, 6, 40),
                      threads * (2 * 320 * 40 + 2 * 320 + 2 * 64 * 64 + 7 * 320 * 48));
    ck_assert_uint_eq(ops->attention_scratch_floats(2, 300, 6, 2, 40),
                      threads * (2 * 320 * 40 + 2 * 320 + 2 * 64 * 64 + 7 * 320 * 48) +
                          2 * 2 * 6 * 320 * 48);
#ifdef MOE_HAVE_CUDA
    ck_assert_uint_eq(moe_ops_cuda.attention_state_floats(2, 300, 6), 2 * 6 * 300 * 300);
    ck_assert_uint_eq(moe_ops_cuda_bf16.attention_scratch_floats(2, 300, 6, 2, 64), 2 * 300 * 300);
#endif
}
END_TEST

// The grouped GEMMs are the per-segment GEMMs the MoE layer makes, bit for
// bit; an empty segment is skipped and decreasing offsets are an error.
START_TEST(test_grouped_matmul_equals_per_segment_calls) {
    const int G = 3, N = 5, K = 7, offsets[] = {0, 4, 4, 9};
    const size_t stride = (size_t)N * K + 2;
    tu_rng r;
    tu_seed(&r, 11);
    float a[9 * 7], b[3 * 37], c1[9 * 5], c2[9 * 5], w1[3 * 37], w2[3 * 37];
    tu_fill_normal(&r, a, 9 * 7, 1.0f);
    tu_fill_normal(&r, b, 3 * 37, 1.0f);
    tu_fill_normal(&r, c1, 9 * 5, 1.0f);
    memcpy(c2, c1, sizeof c1);
    ck_assert_int_eq(ops->matmul_grouped(c1, a, b, stride, offsets, G, N, K, true, 1.0f, 0.5f), 0);
    for (int g = 0; g < G; g++)
        if (offsets[g + 1] > offsets[g])
            ck_assert_int_eq(ops->matmul(c2 + offsets[g] * N, a + offsets[g] * K, b + g * stride,
                                         offsets[g + 1] - offsets[g], N, K, false, true, 1.0f,
                                         0.5f),
                             0);
    ck_assert_int_eq(memcmp(c1, c2, sizeof c1), 0);
    tu_fill_normal(&r, w1, 3 * 37, 1.0f);
    memcpy(w2, w1, sizeof w1);
    const size_t ws = (size_t)K * N + 2;
    ck_assert_int_eq(ops->matmul_grouped_wgrad(w1, ws, a, c1, offsets, G, K, N, 1.0f, 1.0f), 0);
    for (int g = 0; g < G; g++) {
        int n = offsets[g + 1] - offsets[g];
        for (int i = 0; i < K; i++) // w_g[i][j] += sum_r a[r][i] c[r][j], in double here
            for (int j = 0; j < N; j++) {
                double s = 0.0;
                for (int q = 0; q < n; q++)
                    s += (double)a[(offsets[g] + q) * K + i] * c1[(offsets[g] + q) * N + j];
                ck_assert_double_eq_tol(w1[g * ws + i * N + j], w2[g * ws + i * N + j] + s, 1e-5);
            }
    }
    const int bad[] = {0, 5, 3, 9};
    ck_assert_int_eq(ops->matmul_grouped(c1, a, b, stride, bad, G, N, K, true, 1.0f, 0.0f),
                     MOE_EINVAL);
}
END_TEST

START_TEST(test_adamw_op_equals_trainer_update_bitwise) {
    const size_t n = 1001;
    tu_rng r;
    tu_seed(&r, 7);
    float *p1 = malloc(n * sizeof(float)), *p2 = malloc(n * sizeof(float));
    float *g = malloc(n * sizeof(float)), *m = calloc(n, sizeof(float)),
          *v = calloc(n, sizeof(float));
    uint8_t *decay = malloc(n);
    tu_fill_normal(&r, p1, n, 1.0f);
    memcpy(p2, p1, n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        decay[i] = i % 4 != 1;
    // The trainer's optimizer takes the mask as decayed ranges (runs of 1s).
    moe_adamw opt = {.n = n,
                     .m = calloc(n, sizeof(float)),
                     .v = calloc(n, sizeof(float)),
                     .decay = malloc(sizeof(size_t) * (n + 1)),
                     .step = 0};
    for (size_t i = 0; i < n; i++)
        if (decay[i] && (i == 0 || !decay[i - 1]))
            opt.decay[2 * opt.n_decay] = i, opt.decay[2 * opt.n_decay + 1] = i + 1, opt.n_decay++;
        else if (decay[i])
            opt.decay[2 * opt.n_decay - 1] = i + 1;
    for (long step = 1; step <= 7; step++) {
        tu_fill_normal(&r, g, n, 0.3f);
        moe_adamw_update(&opt, p1, g, 3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f);
        ck_assert_int_eq(ops->adamw(p2, m, v, g, decay, n, step, 3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f),
                         0);
    }
    ck_assert_int_eq(memcmp(p1, p2, n * sizeof(float)), 0);
    ck_assert_int_eq(memcmp(opt.m, m, n * sizeof(float)), 0);
    ck_assert_int_eq(memcmp(opt.v, v, n * sizeof(float)), 0);
    ck_assert_int_eq(ops->adamw(p2, m, v, g, decay, n, 0, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f),
                     MOE_EINVAL);

    double s;
    ck_assert_int_eq(ops->sumsq(&s, g, n), 0);
    double norm = moe_grad_norm(g, n);
    ck_assert(sqrt(s) == norm); // same double sum in the same order
    memcpy(p1, g, n * sizeof(float));
    float scale = moe_grad_clip(p1, n, norm, norm / 2);
    ck_assert_int_eq(ops->scale(g, n, scale), 0);
    ck_assert_int_eq(memcmp(p1, g, n * sizeof(float)), 0);

    free(opt.m), free(opt.v), free(opt.decay);
    free(p1), free(p2), free(g), free(m), free(v), free(decay);
}
END_TEST

int main(void) {
    Suite *s = suite_create("ops_table");
    TCase *tc = tcase_create("cpu");
    tcase_add_test(tc, test_cpu_table_has_every_op);
    tcase_add_test(tc, test_attention_buffer_sizes_per_backend);
    tcase_add_test(tc, test_grouped_matmul_equals_per_segment_calls);
    tcase_add_test(tc, test_adamw_op_equals_trainer_update_bitwise);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
