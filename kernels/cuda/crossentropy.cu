// Softmax cross-entropy over the vocabulary on the GPU, the twin of
// kernels/cpu/crossentropy.c: mean over targets >= 0 (target -1 ignored),
//   loss_n = lse_n - x_n[target_n]  (logsumexp in double, max subtracted)
//   dlogits += dloss * (softmax - onehot) / n_valid
// One block per row. The per-row losses come back to the host in double and
// are summed in row order, so the mean is the CPU's to the last bit of the
// per-row values.
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/ops_cuda.h"

#include <math.h>
#include <stdlib.h>

extern "C" int moe_cuda_check_targets(const int32_t *target, int N, int V, int *n_valid,
                                      int32_t *host);

__device__ static double row_lse(const float *x, int V, float *shf, double *shd) {
    float m = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x)
        m = fmaxf(m, x[v]);
    m = moe_block_max(m, shf);
    double s = 0.0;
    for (int v = threadIdx.x; v < V; v += blockDim.x)
        s += exp((double)x[v] - m);
    s = moe_block_sum(s, shd);
    return m + log(s);
}

__global__ static void ce_fwd_kernel(float *losses, double *dl, const float *logits,
                                     const int32_t *target, int N, int V) {
    __shared__ float shf[32];
    __shared__ double shd[32];
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        const float *x = logits + n * V;
        int t = target[n];
        double lse = row_lse(x, V, shf, shd); // every thread of the block takes part
        if (threadIdx.x == 0) {
            double l = t >= 0 ? lse - x[t] : 0.0;
            losses[n] = (float)l;
            dl[n] = l;
        }
    }
}

__global__ static void ce_bwd_kernel(float *dlogits, const float *logits, const int32_t *target,
                                     int N, int V, double scale) {
    __shared__ float shf[32];
    __shared__ double shd[32];
    for (size_t n = blockIdx.x; n < (size_t)N; n += gridDim.x) {
        int t = target[n];
        if (t < 0) continue; // uniform across the block
        const float *x = logits + n * V;
        float *d = dlogits + n * V;
        double lse = row_lse(x, V, shf, shd);
        for (int v = threadIdx.x; v < V; v += blockDim.x) {
            d[v] += (float)(scale * exp((double)x[v] - lse));
            if (v == t) d[v] -= (float)scale;
        }
    }
}

extern "C" int moe_cuda_crossentropy_forward(float *losses, double *mean, const float *logits,
                                             const int32_t *target, int N, int V) {
    if (N < 0 || V < 1) return moe_fail(MOE_EINVAL, "crossentropy: N=%d V=%d", N, V);
    *mean = 0.0;
    if (!N) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    int rc = 0, n_valid = 0;
    double *dl = NULL, *host = (double *)malloc(N * sizeof(double));
    int32_t *tgt = (int32_t *)malloc(N * sizeof(int32_t));
    if (!host || !tgt) {
        rc = moe_fail(MOE_ENOMEM, "crossentropy: host buffers for %d rows", N);
        goto fail;
    }
    MOE_TRY_GOTO(moe_cuda_check_targets(target, N, V, &n_valid, tgt), rc);
    // (moe_cuda_scratch clears the failed call's error, which the next launch
    // check would otherwise report as its own, and says MOE_ENOMEM)
    MOE_TRY_GOTO(moe_cuda_scratch((void **)&dl, N * sizeof(double), c.stream, "crossentropy"), rc);
    ce_fwd_kernel<<<moe_cuda_row_blocks(N), 256, 0, c.stream>>>(losses, dl, logits, target, N, V);
    {
        // keep the first error: cudaGetLastError clears it, so asking again says "no error"
        cudaError_t e = cudaGetLastError();
        if (e == cudaSuccess)
            e = cudaMemcpyAsync(host, dl, N * sizeof(double), cudaMemcpyDeviceToHost, c.stream);
        if (e == cudaSuccess) e = cudaStreamSynchronize(c.stream);
        if (e != cudaSuccess) {
            cudaGetLastError();
            rc = moe_fail(MOE_EDEVICE, "%s:%d: crossentropy forward: %s", __FILE__, __LINE__,
                          cudaGetErrorString(e));
            goto fail;
        }
    }
    {
        double sum = 0.0;
        for (int n = 0; n < N; n++)
            sum += host[n];
        *mean = n_valid ? sum / n_valid : 0.0;
    }
fail:
    if (dl) cudaFreeAsync(dl, c.stream);
    free(host);
    free(tgt);
    return rc;
}

extern "C" int moe_cuda_crossentropy_backward(float *dlogits, const float *logits,
                                              const int32_t *target, int N, int V, float dloss) {
    if (N < 0 || V < 1) return moe_fail(MOE_EINVAL, "crossentropy: N=%d V=%d", N, V);
    if (!N) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    int32_t *tgt = (int32_t *)malloc(N * sizeof(int32_t));
    if (!tgt) return moe_fail(MOE_ENOMEM, "crossentropy: host buffer for %d targets", N);
    int n_valid = 0, rc = moe_cuda_check_targets(target, N, V, &n_valid, tgt);
    free(tgt);
    MOE_TRY(rc);
    if (!n_valid) return 0;
    double scale = (double)dloss / n_valid;
    ce_bwd_kernel<<<moe_cuda_row_blocks(N), 256, 0, c.stream>>>(dlogits, logits, target, N, V,
                                                                scale);
    CUDA_LAUNCH_CHECK();
    return 0;
}
