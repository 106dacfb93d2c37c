// Optimizer ops of the CPU table: one AdamW step (Loshchilov & Hutter, arXiv
// 1711.05101; bias-corrected moments, decoupled weight decay), the sum of
// squares behind the gradient norm, and the scaling that clips it. The
// trainer's optimizer (trainer/optim.c) calls these.
#include "kernels/cpu/cpu.h"
#include "moe/error.h"

#include <math.h>

int moe_cpu_adamw(float *params, float *m, float *v, const float *grads, const uint8_t *decay,
                  size_t n, long step, float lr, float beta1, float beta2, float eps,
                  float weight_decay) {
    if (step < 1) return moe_fail(MOE_EINVAL, "adamw: step %ld (1-based)", step);
    double bc1 = 1.0 - pow(beta1, (double)step), bc2 = 1.0 - pow(beta2, (double)step);
    for (size_t i = 0; i < n; i++) {
        float g = grads[i];
        float mi = m[i] = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
        float mhat = (float)(mi / bc1), vhat = (float)(vi / bc2);
        float wd = decay[i] ? weight_decay : 0.0f;
        params[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * params[i]);
    }
    return 0;
}

int moe_cpu_sumsq(double *sumsq, const float *x, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)x[i] * x[i];
    *sumsq = s;
    return 0;
}

int moe_cpu_scale(float *x, size_t n, float s) {
    for (size_t i = 0; i < n; i++)
        x[i] *= s;
    return 0;
}
