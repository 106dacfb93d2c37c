// Cut cross-entropy on the GPU (kernels/cuda/cce.cu) against the CPU: the
// loss, lse and both gradients equal the CPU's cut cross-entropy and the plain
// loss (logits materialised) within 1e-5 relative, with and without gradient
// filtering (the same tiles dropped), at sizes that are not multiples of the
// tiles, with ignored targets and several backward chunks; two runs give the
// same bits; training with loss.impl = cce follows the CPU. Every device
// buffer sits between guard regions. Without CUDA or a device it prints why
// and exits 77 (ctest: skipped).
#include "kernels/cpu/nn.h"
#include "moe/error.h"
#include "moe/train.h"
#include "testutil.h"

#include <cblas.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cce_cuda.h"
#include "kernels/cuda/cuda.h"
#include "kernels/ops.h"

// ---- guarded device buffers ------------------------------------------------------------

#define GUARD 256
static const float SENTINEL = -7.25e30f;

// n device floats (init, or fill everywhere) between sentinel guards.
static float *dev_make(const float *init, size_t n, float fill) {
    float *all = malloc(sizeof(float) * (n + 2 * GUARD));
    for (size_t i = 0; i < n + 2 * GUARD; i++)
        all[i] = i < GUARD || i >= n + GUARD ? SENTINEL : init ? init[i - GUARD] : fill;
    float *d = moe_ops_cuda.alloc(sizeof(float) * (n + 2 * GUARD));
    ck_assert_msg(d, "device alloc: %s", moe_last_error());
    ck_assert_msg(moe_cuda_upload(d, all, sizeof(float) * (n + 2 * GUARD)) == 0, "upload: %s",
                  moe_last_error());
    free(all);
    return d + GUARD;
}

// Copies the n floats back into host (when not NULL), checks the guards, frees.
static void dev_take(float *host, float *d, size_t n, const char *what) {
    float *all = malloc(sizeof(float) * (n + 2 * GUARD));
    ck_assert_msg(moe_cuda_download(all, d - GUARD, sizeof(float) * (n + 2 * GUARD)) == 0,
                  "download %s: %s", what, moe_last_error());
    for (size_t i = 0; i < GUARD; i++)
        ck_assert_msg(all[i] == SENTINEL && all[n + GUARD + i] == SENTINEL,
                      "%s: a write outside its %zu floats", what, n);
    if (host) memcpy(host, all + GUARD, sizeof(float) * n);
    free(all);
    moe_ops_cuda.free(d - GUARD);
}

// ---- one problem, three implementations ---------------------------------------------

typedef struct {
    int N, D, V;
    float *h, *W;
    int32_t *target;
} problem;

typedef struct {
    double mean;
    long skipped;
    float *losses, *lse, *dh, *dW;
} result;

// As tests/test_cce.c: h ~ 0.3 N(0, 1), W ~ N(0, 1), every 7th target
// ignored; rare: tokens >= 700 improbable everywhere (filtering drops them).
static problem make_problem(int N, int D, int V, int rare) {
    problem p = {N,
                 D,
                 V,
                 malloc(sizeof(float) * N * D),
                 malloc(sizeof(float) * V * D),
                 malloc(sizeof(int32_t) * N)};
    tu_rng r;
    tu_seed(&r, 17);
    tu_fill_normal(&r, p.h, (size_t)N * D, 0.3f);
    tu_fill_normal(&r, p.W, (size_t)V * D, 1.0f);
    for (int n = 0; n < N; n++)
        p.target[n] = n % 7 == 3 ? -1 : (int32_t)(tu_uniform(&r) * V);
    if (rare) {
        for (int n = 0; n < N; n++) {
            p.h[(size_t)n * D] = 5.0f;
            if (p.target[n] >= 700) p.target[n] %= 700;
        }
        for (int v = 700; v < V; v++)
            p.W[(size_t)v * D] = -10.0f;
    }
    return p;
}

static void free_problem(problem *p) {
    free(p->h), free(p->W), free(p->target);
}

static result new_result(const problem *p) {
    result r = {0,
                0,
                calloc(p->N, sizeof(float)),
                calloc(p->N, sizeof(float)),
                calloc((size_t)p->N * p->D, sizeof(float)),
                calloc((size_t)p->V * p->D, sizeof(float))};
    return r;
}

static void free_result(result *r) {
    free(r->losses), free(r->lse), free(r->dh), free(r->dW);
}

// Plain: logits [N, V] materialised (lse is not formed).
static result run_plain(const problem *p) {
    const int N = p->N, D = p->D, V = p->V;
    result r = new_result(p);
    float *logits = malloc(sizeof(float) * N * V), *dlog = calloc((size_t)N * V, sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, V, D, 1, p->h, D, p->W, D, 0, logits,
                V);
    ck_assert_int_eq(moe_cpu_crossentropy_forward(r.losses, &r.mean, logits, p->target, N, V), 0);
    ck_assert_int_eq(moe_cpu_crossentropy_backward(dlog, logits, p->target, N, V, 1.0f), 0);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, D, V, 1, dlog, V, p->W, D, 0, r.dh,
                D);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, D, N, 1, dlog, V, p->h, D, 0, r.dW, D);
    free(logits), free(dlog);
    return r;
}

static result run_cpu(const problem *p, float filter) {
    result r = new_result(p);
    float *scratch = malloc(sizeof(float) * moe_cpu_cce_scratch_floats());
    ck_assert_int_eq(moe_cpu_cce_forward(r.losses, r.lse, &r.mean, p->h, p->W, p->target, p->N,
                                         p->D, p->V, scratch),
                     0);
    ck_assert_int_eq(moe_cpu_cce_backward(r.dh, r.dW, p->h, p->W, p->target, r.lse, p->N, p->D,
                                          p->V, 1.0f, filter, scratch, &r.skipped),
                     0);
    free(scratch);
    return r;
}

// dh0, dW0: the gradients' contents before backward (NULL: zeros).
static result run_gpu(const problem *p, float filter, const float *dh0, const float *dW0) {
    const size_t N = p->N, D = p->D, V = p->V, ns = moe_cuda_cce_scratch_floats(p->N, p->V);
    result r = new_result(p);
    float *h = dev_make(p->h, N * D, 0), *W = dev_make(p->W, V * D, 0);
    int32_t *tg = moe_ops_cuda.alloc(sizeof(int32_t) * N);
    ck_assert_msg(tg && moe_cuda_upload(tg, p->target, sizeof(int32_t) * N) == 0, "targets: %s",
                  moe_last_error());
    float *losses = dev_make(NULL, N, NAN), *lse = dev_make(NULL, N, NAN);
    float *dh = dev_make(dh0, N * D, 0), *dW = dev_make(dW0, V * D, 0);
    float *scratch = dev_make(NULL, ns, NAN); // NaN: nothing may read scratch it did not write
    ck_assert_msg(moe_cuda_cce_forward(losses, lse, &r.mean, h, W, tg, p->N, p->D, p->V, scratch) ==
                      0,
                  "forward: %s", moe_last_error());
    ck_assert_msg(moe_cuda_cce_backward(dh, dW, h, W, tg, lse, p->N, p->D, p->V, 1.0f, filter,
                                        scratch, &r.skipped) == 0,
                  "backward: %s", moe_last_error());
    dev_take(r.losses, losses, N, "losses");
    dev_take(r.lse, lse, N, "lse");
    dev_take(r.dh, dh, N * D, "dh");
    dev_take(r.dW, dW, V * D, "dW");
    dev_take(NULL, scratch, ns, "scratch");
    dev_take(NULL, h, N * D, "h");
    dev_take(NULL, W, V * D, "W");
    moe_ops_cuda.free(tg);
    return r;
}

// max |a - b| / max |b|, the measure of tests/test_cce.c.
static double max_rel(const float *a, const float *b, size_t n) {
    double worst = 0, scale = 0;
    for (size_t i = 0; i < n; i++) {
        scale = fmax(scale, fabs(b[i]));
        worst = fmax(worst, fabs((double)a[i] - b[i]));
        if (isnan(a[i]) != isnan(b[i])) return INFINITY;
    }
    return scale > 0 ? worst / scale : worst;
}

static void assert_close(const result *gpu, const result *ref, const problem *p, bool has_lse,
                         const char *what) {
    ck_assert_msg(fabs(gpu->mean - ref->mean) <= 1e-5 * fabs(ref->mean), "%s: loss %.9g vs %.9g",
                  what, gpu->mean, ref->mean);
    double el = max_rel(gpu->losses, ref->losses, p->N);
    double es = has_lse ? max_rel(gpu->lse, ref->lse, p->N) : 0;
    double eh = max_rel(gpu->dh, ref->dh, (size_t)p->N * p->D);
    double ew = max_rel(gpu->dW, ref->dW, (size_t)p->V * p->D);
    ck_assert_msg(el <= 1e-5 && es <= 1e-5 && eh <= 1e-5 && ew <= 1e-5,
                  "%s: relative losses %.3g lse %.3g dh %.3g dW %.3g", what, el, es, eh, ew);
}

// N = 300 and V = 32007 are no multiples of any tile; a small slab makes the
// backward take 32 chunks, the last of 263 columns.
static void compare(int N, int D, int V, size_t slab, int rare, float filter) {
    moe_cuda_cce_set_slab_floats(slab);
    problem p = make_problem(N, D, V, rare);
    result plain = run_plain(&p), cpu = run_cpu(&p, filter), gpu = run_gpu(&p, filter, 0, 0);
    assert_close(&gpu, &cpu, &p, true, "gpu vs cpu cce");
    assert_close(&gpu, &plain, &p, false, "gpu cce vs plain");
    ck_assert_int_eq(gpu.skipped, cpu.skipped);
    if (rare) ck_assert_msg(gpu.skipped > 0, "filtering dropped no tile");
    free_result(&plain), free_result(&cpu), free_result(&gpu);
    free_problem(&p);
    moe_cuda_cce_set_slab_floats(0);
}

START_TEST(test_cce_gpu_matches_cpu_and_plain_without_filtering) {
    compare(300, 40, 32007, 300 * 1024, 0, 0.0f);
}
END_TEST

START_TEST(test_cce_gpu_matches_cpu_and_plain_with_filtering) {
    compare(300, 40, 32007, 300 * 1024, 0, FLT_EPSILON);
}
END_TEST

START_TEST(test_cce_gpu_drops_the_tiles_the_cpu_drops) {
    compare(300, 40, 32007, 300 * 1024, 1, FLT_EPSILON);
}
END_TEST

START_TEST(test_cce_gpu_matches_cpu_in_one_chunk) {
    compare(1000, 24, 1300, 0, 0, FLT_EPSILON); // the default slab holds all of V
}
END_TEST

START_TEST(test_cce_gpu_runs_are_bit_identical) {
    moe_cuda_cce_set_slab_floats(300 * 1024);
    problem p = make_problem(300, 40, 32007, 1);
    for (int f = 0; f < 2; f++) {
        result a = run_gpu(&p, f ? FLT_EPSILON : 0.0f, 0, 0);
        result b = run_gpu(&p, f ? FLT_EPSILON : 0.0f, 0, 0);
        ck_assert(a.mean == b.mean);
        ck_assert(!memcmp(a.losses, b.losses, sizeof(float) * p.N));
        ck_assert(!memcmp(a.lse, b.lse, sizeof(float) * p.N));
        ck_assert(!memcmp(a.dh, b.dh, sizeof(float) * p.N * p.D));
        ck_assert(!memcmp(a.dW, b.dW, sizeof(float) * p.V * p.D));
        free_result(&a), free_result(&b);
    }
    free_problem(&p);
    moe_cuda_cce_set_slab_floats(0);
}
END_TEST

START_TEST(test_cce_gpu_backward_adds_into_gradients) {
    problem p = make_problem(200, 16, 3000, 0);
    float *dh0 = malloc(sizeof(float) * p.N * p.D), *dW0 = malloc(sizeof(float) * p.V * p.D);
    tu_rng r;
    tu_seed(&r, 5);
    tu_fill_normal(&r, dh0, (size_t)p.N * p.D, 1.0f);
    tu_fill_normal(&r, dW0, (size_t)p.V * p.D, 1.0f);
    result zero = run_gpu(&p, 0.0f, NULL, NULL), added = run_gpu(&p, 0.0f, dh0, dW0);
    for (size_t i = 0; i < (size_t)p.N * p.D; i++)
        ck_assert_msg(fabsf(added.dh[i] - dh0[i] - zero.dh[i]) <= 1e-6f, "dh[%zu]", i);
    for (size_t i = 0; i < (size_t)p.V * p.D; i++)
        ck_assert_msg(fabsf(added.dW[i] - dW0[i] - zero.dW[i]) <= 1e-6f, "dW[%zu]", i);
    free(dh0), free(dW0), free_result(&zero), free_result(&added);
    free_problem(&p);
}
END_TEST

START_TEST(test_cce_gpu_with_every_target_ignored_learns_nothing) {
    problem p = make_problem(130, 8, 600, 0);
    for (int n = 0; n < p.N; n++)
        p.target[n] = -1;
    result g = run_gpu(&p, FLT_EPSILON, NULL, NULL);
    ck_assert(g.mean == 0.0);
    for (int n = 0; n < p.N; n++)
        ck_assert(g.losses[n] == 0.0f);
    for (size_t i = 0; i < (size_t)p.N * p.D; i++)
        ck_assert(g.dh[i] == 0.0f);
    for (size_t i = 0; i < (size_t)p.V * p.D; i++)
        ck_assert(g.dW[i] == 0.0f);
    free_result(&g);
    free_problem(&p);
}
END_TEST

START_TEST(test_cce_gpu_refuses_a_target_outside_the_vocabulary) {
    const int N = 10, D = 8, V = 100;
    problem p = make_problem(N, D, V, 0);
    p.target[4] = V;
    float *h = dev_make(p.h, N * D, 0), *W = dev_make(p.W, V * D, 0);
    float *losses = dev_make(NULL, N, 0), *lse = dev_make(NULL, N, 0);
    float *dh = dev_make(NULL, N * D, 0), *dW = dev_make(NULL, V * D, 0);
    float *scratch = dev_make(NULL, moe_cuda_cce_scratch_floats(N, V), 0);
    int32_t *tg = moe_ops_cuda.alloc(sizeof(int32_t) * N);
    ck_assert(tg && moe_cuda_upload(tg, p.target, sizeof(int32_t) * N) == 0);
    double mean;
    ck_assert_int_eq(moe_cuda_cce_forward(losses, lse, &mean, h, W, tg, N, D, V, scratch),
                     MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "outside the vocabulary"), "%s", moe_last_error());
    ck_assert_int_eq(
        moe_cuda_cce_backward(dh, dW, h, W, tg, lse, N, D, V, 1.0f, 0.0f, scratch, NULL),
        MOE_EINVAL);
    moe_ops_cuda.free(tg);
    float *bufs[] = {h, W, losses, lse, dh, dW, scratch};
    size_t sizes[] = {N * D, V * D, N, N, N * D, V * D, moe_cuda_cce_scratch_floats(N, V)};
    for (int i = 0; i < 7; i++)
        dev_take(NULL, bufs[i], sizes[i], "buffer");
    free_problem(&p);
}
END_TEST

// The model on the GPU with loss.impl = cce (trainer/model.c): 20 steps follow
// the CPU's within 1e-3 relative, as tests/test_train_gpu.c for plain CE.
static void train(const char *device, bool filter, double *losses, const char *name) {
    moe_config c = tu_small_config();
    c.train.steps = 20;
    snprintf(c.train.device, sizeof c.train.device, "%s", device);
    snprintf(c.loss.impl, sizeof c.loss.impl, "cce");
    c.loss.cce_filter = filter;
    moe_train_opts o = {0};
    char out[600];
    snprintf(out, sizeof out, "%s/%s", tu_tmpdir(), name);
    o.out_dir = out;
    o.quiet = true;
    o.losses = losses;
    moe_train_result r;
    ck_assert_msg(moe_train(&c, &o, &r) == 0, "%s run: %s", device, moe_last_error());
    ck_assert_int_eq(r.steps, 20);
    moe_eval_result_free(&r.eval);
}

START_TEST(test_gpu_training_with_cce_follows_cpu) {
    for (int f = 0; f < 2; f++) {
        double cpu[20], gpu[20];
        train("cpu", f, cpu, f ? "cpu_filter" : "cpu");
        train("cuda", f, gpu, f ? "cuda_filter" : "cuda");
        for (int s = 0; s < 20; s++)
            ck_assert_msg(fabs(gpu[s] - cpu[s]) <= 1e-3 * fabs(cpu[s]),
                          "filter %d step %d: gpu %.7f, cpu %.7f", f, s, gpu[s], cpu[s]);
        ck_assert_msg(cpu[19] < cpu[0] - 0.5, "the loss must fall: %g -> %g", cpu[0], cpu[19]);
    }
}
END_TEST

static Suite *gpu_suite(void) {
    Suite *s = suite_create("cce_gpu");
    TCase *tc = tcase_create("cuda_vs_cpu");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_cce_gpu_matches_cpu_and_plain_without_filtering);
    tcase_add_test(tc, test_cce_gpu_matches_cpu_and_plain_with_filtering);
    tcase_add_test(tc, test_cce_gpu_drops_the_tiles_the_cpu_drops);
    tcase_add_test(tc, test_cce_gpu_matches_cpu_in_one_chunk);
    tcase_add_test(tc, test_cce_gpu_runs_are_bit_identical);
    tcase_add_test(tc, test_cce_gpu_backward_adds_into_gradients);
    tcase_add_test(tc, test_cce_gpu_with_every_target_ignored_learns_nothing);
    tcase_add_test(tc, test_cce_gpu_refuses_a_target_outside_the_vocabulary);
    tcase_add_test(tc, test_gpu_training_with_cce_follows_cpu);
    suite_add_tcase(s, tc);
    return s;
}

#else

static Suite *gpu_suite(void) {
    return suite_create("cce_gpu");
}

#endif

int main(void) {
    return tu_run_gpu(gpu_suite(), "the CUDA cut cross-entropy");
}
