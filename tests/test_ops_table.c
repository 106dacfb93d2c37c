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
#include <stdlib.h>
#include <string.h>

static const moe_ops *ops = &moe_ops_cpu;

START_TEST(test_cpu_table_has_every_op) {
    // Every slot filled: a NULL entry would crash a caller, not fail a test.
    const void *const *slot = (const void *const *)((const char *)ops + sizeof(const char *));
    size_t n = (sizeof *ops - sizeof(const char *)) / sizeof(void *);
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(slot[i] != NULL, "moe_ops_cpu entry %zu is NULL", i);
    ck_assert_ptr_eq((void *)ops->rmsnorm_forward, (void *)moe_cpu_rmsnorm_forward);
    ck_assert_ptr_eq((void *)ops->attention_backward, (void *)moe_cpu_attention_backward);
    ck_assert_ptr_eq((void *)ops->crossentropy_forward, (void *)moe_cpu_crossentropy_forward);
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
    moe_adamw opt = {.n = n,
                     .m = calloc(n, sizeof(float)),
                     .v = calloc(n, sizeof(float)),
                     .decay = malloc(n),
                     .step = 0};
    memcpy(opt.decay, decay, n);
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
    tcase_add_test(tc, test_adamw_op_equals_trainer_update_bitwise);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
