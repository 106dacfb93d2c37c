// RMSNorm (Zhang & Sennrich 2019) on the GPU, the twin of kernels/cpu/rmsnorm.c:
//   y = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps)  (sum in double)
//   dx += rstd * (g - xhat * mean(g * xhat)),  g = dout * w,  xhat = x * rstd
//   dw += sum_n dout * xhat
// One block per row. dw in two deterministic stages, no atomics: partial sums
// over blocks of DW_ROWS rows (one thread per column and row block, the
// whole GPU busy), then one thread per column adds them in block order. One
// thread per column walking all N rows left C threads for N * C products:
// 4096 threads walking 16384 rows each at D 4096, T 16384.
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops_cuda.h"

__global__ static void rmsnorm_fwd_kernel(float *out, float *rstd, const float *x, const float *w,
                                          int N, int C, float eps) {
    __shared__ double sh[32];
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        const float *xn = x + n * C;
        double ss = 0.0;
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            ss += (double)xn[c] * xn[c];
        ss = moe_block_sum(ss, sh);
        float r = (float)(1.0 / sqrt(ss / C + eps));
        if (threadIdx.x == 0) rstd[n] = r;
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            out[n * C + c] = xn[c] * r * w[c];
    }
}

__global__ static void rmsnorm_bwd_dx_kernel(float *dx, const float *dout, const float *x,
                                             const float *w, const float *rstd, int N, int C) {
    __shared__ double sh[32];
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        const float *xn = x + n * C, *dn = dout + n * C;
        float r = rstd[n];
        double m = 0.0;
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            m += (double)dn[c] * w[c] * xn[c] * r;
        m = moe_block_sum(m, sh) / C;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float xhat = xn[c] * r;
            dx[n * C + c] += r * (dn[c] * w[c] - xhat * (float)m);
        }
    }
}

enum { DW_ROWS = 64 }; // rows per partial sum of dw (more past 65535 row blocks)

// part[b * C + c] = sum over rows n of block b (in order) of dout * xhat.
__global__ static void rmsnorm_bwd_dw_part_kernel(float *part, const float *dout, const float *x,
                                                  const float *rstd, int N, int C, int rows) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y;
    if (c >= C) return;
    const int n1 = (int)min((long long)N, (long long)(b + 1) * rows);
    float acc = 0.0f;
    for (int n = b * rows; n < n1; n++)
        acc += dout[(size_t)n * C + c] * (x[(size_t)n * C + c] * rstd[n]);
    part[(size_t)b * C + c] = acc;
}

// dw[c] += the partials of column c, in block order.
__global__ static void rmsnorm_bwd_dw_sum_kernel(float *dw, const float *part, int blocks, int C) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x) {
        float acc = dw[c];
        for (int b = 0; b < blocks; b++)
            acc += part[(size_t)b * C + c];
        dw[c] = acc;
    }
}

extern "C" int moe_cuda_rmsnorm_forward(float *out, float *rstd, const float *x, const float *w,
                                        int N, int C, float eps) {
    if (N < 0 || C < 1) return moe_fail(MOE_EINVAL, "rmsnorm: N=%d C=%d", N, C);
    if (!N) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    rmsnorm_fwd_kernel<<<moe_cuda_row_blocks(N), 256, 0, c.stream>>>(out, rstd, x, w, N, C, eps);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_rmsnorm_backward(float *dx, float *dw, const float *dout, const float *x,
                                         const float *w, const float *rstd, int N, int C) {
    if (N < 0 || C < 1) return moe_fail(MOE_EINVAL, "rmsnorm: N=%d C=%d", N, C);
    if (!N) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    rmsnorm_bwd_dx_kernel<<<moe_cuda_row_blocks(N), 256, 0, c.stream>>>(dx, dout, x, w, rstd, N, C);
    CUDA_LAUNCH_CHECK();
    const int rows = N / 65535 + 1 > DW_ROWS ? N / 65535 + 1 : DW_ROWS; // grid.y <= 65535
    const int blocks = (N + rows - 1) / rows;
    const size_t bytes = (size_t)blocks * C * sizeof(float);
    float *part = NULL;
    MOE_TRY(moe_cuda_scratch((void **)&part, bytes, c.stream, "rmsnorm backward"));
    const dim3 grid((unsigned)((C + 127) / 128), (unsigned)blocks);
    rmsnorm_bwd_dw_part_kernel<<<grid, 128, 0, c.stream>>>(part, dout, x, rstd, N, C, rows);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) {
        rmsnorm_bwd_dw_sum_kernel<<<moe_cuda_blocks(C, 128), 128, 0, c.stream>>>(dw, part, blocks,
                                                                                 C);
        e = cudaGetLastError();
    }
    return moe_cuda_scratch_end(part, c.stream, e, "rmsnorm backward");
}
