// Router noise on the GPU (kernels/cuda/router_cuda.h): Switch jitter of the
// router input, keyed as router/noise.c, and the samples the host-device
// equality test reads back. Gumbel sampling itself lives in the top-k kernel
// (kernels/cuda/router.cu).
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/noise.cuh"
#include "kernels/cuda/router_cuda.h"

// x[i] = (float)(x[i] * factor_i), or (float)factor_i without an input (the
// MoE layer's factors, router/noise.c applied to ones).
__global__ static void jitter_kernel(float *out, const float *in, size_t n, double eps,
                                     uint64_t seed, uint64_t step) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        double f = moe_dev_jitter_factor(eps, seed, step, i);
        out[i] = (float)(in ? __dmul_rn((double)in[i], f) : f);
    }
}

extern "C" int moe_cuda_router_jitter(float *out, const float *in, size_t n, double eps,
                                      uint64_t seed, uint64_t step) {
    if (!n) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    jitter_kernel<<<moe_cuda_blocks(n, 256), 256, 0, c.stream>>>(out, in, n, eps, seed, step);
    CUDA_LAUNCH_CHECK();
    return 0;
}

__global__ static void samples_kernel(uint64_t *hash, double *uniform, double *gumbel, size_t n,
                                      uint64_t seed, uint64_t step) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        hash[i] = moe_hash4(seed, step, 1, i);
        uniform[i] = moe_dev_noise_uniform(seed, step, 1, i);
        gumbel[i] = moe_dev_noise_gumbel(seed, step, i);
    }
}

extern "C" int moe_cuda_noise_samples(uint64_t *hash, double *uniform, double *gumbel, size_t n,
                                      uint64_t seed, uint64_t step) {
    if (!n) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    samples_kernel<<<moe_cuda_blocks(n, 256), 256, 0, c.stream>>>(hash, uniform, gumbel, n, seed,
                                                                  step);
    CUDA_LAUNCH_CHECK();
    return 0;
}
