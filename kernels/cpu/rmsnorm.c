// RMSNorm (Zhang & Sennrich 2019), fp32: y = x * rsqrt(mean(x^2) + eps) * w.
// Backward with xhat = x * rstd, g = dout * w:
//   dw += sum_n dout * xhat,  dx += rstd * (g - xhat * mean(g * xhat)).
#include "kernels/cpu/nn.h"
#include "moe/error.h"

#include <math.h>

int moe_cpu_rmsnorm_forward(float *out, float *rstd, const float *x, const float *w, int N, int C,
                            float eps) {
    if (N < 0 || C < 1) return moe_fail(MOE_EINVAL, "rmsnorm: N=%d C=%d", N, C);
    for (int n = 0; n < N; n++) {
        const float *xn = x + (size_t)n * C;
        double ss = 0.0;
        for (int c = 0; c < C; c++)
            ss += (double)xn[c] * xn[c];
        float r = (float)(1.0 / sqrt(ss / C + eps));
        rstd[n] = r;
        float *on = out + (size_t)n * C;
        for (int c = 0; c < C; c++)
            on[c] = xn[c] * r * w[c];
    }
    return 0;
}

int moe_cpu_rmsnorm_backward(float *dx, float *dw, const float *dout, const float *x,
                             const float *w, const float *rstd, int N, int C) {
    for (int n = 0; n < N; n++) {
        const float *xn = x + (size_t)n * C, *dn = dout + (size_t)n * C;
        float r = rstd[n];
        double m = 0.0;
        for (int c = 0; c < C; c++)
            m += (double)dn[c] * w[c] * xn[c] * r;
        m /= C;
        float *dxn = dx + (size_t)n * C;
        for (int c = 0; c < C; c++) {
            float xhat = xn[c] * r;
            dw[c] += dn[c] * xhat;
            dxn[c] += r * (dn[c] * w[c] - xhat * (float)m);
        }
    }
    return 0;
}
