// Backend equivalence in the style of ggml's test-backend-ops: every op of the
// CUDA table against the CPU reference table on the same random inputs, over
// several shapes (edges included: zero sizes, dropped assignments, an expert
// with no tokens, repeated rows). fp32 within 1e-5, bf16 GEMMs within 1e-2
// (error relative to max(1, |cpu|); for GEMM outputs relative to max(1, max
// |cpu|), see matmul_case). Every device output sits between guard
// regions that must survive. Without CUDA, or with no device, prints why and
// exits 77 (ctest: skipped). `--cpu-self-check` runs the op cases with the CPU
// table on both sides (host copies for transfers): it checks this harness
// itself (plans, guards, tolerances) in every build, and says nothing about
// CUDA.
#include "kernels/ops.h"
#include "moe/error.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/router_cuda.h"
#include "moe/moe_layer_cuda.h"
#include "moe/rng.h"
#include "moe/router.h"
#include "router/internal.h"
#endif

static const moe_ops *CPU = &moe_ops_cpu, *GPU;
static int self_check; // GPU is the CPU table; transfers are memcpy

// ---- paired buffers: a host copy the CPU op works on, a guarded device copy ----------

#define GUARD 64
static const float SENTINEL = -7.25e30f;

typedef struct {
    float *h, *d; // d points GUARD floats into the device allocation
    size_t n;
} fbuf;

typedef struct {
    int *h, *d;
    size_t n;
} ibuf;

static void upload(void *dst, const void *src, size_t bytes) {
    if (self_check) {
        if (bytes) memcpy(dst, src, bytes);
        return;
    }
#ifdef MOE_HAVE_CUDA
    ck_assert_msg(moe_cuda_upload(dst, src, bytes) == 0, "upload: %s", moe_last_error());
#endif
}

static void download(void *dst, const void *src, size_t bytes) {
    if (self_check) {
        if (bytes) memcpy(dst, src, bytes);
        return;
    }
#ifdef MOE_HAVE_CUDA
    ck_assert_msg(moe_cuda_download(dst, src, bytes) == 0, "download: %s", moe_last_error());
#endif
}

static void synchronize(const char *what) {
#ifdef MOE_HAVE_CUDA
    if (!self_check) ck_assert_msg(moe_cuda_synchronize() == 0, "%s: %s", what, moe_last_error());
#endif
}

// n floats: host copy from init (or fill), device copy between sentinel guards.
static fbuf fb_make(size_t n, const float *init, float fill) {
    fbuf b = {malloc(sizeof(float) * (n ? n : 1)), NULL, n};
    for (size_t i = 0; i < n; i++)
        b.h[i] = init ? init[i] : fill;
    float *all = malloc(sizeof(float) * (n + 2 * GUARD));
    for (size_t i = 0; i < n + 2 * GUARD; i++)
        all[i] = SENTINEL;
    memcpy(all + GUARD, b.h, sizeof(float) * n);
    float *dev = GPU->alloc(sizeof(float) * (n + 2 * GUARD));
    ck_assert_msg(dev != NULL, "device alloc: %s", moe_last_error());
    upload(dev, all, sizeof(float) * (n + 2 * GUARD));
    free(all);
    b.d = dev + GUARD;
    return b;
}

static fbuf fb_randn(tu_rng *r, size_t n, float scale) {
    float *tmp = malloc(sizeof(float) * (n ? n : 1));
    tu_fill_normal(r, tmp, n, scale);
    fbuf b = fb_make(n, tmp, 0.0f);
    free(tmp);
    return b;
}

static ibuf ib_make(size_t n, const int *init) {
    ibuf b = {malloc(sizeof(int) * (n ? n : 1)), NULL, n};
    memcpy(b.h, init, sizeof(int) * n);
    b.d = GPU->alloc(sizeof(int) * (n ? n : 1));
    ck_assert_msg(b.d != NULL, "device alloc: %s", moe_last_error());
    upload(b.d, b.h, sizeof(int) * n);
    return b;
}

static void fb_free(fbuf *b) {
    GPU->free(b->d - GUARD);
    free(b->h);
}

static void ib_free(ibuf *b) {
    GPU->free(b->d);
    free(b->h);
}

// Downloads the device copy and compares it with the host copy (the CPU
// result): max |gpu - cpu| / max(1, |cpu|) <= tol, guards untouched. With
// whole != 0 the denominator is max(1, max_i |cpu_i|) (GEMM outputs).
static void fb_check_norm(const char *what, const fbuf *b, double tol, int whole) {
    float *all = malloc(sizeof(float) * (b->n + 2 * GUARD));
    synchronize(what);
    download(all, b->d - GUARD, sizeof(float) * (b->n + 2 * GUARD));
    for (int i = 0; i < GUARD; i++) {
        ck_assert_msg(all[i] == SENTINEL, "%s: guard before the buffer overwritten", what);
        ck_assert_msg(all[GUARD + b->n + i] == SENTINEL, "%s: guard after the buffer overwritten",
                      what);
    }
    double worst = 0.0, scale = 1.0;
    size_t at = 0;
    for (size_t i = 0; whole && i < b->n; i++)
        scale = fmax(scale, fabs(b->h[i]));
    for (size_t i = 0; i < b->n; i++) {
        double g = all[GUARD + i], c = b->h[i];
        double e = fabs(g - c) / (whole ? scale : fmax(1.0, fabs(c)));
        if (isnan(e)) e = INFINITY; // NaN on either side fails, and stays the worst
        if (e > worst) worst = e, at = i;
    }
    ck_assert_msg(worst <= tol, "%s: error %.3g at %zu (gpu %.9g, cpu %.9g) > %.1g", what, worst,
                  at, all[GUARD + at], b->h[at], tol);
    free(all);
}

static void fb_check(const char *what, const fbuf *b, double tol) {
    fb_check_norm(what, b, tol, 0);
}

static void ib_check(const char *what, const ibuf *b) {
    int *got = malloc(sizeof(int) * (b->n ? b->n : 1));
    download(got, b->d, sizeof(int) * b->n);
    for (size_t i = 0; i < b->n; i++)
        ck_assert_msg(got[i] == b->h[i], "%s[%zu]: gpu %d, cpu %d", what, i, got[i], b->h[i]);
    free(got);
}

#define BOTH(call_cpu, call_gpu)                                                                   \
    do {                                                                                           \
        ck_assert_msg((call_cpu) == 0, "cpu: %s", moe_last_error());                               \
        ck_assert_msg((call_gpu) == 0, "cuda: %s", moe_last_error());                              \
    } while (0)

static const double TOL = 1e-5;
#ifdef MOE_HAVE_CUDA
static const double TOL_BF16 = 1e-2;
#endif

// ---- matmul -----------------------------------------------------------------------

static void matmul_case(const moe_ops *gpu, int M, int N, int K, int ta, int tb, float alpha,
                        float beta, double tol, uint64_t seed) {
    tu_rng r;
    tu_seed(&r, seed);
    fbuf a = fb_randn(&r, (size_t)M * K, 1.0f), b = fb_randn(&r, (size_t)K * N, 1.0f);
    // beta = 0 must ignore NaN in c; otherwise c holds data.
    fbuf c = beta == 0.0f ? fb_make((size_t)M * N, NULL, NAN) : fb_randn(&r, (size_t)M * N, 1.0f);
    BOTH(CPU->matmul(c.h, a.h, b.h, M, N, K, ta, tb, alpha, beta),
         gpu->matmul(c.d, a.d, b.d, M, N, K, ta, tb, alpha, beta));
    char what[128];
    snprintf(what, sizeof what, "%s matmul M=%d N=%d K=%d ta=%d tb=%d alpha=%g beta=%g", gpu->name,
             M, N, K, ta, tb, alpha, beta);
    // Two fp32 summation orders of K terms of unit size differ by ~ K * 2^-24
    // in absolute terms (2e-5 at K = 512, measured with FMA chains against 16
    // accumulators): an entry near 0 cannot meet 1e-5 of max(1, |c|). Errors
    // count against the output's scale, max(1, max |c|), which an indexing or
    // transpose error still misses by orders of magnitude.
    fb_check_norm(what, &c, tol, 1);
    fb_free(&a), fb_free(&b), fb_free(&c);
}

static const int MM_SHAPES[][3] = {{1, 1, 1}, {7, 13, 5}, {64, 96, 128}, {33, 257, 70}, {0, 5, 3},
                                   {5, 0, 3}, {5, 4, 0},  {128, 8, 512}, {1, 300, 64}};

START_TEST(test_matmul_fp32_matches_cpu) {
    for (size_t s = 0; s < sizeof MM_SHAPES / sizeof *MM_SHAPES; s++)
        for (int t = 0; t < 4; t++) {
            matmul_case(GPU, MM_SHAPES[s][0], MM_SHAPES[s][1], MM_SHAPES[s][2], t & 1, t >> 1, 1.0f,
                        0.0f, TOL, 100 + s);
            matmul_case(GPU, MM_SHAPES[s][0], MM_SHAPES[s][1], MM_SHAPES[s][2], t & 1, t >> 1, 0.5f,
                        1.5f, TOL, 200 + s);
        }
}
END_TEST

#ifdef MOE_HAVE_CUDA
START_TEST(test_matmul_bf16_matches_cpu) {
    // bf16 inputs carry 8 bits of mantissa: the error of an entry grows like
    // sqrt(K) * 2^-8.5, as does the typical |c|, so an entry near 0 has a large
    // error of its own; the bf16 check measures errors against max(1, max |c|).
    for (size_t s = 0; s < sizeof MM_SHAPES / sizeof *MM_SHAPES; s++)
        for (int t = 0; t < 4; t++)
            matmul_case(&moe_ops_cuda_bf16, MM_SHAPES[s][0], MM_SHAPES[s][1], MM_SHAPES[s][2],
                        t & 1, t >> 1, 1.0f, 0.0f, TOL_BF16, 300 + s);
}
END_TEST
#endif

// Grouped GEMMs over uneven segments (an empty one included): the expert
// GEMMs of the MoE layer forward and backward, and the weight gradients.
static void grouped_case(const moe_ops *gpu, int G, int N, int K, double tol, uint64_t seed) {
    tu_rng r;
    tu_seed(&r, seed);
    int offsets[17] = {0};
    for (int g = 0; g < G; g++)
        offsets[g + 1] = offsets[g] + (g == 1 ? 0 : (int)(tu_uniform(&r) * 40));
    const int rows = offsets[G];
    const size_t stride = (size_t)N * K + 3; // experts not packed back to back
    fbuf a = fb_randn(&r, (size_t)rows * K, 1.0f), b = fb_randn(&r, stride * G, 1.0f);
    fbuf c = fb_randn(&r, (size_t)rows * N, 1.0f);
    char what[160];
    for (int tb = 0; tb < 2; tb++) {
        BOTH(CPU->matmul_grouped(c.h, a.h, b.h, stride, offsets, G, N, K, tb, 1.0f,
                                 tb ? 0.5f : 0.0f),
             gpu->matmul_grouped(c.d, a.d, b.d, stride, offsets, G, N, K, tb, 1.0f,
                                 tb ? 0.5f : 0.0f));
        snprintf(what, sizeof what, "%s matmul_grouped G=%d N=%d K=%d tb=%d", gpu->name, G, N, K,
                 tb);
        fb_check_norm(what, &c, tol, 1); // GEMM outputs: see matmul_case
    }
    // weight gradients: w_g [K, N] += a_g^T c_g, both sides from the CPU's c (the
    // GEMMs above left the device copy within tol of it, not equal: bf16 errors
    // would compound into this check)
    upload(c.d, c.h, sizeof(float) * c.n);
    const size_t wstride = (size_t)K * N + 5;
    fbuf w = fb_randn(&r, wstride * G, 1.0f);
    BOTH(CPU->matmul_grouped_wgrad(w.h, wstride, a.h, c.h, offsets, G, K, N, 1.0f, 1.0f),
         gpu->matmul_grouped_wgrad(w.d, wstride, a.d, c.d, offsets, G, K, N, 1.0f, 1.0f));
    snprintf(what, sizeof what, "%s matmul_grouped_wgrad G=%d M=%d N=%d", gpu->name, G, K, N);
    fb_check_norm(what, &w, tol, 1);
    fb_free(&a), fb_free(&b), fb_free(&c), fb_free(&w);
}

START_TEST(test_matmul_grouped_matches_cpu) {
    const int shapes[][3] = {{1, 8, 8}, {4, 64, 32}, {8, 96, 200}, {16, 33, 17}, {0, 8, 8}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        grouped_case(GPU, shapes[s][0], shapes[s][1], shapes[s][2], TOL, 1500 + s);
#ifdef MOE_HAVE_CUDA
        if (!self_check)
            grouped_case(&moe_ops_cuda_bf16, shapes[s][0], shapes[s][1], shapes[s][2], TOL_BF16,
                         1600 + s);
#endif
    }
}
END_TEST

// ---- SwiGLU -----------------------------------------------------------------------

START_TEST(test_swiglu_matches_cpu) {
    const int shapes[][2] = {{1, 1}, {17, 33}, {64, 256}, {0, 8}, {3, 1000}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int n = shapes[s][0], H = shapes[s][1];
        tu_rng r;
        tu_seed(&r, 400 + s);
        fbuf ab = fb_randn(&r, (size_t)n * 2 * H, 3.0f), dh = fb_randn(&r, (size_t)n * H, 1.0f);
        fbuf h = fb_make((size_t)n * H, NULL, NAN), dab = fb_randn(&r, (size_t)n * 2 * H, 1.0f);
        BOTH(CPU->swiglu_forward(h.h, ab.h, n, H), GPU->swiglu_forward(h.d, ab.d, n, H));
        fb_check("swiglu_forward", &h, TOL);
        BOTH(CPU->swiglu_backward(dab.h, dh.h, ab.h, n, H),
             GPU->swiglu_backward(dab.d, dh.d, ab.d, n, H));
        fb_check("swiglu_backward", &dab, TOL);
        fb_free(&ab), fb_free(&dh), fb_free(&h), fb_free(&dab);
    }
}
END_TEST

// ---- permutation ops --------------------------------------------------------------

// A random plan: k distinct experts per token, ~20% dropped, slots numbered
// per expert in token order; expert E-1 never chosen (zero tokens).
typedef struct {
    int *expert, *slot, offsets[65], rows;
} test_plan;

static void make_plan(test_plan *p, tu_rng *r, int T, int k, int E) {
    int counts[64] = {0};
    p->expert = malloc(sizeof(int) * (T * k > 0 ? T * k : 1));
    p->slot = malloc(sizeof(int) * (T * k > 0 ? T * k : 1));
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int e;
            for (;;) {
                e = (int)(tu_uniform(r) * (E - 1));
                int dup = 0;
                for (int i = 0; i < j; i++)
                    dup |= p->expert[t * k + i] == e;
                if (!dup) break;
            }
            p->expert[t * k + j] = e;
        }
    for (int i = 0; i < T * k; i++) {
        if (tu_uniform(r) < 0.2f) {
            p->expert[i] = -1, p->slot[i] = -1;
            continue;
        }
        p->slot[i] = counts[p->expert[i]]++;
    }
    p->offsets[0] = 0;
    for (int e = 0; e < E; e++)
        p->offsets[e + 1] = p->offsets[e] + counts[e];
    p->rows = p->offsets[E];
}

START_TEST(test_permute_ops_match_cpu) {
    const int shapes[][4] = {{1, 1, 2, 1},   {37, 2, 8, 64}, {256, 4, 9, 200}, {0, 2, 4, 8},
                             {50, 1, 3, 33}, {64, 2, 8, 1},  {20, 2, 4, 0}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int T = shapes[s][0], k = shapes[s][1], E = shapes[s][2], D = shapes[s][3];
        tu_rng r;
        tu_seed(&r, 500 + s);
        test_plan p;
        make_plan(&p, &r, T, k, E);
        ibuf expert = ib_make((size_t)T * k, p.expert), slot = ib_make((size_t)T * k, p.slot);
        ibuf offsets = ib_make(E + 1, p.offsets);
        int *init = malloc(sizeof(int) * (T * k > 0 ? T * k : 1));
        for (int i = 0; i < T * k; i++)
            init[i] = 12345;
        ibuf row = ib_make((size_t)T * k, init);
        free(init);
        BOTH(CPU->dispatch_rows(row.h, expert.h, slot.h, offsets.h, T, k),
             GPU->dispatch_rows(row.d, expert.d, slot.d, offsets.d, T, k));
        ib_check("dispatch_rows", &row);

        // chunk_rows over the entries of tokens [T/3, T): the rows and offsets of
        // that mini-sequence chunk, exactly
        const int t0 = T / 3, n = (T - t0) * k;
        int *junk = malloc(sizeof(int) * (T * k + E + 1));
        for (int i = 0; i < T * k + E + 1; i++)
            junk[i] = 12345;
        ibuf crow = ib_make((size_t)n, junk), coff = ib_make(E + 1, junk);
        free(junk);
        BOTH(CPU->chunk_rows(crow.h, coff.h, expert.h + (size_t)t0 * k, n, E),
             GPU->chunk_rows(crow.d, coff.d, expert.d + (size_t)t0 * k, n, E));
        ib_check("chunk_rows offsets", &coff);
        ib_check("chunk_rows rows", &crow);
        ib_free(&crow), ib_free(&coff);

        fbuf x = fb_randn(&r, (size_t)T * D, 1.0f), xe = fb_make((size_t)p.rows * D, NULL, NAN);
        BOTH(CPU->permute_forward(xe.h, x.h, row.h, T, k, D),
             GPU->permute_forward(xe.d, x.d, row.d, T, k, D));
        fb_check("permute_forward", &xe, 0.0);

        fbuf dxe = fb_randn(&r, (size_t)p.rows * D, 1.0f), dx = fb_randn(&r, (size_t)T * D, 1.0f);
        BOTH(CPU->permute_backward(dx.h, dxe.h, row.h, T, k, D),
             GPU->permute_backward(dx.d, dxe.d, row.d, T, k, D));
        fb_check("permute_backward", &dx, TOL);

        fbuf w = fb_randn(&r, (size_t)T * k, 0.5f), y = fb_make((size_t)T * D, NULL, NAN);
        BOTH(CPU->unpermute_forward(y.h, xe.h, row.h, w.h, T, k, D),
             GPU->unpermute_forward(y.d, xe.d, row.d, w.d, T, k, D));
        fb_check("unpermute_forward", &y, TOL);

        fbuf dy = fb_randn(&r, (size_t)T * D, 1.0f), dye = fb_randn(&r, (size_t)p.rows * D, 1.0f);
        fbuf dw = fb_randn(&r, (size_t)T * k, 1.0f);
        BOTH(CPU->unpermute_backward(dye.h, dw.h, dy.h, xe.h, row.h, w.h, T, k, D),
             GPU->unpermute_backward(dye.d, dw.d, dy.d, xe.d, row.d, w.d, T, k, D));
        fb_check("unpermute_backward dye", &dye, TOL);
        fb_check("unpermute_backward dweight", &dw, TOL);

        ib_free(&expert), ib_free(&slot), ib_free(&offsets), ib_free(&row);
        fb_free(&x), fb_free(&xe), fb_free(&dxe), fb_free(&dx), fb_free(&w), fb_free(&y);
        fb_free(&dy), fb_free(&dye), fb_free(&dw);
        free(p.expert), free(p.slot);
    }
}
END_TEST

START_TEST(test_gather_scatter_rows_match_cpu) {
    const int shapes[][3] = {{1, 1, 1}, {40, 7, 8}, {300, 16, 64}, {0, 3, 4}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int n = shapes[s][0], rows = shapes[s][1], D = shapes[s][2];
        tu_rng r;
        tu_seed(&r, 600 + s);
        int *idx = malloc(sizeof(int) * (n ? n : 1));
        for (int i = 0; i < n; i++) // repeats and skipped (-1) rows
            idx[i] = tu_uniform(&r) < 0.1f ? -1 : (int)(tu_uniform(&r) * rows);
        ibuf ix = ib_make(n, idx);
        fbuf in = fb_randn(&r, (size_t)rows * D, 1.0f), out = fb_make((size_t)n * D, NULL, NAN);
        BOTH(CPU->gather_rows(out.h, in.h, ix.h, n, D), GPU->gather_rows(out.d, in.d, ix.d, n, D));
        fb_check("gather_rows", &out, 0.0);
        fbuf acc = fb_randn(&r, (size_t)rows * D, 1.0f);
        BOTH(CPU->scatter_add_rows(acc.h, out.h, ix.h, n, D),
             GPU->scatter_add_rows(acc.d, out.d, ix.d, n, D));
        fb_check("scatter_add_rows", &acc, 0.0); // sorted, in row order: the CPU's bits
        ib_free(&ix), fb_free(&in), fb_free(&out), fb_free(&acc);
        free(idx);
    }
}
END_TEST

START_TEST(test_elementwise_ops_match_cpu) {
    const size_t sizes[] = {0, 1, 1000, 100003};
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        size_t n = sizes[s];
        tu_rng r;
        tu_seed(&r, 700 + s);
        fbuf a = fb_randn(&r, n, 1.0f), b = fb_randn(&r, n, 1.0f), o = fb_randn(&r, n, 1.0f);
        BOTH(CPU->mul_add(o.h, a.h, b.h, n), GPU->mul_add(o.d, a.d, b.d, n));
        fb_check("mul_add", &o, TOL);
        BOTH(CPU->add(o.h, a.h, n), GPU->add(o.d, a.d, n));
        fb_check("add", &o, 0.0);
        BOTH(CPU->mul(a.h, a.h, b.h, n), GPU->mul(a.d, a.d, b.d, n)); // aliased output
        fb_check("mul (in place)", &a, 0.0);
        BOTH(CPU->scale(b.h, n, 0.37f), GPU->scale(b.d, n, 0.37f));
        fb_check("scale", &b, 0.0);
        BOTH(CPU->zero(o.h, n), GPU->zero(o.d, n));
        fb_check("zero", &o, 0.0);
        double s_cpu = -1.0, s_gpu = -1.0;
        BOTH(CPU->sumsq(&s_cpu, b.h, n), GPU->sumsq(&s_gpu, b.d, n));
        ck_assert_msg(fabs(s_cpu - s_gpu) <= 1e-12 * fmax(1.0, s_cpu), "sumsq %.17g vs %.17g",
                      s_gpu, s_cpu);
        // alloc reserves at least the request, and something for 0 bytes
        ck_assert_uint_ge(GPU->alloc_size(n * sizeof(float)), n ? n * sizeof(float) : 1);
        fb_free(&a), fb_free(&b), fb_free(&o);
    }
}
END_TEST

START_TEST(test_adamw_matches_cpu) {
    const size_t n = 5000;
    tu_rng r;
    tu_seed(&r, 800);
    fbuf p = fb_randn(&r, n, 1.0f), m = fb_make(n, NULL, 0.0f), v = fb_make(n, NULL, 0.0f);
    fbuf g = fb_randn(&r, n, 0.1f);
    uint8_t *decay = malloc(n);
    for (size_t i = 0; i < n; i++)
        decay[i] = i % 3 != 0;
    uint8_t *ddecay = GPU->alloc(n);
    upload(ddecay, decay, n);
    for (long step = 1; step <= 5; step++) {
        BOTH(CPU->adamw(p.h, m.h, v.h, g.h, decay, n, step, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f),
             GPU->adamw(p.d, m.d, v.d, g.d, ddecay, n, step, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f));
    }
    fb_check("adamw params", &p, TOL);
    fb_check("adamw m", &m, TOL);
    fb_check("adamw v", &v, TOL);
    GPU->free(ddecay);
    free(decay);
    fb_free(&p), fb_free(&m), fb_free(&v), fb_free(&g);
}
END_TEST

// ---- decoder ops ------------------------------------------------------------------

START_TEST(test_rmsnorm_matches_cpu) {
    const int shapes[][2] = {{1, 1}, {7, 64}, {128, 512}, {3, 1000}, {1000, 33}, {0, 16}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int N = shapes[s][0], C = shapes[s][1];
        tu_rng r;
        tu_seed(&r, 900 + s);
        fbuf x = fb_randn(&r, (size_t)N * C, 2.0f), w = fb_randn(&r, C, 1.0f);
        fbuf out = fb_make((size_t)N * C, NULL, NAN), rstd = fb_make(N, NULL, NAN);
        BOTH(CPU->rmsnorm_forward(out.h, rstd.h, x.h, w.h, N, C, 1e-5f),
             GPU->rmsnorm_forward(out.d, rstd.d, x.d, w.d, N, C, 1e-5f));
        fb_check("rmsnorm_forward out", &out, TOL);
        fb_check("rmsnorm_forward rstd", &rstd, TOL);
        fbuf dout = fb_randn(&r, (size_t)N * C, 1.0f), dx = fb_randn(&r, (size_t)N * C, 1.0f);
        fbuf dw = fb_randn(&r, C, 1.0f);
        BOTH(CPU->rmsnorm_backward(dx.h, dw.h, dout.h, x.h, w.h, rstd.h, N, C),
             GPU->rmsnorm_backward(dx.d, dw.d, dout.d, x.d, w.d, rstd.d, N, C));
        fb_check("rmsnorm_backward dx", &dx, TOL);
        // dw sums N rows: the CPU row by row, the GPU in blocks of rows, so
        // (as for a GEMM output) the error is measured against the vector's norm
        fb_check_norm("rmsnorm_backward dw", &dw, TOL, 1);
        fb_free(&x), fb_free(&w), fb_free(&out), fb_free(&rstd), fb_free(&dout), fb_free(&dx);
        fb_free(&dw);
    }
}
END_TEST

START_TEST(test_rope_matches_cpu) {
    const int shapes[][4] = {
        {1, 1, 1, 2}, {2, 17, 4, 16}, {1, 256, 8, 64}, {3, 5, 2, 128}, {0, 4, 2, 8}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int B = shapes[s][0], T = shapes[s][1], H = shapes[s][2], hd = shapes[s][3];
        size_t n = (size_t)B * T * H * hd;
        tu_rng r;
        tu_seed(&r, 1000 + s);
        fbuf x = fb_randn(&r, n, 1.0f), out = fb_make(n, NULL, NAN), dx = fb_randn(&r, n, 1.0f);
        BOTH(CPU->rope_forward(out.h, x.h, B, T, H, hd, 10000.0f),
             GPU->rope_forward(out.d, x.d, B, T, H, hd, 10000.0f));
        fb_check("rope_forward", &out, TOL);
        BOTH(CPU->rope_backward(dx.h, out.h, B, T, H, hd, 10000.0f),
             GPU->rope_backward(dx.d, out.d, B, T, H, hd, 10000.0f));
        fb_check("rope_backward", &dx, TOL);
        BOTH(CPU->rope_forward(x.h, x.h, B, T, H, hd, 500000.0f), // in place
             GPU->rope_forward(x.d, x.d, B, T, H, hd, 500000.0f));
        fb_check("rope_forward in place", &x, TOL);
        fb_free(&x), fb_free(&out), fb_free(&dx);
    }
    float *x = GPU->alloc(16);
    ck_assert_int_eq(GPU->rope_forward(x, x, 1, 1, 1, 3, 1e4f), MOE_EINVAL); // odd head_dim
    GPU->free(x);
}
END_TEST

START_TEST(test_attention_matches_cpu) {
    // B, T, Hq, Hkv, hd: MHA, GQA, MQA, T = 1
    const int shapes[][5] = {{1, 1, 1, 1, 2},   {2, 17, 4, 2, 8},   {1, 64, 8, 8, 16},
                             {2, 33, 6, 1, 32}, {1, 128, 4, 2, 64}, {0, 4, 2, 1, 8}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int B = shapes[s][0], T = shapes[s][1], Hq = shapes[s][2], Hkv = shapes[s][3];
        int hd = shapes[s][4];
        size_t nq = (size_t)B * T * Hq * hd, nk = (size_t)B * T * Hkv * hd;
        tu_rng r;
        tu_seed(&r, 1100 + s);
        fbuf q = fb_randn(&r, nq, 1.0f), k = fb_randn(&r, nk, 1.0f), v = fb_randn(&r, nk, 1.0f);
        fbuf out = fb_make(nq, NULL, NAN), att = fb_make((size_t)B * Hq * T * T, NULL, NAN);
        // one scratch of the larger backend's size, shared by forward and backward
        size_t ns = CPU->attention_scratch_floats(B, T, Hq, Hkv, hd);
        size_t ns_gpu = GPU->attention_scratch_floats(B, T, Hq, Hkv, hd);
        fbuf datt = fb_make(ns > ns_gpu ? ns : ns_gpu, NULL, NAN);
        BOTH(CPU->attention_forward(out.h, att.h, datt.h, q.h, k.h, v.h, B, T, Hq, Hkv, hd),
             GPU->attention_forward(out.d, att.d, datt.d, q.d, k.d, v.d, B, T, Hq, Hkv, hd));
        fb_check("attention_forward out", &out, TOL);
        // att is each backend's own saved state (CPU: log-sum-exp, CUDA: probabilities)
        fbuf dout = fb_randn(&r, nq, 1.0f), dq = fb_randn(&r, nq, 1.0f);
        fbuf dk = fb_randn(&r, nk, 1.0f), dv = fb_randn(&r, nk, 1.0f);
        BOTH(CPU->attention_backward(dq.h, dk.h, dv.h, datt.h, dout.h, out.h, att.h, q.h, k.h, v.h,
                                     B, T, Hq, Hkv, hd),
             GPU->attention_backward(dq.d, dk.d, dv.d, datt.d, dout.d, out.d, att.d, q.d, k.d, v.d,
                                     B, T, Hq, Hkv, hd));
        fb_check("attention_backward dq", &dq, TOL);
        fb_check("attention_backward dk", &dk, TOL);
        fb_check("attention_backward dv", &dv, TOL);
        fb_free(&q), fb_free(&k), fb_free(&v), fb_free(&out), fb_free(&att), fb_free(&dout);
        fb_free(&dq), fb_free(&dk), fb_free(&dv), fb_free(&datt);
    }
}
END_TEST

START_TEST(test_embedding_matches_cpu) {
    const int N = 300, C = 96, V = 50;
    tu_rng r;
    tu_seed(&r, 1200);
    int tok[N];
    for (int n = 0; n < N; n++)
        tok[n] = (int)(tu_uniform(&r) * V); // many repeats of each id
    ibuf t = ib_make(N, tok);
    fbuf table = fb_randn(&r, (size_t)V * C, 1.0f), out = fb_make((size_t)N * C, NULL, NAN);
    BOTH(CPU->embedding_forward(out.h, t.h, table.h, N, C, V),
         GPU->embedding_forward(out.d, t.d, table.d, N, C, V));
    fb_check("embedding_forward", &out, 0.0);
    fbuf dout = fb_randn(&r, (size_t)N * C, 1.0f), dtable = fb_randn(&r, (size_t)V * C, 1.0f);
    BOTH(CPU->embedding_backward(dtable.h, dout.h, t.h, N, C),
         GPU->embedding_backward(dtable.d, dout.d, t.d, N, C));
    fb_check("embedding_backward", &dtable, 0.0); // repeats add in position order, no atomics
    // no tokens: nothing read, nothing written
    BOTH(CPU->embedding_forward(out.h, t.h, table.h, 0, C, V),
         GPU->embedding_forward(out.d, t.d, table.d, 0, C, V));
    BOTH(CPU->embedding_backward(dtable.h, dout.h, t.h, 0, C),
         GPU->embedding_backward(dtable.d, dout.d, t.d, 0, C));
    fb_check("embedding N=0", &out, 0.0);
    fb_check("embedding_backward N=0", &dtable, 0.0);
    tok[7] = V; // out of the vocabulary: an error naming the position, not a wild read
    upload(t.d, tok, sizeof tok);
    ck_assert_int_eq(GPU->embedding_forward(out.d, t.d, table.d, N, C, V), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "position 7"), "%s", moe_last_error());
    ib_free(&t), fb_free(&table), fb_free(&out), fb_free(&dout), fb_free(&dtable);
}
END_TEST

START_TEST(test_crossentropy_matches_cpu) {
    // the last two: no rows, and every target ignored (mean 0, no gradient)
    const int shapes[][2] = {{1, 2}, {33, 100}, {64, 50257}, {5, 1}, {0, 10}, {4, 7}};
    const size_t n_shapes = sizeof shapes / sizeof *shapes;
    for (size_t s = 0; s < n_shapes; s++) {
        int N = shapes[s][0], V = shapes[s][1];
        tu_rng r;
        tu_seed(&r, 1300 + s);
        int *tgt = malloc(sizeof(int) * (N ? N : 1));
        for (int n = 0; n < N; n++)
            tgt[n] = n % 5 == 3 || s == n_shapes - 1 ? -1 : (int)(tu_uniform(&r) * V);
        ibuf t = ib_make(N, tgt);
        fbuf logits = fb_randn(&r, (size_t)N * V, 3.0f), losses = fb_make(N, NULL, NAN);
        double m_cpu = NAN, m_gpu = NAN;
        BOTH(CPU->crossentropy_forward(losses.h, &m_cpu, logits.h, t.h, N, V),
             GPU->crossentropy_forward(losses.d, &m_gpu, logits.d, t.d, N, V));
        fb_check("crossentropy_forward losses", &losses, TOL);
        ck_assert_msg(fabs(m_cpu - m_gpu) <= TOL * fmax(1.0, fabs(m_cpu)), "mean %.9g vs %.9g",
                      m_gpu, m_cpu);
        fbuf dl = fb_randn(&r, (size_t)N * V, 0.01f);
        BOTH(CPU->crossentropy_backward(dl.h, logits.h, t.h, N, V, 0.5f),
             GPU->crossentropy_backward(dl.d, logits.d, t.d, N, V, 0.5f));
        fb_check("crossentropy_backward", &dl, TOL);
        ib_free(&t), fb_free(&logits), fb_free(&losses), fb_free(&dl);
        free(tgt);
    }
}
END_TEST

#ifdef MOE_HAVE_CUDA
// ---- router kernels vs router/ ---------------------------------------------------

static void expect_ints(const char *what, const int *dev, const int *host, size_t n) {
    int *got = malloc(sizeof(int) * (n ? n : 1));
    download(got, dev, sizeof(int) * n);
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(got[i] == host[i], "%s[%zu]: gpu %d, cpu %d", what, i, got[i], host[i]);
    free(got);
}

static void expect_floats(const char *what, const float *dev, const float *host, size_t n,
                          double tol) {
    float *got = malloc(sizeof(float) * (n ? n : 1));
    download(got, dev, sizeof(float) * n);
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(fabs((double)got[i] - host[i]) <= tol * fmax(1.0, fabs(host[i])),
                      "%s[%zu]: gpu %.9g, cpu %.9g", what, i, got[i], host[i]);
    free(got);
}

typedef struct {
    int T, E, k;
    double cf; // capacity factor (<= 0: dropless)
    moe_slot_order order;
    int tasks;     // > 0: task ids in [0, tasks) with task priorities
    int ties;      // duplicate token rows (equal max probabilities)
    int given_cap; // pass a per-expert capacity vector
    int normalize;
    int gumbel; // router.noise = gumbel, training (choices 2..k sampled)
} router_case;

static void router_case_run(const router_case *rc, uint64_t seed) {
    const int T = rc->T, E = rc->E, k = rc->k;
    moe_router_config cfg;
    moe_router_config_default(&cfg);
    cfg.top_k = k;
    cfg.capacity_factor = rc->cf;
    cfg.slot_order = rc->order;
    cfg.normalize_topk = rc->normalize;
    cfg.aux_counts_all_k = seed % 2;
    cfg.noise = rc->gumbel ? MOE_NOISE_GUMBEL : MOE_NOISE_NONE;
    cfg.seed = seed * 7 + 1;
    const uint64_t step = seed % 13 + 1;
    if (rc->tasks) {
        cfg.n_task_priority = rc->tasks;
        for (int i = 0; i < rc->tasks; i++)
            cfg.task_priority[i] = (double)(i % 3); // repeated priorities
    }
    tu_rng r;
    tu_seed(&r, seed);
    float *logits = malloc(sizeof(float) * ((size_t)T * E + 1));
    tu_fill_normal(&r, logits, (size_t)T * E, 2.0f);
    if (rc->ties)
        for (int t = 1; t < T; t += 3)
            memcpy(logits + (size_t)t * E, logits + (size_t)(t - 1) * E, sizeof(float) * E);
    int *task = malloc(sizeof(int) * (T + 1)), *cap = malloc(sizeof(int) * E);
    for (int t = 0; t < T; t++)
        task[t] = rc->tasks ? (int)(tu_uniform(&r) * rc->tasks) : 0;
    for (int e = 0; e < E; e++)
        cap[e] = 1 + (int)(tu_uniform(&r) * (2.0 * T * k / E));

    // Plans sized for more tokens than the call routes (the sort's scratch,
    // chunk and tile counts are sized by T_max; the kernels must use T).
    const int T_max = T + 7;
    moe_plan cpu;
    ck_assert_int_eq(moe_plan_alloc(&cpu, T_max, E, k), 0);
    ck_assert_msg(moe_router_forward(&cpu, logits, rc->tasks ? task : NULL,
                                     rc->given_cap ? cap : NULL, T, E, &cfg, rc->gumbel, step) == 0,
                  "cpu router: %s", moe_last_error());
    moe_cuda_plan gpu;
    ck_assert_msg(moe_cuda_plan_alloc(&gpu, T_max, E, k) == 0, "%s", moe_last_error());
    float *dlogits = GPU->alloc(sizeof(float) * ((size_t)T * E + 1));
    int *dtask = GPU->alloc(sizeof(int) * (T + 1));
    upload(dlogits, logits, sizeof(float) * T * E);
    upload(dtask, task, sizeof(int) * T);
    ck_assert_msg(moe_cuda_router_forward(&gpu, dlogits, rc->tasks ? dtask : NULL,
                                          rc->given_cap ? cap : NULL, T, E, &cfg, rc->gumbel,
                                          step) == 0,
                  "cuda router: %s", moe_last_error());
    size_t tk = (size_t)T * k;
    expect_ints("choice", gpu.choice, cpu.choice, tk);
    expect_ints("counts", gpu.counts, cpu.counts, E);
    expect_ints("capacity", gpu.capacity, cpu.capacity, E);
    expect_ints("order", gpu.order, cpu.order, T);
    expect_ints("expert", gpu.expert, cpu.expert, tk);
    expect_ints("slot", gpu.slot, cpu.slot, tk);
    expect_ints("kept", gpu.kept, cpu.kept, E);
    expect_ints("offsets", gpu.offsets, cpu.offsets, E + 1);
    // the host mirrors of the one read-back (the layer and trainer read these)
    ck_assert_mem_eq(gpu.counts_h, cpu.counts, sizeof(int) * E);
    ck_assert_mem_eq(gpu.kept_h, cpu.kept, sizeof(int) * E);
    ck_assert_mem_eq(gpu.capacity_h, cpu.capacity, sizeof(int) * E);
    ck_assert_mem_eq(gpu.offsets_h, cpu.offsets, sizeof(int) * (E + 1));
    expect_floats("weight", gpu.weight, cpu.weight, tk, TOL);
    expect_floats("probs", gpu.probs, cpu.probs, (size_t)T * E, TOL);
    expect_floats("lse", gpu.lse, cpu.lse, T, TOL);
    expect_floats("aux_f", gpu.aux_f, cpu.aux_f, E, TOL);
    ck_assert_msg(fabs(gpu.aux_loss - cpu.aux_loss) <= TOL * fmax(1.0, fabs(cpu.aux_loss)),
                  "aux %g vs %g", gpu.aux_loss, cpu.aux_loss);
    ck_assert_msg(fabs(gpu.z_loss - cpu.z_loss) <= TOL * fmax(1.0, fabs(cpu.z_loss)), "z %g vs %g",
                  gpu.z_loss, cpu.z_loss);

    // backward: dweight and both loss terms into a non-zero dlogits
    fbuf dw = fb_randn(&r, tk, 1.0f), dl = fb_randn(&r, (size_t)T * E, 1.0f);
    moe_router_backward(dl.h, dw.h, &cpu, &cfg, 0.01f, 0.001f);
    ck_assert_msg(moe_cuda_router_backward(dl.d, dw.d, &gpu, &cfg, 0.01f, 0.001f) == 0, "%s",
                  moe_last_error());
    fb_check("router backward", &dl, TOL);

    fb_free(&dw), fb_free(&dl);
    GPU->free(dlogits), GPU->free(dtask);
    moe_cuda_plan_free(&gpu);
    moe_plan_free(&cpu);
    free(logits), free(task), free(cap);
}

START_TEST(test_router_matches_cpu) {
    const router_case cases[] = {
        {1, 2, 1, 1.0, MOE_SLOT_POSITION, 0, 0, 0, 1, 0},
        {37, 8, 2, 1.25, MOE_SLOT_POSITION, 0, 0, 0, 1, 0},
        {300, 8, 2, 0.5, MOE_SLOT_PRIORITY, 0, 1, 0, 1, 0},  // BPR with equal max probs
        {300, 9, 3, 0.0, MOE_SLOT_POSITION, 0, 0, 0, 0, 0},  // dropless, raw weights
        {257, 4, 4, 1.0, MOE_SLOT_PRIORITY, 0, 0, 0, 1, 0},  // top_k = E
        {500, 8, 2, 0.75, MOE_SLOT_PRIORITY, 5, 1, 0, 1, 0}, // task priorities
        {400, 16, 2, 1.0, MOE_SLOT_POSITION, 0, 0, 1, 1, 0}, // per-expert capacity given
        {3, 8, 2, 1.0, MOE_SLOT_POSITION, 0, 0, 0, 1, 0},    // T below min_capacity
        {0, 8, 2, 1.0, MOE_SLOT_PRIORITY, 0, 0, 0, 1, 0},    // no tokens
        {4096, 64, 8, 1.0, MOE_SLOT_PRIORITY, 0, 0, 0, 1, 0},
        {700, 320, 4, 1.0, MOE_SLOT_PRIORITY, 0, 0, 1, 1, 0}, // E >= 256: one token per loss row
        // task priorities in BPR order, with drops
        {1000, 16, 2, 0.5, MOE_SLOT_PRIORITY, 7, 0, 0, 1, 0},
        {64, 4, 1, 1.0, MOE_SLOT_PRIORITY, 3, 1, 0, 0, 0},
        {333, 8, 3, 1.0, MOE_SLOT_PRIORITY, 2, 0, 1, 1, 0},
        // Gumbel noise (training): choices 2..k sampled, weights from the clean scores
        {300, 8, 2, 1.0, MOE_SLOT_POSITION, 0, 0, 0, 1, 1},
        {512, 16, 4, 0.75, MOE_SLOT_PRIORITY, 5, 1, 0, 1, 1}, // with task priorities, drops
        {200, 8, 1, 1.0, MOE_SLOT_POSITION, 0, 0, 0, 1, 1},   // k = 1: nothing to sample
        {129, 6, 6, 0.0, MOE_SLOT_POSITION, 0, 1, 0, 0, 1},   // k = E, dropless, raw weights
        {2048, 64, 8, 1.0, MOE_SLOT_PRIORITY, 0, 0, 1, 1, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        router_case_run(&cases[i], 1400 + i);
}
END_TEST

START_TEST(test_router_rejects_nonfinite_logits) {
    moe_router_config cfg;
    moe_router_config_default(&cfg);
    cfg.top_k = 2;
    float logits[4 * 8] = {0};
    logits[2 * 8 + 5] = NAN;
    moe_cuda_plan gpu;
    ck_assert_int_eq(moe_cuda_plan_alloc(&gpu, 4, 8, 2), 0);
    float *d = GPU->alloc(sizeof logits);
    upload(d, logits, sizeof logits);
    ck_assert_int_eq(moe_cuda_router_forward(&gpu, d, NULL, NULL, 4, 8, &cfg, false, 0),
                     MOE_ENUMERIC);
    ck_assert_msg(strstr(moe_last_error(), "token 2"), "%s", moe_last_error());
    cfg.noise = MOE_NOISE_GUMBEL; // the sampling branch checks too
    ck_assert_int_eq(moe_cuda_router_forward(&gpu, d, NULL, NULL, 4, 8, &cfg, true, 3),
                     MOE_ENUMERIC);
    GPU->free(d);
    moe_cuda_plan_free(&gpu);
}
END_TEST

// The keyed noise on the device against router/noise.c: hashes and uniforms
// bit for bit, jitter bit for bit (the factors and the jittered values, both
// uncontracted double arithmetic), Gumbel samples within 4 ulp (CUDA's log and
// glibc's may differ in the last bit).
START_TEST(test_router_noise_matches_cpu_bits) {
    const size_t n = 1 << 16;
    const uint64_t seed = 12345, step = 77;
    uint64_t *dh = GPU->alloc(n * sizeof(uint64_t));
    double *du = GPU->alloc(n * sizeof(double)), *dg = GPU->alloc(n * sizeof(double));
    ck_assert_msg(moe_cuda_noise_samples(dh, du, dg, n, seed, step) == 0, "%s", moe_last_error());
    uint64_t *h = malloc(n * sizeof *h);
    double *u = malloc(n * sizeof *u), *g = malloc(n * sizeof *g);
    download(h, dh, n * sizeof *h);
    download(u, du, n * sizeof *u);
    download(g, dg, n * sizeof *g);
    size_t gumbel_inexact = 0;
    for (size_t i = 0; i < n; i++) {
        ck_assert_msg(h[i] == moe_hash4(seed, step, 1, i), "hash %zu", i);
        double cu = moe_noise_uniform(seed, step, 1, i), cg = moe_noise_gumbel(seed, step, i);
        ck_assert_msg(memcmp(&u[i], &cu, sizeof cu) == 0, "uniform %zu: %.17g vs %.17g", i, u[i],
                      cu);
        ck_assert_msg(fabs(g[i] - cg) <= 4 * 2.220446049250313e-16 * fmax(1.0, fabs(cg)),
                      "gumbel %zu: %.17g vs %.17g", i, g[i], cg);
        gumbel_inexact += g[i] != cg;
    }
    if (gumbel_inexact)
        printf("gumbel: %zu of %zu samples differ in the last bits\n", gumbel_inexact, n);
    // jitter: factors (from ones, as the MoE layer) and values in place
    tu_rng r;
    tu_seed(&r, 1999);
    fbuf x = fb_randn(&r, n, 3.0f), ones = fb_make(n, NULL, 1.0f);
    moe_router_jitter(x.h, n, 0.05, seed, step);
    moe_router_jitter(ones.h, n, 0.05, seed, step);
    ck_assert_int_eq(moe_cuda_router_jitter(x.d, x.d, n, 0.05, seed, step), 0);
    ck_assert_int_eq(moe_cuda_router_jitter(ones.d, NULL, n, 0.05, seed, step), 0);
    fb_check("jitter values", &x, 0.0);
    fb_check("jitter factors", &ones, 0.0);
    fb_free(&x), fb_free(&ones);
    GPU->free(dh), GPU->free(du), GPU->free(dg);
    free(h), free(u), free(g);
}
END_TEST

// ---- the MoE layer: GPU (grouped GEMMs, CUDA router) against moe_layer.c ------------

// n_tasks > 0: task-level routing (with task priorities under BPR); noise:
// the forward trains (router noise on, step = seed).
static void moe_layer_case(const moe_ops *gpu, int T, int D, int H, int E, int k, double cf, int Hs,
                           moe_slot_order order, int n_tasks, moe_noise noise, double tol,
                           uint64_t seed, int n_chunks) {
    moe_layer_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.T_max = T, cfg.D = D, cfg.H = H, cfg.E = E, cfg.H_shared = Hs, cfg.n_tasks = n_tasks;
    cfg.n_chunks = n_chunks;
    moe_router_config_default(&cfg.router);
    cfg.router.top_k = k;
    cfg.router.capacity_factor = cf;
    cfg.router.slot_order = order;
    cfg.router.z_loss_coef = 1e-3;
    cfg.router.noise = noise;
    cfg.router.noise_eps = 0.1;
    cfg.router.seed = seed + 5;
    if (n_tasks && order == MOE_SLOT_PRIORITY) {
        cfg.router.n_task_priority = n_tasks;
        for (int i = 0; i < n_tasks; i++)
            cfg.router.task_priority[i] = (double)((i * 5) % 3);
    }
    const bool training = noise != MOE_NOISE_NONE;
    tu_rng r;
    tu_seed(&r, seed);
    int *task = malloc(sizeof(int) * T);
    for (int t = 0; t < T; t++)
        task[t] = n_tasks ? (int)(tu_uniform(&r) * n_tasks) : 0;
    ibuf tid = ib_make(T, task);
    const int *th = n_tasks ? tid.h : NULL, *td = n_tasks ? tid.d : NULL;
    size_t np = moe_layer_num_params(&cfg);
    fbuf par = fb_randn(&r, np, 1.0f / sqrtf((float)D)), grad = fb_randn(&r, np, 0.1f);
    fbuf x = fb_randn(&r, (size_t)T * D, 1.0f), dy = fb_randn(&r, (size_t)T * D, 1.0f);
    fbuf y = fb_make((size_t)T * D, NULL, NAN), dx = fb_randn(&r, (size_t)T * D, 1.0f);
    moe_layer_params ph, pd, gh, gd;
    ck_assert_int_eq(moe_layer_params_view(&ph, par.h, &cfg), 0);
    ck_assert_int_eq(moe_layer_params_view(&pd, par.d, &cfg), 0);
    ck_assert_int_eq(moe_layer_params_view(&gh, grad.h, &cfg), 0);
    ck_assert_int_eq(moe_layer_params_view(&gd, grad.d, &cfg), 0);
    moe_layer_acts ah;
    moe_layer_cuda_acts ad;
    ck_assert_msg(moe_layer_acts_alloc(&ah, &cfg, &moe_ops_cpu) == 0, "%s", moe_last_error());
    ck_assert_msg(moe_layer_cuda_acts_alloc(&ad, &cfg, gpu) == 0, "%s", moe_last_error());
    ck_assert_msg(moe_layer_forward(y.h, x.h, th, NULL, T, &ph, &ah, training, seed) == 0, "%s",
                  moe_last_error());
    ck_assert_msg(moe_layer_cuda_forward(y.d, x.d, td, NULL, T, &pd, &ad, training, seed) == 0,
                  "%s", moe_last_error());
    char what[200];
    snprintf(what, sizeof what,
             "%s moe layer T=%d D=%d H=%d E=%d k=%d cf=%g Hs=%d tasks=%d noise=%d chunks=%d: y",
             gpu->name, T, D, H, E, k, cf, Hs, n_tasks, (int)noise, n_chunks);
    fb_check_norm(what, &y, tol, tol > TOL);
    expect_ints("moe layer offsets", ad.plan.offsets, ah.plan.offsets, E + 1);
    expect_ints("moe layer expert", ad.plan.expert, ah.plan.expert, (size_t)T * k);
    expect_ints("moe layer slot", ad.plan.slot, ah.plan.slot, (size_t)T * k);
    expect_floats("moe layer weight", ad.plan.weight, ah.plan.weight, (size_t)T * k, TOL);
    ck_assert_msg(moe_layer_backward(dx.h, &gh, dy.h, x.h, th, T, &ph, &ah, 0.01f, 0.001f) == 0,
                  "%s", moe_last_error());
    ck_assert_msg(moe_layer_cuda_backward(dx.d, &gd, dy.d, x.d, td, T, &pd, &ad, 0.01f, 0.001f) ==
                      0,
                  "%s", moe_last_error());
    snprintf(what, sizeof what, "%s moe layer T=%d: dx", gpu->name, T);
    fb_check_norm(what, &dx, tol, tol > TOL);
    snprintf(what, sizeof what, "%s moe layer T=%d: parameter gradients", gpu->name, T);
    fb_check_norm(what, &grad, tol, tol > TOL);
    moe_layer_acts_free(&ah);
    moe_layer_cuda_acts_free(&ad);
    fb_free(&par), fb_free(&grad), fb_free(&x), fb_free(&dy), fb_free(&y), fb_free(&dx);
    ib_free(&tid);
    free(task);
}

START_TEST(test_moe_layer_matches_cpu) {
    // A composition of GEMMs: 1e-4 of max(1, max |cpu|) in fp32 (the ops hold 1e-5).
    const moe_noise none = MOE_NOISE_NONE;
    moe_layer_case(GPU, 64, 32, 48, 4, 2, 1.25, 0, MOE_SLOT_POSITION, 0, none, 1e-4, 1700, 0);
    moe_layer_case(GPU, 200, 64, 96, 8, 2, 0.5, 0, MOE_SLOT_PRIORITY, 0, none, 1e-4, 1701,
                   0); // drops
    moe_layer_case(GPU, 97, 48, 40, 8, 1, 0.0, 24, MOE_SLOT_POSITION, 0, none, 1e-4, 1702, 0);
    moe_layer_case(&moe_ops_cuda_bf16, 128, 64, 128, 8, 2, 1.25, 0, MOE_SLOT_POSITION, 0, none,
                   TOL_BF16, 1703, 0);
}
END_TEST

// Task-level routing (per-task logits gathered per token, dlogits scatter-added
// by task into task_embedding), task priorities in BPR order, jitter on the
// gate input and Gumbel choices: the CPU layer's experts, slots and weights,
// output and gradients (task_embedding's included).
START_TEST(test_moe_layer_tasks_and_noise_match_cpu) {
    moe_layer_case(GPU, 120, 32, 48, 8, 2, 1.0, 0, MOE_SLOT_POSITION, 3, MOE_NOISE_NONE, 1e-4, 1710,
                   0);
    moe_layer_case(GPU, 150, 32, 48, 8, 2, 0.5, 16, MOE_SLOT_PRIORITY, 5, MOE_NOISE_NONE, 1e-4,
                   1711, 0); // task priorities, drops, shared expert
    moe_layer_case(GPU, 100, 32, 40, 8, 2, 1.25, 16, MOE_SLOT_POSITION, 0, MOE_NOISE_JITTER, 1e-4,
                   1712, 0);
    moe_layer_case(GPU, 90, 32, 40, 8, 2, 0.75, 0, MOE_SLOT_PRIORITY, 0, MOE_NOISE_GUMBEL, 1e-4,
                   1713, 0);
    moe_layer_case(GPU, 128, 48, 64, 8, 2, 0.5, 0, MOE_SLOT_PRIORITY, 4, MOE_NOISE_JITTER, 1e-4,
                   1714, 0); // tasks, priorities and jitter together
}
END_TEST

// Mini-sequence chunks (memory.mini_seq): the router over all T tokens, the
// experts and the shared expert one chunk at a time, recomputed in backward.
// Chunks of uneven size (T not a multiple), drops, dropless routing, a shared
// expert, task routing with jitter, and one chunk per token.
START_TEST(test_moe_layer_chunks_match_cpu) {
    const moe_noise none = MOE_NOISE_NONE;
    moe_layer_case(GPU, 120, 32, 48, 8, 2, 1.0, 16, MOE_SLOT_POSITION, 0, none, 1e-4, 1720, 4);
    moe_layer_case(GPU, 97, 48, 40, 8, 1, 0.0, 0, MOE_SLOT_POSITION, 0, none, 1e-4, 1721, 3);
    moe_layer_case(GPU, 150, 32, 48, 8, 2, 0.5, 0, MOE_SLOT_PRIORITY, 3, MOE_NOISE_JITTER, 1e-4,
                   1722, 2);
    moe_layer_case(GPU, 16, 16, 24, 4, 2, 1.25, 8, MOE_SLOT_POSITION, 0, none, 1e-4, 1723, 16);
    moe_layer_case(&moe_ops_cuda_bf16, 128, 64, 128, 8, 2, 1.25, 0, MOE_SLOT_POSITION, 0, none,
                   TOL_BF16, 1724, 4);
}
END_TEST

// 20 training steps of one MoE layer (regression to a fixed target: forward,
// backward, gradient-norm clipping, AdamW) on the CPU and on the GPU from the
// same initial parameters: the losses must agree step by step. Small
// differences compound through the optimizer, so 1e-3 relative.
START_TEST(test_moe_layer_training_matches_cpu) {
    const int T = 96, D = 32, H = 64, E = 8, k = 2, steps = 20;
    moe_layer_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.T_max = T, cfg.D = D, cfg.H = H, cfg.E = E, cfg.H_shared = 16;
    moe_router_config_default(&cfg.router);
    cfg.router.top_k = k;
    cfg.router.capacity_factor = 1.5;
    tu_rng r;
    tu_seed(&r, 1800);
    const size_t np = moe_layer_num_params(&cfg), nx = (size_t)T * D;
    fbuf par = fb_randn(&r, np, 1.0f / sqrtf((float)D)), grad = fb_make(np, NULL, 0.0f);
    fbuf m = fb_make(np, NULL, 0.0f), v = fb_make(np, NULL, 0.0f);
    fbuf x = fb_randn(&r, nx, 1.0f), y = fb_make(nx, NULL, 0.0f), dy = fb_make(nx, NULL, 0.0f);
    fbuf dx = fb_make(nx, NULL, 0.0f);
    float *target = malloc(sizeof(float) * nx), *yg = malloc(sizeof(float) * nx);
    tu_fill_normal(&r, target, nx, 0.5f);
    uint8_t *decay = malloc(np), *ddecay = GPU->alloc(np);
    memset(decay, 1, np);
    upload(ddecay, decay, np);
    moe_layer_params ph, pd, gh, gd;
    moe_layer_params_view(&ph, par.h, &cfg), moe_layer_params_view(&pd, par.d, &cfg);
    moe_layer_params_view(&gh, grad.h, &cfg), moe_layer_params_view(&gd, grad.d, &cfg);
    moe_layer_acts ah;
    moe_layer_cuda_acts ad;
    ck_assert_int_eq(moe_layer_acts_alloc(&ah, &cfg, CPU), 0);
    ck_assert_msg(moe_layer_cuda_acts_alloc(&ad, &cfg, GPU) == 0, "%s", moe_last_error());
    for (int step = 1; step <= steps; step++) {
        double loss[2];
        for (int side = 0; side < 2; side++) { // 0: CPU, 1: GPU
            const moe_ops *o = side ? GPU : CPU;
            float *P = side ? par.d : par.h, *Gr = side ? grad.d : grad.h;
            float *X = side ? x.d : x.h, *Y = side ? y.d : y.h, *DY = side ? dy.d : dy.h;
            float *DX = side ? dx.d : dx.h, *M = side ? m.d : m.h, *V = side ? v.d : v.h;
            ck_assert_int_eq(o->zero(Gr, np), 0);
            ck_assert_int_eq(o->zero(DX, nx), 0);
            int rc = side ? moe_layer_cuda_forward(Y, X, NULL, NULL, T, &pd, &ad, true, step)
                          : moe_layer_forward(Y, X, NULL, NULL, T, &ph, &ah, true, step);
            ck_assert_msg(rc == 0, "forward: %s", moe_last_error());
            // L = sum (y - target)^2 / (2 T D), dL/dy = (y - target) / (T D)
            float *yh = side ? yg : y.h;
            if (side) download(yg, y.d, sizeof(float) * nx);
            double l = 0.0;
            float *g = malloc(sizeof(float) * nx);
            for (size_t i = 0; i < nx; i++) {
                double e = (double)yh[i] - target[i];
                l += e * e;
                g[i] = (float)(e / nx);
            }
            loss[side] = l / (2.0 * nx);
            if (side)
                upload(dy.d, g, sizeof(float) * nx);
            else
                memcpy(dy.h, g, sizeof(float) * nx);
            free(g);
            rc = side ? moe_layer_cuda_backward(DX, &gd, DY, X, NULL, T, &pd, &ad, 0.01f, 0.001f)
                      : moe_layer_backward(DX, &gh, DY, X, NULL, T, &ph, &ah, 0.01f, 0.001f);
            ck_assert_msg(rc == 0, "backward: %s", moe_last_error());
            double ss = 0.0;
            ck_assert_int_eq(o->sumsq(&ss, Gr, np), 0);
            double norm = sqrt(ss), max_norm = 0.5;
            if (norm > max_norm)
                ck_assert_int_eq(o->scale(Gr, np, (float)(max_norm / (norm + 1e-6))), 0);
            ck_assert_int_eq(o->adamw(P, M, V, Gr, side ? ddecay : decay, np, step, 3e-3f, 0.9f,
                                      0.95f, 1e-8f, 0.01f),
                             0);
        }
        ck_assert_msg(fabs(loss[1] - loss[0]) <= 1e-3 * fabs(loss[0]),
                      "step %d: gpu loss %.9g, cpu loss %.9g", step, loss[1], loss[0]);
    }
    moe_layer_acts_free(&ah);
    moe_layer_cuda_acts_free(&ad);
    GPU->free(ddecay);
    free(decay), free(target), free(yg);
    fb_free(&par), fb_free(&grad), fb_free(&m), fb_free(&v), fb_free(&x), fb_free(&y);
    fb_free(&dy), fb_free(&dx);
}
END_TEST

START_TEST(test_moe_layer_refuses_unsupported_configs) {
    moe_layer_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.T_max = 8, cfg.D = 8, cfg.H = 8, cfg.E = 4;
    moe_router_config_default(&cfg.router);
    cfg.router.score = MOE_SCORE_SIGMOID;
    moe_layer_cuda_acts ad;
    ck_assert_int_eq(moe_layer_cuda_acts_alloc(&ad, &cfg, GPU), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "router.score = sigmoid"), "%s", moe_last_error());
    // The router itself refuses expert choice rather than routing token choice.
    moe_router_config rc;
    moe_router_config_default(&rc);
    rc.type = MOE_ROUTER_EXPERT_CHOICE;
    moe_cuda_plan gpu;
    ck_assert_int_eq(moe_cuda_plan_alloc(&gpu, 8, 4, rc.top_k), 0);
    float *d = GPU->alloc(sizeof(float) * 8 * 4);
    ck_assert_int_eq(GPU->zero(d, 8 * 4), 0);
    ck_assert_int_eq(moe_cuda_router_forward(&gpu, d, NULL, NULL, 8, 4, &rc, false, 0), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "expert_choice"), "%s", moe_last_error());
    GPU->free(d);
    moe_cuda_plan_free(&gpu);
}
END_TEST

// ---- errors -----------------------------------------------------------------------

START_TEST(test_out_of_memory_names_size_and_config_key) {
    size_t huge = (size_t)1 << 50; // 1 PiB
    void *p = GPU->alloc(huge);
    ck_assert_ptr_null(p);
    const char *msg = moe_last_error();
    ck_assert_msg(strstr(msg, "1125899906842624 bytes"), "%s", msg);
    ck_assert_msg(strstr(msg, "train.batch_size"), "%s", msg);
    // The context survives: later ops still work.
    float *x = GPU->alloc(64);
    ck_assert_ptr_nonnull(x);
    ck_assert_int_eq(GPU->zero(x, 16), 0);
    ck_assert_int_eq(moe_cuda_synchronize(), 0);
    GPU->free(x);
}
END_TEST

START_TEST(test_device_errors_carry_file_and_line) {
    ck_assert_int_eq(moe_cuda_init(1 << 20), MOE_EDEVICE);
    ck_assert_msg(strstr(moe_last_error(), "requested"), "%s", moe_last_error());
    // A bad copy (to NULL) surfaces through CUDA_TRY with the call site and the
    // CUDA error string.
    float host[4] = {0};
    int rc = moe_cuda_upload(NULL, host, sizeof host);
    ck_assert_int_eq(rc, MOE_EDEVICE);
    ck_assert_msg(strstr(moe_last_error(), "context.cu:") && strstr(moe_last_error(), "cudaMemcpy"),
                  "%s", moe_last_error());
}
END_TEST

#endif // MOE_HAVE_CUDA

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--cpu-self-check")) {
        self_check = 1;
        GPU = &moe_ops_cpu;
    } else {
#ifdef MOE_HAVE_CUDA
        char why[256] = "";
        if (moe_cuda_device_count(why, sizeof why) == 0) {
            printf("SKIP: no CUDA device (%s); the CUDA ops are compiled but not run\n", why);
            return 77;
        }
        if (moe_cuda_init(0) < 0) {
            printf("FAIL: %s\n", moe_last_error());
            return 1;
        }
        GPU = &moe_ops_cuda;
        // The CUDA context lives in this process: a forked test could not use
        // it (the driver is not fork-safe), so run in-process even outside ctest.
        setenv("CK_FORK", "no", 1);
#else
        printf("SKIP: built without CUDA (configure with -DMOE_CUDA=ON and a CUDA toolkit)\n");
        return 77;
#endif
    }
    Suite *s = suite_create("backend_ops");
    TCase *tc = tcase_create(self_check ? "cpu_vs_cpu_harness" : "cuda_vs_cpu");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_matmul_fp32_matches_cpu);
    tcase_add_test(tc, test_matmul_grouped_matches_cpu);
    tcase_add_test(tc, test_swiglu_matches_cpu);
    tcase_add_test(tc, test_permute_ops_match_cpu);
    tcase_add_test(tc, test_gather_scatter_rows_match_cpu);
    tcase_add_test(tc, test_elementwise_ops_match_cpu);
    tcase_add_test(tc, test_adamw_matches_cpu);
    tcase_add_test(tc, test_rmsnorm_matches_cpu);
    tcase_add_test(tc, test_rope_matches_cpu);
    tcase_add_test(tc, test_attention_matches_cpu);
    tcase_add_test(tc, test_embedding_matches_cpu);
    tcase_add_test(tc, test_crossentropy_matches_cpu);
#ifdef MOE_HAVE_CUDA
    if (!self_check) {
        tcase_add_test(tc, test_matmul_bf16_matches_cpu);
        tcase_add_test(tc, test_router_matches_cpu);
        tcase_add_test(tc, test_router_rejects_nonfinite_logits);
        tcase_add_test(tc, test_router_noise_matches_cpu_bits);
        tcase_add_test(tc, test_moe_layer_matches_cpu);
        tcase_add_test(tc, test_moe_layer_tasks_and_noise_match_cpu);
        tcase_add_test(tc, test_moe_layer_chunks_match_cpu);
        tcase_add_test(tc, test_moe_layer_training_matches_cpu);
        tcase_add_test(tc, test_moe_layer_refuses_unsupported_configs);
        tcase_add_test(tc, test_out_of_memory_names_size_and_config_key);
        tcase_add_test(tc, test_device_errors_carry_file_and_line);
    }
#endif
    suite_add_tcase(s, tc);
    int rc = tu_run(s);
#ifdef MOE_HAVE_CUDA
    if (!self_check) moe_cuda_shutdown();
#endif
    return rc;
}
