// Causal scaled dot-product attention with grouped-query heads (GQA, arXiv
// 2305.13245), the twin of kernels/cpu/attention.c; it saves the
// probabilities att [B, Hq, T, T] (upper triangle 0) where the CPU keeps only
// the row log-sum-exp, and ignores the forward output backward gets:
//   forward:  S = scale * Q K^T (cuBLAS, batched over the heads of one kv
//             group), causal softmax per row (kernel), O = P V (cuBLAS)
//   backward: dP = dO V^T,  dV += P^T dO,  dS = P * (dP - rowsum(P * dP)),
//             dQ += scale * dS K,  dK += scale * dS^T Q
// The backward runs one (b, h) at a time through the caller's datt [T, T]
// scratch, as the CPU does: heads of one group add into the same dK, dV, so
// the serial order also keeps those sums free of races. Correct first; a fused
// flash-attention kernel is the faster path.
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops_cuda.h"
#include "moe/cuda_sizes.h"

#include <math.h>

// Row-major c [M, N] (ldc) = alpha * op(a) op(b) + beta * c for `batch`
// matrices at fixed strides (see matmul.cu for the operand swap).
static int gemm_strided(cublasHandle_t h, float *c, int ldc, long long sc, const float *a, int lda,
                        long long sa, const float *b, int ldb, long long sb, int M, int N, int K,
                        bool ta, bool tb, float alpha, float beta, int batch) {
    CUBLAS_TRY(cublasSgemmStridedBatched(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, b, ldb,
                                         sb, a, lda, sa, &beta, c, ldc, sc, batch));
    return 0;
}

// One block per row (bh, t) of att: softmax over s <= t (sum in double with the
// row max subtracted), 0 above the diagonal.
__global__ static void causal_softmax_kernel(float *att, size_t rows, int T) {
    __shared__ float shf[32];
    __shared__ double shd[32];
    for (size_t rix = blockIdx.x; rix < rows; rix += gridDim.x) {
        int t = (int)(rix % T);
        float *row = att + rix * T;
        float m = -INFINITY;
        for (int s = threadIdx.x; s <= t; s += blockDim.x)
            m = fmaxf(m, row[s]);
        m = moe_block_max(m, shf);
        double sum = 0.0;
        for (int s = threadIdx.x; s <= t; s += blockDim.x)
            sum += exp((double)row[s] - m);
        sum = moe_block_sum(sum, shd);
        for (int s = threadIdx.x; s < T; s += blockDim.x)
            row[s] = s <= t ? (float)(exp((double)row[s] - m) / sum) : 0.0f;
    }
}

// dS = P * (dP - rowsum(P * dP)) in place on datt [T, T] (dot in double).
__global__ static void softmax_bwd_kernel(float *datt, const float *p, int T) {
    __shared__ double sh[32];
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const float *pr = p + (size_t)t * T;
        float *dr = datt + (size_t)t * T;
        double dot = 0.0;
        for (int s = threadIdx.x; s <= t; s += blockDim.x)
            dot += (double)pr[s] * dr[s];
        dot = moe_block_sum(dot, sh);
        for (int s = threadIdx.x; s < T; s += blockDim.x)
            dr[s] = s <= t ? pr[s] * (dr[s] - (float)dot) : 0.0f;
    }
}

static int check_dims(int B, int T, int Hq, int Hkv, int hd) {
    if (B < 0 || T < 1 || Hq < 1 || Hkv < 1 || hd < 1 || Hq % Hkv)
        return moe_fail(MOE_EINVAL, "attention: B=%d T=%d n_heads=%d n_kv_heads=%d head_dim=%d", B,
                        T, Hq, Hkv, hd);
    return 0;
}

// The probabilities [B, Hq, T, T] and one (b, h)'s dP/dS [T, T] are what the
// kernels above need: moe_cuda_attention_state_floats / _scratch_floats, in
// moe/src/cuda_sizes.c.

// scratch: none needed (att holds the probabilities), so the caller may pass NULL.
extern "C" int moe_cuda_attention_forward(float *out, float *att, float *scratch, const float *q,
                                          const float *k, const float *v, int B, int T, int Hq,
                                          int Hkv, int hd) {
    MOE_TRY(check_dims(B, T, Hq, Hkv, hd));
    if (!B) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    const float scale = 1.0f / sqrtf((float)hd);
    const int ldq = Hq * hd, ldk = Hkv * hd, group = Hq / Hkv;
    const long long TT = (long long)T * T;
    for (int b = 0; b < B; b++)
        for (int g = 0; g < Hkv; g++) {
            // The `group` query heads g*group.. share kv head g: K stride 0.
            const float *qb = q + (size_t)b * T * ldq + (size_t)g * group * hd;
            const float *kb = k + (size_t)b * T * ldk + (size_t)g * hd;
            float *pb = att + ((size_t)b * Hq + (size_t)g * group) * TT;
            MOE_TRY(gemm_strided(c.cublas, pb, T, TT, qb, ldq, hd, kb, ldk, 0, T, T, hd, false,
                                 true, scale, 0.0f, group));
        }
    size_t rows = (size_t)B * Hq * T;
    causal_softmax_kernel<<<moe_cuda_row_blocks(rows), 128, 0, c.stream>>>(att, rows, T);
    CUDA_LAUNCH_CHECK();
    for (int b = 0; b < B; b++)
        for (int g = 0; g < Hkv; g++) {
            const float *pb = att + ((size_t)b * Hq + (size_t)g * group) * TT;
            const float *vb = v + (size_t)b * T * ldk + (size_t)g * hd;
            float *ob = out + (size_t)b * T * ldq + (size_t)g * group * hd;
            MOE_TRY(gemm_strided(c.cublas, ob, ldq, hd, pb, T, TT, vb, ldk, 0, T, hd, T, false,
                                 false, 1.0f, 0.0f, group));
        }
    return 0;
}

extern "C" int moe_cuda_attention_backward(float *dq, float *dk, float *dv, float *datt,
                                           const float *dout, const float *out, const float *att,
                                           const float *q, const float *k, const float *v, int B,
                                           int T, int Hq, int Hkv, int hd) {
    MOE_TRY(check_dims(B, T, Hq, Hkv, hd));
    if (!B) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    const float scale = 1.0f / sqrtf((float)hd);
    const int ldq = Hq * hd, ldk = Hkv * hd, group = Hq / Hkv;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq; h++) {
            size_t oq = (size_t)b * T * ldq + (size_t)h * hd;
            size_t ok = (size_t)b * T * ldk + (size_t)(h / group) * hd;
            const float *p = att + ((size_t)b * Hq + h) * T * T;
            // dP [T, T] = dO_h [T, hd] @ V_g^T
            MOE_TRY(gemm_strided(c.cublas, datt, T, 0, dout + oq, ldq, 0, v + ok, ldk, 0, T, T, hd,
                                 false, true, 1.0f, 0.0f, 1));
            // dV_g [T, hd] += P^T @ dO_h
            MOE_TRY(gemm_strided(c.cublas, dv + ok, ldk, 0, p, T, 0, dout + oq, ldq, 0, T, hd, T,
                                 true, false, 1.0f, 1.0f, 1));
            softmax_bwd_kernel<<<moe_cuda_row_blocks(T), 128, 0, c.stream>>>(datt, p, T);
            CUDA_LAUNCH_CHECK();
            // dQ_h += scale * dS @ K_g;  dK_g += scale * dS^T @ Q_h
            MOE_TRY(gemm_strided(c.cublas, dq + oq, ldq, 0, datt, T, 0, k + ok, ldk, 0, T, hd, T,
                                 false, false, scale, 1.0f, 1));
            MOE_TRY(gemm_strided(c.cublas, dk + ok, ldk, 0, datt, T, 0, q + oq, ldq, 0, T, hd, T,
                                 true, false, scale, 1.0f, 1));
        }
    return 0;
}
