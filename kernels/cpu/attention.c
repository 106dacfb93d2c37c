// Causal scaled dot-product attention with grouped-query heads (GQA, arXiv
// 2305.13245), blocked as FlashAttention-2 (Dao, arXiv 2307.08691): scores
// exist one [BR, BC] tile at a time, the softmax is kept online per query row
// (running max m, running sum l) in float, and only the row log-sum-exp is
// saved. Backward recomputes each tile from it:
//   P = exp(S - lse),  dV += P^T dO,  dP = dO V^T,  dS = P * (dP - D),
//   D = rowsum(dO * O),  dQ += scale dS K,  dK += scale dS^T Q.
// Tiles are multiplied by a 4x16 register-blocked kernel over zero-padded
// copies (K and V transposed where the inner loop needs them), so every loop
// runs on full 8-wide vectors. (b, head) pairs, or (b, kv head) groups in
// backward so that dK and dV have one writer, are spread over the thread pool.
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/nn.h"
#include "moe/error.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { BR = 64, BC = 64 }; // query rows, key columns per tile

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
static inline void store8(float *p, v8 x) { memcpy(p, &x, sizeof x); }
static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }

static inline v8 vselect(v8i mask, v8 a, v8 b) { // mask ? a : b per lane (C has no vector ?:)
    return (v8)(((v8i)a & mask) | ((v8i)b & ~mask));
}

// exp on 8 lanes (Cephes expf: Cody-Waite reduction by ln 2, degree-6
// polynomial, about 1 ulp); x below -87 (masked scores are -inf) gives 0.
static inline v8 exp8(v8 x) {
    const v8i dead = x < splat(-87.0f);
    x = vselect(dead, splat(-87.0f), x);
    x = vselect(x > splat(88.0f), splat(88.0f), x);
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

// C[4 x 16] += A[4 x K] B[K x 16]: A[r][k] at a[r * rs + k * ks] (so A may be
// read transposed), B rows ldb apart, C rows ldc apart; the tile sits in 8
// vector registers through the K loop.
static inline void kernel4x16(float *c, int ldc, const float *a, int rs, int ks, const float *b,
                              int ldb, int K) {
    v8 c00 = load8(c), c01 = load8(c + 8), c10 = load8(c + ldc), c11 = load8(c + ldc + 8);
    v8 c20 = load8(c + 2 * ldc), c21 = load8(c + 2 * ldc + 8);
    v8 c30 = load8(c + 3 * ldc), c31 = load8(c + 3 * ldc + 8);
    for (int k = 0; k < K; k++) {
        const v8 b0 = load8(b + (size_t)k * ldb), b1 = load8(b + (size_t)k * ldb + 8);
        const float *ak = a + (size_t)k * ks;
        v8 a0 = splat(ak[0]), a1 = splat(ak[rs]);
        c00 += a0 * b0, c01 += a0 * b1, c10 += a1 * b0, c11 += a1 * b1;
        a0 = splat(ak[2 * rs]), a1 = splat(ak[3 * rs]);
        c20 += a0 * b0, c21 += a0 * b1, c30 += a1 * b0, c31 += a1 * b1;
    }
    store8(c, c00), store8(c + 8, c01), store8(c + ldc, c10), store8(c + ldc + 8, c11);
    store8(c + 2 * ldc, c20), store8(c + 2 * ldc + 8, c21);
    store8(c + 3 * ldc, c30), store8(c + 3 * ldc + 8, c31);
}

// C[M x N] += A[M x K] B[K x N], M % 4 == 0, N % 16 == 0; A rows lda apart.
static void tile_gemm(float *c, int ldc, const float *a, int lda, const float *b, int ldb, int M,
                      int N, int K) {
    for (int i = 0; i < M; i += 4)
        for (int j = 0; j < N; j += 16)
            kernel4x16(c + (size_t)i * ldc + j, ldc, a + (size_t)i * lda, lda, 1, b + j, ldb, K);
}

// C[M x N] += A^T B for A [K x M] with rows lda apart (no transposed copy).
static void tile_gemm_tn(float *c, int ldc, const float *a, int lda, const float *b, int ldb, int M,
                         int N, int K) {
    for (int i = 0; i < M; i += 4)
        for (int j = 0; j < N; j += 16)
            kernel4x16(c + (size_t)i * ldc + j, ldc, a + i, 1, lda, b + j, ldb, K);
}

static inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// dst [rows x ldd] = src rows (stride lds, n values each), zero padded.
static void copy_rows(float *dst, int ldd, const float *src, size_t lds, int rows, int n, int pad_rows,
                      float s) {
    for (int r = 0; r < pad_rows; r++) {
        float *d = dst + (size_t)r * ldd;
        if (r < rows)
            for (int i = 0; i < n; i++)
                d[i] = s * src[r * lds + i];
        else
            memset(d, 0, sizeof(float) * n);
        memset(d + n, 0, sizeof(float) * (ldd - n));
    }
}

// dst [n_pad x ldd] = transpose of src rows (rows x n, stride lds), zero padded.
static void copy_transposed(float *dst, int ldd, const float *src, size_t lds, int rows, int n,
                            int n_pad) {
    memset(dst, 0, sizeof(float) * (size_t)n_pad * ldd);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < n; i++)
            dst[(size_t)i * ldd + r] = src[r * lds + i];
}

typedef struct {
    float *out, *lse, *dq, *dk, *dv;
    const float *q, *k, *v, *o, *dout;
    int B, T, Hq, Hkv, hd, Tp, hdp;
    float scale;
    float *scratch;
    size_t slot; // floats of scratch per thread
} att_job;

// S [BR x BC] = Qs_i K_j^T for query rows i0.., key columns j0.., with
// -inf where the key is in the future or past T.
static void scores(float *S, const float *qs, const float *kT, int Tp, int hdp, int i0, int j0,
                   int T) {
    memset(S, 0, sizeof(float) * BR * BC);
    tile_gemm(S, BC, qs, hdp, kT + j0, Tp, BR, BC, hdp);
    if (j0 + BC - 1 <= i0 && j0 + BC <= T) return; // wholly in the past
    for (int r = 0; r < BR; r++)
        for (int c = 0; c < BC; c++)
            if (j0 + c > i0 + r || j0 + c >= T) S[r * BC + c] = -INFINITY;
}

static void forward_head(void *ctx, int item) {
    const att_job *J = ctx;
    const int b = item / J->Hq, h = item % J->Hq, g = h / (J->Hq / J->Hkv);
    const int T = J->T, hd = J->hd, Tp = J->Tp, hdp = J->hdp;
    const size_t ldq = (size_t)J->Hq * hd, ldk = (size_t)J->Hkv * hd;
    const float *q = J->q + (size_t)b * T * ldq + (size_t)h * hd;
    const float *k = J->k + (size_t)b * T * ldk + (size_t)g * hd, *v = J->v + (size_t)b * T * ldk + (size_t)g * hd;
    float *kT = J->scratch + (size_t)moe_cpu_thread_id() * J->slot; // [hdp x Tp]
    float *vp = kT + (size_t)hdp * Tp;                               // [Tp x hdp]
    float *qs = vp + (size_t)Tp * hdp, *acc = qs + BR * hdp, *S = acc + BR * hdp; // tiles
    float m[BR], l[BR];
    copy_transposed(kT, Tp, k, ldk, T, hd, hdp);
    copy_rows(vp, hdp, v, ldk, T, hd, Tp, 1.0f);
    for (int i0 = 0; i0 < T; i0 += BR) {
        const int rows = T - i0 < BR ? T - i0 : BR;
        copy_rows(qs, hdp, q + i0 * ldq, ldq, rows, hd, BR, J->scale);
        memset(acc, 0, sizeof(float) * BR * hdp);
        for (int r = 0; r < BR; r++)
            m[r] = -INFINITY, l[r] = 0.0f;
        for (int j0 = 0; j0 <= i0 + rows - 1; j0 += BC) {
            scores(S, qs, kT, Tp, hdp, i0, j0, T);
            for (int r = 0; r < rows; r++) {
                float *s = S + r * BC, mx = m[r];
                v8 vm = splat(mx);
                for (int c = 0; c < BC; c += 8) {
                    const v8 x = load8(s + c);
                    vm = vselect(x > vm, x, vm);
                }
                for (int i = 0; i < 8; i++)
                    mx = vm[i] > mx ? vm[i] : mx;
                const float alpha = expf(m[r] - mx); // 0 on the first block
                v8 sum = splat(0.0f);
                for (int c = 0; c < BC; c += 8) {
                    v8 p = exp8(load8(s + c) - splat(mx));
                    store8(s + c, p);
                    sum += p;
                }
                float ls = 0.0f;
                for (int i = 0; i < 8; i++)
                    ls += sum[i];
                l[r] = l[r] * alpha + ls, m[r] = mx;
                if (alpha != 1.0f)
                    for (int d = 0; d < hdp; d++)
                        acc[r * hdp + d] *= alpha;
            }
            if (rows < BR) memset(S + rows * BC, 0, sizeof(float) * (BR - rows) * BC);
            tile_gemm(acc, hdp, S, BC, vp + (size_t)j0 * hdp, hdp, BR, hdp, BC);
        }
        float *o = J->out + (size_t)b * T * ldq + (size_t)h * hd + i0 * ldq;
        float *lse = J->lse + ((size_t)b * J->Hq + h) * T + i0;
        for (int r = 0; r < rows; r++) {
            const float inv = 1.0f / l[r];
            for (int d = 0; d < hd; d++)
                o[r * ldq + d] = acc[r * hdp + d] * inv;
            lse[r] = m[r] + logf(l[r]);
        }
    }
}

size_t moe_cpu_attention_state_floats(int B, int T, int Hq) {
    return (size_t)B * Hq * T; // one log-sum-exp per query row
}

size_t moe_cpu_attention_scratch_floats(int T) {
    (void)T; // tiles live in per-thread buffers sized by the thread count
    return 0;
}

int moe_cpu_attention_forward(float *out, float *att, const float *q, const float *k,
                              const float *v, int B, int T, int Hq, int Hkv, int hd) {
    MOE_TRY(check_dims(B, T, Hq, Hkv, hd));
    att_job J = {.out = out, .lse = att, .q = q, .k = k, .v = v, .B = B, .T = T, .Hq = Hq,
                 .Hkv = Hkv, .hd = hd, .Tp = round_up(T, BC), .hdp = round_up(hd, 16),
                 .scale = 1.0f / sqrtf((float)hd)};
    J.slot = 2 * (size_t)J.Tp * J.hdp + 2 * BR * J.hdp + BR * BC + 16;
    J.scratch = malloc(sizeof(float) * J.slot * moe_cpu_threads());
    if (!J.scratch) return moe_fail(MOE_ENOMEM, "attention: %d-position tiles: out of memory", T);
    moe_cpu_parallel_for(B * Hq, forward_head, &J);
    free(J.scratch);
    return 0;
}

static void backward_group(void *ctx, int item) {
    const att_job *J = ctx;
    const int b = item / J->Hkv, g = item % J->Hkv, group = J->Hq / J->Hkv;
    const int T = J->T, hd = J->hd, Tp = J->Tp, hdp = J->hdp;
    const size_t ldq = (size_t)J->Hq * hd, ldk = (size_t)J->Hkv * hd;
    const size_t off_k = (size_t)b * T * ldk + (size_t)g * hd;
    float *kp = J->scratch + (size_t)moe_cpu_thread_id() * J->slot; // [Tp x hdp]
    float *vT = kp + (size_t)Tp * hdp, *kT = vT + (size_t)hdp * Tp;  // [hdp x Tp]
    float *dk = kT + (size_t)hdp * Tp, *dv = dk + (size_t)Tp * hdp;  // [Tp x hdp]
    float *qs = dv + (size_t)Tp * hdp, *dO = qs + (size_t)Tp * hdp;  // [Tp x hdp]
    float *dQ = dO + (size_t)Tp * hdp, *D = dQ + (size_t)Tp * hdp;  // [Tp x hdp], [Tp]
    float *P = D + Tp, *dS = P + BR * BC; // tiles
    copy_rows(kp, hdp, J->k + off_k, ldk, T, hd, Tp, 1.0f);
    copy_transposed(kT, Tp, J->k + off_k, ldk, T, hd, hdp);
    copy_transposed(vT, Tp, J->v + off_k, ldk, T, hd, hdp);
    memset(dk, 0, sizeof(float) * 2 * Tp * hdp);
    for (int h = g * group; h < (g + 1) * group; h++) {
        const size_t off_q = (size_t)b * T * ldq + (size_t)h * hd;
        const float *lse = J->lse + ((size_t)b * J->Hq + h) * T;
        copy_rows(qs, hdp, J->q + off_q, ldq, T, hd, Tp, J->scale);
        copy_rows(dO, hdp, J->dout + off_q, ldq, T, hd, Tp, 1.0f);
        memset(dQ, 0, sizeof(float) * Tp * hdp);
        for (int t = 0; t < Tp; t++) {
            float s = 0.0f;
            if (t < T)
                for (int d = 0; d < hd; d++)
                    s += J->dout[off_q + t * ldq + d] * J->o[off_q + t * ldq + d];
            D[t] = s;
        }
        for (int j0 = 0; j0 < T; j0 += BC) {
            for (int i0 = j0 / BR * BR; i0 < T; i0 += BR) {
                const int rows = T - i0 < BR ? T - i0 : BR;
                scores(P, qs + (size_t)i0 * hdp, kT, Tp, hdp, i0, j0, T);
                for (int r = 0; r < BR; r++) {
                    const v8 m = splat(r < rows ? lse[i0 + r] : INFINITY);
                    for (int c = 0; c < BC; c += 8)
                        store8(P + r * BC + c, exp8(load8(P + r * BC + c) - m));
                }
                // dP = dO_i V_j^T, then dS = P * (dP - D)
                memset(dS, 0, sizeof(float) * BR * BC);
                tile_gemm(dS, BC, dO + (size_t)i0 * hdp, hdp, vT + j0, Tp, BR, BC, hdp);
                for (int r = 0; r < BR; r++) {
                    const v8 Dr = splat(D[i0 + r]);
                    for (int c = 0; c < BC; c += 8)
                        store8(dS + r * BC + c,
                               load8(P + r * BC + c) * (load8(dS + r * BC + c) - Dr));
                }
                tile_gemm_tn(dv + (size_t)j0 * hdp, hdp, P, BC, dO + (size_t)i0 * hdp, hdp, BC,
                             hdp, BR);
                tile_gemm_tn(dk + (size_t)j0 * hdp, hdp, dS, BC, qs + (size_t)i0 * hdp, hdp, BC,
                             hdp, BR);
                tile_gemm(dQ + (size_t)i0 * hdp, hdp, dS, BC, kp + (size_t)j0 * hdp, hdp, BR, hdp,
                          BC);
            }
        }
        for (int t = 0; t < T; t++)
            for (int d = 0; d < hd; d++)
                J->dq[off_q + t * ldq + d] += J->scale * dQ[(size_t)t * hdp + d];
    }
    for (int t = 0; t < T; t++)
        for (int d = 0; d < hd; d++) {
            J->dk[off_k + t * ldk + d] += dk[(size_t)t * hdp + d];
            J->dv[off_k + t * ldk + d] += dv[(size_t)t * hdp + d];
        }
}

int moe_cpu_attention_backward(float *dq, float *dk, float *dv, float *datt, const float *dout,
                               const float *out, const float *att, const float *q, const float *k,
                               const float *v, int B, int T, int Hq, int Hkv, int hd) {
    MOE_TRY(check_dims(B, T, Hq, Hkv, hd));
    (void)datt; // tiles live in the backend's own scratch
    att_job J = {.dq = dq, .dk = dk, .dv = dv, .lse = (float *)att, .q = q, .k = k, .v = v,
                 .o = out, .dout = dout, .B = B, .T = T, .Hq = Hq, .Hkv = Hkv, .hd = hd,
                 .Tp = round_up(T, BC), .hdp = round_up(hd, 16), .scale = 1.0f / sqrtf((float)hd)};
    J.slot = 8 * (size_t)J.Tp * J.hdp + J.Tp + 2 * BR * BC + 16;
    J.scratch = malloc(sizeof(float) * J.slot * moe_cpu_threads());
    if (!J.scratch) return moe_fail(MOE_ENOMEM, "attention: %d-position tiles: out of memory", T);
    moe_cpu_parallel_for(B * Hkv, backward_group, &J);
    free(J.scratch);
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
