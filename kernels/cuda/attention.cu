// Causal scaled dot-product attention with grouped-query heads (GQA, arXiv
// 2305.13245), the twin of kernels/cpu/attention.c; it saves the
// probabilities att [B, Hq, T, T] (upper triangle 0) where the CPU keeps only
// the row log-sum-exp, and ignores the forward output backward gets:
//   forward:  S = scale * Q K^T (cuBLAS, batched over the heads of one kv
//             group), causal softmax per row (kernel), O = P V (cuBLAS)
//   backward: dP = dO V^T,  dV += P^T dO,  dS = P * (dP - rowsum(P * dP)),
//             dQ += scale * dS K,  dK += scale * dS^T Q
// Every GEMM is batched over the batch rows b (or, where that takes fewer
// calls, over the query heads of one kv group) so a layer costs O(n_heads)
// launches, not O(B n_heads). The backward runs one query head at a time,
// batched over b through the caller's datt [B, T, T] scratch: heads of one
// group add into the same dK, dV, so the head order keeps those sums free of
// races and in the CPU's order. A fused flash-attention kernel (no [T, T]
// matrices at all) is the faster path still to come.
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

// dS = P * (dP - rowsum(P * dP)) in place on datt [B, T, T] (dot in double);
// batch row b of P starts p_stride floats after row b - 1.
__global__ static void softmax_bwd_kernel(float *datt, const float *p, size_t p_stride, int B,
                                          int T) {
    __shared__ double sh[32];
    for (size_t rix = blockIdx.x; rix < (size_t)B * T; rix += gridDim.x) {
        const size_t b = rix / T, t = rix % T;
        const float *pr = p + b * p_stride + t * T;
        float *dr = datt + rix * T;
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

// The probabilities [B, Hq, T, T] and one query head's dP/dS [B, T, T] are what the
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
    // Batched over the `group` query heads of one (b, kv head) (K stride 0),
    // or over b for one query head: whichever takes fewer calls.
    const bool by_head = (long long)B * Hkv <= Hq;
    const int calls = by_head ? B * Hkv : Hq, batch = by_head ? group : B;
    const long long sq = by_head ? hd : (long long)T * ldq, sk = by_head ? 0 : (long long)T * ldk;
    const long long sp = by_head ? TT : (long long)Hq * TT;
    for (int i = 0; i < calls; i++) {
        const int b = by_head ? i / Hkv : 0, h = by_head ? (i % Hkv) * group : i;
        const float *qb = q + (size_t)b * T * ldq + (size_t)h * hd;
        const float *kb = k + (size_t)b * T * ldk + (size_t)(h / group) * hd;
        float *pb = att + ((size_t)b * Hq + (size_t)h) * TT;
        MOE_TRY(gemm_strided(c.cublas, pb, T, sp, qb, ldq, sq, kb, ldk, sk, T, T, hd, false, true,
                             scale, 0.0f, batch));
    }
    size_t rows = (size_t)B * Hq * T;
    causal_softmax_kernel<<<moe_cuda_row_blocks(rows), 128, 0, c.stream>>>(att, rows, T);
    CUDA_LAUNCH_CHECK();
    for (int i = 0; i < calls; i++) {
        const int b = by_head ? i / Hkv : 0, h = by_head ? (i % Hkv) * group : i;
        const float *pb = att + ((size_t)b * Hq + (size_t)h) * TT;
        const float *vb = v + (size_t)b * T * ldk + (size_t)(h / group) * hd;
        float *ob = out + (size_t)b * T * ldq + (size_t)h * hd;
        MOE_TRY(gemm_strided(c.cublas, ob, ldq, sq, pb, T, sp, vb, ldk, sk, T, hd, T, false, false,
                             1.0f, 0.0f, batch));
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
    // Each call is batched over b: per-b strides of the [B, T, *] tensors, of
    // the saved P (Hq T T) and of the datt scratch (T T).
    const long long TT = (long long)T * T, sq = (long long)T * ldq, sk = (long long)T * ldk;
    const long long sp = (long long)Hq * TT;
    for (int h = 0; h < Hq; h++) { // head order: the group's dK, dV sums as on the CPU
        const size_t oq = (size_t)h * hd, ok = (size_t)(h / group) * hd;
        const float *p = att + (size_t)h * TT;
        // dP [T, T] = dO_h [T, hd] @ V_g^T
        MOE_TRY(gemm_strided(c.cublas, datt, T, TT, dout + oq, ldq, sq, v + ok, ldk, sk, T, T, hd,
                             false, true, 1.0f, 0.0f, B));
        // dV_g [T, hd] += P^T @ dO_h
        MOE_TRY(gemm_strided(c.cublas, dv + ok, ldk, sk, p, T, sp, dout + oq, ldq, sq, T, hd, T,
                             true, false, 1.0f, 1.0f, B));
        softmax_bwd_kernel<<<moe_cuda_row_blocks((size_t)B * T), 128, 0, c.stream>>>(
            datt, p, (size_t)sp, B, T);
        CUDA_LAUNCH_CHECK();
        // dQ_h += scale * dS @ K_g;  dK_g += scale * dS^T @ Q_h
        MOE_TRY(gemm_strided(c.cublas, dq + oq, ldq, sq, datt, T, TT, k + ok, ldk, sk, T, hd, T,
                             false, false, scale, 1.0f, B));
        MOE_TRY(gemm_strided(c.cublas, dk + ok, ldk, sk, datt, T, TT, q + oq, ldq, sq, T, hd, T,
                             true, false, scale, 1.0f, B));
    }
    return 0;
}
