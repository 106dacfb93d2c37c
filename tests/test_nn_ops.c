// Decoder ops on the CPU: hand-computed values and central-difference
// gradient checks of RMSNorm, RoPE, causal GQA attention, embedding and
// cross-entropy. Each loss is L = sum(out * r) for a fixed random r.
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/nn.h"
#include "moe/error.h"
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// The attention scratch (forward tiles, backward copies) the kernel is given.
static float *att_scratch(int B, int T, int Hq, int Hkv, int hd) {
    return calloc(moe_cpu_attention_scratch_floats(B, T, Hq, Hkv, hd) + 1, sizeof(float));
}

typedef double (*loss_fn)(void *ctx);

// Compares analytic[i] with (L(x+h) - L(x-h)) / 2h for every i < n.
static void fd_check(const char *what, float *x, int n, const float *analytic, loss_fn f, void *ctx,
                     float h) {
    for (int i = 0; i < n; i++) {
        float x0 = x[i];
        x[i] = x0 + h;
        double lp = f(ctx);
        x[i] = x0 - h;
        double lm = f(ctx);
        x[i] = x0;
        double fd = (lp - lm) / (2.0 * h);
        ck_assert_msg(fabs(fd - analytic[i]) <= 1e-3 * fmax(fabs(fd), fabs(analytic[i])) + 1e-4,
                      "%s[%d]: analytic %g vs numeric %g", what, i, analytic[i], fd);
    }
}

static double dot(const float *a, const float *b, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)a[i] * b[i];
    return s;
}

static float *randn(tu_rng *r, size_t n, float scale) {
    float *p = malloc(sizeof(float) * (n ? n : 1));
    tu_fill_normal(r, p, n, scale);
    return p;
}

START_TEST(test_rmsnorm_values) {
    const float x[] = {3, 4}, w[] = {1, 2};
    float out[2], rstd[1];
    ck_assert_int_eq(moe_cpu_rmsnorm_forward(out, rstd, x, w, 1, 2, 0.0f), 0);
    float r = 1.0f / sqrtf(12.5f);
    ck_assert_float_eq_tol(out[0], 3 * r, 1e-6);
    ck_assert_float_eq_tol(out[1], 8 * r, 1e-6);
    // eps sits inside the square root: rsqrt(mean(x^2) + eps) = 1 / sqrt(13)
    ck_assert_int_eq(moe_cpu_rmsnorm_forward(out, rstd, x, w, 1, 2, 0.5f), 0);
    ck_assert_float_eq_tol(rstd[0], 1.0f / sqrtf(13.0f), 1e-7);
    ck_assert_float_eq_tol(out[1], 8.0f / sqrtf(13.0f), 1e-6);
}
END_TEST

// eps sits inside the square root, added to the mean of squares (DESIGN
// "Model": x * rsqrt(mean(x^2) + eps) * w): x = (3, 4), eps = 0.5 gives
// rstd = 1 / sqrt(12.5 + 0.5) = 1 / sqrt(13), not 1 / sqrt((25 + 0.5) / 2).
START_TEST(test_rmsnorm_eps_is_added_to_the_mean) {
    const float x[] = {3, 4}, w[] = {1, 2};
    float out[2], rstd[1];
    ck_assert_int_eq(moe_cpu_rmsnorm_forward(out, rstd, x, w, 1, 2, 0.5f), 0);
    const float r = 1.0f / sqrtf(13.0f);
    ck_assert_float_eq_tol(rstd[0], r, 1e-7);
    ck_assert_float_eq_tol(out[0], 3 * r, 1e-6);
    ck_assert_float_eq_tol(out[1], 8 * r, 1e-6);
}
END_TEST

typedef struct {
    float *out, *rstd, *x, *w, *r;
    int N, C;
} rms_ctx;

static double rms_loss(void *p) {
    rms_ctx *c = p;
    moe_cpu_rmsnorm_forward(c->out, c->rstd, c->x, c->w, c->N, c->C, 1e-5f);
    return dot(c->out, c->r, (size_t)c->N * c->C);
}

START_TEST(test_rmsnorm_gradients) {
    tu_rng g;
    tu_seed(&g, 1);
    enum { N = 5, C = 8 };
    rms_ctx c = {calloc(N * C, 4),
                 calloc(N, 4),
                 randn(&g, N * C, 1),
                 randn(&g, C, 1),
                 randn(&g, N * C, 1),
                 N,
                 C};
    float *dx = calloc(N * C, 4), *dw = calloc(C, 4);
    rms_loss(&c);
    moe_cpu_rmsnorm_backward(dx, dw, c.r, c.x, c.w, c.rstd, N, C);
    fd_check("rmsnorm dx", c.x, N * C, dx, rms_loss, &c, 1e-3f);
    fd_check("rmsnorm dw", c.w, C, dw, rms_loss, &c, 1e-3f);
    free(c.out), free(c.rstd), free(c.x), free(c.w), free(c.r), free(dx), free(dw);
}
END_TEST

// HF rotate-half: dimension i pairs with i + hd/2; angle pos * theta^(-2i/hd).
START_TEST(test_rope_values) {
    // B=1, T=2, H=1, hd=4; the token at position 1 rotates pair (0,2) by 1 rad
    // and pair (1,3) by 1e-2 rad (theta=1e4: 1e4^(-2/4) = 1e-2).
    float x[8] = {9, 9, 9, 9, 1, 1, 0, 2}, out[8];
    ck_assert_int_eq(moe_cpu_rope_forward(out, x, 1, 2, 1, 4, 10000.0f), 0);
    for (int i = 0; i < 4; i++)
        ck_assert_float_eq(out[i], 9.0f); // position 0: identity
    ck_assert_float_eq_tol(out[4], cosf(1.0f), 1e-6);
    ck_assert_float_eq_tol(out[6], sinf(1.0f), 1e-6);
    ck_assert_float_eq_tol(out[5], cosf(0.01f) - 2 * sinf(0.01f), 1e-6);
    ck_assert_float_eq_tol(out[7], 2 * cosf(0.01f) + sinf(0.01f), 1e-6);
    ck_assert_int_eq(moe_cpu_rope_forward(out, x, 1, 2, 1, 3, 10000.0f), MOE_EINVAL);
}
END_TEST

typedef struct {
    float *out, *x, *r;
    int B, T, H, hd;
} rope_ctx;

static double rope_loss(void *p) {
    rope_ctx *c = p;
    moe_cpu_rope_forward(c->out, c->x, c->B, c->T, c->H, c->hd, 100.0f);
    return dot(c->out, c->r, (size_t)c->B * c->T * c->H * c->hd);
}

// The backward ADDS into dx (kernels/cpu/nn.h), the rotation by minus the
// angle: dx starts at 1; the token at position 1 with dout (1, 1, 0, 2) gets
// pair (0,2) rotated by -1 rad, (cos 1, -sin 1), and pair (1,3) by -1e-2 rad,
// (cos .01 + 2 sin .01, 2 cos .01 - sin .01); position 0 passes dout through.
START_TEST(test_rope_backward_adds_the_inverse_rotation) {
    const float dout[8] = {9, 9, 9, 9, 1, 1, 0, 2};
    float dx[8];
    for (int i = 0; i < 8; i++)
        dx[i] = 1.0f;
    ck_assert_int_eq(moe_cpu_rope_backward(dx, dout, 1, 2, 1, 4, 10000.0f), 0);
    for (int i = 0; i < 4; i++)
        ck_assert_float_eq(dx[i], 10.0f);
    ck_assert_float_eq_tol(dx[4], 1 + cosf(1.0f), 1e-6);
    ck_assert_float_eq_tol(dx[6], 1 - sinf(1.0f), 1e-6);
    ck_assert_float_eq_tol(dx[5], 1 + cosf(0.01f) + 2 * sinf(0.01f), 1e-6);
    ck_assert_float_eq_tol(dx[7], 1 + 2 * cosf(0.01f) - sinf(0.01f), 1e-6);
}
END_TEST

START_TEST(test_rope_gradients) {
    tu_rng g;
    tu_seed(&g, 2);
    enum { B = 2, T = 3, H = 2, HD = 6, N = B * T * H * HD };
    rope_ctx c = {calloc(N, 4), randn(&g, N, 1), randn(&g, N, 1), B, T, H, HD};
    float *dx = calloc(N, 4);
    moe_cpu_rope_backward(dx, c.r, B, T, H, HD, 100.0f);
    fd_check("rope dx", c.x, N, dx, rope_loss, &c, 1e-3f);
    free(c.out), free(c.x), free(c.r), free(dx);
}
END_TEST

// The first token attends only to itself: its output is v[0] of its kv head.
START_TEST(test_attention_causal_first_token) {
    tu_rng g;
    tu_seed(&g, 3);
    enum { B = 1, T = 4, HQ = 4, HKV = 2, HD = 3 };
    float *q = randn(&g, B * T * HQ * HD, 1), *k = randn(&g, B * T * HKV * HD, 1);
    float *v = randn(&g, B * T * HKV * HD, 1);
    float *out = calloc(B * T * HQ * HD, 4),
          *att = calloc(moe_cpu_attention_state_floats(B, T, HQ), 4),
          *sc = att_scratch(B, T, HQ, HKV, HD);
    ck_assert_int_eq(moe_cpu_attention_forward(out, att, sc, q, k, v, B, T, HQ, HKV, HD), 0);
    for (int h = 0; h < HQ; h++)
        for (int d = 0; d < HD; d++)
            ck_assert_float_eq_tol(out[h * HD + d], v[(h / 2) * HD + d], 1e-6);
    // att saves each row's log-sum-exp of scaled scores over the keys s <= t
    for (int h = 0; h < HQ; h++)
        for (int t = 0; t < T; t++) {
            double s = 0;
            for (int u = 0; u <= t; u++)
                s += exp(dot(q + (t * HQ + h) * HD, k + (u * HKV + h / 2) * HD, HD) / sqrt(HD));
            ck_assert_double_eq_tol(att[h * T + t], log(s), 1e-5);
        }
    ck_assert_int_eq(moe_cpu_attention_forward(out, att, sc, q, k, v, B, T, 3, 2, HD), MOE_EINVAL);
    free(q), free(k), free(v), free(out), free(att), free(sc);
}
END_TEST

typedef struct {
    float *out, *att, *q, *k, *v, *r, *scratch;
    int B, T, Hq, Hkv, hd;
} att_ctx;

static double att_loss(void *p) {
    att_ctx *c = p;
    moe_cpu_attention_forward(c->out, c->att, c->scratch, c->q, c->k, c->v, c->B, c->T, c->Hq,
                              c->Hkv, c->hd);
    return dot(c->out, c->r, (size_t)c->B * c->T * c->Hq * c->hd);
}

START_TEST(test_attention_gradients) {
    tu_rng g;
    tu_seed(&g, 4);
    enum { B = 2, T = 5, HQ = 4, HKV = 2, HD = 4, NQ = B * T * HQ * HD, NK = B * T * HKV * HD };
    att_ctx c = {calloc(NQ, 4),
                 calloc(moe_cpu_attention_state_floats(B, T, HQ), 4),
                 randn(&g, NQ, 1),
                 randn(&g, NK, 1),
                 randn(&g, NK, 1),
                 randn(&g, NQ, 1),
                 att_scratch(B, T, HQ, HKV, HD),
                 B,
                 T,
                 HQ,
                 HKV,
                 HD};
    float *dq = calloc(NQ, 4), *dk = calloc(NK, 4), *dv = calloc(NK, 4), *datt = c.scratch;
    att_loss(&c);
    ck_assert_int_eq(moe_cpu_attention_backward(dq, dk, dv, datt, c.r, c.out, c.att, c.q, c.k, c.v,
                                                B, T, HQ, HKV, HD),
                     0);
    fd_check("attention dq", c.q, NQ, dq, att_loss, &c, 1e-2f);
    fd_check("attention dk", c.k, NK, dk, att_loss, &c, 1e-2f);
    fd_check("attention dv", c.v, NK, dv, att_loss, &c, 1e-2f);
    free(c.out), free(c.att), free(c.q), free(c.k), free(c.v), free(c.r);
    free(dq), free(dk), free(dv), free(c.scratch);
}
END_TEST

// Straightforward double-precision attention, forward and backward (the
// probabilities materialised), for one (b, h) at a time.
static void ref_attention(double *out, double *dq, double *dk, double *dv, const float *q,
                          const float *k, const float *v, const float *dout, int B, int T, int Hq,
                          int Hkv, int hd) {
    const double scale = 1.0 / sqrt(hd);
    const int ldq = Hq * hd, ldk = Hkv * hd;
    double *p = malloc(sizeof(double) * T), *dp = malloc(sizeof(double) * T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq; h++)
            for (int t = 0; t < T; t++) {
                const float *qt = q + ((size_t)b * T + t) * ldq + h * hd;
                const float *dot_ = dout + ((size_t)b * T + t) * ldq + h * hd;
                size_t kv = (size_t)b * T * ldk + (size_t)(h / (Hq / Hkv)) * hd;
                double m = -INFINITY, sum = 0, pdp = 0;
                for (int s = 0; s <= t; s++) {
                    p[s] = scale * dot(qt, k + kv + (size_t)s * ldk, hd);
                    m = fmax(m, p[s]);
                }
                for (int s = 0; s <= t; s++)
                    sum += p[s] = exp(p[s] - m);
                double *o = out + ((size_t)b * T + t) * ldq + h * hd;
                for (int d = 0; d < hd; d++)
                    o[d] = 0;
                for (int s = 0; s <= t; s++) {
                    p[s] /= sum;
                    dp[s] = dot(dot_, v + kv + (size_t)s * ldk, hd);
                    pdp += p[s] * dp[s];
                    for (int d = 0; d < hd; d++) {
                        o[d] += p[s] * v[kv + (size_t)s * ldk + d];
                        dv[kv + (size_t)s * ldk + d] += p[s] * dot_[d];
                    }
                }
                for (int s = 0; s <= t; s++) {
                    double ds = p[s] * (dp[s] - pdp) * scale;
                    for (int d = 0; d < hd; d++) {
                        dq[((size_t)b * T + t) * ldq + h * hd + d] +=
                            ds * k[kv + (size_t)s * ldk + d];
                        dk[kv + (size_t)s * ldk + d] += ds * qt[d];
                    }
                }
            }
    free(p), free(dp);
}

// max |x - ref| relative to max |ref| over the tensor
static double rel_err(const float *x, const double *ref, size_t n) {
    double e = 0, m = 0;
    for (size_t i = 0; i < n; i++)
        e = fmax(e, fabs(x[i] - ref[i])), m = fmax(m, fabs(ref[i]));
    return e / m;
}

// The blocked float kernel against the double reference: 300 positions
// (several 64-key tiles, a ragged last one), GQA 6 query heads on 2 kv heads,
// head_dim 40 (padded copies inside); 200 positions, head_dim 64 on one kv
// head (accumulated in place); one position. out, dq, dk and dv within 2e-5
// of the largest entry (float rounding over a few hundred terms; a wrong mask,
// scale or lse gives errors of order 1). dq, dk, dv start from a nonzero
// gradient that backward adds to. The scratch sits between guards that must
// stay untouched.
static const int ref_shapes[][5] = {{2, 300, 6, 2, 40}, {1, 200, 4, 1, 64}, {2, 1, 2, 2, 16}};

START_TEST(test_attention_matches_double_reference) {
    tu_rng g;
    tu_seed(&g, 5);
    const int B = ref_shapes[_i][0], T = ref_shapes[_i][1], HQ = ref_shapes[_i][2];
    const int HKV = ref_shapes[_i][3], HD = ref_shapes[_i][4];
    const size_t NQ = (size_t)B * T * HQ * HD, NK = (size_t)B * T * HKV * HD;
    const size_t ns = moe_cpu_attention_scratch_floats(B, T, HQ, HKV, HD);
    float *q = randn(&g, NQ, 1.5f), *k = randn(&g, NK, 1.5f), *v = randn(&g, NK, 1);
    float *dout = randn(&g, NQ, 1), *out = calloc(NQ, 4),
          *att = calloc(moe_cpu_attention_state_floats(B, T, HQ), 4);
    float *dq = randn(&g, NQ, 1), *dk = randn(&g, NK, 1), *dv = randn(&g, NK, 1);
    float *sc = tu_guarded_alloc(ns);
    for (size_t i = 0; i < ns; i++)
        sc[i] = NAN; // stale scratch must not leak into results
    double *ro = calloc(NQ, 8), *rq = calloc(NQ, 8), *rk = calloc(NK, 8), *rv = calloc(NK, 8);
    for (size_t i = 0; i < NQ; i++)
        rq[i] = dq[i];
    for (size_t i = 0; i < NK; i++)
        rk[i] = dk[i], rv[i] = dv[i];
    ck_assert_int_eq(moe_cpu_attention_forward(out, att, sc, q, k, v, B, T, HQ, HKV, HD), 0);
    ck_assert_int_eq(
        moe_cpu_attention_backward(dq, dk, dv, sc, dout, out, att, q, k, v, B, T, HQ, HKV, HD), 0);
    ref_attention(ro, rq, rk, rv, q, k, v, dout, B, T, HQ, HKV, HD);
    ck_assert_double_le(rel_err(out, ro, NQ), 2e-5);
    ck_assert_double_le(rel_err(dq, rq, NQ), 2e-5);
    ck_assert_double_le(rel_err(dk, rk, NK), 2e-5);
    ck_assert_double_le(rel_err(dv, rv, NK), 2e-5);
    ck_assert(tu_guards_intact(sc, ns));
    free(q), free(k), free(v), free(dout), free(out), free(att), free(dq), free(dk), free(dv);
    free(ro), free(rq), free(rk), free(rv);
    tu_guarded_free(sc, ns);
}
END_TEST

START_TEST(test_attention_refuses_missing_scratch) {
    float x[8] = {0}, lse[1];
    ck_assert_int_eq(moe_cpu_attention_forward(x, lse, NULL, x, x, x, 1, 1, 1, 1, 8), MOE_EINVAL);
    ck_assert_int_eq(moe_cpu_attention_backward(x, x, x, NULL, x, x, lse, x, x, x, 1, 1, 1, 1, 8),
                     MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "scratch"));
}
END_TEST

typedef struct {
    float *out, *att, *sc, *q, *k, *v, *dout, *dq, *dk, *dv;
    int B, T, Hq, Hkv, hd;
} att_run;

static void att_run_task(void *ctx, int i) {
    const att_run *a = ctx;
    if (i) return;
    (void)moe_cpu_attention_forward(a->out, a->att, a->sc, a->q, a->k, a->v, a->B, a->T, a->Hq,
                                    a->Hkv, a->hd);
    (void)moe_cpu_attention_backward(a->dq, a->dk, a->dv, a->sc, a->dout, a->out, a->att, a->q,
                                     a->k, a->v, a->B, a->T, a->Hq, a->Hkv, a->hd);
}

// Spread over the pool, or run serially inside one pool task (nested calls
// run serially, on that thread's scratch slot): the same bits.
START_TEST(test_attention_same_bits_serial_and_threaded) {
    tu_rng g;
    tu_seed(&g, 6);
    enum { B = 2, T = 150, HQ = 4, HKV = 2, HD = 32, NQ = B * T * HQ * HD, NK = B * T * HKV * HD };
    float *q = randn(&g, NQ, 1), *k = randn(&g, NK, 1), *v = randn(&g, NK, 1);
    float *dout = randn(&g, NQ, 1);
    att_run r[2];
    for (int s = 0; s < 2; s++) {
        r[s] = (att_run){calloc(NQ, 4),
                         calloc(B * HQ * T, 4),
                         att_scratch(B, T, HQ, HKV, HD),
                         q,
                         k,
                         v,
                         dout,
                         calloc(NQ, 4),
                         calloc(NK, 4),
                         calloc(NK, 4),
                         B,
                         T,
                         HQ,
                         HKV,
                         HD};
    }
    att_run_task(&r[0], 0);
    moe_cpu_parallel_for(2, att_run_task, &r[1]);
    ck_assert(!memcmp(r[0].out, r[1].out, sizeof(float) * NQ));
    ck_assert(!memcmp(r[0].att, r[1].att, sizeof(float) * B * HQ * T));
    ck_assert(!memcmp(r[0].dq, r[1].dq, sizeof(float) * NQ));
    ck_assert(!memcmp(r[0].dk, r[1].dk, sizeof(float) * NK));
    ck_assert(!memcmp(r[0].dv, r[1].dv, sizeof(float) * NK));
    for (int s = 0; s < 2; s++) {
        free(r[s].out), free(r[s].att), free(r[s].sc), free(r[s].dq), free(r[s].dk);
        free(r[s].dv);
    }
    free(q), free(k), free(v), free(dout);
}
END_TEST

// The softmax's vector exp against exp in double over the range its
// arguments take (a score minus the row max or log-sum-exp: x <= 0): within
// 2 ulp (relative 2.4e-7); below -87, and -inf (masked scores), exactly 0.
START_TEST(test_attention_exp_within_two_ulp) {
    enum { N = 200003 };
    float *x = malloc(sizeof(float) * N), *y = malloc(sizeof(float) * N);
    for (int i = 0; i < N; i++)
        x[i] = -87.0f * (float)i / (N - 1); // [-87, 0], ragged tail
    moe_cpu_exp_vec(y, x, N);
    double worst = 0;
    for (int i = 0; i < N; i++)
        worst = fmax(worst, fabs(y[i] - exp((double)x[i])) / exp((double)x[i]));
    ck_assert_msg(worst <= 2.4e-7, "max relative error %g", worst);
    float lo[3] = {-88.0f, -1000.0f, -INFINITY}, out[3];
    moe_cpu_exp_vec(out, lo, 3);
    for (int i = 0; i < 3; i++)
        ck_assert_float_eq(out[i], 0.0f);
    free(x), free(y);
}
END_TEST

START_TEST(test_embedding_forward_backward) {
    const float table[] = {1, 2, 3, 4, 5, 6}; // V=3, C=2
    const int32_t tok[] = {2, 0, 2};
    float out[6], dtable[6] = {0};
    ck_assert_int_eq(moe_cpu_embedding_forward(out, tok, table, 3, 2, 3), 0);
    const float want[] = {5, 6, 1, 2, 5, 6};
    for (int i = 0; i < 6; i++)
        ck_assert_float_eq(out[i], want[i]);
    const float dout[] = {1, 1, 2, 2, 3, 3};
    moe_cpu_embedding_backward(dtable, dout, tok, 3, 2);
    const float wantd[] = {2, 2, 0, 0, 4, 4}; // token 2 used twice: gradients add
    for (int i = 0; i < 6; i++)
        ck_assert_float_eq(dtable[i], wantd[i]);
    const int32_t bad[] = {0, 3};
    ck_assert_int_eq(moe_cpu_embedding_forward(out, bad, table, 2, 2, 3), MOE_EINVAL);
}
END_TEST

typedef struct {
    float *losses, *logits;
    int32_t *target;
    int N, V;
} ce_ctx;

static double ce_loss(void *p) {
    ce_ctx *c = p;
    double m;
    moe_cpu_crossentropy_forward(c->losses, &m, c->logits, c->target, c->N, c->V);
    return m;
}

START_TEST(test_crossentropy) {
    // uniform logits: loss = ln V
    float logits0[8] = {0};
    int32_t t0[2] = {3, -1};
    float losses[4];
    double m;
    ck_assert_int_eq(moe_cpu_crossentropy_forward(losses, &m, logits0, t0, 2, 4), 0);
    ck_assert_double_eq_tol(m, log(4.0), 1e-6);
    ck_assert_float_eq(losses[1], 0.0f); // ignored target

    tu_rng g;
    tu_seed(&g, 5);
    enum { N = 4, V = 7 };
    int32_t target[N] = {1, -1, 6, 0};
    ce_ctx c = {losses, randn(&g, N * V, 2), target, N, V};
    float *d = calloc(N * V, 4);
    ck_assert_int_eq(moe_cpu_crossentropy_backward(d, c.logits, target, N, V, 1.0f), 0);
    fd_check("crossentropy dlogits", c.logits, N * V, d, ce_loss, &c, 1e-3f);
    for (int v = 0; v < V; v++)
        ck_assert_float_eq(d[1 * V + v], 0.0f); // ignored row
    int32_t bad[N] = {1, 7, 0, 0};
    ck_assert_int_eq(moe_cpu_crossentropy_forward(losses, &m, c.logits, bad, N, V), MOE_EINVAL);
    free(c.logits), free(d);
}
END_TEST

// The backward ADDS dloss * (softmax - onehot) / n_valid into dlogits: with
// uniform logits over V = 4, target 3 and one ignored row (n_valid = 1),
// dlogits starting at 0.5 become 0.5 + 0.25 and 0.5 + 0.25 - 1; the ignored
// row keeps its 0.5.
START_TEST(test_crossentropy_backward_adds) {
    const float logits[8] = {0};
    const int32_t target[2] = {3, -1};
    float d[8];
    for (int i = 0; i < 8; i++)
        d[i] = 0.5f;
    ck_assert_int_eq(moe_cpu_crossentropy_backward(d, logits, target, 2, 4, 1.0f), 0);
    for (int v = 0; v < 3; v++)
        ck_assert_float_eq_tol(d[v], 0.75f, 1e-7);
    ck_assert_float_eq_tol(d[3], -0.25f, 1e-7);
    for (int v = 4; v < 8; v++)
        ck_assert_float_eq(d[v], 0.5f);
}
END_TEST

static Suite *nn_suite(void) {
    Suite *s = suite_create("nn_ops");
    TCase *tc = tcase_create("cpu");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_rmsnorm_values);
    tcase_add_test(tc, test_rmsnorm_gradients);
    tcase_add_test(tc, test_rmsnorm_eps_is_added_to_the_mean);
    tcase_add_test(tc, test_rope_values);
    tcase_add_test(tc, test_rope_gradients);
    tcase_add_test(tc, test_rope_backward_adds_the_inverse_rotation);
    tcase_add_test(tc, test_attention_causal_first_token);
    tcase_add_test(tc, test_attention_gradients);
    tcase_add_loop_test(tc, test_attention_matches_double_reference, 0,
                        sizeof ref_shapes / sizeof *ref_shapes);
    tcase_add_test(tc, test_attention_refuses_missing_scratch);
    tcase_add_test(tc, test_attention_same_bits_serial_and_threaded);
    tcase_add_test(tc, test_attention_exp_within_two_ulp);
    tcase_add_test(tc, test_embedding_forward_backward);
    tcase_add_test(tc, test_crossentropy);
    tcase_add_test(tc, test_crossentropy_backward_adds);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(nn_suite());
}
