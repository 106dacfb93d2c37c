// Rotary position embedding (RoFormer, arXiv 2104.09864), rotate-half layout,
// the twin of kernels/cpu/rope.c: (x_i, x_{i+hd/2}) rotated by
// pos * theta^(-2i/hd) (angle in double, as the CPU); backward rotates by the
// opposite angle and adds. One thread per (row, head, i); in place is allowed
// because each thread reads its two inputs before writing them.
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops_cuda.h"

__global__ static void rope_kernel(float *out, const float *x, int B, int T, int H, int hd,
                                   float theta, float sign, int accumulate) {
    const int half = hd / 2;
    const size_t n = (size_t)B * T * H * half;
    for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(idx % half);
        size_t bth = idx / half; // (bt, h)
        int h = (int)(bth % H);
        size_t bt = bth / H;
        int pos = (int)(bt % T);
        double ang = pos * pow((double)theta, -2.0 * i / hd);
        float c = (float)cos(ang), s = sign * (float)sin(ang);
        size_t o = (bt * H + h) * hd;
        float a = x[o + i], b = x[o + i + half];
        float ra = a * c - b * s, rb = b * c + a * s;
        if (accumulate) {
            out[o + i] += ra;
            out[o + i + half] += rb;
        } else {
            out[o + i] = ra;
            out[o + i + half] = rb;
        }
    }
}

static int rope(float *out, const float *x, int B, int T, int H, int hd, float theta, float sign,
                int accumulate) {
    if (hd % 2) return moe_fail(MOE_EINVAL, "rope: head_dim %d is odd", hd);
    if (B < 0 || T < 0 || H < 0) return moe_fail(MOE_EINVAL, "rope: B=%d T=%d H=%d", B, T, H);
    size_t n = (size_t)B * T * H * (hd / 2);
    if (!n) return 0;
    moe_cuda_ctx c = {};
    MOE_TRY(moe_cuda_ctx_get(&c));
    rope_kernel<<<moe_cuda_blocks(n, 256), 256, 0, c.stream>>>(out, x, B, T, H, hd, theta, sign,
                                                               accumulate);
    CUDA_LAUNCH_CHECK();
    return 0;
}

extern "C" int moe_cuda_rope_forward(float *out, const float *x, int B, int T, int H, int hd,
                                     float theta) {
    return rope(out, x, B, T, H, hd, theta, 1.0f, 0);
}

extern "C" int moe_cuda_rope_backward(float *dx, const float *dout, int B, int T, int H, int hd,
                                      float theta) {
    return rope(dx, dout, B, T, H, hd, theta, -1.0f, 1);
}
