// Causal scaled dot-product attention with grouped-query heads (GQA, arXiv
// 2305.13245), blocked as FlashAttention-2 (Dao, arXiv 2307.08691): scores
// exist one [BC keys x BR queries] tile at a time, the softmax is kept online
// per query (running max m, running sum l) in float, and only the row
// log-sum-exp is saved. Backward recomputes each tile from it:
//   P = exp(S - lse),  dV += P^T dO,  dP = dO V^T,  dS = P * (dP - D),
//   D = rowsum(dO * O),  dQ += scale dS K,  dK += scale dS^T Q.
// Tiles are stored transposed (key-major, S^T [BC x BR]) so that K (and V)
// rows are the broadcast operand of a 6x16 register-blocked FMA kernel, only
// Q (and dO) need a transposed copy, and the per-query softmax statistics are
// 8-wide vectors across a tile row. Forward items are (b, head, query block),
// heaviest first; backward items are (b, head), each GQA head's dK, dV in its
// own partial, summed per kv head in head order. Every item's arithmetic is
// fixed, so the results do not depend on the thread count or timing.
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/nn.h"
#include "moe/error.h"

#include <cblas.h>
#include <math.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

enum { BR = 64, BC = 64 }; // queries, keys per tile (BR a multiple of 16)

// 8-lane vectors: AVX registers under -march=native, pairs of SSE ones
// without; the helpers are static, so the vector-ABI note does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float v8 __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

static int check_dims(int B, int T, int Hq, int Hkv, int hd) {
    if (B < 0 || T < 1 || Hq < 1 || Hkv < 1 || hd < 1 || Hq % Hkv)
        return moe_fail(MOE_EINVAL, "attention: B=%d T=%d n_heads=%d n_kv_heads=%d head_dim=%d", B,
                        T, Hq, Hkv, hd);
    return 0;
}

static inline v8 load8(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}
static inline void store8(float *p, v8 x) {
    memcpy(p, &x, sizeof x);
}
static inline v8 splat(float x) {
    return (v8){x, x, x, x, x, x, x, x};
}
static inline v8 vselect(v8i mask, v8 a, v8 b) { // mask ? a : b per lane (C has no vector ?:)
    return (v8)(((v8i)a & mask) | ((v8i)b & ~mask));
}
static inline v8 vmax(v8 a, v8 b) {
#ifdef __AVX__
    return (v8)_mm256_max_ps((__m256)a, (__m256)b); // one instruction, not compare and blend
#else
    return vselect(a > b, a, b);
#endif
}

// exp on 8 lanes for x <= 0 (Cephes expf: Cody-Waite reduction by ln 2,
// degree-7 polynomial, within 2 ulp; tests/test_nn_ops.c bounds it); x below
// -87 (masked scores are -inf) gives exactly 0. Every argument here is a
// score minus its row's running max or log-sum-exp, so there is no upper
// clamp.
static inline v8 exp8(v8 x) {
    const v8i dead = x < splat(-87.0f);
    x = vmax(x, splat(-87.0f));
    v8 n = x * splat(1.44269504088896341f) + splat(12582912.0f); // round to nearest
    n -= splat(12582912.0f);
    v8 r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    v8 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    const v8i e = (__builtin_convertvector(n, v8i) + 127) << 23; // 2^n as float bits
    return (v8)((v8i)((v8)e * p) & ~dead);
}

void moe_cpu_exp_vec(float *y, const float *x, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        store8(y + i, exp8(load8(x + i)));
    if (i < n) {
        float t[8] = {0};
        memcpy(t, x + i, sizeof(float) * (n - i));
        store8(t, exp8(load8(t)));
        memcpy(y + i, t, sizeof(float) * (n - i));
    }
}

// C[R x 16] (+)= A[R x K] B[K x 16]: A[r][k] at a[r * rs + k * ks] (so A may
// be read transposed or in place from a strided tensor), B rows ldb apart, C
// rows ldc apart; zero: C starts from 0 instead of its contents. R <= 6: the
// 12 accumulators, two B vectors and a broadcast fill 15 of the 16 vector
// registers, enough independent FMA chains to cover the FMA latency.
static inline __attribute__((always_inline)) void kernel(int R, bool zero, float *c, size_t ldc,
                                                         const float *a, size_t rs, size_t ks,
                                                         const float *b, size_t ldb, int K) {
    v8 acc[6][2];
    for (int r = 0; r < R; r++) {
        acc[r][0] = zero ? splat(0.0f) : load8(c + r * ldc);
        acc[r][1] = zero ? splat(0.0f) : load8(c + r * ldc + 8);
    }
    for (int k = 0; k < K; k++) {
        const v8 b0 = load8(b + (size_t)k * ldb), b1 = load8(b + (size_t)k * ldb + 8);
        const float *ak = a + (size_t)k * ks;
        for (int r = 0; r < R; r++) {
            const v8 ar = splat(ak[r * rs]);
            acc[r][0] += ar * b0, acc[r][1] += ar * b1;
        }
    }
    for (int r = 0; r < R; r++)
        store8(c + r * ldc, acc[r][0]), store8(c + r * ldc + 8, acc[r][1]);
}

// Diagonal tiles (key block = query block) are triangular: tri names which
// zero (masked) part of a row block of C or A to skip. Skipped products are
// 0 * finite, so the results are the bits of the full product.
enum {
    FULL,
    TRI_S,   // C = S^T [keys x queries]: columns r < c are masked; whole
             // 16-column blocks left of the row block are zero-filled, not computed
    TRI_KLO, // A [keys x queries] (P, dS): A[c][r] = 0 for r < c, so k starts at the row
    TRI_KHI, // A [queries x keys] (P^T, dS^T): A[r][c] = 0 for c > r, so k ends past the block
};

static inline __attribute__((always_inline)) void row_block(int R, bool zero, int tri, float *c,
                                                            size_t ldc, const float *a, size_t rs,
                                                            size_t ks, const float *b, size_t ldb,
                                                            int i, int N, int K) {
    const int k0 = tri == TRI_KLO ? i : 0, k1 = tri == TRI_KHI && i + R < K ? i + R : K;
    const int j0 = tri == TRI_S ? i / 16 * 16 : 0;
    c += i * ldc, a += i * rs + k0 * ks, b += k0 * ldb;
    for (int r = 0; zero && r < R; r++)
        memset(c + r * ldc, 0, sizeof(float) * j0);
    for (int j = j0; j < N; j += 16)
        kernel(R, zero, c + j, ldc, a, rs, ks, b + j, ldb, k1 - k0);
}

// C[M x N] (+)= A[M x K] B[K x N] for any M, N % 16 == 0, strides as kernel().
static inline __attribute__((always_inline)) void gemm(bool zero, int tri, float *c, size_t ldc,
                                                       const float *a, size_t rs, size_t ks,
                                                       const float *b, size_t ldb, int M, int N,
                                                       int K) {
    int i = 0;
    for (; i + 6 <= M; i += 6)
        row_block(6, zero, tri, c, ldc, a, rs, ks, b, ldb, i, N, K);
    for (int R = 4; R >= 1; R /= 2)
        if ((M - i) & R) row_block(R, zero, tri, c, ldc, a, rs, ks, b, ldb, i, N, K), i += R;
}

// The two variants the passes use, so each is compiled once: C = A B (zero)
// and C += A B.
static void gemm_set(int tri, float *c, size_t ldc, const float *a, size_t rs, size_t ks,
                     const float *b, size_t ldb, int M, int N, int K) {
    gemm(true, tri, c, ldc, a, rs, ks, b, ldb, M, N, K);
}
static void gemm_add(int tri, float *c, size_t ldc, const float *a, size_t rs, size_t ks,
                     const float *b, size_t ldb, int M, int N, int K) {
    gemm(false, tri, c, ldc, a, rs, ks, b, ldb, M, N, K);
}

static inline int round_up(int x, int m) {
    return (x + m - 1) / m * m;
}
static inline int min_int(int a, int b) {
    return a < b ? a : b;
}

// dst [hd x BR] = s * (rows x hd, stride lds)^T, queries past rows zero.
// Source rows are read whole (the strided side is the block, in L1).
static void transpose_block(float *dst, const float *src, size_t lds, int rows, int hd, float s) {
    if (rows < BR)
        for (int d = 0; d < hd; d++)
            memset(dst + (size_t)d * BR + rows, 0, sizeof(float) * (BR - rows));
    for (int r = 0; r < rows; r++)
        for (int d = 0; d < hd; d++)
            dst[(size_t)d * BR + r] = s * src[r * lds + d];
}

// sum_i a[i] b[i] over 8 lanes, then the lanes in a fixed order.
static float dot8(const float *a, const float *b, int n) {
    v8 acc = splat(0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        acc += load8(a + i) * load8(b + i);
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

// dst [rows x ldd] = src rows (stride lds, n values each), zero padded to ldd.
static void copy_rows(float *dst, int ldd, const float *src, size_t lds, int rows, int n) {
    for (int r = 0; r < rows; r++) {
        memcpy(dst + (size_t)r * ldd, src + r * lds, sizeof(float) * n);
        memset(dst + (size_t)r * ldd + n, 0, sizeof(float) * (ldd - n));
    }
}

// Scores of a diagonal tile (key block = query block): key c is in the
// future of query r when c > r.
static void mask_diagonal(float *St, int kc) {
    for (int c = 1; c < kc; c++)
        for (int r = 0; r < c; r++)
            St[c * BR + r] = -INFINITY;
}

typedef struct {
    float *out, *lse, *dq, *dk, *dv;
    const float *q, *k, *v, *o, *dout;
    int B, T, Hq, Hkv, hd, hdp, nt;
    float scale;
    float *scratch, *part; // per-thread slots; per-head dK, dV partials (GQA backward)
    size_t slot;           // floats of scratch per thread
} att_job;

// Per-thread floats: forward tiles, or backward's per-head copies (Q and dO
// transposed, K, V, Q, dO rows contiguous) and, head_dim not a multiple of
// 16, padded accumulators.
static size_t slot_floats(int T, int hd) {
    const size_t Tp = (size_t)round_up(T, BR), hdp = (size_t)round_up(hd, 16);
    const size_t fwd = (size_t)hd * BR + (size_t)BC * BR + 2 * (size_t)BR * hdp + 2 * BR;
    size_t bwd = 2 * Tp * hd + 2 * Tp + 2 * (size_t)BC * BR + 4 * Tp * hdp;
    if (hdp != (size_t)hd) bwd += 3 * Tp * hdp;
    return ((fwd > bwd ? fwd : bwd) + 15) / 16 * 16;
}

// With GQA, backward runs one item per query head (B * Hq items spread over
// the pool, not B * Hkv) and each head's dK, dV go to its own [Tp x hdp]
// pair, added per kv head in head order afterwards: one writer each, and the
// sum's order fixed whatever the thread count.
static size_t part_floats(int B, int T, int Hq, int Hkv, int hd) {
    if (Hq == Hkv) return 0;
    return 2 * (size_t)B * Hq * (size_t)round_up(T, BR) * (size_t)round_up(hd, 16);
}

// One query block of one head against every key block up to it (FlashAttention-2
// forward). The tile St[c][r] = k_c . (scale q_r) is K read in place times the
// transposed query block; its columns are the queries, so m, l and the
// rescaling factors are vectors over 8 queries.
static void forward_block(void *ctx, int item) {
    const att_job *J = ctx;
    const int BH = J->B * J->Hq, i0 = (J->nt - 1 - item / BH) * BR; // heaviest first
    const int b = item % BH / J->Hq, h = item % J->Hq, g = h / (J->Hq / J->Hkv);
    const int T = J->T, hd = J->hd, hdp = J->hdp, rows = min_int(BR, T - i0);
    const size_t ldq = (size_t)J->Hq * hd, ldk = (size_t)J->Hkv * hd;
    const float *q = J->q + ((size_t)b * T + i0) * ldq + (size_t)h * hd;
    const float *k = J->k + (size_t)b * T * ldk + (size_t)g * hd;
    const float *v = J->v + (size_t)b * T * ldk + (size_t)g * hd;
    float *Qt = J->scratch + (size_t)moe_cpu_thread_id() * J->slot; // [hd x BR]
    float *St = Qt + (size_t)hd * BR;                               // [BC x BR]
    float *acc = St + BC * BR, *Vp = acc + (size_t)BR * hdp;        // [BR x hdp], [BC x hdp]
    float *m = Vp + (size_t)BC * hdp, *l = m + BR;                  // [BR] each
    transpose_block(Qt, q, ldq, rows, hd, J->scale);
    memset(acc, 0, sizeof(float) * BR * hdp);
    for (int r = 0; r < BR; r++)
        m[r] = -INFINITY, l[r] = 0.0f;
    for (int j0 = 0; j0 <= i0; j0 += BC) {
        const int kc = min_int(BC, T - j0);
        const bool diag = j0 == i0;
        gemm_set(diag ? TRI_S : FULL, St, BR, k + j0 * ldk, ldk, 1, Qt, BR, kc, BR, hd);
        if (diag) mask_diagonal(St, kc);
        v8 alpha[BR / 8];
        bool rescale = false;
        for (int rv = 0; rv < BR; rv += 8) {
            const v8 m_old = load8(m + rv);
            v8 mx = m_old;
            for (int c = 0; c < kc; c++)
                mx = vmax(mx, load8(St + c * BR + rv));
            v8 sum = splat(0.0f);
            for (int c = 0; c < kc; c++) {
                const v8 p = exp8(load8(St + c * BR + rv) - mx);
                store8(St + c * BR + rv, p);
                sum += p;
            }
            const v8 a = exp8(m_old - mx); // 0 on the first block (m_old = -inf)
            store8(l + rv, load8(l + rv) * a + sum), store8(m + rv, mx);
            alpha[rv / 8] = a;
            for (int i = 0; i < 8; i++)
                rescale |= a[i] != 1.0f;
        }
        if (rescale && j0)
            for (int r = 0; r < BR; r++) {
                const v8 a = splat(alpha[r / 8][r % 8]);
                for (int d = 0; d < hdp; d += 8)
                    store8(acc + r * hdp + d, load8(acc + r * hdp + d) * a);
            }
        // acc [BR x hdp] += P^T V_j: P^T read from St as A[r][c] = St[c][r].
        // V_j is copied to contiguous rows first: read in place, its rows a
        // power-of-two stride apart would share a few L1 sets.
        copy_rows(Vp, hdp, v + j0 * ldk, ldk, kc, hd);
        gemm_add(diag ? TRI_KHI : FULL, acc, hdp, St, 1, BR, Vp, hdp, BR, hdp, kc);
    }
    float *o = J->out + ((size_t)b * T + i0) * ldq + (size_t)h * hd;
    float *lse = J->lse + ((size_t)b * J->Hq + h) * T + i0;
    for (int r = 0; r < rows; r++) {
        const float inv = 1.0f / l[r];
        for (int d = 0; d < hd; d++)
            o[r * ldq + d] = acc[r * hdp + d] * inv;
        lse[r] = m[r] + logf(l[r]);
    }
}

size_t moe_cpu_attention_state_floats(int B, int T, int Hq) {
    return (size_t)B * Hq * T; // one log-sum-exp per query row
}

size_t moe_cpu_attention_scratch_floats(int B, int T, int Hq, int Hkv, int hd) {
    if (B < 0 || T < 1 || Hq < 1 || Hkv < 1 || hd < 1 || Hq % Hkv) return 0; // refused at the call
    return slot_floats(T, hd) * (size_t)moe_cpu_threads() + part_floats(B, T, Hq, Hkv, hd);
}

static int job_init(att_job *J, float *scratch, int B, int T, int Hq, int Hkv, int hd) {
    MOE_TRY(check_dims(B, T, Hq, Hkv, hd));
    if (!scratch)
        return moe_fail(MOE_EINVAL,
                        "attention: no scratch (%zu floats expected: "
                        "attention_scratch_floats)",
                        moe_cpu_attention_scratch_floats(B, T, Hq, Hkv, hd));
    J->scratch = scratch, J->B = B, J->T = T, J->Hq = Hq, J->Hkv = Hkv, J->hd = hd;
    J->hdp = round_up(hd, 16), J->nt = (T + BR - 1) / BR, J->scale = 1.0f / sqrtf((float)hd);
    J->slot = slot_floats(T, hd);
    J->part = part_floats(B, T, Hq, Hkv, hd) ? scratch + J->slot * (size_t)moe_cpu_threads() : NULL;
    return 0;
}

int moe_cpu_attention_forward(float *out, float *att, float *scratch, const float *q,
                              const float *k, const float *v, int B, int T, int Hq, int Hkv,
                              int hd) {
    att_job J = {.out = out, .lse = att, .q = q, .k = k, .v = v};
    MOE_TRY(job_init(&J, scratch, B, T, Hq, Hkv, hd));
    moe_cpu_parallel_for(B * Hq * J.nt, forward_block, &J);
    return 0;
}

// One query head (b, h): every (query block, key block) pair at or below the
// diagonal. K, V, Q and dO are read from contiguous (zero-padded) copies, as
// V in forward; with head_dim a multiple of 16, dQ accumulates in place in the
// caller's buffer, as do dK and dV without GQA; otherwise in padded
// accumulators (dK, dV of a GQA head in its partial pair).
static void backward_head(void *ctx, int item) {
    const att_job *J = ctx;
    const int b = item / J->Hq, h = item % J->Hq, g = h / (J->Hq / J->Hkv);
    const int T = J->T, hd = J->hd, hdp = J->hdp, Tp = J->nt * BR;
    const bool pad = hd != hdp;
    const size_t ldq = (size_t)J->Hq * hd, ldk = (size_t)J->Hkv * hd;
    const size_t off_k = (size_t)b * T * ldk + (size_t)g * hd;
    const size_t off_q = (size_t)b * T * ldq + (size_t)h * hd;
    float *Qt = J->scratch + (size_t)moe_cpu_thread_id() * J->slot; // [nt][hd x BR]
    float *dOt = Qt + (size_t)Tp * hd, *D = dOt + (size_t)Tp * hd;  // [nt][hd x BR], [Tp]
    float *L = D + Tp, *P = L + Tp, *dS = P + BC * BR;              // [Tp], tiles [BC x BR]
    float *Kp = dS + BC * BR, *Vp = Kp + (size_t)Tp * hdp;          // rows: [Tp x hdp] each
    float *Qp = Vp + (size_t)Tp * hdp, *dOp = Qp + (size_t)Tp * hdp;
    float *dQp = dOp + (size_t)Tp * hdp, *dKp = dQp + (size_t)Tp * hdp; // padded accumulators
    float *dVp = dKp + (size_t)Tp * hdp;
    const float *lse = J->lse + ((size_t)b * J->Hq + h) * T;
    const float *q = J->q + off_q, *dout = J->dout + off_q;
    float *dkb = J->dk + off_k, *dvb = J->dv + off_k, *dqb = J->dq + off_q;
    size_t ldkb = ldk, ldqb = ldq; // strides of dK, dV rows; of dQ rows
    for (int i0 = 0; i0 < T; i0 += BR) {
        const int rows = min_int(BR, T - i0);
        transpose_block(Qt + (size_t)i0 * hd, q + i0 * ldq, ldq, rows, hd, J->scale);
        transpose_block(dOt + (size_t)i0 * hd, dout + i0 * ldq, ldq, rows, hd, 1.0f);
    }
    for (int t = 0; t < Tp; t++) { // padded queries: D = 0, lse = inf, so P = 0
        D[t] = t < T ? dot8(dout + t * ldq, J->o + off_q + t * ldq, hd) : 0.0f;
        L[t] = t < T ? lse[t] : INFINITY;
    }
    copy_rows(Kp, hdp, J->k + off_k, ldk, T, hd), copy_rows(Vp, hdp, J->v + off_k, ldk, T, hd);
    copy_rows(Qp, hdp, q, ldq, T, hd), copy_rows(dOp, hdp, dout, ldq, T, hd);
    if (pad) {
        memset(dQp, 0, sizeof(float) * 3 * Tp * hdp); // dQp, dKp, dVp
        dqb = dQp, dkb = dKp, dvb = dVp, ldkb = ldqb = hdp;
    }
    if (J->part) { // GQA: this head's own dK, dV
        dkb = J->part + (size_t)item * 2 * Tp * hdp, dvb = dkb + (size_t)Tp * hdp, ldkb = hdp;
        memset(dkb, 0, sizeof(float) * 2 * Tp * hdp);
    }
    for (int i0 = 0; i0 < T; i0 += BR) {
        const int rows = min_int(BR, T - i0);
        const float *qt = Qt + (size_t)i0 * hd, *dot = dOt + (size_t)i0 * hd;
        for (int j0 = 0; j0 <= i0; j0 += BC) {
            const int kc = min_int(BC, T - j0);
            const float *kj = Kp + (size_t)j0 * hdp, *vj = Vp + (size_t)j0 * hdp;
            const bool diag = j0 == i0;
            gemm_set(diag ? TRI_S : FULL, P, BR, kj, hdp, 1, qt, BR, kc, BR, hd); // S^T
            if (diag) mask_diagonal(P, kc);
            gemm_set(diag ? TRI_S : FULL, dS, BR, vj, hdp, 1, dot, BR, kc, BR, hd); // dP^T
            for (int c = 0; c < kc; c++)
                for (int rv = 0; rv < BR; rv += 8) {
                    const v8 p = exp8(load8(P + c * BR + rv) - load8(L + i0 + rv));
                    store8(P + c * BR + rv, p);
                    store8(dS + c * BR + rv,
                           splat(J->scale) * p * (load8(dS + c * BR + rv) - load8(D + i0 + rv)));
                }
            // dV_j += P^T dO_i, dK_j += dS^T Q_i (A = the tiles read row-major)
            const int klo = diag ? TRI_KLO : FULL;
            gemm_add(klo, dvb + j0 * ldkb, ldkb, P, BR, 1, dOp + (size_t)i0 * hdp, hdp, kc, hdp,
                     rows);
            gemm_add(klo, dkb + j0 * ldkb, ldkb, dS, BR, 1, Qp + (size_t)i0 * hdp, hdp, kc, hdp,
                     rows);
            // dQ_i += dS K_j (A[r][c] = dS^T[c][r])
            gemm_add(diag ? TRI_KHI : FULL, dqb + i0 * ldqb, ldqb, dS, 1, BR, kj, hdp, rows, hdp,
                     kc);
        }
    }
    if (!pad) return;
    for (int t = 0; t < T; t++)
        for (int d = 0; d < hd; d++)
            J->dq[off_q + t * ldq + d] += dQp[(size_t)t * hdp + d];
    if (!J->part)
        for (int t = 0; t < T; t++)
            for (int d = 0; d < hd; d++) {
                J->dk[off_k + t * ldk + d] += dKp[(size_t)t * hdp + d];
                J->dv[off_k + t * ldk + d] += dVp[(size_t)t * hdp + d];
            }
}

// dK, dV of kv head (b, g) += its query heads' partials, in head order.
static void reduce_group(void *ctx, int item) {
    const att_job *J = ctx;
    const int b = item / J->Hkv, g = item % J->Hkv, group = J->Hq / J->Hkv;
    const int T = J->T, hd = J->hd, hdp = J->hdp, Tp = J->nt * BR;
    const size_t ldk = (size_t)J->Hkv * hd, off_k = (size_t)b * T * ldk + (size_t)g * hd;
    for (int h = g * group; h < (g + 1) * group; h++) {
        const float *pk = J->part + ((size_t)b * J->Hq + h) * 2 * Tp * hdp;
        const float *pv = pk + (size_t)Tp * hdp;
        for (int t = 0; t < T; t++)
            for (int d = 0; d < hd; d++) {
                J->dk[off_k + t * ldk + d] += pk[(size_t)t * hdp + d];
                J->dv[off_k + t * ldk + d] += pv[(size_t)t * hdp + d];
            }
    }
}

int moe_cpu_attention_backward(float *dq, float *dk, float *dv, float *datt, const float *dout,
                               const float *out, const float *att, const float *q, const float *k,
                               const float *v, int B, int T, int Hq, int Hkv, int hd) {
    att_job J = {.dq = dq,
                 .dk = dk,
                 .dv = dv,
                 .lse = (float *)att,
                 .q = q,
                 .k = k,
                 .v = v,
                 .o = out,
                 .dout = dout};
    MOE_TRY(job_init(&J, datt, B, T, Hq, Hkv, hd));
    moe_cpu_parallel_for(B * Hq, backward_head, &J);
    if (J.part) moe_cpu_parallel_for(B * Hkv, reduce_group, &J);
    return 0;
}

int moe_cpu_attention_cached(float *out, float *scores, const float *q, const float *kc,
                             const float *vc, int pos, int Hq, int Hkv, int hd) {
    MOE_TRY(check_dims(1, pos + 1, Hq, Hkv, hd));
    const float scale = 1.0f / sqrtf((float)hd);
    const int ldk = Hkv * hd, group = Hq / Hkv, n = pos + 1;
    for (int h = 0; h < Hq; h++) {
        const float *kg = kc + (size_t)(h / group) * hd, *vg = vc + (size_t)(h / group) * hd;
        // scores [n] = scale * K[0..pos] q_h
        cblas_sgemv(CblasRowMajor, CblasNoTrans, n, hd, scale, kg, ldk, q + (size_t)h * hd, 1, 0.0f,
                    scores, 1);
        float m = scores[0];
        for (int s = 1; s < n; s++)
            if (scores[s] > m) m = scores[s];
        double sum = 0.0;
        for (int s = 0; s < n; s++)
            sum += exp((double)scores[s] - m);
        for (int s = 0; s < n; s++)
            scores[s] = (float)(exp((double)scores[s] - m) / sum);
        // out_h [hd] = P V = V[0..pos]^T p
        cblas_sgemv(CblasRowMajor, CblasTrans, n, hd, 1.0f, vg, ldk, scores, 1, 0.0f,
                    out + (size_t)h * hd, 1);
    }
    return 0;
}
