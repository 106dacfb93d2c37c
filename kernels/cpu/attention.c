// Causal scaled dot-product attention with grouped-query heads (GQA, arXiv
// 2305.13245), one (batch, head) at a time with strided OpenBLAS GEMMs.
// Backward with P the saved probabilities, S the scaled scores:
//   dP = dO V^T,  dV += P^T dO,  dS = P * (dP - rowsum(P * dP)),
//   dQ += scale * dS K,  dK += scale * dS^T Q.
#include "kernels/cpu/nn.h"
#include "moe/error.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static int check_dims(int B, int T, int Hq, int Hkv, int hd) {
    if (B < 0 || T < 1 || Hq < 1 || Hkv < 1 || hd < 1 || Hq % Hkv)
        return moe_fail(MOE_EINVAL, "attention: B=%d T=%d n_heads=%d n_kv_heads=%d head_dim=%d", B,
                        T, Hq, Hkv, hd);
    return 0;
}

int moe_cpu_attention_forward(float *out, float *att, const float *q, const float *k,
                              const float *v, int B, int T, int Hq, int Hkv, int hd) {
    MOE_TRY(check_dims(B, T, Hq, Hkv, hd));
    const float scale = 1.0f / sqrtf((float)hd);
    const int ldq = Hq * hd, ldk = Hkv * hd, group = Hq / Hkv;
    double *e = malloc(sizeof(double) * (size_t)T); // one row's exponentials, computed once
    if (!e) return moe_fail(MOE_ENOMEM, "attention: %d-position row: out of memory", T);
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < Hq; h++) {
            const float *qh = q + (size_t)b * T * ldq + (size_t)h * hd;
            const float *kg = k + (size_t)b * T * ldk + (size_t)(h / group) * hd;
            const float *vg = v + (size_t)b * T * ldk + (size_t)(h / group) * hd;
            float *p = att + ((size_t)b * Hq + h) * T * T;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hd, scale, qh, ldq, kg, ldk,
                        0.0f, p, T);
            for (int t = 0; t < T; t++) {
                float *row = p + (size_t)t * T, m = row[0];
                for (int s = 1; s <= t; s++)
                    if (row[s] > m) m = row[s];
                double sum = 0.0;
                for (int s = 0; s <= t; s++)
                    sum += e[s] = exp((double)row[s] - m);
                for (int s = 0; s <= t; s++)
                    row[s] = (float)(e[s] / sum);
                memset(row + t + 1, 0, sizeof(float) * (T - t - 1));
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hd, T, 1.0f, p, T, vg, ldk,
                        0.0f, out + (size_t)b * T * ldq + (size_t)h * hd, ldq);
        }
    }
    free(e);
    return 0;
}

int moe_cpu_attention_backward(float *dq, float *dk, float *dv, float *datt, const float *dout,
                               const float *att, const float *q, const float *k, const float *v,
                               int B, int T, int Hq, int Hkv, int hd) {
    MOE_TRY(check_dims(B, T, Hq, Hkv, hd));
    const float scale = 1.0f / sqrtf((float)hd);
    const int ldq = Hq * hd, ldk = Hkv * hd, group = Hq / Hkv;
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < Hq; h++) {
            size_t oq = (size_t)b * T * ldq + (size_t)h * hd;
            size_t ok = (size_t)b * T * ldk + (size_t)(h / group) * hd;
            const float *p = att + ((size_t)b * Hq + h) * T * T;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hd, 1.0f, dout + oq, ldq,
                        v + ok, ldk, 0.0f, datt, T);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hd, T, 1.0f, p, T, dout + oq,
                        ldq, 1.0f, dv + ok, ldk);
            for (int t = 0; t < T; t++) {
                const float *pr = p + (size_t)t * T;
                float *dr = datt + (size_t)t * T;
                double dot = 0.0;
                for (int s = 0; s <= t; s++)
                    dot += (double)pr[s] * dr[s];
                for (int s = 0; s <= t; s++)
                    dr[s] = pr[s] * (dr[s] - (float)dot);
                memset(dr + t + 1, 0, sizeof(float) * (T - t - 1));
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hd, T, scale, datt, T, k + ok,
                        ldk, 1.0f, dq + oq, ldq);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hd, T, scale, datt, T, q + oq,
                        ldq, 1.0f, dk + ok, ldk);
        }
    }
    return 0;
}

int moe_cpu_attention_cached(float *out, float *scores, const float *q, const float *kc,
                             const float *vc, int pos, int Hq, int Hkv, int hd) {
    MOE_TRY(check_dims(1, pos + 1, Hq, Hkv, hd));
    const float scale = 1.0f / sqrtf((float)hd);
    const int ldk = Hkv * hd, group = Hq / Hkv, n = pos + 1;
    for (int h = 0; h < Hq; h++) {
        const float *kg = kc + (size_t)(h / group) * hd, *vg = vc + (size_t)(h / group) * hd;
        // scores [n] = scale * K[0..pos] q_h, as the forward's scaled GEMM row
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
