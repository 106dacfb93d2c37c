// Cut cross-entropy (Wijmans et al., arXiv 2411.09009): the mean cross-entropy
// of logits = h @ W^T computed block by block, so only a [CCE_NB, CCE_VB]
// scratch tile of logits exists at a time instead of [N, V].
//   forward:  lse_n = logsumexp_v (h_n . w_v), kept online across vocabulary
//             blocks; loss_n = lse_n - h_n . w_target (an indexed dot product)
//   backward: each tile is recomputed; G = (softmax - onehot) * dloss / n_valid;
//             dh += G @ W_blk, dW_blk += G^T @ h_blk. A tile whose softmax
//             entries are all below filter_eps and that holds no target is
//             skipped (gradient filtering, CCE §4.3): its contribution is
//             below float precision of the result.
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/nn.h"
#include "moe/error.h"

#include <math.h>
#include <string.h>

size_t moe_cpu_cce_scratch_floats(void) {
    return (size_t)MOE_CCE_NB * MOE_CCE_VB;
}

static int check(const int32_t *target, int N, int V, int *n_valid) {
    *n_valid = 0;
    for (int n = 0; n < N; n++) {
        if (target[n] < -1 || target[n] >= V)
            return moe_fail(MOE_EINVAL, "target %d at position %d is outside the vocabulary (%d)",
                            target[n], n, V);
        *n_valid += target[n] >= 0;
    }
    return 0;
}

int moe_cpu_cce_forward(float *losses, float *lse, double *mean, const float *h, const float *W,
                        const int32_t *target, int N, int D, int V, float *scratch) {
    int n_valid;
    MOE_TRY(check(target, N, V, &n_valid));
    double sum = 0.0;
    for (int n0 = 0; n0 < N; n0 += MOE_CCE_NB) {
        const int nb = N - n0 < MOE_CCE_NB ? N - n0 : MOE_CCE_NB;
        float m[MOE_CCE_NB];
        double s[MOE_CCE_NB];
        for (int i = 0; i < nb; i++)
            m[i] = -INFINITY, s[i] = 0.0;
        for (int v0 = 0; v0 < V; v0 += MOE_CCE_VB) {
            const int vb = V - v0 < MOE_CCE_VB ? V - v0 : MOE_CCE_VB;
            moe_cpu_sgemm(false, true, nb, vb, D, 1.0f,
                        h + (size_t)n0 * D, D, W + (size_t)v0 * D, D, 0.0f, scratch, vb);
            for (int i = 0; i < nb; i++) { // online logsumexp over the vocabulary
                const float *row = scratch + (size_t)i * vb;
                float bm = m[i];
                for (int j = 0; j < vb; j++)
                    if (row[j] > bm) bm = row[j];
                double acc = s[i] * exp((double)m[i] - bm);
                for (int j = 0; j < vb; j++)
                    acc += exp((double)row[j] - bm);
                m[i] = bm, s[i] = acc;
            }
        }
        for (int i = 0; i < nb; i++) {
            const int n = n0 + i;
            lse[n] = (float)(m[i] + log(s[i]));
            losses[n] = 0.0f;
            if (target[n] < 0) continue;
            const float *hn = h + (size_t)n * D, *wt = W + (size_t)target[n] * D;
            float logit = 0.0f;
            for (int d = 0; d < D; d++)
                logit += hn[d] * wt[d];
            losses[n] = lse[n] - logit;
            sum += losses[n];
        }
    }
    *mean = n_valid ? sum / n_valid : 0.0;
    return 0;
}

int moe_cpu_cce_backward(float *dh, float *dW, const float *h, const float *W,
                         const int32_t *target, const float *lse, int N, int D, int V, float dloss,
                         float filter_eps, float *scratch, long *skipped) {
    int n_valid;
    MOE_TRY(check(target, N, V, &n_valid));
    if (!n_valid) return 0;
    const float scale = dloss / (float)n_valid;
    for (int n0 = 0; n0 < N; n0 += MOE_CCE_NB) {
        const int nb = N - n0 < MOE_CCE_NB ? N - n0 : MOE_CCE_NB;
        for (int v0 = 0; v0 < V; v0 += MOE_CCE_VB) {
            const int vb = V - v0 < MOE_CCE_VB ? V - v0 : MOE_CCE_VB;
            moe_cpu_sgemm(false, true, nb, vb, D, 1.0f,
                        h + (size_t)n0 * D, D, W + (size_t)v0 * D, D, 0.0f, scratch, vb);
            int live = 0;
            for (int i = 0; i < nb; i++) {
                const int n = n0 + i;
                float *row = scratch + (size_t)i * vb;
                if (target[n] < 0) { // ignored token: no gradient
                    memset(row, 0, sizeof(float) * vb);
                    continue;
                }
                for (int j = 0; j < vb; j++) {
                    float p = expf(row[j] - lse[n]);
                    live |= p >= filter_eps;
                    row[j] = p * scale;
                }
                int t = target[n] - v0;
                if (t >= 0 && t < vb) {
                    row[t] -= scale;
                    live = 1;
                }
            }
            if (!live) { // every probability below filter_eps, no target here
                if (skipped) (*skipped)++;
                continue;
            }
            moe_cpu_sgemm(false, false, nb, D, vb, 1.0f, scratch, vb,
                        W + (size_t)v0 * D, D, 1.0f, dh + (size_t)n0 * D, D);
            moe_cpu_sgemm(true, false, vb, D, nb, 1.0f, scratch, vb,
                        h + (size_t)n0 * D, D, 1.0f, dW + (size_t)v0 * D, D);
        }
    }
    return 0;
}
