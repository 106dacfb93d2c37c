// The MoE layer (moe/moe_layer.h) on the CPU ops: forward against an
// independent double-precision per-token reference (its own softmax, top-k,
// position-order capacity and renormalisation), exact zeros for dropped
// assignments, central-difference gradients of L = sum(y*r) + a*aux + z*zloss
// for every parameter tensor and x (shared expert, task routing, jitter), the
// edge cases of DESIGN "Tests", and repeatability with intact guards.
#include "moe/error.h"
#include "moe/moe_layer.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---- fixture --------------------------------------------------------------------------

typedef struct {
    moe_layer_config cfg;
    int T, k;
    size_t np;
    float *flat, *gflat; // parameters and gradients (caller-owned flat buffers)
    moe_layer_params p, g;
    moe_layer_acts a;
    float *x, *r;  // input [T, D], loss weights [T, D]
    float *y, *dx; // guarded outputs
    int *task;     // [T] task ids (or NULL)
    bool training; // router noise on
    uint64_t step;
} fixture;

static moe_layer_config small_cfg(int T, int D, int H, int E, int k, double cf, int min_cap) {
    moe_layer_config c;
    memset(&c, 0, sizeof c);
    c.T_max = T, c.D = D, c.H = H, c.E = E;
    moe_router_config_default(&c.router);
    c.router.top_k = k;
    c.router.capacity_factor = cf;
    c.router.min_capacity = min_cap;
    return c;
}

// Random parameters scaled so pre-activations are O(1); gate rows N(0, gate_scale).
static void fx_init(fixture *f, const moe_layer_config *cfg, uint64_t seed, float gate_scale) {
    memset(f, 0, sizeof *f);
    f->cfg = *cfg;
    f->T = cfg->T_max;
    f->k = cfg->router.top_k;
    int T = f->T, D = cfg->D;
    tu_rng r;
    tu_seed(&r, seed);
    f->np = moe_layer_num_params(cfg);
    f->flat = malloc(f->np * sizeof(float));
    f->gflat = calloc(f->np, sizeof(float));
    ck_assert_ptr_nonnull(f->flat);
    ck_assert_int_eq(moe_layer_params_view(&f->p, f->flat, cfg), 0);
    ck_assert_int_eq(moe_layer_params_view(&f->g, f->gflat, cfg), 0);
    tu_fill_normal(&r, f->flat, f->np, 1.0f / sqrtf((float)D));
    tu_fill_normal(&r, f->p.gate, (size_t)cfg->E * D, gate_scale);
    for (int e = 0; e < cfg->E; e++) // w2 [D, H]: scale 1/sqrt(H)
        tu_fill_normal(&r, moe_layer_w2(&f->p, e), (size_t)D * cfg->H, 1.0f / sqrtf(cfg->H));
    if (cfg->n_tasks) tu_fill_normal(&r, f->p.task_emb, (size_t)cfg->n_tasks * D, 1.0f);
    f->x = malloc(sizeof(float) * T * D);
    f->r = malloc(sizeof(float) * T * D);
    tu_fill_normal(&r, f->x, (size_t)T * D, 1.0f);
    tu_fill_normal(&r, f->r, (size_t)T * D, 1.0f);
    f->y = tu_guarded_alloc((size_t)T * D);
    f->dx = tu_guarded_alloc((size_t)T * D);
    if (cfg->n_tasks) {
        f->task = malloc(sizeof(int) * T);
        for (int t = 0; t < T; t++)
            f->task[t] = (t * 7 + 3) % cfg->n_tasks;
    }
    int rc = moe_layer_acts_alloc(&f->a, cfg, &moe_ops_cpu);
    ck_assert_msg(rc == 0, "acts alloc: %s", moe_last_error());
}

static void fx_free(fixture *f) {
    ck_assert(tu_guards_intact(f->y, (size_t)f->T * f->cfg.D));
    ck_assert(tu_guards_intact(f->dx, (size_t)f->T * f->cfg.D));
    moe_layer_acts_free(&f->a);
    tu_guarded_free(f->y, (size_t)f->T * f->cfg.D);
    tu_guarded_free(f->dx, (size_t)f->T * f->cfg.D);
    free(f->flat), free(f->gflat), free(f->x), free(f->r), free(f->task);
}

static void fx_forward(fixture *f, const int *capacity) {
    int rc =
        moe_layer_forward(f->y, f->x, f->task, capacity, f->T, &f->p, &f->a, f->training, f->step);
    ck_assert_msg(rc == 0, "forward: %s", moe_last_error());
}

static int n_dropped(const fixture *f) {
    int d = 0;
    for (int i = 0; i < f->T * f->k; i++)
        d += f->a.plan.expert[i] < 0;
    return d;
}

// ---- naive reference ----------------------------------------------------------------------

// out[D] = w2 (silu(w1 x) * (w3 x)) with w13 [2H, D] (w1 rows then w3), w2 [D, H].
static void ref_ffn(double *out, const float *x, const float *w13, const float *w2, int D, int H) {
    double *h = malloc(sizeof(double) * H);
    for (int j = 0; j < H; j++) {
        double a = 0, b = 0;
        for (int d = 0; d < D; d++)
            a += (double)w13[(size_t)j * D + d] * x[d],
                b += (double)w13[(size_t)(H + j) * D + d] * x[d];
        h[j] = a / (1.0 + exp(-a)) * b;
    }
    for (int d = 0; d < D; d++) {
        double s = 0;
        for (int j = 0; j < H; j++)
            s += (double)w2[(size_t)d * H + j] * h[j];
        out[d] = s;
    }
    free(h);
}

// Mixtral MoE in double, token by token: softmax over gate logits, top-k by
// probability (ties to the lower index), position-order capacity (all first
// choices in token order, then second choices, ...), weights renormalised over
// kept choices, dropped choices contribute nothing; + shared expert.
// expert_out [T*k]: the kept expert of each choice or -1.
static void ref_forward(double *y, int *expert_out, const fixture *f, const int *capacity) {
    const moe_layer_config *c = &f->cfg;
    int T = f->T, D = c->D, E = c->E, k = f->k;
    double *p = malloc(sizeof(double) * T * E);
    int *ch = malloc(sizeof(int) * T * k), *cnt = calloc(E, sizeof(int));
    int *used = calloc(E, sizeof(int));
    for (int t = 0; t < T; t++) {
        const float *g = c->n_tasks ? f->p.task_emb + (size_t)f->task[t] * D : f->x + (size_t)t * D;
        double m = -INFINITY, s = 0;
        for (int e = 0; e < E; e++) {
            double l = 0;
            for (int d = 0; d < D; d++)
                l += (double)f->p.gate[(size_t)e * D + d] * g[d];
            p[t * E + e] = l;
            m = fmax(m, l);
        }
        for (int e = 0; e < E; e++)
            s += p[t * E + e] = exp(p[t * E + e] - m);
        for (int e = 0; e < E; e++)
            p[t * E + e] /= s;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++)
                    taken |= ch[t * k + i] == e;
                if (!taken && (best < 0 || p[t * E + e] > p[t * E + best])) best = e;
            }
            ch[t * k + j] = best;
            cnt[best]++;
        }
    }
    int cmax = 0;
    for (int e = 0; e < E; e++)
        cmax = cnt[e] > cmax ? cnt[e] : cmax;
    int cstat = (int)ceil((double)k * T / E * c->router.capacity_factor - 1e-9);
    if (cstat < c->router.min_capacity) cstat = c->router.min_capacity;
    for (int j = 0; j < k; j++)
        for (int t = 0; t < T; t++) {
            int e = ch[t * k + j];
            int C = c->router.capacity_factor <= 0 ? cmax : capacity ? capacity[e] : cstat;
            expert_out[t * k + j] = used[e] < C ? (used[e]++, e) : -1;
        }
    double *o = malloc(sizeof(double) * D);
    for (int t = 0; t < T; t++) {
        double s = 0;
        for (int j = 0; j < k; j++)
            if (expert_out[t * k + j] >= 0) s += p[t * E + expert_out[t * k + j]];
        for (int d = 0; d < D; d++)
            y[(size_t)t * D + d] = 0;
        for (int j = 0; j < k; j++) {
            int e = expert_out[t * k + j];
            if (e < 0) continue;
            double w = c->router.normalize_topk ? p[t * E + e] / s : p[t * E + e];
            ref_ffn(o, f->x + (size_t)t * D, moe_layer_w13(&f->p, e), moe_layer_w2(&f->p, e), D,
                    c->H);
            for (int d = 0; d < D; d++)
                y[(size_t)t * D + d] += w * o[d];
        }
        if (c->H_shared) {
            ref_ffn(o, f->x + (size_t)t * D, f->p.shared_w13, f->p.shared_w2, D, c->H_shared);
            for (int d = 0; d < D; d++)
                y[(size_t)t * D + d] += o[d];
        }
    }
    free(p), free(ch), free(cnt), free(used), free(o);
}

// Runs forward and compares y and the kept experts with the reference.
static void check_forward_vs_reference(fixture *f, const int *capacity) {
    fx_forward(f, capacity);
    int T = f->T, D = f->cfg.D, k = f->k;
    double *ref = malloc(sizeof(double) * T * D);
    int *ex = malloc(sizeof(int) * T * k);
    ref_forward(ref, ex, f, capacity);
    for (int i = 0; i < T * k; i++)
        ck_assert_msg(f->a.plan.expert[i] == ex[i], "token %d choice %d: expert %d, reference %d",
                      i / k, i % k, f->a.plan.expert[i], ex[i]);
    double worst = 0;
    for (int i = 0; i < T * D; i++) {
        double err = fabs(f->y[i] - ref[i]) / fmax(1.0, fabs(ref[i]));
        worst = err > worst ? err : worst;
    }
    ck_assert_msg(worst < 1e-5, "forward differs from the reference by %g", worst);
    free(ref), free(ex);
}

// ---- finite differences -------------------------------------------------------------------

static const double AUX_C = 0.1, Z_C = 0.05;

static double fx_loss(fixture *f) {
    fx_forward(f, NULL);
    double L = 0;
    for (int i = 0; i < f->T * f->cfg.D; i++)
        L += (double)f->y[i] * f->r[i];
    return L + AUX_C * f->a.plan.aux_loss + Z_C * f->a.plan.z_loss;
}

typedef struct {
    const char *name;
    float *v, *g;
    size_t n;
} tensor;

// Analytic gradient (backward after one forward, into zeroed buffers) against
// central differences of fx_loss on every coordinate. Coordinates whose
// perturbation changes the routing plan are not differentiable there: skipped.
static void check_gradients(fixture *f, tensor *ts, int nts) {
    int T = f->T, D = f->cfg.D, k = f->k;
    memset(f->gflat, 0, f->np * sizeof(float));
    memset(f->dx, 0, sizeof(float) * T * D);
    fx_forward(f, NULL);
    int rc = moe_layer_backward(f->dx, &f->g, f->r, f->x, f->task, T, &f->p, &f->a, (float)AUX_C,
                                (float)Z_C);
    ck_assert_msg(rc == 0, "backward: %s", moe_last_error());
    int *ex0 = malloc(sizeof(int) * T * k), *sl0 = malloc(sizeof(int) * T * k);
    memcpy(ex0, f->a.plan.expert, sizeof(int) * T * k);
    memcpy(sl0, f->a.plan.slot, sizeof(int) * T * k);
    for (int q = 0; q < nts; q++) {
        tensor *t = &ts[q];
        double num2 = 0, diff2 = 0, nmax = 0, dmax = 0, amax = 0;
        size_t skipped = 0;
        for (size_t i = 0; i < t->n; i++) {
            float v = t->v[i], vp = v + 1e-2f, vm = v - 1e-2f;
            t->v[i] = vp;
            double lp = fx_loss(f);
            int same = !memcmp(ex0, f->a.plan.expert, sizeof(int) * T * k) &&
                       !memcmp(sl0, f->a.plan.slot, sizeof(int) * T * k);
            t->v[i] = vm;
            double lm = fx_loss(f);
            same = same && !memcmp(ex0, f->a.plan.expert, sizeof(int) * T * k) &&
                   !memcmp(sl0, f->a.plan.slot, sizeof(int) * T * k);
            t->v[i] = v;
            if (!same) {
                skipped++;
                continue;
            }
            double num = (lp - lm) / ((double)vp - vm), an = t->g[i];
            num2 += num * num, diff2 += (an - num) * (an - num);
            nmax = fmax(nmax, fabs(num)), dmax = fmax(dmax, fabs(an - num));
            amax = fmax(amax, fabs(an));
        }
        double rel = sqrt(diff2) / fmax(sqrt(num2), 1e-12);
        ck_assert_msg(skipped * 5 <= t->n, "%s: %zu of %zu coordinates change the routing", t->name,
                      skipped, t->n);
        if (getenv("MOE_TEST_VERBOSE"))
            fprintf(stderr, "%-24s rel %.2e  worst %.2e of %.2e  skipped %zu/%zu\n", t->name, rel,
                    dmax, nmax, skipped, t->n);
        if (nmax < 1e-9) { // an expert nobody reached: the analytic gradient is zero too
            ck_assert_msg(q >= 2, "%s: gradient vanishes, the check tests nothing", t->name);
            ck_assert_msg(amax == 0.0, "%s: gradient %g where L does not depend on it", t->name,
                          amax);
            continue;
        }
        ck_assert_msg(rel < 1e-3 && dmax < 1e-2 * nmax,
                      "%s: relative error %g, worst element %g of max %g (%zu skipped)", t->name,
                      rel, dmax, nmax, skipped);
    }
    free(ex0), free(sl0);
}

// Every parameter tensor of the layer, plus x.
static int all_tensors(fixture *f, tensor *ts) {
    const moe_layer_config *c = &f->cfg;
    size_t D = c->D, H = c->H, Hs = c->H_shared;
    int n = 0;
    ts[n++] = (tensor){"x", f->x, f->dx, (size_t)f->T * D};
    ts[n++] = (tensor){"gate.weight", f->p.gate, f->g.gate, c->E * D};
    if (c->n_tasks)
        ts[n++] = (tensor){"task_embedding.weight", f->p.task_emb, f->g.task_emb, c->n_tasks * D};
    if (Hs) {
        ts[n++] = (tensor){"shared_expert.w1", f->p.shared_w13, f->g.shared_w13, Hs * D};
        ts[n++] = (tensor){"shared_expert.w3", f->p.shared_w13 + Hs * D, f->g.shared_w13 + Hs * D,
                           Hs * D};
        ts[n++] = (tensor){"shared_expert.w2", f->p.shared_w2, f->g.shared_w2, Hs * D};
    }
    static const char *names[3] = {"w1", "w3", "w2"};
    for (int e = 0; e < c->E && e < 8; e++)
        for (int m = 0; m < 3; m++) {
            static char buf[8][3][32];
            snprintf(buf[e][m], sizeof buf[e][m], "experts.%d.%s", e, names[m]);
            ts[n++] = (tensor){buf[e][m], moe_layer_w13(&f->p, e) + m * H * D,
                               moe_layer_w13(&f->g, e) + m * H * D, H * D};
        }
    return n;
}

static void check_all_gradients(fixture *f) {
    tensor ts[40];
    int n = all_tensors(f, ts);
    check_gradients(f, ts, n);
}

// ---- tests ----------------------------------------------------------------------------------

START_TEST(test_forward_matches_reference_with_drops) {
    fixture f;
    moe_layer_config c = small_cfg(24, 8, 6, 4, 2, 0.75, 1); // C = 9 < busiest expert
    fx_init(&f, &c, 1, 1.0f);
    check_forward_vs_reference(&f, NULL);
    ck_assert_int_gt(n_dropped(&f), 0);
    fx_free(&f);
}
END_TEST

START_TEST(test_forward_matches_reference_switch_top1_raw_weights_and_shared_expert) {
    fixture f;
    moe_layer_config c = small_cfg(20, 8, 6, 4, 1, 1.0, 2);
    c.router.normalize_topk = false; // Switch: y = p_e * expert(x)
    c.H_shared = 5;
    fx_init(&f, &c, 2, 1.0f);
    check_forward_vs_reference(&f, NULL);
    ck_assert_int_gt(n_dropped(&f), 0);
    fx_free(&f);
}
END_TEST

START_TEST(test_forward_passes_dynamic_capacity_to_router) {
    fixture f;
    moe_layer_config c = small_cfg(16, 8, 6, 4, 2, 1.25, 1);
    fx_init(&f, &c, 3, 1.0f);
    int cap[4] = {2, 5, 1, 3};
    check_forward_vs_reference(&f, cap);
    for (int e = 0; e < 4; e++) {
        ck_assert_int_le(f.a.plan.kept[e], cap[e]);
        ck_assert_int_eq(f.a.plan.kept[e],
                         f.a.plan.counts[e] < cap[e] ? f.a.plan.counts[e] : cap[e]);
    }
    fx_free(&f);
}
END_TEST

// Every token prefers expert 0, then expert 1 (a constant input feature and a
// gate that reads it): with C = 2 only tokens 0 and 1 are routed at all.
START_TEST(test_dropped_assignments_contribute_exactly_zero) {
    fixture f;
    moe_layer_config c = small_cfg(12, 8, 6, 4, 2, 0.25, 1); // C = max(1, ceil(6*0.25)) = 2
    c.H_shared = 0;
    fx_init(&f, &c, 4, 0.1f);
    for (int t = 0; t < f.T; t++)
        f.x[t * c.D] = 1.0f;
    f.p.gate[0 * c.D] = 8.0f, f.p.gate[1 * c.D] = 6.0f;
    check_forward_vs_reference(&f, NULL);
    for (int t = 0; t < f.T; t++)
        for (int j = 0; j < 2; j++)
            ck_assert_int_eq(f.a.plan.expert[t * 2 + j], t < 2 ? j : -1);
    for (int t = 2; t < f.T; t++)
        for (int d = 0; d < c.D; d++)
            ck_assert_msg(f.y[t * c.D + d] == 0.0f, "y[%d][%d] = %g", t, d, f.y[t * c.D + d]);
    // Without aux/z terms a fully dropped token gets no gradient at all.
    memset(f.dx, 0, sizeof(float) * f.T * c.D);
    ck_assert_int_eq(moe_layer_backward(f.dx, &f.g, f.r, f.x, NULL, f.T, &f.p, &f.a, 0.0f, 0.0f),
                     0);
    for (int t = 2; t < f.T; t++)
        for (int d = 0; d < c.D; d++)
            ck_assert(f.dx[t * c.D + d] == 0.0f);
    for (int e = 2; e < 4; e++) // experts nobody reached: zero weight gradient
        for (size_t i = 0; i < f.g.expert_numel; i++)
            ck_assert(moe_layer_w13(&f.g, e)[i] == 0.0f);

    // One choice kept, one dropped: the kept expert gets weight 1 (renormalised
    // after dropping). Per-expert capacity {3, 1}: tokens 0-2 keep expert 0,
    // only token 0 keeps expert 1.
    int cap[4] = {3, 1, 4, 4};
    check_forward_vs_reference(&f, cap);
    ck_assert_int_eq(f.a.plan.expert[1 * 2 + 1], -1);
    ck_assert_float_eq(f.a.plan.weight[1 * 2 + 0], 1.0f);
    fx_free(&f);
}
END_TEST

START_TEST(test_gradients_with_drops_and_shared_expert) {
    fixture f;
    moe_layer_config c = small_cfg(12, 6, 5, 4, 2, 0.75, 1);
    c.H_shared = 4;
    fx_init(&f, &c, 5, 1.0f);
    fx_forward(&f, NULL);
    ck_assert_int_gt(n_dropped(&f), 0);
    check_all_gradients(&f);
    fx_free(&f);
}
END_TEST

START_TEST(test_gradients_top1_raw_weights_aux_all_k) {
    fixture f;
    moe_layer_config c = small_cfg(10, 6, 5, 3, 1, 1.0, 1);
    c.router.normalize_topk = false;
    c.router.aux_counts_all_k = true;
    fx_init(&f, &c, 6, 1.0f);
    check_all_gradients(&f);
    fx_free(&f);
}
END_TEST

// router.score = sigmoid (DeepSeek-V3 weights) with route_scale 2.5, drops and
// a shared expert; then raw sigmoid weights, top-1.
START_TEST(test_gradients_sigmoid_scores_route_scale) {
    fixture f;
    moe_layer_config c = small_cfg(12, 6, 5, 4, 2, 0.75, 1);
    c.H_shared = 4;
    c.router.score = MOE_SCORE_SIGMOID;
    c.router.route_scale = 2.5;
    fx_init(&f, &c, 9, 1.0f);
    fx_forward(&f, NULL);
    ck_assert_int_gt(n_dropped(&f), 0);
    check_all_gradients(&f);
    fx_free(&f);
    c = small_cfg(10, 6, 5, 3, 1, 1.0, 1);
    c.router.score = MOE_SCORE_SIGMOID;
    c.router.normalize_topk = false;
    c.router.route_scale = 1.5;
    fx_init(&f, &c, 10, 1.0f);
    check_all_gradients(&f);
    fx_free(&f);
}
END_TEST

START_TEST(test_gradients_task_routing) {
    fixture f;
    moe_layer_config c = small_cfg(12, 6, 5, 4, 2, 1.0, 1);
    c.n_tasks = 3;
    fx_init(&f, &c, 7, 1.0f);
    fx_forward(&f, NULL);
    // Every token of a task has the same choices (before capacity).
    for (int t = 0; t < f.T; t++)
        for (int u = 0; u < f.T; u++)
            if (f.task[t] == f.task[u])
                for (int j = 0; j < 2; j++)
                    ck_assert_int_eq(f.a.plan.choice[t * 2 + j], f.a.plan.choice[u * 2 + j]);
    check_forward_vs_reference(&f, NULL);
    check_all_gradients(&f); // includes task_embedding; x gets no gate term
    fx_free(&f);
}
END_TEST

START_TEST(test_gradients_with_router_jitter) {
    fixture f;
    moe_layer_config c = small_cfg(10, 6, 5, 4, 2, 1.0, 1);
    c.router.noise = MOE_NOISE_JITTER;
    c.router.noise_eps = 0.2;
    fx_init(&f, &c, 8, 1.0f);
    f.training = true, f.step = 3;
    fx_forward(&f, NULL);
    float *logits = malloc(sizeof(float) * f.T * c.E);
    memcpy(logits, f.a.logits, sizeof(float) * f.T * c.E);
    f.training = false;
    fx_forward(&f, NULL);
    int differ = 0;
    for (int i = 0; i < f.T * c.E; i++)
        differ |= logits[i] != f.a.logits[i];
    ck_assert_msg(differ, "jitter did not change the gate logits");
    f.training = true;
    check_all_gradients(&f);
    free(logits);
    fx_free(&f);
}
END_TEST

START_TEST(test_edge_expert_with_zero_tokens) {
    fixture f;
    moe_layer_config c = small_cfg(12, 6, 5, 4, 2, 1.0, 1);
    fx_init(&f, &c, 9, 1.0f);
    for (int t = 0; t < f.T; t++)
        f.x[t * c.D] = 1.0f;
    f.p.gate[3 * c.D] = -20.0f; // expert 3 is never in anyone's top 2
    check_forward_vs_reference(&f, NULL);
    ck_assert_int_eq(f.a.plan.counts[3], 0);
    check_all_gradients(&f);
    for (size_t i = 0; i < f.g.expert_numel; i++)
        ck_assert(moe_layer_w13(&f.g, 3)[i] == 0.0f);
    fx_free(&f);
}
END_TEST

START_TEST(test_edge_top_k_equals_num_experts) {
    fixture f;
    moe_layer_config c = small_cfg(8, 6, 5, 3, 3, 1.0, 1); // C = 8: nothing dropped
    fx_init(&f, &c, 10, 1.0f);
    check_forward_vs_reference(&f, NULL);
    ck_assert_int_eq(n_dropped(&f), 0);
    check_all_gradients(&f);
    fx_free(&f);
}
END_TEST

START_TEST(test_edge_tokens_fewer_than_min_capacity) {
    fixture f;
    moe_layer_config c = small_cfg(3, 6, 5, 4, 2, 1.0, 4); // C = 4 > T
    fx_init(&f, &c, 11, 1.0f);
    check_forward_vs_reference(&f, NULL);
    ck_assert_int_eq(n_dropped(&f), 0);
    check_all_gradients(&f);
    fx_free(&f);
}
END_TEST

START_TEST(test_edge_dropless) {
    fixture f;
    moe_layer_config c = small_cfg(16, 6, 5, 4, 2, 0.0, 1);
    fx_init(&f, &c, 12, 2.0f); // sharp gate: unbalanced load, all kept
    check_forward_vs_reference(&f, NULL);
    ck_assert_int_eq(n_dropped(&f), 0);
    check_all_gradients(&f);
    fx_free(&f);
}
END_TEST

// Forward twice gives identical bits, also after a call with other inputs and
// fewer tokens (stale rows in the activations must not leak into y), and
// backward twice adds exactly twice.
START_TEST(test_repeated_calls_are_identical) {
    fixture f;
    moe_layer_config c = small_cfg(32, 16, 12, 8, 2, 1.0, 2);
    c.H_shared = 8;
    fx_init(&f, &c, 13, 1.0f);
    size_t n = (size_t)f.T * c.D;
    float *y0 = malloc(sizeof(float) * n), *dx0 = malloc(sizeof(float) * n);
    float *g0 = malloc(sizeof(float) * f.np);
    fx_forward(&f, NULL);
    memcpy(y0, f.y, sizeof(float) * n);
    ck_assert_int_eq(moe_layer_backward(f.dx, &f.g, f.r, f.x, NULL, f.T, &f.p, &f.a, 0.1f, 0.1f),
                     0);
    memcpy(dx0, f.dx, sizeof(float) * n);
    memcpy(g0, f.gflat, sizeof(float) * f.np);

    float *x2 = malloc(sizeof(float) * n);
    tu_rng r;
    tu_seed(&r, 99);
    tu_fill_normal(&r, x2, n, 3.0f);
    ck_assert_int_eq(moe_layer_forward(f.y, x2, NULL, NULL, f.T, &f.p, &f.a, false, 0), 0);
    ck_assert_int_eq(moe_layer_forward(f.y, x2, NULL, NULL, 5, &f.p, &f.a, false, 0), 0);
    fx_forward(&f, NULL);
    ck_assert_mem_eq(f.y, y0, sizeof(float) * n);
    ck_assert_int_eq(moe_layer_backward(f.dx, &f.g, f.r, f.x, NULL, f.T, &f.p, &f.a, 0.1f, 0.1f),
                     0);
    for (size_t i = 0; i < n; i++)
        ck_assert_float_eq_tol(f.dx[i], 2 * dx0[i], 1e-5f);
    for (size_t i = 0; i < f.np; i++)
        ck_assert_float_eq_tol(f.gflat[i], 2 * g0[i], 1e-5f);
    free(y0), free(dx0), free(g0), free(x2);
    fx_free(&f);
}
END_TEST

START_TEST(test_param_table_matches_view_layout) {
    moe_layer_config c = small_cfg(4, 6, 5, 3, 2, 1.0, 1);
    c.H_shared = 7, c.n_tasks = 2;
    moe_param_table t;
    moe_param_table_init(&t);
    ck_assert_int_eq(moe_param_table_add(&t, NULL, "embed", 1, (int64_t[]){10}), 0);
    size_t base = t.numel;
    ck_assert_int_eq(moe_layer_param_table(&t, "model.layers.0.block_sparse_moe.", &c), 0);
    ck_assert_uint_eq(t.numel - base, moe_layer_num_params(&c));
    float flat[2000];
    moe_layer_params p;
    moe_layer_params_view(&p, flat + base, &c);
    const char *pre = "model.layers.0.block_sparse_moe.";
    char name[160];
#define AT(nm, ptr, d0, d1)                                                                        \
    do {                                                                                           \
        snprintf(name, sizeof name, "%s%s", pre, nm);                                              \
        const moe_param_view *v = moe_param_table_find(&t, name);                                  \
        ck_assert_msg(v != NULL, "no view %s", name);                                              \
        ck_assert_ptr_eq(flat + v->offset, (ptr));                                                 \
        ck_assert_int_eq(v->ndim, 2);                                                              \
        ck_assert_int_eq(v->shape[0], d0);                                                         \
        ck_assert_int_eq(v->shape[1], d1);                                                         \
    } while (0)
    AT("gate.weight", p.gate, 3, 6);
    AT("task_embedding.weight", p.task_emb, 2, 6);
    AT("shared_expert.w1.weight", p.shared_w13, 7, 6);
    AT("shared_expert.w3.weight", p.shared_w13 + 7 * 6, 7, 6);
    AT("shared_expert.w2.weight", p.shared_w2, 6, 7);
    for (int e = 0; e < 3; e++) {
        char nm[64];
        snprintf(nm, sizeof nm, "experts.%d.w1.weight", e);
        AT(nm, moe_layer_w13(&p, e), 5, 6);
        snprintf(nm, sizeof nm, "experts.%d.w3.weight", e);
        AT(nm, moe_layer_w13(&p, e) + 5 * 6, 5, 6);
        snprintf(nm, sizeof nm, "experts.%d.w2.weight", e);
        AT(nm, moe_layer_w2(&p, e), 6, 5);
    }
#undef AT
    // Views tile the buffer: each starts where the previous ended.
    for (int i = 1; i < t.count; i++)
        ck_assert_uint_eq(t.views[i].offset, t.views[i - 1].offset + t.views[i - 1].numel);
    ck_assert_int_eq(moe_param_table_add(&t, pre, "gate.weight", 1, (int64_t[]){1}), MOE_EINVAL);
    moe_param_table_free(&t);
}
END_TEST

START_TEST(test_bad_inputs_are_rejected) {
    fixture f;
    moe_layer_config c = small_cfg(8, 6, 5, 4, 2, 1.0, 1);
    c.n_tasks = 2;
    fx_init(&f, &c, 14, 1.0f);
    ck_assert_int_eq(moe_layer_backward(f.dx, &f.g, f.r, f.x, f.task, f.T, &f.p, &f.a, 0, 0),
                     MOE_EINVAL); // no forward yet
    ck_assert_int_eq(moe_layer_forward(f.y, f.x, f.task, NULL, 9, &f.p, &f.a, false, 0),
                     MOE_EINVAL);
    ck_assert_int_eq(moe_layer_forward(f.y, f.x, NULL, NULL, 8, &f.p, &f.a, false, 0), MOE_EINVAL);
    f.task[5] = 2;
    ck_assert_int_eq(moe_layer_forward(f.y, f.x, f.task, NULL, 8, &f.p, &f.a, false, 0),
                     MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "task_id[5]"));
    f.task[5] = 1;
    ck_assert_int_eq(moe_layer_forward(f.x, f.x, f.task, NULL, 8, &f.p, &f.a, false, 0),
                     MOE_EINVAL); // y aliasing x
    fx_forward(&f, NULL);
    ck_assert_int_eq(moe_layer_backward(f.dx, &f.g, f.r, f.x, f.task, 7, &f.p, &f.a, 0, 0),
                     MOE_EINVAL);
    moe_layer_config bad = c;
    bad.router.top_k = 5;
    moe_layer_acts a2;
    ck_assert_int_eq(moe_layer_acts_alloc(&a2, &bad, &moe_ops_cpu), MOE_EINVAL);
    bad = c, bad.H = 0;
    ck_assert_int_eq(moe_layer_acts_alloc(&a2, &bad, &moe_ops_cpu), MOE_EINVAL);
    fx_free(&f);
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("moe_layer");
    TCase *tc = tcase_create("cpu");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_forward_matches_reference_with_drops);
    tcase_add_test(tc, test_forward_matches_reference_switch_top1_raw_weights_and_shared_expert);
    tcase_add_test(tc, test_forward_passes_dynamic_capacity_to_router);
    tcase_add_test(tc, test_dropped_assignments_contribute_exactly_zero);
    tcase_add_test(tc, test_gradients_with_drops_and_shared_expert);
    tcase_add_test(tc, test_gradients_top1_raw_weights_aux_all_k);
    tcase_add_test(tc, test_gradients_sigmoid_scores_route_scale);
    tcase_add_test(tc, test_gradients_task_routing);
    tcase_add_test(tc, test_gradients_with_router_jitter);
    tcase_add_test(tc, test_edge_expert_with_zero_tokens);
    tcase_add_test(tc, test_edge_top_k_equals_num_experts);
    tcase_add_test(tc, test_edge_tokens_fewer_than_min_capacity);
    tcase_add_test(tc, test_edge_dropless);
    tcase_add_test(tc, test_repeated_calls_are_identical);
    tcase_add_test(tc, test_param_table_matches_view_layout);
    tcase_add_test(tc, test_bad_inputs_are_rejected);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
