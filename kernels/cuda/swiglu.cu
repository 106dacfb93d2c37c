// SwiGLU (Shazeer 2020) on the fused projection ab [n, 2H] (row i = [a_i | b_i]),
// the CUDA twin of kernels/cpu/swiglu.c:
//   h = silu(a) * b,  silu(a) = a * s,  s = sigmoid(a)
//   da += dh * b * (s + silu * (1 - s)),  db += dh * silu.
// One thread per (i, j) of h; expf is within 2 ulp of the CPU's polynomial.
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops_cuda.h"

__global__ static void swiglu_fwd_kernel(float *h, const float *ab, size_t n, int H) {
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n * H;
         idx += (size_t)gridDim.x * blockDim.x) {
        size_t i = idx / H, j = idx % H;
        float a = ab[i * 2 * H + j], b = ab[i * 2 * H + H + j];
        h[idx] = a / (1.0f + expf(-a)) * b;
    }
}

__global__ static void swiglu_bwd_kernel(float *dab, const float *dh, const float *ab, size_t n,
                                         int H) {
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n * H;
         idx += (size_t)gridDim.x * blockDim.x) {
        size_t i = idx / H, j = idx % H;
        size_t ia = i * 2 * H + j, ib = ia + H;
        float a = ab[ia], b = ab[ib], g = dh[idx];
        float s = 1.0f / (1.0f + expf(-a)), silu = a * s;
        dab[ia] += g * b * (s + silu * (1.0f - s));
        dab[ib] += g * silu;
    }
}

extern "C" int moe_cuda_swiglu_forward(float *h, const float *ab, int n, int H) {
    if (n < 0 || H < 0) return moe_fail(MOE_EINVAL, "swiglu_forward: n=%d H=%d", n, H);
    if (!n || !H) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    size_t total = (size_t)n * H;
    swiglu_fwd_kernel<<<moe_cuda_blocks(total, 256), 256, 0, c.stream>>>(h, ab, n, H);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_swiglu_backward(float *dab, const float *dh, const float *ab, int n,
                                        int H) {
    if (n < 0 || H < 0) return moe_fail(MOE_EINVAL, "swiglu_backward: n=%d H=%d", n, H);
    if (!n || !H) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    size_t total = (size_t)n * H;
    swiglu_bwd_kernel<<<moe_cuda_blocks(total, 256), 256, 0, c.stream>>>(dab, dh, ab, n, H);
    CUDA_LAUNCH_CHECK();
    return 0;
}
