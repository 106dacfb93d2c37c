// The whole decoder: every parameter tensor's gradient against a central
// difference along a random direction in that tensor (dense and MoE layers,
// shared expert, task routing, tied and untied heads), with routing held
// fixed; and determinism of forward passes.
#include "moe/error.h"
#include "moe/model.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 2, T = 6, V = 24 };
#ifndef P_SCALE
#define P_SCALE 2.0
#endif
#ifndef H_REL
#define H_REL 1e-2
#endif

static moe_config tiny(void) {
    moe_config c;
    moe_config_default(&c);
    c.model.vocab_size = V;
    c.model.d_model = 16;
    c.model.n_layers = 2;
    c.model.n_heads = 4;
    c.model.n_kv_heads = 2;
    c.model.d_ff = 12;
    c.moe.num_experts[0] = 4;
    c.moe.d_expert = 8;
    c.router.capacity_factor = 1.0;
    c.router.min_capacity = 1;
    c.router.aux_loss_coef = 0.1;
    c.router.z_loss_coef = 0.01;
    return c;
}

// Copies every MoE layer's routing into buf (to detect flips).
static size_t snapshot(const moe_model *m, int *buf) {
    size_t n = 0;
    for (int l = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        const moe_plan *p = &m->a[l].moe.plan;
        if (buf) memcpy(buf + n, p->expert, sizeof(int) * p->T * p->k);
        n += (size_t)p->T * p->k;
    }
    return n;
}

static double loss_at(moe_model *m, const int32_t *in, const int32_t *tg, const int32_t *task,
                      const int *ref, int *cur) {
    ck_assert_int_eq(moe_model_forward(m, in, tg, task, B, T, false, 0), 0);
    size_t n = snapshot(m, cur);
    if (memcmp(ref, cur, n * sizeof(int))) return NAN;
    return m->loss;
}

static void check_model_grads(moe_config c, const char *what) {
    moe_model m;
    int rc = moe_model_init(&m, &c, B, T, 3);
    ck_assert_msg(rc == 0, "%s: %s", what, moe_last_error());
    // larger weights than the 0.02 init so every path carries signal
    tu_rng r;
    tu_seed(&r, 99);
    for (size_t i = 0; i < moe_model_numel(&m); i++)
        m.params[i] *= (float)P_SCALE;
    int32_t in[B * T], tg[B * T], task[B] = {0, 2};
    for (int i = 0; i < B * T; i++) {
        in[i] = (int32_t)(tu_uniform(&r) * V);
        tg[i] = i % 5 == 4 ? -1 : (int32_t)(tu_uniform(&r) * V);
    }
    ck_assert_int_eq(moe_model_forward(&m, in, tg, task, B, T, false, 0), 0);
    size_t n_plan = snapshot(&m, NULL);
    int *ref = malloc(sizeof(int) * (n_plan + 1)), *cur = malloc(sizeof(int) * (n_plan + 1));
    snapshot(&m, ref);
    memset(m.grads, 0, sizeof(float) * moe_model_numel(&m));
    ck_assert_int_eq(moe_model_backward(&m, in, tg, task), 0);

    int checked = 0;
    for (int v = 0; v < m.table.count; v++) {
        const moe_param_view *pv = &m.table.views[v];
        float *u = malloc(sizeof(float) * pv->numel);
        tu_fill_normal(&r, u, pv->numel, 1.0f);
        double gu = 0.0, pn = 0.0;
        for (size_t i = 0; i < pv->numel; i++) {
            gu += (double)m.grads[pv->offset + i] * u[i];
            pn += (double)m.params[pv->offset + i] * m.params[pv->offset + i];
        }
        float h = (float)(H_REL * fmax(sqrt(pn / pv->numel), 0.05));
        float *p = m.params + pv->offset;
        for (size_t i = 0; i < pv->numel; i++)
            p[i] += h * u[i];
        double lp = loss_at(&m, in, tg, task, ref, cur);
        for (size_t i = 0; i < pv->numel; i++)
            p[i] -= 2 * h * u[i];
        double lm = loss_at(&m, in, tg, task, ref, cur);
        for (size_t i = 0; i < pv->numel; i++)
            p[i] += h * u[i];
        free(u);
        if (isnan(lp) || isnan(lm)) continue; // the step flipped a routing decision
        double fd = (lp - lm) / (2.0 * h);
        ck_assert_msg(fabs(fd - gu) <= 1e-2 * fmax(fabs(fd), fabs(gu)) + 1e-4,
                      "%s: %s: analytic %g vs numeric %g", what, pv->name, gu, fd);
        checked++;
    }
    ck_assert_msg(checked >= m.table.count * 3 / 4, "%s: only %d of %d tensors checked", what,
                  checked, m.table.count);
    free(ref);
    free(cur);
    moe_model_free(&m);
}

START_TEST(test_model_gradients_dense_and_moe) {
    moe_config c = tiny();
    c.moe.every = 2; // layer 0 dense, layer 1 MoE
    check_model_grads(c, "every=2");
}
END_TEST

START_TEST(test_model_gradients_all_moe_untied_shared) {
    moe_config c = tiny();
    c.model.tie_embeddings = false;
    c.moe.shared_experts = 1;
    c.router.top_k = 1;
    c.router.normalize_topk = false;
    check_model_grads(c, "shared+untied");
}
END_TEST

START_TEST(test_model_gradients_task_routing_pyramid) {
    moe_config c = tiny();
    c.moe.n_num_experts = 2;
    c.moe.num_experts[0] = 2;
    c.moe.num_experts[1] = 4;
    c.moe.n_task_layers = 1;
    c.moe.task_layers[0] = 0;
    check_model_grads(c, "task+pyramid");
}
END_TEST

START_TEST(test_model_gradients_cce) {
    moe_config c = tiny();
    snprintf(c.loss.impl, sizeof c.loss.impl, "cce");
    check_model_grads(c, "cce");
}
END_TEST

// loss.impl = cce gives the plain loss and gradients (1e-5 relative).
START_TEST(test_model_cce_equals_plain) {
    moe_config c = tiny();
    c.model.tie_embeddings = false;
    moe_model a, b;
    ck_assert_int_eq(moe_model_init(&a, &c, B, T, 1), 0);
    snprintf(c.loss.impl, sizeof c.loss.impl, "cce");
    ck_assert_int_eq(moe_model_init(&b, &c, B, T, 1), 0);
    int32_t in[B * T], tg[B * T];
    for (int i = 0; i < B * T; i++)
        in[i] = (i * 7) % V, tg[i] = i % 4 == 1 ? -1 : (i * 5 + 3) % V;
    ck_assert_int_eq(moe_model_forward(&a, in, tg, NULL, B, T, false, 0), 0);
    ck_assert_int_eq(moe_model_forward(&b, in, tg, NULL, B, T, false, 0), 0);
    ck_assert_msg(fabs(a.ce - b.ce) <= 1e-5 * a.ce, "ce %.9g vs %.9g", a.ce, b.ce);
    ck_assert_int_eq(moe_model_backward(&a, in, tg, NULL), 0);
    ck_assert_int_eq(moe_model_backward(&b, in, tg, NULL), 0);
    double worst = 0, scale = 0;
    for (size_t i = 0; i < moe_model_numel(&a); i++) {
        scale = fmax(scale, fabs(a.grads[i]));
        worst = fmax(worst, fabs((double)a.grads[i] - b.grads[i]));
    }
    ck_assert_msg(worst <= 1e-5 * scale, "gradients differ by %.3g of %.3g", worst, scale);
    // inference logits still come out, one sequence at a time
    ck_assert_int_eq(moe_model_forward(&b, in, NULL, NULL, 1, T, false, 0), 0);
    ck_assert_int_eq(moe_model_forward(&b, in, NULL, NULL, B, T, false, 0), MOE_EINVAL);
    moe_model_free(&a);
    moe_model_free(&b);
}
END_TEST

START_TEST(test_model_forward_deterministic_and_checked) {
    moe_config c = tiny();
    moe_model a, b;
    ck_assert_int_eq(moe_model_init(&a, &c, B, T, 1), 0);
    ck_assert_int_eq(moe_model_init(&b, &c, B, T, 1), 0);
    ck_assert_mem_eq(a.params, b.params, sizeof(float) * moe_model_numel(&a));
    int32_t in[B * T], tg[B * T];
    for (int i = 0; i < B * T; i++)
        in[i] = (i * 7) % V, tg[i] = (i * 5 + 3) % V;
    ck_assert_int_eq(moe_model_forward(&a, in, tg, NULL, B, T, false, 0), 0);
    ck_assert_int_eq(moe_model_forward(&b, in, tg, NULL, B, T, false, 0), 0);
    ck_assert(a.loss == b.loss);
    ck_assert_msg(fabs(a.ce - log((double)V)) < 0.05, "ce %g",
                  a.ce); // small init: near-uniform predictions
    // a shorter batch than allocated works; a longer one is refused
    ck_assert_int_eq(moe_model_forward(&a, in, tg, NULL, 1, 3, false, 0), 0);
    ck_assert_int_eq(moe_model_forward(&a, in, tg, NULL, B, T + 1, false, 0), MOE_EINVAL);
    in[3] = V; // out of vocabulary
    ck_assert_int_eq(moe_model_forward(&a, in, tg, NULL, B, T, false, 0), MOE_EINVAL);
    moe_model_free(&a);
    moe_model_free(&b);
    c.model.n_kv_heads = 3;
    ck_assert_int_eq(moe_model_init(&a, &c, B, T, 1), MOE_EINVAL);
}
END_TEST

// The table-only model (checkpoint checks) lists the training model's views,
// with the same kinds of layers, and allocates nothing; expert-parallel keys
// are taken as one process, as by moe_model_init.
START_TEST(test_model_init_table_matches) {
    moe_config c = tiny();
    c.moe.shared_experts = 1;
    moe_model full, t;
    ck_assert_int_eq(moe_model_init(&full, &c, B, T, 3), 0);
    c.parallel.ep = 2;
    c.comm.overlap_degree = 2;
    ck_assert_msg(moe_model_init_table(&t, &c, 3) == 0, "%s", moe_last_error());
    ck_assert_int_eq(t.table.count, full.table.count);
    ck_assert_uint_eq(t.table.numel, full.table.numel);
    for (int i = 0; i < t.table.count; i++) {
        const moe_param_view *a = &t.table.views[i], *b = &full.table.views[i];
        ck_assert_str_eq(a->name, b->name);
        ck_assert_int_eq(a->ndim, b->ndim);
        for (int d = 0; d < a->ndim; d++)
            ck_assert_int_eq(a->shape[d], b->shape[d]);
        ck_assert_uint_eq(a->offset, b->offset);
    }
    ck_assert_int_eq(t.L, full.L);
    for (int l = 0; l < t.L; l++)
        ck_assert_int_eq(t.is_moe[l], full.is_moe[l]);
    ck_assert_ptr_null(t.params);
    ck_assert_ptr_null(t.grads);
    moe_model_free(&t);
    moe_model_free(&full);
    c.model.n_kv_heads = 3; // checked like the full model
    ck_assert_int_eq(moe_model_init_table(&t, &c, 3), MOE_EINVAL);
}
END_TEST

// The evaluation model (no gradients, no backward buffers) computes the
// training model's forward bit for bit, with plain and cut cross-entropy and
// mini-sequence chunks with recompute, and refuses a backward.
START_TEST(test_model_init_eval_forward_equal) {
    const char *impl[] = {"plain", "cce", "plain"};
    const int chunks[] = {1, 1, 2};
    for (int v = 0; v < 3; v++) {
        moe_config c = tiny();
        c.model.tie_embeddings = v == 1;
        snprintf(c.loss.impl, sizeof c.loss.impl, "%s", impl[v]);
        c.memory.mini_seq = chunks[v];
        if (chunks[v] > 1) snprintf(c.memory.recompute, sizeof c.memory.recompute, "all");
        moe_model a, e;
        ck_assert_int_eq(moe_model_init(&a, &c, B, T, 1), 0);
        ck_assert_msg(moe_model_init_eval(&e, &c, B, T, 1) == 0, "%s", moe_last_error());
        ck_assert_ptr_null(e.grads);
        ck_assert_ptr_null(e.dres);
        const size_t n = moe_model_numel(&a);
        for (size_t i = 0; i < n; i++) // zero until loaded
            ck_assert(e.params[i] == 0.0f);
        memcpy(e.params, a.params, n * sizeof(float));
        int32_t in[B * T], tg[B * T];
        for (int i = 0; i < B * T; i++)
            in[i] = (i * 7) % V, tg[i] = i % 5 == 2 ? -1 : (i * 5 + 3) % V;
        ck_assert_int_eq(moe_model_forward(&a, in, tg, NULL, B, T, false, 0), 0);
        ck_assert_int_eq(moe_model_forward(&e, in, tg, NULL, B, T, false, 0), 0);
        ck_assert_msg(a.loss == e.loss, "%s: loss %.9g vs %.9g", impl[v], a.loss, e.loss);
        ck_assert_int_eq(moe_model_forward(&a, in, NULL, NULL, 1, T, false, 0), 0);
        ck_assert_int_eq(moe_model_forward(&e, in, NULL, NULL, 1, T, false, 0), 0);
        ck_assert_mem_eq(a.logits, e.logits, sizeof(float) * T * V);
        ck_assert_int_eq(moe_model_forward(&e, in, tg, NULL, B, T, false, 0), 0);
        ck_assert_int_eq(moe_model_backward(&e, in, tg, NULL), MOE_EINVAL);
        moe_model_free(&a);
        moe_model_free(&e);
    }
}
END_TEST

static Suite *model_suite(void) {
    Suite *s = suite_create("model");
    TCase *tc = tcase_create("model");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_model_gradients_dense_and_moe);
    tcase_add_test(tc, test_model_gradients_all_moe_untied_shared);
    tcase_add_test(tc, test_model_gradients_task_routing_pyramid);
    tcase_add_test(tc, test_model_gradients_cce);
    tcase_add_test(tc, test_model_cce_equals_plain);
    tcase_add_test(tc, test_model_forward_deterministic_and_checked);
    tcase_add_test(tc, test_model_init_table_matches);
    tcase_add_test(tc, test_model_init_eval_forward_equal);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(model_suite());
}
