// Elementwise ops of the CUDA table: products (noise multiply and its
// backward), the optimizer step (AdamW, arithmetic as kernels/cpu/adamw.c), the
// sum of squares behind the gradient norm, and scaling for clipping.
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops_cuda.h"

#include <math.h>

#define GRID_STRIDE(i, n)                                                                          \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n);                        \
         i += (size_t)gridDim.x * blockDim.x)

__global__ static void mul_kernel(float *out, const float *a, const float *b, size_t n) {
    GRID_STRIDE(i, n) out[i] = a[i] * b[i];
}

__global__ static void mul_add_kernel(float *out, const float *a, const float *b, size_t n) {
    GRID_STRIDE(i, n) out[i] += a[i] * b[i];
}

__global__ static void add_kernel(float *out, const float *x, size_t n) {
    GRID_STRIDE(i, n) out[i] += x[i];
}

__global__ static void scale_kernel(float *x, size_t n, float s) {
    GRID_STRIDE(i, n) x[i] *= s;
}

// The CPU's per-step constants (kernels/cpu/adamw.c step_job, computed on the
// host in double): step_size = lr / bc1, rsqrt_bc2 = 1 / sqrt(bc2), lr_wd =
// lr * weight_decay, and its expression for the step with the same fused
// multiply-adds written out (kernels/cpu/adamw.c step1), so both tables round
// the same operations.
__global__ static void adamw_kernel(float *params, float *m, float *v, const float *grads,
                                    const uint8_t *decay, size_t n, float step_size,
                                    float rsqrt_bc2, float lr_wd, float beta1, float beta2,
                                    float eps) {
    GRID_STRIDE(i, n) {
        const float g = grads[i];
        const float mi = m[i] = fmaf(beta1, m[i], (1.0f - beta1) * g);
        const float vi = v[i] = fmaf(beta2, v[i], (1.0f - beta2) * g * g);
        const float wd = decay[i] ? lr_wd : 0.0f, p = params[i];
        params[i] = p - fmaf(wd, p, step_size * mi / fmaf(sqrtf(vi), rsqrt_bc2, eps));
    }
}

// Per-block partial sums of squares in double; the host adds the partials in
// block order, so the result is deterministic for a given grid.
__global__ static void sumsq_kernel(double *partial, const float *x, size_t n) {
    __shared__ double sh[32];
    double s = 0.0;
    GRID_STRIDE(i, n) s += (double)x[i] * x[i];
    s = moe_block_sum(s, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

extern "C" int moe_cuda_mul(float *out, const float *a, const float *b, size_t n) {
    if (!n) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    mul_kernel<<<moe_cuda_blocks(n, 256), 256, 0, c.stream>>>(out, a, b, n);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_mul_add(float *out, const float *a, const float *b, size_t n) {
    if (!n) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    mul_add_kernel<<<moe_cuda_blocks(n, 256), 256, 0, c.stream>>>(out, a, b, n);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_add(float *out, const float *x, size_t n) {
    if (!n) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    add_kernel<<<moe_cuda_blocks(n, 256), 256, 0, c.stream>>>(out, x, n);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_scale(float *x, size_t n, float s) {
    if (!n) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    scale_kernel<<<moe_cuda_blocks(n, 256), 256, 0, c.stream>>>(x, n, s);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_adamw(float *params, float *m, float *v, const float *grads,
                              const uint8_t *decay, size_t n, long step, float lr, float beta1,
                              float beta2, float eps, float weight_decay) {
    if (step < 1) return moe_fail(MOE_EINVAL, "adamw: step %ld (1-based)", step);
    if (!n) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    const double bc1 = 1.0 - pow(beta1, (double)step), bc2 = 1.0 - pow(beta2, (double)step);
    adamw_kernel<<<moe_cuda_blocks(n, 256), 256, 0, c.stream>>>(
        params, m, v, grads, decay, n, (float)(lr / bc1), (float)(1.0 / sqrt(bc2)),
        lr * weight_decay, beta1, beta2, eps);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_sumsq(double *sumsq, const float *x, size_t n) {
    *sumsq = 0.0;
    if (!n) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    enum { BLOCKS = 1024, THREADS = 256 };
    unsigned blocks = moe_cuda_blocks(n, THREADS);
    if (blocks > BLOCKS) blocks = BLOCKS;
    double *partial = NULL;
    MOE_TRY(moe_cuda_scratch((void **)&partial, blocks * sizeof(double), c.stream, "sumsq"));
    sumsq_kernel<<<blocks, THREADS, 0, c.stream>>>(partial, x, n);
    cudaError_t launch = cudaGetLastError();
    double host[BLOCKS];
    cudaError_t copy =
        cudaMemcpyAsync(host, partial, blocks * sizeof(double), cudaMemcpyDeviceToHost, c.stream);
    cudaFreeAsync(partial, c.stream);
    CUDA_TRY(launch);
    CUDA_TRY(copy);
    CUDA_TRY(cudaStreamSynchronize(c.stream));
    double s = 0.0;
    for (unsigned b = 0; b < blocks; b++)
        s += host[b];
    *sumsq = s;
    return 0;
}
